"""benchmark/kv_offload/kernel_timeline.py splits a step's kernel trace per layer as documented."""

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
from kernel_timeline import kernels_from_trace, layer_breakdown  # noqa: E402

FW, PLAN, LOAD = 7, 9, 11  # streams


def _event(name, stream, ts, dur, cat="kernel"):
    return dict(cat=cat, name=name, ts=ts, dur=dur, args=dict(stream=stream))


def _step(layers=3):
    """Per layer on the forward stream: plan 10, copy 40 (waits 5 after the plan), a 5 us wait,
    read 5, gemm 100. The prefetch: its plan (8 us) on PLAN right after the layer's copy, its copy
    (60 us) on LOAD after that; the next layer's copy starts while it still runs."""
    events, t = [], 0.0
    for _ in range(layers):
        events.append(_event("_plan_layer_kernel", FW, t, 10))
        events.append(_event("_copy_rows_kernel", FW, t + 15, 40))
        events.append(_event("indexSelect", FW, t + 60, 5))
        events.append(_event("gemm", FW, t + 65, 100))
        events.append(_event("_plan_layer_kernel", PLAN, t + 56, 8))
        events.append(_event("_copy_rows_kernel", LOAD, t + 64, 130))
        events.append(_event("cudaLaunchKernel", FW, t, 1, cat="cuda_runtime"))
        t += 165
    return events


def test_breakdown_of_a_synthetic_step():
    kernels = kernels_from_trace(_step())
    assert [k.start for k in kernels] == sorted(k.start for k in kernels)
    assert all(k.name != "cudaLaunchKernel" for k in kernels)
    out = layer_breakdown(
        kernels, compute_names={"indexSelect", "gemm"}, read_name="indexSelect", copy_tag="copy"
    )
    assert out["boundaries"] == 2
    # Compute of a layer: read start -> gemm end = 105 us; then plan, copy and waits: 60 us.
    assert out["compute_ms"] == pytest.approx(0.105)
    assert out["gap_ms"] == pytest.approx(0.060)
    assert out["forward_kernels_ms"] == {
        "_copy_rows_kernel": pytest.approx(0.040),
        "_plan_layer_kernel": pytest.approx(0.010),
    }
    assert out["forward_idle_ms"] == pytest.approx(0.010)
    # Side kernels started in the layer: the prefetch's plan and copy.
    assert out["side_kernels_ms"] == {
        "_copy_rows_kernel": pytest.approx(0.130),
        "_plan_layer_kernel": pytest.approx(0.008),
    }
    # The gap of the second layer is [165, 225). The previous prefetch copy runs until
    # 64 + 130 = 194 (29 us of it) and this layer's prefetch plan starts at 221 (4 us); the
    # layer's own copy starts at 180, so the two copies share 14 us.
    assert out["side_busy_in_gap_ms"] == pytest.approx(0.033)
    assert out["copies_together_ms"] == pytest.approx(0.014)


def test_breakdown_needs_two_layers():
    kernels = kernels_from_trace(_step(layers=1))
    out = layer_breakdown(kernels, {"indexSelect", "gemm"}, "indexSelect", "copy")
    assert "error" in out and "no layer boundary" in out["error"]
