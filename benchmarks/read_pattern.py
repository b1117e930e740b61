"""What the order in which the Q4 products read their rows costs, with nothing computed: split Q4_1 rows read
linearly (each thread its share of the rows, as dsv41_step_read reads a matrix) against the same bytes read in the
order rows_q4_int takes them (four rows a group: each row's scales, then 64 bytes of each row in turn, the rows ahead
streamed into L2), both summed with wide loads (cpu_kernels.c, dsv41_q4_read_pattern); rows of 18 blocks (the
default model's 576 columns) and of 48 (its 1,536), two buffers of ~64 MB each (past the caches), 2 threads, the
two orders taking turns round by round. Beside them, in the same run, the default model's every decode-step product
against the read of the same bytes on their own pages (FusedDecodeStep.matrices_seconds / read_seconds): what the
products reach of the read ceiling, of which the first ratio is the part their reading order alone sets.

Usage: python -m benchmarks.read_pattern [--rounds 15] [--folder read-pattern]
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import machine, write_results

THREADS = 2
BUFFER_BYTES = 64 * 2**20


def order_rates(lib, blocks: int, rounds: int) -> dict:
    """GB/s of the linear read and of the products' order over the same rows, per round (interleaved)."""
    row_bytes = blocks * 20
    rows = BUFFER_BYTES // row_bytes // 8 * 8
    buffers = [torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8) for _ in range(2)]
    expected = sum(int(b.sum()) for b in buffers)
    rates = {0: [], 1: []}
    for _ in range(rounds):
        for pattern in (0, 1):
            started = time.perf_counter()
            seen = sum(lib.dsv41_q4_read_pattern(3, b.data_ptr(), rows, blocks, pattern, THREADS) for b in buffers)
            rates[pattern].append(rows * row_bytes * len(buffers) / (time.perf_counter() - started) / 1e9)
            if seen != expected:
                raise RuntimeError(f"order {pattern} read {seen}, not the buffers' sum {expected}")
    ratios = [p / lin for lin, p in zip(rates[0], rates[1], strict=True)]
    return {"blocks": blocks, "row_bytes": row_bytes, "rows": rows, "linear_gb_s": rates[0],
            "product_order_gb_s": rates[1], "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}


def step_share(rounds: int) -> dict | None:
    """The default model's decode-step products (dsv41_step_matrices) against the read of their bytes, per round."""
    from engine import DSV41Config, DSV41Model
    from engine.models import adapter

    model = DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=512, kv_cache_ratio=1.0))
    decoder = adapter.runtime(model.hf_model).decoder
    fused = decoder.fused if decoder is not None else None
    if fused is None:
        return None
    fused.matrices_seconds(3)
    shares = [fused.read_seconds(5) / fused.matrices_seconds(5) for _ in range(rounds)]
    return {"share": statistics.median(shares), "share_range": [min(shares), max(shares)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.read_pattern")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--folder", default="read-pattern", help="the results folder's name")
    args = parser.parse_args(argv)
    from engine import kernels as cpu_kernels

    library = cpu_kernels.load()
    if library is None or library.isa != 512:
        print("this benchmark reads with AVX-512 (the products' order is the AVX-512 loop's)")
        return 1
    torch.set_num_threads(THREADS)
    rows = [order_rates(library.lib, blocks, args.rounds) for blocks in (18, 48)]
    step = step_share(args.rounds)
    m = machine()
    lines = [f"Split Q4_1 rows read linearly and in the products' order, nothing computed, {m['cpu']}, {THREADS} "
             f"threads, {args.rounds} rounds taking turns, medians (range of the per-round ratio)", "",
             "| row | linear | in the products' order | order / linear |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['blocks']} blocks ({r['row_bytes']} B) | {statistics.median(r['linear_gb_s']):.1f} GB/s | "
                     f"{statistics.median(r['product_order_gb_s']):.1f} GB/s | ×{r['ratio']:.2f} "
                     f"(×{r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f}) |")
    if step is not None:
        lines += ["", f"The default model's decode-step products against the read of the same bytes, same run: "
                  f"×{step['share']:.2f} (×{step['share_range'][0]:.2f}–{step['share_range'][1]:.2f})"]
    path = write_results(args.folder, {"machine": m, "threads": THREADS, "rounds": args.rounds, "rows": rows,
                                       "step": step}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
