"""Follow-up to the long-document table: does CSA2's top-k lose planted facts in an 8k-token speech?

Four cases (2023-Biden-1, facts at depths 10/25/50/75 %), the question after the document, greedy answer
checked for the planted word, per (label, kv_cache_ratio, csa2_topk, screening re-rank). Writes
results/long-topk/long-topk.json and .md.

Usage: python -m benchmarks.long_topk [--configs unc/1.0/0/3,ced/0.5/256/3,...]
"""

from __future__ import annotations

import argparse
import time

from engine import DSV41Config, DSV41Model
from engine.cache import csa2

from .common import machine, write_results
from .corpus import speech
from .quality import FACTS, plant, retrieval_case

DEFAULT_CONFIGS = ("uncompressed/1.0/0/3,uncompressed/1.0/256/3,ced-evict/0.5/256/3,ced-evict/0.5/0/3,"
                   "ced-evict/0.5/512/3,ced-evict/0.3/256/3,ced-evict/0.5/256/4,ced-evict/0.5/256/6,"
                   "ced-evict/0.5/256/16")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="label/ratio/topk/rerank, comma-separated")
    parser.add_argument("--length", type=int, default=8000)
    args = parser.parse_args(argv)
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=1 << 15))
    tok = model.tokenizer
    ids = tok(speech("2023-Biden-1"), add_special_tokens=False)["input_ids"]
    depths = [0.25, 0.75, 0.5, 0.1]
    cases = []
    for d_i, depth in enumerate(depths):
        city, word = FACTS[(d_i + args.length // 1000) % len(FACTS)]
        cases.append((depth, city, word, plant(ids[: args.length], tok, depth, city, word)))
    default_rerank = csa2.screen.__defaults__
    rows = []
    try:
        for spec in args.configs.split(","):
            label, ratio, topk, rerank = spec.split("/")
            csa2.screen.__defaults__ = (int(rerank),)  # candidates re-ranked exactly, as a multiple of top-k
            model.config = model.config.replace(kv_cache_ratio=float(ratio), ced_policy="ced", ced_mode="evict",
                                                csa2_topk=int(topk), ced_threshold=0.1)
            started = time.perf_counter()
            hits = [retrieval_case(model, doc, city, word, None) for _, city, word, doc in cases]
            rows.append({"label": label, "ratio": float(ratio), "csa2_topk": int(topk), "rerank": int(rerank),
                         "hits": hits, "seconds": time.perf_counter() - started})
            print(f"{spec}: {hits}", flush=True)
    finally:
        csa2.screen.__defaults__ = default_rerank
    table = [f"Planted facts in a {args.length}-token speech (2023-Biden-1), depths "
             + " / ".join(f"{d:.0%}" for d in depths) + "\n",
             "| config | ratio | csa2_topk | re-rank | found |", "|---|---|---|---|---|"]
    for r in rows:
        marks = " ".join("✓" if h else "✗" for h in r["hits"])
        table.append(f"| {r['label']} | {r['ratio']} | {r['csa2_topk'] or 'dense'} | {r['rerank']}× | "
                     f"{sum(r['hits'])}/{len(r['hits'])} ({marks}) |")
    md = "\n".join(table) + "\n"
    write_results("long-topk", {"machine": machine(), "length": args.length, "depths": depths, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
