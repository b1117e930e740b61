"""A chat found by the chats list's search shows where: every occurrence of the searched text is marked in its
messages, and the transcript scrolls to the first message holding it. Each message says when it was written (its
role's tooltip)."""

from __future__ import annotations

from conftest import send
from PySide6.QtWidgets import QAbstractSlider


def marks(bubble) -> list[str]:
    return [s.cursor.selectedText() for s in bubble.view.extraSelections()]


def test_a_chat_opened_from_a_search_marks_the_text_and_scrolls_to_it(qtbot, window):
    window.resize(900, 500)
    for n in range(4):  # a long chat, the match in its middle: neither its top nor its end shows it
        send(qtbot, window, f"A question, number {n}, about something else entirely.")
    send(qtbot, window, "Where do Marmalade Penguins nest? I read about marmalade penguins once.")
    found = window.conversation_id
    for n in range(4):
        send(qtbot, window, f"Another question, number {n}, about something else entirely.")
    window.new_conversation()
    send(qtbot, window, "Tell me about potatoes")
    assert window.conversation_id != found

    window.conversations.search.setText("marmalade penguins")
    qtbot.waitUntil(lambda: window.conversations.ids() == [found], timeout=5_000)
    window.conversations.select(found)  # the user clicks the chat found
    qtbot.waitUntil(lambda: window.conversation_id == found, timeout=5_000)
    first = window.chat.bubbles[8]
    assert marks(first) == ["Marmalade Penguins", "marmalade penguins"]  # case ignored, as the search does
    assert [b for b in window.chat.bubbles if marks(b) and b.role == "user"] == [first]
    bar = window.chat.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 2 * window.chat.viewport().height(), timeout=2_000)
    qtbot.wait(50)  # the transcript lays out
    top = first.mapTo(window.chat.widget(), first.rect().topLeft()).y()
    assert 0 < bar.value() <= top <= bar.value() + window.chat.viewport().height()  # the match is in sight

    # the user scrolls away: the transcript no longer goes back to the match when it lays out again
    bar.triggerAction(QAbstractSlider.SliderAction.SliderToMaximum)
    window.resize(900, 560)
    qtbot.waitUntil(lambda: bar.value() == bar.maximum() and bar.value() > top, timeout=2_000)

    window.conversations.search.setText("")  # the search ends: no marks
    qtbot.waitUntil(lambda: not marks(window.chat.bubbles[8]), timeout=2_000)


def test_opening_a_chat_without_a_search_marks_nothing(qtbot, window):
    send(qtbot, window, "Where do marmalade penguins nest?")
    chat = window.conversation_id
    window.new_conversation()
    window.show_conversation(chat)
    assert all(not marks(b) for b in window.chat.bubbles)
    assert window.chat.highlight("no such words") is None


def test_each_message_says_when_it_was_sent_and_answered(qtbot, window):
    import time

    send(qtbot, window, "What time is it?")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    user, reply = window.chat.bubbles[-2:]
    assert user.role_label.toolTip() in (f"Sent {stamp}", f"Sent {time.strftime('%Y-%m-%d %H:%M')}")
    assert reply.role_label.toolTip().startswith("Answered ")
    from app.store import ConversationStore

    saved = ConversationStore().messages(window.conversation_id)[0].created
    window.show_conversation(window.conversation_id)  # reopened: from the stored time
    assert window.chat.bubbles[0].role_label.toolTip() == "Sent " + time.strftime("%Y-%m-%d %H:%M",
                                                                                   time.localtime(saved))
