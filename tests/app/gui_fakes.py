"""A small stand-in for DSV41Model / ChatSession: app.engine_api's EngineModel and EngineSession.

It streams real engine event objects at a controllable pace, records every call with the time and
the thread it ran on, and can be told to fail in the ways the real engine fails. Tokens are counted
as a quarter of the characters; what is laid out, and what a cache keeps after compaction, is the
engine's own (engine.documents.user_content, engine.cache.budget.budget_for).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

from engine.cache.budget import budget_for
from engine.config import DSV41Config
from engine.documents import Document, format_for_prompt, user_content
from engine.errors import BusyError, ContextOverflowError, ModelLoadError
from engine.events import ContextUsage, Done, ErrorEvent, PrefillProgress, TokenText, TurnStats
from engine.heat import DocumentHeat
from engine.info import LoadInfo, ReconfigureResult
from engine.memory import MemoryReport

KV_BYTES_PER_TOKEN = 46080
WEIGHTS = 538_060_288


class FakeCache:
    """Stands in for DSV41Cache: the worker only hands it back to memory_report."""

    def __init__(self, model):
        self.model = model
        self.seen = 0

    @property
    def stored(self) -> int:
        """What the real cache keeps: everything up to its budget (the floor keeps a short chat whole)."""
        c = self.model.config
        if c.kv_cache_ratio >= 1.0:
            return self.seen
        return min(self.seen, budget_for(self.seen, c.kv_cache_ratio, c.ced_sink_tokens, c.ced_recent_tokens,
                                         c.min_entries))


class FakeSession:
    def __init__(self, model, system_prompt=None):
        self.model = model
        self.messages: list[dict] = []
        self.cache = FakeCache(model)
        self.pins: list[str] = []
        self.system_prompt = None
        self.system_tokens = 0
        self.busy = False
        self.set_system_prompt(system_prompt)

    def set_system_prompt(self, system_prompt):
        system_prompt = system_prompt or None
        if system_prompt == self.system_prompt:
            return
        rest = [m for m in self.messages if m.get("role") != "system"]
        self.system_prompt = system_prompt
        self.messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + rest
        self.system_tokens = self.model.count_system(system_prompt or "")

    def forget_saved(self):
        self.model.record("forget_saved", history=[dict(m) for m in self.messages])
        return 0

    def set_pins(self, texts):
        """As the engine's: past half of what the cache keeps, refused; pieces no message holds, not found."""
        from engine.errors import PinError

        self.model.record("set_pins", pins=list(texts))
        if sum(len(t) for t in texts) // 4 > max(self.cache.stored // 2, 8):
            raise PinError("more to keep hot than the cache has room for: keep a shorter part hot")
        self.pins = [t for t in texts if t.strip()]
        return tuple(t for t in self.pins if not any(t in m.get("content", "") for m in self.messages))

    def document_heat(self, text):
        """As the engine's: None for a text this chat has not read; else each word's share, the first third of the
        text held hot in every slot, the second in half of them, the rest cold."""
        self.model.record("document_heat", chars=len(text))
        if not text or not any(text in m.get("content", "") for m in self.messages if m.get("role") == "user"):
            return None
        spans = tuple((m.start(), m.end(), 1.0 if m.start() < len(text) / 3 else 0.5 if m.start() < 2 * len(text) / 3
                       else 0.0) for m in re.finditer(r"\S+", text))
        share = sum(s for _, _, s in spans) / max(len(spans), 1)
        return DocumentHeat(spans, share, len(spans), 0, self.model.config.cold_tier, self.model.config.kv_cache_ratio)

    def send(self, prompt, documents=(), *, cancel=None, **settings):
        model = self.model
        model.record("send", prompt=prompt, documents=list(documents), settings=settings,
                     history=[dict(m) for m in self.messages])
        if self.busy:
            raise BusyError("busy")
        if "OVERFLOW" in prompt:
            raise ContextOverflowError(9000, model.context_limit, {"system": 0, "history": 0, "documents": 8990,
                                                                    "prompt": 10})
        content = user_content(prompt, documents)
        return self._run(prompt, content, list(documents), cancel or threading.Event(), settings)

    def _run(self, prompt, content, documents, cancel, settings):
        model = self.model
        self.busy = True
        model.record("turn_start")
        try:
            started = time.perf_counter()
            total = max(len(content) // 4, 1)
            yield PrefillProgress(0, total)
            for step in range(model.prefill_steps):
                if cancel.is_set():
                    yield Done("cancelled", "", None, ())
                    return
                time.sleep(model.prefill_delay)
                yield PrefillProgress(min((step + 1) * total // model.prefill_steps, total), total)
            if "CRASH" in prompt:
                raise RuntimeError("simulated bug inside the engine")
            reply = model.reply_for(prompt, documents)
            pieces = _pieces(reply, settings.get("max_new_tokens") or 512)
            # as the engine ends: "length" where max_new_tokens cut the reply short (or the reason it is told)
            cut = len(pieces) < len(reply.split(" "))
            shown, reason, error = "", model.finish_reason or ("length" if cut else "eos"), None
            first = None
            for i, piece in enumerate(pieces):
                if cancel.is_set():
                    reason = "cancelled"
                    break
                if model.oom_after is not None and i >= model.oom_after:
                    error = ErrorEvent("Out of memory during the reply. What was generated is kept.", "oom")
                    reason = "error"
                    break
                time.sleep(model.token_delay)
                first = first or time.perf_counter()
                shown += piece
                yield TokenText(piece, i)
            if error is not None:
                yield error
            self.cache.seen += total + len(shown) // 4
            ended = time.perf_counter()
            stats = TurnStats(ttft_s=(first or ended) - started, prefill_tokens=total, prefill_tok_s=total / 0.01,
                              decode_tokens=len(shown) // 4, decode_tok_s=42.0, total_s=ended - started,
                              tokens_seen=self.cache.seen, kv_stored_tokens=self.cache.stored,
                              kv_stored_bytes=self.cache.stored * KV_BYTES_PER_TOKEN,
                              kv_uncompressed_bytes=self.cache.seen * KV_BYTES_PER_TOKEN)
            yield stats
            self.messages += [{"role": "user", "content": content}, {"role": "assistant", "content": shown}]
            yield Done(reason, shown, stats, ())
        finally:
            self.busy = False
            model.record("turn_end")
            model.turn_finished()


def _bytes_per_token(config: DSV41Config) -> int:
    return KV_BYTES_PER_TOKEN // (4 if config.kv_cache_dtype == "int8" else 1)


def _pieces(text: str, limit: int) -> list[str]:
    words = text.split(" ")
    pieces = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
    return pieces[:limit]


class FakeModel:
    def __init__(self, **config):
        self.config = DSV41Config(**config)
        self.info = LoadInfo(source_kind="default", display_name="FakeLM-1M", folder="", resolve_seconds=0.0,
                             load_seconds=0.0, device="cpu", dtype="float32", weight_quant=self.config.weight_quant,
                             attention_backend="sdpa")
        self.max_positions = 8192
        self.calls: list[tuple] = []
        self.sessions: list[FakeSession] = []
        self.token_delay = 0.005
        self.prefill_delay = 0.005
        self.prefill_steps = 4
        self.oom_after: int | None = None
        self.reply_text: str | None = None
        self.finish_reason: str | None = None  # a reason every reply ends with ("context_full", …)
        self.lock = threading.Lock()

    # --- the DSV41Model surface the worker uses
    @property
    def context_limit(self) -> int:
        return min(self.config.max_seq_len, self.max_positions)

    def chat_session(self, system_prompt=None):
        session = FakeSession(self, system_prompt)
        self.sessions.append(session)
        return session

    def kv_bytes_per_token(self) -> int:
        return _bytes_per_token(self.config)

    def count_tokens(self, text: str) -> int:
        return max(len(text) // 4, 1) if text else 0

    def count_system(self, system_prompt: str) -> int:
        return self.count_tokens(system_prompt) + 4 if system_prompt else 0

    def count_chat(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages)

    def document_tokens(self, document: Document) -> int:
        return self.count_tokens(format_for_prompt(document))

    def context_usage(self, session, history, prompt="", documents=(), system_prompt=None) -> ContextUsage:
        system_tokens, history_tokens = 0, self.count_chat(history)
        if system_prompt is not None and (session is None or (session.system_prompt or "") != system_prompt):
            system_tokens = self.count_system(system_prompt)
        elif session is not None:
            system = [m for m in session.messages if m.get("role") == "system"]
            system_tokens = session.system_tokens
            if session.messages == system + history and session.cache.seen:
                history_tokens = max(session.cache.seen - system_tokens, 0)
        return ContextUsage(system_tokens, history_tokens, sum(self.document_tokens(d) for d in documents),
                            self.count_tokens(prompt), self.context_limit)

    def stored_kv_bytes(self, tokens_seen: int, **knobs) -> int:
        config = self.config.replace(**knobs) if knobs else self.config
        stored = tokens_seen
        if config.kv_cache_ratio < 1.0:
            stored = min(tokens_seen, budget_for(tokens_seen, config.kv_cache_ratio, config.ced_sink_tokens,
                                                 config.ced_recent_tokens, config.min_entries))
        return stored * _bytes_per_token(config)

    def memory_report(self, cache=None, *, last_chat: bool = True) -> MemoryReport:
        seen = cache.seen if cache is not None else 0
        stored = cache.stored if cache is not None else 0
        per_token = self.kv_bytes_per_token()
        report = MemoryReport("cpu", "CPU (system RAM via psutil)", WEIGHTS, stored * per_token,
                              seen * KV_BYTES_PER_TOKEN, 120_000_000, 900_000_000, 16 * 1024**3, 12 * 1024**3, seen,
                              stored)
        if cache is None:
            return report
        from dataclasses import replace

        from engine.cache.budget import explain_ratio
        from engine.cache.settings import CacheSettings

        settings = CacheSettings.from_config(self.config)
        reason = explain_ratio(seen=seen, stored=stored, byte_ratio=report.compression_ratio, settings=settings,
                               threshold_applies=True)
        return replace(report, kv_target_ratio=self.config.kv_cache_ratio, kv_ratio_reason=reason)

    def reconfigure(self, session=None, progress=None, **knobs):
        busy = any(s.busy for s in self.sessions)
        self.record("reconfigure", knobs=knobs, busy=busy)
        before = self.memory_report(session.cache if session else None)
        self.config = self.config.replace(**knobs)
        after = self.memory_report(session.cache if session else None)
        return ReconfigureResult("compacted", before, after)

    # --- test helpers
    def record(self, name, **info):
        with self.lock:
            self.calls.append((name, time.monotonic(), threading.current_thread().name, info))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def turn_finished(self):
        pass

    def reply_for(self, prompt, documents) -> str:
        if self.reply_text is not None:
            return self.reply_text
        names = ", ".join(d.name for d in documents)
        about = f" about {names}" if names else ""
        return (f"You asked{about}: **{prompt}** Here is some code:\n\n```python\nprint('hello')\n```\n\n"
                "And that is all for now, thank you for asking.")

    def sends(self) -> list[dict]:
        return [c[3] for c in self.calls if c[0] == "send"]


def fake_factory(model: FakeModel, *, fail: Exception | None = None, delay: float = 0.0):
    """A model factory for EngineWorker: reports progress, then returns `model` (or raises `fail`)."""
    loads = []

    def factory(options: dict, progress):
        loads.append(dict(options))
        model.record("load", options=dict(options))
        progress("Loading the fake model…", 0.5)
        if delay:
            time.sleep(delay)
        if fail is not None:
            raise fail
        knobs = {k: v for k, v in options.items() if k in DSV41Config.__dataclass_fields__}
        model.config = DSV41Config(**knobs)
        model.info = dataclasses.replace(model.info, weight_quant=model.config.weight_quant)
        return model

    factory.loads = loads
    return factory


__all__ = ["FakeModel", "fake_factory", "ModelLoadError"]
