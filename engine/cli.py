"""python -m engine {chat, generate, memory, doctor, bench, gpucheck}."""

from __future__ import annotations

import argparse
import queue
import re
import sys
import threading

from .cli_documents import attach as _attach
from .cli_documents import doc_command as _doc
from .cli_documents import documents as _documents
from .cli_documents import heat as _heat
from .cli_documents import names as _names
from .cli_documents import pin as _pin
from .config import KNOBS, KNOBS_LIST, USER_DEFAULTS, DSV41Config
from .errors import ConfigError, ContextOverflowError, EngineError
from .threads import EngineThread, ctrl_c_sets

_ENGINE: EngineThread | None = None


def engine_thread() -> EngineThread:
    """The one thread that loads the model and runs every turn (engine.threads says why it must be one)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = EngineThread("engine")
    return _ENGINE


def _number(text: str) -> int | float:
    """An int where the text is one, else a float (prefill_headroom: tokens, or a size in GB)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _model_args(p: argparse.ArgumentParser, *, turns: bool = True) -> None:
    """--model, --no-flash, then one flag per registry knob marked `cli` (engine.config.KNOBS); with `turns`, the
    sampling flags and --system (the server takes those from each request instead)."""
    g = p.add_argument_group("model and cache (engine.config.KNOBS; checked before the model loads)")
    g.add_argument("--model", default="default", help=KNOBS["model_path"].help)
    g.add_argument("--no-flash", action="store_true", help="eager attention instead of fused kernels")
    for knob in KNOBS_LIST:
        if not knob.cli:
            continue
        if knob.kind is bool:
            g.add_argument(knob.flag, action="store_true", help=knob.help)
        elif isinstance(knob.kind, tuple):  # the terminal chat starts as the app does (config.USER_DEFAULTS)
            default = USER_DEFAULTS.get(knob.name, knob.default)
            g.add_argument(knob.flag, choices=knob.kind, default=default, help=f"{knob.help} (default {default})")
        else:
            kind = {int: int, float: float, str: str}.get(knob.kind, _number)
            default = "automatic" if knob.default is None else knob.default
            g.add_argument(knob.flag, type=kind, default=knob.default, help=f"{knob.help} (default {default})")
    if not turns:
        return
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=512)
    s.add_argument("--greedy", action="store_true")
    s.add_argument("--temperature", type=float, default=0.7)
    s.add_argument("--top-p", type=float, default=0.9)
    s.add_argument("--top-k", type=int, default=50)
    s.add_argument("--repetition-penalty", type=float, default=1.1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")


def _config(args):
    knobs = {knob.name: getattr(args, knob.name) for knob in KNOBS_LIST if knob.cli}
    return DSV41Config(model_path=args.model, use_flash_attention=not args.no_flash, **knobs)


def _sampling(args) -> dict:
    """The sampling flags, validated (a bad value fails before the model loads)."""
    from .config import GenerationSettings

    values = dict(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
                  stop=tuple(_text(s) for s in args.stop))
    GenerationSettings(**values)
    return values


def _text(value: str, what: str = "") -> str:
    """A command-line or terminal string as valid text: bytes that are not UTF-8 become U+FFFD (said once)."""
    from .chat_template import clean_text, replaced_count

    count = replaced_count(value)
    if count and what:
        print(f"note: {count} byte(s) of the {what} were not valid UTF-8 and were replaced with \ufffd",
              file=sys.stderr)
    return clean_text(value)


def _load(args):
    from .model import DSV41Model

    def progress(message, fraction):
        print(f"[{fraction:4.0%}] {message}", file=sys.stderr)

    # loaded on the engine thread, where every turn then runs (engine.threads: decode at half speed otherwise)
    model = engine_thread().call(DSV41Model.from_pretrained, _config(args), progress=progress)
    i = model.info
    weights = i.weights
    if i.prefill_bf16:
        weights += ", prefill in bf16"
    print(f"Loaded {i.display_name} on {i.device} ({i.dtype}, weights {weights}, attention {i.attention_backend}) "
          f"in {i.resolve_seconds + i.load_seconds:.1f} s", file=sys.stderr)
    if i.attention_kernels:
        print(f"Attention kernels: {i.attention_kernels}", file=sys.stderr)
    return model


def _stream(session, prompt, documents, args, cancel) -> object:
    """Print a turn as it streams; Ctrl-C stops it. Returns the Done event."""
    from .events import Done, ErrorEvent, PrefillProgress, TokenText

    events: queue.Queue = queue.Queue()

    def work():
        try:
            for event in session.send(prompt, documents, cancel=cancel, **_sampling(args)):
                events.put(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            events.put(exc)
        events.put(None)

    engine_thread().submit(work)  # the thread that loaded the model
    done = None
    reading = False  # a "[reading …]" line is open on stderr: it ends before the reply's text starts
    with ctrl_c_sets(cancel):
        while True:
            try:
                # A timeout, not a wait without end: a SIGINT that lands as the wait starts to block leaves the
                # wait blocked (its handler runs at the next Python step), so the reply would stop only at its
                # next event. Polling takes that step within a quarter of a second.
                event = events.get(timeout=0.25)
            except queue.Empty:
                continue
            except KeyboardInterrupt:  # off the main thread, or a handler of our own could not be set
                cancel.set()
                continue
            if event is None:
                break
            if isinstance(event, BaseException):
                raise event
            if reading and not isinstance(event, PrefillProgress):
                print(file=sys.stderr, flush=True)
                reading = False
            if isinstance(event, TokenText):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, PrefillProgress) and event.total > 2048:
                print(f"\r[reading {event.done}/{event.total} tokens]", end="", file=sys.stderr, flush=True)
                reading = True
            elif isinstance(event, ErrorEvent):
                print(f"\n[{event.kind}] {event.message}", file=sys.stderr)
            elif isinstance(event, Done):
                done = event
    print()
    return done


def _print_stats(done) -> None:
    if done is None or done.stats is None:
        return
    s = done.stats
    print(f"[{done.reason}] TTFT {s.ttft_s * 1000:.0f} ms · prefill {s.prefill_tokens} tok at {s.prefill_tok_s:.0f} tok/s"
          f" · decode {s.decode_tokens} tok at {s.decode_tok_s:.1f} tok/s · KV {s.kv_stored_tokens}/{s.tokens_seen} "
          f"tokens, ×{s.compression_ratio:.2f} an uncompressed cache's bytes (positions and scores included)",
          file=sys.stderr)


def cmd_generate(args) -> int:
    _sampling(args)
    prompt = _text(args.prompt, "prompt")
    documents = _documents(args.document)
    model = _load(args)
    session = model.chat_session(_text(args.system, "system prompt") if args.system else None)
    done = _stream(session, prompt, documents, args, threading.Event())
    _print_stats(done)
    return 0 if done is not None and done.reason != "error" else 1


def _overflow_help(pending: list) -> str:
    """The terminal chat's own remedies for a turn that does not fit (the error's advice names the app's)."""
    dropped = f"/doc clear drops {_names(pending)}; " if pending else ""
    return f" In this chat: {dropped}/reset starts a new conversation."


_COMMANDS = (  # the terminal chat's commands, as /help lists them
    ("/doc PATH", "attach a file, or a folder's documents, to the next message"),
    ("/doc", "list what is attached to the next message; /doc clear drops it"),
    ("/memory", "what the model, the cache and the activations take in memory"),
    ("/heat", "what the cache holds hot of each document sent, and where"),
    ("/pin TEXT", "keep that piece of a document hot"),
    ("/unpin", "let the cache decide again what stays hot"),
    ("/reset", "start a new conversation"),
    ("/help", "these lines (also /?)"),
    ("/quit", "leave the chat (also /exit, or Ctrl-D)"),
)
_BARE = ("/memory", "/heat", "/unpin", "/reset", "/quit", "/exit")  # commands that take nothing after them


def _command(text: str) -> tuple[str, str] | None:
    """A chat line's command and what follows it, or None for a message: its first word is not "/" and letters
    only (or "/?"), as "/usr/bin is a folder" or "/ 2" are not."""
    word, rest = (text.split(None, 1) + [""])[:2]
    if word != "/?" and not re.fullmatch(r"/[A-Za-z]+", word):
        return None
    return word, rest.strip()


def cmd_chat(args) -> int:
    _sampling(args)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach us as surrogate escapes, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    model = _load(args)
    session = model.chat_session(_text(args.system, "system prompt") if args.system else None)
    pending_docs: list = []
    sent_docs: list = []  # the documents sent in this conversation (/heat)
    for path in args.document:
        _attach(path, pending_docs, model)
    print("Chat with the model. Commands: /doc PATH (a file, or a folder's documents, attached to the next message), "
          "/doc (list what is attached), /doc clear, /memory, /heat (what the cache holds of each document sent), "
          "/pin TEXT (keep that piece of a document hot), /unpin, /reset, /help, /quit. Ctrl-C stops a reply.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # as Python's prompt: the line is dropped and the chat goes on
            print()
            print("(Ctrl-D or /quit to quit)", file=sys.stderr)
            continue
        text = _text(line.strip(), "message")
        if not text:
            continue
        command = _command(text)
        if command is not None:
            word, rest = command
            if word not in _BARE + ("/doc", "/pin", "/help", "/?"):
                print(f"Unknown command {word}: /help lists the commands", file=sys.stderr)
            elif word in _BARE and rest:
                print(f"({word} takes nothing after it: /help lists the commands)", file=sys.stderr)
            elif word in ("/quit", "/exit"):
                return 0
            elif word in ("/help", "/?"):
                print("\n".join(f"{usage:<10} {what}" for usage, what in _COMMANDS), file=sys.stderr)
            elif word == "/memory":
                model.print_memory_usage(session.cache)
            elif word == "/heat":
                print(_heat(session, sent_docs))
            elif word == "/unpin" or (word == "/pin" and rest):
                print(_pin(session, rest or None), file=sys.stderr)
            elif word == "/pin":
                print("usage: /pin TEXT keeps that piece of a document the chat has read hot (/unpin lets the cache "
                      "decide again)", file=sys.stderr)
            elif word == "/reset":
                session.reset()
                sent_docs = []
                dropped = f"; {_names(pending_docs)} no longer attached" if pending_docs else ""
                pending_docs = []
                print(f"(new conversation{dropped})", file=sys.stderr)
            else:
                pending_docs = _doc(rest, pending_docs, model)
            continue
        recorded = len(session.messages)
        try:
            done = _stream(session, text, pending_docs, args, threading.Event())
        except EngineError as exc:
            kept = f" {_names(pending_docs)} stay attached." if pending_docs else ""
            remedy = _overflow_help(pending_docs) if isinstance(exc, ContextOverflowError) else ""
            print(f"error: {exc}{remedy}\n(the message was not sent; type it again to retry.{kept})", file=sys.stderr)
            continue
        _print_stats(done)
        if len(session.messages) == recorded:
            # stopped before anything was kept (Ctrl-C while the message or its documents were read): the turn
            # was undone, so its documents wait for the next message as they did for this one
            kept = f"; {_names(pending_docs)} stay attached" if pending_docs else ""
            print(f"(the message was not kept: type it again to send it{kept})", file=sys.stderr)
        else:
            sent_docs += pending_docs
            pending_docs = []


def cmd_memory(args) -> int:
    _sampling(args)
    documents = _documents([args.document])
    model = _load(args)
    session = model.chat_session(_text(args.system, "system prompt") if args.system else None)
    done = _stream(session, _text(args.prompt, "prompt"), documents, args, threading.Event())
    _print_stats(done)
    report = model.print_memory_usage(session.cache)
    print(f"Device: {report.device_label}; {report.free / 2**30:.2f} of {report.total / 2**30:.2f} GB free")
    print(f"Tokens seen {report.tokens_seen}, KV entries stored {report.kv_stored_tokens} per layer and head (the layers' mean), "
          f"compression ×{report.compression_ratio:.2f}")
    if report.hint():
        print("Hint:", report.hint())
    return 0


def cmd_doctor(args) -> int:
    from .doctor import main as doctor_main

    return doctor_main()


def _checkout_tool(module: str, argv: list[str], prog: str) -> int:
    """Run a tool that lives in benchmarks/ at the repository root, which the wheel does not ship."""
    import importlib

    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", module):
            raise
        print(f"error: {prog} is not part of the installed package; run it from a source checkout (in the "
              f"repository root: {prog})", file=sys.stderr)
        return 2
    return main(argv, prog=prog)


def cmd_serve(args) -> int:
    from .server import check_bind, serve

    check_bind(args.host, args.api_key)  # said before the model loads
    if args.queue < 0:
        raise ConfigError("queue", args.queue, "0 or more requests waiting behind the running one")
    serve(_load(args), host=args.host, port=args.port, api_key=args.api_key, queue=args.queue,
          submit=engine_thread().submit)
    return 0


def cmd_bench(args) -> int:
    return _checkout_tool("benchmarks.speed", args.argv, "python -m engine bench")


def cmd_gpucheck(args) -> int:
    return _checkout_tool("benchmarks.gpucheck", args.argv, "python -m engine gpucheck")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="DS-V4.1 engine, headless")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("chat", help="interactive streaming chat")
    _model_args(p)
    p.add_argument("--document", action="append", default=[],
                   help="attach a file (or a folder's documents) to the first message")
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("generate", help="one reply to --prompt")
    _model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--document", action="append", default=[])
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("memory", help="feed a document and print the memory report")
    _model_args(p)
    p.add_argument("--document", required=True)
    p.add_argument("--prompt", default="Summarise the document in one sentence.")
    p.set_defaults(func=cmd_memory, max_new_tokens=32)
    p = sub.add_parser("serve", help="the model as an OpenAI-compatible API (POST /v1/chat/completions); sampling "
                       "and the system prompt come with each request")
    _model_args(p, turns=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (another than 127.0.0.1 needs --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on every request")
    p.add_argument("--queue", type=int, default=8, help="requests that may wait behind the running one; more are "
                   "answered 429 with Retry-After (default 8)")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("doctor", help="check the installation and suggest fixes")
    p.set_defaults(func=cmd_doctor)
    # every argument goes to the benchmark's own parser (no "-" prefix here, so none is taken as an option)
    p = sub.add_parser("bench", help="speed and memory against transformers generate (JSON, Markdown, plots; "
                       "source checkout only)", add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("gpucheck", help="the CUDA path in one run: parity with transformers, speed, memory, failure "
                       "paths (JSON under results/gpucheck; --smoke: a tiny model on the CPU)", add_help=False,
                       prefix_chars="\0")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_gpucheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
