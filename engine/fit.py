"""Will a model fit this machine? An estimate before download or load: weights + KV cache at the chosen context and
ratio + working memory, against the free memory of the device (VRAM) or of the machine (RAM).

Torch-free (the GUI asks it on its own thread). The parts:
- weights: the checkpoint's bytes as the engine will hold them. A bf16 / fp16 safetensors checkpoint is held as it
  is (on a CPU too: our kernels read bf16), a float32 one as bf16 on a GPU or where the CPU path holds it so;
  INT8 halves a 16-bit checkpoint, INT4 (NF4) a quarter plus its scales; a GGUF whose type the CPU kernels hold
  (HELD_GGUF) is held on a CPU as the file's blocks (its size), any other GGUF converted to bf16 at its parameter
  count (estimated from the file's size and its quantization type, named in the file name).
- KV: the model's own geometry (layers x 2 x KV heads x head dim x bytes) x the tokens the cache keeps at that
  context: the ratio's budget (engine.cache.budget.budget_for), the floor included.
- working memory: what the engine's process needs beyond weights and KV on a CPU (the Python, torch and
  transformers runtime, the tokenizer, the prefill chunk's activations), or on a GPU (the CUDA context and the
  prefill chunk's activations). Its constants are measured (benchmarks/fit_estimate.py, the default model at
  three contexts against the memory report: the figures are in the README).

A verdict: "fits" when the total is at most 80 % of what is free, "tight" up to 100 %, "will not fit" above.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .cache.budget import MIN_STORED_ENTRIES, budget_for

GB = 1024**3
# bits per weight of GGUF quantization types (llama.cpp's block sizes: scales included)
GGUF_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K": 5.5, "Q5_0": 5.5,
             "Q5_1": 6.0, "Q4_K": 4.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K": 3.44, "Q2_K": 2.63, "IQ4_XS": 4.25}
# working memory (measured: benchmarks/fit_estimate.py)
CPU_RUNTIME_BYTES = int(0.19 * GB)  # what a load adds beyond weights and KV (the tokenizer, modules, heap)
GPU_RUNTIME_BYTES = int(0.45 * GB)  # the CUDA context and cuBLAS workspaces (not measured yet: no GPU lent)
ACTIVATION_FLOATS_PER_TOKEN_HIDDEN = 12  # a prefill chunk's activations: ~12 floats per token per hidden unit
ATTENTION_BYTES_PER_WEIGHT = 8  # a chunk's attention weights over the context (float32, and the scoring's copy)
BOOKKEEPING_BYTES = 12  # per stored entry, KV head and layer: position, CED score, merge count
FITS_SHARE = 0.8


@dataclass(frozen=True)
class FitEstimate:
    weights: int
    kv: int
    working: int
    free: int
    where: str  # "VRAM" or "RAM"

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.working

    @property
    def verdict(self) -> str:
        if self.total <= FITS_SHARE * self.free:
            return "fits"
        return "tight" if self.total <= self.free else "will not fit"

    def describe(self) -> str:
        """'fits: 1.04 GB of 22.10 GB free RAM (weights 257 MB · KV 18 MB · working 785 MB)'."""
        return (f"{self.verdict}: {_gb(self.total)} of {_gb(self.free)} free {self.where} (weights {_gb(self.weights)}"
                f" · KV {_gb(self.kv)} · working {_gb(self.working)})")


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 2**20:.0f} MB"


# the GGUF types the CPU kernels multiply as the file stores them (engine.kernels.gguf_blocks.FORMATS; a k-quant
# mix such as Q4_K_M stores its matrices as Q4_K and Q6_K): on a CPU such a file is held at its own bytes
HELD_GGUF = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def gguf_type(file_name: str) -> str | None:
    """The quantization type a GGUF file name says ('...Q4_K_M.gguf' -> 'Q4_K'), or None."""
    name = file_name.upper()
    for kind in sorted(GGUF_BITS, key=len, reverse=True):
        if re.search(rf"(^|[^A-Z0-9]){re.escape(kind)}", name):
            return kind
    return None


def gguf_bits(file_name: str) -> float:
    """Bits per weight from a GGUF file name's quantization type ('...Q4_K_M.gguf' -> 4.5); 16 when unnamed."""
    kind = gguf_type(file_name)
    return GGUF_BITS[kind] if kind else 16.0


def gguf_parameters(path) -> int | None:
    """The parameter count of a local GGUF file, from its tensor table (engine.gguf_index reads the header alone, in
    milliseconds; None without the gguf package or for a file that does not parse)."""
    try:
        from .errors import ModelLoadError
        from .gguf_index import read_header

        return sum(math.prod(t.shape) for t in read_header(path).tensors.values())
    except (ImportError, OSError, ModelLoadError):
        return None


def weight_bytes(checkpoint_bytes: int, *, kind: str, weight_quant: str = "none", dtype_bytes: int = 2,
                 file_name: str = "", params: int | None = None, device: str = "cpu") -> int:
    """The bytes the engine holds for a checkpoint of `checkpoint_bytes` (kind "safetensors" with weights of
    `dtype_bytes` each, or "gguf"), held as bf16 or quantized to `weight_quant` -- or, a GGUF in a type the CPU
    kernels hold, on a CPU, as the file's own blocks (its bytes). `params`: the parameter count when known (a local
    GGUF's tensor table), else derived from the bytes."""
    if kind == "gguf" and weight_quant == "none" and not device.startswith("cuda") and \
            gguf_type(file_name) in HELD_GGUF:
        return int(checkpoint_bytes)
    if params is None:
        params = checkpoint_bytes * 8 / gguf_bits(file_name) if kind == "gguf" else checkpoint_bytes / dtype_bytes
    held = {"none": 2.0, "int8": 1.0 + 4 / 64, "int4": 0.5 + 4 / 64}[weight_quant]
    return int(params * held)


def kv_bytes(config: dict, tokens: int, *, ratio: float = 1.0, int8: bool = False, element_bytes: int = 2,
             sink: int = 4, recent: int = 32, floor: int = MIN_STORED_ENTRIES, cold_tier: bool = True) -> int:
    """KV bytes a cache holds after `tokens` tokens at `ratio` (config: the model's config.json): the hot set with
    its bookkeeping, and (cold tier on) what left it, kept as int8 with a scale per token and head."""
    layers = int(config.get("num_hidden_layers", 0))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1))
    per = (1 + 4 / max(head_dim, 1)) if int8 else element_bytes
    stored = tokens if ratio >= 1.0 else min(tokens, budget_for(tokens, ratio, sink, recent, floor))
    hot = layers * kv_heads * (2 * head_dim * per + BOOKKEEPING_BYTES) * stored
    cold = layers * 2 * kv_heads * (head_dim + 4) * (tokens - stored) if cold_tier else 0
    return int(math.ceil(hot + cold))


def working_bytes(config: dict, *, device: str, context: int, chunk: int = 512) -> int:
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 1))
    activations = ACTIVATION_FLOATS_PER_TOKEN_HIDDEN * chunk * hidden * 4
    attention = ATTENTION_BYTES_PER_WEIGHT * min(chunk, context) * context * heads
    return (GPU_RUNTIME_BYTES if device.startswith("cuda") else CPU_RUNTIME_BYTES) + activations + attention


def checkpoint_dtype_bytes(config: dict) -> int:
    """Bytes per weight of a safetensors checkpoint, from its config.json ('dtype' / 'torch_dtype'; 2 if unsaid)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return 4 if "32" in name else 2


def estimate(config: dict, checkpoint_bytes: int, *, kind: str, context: int, free: int, device: str = "cpu",
             weight_quant: str = "none", ratio: float = 0.5, kv_int8: bool = False, dtype_bytes: int | None = None,
             file_name: str = "", chunk: int = 512, params: int | None = None, cold_tier: bool = True) -> FitEstimate:
    """The estimate for a model (its config.json) of `checkpoint_bytes` at `context` tokens against `free` bytes."""
    dtype_bytes = checkpoint_dtype_bytes(config) if dtype_bytes is None else dtype_bytes
    weights = weight_bytes(checkpoint_bytes, kind=kind, weight_quant=weight_quant, dtype_bytes=dtype_bytes,
                           file_name=file_name, params=params, device=device)
    kv = kv_bytes(config, context, ratio=ratio, int8=kv_int8, cold_tier=cold_tier)
    working = working_bytes(config, device=device, context=context, chunk=chunk)
    return FitEstimate(weights, kv, working, int(free), "VRAM" if device.startswith("cuda") else "RAM")
