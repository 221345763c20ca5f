"""benchmark/kv_offload/kernel_timeline.py splits a step's kernel trace per layer as documented."""

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
from kernel_timeline import kernels_from_trace, layer_breakdown, short_name  # noqa: E402

FW, PLAN, LOAD = 7, 9, 11  # streams


def _event(name, stream, ts, dur, cat="kernel"):
    return dict(
        cat=cat,
        name=name,
        ts=ts,
        dur=dur,
        args={
            "stream": stream,
            "grid": [len(name), 1, 1],
            "block": [128, 1, 1],
            "registers per thread": len(name) + 1,
            "shared memory": 2 * len(name),
        },
    )


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
    assert all(k.grid == (len(k.name), 1, 1) for k in kernels)
    assert all(k.block == (128, 1, 1) for k in kernels)
    assert all(
        (k.registers, k.shared_memory) == (len(k.name) + 1, 2 * len(k.name)) for k in kernels
    )
    out = layer_breakdown(
        kernels, compute_names={"indexSelect", "gemm"}, read_name="indexSelect", copy_tag="copy"
    )
    assert out["boundaries"] == 2
    # Compute of a layer: read start -> gemm end = 105 us; then plan, copy and waits: 60 us.
    assert out["compute_ms"] == pytest.approx(0.105)
    assert out["gap_ms"] == pytest.approx(0.060)
    # The second layer's gap is [165, 225): its plan (10 us) and the next prefetch's plan from 221
    # (4 us); its copy (180-220) and the previous prefetch's copy until 64 + 130 = 194: 55 us of
    # copying, 14 us of it two copies at once; nothing runs from 220 to 221.
    assert out["offload_in_gap_ms"] == {
        "_copy_rows_kernel": pytest.approx(0.055),
        "_plan_layer_kernel": pytest.approx(0.014),
    }
    assert out["idle_in_gap_ms"] == pytest.approx(0.001)
    assert out["copies_together_in_gap_ms"] == pytest.approx(0.014)
    # Under the compute [60, 165): the prefetch's plan until 64 and its copy from 64.
    assert out["offload_under_compute_ms"] == {
        "_copy_rows_kernel": pytest.approx(0.101),
        "_plan_layer_kernel": pytest.approx(0.004),
    }
    assert "steady_exposed_ms" not in out
    # Against a compute alone of 90 us: each boundary adds 60 us of gap and 15 us of slowdown.
    alone = layer_breakdown(
        kernels, {"indexSelect", "gemm"}, "indexSelect", "copy", compute_alone_ms=0.090
    )
    assert alone["steady_exposed_ms"] == pytest.approx(0.075)


def test_kernel_names_lose_return_type_and_arguments():
    assert short_name("void ns::k<4, F<int> >(int, F<int>)") == "ns::k<4, F<int> >"
    assert short_name("nvjet_sm90_tst_512x32") == "nvjet_sm90_tst_512x32"
    assert len(short_name("x" * 100)) == 60


def test_breakdown_needs_two_layers():
    kernels = kernels_from_trace(_step(layers=1))
    out = layer_breakdown(kernels, {"indexSelect", "gemm"}, "indexSelect", "copy")
    assert "error" in out and "no layer boundary" in out["error"]
