"""The serving benchmark's harness (benchmark/kv_offload/bench_serving_dsa.py) on the tiny CPU server.

Two real servers (no flag, ``--enable-kv-offload``), each driven by SGLang's own ``python -m
sglang.bench_serving`` client. Checks the harness, not speed: every request served, every field of
each point present, the decode log read, nothing left allocated on the flag-on server.
"""

import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH))

import bench_serving_dsa  # noqa: E402

CONCURRENCY = 2
PROMPTS = 3


def test_harness_serves_every_request_on_both_servers():
    out = Path(tempfile.mkdtemp(prefix="kvb-")) / "serving.json"  # short: ZMQ ipc paths
    report = bench_serving_dsa.main(
        [
            "--out", str(out), "--model", "tiny", "--servers", "off,offload",
            "--layers", "2", "--index-topk", "64", "--input-len", "1024", "--output-len", "6",
            "--concurrency", str(CONCURRENCY), "--prompts-per-concurrency", "1",
            "--min-prompts", str(PROMPTS), "--max-running", "4", "--max-total-tokens", "65536",
            "--offload-config", '{"sparse_slots_per_req": 128}', "--deadline-s", "800",
        ]
    )  # fmt: skip
    assert out.exists() and report["summary"].keys() == {"off", "offload"}
    assert report["kernels"]["kernels"] == "standins"
    assert "cpustub" in report["kernels"]["packages"]["flash_mla"]["version"]
    for server in report["servers"]:
        assert server["ok"], server.get("error") or server.get("log_tail")
        assert server["max_total_num_tokens"] > 0
        (point,) = server["points"]
        assert point["concurrency"] == CONCURRENCY and point["returncode"] == 0
        assert point["completed"] == PROMPTS, point
        assert point["total_output_tokens"] == PROMPTS * 6
        missing = [k for k in bench_serving_dsa.BENCH_KEYS if point.get(k) is None]
        assert not missing, missing
        assert point["output_throughput"] > 0 and point["median_tpot_ms"] > 0
        # The server's decode log was read: the client's concurrency shows in the batches.
        assert 1 <= point["peak_running"] <= CONCURRENCY and point["decode_log_lines"] > 0
        # The stand-ins' first-call trace was read: attention and indexer ran as stand-ins.
        assert {"flash_mla_sparse_fwd", "fp8_paged_mqa_logits"} <= set(server["standins_called"])
    offload = report["servers"][1]
    end = offload["kv_offload_end"]
    assert end["admitted"] == end["released"] == PROMPTS + 1  # the client's warm-up request too
    assert end["free"] == end["initial_free"], end
    assert "--enable-kv-offload" in offload["args"]
    assert "--enable-kv-offload" not in report["servers"][0]["args"]


def test_trace_summary_splits_offload_kernels(tmp_path):
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "_plan_layer_kernel", "ts": 0, "dur": 4},
            {"cat": "kernel", "name": "_copy_rows_kernel", "ts": 5, "dur": 6},
            {"cat": "kernel", "name": "gemm", "ts": 12, "dur": 30},
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        ]
    }
    path = tmp_path / "t.trace.json"
    path.write_text(bench_serving_dsa.json.dumps(trace))
    s = bench_serving_dsa.summarize_trace(str(path), steps=2)
    assert s["kernels"] == 3
    assert s["kernel_us_per_step"] == 20 and s["offload_us_per_step"] == 5
    assert s["span_us_per_step"] == 21
    assert s["top_kernels"][0][:2] == ["gemm", 1]
