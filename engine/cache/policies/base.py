"""The policy protocol: what decides which cache entries matter.

A policy is one small class. The cache calls it at three points and asks it three questions:

    observe(scores, attention, steps, index, prefill)  fold one forward's attention into the entry scores
    rank(layer, when) -> [h, S]                         order entries for a compaction (higher is kept first)
    decode_decay() -> float | None                      how a one-token decode step updates the scores

and reads what it needs: `uses_attention` (whether attention weights are computed for it at all, and whether the
relative threshold applies), `stream_window` (how many of a prefill chunk's last queries score it when the turn
loop does not say) and `waits_for_question` (a document waits unscored for the question of its turn, which then
scores everything at once; a document too large to wait is scored by a probe of that question).

The fused CPU decode step never sees a policy: it applies `scores <- decay * scores + attention` with the decay
`decode_decay()` returns, and a policy whose decode update is not of that form returns None, so every layer is
attended by the cache's own `attend` (called back from C) and `observe` runs. tests/engine/test_policies.py checks,
for every policy, that `observe` of one decode step equals the form `decode_decay()` declares.

`when` is the moment of the compaction:
    STREAM    text compacted as it is read (no question has scored it), and decode-time compactions
    PROBE     a document larger than its headroom, scored by its turn's question before the question is read
    QUESTION  the end of a turn's prefill (or a rebuild / reconfigure): the question has scored every entry

Adding a policy: one file in this folder with a subclass, and one line in policies/__init__.py's registry.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..storage import LayerKV

STREAM, PROBE, QUESTION = "stream", "probe", "question"


class Policy:
    """Scores are decayed accumulated attention: s <- decay^steps * s + a (`decay` 1.0 unless a subclass says)."""

    name: ClassVar[str] = ""
    uses_attention: ClassVar[bool] = True
    waits_for_question: ClassVar[bool] = False

    def __init__(self, settings) -> None:
        self.settings = settings

    @property
    def decay(self) -> float:
        return 1.0

    @property
    def stream_window(self) -> int | None:
        """Queries of a prefill chunk that score it when nobody says: None is every query (as a decode step
        scores with every query it makes)."""
        return None

    def observe(self, scores: torch.Tensor, attention: torch.Tensor, steps: int,
                index: torch.Tensor | None = None, *, prefill: bool) -> None:
        """scores [h, S] in place; attention [h, S] over all entries, or [h, k] over `index` (a sparse CSA2
        step); `steps` scoring queries summed in `attention` (one per decode step, the window for a prefill
        chunk). Tokens read without scoring do not count as steps: a document waiting for its question does
        not age what earlier turns found important."""
        if self.decay != 1.0:
            scores.mul_(self.decay**steps)
        add(scores, attention, index)

    def rank(self, layer: LayerKV, when: str, generator: torch.Generator | None = None) -> torch.Tensor:
        """[h, S] float: higher is kept first."""
        return layer.scores[:, : layer.length]

    def decode_decay(self) -> float | None:
        """The fused step's update for one decode token, scores <- decay * scores + attention; None when
        `observe` must run instead (never called for a policy that does not use attention)."""
        return self.decay


def add(scores: torch.Tensor, attention: torch.Tensor, index: torch.Tensor | None) -> None:
    if index is None:
        scores.add_(attention)
    else:
        scores.scatter_add_(1, index, attention)


POOL_KERNEL = 7  # neighbours share a kept entry's rank (SnapKV's pooling): facts survive as phrases


def pooled(scores: torch.Tensor, kernel: int = POOL_KERNEL) -> torch.Tensor:
    """[h, n]: each entry ranked by the best score within `kernel` positions of it (max-pool), ties broken by
    its own score, so a pooled run keeps its strongest tokens first."""
    if kernel <= 1 or scores.shape[1] < kernel:
        return scores
    best = torch.nn.functional.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return best + 1e-3 * scores
