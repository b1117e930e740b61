"""engine.fit: the "fits your machine" estimate's parts and verdicts (its measured error: benchmarks/fit_estimate.py)."""

from __future__ import annotations

import pytest

from engine import fit

CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def test_gguf_quantization_is_read_from_the_file_name():
    assert fit.gguf_bits("Llama-3-8B-Instruct.Q4_K_M.gguf") == 4.5
    assert fit.gguf_bits("model-q8_0.gguf") == 8.5
    assert fit.gguf_bits("SmolLM2-135M-Instruct.Q4_1.gguf") == 5.0
    assert fit.gguf_bits("model-f16.gguf") == 16.0 and fit.gguf_bits("model.gguf") == 16.0


def test_weights_as_held_bf16_int8_int4():
    eight_gb = 16 * 10**9  # an 8B model in bf16
    assert fit.weight_bytes(eight_gb, kind="safetensors") == eight_gb
    assert fit.weight_bytes(eight_gb, kind="safetensors", weight_quant="int8") == pytest.approx(eight_gb / 2 * 1.0625)
    assert fit.weight_bytes(eight_gb, kind="safetensors", weight_quant="int4") < eight_gb / 3
    # a GGUF in a type the CPU kernels hold: its own bytes on a CPU; bf16 on a GPU (8B params), or in a type not held
    assert fit.weight_bytes(4_500_000_000, kind="gguf", file_name="x.Q4_K_M.gguf") == 4_500_000_000
    assert fit.weight_bytes(4_500_000_000, kind="gguf", file_name="x.Q4_K_M.gguf", device="cuda") == 16 * 10**9
    assert fit.weight_bytes(5_500_000_000, kind="gguf", file_name="x.Q5_0.gguf") == 16 * 10**9
    assert fit.weight_bytes(4_500_000_000, kind="gguf", file_name="x.Q4_K_M.gguf", weight_quant="int8") == \
        pytest.approx(8 * 10**9 * 1.0625)
    assert fit.weight_bytes(1, kind="gguf", params=1000) == 2000


def test_kv_follows_the_models_geometry_the_ratio_and_the_cold_tier():
    per_token = 30 * 2 * 3 * 64 * 2
    hot = fit.kv_bytes(CONFIG, 1000, ratio=1.0, cold_tier=False)
    assert hot == 1000 * (per_token + 30 * 3 * fit.BOOKKEEPING_BYTES)
    half = fit.kv_bytes(CONFIG, 1000, ratio=0.5, cold_tier=False)
    assert half == hot // 2
    with_cold = fit.kv_bytes(CONFIG, 1000, ratio=0.5)
    assert with_cold - half == 500 * 30 * 2 * 3 * (64 + 4)  # int8 entries and a float32 scale each
    assert fit.kv_bytes(CONFIG, 100, ratio=0.5, cold_tier=False) == fit.kv_bytes(CONFIG, 100, ratio=1.0,
                                                                                 cold_tier=False)  # the floor


def test_the_verdict_and_its_words():
    estimate = fit.FitEstimate(weights=4 * fit.GB, kv=1 * fit.GB, working=1 * fit.GB, free=10 * fit.GB, where="VRAM")
    assert estimate.verdict == "fits" and estimate.describe().startswith("fits: 6.00 GB of 10.00 GB free VRAM")
    assert fit.FitEstimate(7 * fit.GB, 1 * fit.GB, 1 * fit.GB, 10 * fit.GB, "RAM").verdict == "tight"
    assert fit.FitEstimate(9 * fit.GB, 1 * fit.GB, 1 * fit.GB, 10 * fit.GB, "RAM").verdict == "will not fit"
    big = fit.estimate({**CONFIG, "num_hidden_layers": 32}, 16 * 10**9, kind="safetensors", context=8192,
                       free=8 * fit.GB, device="cuda")
    assert big.verdict == "will not fit" and big.where == "VRAM"


@pytest.mark.model
def test_a_local_gguf_counts_its_parameters_from_its_tensor_table():
    from engine import loader

    params = fit.gguf_parameters(loader.default_gguf_path())
    assert params is not None and 130e6 < params < 140e6  # SmolLM2-135M


def test_a_float32_checkpoint_is_counted_at_its_parameters():
    f32 = fit.estimate({**CONFIG, "torch_dtype": "float32"}, 542_000_000, kind="safetensors", context=1024, free=fit.GB)
    bf16 = fit.estimate({**CONFIG, "dtype": "bfloat16"}, 271_000_000, kind="safetensors", context=1024, free=fit.GB)
    assert f32.weights == bf16.weights == 271_000_000  # 135.5M parameters held as bf16 either way
