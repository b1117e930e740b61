"""What showing the cache's hold on a document costs: the engine's heat (engine.heat.document_heat) after a question
about a real speech, and the document window's tint (app.widgets.document_text) for a long text whose level changes
at every token (the worst case), written as character formats against extra selections.

    python -m benchmarks.document_heat [--words 640,1280,2900] [--tokens 40000] [--out results/document-heat]

Writes heat.json and heat.md; medians of `--repeats` calls. The GUI part runs offscreen (QT_QPA_PLATFORM).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from .common import RESULTS, machine


def engine_heat(words: list[int], repeats: int) -> list[dict]:
    from engine import DSV41Config, DSV41Model
    from engine.documents import load_document

    from .followup_cases import document, fact_sets

    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192, cold_tier="ram"))
    name, facts = fact_sets()[0]
    rows = []
    for count in words:
        doc = load_document(document(name, facts, count))
        session = model.chat_session()
        list(session.send(facts[0][1], [doc], greedy=True, max_new_tokens=16))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            heat = session.document_heat(doc.text)
            times.append(time.perf_counter() - started)
        rows.append({"words": count, "tokens": heat.tokens, "hot_share": round(heat.hot_share, 4),
                     "median_ms": round(statistics.median(times) * 1000, 2)})
    return rows


def gui_tint(tokens: int, repeats: int) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QTextCharFormat
    from PySide6.QtWidgets import QApplication, QTextEdit

    from app.widgets.document_text import DocumentTextDialog
    from engine.heat import DocumentHeat

    app = QApplication.instance() or QApplication([])
    words = [f"word{i}" for i in range(tokens)]
    text = " ".join(words)
    document = type("Doc", (), {"name": "long.txt", "kind": "txt", "pages": None, "chars": len(text), "text": text})()
    rng = random.Random(0)
    spans, at = [], 0
    for word in words:
        spans.append((at, at + len(word), rng.random()))
        at += len(word) + 1
    heat = DocumentHeat(tuple(spans), 0.5, len(spans), 0, "ram", 0.3)
    dialog = DocumentTextDialog(document)
    dialog.resize(900, 700)
    dialog.show()
    app.processEvents()

    def timed(step) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            app.processEvents()
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1000, 1)

    bar = dialog.text.verticalScrollBar()
    flip = {"up": True}

    def scroll():
        flip["up"] = not flip["up"]
        bar.setValue(bar.maximum() // 3 if flip["up"] else 2 * bar.maximum() // 3)
        dialog.text.viewport().repaint()

    tint_ms = timed(lambda: dialog.show_heat(heat))
    formats_scroll_ms = timed(scroll)
    # the same runs as extra selections, which the view walks on every paint
    dialog.tint.setChecked(False)
    selections = []
    for start, end, level in heat.levels():
        if level:
            cursor = dialog.text.textCursor()
            cursor.setPosition(start)
            cursor.setPosition(end, cursor.MoveMode.KeepAnchor)
            selection = QTextEdit.ExtraSelection()
            selection.cursor, selection.format = cursor, QTextCharFormat()
            selection.format.setBackground(dialog.palette().highlight())
            selections.append(selection)
    dialog.text.setExtraSelections(selections)
    selections_scroll_ms = timed(scroll)
    dialog.close()
    return {"tokens": tokens, "runs_tinted": len(selections), "tint_ms": tint_ms,
            "scroll_ms_char_formats": formats_scroll_ms, "scroll_ms_extra_selections": selections_scroll_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--words", default="640,1280,2900")
    parser.add_argument("--tokens", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "document-heat"))
    args = parser.parse_args(argv)
    payload = {"machine": machine(), "engine": engine_heat([int(w) for w in args.words.split(",")], args.repeats),
               "gui": gui_tint(args.tokens, max(args.repeats // 2, 2))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heat.json").write_text(json.dumps(payload, indent=1))
    lines = ["| document tokens | hot share | heat (median ms) |", "|---|---|---|"]
    lines += [f"| {r['tokens']:,} | {r['hot_share']:.2f} | {r['median_ms']} |" for r in payload["engine"]]
    g = payload["gui"]
    lines += ["", f"Tint of {g['tokens']:,} tokens whose level changes at every token ({g['runs_tinted']:,} runs): "
              f"{g['tint_ms']} ms once; a scroll and repaint {g['scroll_ms_char_formats']} ms as character formats, "
              f"{g['scroll_ms_extra_selections']} ms as extra selections."]
    (out / "heat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
