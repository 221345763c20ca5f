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

pytestmark = pytest.mark.slow
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


def test_flag_on_host_pool_holds_each_cached_page_once(report):
    offload = report["servers"][1]
    assert "--enable-kv-offload" in offload["args"] and "--tiny-radix-cache" in offload["args"]
    (point,) = offload["points"]
    state = point["kv_offload"]
    tree = point["page_tokens"]
    assert state["used"] == {"host": tree, "logical": tree, "physical": 0}, (state, tree)
    assert state["admitted"] == state["released"] == SESSIONS * TURNS
    assert state["shared_prefix_tokens"] > 0 and state["loaded"] > 0, state


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
