"""Downloads from the hub (app/download.py) against a local mirror on 127.0.0.1 (tests/app/hub_mirror.py):
the choices a repository offers, progress to 100 %, cancel (no half file at the final place, finished files kept,
a new download skips them), a dropped connection resumed by huggingface_hub, and clear messages for a 404, an
unknown repository, a malformed id and no connection."""

from __future__ import annotations

import os
import threading

import pytest
from hub_mirror import HubMirror

from app import download


@pytest.fixture
def hub(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (repo / "tokenizer.json").write_text("{}")
    (repo / "model-00001-of-00002.safetensors").write_bytes(os.urandom(3_000_000))
    (repo / "model-00002-of-00002.safetensors").write_bytes(os.urandom(12_000_000))
    (repo / "model.Q4_K_M.gguf").write_bytes(os.urandom(2_000_000))
    (repo / "README.md").write_text("a model card")
    mirror = HubMirror({"org/tiny": repo})
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    yield mirror, repo
    mirror.close()


def test_a_repository_lists_its_choices_with_sizes(hub):
    mirror, repo = hub
    files = download.list_files("org/tiny", endpoint=mirror.url)
    safetensors, gguf = files.choices
    assert safetensors.kind == "safetensors" and safetensors.label == "safetensors (2 files)"
    assert set(safetensors.files) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                      "config.json", "tokenizer.json"}
    assert safetensors.weights_size == 15_000_000 and safetensors.size > 15_000_000
    assert gguf.kind == "gguf" and gguf.files == ("model.Q4_K_M.gguf",) and gguf.size == 2_000_000


def test_a_download_reports_progress_to_the_end_and_returns_what_loads(hub, tmp_path):
    mirror, repo = hub
    choice = download.list_files("org/tiny", endpoint=mirror.url).choices[0]
    seen = []
    path = download.download("org/tiny", choice, progress=seen.append, endpoint=mirror.url, folder=tmp_path / "m")
    assert path == tmp_path / "m" and (path / "config.json").is_file()
    assert seen[-1].done == seen[-1].total == choice.size
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert "MB / " in seen[-1].describe() and "MB/s" in seen[-1].describe()
    for name in choice.files:
        assert (path / name).read_bytes() == (repo / name).read_bytes()
    gguf = download.list_files("org/tiny", endpoint=mirror.url).choices[1]
    assert download.download("org/tiny", gguf, endpoint=mirror.url, folder=tmp_path / "g") == \
        tmp_path / "g" / "model.Q4_K_M.gguf"


def test_cancel_leaves_no_half_file_and_a_new_download_skips_what_was_finished(hub, tmp_path):
    mirror, repo = hub
    choice = download.list_files("org/tiny", endpoint=mirror.url).choices[0]
    folder = tmp_path / "m"
    cancel = threading.Event()

    def progress(p):
        if p.file.startswith("model-00002") and p.done > 3_000_000 + 1_000_000:
            cancel.set()

    with pytest.raises(download.DownloadCancelled):
        download.download("org/tiny", choice, progress=progress, cancel=cancel, endpoint=mirror.url, folder=folder)
    assert (folder / "model-00001-of-00002.safetensors").is_file()  # finished before the cancel: kept
    assert not (folder / "model-00002-of-00002.safetensors").exists()  # no half file at its final place
    leftovers = [p for p in folder.rglob("*.incomplete")]
    assert not leftovers
    mirror.requests.clear()
    download.download("org/tiny", choice, endpoint=mirror.url, folder=folder)
    assert mirror.gets("model-00001-of-00002.safetensors") == []  # not fetched again
    assert mirror.gets("model-00002-of-00002.safetensors") == [None]
    assert (folder / "model-00002-of-00002.safetensors").read_bytes() == \
        (repo / "model-00002-of-00002.safetensors").read_bytes()


def test_a_dropped_connection_is_resumed_by_the_hub_client(hub, tmp_path):
    mirror, repo = hub
    (repo / "big.Q8_0.gguf").write_bytes(os.urandom(25 << 20))  # past the client's 10 MiB write chunks
    big = next(c for c in download.list_files("org/tiny", endpoint=mirror.url).choices if "big" in c.label)
    mirror.fail["big.Q8_0.gguf"] = "drop"  # the connection closes after 12.5 MiB
    path = download.download("org/tiny", big, endpoint=mirror.url, folder=tmp_path / "g")
    assert path.read_bytes() == (repo / "big.Q8_0.gguf").read_bytes()
    ranges = mirror.gets("big.Q8_0.gguf")
    assert ranges[0] is None and ranges[1] == f"bytes={10 << 20}-"  # continued from what it had written


def test_errors_are_said_with_what_to_do(hub, tmp_path):
    mirror, repo = hub
    with pytest.raises(download.DownloadError, match="owner/name"):
        download.list_files("not a repo id", endpoint=mirror.url)
    with pytest.raises(download.DownloadError, match="no model org/missing"):
        download.list_files("org/missing", endpoint=mirror.url)
    choice = download.list_files("org/tiny", endpoint=mirror.url).choices[1]
    mirror.fail["model.Q4_K_M.gguf"] = "404"
    with pytest.raises(download.DownloadError, match="404"):
        download.download("org/tiny", choice, endpoint=mirror.url, folder=tmp_path / "g")
    closed = HubMirror({})
    url = closed.url
    closed.close()
    with pytest.raises(download.DownloadError, match="cannot be reached.*Model folder…"):
        download.list_files("org/tiny", endpoint=url)
