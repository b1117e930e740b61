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
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_lock = threading.Lock()
_state: dict = {}


@dataclass(frozen=True)
class KernelLibrary:
    lib: ctypes.CDLL
    path: Path
    isa: int  # 512 (AVX-512) or 256 (AVX2 + FMA); plain-loop builds are refused (torch is faster)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


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
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> KernelLibrary:
    """Compile (once, cached) and load the kernels; `extra_flags` make a variant build, e.g. ("-mno-avx512f",)
    for the AVX2 path on an AVX-512 machine (the tests check both). Raises KernelsUnavailable."""
    if not sys.platform.startswith("linux"):
        raise KernelsUnavailable(f"built on Linux only (this is {sys.platform})")
    if torch.backends.openmp.is_available() is False:
        raise KernelsUnavailable("torch is built without OpenMP")
    compiler = _compiler()
    if compiler is None:
        raise KernelsUnavailable("no C compiler found (install gcc to enable the bf16 CPU kernels)")
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *extra_flags]
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode() + os.uname().machine.encode()).hexdigest()[:16]
    from .loader import user_cache_dir

    folder = user_cache_dir() / "kernels"
    target = folder / f"cpu_kernels-{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / f".build-{os.getpid()}-{threading.get_ident()}.so"
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(scratch), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            scratch.unlink(missing_ok=True)
            raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-400:]}")
        os.replace(scratch, target)
    before = _openmp_libraries()
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelsUnavailable(f"loading the kernels failed: {exc}") from exc
    after = _openmp_libraries()
    if before and after != before:
        # A second OpenMP runtime would spin its own threads against torch's on the same cores.
        raise KernelsUnavailable("the kernels did not bind to torch's OpenMP runtime")
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dsv41_kernels_isa.restype = cint
    lib.dsv41_mv_bf16.argtypes = [ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_bf16.restype = None
    lib.dsv41_mv_int8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_f32.argtypes = [ptr, ptr, ptr, i64, i64, cint, cint]
    lib.dsv41_mv_f32.restype = None
    lib.dsv41_mv_int8.restype = None
    _bind_step(lib)
    isa = lib.dsv41_kernels_isa()
    if isa == 0:
        raise KernelsUnavailable("this CPU has neither AVX-512 nor AVX2+FMA; torch's path is faster")
    return KernelLibrary(lib, target, isa)


class PackedMatrix:
    """A weight matrix [out, in] held as bf16 (or int8 + a float32 scale per row) for the CPU kernels.

    `linear(x)` for one row of float32 activations runs the kernel (float32 accumulation); more rows (a
    prefill chunk) widen the weights to float32 for one GEMM, or with `bf16_rows` multiply the rows rounded
    to bf16 by the bf16 weights (accumulated in float32, the result rounded to bf16: 1.8x faster prefill on a
    CPU with AMX, +0.1 % perplexity on the default model; adapter.set_prefill_bf16 decides). All give float32 results whatever the
    stored format; other activation dtypes are converted in and out.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, library: KernelLibrary | None = None):
        if data.dim() != 2 or not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("PackedMatrix needs a contiguous 2-D CPU tensor")
        if scale is None and data.dtype != torch.bfloat16:
            raise ValueError("PackedMatrix stores bf16, or int8 with a scale per row")
        if scale is not None and (data.dtype != torch.int8 or scale.shape != (data.shape[0],)):
            raise ValueError("an int8 PackedMatrix needs one float32 scale per row")
        self.data = data
        self.scale = scale.float().contiguous() if scale is not None else None
        self.bf16_rows = False
        self.shape = data.shape
        library = library or load()
        if library is None:
            raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
        self._lib = library.lib

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (self.scale.numel() * 4 if self.scale is not None else 0)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.scale is None:
            return self.data.to(dtype)
        return (self.data.to(torch.float32) * self.scale[:, None]).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Selected rows widened (an embedding lookup)."""
        picked = self.data[index].to(torch.float32)
        if self.scale is not None:
            picked = picked * self.scale[index][:, None]
        return picked.to(dtype)

    def matvec(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [in] float32 contiguous -> out [out] float32 (out += W x when accumulate)."""
        rows, cols = self.shape
        if out is None:
            out = torch.empty(rows, dtype=torch.float32)
        threads = torch.get_num_threads()
        if self.scale is None:
            self._lib.dsv41_mv_bf16(self.data.data_ptr(), x.data_ptr(), out.data_ptr(), rows, cols, int(accumulate),
                                    threads)
        else:
            self._lib.dsv41_mv_int8(self.data.data_ptr(), self.scale.data_ptr(), x.data_ptr(), out.data_ptr(), rows,
                                    cols, int(accumulate), threads)
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) x [T, in] @ W^T (+ bias) -> [T, out] in x's dtype."""
        dtype = x.dtype
        if x.shape[0] == 1:
            native = dtype == torch.float32
            vector = x.view(-1) if native and x.is_contiguous() else x[0].to(torch.float32).contiguous()
            if residual is not None:
                out = residual.reshape(-1).clone() if native else residual[0].to(torch.float32, copy=True)
                self.matvec(vector, out, accumulate=True)
            else:
                out = self.matvec(vector)
            if bias is not None:
                out += bias if native else bias.float()
            return out.view(1, -1) if native else out.to(dtype)[None]
        if self.bf16_rows and self.scale is None and dtype == torch.float32:
            # bf16 x bf16 products with float32 accumulation (AMX / AVX-512 BF16 in oneDNN); torch returns the
            # result rounded to bf16. The weights are bf16 already: the activations and the products' results
            # are what is rounded; bias, residual and everything after stay float32
            out = torch.nn.functional.linear(x.to(torch.bfloat16), self.data).float()
            if bias is not None:
                out += bias
            return out if residual is None else residual + out
        weight = self.dense(dtype)
        if residual is not None and bias is None:
            return torch.addmm(residual, x, weight.t())
        out = torch.nn.functional.linear(x, weight, bias)
        return out if residual is None else residual + out


def bf16_exact(tensor: torch.Tensor) -> bool:
    """True when every value of a float32 tensor is a bf16 value (storing it in bf16 loses nothing)."""
    if tensor.dtype == torch.bfloat16:
        return True
    if tensor.dtype != torch.float32:
        return False
    bits = tensor.detach().contiguous().view(torch.int32)
    return not bool((bits & 0xFFFF).any())


# ------------------------------------------------------------------------------------------ fused decode step
class _StepLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up", "down",
        "qkv_scale", "o_scale", "gate_up_scale", "down_scale", "qkv_bias", "o_bias")]


class _StepCache(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("scores", ctypes.c_void_p), ("log_counts", ctypes.c_void_p), ("length", ctypes.c_int64),
                ("capacity", ctypes.c_int64), ("by_callback", ctypes.c_int64)]


class _StepModel(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                                     "layers", "kv_bf16", "weight_format")] + [
        ("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("final_norm", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p), ("lm_head_scale", ctypes.c_void_p), ("lm_head_bias", ctypes.c_void_p)]


_ATTEND_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)


def _bind_step(lib: ctypes.CDLL) -> None:
    ptr, i64, cint, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.dsv41_step_work_floats.argtypes = [ptr, i64]
    lib.dsv41_step_work_floats.restype = i64
    lib.dsv41_decode_step.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int32, ptr, ptr, cint, f32, ptr, ptr, i64,
                                      _ATTEND_CALLBACK, cint]
    lib.dsv41_decode_step.restype = cint
    lib.dsv41_step_matrices.argtypes = [ptr, ptr, ptr, ptr, cint]
    lib.dsv41_step_matrices.restype = None


def _float_vector(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A norm weight or bias as a contiguous float32 vector (a float32 copy of a bf16 one: it is small)."""
    if t is None:
        return None
    if t.dtype not in (torch.float32, torch.bfloat16) or t.shape != (n,) or t.device.type != "cpu":
        raise _NotFusable("a norm or bias is not a float32/bf16 CPU vector")
    return t.detach().to(torch.float32).contiguous()


class _NotFusable(Exception):
    pass


def _weight_format(m) -> int:
    """cpu_kernels.c's StepModel.weight_format of a decoder matrix: 0 bf16, 1 int8, 2 float32."""
    if isinstance(m, PackedMatrix):
        return 1 if m.scale is not None else 0
    if isinstance(m, torch.Tensor) and m.dim() == 2 and m.is_contiguous() and m.device.type == "cpu":
        if m.dtype == torch.float32:
            return 2
        if m.dtype == torch.bfloat16:
            return 0
    raise _NotFusable("a matrix the kernels cannot read (not packed, float32 or bf16 on the CPU)")


class FusedDecodeStep:
    """One decode step of the whole decoder in one call to cpu_kernels.c (dsv41_decode_step).

    Built from engine.cache.decoder's weights when they fit: every matrix in one format (packed bf16 or int8,
    or plain float32 / bf16 tensors: dtype="float32" gets the fused step too), SiLU gating.
    The step computes in float32; a bf16 model (dtype="bfloat16") keeps its KV cache in bf16 (read widened,
    written rounded) and gets float32 logits. The cache side (which layers, when) is DSV41Cache.fused_plan's. `build`
    returns None when the weights do not fit or DSV41_FUSED_STEP=0, and the per-op Python step runs.
    """

    def __init__(self, weights, library: KernelLibrary):
        w = weights
        self._lib = library.lib
        layers = w.layers
        first = layers[0]
        if w.act_name != "silu":
            raise _NotFusable(f"activation {w.act_name!r} (only SiLU is fused)")
        hidden, d, heads, kv_heads = first.o.shape[0], w.head_dim, w.heads, w.kv_heads
        if d > 256 or heads % kv_heads or heads // kv_heads > 64:
            raise _NotFusable("head geometry outside the kernel's limits (head_dim <= 256, groups <= 64)")
        inter = first.down.shape[1]
        fmt = _weight_format(w.lm_head)
        self._keep = []  # everything a pointer below refers to

        def matrix(m, rows, cols):
            if _weight_format(m) != fmt or tuple(m.shape) != (rows, cols):
                raise _NotFusable("a matrix is not held like the others")
            self._keep.append(m)
            if isinstance(m, PackedMatrix):
                return m.data.data_ptr(), (m.scale.data_ptr() if m.scale is not None else None)
            return m.data_ptr(), None

        def vec(t, n):
            t = _float_vector(t, n)
            if t is None:
                return None
            self._keep.append(t)
            return t.data_ptr()

        self._layers = (_StepLayer * len(layers))()
        for spec, layer in zip(self._layers, layers, strict=True):
            spec.input_norm, spec.post_norm = vec(layer.input_norm, hidden), vec(layer.post_norm, hidden)
            spec.q_norm, spec.k_norm = vec(layer.q_norm, d), vec(layer.k_norm, d)
            if spec.input_norm is None or spec.post_norm is None:
                raise _NotFusable("missing norm")
            spec.qkv, spec.qkv_scale = matrix(layer.qkv, (heads + 2 * kv_heads) * d, hidden)
            spec.o, spec.o_scale = matrix(layer.o, hidden, heads * d)
            spec.gate_up, spec.gate_up_scale = matrix(layer.gate_up, 2 * inter, hidden)
            spec.down, spec.down_scale = matrix(layer.down, hidden, inter)
            spec.qkv_bias = vec(layer.qkv_bias, (heads + 2 * kv_heads) * d)
            spec.o_bias = vec(layer.o_bias, hidden)
        vocab = w.lm_head.shape[0]
        model = _StepModel(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=d, inter=inter, vocab=vocab,
                           layers=len(layers), weight_format=fmt, eps=float(w.eps), scaling=float(w.scaling))
        model.final_norm = vec(w.final_norm, hidden)
        model.lm_head, model.lm_head_scale = matrix(w.lm_head, vocab, hidden)
        model.lm_head_bias = vec(w.lm_head_bias, vocab)
        self._model = model
        self._caches = (_StepCache * len(layers))()
        self._cache_key: list = [None] * len(layers)
        self._work = torch.empty(0)
        self.vocab, self.hidden = vocab, hidden
        self._qkv_size = (heads + 2 * kv_heads) * d
        self._call: dict = {}  # the step in progress, for the callback
        self._callback = _ATTEND_CALLBACK(self._attend_in_python)  # kept alive as long as self

    @classmethod
    def build(cls, weights) -> FusedDecodeStep | None:
        if os.environ.get("DSV41_FUSED_STEP", "1") == "0":
            return None
        library = load()
        if library is None or not weights.layers:
            return None
        try:
            return cls(weights, library)
        except _NotFusable:
            return None

    def _refresh(self, index: int, layer) -> None:
        """Point descriptor `index` at a LayerKV's storage (again, after it was reallocated)."""
        spec = self._caches[index]
        spec.keys, spec.values = layer.keys.data_ptr(), layer.values.data_ptr()
        spec.positions, spec.scores = layer.positions.data_ptr(), layer.scores.data_ptr()
        spec.log_counts = layer.log_counts.data_ptr() if layer.merged_any else None
        spec.capacity = layer.capacity
        self._cache_key[index] = (layer.storage_version, layer.merged_any)

    def step(self, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, cache, by_python: list[bool],
             *, score: bool, decay: float) -> torch.Tensor:
        """x [hidden] float32 (the token's embedding); cos/sin [head_dim] float32 at `position`; `cache` a
        DSV41Cache inside a one-token forward, whose layers marked in `by_python` are appended to and attended
        by its own `attend` (called back from C), the others here (float32 or bf16 storage, each with room for
        one more entry; see DSV41Cache.fused_plan). Every layer gains the token; returns logits [vocab] float32."""
        layers = cache.layers
        self._model.kv_bf16 = int(layers[0].dtype == torch.bfloat16)
        most = 0
        for index, layer in enumerate(layers):
            spec = self._caches[index]
            spec.by_callback = int(by_python[index])
            if by_python[index]:
                continue
            if self._cache_key[index] != (layer.storage_version, layer.merged_any):
                self._refresh(index, layer)
            spec.length = layer.length
            most = max(most, layer.length + 1)
        needed = self._lib.dsv41_step_work_floats(ctypes.byref(self._model), most)
        if self._work.numel() < needed:
            self._work = torch.empty(needed + needed // 4, dtype=torch.float32)
        logits = torch.empty(self.vocab, dtype=torch.float32)
        self._call = {"cache": cache, "error": None}
        try:
            status = self._lib.dsv41_decode_step(
                ctypes.byref(self._model), self._layers, self._caches, x.data_ptr(), position, cos.data_ptr(),
                sin.data_ptr(), int(score), float(decay), logits.data_ptr(), self._work.data_ptr(),
                self._work.numel(), self._callback, torch.get_num_threads())
            error = self._call["error"]
        finally:
            self._call = {}
        if status != 0:
            for index, layer in enumerate(layers):  # an entry written past `length` must leave no score behind
                if not by_python[index] and layer.length < layer.capacity:
                    layer.scores[:, layer.length] = 0.0
            if error is not None:
                raise error
            raise RuntimeError(f"fused decode step failed ({status}): a layer had no room for its entry")
        for index, layer in enumerate(layers):
            if not by_python[index]:
                layer.length += 1
        return logits

    def matrices_seconds(self, reps: int = 5) -> float:
        """Median time of every matrix-vector product of one step and nothing else (dsv41_step_matrices)."""
        import statistics
        import time

        work = torch.full((self._lib.dsv41_step_work_floats(ctypes.byref(self._model), 1),), 0.01)
        logits = torch.empty(self.vocab)
        args = (ctypes.byref(self._model), self._layers, logits.data_ptr(), work.data_ptr(), torch.get_num_threads())
        self._lib.dsv41_step_matrices(*args)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            self._lib.dsv41_step_matrices(*args)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def _attend_in_python(self, index: int) -> int:
        """Called from C for a layer marked by_python: the cache's own append + attention on the q, k, v the
        step left in the work buffer; the output goes where the step reads it. Errors are kept for step()
        to raise (an exception must not cross the C frames)."""
        try:
            hidden, d = self.hidden, self._model.head_dim
            heads, kv_heads = self._model.heads, self._model.kv_heads
            qkv = self._work[2 * hidden: 2 * hidden + self._qkv_size]
            q = qkv[: heads * d].view(1, heads, 1, d)
            k = qkv[heads * d: (heads + kv_heads) * d].view(1, kv_heads, 1, d)
            v = qkv[(heads + kv_heads) * d:].view(1, kv_heads, 1, d)
            cache = self._call["cache"]
            dtype = cache.dtype
            out = cache.attend(int(index), q.to(dtype), k.to(dtype), v.to(dtype), float(self._model.scaling))
            start = 2 * hidden + self._qkv_size
            self._work[start: start + heads * d].copy_(out.reshape(-1))
            return 0
        except BaseException as exc:  # noqa: BLE001 - handed to step(), raised there
            self._call["error"] = exc
            return 1
