"""engine.remote without the app: a server busy with another client's reply does not stall the app's token counts
(they fall back to an estimate, marked so), and a refused request says why."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.serving import served_in_thread


def busy_server(delay: float):
    """Says it is ours (GET /v1/dsv41/model) but answers token counts only after `delay` seconds."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"data": [{"id": "m", "object": "model"}]})

    async def facts(request):
        return JSONResponse({"id": "m", "display_name": "m", "context_limit": 4096, "max_positions": 8192,
                             "kv_bytes_per_token": 1000, "device": "cuda:0", "dtype": "bfloat16", "weight_quant": "none",
                             "weight_storage": "", "attention_backend": "sdpa", "attention_kernels": "",
                             "cache_knobs": {"kv_cache_ratio": 0.5}})

    async def tokens(request):
        await asyncio.sleep(delay)
        return JSONResponse({"counts": [1], "stored_kv_bytes": []})

    async def chat(request):
        return JSONResponse({"error": {"message": "busy elsewhere", "type": "server_error"}}, 503)

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/dsv41/model", facts),
                             Route("/v1/dsv41/tokens", tokens, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


def test_counts_from_a_busy_server_fall_back_to_an_estimate_in_time(monkeypatch):
    from engine import remote
    from engine.errors import EngineError

    monkeypatch.setattr(remote, "ASK_TIMEOUT_S", 0.3)
    with served_in_thread(busy_server(delay=5.0)) as base:
        model = remote.RemoteModel.connect(base + "/v1")
        assert model.ours and model.context_limit == 4096 and model.info.remote == "dsv41"
        started = time.monotonic()
        usage = model.context_usage(None, [{"role": "user", "content": "x" * 40}], "a question?")
        assert time.monotonic() - started < 2.0  # not the server's 5 s
        assert usage.estimated and usage.prompt == 3 and usage.history >= 10 and usage.limit == 4096
        with pytest.raises(EngineError, match="refused the request \\(503\\): busy elsewhere"):
            model.chat_session().send("hello")
        model.close()
