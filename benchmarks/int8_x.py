"""Whole decode steps of the default model with the Q4 products on float32 x (the default) and on int8-rounded x
(DSV41_GGUF_INT8_X=1), paired in one process: the same document prompt, the two settings alternating (which goes
first alternates too), so the machine's drift between fresh processes does not decide the ratio. Needs a CPU with
AVX-512 VNNI (elsewhere there is no int8-x path to compare).

Usage: python -m benchmarks.int8_x [--contexts 128,1024] [--pairs 8] [--new-tokens 64]
Writes results/int8-x/int8-x.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .common import machine, write_results
from .gguf_llamacpp import THREADS, prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.int8_x")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from engine import DSV41Config, DSV41Model
    from engine.kernels.gguf_blocks import activations, has_int8_activations

    from .speed.core import engine_turn

    torch.set_num_threads(THREADS)
    if not has_int8_activations():
        print("This CPU (or build) has no int8-x path (AVX-512 VNNI): nothing to compare.")
        return 1
    model = DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=1.0))
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids, question = prompts(context)
        engine_turn(model, ids[:32], 16, 8)  # warm-up
        runs = {"int8 x": [], "float32 x": []}
        for pair in range(args.pairs):
            for on in ((True, False) if pair % 2 == 0 else (False, True)):
                with activations(int8=on):
                    runs["int8 x" if on else "float32 x"].append(
                        engine_turn(model, ids, question, args.new_tokens)["decode_tok_s"])
        ratios = [a / b for a, b in zip(runs["int8 x"], runs["float32 x"], strict=True)]
        rows.append({"prompt_tokens": len(ids), "runs": runs, "int8_median": statistics.median(runs["int8 x"]),
                     "float_median": statistics.median(runs["float32 x"]), "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    m = machine()
    lines = [f"Decode tok/s, default model (GGUF blocks), {m['cpu']}, {THREADS} threads, {args.new_tokens} new tokens, "
             f"{args.pairs} pairs in one process", "",
             "| prompt tokens | float32 x | int8 x | int8 / float32 (median of pairs) | range |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']:,} | {r['float_median']:.1f} | {r['int8_median']:.1f} | "
                     f"×{r['ratio_median']:.2f} | ×{r['ratio_min']:.2f}–{r['ratio_max']:.2f} |")
    table = "\n".join(lines) + "\n"
    write_results("int8-x", {"machine": m, "threads": THREADS, "new_tokens": args.new_tokens, "pairs": args.pairs,
                             "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
