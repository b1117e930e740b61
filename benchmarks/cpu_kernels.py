"""What holding the weights as bf16 for our CPU kernels (engine/cpu_kernels.c) brings, and what it costs.

1. matvec: every weight matrix of one decode step of the default model's shape (30 layers + the tied
   LM head, 134.5M weights), streamed from memory, through torch float32 mv, torch bf16 mv, our bf16
   kernel (float32 accumulation) and our int8 kernel (scale per row): ms per step and GB/s. Medians of 21.
2. step: the default model, dense, 1,024-token context, one decode step (60 steps, median of the last 50),
   weights held as bf16 (the default load), dtype="float32" (float32-held) and weight_quant="int8" (our
   per-row int8), in one process, interleaved three times.
3. quality: perplexity of 2,048 tokens of each of four speeches, uncompressed and CED-evict at ratio 0.5,
   bf16-held and int8 against float32-held weights (the default model is a Q4_1/Q8_0 checkpoint; bf16
   rounds its dequantized values).

Writes results/cpu-kernels/cpu-kernels.json and .md.   Usage: python -m benchmarks.cpu_kernels [--sections ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import DSV41Config, DSV41Model, cpu_kernels
from engine.cache import adapter

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


def _decode_ms(model: DSV41Model, ids: torch.Tensor, steps: int = 60) -> float:
    cache = model.new_cache()
    for start in range(0, ids.shape[1], 512):
        logits = adapter.forward(model.hf_model, ids[:, start:start + 512], cache)
    token = torch.tensor([[int(logits[0, -1].argmax())]])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = adapter.forward(model.hf_model, token, cache, prefill=False)
        times.append(time.perf_counter() - started)
        token = torch.tensor([[int(logits[0, -1].argmax())]])
    return statistics.median(times[10:]) * 1e3


def step_section() -> dict:
    models = {"bf16-held (default)": DSV41Model.from_pretrained(DSV41Config(kv_cache_ratio=1.0, csa2_topk=0)),
              "float32-held (dtype=float32)": DSV41Model.from_pretrained(
                  DSV41Config(kv_cache_ratio=1.0, csa2_topk=0, dtype="float32")),
              "int8 (weight_quant=int8)": DSV41Model.from_pretrained(
                  DSV41Config(kv_cache_ratio=1.0, csa2_topk=0, weight_quant="int8"))}
    ids = models["bf16-held (default)"].tokenizer(speech("2024-Biden-1"), return_tensors="pt")["input_ids"][:, :1024]
    runs: dict = {name: [] for name in models}
    for _ in range(3):
        for name, model in models.items():
            runs[name].append(_decode_ms(model, ids))
            print(f"[step] {name}: {runs[name][-1]:.1f} ms", flush=True)
    return {name: {"ms": statistics.median(v), "runs": v, "weights_mib": models[name].weights_bytes / 2**20,
                   "weight_storage": models[name].info.weight_storage or "float32"} for name, v in runs.items()}


def quality_section() -> dict:
    from .quality import perplexity

    out: dict = {}
    for label, dtype, quant in (("bf16-held (default)", "auto", "none"),
                                ("float32-held (dtype=float32)", "float32", "none"),
                                ("int8 (weight_quant=int8)", "auto", "int8")):
        model = DSV41Model.from_pretrained(DSV41Config(dtype=dtype, weight_quant=quant))
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
        out += ["", "Default model, dense, 1,024-token context: one decode step (median)\n",
                "| weights | ms per step | weights MiB |", "|---|---|---|"]
        out += [f"| {name} | {v['ms']:.1f} | {v['weights_mib']:.0f} |" for name, v in s.items()]
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
