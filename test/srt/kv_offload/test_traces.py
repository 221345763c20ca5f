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


def test_for_topk_keeps_the_window_a_sixteenth_of_small_topk():
    assert traces.TraceConfig.for_topk(2048).window == traces.TraceConfig.window == 128
    small = traces.TraceConfig.for_topk(256, batch=3, churn=0.2)
    assert (small.topk, small.window, small.batch, small.churn) == (256, 16, 3, 0.2)


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


def test_generate_with_scores_returns_the_ranking_it_picked_by():
    """``generate(scores=True)``: the same trace, and each row's drifting picks are the best-scored
    positions of that step (every pick scores at least as high as every position left out)."""
    cfg = traces.TraceConfig.for_topk(64, batch=2, context=1024, layers=2, steps=4)
    trace, relevance = traces.generate(cfg, scores=True)
    assert torch.equal(trace, traces.generate(cfg))
    assert relevance.shape == (4, 2, 2, 1024)
    for t in range(4):
        for layer in range(2):
            for b in range(2):
                score = relevance[t, layer, b]
                picked = torch.zeros(1024, dtype=torch.bool)
                picked[trace[t, layer, b].long()] = True
                drifting = picked & torch.isfinite(score)
                rest = ~picked & torch.isfinite(score)
                assert int(drifting.sum()) == 64 - cfg.sinks - cfg.window
                assert float(score[drifting].min()) >= float(score[rest].max())
