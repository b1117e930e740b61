"""DSV41Config and KNOBS: every knob of the engine, declared once and validated at the edge.

`KNOBS` is the registry: name, type and range, default, label and help, and when a change takes effect. It
generates DSV41Config's fields and validation, the command-line flags (engine/cli.py), the GUI sliders' ranges
and labels (app/knobs.py) and the table in docs/knobs.md (tests/engine/test_config.py checks that table against
the registry). Adding a knob is one `Knob(...)` line here, plus the code that reads it.

When a change applies (`Knob.applies`):
    live     between turns, on the live cache; nothing is re-read
    cache    between turns: a tighter value compacts the live cache, a looser one (`looser`) re-reads the
             conversation with the new value, since what was dropped cannot come back
    rebuild  between turns, always by re-reading the conversation (the stored format changes)
    reload   only by loading the model again (DSV41Model.from_pretrained)
A change asked for during a reply waits for the end of that turn (DSV41Model.reconfigure).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

LIVE, CACHE, REBUILD, RELOAD = "live", "cache", "rebuild", "reload"


@dataclass(frozen=True)
class Slider:
    """The part of a knob's range the GUI's slider covers (the config accepts the whole range)."""

    minimum: float
    maximum: float
    step: float
    decimals: int


@dataclass(frozen=True)
class Knob:
    name: str
    default: Any
    kind: type | tuple[str, ...]  # bool, int, float, str, object (`check` decides) or the allowed values
    label: str
    help: str
    applies: str = RELOAD
    lo: float | None = None  # inclusive range of an int / float knob
    hi: float | None = None
    optional: bool = False  # None is allowed (and means what `help` says)
    looser: str | None = None  # "up", "down" or "change": the direction that keeps more (cache knobs)
    slider: Slider | None = None
    check: Callable[[Any], str | None] | None = None  # extra check: returns what is allowed when the value is not
    cli: bool = True  # a --flag of `python -m engine chat / generate / memory / serve`

    @property
    def cache(self) -> bool:
        """Changeable between turns without reloading the model."""
        return self.applies != RELOAD

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def allowed(self) -> str:
        """What a valid value is, in words (ConfigError's message)."""
        if isinstance(self.kind, tuple):
            text = "one of " + ", ".join(repr(c) for c in self.kind)
        elif self.kind is bool:
            text = "of type bool (True or False)"
        elif self.kind is int:
            text = f"an integer in [{self.lo}, {self.hi}]"
        elif self.kind is float:
            text = f"a number in [{self.lo}, {self.hi}]"
        elif self.kind is str:
            text = "of type str"
        else:
            text = self.check(None) if self.check else "a value"
        return f"None (auto) or {text}" if self.optional else text

    def validate(self, value: Any) -> None:
        if value is None and self.optional:
            return
        if not self._valid(value):
            raise ConfigError(self.name, value, self.allowed())
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise ConfigError(self.name, value, problem)

    def _valid(self, value: Any) -> bool:
        if isinstance(self.kind, tuple):
            return isinstance(value, str) and value in self.kind
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.kind is int:
            return isinstance(value, int) and self.lo <= value <= self.hi
        if self.kind is float:
            return isinstance(value, (int, float)) and math.isfinite(value) and self.lo <= value <= self.hi
        return isinstance(value, self.kind)

    def is_looser(self, old: Any, new: Any) -> bool:
        """Whether moving from `old` to `new` keeps more than the cache still holds (a re-read is needed)."""
        if old == new:
            return False
        if self.applies == REBUILD or self.looser == "change":
            return True
        if self.looser == "up":
            return (new is None) or (old is not None and new > old)
        if self.looser == "down":
            return old is not None and new is not None and new < old
        return False


def _model_path(value: str) -> str | None:
    if not value.strip():
        return "'default', a model folder, a .gguf file or a hub id (an empty path would mean the current folder)"
    return None


def _device_map(value: str) -> str | None:
    if value in ("auto", "cpu", "cuda") or value.startswith("cuda:"):
        return None
    return "one of 'auto', 'cpu', 'cuda', 'cuda:N'"


def _headroom(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or value > (1e6 if isinstance(value, float) else 2**40):
        return "None (auto), a token count (int, 1 to 2**40) or a size in GB (float > 0, at most 1e6)"
    return None


KNOBS_LIST: tuple[Knob, ...] = (
    # --------------------------------------------------------------- the model (a change reloads it)
    Knob("model_path", "default", str, "Model", "'default', a model folder, a .gguf file or a hub id",
         check=_model_path, cli=False),
    Knob("max_seq_len", 8192, int, "Context length", "tokens a conversation may hold (seen, not stored)",
         lo=16, hi=1 << 20),
    Knob("use_flash_attention", True, bool, "Flash attention", "fused attention kernels (SDPA / flash-attn); "
         "off: eager attention", cli=False),
    Knob("decode_graph", True, bool, "CUDA graph decode", "on a GPU, replay each decode step as one captured CUDA "
         "graph; off: the same step launched op by op", cli=False),
    Knob("weight_quant", "none", ("none", "int8", "int4"), "Weights", "weight format: as loaded, int8 or int4"),
    Knob("dtype", "auto", ("auto", "float32", "bfloat16", "float16"), "Compute dtype",
         "activations and KV cache dtype; auto: float32 on CPU, bf16 on GPU"),
    Knob("device_map", "auto", str, "Device", "'auto', 'cpu', 'cuda' or 'cuda:N'", check=_device_map),
    Knob("trust_remote_code", False, bool, "Trust remote code", "run a model folder's own Python code"),
    Knob("allow_pickled_weights", False, bool, "Allow pickled weights", "load .bin/.pt checkpoints, which can "
         "run code when unpickled", cli=False),
    Knob("allow_position_extrapolation", False, bool, "Allow position extrapolation",
         "let tokens seen pass the model's trained positions (quality degrades past them)", cli=False),
    # --------------------------------------------------------------- the cache (between turns)
    Knob("kv_cache_ratio", 0.5, float, "Cache ratio", "Share of the tokens seen that the KV cache keeps. 1.0 = a "
         "plain cache (no compression).", CACHE, 0.01, 1.0, looser="up",
         slider=Slider(0.01, 1.0, 0.01, 2)),
    # 0.995 and a 32-token recent window: perplexity at ratio 0.5 over four speeches +1.12 % on average,
    # +1.53 % on the hardest (0.99 and 64: +1.38 and +2.49 %; results/quality).
    Knob("ced_decay", 0.995, float, "CED decay", "How slowly old attention fades from an entry's score. "
         "Higher remembers a long document longer.", LIVE, 0.5, 1.0, slider=Slider(0.90, 0.999, 0.001, 3)),
    Knob("ced_threshold", 0.1, float, "CED threshold", "Entries scoring below this × the mean are compressed "
         "even under budget (not with the cold tier on: then the hot set is the ratio). 0 turns it off.", CACHE,
         0.0, 1.0, looser="down", slider=Slider(0.0, 0.5, 0.01, 2)),
    # "evict": with the question-aware layout it kept planted facts at every ratio where "merge" lost them
    # (results/quality).
    Knob("ced_mode", "evict", ("merge", "evict"), "CED mode", "Merge folds each dropped entry into a kept one "
         "(it stands for their mass); Evict drops it.", CACHE, looser="change"),
    Knob("ced_sink_tokens", 4, int, "Sink tokens", "first entries never compacted", CACHE, 0, 1024, looser="up"),
    Knob("ced_recent_tokens", 32, int, "Recent window", "last entries never compacted", CACHE, 0, 8192,
         looser="up"),
    Knob("ced_policy", "ced", ("ced", "h2o", "snapkv", "streaming", "random"), "Policy",
         "which scoring decides what is kept: 'ced' is the product, the others are baselines", CACHE,
         looser="change"),
    Knob("min_entries", 128, int, "Budget floor", "a cache this small is never compacted", CACHE, 0, 1 << 20,
         looser="up", cli=False),
    Knob("compact_every", 16, int, "Compact every", "decode steps between compactions of a growing reply", LIVE,
         1, 4096, cli=False),
    Knob("score_window", 32, int, "Score window", "SnapKV's observation window; the question tokens that "
         "score at least", LIVE, 1, 8192, cli=False),
    Knob("csa2_topk", 256, int, "CSA2 top-k", "Stored entries each decode step attends to exactly (plus sinks "
         "and the recent window). 0 = dense.", LIVE, 0, 65536, slider=Slider(0, 1024, 16, 0)),
    Knob("csa2_rank", None, int, "CSA2 rank", "screening rank; None: head_dim / 8", LIVE, 1, 1024, optional=True),
    Knob("cold_tier", "off", ("off", "ram", "disk"), "Cold tier", "where entries a compaction takes out of the hot "
         "set go: 'ram' keeps them for a later question to recall (spilling to a file past the RAM cap), 'disk' "
         "keeps them in a file from the start; 'off' discards them", REBUILD),
    Knob("cold_tier_ram_mb", 2048, int, "Cold tier RAM cap (MB)", "RAM the cold tier may take before what else "
         "leaves the hot set goes to a file in the user cache folder", LIVE, 0, 1 << 22),
    Knob("cold_tier_dtype", "int8", ("int8", "auto"), "Cold tier dtype", "how the cold tier stores keys and "
         "values: int8 with a scale per token and head, or 'auto' as the hot set stores them (lossless)", REBUILD),
    Knob("conversation_cache_mb", 2048, int, "Saved chat caches (MB)", "disk space for each chat's cache saved "
         "after every turn in the user cache folder: reopening, regenerating or editing a chat restores it instead "
         "of re-reading the conversation; least recently used removed first; 0 = off", LIVE, 0, 1 << 20),
    Knob("kv_cache_dtype", "auto", ("auto", "int8"), "KV dtype", "INT8 stores keys and values in 8 bits with "
         "per-token scales: half of bf16, a quarter of fp32.", REBUILD),
    Knob("prefill_chunk", None, int, "Prefill chunk", "tokens per prefill forward; None: by device", LIVE, 16,
         65536, optional=True),
    Knob("prefill_headroom", None, object, "Prefill headroom", "tokens a document turn may hold before "
         "compacting as it streams in (int), or a size in GB (float); None: from free memory", LIVE,
         optional=True, check=_headroom),
)
KNOBS: dict[str, Knob] = {k.name: k for k in KNOBS_LIST}
# What the app and the terminal chat start with where it differs from a knob's default (the knob's default stays
# the engine API's, the baseline the benchmarks compare against): compaction keeps what it takes out of the hot
# set in the cold tier, so follow-up questions about a document find it again (benchmarks/followups.py, 1k-token
# documents at ratio 0.5: 30 of 36 follow-ups against 14 discarding, uncompressed 29; README).
USER_DEFAULTS = {"cold_tier": "ram"}
CACHE_KNOBS = frozenset(name for name, k in KNOBS.items() if k.cache)


def knobs_table() -> str:
    """The registry as a Markdown table (docs/knobs.md holds it; tests/engine/test_config.py keeps them equal)."""
    rows = ["| knob | default | allowed | applies | CLI flag | meaning |", "|---|---|---|---|---|---|"]
    for k in KNOBS_LIST:
        allowed = k.allowed().replace("|", "\\|")
        flag = f"`{k.flag}`" if k.cli else {"model_path": "`--model`", "use_flash_attention": "`--no-flash`"}.get(k.name, "")
        rows.append(f"| `{k.name}` | `{k.default!r}` | {allowed} | {k.applies} | {flag} | {k.help} |")
    return "\n".join(rows) + "\n"


class _ConfigMethods:
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for knob in KNOBS_LIST:
            knob.validate(getattr(self, knob.name))

    def replace(self, **changes) -> DSV41Config:
        """A validated copy with `changes` applied (unknown names raise ConfigError)."""
        for key in changes:
            if key not in KNOBS:
                raise ConfigError(key, changes[key], f"a DSV41Config field ({', '.join(sorted(KNOBS))})")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DSV41Config = dataclasses.make_dataclass(
    "DSV41Config", [(k.name, Any, dataclasses.field(default=k.default)) for k in KNOBS_LIST],
    bases=(_ConfigMethods,))
DSV41Config.__module__ = __name__
DSV41Config.__doc__ = "Every knob of the engine (see KNOBS for each one's meaning and range); validated on creation."


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
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)  # True is not 1 token

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        checks = [
            ("max_new_tokens", integer(self.max_new_tokens) and 1 <= self.max_new_tokens <= 1 << 20,
             "an integer in [1, 1048576]"),
            ("temperature", number(self.temperature) and 0 <= self.temperature <= 5, "in [0, 5]"),
            ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", integer(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("repetition_penalty", number(self.repetition_penalty) and 1 <= self.repetition_penalty <= 3,
             "in [1, 3]"),
            ("seed", self.seed is None or (integer(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"None (random) or an integer in [0, {MAX_SEED}]"),
            ("greedy", isinstance(self.greedy, bool), "true or false"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("stop", isinstance(self.stop, (tuple, list)) and all(isinstance(x, str) for x in self.stop),
             "a list of strings"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, getattr(self, name), allowed)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0
