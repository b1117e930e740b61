"""`python -m engine serve`: the loaded model as an OpenAI-compatible HTTP API (Starlette on uvicorn).

    POST /v1/chat/completions   messages (system / user / assistant), max_tokens, temperature, top_p, seed, stop,
                                stream (server-sent events); `usage`; our extensions: the cache knobs as extra
                                fields (validated like the config) and `dsv41` (the memory report) in the response
    GET  /v1/models             the one loaded model
    GET  /v1/dsv41/memory       the memory report of the last conversation

Requests run one at a time (the engine holds one model); a bounded queue waits behind the running one and a full
queue answers 429 with Retry-After. A chat client resends the whole conversation every time: the request whose
messages extend a kept conversation's reuses its cache (only the new turn is read, as in the app); another
conversation gets a session (and cache) of its own, the least recently used of SESSIONS dropped. A request that
cannot fit the context is refused before any work with the numbers (400, OpenAI's error shape), never truncated.
A client that disconnects mid-reply cancels it; the session's cache and transcript stay consistent (ChatSession).
Binds to 127.0.0.1; another address needs an API key (`Authorization: Bearer <key>`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict

from .config import CACHE_KNOBS
from .errors import ConfigError, ContextOverflowError
from .events import Done, TokenText

SESSIONS = 4  # conversations whose caches are kept
QUEUE = 8  # requests that may wait behind the running one
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ROLES = ("system", "user", "assistant")


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, headers=None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status,
                        headers=headers)


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
            mine = [m for m in session.messages if m["role"] != "system"]
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


def parse_request(body: dict) -> tuple[str | None, list[dict], str, dict, dict]:
    """(system prompt, history, the new user message, generation settings, cache knobs) or ConfigError."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages", messages, "a non-empty list of {role, content}")
    system, turns = None, []
    for message in messages:
        role, content = (message or {}).get("role"), (message or {}).get("content")
        if isinstance(content, list):  # OpenAI's content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if role not in ROLES or not isinstance(content, str):
            raise ConfigError("messages", role, "roles system / user / assistant with text content")
        if role == "system":
            system = content if system is None else system + "\n\n" + content
        else:
            turns.append({"role": role, "content": content})
    if not turns or turns[-1]["role"] != "user":
        raise ConfigError("messages", turns[-1]["role"] if turns else None, "a conversation ending with a user message")
    settings = {}
    if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
        settings["max_new_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
        if body.get(theirs) is not None:
            settings[ours] = body[theirs]
    if body.get("temperature") == 0:
        settings["greedy"] = True
    stop = body.get("stop")
    if stop is not None:
        settings["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    knobs = {k: body[k] for k in CACHE_KNOBS if k in body}
    return system, turns[:-1], turns[-1]["content"], settings, knobs


def create_app(model, *, api_key: str | None = None, queue: int = QUEUE, name: str | None = None):
    """The ASGI app serving `model` (a DSV41Model)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    conversations = Conversations(model)
    engine_lock = threading.Lock()  # one engine call at a time
    waiting = {"n": 0}
    model_id = name or model.info.display_name

    def authorised(request) -> bool:
        return api_key is None or request.headers.get("authorization", "") == f"Bearer {api_key}"

    def memory(session) -> dict:
        report = model.memory_report(session.cache if session is not None else None)
        return {"kv_hot_bytes": report.kv_stored, "kv_cold_bytes": report.kv_cold + report.kv_cold_disk,
                "kv_uncompressed_bytes": report.kv_uncompressed, "compression_ratio": report.compression_ratio,
                "kv_target_ratio": report.kv_target_ratio, "tokens_seen": report.tokens_seen,
                "stored_entries": report.kv_stored_tokens, "weights_bytes": report.weights,
                "device": report.device}

    async def models(request):
        if not authorised(request):
            return error(401, "Missing or wrong API key: send Authorization: Bearer <key>.", "authentication_error")
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                                         "owned_by": "local"}]})

    async def memory_route(request):
        if not authorised(request):
            return error(401, "Missing or wrong API key: send Authorization: Bearer <key>.", "authentication_error")
        return JSONResponse(memory(conversations.last))

    async def completions(request):
        if not authorised(request):
            return error(401, "Missing or wrong API key: send Authorization: Bearer <key>.", "authentication_error")
        try:
            body = await request.json()
        except (ValueError, json.JSONDecodeError):
            return error(400, "The body is not JSON.")
        try:
            system, history, prompt, settings, knobs = parse_request(body if isinstance(body, dict) else {})
            model.generation_settings(**settings)  # validated before queueing
            if knobs:
                model.config.replace(**knobs)
        except ConfigError as exc:
            return error(400, str(exc), code="invalid_value")
        if waiting["n"] >= queue + 1:
            return error(429, f"{waiting['n']} requests are running or waiting; try again shortly.",
                         "rate_limit_error", headers={"Retry-After": "2"})
        waiting["n"] += 1
        cancel = threading.Event()
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        started = time.time()

        def run() -> None:  # on a worker thread: the engine, one request at a time
            def put(item):
                loop.call_soon_threadsafe(events.put_nowait, item)

            try:
                with engine_lock:
                    if cancel.is_set():
                        return put(("cancelled", None))
                    if knobs:
                        model.reconfigure(None, **knobs)
                    session = conversations.session_for(system, history)
                    conversations.last = session
                    try:
                        stream = session.send(prompt, cancel=cancel, **settings)
                    except ContextOverflowError as exc:
                        return put(("refused", exc))
                    for event in stream:
                        if isinstance(event, TokenText) and event.text:
                            put(("text", event.text))
                        elif isinstance(event, Done):
                            stats = event.stats
                            put(("done", {"reason": event.reason, "text": event.text,
                                          "prompt_tokens": stats.prefill_tokens if stats else 0,
                                          "completion_tokens": stats.decode_tokens if stats else 0,
                                          "memory": memory(session)}))
            except Exception as exc:  # noqa: BLE001 - the request ends with the error (an EngineError's message is
                # the user's), and the server stays up
                put(("error", exc))
            finally:
                put(("end", None))

        worker = threading.Thread(target=run, name="engine-request", daemon=True)
        worker.start()
        ident = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(started)

        def finish_reason(reason: str) -> str:
            return {"length": "length", "context_full": "length", "stop": "stop", "eos": "stop"}.get(reason, "stop")

        def release() -> None:
            waiting["n"] -= 1

        if not body.get("stream"):
            text, done, problem = [], None, None
            try:
                while True:
                    kind, value = await events.get()
                    if kind == "text":
                        text.append(value)
                    elif kind == "done":
                        done = value
                    elif kind in ("refused", "error"):
                        problem = value
                    elif kind == "end":
                        break
            finally:
                release()
            if isinstance(problem, ContextOverflowError):
                return error(400, str(problem), code="context_length_exceeded")
            if problem is not None or done is None:
                return error(500, f"{type(problem).__name__}: {problem}", "server_error")
            usage = {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
                     "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}
            return JSONResponse({"id": ident, "object": "chat.completion", "created": created, "model": model_id,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": done["text"]},
                                              "finish_reason": finish_reason(done["reason"])}],
                                 "usage": usage, "dsv41": done["memory"]})

        # streaming: the refusal must come before the first byte (a 400, not an event)
        first = await events.get()
        if first[0] == "refused":
            await events.get()  # "end"
            release()
            return error(400, str(first[1]), code="context_length_exceeded")

        async def stream():
            def chunk(delta: dict, reason: str | None = None, extra: dict | None = None) -> str:
                payload = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_id,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": reason}], **(extra or {})}
                return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

            item = first
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, value = item
                    if kind == "text":
                        yield chunk({"content": value})
                    elif kind == "done":
                        usage = {"prompt_tokens": value["prompt_tokens"],
                                 "completion_tokens": value["completion_tokens"],
                                 "total_tokens": value["prompt_tokens"] + value["completion_tokens"]}
                        yield chunk({}, finish_reason(value["reason"]), {"usage": usage, "dsv41": value["memory"]})
                    elif kind == "error":
                        yield f"data: {json.dumps({'error': {'message': str(value), 'type': 'server_error'}})}\n\n"
                    elif kind == "end":
                        yield "data: [DONE]\n\n"
                        return
                    item = await events.get()
            finally:  # the client went away (or we are done): stop the reply at its next step
                cancel.set()
                release()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/dsv41/memory", memory_route),
                             Route("/v1/chat/completions", completions, methods=["POST"])])


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Run the server until interrupted (uvicorn). Off the loopback address an API key is required."""
    import logging

    import uvicorn

    if host not in LOOPBACK and not api_key:
        raise ConfigError("host", host, "127.0.0.1, or another address together with --api-key (anyone who can "
                          "reach it could use the model otherwise)")
    log = logging.getLogger("engine.server")
    if host not in LOOPBACK:
        log.warning("listening on %s:%d: requests need Authorization: Bearer <the API key>", host, port)
    print(f"DS-V4.1 serving {model.info.display_name} at http://{host}:{port}/v1 (OpenAI-compatible)", flush=True)
    uvicorn.run(create_app(model, api_key=api_key), host=host, port=port, log_level="info")
