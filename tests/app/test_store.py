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


def test_how_a_reply_ended_is_kept_with_it_and_said_again(data_dir):
    from app.store import reply_footer

    store = ConversationStore()
    conv = store.create_conversation("Endings")
    stats = {"ttft_s": 0.4, "decode_tok_s": 20.0, "decode_tokens": 8, "compression_ratio": 0.3}
    endings = (("length", "done"), ("context_full", "done"), ("cancelled", "stopped"), ("eos", "done"),
               ("error", "error"))
    for reason, status in endings:
        _, reply = store.add_turn(conv, f"ends with {reason}")
        store.finish_reply(reply, "An answer", status, stats=stats, finish_reason=reason)
    store.close()

    again = ConversationStore()  # as after a restart
    replies = [m for m in again.messages(conv) if m.role == "assistant"]
    assert [m.finish_reason for m in replies] == [reason for reason, _ in endings]
    footers = [reply_footer(m.stats, m.status, m.finish_reason) for m in replies]
    assert footers == ["TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30 · reached max new tokens",
                       "TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30 · context full",
                       "TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30 · stopped",
                       "TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30",
                       "TTFT 0.40 s · 20.0 tok/s · 8 tokens · KV ×0.30 · ended by an error"]
    exported = [m.get("finish_reason") for m in again.export_json(conv)["messages"] if m["role"] == "assistant"]
    assert exported == [reason for reason, _ in endings]
    markdown = again.export_markdown(conv)
    assert "KV ×0.30 · reached max new tokens*" in markdown and "KV ×0.30 · context full*" in markdown


def _version_2_database(path) -> None:
    """A chats file as saved before replies kept their ending: a stopped reply and one cut at max new tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
            updated REAL NOT NULL, system_prompt TEXT NOT NULL DEFAULT '', settings_json TEXT);
        CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL, role TEXT NOT NULL,
            content TEXT NOT NULL DEFAULT '', model_content TEXT, status TEXT NOT NULL DEFAULT 'done', error TEXT,
            stats_json TEXT, settings_json TEXT, created REAL NOT NULL, updated REAL NOT NULL, reply_to INTEGER,
            active INTEGER NOT NULL DEFAULT 1);
        CREATE TABLE attachments (id INTEGER PRIMARY KEY, message_id INTEGER NOT NULL, name TEXT NOT NULL,
            path TEXT NOT NULL, kind TEXT NOT NULL, pages INTEGER, chars INTEGER NOT NULL, tokens INTEGER,
            text TEXT NOT NULL);
        INSERT INTO conversations(id, title, created, updated) VALUES (1, 'old chat', 0, 0);
        INSERT INTO messages(conversation_id, role, content, created, updated) VALUES (1, 'user', 'hi', 0, 0);
        INSERT INTO messages(conversation_id, role, content, status, created, updated, reply_to)
            VALUES (1, 'assistant', 'hel', 'stopped', 0, 0, 1);
        INSERT INTO messages(conversation_id, role, content, created, updated) VALUES (1, 'user', 'more', 0, 0);
        INSERT INTO messages(conversation_id, role, content, created, updated, reply_to)
            VALUES (1, 'assistant', 'a long', 0, 0, 3);
        PRAGMA user_version=2;
    """)
    db.close()


def test_a_chats_file_from_before_reply_endings_still_opens(data_dir, monkeypatch):
    from app.store import SCHEMA_VERSION, reply_footer

    path = data_dir / "conversations.sqlite3"
    _version_2_database(path)

    def read_only(self):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    with monkeypatch.context() as patch:  # only read (a read-only folder): the file is not changed
        patch.setattr(ConversationStore, "_open_writable", read_only)
        store = ConversationStore(path)
        assert store.read_only
        replies = [m for m in store.messages(1) if m.role == "assistant"]
        assert [(m.content, m.finish_reason) for m in replies] == [("hel", None), ("a long", None)]
        assert [reply_footer(m.stats, m.status, m.finish_reason) for m in replies] == ["stopped", ""]
        assert "finish_reason" not in store.export_json(1)["messages"][1]
        store.close()

    store = ConversationStore(path)  # writable: it gains the column and keeps every row
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert [m.content for m in store.messages(1)] == ["hi", "hel", "more", "a long"]
    reply = store.add_version(1, 3)
    store.finish_reply(reply, "a longer one", "done", finish_reason="length")
    store.close()
    again = ConversationStore(path)
    last = again.messages(1)[-1]
    assert (last.content, last.finish_reason) == ("a longer one", "length")
    assert reply_footer(last.stats, last.status, last.finish_reason) == "reached max new tokens"
