"""Shared fixtures: tiny random-weight models (unit) and the real default model (integration)."""

from __future__ import annotations

import os
import tempfile

import pytest

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # one of several test processes (`bootstrap.py test`, installer/commands.py worker_args_for_tests): the cores are
    # shared between them, so each torch (and each test's subprocesses) takes its share of the threads, not all
    from installer.common import usable_cpus

    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

import engine  # noqa: E402, F401 - first, before torch, as in the app and the CLI (engine/__init__.py, mkl_dispatch)
from tests.engine.conftest import tiny_model

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Saved conversation caches of the tests go to a folder of their own, never the user's, removed when the run ends
# (a full run writes about a gigabyte there).
_CONVERSATIONS = tempfile.TemporaryDirectory(prefix="dsv41-test-conversations-")
os.environ["DSV41_CONVERSATIONS_DIR"] = _CONVERSATIONS.name


def pytest_unconfigure(config):
    _CONVERSATIONS.cleanup()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # each file runs whole in one process, in this order (--dist loadfile --no-loadscope-reorder): the files
        # with slow tests first, so the processes end together instead of one finishing a 4-minute test alone
        slow = {item.path for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), converted once, loaded once per test session."""
    from engine import DSV41Config, DSV41Model

    return DSV41Model.from_pretrained(DSV41Config(max_seq_len=4096))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as a HF folder (safetensors + the default model's tokenizer)."""
    from transformers import AutoTokenizer

    from engine.loader import resolve_source

    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama")
    # vocab must cover the tokenizer: use the default model's tokenizer but a 49152-token embedding
    source = resolve_source("default")
    tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder
