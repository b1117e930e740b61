"""The decoder's weights moved onto 2 MiB pages (Linux transparent huge pages), where a CPU decode step reads them.

A decode step reads every byte of the model's matrices once per token. Held as PyTorch allocates them, they sit on
4 KiB pages (transparent huge pages are only given to memory that asks for them where the system's setting is
"madvise", the common default), so a step walks tens of thousands of pages and their translations: on a VM each miss
in the TLB is a two-level walk. `move_to_huge_pages` copies every storage of the weights into one anonymous mapping
that asks for huge pages (madvise MADV_HUGEPAGE), and points each tensor at its copy (Tensor.set_: views keep their
offsets, the old memory is freed, nothing is held twice). Paired in one process (benchmarks/huge_pages.py), the
fused step reads the same bytes faster (figures in docs/design.md, "The weights on huge pages").

Linux only (elsewhere, with DSV41_HUGE_PAGES=0, or for more than MOST bytes of weights, nothing moves); the kernel may
still give 4 KiB pages where it finds no free 2 MiB ones (or where transparent huge pages are "never"), and the
weights then read as before.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage's start: a cache line
# Weights beyond this stay where they are: the copy costs about what their first load did (the new pages are
# faulted in and zeroed: ~0.7 GB/s on a 2-core EPYC VM, 0.15 s for the default model), seconds more at start for a
# model of several GB.
MOST = 1 << 30


SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def system_setting() -> str:
    """The system's transparent huge pages: "always", "madvise" or "never" ("" where it cannot be read)."""
    try:
        with open(SETTING) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else ""


def status() -> tuple[bool, str, str]:
    """(a problem?, what holds here, the fix) for `python -m engine doctor`."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False, "not on this system (Linux only)", ""
    if not enabled():
        return False, "off (DSV41_HUGE_PAGES=0)", ""
    setting = system_setting()
    if setting == "never":
        return True, "transparent huge pages are off on this system (never): the weights stay on 4 KiB pages", (
            f"echo madvise | sudo tee {SETTING}  (decode steps 1.03-1.05x faster on an AMD EPYC; until reboot)")
    return False, f"the weights (up to {MOST >> 30} GiB) are moved onto them at load (transparent huge pages: " \
                  f"{setting or 'setting unknown'})", ""


def enabled() -> bool:
    """Whether weights are moved: Linux with madvise(MADV_HUGEPAGE), unless DSV41_HUGE_PAGES=0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("DSV41_HUGE_PAGES", "1") != "0"


def huge_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], zeros, starting on a 2 MiB boundary of an anonymous mapping that asks for huge pages (the
    mapping lives as long as a tensor made from it)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages are faulted in as huge ones
    except OSError:  # a kernel without transparent huge pages: ordinary pages, as PyTorch's
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def weight_tensors(obj, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor the decoder's weights hold: DecoderWeights, its layers, KernelMatrix objects (PackedMatrix,
    GGUFWeight and its GGUFMatrix runs and parts) and the lists of them, walked by their fields."""
    from .gguf_blocks import GGUFMatrix
    from .packed import KernelMatrix

    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            weight_tensors(item, found)
    elif isinstance(obj, (KernelMatrix, GGUFMatrix)) or dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for value in vars(obj).values():
            if isinstance(value, (torch.Tensor, list, tuple, KernelMatrix, GGUFMatrix)) or (
                    dataclasses.is_dataclass(value) and not isinstance(value, type)):
                weight_tensors(value, found)
    return found


@torch.inference_mode()
def move_to_huge_pages(tensors: list[torch.Tensor], also: list[torch.Tensor] = ()) -> int:
    """Each distinct CPU storage among `tensors` copied into one huge-page buffer, and every tensor on it (of
    `tensors` and of `also`: other holders of the same storages, the model's parameters) pointed at the copy with
    its offset, size and stride. Returns the bytes moved (0: nothing moved)."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu":
            continue
        s = t.untyped_storage()
        if s.nbytes() > 0:
            storages.setdefault(s.data_ptr(), (s, []))[1].append(t)
    for t in also:
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() in storages:
            storages[t.untyped_storage().data_ptr()][1].append(t)
    if not storages:
        return 0
    offsets, total = {}, 0
    for key, (s, _) in storages.items():
        offsets[key] = total
        total += -(-s.nbytes() // ALIGN) * ALIGN
    if total > MOST:
        return 0
    try:
        arena = huge_buffer(total)
    except (OSError, MemoryError):  # no address space or memory for a second copy: the weights stay where they are
        return 0
    for key in list(storages):
        s, users = storages.pop(key)  # (the old storage is freed as soon as its last tensor is pointed away)
        at, n = offsets[key], s.nbytes()
        arena[at:at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
        for t in {id(t): t for t in users}.values():
            if n % t.element_size():
                continue  # (no dtype view of these bytes: the tensor keeps its own)
            view = arena[at:at + n].view(t.dtype)
            t.set_(view.untyped_storage(), view.storage_offset() + t.storage_offset(), t.size(), t.stride())
        del s, users
    return total
