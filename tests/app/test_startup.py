"""Startup: the window builds without torch; python -m app opens and loads the model in the background."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, tmp_path, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "DSV41_DATA_DIR": str(tmp_path / "data"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_main_window_builds_without_importing_torch(tmp_path):
    result = run_python("""
        import sys
        from app.main import make_application
        app = make_application([])
        from app.window import MainWindow
        window = MainWindow(autoload=False)
        window.show()
        app.processEvents()
        heavy = sorted(m for m in ("torch", "transformers", "engine.model", "numpy") if m in sys.modules)
        print("HEAVY", heavy)
        window.close()
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_python_m_app_opens_and_loads_the_default_model(tmp_path):
    """The real entry point; it quits itself once the model is loaded (or failed)."""
    result = run_python("""
        import sys
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication
        import app.main as entry

        def watch():
            window = next((w for w in QApplication.topLevelWidgets() if w.objectName() == "mainWindow"), None)
            if window is not None and (window.facts is not None or window.shown_messages):
                print("FACTS", window.facts and window.facts.display_name, window.shown_messages)
                print("ICON", not QApplication.windowIcon().isNull(), "STYLE", bool(QApplication.instance().styleSheet()))
                window.close()
                QApplication.quit()

        timer = QTimer()
        timer.timeout.connect(watch)
        QTimer.singleShot(0, lambda: timer.start(100))
        sys.exit(entry.main([]))
    """, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FACTS SmolLM2-135M-Instruct []" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "ICON True STYLE True" in result.stdout


def test_python_m_app_without_a_display_says_what_to_do_and_help_prints_usage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["DSV41_DATA_DIR"] = str(tmp_path / "data")
    if sys.platform in ("win32", "darwin"):
        return  # a display is always there
    out = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "No display found" in out.stderr and "-m engine chat" in out.stderr
    assert "Traceback" not in out.stderr and "Aborted" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "app", "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m app") and "--selftest" in out.stdout


def test_python_m_app_refuses_an_unknown_option_and_its_usage_is_what_it_takes(tmp_path):
    env = dict(os.environ, DSV41_DATA_DIR=str(tmp_path / "data"), QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-m", "app", "--bogus"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr
    out = subprocess.run([sys.executable, "-m", "app", "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert "--selftest [--prompt TEXT]" in out.stdout  # the self-test's prompt is an option, not a positional
    from app.selftest import _parser

    assert _parser().parse_args(["--prompt", "用一句话介绍北京"]).prompt == "用一句话介绍北京"
