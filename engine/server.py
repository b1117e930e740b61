"""`python -m engine serve`: the loaded model as an OpenAI-compatible HTTP API (Starlette on uvicorn).

    POST /v1/chat/completions   messages (system / user / assistant), max_tokens, temperature, top_p, seed, stop,
                                stream (server-sent events); `usage`; top_k and repetition_penalty as vLLM takes
                                them; our extensions: the cache knobs as extra fields (validated like the config;
                                they apply to that conversation's cache alone, over the model's own) and `dsv41` (the
                                memory report) in the response. The `model` field is not checked: one model is
                                loaded (as llama.cpp's server does). Bad shapes and types are 400s naming the field
    POST /v1/completions        a raw text continuation of `prompt` (no chat template; a fresh cache each time)
    GET  /v1/models             the one loaded model (with max_model_len, as vLLM reports it)
    GET  /v1/dsv41/memory       the memory report of the last conversation
    GET  /v1/dsv41/model        what the app needs to show and tune a model it reaches through this server
    POST /v1/dsv41/tokens       token counts as the engine counts them (the app's context bar over the network)
    POST /v1/dsv41/heat         what a kept conversation's cache holds of a document's text (engine.served)
    POST /v1/dsv41/pins         pieces of a kept conversation's documents kept hot (engine.served); a chat request's
                                `dsv41_pins` field sets them too, from that turn's end on; `dsv41_progress: true` in a
                                streamed request: the prompt's reading as chunks without choices (`dsv41_progress`)

Requests run one at a time (the engine holds one model); a bounded queue waits behind the running one and a full
queue answers 429 with Retry-After. A chat client resends the whole conversation every time: the request whose
messages extend a kept conversation's reuses its cache (only the new turn is read, as in the app); another
conversation gets a session (and cache) of its own, the least recently used of served.SESSIONS dropped. A request that
cannot fit the context is refused before any work with the numbers (400, OpenAI's error shape, the numbers also
under `dsv41`), never truncated. A client that disconnects cancels its request at the next step, whether it waits
in the queue, its prompt is being read (a stream's headers go out once it is accepted) or it is replying, streamed
or not; the session's cache and transcript stay consistent (ChatSession). Binds to 127.0.0.1; another address
needs an API key (`Authorization: Bearer <key>`); without one, pages of other sites are refused (access_refused).
A failed reply is an error (a 500, or the text so far then an error chunk), never a "stop"; openai_api says the rest.
Every request's engine work runs on the thread the model runs on (engine.threads says why); the app serving its
loaded model runs them on its own engine worker thread, between its own turns.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from . import served
from .errors import ConfigError, ContextOverflowError, PinError
from .events import Done, ErrorEvent, PrefillProgress, TokenText
from .openai_api import (
    access_refused,
    count_tokens,
    error,
    memory_figures,
    model_facts,
    parse_completion,
    parse_request,
    usage,
)
from .threads import EngineThread

QUEUE = 8  # requests that may wait behind the running one
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(model, *, api_key: str | None = None, queue: int = QUEUE, name: str | None = None,
               submit: Callable[[Callable], Future] | None = None):
    """The ASGI app serving `model` (a DSV41Model). `submit(fn) -> Future` runs the engine's work on the thread
    the model runs on (engine.threads: the thread that loaded it; the app passes its worker thread's); by default
    a thread of the server's own."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    conversations = served.Conversations(model)
    submit = submit or EngineThread("engine-request").submit  # one engine call at a time, in order
    waiting = {"n": 0}
    model_id = name or model.info.display_name

    async def json_body(request):
        """(the request's JSON object, None), or (None, the error to answer with)."""
        if (refused := access_refused(request.headers, api_key)) is not None:
            return None, refused
        try:
            body = await request.json()
        except (ValueError, json.JSONDecodeError):
            return None, error(400, "The body is not JSON.")
        return (body if isinstance(body, dict) else {}), None

    async def models(request):
        if (refused := access_refused(request.headers, api_key)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                                         "owned_by": "local",
                                                         "max_model_len": int(model.context_limit)}]})

    async def memory_route(request):
        if (refused := access_refused(request.headers, api_key)) is not None:
            return refused
        return JSONResponse(memory_figures(model, conversations.last))

    async def model_route(request):
        if (refused := access_refused(request.headers, api_key)) is not None:
            return refused
        return JSONResponse(model_facts(model, model_id))

    async def tokens_route(request):
        body, refused = await json_body(request)
        if refused is not None:
            return refused
        try:  # on the engine's thread: the tokenizer is not shared between threads
            return JSONResponse(await asyncio.wrap_future(submit(lambda: count_tokens(model, body))))
        except ConfigError as exc:
            return error(400, str(exc), code="invalid_value")

    def about_conversation(answer):
        """A route answering about a kept conversation (engine.served), on the engine's thread."""
        async def route(request):
            body, refused = await json_body(request)
            if refused is not None:
                return refused
            try:
                return JSONResponse(await asyncio.wrap_future(submit(lambda: answer(conversations, body))))
            except PinError as exc:
                return error(400, str(exc), code="pin_room")
            except ConfigError as exc:
                return error(400, str(exc), code="invalid_value")
        return route

    def overflow(exc: ContextOverflowError):
        return error(400, str(exc), code="context_length_exceeded",
                     extra={"dsv41": {"needed": exc.needed, "limit": exc.limit, "parts": exc.parts}})

    async def run_request(request, chat: bool):
        body, refused = await json_body(request)
        if refused is not None:
            return refused
        try:
            if chat:
                system, history, prompt, settings, knobs = parse_request(body)
            else:
                prompt, settings, knobs = parse_completion(body)
            pins = served.pins_of(body) if chat else None
            progress = served.wants_progress(body)
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

        def run() -> None:  # on the engine's thread, one request at a time
            def put(item):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, item)
                except RuntimeError:  # the server stopped meanwhile (its loop is closed): nobody is listening
                    cancel.set()

            try:
                if cancel.is_set():
                    return put(("cancelled", None))
                session = None
                try:
                    if chat:
                        session = conversations.session_for(system, history)
                        conversations.last = session
                        # the request's knobs over the model's own, for this conversation's cache alone (the
                        # model's, which the app serving its model shows and sets, never change)
                        wanted = model.cache_settings().replace(**knobs)
                        if session.cache.settings != wanted:
                            session.apply_settings(wanted)
                        if pins is not None:  # kept hot from this turn's end on, as the app's own chats
                            session.pins = list(pins)
                        stream = session.send(prompt, cancel=cancel, **settings)
                    else:
                        stream = model.complete(prompt, cancel=cancel, knobs=knobs, **settings)
                except ContextOverflowError as exc:
                    return put(("refused", exc))
                put(("accepted", None))  # nothing refuses it from here on: a stream's headers may go out
                for event in stream:
                    if isinstance(event, TokenText) and event.text:
                        put(("text", event.text))
                    elif isinstance(event, PrefillProgress) and progress:
                        put(("progress", {"done": int(event.done), "total": int(event.total)}))
                    elif isinstance(event, ErrorEvent):  # the reply failed (out of memory...): said, never a "stop"
                        put(("failed", event))
                    elif isinstance(event, Done):
                        stats = event.stats
                        put(("done", {"reason": event.reason, "text": event.text,
                                      "usage": usage(stats.prompt_tokens, stats.prefill_tokens, stats.decode_tokens)
                                      if stats else usage(0, 0, 0), "memory": memory_figures(model, session)}))
            except Exception as exc:  # noqa: BLE001 - the request ends with the error (an EngineError's message is
                # the user's), and the server stays up
                put(("error", exc))
            finally:
                put(("end", None))

        submit(run)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(started)
        kind = "chat.completion" if chat else "text_completion"

        def finish_reason(reason: str) -> str:
            return {"length": "length", "context_full": "length", "stop": "stop", "eos": "stop"}.get(reason, "stop")

        def release() -> None:
            waiting["n"] -= 1

        getter: asyncio.Future | None = None
        checked = time.monotonic()

        async def next_event():
            """The engine's next event; meanwhile (at most every quarter second, however fast the events come) a
            client that went away, while the request waits in the queue, reads its prompt or replies, cancels it
            at its next step."""
            nonlocal getter, checked
            getter = getter or asyncio.ensure_future(events.get())
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.25)
                if not cancel.is_set() and time.monotonic() - checked >= 0.25:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        cancel.set()
                if done:
                    item, getter = getter.result(), None
                    return item

        if not body.get("stream"):
            done, problem = None, None
            try:
                while True:
                    what, value = await next_event()
                    if what == "done":
                        done = value
                    elif what in ("refused", "error", "failed"):
                        problem = value
                    elif what == "end":
                        break
            finally:
                release()
            if isinstance(problem, ContextOverflowError):
                return overflow(problem)
            if isinstance(problem, ErrorEvent):  # the reply failed: its message says what to do
                return error(500, problem.message, "server_error", "out_of_memory" if problem.kind == "oom" else None)
            if problem is not None or done is None:
                return error(500, f"{type(problem).__name__}: {problem}", "server_error")
            reason = finish_reason(done["reason"])
            choice = ({"index": 0, "message": {"role": "assistant", "content": done["text"]}, "finish_reason": reason}
                      if chat else {"index": 0, "text": done["text"], "logprobs": None, "finish_reason": reason})
            return JSONResponse({"id": ident, "object": kind, "created": created, "model": model_id,
                                 "choices": [choice], "usage": done["usage"], "dsv41": done["memory"]})

        # streaming: the refusal must come before the first byte (a 400, not an event); once the request is accepted
        # the headers go out, so that a client leaving during the prompt's read is seen (and cancels it)
        first = await next_event()
        if first[0] == "refused":
            await next_event()  # "end"
            release()
            return overflow(first[1])

        async def stream():
            def chunk(text: str | None, reason: str | None = None, extra: dict | None = None) -> str:
                if chat:
                    delta = {} if text is None else {"content": text}
                    if text == "" and reason is None and extra is None:
                        delta = {"role": "assistant", "content": ""}
                    choice = {"index": 0, "delta": delta, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
                payload = {"id": ident, "object": kind + (".chunk" if chat else ""), "created": created,
                           "model": model_id, "choices": [choice], **(extra or {})}
                return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

            item, failed = first, False
            try:
                if chat:
                    yield chunk("")
                while True:
                    what, value = item
                    if what == "accepted":
                        pass
                    elif what == "progress":  # asked for with dsv41_progress: a chunk without choices
                        yield "data: " + json.dumps({"id": ident, "object": kind + (".chunk" if chat else ""),
                                                     "created": created, "model": model_id, "choices": [],
                                                     "dsv41_progress": value}) + "\n\n"
                    elif what == "text":
                        yield chunk(value)
                    elif what == "done" and not failed:
                        yield chunk(None, finish_reason(value["reason"]), {"usage": value["usage"],
                                                                           "dsv41": value["memory"]})
                    elif what in ("error", "failed"):  # the reply so far, then the error (OpenAI's shape), no finish
                        failed, message = True, value.message if isinstance(value, ErrorEvent) else str(value)
                        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                    elif what == "end":
                        yield "data: [DONE]\n\n"
                        return
                    item = await next_event()
            finally:  # the client went away (or we are done): stop the reply at its next step
                cancel.set()
                release()

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def chat_completions(request):
        return await run_request(request, chat=True)

    async def completions(request):
        return await run_request(request, chat=False)

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/dsv41/memory", memory_route),
                             Route("/v1/dsv41/model", model_route),
                             Route("/v1/dsv41/tokens", tokens_route, methods=["POST"]),
                             Route("/v1/dsv41/heat", about_conversation(served.heat), methods=["POST"]),
                             Route("/v1/dsv41/pins", about_conversation(served.pin), methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


def check_bind(host: str, api_key: str | None) -> None:
    """Off the loopback address an API key is required (anyone who can reach it could use the model otherwise)."""
    if host not in LOOPBACK and not api_key:
        raise ConfigError("host", host, "127.0.0.1, or another address together with --api-key (anyone who can "
                          "reach it could use the model otherwise)")


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, queue: int = QUEUE,
          submit: Callable[[Callable], Future] | None = None) -> None:
    """Run the server until interrupted (uvicorn). Off the loopback address an API key is required. `submit`: as
    create_app's (the CLI passes the thread that loaded the model)."""
    import logging

    import uvicorn

    check_bind(host, api_key)
    log = logging.getLogger("engine.server")
    if host not in LOOPBACK:
        log.warning("listening on %s:%d: requests need Authorization: Bearer <the API key>", host, port)
    print(f"DS-V4.1 serving {model.info.display_name} at http://{host}:{port}/v1 (OpenAI-compatible)", flush=True)
    uvicorn.run(create_app(model, api_key=api_key, queue=queue, submit=submit), host=host, port=port,
                log_level="info")


class BackgroundServer:
    """The server on a thread of its own (the app's Serve switch): start() returns once it listens (or raises),
    stop() ends it. `submit`: as create_app's (the app passes its worker thread's, so served requests and the
    app's own turns run one after the other on the thread that loaded the model)."""

    def __init__(self, model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 submit: Callable[[Callable], Future] | None = None):
        check_bind(host, api_key)
        self.host, self.port, self.model = host, port, model
        self.app = create_app(model, api_key=api_key, submit=submit)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 15.0) -> str:
        import uvicorn

        # on stop, requests still streaming get 2 s, then their tasks are cancelled (which stops their replies)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        server = self._server = uvicorn.Server(config)
        failure: list[BaseException] = []

        def run():
            try:
                server.run()
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)

        self._thread = threading.Thread(target=run, name="engine-server", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not server.started and self._thread.is_alive() and time.monotonic() < end:
            time.sleep(0.02)
        if not server.started:
            server.should_exit = True
            # uvicorn logs why and exits (SystemExit with its code): only a real error's text says anything
            reason = f" ({failure[0]})" if failure and not isinstance(failure[0], SystemExit) else ""
            raise OSError(f"The server could not listen on {self.host}:{self.port}{reason}: the port may be in use "
                          "by another program; pick another port.")
        return self.address

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
