"""Two runs of benchmarks/followups.py answer by answer: for each configuration both runs have (same knobs), the
first questions and follow-ups right in each, and every turn whose answer text differs. For a change meant to
keep the answers (a kernel that sums in another order, say), this says how many answers it moved and whether the
score moved with them. Torch-free.

Usage: python -m benchmarks.followups_answers --this results/followups-c-calls/1k/this
           --before results/followups-c-calls/1k/before [--out results/followups-c-calls/1k]
Writes <out>/answers.json and answers.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare(this_dir: Path, before_dir: Path) -> dict:
    this = json.loads((this_dir / "followups.json").read_text())
    before = json.loads((before_dir / "followups.json").read_text())
    if this["words"] != before["words"]:
        raise SystemExit(f"different documents: {this['words']} against {before['words']} words")
    earlier = {json.dumps(row["knobs"], sort_keys=True): row for row in before["rows"]}
    rows = []
    for row in this["rows"]:
        other = earlier.get(json.dumps(row["knobs"], sort_keys=True))
        if other is None:
            continue
        pairs = list(zip(row["turns"], other["turns"], strict=True))
        if any((a["document"], a["turn"]) != (b["document"], b["turn"]) for a, b in pairs):
            raise SystemExit(f"the runs asked different questions for {row['knobs']}")
        moved = [{"document": a["document"], "turn": a["turn"], "question": a["question"], "this": a["answer"],
                  "before": b["answer"], "right_this": a["right"], "right_before": b["right"]}
                 for a, b in pairs if a["answer"] != b["answer"]]
        rows.append({"knobs": row["knobs"], "turns": len(pairs),
                     "first_right": [row["first_right"], other["first_right"]],
                     "followups_right": [row["followups_right"], other["followups_right"]],
                     "followups_total": row["followups_total"], "answers_differing": moved})
    return {"words": this["words"], "tokens": this.get("tokens"), "rows": rows,
            "sources": {"this": str(this_dir), "before": str(before_dir)}}


def table(result: dict) -> str:
    lines = [f"Answers of two runs on {result['tokens']}-token documents ({result['sources']['this']} against "
             f"{result['sources']['before']})", "",
             "| configuration | first questions right: this / before | follow-ups right: this / before | "
             "answers differing |", "|---|---|---|---|"]
    for row in result["rows"]:
        k = row["knobs"]
        name = f"{k.get('ced_policy')} {k.get('kv_cache_ratio')} cold {k.get('cold_tier')}"
        lines.append(f"| {name} | {row['first_right'][0]} / {row['first_right'][1]} | {row['followups_right'][0]} / "
                     f"{row['followups_right'][1]} of {row['followups_total']} | {len(row['answers_differing'])} of "
                     f"{row['turns']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--this", required=True, type=Path)
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = compare(args.this, args.before)
    out = args.out or args.this.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "answers.json").write_text(json.dumps(result, indent=1))
    (out / "answers.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
