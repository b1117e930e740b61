"""The model reads what the chat shows (on the fake engine): a question whose reply was deleted, or that has an empty
one, is still read; a window closed before a reply began keeps nothing of that turn (as a stop then) and puts the
message back in the box; edits and knob moves still waiting for their pause are neither lost at close nor left out
of a message sent at once."""

from __future__ import annotations

from conftest import send


def _engine_messages(window) -> list[tuple[str, str]]:
    session = window.client.worker._sessions[window.conversation_id]
    return [(m["role"], m["content"]) for m in session.messages if m["role"] != "system"]


def test_a_question_whose_reply_was_deleted_is_still_read(qtbot, window, fake_model):
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    first_reply = next(m for m in window.store.messages(window.conversation_id) if m.role == "assistant")
    window.store.delete_message(first_reply.id)  # what Delete on that reply does to the store
    history = window.store.history(window.conversation_id)
    assert [(t.prompt, bool(t.reply)) for t in history] == [("first question", False), ("second question", True)]
    send(qtbot, window, "third question")
    roles = [(role, content[:15]) for role, content in _engine_messages(window)]
    assert roles[:3] == [("user", "first question"), ("user", "second question"), ("assistant", roles[2][1])]


def test_closing_before_the_reply_began_keeps_nothing_and_the_message_comes_back(qtbot, window, make_window,
                                                                                  fake_model):
    send(qtbot, window, "a first question")
    chat = window.conversation_id
    fake_model.prefill_delay, fake_model.prefill_steps = 0.3, 20
    send(qtbot, window, "asked as the window closes", wait=False)
    qtbot.waitUntil(lambda: "Reading the prompt" in window.chat.bubbles[-1].progress.text(), timeout=5_000)
    window.close()
    fake_model.prefill_delay, fake_model.prefill_steps = 0.005, 2
    again = make_window()
    again.conversations.select(chat)
    qtbot.waitUntil(lambda: again.composer.toPlainText() == "asked as the window closes", timeout=5_000)
    assert [m.content for m in again.store.messages(chat) if m.role == "user"] == ["a first question"]


def test_closing_during_a_regenerates_read_shows_the_reply_before_it_again(qtbot, window, make_window, fake_model):
    send(qtbot, window, "a question")
    chat = window.conversation_id
    reply = window.chat.bubbles[-1].text
    fake_model.prefill_delay, fake_model.prefill_steps = 0.3, 20
    window.regenerate()
    qtbot.waitUntil(lambda: "Reading the prompt" in window.chat.bubbles[-1].progress.text(), timeout=5_000)
    window.close()
    fake_model.prefill_delay, fake_model.prefill_steps = 0.005, 2
    again = make_window()
    again.conversations.select(chat)
    replies = [m for m in again.store.messages(chat) if m.role == "assistant"]
    assert [m.content for m in replies] == [reply]  # no empty version left, the reply shown before is shown
    assert [t.reply for t in again.store.history(chat)] == [reply]


def test_a_knob_moved_just_before_sending_applies_to_that_turn(qtbot, window, fake_model):
    send(qtbot, window, "read at the defaults")
    fake_model.calls.clear()
    window.knob_panel.set_values({"kv_cache_ratio": 0.3}, notify=True)  # its pause not over yet
    send(qtbot, window, "read at 0.3")
    names = fake_model.names()
    assert "reconfigure" in names and names.index("reconfigure") < names.index("turn_start")
    assert fake_model.calls[names.index("reconfigure")][3]["knobs"]["kv_cache_ratio"] == 0.3
    stored = [m for m in window.store.messages(window.conversation_id) if m.role == "assistant"][-1]
    assert stored.settings["knobs"]["kv_cache_ratio"] == 0.3


def test_edits_still_waiting_at_close_are_kept(qtbot, window, make_window, fake_model):
    send(qtbot, window, "a question")
    chat = window.conversation_id
    window.system_prompt.editor.setPlainText("Answer in French.")  # its pause not over yet
    window.knob_panel.set_values({"kv_cache_ratio": 0.3}, notify=True)
    window.close()
    again = make_window()
    again.conversations.select(chat)
    assert again.store.system_prompt(chat) == "Answer in French."
    assert again.knob_panel.values()["kv_cache_ratio"] == 0.3


def test_send_with_a_document_and_no_question_says_what_it_waits_for(qtbot, window, fake_model, tmp_path):
    path = tmp_path / "note.txt"
    path.write_text("A note about rivers.")
    window.attach_files([str(path)])
    qtbot.waitUntil(lambda: window.attached and None not in window.attached.values(), timeout=5_000)
    window.send()
    assert "Type a question about the attached document" in window.statusBar().currentMessage()
    assert not fake_model.sends() and list(window.attached)  # nothing sent, the document still attached
