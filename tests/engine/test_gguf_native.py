"""A GGUF file's matrices held in their own block formats by the decoder (adapter.hold_gguf) and multiplied by the
fused decode step and the prefill (engine.kernels.gguf_blocks.GGUFWeight). Loaded straight from the file
(engine.models.gguf_load, every CPU load): the blocks kept and the tensors dequantised are exactly the weights of
transformers' model (llama.cpp's interleaved q / k rows put back in order for a Llama, a Qwen2's as stored), a
damaged or incomplete file is refused, the default model loads without a float copy of its weights. Loaded from a
float conversion (adapter.hold_gguf with the file): the values are exactly the converted weights, a layer's q, k
and v in three different formats make one matrix, a format not held falls back to bf16 and says so, and a tensor
whose values are not the model's is not held. The header reader (engine.gguf_index) against the gguf package's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine import kernels as cpu_kernels
from engine.cache import CacheSettings, DSV41Cache
from engine.kernels import GGUFWeight, PackedMatrix
from engine.kernels.gguf_blocks import activations, float_activations, x_modes
from engine.models import adapter

from .test_gguf_blocks import blocks_of, default_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

HEADS, KV_HEADS, HIDDEN, INTER = 4, 2, 256, 512
# each matrix its own format: three in one layer's qkv, k-quants and the 32-weight blocks side by side
LAYER_FORMATS = {"attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q5_K",
                 "ffn_up": "Q4_1", "ffn_down": "Q6_K"}


def _llama(arch: str = "llama"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config, model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                    tie_word_embeddings=False)
    return model(config).eval()


def _interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order for a Llama q / k projection: each head's two rotary halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_model(tmp_path, *, unheld: str | None = "blk.1.ffn_down", tamper: str | None = None, arch: str = "llama",
                skip: str | None = None):
    """A random tiny Llama (or Qwen2: q / k / v biases, rows not interleaved) and a GGUF file of it: each matrix
    written as blocks of its format (random blocks; the model's weights set to their values, in transformers' row
    order), `unheld` as F16 (no block format), the norms and biases as F32; `skip` left out of the file."""
    model = _llama(arch)
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), arch)
    writer.add_block_count(2)
    modules = {}
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        modules.update({f"blk.{i}.attn_q": (a.q_proj, HEADS), f"blk.{i}.attn_k": (a.k_proj, KV_HEADS),
                        f"blk.{i}.attn_v": (a.v_proj, None), f"blk.{i}.attn_output": (a.o_proj, None),
                        f"blk.{i}.ffn_gate": (m.gate_proj, None), f"blk.{i}.ffn_up": (m.up_proj, None),
                        f"blk.{i}.ffn_down": (m.down_proj, None)})
    modules["token_embd"] = (model.model.embed_tokens, None)
    modules["output"] = (model.lm_head, None)
    with torch.no_grad():
        for seed, (name, (module, heads)) in enumerate(modules.items()):
            rows, cols = module.weight.shape
            if name == unheld:
                stored = module.weight.detach().numpy().astype(np.float16)
                writer.add_tensor(name + ".weight", stored)
                module.weight.copy_(torch.from_numpy(stored.astype(np.float32)))
                continue
            fmt = LAYER_FORMATS.get(name.split(".")[-1], "Q8_0" if name == "output" else "Q4_1")
            data = blocks_of(fmt, rows, cols, seed=seed)
            qtype = gguf.GGMLQuantizationType[fmt]
            values = gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float32)
            if heads and arch == "llama":  # the file holds the rows interleaved; the model (as loaded) in order
                data = _interleave(data, heads)
            writer.add_tensor(name + ".weight", data, raw_shape=data.shape, raw_dtype=qtype)
            module.weight.copy_(torch.from_numpy(values))
            if getattr(module, "bias", None) is not None:
                module.bias.normal_()
                writer.add_tensor(name + ".bias", module.bias.detach().numpy())
        norms = {"output_norm.weight": model.model.norm}
        for i, layer in enumerate(model.model.layers):
            norms[f"blk.{i}.attn_norm.weight"] = layer.input_layernorm
            norms[f"blk.{i}.ffn_norm.weight"] = layer.post_attention_layernorm
        for name, norm in norms.items():
            norm.weight.uniform_(0.5, 1.5)
            if name != skip:
                writer.add_tensor(name, norm.weight.detach().numpy())
        if tamper:
            weight = dict((n, m) for n, (m, _) in modules.items())[tamper].weight
            weight[0, 0] += 1e-3  # the model's values are no longer the file's
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tmp_path / "tiny.gguf"


def _run(model, ids, prefill):
    layers, kv_heads, head_dim = adapter.kv_geometry(model)
    cache = DSV41Cache(layers, kv_heads, head_dim, torch.float32, "cpu", CacheSettings(kv_cache_ratio=1.0, csa2_topk=0))
    outs = [adapter.forward(model, ids[:, :prefill], cache, logits_to_keep=prefill)]
    for i in range(prefill, ids.shape[1]):
        outs.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False))
    return torch.cat(outs, dim=1)


def test_the_header_index_is_the_gguf_packages(tmp_path):
    from engine.gguf_index import tensor_index

    path = default_gguf()
    index = tensor_index(path)
    reader = gguf.GGUFReader(str(path))
    assert len(index) == len(reader.tensors)
    for tensor in reader.tensors:
        entry = index[tensor.name]
        assert (entry.type_id, entry.shape, entry.offset, entry.nbytes) == (
            int(tensor.tensor_type), tuple(int(n) for n in tensor.shape), int(tensor.data_offset), int(tensor.n_bytes))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:4096])  # the metadata cut off
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="header does not parse"):
        tensor_index(broken)


def test_a_gguf_is_held_as_its_blocks_and_answers_as_transformers(tmp_path):
    model, path = _gguf_model(tmp_path)
    reference = copy.deepcopy(model)
    adapter.install(model, pack_rounding=True, gguf=path)
    assert adapter.packed_format(model) == "GGUF Q4_0 + Q4_1 + Q4_K + Q5_K + Q6_K + Q8_0; F16 converted, others as bf16"
    w = adapter.runtime(model).decoder.w
    first, second = w.layers
    assert isinstance(first.qkv, GGUFWeight) and first.qkv.formats == ["Q4_K", "Q8_0", "Q6_K"]
    assert [type(m) for m in (first.o, first.gate_up, first.down)] == [GGUFWeight] * 3
    assert isinstance(second.down, PackedMatrix)  # F16 in the file: no block format, held as bf16
    assert isinstance(w.embed, GGUFWeight) and isinstance(w.lm_head, GGUFWeight) and w.embed is not w.lm_head
    # exactly the values transformers loaded (q / k rows back in order), and the model counts the blocks' bytes
    ref_layer = reference.model.layers[0].self_attn
    expected = torch.cat([ref_layer.q_proj.weight, ref_layer.k_proj.weight, ref_layer.v_proj.weight]).detach()
    assert torch.equal(first.qkv.dense(), expected)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    assert adapter.runtime(model).decoder.fused is not None

    with torch.no_grad():  # the unheld matrix as the model holds it: rounded to bf16
        down = reference.model.layers[1].mlp.down_proj.weight
        down.copy_(down.bfloat16().float())
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with float_activations():  # exact: the Q4 products on float32 x
        got = _run(model, ids, 16)
    with torch.no_grad():
        want = reference(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    decoder = adapter.runtime(model).decoder
    # the default rounded x (int16: AVX-512 VNNI and AVX2), else int8; int8's coarser rounding turns the two steps'
    # ~1e-5 apart into 1e-4 where a value rounds the other way (its own test: test_gguf_blocks)
    rounded = [mode for mode in ("int16", "int8") if mode in x_modes()][:1]
    fused, decoder.fused = decoder.fused, None  # the per-op step multiplies the same blocks
    try:
        with float_activations():
            per_op = _run(model, ids, 16)
        per_op_rounded = None
        if rounded:  # an AVX-512 build without VNNI has neither: x stays float32 there
            with activations(rounded[0]):
                per_op_rounded = _run(model, ids, 16)
    finally:
        decoder.fused = fused
    assert torch.allclose(got, per_op, atol=1e-5, rtol=1e-5)
    # Q4 products on rounded x, the fused and the per-op step alike, close: the two steps sum attention and norms in other orders (~1e-5 apart on float x
    # above), which x's rounding and the k-quants' bf16 terms carry on, so within the tolerance the float
    # comparison with transformers has
    if not rounded:
        return
    with activations(rounded[0]):
        got_rounded = _run(model, ids, 16)
    assert torch.allclose(got_rounded, per_op_rounded, atol=1e-4, rtol=1e-4), (got_rounded - per_op_rounded).abs().max()
    assert (got_rounded - want).abs().max() <= 0.05 * want.abs().max()


def _straight(path, reference, hold: bool = True):
    from engine.models.gguf_load import load_gguf_model

    return load_gguf_model(path, copy.deepcopy(reference.config), hold=hold)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_loads_straight_from_the_file_exactly(tmp_path, arch):
    """Read straight from the file (engine.models.gguf_load: no float copy of a held matrix is ever made): the
    blocks kept and everything dequantised are exactly the values of transformers' model, q / k rows in its order
    (llama.cpp interleaves a Llama's, a Qwen2's are as stored), and the model answers as the reference does."""
    reference, path = _gguf_model(tmp_path, arch=arch)
    exact = copy.deepcopy(reference)
    model, blocks = _straight(path, reference)
    kept = {f"blk.{i}.{n}.weight" for i in (0, 1) for n in LAYER_FORMATS} - {"blk.1.ffn_down.weight"}
    assert set(blocks.matrices) == kept | {"token_embd.weight", "output.weight"}
    meta = {n for n, p in model.named_parameters() if p.is_meta}
    assert len(meta) == len(kept) + 2  # the kept matrices' parameters are empty, nothing else
    adapter.install(model, pack_rounding=True, gguf=blocks)
    assert adapter.packed_format(model) == "GGUF Q4_0 + Q4_1 + Q4_K + Q5_K + Q6_K + Q8_0; F16 converted, others as bf16"
    assert not any(p.is_meta for p in model.parameters())
    w = adapter.runtime(model).decoder.w
    ref = reference.model.layers[0].self_attn
    assert torch.equal(w.layers[0].qkv.dense(), torch.cat([ref.q_proj.weight, ref.k_proj.weight,
                                                           ref.v_proj.weight]).detach())
    if arch == "qwen2":
        assert torch.equal(w.layers[0].qkv_bias, torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
    with torch.no_grad():  # the F16 matrix as the model holds it: rounded to bf16
        down = reference.model.layers[1].mlp.down_proj.weight
        down.copy_(down.bfloat16().float())
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with float_activations():
        got = _run(model, ids, 16)
    with torch.no_grad():
        want = reference(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()

    plain, none_kept = _straight(path, exact, hold=False)
    assert not none_kept.matrices
    values = plain.state_dict()
    for name, tensor in exact.state_dict().items():
        assert torch.equal(values[name], tensor), name  # every weight dequantised exactly (F16 included)


def test_a_damaged_or_incomplete_gguf_is_refused_when_loaded_straight(tmp_path):
    from engine.errors import ModelLoadError
    from engine.gguf_index import tensor_index

    reference, path = _gguf_model(tmp_path)
    data = bytearray(path.read_bytes())
    index = tensor_index(path)
    bad = tmp_path / "nan.gguf"
    for name, nan in (("blk.0.attn_output.weight", np.float16), ("blk.1.ffn_norm.weight", np.float32)):
        broken = bytearray(data)  # the first scale of a Q4_0 matrix; the first value of an F32 norm
        at = index[name].offset
        broken[at:at + np.dtype(nan).itemsize] = np.array([np.nan], dtype=nan).tobytes()
        bad.write_bytes(bytes(broken))
        with pytest.raises(ModelLoadError, match=r"not numbers .*" + name.replace(".", r"\.")) as err:
            _straight(bad, reference)
        assert err.value.reason == "corrupt"
    unknown = bytearray(data)  # output_norm's type id in the header: a type the gguf package does not know
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8  # n_dims u32, one dim u64, then the type u32
    unknown[at:at + 4] = (250).to_bytes(4, "little")
    bad.write_bytes(bytes(unknown))
    with pytest.raises(ModelLoadError, match="type this gguf package does not know") as err:
        _straight(bad, reference)
    assert err.value.reason == "unsupported"
    (tmp_path / "cut").mkdir()
    reference, path = _gguf_model(tmp_path / "cut", skip="output_norm.weight")
    with pytest.raises(ModelLoadError, match="no tensor for the model's model.norm.weight") as err:
        _straight(path, reference)
    assert err.value.reason == "corrupt"


def test_blocks_loaded_straight_must_all_be_held(tmp_path):
    """A model loaded straight from its GGUF has empty parameters where blocks were kept: an install that does not
    hold them (here: packing off) fails loudly instead of leaving them empty (engine.model then loads the float
    conversion)."""
    reference, path = _gguf_model(tmp_path)
    model, blocks = _straight(path, reference)
    with pytest.raises(ValueError, match="not all held"):
        adapter.install(model, pack=False, gguf=blocks)


def test_a_tensor_that_is_not_the_models_is_not_held(tmp_path):
    model, path = _gguf_model(tmp_path, unheld=None, tamper="blk.0.attn_k")
    adapter.install(model, pack_rounding=True, gguf=path)
    first = adapter.runtime(model).decoder.w.layers[0]
    assert isinstance(first.qkv, PackedMatrix)  # k differs from the file: the whole qkv stays as loaded (bf16)
    assert isinstance(first.o, GGUFWeight)
    assert adapter.packed_format(model).endswith(", others as bf16")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_decode_token_given_as_a_number_gets_the_logits_of_a_forward(tmp_path, kv_cache_dtype):
    """adapter.forward_token (the turn loop's decode step: the token as an int, its embedding row read where the
    GGUF blocks hold it, no id or position tensor) gives the logits adapter.forward gives for the same token, and
    leaves the same cache (entries, positions, scores). With an int8 cache every layer is attended by the cache's
    own Python (called back from C), which makes the positions tensor the fused path skipped."""
    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable_reason()}")
    reference, path = _gguf_model(tmp_path)
    model, blocks = _straight(path, reference)
    adapter.install(model, pack_rounding=True, gguf=blocks)
    decoder = adapter.runtime(model).decoder
    assert decoder.fused is not None and isinstance(decoder.w.embed, GGUFWeight)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    layers, kv_heads, head_dim = adapter.kv_geometry(model)
    caches = [DSV41Cache(layers, kv_heads, head_dim, torch.float32, "cpu",
                         CacheSettings(kv_cache_ratio=0.5, csa2_topk=0, kv_cache_dtype=kv_cache_dtype))
              for _ in range(2)]
    outs = []
    for cache, as_number in zip(caches, (False, True), strict=True):
        adapter.forward(model, ids[:, :8], cache, prefill=True)
        logits = []
        for i in range(8, 14):
            if as_number:
                logits.append(adapter.forward_token(model, int(ids[0, i]), cache))
            else:
                logits.append(adapter.forward(model, ids[:, i:i + 1], cache, prefill=False))
        outs.append(torch.cat(logits, dim=1))
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length
        assert torch.equal(a.positions[:, :a.length], b.positions[:, :b.length])
        assert torch.equal(a.scores[:, :a.length], b.scores[:, :b.length])
    assert caches[0].seen == caches[1].seen == 14 and caches[1].decode_steps == 6


def test_the_default_model_holds_its_gguf_exactly(default_model):
    """The shipped Q4_1 model: every decoder matrix and the tied embedding held as the file's blocks, their values
    the converted safetensors' (the reference transformers loads), the weights line the file's tensor bytes."""
    from safetensors.torch import load_file

    from engine.gguf_index import tensor_index

    hf = default_model.hf_model
    if adapter.packed_format(hf) != "GGUF Q4_1 + Q8_0":
        pytest.skip("the default model is loaded another way here (DSV41_GGUF_BLOCKS=0)")
    assert default_model.info.weight_storage == "GGUF Q4_1 + Q8_0"
    w = adapter.runtime(hf).decoder.w
    assert all(isinstance(m, GGUFWeight) for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                                          layer.down))
    assert w.embed is w.lm_head and w.lm_head.formats == ["Q8_0"]
    from engine.loader import resolve_source

    converted = load_file(str(resolve_source("default").path / "model.safetensors"))  # transformers' conversion
    for i in (0, 17, 29):
        qkv = torch.cat([converted[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(w.layers[i].qkv.dense(), qkv)
        assert torch.equal(w.layers[i].down.dense(), converted[f"model.layers.{i}.mlp.down_proj.weight"])
    embed = converted.get("model.embed_tokens.weight", converted.get("lm_head.weight"))  # tied: saved once
    assert torch.equal(w.embed.rows(torch.tensor([0, 5, 49151])), embed[[0, 5, 49151]])
    for token in (0, 5, 49151):  # one token (a decode step's lookup) reads its row where it is held
        assert torch.equal(w.embed.rows(torch.tensor([token])), embed[[token]])
        assert torch.equal(w.embed.rows(torch.tensor([token]), torch.bfloat16), embed[[token]].to(torch.bfloat16))
    with pytest.raises(IndexError):
        w.embed.rows(torch.tensor([49152]))
    row = torch.full((576,), float("nan"))
    for token in (0, 5, 49151):  # a decode step's row, written into one buffer (Decoder.forward_token)
        assert w.embed.row_into(token, row) is row and torch.equal(row, embed[token])
    with pytest.raises(IndexError):
        w.embed.row_into(-1, row)
    with pytest.raises(ValueError):
        w.embed.row_into(0, torch.empty(575))
    write = w.embed.row_writer(row)  # bound to the buffer once (Decoder.forward_token's)
    for token in (49151, 7, 0):
        assert write(token) is row and torch.equal(row, embed[token])
    with pytest.raises(IndexError):
        write(49152)
    with pytest.raises(ValueError):
        w.embed.row_writer(torch.empty(576, dtype=torch.bfloat16))
    file_bytes = sum(e.nbytes for e in tensor_index(default_gguf()).values())
    assert file_bytes <= default_model.weights_bytes < file_bytes + 4096


_LOAD_PEAK = """
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from engine import DSV41Config, DSV41Model
before = peak()
model = DSV41Model.from_pretrained(DSV41Config())
print(before, peak(), model.info.weight_storage)
"""


@pytest.mark.model
def test_the_default_model_loads_without_a_float_copy_of_its_weights(default_model):
    """Straight from the GGUF, the load adds less to the process's peak memory than one float32 copy of the weights
    would (538 MB; measured: +312 MB, the tokenizer, torch's and transformers' first allocations and the 97 MB of
    blocks, +350 MB with their move onto huge pages, which holds part of them twice for a moment; loading the float32
    conversion added 1.3 GB). The bound is that copy itself: a load that made one would add it to all the rest."""
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engine.gguf_index import tensor_index

    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc on this system")
    if adapter.packed_format(default_model.hf_model) != "GGUF Q4_1 + Q8_0":
        pytest.skip("the default model is loaded another way here (DSV41_GGUF_BLOCKS=0)")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    float32_bytes = 4 * sum(math.prod(e.shape) for e in tensor_index(default_gguf()).values())
    assert out[2:] == ["GGUF", "Q4_1", "+", "Q8_0"]
    assert after - before < float32_bytes, (after - before) / 2**20


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_gguf_loads_straight_onto_a_device_in_its_dtype(tmp_path, device):
    """Without holding (a GPU; INT8 on the CPU), every weight is dequantised, cast to the load's dtype and put on
    the device one tensor at a time: the values are the reference model's, cast alike, buffers included."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, path = _gguf_model(tmp_path, arch="qwen2")
    from engine.models.gguf_load import load_gguf_model

    # holding asked for on the GPU: blocks are held on the CPU only, so it dequantises all the same
    model, blocks = load_gguf_model(path, copy.deepcopy(reference.config), dtype=torch.bfloat16,
                                    hold=device != "cpu", device=device)
    assert not blocks.matrices
    values = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert values[name].device.type == device and values[name].dtype == torch.bfloat16, name
        assert torch.equal(values[name].cpu(), tensor.to(torch.bfloat16)), name
    assert all(b.device.type == device for b in model.buffers())
