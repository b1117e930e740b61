"""engine.kernels.sample.sample_head (one kernel call) against engine.sampling's torch path: the same distribution,
drawn where the inverse of its cumulative mass puts `u`; and next_token, which takes it on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine import GenerationSettings
from engine import kernels as cpu_kernels
from engine.kernels.sample import sample_head
from engine.sampling import apply_repetition_penalty, head_probs, next_token, sample_tensor

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def _library(isa):
    return cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None


def _inverse_cdf(logits, seen, penalty, k, temperature, top_p, u):
    """The token torch's distribution puts at u (head_probs' order, descending), and how near u is to a boundary."""
    probs, ids = head_probs(apply_repetition_penalty(logits, seen, penalty), temperature, k, top_p)
    edges = probs.double().cumsum(0) / probs.double().sum()
    at = int(torch.searchsorted(edges, torch.tensor([u], dtype=torch.float64), right=True))
    at = min(at, len(ids) - 1)
    return int(ids[at]), float((edges - u).abs().min())


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("vocab, k, temperature, top_p, penalty", [
    (49152, 50, 0.7, 0.9, 1.1),  # the app's defaults on the default model's vocabulary
    (1000, 50, 1.0, 1.0, 1.0),
    (1003, 7, 0.3, 0.5, 1.8),
    (40, 40 - 1, 2.0, 0.95, 1.3),  # k + seen ids past the vocabulary
])
def test_the_kernel_draws_the_torch_distribution(isa, vocab, k, temperature, top_p, penalty):
    library = _library(isa)
    g = torch.Generator().manual_seed(vocab + k)
    for trial in range(3):
        logits = torch.randn(vocab, generator=g) * 3
        logits[torch.randint(0, vocab, (5,), generator=g)] = float("-inf")
        seen = torch.randint(0, vocab, (30,), generator=g)
        seen = torch.cat((seen, seen[:10], logits.topk(5).indices))  # repeats, and the best tokens seen
        checked = 0
        for u in torch.linspace(0, 1, 401, dtype=torch.float64)[:-1].tolist():
            want, margin = _inverse_cdf(logits, seen, penalty, k, temperature, top_p, u)
            if margin < 1e-5:  # float32 sums may put u on either side of a boundary
                continue
            got = sample_head(logits, seen, penalty, k, temperature, top_p, u, library=library)
            assert got == want, (trial, u)
            checked += 1
        assert checked > 300


def _ties_by_id(logits, seen, penalty, k, temperature, top_p, u):
    """_inverse_cdf with the k best ordered by value, then by the lower id (a stable sort, not torch.topk)."""
    values = apply_repetition_penalty(logits, seen, penalty).double()
    order = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))[:k]
    top = values[order]
    probs = torch.softmax(top / temperature, 0)
    keep = int(((probs.cumsum(0) - probs) <= top_p).sum())
    edges = probs[:keep].cumsum(0) / probs[:keep].sum()
    at = min(int(torch.searchsorted(edges, torch.tensor([u], dtype=torch.float64), right=True)), keep - 1)
    return order[at], float((edges - u).abs().min())


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("order", ["ascending", "few levels"])
def test_the_kernel_keeps_the_right_candidates_when_every_value_enters_or_many_are_equal(isa, order):
    """The pass keeps a buffer of candidates above the running k + s-th best and cuts it back when full: logits in
    ascending order make every value enter (the buffer cut back ~vocab / K times), logits of a few distinct values
    make the cut split long runs of equal values: the torch distribution where the values differ; where they tie,
    the kernel's own order (of equal values the lower id first; torch.topk's order among ties is its own)."""
    library = _library(isa)
    g = torch.Generator().manual_seed(11)
    vocab, k = 5000, 20
    if order == "ascending":
        logits = torch.sort(torch.randn(vocab, generator=g) * 3).values
    else:
        logits = torch.randint(0, 6, (vocab,), generator=g).float()
    seen = torch.cat((torch.randint(0, vocab, (40,), generator=g), logits.topk(8).indices))
    for penalty in (1.0, 1.3):
        checked = 0
        for u in torch.linspace(0, 1, 201, dtype=torch.float64)[:-1].tolist():
            want, margin = (_inverse_cdf if order == "ascending" else _ties_by_id)(logits, seen, penalty, k, 0.8,
                                                                                    0.95, u)
            if margin < 1e-5:
                continue
            assert sample_head(logits, seen, penalty, k, 0.8, 0.95, u, library=library) == want, (penalty, u)
            checked += 1
        assert checked > 150


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_kernel_leaves_undecided_logits_to_torch_and_refuses_bad_arguments(isa):
    library = _library(isa)
    none = torch.tensor([], dtype=torch.long)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    for value in (float("nan"), float("inf")):
        for at in (3, 250):  # in the heap's first fill, and in the vectorised scan
            bad = logits.clone()
            bad[at] = value
            assert sample_head(bad, none, 1.0, 10, 0.7, 0.9, 0.5, library=library) is None
    assert sample_head(torch.full((300,), float("-inf")), none, 1.0, 10, 0.7, 0.9, 0.5, library=library) is None
    ties = torch.zeros(300)
    ties[[17, 5, 200]] = 4.0  # equal best: the lower id first
    assert sample_head(ties, none, 1.0, 1, 0.7, 1.0, 0.99, library=library) == 5
    assert sample_head(ties, none, 1.0, 3, 0.7, 1.0, 0.0, library=library) == 5
    assert sample_head(ties, none, 1.0, 3, 0.7, 1.0, 0.99, library=library) == 200
    with pytest.raises(ValueError):
        sample_head(logits, none, 1.0, 10, 0.7, 0.9, 1.0, library=library)  # u must be below 1
    with pytest.raises(ValueError):
        sample_head(logits, torch.tensor([300]), 1.1, 10, 0.7, 0.9, 0.5, library=library)
    with pytest.raises(ValueError):
        sample_head(logits, none, 1.0, 0, 0.7, 0.9, 0.5, library=library)


def test_next_token_samples_cpu_logits_in_the_kernel_reproducibly(monkeypatch):
    """next_token on CPU float32 logits with top-k draws in the kernel (no tensor: None) from the generator's uniform
    numbers, so a seed gives the same tokens; without the kernels it is sample_tensor's draw."""
    settings = GenerationSettings(seed=3)  # the app's defaults: temperature 0.7, top_k 50, top_p 0.9, penalty 1.1
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1))
    seen = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(2))
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(3)
        draws.append([next_token(logits, settings, seen, g) for _ in range(20)])
    assert draws[0] == draws[1] and all(ids is None for _, ids in draws[0])
    assert len({token for token, _ in draws[0]}) > 1  # a draw, not the argmax
    g = torch.Generator().manual_seed(3)
    u = float(torch.rand((), generator=g, dtype=torch.float64))
    assert draws[0][0][0] == _inverse_cdf(logits, seen, 1.1, 50, 0.7, 0.9, u)[0]
    import engine.kernels.sample as module

    monkeypatch.setattr(module, "load", lambda: None)  # no kernels: the torch path, its tensor returned
    token, ids = next_token(logits, settings, seen, torch.Generator().manual_seed(3))
    assert ids is not None and token == int(ids)
    assert token == int(sample_tensor(logits, settings, seen, torch.Generator().manual_seed(3)))
