"""Our OpenAI-compatible server for tests, on a free loopback port: in a thread of the test process (in front of a
model the tests already hold), or as `python -m engine serve` in a subprocess (what a user runs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_in_thread(app_or_model, **create_app_options):
    """Yield the base URL (http://127.0.0.1:PORT) of uvicorn serving an ASGI app, or engine.server's app of a model."""
    import uvicorn

    app = app_or_model
    if not callable(app_or_model) or hasattr(app_or_model, "chat_session"):
        from engine.server import create_app

        app = create_app(app_or_model, **create_app_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.time() + 20
    while not server.started and time.time() < end:
        time.sleep(0.05)
    assert server.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def served_subprocess(*args: str, timeout: float = 180.0):
    """Yield (base URL, Popen) of `python -m engine serve --port PORT *args`, once GET /v1/models answers."""
    port = free_port()
    log = open(os.devnull, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(port), *args], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + timeout
        while True:
            assert proc.poll() is None, f"python -m engine serve exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.time() < end, "python -m engine serve did not start listening"
            time.sleep(0.25)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


REPLY = "Hello from a server that is not DS-V4.1, word by word."


def stub_app(delay: float = 0.0, words: int | None = None):
    """An OpenAI-compatible server that reports nothing of its own: /v1/models and a streamed chat completion."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: list[dict] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        seen.append(body)
        pieces = REPLY.split(" ") if words is None else [f"w{i}" for i in range(words)]

        async def stream():
            for i, piece in enumerate(pieces):
                text = piece if i == 0 else " " + piece
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}}]})}\n\n"
                await asyncio.sleep(delay)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            usage = {"prompt_tokens": 11, "completion_tokens": len(pieces), "total_tokens": 11 + len(pieces)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    app.state.seen = seen
    return app
