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


def _why(seen, stored, byte_ratio, *, applies=True, **knobs):
    from engine.cache.budget import explain_ratio
    from engine.cache.settings import CacheSettings

    return explain_ratio(seen=seen, stored=stored, byte_ratio=byte_ratio, settings=CacheSettings(**knobs),
                         threshold_applies=applies)


def test_the_ratio_the_slider_asks_for_against_the_caches_is_explained():
    # they agree: nothing to say
    assert _why(1_000, 500, 0.50, kv_cache_ratio=0.5) == ""
    # slider 0.50, cache x0.21: the threshold compressed harder (not with the cold tier on: it does not apply)
    assert _why(1_000, 210, 0.21, kv_cache_ratio=0.5, ced_threshold=0.1) == "threshold 0.10 removed more"
    assert _why(1_000, 210, 0.21, kv_cache_ratio=0.5, ced_threshold=0.1, applies=False) == "compacted further"
    # a short chat stays whole under the budget floor
    assert _why(100, 100, 1.0, kv_cache_ratio=0.5) == "a short chat is kept whole (floor 128 entries)"
    assert _why(177, 128, 0.72, kv_cache_ratio=0.5) == "the cache never keeps fewer than 128 entries"
    # a reply grew past the budget and waits for the end-of-turn compaction
    assert _why(1_000, 540, 0.54, kv_cache_ratio=0.5) == "40 reply entries wait for the turn's compaction"
    # slider 1.00, cache x1.05: positions and scores ride along with every entry
    assert _why(1_000, 1_000, 1.047, kv_cache_ratio=1.0) == "+5 % for positions and scores"
    # INT8 halves the bytes of what is kept
    assert _why(1_000, 500, 0.26, kv_cache_ratio=0.5, kv_cache_dtype="int8") == "INT8: ×0.52 of the bytes"
    assert _why(0, 0, 1.0) == ""


def test_a_real_caches_report_carries_the_target_and_the_reason(tiny_model):
    import torch

    from engine.cache import DSV41Cache
    from engine.cache.settings import CacheSettings
    from engine.models import adapter

    model = tiny_model()
    adapter.install(model)
    layers, kv_heads, head_dim = adapter.kv_geometry(model)
    cache = DSV41Cache(layers, kv_heads, head_dim, torch.float32, "cpu", CacheSettings(kv_cache_ratio=1.0))
    adapter.forward(model, torch.randint(0, 256, (1, 64)), cache, prefill=True)
    ratio = cache.stored_kv_bytes() / cache.uncompressed_bytes()
    assert ratio > 1.0  # head_dim 16: positions, scores and counts are a large share of an entry
    assert cache.ratio_reason(ratio) == f"+{(ratio - 1) * 100:.0f} % for positions and scores"


def test_a_chats_report_counts_every_layer_when_the_threshold_cut_them_apart(tiny_folder):
    """With the CED threshold on and no cold tier, each layer keeps the count its own scores want. The report's
    stored entries are the layers' mean, so its kept share is the share of the KV kept, and the reason and the
    quality warning follow it: here layer 0 keeps over 30 % of what was read, the other layer the floor, the cache
    as a whole under 30 % (docs/reliability.md: the warning also comes when the threshold took the cache that low)."""
    import torch

    from engine import DSV41Config, DSV41Model

    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, kv_cache_ratio=0.4,
                                                   cold_tier="off", ced_threshold=0.5, csa2_topk=0))
    session = model.chat_session()
    document = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(45))
    list(session.send(document + "\n\nWhat is the value of item 3?", max_new_tokens=6, greedy=True))
    cache = session.cache
    other = cache.layers[1]
    with torch.inference_mode():  # this layer's attention sits on a few entries: the threshold keeps the floor
        other.scores[:, : other.length] = 0.0
        other.scores[:, 100:104] = 1.0
    cache.compact()
    lengths = [layer.length for layer in cache.layers]
    seen = cache.seen
    assert lengths[1] == cache.settings.min_entries and lengths[0] / seen >= QUALITY_KEPT_SHARE

    report = model.memory_report(cache)
    assert report.tokens_seen == seen and report.kv_stored_tokens == round(sum(lengths) / len(lengths))
    kept = sum(lengths) / (len(lengths) * seen)  # the KV bytes kept over the uncompressed KV's, bookkeeping aside
    assert abs(report.kept_share - kept) <= 0.5 / seen and round(report.kept_share, 2) < QUALITY_KEPT_SHARE
    assert report.kv_ratio_reason.startswith("threshold 0.50 removed more")
    hint = report.quality_hint()
    assert hint is not None and f"keeps {report.kept_share * 100:.0f} % of the {seen:,} tokens" in hint
    assert report.short_hint() is not None
