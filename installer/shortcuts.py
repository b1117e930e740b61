"""Desktop / Start-menu entries for DS-V4.1 Chat and the places ``uninstall --purge`` clears.

Standard library only; user-level, no root. Used by ``bootstrap.py install-shortcut`` and
``bootstrap.py uninstall``:

  Linux    ~/.local/share/applications/ds-v41-chat.desktop (from installer/ds-v41-chat.desktop),
           icons in ~/.local/share/icons/hicolor/{64x64,256x256,scalable}/apps/
  macOS    ~/Applications/DS-V4.1 Chat.app (a small bundle that runs installer/launch-macos.command;
           its .icns is made from resources/icon-*.png)
  Windows  Start menu > Programs > DS-V4.1 Chat.lnk (made with PowerShell; a .bat there when that
           fails), pointing at installer/launch-windows.bat with an .ico made from resources/

Every function takes ``system``, ``env`` and ``home`` so each platform's layout is testable anywhere.
"""

from __future__ import annotations

import os
import platform
import plistlib
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

APP_ID = "ds-v41-chat"
APP_NAME = "DS-V4.1 Chat"
BUNDLE_ID = "local.dsv41.chat"
TEMPLATE_NAME = "ds-v41-chat.desktop"
ICON_PNGS = {64: "icon-64.png", 256: "icon-256.png"}
ICON_SVG = "icon.svg"
# What the app writes into its data folder (app/paths.py): --purge removes these.
DATA_FILES = ("conversations.sqlite3", "conversations.sqlite3-wal", "conversations.sqlite3-shm",
              "conversations.sqlite3-journal", "settings.ini", "settings.ini.lock")


def _say(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------- launchers


def launcher_path(repo: Path, system: str) -> Path:
    installer = Path(repo).resolve() / "installer"
    if system == "Windows":
        return installer / "launch-windows.bat"
    if system == "Darwin":
        return installer / "launch-macos.command"
    return installer / "launch-linux.sh"


def icon_paths(repo: Path) -> dict:
    """{64: png, 256: png, "svg": svg} for the icons in resources/ that exist."""
    res = Path(repo).resolve() / "resources"
    found = {size: res / name for size, name in ICON_PNGS.items() if (res / name).is_file()}
    if (res / ICON_SVG).is_file():
        found["svg"] = res / ICON_SVG
    return found


# ------------------------------------------------------------------------------ desktop entries


def desktop_exec_arg(arg) -> str:
    """One argument of a desktop entry's Exec key: always quoted, escaped per the spec."""
    text = str(arg).replace("%", "%%")
    text = '"' + re.sub(r'(["`$\\])', r"\\\1", text) + '"'
    return text.replace("\\", "\\\\")  # the string-level escape of a desktop file value


def render_desktop_entry(template: str, launcher: Path, icon: str) -> str:
    icon_value = str(icon).replace("\\", "\\\\")
    return template.replace("@EXEC@", desktop_exec_arg(launcher)).replace("@ICON@", icon_value)


def linux_places(env: dict, home: Path) -> dict:
    xdg = env.get("XDG_DATA_HOME", "")
    share = Path(xdg) if xdg and os.path.isabs(xdg) else Path(home) / ".local" / "share"
    hicolor = share / "icons" / "hicolor"
    return {
        "applications": share / "applications",
        "desktop": share / "applications" / f"{APP_ID}.desktop",
        "hicolor": hicolor,
        "icons": {64: hicolor / "64x64" / "apps" / f"{APP_ID}.png",
                  256: hicolor / "256x256" / "apps" / f"{APP_ID}.png",
                  "svg": hicolor / "scalable" / "apps" / f"{APP_ID}.svg"},
    }


def _refresh_linux_menus(places: dict, run: Callable) -> None:
    """Let the menus notice at once (they also do on their own); missing tools are fine."""
    for cmd in (["update-desktop-database", "-q", str(places["applications"])],
                ["gtk-update-icon-cache", "-q", "-t", "-f", str(places["hicolor"])]):
        if shutil.which(cmd[0]):
            try:
                run(cmd)
            except Exception:  # noqa: BLE001
                pass


def _run_quiet(cmd: list, env: dict | None = None) -> int:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
                              env=env, stdin=subprocess.DEVNULL).returncode
    except (OSError, subprocess.SubprocessError):
        return 1


def install_linux(repo: Path, env: dict, home: Path, run: Callable = _run_quiet) -> list:
    places = linux_places(env, home)
    launcher = launcher_path(repo, "Linux")
    template = (Path(repo).resolve() / "installer" / TEMPLATE_NAME).read_text(encoding="utf-8")
    made = []
    icons = icon_paths(repo)
    for key, src in icons.items():
        dest = places["icons"][key]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        made.append(dest)
    icon = APP_ID if icons else ""
    entry = render_desktop_entry(template, launcher, icon)
    places["applications"].mkdir(parents=True, exist_ok=True)
    dest = places["desktop"]
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(entry, encoding="utf-8")
    os.chmod(tmp, 0o755)  # some desktops only launch entries marked executable
    os.replace(tmp, dest)
    made.append(dest)
    _refresh_linux_menus(places, run)
    return made


def remove_linux(env: dict, home: Path, run: Callable = _run_quiet) -> list:
    places = linux_places(env, home)
    removed = []
    for path in [places["desktop"], *places["icons"].values()]:
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(path)
    if removed:
        _refresh_linux_menus(places, run)
    return removed


# ------------------------------------------------------------------------------------- icon files


def png_size(data: bytes) -> tuple:
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return struct.unpack(">II", data[16:24])


def png_to_ico(pngs: list) -> bytes:
    """A Windows .ico holding PNG images (Vista and later read these)."""
    entries, blobs = [], []
    offset = 6 + 16 * len(pngs)
    for data in pngs:
        w, h = png_size(data)
        entries.append(struct.pack("<BBBBHHII", w % 256, h % 256, 0, 0, 1, 32, len(data), offset))
        blobs.append(data)
        offset += len(data)
    return struct.pack("<HHH", 0, 1, len(pngs)) + b"".join(entries) + b"".join(blobs)


ICNS_TYPES = {16: b"icp4", 32: b"icp5", 64: b"icp6", 128: b"ic07", 256: b"ic08", 512: b"ic09", 1024: b"ic10"}


def png_to_icns(pngs: list) -> bytes:
    """A macOS .icns holding PNG images (10.7 and later read these)."""
    body = b""
    for data in pngs:
        w, _h = png_size(data)
        kind = ICNS_TYPES.get(w)
        if kind is None:
            continue
        body += kind + struct.pack(">I", len(data) + 8) + data
    return b"icns" + struct.pack(">I", len(body) + 8) + body


# ------------------------------------------------------------------------------------------ macOS


def mac_app_path(home: Path) -> Path:
    return Path(home) / "Applications" / f"{APP_NAME}.app"


def _is_our_bundle(app: Path) -> bool:
    try:
        with open(app / "Contents" / "Info.plist", "rb") as f:
            return plistlib.load(f).get("CFBundleIdentifier") == BUNDLE_ID
    except Exception:  # noqa: BLE001
        return False


def install_macos(repo: Path, home: Path) -> list:
    app = mac_app_path(home)
    if app.exists():
        if not _is_our_bundle(app):
            raise FileExistsError(f"{app} exists and was not made by this installer; move it away first")
        shutil.rmtree(app)
    contents = app / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    (contents / "Resources").mkdir()
    launcher = launcher_path(repo, "Darwin")
    info = {
        "CFBundleName": APP_NAME, "CFBundleDisplayName": APP_NAME, "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleExecutable": APP_ID, "CFBundlePackageType": "APPL", "CFBundleVersion": "1",
        "CFBundleShortVersionString": "1.0", "CFBundleInfoDictionaryVersion": "6.0",
        "LSMinimumSystemVersion": "10.13", "NSHighResolutionCapable": True,
    }
    icons = icon_paths(repo)
    pngs = [icons[s].read_bytes() for s in sorted(k for k in icons if isinstance(k, int))]
    if pngs:
        (contents / "Resources" / f"{APP_ID}.icns").write_bytes(png_to_icns(pngs))
        info["CFBundleIconFile"] = f"{APP_ID}.icns"
    with open(contents / "Info.plist", "wb") as f:
        plistlib.dump(info, f)
    (contents / "PkgInfo").write_text("APPL????", encoding="ascii")
    exe = contents / "MacOS" / APP_ID
    quoted = "'" + str(launcher).replace("'", "'\\''") + "'"
    exe.write_text("#!/bin/bash\n# Made by 'installer/bootstrap.py install-shortcut': starts "
                   f"{APP_NAME} from its checkout.\nexec {quoted} --from-app \"$@\"\n", encoding="utf-8")
    os.chmod(exe, 0o755)
    return [app]


def remove_macos(home: Path) -> list:
    app = mac_app_path(home)
    if app.exists() and _is_our_bundle(app):
        shutil.rmtree(app)
        return [app]
    return []


# ---------------------------------------------------------------------------------------- Windows


def windows_programs_dir(env: dict, home: Path) -> Path:
    appdata = env.get("APPDATA")
    base = Path(appdata) if appdata else Path(home) / "AppData" / "Roaming"
    return base / "Microsoft" / "Windows" / "Start Menu" / "Programs"


POWERSHELL_LNK = (
    "$ErrorActionPreference = 'Stop'; "
    "$s = (New-Object -ComObject WScript.Shell).CreateShortcut($env:DSV41_LNK); "
    "$s.TargetPath = $env:DSV41_TARGET; $s.WorkingDirectory = $env:DSV41_WORKDIR; "
    "if ($env:DSV41_ICON) { $s.IconLocation = $env:DSV41_ICON + ',0' }; "
    "$s.Description = $env:DSV41_DESC; $s.WindowStyle = 7; $s.Save()"
)


def install_windows(repo: Path, env: dict, home: Path, data_home: Path,
                    run: Callable = _run_quiet) -> list:
    programs = windows_programs_dir(env, home)
    programs.mkdir(parents=True, exist_ok=True)
    launcher = launcher_path(repo, "Windows")
    made = []
    icon = ""
    icons = icon_paths(repo)
    pngs = [icons[s].read_bytes() for s in sorted(k for k in icons if isinstance(k, int))]
    if pngs:
        ico = Path(data_home) / "shortcut" / f"{APP_ID}.ico"
        ico.parent.mkdir(parents=True, exist_ok=True)
        ico.write_bytes(png_to_ico(pngs))
        made.append(ico)
        icon = str(ico)
    lnk = programs / f"{APP_NAME}.lnk"
    bat = programs / f"{APP_NAME}.bat"
    ps_env = dict(env, DSV41_LNK=str(lnk), DSV41_TARGET=str(launcher), DSV41_WORKDIR=str(launcher.parent.parent),
                  DSV41_ICON=icon, DSV41_DESC=f"{APP_NAME}: chat with long documents on a local model")
    shell = shutil.which("powershell", path=env.get("PATH")) or shutil.which("pwsh", path=env.get("PATH")) \
        or "powershell"
    rc = run([shell, "-NoProfile", "-NonInteractive", "-ExecutionPolicy", "Bypass", "-Command", POWERSHELL_LNK],
             ps_env)
    if rc == 0 and lnk.is_file():
        if bat.is_file():
            bat.unlink()
        made.append(lnk)
    else:  # no PowerShell (or COM refused): a plain .bat in the same menu folder
        bat.write_text(f'@echo off\r\nrem Made by installer/bootstrap.py install-shortcut\r\n'
                       f'call "{launcher}" %*\r\n', encoding="utf-8")
        made.append(bat)
    return made


def remove_windows(env: dict, home: Path, data_home: Path) -> list:
    programs = windows_programs_dir(env, home)
    removed = []
    for path in (programs / f"{APP_NAME}.lnk", programs / f"{APP_NAME}.bat"):
        if path.is_file():
            path.unlink()
            removed.append(path)
    icons = Path(data_home) / "shortcut"
    if icons.is_dir():
        shutil.rmtree(icons, ignore_errors=True)
        removed.append(icons)
    return removed


# ------------------------------------------------------------------------------------- front door


def install_shortcut(repo: Path, data_home: Path, system: str | None = None, env: dict | None = None,
                     home: Path | None = None, run: Callable = _run_quiet) -> list:
    """Put the menu entry in place for this user; the paths made (the entry last)."""
    system = platform.system() if system is None else system
    env = dict(os.environ) if env is None else env
    home = Path.home() if home is None else Path(home)
    if system == "Windows":
        return install_windows(repo, env, home, data_home, run)
    if system == "Darwin":
        return install_macos(repo, home)
    return install_linux(repo, env, home, run)


def remove_shortcut(data_home: Path, system: str | None = None, env: dict | None = None,
                    home: Path | None = None, run: Callable = _run_quiet) -> list:
    system = platform.system() if system is None else system
    env = dict(os.environ) if env is None else env
    home = Path.home() if home is None else Path(home)
    if system == "Windows":
        return remove_windows(env, home, data_home)
    if system == "Darwin":
        return remove_macos(home)
    return remove_linux(env, home, run)


# ----------------------------------------------------------------------------- purge: models, chats


def _platform_dir(kind: str, env: dict, system: str, home: Path) -> Path:
    """platformdirs' user_cache_dir / user_data_dir for the app (appauthor=False), without it."""
    home = Path(home)
    if system == "Windows":
        local = env.get("LOCALAPPDATA")
        base = (Path(local) if local else home / "AppData" / "Local") / APP_ID
        return base / "Cache" if kind == "cache" else base
    if system == "Darwin":
        return home / "Library" / ("Caches" if kind == "cache" else "Application Support") / APP_ID
    var, default = ("XDG_CACHE_HOME", home / ".cache") if kind == "cache" else \
        ("XDG_DATA_HOME", home / ".local" / "share")
    value = env.get(var, "").strip()
    return (Path(os.path.expanduser(value)) if value else default) / APP_ID


def models_cache_dir(env: dict, system: str, home: Path) -> tuple:
    """(folder, overridden): where converted models live (engine/paths.py user_cache_dir)."""
    override = env.get("DSV41_CACHE_DIR")
    if override:
        return Path(override), True
    return _platform_dir("cache", env, system, home), False


def conversations_dir(env: dict, system: str, home: Path) -> tuple:
    """(folder, overridden): where conversations and settings live (app/paths.py data_dir)."""
    override = env.get("DSV41_DATA_DIR")
    if override:
        return Path(override), True
    return _platform_dir("data", env, system, home), False


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def purge_targets(env: dict, system: str, home: Path) -> list:
    """[(what, path)] that --purge removes, existing ones only.

    A folder of the app's own (the default places, named ds-v41-chat) goes whole; inside a folder
    the user named (DSV41_CACHE_DIR / DSV41_DATA_DIR) only what the app put there.
    """
    found = []
    cache, cache_set = models_cache_dir(env, system, home)
    found.append(("converted models", cache / "models" if cache_set else cache))
    data, data_set = conversations_dir(env, system, home)
    if data_set:
        found += [("conversations and settings", data / name) for name in DATA_FILES]
    else:
        found.append(("conversations and settings", data))
    return [(what, p) for what, p in found if p.exists()]


def describe_targets(targets: list) -> list:
    """One line per kind: where it is and how much it holds."""
    lines, seen = [], []
    for what, _ in targets:
        if what not in seen:
            seen.append(what)
    for what in seen:
        paths = [p for w, p in targets if w == what]
        size = sum(_size(p) for p in paths) / 2**20
        where = str(paths[0]) if len(paths) == 1 else f"{len(paths)} files in {paths[0].parent}"
        lines.append(f"{what}: {where} ({size:.0f} MiB)")
    return lines


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        def onerror(func, p, _exc):  # read-only files (Windows)
            try:
                os.chmod(p, 0o700)
                func(p)
            except OSError:
                pass
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=onerror)
        else:
            shutil.rmtree(path, onerror=onerror)
    elif path.exists() or path.is_symlink():
        path.unlink()
