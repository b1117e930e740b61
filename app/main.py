"""Entry point (python -m app, dsv41-chat): the QApplication, icon and style sheet, the error hook."""

from __future__ import annotations

import logging
import sys
import threading
import traceback

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QFont, QFontInfo, QIcon
from PySide6.QtWidgets import QApplication, QMessageBox

from . import theme
from .instance import ALREADY_RUNNING_EXIT, InstanceLock
from .paths import data_dir, resource

log = logging.getLogger("app")


class ErrorHook(QObject):
    """Any unhandled exception (GUI thread or another) reaches one dialog; the app keeps running."""

    raised = Signal(str, str)

    def __init__(self, window=None):
        super().__init__()
        self.window = window
        self.raised.connect(self._show, Qt.ConnectionType.QueuedConnection)
        self._previous = sys.excepthook, threading.excepthook

    def install(self) -> None:
        sys.excepthook = self._hook
        threading.excepthook = lambda args: self._hook(args.exc_type, args.exc_value, args.exc_traceback)

    def uninstall(self) -> None:
        sys.excepthook, threading.excepthook = self._previous

    def _hook(self, exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            QApplication.quit()
            return
        details = "".join(traceback.format_exception(exc_type, exc, tb))
        log.error("unhandled exception:\n%s", details)
        self.raised.emit(f"{exc_type.__name__}: {exc}", details)

    def _show(self, summary: str, details: str) -> None:
        if self.window is not None and hasattr(self.window, "inform"):
            box = self.window.inform("Unexpected error", f"{summary}\n\nThe app keeps running; "
                                     "what you were doing may not have finished.")
            box.setDetailedText(details)
        else:
            QMessageBox.critical(None, "Unexpected error", summary)


def app_icon() -> QIcon:
    icon = QIcon()
    for name in ("icon.svg", "icon-256.png", "icon-64.png"):
        path = resource(name)
        if path is not None:
            icon.addFile(str(path))
    return icon


def style_sheet() -> str:
    """The style sheet's template: colours as @name (app/theme.py fills them in)."""
    path = resource("style.qss")
    return path.read_text(encoding="utf-8") if path is not None else ""


CJK_FALLBACKS = ("Noto Sans CJK SC", "Noto Sans SC", "Microsoft YaHei", "PingFang SC")


def ui_font(system: QFont) -> QFont:
    """The system's UI font with a CJK fallback after it, so Chinese renders even where the UI font lacks it. The
    first family is the one the system's font resolves to ("DejaVu Sans" for fontconfig's "Sans Serif"): an alias
    name first in the list matches no family, and everything, Latin included, was drawn in the CJK fallback, whose
    curly quotes and apostrophes are full width ("file’ s")."""
    font = QFont(system)
    font.setFamilies([QFontInfo(system).family(), *CJK_FALLBACKS])
    return font


def make_application(argv: list[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("DS-V4.1 Chat")
    app.setOrganizationName("ds-v41-chat")
    app.setDesktopFileName("ds-v41-chat")
    app.setWindowIcon(app_icon())
    app.setStyle("Fusion")
    app.setFont(ui_font(app.font()))
    template = style_sheet()
    theme.apply(app, template)
    try:  # follow the system when it switches between light and dark (Qt 6.5+)
        app.styleHints().colorSchemeChanged.connect(lambda _scheme: theme.apply(app, template))
    except AttributeError:
        pass
    return app


def tell_already_running(message: str) -> None:
    """In the terminal, and in a dialog where there is a screen to show one on (not Qt's offscreen platform)."""
    print(message, file=sys.stderr)
    if QApplication.platformName() not in ("offscreen", "minimal"):
        QMessageBox.warning(None, "DS-V4.1 Chat is already running", message)


def bring_to_front(window) -> None:
    """A second start asked for the running app: its window shows, restored if minimised, on top."""
    if window.isMinimized():
        window.showNormal()
    window.show()
    window.raise_()
    window.activateWindow()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = make_application(argv)
    lock = InstanceLock(data_dir())
    refused = lock.acquire()  # before anything opens the chats: one app per data folder
    if refused is not None:
        if lock.ask_to_show():  # the running app's window comes to the front (a second double-click)
            print(lock.shown_message(), file=sys.stderr)
        else:
            tell_already_running(refused)
        return ALREADY_RUNNING_EXIT
    from .window import MainWindow

    hook = ErrorHook()
    hook.install()
    try:
        window = MainWindow(autoload=True)
        hook.window = window
        window.show()
        lock.listen(lambda: bring_to_front(window))
        return app.exec()
    finally:
        hook.uninstall()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
