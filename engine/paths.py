"""Where the engine keeps files of its own: converted models and compiled kernels (the user cache folder).

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
