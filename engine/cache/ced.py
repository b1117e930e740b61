"""CED — Cache Eviction Distillation: importance scores and compaction (evict or merge).

Scores: s <- decay^dt * s + a, where a is the attention an entry received in the step, summed over
the query heads of its GQA group (and over the scoring window's queries during prefill).
Baseline policies share the same compaction so the benchmark compares them at equal budgets:
  ced        decayed accumulated attention (the product)
  h2o        accumulated attention, no decay (Heavy-Hitter Oracle)
  snapkv     attention of the last prefill window only (the question, when it comes last)
  streaming  sinks + most recent (StreamingLLM)
  random     uniform random choice
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .storage import LayerKV


@dataclass(frozen=True)
class CompactionPlan:
    keep: torch.Tensor  # [h, K] ascending entry indices kept per head
    drop: torch.Tensor  # [h, D] ascending entry indices dropped per head
    kept_unprotected: torch.Tensor  # [h, K - protected] subset of keep that may absorb merges


def observe(layer: LayerKV, policy: str, decay: float, attention: torch.Tensor, tokens: int,
            index: torch.Tensor | None = None, *, prefill: bool) -> None:
    """Fold one step's attention into the layer's scores: s <- decay^steps * s + attention.

    `tokens` is the number of scoring steps (queries) the attention sums: one per decode step, the
    window's queries for a prefill chunk. Tokens read without scoring (a document waiting for its
    question) do not count: measured on three-turn conversations (document 1 + question, document 2 +
    an unrelated question, then document 1's question again), aging by every token read forgot
    document 1 entirely at ratio 0.5, like SnapKV.
    attention: [h, S] over all entries, or [h, k] over `index` (sparse CSA2 step).
    """
    n = layer.length
    scores = layer.scores[:, :n]
    if policy == "ced":
        scores.mul_(decay**tokens)
    elif policy == "snapkv" and prefill:
        scores.zero_()
    elif policy not in ("h2o", "snapkv"):
        return  # streaming / random do not use attention
    if index is None:
        scores.add_(attention)
    else:
        scores.scatter_add_(1, index, attention)


POOL_KERNEL = 7  # neighbours share a kept entry's rank (SnapKV's pooling): facts survive as phrases
SPAN_TOKENS = 16  # a question-aware compaction keeps and drops whole spans of this many positions


def ranking(layer: LayerKV, policy: str, generator: torch.Generator | None = None, *, pooled: bool = False,
            spans: bool = False) -> torch.Tensor:
    """[h, S] float: higher is kept first.

    `spans` (CED, the compaction after a turn's question has scored everything): each entry ranks by the
    total score of its span of SPAN_TOKENS positions, so whole spans are kept or dropped and what stays reads
    as text. Token by token, one question after another keeps scattered high-scoring tokens of earlier
    turns: after 200 short turns at ratio 0.5 a chat answered 3 of 11 simple questions a fresh chat gets
    right; with spans 9 (10 uncompressed; benchmarks/long_chat.py). Text compacted as it streams in (no question
    has scored it yet) ranks token by token: spans there cost language-model quality (perplexity at ratio
    0.5 +4.3 % against +1.7 % on 2024-Biden-1).
    `pooled` (the other policies' question-aware compaction): neighbours share a kept entry's rank
    (max-pool), SnapKV's way of keeping facts as phrases."""
    n = layer.length
    if policy == "streaming":
        return layer.positions[:, :n].float()
    if policy == "random":
        return torch.rand(layer.kv_heads, n, generator=generator).to(layer.device)
    scores = layer.scores[:, :n]
    if spans and policy == "ced" and SPAN_TOKENS > 1 and n:
        return span_ranking(scores, layer.positions[:, :n], SPAN_TOKENS)
    if pooled and policy in ("ced", "snapkv") and POOL_KERNEL > 1 and n >= POOL_KERNEL:
        pooled = torch.nn.functional.max_pool1d(scores[:, None], POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)[:, 0]
        # ties broken by the entry's own score, so a pooled run keeps its strongest tokens first
        return pooled + 1e-3 * scores
    return scores


def span_ranking(scores: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
    """[h, n]: every entry ranked by the summed score of its span (position // span) over the span's length,
    so a span missing entries ranks below a whole one of the same mean; ties go to the entry's own score."""
    ids = positions.long() // span
    ids = ids - ids.min(dim=1, keepdim=True).values
    total = torch.zeros(scores.shape[0], int(ids.max()) + 1, dtype=scores.dtype, device=scores.device)
    total.scatter_add_(1, ids, scores)
    return torch.gather(total, 1, ids) / span + 1e-3 * scores


def plan_compaction(rank: torch.Tensor, budget: int, *, sink: int, recent: int, threshold: float,
                    scores: torch.Tensor | None = None, floor: int = 0) -> CompactionPlan | None:
    """Choose what every head keeps: protected sinks and recent window, then the best-ranked entries.

    `threshold` (relative to the mean rank of unprotected entries) drops low entries even under
    budget, but never below `floor` stored entries; heads keep the same count (the largest count any head
    wants), so storage stays rectangular.
    The threshold looks at each entry's own score (`scores`, default `rank`); the choice of what to
    keep follows `rank`. Returns None when nothing needs to go.
    """
    h, n = rank.shape
    n_sink = min(sink, n)
    n_recent = min(recent, n - n_sink)
    lo, hi = n_sink, n - n_recent  # unprotected range [lo, hi)
    candidates = hi - lo
    keep_unprotected = min(candidates, max(budget - n_sink - n_recent, 0))
    middle = rank[:, lo:hi]
    if threshold > 0 and candidates > 0:
        own = (scores if scores is not None else rank)[:, lo:hi]
        cut = threshold * own.mean(dim=1, keepdim=True)
        wanted = int((own >= cut).sum(dim=1).max().item())
        keep_unprotected = min(keep_unprotected, max(wanted, floor - n_sink - n_recent))
    if keep_unprotected >= candidates:
        return None
    device = rank.device
    top = middle.topk(keep_unprotected, dim=1).indices.sort(dim=1).values + lo if keep_unprotected else \
        torch.empty(h, 0, dtype=torch.long, device=device)
    sinks = torch.arange(n_sink, device=device).expand(h, -1)
    recents = torch.arange(hi, n, device=device).expand(h, -1)
    keep = torch.cat([sinks, top, recents], dim=1)
    dropped_mask = torch.ones(h, n, dtype=torch.bool, device=device)
    dropped_mask.scatter_(1, keep, False)
    drop = dropped_mask.nonzero()[:, 1].view(h, -1)
    return CompactionPlan(keep=keep, drop=drop, kept_unprotected=top)


def merge_into_kept(layer: LayerKV, plan: CompactionPlan, chunk: int = 1024) -> None:
    """Fold each dropped entry into its most similar kept (unprotected) slot.

    The slot becomes the count-weighted mean of its keys and values; its count n adds up the tokens
    absorbed, and attention adds log(n) to its logit, so it stands for the mass it absorbed.
    """
    kept, drop = plan.kept_unprotected, plan.drop
    if kept.shape[1] == 0 or drop.shape[1] == 0:
        return
    kk, vk = layer.read_keys(kept).float(), layer.read_values(kept).float()
    kd, vd = layer.read_keys(drop).float(), layer.read_values(drop).float()
    nk = torch.gather(layer.log_counts, 1, kept).exp()
    nd = torch.gather(layer.log_counts, 1, drop).exp()
    kk_unit = torch.nn.functional.normalize(kk, dim=-1)
    target = torch.empty_like(drop)
    for start in range(0, drop.shape[1], chunk):  # bound the [h, D, K] similarity matrix
        part = torch.nn.functional.normalize(kd[:, start:start + chunk], dim=-1)
        target[:, start:start + chunk] = torch.matmul(part, kk_unit.transpose(1, 2)).argmax(dim=-1)
    d = kk.shape[-1]
    idx = target[..., None].expand(-1, -1, d)
    key_sum = (kk * nk[..., None]).scatter_add_(1, idx, kd * nd[..., None])
    value_sum = (vk * nk[..., None]).scatter_add_(1, idx, vd * nd[..., None])
    counts = nk.scatter_add(1, target, nd)
    new_keys = key_sum / counts[..., None]
    new_values = value_sum / counts[..., None]
    dropped_scores = torch.gather(layer.scores, 1, drop)
    kept_scores = torch.gather(layer.scores, 1, kept).scatter_add_(1, target, dropped_scores)
    write_entries(layer, kept, new_keys, new_values)
    layer.log_counts.scatter_(1, kept, counts.log())
    layer.scores.scatter_(1, kept, kept_scores)
    layer.merged_any = True
    layer.merged_tokens += drop.shape[1]


def write_entries(layer: LayerKV, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Overwrite entries at `index` [h, k] with keys/values [h, k, d] (requantized in INT8 mode)."""
    from .storage import quantize_int8

    d = layer.head_dim
    idx = index[..., None].expand(-1, -1, d)
    if layer.int8:
        kq, ks = quantize_int8(keys)
        vq, vs = quantize_int8(values)
        layer.keys.scatter_(1, idx, kq)
        layer.values.scatter_(1, idx, vq)
        layer.key_scales.scatter_(1, index[..., None], ks)
        layer.value_scales.scatter_(1, index[..., None], vs)
    else:
        layer.keys.scatter_(1, idx, keys.to(layer.dtype))
        layer.values.scatter_(1, idx, values.to(layer.dtype))
    if layer.projected_keys is not None and getattr(layer, "csa2_basis", None) is not None:
        proj = torch.matmul(keys.float(), layer.csa2_basis).to(layer.projected_keys.dtype)
        layer.projected_keys.scatter_(1, index[..., None].expand(-1, -1, proj.shape[-1]), proj)


MIN_STORED_ENTRIES = 128
"""Budget floor independent of the recent window: a cache this small is never compacted. DESIGN.md's floor
is sink + recent + 1 alone; with a 32-token recent window that is 37 entries, and a 40-token chat was
compacted (a greedy answer changed) although its whole KV is a few MiB. 128 entries is 5.9 MiB on the default
model in float32 and below every budget the quality benchmark measures (ratio 0.2 of 1k tokens is 205)."""


def budget_for(seen: int, ratio: float, sink: int, recent: int, floor: int = MIN_STORED_ENTRIES) -> int:
    """stored <= max(ceil(ratio * seen), sink + recent + 1, floor)  (DESIGN.md's Budget plus a floor)."""
    return max(math.ceil(ratio * seen - 1e-9), sink + recent + 1, floor)
