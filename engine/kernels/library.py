"""Compact weights for the CPU decode step: bf16 or int8, through our own kernels.

At batch 1 a decode step reads every weight once, so its time is the weight bytes over the memory
bandwidth. Held as bf16 the weights cost half of float32's bytes, and torch's bf16 matrix-vector kernel
reaches only ~60 % of the bandwidth on our machine. cpu_kernels.c widens bf16 to float32 in registers and
accumulates in float32, so a step computes float32 products of the bf16 values from half the bytes: exact
for bf16 checkpoints, a rounding for others (adapter.pack_weights decides; benchmarks/cpu_kernels.py
measures speed and perplexity).

The C file is compiled on first use with the system's C compiler (`cc -O3 -march=native -fopenmp`) into
the user cache folder, keyed by a hash of the source and the compiler. Without a compiler, on a CPU the
kernels do not cover, or with DSV41_CPU_KERNELS=0, `load()` returns None and the engine keeps torch's
float32 path: same results, more memory and time. No torch import at module level beyond what the engine
already loads; nothing here knows transformers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..mkl_dispatch import c_compiler
from ..paths import user_cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_lock = threading.Lock()
_state: dict = {}


@dataclass(frozen=True)
class KernelLibrary:
    lib: ctypes.CDLL
    path: Path
    isa: int  # 512 (AVX-512) or 256 (AVX2 + FMA); plain-loop builds are refused (torch is faster)

    @property
    def isa_name(self) -> str:
        """The instruction set the kernels were built for, as doctor, the CLI and the model panel name it."""
        return {512: "AVX-512", 256: "AVX2"}.get(self.isa, f"ISA {self.isa}")


def _openmp_libraries() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line or "libiomp" in line}
    except OSError:
        return set()


def unavailable_reason() -> str | None:
    """Why the kernels are not used (None when they are)."""
    load()
    return _state.get("reason")


def load() -> KernelLibrary | None:
    """The compiled kernels, building them once per source/compiler; None (with unavailable_reason) if not usable."""
    with _lock:
        if "library" in _state:
            return _state["library"]
        _state["library"] = None
        try:
            _state["library"] = _build_and_load()
        except KernelsUnavailable as exc:
            _state["reason"] = str(exc)
        return _state["library"]


class KernelsUnavailable(Exception):
    pass


def _build_and_load() -> KernelLibrary:
    if os.environ.get("DSV41_CPU_KERNELS", "1") == "0":
        raise KernelsUnavailable("turned off by DSV41_CPU_KERNELS=0")
    # DSV41_CPU_KERNEL_FLAGS="-mno-avx512f" runs the process on a variant build (the AVX2 path on an AVX-512
    # machine, as the tests build it): for measuring what another CPU's path does, never needed otherwise
    return build(tuple(os.environ.get("DSV41_CPU_KERNEL_FLAGS", "").split()))


# How the Q4_0 / Q4_1 products can take x, by dsv41_gguf_x_mode's numbers (engine.kernels.gguf_blocks.x_mode)
X_MODES = ("float32", "int8", "bf16", "int16")


def _compile(compiler: str, flags: list[str], folder: Path, target: Path) -> None:
    """Compile the kernels into `target` in `folder` (atomically); OSError when the folder cannot take it."""
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f".build-{os.getpid()}-{threading.get_ident()}.so"
    done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(scratch), "-lm"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        scratch.unlink(missing_ok=True)
        if not os.access(folder, os.W_OK) or "No space left" in done.stderr or "Read-only" in done.stderr:
            raise OSError(done.stderr.strip()[-400:] or f"{folder} is not writable")
        raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-400:]}")
    os.replace(scratch, target)


def build(extra_flags: tuple[str, ...] = ()) -> KernelLibrary:
    """Compile (once, cached) and load the kernels; `extra_flags` make a variant build, e.g. ("-mno-avx512f",)
    for the AVX2 path on an AVX-512 machine (the tests check both). Raises KernelsUnavailable."""
    if not sys.platform.startswith("linux"):
        raise KernelsUnavailable(f"built on Linux only (this is {sys.platform})")
    if torch.backends.openmp.is_available() is False:
        raise KernelsUnavailable("torch is built without OpenMP")
    compiler = c_compiler()
    if compiler is None:
        raise KernelsUnavailable("no C compiler found (install gcc to enable the bf16 CPU kernels)")
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *extra_flags]
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode() + os.uname().machine.encode()).hexdigest()[:16]
    folder = user_cache_dir() / "kernels"
    target = folder / f"cpu_kernels-{key}.so"
    scratch_dir = None
    if not target.exists():
        try:
            _compile(compiler, flags, folder, target)
        except OSError:  # a read-only or full cache folder: build this process's copy in a temporary folder
            import tempfile

            try:
                scratch_dir = Path(tempfile.mkdtemp(prefix="dsv41-kernels-"))
                target = scratch_dir / target.name
                _compile(compiler, flags, scratch_dir, target)
            except OSError as exc:
                raise KernelsUnavailable(f"no folder to build the kernels in ({folder}: {exc})") from exc
    before = _openmp_libraries()
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelsUnavailable(f"loading the kernels failed: {exc}") from exc
    finally:
        if scratch_dir is not None:  # loaded (mapped) or not, the temporary copy is not needed again
            shutil.rmtree(scratch_dir, ignore_errors=True)
    after = _openmp_libraries()
    if before and after != before:
        # A second OpenMP runtime would spin its own threads against torch's on the same cores.
        raise KernelsUnavailable("the kernels did not bind to torch's OpenMP runtime")
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dsv41_kernels_isa.restype = cint
    lib.dsv41_mv_bf16.argtypes = [ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_bf16.restype = cint
    lib.dsv41_mv_int8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_f32.argtypes = [ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_f32.restype = None
    lib.dsv41_mv_int8.restype = None
    lib.dsv41_gguf_dequant.argtypes = [i64, ptr, ptr, i64, i64, cint]
    lib.dsv41_gguf_dequant.restype = cint
    lib.dsv41_gguf_dequant_bf16.argtypes = [i64, ptr, ptr, i64, i64, cint]
    lib.dsv41_gguf_dequant_bf16.restype = cint
    lib.dsv41_gguf_mm_bf16.argtypes = [i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, cint]
    lib.dsv41_gguf_mm_bf16.restype = cint
    lib.dsv41_gguf_split.argtypes = [i64, ptr, i64, i64, cint]
    lib.dsv41_gguf_split.restype = cint
    lib.dsv41_gguf_splittable.argtypes = [i64]
    lib.dsv41_gguf_splittable.restype = cint
    lib.dsv41_mv_gguf.argtypes = [i64, ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_gguf.restype = cint
    lib.dsv41_gguf_x_mode.argtypes = [cint]
    lib.dsv41_gguf_x_mode.restype = cint
    lib.dsv41_gguf_x_modes.argtypes = []
    lib.dsv41_gguf_x_modes.restype = cint
    lib.dsv41_rows_take.argtypes = [i64, i64, i64, i64, ptr, cint, ptr, ptr, ptr]
    lib.dsv41_rows_take.restype = cint
    lib.dsv41_rows_keep.argtypes = [i64, i64, i64, i64, ptr, cint, ptr, ptr, cint]
    lib.dsv41_rows_keep.restype = cint
    lib.dsv41_cold_add.argtypes = [i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint, i64, i64, ptr, ptr, ptr,
                                   ptr, ptr, ptr, cint, cint]
    lib.dsv41_cold_add.restype = cint
    lib.dsv41_rows_insert.argtypes = [i64, i64, i64, i64, ptr, ptr, cint, ptr, ptr, ptr]
    lib.dsv41_rows_insert.restype = cint
    lib.dsv41_recall_move.argtypes = [i64, i64, i64, i64, i64, ptr, ptr, cint, i64, i64, cint, ptr, ptr, cint]
    lib.dsv41_recall_move.restype = cint
    lib.dsv41_recall_softmax.argtypes = [i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, cint]
    lib.dsv41_recall_softmax.restype = cint
    lib.dsv41_recall_mass.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, cint, i64, ptr, i64, i64, ptr,
                                      cint, i64, ptr, i64, ptr, ptr, cint]
    lib.dsv41_recall_mass.restype = cint
    lib.dsv41_question_attention.argtypes = [i64, i64, i64, i64, ptr, i64, ptr, ptr, cint, i64, ptr, i64, i64, ptr,
                                             i64, ptr, ptr, i64, ptr, ptr, cint]
    lib.dsv41_question_attention.restype = cint
    lib.dsv41_recall_select.argtypes = [i64, i64, ptr, i64, ptr, i64, i64, ptr]
    lib.dsv41_recall_select.restype = cint
    lib.dsv41_cold_counts.argtypes = [i64, i64, i64, ptr, cint, i64, i64, ptr, cint, i64, ptr, ptr, i64, i64, ptr,
                                      cint]
    lib.dsv41_cold_counts.restype = cint
    lib.dsv41_lsh_tally.argtypes = [i64, i64, i64, i64, ptr, ptr, cint, i64, ptr, i64, i64, cint, ptr, cint]
    lib.dsv41_lsh_tally.restype = cint
    # how the Q4 products take x (gguf_blocks.x_mode): DSV41_GGUF_X=float32|int8|bf16|int16, DSV41_GGUF_INT8_X=1 for int8
    wanted = os.environ.get("DSV41_GGUF_X") or ("int8" if os.environ.get("DSV41_GGUF_INT8_X") == "1" else None)
    if wanted is not None:
        if wanted not in X_MODES or lib.dsv41_gguf_x_mode(X_MODES.index(wanted)) < 0:  # the default stays
            have = [m for i, m in enumerate(X_MODES) if lib.dsv41_gguf_x_modes() >> i & 1]
            logging.getLogger(__name__).warning(
                "DSV41_GGUF_X=%s is not a way this CPU's Q4 products can take x (%s); keeping %s", wanted,
                ", ".join(have), X_MODES[lib.dsv41_gguf_x_mode(-1)])
    _bind_step(lib)
    isa = lib.dsv41_kernels_isa()
    if isa == 0:
        raise KernelsUnavailable("this CPU has neither AVX-512 nor AVX2+FMA; torch's path is faster")
    return KernelLibrary(lib, target, isa)


# The fused decode step's entry points (engine.kernels.fused builds the structures they take).
ATTEND_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)


def _bind_step(lib: ctypes.CDLL) -> None:
    ptr, i64, cint, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.dsv41_step_work_floats.argtypes = [ptr, i64]
    lib.dsv41_step_work_floats.restype = i64
    lib.dsv41_decode_step.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int32, ptr, ptr, cint, f32, ptr, ptr, i64,
                                      ATTEND_CALLBACK, cint]
    lib.dsv41_decode_step.restype = cint
    lib.dsv41_step_matrices.argtypes = [ptr, ptr, ptr, ptr, cint]
    lib.dsv41_step_matrices.restype = cint
    lib.dsv41_step_read.argtypes = [ptr, ptr, cint]
    lib.dsv41_step_read.restype = ctypes.c_uint64
    lib.dsv41_q4_read_pattern.argtypes = [i64, ptr, i64, i64, cint, cint]
    lib.dsv41_q4_read_pattern.restype = ctypes.c_uint64
    lib.dsv41_step_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, cint, f32, cint]
    lib.dsv41_step_attention.restype = cint
    lib.dsv41_sample_head.argtypes = [ptr, i64, ptr, i64, f32, i64, f32, f32, ctypes.c_double]
    lib.dsv41_sample_head.restype = i64
