"""A long chat at the shipped defaults: many short turns in one session, then questions about its early turns and
questions a fresh chat answers.

Each turn asks "Turn i: give one word that rhymes with <word>." (greedy, at most 10 new tokens), except five
early turns (2, 5, 10, 20 and 40) that each tell the chat one fact ("Remember this: my sister's name is
Ingrid."). After the last turn the chat is asked questions with a known answer ("What is the capital of
France?" -> Paris), each of a fork of the chat as it stood after its last turn, then, in the chat itself, one
question per turn, about each planted fact in turn ("What is my sister's name?" -> Ingrid); an answer is right
when it holds its key. The same fact questions are asked of a short chat of only the five fact turns (what the
model recalls at all), the general questions of a fresh chat. Per configuration (ratio, cold tier) it records
the answers, the tokens seen and stored, the cold entries, how much of each fact's turn the hot set and the
cold tier still hold after the last turn, and the process RSS after every turn (the RSS curve). Each
configuration runs in a process of its own; ratio 1.0 (no compaction) runs once, without a cold tier.

Saving the chat's cache after every turn (conversation_cache_mb) is off here: a benchmark chat is never
reopened, and each save writes the whole cache to the user cache folder (--knobs can turn it on).

Usage: python -m benchmarks.long_chat [--turns 200] [--ratios 1.0,0.5,0.3,0.2] [--tiers off,ram]
       [--knobs '{"ced_decay": 0.99}'] [--out results/long-chat]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from engine import DSV41Config, DSV41Model
from engine.events import Done

from .common import RESULTS, machine

RHYMES = ["cat", "dog", "sun", "tree", "star", "light", "rain", "moon", "day", "book", "ring", "cake"]
# (question, a word the answer holds): each is asked of the long chat as it stood after its last turn (a
# ChatSession.fork), and of a fresh chat. All eleven are answered right by a fresh chat of the default model
# (greedy, 24 tokens); the "What is 2 + 2?" is not (this 135M model rambles on it), so it is left out
# of the count.
FINAL_QUESTIONS = [("What is the capital of France?", "paris"), ("What is the capital of Japan?", "tokyo"),
                   ("What is the capital of Germany?", "berlin"), ("What is the capital of England?", "london"),
                   ("What is the opposite of hot?", "cold"), ("How many legs does a dog have?", ("4", "four")),
                   ("What is the chemical symbol for water?", "h2o"), ("What is the largest ocean on Earth?", "pacific"),
                   ("How many days are in a week?", ("7", "seven")), ("Who wrote Romeo and Juliet?", "shakespeare"),
                   ("How many hours are in a day?", ("24", "twenty-four", "twenty four"))]
# (turn, what the user says in that turn, the question after the last turn, the key its answer must hold): each
# fact is its own short user turn in place of that turn's rhyme (turns count from 1); a chat shorter than a
# fact's turn does not plant it.
FACTS = [(2, "Remember this: my sister's name is Ingrid.", "What is my sister's name?", "ingrid"),
         (5, "Remember this: my car is a green Volvo.", "What car do I drive?", "volvo"),
         (10, "Remember this: my flight number is KL 4471.", "What is my flight number?", "4471"),
         (20, "Remember this: my dog is called Biscuit.", "What is my dog called?", "biscuit"),
         (40, "Remember this: my favourite number is 58.", "What is my favourite number?", "58")]
# What a right answer to each fact's question says, up to its key, and the key (benchmarks score the key's
# log-probability after this reply prefix: how much of the fact the chat still reads, even where greedy
# decoding follows the chat's pattern instead)
ANSWER_PREFIXES = {2: ("Your sister's name is", " Ingrid"), 5: ("You drive a green", " Volvo"),
                   10: ("Your flight number is KL", " 4471"), 20: ("Your dog is called", " Biscuit"),
                   40: ("Your favourite number is", " 58")}
TURN_TOKENS, ANSWER_TOKENS = 10, 24  # new tokens per chat turn, per question


def holds(answer: str, expected) -> bool:
    words = (expected,) if isinstance(expected, str) else expected
    return any(word in answer.lower() for word in words)


def turn_prompt(i: int) -> str:
    return f"Turn {i}: give one word that rhymes with {RHYMES[i % len(RHYMES)]}."


def reply(session, prompt: str, max_new_tokens: int) -> tuple[str, Done]:
    done = None
    for event in session.send(prompt, max_new_tokens=max_new_tokens, greedy=True):
        if isinstance(event, Done):
            done = event
    return done.text, done


def planted(facts, turns: int) -> list:
    return [fact for fact in facts if fact[0] <= turns]


def key_score(session, question: str, prefix: str, key: str) -> dict:
    """Teacher-forced, on a fork of `session`: `question` read as its next turn (as a turn reads it: chunks, the
    cold tier's recall in the question's forward), then the reply `prefix` fed token by token; returns the
    log-probability of `key`'s tokens after it (summed, nats) and the rank of its first token (1: greedy's
    choice). The fork is dropped: `session` does not change."""
    import torch

    from engine.generate import TurnPlan, TurnResult, _prefill
    from engine.models import adapter

    fork = session.fork()
    model, cache, tokenizer = fork.model, fork.cache, fork.tokenizer
    turn = fork.prepare(question)
    plan = TurnPlan(turn.new_ids, turn.question_tokens, model.prefill_chunk, model.headroom_tokens(cache),
                    fork.context_limit)
    feed = _prefill(model.hf_model, cache, plan, threading.Event(), model.device, TurnResult([], 0, 0, False))
    while True:
        try:
            next(feed)
        except StopIteration as stop:
            logits = stop.value
            break
    cache.finish_prefill(answer_follows=True)  # as run_turn does before the reply's first decode step
    head = tokenizer.encode(prefix, add_special_tokens=False)
    ids = tokenizer.encode(prefix + key, add_special_tokens=False)
    if ids[: len(head)] != head:
        raise ValueError(f"{prefix + key!r} does not tokenize as {prefix!r} and then the key")
    total, rank = 0.0, None
    with torch.inference_mode():
        for i, token in enumerate(ids):
            logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            if i >= len(head):
                total += float(logprobs[token])
                if rank is None:
                    rank = int((logprobs > logprobs[token]).sum()) + 1
            logits = adapter.forward(model.hf_model, torch.tensor([[token]], device=model.device), cache,
                                     prefill=False)
    return {"key_logprob": total, "key_rank": rank}


def ask_facts(session, facts) -> list[dict]:
    """Each fact's question in `session` itself, one per turn, in order (the chat goes on with every answer)."""
    answers = []
    for turn, _, question, key in facts:
        score = key_score(session, question, *ANSWER_PREFIXES[turn])
        text, _ = reply(session, question, ANSWER_TOKENS)
        answers.append({"turn": turn, "question": question, "answer": text, "expected": key,
                        "correct": holds(text, key), "recalled": session.cache.recalled, **score})
    return answers


def held(cache, start: int, end: int) -> dict:
    """Shares of the entries of positions [start, end) (one turn) that the hot set and the cold tier hold, over
    every layer and KV head."""
    import torch

    def share(parts) -> float:
        total = 0
        with torch.inference_mode():
            for positions, length in parts:
                pos = positions[:, :length]
                total += int(((pos >= start) & (pos < end)).sum())
        return total / max((end - start) * cache.kv_heads * cache.num_layers, 1)

    return {"hot": share((layer.positions, layer.length) for layer in cache.layers),
            "cold": share((cold.positions, cold.length) for cold in cache.cold) if cache.cold is not None else 0.0}


def run_chat(model: DSV41Model, turns: int, *, session=None, progress=None, facts=()) -> dict:
    """The long chat in `session` (a new one of `model` by default), with `facts` planted in their turns; then the
    final questions (each of a fork of the chat), the fact questions (in the chat, in order), the final questions
    of a fresh chat and the fact questions of a chat of only the fact turns."""
    session = session or model.chat_session()
    facts = planted(facts, turns)
    statements = {turn: statement for turn, statement, _, _ in facts}
    spans = {}  # fact turn -> the positions its turn (question and reply) took
    process = psutil.Process()
    curve = []
    started = time.perf_counter()
    for i in range(turns):
        before = session.cache.seen
        reply(session, statements.get(i + 1, turn_prompt(i)), TURN_TOKENS)
        if i + 1 in statements:
            spans[i + 1] = (before, session.cache.seen)
        curve.append({"turn": i + 1, "seen": session.cache.seen, "stored": session.cache.stored,
                      "rss_mib": process.memory_info().rss / 2**20})
        if progress and (i + 1) % 25 == 0:
            progress(i + 1, session)
    seen, stored = session.cache.seen, session.cache.stored
    cold = session.cache.cold[0].length if session.cache.cold is not None else 0
    kept = {turn: held(session.cache, *span) for turn, span in spans.items()}
    finals = []
    for question, expected in FINAL_QUESTIONS:
        text, _ = reply(session.fork(), question, ANSWER_TOKENS)
        finals.append({"question": question, "answer": text, "expected": expected,
                       "correct": holds(text, expected)})
    fact_answers = ask_facts(session, facts)
    for answer in fact_answers:
        answer["kept"] = kept[answer["turn"]]
    fresh = []
    for question, expected in FINAL_QUESTIONS:
        text, _ = reply(model.chat_session(), question, ANSWER_TOKENS)
        fresh.append({"question": question, "answer": text, "correct": holds(text, expected)})
    short = None
    if facts:
        short_chat = model.chat_session()
        for _, statement, _, _ in facts:
            reply(short_chat, statement, TURN_TOKENS)
        short = ask_facts(short_chat, facts)
    return {"turns": turns, "seconds": time.perf_counter() - started, "curve": curve, "final": finals,
            "fresh": fresh, "facts": fact_answers, "facts_short_chat": short, "seen": seen, "stored": stored,
            "cold_entries": cold}


def label(run: dict) -> str:
    return f"ratio {run['ratio']}" + (f", cold {run['tier']}" if run["ratio"] < 1.0 else "")


def tier_cell(run: dict) -> str:
    return run["tier"] if run["ratio"] < 1.0 else "—"


def plot(results: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in results["runs"].values():
        turns = [p["turn"] for p in run["curve"]]
        style = "--" if run["tier"] != "off" and run["ratio"] < 1.0 else "-"
        axes[0].plot(turns, [p["rss_mib"] for p in run["curve"]], style, label=label(run))
        axes[1].plot(turns, [p["stored"] for p in run["curve"]], style, label=label(run))
    axes[0].set(xlabel="turn", ylabel="process RSS (MiB)", title="RSS over a long chat")
    axes[1].set(xlabel="turn", ylabel="KV entries stored per layer (hot)", title="Stored entries")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "long-chat.png", dpi=110)


def cell(text: str, limit: int = 90) -> str:
    return text.replace("\n", " ").replace("|", "\\|")[:limit]


def _mean_logprob(facts) -> str:
    scores = [f["key_logprob"] for f in facts or () if "key_logprob" in f]
    return f"{sum(scores) / len(scores):.2f}" if scores else "–"


def markdown(results: dict) -> str:
    facts = planted(FACTS, results["turns"])
    lines = [f"# Long chat: {results['turns']} short turns, then questions (default model, greedy)", "",
             f"Machine: {results['machine'].get('cpu', '?')}; {results['date']}", "",
             f"Early-turn facts: {len(facts)} told in turns {', '.join(str(f[0]) for f in facts)} "
             "(\"Remember this: my sister's name is Ingrid.\"), asked after the last turn in the chat itself, one "
             "question per turn; the short chat is the fact turns alone, then the same questions. Cold tier: where "
             "compaction puts what it takes out of the hot set ('off': discarded; 'ram': kept, and each question "
             "recalls from it); ratio 1.0 compacts nothing.", "",
             "| ratio | cold tier | tokens seen | entries stored | cold entries | right (of the questions a fresh "
             "chat gets right) | early-turn facts right | facts right in a short chat | key log-prob of the facts "
             "(mean; short chat) | RSS after turn 1 → last (MiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"].values():
        curve = run["curve"]
        graded = [f for f, fresh in zip(run["final"], run["fresh"], strict=True) if fresh["correct"]]
        right = sum(f["correct"] for f in graded)
        short = run["facts_short_chat"] or []
        lines.append(f"| {run['ratio']} | {tier_cell(run)} | {run['seen']} | {run['stored']} | {run['cold_entries']} | "
                     f"{right} / {len(graded)} | {sum(f['correct'] for f in run['facts'])} / {len(run['facts'])} | "
                     f"{sum(f['correct'] for f in short)} / {len(short)} | "
                     f"{_mean_logprob(run['facts'])}; {_mean_logprob(short)} | "
                     f"{curve[0]['rss_mib']:.0f} → {curve[-1]['rss_mib']:.0f} |")
    lines += ["", "Early-turn facts (held: share of the fact turn's entries in the hot set / the cold tier after the "
              "last turn, over layers and heads; recalled: entries per head, summed over layers, the question "
              "brought back from the cold tier):", "",
              "| ratio | cold tier | told in turn | question | answer | right | key log-prob (rank) | held hot / cold "
              "| recalled |", "|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"].values():
        for fact in run["facts"]:
            kept = fact["kept"]
            lines.append(f"| {run['ratio']} | {tier_cell(run)} | {fact['turn']} | {fact['question']} | "
                         f"{cell(fact['answer'])} | {'yes' if fact['correct'] else 'no'} | "
                         f"{fact.get('key_logprob', float('nan')):.2f} ({fact.get('key_rank')}) | "
                         f"{kept['hot']:.0%} / {kept['cold']:.0%} | {fact['recalled']} |")
    lines += ["", "Answers:", "", "| ratio | cold tier | question | answer | right |", "|---|---|---|---|---|"]
    for run in results["runs"].values():
        for final in run["final"]:
            lines.append(f"| {run['ratio']} | {tier_cell(run)} | {final['question']} | {cell(final['answer'])} | "
                         f"{'yes' if final['correct'] else 'no'} |")
    return "\n".join(lines) + "\n"


def one_run(model_path: str, ratio: float, tier: str, turns: int, knobs: dict) -> dict:
    model = DSV41Model.from_pretrained(DSV41Config(model_path=model_path, kv_cache_ratio=ratio, cold_tier=tier,
                                                   **knobs))
    name = f"ratio {ratio}, cold {tier}"

    def progress(done, session):
        cold = session.cache.cold[0].length if session.cache.cold is not None else 0
        print(f"{name}: turn {done}, seen {session.cache.seen}, stored {session.cache.stored}, cold {cold}", flush=True)

    run = run_chat(model, turns, progress=progress, facts=FACTS)
    run.update(ratio=ratio, tier=tier, knobs={"kv_cache_ratio": ratio, "cold_tier": tier, **knobs})
    for answer in run["final"] + run["facts"]:
        print(f"{name}: {answer['question']} -> {answer['answer']!r}", flush=True)
    return run


def configurations(ratios: list[float], tiers: list[str]) -> list[tuple[float, str]]:
    """Every ratio with every tier, but ratio 1.0 (nothing compacted, nothing goes cold) once, without a tier."""
    runs = []
    for ratio in ratios:
        for tier in (["off"] if ratio >= 1.0 else tiers):
            if (ratio, tier) not in runs:
                runs.append((ratio, tier))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--ratios", default="1.0,0.5,0.3,0.2")
    parser.add_argument("--tiers", default="off,ram", help="cold_tier values each ratio below 1.0 runs with")
    parser.add_argument("--knobs", default="{}", help="extra DSV41Config fields as JSON, for experiments")
    parser.add_argument("--out", default=str(RESULTS / "long-chat"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # a child process: one ratio
    parser.add_argument("--tier", default="off", help=argparse.SUPPRESS)  # ... and one cold tier
    args = parser.parse_args(argv)
    knobs = {"conversation_cache_mb": 0, **json.loads(args.knobs)}
    if "cold_tier" in knobs or "kv_cache_ratio" in knobs:
        parser.error("set the cold tier with --tiers and the ratio with --ratios, not in --knobs")
    if args.one is not None:  # the RSS curve of one configuration, in a process of its own
        print("RESULT " + json.dumps(one_run(args.model, args.one, args.tier, args.turns, knobs)), flush=True)
        return 0
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    for tier in tiers:
        if tier not in ("off", "ram", "disk"):
            parser.error(f"--tiers: {tier!r} is not one of off, ram, disk")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"turns": args.turns, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "knobs": knobs, "facts": [list(f) for f in planted(FACTS, args.turns)], "runs": {}}
    for ratio, tier in configurations([float(r) for r in args.ratios.split(",")], tiers):
        child = subprocess.run([sys.executable, "-m", "benchmarks.long_chat", "--one", str(ratio), "--tier", tier,
                                "--turns", str(args.turns), "--knobs", json.dumps(knobs), "--model", args.model],
                               capture_output=True, text=True, check=False)
        lines = child.stdout.splitlines()
        for line in lines:
            if not line.startswith("RESULT "):
                print(line, flush=True)
        found = [line for line in lines if line.startswith("RESULT ")]
        if child.returncode != 0 or not found:
            print(child.stderr[-4000:], file=sys.stderr)
            return 1
        results["runs"][f"{ratio}/{tier}"] = json.loads(found[-1][len("RESULT "):])
        (out / "long-chat.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "long-chat.md").write_text(markdown(results))
    plot(results, out)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
