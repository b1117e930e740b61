"""Which system libraries Qt's platform plugin lacks on this Linux machine, and the packages that hold them.

Standard library only (bootstrap.py loads it before the app's environment is usable). The check runs `ldd`
on the plugin the app will use (xcb under X11, wayland under Wayland) inside the app's own PySide6, so it
names exactly the libraries the loader cannot find -- not a guess from Qt's error text, which names
libxcb-cursor0 whatever is missing. Each library maps to its package for the distribution's package manager
(apt, dnf, pacman, zypper); on apt the names are checked against apt-cache where it knows them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Libraries whose package name does not follow Debian's rule (soname -> name + version), and the names on
# other distributions. Keys are sonames without the version.
_PACKAGES = {
    #  soname base          apt                   dnf                    pacman              zypper
    "libxcb-icccm": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm", "libxcb-icccm4"),
    "libxcb-keysyms": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms", "libxcb-keysyms1"),
    "libxcb-cursor": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor", "libxcb-cursor0"),
    "libxcb-image": ("libxcb-image0", "xcb-util-image", "xcb-util-image", "libxcb-image0"),
    "libxcb-render-util": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil",
                           "libxcb-render-util0"),
    "libxcb-util": ("libxcb-util1", "xcb-util", "xcb-util", "libxcb-util1"),
    "libxkbcommon-x11": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11", "libxkbcommon-x11-0"),
    "libxkbcommon": ("libxkbcommon0", "libxkbcommon", "libxkbcommon", "libxkbcommon0"),
    "libEGL": ("libegl1", "libglvnd-egl", "libglvnd", "libEGL1"),
    "libGL": ("libgl1", "libglvnd-glx", "libglvnd", "libGL1"),
    "libGLX": ("libglx0", "libglvnd-glx", "libglvnd", "libGLX0"),
    "libOpenGL": ("libopengl0", "libglvnd-opengl", "libglvnd", "libOpenGL0"),
    "libGLdispatch": ("libglvnd0", "libglvnd", "libglvnd", "libGLdispatch0"),
    "libfontconfig": ("libfontconfig1", "fontconfig", "fontconfig", "libfontconfig1"),
    "libfreetype": ("libfreetype6", "freetype", "freetype2", "libfreetype6"),
    "libdbus-1": ("libdbus-1-3", "dbus-libs", "dbus", "libdbus-1-3"),
    "libglib-2.0": ("libglib2.0-0", "glib2", "glib2", "libglib-2_0-0"),
    "libgthread-2.0": ("libglib2.0-0", "glib2", "glib2", "libgthread-2_0-0"),
    "libX11-xcb": ("libx11-xcb1", "libX11-xcb", "libx11", "libX11-xcb1"),
    "libX11": ("libx11-6", "libX11", "libx11", "libX11-6"),
    "libxcb": ("libxcb1", "libxcb", "libxcb", "libxcb1"),
    "libwayland-client": ("libwayland-client0", "libwayland-client", "wayland", "libwayland-client0"),
    "libwayland-cursor": ("libwayland-cursor0", "libwayland-cursor", "wayland", "libwayland-cursor0"),
    "libwayland-egl": ("libwayland-egl1", "libwayland-egl", "wayland", "libwayland-egl1"),
}
_MANAGERS = ("apt", "dnf", "pacman", "zypper")
_INSTALL = {
    "apt": ["apt-get", "install", "-y", "--no-install-recommends"],
    "dnf": ["dnf", "install", "-y"],
    "pacman": ["pacman", "-S", "--needed", "--noconfirm"],
    "zypper": ["zypper", "--non-interactive", "install"],
}


@dataclass(frozen=True)
class QtCheck:
    plugin: Path | None  # the platform plugin checked (None: PySide6 or the plugin was not found)
    missing: tuple[str, ...]  # sonames the dynamic loader cannot find
    manager: str | None  # apt | dnf | pacman | zypper | None
    packages: tuple[str, ...]  # what to install for them

    @property
    def ok(self) -> bool:
        return not self.missing

    def command(self, sudo: bool = True) -> str:
        if not self.packages:
            return ""
        if self.manager is None:
            return "install the packages holding: " + " ".join(self.missing)
        prefix = ["sudo"] if sudo else []
        return " ".join(prefix + _INSTALL[self.manager] + list(self.packages))


def platform_plugin(pyside_dir: Path, env: dict | None = None) -> Path | None:
    """The platform plugin Qt will load: QT_QPA_PLATFORM when set, wayland on a Wayland-only session, else xcb."""
    env = os.environ if env is None else env
    wanted = (env.get("QT_QPA_PLATFORM") or "").split(":")[0].split(";")[0].strip().lower()
    if not wanted:
        wanted = "wayland" if env.get("WAYLAND_DISPLAY") and not env.get("DISPLAY") else "xcb"
    names = {"xcb": "libqxcb.so", "wayland": "libqwayland.so", "offscreen": "libqoffscreen.so",
             "minimal": "libqminimal.so", "eglfs": "libqeglfs.so", "vnc": "libqvnc.so"}
    folder = Path(pyside_dir) / "Qt" / "plugins" / "platforms"
    candidates = [names.get(wanted, f"libq{wanted}.so")]
    if wanted == "wayland":
        candidates.append("libqwayland-generic.so")
    for name in candidates:
        if (folder / name).is_file():
            return folder / name
    return None


def missing_libraries(library: Path, ldd: str | None = None) -> tuple[str, ...]:
    """Sonames `ldd` reports as 'not found' for `library` (and everything it loads)."""
    ldd = ldd or shutil.which("ldd")
    if not ldd:
        return ()
    try:
        out = subprocess.run([ldd, str(library)], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_ldd(out.stdout + out.stderr)


def parse_ldd(text: str) -> tuple[str, ...]:
    found = []
    for line in text.splitlines():
        match = re.match(r"\s*(\S+)\s+=>\s+not found", line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return tuple(found)


def package_manager(which=shutil.which) -> str | None:
    for manager, exe in (("apt", "apt-get"), ("dnf", "dnf"), ("pacman", "pacman"), ("zypper", "zypper")):
        if which(exe):
            return manager
    return None


def soname_base(soname: str) -> tuple[str, str]:
    """'libxcb-icccm.so.4' -> ('libxcb-icccm', '4')."""
    base, _, version = soname.partition(".so")
    return base, version.lstrip(".").split(".")[0]


def package_for(soname: str, manager: str | None, known=None) -> str:
    """The package holding `soname` for `manager`; `known(name)` says whether apt knows a package name."""
    base, version = soname_base(soname)
    if base in _PACKAGES and manager in _MANAGERS:
        name = _PACKAGES[base][_MANAGERS.index(manager)]
    elif manager in ("apt", "zypper", None):  # Debian's rule: lib name + soname version, '-' after a digit
        stem = base.lower() if manager != "zypper" else base
        name = stem + ("-" if stem[-1:].isdigit() else "") + version
    else:
        name = base.removeprefix("lib")
    if manager == "apt" and known is not None and not known(name) and known(name + "t64"):
        name += "t64"  # Debian 13 / Ubuntu 24.04 renamed some libraries (64-bit time)
    return name


def apt_knows(name: str) -> bool:
    try:
        out = subprocess.run(["apt-cache", "show", "--no-all-versions", name], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "Package:" in out.stdout


def check(pyside_dir: Path | None, env: dict | None = None, *, manager: str | None = "detect",
          ldd: str | None = None, known=None) -> QtCheck:
    manager = package_manager() if manager == "detect" else manager
    plugin = platform_plugin(pyside_dir, env) if pyside_dir else None
    if plugin is None:
        return QtCheck(None, (), manager, ())
    missing = missing_libraries(plugin, ldd)
    if known is None and manager == "apt" and missing:
        known = apt_knows
    packages = []
    for soname in missing:
        name = package_for(soname, manager, known)
        if name not in packages:
            packages.append(name)
    return QtCheck(plugin, missing, manager, tuple(packages))


def install(result: QtCheck, *, as_root: bool, sudo: str | None, run=subprocess.call) -> bool:
    """Install result.packages: directly as root, else through `sudo` (it asks for the password). True on
    success."""
    if not result.packages or result.manager is None:
        return False
    cmd = list(_INSTALL[result.manager]) + list(result.packages)
    if not as_root:
        if not sudo:
            return False
        cmd = [sudo] + cmd
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"} if result.manager == "apt" else None
    try:
        if result.manager == "apt":
            run(([] if as_root else [sudo]) + ["apt-get", "update", "-qq"], env=env)
        return run(cmd, env=env) == 0
    except (OSError, subprocess.SubprocessError):
        return False
