"""A chat's cache saved after each turn, and after a turn's documents before its question, and restored instead of
re-reading the conversation (engine.conversation_store keeps the files; engine.cache.persist turns a cache into
tensors and back). ChatSession calls these."""

from __future__ import annotations

import logging
import threading
import time

from . import chat_template as template

log = logging.getLogger(__name__)

HEAD_MIN = 512  # tokens before a turn's question worth a state of their own (save_head)


def save(session) -> None:
    """Save the chat's cache as it stands after a turn; a failure is logged, never raised (the chat goes on)."""
    from .cache import persist

    _finish_head(session)
    store = session.model.conversation_store
    if store is None or session._dirty or session.cache.seen != len(session.transcript_ids):
        return
    started = time.perf_counter()
    try:
        tensors, facts = persist.save_state(session.cache)
        _write(session, session.cache.settings, session.fed_text, session.fed_specials, session.transcript_ids,
               tensors, facts)
    except Exception as exc:  # noqa: BLE001 - a cache that was not saved is re-read later, nothing is lost
        log.warning("the conversation cache was not saved: %s", str(exc).splitlines()[0] if str(exc) else exc)
    session.last_save_seconds = time.perf_counter() - started


def save_head(session, turn, question_at: int | None, read: int) -> None:
    """A turn's documents (and the history it re-reads) read up to the chunk that holds its question (`read` of its
    new tokens; the rest of them, `pending`, are read with the question, as they were in this turn): the cache saved
    there, so that regenerating the reply, editing the question, or asking about the same documents in a new chat
    with the same start reads only those and the question. The tensors are copied now (the question's forward goes
    on appending to the cache) and written on a thread of their own; the turn's own save waits for it.
    `question_at`: the previous question's position, as it was before this turn."""
    from .cache import persist

    store = session.model.conversation_store
    text = session.fed_text + turn.delta_text[: turn.head_chars]
    ids = list(session.transcript_ids) + list(turn.new_ids[:read])
    if store is None or session.cache.seen != len(ids) or not 0 < read <= turn.head:
        return
    tensors, facts = persist.save_state(session.cache)
    if session.cache.device.type == "cpu":  # copies of their own: a slice that was contiguous already is the cache's
        # memory, which the question's forward goes on updating (scores, query moments) while the thread writes (from
        # a GPU, .cpu() has copied them)
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    facts["question_at"] = question_at
    facts["turn_from"] = len(session.transcript_ids)  # where this turn's tokens begin (its repetition window)
    facts["pending"] = [int(i) for i in turn.new_ids[read:turn.head]]  # its tokens before the question not read yet
    settings = session.cache.settings
    specials = turn.rendered.specials_before(len(text))

    def write():
        try:
            _write(session, settings, text, specials, ids, tensors, facts)
        except Exception as exc:  # noqa: BLE001 - not saved: read again when asked again, nothing else
            log.warning("the documents' state was not saved: %s", exc)

    _finish_head(session)
    session._head_save = threading.Thread(target=write, name="save-documents-state", daemon=True)
    session._head_save.start()


def _write(session, settings, text: str, specials, ids: list[int], tensors: dict, facts: dict) -> None:
    """One state into the chat's store, found later by the model, the settings it was made under and its text."""
    session.model.conversation_store.save(
        model_key=session.model.state_key, settings_key=session.model.settings_key(settings), text=text,
        specials=specials, transcript_ids=ids, tensors=tensors, cache_facts=facts, layout_key=layout_key(settings),
        knobs=_held_knobs(settings))


def _finish_head(session) -> None:
    """Wait for a documents' state still being written (one store write at a time)."""
    if session._head_save is not None:
        session._head_save.join()
        session._head_save = None


def restore(session, rendered: template.Rendered) -> bool:
    """Instead of re-reading the conversation: restore the longest saved state that `rendered` starts with (same
    model and settings) into the chat's cache. A state that cannot be read or does not fit is refused (and removed)."""
    from .cache import persist

    store = session.model.conversation_store
    if store is None:
        return False
    cache = session.cache
    current = cache.settings
    model_key, settings_key = session.model.state_key, session.model.settings_key(current)
    for _ in range(3):  # a refused file is removed; the next best may still do
        found = store.find(model_key=model_key, settings_key=settings_key, rendered=rendered,
                           layout_key=layout_key(current))
        if found is None:
            return False
        saved = store.load(found)
        if saved is None:
            continue
        n = int(saved.facts["text_len"])
        try:
            # made under other budget knobs (the ratio moved since): read as it was made, then the knobs applied to
            # it as a live change is (looser: recalled from its cold tier; tighter: compacted)
            cache.settings = current if found.facts["settings"] == settings_key else current.replace(
                **saved.facts["knobs"])
            cache.reset()
            persist.load_state(cache, saved.tensors, saved.facts["cache"])
            if cache.seen != len(saved.transcript_ids):
                raise persist.StateMismatch("its token count and its cache disagree")
            if cache.settings != current and cache.apply(current) == "needs_rebuild":
                raise persist.StateMismatch("the settings it was made under keep less than these need")
        except (persist.StateMismatch, KeyError, TypeError, ValueError) as exc:
            log.warning("refused the saved conversation cache %s: %s", found.path.name, exc)
            store.discard(found.path)
            cache.settings = current
            cache.reset()
            continue
        session.transcript_ids = list(saved.transcript_ids)
        turn_from = saved.facts["cache"].get("turn_from")  # a state saved inside a turn, after its documents
        session.lead = [] if turn_from is None else session.transcript_ids[int(turn_from):]
        session.pending = [int(i) for i in saved.facts["cache"].get("pending") or []]
        session.fed_text = rendered.text[:n]
        session.fed_specials = tuple(tuple(int(x) for x in span) for span in saved.facts["specials"])
        session._dirty = False
        return True
    return False


def _held_knobs(settings) -> dict:
    """The knobs that shape what a saved state holds (the live ones aside): the settings it was made under."""
    import dataclasses

    from .config import KNOBS, LIVE

    return {k: v for k, v in dataclasses.asdict(settings).items() if KNOBS[k].applies != LIVE}


def layout_key(settings) -> str:
    """What a saved state holds, but for how much of it is hot: its held knobs without those that move the budget
    (the ratio, the threshold, the protected windows). With the cold tier on, a state made under other values of
    those is restored and the current ones applied to it, as a live change of the knobs would (a looser ratio
    recalls from the tier): a chat whose ratio moved since its last turn is not re-read to regenerate or reopen.
    With the cold tier off a looser ratio has nothing to recall from: '' (no such states)."""
    from .config import KNOBS
    from .conversation_store import key_of

    if settings.cold_tier == "off":
        return ""
    return key_of({k: v for k, v in _held_knobs(settings).items() if KNOBS[k].looser not in ("up", "down")})
