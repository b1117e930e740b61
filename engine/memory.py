"""MemoryReport: weights / KV stored / KV uncompressed-equivalent / activations / other / free.

CUDA: torch allocator figures plus NVML for the device total and other processes.
CPU: system RAM through psutil (labelled "CPU"), activations from the process RSS above what the
engine holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

GB = 1024**3
# Below this share of the tokens seen kept in the cache, measured quality drops past the +2 % perplexity target
# (benchmarks/quality.py at the defaults: +1.06 % at ratio 0.5, +2.64 % at 0.3, +3.61 % at 0.2).
QUALITY_KEPT_SHARE = 0.3


@dataclass(frozen=True)
class MemoryReport:
    device: str  # "cuda:0" / "cpu"
    device_label: str  # e.g. "NVIDIA H200" or "CPU (system RAM via psutil)"
    weights: int
    kv_stored: int
    kv_uncompressed: int
    activations: int
    other: int
    total: int  # device (or system RAM) capacity
    free: int
    tokens_seen: int = 0
    kv_stored_tokens: int = 0  # entries kept per layer and KV head, the layers' mean (DSV41Cache.stored)
    kv_reserved: int = 0  # allocated for the cache, incl. spare capacity (counted in `other` beyond kv_stored)
    kv_cold: int = 0  # the cold tier (host RAM): entries out of the hot set, kept for recall; not in kv_stored
    kv_cold_disk: int = 0  # the cold tier's part in a file (past its RAM cap, or cold_tier 'disk')
    recall_s: float | None = None  # the last question's recall from the cold tier (None: nothing recalled yet)
    saved_caches: int = 0  # saved conversation caches on disk (engine.conversation_store), not in memory
    kv_target_ratio: float | None = None  # the ratio the knobs ask for (kv_cache_ratio); None: no cache yet
    kv_ratio_reason: str = ""  # why compression_ratio differs from it ('' when they agree; cache.budget.explain_ratio)
    remote: str = ""  # the server's address when the model runs there (engine.remote); '' in this process

    @property
    def compression_ratio(self) -> float:
        return self.kv_stored / self.kv_uncompressed if self.kv_uncompressed else 1.0

    def without_chat(self) -> MemoryReport:
        """The same machine and model with no chat's cache in the figures (a chat not read yet)."""
        return dataclasses.replace(self, kv_stored=0, kv_uncompressed=0, tokens_seen=0, kv_stored_tokens=0,
                                   kv_reserved=0, kv_cold=0, kv_cold_disk=0, recall_s=None, kv_target_ratio=None,
                                   kv_ratio_reason="")

    @property
    def used_by_engine(self) -> int:
        return self.weights + self.kv_stored + self.kv_cold + self.activations

    def kv_over_weights(self) -> float:
        return self.kv_stored / self.weights if self.weights else 0.0

    @property
    def kept_share(self) -> float:
        """Entries stored per token seen: the share of the uncompressed KV the cache keeps, whatever each layer keeps
        (1.0 before anything is compacted)."""
        return self.kv_stored_tokens / self.tokens_seen if self.tokens_seen else 1.0

    def quality_hint(self) -> str | None:
        """Said when the cache keeps so little that answers measurably worsen (docs/reliability.md)."""
        if round(self.kept_share, 2) >= QUALITY_KEPT_SHARE:
            return None
        return (f"The cache keeps {self.kept_share * 100:.0f} % of the {self.tokens_seen:,} tokens read. Below "
                f"{QUALITY_KEPT_SHARE * 100:.0f} % answers measurably worsen (perplexity +3.6 % at 20 % kept, +1.1 % at "
                "50 %): raise the cache ratio or lower the CED threshold if answers drift.")

    def hint(self) -> str | None:
        """The KV-over-weights rule of thumb, and the quality warning, when they apply."""
        hints = []
        if self.weights and self.kv_over_weights() > 0.30:
            hints.append("KV cache is over 30 % of the weights: compress harder (lower kv_cache_ratio or raise "
                         "ced_threshold).")
        quality = self.quality_hint()
        if quality:
            hints.append(quality)
        return " ".join(hints) or None

    def short_hint(self) -> str | None:
        """hint() in a line or two (the memory panel shows this and the whole hint as its tooltip)."""
        hints = []
        if self.weights and self.kv_over_weights() > 0.30:
            hints.append(f"KV cache is {self.kv_over_weights() * 100:.0f} % of the weights: compress harder")
        if self.quality_hint():
            hints.append(f"keeps {self.kept_share * 100:.0f} % of the {self.tokens_seen:,} tokens read: answers may "
                         "drift")
        return "; ".join(hints) or None

    def format_text(self) -> str:
        """Weights, KV cache (stored and uncompressed), activations, total (print_memory_usage); then the cold tier
        (with the last recall's time) and the saved chat caches on disk, when there are any."""
        return (
            f"Model weights: {self.weights / GB:.2f} GB\n"
            f"KV Cache: {self.kv_stored / GB:.2f} GB (compressed from {self.kv_uncompressed / GB:.2f} GB)\n"
            f"Activation: {self.activations / GB:.2f} GB\n"
            f"Total: {self.used_by_engine / GB:.2f} GB"
            + (f"\nKV Cold tier: {self.kv_cold / GB:.2f} GB host RAM + {self.kv_cold_disk / GB:.2f} GB disk "
               "(recalled per question" + (f"; last recall {self.recall_s * 1000:.0f} ms" if self.recall_s is not None
                                           else "") + ")"
               if self.kv_cold or self.kv_cold_disk else "")
            + (f"\nSaved chat caches: {self.saved_caches / GB:.2f} GB (disk)" if self.saved_caches else "")
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["compression_ratio"] = self.compression_ratio
        return data


def return_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc malloc_trim). Loading a model allocates and frees
    hundreds of MB (a float32 copy of every matrix before it is re-held as GGUF blocks or bf16); glibc keeps
    that freed heap resident (the default model: 777 -> 461 MB RSS after loading). False where there is no glibc."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def module_bytes(model) -> int:
    """Parameters + buffers as stored (quantized tensors count as quantized)."""
    seen = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = tensor.data_ptr()
        if key in seen:  # tied weights (embeddings = lm_head) are stored once
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def measure(device: str, weights: int, kv_stored: int, kv_uncompressed: int, *, baseline_rss: int = 0,
            tokens_seen: int = 0, kv_stored_tokens: int = 0, kv_reserved: int = 0, kv_cold: int = 0,
            kv_cold_disk: int = 0, recall_s: float | None = None, saved_caches: int = 0,
            devices: tuple[str, ...] = ()) -> MemoryReport:
    """`devices`: every device the model's weights and cache use (several GPUs under device_map="auto"; default:
    `device` alone). On CUDA the figures add up over them."""
    from dataclasses import replace

    if device.startswith("cuda"):
        report = _measure_cuda(tuple(devices) or (device,), weights, kv_stored, kv_uncompressed, tokens_seen,
                               kv_stored_tokens)
    else:  # the cold tier is in this process's RAM, so it is not counted as activations
        report = _measure_cpu(weights, kv_stored + kv_cold, kv_uncompressed, baseline_rss, tokens_seen,
                              kv_stored_tokens)
        report = replace(report, kv_stored=kv_stored)
    return replace(report, kv_reserved=max(kv_reserved, kv_stored), kv_cold=kv_cold, kv_cold_disk=kv_cold_disk,
                   recall_s=recall_s,
                   saved_caches=saved_caches)


# ------------------------------------------------------------------------------------------------ CUDA

# Allocated bytes on each CUDA device (by torch index) when the current turn began (begin_turn): the peak since
# then, above this and above what is allocated now, is the turn's working memory ("activations").
_TURN_BASE: dict[int, int] = {}


def cuda_indices(devices, cuda=None) -> list[int]:
    """The torch indices of the CUDA devices among `devices` ("cuda", "cuda:1", torch.device)."""
    import torch

    cuda = cuda or torch.cuda
    out = []
    for device in devices:
        dev = torch.device(device)
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else cuda.current_device()
            if index not in out:
                out.append(index)
    return out


def begin_turn(devices, cuda=None) -> None:
    """Reset each CUDA device's peak counter before a turn (and after loading), so "activations" is the working
    memory of the last turn, not the process-lifetime peak with the load-time copies and the KV reserved."""
    import torch

    cuda = cuda or torch.cuda
    for index in cuda_indices(devices, cuda):
        cuda.reset_peak_memory_stats(index)
        _TURN_BASE[index] = cuda.memory_allocated(index)


def nvml_handle(pynvml, props, index: int, env=None):
    """The NVML handle of torch's CUDA device `index` (its `props` from get_device_properties), matched by UUID,
    then by PCI bus id: torch's indices count only what CUDA_VISIBLE_DEVICES shows (and in its order), NVML's
    count every GPU. By index only when nothing is hidden or reordered; None when no match is certain."""
    import os

    env = os.environ if env is None else env
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        text = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text)
        except Exception:  # noqa: BLE001 - try every device's UUID below
            pass
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                found = pynvml.nvmlDeviceGetUUID(handle)
                found = found.decode() if isinstance(found, bytes) else str(found)
                if found.lower().split("-", 1)[-1] == text.lower().split("-", 1)[-1]:
                    return handle
        except Exception:  # noqa: BLE001
            pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        except Exception:  # noqa: BLE001
            pass
    if not env.get("CUDA_VISIBLE_DEVICES", "").strip():
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001
            return None
    return None


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - NVML is optional; torch's figures still stand
        return None


def _measure_cuda(devices, weights, kv_stored, kv_uncompressed, tokens_seen, kv_tokens, *, cuda=None,
                  nvml=...) -> MemoryReport:
    import torch

    cuda = cuda or torch.cuda
    pynvml = _nvml() if nvml is ... else nvml
    indices = cuda_indices(devices, cuda) or [cuda.current_device()]
    names, total, free, working, other = [], 0, 0, 0, 0
    for index in indices:
        allocated = cuda.memory_allocated(index)
        reserved = cuda.memory_reserved(index)
        peak = cuda.max_memory_allocated(index)
        dev_free, dev_total = cuda.mem_get_info(index)
        names.append(cuda.get_device_name(index))
        # the working memory of the last turn: its peak above what was there when it began and what is now
        working += max(peak - max(_TURN_BASE.get(index, allocated), allocated), 0)
        handle = nvml_handle(pynvml, cuda.get_device_properties(index), index) if pynvml is not None else None
        if handle is not None:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            dev_total, dev_free = int(info.total), int(info.free)
            # everything used on the device that our allocator does not hold: other processes, the CUDA context
            outside = max(int(info.used) - reserved, 0)
        else:
            outside = max(dev_total - dev_free - reserved, 0)
        total, free = total + int(dev_total), free + int(dev_free)
        other += max(reserved - allocated, 0) + outside
    if len(set(names)) > 1:
        label = " + ".join(names)
    else:
        label = names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    device = ",".join(f"cuda:{i}" for i in indices)
    return MemoryReport(device, label, weights, kv_stored, kv_uncompressed, working, other, total, free,
                        tokens_seen, kv_tokens)


def free_by_device(devices, cuda=None) -> dict[int, int]:
    """Free bytes on each CUDA device among `devices` (torch index -> bytes)."""
    import torch

    cuda = cuda or torch.cuda
    return {index: int(cuda.mem_get_info(index)[0]) for index in cuda_indices(devices, cuda)}


def cuda_headroom_tokens(layer_devices, per_token: int, fraction: float, cuda=None) -> int | None:
    """Entries a turn may hold before compacting when the layers (and so each token's KV) are spread over CUDA
    devices: on each device `fraction` of its free memory over its layers' share of `per_token` bytes, the
    smallest of them. None when no layer is on a CUDA device."""
    import collections

    counts = collections.Counter(i for device in layer_devices for i in cuda_indices([device], cuda))
    if not counts:
        return None
    free = free_by_device([f"cuda:{i}" for i in counts], cuda)
    layers = len(layer_devices)
    return max(min(int(free[i] * fraction / (per_token * n / layers)) for i, n in counts.items()), 1)


def _measure_cpu(weights, kv_stored, kv_uncompressed, baseline_rss, tokens_seen, kv_tokens) -> MemoryReport:
    import psutil

    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    engine_rss = max(rss - baseline_rss, 0)
    activations = max(engine_rss - weights - kv_stored, 0)
    other = max(vm.total - vm.available - (weights + kv_stored + activations), 0)
    return MemoryReport("cpu", "CPU (system RAM via psutil)", weights, kv_stored, kv_uncompressed, activations,
                        other, int(vm.total), int(vm.available), tokens_seen, kv_tokens)
