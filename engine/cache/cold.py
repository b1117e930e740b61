"""The cold tier: entries a compaction takes out of the hot set, kept so a later question can recall them.

The hot set (storage.LayerKV) is what every step attends to, at most the budget. With the cold tier on,
an entry a compaction drops is not discarded: its key, value, original position and score move here (per
layer, per KV head, in the order they left), as int8 with one scale per token and head (`cold_tier_dtype
= "int8"`: a quarter of float32, half of bf16), or in the hot set's own dtype (lossless). While a turn's
question is read, each layer, before it attends, scores its cold entries with the question's queries and
moves the best back into the hot set (DSV41Cache._recall_layer), so that layer's attention, the layers above
and the first reply token see them; the question-aware compaction after the question keeps what it needs
most within the budget, and what it drops comes back here. While the reply is decoded, each hot entry stands for
the cold entries like it (engine.cache.counts: log(1 + their count) added to its logit, until the turn ends).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels import cache_ops
from ..kernels.quant import integer_products, quantize_int8, quantize_int16
from . import counts
from .policies.ced import span_ranking
from .storage import BLOCK_TOKENS, LayerKV, Rows, _round_up

# How much a question recalls (a share of the budget, at least RECALL_MIN entries, 32 spans of 16): what comes back
# must hold the spans the question is about; a fact's span is not always the cold entry ranked first, and each one
# recalled is one more for the compaction to rank. Measured by benchmarks/followups.py (docs/design.md: 64 -> 256
# took 1k follow-ups from 24 to 29 of 36 at 0.2, 2k from 17 to 22 at 0.1; 256 -> 512 at 1k 28 / 28 -> 31 / 29 at
# 0.2 / 0.1, speech questions at 2k 3 -> 5 of 24 at 0.3). The reply keeps kv_cache.REPLY_RECALLED of them.
RECALL_SHARE = 0.125
RECALL_MIN = 512
log, _UNUSABLE = logging.getLogger(__name__), set()  # the cold-tier folders that failed here (said once each)


def _on_disk(folder: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory is a file in `folder` (mapped; the OS pages it in and out). The file
    is unlinked at once where the system allows (it lives while mapped and vanishes with the process)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cold-{os.getpid()}-{uuid.uuid4().hex}.bin"
    try:
        numel = torch.Size(shape).numel()
        tensor = torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=dtype)[:numel].view(shape)
    except BaseException:
        path.unlink(missing_ok=True)  # a file begun on a full disk
        raise
    try:
        path.unlink()
    except OSError:  # Windows keeps a mapped file: remove it when the tensor goes
        import weakref

        weakref.finalize(tensor.untyped_storage(), lambda p=path: p.unlink(missing_ok=True))
    return tensor


class ColdLayer:
    """One layer's cold entries: keys, values [h, capacity, d], positions and scores [h, capacity].

    `spill(extra_bytes)` is asked before each allocation: a folder to hold it on disk (file-backed memory that
    the OS writes out under pressure), or None for RAM (DSV41Cache decides from `cold_tier` and its RAM cap)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, *, int8: bool,
                 spill: Callable[[int], Path | None] | None = None, pinned: bool = False):
        self.kv_heads, self.head_dim, self.dtype, self.int8 = kv_heads, head_dim, dtype, int8
        self.device = torch.device(device)
        self.spill = spill
        # Page-locked RAM when the hot set is on a GPU: what a question's recall reads crosses the bus by DMA,
        # asynchronously (stored_keys_to), instead of through a staging copy
        self.pinned = pinned and self.device.type == "cpu" and torch.cuda.is_available()
        self.on_disk = False
        self.length = 0
        self._set(self._alloc(0, None))
        # The cold keys' bucket sizes for the reply's counts (counts.cold_counts), kept up to date as entries come and go
        # so a follow-up hashes only its hot set; None when not kept (see BUCKET_SIZES_SHARE)
        self.bucket_sizes: torch.Tensor | None = None
        self._sizes_key = counts.hashing()

    def _bytes_per_entry(self) -> int:
        element = 1 if self.int8 else torch.empty((), dtype=self.dtype).element_size()
        return self.kv_heads * (2 * self.head_dim * element + 8 + (8 if self.int8 else 0))

    def _alloc(self, capacity: int, folder: Path | None) -> dict[str, torch.Tensor]:
        h, d, dev = self.kv_heads, self.head_dim, self.device
        store = torch.int8 if self.int8 else self.dtype
        shapes = {"keys": ((h, capacity, d), store), "values": ((h, capacity, d), store),
                  "positions": ((h, capacity), torch.int32), "scores": ((h, capacity), torch.float32)}
        if self.int8:
            shapes |= {"key_scales": ((h, capacity, 1), torch.float32), "value_scales": ((h, capacity, 1), torch.float32)}
        if folder is not None and dev.type == "cpu" and capacity:
            try:
                return {name: _on_disk(folder, shape, dtype) for name, (shape, dtype) in shapes.items()}
            except (OSError, RuntimeError) as exc:  # a full, read-only or missing folder: RAM, said once
                if str(folder) not in _UNUSABLE and not _UNUSABLE.add(str(folder)):
                    log.warning("The cold tier could not use %s (%s); what it holds stays in RAM. Free space there, "
                                "or set DSV41_COLD_DIR to a folder with room.", folder, str(exc).splitlines()[0])
        return {name: torch.empty(shape, dtype=dtype, device=dev, pin_memory=self.pinned and capacity > 0)
                for name, (shape, dtype) in shapes.items()}

    def _set(self, tensors: dict[str, torch.Tensor]) -> None:
        self.key_scales = self.value_scales = None
        for name, tensor in tensors.items():
            setattr(self, name, tensor)

    def _names(self) -> list[str]:
        return ["keys", "values", "positions", "scores"] + (["key_scales", "value_scales"] if self.int8 else [])

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = _round_up(max(needed, self.capacity + self.capacity // 4, BLOCK_TOKENS))
        folder = self.spill((capacity - self.capacity) * self._bytes_per_entry()) if self.spill else None
        fresh = self._alloc(capacity, folder)
        for name, new in fresh.items():
            new[:, : self.length] = getattr(self, name)[:, : self.length]
        self._set(fresh)  # all or nothing: nothing replaced before every tensor exists and is filled
        self.on_disk = folder is not None and fresh["keys"].untyped_storage().filename is not None

    @torch.inference_mode()
    def add(self, layer: LayerKV, index: torch.Tensor) -> None:
        """Keep the hot layer's entries at `index` [h, D] (before the layer drops them)."""
        n = index.shape[1]
        if n == 0:
            return
        dev = self.device  # host RAM whatever device the hot set is on
        if not layer.int8 and layer.device.type == "cpu":  # one C call (engine.kernels.cache_ops.cold_add)
            self._grow(self.length + n)
            if cache_ops.cold_add([layer.keys, layer.values, layer.positions, layer.scores],
                                  [self.keys, self.values, self.key_scales, self.value_scales, self.positions,
                                   self.scores], index, layer.length, self.length, self.int8):
                self.length += n
                self._tally(torch.arange(self.length - n, self.length).expand(self.kv_heads, -1), +1)
                return
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
        self._tally(torch.arange(start, end, device=dev).expand(self.kv_heads, -1), +1)

    def read_keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """All cold keys [h, C, d], or those at `index` [h, k]: float32 when stored as int8 (for scoring; the
        hot set casts what it takes back), else the hot set's dtype."""
        return self._read(self.keys, self.key_scales, None if index is None else Rows(index, self.capacity))

    def stored_keys_to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All cold keys as stored, on `device`: (keys [h, C, d], their scales [h, C, 1] when int8, else None), for
        cold_logits. To a GPU the stored bytes (int8 and their scales: a quarter of float32) go as they are, from
        pinned RAM without blocking."""
        device = torch.device(device)
        keys = self.keys[:, : self.length].to(device, non_blocking=self.pinned)
        scales = self.key_scales
        return keys, None if scales is None else scales[:, : self.length].to(device, non_blocking=self.pinned)

    def read_values(self, index: torch.Tensor | None = None) -> torch.Tensor:
        return self._read(self.values, self.value_scales, None if index is None else Rows(index, self.capacity))

    def _read(self, data, scales, rows: Rows | None):
        # widened then scaled in place: one float32 copy, not two (bit-equal)
        if rows is None:
            out = data[:, : self.length]
            return out.float().mul_(scales[:, : self.length]) if scales is not None else out
        out = rows.gather(data)
        return out.float().mul_(rows.gather(scales)) if scales is not None else out

    @torch.inference_mode()
    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the entries at `index` [h, M] (distinct per head) and return their (keys, values, positions,
        scores) in the hot set's dtype. The entries past the new length that stay fill the holes the taken ones
        leave below it, so a recall moves M entries per head, not the whole tier (the tier has no order: a
        recall ranks by score and position)."""
        n, m = self.length, index.shape[1]
        if m == n:
            self.forget_buckets()  # everything leaves: nothing left to count
        self._tally(index, -1)  # before the rows move
        names = self._names()
        try:
            moved = cache_ops.take_rows([getattr(self, name) for name in names], index, n)
        except Exception:
            self.forget_buckets()  # nothing taken, but the sizes counted it gone
            raise
        if moved is not None:  # one C call for every tensor (engine.kernels.rows); the same layout as below
            got = dict(zip(names, moved, strict=True))
            self.length = n - m
            keys, values = got["keys"], got["values"]
            if self.int8:
                keys, values = keys.float().mul_(got["key_scales"]), values.float().mul_(got["value_scales"])
            return keys, values, got["positions"], got["scores"]
        picked = Rows(index, self.capacity)
        taken = (self._read(self.keys, self.key_scales, picked), self._read(self.values, self.value_scales, picked),
                 picked.gather(self.positions), picked.gather(self.scores))
        if m == n:
            self.length = 0
            return taken
        rest = n - m
        gone = torch.zeros(self.kv_heads, n, dtype=torch.bool, device=self.device)
        gone.scatter_(1, index, True)
        # per head, as many holes below `rest` as staying entries at or past it; sorting puts them first (stable),
        # and the pairs past that count are tail entries written onto themselves (harmless: past the new length)
        k = min(m, rest)  # holes per head: at most both
        holes = torch.argsort(gone[:, :rest].to(torch.int8), dim=1, descending=True, stable=True)[:, :k]
        movers = torch.argsort((~gone[:, rest:]).to(torch.int8), dim=1, descending=True, stable=True)[:, :k] + rest
        holes = torch.where(torch.gather(gone[:, :rest], 1, holes), holes, movers)
        source, target = Rows(movers, self.capacity), Rows(holes, self.capacity)
        for name in self._names():
            tensor = getattr(self, name)
            target.put(tensor, source.gather(tensor))
        self.length = rest
        return taken

    @torch.inference_mode()
    def move_into(self, layer: LayerKV, index: torch.Tensor) -> bool:
        """take(index) and layer.insert of what it returns, in one C call on a CPU (no intermediate tensors; bit-equal,
        tests compare the two). False, and nothing changed, where the kernel does not apply (a GPU or int8 hot set)."""
        if layer.int8 or layer.device.type != "cpu":
            return False
        layer.ensure_capacity(layer.length + index.shape[1])
        hot = [getattr(layer, name) for name in layer._tensors()]  # keys, values, positions, scores, then zeroed ones
        self._tally(index, -1)
        try:
            moved = cache_ops.recall_move([getattr(self, name) for name in self._names()], self.int8, self.length,
                                          hot, layer.length, index)
        except Exception:
            self.forget_buckets()  # nothing moved: the sizes no longer match (rebuilt by the next counts)
            raise
        if not moved:
            self._tally(index, +1)
            return False
        self.length -= index.shape[1]
        layer.length += index.shape[1]
        return True

    def reserved_bytes(self) -> int:
        """Bytes allocated (with spare capacity): what the RAM cap counts."""
        return self.capacity * self._bytes_per_entry() + self.sizes_bytes()

    def nbytes(self) -> int:
        """Bytes the cold entries occupy (without spare capacity), with their bucket sizes when kept."""
        return sum(getattr(self, n).element_size() * getattr(self, n)[:, :1].numel() * self.length
                   for n in self._names()) + self.sizes_bytes()

    # ---------------------------------------------------------------- the bucket sizes of the reply's counts
    def sizes_bytes(self) -> int:
        """Bytes of the kept bucket sizes (in RAM, even when the entries are on disk)."""
        return 0 if self.bucket_sizes is None else self.bucket_sizes.numel() * self.bucket_sizes.element_size()

    def buckets_pay(self) -> bool:
        """Whether keeping the bucket sizes pays: on a CPU with the kernels, and their bytes at most
        1 / counts.BUCKET_SIZES_SHARE of the cold entries' (so they add at most that share to the tier), with every
        size below 2^16."""
        sizes = self.kv_heads * (counts.COUNT_TABLES << counts.COUNT_BITS) * 2
        return (self.device.type == "cpu" and self.length < 1 << 16 and cache_ops.load() is not None
                and sizes * counts.BUCKET_SIZES_SHARE <= self.length * self._bytes_per_entry())

    def forget_buckets(self) -> None:
        """Drop the bucket sizes (after a change they do not follow; the next counts rebuild them if they pay)."""
        self.bucket_sizes = None

    def buckets(self) -> torch.Tensor | None:
        """The cold keys' bucket sizes [h, COUNT_TABLES << COUNT_BITS] (int16 read as unsigned), built now if not
        kept and they pay; None (and dropped) when they do not."""
        if not self.buckets_pay():
            self.bucket_sizes = None
            return None
        if self.bucket_sizes is not None and self._sizes_key != counts.hashing():
            self.bucket_sizes = None  # hashed with other planes (a benchmark's --count-seed / --count-tables)
        if self.bucket_sizes is None:
            self._sizes_key = counts.hashing()
            sizes = torch.zeros(self.kv_heads, counts.COUNT_TABLES << counts.COUNT_BITS, dtype=torch.int16)
            everything = torch.arange(self.length).expand(self.kv_heads, -1)
            if not cache_ops.lsh_tally(self.keys, self.length, everything, counts.count_planes(self.head_dim, "cpu"),
                                       counts.COUNT_TABLES, counts.COUNT_BITS, sizes, +1):
                return None
            self.bucket_sizes = sizes
        return self.bucket_sizes

    def _tally(self, index: torch.Tensor, sign: int) -> None:
        """The kept bucket sizes follow the entries at `index` [h, m] coming in (+1, after they are stored) or going
        out (-1, before they move); dropped where that cannot be done."""
        if self.bucket_sizes is None or index.shape[1] == 0:
            return
        planes = counts.count_planes(self.head_dim, "cpu")
        if self._sizes_key != counts.hashing() or not cache_ops.lsh_tally(
                self.keys, self.length, index.cpu(), planes, counts.COUNT_TABLES, counts.COUNT_BITS,
                self.bucket_sizes, sign):
            self.bucket_sizes = None


@torch.inference_mode()
def recall_layer(layer: LayerKV, cold: ColdLayer, question: torch.Tensor, scaling: float, budget: int,
                 spans: int, *, share: bool = False) -> tuple[int, cache_ops.HotLogits | None]:
    """Move the cold entries the question's queries [H, Tq, d] (the last Tq entries of `layer`, just appended)
    would attend to most back into `layer`: RECALL_SHARE of the `budget` per head, ranked by the attention each
    would get in one softmax over hot and cold. `spans` > 0 ranks them by the total of their span of that many
    positions (CED keeps whole spans after a question, so it recalls whole spans too). They come back with the
    score they left with; the question's attention, which the layer computes next over hot and recalled
    entries alike, is added to every score the same way. `share`: keep the logits the scoring computed for the
    hot entries, for the question's attention that follows (cache_ops.HotLogits, with the recall's row map; None
    where the C scoring did not run). Returns (entries recalled per head, those logits or None)."""
    if cold.length == 0:
        return 0, None
    dev = layer.device
    log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
    mass = hot_logits = None
    if dev.type == "cpu" and cold.device.type == "cpu":  # one C call, the cold keys as stored (cache_ops.recall_mass)
        share = share and log_counts is None
        got = cache_ops.recall_mass(question, layer.read_keys(), cold.keys[:, : cold.length],
                                    None if cold.key_scales is None else cold.key_scales[:, : cold.length],
                                    log_counts, scaling, keep_hot=share)
        mass, hot_logits = got if share and got is not None else (got, None)
    if mass is None:
        cold_keys, cold_scales = cold.stored_keys_to(dev)
        mass = recall_mass(question, layer.read_keys(), cold_keys, log_counts, scaling, cold_scales).to(cold.device)
    take = min(cold.length, recall_size(budget))
    positions = cold.positions[:, : cold.length]
    index = cache_ops.recall_select(mass, positions, spans, take)  # one C call (~0.4 ms a layer in torch at 8k)
    if index is None:
        rank = span_ranking(mass, positions, spans) if spans > 1 else mass
        index = rank.topk(take, dim=1).indices
        # in position order, as the hot set keeps them: its insert then merges two sorted runs (an insertion sort
        # of the top-k order cost ~6 ms a question over the default model's 30 layers)
        index = torch.gather(index, 1, torch.gather(positions, 1, index).argsort(dim=1))
    hot_positions = layer.positions[:, : layer.length].clone() if hot_logits is not None else None
    if not cold.move_into(layer, index):
        keys, values, positions, scores = cold.take(index)
        layer.insert(keys.to(dev), values.to(dev), positions.to(dev), scores.to(dev))
    if hot_logits is None:
        return take, None
    rows = question.shape[0] * question.shape[1] // layer.kv_heads  # the group's question rows of a head
    return take, cache_ops.HotLogits(hot_logits, rows, hot_positions, layer.positions[:, : layer.length])


def recall_size(budget: int) -> int:
    """Entries a head a question recalls at most, for a hot `budget`."""
    return max(int(budget * RECALL_SHARE), RECALL_MIN)


def cold_logits(q: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The logits [h, R, C] of query rows q [h, R, d] (float32, scaled) against cold keys [h, C, d] as stored.

    Float keys (bf16, float32): the float32 products of the widened keys. int8 keys with their scales [h, C, 1]
    (the default tier): each query row rounded to int16 with a scale of its own (quantize_int16), the exact
    integer sum over d of its products with the key's int8 values, rounded once to float32, times the key's
    scale, times the row's scale. That is what the C scoring (cache_ops.recall_mass, vpdpwssd / vpmaddwd) computes
    from the bytes the tier holds, at half the instructions of float32 products; here the same numbers, bit for
    bit: on a CPU one float64 product (exact for these integers), on a GPU each int16 row split into a high byte
    (-128..127) and a low one (0..255) so both float32 products are sums of integers below 2^24, exact in any
    order (TF32 included), and 256 x the first + the second rounds once. Rows rounded to int8 instead (four key
    bytes an instruction) put the logits ~300x further from float32's than int16 rows do (benchmarks/recall_cost.py),
    enough to move entries across the recall's boundary (docs/design.md)."""
    if scales is None:
        return torch.matmul(q, keys.float().transpose(1, 2))
    rows, row_scales = quantize_int16(q)
    out = integer_products(rows, keys, split=q.device.type != "cpu")  # fast float64 is rare on GPUs
    return out.mul_(scales.float().transpose(1, 2)).mul_(row_scales)


def recall_mass(query: torch.Tensor, hot_keys: torch.Tensor, cold_keys: torch.Tensor, hot_log_counts,
                scaling: float, cold_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The attention each cold entry [h, C] would get from the queries [H, Tq, d] if it were hot, in one softmax
    over hot and cold entries, summed over the group's heads and the queries. The queries are the last Tq hot
    entries (`hot_keys` [h, S, d]): each sees the hot entries up to its own and every cold one (all earlier).
    The cold keys as stored (int8 with `cold_scales`, or float; cold_logits defines their logits)."""
    h, s = hot_keys.shape[0], hot_keys.shape[1]
    tq = query.shape[1]
    # [h, G * Tq, d], query i of each head at row g * Tq + i; the scaling folded into the queries once
    q = query.float().reshape(h, -1, query.shape[-1]) * scaling
    hot = torch.matmul(q, hot_keys.float().transpose(1, 2))
    cold = cold_logits(q, cold_keys, cold_scales)
    lc = hot_log_counts.float().contiguous() if hot_log_counts is not None else None
    mass = cache_ops.recall_softmax(hot, cold, lc, tq)  # the rest in one C pass per row (engine.kernels.cache_ops)
    if mass is not None:
        return mass
    if hot_log_counts is not None:
        hot += hot_log_counts[:, None, :]
    future = torch.ones(tq, tq, dtype=torch.bool, device=hot.device).triu(1)
    hot[:, :, s - tq:].masked_fill_(future.repeat(q.shape[1] // tq, 1)[None], float("-inf"))
    # one softmax over both, per query row, with one exp per logit: cold entry j's share is
    # exp(cold_j - top) / (sum exp(hot - top) + sum exp(cold - top))
    # (in place: a fresh [h, G * Tq, C] tensor per operation costs more than the operation on this CPU)
    top = torch.maximum(hot.amax(dim=-1, keepdim=True), cold.amax(dim=-1, keepdim=True))
    cold = cold.sub_(top).exp_()
    total = hot.sub_(top).exp_().sum(dim=-1, keepdim=True) + cold.sum(dim=-1, keepdim=True)
    return cold.div_(total).sum(dim=1)
