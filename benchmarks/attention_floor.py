"""The attention part of the decode-step floor: one decode token's attention over S stored entries for
every layer of the default model's shape (30 layers, 9 query / 3 KV heads, head_dim 64, fp32), with a
weight-sized matrix product between layers so K/V are read from memory as in a real step. Every kernel
torch offers for it, medians of 7. Writes results/attention-floor/attention-floor.json and .md.

Usage: python -m benchmarks.attention_floor [--entries 1104]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.cache.attention import decode_attention

from .common import machine, write_results

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1104)  # the context of the profiled 1k decode step
    args = parser.parse_args(argv)
    s, groups, scale = args.entries, HEADS // KV_HEADS, HEAD_DIM**-0.5
    torch.manual_seed(0)
    keys = [torch.randn(KV_HEADS, s + 300, HEAD_DIM)[:, :s] for _ in range(LAYERS)]  # storage-like slices
    values = [torch.randn(KV_HEADS, s + 300, HEAD_DIM)[:, :s] for _ in range(LAYERS)]
    keys_t = [k.transpose(1, 2).contiguous() for k in keys]
    weight, x = torch.randn(3072, 576), torch.randn(1, 576)
    q = torch.randn(HEADS, 1, HEAD_DIM)
    kernels = {
        "engine decode_attention (bmm per KV head)": lambda i: decode_attention(q, keys[i], values[i], None, scale),
        "SDPA, enable_gqa": lambda i: F.scaled_dot_product_attention(
            q.reshape(1, HEADS, 1, HEAD_DIM), keys[i][None], values[i][None], enable_gqa=True, scale=scale),
        "SDPA, group as query rows": lambda i: F.scaled_dot_product_attention(
            q.reshape(1, KV_HEADS, groups, HEAD_DIM), keys[i][None], values[i][None], scale=scale),
        "bmm with K stored transposed": lambda i: torch.bmm(torch.softmax(
            torch.bmm(q.reshape(KV_HEADS, groups, HEAD_DIM), keys_t[i]).mul_(scale), -1), values[i]),
        "mm per KV head": lambda i: [torch.softmax(torch.mm(q.reshape(KV_HEADS, groups, HEAD_DIM)[j], keys[i][j].t())
                                                   .mul_(scale), -1) @ values[i][j] for j in range(KV_HEADS)],
    }
    times = {name: [] for name in kernels}
    with torch.inference_mode():
        for _ in range(7):
            for name, fn in kernels.items():
                total = 0.0
                for i in range(LAYERS):
                    F.linear(x, weight)  # stream a weight matrix between layers, as a decode step does
                    start = time.perf_counter()
                    fn(i)
                    total += time.perf_counter() - start
                times[name].append(total)
    kv_bytes = LAYERS * 2 * KV_HEADS * s * HEAD_DIM * 4
    rows = {name: statistics.median(v) * 1000 for name, v in times.items()}
    md = "\n".join([f"Decode attention over {s} stored entries, all {LAYERS} layers, fp32 (K+V {kv_bytes / 1e6:.0f} MB "
                    "per step); ms per step, median of 7\n", "| kernel | ms |", "|---|---|"]
                   + [f"| {n} | {v:.2f} |" for n, v in rows.items()]) + "\n"
    write_results("attention-floor", {"machine": machine(), "entries": s, "ms_per_step": rows,
                                      "kv_bytes_per_step": kv_bytes}, md)
    print(md)


if __name__ == "__main__":
    main()
