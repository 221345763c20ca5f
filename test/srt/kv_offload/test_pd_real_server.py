"""End to end: a real PD pair (prefill + decode ``sglang.launch_server``, Mooncake over TCP on
loopback, SGLang's mini load balancer) with ``--enable-kv-offload`` on the decode server.

Two pairs run side by side, both decode servers with the flag: ``gpu_pages`` (the prompt KV lands in
GPU rows and is backed up to the host) and ``direct_to_host`` (``pd_direct_to_host``: the prefill
server writes it straight into the decode server's host pool). The gpu_pages decode server also
retracts on upstream's test schedule (``SGLANG_TEST_RETRACT``), so PD decode retraction (the KV
saved by ``Req.offload_kv_cache``, restored by ``resume_retracted_reqs``) runs under load.

Greedy tokens are compared, one request at a time, with a single non-PD server without the flag.
Concurrent requests are checked for completion and leaks only: which prompts the prefill server
batches together depends on when each request's bootstrap handshake completes, and on the CPU the
batch changes the greedy tokens with or without the flag (the same flag-off pair gives different
tokens for two identical concurrent calls). Every test ends with the decode server's free counts
back at their start (``GET /server_info``).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Dict, List

import pytest
import requests
from _real_server import TinyServer, started, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from tiny_pd import PDPair  # noqa: E402

pytestmark = pytest.mark.slow

COMMON = [
    "--json-model-override-args", json.dumps({"index_topk": 64}),
    "--chunked-prefill-size", "256",
    "--context-length", "1024",
    "--max-running-requests", "8",
]  # fmt: skip
SLOTS = 128
PAGE = 64
NEW_TOKENS = 16
# Many pages each; every last page has room for NEW_TOKENS, so decoding completes no page and a
# direct-to-host request never backs anything up.
PROMPT_LENS = (100, 650, 900)


def offload(**extra) -> List[str]:
    config = {"sparse_slots_per_req": SLOTS, **extra}
    return ["--enable-kv-offload", "--kv-offload-config", json.dumps(config)]


def prompt(n: int, seed: int) -> List[int]:
    return [(7 * i + 13 * seed + 3) % 500 + 2 for i in range(n)]


PROMPTS = [prompt(n, i) for i, n in enumerate(PROMPT_LENS)]


def generate(url: str, ids, max_new_tokens: int, rid=None) -> Dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return requests.post(url + "/generate", json=body, timeout=600).json()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    reference = TinyServer(COMMON, logs / "reference.log")
    pairs = {
        "gpu_pages": PDPair(
            COMMON,
            offload(),
            logs / "gpu_pages",
            decode_env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"},
        ),
        "direct_to_host": PDPair(COMMON, offload(pd_direct_to_host=True), logs / "direct"),
    }
    with started(reference, *pairs.values()):
        yield reference, pairs


@pytest.fixture(scope="module")
def reference_tokens(servers) -> List[List[int]]:
    reference, _ = servers
    return [generate(reference.url, ids, NEW_TOKENS)["output_ids"] for ids in PROMPTS]


@pytest.mark.parametrize("mode", ["gpu_pages", "direct_to_host"])
def test_tokens_through_the_pair_equal_one_server(servers, reference_tokens, mode):
    _, pairs = servers
    pair = pairs[mode]
    got = [generate(pair.url, ids, NEW_TOKENS)["output_ids"] for ids in PROMPTS]
    for n, a, b in zip(PROMPT_LENS, reference_tokens, got):
        assert a == b, f"{mode}: the {n}-token prompt differs: {a} vs {b}"
    state = pair.decode.wait_no_leak()
    assert state["loaded"] > 0  # top-k rows came from the host pool


def test_direct_to_host_prompts_land_in_the_host_pool(servers, reference_tokens):
    """With pd_direct_to_host no prompt row is staged in GPU rows: every request is admitted from
    the host and nothing is backed up (decoding completes no page here)."""
    _, pairs = servers
    pair = pairs["direct_to_host"]
    before = pair.decode.offload_state()
    for ids in PROMPTS:
        generate(pair.url, ids, NEW_TOKENS)
    after = pair.decode.wait_no_leak()
    assert after["admitted_from_host"] - before["admitted_from_host"] == len(PROMPTS)
    assert after["admitted"] - before["admitted"] == len(PROMPTS)
    assert after["backup_tokens"] == before["backup_tokens"]


def test_concurrent_requests_with_retraction_complete_and_leak_nothing(servers):
    _, pairs = servers
    pair = pairs["gpu_pages"]
    prompts = [prompt(n, 50 + n) for n in (120, 300, 500, 700, 260)]
    outs = generate(pair.url, prompts, 40)
    assert [len(o["output_ids"]) for o in outs] == [40] * len(prompts), outs
    retractions = sum(o["meta_info"]["num_retractions"] for o in outs)
    assert retractions > 0  # SGLANG_TEST_RETRACT on the decode server, every 5 steps
    state = pair.decode.wait_no_leak()
    assert state["backup_tokens"] > 0


@pytest.mark.parametrize("mode", ["gpu_pages", "direct_to_host"])
def test_abort_mid_decode(servers, mode):
    _, pairs = servers
    pair = pairs[mode]
    steps0 = pair.decode.offload_state()["decode_steps"]
    result = {}
    rid = f"abort-{mode}"
    thread = threading.Thread(
        target=lambda: result.update(generate(pair.url, prompt(600, 9), 400, rid=rid))
    )
    thread.start()
    wait_until(
        lambda: pair.decode.offload_state()["decode_steps"] >= steps0 + 3,
        "the request never started decoding",
    )
    pair.decode.abort(rid)
    thread.join(300)
    assert len(result.get("output_ids", [])) < 400, result
    pair.decode.wait_no_leak()


@pytest.mark.parametrize("mode", ["gpu_pages", "direct_to_host"])
def test_abort_during_transfer(servers, mode):
    """Aborted on the decode server while the prefill server is still computing and sending the
    prompt (the request sits in the decode server's transfer queue): nothing leaks, and the pair
    serves the next request."""
    _, pairs = servers
    pair = pairs[mode]
    rid = f"abort-transfer-{mode}"
    chunks_before = pair.prefill.log().count("Prefill batch")
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(generate(pair.url, prompt(1000, 21), 8, rid=rid))
    )
    thread.start()
    wait_until(
        lambda: pair.prefill.log().count("Prefill batch") >= chunks_before + 1,
        "the prefill server never started the prompt",
    )
    pair.decode.abort(rid)
    thread.join(300)
    assert len(result.get("output_ids", [])) < 8, result
    pair.decode.wait_no_leak()
    assert len(generate(pair.url, PROMPTS[0], 4)["output_ids"]) == 4
    pair.decode.wait_no_leak()


# Attention DP 2 on the decode server (one rank per attention-TP group), as in the published PD
# recipes; on the CPU without upstream's TP LM-head all-to-all, a CUDA-only collective that PD
# decode nodes with pure attention DP turn on by default (the all-gather path computes the same).
DP_DECODE = ["--tp", "2", "--attn-dp-size", "2", "--no-enable-tp-lm-head-all-to-all"]
DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


class TestAttentionDPDecode:
    """A PD pair whose decode server runs attention DP 2 with ``pd_direct_to_host`` (each rank's
    prompts land in its own host pool), against the same pair without the flag: TP 2 and TP 1
    reduce in different orders, so the reference is a DP 2 decode server too."""

    @pytest.fixture(scope="class")
    def dp_pairs(self, tmp_path_factory):
        logs = tmp_path_factory.mktemp("pd_dp")
        pairs = (
            PDPair(COMMON, DP_DECODE, logs / "off", decode_env=DP_ENV),
            PDPair(COMMON, offload(pd_direct_to_host=True) + DP_DECODE, logs / "on", DP_ENV),
        )
        with started(*pairs):
            yield pairs

    def test_tokens_equal_on_both_ranks_from_their_host_pools(self, dp_pairs):
        off, on = dp_pairs
        ranks = []
        for n, ids in zip(PROMPT_LENS, PROMPTS):
            want = generate(off.url, ids, NEW_TOKENS)["output_ids"]
            got = generate(on.url, ids, NEW_TOKENS)
            assert got["output_ids"] == want, f"the {n}-token prompt differs: {got} vs {want}"
            ranks.append(got["meta_info"]["dp_rank"])
        assert set(ranks) == {0, 1}, ranks
        on.decode.wait_no_leak()
        states = on.decode.offload_states()  # one per rank, in no set order
        assert sorted(s["admitted"] for s in states) == sorted(map(ranks.count, (0, 1))), states
        for state in states:
            assert state["admitted_from_host"] == state["admitted"], state
            assert state["loaded"] > 0 and state["error_flags"] == 0, state

    def test_concurrent_requests_complete_and_leak_nothing(self, dp_pairs):
        _, on = dp_pairs
        prompts = [prompt(n, 70 + n) for n in (120, 300, 500, 700, 260)]
        outs = generate(on.url, prompts, 24)
        assert [len(o["output_ids"]) for o in outs] == [24] * len(prompts), outs
        assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
        on.decode.wait_no_leak()
