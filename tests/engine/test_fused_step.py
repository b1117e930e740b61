"""engine.cpu_kernels.FusedDecodeStep: one C call per decode step against the per-op Python step it replaces.

The Python decoder (engine/models/decoder.py + DSV41Cache.attend) is the reference; these tests run the same
tokens through both and compare the logits and everything the step leaves in the cache: keys, values,
positions, CED scores, lengths, merged entries' counts, across block reallocations and compactions.
"""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import kernels as cpu_kernels
from engine.cache import FusedPlan
from engine.kernels.gguf_blocks import activations, float_activations, has_int8_activations
from engine.models import adapter

from .test_cache import make_cache

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def _packed(tiny_model, arch, fmt="bf16", **kwargs):
    """A tiny model installed with its matrices held as `fmt`: "bf16" / "int8" (packed for our kernels) or
    "float32" (random float32 values are not bf16 values: left as torch tensors)."""
    model = tiny_model(arch, **kwargs)
    if fmt == "float32":
        adapter.install(model)
        assert adapter.packed_format(model) is None
    else:
        adapter.install(model, pack_rounding=True, pack_format=fmt)
        assert adapter.packed_format(model) == fmt
    return model


def _decode(model, cache, ids, prefill: int, compact_at=(), compact_to=None):
    """Prefill ids[:prefill] in one forward, then one token at a time (compacting after the steps in
    `compact_at`); returns the decode logits [steps, V]."""
    out = []
    adapter.forward(model, ids[:, :prefill], cache, prefill=True)
    for i in range(prefill, ids.shape[1]):
        out.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)[0, -1])
        if i in compact_at:
            cache.compact(compact_to)
    return torch.stack(out)


def _both(model, ids, prefill, *, threads=None, compact_at=(), compact_to=None, **knobs):
    """(fused logits, fused cache, per-op logits, per-op cache) for the same tokens."""
    decoder = adapter.runtime(model).decoder
    fused = decoder.fused
    assert fused is not None
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cache_a = make_cache(model, **knobs)
        got = _decode(model, cache_a, ids, prefill, compact_at, compact_to)
        decoder.fused = None
        cache_b = make_cache(model, **knobs)
        expected = _decode(model, cache_b, ids, prefill, compact_at, compact_to)
    finally:
        decoder.fused = fused
        torch.set_num_threads(previous)
    return got, cache_a, expected, cache_b


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 summation order: an absolute 1e-5 of the tensor's largest magnitude (a value that is
    one dot product of 576 terms of a layer whose values reach 10 differs by ~1e-5 between two orders; a wrong
    row differs by its own size)."""
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    return torch.allclose(got, expected, atol=1e-5 * scale, rtol=1e-4)


def _assert_same_cache(a, b, *, scores=True):
    assert a.seen == b.seen
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.length == lb.length
        n = la.length
        assert _close(la.keys[:, :n], lb.keys[:, :n]), (la.keys[:, :n] - lb.keys[:, :n]).abs().max()
        assert _close(la.values[:, :n], lb.values[:, :n]), (la.values[:, :n] - lb.values[:, :n]).abs().max()
        assert torch.equal(la.positions[:, :n], lb.positions[:, :n])
        assert torch.equal(la.log_counts[:, :n], lb.log_counts[:, :n])
        if scores:
            assert torch.allclose(la.scores[:, :n], lb.scores[:, :n], atol=1e-5, rtol=1e-4), \
                (la.scores[:, :n] - lb.scores[:, :n]).abs().max()
        assert not la.scores[:, n:].any()  # past `length` stays zero (storage.py relies on it)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "float32"])
def test_fused_step_equals_the_per_op_step(arch, threads, fmt, tiny_model):
    """Qwen2 has QKV biases, Qwen3 per-head q/k norms; 4 query heads over 2 KV heads (GQA). The cache grows
    past its first 256-entry block while decoding (reallocated storage), and attention spans two 256-entry
    chunks with a tail that is not a multiple of 16. Weights packed as bf16, or plain float32 tensors."""
    model = _packed(tiny_model, arch, fmt)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 270))
    got, cache_a, expected, cache_b = _both(model, ids, 250, threads=threads, kv_cache_ratio=1.0, csa2_topk=0)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert cache_a.stored == 270 and cache_a.layers[0].capacity > 256
    _assert_same_cache(cache_a, cache_b)


@needs_kernels
@pytest.mark.parametrize("prefill", [2, 13, 60, 1030, 1300])
def test_fused_attention_splits_any_length_into_work_items_alike(prefill, tiny_model):
    """The C attention splits a head's entries into work items (a quarter of a short cache, at least 16 each;
    256 each past 1,024) and combines their softmaxes after: at every size, with tails that are not a multiple
    of 16, its output and the CED scores it folds in equal the per-op step's."""
    model = _packed(tiny_model, "llama")
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, prefill + 6))
    knobs = dict(kv_cache_ratio=0.9, csa2_topk=0, ced_decay=0.95, min_entries=4096)  # scoring, never compacting
    got, cache_a, expected, cache_b = _both(model, ids, prefill, threads=2, **knobs)
    assert cache_a.compactions == 0 and cache_a.stored == prefill + 6
    assert cache_a.layers[0].scores[:, : prefill + 6].abs().sum() > 0
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(cache_a, cache_b)


@needs_kernels
@pytest.mark.parametrize("policy,mode", [("ced", "evict"), ("ced", "merge"), ("h2o", "evict"), ("snapkv", "evict")])
def test_fused_step_scores_and_compacts_like_the_per_op_step(policy, mode, tiny_model):
    """While compressing, each step folds its attention into the scores (CED: after decaying them), and
    compactions in between choose the same entries; merged entries' counts enter the logits."""
    model = _packed(tiny_model, "llama")
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 90))
    knobs = dict(kv_cache_ratio=0.5, csa2_topk=0, ced_policy=policy, ced_mode=mode, ced_decay=0.9,
                 ced_sink_tokens=2, ced_recent_tokens=4, min_entries=8)
    got, cache_a, expected, cache_b = _both(model, ids, 40, compact_at=(50, 65, 80), **knobs)
    assert cache_a.compactions == 3 and cache_a.stored < 60
    if mode == "merge":
        assert any(layer.merged_any for layer in cache_a.layers)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(cache_a, cache_b)


@needs_kernels
def test_fused_step_with_int8_weights(tiny_model):
    model = _packed(tiny_model, "qwen2", fmt="int8")
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 60))
    got, cache_a, expected, cache_b = _both(model, ids, 40, kv_cache_ratio=1.0, csa2_topk=0)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(cache_a, cache_b)


@needs_kernels
def test_which_layers_the_fused_step_hands_back_to_the_cache(tiny_model, monkeypatch):
    """A plain decode step runs every layer in C (no `attend`); prefill runs per layer; an INT8 cache and a
    layer with a CSA2 side cache are appended to and attended by `attend`, called back from the C step,
    with the per-op step's results."""
    model = _packed(tiny_model, "llama")
    ids = torch.randint(0, 256, (1, 30))
    calls = []
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    original = type(cache).attend

    def counting(self, index, *args, **kwargs):
        calls.append(index)
        return original(self, index, *args, **kwargs)

    monkeypatch.setattr(type(cache), "attend", counting)
    adapter.forward(model, ids[:, :20], cache, prefill=True)
    assert calls == [0, 1]  # prefill: per layer
    adapter.forward(model, ids[:, 20:21], cache, prefill=False)
    assert calls == [0, 1]  # decode: one fused call, no attend
    assert cache.stored == 21 and cache.seen == 21

    calls.clear()
    got, int8_cache, expected, int8_reference = _both(model, ids, 20, kv_cache_ratio=1.0, csa2_topk=0, kv_cache_dtype="int8")
    assert int8_cache.fused_plan() is None  # outside a forward
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    _assert_same_cache(int8_cache, int8_reference)
    assert torch.allclose(int8_cache.layers[1].key_scales[:, :30], int8_reference.layers[1].key_scales[:, :30], rtol=1e-4)
    assert calls.count(1) == 2 * 11  # both paths: the prefill's call, then one per decode step, per layer

    torch.manual_seed(6)
    long_ids = torch.randint(0, 256, (1, 80))
    knobs = dict(kv_cache_ratio=1.0, csa2_topk=4, ced_sink_tokens=2, ced_recent_tokens=4)
    monkeypatch.setattr("engine.cache.csa2.DENSE_BELOW", 1)  # sparse from 11 entries on
    calls.clear()
    decoder = adapter.runtime(model).decoder
    sparse = make_cache(model, **knobs)
    adapter.forward(model, long_ids[:, :60], sparse, prefill=True)
    sparse.fit_sparse()
    sparse.layers[1].projected_keys = None  # layer 0 sparse (Python), layer 1 dense (C)
    reference = make_cache(model, **knobs)
    adapter.forward(model, long_ids[:, :60], reference, prefill=True)
    reference.fit_sparse()
    reference.layers[1].projected_keys = None
    calls.clear()
    fused = decoder.fused
    got, expected = [], []
    for i in range(60, 80):
        got.append(adapter.forward(model, long_ids[:, i:i + 1], sparse, prefill=False)[0, -1])
    assert calls == [0] * 20
    decoder.fused = None
    try:
        for i in range(60, 80):
            expected.append(adapter.forward(model, long_ids[:, i:i + 1], reference, prefill=False)[0, -1])
    finally:
        decoder.fused = fused
    assert sparse.stats().csa2_steps == 20
    assert torch.allclose(torch.stack(got), torch.stack(expected), atol=1e-4, rtol=1e-4)
    _assert_same_cache(sparse, reference)


@needs_kernels
def test_an_error_in_the_called_back_attention_leaves_the_cache_as_it_was(tiny_model, monkeypatch):
    """Out of memory (or any error) in a layer's Python attention mid-step: the error reaches the caller
    and the forward is undone; no layer keeps the half-made entry or a score for it."""
    model = _packed(tiny_model, "llama")
    ids = torch.randint(0, 256, (1, 30))
    cache = make_cache(model, kv_cache_ratio=0.5, csa2_topk=0, kv_cache_dtype="auto", min_entries=8)
    adapter.forward(model, ids[:, :20], cache, prefill=True)
    before = [layer.length for layer in cache.layers]
    real_plan = type(cache).fused_plan
    monkeypatch.setattr(type(cache), "fused_plan",  # layer 1 through attend
                        lambda self: real_plan(self) and FusedPlan([False, True], real_plan(self).score,
                                                                     real_plan(self).decay))

    def failing(self, index, *args, **kwargs):
        raise torch.OutOfMemoryError("no memory for layer 1")

    monkeypatch.setattr(type(cache), "attend", failing)
    with pytest.raises(torch.OutOfMemoryError):
        adapter.forward(model, ids[:, 20:21], cache, prefill=False)
    assert cache.seen == 20
    for layer, length in zip(cache.layers, before, strict=True):
        assert layer.length == length
        assert not layer.scores[:, length:].any()  # as after the per-op step's failure: no trace of the entry
    # the cache stays usable: the same step again succeeds
    monkeypatch.undo()
    adapter.forward(model, ids[:, 20:21], cache, prefill=False)
    assert cache.seen == 21 and all(layer.length == 21 for layer in cache.layers)


@needs_kernels
def test_fused_step_is_built_for_packed_and_float32_weights_unless_turned_off(tiny_model, monkeypatch):
    assert adapter.runtime(_packed(tiny_model, "llama", "float32")).decoder.fused is not None
    assert adapter.runtime(_packed(tiny_model, "llama", "int8")).decoder.fused is not None
    half = tiny_model("llama").to(torch.float16)  # no kernel reads float16: the per-op step
    adapter.install(half)
    assert adapter.runtime(half).decoder is None or adapter.runtime(half).decoder.fused is None
    monkeypatch.setenv("DSV41_FUSED_STEP", "0")
    assert adapter.runtime(_packed(tiny_model, "llama")).decoder.fused is None


@pytest.fixture(autouse=True)
def _float_x():
    """Q4 products on float32 x (the default): with int8-rounded x (DSV41_GGUF_INT8_X=1) the last-bit differences between
    two steps' activations flip roundings, so step is compared against step on float x (int8 x: the test below)."""
    with float_activations():
        yield


@needs_kernels
def test_the_default_models_steps_on_int8_x_stay_close_to_float_x(default_model):
    """The Q4 products' int8-rounded x (DSV41_GGUF_INT8_X=1 on AVX-512 VNNI) moves the logits a little."""
    hf = default_model.hf_model
    if not has_int8_activations():
        pytest.skip("this CPU has no AVX-512 VNNI: the Q4 products keep x float32")
    ids = torch.tensor([default_model.tokenizer.encode(
        "The State of the Union is strong, and our economy keeps growing because we invest in")])
    prefill = ids.shape[1] - 8
    with activations("int8"):
        cache = make_cache(hf, kv_cache_ratio=1.0, csa2_topk=0)
        rounded = _decode(hf, cache, ids, prefill, (), None)
    with float_activations():
        cache = make_cache(hf, kv_cache_ratio=1.0, csa2_topk=0)
        exact = _decode(hf, cache, ids, prefill, (), None)
    error, scale = (rounded - exact).abs(), exact.abs().max()
    assert 0 < error.max() < 0.1 * scale and error.mean() < 0.01 * scale
    assert torch.equal(rounded.argmax(-1), exact.argmax(-1))


@needs_kernels
def test_fused_step_on_the_default_model(default_model):
    """The shipped model (bf16-held weights) decodes through the fused step, with the per-op step's logits."""
    hf = default_model.hf_model
    decoder = adapter.runtime(hf).decoder
    assert decoder.fused is not None
    ids = torch.tensor([default_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")])
    prefill = ids.shape[1] - 4
    got, cache_a, expected, cache_b = _both(hf, ids, prefill, kv_cache_ratio=1.0, csa2_topk=0)
    assert torch.allclose(got, expected, atol=2e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(cache_a, cache_b)


def _avx2_library():
    """The kernels built for AVX2 + FMA only (the path CPUs without AVX-512 take), where this CPU can run it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = info.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if cpu_kernels.load() is None or " avx2" not in flags or " fma" not in flags:
        pytest.skip("needs the kernels and an AVX2 + FMA CPU")
    library = cpu_kernels.build(("-mno-avx512f",))
    assert library.isa == 256
    return library


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(96, 576), (13, 70), (64, 9000)])
def test_avx2_matvec_equals_float32_arithmetic(rows, cols):
    library = _avx2_library()
    torch.manual_seed(rows)
    w = torch.randn(rows, cols)
    x = torch.randn(cols)
    got = cpu_kernels.PackedMatrix(w.bfloat16().contiguous(), library=library).matvec(x)
    reference = w.bfloat16().double() @ x.double()
    assert torch.allclose(got.double(), reference, atol=1e-4, rtol=1e-5)
    q, scale = cpu_kernels.quantize_rows_int8(w)
    got = cpu_kernels.PackedMatrix(q, scale, library=library).matvec(x)
    reference = (q.double() * scale.double()[:, None]) @ x.double()
    assert torch.allclose(got.double(), reference, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_avx2_fused_step_equals_the_per_op_step(tiny_model):
    library = _avx2_library()
    model = _packed(tiny_model, "qwen3")
    adapter.runtime(model).decoder.fused = cpu_kernels.FusedDecodeStep(adapter.runtime(model).decoder.w, library)
    torch.manual_seed(4)
    ids = torch.randint(0, 256, (1, 90))
    knobs = dict(kv_cache_ratio=0.5, csa2_topk=0, ced_mode="merge", ced_sink_tokens=2, ced_recent_tokens=4,
                 min_entries=8)
    got, cache_a, expected, cache_b = _both(model, ids, 40, compact_at=(60,), **knobs)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    _assert_same_cache(cache_a, cache_b)


@needs_kernels
def test_bf16_model_decodes_fused_with_a_bf16_cache(tiny_model):
    """dtype="bfloat16": the cache holds bf16 keys and values; the fused step reads them widened, computes in
    float32 and writes the new entry rounded to nearest even. The per-op step computes in bf16 throughout, so
    the two agree to bf16's precision (not to float32's), with the same greedy tokens."""
    from engine.cache import CacheSettings, DSV41Cache

    model = tiny_model("llama").to(torch.bfloat16)
    adapter.install(model)
    assert adapter.packed_format(model) == "bf16" and adapter.compute_dtype(model) == torch.bfloat16
    decoder = adapter.runtime(model).decoder
    assert decoder.fused is not None
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (1, 60))

    def run(fused):
        saved = decoder.fused
        decoder.fused = fused
        try:
            layers, kv_heads, head_dim = adapter.kv_geometry(model)
            cache = DSV41Cache(layers, kv_heads, head_dim, torch.bfloat16, "cpu",
                               CacheSettings(kv_cache_ratio=1.0, csa2_topk=0))
            return _decode(model, cache, ids, 30), cache
        finally:
            decoder.fused = saved

    got, cache_a = run(decoder.fused)
    expected, cache_b = run(None)
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 0.03 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    for la, lb in zip(cache_a.layers, cache_b.layers, strict=True):
        assert la.keys.dtype == torch.bfloat16 and la.length == lb.length == 60
        n = la.length
        assert torch.allclose(la.keys[:, :n].float(), lb.keys[:, :n].float(), atol=0.05 * lb.keys[:, :n].float().abs().max())
        assert torch.equal(la.keys[:, :30], lb.keys[:, :30])  # the prefill's entries are the same path's


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(96, 576), (13, 70), (40, 3000)])
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_float32_matvec_of_the_fused_step(rows, cols, isa):
    """The float32 matrix-vector kernel the fused step uses for float32 weights (short rows: one linear
    prefetch stream; rows over 4 KiB: per-row prefetch), on both instruction sets."""
    library = cpu_kernels.load() if isa == "native" else _avx2_library()
    torch.manual_seed(cols)
    w, x = torch.randn(rows, cols), torch.randn(cols)
    for threads in (1, 2):
        out, acc = torch.empty(rows), torch.randn(rows)
        summed = acc.clone()
        library.lib.dsv41_mv_f32(w.data_ptr(), x.data_ptr(), out.data_ptr(), rows, cols, 0, threads)
        library.lib.dsv41_mv_f32(w.data_ptr(), x.data_ptr(), summed.data_ptr(), rows, cols, 1, threads)
        reference = w.double() @ x.double()
        assert torch.allclose(out.double(), reference, atol=1e-4, rtol=1e-5)
        assert torch.allclose(summed.double(), reference + acc.double(), atol=1e-4, rtol=1e-5)


@needs_kernels
def test_kernel_ceiling_is_measured_on_the_fused_steps_products(tiny_model):
    """The bench's kernel ceiling: every product of one fused step, timed in C (no Python between them), so
    a whole step can never be faster than it."""
    from benchmarks.speed import core

    model = _packed(tiny_model, "llama")
    ceiling = core.matvec_ceiling(model)
    assert ceiling["from"] == "fused step (C)" and ceiling["seconds"] > 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    assert ceiling["bytes"] <= weights  # the tied head counted once
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    ids = torch.randint(0, 256, (1, 18))
    adapter.forward(model, ids[:, :10], cache, prefill=True)
    import time

    # the products alone and whole steps taken in turns, the fastest of each compared: a step holds every product,
    # so only noise could put a step below them, and the minima drop it. On one thread: after the app's tests have
    # run engine work on other threads, waking OpenMP teams made the products' many parallel regions 10-30x slower
    # than alone (CI: products 0.27 ms, steps 0.19-0.55 ms), which says nothing about what a step computes
    fused = adapter.runtime(model).decoder.fused
    steps, products = [], []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(10, 18):
            products.append(fused.matrices_seconds(1))
            started = time.perf_counter()
            adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)
            steps.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    assert min(steps) > min(products)


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "int8", "gguf"])
def test_the_read_ceiling_reads_every_byte_of_the_steps_matrices_once(tiny_model, default_model, fmt):
    """The benchmarks' read ceiling (dsv41_step_read) sums every byte it reads: that sum is the sum of the bytes of
    every matrix the step multiplies (each layer's four and the head, every stacked part), on one thread and on
    three (each a share of each matrix); so the time it takes is that of reading exactly those bytes."""
    from engine.kernels.fused import _parts

    if fmt == "gguf":
        decoder = adapter.runtime(default_model.hf_model).decoder
    else:
        decoder = adapter.runtime(_packed(tiny_model, "llama", fmt)).decoder
    fused, w = decoder.fused, decoder.w
    matrices = [m for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [w.lm_head]
    want = sum(int(data.contiguous().view(torch.uint8).sum()) for m in matrices for *_, data, _ in _parts(m))
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert fused._lib.dsv41_step_read(ctypes.byref(fused._model), fused._layers, threads) == want
    finally:
        torch.set_num_threads(previous)
    assert fused.read_seconds(3) > 0


@needs_kernels
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("kv", ["bf16", "float32", "bf16 merged"])
@pytest.mark.parametrize("length", [5, 100, 1100])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (8, 1, 64), (4, 4, 64), (10, 2, 128), (6, 2, 96),
                                                (4, 2, 40)])
def test_the_steps_attention_equals_a_float64_reference(kv, length, heads, kv_heads, d, isa):
    """The fused step's attention (dsv41_step_attention: the same code, alone) over bf16 or float32 entries (and bf16
    entries standing for merged tokens, their log counts added to the logits): its
    output and its score update against softmax(q K^T / sqrt(d)) V in float64 over the same stored values. bf16 keys
    of head size 64 are multiplied as stored, by q in two bf16 terms (16 significant bits): within 2e-5 of the
    output's largest value, where q rounded to one bf16 term is ~1e-2 off. The groups cover each way the value pass
    takes query heads (1, 3, 4 + 4 at head size 64; 2 + 2 + 1 at 128; the general loop at 96), on this CPU's build
    and on the AVX2 build (logits 8 rows and up to 4 heads at a time: 1, 2, 3, 4 + 4, 4 + 1; the values up to 3
    heads and 32 columns at a time, the last 8 columns apart at head size 40; a short item's last logits one row at
    a time)."""
    from engine.kernels.fused import _StepCache, _StepModel

    lib = (cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else cpu_kernels.load()).lib
    capacity = length + 7
    g = torch.Generator().manual_seed(length)
    dtype = torch.bfloat16 if kv.startswith("bf16") else torch.float32
    keys = (torch.randn(kv_heads, capacity, d, generator=g) * 2).to(dtype)
    values = torch.randn(kv_heads, capacity, d, generator=g).to(dtype)
    q = torch.randn(heads, d, generator=g) * 2
    positions = torch.zeros(kv_heads, capacity, dtype=torch.int32)
    scores = torch.rand(kv_heads, capacity, generator=g)
    before = scores.clone()
    scaling = d ** -0.5
    # merged entries: each entry's log count (log of the tokens it stands for) added to its logits
    log_counts = torch.log(torch.randint(1, 9, (kv_heads, capacity), generator=g).float()) if "merged" in kv else None
    model = _StepModel(hidden=heads * d, heads=heads, kv_heads=kv_heads, head_dim=d, inter=1, vocab=1, layers=1,
                       kv_bf16=int(dtype == torch.bfloat16), eps=1e-6, scaling=scaling)
    cache = _StepCache(keys=keys.data_ptr(), values=values.data_ptr(), positions=positions.data_ptr(),
                       scores=scores.data_ptr(), log_counts=None if log_counts is None else log_counts.data_ptr(),
                       length=length, capacity=capacity, by_callback=0)
    chunks = max(4, -(-length // 256))
    work = torch.empty(heads * length + 2 * heads * chunks + heads * chunks * d)
    out = torch.empty(heads, d)
    assert lib.dsv41_step_attention(ctypes.byref(model), ctypes.byref(cache), q.data_ptr(), out.data_ptr(),
                                    work.data_ptr(), work.numel(), 1, 0.9, 2) == 0
    k, v = keys[:, :length].double(), values[:, :length].double()
    bias = 0 if log_counts is None else log_counts[:, None, :length].double()
    probs = torch.softmax(q.double().view(kv_heads, heads // kv_heads, d) @ k.transpose(1, 2) * scaling + bias, dim=-1)
    want = (probs @ v).reshape(heads, d)
    assert (out.double() - want).abs().max() <= 2e-5 * want.abs().max()
    want_scores = 0.9 * before[:, :length].double() + probs.sum(dim=1)
    assert (scores[:, :length].double() - want_scores).abs().max() <= 2e-5 * want_scores.abs().max()
    assert torch.equal(scores[:, length:], before[:, length:])
    coarse = q.to(torch.bfloat16).double().view(kv_heads, heads // kv_heads, d)  # one bf16 term: what is avoided
    off = (torch.softmax(coarse @ k.transpose(1, 2) * scaling + bias, dim=-1) @ v).reshape(heads, d) - want
    assert off.abs().max() > 1e-3 * want.abs().max()


@needs_kernels
def test_a_new_cache_is_never_mistaken_for_a_freed_one(tiny_model):
    """The fused step keeps raw pointers into each layer's tensors. A cache made after another is freed is
    often allocated at the same addresses (same id()): the step must still point at the new tensors, not
    at freed memory (that corrupted the heap in a benchmark that made many caches in a row)."""
    import gc

    model = _packed(tiny_model, "llama")
    fused = adapter.runtime(model).decoder.fused
    ids = torch.randint(0, 256, (1, 12))
    for _ in range(6):
        cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
        adapter.forward(model, ids[:, :10], cache, prefill=True)
        adapter.forward(model, ids[:, 10:11], cache, prefill=False)
        for index, layer in enumerate(cache.layers):
            spec = fused._caches[index]
            assert spec.keys == layer.keys.data_ptr() and spec.values == layer.values.data_ptr()
            assert spec.scores == layer.scores.data_ptr() and spec.positions == layer.positions.data_ptr()
        del cache, layer
        gc.collect()
    assert len({layer.storage_version for layer in make_cache(model).layers}) == 2  # one per allocation


@needs_kernels
def test_the_fused_step_and_the_packed_products_refuse_what_they_would_write_past(tiny_model):
    """The C step writes each layer's entry into the cache's storage and the products write `rows` floats: a cache
    of another layer count or storage, an input vector of another size, or an out too short is refused with a
    ValueError before any C call, never written past."""
    model = _packed(tiny_model, "llama")
    fused = adapter.runtime(model).decoder.fused
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    ids = torch.randint(0, 256, (1, 12))
    adapter.forward(model, ids[:, :10], cache, prefill=True)
    d = fused._model.head_dim
    x, cos, sin = torch.zeros(fused.hidden), torch.ones(d), torch.zeros(d)
    layers = cache.layers
    with pytest.raises(ValueError, match="layers"):
        fused.step(x, 10, cos, sin, type("Short", (), {"layers": layers[:-1]})(), [False] * (len(layers) - 1),
                   score=False, decay=1.0)
    with pytest.raises(ValueError, match="float32 CPU vectors"):
        fused.step(x[:-1], 10, cos, sin, cache, [False] * len(layers), score=False, decay=1.0)
    with pytest.raises(ValueError, match="float32 CPU vectors"):
        fused.step(x, 10, cos.double(), sin, cache, [False] * len(layers), score=False, decay=1.0)
    lengths = [layer.length for layer in layers]
    fused._cache_key[0] = None  # the next step points layer 0 again: at storage of the wrong head dim
    real = layers[0].keys
    layers[0].keys = torch.zeros(real.shape[0], real.shape[1], d // 2, dtype=real.dtype)
    try:
        with pytest.raises(ValueError, match="storage"):
            fused.step(x, 10, cos, sin, cache, [False] * len(layers), score=False, decay=1.0)
    finally:
        layers[0].keys = real
        fused._cache_key[0] = None
    assert [layer.length for layer in layers] == lengths  # nothing was appended by the refused steps
    adapter.forward(model, ids[:, 10:11], cache, prefill=False)  # the right cache still decodes
    assert [layer.length for layer in layers] == [n + 1 for n in lengths]
    matrix = cpu_kernels.PackedMatrix(torch.randn(16, 32).to(torch.bfloat16))
    guard = torch.zeros(20)
    for vec, out in ((torch.zeros(32), guard[:4]), (torch.zeros(4), guard[:16]), (torch.zeros(32).double(), None)):
        with pytest.raises(ValueError, match="matvec takes"):
            matrix.matvec(vec, out)
    assert not guard.any()


@needs_kernels
@pytest.mark.parametrize("mode", ["evict", "merge"])
def test_the_default_models_bf16_cache_decodes_alike_fused_and_per_op(default_model, mode):
    """The default load stores bf16 keys and values (DSV41Model.kv_dtype) under float32 activations. The fused
    step and the per-op step (SDPA / decode_attention over the bf16 entries, merged entries' counts in the
    prefill after a compaction) agree, and a cache holds bf16 throughout."""
    hf = default_model.hf_model
    decoder = adapter.runtime(hf).decoder
    ids = torch.tensor([default_model.tokenizer.encode(
        "The State of the Union is strong. Our economy keeps growing, and our people keep working. " * 3)])
    saved = default_model.config
    default_model.config = saved.replace(kv_cache_ratio=0.5, csa2_topk=0, ced_mode=mode)

    def run(fused):
        keep = decoder.fused
        decoder.fused = fused
        try:
            cache = default_model.new_cache()
            cache.settings.min_entries = 8
            assert cache.dtype == torch.bfloat16 and cache.layers[0].keys.dtype == torch.bfloat16
            n = ids.shape[1] - 12
            adapter.forward(hf, ids[:, : n - 8], cache, prefill=True)
            cache.compact()
            adapter.forward(hf, ids[:, n - 8: n], cache, prefill=True)  # a chunk over merged entries
            out = [adapter.forward(hf, ids[:, i:i + 1], cache, prefill=False)[0, -1] for i in range(n, ids.shape[1])]
            return torch.stack(out), cache
        finally:
            decoder.fused = keep

    try:
        got, cache_a = run(decoder.fused)
        expected, cache_b = run(None)
    finally:
        default_model.config = saved
    assert cache_a.compactions == 1 and (mode == "evict" or any(layer.merged_any for layer in cache_a.layers))
    assert got.dtype == torch.float32
    # the per-op step multiplies bf16 q by the bf16 entries (bf16 products); the fused one widens them to float32
    assert (got - expected).abs().max() < 0.02 * expected.abs().max(), (got - expected).abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    for la, lb in zip(cache_a.layers, cache_b.layers, strict=True):
        assert la.length == lb.length
        a, b = la.keys[:, : la.length].float(), lb.keys[:, : lb.length].float()
        assert (a - b).abs().max() <= 0.03 * b.abs().max()  # bf16 roundings apart, not different entries


# Run in a process of its own: the products' scratch for rows wider than their stack buffers is malloc'd, and a
# failed malloc used to leave the output unwritten without a word. glibc is told to mmap every block over 64 KiB
# (no reuse of a freed heap top), and the address space is capped just above what the process holds once every
# buffer of the call exists, so only the scratch's malloc fails.
_NO_MEMORY_SCRIPT = r'''
import resource, sys, torch
torch.set_num_threads(1)

def cap(extra):
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))

def uncap():
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

case = sys.argv[1]
if case in ("bf16", "gguf", "gguf-split"):
    from engine.kernels import PackedMatrix
    from engine.kernels.gguf_blocks import GGUFMatrix
    cols = 1 << 21
    if case == "bf16":
        matrix = PackedMatrix(torch.randn(2, cols).to(torch.bfloat16))
    else:  # Q4_0 blocks (d = 1.0, every nibble 9): each row is sum(x); its scratch is x's block sums (held split
        # where the Q4 products take x as bf16 terms: their scratch is x's terms)
        blocks = torch.full((2, cols // 32, 18), 0x99, dtype=torch.uint8)
        blocks[:, :, 0], blocks[:, :, 1] = 0x00, 0x3C
        matrix = GGUFMatrix(2, blocks.reshape(2, -1), cols)
        matrix = matrix.as_split() if len(sys.argv) > 2 else matrix
    x = torch.randn(cols)
    out = torch.full((2,), float("nan"))
    matrix.matvec(x, out)
    assert torch.isfinite(out).all()
    out.fill_(float("nan"))
    cap(1 << 16)
    try:
        matrix.matvec(x, out)
    except MemoryError:
        uncap()
        print("MemoryError", "unwritten" if torch.isnan(out).all() else "written")
    else:
        uncap()
        print("returned", "unwritten" if torch.isnan(out).all() else "written")
else:  # the fused step, whose down product reads rows of 65,536 columns
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.models import adapter
    from tests.engine.test_cache import make_cache
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=1 << 16,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    adapter.install(model, pack_rounding=True, pack_format="bf16")
    assert adapter.runtime(model).decoder.fused is not None
    cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    ids = torch.randint(0, 256, (1, 12))
    adapter.forward(model, ids[:, :10], cache, prefill=True)
    with torch.no_grad():
        adapter.forward(model, ids[:, 10:11], cache, prefill=False)  # every buffer of a step exists
    length = cache.layers[0].length
    cap(1 << 17)
    try:
        with torch.no_grad():
            adapter.forward(model, ids[:, 11:12], cache, prefill=False)
    except MemoryError:
        uncap()
        kept = cache.layers[0].length == length
        with torch.no_grad():
            logits = adapter.forward(model, ids[:, 11:12], cache, prefill=False)
        print("MemoryError", "kept" if kept else "appended", "decodes" if torch.isfinite(logits).all() else "broken")
    else:
        uncap()
        print("returned")
'''


@needs_kernels
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="caps the address space through /proc and glibc")
@pytest.mark.parametrize("case, expected", [("bf16", "MemoryError unwritten"), ("gguf", "MemoryError unwritten"),
                                            ("gguf-split", "MemoryError unwritten"),
                                            ("fused", "MemoryError kept decodes")])
def test_a_product_without_memory_for_its_scratch_raises_memory_error(case, expected, tmp_path):
    """A wide row's scratch that cannot be allocated is a MemoryError (which a turn reports as out of memory),
    never an output left unwritten; the fused step stops without appending and the next step decodes."""
    script = tmp_path / "no_memory.py"
    script.write_text(_NO_MEMORY_SCRIPT)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    args = [case, "split"] if case == "gguf-split" else [case]
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected
