"""python -m engine: generate, memory, doctor (in-process, against the real default model)."""

import signal

import pytest

from engine.cli import main

pytestmark = pytest.mark.model


def test_generate_prints_the_reply_and_stats(capsys, default_model):
    code = main(["generate", "--prompt", "What is the capital of France?", "--greedy", "--max-new-tokens", "24",
                 "--max-seq-len", "2048"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "Paris" in out
    assert "TTFT" in err and "tok/s" in err


def test_memory_feeds_a_document_and_prints_the_seed_lines(capsys, tmp_path, default_model):
    import pydoc_data.topics

    doc = tmp_path / "topics.txt"
    doc.write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:6])[:12_000])  # ~3k tokens, read in chunks
    code = main(["memory", "--document", str(doc), "--max-seq-len", "8192", "--kv-cache-ratio", "0.5"])
    out, _ = capsys.readouterr()
    assert code == 0
    for line in ("Model weights:", "KV Cache:", "(compressed from", "Activation:", "Total:", "compression ×"):
        assert line in out
    ratio = float(out.split("compression ×")[1].split()[0])
    # budget 0.5 of tokens seen (plus side data); ced_threshold may drop more entries even under budget
    assert 0.05 < ratio < 0.6


def test_bad_knob_is_an_error_naming_the_field(capsys):
    code = main(["generate", "--prompt", "hi", "--kv-cache-ratio", "3"])
    _, err = capsys.readouterr()
    assert code == 2 and "kv_cache_ratio=3.0" in err and "[0.01, 1.0]" in err


def test_missing_document_is_reported(capsys, tmp_path, default_model):
    code = main(["memory", "--document", str(tmp_path / "nope.pdf")])
    _, err = capsys.readouterr()
    assert code == 2 and "nope.pdf" in err


def test_doctor_reports_every_check(capsys):
    code = main(["doctor"])
    out, _ = capsys.readouterr()
    for name in ("Python", "PyTorch", "transformers", "flash-attn", "bitsandbytes", "RAM", "default model"):
        assert name in out
    assert code in (0, 1)
    assert ("No problems found." in out) == (code == 0)


def test_interactive_chat_streams_and_handles_commands(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = tmp_path / "fact.txt"
    doc.write_text("The secret password of the lighthouse is MARMALADE.\n")
    script = (f"/doc {doc}\nWhat is the secret password of the lighthouse?\n/heat\n"
              "/pin password of the lighthouse\n/pin words in no document\n/unpin\n/memory\n/reset\n/heat\n/quit\n")
    proc = subprocess.run([sys.executable, "-m", "engine", "chat", "--greedy", "--max-new-tokens", "24",
                           "--max-seq-len", "2048"], input=script, capture_output=True, text=True, cwd=root,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MARMALADE" in proc.stdout.upper()
    assert "Model weights:" in proc.stdout and "KV Cache:" in proc.stdout
    assert "attached" in proc.stderr and "(new conversation)" in proc.stderr
    # /heat: what the cache holds of the document sent (a 12-token document is kept whole: hot in every head)
    assert "fact.txt: 100% of its 12 tokens hot (cache ratio 0.50); the rest in the cold tier in RAM" in proc.stdout
    assert "  start |" + "█" * 60 + "| end" in proc.stdout
    assert "(no document has been sent in this chat yet)" in proc.stdout  # after /reset
    assert "(kept hot: 1 piece; /unpin lets the cache decide again)" in proc.stderr
    assert "(kept, but no document the chat has read holds that text yet" in proc.stderr
    assert "(nothing is kept hot now: the cache decides again)" in proc.stderr


def test_the_terminal_chat_starts_with_the_cold_tier_on_as_the_app_does():
    from app import knobs as app_knobs
    from engine.cli import _config, build_parser
    from engine.config import KNOBS, USER_DEFAULTS

    for command in (["chat"], ["generate", "--prompt", "hi"]):
        config = _config(build_parser().parse_args(command))
        assert config.cold_tier == USER_DEFAULTS["cold_tier"] == "ram"
    assert _config(build_parser().parse_args(["chat", "--cold-tier", "off"])).cold_tier == "off"
    assert KNOBS["cold_tier"].default == "off"  # the engine API's default: the benchmarks' baseline
    assert app_knobs.DEFAULTS["cold_tier"] == "ram"


def test_serve_refuses_another_address_without_an_api_key_before_loading(capsys):
    from engine import cli as engine_cli

    assert engine_cli.main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "host" in err and "--api-key" in err and "Loaded" not in err


def _fake_model(session_class):
    """A model class for the CLI's tests: its facts, and chat sessions of `session_class`."""

    from engine.info import LoadInfo

    class Model:
        info = LoadInfo(source_kind="fake", display_name="fake", folder="", resolve_seconds=0.0, load_seconds=0.0,
                        device="cpu", dtype="float32", weight_quant="none", attention_backend="sdpa")

        context_limit, max_positions = 100, 8192

        def chat_session(self, system_prompt=None):
            return session_class()

        def document_tokens(self, document):  # a character a token
            return len(document.text)

    return Model


def test_the_cli_loads_the_model_and_runs_every_turn_on_one_thread(monkeypatch, capsys):
    """engine.threads: OpenMP keeps a thread pool per thread that starts parallel regions; a model loaded on one
    thread and decoded on another ran at half speed on 2 cores. The CLI does both on its engine thread."""
    import threading

    from engine import cli
    from engine.events import Done, TokenText
    from engine.model import DSV41Model

    threads = {}

    class Session:
        def send(self, prompt, documents, cancel=None, **settings):
            threads["turn"] = threading.current_thread().name
            yield TokenText("hello", 1)
            yield Done("eos", "hello")

    Model = _fake_model(Session)

    def from_pretrained(config, progress=None):
        threads["load"] = threading.current_thread().name
        return Model()

    monkeypatch.setattr(DSV41Model, "from_pretrained", staticmethod(from_pretrained))
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert "hello" in capsys.readouterr().out
    assert threads["load"] == threads["turn"] == "engine" != threading.current_thread().name


def test_the_engine_thread_runs_calls_in_order_and_hands_back_their_errors():
    import threading

    from engine.threads import EngineThread

    thread = EngineThread("t")
    seen = []
    futures = [thread.submit(seen.append, i) for i in range(5)]
    assert thread.call(threading.current_thread) is not threading.current_thread()
    assert [f.result() for f in futures] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(lambda: "still running") == "still running"


def _fake_chat(monkeypatch, lines: list, prompts: list | None = None):
    """cmd_chat over a fake model: a message "stop" is stopped before anything is kept (as Ctrl-C while its
    document is read), "ctrl-c" is stopped by a Ctrl-C sent to the chat while it is answered, any other is answered
    and recorded; a line KeyboardInterrupt is Ctrl-C at the prompt. Returns the documents each send was given (and
    adds each message sent to `prompts`)."""
    import builtins
    import signal
    import threading
    import time

    from engine import cli
    from engine.errors import ContextOverflowError
    from engine.events import Done, TokenText
    from engine.model import DSV41Model

    sent = []

    class Session:
        messages: list = []

        def send(self, prompt, documents, cancel=None, **settings):
            sent.append([doc.name for doc in documents])
            if prompts is not None:
                prompts.append(prompt)
            if sum(len(doc.text) for doc in documents) >= Model.context_limit:
                raise ContextOverflowError(200, Model.context_limit, {"documents": 200})
            if prompt == "ctrl-c":  # as the terminal does: SIGINT to the main thread, once it waits for the reply
                time.sleep(0.2)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                assert cancel.wait(10), "Ctrl-C during the reply did not stop it"
            if prompt == "ctrl-c in a finalizer":
                # Python runs a signal's handler at its next step, which can be inside a finalizer the garbage
                # collector runs; an exception raised there (KeyboardInterrupt) is printed and dropped.
                handler = signal.getsignal(signal.SIGINT)

                class Dying:
                    def __del__(self):
                        handler(signal.SIGINT, None)

                Dying()
                assert cancel.wait(1), "Ctrl-C handled inside a finalizer did not stop the reply"
            if prompt in ("stop", "ctrl-c", "ctrl-c in a finalizer"):
                yield Done("cancelled", "")
                return
            self.messages = self.messages + [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": "ok"}]
            yield TokenText("ok", 1)
            yield Done("eos", "ok")

        def reset(self):
            self.messages = []

    Model = _fake_model(Session)

    feed = iter(lines)

    def fake_input(prompt=""):
        line = next(feed, EOFError)
        if line in (EOFError, KeyboardInterrupt):
            raise line
        return line

    monkeypatch.setattr(DSV41Model, "from_pretrained", staticmethod(lambda config, progress=None: Model()))
    monkeypatch.setattr(builtins, "input", fake_input)
    assert cli.main(["chat"]) == 0
    return sent


def test_a_message_stopped_before_anything_was_kept_leaves_its_documents_attached(monkeypatch, capsys, tmp_path):
    doc = tmp_path / "spec.txt"
    doc.write_text("The spec.")
    sent = _fake_chat(monkeypatch, [f"/doc {doc}", "stop", "What is it about?", "And then?"])
    err = capsys.readouterr().err
    assert sent == [["spec.txt"], ["spec.txt"], []]  # the retry still carries the document; the next does not
    assert "(the message was not kept: type it again to send it; spec.txt stay attached)" in err


def test_the_terminal_chat_lists_clears_and_resets_attached_documents(monkeypatch, capsys, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A.")
    b.write_text("B.")
    sent = _fake_chat(monkeypatch, [f"/doc {a}", "/doc", "/doc clear", "one", f"/doc {b}", "/reset", "two",
                                    "/doc clear"])
    err = capsys.readouterr().err
    assert sent == [[], []]  # neither document reached a message
    assert "(attached to the next message: a.txt; /doc clear removes them)" in err
    assert "(a.txt no longer attached)" in err
    assert "(new conversation; b.txt no longer attached)" in err
    assert "(nothing was attached)" in err


def test_a_document_too_large_for_the_context_is_said_when_attached_and_the_refusal_names_the_chats_remedies(
        monkeypatch, capsys, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 150)  # 150 tokens to the fake model; its context holds 100
    sent = _fake_chat(monkeypatch, [f"/doc {big}", "What is it?", "/doc clear", "What is it?"])
    err = capsys.readouterr().err
    assert "warning: big.txt is 150 tokens and the context holds 100: no message can carry it. /doc clear drops it" \
        in err
    assert "In this chat: /doc clear drops big.txt; /reset starts a new conversation." in err
    assert sent == [["big.txt"], []]  # refused while attached; answered once dropped


def test_a_doc_line_with_a_missing_file_among_several_attaches_the_others(monkeypatch, capsys, tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("Good.")
    sent = _fake_chat(monkeypatch, [f"/doc {good} {tmp_path / 'nothere.pdf'}", "Read it."])
    err = capsys.readouterr().err
    assert sent == [["good.txt"]]
    assert f'"nothere.pdf" was not found at {tmp_path / "nothere.pdf"}.' in err


def test_a_doc_folder_attaches_the_documents_inside_it(monkeypatch, capsys, tmp_path):
    notes = tmp_path / "my notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "b.txt").write_text("B.")
    (notes / "sub" / "a.md").write_text("A.")
    (notes / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    empty = tmp_path / "photos"
    empty.mkdir()
    (empty / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    sent = _fake_chat(monkeypatch, [f"/doc {notes}", f"/doc {empty}", "What do they say?"])
    err = capsys.readouterr().err
    assert sent == [["b.txt", "a.md"]]  # in name order, the subfolder's too; the image left out
    assert '(2 documents attached from the folder "my notes". 1 other file left out (1 .png).)' in err
    assert ('error: The folder "photos" holds no documents the app reads (PDF, Word, text, Markdown or source '
            "files). 1 other file left out (1 .png). (not attached)") in err


def test_a_doc_folder_counts_the_documents_read_and_names_those_refused(monkeypatch, capsys, tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.md").write_text("A.")
    (mixed / "empty.txt").write_text("")
    (mixed / "good.txt").write_text("Good.")
    (mixed / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "blank.txt").write_text("")
    sent = _fake_chat(monkeypatch, [f"/doc {mixed}", f"/doc {broken}", "What do they say?"])
    err = capsys.readouterr().err
    assert sent == [["a.md", "good.txt"]]
    assert "3 documents attached" not in err
    refused = err.index('error: "empty.txt" contains no text. (not attached)')
    said = err.index('(2 documents attached from the folder "mixed". 1 could not be read: empty.txt. 1 other file '
                     'left out (1 .png).)')
    assert refused < said  # counted once the documents were read
    assert '(No document attached from the folder "broken". 1 could not be read: blank.txt.)' in err


def test_a_doc_folder_read_whole_says_nothing_more_than_its_documents(monkeypatch, capsys, tmp_path):
    (tmp_path / "a.txt").write_text("A.")
    (tmp_path / "b.txt").write_text("B.")
    sent = _fake_chat(monkeypatch, [f"/doc {tmp_path}", "Read them."])
    err = capsys.readouterr().err
    assert sent == [["a.txt", "b.txt"]]
    assert "attached from the folder" not in err and "could not be read" not in err


def test_pin_alone_help_and_a_mistyped_command_are_not_sent_to_the_model(monkeypatch, capsys):
    prompts: list = []
    sent = _fake_chat(monkeypatch, ["/pin", "/help", "/?", "/hep", "/unknown", "/heat all", "/reset now",
                                    "/usr/bin is a folder, right?", "/ 2", "/pin   "], prompts)
    err = capsys.readouterr().err
    assert prompts == ["/usr/bin is a folder, right?", "/ 2"] and len(sent) == 2  # not commands: messages
    assert err.count("usage: /pin TEXT keeps that piece of a document the chat has read hot") == 2
    for line in ("/doc PATH  attach a file, or a folder's documents, to the next message",
                 "/pin TEXT  keep that piece of a document hot", "/reset     start a new conversation",
                 "/help      these lines (also /?)", "/quit      leave the chat (also /exit, or Ctrl-D)"):
        assert err.count(line + "\n") == 2  # /help and /?, a command a line
    assert "Unknown command /hep: /help lists the commands" in err
    assert "Unknown command /unknown: /help lists the commands" in err
    assert "(/heat takes nothing after it: /help lists the commands)" in err
    assert "(/reset now" not in err and "(new conversation" not in err  # /reset with words after it did nothing


def test_ctrl_c_at_the_prompt_drops_the_line_and_during_a_reply_stops_it(monkeypatch, capsys):
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the shell started the run ignoring it
    prompts: list = []
    sent = _fake_chat(monkeypatch, [KeyboardInterrupt, "hello", "ctrl-c", KeyboardInterrupt, "again",
                                    "ctrl-c in a finalizer", "after"], prompts)
    err = capsys.readouterr().err
    assert prompts == ["hello", "ctrl-c", "again", "ctrl-c in a finalizer", "after"] and len(sent) == 5
    assert err.count("(Ctrl-D or /quit to quit)") == 2
    assert err.count("(the message was not kept: type it again to send it)") == 2  # the stopped replies
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C at the prompt is as it was


def test_the_reading_progress_line_ends_before_the_reply(monkeypatch, capsys):
    from engine import cli
    from engine.events import Done, PrefillProgress, TokenText
    from engine.model import DSV41Model

    class Session:
        def send(self, prompt, documents, cancel=None, **settings):
            yield PrefillProgress(1024, 3000)
            yield PrefillProgress(3000, 3000)
            yield TokenText("Answer", 1)
            yield Done("eos", "Answer")

    Model = _fake_model(Session)
    monkeypatch.setattr(DSV41Model, "from_pretrained", staticmethod(lambda config, progress=None: Model()))
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    err = capsys.readouterr().err
    assert "[reading 3000/3000 tokens]\n" in err


def test_documents_and_sampling_are_checked_before_the_model_loads(monkeypatch, capsys, tmp_path):
    from engine import cli
    from engine.model import DSV41Model

    def from_pretrained(config, progress=None):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(DSV41Model, "from_pretrained", staticmethod(from_pretrained))
    doc = tmp_path / "a.txt"
    doc.write_text("A.")
    (tmp_path / "empty").mkdir()
    for argv, said in ((["memory", "--document", str(tmp_path / "nope.pdf")], "nope.pdf"),
                       (["memory", "--document", str(doc), "--seed", "-1"], "seed=-1"),
                       (["generate", "--prompt", "hi", "--document", str(tmp_path / "none.txt")], "none.txt"),
                       (["generate", "--prompt", "hi", "--document", str(tmp_path / "empty")],
                        'The folder "empty" holds no documents')):
        assert cli.main(argv) == 2
        assert said in capsys.readouterr().err


def test_serve_offers_no_flags_it_would_ignore(capsys):
    # sampling and the system prompt come with each request: the server's own flags for them did nothing
    from engine.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--system", "Be brief."])
    assert "unrecognized arguments: --system" in capsys.readouterr().err
    for flag in ("--greedy", "--max-new-tokens", "--temperature", "--seed", "--stop"):
        assert flag not in build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default None)" not in build_parser()._subparsers._group_actions[0].choices["chat"].format_help()


def test_a_doc_path_is_read_as_a_terminal_gives_it(tmp_path, monkeypatch):
    from engine.cli_documents import typed_paths as _typed_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    spaced = tmp_path / "my file ünï 文件.txt"
    spaced.write_text("x")
    other = tmp_path / "b.txt"
    other.write_text("y")
    assert _typed_paths(str(spaced)) == [str(spaced)]  # typed as it is, spaces and all
    assert _typed_paths(f"'{spaced}'") == [str(spaced)]  # a dragged file, quoted
    assert _typed_paths(str(spaced).replace(" ", "\\ ")) == [str(spaced)]  # or escaped
    assert _typed_paths(f"'{spaced}' {other}") == [str(spaced), str(other)]  # several dragged at once
    assert _typed_paths("~/b.txt") == ["~/b.txt"]  # load_document expands ~
    assert _typed_paths("'/nowhere/x.txt") == ["'/nowhere/x.txt"]  # unbalanced: as typed, its error names it


def test_bitsandbytes_imports_without_its_optional_kernel_warning():
    """Its CPU backend warns at import that the hub's `kernels` package is absent (an optional kernel it replaces
    with its own): printed right after doctor's "No problems found", it read as a failure."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", "from engine.loader import import_bitsandbytes as f; print(f().__name__)"],
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "bitsandbytes", out.stderr[-1000:]
    assert "gemm_4bit_forward" not in out.stderr and "pip install kernels" not in out.stderr
