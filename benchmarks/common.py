"""Shared benchmark plumbing: machine facts and result files (the speed benchmark is `python -m engine bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.bench.core import machine as _machine

RESULTS = Path(__file__).resolve().parent.parent / "results"


def machine() -> dict:
    return _machine(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def write_results(name: str, payload: dict, table_md: str) -> Path:
    folder = RESULTS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    (folder / f"{name}.md").write_text(table_md)
    return folder
