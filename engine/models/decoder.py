"""Our decoder forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), on plain tensors.

Why it exists: at batch 1 a decode step of a small model is a few hundred tiny ops, and half the time
of transformers' module-by-module forward went to per-op overhead rather than to reading weights.
Here each layer is four matrix products (fused QKV, O, fused gate+up, down), one RoPE over queries
and keys together, and two RMSNorms; the attention itself is the DS-V4.1 cache's. The fused weights
are built once, and the model's own Linear weights are re-pointed at slices of them, so nothing is
stored twice and transformers' forward (still used for quantized weights) sees the same numbers.

On the CPU a decode step (one token) runs as a single C call instead (kernels.FusedDecodeStep, same
numerics in float32); this per-op forward stays for prefill chunks, the GPU, and as its reference in tests.

The weights come from adapter.decoder_weights (the only place that knows transformers' module
names); numerics follow transformers' Llama code: RMSNorm in float32 then cast, RoPE in the model
dtype with cos/sin computed by the model's own rotary module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import FusedDecodeStep, GGUFWeight, KernelMatrix


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor | KernelMatrix  # [(H + 2h) * d, D]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | KernelMatrix  # [D, H * d]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor | KernelMatrix  # [2 * I, D]
    down: torch.Tensor | KernelMatrix  # [D, I]
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each head's d
    k_norm: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    embed: torch.Tensor | KernelMatrix  # [V, D]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # its dtype is the compute dtype
    lm_head: torch.Tensor | KernelMatrix  # [V, D]
    lm_head_bias: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (x, position_ids) -> cos, sin
    act: Callable[[torch.Tensor], torch.Tensor]
    act_name: str | None = None  # the config's name for `act` ("silu"): what a fused kernel may compute instead
    rope_type: str = "default"  # the rotary module's kind ("dynamic" ones change with the length: no cos/sin table)


_FUSED_RMS_NORM = hasattr(F, "rms_norm")
# rotary embeddings whose cos/sin at a position depend on the sequence length (they cannot be tabled once)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ROPE_TABLE_MIN = 4096  # positions the first cos/sin table covers (it doubles when a position passes it)


class RopeTable:
    """cos / sin [positions, head_dim] computed once by the model's own rotary module for a range of positions (in
    `dtype`, as it returns them for activations of that dtype), doubled when a position passes its end. A decode
    step reads its position's row instead of calling the module (~20 us of torch ops a token on the CPU, more once
    the step's weights have streamed through the caches). Each value is the module's own for that position: its
    angles are one product position x inverse frequency, the same whether computed for one position or for all."""

    def __init__(self, rotary, dtype: torch.dtype, device):
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self.cos = self.sin = None
        self.cos32 = self.sin32 = None  # float32 copies (the fused CPU step reads float32)

    def ensure(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables (in `dtype`), covering `position`."""
        if self.cos is None or position >= self.cos.shape[0]:
            size = max(ROPE_TABLE_MIN, position + 1, 0 if self.cos is None else 2 * self.cos.shape[0])
            probe = torch.empty(1, 1, 1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=self.device)[None])
            self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()
            self.cos32 = self.sin32 = None
        return self.cos, self.sin

    def row32(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position's cos and sin as contiguous float32 vectors [head_dim]."""
        self.ensure(position)
        if self.cos32 is None:
            self.cos32, self.sin32 = self.cos.float(), self.sin.float()
        return self.cos32[position], self.sin32[position]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in float32, cast back, then scale. In float32 that is
    one fused op (F.rms_norm) instead of six. On a GPU in half precision too: one kernel instead of eight (a
    decode step there is bound by its kernel count), normalised and scaled in float32 and rounded once where
    transformers rounds before the scale as well (a bf16 ulp at most apart)."""
    if _FUSED_RMS_NORM and x.dtype == weight.dtype and (x.dtype == torch.float32 or x.device.type != "cpu"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, d]; cos/sin [T, 1, d] (both halves equal, as transformers builds them)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_swap(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """rope_matrix's fixed pattern P [d, d]: +1 at (i, half + i), -1 at (half + i, i)."""
    swap = torch.zeros(d, d, dtype=dtype, device=device)
    swap.diagonal(d // 2).fill_(1)
    swap.diagonal(-(d // 2)).fill_(-1)
    return swap


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE at one position as a [d, d] matrix R (x @ R == rope(x)): cos/sin [d] (both halves equal), R =
    diag(cos) + P * sin with P = rope_swap (pass it to build it once). A decode step rotates every layer's queries
    and keys with one small matmul instead of seven elementwise ops; no host value is read, so a CUDA graph can
    hold it (models/static_step.py)."""
    if swap is None:
        swap = rope_swap(cos.shape[-1], cos.dtype, cos.device)
    return torch.addcmul(torch.diag_embed(cos), swap, sin)


def linear(x: torch.Tensor, weight: torch.Tensor | KernelMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T. A KernelMatrix (bf16/int8/GGUF weights on CPU) runs our kernels. One token in
    half precision goes through mv: on CPU the bf16/fp16 matrix-vector kernel reads the weights faster than
    the GEMM path F.linear takes (measured: 17 vs 25 ms for the default model's matrices)."""
    if isinstance(weight, KernelMatrix):
        return weight.linear(x, bias)
    if x.shape[0] == 1 and x.dtype != torch.float32 and x.device.type == "cpu":
        out = torch.mv(weight, x[0])[None]
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | KernelMatrix,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """residual + linear(x, weight, bias), the add fused into the matrix product where no bias."""
    if isinstance(weight, KernelMatrix):
        return weight.linear(x, bias, residual=residual)
    if bias is not None:
        return residual + linear(x, weight, bias)
    if x.shape[0] == 1 and x.dtype != torch.float32 and x.device.type == "cpu":
        return torch.addmv(residual[0], weight, x[0])[None]
    return torch.addmm(residual, x, weight.t())


def _device_of(weight) -> torch.device:
    return weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")  # KernelMatrix: CPU only


class Decoder:
    """forward(input_ids [1, T], cache, logits_to_keep) -> logits [1, keep, V], attention through `cache`."""

    def __init__(self, weights: DecoderWeights):
        self.w = weights
        # One C call per CPU decode step where the kernels can read the weights (packed bf16 / int8, GGUF blocks, or
        # float32 / bf16 tensors); None elsewhere (GPU, float16, no compiler: fused.step_library says why), and
        # forward() runs the per-op step below. (not even compiled when the weights are on a GPU)
        self.fused = FusedDecodeStep.build(weights)
        # On a GPU a decode step runs with static shapes (static_step.StaticDecodeStep, set by adapter.install),
        # captured as one CUDA graph; None elsewhere (the CPU's fused step is faster there; tests set one on the
        # CPU to compare)
        self.static = None
        # cos / sin by position for the fused step (None: a rotary whose values depend on the length)
        self.rope = None if str(weights.rope_type).startswith(LENGTH_DEPENDENT_ROPE) or self.fused is None else \
            RopeTable(weights.rotary, weights.final_norm.dtype, weights.final_norm.device)
        self._row = None  # forward_token's embedding row writer (GGUF blocks), made on first use

    @torch.inference_mode()
    def forward_token(self, token: int, position: int, cache) -> torch.Tensor | None:
        """One decode token given as numbers, through the fused CPU step: logits [1, 1, V], with no id or position
        tensor made on the way where RoPE comes from the table (DSV41Cache.begin_token begins it; forward() comes
        here for one token too). None where the fused step does not run this token (no fused step, a GPU static
        step, or DSV41Cache.fused_plan says no): forward()'s per-op step runs it then."""
        if self.fused is None or self.static is not None:
            return None
        plan = cache.fused_plan()
        if plan is None:
            return None
        w = self.w
        dtype = w.final_norm.dtype
        if isinstance(w.embed, GGUFWeight) and len(w.embed.parts) == 1:  # read where it is held
            if self._row is None:
                self._row = w.embed.row_writer(torch.empty(w.embed.shape[1]))
            x = self._row(token)
            if dtype != torch.float32:  # the row as the model's dtype holds it, as the per-op step reads it
                x = x.to(dtype).float()
        else:
            ids = torch.tensor([token])
            x = (w.embed.rows(ids, dtype) if isinstance(w.embed, KernelMatrix)
                 else F.embedding(ids, w.embed))[0].float().contiguous()
        if self.rope is not None:
            cos, sin = self.rope.row32(position)
        else:  # a rotary whose values depend on the length: the module, for this position
            probe = torch.empty(1, 1, 1, dtype=dtype, device=w.final_norm.device)
            cos, sin = w.rotary(probe, torch.tensor([[position]]))
            cos, sin = cos[0, 0].float().contiguous(), sin[0, 0].float().contiguous()
        return self.fused.step(x, position, cos, sin, cache, plan.by_python, score=plan.score,
                               decay=plan.decay).view(1, 1, -1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, logits_to_keep: int = 1):
        w = self.w
        heads, kv_heads, d = w.heads, w.kv_heads, w.head_dim
        if input_ids.shape[1] == 1 and self.static is not None:
            plan = cache.static_plan()
            if plan is not None:
                return self.static.step(input_ids, cache, plan).view(1, 1, -1)
        if input_ids.shape[1] == 1 and self.fused is not None:  # (CPU only: the ids are read on the host)
            logits = self.forward_token(int(input_ids[0, 0]), int(position_ids[0, 0]), cache)
            if logits is not None:
                return logits
        if isinstance(w.embed, KernelMatrix):
            x = w.embed.rows(input_ids[0], w.final_norm.dtype)  # [T, D]
        else:
            x = F.embedding(input_ids[0], w.embed)
        t = x.shape[0]
        cos, sin = w.rotary(x[None], position_ids)
        cos, sin = cos[0, :, None, :].to(x.dtype), sin[0, :, None, :].to(x.dtype)  # [T, 1, d]
        rot = rope_matrix(cos[0, 0], sin[0, 0]) if t == 1 else None
        qk_heads = heads + kv_heads
        for index, layer in enumerate(w.layers):
            if layer.input_norm.device != x.device:  # layers spread over devices: the activations follow
                x, cos, sin = x.to(layer.input_norm.device), cos.to(layer.input_norm.device), \
                    sin.to(layer.input_norm.device)
                rot = None if rot is None else rot.to(layer.input_norm.device)
            h = rms_norm(x, layer.input_norm, w.eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias).view(t, qk_heads + kv_heads, d)
            if layer.q_norm is not None:
                q = rms_norm(qkv[:, :heads], layer.q_norm, w.eps)
                k = rms_norm(qkv[:, heads:qk_heads], layer.k_norm, w.eps)
                qk = torch.cat((q, k), dim=1)
            else:
                qk = qkv[:, :qk_heads]
            qk = rope(qk, cos, sin) if rot is None else torch.matmul(qk, rot)
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, H, T, d]
            k = qk[:, heads:].transpose(0, 1)[None]
            v = qkv[:, qk_heads:].transpose(0, 1)[None]
            attn = cache.attend(index, q, k, v, w.scaling)  # [1, T, H, d]
            x = residual_linear(x, attn.reshape(t, heads * d), layer.o, layer.o_bias)
            h = rms_norm(x, layer.post_norm, w.eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = residual_linear(x, w.act(gate).mul_(up), layer.down)
        x = rms_norm(x[-logits_to_keep:].to(w.final_norm.device), w.final_norm, w.eps)
        return linear(x.to(_device_of(w.lm_head)), w.lm_head, w.lm_head_bias)[None]
