"""app.engine_api: the real engine classes, the remote backend (engine.remote) and the tests' fakes provide every
member the worker uses."""

from __future__ import annotations

import inspect
import re

import pytest
from gui_fakes import FakeModel, FakeSession

from app.engine_api import EngineModel, EngineSession


def members(protocol: type) -> list[str]:
    names = list(protocol.__dict__.get("__annotations__", {}))
    return names + [n for n in vars(protocol) if not n.startswith("_") and n not in names]


def instance_attributes(cls: type) -> set[str]:
    """Attributes the class's __init__ assigns (self.name = ...)."""
    return set(re.findall(r"self\.(\w+)\s*(?::[^=]*)?=", inspect.getsource(cls.__init__)))


def check_signature(protocol: type, cls: type, name: str) -> None:
    """Whatever the worker passes to the Protocol's method, the implementation accepts by the same name."""
    wanted = inspect.signature(getattr(protocol, name)).parameters
    given = inspect.signature(getattr(cls, name)).parameters
    takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in given.values())
    for param in wanted.values():
        if param.kind is param.VAR_KEYWORD:
            assert takes_any_keyword, f"{cls.__name__}.{name} takes no **{param.name}"
        elif param.kind is not param.VAR_POSITIONAL:
            assert param.name in given or takes_any_keyword, f"{cls.__name__}.{name} lacks {param.name!r}"
            if param.name in given and param.default is not param.empty:
                assert given[param.name].default is not param.empty, f"{cls.__name__}.{name}: {param.name} needs a default"


def engine_classes():
    from engine.model import DSV41Model
    from engine.session import ChatSession

    return DSV41Model, ChatSession


def remote_classes():
    from engine.remote import RemoteModel, RemoteSession

    return RemoteModel, RemoteSession


@pytest.mark.parametrize("which", ["engine", "remote", "fake"])
def test_every_protocol_member_is_provided(which):
    model_cls, session_cls = {"engine": engine_classes, "remote": remote_classes,
                              "fake": lambda: (FakeModel, FakeSession)}[which]()
    for protocol, cls in ((EngineModel, model_cls), (EngineSession, session_cls)):
        present = set(dir(cls)) | instance_attributes(cls)
        missing = [name for name in members(protocol) if name not in present]
        assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"
        for name in members(protocol):
            if inspect.isfunction(getattr(protocol, name, None)):
                check_signature(protocol, cls, name)


def test_the_protocols_cover_what_the_worker_uses():
    assert set(members(EngineModel)) == {
        "config", "info", "context_limit", "max_positions", "kv_bytes_per_token", "chat_session", "memory_report",
        "reconfigure", "document_tokens", "context_usage", "stored_kv_bytes"}
    assert set(members(EngineSession)) == {"messages", "cache", "pins", "send", "forget_saved", "set_system_prompt",
                                           "set_pins", "document_heat"}


def test_the_fake_is_an_instance_of_the_runtime_checkable_protocols():
    model = FakeModel()
    assert isinstance(model, EngineModel)
    assert isinstance(model.chat_session(), EngineSession)
    assert not isinstance(object(), EngineModel)


def test_the_fake_uses_the_engines_reconfigure_result():
    from engine.info import ReconfigureResult

    result = FakeModel().reconfigure(None, kv_cache_ratio=0.3)
    assert type(result) is ReconfigureResult
