"""Where a follow-up's recall goes, and what its scoring costs per layer (the tiered chat at hot ratio 0.3, default
model, greedy). Three parts:

- in place: tiered chats on `--cases` fact sets (benchmarks/followup_cases.py), each reading its document with
  its first question and then asking the other three; per follow-up, summed over the layers: the scoring
  (cache_ops.recall_mass, one C call per layer from the int8 cold keys as stored: products, softmax over hot and
  cold, mass), the choice (cache_ops.recall_select: span ranking, the best, in position order), moving the
  recalled entries in (ColdLayer.move_into), the whole recall (DSV41Cache._recall_layer), the question's
  attention that follows (cache_ops.question_attention, with the hot logits the recall computed), the TTFT, and
  the reply's counts of the cold tier (DSV41Cache.count_cold, once the first reply token is sampled, before it is
  shown: in the TTFT), and all the cache's work after the question (DSV41Cache.finish_prefill with a reply to follow:
  the reply's compaction, the counts, CSA2's fit);
- one layer's scoring on the shapes the last recall of the run had: the C call against torch's path
  (cold.recall_mass on the int8 keys as stored: the hot products, the cold logits as cold.cold_logits defines
  them, the softmax pass), with how far their masses are apart and whether they recall the same entries, and how
  far the C call is from float32 logits of the widened keys (and whether it recalls what those would);
- one layer's scoring products alone: float32 of the widened keys, bf16 through torch (its conversions
  included), the recall's own (cold.cold_logits: the queries rounded to int16 per row, exact integer products
  with the int8 keys through torch), and int8 (torch._int_mm, where this torch has it) straight from the int8
  cold keys with the queries quantized per row (quantization and rescaling included), each with its largest
  error against float32 relative to the largest logit. Medians of interleaved rounds.

Writes results/<folder>/<folder>.json and .md (results/recall-cost/ by default).

Usage: python -m benchmarks.recall_cost [--words 5900] [--cases 3] [--folder recall-cost]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from .common import machine, write_results

PARTS = ("recall", "scoring", "choice", "move_into", "question_attention", "counts", "before_reply")


def in_place(words: int, cases: int) -> tuple[dict, dict]:
    """(medians per follow-up of each part in ms and the TTFT, the shapes of the last recall_mass call)."""
    import engine.cache.cold as cold
    import engine.cache.kv_cache as kv_cache
    from benchmarks.followup_cases import FACT_SETS, document
    from engine import DSV41Config, DSV41Model
    from engine.documents import load_document
    from engine.events import Done
    from engine.kernels import cache_ops

    spent: dict[str, float] = collections.defaultdict(float)
    shapes: dict = {}
    originals = []

    def timed(owner, attribute: str, part: str):
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))

        def wrapper(*args, **kwargs):
            if part == "scoring":
                query, hot_keys, cold_keys = args[:3]
                shapes.update(heads=hot_keys.shape[0], rows=query.shape[0] // hot_keys.shape[0] * query.shape[1],
                              tq=query.shape[1], dim=hot_keys.shape[2], hot=hot_keys.shape[1], cold=cold_keys.shape[1])
            if part == "before_reply" and not kwargs.get("answer_follows"):
                return original(*args, **kwargs)  # the compaction after the reply (finish_turn): between turns
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - started
        setattr(owner, attribute, wrapper)

    timed(kv_cache.DSV41Cache, "_recall_layer", "recall")
    timed(cache_ops, "recall_mass", "scoring")
    timed(cache_ops, "recall_select", "choice")
    timed(cold.ColdLayer, "move_into", "move_into")
    timed(cache_ops, "question_attention", "question_attention")
    timed(kv_cache.DSV41Cache, "count_cold", "counts")
    timed(kv_cache.DSV41Cache, "finish_prefill", "before_reply")
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


def scoring(shapes: dict, rounds: int = 15) -> dict:
    """One layer's scoring: the C call (cache_ops.recall_mass from the int8 keys) against torch's path (see the
    module's docstring), on random queries and keys of the run's shapes, and how far both are from the masses of
    float32 logits of the widened keys; None where the kernels do not apply."""
    from engine.cache.cold import RECALL_MIN, recall_mass
    from engine.kernels import cache_ops
    from engine.kernels.quant import quantize_int8

    h, rows, d, s, c = shapes["heads"], shapes["rows"], shapes["dim"], shapes["hot"], shapes["cold"]
    tq = shapes.get("tq", rows)
    torch.manual_seed(0)
    query = torch.randn(h * rows // tq, tq, d)
    hot = torch.randn(h, s, d).to(torch.bfloat16)
    keys8, scales = quantize_int8(torch.randn(h, c, d))
    scaling = d**-0.5

    def torch_path():
        return recall_mass(query, hot, keys8, None, scaling, scales)

    def float32_logits():
        return recall_mass(query, hot, keys8.float().mul_(scales), None, scaling)

    def c_call():
        return cache_ops.recall_mass(query, hot, keys8, scales, None, scaling)

    if c_call() is None:
        return None
    times = {"torch": [], "C": []}
    for _ in range(rounds):
        for name, fn in (("torch", torch_path), ("C", c_call)):
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    want, got, reference = torch_path(), c_call(), float32_logits()
    take = min(c, RECALL_MIN)

    def same(a, b):
        return float(sum(len(set(x.tolist()) & set(y.tolist())) for x, y in
                         zip(a.topk(take, dim=1).indices, b.topk(take, dim=1).indices, strict=True)) / (h * take))

    return {"torch_ms": statistics.median(times["torch"]) * 1e3, "c_ms": statistics.median(times["C"]) * 1e3,
            "max_difference_of_largest": float((got - want).abs().max() / want.abs().max()),
            "same_recalled_share": same(want, got), "recalled": take,
            "float32_max_difference_of_largest": float((got - reference).abs().max() / reference.abs().max()),
            "float32_same_recalled_share": same(reference, got)}


def products(shapes: dict, rounds: int = 15) -> dict:
    """One layer's scoring products four ways (see the module's docstring)."""
    from engine.cache.cold import cold_logits

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

    def int16():  # what the recall computes (cold.cold_logits: exact integer products, one rounding)
        return cold_logits(query, keys8, scales)

    def int8():
        step = query.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        q8 = torch.round(query / step).to(torch.int8)
        out = torch.stack([torch._int_mm(q8[i], keys_t[i]) for i in range(h)]).float()
        return out.mul_(step).mul_(scales.transpose(1, 2))

    ways = {"float32": f32, "bf16": bf16, "int16 rows (the recall's)": int16}
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
    parser.add_argument("--folder", default="recall-cost", help="results/<folder>/ (e.g. recall-cost-2k for --words 1280)")
    args = parser.parse_args(argv)
    parts, shapes = in_place(args.words, args.cases)
    whole = scoring(shapes)
    layer = products(shapes)
    payload = {"machine": machine(), "threads": torch.get_num_threads(), "words": args.words, "in_place": parts,
               "shapes": shapes, "scoring": whole, "products": layer}
    table = "\n".join([
        f"Follow-ups of a tiered chat at ratio 0.3 on {args.words}-word documents ({parts['follow_ups']} follow-ups), "
        f"{payload['machine']['cpu']}, {payload['threads']} threads; medians per follow-up, summed over the layers.",
        "", "| TTFT | recall | scoring | choice | moving in | the question's attention after it "
        "| the reply's counts of the cold tier (in the TTFT) | all the work after the question, in the TTFT "
        "(its compaction, the counts, CSA2's fit) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {parts['ttft']:.0f} ms | {parts['recall']:.0f} ms | {parts['scoring']:.0f} ms | "
        f"{parts['choice']:.1f} ms | {parts['move_into']:.1f} ms | {parts['question_attention']:.0f} ms "
        f"| {parts['counts']:.0f} ms | {parts['before_reply']:.0f} ms |", "",
        f"One layer's scoring ({shapes['heads']} KV heads, {shapes['rows']} query rows a head, {shapes['hot']} hot and "
        f"{shapes['cold']} cold entries a head, head dim {shapes['dim']}):", "",
        *(["| torch (int16 rows x int8 keys as cold_logits, softmax pass) | one C call | largest difference / "
           "largest mass | same entries recalled | against float32 logits of the widened keys: difference, same "
           "entries |", "|---|---|---|---|---|",
           f"| {whole['torch_ms']:.3f} ms | {whole['c_ms']:.3f} ms | {whole['max_difference_of_largest']:.1e} | "
           f"{whole['same_recalled_share']:.1%} of {whole['recalled']} | "
           f"{whole['float32_max_difference_of_largest']:.1e}, {whole['float32_same_recalled_share']:.1%} |", ""]
          if whole else
          ["(no CPU kernels here: torch's path only)", ""]),
        "Its products alone, through torch:", "",
        "| products | ms | GFLOP/s | largest error / largest logit |", "|---|---|---|---|",
        *[f"| {name} | {r['ms']:.3f} | {r['gflops']:.0f} | {r['max_error_of_largest']:.1e} |"
          for name, r in layer.items()], ""])
    write_results(args.folder, payload, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
