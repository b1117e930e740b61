"""Running out of memory inside the cache's own bookkeeping changes nothing: growth and compaction are
all or nothing, and the inference-mode tensors of a forward can be undone outside inference mode."""

from __future__ import annotations

import pytest
import torch

from engine.cache.storage import LayerKV


def filled(n: int = 200, **kwargs) -> LayerKV:
    layer = LayerKV(2, 8, torch.float32, "cpu", initial_capacity=256, **kwargs)
    with torch.inference_mode():
        layer.append(torch.randn(2, n, 8), torch.randn(2, n, 8), torch.arange(n))
    return layer


def tensors(layer: LayerKV) -> dict:
    return {name: getattr(layer, name).clone() for name in layer._tensors()}


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("fail_on", [1, 2, 3])
def test_growth_that_runs_out_of_memory_midway_leaves_the_layer_as_it_was(monkeypatch, int8, fail_on):
    layer = filled(int8=int8)
    before, capacity, version = tensors(layer), layer.capacity, layer.storage_version
    real_empty, real_zeros = torch.Tensor.new_empty, torch.Tensor.new_zeros
    calls = {"n": 0}

    def counting(real):
        def allocate(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_on:
                raise torch.OutOfMemoryError("injected: out of memory")
            return real(self, *args, **kwargs)
        return allocate

    monkeypatch.setattr(torch.Tensor, "new_empty", counting(real_empty))
    monkeypatch.setattr(torch.Tensor, "new_zeros", counting(real_zeros))
    with pytest.raises(torch.OutOfMemoryError):
        layer.append(torch.randn(2, 100, 8), torch.randn(2, 100, 8), torch.arange(200, 300))
    monkeypatch.undo()
    assert layer.capacity == capacity and layer.length == 200 and layer.storage_version == version
    assert {n: t.shape[1] for n, t in tensors(layer).items()} == {n: capacity for n in before}
    for name, tensor in tensors(layer).items():
        assert torch.equal(tensor[:, :200], before[name][:, :200]), name
    # and the layer goes on working
    layer.append(torch.randn(2, 100, 8), torch.randn(2, 100, 8), torch.arange(200, 300))
    assert layer.length == 300 and layer.read_keys().shape == (2, 300, 8)


def test_compaction_that_runs_out_of_memory_leaves_the_layer_as_it_was(monkeypatch):
    """The torch path (a GPU layer's; on a CPU one C call moves the rows in place and allocates nothing, so it
    cannot run out of memory part-way) gathers every tensor before it writes any."""
    import engine.cache.storage as storage
    from engine.kernels import cache_ops

    monkeypatch.setattr(cache_ops, "keep_rows", lambda *a, **k: False)
    layer = filled()
    before = tensors(layer)
    real = storage._gather_rows
    calls = {"n": 0}

    def gather(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("injected")
        return real(*args)

    monkeypatch.setattr(storage, "_gather_rows", gather)
    keep = torch.arange(0, 200, 2).expand(2, -1).contiguous()
    with pytest.raises(torch.OutOfMemoryError):
        layer.keep(keep)
    monkeypatch.undo()
    assert calls["n"] == 3
    assert layer.length == 200
    for name, tensor in tensors(layer).items():
        assert torch.equal(tensor[:, :200], before[name][:, :200]), name


def test_undo_outside_inference_mode_of_entries_made_inside_it():
    """The undo of a half-read turn runs outside inference mode on tensors a forward made inside it."""
    layer = LayerKV(2, 8, torch.float32, "cpu", initial_capacity=16)
    with torch.inference_mode():
        layer.append(torch.randn(2, 300, 8), torch.randn(2, 300, 8), torch.arange(300))  # grows inside
    assert layer.keys.is_inference()
    layer.truncate(40)  # raised "Inplace update to inference tensor outside InferenceMode"
    assert layer.length == 40
    layer.keep(torch.arange(0, 40, 2).expand(2, -1).contiguous())
    assert layer.length == 20
