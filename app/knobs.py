"""The cache knobs the GUI exposes, their slider ranges and the presets (data only, no Qt)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DSV41Config


@dataclass(frozen=True)
class SliderKnob:
    name: str  # DSV41Config field
    label: str
    minimum: float
    maximum: float
    step: float
    decimals: int
    tip: str

    @property
    def ticks(self) -> int:
        return round((self.maximum - self.minimum) / self.step)

    def to_tick(self, value: float) -> int:
        return round((min(max(value, self.minimum), self.maximum) - self.minimum) / self.step)

    def from_tick(self, tick: int) -> float | int:
        value = self.minimum + tick * self.step
        return int(round(value)) if self.decimals == 0 else round(value, self.decimals)


SLIDERS = (
    SliderKnob("kv_cache_ratio", "Cache ratio", 0.1, 1.0, 0.05, 2,
               "Share of the tokens seen that the KV cache keeps. 1.0 = a plain cache (no compression)."),
    SliderKnob("ced_decay", "CED decay", 0.90, 0.999, 0.001, 3,
               "How slowly old attention fades from an entry's score. Higher remembers a long document longer."),
    SliderKnob("ced_threshold", "CED threshold", 0.0, 0.5, 0.01, 2,
               "Entries scoring below this × the mean are compressed even under budget. 0 turns it off."),
    SliderKnob("csa2_topk", "CSA2 top-k", 0, 1024, 16, 0,
               "Stored entries each decode step attends to exactly (plus sinks and the recent window). 0 = dense."),
)

CED_MODES = (("merge", "Merge"), ("evict", "Evict"))
CED_MODE_TIP = "Merge folds each dropped entry into a kept one (it stands for their mass); Evict drops it."
KV_DTYPES = (("auto", "Auto (bf16 or model dtype)"), ("int8", "INT8"))
KV_DTYPE_TIP = "INT8 stores keys and values in 8 bits with per-token scales: half of bf16, a quarter of fp32."
HEADROOM_STEPS = (None, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # None = auto (what free memory allows)

_ENGINE_DEFAULTS = DSV41Config()  # the engine decides the defaults (torch-free import)
DEFAULTS = {
    name: getattr(_ENGINE_DEFAULTS, name)
    for name in ("kv_cache_ratio", "ced_decay", "ced_threshold", "csa2_topk", "ced_mode", "kv_cache_dtype",
                 "prefill_headroom")
}
KNOB_NAMES = tuple(DEFAULTS)

PRESETS: dict[str, dict] = {
    "Chat": dict(DEFAULTS),
    "Long document": {**DEFAULTS, "ced_decay": 0.998, "kv_cache_ratio": 0.4, "csa2_topk": 512},
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
    """Keep only known knobs with values in range (settings files may be stale or hand-edited)."""
    out = dict(DEFAULTS)
    for spec in SLIDERS:
        value = knobs.get(spec.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[spec.name] = spec.from_tick(spec.to_tick(float(value)))
    if knobs.get("ced_mode") in dict(CED_MODES):
        out["ced_mode"] = knobs["ced_mode"]
    if knobs.get("kv_cache_dtype") in dict(KV_DTYPES):
        out["kv_cache_dtype"] = knobs["kv_cache_dtype"]
    if "prefill_headroom" in knobs and knobs["prefill_headroom"] in HEADROOM_STEPS:
        out["prefill_headroom"] = knobs["prefill_headroom"]
    return out
