"""PackedMatrix: a weight matrix held as bf16 or int8 for the CPU kernels, and the one int8 quantizer."""

from __future__ import annotations

import functools
import os

import torch

from .library import KernelLibrary, load, unavailable_reason


def cpu_vector(t: torch.Tensor, n: int) -> bool:
    """Whether `t` is what a C product reads or writes as n float32s: contiguous, on the CPU."""
    return t.dtype == torch.float32 and t.numel() == n and t.is_contiguous() and t.device.type == "cpu"


def bf16_products_fast() -> bool:
    """Whether prefill products may multiply in bf16 on this CPU: where it has bf16 dot products in hardware (AVX-512
    BF16 or AMX, where the bf16 products were measured faster) and oneDNN's bf16 GEMM. On a CPU with AVX2 alone
    torch takes a reference path: a [512, 576] x [576, 1536] product took 751 ms in bf16 against 6.4 ms in float32,
    and our tiled bf16 product (GGUFWeight.mm_bf16) ran 4x slower than dequantising to float32 for one float32 GEMM
    (AMD EPYC, AVX2); on AVX-512 without BF16 oneDNN emulates bf16 (not measured here). Elsewhere the products stay
    float32 (adapter.set_prefill_bf16). DSV41_BF16_PRODUCTS=1 or 0 forces the choice."""
    forced = os.environ.get("DSV41_BF16_PRODUCTS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    try:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return bool(native and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without these checks or without oneDNN: float32 products
        return False


class KernelMatrix:
    """A weight matrix [out, in] our CPU kernels multiply as stored (PackedMatrix; gguf_blocks.GGUFWeight).

    `linear(x)` for one row of float32 activations runs the kernel (`matvec`, float32 accumulation); more rows (a
    prefill chunk) widen the weights to float32 for one GEMM (`dense`), or with `bf16_rows` multiply the rows
    rounded to bf16 by the weights as bf16 (`bf16_weight`; accumulated in float32, the result rounded to bf16:
    1.8x faster prefill on a CPU with AMX, +0.1 % perplexity on the default model; adapter.set_prefill_bf16
    decides). All give float32 results whatever the stored format; other activation dtypes are converted in and
    out. A subclass gives shape, nbytes, matvec, dense, rows and bf16_weight.
    """

    shape: tuple[int, int]
    bf16_rows: bool = False

    def matvec(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def bf16_weight(self) -> torch.Tensor | None:
        """The matrix as bf16 for bf16 prefill products when that is what it holds (or widens to exactly)."""
        return None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) x [T, in] @ W^T (+ bias) -> [T, out] in x's dtype."""
        dtype = x.dtype
        if x.shape[0] == 1:
            native = dtype == torch.float32
            vector = x.view(-1) if native and x.is_contiguous() else x[0].to(torch.float32).contiguous()
            if residual is not None:
                out = residual.reshape(-1).clone() if native else residual[0].to(torch.float32, copy=True)
                self.matvec(vector, out, accumulate=True)
            else:
                out = self.matvec(vector)
            if bias is not None:
                out += bias if native else bias.float()
            return out.view(1, -1) if native else out.to(dtype)[None]
        weight = self.bf16_weight() if self.bf16_rows and dtype == torch.float32 else None
        if weight is not None:
            # bf16 x bf16 products with float32 accumulation (AMX / AVX-512 BF16 in oneDNN); torch returns the
            # result rounded to bf16. The activations and the products' results are what is rounded; bias,
            # residual and everything after stay float32
            out = torch.nn.functional.linear(x.to(torch.bfloat16), weight).float()
            if bias is not None:
                out += bias
            return out if residual is None else residual + out
        weight = self.dense(dtype)
        if residual is not None and bias is None:
            return torch.addmm(residual, x, weight.t())
        out = torch.nn.functional.linear(x, weight, bias)
        return out if residual is None else residual + out


class PackedMatrix(KernelMatrix):
    """A weight matrix [out, in] held as bf16 (or int8 + a float32 scale per row) for the CPU kernels."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, library: KernelLibrary | None = None):
        if data.dim() != 2 or not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("PackedMatrix needs a contiguous 2-D CPU tensor")
        if scale is None and data.dtype != torch.bfloat16:
            raise ValueError("PackedMatrix stores bf16, or int8 with a scale per row")
        if scale is not None and (data.dtype != torch.int8 or scale.shape != (data.shape[0],)
                                  or scale.device.type != "cpu"):
            raise ValueError("an int8 PackedMatrix needs one float32 scale per row")
        self.data = data
        self.scale = scale.float().contiguous() if scale is not None else None
        self.bf16_rows = False
        self.shape = data.shape
        library = library or load()
        if library is None:
            raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
        self._lib = library.lib

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (self.scale.numel() * 4 if self.scale is not None else 0)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.scale is None:
            return self.data.to(dtype)
        return (self.data.to(torch.float32) * self.scale[:, None]).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Selected rows widened (an embedding lookup)."""
        picked = self.data[index].to(torch.float32)
        if self.scale is not None:
            picked = picked * self.scale[index][:, None]
        return picked.to(dtype)

    def matvec(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [in] float32 contiguous -> out [out] float32 (out += W x when accumulate)."""
        rows, cols = self.shape
        if out is None:
            out = torch.empty(rows, dtype=torch.float32)
        if not (cpu_vector(x, cols) and cpu_vector(out, rows)):  # the C product reads cols, writes rows floats
            raise ValueError(f"matvec takes float32 contiguous CPU vectors x [{cols}] and out [{rows}]")
        threads = torch.get_num_threads()
        if self.scale is None:
            status = self._lib.dsv41_mv_bf16(self.data.data_ptr(), x.data_ptr(), out.data_ptr(), rows, cols,
                                             int(accumulate), threads)
            if status != 0:  # -2: no memory for a wide row's scratch, out not written
                raise MemoryError(f"out of memory for a [{rows}, {cols}] product's scratch ({cols * 4} bytes)")
        else:
            self._lib.dsv41_mv_int8(self.data.data_ptr(), self.scale.data_ptr(), x.data_ptr(), out.data_ptr(), rows,
                                    cols, int(accumulate), threads)
        return out

    def bf16_weight(self) -> torch.Tensor | None:
        return self.data if self.scale is None else None


def bf16_exact(tensor: torch.Tensor) -> bool:
    """True when every value of a float32 tensor is a bf16 value (storing it in bf16 loses nothing)."""
    if tensor.dtype == torch.bfloat16:
        return True
    if tensor.dtype != torch.float32:
        return False
    bits = tensor.detach().contiguous().view(torch.int32)
    return not bool((bits & 0xFFFF).any())
