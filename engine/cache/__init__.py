"""The DS-V4.1 cache: storage, the cache container (the turn's contract), budget and compaction plans, CED's
merge, CSA2 screening and the compression policies (one per file under policies/)."""

from .kv_cache import CacheStats, DSV41Cache, FusedPlan, Prefill
from .settings import CacheSettings

__all__ = ["CacheSettings", "CacheStats", "DSV41Cache", "FusedPlan", "Prefill"]
