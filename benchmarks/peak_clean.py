"""Turn peak memory of an 8k-token document turn, each row in a fresh process.

`python -m benchmarks.speed` measures every row's peak in one long process, where glibc serves new allocations from
heap that earlier runs freed. Here every row runs in its own process with every allocation of 128 KiB or more
its own mapping from the start (freed memory goes back to the system), after one short warm turn. Writes
results/peak-clean/peak-clean.json and .md.

Usage: python -m benchmarks.peak_clean [--length 8000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from .common import machine, write_results

ROWS = ("transformers sdpa", "engine default", "engine default, headroom 4096")


def _child(row: str, length: int) -> None:
    from .speed import core

    core._mallopt_threshold(128 * 1024)  # before anything large is allocated
    import torch

    from engine import DSV41Config, DSV41Model

    from .speed import document_prompt, load_hf

    model = DSV41Model.from_pretrained(DSV41Config(max_seq_len=8192))
    ids, question = document_prompt(model, length)
    if row == "transformers sdpa":
        hf = load_hf(model.info.folder, "sdpa", "cpu", torch.float32)
        def turn(n):
            return core.hf_generate(hf, ids, n)
    else:
        if row.endswith("headroom 4096"):
            model.config = model.config.replace(prefill_headroom=4096)
        def turn(n):
            return core.engine_turn(model, ids, question, n)
    turn(2)
    with core.PeakMemory(torch.device("cpu")) as peak:
        turn(8)
    print(json.dumps({"row": row, "peak_extra_bytes": peak.peak_extra}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.length)
        return
    rows = {}
    for row in ROWS:
        out = subprocess.run([sys.executable, "-m", "benchmarks.peak_clean", "--child", row, "--length",
                              str(args.length)], capture_output=True, text=True, check=True)
        rows[row] = json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
        print(f"{row}: +{rows[row] / 2**20:.0f} MiB", flush=True)
    base = rows["transformers sdpa"]
    md = "\n".join([f"Turn peak above the loaded model, {args.length}-token document, 8 tokens out, each row in a "
                    "fresh process (RSS, 128 KiB mmap threshold from the start)\n",
                    "| row | peak (MiB) | vs transformers |", "|---|---|---|"]
                   + [f"| {r} | {v / 2**20:.0f} | {v / base * 100:.0f} % |" for r, v in rows.items()]) + "\n"
    write_results("peak-clean", {"machine": machine(), "length": args.length, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
