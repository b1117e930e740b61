"""ChatSession: a conversation as token ids, the chat template, documents, and cache reuse across turns.

The cache is reused across turns: a turn renders the conversation with the model's chat template,
checks that it extends what was already fed, and prefills only the new tokens. A turn lays out as
[documents…][question][assistant header], so the question's attention scores the document before the
end-of-prefill compaction (query-aware CED).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .cache import CacheSettings, adapter
from .documents import Document, format_for_prompt, load_document
from .errors import BusyError, ContextOverflowError
from .events import ContextUsage, Done, Event, PrefillProgress, TurnStats
from .generate import TurnPlan, TurnResult, run_turn
from .sampling import GenerationSettings

MAX_QUESTION_WINDOW = 512  # question tokens that score the document at the end of a turn's prefill


@dataclass
class PreparedTurn:
    user_message: dict
    delta_text: str
    new_ids: list[int]
    question_tokens: int
    usage: ContextUsage
    rebuild: bool  # the template did not extend the transcript: the cache must be rebuilt
    documents: list[Document] = field(default_factory=list)


class ChatSession:
    def __init__(self, model, system_prompt: str | None = None):
        self.model = model
        self.system_prompt = system_prompt
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.cache = model.new_cache()
        self.transcript_ids: list[int] = []  # every token fed, in order (for rebuilds)
        self.fed_text = ""  # the text those tokens stand for
        self.system_tokens = self._count(self._render(self.messages, False)) if system_prompt else 0
        self.last_stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._busy = False
        self._dirty = False  # cache no longer matches fed_text (e.g. cancelled mid-compaction)

    # ------------------------------------------------------------------ helpers
    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def busy(self) -> bool:
        return self._busy

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _count(self, text: str) -> int:
        return len(self._encode(text))

    @property
    def context_limit(self) -> int:
        return self.model.context_limit

    def usage(self, prompt: str = "", documents: Sequence[Document] = ()) -> ContextUsage:
        """What the context holds now, plus a pending prompt/documents (estimate, no template)."""
        doc_tokens = sum(self._count(format_for_prompt(d)) for d in documents)
        return ContextUsage(self.system_tokens, max(self.cache.seen - self.system_tokens, 0), doc_tokens,
                            self._count(prompt), self.context_limit)

    # ------------------------------------------------------------------ turns
    def prepare(self, prompt: str, documents: Sequence[str | Document] = ()) -> PreparedTurn:
        """Everything a turn needs, computed before any model work; raises if it cannot fit."""
        docs = [d if isinstance(d, Document) else load_document(d) for d in documents]
        blocks = [format_for_prompt(d) for d in docs]
        content = "\n\n".join(blocks + [prompt]) if blocks else prompt
        user = {"role": "user", "content": content}
        full = self._render(self.messages + [user], True)
        rebuild = self._dirty or not full.startswith(self.fed_text)
        delta = full if rebuild else full[len(self.fed_text):]
        # Tokenize head (history tail + documents) and tail (question + assistant header) apart, so we
        # know exactly which tokens are the question.
        cut = delta.rfind(prompt) if prompt else -1
        if blocks and cut > 0:
            head_ids, tail_ids = self._encode(delta[:cut]), self._encode(delta[cut:])
        else:
            head_ids, tail_ids = [], self._encode(delta)
        new_ids = head_ids + tail_ids
        question = min(len(tail_ids), MAX_QUESTION_WINDOW)
        doc_tokens = sum(self._count(b) for b in blocks)
        already = 0 if rebuild else self.cache.seen
        prompt_tokens = self._count(prompt)
        history = max(already + len(new_ids) - self.system_tokens - doc_tokens - prompt_tokens, 0)
        usage = ContextUsage(self.system_tokens, history, doc_tokens, prompt_tokens, self.context_limit)
        needed = already + len(new_ids) + 1
        if needed > self.context_limit:
            raise ContextOverflowError(needed, self.context_limit, {
                "system": usage.system, "history": usage.history, "documents": usage.documents,
                "prompt": usage.prompt})
        return PreparedTurn(user, delta, new_ids, question, usage, rebuild, docs)

    def send(self, prompt: str, documents: Sequence[str | Document] = (), *, cancel: threading.Event | None = None,
             settings: GenerationSettings | None = None, **overrides) -> Iterator[Event]:
        """Stream one turn. Errors in the inputs (documents, context) raise before the first event."""
        if self._busy:
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        turn = self.prepare(prompt, documents)
        settings = settings or self.model.generation_settings(**overrides)
        return self._run(turn, settings, cancel)

    def _run(self, turn: PreparedTurn, settings: GenerationSettings, cancel) -> Iterator[Event]:
        if not self._lock.acquire(blocking=False):
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        self._busy = True
        result = TurnResult([], 0, 0, False)
        try:
            if turn.rebuild:
                self.cache.reset()
                self.transcript_ids, self.fed_text = [], ""
            before = (self.cache.seen, [layer.length for layer in self.cache.layers], self.cache.compactions)
            plan = TurnPlan(turn.new_ids, turn.question_tokens, self.model.prefill_chunk,
                            self.model.headroom_tokens(self.cache), self.context_limit)
            done = None
            for event in run_turn(self.model.hf_model, self.tokenizer, self.cache, plan, settings,
                                  cancel=cancel, eos_ids=self.model.eos_ids, result=result):
                if isinstance(event, Done):
                    done = event
                    continue  # yielded after the transcript is updated
                yield event
            self._commit(turn, result, done, before)
            if done is not None:
                done = Done(done.reason, done.text, _with_rebuild(done.stats, turn.rebuild), done.token_ids)
                self.last_stats = done.stats
                yield done
        finally:
            self._busy = False
            self._lock.release()
            self.model._turn_finished(self)

    def _commit(self, turn: PreparedTurn, result: TurnResult, done: Done | None, before) -> None:
        """Record what was actually fed, so the next turn extends it (or rebuilds when it cannot)."""
        if result.prefilled < len(turn.new_ids):
            # Stopped during prefill: nothing of this turn is kept. Undo the partial prefill when no
            # compaction touched the old entries; otherwise rebuild from the transcript next turn.
            seen, lengths, compactions = before
            if self.cache.compactions == compactions:
                for layer, length in zip(self.cache.layers, lengths, strict=True):
                    layer.truncate(length)
                self.cache.seen = seen
            else:
                self._dirty = True
            return
        fed_gen = result.generated[: result.fed_generated]
        self.transcript_ids += turn.new_ids + fed_gen
        self.fed_text += turn.delta_text + self.tokenizer.decode(
            fed_gen, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        reply = done.text if done is not None else ""
        self.messages += [turn.user_message, {"role": "assistant", "content": reply}]

    # ------------------------------------------------------------------ reconfigure / reset
    def rebuild(self, progress=None, cancel: threading.Event | None = None) -> None:
        """Re-read the transcript with the current cache settings (quality comes back after loosening)."""
        with self._lock:
            ids = list(self.transcript_ids)
            self.cache.reset()
            chunk = self.model.prefill_chunk
            device = self.model.device
            total = len(ids)
            for start in range(0, total, chunk):
                if cancel is not None and cancel.is_set():
                    self._dirty = True
                    return
                part = torch.tensor([ids[start:start + chunk]], device=device)
                adapter.forward(self.model.hf_model, part, self.cache, prefill=True)
                if progress:
                    progress(PrefillProgress(min(start + chunk, total), total))
            if self.cache.settings.compressing:
                self.cache.compact(pooled=True)  # the transcript's last question scored it
                self.cache.shrink()
            self.cache.fit_sparse()
            self._dirty = False

    def apply_settings(self, settings: CacheSettings, progress=None) -> str:
        """Apply new cache knobs: 'compacted' (tighter, done on the live cache) or 'rebuilt' (looser)."""
        old = self.cache.settings
        self.cache.settings = settings
        if settings.kv_int8 != old.kv_int8 or _looser(old, settings):
            self.rebuild(progress)
            return "rebuilt"
        if settings.compressing:
            self.cache.compact(pooled=True)
            self.cache.shrink()
        self.cache.fit_sparse()
        return "compacted"

    def reset(self) -> None:
        with self._lock:
            self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            self.cache.reset()
            self.transcript_ids, self.fed_text, self._dirty = [], "", False


def _looser(old: CacheSettings, new: CacheSettings) -> bool:
    """More ratio, lower threshold, a wider protected window or a different policy -> rebuild."""
    return (new.kv_cache_ratio > old.kv_cache_ratio or new.ced_threshold < old.ced_threshold
            or new.ced_sink_tokens > old.ced_sink_tokens or new.ced_recent_tokens > old.ced_recent_tokens
            or new.ced_policy != old.ced_policy or new.ced_mode != old.ced_mode)


def _with_rebuild(stats: TurnStats | None, rebuilt: bool) -> TurnStats | None:
    if stats is None or not rebuilt:
        return stats
    from dataclasses import replace

    return replace(stats, rebuilt_context=True)
