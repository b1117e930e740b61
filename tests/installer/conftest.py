"""Fixtures for the installer tests: the installer modules (loaded by path, as bootstrap loads them),
a fake repository, a throw-away Xvfb display."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "installer"


def load_bootstrap():
    """The bootstrap module, shared with test_bootstrap.py (which registers it as dsv41_bootstrap)."""
    mod = sys.modules.get("dsv41_bootstrap")
    if mod is None:
        spec = importlib.util.spec_from_file_location("dsv41_bootstrap", INSTALLER / "bootstrap.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dsv41_bootstrap"] = mod
        spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def bs():
    return load_bootstrap()


@pytest.fixture(scope="session")
def firstrun(bs):
    return bs._sibling("firstrun")


@pytest.fixture(scope="session")
def shortcuts(bs):
    return bs._sibling("shortcuts")


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
