"""python -m app: open the window and load the last (or default) model in the background.

python -m app --selftest [...] answers one prompt without Qt (app.selftest), for launchers and support.
"""

import os
import platform
import sys

USAGE = """usage: python -m app [--selftest [--prompt TEXT] [--model MODEL] [--max-new-tokens N] [--max-seq-len N]]

Opens the DS-V4.1 Chat window and loads the last model used (the default one the first time).
  --selftest   answer one prompt without opening a window (checks the engine; no display needed;
               python -m app --selftest --help lists its options)
Qt's own options (-platform, -style, -geometry, ...) are passed to Qt.
Without a display, chat in the terminal instead: {python} -m engine chat
Environment: DSV41_DATA_DIR (chats and settings; one app at a time per folder: another folder runs a
second app), QT_QPA_PLATFORM (Qt's platform, e.g. offscreen)."""


def _no_display() -> bool:
    """Linux and the like with neither X11 nor Wayland to open a window on (and no Qt platform chosen)."""
    if platform.system() in ("Windows", "Darwin"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM"))


args = sys.argv[1:]
if "--selftest" in args:
    from .selftest import main as selftest

    sys.exit(selftest([a for a in args if a != "--selftest"]))
if "-h" in args or "--help" in args:
    print(USAGE.format(python=sys.executable))
    sys.exit(0)
# Qt's command-line options (QGuiApplication's and QApplication's): any other option is a mistake to say, not ignore
QT_OPTIONS = {"platform", "platformpluginpath", "platformtheme", "plugin", "qmljsdebugger", "qwindowgeometry",
              "qwindowicon", "qwindowtitle", "reverse", "session", "display", "geometry", "style", "stylesheet",
              "widgetcount", "nograb", "dograb", "sync"}
unknown = [a for a in args if a.startswith("-") and a.lstrip("-").split("=")[0] not in QT_OPTIONS]
if unknown:
    print(USAGE.format(python=sys.executable).split("\n\n")[0], file=sys.stderr)
    print(f"python -m app: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
    sys.exit(2)
if _no_display():
    print("No display found (DISPLAY and WAYLAND_DISPLAY are not set), so the DS-V4.1 Chat window cannot open "
          f"here.\n  Chat in the terminal instead:  {sys.executable} -m engine chat\n"
          "  (To use a Qt platform anyway, set QT_QPA_PLATFORM, e.g. QT_QPA_PLATFORM=offscreen.)", file=sys.stderr)
    sys.exit(2)

from .main import main  # noqa: E402 - Qt is imported only when the window is wanted

sys.exit(main())
