"""The "fits your machine" estimate (engine/fit.py) against what the memory report measures after loading: the
default model, one chat per context (a speech cut to that many tokens, one question, a short reply), at the app's
default knobs. Writes results/fit-estimate/fit.json.

    python -m benchmarks.fit_estimate [--contexts 1024 2048 4096]

The error is (estimate - measured) / measured of the engine's total (weights + KV + working memory); the
measured figure is MemoryReport.used_by_engine (weights, hot KV, cold tier, and the process's other growth).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from benchmarks.corpus import recent_speeches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--out", default="results/fit-estimate")
    args = parser.parse_args(argv)
    from engine import DSV41Config, DSV41Model, fit, loader
    from engine.config import USER_DEFAULTS
    from engine.documents import Document

    model = DSV41Model.from_pretrained(DSV41Config(conversation_cache_mb=0, **USER_DEFAULTS))
    config = model.hf_model.config.to_dict()
    gguf = loader.default_gguf_path()
    params = fit.gguf_parameters(gguf)
    text_ids = model.tokenizer(recent_speeches(6), add_special_tokens=False)["input_ids"]
    rows = []
    for context in args.contexts:
        document = model.tokenizer.decode(text_ids[: max(context - 64, 16)])
        session = model.chat_session()
        for _ in session.send("What does the speech say about the economy?",
                              documents=[Document("speech.txt", "speech.txt", "text", document, None, len(document))],
                              max_new_tokens=16, greedy=True):
            pass
        report = model.memory_report(session.cache)
        guess = fit.estimate(config, gguf.stat().st_size, kind="gguf", file_name=gguf.name, context=report.tokens_seen,
                             free=report.free, ratio=model.config.kv_cache_ratio, params=params,
                             cold_tier=model.config.cold_tier != "off")
        measured = {"weights": report.weights, "kv": report.kv_stored + report.kv_cold,
                    "working": report.activations, "total": report.used_by_engine}
        estimated = {"weights": guess.weights, "kv": guess.kv, "working": guess.working, "total": guess.total}
        rows.append({"context": report.tokens_seen, "measured": measured, "estimated": estimated,
                     "error": (guess.total - report.used_by_engine) / report.used_by_engine,
                     "verdict": guess.verdict, "text": guess.describe()})
        print(f"{report.tokens_seen:>6} tokens: measured {report.used_by_engine / 2**30:.3f} GB, estimated "
              f"{guess.total / 2**30:.3f} GB ({rows[-1]['error'] * 100:+.1f} %)")
        del session
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows},
                                             indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
