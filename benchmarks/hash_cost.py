"""What the reply's counts cost per key: the C hashing (engine/kernels/cache_ops.py) on one layer's shapes, alone.

The counts (engine/cache/counts.py) hash every hot key of a layer, and every cold key where the cold tier keeps no
bucket sizes; a recall and a compaction hash the keys they move where it keeps them (lsh_tally). End to end those
costs drown in this machine's noise (benchmarks/recall_cost.py moves by 10-20 ms between runs of one build), so
this times the calls themselves on the default model's layer shape (3 KV heads, head dim 64) with random keys:
cold_counts over a bf16 hot set with the cold sizes given (a follow-up at 7,429 tokens), the same with a float32
hot set, cold_counts hashing an int8 cold tier as well (a follow-up at 1,781 tokens, where no sizes are kept), and
lsh_tally of int8 cold keys. Medians of `--rounds` rounds (each the best of 5 calls), and the fastest round (the
least disturbed by other work on a shared machine), in ns per key hashed, on torch's threads. To compare builds, run it in each checkout in turn (`--folder`).

Usage: python -m benchmarks.hash_cost [--rounds 15] [--folder hash-cost]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import machine, write_results


def _best(call, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def run(rounds: int) -> dict:
    from engine.cache.counts import COUNT_BITS, COUNT_TABLES, count_planes
    from engine.kernels import cache_ops

    if cache_ops.load() is None:
        raise SystemExit("the CPU kernels are not built on this machine: nothing to time")
    g = torch.Generator().manual_seed(0)
    heads, d = 3, 64
    planes = count_planes(d, "cpu")
    sizes = torch.zeros(heads, COUNT_TABLES << COUNT_BITS, dtype=torch.int16)
    hot8k = torch.randn(heads, 2474, d, generator=g)  # 0.3 x 7,429 + the reply's room, as a follow-up holds
    hot2k = torch.randn(heads, 790, d, generator=g)
    cold2k = (torch.randn(heads, 1250, d, generator=g) * 40).clamp(-127, 127).to(torch.int8)
    index = torch.arange(1250).expand(heads, -1).contiguous()
    hot8k_bf16, hot2k_bf16 = hot8k.bfloat16(), hot2k.bfloat16()  # converted once: the calls alone are timed

    def counts(hot, cold, given):
        return lambda: cache_ops.cold_counts(hot, cold, planes, COUNT_TABLES, COUNT_BITS, given)

    def tally():
        for sign in (+1, -1):
            cache_ops.lsh_tally(cold2k, 1250, index, planes, COUNT_TABLES, COUNT_BITS, sizes, sign)

    cases = {
        "counts, bf16 hot set (2,474 a head), cold sizes given": (counts(hot8k_bf16, None, sizes), heads * 2474),
        "counts, float32 hot set (2,474 a head), cold sizes given": (counts(hot8k, None, sizes), heads * 2474),
        "counts, bf16 hot set (790) and int8 cold tier (1,250) hashed": (counts(hot2k_bf16, cold2k, None),
                                                                          heads * (790 + 1250)),
        "tally, int8 cold keys (1,250 a head), in and out": (tally, 2 * heads * 1250),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # the cases take turns round by round
        for name, (call, _) in cases.items():
            times[name].append(_best(call))
    rows = [{"case": name, "keys": keys, "ms_per_layer": statistics.median(times[name]) * 1e3,
             "ns_per_key": statistics.median(times[name]) * 1e9 / keys, "best_ns_per_key": min(times[name]) * 1e9 / keys,
             "threads": torch.get_num_threads()}
            for name, (_, keys) in cases.items()]
    return {"machine": machine(), "rounds": rounds, "rows": rows}


def table(payload: dict) -> str:
    lines = [f"The counts' C hashing on one layer (3 KV heads, head dim 64, random keys), {payload['rounds']} rounds, "
             f"medians; {payload['machine'].get('cpu', '')}", "",
             "| call | keys hashed | ms a layer | ns a key | ns a key, fastest round |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['keys']:,} | {r['ms_per_layer']:.3f} | {r['ns_per_key']:.1f} | "
              f"{r['best_ns_per_key']:.1f} |"
              for r in payload["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hash_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--folder", default="hash-cost")
    args = parser.parse_args(argv)
    payload = run(args.rounds)
    folder = write_results(args.folder, payload, table(payload))
    print(table(payload))
    print(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
