"""The realistic top-k traces of benchmark/kv_offload/traces.py have what they claim to have."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
import traces  # noqa: E402

SMALL = dict(batch=2, context=4096, topk=256, layers=3, steps=10, sinks=4, window=32)


def test_rows_hold_sinks_window_and_unique_positions_in_the_context():
    cfg = traces.TraceConfig(**SMALL)
    trace = traces.generate(cfg)
    assert trace.shape == (10, 3, 2, 256)
    for t in range(cfg.steps):
        n = cfg.context - cfg.steps + 1 + t
        for row in trace[t].reshape(-1, cfg.topk):
            pos = set(row.tolist())
            assert len(pos) == cfg.topk and min(pos) >= 0 and max(pos) < n
            assert set(range(cfg.sinks)) <= pos and set(range(n - cfg.window, n)) <= pos


@pytest.mark.parametrize("churn", [0.1, 0.4])
def test_measured_churn_overlap_and_returns(churn):
    cfg = traces.TraceConfig(**SMALL, churn=churn)
    stats = traces.measure(traces.generate(cfg))
    drifting = (cfg.topk - cfg.sinks - cfg.window) / cfg.topk
    for layer_churn in stats["churn_per_layer"]:
        # The drifting part churns at about the target; sinks never, the window by one a step.
        assert abs(layer_churn - churn * drifting) < 0.1, stats
    assert stats["adjacent_layer_overlap"] >= 0.7, stats  # IndexCache: 70-100 %
    assert stats["returns"] > 0.1, stats  # positions leave and come back


def test_uniform_churn_for_contrast_has_no_layer_agreement():
    cfg = traces.TraceConfig(**SMALL, share=0.0)
    assert traces.measure(traces.generate(cfg))["adjacent_layer_overlap"] < 0.5


def test_bench_lru_runs_on_realistic_traces(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(BENCH_DIR / "bench_lru.py"),
        "--device", "cpu", "--bs", "2", "--ctx", "512", "--churn", "0.4", "--rows", "656",
        "--topk", "64", "--buffer", "128", "--steps", "4", "--warm", "2",
        "--trace", "realistic", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["trace"] == "realistic" and result["trace_stats"]["returns"] > 0
    assert result["correct_ours"] and result["err_flags"] == 0 and result["misses_ours"] > 0


def test_bench_exposed_runs_the_real_adapter_with_and_without_prefetch(tmp_path):
    """The exposed-time benchmark's logic on CPU (eager, interpreter; no timing claims): on
    realistic traces whose adjacent layers share most of their top-k, the prefetch moves loads off
    the next layer's own plan."""
    out = tmp_path / "exposed.json"
    cmd = [
        sys.executable, str(BENCH_DIR / "bench_exposed.py"),
        "--device", "cpu", "--bs", "2", "--ctx", "512", "--layers", "3", "--topk", "64",
        "--slots", "128", "--warm", "1", "--steps", "2", "--compute-scale", "0.001",
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    plain, prefetch = row["offload"], row["offload+prefetch"]
    assert plain["loaded_rows_per_layer"] > 0 and plain["prefetched_rows_per_layer"] == 0
    assert prefetch["prefetched_rows_per_layer"] > 0
    assert prefetch["loaded_rows_per_layer"] < plain["loaded_rows_per_layer"]
    assert row["trace_stats"]["adjacent_layer_overlap"] > 0.7
