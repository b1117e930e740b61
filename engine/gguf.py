"""GGUF files: check one before use, convert it once to a safetensors folder in the user cache dir, and
answer questions about a conversion (was its source quantized? may it be discarded?).

The loader turns a ``.gguf`` path (and the default model, which ships as one) into a folder through
``convert_gguf``; the conversion is keyed by the file's path, size and time (``_gguf_key``), so later
loads find it at once. ``from gguf import GGUFReader`` below is the gguf package (an absolute import),
not this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .hf_load import _quiet_transformers, check_finite
from .models.adapter import SUPPORTED_ARCHITECTURES
from .paths import user_cache_dir

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Fail fast on a file that is not a GGUF or is truncated (header and tensor data end checked)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path.name} is not a GGUF file (bad header). Re-download it.", reason="corrupt",
                             source=str(path))
    version = struct.unpack("<I", head[4:8])[0]
    if version not in (2, 3):
        raise ModelLoadError(f"{path.name}: GGUF version {version} is not supported (2 or 3).", reason="corrupt",
                             source=str(path))
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError/IndexError/struct.error on damage
        raise ModelLoadError(f"{path.name} is damaged or truncated ({type(exc).__name__}: {exc}). Re-download it.",
                             reason="corrupt", source=str(path)) from exc
    if end > size:
        raise ModelLoadError(f"{path.name} is truncated: tensor data needs {end} bytes, the file has {size}. "
                             "Re-download it.", reason="corrupt", source=str(path))


def _gguf_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


CONVERT_BYTES_PER_S = 20e6  # a guess of the conversion's pace (dequantize + save), for the progress while it runs


@contextlib.contextmanager
def _ticking(progress, message: str, start: float, end: float, expected_s: float):
    """While a step of unknown length runs, report progress every half second from `start` toward `end` (never
    reaching it: 1 - exp(-elapsed / expected_s) of the way) with the seconds spent, so the bar moves."""
    if progress is None:
        yield
        return
    stop = threading.Event()
    began = time.perf_counter()

    def tick():
        while not stop.wait(0.5):
            elapsed = time.perf_counter() - began
            progress(f"{message} ({elapsed:.0f} s)", start + (end - start) * (1 - math.exp(-elapsed / expected_s)))

    thread = threading.Thread(target=tick, name="convert-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def convert_gguf(path: Path, *, progress=None) -> Path:
    """Convert a GGUF once to a safetensors folder in the user cache dir; later calls return it at once.
    `progress(message, fraction)` hears the steps, and every half second while the weights are converted."""
    target = user_cache_dir() / "models" / _gguf_key(path)
    if (target / ".complete").is_file():
        return target
    check_gguf_file(path)
    _check_gguf_architecture(path)
    if progress:
        progress("Converting model (first start only)…", 0.0)
    started = time.perf_counter()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        expected = max(2.0, path.stat().st_size / CONVERT_BYTES_PER_S)
        with _quiet_transformers():
            if progress:
                progress("Converting model (first start only): reading the tokenizer…", 0.02)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            with _ticking(progress, "Converting model (first start only): dequantizing the weights", 0.05, 0.8,
                          expected):
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32)
        if progress:
            progress("Converting model (first start only): saving…", 0.85)
        from safetensors.torch import save_model

        # The weights are dequantized floats now; save them as a plain safetensors model -- unless some are
        # not finite numbers (damaged bytes in the file decode to NaN/inf scales), which nothing can answer with.
        check_finite(model, path.name, what="Re-download the .gguf file.")
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(tmp))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "dsv41_source.json").write_text(json.dumps({"gguf": str(path), "seconds": time.perf_counter() - started,
                                                           "quantized": gguf_is_quantized(path)}))
        (tmp / ".complete").write_text("ok")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(f"Could not write the converted model to {target.parent} ({exc}). Free some disk space "
                             "or set DSV41_CACHE_DIR to a folder with room.", reason="disk", source=str(path)) from exc
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"Could not convert {path.name}: {type(exc).__name__}: {exc}", reason="corrupt",
                             source=str(path)) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        progress("Model converted", 1.0)
    return target


FLOAT_GGUF_TYPES = {"F32", "F16", "BF16", "F64"}


def gguf_is_quantized(path: Path) -> bool:
    """True when some weight of the GGUF file is stored in a quantized type (Q4_1, Q8_0, ...)."""
    from gguf import GGUFReader

    return any(t.tensor_type.name not in FLOAT_GGUF_TYPES for t in GGUFReader(str(path)).tensors)


def source_is_quantized(folder: Path) -> bool:
    """True when `folder` is our conversion of a quantized GGUF: its float32 weights came from codes coarser than
    bf16's precision (the default model: Q4_1 and Q8_0), so holding them as bf16 loses nothing that matters (perplexity
    -0.10 to +0.00 % on four speeches: benchmarks/cpu_kernels.py). Older conversions learn it from their GGUF once."""
    record = Path(folder) / "dsv41_source.json"
    try:
        info = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    if "quantized" not in info:
        source = Path(info.get("gguf", ""))
        if not source.is_file():
            return False
        try:
            info["quantized"] = gguf_is_quantized(source)
        except Exception:  # noqa: BLE001 - an unreadable header: keep float32
            return False
        try:
            record.write_text(json.dumps(info))
        except OSError:
            pass
    return bool(info["quantized"])


def _check_gguf_architecture(path: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field else None
    # GGUF names llama-family models "llama" (Mistral included) and Qwen "qwen2"/"qwen3".
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path.name}: architecture {arch!r} is not supported. Supported: "
                             + ", ".join(SUPPORTED_ARCHITECTURES.values()) + ".", reason="unsupported_architecture",
                             source=str(path))


def discard_conversion(folder: Path) -> bool:
    """Remove a converted GGUF from the user cache dir (a damaged one must not be loaded again)."""
    folder = Path(folder)
    try:
        inside = folder.resolve().is_relative_to((user_cache_dir() / "models").resolve())
    except OSError:
        return False
    if inside and (folder / "dsv41_source.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        return True
    return False


# ------------------------------------------------------------------------------- the tensors of a file, fast
# gguf.GGUFReader parses every metadata value into numpy views (the default model's 49,152 tokenizer strings: ~11 s
# on 2 cores); holding the weights needs only where each tensor's bytes are. The header, as the GGUF specification
# (ggml's docs/gguf.md) gives it, little-endian: magic, version u32, tensor count u64, metadata count u64; each
# metadata pair a string key (u64 length + bytes), a u32 value type and the value (arrays: element type u32, count
# u64, elements); then per tensor a name, n_dims u32, dims u64 (innermost first), type u32, offset u64 from the
# data section, which starts at the next multiple of general.alignment (default 32).

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
            alignment = 32
            for _ in range(n_kv):
                key, kind = string(), take("I")
                if key == "general.alignment" and kind == 4:
                    alignment = take("I")
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
    index = {}
    for name, shape, type_id, offset in infos:
        block = _type_size(type_id)
        count = math.prod(shape)
        nbytes = count // block[0] * block[1] if block else 0
        if block is None or start + offset + nbytes > size:
            continue  # a type this gguf package does not know, or bytes past the end: not indexed
        index[name] = TensorEntry(name, type_id, shape, start + offset, nbytes)
    return index
