"""The first-run window: the step events, its model and runner headlessly, and once for real under Xvfb."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from installer import commands, common, install_steps, setup_runner, torch_choice, venv_setup

REPO = Path(__file__).resolve().parents[2]


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\n')
    return repo


def _steps(calls, fail=None, sleep=0.0, wait_cancel=None):
    def make(key):
        def func(ctx):
            calls.append(key)
            ctx.out(f"working on {key}")
            if key == wait_cancel:
                while not ctx.cancel.is_set():
                    time.sleep(0.01)
                raise common.StepError(f"{key}: command stopped")
            if sleep:
                time.sleep(sleep)
            if fail is not None and fail.get(key):
                raise common.StepError(f"{key} broke", f"fix {key}", ["tail"], ["pip", "install", key],
                                   Path("/tmp/setup.log"))
            if key == "venv":
                venv = ctx.venv
                py = common.venv_python(venv)
                py.parent.mkdir(parents=True, exist_ok=True)
                py.write_text("")
                (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
                (venv / venv_setup.MARKER_NAME).write_text("{}")
            return f"{key} fine"
        return func
    return [install_steps.Step(k, f"Step {k}", make(k), always=(k == "python"))
            for k in ("python", "venv", "torch", "model")]


# ------------------------------------------------------------------------------ observer events


def test_run_steps_reports_each_step_to_the_observer(tmp_path, printer):
    events = []
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer, observer=events.append)
    state = venv_setup.State(tmp_path / venv_setup.STATE_NAME)
    assert not setup_runner.run_steps(_steps([], fail={"torch": True}), state, ctx)
    assert [(e.kind, e.index, e.key) for e in events] == [
        ("plan", 0, ""), ("start", 1, "python"), ("done", 1, "python"), ("start", 2, "venv"),
        ("done", 2, "venv"), ("start", 3, "torch"), ("failed", 3, "torch"), ("finished", 0, "")]
    assert events[0].steps == (("python", "Step python"), ("venv", "Step venv"), ("torch", "Step torch"),
                               ("model", "Step model"))
    failed = events[6]
    assert failed.detail == "torch broke" and failed.fix == "fix torch" and failed.total == 4
    assert isinstance(failed.error, common.StepError) and events[-1].detail == "failed"
    assert "ERROR in step [3/4] Step torch" in printer.text  # the console report is unchanged

    events.clear()
    assert setup_runner.run_steps(_steps([]), venv_setup.State.load(tmp_path / venv_setup.STATE_NAME), ctx)
    assert [(e.kind, e.key) for e in events] == [
        ("plan", ""), ("start", "python"), ("done", "python"), ("skipped", "venv"), ("start", "torch"),
        ("done", "torch"), ("start", "model"), ("done", "model"), ("finished", "")]
    assert events[3].detail == "venv fine" and events[-1].detail == "ok"


def test_a_failing_observer_never_breaks_setup(tmp_path, printer):
    def broken(event):
        raise RuntimeError("display gone")

    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer, observer=broken)
    assert setup_runner.run_steps(_steps([]), venv_setup.State(tmp_path / venv_setup.STATE_NAME), ctx)
    assert "progress display failed: display gone" in printer.text


def test_cancel_marks_the_running_step_and_the_next_start_resumes(tmp_path, printer):
    events, calls = [], []
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer, observer=events.append)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "rc", setup_runner.ensure_setup(ctx, _steps(calls, wait_cancel="torch"))))
    worker.start()
    deadline = time.monotonic() + 10
    while "torch" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    ctx.cancel.set()
    worker.join(10)
    assert result["rc"] == 1
    assert ("interrupted", "torch") in [(e.kind, e.key) for e in events]
    state = venv_setup.State.load(ctx.venv / venv_setup.STATE_NAME)
    assert state.last_failure["step"] == "torch" and state.last_failure["message"] == "cancelled"
    assert "Rerun" in printer.text and "resume from this step" in printer.text
    calls.clear()
    assert setup_runner.ensure_setup(setup_runner.Context(ctx.repo, ctx.home, out=printer), _steps(calls)) == 0
    assert calls == ["python", "torch", "model"]


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_stop_running_commands_kills_the_pip_that_runs(tmp_path, printer):
    result = {}
    code = "import time; print('started', flush=True); time.sleep(60)"
    t = threading.Thread(target=lambda: result.setdefault(
        "res", venv_setup.run_logged([sys.executable, "-c", code], tmp_path / "log.txt", out=printer)))
    t0 = time.monotonic()
    t.start()
    while not venv_setup._LIVE_PROCS and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert venv_setup.stop_running_commands() == 1
    t.join(10)
    assert result["res"].returncode not in (0, None) and time.monotonic() - t0 < 10
    assert not venv_setup._LIVE_PROCS


# ---------------------------------------------------------------------------------- the model


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_model_follows_the_events(tmp_path, firstrun, printer):
    clock = Clock()
    model = firstrun.FirstRunModel(clock=clock)
    assert model.status_text() == "Preparing \u2026" and model.progress() == 0.0
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer)
    seen = []

    def observer(ev):
        seen.append(ev)
        model.on_event(ev)
        if ev.kind == "start" and ev.key == "torch":
            clock.now += 75
            assert model.status_text() == "Step 3 of 4: Step torch \u2026"
            assert model.row_text(model.rows[2]) == (firstrun.GLYPHS["running"], "Step torch",
                                                     "working \u2026 1 min 15 s")
            assert model.progress() == pytest.approx(2.5 / 4)

    ctx.observer = observer
    ctx.out = model.on_output
    state = venv_setup.State(tmp_path / venv_setup.STATE_NAME)
    assert not setup_runner.run_steps(_steps([], fail={"model": True}), state, ctx)
    assert [r.status for r in model.rows] == ["done", "done", "done", "failed"]
    assert model.phase == "failed" and model.finished
    assert model.status_text() == "Setup stopped at step 4 of 4: Step model"
    assert model.error["fix"] == "fix model" and model.error["log"] == "/tmp/setup.log"
    assert "working on model" in model.log_tail(20)
    assert any("ERROR in step [4/4]" in line for line in model.log_tail(20))
    # Retry: the failed row goes back to pending, the done ones stay done.
    model.reset_for_retry()
    assert [r.status for r in model.rows] == ["done", "done", "done", "pending"] and not model.finished
    ctx.observer = model.on_event
    assert setup_runner.run_steps(_steps([]), venv_setup.State.load(tmp_path / venv_setup.STATE_NAME), ctx)
    assert model.phase == "ok" and model.progress() == 1.0
    assert model.status_text().startswith("Setup complete. Starting DS-V4.1 Chat")
    assert [r.status for r in model.rows] == ["done", "skipped", "skipped", "done"]


def test_runner_hands_events_over_and_survives_a_crash(firstrun):
    def setup(out, observer):
        observer(setup_runner.StepEvent("plan", total=1, steps=(("a", "Step a"),)))
        observer(setup_runner.StepEvent("start", 1, 1, "a", "Step a"))
        out("line one\nline two")
        observer(setup_runner.StepEvent("done", 1, 1, "a", "Step a", detail="fine"))
        observer(setup_runner.StepEvent("finished", total=1, detail="ok"))
        return 0

    echoed = []
    model = firstrun.FirstRunModel()
    runner = firstrun.SetupRunner(setup, echo=echoed.append)
    runner.start()
    assert runner.wait(10)
    assert runner.pump(model)
    assert runner.rc == 0 and model.phase == "ok" and model.rows[0].detail == "fine"
    assert model.log_tail() == ["line one", "line two"] and echoed == ["line one\nline two"]

    def crashing(out, observer):
        observer(setup_runner.StepEvent("plan", total=1, steps=(("a", "Step a"),)))
        observer(setup_runner.StepEvent("start", 1, 1, "a", "Step a"))
        raise ValueError("unexpected")

    model = firstrun.FirstRunModel()
    runner = firstrun.SetupRunner(crashing)
    runner.start()
    runner.wait(10)
    runner.pump(model)
    assert runner.rc == 1 and model.phase == "failed"
    assert model.rows[0].status == "failed" and "ValueError: unexpected" in model.error["message"]


def test_gui_possible(firstrun):
    assert not firstrun.gui_possible({}, "Linux")  # no X display
    assert not firstrun.gui_possible({"WAYLAND_DISPLAY": "wayland-0"}, "Linux")  # Tk needs X11 (XWayland)
    assert not firstrun.gui_possible({"DISPLAY": ":0", "DSV41_NO_GUI": "1"}, "Linux")
    try:
        import tkinter  # noqa: F401
    except ImportError:
        assert not firstrun.gui_possible({"DISPLAY": ":0"}, "Linux")
    else:
        assert firstrun.gui_possible({"DISPLAY": ":0"}, "Linux")
        assert firstrun.gui_possible({}, "Windows") and firstrun.gui_possible({}, "Darwin")


def test_setup_with_window_falls_back_to_console_without_tk(tmp_path, firstrun, monkeypatch, printer):
    monkeypatch.setattr(firstrun, "gui_possible", lambda env=None, system=None: False)
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer)
    assert commands.setup_with_window(ctx) is None
    # Tk importable but no window (e.g. a broken display): also None, so the console takes over.
    monkeypatch.setattr(firstrun, "gui_possible", lambda env=None, system=None: True)
    monkeypatch.setattr(firstrun, "make_root", lambda: None)
    assert commands.setup_with_window(ctx) is None
    assert ctx.observer is None and ctx.out is printer


# ------------------------------------------------------------------------ main: run's choices


def test_run_shows_the_window_only_when_setup_is_due(tmp_path, bs, monkeypatch):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    order = []
    ready = {"value": False}
    monkeypatch.setattr(setup_runner, "is_ready", lambda ctx, steps=None: ready["value"])
    monkeypatch.setattr(commands, "setup_with_window", lambda ctx, force=False: order.append("window") or 0)
    monkeypatch.setattr(setup_runner, "ensure_setup", lambda ctx, force=False: order.append("console") or 0)
    monkeypatch.setattr(commands, "launch_app", lambda cmd, env, home: order.append(("app", cmd[1:])) or 0)
    assert bs.main(["run", "--x"]) == 0
    assert order == ["window", ("app", ["-m", "app", "--x"])]
    # No window possible: the console, as before.
    order.clear()
    monkeypatch.setattr(commands, "setup_with_window", lambda ctx, force=False: None)
    assert bs.main(["run"]) == 0
    assert order == ["console", ("app", ["-m", "app"])]
    # A failed setup never starts the app (a half-made environment is never used).
    order.clear()
    monkeypatch.setattr(commands, "setup_with_window", lambda ctx, force=False: order.append("window") or 1)
    assert bs.main(["run"]) == 1
    assert order == ["window"]
    # Set up already: straight to the app (ensure_setup's own fast path).
    order.clear()
    ready["value"] = True
    assert bs.main(["run"]) == 0
    assert order == ["console", ("app", ["-m", "app"])]


def test_app_that_fails_to_start_gets_an_error_window(tmp_path, firstrun, monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(firstrun, "show_error", lambda *a, **k: shown.append(a) or True)
    code = "import sys; print('qt.qpa.plugin: Could not load the Qt platform plugin \"xcb\"'); sys.exit(1)"
    rc = commands.launch_app([sys.executable, "-c", code], dict(os.environ), tmp_path, show_errors=True)
    assert rc == 1 and len(shown) == 1
    title, message, details, _log = shown[0]
    assert "could not start" in title and "libxkbcommon-x11-0" in message and "qt.qpa.plugin" in details
    shown.clear()
    assert commands.launch_app([sys.executable, "-c", "pass"], dict(os.environ), tmp_path, show_errors=True) == 0
    assert shown == []
    assert "xcb-cursor0" in commands.app_failure_hint(["xcb-cursor0 or libxcb-cursor0 is needed"])
    assert "setup --force" in commands.app_failure_hint(["ModuleNotFoundError: No module named 'PySide6'"])
    # a display Qt cannot reach: Qt also names xcb-cursor0 then, but the display is what to fix
    unreachable = ["qt.qpa.xcb: could not connect to display :99",
                   "qt.qpa.plugin: From 6.5.0, xcb-cursor0 or libxcb-cursor0 is needed to load the Qt xcb platform plugin."]
    hint = commands.app_failure_hint(unreachable)
    assert "DISPLAY" in hint and "chat" in hint and "apt install" not in hint


def test_the_no_display_message_names_only_commands_that_work(tmp_path, monkeypatch):
    fresh = tmp_path / "venv" / "bin" / "python"  # before setup: no such python yet
    assert "or directly" not in commands.no_display_message(fresh)
    fresh.parent.mkdir(parents=True)
    fresh.write_text("")
    assert f"{fresh} -m engine chat" in commands.no_display_message(fresh)
    monkeypatch.chdir(tmp_path)  # run from another folder: the bootstrap by its full path
    script = Path(common.__file__).resolve().parent / "bootstrap.py"
    assert common._bootstrap_cmd() in (f"python3 {script}", f'python3 "{script}"')
    monkeypatch.chdir(script.parent.parent)
    assert common._bootstrap_cmd() == "python3 installer/bootstrap.py"


# ------------------------------------------------------------------------------- under Xvfb


@pytest.fixture(autouse=True)
def _free_tk_objects_on_this_thread():
    """The tests' hooks keep windows alive in reference cycles: free them here, on the Tk thread,
    before a later setup thread's garbage collection could (Tcl aborts on that)."""
    yield
    import gc

    gc.collect()


@pytest.mark.skipif(sys.platform != "linux", reason="Xvfb")
def test_window_under_xvfb_success_and_retry(tmp_path, firstrun, xvfb_display, monkeypatch, printer):
    pytest.importorskip("tkinter")
    monkeypatch.setenv("DISPLAY", xvfb_display)
    monkeypatch.delenv("DSV41_NO_GUI", raising=False)
    repo = _repo(tmp_path)
    (repo / "resources").mkdir()
    (repo / "resources" / "icon-64.png").write_bytes((REPO / "resources" / "icon-64.png").read_bytes())
    calls = []
    fail = {"torch": True}
    steps = _steps(calls, fail=fail, sleep=0.05)
    monkeypatch.setattr(install_steps, "default_steps", lambda: steps)
    ctx = setup_runner.Context(repo, tmp_path / "home", out=printer)
    seen = {}

    def hook(window):
        seen["title"] = window.root.title()

        def watch():
            if window.closed:
                return
            if window.model.phase == "failed" and "retried" not in seen:
                seen["retried"] = True
                seen["error"] = window.error_label.cget("text")
                seen["buttons"] = [b.winfo_ismapped() for b in (window.btn_log, window.btn_retry, window.btn_close)]
                fail.clear()
                window.retry()  # what the Retry button does
            window.root.after(50, watch)
        window.root.after(50, watch)

    t0 = time.monotonic()
    rc = commands.setup_with_window(ctx, hook=hook)
    assert rc == 0
    assert time.monotonic() - t0 < 20
    assert seen["title"] == "DS-V4.1 Chat \u2014 first-time setup"
    assert seen["error"] == "torch broke" and seen["buttons"] == [1, 1, 1]
    assert calls == ["python", "venv", "torch", "python", "torch", "model"]  # the retry resumed
    assert setup_runner.is_ready(ctx, steps)
    assert "working on torch" in printer.text  # the console still gets the output
    assert ctx.observer is None and ctx.out is printer


@pytest.mark.skipif(sys.platform != "linux", reason="Xvfb")
def test_window_under_xvfb_cancel(tmp_path, firstrun, xvfb_display, monkeypatch, printer):
    pytest.importorskip("tkinter")
    monkeypatch.setenv("DISPLAY", xvfb_display)
    calls = []
    steps = _steps(calls, wait_cancel="torch")
    monkeypatch.setattr(install_steps, "default_steps", lambda: steps)
    monkeypatch.setattr(firstrun.FirstRunWindow, "confirm_cancel", lambda self: True)
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer)

    def hook(window):
        def watch():
            if "torch" in calls and window.model.phase == "running":
                window.on_close()  # the window's close button
            else:
                window.root.after(30, watch)
        window.root.after(30, watch)

    assert commands.setup_with_window(ctx, hook=hook) == 1
    state = venv_setup.State.load(ctx.venv / venv_setup.STATE_NAME)
    assert state.last_failure["step"] == "torch" and state.last_failure["message"] == "cancelled"


@pytest.mark.skipif(sys.platform != "linux", reason="Xvfb")
def test_error_window_under_xvfb(firstrun, xvfb_display, monkeypatch):
    pytest.importorskip("tkinter")
    monkeypatch.setenv("DISPLAY", xvfb_display)
    seen = {}

    def hook(root):
        seen["title"] = root.title()
        root.after(300, root.destroy)

    assert firstrun.show_error("DS-V4.1 Chat could not start", "It stopped.", "line 1\nline 2", "/tmp/x.log",
                               hook=hook)
    assert seen["title"] == "DS-V4.1 Chat could not start"
