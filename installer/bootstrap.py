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

This file reads the command line and dispatches; the work is done by the modules next to it:
common.py (names, output, folders), torch_choice.py (GPU, PyTorch build, version specs),
venv_setup.py (running pip, the venv, the state file, the lock), install_steps.py (the steps),
setup_runner.py (running them, resuming), commands.py (starting the app and the other commands).

Standard library only; Python 3.10+; Linux, macOS and Windows.

Environment:
    DSV41_HOME               data folder to use instead of the per-user default
    DSV41_FORCE_CPU=1        behave as if there were no NVIDIA GPU
    DSV41_VERBOSE=1          show pip's output while it runs (as ``setup -v``)
    DSV41_NO_GUI=1           never open the first-run window (console output only)
    DSV41_FLASH_ATTN_BUILD=1 allow building flash-attn from source when no prebuilt wheel fits
                             (off by default: the app uses PyTorch SDPA attention then)
    DSV41_FLASH_ATTN_TIMEOUT seconds to allow that build (default 1200)
    DSV41_TEST_WORKERS=N     ``test`` runs pytest in N processes (default: one per core, at most 4; 1: one)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__:  # imported as installer.bootstrap (the tests, python -m installer.bootstrap)
    from . import commands, common, setup_runner, torch_choice
else:  # run as a file, python3 installer/bootstrap.py
    # This folder becomes a package under a private name, so that its modules' relative imports work
    # without a change to sys.path, and no package installed as "installer" can stand in for it.
    import importlib
    import importlib.machinery
    import importlib.util

    _PACKAGE = "dsv41_installer"
    if _PACKAGE not in sys.modules:
        _spec = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
        _spec.submodule_search_locations = [str(Path(__file__).resolve().parent)]
        sys.modules[_PACKAGE] = importlib.util.module_from_spec(_spec)
    commands, common, setup_runner, torch_choice = (
        importlib.import_module(f"{_PACKAGE}.{name}") for name in ("commands", "common", "setup_runner",
                                                                   "torch_choice"))

# The commands, in the order --help lists them, with their help line.
COMMAND_HELP = {
    "run": f"(default) start the {common.APP_NAME} desktop app; args go to 'python -m app' (a setup "
           "that is due first shows its steps in a window, or on the console)",
    "chat": "chat in the terminal ('python -m engine chat')",
    "selftest": "load the default model, answer one prompt, print the figures",
    "test": "install the dev tools and run pytest in the repository; args go to pytest",
    "doctor": "check the machine ('python -m engine doctor')",
    "setup": "only install/update; options: --force (redo every step), --dev (add test tools), -v (show "
             "pip's output), --gui (show the first-run window)",
    "status": "say whether setup is complete (exit 0) or needed (exit 1)",
    "install-shortcut": f"add {common.APP_NAME} to the applications menu / Start menu / ~/Applications",
    "uninstall": "remove the environment and the shortcut; --purge also deletes the converted models "
                 "and conversations (asked when run in a terminal), --keep-data keeps them",
}
COMMANDS = tuple(COMMAND_HELP)
# Commands whose arguments are not read here but handed on as they are: to the program each starts
# ('run --help' is the app's help, 'test -x' goes to pytest), or, for uninstall, to
# commands.cmd_uninstall, which parses them itself (it is also called directly).
PASS_THROUGH = ("run", "chat", "selftest", "test", "doctor", "uninstall")


def build_parser() -> tuple:
    """(the parser, {command: its subparser})."""
    environment = (__doc__ or "").partition("\nEnvironment:\n")[2]
    parser = common.ArgumentParser(
        prog=common.BOOTSTRAP_CMD, usage="%(prog)s [command] [args ...]", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Set up {common.APP_NAME} on first use, then run the command (default: run).",
        epilog=f"environment:\n{environment}\nThe app's private environment lives in "
               f"{common.data_home() / 'venv'} (set DSV41_HOME to move it).")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="command",
                                prog=common.BOOTSTRAP_CMD)
    subparsers = {}
    for name, text in COMMAND_HELP.items():
        # A pass-through command has no options, not even -h: parse_known_args leaves all its
        # arguments, in their order, to be handed on.
        subparsers[name] = sub.add_parser(name, help=text, description=text, allow_abbrev=False,
                                          add_help=name not in PASS_THROUGH)
    setup = subparsers["setup"]
    setup.add_argument("--force", action="store_true", help="redo every step")
    setup.add_argument("--dev", action="store_true", help="add the test tools")
    setup.add_argument("-v", "--verbose", action="store_true", help="show pip's output (as DSV41_VERBOSE=1)")
    setup.add_argument("--gui", action="store_true", help="show the first-run window")
    return parser, subparsers


def parse(argv: list) -> tuple:
    """(command, its parsed options, the arguments handed on) for the arguments after the script.

    A first argument that is no command runs the app with all the arguments: an option
    (``--x``) or a file that exists; any other word is an unknown command (UsageError).
    """
    parser, subparsers = build_parser()
    if argv and argv[0] == "help":
        argv = ["--help"]
    elif not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        if argv and not argv[0].startswith("-") and not os.path.exists(argv[0]):
            raise common.UsageError(f"unknown command: {argv[0]}", parser)
        argv = ["run"] + argv
    opts, rest = parser.parse_known_args(argv)
    if opts.command == "setup" and rest:
        raise common.UsageError(f"setup: unknown option(s) {' '.join(rest)}", subparsers["setup"])
    return opts.command, opts, rest


def main(argv: list | None = None) -> int:
    common.make_console_safe()
    if sys.version_info < common.MIN_PYTHON:
        common.say(common.python_too_old_message())
        return 1
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command, opts, rest = parse(argv)
    except common.UsageError as e:
        common.say(f"{e}\n\n{e.parser.format_help()}" if e.parser else str(e))
        return 2
    except SystemExit as e:  # --help was shown
        return int(e.code or 0)

    repo = common.repo_root()
    home = common.data_home()
    py = common.venv_python(home / "venv")
    if command == "install-shortcut":
        return commands.cmd_install_shortcut(repo, home)
    if command == "uninstall":
        return commands.cmd_uninstall(rest, repo, home)
    if command == "run" and not common.has_display():
        common.say(commands.no_display_message(py))
        return 2

    force = verbose = False
    gui = command == "run"
    extras = set()
    if command == "setup":
        force, verbose, gui = opts.force, opts.verbose, opts.gui
        if opts.dev:
            extras.add("dev")
    if command == "test":
        extras.add("dev")
    verbose = verbose or os.environ.get("DSV41_VERBOSE", "").strip() not in ("", "0")
    gpu = torch_choice.detect_nvidia()
    if gpu:
        extras.add("gpu")
    ctx = setup_runner.Context(repo, home, extras, gpu, verbose=verbose)
    if command == "status":
        return commands.cmd_status(ctx)
    try:
        rc = None
        if gui and (force or not setup_runner.is_ready(ctx)):
            rc = commands.setup_with_window(ctx, force=force)
        if rc is None:
            rc = setup_runner.ensure_setup(ctx, force=force)
    except KeyboardInterrupt:
        return 130
    if rc:
        return rc
    if command == "setup":
        common.say(f"Ready. Start the app with: {common.BOOTSTRAP_CMD} run   (or chat in a terminal: "
                   f"{common.BOOTSTRAP_CMD} chat)")
        return 0
    env = dict(os.environ, VIRTUAL_ENV=str(ctx.venv))
    env["PATH"] = str(py.parent) + os.pathsep + env.get("PATH", "")
    if command == "run":
        rc = commands.ensure_qt_libraries(py, env)
        if rc:
            return rc
        return commands.launch_app([py, "-m", "app"] + rest, env, home)
    if command == "chat":
        return commands.launch([py, "-m", "engine", "chat"] + rest, env=env, ctrl_c_is_theirs=True)
    if command == "doctor":
        return commands.launch([py, "-m", "engine", "doctor"] + rest, env=env)
    if command == "selftest":
        return commands.launch([py, "-m", "app.selftest"] + rest, cwd=repo, env=env)
    # test
    if not common.has_display(env):
        env["QT_QPA_PLATFORM"] = "offscreen"
        common.say("No display: running the tests with QT_QPA_PLATFORM=offscreen.")
    workers = commands.worker_args_for_tests(rest, py, env)
    if workers:
        common.say(f"Running the tests in {workers[1]} processes (DSV41_TEST_WORKERS=1 runs them in one).")
    rc = commands.launch([py, "-m", "pytest"] + workers + rest, cwd=repo, env=env, ctrl_c_is_theirs=True)
    if rc == 5:
        common.say("pytest collected no tests (exit 5): the test suite is empty or the arguments select "
                   "nothing. Treating this as a failure.")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
