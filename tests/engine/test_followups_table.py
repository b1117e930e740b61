"""benchmarks/followups.py's table: every row gives its answers right per turn index, as the issue asks, adding up
to the first-question and follow-up totals, and the questions about the speech itself apart."""

from benchmarks.followups import summarise, table


def test_the_table_counts_answers_right_per_turn():
    rights = [(0, True), (1, False), (2, True), (3, True), (0, False), (1, True), (2, True), (3, False)]
    turns = [{"turn": t, "kind": "fact", "right": r, "ttft_s": 0.1 + t / 100, "hot_bytes": 2**20,
              "cold_bytes": 2**21, "uncompressed_bytes": 2**22} for t, r in rights]
    # the questions about the speech come after the facts, and are counted apart
    turns[4:4] = [dict(turns[3], turn=4, kind="content", right=True), dict(turns[3], turn=5, kind="content", right=False)]
    row = summarise({"kv_cache_ratio": 0.3, "cold_tier": "ram", "ced_policy": "ced"}, turns)
    assert (row["first_right"], row["first_total"], row["followups_right"], row["followups_total"]) == (1, 2, 4, 6)
    assert (row["content_right"], row["content_total"]) == (1, 2)
    text = table({"words": 640, "tokens": 943, "alone_right": 0, "alone_total": 0, "documents": ["a"], "rows": [row]})
    line = next(line for line in text.splitlines() if line.startswith("| ced 0.3 + cold tier"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:5] == ["1/2", "4/6", "1 / 1 / 2 / 1", "1/2"]
    assert cells[6:] == ["1.0 MiB", "2.0 MiB", "4.0 MiB"]


def test_followups_answers_lists_every_answer_two_runs_gave_differently(tmp_path):
    """benchmarks/followups_answers.py: the turns whose answer text moved between two runs, and both scores."""
    import json

    from benchmarks.followups_answers import compare, table

    def run(folder, answers, rights):
        turns = [{"document": "d", "turn": i, "question": f"q{i}", "answer": a, "right": r}
                 for i, (a, r) in enumerate(zip(answers, rights, strict=True))]
        rows = [{"knobs": {"kv_cache_ratio": 0.3, "cold_tier": "ram", "ced_policy": "ced"}, "turns": turns,
                 "first_right": int(rights[0]), "followups_right": sum(rights[1:]), "followups_total": 2},
                {"knobs": {"kv_cache_ratio": 0.1, "cold_tier": "ram", "ced_policy": "ced"}, "turns": turns,
                 "first_right": 0, "followups_right": 0, "followups_total": 2}]
        folder.mkdir()
        (folder / "followups.json").write_text(json.dumps({"words": 640, "tokens": 943, "rows": rows[: 1 + (
            folder.name == "this")]}))
        return folder

    this = run(tmp_path / "this", ["Lisbon", "Maria Lopez", "no idea"], [True, True, False])
    before = run(tmp_path / "before", ["Lisbon", "Lopez", "March 14"], [True, True, True])
    result = compare(this, before)
    (row,) = result["rows"]  # the configuration only one run has is left out
    assert row["followups_right"] == [1, 2]
    assert [(m["turn"], m["this"], m["before"]) for m in row["answers_differing"]] == [
        (1, "Maria Lopez", "Lopez"), (2, "no idea", "March 14")]
    assert "| ced 0.3 cold ram | 1 / 1 | 1 / 2 of 2 | 2 of 3 |" in table(result)


def test_followups_compare_merges_kvpress_runs_of_one_protocol(tmp_path):
    """benchmarks/followups_compare.py: several kvpress runs (other presses or ratios) merge into one table, each
    against the no-press row; runs of another protocol (--history or not) or length are refused; the table says
    which protocol the peer ran."""
    import json

    import pytest

    from benchmarks.followups_compare import compare, table

    ours = tmp_path / "ours"
    ours.mkdir()
    row = {"followups_right": 25, "followups_total": 36}
    (ours / "followups.json").write_text(json.dumps({"mode": "requests", "words": 1280, "tokens": 1781, "machine": {},
        "rows": [dict(row, knobs={"kv_cache_ratio": 1.0, "cold_tier": "off", "ced_policy": "ced"},
                      followups_right=23),
                 dict(row, knobs={"kv_cache_ratio": 0.3, "cold_tier": "ram", "ced_policy": "ced"})]}))

    def peer(name, rows, history=True, words=1280):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "followups_kvpress.json").write_text(json.dumps({"words": words, "history": history,
                                                                   "machine": {}, "rows": rows}))
        return folder

    def press(name, kept, right):
        return {"press": name, "kept_ratio": kept, "followups_right": right, "followups_total": 36, "prefill_s": 1.0}

    a = peer("a", [press("none", 1.0, 21), press("KVzipPress", 0.3, 24)])
    b = peer("b", [press("KVzipPress", 0.5, 27), press("SnapKVPress", 0.3, 9)])
    result = compare([ours], [a, b])
    by_ratio = {r["ratio"]: r for r in result["rows"]}
    assert result["peer_uncompressed"] == 21 and result["peer_history"]
    assert by_ratio[0.3]["KVzip"]["right"] == 24 and by_ratio[0.3]["SnapKV"]["short_of_uncompressed"] == 12
    assert by_ratio[0.5]["KVzip"]["right"] == 27 and by_ratio[0.5]["ours"] is None
    assert "after the first question and the answer each one gave it" in table(result)
    assert "| 0.3 | 25 (+2) | 24 (+3) | 9 (-12) |" in table(result)
    with pytest.raises(SystemExit, match="another kvpress run"):
        compare([ours], [a, peer("alone", [press("KVzipPress", 0.2, 29)], history=False)])
    with pytest.raises(SystemExit, match="no-press row"):
        compare([ours], [b])


def test_followups_compare_pairs_the_same_follow_ups_case_by_case():
    """Each follow-up is matched across the two scripts' records by its document, its chat's first fact and its
    own fact (content questions and first questions left out); the discordant cases give the exact McNemar p."""
    import pytest

    from benchmarks.followups_compare import _cases, paired

    def turns(rights, kinds=None):
        out = []
        for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
            for turn, fact in enumerate(order):
                out.append({"document": "d", "turn": turn, "fact": fact, "right": rights.pop(0)})
        if kinds:
            out.append({"document": "d", "turn": 4, "fact": None, "kind": "content", "right": True})
        return out

    ours = _cases(turns([True, True, True, False, False, True, True, True], kinds=True))
    assert len(ours) == 6 and ours[("d", 0, 3)] is False and ours[("d", 3, 0)] is True  # chat order, facts
    theirs = _cases(turns([False, False, False, True, True, False, False, False]))
    assert paired(ours, theirs) == {"only_ours": 5, "only_peer": 1, "p": pytest.approx(14 / 64)}  # 2 (1 + 6) / 2^6
    assert paired(ours, ours) == {"only_ours": 0, "only_peer": 0, "p": 1.0}
    all_wrong = {k: False for k in ours}
    all_right = {k: True for k in ours}
    assert paired(all_right, all_wrong)["p"] == pytest.approx(2 / 64)
    with pytest.raises(SystemExit, match="different follow-ups"):
        paired(ours, dict(list(theirs.items())[:5]))


def test_followups_compare_pools_runs_on_other_fact_sets(tmp_path):
    """Runs of ours and of kvpress on the standard and the six more fact sets pool into one table: counts summed,
    cases matched over both; a side missing a group, or two runs of ours on one group, are refused."""
    import json

    import pytest

    from benchmarks.followups_compare import compare

    def turns(document, rights):
        return [{"document": document, "turn": t, "fact": t, "right": r} for t, r in enumerate(rights)]

    def ours(name, group, uncompressed, tiered):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"knobs": {"kv_cache_ratio": ratio, "cold_tier": tier, "ced_policy": "ced"},
                 "followups_right": sum(rights[1:]), "followups_total": 3, "turns": turns(group, rights)}
                for ratio, tier, rights in ((1.0, "off", uncompressed), (0.2, "ram", tiered))]
        (folder / "followups.json").write_text(json.dumps({"mode": "requests", "words": 640, "tokens": 943,
                                                           "machine": {}, "fact_sets": group, "rows": rows}))
        return folder

    def peer(name, group, uncompressed, kvzip):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"press": press, "kept_ratio": kept, "followups_right": sum(rights[1:]), "followups_total": 3,
                 "prefill_s": prefill, "turns": turns(group, rights)}
                for press, kept, rights, prefill in (("none", 1.0, uncompressed, 1.0), ("KVzipPress", 0.2, kvzip, 3.0))]
        (folder / "followups_kvpress.json").write_text(json.dumps(
            {"words": 640, "history": True, "machine": {}, "rows": rows}
            | ({"fact_set_group": group} if group != "standard" else {})))
        return folder

    mine = [ours("s", "standard", [1, 1, 1, 1], [1, 1, 1, 0]), ours("m", "more", [1, 1, 0, 1], [1, 1, 1, 1])]
    theirs = [peer("ps", "standard", [1, 1, 1, 1], [1, 0, 0, 1]), peer("pm", "more", [1, 0, 1, 1], [1, 1, 0, 0])]
    result = compare(mine, theirs)
    row = result["rows"][0]
    assert result["followups_total"] == 6 and result["ours_uncompressed"] == 5 and result["peer_uncompressed"] == 5
    assert row["ours"]["right"] == 5 and row["KVzip"]["right"] == 2 and row["KVzip"]["prefill_s"] == 3.0
    assert row["KVzip"]["against_ours"]["only_ours"] == 4 and row["KVzip"]["against_ours"]["only_peer"] == 1
    assert result["fact_set_groups"] == ["more", "standard"]
    with pytest.raises(SystemExit, match="compare the same documents"):
        compare(mine, theirs[:1])
    with pytest.raises(SystemExit, match="two runs of ours"):
        compare([mine[0], mine[0]], theirs)


def test_the_float32_reference_row_is_named_apart_and_its_chats_attend_in_float32():
    """benchmarks/followups.py --float32-reference: a second uncompressed row, named so, whose chats (forks
    included, which make their caches through the model) attend without bf16 rounding; the model is left as it was."""
    from types import SimpleNamespace

    from benchmarks.followups import float32_attention

    row = summarise({"kv_cache_ratio": 1.0, "cold_tier": "off", "ced_policy": "ced", "attention": "float32"},
                    [{"turn": 0, "kind": "fact", "right": True, "ttft_s": 0.1, "hot_bytes": 1, "cold_bytes": 0,
                      "uncompressed_bytes": 1}, {"turn": 1, "kind": "fact", "right": False, "ttft_s": 0.1,
                                                 "hot_bytes": 1, "cold_bytes": 0, "uncompressed_bytes": 1}])
    text = table({"words": 640, "tokens": 943, "alone_right": 0, "alone_total": 0, "documents": ["a"], "rows": [row]})
    assert "| uncompressed, float32 attention | 1/1 | 0/1 |" in text

    class Model:
        def new_cache(self):
            return SimpleNamespace(prefill_bf16=True)

    model = Model()
    with float32_attention(model, True):
        assert model.new_cache().prefill_bf16 is False
    assert model.new_cache().prefill_bf16 is True
    with float32_attention(model, False):
        assert model.new_cache().prefill_bf16 is True


def test_every_fact_set_group_asks_facts_the_speech_does_not_already_answer():
    """A planted fact's answer key must not occur in the speech text around it (a reply quoting the speech would
    count as right), and no speech serves two groups (pooled runs must be independent documents)."""
    from benchmarks.corpus import speech
    from benchmarks.followup_cases import DEPTHS, GROUPS

    seen = set()
    for group, sets in GROUPS.items():
        assert len(sets) == 6, group
        for name, facts in sets:
            assert name not in seen, name
            seen.add(name)
            assert len(facts) == len(DEPTHS)
            text = " ".join(speech(name).split()[:1280]).lower()
            for statement, question, key in facts:
                assert key in statement.lower(), (name, key)
                assert key not in question.lower(), (name, key)
                assert key not in text, (name, key)
