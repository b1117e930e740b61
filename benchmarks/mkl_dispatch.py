"""The prefill with MKL's CPU-specific code (engine.mkl_dispatch, on AMD CPUs) against MKL's generic code, in fresh
processes taking turns (the order alternating pair by pair), so the machine's drift does not decide the ratio.

Each process loads the default model, reads a document of each length once to warm up, then times its TTFT (the
whole prefill of a document and a question, one token out) `--reps` times; the median per process, then per
pair the generic process's TTFT over the one with MKL's CPU-specific code. Also the float32 matrix products of one
512-token prefill chunk of the default model's layer shapes alone, timed in the same processes. The two differ only
in DSV41_MKL_INTEL_PATHS=0.

Usage: python -m benchmarks.mkl_dispatch [--pairs 6] [--tokens 1024,4096] [--reps 3] [--folder mkl-dispatch]
Writes results/<folder>/<folder>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import engine  # noqa: F401 - before torch, as the app and the CLI import it (engine.mkl_dispatch)

ROOT = Path(__file__).resolve().parents[1]
# the default model's products in a prefill chunk: q/k/v joined, o, gate/up joined, down (rows, columns)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
CHUNK = 512


def child(tokens: list[int], reps: int) -> dict:
    """One process's figures."""
    import torch

    from benchmarks.speed import document_prompt
    from benchmarks.speed.core import engine_turn
    from engine import DSV41Config, DSV41Model, mkl_dispatch

    model = DSV41Model.from_pretrained(DSV41Config(kv_cache_ratio=1.0, csa2_topk=0, max_seq_len=8192))
    out = {"code_path": mkl_dispatch.code_path(), "status": mkl_dispatch.status(), "threads": torch.get_num_threads(),
           "ttft_s": {}}
    weights = [torch.randn(rows, cols) for rows, cols in SHAPES]
    xs = [torch.randn(CHUNK, cols) for _, cols in SHAPES]

    def products() -> float:
        started = time.perf_counter()
        for x, w in zip(xs, weights, strict=True):
            torch.nn.functional.linear(x, w)
        return time.perf_counter() - started

    for _ in range(5):
        products()
    out["chunk_products_s"] = statistics.median(products() for _ in range(41))
    for n in tokens:
        ids, q = document_prompt(model, n)
        engine_turn(model, ids, q, 1)
        out["ttft_s"][str(n)] = statistics.median(engine_turn(model, ids, q, 1)["ttft_s"] for _ in range(reps))
    return out


def run_child(generic: bool, tokens: list[int], reps: int) -> dict:
    env = dict(os.environ)
    env.pop("DSV41_MKL_INTEL_PATHS", None)
    if generic:
        env["DSV41_MKL_INTEL_PATHS"] = "0"
    done = subprocess.run([sys.executable, "-m", "benchmarks.mkl_dispatch", "--child", ",".join(map(str, tokens)),
                           "--reps", str(reps)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--folder", default="mkl-dispatch")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child([int(t) for t in args.child.split(",")], args.reps)))
        return 0
    from engine import mkl_dispatch

    from .common import machine, write_results

    if mkl_dispatch.cpu_vendor() != "AuthenticAMD":
        print(f"Not an AMD CPU ({mkl_dispatch.cpu_vendor()}): MKL chooses its own code here; nothing to compare.")
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    pairs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {("generic" if g else "specific"): run_child(g, tokens, args.reps) for g in order}
        pairs.append(runs)
        g, s = runs["generic"], runs["specific"]
        print(f"pair {i + 1}: products {g['chunk_products_s'] * 1e3:.1f} / {s['chunk_products_s'] * 1e3:.1f} ms; "
              + "; ".join(f"TTFT {n}: {g['ttft_s'][str(n)]:.2f} / {s['ttft_s'][str(n)]:.2f} s" for n in tokens),
              flush=True)

    def ratios(key, n=None):
        pick = (lambda r: r[key]) if n is None else (lambda r: r[key][str(n)])
        return [pick(p["generic"]) / pick(p["specific"]) for p in pairs]

    summary = {"chunk_products": ratios("chunk_products_s")}
    summary.update({f"ttft_{n}": ratios("ttft_s", n) for n in tokens})
    payload = {"machine": machine(), "pairs": pairs, "tokens": tokens, "reps": args.reps,
               "code_paths": {"generic": pairs[0]["generic"]["code_path"],
                              "specific": pairs[0]["specific"]["code_path"]},
               "ratio_generic_over_specific": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                               for k, v in summary.items()}}
    m = payload["machine"]
    lines = [f"MKL's CPU-specific code (code path {payload['code_paths']['specific']}) against its generic code "
             f"(code path {payload['code_paths']['generic']}) on {m.get('cpu', 'this CPU')}, "
             f"{pairs[0]['specific']['threads']} threads, the default model; {args.pairs} pairs of fresh processes "
             f"taking turns, medians of {args.reps} TTFTs per process", "",
             "| what | generic | CPU-specific | generic / CPU-specific, median (range) |", "|---|---|---|---|"]

    def row(label, key, n=None, unit="ms", scale=1e3):
        pick = (lambda r: r[key]) if n is None else (lambda r: r[key][str(n)])
        g = statistics.median(pick(p["generic"]) for p in pairs) * scale
        s = statistics.median(pick(p["specific"]) for p in pairs) * scale
        r = payload["ratio_generic_over_specific"]["chunk_products" if n is None else f"ttft_{n}"]
        lines.append(f"| {label} | {g:.1f} {unit} | {s:.1f} {unit} | ×{r['median']:.2f} "
                     f"({r['min']:.2f}–{r['max']:.2f}) |")

    row(f"float32 products of one {CHUNK}-token chunk's layer (four shapes)", "chunk_products_s")
    for n in tokens:
        row(f"TTFT, {n:,}-token document", "ttft_s", n, "s", 1.0)
    folder = write_results(args.folder, payload, "\n".join(lines) + "\n")
    _plot(payload, folder, args.folder)
    print("\n".join(lines))
    print(f"wrote {folder}")
    return 0


def _plot(p: dict, folder: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(p["ratio_generic_over_specific"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, key in enumerate(keys):
        values = ([pr["generic"]["chunk_products_s"] / pr["specific"]["chunk_products_s"] for pr in p["pairs"]]
                  if key == "chunk_products" else
                  [pr["generic"]["ttft_s"][key[5:]] / pr["specific"]["ttft_s"][key[5:]] for pr in p["pairs"]])
        ax.scatter([i] * len(values), values, alpha=0.7)
        ax.hlines(statistics.median(values), i - 0.2, i + 0.2, color="black")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)), [k.replace("ttft_", "TTFT ").replace("chunk_products", "chunk products")
                                     for k in keys])
    ax.set_ylabel("generic / CPU-specific time")
    ax.set_title(f"MKL on {p['machine'].get('cpu', 'this CPU')}: per pair of processes")
    fig.tight_layout()
    fig.savefig(folder / f"{name}.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
