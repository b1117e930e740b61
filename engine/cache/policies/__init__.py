"""Compression policies, one per file; `POLICIES` is the registry the `ced_policy` knob chooses from.

"ced" is the product; the others are baselines the quality benchmark compares at equal budgets.
"""

from __future__ import annotations

from .base import PROBE, QUESTION, STREAM, Policy
from .ced import CED
from .h2o import H2O
from .random import Random
from .snapkv import SnapKV
from .streaming import Streaming

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (CED, H2O, SnapKV, Streaming, Random)}


def make(settings) -> Policy:
    """The policy `settings.ced_policy` names, reading its parameters from `settings`."""
    return POLICIES[settings.ced_policy](settings)


__all__ = ["POLICIES", "PROBE", "QUESTION", "STREAM", "Policy", "make"]
