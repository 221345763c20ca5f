"""End to end: the real ``python -m sglang.launch_server`` on the tiny DeepSeek-V3.2, flag on vs off.

Each server is upstream SGLang's own process tree (tokenizer manager -> scheduler subprocess ->
ModelRunner -> NSA backend), overlap scheduler on unless a test says otherwise; only binary kernels
run as the test-only torch references of ``standins/kv_offload_standins.py``. Greedy tokens with
``--enable-kv-offload`` are compared with the same server without it, request by request: every
reference is the flag-off server running that request alone, and the kernel references are batch
invariant, so a request's tokens do not depend on what it was batched with. Each scenario ends with
a leak check through ``GET /server_info`` (``internal_states[0]["kv_offload"]``: free counts of the
logical, physical and host allocators back at their start values).

The index top-k is overridden to 64 and each request gets 128 sparse slots, so contexts of 512+
tokens evict and reload from the host at most steps.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Dict, List

import pytest
import requests
from _real_server import TinyServer

pytestmark = pytest.mark.slow

TOPK = 64
SLOTS = 128
COMMON = [
    "--json-model-override-args", json.dumps({"index_topk": TOPK}),
    "--chunked-prefill-size", "256",
    "--max-running-requests", "8",
    "--context-length", "1024",
    "--max-total-tokens", "4096",
]  # fmt: skip
OFFLOAD = ["--enable-kv-offload"]


def offload_config(**extra) -> List[str]:
    return ["--kv-offload-config", json.dumps({"sparse_slots_per_req": SLOTS, **extra})]


def prompt(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


# Host slots for about 5000 tokens (2 layers x 1152 B each): less than 8 requests of 700 tokens.
SMALL_HOST_GB = 5000 * 2 * 1152 / 1e9


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The flag-off reference server and the flag-on server, started side by side."""
    logs = tmp_path_factory.mktemp("servers")
    off = TinyServer(COMMON, logs / "off.log")
    on = TinyServer(COMMON + OFFLOAD + offload_config(), logs / "on.log")
    try:
        off.wait_ready()
        on.wait_ready()
        yield off, on
    finally:
        off.stop()
        on.stop()


class References:
    """Each prompt's greedy tokens from the flag-off server, the request alone."""

    def __init__(self, off: TinyServer):
        self.off = off
        self.cache: Dict[tuple, List[int]] = {}

    def __call__(self, ids: List[int], max_new_tokens: int) -> List[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in self.cache:
            out = self.off.generate(ids, max_new_tokens)
            self.cache[key] = out["output_ids"]
        return self.cache[key]


@pytest.fixture(scope="module")
def reference(servers):
    return References(servers[0])


def assert_same_tokens(outs: List[Dict], prompts: List[List[int]], reference, n: int) -> None:
    for i, (out, ids) in enumerate(zip(outs, prompts)):
        assert "output_ids" in out, f"request {i} failed: {out}"
        assert out["output_ids"] == reference(ids, n), f"request {i} ({len(ids)} tokens) differs"


def test_flag_off_server_has_no_offload_state(servers):
    off, on = servers
    assert "kv_offload" not in off.server_info()["internal_states"][0]
    state = on.offload_state()
    assert state["free"] == state["initial_free"]


def test_concurrent_requests_of_different_lengths(servers, reference):
    """(a) several concurrent requests of different lengths (the overlap scheduler is on)."""
    off, on = servers
    prompts = [prompt(n, seed) for seed, n in enumerate([90, 300, 520, 760])]
    outs = on.generate_many(prompts, 16)
    assert_same_tokens(outs, prompts, reference, 16)
    on.wait_no_leak()


def test_forced_eviction_and_reload(servers, reference):
    """(b) contexts >= 8x top-k with slots near top-k: most steps evict and reload from host;
    (e) every prompt here is prefilled in chunks of 256."""
    off, on = servers
    before = on.offload_state()
    prompts = [prompt(n, 100 + n) for n in (640, 900)]
    outs = on.generate_many(prompts, 40)
    assert_same_tokens(outs, prompts, reference, 40)
    after = on.wait_no_leak()
    loaded = after["loaded"] - before["loaded"]
    selected = after["selected"] - before["selected"]
    assert loaded > 0 and after["loaded_bytes"] > before["loaded_bytes"]
    assert after["backup_tokens"] > before["backup_tokens"]
    # Most of each step's top-k came from the host, not from a resident slot or the GPU tail.
    assert loaded > 0.3 * selected, (loaded, selected)
    assert "#new-token: 256" in on.log()  # chunked prefill ran


def test_streaming_response(servers, reference):
    """(g) streaming: the chunks end with the same tokens."""
    off, on = servers
    ids = prompt(700, 7)
    out = on.generate_stream(ids, 24)
    assert out["chunks"] > 1
    assert out["output_ids"] == reference(ids, 24)
    on.wait_no_leak()


def test_abort_mid_decode(servers, reference):
    """(d) abort by /abort_request and by client disconnect, mid-decode; the server serves on."""
    off, on = servers
    steps0 = on.offload_state()["decode_steps"]
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(on.generate(prompt(600, 11), 400, rid="abort-me"))
    )
    thread.start()
    deadline = time.time() + 300
    while on.offload_state()["decode_steps"] < steps0 + 3:
        assert time.time() < deadline, "the request never started decoding"
        time.sleep(0.5)
    on.abort("abort-me")
    thread.join(300)
    assert result["meta_info"]["finish_reason"]["type"] == "abort", result["meta_info"]
    assert len(result["output_ids"]) < 400

    # Client disconnect during a streamed decode.
    body = {
        "input_ids": prompt(650, 12),
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    with requests.post(on.url + "/generate", json=body, stream=True, timeout=300) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    on.wait_no_leak(timeout=120)

    ids = prompt(520, 13)
    assert on.generate(ids, 12)["output_ids"] == reference(ids, 12)
    on.wait_no_leak()


def test_more_requests_than_the_gpu_pool_admits_without_the_flag(servers, reference):
    """(c, first half) the same GPU budget (--max-total-tokens 4096) runs more requests at once
    with the flag: an offloaded token costs index keys on the GPU, its KV lives on the host."""
    off, on = servers
    prompts = [prompt(600, 200 + i) for i in range(8)]
    outs_off = off.generate_many(prompts, 60)
    outs_on = on.generate_many(prompts, 60)
    assert_same_tokens(outs_on, prompts, reference, 60)
    assert [o["output_ids"] for o in outs_off] == [o["output_ids"] for o in outs_on]
    capacity_off = off.server_info()["max_total_num_tokens"]
    capacity_on = on.server_info()["max_total_num_tokens"]
    running_off, running_on = off.max_running_seen(), on.max_running_seen()
    print(
        f"\n[admission] same GPU budget: tokens admitted without the flag {capacity_off}, with "
        f"it {capacity_on}; most requests decoding at once: {running_off} without, "
        f"{running_on} with"
    )
    assert capacity_on > 2 * capacity_off
    assert running_on == 8 and running_off < 8
    on.wait_no_leak()


def test_admission_pressure_waits_and_retracts(tmp_path, reference):
    """(c) more concurrent work than the host pool holds: admission waits, running requests are
    retracted and resumed, every request still completes with the right tokens, nothing leaks."""
    server = TinyServer(
        COMMON + OFFLOAD + offload_config(host_pool_size_gb=SMALL_HOST_GB),
        tmp_path / "pressure.log",
    ).wait_ready()
    try:
        prompts = [prompt(600, 300 + i) for i in range(8)]
        outs = server.generate_many(prompts, 100)
        assert_same_tokens(outs, prompts, reference, 100)
        retractions = sum(o["meta_info"]["total_retractions"] for o in outs)
        state = server.wait_no_leak()
        print(
            f"\n[pressure] host pool {state['initial_free']['host']} tokens, 8 x 700 tokens: "
            f"{retractions} retractions, most decoding at once {server.max_running_seen()}, "
            f"prefill waits {state['prefill_waits']}"
        )
        assert retractions > 0
        assert server.max_running_seen() < 8  # the rest waited for host capacity
    finally:
        server.stop()


def test_overlap_scheduler_off(tmp_path, reference):
    """(f) the same with --disable-overlap-schedule (the other tests run with it on)."""
    server = TinyServer(
        COMMON + OFFLOAD + offload_config() + ["--disable-overlap-schedule"],
        tmp_path / "no_overlap.log",
    ).wait_ready()
    try:
        prompts = [prompt(n, 400 + n) for n in (300, 700)]
        outs = server.generate_many(prompts, 24)
        assert_same_tokens(outs, prompts, reference, 24)
        server.wait_no_leak()
    finally:
        server.stop()


def test_negative_control_corrupted_loads_change_tokens(tmp_path, reference):
    """The comparison can fail: with every row loaded from the host taken from the wrong host
    slot (test-only fault injection), the tokens differ."""
    server = TinyServer(
        COMMON + OFFLOAD + offload_config(),
        tmp_path / "corrupt.log",
        env={"KV_OFFLOAD_TEST_CORRUPT_LOADS": "1"},
    ).wait_ready()
    try:
        ids = prompt(800, 500)
        out = server.generate(ids, 24)
        assert server.offload_state()["loaded"] > 0
        assert out["output_ids"] != reference(ids, 24)
    finally:
        server.stop()


def test_config_that_cannot_fit_fails_at_start_up(tmp_path):
    """A sparse pool too small to stage one prompt beside one request's slots: a clear error."""
    server = TinyServer(
        COMMON + OFFLOAD + offload_config(sparse_pool_slots=SLOTS), tmp_path / "too_small.log"
    )
    try:
        assert server.proc.wait(300) != 0
        assert "sparse_pool_slots=128 cannot stage a prompt" in server.log()
    finally:
        server.stop()
