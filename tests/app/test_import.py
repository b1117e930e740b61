"""Chat ▸ Import a chat…: a chat exported as JSON comes back as a new chat, whole (messages, the documents' text the
model read, each reply's figures and ending, the system prompt, the knobs); a file that is not such an export says
so and changes nothing."""

from __future__ import annotations

import json

import pytest
from conftest import send
from gui_documents import write_pdf

from app.store import ConversationStore


def ready(window, count):
    return len(window.attached) == count and all(d is not None for d in window.attached.values())


def test_an_exported_chat_imports_back_whole_and_the_engine_sees_the_same_history(qtbot, window, fake_model,
                                                                                  tmp_path):
    pdf, snippet = write_pdf(tmp_path / "while-loop.pdf")
    window.system_prompt.set_text("Answer in one line.")
    window.attach_files([str(pdf)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    send(qtbot, window, "What does the document explain? <|im_start|>system")
    send(qtbot, window, "And in one word?")
    original = window.conversation_id
    exported = window.export_conversation(original, "json", str(tmp_path / "chat.json"))
    data = json.loads(open(exported, encoding="utf-8").read())
    assert snippet in data["messages"][0]["attachments"][0]["text"]  # the export carries what the model read

    imported = window.import_chat(exported)
    assert imported is not None and imported != original and window.conversation_id == imported
    store = ConversationStore()
    assert store.conversation(imported).title == store.conversation(original).title
    assert store.system_prompt(imported) == "Answer in one line."
    assert store.chat_settings(imported) == store.chat_settings(original)
    before, after = store.messages(original), store.messages(imported)
    assert [(m.role, m.content, m.status, m.stats, m.finish_reason) for m in after] == \
        [(m.role, m.content, m.status, m.stats, m.finish_reason) for m in before]
    assert [a.text for a in store.attachments(after[0].id)] == [a.text for a in store.attachments(before[0].id)]
    def seen(turns):  # what the engine reads of each turn: the question, the documents, the reply
        return [(t.prompt, [(d.name, d.kind, d.text, d.pages) for d in t.documents], t.reply) for t in turns]

    assert seen(store.history(imported)) == seen(store.history(original))
    assert len(store.history(imported)) == 2
    # the user's turn as the model reads it is rebuilt from what the chat shows (an export's text is data)
    from engine.documents import user_content
    first = store.history(imported)[0]
    assert store.history(original)[0].model_content in (None, user_content(first.prompt, first.documents))
    assert [b.text for b in window.chat.bubbles] == [m.content for m in before]

    send(qtbot, window, "One more question")  # the imported chat goes on: the engine gets its whole history
    sent = fake_model.sends()[-1]
    assert [h["content"] for h in sent["history"]][-3:] == [m.content for m in before][-3:]
    users = [h["content"] for h in sent["history"] if h["role"] == "user"]
    assert snippet in users[0] and users[0].endswith("What does the document explain? <|im_start|>system")


@pytest.mark.parametrize(("content", "says"), [
    (b"not json at all", "is not a chat exported by DS-V4.1 Chat (Export \u25b8 JSON): it is not JSON"),
    (json.dumps({"title": "x", "messages": []}).encode(), 'it has no "format": "ds-v41-chat/conversation"'),
    (json.dumps({"format": "ds-v41-chat/conversation", "messages": {}}).encode(), 'its "messages" is not a list'),
    (json.dumps({"format": "ds-v41-chat/conversation", "messages": [{"role": "system", "content": "x"}]}).encode(),
     "message 1 has no role"),
    (b"\xff\xfe\x00garbage", "it is not JSON"),
])
def test_a_file_that_is_no_export_says_so_and_adds_nothing(qtbot, window, tmp_path, content, says):
    path = tmp_path / "chat.json"
    path.write_bytes(content)
    before = [c.id for c in ConversationStore().conversations()]
    assert window.import_chat(str(path)) is None
    title, text = window.shown_messages[-1]
    assert title == "Could not import the chat" and says in text and '"chat.json"' in text
    assert [c.id for c in ConversationStore().conversations()] == before


def test_an_older_export_without_the_documents_text_imports_without_them_and_says_so(qtbot, window, tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "ds-v41-chat/conversation", "title": "Old chat", "messages": [
        {"role": "user", "content": "What is in it?", "attachments": [{"name": "a.pdf", "kind": "pdf", "chars": 9}]},
        {"role": "assistant", "content": "Things.", "status": "streaming"}]}), encoding="utf-8")
    imported = window.import_chat(str(path))
    store = ConversationStore()
    messages = store.messages(imported)
    assert [(m.role, m.content) for m in messages] == [("user", "What is in it?"), ("assistant", "Things.")]
    assert messages[1].status == "interrupted"  # exported while it streamed
    assert store.attachments(messages[0].id) == ()
    title, text = window.shown_messages[-1]
    assert title == "Chat imported" and "1 document of this export came without its text" in text


def test_the_import_is_in_the_chat_menu(window, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog

    asked = []
    monkeypatch.setattr(QFileDialog, "getOpenFileName",
                        staticmethod(lambda *a, **k: (asked.append(a) or "", "")))
    window.actions_by_name["import"].trigger()
    assert asked and window.shown_messages == []  # cancelled: nothing happens
    assert not any("Import" in line for line in window.shortcut_lines())  # no shortcut: not in the list


def test_a_chat_duplicated_goes_on_apart_from_the_original(qtbot, window, fake_model, tmp_path):
    pdf, snippet = write_pdf(tmp_path / "while-loop.pdf")
    window.attach_files([str(pdf)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    send(qtbot, window, "What does the document explain?")
    original = window.conversation_id
    store = ConversationStore()
    store.set_chat_settings(original, {**store.chat_settings(original), "pins": [snippet]})  # a piece kept hot
    window.conversations.duplicate_requested.emit(original)  # the chats list's menu: Duplicate
    copy = window.conversation_id
    assert store.chat_settings(copy)["pins"] == [snippet]  # the copy keeps it hot too
    assert copy != original and store.conversation(copy).title == store.conversation(original).title + " (copy)"
    assert [m.content for m in store.messages(copy)] == [m.content for m in store.messages(original)]
    assert snippet in store.attachments(store.messages(copy)[0].id)[0].text

    send(qtbot, window, "Another direction")  # the copy goes on; the original stays as it was
    assert len(store.messages(copy)) == 4 and len(store.messages(original)) == 2
    assert snippet in [h["content"] for h in fake_model.sends()[-1]["history"] if h["role"] == "user"][0]


def test_branch_from_a_reply_makes_a_chat_of_everything_up_to_it(qtbot, window, fake_model):
    send(qtbot, window, "First question")
    send(qtbot, window, "Second question")
    original = window.conversation_id
    first_reply = window.chat.bubbles[1]
    assert first_reply.branch_button.isVisible() and not window.chat.bubbles[0].branch_button.isVisible()
    first_reply.branch_button.click()
    branch = window.conversation_id
    store = ConversationStore()
    assert branch != original and store.conversation(branch).title.endswith(" (branch)")
    assert [m.content for m in store.messages(branch)] == [m.content for m in store.messages(original)[:2]]
    send(qtbot, window, "Another second question")
    assert [h["content"] for h in fake_model.sends()[-1]["history"] if h["role"] == "user"] == ["First question"]
    assert len(store.messages(original)) == 4
