"""Setup as a whole: GPU plan selection, resuming, half-made environments, failure messages."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from installer import commands, common, install_steps, setup_runner, torch_choice, venv_setup

REPO = Path(__file__).resolve().parents[2]

SMI_HEADER = """\
Mon Nov 30 18:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}             Driver Version: {driver}     CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""
SMI_NO_CUDA_LINE = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 470.57.02    Driver Version: 470.57.02                           |
+-----------------------------------------------------------------------------+
"""


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch>=2.4,<2.15"]\n')
    return repo


def _fake_smi(tmp_path: Path, monkeypatch, full: str, names: str = "GPU 0: NVIDIA H200 (UUID: GPU-1)") -> None:
    bindir = tmp_path / "smi-bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "smi-full.txt").write_text(full)
    smi = bindir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then echo "{names}"; else cat "{tmp_path / "smi-full.txt"}"; fi\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("DSV41_FORCE_CPU", raising=False)


def _index_tags(plans) -> list:
    out = []
    for p in plans:
        if "--index-url" in p.pip_args:
            out.append(p.pip_args[p.pip_args.index("--index-url") + 1].rsplit("/", 1)[-1])
        else:
            out.append("pypi")
    return out


# ------------------------------------------------------------------------------------ GPU plans


@pytest.mark.skipif(os.name == "nt", reason="the fake nvidia-smi is a shell script")
@pytest.mark.parametrize("driver, cuda, expected", [
    # (index, torch release pinned) per plan, then PyPI; by PyTorch's release matrix (torch_choice.TORCH_CUDA_BUILDS)
    ("595.40.01", "13.2", [("cu132", "2.14"), ("cu130", "2.14"), "pypi"]),
    ("590.44.01", "13.1", [("cu130", "2.14"), ("cu126", "2.14"), "pypi"]),
    ("580.65.06", "13.0", [("cu130", "2.14"), ("cu126", "2.14"), "pypi"]),
    # cu128 stops at 2.11 and cu129 at 2.8: a 12.8 / 12.9 driver gets 2.14 from cu126, then 2.11 from cu128
    ("575.57.08", "12.9", [("cu126", "2.14"), ("cu128", "2.11"), "pypi"]),
    ("570.124.06", "12.8", [("cu126", "2.14"), ("cu128", "2.11"), "pypi"]),
    ("560.35.03", "12.6", [("cu126", "2.14"), ("cu118", "2.7"), "pypi"]),
    ("550.54.15", "12.4", [("cu118", "2.7"), ("cu124", "2.6"), "pypi"]),
    ("535.183.01", "12.2", [("cu118", "2.7"), ("cu121", "2.5"), "pypi"]),
    ("520.61.05", "11.8", [("cu118", "2.7"), "pypi"]),
    ("470.57.02", "11.4", ["pypi"]),
])
def test_torch_plan_matches_the_driver(tmp_path, monkeypatch, driver, cuda, expected):
    _fake_smi(tmp_path, monkeypatch, SMI_HEADER.format(driver=driver, cuda=cuda))
    gpu = torch_choice.detect_nvidia()
    assert gpu is not None and gpu.cuda == cuda and gpu.driver == driver
    plans = torch_choice.torch_install_plans(True, "Linux", "torch>=2.4,<2.15", gpu.cuda)
    assert _index_tags(plans) == [e if isinstance(e, str) else e[0] for e in expected]
    for p, (tag, release) in zip(plans[:-1], expected[:-1], strict=True):
        url = p.pip_args[p.pip_args.index("--index-url") + 1]
        assert url == f"https://download.pytorch.org/whl/{tag}"
        # The release published there is pinned, inside the project's range.
        assert p.pip_args[-1] == f"torch>=2.4,<2.15,=={release}.*"
        assert f"PyTorch {release} " in p.label
        # An unreachable index fails fast, then the next plan runs.
        assert p.pip_args[p.pip_args.index("--timeout") + 1] == "15"
    assert plans[-1].key == "pypi-cuda" and plans[-1].pip_args == ["install", "torch>=2.4,<2.15"]
    # A driver older than PyPI's build (torch 2.14 needs CUDA 13.0) is told so before it is installed.
    assert (plans[-1].warning is not None) == (tuple(map(int, cuda.split("."))) < (13, 0))


@pytest.mark.skipif(os.name == "nt", reason="the fake nvidia-smi is a shell script")
def test_torch_plan_without_a_cuda_version_or_on_windows(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, SMI_NO_CUDA_LINE)
    gpu = torch_choice.detect_nvidia()
    assert gpu is not None and gpu.cuda is None
    assert _index_tags(torch_choice.torch_install_plans(True, "Linux", cuda=gpu.cuda)) == ["pypi"]
    # Windows: PyPI only has CPU builds, so the CUDA index comes first and PyPI is announced as CPU-only.
    win = torch_choice.torch_install_plans(True, "Windows", cuda="12.8")
    assert _index_tags(win) == ["cu126", "cu128", "pypi"] and "CPU-only" in win[-1].warning
    # No GPU: the CPU plans, whatever the CUDA argument says.
    assert [p.key for p in torch_choice.torch_install_plans(False, "Linux", cuda="12.8")] == \
        ["local-cpu", "cpu-index", "pypi-cuda-fallback"]


def test_cuda_wheel_choices_follow_the_torch_range():
    def tags(cuda, limit=2):
        return [c.tag for c in torch_choice.cuda_wheel_choices(cuda, limit=limit)]

    assert tags("13.0") == ["cu130", "cu126"]
    assert tags("13.1", limit=4) == ["cu130", "cu126", "cu128", "cu129"]
    assert tags("12") == ["cu118"]  # "12" is 12.0: older than every 12.x build
    assert tags(None) == [] and tags("") == [] and tags("x") == []
    # A range that stops at 2.11 makes cu128 the best for a 12.8 driver again; 2.13's cu132 is experimental.
    assert torch_choice.cuda_wheel_choices("12.8", "torch>=2.4,<2.12")[0] == \
        torch_choice.CudaChoice("cu128", (2, 11), False)
    assert torch_choice.cuda_wheel_choices("13.2", "torch>=2.4,<2.14")[:2] == [
        torch_choice.CudaChoice("cu130", (2, 13), False), torch_choice.CudaChoice("cu126", (2, 13), False)]
    assert torch_choice.cuda_wheel_choices("13.2", "torch>=2.4,<2.14", limit=3)[2] == \
        torch_choice.CudaChoice("cu132", (2, 13), True)
    # The range in pyproject.toml is the one the installer reads.
    spec = torch_choice.pyproject_requirement((REPO / "pyproject.toml").read_text(), "torch", "")
    assert spec == torch_choice.TORCH_SPEC_DEFAULT


class FakePip:
    """Stands in for run_logged: answers each pip call from a script, records the commands."""

    def __init__(self, results):
        self.results = list(results)
        self.cmds = []

    def __call__(self, cmd, log, timeout=None, verbose=False, env=None, out=None):
        self.cmds.append(cmd)
        rc, text = self.results.pop(0)
        return venv_setup.RunResult(rc, text.splitlines()[-25:], 0.1, text)


def test_step_torch_on_a_gpu_falls_back_to_pypi(tmp_path, monkeypatch, printer):
    fake = FakePip([
        (1, "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection"),
        (1, "ERROR: No matching distribution found for torch<2.15,>=2.4"),
        (0, "Successfully installed torch-2.9.1"),
    ])
    gpu = torch_choice.GpuInfo(("NVIDIA H200",), "570.124.06", "12.8")
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", gpu=gpu, out=printer, runner=fake, system="Linux")
    answers = iter([(False, "ModuleNotFoundError"), (True, "2.9.1\n12.8"), (True, "True")])
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: next(answers))
    result = install_steps.step_torch(ctx)
    assert "torch 2.9.1" in result and "(c)" in result
    assert [c[c.index("--index-url") + 1] if "--index-url" in c else "pypi" for c in fake.cmds] == [
        "https://download.pytorch.org/whl/cu126", "https://download.pytorch.org/whl/cu128", "pypi"]
    assert "index not reachable" in printer.text and "not available here" in printer.text
    assert "does not see the GPU" not in printer.text
    # A torch that cannot see the GPU is reported (not fatal).
    fake2 = FakePip([(0, "Successfully installed torch-2.9.1")])
    ctx.runner = fake2
    answers2 = iter([(False, ""), (True, "2.9.1\n12.8"), (True, "False")])
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: next(answers2))
    assert "installed via (a)" in install_steps.step_torch(ctx)
    assert "does not see the GPU" in printer.text


# ------------------------------------------------------------------------- resume, half-made env


def _fake_venv(venv: Path) -> None:
    py = common.venv_python(venv)
    py.parent.mkdir(parents=True, exist_ok=True)
    py.write_text("")
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    (venv / venv_setup.MARKER_NAME).write_text("{}")


def _steps(calls, interrupt_at=None):
    def make(key):
        def func(ctx):
            calls.append(key)
            if key == interrupt_at:
                raise KeyboardInterrupt
            if key == "venv":
                _fake_venv(ctx.venv)
            return f"{key} ok"
        return func
    return [install_steps.Step(k, k, make(k)) for k in ("venv", "torch", "project", "model")]


def test_interrupted_setup_resumes_from_the_interrupted_step(tmp_path, printer, monkeypatch):
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer)
    calls = []
    with pytest.raises(KeyboardInterrupt):
        setup_runner.ensure_setup(ctx, _steps(calls, interrupt_at="project"))
    assert calls == ["venv", "torch", "project"]
    assert "Interrupted during step [3/4] project" in printer.text
    state = venv_setup.State.load(ctx.venv / venv_setup.STATE_NAME)
    assert state.last_failure["step"] == "project" and state.last_failure["message"] == "interrupted"
    assert not setup_runner.is_ready(ctx, _steps([]))
    # The status command (the launchers ask it whether a setup is due) says what is left to do.
    printer.lines.clear()
    monkeypatch.setattr(common, "say", printer)
    assert commands.cmd_status(ctx, _steps([])) == 1
    assert "setup needed: it stopped at step 'project' (interrupted)" in printer.text
    calls.clear()
    assert setup_runner.ensure_setup(ctx, _steps(calls)) == 0
    assert calls == ["project", "model"]
    assert "stopped at step 'project'" in printer.text
    assert setup_runner.is_ready(ctx, _steps([]))


def test_half_made_environment_is_never_used(tmp_path, bs, printer, monkeypatch):
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer)
    assert setup_runner.ensure_setup(ctx, _steps([])) == 0
    assert setup_runner.is_ready(ctx, _steps([]))
    # The completion marker is gone (the venv is being made again, or a copy was cut short): even
    # with a state file that says all is done, nothing counts as ready and every step runs again.
    (ctx.venv / venv_setup.MARKER_NAME).unlink()
    assert not setup_runner.is_ready(ctx, _steps([]))
    calls = []
    assert setup_runner.ensure_setup(ctx, _steps(calls)) == 0
    assert calls == ["venv", "torch", "project", "model"]
    # And 'run' never starts the app from a venv whose setup did not finish.
    monkeypatch.setenv("DSV41_HOME", str(ctx.home))
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    monkeypatch.setattr(commands, "setup_with_window", lambda c, force=False: None)
    monkeypatch.setattr(setup_runner, "ensure_setup", lambda c, force=False: 1)
    started = []
    monkeypatch.setattr(commands, "launch_app", lambda *a, **k: started.append(a) or 0)
    assert bs.main(["run"]) == 1 and started == []


def test_bootstrap_in_a_temp_dir_makes_a_real_venv_and_is_idempotent(tmp_path, printer):
    """The real python and venv steps (venv without pip, for speed) plus a stand-in install step."""
    installed = []

    def install(ctx):
        installed.append(1)
        r = subprocess.run([str(ctx.python), "-c", "import sys; print(sys.prefix)"], capture_output=True,
                           text=True, timeout=60)
        assert Path(r.stdout.strip()).resolve() == ctx.venv.resolve()
        return "installed"

    def steps():
        return [install_steps.Step("python", "Check Python version", install_steps.step_python, always=True),
                install_steps.Step("venv", "Create virtual environment", install_steps.step_venv),
                install_steps.Step("install", "Install", install)]

    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", with_pip=False, out=printer)
    assert setup_runner.ensure_setup(ctx, steps()) == 0
    assert venv_setup.venv_is_complete(ctx.venv) and installed == [1]
    assert "created at" in printer.text
    # Again: a fast no-op.
    again = setup_runner.Context(ctx.repo, ctx.home, with_pip=False, out=printer)
    t0 = time.monotonic()
    assert setup_runner.ensure_setup(again, steps()) == 0
    assert time.monotonic() - t0 < 2 and installed == [1]
    assert setup_runner.is_ready(again, steps())
    assert commands.cmd_status(again, steps()) == 0


def test_status_command(tmp_path, bs, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    assert bs.main(["status"]) == 1
    assert "setup needed: no complete environment" in capsys.readouterr().out
    assert not (tmp_path / "home" / "venv").exists()  # status installs nothing
    monkeypatch.setattr(setup_runner, "is_ready", lambda ctx, steps=None: True)
    assert bs.main(["status"]) == 0
    assert capsys.readouterr().out.startswith("ready:")


# ------------------------------------------------------------------------------- failure messages


def test_too_old_python_names_the_fix(bs, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(common, "MIN_PYTHON", (99, 0))
    with pytest.raises(common.StepError) as ei:
        install_steps.step_python(setup_runner.Context(_repo(tmp_path), tmp_path / "home"))
    assert "needs Python 99.0 or newer" in ei.value.message and "Install Python 99.0+" in ei.value.message
    assert bs.main(["setup"]) == 1
    assert "needs Python 99.0 or newer" in capsys.readouterr().out


def test_disk_full_while_making_the_venv(tmp_path, monkeypatch):
    import venv as venv_mod

    def full(self, env_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(venv_mod.EnvBuilder, "create", full)
    venv = tmp_path / "home" / "venv"
    with pytest.raises(common.StepError) as ei:
        venv_setup.ensure_venv(venv, with_pip=False, out=lambda m="": None)
    assert "The disk is full" in ei.value.fix and "GiB free" in ei.value.fix
    assert "half-made environment is removed first" in ei.value.fix
    assert (venv / venv_setup.CREATING_NAME).exists()  # so the next try knows it is half-made
    assert not venv_setup.venv_is_complete(venv)


@pytest.mark.parametrize("output, words", [
    ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device", "disk is full"),
    ("WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError'", "check your connection"),
    ("ERROR: No matching distribution found for pyside6-essentials>=6.6", "Check that this Python"),
    ("error: subprocess-exited-with-error\n  note: This error originates from a subprocess", "fix the cause"),
])
def test_each_failure_names_the_step_and_the_fix(tmp_path, printer, output, words):
    ctx = setup_runner.Context(_repo(tmp_path), tmp_path / "home", out=printer, runner=FakePip([(1, output)]))
    step = install_steps.Step("project", "Install DS-V4.1 Chat",
                              lambda c: c.pip_or_fail(["install", "x"], "installing x"))
    _fake_venv(ctx.venv)
    assert not setup_runner.run_steps([step], venv_setup.State(ctx.venv / venv_setup.STATE_NAME), ctx)
    text = printer.text
    assert "ERROR in step [1/1] Install DS-V4.1 Chat: pip failed (exit 1) installing x" in text
    assert words in text
    assert "Rerun: python3 installer/bootstrap.py setup   (setup resumes from this step)" in text


def test_unreachable_index_is_reported_as_network(tmp_path, printer):
    """A real pip against a closed port on this machine (nothing leaves it)."""

    class HereContext(setup_runner.Context):
        @property
        def python(self):
            return Path(sys.executable)

    ctx = HereContext(_repo(tmp_path), tmp_path / "home", out=printer)
    ctx.log = tmp_path / "setup.log"
    args = ["install", "--isolated", "--no-cache-dir", "--index-url", "http://127.0.0.1:9/simple",
            "--timeout", "3", "--retries", "0", "--target", str(tmp_path / "t"), "dsv41-no-such-package"]
    with pytest.raises(common.StepError) as ei:
        ctx.pip_or_fail(args, "installing a package", timeout=120)
    assert "check your connection / proxy" in ei.value.fix
    assert "127.0.0.1" in ctx.log.read_text()
