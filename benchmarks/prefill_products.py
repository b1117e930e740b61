"""Which products a prefill should multiply in bf16 on this CPU: the default model's time to read a prompt.

The default load prefills in bf16 (adapter.set_prefill_bf16): the attention and the KV cache always, the matrix
products where the CPU has bf16 dot products (kernels.packed.bf16_products_fast: AVX-512 BF16 or AMX; on AVX2
alone torch's bf16 GEMM is a reference path). Three variants of the one loaded model, interleaved, on the same
prompt token ids (a speech's first N tokens, read in 512-token chunks as a chat reads a document):

- "as chosen for this CPU": the default load as it is;
- "bf16 products forced": the products in bf16 whatever the CPU (DSV41_BF16_PRODUCTS=1);
- "float32 prefill": products, attention and the cache in float32 (set_prefill_bf16 off).

Reports the median prefill time of each (--reps runs), and their ratios to the first; the logits of the last
token against the float32 prefill's (largest difference, same argmax). Writes results/prefill-products/
prefill-products.json, .md and .png (or --out).  Usage: python -m benchmarks.prefill_products [--tokens 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from engine import DSV41Config, DSV41Model
from engine.kernels import bf16_products_fast
from engine.models import adapter

from .common import RESULTS, machine
from .corpus import speech

SPEECHES = ("2022-Biden-1", "2023-Biden-1", "2024-Biden-1")
VARIANTS = ("as chosen for this CPU", "bf16 products forced", "float32 prefill")


def _prefill(model: DSV41Model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(seconds to read `ids` in 512-token chunks into a new cache, the last token's logits)."""
    cache = model.new_cache()
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, ids.shape[1], 512):
            logits = adapter.forward(model.hf_model, ids[:, start:start + 512], cache)
    return time.perf_counter() - started, logits[0, -1].float()


def _set(model: DSV41Model, variant: str) -> None:
    hf = model.hf_model
    if variant == "bf16 products forced":
        os.environ["DSV41_BF16_PRODUCTS"] = "1"
    else:
        os.environ.pop("DSV41_BF16_PRODUCTS", None)
    adapter.set_prefill_bf16(hf, variant != "float32 prefill")


def run(tokens: list[int], reps: int) -> dict:
    model = DSV41Model.from_pretrained(DSV41Config(kv_cache_ratio=1.0, csa2_topk=0))
    text = "\n\n".join(speech(name) for name in SPEECHES)
    all_ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    forced = os.environ.get("DSV41_BF16_PRODUCTS")
    out: dict = {"bf16_products_fast": bf16_products_fast(), "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "lengths": {}}
    try:
        for n in tokens:
            ids = all_ids[:, :n]
            seconds: dict = {v: [] for v in VARIANTS}
            logits: dict = {}
            for _ in range(reps):
                for variant in VARIANTS:
                    _set(model, variant)
                    took, logits[variant] = _prefill(model, ids)
                    seconds[variant].append(took)
                    print(f"[{n}] {variant}: {took:.2f} s", flush=True)
            base = statistics.median(seconds[VARIANTS[0]])
            exact = logits["float32 prefill"]
            out["lengths"][n] = {v: {"seconds": statistics.median(s), "runs": s,
                                     "ratio": statistics.median(s) / base,
                                     "max_logit_diff_vs_float32": float((logits[v] - exact).abs().max()),
                                     "same_argmax_as_float32": bool(logits[v].argmax() == exact.argmax())}
                                 for v, s in seconds.items()}
    finally:
        if forced is None:
            os.environ.pop("DSV41_BF16_PRODUCTS", None)
        else:
            os.environ["DSV41_BF16_PRODUCTS"] = forced
        _set(model, VARIANTS[0])
    return out


def table(payload: dict) -> str:
    m = payload["machine"]
    lines = [f"Default model, prefill in 512-token chunks, medians of {payload['reps']} "
             f"({m.get('cpu', '?')}, {payload['threads']} threads, torch CPU capability "
             f"{payload['cpu_capability']}, oneDNN bf16 {'yes' if payload['onednn_bf16'] else 'no'}: "
             f"bf16 products {'on' if payload['bf16_products_fast'] else 'off'} as chosen)\n",
             "| prompt tokens | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for n, row in payload["lengths"].items():
        cells = [f"{row[v]['seconds']:.2f} s (×{row[v]['ratio']:.2f})" for v in VARIANTS]
        lines.append(f"| {int(n):,} | " + " | ".join(cells) + " |")
    lines += ["", "Last token's logits against the float32 prefill's: largest difference (same argmax)\n",
              "| prompt tokens | " + " | ".join(VARIANTS[:2]) + " |", "|---|---|---|"]
    for n, row in payload["lengths"].items():
        cells = [f"{row[v]['max_logit_diff_vs_float32']:.3f} ({'yes' if row[v]['same_argmax_as_float32'] else 'no'})"
                 for v in VARIANTS[:2]]
        lines.append(f"| {int(n):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(payload["lengths"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ax.bar([x + i * width for x in range(len(lengths))],
               [payload["lengths"][n][variant]["seconds"] for n in lengths], width, label=variant)
    ax.set_xticks([x + width for x in range(len(lengths))], [f"{int(n):,} tokens" for n in lengths])
    ax.set_ylabel("prefill seconds (median)")
    ax.set_title(f"Default model prefill, {payload['cpu_capability']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill-products")
    args = parser.parse_args(argv)
    payload = run([int(n) for n in args.tokens.split(",")], args.reps)
    payload.update(machine=machine(), threads=torch.get_num_threads(), reps=args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill-products.json").write_text(json.dumps(payload, indent=2, default=str))
    (args.out / "prefill-products.md").write_text(table(payload))
    plot(payload, args.out / "prefill-products.png")
    print(table(payload))


if __name__ == "__main__":
    main()
