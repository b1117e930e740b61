"""EngineWorker on its own thread: batching, stop, errors as outcomes, token counts."""

from __future__ import annotations

import threading

import pytest
from gui_fakes import FakeModel, fake_factory

from app.protocol import AttachedDocument, GenerationOptions, TurnRequest
from app.worker import EngineClient


@pytest.fixture
def client(qtbot):
    model = FakeModel()
    client = EngineClient(fake_factory(model))
    client.model = model
    loaded = []
    client.worker.loaded.connect(loaded.append)
    client.load_model.emit({"max_seq_len": 8192})
    qtbot.waitUntil(lambda: bool(loaded), timeout=5_000)
    yield client
    client.shutdown()


def run_turn(qtbot, client, prompt, turn_id=1, documents=(), **gen):
    outcomes, batches = [], []
    client.worker.turn_finished.connect(outcomes.append)
    client.worker.tokens.connect(lambda t, text: batches.append(text))
    client.send_turn(TurnRequest(turn_id, 1, (), prompt, tuple(documents), GenerationOptions(**gen)))
    qtbot.waitUntil(lambda: bool(outcomes), timeout=10_000)
    return outcomes[0], batches


def test_turns_run_on_the_worker_thread_and_tokens_come_in_batches(qtbot, client):
    client.model.token_delay = 0.01
    client.model.reply_text = " ".join(f"t{i}" for i in range(100))
    outcome, batches = run_turn(qtbot, client, "hi")
    assert outcome.reason == "eos" and outcome.text == client.model.reply_text
    assert "".join(batches) == outcome.text
    assert len(batches) < 40  # 100 tokens at ~10 ms each, coalesced for ~40 ms
    threads = {c[2] for c in client.model.calls if c[0] in ("send", "turn_start")}
    assert threading.current_thread().name not in threads
    assert outcome.model_content == "hi"


def test_stop_is_seen_while_the_worker_is_busy(qtbot, client):
    client.model.token_delay = 0.05
    client.model.reply_text = " ".join(f"t{i}" for i in range(200))
    outcomes = []
    client.worker.turn_finished.connect(outcomes.append)
    client.send_turn(TurnRequest(7, 1, (), "go", (), GenerationOptions()))
    qtbot.wait(300)
    client.stop()
    qtbot.waitUntil(lambda: bool(outcomes), timeout=10_000)
    assert outcomes[0].reason == "cancelled" and 0 < len(outcomes[0].text.split()) < 200
    assert not client.busy


def test_engine_exceptions_become_outcomes(qtbot, client):
    outcome, _ = run_turn(qtbot, client, "CRASH please")
    assert outcome.reason == "error" and outcome.error_kind == "error" and "simulated bug" in outcome.error
    outcome, _ = run_turn(qtbot, client, "OVERFLOW", turn_id=2)
    assert outcome.reason == "refused" and outcome.error_kind == "overflow" and outcome.overflow["needed"] == 9000
    outcome, _ = run_turn(qtbot, client, "fine again", turn_id=3)
    assert outcome.reason == "eos"


def test_document_tokens_are_counted_on_the_worker(qtbot, client):
    doc = AttachedDocument("d1", "a.txt", "/tmp/a.txt", "text", "word " * 400, None, 2000)
    counted = []
    client.worker.document_tokens.connect(lambda key, n: counted.append((key, n)))
    client.count_document.emit(doc)
    qtbot.waitUntil(lambda: bool(counted), timeout=5_000)
    assert counted[0][0] == "d1" and counted[0][1] > 400
