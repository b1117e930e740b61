"""One app per data folder: a second `python -m app` on the same folder says so and leaves the chats alone; a lock
left by a killed app does not block the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.instance import ALREADY_RUNNING_EXIT, LOCK_NAME, InstanceLock

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys; from pathlib import Path; from app.instance import InstanceLock\n"
        "lock = InstanceLock(Path(sys.argv[1]))\n"
        "print('refused' if lock.acquire() else 'held', flush=True)\n"
        "sys.stdin.read()\n")


@pytest.fixture
def holder(data_dir):
    """Another process holding the data folder, as a running app does (killed at the end)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(data_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_a_second_app_on_the_same_data_folder_is_refused_and_the_chats_are_left_alone(data_dir, holder):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "DSV41_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    second = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == ALREADY_RUNNING_EXIT, second.stderr[-2000:]
    assert f"already running with the data folder {data_dir} (process {holder.pid})" in second.stderr
    assert "DSV41_DATA_DIR=" in second.stderr  # how to run a second one: a data folder of its own
    assert sorted(p.name for p in data_dir.iterdir()) == [LOCK_NAME]  # no chats database opened, no settings
    # the same in this process: refused while the other app runs
    message = InstanceLock(data_dir).acquire()
    assert message is not None and f"(process {holder.pid})" in message


def test_a_lock_left_by_a_killed_app_is_taken_over(data_dir, holder):
    holder.kill()  # kill -9: the lock file stays, naming a process that is gone
    holder.wait()
    assert (data_dir / LOCK_NAME).exists()
    lock = InstanceLock(data_dir)
    assert lock.acquire() is None and lock.held
    again = InstanceLock(data_dir).acquire()  # now this process holds it
    assert again is not None and f"(process {os.getpid()})" in again
    lock.release()
    assert not (data_dir / LOCK_NAME).exists()
    assert InstanceLock(data_dir).acquire() is None


def test_a_lock_made_on_another_computer_names_it_and_the_file_to_delete(data_dir):
    # a data folder on a network share: this machine cannot see whether that process runs, so the lock stays
    from PySide6.QtCore import QSysInfo

    data_dir.mkdir(parents=True, exist_ok=True)
    assert QSysInfo.machineHostName() != "lab-workstation-7"
    (data_dir / LOCK_NAME).write_text("4242\npython3\nlab-workstation-7\n", encoding="utf-8")
    message = InstanceLock(data_dir).acquire()
    assert message is not None
    assert "(process 4242 on the computer lab-workstation-7)" in message
    assert f"delete {data_dir / LOCK_NAME} and start the app again" in message
    (data_dir / LOCK_NAME).unlink()  # what the message says to do
    lock = InstanceLock(data_dir)
    assert lock.acquire() is None
    lock.release()


def test_a_folder_where_no_lock_can_be_made_does_not_stop_the_app(tmp_path):
    """A read-only or full data folder: the store opens the chats to read only and says why (app.store)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    lock = InstanceLock(blocked)  # no lock file can be made inside a file
    assert lock.acquire() is None and not lock.held


def test_the_message_is_a_dialog_where_there_is_a_screen_and_the_launcher_adds_no_error(qapp, monkeypatch, capsys):
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.main import tell_already_running
    from installer.commands import QUIET_EXIT_CODES

    shown = []
    monkeypatch.setattr(QApplication, "platformName", staticmethod(lambda: "xcb"))
    monkeypatch.setattr(QMessageBox, "warning", staticmethod(lambda parent, title, text: shown.append((title, text))))
    tell_already_running("DS-V4.1 Chat is already running with the data folder X")
    assert shown == [("DS-V4.1 Chat is already running", "DS-V4.1 Chat is already running with the data folder X")]
    assert "already running" in capsys.readouterr().err
    assert ALREADY_RUNNING_EXIT in QUIET_EXIT_CODES  # the app said why itself: no "stopped unexpectedly" window


def test_a_second_start_brings_the_running_apps_window_to_the_front(qtbot, tmp_path):
    shown = []
    running = InstanceLock(tmp_path)
    assert running.acquire() is None and running.listen(lambda: shown.append(True))
    try:
        second = InstanceLock(tmp_path)
        assert second.acquire() is not None  # refused: the folder is held
        assert second.ask_to_show()
        qtbot.waitUntil(lambda: shown == [True], timeout=5_000)
    finally:
        running.release()
    assert not InstanceLock(tmp_path).ask_to_show()  # nobody listens once the app is gone


def test_a_listener_left_by_a_killed_app_does_not_stop_the_next_one(qtbot, tmp_path):
    first = InstanceLock(tmp_path)
    assert first.acquire() is None and first.listen(lambda: None)
    first._lock.unlock()  # as if killed: its socket name stays taken until the next app clears it
    first.held = False
    shown = []
    nxt = InstanceLock(tmp_path)
    try:
        assert nxt.acquire() is None and nxt.listen(lambda: shown.append(True))
        assert InstanceLock(tmp_path).ask_to_show()
        qtbot.waitUntil(lambda: shown == [True], timeout=5_000)
    finally:
        nxt.release()
        first.release()


LISTEN = ("import sys; from pathlib import Path\n"
          "from PySide6.QtCore import QCoreApplication\n"
          "from app.instance import InstanceLock\n"
          "app = QCoreApplication([])\n"
          "lock = InstanceLock(Path(sys.argv[1]))\n"
          "assert lock.acquire() is None and lock.listen(lambda: (print('shown', flush=True), app.quit()))\n"
          "print('listening', flush=True)\n"
          "app.exec()\n")


def test_python_m_app_a_second_time_raises_the_first_window_instead_of_a_dialog(data_dir):
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "DSV41_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", LISTEN, str(data_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout.readline().strip() == "listening"
        second = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == ALREADY_RUNNING_EXIT, second.stderr[-2000:]
        assert "already running with the data folder" in second.stderr
        assert "Its window was brought to the front." in second.stderr
        assert first.wait(timeout=30) == 0  # it quits when asked to show its window (TimeoutExpired: never asked)
        assert first.stdout.read().strip() == "shown"
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
