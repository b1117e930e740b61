"""Reopening a chat with a long document: the saved conversation cache against re-reading the conversation.

A chat attaches a real speech (~4k tokens) to its first question and asks a follow-up. Then, as after an app
restart, the model is loaded again and a new session is handed the same messages: its next question either
restores the saved cache (conversation_cache_mb > 0) or re-reads the whole conversation (0). Regenerating the
last reply (the messages before it, the same question) is timed the same way, and so is regenerating the first
reply (the state saved once the document was read, before its question; also what a new chat asking about the same
document restores). Greedy, 16 new tokens.

Reports TTFT of: the first question with the states saved and without (what saving the document's state costs it);
a follow-up in the open chat; the first question after reopening, restored and re-read; a regenerate of the last
reply and of the first, restored and re-read; and the size and write time of the saved state.

Usage: python -m benchmarks.reopen [--words 3500] [--ratio 0.5] [--cold-tier ram] [--out results/reopen]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from engine import DSV41Config, DSV41Model
from engine.documents import load_document
from engine.events import Done

from .common import RESULTS, machine
from .corpus import speech

QUESTIONS = ("What does the speech say about the economy?", "And what about education?",
             "What does it say about health care?")


def ask(session, prompt: str, documents=()) -> Done:
    return [e for e in session.send(prompt, documents, max_new_tokens=16, greedy=True) if isinstance(e, Done)][0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reopen")
    parser.add_argument("--words", type=int, default=3500, help="words of speech (3500: about 4k tokens)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--cold-tier", default="ram")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "reopen"))
    args = parser.parse_args(argv)
    started = time.time()
    states = tempfile.mkdtemp(prefix="dsv41-reopen-")  # its own folder, removed at the end
    os.environ["DSV41_CONVERSATIONS_DIR"] = states
    text = " ".join(speech("2010-Obama-1").split()[: args.words])
    path = Path(tempfile.mkdtemp()) / "speech.txt"
    path.write_text(text, encoding="utf-8")
    knobs = dict(max_seq_len=8192, kv_cache_ratio=args.ratio, cold_tier=args.cold_tier)

    model = DSV41Model.from_pretrained(DSV41Config(**knobs))
    chat = model.chat_session()
    first = ask(chat, QUESTIONS[0], [load_document(str(path))])
    followup = ask(chat, QUESTIONS[1])
    history = list(chat.messages)
    save_s = chat.last_save_seconds
    store = model.conversation_store
    saved_bytes = store.total_bytes()
    del chat, model

    rows = {"followup_ttft_s": followup.stats.ttft_s, "first_ttft_s": first.stats.ttft_s,
            "document_tokens": first.stats.prefill_tokens, "save_s": save_s, "saved_bytes": saved_bytes}
    model = DSV41Model.from_pretrained(DSV41Config(**knobs))  # "after a restart": a new model, a new session
    document = load_document(str(path))
    cases = (("reopen", history, QUESTIONS[2], ()), ("regenerate", history[:-2], QUESTIONS[1], ()),
             ("regenerate_first", [], QUESTIONS[0], (document,)))
    for label, messages, question, documents in cases:
        for store_mb, name in ((2048, "restored"), (0, "re-read")):
            times, restored = [], []
            for _ in range(args.repeats):
                model.config = model.config.replace(conversation_cache_mb=store_mb)
                session = model.chat_session()
                session.messages = list(messages)
                done = ask(session, question, documents)
                times.append(done.stats.ttft_s)
                restored.append(done.stats.restored_context)
                model.config = model.config.replace(conversation_cache_mb=2048)
                if name == "re-read":
                    break  # one re-read is enough to see it (and takes a document's prefill)
            rows[f"{label}_{name}_ttft_s"] = statistics.median(times)
            rows[f"{label}_{name}_restored"] = all(restored)
    # the first question without saving the document's state, in this process (its cost in the first TTFT): each
    # asked as a new chat, taking turns with and without the store
    with_store, without_store = [], []
    for _ in range(args.repeats):
        for store_mb, times in ((0, without_store), (2048, with_store)):
            model.config = model.config.replace(conversation_cache_mb=store_mb)
            if store_mb:
                shutil.rmtree(states, ignore_errors=True)  # nothing to restore: the document is read and saved
            times.append(ask(model.chat_session(), QUESTIONS[0], [document]).stats.ttft_s)
    rows["first_saving_ttft_s"], rows["first_not_saving_ttft_s"] = (statistics.median(with_store),
                                                                    statistics.median(without_store))
    payload = {"machine": machine(), "knobs": knobs, "words": args.words, **rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reopen.json").write_text(json.dumps(payload, indent=2))
    table = "\n".join([
        f"Reopening a chat with a {rows['document_tokens']:,}-token document (ratio {args.ratio}, cold tier "
        f"{args.cold_tier}); the chat's saved states (the two turns' and the document's before its question) take "
        f"{saved_bytes / 2**20:.1f} MiB on disk, the last was written in {save_s * 1000:.0f} ms",
        "", "| turn | TTFT |", "|---|---|",
        f"| first question (reads the document) | {rows['first_ttft_s']:.2f} s |",
        f"| first question, the document's state saved / not saved (medians, taking turns) | "
        f"{rows['first_saving_ttft_s']:.2f} / {rows['first_not_saving_ttft_s']:.2f} s |",
        f"| follow-up in the open chat | {rows['followup_ttft_s']:.2f} s |",
        f"| first question after reopening, saved cache restored | {rows['reopen_restored_ttft_s']:.2f} s |",
        f"| first question after reopening, conversation re-read | {rows['reopen_re-read_ttft_s']:.2f} s |",
        f"| regenerate, saved cache restored | {rows['regenerate_restored_ttft_s']:.2f} s |",
        f"| regenerate, conversation re-read | {rows['regenerate_re-read_ttft_s']:.2f} s |",
        f"| regenerate the first reply (or the document in a new chat), its state restored | "
        f"{rows['regenerate_first_restored_ttft_s']:.2f} s |",
        f"| regenerate the first reply, document re-read | {rows['regenerate_first_re-read_ttft_s']:.2f} s |", ""])
    (out / "reopen.md").write_text(table)
    print(table)
    shutil.rmtree(states, ignore_errors=True)
    print(f"elapsed {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
