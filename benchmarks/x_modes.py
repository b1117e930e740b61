"""Whole decode steps of the default model with the Q4 products taking x each way this build has (float32, two bf16
terms, int8-rounded: engine.kernels.gguf_blocks.x_mode, DSV41_GGUF_X), in one process: the same document prompt,
the modes taking turns (the order rotates from round to round), so the machine's drift between fresh processes does
not decide the ratios. Each round's decode tok/s over float32 x's in the same round; medians over the rounds.

Usage: python -m benchmarks.x_modes [--contexts 128,1024] [--rounds 8] [--new-tokens 64] [--folder x-modes]
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .common import machine, write_results
from .gguf_llamacpp import THREADS, prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.x_modes")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--folder", default="x-modes", help="the results folder's name")
    args = parser.parse_args(argv)

    from engine import DSV41Config, DSV41Model
    from engine.kernels.gguf_blocks import activations, x_mode, x_modes

    from .speed.core import engine_turn

    torch.set_num_threads(THREADS)
    modes = list(x_modes())
    if len(modes) < 2:
        print(f"This CPU (or build) takes x one way only ({', '.join(modes) or 'no kernels'}): nothing to compare.")
        return 1
    default = x_mode()
    model = DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=1.0))
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids, question = prompts(context)
        engine_turn(model, ids[:32], 16, 8)  # warm-up
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_ in range(args.rounds):
            turn = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
            for mode in turn:
                with activations(mode):
                    runs[mode].append(engine_turn(model, ids, question, args.new_tokens)["decode_tok_s"])
        row = {"prompt_tokens": len(ids), "runs": runs}
        for mode in modes:
            ratios = [a / b for a, b in zip(runs[mode], runs["float32"], strict=True)]
            row[mode] = {"median": statistics.median(runs[mode]), "ratio_median": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
    m = machine()
    lines = [f"Decode tok/s, default model (GGUF blocks), {m['cpu']}, {THREADS} threads, {args.new_tokens} new tokens, "
             f"{args.rounds} rounds of every mode in one process (the default here: {default} x); in brackets each "
             "mode over float32 x in the same round, median and range", "",
             "| prompt tokens | " + " | ".join(f"{mode} x" for mode in modes) + " |", "|---|" + "---|" * len(modes)]
    for r in rows:
        cells = [f"{r[mode]['median']:.1f} (×{r[mode]['ratio_median']:.2f}, ×{r[mode]['ratio_min']:.2f}–"
                 f"{r[mode]['ratio_max']:.2f})" for mode in modes]
        lines.append(f"| {r['prompt_tokens']:,} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    write_results(args.folder, {"machine": m, "threads": THREADS, "new_tokens": args.new_tokens, "rounds": args.rounds,
                              "default": default, "modes": modes, "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
