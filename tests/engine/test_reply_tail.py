"""A reply's last tokens that its message does not keep (the start of a stop string of several tokens) leave the cache
with the reply's turn: the next turn reads only its own tokens (and that tail, as text), instead of re-reading the
whole conversation. The choice of tokens is also right for a character whose last bytes were never fed."""

from __future__ import annotations

import pytest

from engine import chat_template as template
from engine.documents import Document

ITEMS = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(30))


@pytest.fixture(scope="module")
def model(tiny_folder):
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0,
                                                  kv_cache_ratio=0.3, cold_tier="ram", conversation_cache_mb=0))


def _chat(model, **settings):
    session = model.chat_session()
    doc = Document(name="items.txt", path="items.txt", kind="txt", text=ITEMS, pages=None, chars=len(ITEMS))
    done = list(session.send("What is the value of item 3?", [doc], max_new_tokens=16, greedy=True,
                             ignore_eos=True, **settings))[-1]
    return session, done


def test_a_stop_string_of_several_tokens_leaves_the_next_turn_reading_only_its_own(model):
    _, plain = _chat(model)
    ids = list(plain.token_ids)
    stop = model.tokenizer.decode(ids[6:9])  # three tokens of the reply, met again after the reply's start
    assert len(model.tokenizer(stop, add_special_tokens=False)["input_ids"]) >= 2
    session, done = _chat(model, stop=[stop])
    assert done.reason == "stop" and stop not in session.messages[-1]["content"]
    assert session.consistent and session.cache.seen == len(session.transcript_ids)
    follow = list(session.send("And item 4?", max_new_tokens=4, greedy=True))[-1]
    assert not follow.stats.rebuilt_context
    assert follow.stats.prefill_tokens < 40  # the question (and the reply's tail), not the document again


def test_the_tokens_kept_are_those_whose_text_begins_the_reply(model):
    tokenizer = model.tokenizer
    ids = tokenizer("你好世界", add_special_tokens=False)["input_ids"]  # byte-level: 界 takes three tokens
    fed = ids[:-1]  # a reply cut by its length inside 界: its text ends in "�", the message in "世"
    assert tokenizer.decode(fed).endswith("\ufffd")
    keep = template.reply_tokens_kept(tokenizer, fed, "你好世")
    assert tokenizer.decode(fed[:keep]) == "你好世"
    assert template.reply_tokens_kept(tokenizer, ids, "你好世界") == len(ids)  # all of it: nothing to give up
    words = tokenizer("Paris is the capital of France", add_special_tokens=False)["input_ids"]
    assert template.reply_tokens_kept(tokenizer, words, "Paris is the cap") == \
        len(tokenizer("Paris is the", add_special_tokens=False)["input_ids"])


def test_the_cache_forgets_its_last_positions_only_where_they_are_its_last_entries(model):
    session, _ = _chat(model)
    cache = session.cache
    seen = cache.seen
    assert cache.forget_last(3) and cache.seen == seen - 3
    assert all(int(layer.positions[:, : layer.length].max()) == seen - 4 for layer in cache.layers)
    assert not cache.forget_last(seen)  # most of it is cold, or gone from the hot set: nothing changes
    assert cache.seen == seen - 3
