"""The cold tier: entries a compaction takes out of the hot set, kept so a later question can recall them.

The hot set (storage.LayerKV) is what every step attends to, at most the budget. With the cold tier on,
an entry a compaction drops is not discarded: its key, value, original position and score move here (per
layer, per KV head, in the order they left), as int8 with one scale per token and head (`cold_tier_dtype
= "int8"`: a quarter of float32, half of bf16), or in the hot set's own dtype (lossless). When a turn's
question has been read, the cache scores the cold entries with the question's queries and moves the best
back into the hot set (DSV41Cache.finish_prefill), where the question-aware compaction then keeps what the
question needs most within the budget; what it drops comes back here.
"""

from __future__ import annotations

import torch

from ..kernels.quant import quantize_int8
from .policies.ced import span_ranking
from .storage import BLOCK_TOKENS, LayerKV, _gather_rows, _round_up

# How much a question recalls, as a share of the budget (at least RECALL_MIN entries): what comes back only
# has to hold the few spans the question is about; each entry recalled is also one more for the compaction
# after it to rank. Measured by benchmarks/followups.py (see docs/design.md).
RECALL_SHARE = 0.125
RECALL_MIN = 64


class ColdLayer:
    """One layer's cold entries: keys, values [h, capacity, d], positions and scores [h, capacity]."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, *, int8: bool):
        self.kv_heads, self.head_dim, self.dtype, self.int8 = kv_heads, head_dim, dtype, int8
        self.device = torch.device(device)
        self.length = 0
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        h, d, dev = self.kv_heads, self.head_dim, self.device
        store = torch.int8 if self.int8 else self.dtype
        self.keys = torch.empty(h, capacity, d, dtype=store, device=dev)
        self.values = torch.empty(h, capacity, d, dtype=store, device=dev)
        self.key_scales = torch.empty(h, capacity, 1, dtype=torch.float32, device=dev) if self.int8 else None
        self.value_scales = torch.empty(h, capacity, 1, dtype=torch.float32, device=dev) if self.int8 else None
        self.positions = torch.empty(h, capacity, dtype=torch.int32, device=dev)
        self.scores = torch.empty(h, capacity, dtype=torch.float32, device=dev)

    def _names(self) -> list[str]:
        return ["keys", "values", "positions", "scores"] + (["key_scales", "value_scales"] if self.int8 else [])

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = _round_up(max(needed, self.capacity + self.capacity // 4, BLOCK_TOKENS))
        fresh = {}
        for name in self._names():
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], capacity, *old.shape[2:]))
            new[:, : self.length] = old[:, : self.length]
            fresh[name] = new
        for name, new in fresh.items():  # all or nothing: nothing replaced before every tensor exists
            setattr(self, name, new)

    @torch.inference_mode()
    def add(self, layer: LayerKV, index: torch.Tensor) -> None:
        """Keep the hot layer's entries at `index` [h, D] (before the layer drops them)."""
        n = index.shape[1]
        if n == 0:
            return
        dev = self.device  # host RAM whatever device the hot set is on
        keys, values = layer.read_keys(index).to(dev), layer.read_values(index).to(dev)
        positions = torch.gather(layer.positions, 1, index).to(dev)
        scores = torch.gather(layer.scores, 1, index).to(dev)
        self._grow(self.length + n)
        start, end = self.length, self.length + n
        if self.int8:
            self.keys[:, start:end], self.key_scales[:, start:end] = quantize_int8(keys)
            self.values[:, start:end], self.value_scales[:, start:end] = quantize_int8(values)
        else:
            self.keys[:, start:end] = keys.to(self.dtype)
            self.values[:, start:end] = values.to(self.dtype)
        self.positions[:, start:end] = positions
        self.scores[:, start:end] = scores
        self.length = end

    def read_keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """All cold keys [h, C, d], or those at `index` [h, k]: float32 when stored as int8 (for scoring; the
        hot set casts what it takes back), else the hot set's dtype."""
        return self._read(self.keys, self.key_scales, index)

    def read_values(self, index: torch.Tensor | None = None) -> torch.Tensor:
        return self._read(self.values, self.value_scales, index)

    def _read(self, data, scales, index):
        if index is None:
            out = data[:, : self.length]
            return out.float() * scales[:, : self.length] if scales is not None else out
        out = _gather_rows(data, index)
        return out.float() * _gather_rows(scales, index) if scales is not None else out

    @torch.inference_mode()
    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the entries at `index` [h, M] (distinct per head) and return their (keys, values, positions,
        scores) in the hot set's dtype; the others stay, in their order."""
        taken = (self.read_keys(index), self.read_values(index), torch.gather(self.positions[:, : self.length], 1, index),
                 torch.gather(self.scores[:, : self.length], 1, index))
        rest = torch.ones(self.kv_heads, self.length, dtype=torch.bool, device=self.device)
        rest.scatter_(1, index, False)
        keep = rest.nonzero()[:, 1].view(self.kv_heads, -1)
        kept = {name: _gather_rows(getattr(self, name)[:, : self.length], keep) for name in self._names()}
        for name, rows in kept.items():
            getattr(self, name)[:, : rows.shape[1]] = rows
        self.length = keep.shape[1]
        return taken

    def nbytes(self) -> int:
        """Bytes the cold entries occupy (without spare capacity)."""
        return sum(getattr(self, n).element_size() * getattr(self, n)[:, :1].numel() * self.length
                   for n in self._names())


@torch.inference_mode()
def recall_layer(layer: LayerKV, cold: ColdLayer, question: torch.Tensor | None, scaling: float, budget: int,
                 spans: int) -> int:
    """Move the cold entries `question`'s queries [H, Tq, d] would attend to most back into `layer` (RECALL_SHARE
    of the `budget` per head), scored with that attention. `spans` > 0 ranks them by the total of their span of that
    many positions (CED keeps whole spans after a question, so it recalls whole spans too, and what comes back
    can stand against the spans already hot). Returns entries recalled per head."""
    if question is None or cold.length == 0:
        return 0
    log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
    dev = layer.device
    mass, hot_change = recall_scores(question, layer.read_keys(), cold.read_keys().to(dev), log_counts, scaling)
    # what the question gave the hot entries, as if it had seen the cold entries too (a fair contest)
    layer.scores[:, : layer.length] += hot_change
    mass = mass.to(cold.device)
    take = min(cold.length, max(int(budget * RECALL_SHARE), RECALL_MIN))
    rank = span_ranking(mass, cold.positions[:, : cold.length], spans) if spans > 1 else mass
    best = rank.topk(take, dim=1).indices
    keys, values, positions, _ = cold.take(best)
    layer.insert(keys.to(dev), values.to(dev), positions.to(dev), torch.gather(mass, 1, best).to(dev))
    return take


def recall_scores(query: torch.Tensor, hot_keys: torch.Tensor, cold_keys: torch.Tensor, hot_log_counts,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The question's queries [H, Tq, d] are the last Tq tokens of the hot set (`hot_keys` [h, S, d], each query
    sees the hot entries up to its own). Returns (the attention each cold entry [h, C] would get if it were hot,
    one softmax over both; the change in each hot entry's share [h, S] once the cold entries are counted, to
    correct the score the question gave it when it saw the hot set alone), summed over the group's heads and
    the queries."""
    h, s = hot_keys.shape[0], hot_keys.shape[1]
    tq = query.shape[1]
    q = query.float().reshape(h, -1, query.shape[-1])  # [h, G * Tq, d], query i of each head at row g * Tq + i
    hot = torch.matmul(q, hot_keys.float().transpose(1, 2)) * scaling
    if hot_log_counts is not None:
        hot = hot + hot_log_counts[:, None, :]
    # causal: query i sees the question's own entries up to itself (the last tq hot entries, in order)
    future = torch.ones(tq, tq, dtype=torch.bool, device=hot.device).triu(1)
    hot[:, :, s - tq:].masked_fill_(future.repeat(q.shape[1] // tq, 1)[None], float("-inf"))
    cold = torch.matmul(q, cold_keys.float().transpose(1, 2)) * scaling
    top = torch.maximum(hot.amax(dim=-1, keepdim=True), cold.amax(dim=-1, keepdim=True))
    hot_exp, cold_exp = torch.exp(hot - top), torch.exp(cold - top)
    hot_sum = hot_exp.sum(dim=-1, keepdim=True)
    total = hot_sum + cold_exp.sum(dim=-1, keepdim=True)
    joint_hot = hot_exp / total
    alone_hot = hot_exp / hot_sum
    return (cold_exp / total).sum(dim=1), (joint_hot - alone_hot).sum(dim=1)
