"""A cache's state as named tensors and back: what engine.conversation_store writes to disk and reads again.

Everything a later turn reads is saved: per layer the hot entries (keys, values, their int8 scales, positions,
scores, merge counts) and the CSA2 query moments, the cold tier's entries, and the counters (tokens seen,
compactions, decode steps). CSA2's projected keys are not saved: they are refitted from the saved moments.
Only the stored entries are written, never the spare capacity.

`load_state` checks every tensor's name, shape and dtype against the cache it fills before changing anything,
so a file that does not fit (another model, another storage format) raises StateMismatch and leaves the cache
as it was.
"""

from __future__ import annotations

import torch

from .storage import LayerKV

FORMAT = 1  # bumped when the layout below changes: older files are refused (and rebuilt)


class StateMismatch(ValueError):
    """A saved state that does not fit this cache (refused; the conversation is re-read instead)."""


def _hot_names(layer: LayerKV) -> list[str]:
    return ["keys", "values", "positions", "scores", "log_counts"] + (["key_scales", "value_scales"] if layer.int8 else [])


@torch.inference_mode()
def save_state(cache) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, facts): the cache's state as contiguous CPU tensors and a JSON-able dict of its counters. A state
    is saved between turns: a reply's counts of the cold tier (DSV41Cache.count_cold) are not part of it."""
    cache.uncount_cold()
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        n = layer.length
        for name in _hot_names(layer):
            tensors[f"hot.{i}.{name}"] = getattr(layer, name)[:, :n].contiguous().cpu()
        if layer.query_moment is not None:
            tensors[f"hot.{i}.query_moment"] = layer.query_moment.contiguous().cpu()
        layers.append({"length": n, "merged_any": layer.merged_any, "merged_tokens": layer.merged_tokens,
                       "query_count": layer.query_count})
    colds = []
    for i, cold in enumerate(cache.cold or ()):
        for name in cold._names():
            tensors[f"cold.{i}.{name}"] = getattr(cold, name)[:, : cold.length].contiguous().cpu()
        colds.append(cold.length)
    facts = {"format": FORMAT, "seen": cache.seen, "compactions": cache.compactions,
             "decode_steps": cache.decode_steps, "question_at": cache.question_at, "layers": layers,
             "cold": colds if cache.cold is not None else None}
    return tensors, facts


def _expect(tensors, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise StateMismatch(f"the saved state has no {key}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise StateMismatch(f"{key} is {tuple(t.shape)} {t.dtype}, this cache needs {tuple(shape)} {dtype}")
    return t


@torch.inference_mode()
def load_state(cache, tensors: dict[str, torch.Tensor], facts: dict) -> None:
    """Fill `cache` (freshly reset, same settings) with a saved state. Raises StateMismatch, changing nothing,
    when the state does not fit it."""
    if facts.get("format") != FORMAT:
        raise StateMismatch(f"saved state format {facts.get('format')!r}, this engine reads {FORMAT}")
    layers = facts.get("layers") or []
    if len(layers) != len(cache.layers):
        raise StateMismatch(f"{len(layers)} layers saved, the model has {len(cache.layers)}")
    if (facts.get("cold") is None) != (cache.cold is None):
        raise StateMismatch("the saved state and this cache disagree on the cold tier")
    h, d = cache.kv_heads, cache.head_dim
    plan = []  # everything checked before anything is written
    for i, (layer, saved) in enumerate(zip(cache.layers, layers, strict=True)):
        n = int(saved["length"])
        store = torch.int8 if layer.int8 else layer.dtype
        shapes = {"keys": ((h, n, d), store), "values": ((h, n, d), store), "positions": ((h, n), torch.int32),
                  "scores": ((h, n), torch.float32), "log_counts": ((h, n), torch.float32),
                  "key_scales": ((h, n, 1), torch.float32), "value_scales": ((h, n, 1), torch.float32)}
        rows = {name: _expect(tensors, f"hot.{i}.{name}", *shapes[name]) for name in _hot_names(layer)}
        moment = tensors.get(f"hot.{i}.query_moment")
        if moment is not None:
            _expect(tensors, f"hot.{i}.query_moment", (h, d, d), torch.float32)
        plan.append((layer, n, rows, moment, saved))
    cold_plan = []
    for i, cold in enumerate(cache.cold or ()):
        n = int(facts["cold"][i])
        store = torch.int8 if cold.int8 else cold.dtype
        shapes = {"keys": ((h, n, d), store), "values": ((h, n, d), store), "positions": ((h, n), torch.int32),
                  "scores": ((h, n), torch.float32), "key_scales": ((h, n, 1), torch.float32),
                  "value_scales": ((h, n, 1), torch.float32)}
        cold_plan.append((cold, n, {name: _expect(tensors, f"cold.{i}.{name}", *shapes[name])
                                    for name in cold._names()}))
    for layer, n, rows, moment, saved in plan:
        layer.resize(n + 1)
        for name, t in rows.items():
            getattr(layer, name)[:, :n] = t.to(layer.device)
        layer.length = n
        layer.merged_any, layer.merged_tokens = bool(saved["merged_any"]), int(saved["merged_tokens"])
        layer.query_moment = None if moment is None else moment.to(layer.device)
        layer.query_count = int(saved["query_count"])
        layer.projected_keys = None
    for cold, n, rows in cold_plan:
        cold._grow(n)
        for name, t in rows.items():
            getattr(cold, name)[:, :n] = t
        cold.length = n
        cold.forget_buckets()  # other entries than the sizes counted (rebuilt by the next counts)
    cache.seen, cache.compactions = int(facts["seen"]), int(facts["compactions"])
    cache.decode_steps = int(facts["decode_steps"])
    # where its last question began (DSV41Cache.count_cold); a state saved without it counts that exchange too
    cache.question_at = None if facts.get("question_at") is None else int(facts["question_at"])
    cache.fit_sparse()
