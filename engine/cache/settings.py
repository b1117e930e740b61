"""CacheSettings: the knobs one cache reads, generated from the registry's cache knobs (engine.config.KNOBS)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import KNOBS, KNOBS_LIST, LIVE


class _SettingsMethods:
    def __post_init__(self) -> None:
        for name in CACHE_FIELDS:
            KNOBS[name].validate(getattr(self, name))

    @classmethod
    def from_config(cls, config) -> CacheSettings:
        return cls(**{name: getattr(config, name) for name in CACHE_FIELDS})

    @property
    def compressing(self) -> bool:
        return self.kv_cache_ratio < 1.0

    @property
    def kv_int8(self) -> bool:
        return self.kv_cache_dtype == "int8"

    def needs_rebuild(self, new: CacheSettings) -> bool:
        """Whether going from these settings to `new` needs the conversation re-read: a knob that changes the
        stored format, or one moved in the direction that keeps more than the cache still holds."""
        return any(KNOBS[name].is_looser(getattr(self, name), getattr(new, name)) for name in CACHE_FIELDS)

    def only_budget_changed(self, new: CacheSettings) -> bool:
        """Whether `new` differs only in how much of what was read stays hot (knobs that move up or down the
        budget, the threshold or the protected windows), besides knobs that apply live."""
        return all(getattr(self, name) == getattr(new, name) for name in CACHE_FIELDS
                   if KNOBS[name].applies != LIVE and KNOBS[name].looser not in ("up", "down"))

    def replace(self, **changes) -> CacheSettings:
        return dataclasses.replace(self, **changes)


CACHE_FIELDS = tuple(k.name for k in KNOBS_LIST if k.cache)
CacheSettings = dataclasses.make_dataclass(
    "CacheSettings", [(k.name, Any, dataclasses.field(default=k.default)) for k in KNOBS_LIST if k.cache],
    bases=(_SettingsMethods,))
CacheSettings.__module__ = __name__
CacheSettings.__doc__ = "The cache knobs of one chat session's cache (validated like DSV41Config)."
