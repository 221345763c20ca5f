"""A real PD pair with ``--enable-kv-offload`` on the decode server, when something goes wrong.

* The prefill server's KV cache dtype (bf16) differs from the decode server's (fp8): the decode side
  refuses at the first transfer, naming both dtypes and the flag to set (upstream's check in
  ``CommonKVReceiver.try_ensure_parallel_info``, which runs with the flag as without it).
* The prefill server is killed while it prefills and transfers a long prompt: the request fails and
  the decode server serves on with every free count back at its start.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import requests
from tiny_pd import PDPair
from tiny_server import BF16_KV, FP8_KV
from tiny_server_proc import wait_until

pytestmark = pytest.mark.slow

COMMON = FP8_KV + [
    "--json-model-override-args", json.dumps({"index_topk": 64}),
    "--chunked-prefill-size", "256",
    "--context-length", "2048",
]  # fmt: skip
OFFLOAD = ["--enable-kv-offload", "--kv-offload-config", json.dumps({"sparse_slots_per_req": 128})]


def generate(url: str, ids, max_new_tokens: int):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens}}
    return requests.post(url + "/generate", json=body, timeout=600)


def test_kv_cache_dtype_mismatch_is_refused_at_the_first_transfer(tmp_path):
    pair = PDPair(COMMON, OFFLOAD, tmp_path, prefill_extra=BF16_KV)
    try:
        pair.wait_ready()
        assert generate(pair.url, list(range(2, 200)), 8).status_code != 200
        assert pair.decode.proc.wait(120) is not None
        assert (
            "KV cache dtype mismatch: prefill server has kv_cache_dtype=bfloat16, but decode "
            "server has kv_cache_dtype=fp8_e4m3. Both servers must use the same --kv-cache-dtype"
        ) in pair.decode.log_text()
    finally:
        pair.stop()


def test_prefill_killed_mid_transfer_fails_the_request_and_leaks_nothing(tmp_path):
    pair = PDPair(COMMON, OFFLOAD, tmp_path)
    try:
        pair.wait_ready()
        start = pair.decode.offload_state()["initial_free"]
        chunks_before = pair.prefill.log_text().count("Prefill batch")
        result = {}
        long_prompt = [(7 * i) % 500 + 2 for i in range(1800)]  # 8 chunks of 256
        call = threading.Thread(
            target=lambda: result.update(response=generate(pair.url, long_prompt, 8))
        )
        call.start()
        # Two chunks prefilled (and sent page by page as they are computed): kill it mid-way.
        wait_until(
            lambda: pair.prefill.log_text().count("Prefill batch") >= chunks_before + 2,
            "the prefill server never started the prompt",
        )
        os.killpg(pair.prefill.proc.pid, signal.SIGKILL)
        call.join(300)
        assert result["response"].status_code != 200
        state = pair.decode.wait_no_leak(timeout=120)
        assert state["free"] == start and state["promised"] == 0
        assert pair.decode.alive()
        assert "Decode transfer failed" in pair.decode.log_text()
    finally:
        pair.stop()
