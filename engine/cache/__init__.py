"""The DS-V4.1 cache: block storage, CED compaction, CSA2 screening and the transformers adapter."""

from .kv_cache import CacheSettings, CacheStats, DSV41Cache

__all__ = ["CacheSettings", "CacheStats", "DSV41Cache"]
