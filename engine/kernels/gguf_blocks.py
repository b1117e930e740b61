"""GGUF quantized tensors held in their own block formats, multiplied directly by our C kernels (cpu_kernels.c).

A GGUF file stores most matrices in blocks of 32 or 256 weights with their own scales (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K here). Held as the file stores them, a decode step reads those bytes (the default model: 85 MB per token
against 269 MB as bf16) and computes the weights' exact values: `dequantize` writes them as the gguf package's
dequantiser does (bit for bit; tests/engine/test_gguf_blocks.py), `matvec` multiplies them by a float32 vector with
float32 accumulation. How the Q4_0 / Q4_1 products take x is `x_mode` (DSV41_GGUF_X): "float32"; "bf16" (the
default on CPUs with AVX-512 BF16 but not VNNI) carries x as two bf16 terms, 16 significant bits, and multiplies with bf16 dot
products, about 1e-6 of a row's sum of |w x| from the float32 path, the product ×1.2 faster on an AMD EPYC (on an
Intel Xeon whole decode steps are 0.88-0.93x float32 x's); "int8" (AVX-512 VNNI,
DSV41_GGUF_INT8_X=1) rounds x to int8 per block of 32 first, as llama.cpp does: half the instructions per block, but
whole decode steps gain 1.05-1.12x over float32 x (benchmarks/x_modes.py), and it changes greedy answers (the
weights stay the file's exact values, the products do not). "int16" (the default where AVX-512 VNNI is) rounds x
to int16 per block of 32 (Q4_0, Q4_1) or sub-block (Q4_K, Q5_K per 32, Q6_K per 16), 15 bits of its largest value,
and takes exact integer products of the weights' integers with x's high and low bytes (two vpdpbusd per 64
weights): the default model decodes ×1.28 / ×1.16 faster than on the bf16 terms at 128 / 1k tokens on an Intel
Xeon (benchmarks/x_modes.py), a Q4_K_M file ×1.34 / ×1.37 (benchmarks/gguf_kquants.py).

    blocks = GGUFMatrix.from_reader_tensor(reader_tensor)   # or GGUFMatrix(type, raw uint8 [rows, row_bytes], cols)
    y = blocks.matvec(x)                                      # float32 [rows]
    w = blocks.dequantize()                                   # float32 [rows, cols], the file's own values

GGUFWeight is a decoder matrix made of such matrices stacked by rows (a layer's q, k and v, which a file may hold in
different formats), multiplied as one by the decoder and the fused decode step (engine.kernels.fused): one token
through the block kernels, a prefill chunk through one GEMM on the weights dequantised for that call (a layer at a
time: nothing but the blocks stays in memory).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .library import X_MODES, load
from .packed import KernelMatrix, cpu_vector

# ggml's type ids, the block's weights and bytes
FORMATS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
           "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
BY_TYPE = {type_id: (name, weights, size) for name, (type_id, weights, size) in FORMATS.items()}
# where each block keeps its float16 scales (ggml's block structs): every other field is a small integer, so a
# block's weights are finite numbers exactly when these are
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def x_modes(library=None) -> tuple[str, ...]:
    """The ways this build's Q4_0 / Q4_1 products can take x: "float32" always; "int8" (x rounded to int8 per block of
    32, integer dot products: AVX-512 VNNI, and AVX2 builds); "bf16" (x as two bf16 terms, 16 significant bits, bf16
    dot products: AVX-512 BF16, rows held split); "int16" (x rounded to int16 per block of 32, exact integer
    products: AVX-512 VNNI, and AVX2 builds; the default where it exists, else "bf16" where that does). Q4_K follows
    the mode too (int8 or int16 per sub-block of 32); Q5_K and Q6_K take int16 x per sub-block (32, 16) in "int16"
    and two bf16 terms in "bf16" and "int8" where AVX-512 BF16 is; the k-quants float32 x otherwise. On AVX2 builds
    the k-quants take int16 x per 32 in both integer modes (no int8 k-quant route there), and so does Q8_0 (with
    AVX-512 Q8_0 always takes float32 x)."""
    lib = library if library is not None else load()
    if lib is None:
        return ()
    bits = lib.lib.dsv41_gguf_x_modes()
    return tuple(mode for i, mode in enumerate(X_MODES) if bits >> i & 1)


def x_mode(mode: str | None = None, library=None) -> str | None:
    """The mode the Q4 products take x in for the whole process (the fused decode step included); with `mode`, set it.
    Returns the mode in force before the call (None without the kernels). DSV41_GGUF_X sets it at load."""
    lib = library if library is not None else load()
    if lib is None:
        return None
    if mode is not None and mode not in x_modes(lib):
        raise ValueError(f"the Q4 products cannot take x as {mode!r} here; this build has {', '.join(x_modes(lib))}")
    return X_MODES[lib.lib.dsv41_gguf_x_mode(-1 if mode is None else X_MODES.index(mode))]


def has_int8_activations(library=None) -> bool:
    """Whether this build has the int8-x route for Q4 products (AVX-512 VNNI, or an AVX2 build)."""
    return "int8" in x_modes(library)


@contextmanager
def activations(mode: str, library=None):
    """Within the block, Q4 products take x as `mode` (x_modes); the mode before is back after it."""
    before = x_mode(mode, library)
    try:
        yield
    finally:
        x_mode(before, library)


def float_activations(library=None):
    """Within the block, Q4 products keep x float32 (exact to the weights; what tests compare against references)."""
    return activations("float32", library)


# The 32-weight formats also have a "split" row layout (cpu_kernels.c, GGUF_SPLIT): the same bytes as [every block's
# d] [every block's m (Q4_1)] [every block's integers], a row's scales one vector load; Q4_0 / Q4_1 integers further
# interleaved by words in whole groups of 16 blocks (a lane holds one block in all four chunks of its group). Q4_K has
# one where the build has AVX-512 VNNI (splittable): groups of four blocks, heads first, nibbles interleaved by words.
# design.md, "Interleaved groups" and "Q4_K groups".
SPLITTABLE = {2, 3, 8}


def held_split(type_id: int) -> bool:
    """Whether a decoder weight of this type is held split: the 32-weight formats always; Q4_K where it has the
    layout and x is taken as int16 at load (the default there; in another mode it stays in the file's order)."""
    return type_id in SPLITTABLE or (splittable(type_id) and x_mode() == "int16")


def splittable(type_id: int, library=None) -> bool:
    """Whether rows of this GGUF type have a split layout with these kernels (Q4_K: with AVX-512 VNNI)."""
    if type_id in SPLITTABLE:
        return True
    lib = library if library is not None else load()
    return lib is not None and bool(lib.lib.dsv41_gguf_splittable(type_id))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Intel Sapphire Rapids and later), which oneDNN's bf16 GEMM uses."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in info)
    except OSError:
        return False


# A bf16 prefill chunk of at most this many rows multiplies the blocks tile by tile (GGUFMatrix.mm_bf16); a longer
# one dequantises each matrix to bf16 for one GEMM. Where the crossing lies depends on the GEMM
# (benchmarks/tiled_rows.py): without AMX (AMD EPYC, results/tiled-rows/) the tiled product wins up to 256 rows and
# the GEMM at 512; with AMX's bf16 tiles (Intel Xeon) the GEMM wins from about 28 rows on the default model (at 128
# rows 80 against 202 ms, results/tiled-rows-xeon/) and from about 40 on a Q4_K_M file (258 against 596 ms,
# results/tiled-rows-kquants/).
TILED_ROWS = 32 if cpu_has_amx() else 256
_SPLIT_FLAG = 256


@dataclass
class GGUFMatrix:
    """A [rows, cols] matrix as GGUF blocks: `data` uint8 [rows, cols / block weights * block bytes], each row's
    blocks in the file's order, or in the split layout when `split` (as_split; file_blocks gives the file's)."""

    type_id: int
    data: torch.Tensor
    cols: int
    split: bool = False

    def __post_init__(self):
        if self.type_id not in BY_TYPE:
            raise ValueError(f"GGUF type {self.type_id} is not held in its block format here")
        _, per, size = BY_TYPE[self.type_id]
        if self.cols % per or self.data.dtype != torch.uint8 or self.data.dim() != 2 or \
                self.data.shape[1] != self.cols // per * size:
            raise ValueError(f"{self.format}: {tuple(self.data.shape)} bytes do not hold rows of {self.cols} weights")
        if self.data.device.type != "cpu":
            raise ValueError(f"{self.format} blocks are multiplied on the CPU; these are on {self.data.device}")
        if self.split and not splittable(self.type_id):
            raise ValueError(f"{self.format} has no split layout")
        self.data = self.data.contiguous()

    @property
    def kernel_type(self) -> int:
        """The type as the C kernels take it (the split layout flagged)."""
        return self.type_id | (_SPLIT_FLAG if self.split else 0)

    def _rearrange(self, data: torch.Tensor, to_split: bool, library=None) -> torch.Tensor:
        """`data` (this matrix's shape of bytes) rearranged in place to the split layout or back; returns it."""
        status = self._lib(library).dsv41_gguf_split(self.type_id, data.data_ptr(), self.rows, self.cols,
                                                     int(to_split))
        if status != 0:
            raise RuntimeError(f"rearranging {self.format} rows failed ({status})")
        return data

    def as_split(self, library=None) -> GGUFMatrix:
        """This matrix in the split row layout (a copy; itself when already so or when its format has none)."""
        if self.split or not splittable(self.type_id, library):
            return self
        return GGUFMatrix(self.type_id, self._rearrange(self.data.clone(), True, library), self.cols, split=True)

    def file_blocks(self, library=None) -> torch.Tensor:
        """The bytes in the file's own block order (a copy when held split)."""
        return self._rearrange(self.data.clone(), False, library) if self.split else self.data

    @property
    def format(self) -> str:
        return BY_TYPE[self.type_id][0]

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_reader_tensor(cls, tensor) -> GGUFMatrix:
        """From a gguf.GGUFReader tensor (its `data` is the file's bytes, memory-mapped, [rows, row_bytes])."""
        import warnings

        raw = np.ascontiguousarray(tensor.data)
        cols = int(tensor.shape[0])  # GGUF lists the innermost dimension first
        with warnings.catch_warnings():  # the file's pages, mapped read-only: never written through this tensor
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(raw.view(np.uint8).reshape(raw.shape[0], -1))
        return cls(int(tensor.tensor_type), data, cols)

    def _lib(self, library=None):
        if library is not None:  # a variant build (the tests run the AVX2 path on an AVX-512 machine too)
            return library.lib
        lib = load()
        if lib is None:
            from .library import unavailable_reason

            raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
        return lib.lib

    def dequantize(self, library=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, cols]: every weight's value as the GGUF definition gives it (into `out` when given; a
        bfloat16 `out` gets those values rounded to nearest even, as .to(torch.bfloat16) would, in one pass)."""
        if out is None:
            out = torch.empty(self.rows, self.cols, dtype=torch.float32)
        elif out.dtype not in (torch.float32, torch.bfloat16) or out.shape != (self.rows, self.cols) \
                or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous float32 or bfloat16 [{self.rows}, {self.cols}] on the CPU")
        _, per, _ = BY_TYPE[self.type_id]
        lib = self._lib(library)
        write = lib.dsv41_gguf_dequant if out.dtype == torch.float32 else lib.dsv41_gguf_dequant_bf16
        status = write(self.kernel_type, self.data.data_ptr(), out.data_ptr(), self.rows * self.cols // per,
                       self.cols // per, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"dequantising {self.format} failed ({status})")
        return out

    def mm_bf16(self, x: torch.Tensor, out: torch.Tensor | None = None, library=None) -> torch.Tensor:
        """x [m, cols] (bf16) times the matrix's values rounded to bf16, accumulated in float32: [m, rows] float32
        (into `out`, which may be a column slice of a wider row-major tensor). For a few rows (a short prefill
        chunk): the blocks are dequantised a tile at a time into cache, never to memory."""
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.cols or x.stride(1) != 1
                or x.device.type != "cpu"):
            raise ValueError(f"x must be bf16 [m, {self.cols}] with contiguous rows, on the CPU")
        m = x.shape[0]
        out = torch.empty(m, self.rows, dtype=torch.float32) if out is None else out
        if out.dtype != torch.float32 or out.shape != (m, self.rows) or out.stride(1) != 1 or out.device.type != "cpu":
            raise ValueError(f"out must be float32 [{m}, {self.rows}] with contiguous rows, on the CPU")
        status = self._lib(library).dsv41_gguf_mm_bf16(self.kernel_type, self.data.data_ptr(), self.rows, self.cols,
                                                       x.data_ptr(), m, x.stride(0), out.data_ptr(), out.stride(0),
                                                       torch.get_num_threads())
        if status != 0:
            raise (MemoryError if status == -2 else RuntimeError)(f"the {self.format} bf16 product failed ({status})")
        return out

    def finite(self) -> bool:
        """Whether every weight is a finite number (damaged bytes decode to NaN / infinite scales), read from the
        blocks' float16 scales alone: no dequantised copy."""
        _, per, size = BY_TYPE[self.type_id]
        if self.split and self.type_id not in SPLITTABLE:  # Q4_K: its heads among the nibbles (read in the file's order)
            return GGUFMatrix(self.type_id, self.file_blocks(), self.cols).finite()
        if self.split:  # a row's scales come first, side by side
            scales = self.data[:, :self.cols // per * (4 if self.type_id == 3 else 2)]
            return bool(torch.isfinite(scales.contiguous().view(torch.float16)).all())
        blocks = self.data.view(-1, size)
        return all(bool(torch.isfinite(blocks[:, at:at + 2].contiguous().view(torch.float16)).all())
                   for at in _HALF_FIELDS[self.format])

    def select_rows(self, index: torch.Tensor) -> GGUFMatrix:
        """The rows `index` (in that order) as a matrix of their own: a row's blocks hold that row alone."""
        return GGUFMatrix(self.type_id, self.data[index], self.cols, self.split)

    def matvec(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False,
               library=None) -> torch.Tensor:
        """W x for a float32 vector x [cols] (into `out`, added to it when `accumulate`)."""
        if x.dtype != torch.float32 or x.numel() != self.cols or x.device.type != "cpu":
            raise ValueError(f"x must be float32 [{self.cols}] on the CPU")
        x = x.contiguous()
        out = torch.empty(self.rows, dtype=torch.float32) if out is None else out
        if not cpu_vector(out, self.rows):  # the C product writes rows float32s
            raise ValueError(f"out must be float32 contiguous [{self.rows}] on the CPU")
        status = self._lib(library).dsv41_mv_gguf(self.kernel_type, self.data.data_ptr(), x.data_ptr(), out.data_ptr(),
                                           self.rows, self.cols, int(accumulate), torch.get_num_threads())
        if status == -2:  # no memory for a wide row's scratch: out not written
            raise MemoryError(f"out of memory for a [{self.rows}, {self.cols}] {self.format} product's scratch")
        if status != 0:
            raise RuntimeError(f"the {self.format} product failed ({status})")
        return out


class GGUFWeight(KernelMatrix):
    """A decoder matrix [out, in] held as GGUF blocks: `parts` stacked by rows, each in its own block format.

    Held as `runs`: neighbouring parts of one format joined into one matrix (one product where a layer's q, k and v
    share a format, instead of three), in the split row layout where the format has one; `parts` are views of
    their rows (what the model's modules point at). The parts given are copied: they may be the file's
    read-only pages, and nothing keeps them."""

    def __init__(self, parts: list[GGUFMatrix]):
        if not parts or len({p.cols for p in parts}) != 1:
            raise ValueError("a GGUFWeight stacks GGUF matrices of the same width")
        self.shape = (sum(p.rows for p in parts), parts[0].cols)
        self.bf16_rows = False
        groups: list[list[GGUFMatrix]] = []
        for p in parts:
            if groups and groups[-1][0].type_id == p.type_id and groups[-1][0].split == p.split:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.runs, self.parts = [], []
        for group in groups:
            data = torch.cat([p.data for p in group]) if len(group) > 1 else group[0].data.clone()
            run = GGUFMatrix(group[0].type_id, data, self.shape[1], group[0].split)
            if held_split(run.type_id) and not run.split:  # data is this run's own copy: rearranged in place
                run._rearrange(data, True)
                run.split = True
            self.runs.append(run)
            row = 0
            for p in group:
                self.parts.append(GGUFMatrix(run.type_id, run.data[row:row + p.rows], run.cols, run.split))
                row += p.rows

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def formats(self) -> list[str]:
        return [p.format for p in self.parts]

    def matvec(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        out = torch.empty(self.shape[0], dtype=torch.float32) if out is None else out
        if out.shape != (self.shape[0],):  # a shorter out would give each run a clamped slice to write past
            raise ValueError(f"out must be [{self.shape[0]}], not {tuple(out.shape)}")
        row = 0
        for run in self.runs:
            run.matvec(x, out[row:row + run.rows], accumulate)
            row += run.rows
        return out

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        direct = dtype in (torch.float32, torch.bfloat16)  # written by the kernels, no float32 copy in between
        out = torch.empty(self.shape, dtype=dtype if direct else torch.float32)
        row = 0
        for run in self.runs:
            run.dequantize(out=out[row:row + run.rows])
            row += run.rows
        return out if direct else out.to(dtype)

    def bf16_weight(self) -> torch.Tensor:
        return self.dense(torch.bfloat16)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """As KernelMatrix.linear; a bf16 chunk of at most TILED_ROWS rows multiplies the blocks as they are
        dequantised into cache (mm_bf16) instead of through a bf16 copy of the whole matrix."""
        if not (self.bf16_rows and x.dtype == torch.float32 and 1 < x.shape[0] <= TILED_ROWS and x.dim() == 2):
            return super().linear(x, bias, residual)
        rows = x.to(torch.bfloat16)
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        row = 0
        for run in self.runs:
            run.mm_bf16(rows, out[:, row:row + run.rows])
            row += run.rows
        if bias is not None:
            out += bias
        return out if residual is None else out.add_(residual)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Selected rows' values (an embedding lookup)."""
        if len(self.parts) != 1:
            raise ValueError("rows() of a stacked GGUFWeight")
        if index.numel() == 1:  # one token (a decode step): its row as it is held, no gathered copy
            return self.row_into(int(index.reshape(())), torch.empty(self.shape[1]))[None].to(dtype)
        return self.parts[0].select_rows(index).dequantize().to(dtype)

    def row_writer(self, out: torch.Tensor):
        """A function of a row number (range-checked) that writes that row's values into `out` (float32 [cols],
        contiguous, on the CPU), read where the row is held: one kernel call and no tensor made. Bound once, so a
        decode step's embedding checks `out` and looks up the pointers here, not per token."""
        if len(self.parts) != 1:
            raise ValueError("row_writer() of a stacked GGUFWeight")
        part = self.parts[0]
        if out.dtype != torch.float32 or out.shape != (part.cols,) or not out.is_contiguous() or \
                out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous float32 [{part.cols}] on the CPU")
        write, kind, base, stride = part._lib().dsv41_gguf_dequant, part.kernel_type, part.data.data_ptr(), \
            part.data.stride(0)
        rows, blocks, target = part.rows, part.cols // BY_TYPE[part.type_id][1], out.data_ptr()
        keep = (part.data, out)  # what the pointers point into, alive as long as the function

        def into(row: int) -> torch.Tensor:
            if not 0 <= row < rows:
                raise IndexError(f"row {row} of a matrix of {rows} rows")
            status = write(kind, base + row * stride, target, blocks, blocks, 1)
            if status != 0:
                raise RuntimeError(f"dequantising a {part.format} row failed ({status})")
            return keep[1]

        return into

    def row_into(self, row: int, out: torch.Tensor) -> torch.Tensor:
        """Row `row`'s values into `out` (row_writer's, once). Returns out."""
        return self.row_writer(out)(row)
