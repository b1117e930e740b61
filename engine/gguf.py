"""GGUF files: check one before use, convert it once to a folder in the user cache dir, and answer questions
about a conversion (was its source quantized? may it be discarded?).

The loader turns a ``.gguf`` path (and the default model, which ships as one) into a folder through
``convert_gguf``: its config and tokenizer always (on the CPU that is all: the weights are read from the GGUF
itself, engine.models.gguf_load), float32 safetensors of its weights only where transformers must load them (a
GPU, bitsandbytes). The conversion is keyed by the file's path, size and time (``_gguf_key``), so later loads
find it at once. ``from gguf import ...`` below is the gguf package (an absolute import), not this module.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shutil
import struct
import threading
import time
from pathlib import Path

import psutil

from .errors import ModelLoadError
from .gguf_index import GGUF_MAGIC, read_header
from .hf_load import _quiet_transformers, check_finite
from .models.adapter import SUPPORTED_ARCHITECTURES, gguf_header_read_once
from .paths import user_cache_dir


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
    header = read_header(path)  # ModelLoadError when it does not parse
    if header.past_end:
        raise ModelLoadError(f"{path.name} is truncated: the data of {len(header.past_end)} tensor(s) "
                             f"({header.past_end[0]}, ...) lies past its end ({size} bytes). Re-download it.",
                             reason="corrupt", source=str(path))


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


def convert_gguf(path: Path, *, progress=None, weights: bool = True) -> Path:
    """Convert a GGUF once to a folder in the user cache dir; later calls return it at once. The folder holds the
    config, generation config and tokenizer (transformers reads them from the file's metadata), and with `weights`
    the weights dequantized to float32 safetensors as well (for a GPU, or bitsandbytes; on the CPU the weights are
    read from the GGUF itself: engine.models.gguf_load). `progress(message, fraction)` hears the steps, and every
    half second while a step runs."""
    target = user_cache_dir() / "models" / _gguf_key(path)
    if (target / ".complete").is_file() and (not weights or (target / "model.safetensors").is_file()):
        return target
    check_gguf_file(path)
    _check_gguf_architecture(path)
    step = "Converting model (first start only)" if weights else "Reading the model's settings (first start only)"
    if progress:
        progress(f"{step}…", 0.0)
    started = time.perf_counter()
    tmp = _partial_folder(target)
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        expected = max(2.0, path.stat().st_size / CONVERT_BYTES_PER_S)
        model = None
        with _quiet_transformers(), gguf_header_read_once():
            if progress:
                progress(f"{step}: reading the tokenizer…", 0.02)
            with _ticking(progress, f"{step}: reading the tokenizer", 0.02, 0.05 if weights else 0.9, 10.0):
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if weights:
                with _ticking(progress, f"{step}: dequantizing the weights", 0.05, 0.8, expected):
                    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32)
                config, generation = model.config, model.generation_config
            else:
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
                generation = GenerationConfig.from_model_config(config)
        if progress:
            progress(f"{step}: saving…", 0.85 if weights else 0.95)
        tmp.mkdir(parents=True)
        if model is not None:
            from safetensors.torch import save_model

            # The weights are dequantized floats now; save them as a plain safetensors model -- unless some are
            # not finite numbers (damaged bytes decode to NaN/inf scales), which nothing can answer with.
            check_finite(model, path.name, what="Re-download the .gguf file.")
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))
        if generation is not None:
            generation.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "dsv41_source.json").write_text(json.dumps({"gguf": str(path), "seconds": time.perf_counter() - started,
                                                           "quantized": gguf_is_quantized(path),
                                                           "weights": weights}))
        (tmp / ".complete").write_text("ok")
        _publish(tmp, target, weights)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(f"Could not write the converted model to {target.parent} ({exc}). Free some disk space "
                             "or set DSV41_CACHE_DIR to a folder with room.", reason="disk", source=str(path)) from exc
    except Exception as exc:  # noqa: BLE001
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if isinstance(exc, ValueError) and unknown:  # a type the gguf package does not know: not a damaged file
            raise ModelLoadError(
                f"{path.name} stores weights in a quantization type this version cannot read (GGML type "
                f"{unknown.group(1)}; a newer llama.cpp may have written it). Pick a file of a common type (Q4_K_M, "
                "Q5_K_M, Q6_K, Q8_0, Q4_0 or F16) of the same model.", reason="unsupported_type",
                source=str(path)) from exc
        raise ModelLoadError(f"Could not convert {path.name}: {type(exc).__name__}: {exc}", reason="corrupt",
                             source=str(path)) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        progress("Model converted" if weights else "Model settings read", 1.0)
    return target


def _partial_folder(target: Path) -> Path:
    """A folder of this conversion's own beside `target` (named by process and thread: another process converting
    the same file at once, a second app or `python -m engine serve` on a first start, writes its own), after
    removing those whose process has gone (a conversion killed part-way) and an earlier one of this thread's."""
    own = target.with_name(f"{target.name}.partial-{os.getpid()}-{threading.get_ident()}")
    for stale in target.parent.glob(glob.escape(target.name) + ".partial*"):
        pid = re.fullmatch(re.escape(target.name) + r"\.partial-(\d+)-\d+", stale.name)  # None: another layout
        if stale == own or pid is None or (int(pid[1]) != os.getpid() and not psutil.pid_exists(int(pid[1]))):
            shutil.rmtree(stale, ignore_errors=True)
    return own


def _publish(tmp: Path, target: Path, weights: bool) -> None:
    """Move the finished conversion `tmp` to `target`, unless a conversion of the same file running beside this one
    published what this call needs first (then that one stays: a process may be loading from it, and ours is removed
    by the caller); a settings-only folder where weights are wanted is replaced."""
    for _ in range(3):
        if (target / ".complete").is_file() and (not weights or (target / "model.safetensors").is_file()):
            return
        shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
            return
        except OSError:
            if not target.exists():
                raise
            # another conversion renamed its folder in between: look at what it holds
    raise OSError(f"{target} kept changing while this conversion tried to save it")


FLOAT_GGUF_TYPES = {"F32", "F16", "BF16", "F64"}


def gguf_is_quantized(path: Path) -> bool:
    """True when some weight of the GGUF file is stored in a quantized type (Q4_1, Q8_0, ...)."""
    from gguf import GGMLQuantizationType

    return any(GGMLQuantizationType(t.type_id).name not in FLOAT_GGUF_TYPES
               for t in read_header(path).tensors.values())


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
    arch = read_header(path).architecture
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
