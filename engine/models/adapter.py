"""The ONE place that touches transformers internals (attention registry, mask registry, forward kwargs).

How the DS-V4.1 cache plugs in: we register an attention implementation "dsv41" and run the model
with `use_cache=False`, so transformers never builds its own cache; each attention layer hands us the
RoPE'd query/key/value of the new tokens and we append, score, select and attend against our cache
(passed down as a forward kwarg). Masks are ours as well, so transformers' mask builder returns None.
Tested with the transformers range pinned in pyproject.toml; when transformers renames something,
only this file changes.

What `install` adds to a model (our decoder, how its weights are held, the compute dtype) is a `Runtime`,
kept beside the model in `_RUNTIMES` and read through `runtime(model)`; nothing is stored on the model itself.

Why this file is long: the rule that only this module knows transformers' module names (q_proj, mlp.down_proj,
embed_tokens, ...) puts everything that reads or re-points them here: the decoder's fused weights, holding them
as bf16 / int8 (pack_weights) or as a GGUF file's blocks (hold_gguf; reading the file is engine.models.gguf_hold's).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

from ..kernels import GGUFWeight, KernelMatrix, PackedMatrix, bf16_exact, huge_pages, load, quantize_rows_int8
from ..kernels.packed import bf16_products_fast
from . import static_step
from .decoder import Decoder, DecoderWeights, LayerWeights

SUPPORTED_ARCHITECTURES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}
ATTENTION_NAME = "dsv41"
_CACHE_KWARG = "dsv41_cache"
_registered = False


@dataclass
class Runtime:
    """What `install` set up for one transformers model."""

    compute_dtype: torch.dtype  # activations and the KV cache (weights may be held more compactly)
    decoder: Decoder | None  # our forward; None: transformers' forward runs (quantized layers, other layouts)
    packed: str | None  # "bf16" / "int8" when the decoder's matrices are held for our CPU kernels
    prefill_bf16: bool = False  # prefill chunks attend in bf16 and the KV cache is bf16 (set_prefill_bf16)


_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime(model) -> Runtime:
    """The model's Runtime (a model `install` has not seen: transformers' forward in its own dtype)."""
    found = _RUNTIMES.get(model)
    if found is None:
        return Runtime(next(p.dtype for p in model.parameters() if p.is_floating_point()), None, None)
    return found


class UnsupportedArchitecture(ValueError):
    pass


def check_architecture(model_type: str | None) -> str:
    """Return the display name of a supported architecture or raise with the list of supported ones."""
    if model_type in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[model_type]
    supported = ", ".join(SUPPORTED_ARCHITECTURES.values())
    raise UnsupportedArchitecture(
        f"Model architecture {model_type!r} is not supported by the DS-V4.1 engine yet. Supported: {supported}. "
        "Pick a model of one of these families (e.g. a Llama, Mistral or Qwen2/Qwen3 chat model)."
    )


def _dsv41_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = kwargs.get(_CACHE_KWARG)
    if cache is None:
        raise RuntimeError("dsv41 attention called without a DS-V4.1 cache; run the model through engine.models.adapter")
    out = cache.attend(module.layer_idx, query, key, value, scaling if scaling is not None else module.scaling)
    return out, None


def _no_mask(*args, **kwargs):
    return None


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _dsv41_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    _registered = True


def install(model, *, fast: bool = True, pack: bool = True, pack_rounding: bool = False,
            pack_format: str = "bf16", prefill_bf16: bool = False, graphs: bool = True, gguf=None) -> None:
    """Switch a loaded HF causal LM to the DS-V4.1 attention path (and our fused decoder where it applies).
    `pack`: on CPU, hold the decoder's matrices as bf16 for our kernels when that is exact, or with
    `pack_rounding` also when it rounds; `pack_format="int8"` quantizes them to int8 (pack_weights).
    `prefill_bf16`: where the matrices are held as bf16, prefill runs in bf16 (set_prefill_bf16).
    `graphs`: on a GPU, capture the decode step as one CUDA graph (engine.models.static_step).
    `gguf`: the .gguf file the model was converted from: on CPU its matrices are held in their own block formats
    where the kernels read them (hold_gguf), the rest packed as above; or the GGUFBlocks of a model loaded straight
    from the file (engine.models.gguf_load), which must all be held (ValueError otherwise)."""
    check_architecture(getattr(model.config, "model_type", None))
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    compute = runtime(model).compute_dtype  # the dtype before any packing (an install again keeps it)
    weights = decoder_weights(model) if fast else None
    held = hold_gguf(model, weights, gguf) if weights is not None and pack and gguf is not None and \
        pack_format == "bf16" else None
    if getattr(gguf, "untaken", None) is not None and gguf.untaken():
        # a model loaded straight from its GGUF (engine.models.gguf_load) whose kept blocks are not all held:
        # parameters would stay empty (a layout our decoder does not cover); the caller loads another way
        raise ValueError("the GGUF's blocks are not all held by the decoder: " + ", ".join(gguf.untaken()[:3]))
    packed = pack_weights(model, weights, rounding=pack_rounding, fmt=pack_format) \
        if weights is not None and pack else None
    if held:
        packed = held + (f", others as {packed}" if packed else "")
    if weights is not None and weights.final_norm.device.type == "cpu" and huge_pages.enabled():
        # before the fused step takes the matrices' addresses (the model's parameters that share them follow)
        huge_pages.move_to_huge_pages(huge_pages.weight_tensors(weights), also=[*model.parameters(), *model.buffers()])
    decoder = Decoder(weights) if weights is not None else None
    if decoder is not None and weights.final_norm.device.type == "cuda" and static_step.supports(weights):
        decoder.static = static_step.StaticDecodeStep(weights, graphs=graphs)
    _RUNTIMES[model] = Runtime(compute, decoder, packed)
    set_prefill_bf16(model, prefill_bf16)


_GGUF_READ_LOCK = threading.Lock()


@contextlib.contextmanager
def gguf_header_read_once():
    """While a GGUF is converted, transformers reads the file's whole header (every metadata field, the vocabulary
    included, through gguf's GGUFReader) once, not twice. For architectures its fast metadata reader does not cover
    (llama among them), AutoTokenizer reads the whole header to learn the config and AutoConfig reads it again:
    about 10 s each for the default model's 49k-token vocabulary on a 2-core AMD EPYC, more for larger vocabularies.
    Here a second read of the same file (size and time unchanged) without tensors returns a copy of the first's
    result. Conversions hold a lock, so two never patch at once; a transformers whose reader takes other arguments
    is left as it is."""
    import copy
    import inspect
    import os

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        real = gguf_utils.load_gguf_checkpoint
        names = list(inspect.signature(real).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        yield
        return
    if names[:2] != ["gguf_checkpoint_path", "return_tensors"]:
        yield
        return
    results: dict = {}

    def once(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or any(v is not None for v in kwargs.values()):
            return real(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        try:
            info = os.stat(gguf_checkpoint_path)
            key = (os.path.realpath(gguf_checkpoint_path), info.st_size, info.st_mtime_ns)
        except (OSError, TypeError):
            return real(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        if key not in results:
            results[key] = real(gguf_checkpoint_path, False)
        return copy.deepcopy(results[key])

    with _GGUF_READ_LOCK:
        gguf_utils.load_gguf_checkpoint = once
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = real


@contextlib.contextmanager
def transformers_attention(model, implementation: str = "sdpa"):
    """Run transformers' own attention ("sdpa", "eager") on an installed model for a while: the reference on the
    same weights (our fused weights are views the model's modules still read), then back to ours."""
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def set_prefill_bf16(model, on: bool) -> bool:
    """Prefill in bf16 (on) or float32 (off) for a model whose matrices are held as bf16 for our CPU kernels:
    caches made by DSV41Model.new_cache attend prefill chunks in bf16 (DSV41Cache.prefill_bf16) and store bf16
    keys and values (DSV41Model.kv_dtype: that attention reads them rounded anyway), and, where the CPU has
    bf16 dot products (packed.bf16_products_fast), matrix products of bf16 activations x bf16 weights with float32
    accumulation, the products rounded to bf16. Norms, the residual stream, CED scoring and every decode step
    compute in float32. Measured on the default model (2 cores with AMX; benchmarks/cpu_kernels.py): products
    alone took a 1k-token prompt from 1.22 to 0.67 s and an 8k document from 17.0 to 12.9 s, bf16 attention then
    the 8k document to 6.8 s; perplexity on four speeches moved by -0.1 to +0.2 % (mean about +0.05 %) against
    float32. On a CPU with AVX2 alone bf16 products took a 1k-token prompt from 3.4 to 15.4 s (AMD EPYC): there
    the products stay float32 and the attention and the cache are bf16 (torch's flash kernel in bf16 runs at its
    float32 speed there). Returns whether it is on (False where no matrix is held as bf16)."""
    step = step_matrices(model) or []
    decoder = runtime(model).decoder
    packed = [m for m in step if _bf16_capable(m)]  # bf16 or GGUF blocks, not int8
    products = on and bf16_products_fast()
    for matrix in packed:
        matrix.bf16_rows = products
    if decoder is not None and _bf16_capable(decoder.w.embed):
        decoder.w.embed.bf16_rows = products
    found = _RUNTIMES.get(model)
    if found is not None:
        found.prefill_bf16 = bool(on and packed)
    return bool(on and packed)


def _bf16_capable(m) -> bool:
    """A held matrix whose prefill products may run in bf16: bf16 itself, or GGUF blocks (dequantised per call)."""
    return isinstance(m, GGUFWeight) or (isinstance(m, PackedMatrix) and m.scale is None)


def prefill_bf16(model) -> bool:
    """Whether prefill runs in bf16 (set_prefill_bf16): its attention and the KV cache, and its products where
    prefill_products_bf16."""
    return runtime(model).prefill_bf16


def prefill_products_bf16(model) -> bool:
    """Whether prefill chunks multiply the bf16-held matrices in bf16 (set_prefill_bf16, on a CPU with a fast bf16
    GEMM)."""
    step = step_matrices(model) or []
    return any(_bf16_capable(m) and m.bf16_rows for m in step)


def compute_dtype(model) -> torch.dtype:
    """The dtype activations and the KV cache use (weights may be held more compactly, see pack_weights)."""
    return runtime(model).compute_dtype


def packed_format(model) -> str | None:
    """'bf16' or 'int8' when pack_weights holds the decoder's matrices for our CPU kernels, else None."""
    return runtime(model).packed


@torch.inference_mode()
def pack_weights(model, weights: DecoderWeights, *, rounding: bool = False, fmt: str = "bf16") -> str | None:
    """Hold every decoder matrix (and the embedding) as bf16 for engine.kernels, on CPU, when that is
    exact: a bf16 model, or a float32 model whose values are all bf16 values (a bf16 checkpoint loaded as
    float32). Activations and the KV cache keep the compute dtype. transformers'
    Linear modules are re-pointed at slices of the bf16 matrices, so the float32 copies are freed and
    the model's parameters count what is really held. `rounding`: pack a float32 model whose values bf16
    cannot all hold (the loader allows it for checkpoints quantized coarser than bf16, like the default
    Q4_1 model). Returns the format held ('bf16' or 'int8'), or
    None where nothing changed (GPU, kernels unavailable, float16, inexact values without `rounding`).

    fmt="int8" (weight_quant="int8" on CPU): every matrix quantized per output row (absmax / 127, one
    float32 scale per row), a quarter of float32's bytes; the float32 compute is unchanged."""
    dtype = weights.final_norm.dtype
    if weights.final_norm.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or load() is None:
        return None
    base, lm_head = model.model, model.lm_head
    tied = base.embed_tokens.weight is lm_head.weight
    matrices = [m for layer in weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    matrices.append(weights.lm_head)
    if not tied:
        matrices.append(weights.embed)
    matrices = [m for m in matrices if not isinstance(m, KernelMatrix)]  # held already (hold_gguf)
    if not matrices:
        return None
    if fmt == "bf16" and dtype == torch.float32 and not rounding and not all(bf16_exact(m) for m in matrices):
        return None

    def packed(tensor, modules):
        if isinstance(tensor, KernelMatrix):
            return tensor
        if fmt == "int8":
            matrix = PackedMatrix(*quantize_rows_int8(tensor))
        else:
            matrix = PackedMatrix(tensor.detach().to(torch.bfloat16).contiguous())
        row = 0
        for module in modules:
            n = module.weight.shape[0]
            module.weight = torch.nn.Parameter(matrix.data[row:row + n], requires_grad=False)
            if matrix.scale is not None:  # counted with the module's memory
                module.register_buffer("dsv41_weight_scale", matrix.scale[row:row + n], persistent=False)
            row += n
        return matrix

    for layer, weight in zip(base.layers, weights.layers, strict=True):
        a, m = layer.self_attn, layer.mlp
        weight.qkv = packed(weight.qkv, [a.q_proj, a.k_proj, a.v_proj])
        weight.o = packed(weight.o, [a.o_proj])
        weight.gate_up = packed(weight.gate_up, [m.gate_proj, m.up_proj])
        weight.down = packed(weight.down, [m.down_proj])
    weights.lm_head = packed(weights.lm_head, [lm_head])
    if tied:
        base.embed_tokens.weight = lm_head.weight
        weights.embed = weights.lm_head
    else:
        weights.embed = packed(weights.embed, [base.embed_tokens])
    return fmt


@torch.inference_mode()
def hold_gguf(model, weights: DecoderWeights, path) -> str | None:
    """Hold the decoder's matrices as the GGUF file at `path` stores them (engine.kernels.gguf_blocks), on CPU:
    exactly the checkpoint's values, its bytes read per token. `path` is the file a loaded model was converted
    from (a matrix is held when every part of it -- q, k, v; gate, up -- is in a block format the kernels multiply
    and its values are the loaded weight's; the rest stay for pack_weights), or the GGUFBlocks a load straight from
    the file kept (engine.models.gguf_load: taken as they are). The model's Linear modules are re-pointed at their
    rows of the blocks (uint8), so no float copies stay and the model's parameters count the bytes held
    (transformers' own forward cannot run on them; ours does). Returns what is held ("GGUF Q4_1 + Q8_0"), or
    None where nothing is (GPU, no kernels, formats not held, a layout that does not match)."""
    from .gguf_hold import GGUFBlocks, GGUFHolder

    if weights.final_norm.device.type != "cpu" or weights.final_norm.dtype not in (torch.float32, torch.bfloat16) \
            or load() is None:
        return None
    holder = path if isinstance(path, GGUFBlocks) else GGUFHolder(path)
    base, lm_head = model.model, model.lm_head
    tied = base.embed_tokens.weight is lm_head.weight

    def hold(names: list[str], modules, heads: list[int | None]) -> GGUFWeight | None:
        held = holder.hold(names, [module.weight for module in modules], heads)
        if held is not None:
            for module, part in zip(modules, held.parts, strict=True):
                module.weight = torch.nn.Parameter(part.data, requires_grad=False)
        return held

    cfg = text_config(model)
    heads, kv_heads = weights.heads, weights.kv_heads
    llama = getattr(cfg, "model_type", "") in ("llama", "mistral")
    for i, (layer, weight) in enumerate(zip(base.layers, weights.layers, strict=True)):
        a, m = layer.self_attn, layer.mlp
        blk = f"blk.{i}."
        qkv = hold([blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"],
                   [a.q_proj, a.k_proj, a.v_proj], [heads if llama else None, kv_heads if llama else None, None])
        weight.qkv = qkv or weight.qkv
        weight.o = hold([blk + "attn_output.weight"], [a.o_proj], [None]) or weight.o
        weight.gate_up = hold([blk + "ffn_gate.weight", blk + "ffn_up.weight"], [m.gate_proj, m.up_proj],
                              [None, None]) or weight.gate_up
        weight.down = hold([blk + "ffn_down.weight"], [m.down_proj], [None]) or weight.down
    if tied or not holder.has("output.weight"):
        embed = hold(["token_embd.weight"], [base.embed_tokens], [None]) if tied else None
        if embed is not None:
            lm_head.weight = base.embed_tokens.weight
            weights.embed = weights.lm_head = embed
    else:
        weights.lm_head = hold(["output.weight"], [lm_head], [None]) or weights.lm_head
        weights.embed = hold(["token_embd.weight"], [base.embed_tokens], [None]) or weights.embed
    return holder.summary()


def uses_fast_decoder(model) -> bool:
    return runtime(model).decoder is not None


@torch.inference_mode()
def forward(model, input_ids: torch.Tensor, cache, *, score_window: int | None = None, prefill: bool | None = None,
            logits_to_keep: int = 1, question: bool = False) -> torch.Tensor:
    """Run `input_ids` [1, T] through the model against `cache`; returns logits [1, logits_to_keep, V] (float32).
    `question`: these tokens end with a turn's question (the cache may recall for it; DSV41Cache.begin_forward)."""
    position_ids = cache.begin_forward(input_ids.shape[1], score_window=score_window, prefill=prefill,
                                       question=question)
    decoder = runtime(model).decoder
    try:
        if decoder is not None:
            logits = decoder.forward(input_ids, position_ids, cache, logits_to_keep)
        else:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           logits_to_keep=logits_to_keep, **{_CACHE_KWARG: cache}).logits
    except BaseException:
        cache.abort_forward()
        raise
    cache.end_forward()
    return logits.float()


def forward_token(model, token: int, cache, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token -> logits [1, 1, V] float32, as forward(model, [[token]], cache, prefill=False). Where the
    fused CPU step runs it (Decoder.forward_token), no id or position tensor is made: a decode step's Python is
    ~10 % of its time on a small model. Elsewhere forward() runs it, fed from `token_ids` (the token as a [1] tensor
    where it was sampled: on a GPU it stays there) or a tensor made from `token`."""
    decoder = runtime(model).decoder
    if decoder is not None and decoder.fused is not None:
        position = cache.begin_token()
        try:
            logits = decoder.forward_token(token, position, cache)
        except BaseException:
            cache.abort_forward()
            raise
        if logits is not None:
            cache.end_forward()
            return logits
    ids = token_ids.view(1, 1) if token_ids is not None else torch.tensor([[token]])
    return forward(model, ids.to(next(model.parameters()).device), cache, prefill=False)


@torch.inference_mode()
def probe_queries(model, input_ids: torch.Tensor, cache, start: int) -> dict[int, torch.Tensor]:
    """Run `input_ids` at positions from `start` only to collect each layer's (RoPE'd) queries; the cache's
    entries, tokens seen and scores are left as they were (the probe's entries are dropped)."""
    position_ids = cache.begin_forward(input_ids.shape[1], score_window=0, prefill=True, start=start)
    decoder = runtime(model).decoder
    cache.start_capture()
    try:
        if decoder is not None:
            decoder.forward(input_ids, position_ids, cache, 1)
        else:
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
                  **{_CACHE_KWARG: cache})
    finally:
        captured = cache.finish_capture()
        cache.abort_forward()
    return captured


def _plain_linear(module) -> bool:
    return type(module) is torch.nn.Linear and module.weight.dtype.is_floating_point


def _fuse(modules, dim_bias: bool = True):
    """Concatenate the weights of `modules` (rows) and re-point each module at its slice: stored once."""
    fused = torch.cat([m.weight.detach() for m in modules], dim=0)
    bias = None
    if dim_bias and any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else
                          torch.zeros(m.out_features, dtype=fused.dtype, device=fused.device) for m in modules])
    row = 0
    for m in modules:
        n = m.out_features
        m.weight = torch.nn.Parameter(fused[row:row + n], requires_grad=False)
        if bias is not None and m.bias is not None:
            m.bias = torch.nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return fused, bias


@torch.inference_mode()
def decoder_weights(model) -> DecoderWeights | None:
    """Fused weights for engine.models.decoder, or None when the model does not fit that path
    (quantized Linear layers, MLP biases, an unexpected module layout): transformers' forward is used then."""
    base = getattr(model, "model", None)
    try:
        layers = list(base.layers)
        attn0 = layers[0].self_attn
        head_dim = attn0.head_dim
        cfg = text_config(model)
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        rotary = base.rotary_emb
        lm_head = model.lm_head
    except (AttributeError, IndexError, TypeError):
        return None
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if not all(_plain_linear(p) for p in projections) or not _plain_linear(lm_head):
            return None
        if any(p.bias is not None for p in (m.gate_proj, m.up_proj, m.down_proj)):
            return None
        if type(base.embed_tokens) is not torch.nn.Embedding:
            return None
    out = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
        gate_up, _ = _fuse([m.gate_proj, m.up_proj], dim_bias=False)
        q_norm = getattr(a, "q_norm", None)
        k_norm = getattr(a, "k_norm", None)
        out.append(LayerWeights(
            input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias, o=a.o_proj.weight,
            o_bias=a.o_proj.bias, post_norm=layer.post_attention_layernorm.weight, gate_up=gate_up,
            down=m.down_proj.weight, q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None))
    eps = getattr(layers[0].input_layernorm, "variance_epsilon", None) or cfg.rms_norm_eps
    return DecoderWeights(
        embed=base.embed_tokens.weight, layers=out, final_norm=base.norm.weight, lm_head=lm_head.weight,
        lm_head_bias=lm_head.bias, heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps,
        scaling=attn0.scaling, rotary=lambda x, pos: rotary(x, position_ids=pos), act=layers[0].mlp.act_fn,
        act_name=getattr(cfg, "hidden_act", None), rope_type=str(getattr(rotary, "rope_type", "default")))


def step_matrices(model) -> list | None:
    """The matrices one decode step of our decoder multiplies (fused, packed where packed), or None when
    transformers' forward runs."""
    decoder = runtime(model).decoder
    if decoder is None:
        return None
    w = decoder.w
    return [m for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [w.lm_head]


def text_config(model):
    """The language-model config (geometry the cache is built from)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def kv_geometry(model) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of the decoder."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def layer_devices(model) -> list[torch.device]:
    """The device of each decoder layer's weights, in order (one per layer; several GPUs when accelerate's
    device_map="auto" spread the layers): where that layer's KV cache lives and its activations go."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    fallback = next(model.parameters()).device
    if layers is None:
        return [fallback] * kv_geometry(model)[0]
    out = []
    for layer in layers:
        first = next(layer.parameters(), None)
        out.append(first.device if first is not None else fallback)
    return out


def attention_kernels_line(model, backend: str, device: torch.device) -> str:
    """The attention kernels this model's calls run (cache.attention.attention_kernels), as one line; on the CPU
    a decode step is one fused C call where the decoder built one (engine.kernels.fused)."""
    from ..cache.attention import attention_kernels, describe_kernels

    _, kv_heads, head_dim = kv_geometry(model)
    found = attention_kernels(backend, device, compute_dtype(model), kv_heads,
                              max(1, attention_heads(model) // kv_heads), head_dim)
    decoder = runtime(model).decoder
    if decoder is not None and decoder.fused is not None:  # what Decoder decided at load: one C call per step
        found["decode"] = found["scored decode"] = decoder.fused.describe()
    return describe_kernels(found)


def attention_heads(model) -> int:
    """Query heads per layer."""
    return text_config(model).num_attention_heads


def max_positions(model) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)
