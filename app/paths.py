"""Where the app keeps its data (SQLite, settings) and finds its resources."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "ds-v41-chat"
DATA_DIR_ENV = "DSV41_DATA_DIR"  # tests and portable installs point this at their own folder


def data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        path = Path(override)
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only or full: the store says so (ConversationStore.read_only) and the app goes on
        pass
    return path


def database_path() -> Path:
    return data_dir() / "conversations.sqlite3"


def settings_path() -> Path:
    return data_dir() / "settings.ini"


def resources_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources"


def resource(name: str) -> Path | None:
    path = resources_dir() / name
    return path if path.exists() else None
