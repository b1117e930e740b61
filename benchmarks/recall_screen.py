"""How a question's recall should score the cold tier: exact products, or CSA2's rank-r screen first.

A recall (engine/cache/cold.py, recall_layer) ranks every cold entry by the attention the question's queries would
give it in one softmax over hot and cold keys, then brings the best spans back. The products behind that softmax
can be exact (what ships: the int8 cold keys widened, two matrix products per layer) or screened the way CSA2
screens a decode step: the keys projected to rank r with the bilinear fit of engine/cache/csa2.py (the layer's
query and key second moments), which the cold tier would store beside its int8 keys (r float32 a head and entry),
followed by an exact re-rank of the best RERANK x take candidates.

This runs the follow-up benchmark's cases as a chat does (tiered CED at `--ratio`, greedy): the first question
reads the document, and during each follow-up's recall the inputs of every layer's recall are kept. Each is then
ranked three ways, timed (median of `--repeat`), and compared with the exact ranking by the share of the entries
it recalls that the exact recall also recalls (1.0: the same spans come back):
  exact            widened keys, both products exact (the shipped path, recall_mass)
  screen           rank-r products for hot and cold (the projected keys precomputed, as a stored side cache)
  screen + rerank  the exact hot product, rank-r cold products, the best RERANK x take cold candidates re-scored
                   exactly and the softmax taken over the hot entries and those candidates

Usage: python -m benchmarks.recall_screen [--words 2900] [--ratio 0.3] [--rank 8] [--cases 4]
       [--out results/recall-screen]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import DSV41Config, DSV41Model
from engine.cache import kv_cache
from engine.cache.cold import RECALL_MIN, RECALL_SHARE, recall_mass
from engine.cache.csa2 import RERANK, bases
from engine.cache.policies.ced import span_ranking
from engine.documents import load_document
from engine.kernels import cache_ops

from .common import RESULTS, machine
from .followup_cases import FACT_SETS, document, orders
from .followups import ask


def capture(model: DSV41Model, cases, ratio: float) -> list[dict]:
    """Every layer's recall inputs during the follow-ups of `cases` (tiered CED at `ratio`)."""
    kept: list[dict] = []
    state = {"on": False}
    original = kv_cache.recall_layer

    def recording(layer, cold, question, scaling, budget, spans, **kwargs):
        if state["on"] and cold.length:
            n = layer.length
            kept.append({
                "question": question.detach().float().clone(), "hot": layer.read_keys()[:, :n].float().clone(),
                "cold": cold.keys[:, : cold.length].clone(),
                "cold_scales": None if cold.key_scales is None else cold.key_scales[:, : cold.length].clone(),
                "positions": cold.positions[:, : cold.length].clone(),
                "log_counts": layer.log_counts[:, :n].float().clone() if layer.merged_any else None,
                "moment": layer.query_moment / layer.query_count if layer.query_count else None,
                "scaling": scaling, "take": min(cold.length, max(int(budget * RECALL_SHARE), RECALL_MIN)),
                "spans": spans})
        return original(layer, cold, question, scaling, budget, spans, **kwargs)

    kv_cache.recall_layer = recording
    try:
        model.config = model.config.replace(kv_cache_ratio=ratio, cold_tier="ram", ced_policy="ced")
        for path, facts, order in cases:
            session = model.chat_session()
            for index, fact in enumerate(order):
                state["on"] = index > 0
                ask(session, facts[fact][1], [load_document(str(path))] if index == 0 else [])
            state["on"] = False
    finally:
        kv_cache.recall_layer = original
    return kept


def _softmax_mass(hot_logits, cold_logits, log_counts, tq):
    mass = cache_ops.recall_softmax(hot_logits, cold_logits, log_counts, tq)
    if mass is None:
        raise SystemExit("this benchmark needs the project's C kernels (python -m engine doctor says why not)")
    return mass


def chosen(mass: torch.Tensor, positions: torch.Tensor, spans: int, take: int) -> torch.Tensor:
    rank = span_ranking(mass, positions, spans) if spans > 1 else mass
    return rank.topk(take, dim=1).indices


def rank_ways(rec: dict, rank: int, repeat: int) -> dict:
    q, hot, stored, scales, positions = rec["question"], rec["hot"], rec["cold"], rec["cold_scales"], rec["positions"]

    def widen(keys, key_scales):  # as ColdLayer.read_keys gives them: int8 times its scale, in float32
        return keys.float().mul_(key_scales) if key_scales is not None else keys.float()

    cold = widen(stored, scales)
    h, tq, take, spans = hot.shape[0], q.shape[1], rec["take"], rec["spans"]
    lc = None if rec["log_counts"] is None else rec["log_counts"].contiguous()
    qs = q.reshape(h, -1, q.shape[-1]) * rec["scaling"]
    query_basis, key_basis = bases(hot, rec["moment"], rank)  # CSA2's fit (engine.cache.csa2.fit)
    hot_proj, cold_proj = torch.matmul(hot, key_basis), torch.matmul(cold, key_basis)  # the stored side caches
    pool = min(cold.shape[1], RERANK * take)

    def exact():  # the shipped path: every cold key widened, then both exact products
        return recall_mass(q, hot, widen(stored, scales), lc, rec["scaling"])

    def screen():
        qp = torch.matmul(qs, query_basis)
        return _softmax_mass(torch.matmul(qp, hot_proj.transpose(1, 2)).contiguous(),
                             torch.matmul(qp, cold_proj.transpose(1, 2)).contiguous(), lc, tq)

    def screen_rerank():
        qp = torch.matmul(qs, query_basis)
        approx = torch.matmul(qp, cold_proj.transpose(1, 2)).amax(dim=1)
        cand = approx.topk(pool, dim=1, sorted=False).indices
        rows = cand[:, :, None].expand(-1, -1, stored.shape[2])
        keys = widen(torch.gather(stored, 1, rows), None if scales is None else torch.gather(scales, 1, cand[:, :, None]))
        mass = _softmax_mass(torch.matmul(qs, hot.transpose(1, 2)).contiguous(),
                             torch.matmul(qs, keys.transpose(1, 2)).contiguous(), lc, tq)
        full = torch.zeros(h, cold.shape[1])
        full.scatter_(1, cand, mass)
        return full

    out = {}
    truth = None
    for name, fn in (("exact", exact), ("screen", screen), ("screen + rerank", screen_rerank)):
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            mass = fn()
            times.append(time.perf_counter() - started)
        picked = chosen(mass, positions, spans, take)
        if truth is None:
            truth = picked
        same = (picked[:, :, None] == truth[:, None, :]).any(dim=-1).float().mean().item()
        out[name] = {"ms": statistics.median(times) * 1000, "same_as_exact": same}
    out["cold_entries"], out["hot_entries"], out["take"] = cold.shape[1], hot.shape[1], take
    return out


def summary(rows: list[dict]) -> dict:
    names = ("exact", "screen", "screen + rerank")
    return {n: {"ms_per_layer": statistics.median(r[n]["ms"] for r in rows),
                "same_as_exact": statistics.mean(r[n]["same_as_exact"] for r in rows)} for n in names}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recall_screen")
    parser.add_argument("--words", type=int, default=2900, help="words of speech per document (2900: ~3.8k tokens)")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--rank", type=int, default=8, help="the screen's rank (CSA2's default: head_dim / 8)")
    parser.add_argument("--cases", type=int, default=4, help="cases of the follow-up benchmark to run (of 12)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "recall-screen"))
    args = parser.parse_args(argv)
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=1.0, conversation_cache_mb=0))
    cases = [(document(name, facts, args.words), facts, order) for name, facts in FACT_SETS
             for order in orders(facts)][: args.cases]
    records = capture(model, cases, args.ratio)
    if not records:
        raise SystemExit("no recall happened (is the document longer than the hot budget?)")
    rows = [rank_ways(rec, args.rank, args.repeat) for rec in records]
    per = summary(rows)
    payload = {"machine": machine(), "words": args.words, "ratio": args.ratio, "rank": args.rank,
               "rerank": RERANK, "recalls": len(rows), "summary": per, "rows": rows,
               "cold_entries_median": statistics.median(r["cold_entries"] for r in rows),
               "hot_entries_median": statistics.median(r["hot_entries"] for r in rows),
               "take_median": statistics.median(r["take"] for r in rows)}
    d = records[0]["hot"].shape[2]
    # an int8 cold entry per head: key and value bytes, their two float32 scales, position and score
    extra = payload["screen_extra_share"] = args.rank * 4 / (2 * d + 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recall_screen.json").write_text(json.dumps(payload, indent=2))
    lines = [f"Scoring the cold tier for a question's recall: {len(rows)} layer recalls of {args.cases} chats' "
             f"follow-ups, {args.words}-word documents, tiered CED at {args.ratio}; per layer a median of "
             f"{payload['hot_entries_median']:.0f} hot and {payload['cold_entries_median']:.0f} cold entries a "
             f"head, {payload['take_median']:.0f} recalled; rank {args.rank}, re-rank {RERANK}x. "
             f"{payload['machine']['cpu']}, {payload['machine']['torch_threads']} threads. The screen's stored "
             f"projections would add {extra:.0%} to the int8 cold tier's bytes.", "",
             "| scoring | ms per layer (median) | share of the exact recall's entries recalled |", "|---|---|---|"]
    for name, v in per.items():
        lines.append(f"| {name} | {v['ms_per_layer']:.2f} | {v['same_as_exact']:.3f} |")
    (out / "recall_screen.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
