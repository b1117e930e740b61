"""EngineWorker on its own thread: batching, stop, errors as outcomes, token counts."""

from __future__ import annotations

import threading

import pytest
from gui_fakes import FakeModel, fake_factory

from app.protocol import AttachedDocument, GenerationOptions, TurnRequest, UsageRequest
from app.worker import EngineClient
from engine.errors import ConfigError, ModelLoadError


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
    # `outcomes` heard the signal on the worker thread; the client hears it queued on this one, a moment later
    qtbot.waitUntil(lambda: not client.busy, timeout=2_000)


def test_engine_exceptions_become_outcomes(qtbot, client):
    outcome, _ = run_turn(qtbot, client, "CRASH please")
    assert outcome.reason == "error" and outcome.error_kind == "error" and "simulated bug" in outcome.error
    outcome, _ = run_turn(qtbot, client, "OVERFLOW", turn_id=2)
    assert outcome.reason == "refused" and outcome.error_kind == "overflow" and outcome.overflow["needed"] == 9000
    outcome, _ = run_turn(qtbot, client, "fine again", turn_id=3)
    assert outcome.reason == "eos"


def test_usage_and_document_figures_come_from_the_engine(qtbot, client):
    """The context bar's counts and each document's tokens and KV bytes are the model's answers, at the knobs the
    panel shows; a document's bytes are its share of the cache after what comes before it."""
    from app.worker import _engine_document

    model = client.model
    docs = (AttachedDocument("d1", "a.txt", "/tmp/a.txt", "text", "word " * 400, None, 2000),
            AttachedDocument("d2", "b.txt", "/tmp/b.txt", "text", "more " * 100, None, 500))
    figures, usages = [], []
    client.worker.document_figures.connect(figures.append)
    client.worker.usage.connect(usages.append)
    client.count_usage.emit(UsageRequest(None, (), "a question", docs, {"kv_cache_ratio": 0.2}))
    qtbot.waitUntil(lambda: bool(usages), timeout=5_000)
    first, second = figures[0]
    prompt = model.count_tokens("a question")
    assert (first.key, second.key) == ("d1", "d2")
    assert first.tokens == model.document_tokens(_engine_document(docs[0])) > 400
    assert first.kv_after == model.stored_kv_bytes(prompt + first.tokens, kv_cache_ratio=0.2)
    assert first.kv_bytes == first.kv_after - model.stored_kv_bytes(prompt, kv_cache_ratio=0.2)
    assert second.kv_after == model.stored_kv_bytes(prompt + first.tokens + second.tokens, kv_cache_ratio=0.2)
    assert first.kv_bytes + second.kv_bytes == second.kv_after - model.stored_kv_bytes(prompt, kv_cache_ratio=0.2)
    assert first.kv_cache_ratio == 0.2 and model.config.kv_cache_ratio == 0.5  # figured at, not applied
    assert usages[0].documents == first.tokens + second.tokens and usages[0].prompt == prompt
    assert usages[0].limit == model.context_limit


def test_a_history_turn_is_laid_out_as_the_engine_lays_out_a_turn(qtbot, client):
    from app.protocol import HistoryTurn
    from app.worker import _engine_document
    from engine.documents import user_content

    doc = AttachedDocument("d1", "a.txt", "/tmp/a.txt", "text", "Some notes.", None, 11)
    history = (HistoryTurn("What do the notes say?", (doc,), "They say little."),)
    outcomes = []
    client.worker.turn_finished.connect(outcomes.append)
    client.send_turn(TurnRequest(1, 5, history, "And then?", (), GenerationOptions()))
    qtbot.waitUntil(lambda: bool(outcomes), timeout=10_000)
    sent = client.model.sends()[-1]["history"]
    assert sent[0] == {"role": "user", "content": user_content("What do the notes say?", [_engine_document(doc)])}
    assert sent[1] == {"role": "assistant", "content": "They say little."}


def test_errors_are_told_apart_by_their_type():
    import torch

    from app.worker import _is_oom
    from engine.errors import EngineError

    assert _is_oom(MemoryError()) and _is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert _is_oom(ModelLoadError("The model does not fit.", reason="oom"))
    assert not _is_oom(ModelLoadError("Not found.", reason="missing"))

    class OutOfMemoryError(EngineError):  # the name alone says nothing
        pass

    assert not _is_oom(OutOfMemoryError("x"))


@pytest.mark.parametrize(("error", "reason", "message"), [
    (ConfigError("max_seq_len", 5, "an integer in [16, 1048576]"), "config", "max_seq_len=5 is not allowed"),
    (MemoryError(), "oom", "MemoryError"),
    (ValueError("weird header"), "load_failed", "ValueError: weird header"),
    (ModelLoadError("The file is damaged.", reason="corrupt"), "corrupt", "The file is damaged."),
])
def test_a_failed_load_says_why_by_the_errors_type(qtbot, error, reason, message):
    client = EngineClient(fake_factory(FakeModel(), fail=error))
    failures = []
    client.worker.load_failed.connect(lambda *args: failures.append(args))
    client.load_model.emit({"max_seq_len": 8192})
    qtbot.waitUntil(lambda: bool(failures), timeout=5_000)
    client.shutdown()
    got_message, got_reason, kept = failures[0]
    assert got_reason == reason and got_message.startswith(message) and kept is None


def test_knobs_for_a_chat_not_read_yet_touch_no_other_chats_cache_and_its_figures_are_its_own(qtbot, client):
    """A chat opened without a live cache sends its knobs: they are kept for its next question (the model's knobs
    a new session starts with), not applied to the chat that has a cache; its memory figures show no cache rather
    than that other chat's."""
    run_turn(qtbot, client, "hello there")  # conversation 1 has a live cache
    results, reports = [], []
    client.worker.reconfigured.connect(lambda result, facts: results.append(result))
    client.worker.memory.connect(reports.append)
    client.reconfigure.emit((2, {"kv_cache_ratio": 0.3}))
    qtbot.waitUntil(lambda: bool(results) and bool(reports), timeout=5_000)
    assert results[0].action == "set" and "reconfigure" not in client.model.names()
    assert client.model.config.kv_cache_ratio == 0.3
    assert reports[-1].tokens_seen == 0  # conversation 2's (none), not conversation 1's
    reports.clear()
    client.report_memory.emit(1)
    qtbot.waitUntil(lambda: bool(reports), timeout=5_000)
    assert reports[-1].tokens_seen > 0
    failed = []
    client.worker.reconfigure_failed.connect(failed.append)
    client.reconfigure.emit((2, {"kv_cache_ratio": 1.7}))
    qtbot.waitUntil(lambda: bool(failed), timeout=5_000)
    assert "kv_cache_ratio" in failed[0] and client.model.config.kv_cache_ratio == 0.3
