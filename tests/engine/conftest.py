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


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), converted once, loaded once per test session."""
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(max_seq_len=4096))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as a HF folder (safetensors + the default model's tokenizer)."""
    from transformers import AutoTokenizer

    from engine.loader import resolve_source

    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama")
    # vocab must cover the tokenizer: use the default model's tokenizer but a 49152-token embedding
    source = resolve_source("default")
    tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder
