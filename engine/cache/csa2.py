"""CSA2 — Compressed Sparse Attention v2: rank-r screening, an exact re-rank of the best candidates,
then exact attention on the top-k.

Screening approximates every stored entry's logit q.k with rank-r projections: q.k ~ (q Pq).(k Pk).
The projections are fitted per layer and KV head after each prefill (and after a compaction):
  - when the prefill's queries were seen (the normal case): the rank-r bilinear form that minimises the
    expected squared logit error under the observed query and key second moments Cq, Ck. With
    Cq = Lq Lq^T, Ck = Lk Lk^T and Lq^T Lk = U S V^T: Pq = Lq^-T U_r, Pk = Lk^-T V_r S_r;
  - otherwise: the top-r eigenvectors of Ck (Pq = Pk).
Projected keys k Pk are a side cache [h, capacity, r] kept next to the keys. The best `rerank x k`
candidates by screen score are then scored exactly (their keys are gathered; still a fraction of a dense
read), and the top-k of those are attended. Per KV head, a candidate's score is the max over the group's
query heads. Sinks and the recent window are always attended.

Measured on the default model (2k-token speech, recall@256 of the exact top-256, rank 8): key
eigenvectors alone 0.55, the bilinear fit 0.66, key eigenvectors + 3x re-rank 0.78 (x4: 0.95 at 2k),
bilinear + 3x re-rank 0.95.
"""

from __future__ import annotations

import torch

from .attention import decode_attention
from .storage import LayerKV

RERANK = 3  # candidates scored exactly, as a multiple of top-k
RECALL_EVERY = 64  # decode steps between sampled recall measurements (one layer each)
# CSA2 pays only on a long cache: below this many entries per top-k slot, dense attention is faster.
# Measured on 2 CPU cores (default model, top-k 256, every layer at the same length), decode step in ms,
# dense attention inside the fused C step against CSA2's screening in Python (called back from it):
# 16.2 / 24.5 at 2k entries, 21.2 / 26.8 at 4k, 31.7 / 29.2 at 8k -> the crossover is near 7k = 28 x top-k.
# (The per-op Python step, without the fused C step, crosses near 3k: 43/48 ms at 2k, 54/48 at 4k, 72/54 at 8k.)
DENSE_BELOW = 28


def pays(length: int, settings) -> bool:
    """Whether sparse screening is faster than dense attention over `length` stored entries."""
    s = settings
    return length > s.csa2_topk + s.ced_sink_tokens + s.ced_recent_tokens and length >= DENSE_BELOW * s.csa2_topk


def fit_layers(layers: list[LayerKV], settings, head_dim: int) -> None:
    """Fit every layer where screening pays (rank csa2_rank, default head_dim / 8); drop the side cache elsewhere."""
    if settings.csa2_topk <= 0:
        for layer in layers:
            layer.projected_keys = None
        return
    rank = settings.csa2_rank or max(1, head_dim // 8)
    for layer in layers:
        if pays(layer.length, settings):
            fit(layer, rank)
        else:  # short cache: dense attention, no side cache to pay for
            layer.projected_keys = None


def sparse_attention(layer: LayerKV, query: torch.Tensor, scaling: float, settings):
    """One decode query [H, 1, d] against the screened entries: (output [H, 1, d], probs [H, 1, K], the
    attended index [h, K], the top-k candidates [h, k])."""
    s = settings
    index, top = screen(layer, query, s.csa2_topk, s.ced_sink_tokens, s.ced_recent_tokens)
    keys, values = layer.read_keys(index), layer.read_values(index)
    log_counts = torch.gather(layer.log_counts, 1, index) if layer.merged_any else None
    out, probs = decode_attention(query, keys, values, log_counts, scaling)
    return out, probs, index, top


def observe_queries(layer: LayerKV, query: torch.Tensor) -> None:
    """Accumulate the second moment of prefill queries [H, T, d] per KV head (for the bilinear fit)."""
    h, d = layer.kv_heads, query.shape[-1]
    q = query.reshape(h, -1, d).float()  # query head j belongs to KV head j // groups
    moment = torch.matmul(q.transpose(1, 2), q)
    if layer.query_moment is None:
        layer.query_moment = moment
        layer.query_count = q.shape[1]
    else:
        layer.query_moment += moment
        layer.query_count += q.shape[1]


def _factor(moment: torch.Tensor, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """moment [h, d, d] = L L^T; returns (L, L^-T), eigenvalues floored at eps * the largest."""
    w, v = torch.linalg.eigh(moment)
    w = w.clamp_min(eps * w[:, -1:].clamp_min(1e-12))
    root = w.sqrt()[:, None, :]
    return v * root, v / root


def bases(keys: torch.Tensor, query_moment: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-r projections (query basis, key basis) [h, d, r] for keys [h, S, d] (float32) and the mean query
    second moment [h, d, d] (None when no queries were seen: the keys' top eigenvectors for both)."""
    key_moment = torch.matmul(keys.transpose(1, 2), keys) / keys.shape[1]  # [h, d, d]
    if query_moment is None:
        _, vectors = torch.linalg.eigh(key_moment)  # ascending eigenvalues
        basis = vectors[:, :, -rank:].contiguous()
        return basis, basis
    lq, lq_inv_t = _factor(query_moment)
    lk, lk_inv_t = _factor(key_moment)
    u, s, vh = torch.linalg.svd(torch.matmul(lq.transpose(1, 2), lk))
    return (torch.matmul(lq_inv_t, u[:, :, :rank]).contiguous(),
            torch.matmul(lk_inv_t, vh.transpose(1, 2)[:, :, :rank] * s[:, None, :rank]).contiguous())


def fit(layer: LayerKV, rank: int) -> None:
    """(Re)fit the projections on the stored keys (and seen queries) and rebuild the projected side cache."""
    n = layer.length
    if n == 0:
        return
    keys = layer.read_keys().float()  # [h, S, d]
    seen = layer.query_moment is not None and layer.query_count > 0
    query_basis, key_basis = bases(keys, layer.query_moment / layer.query_count if seen else None, rank)
    layer.csa2_basis = key_basis
    layer.csa2_query_basis = query_basis
    proj_dtype = torch.float32 if layer.device.type == "cpu" else layer.dtype
    layer.projected_keys = torch.zeros(layer.kv_heads, layer.capacity, rank, dtype=proj_dtype, device=layer.device)
    layer.projected_keys[:, :n] = torch.matmul(keys, key_basis).to(proj_dtype)


def project_new(layer: LayerKV, keys: torch.Tensor, start: int) -> None:
    """Project freshly appended keys [h, T, d] into the side cache."""
    if layer.projected_keys is None:
        return
    end = start + keys.shape[1]
    layer.projected_keys[:, start:end] = torch.matmul(keys.float(), layer.csa2_basis).to(layer.projected_keys.dtype)


def protected_counts(n: int, sink: int, recent: int) -> tuple[int, int]:
    n_sink = min(sink, n)
    return n_sink, min(recent, n - n_sink)


def screen(layer: LayerKV, query: torch.Tensor, topk: int, sink: int, recent: int,
           rerank: int = RERANK) -> tuple[torch.Tensor, torch.Tensor]:
    """query [H, 1, d] -> (index [h, K]: sinks + top-k + recent, top-k candidate index [h, k])."""
    n = layer.length
    h = layer.kv_heads
    n_sink, n_recent = protected_counts(n, sink, recent)
    lo, hi = n_sink, n - n_recent
    q = query.view(h, -1, query.shape[-1]).float()  # [h, G, d]
    q_proj = torch.matmul(q, layer.csa2_query_basis)  # [h, G, r]
    approx = torch.matmul(q_proj, layer.projected_keys[:, lo:hi].float().transpose(1, 2))  # [h, G, C]
    approx = approx.amax(dim=1) + layer.log_counts[:, lo:hi]
    k = min(topk, hi - lo)
    pool = min(k * max(rerank, 1), hi - lo)
    top = approx.topk(pool, dim=1, sorted=False).indices + lo  # unsorted: half the time on CPU
    if pool > k:  # exact logits of the candidates, keep the best k
        cand_keys = layer.read_keys(top).float()  # [h, pool, d]
        exact = torch.matmul(q, cand_keys.transpose(1, 2)).amax(dim=1) + torch.gather(layer.log_counts, 1, top)
        top = torch.gather(top, 1, exact.topk(k, dim=1, sorted=False).indices)
    device = query.device
    index = torch.cat(
        [torch.arange(n_sink, device=device).expand(h, -1), top, torch.arange(hi, n, device=device).expand(h, -1)],
        dim=1)
    return index, top


def exact_topk_recall(layer: LayerKV, query: torch.Tensor, candidates: torch.Tensor, sink: int, recent: int) -> float:
    """Fraction of the exact top-k (by true logits over the unprotected range) that screening found."""
    n = layer.length
    h = layer.kv_heads
    n_sink, n_recent = protected_counts(n, sink, recent)
    lo, hi = n_sink, n - n_recent
    q = query.view(h, -1, query.shape[-1]).float()
    keys = layer.read_keys()[:, lo:hi].float()
    exact = torch.matmul(q, keys.transpose(1, 2)).amax(dim=1) + layer.log_counts[:, lo:hi]
    k = candidates.shape[1]
    truth = exact.topk(k, dim=1).indices + lo
    hits = (truth[:, :, None] == candidates[:, None, :]).any(dim=-1).float().mean()
    return float(hits)


__all__ = ["DENSE_BELOW", "RECALL_EVERY", "RERANK", "bases", "exact_topk_recall", "fit", "fit_layers", "observe_queries", "pays",
           "project_new", "screen", "sparse_attention"]
