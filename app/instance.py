"""One app per data folder: a lock file in it (QLockFile), held while the window is open.

Two apps on one folder would both write the chats, and each would mark the other's streaming reply
"interrupted" when it starts (app.store). The second one is refused before it opens the store, and says how to
run a second one on a folder of its own. A lock left by a process that died (killed, crashed, the machine
restarted) is taken over: QLockFile finds its pid no longer running. Where no lock file can be made (a read-only
or full data folder) the app goes on: the store opens the chats to read only and says so.

The self-test and the terminal chat (`python -m engine chat`) never open the chats database: they take no lock
and run beside the app.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from PySide6.QtCore import QLockFile

from .paths import DATA_DIR_ENV

LOCK_NAME = "ds-v41-chat.lock"
ALREADY_RUNNING_EXIT = 3  # the launcher (installer/commands.py) shows no error of its own for it: the app said why


def already_running_message(folder: Path, pid: int | None) -> str:
    """What the second app says: which folder, which process holds it, and how to run another one beside it."""
    holder = f" (process {pid})" if pid else ""
    if platform.system() == "Windows":
        example = f'set {DATA_DIR_ENV}=%USERPROFILE%\\ds-v41-chat-2 && "{sys.executable}" -m app'
    else:
        example = f"{DATA_DIR_ENV}=$HOME/ds-v41-chat-2 {sys.executable} -m app"
    return (f"DS-V4.1 Chat is already running with the data folder {folder}{holder}. Switch to its window, or close "
            "it before starting the app again.\n\nTo run a second app at the same time, give it a data folder of "
            f"its own (its own chats and settings) with {DATA_DIR_ENV}, for example:\n  {example}")


class InstanceLock:
    """acquire() -> None when this process may use the data folder (the lock is held until release(), or no
    lock can be made there), or the message to show when another running app holds it."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._lock = QLockFile(str(self.folder / LOCK_NAME))
        # stale only when its process is gone (a live app holding the folder for hours is not stale)
        self._lock.setStaleLockTime(0)
        self.held = False

    def acquire(self) -> str | None:
        if self._lock.tryLock(0):
            self.held = True
            return None
        if self._lock.error() != QLockFile.LockError.LockFailedError:
            return None  # no lock file can be made here: the store opens read-only and says why
        return already_running_message(self.folder, self._holder())

    def _holder(self) -> int | None:
        try:
            info = self._lock.getLockInfo()
        except (RuntimeError, TypeError):
            return None
        if not isinstance(info, tuple) or not info or info[0] is False:  # (ok, pid, ...) in some PySide6 versions
            return None
        pid = next((v for v in info if isinstance(v, int) and not isinstance(v, bool)), None)
        return pid if pid is not None and pid > 0 else None

    def release(self) -> None:
        if self.held:
            self._lock.unlock()
            self.held = False
