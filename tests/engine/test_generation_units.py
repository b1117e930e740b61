"""Sampling functions, the incremental detokenizer, chunking and stop-string hold-back."""

import pytest
import torch

from engine import ConfigError, GenerationSettings
from engine.detokenizer import IncrementalDetokenizer
from engine.generate import RecentIds, _chunk_bounds, _cut_at_stop, _held_back
from engine.sampling import apply_repetition_penalty, logits_to_probs, next_token, sample, sample_tensor


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = logits_to_probs(logits, 1.0, top_k=2, top_p=1.0)
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    probs = logits_to_probs(logits, 1.0, top_k=0, top_p=0.5)
    assert probs[0] == 1.0  # the top token alone already has >= 0.5 of the mass


def test_top_p_within_top_k_is_the_same_distribution_as_over_the_vocabulary():
    from engine.sampling import head_probs

    logits = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_k, top_p in ((0.7, 50, 0.9), (1.0, 10, 1.0), (1.3, 200, 0.5)):
        full = logits_to_probs(logits, temperature, top_k, top_p)
        probs, ids = head_probs(logits, temperature, top_k, top_p)
        assert ids.shape == (top_k,) and torch.allclose(full[ids], probs, atol=1e-6)
        assert torch.isclose(full[ids].sum(), torch.tensor(1.0), atol=1e-5)  # nothing outside the head
    # draws follow it: a seeded run picks only head tokens, and is reproducible
    settings = GenerationSettings(temperature=0.7, top_k=50, top_p=0.9, seed=1)
    none = torch.tensor([], dtype=torch.long)
    draws = [sample(logits, settings, none, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert draws[0] == draws[1] and draws[0] in head_probs(logits, 0.7, 50, 0.9)[1].tolist()
    counts = torch.zeros(5000)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[sample(logits, settings, none, g)] += 1
    expected = logits_to_probs(logits, 0.7, 50, 0.9)
    assert (counts[expected == 0] == 0).all()
    assert torch.allclose(counts / 3000, expected, atol=0.03)


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


@pytest.mark.parametrize("in_place", ["numpy", "tensor"])
def test_the_penalty_window_holds_the_last_tokens_whatever_their_order(in_place):
    """RecentIds: the prompt's last `window` ids, then each new token in place of the oldest; its `ids` are always
    the multiset of the last `window` tokens (the order is the ring's), and what the penalty does with them is
    what it does with those tokens in order. "tensor": the write a GPU's ring takes (no numpy view)."""
    window = 5
    recent = RecentIds([9, 8, 7], window, torch.device("cpu"))
    if in_place == "tensor":
        recent._host = None
    history = [9, 8, 7]
    assert sorted(recent.ids.tolist()) == sorted(history)
    for n, token in enumerate([3, 3, 1, 4, 0, 2, 6]):
        recent.push(token, torch.tensor([token]) if n % 2 else None)
        history.append(token)
        assert sorted(recent.ids.tolist()) == sorted(history[-window:])
    logits = torch.randn(10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(apply_repetition_penalty(logits, recent.ids, 1.5),
                       apply_repetition_penalty(logits, torch.tensor(history[-window:]), 1.5))
    long_prompt = RecentIds(list(range(20)), window, torch.device("cpu"))
    assert sorted(long_prompt.ids.tolist()) == list(range(15, 20)) and long_prompt.ids.numel() == window
    assert RecentIds([], window, torch.device("cpu")).ids.numel() == 0


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1000)
    settings = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0)
    draws = [[sample(logits, settings, torch.tensor([], dtype=torch.long), torch.Generator().manual_seed(7))
              for _ in range(1)] for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    assert sample(logits, GenerationSettings(greedy=True), torch.tensor([], dtype=torch.long), None) == int(logits.argmax())


def test_greedy_takes_the_first_maximum_on_every_path():
    """Greedy is the first largest logit (numpy's argmax on CPU float32 logits, torch's elsewhere), ties and NaN
    included, after the repetition penalty, as a one-element long tensor."""
    no_ids = torch.tensor([], dtype=torch.long)
    greedy = GenerationSettings(greedy=True)
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    for values in (logits, logits.double(), logits[::1].clone().as_strided((3,), (2,))):
        token = sample_tensor(values, greedy, no_ids, None)
        assert token.dtype == torch.long and token.shape == (1,) and int(token) == int(torch.argmax(values))
    assert int(sample_tensor(logits, greedy, no_ids, None)) == 1  # the first of two equal maxima
    assert int(sample_tensor(torch.tensor([1.0, float("nan"), 5.0]), greedy, no_ids, None)) == 1
    penalised = GenerationSettings(greedy=True, repetition_penalty=2.0)
    assert int(sample_tensor(torch.tensor([3.0, 2.0, 1.0]), penalised, torch.tensor([0]), None)) == 1
    with torch.inference_mode():  # the decode loop's logits are inference tensors
        big = torch.randn(49152, generator=torch.Generator().manual_seed(2))
        assert int(sample_tensor(big, greedy, no_ids, None)) == int(torch.argmax(big))


def test_next_token_reads_greedy_cpu_logits_on_the_host_and_draws_the_rest_as_sample_tensor():
    """The turn loop's sampler: greedy over float32 CPU logits without a penalty is numpy's argmax as a host int (no
    tensor made: None); a penalty on greedy, or other logits, go through sample_tensor, whose tensor comes back
    beside its value (the repetition window and a GPU's feed use it)."""
    no_ids = torch.tensor([], dtype=torch.long)
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    greedy = GenerationSettings(greedy=True, repetition_penalty=1.0)
    assert next_token(logits, greedy, no_ids, None) == (1, None)
    assert next_token(torch.tensor([1.0, float("nan"), 5.0]), greedy, no_ids, None) == (1, None)
    token, ids = next_token(torch.tensor([3.0, 2.0, 1.0]), GenerationSettings(greedy=True, repetition_penalty=2.0),
                            torch.tensor([0]), None)
    assert token == 1 and ids.dtype == torch.long and ids.shape == (1,) and int(ids) == 1
    token, ids = next_token(logits.double(), greedy, no_ids, None)
    assert token == 1 and int(ids) == 1
    settings = GenerationSettings(temperature=0.8, top_k=3, seed=5)  # (float32 CPU logits: tests/engine/test_sample_kernel.py)
    for seed in range(5):
        token, ids = next_token(logits.double(), settings, no_ids, torch.Generator().manual_seed(seed))
        assert token == int(ids) == int(sample_tensor(logits.double(), settings, no_ids,
                                                      torch.Generator().manual_seed(seed)))


def test_generation_settings_are_validated():
    with pytest.raises(ConfigError, match="top_p"):
        GenerationSettings(top_p=0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationSettings(max_new_tokens=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loader import resolve_source

    return AutoTokenizer.from_pretrained(str(resolve_source("default").path))


@pytest.mark.parametrize("text", ["北京是中国的首都。", "Hello 👋🏽 world 🚀!", "混合 mixed 文本 and 😀 emoji"])
def test_detokenizer_never_splits_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # multi-byte characters span several byte-level tokens: some pushes must have held text back
    assert len(ids) > len([p for p in pieces if p])


def test_detokenizer_decodes_a_single_token_once_per_tokenizer(tokenizer, monkeypatch):
    """A window of one token is decoded once per tokenizer and then read from its table: a reply's text is the same
    as with every window decoded, with about half the decodes (push() decodes two windows a token, the first most
    often the one token emitted before)."""
    text = "The same words, the same words again: 北京, 北京, 北京. The same words."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    calls = []
    decode = type(tokenizer).decode
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, i, **k: calls.append(list(i)) or decode(self, i, **k))
    pieces, counts = [], []
    for table in (None, None, {}):  # the second reply finds the first one's single tokens; the third has no table
        calls.clear()
        detok = IncrementalDetokenizer(tokenizer)
        if table is not None:
            detok._single = type("NoTable", (dict,), {"__setitem__": lambda *a: None})()
        pieces.append("".join([detok.push(i) for i in ids] + [detok.flush()]))
        counts.append((len(calls), sum(len(c) == 1 for c in calls)))
    assert pieces == [text] * 3
    assert counts[0][1] <= len(set(ids)) and counts[1][1] == 0  # each single token decoded once for the tokenizer
    assert counts[1][0] < 0.7 * counts[2][0]  # 40 against 64 here: the multi-byte characters take wider windows
    other = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)  # a table of its own
    assert other._single is not IncrementalDetokenizer(tokenizer)._single


def test_detokenizer_drops_an_incomplete_trailing_character(tokenizer):
    ids = tokenizer("好", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids[:-1]] + [detok.flush()]
    assert "".join(pieces) == ""


def test_chunks_end_with_the_whole_question():
    bounds = _chunk_bounds(1000, 256, 40)
    assert bounds[-1] == (768, 1000)  # the question joins the last 192-token document piece
    assert _chunk_bounds(1030, 256, 60)[-2:] == [(768, 970), (970, 1030)]  # would not fit: its own chunk
    assert _chunk_bounds(1000, 256, 300)[-2:] == [(700, 956), (956, 1000)]  # a long question spans chunks
    bounds = _chunk_bounds(1000, 256, 40)
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(e - s <= 256 for s, e in bounds)
    assert _chunk_bounds(100, 256, 0) == [(0, 100)]


def test_stop_strings_are_cut_and_held_back():
    assert _cut_at_stop("abc STOP def", ("STOP",)) == ("abc ", True)
    assert _held_back("abc ST", ("STOP",)) == 2
    assert _held_back("abc", ("STOP",)) == 0


def test_decode_speed_counts_the_reply_and_not_the_compaction_after_it(tiny_folder, monkeypatch):
    """decode_tok_s is the reply's tokens after the first over the time from the first to the last: the turn's
    compaction after the reply (finish_turn) is in total_s and compaction_s, not in the decode speed."""
    import time

    from engine import DSV41Config, DSV41Model
    from engine.cache import kv_cache
    from engine.events import Done

    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=1024, kv_cache_ratio=0.5))
    real = kv_cache.DSV41Cache.finish_turn
    monkeypatch.setattr(kv_cache.DSV41Cache, "finish_turn", lambda self, *a, **k: time.sleep(0.4) or real(self, *a, **k))
    session = model.chat_session()
    done = [e for e in session.send("Count: one two three four", max_new_tokens=12, greedy=True, ignore_eos=True)
            if isinstance(e, Done)][0]
    stats = done.stats
    assert stats.decode_tokens == 12 and stats.decode_tok_s > 0
    decode_s = (stats.decode_tokens - 1) / stats.decode_tok_s
    assert stats.total_s - stats.ttft_s >= decode_s + 0.39  # the sleep is after the last token, outside decode_s
