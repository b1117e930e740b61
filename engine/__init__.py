"""DS-V4.1 engine: Flash attention, a compressing KV cache (CED + CSA2) and INT8/INT4 weights on transformers.

Headless: never imports Qt. The engine knows token ids; text comes in through the chat template and
goes out through the incremental detokenizer.
"""

from .config import DSV41Config
from .errors import BusyError, ConfigError, ContextOverflowError, EngineError, ModelLoadError
from .events import Done, ErrorEvent, PrefillProgress, TokenText, TurnStats
from .memory import MemoryReport
from .sampling import GenerationSettings

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
