"""Sampling as small pure functions over one logits vector [V] (float32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1
    seed: int | None = None
    greedy: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens

    def __post_init__(self):
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens <= 1 << 20,
             "an integer in [1, 1048576]"),
            ("temperature", isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 5, "in [0, 5]"),
            ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("repetition_penalty", isinstance(self.repetition_penalty, (int, float)) and 1 <= self.repetition_penalty <= 3,
             "in [1, 3]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, getattr(self, name), allowed)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


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


def sample(logits: torch.Tensor, settings: GenerationSettings, seen_ids: torch.Tensor,
           generator: torch.Generator | None) -> int:
    logits = apply_repetition_penalty(logits, seen_ids, settings.repetition_penalty)
    if settings.is_greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, settings.temperature, settings.top_k, settings.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
