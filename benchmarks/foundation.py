"""Load times, and TTFT / decode tok/s of our loop vs transformers `generate` (fp32, bf16, int8, int4).

Same model (the default SmolLM2-135M-Instruct), same prompt, same machine, interleaved repetitions,
medians. The engine runs dense here (kv_cache_ratio=1, csa2_topk=0): this measures the loop, not
the cache. Usage: python -m benchmarks.foundation [--reps 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from engine import Done, DSV41Config, DSV41Model
from engine.loader import convert_gguf, default_gguf_path, resolve_source

from .common import hf_generate_timing, machine, median, write_results

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def load_times() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("DSV41_CACHE_DIR")
        os.environ["DSV41_CACHE_DIR"] = tmp
        try:
            start = time.perf_counter()
            convert_gguf(default_gguf_path())
            first = time.perf_counter() - start
        finally:
            if old is None:
                os.environ.pop("DSV41_CACHE_DIR")
            else:
                os.environ["DSV41_CACHE_DIR"] = old
    resolve_source("default")  # make sure the real cache has it
    start = time.perf_counter()
    DSV41Model.from_pretrained(DSV41Config())
    converted = time.perf_counter() - start
    return {"first_load_conversion_s": first, "converted_load_s": converted}


def engine_timing(model: DSV41Model, new_tokens: int) -> dict:
    session = model.chat_session()
    done = None
    for event in session.send(PROMPT, greedy=True, max_new_tokens=new_tokens, ignore_eos=True,
                              repetition_penalty=1.0):
        if isinstance(event, Done):
            done = event
    s = done.stats
    return {"ttft_s": s.ttft_s, "decode_tok_s": s.decode_tok_s, "tokens": s.decode_tokens, "total_s": s.total_s}


def hf_model(folder, variant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if variant == "bf16":
        kwargs["dtype"] = torch.bfloat16
    elif variant == "int8":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    elif variant == "int4":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", **kwargs).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default="fp32,bf16,int8,int4")
    args = parser.parse_args()
    payload = {"machine": machine(), "prompt": PROMPT, "new_tokens": args.new_tokens, "reps": args.reps}
    payload["load"] = load_times()
    print(payload["load"])
    folder = resolve_source("default").path
    rows = {}
    for variant in args.variants.split(","):
        cfg = DSV41Config(kv_cache_ratio=1.0, csa2_topk=0,
                          dtype="bfloat16" if variant == "bf16" else "auto",
                          weight_quant={"int8": "int8", "int4": "int4"}.get(variant, "none"))
        ours = DSV41Model.from_pretrained(cfg)
        theirs = hf_model(folder, variant)
        ids = ours.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
        engine_runs, hf_runs = [], []
        engine_timing(ours, 8)  # one short warm run each, then interleave
        hf_generate_timing(theirs, ids, 8)
        for _ in range(args.reps):
            engine_runs.append(engine_timing(ours, args.new_tokens))
            hf_runs.append(hf_generate_timing(theirs, ids, args.new_tokens))
        row = {
            "weights_bytes": ours.weights_bytes,
            "engine": {k: median([r[k] for r in engine_runs]) for k in ("ttft_s", "decode_tok_s")},
            "transformers": {k: median([r[k] for r in hf_runs]) for k in ("ttft_s", "decode_tok_s")},
            "engine_runs": engine_runs, "transformers_runs": hf_runs,
        }
        row["decode_ratio"] = row["engine"]["decode_tok_s"] / row["transformers"]["decode_tok_s"]
        row["ttft_ratio"] = row["engine"]["ttft_s"] / row["transformers"]["ttft_s"]
        rows[variant] = row
        print(variant, row["engine"], row["transformers"], f"decode x{row['decode_ratio']:.2f}")
        del ours, theirs
    payload["variants"] = rows
    lines = [
        "| weights | weights MB | TTFT ours (ms) | TTFT transformers (ms) | decode ours (tok/s) | decode transformers (tok/s) | decode ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['weights_bytes'] / 2**20:.0f} | {r['engine']['ttft_s'] * 1000:.0f} | "
                     f"{r['transformers']['ttft_s'] * 1000:.0f} | {r['engine']['decode_tok_s']:.1f} | "
                     f"{r['transformers']['decode_tok_s']:.1f} | ×{r['decode_ratio']:.2f} |")
    load = payload["load"]
    table = (f"First load (GGUF conversion): {load['first_load_conversion_s']:.1f} s; converted load: "
             f"{load['converted_load_s']:.1f} s\n\n" + "\n".join(lines) + "\n")
    folder_out = write_results("foundation", payload, table)
    _plot(rows, folder_out / "foundation.png")
    print(table)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [rows[n]["engine"]["decode_tok_s"] for n in names], 0.4, label="DS-V4.1 engine")
    ax.bar([i + 0.2 for i in x], [rows[n]["transformers"]["decode_tok_s"] for n in names], 0.4,
           label="transformers generate")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("Default model, CPU, 128 greedy tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
