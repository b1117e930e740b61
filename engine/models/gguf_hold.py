"""A GGUF file's matrices as the decoder's GGUFWeights (adapter.hold_gguf walks the model; this reads the file).

A matrix is held when every part of it (a layer's q, k and v; gate and up) is in a block format the kernels multiply
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
        half = blocks.rows // heads // 2
        # model row (h, j, i) is stored at row (h, i, j) of [heads, half, 2]
        orders.append(torch.arange(blocks.rows).view(heads, half, 2).transpose(1, 2).reshape(-1))
    for order in orders:
        if torch.equal(values if order is None else values[order], expected):
            return blocks if order is None else blocks.select_rows(order)
    return None


class GGUFHolder:
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
                self.converted.add(_type_name(entry.type_id))
                return None
            cols, rows = entry.shape  # innermost first
            raw = torch.from_numpy(np.array(self._file[entry.offset:entry.offset + entry.nbytes]))  # a copy in RAM
            part = _gguf_rows(GGUFMatrix(entry.type_id, raw.view(rows, -1), cols), weight, h)
            if part is None:
                return None
            parts.append(part)
        self.formats.update(p.format for p in parts)
        return GGUFWeight(parts)

    def summary(self) -> str | None:
        """What is held, for the weights line: "GGUF Q4_1 + Q8_0" (+ "; F16 converted" for formats in the file that
        are not held); None when nothing is."""
        if not self.formats:
            return None
        held = "GGUF " + " + ".join(sorted(self.formats))
        return held + (f"; {', '.join(sorted(self.converted))} converted" if self.converted else "")


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"
