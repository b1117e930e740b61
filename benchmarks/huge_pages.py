"""The default model's decode step with its weights on huge pages (as loaded: engine/kernels/huge_pages.py) against
the same bytes on 4 KiB pages, in one process.

A second fused step is built over copies of every weight storage in ordinary memory (what PyTorch allocates: 4 KiB
pages where transparent huge pages are "madvise"), the same kernels. Then, taking turns with the order alternating:
the step's products alone (dsv41_step_matrices) and a read of the same bytes (dsv41_step_read), one call each a
round for `--seconds`, and whole decode steps at each context, the two steps taking turns token by token within
decode turns (greedy, the end of text ignored; each C call timed). Ratios are 4 KiB over huge pages (above 1: huge
pages faster). 2 threads.

Usage: python -m benchmarks.huge_pages [--seconds 40] [--contexts 128,1024] [--rounds 8] [--new-tokens 64]
       [--folder huge-pages]
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from .common import machine, write_results
from .gguf_llamacpp import THREADS, prompts


def smaps_huge_kb() -> int:
    """This process's AnonHugePages (kB)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@torch.inference_mode()
def small_pages_step(decoder):
    """A FusedDecodeStep over copies of the decoder's weight storages in ordinary memory (kept by the step)."""
    from engine.kernels import huge_pages
    from engine.kernels.fused import FusedDecodeStep

    tensors = huge_pages.weight_tensors(decoder.w)
    saved = [(t, t.untyped_storage(), t.storage_offset(), t.size(), t.stride()) for t in tensors]
    copies: dict[int, torch.Tensor] = {}
    try:
        for t, s, offset, size, stride in saved:
            if s.data_ptr() not in copies:
                c = torch.empty(s.nbytes(), dtype=torch.uint8)
                c.copy_(torch.empty(0, dtype=torch.uint8).set_(s))
                copies[s.data_ptr()] = c
            t.set_(copies[s.data_ptr()].untyped_storage(), offset, size, stride)
        step = FusedDecodeStep(decoder.w, decoder.fused.library)
        step._keep.extend(copies.values())
    finally:
        for t, s, offset, size, stride in saved:
            t.set_(s, offset, size, stride)
    return step


class Alternating:
    """Stands in for the decoder's fused step: each token's step by the next of `steps` in turn, its call timed."""

    def __init__(self, steps: dict):
        self.steps, self.names = steps, list(steps)
        self.seconds: dict[str, list[float]] = {name: [] for name in steps}
        self.calls = 0

    def step(self, *args, **kwargs):
        name = self.names[self.calls % len(self.names)]
        self.calls += 1
        started = time.perf_counter()
        out = self.steps[name].step(*args, **kwargs)
        self.seconds[name].append(time.perf_counter() - started)
        return out

    def __getattr__(self, attr):
        return getattr(self.steps[self.names[0]], attr)


def alternate(model, decoder, steps: dict, ids: list[int], question: int, rounds: int, new_tokens: int) -> dict:
    """`rounds` decode turns with the fused steps of `steps` taking turns token by token (Alternating): each C call's
    seconds by name. decoder.fused is put back as it was."""
    from .speed.core import engine_turn

    before, alternating = decoder.fused, Alternating(steps)
    decoder.fused = alternating
    try:
        for _ in range(rounds):
            engine_turn(model, ids, question, new_tokens)
    finally:
        decoder.fused = before
    return alternating.seconds


def timed_calls(step) -> dict:
    lib, model = step._lib, step._model
    work = torch.full((lib.dsv41_step_work_floats(ctypes.byref(model), 1),), 0.01)
    logits = torch.empty(step.vocab)
    products = (ctypes.byref(model), step._layers, logits.data_ptr(), work.data_ptr(), THREADS)
    read = step.read_args()
    return {"products": (lib.dsv41_step_matrices, products, work, logits), "read": (lib.dsv41_step_read, read)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.huge_pages", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--folder", default="huge-pages")
    args = parser.parse_args(argv)

    from engine import DSV41Config, DSV41Model
    from engine.kernels import huge_pages
    from engine.models.adapter import runtime

    from .speed.core import engine_turn

    if not huge_pages.enabled() or huge_pages.system_setting() != "madvise":
        raise SystemExit("needs Linux with transparent huge pages set to madvise (where ordinary memory gets 4 KiB "
                         "pages) and DSV41_HUGE_PAGES not 0")
    torch.set_num_threads(THREADS)
    model = DSV41Model.from_pretrained(DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=1.0,
                                                   csa2_topk=0))
    decoder = runtime(model.hf_model).decoder
    huge_kb = smaps_huge_kb()
    steps = {"huge": decoder.fused, "4k": small_pages_step(decoder)}
    calls = {name: timed_calls(step) for name, step in steps.items()}
    times = {(name, kind): [] for name in steps for kind in ("products", "read")}
    end, round_ = time.perf_counter() + args.seconds, 0
    while time.perf_counter() < end:
        for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
            for kind in ("products", "read"):
                fn, fargs = calls[name][kind][:2]
                started = time.perf_counter()
                fn(*fargs)
                times[(name, kind)].append(time.perf_counter() - started)
        round_ += 1
    alone = {}
    for kind in ("products", "read"):
        ratios = [a / b for a, b in zip(times[("4k", kind)], times[("huge", kind)], strict=True)]
        alone[kind] = {"huge_ms": 1e3 * statistics.median(times[("huge", kind)]),
                       "small_ms": 1e3 * statistics.median(times[("4k", kind)]),
                       "ratio_median": statistics.median(ratios)}
    rows = []
    for context in (int(c) for c in args.contexts.split(",") if c):
        ids, question = prompts(context)
        engine_turn(model, ids[:32], 16, 8)
        seconds = alternate(model, decoder, steps, ids, question, args.rounds, args.new_tokens)
        pairs = list(zip(seconds["huge"], seconds["4k"], strict=False))  # (an odd count: one unpaired)
        rows.append({"prompt_tokens": len(ids), "steps": len(pairs),
                     "huge_ms": 1e3 * statistics.median(seconds["huge"]),
                     "small_ms": 1e3 * statistics.median(seconds["4k"]),
                     "ratio_median": statistics.median(small / huge for huge, small in pairs)})
    m = machine()
    lines = [f"Default model (GGUF blocks), {m['cpu']}, {THREADS} threads: the weights on huge pages (as loaded; "
             f"{huge_kb / 1024:.0f} MiB of AnonHugePages) against copies on 4 KiB pages, in one process", "",
             f"The step's products alone and a read of their bytes, taking turns for {args.seconds:.0f} s "
             f"({round_} rounds):", "",
             "| call | huge pages | 4 KiB pages | 4 KiB / huge, median of paired rounds |", "|---|---|---|---|"]
    for kind, a in alone.items():
        lines.append(f"| {kind} | {a['huge_ms']:.3f} ms | {a['small_ms']:.3f} ms | ×{a['ratio_median']:.3f} |")
    if rows:
        lines += ["", f"Whole decode steps (the fused C call, attention included), the two taking turns token by token "
                  f"in {args.rounds} turns of {args.new_tokens} new tokens (greedy):", "",
                  "| prompt tokens | steps paired | huge pages | 4 KiB pages | 4 KiB / huge, median of pairs |",
                  "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['prompt_tokens']:,} | {r['steps']} | {r['huge_ms']:.3f} ms | {r['small_ms']:.3f} ms | "
                         f"×{r['ratio_median']:.3f} |")
    table = "\n".join(lines) + "\n"
    write_results(args.folder, {"machine": m, "threads": THREADS, "anon_huge_kb": huge_kb, "seconds": args.seconds,
                                "rounds": round_, "alone": alone, "turns": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
