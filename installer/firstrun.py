"""First-run window for DS-V4.1 Chat: each setup step with its status, a progress bar, the log's tail.

Standard library only (tkinter). bootstrap.py loads this file when ``run`` needs a setup and a
window can open; where Tk is missing (or no display), bootstrap keeps to the console.

Three layers, so the logic is tested without a display:
  FirstRunModel   plain state, fed with bootstrap's StepEvent objects and its output lines
  SetupRunner     runs the setup function on a worker thread; hands events over through a queue
                  (Tk is used from the main thread only)
  FirstRunWindow  draws the model every 100 ms; Cancel / Retry / Open log / Close

This file never imports bootstrap.py: the setup function is passed in as
``setup(out, observer) -> int`` (0: ready, anything else: failed).
"""

from __future__ import annotations

import os
import platform
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PENDING, RUNNING, DONE, SKIPPED, FAILED = "pending", "running", "done", "skipped", "failed"
GLYPHS = {PENDING: "\u25cb", RUNNING: "\u25b6", DONE: "\u2714", SKIPPED: "\u2714", FAILED: "\u2716"}
SPINNER = "\u280b\u2819\u2839\u2838\u283c\u2834\u2826\u2827\u2807\u280f"
COLORS = {PENDING: "#8a8f98", RUNNING: "#1f6feb", DONE: "#1a7f37", SKIPPED: "#1a7f37", FAILED: "#cf222e"}


def _fmt_secs(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


# ------------------------------------------------------------------------------------- the model


@dataclass
class Row:
    key: str
    name: str
    status: str = PENDING
    detail: str = ""
    started: float | None = None
    elapsed: float | None = None


class FirstRunModel:
    """What the window shows, updated from StepEvents (duck-typed: .kind, .index, .key, ...)."""

    def __init__(self, app_name: str = "DS-V4.1 Chat", clock: Callable[[], float] = time.monotonic,
                 log_size: int = 400):
        self.app_name = app_name
        self.clock = clock
        self.rows: list[Row] = []
        self.log: deque = deque(maxlen=log_size)
        self.phase = "starting"  # starting | running | ok | failed | cancelling | cancelled
        self.error: dict | None = None  # step, name, message, fix, log
        self.version = 0  # bumped on every change (the window redraws when it moves)

    # -- input
    def on_event(self, ev) -> None:
        kind = ev.kind
        if kind == "plan":
            old = {r.key: r for r in self.rows}
            self.rows = [Row(k, n) for k, n in ev.steps]
            for r in self.rows:  # a retry keeps what is already known done
                before = old.get(r.key)
                if before is not None and before.status in (DONE, SKIPPED):
                    r.status, r.detail = before.status, before.detail
            if self.phase != "cancelling":
                self.phase = "running"
            self.error = None
        elif kind == "start":
            row = self._row(ev)
            row.status, row.started, row.detail, row.elapsed = RUNNING, self.clock(), "", None
        elif kind == "skipped":
            row = self._row(ev)
            row.status, row.detail = SKIPPED, "done before"
        elif kind == "done":
            row = self._row(ev)
            row.status, row.detail = DONE, ev.detail
            row.elapsed = ev.elapsed or (self.clock() - row.started if row.started else None)
        elif kind in ("failed", "interrupted"):
            row = self._row(ev)
            row.status, row.detail = FAILED, ev.detail
            error = getattr(ev, "error", None)
            log = getattr(error, "log", None)
            self.error = {"step": ev.index, "total": ev.total, "name": ev.name, "message": ev.detail,
                          "fix": getattr(ev, "fix", "") or "", "log": str(log) if log else None,
                          "interrupted": kind == "interrupted"}
        elif kind == "finished":
            if ev.detail == "ok":
                self.phase = "ok"
            else:
                self.phase = "cancelled" if self.phase == "cancelling" else "failed"
        self.version += 1

    def on_output(self, line: str) -> None:
        for part in str(line).splitlines() or [""]:
            if part.strip():
                self.log.append(part.rstrip())
        self.version += 1

    def on_result(self, rc: int | None, crash: str | None = None) -> None:
        """The setup function returned (or raised): settle the phase even without a 'finished' event."""
        if crash:
            self.on_output(crash)
            if self.error is None:
                self.error = {"step": 0, "total": len(self.rows), "name": "setup",
                              "message": crash.strip().splitlines()[-1], "fix": "", "log": None,
                              "interrupted": False}
        if self.phase == "cancelling":
            self.phase = "cancelled"
        elif rc == 0 and not crash:
            self.phase = "ok"
        elif self.phase not in ("failed", "cancelled"):
            self.phase = "failed"
        for row in self.rows:
            if row.status == RUNNING:
                row.status = FAILED if self.phase != "ok" else DONE
        self.version += 1

    def request_cancel(self) -> None:
        if self.phase in ("starting", "running"):
            self.phase = "cancelling"
            self.version += 1

    def reset_for_retry(self) -> None:
        self.phase, self.error = "starting", None
        for row in self.rows:
            if row.status in (RUNNING, FAILED):
                row.status, row.detail = PENDING, ""
        self.log.append("--- retrying ---")
        self.version += 1

    def _row(self, ev) -> Row:
        for row in self.rows:
            if row.key == ev.key:
                return row
        row = Row(ev.key, ev.name)
        self.rows.append(row)
        return row

    # -- output
    @property
    def finished(self) -> bool:
        return self.phase in ("ok", "failed", "cancelled")

    def progress(self) -> float:
        """0..1: finished steps, plus half of the one running."""
        if not self.rows:
            return 1.0 if self.phase == "ok" else 0.0
        done = sum(r.status in (DONE, SKIPPED) for r in self.rows)
        running = sum(r.status == RUNNING for r in self.rows)
        return min(1.0, (done + 0.5 * running) / len(self.rows))

    def current(self) -> tuple | None:
        for i, row in enumerate(self.rows, 1):
            if row.status == RUNNING:
                return i, row
        return None

    def row_text(self, row: Row) -> tuple:
        """(glyph, name, detail) for one step's line."""
        detail = row.detail
        if row.status == RUNNING and row.started is not None:
            detail = f"working \u2026 {_fmt_secs(self.clock() - row.started)}"
        elif row.status == DONE and row.elapsed is not None and row.elapsed >= 1:
            detail = f"{detail} ({_fmt_secs(row.elapsed)})" if detail else _fmt_secs(row.elapsed)
        elif row.status == PENDING:
            detail = ""
        return GLYPHS[row.status], row.name, detail

    def status_text(self) -> str:
        n = len(self.rows)
        if self.phase == "ok":
            return f"Setup complete. Starting {self.app_name} \u2026"
        if self.phase == "cancelling":
            return "Stopping the setup \u2026"
        if self.phase == "cancelled":
            return "Setup stopped. The next start continues from where it stopped."
        if self.phase == "failed":
            e = self.error or {}
            if e.get("step"):
                return f"Setup stopped at step {e['step']} of {e.get('total') or n}: {e.get('name')}"
            return "Setup stopped."
        cur = self.current()
        if cur:
            i, row = cur
            return f"Step {i} of {n}: {row.name} \u2026"
        return "Preparing \u2026"

    def log_tail(self, n: int = 8) -> list:
        return list(self.log)[-n:]


# ------------------------------------------------------------------------------------ the runner


class SetupRunner:
    """Runs ``setup(out, observer)`` on a worker thread; ``pump(model)`` applies what it reported."""

    def __init__(self, setup: Callable, echo: Callable[[str], None] | None = None):
        self.setup = setup
        self.echo = echo
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.rc: int | None = None

    def start(self) -> None:
        self.rc = None
        self.thread = threading.Thread(target=self._work, name="dsv41-setup", daemon=True)
        self.thread.start()

    def _out(self, line: str = "") -> None:
        self.queue.put(("out", str(line)))
        if self.echo is not None:
            try:
                self.echo(line)
            except Exception:  # noqa: BLE001  (no console: pythonw, a closed pipe)
                pass

    def _work(self) -> None:
        try:
            rc = self.setup(self._out, lambda ev: self.queue.put(("event", ev)))
            self.queue.put(("result", rc, None))
        except BaseException:  # noqa: BLE001  (reported in the window, never lost)
            self.queue.put(("result", 1, traceback.format_exc()))

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def pump(self, model: FirstRunModel, limit: int = 500) -> bool:
        """Apply queued reports to the model; True when any arrived."""
        changed = False
        for _ in range(limit):
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            changed = True
            if item[0] == "out":
                model.on_output(item[1])
            elif item[0] == "event":
                model.on_event(item[1])
            else:
                self.rc = item[1]
                model.on_result(item[1], item[2])
        return changed

    def wait(self, timeout: float) -> bool:
        if self.thread is not None:
            self.thread.join(timeout)
        return not self.running


# ------------------------------------------------------------------------------------ the window


def gui_possible(env: dict | None = None, system: str | None = None) -> bool:
    """Whether a Tk window may open: not turned off, tkinter importable, a display (X11 on Linux)."""
    env = os.environ if env is None else env
    system = platform.system() if system is None else system
    if env.get("DSV41_NO_GUI", "").strip() not in ("", "0"):
        return False
    if system not in ("Windows", "Darwin") and not env.get("DISPLAY"):
        return False  # Tk draws through X11 only (Wayland sessions have XWayland's DISPLAY)
    try:
        import tkinter  # noqa: F401
    except Exception:  # noqa: BLE001  (ImportError, or a broken _tkinter)
        return False
    return True


def make_root():
    """A Tk root, or None when Tk cannot open a window (no display, Tcl/Tk libraries missing)."""
    try:
        import tkinter as tk

        root = tk.Tk()
        root.withdraw()
        return root
    except Exception:  # noqa: BLE001
        return None


def open_path(path: str) -> None:
    """Show a file with the system's default program (best effort)."""
    try:
        if sys.platform.startswith("win"):
            os.startfile(path)  # type: ignore[attr-defined]
        elif sys.platform == "darwin":
            subprocess.Popen(["open", path])
        else:
            subprocess.Popen(["xdg-open", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except Exception:  # noqa: BLE001
        pass


class FirstRunWindow:
    TICK_MS = 100

    def __init__(self, root, model: FirstRunModel, runner: SetupRunner, *, cancel: Callable[[], None],
                 icon: Path | None = None, auto_close_ms: int = 900, log_lines: int = 8):
        import tkinter as tk
        from tkinter import ttk

        self.tk, self.ttk = tk, ttk
        self.root, self.model, self.runner, self.cancel_func = root, model, runner, cancel
        self.auto_close_ms = auto_close_ms
        self.log_lines = log_lines
        self.result: int | None = None
        self.closed = False
        self._drawn = -1
        self._spin = 0
        self._close_at: float | None = None

        root.title(f"{model.app_name} \u2014 first-time setup")
        root.protocol("WM_DELETE_WINDOW", self.on_close)
        self._icon = None
        if icon is not None and Path(icon).is_file():
            try:
                self._icon = tk.PhotoImage(file=str(icon))
                root.iconphoto(True, self._icon)
            except Exception:  # noqa: BLE001  (old Tk without PNG)
                self._icon = None
        if platform.system() == "Linux":  # the default X11 theme looks dated
            try:
                ttk.Style(root).theme_use("clam")
            except Exception:  # noqa: BLE001
                pass

        outer = ttk.Frame(root, padding=14)
        outer.grid(sticky="nsew")
        root.columnconfigure(0, weight=1)
        root.rowconfigure(0, weight=1)
        outer.columnconfigure(0, weight=1)

        head = ttk.Frame(outer)
        head.grid(row=0, column=0, sticky="ew")
        if self._icon is not None:
            ttk.Label(head, image=self._icon).grid(row=0, column=0, rowspan=2, padx=(0, 12))
        ttk.Label(head, text=f"Setting up {model.app_name}", font=("TkDefaultFont", 13, "bold")).grid(
            row=0, column=1, sticky="w")
        ttk.Label(head, text="This happens once; later starts open the app straight away.",
                  foreground="#57606a").grid(row=1, column=1, sticky="w")

        self.steps_frame = ttk.Frame(outer, padding=(0, 10, 0, 6))
        self.steps_frame.grid(row=1, column=0, sticky="ew")
        self.steps_frame.columnconfigure(1, weight=1)
        self.step_widgets: list = []

        self.status = ttk.Label(outer, text="Preparing \u2026")
        self.status.grid(row=2, column=0, sticky="w")
        self.bar = ttk.Progressbar(outer, mode="determinate", maximum=1000, length=520)
        self.bar.grid(row=3, column=0, sticky="ew", pady=(4, 8))

        self.error_box = ttk.Frame(outer)
        self.error_box.grid(row=4, column=0, sticky="ew")
        self.error_label = ttk.Label(self.error_box, text="", foreground=COLORS[FAILED], wraplength=560,
                                     justify="left", font=("TkDefaultFont", 10, "bold"))
        self.error_label.grid(row=0, column=0, sticky="w")
        self.fix_label = ttk.Label(self.error_box, text="", wraplength=560, justify="left")
        self.fix_label.grid(row=1, column=0, sticky="w", pady=(4, 0))
        self.error_box.grid_remove()

        self.logbox = tk.Text(outer, height=log_lines, width=80, wrap="none", relief="flat",
                              background="#f6f8fa", foreground="#24292f", font=("TkFixedFont", 9))
        self.logbox.grid(row=5, column=0, sticky="nsew", pady=(4, 8))
        self.logbox.configure(state="disabled")
        outer.rowconfigure(5, weight=1)

        buttons = ttk.Frame(outer)
        buttons.grid(row=6, column=0, sticky="e")
        self.btn_log = ttk.Button(buttons, text="Open log", command=self.open_log)
        self.btn_retry = ttk.Button(buttons, text="Retry", command=self.retry)
        self.btn_close = ttk.Button(buttons, text="Cancel", command=self.on_close)
        self.btn_log.grid(row=0, column=0, padx=4)
        self.btn_retry.grid(row=0, column=1, padx=4)
        self.btn_close.grid(row=0, column=2, padx=4)
        self.btn_log.grid_remove()
        self.btn_retry.grid_remove()

        root.deiconify()
        self.place()
        root.after(self.TICK_MS, self.tick)

    def place(self) -> None:
        """Centre the window (again after it grew, so that its buttons stay on the screen)."""
        try:
            self.root.update_idletasks()
            w, h = self.root.winfo_reqwidth(), self.root.winfo_reqheight()
            x = max(0, (self.root.winfo_screenwidth() - w) // 2)
            y = max(0, min((self.root.winfo_screenheight() - h) // 3, self.root.winfo_screenheight() - h - 60))
            self.root.geometry(f"+{x}+{y}")
        except Exception:  # noqa: BLE001
            pass

    # -- drawing
    def _ensure_rows(self) -> None:
        tk, ttk = self.tk, self.ttk
        if len(self.step_widgets) == len(self.model.rows):
            return
        for widgets in self.step_widgets:
            for w in widgets:
                w.destroy()
        self.step_widgets = []
        for i, _row in enumerate(self.model.rows):
            glyph = tk.Label(self.steps_frame, width=2, anchor="w")
            name = ttk.Label(self.steps_frame, anchor="w")
            detail = ttk.Label(self.steps_frame, anchor="w", foreground="#57606a", wraplength=330)
            glyph.grid(row=i, column=0, sticky="w")
            name.grid(row=i, column=1, sticky="w", padx=(2, 12))
            detail.grid(row=i, column=2, sticky="w")
            self.step_widgets.append((glyph, name, detail))

    def draw(self) -> None:
        m = self.model
        self._ensure_rows()
        self._spin = (self._spin + 1) % len(SPINNER)
        for row, (glyph_w, name_w, detail_w) in zip(m.rows, self.step_widgets, strict=True):
            glyph, name, detail = m.row_text(row)
            if row.status == RUNNING:
                glyph = SPINNER[self._spin]
            glyph_w.configure(text=glyph, foreground=COLORS[row.status])
            name_w.configure(text=name)
            detail_w.configure(text=detail[:160])
        self.status.configure(text=m.status_text())
        self.bar["value"] = int(1000 * m.progress())
        if m.version != self._drawn:
            self._drawn = m.version
            self.logbox.configure(state="normal")
            self.logbox.delete("1.0", "end")
            self.logbox.insert("end", "\n".join(line[:200] for line in m.log_tail(self.log_lines)))
            self.logbox.see("end")
            self.logbox.xview_moveto(0)  # the start of long lines, not their ends
            self.logbox.configure(state="disabled")
            self._draw_end_state()

    def _draw_end_state(self) -> None:
        m = self.model
        if m.phase == "failed":
            e = m.error or {}
            self.error_label.configure(text=e.get("message") or "The setup failed.")
            fix = f"What to do: {e['fix']}" if e.get("fix") else ""
            if e.get("log"):
                fix += f"\nFull log: {e['log']}"
            fix += "\nRetry continues from the step that failed."
            self.fix_label.configure(text=fix.strip())
            if not self.error_box.winfo_ismapped():
                self.logbox.configure(height=max(4, self.log_lines - 3))
                self.error_box.grid()
                self.btn_retry.grid()
                if e.get("log"):
                    self.btn_log.grid()
                self.btn_close.configure(text="Close")
                self.place()
        elif m.phase == "cancelled":
            self.btn_close.configure(text="Close")
        else:
            if self.error_box.winfo_ismapped():
                self.logbox.configure(height=self.log_lines)
            self.error_box.grid_remove()
            self.btn_retry.grid_remove()
            self.btn_log.grid_remove()
            if not m.finished:
                self.btn_close.configure(text="Cancel")

    # -- the loop
    def tick(self) -> None:
        if self.closed:
            return
        self.runner.pump(self.model)
        self.draw()
        m = self.model
        if m.phase == "ok":
            self.result = 0
            if self._close_at is None:
                self._close_at = time.monotonic() + self.auto_close_ms / 1000
            elif time.monotonic() >= self._close_at:
                self.close()
                return
        elif m.phase == "cancelled" and not self.runner.running:
            self.result = 1
            self.close()
            return
        elif m.phase == "failed":
            self.result = self.runner.rc or 1
        self.root.after(self.TICK_MS, self.tick)

    # -- buttons
    def on_close(self) -> None:
        m = self.model
        if m.finished:
            self.result = 0 if m.phase == "ok" else (self.result or 1)
            self.close()
            return
        if m.phase == "cancelling":
            return
        if not self.confirm_cancel():
            return
        m.request_cancel()
        self.btn_close.state(["disabled"])
        try:
            self.cancel_func()
        finally:
            # The worker stops at its next check; give it a few seconds, then leave anyway.
            self.root.after(8000, self._force_close)

    def confirm_cancel(self) -> bool:
        try:
            from tkinter import messagebox

            return bool(messagebox.askyesno(
                "Stop the setup?", "Stop the setup now?\n\nThe next start continues from the step "
                "that was running.", parent=self.root))
        except Exception:  # noqa: BLE001
            return True

    def _force_close(self) -> None:
        if not self.closed:
            self.result = 1
            self.close()

    def retry(self) -> None:
        if self.runner.running:
            return
        self.model.reset_for_retry()
        self.btn_close.state(["!disabled"])
        self.runner.start()

    def open_log(self) -> None:
        e = self.model.error or {}
        if e.get("log"):
            open_path(e["log"])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._icon = None  # Tk images must be freed on this (the Tk) thread, not by a later GC elsewhere
        try:
            self.root.destroy()
        except Exception:  # noqa: BLE001
            pass


def run_with_window(setup: Callable, cancel: Callable[[], None], *, app_name: str = "DS-V4.1 Chat",
                    icon: Path | None = None, echo: Callable[[str], None] | None = None,
                    auto_close_ms: int = 900, hook: Callable[[FirstRunWindow], None] | None = None) -> int | None:
    """Run ``setup(out, observer)`` with the first-run window; its exit code, or None without Tk.

    ``cancel`` is called (on the Tk thread) when the user stops the setup; ``hook`` gets the window
    once it is built (tests and automation use it).
    """
    root = make_root()
    if root is None:
        return None
    model = FirstRunModel(app_name)
    runner = SetupRunner(setup, echo)
    try:
        window = FirstRunWindow(root, model, runner, cancel=cancel, icon=icon, auto_close_ms=auto_close_ms)
    except Exception:  # noqa: BLE001  (a broken Tk: fall back to the console)
        try:
            root.destroy()
        except Exception:  # noqa: BLE001
            pass
        return None
    runner.start()
    if hook is not None:
        hook(window)
    try:
        root.mainloop()
    except KeyboardInterrupt:
        cancel()
        window.close()
        runner.wait(10)
        _collect_tk_garbage()
        return 130
    window.close()
    if runner.running:  # closed while the worker still runs (force-closed after a cancel)
        runner.wait(5)
    runner.pump(model)
    result = window.result
    if result is None:
        result = runner.rc if runner.rc is not None else 1
    window = root = None  # noqa: F841
    _collect_tk_garbage()
    return result


def _collect_tk_garbage() -> None:
    """Free what is left of the Tk window here, on the Tk thread.

    Tk objects caught in reference cycles are otherwise freed by whichever thread the garbage
    collector runs on next; Tcl aborts the process when that is not the thread that made them.
    """
    import gc

    gc.collect()


# ---------------------------------------------------------------------------------- error dialog


def show_error(title: str, message: str, details: str = "", log: str | None = None,
               hook: Callable | None = None) -> bool:
    """A small window with an error, the last lines of output and 'Open log'; False without Tk."""
    root = make_root()
    if root is None:
        return False
    try:
        import tkinter as tk
        from tkinter import ttk

        root.title(title)
        frame = ttk.Frame(root, padding=14)
        frame.grid(sticky="nsew")
        ttk.Label(frame, text=message, wraplength=560, justify="left",
                  foreground=COLORS[FAILED]).grid(row=0, column=0, sticky="w")
        if details:
            box = tk.Text(frame, height=12, width=90, wrap="none", background="#f6f8fa",
                          font=("TkFixedFont", 9))
            box.insert("end", details)
            box.configure(state="disabled")
            box.grid(row=1, column=0, pady=8, sticky="nsew")
        buttons = ttk.Frame(frame)
        buttons.grid(row=2, column=0, sticky="e")
        if log:
            ttk.Button(buttons, text="Open log", command=lambda: open_path(log)).grid(row=0, column=0, padx=4)
        ttk.Button(buttons, text="Close", command=root.destroy).grid(row=0, column=1, padx=4)
        root.protocol("WM_DELETE_WINDOW", root.destroy)
        root.deiconify()
        if hook is not None:
            hook(root)
        root.mainloop()
        return True
    except Exception:  # noqa: BLE001
        try:
            root.destroy()
        except Exception:  # noqa: BLE001
            pass
        return False
    finally:
        root = None  # noqa: F841
        _collect_tk_garbage()
