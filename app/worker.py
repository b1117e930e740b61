"""The one thread that owns the engine: requests come in as queued signals, events go out as signals.

    client = EngineClient(model_factory)        # GUI thread; starts the worker thread
    client.load_model.emit({"model_path": "default", ...})
    client.send_turn(request)                   # request.cancel is set by client.stop() from the GUI thread

Everything that touches the model, the tokenizer or torch runs in EngineWorker's slots, on the worker
thread. A turn runs inside one slot, so requests queued meanwhile (reconfigure, memory, usage) wait
until the turn is over: that is what "applied between turns" means, and the GUI sends a knob change at
once even during a reply. Stop cannot wait in that queue, so it is a threading.Event the engine checks
before every prefill chunk and decode step.

The worker asks the engine for every figure it reports (token counts, the context bar, a document's KV
bytes) and lays out a user turn with the engine's own function; it is written against app.engine_api.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.config import CACHE_KNOBS
from engine.documents import Document, DocumentError, user_content
from engine.errors import BusyError, ConfigError, ContextOverflowError, EngineError, ModelLoadError
from engine.events import Done, ErrorEvent, PrefillProgress, TokenText, TurnStats
from engine.info import ReconfigureResult

from .engine_api import EngineModel, EngineSession
from .protocol import (
    AttachedDocument,
    ContextFigures,
    DocumentFigures,
    HeatRequest,
    HistoryTurn,
    ModelFacts,
    PinRequest,
    TurnOutcome,
    TurnRequest,
    UsageRequest,
)

log = logging.getLogger(__name__)

TOKEN_BATCH_S = 0.04  # coalesce streamed text for this long before painting it
PROGRESS_EVERY_S = 0.05
MEMORY_EVERY_S = 1.0  # memory reports during a turn (the GUI's own timer is blocked by the turn)
KEPT_SESSIONS = 2  # each session holds a preallocated KV cache; keep only the recent ones

ModelFactory = Callable[[dict, Callable[[str, float], None]], EngineModel]


def load_engine_model(options: dict, progress: Callable[[str, float], None]) -> EngineModel:
    """The real engine: DSV41Model.from_pretrained(DSV41Config(**options)), or, for a server address
    (http://… or https://…), the model that server serves (engine.remote; `api_key` from the options).
    Runs on the worker thread."""
    from engine.remote import RemoteModel, is_remote

    if is_remote(options.get("model_path")):
        from engine.config import CACHE_KNOBS

        return RemoteModel.connect(options["model_path"], options.get("api_key") or None,
                                   max_seq_len=int(options.get("max_seq_len") or 8192), progress=progress,
                                   knobs={k: v for k, v in options.items() if k in CACHE_KNOBS})
    from engine import DSV41Config, DSV41Model

    options = {k: v for k, v in options.items() if k != "api_key"}
    return DSV41Model.from_pretrained(DSV41Config(**options), progress=progress)


class EngineWorker(QObject):
    # ---- events out (all emitted on the worker thread; connections to the GUI are queued)
    load_progress = Signal(str, float)
    loaded = Signal(object)  # ModelFacts
    load_failed = Signal(str, str, object)  # message, reason, ModelFacts of the model still loaded (or None)
    prefill_progress = Signal(int, int, int)  # turn id, done, total
    tokens = Signal(int, str)  # turn id, text batch
    stats = Signal(int, object)  # turn id, engine TurnStats
    turn_finished = Signal(object)  # TurnOutcome
    memory = Signal(object)  # engine MemoryReport
    usage = Signal(object)  # ContextFigures
    document_figures = Signal(object)  # tuple of DocumentFigures (sent before the usage they belong to)
    pinned = Signal(int, object, str, str)  # PinRequest.request_id, the pins not found, an error, why not applied now
    heat = Signal(int, object, str)  # HeatRequest.request_id, engine DocumentHeat or None, and why none (report_heat)
    reconfigured = Signal(object, object)  # engine ReconfigureResult, ModelFacts
    reconfigure_failed = Signal(str)
    serving = Signal(str, str)  # the served address ('' when stopped), and why it stopped or could not start
    _call = Signal(object, object)  # (fn, Future) from the server's thread: run here, between turns
    error = Signal(str)  # an unexpected failure outside a turn; the worker keeps running

    def __init__(self, model_factory: ModelFactory | None = None):
        super().__init__()
        self._factory = model_factory or load_engine_model
        self._call.connect(self._run_call)  # emitted from the server's thread: queued to this one
        self.model: EngineModel | None = None
        self._options: dict = {}
        self._sessions: OrderedDict[int, EngineSession] = OrderedDict()
        self._doc_tokens: dict[str, int] = {}  # the engine's count per attachment key (documents do not change)
        self._server = None  # engine.server.BackgroundServer while serving
        self._serve_options: dict | None = None  # what Serve was started with (it restarts on a model change)

    # ------------------------------------------------------------------ model
    @Slot(object)
    def load_model(self, options: dict) -> None:
        """Load a model; the one that is working stays loaded (and in use) until the new one has loaded.
        Only where the new one ran out of memory beside it is the old one unloaded for a second try, and
        loaded again when that fails too."""
        started = time.perf_counter()
        previous, previous_options = self.model, self._options
        try:
            model = self._factory(dict(options), self._report_load_progress)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a dialog, the app stays usable
            if previous is None or not _is_oom(exc):
                self._load_failed(exc, kept=previous is not None)
                return
            log.warning("the new model ran out of memory beside the loaded one: unloading that and retrying")
            self._drop_model()
            try:
                model = self._factory(dict(options), self._report_load_progress)
            except Exception as retry_exc:  # noqa: BLE001
                try:
                    self.model = self._factory(dict(previous_options), self._report_load_progress)
                    self._options = previous_options
                except Exception:  # noqa: BLE001 - the previous model cannot come back either
                    log.exception("could not load the previous model again")
                    self._load_failed(retry_exc, kept=False)
                    return
                self._load_failed(retry_exc, kept=True)
                return
        if previous is not None:
            self._drop_model()
        self.model, self._options = model, dict(options)
        facts = self._facts(time.perf_counter() - started)
        self.loaded.emit(facts)
        self._emit_memory(None)
        if self._serve_options is not None:  # Serve stays on across a model change, for the new model
            self.start_serving(self._serve_options)

    def _load_failed(self, exc: BaseException, *, kept: bool) -> None:
        if isinstance(exc, ModelLoadError):
            reason = exc.reason
        elif isinstance(exc, ConfigError):
            reason = "config"
        else:
            reason = "oom" if _is_oom(exc) else "load_failed"
        message = str(exc)
        if not isinstance(exc, EngineError):  # not a message written for the user: say what it is
            message = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        log.warning("model load failed: %s", message)
        # The facts of the model still loaded (the one that was working), or None: the window keeps using it.
        self.load_failed.emit(message, reason, self._facts() if kept and self.model is not None else None)

    def _report_load_progress(self, message: str, fraction: float) -> None:
        self.load_progress.emit(str(message), float(fraction))

    def _drop_model(self) -> None:
        if self.model is None:
            return
        if self._server is not None:
            self._server.stop()  # a request in flight is stopped at its next step (cancelled with its client)
            self._server = None
            self.serving.emit("", "")
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
        self._sessions.clear()
        self._doc_tokens.clear()
        self.model = None
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _facts(self, load_seconds: float = 0.0) -> ModelFacts:
        model = self.model
        info = model.info
        config = model.config.to_dict()
        return ModelFacts(
            display_name=info.display_name, source=config["model_path"], device=info.device,
            dtype=info.dtype, weight_quant=info.weight_quant, attention_backend=info.attention_backend,
            context_limit=int(model.context_limit), max_positions=int(model.max_positions),
            kv_bytes_per_token=int(model.kv_bytes_per_token()), config=config, load_seconds=load_seconds,
            weight_storage=info.weight_storage, prefill_bf16=bool(info.prefill_bf16),
            attention_kernels=info.attention_kernels, remote=info.remote)

    # ------------------------------------------------------------------ turns
    @Slot(object)
    def send(self, request: TurnRequest) -> None:
        try:
            outcome = self._run_turn(request)
        except Exception as exc:  # noqa: BLE001 - a bug anywhere in a turn must not kill the worker
            log.exception("turn failed")
            outcome = TurnOutcome(request.turn_id, "error", "", error=_describe(exc),
                                  error_kind="oom" if _is_oom(exc) else "error")
        self.turn_finished.emit(outcome)
        if self.model is not None:
            try:
                self._emit_memory(self._sessions.get(request.conversation_id))
            except Exception as exc:  # noqa: BLE001
                self.error.emit(_describe(exc))

    def _run_turn(self, request: TurnRequest) -> TurnOutcome:
        turn = request.turn_id
        if self.model is None:
            return TurnOutcome(turn, "refused", "", error="No model is loaded yet. Wait for it to finish loading, "
                               "or pick a model in the model panel and press Load.", error_kind="no_model")
        if request.cancel.is_set():
            return TurnOutcome(turn, "cancelled", "")
        gen = request.generation
        try:
            session = self._session_for(request.conversation_id, request.history, request.system_prompt)
            session.pins = list(request.pins)  # kept hot from this turn's end on (and after each later one)
            events = session.send(request.prompt, documents=[_engine_document(d) for d in request.documents],
                                  cancel=request.cancel, max_new_tokens=gen.max_new_tokens,
                                  temperature=gen.temperature, seed=gen.seed, greedy=gen.greedy, top_p=gen.top_p,
                                  top_k=gen.top_k, repetition_penalty=gen.repetition_penalty)
        except ContextOverflowError as exc:
            return TurnOutcome(turn, "refused", "", error=str(exc), error_kind="overflow",
                               overflow={"needed": exc.needed, "limit": exc.limit, "parts": dict(exc.parts)})
        except BusyError as exc:
            return TurnOutcome(turn, "refused", "", error=str(exc), error_kind="busy")
        except DocumentError as exc:
            return TurnOutcome(turn, "refused", "", error=str(exc), error_kind="document")
        except Exception as exc:  # noqa: BLE001
            return TurnOutcome(turn, "refused", "", error=_describe(exc), error_kind="oom" if _is_oom(exc) else "error")

        batch: list[str] = []
        text_parts: list[str] = []
        last_flush = last_progress = last_memory = time.monotonic()
        done = None
        error: ErrorEvent | None = None

        def flush():
            nonlocal last_flush
            if batch:
                self.tokens.emit(turn, "".join(batch))
                batch.clear()
            last_flush = time.monotonic()

        messages_before = len(session.messages)
        for event in events:
            now = time.monotonic()
            if isinstance(event, TokenText):
                if event.text:
                    batch.append(event.text)
                    text_parts.append(event.text)
                if now - last_flush >= TOKEN_BATCH_S:
                    flush()
            elif isinstance(event, PrefillProgress):
                if event.done in (0, event.total) or now - last_progress >= PROGRESS_EVERY_S:
                    self.prefill_progress.emit(turn, event.done, event.total)
                    last_progress = now
            elif isinstance(event, TurnStats):
                flush()
                self.stats.emit(turn, event)
            elif isinstance(event, ErrorEvent):
                error = event
            elif isinstance(event, Done):
                done = event
            if now - last_memory >= MEMORY_EVERY_S:
                self._emit_memory(session)
                last_memory = time.monotonic()
        flush()

        text = done.text if done is not None else "".join(text_parts)
        reason = done.reason if done is not None else "error"
        model_content = None
        if len(session.messages) >= messages_before + 2:
            model_content = session.messages[-2].get("content")
        return TurnOutcome(turn, reason, text, stats=done.stats if done is not None else None,
                           error=error.message if error else None, error_kind=error.kind if error else None,
                           model_content=model_content)

    def _session_for(self, conversation_id: int, history: tuple[HistoryTurn, ...],
                     system_prompt: str = "") -> EngineSession:
        """The engine session of this conversation, holding exactly `history` under `system_prompt` (the cache
        is reused when it does)."""
        session = self._sessions.get(conversation_id)
        if session is None:
            session = self.model.chat_session(system_prompt or None)
            self._sessions[conversation_id] = session
            while len(self._sessions) > KEPT_SESSIONS:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(conversation_id)
        session.set_system_prompt(system_prompt or None)
        wanted = self._history_messages(history)
        system = [m for m in session.messages if m.get("role") == "system"]
        if session.messages != system + wanted:
            # The engine notices the transcript no longer extends what it fed and rebuilds the cache.
            session.messages = system + wanted
        return session

    @staticmethod
    def _history_messages(history: tuple[HistoryTurn, ...]) -> list[dict]:
        """The user/assistant messages of `history`; a user message the engine did not store is laid out as
        the engine lays out a turn."""
        messages = []
        for item in history:
            content = item.model_content
            if content is None:
                content = user_content(item.prompt, [_engine_document(d) for d in item.documents])
            messages.append({"role": "user", "content": content})
            if item.reply:  # a question shown without a reply is read without one
                messages.append({"role": "assistant", "content": item.reply})
        return messages

    @Slot(int)
    def forget_conversation(self, conversation_id: int) -> None:
        """A deleted chat: its session goes, and so do its saved caches on disk."""
        session = self._sessions.pop(conversation_id, None)
        if session is not None:
            try:
                session.forget_saved()
            except OSError as exc:
                log.warning("the deleted chat's saved caches could not all be removed: %s", exc)

    # ------------------------------------------------------------------ Serve: the loaded model as an API
    def _submit(self, fn) -> Future:
        """The server's way onto this thread (engine.server's `submit`): its requests run here between the app's
        own turns, on the thread that loaded the model (engine.threads says why that matters)."""
        future: Future = Future()
        self._call.emit(fn, future)
        return future

    @Slot(object, object)
    def _run_call(self, fn, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the server, which answers with it
            future.set_exception(exc)

    @Slot(object)
    def start_serving(self, options: dict) -> None:
        """Serve the loaded model at options' host/port (engine.server), its requests run on this thread;
        `serving` says the address, or why not."""
        self._serve_options = dict(options)
        if self._server is not None:
            self.stop_serving(keep=True)
        if self.model is None:
            self.serving.emit("", "No model is loaded yet: Serve starts once it has loaded.")
            return
        if self.model.info.remote:
            self._serve_options = None
            self.serving.emit("", "This model runs on another server already: Serve shares a model of this "
                                  "machine (point other programs at that server instead).")
            return
        from engine.server import BackgroundServer

        try:
            server = BackgroundServer(self.model, host=options.get("host", "127.0.0.1"),
                                      port=int(options.get("port", 8000)), api_key=options.get("api_key") or None,
                                      submit=self._submit)
            address = server.start()
        except (OSError, EngineError) as exc:
            self._serve_options = None
            self.serving.emit("", str(exc))
            return
        self._server = server
        self.serving.emit(address, "")

    @Slot()
    def stop_serving(self, keep: bool = False) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if not keep:
            self._serve_options = None
            self.serving.emit("", "")

    # ------------------------------------------------------------------ knobs and figures
    @Slot(object)
    def reconfigure(self, request: tuple) -> None:
        """request: (the open chat's id, the knobs). They apply to that chat's cache alone: every chat keeps its own
        knobs (opening a chat sends its knobs, and the other chats' caches are not touched). A chat without a live
        cache (new, or not read yet in this run) is read with them at its next question: the model's knobs, which a
        new session starts with, become these. The before / after figures are that chat's cache's."""
        if self.model is None:
            return
        conversation_id, knobs = request
        session = self._sessions.get(conversation_id) if conversation_id is not None else None
        try:
            if session is None and not self.model.info.remote:
                bad = [k for k in knobs if k not in CACHE_KNOBS]
                if bad:
                    raise ConfigError(bad[0], knobs[bad[0]], "a cache knob")
                new = self.model.config.replace(**knobs)  # validates
                result = ReconfigureResult("unchanged" if new == self.model.config else "set", None, None)
                self.model.config = new
            else:
                result = self.model.reconfigure(session, progress=self._reconfigure_progress, **knobs)
        except Exception as exc:  # noqa: BLE001 - a bad knob value is a message, not a crash
            self.reconfigure_failed.emit(str(exc) if isinstance(exc, EngineError) else _describe(exc))
            return
        self.reconfigured.emit(result, self._facts())
        self._emit_memory(session)

    def _reconfigure_progress(self, event: PrefillProgress) -> None:
        self.prefill_progress.emit(-1, int(event.done), int(event.total))

    @Slot(object)
    def report_memory(self, conversation_id) -> None:
        if self.model is None:
            return
        try:
            self._emit_memory(self._sessions.get(conversation_id) if conversation_id is not None else None)
        except Exception as exc:  # noqa: BLE001
            self.error.emit(_describe(exc))

    def _emit_memory(self, session: EngineSession | None) -> None:
        """The open chat's figures: with no live cache (a new chat, or one not read yet) none, never another chat's."""
        if self.model is None:
            return
        self.memory.emit(self.model.memory_report(session.cache if session is not None else None, last_chat=False))

    @Slot(object)
    def report_heat(self, request: HeatRequest) -> None:
        """Which parts of a document the chat's cache holds hot now, from the engine, or why the engine cannot say:
        "no_model", "remote" (another server's cache), "not_loaded" (the chat not asked anything since the app
        started), "not_held" (its cache does not hold that text)."""
        heat = None
        session, why = self._live_session(request.conversation_id)
        if session is not None:
            try:
                heat = session.document_heat(request.text)
            except Exception as exc:  # noqa: BLE001
                self.error.emit(_describe(exc))
            why = "" if heat is not None else "not_held"
        self.heat.emit(request.request_id, heat, why)

    def _live_session(self, conversation_id: int) -> tuple[EngineSession | None, str]:
        """The chat's session with a live cache (this process's, or our server's for a chat it reaches), or None and
        why not: "no_model", "remote" (another server's cache), "not_loaded" (the chat not asked anything since the
        model was loaded)."""
        if self.model is None:
            return None, "no_model"
        if self.model.info.remote == "openai":
            return None, "remote"  # our server answers for its cache (engine.served); another server cannot
        session = self._sessions.get(conversation_id)
        return session, "" if session is not None else "not_loaded"

    @Slot(object)
    def set_pins(self, request: PinRequest) -> None:
        """The chat's pins applied to its live cache now ("not_loaded": none here yet; its next turn applies
        them), or the engine's refusal (more than the cache has room for: nothing changed)."""
        session, why = self._live_session(request.conversation_id)
        if session is None:
            self.pinned.emit(request.request_id, (), "", why)
            return
        try:
            missing = session.set_pins(list(request.pins))
        except EngineError as exc:
            self.pinned.emit(request.request_id, (), str(exc), "")
            return
        except Exception as exc:  # noqa: BLE001
            self.error.emit(_describe(exc))
            self.pinned.emit(request.request_id, (), _describe(exc), "")
            return
        self.pinned.emit(request.request_id, tuple(missing), "", "")

    @Slot(object)
    def count_usage(self, request: UsageRequest) -> None:
        """The context bar's figures, and each attached document's tokens and KV bytes, from the engine."""
        if self.model is None:
            return
        try:
            usage = self._usage(request)
            self.document_figures.emit(self._document_figures(request, usage))
            self.usage.emit(usage)
        except Exception as exc:  # noqa: BLE001
            self.error.emit(_describe(exc))

    def _usage(self, request: UsageRequest) -> ContextFigures:
        session = self._sessions.get(request.conversation_id) if request.conversation_id is not None else None
        usage = self.model.context_usage(session, self._history_messages(request.history), request.prompt,
                                         system_prompt=request.system_prompt)
        # Documents are counted once per attachment (the engine's count, kept by key): the context bar asks
        # again at every pause in typing.
        return dataclasses.replace(usage, documents=sum(self._document_tokens(d) for d in request.documents))

    def _document_figures(self, request: UsageRequest, usage: ContextFigures) -> tuple[DocumentFigures, ...]:
        """Each document after what comes before it: its share of the compacted cache (the engine's budget,
        whose floor keeps a short document whole) and the cache's bytes once it holds it, at the knobs the
        panel shows (they may not be applied yet)."""
        knobs = request.knobs
        ratio = float(knobs.get("kv_cache_ratio", self.model.config.kv_cache_ratio))
        before = usage.system + usage.history + usage.prompt
        stored_before = self.model.stored_kv_bytes(before, **knobs)
        figures = []
        for document in request.documents:
            tokens = self._document_tokens(document)
            stored_after = self.model.stored_kv_bytes(before + tokens, **knobs)
            figures.append(DocumentFigures(document.key, tokens, stored_after - stored_before, stored_after, ratio))
            before, stored_before = before + tokens, stored_after
        return tuple(figures)

    def _document_tokens(self, document: AttachedDocument) -> int:
        if document.key not in self._doc_tokens:
            self._doc_tokens[document.key] = self.model.document_tokens(_engine_document(document))
        return self._doc_tokens[document.key]


class EngineClient(QObject):
    """GUI-side handle: owns the worker thread; its request signals are queued to the worker's slots."""

    load_model = Signal(object)
    _send = Signal(object)
    reconfigure = Signal(object)
    report_memory = Signal(object)
    count_usage = Signal(object)
    report_heat = Signal(object)  # HeatRequest
    set_pins = Signal(object)  # PinRequest
    forget_conversation = Signal(int)
    start_serving = Signal(object)  # {"host", "port", "api_key"}
    stop_serving = Signal()

    def __init__(self, model_factory: ModelFactory | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker(model_factory)
        self.worker.moveToThread(self.thread)
        self.thread.finished.connect(self.worker.deleteLater)
        self.load_model.connect(self.worker.load_model)
        self._send.connect(self.worker.send)
        self.reconfigure.connect(self.worker.reconfigure)
        self.report_memory.connect(self.worker.report_memory)
        self.count_usage.connect(self.worker.count_usage)
        self.report_heat.connect(self.worker.report_heat)
        self.set_pins.connect(self.worker.set_pins)
        self.forget_conversation.connect(self.worker.forget_conversation)
        self.start_serving.connect(self.worker.start_serving)
        self.stop_serving.connect(self.worker.stop_serving)
        self.worker.turn_finished.connect(self._on_turn_finished)
        self._current: TurnRequest | None = None
        # Normal priority on purpose: a lowered worker can be preempted while it holds the GIL, and then the
        # GUI thread waits for it (measured: worse worst-case gaps under load, and slower turns).
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def send_turn(self, request: TurnRequest) -> None:
        self._current = request
        self._send.emit(request)

    def stop(self) -> None:
        """Set from the GUI thread: the engine sees it at its next prefill chunk or decode step."""
        if self._current is not None:
            self._current.cancel.set()

    @Slot(object)
    def _on_turn_finished(self, outcome: TurnOutcome) -> None:
        if self._current is not None and self._current.turn_id == outcome.turn_id:
            self._current = None

    def shutdown(self, timeout_ms: int = 10_000) -> None:
        self.stop()
        server = self.worker._server
        if server is not None:  # the event loop may not run a queued stop_serving any more
            server.stop(timeout=5)
        self.thread.quit()
        if not self.thread.wait(timeout_ms):
            log.warning("engine worker did not stop within %d ms", timeout_ms)


# ---------------------------------------------------------------------------------------------- helpers
def _engine_document(document: AttachedDocument) -> Document:
    return Document(name=document.name, path=document.path, kind=document.kind, text=document.text,
                    pages=document.pages, chars=document.chars)


def _is_oom(exc: BaseException) -> bool:
    """Out of memory, by type: Python's MemoryError, torch's (CUDA) OutOfMemoryError, or an engine error
    whose reason says so (engine.loader raises ModelLoadError(reason="oom"); a turn reports ErrorEvent kind
    "oom" itself)."""
    if isinstance(exc, MemoryError) or (isinstance(exc, ModelLoadError) and exc.reason == "oom"):
        return True
    # Only called on the worker thread. An exception of torch's exists only once torch is loaded, so an
    # unloaded torch is not imported just to ask.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{place}"
