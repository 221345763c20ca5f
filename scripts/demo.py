#!/usr/bin/env python3
"""Demo of --enable-kv-offload on the real server: the tiny DeepSeek-V3.2, flag off vs on.

1. Starts two ``python -m sglang.launch_server`` (``scripts/tiny_server.py``: a 2-layer random-weight
   ``DeepseekV32ForCausalLM``, CPU unless CUDA is present) side by side: one with
   ``--enable-kv-offload`` (index top-k 64 and 128 sparse slots per request, so contexts of 500+
   tokens evict and reload rows from the host at most steps) and ``--max-total-tokens`` of device
   memory, and the reference without the flag, given 4x that budget so that it admits the same
   requests at the same steps (on the CPU a request's greedy tokens depend on what it is batched
   with, flag or not).
2. Sends the same prompts to both in one ``/generate`` call each and compares the greedy tokens.
3. Prints what the flag bought (token budget in the same device memory, device bytes per cached
   token), what it did (rows loaded from the host, hit rate, backups) and the leak check.

Exits non-zero when a token differs or a free count does not return to its start. Logs go to a
temporary directory removed at exit (``--keep-logs DIR`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import LOGICAL_LOC_STATE_BYTES
from tiny_server_proc import TinyServer

LAYERS = 2  # the tiny model (test/srt/kv_offload/fixtures/tiny-deepseek-v32/config.json)
INDEX_ROW = 132  # fp8 index key (128) + fp32 scale, per token and layer
KV_ROW = {"bfloat16": 1152, "fp8_e4m3": 656}


def prompt(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def log(t0: float, msg: str) -> None:
    print(f"[demo {time.time() - t0:5.0f} s] {msg}", flush=True)


def generate_with_progress(t0, servers: Dict[str, TinyServer], prompts, new_tokens: int):
    """The same call on both servers at once, printing decode progress until both answer."""
    out: Dict[str, list] = {}
    calls = [
        threading.Thread(
            target=lambda k=k, s=s: out.__setitem__(k, s.generate_batch(prompts, new_tokens))
        )
        for k, s in servers.items()
    ]
    for call in calls:
        call.start()
    steps0 = servers["on"].offload_state()["decode_steps"]
    while any(call.is_alive() for call in calls):
        time.sleep(5)
        steps = servers["on"].offload_state()["decode_steps"] - steps0
        done = ", ".join(k for k in servers if k in out) or "none"
        log(t0, f"  decoding: {steps} steps with the flag so far; finished: {done}")
    for call in calls:
        call.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="device token budget")
    ap.add_argument("--keep-logs", default=None, help="keep the server logs in this directory")
    a = ap.parse_args()
    t0 = time.time()
    log_dir = (
        Path(a.keep_logs) if a.keep_logs else Path(tempfile.mkdtemp(prefix="kv-offload-demo-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    common = [
        "--json-model-override-args", json.dumps({"index_topk": 64}),
        "--chunked-prefill-size", "256",
        "--context-length", "1024",
        "--max-running-requests", "8",
    ]  # fmt: skip
    budget_args = ["--max-total-tokens", str(a.max_total_tokens)]
    reference_args = ["--max-total-tokens", str(4 * a.max_total_tokens)]
    flag = ["--enable-kv-offload", "--kv-offload-config", '{"sparse_slots_per_req": 128}']
    servers = {}
    try:
        log(t0, "[1/3] starting two tiny DeepSeek-V3.2 servers (python -m sglang.launch_server): "
            f"--enable-kv-offload with --max-total-tokens {a.max_total_tokens}, and the reference "
            f"without the flag ({4 * a.max_total_tokens})")  # fmt: skip
        servers = {
            "off": TinyServer(common + reference_args, log_dir / "off.log"),
            "on": TinyServer(common + budget_args + flag, log_dir / "on.log"),
        }
        for server in servers.values():
            server.wait_ready()
        info = {k: s.server_info() for k, s in servers.items()}
        dtype = info["on"]["kv_cache_dtype"]
        dtype = "bfloat16" if dtype == "auto" else dtype
        log(t0, f"      ready; KV cache dtype {dtype}, device {info['on']['device']}")

        prompts = [prompt(a.prompt_tokens + 100 * i, i) for i in range(a.requests)]
        log(t0, f"[2/3] {a.requests} requests of {a.prompt_tokens}-"
            f"{a.prompt_tokens + 100 * (a.requests - 1)} tokens, {a.new_tokens} new tokens "
            "each, greedy, the same /generate call to both")  # fmt: skip
        before = servers["on"].offload_state()
        out = generate_with_progress(t0, servers, prompts, a.new_tokens)
        tokens = {k: [o["output_ids"] for o in v] for k, v in out.items()}
        equal = [x == y for x, y in zip(tokens["off"], tokens["on"])]
        state = servers["on"].wait_no_leak()

        log(t0, "[3/3] results")
        row = KV_ROW[dtype]
        on_budget = info["on"]["max_total_num_tokens"]
        off_bytes = (row + INDEX_ROW) * LAYERS
        on_bytes = INDEX_ROW * LAYERS + LOGICAL_LOC_STATE_BYTES
        loaded = state["loaded"] - before["loaded"]
        selected = state["selected"] - before["selected"]
        hits = state["hits"] - before["hits"]
        lines = [
            f"greedy tokens equal: {sum(equal)}/{len(equal)} requests",
            f"token budget in the device memory of {a.max_total_tokens} tokens: {on_budget} with "
            f"the flag ({100 * (on_budget / a.max_total_tokens - 1):+.0f} %)",
            f"device bytes per cached token ({LAYERS} layers, {dtype} KV): {off_bytes} B without the "
            f"flag, {on_bytes} B with it ({100 * (on_bytes / off_bytes - 1):+.0f} %; the KV is in the "
            f"host pool, plus a bounded sparse buffer of 128 slots per request)",
            f"top-k rows: {selected} selected, {hits} hits in the sparse buffer "
            f"({100 * hits / max(selected, 1):.0f} %), {loaded} loaded from the host "
            f"({state['loaded_bytes'] - before['loaded_bytes']} B); "
            f"{state['backup_tokens'] - before['backup_tokens']} tokens backed up",
            "free counts back at their start: "
            + ", ".join(f"{k} {v}" for k, v in state["free"].items()),
        ]
        for line in lines:
            print("  " + line)
        ok = all(equal)
        if not ok:
            print("FAIL: the tokens differ with the flag", file=sys.stderr)
        log(t0, "done" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for server in servers.values():
            server.stop()  # also removes the server's temporary files
        if not a.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
