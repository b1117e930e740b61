"""The decoder's weights on huge pages (engine/kernels/huge_pages.py): moved without a byte changed or held twice."""

import sys

import pytest
import torch

from engine.kernels import huge_pages
from engine.models import adapter

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not huge_pages.enabled(),
                           reason="transparent huge pages are asked for on Linux only")


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
def test_the_buffer_starts_on_a_huge_page_of_a_mapping_that_asks_for_them():
    buf = huge_pages.huge_buffer(3 << 20)
    assert buf.numel() == 3 << 20 and buf.dtype == torch.uint8 and not buf.any()
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in _mapping_flags(buf.data_ptr())  # madvise(MADV_HUGEPAGE) on it


@linux
def test_moving_keeps_every_value_view_and_shared_storage():
    base = torch.arange(1000, dtype=torch.float32)
    view = base[10:20]  # a view another holder keeps (as the model's parameters do of the GGUF runs)
    strided = base[::7]
    other = torch.randint(0, 255, (33, 17), dtype=torch.uint8)  # an odd size: the next storage's start is aligned
    half = torch.randn(5, 3).to(torch.bfloat16)
    expected = [t.clone() for t in (base, view, strided, other, half)]
    old = base.untyped_storage().data_ptr()
    moved = huge_pages.move_to_huge_pages([base, other, half, other], also=[view, strided, torch.zeros(3)])
    assert moved == 4032 + 576 + 64  # each storage from a cache line on
    for got, want in zip((base, view, strided, other, half), expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert base.untyped_storage().data_ptr() != old
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # still one storage, not two
    assert strided.stride() == (7,) and view.storage_offset() == base.storage_offset() + 10
    assert other.data_ptr() % huge_pages.ALIGN == 0 and half.data_ptr() % huge_pages.ALIGN == 0
    assert "hg" in _mapping_flags(base.data_ptr())
    base[10] = -1.0  # the view still sees its base's bytes
    assert view[0] == -1.0


def test_nothing_moves_when_turned_off_or_too_large(monkeypatch):
    t = torch.ones(4)
    ptr = t.data_ptr()
    monkeypatch.setattr(huge_pages, "MOST", 8)
    assert huge_pages.move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr
    monkeypatch.setenv("DSV41_HUGE_PAGES", "0")
    assert not huge_pages.enabled()


@linux
def test_the_default_models_weights_sit_on_huge_pages_held_once(default_model):
    """As loaded, the decoder's weights (hundreds of tensors) are views of one storage in the huge-page mapping, and
    the model's parameters that share those bytes are views of it too (no second copy)."""
    hf = default_model.hf_model
    decoder = adapter.runtime(hf).decoder
    tensors = huge_pages.weight_tensors(decoder.w)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(tensors) > 300 and len(storages) == 1
    assert "hg" in _mapping_flags(tensors[0].data_ptr())
    assert sum(t.nbytes for t in tensors if t.is_contiguous()) > 90e6
    arena = tensors[0].untyped_storage().data_ptr()
    shared = [p for p in hf.parameters() if p.dtype == torch.uint8]  # the GGUF bytes as the model's parameters
    assert shared and all(p.untyped_storage().data_ptr() == arena for p in shared)


def test_doctor_says_whether_the_weights_get_huge_pages_and_how_to_turn_them_on(monkeypatch):
    from engine import doctor

    monkeypatch.setattr(huge_pages, "system_setting", lambda: "never")
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    check = doctor._huge_pages_check()
    if not hasattr(huge_pages.mmap, "MADV_HUGEPAGE"):
        assert check.status == "info" and "Linux only" in check.found
        return
    assert check.status == "warn" and "never" in check.found
    assert "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled" in check.fix
    monkeypatch.setattr(huge_pages, "system_setting", lambda: "madvise")
    check = doctor._huge_pages_check()
    assert check.status == "info" and "moved onto them at load" in check.found and not check.fix
    monkeypatch.setattr(huge_pages, "enabled", lambda: False)
    assert "DSV41_HUGE_PAGES=0" in doctor._huge_pages_check().found


@linux
def test_the_system_setting_is_read_from_the_kernel():
    assert huge_pages.system_setting() in ("always", "madvise", "never", "")


def test_no_memory_for_the_copy_leaves_the_weights_where_they_are(monkeypatch):
    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "huge_buffer", refuse)
    t = torch.arange(10.0)
    ptr = t.data_ptr()
    assert huge_pages.move_to_huge_pages([t]) == 0
    assert t.data_ptr() == ptr and torch.equal(t, torch.arange(10.0))
