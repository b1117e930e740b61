"""Shared benchmark plumbing: machine facts, medians, transformers baseline timing, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"


def machine() -> dict:
    import psutil
    import transformers

    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return info


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class TimingStreamer:
    """A transformers streamer that timestamps every generated token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_generate_timing(model, input_ids: torch.Tensor, new_tokens: int) -> dict:
    """TTFT and decode tok/s of plain transformers `generate` (greedy, exactly `new_tokens` tokens)."""
    streamer = TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                             pad_token_id=model.config.eos_token_id)
    end = time.perf_counter()
    times = streamer.times
    return {
        "ttft_s": times[0] - start,
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
        "tokens": int(out.shape[1] - input_ids.shape[1]), "total_s": end - start,
    }


def write_results(name: str, payload: dict, table_md: str) -> Path:
    folder = RESULTS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    (folder / f"{name}.md").write_text(table_md)
    return folder
