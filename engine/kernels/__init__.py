"""Our CPU kernels: the C source and its build (library), weights held for it (packed; GGUF blocks: gguf_blocks), the one integer
quantizer (quant), the whole-decoder decode step in one call (fused) and top-k sampling in one call (sample). Nothing
here knows transformers or the cache's policies: the fused step takes plain tensors and a decay."""

from .fused import FusedDecodeStep
from .gguf_blocks import GGUFMatrix, GGUFWeight
from .library import KernelLibrary, KernelsUnavailable, build, load, unavailable_reason
from .packed import KernelMatrix, PackedMatrix, bf16_exact, bf16_products_fast
from .quant import quantize_int8, quantize_rows_int8

__all__ = ["FusedDecodeStep", "GGUFMatrix", "GGUFWeight", "KernelLibrary", "KernelMatrix", "KernelsUnavailable",
           "PackedMatrix", "bf16_exact", "bf16_products_fast", "build", "load",
           "quantize_int8", "quantize_rows_int8", "unavailable_reason"]
