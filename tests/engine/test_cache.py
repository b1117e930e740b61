"""The DS-V4.1 cache on tiny random-weight GQA models: exactness and the compaction invariants."""

import math

import pytest
import torch

from engine.cache import CacheSettings, DSV41Cache, csa2, merge, policies
from engine.cache import budget as budget_mod
from engine.cache.policies import ced as ced_policy
from engine.cache.storage import LayerKV
from engine.models import adapter


def ranking(layer, policy, *, pooled=False, spans=False):
    """A policy's ranking at the compaction a (pooled, spans) pair stands for: spans after a question,
    pooled after a probe of it, neither while text streams in."""
    when = policies.QUESTION if spans else policies.PROBE if pooled else policies.STREAM
    return policies.POLICIES[policy](CacheSettings(ced_policy=policy)).rank(layer, when)


def make_cache(model, backend="sdpa", **knobs):
    layers, kv_heads, head_dim = adapter.kv_geometry(model)
    return DSV41Cache(layers, kv_heads, head_dim, torch.float32, "cpu", CacheSettings(**knobs), backend=backend)


def run_ids(model, cache, ids, prefill=24, chunk=10):
    """Chunked prefill of ids[:prefill], then one token at a time; returns logits for every position."""
    outs = []
    for start in range(0, prefill, chunk):
        end = min(start + chunk, prefill)
        outs.append(adapter.forward(model, ids[:, start:end], cache, logits_to_keep=end - start))
    for i in range(prefill, ids.shape[1]):
        outs.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("fast", [True, False], ids=["fused-decoder", "transformers-forward"])
def test_plain_cache_reproduces_transformers_logits(arch, backend, fast, tiny_model):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 48))
    with torch.no_grad():
        reference = model(ids).logits
    adapter.install(model, fast=fast)
    assert adapter.uses_fast_decoder(model) == fast
    cache = make_cache(model, backend, kv_cache_ratio=1.0, csa2_topk=0)
    got = run_ids(model, cache, ids)
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-4), (got - reference).abs().max()
    assert cache.seen == 48 and cache.stored == 48


def test_sparse_path_with_topk_covering_everything_equals_dense(monkeypatch, tiny_model):
    model = tiny_model("llama")
    adapter.install(model)
    ids = torch.randint(0, 256, (1, 60))
    dense = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids, prefill=40)
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=1000, ced_sink_tokens=4, ced_recent_tokens=8)
    used = []
    original = cache._sparse_decode
    monkeypatch.setattr(cache, "_sparse_ready", lambda layer: layer.projected_keys is not None)
    monkeypatch.setattr(cache, "_sparse_decode", lambda *a: used.append(1) or original(*a))
    monkeypatch.setattr("engine.cache.csa2.RECALL_EVERY", 1)
    outs = [adapter.forward(model, ids[:, :40], cache, logits_to_keep=40)]
    for layer in cache.layers:
        csa2.fit(layer, 2)
    for i in range(40, 60):
        outs.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False))
    got = torch.cat(outs, dim=1)
    assert used, "the CSA2 path was not taken"
    assert torch.allclose(got, dense, atol=1e-5, rtol=1e-4)
    assert cache.stats().csa2_recall == 1.0  # top-k covering every candidate finds all of the exact top-k


def test_csa2_recall_is_one_with_full_rank_projection():
    torch.manual_seed(1)
    layer = LayerKV(2, 16, torch.float32, "cpu")
    layer.append(torch.randn(2, 300, 16), torch.randn(2, 300, 16), torch.arange(300))
    csa2.fit(layer, 16)  # rank = head_dim: screening is exact
    q = torch.randn(4, 1, 16)
    _, top = csa2.screen(layer, q, 32, 4, 16)
    assert csa2.exact_topk_recall(layer, q, top, 4, 16) == 1.0
    csa2.fit(layer, 2)
    _, top = csa2.screen(layer, q, 32, 4, 16)
    assert csa2.exact_topk_recall(layer, q, top, 4, 16) < 1.0  # rank 2 of random keys is lossy


def drive(cache_knobs, steps=80, prefill=120):
    from .conftest import tiny_model

    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model, **cache_knobs)
    ids = torch.randint(0, 256, (1, prefill + steps))
    budgets = []
    adapter.forward(model, ids[:, :prefill], cache)
    cache.compact()
    budgets.append((cache.stored, cache.budget()))
    for i in range(prefill, prefill + steps):
        adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)
        if cache.after_decode_step():
            budgets.append((cache.stored, cache.budget()))
    return model, cache, budgets


@pytest.mark.parametrize("mode", ["evict", "merge"])
@pytest.mark.parametrize("policy", ["ced", "h2o", "snapkv", "streaming", "random"])
def test_budget_holds_after_every_compaction(mode, policy):
    _, cache, budgets = drive(dict(kv_cache_ratio=0.4, ced_mode=mode, ced_policy=policy, ced_sink_tokens=4,
                                   ced_recent_tokens=16, csa2_topk=0))
    assert len(budgets) >= 3
    for stored, budget in budgets:
        assert stored <= budget
    for layer in cache.layers:  # every head of a layer holds the same count (rectangular), within budget
        assert layer.length <= cache.budget() or cache.decode_steps % 16
        assert layer.keys.shape[0] == layer.kv_heads and layer.positions[:, : layer.length].shape[1] == layer.length


@pytest.mark.parametrize("mode", ["evict", "merge"])
def test_sinks_and_recent_window_always_kept(mode):
    _, cache, _ = drive(dict(kv_cache_ratio=0.3, ced_mode=mode, ced_sink_tokens=4, ced_recent_tokens=16, csa2_topk=0))
    cache.compact(target=cache.stored - 10, threshold=False)
    seen = cache.seen
    for layer in cache.layers:
        pos = layer.positions[:, : layer.length]
        for head in range(layer.kv_heads):
            kept = set(pos[head].tolist())
            assert set(range(4)) <= kept
            assert set(range(seen - 16, seen)) <= kept
        assert torch.all(pos[:, 1:] > pos[:, :-1])  # position order is preserved


@pytest.mark.parametrize("policy,pooled", [("h2o", True), ("ced", False), ("ced", True)])
def test_evict_keeps_the_highest_scores(policy, pooled):
    """Ranked by raw score; the question-aware compaction of ced ranks by score max-pooled over
    neighbours (kept phrases); h2o never pools."""
    torch.manual_seed(0)
    layer = LayerKV(2, 8, torch.float32, "cpu")
    layer.append(torch.randn(2, 50, 8), torch.randn(2, 50, 8), torch.arange(50))
    layer.scores[:, :50] = torch.rand(2, 50)
    rank = ranking(layer, policy, pooled=pooled).clone()
    if policy == "h2o" or not pooled:
        assert torch.equal(rank, layer.scores[:, :50])
    else:
        pooled = torch.nn.functional.max_pool1d(layer.scores[:, None, :50], 7, stride=1, padding=3)[:, 0]
        assert torch.all(rank >= pooled) and torch.all(rank <= pooled + 1e-3)
    plan = budget_mod.plan_compaction(rank, 20, sink=2, recent=5, threshold=0.0)
    layer.keep(plan.keep)
    assert layer.length == 20
    for head in range(2):
        kept = set(layer.positions[head, :20].tolist())
        expected = set(range(2)) | set(range(45, 50)) | set((rank[head, 2:45].topk(13).indices + 2).tolist())
        assert kept == expected


def test_question_aware_ced_compaction_keeps_whole_spans():
    """After a question scored everything, CED keeps and drops whole spans of SPAN_TOKENS positions, chosen by
    their total score, so the kept text reads as text; the baselines still pool."""
    torch.manual_seed(1)
    span = ced_policy.SPAN_TOKENS
    n = 12 * span
    layer = LayerKV(2, 8, torch.float32, "cpu")
    layer.append(torch.randn(2, n, 8), torch.randn(2, n, 8), torch.arange(n))
    layer.scores[:, :n] = torch.rand(2, n) * 0.1
    best = [3, 7, 9]  # the spans the question attended to, a few tokens each
    for s_i in best:
        layer.scores[:, s_i * span + 2: s_i * span + 5] += 1.0
    layer.scores[:, 5 * span + 1] += 2.5  # one sharp token alone: its span totals less than the three above
    rank = ranking(layer, "ced", spans=True)
    plan = budget_mod.plan_compaction(rank, 3 * span, sink=0, recent=0, threshold=0.0)
    layer.keep(plan.keep)
    for head in range(2):
        kept = sorted(layer.positions[head, : layer.length].tolist())
        assert kept == [p for s_i in best for p in range(s_i * span, (s_i + 1) * span)]
    # the baselines keep pooling: spans change nothing for them
    assert torch.equal(ranking(layer, "snapkv", pooled=True, spans=True),
                       ranking(layer, "snapkv", pooled=True))


def test_span_ranking_follows_positions_not_storage_order():
    scores = torch.tensor([[1.0, 1.0, 0.5, 3.0]])
    positions = torch.tensor([[0, 1, 16, 40]])  # spans 0, 0, 1, 2 (entries between them were evicted before)
    rank = ced_policy.span_ranking(scores, positions, 16)
    assert torch.allclose(rank[0, :2], torch.tensor([2 / 16 + 1e-3] * 2))
    assert torch.allclose(rank[0, 2:], torch.tensor([0.5 / 16 + 5e-4, 3.0 / 16 + 3e-3]))


def test_threshold_drops_low_entries_even_under_budget():
    layer = LayerKV(1, 4, torch.float32, "cpu")
    layer.append(torch.randn(1, 30, 4), torch.randn(1, 30, 4), torch.arange(30))
    layer.scores[0, :30] = 1.0
    layer.scores[0, 10:15] = 0.01  # far below 0.1 x mean
    scores = layer.scores[:, :30]
    plan = budget_mod.plan_compaction(ranking(layer, "ced"), 1000, sink=2, recent=4, threshold=0.1, scores=scores)
    assert plan is not None and plan.keep.shape[1] == 25
    assert not set(range(10, 15)) & set(plan.keep[0].tolist())
    assert budget_mod.plan_compaction(ranking(layer, "ced"), 1000, sink=2, recent=4, threshold=0.0,
                               scores=scores) is None


def test_threshold_never_compacts_below_the_floor():
    layer = LayerKV(1, 4, torch.float32, "cpu")
    layer.append(torch.randn(1, 30, 4), torch.randn(1, 30, 4), torch.arange(30))
    layer.scores[0, :30] = 1.0
    layer.scores[0, 6:26] = 0.01  # 20 entries far below 0.1 x mean
    scores = layer.scores[:, :30]
    plan = budget_mod.plan_compaction(ranking(layer, "ced"), 1000, sink=2, recent=4, threshold=0.1, scores=scores,
                               floor=20)
    assert plan.keep.shape[1] == 20  # the threshold wanted 10; the floor keeps 20, the best of them
    assert set(range(2, 6)) <= set(plan.keep[0].tolist())
    assert budget_mod.plan_compaction(ranking(layer, "ced"), 1000, sink=2, recent=4, threshold=0.1, scores=scores,
                               floor=30) is None


def test_budget_floor_is_independent_of_the_recent_window():
    assert budget_mod.budget_for(40, 0.5, 4, 32) == budget_mod.MIN_STORED_ENTRIES == 128
    assert budget_mod.budget_for(1000, 0.5, 4, 32) == 500
    assert budget_mod.budget_for(100, 0.1, 4, 200) == 205  # sink + recent + 1 still holds when larger
    assert budget_mod.budget_for(40, 0.5, 4, 32, floor=0) == 37


def test_a_short_chat_is_never_compacted_at_the_defaults():
    """A 40-token exchange was compacted with a 32-token recent window (budget floor 37) and a greedy answer
    changed; below the floor nothing is dropped, by the budget or by the threshold."""
    from .conftest import tiny_model

    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model)  # the defaults: ratio 0.5, recent 32, threshold 0.1
    assert cache.settings.ced_recent_tokens == 32
    ids = torch.randint(0, 256, (1, 120))
    adapter.forward(model, ids[:, :100], cache)
    assert cache.compact() == 0 and cache.stored == 100
    for i in range(100, 120):
        adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)
        cache.after_decode_step()
    assert cache.stored == cache.seen == 120
    more = torch.randint(0, 256, (1, 200))
    adapter.forward(model, more, cache)
    assert cache.compact() > 0 and cache.stored <= cache.budget() == 160


def test_merge_counts_add_up_to_tokens_absorbed():
    _, cache, _ = drive(dict(kv_cache_ratio=0.3, ced_mode="merge", ced_sink_tokens=4, ced_recent_tokens=16,
                             csa2_topk=0))
    for layer in cache.layers:
        counts = layer.log_counts[:, : layer.length].exp().sum(dim=1)
        assert torch.allclose(counts, torch.full_like(counts, float(cache.seen)), rtol=1e-4)
        assert layer.merged_tokens == cache.seen - layer.length


def test_merged_slot_is_count_weighted_mean():
    layer = LayerKV(1, 2, torch.float32, "cpu")
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.0, 0.0]]])
    values = torch.tensor([[[2.0, 0.0], [0.0, 4.0], [4.0, 0.0], [9.0, 9.0]]])
    layer.append(keys, values, torch.arange(4))
    layer.scores[0, :4] = torch.tensor([5.0, 4.0, 1.0, 9.0])
    # no protection; keep 3 of 4: entry 2 (lowest) folds into entry 0 (most similar key)
    plan = budget_mod.plan_compaction(ranking(layer, "ced"), 3, sink=0, recent=0, threshold=0.0)
    merge.merge_into_kept(layer, plan)
    layer.keep(plan.keep)
    assert layer.positions[0, :3].tolist() == [0, 1, 3]
    assert torch.allclose(layer.read_values()[0, 0], torch.tensor([3.0, 0.0]))
    assert torch.allclose(layer.read_keys()[0, 0], torch.tensor([1.0, 0.05]))
    assert math.isclose(float(layer.log_counts[0, 0].exp()), 2.0, rel_tol=1e-6)
    assert float(layer.scores[0, 0]) == pytest.approx(6.0)


def test_new_tokens_get_position_equal_to_tokens_seen_after_eviction():
    model, cache, _ = drive(dict(kv_cache_ratio=0.3, ced_mode="evict", ced_sink_tokens=4, ced_recent_tokens=16,
                                 csa2_topk=0))
    assert cache.stored < cache.seen
    seen = cache.seen
    adapter.forward(model, torch.tensor([[5]]), cache, prefill=False)
    for layer in cache.layers:
        assert torch.all(layer.positions[:, layer.length - 1] == seen)


def test_int8_kv_attention_error_is_small(tiny_model):
    model = tiny_model("llama")
    adapter.install(model)
    ids = torch.randint(0, 256, (1, 64))
    ref = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids, prefill=48)
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0, kv_cache_dtype="int8")
    got = run_ids(model, cache, ids, prefill=48)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.02, rel
    assert cache.layers[0].keys.dtype == torch.int8
    fp_bytes = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0).bytes_per_token()
    assert cache.bytes_per_token() < 0.35 * fp_bytes


def test_failed_forward_rolls_back_every_layer(monkeypatch, tiny_model):
    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    adapter.forward(model, torch.randint(0, 256, (1, 10)), cache)
    calls = {"n": 0}
    original = cache.attend

    def failing(layer_idx, *args):
        calls["n"] += 1
        if layer_idx == 1:
            raise MemoryError("simulated out of memory")
        return original(layer_idx, *args)

    monkeypatch.setattr(cache, "attend", failing)
    with pytest.raises(MemoryError):
        adapter.forward(model, torch.tensor([[1, 2, 3]]), cache)
    assert calls["n"] == 2
    assert cache.seen == 10 and all(layer.length == 10 for layer in cache.layers)


def test_storage_grows_in_blocks_and_shrinks_after_compaction():
    layer = LayerKV(2, 8, torch.float32, "cpu", initial_capacity=256)
    assert layer.capacity == 256
    for i in range(600):
        layer.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.tensor([i]))
    assert layer.capacity % 256 == 0 and layer.capacity >= 600
    before = layer.nbytes()
    keep = torch.arange(100).expand(2, -1)
    layer.keep(keep)
    layer.shrink_to_fit(spare_tokens=0)
    assert layer.capacity == 256 and layer.nbytes() < before / 2


def test_unsupported_architecture_message_lists_supported():
    with pytest.raises(adapter.UnsupportedArchitecture, match="Llama, Mistral, Qwen2, Qwen3"):
        adapter.check_architecture("gpt2")


def test_csa2_bilinear_fit_follows_the_queries_not_just_the_keys():
    """Keys vary most along dims 0-7, but queries only look along dims 8-15: key eigenvectors screen
    on the wrong subspace, the bilinear fit (from observed prefill queries) on the right one."""
    torch.manual_seed(0)
    h, d, n = 2, 32, 600
    keys = torch.randn(h, n, d)
    keys[:, :, :8] *= 10.0
    queries = torch.zeros(h * 2, 50, d)
    queries[:, :, 8:16] = torch.randn(h * 2, 50, 8)

    def recall(with_queries: bool, rerank: int) -> float:
        layer = LayerKV(h, d, torch.float32, "cpu")
        layer.append(keys, keys.clone(), torch.arange(n))
        if with_queries:
            csa2.observe_queries(layer, queries)
        csa2.fit(layer, 8)
        q = torch.zeros(h * 2, 1, d)
        q[:, 0, 8:16] = torch.randn(h * 2, 8)
        _, top = csa2.screen(layer, q, 32, 4, 16, rerank=rerank)
        return csa2.exact_topk_recall(layer, q, top, 4, 16)

    assert recall(False, 1) < 0.5
    assert recall(True, 1) > 0.95
    assert recall(False, 4) > recall(False, 1)  # the exact re-rank recovers part of a poor screen


def test_csa2_is_dense_below_its_crossover_and_fits_when_the_cache_grows(monkeypatch):
    settings = CacheSettings(kv_cache_ratio=1.0, csa2_topk=16, ced_sink_tokens=2, ced_recent_tokens=4)
    cache = DSV41Cache(1, 2, 8, torch.float32, "cpu", settings)
    layer = cache.layers[0]
    layer.append(torch.randn(2, 100, 8), torch.randn(2, 100, 8), torch.arange(100))
    monkeypatch.setattr(csa2, "DENSE_BELOW", 12)  # 12 x 16 = 192 entries
    cache.fit_sparse()
    assert layer.projected_keys is None and not cache._sparse_ready(layer)
    layer.append(torch.randn(2, 100, 8), torch.randn(2, 100, 8), torch.arange(100, 200))
    cache.decode_steps = settings.compact_every
    cache.after_decode_step()
    assert layer.projected_keys is not None and cache._sparse_ready(layer)


def test_csa2_fits_a_layer_that_grew_past_its_crossover_whatever_layer_0_holds(monkeypatch):
    """The layers may hold different counts (the CED threshold): a reply's check for CSA2 looks at every layer, so a
    long layer gets its side cache although layer 0 is still short (dense there)."""
    settings = CacheSettings(kv_cache_ratio=1.0, csa2_topk=16, ced_sink_tokens=2, ced_recent_tokens=4)
    cache = DSV41Cache(2, 2, 8, torch.float32, "cpu", settings)
    monkeypatch.setattr(csa2, "DENSE_BELOW", 12)  # 12 x 16 = 192 entries
    short, long = cache.layers
    short.append(torch.randn(2, 100, 8), torch.randn(2, 100, 8), torch.arange(100))
    long.append(torch.randn(2, 200, 8), torch.randn(2, 200, 8), torch.arange(200))
    cache.decode_steps = settings.compact_every
    cache.after_decode_step()
    assert long.projected_keys is not None and short.projected_keys is None


def test_scores_age_by_scoring_steps_not_by_unscored_document_tokens(tiny_model, monkeypatch):
    """s <- decay^dt s + a with dt = scoring steps: a scored chunk ages older scores by decay^window, a
    document chunk read without scoring (waiting for its question) leaves them as they are."""
    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model, kv_cache_ratio=0.5, csa2_topk=0, ced_decay=0.9)
    adapter.forward(model, torch.randint(0, 256, (1, 12)), cache, score_window=12)
    before = cache.layers[0].scores[:, :12].clone()
    assert before.sum() > 0
    adapter.forward(model, torch.randint(0, 256, (1, 5)), cache, score_window=0)
    layer = cache.layers[0]
    assert torch.equal(layer.scores[:, :12], before)
    assert torch.all(layer.scores[:, 12:17] == 0)
    steps = []
    original = policies.CED.observe
    monkeypatch.setattr(policies.CED, "observe", lambda self, *a, **k: steps.append(a[2]) or original(self, *a, **k))
    expected = layer.scores[:, :17].clone() * 0.9**3
    adapter.forward(model, torch.randint(0, 256, (1, 10)), cache, score_window=3)
    assert steps == [3, 3]  # one observation per layer, aged by the window's 3 queries, not the 10 tokens
    assert torch.all(layer.scores[:, :17] >= expected - 1e-6)


def test_question_probe_collects_queries_and_leaves_the_cache_alone(tiny_model):
    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model, kv_cache_ratio=0.5, csa2_topk=0)
    adapter.forward(model, torch.randint(0, 256, (1, 30)), cache, score_window=8)
    before = [(layer.length, layer.scores[:, : layer.length].clone(), layer.keys[:, : layer.length].clone())
              for layer in cache.layers]
    probe = adapter.probe_queries(model, torch.randint(0, 256, (1, 6)), cache, start=100)
    assert cache.seen == 30
    assert sorted(probe) == list(range(len(cache.layers)))
    assert all(q.shape == (4, 6, 16) for q in probe.values())  # [query heads, tokens, head_dim]
    for layer, (length, scores, keys) in zip(cache.layers, before, strict=True):
        assert layer.length == length
        assert torch.equal(layer.scores[:, :length], scores) and torch.equal(layer.keys[:, :length], keys)
    # its queries then score every stored entry: each query's attention sums to one
    cache.score_with_probe(probe)
    for layer, (length, scores, _) in zip(cache.layers, before, strict=True):
        added = layer.scores[:, :length] - scores
        assert torch.allclose(added.sum(dim=1), torch.full((2,), 2 * 6.0), atol=1e-4)  # 2 heads/group x 6 queries


def test_scores_past_the_stored_length_stay_zero_after_keep_truncate_and_growth():
    torch.manual_seed(0)
    layer = LayerKV(2, 8, torch.float32, "cpu", initial_capacity=16)
    layer.append(torch.randn(2, 10, 8), torch.randn(2, 10, 8), torch.arange(10))
    layer.scores[:, :10] = 5.0
    layer.log_counts[:, :10] = 1.0
    layer.keep(torch.arange(4).repeat(2, 1))  # dropped slots 4..9 must not leak their scores
    layer.append(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.arange(10, 13))
    assert torch.equal(layer.scores[:, 4:7], torch.zeros(2, 3))
    assert torch.equal(layer.log_counts[:, 4:7], torch.zeros(2, 3))
    layer.scores[:, :7] = 2.0
    layer.truncate(5)  # an undone forward
    layer.append(torch.randn(2, 300, 8), torch.randn(2, 300, 8), torch.arange(13, 313))  # grows a block
    assert layer.length == 305 and layer.capacity >= 305
    assert torch.equal(layer.scores[:, 5:305], torch.zeros(2, 300))
    assert torch.equal(layer.log_counts[:, 4:305], torch.zeros(2, 301))


@pytest.mark.parametrize("policy, scoring_queries", [("ced", 40), ("h2o", 40), ("snapkv", 32)])
def test_streamed_chunk_is_scored_by_every_query_except_for_snapkv(tiny_model, policy, scoring_queries):
    """A chunk read as it streams (no explicit window): CED and H2O score it with all of its queries, as a
    decode step scores with each one; SnapKV with its last `score_window` queries only."""
    model = tiny_model("llama")
    adapter.install(model)
    cache = make_cache(model, kv_cache_ratio=0.5, csa2_topk=0, ced_policy=policy, ced_decay=1.0)
    assert cache.settings.score_window == 32
    adapter.forward(model, torch.randint(0, 256, (1, 40)), cache)
    for layer in cache.layers:  # each query's weights sum to one, for each of the group's 2 query heads
        mass = layer.scores[:, : layer.length].sum(dim=1)
        assert torch.allclose(mass, torch.full_like(mass, 2.0 * scoring_queries), atol=1e-3)


def test_bf16_prefill_attention_rounds_q_k_v_and_keeps_the_cache_float32(tiny_model):
    """DSV41Cache.prefill_bf16: prefill chunks (the first, causal, and later ones over earlier entries) attend
    with bf16 q, k, v; the result is float32 and within bf16 rounding of float32 attention; the stored keys
    and values are the same float32 values; one-token steps are untouched."""
    from engine.cache.attention import dense_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(4, 20, 16), torch.randn(2, 50, 16), torch.randn(2, 50, 16)
    for t, s in ((20, 20), (20, 50)):
        exact = dense_attention(q[:, :t], k[:, :s], v[:, :s], None, 0.25, "sdpa")
        rounded = dense_attention(q[:, :t], k[:, :s], v[:, :s], None, 0.25, "sdpa", bf16=True)
        reference = dense_attention(q[:, :t].bfloat16().float(), k[:, :s].bfloat16().float(),
                                    v[:, :s].bfloat16().float(), None, 0.25, "sdpa")
        assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
        assert torch.allclose(rounded, reference, atol=2e-2, rtol=2e-2)
        assert (rounded - exact).abs().max() < 0.05
    one = dense_attention(q[:, :1], k, v, None, 0.25, "sdpa", bf16=True)
    assert torch.equal(one, dense_attention(q[:, :1], k, v, None, 0.25, "sdpa"))

    model = tiny_model("llama")
    adapter.install(model)
    ids = torch.randint(0, 256, (1, 30))
    plain = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    halved = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    halved.prefill_bf16 = True
    a = run_ids(model, plain, ids, prefill=24, chunk=10)
    b = run_ids(model, halved, ids, prefill=24, chunk=10)
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.05 * a.abs().max()
    layer_a, layer_b = plain.layers[0], halved.layers[0]
    assert layer_b.keys.dtype == torch.float32
    assert torch.equal(layer_a.keys[:, :10], layer_b.keys[:, :10])  # the first chunk's keys come before attention


def test_every_layer_planned_together_as_one_at_a_time():
    """plan_compactions plans layers of one shape in one batch: each layer's plan is the one plan_compaction
    makes for it alone, the threshold's count per layer (here layers that want different counts, one that
    needs nothing dropped), and layers of other shapes planned one by one."""
    torch.manual_seed(4)
    ranks = [torch.rand(3, 60) for _ in range(5)]
    ranks[1][:, 10:50] *= 0.01  # below the threshold: this layer keeps fewer
    ranks[3][:, 6:54] = 1.0  # nothing low: the budget alone
    ranks.append(torch.rand(3, 40))  # another length
    knobs = dict(sink=2, recent=4, threshold=0.1, floor=8)
    for budget in (20, 45, 1000):
        together = budget_mod.plan_compactions(ranks, budget, scores=ranks, **knobs)
        alone = [budget_mod.plan_compaction(r, budget, scores=r, **knobs) for r in ranks]
        assert [p is None for p in together] == [p is None for p in alone]
        assert any(p is not None for p in alone)
        for got, want in zip(together, alone, strict=True):
            if want is not None:
                for name in ("keep", "drop", "kept_unprotected"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), (budget, name)
    counts = {p.keep.shape[1] for p in budget_mod.plan_compactions(ranks[:5], 1000, scores=ranks[:5], **knobs) if p}
    assert len(counts) > 1  # the threshold kept different counts in different layers


def _layers_apart(short: int):
    """Two layers (no cold tier) that the CED threshold left at different counts: 64 tokens read, ratio 0.5 (budget
    32), layer `short`'s scores on four entries (the threshold keeps them, the sinks and the recent window: 10), the
    other layer's even (the budget: 32)."""
    settings = CacheSettings(kv_cache_ratio=0.5, csa2_topk=0, ced_sink_tokens=2, ced_recent_tokens=4, min_entries=8,
                             ced_threshold=0.5, cold_tier="off")
    cache = DSV41Cache(2, 2, 8, torch.float32, "cpu", settings)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.append(torch.randn(2, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g), torch.arange(64))
        layer.scores[:, :64] = 1.0
    cache.seen = 64
    cache.layers[short].scores[:, :64] = 0.0
    cache.layers[short].scores[:, 20:24] = 1.0
    cache.compact()
    assert [layer.length for layer in cache.layers] == ([10, 32] if short == 0 else [32, 10])
    return cache


def _decode(cache, steps: int, seed: int = 1) -> list[int]:
    """`steps` one-token forwards through the cache's own attend, each followed by after_decode_step; what each
    step's compaction dropped."""
    g = torch.Generator().manual_seed(seed)
    dropped = []
    for _ in range(steps):
        cache.begin_forward(1, prefill=False)
        for index in range(cache.num_layers):
            cache.attend(index, torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g),
                         torch.randn(1, 2, 1, 8, generator=g), 8**-0.5)
        cache.end_forward()
        dropped.append(cache.after_decode_step())
    return dropped


@pytest.mark.parametrize("short", [0, 1])
def test_stored_is_the_mean_of_what_the_layers_keep_when_the_threshold_cut_them_apart(short):
    """The threshold cuts each layer to what its own scores want, so the layers keep different counts: `stored` (what
    the memory report and a turn's stats show) is their mean, stored / seen the share of the KV bytes kept, whichever
    layer is the short one; `longest` is the layer that keeps the most."""
    cache = _layers_apart(short)
    assert cache.stored == cache.stats().stored == 21 and cache.longest == 32
    element = 2 * cache.kv_heads * cache.head_dim * cache.kv_bytes_per_element  # K and V of one entry in one layer
    kept = sum(layer.length for layer in cache.layers) * element
    assert cache.stored / cache.seen == kept / cache.uncompressed_bytes()
    # the byte ratio is under the slider's 0.5 because of the threshold, and the reason says so
    ratio = cache.stored_kv_bytes() / cache.uncompressed_bytes()
    assert cache.ratio_reason(ratio).startswith("threshold 0.50 removed more")


def test_the_budget_and_the_headroom_hold_the_longest_layer_not_the_first():
    """With layer 0 the short one, the checks that keep every layer within the budget (a reply's compaction every
    compact_every steps, the turn's end), within a turn's headroom, and the room reserved for a turn go by the
    longest layer: by layer 0's count (or the mean) the other layer would pass them."""
    cache = _layers_apart(0)
    dropped = _decode(cache, cache.settings.compact_every)  # seen 80, budget 40: layer 0 holds 26, layer 1 48
    assert dropped[-1] > 0 and all(layer.length <= cache.budget() for layer in cache.layers)

    cache = _layers_apart(0)
    _decode(cache, 10)  # seen 74, budget 37: layer 0 holds 20, layer 1 42; no compaction yet
    assert cache.longest == 42 > cache.budget() > cache.stored
    cache.finish_turn()
    assert all(layer.length <= cache.budget() for layer in cache.layers)

    cache = _layers_apart(0)
    cache.start_prefill(490, 0, None)  # storage grows in blocks of 256: 10 + 490 would fit in 512
    assert all(layer.capacity >= layer.length + 490 for layer in cache.layers)  # room for the turn in every layer
    prefill = cache.start_prefill(12, 0, 40)
    cache.before_chunk(prefill, 12)  # layer 1's 32 and the chunk's 12 pass the headroom of 40
    assert prefill.compacted and all(layer.length + 12 <= 40 for layer in cache.layers)


@pytest.mark.parametrize("int8", [False, True])
def test_keep_moves_rows_in_place_as_the_gather_does(int8, monkeypatch):
    """LayerKV.keep moves every tensor's kept rows down in one C call (cache_ops.keep_rows): bit-equal to the
    torch gather it replaces; an index that is not ascending is refused before anything moves."""
    from engine import kernels
    from engine.kernels import cache_ops

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")

    def layer():
        torch.manual_seed(5)
        kv = LayerKV(3, 8, torch.bfloat16, "cpu", int8=int8)
        kv.append(torch.randn(3, 70, 8), torch.randn(3, 70, 8), torch.arange(70))
        kv.scores[:, :70] = torch.rand(3, 70)
        kv.log_counts[:, :70] = torch.rand(3, 70)
        return kv

    index = torch.stack([torch.randperm(70)[:30].sort().values for _ in range(3)])
    fast, slow = layer(), layer()
    fast.keep(index)
    with monkeypatch.context() as m:
        m.setattr(cache_ops, "keep_rows", lambda *a, **k: False)
        slow.keep(index)
    assert fast.length == slow.length == 30
    for name in fast._tensors():
        assert torch.equal(getattr(fast, name)[:, :30], getattr(slow, name)[:, :30]), name
    for name in ("scores", "log_counts"):  # past the length they read zero (storage.py relies on it)
        assert not getattr(fast, name)[:, 30:].any()
    before = {name: getattr(fast, name)[:, :30].clone() for name in fast._tensors()}
    with pytest.raises(ValueError, match="not ascending"):
        cache_ops.keep_rows([getattr(fast, name) for name in fast._tensors()], index[:, :10].flip(1), 30)
    assert all(torch.equal(getattr(fast, name)[:, :30], was) for name, was in before.items())
