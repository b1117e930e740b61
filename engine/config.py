"""DSV41Config: every knob of the engine, validated once at the edge.

The meaning of each knob is fixed in DESIGN.md ("Semantics of the knobs"). Cache knobs
(CED, CSA2, KV dtype, headroom) can change between turns through `DSV41Model.reconfigure`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import ConfigError

WEIGHT_QUANTS = ("none", "int8", "int4")
KV_DTYPES = ("auto", "int8")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CED_MODES = ("merge", "evict")
# Knobs that only change the cache; they may be changed between turns without reloading weights.
CACHE_KNOBS = frozenset(
    {
        "kv_cache_ratio", "ced_decay", "ced_threshold", "ced_mode", "ced_sink_tokens", "ced_recent_tokens",
        "csa2_topk", "csa2_rank", "kv_cache_dtype", "prefill_chunk", "prefill_headroom", "ced_policy",
    }
)
# Baseline policies live in the same code so the benchmark compares them at equal budgets.
CED_POLICIES = ("ced", "h2o", "snapkv", "streaming", "random")


@dataclass
class DSV41Config:
    model_path: str = "default"
    max_seq_len: int = 8192
    kv_cache_ratio: float = 0.5
    # 0.995 and a 32-token recent window (DESIGN: 0.99 and 64): perplexity at ratio 0.5 over four speeches
    # +1.38 -> +1.12 % on average, +2.49 -> +1.53 % on the hardest (results/quality; see README). Shipping a
    # 32-token window needed a budget floor of its own (ced.MIN_STORED_ENTRIES), so short chats stay whole.
    ced_decay: float = 0.995
    ced_threshold: float = 0.1
    # "evict" ships: with the question-aware layout it kept planted facts at every ratio where "merge"
    # lost them (results/quality); "merge" stays available (DESIGN.md: the benchmark decides).
    ced_mode: str = "evict"
    ced_sink_tokens: int = 4
    ced_recent_tokens: int = 32
    csa2_topk: int = 256
    csa2_rank: int | None = None
    use_flash_attention: bool = True
    weight_quant: str = "none"
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    device_map: str = "auto"
    kv_cache_shard: bool = False
    prefill_chunk: int | None = None
    prefill_headroom: int | float | None = None
    # Not in the seed; safety switches the user must turn on explicitly.
    trust_remote_code: bool = False
    allow_pickled_weights: bool = False
    # Let tokens seen pass the model's trained positions (max_seq_len then is the only limit). With a
    # compressing cache the stored entries stay few, but RoPE positions past training degrade quality.
    allow_position_extrapolation: bool = False
    # Which scoring policy compacts the cache: "ced" is the product; the others are baselines.
    ced_policy: str = "ced"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_type(self, "model_path", str)
        if not self.model_path.strip():
            raise ConfigError("model_path", self.model_path, "'default', a model folder, a .gguf file or a hub id "
                              "(an empty path would mean the current folder)")
        _int_range(self, "max_seq_len", 16, 1 << 20)
        _float_range(self, "kv_cache_ratio", 0.01, 1.0)
        _float_range(self, "ced_decay", 0.5, 1.0)
        _float_range(self, "ced_threshold", 0.0, 1.0)
        _choice(self, "ced_mode", CED_MODES)
        _int_range(self, "ced_sink_tokens", 0, 1024)
        _int_range(self, "ced_recent_tokens", 0, 8192)
        _int_range(self, "csa2_topk", 0, 65536)
        if self.csa2_rank is not None:
            _int_range(self, "csa2_rank", 1, 1024)
        _check_type(self, "use_flash_attention", bool)
        _choice(self, "weight_quant", WEIGHT_QUANTS)
        _choice(self, "kv_cache_dtype", KV_DTYPES)
        _choice(self, "dtype", DTYPES)
        _check_type(self, "device_map", str)
        if self.device_map not in ("auto", "cpu", "cuda") and not self.device_map.startswith("cuda:"):
            raise ConfigError("device_map", self.device_map, "one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        _check_type(self, "kv_cache_shard", bool)
        if self.prefill_chunk is not None:
            _int_range(self, "prefill_chunk", 16, 65536)
        if self.prefill_headroom is not None:
            value = self.prefill_headroom
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    "prefill_headroom", value, "None (auto), a token count (int > 0) or a size in GB (float > 0)"
                )
        _check_type(self, "trust_remote_code", bool)
        _check_type(self, "allow_pickled_weights", bool)
        _check_type(self, "allow_position_extrapolation", bool)
        _choice(self, "ced_policy", CED_POLICIES)

    def replace(self, **changes) -> DSV41Config:
        """A validated copy with `changes` applied (unknown names raise ConfigError)."""
        names = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in names:
                raise ConfigError(key, changes[key], f"a DSV41Config field ({', '.join(sorted(names))})")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_type(cfg, name, kind):
    value = getattr(cfg, name)
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(name, value, f"of type {kind.__name__}")


def _int_range(cfg, name, lo, hi):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(name, value, f"an integer in [{lo}, {hi}]")


def _float_range(cfg, name, lo, hi):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise ConfigError(name, value, f"a number in [{lo}, {hi}]")


def _choice(cfg, name, choices):
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, value, "one of " + ", ".join(repr(c) for c in choices))


MAX_SEED = 2**64 - 1  # the range torch.Generator.manual_seed takes


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1
    seed: int | None = None
    greedy: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens

    def __post_init__(self):
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens <= 1 << 20,
             "an integer in [1, 1048576]"),
            ("temperature", isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 5, "in [0, 5]"),
            ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("repetition_penalty", isinstance(self.repetition_penalty, (int, float)) and 1 <= self.repetition_penalty <= 3,
             "in [1, 3]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                           and 0 <= self.seed <= MAX_SEED),
             f"None (random) or an integer in [0, {MAX_SEED}]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, getattr(self, name), allowed)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0
