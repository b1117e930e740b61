"""Top-k / top-p sampling of one float32 CPU logits vector in one kernel call (cpu_kernels.c, dsv41_sample_head):
the distribution of engine.sampling.head_probs after the repetition penalty, drawn at a given uniform number."""

from __future__ import annotations

import torch

from .library import load


def available() -> bool:
    """Whether sample_head can run here (the kernels built)."""
    return load() is not None


def sample_head(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float, top_k: int, temperature: float,
                top_p: float, u: float, library=None) -> int | None:
    """The token drawn at `u` in [0, 1) of the kept mass: the top_k best logits after the repetition penalty on
    `seen_ids`, softmax(value / temperature) over them, the smallest prefix whose mass reaches top_p, in descending
    order. None where the kernels do not decide it (no kernels, a NaN or +inf logit, no finite logit): the torch path
    does then."""
    lib = library or load()
    if lib is None:
        return None
    if (logits.dtype != torch.float32 or logits.dim() != 1 or not logits.is_contiguous()
            or logits.device.type != "cpu"):
        raise ValueError("sample_head takes a contiguous float32 CPU logits vector")
    n = logits.shape[0]
    if not 0 < top_k <= n:
        raise ValueError(f"top_k must be in [1, {n}], not {top_k}")
    seen = seen_ids
    if seen.numel() and (seen.dtype != torch.long or not seen.is_contiguous() or seen.device.type != "cpu"):
        seen = seen.to("cpu", torch.long).contiguous()
    token = lib.lib.dsv41_sample_head(logits.data_ptr(), n, seen.data_ptr() if seen.numel() else None, seen.numel(),
                                      float(penalty), int(top_k), float(temperature), float(top_p), float(u))
    if token == -3:
        raise MemoryError("out of memory while sampling a token")
    if token == -1:
        raise ValueError(f"sample_head: an argument is out of range (penalty {penalty}, top_p {top_p}, u {u}, or a "
                         f"seen id outside [0, {n}))")
    return None if token < 0 else int(token)
