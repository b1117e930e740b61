"""A long chat at the shipped defaults: many short turns in one session, then questions a fresh chat answers.

Each turn asks "Turn i: give one word that rhymes with <word>." (greedy, at most 10 new tokens); after the
last turn the chat asks questions with a known answer ("What is the capital of France?" -> Paris,
"What is 2 + 2?" -> 4). Per ratio it records the final answers, whether they hold the expected word, the
tokens seen and stored, and the process RSS after every turn (the RSS curve).

Usage: python -m benchmarks.long_chat [--turns 200] [--ratios 1.0,0.5,0.3] [--out results/long-chat]
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
# copy of the session), and of a fresh chat. All eleven are answered right by a fresh chat of the default
# model (greedy, 24 tokens); the "What is 2 + 2?" is not (this 135M model rambles on it), so it is
# left out of the count.
FINAL_QUESTIONS = [("What is the capital of France?", "paris"), ("What is the capital of Japan?", "tokyo"),
                   ("What is the capital of Germany?", "berlin"), ("What is the capital of England?", "london"),
                   ("What is the opposite of hot?", "cold"), ("How many legs does a dog have?", ("4", "four")),
                   ("What is the chemical symbol for water?", "h2o"), ("What is the largest ocean on Earth?", "pacific"),
                   ("How many days are in a week?", ("7", "seven")), ("Who wrote Romeo and Juliet?", "shakespeare"),
                   ("How many hours are in a day?", ("24", "twenty-four", "twenty four"))]


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


def run_chat(model: DSV41Model, turns: int, *, session=None, progress=None) -> dict:
    """The long chat in `session` (a new one of `model` by default), then the final questions, then a fresh chat."""
    session = session or model.chat_session()
    process = psutil.Process()
    curve = []
    started = time.perf_counter()
    for i in range(turns):
        reply(session, turn_prompt(i), 10)
        curve.append({"turn": i + 1, "seen": session.cache.seen, "stored": session.cache.stored,
                      "rss_mib": process.memory_info().rss / 2**20})
        if progress and (i + 1) % 25 == 0:
            progress(i + 1, session)
    finals = []
    for question, expected in FINAL_QUESTIONS:
        text, _ = reply(clone_session(session), question, 24)
        finals.append({"question": question, "answer": text, "expected": expected,
                       "correct": holds(text, expected)})
    fresh = []
    for question, expected in FINAL_QUESTIONS:
        text, _ = reply(model.chat_session(), question, 24)
        fresh.append({"question": question, "answer": text, "correct": holds(text, expected)})
    return {"turns": turns, "seconds": time.perf_counter() - started, "curve": curve, "final": finals,
            "fresh": fresh, "seen": session.cache.seen, "stored": session.cache.stored}


def clone_session(session):
    """A copy of a chat session (its cache tensors copied), so that each final question meets the same state."""
    import copy

    import torch

    from engine.cache import storage

    clone = copy.copy(session)
    clone.messages = [dict(m) for m in session.messages]
    clone.transcript_ids = list(session.transcript_ids)
    clone._lock = threading.Lock()
    cache = copy.copy(session.cache)
    layers = []
    with torch.inference_mode():
        for layer in session.cache.layers:
            twin = copy.copy(layer)
            for name, value in vars(layer).items():
                if isinstance(value, torch.Tensor):
                    setattr(twin, name, value.clone())
            twin.storage_version = next(storage._ALLOCATIONS)
            layers.append(twin)
    cache.layers = layers
    cache._recall = list(session.cache._recall)
    cache._torch_rng = torch.Generator().manual_seed(0)
    clone.cache = cache
    return clone


def plot(results: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ratio, run in results["runs"].items():
        turns = [p["turn"] for p in run["curve"]]
        axes[0].plot(turns, [p["rss_mib"] for p in run["curve"]], label=f"ratio {ratio}")
        axes[1].plot(turns, [p["stored"] for p in run["curve"]], label=f"ratio {ratio}")
    axes[0].set(xlabel="turn", ylabel="process RSS (MiB)", title="RSS over a long chat")
    axes[1].set(xlabel="turn", ylabel="KV entries stored per layer", title="Stored entries")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "long-chat.png", dpi=110)


def markdown(results: dict) -> str:
    lines = [f"# Long chat: {results['turns']} short turns, then questions (default model, greedy)", "",
             f"Machine: {results['machine'].get('cpu', '?')}; {results['date']}", "",
             "| ratio | tokens seen | entries stored | right (of the questions a fresh chat gets right) | "
             "RSS after turn 1 → last (MiB) |", "|---|---|---|---|---|"]
    for ratio, run in results["runs"].items():
        curve = run["curve"]
        graded = [f for f, fresh in zip(run["final"], run["fresh"], strict=True) if fresh["correct"]]
        right = sum(f["correct"] for f in graded)
        lines.append(f"| {ratio} | {run['seen']} | {run['stored']} | {right} / {len(graded)} | "
                     f"{curve[0]['rss_mib']:.0f} → {curve[-1]['rss_mib']:.0f} |")
    lines += ["", "Answers:", "", "| ratio | question | answer | right |", "|---|---|---|---|"]
    for ratio, run in results["runs"].items():
        for final in run["final"]:
            answer = final["answer"].replace("\n", " ").replace("|", "\\|")[:90]
            lines.append(f"| {ratio} | {final['question']} | {answer} | {'yes' if final['correct'] else 'no'} |")
    return "\n".join(lines) + "\n"


def one_run(model_path: str, ratio: float, turns: int, knobs: dict) -> dict:
    model = DSV41Model.from_pretrained(DSV41Config(model_path=model_path, kv_cache_ratio=ratio, **knobs))

    def progress(done, session):
        print(f"ratio {ratio}: turn {done}, seen {session.cache.seen}, stored {session.cache.stored}", flush=True)

    run = run_chat(model, turns, progress=progress)
    run["knobs"] = {"kv_cache_ratio": ratio, **knobs}
    for final in run["final"]:
        print(f"ratio {ratio}: {final['question']} -> {final['answer']!r}", flush=True)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--ratios", default="1.0,0.5,0.3")
    parser.add_argument("--knobs", default="{}", help="extra DSV41Config fields as JSON, for experiments")
    parser.add_argument("--out", default=str(RESULTS / "long-chat"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # a child process: one ratio
    args = parser.parse_args(argv)
    knobs = json.loads(args.knobs)
    if args.one is not None:  # the RSS curve of one ratio, in a process of its own
        print("RESULT " + json.dumps(one_run(args.model, args.one, args.turns, knobs)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"turns": args.turns, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "knobs": knobs, "runs": {}}
    for ratio in [float(r) for r in args.ratios.split(",")]:
        child = subprocess.run([sys.executable, "-m", "benchmarks.long_chat", "--one", str(ratio), "--turns",
                                str(args.turns), "--knobs", args.knobs, "--model", args.model],
                               capture_output=True, text=True, check=False)
        lines = child.stdout.splitlines()
        for line in lines:
            if not line.startswith("RESULT "):
                print(line, flush=True)
        found = [line for line in lines if line.startswith("RESULT ")]
        if child.returncode != 0 or not found:
            print(child.stderr[-4000:], file=sys.stderr)
            return 1
        results["runs"][str(ratio)] = json.loads(found[-1][len("RESULT "):])
        (out / "long-chat.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "long-chat.md").write_text(markdown(results))
    plot(results, out)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
