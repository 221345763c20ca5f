"""The agent-session benchmark (benchmark/kv_offload/bench_agent.py) on the tiny CPU server.

Two real servers with the radix cache (no flag, ``--enable-kv-offload``), three sessions of three
turns in flight at once (a shared system prompt, tool results, think time), streamed through the
benchmark's own client, then a session that outgrows the context length. Checks the harness and the
cache accounting, not speed: every turn answered; each session's returning turns find its whole
history cached (the budget holds every session); the cached and prompt tokens the client summed
equal the server's ``/metrics`` counters; with the flag the host pool holds each cached page once
and no GPU row once the sessions end; the overflowing turn gets upstream's context-length error,
the earlier turns' pages stay cached and nothing else is held; after ``/flush_cache`` every free
count is back at its start.
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH))

import bench_agent  # noqa: E402

SESSIONS, TURNS, OUTPUT = 3, 3, 6


@pytest.fixture(scope="module")
def report():
    out = Path(tempfile.mkdtemp(prefix="kva-")) / "agent.json"  # short: ZMQ ipc paths
    return bench_agent.main(
        [
            "--out", str(out), "--model", "tiny", "--servers", "off,offload",
            "--layers", "2", "--index-topk", "64", "--sessions", str(SESSIONS),
            "--turns", str(TURNS), "--first-len", "320", "--system-len", "160",
            "--tool-len", "64", "--output-len", str(OUTPUT), "--think-s", "0.2",
            "--max-running", "4", "--max-total-tokens", "8192", "--chunked-prefill-size", "256",
            "--offload-config", json.dumps({"sparse_slots_per_req": 128}),
            "--overflow-session", "--deadline-s", "600",
        ]
    )  # fmt: skip


@pytest.mark.slow
def test_every_turn_answered_and_counted_on_both_servers(report):
    assert [s["kind"] for s in report["servers"]] == ["off", "offload"]
    for server in report["servers"]:
        assert server["ok"], server.get("error") or server.get("log_tail")
        (point,) = server["points"]
        assert point["turns_answered"] == point["turns_sent"] == SESSIONS * TURNS, point["errors"]
        assert point["output_tokens"] == SESSIONS * TURNS * OUTPUT
        for row in point["turns"]["rows"]:
            turn = dict(zip(point["turns"]["columns"], row))
            assert turn["prompt_tokens"] == turn["prompt_len"], turn
            assert turn["ttft_s"] is not None and turn["ttft_s"] <= turn["latency_s"], turn
        # The budget holds every session: each returning turn reuses its whole history.
        back = point["returning"]
        assert back["turns"] == back["full_hits"] == SESSIONS * (TURNS - 1), back
        assert point["sessions_held"] == SESSIONS
        assert point["counters"]["equal"], point["counters"]
        prefill = point["prefill"]
        assert prefill["computed_tokens"] + prefill["cached_tokens"] == prefill["prompt_tokens"]
        assert point["ttft_ms"]["by_turn"][0]["n"] == SESSIONS
        assert point["peak_running"] >= 1 and point["decode_log_lines"] > 0
    summary = report["summary"][str(SESSIONS)]
    assert summary.keys() >= {"off", "offload", "returning_cached_ratio"}


@pytest.mark.slow
def test_flag_on_host_pool_holds_each_cached_page_once(report):
    offload = report["servers"][1]
    assert "--enable-kv-offload" in offload["args"] and "--tiny-radix-cache" in offload["args"]
    (point,) = offload["points"]
    state = point["kv_offload"]
    tree = point["page_tokens"]
    assert state["used"] == {"host": tree, "logical": tree, "physical": 0}, (state, tree)
    assert state["admitted"] == state["released"] == SESSIONS * TURNS
    assert state["shared_prefix_tokens"] > 0 and state["loaded"] > 0, state


@pytest.mark.slow
def test_overflowing_session_gets_upstreams_error_and_its_pages_come_back(report):
    for server in report["servers"]:
        over = server["overflow"]
        assert over["turns_answered"] >= 1 and over["upstream_error"], over
        assert over["refused_prompt_len"] >= over["context_length"] - OUTPUT, over
    over = report["servers"][1]["overflow"]
    # Only the answered turns' pages are held (the refused turn took nothing) ...
    tree = over["page_tokens"]
    assert over["used"] == {"host": tree, "logical": tree, "physical": 0}, over
    # ... and the flush gives them back.
    end = report["servers"][1]["after_flush"]
    assert report["servers"][1]["leak_problems"] == [], end
    assert end["free"] == end["initial_free"] and end["error_flags"] == 0, end


# ---------------------------------------------------------------------- the client's arithmetic
def turn(session: int, k: int, prompt: list, out: list, hist: int, cached: int) -> bench_agent.Turn:
    t = bench_agent.Turn(session, k, len(prompt), hist, sent_s=0.0, ttft_s=0.1 * (k + 1))
    t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.output_ids = (
        len(prompt),
        cached,
        len(out),
        out,
    )
    return t


def test_summary_counts_full_hits_held_sessions_and_distinct_pages():
    w = bench_agent.Workload(turns=2, first_len=150, system_len=70, tool_len=20, output_len=10)
    a0, b0 = w.first_prompt(0), w.first_prompt(1)
    assert a0[:70] == b0[:70] and a0[70:] != b0[70:]  # the shared system prompt
    out = list(range(2, 12))
    a1 = a0 + out + w.tool_result(0, 1)
    b1 = b0 + out + w.tool_result(1, 1)
    hist = bench_agent.history_len(a0, out)
    assert hist == 128  # 150 + 10 - 1 tokens: two whole pages
    run = bench_agent.SessionsRun(
        turns=[
            turn(0, 0, a0, out, 0, 0),
            turn(1, 0, b0, out, 0, 64),
            turn(0, 1, a1, out, hist, hist),  # a full hit
            turn(1, 1, b1, out, hist, 64),  # evicted down to the system prompt's page
        ],
        prompts={(0, 0): a0, (1, 0): b0, (0, 1): a1, (1, 1): b1},
        wall_s=2.0,
    )
    s = bench_agent.summarize(run, turns=2)
    assert s["returning"] == {
        "turns": 2,
        "cached_mean": 96.0,
        "history_mean": 128.0,
        "full_hits": 1,
    }
    assert s["sessions_held"] == 1 and s["output_tokens_per_s"] == 20.0
    assert s["prefill"]["cached_tokens"] == hist + 128
    assert s["ttft_ms"]["by_turn"] == [
        {"n": 2, "p50": 100.0, "p99": 100.0},
        {"n": 2, "p50": 200.0, "p99": 200.0},
    ]
    # Turn 0 holds 159 tokens per session: the system prompt's page (shared) and one page of each
    # session's own; turn 1's 189 tokens span the same two whole pages.
    assert s["page_tokens"] == 3 * 64


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert bench_agent.percentile(values, 0.5) == 50
    assert bench_agent.percentile(values, 0.99) == 99
    assert bench_agent.percentile([7.0], 0.99) == 7.0 and bench_agent.percentile([], 0.5) is None


def test_merge_joins_one_server_runs_of_one_workload(tmp_path):
    def one(kind: str, cached: float) -> dict:
        point = {
            "sessions": 2,
            "ttft_ms": {"returning": {"p50": 1.0, "p99": 2.0}, "first_turns": {"p50": 3.0}},
            "output_tokens_per_s": 1.0,
            "prefill": {"computed_tokens": 10, "cached_tokens": 5},
            "returning": {"cached_mean": cached, "history_mean": 128.0},
            "sessions_held": 1,
            "final_history_mean": 100.0,
            "peak_running": 2,
        }
        server = {"kind": kind, "max_total_num_tokens": 400, "points": [point]}
        return {"command": kind, "workload": {"turns": 2}, "servers": [server]}

    paths = []
    for kind, cached in (("off", 32.0), ("offload", 128.0)):
        paths.append(str(tmp_path / f"{kind}.json"))
        Path(paths[-1]).write_text(json.dumps(one(kind, cached)))
    merged = bench_agent.merge(paths, tmp_path / "all.json")
    assert [s["kind"] for s in merged["servers"]] == ["off", "offload"]
    assert merged["summary"]["2"]["returning_cached_ratio"] == 4.0
    assert merged["summary"]["2"]["off"]["capacity_sessions"] == 4.0
    assert json.loads((tmp_path / "all.json").read_text()) == merged
    other = one("hisparse", 0.0)
    other["workload"] = {"turns": 3}
    Path(tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different workloads"):
        bench_agent.merge(paths + [str(tmp_path / "other.json")], tmp_path / "bad.json")
