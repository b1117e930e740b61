"""What our server answers about a conversation it keeps (engine.served), and engine.remote asking it as the app does:
the heat of a document the conversation sent (the same as a chat in this process holds), pieces kept hot now or
from the next turn on (`dsv41_pins`), the pieces not found, a pin past the cache's room refused, bad shapes 400s."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from engine.documents import Document
from engine.errors import PinError
from tests.serving import served_in_thread

ITEMS = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(48))
PIECE = "Line 17: the value of item 17 is 119."


@pytest.fixture(scope="module")
def served(tiny_folder):
    from engine import DSV41Config, DSV41Model

    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0,
                                                   kv_cache_ratio=0.3, cold_tier="ram"))
    with served_in_thread(model) as base:
        yield model, base


def _remote(base):
    from engine.remote import RemoteModel

    remote = RemoteModel.connect(base + "/v1")
    assert remote.ours
    return remote


def _share(heat, text: str, piece: str) -> float:
    at = text.index(piece)
    shares = [share for start, end, share in heat.spans if start < at + len(piece) and end > at]
    return sum(shares) / len(shares)


def _post(base, path, body):
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_heat_of_a_served_conversation_is_what_a_chat_here_holds(served):
    model, base = served
    doc = Document(name="items.txt", path="items.txt", kind="txt", text=ITEMS, pages=None, chars=len(ITEMS))
    remote = _remote(base)
    session = remote.chat_session()
    assert session.document_heat(ITEMS) is None  # nothing sent yet: the server holds no such conversation
    list(session.send("What is the value of item 3?", [doc], max_new_tokens=4, greedy=True))
    heat = session.document_heat(ITEMS)
    local = model.chat_session()  # the same turn in this process
    list(local.send("What is the value of item 3?", [doc], max_new_tokens=4, greedy=True))
    assert local.messages == session.messages
    here = local.document_heat(ITEMS)
    assert heat is not None and heat.tokens == here.tokens > 100 and heat.cold_tier == "ram" and heat.ratio == 0.3
    assert [s[:2] for s in heat.spans] == [s[:2] for s in here.spans]
    assert heat.hot_share == pytest.approx(here.hot_share, abs=0.05) and 0.0 < heat.hot_share < 1.0
    assert session.document_heat("A text this conversation never sent, long enough to look for.") is None
    # another conversation (its messages differ) is not this one
    other = remote.chat_session("Be brief.")
    other.messages = session.messages[:1]
    assert other.document_heat(ITEMS) is None
    remote.close()


def test_pieces_kept_hot_on_the_server_now_and_from_the_next_turn(served):
    _, base = served
    doc = Document(name="items.txt", path="items.txt", kind="txt", text=ITEMS, pages=None, chars=len(ITEMS))
    remote = _remote(base)
    session = remote.chat_session()
    list(session.send("What is the value of item 40?", [doc], max_new_tokens=4, greedy=True))
    assert session.set_pins([PIECE, "a sentence no document here holds"]) == ("a sentence no document here holds",)
    assert session.pins == [PIECE, "a sentence no document here holds"]
    for item in (2, 44, 30):  # questions about other parts: the piece stays hot in every (layer, head)
        list(session.send(f"And the value of item {item}?", max_new_tokens=4, greedy=True))
        assert _share(session.document_heat(ITEMS), ITEMS, PIECE) == 1.0
    with pytest.raises(PinError, match="room"):
        session.set_pins([ITEMS])  # the whole document: past the room the cache keeps for pins
    assert session.pins == [PIECE, "a sentence no document here holds"]  # unchanged, here and there
    list(session.send("And item 45?", max_new_tokens=4, greedy=True))
    assert _share(session.document_heat(ITEMS), ITEMS, PIECE) == 1.0
    session.set_pins([])
    list(session.send("And item 46?", max_new_tokens=4, greedy=True))
    assert _share(session.document_heat(ITEMS), ITEMS, PIECE) < 1.0  # unpinned: the cache chooses again

    fresh = remote.chat_session()  # pinned before its first question: sent with it (dsv41_pins)
    assert fresh.set_pins([PIECE]) == ()
    list(fresh.send("What is the value of item 40?", [doc], max_new_tokens=4, greedy=True))
    list(fresh.send("And the value of item 2?", max_new_tokens=4, greedy=True))
    assert _share(fresh.document_heat(ITEMS), ITEMS, PIECE) == 1.0
    remote.close()


def test_heat_and_pin_requests_of_a_bad_shape_are_400s_naming_the_field(served):
    _, base = served
    status, body = _post(base, "/v1/dsv41/heat", {"messages": "hello", "text": "x"})
    assert status == 400 and "messages" in body["error"]["message"]
    status, body = _post(base, "/v1/dsv41/heat", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "text" in body["error"]["message"]
    status, body = _post(base, "/v1/dsv41/pins", {"messages": [], "pins": "one piece"})
    assert status == 400 and "pins" in body["error"]["message"]
    status, body = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "dsv41_pins": [3]})
    assert status == 400 and "dsv41_pins" in body["error"]["message"]
    status, body = _post(base, "/v1/dsv41/heat", {"messages": [{"role": "user", "content": "never sent"}],
                                                  "text": "some text"})
    assert status == 200 and body == {"heat": None, "reason": "not_loaded"}


def test_a_heat_from_a_server_is_checked_not_trusted():
    from engine.heat import DocumentHeat

    heat = DocumentHeat(((0, 4, 1.0), (4, 9, 0.25)), 0.625, 2, 17, "disk", 0.2)
    assert DocumentHeat.from_dict(json.loads(json.dumps(heat.to_dict()))) == heat
    for bad in ({}, {**heat.to_dict(), "tokens": 3}, {**heat.to_dict(), "spans": [[0, 4, 1.5], [4, 9, 0.2]]},
                {**heat.to_dict(), "spans": "nope"}):
        with pytest.raises(ValueError, match="not a document's heat"):
            DocumentHeat.from_dict(bad)


def test_a_document_too_large_for_a_servers_context_is_said_to_be_the_document(served):
    from engine.errors import ContextOverflowError

    _, base = served
    text = " ".join([ITEMS] * 4)
    doc = Document(name="long.txt", path="long.txt", kind="txt", text=text, pages=None, chars=len(text))
    remote = _remote(base)
    with pytest.raises(ContextOverflowError) as refused:
        remote.chat_session().send("What is this about?", [doc], max_new_tokens=4)
    parts = refused.value.parts
    assert parts["documents"] > 1000 and parts["prompt"] < 40  # the question's few tokens, not the document's
    assert "Attach a shorter document" in str(refused.value) and "Shorten the message" not in str(refused.value)
    remote.close()


def test_a_served_prompts_reading_is_reported_to_a_client_that_asks(served):
    from engine.events import PrefillProgress

    _, base = served
    doc = Document(name="items.txt", path="items.txt", kind="txt", text=ITEMS, pages=None, chars=len(ITEMS))
    remote = _remote(base)
    events = list(remote.chat_session().send("What is the value of item 3?", [doc], max_new_tokens=4, greedy=True))
    read = [e for e in events if isinstance(e, PrefillProgress)]
    assert read and read[-1].done == read[-1].total > 500 and [e.done for e in read] == sorted(e.done for e in read)
    assert events.index(read[-1]) < next(i for i, e in enumerate(events) if type(e).__name__ == "TokenText")
    remote.close()
    # a client that did not ask gets no chunk without choices besides OpenAI's own usage chunk
    body = {"messages": [{"role": "user", "content": ITEMS + "\n\nWhat is the value of item 3?"}], "stream": True,
            "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [json.loads(line[5:]) for line in response.read().decode().splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert chunks and all(c["choices"] for c in chunks if "usage" not in c)
    assert not any("dsv41_progress" in c for c in chunks)
    status, refused = _post(base, "/v1/chat/completions", {**body, "dsv41_progress": "yes"})
    assert status == 400 and "dsv41_progress" in refused["error"]["message"]
