"""Ordinary bad input gets a clear message, never a traceback, and loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ConfigError, DSV41Config, GenerationSettings

from .conftest import new_session

REPO = Path(__file__).resolve().parents[2]


def cli(*args, stdin: bytes | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "engine", *args], input=stdin, capture_output=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize("seed", [2**64, -1, 99999999999999999999999, 1.5, True])
def test_a_seed_out_of_range_is_refused_with_the_range(seed):
    with pytest.raises(ConfigError, match=r"seed=.*\[0, 18446744073709551615\]"):
        GenerationSettings(seed=seed)


def test_the_largest_seed_works(chat_model):
    session = new_session(chat_model)
    events = list(session.send("hi", max_new_tokens=2, seed=2**64 - 1))
    assert events[-1].reason in ("length", "eos")
    before = [dict(m) for m in session.messages]  # (two random tokens of the tiny model may show no text: no exchange)
    with pytest.raises(ConfigError, match="seed"):
        session.send("hi", seed=2**64)
    assert not session.busy and session.messages == before and session.consistent


def test_the_cli_refuses_a_huge_seed_before_loading_the_model():
    out = cli("generate", "--prompt", "hi", "--seed", "99999999999999999999999")
    assert out.returncode == 2
    err = out.stderr.decode()
    assert "seed=" in err and "Traceback" not in err and "Loaded" not in err


def test_an_empty_model_path_is_refused():
    with pytest.raises(ConfigError, match="model_path"):
        DSV41Config(model_path="")
    with pytest.raises(ConfigError, match="model_path"):
        DSV41Config(model_path="   ")


def test_invalid_utf8_in_argv_is_replaced_and_said(tiny_folder):
    prompt = os.fsdecode(b"caf\xe9 \xff hello")  # what Python makes of such argv bytes
    out = cli("generate", "--model", str(tiny_folder), "--max-new-tokens", "3", "--prompt", prompt)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "Traceback" not in err and "not valid UTF-8" in err


def test_the_terminal_chat_survives_invalid_utf8_and_a_bad_attachment(tiny_folder, tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("The secret word is PELICAN.")
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    script = (b"caf\xe9 \xff hello\n"
              + f"/doc {photos}\n".encode()  # a folder without documents: refused at once, nothing waits
              + b"first question\n"
              + f"/doc {good}\n".encode()
              + b"second question\n/quit\n")
    out = cli("chat", "--model", str(tiny_folder), "--max-new-tokens", "3", "--greedy", stdin=script)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "Traceback" not in err
    assert 'The folder "photos" holds no documents' in err and "(not attached)" in err
    assert "attached good.txt" in err
    assert err.count("[length]") + err.count("[eos]") == 3  # every prompt got its reply
    assert "not valid UTF-8" in err


def test_a_turn_too_large_says_what_takes_the_room_and_only_the_remedies_that_help(chat_model, tiny_folder,
                                                                                   tmp_path):
    from engine import ContextOverflowError, DSV41Model
    from engine.documents import load_document

    from .conftest import turn

    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    session = chat_model.chat_session()
    with pytest.raises(ContextOverflowError) as err:
        session.send("Summarise.", [str(big)])
    parts, message = err.value.parts, str(err.value)
    # a new chat: no history (the template's default system prompt counts as system), so "start a new chat"
    # would not help; the document would
    assert parts["history"] == 0 and parts["system"] > 0 and parts["documents"] > 1024
    assert sum(parts.values()) + 1 == err.value.needed
    assert "new chat" not in message and "shorter document" in message
    assert chat_model.context_limit == chat_model.max_positions == 1024  # max_seq_len cannot go further
    assert "max_seq_len" not in message and "already spans all 1024 of the model's positions" in message

    turn(session, "Hello")
    with pytest.raises(ContextOverflowError) as err:
        session.send("word " * 1200)
    assert err.value.parts["history"] > 0 and err.value.parts["documents"] == 0
    assert "Start a new chat" in str(err.value) and "shorten the message" in str(err.value)
    assert sum(err.value.parts.values()) + 1 == err.value.needed

    short = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=256))
    with pytest.raises(ContextOverflowError) as err:
        short.chat_session().send("Summarise.", [load_document(str(big))])
    assert "raise max_seq_len (up to the model's 1024 positions)" in str(err.value)


def test_one_document_may_be_given_as_itself(chat_model, tmp_path):
    from .conftest import turn

    doc = tmp_path / "note.txt"
    doc.write_text("The pass code is ORCHID.")
    session = chat_model.chat_session()
    done, _ = turn(session, "What is the pass code?", str(doc))
    assert done is not None and "ORCHID" in session.messages[-2]["content"]
    done, _ = turn(session, "Again?", doc)  # a Path too
    assert session.messages[-2]["content"].count("ORCHID") == 1
