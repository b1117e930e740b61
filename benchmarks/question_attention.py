"""A follow-up question's attention, per layer of the default model's shape (9 query / 3 KV heads, head_dim 64, a
bf16 cache, float32 activations): dense_attention (torch's CPU flash kernel, bf16) plus attention_mass (the
scoring), against question_attention (one float32 softmax gives both). T question tokens over S stored entries;
medians of 7 rounds of 50 calls, and how far the two outputs and masses differ. Writes
results/question-attention/question-attention.json and .md.

Usage: python -m benchmarks.question_attention
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cache.attention import attention_mass, dense_attention, question_attention

from .common import machine, write_results

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _ms(call, rounds: int = 7, calls: int = 50) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1000)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queries", default="19,40,64,128")
    parser.add_argument("--entries", default="550,1050,2200,4200")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for t in (int(x) for x in args.queries.split(",")):
        for s in (int(x) for x in args.entries.split(",")):
            q = torch.randn(HEADS, t, HEAD_DIM)
            k = torch.randn(KV_HEADS, s, HEAD_DIM).bfloat16()
            v = torch.randn(KV_HEADS, s, HEAD_DIM).bfloat16()
            old = _ms(lambda: (dense_attention(q, k, v, None, scale, "sdpa", None, bf16=True),  # noqa: B023
                               attention_mass(q, k, None, scale, last=t)))  # noqa: B023
            new = _ms(lambda: question_attention(q, k, v, None, scale, last=t))  # noqa: B023
            out, mass = question_attention(q, k, v, None, scale, last=t)
            rows.append({"queries": t, "entries": s, "dense_plus_mass_ms": old, "question_attention_ms": new,
                         "speedup": old / new,
                         "out_max_abs_diff": float((dense_attention(q, k, v, None, scale, "sdpa", None, bf16=True)
                                                    - out).abs().max()),
                         "mass_max_abs_diff": float((attention_mass(q, k, None, scale, last=t) - mass).abs().max())})
    lines = ["| queries | entries | dense + mass (ms) | question_attention (ms) | speedup | out max diff | mass max diff |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['queries']} | {r['entries']} | {r['dense_plus_mass_ms']:.3f} | {r['question_attention_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['out_max_abs_diff']:.1e} | {r['mass_max_abs_diff']:.1e} |" for r in rows]
    folder = write_results("question-attention", {"machine": machine(torch.device("cpu")), "rows": rows},
                           "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {folder}")


if __name__ == "__main__":
    main()
