"""Our fused decoder and decode-attention kernels against the reference paths they replace."""

import pytest
import torch
import torch.nn.functional as F

from engine.cache.attention import attention_probs, decode_attention
from engine.cache.storage import _gather_rows
from engine.models import adapter
from engine.models.decoder import ROPE_TABLE_MIN, RopeTable, linear, residual_linear, rope, rope_matrix


def _param_bytes(model):
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def _storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_fused_weights_are_stored_once(tiny_model):
    model = tiny_model("qwen2")  # q/k/v carry biases
    before = _param_bytes(model)
    storages_before = len(_storages(model))
    adapter.install(model)
    assert adapter.uses_fast_decoder(model)
    # every layer's q/k/v (and gate/up) now live in one fused storage: fewer storages, same bytes
    assert _param_bytes(model) == before
    assert len(_storages(model)) < storages_before
    attn = model.model.layers[0].self_attn
    fused = adapter.runtime(model).decoder.w.layers[0].qkv
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(fused[: attn.q_proj.out_features], attn.q_proj.weight)


def test_quantized_or_custom_linears_fall_back_to_transformers_forward(tiny_model):
    class Custom(torch.nn.Linear):  # stands for a bitsandbytes Linear8bitLt / Linear4bit
        pass

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        reference = model(ids).logits
    old = model.model.layers[1].mlp.down_proj
    new = Custom(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    model.model.layers[1].mlp.down_proj = new
    adapter.install(model)
    assert not adapter.uses_fast_decoder(model)
    from .test_cache import make_cache, run_ids

    got = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids, prefill=12, chunk=6)
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("merged", [False, True])
def test_decode_attention_matches_reference(merged):
    torch.manual_seed(0)
    h, groups, d, s = 3, 3, 16, 200
    q = torch.randn(h * groups, 1, d)
    keys = torch.randn(h, 300, d)[:, :s]  # a strided slice, as read from storage
    values = torch.randn(h, 300, d)[:, :s]
    log_counts = torch.rand(h, s).log1p() if merged else None
    out, probs = decode_attention(q, keys, values, log_counts, 0.25)
    ref_probs = attention_probs(q, keys, log_counts, 0.25)  # [h, G, 1, S]
    ref_out = torch.matmul(ref_probs, values[:, None]).reshape(h * groups, 1, d)
    assert torch.allclose(probs, ref_probs[:, :, 0], atol=1e-6)
    assert torch.allclose(out, ref_out, atol=1e-5)


def test_row_gather_matches_elementwise_gather():
    torch.manual_seed(0)
    data = torch.randn(3, 128, 8)
    view = data[:, :100]
    index = torch.stack([torch.randperm(100)[:17].sort().values for _ in range(3)])
    expected = torch.gather(view, 1, index[:, :, None].expand(-1, -1, 8))
    assert torch.equal(_gather_rows(view, index), expected)
    scales = torch.randn(3, 128, 1)
    assert torch.equal(_gather_rows(scales, index), torch.gather(scales, 1, index[:, :, None]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_token_linear_matches_f_linear(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 64).to(dtype)
    b = torch.randn(96).to(dtype)
    x = torch.randn(1, 64).to(dtype)
    tol = 1e-1 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(linear(x, w, b).float(), F.linear(x, w, b).float(), atol=tol, rtol=2e-2)
    xs = torch.randn(5, 64).to(dtype)
    assert torch.equal(linear(xs, w), F.linear(xs, w))


def test_rope_matrix_rotates_like_rope():
    d = 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = 1234 * inv
    cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
    x = torch.randn(1, 12, d)
    want = rope(x, cos[None, None], sin[None, None])
    assert torch.allclose(torch.matmul(x, rope_matrix(cos, sin)), want, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_table_holds_the_rotary_modules_own_values(tiny_model, dtype):
    """A position's row of the table is what the model's rotary module returns for that position alone (bit for bit,
    in the activations' dtype and widened to float32), before and after the table grows past its first size."""
    model = tiny_model("llama")
    adapter.install(model)
    w = adapter.runtime(model).decoder.w
    table = RopeTable(w.rotary, dtype, torch.device("cpu"))
    probe = torch.empty(1, 1, 1, dtype=dtype)
    for position in (0, 1, 777, ROPE_TABLE_MIN - 1, ROPE_TABLE_MIN, 3 * ROPE_TABLE_MIN + 5):
        cos, sin = w.rotary(probe, torch.tensor([[position]]))
        got_cos, got_sin = table.row32(position)
        assert torch.equal(got_cos, cos[0, 0].float()) and torch.equal(got_sin, sin[0, 0].float())
        assert got_cos.is_contiguous() and got_cos.dtype == torch.float32
        assert torch.equal(table.ensure(position)[0][position], cos[0, 0].to(dtype))
    assert table.cos.shape[0] >= 3 * ROPE_TABLE_MIN + 6


def test_the_fused_step_takes_rope_from_the_table_and_calls_the_module_only_to_build_it(tiny_model, monkeypatch):
    """A one-token decode on the fused CPU step reads cos / sin from the table: the rotary module runs once (to build
    it) for a whole reply, and the logits are those of the per-op step, which calls the module every token."""
    from engine.kernels import load

    if load() is None:
        pytest.skip("no C compiler: no fused step")
    from .test_cache import make_cache

    model = tiny_model("llama")
    adapter.install(model)
    decoder = adapter.runtime(model).decoder
    assert decoder.fused is not None and decoder.rope is not None
    ids = torch.randint(0, 256, (1, 16))
    calls = []
    rotary = decoder.w.rotary
    monkeypatch.setattr(decoder.w, "rotary", lambda *a: calls.append(a[1].numel()) or rotary(*a))
    monkeypatch.setattr(decoder.rope, "rotary", decoder.w.rotary)
    caches = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
    outs = []
    for cache, fused in zip(caches, (decoder.fused, None), strict=True):
        decoder.fused = fused
        adapter.forward(model, ids[:, :8], cache, prefill=True)
        calls.clear()
        outs.append([adapter.forward(model, ids[:, i:i + 1], cache, prefill=False) for i in range(8, 16)])
        if fused is not None:
            assert calls == [ROPE_TABLE_MIN]  # the table, built once
        else:
            assert calls == [1] * 8
    for fused_logits, per_op in zip(*outs, strict=True):
        assert torch.allclose(fused_logits, per_op, atol=1e-5, rtol=1e-4)


def test_the_fused_step_takes_a_length_dependent_rope_from_the_module():
    """A rotary whose values depend on the length (dynamic scaling, past max_position_embeddings) has no table: the
    fused step (through adapter.forward and adapter.forward_token alike) gets the module's cos / sin for each token's
    position, and answers as the per-op step does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.kernels import load

    if load() is None:
        pytest.skip("no C compiler: no fused step")
    from .test_cache import make_cache

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})).eval()
    adapter.install(model)
    decoder = adapter.runtime(model).decoder
    assert decoder.fused is not None and decoder.rope is None
    fused = decoder.fused
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    outs = []
    for way in ("forward", "token", "per-op"):
        decoder.fused = None if way == "per-op" else fused
        cache = make_cache(model, kv_cache_ratio=1.0, csa2_topk=0)
        adapter.forward(model, ids[:, :8], cache, prefill=True)
        outs.append(torch.cat([adapter.forward_token(model, int(ids[0, i]), cache) if way == "token"
                               else adapter.forward(model, ids[:, i:i + 1], cache, prefill=False)
                               for i in range(8, 30)], dim=1))  # positions 8..29: past 16, the scaling grows
    decoder.fused = fused
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_residual_linear_is_residual_plus_linear(dtype, with_bias):
    torch.manual_seed(0)
    w = torch.randn(48, 32).to(dtype)
    b = torch.randn(48).to(dtype) if with_bias else None
    for tokens in (1, 5):
        x, r = torch.randn(tokens, 32).to(dtype), torch.randn(tokens, 48).to(dtype)
        want = (r.float() + F.linear(x.float(), w.float(), None if b is None else b.float()))
        tol = 1e-4 if dtype == torch.float32 else 0.3
        assert torch.allclose(residual_linear(r, x, w, b).float(), want, atol=tol, rtol=2e-2)


@pytest.mark.parametrize("merged", [False, True])
def test_attention_mass_in_blocks_equals_one_pass(monkeypatch, merged):
    from engine.cache import attention

    torch.manual_seed(0)
    q, k = torch.randn(6, 40, 16), torch.randn(2, 100, 16)  # 40 new queries, 100 stored entries (60 before them)
    counts = torch.rand(2, 100).log1p() if merged else None
    want = attention_probs(q, k, counts, 0.25, last=40).sum(dim=(1, 2))
    monkeypatch.setattr(attention, "SCORE_BLOCK_ELEMENTS", 6 * 100 * 7)  # 7 queries per block
    got = attention.attention_mass(q, k, counts, 0.25, last=40)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.sum(dim=1), torch.full((2,), 3 * 40.0), atol=1e-3)  # every query's weights sum to 1
    assert torch.allclose(attention.attention_mass(q, k, counts, 0.25, last=9),
                          attention_probs(q, k, counts, 0.25, last=9).sum(dim=(1, 2)), atol=1e-5)


@pytest.mark.parametrize("path", ["C", "torch"])
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [19, 45])
def test_question_attention_is_the_eager_attention_and_its_mass_from_one_softmax(monkeypatch, merged, dtype, path, t):
    """Through the one C call (cache_ops.question_attention: the keys and values as views of a layer's storage,
    the group's 3 x t query rows over one or several vector blocks) and through torch alike."""
    from engine import kernels
    from engine.cache import attention
    from engine.kernels import cache_ops

    if path == "C" and kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    real, calls = cache_ops.question_attention, []
    monkeypatch.setattr(cache_ops, "question_attention",
                        (lambda *a: calls.append(real(*a)) or calls[-1]) if path == "C" else (lambda *a: None))
    torch.manual_seed(0)
    q = torch.randn(6, t, 16)  # t question tokens, the last of 120 stored entries
    k, v = (torch.randn(2, 150, 16).to(dtype)[:, :120] for _ in range(2))  # a layer's storage up to its length
    counts = torch.rand(2, 150).log1p()[:, :120] if merged else None
    out, mass = attention.question_attention(q, k, v, counts, 0.25, last=12)
    probs = attention_probs(q, k, counts, 0.25)  # [h, G, T, S], float32, causal
    want = torch.matmul(probs, v.float()[:, None]).reshape(6, t, 16)
    assert out.dtype == torch.float32 and torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(mass, attention.attention_mass(q, k, counts, 0.25, last=12), atol=1e-6)
    assert torch.allclose(mass.sum(dim=1), torch.full((2,), 3 * 12.0), atol=1e-3)  # the last 12 queries only
    assert attention.fuses_question(q, k) and not attention.fuses_question(torch.randn(6, 200, 16), k)
    assert len(calls) == (1 if path == "C" else 0) and (path == "torch" or calls[0] is not None)


def test_a_scored_question_attends_as_the_dense_path_does(monkeypatch):
    """Through the cache: a short scored chunk goes through question_attention, and its output and the scores it
    leaves are the dense path's (dense_attention + attention_mass) within float32 error."""
    from engine.cache import CacheSettings, DSV41Cache, attention

    def run(fuse: bool):
        monkeypatch.setattr(attention, "QUESTION_ROWS", 128 if fuse else 0)
        cache = DSV41Cache(2, 2, 8, torch.float32, "cpu", CacheSettings(kv_cache_ratio=0.5, csa2_topk=0))
        g = torch.Generator().manual_seed(3)
        outs = []
        for tokens, window in ((90, 0), (12, 12)):
            cache.begin_forward(tokens, score_window=window, prefill=True, question=window > 0)
            for index in range(2):
                q, k, v = (torch.randn(1, h, tokens, 8, generator=g) for h in (4, 2, 2))
                outs.append(cache.attend(index, q, k, v, 8**-0.5))
            cache.end_forward()
        return outs, [layer.scores[:, : layer.length].clone() for layer in cache.layers]

    fused_out, fused_scores = run(True)
    dense_out, dense_scores = run(False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused_out, dense_out, strict=True))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fused_scores, dense_scores, strict=True))
    assert all(s.sum() > 0 for s in fused_scores)


@pytest.mark.parametrize("t", [1, 7, 64])
def test_chunk_attention_over_earlier_entries_matches_the_masked_reference(t):
    from engine.cache import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(9, t, 32), torch.randn(3, 150, 32), torch.randn(3, 150, 32)
    probs = attention_probs(q, k, None, 0.2)  # [h, G, T, S], causal: query i is entry 150 - t + i
    want = torch.matmul(probs, v[:, None]).reshape(9, t, 32)
    got = attention.dense_attention(q, k, v, None, 0.2, "sdpa")
    assert torch.allclose(got, want, atol=1e-5)
    if attention._cpu_flash_lse is not None and t > 1:  # the mask-free split is what ran
        assert torch.allclose(attention._prefix_and_chunk(q, k, v, 0.2), want, atol=1e-5)


def test_output_only_decode_attention_matches_decode_attention():
    from engine.cache.attention import decode_attention_output

    torch.manual_seed(0)
    q, k, v = torch.randn(9, 1, 16), torch.randn(3, 70, 16), torch.randn(3, 70, 16)
    want, _ = decode_attention(q, k, v, None, 0.25)
    assert torch.allclose(decode_attention_output(q, k, v, 0.25), want, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_output_only_decode_attention_takes_the_matrix_products_and_equals_sdpa():
    """On CUDA, SDPA (cuDNN) is built per length; the output-only decode takes decode_attention's products."""
    from engine.cache.attention import attention_kernels, decode_attention_output

    torch.manual_seed(0)
    q = torch.randn(32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.reshape(1, 8, 4, 128), k[None], v[None], scale=0.088)
    got = decode_attention_output(q, k, v, 0.088)
    assert (got.float() - sdpa.reshape(32, 1, 128).float()).abs().max() < 0.02
    assert attention_kernels("sdpa", "cuda", torch.bfloat16, 8, 4, 128)["decode"] == "matmul"


@pytest.mark.gpu
def test_on_a_gpu_prefill_attention_never_takes_cudnn_and_equals_the_math_kernel():
    """cuDNN's SDPA kernels are built per shape, and prefill chunks have new lengths: the cache's SDPA calls
    leave cuDNN out (flash or memory-efficient run), with the same result."""
    from engine.cache.attention import attention_kernels, causal_bias, dense_attention

    kernels = attention_kernels("sdpa", "cuda", torch.bfloat16, 8, 4, 128)
    assert "cuDNN" not in kernels.values(), kernels
    torch.manual_seed(0)
    q = torch.randn(32, 64, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = dense_attention(q, k, v, None, 0.088, "sdpa", causal_bias(64, 300, torch.bfloat16, "cuda"))
    want = dense_attention(q.float(), k.float(), v.float(), None, 0.088, "eager")
    assert (got.float() - want).abs().max() < 0.03


def test_the_question_attention_call_gives_the_same_result_on_any_number_of_threads():
    """cache_ops.question_attention splits entries and value tiles over its threads (any count, tiles not even)."""
    from engine import kernels
    from engine.kernels import cache_ops

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    torch.manual_seed(1)
    q = torch.randn(9, 21, 64)
    k, v = torch.randn(3, 700, 64).bfloat16(), torch.randn(3, 700, 64).bfloat16()
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 3, 5):
            torch.set_num_threads(n)
            outs.append(cache_ops.question_attention(q, k, v, None, 0.125, 10))
    finally:
        torch.set_num_threads(threads)
    for out, mass in outs[1:]:
        assert torch.allclose(out, outs[0][0], atol=1e-6) and torch.allclose(mass, outs[0][1], atol=1e-6)
