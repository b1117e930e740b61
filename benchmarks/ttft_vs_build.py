"""Follow-up TTFT against another build of this engine, follow-up by follow-up: three chats at hot ratio 0.3, the
other build's discarding chat (cold tier off), this build's discarding chat and this build's tiered chat, each in
its own process (one computing at a time), take turns question by question on the cases of benchmarks/followups.py
(six fact sets, each in two orders: 36 follow-ups), so a machine whose speed drifts slows the three alike. The other
build is a checkout of this repository at another commit (`git worktree add /tmp/before <commit>`). Writes
<out>/ttft_vs_build.json and .md: medians and, per follow-up, each chat's TTFT over the other build's.

Usage: python -m benchmarks.ttft_vs_build --before /tmp/before [--words 1280] [--out results/followups-ttft/vs-build/2k]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def worker(tier: str, ratio: float) -> None:
    """Runs in the build under test (its `engine` on PYTHONPATH): 'case <words> <set> <reversed>' reads a document
    with its first question; 'next' asks the next follow-up; each answers one JSON line."""
    from benchmarks.followup_cases import FACT_SETS, document
    from engine import DSV41Config, DSV41Model
    from engine.documents import load_document
    from engine.events import Done

    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=ratio, cold_tier=tier,
                                                   conversation_cache_mb=0))

    def ask(session, question, documents=()):
        done = None
        for event in session.send(question, documents, max_new_tokens=24, greedy=True, repetition_penalty=1.0):
            if isinstance(event, Done):
                done = event
        return done

    print("ready", flush=True)
    session, questions = None, []
    for line in sys.stdin:
        command = line.split()
        if command[0] == "case":
            words, index, reverse = int(command[1]), int(command[2]), command[3] == "1"
            name, facts = FACT_SETS[index]
            questions = [facts[i][1] for i in ((3, 2, 1, 0) if reverse else (0, 1, 2, 3))]
            session = model.chat_session()
            done = ask(session, questions.pop(0), [load_document(str(document(name, facts, words)))])
            print(json.dumps({"ttft_s": done.stats.ttft_s}), flush=True)
        elif command[0] == "next":
            done = ask(session, questions.pop(0))
            print(json.dumps({"ttft_s": done.stats.ttft_s, "answer": done.text}), flush=True)


def _commit(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, help="a checkout of this repository at the other commit")
    parser.add_argument("--words", type=int, default=1280)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    before = Path(args.before).resolve()
    chats = {"before, discarding": (before, "off"), "now, discarding": (here, "off"), "now, tier": (here, "ram")}
    procs = {}
    for name, (root, tier) in chats.items():
        procs[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", tier, str(args.ratio)],
                                       cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONPATH": str(root)})
        while procs[name].stdout.readline().strip() != "ready":
            pass

    def call(proc, command: str) -> dict:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        while not (line := proc.stdout.readline()).startswith("{"):
            if not line:
                raise RuntimeError("a worker ended early")
        return json.loads(line)

    ttft = {name: [] for name in procs}
    from benchmarks.followup_cases import FACT_SETS

    for index in range(len(FACT_SETS)):
        for reverse in (0, 1):
            for proc in procs.values():
                call(proc, f"case {args.words} {index} {reverse}")
            for _ in range(3):
                for name, proc in procs.items():
                    ttft[name].append(call(proc, "next")["ttft_s"])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    base = ttft["before, discarding"]
    from .common import machine

    payload = {"machine": machine(), "words": args.words, "ratio": args.ratio, "before_commit": _commit(before),
               "now_commit": _commit(here), "ttft_s": ttft,
               "median_ms": {n: 1000 * statistics.median(v) for n, v in ttft.items()},
               "median_ratio_to_before": {n: statistics.median(a / b for a, b in zip(v, base, strict=True))
                                          for n, v in ttft.items()}}
    out = Path(args.out or here / "results" / "followups-ttft" / "vs-build" / f"{args.words}w")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_vs_build.json").write_text(json.dumps(payload, indent=1))
    lines = [f"Follow-up TTFT at ratio {args.ratio}, {args.words}-word documents, {len(base)} follow-ups taking turns; "
             f"before = {payload['before_commit']}, now = {payload['now_commit']}", "",
             "| chat | median TTFT | median ratio to before, discarding |", "|---|---|---|"]
    lines += [f"| {n} | {payload['median_ms'][n]:.0f} ms | {payload['median_ratio_to_before'][n]:.2f}x |" for n in ttft]
    (out / "ttft_vs_build.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], float(sys.argv[3]))
    else:
        main()
