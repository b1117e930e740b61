"""The SQLite store: WAL, conversations and messages, streaming updates, history, export."""

from __future__ import annotations

import json
import sqlite3

from app.protocol import AttachedDocument
from app.store import ConversationStore


def test_store_lives_in_the_data_dir_with_wal(data_dir):
    store = ConversationStore()
    assert store.path.parent == data_dir
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_messages_attachments_history_and_export(data_dir):
    store = ConversationStore()
    conv = store.create_conversation("Python 问答")
    doc = AttachedDocument("k1", "notes.md", "/tmp/notes.md", "markdown", "# Notes\nThe answer is 42.", None, 24)
    user = store.add_user_message(conv, "What is the answer?", [(doc, 9)])
    reply = store.add_reply(conv, {"model": "FakeLM", "weight_quant": "int8", "device": "cpu",
                                   "knobs": {"kv_cache_ratio": 0.5}})
    store.update_reply(reply, "The answer")
    # Another connection sees the streamed text before the reply is finished.
    other = sqlite3.connect(store.path)
    assert other.execute("SELECT content, status FROM messages WHERE id=?", (reply,)).fetchone() == \
        ("The answer", "streaming")
    store.finish_reply(reply, "The answer is 42.", "done",
                       stats={"ttft_s": 0.25, "decode_tok_s": 31.5, "decode_tokens": 6, "compression_ratio": 0.5})
    store.set_model_content(user, "<document name=\"notes.md\">…</document>\n\nWhat is the answer?")

    history = store.history(conv)
    assert len(history) == 1 and history[0].reply == "The answer is 42."
    assert history[0].documents[0].text == doc.text and history[0].model_content.startswith("<document")
    assert store.messages(conv)[0].attachments[0].tokens == 9

    data = store.export_json(conv)
    json.dumps(data)
    assert data["title"] == "Python 问答"
    assert data["messages"][0]["attachments"][0]["name"] == "notes.md"
    assert data["messages"][1]["settings"]["weight_quant"] == "int8"
    assert data["messages"][1]["stats"]["decode_tok_s"] == 31.5
    md = store.export_markdown(conv)
    assert md.startswith("# Python 问答") and "TTFT 0.25 s · 31.5 tok/s · 6 tokens · KV ×0.50" in md
    assert "notes.md" in md and "int8" in md

    assert [c.title for c in store.conversations("answer is 42")] == ["Python 问答"]
    assert store.conversations("no such words") == []
    store.delete_messages_from(user)
    assert store.messages(conv) == []
    store.delete(conv)
    assert store.conversations() == []
    assert store.db.execute("SELECT COUNT(*) FROM attachments").fetchone()[0] == 0


def test_search_escapes_like_wildcards(data_dir):
    store = ConversationStore()
    store.create_conversation("100% sure")
    store.create_conversation("1000 things")
    assert [c.title for c in store.conversations("100%")] == ["100% sure"]


def test_the_reply_footer_says_how_the_context_was_had():
    from app.store import reply_footer

    base = {"ttft_s": 0.4, "decode_tok_s": 20.0, "decode_tokens": 8, "compression_ratio": 0.3}
    assert reply_footer(base) == "TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30"
    assert reply_footer({**base, "restored_context": True, "recall_s": 0.0123}).endswith(
        "KV ×0.30 · recalled in 12 ms · saved cache restored")
    assert reply_footer({**base, "rebuilt_context": True}).endswith("· conversation re-read")
