"""Where a follow-up's recall goes, and what cheaper products for its scoring would save (the tiered chat at
hot ratio 0.3, default model, greedy). Two parts:

- in place: tiered chats on `--cases` fact sets (benchmarks/followup_cases.py), each reading its document with
  its first question and then asking the other three; per follow-up, the time in the recall's parts
  (cold.recall_mass: scoring the cold tier against the question's queries, products and softmax;
  ColdLayer.read_keys_to: widening the int8 cold keys; cold.span_ranking; ColdLayer.move_into: moving the
  recalled entries in) summed over the layers, the whole recall (DSV41Cache._recall_layer) and the TTFT;
- the scoring's products alone, on the shapes the last recall of the run had (one layer): float32 as recall_mass
  takes them, bf16 through torch (its conversions included), and int8 (torch._int_mm, where this torch has it)
  straight from the int8 cold keys with the queries quantized per row (quantization and rescaling included),
  each with its largest error against float32 relative to the largest logit. Medians of interleaved rounds.

Writes results/recall-cost/recall-cost.json and .md.

Usage: python -m benchmarks.recall_cost [--words 5900] [--cases 3]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from .common import machine, write_results

PARTS = ("recall", "recall_mass", "read_keys_to", "span_ranking", "move_into")


def in_place(words: int, cases: int) -> tuple[dict, dict]:
    """(medians per follow-up of each part in ms and the TTFT, the shapes of the last recall_mass call)."""
    import engine.cache.cold as cold
    import engine.cache.kv_cache as kv_cache
    from benchmarks.followup_cases import FACT_SETS, document
    from engine import DSV41Config, DSV41Model
    from engine.documents import load_document
    from engine.events import Done

    spent: dict[str, float] = collections.defaultdict(float)
    shapes: dict = {}
    originals = []

    def timed(owner, attribute: str, part: str):
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))

        def wrapper(*args, **kwargs):
            if part == "recall_mass":
                query, hot_keys, cold_keys = args[:3]
                shapes.update(heads=hot_keys.shape[0], rows=query.shape[0] // hot_keys.shape[0] * query.shape[1],
                              dim=hot_keys.shape[2], hot=hot_keys.shape[1], cold=cold_keys.shape[1])
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - started
        setattr(owner, attribute, wrapper)

    timed(kv_cache.DSV41Cache, "_recall_layer", "recall")
    timed(cold, "recall_mass", "recall_mass")
    timed(cold, "span_ranking", "span_ranking")
    timed(cold.ColdLayer, "read_keys_to", "read_keys_to")
    timed(cold.ColdLayer, "move_into", "move_into")
    try:
        model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=0.3, cold_tier="ram",
                                                       conversation_cache_mb=0))

        def ask(session, question, documents=()):
            for event in session.send(question, documents, max_new_tokens=24, greedy=True, repetition_penalty=1.0):
                if isinstance(event, Done):
                    return event

        rows = []
        for name, facts in FACT_SETS[:cases]:
            session = model.chat_session()
            ask(session, facts[0][1], [load_document(str(document(name, facts, words)))])
            for _, question, *_ in facts[1:]:
                spent.clear()
                done = ask(session, question)
                rows.append({"ttft": done.stats.ttft_s * 1e3, **{p: spent[p] * 1e3 for p in PARTS}})
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)
    medians = {key: statistics.median(r[key] for r in rows) for key in ("ttft", *PARTS)}
    return {"follow_ups": len(rows), **medians}, shapes


def products(shapes: dict, rounds: int = 15) -> dict:
    """One layer's scoring products three ways (see the module's docstring)."""
    h, rows, d, c = shapes["heads"], shapes["rows"], shapes["dim"], shapes["cold"]
    torch.manual_seed(0)
    query = torch.randn(h, rows, d) * 0.125
    keys8 = torch.randint(-127, 128, (h, c, d), dtype=torch.int8)
    scales = torch.rand(h, c, 1) * 0.05
    keys_t = keys8.transpose(1, 2).contiguous()  # what an int8 layout for products would store

    def f32():
        return torch.matmul(query, keys8.float().mul_(scales).transpose(1, 2))

    def bf16():
        keys = keys8.float().mul_(scales).to(torch.bfloat16)
        return torch.matmul(query.to(torch.bfloat16), keys.transpose(1, 2)).float()

    def int8():
        step = query.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        q8 = torch.round(query / step).to(torch.int8)
        out = torch.stack([torch._int_mm(q8[i], keys_t[i]) for i in range(h)]).float()
        return out.mul_(step).mul_(scales.transpose(1, 2))

    ways = {"float32": f32, "bf16": bf16}
    if hasattr(torch, "_int_mm"):
        try:
            int8()
            ways["int8"] = int8
        except RuntimeError:
            pass
    reference = f32()
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    flops = 2 * h * rows * c * d
    out = {}
    for name, fn in ways.items():
        ms = statistics.median(times[name]) * 1e3
        error = float((fn() - reference).abs().max() / reference.abs().max())
        out[name] = {"ms": ms, "gflops": flops / ms / 1e6, "max_error_of_largest": error}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=5900)
    parser.add_argument("--cases", type=int, default=3)
    args = parser.parse_args(argv)
    parts, shapes = in_place(args.words, args.cases)
    layer = products(shapes)
    payload = {"machine": machine(), "threads": torch.get_num_threads(), "words": args.words, "in_place": parts,
               "shapes": shapes, "products": layer}
    table = "\n".join([
        f"Follow-ups of a tiered chat at ratio 0.3 on {args.words}-word documents ({parts['follow_ups']} follow-ups), "
        f"{payload['machine']['cpu']}, {payload['threads']} threads; medians per follow-up, summed over the layers.",
        "", "| TTFT | recall | scoring (recall_mass) | widening the int8 keys | span ranking | moving in |",
        "|---|---|---|---|---|---|",
        f"| {parts['ttft']:.0f} ms | {parts['recall']:.0f} ms | {parts['recall_mass']:.0f} ms | "
        f"{parts['read_keys_to']:.1f} ms | {parts['span_ranking']:.1f} ms | {parts['move_into']:.1f} ms |", "",
        f"One layer's scoring products ({shapes['heads']} KV heads, {shapes['rows']} query rows a head, "
        f"{shapes['cold']} cold entries a head, head dim {shapes['dim']}):", "",
        "| products | ms | GFLOP/s | largest error / largest logit |", "|---|---|---|---|",
        *[f"| {name} | {r['ms']:.3f} | {r['gflops']:.0f} | {r['max_error_of_largest']:.1e} |"
          for name, r in layer.items()], ""])
    write_results("recall-cost", payload, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
