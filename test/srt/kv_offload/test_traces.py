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


@pytest.mark.parametrize("kind", ["uniform", "realistic"])
def test_bench_decode_scale_layer_traces(kind):
    import argparse

    import bench_decode_scale

    a = argparse.Namespace(trace=kind, topk=256, steps=4, churn=0.4, seed=0)
    per_layer, info = bench_decode_scale.layer_traces(2, 4096, 3, a, device="cpu")
    assert info["kind"] == kind and len(per_layer) == 3
    for steps in per_layer:
        assert len(steps) == 4
        for topk in steps:
            assert topk.shape == (2, 256) and topk.dtype == torch.int32
            assert int(topk.min()) >= 0 and int(topk.max()) < 4096
            assert all(len(set(row.tolist())) == 256 for row in topk)
    layer0, layer1 = (set(per_layer[i][1][0].tolist()) for i in (0, 1))
    if kind == "realistic":  # adjacent layers share most of their top-k, and it says so
        assert len(layer0 & layer1) / 256 > 0.6 and info["adjacent_layer_overlap"] > 0.6
        assert info["returns"] > 0 and info["churn_per_layer_max"] > 0
    else:  # independent per layer
        assert len(layer0 & layer1) / 256 < 0.3


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
    the next layer's own plan; the oracle guess (the next layer's own top-k) moves every load but
    layer 0's off it, and moves exactly the rows the plain swap-in moves."""
    out = tmp_path / "exposed.json"
    cmd = [
        sys.executable, str(BENCH_DIR / "bench_exposed.py"),
        "--device", "cpu", "--bs", "2", "--ctx", "512", "--layers", "3", "--topk", "64",
        "--slots", "128", "--warm", "1", "--steps", "2", "--compute-scale", "0.001",
        "--prefetch-oracle", "--speculative-indexer", "--oracle-catch", "0.5", "--out", str(out),
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
    oracle = row["offload+prefetch+oracle"]
    assert oracle["loaded_rows_per_layer"] < prefetch["loaded_rows_per_layer"]
    moved = oracle["loaded_rows_per_layer"] + oracle["prefetched_rows_per_layer"]
    assert moved == pytest.approx(plain["loaded_rows_per_layer"])
    # The speculative indexer's logits run before each swap-in and change no row moved; they read
    # every request's index keys (512 tokens x 132 B).
    spec = row["offload+prefetch+oracle+specidx"]
    for key in ("loaded_rows_per_layer", "prefetched_rows_per_layer", "hit_rate"):
        assert spec[key] == oracle[key]
    assert row["speculative_indexer"]["key_mb_per_layer"] == 2 * 512 * 132 / 1e6
    # A guess catching half the next layer's top-k leaves more of it to that layer's own plan.
    half = row["offload+prefetch+guess50+specidx"]
    assert half["loaded_rows_per_layer"] > oracle["loaded_rows_per_layer"]


def test_mixed_guess_keeps_a_share_of_the_next_layers_top_k_and_fills_from_the_layer_before():
    """bench_exposed --oracle-catch: each guess row keeps about ``catch`` of its layer's own
    entries, fills the rest with the previous layer's entries outside them (then -1), and stays
    unique; layer 0 keeps its own top-k."""
    from bench_exposed import mixed_guess

    trace = traces.generate(traces.TraceConfig(**SMALL))
    guess = mixed_guess(trace, 0.8, seed=1)
    assert guess.shape == trace.shape and torch.equal(guess[:, 0], trace[:, 0])
    kept = filled = total = 0
    for t in range(trace.shape[0]):
        for layer in range(1, trace.shape[1]):
            for row, own, alt in zip(guess[t, layer], trace[t, layer], trace[t, layer - 1]):
                got = row[row >= 0].tolist()
                assert len(got) == len(set(got))
                own_set, alt_set = set(own.tolist()), set(alt.tolist())
                kept += len(own_set.intersection(got))
                filled += sum(1 for x in got if x not in own_set)
                assert all(x in alt_set for x in got if x not in own_set)
                total += len(own_set)
    assert 0.77 < kept / total < 0.83 and filled > 0


def test_layer_budget_replay_matches_the_plan_reference_hit_for_hit():
    """bench_layer_budgets' vectorised LRU replays a trace exactly as the plan's torch reference
    (``lru_ref.plan_layer_ref``, which the plan kernel matches bit for bit) does, with a
    different slot budget per request."""
    import bench_layer_budgets as budgets
    from sglang.srt.mem_cache.sparsity.kv_offload.lru_ref import plan_layer_ref
    from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import LayerState

    cfg = traces.TraceConfig(**{**SMALL, "layers": 1, "steps": 12, "churn": 0.5})
    trace = traces.generate(cfg)[:, 0]  # (steps, batch, topk)
    capacity = torch.tensor([cfg.topk, cfg.topk + 96])
    got = budgets.lru_hits(trace, capacity, cfg.context, first=2)

    # Request b's position p is logical loc b * context + p; every loc has a host copy, none a
    # tail row; each request owns its budget's slots.
    n, num_locs = int(capacity.max()), cfg.batch * cfg.context
    state = LayerState(
        loc_to_slot=torch.full((num_locs,), -1, dtype=torch.int32),
        slot_loc=torch.full((cfg.batch, n), -1, dtype=torch.int32),
        lru=torch.arange(n, dtype=torch.int16).repeat(cfg.batch, 1),
        out_cache_loc_sparse=torch.arange(cfg.batch * n, dtype=torch.int32).view(cfg.batch, n),
        num_slots=capacity.to(torch.int32),
    )
    host = torch.arange(num_locs, dtype=torch.int64)
    tails = torch.full((num_locs,), -1, dtype=torch.int64)
    first_loc = torch.arange(cfg.batch)[:, None] * cfg.context
    want = torch.zeros(cfg.batch, dtype=torch.int64)
    for t in range(cfg.steps):
        res = plan_layer_ref(
            (trace[t] + first_loc).to(torch.int32),
            torch.arange(cfg.batch),
            torch.tensor([cfg.batch], dtype=torch.int32),
            host,
            tails,
            state,
        )
        assert int(res.error_flags[0]) == 0
        if t >= 2:
            want += cfg.topk - res.num_misses.to(torch.int64)
    assert got.tolist() == want.tolist()
    assert got[1] > got[0]  # the larger budget holds more of the returns


def test_layer_budget_split_follows_the_measured_gains():
    import bench_layer_budgets as budgets

    steps = [256, 384, 512, 640]
    curves = torch.tensor([[100, 101, 102, 103], [100, 180, 240, 260], [100, 150, 170, 175]])
    split = budgets.split_budget(curves, steps, total=3 * 384)
    assert sum(split) <= 3 * 384 and min(split) >= 256
    assert split == [256, 512, 384]  # slots go where they buy the most hits
    with pytest.raises(ValueError, match="cannot give"):
        budgets.split_budget(curves, steps, total=3 * 256 - 1)
    with pytest.raises(ValueError, match="below top-k"):
        budgets.lru_hits(torch.zeros((1, 1, 8), dtype=torch.int32), torch.tensor([4]), 16, 0)


def test_bench_layer_budgets_runs_and_reports_its_trace(tmp_path):
    out = tmp_path / "budgets.json"
    cmd = [
        sys.executable, str(BENCH_DIR / "bench_layer_budgets.py"),
        "--batch", "1", "--ctx", "4096", "--topk", "256", "--slots", "512", "--max-slots", "1024",
        "--unit", "128", "--layers", "3", "--calibrate", "6", "--steps", "6", "--warm", "2",
        "--churn-spread", "0.5,1.0", "--out", str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["args"]["churn_spread"] for r in rows] == [0.5, 1.0]
    for r in rows:
        assert sum(r["split_measured"]) <= 3 * 512 and min(r["split_measured"]) >= 256
        assert all(0 < h < 1 for h in r["hit_rate"].values())
        assert len(r["trace_stats"]["churn_per_layer"]) == 3
        curve = r["uniform_hit_curve"]
        assert r["budgets"] == list(range(256, 1025, 128)) and len(r["layer_hit_curves"]) == 3
        assert len(curve) == len(r["layer_hit_curves"][0]) == len(r["budgets"])
        assert curve[-1] > curve[0]  # twice the slots hold more of the returns


def test_bench_layer_budgets_emits_a_server_config_from_a_recorded_trace(tmp_path):
    """``--trace-file`` replays a recorded (steps, layers, requests, topk) trace and
    ``--emit-config`` writes its measured split as a --kv-offload-config the server accepts."""
    from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig

    cfg = traces.TraceConfig(
        batch=1, context=4096, topk=256, layers=4, steps=12, churn=0.4, churn_spread=1.0,
        share=0.5, seed=3,
    )  # fmt: skip
    torch.save(traces.generate(cfg), tmp_path / "trace.pt")
    emitted = tmp_path / "config.json"
    base = [
        sys.executable, str(BENCH_DIR / "bench_layer_budgets.py"), "--ctx", "4096",
        "--slots", "512", "--max-slots", "1024", "--unit", "128", "--calibrate", "6",
        "--steps", "6", "--warm", "2", "--out", str(tmp_path / "out.json"),
    ]  # fmt: skip
    cmd = base + ["--trace-file", str(tmp_path / "trace.pt"), "--emit-config", str(emitted)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    row = json.loads((tmp_path / "out.json").read_text())["rows"][0]
    assert (row["args"]["layers"], row["args"]["topk"]) == (4, 256)  # from the trace's shape
    config = KVOffloadConfig.from_json(emitted.read_text())
    config.check(index_topk=256)
    assert list(config.layer_slots(4)) == row["split_measured"]
    assert sum(row["split_measured"]) <= 4 * 512 and config.sparse_slots_per_req == 512
    torch.save(torch.zeros((3, 4, 1, 256), dtype=torch.int32), tmp_path / "short.pt")
    res = subprocess.run(
        base + ["--trace-file", str(tmp_path / "short.pt")], capture_output=True, text=True
    )
    assert res.returncode != 0 and "need >= 12 steps" in res.stderr


def test_guess_simulation_counts_what_the_next_layer_uses():
    """``sim_prefetch_guess.simulate``: with identical layers the previous layer's top-k is a
    perfect guess (every prefetched row used, only layer 0 loads on the critical path); with
    disjoint layers none of it is used; the two-layer guess keeps only what layers L-1 and L share.
    """
    import sim_prefetch_guess as sim

    steps, layers, k = 6, 3, 8
    gen = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(64, generator=gen)[:k] for _ in range(steps)]).int()
    same = rows[:, None, None, :].expand(steps, layers, 1, k)
    none = sim.simulate(same, slots=16, guess="none", warm=0)
    prev = sim.simulate(same, slots=16, guess="previous_layer", warm=0)
    assert none["prefetched_per_selected"] == 0 and none["critical_per_selected"] > 0
    assert prev["used_of_prefetched"] == 1.0
    assert prev["critical_per_selected"] == pytest.approx(none["critical_per_selected"] / layers)
    # Disjoint layers: layer l selects rows + 100 * l.
    apart = torch.stack([rows + 100 * layer for layer in range(layers)], dim=1)[:, :, None, :]
    prev = sim.simulate(apart, slots=16, guess="previous_layer", warm=0)
    both = sim.simulate(apart, slots=16, guess="two_layers", warm=0)
    assert prev["prefetched_per_selected"] > 0 and prev["used_of_prefetched"] == 0.0
    # Layer 1 shares nothing with layer 0, so only layer 0's (whole) top-k is prefetched, for layer
    # 1: half of what the previous-layer guess moves into layers 1 and 2 (the same LRU histories).
    assert both["prefetched_per_selected"] == pytest.approx(prev["prefetched_per_selected"] / 2)


def test_sim_prefetch_guess_runs_and_writes_its_results(tmp_path):
    import sim_prefetch_guess as sim

    out = tmp_path / "sim.json"
    report = sim.main(
        ["--batch", "1", "--ctx", "2048", "--topk", "128", "--slots", "256", "--layers", "3",
         "--steps", "6", "--warm", "2", "--share", "0.97", "--churn", "0.4", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["rows"]
    assert set(sim.GUESSES) <= set(row)
    assert row["previous_layer"]["critical_per_selected"] < row["none"]["critical_per_selected"]


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


def test_belady_bounds_the_lru_and_the_score_aware_policy():
    """``sim_hit_bound``: on a cycle of three positions through two slots the LRU never hits while
    Belady's MIN hits every other step; with slots for the whole context all three policies hit
    every return; on a realistic trace Belady is at least the others."""
    import sim_hit_bound as shb
    from bench_layer_budgets import lru_hits

    cycle = torch.tensor([0, 1, 2] * 4, dtype=torch.int32).view(12, 1, 1)
    assert int(lru_hits(cycle, torch.tensor([2]), 3, 0)[0]) == 0
    assert int(shb.belady_hits(cycle, 2, 3, 0)[0]) == 5  # hits at steps 3, 5, 7, 9 and 11
    cfg = traces.TraceConfig.for_topk(64, batch=1, context=512, layers=2, steps=8)
    trace, relevance = traces.generate(cfg, scores=True)
    flat, scored = trace.reshape(8, 2, 64), relevance.reshape(8, 2, -1)
    full = [
        int(lru_hits(flat, torch.tensor([512, 512]), 512, 0).sum()),
        int(shb.score_aware_hits(flat, scored, 512, 0).sum()),
        int(shb.belady_hits(flat, 512, 512, 0).sum()),
    ]
    assert full[0] == full[1] == full[2] > 0
    lru = int(lru_hits(flat, torch.tensor([96, 96]), 512, 2).sum())
    aware = int(shb.score_aware_hits(flat, scored, 96, 2).sum())
    bound = int(shb.belady_hits(flat, 96, 512, 2).sum())
    assert bound >= max(lru, aware) and bound > lru


def test_sim_hit_bound_runs_and_writes_its_results(tmp_path):
    import sim_hit_bound as shb

    out = tmp_path / "bound.json"
    report = shb.main(
        ["--batch", "1", "--ctx", "2048", "--topk", "128", "--slots", "256", "--budgets",
         "256,384", "--layers", "2", "--steps", "8", "--warm", "2", "--share", "0.97",
         "--churn", "0.4", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["rows"]
    assert row["belady"] >= row["lru"] and row["lru_curve"][256] == row["lru"]
