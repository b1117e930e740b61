"""`python -m engine doctor`: the usual causes of a failed start or a slow one (device, driver, kernels,
attention backend, the default model), checked one by one.

Each check returns (status, what it found, the fix when it is a problem). status: ok | info | warn | fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    found: str
    fix: str = ""


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001
        return None


def nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def run_checks() -> list[Check]:
    checks: list[Check] = []
    py = sys.version_info
    checks.append(Check("Python", "ok" if py >= (3, 10) else "fail", platform.python_version(),
                        "" if py >= (3, 10) else "Install Python 3.10 or newer and rerun the setup."))
    torch_v = _version("torch")
    if torch_v is None:
        checks.append(Check("PyTorch", "fail", "not importable", "Rerun: python3 installer/bootstrap.py setup"))
        return checks
    import torch

    checks.append(Check("PyTorch", "ok", f"{torch_v} (CUDA build: {torch.version.cuda or 'none, CPU only'})"))
    tf_v = _version("transformers")
    tf_ok = tf_v is not None and tf_v.startswith("5.23")
    checks.append(Check("transformers", "ok" if tf_ok else "warn", tf_v or "not importable",
                        "" if tf_ok else "The engine is tested with transformers 5.23.x: pip install 'transformers>=5.23,<5.24'"))
    nvcc = nvcc_version()
    cuda_avail = torch.cuda.is_available()
    if torch.version.cuda and nvcc:
        same_major = nvcc.split(".")[0] == torch.version.cuda.split(".")[0]
        checks.append(Check("nvcc vs torch CUDA", "ok" if same_major else "warn",
                            f"nvcc {nvcc}, torch built for CUDA {torch.version.cuda}",
                            "" if same_major else "Building flash-attn needs matching versions: install the CUDA "
                            f"toolkit {torch.version.cuda} (gcc 9-11), clear ~/.cache/torch_extensions, or use a "
                            "prebuilt flash-attn wheel."))
    else:
        checks.append(Check("nvcc", "info", nvcc or "not found", "" if nvcc else
                            "Only needed to build flash-attn from source; prebuilt wheels do not need it."))
    checks.extend(_gpu_checks(torch, cuda_avail))
    checks.append(_attention_check(torch, cuda_avail))
    try:
        from .loader import import_bitsandbytes

        bitsandbytes = import_bitsandbytes()
        checks.append(Check("bitsandbytes", "ok", f"{bitsandbytes.__version__} (INT8/INT4 weights available)"))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("bitsandbytes", "warn", f"not importable ({type(exc).__name__})",
                            "INT8/INT4 weights need it: pip install bitsandbytes"))
    if not cuda_avail:
        checks.append(_cpu_kernels_check())
        checks.append(_mkl_check())
        checks.append(_huge_pages_check())
    checks.append(_ram_check())
    checks.append(_default_model_check())
    return checks


def _attention_check(torch, cuda_avail: bool) -> Check:
    """Which kernel each attention call runs here (for an 8B-class shape on the device and in the dtype the default
    settings pick), and whether the flash-attn package imports with its compiled extension (tried, not looked up).
    Where the default settings decode on the CPU, decode is what the load decides: the fused C step (its ISA and x
    mode) when it runs, the per-op kernel otherwise."""
    from .cache.attention import attention_kernels, describe_kernels, flash_import_error

    device = "cuda" if cuda_avail else "cpu"
    dtype = torch.bfloat16 if cuda_avail else torch.float32
    try:
        found = attention_kernels("sdpa", device, dtype, 8, 4, 128)
        step, why_not = _decode_step()
        if step is not None:
            found["decode"] = found["scored decode"] = step
        kernels = describe_kernels(found)
        if step is None and why_not:
            kernels += f" ({why_not})"
    except Exception as exc:  # noqa: BLE001
        return Check("attention", "warn", f"could not be checked ({type(exc).__name__}: {exc})"[:200])
    flash_error = flash_import_error()
    if flash_error is None:
        return Check("attention", "ok", f"PyTorch SDPA: {kernels}; flash-attn imports (used for prefill on CUDA)")
    package = ("flash-attn not needed (PyTorch SDPA has FlashAttention-2 class kernels)"
               if "No module named" in flash_error else f"flash-attn installed but not loadable ({flash_error})")
    slow = cuda_avail and "math" in kernels
    return Check("attention", "warn" if slow else "ok", f"PyTorch SDPA: {kernels}; {package}",
                 "SDPA falls back to its math kernel here: check the GPU generation and the torch build"
                 if slow else "")


def _decode_step() -> tuple[str | None, str]:
    """(the fused decode step as the model panel names it, "") where the default settings' load builds one on this
    machine (engine.kernels.fused.step_library, for the device and dtype the loader picks; the default model's
    weights are GGUF blocks, which the kernels read), else (None, why not: "" on a GPU)."""
    from .config import DSV41Config
    from .kernels.fused import describe_step, step_library
    from .loader import pick_device, pick_dtype

    config = DSV41Config()
    device = pick_device(config.device_map)
    library, why_not = step_library(device, pick_dtype(config.dtype, device))
    if library is None:
        return None, "" if device.startswith("cuda") else why_not
    return describe_step(library), ""


def _cpu_kernels_check() -> Check:
    """The bf16 matrix-vector kernels (engine/kernels/cpu_kernels.c), built on first use with the C compiler."""
    from . import kernels as cpu_kernels

    library = cpu_kernels.load()
    if library is not None:
        isa = library.isa_name
        step, why_not = _decode_step()
        fused = "one fused call per decode step" if step is not None else f"the per-op decode step ({why_not})"
        return Check("CPU kernels", "ok", f"built ({isa}): CPU weights held as bf16 (or int8), decode reads half the "
                     f"bytes or less, {fused}")
    return Check("CPU kernels", "warn", cpu_kernels.unavailable_reason() or "unavailable",
                 "Decoding on the CPU works without them, about 2x slower with twice the weight memory. "
                 "Install a C compiler (Debian/Ubuntu: sudo apt install gcc) and restart.")


def _mkl_check() -> Check:
    """MKL's code path for the prefill's float32 products (engine.mkl_dispatch: AMD CPUs)."""
    from . import mkl_dispatch

    slow = mkl_dispatch.missed()
    return Check("MKL (prefill products)", "warn" if slow else "info", mkl_dispatch.status(),
                 "Import the engine before torch, and install a C compiler (gcc): MKL then runs its AVX2 / AVX-512 "
                 "code on AMD CPUs (prefill 1.1-1.3x faster)" if slow else "")


def _huge_pages_check() -> Check:
    """Whether the CPU decode step's weights sit on huge pages (engine.kernels.huge_pages)."""
    from .kernels import huge_pages

    problem, found, fix = huge_pages.status()
    return Check("Huge pages (weights)", "warn" if problem else "info", found, fix)


def _gpu_checks(torch, cuda_avail: bool) -> list[Check]:
    out = []
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(Check(f"GPU {i}", "ok", f"{name}, driver {driver}, {mem.free / 2**30:.1f} of "
                             f"{mem.total / 2**30:.1f} GB free"))
        if count and not cuda_avail:
            out.append(Check("CUDA in PyTorch", "fail", "a GPU is present but PyTorch cannot use it",
                             "Install a CUDA build of torch matching the driver: rerun python3 installer/bootstrap.py "
                             "setup, or see https://pytorch.org/get-started/locally/"))
    except Exception:  # noqa: BLE001 - no NVIDIA driver / library
        out.append(Check("GPU", "info", "no NVIDIA GPU found (NVML unavailable): the engine runs on the CPU"))
    return out


def _ram_check() -> Check:
    import psutil

    vm = psutil.virtual_memory()
    free_gb = vm.available / 2**30
    status = "ok" if free_gb >= 2 else "warn"
    return Check("RAM", status, f"{free_gb:.1f} of {vm.total / 2**30:.1f} GB available",
                 "" if status == "ok" else "Close other programs; lower max_seq_len or kv_cache_ratio.")


def _default_model_check() -> Check:
    from .errors import ModelLoadError
    from .gguf import _gguf_key
    from .loader import DEFAULT_MODEL_PACKAGE, default_gguf_path
    from .paths import user_cache_dir

    try:
        path = default_gguf_path()
    except ModelLoadError as exc:
        return Check("default model", "fail", f"package {DEFAULT_MODEL_PACKAGE} missing", str(exc))
    converted = (user_cache_dir() / "models" / _gguf_key(path) / ".complete").is_file()
    return Check("default model", "ok", f"{path.name} ({'converted' if converted else 'converts on first start'})")


def main() -> int:
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    problems = 0
    for c in checks:
        mark = {"ok": "OK  ", "info": "INFO", "warn": "WARN", "fail": "FAIL"}[c.status]
        print(f"[{mark}] {c.name.ljust(width)}  {c.found}")
        if c.fix:
            print(f"       {' ' * width}  fix: {c.fix}")
        problems += c.status == "fail"
    print(f"\n{problems} problem(s) found." if problems else "\nNo problems found.")
    return 1 if problems else 0
