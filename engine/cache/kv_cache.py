"""DSV41Cache: the compressing KV cache of one chat session (all layers).

The engine drives it around each model forward:
    cache.begin_forward(n_tokens, score_window)   positions = tokens seen so far
    ... model forward; each attention layer calls cache.attend(...) ...
    cache.end_forward()
and compacts it at the points DESIGN.md fixes (end of a turn's prefill, over the prefill headroom,
every few decode steps). Positions are never derived from the stored length.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import ced, csa2
from .attention import (
    attention_mass,
    causal_bias,
    chunk_needs_mask,
    decode_attention,
    decode_attention_output,
    dense_attention,
)
from .storage import LayerKV

CSA2_RECALL_EVERY = 64  # decode steps between sampled recall measurements (one layer each)
# CSA2 pays only on a long cache: below this many entries per top-k slot, dense attention is faster.
# Measured on 2 CPU cores (default model, top-k 256, every layer at the same length), decode step in ms,
# dense attention inside the fused C step against CSA2's screening in Python (called back from it):
# 16.2 / 24.5 at 2k entries, 21.2 / 26.8 at 4k, 31.7 / 29.2 at 8k -> the crossover is near 7k = 28 x top-k.
# (With the per-op Python step it was near 3k: 43/48 ms at 2k, 54/48 at 4k, 72/54 at 8k.)
CSA2_DENSE_BELOW = 28


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, element_bytes: int, int8: bool) -> int:
    """K and V bytes one stored token costs across all layers (INT8: 1 byte each plus a float32 scale)."""
    per = 1 + 4 / head_dim if int8 else element_bytes
    return int(math.ceil(num_layers * 2 * kv_heads * head_dim * per))


@dataclass
class CacheSettings:
    kv_cache_ratio: float = 0.5
    ced_decay: float = 0.995
    ced_threshold: float = 0.1
    ced_mode: str = "evict"
    ced_sink_tokens: int = 4
    ced_recent_tokens: int = 32
    ced_policy: str = "ced"
    csa2_topk: int = 256
    csa2_rank: int | None = None
    kv_int8: bool = False
    compact_every: int = 16
    score_window: int = 32
    min_entries: int = ced.MIN_STORED_ENTRIES  # budget floor (ced.budget_for)

    @classmethod
    def from_config(cls, config) -> CacheSettings:
        return cls(
            kv_cache_ratio=config.kv_cache_ratio, ced_decay=config.ced_decay, ced_threshold=config.ced_threshold,
            ced_mode=config.ced_mode, ced_sink_tokens=config.ced_sink_tokens,
            ced_recent_tokens=config.ced_recent_tokens, ced_policy=config.ced_policy, csa2_topk=config.csa2_topk,
            csa2_rank=config.csa2_rank, kv_int8=config.kv_cache_dtype == "int8",
        )

    @property
    def compressing(self) -> bool:
        return self.kv_cache_ratio < 1.0


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
        return max(self.stored_per_layer, default=0)

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


@dataclass
class _Forward:
    tokens: int = 0
    positions: torch.Tensor | None = None
    score_window: int | None = 0  # None: every query of the forward scores
    prefill: bool = True
    start_lengths: tuple[int, ...] = ()
    mask: torch.Tensor | None = None  # causal bias shared by the layers of a prefill chunk


@dataclass
class DSV41Cache:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    settings: CacheSettings
    backend: str = "sdpa"
    initial_capacity: int = 256
    prefill_bf16: bool = False  # prefill chunks attend in bf16 (attention.dense_attention; the model's choice)
    kv_bytes_per_element: int = field(init=False)

    def __post_init__(self):
        self.device = torch.device(self.device)
        self.kv_bytes_per_element = torch.empty((), dtype=self.dtype).element_size()
        self.reset()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self.layers = [
            LayerKV(self.kv_heads, self.head_dim, self.dtype, self.device, int8=self.settings.kv_int8,
                    initial_capacity=self.initial_capacity)
            for _ in range(self.num_layers)
        ]
        self.seen = 0
        self.compactions = 0
        self.compaction_seconds = 0.0
        self.decode_steps = 0
        self._recall: list[float] = []
        self._csa2_steps = 0
        self._fwd = _Forward()
        self._torch_rng = torch.Generator().manual_seed(0)
        self._capture: dict[int, torch.Tensor] | None = None
        self._scaling = self.head_dim**-0.5

    @property
    def stored(self) -> int:
        return self.layers[0].length if self.layers else 0

    @torch.inference_mode()
    def checkpoint(self) -> Checkpoint:
        """The state a half-read turn must be undone to: tokens seen, lengths, scores, CSA2 query moments."""
        return Checkpoint(
            self.seen, self.compactions, self.decode_steps, tuple(layer.length for layer in self.layers),
            tuple(layer.scores[:, :layer.length].clone() for layer in self.layers),
            tuple(None if layer.query_moment is None else layer.query_moment.clone() for layer in self.layers),
            tuple(layer.query_count for layer in self.layers))

    @torch.inference_mode()
    def restore(self, checkpoint: Checkpoint) -> bool:
        """Undo everything since `checkpoint` that only appended (a prefill stopped part-way). False, and
        nothing changed, when a compaction has removed entries since: then only a rebuild can undo it."""
        if (self.compactions != checkpoint.compactions or len(self.layers) != len(checkpoint.lengths)
                or any(layer.length < n for layer, n in zip(self.layers, checkpoint.lengths, strict=True))):
            return False
        for layer, n, scores, moment, count in zip(self.layers, checkpoint.lengths, checkpoint.scores,
                                                   checkpoint.query_moments, checkpoint.query_counts, strict=True):
            layer.truncate(n)
            layer.scores[:, :n] = scores
            layer.query_moment, layer.query_count = moment, count
        self.seen, self.decode_steps = checkpoint.seen, checkpoint.decode_steps
        self._fwd = _Forward()
        return True

    def budget(self, seen: int | None = None) -> int:
        s = self.settings
        return ced.budget_for(self.seen if seen is None else seen, s.kv_cache_ratio, s.ced_sink_tokens,
                              s.ced_recent_tokens, s.min_entries)

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, tokens: int, *, score_window: int | None = None, prefill: bool | None = None,
                      start: int | None = None) -> torch.Tensor:
        """Start a forward over `tokens` new tokens; returns their position ids [1, tokens] (from `start`,
        default: tokens seen so far)."""
        first = self.seen if start is None else start
        positions = torch.arange(first, first + tokens, device=self.device)
        window = self.stream_window() if score_window is None else score_window
        self._fwd = _Forward(tokens, positions, window, tokens > 1 if prefill is None else prefill,
                             tuple(layer.length for layer in self.layers))
        return positions[None]

    def stream_window(self) -> int | None:
        """How many of a prefill chunk's last queries score it when nobody says (text read as it streams):
        SnapKV's observation window (`score_window`) for snapkv; every query (None) for CED and H2O, as a
        decode step scores with every query it makes. Measured (perplexity at ratio 0.5, 2k-token speeches,
        128-token chunks): CED with the last 32 queries +2.94 / +1.24 / +1.65 / +1.34 %, with every query
        +2.49 / +1.52 / +0.20 / +1.30 % (mean 1.79 -> 1.38 %)."""
        return self.settings.score_window if self.settings.ced_policy == "snapkv" else None

    @torch.inference_mode()
    def abort_forward(self) -> None:
        """Undo a forward that failed part-way (OOM, error): drop what some layers appended."""
        for layer, length in zip(self.layers, self._fwd.start_lengths, strict=False):
            layer.truncate(length)
        self._fwd = _Forward()

    def end_forward(self) -> None:
        self.seen += self._fwd.tokens
        if not self._fwd.prefill:
            self.decode_steps += 1
        self._fwd = _Forward()

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [1, H, T, d], key/value [1, h, T, d] (RoPE applied) -> output [1, T, H, d]."""
        layer = self.layers[layer_idx]
        fwd = self._fwd
        start = layer.length
        layer.append(key[0], value[0], fwd.positions)
        csa2.project_new(layer, key[0], start)
        q = query[0]
        s = self.settings
        self._scaling = scaling
        scoring = s.compressing and s.ced_policy in ("ced", "h2o", "snapkv")
        if self._capture is not None:  # a question probe: keep its queries, score nothing
            self._capture[layer_idx] = q.detach().clone()
            scoring = False
        log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
        t = q.shape[1]
        if t == 1 and self._sparse_ready(layer):
            out = self._sparse_decode(layer_idx, layer, q, scaling, scoring)
        elif t == 1 and not scoring and log_counts is None:  # nothing needs the weights: output only
            out = decode_attention_output(q, layer.read_keys(), layer.read_values(), scaling)
        elif t == 1:
            out, probs = decode_attention(q, layer.read_keys(), layer.read_values(), log_counts, scaling)
            if scoring:
                ced.observe(layer, s.ced_policy, s.ced_decay, probs.sum(dim=1), 1, prefill=False)
        else:
            keys, values = layer.read_keys(), layer.read_values()
            mask = None
            if self.backend != "eager" and keys.shape[1] != t and chunk_needs_mask(q.device):
                # every layer has the same (t, S): build the mask once per forward
                if fwd.mask is None or fwd.mask.shape != (t, keys.shape[1]) or fwd.mask.dtype != q.dtype:
                    fwd.mask = causal_bias(t, keys.shape[1], q.dtype, q.device)
                mask = fwd.mask
            out = dense_attention(q, keys, values, log_counts, scaling, self.backend, mask, bf16=self.prefill_bf16)
            if s.csa2_topk > 0 and self._capture is None:
                csa2.observe_queries(layer, q)
            window = t if fwd.score_window is None else min(fwd.score_window, t)
            if scoring and window > 0:
                # dt counts scoring steps (the window's queries), not the chunk's tokens: a document read
                # without scoring does not age what earlier turns found important (see ced.observe).
                mass = attention_mass(q, keys, log_counts, scaling, last=window)
                ced.observe(layer, s.ced_policy, s.ced_decay, mass, window, prefill=True)
        return out.to(query.dtype).transpose(0, 1)[None]  # a bf16 cache under float32 activations

    def fused_plan(self) -> list[bool] | None:
        """For a decode step run as one fused CPU call (engine.cpu_kernels.FusedDecodeStep): per layer, whether
        its append and attention stay with `attend` (called back from the C step): a layer with a CSA2 side
        cache (sparse screening), or an INT8 cache. The other layers are appended to and attended in C, as
        `attend` would for one token: dense attention with merge counts, CED scoring (`fused_scoring`); they
        get room for one more entry here. None when the step cannot be fused: not a one-token decode, a probe,
        or not a CPU float32/bf16 cache."""
        fwd = self._fwd
        if (fwd.tokens != 1 or fwd.prefill or self._capture is not None or self.device.type != "cpu"
                or self.dtype not in (torch.float32, torch.bfloat16)):
            return None
        plan = []
        for layer in self.layers:
            by_python = self.settings.kv_int8 or layer.projected_keys is not None
            if not by_python:
                layer.ensure_capacity(layer.length + 1)
            plan.append(by_python)
        return plan

    def fused_scoring(self) -> tuple[bool, float]:
        """(whether a decode step folds its attention into the scores, the decay it applies first), as
        `attend` + ced.observe do for one token."""
        s = self.settings
        scoring = s.compressing and s.ced_policy in ("ced", "h2o", "snapkv")
        return scoring, (s.ced_decay if s.ced_policy == "ced" else 1.0)

    # ------------------------------------------------------------------ question probe
    def start_capture(self) -> None:
        """The next forward is a probe: its per-layer queries are kept, its entries are dropped after."""
        self._capture = {}

    def finish_capture(self) -> dict[int, torch.Tensor]:
        captured, self._capture = self._capture or {}, None
        return captured

    @torch.inference_mode()
    def score_with_probe(self, probe: dict[int, torch.Tensor]) -> None:
        """Add the attention the probe's queries ([H, Tq, d] per layer, positioned after everything
        stored) pay to every stored entry to its score, summed over the group's heads and the queries."""
        for index, layer in enumerate(self.layers):
            q = probe.get(index)
            if q is None or layer.length == 0:
                continue
            h, n = layer.kv_heads, layer.length
            keys = layer.read_keys().float()
            qg = q.float().reshape(h, -1, q.shape[-1])  # [h, G * Tq, d]
            logits = torch.matmul(qg, keys.transpose(1, 2)) * self._scaling
            if layer.merged_any:
                logits = logits + layer.log_counts[:, None, :n]
            layer.scores[:, :n] += torch.softmax(logits, dim=-1).sum(dim=1)

    # ------------------------------------------------------------------ CSA2
    def _sparse_ready(self, layer: LayerKV) -> bool:
        s = self.settings
        return s.csa2_topk > 0 and layer.projected_keys is not None and self._sparse_pays(layer.length)

    def _sparse_decode(self, layer_idx: int, layer: LayerKV, q: torch.Tensor, scaling: float,
                       scoring: bool) -> torch.Tensor:
        s = self.settings
        index, top = csa2.screen(layer, q, s.csa2_topk, s.ced_sink_tokens, s.ced_recent_tokens)
        keys, values = layer.read_keys(index), layer.read_values(index)
        log_counts = torch.gather(layer.log_counts, 1, index) if layer.merged_any else None
        out, probs = decode_attention(q, keys, values, log_counts, scaling)
        if scoring:
            ced.observe(layer, s.ced_policy, s.ced_decay, probs.sum(dim=1), 1, index, prefill=False)
        if layer_idx == 0:
            self._csa2_steps += 1
        # Sampled recall against the exact top-k: every CSA2_RECALL_EVERY-th step, on a rotating layer.
        step = self.decode_steps
        if step % CSA2_RECALL_EVERY == 0 and layer_idx == (step // CSA2_RECALL_EVERY) % len(self.layers):
            self._recall.append(csa2.exact_topk_recall(layer, q, top, s.ced_sink_tokens, s.ced_recent_tokens))
        return out

    @torch.inference_mode()
    def fit_sparse(self) -> None:
        """Fit the CSA2 screening projection on what is stored (after a prefill or a compaction)."""
        s = self.settings
        if s.csa2_topk <= 0:
            for layer in self.layers:
                layer.projected_keys = None
            return
        rank = s.csa2_rank or max(1, self.head_dim // 8)
        for layer in self.layers:
            if self._sparse_pays(layer.length):
                csa2.fit(layer, rank)
            else:  # short cache: dense attention, no side cache to pay for
                layer.projected_keys = None

    def _sparse_pays(self, length: int) -> bool:
        s = self.settings
        return length > s.csa2_topk + s.ced_sink_tokens + s.ced_recent_tokens and length >= CSA2_DENSE_BELOW * s.csa2_topk

    # ------------------------------------------------------------------ compaction
    @torch.inference_mode()
    def compact(self, target: int | None = None, *, threshold: bool = True, pooled: bool = False,
                spans: bool = False) -> int:
        """Compact every layer down to `target` entries (default: the budget). Returns entries dropped per head.

        `spans` / `pooled`: the compaction after a question has scored every entry: CED keeps whole spans, the
        baselines rank by max-pooled scores (see ced.ranking)."""
        s = self.settings
        if not s.compressing:
            return 0
        target = self.budget() if target is None else target
        started = time.perf_counter()
        dropped = 0
        use_threshold = s.ced_threshold if threshold and s.ced_policy in ("ced", "h2o", "snapkv") else 0.0
        for layer in self.layers:
            rank = ced.ranking(layer, s.ced_policy, self._torch_rng, pooled=pooled, spans=spans)
            plan = ced.plan_compaction(rank, target, sink=s.ced_sink_tokens, recent=s.ced_recent_tokens,
                                       threshold=use_threshold, scores=layer.scores[:, : layer.length],
                                       floor=s.min_entries)
            if plan is None:
                continue
            if s.ced_mode == "merge":
                ced.merge_into_kept(layer, plan)
            layer.keep(plan.keep)
            dropped = max(dropped, plan.drop.shape[1])
        if dropped:
            self.compactions += 1
        self.compaction_seconds += time.perf_counter() - started
        return dropped

    def maybe_compact_decode(self) -> int:
        s = self.settings
        if (s.csa2_topk > 0 and self.decode_steps % s.compact_every == 0 and self.layers
                and self.layers[0].projected_keys is None and self._sparse_pays(self.stored)):
            self.fit_sparse()  # a reply that grew the cache past the point where CSA2 pays
        if s.compressing and self.decode_steps and self.decode_steps % s.compact_every == 0 and self.stored > self.budget():
            return self.compact()
        return 0

    @torch.inference_mode()
    def reserve(self, entries: int) -> None:
        """Make room for `entries` stored entries per layer at once (a turn whose size is known), instead
        of growing block by block while it streams in."""
        for layer in self.layers:
            if entries > layer.capacity:
                layer.resize(entries)

    @torch.inference_mode()
    def shrink(self, spare_tokens: int = 256) -> None:
        for layer in self.layers:
            layer.shrink_to_fit(spare_tokens)

    # ------------------------------------------------------------------ reporting
    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def uncompressed_bytes(self, seen: int | None = None) -> int:
        seen = self.seen if seen is None else seen
        return seen * self.num_layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes_per_element

    def stored_kv_bytes(self) -> int:
        """Bytes held by stored entries (incl. side caches), without spare capacity."""
        return sum(layer.used_bytes() for layer in self.layers)

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.kv_bytes_per_element,
                                  self.settings.kv_int8)

    def stats(self) -> CacheStats:
        recall = sum(self._recall) / len(self._recall) if self._recall else None
        return CacheStats(
            tokens_seen=self.seen,
            stored_per_layer=[layer.length for layer in self.layers],
            merged_per_layer=[layer.merged_tokens for layer in self.layers],
            stored_bytes=self.stored_kv_bytes(),
            uncompressed_bytes=self.uncompressed_bytes(),
            compactions=self.compactions,
            compaction_seconds=self.compaction_seconds,
            csa2_recall=recall,
            csa2_steps=self._csa2_steps,
            budget=self.budget(),
        )
