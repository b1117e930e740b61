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
