"""ChatSession: a conversation as token ids, the chat template, documents, and cache reuse across turns.

The cache is reused across turns: a turn renders the conversation with the model's chat template,
checks that it extends what was already fed, and prefills only the new tokens. A turn lays out as
[documents…][question][assistant header], so the question's attention scores the document before the
end-of-prefill compaction (query-aware CED).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from . import chat_template as template
from . import saved_state
from .cache import CacheSettings
from .documents import Document, format_for_prompt, load_document, user_content
from .errors import BusyError, ContextOverflowError
from .events import ContextUsage, Done, Event, PrefillProgress, TurnStats
from .generate import TurnPlan, TurnResult, run_turn
from .models import adapter
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
    rendered: template.Rendered | None = None  # the whole conversation with this turn (delta_text is its end)
    restored: bool = False  # the conversation's saved cache was restored (nothing before this turn is re-read)
    head: int = 0  # tokens of new_ids before the question (what the question is asked about), and their characters
    head_chars: int = 0  # in delta_text: saved once read where there are enough of them (saved_state.save_head)


class ChatSession:
    def __init__(self, model, system_prompt: str | None = None):
        self.model = model
        self.system_prompt = system_prompt
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.cache = model.new_cache()
        self.transcript_ids: list[int] = []  # every token fed, in order (for rebuilds)
        self.fed_text = ""  # the rendered conversation those tokens stand for
        self.fed_specials: tuple[tuple[int, int, int], ...] = ()  # where its control tokens are (template.Rendered)
        self.system_tokens = template.count_system(self.tokenizer, system_prompt)
        # A reply ends at the first control token the model generates (EOS or any other special token): a
        # control token is never fed as reply text, so a reply cannot open a turn of its own.
        self.stop_ids = frozenset(model.eos_ids) | template.special_ids(self.tokenizer)
        self.last_stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._busy = False
        self._dirty = False  # cache no longer matches fed_text (e.g. cancelled mid-compaction)
        self.last_save_seconds: float | None = None  # writing the last turn's saved cache
        # restored from a state saved inside a turn (saved_state.save_head): that turn's tokens the cache read before
        # it (the repetition penalty looks at them) and those it had not read yet (read first by the next turn)
        self.lead: list[int] = []
        self.pending: list[int] = []
        self._head_save = None  # the thread writing a turn's documents' state (saved_state.save_head)
        self.pins: list[str] = []  # parts of its documents kept hot (set_pins)

    def set_system_prompt(self, system_prompt: str | None) -> None:
        """A new system prompt for this chat ('' or None: none). The transcript then no longer extends what
        the cache holds, so the next turn reads the conversation again under the new prompt."""
        system_prompt = system_prompt or None
        if system_prompt == self.system_prompt:
            return
        if self._busy:
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        rest = [m for m in self.messages if m.get("role") != "system"]
        self.system_prompt = system_prompt
        self.messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + rest
        self.system_tokens = template.count_system(self.tokenizer, system_prompt)

    # ------------------------------------------------------------------ helpers
    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def busy(self) -> bool:
        return self._busy

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> template.Rendered:
        return template.render(self.tokenizer, messages, add_generation_prompt)

    def _count(self, text: str) -> int:
        return template.count_text(self.tokenizer, text)

    @property
    def context_limit(self) -> int:
        return self.model.context_limit

    @property
    def consistent(self) -> bool:
        """The cache holds exactly the transcript's tokens, and the transcript renders the messages' start."""
        if self._dirty or self.cache.seen != len(self.transcript_ids):
            return False
        return self._render(self.messages, False).extends(self.fed_text, self.fed_specials) or \
            self._render(self.messages, True).extends(self.fed_text, self.fed_specials)

    # ------------------------------------------------------------------ turns
    def prepare(self, prompt: str, documents: Sequence[str | Document] = ()) -> PreparedTurn:
        """Everything a turn needs, computed before any model work; raises if it cannot fit."""
        prompt = template.clean_text(prompt)
        if isinstance(documents, (str, os.PathLike, Document)):
            documents = [documents]  # one document given as itself rather than in a list
        docs = [d if isinstance(d, Document) else load_document(d) for d in documents]
        blocks = [template.clean_text(format_for_prompt(d)) for d in docs]
        user = {"role": "user", "content": user_content(prompt, docs)}
        full = self._render(self.messages + [user], True)
        # Rebuild from the messages when the cache does not hold exactly the transcript (an interrupted
        # turn that could not be undone), or when the messages no longer render what was fed.
        # (a chat given its messages but no cache, a reopened one, reads them all: that is a re-read too, and its
        # reply says so)
        rebuild = (self._dirty or self.cache.seen != len(self.transcript_ids)
                   or not full.extends(self.fed_text, self.fed_specials)
                   or (not self.transcript_ids and any(m.get("role") == "assistant" for m in self.messages)))
        # A cache that holds nothing yet (a chat reopened) or must be rebuilt: a saved state may spare the re-read.
        # States end after a reply or after a turn's documents (saved_state.save_head): a chat with neither before
        # its question (a new chat asked without documents) has none to look for.
        restored = ((rebuild or not self.transcript_ids)
                    and (blocks or any(m.get("role") == "assistant" for m in self.messages))
                    and saved_state.restore(self, full))
        if restored:
            rebuild = not full.extends(self.fed_text, self.fed_specials)
        offset = 0 if rebuild else len(self.fed_text)
        delta = full.text[offset:]
        # Tokenize head (history tail + documents) and tail (question + assistant header) apart, so we
        # know exactly which tokens are the question.
        cut = delta.rfind(prompt) if prompt else -1
        if blocks and cut > 0:
            head_ids = template.encode(self.tokenizer, full, offset, offset + cut)
            tail_ids = template.encode(self.tokenizer, full, offset + cut)
        else:
            head_ids, tail_ids = [], template.encode(self.tokenizer, full, offset)
        pending = [] if rebuild else list(self.pending)  # a turn's tokens a restored state had not read yet
        new_ids = pending + head_ids + tail_ids
        question = min(len(tail_ids), MAX_QUESTION_WINDOW)
        doc_tokens = sum(self._count(b) for b in blocks)
        already = 0 if rebuild else self.cache.seen
        # history: the earlier turns (as the cache holds them, or as the template renders them when re-read); the
        # prompt part is this turn's own tokens but its documents, its template markers with it
        if not any(m.get("role") != "system" for m in self.messages):
            history = 0
        elif rebuild:
            history = len(template.encode(self.tokenizer, self._render(self.messages, False))) - self.system_tokens
        else:
            history = already - self.system_tokens
        history = max(history, 0)
        prompt_tokens = max(already + len(new_ids) - self.system_tokens - history - doc_tokens, 0)
        usage = ContextUsage(self.system_tokens, history, doc_tokens, prompt_tokens, self.context_limit)
        needed = already + len(new_ids) + 1
        if needed > self.context_limit:
            raise ContextOverflowError(needed, self.context_limit, {
                "system": usage.system, "history": usage.history, "documents": usage.documents,
                "prompt": usage.prompt}, max_positions=self.model.max_positions)
        head = len(pending) + len(head_ids) if question == len(tail_ids) else 0  # (a longer question: no clean cut)
        return PreparedTurn(user, delta, new_ids, question, usage, rebuild, docs, full, restored, head,
                            cut if head else 0)

    def send(self, prompt: str, documents: Sequence[str | Document] = (), *, cancel: threading.Event | None = None,
             settings: GenerationSettings | None = None, **overrides) -> Iterator[Event]:
        """Stream one turn. Errors in the inputs (documents, context, settings) raise before the first event.

        However the turn ends (done, stopped, an error, the generator closed or interrupted), the cache and
        the transcript agree afterwards: a turn stopped before its prompt was read, or ended without any
        reply text, is undone; one stopped while replying keeps the reply shown so far."""
        if self._busy:
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        settings = settings or self.model.generation_settings(**overrides)
        turn = self.prepare(prompt, documents)
        return self._run(turn, settings, cancel)

    def _run(self, turn: PreparedTurn, settings: GenerationSettings, cancel) -> Iterator[Event]:
        if not self._lock.acquire(blocking=False):
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        self._busy = True
        result = TurnResult([], 0, 0, False)
        committed = False
        checkpoint = None
        events = None
        try:
            if turn.rebuild:
                self.cache.reset()
                self.transcript_ids, self.fed_text, self.fed_specials, self._dirty = [], "", (), False
                self.lead, self.pending = [], []
            if self.pins:  # hot while the turn reads (engine.heat.pins_ahead)
                from .heat import pins_ahead

                pins_ahead(self, turn)
            checkpoint = self.cache.checkpoint()
            plan = TurnPlan(turn.new_ids, turn.question_tokens, self.model.chunk_for(self.cache.settings.prefill_chunk),
                            self.model.headroom_tokens(self.cache), self.context_limit)
            plan.lead = list(self.lead) if turn.restored else []
            if turn.head >= saved_state.HEAD_MIN and self.model.conversation_store is not None:
                plan.head = turn.head
                plan.on_head = lambda read: saved_state.save_head(self, turn, checkpoint.question_at, read)
            done = None
            events = run_turn(self.model.hf_model, self.tokenizer, self.cache, plan, settings, cancel=cancel,
                              eos_ids=self.stop_ids, result=result)
            for event in events:
                if isinstance(event, Done):
                    done = event
                    continue  # yielded after the transcript is updated
                yield event
            committed = True
            self._commit(turn, result, done, checkpoint)
            if self.pins and not self._dirty:  # hot again where a rebuild dropped them, found where just sent
                from .heat import keep_pins

                keep_pins(self)
            if done is not None and done.text:
                saved_state.save(self)
            if done is not None:
                done = Done(done.reason, done.text, _with_context(done.stats, turn), done.token_ids)
                self.last_stats = done.stats
                yield done
        finally:
            if events is not None:
                events.close()
            if not committed:  # closed, interrupted (Ctrl-C) or failed outside the turn loop
                try:
                    self._commit(turn, result, None, checkpoint)
                except BaseException:
                    self._dirty = True  # the next turn rebuilds the cache from the messages
                    raise
                finally:
                    self._release()
            else:
                self._release()

    def _release(self) -> None:
        self._busy = False
        self._lock.release()
        self.model.turn_finished(self)

    def _commit(self, turn: PreparedTurn, result: TurnResult, done: Done | None, checkpoint) -> None:
        """Record what was actually fed, so the next turn extends it (or rebuilds when it cannot)."""
        if checkpoint is None:  # stopped before anything was fed
            return
        reply = done.text if done is not None else result.text
        if result.prefilled < len(turn.new_ids) or not reply:
            # Stopped while the prompt was read, or no reply text at all: nothing of this turn is kept (a chat
            # app keeps no exchange without a reply either). Undo it exactly when no compaction removed
            # entries since the turn began; otherwise the next turn re-reads the conversation.
            if not self.cache.restore(checkpoint):
                self._dirty = True
            return
        fed_gen = result.generated[: result.fed_generated]
        # a stop string of several tokens: the tokens fed of its start, which the reply does not keep, leave the cache
        keep = template.reply_tokens_kept(self.tokenizer, fed_gen, reply) if done and done.reason == "stop" else len(
            fed_gen)
        if keep < len(fed_gen) and self.cache.forget_last(len(fed_gen) - keep):
            fed_gen = fed_gen[:keep]  # the rest of the reply is read again, as its text, with the next turn
        text, specials = template.decode_fed(self.tokenizer, fed_gen, len(self.fed_text) + len(turn.delta_text))
        self.transcript_ids += turn.new_ids + fed_gen
        self.lead, self.pending = [], []
        offset = len(self.fed_text)  # turn.rendered starts with fed_text (or both start afresh)
        self.fed_specials = self.fed_specials + tuple(span for span in turn.rendered.specials
                                                      if span[0] >= offset) + specials
        self.fed_text += turn.delta_text + text
        self.messages += [turn.user_message, {"role": "assistant", "content": reply}]
        if self.cache.seen != len(self.transcript_ids):  # interrupted between a forward and its record
            self._dirty = True

    # ------------------------------------------------------------------ saved caches (engine.saved_state)
    def forget_saved(self) -> int:
        """Remove this conversation's saved caches (the chat was deleted). Returns how many files went."""
        store = self.model.conversation_store
        return store.forget(self.fed_text) if store is not None and self.fed_text else 0

    def document_heat(self, text: str):
        """What the cache holds hot of a document this chat has read (engine.heat.DocumentHeat; None: not held)."""
        from . import heat

        return heat.document_heat(self._idle(), text)

    def set_pins(self, texts: Sequence[str]) -> tuple[str, ...]:
        """Keep these pieces of the documents this chat has read hot, now and after every turn (engine.heat.set_pins);
        the pieces not found. Raises PinError, changing nothing, past the cache's room for them."""
        from . import heat

        return heat.set_pins(self._idle(), texts)

    def _idle(self) -> ChatSession:
        if self._busy:
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        return self

    def fork(self) -> ChatSession:
        """A new chat that goes on from this one as it stands: the same messages and a copy of its cache (hot
        set, cold tier, scores, settings), so its next turn reads only that turn, as this one's would. The two
        then go their own ways. A chat whose cache does not hold its transcript gives a fork that re-reads it
        on its first turn."""
        from .cache import persist

        if not self._lock.acquire(blocking=False):
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        try:
            other = ChatSession(self.model, self.system_prompt)
            self.model._sessions.add(other)  # a chat of the model's like any other (knob changes, deferral)
            other.messages = [dict(m) for m in self.messages]
            other.pins = list(self.pins)
            other.cache.settings = self.cache.settings
            other.cache.reset()
            if self._dirty or self.cache.seen != len(self.transcript_ids):
                return other  # nothing fed: its first turn renders and reads the whole conversation
            tensors, facts = persist.save_state(self.cache)
            persist.load_state(other.cache, tensors, facts)
            other.cache.pinned = self.cache.pinned
            other.transcript_ids = list(self.transcript_ids)
            other.lead, other.pending = list(self.lead), list(self.pending)
            other.fed_text, other.fed_specials = self.fed_text, self.fed_specials
            return other
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ reconfigure / reset
    def rebuild(self, progress=None, cancel: threading.Event | None = None) -> None:
        """Re-read the transcript with the current cache settings (quality comes back after loosening)."""
        with self._lock:
            ids = list(self.transcript_ids)
            pinned = self.cache.pinned
            self.cache.reset()
            self.cache.pinned = pinned  # the same tokens at the same positions: kept hot while they are read again
            self._dirty = True  # until the whole transcript has been read again
            chunk = self.model.chunk_for(self.cache.settings.prefill_chunk)
            device = self.model.device
            total = len(ids)
            for start in range(0, total, chunk):
                if cancel is not None and cancel.is_set():
                    return
                part = torch.tensor([ids[start:start + chunk]], device=device)
                adapter.forward(self.model.hf_model, part, self.cache, prefill=True)
                if progress:
                    progress(PrefillProgress(min(start + chunk, total), total))
            self.cache.finish_prefill()  # the transcript's last question scored it
            self._dirty = False

    def apply_settings(self, settings: CacheSettings, progress=None) -> str:
        """Apply new cache knobs: 'compacted' (done on the live cache), 'recalled' (looser, brought back from the
        cold tier) or 'rebuilt' (they keep more than the cache still holds, or store it differently: the
        transcript is read again)."""
        done = self.cache.apply(settings)
        if done == "needs_rebuild":
            self.rebuild(progress)
            done = "rebuilt"
        if self.pins:  # a looser ratio has room again for the pins a tighter one left out
            from .heat import keep_pins

            keep_pins(self)
        return done

    def reset(self) -> None:
        with self._lock:
            self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            self.cache.reset()
            self.transcript_ids, self.fed_text, self.fed_specials, self._dirty = [], "", (), False
            self.pins, self.lead, self.pending = [], [], []


def _with_context(stats: TurnStats | None, turn: PreparedTurn) -> TurnStats | None:
    if stats is None or not (turn.rebuild or turn.restored):
        return stats
    from dataclasses import replace

    return replace(stats, rebuilt_context=turn.rebuild, restored_context=turn.restored)
