"""Fixtures for the installer tests: the installer's modules (imported as the package ``installer``),
a fake repository, a throw-away Xvfb display."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from installer import common

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "installer"


def load_bootstrap():
    """installer/bootstrap.py, the entry point (main); the other names live in the modules it uses."""
    return importlib.import_module("installer.bootstrap")


@pytest.fixture(scope="session")
def bs():
    return load_bootstrap()


@pytest.fixture(scope="session")
def firstrun():
    return common.sibling("firstrun")


@pytest.fixture(scope="session")
def shortcuts():
    return common.sibling("shortcuts")


class Printer:
    def __init__(self):
        self.lines = []

    def __call__(self, msg=""):
        self.lines.append(str(msg))

    @property
    def text(self):
        return "\n".join(self.lines)


@pytest.fixture
def printer():
    return Printer()


@pytest.fixture
def fake_repo(tmp_path):
    """A repository with a pyproject, the real installer/ files and the real icons."""
    repo = tmp_path / "repo dir"
    repo.mkdir()
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch>=2.4,<2.15"]\n')
    shutil.copytree(INSTALLER, repo / "installer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "resources", repo / "resources", ignore=shutil.ignore_patterns("chat_templates"))
    return repo


@pytest.fixture(scope="session")
def xvfb_display():
    """A private X display (Xvfb), or skip when Xvfb is not installed."""
    exe = shutil.which("Xvfb")
    if not exe:
        pytest.skip("Xvfb is not installed (apt-get install -y xvfb)")
    for num in range(157, 190):
        if os.path.exists(f"/tmp/.X11-unix/X{num}") or os.path.exists(f"/tmp/.X{num}-lock"):
            continue
        proc = subprocess.Popen([exe, f":{num}", "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(f"/tmp/.X11-unix/X{num}"):
                break
            time.sleep(0.05)
        if proc.poll() is None and os.path.exists(f"/tmp/.X11-unix/X{num}"):
            try:
                yield f":{num}"
            finally:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            return
        proc.kill()
    pytest.skip("could not start Xvfb")
