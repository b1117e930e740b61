"""Self-test: load the default model, answer one prompt greedily, print the figures. No Qt at all.

    python -m app.selftest [--model PATH] [--prompt TEXT] [--max-new-tokens N] [--max-seq-len N]
    python -m app --selftest          (the same, through the app's entry point)
    python3 installer/bootstrap.py selftest

For the launchers and for support: exit code 0 when the model answered (a non-empty reply), 1
otherwise, with the error and what to do. It never imports PySide6, so it runs on machines
without a display or without Qt's system libraries.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback

DEFAULT_PROMPT = "What is the capital of France?"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app --selftest", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-seq-len", type=int, default=2048)
    return p


def _versions() -> str:
    parts = [f"Python {platform.python_version()}", f"{platform.system()} {platform.machine()}"]
    try:
        import torch

        cuda = torch.version.cuda
        parts.append(f"torch {torch.__version__}" + (f" (CUDA {cuda})" if cuda else " (CPU build)"))
        if torch.cuda.is_available():
            parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    except Exception as e:  # noqa: BLE001
        parts.append(f"torch not importable: {e}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import engine  # noqa: F401 - before torch: what it sets up must precede torch (engine/__init__.py)
    print("DS-V4.1 Chat self-test", flush=True)
    print(f"  system:   {_versions()}", flush=True)
    try:
        from engine import DSV41Config, DSV41Model
        from engine.events import Done, ErrorEvent, TokenText

        def progress(message: str, fraction: float) -> None:
            print(f"  [{fraction * 100:3.0f}%] {message}", flush=True)

        t0 = time.perf_counter()
        from engine.threads import EngineThread

        # loaded and run on one thread, as the app's worker does (engine.threads: decode at half speed otherwise)
        engine = EngineThread("selftest-engine")
        model = engine.call(DSV41Model.from_pretrained,
                            DSV41Config(model_path=args.model, max_seq_len=args.max_seq_len), progress=progress)
        load_s = time.perf_counter() - t0
        info = model.info
        print(f"  model:    {info.display_name} on {info.device} ({info.dtype}, weights {info.weights}, "
              f"attention {info.attention_backend})", flush=True)
        print(f"  load:     {load_s:.2f} s (finding/converting {info.resolve_seconds:.2f} s, "
              f"loading {info.load_seconds:.2f} s)", flush=True)

        session = model.chat_session()
        pieces: list[str] = []
        done = None
        errors: list[str] = []
        crash: list[BaseException] = []

        def turn() -> None:  # on the engine thread, as the app and the CLI run it
            nonlocal done
            try:
                for event in session.send(args.prompt, max_new_tokens=args.max_new_tokens, greedy=True):
                    if isinstance(event, TokenText):
                        pieces.append(event.text)
                    elif isinstance(event, ErrorEvent):
                        errors.append(f"{event.kind}: {event.message}")
                    elif isinstance(event, Done):
                        done = event
            except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
                crash.append(exc)

        t1 = time.perf_counter()
        engine.call(turn)
        wall = time.perf_counter() - t1
        if crash:
            raise crash[0]
        reply = (done.text if done is not None and done.text else "".join(pieces)).strip()

        print(f"  prompt:   {args.prompt}")
        print(f"  reply:    {reply if reply else '(empty)'}")
        stats = done.stats if done is not None else None
        if stats is not None:
            print(f"  TTFT:     {stats.ttft_s * 1000:.0f} ms (prefill {stats.prefill_tokens} tokens at "
                  f"{stats.prefill_tok_s:.0f} tok/s)")
            print(f"  decode:   {stats.decode_tokens} tokens at {stats.decode_tok_s:.1f} tok/s "
                  f"(turn {stats.total_s:.2f} s, ended by {done.reason})")
        else:
            print(f"  turn:     {wall:.2f} s (no statistics: {done.reason if done else 'no end event'})")
        report = model.memory_report(session.cache)
        print(f"  memory ({report.device_label}):")
        for line in report.format_text().splitlines():
            print(f"    {line}")
        print(f"    free: {report.free / 1024**3:.2f} GB of {report.total / 1024**3:.2f} GB", flush=True)
        for err in errors:
            print(f"  error:    {err}")
        if not reply:
            print("FAIL: the model gave an empty reply. Run 'python3 installer/bootstrap.py doctor' and "
                  "send its output with this one to support.", flush=True)
            return 1
        print("PASS", flush=True)
        return 0
    except KeyboardInterrupt:
        print("FAIL: interrupted", flush=True)
        return 1
    except Exception as e:  # noqa: BLE001  (a self-test reports every failure as a result)
        if os.environ.get("DSV41_DEBUG"):
            traceback.print_exc()
        print(f"FAIL: {type(e).__name__}: {e}", flush=True)
        print("  (set DSV41_DEBUG=1 for the traceback; 'python3 installer/bootstrap.py doctor' checks the "
              "machine, 'python3 installer/bootstrap.py setup --force' reinstalls the environment)", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
