"""However a turn ends -- stopped, out of memory, an error, the generator closed, Ctrl-C -- the cache and the
transcript agree afterwards, and the next turn answers as a session that never met the fault.

A turn stopped before its prompt was read is undone exactly (the state equals the one before it). A turn stopped
while replying keeps the reply shown so far, and equals a session that asked for exactly that many tokens."""

from __future__ import annotations

import threading

import pytest

from engine import Done, PrefillProgress, TokenText
from engine.models import adapter

from .conftest import agrees, first_turn, new_session, same_state, snapshot, turn

QUESTION = "Summarise it in one line."
FOLLOW_UP = "And what happens when optimisation is on?"
LONG_PROMPT = "Please read this carefully. " + "The quick brown fox jumps over the lazy dog. " * 12


def reference(model, ratio, *, second: dict | None = None):
    """The follow-up's reply in a session that had turn 1, optionally a clean turn 2, then the follow-up."""
    session = new_session(model, ratio)
    first_turn(session)
    if second is not None:
        turn(session, LONG_PROMPT, **second)
    done, _ = turn(session, FOLLOW_UP)
    return done.text, snapshot(session)


def prefill_chunks(model) -> int:
    session = new_session(model)
    first_turn(session)
    _, events = turn(session, LONG_PROMPT)
    return sum(1 for e in events if isinstance(e, PrefillProgress)) - 1


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_stop_at_every_prefill_chunk_undoes_the_turn_exactly(chat_model, ratio):
    expected, _ = reference(chat_model, ratio)
    chunks = prefill_chunks(chat_model)
    assert chunks >= 4
    for stop_after in range(-1, chunks):  # before the first chunk .. after the last (before any reply text)
        session = new_session(chat_model, ratio)
        first_turn(session)
        before = snapshot(session)
        cancel = threading.Event()
        seen_progress = 0
        events = []
        for event in session.send(LONG_PROMPT, cancel=cancel, greedy=True, max_new_tokens=8):
            events.append(event)
            if isinstance(event, PrefillProgress):
                if seen_progress == stop_after + 1:
                    cancel.set()
                seen_progress += 1
        assert events[-1].reason == "cancelled"
        if stop_after == chunks - 1 and ratio < 1.0:
            # read to the end and compacted (the question scored the document), then stopped before any
            # reply: the compaction cannot be undone in place, so the next turn restores the cache saved after
            # the first turn (engine.conversation_store), exactly the state from before this one
            assert not session.consistent and len(session.messages) == len(before["messages"])
            done, _ = turn(session, FOLLOW_UP)
            assert done.stats.restored_context and not done.stats.rebuilt_context
            fresh = new_session(chat_model, ratio)
            fresh.messages = before["messages"]
            assert done.text == turn(fresh, FOLLOW_UP)[0].text
            continue
        assert same_state(snapshot(session), before), f"stopped after chunk {stop_after}"
        assert session.consistent
        done, _ = turn(session, FOLLOW_UP)
        assert not done.stats.rebuilt_context
        assert done.text == expected


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("failure", [MemoryError, RuntimeError])
def test_a_failure_at_every_forward_of_the_prompt_undoes_the_turn(chat_model, monkeypatch, ratio, failure):
    expected, _ = reference(chat_model, ratio)
    real = adapter.forward
    chunks = prefill_chunks(chat_model)
    for fail_at in range(chunks):
        session = new_session(chat_model, ratio)
        first_turn(session)
        before = snapshot(session)
        calls = {"n": 0}

        def forward(*args, fail_at=fail_at, calls=calls, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_at + 1:
                raise failure("CUDA out of memory (injected)" if failure is RuntimeError else "injected")
            return real(*args, **kwargs)

        monkeypatch.setattr(adapter, "forward", forward)
        done, events = turn(session, LONG_PROMPT)
        monkeypatch.setattr(adapter, "forward", real)
        assert done.reason == "error"
        assert any(getattr(e, "kind", None) == "oom" for e in events)
        assert same_state(snapshot(session), before)
        assert session.consistent
        done, _ = turn(session, FOLLOW_UP)
        assert done.text == expected


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_a_failure_inside_a_layer_of_a_prefill_chunk_is_undone(chat_model, monkeypatch, ratio):
    """The chunk fails after layer 0 appended its keys: the forward is undone, then the whole turn."""
    from engine.cache.kv_cache import DSV41Cache

    expected, _ = reference(chat_model, ratio)
    real = DSV41Cache.attend
    for fail_at_chunk in (0, 2):
        session = new_session(chat_model, ratio)
        first_turn(session)
        before = snapshot(session)
        state = {"chunk": -1}

        def attend(self, layer_idx, query, *args, fail_at_chunk=fail_at_chunk, state=state):
            if layer_idx == 0 and query.shape[2] > 1:
                state["chunk"] += 1
            if layer_idx == 1 and state["chunk"] == fail_at_chunk:
                raise MemoryError("injected in layer 1")
            return real(self, layer_idx, query, *args)

        monkeypatch.setattr(DSV41Cache, "attend", attend)
        done, _ = turn(session, LONG_PROMPT)
        monkeypatch.setattr(DSV41Cache, "attend", real)
        assert done.reason == "error"
        assert same_state(snapshot(session), before)
        done, _ = turn(session, FOLLOW_UP)
        assert done.text == expected


def test_a_failure_at_every_decode_step_keeps_what_was_shown(chat_model, monkeypatch):
    """Out of memory at decode step k keeps the k tokens shown; the state then equals a session whose reply
    was cut at k tokens by max_new_tokens (ratio 1.0: nothing else differs)."""
    real = adapter.forward_token  # every decode step of a turn (fused on the CPU or not)
    for fail_at_step in range(1, 7):
        session = new_session(chat_model)
        first_turn(session)
        calls = {"decode": 0}

        def forward_token(model, token, cache, *args, fail_at_step=fail_at_step, calls=calls, **kwargs):
            calls["decode"] += 1
            if calls["decode"] == fail_at_step:
                raise MemoryError("injected")
            return real(model, token, cache, *args, **kwargs)

        monkeypatch.setattr(adapter, "forward_token", forward_token)
        done, events = turn(session, LONG_PROMPT, ignore_eos=True, max_new_tokens=12)
        monkeypatch.setattr(adapter, "forward_token", real)
        assert done.reason == "error" and len(done.token_ids) == fail_at_step
        assert agrees(session)
        expected_text, expected_state = reference(chat_model, 1.0,
                                                  second={"ignore_eos": True, "max_new_tokens": fail_at_step})
        follow, _ = turn(session, FOLLOW_UP)
        assert follow.text == expected_text
        assert same_state(snapshot(session), expected_state)


@pytest.mark.parametrize("where", ["step", "layer"])
def test_a_failure_inside_the_fused_decode_step_keeps_what_was_shown(chat_model, monkeypatch, where):
    """Out of memory inside the CPU's fused decode step 3, after the cache began the token: in the step's call
    ("step"), or in its second layer with an int8 cache, whose layers the cache's own Python appends to and attends
    from inside the C step ("layer": the first layer has its entry by then, and adapter.forward_token must undo it).
    The turn keeps its 3 tokens and the next turn answers as a session whose reply was cut there."""
    from engine.cache import DSV41Cache

    decoder = adapter.runtime(chat_model.hf_model).decoder
    if decoder is None or decoder.fused is None:
        pytest.skip("no fused CPU decode step here (no C compiler)")
    knobs = {"kv_cache_dtype": "int8"} if where == "layer" else {}
    calls = {"steps": 0, "layers": 0}
    real_step, real_attend = decoder.fused.step, DSV41Cache.attend

    def step(*args, **kwargs):
        calls["steps"] += 1
        if calls["steps"] == 3 and where == "step":
            raise MemoryError("injected")
        return real_step(*args, **kwargs)

    def attend(self, index, query, *args, **kwargs):
        if query.shape[2] == 1 and calls["steps"] == 3 and index == 1:
            raise MemoryError("injected")
        return real_attend(self, index, query, *args, **kwargs)

    session = new_session(chat_model, 1.0, **knobs)
    first_turn(session)
    monkeypatch.setattr(decoder.fused, "step", step)
    monkeypatch.setattr(DSV41Cache, "attend", attend)
    done, events = turn(session, LONG_PROMPT, ignore_eos=True, max_new_tokens=12)
    monkeypatch.undo()
    assert calls["steps"] == 3 and done.reason == "error" and len(done.token_ids) == 3
    assert any(getattr(e, "kind", None) == "oom" for e in events)
    assert agrees(session)
    assert [layer.length for layer in session.cache.layers] == [session.cache.seen] * len(session.cache.layers)
    cut = new_session(chat_model, 1.0, **knobs)
    first_turn(cut)
    turn(cut, LONG_PROMPT, ignore_eos=True, max_new_tokens=3)
    expected, _ = turn(cut, FOLLOW_UP)
    follow, _ = turn(session, FOLLOW_UP)
    assert follow.text == expected.text
    assert same_state(snapshot(session), snapshot(cut))


def closing_points(chat_model) -> int:
    session = new_session(chat_model)
    first_turn(session)
    return len(list(session.send(LONG_PROMPT, greedy=True, max_new_tokens=6, ignore_eos=True)))


@pytest.mark.parametrize("how", ["close", "interrupt"])
def test_an_abandoned_turn_leaves_cache_and_transcript_consistent(chat_model, monkeypatch, how):
    """The generator closed (or Ctrl-C in the consumer) after any event: what was fed is recorded, nothing
    else; the next turn equals a session that never met the fault."""
    for stop_at in range(closing_points(chat_model) - 1):
        session = new_session(chat_model)
        first_turn(session)
        before = snapshot(session)
        prompt_tokens = len(session.prepare(LONG_PROMPT).new_ids)
        stream = session.send(LONG_PROMPT, greedy=True, max_new_tokens=6, ignore_eos=True)
        shown = ""
        try:
            for index, event in enumerate(stream):
                if isinstance(event, TokenText):
                    shown += event.text
                if index == stop_at:
                    if how == "interrupt":
                        raise KeyboardInterrupt
                    stream.close()
                    break
        except KeyboardInterrupt:
            stream.close()  # what a REPL does with the generator it was iterating
        assert not session.busy
        assert agrees(session), f"stopped at event {stop_at}"
        if len(session.messages) == len(before["messages"]):  # stopped before the prompt was read: undone
            assert same_state(snapshot(session), before)
            expected, _ = reference(chat_model, 1.0)
        else:
            assert session.messages[-1] == {"role": "assistant", "content": shown}
            fed = len(session.transcript_ids) - len(before["ids"]) - prompt_tokens
            assert 0 <= fed <= 6
            # a session whose reply was cut right there feeds the same tokens
            expected, _ = reference(chat_model, 1.0, second={"ignore_eos": True, "max_new_tokens": fed + 1})
        messages = [dict(m) for m in session.messages]
        follow, _ = turn(session, FOLLOW_UP)
        if follow.stats.rebuilt_context:  # the text shown differs from what was fed (a held-back character)
            fresh = new_session(chat_model)
            fresh.messages = messages
            expected = turn(fresh, FOLLOW_UP)[0].text
        assert follow.text == expected, f"stopped at event {stop_at}"


def test_ctrl_c_inside_a_forward_is_undone(chat_model, monkeypatch):
    """KeyboardInterrupt raised in the middle of a decode forward (a REPL's Ctrl-C lands anywhere)."""
    real = adapter.forward_token
    session = new_session(chat_model)
    first_turn(session)
    calls = {"decode": 0}

    def forward_token(model, token, cache, *args, **kwargs):
        calls["decode"] += 1
        if calls["decode"] == 3:
            raise KeyboardInterrupt
        return real(model, token, cache, *args, **kwargs)

    monkeypatch.setattr(adapter, "forward_token", forward_token)
    with pytest.raises(KeyboardInterrupt):
        turn(session, LONG_PROMPT, ignore_eos=True, max_new_tokens=10)
    monkeypatch.setattr(adapter, "forward_token", real)
    assert not session.busy and agrees(session)
    done, _ = turn(session, FOLLOW_UP)
    assert isinstance(done, Done) and done.reason in ("eos", "length")


def test_a_cancelled_rebuild_leaves_a_usable_session(chat_model):
    """A rebuild (the messages changed under the session) stopped part-way: the next turn rebuilds again and
    answers as a fresh session with the same messages."""
    session = new_session(chat_model)
    first_turn(session)
    turn(session, "Second question?")
    session.messages[1] = {"role": "user", "content": "An edited first question"}
    cancel = threading.Event()
    for event in session.send(LONG_PROMPT, cancel=cancel, greedy=True):
        if isinstance(event, PrefillProgress) and event.done > 0:
            cancel.set()
    assert agrees(session)
    done, _ = turn(session, FOLLOW_UP)
    fresh = new_session(chat_model)
    fresh.messages = [dict(m) for m in session.messages[:-2]]
    assert done.text == turn(fresh, FOLLOW_UP)[0].text
