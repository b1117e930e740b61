"""Per-layer KV storage in blocks, with importance scores, merge counts and optional INT8.

Layout (per layer, batch size 1 — a chat app serves one conversation at a time):
    keys, values   [kv_heads, capacity, head_dim]   one contiguous block per KV head
    positions      [kv_heads, capacity]             RoPE position each entry was encoded at
    scores         [kv_heads, capacity]  float32    CED importance (decayed accumulated attention)
    log_counts     [kv_heads, capacity]  float32    log(n): n tokens folded into the slot (merge mode)
Every head holds the same number of entries (`length`), so tensors stay rectangular and a
compaction really frees memory. Entries stay in position order; sinks are the first entries and
the recent window the last ones of every head.

Capacity grows block by block (never a cat per token) and shrinks after a compaction.
INT8 mode stores keys/values as int8 with one float scale per token and head; only what is read
is dequantized.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..kernels import cache_ops
from ..kernels.quant import quantize_int8

BLOCK_TOKENS = 256
# Every allocation of a layer's tensors gets a number no other allocation in this process has had: whoever
# holds raw pointers into them (cpu_kernels.FusedDecodeStep) knows when to fetch them again. (An object's
# id() is not enough: a new cache's layers are often allocated where a freed cache's were.)
_ALLOCATIONS = itertools.count(1)


class LayerKV:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, *, int8: bool = False,
                 initial_capacity: int = BLOCK_TOKENS):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device, self.int8 = dtype, torch.device(device), int8
        self.length = 0
        self.storage_version = 0  # unique per allocation of the tensors below (see _ALLOCATIONS)
        self.merged_any = False
        self.merged_tokens = 0  # tokens folded into other slots (merge mode), for statistics
        self._alloc(_round_up(max(initial_capacity, 1)))

    # ------------------------------------------------------------------ allocation
    def _alloc(self, capacity: int) -> None:
        h, d, dev = self.kv_heads, self.head_dim, self.device
        self.storage_version = next(_ALLOCATIONS)
        store_dtype = torch.int8 if self.int8 else self.dtype
        # Uninitialised: nothing past `length` is ever read, and on CPU untouched pages cost no RAM, so a
        # large reservation (max_seq_len x kv_cache_ratio) is only paid for as it fills.
        self.keys = torch.empty(h, capacity, d, dtype=store_dtype, device=dev)
        self.values = torch.empty(h, capacity, d, dtype=store_dtype, device=dev)
        if self.int8:
            self.key_scales = torch.empty(h, capacity, 1, dtype=torch.float32, device=dev)
            self.value_scales = torch.empty(h, capacity, 1, dtype=torch.float32, device=dev)
        self.positions = torch.empty(h, capacity, dtype=torch.int32, device=dev)
        self.scores = torch.zeros(h, capacity, dtype=torch.float32, device=dev)
        self.log_counts = torch.zeros(h, capacity, dtype=torch.float32, device=dev)
        # CSA2's side state (engine.cache.csa2 fits and reads it; None / 0 until it is fitted):
        self.projected_keys = None  # projected keys [h, capacity, r], the screening side cache
        self.csa2_basis = None  # key projection [h, d, r]
        self.csa2_query_basis = None  # query projection [h, d, r]
        self.query_moment = None  # sum of q q^T of prefill queries per KV head [h, d, d] (float32)
        self.query_count = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def _tensors(self) -> list[str]:
        names = ["keys", "values", "positions", "scores", "log_counts"]
        if self.int8:
            names += ["key_scales", "value_scales"]
        if self.projected_keys is not None:
            names.append("projected_keys")
        return names

    @torch.inference_mode()
    def resize(self, capacity: int) -> None:
        """Reallocate to `capacity` (rounded up to whole blocks), keeping the first `length` entries.
        All or nothing: every new tensor is allocated and filled before any replaces its old one, so running
        out of memory part-way leaves the layer as it was."""
        capacity = _round_up(max(capacity, self.length, 1))
        if capacity == self.capacity:
            return
        n = self.length
        fresh = {}
        for name in self._tensors():
            old = getattr(self, name)
            shape = (old.shape[0], capacity, *old.shape[2:])
            new = old.new_zeros(shape) if name in ("scores", "log_counts") else old.new_empty(shape)
            new[:, :n] = old[:, :n]
            fresh[name] = new
        for name, new in fresh.items():
            setattr(self, name, new)
        self.storage_version = next(_ALLOCATIONS)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            # Grow by at least a quarter so long prefills do not reallocate every block.
            self.resize(max(needed, self.capacity + self.capacity // 4))

    def shrink_to_fit(self, spare_tokens: int = BLOCK_TOKENS) -> None:
        if self.capacity - self.length > spare_tokens + BLOCK_TOKENS:
            self.resize(self.length + spare_tokens)

    # ------------------------------------------------------------------ writes
    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """keys, values: [kv_heads, T, head_dim]; positions: [T] (same for every head)."""
        t = keys.shape[1]
        start, end = self.length, self.length + t
        self.ensure_capacity(end)
        if self.int8:
            q, s = quantize_int8(keys)
            self.keys[:, start:end], self.key_scales[:, start:end] = q, s
            q, s = quantize_int8(values)
            self.values[:, start:end], self.value_scales[:, start:end] = q, s
        else:
            self.keys[:, start:end] = keys
            self.values[:, start:end] = values
        self.positions[:, start:end] = positions  # copy_ casts to int32
        # scores and log_counts past `length` are kept at zero (see truncate/keep/resize), so a decode
        # step appends two tensors fewer.
        self.length = end

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Forget the entries past `length` (an undone forward)."""
        if length < self.length:
            self.scores[:, length:self.length] = 0.0
            self.log_counts[:, length:self.length] = 0.0
            self.length = length

    # ------------------------------------------------------------------ reads
    def read_keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """All stored keys [h, S, d], or the entries at `index` [h, k] (gathered, then dequantized)."""
        return self._read(self.keys, self.key_scales if self.int8 else None, index)

    def read_values(self, index: torch.Tensor | None = None) -> torch.Tensor:
        return self._read(self.values, self.value_scales if self.int8 else None, index)

    def _read(self, data, scales, index):
        n = self.length
        if index is None:
            out = data[:, :n]
            if scales is not None:
                out = out.to(self.dtype) * scales[:, :n].to(self.dtype)
            return out
        out = _gather_rows(data, index)
        if scales is not None:
            out = out.to(self.dtype) * _gather_rows(scales, index).to(self.dtype)
        return out

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._tensors())

    def used_bytes(self) -> int:
        """Bytes the stored entries occupy (K, V, scales, positions, scores, counts, CSA2 side cache),
        without spare capacity."""
        total = 0
        for name in self._tensors():
            t = getattr(self, name)
            total += t.element_size() * t[:, :1].numel() * self.length
        return total

    @torch.inference_mode()
    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at `index` [h, k] (ascending per head) in place; k is the new length.
        On a CPU one C call moves every tensor's rows down in place (engine.kernels.cache_ops.keep_rows); else
        every tensor is gathered before any is written, so running out of memory leaves the layer as it was."""
        k = index.shape[1]
        if not cache_ops.keep_rows([getattr(self, name) for name in self._tensors()], index, self.length):
            kept = {name: _gather_rows(getattr(self, name)[:, : self.length], index) for name in self._tensors()}
            for name, rows in kept.items():
                getattr(self, name)[:, :k] = rows
        self.scores[:, k:self.length] = 0.0
        self.log_counts[:, k:self.length] = 0.0
        self.length = k

    @torch.inference_mode()
    def insert(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Put entries back (keys/values [h, M, d], positions/scores [h, M], count 1 each) where their positions
        belong, so every head stays in position order (sinks first, the recent window last). All or nothing."""
        m = keys.shape[1]
        if m == 0:
            return
        n = self.length
        self.ensure_capacity(n + m)
        new = {"positions": positions, "scores": scores}
        if self.int8:
            new["keys"], new["key_scales"] = quantize_int8(keys)
            new["values"], new["value_scales"] = quantize_int8(values)
        else:
            new["keys"], new["values"] = keys, values
        names = self._tensors()
        # one C call merges the new rows of every tensor into position order (engine.kernels.rows; it checks
        # everything before it writes); else through torch: the new entries go past the stored ones first, then
        # every tensor is put in position order in one gather
        if cache_ops.insert_rows([getattr(self, name) for name in names], self.positions, positions,
                                   [new.get(name) for name in names], n):
            self.length = n + m
            return
        order = torch.cat([self.positions[:, :n], positions.to(torch.int32)], dim=1).argsort(dim=1, stable=True)
        order = Rows(order, self.capacity)
        merged = {}
        try:
            for name in self._tensors():
                tensor = getattr(self, name)
                rows = new.get(name)
                if rows is None:  # log_counts (count 1), CSA2's projected keys (refitted after a recall)
                    tensor[:, n:n + m] = 0
                else:
                    tensor[:, n:n + m] = rows
                merged[name] = order.gather(tensor)
        except BaseException:  # out of memory part-way: the layer as it was (nothing past `length` scored)
            self.scores[:, n:n + m] = 0.0
            raise
        for name, rows in merged.items():
            getattr(self, name)[:, : n + m] = rows
        self.length = n + m


class Rows:
    """Row indices [h, k] into tensors laid out [h, capacity, ...] (contiguous, one capacity for all: a layer's
    or a cold layer's tensors), flattened once and then read from or written to each such tensor with one
    index_select / index_copy_ (a recall moves rows of six or seven tensors per layer: per-tensor index
    arithmetic was most of its time)."""

    def __init__(self, index: torch.Tensor, capacity: int):
        h, k = index.shape
        self.shape, self.capacity = (h, k), capacity
        self.flat = (index + torch.arange(h, device=index.device)[:, None] * capacity).reshape(-1)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """t [h, N, d] or [h, N] (N: the capacity, or a leading slice of it) as [h * capacity, d] rows."""
        step = t.stride(1)
        assert t.stride(0) == self.capacity * step and (t.dim() == 2 and step == 1 or t.dim() == 3 and t.stride(2) == 1), \
            "Rows indexes [h, capacity, ...] tensors (or leading slices of them)"
        return t.as_strided((t.shape[0] * self.capacity, 1 if t.dim() == 2 else t.shape[2]), (step, 1))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return self._flat(t).index_select(0, self.flat).view(*self.shape, *t.shape[2:])

    def put(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        self._flat(t).index_copy_(0, self.flat, rows.reshape(self.flat.numel(), -1).to(t.dtype))


def _gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [h, N, ...], index [h, k] -> [h, k, ...]."""
    if t.dim() == 2:
        return torch.gather(t, 1, index)
    if t.dim() == 3 and t.stride(2) == 1 and t.stride(0) % t.stride(1) == 0:
        # Whole rows: one index_select over [h * N, d] copies rows instead of gathering element-wise.
        return Rows(index, t.stride(0) // t.stride(1)).gather(t)
    expand = index.view(*index.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:])
    return torch.gather(t, 1, expand)


def _round_up(n: int) -> int:
    return int(math.ceil(n / BLOCK_TOKENS) * BLOCK_TOKENS)
