"""A hub id that cannot be fetched says why: offline (the usual case), not found, or gated."""

from __future__ import annotations

import pytest

from engine import ModelLoadError
from engine.loader import resolve_source


def failing(exc):
    def download(*args, **kwargs):
        raise exc
    return download


def offline_error():
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub, "
                                          "and we cannot find the appropriate snapshot folder") from cause
    except LocalEntryNotFoundError as exc:
        return exc


def not_found_error():
    from huggingface_hub.errors import RepositoryNotFoundError

    exc = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # without an HTTP response object
    Exception.__init__(exc, "404 Client Error. Repository Not Found")
    return exc


@pytest.mark.parametrize("make, reason, words", [
    (offline_error, "offline", ["offline", "Name or service not known"]),
    (lambda: ConnectionError("Network is unreachable"), "offline", ["network failed"]),
    (not_found_error, "missing", ["does not exist or is private"]),
])
def test_hub_failures_say_what_happened(monkeypatch, make, reason, words):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing(make()))
    with pytest.raises(ModelLoadError) as err:
        resolve_source("SomeOrg/some-model")
    assert err.value.reason == reason
    for word in words:
        assert word in str(err.value)
    if reason == "offline":
        assert "does not exist" not in str(err.value)
