"""Where each tensor of a GGUF file lies, from its header alone (engine.models.gguf_load reads the tensors there),
its architecture, and whether the file is cut short.

gguf.GGUFReader parses every metadata value into numpy views (the default model's 49,152 tokenizer strings: ~11 s
on 2 cores); holding the weights needs only where each tensor's bytes are. The header, as the GGUF specification
(ggml's docs/gguf.md) gives it, little-endian: magic, version u32, tensor count u64, metadata count u64; each
metadata pair a string key (u64 length + bytes), a u32 value type and the value (arrays: element type u32, count
u64, elements); then per tensor a name, n_dims u32, dims u64 (innermost first), type u32, offset u64 from the
data section, which starts at the next multiple of general.alignment (default 32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by GGUF value type
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_id: int  # ggml's type
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    offset: int  # of its bytes in the file
    nbytes: int


def _type_size(type_id: int) -> tuple[int, int] | None:
    """(weights, bytes) of one block of ggml type `type_id`, from the gguf package's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def tensor_index(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a GGUF file with where its bytes lie, reading the header only (check_gguf_file checks the
    rest). Raises ModelLoadError for a header that does not parse or a tensor past the end of the file."""
    return read_header(path).tensors


@dataclass(frozen=True)
class GGUFHeader:
    tensors: dict[str, TensorEntry]  # those whose bytes lie in the file, of a type the gguf package knows
    architecture: str | None  # general.architecture ("llama", "qwen2", ...)
    past_end: tuple[str, ...]  # tensors whose bytes run past the end of the file (it is truncated)
    unknown: tuple[str, ...]  # tensors of a type the gguf package does not know


def read_header(path: Path) -> GGUFHeader:
    """A GGUF file's tensors (tensor_index), architecture and damage, from one read of its header (milliseconds;
    gguf.GGUFReader takes ~10 s on the default model)."""
    size = Path(path).stat().st_size
    try:
        with open(path, "rb") as fh:
            data = fh.read(min(size, 64 << 20))  # the header: metadata and tensor infos (a few MB at most)
            pos = 0

            def takes(fmt: str) -> tuple:
                nonlocal pos
                values = struct.unpack_from("<" + fmt, data, pos)
                pos += struct.calcsize("<" + fmt)
                return values

            def take(fmt: str):
                values = takes(fmt)
                return values if len(values) > 1 else values[0]

            def string() -> str:
                nonlocal pos
                n = take("Q")
                text = data[pos:pos + n].decode("utf-8", errors="replace")
                pos += n
                return text

            def skip(kind: int):
                nonlocal pos
                if kind == _STRING:
                    n = take("Q")
                    pos += n
                elif kind == _ARRAY:
                    element, count = take("IQ")
                    if element in _SCALAR_SIZES:
                        pos += count * _SCALAR_SIZES[element]
                    else:
                        for _ in range(count):
                            skip(element)
                elif kind in _SCALAR_SIZES:
                    pos += _SCALAR_SIZES[kind]
                else:
                    raise ValueError(f"metadata value type {kind}")

            magic, version, n_tensors, n_kv = take("4sIQQ")
            if magic != GGUF_MAGIC or version not in (2, 3):
                raise ValueError("not a GGUF v2/v3 header")
            alignment, architecture = 32, None
            for _ in range(n_kv):
                key, kind = string(), take("I")
                if key == "general.alignment" and kind == 4:
                    alignment = take("I")
                elif key == "general.architecture" and kind == _STRING:
                    architecture = string()
                else:
                    skip(kind)
            infos = []
            for _ in range(n_tensors):
                name, n_dims = string(), take("I")
                shape = takes(f"{n_dims}Q")
                type_id, offset = take("IQ")
                infos.append((name, shape, type_id, offset))
            start = (pos + alignment - 1) // alignment * alignment
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise ModelLoadError(f"{Path(path).name}: its GGUF header does not parse ({exc}). Re-download it.",
                             reason="corrupt", source=str(path)) from exc
    index, past_end, unknown = {}, [], []
    for name, shape, type_id, offset in infos:
        block = _type_size(type_id)
        if block is None:
            unknown.append(name)
            continue
        nbytes = math.prod(shape) // block[0] * block[1]
        if start + offset + nbytes > size:
            past_end.append(name)
            continue
        index[name] = TensorEntry(name, type_id, shape, start + offset, nbytes)
    return GGUFHeader(index, architecture, tuple(past_end), tuple(unknown))
