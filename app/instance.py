"""One app per data folder: a lock file in it (QLockFile), held while the window is open.

Two apps on one folder would both write the chats, and each would mark the other's streaming reply
"interrupted" when it starts (app.store). The second one is refused before it opens the store, and says how to
run a second one on a folder of its own. A lock left by a process that died (killed, crashed, the machine
restarted) is taken over: QLockFile finds its pid no longer running (on this computer: where the folder is shared
and another computer's app holds it, the message names that computer and the lock file to delete if that app is
gone). Where no lock file can be made (a read-only
or full data folder) the app goes on: the store opens the chats to read only and says so. The app holding the folder
listens on a local socket named after it (QLocalServer): a second start (a second double-click) asks it to bring its
window to the front, and says so only in the terminal; where that fails it shows its message in a dialog too.

The self-test and the terminal chat (`python -m engine chat`) never open the chats database: they take no lock
and run beside the app.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QLockFile, QSysInfo
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from .paths import DATA_DIR_ENV

LOCK_NAME = "ds-v41-chat.lock"
SHOW = b"show\n"  # what a second start sends the running app: bring your window to the front
ALREADY_RUNNING_EXIT = 3  # the launcher (installer/commands.py) shows no error of its own for it: the app said why


def already_running_message(folder: Path, pid: int | None, *, shown: bool = False, host: str | None = None) -> str:
    """What the second app says: which folder, which process holds it (and on which machine, where another one
    does: a data folder on a network share), and how to run another one beside it (`shown`: the running app's window
    was brought to the front)."""
    holder = f" (process {pid})" if pid else ""
    what_now = ("Its window was brought to the front." if shown else
                "Switch to its window, or close it before starting the app again.")
    if host:
        # this machine cannot tell whether a process of another one still runs: a lock left by a crash there stays
        holder = f" (process {pid} on the computer {host})" if pid else f" (on the computer {host})"
        what_now = (f"Close it there before starting the app here. If the app is no longer running on {host} (that "
                    f"computer crashed or lost power), delete {Path(folder) / LOCK_NAME} and start the app again.")
    if platform.system() == "Windows":
        example = f'set {DATA_DIR_ENV}=%USERPROFILE%\\ds-v41-chat-2 && "{sys.executable}" -m app'
    else:
        example = f"{DATA_DIR_ENV}=$HOME/ds-v41-chat-2 {sys.executable} -m app"
    return (f"DS-V4.1 Chat is already running with the data folder {folder}{holder}. {what_now}\n\nTo run a second "
            f"app at the same time, give it a data folder of its own (its own chats and settings) with {DATA_DIR_ENV}, "
            f"for example:\n  {example}")


class InstanceLock:
    """acquire() -> None when this process may use the data folder (the lock is held until release(), or no
    lock can be made there), or the message to show when another running app holds it."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._lock = QLockFile(str(self.folder / LOCK_NAME))
        # stale only when its process is gone (a live app holding the folder for hours is not stale)
        self._lock.setStaleLockTime(0)
        self.held = False
        self._server: QLocalServer | None = None

    def acquire(self) -> str | None:
        if self._lock.tryLock(0):
            self.held = True
            return None
        if self._lock.error() != QLockFile.LockError.LockFailedError:
            return None  # no lock file can be made here: the store opens read-only and says why
        pid, host = self._holder()
        return already_running_message(self.folder, pid, host=host)

    def shown_message(self) -> str:
        """What a second start says after the running app brought its window to the front."""
        return already_running_message(self.folder, self._holder()[0], shown=True)

    def _holder(self) -> tuple[int | None, str | None]:
        """(the pid in the lock file, the computer it was made on where that is not this one)."""
        try:
            info = self._lock.getLockInfo()
        except (RuntimeError, TypeError):
            return None, None
        if not isinstance(info, tuple) or not info or info[0] is False:  # (ok, pid, ...) in some PySide6 versions
            return None, None
        pid = next((v for v in info if isinstance(v, int) and not isinstance(v, bool)), None)
        strings = [v for v in info if isinstance(v, str)]  # (pid, hostname, appname)
        host = strings[0] if strings and strings[0] and strings[0] != QSysInfo.machineHostName() else None
        return (pid if pid is not None and pid > 0 else None), host

    def release(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.held:
            self._lock.unlock()
            self.held = False

    # ------------------------------------------------------------------ the running app's window to the front
    def server_name(self) -> str:
        """The local socket the app holding this folder listens on (one per data folder, per user)."""
        folder = str(self.folder.resolve()).encode("utf-8", "surrogateescape")
        return "ds-v41-chat-" + hashlib.sha256(folder).hexdigest()[:16]

    def listen(self, show: Callable[[], None]) -> bool:
        """While the lock is held: a second start's request calls `show` (raise the window). False where no local
        socket can be made (the second start then only says the app is running)."""
        if not self.held:
            return False
        QLocalServer.removeServer(self.server_name())  # left by an app that was killed
        server = QLocalServer()
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)

        def accept() -> None:
            while server.hasPendingConnections():
                socket = server.nextPendingConnection()
                socket.readyRead.connect(lambda socket=socket: self._read(socket, show))
                socket.disconnected.connect(socket.deleteLater)

        server.newConnection.connect(accept)
        if not server.listen(self.server_name()):
            return False
        self._server = server
        return True

    @staticmethod
    def _read(socket: QLocalSocket, show: Callable[[], None]) -> None:
        if bytes(socket.readAll().data()).startswith(SHOW):
            show()

    def ask_to_show(self, timeout_ms: int = 1500) -> bool:
        """From a second start: ask the app holding the folder to bring its window to the front; whether it got
        the request."""
        socket = QLocalSocket()
        socket.connectToServer(self.server_name())
        if not socket.waitForConnected(timeout_ms):
            return False
        socket.write(SHOW)
        sent = socket.waitForBytesWritten(timeout_ms)
        socket.disconnectFromServer()
        return sent
