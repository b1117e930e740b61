"""Launchers (Linux .sh + .desktop, macOS .command, Windows .bat), install-shortcut and uninstall."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from installer import commands, venv_setup

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "installer"
LINUX = INSTALLER / "launch-linux.sh"
MACOS = INSTALLER / "launch-macos.command"
WINDOWS = INSTALLER / "launch-windows.bat"
DESKTOP = INSTALLER / "ds-v41-chat.desktop"
posix_only = pytest.mark.skipif(os.name == "nt", reason="POSIX shell launchers")

FAKE_BOOTSTRAP = """\
import json, os, sys
from pathlib import Path
record = Path(os.environ["FAKE_RECORD"])
calls = json.loads(record.read_text()) if record.exists() else []
calls.append({"argv": sys.argv[1:], "cwd": os.getcwd(), "file": str(Path(__file__).resolve()),
              "in_terminal": os.environ.get("DSV41_IN_TERMINAL")})
record.write_text(json.dumps(calls))
if sys.argv[1:2] == ["status"]:
    sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
print("fake bootstrap ran", sys.argv[1:])
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


def _tool_bin(tmp_path: Path, extra: dict | None = None) -> Path:
    """A PATH folder with only the tools the launchers use (no python, no terminal, no dialogs)."""
    bindir = tmp_path / "toolbin"
    bindir.mkdir(exist_ok=True)
    for tool in ("sh", "bash", "dirname", "basename", "readlink", "mkdir", "wc", "mv", "date", "env", "cat"):
        found = shutil.which(tool)
        if found and not (bindir / tool).exists():
            (bindir / tool).symlink_to(found)
    for name, text in (extra or {}).items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def _fake_checkout(tmp_path: Path, name: str = "my checkout") -> Path:
    """A checkout (with a space in its path) whose bootstrap.py only records how it was called."""
    repo = tmp_path / name
    (repo / "installer").mkdir(parents=True)
    for f in (LINUX, MACOS):
        shutil.copy2(f, repo / "installer" / f.name)
    (repo / "installer" / "bootstrap.py").write_text(FAKE_BOOTSTRAP)
    return repo


def _launcher_env(tmp_path: Path, bindir: Path, **extra) -> dict:
    env = {"PATH": str(bindir), "HOME": str(tmp_path / "home"), "DSV41_PYTHON": sys.executable,
           "DSV41_HOME": str(tmp_path / "data"), "FAKE_RECORD": str(tmp_path / "calls.json"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def _calls(tmp_path: Path) -> list:
    path = tmp_path / "calls.json"
    return json.loads(path.read_text()) if path.exists() else []


# -------------------------------------------------------------------------------- the files


@posix_only
def test_launchers_have_run_bits_and_shebangs():
    for path, shebang in ((LINUX, "#!/bin/sh"), (MACOS, "#!/bin/bash")):
        mode = path.stat().st_mode
        assert mode & stat.S_IXUSR and mode & stat.S_IXGRP and mode & stat.S_IXOTH, f"{path} is not executable"
        data = path.read_bytes()
        assert data.startswith(shebang.encode() + b"\n")
        assert b"\r" not in data, f"{path} must have LF line endings"
    # When git tracks them, it must record the run bit too (a fresh clone gets it from there).
    if shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-s", "--", str(LINUX), str(MACOS)], cwd=REPO,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            assert line.startswith("100755"), line


@posix_only
def test_shell_launchers_parse():
    assert subprocess.run(["sh", "-n", str(LINUX)]).returncode == 0
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(MACOS)]).returncode == 0
    if shutil.which("shellcheck"):
        for path in (LINUX, MACOS):
            r = subprocess.run(["shellcheck", "-S", "error", str(path)], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout


def test_windows_launcher_text():
    data = WINDOWS.read_bytes()
    assert data.count(b"\r\n") == data.count(b"\n"), "the .bat needs CRLF line endings"
    text = data.decode("ascii")
    assert text.startswith("@echo off")
    assert 'set "BOOT=%~dp0bootstrap.py"' in text  # next to the launcher, wherever it is
    assert 'cd /d "%~dp0.."' in text
    assert '"%BOOT%" run %*' in text
    assert "sys.version_info >= (3, 10)" in text and "py -3" in text
    assert "pause" in text  # a failure stays readable
    assert "\\" not in text.replace("installer\\", "").replace("%LOCALAPPDATA%\\", "").replace(
        'rem "py installer\\bootstrap.py', "")  # no hard-coded Windows paths
    gitattributes = (INSTALLER / ".gitattributes").read_text()
    assert "*.bat text eol=crlf" in gitattributes


def test_desktop_template_fields():
    text = DESKTOP.read_text()
    lines = text.splitlines()
    assert lines[0] == "[Desktop Entry]"
    keys = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert keys["Type"] == "Application" and keys["Name"] == "DS-V4.1 Chat"
    assert keys["Exec"] == "@EXEC@" and keys["Icon"] == "@ICON@"
    assert keys["Terminal"] == "false"
    # app/main.py calls setDesktopFileName("ds-v41-chat"): the file name must match.
    assert DESKTOP.stem == "ds-v41-chat"
    assert "setDesktopFileName(\"ds-v41-chat\")" in (REPO / "app" / "main.py").read_text()


def test_desktop_exec_quoting(shortcuts):
    q = shortcuts.desktop_exec_arg
    assert q("/opt/app/launch-linux.sh") == '"/opt/app/launch-linux.sh"'
    assert q("/home/a b/launch.sh") == '"/home/a b/launch.sh"'
    # $, " and ` are escaped inside the quotes, then every backslash once more for the file format.
    assert q('/x/$HOME"q`.sh') == r'"/x/\\$HOME\\"q\\`.sh"'
    assert q("/x/100%/l.sh") == '"/x/100%%/l.sh"'
    assert q("/x/back\\slash") == r'"/x/back\\\\slash"'


def _validate(path: Path) -> bool:
    """desktop-file-validate the entry; False when the tool is not installed."""
    exe = shutil.which("desktop-file-validate")
    if not exe:
        return False
    r = subprocess.run([exe, str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "error" not in r.stdout.lower(), r.stdout + r.stderr
    return True


def test_desktop_template_validates():
    if not _validate(DESKTOP):
        pytest.skip("desktop-file-validate is not installed (apt-get install -y desktop-file-utils)")


# ---------------------------------------------------------------------- running the launchers


@posix_only
def test_linux_launcher_finds_repo_through_a_link(tmp_path):
    repo = _fake_checkout(tmp_path)
    elsewhere = tmp_path / "Desktop dir"
    elsewhere.mkdir()
    link = elsewhere / "DS-V4.1 Chat"
    link.symlink_to(repo / "installer" / "launch-linux.sh")
    env = _launcher_env(tmp_path, _tool_bin(tmp_path))
    r = subprocess.run([str(link), "--flag", "two words"], cwd=str(tmp_path), env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _calls(tmp_path)
    # Not on a terminal: it first asks whether a setup is due, then runs the app.
    assert [c["argv"] for c in calls] == [["status"], ["run", "--flag", "two words"]]
    assert calls[-1]["file"] == str((repo / "installer" / "bootstrap.py").resolve())
    assert Path(calls[-1]["cwd"]).resolve() == repo.resolve()
    log = tmp_path / "data" / "logs" / "launcher.log"
    assert "fake bootstrap ran" in log.read_text()  # output kept when nobody sees a terminal


@posix_only
def test_linux_launcher_opens_a_terminal_when_setup_is_due_and_no_window_can(tmp_path):
    repo = _fake_checkout(tmp_path)
    term_log = tmp_path / "terminal.txt"
    fake_term = f'#!/bin/sh\necho "$@" > "{term_log}"\n[ "$1" = "-e" ] && shift\nexec "$@"\n'
    env = _launcher_env(tmp_path, _tool_bin(tmp_path, {"x-terminal-emulator": fake_term}), FAKE_STATUS="1")
    env.pop("DISPLAY", None)  # no X display: Tk cannot show the first-run window
    launcher = repo / "installer" / "launch-linux.sh"
    r = subprocess.run([str(launcher)], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert term_log.read_text().split()[:3] == ["-e", "env", "DSV41_IN_TERMINAL=1"]
    runs = [c for c in _calls(tmp_path) if c["argv"][:1] == ["run"]]
    assert len(runs) == 1 and runs[0]["in_terminal"] == "1"


@posix_only
def test_linux_launcher_without_python(tmp_path):
    repo = _fake_checkout(tmp_path)
    old_python = "#!/bin/sh\nexit 1\n"  # answers the version check like a Python 3.8 would
    env = _launcher_env(tmp_path, _tool_bin(tmp_path, {"python3": old_python}), DSV41_PYTHON="/nonexistent/python")
    r = subprocess.run([str(repo / "installer" / "launch-linux.sh")], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "needs Python 3.10 or newer" in r.stderr
    assert _calls(tmp_path) == []


@posix_only
@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
def test_macos_launcher_from_app_bundle(tmp_path):
    repo = _fake_checkout(tmp_path)
    env = _launcher_env(tmp_path, _tool_bin(tmp_path))
    launcher = repo / "installer" / "launch-macos.command"
    r = subprocess.run([str(launcher), "--from-app", "-psn_0_12345", "--x"], cwd=str(tmp_path), env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _calls(tmp_path)
    assert calls[-1]["argv"] == ["run", "--x"]  # macOS's -psn_ and our --from-app are dropped
    assert Path(calls[-1]["cwd"]).resolve() == repo.resolve()
    assert (tmp_path / "data" / "logs" / "launcher.log").is_file()
    # Double-clicked in Finder (Terminal): runs directly; a failure waits for Enter.
    env["FAKE_RC"] = "3"
    r = subprocess.run([str(launcher)], env=env, input="\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "Press Enter" in r.stdout


# -------------------------------------------------------------------------- install-shortcut


def test_install_shortcut_linux_in_temp_home(tmp_path, fake_repo):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DSV41_"))}
    env.update(HOME=str(home), DSV41_HOME=str(tmp_path / "data"))
    cmd = [sys.executable, str(fake_repo / "installer" / "bootstrap.py"), "install-shortcut"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    entry = home / ".local" / "share" / "applications" / "ds-v41-chat.desktop"
    assert entry.is_file() and os.access(entry, os.X_OK)
    keys = dict(line.split("=", 1) for line in entry.read_text().splitlines() if "=" in line)
    launcher = (fake_repo / "installer" / "launch-linux.sh").resolve()
    assert keys["Exec"] == f'"{launcher}"'  # absolute, quoted (the path has a space)
    assert keys["Icon"] == "ds-v41-chat"
    hicolor = home / ".local" / "share" / "icons" / "hicolor"
    for size in (64, 256):
        icon = hicolor / f"{size}x{size}" / "apps" / "ds-v41-chat.png"
        assert icon.read_bytes() == (fake_repo / "resources" / f"icon-{size}.png").read_bytes()
    assert (hicolor / "scalable" / "apps" / "ds-v41-chat.svg").is_file()
    _validate(entry)  # where desktop-file-utils is installed
    # Twice is fine.
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=60).returncode == 0
    # uninstall removes it again (nothing else installed; no data to keep).
    r = subprocess.run([sys.executable, str(fake_repo / "installer" / "bootstrap.py"), "uninstall"], env=env,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not entry.exists()
    assert not list(hicolor.rglob("ds-v41-chat.*"))


def test_install_shortcut_respects_xdg_data_home(tmp_path, fake_repo, shortcuts):
    xdg = tmp_path / "xdg"
    made = shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Linux", {"XDG_DATA_HOME": str(xdg)},
                                      tmp_path / "home", run=lambda cmd: 0)
    assert made[-1] == xdg / "applications" / "ds-v41-chat.desktop"
    assert (xdg / "icons" / "hicolor" / "256x256" / "apps" / "ds-v41-chat.png").is_file()


def test_install_shortcut_macos_bundle(tmp_path, fake_repo, shortcuts):
    home = tmp_path / "home"
    [app] = shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Darwin", {}, home)
    assert app == home / "Applications" / "DS-V4.1 Chat.app"
    info = plistlib.loads((app / "Contents" / "Info.plist").read_bytes())
    assert info["CFBundleExecutable"] == "ds-v41-chat" and info["CFBundlePackageType"] == "APPL"
    exe = app / "Contents" / "MacOS" / "ds-v41-chat"
    assert os.access(exe, os.X_OK)
    launcher = (fake_repo / "installer" / "launch-macos.command").resolve()
    assert f"exec '{launcher}' --from-app" in exe.read_text()
    icns = (app / "Contents" / "Resources" / info["CFBundleIconFile"]).read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)
    kinds, pos = [], 8
    while pos < len(icns):
        kinds.append(icns[pos:pos + 4])
        pos += struct.unpack(">I", icns[pos + 4:pos + 8])[0]
    assert kinds == [b"icp6", b"ic08"] and pos == len(icns)  # 64 and 256 px PNGs
    # Again: replaced, not duplicated; and a foreign bundle of that name is never touched.
    shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Darwin", {}, home)
    assert shortcuts.remove_shortcut(tmp_path / "data", "Darwin", {}, home) == [app]
    app.mkdir(parents=True)
    (app / "theirs").write_text("x")
    with pytest.raises(FileExistsError):
        shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Darwin", {}, home)
    assert shortcuts.remove_shortcut(tmp_path / "data", "Darwin", {}, home) == []
    assert (app / "theirs").exists()


def test_install_shortcut_windows_lnk_and_fallback(tmp_path, fake_repo, shortcuts):
    env = {"APPDATA": str(tmp_path / "Roaming"), "PATH": ""}
    programs = tmp_path / "Roaming" / "Microsoft" / "Windows" / "Start Menu" / "Programs"
    seen = {}

    def powershell_ok(cmd, ps_env):
        seen["cmd"], seen["env"] = cmd, ps_env
        Path(ps_env["DSV41_LNK"]).write_bytes(b"L\x00\x00\x00")  # what WScript.Shell would save
        return 0

    made = shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Windows", env, tmp_path, run=powershell_ok)
    assert made[-1] == programs / "DS-V4.1 Chat.lnk"
    assert "CreateShortcut" in seen["cmd"][-1] and "-NoProfile" in seen["cmd"]
    assert seen["env"]["DSV41_TARGET"] == str((fake_repo / "installer" / "launch-windows.bat").resolve())
    assert seen["env"]["DSV41_WORKDIR"] == str(fake_repo.resolve())
    ico = Path(seen["env"]["DSV41_ICON"]).read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind, count) == (0, 1, 2)
    sizes = [ico[6 + 16 * i] for i in range(count)]
    assert sizes == [64, 0]  # 0 means 256 in an .ico directory
    for i in range(count):
        size, offset = struct.unpack("<II", ico[6 + 16 * i + 8:6 + 16 * i + 16])
        assert ico[offset:offset + 8] == b"\x89PNG\r\n\x1a\n" and offset + size <= len(ico)
    # No PowerShell: a .bat in the same Start-menu folder.
    (programs / "DS-V4.1 Chat.lnk").unlink()
    made = shortcuts.install_shortcut(fake_repo, tmp_path / "data", "Windows", env, tmp_path,
                                      run=lambda cmd, e: 1)
    bat = programs / "DS-V4.1 Chat.bat"
    assert made[-1] == bat
    assert bat.read_bytes().count(b"\r\n") == 3
    assert f'call "{(fake_repo / "installer" / "launch-windows.bat").resolve()}" %*' in bat.read_text()
    removed = shortcuts.remove_shortcut(tmp_path / "data", "Windows", env, tmp_path)
    assert bat in removed and not bat.exists() and not (tmp_path / "data" / "shortcut").exists()


# ------------------------------------------------------------------------------------ uninstall


def _installed(tmp_path: Path) -> tuple:
    """A data home with a venv, logs, conversations; a cache with a converted model."""
    home = tmp_path / "data"
    venv = home / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    (venv / venv_setup.MARKER_NAME).write_text("{}")
    (home / "logs").mkdir()
    (home / "logs" / "setup.log").write_text("log")
    (home / "conversations.sqlite3").write_text("chats")
    (home / "settings.ini").write_text("[x]")
    cache = tmp_path / "user" / ".cache" / "ds-v41-chat"
    (cache / "models" / "SmolLM2").mkdir(parents=True)
    (cache / "models" / "SmolLM2" / "model.safetensors").write_bytes(b"0" * 1024)
    env = {"XDG_CACHE_HOME": str(tmp_path / "user" / ".cache"), "XDG_DATA_HOME": str(tmp_path / "xdgdata")}
    return home, cache, env


def test_uninstall_keeps_data_unless_purged(tmp_path, printer, monkeypatch, capsys):
    home, cache, env = _installed(tmp_path)
    # The app's data folder is where the conversations are (here: the same folder as the venv).
    env["DSV41_DATA_DIR"] = str(home)
    rc = commands.cmd_uninstall([], REPO, home, "Linux", env, tmp_path / "user", interactive=False)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert not (home / "venv").exists() and not (home / "logs").exists()
    assert (home / "conversations.sqlite3").exists() and (cache / "models").exists()
    assert "rerun with --purge" in out and "converted models" in out
    # Asked in a terminal: "n" keeps them ...
    monkeypatch.setattr("builtins.input", lambda prompt="": "n")
    assert commands.cmd_uninstall([], REPO, home, "Linux", env, tmp_path / "user", interactive=True) == 0
    assert (home / "conversations.sqlite3").exists()
    # ... "y" deletes them; a user-named data folder loses only the app's own files.
    (home / "my notes.txt").write_text("not the app's")
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    assert commands.cmd_uninstall([], REPO, home, "Linux", env, tmp_path / "user", interactive=True) == 0
    assert not (home / "conversations.sqlite3").exists() and not (home / "settings.ini").exists()
    assert not cache.exists()
    assert (home / "my notes.txt").exists()


def test_uninstall_purge_flag_default_places(tmp_path, capsys):
    home, cache, env = _installed(tmp_path)
    data = tmp_path / "xdgdata" / "ds-v41-chat"  # platformdirs' user_data_dir under XDG_DATA_HOME
    data.mkdir(parents=True)
    (data / "conversations.sqlite3").write_text("chats")
    assert commands.cmd_uninstall(["--purge"], REPO, home, "Linux", env, tmp_path / "user", interactive=False) == 0
    assert not data.exists() and not cache.exists()
    # The data home (DSV41_HOME here) is not the app's data folder: only the installer's parts went.
    assert sorted(p.name for p in home.iterdir()) == ["conversations.sqlite3", "settings.ini"]
    assert commands.cmd_uninstall(["--purge", "--keep-data"], REPO, home, "Linux", env, tmp_path) == 2
    assert commands.cmd_uninstall(["--bogus"], REPO, home, "Linux", env, tmp_path) == 2


def test_uninstall_never_deletes_a_folder_that_is_not_a_venv(tmp_path, capsys):
    home = tmp_path / "data"
    (home / "venv").mkdir(parents=True)
    (home / "venv" / "precious.txt").write_text("user data")
    assert commands.cmd_uninstall(["--keep-data"], REPO, home, "Linux", {}, tmp_path, interactive=False) == 0
    assert (home / "venv" / "precious.txt").exists()
    assert "not a virtual environment" in capsys.readouterr().out


def test_purge_places_per_platform(tmp_path, shortcuts):
    h = tmp_path
    assert shortcuts.models_cache_dir({}, "Linux", h) == (h / ".cache" / "ds-v41-chat", False)
    assert shortcuts.models_cache_dir({}, "Darwin", h) == (h / "Library" / "Caches" / "ds-v41-chat", False)
    assert shortcuts.models_cache_dir({"LOCALAPPDATA": str(h / "L")}, "Windows", h) == \
        (h / "L" / "ds-v41-chat" / "Cache", False)
    assert shortcuts.models_cache_dir({"DSV41_CACHE_DIR": str(h / "c")}, "Linux", h) == (h / "c", True)
    assert shortcuts.conversations_dir({}, "Linux", h) == (h / ".local" / "share" / "ds-v41-chat", False)
    assert shortcuts.conversations_dir({}, "Darwin", h) == \
        (h / "Library" / "Application Support" / "ds-v41-chat", False)
    assert shortcuts.conversations_dir({"DSV41_DATA_DIR": str(h / "d")}, "Windows", h) == (h / "d", True)
    # Inside a folder the user named, only what the app made there is a target.
    (h / "c" / "models").mkdir(parents=True)
    (h / "c" / "other").mkdir()
    targets = shortcuts.purge_targets({"DSV41_CACHE_DIR": str(h / "c"), "DSV41_DATA_DIR": str(h / "d")}, "Linux", h)
    assert targets == [("converted models", h / "c" / "models")]
