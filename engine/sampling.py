"""Sampling as small pure functions over one logits vector [V] (float32), on whatever device the logits are: on a
GPU nothing leaves the device but the chosen token id (one host sync per token)."""

from __future__ import annotations

import torch

from .config import GenerationSettings
from .kernels import sample as sample_kernel

__all__ = ["GenerationSettings", "apply_repetition_penalty", "head_probs", "logits_to_probs", "next_token", "sample",
           "sample_tensor"]


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    picked = logits[seen_ids]
    logits = logits.clone()
    logits[seen_ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        remove = cumulative - sorted_probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(remove, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def head_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same distribution as logits_to_probs, over the top_k best tokens only: (probabilities [k], token ids
    [k]), top-p applied within the top-k, so only k values are sorted, not the vocabulary (128k on a Llama 3)."""
    values, ids = torch.topk(logits, top_k)  # sorted, best first
    probs = torch.softmax(values / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        remove = probs.cumsum(-1) - probs > top_p
        probs = probs.masked_fill(remove, 0.0)
        probs = probs / probs.sum()
    return probs, ids


def sample_tensor(logits: torch.Tensor, settings: GenerationSettings, seen_ids: torch.Tensor,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The next token as a one-element long tensor [1] on the logits' device (nothing is read on the host): argmax
    when greedy, else a draw from the tempered top-k / top-p distribution (from the head only when top_k cuts
    the vocabulary). `seen_ids` and `generator` on the logits' device."""
    logits = apply_repetition_penalty(logits, seen_ids, settings.repetition_penalty)
    if settings.is_greedy:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's argmax, the same first maximum: ~3 us on the default model's 49k logits, torch's ~40 (it
            # parallelises the reduction), once per token
            return torch.full((1,), int(logits.numpy().argmax()), dtype=torch.long)
        return torch.argmax(logits).view(1)
    if 0 < settings.top_k < logits.shape[-1]:
        probs, ids = head_probs(logits, settings.temperature, settings.top_k, settings.top_p)
        return ids[torch.multinomial(probs, 1, generator=generator)]
    probs = logits_to_probs(logits, settings.temperature, settings.top_k, settings.top_p)
    return torch.multinomial(probs, 1, generator=generator)


def next_token(logits: torch.Tensor, settings: GenerationSettings, seen_ids: torch.Tensor,
               generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """sample_tensor's token as a host int, and as the [1] tensor it was drawn as (on the logits' device), or None
    where it was chosen on the host from float32 CPU logits: greedy with no repetition penalty (numpy's argmax, the
    same first maximum), or top-k sampling (engine.kernels.sample.sample_head: sample_tensor's distribution, drawn
    at a uniform number from `generator`, so a seed still gives the same reply)."""
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if settings.is_greedy and settings.repetition_penalty == 1.0 and on_cpu:
        return int(logits.numpy().argmax()), None
    if not settings.is_greedy and on_cpu and 0 < settings.top_k < logits.shape[-1] and logits.is_contiguous() \
            and _kernel_sampling():
        # the same distribution in one kernel call (engine.kernels.sample; through torch, ~12 ops a token cost
        # 0.55 ms a token more than greedy in the decode loop), drawn at a number from the same generator
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        token = sample_kernel.sample_head(logits, seen_ids, settings.repetition_penalty, settings.top_k,
                                          settings.temperature, settings.top_p, u)
        if token is not None:
            return token, None
    ids = sample_tensor(logits, settings, seen_ids, generator)
    return int(ids), ids


def _kernel_sampling() -> bool:
    return sample_kernel.available()


def sample(logits: torch.Tensor, settings: GenerationSettings, seen_ids: torch.Tensor,
           generator: torch.Generator | None) -> int:
    """sample_tensor's token id on the host (on a GPU: the one host sync of a decode step)."""
    return int(sample_tensor(logits, settings, seen_ids, generator))
