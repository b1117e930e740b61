"""DS-V4.1 engine: Flash attention, a compressing KV cache (CED + CSA2) and INT8/INT4 weights on transformers.

Headless: never imports Qt. The engine knows token ids; text comes in through the chat template and
goes out through the incremental detokenizer.
"""

import os

# How torch's OpenMP threads wait between ops (must be set before torch loads; the engine never imports
# torch at package import, so this takes effect for the app and the CLI). Measured on 2 cores, decode
# step of the default model at a 1k context: spinning briefly (GOMP_SPINCOUNT=30000) 38 ms idle but
# 177 ms when another process keeps a core busy; PASSIVE 56 ms idle, 66 ms busy; the OpenMP default
# (long spin) 40 ms idle, 270 ms busy. Default: the short spin (a workstation running the model is
# mostly idle otherwise); DSV41_CPU_WAIT=passive for a shared or busy machine.
if os.environ.get("DSV41_CPU_WAIT", "spin").lower() == "passive":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
elif "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

# MKL's CPU-specific code on AMD CPUs (must happen before torch loads as well): engine/mkl_dispatch.py
from . import mkl_dispatch as _mkl_dispatch  # noqa: E402

_mkl_dispatch.apply()

from .config import DSV41Config, GenerationSettings  # noqa: E402
from .errors import BusyError, ConfigError, ContextOverflowError, EngineError, ModelLoadError  # noqa: E402
from .events import Done, ErrorEvent, PrefillProgress, TokenText, TurnStats  # noqa: E402
from .memory import MemoryReport  # noqa: E402

__all__ = [
    "DSV41Config", "DSV41Model", "ChatSession", "GenerationSettings", "MemoryReport",
    "Done", "ErrorEvent", "PrefillProgress", "TokenText", "TurnStats",
    "EngineError", "ConfigError", "ModelLoadError", "ContextOverflowError", "BusyError",
]


def __getattr__(name):  # torch/transformers load only when the model classes are first used
    if name == "DSV41Model":
        from .model import DSV41Model

        return DSV41Model
    if name == "ChatSession":
        from .session import ChatSession

        return ChatSession
    raise AttributeError(name)
