"""End to end: the radix cache (upstream's default prefix cache) with ``--enable-kv-offload``.

Two real tiny servers with the radix cache on (``--tiny-radix-cache`` drops the tiny defaults'
``--disable-radix-cache``), the flag off and on, run the same workload one after the other (one server
at a time: the machine is shared), each request sent alone so that both servers run the same batches
(see ``test_real_server.py``), except one batch of prompts sharing a cached document, sent in one call
to both:

* multi-turn: each turn's prompt is the previous turn's prompt, its output and new text;
* a shared document: one request caches it, then three questions about it run as one batch (their
  rows name the same prefix locs in the same decode steps), then a question answered by its prefill
  alone (one token: it never decodes) and one aborted while decoding.

Both servers also retract on upstream's test schedule (``SGLANG_TEST_RETRACT``), at the same steps.

Prompts are prefilled in chunks of 128 (so the tree also takes chunk pages before the first decode
step), the index top-k is 64 and each request gets 128 sparse slots: prefix rows are loaded from the
host at most steps. What it shows: the greedy tokens and ``cached_tokens`` of every request equal the
flag-off server's, prefix hits happen, the host pool holds each cached page once (host rows in use =
logical locs in use = the tokens the tree holds, counted here from the requests' token ids), no GPU
KV row stays held once the requests end, and after ``POST /flush_cache`` every free count (logical
index keys, physical rows, host slots) is back at its start value.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Dict, List, Set, Tuple

import pytest
import requests
from _real_server import started
from tiny_pd import PDPair
from tiny_server import FP8_KV
from tiny_server_proc import TinyServer, wait_until

pytestmark = pytest.mark.slow

TOPK = 64
SLOTS = 128
PAGE = 64
NEW = 12  # tokens per request
COMMON = FP8_KV + [
    "--tiny-radix-cache",
    "--json-model-override-args", json.dumps({"index_topk": TOPK}),
    "--chunked-prefill-size", "128",
    "--max-running-requests", "4",
    "--context-length", "2048",
    "--max-total-tokens", "8192",
]  # fmt: skip
OFFLOAD = [
    "--enable-kv-offload",
    "--kv-offload-config",
    json.dumps({"sparse_slots_per_req": SLOTS}),
]


def text(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


DOC = text(450, 1)
QUESTIONS = [text(30 + 7 * i, 10 + i) for i in range(4)]


def workload(server: TinyServer, on: bool) -> Dict:
    """Run the workload; returns every request's output and, flag on, the offload checks' data."""
    outs: List[Tuple[List[int], Dict]] = []  # (prompt, output)
    checks: List[Tuple] = []  # (what, host used, logical used, physical used, tree tokens)

    def used(state) -> Tuple[int, int, int]:
        free, start = state["free"], state["initial_free"]
        return (
            start["host"] - free["host"],
            start["logical"] - free["logical"],
            start["physical"] - free["physical"],
        )

    def settle(what: str) -> None:
        if not on:
            return
        host, logical, physical = used(server.wait_settled())
        checks.append((what, host, logical, physical, tree_tokens(outs)))

    def run(prompt: List[int]) -> Dict:
        out = server.generate(prompt, NEW)
        assert "output_ids" in out, out
        outs.append((prompt, out))
        return out

    # multi-turn: turn k+1 = turn k's prompt + its output + new text
    turn = text(200, 0)
    for k in range(3):
        out = run(turn)
        settle(f"turn {k}")
        turn = turn + out["output_ids"] + text(70, 100 + k)
    # a shared document: cached by one request, then three questions in one batch
    run(DOC + QUESTIONS[0])
    settle("document")
    batch = [DOC + q for q in QUESTIONS[1:]]
    got = server.generate_batch(batch, NEW)
    for p, o in zip(batch, got):
        assert "output_ids" in o, o
        outs.append((p, o))
    settle("questions")
    # a request that ends at its prefill (one token): the tree keeps its prompt pages, which no
    # decode step ever backed up
    run(DOC + text(90, 20))
    out = server.generate(DOC + text(90, 21), 1)
    assert "output_ids" in out, out
    outs.append((DOC + text(90, 21), out))
    settle("one token")
    # an abort in the middle of decoding a request on the document (its tokens are not compared)
    if on:
        state = server.offload_state()
        steps = state["decode_steps"]
    box: Dict = {}
    call = threading.Thread(
        target=lambda: box.update(out=server.generate(DOC + text(70, 30), 1500, rid="abort-me"))
    )
    call.start()
    if on:
        wait_until(lambda: server.offload_state()["decode_steps"] > steps + 3, "decoding", 120)
    else:
        time.sleep(2)
    server.abort("abort-me")
    call.join(timeout=120)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort", box["out"]["meta_info"]
    if on:
        host, logical, physical = used(server.wait_settled())
        checks.append(("abort", host, logical, physical, None))
    return flushed(server, {"outs": outs, "checks": checks}, on)


def flushed(server: TinyServer, result: Dict, on: bool) -> Dict:
    """``result`` with, flag on, the offload state before and after ``POST /flush_cache``."""
    if on:
        result["before_flush"] = server.offload_state()
        r = requests.post(server.url + "/flush_cache", timeout=60)
        assert r.status_code == 200, r.text
        result["after_flush"] = server.wait_no_leak()
    return result


def tree_tokens(outs) -> int:
    """Tokens the radix tree holds after these requests ended: the distinct whole pages of each
    request's KV (its prompt and every output token but the last, whose KV is never computed)."""
    pages: Set[Tuple[int, ...]] = set()
    for prompt, out in outs:
        seq = prompt + out["output_ids"][:-1]
        for k in range(1, len(seq) // PAGE + 1):
            pages.add(tuple(seq[: k * PAGE]))
    return len(pages) * PAGE


# Both servers retract on upstream's test schedule (every RETRACT_INTERVAL decode steps of a batch of
# several requests), the same steps in both: a retracted request's pages go to the tree, and it
# resumes from its cached prefix.
RETRACT_INTERVAL = 10
RETRACT = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_INTERVAL)}


def serve(args: List[str], log_path, on: bool) -> Dict:
    server = TinyServer(COMMON + args, log_path, RETRACT)
    with started(server):
        return workload(server, on)


@pytest.fixture(scope="module")
def off(tmp_path_factory) -> Dict:
    return serve([], tmp_path_factory.mktemp("radix") / "off.log", on=False)


@pytest.fixture(scope="module")
def on(tmp_path_factory, off) -> Dict:  # after the flag-off server has stopped
    return serve(OFFLOAD, tmp_path_factory.mktemp("radix") / "on.log", on=True)


def test_greedy_tokens_and_cached_tokens_equal_flag_off(off, on):
    assert len(off["outs"]) == len(on["outs"])
    for i, ((p, a), (_, b)) in enumerate(zip(off["outs"], on["outs"])):
        assert a["output_ids"] == b["output_ids"], f"request {i} ({len(p)} tokens) differs"
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"], i
    retractions = [sum(o["meta_info"]["num_retractions"] for _, o in r["outs"]) for r in (off, on)]
    assert retractions[0] == retractions[1] > 0, retractions
    cached = [o["meta_info"]["cached_tokens"] for _, o in on["outs"]]
    # turns 2 and 3 reuse the previous turn, every question reuses the document
    assert cached[0] == 0 and all(c > 0 for c in cached[1:3]), cached
    assert all(c >= len(DOC) // PAGE * PAGE for c in cached[4:]), cached


def test_prefix_pages_live_once_on_the_host_and_never_in_gpu_rows(on):
    state = on["before_flush"]
    assert state["shared_prefix_tokens"] > 0 and state["loaded"] > 0, state
    assert state["release_drains"] > 0 and state["restored_prefix_tokens"] > 0, state
    for what, host, logical, physical, tree in on["checks"]:
        # the tree's tokens hold one logical loc and one host slot each, and no GPU KV row
        tree = host if tree is None else tree  # after the abort: what the tree kept of it
        assert (host, logical, physical) == (tree, tree, 0), (what, host, logical, physical, tree)
    grown = [b[1] - a[1] for a, b in zip(on["checks"], on["checks"][1:])]
    assert all(g >= 0 for g in grown) and on["checks"][-1][1] < sum(
        len(p) + NEW for p, _ in on["outs"]
    ), grown


def test_flush_cache_returns_every_free_count(on):
    state = on["after_flush"]
    assert state["free"] == state["initial_free"], state
    assert state["error_flags"] == 0


# ---------------------------------------------------------------------- PD decode radix cache
# ``--disaggregation-decode-enable-radix-cache``: the decode server matches each prompt against
# its own tree and the prefill server sends only the rest. Pairs run one after the other (flag off,
# flag on with the prompt staged in GPU rows, flag on with ``pd_direct_to_host``), each request
# alone, so every pair runs the same batches.
PD_DECODE = ["--disaggregation-decode-enable-radix-cache"]


def pd_workload(pair: PDPair, on: bool) -> Dict:
    outs: List[Tuple[List[int], Dict]] = []
    checks: List[Tuple] = []
    decode = pair.decode

    def run(prompt: List[int]) -> None:
        out = decode_generate(pair.url, prompt)
        outs.append((prompt, out))
        if on:
            state = decode.wait_settled()
            free, start = state["free"], state["initial_free"]
            used = tuple(start[k] - free[k] for k in ("host", "logical", "physical"))
            checks.append((len(outs), *used, tree_tokens(outs)))

    turn = text(200, 0)
    for k in range(3):
        run(turn)
        turn = turn + outs[-1][1]["output_ids"] + text(70, 100 + k)
    for q in QUESTIONS[:3]:
        run(DOC + q)
    return flushed(decode, {"outs": outs, "checks": checks}, on)


def decode_generate(url: str, prompt: List[int]) -> Dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
    }
    out = requests.post(url + "/generate", json=body, timeout=600).json()
    assert "output_ids" in out, out
    return out


@pytest.fixture(scope="module")
def pd_runs(tmp_path_factory) -> Dict[str, Dict]:
    logs = tmp_path_factory.mktemp("pd_radix")
    common = [a for a in COMMON if a != "--tiny-radix-cache"]  # the prefill side keeps none
    runs = {}
    for name, extra in (
        ("off", []),
        ("staged", OFFLOAD),
        (
            "direct",
            OFFLOAD[:-1] + [json.dumps({"sparse_slots_per_req": SLOTS, "pd_direct_to_host": True})],
        ),
    ):
        pair = PDPair(common, PD_DECODE + extra, logs / name)
        with started(pair):
            runs[name] = pd_workload(pair, on=name != "off")
    return runs


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_pd_decode_prefix_cache_tokens_and_cached_tokens_equal_flag_off(pd_runs, mode):
    off, on = pd_runs["off"], pd_runs[mode]
    for i, ((p, a), (_, b)) in enumerate(zip(off["outs"], on["outs"])):
        assert a["output_ids"] == b["output_ids"], f"{mode}: request {i} ({len(p)} tokens) differs"
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"], (mode, i)
    cached = [o["meta_info"]["cached_tokens"] for _, o in on["outs"]]
    # turns 2 and 3 reuse the previous turn; the first question caches the document, the others
    # reuse it
    assert cached[0] == cached[3] == 0 and cached[1] > 0 and cached[2] > 0, cached
    assert all(c >= len(DOC) // PAGE * PAGE for c in cached[4:]), cached
    state = on["before_flush"]
    # the decode side's prefix hits are exactly what upstream reports as cached
    assert state["shared_prefix_tokens"] == sum(cached), (state, cached)
    if mode == "direct":
        assert state["admitted_from_host"] == len(on["outs"]), state


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_pd_decode_prefix_pages_live_once_on_the_host_and_all_come_back(pd_runs, mode):
    on = pd_runs[mode]
    for n, host, logical, physical, tree in on["checks"]:
        assert (host, logical, physical) == (tree, tree, 0), (mode, n, host, logical, physical)
    state = on["after_flush"]
    assert state["free"] == state["initial_free"] and state["error_flags"] == 0, state
