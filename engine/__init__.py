"""DS-V4.1 engine: Flash attention, a compressing KV cache (CED + CSA2) and INT8/INT4 weights on transformers.

Headless: never imports Qt. The engine knows token ids; text comes in through the chat template and
goes out through the incremental detokenizer.
"""

import os

# OpenMP threads that spin while waiting make torch 2-3x slower on a desktop where anything else
# runs (measured: 6.5 -> 14 tok/s on 2 cores with one other busy process). Must be set before torch
# loads; the engine never imports torch at package import, so this takes effect for the app and CLI.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
