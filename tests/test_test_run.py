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


def test_the_suite_runs_in_one_process_per_core_where_it_can(monkeypatch):
    from installer import commands

    xdist = ["--dist", "loadfile", "--no-loadscope-reorder"]
    py = Path(sys.executable)  # the dev environment: pytest-xdist is there
    assert commands.worker_args_for_tests([], py, {}, cpus=2) == ["-n", "2"] + xdist
    assert commands.worker_args_for_tests(["-k", "chat", "tests/app"], py, {}, cpus=16) == ["-n", "4"] + xdist
    assert commands.worker_args_for_tests([], py, {"DSV41_TEST_WORKERS": "3"}, cpus=2) == ["-n", "3"] + xdist
    assert commands.worker_args_for_tests([], py, {}, cpus=1) == []
    assert commands.worker_args_for_tests([], py, {"DSV41_TEST_WORKERS": "1"}, cpus=8) == []
    for decided in (["-n", "1"], ["-n0"], ["--numprocesses=2"], ["--dist", "load"], ["-p", "no:xdist"], ["--pdb"],
                    ["-s"]):
        assert commands.worker_args_for_tests(decided, py, {}, cpus=8) == [], decided
    assert commands.worker_args_for_tests([], Path("/nonexistent/python"), {}, cpus=8) == []  # no pytest-xdist there


def test_in_a_test_process_beside_others_torch_takes_its_share_of_the_cores():
    from installer.common import usable_cpus

    cpus = usable_cpus()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTEST_XDIST_WORKER="gw1", PYTEST_XDIST_WORKER_COUNT="2")
    done = subprocess.run([sys.executable, "-c", "import tests.conftest, torch; print(torch.get_num_threads())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == max(1, cpus // 2)


def test_in_test_processes_the_files_with_slow_tests_come_first_each_whole(monkeypatch):
    from types import SimpleNamespace

    from tests import conftest

    def item(path, *marks):
        return SimpleNamespace(path=Path(path), keywords={m: True for m in marks}, name=path)

    items = [item("a.py"), item("a.py"), item("b.py"), item("b.py", "slow"), item("c.py"), item("d.py", "slow")]
    order = [(i.path.name, "slow" in i.keywords) for i in items]
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest.pytest_collection_modifyitems(None, items)
    assert [(i.path.name, "slow" in i.keywords) for i in items] == order  # one process: the files' own order
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(None, items)
    assert [(i.path.name, "slow" in i.keywords) for i in items] == [
        ("b.py", False), ("b.py", True), ("d.py", True), ("a.py", False), ("a.py", False), ("c.py", False)]
