"""Layers spread over devices (device_map="auto" on several GPUs): each layer's KV cache lives on its layer's
device and the activations follow the layers. Two GPUs are not available to the tests, so the second device is
`meta` (shapes and devices without data): a forward whose later layers sit on `meta` must run there, and one
that forgot to move an activation fails with a device mismatch."""

from __future__ import annotations

import torch

from engine.cache import CacheSettings, DSV41Cache
from engine.config import DSV41Config
from engine.models import adapter
from engine.models.decoder import Decoder, DecoderWeights, LayerWeights

SPLIT = ("cpu", "cpu", "meta", "meta")


def _settings(**knobs) -> CacheSettings:
    return CacheSettings.from_config(DSV41Config(**knobs))


def test_each_layer_kv_lives_on_its_layer_device():
    cache = DSV41Cache(4, 2, 16, torch.float32, "cpu", _settings(kv_cache_ratio=1.0), layer_devices=SPLIT)
    assert [layer.device.type for layer in cache.layers] == ["cpu", "cpu", "meta", "meta"]
    positions = cache.begin_forward(5)
    assert positions.device.type == "cpu"
    for index, device in enumerate(SPLIT):
        q = torch.randn(1, 4, 5, 16, device=device)
        k, v = torch.randn(1, 2, 5, 16, device=device), torch.randn(1, 2, 5, 16, device=device)
        out = cache.attend(index, q, k, v, 0.25)
        assert out.device.type == device and out.shape == (1, 5, 4, 16)
        # the layer's positions were moved to its device with it
        assert cache.layers[index].positions.device.type == device
    cache.end_forward()
    assert cache.seen == 5 and cache.layers[0].length == 5
    assert torch.equal(cache.layers[1].positions[:, :5].long(), torch.arange(5).expand(2, 5))


def test_a_cache_refuses_a_device_list_of_the_wrong_length():
    import pytest

    with pytest.raises(ValueError, match="3 devices for 4 layers"):
        DSV41Cache(4, 2, 16, torch.float32, "cpu", _settings(), layer_devices=("cpu",) * 3)


class _DeviceSpy:
    """Stands in for the cache: records where each layer's query arrives and answers on that device."""

    def __init__(self):
        self.devices = []

    def attend(self, index, q, k, v, scaling):
        assert q.device == k.device == v.device
        self.devices.append(q.device.type)
        return torch.zeros(1, q.shape[2], q.shape[1], q.shape[3], device=q.device, dtype=q.dtype)

    def fused_plan(self):
        return None


def _on(weights: LayerWeights, device: str) -> LayerWeights:
    return LayerWeights(**{name: None if value is None else value.to(device)
                           for name, value in vars(weights).items()})


def test_decoder_activations_follow_layers_spread_over_devices(tiny_model):
    model = tiny_model("llama", layers=4)
    adapter.install(model)
    weights = adapter.decoder_weights(model)
    assert weights is not None
    split = DecoderWeights(**{**vars(weights), "layers": [_on(layer, device) for layer, device in
                                                          zip(weights.layers, SPLIT, strict=True)],
                              "final_norm": weights.final_norm.to("meta"), "lm_head": weights.lm_head.to("meta")})
    decoder = Decoder(split)
    decoder.fused = None
    spy = _DeviceSpy()
    ids = torch.tensor([[1, 2, 3]])
    logits = decoder.forward(ids, torch.arange(3)[None], spy)
    assert spy.devices == list(SPLIT)
    assert logits.device.type == "meta" and logits.shape == (1, 1, 256)
    # one token (the decode path, with its RoPE matrix) follows the layers too
    spy.devices.clear()
    decoder.forward(ids[:, :1], torch.tensor([[3]]), spy)
    assert spy.devices == list(SPLIT)


def test_layer_devices_of_a_model(tiny_model):
    model = tiny_model("llama", layers=3)
    assert adapter.layer_devices(model) == [torch.device("cpu")] * 3
    model.model.layers[2].to("meta")
    assert [d.type for d in adapter.layer_devices(model)] == ["cpu", "cpu", "meta"]
