"""The OpenAI API's shapes as the server reads and writes them (engine/server.py serves them): requests to engine
settings, the error body, and our extensions (the memory report, the model's facts, token counts).

`usage.prompt_tokens` is the whole prompt, the kept conversation's share of it under
`prompt_tokens_details.cached_tokens`; `n`, `best_of`, `echo` and `logprobs` other than their defaults are 400s (one
reply, no log-probabilities: never an answer that quietly is not what was asked for)."""

from __future__ import annotations

import hmac

from .config import CACHE_KNOBS
from .errors import ConfigError

ROLES = ("system", "user", "assistant")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _host_name(value: str) -> str:
    """The host of a Host header or an origin's authority, without port or brackets ("[::1]:8000" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def access_refused(headers, api_key: str | None):
    """The error to answer a request with, or None when it may be served.

    With an API key: the key (`Authorization: Bearer <key>`). Without one (the server then listens on the loopback
    address only, engine.server.check_bind) a web page the user has open could still reach it: a page of another
    site can POST to 127.0.0.1 without asking first (a text/plain body) and a site whose name it points at
    127.0.0.1 (DNS rebinding) could even read the replies. So the Host must be this machine's name and a request a
    browser marks as coming from a page (`Origin`) must come from a page served by this machine."""
    if api_key is not None:
        scheme, _, key = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode()):
            return None
        return error(401, "Missing or wrong API key: send Authorization: Bearer <key>.", "authentication_error")
    host, origin = headers.get("host", ""), headers.get("origin")
    if _host_name(host) not in LOCAL_HOSTS:
        return error(403, f"This server answers requests for 127.0.0.1 or localhost only, not {host!r}; to reach it "
                     "under another name, start it with --api-key.", "permission_error")
    if origin is not None and _host_name(origin.partition("://")[2].partition("/")[0]) not in LOCAL_HOSTS:
        return error(403, f"Requests from web pages of other sites ({origin}) are refused; a page served from this "
                     "machine may ask, or start the server with --api-key.", "permission_error")
    return None


def usage(prompt_tokens: int, read: int, completion_tokens: int) -> dict:
    """OpenAI's usage: the whole prompt, of which `prompt_tokens - read` came from the kept conversation's cache
    (`prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report a prefix cache's share)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(prompt_tokens - read, 0)}}


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, headers=None,
          extra: dict | None = None):
    """OpenAI's error body; `extra`: our fields beside it (the numbers of a refusal under `dsv41`)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}, **(extra or {})},
                        status, headers=headers)



def _sampling(body: dict) -> dict:
    """The generation settings a request asks for (OpenAI's names, and vLLM's top_k, repetition_penalty, ignore_eos)."""
    settings = {}
    if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
        settings["max_new_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    for name in ("temperature", "top_p", "seed", "top_k", "repetition_penalty", "ignore_eos"):
        if body.get(name) is not None:
            settings[name] = body[name]
    if body.get("temperature") == 0:
        settings["greedy"] = True
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
            raise ConfigError("stop", stop, "a string or a list of strings")
        settings["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    for name in ("stream", "ignore_eos"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ConfigError(name, body[name], "true or false")
    for name, allowed, wanted in (("n", (1,), "1 (one reply a request)"), ("best_of", (1,), "1"),
                                  ("echo", (False,), "false (the prompt is not echoed)"),
                                  ("logprobs", (False,), "false (log-probabilities are not given)"),
                                  ("top_logprobs", (0,), "0 (log-probabilities are not given)")):
        value = body.get(name)  # asked and not done would be an answer that is not what was asked for
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(name, value, wanted)
    return settings


def _text(content):
    """A message's content as text: a string, or OpenAI's content parts, every one of them text."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content} - {"text"})
        raise ConfigError("messages", ", ".join(kinds) or None,
                          'content parts of type "text" with a string "text" (this model reads text only)')
    return "".join(p["text"] for p in content)


def parse_request(body: dict) -> tuple[str | None, list[dict], str, dict, dict]:
    """(system prompt, history, the new user message, generation settings, cache knobs) or ConfigError."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages", messages, "a non-empty list of {role, content}")
    system, turns = None, []
    for message in messages:
        if not isinstance(message, dict):
            raise ConfigError("messages", type(message).__name__, "a list of {role, content} objects")
        role, content = message.get("role"), _text(message.get("content"))
        if role not in ROLES or not isinstance(content, str):
            raise ConfigError("messages", role, "roles system / user / assistant with text content")
        if role == "system":
            system = content if system is None else system + "\n\n" + content
        else:
            turns.append({"role": role, "content": content})
    if not turns or turns[-1]["role"] != "user":
        raise ConfigError("messages", turns[-1]["role"] if turns else None, "a conversation ending with a user message")
    knobs = {k: body[k] for k in CACHE_KNOBS if k in body}
    return system, turns[:-1], turns[-1]["content"], _sampling(body), knobs


def parse_completion(body: dict) -> tuple[str, dict, dict]:
    """(prompt, generation settings, cache knobs) of a /v1/completions request, or ConfigError."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError("prompt", prompt, "one non-empty string")
    settings = _sampling(body)
    settings.setdefault("max_new_tokens", 16)  # OpenAI's default for completions
    return prompt, settings, {k: body[k] for k in CACHE_KNOBS if k in body}


def memory_figures(model, session) -> dict:
    """The memory report as the server sends it: the headline figures, and the whole report under `report`."""
    report = model.memory_report(session.cache if session is not None else None)
    return {"kv_hot_bytes": report.kv_stored, "kv_cold_bytes": report.kv_cold + report.kv_cold_disk,
            "kv_uncompressed_bytes": report.kv_uncompressed, "compression_ratio": report.compression_ratio,
            "kv_target_ratio": report.kv_target_ratio, "tokens_seen": report.tokens_seen,
            "stored_entries": report.kv_stored_tokens, "weights_bytes": report.weights,
            "device": report.device, "report": report.to_dict()}


def model_facts(model, model_id: str) -> dict:
    """GET /v1/dsv41/model: the figures a remote app shows and the knobs it may change."""
    info = model.info
    return {"id": model_id, "display_name": info.display_name, "context_limit": int(model.context_limit),
            "max_positions": int(model.max_positions), "kv_bytes_per_token": int(model.kv_bytes_per_token()),
            "device": info.device, "dtype": info.dtype, "weight_quant": info.weight_quant,
            "weight_storage": info.weight_storage, "attention_backend": info.attention_backend,
            "attention_kernels": info.attention_kernels,
            "cache_knobs": {k: v for k, v in model.config.to_dict().items() if k in CACHE_KNOBS}}


def count_tokens(model, body: dict) -> dict:
    """POST /v1/dsv41/tokens: `texts` counted as data, `messages` as the chat template renders them, `system`
    as a system prompt, and `stored_kv` (token counts) as the KV bytes the cache keeps of them under `knobs`."""
    from .chat_template import count_system

    out: dict = {}
    texts = body.get("texts", [])
    messages = body.get("messages")
    stored = body.get("stored_kv", [])
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ConfigError("texts", texts, "a list of strings")
    if not isinstance(stored, list) or not all(isinstance(n, int) and n >= 0 for n in stored):
        raise ConfigError("stored_kv", stored, "a list of token counts")
    out["counts"] = [model.count_tokens(t) for t in texts]
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and m.get("role") in ROLES
                                                     and isinstance(m.get("content"), str) for m in messages):
            raise ConfigError("messages", None, "a list of {role, content} with text content")
        out["chat"] = model.count_chat(messages)
    if body.get("system") is not None:
        if not isinstance(body["system"], str):
            raise ConfigError("system", body["system"], "a string")
        out["system"] = count_system(model.tokenizer, body["system"])
    knobs = body.get("knobs") or {}
    if not isinstance(knobs, dict) or any(k not in CACHE_KNOBS for k in knobs):
        raise ConfigError("knobs", knobs, "cache knobs (" + ", ".join(sorted(CACHE_KNOBS)) + ")")
    out["stored_kv_bytes"] = [model.stored_kv_bytes(n, **knobs) for n in stored]
    return out
