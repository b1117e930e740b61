"""One turn: chunked prefill, then the decode loop. The engine knows token ids; text comes from the detokenizer.

`run_turn` is a generator of events (see events.py). Cancel is a threading.Event checked before every
prefill chunk and every decode step. The cache's work after the question (DSV41Cache.finish_prefill: its
compaction, the CSA2 fit) runs once the first reply token has been sampled, before the first decode step feeds it:
that token comes from the question's logits, so nothing it depends on changes. It is shown before that work, so
the reader sees it sooner, except in a tiered follow-up that recalled (DSV41Cache.readies_reply_first): there the
work is the question's compaction to the reply's hot set and the counts of the cold tier (44 ms at 7,429 tokens,
benchmarks/recall_cost.py), done before the token is shown, where it counts in the first-token latency of the
question it belongs to instead of stalling the reply between its first token and its second (a short reply's
decode speed paid all of it).
Out of memory mid-turn keeps what was generated and ends the turn with an ErrorEvent + Done("error"). `eos_ids` end
the reply and are never fed (ChatSession passes EOS and every control token of the tokenizer). `result` says at
every yield exactly what was fed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .cache import DSV41Cache
from .detokenizer import IncrementalDetokenizer
from .events import Done, ErrorEvent, Event, PrefillProgress, TokenText, TurnStats
from .memory import begin_turn
from .models import adapter
from .sampling import GenerationSettings, next_token
from .threads import decode_threads

log = logging.getLogger(__name__)

REPETITION_WINDOW = 256  # recent tokens the repetition penalty looks at


@dataclass
class TurnPlan:
    """What to feed: the new token ids and how many at the end are the question (they score the rest)."""

    new_ids: list[int]
    question_tokens: int = 0
    chunk: int = 512
    headroom_tokens: int | None = None  # max stored entries while this turn prefills (None: unbounded)
    limit: int = 8192  # tokens seen may not exceed this (context window)
    head: int = 0  # with on_head: the tokens before the question. on_head(n) is called before the chunk that holds
    on_head: Callable[[int], None] | None = None  # the question's first token, n tokens read (the session saves the
    # cache there; never fails the turn). The chunks are what they are without it.
    lead: list[int] = field(default_factory=list)  # this turn's tokens read before new_ids (a turn restored from the
    # state saved after its documents): the repetition penalty looks at them as when the turn read them


@dataclass
class TurnResult:
    generated: list[int]
    fed_generated: int  # how many generated tokens were fed to the model (the last sampled one may not be)
    prefilled: int  # how many of plan.new_ids were fed
    compacted_during_prefill: bool
    text: str = ""  # reply text yielded so far (what a reader of the events has seen)


class RecentIds:
    """The last `window` token ids, which the repetition penalty lowers, as one tensor on `device` (`ids`) kept in a
    ring: their order is not kept (the penalty applies once per distinct id, wherever it stands), so a new token is
    one element written in place (through numpy on the CPU), where a torch.cat of the window per token cost
    30-60 us with the caches the decode step has just flushed."""

    def __init__(self, initial: list[int], window: int, device: torch.device):
        initial = list(initial)[-window:]
        self._ring = torch.zeros(window, dtype=torch.long, device=device)
        if initial:
            self._ring[: len(initial)] = torch.tensor(initial, dtype=torch.long)
        self._window, self._filled, self._at = window, len(initial), len(initial) % window
        self._host = self._ring.numpy() if self._ring.device.type == "cpu" else None
        self.ids = self._ring if self._filled == window else self._ring[: self._filled]

    def push(self, token: int, token_ids: torch.Tensor | None = None) -> None:
        """`token` in place of the oldest (`token_ids`: the same id as a one-element tensor on the ring's device,
        written without a read on the host)."""
        if self._host is not None:
            self._host[self._at] = token
        elif token_ids is not None:
            self._ring[self._at : self._at + 1] = token_ids
        else:
            self._ring[self._at] = token
        self._at = (self._at + 1) % self._window
        if self._filled < self._window:
            self._filled += 1
            self.ids = self._ring if self._filled == self._window else self._ring[: self._filled]


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(exc, oom_type) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def run_turn(model, tokenizer, cache: DSV41Cache, plan: TurnPlan, settings: GenerationSettings, *,
             cancel: threading.Event | None = None, eos_ids: frozenset[int] = frozenset(),
             result: TurnResult | None = None) -> Iterator[Event]:
    cancel = cancel or threading.Event()
    result = result if result is not None else TurnResult([], 0, 0, False)
    detok = IncrementalDetokenizer(tokenizer)
    device = next(model.parameters()).device
    if device.type == "cuda":
        begin_turn(cache.devices)  # "activations" in the memory report: this turn's working memory
    generator = None  # made beside the first logits: sampling runs where they are (sampling.py)
    started = time.perf_counter()
    compaction_before = cache.compaction_seconds
    first_token_at = None
    reason = "length"
    shown = ""  # text already emitted (stop strings are held back until they cannot match)
    prefill_done = decoded_at = None
    threads = None
    prompt_tokens = cache.seen + len(plan.new_ids)  # what is kept from earlier turns, and this turn's new tokens
    try:
        logits = yield from _prefill(model, cache, plan, cancel, device, result)
        prefill_done = time.perf_counter()
        if logits is None:
            reason = "cancelled"
        else:
            prefill_finished = False
            # the recent tokens stay on the logits' device and the sampled token is fed from there: a decode step
            # reads one value on the host (the token id, for the stop checks and the text), nothing else
            # (kept only where the repetition penalty reads them)
            penalise = settings.repetition_penalty != 1.0
            threads = decode_threads() if device.type == "cpu" else None  # engine.threads.DecodeThreads
            if threads is not None and threads.use != torch.get_num_threads():
                torch.set_num_threads(threads.use)
            step_began, using = None, threads.use if threads is not None else 0
            recent = RecentIds((plan.lead + plan.new_ids) if penalise else [], REPETITION_WINDOW, logits.device)
            while True:
                if cancel.is_set():
                    reason = "cancelled"
                    break
                if generator is None and settings.seed is not None:
                    generator = torch.Generator(device=logits.device).manual_seed(settings.seed)
                token, token_ids = next_token(logits[0, -1], settings, recent.ids, generator)
                if token in eos_ids and not settings.ignore_eos:
                    reason = "eos"
                    break
                result.generated.append(token)
                if penalise:
                    recent.push(token, token_ids)
                detok.push(token)
                text, hit = _cut_at_stop(detok.text, settings.stop)
                safe = text if hit else text[: len(text) - _held_back(text, settings.stop)]
                ends = ("stop" if hit else "length" if len(result.generated) >= settings.max_new_tokens
                        else "context_full" if cache.seen + 1 > plan.limit else None)
                if ends is None and not prefill_finished and cache.readies_reply_first:
                    # a tiered follow-up: the question's work before the token is shown (see the module's docstring)
                    cache.finish_prefill(answer_follows=True)
                    prefill_finished = True
                if len(safe) > len(shown):
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    delta, shown = safe[len(shown):], safe
                    result.text = shown
                    yield TokenText(delta, token)
                if ends is not None:
                    reason = ends
                    break
                if not prefill_finished:  # after the first token is out (see the module's docstring)
                    cache.finish_prefill(answer_follows=True)
                    prefill_finished = True
                if threads is not None:
                    now = time.perf_counter()
                    if step_began is not None:  # the whole step: sampling, text and the forward
                        use = threads.step(now - step_began)
                        if use != using:
                            torch.set_num_threads(use)
                            using = use
                    step_began = now
                logits = adapter.forward_token(model, token, cache, token_ids)
                result.fed_generated += 1
                cache.after_decode_step()
            decoded_at = time.perf_counter()  # the reply's last token is out: what follows is the turn's compaction
            if not prefill_finished:  # the reply ended at its first token (or never began): no reply to wait for
                cache.finish_prefill()
            cache.finish_turn()
    except Exception as exc:  # noqa: BLE001 - the turn ends, the session stays usable
        reason = "error"
        failure = _failure(exc, reading=result.prefilled < len(plan.new_ids))
    else:
        failure = None
    finally:
        if threads is not None and torch.get_num_threads() != threads.full:
            torch.set_num_threads(threads.full)  # prefill and everything else run on every thread
    if failure is not None:
        # Yielded outside the except block: the traceback (and the tensors its frames hold) is gone by now,
        # so the memory a failed step held is free again before the caller acts on the error.
        if failure.kind == "oom" and torch.cuda.is_available():
            import gc

            gc.collect()  # tensors the failed step left in reference cycles
            torch.cuda.empty_cache()
        yield failure
    if reason != "stop":
        detok.flush()
        text, _ = _cut_at_stop(detok.text, settings.stop)
        if len(text) > len(shown):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            delta, shown = text[len(shown):], text
            result.text = shown
            yield TokenText(delta, result.generated[-1] if result.generated else -1)
    ended = time.perf_counter()
    stats = _stats(cache, plan, result, started, prefill_done, first_token_at, decoded_at or ended, ended,
                   compaction_before, prompt_tokens)
    yield stats
    yield Done(reason, shown, stats, tuple(result.generated))


def _failure(exc: BaseException, *, reading: bool) -> ErrorEvent:
    if is_oom(exc):
        kept = ("Nothing of this turn was kept (the prompt had not been read yet)." if reading
                else "What was generated is kept.")
        return ErrorEvent(f"Out of memory during the reply. {kept} Lower kv_cache_ratio or raise ced_threshold "
                          "(compress harder), or lower max_seq_len, then retry.", "oom")
    return ErrorEvent(f"Generation failed: {type(exc).__name__}: {exc}")


def _prefill(model, cache: DSV41Cache, plan: TurnPlan, cancel, device, result: TurnResult):
    """Feed plan.new_ids in chunks; the last chunk holds the question so its attention scores the document.
    The cache decides how the turn is read (DSV41Cache.start_prefill); this loop only runs the forwards."""
    ids = plan.new_ids
    total = len(ids)
    chunks = _chunk_bounds(total, plan.chunk, plan.question_tokens)
    save_at = max((s for s, _ in chunks if s <= plan.head), default=0) if plan.on_head is not None else 0
    logits = None
    prefill = cache.start_prefill(total, plan.question_tokens, plan.headroom_tokens)
    if prefill.wants_probe:
        question = torch.tensor([ids[total - plan.question_tokens:]], device=device)
        prefill.probe = adapter.probe_queries(model, question, cache, cache.seen + total - plan.question_tokens)
    yield PrefillProgress(0, total)
    for index, (start, end) in enumerate(chunks):
        if cancel.is_set():
            return None
        last = index == len(chunks) - 1
        if save_at and start == save_at:
            try:
                plan.on_head(start)
            except Exception:  # noqa: BLE001 - a state not saved is read again later, nothing else
                log.warning("the documents' state was not saved", exc_info=True)
        cache.before_chunk(prefill, end - start)
        result.compacted_during_prefill = prefill.compacted
        chunk_ids = torch.tensor([ids[start:end]], device=device)
        logits = adapter.forward(model, chunk_ids, cache, score_window=cache.chunk_window(prefill, last),
                                 prefill=True, question=last and plan.question_tokens > 0)  # window capped at the chunk
        result.prefilled = end
        yield PrefillProgress(end, total)
    return logits  # the caller runs cache.finish_prefill once the first reply token is out


def _chunk_bounds(total: int, chunk: int, question_tokens: int) -> list[tuple[int, int]]:
    """Chunk [0, total); the final chunk holds the whole question (so one forward scores with all of it)."""
    if total == 0:
        return []
    tail = min(total, max(question_tokens, 1))
    head_end = total - tail if question_tokens else total
    bounds = [(s, min(s + chunk, head_end)) for s in range(0, head_end, chunk)]
    if question_tokens:
        if tail > chunk:
            bounds += [(s, min(s + chunk, total)) for s in range(head_end, total, chunk)]
        elif bounds and total - bounds[-1][0] <= chunk:
            bounds[-1] = (bounds[-1][0], total)  # the question fits beside the last document piece: one forward less
        else:
            bounds.append((head_end, total))
    return bounds


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def _stats(cache, plan, result, started, prefill_done, first_token_at, decoded_at, ended,
           compaction_before, prompt_tokens) -> TurnStats:
    prefill_done = prefill_done or ended
    prefill_s = max(prefill_done - started, 1e-9)
    decode_tokens = len(result.generated)
    # from the first token shown to the last one decoded (the cache's work after the question, where it runs after
    # the first token is shown, is in it; the turn's compaction after the last one is not: compaction_s has it)
    decode_s = decoded_at - (first_token_at or decoded_at)
    cstats = cache.stats()
    return TurnStats(
        ttft_s=(first_token_at or ended) - started,
        prefill_tokens=result.prefilled,
        prefill_tok_s=result.prefilled / prefill_s,
        decode_tokens=decode_tokens,
        decode_tok_s=(decode_tokens - 1) / decode_s if decode_tokens > 1 and decode_s > 0 else 0.0,
        total_s=ended - started,
        tokens_seen=cstats.tokens_seen,
        prompt_tokens=prompt_tokens,
        kv_stored_tokens=cstats.stored,
        kv_stored_bytes=cstats.stored_bytes,
        kv_uncompressed_bytes=cstats.uncompressed_bytes,
        compaction_s=cache.compaction_seconds - compaction_before,
        csa2_recall=cstats.csa2_recall,
        recall_s=cache.recall_seconds if plan.question_tokens else 0.0,
        recalled_entries=cache.recalled if plan.question_tokens else 0,
    )
