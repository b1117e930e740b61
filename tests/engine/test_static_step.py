"""engine.models.static_step: the decode step with static shapes (captured as a CUDA graph on a GPU) against the
per-op step it replaces there.

The per-op decoder (decoder.py + DSV41Cache.attend) is the reference: the same tokens go through both and the
logits and everything the step leaves in the cache (keys, values, positions, CED scores, merge counts, lengths)
must agree, through compactions, reallocations, merged entries, INT8 and CSA2 screening. On the CPU the static
step runs without a graph; what makes it capturable is checked here too: its kernels never read a device value
on the host, and two steps at different lengths run the same ops on the same shapes. The capture itself runs only
on a GPU (the `gpu` test at the end).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.cache import DSV41Cache
from engine.cache.settings import CacheSettings
from engine.models import adapter
from engine.models.static_step import StaticDecodeStep

from .test_fused_step import _assert_same_cache


def _installed(tiny_model, arch="llama", **kwargs):
    model = tiny_model(arch, **kwargs)
    adapter.install(model, pack=False)
    decoder = adapter.runtime(model).decoder
    decoder.fused = None  # the per-op step is the reference
    return model, decoder


def _cache(model, device="cpu", dtype=torch.float32, initial_capacity=256, **knobs):
    layers, kv_heads, head_dim = adapter.kv_geometry(model)
    return DSV41Cache(layers, kv_heads, head_dim, dtype, device, CacheSettings(**knobs),
                      initial_capacity=initial_capacity)


def _decode(model, cache, ids, prefill, *, compact_at=(), compact_to=None, fit=False):
    out = []
    adapter.forward(model, ids[:, :prefill], cache, prefill=True)
    if fit:
        cache.fit_sparse()
    for i in range(prefill, ids.shape[1]):
        out.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)[0, -1].clone())
        if i in compact_at:
            cache.compact(compact_to)
    return torch.stack(out)


def _both(model, decoder, ids, prefill, *, device="cpu", dtype=torch.float32, initial_capacity=256, **kwargs):
    """(static logits, static cache, per-op logits, per-op cache, the static step) for the same tokens."""
    knobs = {k: v for k, v in kwargs.items() if k not in ("compact_at", "compact_to", "fit")}
    run = {k: v for k, v in kwargs.items() if k in ("compact_at", "compact_to", "fit")}
    static = StaticDecodeStep(decoder.w)
    decoder.static = static
    try:
        cache_a = _cache(model, device, dtype, initial_capacity, **knobs)
        got = _decode(model, cache_a, ids, prefill, **run)
    finally:
        decoder.static = None
    cache_b = _cache(model, device, dtype, initial_capacity, **knobs)
    expected = _decode(model, cache_b, ids, prefill, **run)
    return got, cache_a, expected, cache_b, static


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_step_equals_the_per_op_step_uncompressed(arch, tiny_model):
    model, decoder = _installed(tiny_model, arch)
    ids = torch.randint(0, 256, (1, 60))
    got, a, expected, b, _ = _both(model, decoder, ids, 30, kv_cache_ratio=1.0)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert a.decode_steps == b.decode_steps == 30
    _assert_same_cache(a, b)


def test_static_step_scores_compacts_and_grows_like_the_per_op_step(tiny_model):
    """CED scoring inside the step, compactions between steps (lengths change in place), and blocks
    reallocated as the cache grows past its capacity (a fresh allocation's tail is zeroed before use)."""
    model, decoder = _installed(tiny_model)
    ids = torch.randint(0, 256, (1, 340))
    got, a, expected, b, _ = _both(model, decoder, ids, 200, kv_cache_ratio=0.5, ced_sink_tokens=2,
                                   ced_recent_tokens=8, min_entries=16, compact_every=1000,
                                   compact_at=(300, 320), initial_capacity=16)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert a.compactions == b.compactions == 2
    assert a.layers[0].capacity > 256  # grew past its first block during the decode
    _assert_same_cache(a, b)


def test_static_step_never_reads_what_a_fresh_allocation_left_past_the_length(tiny_model):
    """Uninitialised memory past a layer's length may hold NaNs (0 x NaN is NaN even under a zero weight): the
    static step zeroes a reallocated layer's tail once before it attends over the capacity."""
    model, decoder = _installed(tiny_model)
    ids = torch.randint(0, 256, (1, 40))
    caches = []
    for static in (StaticDecodeStep(decoder.w), None):
        decoder.static = static
        cache = _cache(model, kv_cache_ratio=1.0)
        adapter.forward(model, ids[:, :20], cache, prefill=True)
        with torch.inference_mode():
            for layer in cache.layers:
                layer.resize(layer.capacity + 256)  # a new allocation...
                layer.keys[:, layer.length:] = float("nan")  # ...whose tail is garbage
                layer.values[:, layer.length:] = float("nan")
        logits = torch.stack([adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)[0, -1].clone()
                              for i in range(20, 40)])
        caches.append((logits, cache))
    decoder.static = None
    (got, a), (expected, b) = caches
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    _assert_same_cache(a, b)


def test_static_step_with_merged_entries_and_int8(tiny_model):
    model, decoder = _installed(tiny_model)
    ids = torch.randint(0, 256, (1, 120))
    got, a, expected, b, _ = _both(model, decoder, ids, 80, kv_cache_ratio=0.4, ced_mode="merge",
                                   ced_sink_tokens=2, ced_recent_tokens=8, min_entries=16, compact_every=1000,
                                   compact_at=(90,))
    assert a.layers[0].merged_any
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    _assert_same_cache(a, b)
    got, a, expected, b, _ = _both(model, decoder, ids, 80, kv_cache_ratio=1.0, kv_cache_dtype="int8")
    assert a.layers[0].int8
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    for la, lb in zip(a.layers, b.layers, strict=True):
        n = la.length
        assert torch.equal(la.keys[:, :n], lb.keys[:, :n]) and torch.equal(la.values[:, :n], lb.values[:, :n])
        assert torch.allclose(la.key_scales[:, :n], lb.key_scales[:, :n])


def test_static_step_screens_with_csa2_like_the_per_op_step(tiny_model):
    """CSA2's screening inside the step: fixed top-k over the capacity with the sinks and recent window by mask
    and index arithmetic; every csa2.RECALL_EVERY-th step runs per-op (its recall is sampled there)."""
    model, decoder = _installed(tiny_model)
    ids = torch.randint(0, 256, (1, 300))
    knobs = dict(kv_cache_ratio=1.0, csa2_topk=4, csa2_rank=4, ced_sink_tokens=4, ced_recent_tokens=8, fit=True)
    got, a, expected, b, static = _both(model, decoder, ids, 200, **knobs)
    assert a.layers[0].projected_keys is not None
    assert a.stats().csa2_steps == b.stats().csa2_steps == 100
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(a, b)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.allclose(la.projected_keys[:, :la.length], lb.projected_keys[:, :lb.length], atol=1e-5)
    # and the step with the screening scoring (CED on): the scores follow the screened entries only
    got, a, expected, b, _ = _both(model, decoder, ids, 200, **{**knobs, "kv_cache_ratio": 0.9,
                                                                   "compact_every": 1000})
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    _assert_same_cache(a, b)


def test_static_step_runs_where_the_plan_allows_and_the_per_op_step_elsewhere(tiny_model):
    model, decoder = _installed(tiny_model)
    cache = _cache(model)
    adapter.forward(model, torch.randint(0, 256, (1, 8)), cache, prefill=True)
    cache.begin_forward(1, prefill=False)
    plan = cache.static_plan()
    assert plan is not None and plan.position == 8 and not any(m.sparse for m in plan.layers)
    cache.abort_forward()
    cache.begin_forward(4, prefill=True)
    assert cache.static_plan() is None  # a prefill chunk
    cache.abort_forward()
    cache.start_capture()
    cache.begin_forward(1, prefill=False)
    assert cache.static_plan() is None  # a question probe
    cache.finish_capture()
    cache.abort_forward()
    spread = DSV41Cache(2, 2, 16, torch.float32, "cpu", CacheSettings(), layer_devices=("cpu", "meta"))
    spread.begin_forward(1, prefill=False)
    assert spread.static_plan() is None  # layers on several devices


class _Record(TorchDispatchMode):
    """Every aten op a block of code runs, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(t.shape) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor))
        self.calls.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def _recorded_steps(model, decoder, cache, ids, steps: int) -> list[list]:
    static = decoder.static
    compute = static._compute
    records = []

    def recorded(cache_, plan_):
        with _Record() as rec:
            out = compute(cache_, plan_)
        records.append(rec.calls)
        return out

    static._compute = recorded
    try:
        for i in range(steps):
            adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)
    finally:
        static._compute = compute
    return records


@pytest.mark.parametrize("csa2", [False, True], ids=["dense", "csa2"])
def test_static_step_is_capturable_no_host_reads_and_the_same_ops_at_every_length(csa2, tiny_model):
    """What a CUDA graph needs, checked on the CPU: inside the step no op reads a tensor's value on the host
    (.item(), nonzero, data-dependent shapes), and steps at different lengths run the same ops on the same
    shapes (only the device tensors with the token, position and slots differ)."""
    model, decoder = _installed(tiny_model)
    knobs = dict(kv_cache_ratio=0.9, ced_sink_tokens=4, ced_recent_tokens=8, compact_every=1000)
    if csa2:
        knobs.update(csa2_topk=4, csa2_rank=4)
    cache = _cache(model, **knobs)
    ids = torch.randint(0, 256, (1, 200))
    adapter.forward(model, ids, cache, prefill=True)
    cache.fit_sparse()
    cache.decode_steps = 1  # not a CSA2 recall-sampling step
    decoder.static = StaticDecodeStep(decoder.w)
    try:
        records = _recorded_steps(model, decoder, cache, ids, 3)
    finally:
        decoder.static = None
    assert len(records) == 3 and cache.stored == 203
    ops = {name for name, _ in records[0]}
    assert not ops & {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                      "aten.masked_select.default"}, ops
    assert ("aten.topk.default" in ops) == csa2
    assert records[1] == records[2]  # lengths 201 and 202: the same kernels on the same shapes
    if not csa2:
        # On a GPU a step is bound by its kernel count (gpucheck: 1,461 a step for an 8B shape, 46 a layer, at
        # 46-50 % of the bandwidth bound). Ops that launch a kernel (views and same-dtype casts do not), over
        # the 2 layers and the step's own: RMSNorm fused, RoPE one product, no constant remade per layer:
        # 48 here (60 before: 27 a layer). On a GPU in bf16 the fused RMSNorms take 14 more kernels off a layer.
        views = ("view", "expand", "slice", "select", "unsqueeze", "squeeze", "aten.t.", "transpose", "permute",
                 "alias", "detach", "reshape", "as_strided", "split", "chunk", "aten.to.dtype")
        kernels = [name for name, _ in records[1] if not any(v in name for v in views)]
        assert len(kernels) <= 2 * 21 + 7, "\n".join(kernels)


def test_graph_key_changes_only_when_what_the_graph_reads_moves(tiny_model):
    model, decoder = _installed(tiny_model)
    cache = _cache(model, kv_cache_ratio=1.0)
    static = StaticDecodeStep(decoder.w)
    ids = torch.randint(0, 256, (1, 40))
    adapter.forward(model, ids[:, :20], cache, prefill=True)

    def key():
        cache.begin_forward(1, prefill=False)
        plan = cache.static_plan()
        static._prepare(cache, plan.position)
        out = static._key(cache, plan)
        cache.abort_forward()
        return out

    first = key()
    decoder.static = static
    adapter.forward(model, ids[:, 20:21], cache, prefill=False)
    assert key() == first  # one more entry: the same graph
    cache.layers[1].resize(cache.layers[1].capacity + 512)
    assert key() != first  # a layer reallocated: captured again


@pytest.mark.gpu
def test_cuda_graph_replay_equals_the_static_step_and_the_per_op_step(tiny_model):
    model, _ = _installed(tiny_model)
    model = model.to("cuda", torch.bfloat16)
    adapter.install(model, pack=False)
    decoder = adapter.runtime(model).decoder
    assert decoder.static is not None and decoder.static.graphs
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    knobs = dict(kv_cache_ratio=0.5, ced_sink_tokens=4, ced_recent_tokens=8, min_entries=16)
    graphed = decoder.static
    runs = []
    for static in (graphed, StaticDecodeStep(decoder.w), None):
        decoder.static = static
        cache = _cache(model, "cuda", torch.bfloat16, **knobs)
        runs.append((_decode(model, cache, ids, 200, compact_at=(250,)), cache))
    decoder.static = graphed
    assert graphed.captures >= 1 and graphed.replays >= 90 and graphed.graph_error is None
    (g, cg), (s, cs), (p, cp) = runs
    differ = [i for i in range(len(g)) if not torch.equal(g[i], s[i])]
    # the graph replays exactly the static step's kernels
    assert not differ, (f"graph and static step differ from decode step {differ[0]} of {len(g)} (compaction after "
                        f"step 50), by up to {(g - s).abs().max():.3g}; {graphed.describe()}")
    assert torch.equal(g.argmax(-1), p.argmax(-1)) or (g - p).abs().max() < 0.1
    assert cg.stored == cs.stored == cp.stored


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (a device sync on a GPU) and the tensors made from
    host data (torch.tensor(...): a copy to the device on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.from_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.reads += 1
        elif func is torch.ops.aten.lift_fresh.default:
            self.from_host += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_decode_step_of_the_turn_loop_reads_one_value_on_the_host(sampled, tiny_model, monkeypatch):
    """The turn loop with the static step: the sampled token id is the only value a decode step reads on the
    host (on a GPU, its one sync); the token is fed back and the repetition window kept on the device. (Run on the
    CPU here, where CPU logits would be sampled by the CPU's kernel: turned off, as a GPU's logits never reach it.)"""
    from engine import sampling
    from engine.config import GenerationSettings
    from engine.generate import TurnPlan, run_turn

    monkeypatch.setattr(sampling, "_kernel_sampling", lambda: False)

    model, decoder = _installed(tiny_model)
    decoder.static = StaticDecodeStep(decoder.w)
    ids = torch.randint(0, 256, (60,)).tolist()

    class Tok:  # the detokenizer's side of a tokenizer
        def decode(self, tokens, **_):
            return "".join(chr(97 + t % 26) for t in tokens)

    reads = []
    try:
        for new_tokens in (1, 17):
            settings = GenerationSettings(max_new_tokens=new_tokens, greedy=not sampled, temperature=0.8, top_k=20,
                                          top_p=0.9, seed=1 if sampled else None, ignore_eos=True,
                                          repetition_penalty=1.2)
            cache = _cache(model, kv_cache_ratio=1.0)
            with _HostReads() as counter:
                events = list(run_turn(model, Tok(), cache, TurnPlan(ids, 8), settings))
            assert events[-1].reason == "length" and len(events[-1].token_ids) == new_tokens
            reads.append((counter.reads, counter.from_host))
    finally:
        decoder.static = None
    assert reads[1][0] - reads[0][0] == 16, reads  # one read per step: the token id
    assert reads[1][1] == reads[0][1], reads  # and nothing copied from the host per step


@pytest.mark.gpu
def test_cuda_graphs_captured_again_and_again_for_chats_taking_turns(tiny_model):
    """Two chats decoding in turn on one model: each switch reads other addresses, so the step is captured again,
    the previous graph released first. Every capture must succeed (reusing one memory-pool id after its graph was
    released tripped torch's allocator at the second capture) and replay the static step exactly."""
    model, _ = _installed(tiny_model)
    model = model.to("cuda", torch.bfloat16)
    adapter.install(model, pack=False)
    decoder = adapter.runtime(model).decoder
    graphed = decoder.static
    ids = torch.randint(0, 256, (1, 80), device="cuda")
    caches = [_cache(model, "cuda", torch.bfloat16, kv_cache_ratio=1.0) for _ in range(2)]
    for cache in caches:
        adapter.forward(model, ids[:, :40], cache, prefill=True)
    got = []
    for i in range(40, 50):
        for cache in caches:
            got.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)[0, -1].clone())
    assert graphed.graph_error is None, graphed.graph_error
    assert graphed.captures >= 20 and graphed.replays == 20
    decoder.static = StaticDecodeStep(decoder.w)
    try:
        caches = [_cache(model, "cuda", torch.bfloat16, kv_cache_ratio=1.0) for _ in range(2)]
        for cache in caches:
            adapter.forward(model, ids[:, :40], cache, prefill=True)
        want = [adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)[0, -1].clone()
                for i in range(40, 50) for cache in caches]
    finally:
        decoder.static = graphed
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_step_rotation_matrix_is_rope():
    """The decode steps rotate queries and keys with one [d, d] product built from device tensors (no host read,
    so a CUDA graph holds it): R has cos on the diagonal, sin at (i, half + i), -sin at (half + i, i)."""
    from engine.models.decoder import rope, rope_matrix, rope_swap

    angles = torch.rand(8) * 50
    cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
    want = torch.diag(cos)
    i = torch.arange(8)
    want[i, i + 8], want[i + 8, i] = angles.sin(), -angles.sin()
    rotation = rope_matrix(cos, sin)
    assert torch.equal(rotation, want) and torch.equal(rope_matrix(cos, sin, rope_swap(16, cos.dtype, "cpu")), want)
    x = torch.randn(1, 6, 16)
    assert torch.allclose(x @ rotation, rope(x, cos[None, None], sin[None, None]), atol=1e-6)
