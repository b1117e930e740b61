"""Where the engine keeps files of its own: converted models, compiled kernels and saved conversation caches
(the user cache folder).

A module of its own so that everything below the loader (kernels, models) can find the folder without
importing the loader.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """DSV41_CACHE_DIR, else the platform's per-user cache folder for the app."""
    override = os.environ.get("DSV41_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("ds-v41-chat", appauthor=False))


def conversations_dir() -> Path:
    """DSV41_CONVERSATIONS_DIR, else `conversations` in the user cache folder (engine.conversation_store)."""
    override = os.environ.get("DSV41_CONVERSATIONS_DIR")
    return Path(override) if override else user_cache_dir() / "conversations"


def cold_dir() -> Path:
    """DSV41_COLD_DIR, else `cold-tier` in the user cache folder: where a cold tier past its RAM cap (or
    cold_tier 'disk') maps its files (engine.cache.cold; unlinked at once, they vanish with the process)."""
    override = os.environ.get("DSV41_COLD_DIR")
    return Path(override) if override else user_cache_dir() / "cold-tier"
