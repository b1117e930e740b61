"""A follow-up's reply counts what is cold: each hot entry stands for the cold entries like it.

From the reply's first decode step to the end of its turn, each hot entry's attention logit gets log(1 + c), c the
cold entries it stands for (DSV41Cache.count_cold), estimated by locality-sensitive hashing of the keys. The cold
tier (engine.cache.cold) keeps its keys' bucket sizes between turns where they pay (ColdLayer.bucket_sizes), so a
follow-up hashes only its hot set.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import cache_ops
from ..kernels.quant import quantize_int8
from .storage import LayerKV

# A reply after a recall counts what is cold (DSV41Cache.count_cold): each hot entry's attention logit gets log(1 + c),
# c the cold entries it stands for, so the softmax gives the hot set about the share the whole conversation would
# have (the merge mode's log n, without folding keys or values). c is estimated by locality-sensitive hashing:
# COUNT_TABLES tables of COUNT_BITS random hyperplanes through the origin bucket every key by the signs of its
# projections (keys at a small angle share buckets); in each table a bucket's cold entries are shared evenly by its
# hot ones, and c is the mean over the tables. The hyperplanes are int8 and every key is hashed as the int8 the cold
# tier stores (a hot key rounded as it would be), so the products are exact integers: an entry has the same buckets
# hot or cold, in any order of summation, on any device; on a CPU one C call a layer hashes and counts
# (cache_ops.cold_counts). Measured by benchmarks/followups.py (docs/design.md, "What the reply counts"): at 1,781
# tokens the follow-ups went from 20 / 21 / 22 to 24 / 24 / 24 of 36 at ratios 0.3 / 0.2 / 0.1 (uncompressed 23), at
# 3,752 tokens from 18 / 18 to 24 / 23 at 0.3 / 0.2 (uncompressed 19). Exact counts (each cold entry on its most
# similar hot key) take a [cold x hot] product per head and layer: about 70 billion multiply-adds a follow-up at
# 7.4k tokens.
COUNT_TABLES = 16
COUNT_BITS = 10
COUNT_SEED = 0


# The cold tier keeps its keys' bucket sizes between turns (ColdLayer.bucket_sizes: COUNT_TABLES << COUNT_BITS
# uint16 a head, 32 KiB), updated as entries go cold and come back, so a follow-up's counts hash only the hot set;
# kept only while they are at most 1 / BUCKET_SIZES_SHARE of the cold entries' bytes (3,641 int8 entries a head
# for head dim 64), so they add at most ~6 % to the tier. Below that the counts hash the cold keys each time.
BUCKET_SIZES_SHARE = 16

PLANE_STEPS = 32  # a hyperplane's normal in int8: round(32 x a standard normal), clamped to +-127


def hashing() -> tuple[int, int, int]:
    """What a key's buckets depend on besides the key (kept bucket sizes made with others are rebuilt)."""
    return COUNT_SEED, COUNT_TABLES, COUNT_BITS


@functools.lru_cache(maxsize=8)
def _planes(head_dim: int, device: str, seed: int, tables: int, bits: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    normals = torch.randn(head_dim, tables * bits, generator=generator)
    return normals.t().mul(PLANE_STEPS).round_().clamp_(-127, 127).to(torch.int8).contiguous().to(device)


def count_planes(head_dim: int, device) -> torch.Tensor:
    """The hyperplanes of count_cold's hashing [COUNT_TABLES * COUNT_BITS, head_dim] int8, the same for every cache
    (seeded: a chat's replies do not depend on the process they run in). In int8, like the keys they are applied
    to, so every product is an exact integer: a key hashes the same in any order of summation, on any device."""
    return _planes(head_dim, str(torch.device(device)), COUNT_SEED, COUNT_TABLES, COUNT_BITS)


def _buckets(keys: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """keys [h, n, d] -> each key's bucket in every table [h, n * COUNT_TABLES], numbered across the tables. A float
    key is rounded to int8 as the cold tier stores it (quantize_int8: an entry hashes the same hot or cold); the
    int8 products are exact in float32 (|sum| <= 127 * 127 * d < 2^24 for d <= 1024), as in the C call.
    cold_counts' path on a GPU, or without the kernels."""
    h, n = keys.shape[0], keys.shape[1]
    q = keys if keys.dtype == torch.int8 else quantize_int8(keys)[0]
    # [h, n, T, b]: 1.0 where the key is above the plane; a table's bits to its bucket number (exact in float32)
    signs = torch.matmul(q.float(), planes.float().t()).gt_(0).view(h, n, COUNT_TABLES, COUNT_BITS)
    powers = 2.0 ** torch.arange(COUNT_BITS, device=keys.device)
    offsets = torch.arange(COUNT_TABLES, device=keys.device) << COUNT_BITS
    return (torch.matmul(signs, powers).long() + offsets).view(h, -1)


@torch.inference_mode()
def cold_counts(layer: LayerKV, cold, planes: torch.Tensor) -> torch.Tensor:
    """log(1 + c) for each hot entry of `layer` [h, S] float32 on its device: c, the entries of the cold tier `cold`
    (a cold.ColdLayer) it stands for (see COUNT_TABLES). The cold keys are hashed as stored (int8: a key's scale is
    positive, it changes no sign), on the hot set's device (to a GPU the int8 bytes cross the bus, a quarter of
    float32); on a CPU from the bucket sizes the tier keeps, where it keeps them (ColdLayer.buckets)."""
    dev = layer.device
    h, s = layer.kv_heads, layer.length
    stored = cold.keys[:, : cold.length]
    if dev.type == "cpu":  # one C call: hashes, counts and shares (dsv41_cold_counts)
        sizes = cold.buckets()  # the cold keys' bucket sizes where the tier keeps them: only the hot set is hashed
        got = cache_ops.cold_counts(layer.read_keys(), None if sizes is not None else stored, planes, COUNT_TABLES,
                                    COUNT_BITS, sizes)
        if got is not None:
            return got
    hot = _buckets(layer.read_keys(), planes)
    held = _buckets(stored.to(dev, non_blocking=cold.pinned), planes)
    slots = COUNT_TABLES << COUNT_BITS
    heads = torch.arange(h, device=dev)[:, None] * slots  # one count over every head's buckets

    def sizes(buckets):
        return torch.bincount((buckets + heads).view(-1), minlength=h * slots).view(h, slots).float()

    shared = torch.gather(sizes(held), 1, hot) / torch.gather(sizes(hot), 1, hot)
    return shared.view(h, s, COUNT_TABLES).mean(dim=-1).log1p_()
