"""A follow-up's reply decode speed, tiered against discarding, at one hot ratio: the replies run long (128 tokens,
end-of-turn ignored), so the speed is the decode's and not a short reply's one-off costs. Per case of
benchmarks/followups.py (six fact sets): a fresh chat reads the document with its first question, then asks one
follow-up; the chats take turns case by case. Three chats: the discarding chat as the engine runs it (CED's
threshold can cut the hot set below the ratio), the discarding chat with the threshold off (its hot set is the
ratio, as the tier's is between turns), and the tier. For each reply: tokens after the first over the time since it
(TurnStats.decode_tok_s: the cache's work before the reply's first step is in it), the steady speed from the second
token on, and the hot set the reply attends to (MiB over every layer: the threshold cuts layers apart). Writes results/followup-decode/<name>/followup-decode.json
and .md.

Usage: python -m benchmarks.followup_decode [--words 1280] [--ratio 0.3] [--tokens 128] [--out results/followup-decode/2k]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from engine import DSV41Config, DSV41Model
from engine.documents import load_document
from engine.events import Done, TokenText

from .common import RESULTS, machine
from .followup_cases import FACT_SETS, document

CHATS = {"discarding": {"cold_tier": "off"}, "discarding, threshold off": {"cold_tier": "off", "ced_threshold": 0.0},
         "tier": {"cold_tier": "ram"}}


def reply(session, question: str, documents=(), tokens: int = 24, ignore_eos: bool = False) -> dict:
    """One turn; the times each piece of the reply's text came out, and the hot set's MiB mid-reply (every layer)."""
    shown, hot, done = [], None, None
    for event in session.send(question, documents, max_new_tokens=tokens, greedy=True, repetition_penalty=1.0,
                              ignore_eos=ignore_eos):
        if isinstance(event, TokenText):
            shown.append(time.perf_counter())
            if len(shown) <= 8:  # mid-reply: at the eighth piece (the last one of a shorter reply)
                hot = session.cache.stored_kv_bytes() / 2**20
        elif isinstance(event, Done):
            done = event
    # pieces of text from the second to the last, over their time, in tokens (a piece is a token, or a few where one
    # alone ends mid-character: the reply's tokens per piece)
    steady = ((len(shown) - 2) / (shown[-1] - shown[1]) * done.stats.decode_tokens / len(shown)
              if len(shown) > 2 else 0.0)
    return {"decode_tok_s": done.stats.decode_tok_s, "steady_tok_s": steady, "tokens": done.stats.decode_tokens,
            "pieces": len(shown), "hot_mib": hot, "ttft_s": done.stats.ttft_s, "answer": done.text}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=1280)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "followup-decode" / "2k"))
    args = parser.parse_args(argv)
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=args.ratio, conversation_cache_mb=0))
    base = model.config
    rows = {name: [] for name in CHATS}
    for name, facts in FACT_SETS:
        path = document(name, facts, args.words)
        for chat, knobs in CHATS.items():
            model.config = base.replace(**knobs)
            session = model.chat_session()
            reply(session, facts[0][1], [load_document(str(path))])
            rows[chat].append({"document": name, **reply(session, facts[2][1], tokens=args.tokens, ignore_eos=True)})
            print(chat, name, {k: v for k, v in rows[chat][-1].items() if k != "answer"}, flush=True)
    summary = {chat: {key: statistics.median(r[key] for r in turns)
                      for key in ("decode_tok_s", "steady_tok_s", "hot_mib")} for chat, turns in rows.items()}
    tier = rows["tier"]
    for chat, turns in rows.items():  # per case, the tier over this chat (paired)
        summary[chat]["tier_over_this_steady"] = statistics.median(
            t["steady_tok_s"] / c["steady_tok_s"] for t, c in zip(tier, turns, strict=True))
        summary[chat]["tier_over_this_decode"] = statistics.median(
            t["decode_tok_s"] / c["decode_tok_s"] for t, c in zip(tier, turns, strict=True))
    payload = {"machine": machine(), "words": args.words, "ratio": args.ratio, "tokens": args.tokens,
               "summary": summary, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "followup-decode.json").write_text(json.dumps(payload, indent=2, default=str))
    lines = [f"A follow-up's reply, {args.tokens} tokens (end-of-turn ignored), after a {args.words}-word document at "
             f"hot ratio {args.ratio}; {len(FACT_SETS)} cases, the chats taking turns case by case; medians; "
             f"{payload['machine']['cpu']}, {payload['machine']['torch_threads']} threads.", "",
             "| chat | hot KV mid-reply (MiB, every layer) | decode tok/s (after the first token) | steady tok/s (from the "
             "second) | tier / this chat, decode | tier / this chat, steady |", "|---|---|---|---|---|---|"]
    for chat, s in summary.items():
        lines.append(f"| {chat} | {s['hot_mib']:.1f} | {s['decode_tok_s']:.1f} | {s['steady_tok_s']:.1f} | "
                     f"{s['tier_over_this_decode']:.3f}× | {s['tier_over_this_steady']:.3f}× |")
    (out / "followup-decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
