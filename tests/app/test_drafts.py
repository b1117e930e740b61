"""The message box belongs to its chat: what is typed (and attached) in one chat stays with it when another chat is
opened, comes back when it is reopened, and is never sent into another chat (on the fake engine)."""

from __future__ import annotations

from conftest import send


def _attach(qtbot, window, path, text: str = "A note.") -> None:
    path.write_text(text)
    window.attach_files([str(path)])
    qtbot.waitUntil(lambda: all(doc is not None for doc in window.attached.values()), timeout=5_000)


def _box(window) -> tuple[str, list[str], list[str]]:
    """What the message box shows: its text, the documents attached and the chips painted."""
    chips = [chip.document.name if chip.document is not None else chip.title.text()  # "Reading x…" while read
             for chip in window.chips.chips.values() if chip.isVisibleTo(window)]
    return (window.composer.toPlainText(), [d.name if d is not None else key for key, d in window.attached.items()],
            chips)


def _send_slowly(qtbot, window, fake_model, text: str) -> None:
    """Send `text` with the engine reading its prompt slowly, and wait until the reading has begun."""
    fake_model.prefill_delay = 0.3
    fake_model.prefill_steps = 20
    send(qtbot, window, text, wait=False)
    reply = window.chat.bubbles[-1]
    qtbot.waitUntil(lambda: "Reading the prompt" in reply.progress.text(), timeout=5_000)


def _two_chats(qtbot, window) -> tuple[int, int]:
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.new_conversation()
    send(qtbot, window, "chat two")
    return one, window.conversation_id


def test_each_chat_keeps_its_own_message_box(qtbot, window, fake_model, tmp_path):
    one, two = _two_chats(qtbot, window)
    window.conversations.select(one)
    window.composer.setPlainText("draft for one")
    _attach(qtbot, window, tmp_path / "note.txt")
    assert _box(window)[1:] == (["note.txt"], ["note.txt"])

    window.conversations.select(two)
    assert window.conversation_id == two and _box(window) == ("", [], [])  # nothing of chat one's
    window.composer.setPlainText("draft for two")
    window.new_conversation()
    assert _box(window) == ("", [], [])  # a new chat starts empty
    window.conversations.select(one)
    assert _box(window) == ("draft for one", ["note.txt"], ["note.txt"])
    window.conversations.select(two)
    assert _box(window) == ("draft for two", [], [])

    window.send()  # chat two's message goes to chat two, without chat one's document
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    sent = fake_model.sends()[-1]
    assert sent["prompt"] == "draft for two" and sent["documents"] == []
    assert [m["content"] for m in sent["history"] if m["role"] == "user"] == ["chat two"]
    assert _box(window) == ("", [], [])

    window.conversations.select(one)  # chat one's draft is still there, and goes to chat one
    assert _box(window) == ("draft for one", ["note.txt"], ["note.txt"])
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    sent = fake_model.sends()[-1]
    assert sent["prompt"] == "draft for one" and [d.name for d in sent["documents"]] == ["note.txt"]
    assert [m["content"] for m in sent["history"] if m["role"] == "user"] == ["chat one"]
    window.conversations.select(two)
    assert _box(window) == ("", [], [])  # sent: nothing left for either chat


def test_a_draft_is_not_carried_into_a_new_chat(qtbot, window, fake_model, tmp_path):
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.composer.setPlainText("half a thought")
    _attach(qtbot, window, tmp_path / "note.txt")
    window.new_conversation()
    assert _box(window) == ("", [], [])
    send(qtbot, window, "a new topic")
    assert fake_model.sends()[-1]["documents"] == [] and window.conversation_id != one
    window.conversations.select(one)
    assert _box(window) == ("half a thought", ["note.txt"], ["note.txt"])


def test_a_document_still_being_read_stays_with_its_chat(qtbot, window, fake_model, tmp_path, slow_reading):
    gate = slow_reading
    one, two = _two_chats(qtbot, window)
    window.conversations.select(one)
    slow_file = tmp_path / "slow.txt"
    slow_file.write_text("Read slowly.")
    window.attach_files([str(slow_file)])
    window.conversations.select(two)
    window.conversations.select(one)  # back while it is still read: its chip says so
    assert _box(window)[2] == ["Reading slow.txt…"]
    window.conversations.select(two)
    gate.set()
    qtbot.waitUntil(lambda: not window.loader.pending, timeout=5_000)
    assert _box(window) == ("", [], [])  # read while chat two was shown: not attached there
    window.conversations.select(one)
    assert _box(window) == ("", ["slow.txt"], ["slow.txt"])  # but in its chat's box, read
    send(qtbot, window, "What does it say?")
    assert [d.name for d in fake_model.sends()[-1]["documents"]] == ["slow.txt"]


def test_deleting_a_chat_drops_its_draft(qtbot, window, fake_model, tmp_path):
    one, two = _two_chats(qtbot, window)
    window.conversations.select(one)
    window.composer.setPlainText("never mind")
    _attach(qtbot, window, tmp_path / "note.txt")
    window.delete_conversation(one)  # the chat shown: the next one opens, with its own (empty) box
    assert window.conversation_id == two and _box(window) == ("", [], [])
    window.composer.setPlainText("for chat two")
    window.new_conversation()
    window.delete_conversation(two)  # a chat not shown
    assert window.store.conversations() == [] and two not in window._drafts
    assert _box(window) == ("", [], [])
    send(qtbot, window, "chat three")
    window.composer.setPlainText("about chat three")
    window.delete_conversation(window.conversation_id)  # the last chat, shown: a new chat, empty
    assert window.conversation_id is None and _box(window) == ("", [], [])


def test_a_message_stopped_in_another_chat_goes_back_to_its_chats_box(qtbot, window, fake_model):
    one, two = _two_chats(qtbot, window)
    window.conversations.select(one)
    _send_slowly(qtbot, window, fake_model, "Stopped while it is read")
    window.conversations.select(two)
    window.composer.setPlainText("typed in chat two")
    window.stop()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=3_000)
    assert _box(window) == ("typed in chat two", [], [])
    window.conversations.select(one)
    assert _box(window) == ("Stopped while it is read", [], [])
    assert [b.text for b in window.chat.bubbles] == ["chat one", fake_model.reply_for("chat one", [])]


def test_a_document_read_while_a_message_is_edited_is_back_with_the_draft(qtbot, window, fake_model, tmp_path,
                                                                          slow_reading):
    gate = slow_reading
    send(qtbot, window, "first question")
    slow_file = tmp_path / "slow.txt"
    slow_file.write_text("Read slowly.")
    window.composer.setPlainText("my draft")
    window.attach_files([str(slow_file)])
    window.edit_last()  # the draft, with the document still being read, is set aside
    gate.set()
    qtbot.waitUntil(lambda: not window.loader.pending, timeout=5_000)
    window.cancel_edit()
    assert _box(window) == ("my draft", ["slow.txt"], ["slow.txt"])
    send(qtbot, window, "my draft")
    assert [d.name for d in fake_model.sends()[-1]["documents"]] == ["slow.txt"]


def test_the_open_chats_draft_comes_back_after_a_restart(qtbot, make_window, fake_model, tmp_path):
    first = make_window()
    one, two = _two_chats(qtbot, first)
    first.conversations.select(one)
    first.composer.setPlainText("draft for one")
    first.conversations.select(two)
    first.composer.setPlainText("draft for two")
    _attach(qtbot, first, tmp_path / "note.txt")
    first.close()
    second = make_window()
    assert second.conversation_id == two
    qtbot.waitUntil(lambda: _box(second) == ("draft for two", ["note.txt"], ["note.txt"]), timeout=5_000)


def test_every_chats_draft_comes_back_after_a_restart(qtbot, make_window, fake_model, tmp_path):
    """Not only the open chat's: a draft left in another chat is there when that chat is opened after a restart,
    documents included (read again at the start)."""
    first = make_window()
    one, two = _two_chats(qtbot, first)
    first.conversations.select(one)
    first.composer.setPlainText("draft for one")
    _attach(qtbot, first, tmp_path / "note.txt")
    first.conversations.select(two)
    first.composer.setPlainText("draft for two")
    first.close()
    second = make_window()
    assert second.conversation_id == two
    qtbot.waitUntil(lambda: _box(second) == ("draft for two", [], []), timeout=5_000)
    second.conversations.select(one)
    qtbot.waitUntil(lambda: _box(second) == ("draft for one", ["note.txt"], ["note.txt"]), timeout=5_000)
    second.send()
    qtbot.waitUntil(lambda: not second.turns.busy, timeout=10_000)
    sent = fake_model.sends()[-1]
    assert sent["prompt"] == "draft for one" and [d.name for d in sent["documents"]] == ["note.txt"]
    second.conversations.select(two)
    assert _box(second) == ("draft for two", [], [])
    second.close()
    third = make_window()  # what was sent is not back; chat two's draft still is
    third.conversations.select(one)
    assert _box(third) == ("", [], [])
    third.conversations.select(two)
    qtbot.waitUntil(lambda: _box(third) == ("draft for two", [], []), timeout=5_000)


def test_a_document_still_being_read_at_close_comes_back(qtbot, make_window, fake_model, tmp_path, slow_reading):
    first = make_window()
    send(qtbot, first, "chat one")
    path = tmp_path / "slow.txt"
    path.write_text("Slow to read.")
    first.composer.setPlainText("about the slow file")
    first.attach_files([str(path)])
    assert list(first.attached.values()) == [None]  # still being read
    first.close()
    slow_reading.set()
    second = make_window()
    qtbot.waitUntil(lambda: _box(second) == ("about the slow file", ["slow.txt"], ["slow.txt"]), timeout=5_000)


def test_a_new_chats_unsent_message_waits_for_the_next_new_chat(qtbot, make_window, fake_model, tmp_path):
    window = make_window()
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.new_conversation()
    window.composer.setPlainText("a question for a new chat")
    _attach(qtbot, window, tmp_path / "note.txt")
    window.conversations.select(one)  # a look at an old chat
    assert _box(window) == ("", [], [])
    window.new_conversation()
    assert window.conversation_id is None
    assert _box(window) == ("a question for a new chat", ["note.txt"], ["note.txt"])
    window.conversations.select(one)
    window.close()
    second = make_window()  # after a restart too
    assert second.conversation_id == one and _box(second) == ("", [], [])
    second.new_conversation()
    qtbot.waitUntil(lambda: _box(second) == ("a question for a new chat", ["note.txt"], ["note.txt"]),
                    timeout=5_000)
    second.send()
    qtbot.waitUntil(lambda: not second.turns.busy, timeout=10_000)
    assert fake_model.sends()[-1]["prompt"] == "a question for a new chat"
    second.new_conversation()
    assert _box(second) == ("", [], [])  # sent: nothing waits any more


def test_a_new_chats_first_message_stopped_while_another_chat_is_shown_is_not_lost(qtbot, window, fake_model):
    send(qtbot, window, "chat one")
    one = window.conversation_id
    window.new_conversation()
    _send_slowly(qtbot, window, fake_model, "The first message of a new chat")
    window.conversations.select(one)
    window.stop()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=3_000)
    assert [c.id for c in window.store.conversations()] == [one]  # the emptied new chat is deleted
    assert _box(window) == ("", [], [])
    window.new_conversation()  # the emptied chat is gone; its message waits in the next new chat
    assert _box(window) == ("The first message of a new chat", [], [])
