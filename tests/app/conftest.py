"""Fixtures for the GUI tests: an isolated data dir, a fake engine, and a window wired to it."""

from __future__ import annotations

import threading

import pytest
from gui_fakes import FakeModel, fake_factory

LOAD_TIMEOUT_MS = 10_000


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    """Conversations and settings of each test live in its own folder."""
    folder = tmp_path / "data"
    monkeypatch.setenv("DSV41_DATA_DIR", str(folder))
    return folder


@pytest.fixture
def fake_model():
    return FakeModel(max_seq_len=8192)


@pytest.fixture
def make_window(qtbot, fake_model):
    """Build a MainWindow on the fake engine (or another factory) and wait for the model."""
    from app.window import MainWindow

    windows = []

    def make(factory=None, *, wait_loaded=True, confirm=True):
        window = MainWindow(factory or fake_factory(fake_model), autoload=True)
        window.confirm = lambda title, text: confirm
        qtbot.addWidget(window)
        window.show()
        if wait_loaded:
            qtbot.waitUntil(lambda: window.facts is not None, timeout=LOAD_TIMEOUT_MS)
        windows.append(window)
        return window

    yield make
    for window in windows:
        if window.isVisible():
            window.close()


@pytest.fixture
def slow_reading(monkeypatch):
    """Documents are read only once the returned event is set (at most 5 s): a test sees them while still read."""
    import engine.documents

    gate = threading.Event()
    real = engine.documents.load_document

    def slow(path, **kw):
        gate.wait(5)
        return real(path, **kw)

    monkeypatch.setattr(engine.documents, "load_document", slow)
    yield gate
    gate.set()


@pytest.fixture
def window(make_window):
    return make_window()


def send(qtbot, window, text: str, *, wait: bool = True, timeout: int = 10_000):
    window.composer.setPlainText(text)
    window.send()
    if wait:
        qtbot.waitUntil(lambda: not window.turns.busy, timeout=timeout)
