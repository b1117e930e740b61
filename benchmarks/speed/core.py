"""Measuring tools shared by the benchmark sections: memory bandwidth, peak memory, transformers
`generate` timing and our engine's turn timing on the same token ids (machine facts: benchmarks/common.py)."""

from __future__ import annotations

import statistics
import threading
import time

import psutil
import torch

from engine.events import Done
from engine.generate import TurnPlan, TurnResult, run_turn
from engine.models import adapter
from engine.sampling import GenerationSettings


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------- bandwidth
def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5, buffers: int = 3) -> dict:
    """Memory read bandwidth in bytes/s: the best of a reduction and a matrix-vector product over a
    buffer far larger than the caches (what a decode step does with the weights), over `buffers` freshly allocated
    buffers (on a shared 2-core VM one 1 GiB buffer read at 34 GB/s and the next at 55: where a buffer's pages land
    matters as much as the loop)."""
    n = nbytes // 4
    results: dict[str, float] = {}
    for _ in range(buffers):
        buf = torch.ones(n, dtype=torch.float32, device=device)
        mat = buf.view(-1, 4096)
        vec = torch.ones(4096, dtype=torch.float32, device=device)
        for name, fn in (("sum", lambda b=buf: b.sum()), ("mv", lambda m=mat, v=vec: torch.mv(m, v))):
            fn()
            sync(device)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - start)
            results[name] = max(results.get(name, 0.0), nbytes / min(times))
        del buf, mat, fn
    return {"bytes_per_s": max(results.values()), "by_kernel": results, "buffer_bytes": nbytes}


def matvec_ceiling(hf_model, reps: int = 5) -> dict:
    """The kernel ceiling: time of one matrix-vector product with every weight matrix of the model
    (what a decode step cannot avoid), with nothing else; as bytes/s and as a fraction of `bw`."""
    from engine.kernels import KernelMatrix
    from engine.models.decoder import linear

    device = next(hf_model.parameters()).device
    unique = adapter.step_matrices(hf_model)  # our decoder's (fused, packed) matrices when it runs
    decoder = adapter.runtime(hf_model).decoder
    if decoder is not None and decoder.fused is not None:  # the fused C step's products, from C (no Python between)
        seconds = decoder.fused.matrices_seconds(max(reps, 11))
        nbytes = sum(m.nbytes if isinstance(m, KernelMatrix) else m.numel() * m.element_size() for m in unique)
        return {"seconds": seconds, "bytes": nbytes, "bytes_per_s": nbytes / seconds, "from": "fused step (C)"}
    if unique is None:
        mats = [p for p in hf_model.parameters() if p.dim() == 2 and p.dtype.is_floating_point]
        seen, unique = set(), []
        for m in mats:
            if (m.data_ptr(), m.shape) not in seen:
                seen.add((m.data_ptr(), m.shape))
                unique.append(m)
    dtype = adapter.compute_dtype(hf_model)
    xs = {m.shape[1]: torch.ones(1, m.shape[1], dtype=dtype, device=device) for m in unique}
    with torch.inference_mode():
        for m in unique:
            linear(xs[m.shape[1]], m)
        sync(device)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for m in unique:
                linear(xs[m.shape[1]], m)
            sync(device)
            times.append(time.perf_counter() - start)
    nbytes = sum(m.nbytes if isinstance(m, KernelMatrix) else m.numel() * m.element_size() for m in unique)
    return {"seconds": statistics.median(times), "bytes": nbytes, "bytes_per_s": nbytes / statistics.median(times)}


def weight_read_bytes(hf_model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input embedding
    (a step reads one row of it)."""
    embed = hf_model.get_input_embeddings().weight
    out = hf_model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    total = 0
    for p in hf_model.parameters():
        if p is embed and not tied:
            continue
        total += p.numel() * p.element_size()
    for b in hf_model.buffers():  # bitsandbytes keeps quantization state in buffers/attributes
        if b.dim() >= 2:
            total += b.numel() * b.element_size()
    return total


# --------------------------------------------------------------------------------------------- peak memory
_M_MMAP_THRESHOLD = -3
_SMALL_THRESHOLD = 128 * 1024
_TIMING_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its dynamic threshold
_libc = None


def _mallopt_threshold(nbytes: int) -> bool:
    global _libc
    try:
        import ctypes

        _libc = _libc or ctypes.CDLL("libc.so.6")
        return _libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1
    except (OSError, AttributeError):
        return False


def timing_allocator() -> bool:
    """Pin glibc's mmap threshold where its dynamic rule ends up after warm-up (32 MiB), so runs before
    and after a memory measurement allocate alike."""
    return _mallopt_threshold(_TIMING_THRESHOLD)


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak, or process RSS sampled every 2 ms on CPU.

    On CPU (glibc) the run is made with every allocation of 128 KiB or more as its own mapping, returned
    when freed, and the free heap trimmed at entry, so RSS follows live tensor memory (otherwise memory
    freed by one run is silently reused by the next and its peak reads as zero). That slows allocation-
    heavy code, so the benchmark measures memory in a run of its own, never in a timed one."""

    def __init__(self, device: torch.device):
        self.device = device
        self.exact = False
        self.peak_extra = 0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self.exact = _mallopt_threshold(_SMALL_THRESHOLD)
            if self.exact:
                _libc.malloc_trim(0)
            self._proc = psutil.Process()
            self._base = self._proc.memory_info().rss
            self._peak = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            self._stop.wait(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_extra = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, self._proc.memory_info().rss)
            self.peak_extra = self._peak - self._base
            if self.exact:
                timing_allocator()
        return False


class _NoPeak:
    peak_extra = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------------------------- transformers
class _TimingStreamer:
    """Timestamps every generated token (the first put() is the prompt)."""

    def __init__(self, device):
        self.device = device
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def kv_bytes_of(past) -> int:
    """Bytes held by a transformers cache object (whatever its layout)."""
    total = 0
    seen = set()

    def visit(obj, depth=0):
        nonlocal total
        if depth > 4 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item, depth + 1)

    visit(getattr(past, "layers", past))
    return total


def hf_generate(model, ids: list[int], new_tokens: int, *, memory: bool = False) -> dict:
    """TTFT, decode tok/s and KV bytes of plain transformers `generate` (greedy); peak memory when `memory`."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    streamer = _TimingStreamer(device)
    with (PeakMemory(device) if memory else _NoPeak()) as peak, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                             pad_token_id=model.config.eos_token_id, return_dict_in_generate=True)
        sync(device)
        end = time.perf_counter()
    times = streamer.times
    kv = kv_bytes_of(out.past_key_values)
    context = len(ids) + new_tokens / 2  # mean context a decode step attends to
    return {
        "ttft_s": times[0] - start,
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
        "tokens": len(times), "total_s": end - start, "peak_extra_bytes": peak.peak_extra,
        "kv_bytes": kv, "kv_uncompressed_bytes": kv,
        "kv_read_per_token": kv / (len(ids) + new_tokens) * context if kv else 0,
    }


# --------------------------------------------------------------------------------------------- our engine
def kv_read_per_step(cache) -> int:
    """KV bytes one decode step reads from this cache: every stored entry when dense; with CSA2 the
    projected keys of all entries, the keys of the re-ranked candidates, and K/V of the sinks, top-k
    and recent entries."""
    from engine.cache import csa2

    s = cache.settings
    total = 0
    per_entry = cache.kv_heads * cache.head_dim * 2 * (1 if s.kv_int8 else cache.kv_bytes_per_element)
    for layer in cache.layers:
        if cache._sparse_ready(layer):
            protected = min(layer.length, s.ced_sink_tokens + s.ced_recent_tokens)
            attended = min(layer.length, s.csa2_topk + protected)
            reranked = min(csa2.RERANK * s.csa2_topk, layer.length - protected)  # their keys only
            proj = layer.projected_keys
            total += (layer.length * cache.kv_heads * proj.shape[-1] * proj.element_size() + attended * per_entry
                      + reranked * per_entry // 2)
        else:
            total += layer.length * per_entry
    return total


def turn_settings(new_tokens: int, seed: int | None = None) -> GenerationSettings:
    """A benchmark turn's sampling, EOS ignored: greedy; with `seed`, the app's default sampling instead
    (temperature, top-k, top-p, repetition penalty: GenerationSettings' defaults)."""
    if seed is None:
        return GenerationSettings(max_new_tokens=new_tokens, greedy=True, ignore_eos=True, repetition_penalty=1.0)
    return GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True, seed=seed)


def engine_turn(model, ids: list[int], question_tokens: int, new_tokens: int, *, memory: bool = False,
                seed: int | None = None) -> dict:
    """One turn of our engine on exactly these token ids (the path ChatSession.send takes), with
    turn_settings(new_tokens, seed)."""
    settings = turn_settings(new_tokens, seed)
    result = TurnResult([], 0, 0, False)
    done = None
    with PeakMemory(model.device) if memory else _NoPeak() as peak:  # the cache's allocation counts too
        cache = model.new_cache()
        plan = TurnPlan(list(ids), question_tokens, model.prefill_chunk, model.headroom_tokens(cache),
                        model.context_limit)
        for event in run_turn(model.hf_model, model.tokenizer, cache, plan, settings, eos_ids=model.eos_ids,
                              result=result):
            if isinstance(event, Done):
                done = event
    if done is None or done.reason == "error":
        raise RuntimeError(f"engine turn failed: {done}")
    s = done.stats
    return {
        "ttft_s": s.ttft_s, "decode_tok_s": s.decode_tok_s or None, "tokens": s.decode_tokens,
        "generated": list(result.generated),
        "total_s": s.total_s, "peak_extra_bytes": peak.peak_extra, "kv_bytes": s.kv_stored_bytes,
        "kv_uncompressed_bytes": s.kv_uncompressed_bytes, "kv_read_per_token": kv_read_per_step(cache),
        "compaction_s": s.compaction_s, "csa2_recall": s.csa2_recall,
        "fast_decoder": adapter.uses_fast_decoder(model.hf_model),
    }
