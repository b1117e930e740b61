"""MKL's fast code paths on AMD CPUs: the prefill's float32 matrix products run 1.1-1.3x faster.

torch's Linux x86-64 wheels hold Intel's MKL, which runs its generic code on CPUs that are not Intel's whatever their
instruction sets (`mkl_serv_cpu_detect()` answers 0 there; 5, AVX2, on the same AMD EPYC once this is applied). MKL
asks one function of its own, `mkl_serv_intel_cpu_true`, through the dynamic linker; a one-line library defining it
(engine/kernels/mkl_dispatch.c, built with the C compiler the kernels use, kept in the user cache folder) loaded
into the process's global scope before torch is found first. Measured on a 2-core AMD EPYC (AVX2), the default
model's 1k-token prefill in fresh processes taking turns: `python -m benchmarks.mkl_dispatch` (results/mkl-dispatch/).

Applied when the engine package is imported, before torch is, on Linux x86-64 with an AMD CPU; never on Intel CPUs
(MKL's own choice there), nor when torch is already loaded (too late: the process keeps MKL's answer), nor with
DSV41_MKL_INTEL_PATHS=0. `status()` says what happened (doctor prints it). Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels") / "mkl_dispatch.c"
_state: dict = {}


def c_compiler() -> str | None:
    """The system's C compiler ($CC, cc, gcc, clang), as the CPU kernels are built with (engine.kernels.library)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_vendor(cpuinfo: str | None = None) -> str | None:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"); None where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read(8192)
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip() or None
    return None


def reason_not_to_apply(cpuinfo: str | None = None) -> str | None:
    """Why the library is not for this machine or this run (None: it is; apply() may still miss it)."""
    if os.environ.get("DSV41_MKL_INTEL_PATHS", "1").strip() == "0":
        return "turned off (DSV41_MKL_INTEL_PATHS=0)"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "not Linux on x86-64"
    vendor = cpu_vendor(cpuinfo)
    if vendor != "AuthenticAMD":
        return f"not an AMD CPU ({vendor or 'vendor unknown'}): MKL chooses its own code paths"
    return None


def _build(compiler: str) -> Path:
    from .paths import user_cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + compiler.encode()).hexdigest()[:16]
    target = user_cache_dir() / "kernels" / f"mkl-dispatch-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise OSError(f"the compiler failed: {done.stderr.strip()[:200]}")
    os.replace(partial, target)  # another process building the same library at once writes the same bytes
    return target


def apply() -> None:
    """Load the library where it applies (once per process; see the module's docstring); never raises."""
    if "applied" in _state:
        return
    _state.update(applied=False, missed=False)
    reason = reason_not_to_apply()
    if reason is None:  # it is for this machine: what follows can only miss it
        if "torch" in sys.modules:
            reason = "torch was loaded before the engine: MKL keeps its generic code paths in this process"
        elif (compiler := c_compiler()) is None:
            reason = "no C compiler to build it with"
        else:
            try:
                ctypes.CDLL(str(_build(compiler)), mode=os.RTLD_GLOBAL)
                _state["applied"] = True
            except (OSError, subprocess.SubprocessError) as exc:
                reason = f"could not be built or loaded ({exc})"[:300]
        _state["missed"] = reason is not None
    _state["reason"] = reason


def missed() -> bool:
    """True where MKL should have been given its CPU-specific code and was not (torch first, no compiler, a failed
    build): what doctor warns about."""
    return bool(_state.get("missed"))


def code_path() -> int | None:
    """MKL's code path in this process (`mkl_serv_cpu_detect()`: 0 its generic code; more, a CPU-specific one), None
    where torch does not hold MKL that way. Loads torch."""
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return int(lib.mkl_serv_cpu_detect())
    except (OSError, AttributeError):
        return None


def status() -> str:
    """One line: whether MKL runs its CPU-specific code here, and why (doctor)."""
    if _state.get("applied"):
        path = code_path()
        return f"AMD CPU: MKL told to pick its code by instruction set (code path {path})"
    return _state.get("reason") or "not checked (the engine package was not imported the usual way)"
