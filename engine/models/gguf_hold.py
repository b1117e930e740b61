"""A GGUF file's matrices as the decoder's GGUFWeights (adapter.hold_gguf walks the model; this reads the file).

Two holders: GGUFBlocks, what engine.models.gguf_load kept while loading the file straight into a model (every
GGUF load on a CPU), and GGUFHolder, for a model loaded from a float conversion of the file (the comparison and
fallback path), which checks each matrix against the loaded weight. There a matrix is held when every part of it (a layer's q, k and v; gate and up) is in a block format the kernels multiply
(engine.kernels.gguf_blocks) and the blocks' values are exactly the weights transformers loaded from the conversion.
llama.cpp's converter stores a Llama q / k projection with each head's rows interleaved (the two halves of the
rotary dimensions alternate); transformers undoes that when it loads, so the rows are taken in the same order here:
as stored, or de-interleaved per head, whichever gives the weight (checked, never assumed).
"""

from __future__ import annotations

import numpy as np
import torch

from ..gguf_index import tensor_index
from ..kernels.gguf_blocks import BY_TYPE, GGUFMatrix, GGUFWeight


def _gguf_rows(blocks: GGUFMatrix, hf_weight: torch.Tensor, heads: int | None) -> GGUFMatrix | None:
    """The blocks in the row order of the model's own weight, or None when their values are not exactly that
    weight's (then it is not held)."""
    if tuple(hf_weight.shape) != (blocks.rows, blocks.cols):
        return None
    expected = hf_weight.detach().float()
    values = blocks.dequantize()
    orders = [None]
    if heads and blocks.rows % (2 * heads) == 0:
        orders.append(deinterleaved(blocks.rows, heads))
    for order in orders:
        if torch.equal(values if order is None else values[order], expected):
            return blocks if order is None else blocks.select_rows(order)
    return None


def deinterleaved(rows: int, heads: int) -> torch.Tensor:
    """The stored row of each model row of a q / k projection llama.cpp's converter interleaved: model row (h, j, i)
    is stored at row (h, i, j) of [heads, rows / heads / 2, 2]."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class _Held:
    formats: set[str]  # held
    converted: set[str]  # in the file, in formats not held (they stay as the model loaded them)

    def summary(self) -> str | None:
        """What is held, for the weights line: "GGUF Q4_1 + Q8_0" (+ "; F16 converted" for formats in the file that
        are not held); None when nothing is."""
        if not self.formats:
            return None
        held = "GGUF " + " + ".join(sorted(self.formats))
        return held + (f"; {', '.join(sorted(self.converted))} converted" if self.converted else "")


class GGUFBlocks(_Held):
    """The matrices engine.models.gguf_load kept as the file's blocks (their rows in the model's order), by GGUF
    tensor name: the model's own parameters for them are empty until hold_gguf takes them all."""

    def __init__(self, matrices: dict[str, GGUFMatrix], names: set[str], converted: set[str]):
        self.matrices = matrices
        self.names = names  # every tensor in the file
        self.formats: set[str] = set()
        self.converted = converted
        self.taken: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.names

    def hold(self, names: list[str], weights: list[torch.Tensor], heads: list[int | None]) -> GGUFWeight | None:
        """The kept matrices `names` stacked as one GGUFWeight, or None where they were loaded as values."""
        parts = [self.matrices.get(name) for name in names]
        if any(part is None for part in parts):
            if any(part is not None for part in parts):
                raise ValueError(f"{names}: kept in part (engine.models.gguf_load groups these together)")
            return None
        self.taken.update(names)
        self.formats.update(p.format for p in parts)
        held = GGUFWeight(parts)  # its own copy of the blocks (rearranged for the kernels): these are let go
        for name in names:
            self.matrices[name] = None
        return held

    def untaken(self) -> list[str]:
        """Kept matrices no module was pointed at (their parameters are still empty)."""
        return sorted(set(self.matrices) - self.taken)


class GGUFHolder(_Held):
    """The tensors of one GGUF file, read into RAM as blocks on request (the file may go away after loading)."""

    def __init__(self, path):
        self.tensors = tensor_index(path)
        self._file = np.memmap(path, dtype=np.uint8, mode="r")
        self.formats: set[str] = set()  # held
        self.converted: set[str] = set()  # in the file, in formats not held (they stay as the model loaded them)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def hold(self, names: list[str], weights: list[torch.Tensor], heads: list[int | None]) -> GGUFWeight | None:
        """The tensors `names` stacked by rows as one GGUFWeight, if every one of them is held exactly as the
        model's `weights` (heads: the query / key head count of a Llama q / k projection, else None)."""
        parts = []
        for name, weight, h in zip(names, weights, heads, strict=True):
            entry = self.tensors.get(name)
            if entry is None or len(entry.shape) != 2:
                return None
            if entry.type_id not in BY_TYPE:
                self.converted.add(type_name(entry.type_id))
                return None
            cols, rows = entry.shape  # innermost first
            raw = torch.from_numpy(np.array(self._file[entry.offset:entry.offset + entry.nbytes]))  # a copy in RAM
            part = _gguf_rows(GGUFMatrix(entry.type_id, raw.view(rows, -1), cols), weight, h)
            if part is None:
                return None
            parts.append(part)
        self.formats.update(p.format for p in parts)
        return GGUFWeight(parts)



def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"
