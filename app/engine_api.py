"""What the GUI's worker uses of the engine, as Protocols over the engine's own types.

app.worker is written against EngineModel and EngineSession, so the real DSV41Model / ChatSession and the
tests' fakes (tests/app/gui_fakes.py) are held to one surface; tests/app/test_engine_api.py checks that both
provide every member. Importing this module loads no torch (the GUI thread imports it through app.worker):
the engine types that need torch are named for type checkers only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.config import DSV41Config
from engine.documents import Document
from engine.events import ContextUsage, Event, PrefillProgress
from engine.heat import DocumentHeat
from engine.memory import MemoryReport

if TYPE_CHECKING:
    from engine.cache import DSV41Cache
    from engine.info import LoadInfo, ReconfigureResult


@runtime_checkable
class EngineSession(Protocol):
    """One conversation (engine.session.ChatSession)."""

    # The transcript the session feeds (system, user, assistant). The worker sets it to the stored history;
    # the session notices when it no longer extends what its cache holds and re-reads it.
    messages: list[dict]
    cache: DSV41Cache  # only handed back to EngineModel.memory_report
    pins: list[str]  # the pieces of its documents kept hot; the worker sets them from the stored chat before a turn

    def send(self, prompt: str, documents: Sequence[str | Document] = (), *,
             cancel: threading.Event | None = None, **settings: Any) -> Iterator[Event]:
        """Stream one turn; errors in the inputs raise before the first event."""
        ...

    def forget_saved(self) -> int:
        """Remove the conversation's saved caches from disk (its chat was deleted)."""
        ...

    def set_system_prompt(self, system_prompt: str | None) -> None:
        """The chat's system prompt changed: the next turn reads the conversation again under it."""
        ...

    def set_pins(self, texts: Sequence[str]) -> tuple[str, ...]:
        """Keep these pieces of its documents hot now and after every turn; the pieces not found (EngineError when
        the cache has no room for them)."""
        ...

    def document_heat(self, text: str) -> DocumentHeat | None:
        """Which parts of a document the chat has read its cache holds hot now; None where it cannot say."""
        ...


@runtime_checkable
class EngineModel(Protocol):
    """A loaded model (engine.model.DSV41Model): exactly what app.worker calls."""

    config: DSV41Config
    info: LoadInfo

    @property
    def context_limit(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

    def kv_bytes_per_token(self) -> int: ...

    def chat_session(self, system_prompt: str | None = None) -> EngineSession: ...

    def memory_report(self, cache: DSV41Cache | None = None, *, last_chat: bool = True) -> MemoryReport:
        """The figures with `cache`'s KV; with none, the last chat's (`last_chat`) or no chat's."""
        ...

    def reconfigure(self, session: EngineSession | None = None,
                    progress: Callable[[PrefillProgress], None] | None = None,
                    **knobs: Any) -> ReconfigureResult: ...

    def document_tokens(self, document: Document) -> int: ...

    def context_usage(self, session: EngineSession | None, history: list[dict], prompt: str = "",
                      documents: Sequence[Document] = (), system_prompt: str | None = None) -> ContextUsage: ...

    def stored_kv_bytes(self, tokens_seen: int, **knobs: Any) -> int: ...

