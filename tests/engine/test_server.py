"""python -m engine serve (engine/server.py): a real uvicorn server on 127.0.0.1 in front of the default model,
driven with the standard library's HTTP client as an OpenAI client would: models, a completion with usage, the
same conversation resent with one more turn (only the new turn is read), another conversation kept apart,
streaming by server-sent events, our cache knobs and memory report, a context overflow refused with the numbers,
a full queue answered 429, the API key, and the loopback rule."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serving import free_port, served_in_thread

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(default_model):
    with served_in_thread(default_model, api_key="secret", queue=1) as url:
        yield url, default_model


def call(url, path, body=None, key="secret"):
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


def chat(url, messages, **extra):
    status, _, text = call(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                         **extra})
    return status, json.loads(text)


def read(body) -> int:
    """The prompt tokens a request read: its whole prompt less what came from a kept conversation."""
    return body["usage"]["prompt_tokens"] - body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_completion_and_the_conversation_resent_reads_only_its_new_turn(server):
    url, model = server
    status, _, text = call(url, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["object"] == "model"
    first = [{"role": "user", "content": "What is the capital of France?"}]
    status, body = chat(url, first)
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer and body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["dsv41"]["tokens_seen"] >= usage["prompt_tokens"] and "compression_ratio" in body["dsv41"]
    # the client resends the whole conversation with one more question: only that turn is read
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    status, again = chat(url, second)
    assert status == 200 and read(again) < usage["prompt_tokens"]
    # usage counts the whole prompt (as OpenAI's does), the kept conversation's share under cached_tokens
    assert again["usage"]["prompt_tokens"] > usage["prompt_tokens"] + usage["completion_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
    # another conversation is read from the start, in a cache of its own
    status, other = chat(url, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}])
    assert status == 200 and other["dsv41"]["tokens_seen"] < again["dsv41"]["tokens_seen"]
    status, back = chat(url, second + [{"role": "assistant", "content": again["choices"][0]["message"]["content"]},
                                      {"role": "user", "content": "Thanks."}])
    assert status == 200 and read(back) < usage["prompt_tokens"]  # its cache was kept apart


def test_streaming_by_server_sent_events(server):
    url, _ = server
    status, headers, text = call(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10, "stream": True,
        "temperature": 0})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_cache_knobs_are_extensions_validated_like_the_config(server):
    url, model = server
    own = model.config.kv_cache_ratio
    status, body = chat(url, [{"role": "user", "content": "Hi"}], kv_cache_ratio=0.4)
    assert status == 200 and body["dsv41"]["kv_target_ratio"] == 0.4 and model.config.kv_cache_ratio == own
    status, body = chat(url, [{"role": "user", "content": "Hi"}], kv_cache_ratio=7)
    assert status == 400 and "kv_cache_ratio" in body["error"]["message"]
    status, _, text = call(url, "/v1/dsv41/memory")
    assert status == 200 and json.loads(text)["kv_target_ratio"] == 0.4
    chat(url, [{"role": "user", "content": "Hi"}], kv_cache_ratio=0.5)


def test_refusals_say_why_before_any_work(server):
    url, model = server
    huge = "word " * (model.context_limit + 100)
    status, body = chat(url, [{"role": "user", "content": huge}])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert f"holds {model.context_limit}" in body["error"]["message"]  # the numbers, not a silent cut
    status, body = chat(url, [{"role": "assistant", "content": "no question"}])
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, text = call(url, "/v1/models", key=None)
    assert status == 401 and "Bearer" in json.loads(text)["error"]["message"]
    status, _, text = call(url, "/v1/models", key="wrong")
    assert status == 401


def test_a_full_queue_answers_429_with_retry_after(server):
    url, _ = server
    results = []

    def slow():
        results.append(chat(url, [{"role": "user", "content": "Write a long story."}], max_tokens=200))

    threads = [threading.Thread(target=slow) for _ in range(3)]  # one runs, one waits (queue=1), one is refused
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(300)
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200, 429], statuses
    refused = next(body for status, body in results if status == 429)
    assert refused["error"]["type"] == "rate_limit_error"


def test_another_address_needs_an_api_key(default_model):
    from engine.errors import ConfigError
    from engine.server import serve

    with pytest.raises(ConfigError, match="api-key"):
        serve(default_model, host="0.0.0.0", port=0)


def test_a_client_that_goes_away_mid_stream_stops_the_reply(server, monkeypatch):
    url, model = server
    settings = model.generation_settings
    # the reply would run its whole 3,000 tokens (~40 s here) unless the disconnect stops it
    monkeypatch.setattr(model, "generation_settings", lambda **kw: settings(**{**kw, "ignore_eos": True}))
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}], "max_tokens": 3000,
        "stream": True, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer secret"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # the reply has started
    response.close()  # the client goes away
    started = time.time()
    status, body = chat(url, [{"role": "user", "content": "Hi"}])
    # had the 3,000-token reply gone on, this request would have waited for it behind the engine
    assert status == 200 and time.time() - started < 10
    status, body = chat(url, [{"role": "user", "content": "What is the capital of France?"}])
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]  # and the engine answers right


def test_raw_completions_continue_the_text_without_the_chat_template(server):
    url, model = server
    status, _, text = call(url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0})
    body = json.loads(text)
    assert status == 200 and body["object"] == "text_completion", body
    assert "Paris" in body["choices"][0]["text"]
    ids = model.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(ids)  # the text alone: no template around it
    status, _, text = call(url, "/v1/completions", {"prompt": "One, two, three,", "max_tokens": 6, "temperature": 0,
                                                    "stream": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    status, _, again = call(url, "/v1/completions", {"prompt": "One, two, three,", "max_tokens": 6, "temperature": 0})
    assert streamed == json.loads(again)["choices"][0]["text"] and streamed.strip()
    status, _, text = call(url, "/v1/completions", {"prompt": "", "max_tokens": 4})
    assert status == 400 and "prompt" in json.loads(text)["error"]["message"]


def test_what_a_remote_app_asks_of_our_server(server):
    url, model = server
    status, _, text = call(url, "/v1/dsv41/model")
    facts = json.loads(text)
    assert status == 200 and facts["context_limit"] == model.context_limit
    assert facts["kv_bytes_per_token"] == model.kv_bytes_per_token() and "kv_cache_ratio" in facts["cache_knobs"]
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
    status, _, text = call(url, "/v1/dsv41/tokens", {"texts": ["Hello world", "<|im_start|>"], "messages": messages,
                                                     "system": "Be brief.", "stored_kv": [0, 5000],
                                                     "knobs": {"kv_cache_ratio": 0.25}})
    counts = json.loads(text)
    assert status == 200
    assert counts["counts"] == [model.count_tokens("Hello world"), model.count_tokens("<|im_start|>")]
    assert counts["counts"][1] > 1  # a template marker in user text is data: several tokens, not the control one
    assert counts["chat"] == model.count_chat(messages) and counts["system"] > 0
    assert counts["stored_kv_bytes"] == [0, model.stored_kv_bytes(5000, kv_cache_ratio=0.25)]
    status, _, text = call(url, "/v1/dsv41/tokens", {"knobs": {"kv_cache_ratio": 9}, "stored_kv": [10]})
    assert status == 400 and "kv_cache_ratio" in json.loads(text)["error"]["message"]
    # a refusal carries its numbers for a program (the remote app shows them as the local engine's)
    status, body = chat(url, [{"role": "user", "content": "word " * (model.context_limit + 10)}])
    assert status == 400 and body["dsv41"]["limit"] == model.context_limit
    assert body["dsv41"]["needed"] > model.context_limit and body["dsv41"]["parts"]["prompt"] > 0


def test_the_background_server_says_when_its_port_is_taken(default_model):
    from engine.errors import ConfigError
    from engine.server import BackgroundServer

    with pytest.raises(ConfigError, match="api-key"):
        BackgroundServer(default_model, host="0.0.0.0")
    first = BackgroundServer(default_model, port=free_port())
    address = first.start()
    try:
        status, _, text = call(address.removesuffix("/v1"), "/v1/models", key=None)
        assert status == 200 and json.loads(text)["data"][0]["max_model_len"] == default_model.context_limit
        with pytest.raises(OSError, match="pick another port") as taken:
            BackgroundServer(default_model, port=first.port).start(timeout=5)
        assert "(3)" not in str(taken.value)  # not uvicorn's exit code
    finally:
        first.stop()
    assert not first.running


def test_bad_request_shapes_are_refused_with_400s_naming_the_field(server):
    url, _ = server
    hi = [{"role": "user", "content": "Hi"}]
    cases = [({"messages": ["hi"]}, "messages"), ({"messages": hi, "stop": 5}, "stop"),
             ({"messages": hi, "stop": [5]}, "stop"), ({"messages": hi, "stop": [5], "stream": True}, "stop"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages"),
             ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages"),
             ({"messages": hi, "stream": "no"}, "stream"), ({"messages": hi, "ignore_eos": "yes"}, "ignore_eos"),
             ({"messages": hi, "max_tokens": True}, "max_new_tokens"),
             # asked for and not done would be a 200 that is not what was asked for
             ({"messages": hi, "n": 3}, "n"), ({"messages": hi, "n": True}, "n"), ({"messages": hi, "echo": True}, "echo"),
             ({"messages": hi, "logprobs": True}, "logprobs"), ({"messages": hi, "top_logprobs": 2}, "top_logprobs")]
    for body, field in cases:
        status, _, text = call(url, "/v1/chat/completions", body)
        assert status == 400, (body, status, text)
        error = json.loads(text)["error"]
        assert error["code"] == "invalid_value" and field in error["message"], (body, error)
    status, body = chat(url, [{"role": "user", "content": [{"type": "text", "text": "What is the capital of "},
                                                           {"type": "text", "text": "France?"}]}])
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]  # text parts are read


def test_the_api_keys_scheme_is_case_insensitive(server):
    url, _ = server
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": "bearer secret"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_a_requests_cache_knobs_apply_to_its_conversation_alone(server):
    url, model = server
    own = model.config.kv_cache_ratio
    status, body = chat(url, [{"role": "user", "content": "Hi"}], kv_cache_ratio=0.3)
    assert status == 200 and body["dsv41"]["kv_target_ratio"] == 0.3
    assert model.config.kv_cache_ratio == own  # the model's own (the app's, when it serves its model) unchanged
    status, _, text = call(url, "/v1/dsv41/model")
    assert json.loads(text)["cache_knobs"]["kv_cache_ratio"] == own
    status, body = chat(url, [{"role": "user", "content": "Hello"}])  # another conversation, no knobs
    assert status == 200 and body["dsv41"]["kv_target_ratio"] == own
    # the same conversation resent without its knobs goes back to the model's own
    first = [{"role": "user", "content": "Tell me about tea."}]
    status, body = chat(url, first, kv_cache_ratio=0.3)
    first.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    status, body = chat(url, first + [{"role": "user", "content": "And coffee?"}])
    assert status == 200 and body["dsv41"]["kv_target_ratio"] == own
    assert read(body) < 20  # its own session (a new one would read the whole conversation)
    # the model's owner changing a knob between requests reaches the requests that send none
    model.reconfigure(None, kv_cache_ratio=0.6)
    try:
        status, body = chat(url, [{"role": "user", "content": "Hello again"}])
        assert body["dsv41"]["kv_target_ratio"] == 0.6
    finally:
        model.reconfigure(None, kv_cache_ratio=own)


def _last_conversation_seen(url) -> int:
    """Tokens the last chat's cache holds, once every request before this call is over (a completion queues behind
    them)."""
    status, _, _ = call(url, "/v1/completions", {"prompt": "One", "max_tokens": 1})
    assert status == 200
    return json.loads(call(url, "/v1/dsv41/memory")[2])["tokens_seen"]


def _leave_after(url, body: dict, seconds: float) -> None:
    """Send a chat request and close the connection after `seconds`, whatever came back by then."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=seconds)
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": "Bearer secret"})
    try:
        connection.getresponse().read(1)
    except TimeoutError:
        pass
    connection.close()


def test_a_client_that_goes_away_before_the_reply_stops_it(server, monkeypatch):
    """Non-streaming, and streaming while the prompt is still being read: the request is cancelled at its next step
    (a turn stopped before any reply is undone), not run to its end for nobody."""
    url, model = server
    settings = model.generation_settings
    monkeypatch.setattr(model, "generation_settings", lambda **kw: settings(**{**kw, "ignore_eos": True}))
    story = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}],
             "max_tokens": 3000, "temperature": 0}
    _leave_after(url, story, 1.0)
    seen = _last_conversation_seen(url)
    assert 0 < seen < 1500  # the 3,000-token reply stopped soon after the client left (~20 s of tokens otherwise)

    document = "The harbour records list every ship that docked in the spring. " * 250  # ~3,000 tokens to read
    _leave_after(url, {**story, "stream": True,
                       "messages": [{"role": "user", "content": document + "\nSummarise the records."}]}, 0.3)
    assert _last_conversation_seen(url) == 0  # stopped while reading: the turn was undone


def test_a_reply_that_fails_is_an_error_never_a_stop(server, monkeypatch):
    """Out of memory (or any failure) after a few tokens: not a 200 with finish_reason "stop" a client would take for
    a finished reply, but the engine's message: a 500 when not streamed; streamed, the text so far, then the error
    chunk and no finish_reason."""
    from engine.models import adapter

    url, _ = server
    real, calls = adapter.forward_token, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward_token", failing)
    status, body = chat(url, [{"role": "user", "content": "Write a story about a dragon."}], max_tokens=40)
    assert status == 500 and body["error"]["code"] == "out_of_memory", body
    assert "kv_cache_ratio" in body["error"]["message"]  # what to do
    calls["n"] = 0
    status, _, text = call(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write a story about a knight."}], "max_tokens": 40,
        "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and "out of memory" in events[-1]["error"]["message"].lower()
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)  # the text so far
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
    monkeypatch.setattr(adapter, "forward_token", real)
    status, body = chat(url, [{"role": "user", "content": "What is the capital of France?"}])
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]  # and the server goes on


def test_without_a_key_pages_of_other_sites_are_refused(default_model):
    """A page the user has open in a browser can POST to 127.0.0.1 without asking first (a text/plain body), and a
    site whose name it points at 127.0.0.1 could read the replies: without an API key only requests that name this
    machine as their Host, and come from no page of another site, are served."""
    import http.client

    def post(port, headers):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "text/plain", **headers})
        response = connection.getresponse()
        return response.status, json.loads(response.read())

    with served_in_thread(default_model) as url:
        port = int(url.rpartition(":")[2])
        status, body = post(port, {"Origin": "https://evil.example"})
        assert status == 403 and "other sites" in body["error"]["message"], body
        status, body = post(port, {"Origin": "null"})
        assert status == 403
        status, body = post(port, {"Host": f"rebound.example:{port}"})  # DNS rebinding
        assert status == 403 and "--api-key" in body["error"]["message"]
        for allowed in ({}, {"Origin": f"http://localhost:{port}"}, {"Host": f"localhost:{port}"},
                        {"Origin": "http://[::1]:3000"}):
            status, body = post(port, allowed)
            assert status == 200, (allowed, body)
    # with a key, the key decides (a page cannot send it without the browser asking the server first)
    with served_in_thread(default_model, api_key="k") as url:
        port = int(url.rpartition(":")[2])
        status, _ = post(port, {"Host": f"my-machine.lan:{port}", "Authorization": "Bearer k"})
        assert status == 200
