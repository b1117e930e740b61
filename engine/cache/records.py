"""Plain records the cache hands out: statistics, a checkpoint of a turn, a turn's prefill plan, the fused
step's plan, and the bytes one stored token costs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, element_bytes: int, int8: bool) -> int:
    """K and V bytes one stored token costs across all layers (INT8: 1 byte each plus a float32 scale)."""
    per = 1 + 4 / head_dim if int8 else element_bytes
    return int(math.ceil(num_layers * 2 * kv_heads * head_dim * per))


@dataclass
class CacheStats:
    tokens_seen: int
    stored_per_layer: list[int]
    merged_per_layer: list[int]
    stored_bytes: int
    uncompressed_bytes: int
    compactions: int
    compaction_seconds: float
    csa2_recall: float | None
    csa2_steps: int
    budget: int

    @property
    def stored(self) -> int:
        """Entries kept per layer and KV head, the mean over the layers (DSV41Cache.stored): stored / tokens_seen is
        the share of the uncompressed KV kept, also when the CED threshold left the layers different counts."""
        n = len(self.stored_per_layer)
        return round(sum(self.stored_per_layer) / n) if n else 0

    @property
    def compression_ratio(self) -> float:
        return self.stored_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 1.0


@dataclass
class Checkpoint:
    """What a turn may change before its prompt has been read (DSV41Cache.checkpoint / restore)."""

    seen: int
    compactions: int
    decode_steps: int
    lengths: tuple[int, ...]
    scores: tuple[torch.Tensor, ...]
    query_moments: tuple[torch.Tensor | None, ...]
    query_counts: tuple[int, ...]
    question_at: int | None = None
    exchange_from: int | None = None


@dataclass
class Prefill:
    """How one turn's new tokens are read (DSV41Cache.start_prefill decides; the turn loop follows)."""

    total: int
    question_tokens: int
    headroom: int | None  # entries the cache may hold while the turn is read (None: no limit)
    streaming: bool  # more than the headroom: compacted while it streams in
    wants_probe: bool  # score the streaming document with a probe of the question (set `probe` to its queries)
    probe: dict[int, torch.Tensor] | None = None
    compacted: bool = False  # a compaction happened while it streamed in


@dataclass
class FusedPlan:
    """What a fused CPU decode step does itself (engine.kernels.fused): per layer, whether `attend` runs it
    instead (by_python), and how the step updates the scores (scores <- decay * scores + attention)."""

    by_python: list[bool]
    score: bool
    decay: float


@dataclass(frozen=True)
class StaticLayer:
    """How one layer attends in a static decode step: densely over its capacity, or screened by CSA2 down to
    `k` entries (from `pool` candidates re-ranked exactly) plus the sinks and the recent window."""

    sparse: bool = False
    k: int = 0
    pool: int = 0


@dataclass
class StaticPlan:
    """A decode step with static shapes (engine.models.static_step; DSV41Cache.static_plan): the token's position,
    each layer's attention, and the score update scores <- decay * scores + attention (when `score`)."""

    position: int
    layers: list[StaticLayer]
    score: bool
    decay: float
    sink: int
    recent: int


@dataclass
class Forward:
    """The forward in progress (DSV41Cache.begin_forward .. end_forward)."""

    tokens: int = 0
    positions: torch.Tensor | None = None
    score_window: int | None = 0  # None: every query of the forward scores
    prefill: bool = True
    start_lengths: tuple[int, ...] = ()
    mask: torch.Tensor | None = None  # causal bias shared by the layers of a prefill chunk
    question: bool = False  # a turn's question is in this forward: each layer recalls from the cold tier first
    recalled: dict[int, int] = field(default_factory=dict)  # entries per head each layer recalled (abort keeps them)
    moved: dict = field(default_factory=dict)  # the positions on each other device a layer lives on
    first: int = 0  # the first token's position (a host int: `positions` may live on a GPU)
