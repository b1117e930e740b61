"""Integration: the real default model (SmolLM2-135M-Instruct) through our loop."""

import threading
import time

import pytest

from engine import ContextOverflowError, Done, PrefillProgress, TokenText, TurnStats
from engine.kernels.gguf_blocks import float_activations
from engine.model import collect_text

pytestmark = pytest.mark.model


def run(session, prompt, **kw):
    events = list(session.send(prompt, **kw))
    done = events[-1]
    assert isinstance(done, Done)
    return events, done


def test_capital_of_france_greedy(default_model):
    events, done = run(default_model.chat_session(), "What is the capital of France?", greedy=True, max_new_tokens=32)
    assert "Paris" in done.text
    assert done.reason == "eos"
    stats = [e for e in events if isinstance(e, TurnStats)][0]
    assert stats.prefill_tokens > 10 and stats.decode_tokens > 3
    assert stats.ttft_s > 0 and stats.decode_tok_s > 0


def test_greedy_is_deterministic_and_streamed_text_equals_reply(default_model):
    a_events, a = run(default_model.chat_session(), "Name three colours.", greedy=True, max_new_tokens=24)
    _, b = run(default_model.chat_session(), "Name three colours.", greedy=True, max_new_tokens=24)
    assert a.text == b.text and a.text
    assert collect_text(a_events) == a.text
    assert default_model.generate("Name three colours.", greedy=True, max_new_tokens=24) == a.text


def test_same_seed_same_text_different_seed_differs(default_model):
    kw = dict(temperature=1.0, top_p=0.95, seed=1234, max_new_tokens=24)
    texts = [run(default_model.chat_session(), "Write a short poem about the sea.", **kw)[1].text for _ in range(2)]
    other = run(default_model.chat_session(), "Write a short poem about the sea.", **{**kw, "seed": 99})[1].text
    assert texts[0] == texts[1]
    assert other != texts[0]


def test_chinese_streams_without_replacement_characters(default_model):
    events, done = run(default_model.chat_session(), "请用中文介绍一下北京。", greedy=True, max_new_tokens=48)
    pieces = [e.text for e in events if isinstance(e, TokenText)]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in done.text), done.text
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == done.text


def test_second_turn_prefills_only_its_new_tokens(default_model):
    session = default_model.chat_session()
    _, first = run(session, "What is the capital of France?", greedy=True, max_new_tokens=16)
    seen_after_first = session.cache.seen
    turn = session.prepare("And of Italy?")
    assert not turn.rebuild
    assert len(turn.new_ids) < 20
    _, second = run(session, "And of Italy?", greedy=True, max_new_tokens=16)
    assert second.stats.prefill_tokens == len(turn.new_ids)
    assert session.cache.seen >= seen_after_first + len(turn.new_ids)
    assert not second.stats.rebuilt_context
    assert "Rome" in second.text


def test_cancel_returns_within_one_second(default_model):
    session = default_model.chat_session()
    cancel = threading.Event()
    events = []

    def consume():
        for event in session.send("Tell me a very long story about dragons.", cancel=cancel, max_new_tokens=2000,
                                  temperature=0.8, seed=3):
            events.append(event)

    worker = threading.Thread(target=consume)
    worker.start()
    deadline = time.time() + 30
    while not any(isinstance(e, TokenText) and e.text for e in events) and time.time() < deadline:
        time.sleep(0.01)
    asked = time.perf_counter()
    cancel.set()
    worker.join(5)
    elapsed = time.perf_counter() - asked
    assert not worker.is_alive()
    assert elapsed < 1.0, elapsed
    assert events[-1].reason == "cancelled"
    # the session stays usable, and the partial reply is kept in the history
    assert session.messages[-1]["role"] == "assistant" and session.messages[-1]["content"] == events[-1].text
    _, done = run(session, "Thanks. What is 2 + 2?", greedy=True, max_new_tokens=8)
    assert done.reason in ("eos", "length")


def test_cancel_during_prefill_leaves_the_session_as_it_was(default_model):
    session = default_model.chat_session()
    run(session, "Hello!", greedy=True, max_new_tokens=4)
    seen = session.cache.seen
    cancel = threading.Event()
    stream = session.send("word " * 1500, cancel=cancel, max_new_tokens=4)
    first = next(stream)
    assert isinstance(first, PrefillProgress)
    cancel.set()
    rest = list(stream)
    assert rest[-1].reason == "cancelled"
    assert session.cache.seen == seen and len(session.messages) == 2
    assert not session.prepare("Hi again").rebuild


def test_turn_that_cannot_fit_is_refused_before_any_work(default_model):
    session = default_model.chat_session()
    with pytest.raises(ContextOverflowError) as err:
        session.send("word " * 5000)
    assert err.value.needed > err.value.limit == 4096
    assert "4096" in str(err.value) and "max_seq_len" in str(err.value)
    assert session.cache.seen == 0 and session.messages == []


def test_stop_string_ends_the_reply(default_model):
    _, done = run(default_model.chat_session(), "Count from 1 to 10, separated by commas.", greedy=True,
                  max_new_tokens=60, stop=("5",))
    assert done.reason == "stop"
    assert "5" not in done.text and "4" in done.text


def test_document_turn_answers_from_the_document(default_model, tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text("# Team notes\n\nThe project codename is BLUEHERON. The launch is planned for March.\n")
    session = default_model.chat_session()
    turn = session.prepare("What is the project codename?", [str(doc)])
    assert turn.usage.documents > 15 and turn.usage.prompt >= 6
    _, done = run(session, "What is the project codename?", documents=[str(doc)], greedy=True, max_new_tokens=24)
    assert "BLUEHERON" in done.text.upper().replace(" ", "")
    assert 'notes.md' in session.messages[-2]["content"]


def test_bad_document_changes_nothing(default_model, tmp_path):
    from engine.documents import DocumentError

    session = default_model.chat_session()
    bad = tmp_path / "blob.txt"
    bad.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DocumentError):
        session.send("Summarise", documents=[str(bad)])
    assert session.cache.seen == 0 and session.messages == []


def test_memory_report_and_seed_print(default_model, capsys):
    session = default_model.chat_session()
    run(session, "Hello there!", greedy=True, max_new_tokens=8)
    report = default_model.print_memory_usage(session.cache)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Model weights: ") and out[0].endswith(" GB")
    assert out[1].startswith("KV Cache: ") and "(compressed from " in out[1]
    assert out[2].startswith("Activation: ") and out[3].startswith("Total: ")
    assert report.device == "cpu" and report.device_label.startswith("CPU")
    # weights: 135M parameters, tied embeddings counted once. The default load holds the matrices as the GGUF
    # file stores them (engine.kernels.gguf_blocks): the weights line is the file's tensor bytes (the norms are
    # float32 there too; the rotary module's few inverse frequencies besides); as bf16 (DSV41_GGUF_BLOCKS=0)
    # 2 bytes a weight, else float32
    from engine.gguf_index import tensor_index
    from engine.loader import default_gguf_path
    from engine.models import adapter

    held = adapter.packed_format(default_model.hf_model)
    if held == "GGUF Q4_1 + Q8_0":
        file_bytes = sum(entry.nbytes for entry in tensor_index(default_gguf_path()).values())
        assert file_bytes <= report.weights < file_bytes + 4096
    elif held == "bf16":
        assert 0.25e9 < report.weights < 0.3e9
    else:
        assert 0.45e9 < report.weights < 0.6e9
    import torch

    # the KV cache holds bf16 under the default load's bf16 prefill (DSV41Model.kv_dtype): 2 bytes an element
    element = 2 if adapter.prefill_bf16(default_model.hf_model) else 4
    assert default_model.kv_dtype == (torch.bfloat16 if element == 2 else torch.float32)
    expected_full = session.cache.seen * 30 * 2 * 3 * 64 * element
    assert report.kv_uncompressed == expected_full
    assert report.kv_stored > 0 and report.total > report.free > 0


def test_warmup_returns_ttfts(default_model):
    ttfts = default_model.warmup(sample_inputs=["你好", "请介绍一下你自己"])
    assert len(ttfts) == 2 and all(t > 0 for t in ttfts)


@pytest.mark.parametrize("held", ["as loaded", "float32"])
def test_plain_cache_reproduces_transformers_logits_on_the_default_model(default_model, held):
    """kv_cache_ratio 1 and dense attention give transformers' logits on the same weights: the default load
    holds the matrices as the GGUF's own blocks, whose values are the converted float32 weights transformers loads
    (held as bf16 instead, DSV41_GGUF_BLOCKS=0, its reference gets the same bf16 values in float32);
    dtype="float32" keeps the converted float32 values and matches them as they are."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import DSV41Config, DSV41Model
    from engine.models import adapter

    model = default_model if held == "as loaded" else DSV41Model.from_pretrained(DSV41Config(dtype="float32"))
    if held == "float32":
        assert adapter.packed_format(model.hf_model) is None
    else:
        assert adapter.packed_format(model.hf_model) in ("GGUF Q4_1 + Q8_0", "bf16")
    from engine.loader import resolve_source

    reference_model = AutoModelForCausalLM.from_pretrained(resolve_source("default").path, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    if adapter.packed_format(model.hf_model) == "bf16":
        with torch.no_grad():
            for p in reference_model.parameters():
                if p.dim() == 2:
                    p.copy_(p.bfloat16().float())
    default_model = model
    prefill_bf16 = adapter.prefill_bf16(model.hf_model)
    adapter.set_prefill_bf16(model.hf_model, False)  # exactness: float32 products (the bf16 prefill: next test)
    try:
        with float_activations():  # and the one-token steps' Q4 products on float32 x (their int8 x: test_gguf_blocks)
            got, reference = _against_reference(default_model, reference_model)
    finally:
        adapter.set_prefill_bf16(model.hf_model, prefill_bf16)
    assert torch.allclose(got, reference, atol=2e-4, rtol=1e-4), (got - reference).abs().max()


def test_default_model_prefills_in_bf16_within_bf16_rounding_of_float32(default_model, monkeypatch):
    """The default load (a Q4_1 checkpoint, weights held rounded to bf16) prefills in bf16: its attention, and its
    products where the CPU has bf16 dot products (test_cpu_kernels). Those bf16 products (forced here, so any CPU
    checks them) keep the logits close to the float32 products' (one-token steps keep float32 products)."""
    from engine import DSV41Config, DSV41Model
    from engine.kernels import bf16_products_fast
    from engine.models import adapter

    hf = default_model.hf_model
    assert adapter.prefill_bf16(hf)
    assert default_model.info.prefill_bf16 == adapter.prefill_products_bf16(hf) == bf16_products_fast()
    exact_model = DSV41Model.from_pretrained(DSV41Config(dtype="float32"))
    assert not adapter.prefill_bf16(exact_model.hf_model) and not exact_model.info.prefill_bf16
    monkeypatch.setenv("DSV41_BF16_PRODUCTS", "1")
    try:
        adapter.set_prefill_bf16(hf, True)
        assert adapter.prefill_products_bf16(hf)
        got, _ = _against_reference(default_model, None)
        adapter.set_prefill_bf16(hf, False)
        exact, _ = _against_reference(default_model, None)
    finally:
        monkeypatch.delenv("DSV41_BF16_PRODUCTS")
        adapter.set_prefill_bf16(hf, True)
    assert adapter.prefill_products_bf16(hf) == bf16_products_fast()
    n = got.shape[1] - 4
    error = (got[:, :n] - exact[:, :n]).abs()
    scale = exact.abs().max()
    assert 0 < error.max() < 0.05 * scale and error.mean() < 0.005 * scale  # different products, same model
    assert (got[:, :n].argmax(-1) == exact[:, :n].argmax(-1)).float().mean() > 0.9


def _against_reference(default_model, reference_model):
    """(our logits, transformers' logits or None) for a fixed prompt: prefill, then 4 decode steps."""
    import torch

    from engine.cache import CacheSettings, DSV41Cache
    from engine.models import adapter

    ids = default_model.tokenizer("The State of the Union is strong, and our economy keeps growing because",
                                  return_tensors="pt")["input_ids"]
    ids = torch.cat([ids, torch.tensor([[260, 1345, 314, 2209]])], dim=1)
    reference = None
    if reference_model is not None:
        with torch.no_grad():
            reference = reference_model(ids).logits
    cache = DSV41Cache(default_model.num_layers, default_model.kv_heads, default_model.head_dim, torch.float32, "cpu",
                       CacheSettings(kv_cache_ratio=1.0, csa2_topk=0))
    n = ids.shape[1] - 4
    outs = [adapter.forward(default_model.hf_model, ids[:, :n], cache, logits_to_keep=n)]
    for i in range(n, ids.shape[1]):
        outs.append(adapter.forward(default_model.hf_model, ids[:, i:i + 1], cache, prefill=False))
    return torch.cat(outs, dim=1), reference


def test_default_model_caches_attend_prefill_in_bf16(default_model):
    from engine import DSV41Config, DSV41Model

    assert default_model.new_cache().prefill_bf16
    assert not DSV41Model.from_pretrained(DSV41Config(dtype="float32")).new_cache().prefill_bf16


def test_a_loaded_model_keeps_no_weights_file_mapped(default_model):
    """Safetensors' tensors are views of the whole mapped file: once the matrices are re-held (GGUF blocks), a
    norm left as such a view kept the 513 MB float32 file resident beside 97 MB of blocks (loader._own_small_tensors)."""
    import gc
    from pathlib import Path

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this system")
    gc.collect()
    folder = str(default_model.info.folder)
    mapped = [line for line in maps.read_text().splitlines() if folder in line and line.endswith(".safetensors")]
    assert mapped == []
