"""A GGUF file loaded straight into a transformers model (on the CPU, or one GPU), with no float32 copy of its weights.

The model is built from its config with empty (meta) parameters (accelerate's init_empty_weights; buffers such as
the rotary frequencies are computed as usual), then every parameter is read from the file under its GGUF name (the
gguf package's name map for the file's architecture, the map transformers' own GGUF loader uses):

- a matrix in a block format our kernels multiply (engine.kernels.gguf_blocks), whose group (a layer's q, k and v;
  gate and up) is all in such formats, is kept as its blocks (GGUFBlocks) and its parameter left empty:
  adapter.hold_gguf points the module at the blocks;
- everything else (norms, biases, formats not held; every tensor when `hold` is off) is dequantised exactly (our
  kernels for the block formats, the gguf package's dequantiser for the rest) into the model's dtype.

llama.cpp's converter stores a Llama q / k projection ("llama" architecture: Mistral's files too) with each head's
two rotary halves interleaved; transformers' loader puts them back per head and so does this
(tests/engine/test_gguf_native.py compares the result with transformers' own load of the same file). Nothing the
size of a float32 model is allocated: the default model loads with its 97 MB of blocks and the small tensors, where
loading its float32 conversion peaked at 1.5 GB.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..gguf_index import TensorEntry, read_header
from ..kernels import load as load_kernels
from ..kernels.gguf_blocks import BY_TYPE, GGUFMatrix
from .gguf_hold import GGUFBlocks, deinterleaved, type_name

_GROUPED = re.compile(r"^(blk\.\d+\.)(attn_q|attn_k|attn_v|ffn_gate|ffn_up)\.weight$")
_INTERLEAVED = re.compile(r"^blk\.\d+\.attn_([qk])\.(weight|bias)$")


def _group(name: str) -> str:
    """The matrix a GGUF tensor is part of in our decoder (a layer's q, k, v make one; gate and up another)."""
    found = _GROUPED.match(name)
    if found is None:
        return name
    return found.group(1) + ("qkv" if found.group(2).startswith("attn") else "gate_up")


def load_gguf_model(path: Path, config, *, dtype: torch.dtype = torch.float32, hold: bool = True,
                    device: str = "cpu"):
    """The causal LM of `config` with the GGUF file's weights; returns (model, GGUFBlocks). With `hold` (on the
    CPU, the kernels built) the matrices in block formats stay blocks for adapter.install(gguf=...), whose
    hold_gguf must then take every one of them; without, every weight is dequantised into `dtype` and put on
    `device` one tensor at a time (a GPU load needs host memory for the largest tensor only, not for a float copy
    of the model). Raises ModelLoadError for a file whose tensors do not make the model (missing, wrong shape,
    not finite numbers)."""
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path = Path(path)
    header = read_header(path)
    tensors, architecture = header.tensors, header.architecture
    arch = next((key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ModelLoadError(f"{path.name}: GGUF architecture {architecture!r} is not known to the gguf package.",
                             reason="unsupported_architecture", source=str(path))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "output.weight" not in tensors and not getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = True  # a file without an output matrix answers with its embedding
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # empty parameters are not tied as the model is built
    model.eval()
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    aliases: dict[int, list[str]] = {}  # tied parameters: one object, several names
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    targets = {}  # model parameter -> GGUF tensor
    for name, _ in model.named_parameters():
        stem, _, suffix = name.rpartition(".")
        found = names.get_name(stem)
        if found is not None and f"{found}.{suffix}" in header.unknown:
            raise ModelLoadError(f"{path.name}: {found}.{suffix} is stored in a type this gguf package does not "
                                 "know. Update it (pip install -U gguf) or pick a file in another quantization.",
                                 reason="unsupported", source=str(path))
        if found is None or f"{found}.{suffix}" not in tensors:
            raise ModelLoadError(f"{path.name} has no tensor for the model's {name}: the file is incomplete or "
                                 "not this architecture's. Re-download it.", reason="corrupt", source=str(path))
        targets[name] = f"{found}.{suffix}"
    groups: dict[str, list[str]] = {}
    for tensor in targets.values():
        groups.setdefault(_group(tensor), []).append(tensor)
    lib = load_kernels()
    hold = hold and torch.device(device).type == "cpu"

    def kept(tensor: str) -> bool:
        return hold and lib is not None and all(
            tensors[t].type_id in BY_TYPE and len(tensors[t].shape) == 2 for t in groups[_group(tensor)])

    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    params = dict(model.named_parameters())
    blocks, converted, bad = {}, set(), []
    with open(path, "rb") as fh:
        for name, tensor in targets.items():
            entry = tensors[tensor]
            shape = tuple(reversed(entry.shape))  # GGUF lists the innermost dimension first
            if shape != tuple(params[name].shape):
                raise ModelLoadError(f"{path.name}: {tensor} is {list(shape)}, the model's {name} is "
                                     f"{list(params[name].shape)}. The file does not match its own metadata.",
                                     reason="corrupt", source=str(path))
            raw = _read(fh, entry, path)
            interleaved = _INTERLEAVED.match(tensor) if architecture == "llama" else None
            order = deinterleaved(shape[0], heads if interleaved.group(1) == "q" else kv_heads) \
                if interleaved else None
            if kept(tensor):
                matrix = GGUFMatrix(entry.type_id, raw.view(shape[0], -1), shape[1])
                matrix = matrix.select_rows(order) if order is not None else matrix
                if not matrix.finite():
                    bad.append(tensor)
                blocks[tensor] = matrix  # its parameter stays empty: hold_gguf points the module at the blocks
                continue
            if hold and len(shape) == 2 and entry.type_id not in BY_TYPE:
                converted.add(type_name(entry.type_id))  # said on the weights line
            value = _dequantize(entry, raw, shape, lib, path)
            value = value[order] if order is not None else value
            low, high = torch.aminmax(value.reshape(-1))
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                bad.append(tensor)
            parameter = torch.nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)
            del value
            for alias in aliases[id(params[name])]:
                owner, _, leaf = alias.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = parameter
    if torch.device(device).type != "cpu":
        model.to(device)  # the buffers (rotary frequencies) the model computed on the CPU
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ModelLoadError(f"{path.name} is damaged: {len(bad)} tensor(s) hold values that are not numbers (NaN "
                             f"or infinity): {shown}. Re-download the .gguf file.", reason="corrupt",
                             source=str(path))
    return model, GGUFBlocks(blocks, set(tensors), converted)


def _read(fh, entry: TensorEntry, path: Path) -> torch.Tensor:
    """The tensor's bytes, read into memory of their own (no mapping of the file stays resident)."""
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    fh.seek(entry.offset)
    if fh.readinto(memoryview(raw.numpy())) != entry.nbytes:
        raise ModelLoadError(f"{path.name} is truncated at {entry.name}. Re-download it.", reason="corrupt",
                             source=str(path))
    return raw


def _dequantize(entry: TensorEntry, raw: torch.Tensor, shape: tuple[int, ...], lib, path: Path) -> torch.Tensor:
    """float32 values of a tensor, in the model's shape, exactly as the GGUF definition gives them."""
    if entry.type_id in BY_TYPE and lib is not None and len(shape) == 2:
        return GGUFMatrix(entry.type_id, raw.view(shape[0], -1), shape[1]).dequantize()
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(raw.numpy().reshape(shape[0] if len(shape) == 2 else 1, -1),
                            GGMLQuantizationType(entry.type_id))
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"{path.name}: {entry.name} is stored as {type_name(entry.type_id)}, which the gguf "
                             f"package cannot read ({exc}). Update it (pip install -U gguf) or pick another file.",
                             reason="unsupported", source=str(path)) from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
