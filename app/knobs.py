"""The cache knobs the GUI exposes, from the engine's registry (engine.config.KNOBS), and the presets.

Ranges, steps, labels, tips, choices and defaults are the registry's: a knob with a `slider` there gets a
slider here. What stays here is the GUI's own: the words a choice is shown with, the headroom steps of its
combo box, and the presets. Data only, no Qt; engine.config is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import KNOBS, USER_DEFAULTS, Knob
from engine.errors import ConfigError


@dataclass(frozen=True)
class SliderKnob:
    name: str  # DSV41Config field
    label: str
    minimum: float
    maximum: float
    step: float
    decimals: int
    tip: str

    @classmethod
    def of(cls, knob: Knob) -> SliderKnob:
        slider = knob.slider
        return cls(knob.name, knob.label, slider.minimum, slider.maximum, slider.step, slider.decimals, knob.help)

    @property
    def ticks(self) -> int:
        return round((self.maximum - self.minimum) / self.step)

    def to_tick(self, value: float) -> int:
        return round((min(max(value, self.minimum), self.maximum) - self.minimum) / self.step)

    def from_tick(self, tick: int) -> float | int:
        value = self.minimum + tick * self.step
        return int(round(value)) if self.decimals == 0 else round(value, self.decimals)

    def snap(self, value: float) -> float | int:
        """The slider's value nearest to `value` (within the part of the range the slider covers)."""
        return self.from_tick(self.to_tick(value))


# Knobs changeable between turns whose registry entry has a slider, in the registry's order.
SLIDERS = tuple(SliderKnob.of(knob) for knob in KNOBS.values() if knob.slider is not None and knob.cache)
SLIDER = {spec.name: spec for spec in SLIDERS}

# How a choice is shown; the values themselves are the registry's (a value missing here is shown as is).
CHOICE_LABELS = {
    "ced_mode": {"merge": "Merge", "evict": "Evict"},
    "kv_cache_dtype": {"auto": "Auto (bf16 or model dtype)", "int8": "INT8"},
    "cold_tier": {"off": "Off (compaction discards)", "ram": "RAM (later questions recall)",
                  "disk": "Disk (later questions recall; least RAM)"},
}


def choices(name: str) -> tuple[tuple[str, str], ...]:
    """(value, label) for each value the registry allows for the choice knob `name`."""
    labels = CHOICE_LABELS.get(name, {})
    return tuple((value, labels.get(value, value)) for value in KNOBS[name].kind)


CED_MODES = choices("ced_mode")
CED_MODE_LABEL, CED_MODE_TIP = KNOBS["ced_mode"].label, KNOBS["ced_mode"].help
KV_DTYPES = choices("kv_cache_dtype")
KV_DTYPE_LABEL, KV_DTYPE_TIP = KNOBS["kv_cache_dtype"].label, KNOBS["kv_cache_dtype"].help
COLD_TIERS = choices("cold_tier")
COLD_TIER_LABEL, COLD_TIER_TIP = KNOBS["cold_tier"].label, KNOBS["cold_tier"].help
HEADROOM_LABEL = KNOBS["prefill_headroom"].label
HEADROOM_STEPS = (None, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # None = auto (what free memory allows)

KNOB_NAMES = tuple(SLIDER) + ("ced_mode", "kv_cache_dtype", "cold_tier", "prefill_headroom")
# What the app starts with: the registry's defaults but for engine.config.USER_DEFAULTS (the cold tier on)
DEFAULTS = {name: USER_DEFAULTS.get(name, KNOBS[name].default) for name in KNOB_NAMES}

PRESETS: dict[str, dict] = {
    "Chat": dict(DEFAULTS),
    # follow-up questions about a document: the cold tier keeps what compaction takes out (benchmarks/followups.py)
    "Long document": {**DEFAULTS, "ced_decay": 0.998, "kv_cache_ratio": 0.4, "csa2_topk": 512, "cold_tier": "ram"},
    "Max quality": {**DEFAULTS, "kv_cache_ratio": 1.0, "ced_threshold": 0.0, "csa2_topk": 0,
                    "kv_cache_dtype": "auto"},
    "Min memory": {**DEFAULTS, "kv_cache_ratio": 0.2, "ced_threshold": 0.2, "csa2_topk": 128,
                   "kv_cache_dtype": "int8"},
}


def headroom_label(value) -> str:
    if value is None:
        return "Auto (free memory)"
    return f"{value:,} tokens"


def sanitize(knobs: dict) -> dict:
    """The GUI's knobs from `knobs` (a settings file may be stale or hand-edited): each value the registry
    accepts, a slider's snapped to its step, the default for anything missing or not allowed."""
    out = dict(DEFAULTS)
    for name in KNOB_NAMES:
        if name not in knobs:
            continue
        try:
            KNOBS[name].validate(knobs[name])
        except ConfigError:
            continue
        out[name] = knobs[name]
    for spec in SLIDERS:
        out[spec.name] = spec.snap(out[spec.name])
    headroom = out["prefill_headroom"]
    if headroom not in HEADROOM_STEPS or isinstance(headroom, float):  # the combo offers these token counts only
        out["prefill_headroom"] = DEFAULTS["prefill_headroom"]
    return out
