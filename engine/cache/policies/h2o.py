"""H2O (Heavy-Hitter Oracle) baseline: accumulated attention, no decay."""

from __future__ import annotations

from .base import Policy


class H2O(Policy):
    name = "h2o"
