"""What the commands do once the environment is set up, and the commands that need no setup.

- starting a program of the environment (chat, doctor, selftest, pytest) and the app itself: started
  without a terminal, the app's last lines and a fix are shown in a window when it fails;
- on Linux, Qt's missing system libraries found and installed (or the one command to run named);
- the setup shown in the first-run window (installer/firstrun.py) instead of the console;
- ``install-shortcut``, ``uninstall`` and ``status``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from . import common, setup_runner, venv_setup


def launch(cmd: list, cwd: Path | None = None, env: dict | None = None, ctrl_c_is_theirs: bool = False) -> int:
    """Run `cmd` and return its exit code. Ctrl-C in a terminal reaches the child as well as this process: with
    `ctrl_c_is_theirs` (the terminal chat, where it stops a reply or drops a line, and pytest) the child decides
    and this process keeps waiting for it; otherwise the child is stopped with this process."""
    try:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd) if cwd else None, env=env)
    except OSError as e:
        common.say(f"Could not start {cmd[0]}: {e}. Rerun '{common.BOOTSTRAP_CMD} setup --force'.")
        return 1
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            if not ctrl_c_is_theirs:
                proc.kill()
                proc.wait()
                return 130


MAX_TEST_WORKERS = 4
"""`bootstrap.py test` runs pytest in up to this many processes (pytest-xdist, a dev tool), one per core, each test
file whole in one of them, the files holding tests marked slow first (tests/conftest.py). Each loads the default model
and its threads share the cores (OMP_NUM_THREADS, tests/conftest.py)."""
_SERIAL_OPTIONS = ("-n", "--numprocesses", "--dist", "--pdb", "--trace", "-s")


def worker_args_for_tests(rest: list, py: Path, env: dict, cpus: int | None = None) -> list:
    """pytest's arguments that spread the suite over the machine's cores: none where the arguments already decide
    (-n, --dist, -p no:xdist, or a debugger or uncaptured output, which want one process), DSV41_TEST_WORKERS=1
    asks for one process, the machine has one core, or pytest-xdist is not in the environment."""
    wanted = env.get("DSV41_TEST_WORKERS", "").strip()
    workers = int(wanted) if wanted.isdigit() else min(common.usable_cpus() if cpus is None else cpus, MAX_TEST_WORKERS)
    if workers < 2 or any(str(a).split("=")[0] in _SERIAL_OPTIONS or str(a).startswith("-n") or "no:xdist" in str(a)
                          for a in rest):
        return []
    try:
        has_xdist = subprocess.run([str(py), "-c", "import xdist"], env=env, capture_output=True,
                                   timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        has_xdist = False
    if not has_xdist:
        return []
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]


# ------------------------------------------------------------------------ the first-run window


def app_icon_file(repo: Path) -> Path | None:
    for name in ("icon-64.png", "icon-256.png"):
        path = Path(repo) / "resources" / name
        if path.is_file():
            return path
    return None


def window_possible(env: dict | None = None) -> bool:
    firstrun = common.sibling("firstrun")
    return firstrun is not None and firstrun.gui_possible(env)


def setup_with_window(ctx: setup_runner.Context, force: bool = False,
                      hook: Callable | None = None) -> int | None:
    """ensure_setup shown in the first-run window: its exit code, or None when no window can open.

    The steps report to the window through ``ctx.observer``; pip's own lines go to its log view
    (and still to the console). Closing the window stops the running command; the step is marked
    interrupted so the next start resumes there.
    """
    if not window_possible():
        return None
    firstrun = common.sibling("firstrun")
    console_out, verbose = ctx.out, ctx.verbose
    ctx.cancel = threading.Event()

    def setup(out, observer) -> int:
        ctx.out, ctx.observer, ctx.verbose = out, observer, True
        return setup_runner.ensure_setup(ctx, force=force)

    def cancel() -> None:
        ctx.cancel.set()
        venv_setup.stop_running_commands()

    try:
        return firstrun.run_with_window(setup, cancel, app_name=common.APP_NAME, icon=app_icon_file(ctx.repo),
                                        echo=console_out, hook=hook)
    finally:
        ctx.out, ctx.observer, ctx.verbose = console_out, None, verbose


# --------------------------------------------------------------------------- starting the app

APP_FAILURE_HINTS = (
    # first: Qt names libxcb-cursor0 whenever its xcb plugin fails, a display it cannot reach included
    (("could not connect to display", "cannot open display", "Failed to create wl_display"),
     "The display could not be reached: check DISPLAY (or WAYLAND_DISPLAY), or 'ssh -X' for a remote machine; "
     f"or chat in the terminal: {common.BOOTSTRAP_CMD} chat"),
    (("xcb-cursor",), "Qt needs a system library: sudo apt install libxcb-cursor0 "
                      "(Fedora: sudo dnf install xcb-util-cursor), then start the app again."),
    (("Could not load the Qt platform plugin", "qt.qpa.plugin"),
     "Qt's display libraries are missing: sudo apt install libxkbcommon-x11-0 libxcb-icccm4 "
     "libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 libegl1, then "
     "start the app again."),
    (("ModuleNotFoundError", "ImportError", "DLL load failed"),
     f"A package of the app's environment is missing or broken: run '{common.BOOTSTRAP_CMD} setup --force'."),
    (("No space left on device",), "The disk is full: free some space, then start the app again."),
)
# normal exit, already running with this data folder (app/instance.py: the app said so itself), Ctrl+C, killed,
# logged out
QUIET_EXIT_CODES = (0, 3, 130, 137, 143, -2, -9, -15)


def app_failure_hint(lines: list) -> str:
    text = "\n".join(lines)
    for patterns, fix in APP_FAILURE_HINTS:
        if any(p in text for p in patterns):
            return fix
    return (f"Run '{common.BOOTSTRAP_CMD} doctor' in a terminal to check the machine, or start the app from "
            f"a terminal ('{common.BOOTSTRAP_CMD} run') to see all of its messages.")


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
        common.say(f"Could not start {cmd[0]}: {e}. Rerun '{common.BOOTSTRAP_CMD} setup --force'.")
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
    message = (f"{common.APP_NAME} stopped unexpectedly (exit code {rc}).\n\n"
               f"What to do: {app_failure_hint(list(tail))}")
    common.say(message)
    firstrun = common.sibling("firstrun")
    if firstrun is not None:
        firstrun.show_error(f"{common.APP_NAME} could not start", message, "\n".join(tail),
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
    say = common.say
    system = platform.system() if system is None else system
    if system != "Linux":
        return 0
    qt = common.sibling("qt_libraries")
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
        elif not interactive and which("pkexec") and common.has_display(env):
            say(f"Asking for the administrator password to run: {result.command(sudo=False)}")
            tried = qt.install(result, as_root=False, sudo="pkexec")
    if tried:
        result = qt.check(folder, env)
        if result.ok:
            say("Installed; starting the app.")
            return 0
    message = (f"{common.APP_NAME} cannot open its window: Qt's {plugin} plugin is missing system libraries "
               f"({', '.join(result.missing)}).\n\nRun this, then start the app again:\n  {result.command()}")
    say(message)
    if not interactive:
        firstrun = common.sibling("firstrun")
        if firstrun is not None:
            firstrun.show_error(f"{common.APP_NAME} could not start", message, "", None)
    return 1


def no_display_message(py: Path) -> str:
    directly = f"  or directly:                   {py} -m engine chat\n" if Path(py).exists() else ""
    return (f"No display found (DISPLAY and WAYLAND_DISPLAY are not set), so the {common.APP_NAME} window "
            "cannot open here.\n"
            f"  Chat in the terminal instead:  {common.BOOTSTRAP_CMD} chat\n"
            f"{directly}"
            "  (To use a Qt platform anyway, set QT_QPA_PLATFORM, e.g. QT_QPA_PLATFORM=offscreen.)")


# ------------------------------------------------------------------ shortcut, uninstall, status


def cmd_install_shortcut(repo: Path, home: Path, system: str | None = None, env: dict | None = None,
                         user_home: Path | None = None) -> int:
    shortcuts = common.sibling("shortcuts")
    system = platform.system() if system is None else system
    try:
        made = shortcuts.install_shortcut(repo, home, system, env, user_home)
    except (OSError, FileExistsError) as e:
        common.say(f"Could not put the shortcut in place: {e}")
        return 1
    for path in made:
        common.say(f"  made {path}")
    where = {"Windows": "the Start menu", "Darwin": "~/Applications (Launchpad, Spotlight)"}.get(
        system, "your applications menu")
    common.say(f"{common.APP_NAME} is now in {where}. The first start from there sets the app up "
               f"(or run '{common.BOOTSTRAP_CMD} setup' now); '{common.BOOTSTRAP_CMD} uninstall' removes it "
               "again.")
    return 0


def _ask(question: str) -> bool:
    try:
        return input(question + " [y/N] ").strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        common.say("")
        return False


def _interactive() -> bool:
    try:
        return bool(sys.stdin and sys.stdin.isatty() and sys.stdout and sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


def uninstall_parser() -> common.ArgumentParser:
    parser = common.ArgumentParser(
        prog=f"{common.BOOTSTRAP_CMD} uninstall", allow_abbrev=False,
        description="Remove the environment, its logs and the shortcut. The converted models and the "
                    "conversations are kept unless --purge is given (asked when run in a terminal).")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--purge", action="store_true",
                        help="also delete the converted models and conversations")
    choice.add_argument("--keep-data", action="store_true", help="keep them without asking")
    return parser


def cmd_uninstall(args: list, repo: Path, home: Path, system: str | None = None, env: dict | None = None,
                  user_home: Path | None = None, interactive: bool | None = None) -> int:
    """Remove the environment, logs and the shortcut; with --purge also converted models and chats.

    ``args`` are the command's own arguments (``--purge``, ``--keep-data``), parsed here."""
    parser = uninstall_parser()
    try:
        opts = parser.parse_args(args)
    except common.UsageError as e:
        common.say(f"{e}\n\n{parser.format_help()}")
        return 2
    except SystemExit as e:  # --help was shown
        return int(e.code or 0)
    say = common.say
    shortcuts = common.sibling("shortcuts")
    system = platform.system() if system is None else system
    env = dict(os.environ) if env is None else env
    user_home = Path.home() if user_home is None else Path(user_home)
    interactive = _interactive() if interactive is None else interactive
    venv = home / "venv"
    failed = False
    with venv_setup.setup_lock(home):
        for path in shortcuts.remove_shortcut(home, system, env, user_home):
            say(f"  removed {path}")
        if venv.exists():
            ours = (venv / "pyvenv.cfg").exists() or (venv / venv_setup.MARKER_NAME).exists() or \
                (venv / venv_setup.CREATING_NAME).exists()
            if not ours:
                say(f"  kept {venv}: it is not a virtual environment (delete it yourself if it is not "
                    "needed)")
            else:
                try:
                    venv_setup.remove_venv(venv)
                    say(f"  removed the environment {venv}")
                except common.StepError as e:
                    say(f"  {e.message}. {e.fix}")
                    failed = True
        logs = home / "logs"
        if logs.is_dir():
            shutil.rmtree(logs, ignore_errors=True)
            say(f"  removed {logs}")
    targets = shortcuts.purge_targets(env, system, user_home)
    purge = opts.purge
    if targets and not purge and not opts.keep_data:
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
    say(f"{common.APP_NAME} was uninstalled" + (" (with some problems, see above)." if failed else ".") +
        f" The source folder {repo} is yours to delete.")
    return 1 if failed else 0


def cmd_status(ctx: setup_runner.Context, steps: list | None = None) -> int:
    """'ready' (exit 0) or what setup still has to do (exit 1); installs nothing."""
    state = setup_runner.load_state(ctx)
    if setup_runner.is_ready(ctx, steps):
        common.say(f"ready: {ctx.venv}")
        return 0
    if not venv_setup.venv_is_complete(ctx.venv):
        common.say(f"setup needed: no complete environment at {ctx.venv}")
    elif state.last_failure:
        f = state.last_failure
        common.say(f"setup needed: it stopped at step '{f.get('name')}' ({f.get('message')})")
    else:
        common.say("setup needed: the project or the wanted extras changed since the last setup")
    return 1
