"""Plain data passed between the GUI thread and the engine worker (no Qt; only torch-free engine types).

The GUI never holds engine objects it did not receive on a signal; the worker turns these into engine
calls on its own thread.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

# Token counts for the context bar: the engine's own type (engine.events is torch-free).
from engine.events import ContextUsage as ContextFigures  # noqa: F401 - re-exported for the GUI


@dataclass(frozen=True)
class AttachedDocument:
    """A parsed file ready to be attached to a turn (mirrors engine.documents.Document, plus a key)."""

    key: str  # unique per attachment in this app run; token counts come back under it
    name: str
    path: str
    kind: str
    text: str
    pages: int | None
    chars: int
    notes: tuple[str, ...] = ()  # from the reader: bytes replaced, the encoding guessed

    @property
    def estimated_tokens(self) -> int:
        return max(self.chars // 4, 1)


@dataclass(frozen=True)
class HistoryTurn:
    """One exchange of a conversation as the chat shows it, as the engine should read it again (reply "": a
    question shown without a reply, read without one)."""

    prompt: str
    documents: tuple[AttachedDocument, ...]
    reply: str
    model_content: str | None = None  # the user message exactly as the engine stored it, when known


@dataclass(frozen=True)
class GenerationOptions:
    """The reply's sampling options (the engine's GenerationSettings validates them; the defaults are its own)."""

    max_new_tokens: int = 512
    temperature: float = 0.7
    greedy: bool = False
    seed: int | None = None
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1

    @classmethod
    def from_dict(cls, stored) -> GenerationOptions:
        """From saved settings (possibly stale or hand-edited): known fields of the right kind, defaults for
        the rest; values the engine would refuse go back to the default too."""
        from engine.config import GenerationSettings
        from engine.errors import ConfigError

        if not isinstance(stored, dict):
            return cls()
        options = cls()
        for name in cls.__dataclass_fields__:
            if name not in stored:
                continue
            try:
                candidate = dataclasses.replace(options, **{name: stored[name]})
                GenerationSettings(**dataclasses.asdict(candidate))
            except (TypeError, ValueError, ConfigError):
                continue
            options = candidate
        return options


@dataclass
class TurnRequest:
    turn_id: int
    conversation_id: int
    history: tuple[HistoryTurn, ...]
    prompt: str
    documents: tuple[AttachedDocument, ...]
    generation: GenerationOptions
    cancel: threading.Event = field(default_factory=threading.Event)
    system_prompt: str = ""  # the chat's ('' for none)
    pins: tuple[str, ...] = ()  # the pieces of its documents the chat keeps hot (engine ChatSession.set_pins)


@dataclass(frozen=True)
class TurnOutcome:
    """How a turn ended. Always sent exactly once per TurnRequest."""

    turn_id: int
    reason: str  # engine Done.reason, or "refused" when the turn never started
    text: str
    stats: object | None = None  # engine TurnStats
    error: str | None = None
    error_kind: str | None = None  # "oom" | "error" | "overflow" | "document" | "busy" | "no_model"
    model_content: str | None = None
    overflow: dict | None = None  # {"needed", "limit", "parts"} for a context overflow


@dataclass(frozen=True)
class UsageRequest:
    conversation_id: int | None
    history: tuple[HistoryTurn, ...]
    prompt: str
    documents: tuple[AttachedDocument, ...]
    knobs: dict = field(default_factory=dict)  # the knob panel's values: the KV figures are worked out at them
    system_prompt: str = ""  # the chat's ('' for none)


@dataclass(frozen=True)
class HeatRequest:
    """Which parts of a sent document the chat's cache holds hot (the document text window asks)."""

    request_id: int
    conversation_id: int
    text: str


@dataclass(frozen=True)
class PinRequest:
    """The pieces of its documents a chat keeps hot from now on (all of them; () keeps none)."""

    request_id: int
    conversation_id: int
    pins: tuple[str, ...]


@dataclass(frozen=True)
class DocumentFigures:
    """One attached document as the engine counts and stores it, after the tokens that come before it (the
    system prompt, the history, the question and the documents attached before it)."""

    key: str  # AttachedDocument.key
    tokens: int
    kv_bytes: int  # this document's share of the KV cache once compacted to its budget (the floor included)
    kv_after: int  # the whole cache's KV bytes once it holds this document (for the free-memory check)
    kv_cache_ratio: float  # the ratio these were worked out at


@dataclass(frozen=True)
class ModelFacts:
    """What the GUI needs to know about the loaded model, refreshed after every reconfigure."""

    display_name: str
    source: str
    device: str
    dtype: str
    weight_quant: str
    attention_backend: str
    context_limit: int
    max_positions: int
    kv_bytes_per_token: int
    config: dict
    load_seconds: float = 0.0
    weight_storage: str = ""  # "bf16"/"int8": float32 compute on weights held so (engine.kernels)
    prefill_bf16: bool = False  # prefill multiplies those weights in bf16 (engine.models.adapter.set_prefill_bf16)
    attention_kernels: str = ""  # the kernel each attention call runs ("prefill flash · decode fused C step ...")
    remote: str = ""  # "" in this process; "dsv41": our server (knobs sent with requests); "openai": another server
