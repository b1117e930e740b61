"""Every compression policy in the registry against the invariants they all share, and the fused decode step's
score update against each policy's own `observe` (so a change to a policy cannot be bypassed on the CPU path)."""

import pytest
import torch

from engine.cache import CacheSettings, DSV41Cache, policies
from engine.cache.budget import largest, plan_compaction, plan_compactions
from engine.cache.storage import LayerKV
from engine.config import KNOBS

NAMES = sorted(policies.POLICIES)


def _layer(n=80, heads=2, seed=0):
    torch.manual_seed(seed)
    layer = LayerKV(heads, 8, torch.float32, "cpu")
    layer.append(torch.randn(heads, n, 8), torch.randn(heads, n, 8), torch.arange(n))
    layer.scores[:, :n] = torch.rand(heads, n)
    return layer


def test_the_registry_and_the_knob_agree():
    assert set(policies.POLICIES) == set(KNOBS["ced_policy"].kind)
    for name, cls in policies.POLICIES.items():
        assert cls.name == name and issubclass(cls, policies.Policy)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("when", [policies.STREAM, policies.PROBE, policies.QUESTION])
def test_rank_is_one_finite_value_per_entry_and_leaves_the_scores_alone(name, when):
    layer = _layer()
    before = layer.scores.clone()
    policy = policies.make(CacheSettings(ced_policy=name))
    rank = policy.rank(layer, when, torch.Generator().manual_seed(0))
    assert rank.shape == (2, layer.length) and rank.dtype.is_floating_point
    assert torch.isfinite(rank).all()
    assert torch.equal(layer.scores, before)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("when", [policies.STREAM, policies.PROBE, policies.QUESTION])
def test_a_compaction_by_any_policy_keeps_sinks_recent_and_order_within_budget(name, when):
    layer = _layer(n=120)
    policy = policies.make(CacheSettings(ced_policy=name))
    plan = plan_compaction(policy.rank(layer, when, torch.Generator().manual_seed(1)), 50, sink=4, recent=8,
                           threshold=0.0)
    layer.keep(plan.keep)
    assert layer.length == 50
    for head in range(2):
        kept = layer.positions[head, :50].tolist()
        assert kept == sorted(kept)
        assert set(range(4)) | set(range(112, 120)) <= set(kept)


@pytest.mark.parametrize("name", NAMES)
def test_observe_uses_attention_only_when_the_policy_says_so(name):
    policy = policies.make(CacheSettings(ced_policy=name))
    if not policy.uses_attention:
        assert name in ("streaming", "random")
        return
    scores = torch.rand(2, 30)
    attention = torch.rand(2, 30)
    before = scores.clone()
    policy.observe(scores, attention, 1, prefill=False)
    assert not torch.equal(scores, before)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("decay", [0.9, 0.995, 1.0])
def test_the_fused_steps_update_is_the_policys_own_observe(name, decay):
    """The C step applies scores <- decay * scores + attention with the decay `decode_decay()` declares; that
    must equal what `observe` does for one decode token, over all entries and over a sparse CSA2 index."""
    policy = policies.make(CacheSettings(ced_policy=name, ced_decay=decay))
    if not policy.uses_attention:
        return
    fused = policy.decode_decay()
    if fused is None:  # the policy asks to be called back: nothing to compare
        return
    torch.manual_seed(3)
    scores, attention = torch.rand(2, 40), torch.rand(2, 40)
    expected = scores.clone()
    policy.observe(expected, attention, 1, prefill=False)
    assert torch.allclose(scores * fused + attention, expected, atol=1e-6)
    index = torch.stack([torch.randperm(40)[:10] for _ in range(2)])
    sparse, expected = scores.clone(), scores.clone()
    policy.observe(expected, attention[:, :10], 1, index, prefill=False)
    sparse.mul_(fused).scatter_add_(1, index, attention[:, :10])
    assert torch.allclose(sparse, expected, atol=1e-6)


class _Squared(policies.Policy):
    """A policy whose decode update is not `decay * s + a`: the fused step must call it back."""

    name = "squared"

    def observe(self, scores, attention, steps, index=None, *, prefill):
        scores.add_(attention.square() if index is None else torch.zeros_like(scores).scatter_add_(
            1, index, attention.square()))

    def decode_decay(self):
        return None


def test_a_policy_without_the_fused_form_sends_every_layer_back_to_python(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, "squared", _Squared)
    settings = CacheSettings(kv_cache_ratio=0.5)
    cache = DSV41Cache(2, 2, 8, torch.float32, "cpu", settings)
    object.__setattr__(settings, "ced_policy", "squared")  # a registered policy the knob does not list
    cache.begin_forward(1, prefill=False)
    plan = cache.fused_plan()
    assert plan is not None and plan.by_python == [True, True]
    cache.abort_forward()
    monkeypatch.setattr(cache.settings, "ced_policy", "ced")
    cache.begin_forward(1, prefill=False)
    plan = cache.fused_plan()
    assert plan.by_python == [False, False] and plan.score and plan.decay == settings.ced_decay


def _topk_mask(x: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.topk(count, dim=-1).indices, True)


def test_a_compaction_keeps_the_entries_topk_keeps():
    """largest (one selection and a comparison) keeps what topk keeps: on distinct values, on values that tie at the
    boundary (where topk's own choice is taken), with NaN among them, and at the edges of count; and a plan of many
    layers is the plan of each alone, the sinks and recent window kept."""
    g = torch.Generator().manual_seed(3)
    for m, count in ((2714, 2449), (1000, 300), (37, 1), (37, 36)):
        x = torch.rand(5, 3, m, generator=g)
        assert torch.equal(largest(x, count), _topk_mask(x, count))
    ties = torch.randint(0, 4, (4, 3, 500), generator=g).float()
    assert torch.equal(largest(ties, 123), _topk_mask(ties, 123))
    nan = torch.rand(3, 200, generator=g)
    nan[1, 5] = float("nan")
    assert torch.equal(largest(nan, 50), _topk_mask(nan, 50))
    assert not largest(nan, 0).any() and largest(nan, 200).all()
    ranks = [torch.rand(3, 300, generator=g) for _ in range(4)]
    plans = plan_compactions(ranks, 100, sink=4, recent=16, threshold=0.0)
    for rank, plan in zip(ranks, plans, strict=True):
        alone = plan_compaction(rank, 100, sink=4, recent=16, threshold=0.0)
        assert torch.equal(plan.keep, alone.keep) and torch.equal(plan.drop, alone.drop)
        top = rank[:, 4:284].topk(80, dim=-1).indices.sort(dim=-1).values + 4
        assert torch.equal(plan.kept_unprotected, top)
        assert torch.equal(plan.keep, torch.cat([torch.arange(4).expand(3, -1), top, torch.arange(284, 300).expand(3, -1)], 1))
        assert torch.equal(torch.sort(torch.cat([plan.keep, plan.drop], 1), dim=1).values, torch.arange(300).expand(3, -1))
