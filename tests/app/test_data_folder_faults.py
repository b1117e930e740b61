"""A full or read-only data folder, and a model load that fails: nothing typed is lost, existing chats open
to read, the working model stays, and every message names the folder or model and what to do."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import subprocess
import uuid

import pytest
from conftest import LOAD_TIMEOUT_MS, send
from gui_fakes import FakeModel, ModelLoadError, fake_factory

from app.store import ConversationStore


def disk_full(*args, **kwargs):
    raise sqlite3.OperationalError("database or disk is full")


def test_a_full_disk_keeps_the_typed_message(qtbot, window, monkeypatch):
    send(qtbot, window, "first message")
    bubbles = len(window.chat.bubbles)
    monkeypatch.setattr(window.store, "add_turn", disk_full)
    window.composer.setPlainText("a long message I typed with care")
    window.send()
    assert window.composer.toPlainText() == "a long message I typed with care"
    assert len(window.chat.bubbles) == bubbles and not window.turns.busy
    title, text = window.shown_messages[-1]
    assert title == "Could not save" and "database or disk is full" in text and "still in the message box" in text
    assert str(window.store.path.parent) in text
    monkeypatch.undo()
    window.send()  # space freed: the same text goes out
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert window.composer.toPlainText() == ""
    assert window.chat.bubbles[-2].text == "a long message I typed with care"


def test_a_full_disk_in_a_new_chat_keeps_the_message_and_leaves_no_empty_chat(qtbot, window, monkeypatch):
    monkeypatch.setattr(window.store, "add_turn", disk_full)
    window.new_conversation()
    window.composer.setPlainText("hello from a new chat")
    window.send()
    assert window.composer.toPlainText() == "hello from a new chat"
    assert window.store.conversations() == [] and window.conversation_id is None


def test_any_failure_to_send_in_a_new_chat_keeps_the_message_and_leaves_no_empty_chat(qtbot, window, monkeypatch):
    """Not only the store's own errors: whatever fails while the message is saved (text SQLite refuses, say) leaves
    neither an empty chat in the list nor the message lost, and says what happened."""
    def refuse(*args, **kwargs):
        raise UnicodeEncodeError("utf-8", "\ud835", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(window.store, "add_turn", refuse)
    window.new_conversation()
    window.composer.setPlainText("what is the value?")
    window.send()
    assert window.composer.toPlainText() == "what is the value?" and not window.turns.busy
    assert window.store.conversations() == [] and window.conversation_id is None
    assert "was not sent" in window.shown_messages[-1][1] and "surrogates" in window.shown_messages[-1][1]


def test_a_full_disk_while_a_reply_streams_says_so_once_and_keeps_the_reply(qtbot, window, monkeypatch,
                                                                            fake_model):
    fake_model.token_delay = 0.03
    monkeypatch.setattr(window.store, "update_reply", disk_full)
    send(qtbot, window, "tell me something")
    saves = [m for m in window.shown_messages if m[0] == "Could not save"]
    assert len(saves) == 1 and "stays on screen" in saves[0][1]
    assert window.chat.bubbles[-1].text.startswith("You asked")


def make_chat(data_dir) -> int:
    store = ConversationStore()
    conversation = store.create_conversation("An old chat")
    user, reply = store.add_turn(conversation, "What was said?", ())
    store.finish_reply(reply, "This was said.", "done")
    store.close()
    return conversation


def test_a_read_only_data_folder_opens_chats_to_read_and_says_what_to_do(qtbot, make_window, monkeypatch, data_dir):
    conversation = make_chat(data_dir)

    def read_only(self):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(ConversationStore, "_open_writable", read_only)
    window = make_window()
    qtbot.waitUntil(lambda: any(t == "Chats cannot be saved" for t, _ in window.shown_messages), timeout=5_000)
    text = next(t for title, t in window.shown_messages if title == "Chats cannot be saved")
    assert str(data_dir) in text and "DSV41_DATA_DIR" in text and "chmod" in text
    window.show_conversation(conversation)
    assert [b.text for b in window.chat.bubbles] == ["What was said?", "This was said."]
    window.composer.setPlainText("can I write?")
    window.send()
    assert window.composer.toPlainText() == "can I write?" and not window.turns.busy


@contextlib.contextmanager
def small_disk(path, size="1m"):
    """A tmpfs of `size` at `path` (root only; skipped where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root and a mount namespace that allows it")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder) -> None:
    with contextlib.suppress(OSError), open(folder / f"filler-{uuid.uuid4().hex}", "wb", buffering=0) as fh:
        while True:
            fh.write(b"\0" * 512)


def test_a_really_full_disk(qtbot, make_window, data_dir):
    """The same on a real 1 MB filesystem filled to the last byte."""
    with small_disk(data_dir):
        conversation = make_chat(data_dir)
        fill(data_dir)
        window = make_window()
        window.show_conversation(conversation)
        assert [b.text for b in window.chat.bubbles] == ["What was said?", "This was said."]
        window.composer.setPlainText("will this fit?")
        window.send()
        assert window.composer.toPlainText() == "will this fit?"
        title, text = window.shown_messages[-1]
        assert title in ("Could not save", "Chats cannot be saved") and "full" in text
        window.close()


def test_a_really_read_only_folder(qtbot, make_window, data_dir):
    with small_disk(data_dir):
        conversation = make_chat(data_dir)
        subprocess.run(["mount", "-o", "remount,ro", str(data_dir)], check=True)
        window = make_window()
        qtbot.waitUntil(lambda: any(t == "Chats cannot be saved" for t, _ in window.shown_messages), timeout=5_000)
        window.show_conversation(conversation)
        assert [b.text for b in window.chat.bubbles] == ["What was said?", "This was said."]
        window.close()


# ------------------------------------------------------------------ a model load that fails
def test_a_failed_load_keeps_the_model_that_was_working(qtbot, make_window, fake_model):
    factory = fake_factory(fake_model)
    window = make_window(factory)
    first = window.facts
    fail = ModelLoadError("GGUF file not found: /nowhere/big.gguf. Check the path.", reason="missing")

    def failing(options, progress):
        raise fail

    window.client.worker._factory = failing
    window.load_model({"model_path": "/nowhere/big.gguf"})
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert window.facts is not None and window.facts.display_name == first.display_name
    assert window.send_button.isEnabled()
    assert "still loaded" in window.model_panel.status.text()
    assert "still loaded" in window.shown_messages[-1][1]
    # the failed choice is not the one to start with next time, and the panel shows the model that runs
    assert window.settings.model_options().get("model_path") != "/nowhere/big.gguf"
    assert window.model_panel.options().get("model_path") != "/nowhere/big.gguf"
    window.client.worker._factory = factory
    send(qtbot, window, "are you still there?")
    assert window.chat.bubbles[-1].text.startswith("You asked")
    window.load_model({**window.model_panel.options(), "max_seq_len": 4096})  # a load that works is saved
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert window.settings.model_options().get("max_seq_len") == 4096
    # a context past the model's positions is capped: the panel and the saved choice say the capped size
    window.load_model({**window.model_panel.options(), "max_seq_len": 10 ** 6})
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    limit = window.facts.context_limit
    assert limit < 10 ** 6 and window.model_panel.max_seq_len.value() == limit
    assert window.settings.model_options().get("max_seq_len") == limit


def test_out_of_memory_beside_the_old_model_retries_alone(qtbot, make_window, fake_model):
    window = make_window(fake_factory(fake_model))
    worker = window.client.worker
    other = FakeModel(max_seq_len=4096)
    other.info = dataclasses.replace(other.info, display_name="BigLM")
    calls = []

    def factory(options, progress):
        calls.append((options.get("model_path"), worker.model is not None))
        if options.get("model_path") == "big" and worker.model is not None:
            raise ModelLoadError("The model does not fit in GPU memory.", reason="oom")
        return other if options.get("model_path") == "big" else fake_model

    worker._factory = factory
    window.load_model({"model_path": "big"})
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert calls == [("big", True), ("big", False)]  # unloaded the old one, then it fitted
    assert window.facts.display_name == "BigLM"


def test_out_of_memory_alone_too_brings_the_old_model_back(qtbot, make_window, fake_model):
    window = make_window(fake_factory(fake_model))
    worker = window.client.worker
    calls = []

    def factory(options, progress):
        calls.append(options.get("model_path"))
        if options.get("model_path") == "huge":
            raise ModelLoadError("The model does not fit in GPU memory.", reason="oom")
        return fake_model

    worker._factory = factory
    window.load_model({"model_path": "huge"})
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert calls == ["huge", "huge", "default"]
    assert window.facts is not None and window.facts.display_name == "FakeLM-1M"
    assert window.send_button.isEnabled()


def _chats(store, n: int) -> list[int]:
    ids = []
    for i in range(n):
        conv = store.create_conversation(f"chat {i}")
        store.add_user_message(conv, f"question {i} " + "words " * 400)
        store.finish_reply(store.add_reply(conv), f"answer {i} " + "more " * 400, "done")
        ids.append(conv)
    return ids


def test_a_file_that_is_not_a_database_is_moved_aside_and_a_new_store_starts(data_dir):
    data_dir.mkdir(parents=True)
    junk = os.urandom(8192)
    (data_dir / "conversations.sqlite3").write_bytes(junk)
    store = ConversationStore()
    assert not store.read_only and store.problem is None
    moved = [p for p in data_dir.iterdir() if ".damaged-" in p.name]
    assert len(moved) == 1 and moved[0].read_bytes() == junk  # nothing deleted
    assert str(moved[0]) in store.notice and "nothing in it could be read" in store.notice
    conv = store.create_conversation("after")  # the new store takes messages
    store.add_user_message(conv, "hello")
    assert [c.title for c in store.conversations()] == ["after"]


def test_a_database_with_damaged_pages_keeps_what_can_still_be_read(data_dir):
    store = ConversationStore()
    ids = _chats(store, 12)
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    path = data_dir / "conversations.sqlite3"
    raw = bytearray(path.read_bytes())
    page = 4096
    pages = len(raw) // page
    assert pages > 12
    middle = (pages * 2 // 3) * page  # a page of message rows, past the first chats'
    raw[middle: middle + page] = os.urandom(page)
    path.write_bytes(bytes(raw))
    store = ConversationStore()
    assert not store.read_only and store.notice and "damaged" in store.notice
    titles = [c.title for c in store.conversations()]
    assert 0 < len(titles) <= len(ids)  # every conversation row sits on the first pages: read back
    readable = [c.id for c in store.conversations() if store.messages(c.id)]
    assert readable  # and the messages before the damaged page come back with them
    assert store.db.execute("PRAGMA quick_check").fetchone()[0] == "ok"


def test_the_window_says_when_the_chats_file_was_damaged(qtbot, data_dir, make_window):
    data_dir.mkdir(parents=True)
    (data_dir / "conversations.sqlite3").write_text("these are not chats\n" * 100)
    window = make_window()
    qtbot.waitUntil(lambda: bool(window.shown_messages), timeout=5000)
    title, text = window.shown_messages[0]
    assert title == "The chats file was damaged" and ".damaged-" in text
    send(qtbot, window, "still works")
    assert window.chat.bubbles[-2].text == "still works"


@pytest.mark.parametrize("lines", [
    ['[model]', 'options="{\\"model_path\\": 5, \\"max_seq_len\\": 100000000000, \\"device_map\\": [1]}"'],
    ['[window]', 'geometry=hello', 'splitter=3'],
    ['[chat]', 'draft="{\\"conversation\\": 99999999999999999999999, \\"text\\": \\"hi\\", \\"documents\\": 5}"',
     'last_conversation=99999999999999999999999'],
    ['[chat]', 'draft="{\\"conversation\\": [1], \\"text\\": \\"hi\\"}"'],
])
def test_a_settings_file_with_values_of_the_wrong_type_starts_with_the_defaults(make_window, data_dir, lines):
    # a hand-edited or damaged settings.ini aborted every start (a TypeError inside a Qt call)
    from app.paths import settings_path

    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    window = make_window()
    assert window.model_panel.options()["model_path"] == "default"
    assert 256 <= window.model_panel.options()["max_seq_len"] <= 1 << 20
    window.composer.setPlainText("still works")
    window.send()
