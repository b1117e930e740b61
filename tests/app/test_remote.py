"""The app on an OpenAI-compatible server (engine.remote), through the real worker: our own server (in front of the
default model, on a loopback port) and a stand-in for any other server (vLLM, LM Studio... : the reply, nothing
else). A turn streams, stop works, regenerate works, the memory panel shows the server's figures or says they are
not reported, and the cache knobs are disabled with the reason unless the server is ours; a document's text is
tinted by our server's cache and a piece kept hot there. Also Serve: the app's
loaded model served to other programs while the app chats with it."""

from __future__ import annotations

import json
import sqlite3
import urllib.request

import pytest

from tests.serving import REPLY, free_port, served_in_thread, stub_app


def remote_window(qtbot, make_window, url: str, generation: dict | None = None):
    from app.settings import Key, Settings
    from app.worker import load_engine_model

    settings = Settings()
    settings.set_json(Key.MODEL, {"model_path": url, "weight_quant": "none", "device_map": "cpu",
                                  "max_seq_len": 4096})
    settings.set_json(Key.GENERATION, generation or {"max_new_tokens": 16, "temperature": 0.7, "greedy": True})
    settings.sync()
    window = make_window(load_engine_model, wait_loaded=False)
    qtbot.waitUntil(lambda: window.facts is not None or bool(window.shown_messages), timeout=60_000)
    assert window.facts is not None, window.shown_messages
    return window


def ask(qtbot, window, text: str, timeout: int = 120_000):
    window.composer.setPlainText(text)
    window.send()
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=timeout)
    return window.chat.bubbles[-1]


@pytest.fixture
def served_model(default_model):
    """The session's default model behind our server; its own settings come back afterwards whatever a test did
    (other tests rely on them)."""
    saved = default_model.config
    try:
        yield default_model
    finally:
        default_model.config = saved


@pytest.mark.model
@pytest.mark.slow
def test_the_app_on_our_own_server(qtbot, make_window, served_model, data_dir):
    default_model = served_model
    with served_in_thread(default_model) as base:
        window = remote_window(qtbot, make_window, base + "/v1")
        facts = window.facts
        assert facts.remote == "dsv41" and facts.context_limit == default_model.context_limit
        assert facts.config["cold_tier"] == window.knob_panel.values()["cold_tier"]  # the panel's knobs are sent
        assert "DS-V4.1 server" in window.model_panel.status.text()
        assert all(slider.isEnabled() for slider in window.knob_panel.sliders.values())
        assert not window.model_panel.weights.isEnabled()  # set on the server
        reply = ask(qtbot, window, "What is the capital of France?")
        assert not window.shown_messages, window.shown_messages
        assert "Paris" in reply.text and "tok/s" in reply.footer.text()
        # the memory panel shows the server's own figures for this conversation
        qtbot.waitUntil(lambda: window.memory_panel.report is not None
                        and window.memory_panel.report.tokens_seen > 0, timeout=10_000)
        report = window.memory_panel.report
        assert report.remote.startswith(base) and report.weights == default_model.weights_bytes
        assert window.memory_panel.device_label.text().startswith("Remote · 127.0.0.1")
        assert window.memory_panel.values["KV cache"].text().startswith(tuple("0123456789"))
        # the context bar counts as the server's engine counts (not an estimate)
        window.composer.setPlainText("And of Italy?")
        window._request_usage()
        qtbot.waitUntil(lambda: window.figures is not None and window.figures.prompt > 0, timeout=10_000)
        assert not window.figures.estimated and window.figures.history > 10
        assert "estimated" not in window.memory_panel.context_label.text()
        # a follow-up: the server reads only the new turn (the conversation extends what its cache holds)
        second = ask(qtbot, window, "And of Italy?")
        rows = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
            "SELECT stats_json FROM messages WHERE role='assistant' ORDER BY id").fetchall()
        first_prompt, second_prompt = (json.loads(r[0])["prefill_tokens"] for r in rows)
        assert second.text and second_prompt < first_prompt
        # a knob is validated here and sent with the next request
        window.knob_panel.set_values({"kv_cache_ratio": 0.3}, notify=True)
        qtbot.waitUntil(lambda: "Sent to the server" in window.knob_panel.status.text(), timeout=5_000)
        ask(qtbot, window, "Thanks.")
        # ... to this conversation's cache on the server (the served model's own knobs stay as they were)
        qtbot.waitUntil(lambda: window.memory_panel.report.kv_target_ratio == 0.3, timeout=10_000)
        assert default_model.config.kv_cache_ratio == 0.5
        window.knob_panel.set_values({"kv_cache_ratio": 0.5}, notify=True)
        qtbot.waitUntil(lambda: window.facts.config["kv_cache_ratio"] == 0.5, timeout=5_000)
        ask(qtbot, window, "Bye.")
        qtbot.waitUntil(lambda: window.memory_panel.report.kv_target_ratio == 0.5, timeout=10_000)
        window.close()


def test_the_heat_and_the_pins_of_a_chat_on_our_server(qtbot, make_window, tiny_folder, tmp_path, data_dir):
    """The document text window of a chat on our server: tinted by that server's cache, a selection kept hot there
    (through a compaction by a question about another part), the other server's case below says why there is none."""
    from PySide6.QtGui import QTextCursor
    from PySide6.QtWidgets import QLabel

    from engine import DSV41Config, DSV41Model

    items = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(48))
    piece = "Line 17: the value of item 17 is 119."
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0))
    path = tmp_path / "items.txt"
    path.write_text(items, encoding="utf-8")
    with served_in_thread(model) as base:
        window = remote_window(qtbot, make_window, base + "/v1")
        window.knob_panel.set_values({"kv_cache_ratio": 0.3, "cold_tier": "ram"}, notify=True)
        qtbot.waitUntil(lambda: "Sent to the server" in window.knob_panel.status.text(), timeout=5_000)
        window.attach_files([str(path)])
        qtbot.waitUntil(lambda: len(window.attached) == 1 and None not in window.attached.values(), timeout=10_000)
        read = []  # the server reports its reading of the prompt, as the local engine does
        window.client.worker.prefill_progress.connect(lambda turn, done, total: read.append((done, total)))
        ask(qtbot, window, "What is the value of item 40?")
        qtbot.waitUntil(lambda: bool(read) and read[-1][0] == read[-1][1] > 500, timeout=5_000)
        user = window.chat.bubbles[-2]
        next(label for label in user.findChildren(QLabel) if "items.txt" in label.text()).linkActivated.emit(
            "document:0")
        dialog = window.text_windows[-1]
        qtbot.waitUntil(lambda: dialog.heat is not None, timeout=10_000)
        assert "cache ratio 0.30" in dialog.heat_label.text() and dialog.tints()
        at = dialog.document_text.index(piece)
        cursor = dialog.text.textCursor()
        cursor.setPosition(at)
        cursor.setPosition(at + len(piece), QTextCursor.MoveMode.KeepAnchor)
        dialog.text.setTextCursor(cursor)
        dialog.keep_hot.click()
        qtbot.waitUntil(lambda: dialog.pins == [piece], timeout=10_000)
        assert "Kept hot" in window.statusBar().currentMessage() and not window.shown_messages
        pinned = dialog.heat
        ask(qtbot, window, "And the value of item 2?")  # another part: the server's compaction keeps the piece
        qtbot.waitUntil(lambda: dialog.heat is not pinned and dialog.heat is not None, timeout=10_000)  # follows
        shares = [dialog.share_at(i) for i in range(at, at + len(piece))]
        assert shares and set(shares) - {None} == {1.0}
        assert min(dialog.share_at(i) or 1.0 for i in range(len(items))) < 1.0  # other parts went cold
        assert dialog.pins_label.text() == "Kept hot: 1 part of this text"
        window.close()


def test_the_app_on_another_openai_compatible_server(qtbot, make_window, data_dir):
    app = stub_app()
    with served_in_thread(app) as base:
        window = remote_window(qtbot, make_window, base + "/v1")
        assert window.facts.remote == "openai" and window.facts.context_limit == 4096  # the panel's: none reported
        # the knobs are ours: disabled, with the reason; the reply options stay
        assert not any(slider.isEnabled() for slider in window.knob_panel.sliders.values())
        assert "not DS-V4.1" in window.knob_panel.status.text()
        assert window.knob_panel.max_tokens.isEnabled()
        reply = ask(qtbot, window, "Hi there")
        assert reply.text == REPLY and not window.shown_messages
        assert "tok/s" in reply.footer.text() and "KV" not in reply.footer.text()  # no KV figure it does not have
        sent = app.state.seen[-1]
        assert sent["messages"][-1] == {"role": "user", "content": "Hi there"} and sent["temperature"] == 0.0
        assert sent["max_tokens"] == 16 and sent["stream"] is True
        assert "kv_cache_ratio" not in sent  # no cache knobs to a server that has none
        qtbot.waitUntil(lambda: window.memory_panel.report is not None, timeout=5_000)
        assert window.memory_panel.values["Weights"].text() == "remote: not reported"
        assert "memory not reported" in window.memory_panel.device_label.text()
        window.composer.setPlainText("What next?")
        window._request_usage()
        qtbot.waitUntil(lambda: window.figures is not None and window.figures.prompt > 0, timeout=5_000)
        assert window.figures.estimated and "estimated from characters" in window.memory_panel.context_label.text()
        # the history travels with the next request, as any chat client sends it
        ask(qtbot, window, "Again")
        assert [m["content"] for m in app.state.seen[-1]["messages"]] == ["Hi there", REPLY, "Again"]
        # a document's text window has no tint to show: the server's cache is not visible from here
        from app.protocol import AttachedDocument

        dialog = window.show_document_text(AttachedDocument("k", "a.txt", "/a.txt", "txt", "Hi there", None, 8))
        qtbot.waitUntil(lambda: "runs on a server" in dialog.heat_label.text(), timeout=5_000)
        dialog.close()
        row = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
            "SELECT content, status FROM messages WHERE role='assistant' ORDER BY id DESC").fetchone()
        assert row == (REPLY, "done")
        # regenerate replaces the last reply through the server
        window.regenerate()
        qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
        assert [m["content"] for m in app.state.seen[-1]["messages"]] == ["Hi there", REPLY, "Again"]
        window.close()


def test_stop_closes_the_stream_and_keeps_the_partial_reply(qtbot, make_window, data_dir):
    app = stub_app(delay=0.05, words=400)  # 20 s of reply unless stopped
    with served_in_thread(app) as base:
        window = remote_window(qtbot, make_window, base + "/v1", {"max_new_tokens": 1000, "greedy": True})
        window.composer.setPlainText("Talk a lot")
        window.send()
        qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=10_000)
        window.stop()
        qtbot.waitUntil(lambda: not window.turns.busy, timeout=3_000)
        reply = window.chat.bubbles[-1]
        assert reply.text.startswith("w0") and len(reply.text.split()) < 400 and "stopped" in reply.footer.text()
        row = sqlite3.connect(data_dir / "conversations.sqlite3").execute(
            "SELECT content, status FROM messages WHERE role='assistant'").fetchone()
        assert row == (reply.text, "stopped")
        window.close()


def test_a_server_that_is_not_there_is_a_clear_load_failure(qtbot, make_window):
    from app.settings import Key, Settings
    from app.worker import load_engine_model

    settings = Settings()
    settings.set_json(Key.MODEL, {"model_path": f"http://127.0.0.1:{free_port()}/v1", "max_seq_len": 4096})
    settings.sync()
    window = make_window(load_engine_model, wait_loaded=False)
    qtbot.waitUntil(lambda: bool(window.shown_messages), timeout=30_000)
    title, text = window.shown_messages[-1]
    assert title == "Could not load the model" and "cannot be reached" in text and "python -m engine serve" in text
    assert window.facts is None


@pytest.mark.model
@pytest.mark.slow
def test_serve_shares_the_loaded_model_with_other_programs(qtbot, make_window):
    from app.settings import Key, Settings
    from app.worker import load_engine_model

    settings = Settings()
    settings.set_json(Key.MODEL, {"model_path": "default", "device_map": "cpu", "max_seq_len": 4096})
    settings.set_json(Key.GENERATION, {"max_new_tokens": 12, "greedy": True})
    settings.sync()
    window = make_window(load_engine_model, wait_loaded=False)
    qtbot.waitUntil(lambda: window.facts is not None, timeout=120_000)
    panel = window.model_panel
    assert panel.serve_button.isEnabled()
    panel.serve_port.setValue(free_port())
    panel.serve_button.setChecked(True)
    qtbot.waitUntil(lambda: panel.serve_address.text().startswith("serving http://127.0.0.1:"), timeout=15_000)
    address = panel.serve_address.text().removeprefix("serving ")
    assert panel.serve_button.text() == "Stop serving" and not panel.serve_port.isEnabled()
    request = urllib.request.Request(address + "/chat/completions", data=json.dumps({
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        served = json.loads(response.read())["choices"][0]["message"]["content"]
    reply = ask(qtbot, window, "What is the capital of France?")  # the app chats with the same model meanwhile
    assert "Paris" in served and "Paris" in reply.text
    panel.serve_button.setChecked(False)
    qtbot.waitUntil(lambda: panel.serve_address.text() == "", timeout=15_000)
    assert panel.serve_button.text() == "Serve" and panel.serve_port.isEnabled()
    with pytest.raises(OSError):
        urllib.request.urlopen(address + "/models", timeout=5)
    window.close()
