"""MemoryReport's hints: the KV-over-weights rule and the warning when quality must drop."""

from __future__ import annotations

from engine.memory import QUALITY_KEPT_SHARE, MemoryReport


def report(seen: int, stored: int, kv_stored: int = 1_000) -> MemoryReport:
    return MemoryReport("cpu", "CPU", 100_000_000, kv_stored, kv_stored * 2, 0, 0, 1 << 34, 1 << 33, seen, stored)


def test_no_hint_at_the_default_ratio_or_before_compaction():
    assert report(0, 0).hint() is None
    assert report(6_900, 3_450).hint() is None  # ratio 0.5, the default
    assert report(6_758, 2_028).hint() is None  # ratio 0.3: 30.0 % kept
    assert report(100, 100).quality_hint() is None


def test_keeping_less_than_the_measured_share_warns_with_the_figures():
    hint = report(6_747, 1_350).hint()  # ratio 0.2
    assert hint is not None and "20 %" in hint and "6,747" in hint and "raise the cache ratio" in hint
    assert report(10_000, int(10_000 * (QUALITY_KEPT_SHARE - 0.02))).quality_hint() is not None


def test_both_hints_are_said_together():
    hint = report(10_000, 1_000, kv_stored=40_000_000).hint()
    assert "30 % of the weights" in hint and "10 % of the 10,000 tokens" in hint


def test_the_printed_report_keeps_the_four_seed_lines_first_and_adds_the_cold_tier_and_saved_caches():
    from dataclasses import replace

    plain = report(1_000, 500, kv_stored=2**30).format_text().splitlines()
    assert [line.split(":")[0] for line in plain] == ["Model weights", "KV Cache", "Activation", "Total"]
    tiered = replace(report(1_000, 500, kv_stored=2**30), kv_cold=2**29, kv_cold_disk=2**30, recall_s=0.0421,
                     saved_caches=3 * 2**30).format_text().splitlines()
    assert tiered[:4] == plain[:3] + [tiered[3]] and tiered[3].startswith("Total: ")
    assert tiered[4] == "KV Cold tier: 0.50 GB host RAM + 1.00 GB disk (recalled per question; last recall 42 ms)"
    assert tiered[5] == "Saved chat caches: 3.00 GB (disk)"
