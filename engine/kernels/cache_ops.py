"""The cache's per-layer operations in C (cpu_kernels.c): rows moved (dsv41_rows_take, dsv41_rows_keep,
dsv41_rows_insert, dsv41_cold_add, and a recall's take and insert at once, dsv41_recall_move), the recall's
softmax (dsv41_recall_softmax), and the reply's counts of the cold tier (dsv41_cold_counts, with the bucket sizes
the cold tier keeps through dsv41_lsh_tally).

A layer (the hot set's LayerKV, the cold tier's ColdLayer) keeps several tensors laid out [heads, capacity, ...]
with one capacity for all. A question's recall takes a few rows per head out of the cold tier and inserts them in
position order into the hot set: through torch that is a few operations per tensor (~30 us each on a 2-core
machine), which made the moves half of a recall (1.4 + 0.9 ms a layer at 4k tokens), and a compaction's keep
(every tensor gathered, then written back) 0.3 ms a layer, and its dropped rows' way into the cold tier
(gathered, quantized to int8, written) 0.25 ms a layer; one call here moves every tensor's rows by memcpy
(bit-exact, any dtype). The recall's ranking, one softmax per query row over hot and cold
logits summed over the rows, runs in one pass per row (in L1) instead of torch operations over the whole block.
Each returns None / False where it does not apply (no kernels, a GPU tensor, another layout), and the caller
runs the torch path as before; tests compare the two.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .library import load
from .quant import quantize_int16


def _layout(tensors: list[torch.Tensor], capacity: int) -> list[int] | None:
    """Bytes per row of each tensor, or None unless all are contiguous CPU tensors [heads, capacity, ...]."""
    heads = tensors[0].shape[0]
    out = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 2 or t.shape[:2] != (heads, capacity):
            return None
        out.append(math.prod(t.shape[2:]) * t.element_size())  # a row's bytes (t[0, 0] would make a view each call)
    return out


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def _rows_call(tensors: list[torch.Tensor], index: torch.Tensor):
    """(library, capacity, bytes per row, index as contiguous int64) for a call that moves rows `index` of
    `tensors`, or None where the kernels do not apply."""
    lib = load()
    capacity = tensors[0].shape[1]
    sizes = _layout(tensors, capacity) if lib is not None else None
    if sizes is None or index.device.type != "cpu" or index.dim() != 2 or index.shape[0] != tensors[0].shape[0]:
        return None  # (an index of more heads than the tensors: the call would write past them)
    return lib, capacity, sizes, index.to(torch.int64).contiguous()


def take_rows(tensors: list[torch.Tensor], index: torch.Tensor, n: int) -> list[torch.Tensor] | None:
    """Take rows `index` [heads, m] (distinct per head, < n) out of the first n rows of every tensor: returned as
    [heads, m, ...] each, in index order; the holes they leave below n - m are filled with the rows at or past
    n - m that stay, in ascending order. None where the kernels do not apply."""
    prepared = _rows_call(tensors, index)
    if prepared is None:
        return None
    lib, capacity, sizes, index = prepared
    heads, m = index.shape
    outs = [torch.empty((heads, m, *t.shape[2:]), dtype=t.dtype) for t in tensors]
    status = lib.lib.dsv41_rows_take(heads, capacity, n, m, index.data_ptr(), len(tensors), _pointers(tensors),
                                     (ctypes.c_int64 * len(sizes))(*sizes), _pointers(outs))
    if status != 0:
        raise ValueError(f"taking rows failed ({status}): an index out of range or repeated")
    return outs


def keep_rows(tensors: list[torch.Tensor], index: torch.Tensor, n: int) -> bool:
    """Keep rows `index` [heads, k] (strictly ascending per head, < n) of the first n rows of every tensor, moved
    in place to rows 0..k-1. Nothing to allocate, so it cannot run out of memory part-way. False where the kernels
    do not apply."""
    prepared = _rows_call(tensors, index)
    if prepared is None:
        return False
    lib, capacity, sizes, index = prepared
    heads, k = index.shape
    status = lib.lib.dsv41_rows_keep(heads, capacity, n, k, index.data_ptr(), len(tensors), _pointers(tensors),
                                     (ctypes.c_int64 * len(sizes))(*sizes), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"keeping rows failed ({status}): an index out of range or not ascending")
    return True


def _cold_matches(keys: torch.Tensor, values: torch.Tensor, cold: list, int8: bool, index: torch.Tensor) -> bool:
    """Whether a cold layer's keys / values (cold[0], cold[1]) are the hot layer's heads and row widths, in the dtype
    the C moves write (int8, or the hot one), and `index` has a row per head: else a call would write past rows."""
    return (cold[0].dtype == (torch.int8 if int8 else keys.dtype) and cold[0].shape[0] == keys.shape[0]
            and index.shape[0] == keys.shape[0] and cold[0].shape[2:] == keys.shape[2:]
            and cold[1].shape[2:] == values.shape[2:])


def cold_add(hot: list[torch.Tensor], cold: list[torch.Tensor | None], index: torch.Tensor, n: int, start: int,
             int8: bool) -> bool:
    """Append the hot layer's rows `index` [heads, m] (< n) to the cold layer at row `start`: hot = [keys, values,
    positions, scores] (keys / values float32 or bf16), cold = [keys, values, key_scales, value_scales, positions,
    scores] (keys / values int8 with their scales when `int8`, else the hot dtype with the scales None). Bit-equal
    to gathering and quantize_int8. False where the kernels do not apply."""
    lib = load()
    keys, values, positions, scores = hot
    if (lib is None or index.device.type != "cpu" or keys.dtype not in (torch.float32, torch.bfloat16)
            or _layout(hot, keys.shape[1]) is None
            or _layout([t for t in cold if t is not None], cold[0].shape[1]) is None
            or not _cold_matches(keys, values, cold, int8, index) or positions.dtype != torch.int32
            or scores.dtype != torch.float32 or cold[4].dtype != torch.int32 or cold[5].dtype != torch.float32):
        return False
    heads, m = index.shape
    index = index.to(torch.int64).contiguous()
    ptr = [None if t is None else t.data_ptr() for t in cold]
    status = lib.lib.dsv41_cold_add(heads, keys.shape[2], keys.shape[1], n, m, index.data_ptr(), keys.data_ptr(),
                                    values.data_ptr(), positions.data_ptr(), scores.data_ptr(),
                                    int(keys.dtype == torch.bfloat16), cold[0].shape[1], start, *ptr, int(int8),
                                    torch.get_num_threads())
    if status != 0:
        raise ValueError(f"adding rows to the cold tier failed ({status}): an index or size out of range")
    return True


def insert_rows(tensors: list[torch.Tensor], positions: torch.Tensor, new_positions: torch.Tensor,
                news: list[torch.Tensor | None], n: int) -> bool:
    """Insert m rows per head among the first n rows of every tensor so each head stays in position order
    (`positions` [heads, capacity] int32, one of `tensors`; ties: stored rows first). news[i] [heads, m, ...] holds
    tensors[i]'s new rows, None for zeros. Needs n + m <= capacity. False where the kernels do not apply."""
    lib = load()
    capacity = tensors[0].shape[1]
    sizes = _layout(tensors, capacity) if lib is not None else None
    if sizes is None or positions.dtype != torch.int32 or not any(positions is t for t in tensors):
        return False
    heads, m = new_positions.shape
    new_positions = new_positions.to(device="cpu", dtype=torch.int32).contiguous()
    rows = []
    for tensor, new in zip(tensors, news, strict=True):
        if new is not None:
            new = new.to(device="cpu", dtype=tensor.dtype).contiguous().view(heads, m, *tensor.shape[2:])
        rows.append(new)
    status = lib.lib.dsv41_rows_insert(heads, capacity, n, m, positions.data_ptr(), new_positions.data_ptr(),
                                       len(tensors), _pointers(tensors), (ctypes.c_int64 * len(sizes))(*sizes),
                                       _pointers(rows))
    if status != 0:
        raise ValueError(f"inserting rows failed ({status}): {n} + {m} rows do not fit {capacity}")
    return True


def recall_move(cold: list[torch.Tensor], cold_int8: bool, n_cold: int, hot: list[torch.Tensor], n_hot: int,
                index: torch.Tensor) -> bool:
    """A recall in one call: take rows `index` [heads, m] out of the first n_cold rows of the cold layer's tensors
    (keys, values, positions, scores[, key_scales, value_scales]) and insert them, in the hot layer's dtype, among
    the first n_hot rows of its tensors (keys, values, positions, scores, then tensors whose new rows are zeros) in
    position order. Bit-equal to take_rows, the widening, and insert_rows. False where the kernels do not apply."""
    prepared = _rows_call(cold, index)
    if prepared is None:
        return False
    lib, cold_capacity, _, index = prepared
    hot_sizes = _layout(hot, hot[0].shape[1])
    keys = hot[0]
    if (hot_sizes is None or keys.dtype not in (torch.float32, torch.bfloat16) or hot[2].dtype != torch.int32
            or hot[3].dtype != torch.float32 or cold[2].dtype != torch.int32 or cold[3].dtype != torch.float32
            or not _cold_matches(keys, hot[1], cold, cold_int8, index)):
        return False  # (a cold layer of another shape than the hot one: the call would write past its rows)
    heads, m = index.shape
    status = lib.lib.dsv41_recall_move(heads, keys.shape[2], cold_capacity, n_cold, m, index.data_ptr(),
                                       _pointers(cold), int(cold_int8), keys.shape[1], n_hot, len(hot), _pointers(hot),
                                       (ctypes.c_int64 * len(hot_sizes))(*hot_sizes), int(keys.dtype == torch.bfloat16))
    if status != 0:
        raise (MemoryError if status == -2 else ValueError)(f"moving a recall failed ({status})")
    return True


def recall_softmax(hot: torch.Tensor, cold: torch.Tensor, hot_log_counts: torch.Tensor | None,
                   tq: int) -> torch.Tensor | None:
    """mass [h, C]: per kv head, the cold entries' shares of one softmax per query row over the hot logits
    hot [h, R, S] (+ hot_log_counts [h, S]; row r sees the hot entries up to S - tq + r % tq: the question's own
    later tokens masked) and the cold logits cold [h, R, C] (overwritten), summed over the R rows. None where the
    kernels do not apply."""
    lib = load()
    tensors = [hot, cold] + ([hot_log_counts] if hot_log_counts is not None else [])
    if lib is None or any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
                          for t in tensors):
        return None
    heads, rows, s = hot.shape
    c = cold.shape[2]
    if cold.shape[:2] != (heads, rows) or (hot_log_counts is not None and hot_log_counts.shape != (heads, s)):
        return None
    mass = torch.empty(heads, c, dtype=torch.float32)
    status = lib.lib.dsv41_recall_softmax(heads, rows, tq, s, c, hot.data_ptr(),
                                          None if hot_log_counts is None else hot_log_counts.data_ptr(),
                                          cold.data_ptr(), mass.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("the recall's softmax could not allocate its buffers")
    return mass


_KEY_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _rows_of(t: torch.Tensor, width: int) -> bool:
    """Whether t [h, n, width] (or [h, n] for width 1) is a CPU view whose entries are contiguous rows."""
    return (t.device.type == "cpu" and t.dim() in (2, 3) and (t.dim() == 2 or t.shape[2] == width)
            and (t.shape[1] <= 1 or t.stride(1) == width) and (t.dim() == 2 or t.stride(2) == 1 or width == 1))


def recall_mass(query: torch.Tensor, hot_keys: torch.Tensor, cold_keys: torch.Tensor, cold_scales: torch.Tensor | None,
                hot_log_counts: torch.Tensor | None, scaling: float, *, keep_hot: bool = False):
    """cold.recall_mass in one C call (dsv41_recall_mass), the cold keys read as stored: int8 [h, C, d] with their
    float32 scales [h, C, 1] (against the query rows rounded to int16 here, integer products: cold.cold_logits,
    bit for bit), or bf16 / float32 without scales (widened key by key);
    the hot keys [h, S, d] float32 or bf16; each a view whose entries are contiguous rows (a layer's storage up
    to its length). None where the kernels do not apply. `keep_hot`: (mass, logits), the hot entries' logits
    [h, S, rows rounded up to the vector width] as computed, for the question's attention after the recall
    (HotLogits)."""
    lib = load()
    h, s, d = hot_keys.shape
    c = cold_keys.shape[1]
    if (lib is None or hot_keys.dtype not in (torch.float32, torch.bfloat16) or cold_keys.dtype not in _KEY_TYPES
            or (cold_keys.dtype == torch.int8) != (cold_scales is not None) or not _rows_of(hot_keys, d)
            or not _rows_of(cold_keys, d) or cold_keys.shape[0] != h or query.device.type != "cpu"
            or query.dim() != 3 or query.shape[2] != d or query.shape[0] % h):
        return None
    if cold_scales is not None and (cold_scales.dtype != torch.float32 or not _rows_of(cold_scales, 1)
                                    or cold_scales.shape[:2] != (h, c)):
        return None
    if hot_log_counts is not None and (hot_log_counts.dtype != torch.float32 or not _rows_of(hot_log_counts, 1)
                                       or hot_log_counts.shape[:2] != (h, s)):
        return None
    tq = query.shape[1]
    q = (query.float().reshape(h, -1, d) * scaling).contiguous()
    q16, q16_scales = quantize_int16(q) if cold_scales is not None else (None, None)
    mass = torch.empty(h, c, dtype=torch.float32)
    lanes = lib.isa // 32
    hot = torch.empty(h, s, -(-q.shape[1] // lanes) * lanes, dtype=torch.float32) if keep_hot else None
    status = lib.lib.dsv41_recall_mass(
        h, q.shape[1], tq, d, q.data_ptr(), None if q16 is None else q16.data_ptr(),
        None if q16_scales is None else q16_scales.data_ptr(),
        s, hot_keys.data_ptr(), _KEY_TYPES[hot_keys.dtype], hot_keys.stride(0),
        None if hot_log_counts is None else hot_log_counts.data_ptr(),
        0 if hot_log_counts is None else hot_log_counts.stride(0), c, cold_keys.data_ptr(),
        _KEY_TYPES[cold_keys.dtype], cold_keys.stride(0), None if cold_scales is None else cold_scales.data_ptr(),
        0 if cold_scales is None else cold_scales.stride(0), mass.data_ptr(), None if hot is None else hot.data_ptr(),
        torch.get_num_threads())
    if status == -2:
        raise MemoryError("the recall's scoring could not allocate its buffers")
    if status != 0:
        return None
    return (mass, hot) if keep_hot else mass


@dataclass
class HotLogits:
    """The logits recall_mass computed for a layer's hot entries [h, S, rows rounded up to the vector width] (the
    group's question rows in lanes, masked as the question's attention masks them), `rows` of them real; the
    positions of those entries [h, S] (int32, in order) and the layer's positions once the recalled entries are in
    [h, S'] (a view): question_attention pairs the two to find each entry's row (the recalled ones it computes).
    Built by cold.recall_layer."""
    logits: torch.Tensor
    rows: int
    positions: torch.Tensor
    merged: torch.Tensor


def question_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       log_counts: torch.Tensor | None, scaling: float, last: int, shared: HotLogits | None = None):
    """attention.question_attention in one C call (dsv41_question_attention): (out [H, T, d] float32, mass [h, S]
    float32), the keys and values [h, S, d] float32 or bf16 views whose entries are contiguous rows (a layer's
    storage up to its length). `shared`: the logits the recall computed for the entries it found hot (taken
    instead of computed again; the same products of the same rows). None where the kernels do not apply."""
    lib = load()
    h, s, d = keys.shape
    big_h, t, _ = query.shape
    if (lib is None or keys.dtype not in (torch.float32, torch.bfloat16) or values.dtype != keys.dtype
            or not _rows_of(keys, d) or not _rows_of(values, d) or values.shape != keys.shape
            or keys.stride(0) != values.stride(0) or query.device.type != "cpu" or big_h % h
            or query.shape[2] != d):
        return None
    if log_counts is not None and (log_counts.dtype != torch.float32 or not _rows_of(log_counts, 1)
                                   or log_counts.shape[:2] != (h, s)):
        return None
    groups = big_h // h
    if shared is not None and (log_counts is not None or shared.rows != groups * t
                               or shared.merged.shape != (h, s) or not _rows_of(shared.merged, 1)
                               or shared.merged.dtype != torch.int32 or shared.logits.shape[0] != h
                               or shared.positions.shape != shared.logits.shape[:2]
                               or shared.positions.dtype != torch.int32 or not shared.positions.is_contiguous()):
        shared = None
    q = (query.float().reshape(h, groups * t, d) * scaling).contiguous()
    out = torch.empty(big_h, t, d, dtype=torch.float32)
    mass = torch.empty(h, s, dtype=torch.float32)
    status = lib.lib.dsv41_question_attention(
        h, groups, t, d, q.data_ptr(), s, keys.data_ptr(), values.data_ptr(), _KEY_TYPES[keys.dtype], keys.stride(0),
        None if log_counts is None else log_counts.data_ptr(), 0 if log_counts is None else log_counts.stride(0),
        last, None if shared is None else shared.logits.data_ptr(), 0 if shared is None else shared.logits.shape[1],
        None if shared is None else shared.positions.data_ptr(), None if shared is None else shared.merged.data_ptr(),
        0 if shared is None else shared.merged.stride(0), out.data_ptr(), mass.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("the question's attention could not allocate its buffers")
    return (out, mass) if status == 0 else None


def recall_select(mass: torch.Tensor, positions: torch.Tensor, span: int, take: int) -> torch.Tensor | None:
    """cold.recall_layer's choice in one C call (dsv41_recall_select): the indices [h, take] of the `take` cold
    entries of each head ranked first by mass [h, C] (span > 1: by cold.span_ranking), in position order
    (positions [h, C] int32, a view whose rows are contiguous). None where the kernels do not apply."""
    lib = load()
    if (lib is None or mass.device.type != "cpu" or mass.dtype != torch.float32 or not mass.is_contiguous()
            or positions.dtype != torch.int32 or not _rows_of(positions, 1) or positions.shape != mass.shape):
        return None
    heads, c = mass.shape
    out = torch.empty(heads, take, dtype=torch.int64)
    status = lib.lib.dsv41_recall_select(heads, c, positions.data_ptr(), positions.stride(0), mass.data_ptr(),
                                         span, take, out.data_ptr())
    if status == -2:
        raise MemoryError("the recall's choice could not allocate its buffers")
    return out if status == 0 else None


def _hashable(keys: torch.Tensor, planes: torch.Tensor, tables: int, bits: int) -> bool:
    """Whether the C hashing takes `keys` [h, n, d] (a key type it reads, contiguous rows on the CPU) with `planes`."""
    d = keys.shape[2]
    return (keys.dtype in _KEY_TYPES and _rows_of(keys, d) and planes.dtype == torch.int8
            and planes.device.type == "cpu" and planes.is_contiguous() and planes.shape == (tables * bits, d))


def _sizes_fit(sizes: torch.Tensor, heads: int, tables: int, bits: int) -> bool:
    """Whether `sizes` is a [heads, tables << bits] int16 CPU table the C calls read and write as uint16."""
    return (sizes.dtype == torch.int16 and sizes.device.type == "cpu" and sizes.is_contiguous()
            and sizes.shape == (heads, tables << bits))


def cold_counts(hot_keys: torch.Tensor, cold_keys: torch.Tensor | None, planes: torch.Tensor, tables: int,
                bits: int, cold_sizes: torch.Tensor | None = None) -> torch.Tensor | None:
    """counts.cold_counts in one C call (dsv41_cold_counts): log(1 + c) [h, S] float32 for the hot keys [h, S, d], c
    the mean over the tables of their bucket's cold keys [h, C, d] over its hot ones. Keys float32 or bf16 (rounded
    to int8 as quantize_int8 rounds them) or int8 (as stored), views whose entries are contiguous rows; planes int8
    [tables * bits, d]. `cold_sizes` [h, tables << bits] int16 (read as unsigned): the cold keys' bucket sizes as
    lsh_tally keeps them, in place of hashing cold_keys (then None). The buckets are the torch path's integers
    (exact products). None where the kernels do not apply."""
    lib = load()
    h, s, d = hot_keys.shape
    given = cold_sizes is not None
    if lib is None or not _hashable(hot_keys, planes, tables, bits) or (
            not _sizes_fit(cold_sizes, h, tables, bits) if given else
            cold_keys is None or not _hashable(cold_keys, planes, tables, bits) or cold_keys.shape[0] != h):
        return None
    out = torch.empty(h, s, dtype=torch.float32)
    status = lib.lib.dsv41_cold_counts(h, d, s, hot_keys.data_ptr(), _KEY_TYPES[hot_keys.dtype],
                                       hot_keys.stride(0) if h else 0, 0 if given else cold_keys.shape[1],
                                       None if given else cold_keys.data_ptr(),
                                       0 if given else _KEY_TYPES[cold_keys.dtype],
                                       0 if given or not h else cold_keys.stride(0),
                                       cold_sizes.data_ptr() if given else None, planes.data_ptr(),
                                       tables, bits, out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("the reply's counts could not allocate their buffers")
    return out if status == 0 else None


def lsh_tally(keys: torch.Tensor, n: int, index: torch.Tensor, planes: torch.Tensor, tables: int, bits: int,
              sizes: torch.Tensor, sign: int) -> bool:
    """Add `sign` (+1 / -1) to the bucket sizes `sizes` [h, tables << bits] (int16, read as unsigned) for the keys at
    rows `index` [h, m] (< n) of `keys` [h, rows, d] (float32, bf16 or int8 as stored; a view whose entries are
    contiguous rows), hashed as cold_counts hashes them (dsv41_lsh_tally). False, and nothing changed, where the
    kernels do not apply or a size would leave 0..65535."""
    lib = load()
    h, _, d = keys.shape
    if (lib is None or not _hashable(keys, planes, tables, bits) or not _sizes_fit(sizes, h, tables, bits)
            or index.dim() != 2 or index.shape[0] != h or index.device.type != "cpu" or not 0 <= n <= keys.shape[1]):
        return False
    index = index.to(torch.int64).contiguous()
    status = lib.lib.dsv41_lsh_tally(h, d, n, index.shape[1], index.data_ptr(), keys.data_ptr(), _KEY_TYPES[keys.dtype],
                                     keys.stride(0) if h else 0, planes.data_ptr(), tables, bits, sign,
                                     sizes.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("the cold tier's bucket sizes could not allocate their buffers")
    if status == -1:
        raise ValueError("tallying the cold tier's buckets failed: an index or size out of range")
    return status == 0
