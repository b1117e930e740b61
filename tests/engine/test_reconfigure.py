"""Reconfigure between turns: tighter compacts the live cache, looser rebuilds it; never mid-turn."""

import pydoc_data.topics

import pytest

from engine import Done, DSV41Config, DSV41Model, TokenText

pytestmark = pytest.mark.model


@pytest.fixture
def model_with_document(tmp_path):
    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=4096, kv_cache_ratio=0.5, ced_threshold=0.0))
    doc = tmp_path / "topics.txt"
    doc.write_text(pydoc_data.topics.topics["assert"] + "\n\n" + pydoc_data.topics.topics["assignment"][:3000])
    session = model.chat_session()
    list(session.send("What does assert do?", documents=[str(doc)], greedy=True, max_new_tokens=8))
    return model, session


def test_tighter_settings_compact_the_live_cache(model_with_document):
    model, session = model_with_document
    seen, stored = session.cache.seen, session.cache.stored
    assert stored <= session.cache.budget() < seen
    result = model.reconfigure(session, kv_cache_ratio=0.25)
    assert result.action == "compacted"
    assert session.cache.seen == seen  # nothing re-read
    assert session.cache.stored <= session.cache.budget() < stored
    assert result.after.kv_stored < result.before.kv_stored
    assert model.config.kv_cache_ratio == 0.25


def test_looser_settings_rebuild_from_the_transcript(model_with_document):
    model, session = model_with_document
    seen = session.cache.seen
    progress = []
    result = model.reconfigure(session, progress=progress.append, kv_cache_ratio=1.0)
    assert result.action == "rebuilt"
    assert session.cache.seen == seen == len(session.transcript_ids)
    assert session.cache.stored == seen  # everything is back
    assert progress and progress[-1].done == progress[-1].total == seen
    assert result.after.kv_stored > result.before.kv_stored
    # the conversation continues on the rebuilt cache without re-reading it
    turn = session.prepare("Thanks!")
    assert not turn.rebuild


def test_change_during_a_reply_is_deferred_to_the_end_of_the_turn(model_with_document):
    model, session = model_with_document
    stream = session.send("Explain assignment statements in detail.", max_new_tokens=12, greedy=True,
                          ignore_eos=True)
    for event in stream:
        if isinstance(event, TokenText) and event.text:
            break
    result = model.reconfigure(session, kv_cache_ratio=0.2)
    assert result.action == "deferred" and model.pending_knobs == {"kv_cache_ratio": 0.2}
    assert session.cache.settings.kv_cache_ratio == 0.5  # not applied mid-turn
    events = list(stream)
    assert isinstance(events[-1], Done)
    assert model.pending_knobs is None
    assert session.cache.settings.kv_cache_ratio == 0.2 and model.config.kv_cache_ratio == 0.2
    assert session.cache.stored <= session.cache.budget()


def test_non_cache_knob_is_refused(model_with_document):
    from engine import ConfigError

    model, session = model_with_document
    with pytest.raises(ConfigError, match="weight_quant"):
        model.reconfigure(session, weight_quant="int8")
    with pytest.raises(ConfigError, match="kv_cache_ratio"):
        model.reconfigure(session, kv_cache_ratio=1.7)


def test_a_chats_knobs_leave_the_other_chats_caches_alone(model_with_document):
    """The app keeps knobs per chat and sends a chat's own when it is opened: that must not compact, recall or
    re-read any other chat's cache (with an INT8 chat and a bf16 one, every switch re-read both transcripts)."""
    model, first = model_with_document
    second = model.chat_session()
    list(second.send("Name three colours.", greedy=True, max_new_tokens=8))
    seen = second.cache.seen
    result = model.reconfigure(second, kv_cache_dtype="int8", kv_cache_ratio=0.3)
    assert result.action == "rebuilt" and second.cache.settings.kv_cache_dtype == "int8"
    assert first.cache.settings.kv_cache_dtype == "auto" and first.cache.settings.kv_cache_ratio == 0.5
    # opening the first chat again: its knobs are the ones its cache has, so nothing is done to either
    result = model.reconfigure(first, kv_cache_dtype="auto", kv_cache_ratio=0.5)
    assert result.action == "unchanged" and model.config.kv_cache_ratio == 0.5
    assert second.cache.settings.kv_cache_dtype == "int8" and second.cache.seen == seen
    # a new chat starts with the model's knobs: the last chat's it was given
    assert model.chat_session().cache.settings.kv_cache_ratio == 0.5
    # without a session every live chat takes them (the API's live reconfigure)
    model.reconfigure(None, kv_cache_ratio=0.25)
    assert first.cache.settings.kv_cache_ratio == second.cache.settings.kv_cache_ratio == 0.25


def test_changes_for_two_chats_asked_during_a_reply_each_go_to_their_own_chat(tiny_folder):
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0,
                                                   kv_cache_ratio=0.3, cold_tier="ram"))
    a, b = model.chat_session(), model.chat_session()
    for chat in (a, b):
        list(chat.send("Tell me about rivers and the sea, at length.", max_new_tokens=4, greedy=True))
    stream = a.send("And lakes?", max_new_tokens=8, greedy=True, ignore_eos=True)
    next(e for e in stream if isinstance(e, TokenText))
    assert model.reconfigure(a, kv_cache_ratio=0.5).action == "deferred"
    assert model.reconfigure(b, csa2_topk=64).action == "deferred"
    assert model.pending_knobs == {"kv_cache_ratio": 0.5, "csa2_topk": 64}
    list(stream)
    assert a.cache.settings.kv_cache_ratio == 0.5 and a.cache.settings.csa2_topk == 0
    assert b.cache.settings.kv_cache_ratio == 0.3 and b.cache.settings.csa2_topk == 64
    assert model.pending_knobs is None


def test_a_fork_is_one_of_the_models_chats(tiny_folder):
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, csa2_topk=0,
                                                   kv_cache_ratio=0.3, cold_tier="ram"))
    chat = model.chat_session()
    list(chat.send("Tell me about rivers and the sea, at length.", max_new_tokens=4, greedy=True))
    fork = chat.fork()
    model.reconfigure(kv_cache_ratio=0.5)  # every chat of the model, the fork too
    assert fork.cache.settings.kv_cache_ratio == 0.5
    stream = fork.send("And lakes?", max_new_tokens=8, greedy=True, ignore_eos=True)
    next(e for e in stream if isinstance(e, TokenText))
    assert model.reconfigure(fork, kv_cache_ratio=0.2).action == "deferred"  # never mid-reply
    list(stream)
    assert fork.cache.settings.kv_cache_ratio == 0.2
