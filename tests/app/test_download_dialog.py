"""The download dialog in the window, against a local hub mirror (HF_ENDPOINT): find a repository's choices with
their fit estimates, download with progress to 100 %, then the window loads it; cancel; offline."""

from __future__ import annotations

import os
import threading

import pytest
from hub_mirror import HubMirror

CONFIG = ('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
          '"hidden_size": 64}')


@pytest.fixture
def hub(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(CONFIG)
    (repo / "model.safetensors").write_bytes(os.urandom(4_000_000))
    (repo / "model.Q8_0.gguf").write_bytes(os.urandom(30 << 20))
    mirror = HubMirror({"org/tiny": repo})
    monkeypatch.setenv("HF_ENDPOINT", mirror.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield mirror
    mirror.close()


def _find(qtbot, dialog, repo_id="org/tiny"):
    dialog.repo.setText(repo_id)
    dialog.find()
    qtbot.waitUntil(lambda: not dialog.busy, timeout=10_000)


def test_find_estimate_download_and_load(qtbot, window, fake_model, hub, data_dir):
    dialog = window.open_download()
    _find(qtbot, dialog)
    assert dialog.choices.count() == 2
    first = dialog.choices.item(0).text()
    assert first.startswith("safetensors (1 file) · 4 MB") and "fits:" in first and "free RAM" in first
    assert "KV" in first and "working" in first
    dialog.weights.setCurrentIndex(dialog.weights.findData("int4"))
    assert dialog.choices.item(0).text() != first  # the estimate follows the weights format
    dialog.choices.setCurrentRow(0)
    values = []
    dialog.progress.valueChanged.connect(values.append)
    with qtbot.waitSignal(dialog.downloaded, timeout=20_000) as done:
        dialog.start_download()
    path = done.args[0]
    assert path == str(data_dir / "models" / "org--tiny") and values[-1] == 1000
    assert (data_dir / "models" / "org--tiny" / "model.safetensors").stat().st_size == 4_000_000
    qtbot.waitUntil(lambda: window.facts is not None and not window.loading, timeout=10_000)
    assert window.model_panel.source.currentText() == path
    loads = [c for c in fake_model.calls if c[0] == "load"]
    assert loads[-1][3]["options"]["model_path"] == path


def test_cancel_a_download_and_the_messages_for_a_missing_repository_and_no_connection(qtbot, window, hub,
                                                                                      monkeypatch, data_dir):
    dialog = window.open_download()
    _find(qtbot, dialog)
    dialog.choices.setCurrentRow(1)  # the 30 MiB .gguf
    started = threading.Event()
    dialog.task = None
    dialog.start_download()
    dialog.task.progress.connect(lambda p: started.set())
    qtbot.waitUntil(started.is_set, timeout=10_000)
    dialog.cancel()
    qtbot.waitUntil(lambda: not dialog.busy, timeout=10_000)
    assert dialog.status.text().startswith("Cancelled")
    assert not (data_dir / "models" / "org--tiny" / "model.Q8_0.gguf").exists()
    _find(qtbot, dialog, "org/missing")
    assert "no model org/missing" in dialog.status.text() and dialog.choices.count() == 0
    hub.close()
    _find(qtbot, dialog)
    assert "cannot be reached" in dialog.status.text() and "Model folder…" in dialog.status.text()
    dialog.reject()
