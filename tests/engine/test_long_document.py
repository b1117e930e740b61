"""A 16k-token document through the default model stays within its prefill headroom."""

import pytest

from benchmarks.corpus import speech
from engine import Done, DSV41Config, DSV41Model, PrefillProgress

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_16k_document_never_exceeds_headroom_and_ends_at_budget(tmp_path):
    model = DSV41Model.from_pretrained(DSV41Config(
        max_seq_len=20000, allow_position_extrapolation=True, kv_cache_ratio=0.2, prefill_headroom=4096,
        csa2_topk=256))
    text = "\n\n".join(speech(n) for n in ("2022-Biden-1", "2023-Biden-1", "2024-Biden-1", "2026-Trump-1"))
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"][:16000]
    doc = tmp_path / "speeches.txt"
    doc.write_text(model.tokenizer.decode(ids))
    session = model.chat_session()
    peaks, done = [], None
    for event in session.send("Which president gave these speeches?", documents=[str(doc)], greedy=True,
                              max_new_tokens=8):
        if isinstance(event, PrefillProgress):
            peaks.append(session.cache.stored)
        elif isinstance(event, Done):
            done = event
    assert done.reason in ("eos", "length"), done
    assert session.cache.seen > 16000
    assert max(peaks) <= 4096
    assert session.cache.stored <= session.cache.budget() == -(-session.cache.seen * 2 // 10)
    stats = session.cache.stats()
    assert stats.compactions >= 3 and stats.compression_ratio < 0.25
    assert all(n <= 4096 for n in stats.stored_per_layer)
