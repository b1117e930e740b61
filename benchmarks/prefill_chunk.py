"""Time to first token and a turn's peak memory against the prefill chunk on a CPU: the default model held as its
GGUF blocks (dequantised to bf16 per chunk) and held as bf16, in one process, every configuration taking turns
pair by pair (which goes first alternates), so the machine's drift does not decide the ratios; the peak of an
8,000-token turn in a fresh process per chunk size (VmHWM, loading included, dense and at the defaults).

Usage: python -m benchmarks.prefill_chunk [--context 4096] [--pairs 3] [--chunks 512,1024,2048]
Writes results/prefill-chunk/prefill-chunk.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from .common import machine, write_results
from .gguf_llamacpp import THREADS, prompts


def _model(blocks: bool, ratio: float = 1.0, chunk: int | None = None):
    from engine import DSV41Config, DSV41Model

    os.environ["DSV41_GGUF_BLOCKS"] = "1" if blocks else "0"
    return DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=ratio,
                                                  prefill_chunk=chunk))


def _high_water() -> int:
    """This process's peak resident bytes (VmHWM: unlike ru_maxrss it does not carry the parent's peak over exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak_worker(chunk: int, ratio: float) -> None:
    from .speed.core import engine_turn

    torch.set_num_threads(THREADS)
    model = _model(True, ratio, chunk)
    ids, question = prompts(8000)
    loaded = _high_water()
    turn = engine_turn(model, ids, question, 8)
    print(json.dumps({"loaded_peak": loaded, "peak": _high_water(), "ttft_s": turn["ttft_s"]}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_chunk")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--chunks", default="512,1024,2048")
    parser.add_argument("--peak-worker", nargs=2, metavar=("CHUNK", "RATIO"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_worker:
        _peak_worker(int(args.peak_worker[0]), float(args.peak_worker[1]))
        return 0

    from .speed.core import engine_turn

    torch.set_num_threads(THREADS)
    chunks = [int(c) for c in args.chunks.split(",")]
    gguf, bf16 = _model(True), _model(False)
    ids, question = prompts(args.context)
    configs = [(f"GGUF blocks, chunk {c}", gguf, c) for c in chunks] + [(f"bf16-held, chunk {c}", bf16, c)
                                                                        for c in chunks[:2]]
    for model in (gguf, bf16):
        engine_turn(model, ids[:600], 16, 2)  # warm-up
    ttft = {name: [] for name, _, _ in configs}
    for pair in range(args.pairs):
        for name, model, chunk in (configs if pair % 2 == 0 else configs[::-1]):
            model.config.prefill_chunk = chunk
            ttft[name].append(engine_turn(model, ids, question, 2)["ttft_s"])
    peaks = {}
    for chunk in chunks:
        for ratio in (1.0, 0.5):
            out = subprocess.run([sys.executable, "-m", "benchmarks.prefill_chunk", "--peak-worker", str(chunk),
                                  str(ratio)], capture_output=True, text=True, check=True)
            peaks[f"{chunk} {ratio}"] = json.loads(out.stdout.strip().splitlines()[-1])
    m = machine()
    base = statistics.median(ttft[configs[0][0]])
    lines = [f"Prefill chunk on a CPU: the default model, {m['cpu']}, {THREADS} threads; TTFT of a {len(ids):,}-token "
             f"prompt, medians of {args.pairs} pairs in one process", "",
             "| weights | chunk | TTFT | × GGUF at the first chunk size |", "|---|---|---|---|"]
    for name, _, chunk in configs:
        t = statistics.median(ttft[name])
        lines.append(f"| {name.split(',')[0]} | {chunk} | {t:.2f} s | ×{t / base:.2f} |")
    lines += ["", "Peak RSS of an 8,000-token turn (a fresh process each; GGUF blocks):", "",
              "| chunk | dense: peak | dense: above the load | defaults (ratio 0.5): peak | above the load |",
              "|---|---|---|---|---|"]
    for chunk in chunks:
        d, c = peaks[f"{chunk} 1.0"], peaks[f"{chunk} 0.5"]
        lines.append(f"| {chunk} | {d['peak'] / 2**20:,.0f} MiB | {(d['peak'] - d['loaded_peak']) / 2**20:,.0f} MiB | "
                     f"{c['peak'] / 2**20:,.0f} MiB | {(c['peak'] - c['loaded_peak']) / 2**20:,.0f} MiB |")
    table = "\n".join(lines) + "\n"
    write_results("prefill-chunk", {"machine": m, "threads": THREADS, "prompt_tokens": len(ids), "pairs": args.pairs,
                                    "ttft_s": ttft, "peaks": peaks}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
