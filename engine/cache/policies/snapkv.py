"""SnapKV baseline: the attention of a prefill chunk's last queries (the question, when it comes last) decides."""

from __future__ import annotations

import torch

from ..storage import LayerKV
from .base import STREAM, Policy, add, pooled


class SnapKV(Policy):
    """A prefill chunk's observation window (its last `score_window` queries) replaces the scores; decode steps
    add their attention. Question-aware compactions rank max-pooled (SnapKV's pooling)."""

    name = "snapkv"

    @property
    def stream_window(self) -> int | None:
        return self.settings.score_window

    def observe(self, scores: torch.Tensor, attention: torch.Tensor, steps: int,
                index: torch.Tensor | None = None, *, prefill: bool) -> None:
        if prefill:
            scores.zero_()
        add(scores, attention, index)

    def rank(self, layer: LayerKV, when: str, generator: torch.Generator | None = None) -> torch.Tensor:
        scores = layer.scores[:, : layer.length]
        return scores if when == STREAM else pooled(scores)
