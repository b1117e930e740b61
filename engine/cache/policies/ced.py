"""CED — the product's policy: decayed accumulated attention, and whole spans kept after a question."""

from __future__ import annotations

import torch

from ..storage import LayerKV
from .base import PROBE, QUESTION, Policy, pooled

SPAN_TOKENS = 16  # a question-aware compaction keeps and drops whole spans of this many positions


class CED(Policy):
    """s <- ced_decay^steps * s + a. A turn's document waits for its question, which then scores it.

    After a question has scored everything (QUESTION), each entry ranks by the total score of its span of
    SPAN_TOKENS positions, so whole spans are kept or dropped and what stays reads as text. Token by token, one
    question after another keeps scattered high-scoring tokens of earlier turns: after 200 short turns at ratio
    0.5 a chat answered 3 of 11 simple questions a fresh chat gets right; with spans 9 (10 uncompressed;
    benchmarks/long_chat.py). Text compacted as it streams in ranks token by token: spans there cost
    language-model quality (perplexity at ratio 0.5 +4.3 % against +1.7 % on 2024-Biden-1). A document scored
    by a probe of its question (PROBE) ranks max-pooled."""

    name = "ced"
    waits_for_question = True

    @property
    def decay(self) -> float:
        return self.settings.ced_decay

    def rank(self, layer: LayerKV, when: str, generator: torch.Generator | None = None) -> torch.Tensor:
        n = layer.length
        scores = layer.scores[:, :n]
        if when == QUESTION and SPAN_TOKENS > 1 and n:
            return span_ranking(scores, layer.positions[:, :n], SPAN_TOKENS)
        if when == PROBE:
            return pooled(scores)
        return scores


def span_ranking(scores: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
    """[h, n]: every entry ranked by the summed score of its span (position // span) over the span's length,
    so a span missing entries ranks below a whole one of the same mean; ties go to the entry's own score."""
    ids = positions.long() // span
    ids = ids - ids.min(dim=1, keepdim=True).values
    total = torch.zeros(scores.shape[0], int(ids.max()) + 1, dtype=scores.dtype, device=scores.device)
    total.scatter_add_(1, ids, scores)
    return torch.gather(total, 1, ids) / span + 1e-3 * scores
