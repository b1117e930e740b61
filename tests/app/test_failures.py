"""Failure paths: each shows a message, nothing already shown is lost, and the app stays usable."""

from __future__ import annotations

import sqlite3

from conftest import send
from gui_fakes import ModelLoadError, fake_factory


def test_load_failure_shows_the_reason_and_what_to_do(qtbot, make_window, fake_model):
    error = ModelLoadError("GGUF file not found: /nowhere/model.gguf. Check the path or pick the file again.",
                           reason="missing")
    window = make_window(fake_factory(fake_model, fail=error), wait_loaded=False)
    qtbot.waitUntil(lambda: bool(window.shown_messages), timeout=5_000)
    title, text = window.shown_messages[-1]
    assert title == "Could not load the model"
    assert "GGUF file not found" in text and "What to do:" in text
    assert window.open_dialogs and window.open_dialogs[-1].isVisible()
    assert "Load failed" in window.model_panel.status.text()
    assert window.model_panel.load_button.isEnabled() and not window.send_button.isEnabled()
    window.composer.setPlainText("hello?")
    window.send()
    assert window.shown_messages[-1][0] == "No model"


def test_an_unexpected_exception_while_loading_is_shown(qtbot, make_window, fake_model):
    window = make_window(fake_factory(fake_model, fail=ValueError("weird header")), wait_loaded=False)
    qtbot.waitUntil(lambda: bool(window.shown_messages), timeout=5_000)
    assert "ValueError: weird header" in window.shown_messages[-1][1]


def test_an_exception_inside_a_turn_is_shown_and_the_app_stays_usable(qtbot, window, fake_model):
    send(qtbot, window, "please CRASH now")
    title, text = window.shown_messages[-1]
    assert title == "The reply ended with an error"
    assert "RuntimeError" in text and "simulated bug" in text
    assert window.chat.bubbles[-1].error_label.isVisible()
    send(qtbot, window, "are you still there?")
    assert window.chat.bubbles[-1].text.startswith("You asked")


def test_out_of_memory_keeps_the_partial_reply_and_offers_retries(qtbot, window, fake_model, data_dir):
    fake_model.oom_after = 5
    send(qtbot, window, "Summarise a very long document")
    reply = window.chat.bubbles[-1]
    assert len(reply.text.split()) == 5
    assert "Out of memory" in reply.error_label.text()
    row = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
        "SELECT content, status, error FROM messages WHERE role='assistant'").fetchone()
    assert row[0] == reply.text and row[1] == "error" and "Out of memory" in row[2]
    box = window.open_dialogs[-1]
    labels = [b.text() for b in box.buttons()]
    assert labels == ["Compress harder and retry", "Lower max_seq_len and retry", "Keep the partial reply"]

    # "Compress harder and retry": knobs tighten, reach the engine, then the turn runs again.
    fake_model.oom_after = None
    sends_before = len(fake_model.sends())
    next(b for b in box.buttons() if b.text().startswith("Compress")).click()
    qtbot.waitUntil(lambda: len(fake_model.sends()) > sends_before and not window.turns.busy, timeout=10_000)
    names = fake_model.names()
    assert names.index("reconfigure") < len(names) - 1 - names[::-1].index("send")
    assert fake_model.config.kv_cache_ratio == 0.25 and fake_model.config.kv_cache_dtype == "int8"
    assert window.chat.bubbles[-1].text.startswith("You asked")
    assert len([b for b in window.chat.bubbles if b.role == "assistant"]) == 1  # the retry replaced it


def test_out_of_memory_retry_with_a_shorter_context_reloads(qtbot, window, fake_model):
    fake_model.oom_after = 2
    send(qtbot, window, "Long one")
    fake_model.oom_after = None
    box = window.open_dialogs[-1]
    next(b for b in box.buttons() if b.text().startswith("Lower")).click()
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.context_limit == 4096
                    and len(fake_model.sends()) == 2 and not window.turns.busy, timeout=10_000)
    assert window.chat.bubbles[-1].text.startswith("You asked")


def test_context_overflow_is_explained_and_the_question_comes_back(qtbot, window, fake_model):
    send(qtbot, window, "first")
    send(qtbot, window, "OVERFLOW with a huge question")
    title, text = window.shown_messages[-1]
    assert title == "Does not fit the context"
    assert "9000 tokens" in text and "max_seq_len" in text
    assert window.composer.toPlainText() == "OVERFLOW with a huge question"
    assert [b.text for b in window.chat.bubbles if b.role == "user"] == ["first"]
    assert window.send_button.isEnabled()


def test_overflow_in_a_new_chat_leaves_no_empty_conversation(qtbot, window, fake_model):
    send(qtbot, window, "OVERFLOW right away")
    assert window.conversations.list.count() == 0
    assert window.conversation_id is None


def test_changing_the_model_during_a_reply_is_refused(qtbot, window, fake_model):
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(40))
    send(qtbot, window, "Keep talking", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=5_000)
    loads = [c for c in fake_model.calls if c[0] == "load"]
    window.load_model({"model_path": "default", "weight_quant": "int8", "device_map": "cpu", "max_seq_len": 8192})
    assert window.shown_messages[-1][0] == "Model change refused"
    assert not window.model_panel.load_button.isEnabled()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert [c for c in fake_model.calls if c[0] == "load"] == loads
    assert window.chat.bubbles[-1].text.endswith("w39")


def test_deleting_the_chat_that_is_generating_is_refused(qtbot, window, fake_model):
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(30))
    send(qtbot, window, "Keep talking", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=5_000)
    window.delete_conversation(window.conversation_id)
    assert window.shown_messages[-1][0] == "Delete refused"
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)


def test_a_crash_mid_reply_keeps_what_was_saved(qtbot, data_dir):
    """A reply row left 'streaming' (the process was killed) opens as 'interrupted' with its text."""
    from app.store import ConversationStore

    store = ConversationStore()
    conversation = store.create_conversation("Before the crash")
    store.add_user_message(conversation, "Tell me a story")
    reply = store.add_reply(conversation, {"model": "x"})
    store.update_reply(reply, "Once upon a time")
    store.db.close()  # no finish_reply: as if killed

    reopened = ConversationStore()
    assert reopened.recovered == 1
    message = reopened.messages(conversation)[-1]
    assert (message.content, message.status) == ("Once upon a time", "interrupted")
    assert reopened.history(conversation)[0].reply == "Once upon a time"


def test_unhandled_gui_exceptions_reach_one_dialog(qtbot, window):
    import sys

    from app.main import ErrorHook

    hook = ErrorHook(window)
    hook.install()
    try:
        try:
            raise KeyError("boom")
        except KeyError:
            sys.excepthook(*sys.exc_info())
        qtbot.waitUntil(lambda: bool(window.shown_messages) and window.shown_messages[-1][0] == "Unexpected error",
                        timeout=2_000)
        assert "KeyError" in window.shown_messages[-1][1]
    finally:
        hook.uninstall()


def test_every_reason_a_load_fails_for_has_its_own_advice():
    """The window's "What to do" after a failed load comes from LOAD_HELP by the engine's reason; one missing fell
    back to "Try the default model, or check the model's files" (for a missing GPU, say)."""
    import re
    from pathlib import Path

    import engine
    from app.window import LOAD_HELP
    from engine.documents import DocumentError

    reasons = set()
    root = Path(engine.__file__).parent
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "documents"):  # a document's reasons go to its chip (DocumentError.REASONS)
            continue
        reasons |= set(re.findall(r'reason="([a-z_]+)"', path.read_text(encoding="utf-8")))
    assert "no_gpu" in reasons and reasons - set(LOAD_HELP) == set()
    documents = set()
    for path in (root / "documents").rglob("*.py"):
        documents |= set(re.findall(r'reason="([a-z_]+)"', path.read_text(encoding="utf-8")))
    assert documents and documents <= DocumentError.REASONS
