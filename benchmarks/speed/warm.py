"""Cold vs warm TTFT probe, run in a fresh process by the bench: python -m benchmarks.speed.warm cold|warm.

cold: load the model, then time the first turn. warm: load, run warmup(), then time the first turn.
The turn is what the app is for: a ~1k-token document and a question (--tokens; the bench's --quick passes 256, as
its other sections read). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["cold", "warm"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=1000, help="the document's length in tokens")
    args = parser.parse_args()
    from benchmarks.speed import document_prompt
    from benchmarks.speed.core import engine_turn
    from engine import DSV41Config, DSV41Model

    model = DSV41Model.from_pretrained(DSV41Config(model_path=args.model, device_map=args.device,
                                                        dtype=args.dtype))
    ids, question = document_prompt(model, args.tokens)
    warmup_s = None
    if args.mode == "warm":
        started = time.perf_counter()
        model.warmup()
        warmup_s = time.perf_counter() - started
    turn = engine_turn(model, ids, question, 8)
    print(json.dumps({"mode": args.mode, "ttft_s": turn["ttft_s"], "warmup_s": warmup_s,
                      "prompt_tokens": len(ids)}))


if __name__ == "__main__":
    main()
