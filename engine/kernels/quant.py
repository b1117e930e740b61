"""The one int8 quantizer: symmetric, one float32 scale per row of the last dimension.

Used for the KV cache in INT8 mode (a scale per token and head) and for weights held as int8 for the CPU
kernels (a scale per output row).
"""

from __future__ import annotations

import torch

EPS = 1e-8  # the smallest scale numerator: an all-zero row quantizes to zeros, not NaN


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q int8 [..., n], scale float32 [..., 1]) with x ~ q * scale and |q| <= 127."""
    xf = x.detach().float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS) / 127.0
    q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight matrix [out, in] -> (int8 [out, in] contiguous, float32 scale [out])."""
    q, scale = quantize_int8(weight)
    return q.contiguous(), scale[:, 0].contiguous()
