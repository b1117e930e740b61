"""Per-chat system prompt and settings, sampling options, and the keyboard (on the fake engine)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from conftest import send
from PySide6.QtCore import Qt

from app.protocol import GenerationOptions
from app.store import ConversationStore


def _set_prompt(qtbot, window, text):
    window.system_prompt.toggle.setChecked(True)
    window.system_prompt.editor.setPlainText(text)
    window.system_prompt.flush()


def test_the_system_prompt_reaches_the_engine_is_saved_per_chat_and_counted(qtbot, window, fake_model):
    _set_prompt(qtbot, window, "You are a concise assistant.")
    assert "concise assistant" in window.system_prompt.toggle.text()
    send(qtbot, window, "Hello")
    first = window.conversation_id
    assert fake_model.sessions[-1].messages[0] == {"role": "system", "content": "You are a concise assistant."}
    assert ConversationStore().system_prompt(first) == "You are a concise assistant."
    assert window.chat.bubbles and window.turns.active is None
    qtbot.waitUntil(lambda: window.figures is not None and window.figures.system > 0, timeout=5000)
    # editing it applies to the next turn (the engine reads the chat again under it)
    _set_prompt(qtbot, window, "Answer in French.")
    send(qtbot, window, "Again")
    assert fake_model.sessions[-1].messages[0]["content"] == "Answer in French."
    assert ConversationStore().system_prompt(first) == "Answer in French."
    # a new chat starts without one (no default set), and the first chat keeps its own
    window.new_conversation()
    assert window.system_prompt.text() == ""
    send(qtbot, window, "Other chat")
    assert fake_model.sends()[-1]["history"] == []
    window.show_conversation(first)
    assert window.system_prompt.text() == "Answer in French."


def test_use_for_new_chats_makes_the_default(qtbot, make_window, fake_model):
    window = make_window()
    _set_prompt(qtbot, window, "Cite the page.")
    window.system_prompt.default_button.click()
    send(qtbot, window, "Hi")
    window.new_conversation()
    assert window.system_prompt.text() == "Cite the page."
    window.close()
    again = make_window()
    again.new_conversation()
    assert again.system_prompt.text() == "Cite the page."


def test_a_chat_brings_back_its_knobs_and_reply_options(qtbot, make_window, fake_model):
    window = make_window()
    panel = window.knob_panel
    panel.set_values({"kv_cache_ratio": 0.3}, notify=True)
    panel.top_k.setValue(10)
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.3, timeout=5000)
    send(qtbot, window, "Chat A")
    chat_a = window.conversation_id
    window.new_conversation()
    panel.set_values({"kv_cache_ratio": 0.8}, notify=True)
    panel.top_k.setValue(40)
    send(qtbot, window, "Chat B")
    chat_b = window.conversation_id
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.8, timeout=5000)
    stored = ConversationStore().chat_settings(chat_a)
    assert stored["knobs"]["kv_cache_ratio"] == 0.3 and stored["generation"]["top_k"] == 10

    window.show_conversation(chat_a)
    assert panel.values()["kv_cache_ratio"] == 0.3 and panel.generation().top_k == 10
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.3, timeout=5000)  # applied to the engine
    window.show_conversation(chat_b)
    assert panel.values()["kv_cache_ratio"] == 0.8 and panel.generation().top_k == 40
    # a restart opens the last chat with its own settings
    window.close()
    again = make_window()
    assert again.conversation_id == chat_b
    assert again.knob_panel.values()["kv_cache_ratio"] == 0.8 and again.knob_panel.generation().top_k == 40


def test_sampling_options_reach_the_engine_within_its_ranges(qtbot, window, fake_model):
    panel = window.knob_panel
    panel.top_p.setValue(0.5)
    panel.top_k.setValue(7)
    panel.repetition_penalty.setValue(1.3)
    panel.seed.setValue(42)
    panel.temperature.setValue(0.9)
    send(qtbot, window, "Sample")
    settings = fake_model.sends()[-1]["settings"]
    assert settings["top_p"] == 0.5 and settings["top_k"] == 7 and settings["repetition_penalty"] == 1.3
    assert settings["seed"] == 42 and settings["temperature"] == 0.9 and settings["greedy"] is False
    panel.seed.setValue(-1)
    assert panel.seed.text() == "random" and panel.generation().seed is None
    panel.top_k.setValue(0)
    assert panel.top_k.text() == "off"
    # every value the spin boxes allow is one the engine accepts
    from engine.config import GenerationSettings

    for box in (panel.top_p, panel.top_k, panel.repetition_penalty, panel.temperature, panel.seed):
        for value in (box.minimum(), box.maximum()):
            box.setValue(value)
            GenerationSettings(**panel.generation().__dict__)
    panel.greedy.setChecked(True)
    assert not panel.top_p.isEnabled() and not panel.seed.isEnabled()
    # stale or hand-edited saved options fall back to the defaults field by field
    options = GenerationOptions.from_dict({"top_p": 0, "top_k": "x", "repetition_penalty": 1.5, "bogus": 1})
    assert options.top_p == 0.9 and options.top_k == 50 and options.repetition_penalty == 1.5


def test_esc_stops_a_reply_and_its_reading(qtbot, window, fake_model):
    fake_model.prefill_delay = 0.2
    fake_model.prefill_steps = 20
    send(qtbot, window, "Read slowly", wait=False)
    qtbot.waitUntil(lambda: any(c[0] == "turn_start" for c in fake_model.calls), timeout=5000)
    qtbot.keyClick(window.composer, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=2000)  # within a step (0.2 s), not the 4 s prefill
    fake_model.prefill_delay, fake_model.prefill_steps = 0.005, 4
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(200))
    send(qtbot, window, "Talk long", wait=False)
    qtbot.waitUntil(lambda: window.turns.active is not None and len(window.turns.active.text) > 10, timeout=5000)
    qtbot.keyClick(window.composer, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=2000)
    reply = [b for b in window.chat.bubbles if b.role == "assistant"][-1]
    assert 0 < len(reply.text) < len(fake_model.reply_text)


def test_keyboard_up_edits_the_last_message_ctrl_f_searches_and_help_lists_the_shortcuts(qtbot, window):
    send(qtbot, window, "first")
    send(qtbot, window, "second")
    window.composer.setFocus()
    qtbot.keyClick(window.composer, Qt.Key.Key_Up)
    assert window.editing_message_id is not None and window.composer.toPlainText() == "second"
    qtbot.keyClick(window.composer, Qt.Key.Key_Escape)  # leaves the edit
    assert window.editing_message_id is None and window.composer.toPlainText() == ""
    window.composer.setPlainText("typing")
    qtbot.keyClick(window.composer, Qt.Key.Key_Up)  # not empty: the cursor moves, nothing is edited
    assert window.editing_message_id is None
    window.actions_by_name["search"].trigger()
    assert window.focusWidget() is window.conversations.search  # (hasFocus also needs the window active)
    assert window.actions_by_name["new"].shortcut().toString() == "Ctrl+N"
    assert window.actions_by_name["search"].shortcut().toString() == "Ctrl+F"
    assert window.actions_by_name["stop"].shortcut().toString() == "Esc"
    window.actions_by_name["shortcuts"].trigger()
    title, text = window.shown_messages[-1]
    assert title == "Keyboard shortcuts" and "Ctrl+N — New chat" in text and "Esc" in text and "Up" in text
    menus = [a.text() for a in window.menuBar().actions()]
    assert menus == ["&Chat", "&View", "&Help"]


def test_a_database_from_before_chat_settings_opens_and_gains_them(data_dir):
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "conversations.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
                                    updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL, role TEXT NOT NULL,
            content TEXT NOT NULL DEFAULT '', model_content TEXT, status TEXT NOT NULL DEFAULT 'done', error TEXT,
            stats_json TEXT, settings_json TEXT, created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE attachments (id INTEGER PRIMARY KEY, message_id INTEGER NOT NULL, name TEXT NOT NULL,
            path TEXT NOT NULL, kind TEXT NOT NULL, pages INTEGER, chars INTEGER NOT NULL, tokens INTEGER,
            text TEXT NOT NULL);
        INSERT INTO conversations VALUES (1, 'old chat', 0, 0);
        INSERT INTO messages(conversation_id, role, content, created, updated) VALUES (1, 'user', 'hi', 0, 0);
        INSERT INTO messages(conversation_id, role, content, created, updated) VALUES (1, 'assistant', 'hello', 0, 0);
        PRAGMA user_version=1;
    """)
    db.close()
    store = ConversationStore(path)
    assert store.system_prompt(1) == "" and store.chat_settings(1) is None
    assert [m.content for m in store.messages(1)] == ["hi", "hello"]
    # an old chat's reply becomes the first version when it is regenerated
    new = store.add_version(1, 1)
    store.finish_reply(new, "hello again", "done")
    assert store.versions(new) == [2, new] and [m.content for m in store.messages(1)] == ["hi", "hello again"]
    store.select_version(2)
    assert [m.content for m in store.messages(1)] == ["hi", "hello"]
    assert [t.reply for t in store.history(1)] == ["hello"]
    store.set_system_prompt(1, "Be kind.")
    store.set_chat_settings(1, {"knobs": {"kv_cache_ratio": 0.4}})
    assert store.system_prompt(1) == "Be kind." and store.chat_settings(1)["knobs"]["kv_cache_ratio"] == 0.4
    assert store.export_json(1)["system_prompt"] == "Be kind."
    assert "## System prompt" in store.export_markdown(1)


def _overlaps(widgets) -> list[tuple[str, str]]:
    """Pairs of visible sibling widgets whose rectangles (in window coordinates) intersect."""
    rects = []
    for w in widgets:
        if w.isVisible() and w.width() > 0:
            top_left = w.mapTo(w.window(), w.rect().topLeft())
            rects.append((w, w.rect().translated(top_left)))
    return [(a.objectName() or type(a).__name__, b.objectName() or type(b).__name__)
            for i, (a, ra) in enumerate(rects) for b, rb in rects[i + 1:] if ra.intersects(rb)]


def test_the_window_lays_out_at_1024x700_and_1280x720_without_overlaps(qtbot, window):
    from PySide6.QtWidgets import QAbstractButton, QComboBox, QLabel, QSpinBox, QWidget

    send(qtbot, window, "hello")
    reply = window.chat.bubbles[-1]
    reply.set_footer("TTFT 0.10 s · 64.6 tok/s · 64 tokens · KV ×1.05 · conversation re-read · reached max new "
                     "tokens · recalled in 88 ms")  # as long as a real one gets
    reply.set_versions(3, 3)
    for width, height in ((1024, 700), (1280, 720)):
        window.resize(width, height)
        qtbot.waitUntil(lambda w=width: window.width() == w, timeout=2000)
        assert window.height() == height and window.minimumSizeHint().width() <= 1024
        panel = window.model_panel
        controls = [w for w in panel.findChildren(QWidget)
                    if w.parent() is panel and isinstance(w, (QAbstractButton, QComboBox, QLabel, QSpinBox))]
        assert len(controls) >= 10 and not _overlaps(controls)
        assert panel.status.width() >= 400  # the status line has a row of its own: readable
        buttons = [window.attach_button, window.edit_button, window.regenerate_button, window.stop_button,
                   window.send_button]
        assert not _overlaps(buttons)
        assert not _overlaps([window.conversations, window.chat, window.side_panel])
        assert window.chat.width() >= 300 and window.send_button.geometry().right() < window.width()

        def cut():  # bubbles past the chat's right edge (the layout settles once a scroll bar comes or goes)
            viewport = window.chat.viewport()
            return [(b.role, b.mapTo(viewport, b.rect().topRight()).x(), viewport.width())
                    for b in window.chat.bubbles if b.mapTo(viewport, b.rect().topRight()).x() > viewport.width()]

        qtbot.waitUntil(lambda: not cut(), timeout=3000)
    # the side panels collapse from the View menu, and the chat takes their room
    before = window.chat.width()
    window.actions_by_name["show_side"].setChecked(False)
    window.actions_by_name["show_chats"].setChecked(False)
    qtbot.waitUntil(lambda: window.chat.width() > before + 300, timeout=2000)
    assert not window.side_panel.isVisible() and not window.conversations.isVisible()
    window.actions_by_name["show_side"].setChecked(True)
    assert window.side_panel.isVisible()


def test_the_export_dialog_opens_in_the_documents_folder(qtbot, window, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog

    import app.window as window_module

    assert window_module.export_folder().is_dir() and window_module.export_folder() != Path.cwd()
    documents = tmp_path / "Documents"
    documents.mkdir()
    monkeypatch.setattr(window_module, "export_folder", lambda: documents)
    asked = []
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda parent, title, suggested, filters: (asked.append(suggested), (suggested, filters))[1])
    send(qtbot, window, "Export me")
    path = window.export_conversation(window.conversation_id, "md")
    assert asked == [str(documents / "Export me.md")] and path == asked[0]
    assert "Export me" in (documents / "Export me.md").read_text(encoding="utf-8")
