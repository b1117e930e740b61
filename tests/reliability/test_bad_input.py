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
    script = (b"caf\xe9 \xff hello\n"
              + f"/doc {tmp_path}\n".encode()  # a folder: refused at once, nothing waits
              + b"first question\n"
              + f"/doc {good}\n".encode()
              + b"second question\n/quit\n")
    out = cli("chat", "--model", str(tiny_folder), "--max-new-tokens", "3", "--greedy", stdin=script)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "Traceback" not in err
    assert "is a folder" in err and "(not attached)" in err
    assert "attached good.txt" in err
    assert err.count("[length]") + err.count("[eos]") == 3  # every prompt got its reply
    assert "not valid UTF-8" in err
