"""Tests for installer/bootstrap.py: the logic, without installing anything from the network."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

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
    py = bs.venv_python(venv)
    py.parent.mkdir(parents=True)
    py.write_text("")
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    (venv / bs.MARKER_NAME).write_text("{}")


# ----------------------------------------------------------------------------------- data_home


def test_data_home_override_wins(tmp_path):
    env = {"DSV41_HOME": str(tmp_path / "mine"), "XDG_DATA_HOME": "/xdg", "LOCALAPPDATA": "C:/x"}
    for system in ("Linux", "Darwin", "Windows"):
        assert bs.data_home(env, system, home=tmp_path) == tmp_path / "mine"


def test_data_home_defaults_per_platform(tmp_path):
    h = tmp_path
    assert bs.data_home({}, "Linux", h) == h / ".local" / "share" / "ds-v41-chat"
    assert bs.data_home({"XDG_DATA_HOME": "/data/x"}, "Linux", h) == Path("/data/x/ds-v41-chat")
    # A relative XDG_DATA_HOME is invalid per the spec and ignored.
    assert bs.data_home({"XDG_DATA_HOME": "rel"}, "Linux", h) == h / ".local" / "share" / "ds-v41-chat"
    assert bs.data_home({}, "Darwin", h) == h / "Library" / "Application Support" / "ds-v41-chat"
    assert bs.data_home({"LOCALAPPDATA": str(h / "L")}, "Windows", h) == h / "L" / "ds-v41-chat"
    assert bs.data_home({}, "Windows", h) == h / "AppData" / "Local" / "ds-v41-chat"


def test_venv_python_paths():
    assert bs.venv_python(Path("v"), "Linux") == Path("v/bin/python")
    assert bs.venv_python(Path("v"), "Darwin") == Path("v/bin/python")
    assert bs.venv_python(Path("v"), "Windows") == Path("v/Scripts/python.exe")


# --------------------------------------------------------------------------------- fingerprint


def test_fingerprint_changes_when_pyproject_changes(tmp_path):
    repo = make_repo(tmp_path)
    fp1 = bs.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    assert fp1 == bs.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch>=2.5"]\n')
    fp2 = bs.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7")
    assert fp2 != fp1
    # ... and with each of the other inputs.
    others = {
        bs.fingerprint(repo / "pyproject.toml", repo, [], "3.11.7"),
        bs.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.12.1"),
        bs.fingerprint(repo / "pyproject.toml", tmp_path, ["dev"], "3.11.7"),
        bs.fingerprint(repo / "pyproject.toml", repo, ["dev"], "3.11.7", model_version="9.9"),
    }
    assert fp2 not in others and len(others) == 4
    # Extras are a set: order and duplicates don't matter.
    assert bs.fingerprint(repo / "pyproject.toml", repo, ["gpu", "dev", "dev"], "3.11.7") == \
        bs.fingerprint(repo / "pyproject.toml", repo, ["dev", "gpu"], "3.11.7")


# ---------------------------------------------------------------------------------------- state


def test_state_round_trip(tmp_path):
    path = tmp_path / bs.STATE_NAME
    st = bs.State(path)
    st.data["fingerprint"] = "abc"
    st.data["extras"] = ["dev"]
    st.mark_done("python", "Python 3.11")
    st.mark_failed("torch", "Install PyTorch", "no network")
    assert st.save()
    back = bs.State.load(path)
    assert back.fingerprint == "abc"
    assert back.extras == ["dev"]
    assert back.is_done("python") and not back.is_done("torch")
    assert back.last_failure["step"] == "torch"
    assert back.last_failure["message"] == "no network"
    assert not back.all_done(["python", "torch"])


def test_state_corrupt_or_missing_is_empty(tmp_path):
    path = tmp_path / bs.STATE_NAME
    assert bs.State.load(path).data["steps"] == {}
    path.write_text("{not json")
    st = bs.State.load(path)
    assert st.fingerprint is None and st.data["steps"] == {}
    # Saving into a folder that does not exist (venv not made yet) is a no-op, not a crash.
    assert bs.State(tmp_path / "nope" / bs.STATE_NAME).save() is False


def _counting_steps(calls, fail_at=None):
    def make(key):
        def func(ctx):
            calls.append(key)
            if key == fail_at:
                raise bs.StepError(f"{key} broke", "do the fix", ["pip line 1", "pip line 2"],
                                   ["python", "-m", "pip", "install", key])
            return f"{key} fine"
        return func
    return [bs.Step(k, f"Step {k}", make(k)) for k in ("s1", "s2", "s3", "s4")]


def test_resume_from_failed_step(tmp_path):
    state_path = tmp_path / bs.STATE_NAME
    out = Printer()
    ctx = bs.Context(make_repo(tmp_path), tmp_path / "home", out=out)

    calls = []
    ok = bs.run_steps(_counting_steps(calls, fail_at="s3"), bs.State(state_path), ctx)
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
    ok = bs.run_steps(_counting_steps(calls2), bs.State.load(state_path), ctx)
    assert ok
    assert calls2 == ["s3", "s4"]  # 1-2 skipped, 3 retried
    assert "stopped at step 'Step s3'" in out2.text
    assert out2.text.count("done before, skipped") == 2


def _fake_ctx(tmp_path, out, extras=()):
    repo = tmp_path / "repo"
    if not repo.exists():
        make_repo(tmp_path)
    ctx = bs.Context(repo, tmp_path / "home", extras=extras, out=out)
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
        return [bs.Step("venv", "venv", make_venv), bs.Step("a", "a", other("a")), bs.Step("b", "b", other("b"))]

    assert bs.ensure_setup(ctx, steps()) == 0
    assert calls == ["venv", "a", "b"]
    state = bs.State.load(ctx.venv / bs.STATE_NAME)
    assert state.fingerprint and state.last_failure is None

    # Second start: nothing runs, and it is quick.
    calls.clear()
    t0 = time.monotonic()
    assert bs.ensure_setup(bs.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert time.monotonic() - t0 < 2.0
    assert calls == []

    # A start that needs the dev extra re-runs the install steps (not the venv) ...
    assert bs.ensure_setup(bs.Context(ctx.repo, ctx.home, extras={"dev"}, out=out), steps()) == 0
    assert calls == ["a", "b"]
    # ... after which a plain start (no dev asked) is a no-op again: extras accumulate.
    calls.clear()
    assert bs.ensure_setup(bs.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert calls == []

    # Editing pyproject.toml re-runs them too.
    (ctx.repo / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "2"\n')
    assert bs.ensure_setup(bs.Context(ctx.repo, ctx.home, out=out), steps()) == 0
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
                raise bs.StepError(f"{key} failed", "fix it")
            return key
        return f

    def steps():
        return [bs.Step("venv", "venv", make_venv), bs.Step("a", "a", step("a")),
                bs.Step("b", "b", step("b")), bs.Step("c", "c", step("c"))]

    assert bs.ensure_setup(ctx, steps()) == 1
    assert calls == ["venv", "a", "b"]
    assert not bs.is_ready(ctx, steps())
    calls.clear()
    fail.clear()
    assert bs.ensure_setup(bs.Context(ctx.repo, ctx.home, out=out), steps()) == 0
    assert calls == ["b", "c"]
    assert bs.is_ready(ctx, steps())


# ----------------------------------------------------------------------------------- torch plans


def test_torch_plans_no_gpu_linux_cpu_first():
    plans = bs.torch_install_plans(False, "Linux")
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
    mac = bs.torch_install_plans(False, "Darwin")
    assert [p.key for p in mac] == ["local-cpu", "cpu-index", "pypi"]
    assert mac[-1].warning is None
    gpu = bs.torch_install_plans(True, "Linux")
    assert [p.key for p in gpu] == ["pypi-cuda"]
    assert gpu[0].pip_args == ["install", "torch>=2.4,<2.15"]


def test_version_in_spec():
    assert bs.version_in_spec("2.13.0+cpu", "torch>=2.4,<2.15")
    assert not bs.version_in_spec("2.15.0", "torch>=2.4,<2.15")
    assert not bs.version_in_spec("2.3.1", "torch>=2.4,<2.15")
    assert bs.version_in_spec("2.4", "torch>=2.4,<2.15")


class FakePip:
    """Stands in for run_logged: answers each pip call from a script, records the commands."""

    def __init__(self, results):
        self.results = list(results)
        self.cmds = []

    def __call__(self, cmd, log, timeout=None, verbose=False, env=None, out=None):
        self.cmds.append(cmd)
        rc, text = self.results.pop(0)
        lines = text.splitlines()
        return bs.RunResult(rc, lines[-25:], 0.1, text)


def test_step_torch_falls_through_plans_in_order(tmp_path, monkeypatch):
    out = Printer()
    fake = FakePip([
        (1, "ERROR: No matching distribution found for torch==2.13.0+cpu"),
        (1, "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection"),
        (0, "Successfully installed torch-2.14.1"),
    ])
    ctx = bs.Context(make_repo(tmp_path), tmp_path / "home", out=out, runner=fake, system="Linux")
    probes = iter([(False, "ModuleNotFoundError"), (True, "2.14.1\n12.8")])
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: next(probes))
    result = bs.step_torch(ctx)
    assert "torch 2.14.1" in result and "(c)" in result
    assert [c[-1] for c in fake.cmds] == ["torch==2.13.0+cpu", "torch>=2.4,<2.15", "torch>=2.4,<2.15"]
    assert "--index-url" in fake.cmds[1] and "--index-url" not in fake.cmds[2]
    assert "not available here" in out.text and "index not reachable" in out.text
    assert "large CUDA build" in out.text


def test_step_torch_all_fail_names_network(tmp_path, monkeypatch):
    net = "Could not fetch URL https://pypi.org/simple/torch/: ProxyError('Cannot connect to proxy.')"
    fake = FakePip([(1, net), (1, net), (1, net)])
    ctx = bs.Context(make_repo(tmp_path), tmp_path / "home", out=Printer(), runner=fake, system="Linux")
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (False, ""))
    with pytest.raises(bs.StepError) as ei:
        bs.step_torch(ctx)
    assert "check your connection / proxy" in ei.value.fix
    assert "setup resumes from this step" in ei.value.fix
    assert ei.value.command and ei.value.command[-1] == "torch>=2.4,<2.15"


def test_step_torch_skips_when_installed(tmp_path, monkeypatch):
    fake = FakePip([])
    ctx = bs.Context(make_repo(tmp_path), tmp_path / "home", out=Printer(), runner=fake)
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (True, "2.13.0+cpu\n"))
    assert "already installed" in bs.step_torch(ctx)
    assert fake.cmds == []


def test_flash_attn_failure_never_fails_setup(tmp_path, monkeypatch):
    out = Printer()
    fake = FakePip([(1, "error: subprocess-exited-with-error\nnvcc not found")])
    gpu = bs.GpuInfo(("NVIDIA H200",), "570.1", "12.8")
    ctx = bs.Context(make_repo(tmp_path), tmp_path / "home", gpu=gpu, out=out, runner=fake)
    monkeypatch.setattr(ctx, "venv_eval", lambda code, timeout=300: (False, ""))
    monkeypatch.delenv("DSV41_FLASH_ATTN_BUILD", raising=False)
    result = bs.step_flash_attn(ctx)
    # Only a prebuilt wheel is tried; no source build by default; one line names SDPA.
    assert "no prebuilt flash-attn wheel fits" in result and "PyTorch SDPA" in result
    assert len(fake.cmds) == 1
    assert fake.cmds[0][fake.cmds[0].index("--only-binary") + 1] == ":all:"
    assert "--no-build-isolation" not in fake.cmds[0]
    # The source build happens only when asked for, and its failure never fails setup either.
    monkeypatch.setenv("DSV41_FLASH_ATTN_BUILD", "1")
    fake2 = FakePip([(1, "no wheel"), (1, "error: subprocess-exited-with-error\nnvcc not found")])
    ctx.runner = fake2
    result = bs.step_flash_attn(ctx)
    assert "could not be built" in result and "PyTorch SDPA" in result
    assert "--only-binary" in fake2.cmds[0] and "--no-build-isolation" in fake2.cmds[1]
    no_gpu = bs.Context(ctx.repo, ctx.home, out=out, runner=FakePip([]))
    assert "SDPA" in bs.step_flash_attn(no_gpu)


def test_diagnose_kinds(tmp_path):
    assert bs.diagnose("OSError: [Errno 28] No space left on device", tmp_path)[0] == "disk"
    assert "GiB free" in bs.diagnose("No space left on device", tmp_path)[1]
    kind, fix = bs.diagnose("Temporary failure in name resolution", tmp_path)
    assert kind == "network" and "proxy" in fix
    assert bs.diagnose("No matching distribution found for foo==1", tmp_path)[0] == "not-found"
    assert bs.diagnose("something else", tmp_path)[0] == "pip"


def test_run_logged_real_process(tmp_path):
    log = tmp_path / "log.txt"
    code = "import sys\nfor i in range(40): print('line', i)\nsys.exit(3)"
    res = bs.run_logged([sys.executable, "-c", code], log, out=Printer())
    assert res.returncode == 3
    assert res.tail[-1] == "line 39" and len(res.tail) == 25
    assert "line 0" in log.read_text()
    slow = bs.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], None, timeout=1, out=Printer())
    assert slow.returncode is None and slow.elapsed < 10


# ------------------------------------------------------------------------------------- nvidia


def test_detect_nvidia_none_without_nvidia_smi(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert bs.detect_nvidia() is None


SMI_FULL = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_parse_nvidia_smi():
    info = bs.parse_nvidia_smi("GPU 0: NVIDIA H200 (UUID: GPU-1234)\nGPU 1: NVIDIA H200 (UUID: GPU-5)\n", SMI_FULL)
    assert info.names == ("NVIDIA H200", "NVIDIA H200")
    assert info.cuda == "12.4" and info.driver == "550.54.15"
    assert bs.parse_nvidia_smi("No devices were found\n", "") is None


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
    info = bs.detect_nvidia()
    assert info is not None and info.names == ("NVIDIA A10",) and info.cuda == "12.4"
    monkeypatch.setenv("DSV41_FORCE_CPU", "1")
    assert bs.detect_nvidia() is None
    # A driver that lists no GPU (or fails) means no GPU.
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    monkeypatch.delenv("DSV41_FORCE_CPU")
    assert bs.detect_nvidia() is None


# ------------------------------------------------------------------------------------------ venv


def test_half_made_venv_is_recreated(tmp_path):
    venv = tmp_path / "home" / "venv"
    venv.mkdir(parents=True)
    (venv / bs.CREATING_NAME).write_text("pid 1")
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    (venv / "leftover.txt").write_text("from the interrupted attempt")
    out = Printer()
    result = bs.ensure_venv(venv, with_pip=False, out=out)
    assert result.startswith("recreated")
    assert "incomplete" in out.text
    assert not (venv / "leftover.txt").exists()
    assert not (venv / bs.CREATING_NAME).exists()
    assert (venv / bs.MARKER_NAME).is_file()
    assert bs.venv_is_complete(venv)
    # The new one is real: its Python runs.
    import subprocess
    r = subprocess.run([str(bs.venv_python(venv)), "-c", "import sys; print(sys.prefix)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and Path(r.stdout.strip()).resolve() == venv.resolve()
    # And the next call reuses it.
    assert bs.ensure_venv(venv, with_pip=False, out=out).startswith("reusing")


def test_broken_venv_without_marker_is_recreated_and_working_one_adopted(tmp_path):
    import venv as venv_mod
    # A marker-less venv whose python is gone: half-made, recreated.
    broken = tmp_path / "broken" / "venv"
    broken.mkdir(parents=True)
    (broken / "pyvenv.cfg").write_text("home = /nowhere\n")
    assert bs.ensure_venv(broken, with_pip=False, out=Printer()).startswith("recreated")
    # A working venv made by hand (no marker, no creation sentinel) is adopted, not wiped.
    good = tmp_path / "good" / "venv"
    venv_mod.EnvBuilder(with_pip=False, symlinks=(os.name != "nt")).create(str(good))
    (good / "keep.txt").write_text("x")
    assert "existing environment" in bs.ensure_venv(good, with_pip=False, out=Printer())
    assert (good / "keep.txt").exists() and (good / bs.MARKER_NAME).exists()


def test_non_venv_folder_is_never_deleted(tmp_path):
    folder = tmp_path / "venv"
    folder.mkdir()
    (folder / "precious.txt").write_text("user data")
    with pytest.raises(bs.StepError):
        bs.ensure_venv(folder, with_pip=False, out=Printer())
    assert (folder / "precious.txt").exists()


# ------------------------------------------------------------------------------------- commands


def test_run_without_display_points_to_chat(tmp_path, monkeypatch, capsys):
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bs.platform, "system", lambda: "Linux")
    assert bs.main(["run"]) == 2
    text = capsys.readouterr().out
    assert "No display" in text
    assert "installer/bootstrap.py chat" in text and "-m engine chat" in text
    assert not (tmp_path / "home" / "venv").exists()  # nothing installed for nothing
    assert bs.main([]) == 2  # run is the default


def test_has_display():
    assert not bs.has_display({}, "Linux")
    assert bs.has_display({"DISPLAY": ":0"}, "Linux")
    assert bs.has_display({"WAYLAND_DISPLAY": "wayland-0"}, "Linux")
    assert bs.has_display({"QT_QPA_PLATFORM": "offscreen"}, "Linux")
    assert bs.has_display({}, "Darwin") and bs.has_display({}, "Windows")


def test_test_command_maps_no_tests_to_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bs, "detect_nvidia", lambda: None)
    seen = {}

    def fake_setup(ctx, force=False):
        seen["extras"] = set(ctx.extras)
        return 0

    launched = []
    monkeypatch.setattr(bs, "ensure_setup", fake_setup)
    monkeypatch.setattr(bs, "launch", lambda cmd, cwd=None, env=None: launched.append(cmd) or 5)
    assert bs.main(["test", "-k", "nothing"]) == 1
    assert "collected no tests" in capsys.readouterr().out
    assert seen["extras"] == {"dev"}
    assert [str(a) for a in launched[0][1:]] == ["-m", "pytest", "-k", "nothing"]
    monkeypatch.setattr(bs, "launch", lambda cmd, cwd=None, env=None: 0)
    assert bs.main(["test"]) == 0
    monkeypatch.setattr(bs, "launch", lambda cmd, cwd=None, env=None: 1)
    assert bs.main(["test"]) == 1


def test_setup_failure_exit_code_and_unknown_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bs, "detect_nvidia", lambda: None)
    monkeypatch.setattr(bs, "ensure_setup", lambda ctx, force=False: 1)
    assert bs.main(["setup"]) == 1
    assert bs.main(["doctor"]) == 1
    assert bs.main(["bogus-command"]) == 2
    assert "unknown command" in capsys.readouterr().out
