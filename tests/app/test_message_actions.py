"""Message actions: regenerate keeps the earlier replies as versions (‹ 1/2 ›), edit any message of yours, delete a
message, all saved, and the engine reads the transcript as shown (on the fake engine)."""

from __future__ import annotations

from conftest import send

from app.store import ConversationStore


def _texts(window):
    return [(b.role, b.text) for b in window.chat.bubbles]


def _last_reply(window):
    return [b for b in window.chat.bubbles if b.role == "assistant"][-1]


def _regenerate(qtbot, window, fake_model, text):
    fake_model.reply_text = text
    window.regenerate()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)


def test_regenerate_keeps_the_earlier_replies_as_versions_you_can_page_through(qtbot, make_window, fake_model):
    window = make_window()
    fake_model.reply_text = "First answer."
    send(qtbot, window, "Question")
    _regenerate(qtbot, window, fake_model, "Second answer.")
    _regenerate(qtbot, window, fake_model, "Third answer.")
    reply = _last_reply(window)
    assert _texts(window) == [("user", "Question"), ("assistant", "Third answer.")]
    assert reply.version_label.text() == "3/3" and reply.version_label.isVisible()
    assert not reply.next_button.isEnabled() and reply.previous_button.isEnabled()
    reply.previous_button.click()
    reply = _last_reply(window)
    assert reply.text == "Second answer." and reply.version_label.text() == "2/3"
    _last_reply(window).previous_button.click()
    assert _last_reply(window).text == "First answer."
    # the engine reads the version shown
    fake_model.reply_text = "ok"
    send(qtbot, window, "Follow-up")
    assert [m["content"] for m in fake_model.sends()[-1]["history"]][1] == "First answer."
    assert not _last_reply(window).version_label.isVisible()  # the new reply has one version
    # versions survive a restart
    window.close()
    again = make_window()
    store = ConversationStore()
    first_reply = [m for m in store.messages(again.conversation_id) if m.role == "assistant"][0]
    assert len(store.versions(first_reply.id)) == 3 and first_reply.content == "First answer."


def test_a_refused_regenerate_keeps_the_reply_that_was_shown(qtbot, window, fake_model, monkeypatch):
    from engine.errors import BusyError

    fake_model.reply_text = "Kept answer."
    send(qtbot, window, "Question")
    session = fake_model.sessions[-1]

    def refuse(*args, **kwargs):
        raise BusyError("busy for the test")

    monkeypatch.setattr(session, "send", refuse)
    window.regenerate()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert _texts(window) == [("user", "Question"), ("assistant", "Kept answer.")]
    store = ConversationStore()
    reply = [m for m in store.messages(window.conversation_id) if m.role == "assistant"][-1]
    assert reply.content == "Kept answer." and store.versions(reply.id) == [reply.id]
    assert window.composer.toPlainText() == ""  # a regenerate puts nothing back in the box


def test_edit_any_message_continues_the_chat_from_it(qtbot, window, fake_model):
    for text in ("one", "two", "three"):
        fake_model.reply_text = f"reply to {text}"
        send(qtbot, window, text)
    first = window.chat.bubbles[0]
    assert first.edit_button.isVisible() and not window.chat.bubbles[1].edit_button.isVisible()
    first.edit_button.click()
    assert window.composer.toPlainText() == "one"
    assert "the 5 messages after it" in window.edit_banner.text()
    window.composer.setPlainText("ONE")
    fake_model.reply_text = "reply to ONE"
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert _texts(window) == [("user", "ONE"), ("assistant", "reply to ONE")]
    assert fake_model.sends()[-1]["history"] == [] and fake_model.sends()[-1]["prompt"] == "ONE"
    assert [m.content for m in ConversationStore().messages(window.conversation_id)] == ["ONE", "reply to ONE"]


def test_delete_a_message_or_a_reply_version(qtbot, window, fake_model):
    for text in ("one", "two", "three"):
        fake_model.reply_text = f"reply to {text}"
        send(qtbot, window, text)
    middle = next(b for b in window.chat.bubbles if b.text == "two")
    middle.delete_button.click()  # confirm() answers yes in these tests
    assert [t for _, t in _texts(window)] == ["one", "reply to one", "three", "reply to three"]
    fake_model.reply_text = "ok"
    send(qtbot, window, "four")
    assert [m["content"] for m in fake_model.sends()[-1]["history"]] == ["one", "reply to one", "three",
                                                                          "reply to three"]
    _regenerate(qtbot, window, fake_model, "another ok")
    _last_reply(window).delete_button.click()  # the shown version goes; the other is shown again
    assert _last_reply(window).text == "ok" and not _last_reply(window).version_label.isVisible()


def test_message_actions_wait_while_a_reply_streams(qtbot, window, fake_model):
    send(qtbot, window, "one")
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(100))
    send(qtbot, window, "two", wait=False)
    qtbot.waitUntil(lambda: window.turns.busy, timeout=5_000)
    first = window.chat.bubbles[0]
    assert not first.edit_button.isEnabled() and not first.delete_button.isEnabled()
    window.chat.message_action.emit("delete", first.message_id)  # (as if clicked anyway)
    assert window.shown_messages[-1][0] == "Not now"
    window.stop()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=5_000)
    assert window.chat.bubbles[0].edit_button.isEnabled() and window.chat.bubbles[0].text == "one"


def test_a_new_chat_opened_during_a_reply_stays_open_with_its_system_prompt(qtbot, window, fake_model):
    send(qtbot, window, "first chat")
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(30))
    send(qtbot, window, "keep talking", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=5_000)
    window.new_conversation()
    window.system_prompt.editor.setPlainText("You are a pirate.")
    window.composer.setPlainText("a question for the new chat")
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert window.conversation_id is None  # the finished reply did not pull the view back to its chat
    assert window.system_prompt.text() == "You are a pirate."
    assert window.composer.toPlainText() == "a question for the new chat"
    fake_model.token_delay = 0.005
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert window.conversations.list.count() == 2
    assert window.store.system_prompt(window.conversation_id) == "You are a pirate."


def test_a_refused_first_message_leaves_you_in_the_new_chat(qtbot, window, fake_model):
    send(qtbot, window, "an older chat")
    window.new_conversation()
    window.composer.setPlainText("OVERFLOW right away")
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy and bool(window.shown_messages), timeout=10_000)
    assert window.conversation_id is None and window.chat.bubbles == []  # not the older chat
    assert window.composer.toPlainText() == "OVERFLOW right away"


def _draft(qtbot, window, tmp_path, text: str) -> None:
    """Type `text` in the box and attach a small note.txt, read."""
    note = tmp_path / "note.txt"
    note.write_text("A note.")
    window.composer.setPlainText(text)
    window.attach_files([str(note)])
    qtbot.waitUntil(lambda: all(doc is not None for doc in window.attached.values()), timeout=5_000)


def test_editing_a_message_sets_the_draft_aside_and_puts_it_back(qtbot, window, fake_model, tmp_path):
    send(qtbot, window, "first question")
    _draft(qtbot, window, tmp_path, "my unsent draft")
    window.edit_last()
    assert window.composer.toPlainText() == "first question" and not window.attached
    window.cancel_edit()  # Esc
    assert window.composer.toPlainText() == "my unsent draft"
    assert [doc.name for doc in window.attached.values()] == ["note.txt"]
    window.edit_last()
    window.composer.setPlainText("first question, edited")
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert fake_model.sends()[-1]["prompt"] == "first question, edited"
    assert window.composer.toPlainText() == "my unsent draft"  # back after the edit was sent too
    assert [doc.name for doc in window.attached.values()] == ["note.txt"]


def test_a_messages_first_line_keeps_its_indentation(qtbot, window, fake_model):
    window.composer.setPlainText("\n\n    x = 1\n    y = 2\n\n")
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    assert fake_model.sends()[-1]["prompt"] == "    x = 1\n    y = 2"
    assert window.chat.bubbles[0].text == "    x = 1\n    y = 2"


def test_a_knob_moved_just_before_switching_chats_stays_with_its_chat(qtbot, window, fake_model):
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.new_conversation()
    send(qtbot, window, "chat two")
    two = window.conversation_id
    window.show_conversation(one)
    window.knob_panel.set_values({**window.knob_panel.values(), "kv_cache_ratio": 0.3}, notify=True)
    window.show_conversation(two)  # before the panel's debounce ran out
    assert window.store.chat_settings(one)["knobs"]["kv_cache_ratio"] == 0.3
    assert window.store.chat_settings(two)["knobs"]["kv_cache_ratio"] != 0.3


def test_a_knob_or_system_prompt_changed_just_before_new_chat_stays_with_its_chat(qtbot, window, fake_model):
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.knob_panel.set_values({**window.knob_panel.values(), "kv_cache_ratio": 0.3}, notify=True)
    window.system_prompt.editor.setPlainText("Answer in French.")
    window.new_conversation()  # before either debounce ran out
    assert window.store.chat_settings(one)["knobs"]["kv_cache_ratio"] == 0.3
    assert window.store.system_prompt(one) == "Answer in French."
    assert window.system_prompt.text() == ""  # the new chat starts with the default (none)


def test_a_knob_change_reports_the_open_chats_cache(qtbot, window, fake_model):
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.new_conversation()
    send(qtbot, window, "chat two, the most recent")
    window.show_conversation(one)
    sessions = window.client.worker._sessions
    seen = []
    plain = fake_model.reconfigure

    def reconfigure(session=None, progress=None, **knobs):
        seen.append(session)
        return plain(session, progress, **knobs)

    fake_model.reconfigure = reconfigure
    window.knob_panel.set_values({**window.knob_panel.values(), "kv_cache_ratio": 0.3}, notify=True)
    qtbot.waitUntil(lambda: bool(seen), timeout=5_000)
    assert seen[0] is sessions[one]  # not the session of the chat used last


def test_an_unsent_draft_comes_back_after_a_restart(qtbot, make_window, fake_model, tmp_path):
    first = make_window()
    send(qtbot, first, "a question")
    chat = first.conversation_id
    _draft(qtbot, first, tmp_path, "the draft I was typing")
    first.close()
    second = make_window()
    assert second.conversation_id == chat and second.composer.toPlainText() == "the draft I was typing"
    qtbot.waitUntil(lambda: [d.name for d in second.attached.values() if d is not None] == ["note.txt"],
                    timeout=5_000)
    second.composer.clear()
    second.attached.clear()
    second.close()
    third = make_window()  # nothing in the box at close: nothing comes back
    assert third.composer.toPlainText() == "" and not third.attached
