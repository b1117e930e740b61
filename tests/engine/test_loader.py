"""Model sources and their errors; INT8 / INT4 weights on the CPU."""

import functools
import json
import os
import shutil
from pathlib import Path

import pytest

from engine import DSV41Config, DSV41Model, ModelLoadError
from engine.loader import default_gguf_path, resolve_source


def load(path, **kw):
    return DSV41Model.from_pretrained(DSV41Config(model_path=str(path), **kw))


def test_default_model_is_converted_once_and_reloads_fast(default_model):
    """The session's model converted the GGUF (or found it converted); resolving it again converts nothing.
    (The fixture's own load may have been the first conversion on a fresh machine, so it is not timed.)"""
    import time

    first = resolve_source("default", weights=False)
    assert Path(default_model.info.folder) == first.path
    assert (first.path / "config.json").is_file() and (first.path / ".complete").is_file()
    started = time.perf_counter()
    assert resolve_source("default", weights=False).path == first.path
    assert time.perf_counter() - started < 1.0  # already converted: no second conversion
    assert default_model.info.source_kind == "default"


def test_on_the_cpu_a_gguf_is_converted_without_its_weights(tmp_path, monkeypatch):
    """A first start on the CPU writes the default model's config and tokenizer only (its weights are read from the
    GGUF: engine.models.gguf_load); a float32 copy of the weights is written when a load needs one (bitsandbytes,
    a GPU), into the same folder."""
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reads = []
    real = gguf_utils.load_gguf_checkpoint

    @functools.wraps(real)
    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    folder = resolve_source("default", weights=False).path
    # transformers reads the whole header for the config in AutoTokenizer and again in AutoConfig (llama is not
    # among the architectures its fast metadata reader covers): once is enough (engine.models.adapter)
    assert len(reads) == 1, reads
    assert gguf_utils.load_gguf_checkpoint is counted  # put back as it was
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", "generation_config.json", ".complete"} <= names
    assert not any(name.endswith(".safetensors") for name in names)
    assert json.loads((folder / "dsv41_source.json").read_text())["weights"] is False
    from engine.loader import load_gguf

    model, tokenizer, blocks = load_gguf(folder, default_gguf_path(), dtype=__import__("torch").float32, hold=True)
    assert tokenizer.chat_template and model.config.num_hidden_layers == 30
    assert len(blocks.matrices) == 30 * 7 + 1  # every decoder matrix and the tied embedding kept as blocks


def test_a_conversion_beside_another_of_the_same_file_keeps_the_one_published_first(tmp_path, monkeypatch):
    """Two processes converting the same GGUF at once (a second app or `python -m engine serve` on a first start,
    test workers on a fresh cache): each writes a folder of its own, and the one finishing second keeps the folder
    the first published (a process may be loading from it). Leftovers of a conversion whose process has gone are
    removed; a live one's are not."""
    import psutil
    import transformers

    from engine.gguf import _gguf_key, convert_gguf

    real = resolve_source("default", weights=False).path  # the session's conversion: its tokenizer and config
    gguf = default_gguf_path()
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / _gguf_key(gguf)
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not psutil.pid_exists(pid))
    left = target.with_name(f"{target.name}.partial-{dead}-7")
    writing = target.with_name(f"{target.name}.partial-{os.getppid()}-7")  # a live process's, mid-write
    left.mkdir(parents=True)
    tokenizer, config = transformers.AutoTokenizer.from_pretrained, transformers.AutoConfig.from_pretrained

    def tokenizer_while_the_other_publishes(*args, **kwargs):
        assert not left.exists() and writing.is_dir()
        shutil.copytree(real, target)  # the other conversion finishes first
        (target / "theirs").write_text("")
        return tokenizer(str(real))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_while_the_other_publishes)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: config(str(real)))
    writing.mkdir()
    assert convert_gguf(gguf, weights=False) == target
    assert (target / "theirs").is_file() and (target / ".complete").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, writing.name])


def test_the_default_conversion_knows_its_gguf_was_quantized(default_model, tmp_path):
    from engine.loader import source_is_quantized

    folder = resolve_source("default").path
    assert source_is_quantized(folder)  # Q4_1 / Q8_0: float32 values coarser than bf16 keeps
    record = json.loads((folder / "dsv41_source.json").read_text())
    assert record["quantized"] is True
    # a conversion from before the flag learns it from its GGUF, once, and records it
    old = tmp_path / "old"
    old.mkdir()
    (old / "dsv41_source.json").write_text(json.dumps({"gguf": record["gguf"]}))
    assert source_is_quantized(old)
    assert json.loads((old / "dsv41_source.json").read_text())["quantized"] is True
    assert not source_is_quantized(tmp_path)  # a plain folder: nothing recorded, weights kept as they are


def test_local_folder_loads_and_generates(tiny_folder):
    model = load(tiny_folder, max_seq_len=256)
    assert model.info.source_kind == "folder"
    text = model.generate("hi", max_new_tokens=5, greedy=True)
    assert isinstance(text, str)


def test_missing_path():
    with pytest.raises(ModelLoadError) as err:
        load("/nonexistent/models/llama")
    assert err.value.reason == "missing" and "not found" in str(err.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load(tmp_path)
    assert err.value.reason == "missing"


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated") as err:
        load(folder)
    assert err.value.reason == "corrupt" and "Re-download" in str(err.value)


def test_garbage_safetensors(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(ModelLoadError) as err:
        load(folder)
    assert err.value.reason == "corrupt"


def test_unsupported_architecture(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not supported") as err:
        load(folder)
    assert err.value.reason == "unsupported_architecture" and "Qwen2" in str(err.value)


def test_remote_code_needs_opt_in(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="fancy_custom", auto_map={"AutoModelForCausalLM": "modeling_fancy.FancyLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="trust_remote_code") as err:
        load(folder)
    assert err.value.reason == "remote_code"


def test_pickled_weights_refused_without_opt_in(tiny_folder, tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = copy_folder(tiny_folder, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow_pickled_weights") as err:
        load(folder)
    assert err.value.reason == "pickled"


def test_hub_id_offline_gives_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="offline") as err:
        load("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert err.value.reason == "offline"


def test_truncated_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    src = default_gguf_path()
    bad = tmp_path / "broken.gguf"
    with open(src, "rb") as fh:
        bad.write_bytes(fh.read(20_000_000))
    with pytest.raises(ModelLoadError, match="truncated|damaged") as err:
        load(bad)
    assert err.value.reason == "corrupt"
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_gguf_of_a_quantization_type_unknown_here_says_so_not_download_again(tmp_path, monkeypatch):
    """A file a newer llama.cpp wrote (a type the gguf package has no number for) is no damaged file: downloading
    it again would not help."""
    import struct

    from gguf import GGUFReader

    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    src = default_gguf_path()
    reader = GGUFReader(src)
    field = reader.tensors[0].field  # its parts: name length, name, dimensions, their sizes, type, offset
    offset = field.parts[-2].ctypes.data - reader.data.ctypes.data
    assert int(field.parts[-2][0]) == int(reader.tensors[0].tensor_type)
    data = bytearray(src.read_bytes())
    data[offset:offset + 4] = struct.pack("<I", 99)
    bad = tmp_path / "newer.gguf"
    bad.write_bytes(bytes(data))
    del reader
    with pytest.raises(ModelLoadError, match="GGML type 99") as err:
        load(bad)
    assert err.value.reason == "unsupported_type" and "Q4_K_M" in str(err.value)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF") as err:
        load(bad)
    assert err.value.reason == "corrupt"


def test_a_gguf_saved_under_another_name_is_read_as_one(tmp_path, monkeypatch):
    """What the file holds decides: a GGUF downloaded as `model.bin` loads as the GGUF it is; another `.bin` is
    still refused as no model."""
    from engine import loader

    converted = []  # what would be converted (the conversion itself: the tests above)
    monkeypatch.setattr(loader, "convert_gguf", lambda path, **_: converted.append(path) or tmp_path / "folder")
    renamed = tmp_path / "model.bin"
    renamed.symlink_to(default_gguf_path())
    source = resolve_source(str(renamed), weights=False)
    assert source.kind == "gguf" and source.gguf == renamed and converted == [renamed]
    other = tmp_path / "pytorch_model.bin"
    other.write_bytes(b"PK\x03\x04 a pickled checkpoint")
    with pytest.raises(ModelLoadError, match="is a file, not a model") as err:
        resolve_source(str(other))
    assert err.value.reason == "unsupported"


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found") as err:
        load(tmp_path / "nothing.gguf")
    assert err.value.reason == "missing"


def test_cuda_device_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ModelLoadError, match="no CUDA GPU") as err:
        load("default", device_map="cuda")
    assert err.value.reason == "no_gpu"


@pytest.mark.model
@pytest.mark.parametrize("quant,max_fraction", [("int8", 0.55), ("int4", 0.45)])
def test_quantized_default_model_is_smaller_and_answers(default_model, quant, max_fraction):
    model = DSV41Model.from_pretrained(DSV41Config(weight_quant=quant, max_seq_len=2048))
    assert model.info.weight_quant == quant
    import math

    from engine.gguf_index import tensor_index

    float32_bytes = 4 * sum(math.prod(e.shape) for e in tensor_index(default_gguf_path()).values())
    assert model.weights_bytes < max_fraction * float32_bytes
    reply = model.generate("What is the capital of France?", greedy=True, max_new_tokens=24)
    assert "Paris" in reply, reply


def test_the_conversion_progress_moves_while_the_weights_are_converted():
    """A first start converts the default GGUF (tens of seconds on 2 cores): while the weights are dequantized the
    bar moves every half second toward its step's end, with the seconds spent, and stops when the step ends."""
    import time

    from engine.gguf import _ticking

    seen = []
    with _ticking(lambda message, fraction: seen.append((message, fraction)), "Converting", 0.05, 0.8, 1.0):
        time.sleep(1.8)
    count = len(seen)
    time.sleep(0.7)
    assert len(seen) == count >= 3  # ticked while it ran, not after
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and 0.05 < fractions[0] and fractions[-1] < 0.8
    assert seen[-1][0].startswith("Converting (") and seen[-1][0].endswith(" s)")


@pytest.mark.model
def test_first_load_progress_runs_forward_from_the_conversion_into_the_load(monkeypatch):
    from engine import DSV41Config, DSV41Model, loader

    real = loader.resolve_source

    def converting(model_path, *, progress=None, weights=True):  # as a first start's conversion reports
        for fraction in (0.0, 0.3, 0.85, 1.0):
            progress("Converting model (first start only)…", fraction)
        return real(model_path, weights=weights)

    monkeypatch.setattr(loader, "resolve_source", converting)
    seen = []
    DSV41Model.from_pretrained(DSV41Config(), progress=lambda message, fraction: seen.append((message, fraction)))
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0  # never back to a lower figure
    assert max(f for m, f in seen if "Converting" in m) == 0.6 and any("Loading" in m for m, _ in seen)
