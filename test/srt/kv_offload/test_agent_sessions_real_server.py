"""End to end: agent sessions with the radix cache, speculative decoding (NEXTN) and a PD decode
server, ``--enable-kv-offload`` on, greedy tokens equal to the flag-off server turn by turn.

Two sessions of three turns (a 160-token system prompt both share, then each session's own text;
every later turn appends the answer and a tool result), sent through the agent benchmark's
streaming client (``benchmark/kv_offload/bench_agent.py``) one turn at a time, session after
session, so every server runs the same requests alone, in the same order, against the same
cache. Each flag-on deployment runs beside its flag-off reference:

* the reference: a co-located server without the flag or speculation, radix cache on;
* MTP: the flag, the radix cache and NEXTN (``test_spec_real_server.SPEC``: 3 draft steps, eagle
  top-k 1) on the model's MTP layer;
* PD: a pair whose decode server has the flag (``pd_direct_to_host``) and upstream's decode radix
  cache (``--disaggregation-decode-enable-radix-cache``; the prefill server keeps no cache), against
  the same pair without the flag. (A PD pair's tokens on the CPU are not the co-located server's:
  its prefill recomputes the whole prompt, while the co-located prefill reads the cached history,
  whose answer tokens' KV the decode steps wrote, and the greedy tokens part ways within a turn.)

What it shows: every turn's tokens and ``cached_tokens`` equal the reference's, returning turns
reuse the session's whole history and the second session's first turn the shared system prompt,
the flag-on server's prefix hits (``shared_prefix_tokens``) are exactly what upstream reports as
cached, drafts were verified at every MTP turn, and after ``/flush_cache`` every free count is back
at its start. The lengths keep every history off a page boundary: with speculation upstream keys
the tree by token pairs (``RadixKey.is_bigram``: one key fewer per sequence), so at a boundary its
hit would be a page shorter than the reference's (which changes the prefill's chunks, and with
them the CPU tokens).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
from _real_server import started
from test_spec_real_server import SPEC

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmark" / "kv_offload"))
import bench_agent  # noqa: E402
from tiny_pd import PDPair  # noqa: E402
from tiny_server_proc import TinyServer  # noqa: E402

pytestmark = pytest.mark.slow

TOPK = 64
WORKLOAD = bench_agent.Workload(turns=3, first_len=330, system_len=160, tool_len=90, output_len=12)
SESSIONS = [0, 1]
COMMON = [
    "--json-model-override-args", json.dumps({"index_topk": TOPK, "num_nextn_predict_layers": 1}),
    "--chunked-prefill-size", "128",
    "--max-running-requests", "4",
    "--context-length", str(WORKLOAD.context_length()),
    "--max-total-tokens", "8192",
]  # fmt: skip
RADIX = ["--tiny-radix-cache"]


def offload(**config) -> List[str]:
    return ["--enable-kv-offload", "--kv-offload-config", json.dumps(config)]


def serve(off: Callable, on, flag_server: TinyServer) -> Tuple[Dict, Dict]:
    """Start the flag-off deployment (``off()``) once the flag-on one (``on``, launched) answers,
    then run the sessions on both at once (each server still gets its turns one at a time, in the
    same order); the flag-on ``flag_server``'s offload state before and after ``/flush_cache`` goes
    with its turns. (The flag-on server first: its host pool's start-up check counts host memory
    the reference's servers would take while starting.)"""
    with started(on):
        reference = off()
        with started(reference), ThreadPoolExecutor(2) as pool:
            runs = pool.map(
                lambda url: bench_agent.run_sessions(url, WORKLOAD, SESSIONS, in_flight=1),
                [reference.url, on.url],
            )
            ref, got = [{"turns": sorted(r.turns, key=lambda t: (t.session, t.turn))} for r in runs]
            got["before_flush"] = flag_server.wait_settled()
            got["after_flush"] = bench_agent.flush(flag_server.url)
    return ref, got


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("agent")


@pytest.fixture(scope="module")
def mtp(logs) -> Tuple[Dict, Dict]:
    """The reference and the MTP server."""
    # Slots for the union of a verify step's 4 draft tokens' top-k sets.
    spec = TinyServer(
        COMMON + RADIX + SPEC + offload(sparse_slots_per_req=4 * TOPK), logs / "mtp.log"
    )
    return serve(lambda: TinyServer(COMMON + RADIX, logs / "reference.log"), spec, spec)


@pytest.fixture(scope="module")
def pd(logs) -> Tuple[Dict, Dict]:
    """The flag-off pair and the flag-on pair."""
    decode = ["--disaggregation-decode-enable-radix-cache"]
    on = offload(sparse_slots_per_req=2 * TOPK, pd_direct_to_host=True)
    flag_on = PDPair(COMMON, decode + on, logs / "pd_on")
    return serve(lambda: PDPair(COMMON, decode, logs / "pd_off"), flag_on, flag_on.decode)


def check_against_reference(reference: Dict, run: Dict) -> None:
    ref, got = reference["turns"], run["turns"]
    assert [(t.session, t.turn) for t in got] == [(t.session, t.turn) for t in ref]
    for a, b in zip(ref, got):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert b.output_ids == a.output_ids, f"session {b.session} turn {b.turn} differs"
        assert b.cached_tokens == a.cached_tokens, (b.session, b.turn)
    cached = [t.cached_tokens for t in got]
    # Returning turns reuse the whole history; the second session's first turn reuses the whole
    # pages of the shared system prompt.
    assert all(t.cached_tokens == t.history_len > 0 for t in got if t.turn > 0), cached
    assert cached[0] == 0 and cached[WORKLOAD.turns] == WORKLOAD.system_len // 64 * 64, cached
    before, after = run["before_flush"], run["after_flush"]
    assert before["shared_prefix_tokens"] == sum(cached), (before, cached)
    assert before["loaded"] > 0 and before["error_flags"] == 0, before
    assert after["free"] == after["initial_free"] and after["requests"] == 0, after


def test_mtp_turns_equal_flag_off_server(mtp):
    reference, spec = mtp
    check_against_reference(reference, spec)
    assert all(t.spec_accept_length is None for t in reference["turns"])
    # Every MTP turn was decoded by verify steps (the random MTP layer accepts almost nothing).
    assert all(
        t.spec_accept_length is not None and t.spec_accept_length >= 1 for t in spec["turns"]
    )


def test_pd_decode_radix_turns_equal_flag_off_pair(pd):
    reference, on = pd
    check_against_reference(reference, on)
    assert on["before_flush"]["admitted_from_host"] == len(on["turns"]), on["before_flush"]
