"""The swap-in benchmark's own bookkeeping on CPU (interpreter): no timing is asserted.

bench_lru.py reads each step's rows from a different host region (one per layer) and checks the
rows that the plan + load put on the device against the host rows of that step's region. Points
with different footprints share one host buffer; this runs several such points and asserts that
every kernel result was checked and correct.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmark" / "kv_offload" / "bench_lru.py"


@pytest.mark.parametrize("host_layers", ["3", "0"])
def test_multi_region_points_are_checked_and_correct(tmp_path, host_layers):
    out = tmp_path / "bench.json"
    # "3": two row sizes (the second pins its own buffer after the first is released)
    rows, ctx = ("656,1152", "256") if host_layers == "3" else ("656", "256,512")
    cmd = [
        sys.executable,
        str(BENCH),
        "--device", "cpu",
        "--bs", "1,2",
        "--ctx", ctx,
        "--churn", "0.1",
        "--rows", rows,
        "--topk", "64",
        "--buffer", "128",
        "--steps", "4",
        "--warm", "2",
        "--host-layers", host_layers,
        "--pool-layers", "4",
        "--max-host-gb", str(2 * 512 * 656 * 3.5 / 1e9),  # "0": 3 layers at bs 2 / 512, 4 below
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4
    layers = {(r["bs"], r["ctx"]): r["host_layers"] for r in results}  # per row size
    if host_layers == "3":
        assert set(layers.values()) == {3}
        assert sorted(r["row_bytes"] for r in results) == [656, 656, 1152, 1152]
    else:  # the largest point gets 3 layers within the cap, the others the 4-layer pool
        assert layers == {(2, 512): 3, (2, 256): 4, (1, 512): 4, (1, 256): 4}
    for r in results:
        assert r["correct_ours"] and r["correct_ours_rowpacked"], r
        assert r["err_flags"] == 0 and r["misses_ours"] > 0
