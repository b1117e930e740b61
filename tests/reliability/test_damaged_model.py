"""A model whose weight bytes are damaged (size unchanged) is refused as damaged, and never cached."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import DSV41Config, DSV41Model, ModelLoadError, loader
from engine.gguf import _gguf_key


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("DSV41_CACHE_DIR", str(folder))
    return folder


@pytest.mark.model
@pytest.mark.slow
def test_a_gguf_with_random_bytes_mid_file_is_refused_and_not_cached(tmp_path, cache_dir):
    source = loader.default_gguf_path()
    data = bytearray(source.read_bytes())
    rng = random.Random(13)
    middle = len(data) // 2
    data[middle:middle + 4 * 1024 * 1024] = rng.randbytes(4 * 1024 * 1024)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="damaged") as err:
        DSV41Model.from_pretrained(DSV41Config(model_path=str(damaged)))
    assert err.value.reason == "corrupt"
    assert "NaN" in str(err.value) and "Re-download" in str(err.value)
    models = cache_dir / "models"
    assert not models.exists() or not any(models.iterdir())  # nothing cached, not even a partial folder


def nan_folder(tiny_folder, target):
    """A copy of the tiny model with one weight matrix full of NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_folder, target)
    weights = load_file(str(target / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_folder_with_nan_weights_is_refused(tiny_folder, tmp_path):
    folder = nan_folder(tiny_folder, tmp_path / "nan-model")
    with pytest.raises(ModelLoadError, match="damaged.*down_proj") as err:
        DSV41Model.from_pretrained(DSV41Config(model_path=str(folder)))
    assert err.value.reason == "corrupt"


def test_a_damaged_conversion_cached_earlier_is_removed(tmp_path, cache_dir):
    """A conversion in the cache that is damaged (its config, which a load straight from the GGUF reads beside the
    file's weights) is refused at load and removed, so the next start converts the file again."""
    import shutil

    gguf = tmp_path / "model.gguf"
    shutil.copy(loader.default_gguf_path(), gguf)
    target = cache_dir / "models" / _gguf_key(gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{ this is not json")
    (target / "dsv41_source.json").write_text(json.dumps({"gguf": str(gguf), "quantized": True, "weights": False}))
    (target / ".complete").write_text("ok")
    with pytest.raises(ModelLoadError, match="damaged.*load the model again") as err:
        DSV41Model.from_pretrained(DSV41Config(model_path=str(gguf)))
    assert err.value.reason == "corrupt"
    assert not target.exists()
