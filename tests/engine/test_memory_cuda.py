"""The memory report's CUDA arithmetic, with stand-ins for torch.cuda and NVML (no GPU here): activations are
the last turn's working memory (not the process-lifetime peak), NVML is matched to torch's device by UUID
(CUDA_VISIBLE_DEVICES renumbers torch's devices, not NVML's), and every device the model uses is counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import memory

GB = 1 << 30


class FakeCuda:
    """torch.cuda's memory functions over a few devices whose counters the test sets."""

    def __init__(self, count: int, name: str = "NVIDIA H200"):
        self.allocated = [0] * count
        self.reserved = [0] * count
        self.peak = [0] * count
        self.free = [100 * GB] * count
        self.total = [141 * GB] * count
        self.name = name
        self.uuids = [f"uuid-{i}" for i in range(count)]

    def current_device(self):
        return 0

    def memory_allocated(self, i):
        return self.allocated[i]

    def memory_reserved(self, i):
        return self.reserved[i]

    def max_memory_allocated(self, i):
        return self.peak[i]

    def reset_peak_memory_stats(self, i):
        self.peak[i] = self.allocated[i]

    def mem_get_info(self, i):
        return self.free[i], self.total[i]

    def get_device_name(self, i):
        return self.name

    def get_device_properties(self, i):
        return SimpleNamespace(uuid=self.uuids[i])


class FakeNvml:
    """pynvml over the machine's GPUs in NVML's own order, each with its UUID and memory figures."""

    def __init__(self, uuids, *, by_uuid=True):
        self.uuids = list(uuids)
        self.by_uuid = by_uuid
        self.memory = {u: SimpleNamespace(total=141 * GB, free=90 * GB, used=51 * GB) for u in uuids}

    def nvmlDeviceGetHandleByUUID(self, text):  # noqa: N802 - pynvml's names
        if not self.by_uuid or text.removeprefix("GPU-") not in self.uuids:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return text.removeprefix("GPU-")

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return self.uuids[i]

    def nvmlDeviceGetUUID(self, handle):  # noqa: N802
        return f"GPU-{handle}".encode()

    def nvmlDeviceGetHandleByPciBusId(self, pci):  # noqa: N802
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return self.memory[handle]


def test_nvml_is_matched_by_uuid_not_by_torch_index():
    # CUDA_VISIBLE_DEVICES=2: torch's device 0 is the machine's third GPU
    nvml = FakeNvml(["uuid-a", "uuid-b", "uuid-c"])
    props = SimpleNamespace(uuid="uuid-c")
    env = {"CUDA_VISIBLE_DEVICES": "2"}
    assert memory.nvml_handle(nvml, props, 0, env) == "uuid-c"
    # an NVML that cannot look a UUID up (MIG, other formats): every device's UUID is compared
    assert memory.nvml_handle(FakeNvml(["uuid-a", "uuid-c"], by_uuid=False), props, 0, env) == "uuid-c"
    # no UUID and no PCI id: by index only when nothing is hidden or renumbered
    bare = SimpleNamespace()
    assert memory.nvml_handle(nvml, bare, 0, env) is None
    assert memory.nvml_handle(nvml, bare, 0, {}) == "uuid-a"


def test_activations_are_the_last_turns_working_memory(monkeypatch):
    monkeypatch.setattr(memory, "_TURN_BASE", {})
    cuda = FakeCuda(1)
    cuda.allocated[0], cuda.reserved[0] = 20 * GB, 24 * GB
    cuda.peak[0] = 60 * GB  # the load's copies: never a turn's working memory
    memory.begin_turn(["cuda:0"], cuda)
    # a turn: the cache grew by 2 GB and its forwards needed 5 GB more at their peak
    cuda.peak[0], cuda.allocated[0] = 27 * GB, 22 * GB
    report = memory._measure_cuda(("cuda:0",), 16 * GB, 6 * GB, 12 * GB, 100, 50, cuda=cuda, nvml=None)
    assert report.activations == 5 * GB
    # without the reset the lifetime peak would have said 38 GB
    assert report.activations != max(60 * GB - 16 * GB - 6 * GB, 0)
    # no NVML: what the allocator does not hold comes from torch's free figure
    assert report.other == (24 - 22) * GB + (141 - 100 - 24) * GB


def test_every_device_the_model_uses_is_counted(monkeypatch):
    monkeypatch.setattr(memory, "_TURN_BASE", {})
    cuda = FakeCuda(2)
    cuda.uuids = ["uuid-x", "uuid-y"]
    for i in range(2):
        cuda.allocated[i] = cuda.reserved[i] = 10 * GB
    memory.begin_turn(["cuda:0", "cuda:1"], cuda)
    cuda.peak = [13 * GB, 11 * GB]
    nvml = FakeNvml(["uuid-y", "uuid-x"])  # NVML lists them the other way round
    nvml.memory["uuid-x"].free = 80 * GB
    nvml.memory["uuid-y"].free = 70 * GB
    report = memory._measure_cuda(("cuda:0", "cuda:1"), 16 * GB, 2 * GB, 4 * GB, 10, 5, cuda=cuda, nvml=nvml)
    assert report.device == "cuda:0,cuda:1" and report.device_label == "2 x NVIDIA H200"
    assert report.total == 2 * 141 * GB and report.free == 150 * GB
    assert report.activations == 4 * GB
    assert report.other == 2 * (51 - 10) * GB  # NVML's used beyond what our allocator reserved, per device


@pytest.mark.parametrize("devices, expected", [(["cpu"], []), (["cuda:1", "cuda:1", "cuda:0"], [1, 0]),
                                               (["cuda"], [0])])
def test_cuda_indices(devices, expected):
    assert memory.cuda_indices(devices, FakeCuda(2)) == expected


def test_the_prefill_headroom_is_taken_per_device():
    cuda = FakeCuda(2)
    cuda.free = [10 * GB, 40 * GB]
    # 3 layers on cuda:0, 1 on cuda:1: 3/4 of each token's KV on cuda:0
    per_token = 4 << 20
    tokens = memory.cuda_headroom_tokens(["cuda:0"] * 3 + ["cuda:1"], per_token, 0.5, cuda)
    assert tokens == min(int(10 * GB * 0.5 / (per_token * 3 / 4)), int(40 * GB * 0.5 / (per_token / 4)))
    assert tokens == int(10 * GB * 0.5 / (per_token * 3 / 4))  # the fuller device decides
    assert memory.cuda_headroom_tokens(["cpu"] * 4, per_token, 0.5, cuda) is None
