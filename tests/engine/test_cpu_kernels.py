"""engine.cpu_kernels: bf16/int8 weights through our CPU matrix-vector kernels, and the decoder on them."""

import platform
import shutil
import sys

import pytest
import torch

from engine import kernels as cpu_kernels
from engine.kernels import PackedMatrix, bf16_exact
from engine.memory import module_bytes
from engine.models import adapter

from .test_cache import make_cache, run_ids

BUILDS_HERE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and bool(
    shutil.which("cc") or shutil.which("gcc"))
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def test_kernels_build_where_a_compiler_is():
    """On Linux x86-64 with a C compiler (CI, the machines we measure on) the kernels must build and load,
    so the tests below run instead of skipping."""
    if not BUILDS_HERE:
        pytest.skip("no C compiler on Linux x86-64 here")
    library = cpu_kernels.load()
    assert library is not None, cpu_kernels.unavailable_reason()
    assert library.isa in (256, 512) and library.path.is_file()


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(96, 576), (13, 70), (1, 31), (64, 9000), (200, 40)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_matvec_equals_float32_arithmetic(rows, cols, threads):
    torch.manual_seed(rows + cols)
    w = torch.randn(rows, cols).bfloat16()
    x = torch.randn(cols)
    packed = PackedMatrix(w.contiguous())
    reference = w.double() @ x.double()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = packed.matvec(x)
        acc = torch.randn(rows)
        summed = packed.matvec(x, acc.clone(), accumulate=True)
    finally:
        torch.set_num_threads(previous)
    tol = 1e-5 * cols ** 0.5 * (w.float().abs().max() * x.abs().max()).item()
    assert torch.allclose(got.double(), reference, atol=tol, rtol=0), (got.double() - reference).abs().max()
    assert torch.allclose(summed.double(), reference + acc.double(), atol=tol, rtol=0)


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(96, 576), (13, 70), (5, 130)])
def test_int8_matvec_applies_the_row_scales(rows, cols):
    torch.manual_seed(cols)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    scale = torch.rand(rows) * 0.01
    x = torch.randn(cols)
    packed = PackedMatrix(q, scale)
    reference = (q.double() * scale.double()[:, None]) @ x.double()
    got = packed.matvec(x)
    assert torch.allclose(got.double(), reference, atol=1e-4, rtol=1e-5), (got.double() - reference).abs().max()
    assert torch.allclose(packed.dense(), q.float() * scale[:, None])


@needs_kernels
def test_packed_linear_one_row_and_many_rows_agree_with_float32():
    torch.manual_seed(0)
    w = torch.randn(48, 64).bfloat16()
    bias = torch.randn(48)
    packed = PackedMatrix(w.contiguous())
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        residual = torch.randn(rows, 48)
        expected = torch.nn.functional.linear(x, w.float(), bias)
        assert torch.allclose(packed.linear(x, bias), expected, atol=1e-5)
        assert torch.allclose(packed.linear(x, residual=residual), residual + x @ w.float().t(), atol=1e-5)
        assert torch.allclose(packed.linear(x, bias, residual=residual), residual + expected, atol=1e-5)
    xb = torch.randn(1, 64).bfloat16()  # a bf16 model: activations converted in and out
    out = packed.linear(xb)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), xb.float() @ w.float().t(), atol=0.05, rtol=0.01)


def test_bf16_exact_detects_values_bf16_cannot_hold():
    w = torch.randn(8, 8).bfloat16().float()
    assert bf16_exact(w)
    w[3, 3] += 1e-4
    assert not bf16_exact(w)
    assert bf16_exact(w.bfloat16()) and not bf16_exact(w.half())


def _round_to_bf16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_on_bf16_held_weights_matches_float32(arch, tiny_model):
    """A float32 model whose values are all bf16 values is held as bf16 (half the bytes) and gives the same
    logits through prefill and decode, with the same float32 arithmetic."""
    reference_model = tiny_model(arch)
    _round_to_bf16(reference_model)
    model = tiny_model(arch)
    _round_to_bf16(model)
    adapter.install(reference_model, pack=False)
    before = module_bytes(model)
    adapter.install(model)
    assert adapter.packed_format(model) == "bf16" and adapter.packed_format(reference_model) is None
    assert adapter.compute_dtype(model) == torch.float32
    assert module_bytes(model) < 0.62 * before  # every matrix halved; norms and biases stay float32
    ids = torch.randint(0, 256, (1, 40))
    expected = run_ids(reference_model, make_cache(reference_model, kv_cache_ratio=1.0, csa2_topk=0), ids)
    got = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()


@needs_kernels
def test_inexact_float32_weights_stay_float32_unless_rounding_is_allowed(tiny_model):
    model = tiny_model("llama")  # random float32 values: bf16 would round them
    adapter.install(model)
    assert adapter.packed_format(model) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    rounded = tiny_model("llama")
    adapter.install(rounded, pack_rounding=True)
    assert adapter.packed_format(rounded) == "bf16"
    ids = torch.randint(0, 256, (1, 30))
    expected = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids)
    got = run_ids(rounded, make_cache(rounded, kv_cache_ratio=1.0, csa2_topk=0), ids)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()  # rounding noise, not a different model
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels.library, "_state", {})
    monkeypatch.setenv("DSV41_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert "DSV41_CPU_KERNELS=0" in cpu_kernels.unavailable_reason()


def test_int8_rows_quantize_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(20, 33) * torch.rand(20, 1)
    q, scale = cpu_kernels.quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (20,)
    assert q.abs().max() == 127  # each row's largest weight uses the full range
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7)


@needs_kernels
def test_int8_weights_run_through_the_decoder(tiny_model):
    """weight_quant="int8" on CPU: every matrix int8 with row scales (about a quarter of the bytes), float32
    compute, logits close to the float32 model's."""
    reference = tiny_model("qwen2")
    model = tiny_model("qwen2")
    adapter.install(reference, pack=False)
    before = module_bytes(model)
    adapter.install(model, pack_format="int8")
    assert adapter.packed_format(model) == "int8" and adapter.compute_dtype(model) == torch.float32
    assert module_bytes(model) < 0.4 * before
    ids = torch.randint(0, 256, (1, 30))
    expected = run_ids(reference, make_cache(reference, kv_cache_ratio=1.0, csa2_topk=0), ids)
    got = run_ids(model, make_cache(model, kv_cache_ratio=1.0, csa2_topk=0), ids)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@needs_kernels
def test_bf16_rows_round_only_the_activations():
    """A prefill chunk with bf16_rows: bf16(x) @ W^T with float32 accumulation, its result rounded to bf16 (what
    torch's CPU bf16 GEMM returns), then + bias and + residual in float32."""
    torch.manual_seed(7)
    w = torch.randn(40, 96).bfloat16()
    x, bias, residual = torch.randn(12, 96), torch.randn(40), torch.randn(12, 40)
    packed = PackedMatrix(w.contiguous())
    exact = packed.linear(x, bias, residual=residual)
    packed.bf16_rows = True
    got = packed.linear(x, bias, residual=residual)
    product = x.bfloat16().double() @ w.double().t()
    got_product = got.double() - residual.double() - bias.double()
    assert torch.all((got_product - product).abs() <= 2.0 ** -8 * product.abs() + 1e-5)  # within one bf16 rounding
    assert got.dtype == torch.float32 and not torch.equal(got, exact)
    assert torch.allclose(got, exact, atol=0.05, rtol=0.02)
    one = packed.linear(x[:1], bias)  # a decode step stays float32 (the matvec kernel)
    assert torch.allclose(one.double(), x[:1].double() @ w.double().t() + bias.double(), atol=1e-5)


@needs_kernels
def test_prefill_in_bf16_only_where_the_matrices_are_bf16(tiny_model):
    """set_prefill_bf16 applies to bf16-held matrices; int8 ones (their values are not bf16 values) keep a
    float32 prefill, and so do the caches made for them."""
    int8 = tiny_model("llama")
    adapter.install(int8, pack_format="int8", prefill_bf16=True)
    assert adapter.packed_format(int8) == "int8" and not adapter.prefill_bf16(int8)
    bf16 = tiny_model("llama")
    adapter.install(bf16, pack_rounding=True, prefill_bf16=True)
    assert adapter.prefill_bf16(bf16)
    assert not adapter.set_prefill_bf16(bf16, False) and not adapter.prefill_bf16(bf16)


@needs_kernels
@pytest.mark.parametrize("fast", ["0", "1"])
def test_bf16_products_only_where_the_cpu_multiplies_bf16_fast(tiny_model, monkeypatch, fast):
    """On a CPU without bf16 dot products (AVX2 alone: torch's reference path, ~100x slower than float32) a bf16
    prefill keeps its products float32 and still attends in bf16 into a bf16 cache; with one, the products are
    bf16 too. DSV41_BF16_PRODUCTS forces either for this test."""
    monkeypatch.setenv("DSV41_BF16_PRODUCTS", fast)
    model = tiny_model("llama")
    adapter.install(model, pack_rounding=True, prefill_bf16=True)
    assert adapter.prefill_bf16(model)  # the cache's side: bf16 attention, bf16 keys and values
    assert adapter.prefill_products_bf16(model) == (fast == "1")
    matrix = next(m for m in adapter.step_matrices(model) if isinstance(m, PackedMatrix))
    x = torch.randn(9, matrix.shape[1])
    exact = torch.nn.functional.linear(x, matrix.dense(torch.float32))
    got = matrix.linear(x)
    assert torch.equal(got, exact) == (fast == "0")  # float32 products are the float32 GEMM's, bit for bit
    monkeypatch.setenv("DSV41_BF16_PRODUCTS", "1" if fast == "0" else "0")
    adapter.set_prefill_bf16(model, True)  # applied again, it follows the CPU's (here: forced) answer
    assert adapter.prefill_products_bf16(model) == (fast == "0") and adapter.prefill_bf16(model)


def test_the_cpus_bf16_gemm_decides_without_the_environment(monkeypatch):
    from engine.kernels import packed

    monkeypatch.delenv("DSV41_BF16_PRODUCTS", raising=False)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert packed.bf16_products_fast() == bool(native and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setattr(packed, "_onednn_bf16", lambda: False)
    assert not packed.bf16_products_fast()
    monkeypatch.setenv("DSV41_BF16_PRODUCTS", "1")
    assert packed.bf16_products_fast()
