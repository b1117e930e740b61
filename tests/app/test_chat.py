"""Chatting on the fake engine: streaming, saving, Stop, Regenerate, edit-and-resend, conversations."""

from __future__ import annotations

import json
import sqlite3

import pytest
from conftest import send

from app.store import ConversationStore


def reply_bubbles(window):
    return [b for b in window.chat.bubbles if b.role == "assistant"]


def test_send_streams_the_reply_into_the_view_and_saves_it(qtbot, window, fake_model, data_dir):
    fake_model.token_delay = 0.03
    batches = []
    window.client.worker.tokens.connect(lambda turn, text: batches.append(text))
    send(qtbot, window, "What does the with statement do?")

    reply = reply_bubbles(window)[-1]
    expected = fake_model.reply_for("What does the with statement do?", [])
    assert reply.text == expected
    assert "print('hello')" in reply.view.toPlainText()  # the code block is rendered
    assert "Copy code" in reply.view.toPlainText()
    assert "tok/s" in reply.footer.text() and "TTFT" in reply.footer.text() and "KV ×" in reply.footer.text()
    # Painted in batches, not one signal per token.
    assert 1 < len(batches) < len(expected.split(" "))
    assert "".join(batches) == expected

    rows = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
        "SELECT role, content, status, stats_json, settings_json FROM messages ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[1][1] == expected and rows[1][2] == "done"
    stats, settings = json.loads(rows[1][3]), json.loads(rows[1][4])
    assert stats["decode_tok_s"] == 42.0 and 0 < stats["compression_ratio"] <= 1
    assert settings["model"] == "FakeLM-1M" and settings["knobs"]["kv_cache_ratio"] == 0.5
    assert window.conversations.list.count() == 1
    assert window.conversations.list.item(0).text() == "What does the with statement do?"


def test_reply_is_saved_while_it_streams(qtbot, window, fake_model, data_dir):
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"word{i}" for i in range(60))
    send(qtbot, window, "Count for me", wait=False)
    qtbot.waitUntil(lambda: len(window.turns.active.text) > 100 if window.turns.active else False, timeout=10_000)
    qtbot.wait(700)
    # Another connection (a crash-survivor's view of the file) already sees most of what is shown.
    shown = window.turns.active.text
    saved = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
        "SELECT content, status FROM messages WHERE role='assistant'").fetchone()
    assert saved[1] == "streaming"
    assert saved[0] and shown.startswith(saved[0]) and len(saved[0]) > 60
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)


def test_enter_sends_and_shift_enter_breaks_the_line(qtbot, window, fake_model):
    from PySide6.QtCore import Qt

    window.composer.setFocus()
    qtbot.keyClicks(window.composer, "first line")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.composer, "second line")
    assert window.composer.toPlainText() == "first line\nsecond line"
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.turns.busy and len(window.chat.bubbles) == 2, timeout=10_000)
    assert fake_model.sends()[-1]["prompt"] == "first line\nsecond line"
    assert window.composer.toPlainText() == ""


def test_stop_during_decode_keeps_the_partial_reply(qtbot, window, fake_model, data_dir):
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(200))
    send(qtbot, window, "Talk a lot", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=10_000)
    assert window.stop_button.isEnabled()
    qtbot.mouseClick(window.stop_button, __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=3_000)
    reply = reply_bubbles(window)[-1]
    assert reply.text and len(reply.text.split()) < 200
    assert "stopped" in reply.footer.text()
    row = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
        "SELECT content, status FROM messages WHERE role='assistant'").fetchone()
    assert row == (reply.text, "stopped")
    assert window.send_button.isEnabled()


def test_stop_during_prefill_puts_the_message_and_its_documents_back(qtbot, window, fake_model, tmp_path):
    """Stopped while its message and document were read, a turn leaves nothing in the engine: the chat keeps no
    exchange the model never read (it showed the question and its document chip, and the next question was
    answered without the document), and the message with its document goes back into the box."""
    doc = tmp_path / "spec.txt"
    doc.write_text("The launch code is 4417. " * 40)
    window.attach_files([str(doc)])
    qtbot.waitUntil(lambda: bool(window.attached) and all(d is not None for d in window.attached.values()),
                    timeout=5_000)
    fake_model.prefill_delay = 0.3
    fake_model.prefill_steps = 20
    send(qtbot, window, "What is the launch code?", wait=False)
    qtbot.waitUntil(lambda: "Reading the prompt" in reply_bubbles(window)[-1].progress.text(), timeout=5_000)
    window.stop()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=2_000)  # well before the 6 s prefill would end
    assert window.chat.bubbles == [] and window.composer.toPlainText() == "What is the launch code?"
    assert [d.name for d in window.attached.values()] == ["spec.txt"]
    assert "back in the message box" in window.statusBar().currentMessage()
    assert len(window.chips.chips) == 1 and sum(c.isVisible() for c in window.chips.findChildren(type(
        next(iter(window.chips.chips.values()))))) == 1  # the chip taken away at send is not painted under it
    # sent again, the document is read with it
    fake_model.prefill_delay = 0.001
    window.send()
    assert window.statusBar().currentMessage() == ""  # the notice was about this message
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    last = fake_model.sends()[-1]
    assert last["history"] == [] and [d.name for d in last["documents"]] == ["spec.txt"]


def test_history_reaches_the_engine_and_regenerate_replaces_the_last_reply(qtbot, window, fake_model, data_dir):
    send(qtbot, window, "one")
    send(qtbot, window, "two")
    assert [m["content"] for m in fake_model.sends()[-1]["history"]][0] == "one"
    fake_model.reply_text = "A different answer."
    window.regenerate()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    last = fake_model.sends()[-1]
    assert last["prompt"] == "two"
    assert [m["role"] for m in last["history"]] == ["user", "assistant"]  # only "one" and its reply
    texts = [(b.role, b.text) for b in window.chat.bubbles]
    assert texts[-1] == ("assistant", "A different answer.") and len(texts) == 4
    store = ConversationStore()
    assert [m.content for m in store.messages(window.conversation_id)][-2:] == ["two", "A different answer."]


def test_edit_and_resend_the_last_user_message(qtbot, window, fake_model):
    send(qtbot, window, "first question")
    send(qtbot, window, "secnod question with a typo")
    window.edit_last()
    assert window.edit_banner.isVisible()
    assert window.composer.toPlainText() == "secnod question with a typo"
    window.composer.setPlainText("second question")
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert [b.text for b in window.chat.bubbles if b.role == "user"] == ["first question", "second question"]
    assert not window.edit_banner.isVisible()
    assert fake_model.sends()[-1]["prompt"] == "second question"


def test_conversations_survive_closing_and_reopening_the_window(qtbot, make_window, fake_model):
    first = make_window()
    send(qtbot, first, "Remember the number 4711")
    first.conversations.renamed.emit(first.conversation_id, "Numbers")
    first.new_conversation()
    send(qtbot, first, "中文也可以吗？")
    first.close()

    second = make_window()
    titles = [second.conversations.list.item(i).text() for i in range(second.conversations.list.count())]
    assert titles == ["中文也可以吗？", "Numbers"]
    assert [b.text for b in second.chat.bubbles][0] == "中文也可以吗？"  # the last chat is reopened
    second.conversations.select(second.conversations.ids()[1])
    assert second.chat.bubbles[0].text == "Remember the number 4711"
    send(qtbot, second, "Which number?")
    assert fake_model.sends()[-1]["history"][0]["content"] == "Remember the number 4711"


def test_search_rename_delete_and_export(qtbot, window, fake_model, tmp_path):
    send(qtbot, window, "Tell me about tomatoes")
    tomato = window.conversation_id
    window.new_conversation()
    send(qtbot, window, "Tell me about potatoes")
    window.conversations.search.setText("tomato")
    qtbot.waitUntil(lambda: window.conversations.ids() == [tomato], timeout=2_000)
    window.conversations.search.setText("")
    qtbot.waitUntil(lambda: len(window.conversations.ids()) == 2, timeout=2_000)

    md = window.export_conversation(tomato, "md", str(tmp_path / "t.md"))
    js = window.export_conversation(tomato, "json", str(tmp_path / "t.json"))
    text = open(md, encoding="utf-8").read()
    assert "## You" in text and "Tell me about tomatoes" in text and "tok/s" in text and "FakeLM-1M" in text
    data = json.load(open(js, encoding="utf-8"))
    reply = data["messages"][1]
    assert reply["settings"]["weight_quant"] == "none" and reply["stats"]["ttft_s"] >= 0
    assert reply["settings"]["knobs"]["ced_decay"] == 0.995

    window.delete_conversation(tomato)
    assert tomato not in window.conversations.ids()
    assert ConversationStore().conversation(tomato) is None


@pytest.mark.parametrize(("reason", "ending"), [("length", "reached max new tokens"), ("context_full", "context full")])
def test_how_a_reply_ended_is_still_said_when_its_chat_is_reopened(qtbot, make_window, fake_model, reason, ending):
    first = make_window()
    fake_model.reply_text = " ".join(f"word{i}" for i in range(40))
    if reason == "length":
        first.knob_panel.max_tokens.setValue(5)  # the fake ends with "length" where this cuts the reply
    else:
        fake_model.finish_reason = reason
    send(qtbot, first, "Tell me everything")
    chat = first.conversation_id
    footer = reply_bubbles(first)[-1].footer.text()
    assert footer.startswith("TTFT") and footer.endswith(f" · {ending}")
    first.new_conversation()
    fake_model.finish_reason = None
    send(qtbot, first, "Another chat")
    first.show_conversation(chat)  # reopened from the store
    assert reply_bubbles(first)[-1].footer.text() == footer
    first.close()

    second = make_window()  # after a restart
    second.show_conversation(chat)
    assert [b.text for b in second.chat.bubbles][0] == "Tell me everything"
    assert reply_bubbles(second)[-1].footer.text() == footer
