"""What holding the weights as bf16 for our CPU kernels (engine/cpu_kernels.c) brings, and what it costs.

1. matvec: every weight matrix of one decode step of the default model's shape (30 layers + the tied
   LM head, 134.5M weights), streamed from memory, through torch float32 mv, torch bf16 mv, our bf16
   kernel (float32 accumulation) and our int8 kernel (scale per row): ms per step and GB/s. Medians of 21.
2. step: the default model, dense, 1,024-token context: the prefill of those 1,024 tokens (two 512-token
   chunks) and one decode step (60 steps, median of the last 50), for the default load (weights held as
   bf16, prefill products and attention in bf16, the fused C decode step), the same with the per-op Python
   decode step, with a float32 prefill, dtype="float32" (float32-held), dtype="bfloat16" (bf16 activations and KV)
   and weight_quant="int8" (our per-row int8), in one process, interleaved three times.
3. quality: perplexity of 2,048 tokens of each of four speeches, uncompressed and CED-evict at ratio 0.5,
   the default load, the default load with a float32 prefill, and int8, against float32-held
   weights (the default model is a Q4_1/Q8_0 checkpoint; bf16 rounds its dequantized values).

Writes results/cpu-kernels/cpu-kernels.json and .md.   Usage: python -m benchmarks.cpu_kernels [--sections ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import DSV41Config, DSV41Model, cpu_kernels
from engine.models import adapter

from .common import RESULTS, machine, write_results
from .corpus import speech
from .quality import _ratio_keys

LAYERS, HIDDEN, INTERMEDIATE, QKV_ROWS, VOCAB = 30, 576, 1536, 960, 49152
SPEECHES = ["2024-Biden-1", "2016-Obama-1", "1962-Kennedy-1", "2019-Trump-1"]


def _median_ms(fn, reps: int = 21) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matvec_section() -> dict:
    torch.manual_seed(0)
    shapes = [(QKV_ROWS, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    fp32 = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for o, i in shapes] + [torch.randn(VOCAB, HIDDEN) * 0.02]
    weights = sum(w.numel() for w in fp32)
    xs = {n: torch.randn(n) for n in (HIDDEN, INTERMEDIATE)}
    bf16 = [w.bfloat16() for w in fp32]
    xb = {n: x.bfloat16() for n, x in xs.items()}
    variants = {
        "torch float32 mv": (lambda: [torch.mv(w, xs[w.shape[1]]) for w in fp32], 4),
        "torch bf16 mv": (lambda: [torch.mv(w, xb[w.shape[1]]) for w in bf16], 2),
    }
    if cpu_kernels.load() is not None:
        packed = [cpu_kernels.PackedMatrix(w.contiguous()) for w in bf16]
        outs = {w.shape[0]: torch.empty(w.shape[0]) for w in fp32}
        variants["ours, bf16 weights (float32 accumulation)"] = (
            lambda: [p.matvec(xs[p.shape[1]], outs[p.shape[0]]) for p in packed], 2)
        int8 = []
        for w in fp32:
            scale = w.abs().amax(dim=1) / 127
            int8.append(cpu_kernels.PackedMatrix(torch.round(w / scale[:, None]).to(torch.int8).contiguous(), scale))
        variants["ours, int8 weights (row scales)"] = (
            lambda: [p.matvec(xs[p.shape[1]], outs[p.shape[0]]) for p in int8], 1)
    out = {"weights": weights, "variants": {}}
    for name, (fn, element_bytes) in variants.items():
        ms = _median_ms(fn)
        out["variants"][name] = {"ms": ms, "bytes": weights * element_bytes, "gb_s": weights * element_bytes / ms / 1e6}
        print(f"[matvec] {name}: {ms:.2f} ms, {out['variants'][name]['gb_s']:.1f} GB/s", flush=True)
    return out


def _decode_ms(model: DSV41Model, ids: torch.Tensor, steps: int = 60) -> tuple[float, float]:
    """(prefill ms of ids, median decode step ms)."""
    cache = model.new_cache()
    started = time.perf_counter()
    for start in range(0, ids.shape[1], 512):
        logits = adapter.forward(model.hf_model, ids[:, start:start + 512], cache)
    prefill_ms = (time.perf_counter() - started) * 1e3
    token = torch.tensor([[int(logits[0, -1].argmax())]])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = adapter.forward(model.hf_model, token, cache, prefill=False)
        times.append(time.perf_counter() - started)
        token = torch.tensor([[int(logits[0, -1].argmax())]])
    return prefill_ms, statistics.median(times[10:]) * 1e3


class _Variant:
    """A loaded model with a switch applied around each use (the per-op step, float32 prefill products)."""

    def __init__(self, model: DSV41Model, per_op: bool = False, prefill_bf16: bool | None = None):
        self.model, self.per_op, self.prefill_bf16 = model, per_op, prefill_bf16

    def __enter__(self) -> DSV41Model:
        hf = self.model.hf_model
        self._fused = adapter.runtime(hf).decoder and adapter.runtime(hf).decoder.fused
        self._prefill = adapter.prefill_bf16(hf)
        if self.per_op and self._fused is not None:
            adapter.runtime(hf).decoder.fused = None
        if self.prefill_bf16 is not None:
            adapter.set_prefill_bf16(hf, self.prefill_bf16)
        return self.model

    def __exit__(self, *exc) -> None:
        hf = self.model.hf_model
        if self._fused is not None:
            adapter.runtime(hf).decoder.fused = self._fused
        adapter.set_prefill_bf16(hf, self._prefill)


def step_section() -> dict:
    knobs = dict(kv_cache_ratio=1.0, csa2_topk=0)
    default = DSV41Model.from_pretrained(DSV41Config(**knobs))
    variants = {
        "default (bf16-held, bf16 prefill, fused step)": _Variant(default),
        "default, per-op Python decode step": _Variant(default, per_op=True),
        "default, float32 prefill": _Variant(default, prefill_bf16=False),
        "float32-held (dtype=float32)": _Variant(DSV41Model.from_pretrained(DSV41Config(dtype="float32", **knobs))),
        "float32-held, per-op Python decode step": None,
        "bf16 activations and KV (dtype=bfloat16)": _Variant(
            DSV41Model.from_pretrained(DSV41Config(dtype="bfloat16", **knobs))),
        "int8 (weight_quant=int8)": _Variant(DSV41Model.from_pretrained(DSV41Config(weight_quant="int8", **knobs))),
    }
    variants["float32-held, per-op Python decode step"] = _Variant(variants["float32-held (dtype=float32)"].model,
                                                                  per_op=True)
    ids = default.tokenizer(speech("2024-Biden-1"), return_tensors="pt")["input_ids"][:, :1024]
    runs: dict = {name: [] for name in variants}
    for _ in range(3):
        for name, variant in variants.items():
            with variant as model:
                runs[name].append(_decode_ms(model, ids))
            print(f"[step] {name}: prefill {runs[name][-1][0]:.0f} ms, step {runs[name][-1][1]:.1f} ms", flush=True)
    return {name: {"ms": statistics.median(r[1] for r in v), "prefill_ms": statistics.median(r[0] for r in v),
                   "runs": v, "weights_mib": variants[name].model.weights_bytes / 2**20,
                   "weight_storage": variants[name].model.info.weight_storage or "float32"}
            for name, v in runs.items()}


def quality_section() -> dict:
    from .quality import perplexity

    out: dict = {}
    default = DSV41Model.from_pretrained(DSV41Config())
    for label, variant in (("default (bf16-held, bf16 prefill)", lambda: _Variant(default)),
                           ("bf16-held, float32 prefill", lambda: _Variant(default, prefill_bf16=False)),
                           ("float32-held (dtype=float32)",
                            lambda: _Variant(DSV41Model.from_pretrained(DSV41Config(dtype="float32")))),
                           ("int8 (weight_quant=int8)",
                            lambda: _Variant(DSV41Model.from_pretrained(DSV41Config(weight_quant="int8"))))):
        with variant() as model:
            tok = model.tokenizer
            for name in SPEECHES:
                ids = tok(speech(name), add_special_tokens=False)["input_ids"][:2048]
                for ratio in (1.0, 0.5):
                    model.config = model.config.replace(kv_cache_ratio=ratio, csa2_topk=0, ced_threshold=0.0,
                                                        ced_policy="ced", ced_mode="evict")
                    value = perplexity(model, ids)
                    out.setdefault(label, {}).setdefault(name, {})[ratio] = value
                    print(f"[quality] {label} {name} {ratio}: {value:.3f}", flush=True)
    return out


def _table(p: dict) -> str:
    out = []
    if "matvec" in p:
        m = p["matvec"]
        out += [f"Every weight matrix of one decode step ({m['weights'] / 1e6:.1f}M weights), medians of 21\n",
                "| kernel | ms per step | GB/s |", "|---|---|---|"]
        out += [f"| {name} | {v['ms']:.2f} | {v['gb_s']:.1f} |" for name, v in m["variants"].items()]
    if "step" in p:
        s = p["step"]
        out += ["", "Default model, dense: prefill of 1,024 tokens and one decode step at that context (medians)\n",
                "| variant | prefill ms | ms per decode step | weights MiB |", "|---|---|---|---|"]
        out += [f"| {name} | {v['prefill_ms']:.0f} | {v['ms']:.1f} | {v['weights_mib']:.0f} |" if "prefill_ms" in v
                else f"| {name} | | {v['ms']:.1f} | {v['weights_mib']:.0f} |" for name, v in s.items()]
    if "quality" in p:
        q = p["quality"]
        labels = list(q)
        base = "float32-held (dtype=float32)"
        others = [label for label in labels if label != base]
        out += ["", "Perplexity, 2,048 tokens per speech, against float32-held weights\n",
                f"| speech | ratio | {base} | " + " | ".join(others) + " |", "|---" * (len(others) + 3) + "|"]
        for name in q[base]:
            for ratio in q[base][name]:
                b = q[base][name][ratio]
                cells = [f"{q[label][name][ratio]:.3f} ({(q[label][name][ratio] / b - 1) * 100:+.2f} %)" for label in others]
                out.append(f"| {name} | {ratio} | {b:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="matvec,step,quality")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    previous = RESULTS / "cpu-kernels" / "cpu-kernels.json"
    payload = _ratio_keys(json.loads(previous.read_text())) if previous.exists() else {}
    payload["machine"] = machine()
    payload["threads"] = torch.get_num_threads()
    library = cpu_kernels.load()
    payload["kernels"] = {"isa": library.isa} if library else {"unavailable": cpu_kernels.unavailable_reason()}
    if "matvec" in sections:
        payload["matvec"] = matvec_section()
    if "step" in sections:
        payload["step"] = step_section()
    if "quality" in sections:
        payload["quality"] = quality_section()
    write_results("cpu-kernels", payload, _table(payload))
    print(_table(payload))


if __name__ == "__main__":
    main()
