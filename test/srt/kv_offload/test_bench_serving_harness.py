"""The serving benchmark's harness (benchmark/kv_offload/bench_serving_dsa.py) on the tiny CPU server.

Two real servers (no flag, ``--enable-kv-offload``), each driven by SGLang's own ``python -m
sglang.bench_serving`` client. Checks the harness and the flag's capacity, counts not speed: every
request served, every field of each point present, the decode log read, nothing left allocated on
the flag-on server, and (``bench_capacity.py serve``) the flag-on server running at least the
flag-off server's batch at a short-prompt point (every request kept on the GPU) and at least 90 %
of what its arena fits at a decode-dominated long-prompt point.
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
KV_ROW = 1152  # the tiny server's bf16 latent row (bench_serving_dsa.py runs it in bf16)
LAYERS = 2  # the tiny model's layers here (bench_capacity.py serve --layers): prefill is the time
BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH))

import bench_capacity  # noqa: E402
import bench_serving_dsa  # noqa: E402
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (  # noqa: E402
    LOGICAL_LOC_STATE_BYTES,
    size_arena,
)


def _capacity_point(prompt_len, **over):
    """One ``bench_capacity.py serve`` point: both servers started, every request served."""
    args = bench_capacity.argparse.Namespace(
        output_len=32,
        range_ratio=1.0,
        concurrency=32,
        prompts=64,
        max_running=48,
        max_total_tokens=8192,
        chunked_prefill_size=2048,
        slots=128,
        topk=64,
        layers=LAYERS,
        point_deadline_s=1200,
        offload_config={},
        pd=False,
        fast_standins=False,
    )
    vars(args).update(over)
    out = Path(tempfile.mkdtemp(prefix="kvc-"))  # short: ZMQ ipc paths
    row = bench_capacity.serve_point(args, prompt_len, out)
    report = json.loads((out / f"{prompt_len}.json").read_text())
    for kind in ("off", "offload"):
        assert row[kind]["started"] and not row[kind]["error"], row
        assert row[kind]["completed"] == args.prompts, row
    assert row["offload"]["leak_free"], row
    return args, row, report


def test_short_prompts_stay_on_the_gpu_and_run_the_flag_off_batch():
    """#47's first finding: short prompts (128 tokens and 16 new, within the 128 sparse slots and
    two tail pages) at concurrency 32, --max-running-requests 48, the same 8192-token GPU budget.
    The flag-on server refused to start (a static GPU split sized for 48 requests); now it starts,
    keeps every request on the GPU whole (nothing loaded from the host) and runs the flag-off
    server's whole batch. Also checks the harness: every field of each point, the decode log and
    the stand-ins' trace read."""
    args, row, report = _capacity_point(128, output_len=16, prompts=32)
    off, on = row["off"], row["offload"]
    print(f"\n[capacity] 128-token prompts: peak running {on['peak_running']} with the flag, "
          f"{off['peak_running']} without; resident {on['resident_requests']}, "
          f"loaded rows {on['loaded_rows']}")  # fmt: skip
    assert on["peak_running"] >= off["peak_running"] >= 16, row
    assert on["resident_requests"] == args.prompts + 1 and on["loaded_rows"] == 0, row
    assert report["summary"].keys() == {"off", "offload"}
    assert report["kernels"]["kernels"] == "standins"
    assert "cpustub" in report["kernels"]["packages"]["flash_mla"]["version"]
    for server in report["servers"]:
        assert server["ok"], server.get("error") or server.get("log_tail")
        (point,) = server["points"]
        assert point["concurrency"] == args.concurrency and point["returncode"] == 0
        assert point["total_output_tokens"] == args.prompts * args.output_len
        missing = [k for k in bench_serving_dsa.BENCH_KEYS if point.get(k) is None]
        assert not missing, missing
        assert point["output_throughput"] > 0 and point["median_tpot_ms"] > 0
        assert 1 <= point["peak_running"] <= args.concurrency and point["decode_log_lines"] > 0
        by_running = point["step_ms_by_running"]  # JSON: the batch sizes are strings
        assert max(int(k) for k in by_running) == point["peak_running"], by_running
        assert all(v["median_ms"] > 0 for v in by_running.values()), by_running
        assert {"flash_mla_sparse_fwd", "fp8_paged_mqa_logits"} <= set(server["standins_called"])
    end = report["servers"][1]["kv_offload_end"]
    assert end["admitted"] == end["released"] == args.prompts + 1  # the client's warm-up too
    assert "--enable-kv-offload" in report["servers"][1]["args"]
    assert "--enable-kv-offload" not in report["servers"][0]["args"]


def test_long_prompts_run_what_their_tokens_fit():
    """512-token prompts and 160 new tokens (sparse: longer than 128 slots and two tail pages), a
    2048-token GPU budget (2 such requests without the flag), all sent at once: decode dominates,
    and the flag-on server runs at least 90 % of what its arena fits (the product's sizing code:
    each holds 128 sparse slots, two tail pages and its index keys; in a burst each staged
    prompt's own rows pay for its slots), never more. Without the prefill gate's retry when rows
    free up, it ran 2 at once (upstream retried only when a request finished); while the retry
    compared with the room before the round's own prompts took their rows, 4 of 5."""
    new_tokens = 160
    args, row, _ = _capacity_point(
        512, output_len=new_tokens, max_total_tokens=2048, max_running=8, prompts=6, concurrency=6
    )
    off, on = row["off"], row["offload"]
    budget = args.max_total_tokens * (KV_ROW + 132) * LAYERS
    sizing = size_arena(budget, LAYERS, KV_ROW, 132, 64, logical_loc_bytes=LOGICAL_LOC_STATE_BYTES)
    fits = bench_capacity.sizing_point(
        sizing, args.max_total_tokens, 512 + new_tokens, args.slots, 2
    )
    print(f"\n[capacity] 512+{new_tokens} tokens: peak running {on['peak_running']} with the flag "
          f"(its arena fits {fits['flag_on_requests']}), {off['peak_running']} without")  # fmt: skip
    assert fits["flag_on_requests"] >= 2 * fits["flag_off_requests"] == 4, fits
    assert off["peak_running"] <= on["peak_running"], row
    assert 0.9 * fits["flag_on_requests"] <= on["peak_running"] <= fits["flag_on_requests"], row
    assert on["loaded_rows"] > 0 and on["resident_requests"] == 0, row  # all sparse


def test_trace_summary_splits_offload_kernels(tmp_path):
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "_plan_layer_kernel", "ts": 0, "dur": 4},
            {"cat": "kernel", "name": "_copy_rows_kernel", "ts": 5, "dur": 6},
            {"cat": "kernel", "name": "gemm", "ts": 12, "dur": 30},
            {"cat": "kernel", "name": "_copy_rows_kernel", "ts": 20, "dur": 2},  # another stream
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        ]
    }
    path = tmp_path / "t.trace.json"
    path.write_text(bench_serving_dsa.json.dumps(trace))
    s = bench_serving_dsa.summarize_trace(str(path), steps=2)
    assert s["kernels"] == 4
    assert s["kernel_us_per_step"] == 21 and s["offload_us_per_step"] == 6
    assert s["busy_us_per_step"] == 20 and s["span_us_per_step"] == 21  # 1 us idle at ts 4
    assert s["top_kernels"][0][:2] == ["gemm", 1]


def test_profile_starts_at_each_servers_batch(tmp_path, monkeypatch):
    """The profile starts once the decode batch has held the server's own ``--profile-batch``
    entry (never above the concurrency) for longer than the client's warm-up request decodes
    (a profile started by the warm-up caught the first prompt's prefill), asking for
    ``--profile-steps`` steps."""
    a = bench_serving_dsa.argparse.Namespace(
        profile_batch="off=6,offload=16", profile_steps=8, on_gpu=False
    )
    assert bench_serving_dsa.profile_batch(a, "off", 32) == 6
    assert bench_serving_dsa.profile_batch(a, "offload", 8) == 8
    assert bench_serving_dsa.profile_batch(a, "hisparse", 32) == 32
    a.profile_batch = "4,off=2"
    assert [bench_serving_dsa.profile_batch(a, k, 16) for k in ("off", "hisparse")] == [2, 4]

    line = (
        "Decode batch, #running-req: {}, #token: 1, token usage: 0.01, cuda graph: True, "
        "gen throughput (token/s): 100.0, #queue-req: 0\n"
    )
    log = ["before " + line.format(9)]  # before ``since``: not counted
    server = bench_serving_dsa.argparse.Namespace(url="http://x", log_text=lambda: "".join(log))
    posted = []
    monkeypatch.setattr(
        bench_serving_dsa, "http", lambda method, url, body, timeout: posted.append(body) or "ok"
    )
    stop = bench_serving_dsa.threading.Event()
    started = bench_serving_dsa.profile_when_batch(server, len(log[0]), 6, tmp_path, a, stop)
    log.append(line.format(5))
    log.append(line.format(6) * bench_serving_dsa.WARMUP_DECODE_TOKENS)  # the warm-up's length
    log.append(line.format(5))
    bench_serving_dsa.time.sleep(1.2)
    assert posted == [] and started == {}
    log.append(line.format(6) * bench_serving_dsa.WARMUP_DECODE_TOKENS)
    last = line.format(7)
    log.append(last[:20])  # a line the server is still writing is read once it is whole
    bench_serving_dsa.time.sleep(1.2)
    assert posted == [] and started == {}
    log.append(last[20:])
    for _ in range(40):
        if started:
            break
        bench_serving_dsa.time.sleep(0.25)
    stop.set()
    assert started == {"running": 7, "answer": "ok"}
    assert posted[0]["num_steps"] == 8 and posted[0]["output_dir"] == str(tmp_path)
    assert posted[0]["activities"] == ["CPU"]  # a CPU server records no GPU activity


def test_a_profiled_point_reports_the_unprofiled_runs_latencies(tmp_path, monkeypatch):
    """The trace's export pauses the server (about a second: the c=1 points of the 2026-12-07
    H100 run carried it in their TPOT), so ``--profile-concurrency`` runs the point's workload a
    second time for the trace: the point's figures are the first run's, taken with no profile
    watching; the second run's client output is kept apart; a trace that never started is an
    error of the profile, not of the point."""
    log, watching, runs = [], [], []
    server = bench_serving_dsa.argparse.Namespace(
        port=1,
        url="http://x",
        cmd=["python", "--model-path", "m"],
        log_text=lambda: "".join(log),
        stop=lambda: None,
        wait_settled=lambda settle_s, strict: {"requests": 0},
    )
    launched = lambda kind, a, out: (server, {"kind": kind, "ok": False})  # noqa: E731
    monkeypatch.setattr(bench_serving_dsa, "launch", launched)
    monkeypatch.setattr(bench_serving_dsa, "wait_started", lambda server, res, a: None)
    trace_starts = [{"running": 1, "answer": "ok"}]

    def watch(server, since, batch, prof_dir, a, stop):
        watching.append(stop)
        return trace_starts[0]

    def client(cmd, out_file, log_file, timeout):
        runs.append((out_file.name, bool(watching) and not watching[-1].is_set()))
        if out_file.name.endswith("_profile.jsonl") and trace_starts[0]:
            (tmp_path / "profile_offload").mkdir(exist_ok=True)
            (tmp_path / "profile_offload" / "1-TP-0.trace.json").write_text("{}")
            log.append("Profiling done. Traces are saved\n")
        tpot = 6.0 if out_file.name.endswith("_profile.jsonl") else 4.6
        return {"completed": 2, "median_tpot_ms": tpot}

    monkeypatch.setattr(bench_serving_dsa, "profile_when_batch", watch)
    monkeypatch.setattr(bench_serving_dsa, "run_client", client)
    monkeypatch.setattr(
        bench_serving_dsa, "summarize_trace", lambda path, steps: {"trace": Path(path).name}
    )
    a = bench_serving_dsa.argparse.Namespace(
        concurrency=[1, 4], profile_concurrency=1, profile_batch="", profile_steps=8,
        point_reserve_s=30, min_prompts=2, prompts_per_concurrency=1, input_len=64, output_len=8,
        random_range_ratio=1.0, seed=1,
    )  # fmt: skip
    end = lambda: bench_serving_dsa.time.time() + 600  # noqa: E731
    res = bench_serving_dsa.run_server("offload", a, tmp_path, end)
    assert runs == [
        ("bench_offload_c1.jsonl", False),
        ("bench_offload_c1_profile.jsonl", True),
        ("bench_offload_c4.jsonl", False),
    ]
    c1, c4 = res["points"]
    assert c1["median_tpot_ms"] == 4.6 and c4["median_tpot_ms"] == 4.6 and "profile" not in c4
    assert c1["profile"] == {
        "batch": 1,
        "started": {"running": 1, "answer": "ok"},
        "trace": "1-TP-0.trace.json",
    }
    assert res["ok"]

    trace_starts[0], runs[:] = {}, []
    res = bench_serving_dsa.run_server("offload", a, tmp_path, end)
    assert res["points"][0]["profile"]["error"] == "no trace written"
    assert res["points"][0]["median_tpot_ms"] == 4.6 and res["ok"]


def test_each_server_shares_the_time_left_after_it_started(tmp_path, monkeypatch):
    """A server that is slow to start (the first on a fresh GPU machine compiles the JIT kernels
    while capturing its first graph) does not lose its points to its start, nor the later servers
    theirs: each one's share of the deadline is counted from when it is ready."""
    clock = [1000.0]
    monkeypatch.setattr(bench_serving_dsa.time, "time", lambda: clock[0])
    a = bench_serving_dsa.argparse.Namespace(deadline_s=300, servers="off,offload,hisparse")
    shares = []

    def run_one(kind, points_end):
        clock[0] += 120 if kind == "off" else 10  # start-up
        shares.append(points_end() - clock[0])
        clock[0] += shares[-1]  # its points use all of its share
        return {"kind": kind}

    report = {}
    bench_serving_dsa.run_servers(a, report, tmp_path / "r.json", run_one)
    assert shares == [60, 55, 45]
    assert [s["kind"] for s in report["servers"]] == ["off", "offload", "hisparse"]
    assert json.loads((tmp_path / "r.json").read_text())["servers"] == report["servers"]


def test_pd_puts_the_offload_flags_on_the_decode_server_only(tmp_path, monkeypatch):
    """``--pd``: both servers get the common flags, the decode server also the kind's; the client
    talks to the load balancer, the report reads the decode server. HiSparse is refused."""
    parser = bench_serving_dsa.argparse.ArgumentParser()
    bench_serving_dsa.add_server_options(parser, layers=2, max_running=8)
    a = parser.parse_args(
        ["--model", "tiny", "--pd", "--offload-config", '{"pd_direct_to_host": 1}']
    )
    a.context_length = 1024
    made = []

    class FakePair:
        def __init__(self, args, decode_extra, log_dir, decode_env):
            made.append((args, decode_extra))
            self.lb = bench_serving_dsa.argparse.Namespace(port=4321)
            self.decode = bench_serving_dsa.argparse.Namespace(url="http://d", cmd=["decode"])

    monkeypatch.setattr(bench_serving_dsa, "PDPair", FakePair)
    server, res = bench_serving_dsa.launch("offload", a, tmp_path)
    (common, decode_extra), off_args = made[0], bench_serving_dsa.server_args("off", a)
    assert common == off_args and "--enable-kv-offload" not in common
    assert decode_extra == [
        "--enable-kv-offload",
        "--kv-offload-config",
        '{"pd_direct_to_host": 1}',
    ]
    assert (server.port, server.url) == (4321, "http://d") and res["kind"] == "offload"
    with pytest.raises(ValueError, match="off and offload"):
        bench_serving_dsa.launch("hisparse", a, tmp_path)


def test_a_client_stopped_after_its_result_keeps_it(tmp_path):
    """A ``bench_serving`` client that wrote its result line but had not exited when its time ran
    out (the flag-off server's point of the 32K H100 run) keeps its figures, marked ``timed_out``;
    one stopped before writing it or while writing it, or one that failed, is an error."""
    out, log = tmp_path / "out.jsonl", tmp_path / "client.log"
    row = {"completed": 28, "output_throughput": 1076.1, "median_tpot_ms": 5.34}
    write = f"open({str(out)!r}, 'w').write({json.dumps(json.dumps(row))} + '\\n')"
    slow = [sys.executable, "-c", f"import time; print('sent'); {write}; time.sleep(30)"]
    point = bench_serving_dsa.run_client(slow, out, log, timeout=3)
    assert point["timed_out"] and point["returncode"] is None and "error" not in point
    assert point["completed"] == 28 and point["output_throughput"] == 1076.1
    assert point["wall_s"] < 20 and "stopped after 3 s" in log.read_text()

    half = f"open({str(out)!r}, 'w').write({json.dumps(json.dumps(row)[:20])})"
    cut = [sys.executable, "-c", f"import time; {half}; time.sleep(30)"]
    point = bench_serving_dsa.run_client(cut, out, log, timeout=3)
    assert "error" in point and "completed" not in point  # stopped while writing its line

    out.unlink()
    stuck = [sys.executable, "-c", "import time; time.sleep(30)"]
    point = bench_serving_dsa.run_client(stuck, out, log, timeout=2)
    assert "error" in point and "completed" not in point

    failed = [sys.executable, "-c", f"{write}; raise SystemExit(3)"]
    point = bench_serving_dsa.run_client(failed, out, log, timeout=20)
    assert point["returncode"] == 3 and "error" in point and "completed" not in point

    done = [sys.executable, "-c", write]
    point = bench_serving_dsa.run_client(done, out, log, timeout=20)
    assert point["returncode"] == 0 and "timed_out" not in point and point["completed"] == 28
