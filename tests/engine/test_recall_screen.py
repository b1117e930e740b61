"""benchmarks/recall_screen.py compares ways of scoring the cold tier for a recall; its comparison must be right:
the exact way is the shipped recall_mass, a screen at full rank recalls exactly what the exact recall recalls, and
the re-rank scores its candidates exactly."""

import pytest
import torch

from benchmarks.recall_screen import rank_ways
from engine import kernels
from engine.kernels.quant import quantize_int8


def _record(seed: int, spans: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, groups, d, s, c, tq = 2, 3, 16, 48, 400, 8
    keys = torch.randn(h, c, d, generator=g) * torch.linspace(0.3, 3.0, d)  # uneven channels, as real keys
    stored, scales = quantize_int8(keys)
    query = torch.randn(h * groups, tq, d, generator=g) * 2
    q = query.reshape(h, -1, d)
    return {"question": query, "hot": torch.randn(h, s, d, generator=g) * torch.linspace(0.3, 3.0, d),
            "cold": stored, "cold_scales": scales,
            "positions": torch.randperm(c, generator=g).to(torch.int32).expand(h, -1).contiguous(),
            "log_counts": None, "moment": q.transpose(1, 2) @ q / q.shape[1], "scaling": 0.25, "take": 64,
            "spans": spans}


@pytest.mark.parametrize("spans", [0, 16])
def test_a_full_rank_screen_recalls_what_the_exact_recall_recalls(spans):
    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    full = rank_ways(_record(1, spans), rank=16, repeat=1)
    assert full["exact"]["same_as_exact"] == 1.0
    assert full["screen"]["same_as_exact"] > 0.99
    # candidates picked by their best row's logit, the softmax over hot and candidates only: nearly the same
    assert full["screen + rerank"]["same_as_exact"] > 0.95
    low = rank_ways(_record(1, spans), rank=1, repeat=1)
    assert low["screen"]["same_as_exact"] < 0.95  # rank 1 loses entries the exact ranking keeps ...
    assert low["screen + rerank"]["same_as_exact"] >= low["screen"]["same_as_exact"]  # ... the re-rank wins some back
    assert full["cold_entries"] == 400 and full["take"] == 64


def test_recall_cost_times_one_layers_scoring_both_ways_and_they_recall_the_same_entries():
    from benchmarks.recall_cost import scoring

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    out = scoring({"heads": 2, "rows": 12, "tq": 4, "dim": 16, "hot": 50, "cold": 700}, rounds=2)
    assert out["torch_ms"] > 0 and out["c_ms"] > 0 and out["recalled"] == 512
    assert out["max_difference_of_largest"] < 1e-4 and out["same_recalled_share"] == 1.0


def test_recall_cost_times_the_scoring_products_and_says_how_far_each_is_from_float32():
    from benchmarks.recall_cost import products

    out = products({"heads": 2, "rows": 6, "dim": 16, "cold": 40}, rounds=2)
    assert out["float32"]["max_error_of_largest"] == 0.0
    assert 0 < out["bf16"]["max_error_of_largest"] < 0.02  # bf16 rounding, not a wrong product
    if "int8" in out:
        assert 0 < out["int8"]["max_error_of_largest"] < 0.03
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in out.values())
