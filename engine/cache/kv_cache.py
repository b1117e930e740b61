"""DSV41Cache: the compressing KV cache of one chat session (all layers).

What the turn loop (engine.generate) and the session call, in the order of a turn:

    prefill = cache.start_prefill(tokens, question_tokens, headroom)   reserve; decide how the turn is read
    for each chunk:  cache.before_chunk(prefill, size)                 compact first if over the headroom
                     forward (below), scored by cache.chunk_window(prefill, last); the last one
                     (question=True) recalls from the cold tier layer by layer
    cache.finish_prefill(answer_follows=True)                          question-aware compaction, CSA2 fit
                                                                       (once the first reply token is sampled)
                                                                       (tiered CED: after the reply instead;
                                                                       a follow-up's reply counts the cold
                                                                       tier until finish_turn: count_cold,
                                                                       before its first token is shown:
                                                                       readies_reply_first)
    for each decode step: forward, then cache.after_decode_step()
    cache.finish_turn()                                                back to the steady-state budget
    cache.apply(settings) -> "compacted" | "needs_rebuild"             new knobs between turns

Each forward (engine.models.adapter) is `begin_forward(n)` (positions = tokens seen so far, never derived from
the stored length), then every attention layer's `attend(...)`, then `end_forward()` (or `abort_forward()` when
it failed part-way). A fused CPU decode step reads `fused_plan()` instead of calling `attend` for most layers.
What is kept is the policy's decision (engine.cache.policies), how much the budget's (engine.cache.budget);
what leaves the hot set goes to the cold tier (engine.cache.cold) when it is on.

Why this file is long: it is one object's state (the hot layers, the cold tier, the forward in progress, the
turn's counters) and every method that changes it; the pieces that do not need that state live beside it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import PinError
from ..paths import cold_dir
from . import attention, csa2, policies
from .budget import budget_for, explain_ratio, plan_compactions
from .cold import ColdLayer, recall_layer, recall_size
from .counts import cold_counts, count_planes
from .merge import merge_into_kept
from .policies import PROBE, QUESTION, STREAM
from .policies.ced import SPAN_TOKENS
from .records import (
    CacheStats,
    Checkpoint,
    Forward,
    FusedPlan,
    Prefill,
    StaticLayer,
    StaticPlan,
    kv_bytes_per_token,
)
from .settings import CacheSettings
from .storage import LayerKV

__all__ = ["CacheStats", "Checkpoint", "DSV41Cache", "FusedPlan", "Prefill", "StaticPlan", "kv_bytes_per_token"]


# A reply decoded before its question's compaction (DSV41Cache.answers_before_compacting) may add this many
# entries to what the question's forward held before it is compacted back (a short answer is never compacted
# mid-way: a fact dropped at its 16th token was lost to the rest of the answer)
REPLY_ROOM = 256
# A follow-up question reads with what it recalled (cold.RECALL_MIN entries a head at least); before its reply the
# hot set goes back to the budget plus this many entries a head, the ones the question's attention ranks first
# (benchmarks/followups.py, AMD EPYC, 1,781 tokens at ratio 0.3: the reply's decode 11-17 % below the discarding
# chat's instead of 26 % with all 512 recalled kept; follow-ups 20 of 36 either way, docs/design.md)
REPLY_RECALLED = 256
# Room a compacted cache keeps past its entries for the next turn's question and reply; a tiered cache keeps what
# the next question may recall on top (cold.recall_size), which every follow-up fills again: without it, each
# follow-up's reserve reallocated and copied every layer (at 8k, 512 entries a head: ~12 MB of the default
# model's memory kept between turns instead).
SPARE_TOKENS = 256
# A follow-up's reply attends with each hot entry standing for the cold entries like it (counts.cold_counts, from the
# reply's first decode step to the end of the turn); False: the hot set alone, as if nothing were cold
COUNT_COLD = True
# ... in the layers whose cold tier holds at least this many entries a head: the counts are estimated from how the
# cold keys fall into the hash buckets, and over a few hundred entries that is mostly chance. Measured
# (benchmarks/followups.py, follow-ups of 36 without -> with the counts; cold entries a head at the count read by
# hand with a probe on count_cold): 943
# tokens 30 -> 30 (230 cold, ratio 0.5), 31 -> 27 (430, 0.3; 27 / 27 / 30 over three hash seeds), 30 -> 29 (520,
# 0.2), 28 -> 30 (600, 0.1); 1,781 tokens 20 -> 23 (650, 0.5), 20 -> 24 (1,000, 0.3), 21 -> 24, 22 -> 24; more
# at 3,752 and 7,429 tokens (docs/design.md, "What the reply counts")
COUNT_COLD_MIN = 512


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
    # Each layer's device, when the model's layers are spread over several (device_map="auto" on several GPUs):
    # a layer's KV lives beside its weights. None: every layer on `device`.
    layer_devices: tuple | None = None
    kv_bytes_per_element: int = field(init=False)

    def __post_init__(self):
        self.device = torch.device(self.device)
        devices = tuple(torch.device(d) for d in self.layer_devices) if self.layer_devices else None
        if devices is not None and len(devices) != self.num_layers:
            raise ValueError(f"layer_devices names {len(devices)} devices for {self.num_layers} layers")
        self.layer_devices = devices
        self.kv_bytes_per_element = torch.empty((), dtype=self.dtype).element_size()
        self.reset()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        devices = self.layer_devices or (self.device,) * self.num_layers
        self.layers = [
            LayerKV(self.kv_heads, self.head_dim, self.dtype, device, int8=self.settings.kv_int8,
                    initial_capacity=self.initial_capacity)
            for device in devices
        ]
        self.seen = 0
        self.compactions = 0
        self.compaction_seconds = 0.0
        self.decode_steps = 0
        self._recall: list[float] = []
        self._csa2_steps = 0
        self._fwd = Forward()
        self._torch_rng = torch.Generator().manual_seed(0)
        self._capture: dict[int, torch.Tensor] | None = None
        self._scaling = self.head_dim**-0.5
        self._policy: policies.Policy | None = None
        # The cold tier (cold.py): what compactions took out of the hot set, recalled by each question.
        # The layers ask the cache where to spill through a weak reference: a bound method would make a cycle
        # (cache -> cold layer -> cache) that only the cyclic collector frees, rarely, keeping every dropped
        # chat's cache in memory until then (measured: a server's RSS grew 900 MiB over 240 short chats).
        spill = weakref.WeakMethod(self._spill)
        self.cold = [ColdLayer(self.kv_heads, self.head_dim, self.dtype, "cpu",
                               int8=self.settings.cold_tier_dtype == "int8",
                               spill=lambda extra, spill=spill: spill()(extra), pinned=self.device.type == "cuda")
                     for _ in range(self.num_layers)] if self.settings.cold_tier != "off" else None
        self.recalled = 0  # entries the last question brought back from the cold tier (per head, summed over layers)
        self.pinned: tuple[tuple[int, int], ...] = ()  # position ranges kept hot whatever their rank (pin)
        self.recall_seconds = 0.0
        # While a reply is decoded after its question (finish_prefill(answer_follows=True)): the entries the
        # question's forward held, which the reply may attend to until the turn ends (None: the budget)
        self.answer_limit: int | None = None
        self.question_tokens = 0  # the current turn's question, its last tokens (start_prefill)
        # Where the latest turn's question begins, and the turn's before it (start_prefill): a reply counts nothing
        # for that earlier question and its answer (count_cold)
        self.question_at: int | None = None
        self.exchange_from: int | None = None
        self.counting = False  # the hot set's log counts stand for the cold tier (count_cold) until the turn ends

    @property
    def policy(self) -> policies.Policy:
        """The compression policy `settings.ced_policy` names (made again when the settings are replaced)."""
        policy = self._policy
        if policy is None or policy.settings is not self.settings or policy.name != self.settings.ced_policy:
            self._policy = policies.make(self.settings)
        return self._policy

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices the hot layers live on (one, or several when the model's layers are spread)."""
        return tuple(dict.fromkeys(layer.device for layer in self.layers)) or (self.device,)

    @property
    def stored(self) -> int:
        """Entries kept per layer and KV head: the mean over the layers, rounded. stored / seen is the share of the
        uncompressed KV the cache keeps (what the memory report and a turn's stats say): every head of a layer keeps
        the same count, but the layers need not (the CED threshold cuts each layer to what its own scores want)."""
        return round(sum(layer.length for layer in self.layers) / len(self.layers)) if self.layers else 0

    @property
    def longest(self) -> int:
        """Entries per head of the layer that keeps the most: what the budget, a turn's headroom and the room reserved
        for it hold every layer to (`stored` while the layers keep the same count)."""
        return max((layer.length for layer in self.layers), default=0)

    @torch.inference_mode()
    def checkpoint(self) -> Checkpoint:
        """The state a half-read turn must be undone to: tokens seen, lengths, scores, CSA2 query moments."""
        return Checkpoint(
            self.seen, self.compactions, self.decode_steps, tuple(layer.length for layer in self.layers),
            tuple(layer.scores[:, :layer.length].clone() for layer in self.layers),
            tuple(None if layer.query_moment is None else layer.query_moment.clone() for layer in self.layers),
            tuple(layer.query_count for layer in self.layers), self.question_at, self.exchange_from)

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
        self.question_at, self.exchange_from = checkpoint.question_at, checkpoint.exchange_from
        self._fwd = Forward()
        return True

    @torch.inference_mode()
    def forget_last(self, tokens: int) -> bool:
        """Forget the last `tokens` positions fed (a reply's tail its transcript does not keep: the start of a stop
        string, a character cut in two), where they are the last entries of every head of every layer and none is
        cold (the recent window keeps them hot); False, and nothing changed, otherwise."""
        first = self.seen - tokens
        if tokens <= 0 or first < 0:
            return tokens == 0
        if self.cold is not None and any(c.length and bool((c.positions[:, : c.length] >= first).any())
                                         for c in self.cold):
            return False
        for layer in self.layers:  # positions are unique in a head: the last `tokens` ≥ first are exactly those
            if layer.length < tokens or not bool((layer.positions[:, layer.length - tokens:layer.length] >= first)
                                                 .all()):
                return False
        for layer in self.layers:
            layer.truncate(layer.length - tokens)
        self.seen = first
        self._fwd = Forward()
        return True

    def budget(self, seen: int | None = None) -> int:
        s = self.settings
        return budget_for(self.seen if seen is None else seen, s.kv_cache_ratio, s.ced_sink_tokens,
                          s.ced_recent_tokens, s.min_entries)

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, tokens: int, *, score_window: int | None = None, prefill: bool | None = None,
                      start: int | None = None, question: bool = False) -> torch.Tensor:
        """Start a forward over `tokens` new tokens; returns their position ids [1, tokens] (from `start`,
        default: tokens seen so far). `question`: the forward holds a turn's question (its last chunk), so with
        the cold tier on each layer first recalls what the question's queries look for (_recall_layer)."""
        first = self.seen if start is None else start
        positions = torch.arange(first, first + tokens, device=self.device)
        window = self.policy.stream_window if score_window is None else score_window
        question = question and self.cold is not None and self.settings.compressing
        self._fwd = Forward(tokens, positions, window, tokens > 1 if prefill is None else prefill,
                             tuple(layer.length for layer in self.layers), question=question, first=first)
        if question:
            self.recalled, self.recall_seconds = 0, 0.0
        return positions[None]

    def begin_token(self) -> int:
        """begin_forward for one decode token whose caller needs no position tensor (the fused CPU step takes the
        position as a number): returns its position. The tensor is made only if a layer's `attend` asks for it."""
        first = self.seen
        self._fwd = Forward(1, None, self.policy.stream_window, False, tuple(layer.length for layer in self.layers),
                            first=first)
        return first

    @torch.inference_mode()
    def abort_forward(self) -> None:
        """Undo a forward that failed part-way (OOM, error): drop what some layers appended (always their last
        entries: what a layer recalled sits before them, by position, and stays in the hot set)."""
        fwd = self._fwd
        for index, (layer, length) in enumerate(zip(self.layers, fwd.start_lengths, strict=False)):
            layer.truncate(min(layer.length, length + fwd.recalled.get(index, 0)))
        self._fwd = Forward()

    def end_forward(self) -> None:
        self.seen += self._fwd.tokens
        if not self._fwd.prefill:
            self.decode_steps += 1
        self._fwd = Forward()

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [1, H, T, d], key/value [1, h, T, d] (RoPE applied) -> output [1, T, H, d]."""
        layer = self.layers[layer_idx]
        fwd = self._fwd
        start = layer.length
        positions = fwd.positions
        if positions is None:  # a forward begun by begin_token
            positions = fwd.positions = torch.arange(fwd.first, fwd.first + fwd.tokens, device=self.device)
        if positions.device != layer.device:  # layers spread over devices: the positions follow the layer
            positions = fwd.moved.get(layer.device)
            if positions is None:
                positions = fwd.moved[layer.device] = fwd.positions.to(layer.device)
        layer.append(key[0], value[0], positions)
        csa2.project_new(layer, key[0], start)
        q = query[0]
        s = self.settings
        self._scaling = scaling
        policy = self.policy
        scoring = s.compressing and policy.uses_attention
        if self._capture is not None:  # a question probe: keep its queries, score nothing
            self._capture[layer_idx] = q.detach().clone()
            scoring = False
        log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
        t = q.shape[1]
        if t == 1 and self._sparse_ready(layer):
            out = self._sparse_decode(layer_idx, layer, q, scaling, scoring)
        elif t == 1 and not scoring and log_counts is None:  # nothing needs the weights: output only
            out = attention.decode_attention_output(q, layer.read_keys(), layer.read_values(), scaling)
        elif t == 1:
            out, probs = attention.decode_attention(q, layer.read_keys(), layer.read_values(), log_counts, scaling)
            if scoring:
                policy.observe(layer.scores[:, :layer.length], probs.sum(dim=1), 1, prefill=False)
        else:
            window = t if fwd.score_window is None else min(fwd.score_window, t)
            shared = None
            if fwd.question and scoring and window > 0 and self.cold[layer_idx].length:
                # a chunk that is all question: its attention takes the hot logits the recall computed
                shared = self._recall_layer(layer_idx, layer, q[:, t - window:], scaling, share=window == t)
                log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
            keys, values = layer.read_keys(), layer.read_values()
            mask = None
            fused = scoring and window > 0 and self.backend != "eager" and attention.fuses_question(q, keys)
            if fused:  # a short scored chunk (a follow-up's question): output and scores from one softmax
                out, mass = attention.question_attention(q, keys, values, log_counts, scaling, last=window,
                                                         shared=shared)
            elif self.backend != "eager" and keys.shape[1] != t and attention.chunk_needs_mask(q.device):
                # every layer has the same (t, S): build the mask once per forward
                if (fwd.mask is None or fwd.mask.shape != (t, keys.shape[1]) or fwd.mask.dtype != q.dtype
                        or fwd.mask.device != q.device):
                    fwd.mask = attention.causal_bias(t, keys.shape[1], q.dtype, q.device)
                mask = fwd.mask
            if not fused:
                out = attention.dense_attention(q, keys, values, log_counts, scaling, self.backend, mask,
                                                bf16=self.prefill_bf16)
            if s.csa2_topk > 0 and self._capture is None:
                csa2.observe_queries(layer, q)
            if scoring and window > 0:
                if fwd.question and policy.waits_for_question:
                    # Tiered, a question ranks by its own attention alone: what earlier questions needed is
                    # in the cold tier, recallable by the question that needs it again (follow-ups at 1.8k
                    # tokens, repetition penalty 1.1, ratios 0.3 / 0.2 / 0.1: 11 / 12 / 8 of 18 against
                    # 10 / 10 / 5 with the scores carried over; uncompressed 11; the cases of benchmarks/followups.py, each
                    # variant run once by hand: the script runs the shipped rule only).
                    layer.scores[:, : layer.length].zero_()
                # dt counts scoring steps (the window's queries), not the chunk's tokens: a document read
                # without scoring does not age what earlier turns found important (Policy.observe).
                if not fused:
                    mass = attention.attention_mass(q, keys, log_counts, scaling, last=window)
                policy.observe(layer.scores[:, :layer.length], mass, window, prefill=True)
        return out.to(query.dtype).transpose(0, 1)[None]  # a bf16 cache under float32 activations

    def fused_plan(self) -> FusedPlan | None:
        """For a decode step run as one fused CPU call (engine.kernels.fused.FusedDecodeStep): per layer, whether
        its append and attention stay with `attend` (called back from the C step): a layer with a CSA2 side
        cache (sparse screening), an INT8 cache, or every layer when the policy's decode update is not the
        step's `decay * scores + attention`. The other layers are appended to and attended in C, as `attend`
        would for one token; they get room for one more entry here. None when the step cannot be fused: not
        a one-token decode, a probe, or not a CPU float32/bf16 cache."""
        fwd = self._fwd
        if (fwd.tokens != 1 or fwd.prefill or self._capture is not None or self.device.type != "cpu"
                or self.dtype not in (torch.float32, torch.bfloat16)):
            return None
        policy = self.policy
        score = self.settings.compressing and policy.uses_attention
        decay = policy.decode_decay() if score else 1.0
        every = self.settings.kv_int8 or decay is None
        by_python = []
        for layer in self.layers:
            python = every or layer.projected_keys is not None
            if not python and layer.length >= layer.keys.shape[1]:  # (its capacity: one more entry needs room)
                layer.ensure_capacity(layer.length + 1)
            by_python.append(python)
        return FusedPlan(by_python, score, 1.0 if decay is None else decay)

    def static_plan(self) -> StaticPlan | None:
        """For a decode step with static shapes (engine.models.static_step, CUDA-graph captured on a GPU): per
        layer, dense attention over its capacity or CSA2 screening with fixed counts (as `attend` would choose
        for the length it is about to have), each with room for one more entry. None where the step must run
        through `attend`: not a one-token decode, a probe, layers on several devices, a policy whose decode
        update is not `decay * scores + attention`, or a step that samples CSA2's recall (csa2.RECALL_EVERY)."""
        fwd = self._fwd
        if fwd.tokens != 1 or fwd.prefill or self._capture is not None or len(self.devices) > 1:
            return None
        s = self.settings
        policy = self.policy
        score = s.compressing and policy.uses_attention
        decay = policy.decode_decay() if score else 1.0
        if decay is None:
            return None
        modes = []
        for layer in self.layers:
            n = layer.length + 1
            if s.csa2_topk > 0 and layer.projected_keys is not None and csa2.pays(n, s):
                n_sink, n_recent = csa2.protected_counts(n, s.ced_sink_tokens, s.ced_recent_tokens)
                span = n - n_sink - n_recent
                k = min(s.csa2_topk, span)
                modes.append(StaticLayer(True, k, min(k * max(csa2.RERANK, 1), span)))
            else:
                modes.append(StaticLayer())
        if modes and any(m.sparse for m in modes) and self.decode_steps % csa2.RECALL_EVERY == 0:
            return None
        for layer in self.layers:
            layer.ensure_capacity(layer.length + 1)
        return StaticPlan(fwd.first, modes, score, decay, s.ced_sink_tokens, s.ced_recent_tokens)

    def commit_static(self, plan: StaticPlan) -> None:
        """A static step wrote every layer's entry at its length: count it."""
        for layer in self.layers:
            layer.length += 1
        if plan.layers and plan.layers[0].sparse:
            self._csa2_steps += 1

    # ------------------------------------------------------------------ question probe
    def start_capture(self) -> None:
        """The next forward is a probe (engine.models.adapter.probe_queries): its per-layer queries are kept,
        nothing is scored, and its entries are dropped after (abort_forward)."""
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
            log_counts = layer.log_counts[:, : layer.length] if layer.merged_any else None
            layer.scores[:, : layer.length] += attention.probe_mass(q, layer.read_keys(), log_counts, self._scaling)

    # ------------------------------------------------------------------ CSA2
    def _sparse_ready(self, layer: LayerKV) -> bool:
        return self.settings.csa2_topk > 0 and layer.projected_keys is not None and \
            csa2.pays(layer.length, self.settings)

    def _sparse_decode(self, layer_idx: int, layer: LayerKV, q: torch.Tensor, scaling: float,
                       scoring: bool) -> torch.Tensor:
        s = self.settings
        out, probs, index, top = csa2.sparse_attention(layer, q, scaling, s)
        if scoring:
            self.policy.observe(layer.scores[:, :layer.length], probs.sum(dim=1), 1, index, prefill=False)
        if layer_idx == 0:
            self._csa2_steps += 1
        # Sampled recall against the exact top-k: every csa2.RECALL_EVERY-th step, on a rotating layer.
        step, every = self.decode_steps, csa2.RECALL_EVERY
        if step % every == 0 and layer_idx == (step // every) % len(self.layers):
            self._recall.append(csa2.exact_topk_recall(layer, q, top, s.ced_sink_tokens, s.ced_recent_tokens))
        return out

    @torch.inference_mode()
    def fit_sparse(self) -> None:
        """Fit the CSA2 screening projection on what is stored (after a prefill or a compaction)."""
        csa2.fit_layers(self.layers, self.settings, self.head_dim)

    # ------------------------------------------------------------------ a turn
    def start_prefill(self, total: int, question_tokens: int, headroom: int | None) -> Prefill:
        """A turn's `total` new tokens (its question the last `question_tokens`) are about to be read; the
        cache may hold `headroom` entries meanwhile (None: no limit). Reserves room.

        When the turn fits its headroom, nothing is compacted until the question has been read, so a policy
        that waits for the question (CED) scores the document by the question's attention alone (window
        scores of the document's own chunks would dilute it). A turn larger than its headroom is compacted
        as it streams in; its question is known, so such a policy asks for a probe of the question (at the
        positions it will have) to score the document with, instead of each chunk's own last tokens."""
        s = self.settings
        self.uncount_cold()  # a turn that failed while replying did not reach finish_turn
        self.answer_limit = None
        self.question_tokens = question_tokens
        if question_tokens:
            self.exchange_from, self.question_at = self.question_at, self.seen + total - question_tokens
        self.recalled, self.recall_seconds = 0, 0.0  # this turn's (a turn without a question recalls nothing)
        streaming = headroom is not None and s.compressing and self.longest + total > headroom
        wants_probe = streaming and question_tokens > 0 and self.policy.waits_for_question
        room = self.longest + total + 1
        if question_tokens:
            room += self._recall_room(self.seen + total)  # what it may recall
        self.reserve(min(room, headroom) if streaming else room)
        return Prefill(total, question_tokens, headroom, streaming, wants_probe)

    def before_chunk(self, prefill: Prefill, size: int) -> None:
        """Make room for the next `size` tokens when they would pass the headroom (query-agnostic unless a
        probe of the question has scored the cache): down to a target between half the headroom and the
        budget, never below the budget floor."""
        headroom = prefill.headroom
        if headroom is None or not self.settings.compressing or self.longest + size <= headroom:
            return
        target = max(min(headroom - size, max(self.budget(self.seen), headroom // 2)), self.budget(0))
        if prefill.probe is not None:
            self.score_with_probe(prefill.probe)
        self.compact(target, threshold=False, when=PROBE if prefill.probe is not None else STREAM)
        prefill.compacted = True

    def chunk_window(self, prefill: Prefill, last: bool) -> int | None:
        """How many of a chunk's last queries score the cache: the question (at least `score_window` queries)
        for the last chunk; for the others none while a policy waits for the question (and no probe does
        the scoring), else the policy's stream window (None: every query)."""
        if last:
            return max(prefill.question_tokens, self.settings.score_window)
        if prefill.probe is not None:
            return 0
        if prefill.streaming or not self.policy.waits_for_question:
            return self.policy.stream_window
        return 0

    @property
    def answers_before_compacting(self) -> bool:
        """Whether a turn's question-aware compaction waits for the end of its reply (finish_turn): the reply
        attends to what its question's forward held (at most the prefill's headroom, so the turn's peak does
        not grow) and the compaction ranks by the question's and the reply's attention. With the cold tier
        on and CED (benchmarks/followups.py, 1k-token documents, 36 follow-ups: at ratios 0.3 / 0.2 / 0.1,
        28 / 26 / 23 right against 24 / 22 / 15 compacting before the reply; uncompressed 29; first questions
        12 / 12 / 12 against 11 / 10 / 7). The published baselines (H2O, SnapKV, ...) keep their own order."""
        return self.cold is not None and self.settings.compressing and self.policy.waits_for_question

    @property
    def readies_reply_first(self) -> bool:
        """Whether run_turn calls finish_prefill(answer_follows=True) before it shows the first reply token rather
        than after: in a follow-up that recalled, whose reply attends to a hot set compacted for it and counts the
        cold tier (44 ms at 7,429 tokens, benchmarks/recall_cost.py; per question whatever the reply's length). The
        same work in the same order either way; it counts in the follow-up's first-token latency instead of a pause
        before the second."""
        return self.answers_before_compacting and self.recalled > 0

    @torch.inference_mode()
    def finish_prefill(self, *, answer_follows: bool = False) -> None:
        """After a turn's question (or a re-read conversation's last one) has scored every entry: the
        question-aware compaction to the budget, spare room released, the CSA2 screening fitted. When a reply
        follows and the cache answers before compacting, the compaction waits for finish_turn."""
        if answer_follows and self.answers_before_compacting:
            if self.recalled and self.longest > self.budget() + REPLY_RECALLED:
                # a question that recalled: its reply keeps the budget plus the REPLY_RECALLED entries its question
                # needs most of all it read (its own tokens stay), the rest goes back cold before the reply's first
                # decode step (run_turn calls this once the first token, which the question's logits gave, is sampled)
                self.compact(self.budget() + REPLY_RECALLED, when=QUESTION,
                             recent=max(self.settings.ced_recent_tokens, self.question_tokens))
            if self.recalled and COUNT_COLD:
                self.count_cold()
            self.answer_limit = max(self.longest, self.budget())
        elif self.settings.compressing:
            self.compact(when=QUESTION)
            self.shrink(SPARE_TOKENS + self._recall_room())
        self.fit_sparse()

    @torch.inference_mode()
    def count_cold(self) -> None:
        """Before a follow-up's reply: every hot entry's logit gets log(1 + the cold entries it stands for)
        (counts.cold_counts), so the reply's attention gives the hot set about the share the whole conversation
        would have, instead of the recent turns taking what the cold entries would have drawn; the previous turn's
        question and answer (from exchange_from to this turn's question) get none. Measured in docs/design.md
        ("What the reply counts"). Undone by uncount_cold when the turn ends."""
        if self.cold is None or any(layer.merged_any for layer in self.layers):
            return  # merge counts of their own (a merge-mode cache): left as they are
        for layer, cold in zip(self.layers, self.cold, strict=True):
            if not layer.length or cold.length < COUNT_COLD_MIN:
                continue  # too few cold entries for their bucket sizes to say much (COUNT_COLD_MIN)
            planes = count_planes(self.head_dim, layer.device)  # built once per device (cached)
            n = layer.length
            layer.log_counts[:, :n] = cold_counts(layer, cold, planes)
            if self.exchange_from is not None and self.question_at is not None:
                # the previous question and its answer stand for nothing cold: counted for the cold entries like
                # them (another sentence about the same thing), they drew replies back to that answer
                at = layer.positions[:, :n]
                layer.log_counts[:, :n].masked_fill_((at >= self.exchange_from) & (at < self.question_at), 0.0)
            layer.merged_any = True
            self.counting = True

    @torch.inference_mode()
    def uncount_cold(self) -> None:
        """The hot set stands for itself again (after count_cold; a no-op otherwise)."""
        if not self.counting:
            return
        for layer in self.layers:
            layer.log_counts[:, : layer.length] = 0.0
            layer.merged_any = False
        self.counting = False

    def _recall_room(self, seen: int | None = None) -> int:
        """Entries per head the next question may recall (0 with the cold tier off or empty)."""
        if self.cold is None or not self.settings.compressing or not self.cold[0].length:
            return 0
        return min(self.cold[0].length, recall_size(self.budget(self.seen if seen is None else seen)))

    def _recall_layer(self, index: int, layer, question: torch.Tensor, scaling: float, *, share: bool = False):
        """Inside the forward that reads a turn's question, before layer `index` attends: the cold entries the
        question's queries [H, Tq, d] (the last Tq hot entries) would attend to most come back into the hot
        set, so this layer's attention, everything above it and the first reply token see them. The
        question-aware compaction after the forward keeps what the question needs most and sends the rest
        back. `share`: return the hot entries' logits the scoring computed (cold.recall_layer), else None."""
        started = time.perf_counter()
        fwd = self._fwd
        spans = SPAN_TOKENS if self.policy.waits_for_question else 0
        taken, shared = recall_layer(layer, self.cold[index], question, scaling, self.budget(self.seen + fwd.tokens),
                                     spans, share=share)
        if taken:
            if not fwd.recalled:
                self.compactions += 1  # the layout changed: a stopped turn can no longer be undone in place
            fwd.recalled[index] = taken
            self.recalled += taken
        self.recall_seconds += time.perf_counter() - started
        return shared

    def after_decode_step(self) -> int:
        """Every `compact_every` decode steps: fit CSA2 once a reply has grown a layer without a side cache past the
        point where it pays, and compact back to the budget (when any layer is past it). Returns entries dropped per
        head."""
        s = self.settings
        if (s.csa2_topk > 0 and self.decode_steps % s.compact_every == 0
                and any(layer.projected_keys is None and csa2.pays(layer.length, s) for layer in self.layers)):
            self.fit_sparse()
        if s.compressing and self.decode_steps and self.decode_steps % s.compact_every == 0:
            limit = self.budget() if self.answer_limit is None else max(self.answer_limit + REPLY_ROOM, self.budget())
            if self.longest > limit:
                return self.compact(limit)
        return 0

    def finish_turn(self) -> None:
        """The turn ends at the steady-state budget (a reply decoded before its question's compaction: that
        compaction now, ranked by the question's and the reply's attention)."""
        self.uncount_cold()
        if self.answer_limit is not None:
            self.answer_limit = None
            self.finish_prefill()
        elif self.settings.compressing and self.longest > self.budget():
            self.compact()
        self._size_buckets()

    def _size_buckets(self) -> None:
        """Between turns: the cold tier's bucket sizes (ColdLayer.buckets) built now where a follow-up's reply will
        count with them, instead of in the pause before that reply's second token (30-50 ms at 7.4k tokens, the
        first follow-up after a document was read)."""
        if self.cold is None or not COUNT_COLD:
            return
        for layer, cold in zip(self.layers, self.cold, strict=True):
            if layer.device.type == "cpu" and cold.length >= COUNT_COLD_MIN and cold.bucket_sizes is None:
                cold.buckets()  # kept only where they pay (ColdLayer.buckets_pay)

    def apply(self, settings: CacheSettings) -> str:
        """New knobs between turns. "compacted": applied to the live cache (tighter, or nothing to drop; with the
        cold tier on, what leaves the hot set goes cold); "recalled": looser, and the cold tier held what the hot
        set lacked, so it came back from there; "needs_rebuild": the settings are taken, but they keep more than
        the cache still holds (or change its stored format), so the caller re-reads the conversation
        (ChatSession.rebuild)."""
        self.uncount_cold()
        old, self.settings = self.settings, settings
        self.pinned = self._pins_that_fit()
        if old.needs_rebuild(settings):
            if self.cold is None or not old.only_budget_changed(settings):
                return "needs_rebuild"
            self._refill()  # the cold tier holds everything the hot set lost: nothing needs re-reading
            self.finish_prefill()
            self._size_buckets()
            return "recalled"
        self.finish_prefill()
        self._size_buckets()
        return "compacted"

    @torch.inference_mode()
    def _refill(self) -> None:
        """Every cold entry back into the hot set, with the score it left with (the compaction that follows
        keeps the best of them within the new budget and sends the rest back)."""
        for layer, cold in zip(self.layers, self.cold, strict=True):
            if cold.length:
                keys, values, positions, scores = cold.take(torch.arange(cold.length).expand(cold.kv_heads, -1))
                dev = layer.device
                layer.insert(keys.to(dev), values.to(dev), positions.to(dev), scores.to(dev))
        self.compactions += 1

    # ------------------------------------------------------------------ compaction
    @torch.inference_mode()
    def compact(self, target: int | None = None, *, threshold: bool = True, when: str = STREAM,
                recent: int | None = None) -> int:
        """Compact every layer down to `target` entries (default: the budget). Returns entries dropped per head.
        `when` tells the policy what has scored the entries (policies.STREAM / PROBE / QUESTION); `recent`: the
        last entries kept whatever their rank (default ced_recent_tokens)."""
        s = self.settings
        if not s.compressing:
            return 0
        target = self.budget() if target is None else target
        started = time.perf_counter()
        dropped = 0
        policy = self.policy
        # With the cold tier on, the hot set is the budget (the ratio the user chose): the threshold, which
        # drops entries below it, only applies when dropping saves memory for good (benchmarks/followups.py:
        # follow-ups at ratio 0.3, 11/18 without it against 7/18 with it, a one-off run of its cases).
        use_threshold = s.ced_threshold if threshold and policy.uses_attention and self.cold is None else 0.0
        ranks = [policy.rank(layer, when, self._torch_rng) for layer in self.layers]
        scores = [layer.scores[:, : layer.length] for layer in self.layers]
        for i, layer in enumerate(self.layers):
            pinned = self.pinned_mask(layer)
            if pinned is not None and pinned.any():  # kept first; counted as wanted by the threshold
                ranks[i] = ranks[i].masked_fill(pinned, float("inf"))
                scores[i] = scores[i].masked_fill(pinned, float(scores[i].amax()))
        plans = plan_compactions(ranks, target, sink=s.ced_sink_tokens,
                                 recent=s.ced_recent_tokens if recent is None else recent, threshold=use_threshold,
                                 scores=scores, floor=s.min_entries)
        for index, (layer, plan) in enumerate(zip(self.layers, plans, strict=True)):
            if plan is None:
                continue
            if self.cold is not None:  # tiered: nothing is folded away, the dropped entries go cold
                self.cold[index].add(layer, plan.drop)
            elif s.ced_mode == "merge":
                merge_into_kept(layer, plan)
            layer.keep(plan.keep)
            dropped = max(dropped, plan.drop.shape[1])
        if dropped:
            self.compactions += 1
        self.compaction_seconds += time.perf_counter() - started
        return dropped

    # ------------------------------------------------------------------ pins
    def pinned_mask(self, layer) -> torch.Tensor | None:
        """[h, n]: True where a hot entry's position lies in a pinned range (None without pins)."""
        if not self.pinned:
            return None
        at = layer.positions[:, : layer.length]
        mask = torch.zeros(at.shape, dtype=torch.bool, device=at.device)
        for start, end in self.pinned:
            mask |= (at >= start) & (at < end)
        return mask

    def pin_room(self, seen: int | None = None) -> int:
        """Tokens that may be pinned: half of what the budget keeps besides the sinks and the recent window (the
        rest stays for what each question needs); `seen`: once that many tokens are read (default: now)."""
        s = self.settings
        seen = self.seen if seen is None else seen
        if not s.compressing:
            return seen
        return max((self.budget(seen) - s.ced_sink_tokens - s.ced_recent_tokens) // 2, 0)

    @torch.inference_mode()
    def pin(self, ranges) -> None:
        """Keep the entries at the positions in `ranges` ((start, end) half-open; () unpins) hot in every layer and
        head whatever their rank, within pin_room. With the cold tier on, the pinned entries that had gone cold come
        back now (every cold entry is taken back and the compaction keeps the pinned and the best of the rest); with
        it off, what compaction already dropped stays dropped."""
        ranges = tuple(dict.fromkeys((int(a), int(b)) for a, b in ranges if int(b) > int(a)))  # in the order given
        covered = self._covered(ranges)
        if self.settings.compressing and len(covered) > self.pin_room():
            raise PinError(f"{len(covered):,} tokens to keep hot, the cache has room for {self.pin_room():,} at cache "
                           f"ratio {self.settings.kv_cache_ratio:.2f} (half its hot set past the first and the recent "
                           "tokens): keep a shorter part hot, or raise the cache ratio.")
        self.pinned = ranges
        if (ranges and self.settings.compressing and self.cold is not None and self.cold[0].length
                and not self._pins_hot(len(covered))):
            self._refill()
            self.finish_prefill()
            self._size_buckets()

    def _covered(self, ranges) -> set[int]:
        covered = set()
        for start, end in ranges:
            covered.update(range(max(start, 0), min(end, self.seen)))
        return covered

    def _pins_that_fit(self) -> tuple[tuple[int, int], ...]:
        """The pinned ranges, in the order pinned, as many as pin_room holds (a tighter ratio has less room: the later
        pins stop being kept hot; ChatSession.set_pins refuses them again until the ratio is raised)."""
        kept: list[tuple[int, int]] = []
        for pinned in self.pinned:
            if self.settings.compressing and len(self._covered([*kept, pinned])) > self.pin_room():
                break
            kept.append(pinned)
        return tuple(kept)

    def _pins_hot(self, covered: int) -> bool:
        """Whether every head of every layer holds all `covered` pinned positions hot."""
        return all(bool((self.pinned_mask(layer).sum(dim=1) >= covered).all()) for layer in self.layers)

    @torch.inference_mode()
    def reserve(self, entries: int) -> None:
        """Make room for `entries` stored entries per layer at once (a turn whose size is known), instead
        of growing block by block while it streams in."""
        for layer in self.layers:
            if entries > layer.capacity:
                layer.resize(entries)

    @torch.inference_mode()
    def shrink(self, spare_tokens: int = SPARE_TOKENS) -> None:
        for layer in self.layers:
            layer.shrink_to_fit(spare_tokens)

    # ------------------------------------------------------------------ reporting
    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def uncompressed_bytes(self, seen: int | None = None) -> int:
        seen = self.seen if seen is None else seen
        return seen * self.num_layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes_per_element

    def stored_kv_bytes(self) -> int:
        """Bytes held by stored (hot) entries (incl. side caches), without spare capacity."""
        return sum(layer.used_bytes() for layer in self.layers)

    def cold_bytes(self, where: str | None = None) -> int:
        """Bytes the cold tier holds (0 when it is off); `where` = "ram" or "disk" counts only what is there (the
        entries of a layer on disk are there, its kept bucket sizes in RAM)."""
        if where is None:
            return sum(cold.nbytes() for cold in self.cold or ())
        disk = sum(cold.nbytes() - cold.sizes_bytes() for cold in self.cold or () if cold.on_disk)
        return disk if where == "disk" else self.cold_bytes() - disk

    def _spill(self, extra_bytes: int) -> Path | None:
        """Where a cold layer's next allocation of `extra_bytes` goes: a file (cold_tier 'disk', or 'ram' past
        its cap, cold_tier_ram_mb) or RAM (None)."""
        s = self.settings
        in_ram = sum(cold.reserved_bytes() if not cold.on_disk else cold.sizes_bytes() for cold in self.cold or ())
        if s.cold_tier == "disk" or in_ram + extra_bytes > s.cold_tier_ram_mb * 2**20:
            return cold_dir()
        return None

    def ratio_reason(self, byte_ratio: float) -> str:
        """Why `byte_ratio` (stored over uncompressed bytes) is not kv_cache_ratio, in words (budget.explain_ratio)."""
        return explain_ratio(seen=self.seen, stored=self.stored, byte_ratio=byte_ratio, settings=self.settings,
                             threshold_applies=self.cold is None and self.policy.uses_attention)

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.kv_bytes_per_element,
                                  self.settings.kv_int8)

    def stats(self) -> CacheStats:
        recall = sum(self._recall) / len(self._recall) if self._recall else None
        return CacheStats(self.seen, [layer.length for layer in self.layers],
                          [layer.merged_tokens for layer in self.layers], self.stored_kv_bytes(),
                          self.uncompressed_bytes(), self.compactions, self.compaction_seconds, recall,
                          self._csa2_steps, self.budget())
