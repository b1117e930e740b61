"""A follow-up's reply counts what is cold: each hot entry's logit gets log(1 + the cold entries it stands for)
(engine.cache.counts.cold_counts, DSV41Cache.count_cold), from the reply's first step to the end of the turn."""

import dataclasses

import pytest
import torch

from engine.cache import CacheSettings, DSV41Cache, kv_cache, persist
from engine.cache import counts as counts_module
from engine.cache.cold import ColdLayer
from engine.cache.counts import COUNT_BITS, COUNT_TABLES, cold_counts, count_planes
from engine.cache.storage import LayerKV
from engine.kernels import cache_ops
from engine.kernels.quant import quantize_int8


def _layers(hot_keys, cold_keys, *, int8):
    h, s, d = hot_keys.shape
    layer = LayerKV(h, d, torch.float32, "cpu", initial_capacity=s)
    layer.append(hot_keys, torch.randn(h, s, d), torch.arange(s).expand(h, -1).contiguous())
    source = LayerKV(h, d, torch.float32, "cpu", initial_capacity=cold_keys.shape[1])
    c = cold_keys.shape[1]
    source.append(cold_keys, torch.randn(h, c, d), torch.arange(s, s + c).expand(h, -1).contiguous())
    cold = ColdLayer(h, d, torch.float32, "cpu", int8=int8)
    cold.add(source, torch.arange(c).expand(h, -1).contiguous())
    return layer, cold


def _naive(hot_keys, cold_keys, planes):
    """The counts by hand: per head and table, each key's bucket from the signs of its integer products (the key
    rounded to int8 as the cold tier stores it) with the table's int8 planes; a bucket's cold entries shared evenly
    by its hot ones; the mean over the tables."""
    h, s, _ = hot_keys.shape
    out = torch.zeros(h, s)
    for head in range(h):
        for table in range(COUNT_TABLES):
            cut = planes[table * COUNT_BITS:(table + 1) * COUNT_BITS].long()

            def bucket(key, cut=cut):
                return tuple(bool(x > 0) for x in cut @ quantize_int8(key)[0].long())

            hot_buckets = [bucket(k) for k in hot_keys[head]]
            cold_buckets = [bucket(k) for k in cold_keys[head]]
            for i, b in enumerate(hot_buckets):
                out[head, i] += cold_buckets.count(b) / hot_buckets.count(b)
    return (out / COUNT_TABLES).log1p()


def test_each_bucket_shares_its_cold_entries_evenly_over_its_hot_ones():
    g = torch.Generator().manual_seed(0)
    hot = torch.randn(2, 24, 8, generator=g)
    # cold keys near some hot ones (what a compaction sends away looks like what it keeps) and some anywhere
    near = hot[:, :6].repeat(1, 3, 1) + 0.05 * torch.randn(2, 18, 8, generator=g)
    cold = torch.cat([near, torch.randn(2, 10, 8, generator=g)], dim=1)
    layer, cold_layer = _layers(hot, cold, int8=False)
    planes = count_planes(8, "cpu")
    got = cold_counts(layer, cold_layer, planes)
    assert torch.allclose(got, _naive(hot, cold, planes), atol=1e-6)
    # the hot keys with cold ones close to them stand for more than the others
    assert got[:, :6].mean() > 2 * got[:, 6:].mean()
    # cold copies of the hot keys: every cold entry is counted once, on the hot entries of its own bucket
    copies = hot[:, [0, 0, 5, 9]]
    layer, cold_layer = _layers(hot, copies, int8=False)
    counts = cold_counts(layer, cold_layer, planes).expm1()
    assert torch.allclose(counts.sum(dim=1), torch.full((2,), 4.0), atol=1e-5)


def test_an_entry_hashes_the_same_hot_or_cold():
    """The int8 cold keys are hashed as stored, and a hot key as it would be stored: the counts over an int8 cold
    tier are those of the original float keys, and a key copied into the cold tier lands in its own buckets."""
    g = torch.Generator().manual_seed(1)
    hot, cold = torch.randn(3, 40, 16, generator=g), torch.randn(3, 70, 16, generator=g)
    layer, int8_cold = _layers(hot, cold, int8=True)
    planes = count_planes(16, "cpu")
    assert not torch.equal(int8_cold.read_keys(), cold)  # int8 is not lossless: the point is what is stored
    assert torch.allclose(cold_counts(layer, int8_cold, planes), _naive(hot, cold, planes), atol=1e-6)
    # every hot key also cold (as int8): each bucket's cold entries are exactly its hot ones, c = 1 everywhere
    layer, copies = _layers(hot, hot, int8=True)
    assert torch.allclose(cold_counts(layer, copies, planes), torch.full((3, 40), 2.0).log(), atol=1e-6)


def test_a_key_hashes_alone_as_among_others():
    """The buckets of part of the keys are those keys' buckets of the whole (exact products: no order of summation
    moves a sign), numbered across the tables (table t's buckets are t << COUNT_BITS and up)."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 300, 64, generator=g)[:, :257]
    planes = count_planes(64, "cpu")
    whole = counts_module._buckets(keys, planes)
    assert torch.equal(counts_module._buckets(keys[:, 100:130], planes), whole[:, 100 * COUNT_TABLES:130 * COUNT_TABLES])
    tables = whole.view(3, 257, COUNT_TABLES) >> COUNT_BITS
    assert torch.equal(tables, torch.arange(COUNT_TABLES).expand(3, 257, -1))


def _cache(**knobs):
    settings = CacheSettings(**{"kv_cache_ratio": 0.25, "csa2_topk": 0, "ced_sink_tokens": 2, "ced_recent_tokens": 4,
                                "min_entries": 8, "ced_threshold": 0.0, "cold_tier": "ram", **knobs})
    return DSV41Cache(2, 2, 8, torch.float32, "cpu", settings)


def _forward(cache, tokens, *, seed, question=False):
    """One forward of `tokens` random entries through the cache's own attend; the layers' outputs."""
    g = torch.Generator().manual_seed(seed)
    cache.begin_forward(tokens, score_window=tokens, prefill=tokens > 1, question=question)
    outs = []
    for index in range(cache.num_layers):
        q, k, v = (torch.randn(1, n, tokens, 8, generator=g) for n in (4, 2, 2))
        outs.append(cache.attend(index, q, k, v, 8**-0.5))
    cache.end_forward()
    return outs


@pytest.fixture(autouse=True)
def _small_recall(monkeypatch):
    """A question of these small caches recalls a few entries and its reply keeps fewer (the defaults would bring
    the whole cold tier back), and its reply counts their small cold tiers."""
    from engine.cache import cold

    monkeypatch.setattr(cold, "RECALL_MIN", 8)
    monkeypatch.setattr(kv_cache, "REPLY_RECALLED", 4)
    monkeypatch.setattr(kv_cache, "COUNT_COLD_MIN", 1)  # their cold tiers are a few dozen entries


def _first_turn_then_question(cache):
    cache.start_prefill(64, 8, None)
    _forward(cache, 64, seed=3)
    cache.finish_prefill(answer_follows=True)
    for step in range(4):
        _forward(cache, 1, seed=10 + step)
    cache.finish_turn()
    assert cache.cold[0].length > 0
    cache.start_prefill(6, 6, None)
    _forward(cache, 6, seed=20, question=True)
    assert cache.recalled > 0
    assert cache.cold[0].length > 0


def test_a_follow_ups_reply_counts_the_cold_tier_until_its_turn_ends(monkeypatch):
    cache = _cache(ced_recent_tokens=16)  # the previous exchange stays hot in part
    _first_turn_then_question(cache)
    cache.finish_prefill(answer_follows=True)
    assert cache.counting
    planes = count_planes(8, "cpu")
    # the first turn's question began at 64 - 8, this one's at 64 + 4 reply tokens: that exchange counts nothing
    assert (cache.exchange_from, cache.question_at) == (56, 68)
    for layer, cold in zip(cache.layers, cache.cold, strict=True):
        assert layer.merged_any
        n = layer.length
        exchange = (layer.positions[:, :n] >= 56) & (layer.positions[:, :n] < 68)
        counts = cold_counts(layer, cold, planes)
        assert exchange.any() and counts[exchange].max() > 0  # entries of it are hot, and would have counted
        assert not layer.log_counts[:, :n][exchange].any()
        assert torch.equal(layer.log_counts[:, :n][~exchange], counts[~exchange])
        assert layer.log_counts[:, :n].max() > 0
    counted = _forward(cache, 1, seed=30)  # a reply step attends with the counts ...
    cache.finish_turn()
    assert not cache.counting
    for layer in cache.layers:  # ... and the turn ends with the hot set standing for itself alone
        assert not layer.merged_any and not layer.log_counts.any()

    plain = _cache(ced_recent_tokens=16)  # the same turns without the counts: the reply's step attends differently
    _first_turn_then_question(plain)
    monkeypatch.setattr(kv_cache, "COUNT_COLD", False)
    plain.finish_prefill(answer_follows=True)
    assert not plain.counting and not any(layer.merged_any for layer in plain.layers)
    uncounted = _forward(plain, 1, seed=30)
    assert not all(torch.allclose(a, b) for a, b in zip(counted, uncounted, strict=True))


def test_a_first_question_and_a_cache_without_the_cold_tier_count_nothing():
    for knobs in ({}, {"cold_tier": "off"}):
        cache = _cache(**knobs)
        cache.start_prefill(64, 8, None)
        _forward(cache, 64, seed=3, question=True)
        cache.finish_prefill(answer_follows=True)
        assert not cache.counting and not any(layer.merged_any for layer in cache.layers)


@pytest.mark.parametrize("after", ["save", "next turn", "new knobs"])
def test_a_reply_that_never_finished_leaves_no_counts_behind(after):
    """A reply that failed part-way does not reach finish_turn: a saved state, the next turn and new knobs each
    find the hot set standing for itself."""
    cache = _cache()
    _first_turn_then_question(cache)
    cache.finish_prefill(answer_follows=True)
    _forward(cache, 1, seed=30)
    assert cache.counting  # the reply fails here
    if after == "save":
        tensors, facts = persist.save_state(cache)
        assert not any(tensors[f"hot.{i}.log_counts"].any() for i in range(cache.num_layers))
        assert not any(layer["merged_any"] for layer in facts["layers"])
    elif after == "next turn":
        cache.start_prefill(4, 4, None)
    else:
        cache.apply(dataclasses.replace(cache.settings, ced_decay=0.99))
    assert not cache.counting
    assert not any(layer.merged_any or layer.log_counts.any() for layer in cache.layers)


@pytest.mark.parametrize("hot_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("tables", [COUNT_TABLES, 6])
def test_the_c_counts_are_the_torch_ones(hot_dtype, int8, tables, monkeypatch):
    """dsv41_cold_counts (hashes, bucket sizes, shares and their mean in one call) against the torch path, on a
    layer's and a cold tier's storage views, every key type the tiers hold: a float32 or bf16 hot set, an int8 or
    lossless cold tier; the shipped 16 tables and a count the C call's groups of 4 tables do not divide. One key
    in another bucket would move a count by far more than the tolerance."""
    monkeypatch.setattr(counts_module, "COUNT_TABLES", tables)
    g = torch.Generator().manual_seed(4)
    hot = torch.randn(3, 90, 64, generator=g)
    near = hot[:, :30].repeat(1, 4, 1) + 0.1 * torch.randn(3, 120, 64, generator=g)
    _, cold_layer = _layers(hot, torch.cat([near, torch.randn(3, 50, 64, generator=g)], dim=1), int8=int8)
    layer = LayerKV(3, 64, hot_dtype, "cpu", initial_capacity=100)
    layer.append(hot.to(hot_dtype), torch.randn(3, 90, 64).to(hot_dtype), torch.arange(90).expand(3, -1).contiguous())
    planes = count_planes(64, "cpu")
    if cache_ops.cold_counts(layer.read_keys(), cold_layer.keys[:, :1], planes, tables, COUNT_BITS) is None:
        pytest.skip("the C kernels are not available here")
    c = cold_counts(layer, cold_layer, planes)
    monkeypatch.setattr(cache_ops, "cold_counts", lambda *args: None)
    torch_path = cold_counts(layer, cold_layer, planes)
    assert torch.allclose(c, torch_path, rtol=1e-6, atol=1e-6)
    assert c[:, :30].mean() > 2 * c[:, 30:].mean()  # the keys with cold ones near them stand for more


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_counts_are_the_cpu_ones(dtype):
    """The hot set on a GPU: its keys rounded to int8 there, the int8 cold keys carried over as stored, the products in
    float32 (exact for these integers, TF32 or not), the counts those of the CPU path for the same keys."""
    g = torch.Generator().manual_seed(5)
    hot = torch.randn(3, 90, 64, generator=g).to(dtype)
    near = hot[:, :30].float().repeat(1, 4, 1) + 0.1 * torch.randn(3, 120, 64, generator=g)
    cold_keys = torch.cat([near, torch.randn(3, 50, 64, generator=g)], dim=1)
    layer, cold_layer = _layers(hot.float(), cold_keys, int8=True)
    gpu = LayerKV(3, 64, dtype, "cuda", initial_capacity=90)
    gpu.append(hot.cuda(), torch.randn(3, 90, 64).to(dtype).cuda(), torch.arange(90).expand(3, -1).contiguous().cuda())
    if dtype == torch.bfloat16:  # the CPU side from the same bf16 keys
        layer = LayerKV(3, 64, torch.bfloat16, "cpu", initial_capacity=90)
        layer.append(hot, torch.randn(3, 90, 64).to(dtype), torch.arange(90).expand(3, -1).contiguous())
    on_gpu = cold_counts(gpu, cold_layer, count_planes(64, "cuda"))
    assert on_gpu.device.type == "cuda"
    assert torch.allclose(on_gpu.cpu(), cold_counts(layer, cold_layer, count_planes(64, "cpu")), atol=1e-6)


def _rebuilt(cold):
    """The cold tier's bucket sizes hashed afresh from every entry it holds."""
    kept = cold.bucket_sizes
    cold.forget_buckets()
    fresh = cold.buckets()
    cold.bucket_sizes = kept
    return fresh


@pytest.mark.parametrize("hot_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [True, False])
def test_the_kept_bucket_sizes_follow_the_entries_that_come_and_go(hot_dtype, int8, monkeypatch):
    """The cold tier keeps its keys' bucket sizes between turns (ColdLayer.bucket_sizes) so the reply's counts
    hash only the hot set: after entries go cold (the C add and torch's), come back (a recall's move and a take)
    the kept sizes equal sizes hashed afresh, and the counts from them equal the counts that hash the cold keys."""
    monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)  # kept whatever the tier's size
    g = torch.Generator().manual_seed(6)
    h, d = 3, 64
    hot = torch.randn(h, 90, d, generator=g)
    near = hot[:, :30].repeat(1, 4, 1) + 0.1 * torch.randn(h, 120, d, generator=g)
    first = LayerKV(h, d, hot_dtype, "cpu", initial_capacity=120)
    first.append(near.to(hot_dtype), torch.randn(h, 120, d).to(hot_dtype), torch.arange(90, 210).expand(h, -1).contiguous())
    cold = ColdLayer(h, d, hot_dtype, "cpu", int8=int8)  # int8, or lossless in the hot set's dtype
    cold.add(first, torch.arange(120).expand(h, -1).contiguous())
    if cold.buckets() is None:
        pytest.skip("the C kernels are not available here")
    source = LayerKV(h, d, hot_dtype, "cpu", initial_capacity=200)
    source.append(torch.randn(h, 200, d, generator=g).to(hot_dtype), torch.randn(h, 200, d).to(hot_dtype),
                  torch.arange(500, 700).expand(h, -1).contiguous())
    layer = LayerKV(h, d, hot_dtype, "cpu", initial_capacity=90)
    layer.append(hot.to(hot_dtype), torch.randn(h, 90, d).to(hot_dtype), torch.arange(90).expand(h, -1).contiguous())
    planes = count_planes(d, "cpu")

    def check():
        assert cold.bucket_sizes is not None
        assert torch.equal(cold.bucket_sizes, _rebuilt(cold))
        assert int(cold.bucket_sizes.view(torch.int16).long().sum()) == h * COUNT_TABLES * cold.length
        with_sizes = cold_counts(layer, cold, planes)
        kept = cold.bucket_sizes
        monkeypatch.setattr(ColdLayer, "buckets", lambda self: None)
        hashed = cold_counts(layer, cold, planes)
        monkeypatch.undo()
        monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)
        cold.bucket_sizes = kept
        assert torch.equal(with_sizes, hashed)

    check()
    cold.add(source, torch.randint(0, 200, (h, 40), generator=g).unique(dim=1)[:, :20].sort().values)  # the C add
    check()
    with monkeypatch.context() as m:  # torch's add (a GPU hot set, or no kernels for this layout)
        m.setattr(cache_ops, "cold_add", lambda *args: False)
        cold.add(source, torch.arange(100, 130).expand(h, -1).contiguous())
    check()
    recall = torch.stack([torch.randperm(cold.length, generator=g)[:25] for _ in range(h)])
    assert cold.move_into(layer, recall)  # a question's recall
    check()
    cold.take(torch.stack([torch.randperm(cold.length, generator=g)[:10] for _ in range(h)]))
    check()
    with pytest.raises(ValueError):  # a bad index changes nothing, and the sizes still match
        cold.take(torch.full((h, 2), cold.length + 5))
    assert cold.bucket_sizes is None or torch.equal(cold.bucket_sizes, _rebuilt(cold))
    cold.take(torch.arange(cold.length).expand(h, -1))  # everything back: nothing left to count
    assert cold.length == 0 and cold.bucket_sizes is None


def test_the_bucket_sizes_are_built_between_turns_not_before_a_replys_second_token(monkeypatch):
    """Where they pay, the cold tier's bucket sizes exist once a turn has ended (its compaction sent entries cold), so
    the next follow-up's counts, after its first reply token, only hash the hot set; the same sizes a count would
    build. Not where the counts are off, and not for a tier too small to count."""
    monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)  # they pay whatever the tier's size
    cache = _cache()
    cache.start_prefill(64, 8, None)
    _forward(cache, 64, seed=3)
    cache.finish_prefill(answer_follows=True)
    if cache_ops.load() is None:
        pytest.skip("the C kernels are not available here")
    _forward(cache, 1, seed=10)
    assert all(cold.bucket_sizes is None for cold in cache.cold)  # nothing is cold before the turn's compaction
    cache.finish_turn()
    assert all(cold.length and cold.bucket_sizes is not None for cold in cache.cold)
    assert all(torch.equal(cold.bucket_sizes, _rebuilt(cold)) for cold in cache.cold)
    calls = []
    monkeypatch.setattr(cache_ops, "lsh_tally", lambda *a, **k: calls.append(a) or False)
    for cold in cache.cold:
        assert cold.buckets() is cold.bucket_sizes  # kept: a count builds nothing
    assert not calls
    monkeypatch.undo()
    monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)
    for off in ({"counts": False}, {"too_small": True}):
        other = _cache()
        monkeypatch.setattr(kv_cache, "COUNT_COLD", "counts" not in off)
        monkeypatch.setattr(kv_cache, "COUNT_COLD_MIN", 10_000 if "too_small" in off else 1)
        other.start_prefill(64, 8, None)
        _forward(other, 64, seed=3)
        other.finish_prefill(answer_follows=True)
        other.finish_turn()
        assert all(cold.length and cold.bucket_sizes is None for cold in other.cold)


def test_bucket_sizes_are_kept_only_where_they_pay():
    """At most 1 / BUCKET_SIZES_SHARE of the cold entries' bytes: a small tier hashes its keys at each count, a large
    one keeps the sizes, and counts them in its bytes (the memory panel's cold line)."""
    h, d = 3, 64
    per_head = COUNT_TABLES << COUNT_BITS
    small = _layers(torch.randn(h, 10, d), torch.randn(h, 500, d), int8=True)[1]
    assert small.buckets() is None and small.bucket_sizes is None
    entries = -(-counts_module.BUCKET_SIZES_SHARE * h * per_head * 2 // small._bytes_per_entry())  # the smallest that pays
    layer, large = _layers(torch.randn(h, 10, d), torch.randn(h, entries, d), int8=True)
    if large.buckets() is None:
        pytest.skip("the C kernels are not available here")
    plain = sum(getattr(large, n)[:, : large.length].numel() * getattr(large, n).element_size() for n in large._names())
    assert large.nbytes() == plain + h * per_head * 2
    assert large.nbytes() <= plain * (1 + 1 / counts_module.BUCKET_SIZES_SHARE)
    large.move_into(layer, torch.arange(5).expand(h, -1).contiguous())  # below the line now: dropped at the next count
    assert large.bucket_sizes is not None and large.buckets() is None and large.bucket_sizes is None
    assert large.nbytes() == plain - 5 * large._bytes_per_entry()


def test_a_saved_state_loads_without_the_sizes_it_was_counted_with(monkeypatch):
    """The sizes are not part of a saved state: a state loaded into a cache whose tier kept sizes for other entries
    drops them, and its next counts are those of the saved entries."""
    monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)
    cache = _cache()
    _first_turn_then_question(cache)
    cache.finish_prefill(answer_follows=True)
    assert all(cold.bucket_sizes is not None for cold in cache.cold)
    cache.finish_turn()
    tensors, facts = persist.save_state(cache)
    other = _cache()
    _first_turn_then_question(other)
    other.finish_prefill(answer_follows=True)
    other.finish_turn()
    other.cold[0].add(other.layers[0], torch.arange(3).expand(2, -1).contiguous())
    assert other.cold[0].bucket_sizes is not None
    persist.load_state(other, tensors, facts)
    assert all(cold.bucket_sizes is None for cold in other.cold)
    planes = count_planes(8, "cpu")
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        assert torch.equal(cold_counts(mine, cache.cold[cache.layers.index(mine)], planes),
                           cold_counts(theirs, other.cold[other.layers.index(theirs)], planes))


@pytest.mark.parametrize("least", [0, 10**6, "between"])
def test_a_layer_counts_its_cold_tier_only_where_it_holds_enough_entries(least, monkeypatch):
    """Over a few cold entries the bucket sizes say little (COUNT_COLD_MIN): a layer whose cold tier holds fewer
    attends to its hot set alone, each layer by its own tier."""
    cache = _cache()
    _first_turn_then_question(cache)
    monkeypatch.setattr(kv_cache, "COUNT_COLD", False)
    cache.finish_prefill(answer_follows=True)  # the reply's compaction, without the counts
    assert not cache.counting
    if least == "between":  # a threshold the second layer's tier reaches and the first's does not
        cache.cold[0].take(torch.arange(3).expand(cache.kv_heads, -1).contiguous())
        least = cache.cold[1].length
        assert cache.cold[0].length < least
    monkeypatch.setattr(kv_cache, "COUNT_COLD_MIN", least)
    cache.count_cold()
    counted = [cold.length >= least for cold in cache.cold]
    assert counted == [layer.merged_any for layer in cache.layers]
    assert cache.counting == any(counted)
    assert counted == ([True, True] if least == 0 else [False, False] if least == 10**6 else [False, True])
    for layer, was in zip(cache.layers, counted, strict=True):
        assert bool(layer.log_counts[:, : layer.length].any()) == was


def test_a_chat_answers_the_same_with_the_kept_sizes_as_hashing_the_cold_tier(tiny_folder, monkeypatch):
    """Through real turns (a tiny model, the real tokenizer): a chat whose cold tier keeps its bucket sizes from its
    first count on (kept whatever the tier's size here) gives every follow-up the same counts and the same reply as
    a chat that hashes the cold tier at each count."""
    from engine import DSV41Config, DSV41Model
    from engine.cache import cold as cold_module
    from engine.events import TokenText

    monkeypatch.setattr(cold_module, "RECALL_MIN", 16)  # the tiny chat's cold tier would come back whole
    monkeypatch.setattr(kv_cache, "COUNT_COLD_MIN", 1)
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, kv_cache_ratio=0.2,
                                                   cold_tier="ram", csa2_topk=0))
    document = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(45))
    questions = [document + "\n\nWhat is the value of item 3?", "And item 40?", "And item 25?", "And item 12?"]

    def chat(share):
        monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", share)
        seen, original = [], DSV41Cache.count_cold

        def count_cold(self):
            original(self)
            seen.append([layer.log_counts[:, : layer.length].clone() for layer in self.layers])
            seen[-1].append([cold.bucket_sizes is not None for cold in self.cold])

        monkeypatch.setattr(DSV41Cache, "count_cold", count_cold)
        session = model.chat_session()
        replies = ["".join(e.text for e in session.send(q, max_new_tokens=6, greedy=True) if isinstance(e, TokenText))
                   for q in questions]
        monkeypatch.setattr(DSV41Cache, "count_cold", original)
        return replies, seen

    kept_replies, kept = chat(0)
    hashed_replies, hashed = chat(10**9)
    if not any(kept[0][-1]):
        pytest.skip("the C kernels are not available here")
    assert len(kept) == len(hashed) == len(questions) - 1  # every follow-up counted
    assert all(all(k[-1]) for k in kept) and not any(any(h[-1]) for h in hashed)
    for k, h in zip(kept, hashed, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(k[:-1], h[:-1], strict=True))
    assert kept_replies == hashed_replies


def test_kept_sizes_are_counted_in_ram_when_the_tier_is_on_disk(monkeypatch, tmp_path):
    """The memory report's cold lines: a tier spilled to a file holds its entries there and its bucket sizes in RAM."""
    from engine.cache import kv_cache as kv

    monkeypatch.setattr(kv, "cold_dir", lambda: tmp_path)
    monkeypatch.setattr(counts_module, "BUCKET_SIZES_SHARE", 0)
    cache = _cache(cold_tier="disk")
    _first_turn_then_question(cache)
    cache.finish_prefill(answer_follows=True)
    if not all(cold.on_disk and cold.bucket_sizes is not None for cold in cache.cold):
        pytest.skip("the C kernels (or a mapped file) are not available here")
    sizes = sum(cold.sizes_bytes() for cold in cache.cold)
    assert sizes == cache.num_layers * cache.kv_heads * (COUNT_TABLES << COUNT_BITS) * 2
    assert cache.cold_bytes("ram") == sizes
    assert cache.cold_bytes("disk") == cache.cold_bytes() - sizes > 0


def test_the_hashing_without_avx512_is_the_same(monkeypatch):
    """Without AVX-512 VNNI (an AVX2 machine) the C hashing takes its scalar integer products: the same buckets, so
    the same counts and the same kept bucket sizes as the vpdpbusd path."""
    from engine.kernels import library

    default = cache_ops.load()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = info.read()
    except OSError:
        flags = ""
    if default is None or default.isa != 512 or " avx512_vnni" not in flags:
        pytest.skip("needs the kernels on an AVX-512 VNNI CPU (to compare its path with the scalar one)")
    scalar = library.build(("-mno-avx512f",))
    g = torch.Generator().manual_seed(7)
    hot = torch.randn(3, 90, 64, generator=g).to(torch.bfloat16)
    near = hot[:, :30].float().repeat(1, 4, 1) + 0.1 * torch.randn(3, 120, 64, generator=g)
    _, cold = _layers(hot.float(), near, int8=True)
    planes = count_planes(64, "cpu")
    index = torch.arange(cold.length).expand(3, -1).contiguous()

    def hashed():
        sizes = torch.zeros(3, COUNT_TABLES << COUNT_BITS, dtype=torch.int16)
        assert cache_ops.lsh_tally(cold.keys, cold.length, index, planes, COUNT_TABLES, COUNT_BITS, sizes, +1)
        stored = cold.keys[:, : cold.length]
        return (sizes, cache_ops.cold_counts(hot, stored, planes, COUNT_TABLES, COUNT_BITS),
                cache_ops.cold_counts(hot, None, planes, COUNT_TABLES, COUNT_BITS, sizes))

    vnni = hashed()
    monkeypatch.setattr(cache_ops, "load", lambda: scalar)
    plain = hashed()
    assert all(torch.equal(a, b) for a, b in zip(vnni, plain, strict=True))
    assert torch.equal(vnni[1], vnni[2])  # from the kept sizes as from hashing the cold keys
    assert vnni[1][:, :30].mean() > 2 * vnni[1][:, 30:].mean()


def test_where_the_last_question_began_survives_a_saved_state_and_an_undone_turn():
    """A fork, a reopened chat (persist) and a turn stopped before its prompt was read (restore) keep the position
    the previous exchange starts at, so their next reply leaves the same entries uncounted."""
    cache = _cache()
    _first_turn_then_question(cache)
    cache.finish_prefill(answer_follows=True)
    _forward(cache, 1, seed=30)
    cache.finish_turn()
    tensors, facts = persist.save_state(cache)
    other = _cache()
    persist.load_state(other, tensors, facts)
    assert other.question_at == cache.question_at == 68
    other.start_prefill(5, 5, None)
    assert (other.exchange_from, other.question_at) == (68, other.seen)

    checkpoint = cache.checkpoint()
    cache.start_prefill(5, 5, None)
    _forward(cache, 2, seed=40)  # stopped part-way through its question
    assert cache.restore(checkpoint)
    assert (cache.exchange_from, cache.question_at) == (56, 68)
