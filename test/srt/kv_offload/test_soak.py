"""The soak driver (benchmark/kv_offload/soak.py): a bounded, seeded run, and its checks' teeth.

``test_soak_bounded_run`` (slow) runs the driver against the real server and the PD pair, every
fault included, and asserts that every check passed. The fast tests feed the checking functions
what a broken server would produce, so the soak cannot pass by checking nothing.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH))
import soak  # noqa: E402

# Seeded, bounded: each mode runs one window per fault (a mode runs at least that many, and no
# more with no time asked): the server restarts once, the pair meets every PD fault once.
DURATION_S = 0
WINDOW_S = 20

IDLE = {
    "free": {"logical": 13568, "physical": 2048, "host": 13568},
    "initial_free": {"logical": 13568, "physical": 2048, "host": 13568},
    "requests": 0,
    "promised": 0,
    "backups_in_flight": 0,
    "host_pending_free": 0,
    "error_flags": 0,
    "loaded": 1000,
    "loaded_bytes": 1000 * soak.ROW_BYTES,
    "host_pool": {"tokens": 64, "bytes": 64 * soak.ROW_BYTES * 2},
}
LABELS = '{model_name="m",tp_rank="0"}'
PROMETHEUS = (
    f"sglang:kv_offload_rows_loaded_total{LABELS} 1000.0\n"
    f"sglang:kv_offload_bytes_loaded_total{LABELS} {1000.0 * soak.ROW_BYTES}\n"
)


@pytest.mark.slow
def test_soak_bounded_run(tmp_path):
    out = tmp_path / "soak.json"
    start = time.time()
    report = soak.main(
        [
            "--duration-s", str(DURATION_S), "--seed", "42", "--mode", "both",
            "--window-s", str(WINDOW_S), "--out", str(out),
        ]
    )  # fmt: skip
    print(f"\n[soak] {time.time() - start:.0f} s: {json.dumps(report['modes'])[:4000]}")
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for mode, result in report["modes"].items():
        failed = {k: c["failures"] for k, c in result["checks"].items() if c["failed"]}
        assert not failed, f"{mode}: {failed}"
        assert sum(result["served"].values()) > 0 and result["retractions"] > 0, result
        assert result["checks"]["probe_tokens"]["passed"] >= 2, result["checks"]
        assert result["checks"]["probe_retracted"]["passed"] >= 2, result["checks"]
    assert set(report["modes"]["server"]["faults"]) == {"restart"}
    assert set(report["modes"]["pd"]["faults"]) == set(soak.PDTarget.faults)
    assert report["ok"]


def test_the_retraction_probe_fails_unless_both_complete_and_one_was_retracted():
    n = soak.RETRACT_PROBE_TOKENS

    def answer(tokens: int, retractions: int) -> dict:
        return {"output_ids": [5] * tokens, "meta_info": {"num_retractions": retractions}}

    assert soak.retraction_probe(200, [answer(n, 1), answer(n, 0)]) == (1, [])
    retracted, (problem,) = soak.retraction_probe(200, [answer(n, 0), answer(n, 0)])
    assert retracted == 0 and "never retracted" in problem
    (problem,) = soak.retraction_probe(200, [answer(n, 2), answer(n - 1, 0)])[1]
    assert f"[{n}, {n - 1}] tokens" in problem
    (problem,) = soak.retraction_probe(503, {"error": "busy"})[1]
    assert "HTTP 503" in problem
    (problem,) = soak.retraction_probe(200, [answer(n, 1)])[1]
    assert "HTTP 200" in problem


def test_an_idle_server_passes_and_each_leak_fails():
    assert soak.idle_problems(IDLE) == []
    for key, value in (("logical", 13504), ("physical", 1984), ("host", 13504)):
        leaked = copy.deepcopy(IDLE)
        leaked["free"][key] = value
        (problem,) = soak.idle_problems(leaked)
        assert "not back at start" in problem
    for key in ("requests", "promised", "backups_in_flight", "host_pending_free", "error_flags"):
        (problem,) = soak.idle_problems({**IDLE, key: 1})
        assert problem.startswith(key)


def test_metrics_that_do_not_add_up_fail():
    assert soak.metrics_problems(IDLE, PROMETHEUS) == []
    assert soak.metrics_problems({**IDLE, "loaded_bytes": 999 * soak.ROW_BYTES}, PROMETHEUS)
    stale = PROMETHEUS.replace(" 1000.0\n", " 990.0\n")
    assert soak.metrics_problems(IDLE, stale) and soak.metrics_problems(IDLE, "")
    host = {**IDLE, "host_pool": {"tokens": 64, "bytes": 64 * soak.ROW_BYTES}}
    assert soak.metrics_problems(host, PROMETHEUS)


def test_a_changed_probe_fails():
    assert soak.probe_problems([5, 6, 7], [5, 6, 7]) == []
    assert soak.probe_problems([5, 6, 7], [5, 6, 8]) and soak.probe_problems([5, 6, 7], [5, 6])


def test_responses_that_break_the_contract_fail():
    ok = {"output_ids": [1] * 4, "meta_info": {"finish_reason": {"type": "length"}}}
    aborted = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"}}}
    error = {"error": {"message": "Input is too long"}}
    check = soak.response_problem
    assert check("generate", 200, ok, 4, "") is None
    assert check("burst", 200, [ok, ok], 4, "") is None
    assert check("abort", 200, aborted, 4, "") is None
    assert check("oversized", 400, error, 4, "") is None
    assert check("disconnect", None, "ReadTimeout", 4, "") is None
    assert check("generate", None, "ConnectionError", 4, "restart") is None
    assert check("generate", 503, error, 4, "fail_transfer") is None
    # What must fail: short output, a lost request, an error without a message, an error with no
    # fault active, a malformed request accepted or answered 5xx.
    assert check("generate", 200, aborted, 4, "")
    assert check("burst", 200, [ok, aborted], 4, "")
    assert check("generate", None, "ReadTimeout", 4, "")
    assert check("generate", None, "ReadTimeout", 4, "stall_transfer")
    assert check("generate", 500, "Internal Server Error", 4, "restart") is None
    assert check("generate", 500, {"error": {}}, 4, "fail_transfer")
    failed_stream = {
        "meta_info": {"finish_reason": {"type": "abort", "message": "transfer failed"}}
    }
    assert check("stream", 200, failed_stream, 4, "fail_transfer") is None
    assert check("stream", 200, failed_stream, 4, "")
    assert check("burst", 200, [ok, failed_stream], 4, "fail_transfer") is None
    assert check("generate", 500, error, 4, "") and check("generate", 400, error, 4, "")
    assert check("malformed", 200, ok, 4, "") and check("malformed", 500, error, 4, "")
    assert check("oversized", 400, {"detail": ""}, 4, "")


def test_a_long_error_keeps_its_failure_reason():
    reason = "Request 7 timed out after 300.0s in KVPoll.WaitingForInput"
    message = f"Decode transfer failed for request rid='{'a' * 200}' with exception {reason}"
    problem = soak.response_problem("generate", 500, {"object": "error", "message": message}, 4, "")
    assert problem.startswith("HTTP 500 with no fault active: Decode transfer failed")
    assert problem.endswith(reason) and " ... " in problem and len(soak.shorten(message)) == 305
    assert soak.shorten("short") == "short"


def test_shm_files_named_after_our_processes_are_found(tmp_path):
    for name in ("sglang-kv-offload-4242-0a1b2c-node0", "sgl_shm_mq_4242_77", "other_42420_1"):
        (tmp_path / name).touch()
    ours, theirs = soak.leftover_shm([4242], str(tmp_path))
    assert ours == ["sglang-kv-offload-4242-0a1b2c-node0"] and theirs == ["sgl_shm_mq_4242_77"]
    assert soak.leftover_shm([4243], str(tmp_path)) == ([], [])


def test_tally_fails_on_one_failed_check_and_excuses_only_overlapping_faults():
    tally = soak.Tally()
    tally.check("probe_tokens", [])
    assert tally.summary()["ok"]
    tally.fault_spans.append([10.0, 20.0, "restart"])
    assert tally.fault_during(5, 11) == "restart" and tally.fault_during(21, 30) == ""
    tally.check("idle_state", ["free counts not back at start"])
    assert not tally.summary()["ok"]
    assert tally.summary()["checks"]["idle_state"] == {
        "passed": 0,
        "failed": 1,
        "failures": ["free counts not back at start"],
    }
