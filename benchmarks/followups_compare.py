"""Our tiered cache against NVIDIA kvpress on the same follow-up questions, side by side, per hot (kept) ratio.

Reads what benchmarks/followups.py and benchmarks/kvpress_peer.py wrote for one document length (the same six
speeches, facts, questions, orders and answer keys; torch-free, so any python runs it) and writes one table and one
plot. Both protocols ask every follow-up without the earlier follow-ups in view: kvpress asks each question alone
on the context it compressed once; `followups.py --mode requests` asks each follow-up on a fork of the chat as it
stood after its first turn (the first question and its answer are in the chat, as a user's first turn is).
`kvpress_peer.py --history` asks each follow-up after the first question and the press's own answer to it, the
token sequence of our requests mode (its --check-prompt --history checks that). The two uncompressed rows differ (float32 transformers against our default load; a first turn in the chat or not),
so each row is also given against its own uncompressed figure: the share of its own uncompressed answers it keeps.

Runs on the other fact-set groups (`--fact-sets more` or `third` in both scripts) pool with the standard ones:
give each side's runs (`--ours` and `--peer` repeated); the counts are summed and the cases matched one to one over
every document.

Usage: python -m benchmarks.followups_compare --ours results/followups-requests/1k [--ours a run on more fact sets]
           --peer results/followups-kvpress [--peer another run] --out results/followups-compare/1k
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _pool(rows: list[dict]) -> dict:
    """One configuration's rows from runs on different documents (fact-set groups) as one row: counts summed,
    per-case records joined, the prefill time averaged over the runs."""
    if len(rows) == 1:
        return rows[0]
    pooled = dict(rows[0])
    for key in ("followups_right", "followups_total"):
        pooled[key] = sum(row[key] for row in rows)
    if all("turns" in row for row in rows):
        pooled["turns"] = [turn for row in rows for turn in row["turns"]]
    prefill = [row["prefill_s"] for row in rows if row.get("prefill_s") is not None]
    pooled["prefill_s"] = sum(prefill) / len(prefill) if prefill else None
    return pooled


def _pooled(groups: dict[str, dict], what: str) -> dict:
    """{group: {config: row}} -> {config: pooled row}, for the configurations every group ran."""
    common = set.intersection(*(set(rows) for rows in groups.values()))
    missing = set.union(*(set(rows) for rows in groups.values())) - common
    if missing:
        print(f"{what}: left out, not run on every fact-set group: {sorted(map(str, missing))}")
    return {config: _pool([rows[config] for rows in groups.values()]) for config in common}


def _ours(folders: list[Path]) -> tuple[dict, dict]:
    """One run of followups.py, or runs of other fact-set groups (--fact-sets) pooled."""
    payloads = [json.loads((folder / "followups.json").read_text()) for folder in folders]
    payload = payloads[0]
    groups: dict[str, dict] = {}
    for other, folder in zip(payloads, folders, strict=True):
        if (other.get("mode"), other["words"]) != (payload.get("mode"), payload["words"]):
            raise SystemExit(f"{folder} is another run of ours ({other['words']} words, mode {other.get('mode')}) "
                             f"than {folders[0]}")
        group = other.get("fact_sets", "standard")
        if group in groups:
            raise SystemExit(f"two runs of ours on the {group!r} fact sets: pool runs of different ones")
        rows = groups[group] = {}
        for row in other["rows"]:
            k = row["knobs"]
            if k["kv_cache_ratio"] >= 1:
                if k.get("attention") != "float32":  # the app's uncompressed chat, as kvpress's peer runs it
                    rows["uncompressed"] = row
            elif k["ced_policy"] == "ced" and k["cold_tier"] != "off":
                rows[k["kv_cache_ratio"]] = row
    return dict(payload, fact_set_groups=sorted(groups)), _pooled(groups, "ours")


def _peer(folders: list[Path]) -> tuple[dict, dict[str, dict]]:
    """One kvpress run, or several runs of the same protocol merged: other presses or ratios on the same fact sets,
    pooled across runs on other fact-set groups (--fact-sets)."""
    payloads = [json.loads((folder / "followups_kvpress.json").read_text()) for folder in folders]
    payload = payloads[0]
    for other, folder in zip(payloads[1:], folders[1:], strict=True):
        if (other["words"], bool(other.get("history"))) != (payload["words"], bool(payload.get("history"))):
            raise SystemExit(f"{folder} is another kvpress run ({other['words']} words, history "
                             f"{bool(other.get('history'))}) than {folders[0]}")
    groups: dict[str, dict] = {}
    for other in payloads:
        rows = groups.setdefault(other.get("fact_set_group", "standard"), {})
        for row in other["rows"]:
            if row["press"] == "none":
                rows[("uncompressed", 1.0)] = row
            else:
                rows[(row["press"].removesuffix("Press"), row["kept_ratio"])] = row
    if any(("uncompressed", 1.0) not in rows for rows in groups.values()):
        raise SystemExit("no kvpress run among " + ", ".join(map(str, folders)) + " has the no-press row"
                         + (" on every fact-set group" if len(groups) > 1 else ""))
    pooled: dict[str, dict] = {}
    for (press, ratio), row in _pooled(groups, "kvpress").items():
        pooled.setdefault(press, {})[ratio] = row
    order = dict.fromkeys("uncompressed" if r["press"] == "none" else r["press"].removesuffix("Press")
                          for other in payloads for r in other["rows"])  # the presses in the order they ran
    presses = {press: pooled[press] for press in order if press in pooled}
    return dict(payload, fact_set_groups=sorted(groups)), presses


def _cases(turns: list[dict]) -> dict[tuple, bool]:
    """Each follow-up about a planted fact (turn >= 1), keyed by its document, the fact its chat asked first and
    its own fact (the same key in both scripts' records), to whether it was answered right."""
    cases, first = {}, None
    for turn in turns:
        if turn["turn"] == 0:
            first = turn["fact"]
        elif turn.get("kind", "fact") == "fact":
            cases[(turn["document"], first, turn["fact"])] = bool(turn["right"])
    return cases


def paired(ours: dict[tuple, bool], peer: dict[tuple, bool]) -> dict:
    """The same follow-ups compared case by case: how many only ours / only the peer answered, and the exact
    two-sided McNemar p (a sign test on those discordant cases): the chance of a split at least that uneven if
    neither were better."""
    if ours.keys() != peer.keys():
        raise SystemExit(f"the runs asked different follow-ups ({len(ours)} against {len(peer)} cases)")
    only_ours = sum(ours[k] and not peer[k] for k in ours)
    only_peer = sum(peer[k] and not ours[k] for k in ours)
    n, low = only_ours + only_peer, min(only_ours, only_peer)
    p = min(1.0, 2 * sum(math.comb(n, k) for k in range(low + 1)) / 2 ** n) if n else 1.0
    return {"only_ours": only_ours, "only_peer": only_peer, "p": p}


def compare(ours_dirs: list[Path], peer_dirs: list[Path]) -> dict:
    ours_payload, ours = _ours(ours_dirs)
    peer_payload, peer = _peer(peer_dirs)
    if ours_payload["fact_set_groups"] != peer_payload["fact_set_groups"]:
        raise SystemExit(f"ours ran the fact sets {ours_payload['fact_set_groups']}, kvpress "
                         f"{peer_payload['fact_set_groups']}: compare the same documents")
    if ours_payload.get("mode") != "requests":
        raise SystemExit(f"{ours_dirs[0]} was run with --mode {ours_payload.get('mode', 'chat')}: the comparison needs "
                         "--mode requests (each follow-up without the earlier follow-ups, as kvpress asks them)")
    if ours_payload["words"] != peer_payload["words"]:
        raise SystemExit(f"different documents: ours {ours_payload['words']} words, kvpress {peer_payload['words']}")
    base_ours = ours["uncompressed"]["followups_right"]
    base_peer = peer["uncompressed"][1.0]["followups_right"]
    total = ours["uncompressed"]["followups_total"]
    ratios = sorted({r for r in ours if r != "uncompressed"} | {r for p, rs in peer.items() if p != "uncompressed"
                                                                 for r in rs}, reverse=True)
    lines = []

    def cell(row, base):
        if row is None:
            return None
        return {"right": row["followups_right"], "total": row["followups_total"],
                "of_uncompressed": row["followups_right"] / base if base else None,
                "short_of_uncompressed": base - row["followups_right"],
                "prefill_s": row.get("prefill_s")}

    for ratio in ratios:
        entry = {"ratio": ratio, "ours": cell(ours.get(ratio), base_ours)}
        for press, rows in peer.items():
            if press != "uncompressed":
                entry[press] = cell(rows.get(ratio), base_peer)
                if entry[press] is not None and entry["ours"] is not None and "turns" in rows[ratio]:
                    # case by case against ours
                    entry[press]["against_ours"] = paired(_cases(ours[ratio]["turns"]),
                                                          _cases(rows[ratio]["turns"]))
        lines.append(entry)
    return {"words": ours_payload["words"], "tokens": ours_payload["tokens"], "followups_total": total,
            "ours_uncompressed": base_ours, "peer_uncompressed": base_peer,
            "presses": [p for p in peer if p != "uncompressed"], "rows": lines,
            "ours_machine": ours_payload["machine"], "peer_machine": peer_payload["machine"],
            "peer_prefill_uncompressed_s": peer["uncompressed"][1.0].get("prefill_s"),
            "peer_history": bool(peer_payload.get("history")),
            "fact_set_groups": ours_payload["fact_set_groups"],
            "sources": {"ours": [str(d) for d in ours_dirs], "peer": [str(d) for d in peer_dirs]}}


def table(result: dict) -> str:
    presses = result["presses"]
    total = result["followups_total"]
    head = ["hot / kept ratio", "ours: tiered CED"] + [f"kvpress {p}" for p in presses]
    protocol = ("after the first question and the answer each one gave it (the same token sequence)"
                if result.get("peer_history") else
                "ours after the first question and its answer, kvpress alone on the compressed document")
    documents = ("" if result.get("fact_set_groups", ["standard"]) == ["standard"] else
                 f" (fact sets {' + '.join(result['fact_set_groups'])} pooled)")
    lines = [f"Follow-ups right (of {total}) on {result['tokens']}-token documents{documents}, each follow-up asked "
             "without the "
             f"earlier follow-ups, {protocol}; in brackets, short of each one's own uncompressed figure (ours "
             f"{result['ours_uncompressed']}/{total}, kvpress {result['peer_uncompressed']}/{total})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [f"{row['ratio']}"]
        for name in ["ours", *presses]:
            c = row.get(name)
            cells.append("" if c is None else f"{c['right']} ({-c['short_of_uncompressed']:+d})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Case by case against ours: follow-ups only ours answered / only the press answered, and the exact "
              "two-sided McNemar p (the chance of a split at least that uneven if neither were better)", "",
              "| hot / kept ratio | " + " | ".join(f"kvpress {p}" for p in presses) + " |",
              "|" + "---|" * (len(presses) + 1)]
    for row in result["rows"]:
        cells = [f"{row['ratio']}"]
        for name in presses:
            pair = (row.get(name) or {}).get("against_ours")
            cells.append("" if pair is None else f"{pair['only_ours']} / {pair['only_peer']}, p = {pair['p']:.2g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, label, style in [("ours", "ours: tiered CED", "s-")] + [(p, f"kvpress {p}", "o--")
                                                                      for p in result["presses"]]:
        points = [(r["ratio"], r[name]["of_uncompressed"]) for r in result["rows"] if r.get(name)]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.axhline(1.0, color="gray", linestyle=":", label="each one's uncompressed")
    ax.set_xlabel("hot / kept ratio")
    ax.set_ylabel("follow-ups right / own uncompressed")
    ax.set_title(f"Follow-up questions, {result['tokens']}-token documents"
                 + ("\n(kvpress after the first exchange)" if result.get("peer_history") else ""), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "followups_compare.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.followups_compare")
    parser.add_argument("--ours", required=True, action="append",
                        help="a folder of `followups.py --mode requests`; repeat it to pool runs of other --fact-sets "
                             "(the kvpress runs must cover the same ones)")
    parser.add_argument("--peer", required=True, action="append",
                        help="a folder of benchmarks/kvpress_peer.py, same --words; repeat it to merge runs of the "
                             "same protocol (other presses or ratios)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = compare([Path(p) for p in args.ours], [Path(p) for p in args.peer])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "followups_compare.json").write_text(json.dumps(result, indent=2))
    (out / "followups_compare.md").write_text(table(result))
    plot(result, out)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
