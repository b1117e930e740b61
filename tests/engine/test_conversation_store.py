"""Saved conversation caches: a reopened, regenerated or edited chat restores its cache instead of re-reading;
a corrupt, truncated, foreign-model or foreign-settings file is refused and the conversation is re-read."""

from __future__ import annotations

import pytest
import torch

from engine.cache import persist
from engine.conversation_store import SUFFIX, ConversationStore
from engine.events import Done

DOCUMENT = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(45))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_CONVERSATIONS_DIR", str(tmp_path / "conversations"))
    return tmp_path / "conversations"


@pytest.fixture(scope="module")
def model(tiny_folder):
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, kv_cache_ratio=0.2,
                                                  cold_tier="ram", csa2_topk=0))


def ask(session, prompt: str) -> Done:
    return [e for e in session.send(prompt, max_new_tokens=6, greedy=True) if isinstance(e, Done)][0]


def _chat(model, turns=("What is the value of item 3?", "And item 40?")):
    session = model.chat_session()
    replies = [ask(session, (DOCUMENT + "\n\n" if i == 0 else "") + q) for i, q in enumerate(turns)]
    return session, replies


def _state(cache):
    tensors, facts = persist.save_state(cache)
    return {k: v.clone() for k, v in tensors.items()}, facts


def _equal_states(a, b) -> bool:
    (ta, fa), (tb, fb) = a, b
    return fa == fb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_reopened_chat_restores_its_cache_bit_equal_and_reads_only_the_new_turn(model, folder):
    session, _ = _chat(model)
    saved = _state(session.cache)
    assert len(list(folder.glob("*" + SUFFIX))) == 2  # one state per turn
    reopened = model.chat_session()
    reopened.messages = list(session.messages)  # what the app hands a new session after a restart
    turn = reopened.prepare("And item 25?")
    assert turn.restored and not turn.rebuild
    assert _equal_states(_state(reopened.cache), saved)
    assert reopened.transcript_ids == session.transcript_ids and reopened.fed_text == session.fed_text
    done = list(reopened._run(turn, model.generation_settings(max_new_tokens=6, greedy=True), None))[-1]
    assert done.stats.restored_context and not done.stats.rebuilt_context
    assert done.stats.prefill_tokens == len(turn.new_ids) < 40  # the question only, not the document
    assert done.text == ask(session, "And item 25?").text  # the same answer the open chat gives


def test_a_reopened_chat_without_a_saved_state_reads_it_all_and_says_so(model, folder):
    """A chat whose last state was not saved (its reply cut off by closing the app, or the saved caches off):
    the whole conversation is read again, and the reply's figures say it was (the app's footer shows them)."""
    session, _ = _chat(model)
    for saved in folder.glob("*" + SUFFIX):
        saved.unlink()
    reopened = model.chat_session()
    reopened.messages = list(session.messages)
    turn = reopened.prepare("And item 25?")
    assert turn.rebuild and not turn.restored
    assert turn.usage.history > 0 and turn.usage.history + turn.usage.system > len(turn.new_ids) // 2
    done = list(reopened._run(turn, model.generation_settings(max_new_tokens=6, greedy=True), None))[-1]
    assert done.stats.rebuilt_context and done.stats.prefill_tokens > 200  # the document again


def test_regenerate_and_edit_restore_the_state_from_before_the_last_turn(model, folder):
    session, replies = _chat(model)
    one = model.chat_session()
    ask(one, DOCUMENT + "\n\nWhat is the value of item 3?")
    first_turn_state = _state(one.cache)
    # regenerate: the last exchange goes, the same question is asked again
    session.messages = session.messages[:2]
    turn = session.prepare("And item 40?")
    assert turn.restored and _equal_states(_state(session.cache), first_turn_state)
    done = list(session._run(turn, model.generation_settings(max_new_tokens=6, greedy=True), None))[-1]
    assert done.text == replies[1].text and done.stats.prefill_tokens == len(turn.new_ids)
    # edit the last message: another question from the same state
    session.messages = session.messages[:2]
    edited = ask(session, "And item 44?")
    assert edited.stats.restored_context


def _saved_files(folder):
    return sorted(folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "not safetensors"])
def test_a_damaged_file_is_refused_removed_and_the_chat_re_read(model, folder, damage):
    session, _ = _chat(model, ("What is the value of item 3?",))
    (path,) = _saved_files(folder)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-100] ^= 0xFF  # one byte of the tensors
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a state at all")
    path.write_bytes(bytes(data))
    reopened = model.chat_session()
    reopened.messages = list(session.messages)
    done = ask(reopened, "And item 40?")
    assert not done.stats.restored_context and not path.exists()  # refused and removed
    assert done.stats.prefill_tokens > 400  # the whole conversation (the document) was read again
    assert reopened.cache.seen == len(reopened.transcript_ids)
    with _store_off(model):  # the answer of a chat that never had a saved state
        reference = model.chat_session()
        reference.messages = list(session.messages)
        assert done.text == ask(reference, "And item 40?").text


def test_an_entry_that_cannot_be_read_or_removed_is_passed_over(model, folder, monkeypatch):
    """A folder named like a state, or a damaged state in a folder the user may not delete from: the chat restores
    the state it can read (or re-reads) and the turn goes on."""
    from pathlib import Path

    session, replies = _chat(model)
    (folder / ("0000-not-a-state" + SUFFIX)).mkdir()
    damaged = folder / ("0001-damaged" + SUFFIX)
    damaged.write_bytes(b"not a state at all")
    real_unlink = Path.unlink

    def refuse(path, missing_ok=False):
        if path == damaged:
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    session.messages = session.messages[:2]  # regenerate
    done = ask(session, "And item 40?")
    assert done.stats.restored_context and done.text == replies[1].text
    assert damaged.exists() and (folder / ("0000-not-a-state" + SUFFIX)).is_dir()
    ConversationStore(folder, cap_bytes=1).trim()  # the cap: what can go goes, the rest is passed over
    assert damaged.exists() and not [p for p in _saved_files(folder) if p.is_file() and p != damaged]


class _store_off:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.config = self.model.config
        self.model.config = self.config.replace(conversation_cache_mb=0)

    def __exit__(self, *exc):
        self.model.config = self.config


def test_a_state_of_another_model_or_other_settings_never_matches(model, folder):
    session, _ = _chat(model, ("What is the value of item 3?",))
    assert len(_saved_files(folder)) == 1
    reopened = model.chat_session()
    reopened.messages = list(session.messages)
    real = model.state_key
    model._state_key = "another model"
    try:
        assert not reopened.prepare("And item 40?").restored
    finally:
        model._state_key = real
    for changed in ({"ced_mode": "merge"}, {"cold_tier_dtype": "auto"}, {"kv_cache_ratio": 0.3, "cold_tier": "off"}):
        other = model.chat_session()  # what the cache holds differs: never restored
        other.messages = list(session.messages)
        other.cache.settings = other.cache.settings.replace(**changed)
        other.cache.reset()
        assert not other.prepare("And item 40?").restored, changed
    same = model.chat_session()
    same.messages = list(session.messages)
    assert same.prepare("And item 40?").restored
    # knobs that apply live change nothing a state holds: moving them keeps the saved chats restorable (with them
    # in the key, a new CSA2 top-k or prefill headroom made every saved chat re-read its document)
    live = model.chat_session()
    live.messages = list(session.messages)
    live.cache.settings = live.cache.settings.replace(csa2_topk=128, prefill_headroom=4096, compact_every=8,
                                                      cold_tier_ram_mb=512, prefill_chunk=256)
    live.cache.reset()
    assert live.prepare("And item 40?").restored


def test_a_chat_whose_ratio_moved_since_its_last_turn_is_restored_with_the_new_ratio_applied(model, folder):
    """Regenerate, edit or reopen after the ratio moved: the state saved under the old ratio is restored and the new
    one applied to it as a live change is (looser: recalled from the cold tier), not the document re-read."""
    session, replies = _chat(model)  # ratio 0.2, cold tier in RAM
    live = session.fork()
    assert model.reconfigure(live, kv_cache_ratio=0.4).action == "recalled"
    reopened = model.chat_session()
    reopened.messages = list(session.messages)
    reopened.cache.settings = live.cache.settings
    reopened.cache.reset()
    turn = reopened.prepare("And item 44?")
    assert turn.restored and not turn.rebuild and reopened.cache.settings == live.cache.settings
    assert _equal_states(_state(reopened.cache), _state(live.cache))  # as the live change made it
    done = list(reopened._run(turn, model.generation_settings(max_new_tokens=6, greedy=True), None))[-1]
    assert done.text == ask(live, "And item 44?").text and done.stats.prefill_tokens == len(turn.new_ids) < 40
    tighter = model.chat_session()  # tighter: compacted
    tighter.messages = list(session.messages[:2])
    tighter.cache.settings = tighter.cache.settings.replace(kv_cache_ratio=0.1)
    tighter.cache.reset()
    assert tighter.prepare("And item 40?").restored and tighter.cache.stored <= tighter.cache.budget()


def test_the_first_reply_regenerated_or_edited_reads_only_its_question(model, folder):
    """The state saved once a turn's documents are read (before its question): regenerating the first reply, editing
    the first question, or a new chat about the same document read only the question, and regenerating gives the
    first reply's cache and answer bit for bit (the repetition penalty sees the document as the first turn did)."""
    from engine.documents import Document

    doc = Document(name="items.txt", path="items.txt", kind="txt", text=DOCUMENT, pages=None, chars=len(DOCUMENT))
    settings = dict(max_new_tokens=8, greedy=True, repetition_penalty=1.3)
    config = model.config
    model.config = config.replace(prefill_chunk=256)  # the ~810-token document in four chunks, its last with the
    try:  # question: the state is saved before that chunk, and the chunk read again as it was (its ~40 tokens first)
        _first_reply_regenerated(model, folder, doc, settings)
    finally:
        model.config = config


def _first_reply_regenerated(model, folder, doc, settings):
    session = model.chat_session()
    first = list(session.send("What is the value of item 3?", [doc], **settings))[-1]
    assert first.stats.prefill_tokens > 500 and not first.stats.restored_context
    after_first, after_ids = _state(session.cache), list(session.transcript_ids)
    session.messages = []  # regenerate the first reply
    turn = session.prepare("What is the value of item 3?", [doc])
    assert turn.restored and session.lead == session.transcript_ids == after_ids[: len(session.transcript_ids)]
    assert turn.new_ids == after_ids[len(session.transcript_ids): len(turn.new_ids) + len(session.transcript_ids)]
    again = list(session._run(turn, model.generation_settings(**settings), None))[-1]
    assert again.stats.restored_context and again.stats.prefill_tokens < 80
    assert again.text == first.text and _equal_states(_state(session.cache), after_first)
    session.messages = []  # edit the first question
    edited = list(session.send("What is the value of item 44?", [doc], **settings))[-1]
    assert edited.stats.restored_context and edited.stats.prefill_tokens < 80
    other = model.chat_session()  # another chat asking about the same document
    assert list(other.send("What is the value of item 3?", [doc], **settings))[-1].text == first.text
    short = model.chat_session()  # a short document: no state of its own (the question is read with it)
    files = set(_saved_files(folder))
    list(short.send("Sum up: " + "a b c " * 20, **settings))
    assert len(set(_saved_files(folder)) - files) == 1  # the turn's own, after its reply


def test_a_documents_state_that_cannot_be_saved_leaves_the_turn_as_it_was(model, folder, monkeypatch):
    from engine.documents import Document

    doc = Document(name="items.txt", path="items.txt", kind="txt", text=DOCUMENT, pages=None, chars=len(DOCUMENT))
    with _store_off(model):
        reference = list(model.chat_session().send("What is the value of item 3?", [doc], max_new_tokens=6,
                                                   greedy=True))[-1]

    def fail(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "save_state", fail)  # the documents' state and the turn's own: neither saved
    done = list(model.chat_session().send("What is the value of item 3?", [doc], max_new_tokens=6, greedy=True))[-1]
    assert done.reason != "error" and done.text == reference.text


def test_a_crash_while_saving_leaves_the_earlier_state_usable(model, folder, monkeypatch):
    session, _ = _chat(model, ("What is the value of item 3?",))
    (before,) = _saved_files(folder)
    content = before.read_bytes()

    import safetensors.torch

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", crash)
        done = ask(session, "And item 40?")
    assert done.text is not None and session.cache.seen == len(session.transcript_ids)  # the chat goes on
    assert _saved_files(folder) == [before] and before.read_bytes() == content
    assert not list(folder.glob("*.tmp"))  # no half-written leftovers
    assert "disk full" in model.conversation_store.last_error  # said, and the chat was not interrupted
    regenerate = model.chat_session()
    regenerate.messages = list(session.messages[:2])
    assert regenerate.prepare("And item 40?").restored  # the earlier state still restores


def test_a_save_that_fails_with_the_writers_own_error_is_said_once_and_the_chat_goes_on(tmp_path, monkeypatch,
                                                                                         caplog):
    # safetensors reports a full disk with its own exception type, not OSError: it reached the terminal chat as a
    # traceback at every turn
    import safetensors.torch

    class SafetensorError(Exception):
        pass

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    store = ConversationStore(tmp_path, cap_bytes=1 << 20)
    for text in ("a", "ab"):
        assert store.save(model_key="m", settings_key="s", text=text, specials=(), transcript_ids=[1],
                          tensors={"x": torch.zeros(8)}, cache_facts={}) is None
    assert "No space left on device" in store.last_error and "free space" in store.last_error
    assert sum("could not save" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.glob("*.tmp")) and not any(r.exc_info for r in caplog.records)


def test_the_folder_stays_under_its_cap_removing_the_least_recently_used(tmp_path):
    store = ConversationStore(tmp_path, cap_bytes=1 << 20)
    tensors = {"x": torch.zeros(1024)}  # 4 KiB each

    def save(text):
        return store.save(model_key="m", settings_key="s", text=text, specials=(), transcript_ids=[1],
                          tensors=tensors, cache_facts={})

    a = save("a")
    store.cap_bytes = int(3.5 * a.stat().st_size)  # room for three
    b, c = save("ab"), save("abc")
    assert {a, b, c} == set(tmp_path.glob("*" + SUFFIX))
    import os
    import time

    old = time.time() - 100
    for i, p in enumerate((a, b, c)):
        os.utime(p, (old + i, old + i))
    from engine.chat_template import Rendered

    found = store.find(model_key="m", settings_key="s", rendered=Rendered("a and more"))
    assert found.path == a and store.load(found) is not None  # used now: the most recent
    d = save("abcd")
    assert set(tmp_path.glob("*" + SUFFIX)) == {a, c, d}  # b was the least recently used
    assert store.total_bytes() <= store.cap_bytes
    assert save("x" * 10) is not None and store.save(model_key="m", settings_key="s", text="big", specials=(),
                                                      transcript_ids=[1], tensors={"x": torch.zeros(10**5)},
                                                      cache_facts={}) is None
    assert "larger than the cap" in store.last_error


def test_a_save_killed_midway_leaves_a_file_that_counts_in_the_cap_and_goes_once_its_writer_is_gone(tmp_path):
    """kill -9 during a save leaves its temporary file: the next open (or save) removes it, as soon as the process
    in its name runs no more; a live process's file is kept, counted in the cap, and removed after its writer dies."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import os, signal, torch, safetensors.torch\n"
        "from engine.conversation_store import ConversationStore\n"
        "def killed(tensors, filename, metadata=None):\n"
        "    with open(filename, 'wb') as f:\n"
        "        f.write(b'x' * 30000)\n"
        f"    os.kill(os.getpid(), {int(getattr(signal, 'SIGKILL', 9))})\n"
        "safetensors.torch.save_file = killed\n"
        f"ConversationStore({str(tmp_path)!r}, 1 << 20).save(model_key='m', settings_key='s', text='t', specials=(),"
        " transcript_ids=[1], tensors={'x': torch.zeros(8)}, cache_facts={})\n")
    killed = subprocess.Popen([sys.executable, "-c", code], cwd=root, stderr=subprocess.PIPE)
    assert killed.wait(timeout=120) != 0, killed.stderr.read()[-2000:]
    killed.stderr.close()
    (dead,) = tmp_path.glob("*.tmp")  # what the killed save left
    assert f".{killed.pid}.tmp" in dead.name
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".{'0' * 32}{SUFFIX}.{writer.pid}.tmp"  # a save under way in another process
        live.write_bytes(b"y" * 20000)
        mine = tmp_path / f".{'1' * 32}{SUFFIX}.{os.getpid()}.tmp"  # this pid, but no save of this process's
        mine.write_bytes(b"z" * 10)
        unnamed = tmp_path / "leftover.tmp"  # no pid in its name: removed when not written for an hour
        unnamed.write_bytes(b"w" * 10)

        store = ConversationStore(tmp_path, cap_bytes=1 << 20)  # opening removes the dead saves' files
        assert set(tmp_path.glob("*.tmp")) == {live, unnamed}
        assert store.total_bytes() == 20010  # the live save's bytes count

        def save(text):
            return store.save(model_key="m", settings_key="s", text=text, specials=(), transcript_ids=[1],
                              tensors={"x": torch.zeros(1024)}, cache_facts={})

        a = save("a")
        size = a.stat().st_size
        store.cap_bytes = 20010 + int(2.5 * size)  # the live file and two states
        old = time.time() - 100
        os.utime(a, (old, old))
        b, c = save("ab"), save("abc")
        assert set(tmp_path.glob("*" + SUFFIX)) == {b, c}  # a went: the live file takes its room
        assert live.exists() and store.total_bytes() == 20010 + 2 * size <= store.cap_bytes
        stale = time.time() - 2 * 3600
        os.utime(unnamed, (stale, stale))
    finally:
        writer.kill()
        writer.wait()
    save("abcd")  # its writer gone, the live file goes at the next save; so does the one not written for hours
    assert not list(tmp_path.glob("*.tmp"))
    assert store.total_bytes() == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_a_state_that_does_not_fit_the_cache_changes_nothing(model):
    session, _ = _chat(model, ("What is the value of item 3?",))
    tensors, facts = persist.save_state(session.cache)
    target = model.chat_session().cache
    before = _state(target)
    bad = dict(tensors)
    bad["hot.0.keys"] = bad["hot.0.keys"][:, :-1]
    with pytest.raises(persist.StateMismatch):
        persist.load_state(target, bad, facts)
    with pytest.raises(persist.StateMismatch):
        persist.load_state(target, tensors, {**facts, "format": 0})
    assert _equal_states(_state(target), before)
    persist.load_state(target, tensors, facts)
    assert _equal_states(_state(target), _state(session.cache))


def test_a_fork_goes_on_from_the_same_state_and_leaves_the_original_as_it_was(model, folder):
    session, _ = _chat(model, ("What is the value of item 3?",))
    before = _state(session.cache)
    fork = session.fork()
    assert _equal_states(_state(fork.cache), before) and fork.cache.settings == session.cache.settings
    assert fork.cache.cold is not None and sum(c.length for c in fork.cache.cold) > 0  # the cold tier came too
    forked = ask(fork, "And item 40?")
    assert forked.stats.prefill_tokens < 40 and not forked.stats.rebuilt_context  # the question only
    assert _equal_states(_state(session.cache), before)  # the fork's turn changed nothing here
    assert ask(session, "And item 40?").text == forked.text  # the same answer the original gives
    assert _equal_states(_state(session.cache), _state(fork.cache))


def test_a_fork_of_a_chat_whose_cache_is_out_of_step_re_reads_it(model, folder, monkeypatch):
    monkeypatch.setattr(model, "config", model.config.replace(conversation_cache_mb=0))  # no saved state to restore
    session, _ = _chat(model, ("What is the value of item 3?",))
    session._dirty = True  # as after a turn interrupted mid-compaction
    fork = session.fork()
    assert fork.cache.seen == 0 and fork.messages == session.messages
    done = ask(fork, "And item 40?")
    assert done.stats.prefill_tokens > 40  # the whole conversation read again
    assert fork.cache.seen == len(fork.transcript_ids)
