"""`run` finds exactly which system libraries Qt's platform plugin lacks (ldd on the plugin), names their
packages for the distribution, installs them when it may, and otherwise prints the one command to run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from installer import commands, common

LDD_BARE_DEBIAN = """\
\tlinux-vdso.so.1 (0x00007ffd1a7f2000)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f0c)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f0c)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0c)
"""


@pytest.fixture(scope="module")
def qt():
    return common.sibling("qt_libraries")


def test_ldd_output_names_the_missing_libraries_once(qt):
    assert qt.parse_ldd(LDD_BARE_DEBIAN) == ("libxcb-icccm.so.4", "libxcb-keysyms.so.1")


@pytest.mark.parametrize("manager, expected", [
    ("apt", ["libxcb-icccm4", "libxcb-keysyms1", "libxcb-cursor0", "libxkbcommon-x11-0", "libegl1"]),
    ("dnf", ["xcb-util-wm", "xcb-util-keysyms", "xcb-util-cursor", "libxkbcommon-x11", "libglvnd-egl"]),
    ("pacman", ["xcb-util-wm", "xcb-util-keysyms", "xcb-util-cursor", "libxkbcommon-x11", "libglvnd"]),
])
def test_libraries_map_to_the_distributions_packages(qt, manager, expected):
    sonames = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0", "libxkbcommon-x11.so.0",
               "libEGL.so.1"]
    assert [qt.package_for(s, manager) for s in sonames] == expected


def test_unknown_libraries_follow_debians_naming_and_its_t64_renames(qt):
    assert qt.package_for("libxcb-xinput.so.0", "apt") == "libxcb-xinput0"
    assert qt.package_for("libfoo2.so.5", "apt") == "libfoo2-5"
    known = {"libglib2.0-0t64"}.__contains__  # Debian 13 / Ubuntu 24.04
    assert qt.package_for("libglib-2.0.so.0", "apt", known) == "libglib2.0-0t64"


def build_plugin(tmp_path: Path) -> Path:
    """A PySide6-shaped folder whose xcb plugin needs a library that exists nowhere on this machine."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "dep.c").write_text("int dsv41_missing(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(stub / "libxcb-dsv41test.so.4"), str(stub / "dep.c"),
                    "-Wl,-soname,libxcb-dsv41test.so.4"], check=True)
    (stub / "libxcb-dsv41test.so").symlink_to("libxcb-dsv41test.so.4")
    platforms = tmp_path / "PySide6" / "Qt" / "plugins" / "platforms"
    platforms.mkdir(parents=True)
    (stub / "plugin.c").write_text("int dsv41_missing(void);\nint plugin(void) { return dsv41_missing(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(platforms / "libqxcb.so"), str(stub / "plugin.c"),
                    f"-L{stub}", "-lxcb-dsv41test"], check=True)
    shutil.rmtree(stub)  # now the plugin's library is missing, as on a bare machine
    return tmp_path / "PySide6"


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc)")
def test_the_check_finds_the_library_a_real_plugin_lacks(qt, tmp_path):
    pyside = build_plugin(tmp_path)
    result = qt.check(pyside, {"DISPLAY": ":0"}, manager="apt", known=lambda name: False)
    assert result.plugin.name == "libqxcb.so"
    assert result.missing == ("libxcb-dsv41test.so.4",)
    assert result.packages == ("libxcb-dsv41test4",)
    assert result.command() == "sudo apt-get install -y --no-install-recommends libxcb-dsv41test4"


def test_the_plugin_follows_the_session_type(qt, tmp_path):
    platforms = tmp_path / "PySide6" / "Qt" / "plugins" / "platforms"
    platforms.mkdir(parents=True)
    for name in ("libqxcb.so", "libqwayland.so"):
        (platforms / name).write_bytes(b"")
    pyside = tmp_path / "PySide6"
    assert qt.platform_plugin(pyside, {"DISPLAY": ":0"}).name == "libqxcb.so"
    assert qt.platform_plugin(pyside, {"WAYLAND_DISPLAY": "wayland-0"}).name == "libqwayland.so"
    assert qt.platform_plugin(pyside, {"QT_QPA_PLATFORM": "wayland", "DISPLAY": ":0"}).name == "libqwayland.so"


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc)")
def test_run_prints_the_one_command_when_it_may_not_install(qt, tmp_path, capsys, monkeypatch):
    pyside = build_plugin(tmp_path)
    monkeypatch.setattr(qt, "package_manager", lambda which=None: "apt")
    monkeypatch.setattr(qt, "apt_knows", lambda name: False)
    shown = []
    monkeypatch.setattr(common.sibling("firstrun"), "show_error", lambda *args, **kwargs: shown.append(args))
    rc = commands.ensure_qt_libraries(Path("python"), {"DISPLAY": ":0"}, system="Linux", interactive=False,
                                as_root=False, which=lambda exe: None, folder=pyside)
    out = capsys.readouterr().out
    assert rc == 1
    assert "libxcb-dsv41test.so.4" in out
    assert "sudo apt-get install -y --no-install-recommends libxcb-dsv41test4" in out
    assert shown and "libxcb-dsv41test4" in shown[0][1]  # and a window says it when double-clicked


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc)")
def test_run_installs_as_root_then_starts(qt, tmp_path, capsys, monkeypatch):
    pyside = build_plugin(tmp_path)
    monkeypatch.setattr(qt, "package_manager", lambda which=None: "apt")
    monkeypatch.setattr(qt, "apt_knows", lambda name: False)
    installed = []

    def install(result, *, as_root, sudo, run=None):
        installed.append((result.packages, as_root, sudo))
        (pyside / "Qt" / "plugins" / "platforms" / "libqxcb.so").unlink()  # "fixed": nothing left to miss
        (pyside / "Qt" / "plugins" / "platforms" / "libqxcb.so").write_bytes(b"")
        return True

    monkeypatch.setattr(qt, "install", install)
    rc = commands.ensure_qt_libraries(Path("python"), {"DISPLAY": ":0"}, system="Linux", interactive=False,
                                as_root=True, folder=pyside)
    assert rc == 0 and installed == [(("libxcb-dsv41test4",), True, None)]
    assert "Installing them: apt-get install" in capsys.readouterr().out


def test_nothing_to_do_elsewhere():
    assert commands.ensure_qt_libraries(Path("python"), {}, system="Windows") == 0
