"""Attention over one layer's stored entries: dense (flash / SDPA / eager) and the scoring window.

Shapes (batch 1): query [H, T, d] with H = kv_heads * groups; the layer's storage already holds
the T new entries as its last T entries. Query head h belongs to KV head h // groups (the layout
transformers' repeat_kv assumes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..kernels import cache_ops

try:  # optional: only on CUDA machines with the gpu extra
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_func = None

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # On a GPU, SDPA may pick cuDNN, whose kernels are built for each new shape (hundreds of milliseconds each,
    # reported by other projects). A document's prefill chunks have a new length every chunk and every document,
    # so they would always pay it: on an H200 the first 8k-token turn of a process took 1.7 s against 0.32-0.39 s
    # once the same shapes came again (gpucheck). Flash and memory-efficient kernels need no build.
    _GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # an older torch: its own choice
    sdpa_kernel = _GPU_SDPA = None


def _sdpa_backends(device: torch.device):
    """The SDPA kernels the cache allows on `device`: on a GPU all but cuDNN's (see _GPU_SDPA)."""
    if device.type == "cuda" and _GPU_SDPA is not None:
        return sdpa_kernel(_GPU_SDPA)
    return contextlib.nullcontext()


def sdpa(q, k, v, **kwargs):
    """F.scaled_dot_product_attention with the kernels _sdpa_backends allows."""
    with _sdpa_backends(q.device):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def flash_available() -> bool:
    return _flash_attn_func is not None


def flash_import_error() -> str | None:
    """Why the flash-attn package cannot be used (None when it imported with its compiled extension)."""
    if _flash_attn_func is not None:
        return None
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_func  # noqa: F401  (loads flash_attn_2_cuda)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


_SDPA_NAMES = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "overrideable"}


def _sdpa_choice(q, k, v, mask=None, is_causal=False) -> str:
    """The kernel scaled_dot_product_attention dispatches these arguments to (torch's own choice function)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "SDPA (kernel not reported by this torch)"
    try:
        with _sdpa_backends(q.device):  # what sdpa() allows
            return _SDPA_NAMES.get(int(choose(q, k, v, attn_mask=mask, is_causal=is_causal, scale=0.125)), "SDPA")
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say what failed
        return f"error: {type(exc).__name__}"


def attention_kernels(backend: str, device, dtype: torch.dtype, kv_heads: int, groups: int,
                      head_dim: int) -> dict[str, str]:
    """Which kernel runs each attention call the cache makes, for this model's shape, device and dtype, with the
    arguments dense_attention / decode_attention_output pass: "prefill" (a chunk over earlier entries),
    "decode" (one query, output only), "scored decode" (one query whose weights score the cache: our own
    matrix products), "merged" (entries with merge counts: an additive bias). Kernels: "flash",
    "memory-efficient", "cuDNN", "math" (SDPA's), "flash-attn" (the package), "matmul" (ours)."""
    device = torch.device(device)
    s, t = 96, 32

    def zeros(*shape):  # only shapes, dtypes and devices decide the kernel
        return torch.zeros(*shape, device=device, dtype=dtype)

    keys = zeros(kv_heads, s, head_dim)
    k = keys[:, None].expand(kv_heads, groups, s, head_dim)
    q = zeros(kv_heads, groups, t, head_dim)
    if backend == "eager":
        prefill = merged = "matmul"
    else:
        if backend == "flash":
            prefill = "flash-attn"
        elif device.type == "cpu" and _cpu_flash_lse is not None:
            prefill = "flash"  # _prefix_and_chunk calls torch's CPU flash kernel itself
        else:
            prefill = _sdpa_choice(q, k, k, causal_bias(t, s, dtype, device))
        bias = torch.zeros(kv_heads, 1, t, s, device=device, dtype=dtype).expand(kv_heads, groups, t, s)
        merged = _sdpa_choice(q, k, k, bias)
    decode = _sdpa_choice(zeros(1, kv_heads, groups, head_dim), keys[None], keys[None]) if device.type == "cpu" \
        else "matmul"  # decode_attention_output
    return {"prefill": prefill, "decode": decode, "scored decode": "matmul", "merged": merged}


def describe_kernels(kernels: dict[str, str]) -> str:
    """One line for the model panel and the CLI: "prefill flash · decode flash · scored decode matmul"."""
    return " · ".join(f"{name} {kernel}" for name, kernel in kernels.items())


def pick_backend(use_flash_attention: bool, device: torch.device, dtype: torch.dtype) -> str:
    """'flash' (CUDA + flash-attn + fp16/bf16), 'sdpa', or 'eager' when flash is turned off."""
    if not use_flash_attention:
        return "eager"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_available():
        return "flash"
    return "sdpa"


def causal_visibility(t: int, s: int, device) -> torch.Tensor:
    """Bool [t, s]: query i (the (s-t+i)-th entry) sees every stored entry up to itself."""
    cols = torch.arange(s, device=device)
    rows = torch.arange(t, device=device) + (s - t)
    return cols[None, :] <= rows[:, None]


def causal_bias(t: int, s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive float mask [t, s]: 0 where query i sees entry j, -inf elsewhere (see causal_visibility)."""
    bias = torch.zeros(t, s, dtype=dtype, device=device)
    return bias.masked_fill_(~causal_visibility(t, s, device), float("-inf"))


# torch's CPU flash kernel, which also returns each query's log-sum-exp (private; absent -> masked path).
_cpu_flash_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_needs_mask(device: torch.device) -> bool:
    """Whether dense_attention needs a causal mask for a chunk after earlier entries (see _prefix_and_chunk)."""
    return not (device.type == "cpu" and _cpu_flash_lse is not None)


def _prefix_and_chunk(query, keys, values, scaling: float):
    """Causal attention of a chunk's T queries over S stored entries (the chunk's own T are the last) without
    a mask: the S - T earlier entries are seen by every query, so that part is plain attention with the GQA
    group's queries stacked as rows (no copies of K/V); the chunk's own part is causal self-attention. The
    two are merged by their log-sum-exps. Measured (512 queries, 4,096 entries, 9/3 heads): 20.5 ms against
    23.5 ms for the masked kernel."""
    h, s, d = keys.shape
    big_h, t, _ = query.shape
    groups = big_h // h
    prefix = s - t
    q_rows = query.reshape(1, h, groups * t, d)
    out1, lse1 = _cpu_flash_lse(q_rows, keys[None, :, :prefix], values[None, :, :prefix], scale=scaling)[:2]
    q = query[None]
    k_own = keys[:, prefix:].repeat_interleave(groups, dim=0)[None]
    v_own = values[:, prefix:].repeat_interleave(groups, dim=0)[None]
    out2, lse2 = _cpu_flash_lse(q, k_own, v_own, is_causal=True, scale=scaling)[:2]
    out1 = out1.reshape(big_h, t, d)
    lse1, lse2 = lse1.reshape(big_h, t, 1), lse2.reshape(big_h, t, 1)
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    return ((out1 * w1 + out2[0] * w2) / (w1 + w2)).to(query.dtype)


def dense_attention(query, keys, values, log_counts, scaling: float, backend: str, mask: torch.Tensor | None = None,
                    *, bf16: bool = False):
    """query [H,T,d]; keys/values [h,S,d]; log_counts [h,S] or None. Returns [H,T,d].

    `mask`: the causal_bias for (T, S), built once per forward by the caller and shared by every layer
    (building and converting a boolean mask per layer cost about 5 % of a long prefill).
    `bf16`: a float32 prefill chunk on the CPU attends with q, k, v rounded to bf16 (torch's flash kernel
    accumulates in float32; the result comes back as float32; the storage is not touched):
    2.5x faster (512 queries over 8,192 entries, 9/3 heads: 13.9 against 37.0 ms); see set_prefill_bf16 in
    adapter.py for what the default model gains and costs. Entries with merge counts keep float32."""
    h, s, d = keys.shape
    big_h, t, _ = query.shape
    groups = big_h // h
    if (bf16 and t > 1 and log_counts is None and query.dtype == torch.float32 and query.device.type == "cpu"
            and backend != "eager" and _cpu_flash_lse is not None):
        out = dense_attention(query.to(torch.bfloat16), keys.to(torch.bfloat16), values.to(torch.bfloat16), None,
                              scaling, backend, None if mask is None else mask.to(torch.bfloat16))
        return out.to(torch.float32)
    if keys.dtype != query.dtype:  # a bf16 cache under float32 activations (merged entries, eager)
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    if backend == "flash" and log_counts is None:
        out = _flash_attn_func(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                               values.transpose(0, 1)[None], softmax_scale=scaling, causal=True)
        return out[0].transpose(0, 1)
    if backend == "eager":
        probs = attention_probs(query, keys, log_counts, scaling)  # [h, G, T, S]
        return torch.matmul(probs.to(values.dtype), values[:, None]).reshape(big_h, t, d)
    if log_counts is None and 1 < t < s and query.device.type == "cpu" and _cpu_flash_lse is not None:
        return _prefix_and_chunk(query, keys, values, scaling)
    q = query.view(h, groups, t, d)
    k = keys[:, None].expand(h, groups, s, d)
    v = values[:, None].expand(h, groups, s, d)
    if log_counts is None and t == s:
        out = sdpa(q, k, v, is_causal=True, scale=scaling)
    elif log_counts is None:
        if t > 1 and mask is None:
            mask = causal_bias(t, s, query.dtype, query.device)
        out = sdpa(q, k, v, attn_mask=mask if t > 1 else None, scale=scaling)
    else:
        bias = log_counts.to(query.dtype)[:, None, None, :].expand(h, 1, t, s)
        if t > 1:
            bias = bias.masked_fill(~causal_visibility(t, s, query.device), float("-inf"))
        out = sdpa(q, k, v, attn_mask=bias, scale=scaling)
    return out.reshape(big_h, t, d)


def decode_attention(query, keys, values, log_counts, scaling: float):
    """One new token: query [H, 1, d]; keys/values [h, S, d]. Returns (out [H, 1, d], probs [h, G, S] float32).

    Batched over KV heads with the group's query heads as rows (no broadcast copies of K/V); logits in
    the storage dtype with float accumulation, softmax in float32 (what transformers' eager path does).
    """
    h, s, d = keys.shape
    big_h = query.shape[0]
    q = query.reshape(h, big_h // h, d)
    logits = torch.bmm(q.to(keys.dtype), keys.transpose(1, 2)).float()
    logits.mul_(scaling)
    if log_counts is not None:
        logits.add_(log_counts[:, None, :])
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.to(values.dtype), values)
    return out.reshape(big_h, 1, d), probs


def decode_attention_output(query, keys, values, scaling: float):
    """One new token, output only (no weights wanted, no merge counts): query [H, 1, d] -> [H, 1, d].
    On the CPU, SDPA with the GQA group's queries as rows: 3.8 against 4.6 ms per step for decode_attention over
    1.1k entries on the default model (benchmarks/attention_floor.py). On a GPU, decode_attention's matrix
    products: there SDPA picks cuDNN, whose kernels are built for each new length, and a decode step has a new
    length every time. Measured on an H200 (gpucheck, 8B shape, per-op step): 16 tok/s for the dense cache
    through SDPA against 58 for the CED cache, whose decode takes the matrix products and scores the cache too."""
    if query.device.type != "cpu":
        return decode_attention(query, keys, values, None, scaling)[0].to(query.dtype)
    h, s, d = keys.shape
    big_h = query.shape[0]
    q = query.reshape(1, h, big_h // h, d).to(keys.dtype)
    out = F.scaled_dot_product_attention(q, keys[None], values[None], scale=scaling)
    return out.reshape(big_h, 1, d).to(query.dtype)


def attention_probs(query, keys, log_counts, scaling: float, *, last: int | None = None):
    """Softmax weights of the last `last` queries (all when None): [h, G, w, S], float32."""
    h, s, d = keys.shape
    big_h, t, _ = query.shape
    groups = big_h // h
    w = t if last is None else min(last, t)
    q = query.view(h, groups, t, d)[:, :, t - w:]
    logits = torch.matmul(q.float(), keys.float()[:, None].transpose(-1, -2)) * scaling  # [h,G,w,S]
    if log_counts is not None:
        logits = logits + log_counts[:, None, None, :]
    if t > 1:
        visible = causal_visibility(t, s, query.device)[t - w:]
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)


SCORE_BLOCK_ELEMENTS = 1 << 22  # float32 attention weights computed at once when scoring (16 MiB)


def attention_mass(query, keys, log_counts, scaling: float, *, last: int) -> torch.Tensor:
    """Attention each stored entry receives from the last `last` queries, summed over the queries and
    the query heads of its GQA group: [h, S] float32. Computed in blocks of queries, so scoring every
    query of a long chunk against a long cache stays within SCORE_BLOCK_ELEMENTS of weights."""
    h, s, _ = keys.shape
    big_h, t, _ = query.shape
    w = min(last, t)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (big_h * s))
    total = None
    for stop in range(t, t - w, -rows):
        start = max(t - w, stop - rows)
        visible = s - (t - stop)  # entries the block's queries can see (causal)
        counts = None if log_counts is None else log_counts[:, :visible]
        probs = attention_probs(query[:, :stop], keys[:, :visible], counts, scaling, last=stop - start)
        mass = probs.sum(dim=(1, 2))
        if total is None:
            total = torch.zeros(h, s, dtype=mass.dtype, device=mass.device)
        total[:, : mass.shape[1]] += mass
    return total


# A CPU chunk of at most this many queries that scores every stored entry (a follow-up's question) attends through
# question_attention, which gives the output and the attention mass from one softmax, instead of dense_attention
# plus attention_mass (the logits twice), while its float32 weights stay within 2 x SCORE_BLOCK_ELEMENTS.
# benchmarks/question_attention.py (AMD EPYC, 2 threads, the default model's heads): 19 queries over 550 / 1,050 /
# 4,200 entries 2.6 / 2.5 / 3.2x faster a layer, 128 over 4,200 1.3x; the mass is attention_mass's to the bit.
QUESTION_ROWS = 128


def fuses_question(query, keys) -> bool:
    """Whether a scored chunk (query [H, T, d] over keys [h, S, d]) attends through question_attention."""
    big_h, t, _ = query.shape
    return query.device.type == "cpu" and t <= QUESTION_ROWS and big_h * t * keys.shape[1] <= 2 * SCORE_BLOCK_ELEMENTS


def question_attention(query, keys, values, log_counts, scaling: float, *, last: int, shared=None):
    """query [H, T, d] (the chunk's T entries the last of keys / values [h, S, d]) -> (out [H, T, d] float32, mass
    [h, S] float32): causal attention in float32, and the attention each entry receives from the last `last`
    queries summed over them and the group's heads (attention_mass's), from the same weights. `shared`: the hot
    logits a recall computed (cache_ops.HotLogits), which the C path takes instead of computing them again."""
    fused = cache_ops.question_attention(query, keys, values, log_counts, scaling, last, shared)
    if fused is not None:
        return fused
    h, s, d = keys.shape
    big_h, t, _ = query.shape
    groups = big_h // h
    q = query.float().reshape(h, groups * t, d) * scaling  # the group's queries as rows (no copies of K / V)
    logits = torch.matmul(q, keys.float().transpose(1, 2))
    if log_counts is not None:
        logits += log_counts.float()[:, None, :]
    future = torch.ones(t, t, dtype=torch.bool, device=logits.device).triu(1)
    logits.view(h, groups, t, s)[..., s - t:].masked_fill_(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, values.float()).reshape(big_h, t, d)
    w = min(last, t)
    return out, probs.view(h, groups, t, s)[:, :, t - w:].sum(dim=(1, 2))


def probe_mass(query, keys, log_counts, scaling: float) -> torch.Tensor:
    """The attention a question probe's queries [H, Tq, d] pay to each stored entry (keys [h, S, d]), summed over
    the group's heads and the queries -> [h, S] float32 (each query's attention sums to one)."""
    h = keys.shape[0]
    qg = query.float().reshape(h, -1, query.shape[-1])  # [h, G * Tq, d]
    logits = torch.matmul(qg, keys.float().transpose(1, 2)) * scaling
    if log_counts is not None:
        logits = logits + log_counts[:, None, :]
    return torch.softmax(logits, dim=-1).sum(dim=1)
