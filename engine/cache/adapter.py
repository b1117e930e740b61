"""The ONE place that touches transformers internals (attention registry, mask registry, forward kwargs).

How the DS-V4.1 cache plugs in: we register an attention implementation "dsv41" and run the model
with `use_cache=False`, so transformers never builds its own cache; each attention layer hands us the
RoPE'd query/key/value of the new tokens and we append, score, select and attend against our cache
(passed down as a forward kwarg). Masks are ours as well, so transformers' mask builder returns None.
Tested with the transformers range pinned in pyproject.toml; when transformers renames something,
only this file changes.
"""

from __future__ import annotations

import torch

SUPPORTED_ARCHITECTURES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}
ATTENTION_NAME = "dsv41"
_CACHE_KWARG = "dsv41_cache"
_registered = False


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
        raise RuntimeError("dsv41 attention called without a DS-V4.1 cache; run the model through engine.cache.adapter")
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


def install(model) -> None:
    """Switch a loaded HF causal LM to the DS-V4.1 attention path."""
    check_architecture(getattr(model.config, "model_type", None))
    register()
    model.set_attn_implementation(ATTENTION_NAME)


@torch.inference_mode()
def forward(model, input_ids: torch.Tensor, cache, *, score_window: int | None = None, prefill: bool | None = None,
            logits_to_keep: int = 1) -> torch.Tensor:
    """Run `input_ids` [1, T] through the model against `cache`; returns logits [1, logits_to_keep, V] (float32)."""
    position_ids = cache.begin_forward(input_ids.shape[1], score_window=score_window, prefill=prefill)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                    logits_to_keep=logits_to_keep, **{_CACHE_KWARG: cache})
    except BaseException:
        cache.abort_forward()
        raise
    cache.end_forward()
    return out.logits.float()


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


def max_positions(model) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)
