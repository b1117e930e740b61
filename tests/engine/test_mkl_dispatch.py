"""MKL's CPU-specific code on AMD CPUs (engine.mkl_dispatch): when it applies, and that MKL takes it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import mkl_dispatch

ROOT = Path(__file__).resolve().parents[2]
AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"


def test_the_vendor_is_read_from_cpuinfo():
    assert mkl_dispatch.cpu_vendor(AMD) == "AuthenticAMD"
    assert mkl_dispatch.cpu_vendor(INTEL) == "GenuineIntel"
    assert mkl_dispatch.cpu_vendor("processor\t: 0\n") is None


def test_it_applies_to_amd_cpus_only_before_torch_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(mkl_dispatch.sys, "platform", "linux")
    monkeypatch.setattr(mkl_dispatch.platform, "machine", lambda: "x86_64")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("DSV41_MKL_INTEL_PATHS", raising=False)
    assert mkl_dispatch.reason_not_to_apply(AMD) is None
    assert "not an AMD CPU (GenuineIntel)" in mkl_dispatch.reason_not_to_apply(INTEL)
    assert "vendor unknown" in mkl_dispatch.reason_not_to_apply("")
    monkeypatch.setenv("DSV41_MKL_INTEL_PATHS", "0")
    assert "turned off" in mkl_dispatch.reason_not_to_apply(AMD)
    monkeypatch.setenv("DSV41_MKL_INTEL_PATHS", "1")
    monkeypatch.setattr(mkl_dispatch.platform, "machine", lambda: "aarch64")
    assert "not Linux on x86-64" in mkl_dispatch.reason_not_to_apply(AMD)


def test_where_it_applies_torch_loaded_first_is_missed_and_an_intel_cpu_is_not(monkeypatch):
    monkeypatch.setattr(mkl_dispatch.sys, "platform", "linux")
    monkeypatch.setattr(mkl_dispatch.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("DSV41_MKL_INTEL_PATHS", raising=False)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", object()))
    monkeypatch.setattr(mkl_dispatch, "cpu_vendor", lambda cpuinfo=None: "AuthenticAMD")
    monkeypatch.setattr(mkl_dispatch, "_state", {})
    mkl_dispatch.apply()
    assert mkl_dispatch.missed() and "torch was loaded before the engine" in mkl_dispatch.status()
    monkeypatch.setattr(mkl_dispatch, "cpu_vendor", lambda cpuinfo=None: "GenuineIntel")
    monkeypatch.setattr(mkl_dispatch, "_state", {})
    mkl_dispatch.apply()
    assert not mkl_dispatch.missed() and "not an AMD CPU" in mkl_dispatch.status()


def _code_path(env: dict, torch_first: bool = False) -> tuple[str, str]:
    """MKL's code path and the status line in a fresh process importing the engine (and torch, first if asked)."""
    imports = "import torch, engine" if torch_first else "import engine, torch"
    code = (f"{imports}\nfrom engine import mkl_dispatch\ntorch.mm(torch.ones(8, 8), torch.ones(8, 8))\n"
            "print(mkl_dispatch.code_path()); print(mkl_dispatch.status())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    path, status = done.stdout.strip().splitlines()[-2:]
    return path, status


@pytest.mark.skipif(mkl_dispatch.cpu_vendor() != "AuthenticAMD" or sys.platform != "linux",
                    reason="MKL's vendor check: an AMD CPU on Linux")
def test_on_an_amd_cpu_mkl_runs_its_cpu_specific_code_unless_turned_off_or_too_late(tmp_path):
    if mkl_dispatch.c_compiler() is None:
        pytest.skip("no C compiler")
    env = dict(os.environ, DSV41_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("DSV41_MKL_INTEL_PATHS", None)
    path, status = _code_path(env)
    if path == "None":
        pytest.skip("this torch does not hold MKL in libtorch_cpu.so")
    assert int(path) > 0 and "AMD CPU: MKL told to pick its code by instruction set" in status
    assert list((tmp_path / "cache" / "kernels").glob("mkl-dispatch-*.so"))  # built once, in the cache folder
    off, status = _code_path(dict(env, DSV41_MKL_INTEL_PATHS="0"))
    assert off == "0" and "turned off" in status  # MKL's generic code: what the library changes
    late, status = _code_path(env, torch_first=True)
    assert late == "0" and "torch was loaded before the engine" in status
