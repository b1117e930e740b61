"""StreamingLLM baseline: the sinks and the most recent entries; no attention is looked at."""

from __future__ import annotations

import torch

from ..storage import LayerKV
from .base import Policy


class Streaming(Policy):
    name = "streaming"
    uses_attention = False

    def rank(self, layer: LayerKV, when: str, generator: torch.Generator | None = None) -> torch.Tensor:
        return layer.positions[:, : layer.length].float()
