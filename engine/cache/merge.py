"""CED's merge mode: dropped entries are folded into their most similar kept entry instead of discarded."""

from __future__ import annotations

import torch

from ..kernels.quant import quantize_int8
from .budget import CompactionPlan
from .storage import LayerKV


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
    if layer.projected_keys is not None and layer.csa2_basis is not None:
        proj = torch.matmul(keys.float(), layer.csa2_basis).to(layer.projected_keys.dtype)
        layer.projected_keys.scatter_(1, index[..., None].expand(-1, -1, proj.shape[-1]), proj)
