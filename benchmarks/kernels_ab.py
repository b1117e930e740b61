"""Whole decode steps of the default model on this tree's CPU kernels against those of another git revision, in one
process: the same weights (held once), two builds of engine/kernels/cpu_kernels.c loaded side by side, each a fused
decode step of its own, taking turns round by round (the order alternates), so the machine's drift between fresh
processes does not decide the ratio. Each round's decode tok/s on this tree over the revision's, median and range.
With DSV41_CPU_KERNEL_FLAGS (e.g. -mno-avx512f) both builds are that variant. The weights are held once, in this
tree's layout: a revision that held Q4 rows in another split layout (before the interleaved groups of 16 blocks)
reads the same bytes as other values, the same work for other tokens (greedy, the end of text ignored).

`--products SECONDS` adds the step's products alone (dsv41_step_matrices), both builds each round with a read of the
weights (dsv41_step_read) right after each, for that long (thousands of rounds): their ratio over all rounds and over
the quarters of rounds whose reads were fastest and slowest, where whole turns are too noisy to tell a few percent
(on a VM whose bandwidth swings within seconds, the products' time depends on the minute).

`--steps` adds the two builds' decode steps taking turns token by token within the same turns (each C call timed):
the machine's drift between turns cancels, where whole turns' ratios range ±10 %.

Usage: python -m benchmarks.kernels_ab --rev 7fe8efd [--contexts 128,1024,4096] [--rounds 6] [--new-tokens 64]
       [--products 60] [--steps] [--model default|PATH.gguf] [--folder kernels-ab]   (--contexts "" with --products: the
       products alone)
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from .common import machine, write_results
from .gguf_llamacpp import ROOT, THREADS, prompts
from .huge_pages import alternate


def build_at(rev: str):
    """The kernels of `rev` compiled and loaded beside this tree's (engine.kernels.library.build on its source)."""
    from engine.kernels import library

    source = subprocess.run(["git", "show", f"{rev}:engine/kernels/cpu_kernels.c"], cwd=ROOT, capture_output=True,
                            check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cpu_kernels.c"
        path.write_bytes(source)
        ours, library.SOURCE = library.SOURCE, path
        try:  # the same variant as this tree's (DSV41_CPU_KERNEL_FLAGS=-mno-avx512f: both AVX2 builds)
            return library.build(tuple(os.environ.get("DSV41_CPU_KERNEL_FLAGS", "").split()))
        finally:
            library.SOURCE = ours


def products_rounds(steps: dict, seconds: float) -> list[dict]:
    """Rounds of every step's products alone (the order alternating), each followed by a read of the weights
    (the first step's dsv41_step_read), for `seconds`: per round and build, products and read seconds."""
    import ctypes
    import time

    first = next(iter(steps.values()))
    read = (first._lib.dsv41_step_read, first.read_args())
    calls = {}
    for name, step in steps.items():
        work = torch.full((step._lib.dsv41_step_work_floats(ctypes.byref(step._model), 1),), 0.01)
        logits = torch.empty(step.vocab)
        calls[name] = (step._lib.dsv41_step_matrices,
                       (ctypes.byref(step._model), step._layers, logits.data_ptr(), work.data_ptr(), THREADS), work,
                       logits)
    rounds, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        record = {}
        for name in (list(calls) if len(rounds) % 2 == 0 else list(calls)[::-1]):
            fn, args = calls[name][:2]
            started = time.perf_counter()
            fn(*args)
            record[name] = time.perf_counter() - started
            started = time.perf_counter()
            read[0](*read[1])
            record[f"read {name}"] = time.perf_counter() - started
        rounds.append(record)
    return rounds


def products_summary(rounds: list[dict], ours: str, theirs: str) -> dict:
    """Ratio of their products' time over ours (above 1: ours faster) in all rounds and in the quarters whose reads
    were fastest / slowest, with each build's products over read."""
    reads = sorted(min(r[f"read {ours}"], r[f"read {theirs}"]) for r in rounds)
    fast, slow = reads[len(reads) // 4], reads[3 * len(reads) // 4]
    out = {}
    for label, keep in (("all", lambda r: True),
                        ("fastest reads", lambda r: max(r[f"read {ours}"], r[f"read {theirs}"]) <= fast),
                        ("slowest reads", lambda r: min(r[f"read {ours}"], r[f"read {theirs}"]) >= slow)):
        sub = [r for r in rounds if keep(r)]
        if sub:
            out[label] = {"rounds": len(sub), "read_ms": 1e3 * statistics.median(r[f"read {ours}"] for r in sub),
                          "ours_ms": 1e3 * statistics.median(r[ours] for r in sub),
                          "theirs_ms": 1e3 * statistics.median(r[theirs] for r in sub),
                          "ratio": statistics.median(r[theirs] / r[ours] for r in sub),
                          "ours_share": statistics.median(r[f"read {ours}"] / r[ours] for r in sub),
                          "theirs_share": statistics.median(r[f"read {theirs}"] / r[theirs] for r in sub)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the git revision whose kernels to compare against")
    parser.add_argument("--contexts", default="128,1024,4096")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--products", type=float, default=0.0,
                        help="seconds of the products alone, each build with a read after it (see above)")
    parser.add_argument("--steps", action="store_true",
                        help="also the two builds' decode steps taking turns token by token within each turn (each C "
                             "call timed; benchmarks.huge_pages.alternate): finer than whole turns")
    parser.add_argument("--model", default="default", help="the model (a .gguf path: its products; default: ours)")
    parser.add_argument("--folder", default="kernels-ab")
    args = parser.parse_args(argv)

    from engine import DSV41Config, DSV41Model
    from engine.kernels.fused import FusedDecodeStep
    from engine.models.adapter import runtime

    from .speed.core import engine_turn

    torch.set_num_threads(THREADS)
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    theirs = build_at(args.rev)
    model = DSV41Model.from_pretrained(DSV41Config(model_path=args.model, max_seq_len=8192, kv_cache_ratio=1.0,
                                                   csa2_topk=0))
    decoder = runtime(model.hf_model).decoder
    steps = {"this tree": decoder.fused, rev: FusedDecodeStep(decoder.w, theirs)}
    rows = []
    for context in (int(c) for c in args.contexts.split(",") if c):
        ids, question = prompts(context)
        engine_turn(model, ids[:32], 16, 8)
        runs: dict[str, list[float]] = {name: [] for name in steps}
        for round_ in range(args.rounds):
            for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
                decoder.fused = steps[name]
                runs[name].append(engine_turn(model, ids, question, args.new_tokens)["decode_tok_s"])
        decoder.fused = steps["this tree"]
        ratios = [a / b for a, b in zip(runs["this tree"], runs[rev], strict=True)]
        rows.append({"prompt_tokens": len(ids), "runs": runs, "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "medians": {name: statistics.median(v) for name, v in runs.items()}})
        if args.steps:
            seconds = alternate(model, decoder, steps, ids, question, args.rounds, args.new_tokens)
            pairs = list(zip(seconds[rev], seconds["this tree"], strict=False))
            rows[-1]["steps"] = {"pairs": len(pairs), "ratio_median": statistics.median(a / b for a, b in pairs),
                                 "ms": {name: 1e3 * statistics.median(v) for name, v in seconds.items()}}
    m = machine()
    name = "default model" if args.model == "default" else Path(args.model).name
    lines = [f"Decode tok/s, {name} (GGUF blocks, dense), {m['cpu']}, {THREADS} threads, {args.new_tokens} new "
             f"tokens, {args.rounds} rounds in one process, this tree's kernels against {rev}'s", "",
             f"| prompt tokens | {rev} | this tree | this tree / {rev}, median (range) |", "|---|---|---|---|"]
    if not rows:
        lines = [f"{name}: the decode step's products (GGUF blocks), {m['cpu']}, {THREADS} threads, this tree's "
                 f"kernels against {rev}'s"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']:,} | {r['medians'][rev]:.1f} | {r['medians']['this tree']:.1f} | "
                     f"×{r['ratio_median']:.2f} (×{r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |")
    if args.steps and rows:
        lines += ["", "The two builds' decode steps taking turns token by token in the same turns (the C call "
                  "timed, attention included):", "",
                  f"| prompt tokens | steps paired | {rev} | this tree | {rev} / this tree, median of pairs |",
                  "|---|---|---|---|---|"]
        for r in rows:
            st = r["steps"]
            lines.append(f"| {r['prompt_tokens']:,} | {st['pairs']} | {st['ms'][rev]:.3f} ms | "
                         f"{st['ms']['this tree']:.3f} ms | ×{st['ratio_median']:.3f} |")
    products = products_summary(products_rounds(steps, args.products), "this tree", rev) if args.products else {}
    if products:
        lines += ["", f"The step's products alone, both builds each round with a read of the weights after each, "
                  f"{args.products:.0f} s ({products['all']['rounds']} rounds):", "",
                  f"| rounds | the read | {rev} | this tree | {rev} / this tree | products / read ({rev}, this tree) |",
                  "|---|---|---|---|---|---|"]
        for label, p in products.items():
            lines.append(f"| {label} ({p['rounds']}) | {p['read_ms']:.2f} ms | {p['theirs_ms']:.2f} ms | "
                         f"{p['ours_ms']:.2f} ms | ×{p['ratio']:.3f} | {p['theirs_share']:.2f}, {p['ours_share']:.2f} |")
    table = "\n".join(lines) + "\n"
    write_results(args.folder, {"machine": m, "threads": THREADS, "rev": rev, "new_tokens": args.new_tokens,
                                "rounds": args.rounds, "rows": rows, "products": products}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
