"""Where a decoded token's time goes on the CPU: the fused C step against the Python around it.

The default model (GGUF blocks), a document prompt, greedy (or the app's default sampling: --sampling app), EOS
ignored, 2 threads; each turn goes through the path ChatSession.send takes (engine.generate.run_turn). The fused
step's C call is timed from Python on every token (FusedDecodeStep.step's library call, wrapped); the rest of a
token's time (the turn loop, sampling, the cache's per-token plan, the embedding row, the detokenizer) is the token's
time less that. The bandwidth bound of a token is the bytes a step reads (the matrices as held + the KV it attends)
over a read bandwidth, two ways: this machine's (benchmarks.speed.core.read_bandwidth: 1 GiB buffers, the best of
several) and the rate at which the step's own matrices are read where they sit, with nothing else done
(FusedDecodeStep.read_seconds, before every turn: on a VM the same loop reads one buffer at 34 GB/s and the next at
55, by where its pages land, so the model's own pages are the bound that holds for its steps). `--profile` adds the
Python functions that take the most of the decode loop (cProfile from the first reply token on, one extra turn).
`--paired` reads the step's weights once right after every step (timed apart, left out of the token's time) and
gives each step's share of the bound at that read's rate: on a VM whose bandwidth swings within seconds, a bound
measured before a turn does not hold for every step in it.

Usage: python -m benchmarks.step_time [--contexts 128,1024] [--turns 3] [--new-tokens 200] [--sampling greedy|app]
       [--paired] [--folder step-time]
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import machine, write_results
from .gguf_llamacpp import THREADS, _held_weight_bytes, prompts


class _TimedLibrary:
    """The kernel library with its decode step call timed (every other symbol passed through); `read` (the step's
    dsv41_step_read arguments): right after each step, the step's weights read once on their own pages, timed."""

    def __init__(self, lib, read: tuple | None = None):
        self._lib = lib
        self._read = read
        self.seconds: list[float] = []
        self.read_seconds: list[float] = []

    def dsv41_decode_step(self, *args):
        started = time.perf_counter()
        status = self._lib.dsv41_decode_step(*args)
        self.seconds.append(time.perf_counter() - started)
        if self._read is not None:
            started = time.perf_counter()
            self._lib.dsv41_step_read(*self._read)
            self.read_seconds.append(time.perf_counter() - started)
        return status

    def __getattr__(self, name):
        return getattr(self._lib, name)


def measure(model, ids: list[int], question: int, new_tokens: int, seed: int | None = None,
            paired: bool = False) -> dict:
    """One turn: its decode tokens' median-free totals (decode seconds, C step seconds, tokens); greedy, or the app's
    default sampling with `seed`. `paired`: each step is followed by a read of the step's weights (timed apart and
    left out of the token's time), and `paired_share_step` is the median over steps of (the step's bytes at the rate
    that read ran at) / (the step's time): the bound taken milliseconds from the step it bounds."""
    from engine.models import adapter

    from .speed.core import engine_turn

    fused = adapter.runtime(model.hf_model).decoder.fused
    read = fused.read_args() if paired else None
    timed = _TimedLibrary(fused._lib, read)
    fused._lib = timed
    try:
        turn = engine_turn(model, ids, question, new_tokens, seed=seed)
    finally:
        fused._lib = timed._lib
    steps = timed.seconds  # every decode step fed a generated token (the last sampled one is not fed)
    token_s = 1.0 / turn["decode_tok_s"] - sum(timed.read_seconds) / max(len(steps), 1)
    step_s = statistics.median(steps)
    row = {"token_ms": 1e3 * token_s, "step_ms": 1e3 * step_s, "python_ms": 1e3 * (token_s - sum(steps) / len(steps)),
           "kv_read_per_token": turn["kv_read_per_token"], "steps": len(steps)}
    if paired:
        weights = _held_weight_bytes(model)
        read_bytes = weights + turn["kv_read_per_token"]
        # each step against the read right after it (the KV's bytes at the weights' rate)
        shares = [read_bytes / weights * r / st for st, r in zip(steps, timed.read_seconds, strict=True)]
        row["paired_share_step"] = statistics.median(shares)
        row["paired_read_ms"] = 1e3 * statistics.median(timed.read_seconds)
        row["paired_share_token"] = row["paired_share_step"] * step_s / token_s
    return row


def profile_turn(model, ids: list[int], question: int, new_tokens: int, top: int = 18,
                 seed: int | None = None) -> list[dict]:
    """The Python functions with the most own time in one turn's decode loop (cProfile from the first reply token on:
    the prompt's reading is not in it), per decoded token."""
    import cProfile
    import pstats

    from engine.events import TokenText
    from engine.generate import TurnPlan, run_turn

    from .speed.core import turn_settings

    settings = turn_settings(new_tokens, seed)
    cache = model.new_cache()
    plan = TurnPlan(list(ids), question, model.prefill_chunk, model.headroom_tokens(cache), model.context_limit)
    profiler, started = cProfile.Profile(), False
    for event in run_turn(model.hf_model, model.tokenizer, cache, plan, settings, eos_ids=model.eos_ids):
        if isinstance(event, TokenText) and not started:
            profiler.enable()
            started = True
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(((value[2], key) for key, value in stats.items()), reverse=True)[:top]
    return [{"function": f"{key[0].rsplit('/', 2)[-1]}:{key[1]}({key[2]})", "own_us_per_token": 1e6 * own / new_tokens,
             "calls_per_token": stats[key][1] / new_tokens} for own, key in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_time")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="also list the Python functions of the decode loop")
    parser.add_argument("--sampling", choices=("greedy", "app"), default="greedy",
                        help="greedy, or the app's default sampling (temperature 0.7, top-k 50, top-p 0.9, repetition "
                             "penalty 1.1; seeded by turn)")
    parser.add_argument("--paired", action="store_true",
                        help="also read the step's weights right after every step: a table of each step's share of "
                             "the bound at its own read's rate")
    parser.add_argument("--folder", default="step-time", help="the results folder's name")
    args = parser.parse_args(argv)

    from engine import DSV41Config, DSV41Model
    from engine.kernels.gguf_blocks import x_mode
    from engine.models import adapter

    from .speed.core import engine_turn, read_bandwidth

    torch.set_num_threads(THREADS)
    model = DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=1.0))
    decoder = adapter.runtime(model.hf_model).decoder
    fused = decoder.fused if decoder is not None else None
    if fused is None:
        print("The fused CPU decode step is not built on this machine (no compiler?): nothing to time.")
        return 1
    bandwidth = read_bandwidth(torch.device("cpu"))["bytes_per_s"]
    weights = _held_weight_bytes(model)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids, question = prompts(context)
        engine_turn(model, ids[:32], 16, 8)  # warm-up
        turns = []
        for turn in range(args.turns):
            read_s = fused.read_seconds(21)
            seed = turn if args.sampling == "app" else None
            turns.append({**measure(model, ids, question, args.new_tokens, seed, paired=args.paired),
                          "weights_read_ms": 1e3 * read_s})
        row = {"prompt_tokens": len(ids), "turns": turns}
        keys = ["token_ms", "step_ms", "python_ms", "kv_read_per_token", "weights_read_ms"]
        for key in keys + (["paired_share_step", "paired_share_token", "paired_read_ms"] if args.paired else []):
            row[key] = statistics.median(t[key] for t in turns)
        read = weights + row["kv_read_per_token"]
        row["bytes_per_token"] = read
        row["bound_ms"] = 1e3 * read / bandwidth
        row["own_rate_bytes_per_s"] = 1e3 * weights / row["weights_read_ms"]
        row["own_bound_ms"] = 1e3 * read / row["own_rate_bytes_per_s"]
        for bound in ("bound", "own_bound"):
            row[f"{bound}_share_token"] = row[f"{bound}_ms"] / row["token_ms"]
            row[f"{bound}_share_step"] = row[f"{bound}_ms"] / row["step_ms"]
        if args.profile:
            row["profile"] = profile_turn(model, ids, question, args.new_tokens,
                                          seed=0 if args.sampling == "app" else None)
        rows.append(row)
    m = machine()
    lines = [f"A decoded token's time, default model (GGUF blocks, {x_mode()} x), {m['cpu']}, {THREADS} threads, read "
             f"bandwidth {bandwidth / 1e9:.1f} GB/s; {args.new_tokens} new tokens, {args.sampling} sampling, medians "
             f"of {args.turns} turns", "",
             "| prompt tokens | per token | in the C step | Python around it | bytes read | bound at the machine's "
             "bandwidth | share (token / step alone) | the weights' own read rate | bound at it | share (token / step "
             "alone) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']:,} | {r['token_ms']:.2f} ms | {r['step_ms']:.2f} ms | "
                     f"{r['python_ms']:.2f} ms | {r['bytes_per_token'] / 1e6:.1f} MB | {r['bound_ms']:.2f} ms | "
                     f"{100 * r['bound_share_token']:.0f} % / {100 * r['bound_share_step']:.0f} % | "
                     f"{r['own_rate_bytes_per_s'] / 1e9:.1f} GB/s | {r['own_bound_ms']:.2f} ms | "
                     f"{100 * r['own_bound_share_token']:.0f} % / {100 * r['own_bound_share_step']:.0f} % |")
    if args.paired:
        lines += ["", "Each step paired with a read of the step's weights right after it (the bound milliseconds from "
                  "the step; the median over steps, then over turns):", "",
                  "| prompt tokens | the weights read | share of the paired bound (token / step alone) |",
                  "|---|---|---|"]
        lines += [f"| {r['prompt_tokens']:,} | {r['paired_read_ms']:.2f} ms | {100 * r['paired_share_token']:.0f} % / "
                  f"{100 * r['paired_share_step']:.0f} % |" for r in rows]
    for r in rows:
        if "profile" in r:
            lines += ["", f"Python functions by own time, {r['prompt_tokens']:,}-token prompt (cProfile, which slows "
                      "Python itself; per decoded token):", "", "| function | own µs | calls |", "|---|---|---|"]
            lines += [f"| `{p['function']}` | {p['own_us_per_token']:.1f} | {p['calls_per_token']:.1f} |"
                      for p in r["profile"]]
    payload = {"machine": m, "threads": THREADS, "x_mode": x_mode(), "sampling": args.sampling,
               "bandwidth_bytes_per_s": bandwidth,
               "weight_bytes": weights, "new_tokens": args.new_tokens, "rows": rows}
    path = write_results(args.folder, payload, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
