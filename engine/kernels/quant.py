"""The one integer quantizer: symmetric, one float32 scale per row of the last dimension.

int8 for the KV cache in INT8 mode and the cold tier (a scale per token and head) and for weights held as int8
for the CPU kernels (a scale per output row); int16 for the query rows a recall scores int8 cold keys with
(engine.cache.cold.cold_logits: exact integer products, one rounding: integer_products).
"""

from __future__ import annotations

import torch

EPS = 1e-8  # the smallest scale numerator: an all-zero row quantizes to zeros, not NaN


def _quantize(x: torch.Tensor, limit: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.detach().float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS) / float(limit)
    q = torch.round(xf / scale).clamp_(-limit, limit).to(dtype)
    return q, scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q int8 [..., n], scale float32 [..., 1]) with x ~ q * scale and |q| <= 127."""
    return _quantize(x, 127, torch.int8)


def quantize_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q int16 [..., n], scale float32 [..., 1]) with x ~ q * scale and |q| <= 32767 (never -32768:
    a pair of products of two int16 values then always fits an int32 lane)."""
    return _quantize(x, 32767, torch.int16)


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight matrix [out, in] -> (int8 [out, in] contiguous, float32 scale [out])."""
    q, scale = quantize_int8(weight)
    return q.contiguous(), scale[:, 0].contiguous()


def integer_products(rows: torch.Tensor, keys: torch.Tensor, *, split: bool) -> torch.Tensor:
    """rows int16 [h, R, d] x keys int8 [h, C, d] -> [h, R, C] float32: each exact integer sum rounded once. One
    float64 product (exact: the sums stay far below 2^53), or (`split`) two float32 products of the rows' high and
    low bytes, each exact (sums below 2^24), 256 x the first + the second rounded once."""
    if not split:
        return torch.matmul(rows.double(), keys.double().transpose(1, 2)).float()
    rows = rows.int()
    high = torch.div(rows, 256, rounding_mode="floor")
    k = keys.float().transpose(1, 2)
    return torch.matmul(high.float(), k).mul_(256.0).add_(torch.matmul((rows - high * 256).float(), k))
