"""The decode step with static shapes, and its CUDA-graph replay.

Why: on a GPU a batch-1 decode step of our per-op forward (decoder.py + DSV41Cache.attend) is ~40 kernels and
~80 Python-level torch calls per layer, so an 8B-shape model spends more time launching kernels than reading its
weights. Captured as one CUDA graph, a step is one launch. A graph replays fixed kernels on fixed addresses, so
the step may not depend on host values: here nothing in it does.

- Every layer attends over its whole preallocated capacity C (LayerKV's blocks), masked past the entry being
  written; where that entry goes (its slot), the token and its position are device tensors the host writes
  before each step (one small copy). Nothing past a layer's length is ever used: keys, values and projected keys
  there are zeroed once per allocation (uninitialised memory could hold NaNs, and 0 x NaN is NaN), and CED scores
  there are zero already (storage.py keeps them so), so `scores <- decay * scores + attention` over the capacity
  leaves them zero.
- The CED score update and CSA2's screening run inside the step: CSA2's top-k is a fixed count, its range (past
  the sinks, before the recent window) a mask; the recent window's indices are computed from the slot.
- Compaction, recall, CSA2 fitting and growth run outside, in place, between steps. A graph is captured again
  only when what it reads moved (a layer reallocated, a CSA2 fit, a merge) or the per-layer plan changed:
  capacities grow in blocks (storage.ensure_capacity), so that is rare.
- RoPE's cos/sin come from a table built by the model's own rotary module, indexed by the position tensor.

On the CPU the same step runs without a graph; tests check it equals the per-op step (logits, keys, values,
positions, scores) and that it never reads a device value on the host. DSV41Cache.static_plan decides when a step
can run this way; what it cannot (a probe, a sampled CSA2 recall measurement, layers on several devices) takes the
per-op step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..cache.storage import _gather_rows
from .decoder import (
    LENGTH_DEPENDENT_ROPE,
    DecoderWeights,
    RopeTable,
    linear,
    residual_linear,
    rms_norm,
    rope_matrix,
    rope_swap,
)

log = logging.getLogger(__name__)


def supports(weights: DecoderWeights) -> bool:
    """Whether this model's decode step can run with static shapes (plain tensor weights, a position-only RoPE)."""
    plain = all(isinstance(m, torch.Tensor) for m in (weights.embed, weights.lm_head))
    plain = plain and all(isinstance(getattr(layer, name), torch.Tensor) for layer in weights.layers
                          for name in ("qkv", "o", "gate_up", "down"))
    return plain and not str(weights.rope_type).startswith(LENGTH_DEPENDENT_ROPE)


class StaticDecodeStep:
    """step(input_ids [1, 1], cache, plan) -> logits [vocab] float32, for a cache inside a one-token forward
    (DSV41Cache.static_plan gave `plan`). `graphs`: capture the step as a CUDA graph and replay it."""

    def __init__(self, weights: DecoderWeights, *, graphs: bool = False):
        self.w = weights
        self.device = weights.final_norm.device
        self.dtype = weights.final_norm.dtype
        self.graphs = graphs and self.device.type == "cuda"
        layers = len(weights.layers)
        # [token, position, slot of layer 0, ..., slot of layer L-1]: what the host writes before a step
        self.inputs = torch.zeros(2 + layers, dtype=torch.long, device=self.device)
        self._host = torch.zeros(1 + layers, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_view = self._host.numpy()  # written without a torch op per value
        self._copied = None  # a CUDA event: the last copy out of _host has run (it may be rewritten)
        self._rope = RopeTable(weights.rotary, self.dtype, self.device)
        self._cos = self._sin = None
        self._clean: list[int | None] = [None] * layers  # storage_version whose tail past `length` is zeroed
        self._swap = rope_swap(weights.head_dim, self.dtype, self.device)  # RoPE's fixed pattern (rope_matrix)
        self._entries: dict[int, torch.Tensor] = {}  # arange(capacity) per capacity: a constant, not a kernel a layer
        # the CUDA graph: what it was captured for, its output (in the graph's own memory pool)
        self._graph = None
        self._graph_key = None
        self._graph_out: torch.Tensor | None = None
        self.captures = 0  # graphs captured so far (bench / gpucheck report it)
        self.replays = 0
        self.graph_error: str | None = None  # why capture failed (the eager static step runs from then on)

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, cache, plan) -> torch.Tensor:
        self._write_inputs(input_ids, cache, plan.position)
        self._prepare(cache, plan.position)
        if self.graphs and self.graph_error is None:
            key = self._key(cache, plan)
            if key != self._graph_key:
                self._capture(cache, plan, key)
            if self.graph_error is None:
                self._graph.replay()
                self.replays += 1
                cache.commit_static(plan)
                return self._graph_out.clone()  # the next replay overwrites the graph's output
        logits = self._compute(cache, plan)
        cache.commit_static(plan)
        return logits

    def _write_inputs(self, input_ids: torch.Tensor, cache, position: int) -> None:
        """The token (already on the device), its position and each layer's slot (its length: where the new
        entry goes) into the step's input tensor: one copy from pinned host memory, no torch op per value.

        The copy runs when the stream reaches it, reading the pinned buffer then, so the buffer is rewritten only
        once the last copy has run: a caller that does not read each step's result on the host (which waits for
        the step anyway) could otherwise get the next step's slots and position in this one. The likely cause of
        what the GPU test saw on an H200: steps run back to back without a host read, the graph and the eager
        static step differed from decode step 3 on (not yet rerun on a GPU)."""
        if self._copied is not None:
            self._copied.synchronize()  # done already after the turn loop's token read: no wait there
        self._host_view[0] = position
        self._host_view[1:] = [layer.length for layer in cache.layers]
        self.inputs[:1].copy_(input_ids.reshape(1))
        self.inputs[1:].copy_(self._host, non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def _prepare(self, cache, position: int) -> None:
        """Outside the step: a cos/sin table covering `position`, and each reallocated layer's tail zeroed."""
        self._cos, self._sin = self._rope.ensure(position)
        for index, layer in enumerate(cache.layers):
            if self._clean[index] != layer.storage_version:
                n = layer.length
                for name in ("keys", "values", "key_scales", "value_scales", "projected_keys"):
                    tensor = getattr(layer, name, None)
                    if tensor is not None:
                        tensor[:, n:].zero_()
                self._clean[index] = layer.storage_version
        # a CSA2 fit makes a new side cache (zeros past the length) without a new storage_version: nothing to do

    # ------------------------------------------------------------------ the computation (captured as a graph)
    def _compute(self, cache, plan) -> torch.Tensor:
        w = self.w
        heads, kv_heads, d = w.heads, w.kv_heads, w.head_dim
        qk_heads = heads + kv_heads
        token, position = self.inputs[:1], self.inputs[1:2]
        x = F.embedding(token, w.embed)  # [1, D]
        cos = self._cos.index_select(0, position)[:, None, :]  # [1, 1, d]
        sin = self._sin.index_select(0, position)[:, None, :]
        positions32 = position.to(torch.int32).expand(kv_heads, 1).contiguous()
        rotation = rope_matrix(cos[0, 0], sin[0, 0], self._swap)  # [d, d]
        for index, layer in enumerate(w.layers):
            h = rms_norm(x, layer.input_norm, w.eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias).view(1, qk_heads + kv_heads, d)
            if layer.q_norm is not None:
                qk = torch.cat((rms_norm(qkv[:, :heads], layer.q_norm, w.eps),
                                rms_norm(qkv[:, heads:qk_heads], layer.k_norm, w.eps)), dim=1)
            else:
                qk = qkv[:, :qk_heads]
            qk = torch.matmul(qk, rotation)  # RoPE: one product instead of seven elementwise kernels
            slot = self.inputs[2 + index: 3 + index]
            attn = self._attend(cache.layers[index], plan.layers[index], plan, qk[0, :heads], qk[0, heads:],
                                qkv[0, qk_heads:], slot, positions32)  # [H, d]
            x = residual_linear(x, attn.reshape(1, heads * d).to(x.dtype), layer.o, layer.o_bias)
            h = rms_norm(x, layer.post_norm, w.eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = residual_linear(x, w.act(gate).mul_(up), layer.down)
        x = rms_norm(x, w.final_norm, w.eps)
        return linear(x, w.lm_head, w.lm_head_bias)[0].float()

    def _attend(self, kv, mode, plan, q, k, v, slot, positions32) -> torch.Tensor:
        """One layer: write the new entry at `slot`, attend over the capacity (dense) or the screened entries
        (CSA2), update the scores. q [H, d], k / v [h, d] -> [H, d]."""
        h, d = kv.kv_heads, kv.head_dim
        groups = q.shape[0] // h
        k3, v3 = k[:, None].to(kv.dtype), v[:, None].to(kv.dtype)  # [h, 1, d]
        if kv.int8:
            from ..kernels.quant import quantize_int8

            kq, ks = quantize_int8(k3)
            vq, vs = quantize_int8(v3)
            kv.keys.index_copy_(1, slot, kq)
            kv.key_scales.index_copy_(1, slot, ks)
            kv.values.index_copy_(1, slot, vq)
            kv.value_scales.index_copy_(1, slot, vs)
        else:
            kv.keys.index_copy_(1, slot, k3)
            kv.values.index_copy_(1, slot, v3)
        kv.positions.index_copy_(1, slot, positions32)
        if kv.projected_keys is not None:
            projected = torch.matmul(k3.float(), kv.csa2_basis).to(kv.projected_keys.dtype)
            kv.projected_keys.index_copy_(1, slot, projected)
        capacity = kv.capacity
        entries = self._entries.get(capacity)
        if entries is None:
            entries = self._entries[capacity] = torch.arange(capacity, device=q.device)
        qg = q.reshape(h, groups, d)
        if mode.sparse:
            index = self._screen(kv, mode, plan, qg.float(), slot, entries)
            keys, values = _read_rows(kv, "keys", index), _read_rows(kv, "values", index)
            counts = torch.gather(kv.log_counts, 1, index) if kv.merged_any else None
        else:
            index = None
            keys, values = _read_all(kv, "keys"), _read_all(kv, "values")
            counts = kv.log_counts if kv.merged_any else None
        logits = torch.bmm(qg.to(keys.dtype), keys.transpose(1, 2)).float()  # [h, G, C or K]
        logits.mul_(self.w.scaling)
        if counts is not None:
            logits.add_(counts[:, None, :])
        if index is None:
            logits.masked_fill_((entries > slot)[None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out = torch.bmm(probs.to(values.dtype), values)  # [h, G, d]
        if plan.score:
            scores = kv.scores
            if plan.decay != 1.0:
                scores.mul_(plan.decay)
            if index is None:
                scores.add_(probs.sum(dim=1))
            else:
                scores.scatter_add_(1, index, probs.sum(dim=1))
        return out.reshape(h * groups, d)

    @staticmethod
    def _screen(kv, mode, plan, q, slot, entries) -> torch.Tensor:
        """CSA2 (csa2.screen) over the capacity: screen scores past the sinks and before the recent window, the
        best `pool` re-ranked exactly, the best `k` attended with the sinks and the recent window -> [h, K]."""
        h = kv.kv_heads
        sink, recent = plan.sink, plan.recent
        approx = torch.matmul(torch.matmul(q, kv.csa2_query_basis), kv.projected_keys.float().transpose(1, 2))
        approx = approx.amax(dim=1) + kv.log_counts  # [h, C]
        window_start = slot + 1 - recent  # the first entry of the recent window (the new one is its last)
        approx.masked_fill_(((entries < sink) | (entries >= window_start))[None], float("-inf"))
        top = approx.topk(mode.pool, dim=1, sorted=False).indices
        if mode.pool > mode.k:
            candidates = _read_rows(kv, "keys", top).float()
            exact = torch.matmul(q, candidates.transpose(1, 2)).amax(dim=1) + torch.gather(kv.log_counts, 1, top)
            top = torch.gather(top, 1, exact.topk(mode.k, dim=1, sorted=False).indices)
        recent_index = window_start + torch.arange(recent, device=q.device)
        return torch.cat([entries[:sink].expand(h, -1), top, recent_index.expand(h, -1)], dim=1)

    # ------------------------------------------------------------------ the CUDA graph
    def _key(self, cache, plan) -> tuple:
        """What a captured graph depends on: the addresses and shapes it reads, the per-layer plan, the knobs."""
        parts = [plan.score, plan.decay, plan.sink, plan.recent, self._cos.data_ptr(),
                 self._cos.shape[0]]
        for layer, mode in zip(cache.layers, plan.layers, strict=True):
            parts.append((mode, layer.merged_any, layer.capacity, layer.keys.data_ptr(), layer.values.data_ptr(),
                          layer.positions.data_ptr(), layer.scores.data_ptr(), layer.log_counts.data_ptr(),
                          *(t.data_ptr() if t is not None else 0 for t in (
                              getattr(layer, "key_scales", None) if layer.int8 else None,
                              getattr(layer, "value_scales", None) if layer.int8 else None,
                              layer.projected_keys, layer.csa2_basis, layer.csa2_query_basis))))
        return tuple(parts)

    def _capture(self, cache, plan, key) -> None:
        """Capture _compute as a graph (after one warm-up run on a side stream, which the capture requires; the
        scores it updated are put back, everything else it wrote sits past the lengths and is written again).

        Each capture gets a private memory pool of its own, and the previous graph (with its pool) is released
        first. Reusing one pool id after the graph that held it is gone trips an internal assert of torch's
        caching allocator (`it->second->use_count > 0`, seen with torch 2.11 on an H200 at the second capture)."""
        self._graph = self._graph_out = self._graph_key = None
        saved = [layer.scores.clone() for layer in cache.layers]
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._compute(cache, plan)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._compute(cache, plan)
        except Exception as exc:  # noqa: BLE001 - the eager static step still runs; say why once
            self.graph_error = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("CUDA graph capture failed, decoding without it: %s", self.graph_error)
        else:
            self._graph, self._graph_out, self._graph_key = graph, out, key
            self.captures += 1
        finally:
            for layer, scores in zip(cache.layers, saved, strict=True):
                layer.scores.copy_(scores)

    def describe(self) -> str:
        """One line for the bench and gpucheck: whether graphs run, how often they were captured."""
        if not self.graphs:
            return "static step (no graph)"
        if self.graph_error:
            return f"graph capture failed: {self.graph_error}"
        return f"CUDA graph: {self.captures} capture(s), {self.replays} replay(s)"


def _read_all(kv, name: str) -> torch.Tensor:
    data = getattr(kv, name)
    if not kv.int8:
        return data
    return data.to(kv.dtype) * getattr(kv, name[:-1] + "_scales").to(kv.dtype)


def _read_rows(kv, name: str, index: torch.Tensor) -> torch.Tensor:
    rows = _gather_rows(getattr(kv, name), index)
    if not kv.int8:
        return rows
    return rows.to(kv.dtype) * _gather_rows(getattr(kv, name[:-1] + "_scales"), index).to(kv.dtype)
