"""Decode speed on an idle machine and on one whose cores other programs keep busy, with the decode step's thread
count chosen by timing (engine.threads.DecodeThreads, the default) against every thread always
(DSV41_DECODE_THREADS=fixed) and against threads that sleep at once (OMP_WAIT_POLICY=PASSIVE).

Each run is `python -m engine generate` in a fresh process (the default model, a 200-token greedy reply, no
repetition penalty); "busy" starts one Python busy loop per core beside it. The modes take turns, run by run.

Usage: python -m benchmarks.busy_cores [--runs 3] [--tokens 200] [--folder busy-cores]
Writes results/<folder>/<folder>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

from .common import machine, write_results

MODES = {"adapt (default)": {}, "fixed": {"DSV41_DECODE_THREADS": "fixed"},
         "passive": {"DSV41_DECODE_THREADS": "fixed", "DSV41_CPU_WAIT": "passive"}}
PROMPT = "Write a long story about a cat who learns to sail across the ocean."
_DECODE = re.compile(r"decode (\d+) tok at ([0-9.]+) tok/s")


def _decode_rate(extra_env: dict, tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("DSV41_DECODE_THREADS", "DSV41_CPU_WAIT")}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--greedy",
                           "--max-new-tokens", str(tokens), "--repetition-penalty", "1.0"],
                          env=env, capture_output=True, text=True, timeout=900)
    found = _DECODE.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"generate failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(found[-1][1])


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_cores")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--folder", default="busy-cores")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    rates: dict[str, dict[str, list[float]]] = {}
    for load in ("idle", "busy"):
        loops = _busy_loops(cores) if load == "busy" else []
        try:
            for _ in range(args.runs):
                for mode, env in MODES.items():
                    rate = _decode_rate(env, args.tokens)
                    rates.setdefault(load, {}).setdefault(mode, []).append(rate)
                    print(f"{load:5} {mode:16} {rate:7.1f} tok/s", flush=True)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
    medians = {load: {mode: statistics.median(v) for mode, v in modes.items()} for load, modes in rates.items()}
    rows = ["| machine | " + " | ".join(f"{m}: decode tok/s" for m in MODES) + " | adapt / fixed | adapt / passive |",
            "|---|" + "---|" * (len(MODES) + 2)]
    for load, by_mode in medians.items():
        adapt, fixed, passive = (by_mode[m] for m in MODES)
        label = "idle" if load == "idle" else f"busy ({cores} busy loops beside it)"
        rows.append(f"| {label} | " + " | ".join(f"{by_mode[m]:.1f}" for m in MODES)
                    + f" | ×{adapt / fixed:.2f} | ×{adapt / passive:.2f} |")
    table = (f"Decode tok/s of the default model ({args.tokens}-token greedy reply, `python -m engine generate`), "
             f"medians of {args.runs} fresh processes per mode, the modes taking turns; {cores} cores.\n\n"
             + "\n".join(rows) + "\n")
    print(table)
    write_results(args.folder, {"machine": machine(), "runs": rates, "medians": medians, "tokens": args.tokens},
                  table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
