"""Tests for the installer's logic (installer/bootstrap.py and the modules it uses), without installing
anything from the network."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import pytest

from installer import commands, common, install_steps, setup_runner, torch_choice, venv_setup
from tests.installer.conftest import Printer, load_bootstrap

REPO = Path(__file__).resolve().parents[2]

bs = load_bootstrap()


def make_repo(tmp_path: Path, pyproject: str = '[project]\nname = "x"\ndependencies = ["torch>=2.4,<2.15"]\n'):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text(pyproject)
    return repo


def make_complete_fake_venv(venv: Path):
    """A venv folder that passes the cheap completeness check (marker + python file)."""
    py = common.venv_python(venv)
    py.parent.mkdir(parents=True)
    py.write_text("")
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    (venv / venv_setup.MARKER_NAME).write_text("{}")


# ----------------------------------------------------------------------------------- data_home


def test_data_home_override_wins(tmp_path):
    env = {"DSV41_HOME": str(tmp_path / "mine"), "XDG_DATA_HOME": "/xdg", "LOCALAPPDATA": "C:/x"}
    for system in ("Linux", "Darwin", "Windows"):
        assert common.data_home(env, system, home=tmp_path) == tmp_path / "mine"


def test_data_home_defaults_per_platform(tmp_path):
    h = tmp_path
    assert common.data_home({}, "Linux", h) == h / ".local" / "share" / "ds-v41-chat"
    assert common.data_home({"XDG_DATA_HOME": "/data/x"}, "Linux", h) == Path("/data/x/ds-v41-chat")
    # A relative XDG_DATA_HOME is invalid per the spec and ignored.
    assert common.data_home({"XDG_DATA_HOME": "rel"}, "Linux", h) == h / ".local" / "share" / "ds-v41-chat"
    assert common.data_home({}, "Darwin", h) == h / "Library" / "Application Support" / "ds-v41-chat"
    assert common.data_home({"LOCALAPPDATA": str(h / "L")}, "Windows", h) == h / "L" / "ds-v41-chat"
    assert common.data_home({}, "Windows", h) == h / "AppData" / "Local" / "ds-v41-chat"


def test_venv_python_paths():
    assert common.venv_python(Path("v"), "Linux") == Path("v/bin/python")
    assert common.venv_python(Path("v"), "Darwin") == Path("v/bin/python")
    assert common.venv_python(Path("v"), "Windows") == Path("v/Scripts/python.exe")


# --------------------------------------------------------------------------------- fingerprint


def test_fingerprint_changes_when_pyproject_changes(tmp_path):
    repo = make_repo(tmp_path)
    fp1 = venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    assert fp1 == venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch>=2.5"]\n')
    fp2 = venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    assert fp2 != fp1
    # ... and with each of the other inputs.
    others = {
        venv_setup.fingerprint(repo / "pyproject.toml", repo, [], "3.11.7"),
        venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.12.1"),
        venv_setup.fingerprint(repo / "pyproject.toml", tmp_path, ["dev"], "3.11.7"),
        venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7", model_version="9.9"),
    }
    assert fp2 not in others and len(others) == 4
    # Extras are a set: order and duplicates don't matter.
    assert venv_setup.fingerprint(repo / "pyproject.toml", repo, ["gpu", "dev", "dev"], "3.11.7") == \
        venv_setup.fingerprint(repo / "pyproject.toml", repo, ["dev", "gpu"], "3.11.7")


# ---------------------------------------------------------------------------------------- state


def test_state_round_trip(tmp_path):
    path = tmp_path / venv_setup.STATE_NAME
    st = venv_setup.State(path)
    st.data["fingerprint"] = "abc"
    st.data["extras"] = ["dev"]
    st.mark_done("python", "Python 3.11")
    st.mark_failed("torch", "Install PyTorch", "no network")
    assert st.save()
    back = venv_setup.State.load(path)
    assert back.fingerprint == "abc"
    assert back.extras == ["dev"]
    assert back.is_done("python") and not back.is_done("torch")
    assert back.last_failure["step"] == "torch"
    assert back.last_failure["message"] == "no network"
    assert not back.all_done(["python", "torch"])


def test_state_corrupt_or_missing_is_empty(tmp_path):
    path = tmp_path / venv_setup.STATE_NAME
    assert venv_setup.State.load(path).data["steps"] == {}
    path.write_text("{not json")
    st = venv_setup.State.load(path)
    assert st.fingerprint is None and st.data["steps"] == {}
    # Saving into a folder that does not exist (venv not made yet) is a no-op, not a crash.
    assert venv_setup.State(tmp_path / "nope" / venv_setup.STATE_NAME).save() is False


def _counting_steps(calls, fail_at=None):
    def make(key):
        def func(ctx):
            calls.append(key)
            if key == fail_at:
                raise common.StepError(f"{key} broke", "do the fix", ["pip line 1", "pip line 2"],
                                   ["python", "-m", "pip", "install", key])
            return f"{key} fine"
        return func
    return [install_steps.Step(k, f"Step {k}", make(k)) for k in ("s1", "s2", "s3", "s4")]


def test_resume_from_failed_step(tmp_path):
    state_path = tmp_path / venv_setup.STATE_NAME
    out = Printer()
    ctx = setup_runner.Context(make_repo(tmp_path), tmp_path / "home", out=out)

    calls = []
    ok = setup_runner.run_steps(_counting_steps(calls, fail_at="s3"), venv_setup.State(state_path), ctx)
    assert not ok
    assert calls == ["s1", "s2", "s3"]
    assert "[3/4] Step s3" in out.text
    assert "ERROR in step [3/4] Step s3: s3 broke" in out.text
    assert "pip line 2" in out.text and "Fix: do the fix" in out.text
    assert "python -m pip install s3" in out.text  # the exact command to rerun
    saved = json.loads(state_path.read_text())
    assert saved["last_failure"]["step"] == "s3"

    calls2 = []
    out2 = Printer()
    ctx.out = out2
    ok = setup_runner.run_steps(_counting_steps(calls2), venv_setup.State.load(state_path), ctx)
    assert ok
    assert calls2 == ["s3", "s4"]  # 1-2 skipped, 3 retried
    assert "stopped at step 'Step s3'" in out2.text
    assert out2.text.count("done before, skipped") == 2


def _fake_ctx(tmp_path, out, extras=()):
    repo = tmp_path / "repo"
    if not repo.exists():
        make_repo(tmp_path)
    ctx = setup_runner.Context(repo, tmp_path / "home", extras=extras, out=out)
    return ctx


def test_ensure_setup_fast_path_and_fingerprint_change(tmp_path):
    out = Printer()
    ctx = _fake_ctx(tmp_path, out)
    calls = []

    def make_venv(c):
        calls.append("venv")
        make_complete_fake_venv(c.venv)
        return "made"

    def other(key):
        def f(c):
            calls.append(key)
            return key
        return f

    def steps():
        return [install_steps.Step("venv", "venv", make_venv), install_steps.Step("a", "a", other("a")),
                install_steps.Step("b", "b", other("b"))]

    assert setup_runner.ensure_setup(ctx, steps()) == 0
    assert calls == ["venv", "a", "b"]
    state = venv_setup.State.load(ctx.venv / venv_setup.STATE_NAME)
    assert state.fingerprint and state.last_failure is None

    # Second start: nothing runs, and it is quick.
    calls.clear()
    t0 = time.monotonic()
    assert setup_runner.ensure_setup(setup_runner.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert time.monotonic() - t0 < 2.0
    assert calls == []

    # A start that needs the dev extra re-runs the install steps (not the venv) ...
    dev = setup_runner.Context(ctx.repo, ctx.home, extras={"dev"}, out=out)
    assert setup_runner.ensure_setup(dev, steps()) == 0
    assert calls == ["a", "b"]
    # ... after which a plain start (no dev asked) is a no-op again: extras accumulate.
    calls.clear()
    assert setup_runner.ensure_setup(setup_runner.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert calls == []

    # Editing pyproject.toml re-runs them too.
    (ctx.repo / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "2"\n')
    assert setup_runner.ensure_setup(setup_runner.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert calls == ["a", "b"]
    assert "project changed since the last setup" in out.text


def test_ensure_setup_failure_then_resume(tmp_path):
    out = Printer()
    ctx = _fake_ctx(tmp_path, out)
    calls = []
    fail = {"b": True}

    def make_venv(c):
        calls.append("venv")
        make_complete_fake_venv(c.venv)
        return "made"

    def step(key):
        def f(c):
            calls.append(key)
            if fail.get(key):
                raise common.StepError(f"{key} failed", "fix it")
            return key
        return f

    def steps():
        return [install_steps.Step("venv", "venv", make_venv), install_steps.Step("a", "a", step("a")),
                install_steps.Step("b", "b", step("b")), install_steps.Step("c", "c", step("c"))]

    assert setup_runner.ensure_setup(ctx, steps()) == 1
    assert calls == ["venv", "a", "b"]
    assert not setup_runner.is_ready(ctx, steps())
    calls.clear()
    fail.clear()
    assert setup_runner.ensure_setup(setup_runner.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert calls == ["b", "c"]
    assert setup_runner.is_ready(ctx, steps())


# ----------------------------------------------------------------------------------- torch plans


def test_torch_plans_no_gpu_linux_cpu_first():
    plans = torch_choice.torch_install_plans(False, "Linux")
    keys = [p.key for p in plans]
    assert keys == ["local-cpu", "cpu-index", "pypi-cuda-fallback"]
    assert plans[0].pip_args == ["install", "torch==2.13.0+cpu"]
    b = plans[1].pip_args
    assert b[b.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert b[b.index("--timeout") + 1] == "15" and b[b.index("--retries") + 1] == "0"
    assert b[-1] == "torch>=2.4,<2.15"
    # Nothing before the last plan can pull a CUDA build from PyPI: each pins +cpu or uses the CPU index.
    for p in plans[:-1]:
        assert "+cpu" in " ".join(p.pip_args) or "/whl/cpu" in " ".join(p.pip_args)
    assert plans[-1].warning and "CUDA" in plans[-1].warning


def test_torch_plans_other_systems():
    mac = torch_choice.torch_install_plans(False, "Darwin")
    assert [p.key for p in mac] == ["local-cpu", "cpu-index", "pypi"]
    assert mac[-1].warning is None
    gpu = torch_choice.torch_install_plans(True, "Linux")
    assert [p.key for p in gpu] == ["pypi-cuda"]
    assert gpu[0].pip_args == ["install", "torch>=2.4,<2.15"]


def test_version_in_spec():
    assert torch_choice.version_in_spec("2.13.0+cpu", "torch>=2.4,<2.15")
    assert not torch_choice.version_in_spec("2.15.0", "torch>=2.4,<2.15")
    assert not torch_choice.version_in_spec("2.3.1", "torch>=2.4,<2.15")
    assert torch_choice.version_in_spec("2.4", "torch>=2.4,<2.15")


@pytest.mark.parametrize("version, spec, ok", [
    # The plain comparisons: release numbers only, the shorter padded with zeros.
    ("2.4", ">=2.4", True), ("2.4.0", ">=2.4", True), ("2.3.9", ">=2.4", False),
    ("2.4", "<=2.4.0", True), ("2.4.1", "<=2.4", False),
    ("2.4.1", ">2.4", True), ("2.4.0", ">2.4", False),
    ("2.3.9", "<2.4", True), ("2.4", "<2.4", False),
    ("2.4.0", "==2.4", True), ("2.4.1", "==2.4", False), ("2.13.0+cpu", "==2.13.0", True),
    ("2.4.1", "!=2.4", True), ("2.4.0", "!=2.4", False),
    # == and != with a trailing .* compare the leading numbers.
    ("2.4.7", "==2.4.*", True), ("2.4", "==2.4.*", True), ("2.5.0", "==2.4.*", False),
    ("2.5.0", "!=2.4.*", True), ("2.4.2", "!=2.4.*", False),
    # ~= is the compatible release: ~=2.4 is >=2.4, ==2.*; ~=2.4.1 is >=2.4.1, ==2.4.*.
    ("2.4", "~=2.4", True), ("2.4.0", "~=2.4", True), ("2.9.3", "~=2.4", True), ("2.15.0", "~=2.4", True),
    ("2.3.9", "~=2.4", False), ("3.0", "~=2.4", False), ("3.1.0", "~=2.4", False),
    ("2.4.1", "~=2.4.1", True), ("2.4.9", "~=2.4.1", True), ("2.4.0", "~=2.4.1", False),
    ("2.5.0", "~=2.4.1", False), ("3.4.1", "~=2.4.1", False),
    ("2.13.0+cpu", "torch~=2.13.0", True), ("2.14.0", "torch~=2.13.0", False),
    ("1.4.5.2", "~=1.4.5.0", True), ("1.4.6", "~=1.4.5.0", False),
    # Several clauses, a name with extras, spaces, an environment marker (not looked at).
    ("2.13.0+cpu", "torch >= 2.4 , < 2.15", True), ("2.15.0", "torch>=2.4,<2.15", False),
    ("2.5.1", "torch[opt]~=2.4,!=2.5.1", False), ("2.5.2", "torch[opt]~=2.4,!=2.5.1", True),
    ("2.5", 'torch>=2.4; python_version < "3.12"', True),
    # A clause of another form is not understood and ignored.
    ("1.0", "torch===2.4", True), ("1.0", "torch", True), ("1.0", "", True),
])
def test_version_in_spec_operators(version, spec, ok):
    assert torch_choice.version_in_spec(version, spec) is ok


@pytest.mark.parametrize("spec", ["~=2", "torch~=2", "torch>=2.4,~=3", "~=2.4.*", ">=2.*", "<2.4.*"])
def test_version_in_spec_invalid_clauses_raise(spec):
    with pytest.raises(ValueError):
        torch_choice.version_in_spec("2.4", spec)


class FakePip:
    """Stands in for run_logged: answers each pip call from a script, records the commands."""

    def __init__(self, results):
        self.results = list(results)
        self.cmds = []

    def __call__(self, cmd, log, timeout=None, verbose=False, env=None, out=None):
        self.cmds.append(cmd)
        rc, text = self.results.pop(0)
        lines = text.splitlines()
        return venv_setup.RunResult(rc, lines[-25:], 0.1, text)


def test_step_torch_falls_through_plans_in_order(tmp_path, monkeypatch):
    out = Printer()
    fake = FakePip([
        (1, "ERROR: No matching distribution found for torch==2.13.0+cpu"),
        (1, "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection"),
        (0, "Successfully installed torch-2.14.1"),
    ])
    ctx = setup_runner.Context(make_repo(tmp_path), tmp_path / "home", out=out, runner=fake, system="Linux")
    probes = iter([(False, "ModuleNotFoundError"), (True, "2.14.1\n12.8")])
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: next(probes))
    result = install_steps.step_torch(ctx)
    assert "torch 2.14.1" in result and "(c)" in result
    assert [c[-1] for c in fake.cmds] == ["torch==2.13.0+cpu", "torch>=2.4,<2.15", "torch>=2.4,<2.15"]
    assert "--index-url" in fake.cmds[1] and "--index-url" not in fake.cmds[2]
    assert "not available here" in out.text and "index not reachable" in out.text
    assert "large CUDA build" in out.text


def test_step_torch_all_fail_names_network(tmp_path, monkeypatch):
    net = "Could not fetch URL https://pypi.org/simple/torch/: ProxyError('Cannot connect to proxy.')"
    fake = FakePip([(1, net), (1, net), (1, net)])
    ctx = setup_runner.Context(make_repo(tmp_path), tmp_path / "home", out=Printer(), runner=fake, system="Linux")
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (False, ""))
    with pytest.raises(common.StepError) as ei:
        install_steps.step_torch(ctx)
    assert "check your connection / proxy" in ei.value.fix
    assert "setup resumes from this step" in ei.value.fix
    assert ei.value.command and ei.value.command[-1] == "torch>=2.4,<2.15"


def test_step_torch_invalid_requirement_names_it(tmp_path, monkeypatch):
    repo = make_repo(tmp_path, '[project]\nname = "x"\ndependencies = ["torch~=2"]\n')
    fake = FakePip([])
    ctx = setup_runner.Context(repo, tmp_path / "home", out=Printer(), runner=fake)
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (True, "2.13.0+cpu\n"))
    with pytest.raises(common.StepError) as ei:
        install_steps.step_torch(ctx)
    assert "'torch~=2'" in ei.value.message and "at least two numbers" in ei.value.message
    assert "pyproject.toml" in ei.value.fix and fake.cmds == []


def test_step_torch_replaces_a_torch_outside_a_compatible_release(tmp_path, monkeypatch):
    out = Printer()
    repo = make_repo(tmp_path, '[project]\nname = "x"\ndependencies = ["torch~=2.12.0"]\n')
    fake = FakePip([(0, "Successfully installed torch-2.12.1")])
    ctx = setup_runner.Context(repo, tmp_path / "home", out=out, runner=fake, system="Linux")
    probes = iter([(True, "2.13.0+cpu\n"), (True, "2.12.1+cpu\n")])
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: next(probes))
    install_steps.step_torch(ctx)
    assert "torch 2.13.0+cpu is installed but torch~=2.12.0 is needed: replacing it" in out.text
    assert len(fake.cmds) == 1


def test_step_torch_skips_when_installed(tmp_path, monkeypatch):
    fake = FakePip([])
    ctx = setup_runner.Context(make_repo(tmp_path), tmp_path / "home", out=Printer(), runner=fake)
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (True, "2.13.0+cpu\n"))
    assert "already installed" in install_steps.step_torch(ctx)
    assert fake.cmds == []


def test_flash_attn_failure_never_fails_setup(tmp_path, monkeypatch):
    out = Printer()
    fake = FakePip([])
    gpu = torch_choice.GpuInfo(("NVIDIA H200",), "570.1", "12.8")
    ctx = setup_runner.Context(make_repo(tmp_path), tmp_path / "home", gpu=gpu, out=out, runner=fake)
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (False, ""))
    monkeypatch.delenv("DSV41_FLASH_ATTN_BUILD", raising=False)
    result = install_steps.step_flash_attn(ctx)
    # PyPI has no flash-attn wheel: nothing is tried by default (SDPA's flash kernels run); one line says so.
    assert "not needed" in result and "PyTorch SDPA" in result
    assert fake.cmds == []
    # The source build happens only when asked for, and its failure never fails setup either.
    monkeypatch.setenv("DSV41_FLASH_ATTN_BUILD", "1")
    fake2 = FakePip([(1, "error: subprocess-exited-with-error\nnvcc not found")])
    ctx.runner = fake2
    result = install_steps.step_flash_attn(ctx)
    assert "could not be built" in result and "PyTorch SDPA" in result
    assert len(fake2.cmds) == 1 and "--no-build-isolation" in fake2.cmds[0] and "--only-binary" not in fake2.cmds[0]
    # Installed and loadable: used, nothing installed.
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (True, ""))
    ctx.runner = fake3 = FakePip([])
    assert "already installed" in install_steps.step_flash_attn(ctx) and fake3.cmds == []
    no_gpu = setup_runner.Context(ctx.repo, ctx.home, out=out, runner=FakePip([]))
    assert "SDPA" in install_steps.step_flash_attn(no_gpu)


def test_diagnose_kinds(tmp_path):
    assert venv_setup.diagnose("OSError: [Errno 28] No space left on device", tmp_path)[0] == "disk"
    assert "GiB free" in venv_setup.diagnose("No space left on device", tmp_path)[1]
    kind, fix = venv_setup.diagnose("Temporary failure in name resolution", tmp_path)
    assert kind == "network" and "proxy" in fix
    assert venv_setup.diagnose("No matching distribution found for foo==1", tmp_path)[0] == "not-found"
    assert venv_setup.diagnose("something else", tmp_path)[0] == "pip"


def test_run_logged_real_process(tmp_path):
    log = tmp_path / "log.txt"
    code = "import sys\nfor i in range(40): print('line', i)\nsys.exit(3)"
    res = venv_setup.run_logged([sys.executable, "-c", code], log, out=Printer())
    assert res.returncode == 3
    assert res.tail[-1] == "line 39" and len(res.tail) == 25
    assert "line 0" in log.read_text()
    slow = venv_setup.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], None, timeout=1,
                                 out=Printer())
    assert slow.returncode is None and slow.elapsed < 10


# ------------------------------------------------------------------------------------- nvidia


def test_detect_nvidia_none_without_nvidia_smi(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert torch_choice.detect_nvidia() is None


SMI_FULL = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_parse_nvidia_smi():
    info = torch_choice.parse_nvidia_smi("GPU 0: NVIDIA H200 (UUID: GPU-1234)\nGPU 1: NVIDIA H200 (UUID: GPU-5)\n",
                                         SMI_FULL)
    assert info.names == ("NVIDIA H200", "NVIDIA H200")
    assert info.cuda == "12.4" and info.driver == "550.54.15"
    assert torch_choice.parse_nvidia_smi("No devices were found\n", "") is None


@pytest.mark.skipif(os.name == "nt", reason="fake nvidia-smi is a shell script")
def test_detect_nvidia_with_fake_nvidia_smi(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    (tmp_path / "full.txt").write_text(SMI_FULL)
    smi.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA A10 (UUID: GPU-x)"; '
                   f'else cat "{tmp_path / "full.txt"}"; fi\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("DSV41_FORCE_CPU", raising=False)
    info = torch_choice.detect_nvidia()
    assert info is not None and info.names == ("NVIDIA A10",) and info.cuda == "12.4"
    monkeypatch.setenv("DSV41_FORCE_CPU", "1")
    assert torch_choice.detect_nvidia() is None
    # A driver that lists no GPU (or fails) means no GPU.
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    monkeypatch.delenv("DSV41_FORCE_CPU")
    assert torch_choice.detect_nvidia() is None


# ------------------------------------------------------------------------------------------ venv


def test_half_made_venv_is_recreated(tmp_path):
    venv = tmp_path / "home" / "venv"
    venv.mkdir(parents=True)
    (venv / venv_setup.CREATING_NAME).write_text("pid 1")
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    (venv / "leftover.txt").write_text("from the interrupted attempt")
    out = Printer()
    result = venv_setup.ensure_venv(venv, with_pip=False, out=out)
    assert result.startswith("recreated")
    assert "incomplete" in out.text
    assert not (venv / "leftover.txt").exists()
    assert not (venv / venv_setup.CREATING_NAME).exists()
    assert (venv / venv_setup.MARKER_NAME).is_file()
    assert venv_setup.venv_is_complete(venv)
    # The new one is real: its Python runs.
    import subprocess
    r = subprocess.run([str(common.venv_python(venv)), "-c", "import sys; print(sys.prefix)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and Path(r.stdout.strip()).resolve() == venv.resolve()
    # And the next call reuses it.
    assert venv_setup.ensure_venv(venv, with_pip=False, out=out).startswith("reusing")


def test_broken_venv_without_marker_is_recreated_and_working_one_adopted(tmp_path):
    import venv as venv_mod
    # A marker-less venv whose python is gone: half-made, recreated.
    broken = tmp_path / "broken" / "venv"
    broken.mkdir(parents=True)
    (broken / "pyvenv.cfg").write_text("home = /nowhere\n")
    assert venv_setup.ensure_venv(broken, with_pip=False, out=Printer()).startswith("recreated")
    # A working venv made by hand (no marker, no creation sentinel) is adopted, not wiped.
    good = tmp_path / "good" / "venv"
    venv_mod.EnvBuilder(with_pip=False, symlinks=(os.name != "nt")).create(str(good))
    (good / "keep.txt").write_text("x")
    assert "existing environment" in venv_setup.ensure_venv(good, with_pip=False, out=Printer())
    assert (good / "keep.txt").exists() and (good / venv_setup.MARKER_NAME).exists()


def test_non_venv_folder_is_never_deleted(tmp_path):
    folder = tmp_path / "venv"
    folder.mkdir()
    (folder / "precious.txt").write_text("user data")
    with pytest.raises(common.StepError):
        venv_setup.ensure_venv(folder, with_pip=False, out=Printer())
    assert (folder / "precious.txt").exists()


# ------------------------------------------------------------------------------------- commands


def test_run_without_display_points_to_chat(tmp_path, monkeypatch, capsys):
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert bs.main(["run"]) == 2
    text = capsys.readouterr().out
    assert "No display" in text
    assert "installer/bootstrap.py chat" in text
    assert "-m engine chat" not in text  # no environment yet: its python is not named as if it were there
    assert not (tmp_path / "home" / "venv").exists()  # nothing installed for nothing
    assert bs.main([]) == 2  # run is the default


def test_has_display():
    assert not common.has_display({}, "Linux")
    assert common.has_display({"DISPLAY": ":0"}, "Linux")
    assert common.has_display({"WAYLAND_DISPLAY": "wayland-0"}, "Linux")
    assert common.has_display({"QT_QPA_PLATFORM": "offscreen"}, "Linux")
    assert common.has_display({}, "Darwin") and common.has_display({}, "Windows")


def test_test_command_maps_no_tests_to_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    seen = {}

    def fake_setup(ctx, force=False):
        seen["extras"] = set(ctx.extras)
        return 0

    launched = []
    monkeypatch.setattr(setup_runner, "ensure_setup", fake_setup)
    monkeypatch.setattr(commands, "launch", lambda cmd, cwd=None, env=None, **_kw: launched.append(cmd) or 5)
    assert bs.main(["test", "-k", "nothing"]) == 1
    assert "collected no tests" in capsys.readouterr().out
    assert seen["extras"] == {"dev"}
    assert [str(a) for a in launched[0][1:]] == ["-m", "pytest", "-k", "nothing"]
    monkeypatch.setattr(commands, "launch", lambda cmd, cwd=None, env=None, **_kw: 0)
    assert bs.main(["test"]) == 0
    monkeypatch.setattr(commands, "launch", lambda cmd, cwd=None, env=None, **_kw: 1)
    assert bs.main(["test"]) == 1


def test_test_command_runs_pytest_in_the_processes_the_machine_allows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    monkeypatch.setattr(setup_runner, "ensure_setup", lambda ctx, force=False: 0)
    asked, launched = [], []
    spread = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    monkeypatch.setattr(commands, "worker_args_for_tests", lambda rest, py, env: asked.append(list(rest)) or spread)
    monkeypatch.setattr(commands, "launch", lambda cmd, cwd=None, env=None, **_kw: launched.append(cmd) or 0)
    assert bs.main(["test", "-k", "chat"]) == 0
    assert asked == [["-k", "chat"]]
    assert [str(a) for a in launched[0][1:]] == ["-m", "pytest"] + spread + ["-k", "chat"]
    assert "Running the tests in 2 processes (DSV41_TEST_WORKERS=1 runs them in one)." in capsys.readouterr().out


def test_setup_failure_exit_code_and_unknown_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    monkeypatch.setattr(setup_runner, "ensure_setup", lambda ctx, force=False: 1)
    assert bs.main(["setup"]) == 1
    assert bs.main(["doctor"]) == 1
    assert bs.main(["bogus-command"]) == 2
    assert "unknown command" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the command line


def test_help_lists_the_commands_options_and_environment(capsys):
    for argv in (["--help"], ["-h"], ["help"], ["-h", "setup"]):
        assert bs.main(argv) == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: python3 installer/bootstrap.py [command] [args ...]")
        for command in bs.COMMANDS:
            assert f"\n    {command} " in text or f"\n    {command}\n" in text
        for var in ("DSV41_HOME", "DSV41_FORCE_CPU", "DSV41_VERBOSE", "DSV41_NO_GUI", "DSV41_FLASH_ATTN_BUILD",
                    "DSV41_FLASH_ATTN_TIMEOUT"):
            assert var in text
    # setup and uninstall read options of their own, each with its --help.
    assert bs.main(["setup", "--help"]) == 0
    text = capsys.readouterr().out
    assert all(opt in text for opt in ("--force", "--dev", "-v, --verbose", "--gui"))
    assert bs.main(["uninstall", "-h"]) == 0
    assert "[--purge | --keep-data]" in capsys.readouterr().out


PASSED_ON = ["-x", "-k", "foo and not bar", "--help", "-h", "--opt=1", "-v", "file.pdf", "--", "--after"]


@pytest.mark.parametrize("command, program", [
    ("run", ["-m", "app"]), ("chat", ["-m", "engine", "chat"]), ("doctor", ["-m", "engine", "doctor"]),
    ("selftest", ["-m", "app.selftest"]), ("test", ["-m", "pytest"]),
])
def test_arguments_after_a_command_go_to_its_program_untouched(tmp_path, monkeypatch, command, program):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(torch_choice, "detect_nvidia", lambda: None)
    monkeypatch.setattr(setup_runner, "is_ready", lambda ctx, steps=None: True)
    monkeypatch.setattr(setup_runner, "ensure_setup", lambda ctx, force=False: 0)
    monkeypatch.setattr(commands, "ensure_qt_libraries", lambda py, env: 0)
    started = []
    monkeypatch.setattr(commands, "launch", lambda cmd, cwd=None, env=None, **_kw: started.append(cmd) or 0)
    monkeypatch.setattr(commands, "launch_app", lambda cmd, env, home: started.append(cmd) or 0)
    assert bs.main([command] + PASSED_ON) == 0
    assert [str(a) for a in started[0][1:]] == program + PASSED_ON
    if command == "run":  # also as the default command
        started.clear()
        assert bs.main(["--opt=1", "file.pdf"]) == 0
        assert [str(a) for a in started[0][1:]] == program + ["--opt=1", "file.pdf"]


def test_uninstall_gets_its_arguments_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    seen = []
    monkeypatch.setattr(commands, "cmd_uninstall", lambda args, repo, home: seen.append((args, home)) or 0)
    assert bs.main(["uninstall", "--purge", "--bogus"]) == 0
    assert seen == [(["--purge", "--bogus"], tmp_path / "home")]


def test_default_command_and_unknown_words(tmp_path):
    assert bs.parse([])[::2] == ("run", [])
    assert bs.parse(["--fullscreen", "x"])[::2] == ("run", ["--fullscreen", "x"])
    existing = tmp_path / "notes.txt"
    existing.write_text("x")
    assert bs.parse([str(existing)])[::2] == ("run", [str(existing)])
    with pytest.raises(common.UsageError, match="unknown command: notes"):
        bs.parse(["notes"])


def test_setup_options(capsys):
    command, opts, rest = bs.parse(["setup", "--force", "-v", "--dev", "--gui"])
    assert (command, opts.force, opts.verbose, opts.dev, opts.gui, rest) == ("setup", True, True, True, True, [])
    _, opts, _ = bs.parse(["setup", "--verbose"])
    assert opts.verbose and not (opts.force or opts.dev or opts.gui)
    for wrong in (["--bogus"], ["--forc"], ["extra"], ["--force=1"]):  # no abbreviations, no values
        assert bs.main(["setup"] + wrong) == 2
        text = capsys.readouterr().out
        assert text.startswith("setup: ") and "--force" in text  # the message, then setup's help


def test_bootstrap_runs_as_a_file_from_an_isolated_python(tmp_path):
    """As the launchers start it: a bare Python, the installer folder not on sys.path (-I)."""
    import subprocess
    env = dict(os.environ, DSV41_HOME=str(tmp_path / "home"))
    script = str(REPO / "installer" / "bootstrap.py")
    r = subprocess.run([sys.executable, "-I", script, "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "install-shortcut" in r.stdout and r.stderr == ""
    r = subprocess.run([sys.executable, "-I", script, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "setup needed: no complete environment" in r.stdout, r.stderr
    assert not (tmp_path / "home" / "venv").exists()


@pytest.mark.parametrize("theirs", [True, False])
def test_ctrl_c_reaches_the_terminal_chat_which_goes_on_where_the_app_is_stopped(monkeypatch, theirs):
    """The terminal sends Ctrl-C to the launcher and its child alike: the chat (and pytest) handle it themselves and
    the launcher keeps waiting; any other child is stopped with the launcher."""
    import subprocess

    real_wait = subprocess.Popen.wait
    interrupted = []

    def wait(self, timeout=None):
        if not interrupted:  # Ctrl-C while the child runs
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    code = "import time; time.sleep(0.5); raise SystemExit(7)"
    rc = commands.launch([sys.executable, "-c", code], ctrl_c_is_theirs=theirs)
    assert interrupted and rc == (7 if theirs else 130)
