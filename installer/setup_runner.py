"""Running the setup: the Context a step works with (folders, GPU, output, how pip is run), the
progress events the first-run window listens to, running the steps in order with progress saved
after each, the report of a failed step, and ``ensure_setup``: a fast no-op when everything is done
for this checkout, else the steps still to do (resuming where a setup stopped).
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import common, install_steps, torch_choice, venv_setup


class StepEvent(NamedTuple):
    """What run_steps tells ``Context.observer`` (the first-run window listens to these).

    kind: "plan" (before the first step; ``steps`` lists (key, name) of all), "start", "skipped"
    (done before), "done" (``detail`` is the result line), "failed" (``detail`` the message, ``fix``
    what to do, ``error`` the StepError), "interrupted" (cancelled or Ctrl+C), and "finished"
    (after the last one; ``detail`` is "ok" or "failed").
    """
    kind: str
    index: int = 0  # 1-based step number; 0 for plan/finished
    total: int = 0
    key: str = ""
    name: str = ""
    detail: str = ""
    fix: str = ""
    steps: tuple = ()
    error: object = None
    elapsed: float = 0.0


class Context:
    def __init__(self, repo: Path, home: Path, extras=(), gpu: torch_choice.GpuInfo | None = None,
                 system: str | None = None, with_pip: bool = True, verbose: bool = False,
                 out: Callable[[str], None] = common.say, runner: Callable | None = None,
                 observer: Callable[[StepEvent], None] | None = None,
                 cancel: threading.Event | None = None):
        self.repo = Path(repo).resolve()
        self.home = Path(home)
        self.venv = self.home / "venv"
        self.extras = set(extras)
        self.gpu = gpu
        self.system = platform.system() if system is None else system
        self.with_pip = with_pip
        self.verbose = verbose
        self.out = out
        self.runner = runner or venv_setup.run_logged
        self.log = self.home / "logs" / "setup.log"
        self.observer = observer  # gets a StepEvent as each step starts, ends or fails
        self.cancel = cancel or threading.Event()  # set (from another thread) to stop the setup

    def notify(self, kind: str, **fields) -> None:
        """Tell the observer; an observer that fails never breaks the setup."""
        if self.observer is None:
            return
        try:
            self.observer(StepEvent(kind, **fields))
        except Exception as e:  # noqa: BLE001
            self.out(f"      (progress display failed: {e})")

    @property
    def python(self) -> Path:
        return common.venv_python(self.venv, self.system)

    @property
    def pyproject(self) -> Path:
        return self.repo / "pyproject.toml"

    def pyproject_text(self) -> str:
        try:
            return self.pyproject.read_text(encoding="utf-8")
        except OSError:
            return ""

    def pip(self, args: list, timeout: float | None = 3600.0, extra_env: dict | None = None) -> tuple:
        cmd = [str(self.python), "-m", "pip"] + list(args)
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONUNBUFFERED="1")
        env.update(extra_env or {})
        res = self.runner(cmd, self.log, timeout=timeout, verbose=self.verbose, env=env, out=self.out)
        return cmd, res

    def pip_or_fail(self, args: list, what: str, timeout: float | None = 3600.0) -> venv_setup.RunResult:
        cmd, res = self.pip(args, timeout)
        if res.returncode != 0:
            kind, fix = venv_setup.diagnose(res.output, self.home)
            why = "timed out" if res.returncode is None else f"exit {res.returncode}"
            raise common.StepError(f"pip failed ({why}) {what}", fix, res.tail, cmd, self.log)
        return res

    def venv_eval(self, code: str, timeout: float = 300.0) -> tuple:
        """(ok, stdout) of running ``code`` with the venv's Python."""
        try:
            p = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True,
                               timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            return False, str(e)
        return p.returncode == 0, p.stdout.strip()


# ------------------------------------------------------------------------------------ the runner


def run_steps(steps: list, state: venv_setup.State, ctx: Context) -> bool:
    """Run the steps not yet done, saving progress after each. False when one failed."""
    out = ctx.out
    last = state.last_failure
    if last:
        out(f"Last time setup stopped at step '{last.get('name')}' ({last.get('at', '?')}): "
            f"{last.get('message')}")
        out("Resuming from there; steps already done are skipped.")
    n = len(steps)
    ctx.notify("plan", total=n, steps=tuple((s.key, s.name) for s in steps))
    for i, step in enumerate(steps, 1):
        where = {"index": i, "total": n, "key": step.key, "name": step.name}
        if ctx.cancel.is_set():
            _interrupted(ctx, state, step, i, n, "cancelled")
            return False
        out(f"[{i}/{n}] {step.name} \u2026")
        if state.is_done(step.key) and not step.always:
            out("      done before, skipped")
            ctx.notify("skipped", **where, detail=state.data["steps"][step.key].get("result", ""))
            continue
        ctx.notify("start", **where)
        t0 = time.monotonic()
        try:
            result = step.func(ctx)
        except common.StepError as e:
            if ctx.cancel.is_set():  # the step failed because its command was stopped
                _interrupted(ctx, state, step, i, n, "cancelled")
                return False
            state.mark_failed(step.key, step.name, e.message)
            state.save()
            report_failure(ctx, i, n, step, e)
            ctx.notify("failed", **where, detail=e.message, fix=e.fix, error=e,
                       elapsed=time.monotonic() - t0)
            ctx.notify("finished", total=n, detail="failed")
            return False
        except KeyboardInterrupt:
            _interrupted(ctx, state, step, i, n, "interrupted")
            raise
        state.mark_done(step.key, result or "")
        state.save()
        out(f"      ok: {result} ({common.fmt_secs(time.monotonic() - t0)})" if result else "      ok")
        ctx.notify("done", **where, detail=result or "", elapsed=time.monotonic() - t0)
    ctx.notify("finished", total=n, detail="ok")
    return True


def _interrupted(ctx: Context, state: venv_setup.State, step: install_steps.Step, i: int, n: int,
                 why: str) -> None:
    state.mark_failed(step.key, step.name, why)
    state.save()
    ctx.out(f"\n{why.capitalize()} during step [{i}/{n}] {step.name}. Rerun '{common.BOOTSTRAP_CMD} setup' "
            "(or start the app again) to resume from this step.")
    ctx.notify("interrupted", index=i, total=n, key=step.key, name=step.name, detail=why)
    ctx.notify("finished", total=n, detail="failed")


def report_failure(ctx: Context, i: int, n: int, step: install_steps.Step, e: common.StepError) -> None:
    out = ctx.out
    out("")
    out(f"ERROR in step [{i}/{n}] {step.name}: {e.message}")
    if e.tail:
        out("  last lines of the output:")
        for line in e.tail:
            out("    " + line)
    if e.fix:
        out(f"  Fix: {e.fix}")
    out(f"  Rerun: {common.BOOTSTRAP_CMD} setup   (setup resumes from this step)")
    if e.command:
        out(f"  The command that failed: {common.quote(e.command)}")
    if e.log:
        out(f"  Full log: {e.log}")


def load_state(ctx: Context) -> venv_setup.State:
    """The saved state; an empty one while the venv is not complete (a half-made one counts for nothing)."""
    path = ctx.venv / venv_setup.STATE_NAME
    return venv_setup.State.load(path) if venv_setup.venv_is_complete(ctx.venv) else venv_setup.State(path)


def _fingerprint_for(ctx: Context, extras) -> str:
    return venv_setup.fingerprint(ctx.pyproject, ctx.repo, extras, common.venv_python_version(ctx.venv))


def is_ready(ctx: Context, steps: list | None = None) -> bool:
    steps = install_steps.default_steps() if steps is None else steps
    state = load_state(ctx)
    wanted = sorted(set(state.extras) | ctx.extras)
    return (state.fingerprint == _fingerprint_for(ctx, wanted) and state.last_failure is None
            and state.all_done([s.key for s in steps]))


def ensure_setup(ctx: Context, steps: list | None = None, force: bool = False) -> int:
    """Bring the environment up to date (fast no-op when it is). 0 on success, 1 on failure."""
    steps = install_steps.default_steps() if steps is None else steps
    if not force and is_ready(ctx, steps):
        return 0
    with venv_setup.setup_lock(ctx.home, ctx.out):
        if not force and is_ready(ctx, steps):  # another process finished it meanwhile
            return 0
        state = load_state(ctx)
        wanted = sorted(set(state.extras) | ctx.extras)
        fp = _fingerprint_for(ctx, wanted)
        resettable = [s.key for s in steps if s.key not in ("python", "venv")]
        if force:
            state.reset(resettable)
        elif state.fingerprint and state.fingerprint != fp and state.last_failure is None:
            ctx.out("The project changed since the last setup (pyproject.toml, extras, location or "
                    "versions): checking the install steps again.")
            state.reset(resettable)
        t0 = time.monotonic()
        ctx.out(f"Setting up {common.APP_NAME} in {ctx.home} (done once; later starts skip this).")
        ctx.log.parent.mkdir(parents=True, exist_ok=True)
        if ctx.log.exists():
            try:
                os.replace(ctx.log, ctx.log.with_name("setup.prev.log"))
            except OSError:
                pass
        ctx.extras = set(wanted)
        if not run_steps(steps, state, ctx):
            return 1
        # The venv (and so the state file) may only exist now: save the full record there.
        state.data["fingerprint"] = _fingerprint_for(ctx, wanted)
        state.data["extras"] = wanted
        state.data["last_failure"] = None
        state.data["repo"] = str(ctx.repo)
        state.save()
        ctx.out(f"Setup complete in {common.fmt_secs(time.monotonic() - t0)}.")
        return 0
