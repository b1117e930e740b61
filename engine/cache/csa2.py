"""CSA2 — Compressed Sparse Attention v2: rank-r screening, then exact attention on the top-k.

Screening: q.k ~ (qP).(kP) with P [h, d, r] the top-r eigenvectors of the stored keys' second
moment (per layer and KV head, fitted after each prefill). Projected keys kP are a side cache
[h, capacity, r] kept next to the keys. Per KV head, a candidate's screen score is the max over
the group's query heads. Sinks and the recent window are always attended.
"""

from __future__ import annotations

import torch

from .storage import LayerKV


def fit(layer: LayerKV, rank: int) -> None:
    """(Re)fit the projection on the stored keys and rebuild the projected side cache."""
    n = layer.length
    if n == 0:
        return
    keys = layer.read_keys().float()  # [h, S, d]
    moment = torch.matmul(keys.transpose(1, 2), keys) / n  # [h, d, d]
    _, vectors = torch.linalg.eigh(moment)  # ascending eigenvalues
    basis = vectors[:, :, -rank:].contiguous()  # [h, d, r]
    layer.csa2_basis = basis
    proj_dtype = torch.float32 if layer.device.type == "cpu" else layer.dtype
    layer.projected_keys = torch.zeros(layer.kv_heads, layer.capacity, rank, dtype=proj_dtype, device=layer.device)
    layer.projected_keys[:, :n] = torch.matmul(keys, basis).to(proj_dtype)


def project_new(layer: LayerKV, keys: torch.Tensor, start: int) -> None:
    """Project freshly appended keys [h, T, d] into the side cache."""
    if layer.projected_keys is None:
        return
    end = start + keys.shape[1]
    layer.projected_keys[:, start:end] = torch.matmul(keys.float(), layer.csa2_basis).to(layer.projected_keys.dtype)


def protected_counts(n: int, sink: int, recent: int) -> tuple[int, int]:
    n_sink = min(sink, n)
    return n_sink, min(recent, n - n_sink)


def screen(layer: LayerKV, query: torch.Tensor, topk: int, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query [H, 1, d] -> (index [h, K] ascending: sinks + top-k + recent, top-k candidate index [h, k])."""
    n = layer.length
    h = layer.kv_heads
    n_sink, n_recent = protected_counts(n, sink, recent)
    lo, hi = n_sink, n - n_recent
    q = query.view(h, -1, query.shape[-1]).float()  # [h, G, d]
    q_proj = torch.matmul(q, layer.csa2_basis)  # [h, G, r]
    approx = torch.matmul(q_proj, layer.projected_keys[:, lo:hi].float().transpose(1, 2))  # [h, G, C]
    approx = approx.amax(dim=1) + layer.log_counts[:, lo:hi]
    k = min(topk, hi - lo)
    top = approx.topk(k, dim=1).indices + lo
    device = query.device
    index = torch.cat(
        [torch.arange(n_sink, device=device).expand(h, -1), top.sort(dim=1).values,
         torch.arange(hi, n, device=device).expand(h, -1)], dim=1)
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
