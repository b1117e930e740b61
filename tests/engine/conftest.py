from __future__ import annotations

import pytest


def tiny_model(arch: str = "llama", *, layers: int = 2, seed: int = 0):
    """A random-weight causal LM with GQA (4 query heads, 2 KV heads), built in-process."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    else:
        raise ValueError(arch)
    return model.eval()


@pytest.fixture(name="tiny_model")
def tiny_model_fixture():
    return tiny_model


