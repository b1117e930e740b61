"""Shared benchmark plumbing: machine facts and result files (the speed benchmark is benchmarks/speed/)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import psutil
import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"


def cpu_facts() -> dict:
    """The CPU's name, its family and model numbers and the widest vector instructions it has, from /proc/cpuinfo's
    first processor: "AMD EPYC" alone names Zen 1 to Zen 4, whose vector units differ by 2x (family 23 = Zen 1/2,
    25 = Zen 3/4; Zen 4 adds AVX-512)."""
    facts: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in facts:
                    facts[key] = value.strip() if key == "model name" else int(value.strip())
                elif key == "flags":
                    flags = set(value.split())
                    facts["isa"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
                                                "amx_tile") if f in flags]
                    break
    except (OSError, ValueError):
        pass
    return {"cpu": facts.get("model name") or platform.processor() or platform.machine(),
            "cpu_family": facts.get("cpu family"), "cpu_model": facts.get("model"), "isa": facts.get("isa", [])}


def machine(device: torch.device | None = None) -> dict:
    """What a results file says about where it was measured; `device` defaults to the GPU when one is visible."""
    import transformers

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        **cpu_facts(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "platform": platform.platform(),
    }


def write_results(name: str, payload: dict, table_md: str) -> Path:
    folder = RESULTS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    (folder / f"{name}.md").write_text(table_md)
    return folder
