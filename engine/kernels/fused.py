"""FusedDecodeStep: one decode step of the whole decoder in one call to cpu_kernels.c."""

from __future__ import annotations

import ctypes
import os

import torch

from .gguf_blocks import GGUFWeight, x_mode
from .library import ATTEND_CALLBACK, KernelLibrary, load, unavailable_reason
from .packed import PackedMatrix

MAT_PARTS = 3  # cpu_kernels.c's Mat: up to three stacked groups of rows, each in its own format
MAT_BF16, MAT_INT8, MAT_F32, MAT_GGUF = 0, 1, 2, 3


class _MatPart(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("format", ctypes.c_int64),
                ("gguf_type", ctypes.c_int64), ("rows", ctypes.c_int64)]


class _Mat(ctypes.Structure):
    _fields_ = [("part", _MatPart * MAT_PARTS), ("parts", ctypes.c_int64)]


class _StepLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "q_norm", "k_norm")] + [
        (name, _Mat) for name in ("qkv", "o", "gate_up", "down")] + [
        ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p)]


class _StepCache(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("scores", ctypes.c_void_p), ("log_counts", ctypes.c_void_p), ("length", ctypes.c_int64),
                ("capacity", ctypes.c_int64), ("by_callback", ctypes.c_int64)]


class _StepModel(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                                     "layers", "kv_bf16")] + [
        ("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("final_norm", ctypes.c_void_p), ("lm_head", _Mat),
        ("lm_head_bias", ctypes.c_void_p)]


def _float_vector(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A norm weight or bias as a contiguous float32 vector (a float32 copy of a bf16 one: it is small)."""
    if t is None:
        return None
    if t.dtype not in (torch.float32, torch.bfloat16) or t.shape != (n,) or t.device.type != "cpu":
        raise _NotFusable("a norm or bias is not a float32/bf16 CPU vector")
    return t.detach().to(torch.float32).contiguous()


class _NotFusable(Exception):
    pass


def step_library(device, dtype: torch.dtype) -> tuple[KernelLibrary | None, str]:
    """Whether decode steps of weights on `device` computing in `dtype` run as the fused C call on this machine:
    (the kernels it runs on, "") or (None, why the per-op step runs instead). The machine's part of
    FusedDecodeStep.build's decision (the weights' part: whether the kernels can read them); `python -m engine
    doctor` asks it too. Nothing is compiled for a GPU."""
    if torch.device(device).type != "cpu":
        return None, "weights on a GPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"no fused step computes in {str(dtype).replace('torch.', '')}"
    if os.environ.get("DSV41_FUSED_STEP", "1") == "0":
        return None, "fused decode step off: DSV41_FUSED_STEP=0"
    library = load()
    if library is None:
        return None, f"no CPU kernels: {unavailable_reason() or 'unavailable'}"
    return library, ""


def describe_step(library: KernelLibrary, gguf: bool = True) -> str:
    """The fused step as the model panel, the CLI and doctor name it: its kernels' ISA variant and, for weights held as
    GGUF blocks, how the Q4 products take x (gguf_blocks.x_mode), e.g. "fused C step (AVX-512, Q4 x int16)"."""
    isa = library.isa_name
    return f"fused C step ({isa}, Q4 x {x_mode(library=library)})" if gguf else f"fused C step ({isa})"


def _parts(m) -> list[tuple[int, int, int, object, object]]:
    """cpu_kernels.c's MatParts of a decoder matrix: (format, gguf type, rows, data tensor, scale tensor or None)."""
    if isinstance(m, GGUFWeight):
        return [(MAT_GGUF, p.kernel_type, p.rows, p.data, None) for p in m.runs]
    if isinstance(m, PackedMatrix):
        return [(MAT_INT8 if m.scale is not None else MAT_BF16, 0, m.shape[0], m.data, m.scale)]
    if isinstance(m, torch.Tensor) and m.dim() == 2 and m.is_contiguous() and m.device.type == "cpu":
        if m.dtype == torch.float32:
            return [(MAT_F32, 0, m.shape[0], m, None)]
        if m.dtype == torch.bfloat16:
            return [(MAT_BF16, 0, m.shape[0], m, None)]
    raise _NotFusable("a matrix the kernels cannot read (not packed, GGUF blocks, float32 or bf16 on the CPU)")


class FusedDecodeStep:
    """One decode step of the whole decoder in one call to cpu_kernels.c (dsv41_decode_step).

    Built from engine.models.decoder's weights when they fit: each matrix packed bf16 or int8, GGUF blocks (one
    format per stacked part: a GGUF file's q, k and v may differ), or a plain float32 / bf16 tensor
    (dtype="float32" gets the fused step too); SiLU gating.
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
        self._keep = []  # everything a pointer below refers to

        def matrix(m, rows, cols) -> _Mat:
            parts = _parts(m)
            if tuple(m.shape) != (rows, cols) or len(parts) > MAT_PARTS:
                raise _NotFusable("a matrix is not of the shape the step multiplies")
            spec = _Mat(parts=len(parts))
            for i, (fmt, gguf_type, n, data, scale) in enumerate(parts):
                self._keep.extend((data, scale))
                spec.part[i] = _MatPart(data.data_ptr(), scale.data_ptr() if scale is not None else None, fmt,
                                        gguf_type, n)
            return spec

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
            spec.qkv = matrix(layer.qkv, (heads + 2 * kv_heads) * d, hidden)
            spec.o = matrix(layer.o, hidden, heads * d)
            spec.gate_up = matrix(layer.gate_up, 2 * inter, hidden)
            spec.down = matrix(layer.down, hidden, inter)
            spec.qkv_bias = vec(layer.qkv_bias, (heads + 2 * kv_heads) * d)
            spec.o_bias = vec(layer.o_bias, hidden)
        vocab = w.lm_head.shape[0]
        model = _StepModel(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=d, inter=inter, vocab=vocab,
                           layers=len(layers), eps=float(w.eps), scaling=float(w.scaling))
        model.final_norm = vec(w.final_norm, hidden)
        if model.final_norm is None:
            raise _NotFusable("missing final norm")
        model.lm_head = matrix(w.lm_head, vocab, hidden)
        model.lm_head_bias = vec(w.lm_head_bias, vocab)
        self._model = model
        self._caches = (_StepCache * len(layers))()
        self._specs = list(self._caches)  # each a view of its element (indexing the array makes a new one each time)
        self._work_entries = -1  # the most entries per layer self._work has room for (-1: none yet)
        self._cache_key: list = [None] * len(layers)
        self._work = torch.empty(0)
        self.vocab, self.hidden = vocab, hidden
        self._qkv_size = (heads + 2 * kv_heads) * d
        self._call: dict = {}  # the step in progress, for the callback
        self._callback = ATTEND_CALLBACK(self._attend_in_python)  # kept alive as long as self
        self.library = library
        self.gguf = any(isinstance(m, GGUFWeight) for m in (w.lm_head, *(m for layer in layers for m in (
            layer.qkv, layer.o, layer.gate_up, layer.down))))

    @classmethod
    def build(cls, weights) -> FusedDecodeStep | None:
        """The step for these weights, or None where the per-op step runs (step_library says no, or the kernels
        cannot read them)."""
        library, _ = step_library(weights.final_norm.device, weights.final_norm.dtype)
        if library is None or not weights.layers:
            return None
        try:
            return cls(weights, library)
        except _NotFusable:
            return None

    def _refresh(self, index: int, layer) -> None:
        """Point descriptor `index` at a LayerKV's storage (again, after it was reallocated)."""
        m = self._model
        shape = (m.kv_heads, layer.capacity, m.head_dim)
        if (layer.int8 or layer.keys.shape != shape or layer.values.shape != shape
                or layer.values.dtype != layer.keys.dtype
                or layer.keys.dtype != (torch.bfloat16 if m.kv_bf16 else torch.float32)
                or layer.positions.dtype != torch.int32 or layer.scores.dtype != torch.float32
                or any(t.device.type != "cpu" or not t.is_contiguous() or t.shape[:2] != shape[:2]
                       for t in (layer.keys, layer.values, layer.positions, layer.scores, layer.log_counts))):
            # the C step writes the token's entry at (head, length) of [kv_heads, capacity, head_dim] storage
            raise ValueError(f"layer {index}'s cache storage is not what the fused step writes into")
        spec = self._caches[index]
        spec.keys, spec.values = layer.keys.data_ptr(), layer.values.data_ptr()
        spec.positions, spec.scores = layer.positions.data_ptr(), layer.scores.data_ptr()
        spec.log_counts = layer.log_counts.data_ptr() if layer.merged_any else None
        spec.capacity = layer.capacity
        self._cache_key[index] = (layer.storage_version, layer.merged_any)

    def describe(self) -> str:
        return describe_step(self.library, self.gguf)

    def step(self, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, cache, by_python: list[bool],
             *, score: bool, decay: float) -> torch.Tensor:
        """x [hidden] float32 (the token's embedding); cos/sin [head_dim] float32 at `position`; `cache` a
        DSV41Cache inside a one-token forward, whose layers marked in `by_python` are appended to and attended
        by its own `attend` (called back from C), the others here (float32 or bf16 storage, each with room for
        one more entry; see DSV41Cache.fused_plan). Every layer gains the token; returns logits [vocab] float32."""
        layers = cache.layers
        if len(layers) != len(self._cache_key) or len(by_python) != len(layers):
            raise ValueError(f"the fused step has {len(self._cache_key)} layers; the cache {len(layers)}")
        if (any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in (x, cos, sin))
                or x.numel() != self.hidden or min(cos.numel(), sin.numel()) < self._model.head_dim // 2):
            raise ValueError(f"the fused step takes float32 CPU vectors x [{self.hidden}] and cos / sin "
                             f"[{self._model.head_dim}]")
        kv_bf16 = int(layers[0].dtype == torch.bfloat16)
        if kv_bf16 != self._model.kv_bf16:  # every descriptor is pointed again with the new storage type
            self._cache_key = [None] * len(layers)
        self._model.kv_bf16 = kv_bf16
        most = 0
        keys = self._cache_key
        for index, (spec, layer, python) in enumerate(zip(self._specs, layers, by_python, strict=True)):
            spec.by_callback = int(python)
            if python:
                continue
            if keys[index] != (layer.storage_version, layer.merged_any):
                self._refresh(index, layer)
            length = spec.length = layer.length
            if length >= most:
                most = length + 1
        if most > self._work_entries:  # (the floats a step needs grow with its longest layer)
            needed = self._lib.dsv41_step_work_floats(ctypes.byref(self._model), most)
            if self._work.numel() < needed:
                self._work = torch.empty(needed + needed // 4, dtype=torch.float32)
            self._work_entries = most
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
            if status == -4:
                raise MemoryError("out of memory in the decode step: a product found no memory for its scratch; "
                                  "close other programs or load a smaller model")
            raise RuntimeError(f"fused decode step failed ({status}): a layer had no room for its entry")
        for index, layer in enumerate(layers):
            if not by_python[index]:
                layer.length += 1
        return logits

    def matrices_seconds(self, reps: int = 5) -> float:
        """Median time of every matrix-vector product of one step and nothing else (dsv41_step_matrices)."""
        work = torch.full((self._lib.dsv41_step_work_floats(ctypes.byref(self._model), 1),), 0.01)
        logits = torch.empty(self.vocab)
        args = (ctypes.byref(self._model), self._layers, logits.data_ptr(), work.data_ptr(), torch.get_num_threads())
        if self._lib.dsv41_step_matrices(*args) != 0:
            raise MemoryError("the step's products found no memory for their scratch")
        return _median_seconds(self._lib.dsv41_step_matrices, args, reps)

    def read_args(self) -> tuple:
        """dsv41_step_read's arguments for this step's matrices (every byte of them read once, nothing else)."""
        return ctypes.byref(self._model), self._layers, torch.get_num_threads()

    def read_seconds(self, reps: int = 11) -> float:
        """Median time of reading every byte of one step's matrices and nothing else (dsv41_step_read): the bandwidth
        bound for those bytes, measured on the pages they sit on."""
        args = self.read_args()
        self._lib.dsv41_step_read(*args)
        return _median_seconds(self._lib.dsv41_step_read, args, reps)

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


def _median_seconds(call, args: tuple, reps: int) -> float:
    """Median wall time of `reps` calls of call(*args) (after whatever warm-up the caller did)."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
