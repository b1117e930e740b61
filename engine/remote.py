"""The app on an OpenAI-compatible server: our own (`python -m engine serve`), or vLLM, SGLang, LM Studio, Ollama,
llama.cpp's server... RemoteModel and RemoteSession have the surface of DSV41Model and ChatSession that the app uses
(app.engine_api), over HTTP (httpx). Torch-free: a machine that only talks to a server never loads torch.

    model = RemoteModel.connect("http://gpu-box:8000/v1", api_key="...")
    session = model.chat_session("You are terse.")
    for event in session.send("Hello"): ...          # TokenText ..., Done (with TurnStats from `usage`)

What a remote model can and cannot tell:
- Our server (it answers GET /v1/dsv41/model): the memory report of the conversation, the cache knobs (sent with
  every request; the server validates them like the config), token counts as its engine counts them, what its
  cache holds of a document (document_heat) and the pieces kept hot (set_pins; sent with every request too).
- Any other server: the reply and its `usage`; nothing about memory (memory_report() says "not reported"), no cache
  knobs (reconfigure() answers "unsupported"), no heat or pins, token counts estimated (ContextUsage.estimated)
  from characters, the context limit from /v1/models' `max_model_len` where the server gives it (vLLM does), else the panel's.
The user's text and documents travel as the text of the user message, as the app lays them out for its own engine.

Why this file is long: RemoteModel stands in for the whole of DSV41Model's surface the app uses (load, turns, counts,
memory, knobs, heat and pins), each answered from our server or honestly estimated for another; splitting it would
split one object.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

from .config import CACHE_KNOBS, DSV41Config
from .documents import Document, format_for_prompt, load_document, user_content
from .errors import BusyError, ConfigError, ContextOverflowError, EngineError, ModelLoadError, PinError
from .events import ContextUsage, Done, ErrorEvent, Event, PrefillProgress, TokenText, TurnStats
from .heat import DocumentHeat
from .info import LoadInfo, ReconfigureResult
from .memory import MemoryReport

CHARS_PER_TOKEN = 4  # the estimate where the server counts nothing for us (English prose with BPE tokenizers)
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a long document's prefill on a busy server
ASK_TIMEOUT_S = 5.0  # token counts and memory: a server busy with another client's reply is not waited for (the
# counts are then estimated, the memory report kept from the last turn)
EXTRA_SAMPLING = ("top_k", "repetition_penalty")  # not OpenAI's; vLLM, SGLang, LM Studio take them


def is_remote(source: str | None) -> bool:
    """A model source that names a server rather than a model."""
    return isinstance(source, str) and source.strip().lower().startswith(("http://", "https://"))


def base_url(url: str) -> str:
    """The API root: `http://host:port` becomes `http://host:port/v1`; a path given is kept."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError("model_path", url, "a server address such as http://127.0.0.1:8000/v1")
    return url if parts.path not in ("", "/") else url + "/v1"


class RemoteCache:
    """What a remote conversation knows of its cache: our server's last memory report (None from another server)."""

    def __init__(self):
        self.report: dict | None = None


class RemoteSession:
    """One conversation with the server. The server keeps no state we rely on: every request carries the whole
    conversation (our server reuses its cache when the conversation extends what it holds)."""

    def __init__(self, model: RemoteModel, system_prompt: str | None = None):
        self.model = model
        self.system_prompt = system_prompt or None
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.pins: list[str] = []
        self.cache = RemoteCache()
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def set_system_prompt(self, system_prompt: str | None) -> None:
        self.system_prompt = system_prompt or None
        rest = [m for m in self.messages if m.get("role") != "system"]
        self.messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + rest

    def forget_saved(self) -> int:
        return 0  # nothing of a remote chat is saved on this machine besides the app's own store

    def document_heat(self, text: str) -> DocumentHeat | None:
        """What our server's cache of this conversation holds of a document it sent (POST /dsv41/heat); None from
        another server, or where the server does not hold this conversation (it re-reads it at the next question)."""
        if not self.model.ours or not text:
            return None
        answer = self.model.ask("/dsv41/heat", {"messages": self.messages, "text": text})
        try:
            return DocumentHeat.from_dict(answer["heat"]) if answer.get("heat") is not None else None
        except ValueError as exc:
            raise EngineError(f"The server at {self.model.url} sent a heat that cannot be read: {exc}") from exc

    def set_pins(self, texts: Sequence[str]) -> tuple[str, ...]:
        """Our server keeps these pieces hot in its cache of this conversation now (POST /dsv41/pins), or from the
        next question on where it does not hold the conversation; every request carries them (`dsv41_pins`). The
        pieces not found; PinError past the cache's room, changing nothing. Another server keeps nothing hot."""
        texts = [t for t in texts if t and t.strip()]
        missing: list[str] = []
        if self.model.ours and self.messages:
            missing = list(self.model.ask("/dsv41/pins", {"messages": self.messages, "pins": texts})["missing"])
        self.pins = texts
        return tuple(missing)

    def send(self, prompt: str, documents: Sequence[str | Document] = (), *, cancel: threading.Event | None = None,
             **settings) -> Iterator[Event]:
        """Stream one turn. A refusal (context, a bad value, the key, an unreachable server) raises before the
        first event; a failure mid-reply ends it with ErrorEvent + Done("error") keeping the text so far."""
        if self.busy:
            raise BusyError("A reply is still being generated in this chat; stop it or wait for it to finish.")
        docs = [d if isinstance(d, Document) else load_document(d) for d in documents]
        user = {"role": "user", "content": user_content(prompt, docs)}
        started = time.perf_counter()
        # the server counts and refuses what does not fit (ours with the numbers: ContextOverflowError)
        try:
            response = self.model.open_chat(self.messages + [user], settings, self.pins)  # raises before any event
        except ContextOverflowError as exc:
            raise self.model.overflow_with_documents(exc, docs) from None
        return self._stream(response, user, cancel or threading.Event(), started)

    def _stream(self, response, user: dict, cancel: threading.Event, started: float) -> Iterator[Event]:
        self._lock.acquire()
        finished = threading.Event()

        def watch():  # a stop closes the connection: the server stops the reply (ours does), the read below ends
            while not finished.wait(0.05):
                if cancel.is_set():
                    response.close()
                    return

        threading.Thread(target=watch, name="remote-stop", daemon=True).start()
        parts: list[str] = []
        first_at = None
        usage: dict = {}
        memory = None
        reason, failure = "length", None
        try:
            for data in _sse_data(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    failure = str(chunk["error"].get("message", chunk["error"]))
                    break
                read = chunk.get("dsv41_progress")
                if isinstance(read, dict):
                    yield PrefillProgress(int(read.get("done", 0)), int(read.get("total", 0)))
                    continue
                usage = chunk.get("usage") or usage
                memory = chunk.get("dsv41") or memory
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if first_at is None:
                            first_at = time.perf_counter()
                        parts.append(text)
                        yield TokenText(text, -1)
                    if choice.get("finish_reason"):
                        reason = {"stop": "eos", "length": "length"}.get(choice["finish_reason"], "eos")
        except Exception as exc:  # noqa: BLE001 - a stop closes the stream under us; anything else is a failure
            if not cancel.is_set():
                failure = _network_message(exc, self.model.url)
        finally:
            finished.set()
            response.close()
            self._lock.release()
        if cancel.is_set():
            reason = "cancelled"
        elif failure is not None:
            reason = "error"
            yield ErrorEvent(f"The server ended the reply: {failure}")
        text = "".join(parts)
        ended = time.perf_counter()
        if text:  # as ChatSession: an exchange without any reply text is not kept
            self.messages = self.messages + [user, {"role": "assistant", "content": text}]
        # read this turn: the prompt less what the server kept of the conversation (ours says; others count it all)
        read = int(usage.get("prompt_tokens") or 0) - int(
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        completion = int(usage.get("completion_tokens") or len(parts))
        ttft = (first_at or ended) - started
        decode_s = max(ended - (first_at or ended), 1e-9)
        if memory is not None:
            self.cache.report = memory
        report = (memory or {}).get("report") or {}
        stats = TurnStats(ttft_s=ttft, prefill_tokens=read, prefill_tok_s=read / max(ttft, 1e-9),
                          decode_tokens=completion, decode_tok_s=max(completion - 1, 0) / decode_s,
                          total_s=ended - started, tokens_seen=int(report.get("tokens_seen") or 0),
                          kv_stored_tokens=int(report.get("kv_stored_tokens") or 0),
                          kv_stored_bytes=int(report.get("kv_stored") or 0),
                          kv_uncompressed_bytes=int(report.get("kv_uncompressed") or 0),
                          recall_s=float(report.get("recall_s") or 0.0))
        yield Done(reason, text, stats)


class RemoteModel:
    """A model served by an OpenAI-compatible server (see the module's docstring)."""

    def __init__(self, url: str, client, model_id: str, *, facts: dict | None, context_limit: int,
                 config: DSV41Config, load_seconds: float):
        self.url, self.model_id = url, model_id
        self.facts = facts  # our server's GET /v1/dsv41/model, or None
        self._limit = int(context_limit)
        self.config = config
        self._client = client  # httpx.Client with the API key (_http_client)
        self._extras = True  # send top_k / repetition_penalty until the server refuses them
        host = urlsplit(url).netloc
        ours = facts is not None
        self.info = LoadInfo(
            source_kind="remote", display_name=f"{model_id} @ {host}", folder="", resolve_seconds=0.0,
            load_seconds=load_seconds,
            device=f"remote {facts['device']}" if ours else "remote",
            dtype=facts["dtype"] if ours else "server's", weight_quant=facts["weight_quant"] if ours else "server's",
            attention_backend=facts["attention_backend"] if ours else "server's",
            weight_storage=facts.get("weight_storage", "") if ours else "",
            attention_kernels=facts.get("attention_kernels", "") if ours else "", remote="dsv41" if ours else "openai")

    # ------------------------------------------------------------------ connecting
    @classmethod
    def connect(cls, url: str, api_key: str | None = None, *, model: str | None = None, max_seq_len: int = 8192,
                progress=None, knobs: dict | None = None) -> RemoteModel:
        """Reach the server, pick its model (`model`, else the first it lists), and ask whether it is ours.
        `knobs`: cache knobs to send with every request (our server only; the server's own otherwise).
        Every failure is a ModelLoadError that says what to do."""
        import httpx

        url = base_url(url)
        started = time.perf_counter()
        if progress is not None:
            progress(f"Connecting to {url}…", 0.2)
        client = _http_client(api_key)
        try:
            listed = client.get(url + "/models", timeout=30.0)
            if listed.status_code in (401, 403):
                raise ModelLoadError(f"The server at {url} refused the API key ({listed.status_code}).",
                                     reason="remote_auth", source=url)
            if listed.status_code != 200:
                raise ModelLoadError(f"The server at {url} answered {listed.status_code} to GET /models: it "
                                     "does not look like an OpenAI-compatible API.", reason="remote", source=url)
            data = [m for m in listed.json().get("data") or [] if isinstance(m, dict) and m.get("id")]
            ids = [m["id"] for m in data]
            if not ids:
                raise ModelLoadError(f"The server at {url} lists no model.", reason="remote", source=url)
            if model is not None and model not in ids:
                raise ModelLoadError(f"The server at {url} has no model {model!r} (it has {', '.join(ids)}).",
                                     reason="remote", source=url)
            entry = data[ids.index(model)] if model is not None else data[0]
            ours = client.get(url + "/dsv41/model", timeout=30.0)
            facts = ours.json() if ours.status_code == 200 else None
        except ModelLoadError:
            client.close()
            raise
        except (httpx.HTTPError, ValueError) as exc:
            client.close()
            raise ModelLoadError(_network_message(exc, url), reason="remote_unreachable", source=url) from exc
        if facts is not None:  # our server: its knobs, then the ones asked for
            limit = int(facts["context_limit"])
            served = {k: v for k, v in (facts.get("cache_knobs") or {}).items() if k in CACHE_KNOBS}
            wanted = {k: v for k, v in (knobs or {}).items() if k in CACHE_KNOBS}
            config = DSV41Config(model_path=url, max_seq_len=limit).replace(**{**served, **wanted})
        else:
            limit = int(entry.get("max_model_len") or max_seq_len)
            config = DSV41Config(model_path=url, max_seq_len=limit)
        if progress is not None:
            progress(f"Connected to {url}", 1.0)
        return cls(url, client, entry["id"], facts=facts, context_limit=limit, config=config,
                   load_seconds=time.perf_counter() - started)

    @property
    def ours(self) -> bool:
        return self.facts is not None

    @property
    def context_limit(self) -> int:
        return self._limit

    @property
    def max_positions(self) -> int:
        return int(self.facts["max_positions"]) if self.ours else self._limit

    def kv_bytes_per_token(self) -> int:
        return int(self.facts["kv_bytes_per_token"]) if self.ours else 0

    # ------------------------------------------------------------------ requests
    def _post(self, path: str, body: dict, timeout: float | None = None):
        import httpx

        try:
            return self._client.post(self.url + path, json=body, **({"timeout": timeout} if timeout else {}))
        except httpx.HTTPError as exc:
            raise EngineError(_network_message(exc, self.url)) from exc

    def open_chat(self, messages: list[dict], settings: dict, pins: Sequence[str] = ()):
        """POST /chat/completions with stream=true; the response once it streams (or the refusal as an error).
        Our server also gets the cache knobs and the pieces kept hot (`pins`)."""
        import httpx

        body = {"model": self.model_id, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **self._sampling(settings)}
        if self.ours:
            body.update({k: v for k, v in self.config.to_dict().items() if k in CACHE_KNOBS})
            body["dsv41_pins"] = list(pins)
            body["dsv41_progress"] = True  # the prompt's reading, as the local engine reports it
        for attempt in range(2):
            try:
                request = self._client.build_request("POST", self.url + "/chat/completions", json=body)
                response = self._client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise EngineError(_network_message(exc, self.url)) from exc
            if response.status_code == 200:
                return response
            response.read()
            response.close()
            message, payload = _error_of(response)
            if response.status_code == 400 and attempt == 0 and self._extras and any(
                    name in message for name in EXTRA_SAMPLING + ("nrecognized", "xtra")):
                self._extras = False  # a server that takes only OpenAI's own fields: ask again without ours
                body = {k: v for k, v in body.items() if k not in EXTRA_SAMPLING}
                continue
            raise self._refusal(response.status_code, message, payload)
        raise AssertionError("unreachable")

    def ask(self, path: str, body: dict) -> dict:
        """Our server's answer to one of its own requests (POST /dsv41/…), or its refusal as an EngineError (PinError
        for a pin past the cache's room). Waits for a turn running there (the server does one thing at a time)."""
        response = self._post(path, body, timeout=READ_TIMEOUT_S)
        if response.status_code == 200:
            return response.json()
        message, payload = _error_of(response)
        if (payload.get("error") or {}).get("code") == "pin_room":
            raise PinError(message)
        raise self._refusal(response.status_code, message, payload)

    def _sampling(self, settings: dict) -> dict:
        out = {}
        if settings.get("max_new_tokens") is not None:
            out["max_tokens"] = int(settings["max_new_tokens"])
        if settings.get("greedy"):
            out["temperature"] = 0.0
        elif settings.get("temperature") is not None:
            out["temperature"] = float(settings["temperature"])
        for name in ("top_p", "seed"):
            if settings.get(name) is not None and not settings.get("greedy"):
                out[name] = settings[name]
        if self._extras:
            if settings.get("top_k") and not settings.get("greedy"):
                out["top_k"] = int(settings["top_k"])
            if settings.get("repetition_penalty") not in (None, 1.0):
                out["repetition_penalty"] = float(settings["repetition_penalty"])
        if settings.get("stop"):
            out["stop"] = list(settings["stop"]) if not isinstance(settings["stop"], str) else [settings["stop"]]
        return out

    def _refusal(self, status: int, message: str, payload: dict) -> EngineError:
        numbers = payload.get("dsv41") or {}
        if "needed" in numbers:
            return ContextOverflowError(int(numbers["needed"]), int(numbers["limit"]), numbers.get("parts") or {})
        found = re.search(r"maximum context length is (\d+) tokens.*?(\d+) tokens", message, re.S)  # vLLM, OpenAI
        if status == 400 and found:
            return ContextOverflowError(int(found.group(2)), int(found.group(1)))
        if status in (401, 403):
            return EngineError(f"The server at {self.url} refused the API key ({status}): set the key in the "
                               "model panel (Open ▸ OpenAI-compatible server…) and load again.")
        if status == 429:
            return EngineError(f"The server at {self.url} is busy with other requests (429): try again shortly.")
        return EngineError(f"The server at {self.url} refused the request ({status}): {message}")

    def overflow_with_documents(self, exc: ContextOverflowError, docs: Sequence[Document]) -> ContextOverflowError:
        """A server's refusal counts the documents, which travel inside the user's text, as the message: their share
        moved where it belongs and the model's positions named, as the local engine says it."""
        parts = dict(exc.parts)
        if docs and parts.get("prompt"):
            moved = min(sum(self.document_tokens(d) for d in docs), parts["prompt"])
            parts["prompt"] -= moved
            parts["documents"] = parts.get("documents", 0) + moved
        return ContextOverflowError(exc.needed, exc.limit, parts, max_positions=self.max_positions if self.ours else None)

    # ------------------------------------------------------------------ the engine's surface (app.engine_api)
    def chat_session(self, system_prompt: str | None = None) -> RemoteSession:
        return RemoteSession(self, system_prompt)

    def _count(self, body: dict) -> dict | None:
        """Our server's counts (POST /dsv41/tokens), or None where the server is not ours or cannot be asked."""
        if not self.ours:
            return None
        try:
            response = self._post("/dsv41/tokens", body, timeout=ASK_TIMEOUT_S)
        except EngineError:
            return None
        return response.json() if response.status_code == 200 else None

    def count_tokens(self, text: str) -> int:
        counted = self._count({"texts": [text]}) if text else None
        return counted["counts"][0] if counted else _estimate(text)

    def document_tokens(self, document: Document) -> int:
        return self.count_tokens(format_for_prompt(document))

    def context_usage(self, session: RemoteSession | None, history: list[dict], prompt: str = "",
                      documents=(), system_prompt: str | None = None) -> ContextUsage:
        """The context bar's figures: our server's counts, or estimates (`estimated`) from another server."""
        if system_prompt is None:
            system_prompt = session.system_prompt if session is not None else None
        texts = [prompt] + [format_for_prompt(d) for d in documents]
        counted = self._count({"texts": texts, "messages": history, "system": system_prompt or ""})
        if counted is not None:
            counts = counted["counts"]
            system = counted.get("system", 0) if system_prompt else 0
            return ContextUsage(system, counted.get("chat", 0), sum(counts[1:]), counts[0], self._limit)
        history_chars = sum(len(m.get("content", "")) + 8 for m in history)
        return ContextUsage(_estimate(system_prompt or ""), -(-history_chars // CHARS_PER_TOKEN),
                            sum(_estimate(t) for t in texts[1:]), _estimate(prompt), self._limit, estimated=True)

    def stored_kv_bytes(self, tokens_seen: int, **knobs) -> int:
        if not self.ours:
            return 0
        self.config.replace(**knobs)  # validates
        counted = self._count({"stored_kv": [int(tokens_seen)], "knobs": knobs})
        return counted["stored_kv_bytes"][0] if counted else 0

    def memory_report(self, cache: RemoteCache | None = None, *, last_chat: bool = True) -> MemoryReport:
        """Our server's report of the conversation (its last, when `cache` has none yet and `last_chat`; without
        `last_chat` its figures with no chat's cache); from another server a report that says it reports nothing
        (all figures 0, device_label saying so)."""
        host = urlsplit(self.url).netloc
        if not self.ours:
            return MemoryReport(device="remote", device_label=f"{host}: memory not reported by this server",
                                weights=0, kv_stored=0, kv_uncompressed=0, activations=0, other=0, total=0, free=0,
                                remote=self.url)
        figures = cache.report if cache is not None and cache.report else None
        if figures is None:
            try:
                response = self._client.get(self.url + "/dsv41/memory", timeout=ASK_TIMEOUT_S)
                figures = response.json() if response.status_code == 200 else None
            except Exception:  # noqa: BLE001 - the panel shows the server as not reporting, the chat goes on
                figures = None
        report = (figures or {}).get("report")
        if not report:
            return MemoryReport(device="remote", device_label=f"{host}: memory report unavailable", weights=0,
                                kv_stored=0, kv_uncompressed=0, activations=0, other=0, total=0, free=0,
                                remote=self.url)
        fields = {k: v for k, v in report.items() if k in MemoryReport.__dataclass_fields__}
        fields["device_label"] = f"{host} · {fields.get('device_label', '')}"
        fields["remote"] = self.url
        report = MemoryReport(**fields)
        return report if cache is not None and cache.report or last_chat else report.without_chat()

    def reconfigure(self, session=None, progress=None, **knobs) -> ReconfigureResult:
        """Our server: the knobs are validated here and sent with every request from now on (the server applies
        them before it reads the turn). Another server has no such knobs: "unsupported"."""
        bad = [k for k in knobs if k not in CACHE_KNOBS]
        if bad:
            raise ConfigError(bad[0], knobs[bad[0]], "a cache knob (" + ", ".join(sorted(CACHE_KNOBS)) + ")")
        if not self.ours:
            return ReconfigureResult("unsupported", None, None)
        new = self.config.replace(**knobs)
        if new == self.config:
            return ReconfigureResult("unchanged", None, None)
        self.config = new
        return ReconfigureResult("sent", None, None)

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------------------------------------- helpers
def _http_client(api_key: str | None):
    import httpx

    return httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                        headers={"Authorization": f"Bearer {api_key}"} if api_key else {})


def _estimate(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) if text else 0


def _sse_data(response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def _error_of(response) -> tuple[str, dict]:
    try:
        payload = response.json()
    except ValueError:
        return response.text[:300], {}
    if not isinstance(payload, dict):
        return str(payload)[:300], {}
    problem = payload.get("error")
    message = problem.get("message", "") if isinstance(problem, dict) else str(problem or payload.get("detail", ""))
    return message, payload


def _network_message(exc: BaseException, url: str) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return (f"The server at {url} cannot be reached ({exc}). Check that it is running and the address (host, "
                "port, and /v1), then load again.")
    if isinstance(exc, httpx.TimeoutException):
        return f"The server at {url} did not answer in time ({type(exc).__name__}): it may be overloaded."
    return f"The connection to {url} failed: {type(exc).__name__}: {exc}"
