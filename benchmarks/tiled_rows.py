"""A short bf16 prefill chunk (a follow-up's question, a short message) through the default model's GGUF-held
matrices: the blocks dequantised a tile at a time into cache and multiplied there (GGUFMatrix.mm_bf16), against
each matrix dequantised to a bf16 copy for one GEMM (oneDNN). Every matrix of the 30 layers as the decoder holds
them (a layer's q, k and v one product), T rows of float32 activations; medians of 7 interleaved rounds. What
gguf_blocks.TILED_ROWS is chosen from: the tiled product is used up to the largest T where it wins. Writes
results/tiled-rows/tiled-rows.json and .md.

Usage: python -m benchmarks.tiled_rows [--gguf FILE --folder NAME]   (another GGUF's matrices, e.g. the Q4_K_M file
of benchmarks/gguf_kquants: ~/.cache/ds-v41-chat/benchmarks/kquants/llama-8x2048-5632-Q4_K_M.gguf)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import kernels as cpu_kernels
from engine.kernels import gguf_blocks
from engine.kernels.gguf_blocks import GGUFWeight

from .common import machine, write_results
from .gguf_blocks import held_tensors
from .gguf_kquants import files as kquant_files

ROWS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)


def layer_weights(path=None) -> list[GGUFWeight]:
    """The decoder's matrices: per layer q+k+v joined, o, gate+up joined, down (as engine/models/gguf_hold.py)."""
    held = {name: m for name, m in held_tensors(path).items() if name.startswith("blk.")}
    layers = sorted({int(name.split(".")[1]) for name in held})
    groups = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
    weights = [GGUFWeight([held[f"blk.{i}.{part}.weight"] for part in group]) for i in layers for group in groups]
    for w in weights:
        w.bf16_rows = True
    return weights


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="a GGUF file whose matrices to multiply (default: the default model's); "
                                       "'kquants' for benchmarks/gguf_kquants' Q4_K_M file")
    parser.add_argument("--folder", default="tiled-rows")
    args = parser.parse_args(argv)
    path = str(kquant_files()[1]) if args.gguf == "kquants" else args.gguf
    if cpu_kernels.load() is None:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
        return 1
    weights = layer_weights(path)
    formats = sorted({m.format for w in weights for m in w.parts})
    before = gguf_blocks.TILED_ROWS
    rows = {}
    try:
        for t in ROWS:
            xs = {w.shape[1]: torch.randn(t, w.shape[1]) for w in weights}

            def run(tiled: bool, t=t, xs=xs):
                gguf_blocks.TILED_ROWS = t if tiled else 0
                started = time.perf_counter()
                for w in weights:
                    w.linear(xs[w.shape[1]])
                return time.perf_counter() - started

            run(True), run(False)
            times = {True: [], False: []}
            for _ in range(7):
                for tiled in (True, False):
                    times[tiled].append(run(tiled))
            tiled, gemm = (statistics.median(times[k]) * 1e3 for k in (True, False))
            rows[t] = {"tiled_ms": tiled, "gemm_ms": gemm, "speedup": gemm / tiled}
            print(f"T={t}: tiled {tiled:.1f} ms, dequantised GEMM {gemm:.1f} ms", flush=True)
    finally:
        gguf_blocks.TILED_ROWS = before
    payload = {"machine": machine(), "threads": torch.get_num_threads(), "tiled_rows_setting": before, "rows": rows,
               "gguf": path or "the default model", "formats": formats}
    table = "\n".join([
        f"Every layer matrix of {path or 'the default model'} ({' + '.join(formats)} blocks), T rows of bf16 activations, {payload['machine']['cpu']}, "
        f"{payload['threads']} threads; medians of 7 interleaved rounds, the whole model's matrices per round.", "",
        "| T rows | tiled (mm_bf16), ms | dequantised + GEMM, ms | GEMM / tiled |", "|---|---|---|---|",
        *[f"| {t} | {r['tiled_ms']:.1f} | {r['gemm_ms']:.1f} | {r['speedup']:.2f}× |" for t, r in rows.items()], "",
        f"gguf_blocks.TILED_ROWS = {before}: chunks of at most that many rows take the tiled product.", ""])
    write_results(args.folder, payload, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
