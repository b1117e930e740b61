"""Which PyTorch build to install: the NVIDIA driver (nvidia-smi), the wheel indexes its CUDA version
can use, the ways to install torch in the order to try them, and reading version requirements
(``torch>=2.4,<2.15``, ``~=2.4``) to tell whether an installed torch fits.

Pure decisions: nothing here installs anything; the only command run is nvidia-smi.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from typing import NamedTuple

TORCH_SPEC_DEFAULT = "torch>=2.4,<2.15"
TORCH_LOCAL_CPU = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_BASE = "https://download.pytorch.org/whl/"
# Which CUDA builds each PyTorch release publishes on its wheel indexes (download.pytorch.org/whl/cuXYZ), from
# the release compatibility matrix in PyTorch's RELEASE.md: (stable, experimental). The cu128 index, for one,
# stops at 2.11, so a driver reporting CUDA 12.8 or 12.9 is better served by 2.14 from cu126 than by 2.11
# from cu128. A newer release missing here is not guessed at: PyPI's own build is the last plan anyway.
TORCH_CUDA_BUILDS = {
    (2, 14): (("cu126", "cu130", "cu132"), ()),
    (2, 13): (("cu126", "cu130"), ("cu132",)),
    (2, 12): (("cu126", "cu130"), ("cu132",)),
    (2, 11): (("cu126", "cu128", "cu130"), ()),
    (2, 10): (("cu126", "cu128"), ("cu130",)),
    (2, 9): (("cu126", "cu128"), ("cu130",)),
    (2, 8): (("cu126", "cu128"), ("cu129",)),
    (2, 7): (("cu118", "cu126"), ("cu128",)),
    (2, 6): (("cu118", "cu124"), ("cu126",)),
    (2, 5): (("cu118", "cu121", "cu124"), ()),
    (2, 4): (("cu118", "cu121"), ("cu124",)),
}
# The CUDA version PyPI's default Linux torch wheels need, for the newest release of the range in pyproject.toml
# (torch 2.14's wheel requires cuda-toolkit 13.0).
PYPI_TORCH_CUDA = (13, 0)
FLASH_ATTN_SPEC_DEFAULT = "flash-attn>=2.6"


# ---------------------------------------------------------------------------------------- GPU


class GpuInfo(NamedTuple):
    names: tuple
    driver: str | None
    cuda: str | None  # the highest CUDA version the driver supports, from nvidia-smi's header


def parse_nvidia_smi(list_output: str, full_output: str = "") -> GpuInfo | None:
    """Parse ``nvidia-smi -L`` (GPU names) and plain ``nvidia-smi`` (driver, CUDA version)."""
    names = []
    for line in list_output.splitlines():
        m = re.match(r"\s*GPU\s+\d+:\s*(.+?)\s*(?:\(UUID:.*)?$", line)
        if m:
            names.append(m.group(1))
    if not names:
        return None
    cuda = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)*)", full_output)
    driver = re.search(r"Driver Version:\s*([0-9]+(?:\.[0-9]+)*)", full_output)
    return GpuInfo(tuple(names), driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def detect_nvidia(timeout: float = 15.0, env: dict | None = None) -> GpuInfo | None:
    """An NVIDIA GPU usable by the driver, or None (no nvidia-smi on PATH, or it lists no GPU)."""
    env = os.environ if env is None else env
    if env.get("DSV41_FORCE_CPU", "").strip() not in ("", "0"):
        return None
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if not exe:
        return None
    try:
        listed = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout)
        if listed.returncode != 0:
            return None
        full = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(listed.stdout, full.stdout if full.returncode == 0 else "")


# ---------------------------------------------------------------------------- torch choices


class Plan(NamedTuple):
    key: str
    label: str
    pip_args: list
    warning: str | None = None
    timeout: float = 3600.0


class CudaChoice(NamedTuple):
    tag: str  # the wheel index, e.g. "cu130"
    torch: tuple  # the newest release of the range published there, e.g. (2, 14)
    experimental: bool


def _tag_cuda(tag: str) -> tuple:
    digits = tag[2:]
    return int(digits[:-1]), int(digits[-1])


def _release_in_spec(release: tuple, spec: str) -> bool:
    """Whether some patch release of `release` (2, 14) can meet `spec` (its first or a late one)."""
    return any(version_in_spec(f"{release[0]}.{release[1]}.{patch}", spec) for patch in (0, 99))


def cuda_wheel_choices(driver_cuda: str | None, torch_spec: str = TORCH_SPEC_DEFAULT, limit: int = 2) -> list:
    """The PyTorch CUDA wheel indexes to try for a driver supporting CUDA `driver_cuda`, best first, at most
    `limit`: each index the driver runs (a build for its CUDA version or older), with the newest release of
    `torch_spec` published there. A newer torch beats a newer CUDA build (2.14 for cu126 before 2.11 for
    cu128), a stable build an experimental one, then the newer CUDA. Empty when the version is unknown or
    older than every build in the range (PyPI's default build is the only choice then)."""
    if not driver_cuda:
        return []
    have = version_tuple(driver_cuda)[:2]
    if not have:
        return []
    have = have + (0,) * (2 - len(have))
    best: dict[str, CudaChoice] = {}
    for release, (stable, experimental) in TORCH_CUDA_BUILDS.items():
        if not _release_in_spec(release, torch_spec):
            continue
        for tag, exp in [(t, False) for t in stable] + [(t, True) for t in experimental]:
            if _tag_cuda(tag) > have:
                continue
            choice = CudaChoice(tag, release, exp)
            old = best.get(tag)
            if old is None or (release, not exp) > (old.torch, not old.experimental):
                best[tag] = choice
    ranked = sorted(best.values(), key=lambda c: (c.torch, not c.experimental, _tag_cuda(c.tag)), reverse=True)
    return ranked[:limit]


def _cuda_of_tag(tag: str) -> str:
    major, minor = _tag_cuda(tag)
    return f"{major}.{minor}"


def torch_install_plans(has_gpu: bool, system: str | None = None,
                        torch_spec: str = TORCH_SPEC_DEFAULT, cuda: str | None = None) -> list:
    """The ways to install PyTorch, in the order to try them.

    With no NVIDIA GPU a CPU build is always tried before anything that could be a multi-GB CUDA
    build: (a) the local/configured CPU wheel, (b) the official PyTorch CPU index (failing fast
    when it cannot be reached), (c) plain PyPI (CPU-only on macOS/Windows; on Linux a CUDA build,
    announced with a warning).

    With a GPU whose driver supports CUDA ``cuda``: the official PyTorch indexes that publish the newest
    release of ``torch_spec`` the driver runs (cuda_wheel_choices: e.g. 2.14 from .../whl/cu126 for a
    driver with CUDA 12.8 or 12.9, whose cu128 index stops at 2.11), the release pinned, then PyPI's
    default CUDA build (Linux; on Windows PyPI only has CPU builds).
    """
    system = platform.system() if system is None else system
    if has_gpu:
        plans = []
        for choice in cuda_wheel_choices(cuda, torch_spec):
            tag, release = choice.tag, f"{choice.torch[0]}.{choice.torch[1]}"
            plans.append(Plan(
                f"{tag}-index", f"PyTorch {release} for CUDA {_cuda_of_tag(tag)} ({tag}"
                + (", experimental" if choice.experimental else "") + ") from the official PyTorch index",
                ["install", "--index-url", TORCH_INDEX_BASE + tag, "--timeout", "15", "--retries", "0",
                 f"{torch_spec},=={release}.*"]))
        warning = None
        if system == "Windows":
            warning = ("PyPI's Windows build of PyTorch is CPU-only; for CUDA see "
                       "https://pytorch.org/get-started/locally/")
        elif cuda and version_tuple(cuda)[:2] < PYPI_TORCH_CUDA:
            need = ".".join(map(str, PYPI_TORCH_CUDA))
            warning = (f"PyPI's default PyTorch build targets CUDA {need}; this driver supports CUDA "
                       f"{cuda}: if torch cannot see the GPU, update the NVIDIA driver.")
        plans.append(Plan("pypi-cuda", "PyTorch with CUDA, from PyPI (default build)", ["install", torch_spec],
                          warning))
        return plans
    plans = [
        Plan("local-cpu", f"PyTorch CPU build {TORCH_LOCAL_CPU} (local wheel or configured index)",
             ["install", TORCH_LOCAL_CPU], None, 1800.0),
        Plan("cpu-index", "PyTorch CPU build from the official PyTorch CPU index",
             ["install", "--index-url", TORCH_CPU_INDEX, "--timeout", "15", "--retries", "0", torch_spec],
             None, 1800.0),
    ]
    if system in ("Darwin", "Windows"):
        plans.append(Plan("pypi", "PyTorch from PyPI (CPU build on this system)", ["install", torch_spec]))
    else:
        plans.append(Plan(
            "pypi-cuda-fallback", "PyTorch from PyPI (last resort)", ["install", torch_spec],
            "WARNING: no CPU build of PyTorch could be found; installing PyPI's Linux build, which is a "
            "large CUDA build (several GB to download) that runs on the CPU here.",
        ))
    return plans


# ------------------------------------------------------------------------------ version specs


def version_tuple(v: str) -> tuple:
    """The release numbers of a version: ``2.13.0+cpu`` -> (2, 13, 0); stops at the first part
    that does not start with a digit."""
    out = []
    for part in re.split(r"[.+]", v):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group(0)))
    return tuple(out)


_CLAUSE = re.compile(r"(~=|>=|<=|==|!=|>|<)\s*([0-9]+(?:\.[0-9]+)*)(\.\*)?")


def version_in_spec(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec``, like ``torch>=2.4,<2.15`` (name optional).

    Only release numbers are compared (``2.13.0+cpu`` is 2.13.0: local labels and pre/post/dev
    parts are not looked at), shorter ones padded with zeros (2.4 == 2.4.0).

    - ``>=``, ``<=``, ``>``, ``<``, ``==``, ``!=``: that comparison; ``==2.4.*`` and ``!=2.4.*``
      compare the leading numbers only (2.4.x matches ``==2.4.*``).
    - ``~=`` is PEP 440's compatible release: ``~=2.4`` means ``>=2.4, ==2.*``; ``~=2.4.1`` means
      ``>=2.4.1, ==2.4.*``.

    Invalid clauses raise ValueError: ``~=`` with a single number (``~=2``, which PEP 440 does not
    allow) and a ``.*`` after any operator but ``==`` and ``!=``. A clause of another form
    (``===``, an environment marker) is not understood and ignored.
    """
    v = version_tuple(version)
    clauses = re.sub(r"^[A-Za-z0-9_.\-\[\]]+", "", spec.strip())
    for clause in filter(None, (c.strip() for c in clauses.split(","))):
        m = _CLAUSE.match(clause)
        if not m:
            continue
        op, w, wildcard = m.group(1), version_tuple(m.group(2)), bool(m.group(3))
        if wildcard and op not in ("==", "!="):
            raise ValueError(f"{clause!r}: only == and != can take a '.*' suffix")
        if op == "~=" and len(w) < 2:
            raise ValueError(f"{clause!r}: ~= needs at least two numbers (e.g. ~=2.4)")
        if not _clause_holds(v, op, w, wildcard):
            return False
    return True


def _clause_holds(v: tuple, op: str, w: tuple, wildcard: bool) -> bool:
    if wildcard:  # == / != on the leading numbers
        same = _padded(v, len(w))[:len(w)] == w
        return same if op == "==" else not same
    n = max(len(v), len(w))
    a, b = _padded(v, n), _padded(w, n)
    if op == "~=":
        prefix = w[:-1]  # ~=2.4.1: the same 2.4, and at least 2.4.1
        return a >= b and _padded(v, len(prefix))[:len(prefix)] == prefix
    return {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b}[op]


def _padded(t: tuple, n: int) -> tuple:
    return t + (0,) * (n - len(t))


def pyproject_requirement(pyproject_text: str, name: str, default: str) -> str:
    """The requirement string for ``name`` in pyproject.toml's text (e.g. ``torch>=2.4,<2.15``)."""
    m = re.search(r"[\"'](" + re.escape(name) + r"\s*[<>=!~][^\"']*)[\"']", pyproject_text)
    return m.group(1) if m else default
