"""Follow-ups against another build of this engine, follow-up by follow-up: chats at hot ratio 0.3, the other
build's discarding chat (cold tier off; with `--before-tier`, its tiered chat too), this build's discarding chat and
this build's tiered chat, each in its own process (one computing at a time), take turns question by question on the
cases of benchmarks/followups.py (six fact sets, each in two orders: 36 follow-ups), so a machine whose speed drifts
slows them alike. The other build is a checkout of this repository at another commit (`git worktree add /tmp/before
<commit>`). Writes <out>/ttft_vs_build.json and .md: per chat the median TTFT, the median of each follow-up's TTFT
over the other build's discarding chat's, the median decode speed of the replies (at most 24 tokens: tokens after
the first over the time to the last, which holds whatever work the chat does between the first reply token and
the second), the median time from the question to the reply's last token, and whether its answers are the other
build's tiered chat's (with --before-tier).

Usage: python -m benchmarks.ttft_vs_build --before /tmp/before [--words 1280] [--before-tier]
                                           [--out results/followups-ttft/vs-build/2k]
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
            stats = done.stats
            last = stats.ttft_s + ((stats.decode_tokens - 1) / stats.decode_tok_s if stats.decode_tok_s else 0.0)
            print(json.dumps({"ttft_s": stats.ttft_s, "decode_tok_s": stats.decode_tok_s, "last_token_s": last,
                              "answer": done.text}), flush=True)


def _commit(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, help="a checkout of this repository at the other commit")
    parser.add_argument("--words", type=int, default=1280)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--before-tier", action="store_true", help="the other build's tiered chat too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    before = Path(args.before).resolve()
    chats = {"before, discarding": (before, "off"), "now, discarding": (here, "off"), "now, tier": (here, "ram")}
    if args.before_tier:
        chats = {"before, discarding": (before, "off"), "before, tier": (before, "ram"), **chats}
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
    decode = {name: [] for name in procs}
    answers = {name: [] for name in procs}
    last = {name: [] for name in procs}
    from benchmarks.followup_cases import FACT_SETS

    for index in range(len(FACT_SETS)):
        for reverse in (0, 1):
            for proc in procs.values():
                call(proc, f"case {args.words} {index} {reverse}")
            for _ in range(3):
                for name, proc in procs.items():
                    got = call(proc, "next")
                    ttft[name].append(got["ttft_s"])
                    decode[name].append(got["decode_tok_s"])
                    answers[name].append(got["answer"])
                    last[name].append(got["last_token_s"])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    base = ttft["before, discarding"]
    from .common import machine

    payload = {"machine": machine(), "words": args.words, "ratio": args.ratio, "before_commit": _commit(before),
               "now_commit": _commit(here), "ttft_s": ttft, "decode_tok_s": decode, "answers": answers,
               "median_ms": {n: 1000 * statistics.median(v) for n, v in ttft.items()},
               "median_ratio_to_before": {n: statistics.median(a / b for a, b in zip(v, base, strict=True))
                                          for n, v in ttft.items()},
               "median_decode_tok_s": {n: statistics.median(x for x in v if x) if any(v) else None
                                       for n, v in decode.items()},
               "last_token_s": last, "median_last_token_ms": {n: 1000 * statistics.median(v) for n, v in last.items()}}
    if "before, tier" in answers:
        payload["same_answers_as_before_tier"] = sum(a == b for a, b in zip(answers["now, tier"], answers["before, tier"],
                                                                           strict=True))
    out = Path(args.out or here / "results" / "followups-ttft" / "vs-build" / f"{args.words}w")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_vs_build.json").write_text(json.dumps(payload, indent=1))
    lines = [f"Follow-up TTFT at ratio {args.ratio}, {args.words}-word documents, {len(base)} follow-ups taking turns; "
             f"before = {payload['before_commit']}, now = {payload['now_commit']}", "",
             "| chat | median TTFT | median ratio to before, discarding | median decode of the replies "
             "| median time to the reply's last token |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {payload['median_ms'][n]:.0f} ms | {payload['median_ratio_to_before'][n]:.2f}x | "
              + (f"{payload['median_decode_tok_s'][n]:.1f} tok/s |" if payload["median_decode_tok_s"][n] else "— |")
              + f" {payload['median_last_token_ms'][n]:.0f} ms |" for n in ttft]
    if "same_answers_as_before_tier" in payload:
        lines += ["", f"This build's tiered chat gave the other build's tiered answer to "
                      f"{payload['same_answers_as_before_tier']} of {len(base)} follow-ups."]
    (out / "ttft_vs_build.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], float(sys.argv[3]))
    else:
        main()
