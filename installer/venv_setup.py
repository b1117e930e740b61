"""The app's environment on disk and the commands that fill it.

- running a command (pip) with its output logged, a heartbeat while it runs, a time limit, and a way
  to stop it from another thread (a cancelled setup); telling from pip's output why it failed;
- making the virtual environment, never using a half-made one, adopting one made by hand;
- what setup did, in ``<venv>/.dsv41-bootstrap.json``, and the fingerprint of what it was done for;
- the lock that lets one setup run at a time per data folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from . import common

STATE_NAME = ".dsv41-bootstrap.json"
MARKER_NAME = ".dsv41-venv-complete"
CREATING_NAME = ".dsv41-venv-creating"
STATE_VERSION = 1

NETWORK_PATTERNS = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "nodename nor servname",
    "getaddrinfo failed",
    "NewConnectionError",
    "ConnectTimeoutError",
    "ConnectionResetError",
    "Connection refused",
    "Network is unreachable",
    "Read timed out",
    "ProxyError",
    "Max retries exceeded",
    "Could not fetch URL",
    "SSLError",
)
DISK_PATTERNS = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded")
NOT_FOUND_PATTERNS = ("No matching distribution found", "Could not find a version that satisfies")


# ----------------------------------------------------------------------------- running commands


_LIVE_PROCS: set = set()
_LIVE_LOCK = threading.Lock()


def stop_running_commands() -> int:
    """Kill the commands run_logged is running now (a cancelled setup); returns how many."""
    with _LIVE_LOCK:
        procs = list(_LIVE_PROCS)
    for proc in procs:
        try:
            proc.kill()
        except OSError:
            pass
    return len(procs)


class RunResult(NamedTuple):
    returncode: int | None  # None: killed after the timeout
    tail: list
    elapsed: float
    output: str


def run_logged(cmd: list, log_path: Path | None = None, timeout: float | None = None,
               heartbeat: float = 30.0, verbose: bool = False, env: dict | None = None,
               cwd: Path | None = None, out: Callable[[str], None] = common.say,
               tail_lines: int = 25) -> RunResult:
    """Run ``cmd``, log its output, print a heartbeat while it runs, keep its last lines."""
    start = time.monotonic()
    lines: list = []
    log = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a", encoding="utf-8", errors="replace")
        log.write(f"\n$ {' '.join(map(str, cmd))}\n")
        log.flush()
    try:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", env=env,
                                cwd=str(cwd) if cwd else None)
    except OSError as e:
        if log:
            log.close()
        return RunResult(127, [str(e)], time.monotonic() - start, str(e))
    with _LIVE_LOCK:
        _LIVE_PROCS.add(proc)

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if log:
                log.write(line)
                log.flush()
            if verbose:
                out("      | " + line.rstrip("\n"))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    next_beat = start + heartbeat
    rc: int | None = None
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if timeout is not None and now - start > timeout:
                    proc.kill()
                    proc.wait()
                    rc = None
                    lines.append(f"(stopped after {common.fmt_secs(now - start)}: time limit reached)")
                    break
                if heartbeat and now >= next_beat and not verbose:
                    out(f"      ... still working ({common.fmt_secs(now - start)})")
                    next_beat = now + heartbeat
    except KeyboardInterrupt:
        proc.kill()
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE_PROCS.discard(proc)
        t.join(timeout=5)
        if log:
            log.close()
    return RunResult(rc, lines[-tail_lines:], time.monotonic() - start, "\n".join(lines))


def diagnose(output: str, home: Path | None = None) -> tuple:
    """(kind, fix) for a failed pip run: kind is 'disk', 'network', 'not-found' or 'pip'."""
    if any(p in output for p in DISK_PATTERNS):
        return "disk", f"The disk is full: {free_space_text(home)}. Free some space (pip's cache: " \
                       f"'python -m pip cache purge'), then rerun: setup resumes from this step."
    if any(p in output for p in NETWORK_PATTERNS) or "(from versions: none)" in output:
        return "network", ("Could not reach the package index: check your connection / proxy "
                           "(HTTPS_PROXY, pip.conf); rerun: setup resumes from this step.")
    if any(p in output for p in NOT_FOUND_PATTERNS):
        return "not-found", ("pip found no release that fits (see above). Check that this Python "
                             f"({platform.python_version()}) and system are supported; rerun: setup "
                             "resumes from this step.")
    return "pip", "See pip's output above; fix the cause, then rerun: setup resumes from this step."


def free_space_text(path: Path | None) -> str:
    p = Path(path) if path else Path.home()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB on {p}"


# ----------------------------------------------------------------------------------- the venv


def _venv_healthy(venv: Path, need_pip: bool) -> bool:
    py = common.venv_python(venv)
    if not (venv / "pyvenv.cfg").is_file() or not py.exists():
        return False
    code = "import sys; " + ("import pip; " if need_pip else "") + \
           f"sys.exit(0 if sys.version_info >= {common.MIN_PYTHON!r} else 3)"
    try:
        return subprocess.run([str(py), "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def remove_venv(path: Path) -> None:
    """Delete an environment folder (read-only files on Windows included); StepError if it stays."""
    common.sibling("shortcuts").remove_path(path)  # one removal routine for the whole installer
    if path.exists():
        raise common.StepError(f"Could not remove the incomplete environment at {path}",
                               f"Close programs that use it and delete the folder yourself, then rerun "
                               f"'{common.BOOTSTRAP_CMD} setup'.")


def venv_is_complete(venv: Path) -> bool:
    return (Path(venv) / MARKER_NAME).is_file() and common.venv_python(venv).exists()


def ensure_venv(venv: Path, with_pip: bool = True, out: Callable[[str], None] = common.say) -> str:
    """Make sure ``venv`` is a complete virtual environment; return what was done.

    A venv whose completion marker is missing is never used as it is: one that this installer
    started making (creation sentinel present) or that does not work is removed and made anew; a
    working venv made by hand (pyvenv.cfg, a Python >= 3.10, pip) is adopted and marked.
    """
    venv = Path(venv)
    if venv_is_complete(venv):
        return f"reusing {venv}"
    action = "created"
    if venv.exists():
        ours = (venv / CREATING_NAME).exists() or (venv / MARKER_NAME).exists()
        is_venv = (venv / "pyvenv.cfg").exists()
        if not ours and is_venv and _venv_healthy(venv, need_pip=with_pip):
            _write_marker(venv, adopted=True)
            return f"reusing the existing environment {venv} (checked: works, has pip)"
        if not ours and not is_venv and venv.is_dir() and any(venv.iterdir()):
            raise common.StepError(f"{venv} exists but is not a virtual environment",
                                   "Move that folder away, or set DSV41_HOME to another folder, and rerun.")
        out(f"      the environment at {venv} is incomplete (an earlier setup was interrupted): "
            "removing it and starting over")
        remove_venv(venv)
        action = "recreated"
    try:
        if with_pip:
            import ensurepip  # noqa: F401  (Debian/Ubuntu ship it separately)
    except ImportError:
        raise common.StepError("This Python cannot create virtual environments with pip (no 'ensurepip')",
                               "On Debian/Ubuntu: sudo apt install python3-venv (or python3.X-venv for "
                               f"your version), then rerun '{common.BOOTSTRAP_CMD} setup'.") from None
    import venv as venv_mod
    venv.mkdir(parents=True, exist_ok=True)
    (venv / CREATING_NAME).write_text(f"pid {os.getpid()} at {time.ctime()}\n", encoding="utf-8")
    try:
        venv_mod.EnvBuilder(with_pip=with_pip, symlinks=(os.name != "nt"), clear=False).create(str(venv))
    except (OSError, subprocess.CalledProcessError) as e:
        fix = f"rerun '{common.BOOTSTRAP_CMD} setup' (the half-made environment is removed first)."
        if isinstance(e, OSError) and e.errno == 28:
            fix = f"The disk is full: {free_space_text(venv.parent)}. Free some space, then " + fix
        raise common.StepError(f"Could not create the virtual environment at {venv}: {e}", fix) from None
    py = common.venv_python(venv)
    try:
        ok = subprocess.run([str(py), "-c", "import sys"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise common.StepError(f"The new environment's Python ({py}) does not start",
                               f"Rerun '{common.BOOTSTRAP_CMD} setup'; if it fails again, reinstall Python.")
    _write_marker(venv, adopted=False)
    (venv / CREATING_NAME).unlink()
    return f"{action} at {venv}"


def _write_marker(venv: Path, adopted: bool) -> None:
    (venv / MARKER_NAME).write_text(json.dumps({
        "made_by": "installer/bootstrap.py", "adopted": adopted, "python": common.venv_python_version(venv),
        "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- fingerprint, state


def fingerprint(pyproject: Path, repo: Path, extras, python_version: str,
                model_version: str = common.MODEL_VERSION) -> str:
    try:
        py_hash = hashlib.sha256(Path(pyproject).read_bytes()).hexdigest()
    except OSError:
        py_hash = "missing"
    payload = {
        "pyproject": py_hash,
        "repo": str(Path(repo).resolve()),
        "extras": sorted(set(extras)),
        "python": python_version,
        "model": f"{common.MODEL_PACKAGE}=={model_version}",
        "state_version": STATE_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class State:
    """What setup did, in ``<venv>/.dsv41-bootstrap.json``."""

    def __init__(self, path: Path, data: dict | None = None):
        self.path = Path(path)
        self.data = {"version": STATE_VERSION, "fingerprint": None, "extras": [], "steps": {},
                     "last_failure": None}
        if data:
            self.data.update(data)

    @classmethod
    def load(cls, path: Path) -> State:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                data = None
        except (OSError, ValueError):
            data = None
        return cls(path, data)

    def save(self) -> bool:
        """Write atomically; does nothing (returns False) while the venv folder does not exist."""
        if not self.path.parent.is_dir():
            return False
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)
        return True

    @property
    def fingerprint(self) -> str | None:
        return self.data.get("fingerprint")

    @property
    def extras(self) -> list:
        return list(self.data.get("extras") or [])

    @property
    def last_failure(self) -> dict | None:
        return self.data.get("last_failure")

    def is_done(self, key: str) -> bool:
        return bool(self.data["steps"].get(key, {}).get("done"))

    def all_done(self, keys) -> bool:
        return all(self.is_done(k) for k in keys)

    def mark_done(self, key: str, result: str = "") -> None:
        self.data["steps"][key] = {"done": True, "result": result, "at": time.strftime("%Y-%m-%d %H:%M:%S")}

    def mark_failed(self, key: str, name: str, message: str) -> None:
        self.data["steps"][key] = {"done": False, "at": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.data["last_failure"] = {"step": key, "name": name, "message": message,
                                     "at": time.strftime("%Y-%m-%d %H:%M:%S")}

    def reset(self, keys) -> None:
        for k in keys:
            self.data["steps"].pop(k, None)


# ------------------------------------------------------------------------------------- the lock


@contextmanager
def setup_lock(home: Path, out: Callable[[str], None] = common.say):
    """One setup at a time per data folder (other starts wait for it)."""
    home.mkdir(parents=True, exist_ok=True)
    f = open(home / ".bootstrap.lock", "a+")
    try:
        if os.name == "nt":
            import msvcrt
            told = False
            while True:
                try:
                    f.seek(0)
                    msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    if not told:
                        out("Another setup of this app is running; waiting for it to finish ...")
                        told = True
                    time.sleep(1)
        else:
            import fcntl
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                out("Another setup of this app is running; waiting for it to finish ...")
                fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()  # releases the lock
