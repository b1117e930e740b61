"""The conversations our server keeps (engine/server.py), and what it answers about one of them beyond the OpenAI API:
what its cache holds of a document (the heat) and the pieces of its documents kept hot (the pins).

A client names a conversation by sending it, as it sends a chat request: the messages (system, user, assistant),
here the whole conversation so far. The kept session holding exactly those messages answers; none (the server
dropped it, or restarted) is said as "not_loaded", and a pin is then kept by the client and sent with its next
request (`dsv41_pins`), as the app does for a chat not loaded yet.
"""

from __future__ import annotations

from collections import OrderedDict

from .errors import ConfigError

SESSIONS = 4  # conversations whose caches are kept


class Conversations:
    """The kept chat sessions, found by the conversation a request carries (its messages before the last)."""

    def __init__(self, model, size: int = SESSIONS):
        self.model, self.size = model, size
        self.sessions: OrderedDict[int, object] = OrderedDict()
        self.last = None

    def session_for(self, system: str | None, history: list[dict]):
        """A session holding `history` under `system`: one whose transcript it extends (only the new turn is then
        read), else a new one."""
        for key, session in reversed(self.sessions.items()):
            mine = _turns(session)
            if (session.system_prompt or None) == system and mine == history[: len(mine)] and mine:
                self.sessions.move_to_end(key)
                session.messages = ([{"role": "system", "content": system}] if system else []) + history
                return session
        session = self.model.chat_session(system)
        session.messages = ([{"role": "system", "content": system}] if system else []) + history
        self.sessions[id(session)] = session
        while len(self.sessions) > self.size:
            self.sessions.popitem(last=False)
        return session

    def holding(self, system: str | None, turns: list[dict]):
        """The kept session whose conversation is exactly `turns` under `system`, or None; changes nothing."""
        for session in reversed(self.sessions.values()):
            if (session.system_prompt or None) == system and _turns(session) == turns:
                return session
        return None


def _turns(session) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in session.messages if m["role"] != "system"]


def conversation(body: dict) -> tuple[str | None, list[dict]]:
    """(system prompt, turns) of a heat or pins request's `messages` (the conversation so far), or ConfigError."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in messages):
        raise ConfigError("messages", None, "the conversation so far: a list of {role, content} with text content")
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    return system, [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]


def pins_of(body: dict, field: str = "dsv41_pins") -> list[str] | None:
    """The pieces to keep hot a request carries (None: the field is absent), or ConfigError."""
    pins = body.get(field)
    if pins is None:
        return None
    if not isinstance(pins, list) or not all(isinstance(p, str) for p in pins):
        raise ConfigError(field, pins, "a list of strings (pieces of the conversation's documents to keep hot)")
    return pins


def wants_progress(body: dict) -> bool:
    """Whether a streamed request asks for the prompt's reading as it goes (`dsv41_progress`: chunks with no choices,
    which a client that did not ask might not expect), or ConfigError."""
    wanted = body.get("dsv41_progress", False)
    if not isinstance(wanted, bool):
        raise ConfigError("dsv41_progress", wanted, "true or false")
    return wanted and bool(body.get("stream"))


def heat(conversations: Conversations, body: dict) -> dict:
    """POST /v1/dsv41/heat {messages, text}: {"heat": DocumentHeat.to_dict() or None, "reason": why none} where
    reason is "not_loaded" (no kept conversation is that one) or "not_held" (its cache does not hold that text)."""
    system, turns = conversation(body)
    text = body.get("text")
    if not isinstance(text, str) or not text:
        raise ConfigError("text", text, "a document's text, as the conversation sent it")
    session = conversations.holding(system, turns)
    if session is None:
        return {"heat": None, "reason": "not_loaded"}
    found = session.document_heat(text)
    return {"heat": found.to_dict(), "reason": ""} if found is not None else {"heat": None, "reason": "not_held"}


def pin(conversations: Conversations, body: dict) -> dict:
    """POST /v1/dsv41/pins {messages, pins}: the conversation's pins set now ({"missing": the pieces not found}),
    or {"missing": [], "reason": "not_loaded"} where no kept conversation is that one. PinError (past the cache's
    room) changes nothing."""
    system, turns = conversation(body)
    pins = pins_of(body, "pins")
    if pins is None:
        raise ConfigError("pins", None, "a list of strings (pieces of the conversation's documents to keep hot)")
    session = conversations.holding(system, turns)
    if session is None:
        return {"missing": [], "reason": "not_loaded"}
    return {"missing": list(session.set_pins(pins)), "reason": ""}
