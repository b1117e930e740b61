"""Fault injection: a small random-weight Llama behind the real default model's tokenizer and chat template
(fast enough to fail every prefill chunk and decode step), and helpers that snapshot a chat session."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from engine import Done, DSV41Config, DSV41Model, ErrorEvent, TokenText

DOCUMENT = pydoc_data.topics.topics["assert"][:900]


@pytest.fixture(scope="session")
def chat_model(tiny_folder):
    """Prefill in 16-token chunks, so that a document turn has many points to fail at."""
    return DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=1024, prefill_chunk=16))


def new_session(model, ratio: float = 1.0, **knobs):
    from dataclasses import replace

    session = model.chat_session()
    session.cache.settings = replace(session.cache.settings, kv_cache_ratio=ratio, **knobs)
    return session


def turn(session, prompt: str, documents=(), **settings) -> tuple[Done | None, list]:
    settings = {"greedy": True, "max_new_tokens": 8, **settings}
    events = list(session.send(prompt, documents, **settings))
    done = next((e for e in events if isinstance(e, Done)), None)
    return done, events


def first_turn(session) -> None:
    """A turn with a document long enough (> the 128-entry floor) that ratio 0.5 compacts it."""
    from engine.documents import Document

    doc = Document("assert.txt", "/tmp/assert.txt", "text", DOCUMENT, None, len(DOCUMENT))
    turn(session, "What does assert do?", [doc])


def snapshot(session) -> dict:
    """Everything that decides the next turn: tokens seen, the transcript, the messages, every stored entry."""
    layers = []
    with torch.inference_mode():
        for layer in session.cache.layers:
            n = layer.length
            layers.append((n, layer.keys[:, :n].clone(), layer.values[:, :n].clone(),
                           layer.positions[:, :n].clone(), layer.scores[:, :n].clone(),
                           layer.log_counts[:, :n].clone()))
    return {"seen": session.cache.seen, "ids": list(session.transcript_ids), "text": session.fed_text,
            "messages": [dict(m) for m in session.messages], "layers": layers,
            "compactions": session.cache.compactions}


def same_state(a: dict, b: dict) -> bool:
    if {k: v for k, v in a.items() if k != "layers"} != {k: v for k, v in b.items() if k != "layers"}:
        return False
    return all(x[0] == y[0] and all(torch.equal(p, q) for p, q in zip(x[1:], y[1:], strict=True))
               for x, y in zip(a["layers"], b["layers"], strict=True))


def reply_text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenText))


def errors(events) -> list[ErrorEvent]:
    return [e for e in events if isinstance(e, ErrorEvent)]


def agrees(session) -> bool:
    """The cache holds exactly the transcript's tokens, and the transcript is the text recorded as fed (or
    the session knows it must re-read the conversation). `session.consistent` says more: no re-read needed."""
    if session.cache.seen != len(session.transcript_ids):
        return False
    if session._dirty:
        return True
    decoded = session.tokenizer.decode(session.transcript_ids, skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
    return decoded == session.fed_text
