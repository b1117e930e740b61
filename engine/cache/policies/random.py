"""Random baseline: a uniform choice of what to keep (beside the sinks and the recent window)."""

from __future__ import annotations

import torch

from ..storage import LayerKV
from .base import Policy


class Random(Policy):
    name = "random"
    uses_attention = False

    def rank(self, layer: LayerKV, when: str, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.rand(layer.kv_heads, layer.length, generator=generator).to(layer.device)
