"""engine.heat: which tokens of a document the cache holds hot, found in the transcript by its tokens, each mapped to
its characters in the document's text."""

from __future__ import annotations

import pytest

from engine.documents import Document
from engine.errors import BusyError


def _model(tiny_folder, **knobs):
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0,
                                                  **knobs))


def _document(name: str, text: str) -> Document:
    return Document(name=name, path=name, kind="txt", text=text, pages=None, chars=len(text))


def _hot(cache, position: int) -> float:
    """The share of (layer, head) slots holding `position`, counted here from the layers' own positions."""
    slots = held = 0
    for layer in cache.layers:
        for head in range(cache.kv_heads):
            slots += 1
            held += position in set(layer.positions[head, : layer.length].tolist())
    return held / slots


@pytest.fixture(scope="module")
def chat(tiny_folder):
    """A tiered chat at ratio 0.3 that read two documents in two turns (the second with </document> in it)."""
    model = _model(tiny_folder, kv_cache_ratio=0.3, cold_tier="ram")
    session = model.chat_session()
    first = _document("items.txt", " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(40)))
    second = _document("notes.txt", "Notes.\nA tag </document> inside the file, then more text: the fact is 42.")
    list(session.send("What is the value of item 3?", [first], max_new_tokens=4, greedy=True))
    list(session.send("And the fact?", [second], max_new_tokens=4, greedy=True))
    return model, session, first, second


def test_each_token_of_a_read_document_maps_to_its_characters_and_its_hot_share(chat):
    model, session, first, _ = chat
    heat = session.document_heat(first.text)
    assert heat is not None and heat.tokens > 100 and heat.cold_tier == "ram" and heat.ratio == 0.3
    tokenizer = model.tokenizer
    ids = session.transcript_ids
    inside = [(j, span) for j, span in enumerate(heat.spans) if 2 <= j < heat.tokens - 2]
    for j, (start, end, share) in inside:
        # the token at that cache position is the text at those characters (ASCII: byte-level tokens decode exactly)
        assert tokenizer.decode([ids[heat.first_position + j]]) == first.text[start:end]
        assert share == pytest.approx(_hot(session.cache, heat.first_position + j))
    assert [s for s, _, _ in heat.spans] == sorted(s for s, _, _ in heat.spans)
    shares = [share for _, _, share in heat.spans]
    assert min(shares) < 0.5 < max(shares)  # at 0.3 part of it is hot and part cold
    assert heat.hot_share == pytest.approx(sum(shares) / len(shares))
    levels = heat.levels((0.1, 0.5, 0.9))
    assert levels[0][0] == heat.spans[0][0] and levels[-1][1] == heat.spans[-1][1]
    assert all(a[2] != b[2] for a, b in zip(levels, levels[1:], strict=False))  # adjacent runs differ


def test_a_defused_closing_tag_keeps_the_characters_of_the_documents_own_text(chat):
    model, session, _, second = chat
    heat = session.document_heat(second.text)
    assert heat is not None
    after = second.text.index(" inside")
    tail = [(j, s, e) for j, (s, e, _) in enumerate(heat.spans) if s >= after and j < heat.tokens - 1]
    assert tail
    for j, start, end in tail:  # the block reads "<\\/document>": one character more before these tokens
        assert model.tokenizer.decode([session.transcript_ids[heat.first_position + j]]) == second.text[start:end]


def test_a_text_the_chat_has_not_read_has_no_heat_and_a_looser_ratio_holds_more(tiny_folder):
    model = _model(tiny_folder, kv_cache_ratio=0.2, cold_tier="ram")
    session = model.chat_session()
    doc = _document("items.txt", " ".join(f"Row {i} holds {i * 3} apples." for i in range(60)))
    assert session.document_heat(doc.text) is None  # nothing read yet
    list(session.send("How many apples in row 5?", [doc], max_new_tokens=4, greedy=True))
    assert session.document_heat("A text this chat never saw, long enough to look for in it.") is None
    tight = session.document_heat(doc.text)
    model.reconfigure(session, kv_cache_ratio=0.6)  # the cold tier holds everything: loosening recalls from it
    loose = session.document_heat(doc.text)
    assert loose.ratio == 0.6 and loose.hot_share > tight.hot_share
    model.reconfigure(session, kv_cache_ratio=1.0)
    assert session.document_heat(doc.text).hot_share == 1.0


def test_heat_is_refused_while_a_reply_runs(tiny_folder):
    model = _model(tiny_folder)
    session = model.chat_session()
    turn = session.send("Hello there", max_new_tokens=8, greedy=True)
    next(turn)
    with pytest.raises(BusyError):
        session.document_heat("Hello there")
    list(turn)


def test_the_terminal_strip_shows_where_the_hot_part_is():
    from engine.heat import DocumentHeat

    text_length = 100
    spans = tuple((i, i + 10, 1.0 if i < 50 else 0.0) for i in range(0, 100, 10))
    heat = DocumentHeat(spans, 0.5, 10, 0, "disk", 0.3)
    assert heat.strip(text_length, width=10) == "█" * 5 + " " * 5
    assert heat.strip(text_length, width=20) == "█" * 10 + " " * 10  # a column without a token start: as before it
    assert heat.summary() == "50% of its 10 tokens hot (cache ratio 0.30); the rest in the cold tier on disk"
    half = DocumentHeat(((0, 100, 0.5),), 0.5, 1, 0, "off", 0.3)
    assert half.strip(text_length, width=4) == "▄▄▄▄" and "discarded" in half.summary()


def _share_of(session, text: str, piece: str) -> float:
    """The hot share of the tokens of `piece` inside the document `text` (engine.heat over the whole text)."""
    heat = session.document_heat(text)
    at = text.index(piece)
    shares = [share for start, end, share in heat.spans if start < at + len(piece) and end > at]
    return sum(shares) / len(shares)


@pytest.mark.parametrize("mode,threshold", [("evict", 0.0), ("evict", 1.0), ("merge", 0.0)])
def test_a_compaction_keeps_pinned_positions_whatever_their_rank(mode, threshold):
    from tests.engine.test_cold_tier import _cache, _read

    def held(cache, start, end):
        return [sum(1 for p in layer.positions[h, : layer.length].tolist() if start <= p < end)
                for layer in cache.layers for h in range(cache.kv_heads)]

    caches = []
    for pinned in ((), ((40, 46),)):
        cache = _cache(kv_cache_ratio=0.2, ced_mode=mode, ced_threshold=threshold)
        _read(cache, 120, seed=3)
        cache.pinned = pinned
        cache.compact()
        caches.append(cache)
    assert min(held(caches[0], 40, 46)) < 6  # ranked out without the pin
    assert held(caches[1], 40, 46) == [6] * 4  # every head of every layer holds the pinned six
    assert caches[1].stored <= caches[1].budget()


def test_a_pinned_piece_stays_hot_through_later_turns_and_comes_back_from_the_cold_tier(tiny_folder):
    model = _model(tiny_folder, kv_cache_ratio=0.2, cold_tier="ram")
    session = model.chat_session()
    lines = [f"Line {i}: the value of item {i} is {i * 7}." for i in range(45)]
    doc = _document("items.txt", " ".join(lines))
    piece = "Line 7: the value of item 7 is 49."
    list(session.send("What is the value of item 30?", [doc], max_new_tokens=4, greedy=True))
    assert _share_of(session, doc.text, piece) < 1.0  # partly cold
    assert session.set_pins([piece]) == ()
    assert _share_of(session, doc.text, piece) == 1.0  # back from the cold tier at once
    for question in ["And item 40?", "And item 43?", "And item 3?"]:  # later questions about other parts
        list(session.send(question, max_new_tokens=4, greedy=True))
        assert _share_of(session, doc.text, piece) == 1.0
        assert session.cache.stored <= session.cache.budget()  # within the ratio: the pin takes its room
    assert session.set_pins(["no such words in any document here"]) == ("no such words in any document here",)
    assert session.pins == ["no such words in any document here"] and session.cache.pinned == ()


def test_pins_past_half_the_hot_set_are_refused_and_pins_survive_a_rebuild_and_a_fork(tiny_folder):
    from engine.errors import PinError

    model = _model(tiny_folder, kv_cache_ratio=0.2, cold_tier="ram")
    session = model.chat_session()
    doc = _document("items.txt", " ".join(f"Row {i} holds {i * 3} apples." for i in range(70)))
    list(session.send("How many apples in row 5?", [doc], max_new_tokens=4, greedy=True))
    with pytest.raises(PinError, match="room for"):
        session.set_pins([doc.text[: len(doc.text) // 2]])
    assert session.pins == [] and session.cache.pinned == ()  # nothing changed
    piece = "Row 40 holds 120 apples."
    session.set_pins([piece])
    model.reconfigure(session, kv_cache_ratio=0.25, ced_decay=0.9)  # a knob that needs the conversation read again
    assert _share_of(session, doc.text, piece) == 1.0
    other = session.fork()
    list(other.send("And row 70?", max_new_tokens=4, greedy=True))
    assert other.pins == [piece] and _share_of(other, doc.text, piece) == 1.0
    session.set_pins([])
    assert session.cache.pinned == ()


def test_a_pin_is_found_in_the_document_not_in_a_question_quoting_it(tiny_folder):
    model = _model(tiny_folder)
    session = model.chat_session()
    doc = _document("fact.txt", "The secret password of the lighthouse is MARMALADE.\n")
    list(session.send("What is the secret password of the lighthouse?", [doc], max_new_tokens=4, greedy=True))
    assert session.set_pins(["password of the lighthouse"]) == ()
    ((start, end),) = session.cache.pinned
    assert model.tokenizer.decode(session.transcript_ids[start:end]).strip() == "password of the lighthouse"
    question = session.fed_text.rindex("What is the secret")
    assert model.tokenizer.decode(session.transcript_ids[:end]) in session.fed_text[:question]  # inside the document


def test_a_tighter_ratio_keeps_the_first_pins_that_fit_and_the_rest_are_refused_until_it_is_raised(tiny_folder):
    from engine.errors import PinError

    model = _model(tiny_folder, kv_cache_ratio=0.4, cold_tier="ram")
    session = model.chat_session()
    doc = _document("items.txt", " ".join(f"Row {i} holds {i * 3} apples." for i in range(70)))
    list(session.send("How many apples in row 5?", [doc], max_new_tokens=4, greedy=True))
    first = "Row 10 holds 30 apples. Row 11 holds 33 apples. Row 12 holds 36 apples."
    second = "Row 50 holds 150 apples. Row 51 holds 153 apples. Row 52 holds 156 apples."
    session.set_pins([second, first])  # in this order: the first pinned is kept first
    pinned = session.cache.pinned
    assert len(pinned) == 2
    model.reconfigure(session, kv_cache_ratio=0.1)  # room for one of them, not both
    assert pinned[1][1] - pinned[1][0] <= session.cache.pin_room() < len(session.cache._covered(pinned))
    assert session.cache.pinned == pinned[:1]
    assert _share_of(session, doc.text, second) == 1.0
    assert session.cache.stored <= session.cache.budget()
    with pytest.raises(PinError):
        session.set_pins([second, first])


def test_pins_are_hot_while_a_reopened_or_regenerated_chat_answers(tiny_folder, tmp_path, monkeypatch):
    """A chat restored from its saved state (reopened after a restart, a regenerated or edited reply) has its pins
    hot from the reply's first token, not only after the turn."""
    from engine.events import TokenText
    from engine.heat import hot_share

    monkeypatch.setenv("DSV41_CONVERSATIONS_DIR", str(tmp_path / "conversations"))
    model = _model(tiny_folder, kv_cache_ratio=0.2, cold_tier="ram")
    text = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(48))
    piece = "Line 17: the value of item 17 is 119."
    session = model.chat_session()
    list(session.send("What is the value of item 40?", [_document("items.txt", text)], max_new_tokens=4,
                      greedy=True))
    session.set_pins([piece])
    (start, end), = session.cache.pinned
    list(session.send("And item 2?", max_new_tokens=4, greedy=True))

    def share_as_it_answers(chat, question):
        shares = []
        for event in chat.send(question, max_new_tokens=4, greedy=True):
            if isinstance(event, TokenText) and not shares:
                shares.append(float(hot_share(chat.cache)[start:end].mean()))
        return shares[0]

    reopened = model.chat_session()  # as the app reopens a chat: its messages, its pins, its saved state
    reopened.messages, reopened.pins = [dict(m) for m in session.messages], [piece]
    assert share_as_it_answers(reopened, "And item 44?") == 1.0
    assert reopened.last_stats.restored_context
    session.messages = session.messages[:-2]  # regenerate the last reply
    assert share_as_it_answers(session, "And item 2?") == 1.0


def test_a_piece_with_a_closing_tag_in_it_is_found_and_kept_hot(chat):
    _, session, _, second = chat
    piece = "A tag </document> inside the file"
    assert session.set_pins([piece]) == ()
    assert _share_of(session, second.text, piece) == 1.0
    session.set_pins([])


def test_pins_a_tighter_ratio_left_out_are_hot_again_when_it_is_loosened(tiny_folder):
    model = _model(tiny_folder, kv_cache_ratio=0.3, cold_tier="ram")
    text = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(48))
    first = "Line 5: the value of item 5 is 35. Line 6: the value of item 6 is 42."
    second = "Line 30: the value of item 30 is 210. Line 31: the value of item 31 is 217."
    session = model.chat_session()
    list(session.send("What is the value of item 20?", [_document("items.txt", text)], max_new_tokens=4,
                      greedy=True))
    session.set_pins([first, second])
    model.reconfigure(session, kv_cache_ratio=0.1)  # room for the first only
    assert len(session.cache.pinned) == 1 and _share_of(session, text, second) < 1.0
    model.reconfigure(session, kv_cache_ratio=0.3)
    assert len(session.cache.pinned) == 2
    assert _share_of(session, text, first) == 1.0 and _share_of(session, text, second) == 1.0


def test_a_repetitive_document_is_found_where_it_begins_not_one_period_late(tiny_folder):
    model = _model(tiny_folder, kv_cache_ratio=0.3, cold_tier="ram")
    text = "The river rose in spring and fell in autumn. " * 80 + "Only one line says the key is 4417."
    session = model.chat_session()
    list(session.send("Summarise this.", [_document("river.txt", text)], max_new_tokens=4, greedy=True))
    heat = session.document_heat(text)
    begins = session.fed_text.index(text)  # where the text begins, as characters of the transcript
    before = model.tokenizer.decode(session.transcript_ids[: heat.first_position + 2])
    assert begins <= len(before) <= begins + 12  # its first tokens, not a period (~10 tokens) later
    session.set_pins(["the key is 4417."])
    (start, end), = session.cache.pinned
    assert "4417" in model.tokenizer.decode(session.transcript_ids[start:end])
