"""The budget (how many entries a cache may store) and the compaction plan (which ones every head keeps).

Policies rank entries (engine.cache.policies); this module turns a ranking into a plan: the protected sinks and
recent window, then the best-ranked entries up to the budget, fewer where the relative threshold drops more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_STORED_ENTRIES = 128
"""Budget floor independent of the recent window: a cache this small is never compacted. Without it the floor
is sink + recent + 1 alone; with a 32-token recent window that is 37 entries, and a 40-token chat would be
compacted (a greedy answer changes) although its whole KV is a few MiB. 128 entries is 5.9 MiB on the default
model in float32 and below every budget the quality benchmark measures (ratio 0.2 of 1k tokens is 205)."""


def budget_for(seen: int, ratio: float, sink: int, recent: int, floor: int = MIN_STORED_ENTRIES) -> int:
    """stored <= max(ceil(ratio * seen), sink + recent + 1, floor)  (docs/design.md, "Budget")."""
    return max(math.ceil(ratio * seen - 1e-9), sink + recent + 1, floor)


@dataclass(frozen=True)
class CompactionPlan:
    keep: torch.Tensor  # [h, K] ascending entry indices kept per head
    drop: torch.Tensor  # [h, D] ascending entry indices dropped per head
    kept_unprotected: torch.Tensor  # [h, K - protected] subset of keep that may absorb merges


def plan_compaction(rank: torch.Tensor, budget: int, *, sink: int, recent: int, threshold: float,
                    scores: torch.Tensor | None = None, floor: int = 0) -> CompactionPlan | None:
    """Choose what every head keeps: protected sinks and recent window, then the best-ranked entries.

    `threshold` (relative to the mean rank of unprotected entries) drops low entries even under
    budget, but never below `floor` stored entries; heads keep the same count (the largest count any head
    wants), so storage stays rectangular.
    The threshold looks at each entry's own score (`scores`, default `rank`); the choice of what to
    keep follows `rank`. Returns None when nothing needs to go.
    """
    return plan_compactions([rank], budget, sink=sink, recent=recent, threshold=threshold,
                            scores=None if scores is None else [scores], floor=floor)[0]


def plan_compactions(ranks: list[torch.Tensor], budget: int, *, sink: int, recent: int, threshold: float,
                     scores: list[torch.Tensor] | None = None, floor: int = 0) -> list[CompactionPlan | None]:
    """plan_compaction of every layer: layers of one shape are planned together, a few tensor operations for all
    of them (one layer at a time, a decode-time compaction of the default model's 30 layers cost ~7 ms of
    operations, as much as a decode step). Each layer's heads keep the count that layer's threshold wants."""
    if len({(r.shape, r.device) for r in ranks}) > 1:
        return [plan_compactions([r], budget, sink=sink, recent=recent, threshold=threshold,
                                 scores=None if scores is None else [s], floor=floor)[0]
                for r, s in zip(ranks, scores or [None] * len(ranks), strict=True)]
    rank = torch.stack(ranks) if len(ranks) > 1 else ranks[0][None]  # [L, h, n]
    layers, h, n = rank.shape
    n_sink = min(sink, n)
    n_recent = min(recent, n - n_sink)
    lo, hi = n_sink, n - n_recent  # unprotected range [lo, hi)
    candidates = hi - lo
    keep_unprotected = min(candidates, max(budget - n_sink - n_recent, 0))
    counts = [keep_unprotected] * layers
    if threshold > 0 and candidates > 0:
        own = (rank if scores is None else torch.stack(scores) if len(scores) > 1 else scores[0][None])[..., lo:hi]
        cut = threshold * own.mean(dim=-1, keepdim=True)
        wanted = (own >= cut).sum(dim=-1).amax(dim=-1).tolist()
        counts = [min(keep_unprotected, max(w, floor - n_sink - n_recent)) for w in wanted]
    plans: list[CompactionPlan | None] = [None] * layers
    for count in sorted({c for c in counts if c < candidates}):
        which = [i for i, c in enumerate(counts) if c == count]
        group = rank if len(which) == layers else rank[which]
        g = group.shape[0]
        kept = torch.ones(g, h, n, dtype=torch.bool, device=rank.device)  # sinks and recent window: protected
        kept[..., lo:hi] = largest(group[..., lo:hi], count)
        keep = kept.nonzero()[:, -1].view(g, h, -1)  # ascending per head
        drop = (~kept).nonzero()[:, -1].view(g, h, -1)
        for j, i in enumerate(which):
            plans[i] = CompactionPlan(keep=keep[j], drop=drop[j], kept_unprotected=keep[j, :, n_sink:n_sink + count])
    return plans


def largest(x: torch.Tensor, count: int) -> torch.Tensor:
    """A mask [..., m] of the `count` largest entries of each row of x [..., m]: the entries topk keeps. One selection
    (kthvalue) and a comparison instead of topk and a sort of its indices: 2.5 against 10 ms for a question-aware
    compaction of the default model's 30 layers at 7.4k tokens (2 threads; a one-off measurement). Where a row has
    values tying at the boundary (or NaN), topk itself decides, as before (its choice among equal values is its own:
    rare, but real scores do tie)."""
    m = x.shape[-1]
    if count <= 0 or count >= m:
        return torch.full(x.shape, count > 0, dtype=torch.bool, device=x.device)
    t = x.kthvalue(m - count + 1, dim=-1, keepdim=True).values  # the count-th largest
    mask = x >= t
    if torch.equal(mask.sum(dim=-1), torch.full(x.shape[:-1], count, device=x.device)):
        return mask  # exactly count at or above it: no tie at the boundary
    return torch.zeros_like(mask).scatter_(-1, x.topk(count, dim=-1).indices, True)


def explain_ratio(*, seen: int, stored: int, byte_ratio: float, settings, threshold_applies: bool) -> str:
    """Why the cache's byte ratio (stored / uncompressed bytes) is not the ratio the slider asks for, in words for
    the memory panel ('' when they agree within 2 %): the budget floor or protected window keeps a short chat
    whole, a reply's entries wait for the turn's compaction, the threshold removed more, INT8 bytes, and the
    bookkeeping each entry carries (position, score, merge count). `stored`: entries per layer and head, the layers'
    mean (DSV41Cache.stored), so stored / seen is the share of the KV kept when the threshold cut layers apart."""
    s = settings
    if seen <= 0 or stored <= 0:
        return ""
    target = s.kv_cache_ratio
    token_ratio = stored / seen
    budget = budget_for(seen, target, s.ced_sink_tokens, s.ced_recent_tokens, s.min_entries)
    reasons = []
    if target < 1.0 and token_ratio > target * 1.02:
        if stored > budget:
            reasons.append(f"{stored - budget:,} reply entries wait for the turn's compaction")
        elif budget > math.ceil(target * seen) and stored >= min(seen, budget) - 1:
            reasons.append(f"a short chat is kept whole (floor {budget:,} entries)" if stored >= seen - 1 else
                           f"the cache never keeps fewer than {budget:,} entries")
    elif token_ratio < min(target, budget / seen) * 0.98:
        if threshold_applies and s.ced_threshold > 0:
            reasons.append(f"threshold {s.ced_threshold:.2f} removed more")
        else:
            reasons.append("compacted further")
    bytes_factor = byte_ratio / token_ratio
    if s.kv_int8:
        reasons.append(f"INT8: ×{bytes_factor:.2f} of the bytes")
    elif bytes_factor > 1.02:
        reasons.append(f"+{(bytes_factor - 1) * 100:.0f} % for positions and scores")
    if not reasons and abs(byte_ratio - target) <= 0.02 * max(target, 1e-9):
        return ""
    return "; ".join(reasons)
