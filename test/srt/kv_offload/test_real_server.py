"""End to end: the real ``python -m sglang.launch_server`` on the tiny DeepSeek-V3.2, flag on vs off.

Each server is upstream SGLang's own process tree (tokenizer manager -> scheduler subprocess ->
ModelRunner -> NSA backend), overlap scheduler on unless a test says otherwise; only binary kernels
run as the test-only torch references of ``standins/kv_offload_standins.py``. Greedy tokens with
``--enable-kv-offload`` are compared with a server without it, request by request, and each scenario
ends with a leak check through ``GET /server_info`` (``internal_states[0]["kv_offload"]``: free
counts of the logical, physical and host allocators back at their start values).

Fixed batching: on the CPU a request's greedy tokens depend on what it is batched with, with or
without the flag (upstream computes the MoE router and the indexer head gates as fp32 matmuls, whose
reduction order changes with the number of rows), so every comparison sends its prompts in one
``/generate`` call: the scheduler receives them in one message and two servers whose admission
decisions agree run the same batches. Each flag-on server is paired with a flag-off twin whose
token budget makes the same decisions (``OFF_LARGE`` admits what ``ON`` admits; ``OFF_SMALL`` has
the token budget ``ON_PRESSURE``'s host pool gives it, so both wait and retract at the same steps).

The index top-k is overridden to 64 and each request gets 128 sparse slots, so contexts of 512+
tokens evict and reload from the host at most steps.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from typing import Iterator, List

import pytest
import requests
from _real_server import TinyServer

pytestmark = pytest.mark.slow

TOPK = 64
SLOTS = 128
KV_ROW_BYTES = 2 * 1152  # 2 layers of bf16 latent rows per token
COMMON = [
    "--json-model-override-args", json.dumps({"index_topk": TOPK}),
    "--chunked-prefill-size", "256",
    "--max-running-requests", "8",
    "--context-length", "1024",
]  # fmt: skip
SMALL_GPU = ["--max-total-tokens", "4096"]
LARGE_GPU = ["--max-total-tokens", "16384"]
# A host pool of exactly 4096 tokens (the budget of OFF_SMALL), and a sparse pool large enough that
# the GPU-row gate never binds: admission and retraction then follow the host pool alone.
PRESSURE_HOST_GB = (4096 * KV_ROW_BYTES + 1024) / 1e9
PRESSURE_SPARSE_POOL = 8 * (SLOTS + 128) + 8 * 640


def offload(**extra) -> List[str]:
    config = {"sparse_slots_per_req": SLOTS, **extra}
    return ["--enable-kv-offload", "--kv-offload-config", json.dumps(config)]


OFF_LARGE = COMMON + LARGE_GPU
ON = COMMON + SMALL_GPU + offload()  # a quarter of OFF_LARGE's GPU budget
OFF_SMALL = COMMON + SMALL_GPU
ON_PRESSURE = (
    COMMON
    + LARGE_GPU
    + offload(host_pool_size_gb=PRESSURE_HOST_GB, sparse_pool_slots=PRESSURE_SPARSE_POOL)
)


def prompt(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


@contextlib.contextmanager
def running(*specs) -> Iterator[List[TinyServer]]:
    """Servers started side by side (``(args, log_path[, env])`` each), ready, stopped after."""
    servers = [TinyServer(*spec) for spec in specs]
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def main_pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("main")
    with running((OFF_LARGE, logs / "off_large.log"), (ON, logs / "on.log")) as servers:
        yield servers


def tokens(outs) -> List[List[int]]:
    outs = outs if isinstance(outs, list) else [outs]
    for i, out in enumerate(outs):
        assert "output_ids" in out, f"request {i} failed: {out}"
    return [out["output_ids"] for out in outs]


def assert_same_batch(off: TinyServer, on: TinyServer, prompts, max_new_tokens: int):
    """Both servers run ``prompts`` as one call; every request's tokens must be equal."""
    ref = tokens(off.generate_batch(prompts, max_new_tokens))
    got = tokens(on.generate_batch(prompts, max_new_tokens))
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} ({len(prompts[i])} tokens) differs: {a} vs {b}"
    return got


def test_flag_off_server_has_no_offload_state(main_pair):
    off, on = main_pair
    assert "kv_offload" not in off.server_info()["internal_states"][0]
    state = on.offload_state()
    assert state["free"] == state["initial_free"] and state["requests"] == 0


def test_concurrent_requests_of_different_lengths(main_pair):
    """(a) several concurrent requests of different lengths (the overlap scheduler is on)."""
    off, on = main_pair
    prompts = [prompt(n, seed) for seed, n in enumerate([90, 300, 520, 760])]
    assert_same_batch(off, on, prompts, 16)
    on.wait_no_leak()


def test_forced_eviction_and_reload(main_pair):
    """(b) contexts >= 8x top-k with slots near top-k: most steps evict and reload from host;
    (e) every prompt here is prefilled in chunks of 256."""
    off, on = main_pair
    before = on.offload_state()
    prompts = [prompt(n, 100 + n) for n in (640, 900)]
    assert_same_batch(off, on, prompts, 40)
    after = on.wait_no_leak()
    loaded = after["loaded"] - before["loaded"]
    selected = after["selected"] - before["selected"]
    assert after["loaded_bytes"] > before["loaded_bytes"]
    assert after["backup_tokens"] > before["backup_tokens"]
    # Most of each step's top-k came from the host, not from a resident slot or the GPU tail.
    assert loaded > 0.3 * selected, (loaded, selected)
    assert "#new-token: 256" in on.log()  # chunked prefill ran


def test_streaming_response(main_pair):
    """(g) streaming: the chunks end with the flag-off server's tokens."""
    off, on = main_pair
    ids = prompt(700, 7)
    out = on.generate_stream(ids, 24)
    assert out["chunks"] > 1
    assert out["output_ids"] == tokens(off.generate(ids, 24))[0]
    on.wait_no_leak()


def test_abort_mid_decode(main_pair):
    """(d) abort by /abort_request and by client disconnect, mid-decode; the server serves on."""
    off, on = main_pair
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
        "input_ids": prompt(600, 12),
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
    }
    with requests.post(on.url + "/generate", json=body, stream=True, timeout=300) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    on.wait_no_leak(timeout=120)

    ids = prompt(520, 13)
    assert tokens(on.generate(ids, 12)) == tokens(off.generate(ids, 12))
    on.wait_no_leak()


@pytest.fixture(scope="module")
def pressure_pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pressure")
    # With this workload the host budget makes requests wait but never runs decode out of tokens,
    # so both twins also retract on upstream's test schedule (every 20 decode steps), which
    # keeps their batches identical.
    retract = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "20"}
    specs = (
        (OFF_SMALL, logs / "off_small.log", retract),
        (ON_PRESSURE, logs / "on_pressure.log", retract),
    )
    with running(*specs) as servers:
        yield servers


PRESSURE_PROMPTS = [prompt(600, 200 + i) for i in range(8)]
PRESSURE_NEW_TOKENS = 60


def test_token_budget_with_the_same_gpu_budget(main_pair, pressure_pair):
    """(c, first half) the same GPU budget (--max-total-tokens 4096) admits more tokens with the
    flag: an offloaded token costs index keys on the GPU, its KV lives on the host."""
    _, on = main_pair
    off_small, _ = pressure_pair
    capacity_off = off_small.server_info()["max_total_num_tokens"]
    capacity_on = on.server_info()["max_total_num_tokens"]
    print(
        f"\n[admission] --max-total-tokens 4096 both: token budget without the flag "
        f"{capacity_off}, with it {capacity_on}"
    )
    assert capacity_off == 4096
    assert capacity_on > 3 * capacity_off


def test_admission_pressure_waits_and_retracts(pressure_pair):
    """(c) more concurrent work than the host pool holds: admission waits, running requests are
    retracted and resumed, every request completes with the tokens of a flag-off server whose
    token budget equals the host pool (so, fresh like it, it waits and retracts at the same
    steps)."""
    off, on = pressure_pair
    assert on.server_info()["max_total_num_tokens"] == off.server_info()["max_total_num_tokens"]
    outs = on.generate_batch(PRESSURE_PROMPTS, PRESSURE_NEW_TOKENS)
    ref = off.generate_batch(PRESSURE_PROMPTS, PRESSURE_NEW_TOKENS)
    assert tokens(outs) == tokens(ref)
    retractions = [sum(o["meta_info"]["total_retractions"] for o in r) for r in (outs, ref)]
    state = on.wait_no_leak()
    print(
        f"\n[pressure] host pool {state['initial_free']['host']} tokens, 8 x "
        f"{600 + PRESSURE_NEW_TOKENS} tokens: retractions {retractions[0]} with the flag, "
        f"{retractions[1]} without; most decoding at once {on.max_running_seen()} / "
        f"{off.max_running_seen()}; prefill waits on GPU rows {state['prefill_waits']}"
    )
    assert retractions[0] > 0 and retractions[0] == retractions[1]
    assert on.max_running_seen() < 8  # the others waited for host capacity


def test_overlap_scheduler_off(main_pair, tmp_path):
    """(f) the same with --disable-overlap-schedule (the other tests run with it on)."""
    off, _ = main_pair
    with running((ON + ["--disable-overlap-schedule"], tmp_path / "no_overlap.log")) as (server,):
        prompts = [prompt(n, 400 + n) for n in (300, 700)]
        assert_same_batch(off, server, prompts, 24)
        server.wait_no_leak()


def test_negative_control_corrupted_loads_change_tokens(main_pair, tmp_path):
    """The comparison can fail: with every row loaded from the host taken from the wrong host
    slot (test-only fault injection), the tokens differ."""
    off, _ = main_pair
    corrupt = {"KV_OFFLOAD_TEST_CORRUPT_LOADS": "1"}
    with running((ON, tmp_path / "corrupt.log", corrupt)) as (server,):
        ids = prompt(800, 500)
        out = tokens(server.generate(ids, 24))
        assert server.offload_state()["loaded"] > 0
        assert out != tokens(off.generate(ids, 24))


def test_config_that_cannot_fit_fails_at_start_up(tmp_path):
    """A sparse pool too small to stage one prompt beside one request's slots: a clear error."""
    server = TinyServer(
        COMMON + SMALL_GPU + offload(sparse_pool_slots=SLOTS), tmp_path / "too_small.log"
    )
    try:
        assert server.proc.wait(300) != 0
        assert "sparse_pool_slots=128 cannot stage a prompt" in server.log()
    finally:
        server.stop()
