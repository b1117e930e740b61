"""The test run itself leaves nothing behind on the machine that runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_removes_its_conversations_folder(tmp_path):
    # A full run saves about a gigabyte of conversation caches: the folder must go when the run ends.
    probe = "tests/app/test_theme.py"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", probe],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("dsv41-test-conversations-")]
    assert left == []
