#!/usr/bin/env python3
"""Soak: hostile traffic on the real tiny server with ``--enable-kv-offload`` (issue #42).

``python3 benchmark/kv_offload/soak.py --duration-s 600 --seed 0 --mode both --out soak.json``

Against (a) one real server with the flag and (b) a PD pair with the flag on the decode server
(``scripts/tiny_server.py`` / ``scripts/tiny_pd.py``, fp8 KV as the guide's recipes;
``--duration-s`` is split between the modes),
it sends windows of seeded random traffic: prompts from a few tokens to the context limit,
streaming and not, client aborts racing finishes, mid-stream and mid-request disconnects, bursts
(one call of ``BURST`` prompts; every server retracts on upstream's ``SGLANG_TEST_RETRACT``
schedule, as the retraction tests do), malformed and oversized requests. One fault per window:
the server or the decode server killed (SIGKILL) and restarted under load; on the pair also a
failed transfer (``KV_OFFLOAD_TEST_FAIL_TRANSFER_FILE``), a stalled one (the prefill server
SIGSTOPped mid-transfer) and the prefill server killed mid-transfer and restarted (once the decode
server has dropped it: see ``LOST_PREFILL``).

Checked after every window, once the traffic has drained: a fixed greedy probe (sent alone) gives
the tokens it gave first; two prompts sent together decode for two retraction intervals and are
retracted (so every window meets a retraction, whatever the traffic's luck); every request got a
response or an error with a message (a 4xx for malformed ones, a 5xx or no answer only while a
fault was active); every free count of ``/server_info`` is back at its start, nothing promised, no
backup pending, the error flags 0; bytes loaded = rows loaded x the fp8 KV row (656 B), and the
Prometheus counters say the same. At the end: no process of ours alive and no ``/dev/shm`` file
named after one.

Writes a JSON summary (requests served and errors by kind, faults, retractions, checks passed and
failed) and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil
import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "scripts")]
import tiny_server  # noqa: E402
from bench_common import git_commit, results_json  # noqa: E402
from tiny_pd import PDPair  # noqa: E402
from tiny_server import FP8_KV, FP8_ROW  # noqa: E402
from tiny_server_proc import TinyServer, wait_until  # noqa: E402

logger = logging.getLogger("soak")

MODEL = json.loads(tiny_server.MODEL_CONFIG.read_text())
# fp8 KV, as the guide's recipes: one 656 B row per token and layer.
ROW_BYTES = FP8_ROW
CONTEXT = 1024
PD_CONTEXT = 2048  # long prompts span 8 chunks: time to fail, stall or kill their transfer
CHUNK = 256
RUNNING = 8
BURST = RUNNING
COMMON = FP8_KV + [
    "--json-model-override-args", json.dumps({"index_topk": 64}),
    "--chunked-prefill-size", str(CHUNK),
    "--max-running-requests", str(RUNNING),
]  # fmt: skip
# As test_real_server's ON server: a quarter of the GPU budget (eviction and reload at most steps),
# metrics.
SERVER_ARGS = COMMON + ["--context-length", str(CONTEXT), "--max-total-tokens", "4096"]
OFFLOAD = {"sparse_slots_per_req": 128}
SERVER_OFFLOAD = OFFLOAD
PD_OFFLOAD = {**OFFLOAD, "pd_direct_to_host": True}
RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "20"}
WORKERS = 4
REQUEST_TIMEOUT_S = 300
IDLE_TIMEOUT_S = 120
START_TIMEOUT_S = 600  # a start on 2 busy cores can take minutes
STALL_S = 4  # below upstream's PD heartbeat timeout (2 misses of 5 s): the transfer resumes
PROBE = [(7 * i + 3) % 500 + 2 for i in range(300)]
PROBE_TOKENS = 16
# Two prompts decoding together for two retraction intervals (their prefill takes a few forwards):
# the forward count passes a multiple of the interval while both run, so one is retracted.
RETRACT_PROBE_TOKENS = 2 * int(RETRACT_ENV["SGLANG_TEST_RETRACT_INTERVAL"])
KINDS = {  # request kind -> weight in the mix
    "generate": 30,
    "stream": 20,
    "abort": 12,
    "disconnect": 12,
    "burst": 6,
    "malformed": 10,
    "oversized": 10,
}
KILLING_FAULTS = {"restart", "restart_decode", "kill_prefill"}
FAILED_EXAMPLES = 20
# kill_prefill restarts the prefill server only once the decode server has dropped it. The decode
# server's heartbeat (upstream's CommonKVManager: a GET of the prefill's bootstrap ``/health`` every
# 5 s, SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE = 2 misses in a row) drops a dead prefill
# server: it fails that server's rooms in flight and forgets its cached bootstrap infos (the rank
# ports of the dead process; ``_handle_node_failure``). A prefill server back on the same bootstrap
# port before that (its bootstrap server listened again 5 s after the SIGKILL: one miss) is never
# noticed, and every request after the restart sends its KV indices to the dead process's port
# (``_setup_bootstrap_infos`` reuses ``connection_pool``); the new prefill server never gets them,
# and the decode server fails the request 300 s later (SGLANG_DISAGGREGATION_WAITING_TIMEOUT, "timed
# out after 300.0s in KVPoll.WaitingForInput"), until the first such timeout drops the cache
# (``invalidate_cached_bootstrap_infos``). Seen in CI: two requests sent right after the restart,
# with no fault active. That gap is upstream's (a prefill replaced behind the same bootstrap
# address: sglang issue #33789), not kv offload's, and excusing it would take a fault span of 300 s
# or more (the checkpoint's probe included). A more tolerant heartbeat would widen the gap; the
# default stays (no heartbeat was ever missed here but at a kill or a stall).
LOST_PREFILL = re.compile(
    r"Lost connection with prefill instance \(bootstrap_addr: [^)]*\), \d+ requests affected"
)
DROP_TIMEOUT_S = 120  # 2 misses take about 10 s


def offload_args(config: Dict) -> List[str]:
    return ["--enable-kv-offload", "--kv-offload-config", json.dumps(config), "--enable-metrics"]


# ---------------------------------------------------------------------- checks (pure)
def retraction_probe(status: Optional[int], out: object) -> Tuple[int, List[str]]:
    """(retractions, problems) of the two-prompt retraction probe's answer: both complete, at
    least one retraction (its tokens depend on where the retraction fell, so they are not
    compared)."""
    if status != 200 or not isinstance(out, list) or len(out) != 2:
        return 0, [f"retraction probe got HTTP {status}: {str(out)[:300]}"]
    lengths = [len(o.get("output_ids", [])) for o in out]
    retracted = sum(o.get("meta_info", {}).get("num_retractions", 0) for o in out)
    problems = [f"retraction probe gave {lengths} tokens, not {RETRACT_PROBE_TOKENS} each"]
    if lengths == [RETRACT_PROBE_TOKENS] * 2:
        problems = [] if retracted else ["retraction probe was never retracted"]
    return retracted, problems


def probe_problems(reference: Sequence[int], got: Sequence[int]) -> List[str]:
    if list(got) == list(reference):
        return []
    return [f"probe tokens changed: {list(got)} (first run gave {list(reference)})"]


def idle_problems(state: Dict) -> List[str]:
    """What is wrong with the offload state of an idle server (an empty list: nothing)."""
    out = []
    if state["free"] != state["initial_free"]:
        out.append(f"free counts {state['free']} not back at start {state['initial_free']}")
    for key in ("requests", "promised", "backups_in_flight", "host_pending_free", "error_flags"):
        if state[key] != 0:
            out.append(f"{key} is {state[key]} once idle, not 0")
    return out


def metrics_problems(state: Dict, prometheus: str, layers: int = MODEL["num_hidden_layers"]):
    """Rows x row bytes = bytes loaded; the host pool is tokens x rows x layers; the Prometheus
    counters equal ``/server_info``'s."""
    out = []
    rows, nbytes = state["loaded"], state["loaded_bytes"]
    if rows * ROW_BYTES != nbytes:
        out.append(f"loaded {rows} x {ROW_BYTES} B != loaded_bytes {nbytes}")
    host = state["host_pool"]
    if host["bytes"] != host["tokens"] * ROW_BYTES * layers:
        out.append(f"host pool {host['bytes']} B != {host['tokens']} x {ROW_BYTES} x {layers}")
    for name, key in (("rows_loaded_total", "loaded"), ("bytes_loaded_total", "loaded_bytes")):
        found = re.findall(rf"^sglang:kv_offload_{name}{{[^}}]*}} (\S+)$", prometheus, re.M)
        if [float(v) for v in found] != [float(state[key])]:
            out.append(f"/metrics {name} {found} != /server_info {key} {state[key]}")
    return out


def shorten(message: str, head: int = 60, tail: int = 240) -> str:
    """``message``, or its first ``head`` and last ``tail`` characters when longer: an upstream
    error names the request first and ends with the failure reason."""
    if len(message) <= head + tail + 5:
        return message
    return f"{message[:head]} ... {message[-tail:]}"


def response_problem(kind: str, status: Optional[int], body, expect_tokens: int, fault: str):
    """Why a response breaks the contract (None if it does not). ``status`` None: no response;
    ``fault``: the fault active while the request ran ('' if none)."""
    if kind == "disconnect":
        return None  # the client left; the server's clean-up is checked once idle
    if (status is None or status >= 500) and fault in KILLING_FAULTS:
        return None  # a server was down (the mini load balancer then answers a bare 500)
    if status is None:
        return "no response"
    message = error_message(body)
    if kind in ("malformed", "oversized"):
        if 400 <= status < 500 and message:
            return None
        return (
            f"{kind} request answered HTTP {status} {shorten(repr(body))}, not a 4xx with a message"
        )
    if status != 200 or message:
        if not message:
            return f"HTTP {status} without an error message: {shorten(repr(body))}"
        if not fault and kind != "abort":
            return f"HTTP {status} with no fault active: {shorten(message)}"
        return None
    outs = body if isinstance(body, list) else [body]
    for out in outs:  # a burst's members end one by one
        if error_message(out) and (fault or kind == "abort"):
            continue
        if len(out.get("output_ids", [])) != expect_tokens:
            return f"HTTP 200 with {len(out.get('output_ids', []))} of {expect_tokens} tokens"
    return None


def error_message(body) -> str:
    """The error message of a response body ('' if it carries none)."""
    if not isinstance(body, dict):
        return ""
    if body.get("object") == "error":  # upstream's ErrorResponse
        return str(body.get("message") or "")
    finish = body.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "abort":  # a stream already answered 200 ends with the error here
        return str(finish.get("message") or "aborted")
    err = body.get("error", body.get("detail"))
    return str(err.get("message") or "") if isinstance(err, dict) else str(err or "")


def leftover_shm(pids: Sequence[int], shm_dir: str = "/dev/shm") -> Tuple[List[str], List[str]]:
    """Files in ``shm_dir`` named after one of ``pids``: (kv offload's, upstream's)."""
    ours, theirs = [], []
    names = os.listdir(shm_dir) if os.path.isdir(shm_dir) else []
    for name in names:
        if any(re.search(rf"(^|[-_]){pid}([-_]|$)", name) for pid in pids):
            (ours if name.startswith("sglang-kv-offload-") else theirs).append(name)
    return ours, theirs


# ---------------------------------------------------------------------- bookkeeping
class Tally:
    """Counts and check results of one mode, shared by the worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served: Counter = Counter()
        self.errors: Counter = Counter()
        self.faults: Counter = Counter()
        self.retractions = 0
        self.checks: Dict[str, Dict] = {}
        self.fault_spans: List[List] = []  # [start, end, fault]; end inf while it runs
        self.offload: Counter = Counter()  # offload counters of the server instances killed
        self.last: Dict = {}  # the last idle offload state of the running instance

    def check(self, name: str, problems: List[str]) -> bool:
        with self.lock:
            entry = self.checks.setdefault(name, {"passed": 0, "failed": 0, "failures": []})
            entry["failed" if problems else "passed"] += 1
            entry["failures"] += problems[: FAILED_EXAMPLES - len(entry["failures"])]
        for problem in problems:
            logger.error("check %s failed: %s", name, problem)
        return not problems

    def fault_during(self, start: float, end: float) -> str:
        with self.lock:
            return next((f for s, e, f in self.fault_spans if s <= end and start <= e), "")

    @staticmethod
    def counters(state: Dict) -> Counter:
        keys = ("admitted", "released", "backup_tokens", "prefill_waits", "decode_steps")
        keys += ("selected", "hits", "loaded", "loaded_bytes")
        return Counter({k: state[k] for k in keys if k in state})

    def summary(self) -> Dict:
        return {
            "served": dict(self.served),
            "errors": dict(self.errors),
            "faults": dict(self.faults),
            "retractions": self.retractions,
            "offload": dict(self.offload + self.counters(self.last)),
            "checks": self.checks,
            "ok": all(c["failed"] == 0 for c in self.checks.values()),
        }


# ---------------------------------------------------------------------- targets
class Target:
    """The servers under soak: ``url`` takes the traffic, ``offload`` has the flag."""

    faults: Tuple[Optional[str], ...] = (None,)  # one per window, in turn
    empty_ids = True  # send ``input_ids: []`` among the malformed requests

    def __init__(self) -> None:
        self.pids: Dict[int, float] = {}  # every process of ours seen: pid -> create time

    def servers(self) -> List[TinyServer]:
        raise NotImplementedError

    def procs(self) -> List[subprocess.Popen]:
        return [s.proc for s in self.servers()]

    def abort(self, rid: str) -> None:
        try:
            self.offload.abort(rid)
        except requests.RequestException:
            pass  # the server is down (a fault): the request fails anyway

    def note_pids(self) -> None:
        for proc in self.procs():
            try:
                procs = [psutil.Process(proc.pid)]
                procs += procs[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    self.pids[p.pid] = p.create_time()
                except psutil.NoSuchProcess:
                    pass

    def alive_pids(self) -> List[int]:
        alive = []
        for pid, created in self.pids.items():
            try:
                if psutil.Process(pid).create_time() == created:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


class SingleTarget(Target):
    faults = (None, "restart")

    def __init__(self, log_dir: Path, tp: int) -> None:
        super().__init__()
        args = SERVER_ARGS + offload_args(SERVER_OFFLOAD) + ["--tp", str(tp)]
        env = dict(RETRACT_ENV)
        if tp > 1:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(r % os.cpu_count()) for r in range(tp)
            )
        self.server = TinyServer(args, log_dir / "server.log", env)
        self.url, self.offload, self.context = self.server.url, self.server, CONTEXT

    def servers(self) -> List[TinyServer]:
        return [self.server]

    def start(self) -> None:
        self.server.wait_ready()

    def stop(self) -> None:
        self.server.stop()


class PDTarget(Target):
    faults = ("fail_transfer", "stall_transfer", "restart_decode", "kill_prefill")
    # sglang_router's mini load balancer (a debugging tool) fails on ``input_ids: []`` with a bare
    # 500 (IndexError in mini_lb._get_request_batch_size) before any server sees it.
    empty_ids = False

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.trigger = Path(tempfile.mkdtemp(prefix="kvo-soak-")) / "fail-transfer"
        env = {**RETRACT_ENV, "KV_OFFLOAD_TEST_FAIL_TRANSFER_FILE": str(self.trigger)}
        args = COMMON + ["--context-length", str(PD_CONTEXT)]
        self.pair = PDPair(args, offload_args(PD_OFFLOAD), log_dir, decode_env=env)
        self.offload, self.context = self.pair.decode, PD_CONTEXT

    def servers(self) -> List[TinyServer]:
        return [self.pair.prefill, self.pair.decode]

    def abort(self, rid: str) -> None:
        """To both servers, as a PD router must: aborted at the decode server alone, a request
        the decode server has not sent its KV indices yet may wait at the prefill server for upstream's
        bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s), and the mini load balancer
        answers only when both servers have (the likely cause of the one abort left unanswered
        for 300 s in the 1-hour soak at 37f8ad3, sent during a stalled transfer)."""
        for server in self.servers():
            try:
                server.abort(rid)
            except requests.RequestException:
                pass  # that server is down (a fault)

    def procs(self) -> List[subprocess.Popen]:
        return super().procs() + [self.pair.lb.proc]

    def start(self) -> None:
        self.pair.wait_ready()
        self.url = self.pair.url

    def stop(self) -> None:
        self.pair.stop()
        shutil.rmtree(self.trigger.parent, ignore_errors=True)


# ---------------------------------------------------------------------- traffic
def body(ids, max_new: int, **extra) -> Dict:
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sampling, **extra}


def post(url: str, payload, stream: bool = False, timeout=REQUEST_TIMEOUT_S, chunks: int = 0):
    """(status, body) of one ``/generate`` call; (None, reason) if no response came.

    Streaming: the body is the last chunk; ``chunks`` > 0 closes the connection after that many.
    """
    kwargs = {"data": payload} if isinstance(payload, str) else {"json": payload}
    try:
        with requests.post(url + "/generate", stream=stream, timeout=timeout, **kwargs) as r:
            if not stream or r.status_code != 200:
                try:
                    return r.status_code, r.json()
                except ValueError:
                    return r.status_code, r.text
            last, seen = None, 0
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                last, seen = json.loads(line[5:]), seen + 1
                if chunks and seen >= chunks:
                    return 200, None  # disconnected mid-stream
                if isinstance(last, dict) and "error" in last:
                    break
            return r.status_code, last
    except requests.RequestException as exc:
        return None, type(exc).__name__


def malformed(rng: random.Random, empty_ids: bool = True) -> object:
    ok = [5, 6, 7]
    bad = [
        "{not json",
        {"sampling_params": {"max_new_tokens": 4}},  # neither text nor input_ids
        body(ok, -1),
        {**body(ok, 4), "sampling_params": {"max_new_tokens": 4, "temperature": -1.0}},
        {**body(ok, 4), "sampling_params": {"max_new_tokens": 4, "top_p": 2.0}},
        body(["a", "b"], 4),
    ]
    return rng.choice(bad + ([body([], 4)] if empty_ids else []))


class Traffic:
    """Worker threads sending the seeded mix to ``target`` until ``deadline``."""

    def __init__(self, target: Target, tally: Tally, seed: int) -> None:
        self.target, self.tally, self.seed = target, tally, seed

    def prompt(self, rng: random.Random, max_new: int) -> List[int]:
        longest = self.target.context - max_new
        n = rng.choice([rng.randint(1, 64), rng.randint(64, 512), rng.randint(512, longest)])
        return [rng.randrange(2, 500) for _ in range(n)]

    def one(self, rng: random.Random) -> Optional[int]:
        """Send one request of a random kind and check its answer; returns its HTTP status."""
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        url, max_new = self.target.url, rng.randint(1, 24)
        # Named, so that a failure can be found in the servers' and the load balancer's logs.
        rid = f"soak-{uuid.uuid4().hex}"
        start = time.time()
        if kind == "generate":
            status, out = post(url, body(self.prompt(rng, max_new), max_new, rid=rid))
        elif kind == "stream":
            payload = body(self.prompt(rng, max_new), max_new, rid=rid, stream=True)
            status, out = post(url, payload, True)
        elif kind == "abort":
            timer = threading.Timer(rng.uniform(0.1, 4), self.target.abort, (rid,))
            timer.start()
            status, out = post(url, body(self.prompt(rng, max_new), max_new, rid=rid))
            timer.join()
        elif kind == "disconnect":
            payload = body(self.prompt(rng, max_new), max_new, rid=rid)
            if rng.random() < 0.5:
                status, out = post(url, {**payload, "stream": True}, True, chunks=rng.randint(1, 4))
            else:
                status, out = post(url, payload, timeout=rng.uniform(0.2, 3))
        elif kind == "burst":
            prompts = [self.prompt(rng, max_new) for _ in range(BURST)]
            status, out = post(
                url, body(prompts, max_new, rid=[f"{rid}-{i}" for i in range(BURST)])
            )
        elif kind == "malformed":
            status, out = post(url, malformed(rng, self.target.empty_ids))
        else:  # oversized: a prompt of the context or more, or prompt + max_new past it
            n = rng.randint(1, self.target.context)
            if rng.random() < 0.5:
                n, max_new = n + self.target.context - 1, 4
            else:
                max_new = self.target.context - n + rng.randint(1, 200)
            ids = [rng.randrange(2, 500) for _ in range(n)]
            status, out = post(url, body(ids, max_new, rid=rid))
        end = time.time()
        fault = self.tally.fault_during(start, end)
        problem = response_problem(kind, status, out, max_new, fault)
        sent = time.strftime("%H:%M:%S", time.gmtime(start))
        where = f"{rid} sent {sent} UTC, {end - start:.0f} s"
        self.tally.check("request_answered", [f"{kind} ({where}): {problem}"] if problem else [])
        with self.tally.lock:
            if status == 200 and not error_message(out):
                self.tally.served[kind] += 1
                outs = out if isinstance(out, list) else [out] if isinstance(out, dict) else []
                self.tally.retractions += sum(
                    o.get("meta_info", {}).get("num_retractions", 0) for o in outs
                )
            else:
                reason = f"HTTP {status}" if status is not None else out
                self.tally.errors[f"{kind}: {reason}"] += 1
        return status

    def run(self, window: int, deadline: float) -> List[threading.Thread]:
        def loop(worker: int) -> None:
            rng = random.Random(f"{self.seed}-{window}-{worker}")
            while time.time() < deadline:
                try:
                    if self.one(rng) is None:
                        time.sleep(1)  # no answer: the server may be down (a fault)
                except Exception as exc:  # a driver bug must not pass silently
                    self.tally.check("driver", [f"{type(exc).__name__}: {exc}"])

        threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(WORKERS)]
        for t in threads:
            t.start()
        return threads


# ---------------------------------------------------------------------- faults
def prefill_batches(pair: PDPair) -> int:
    return pair.prefill.log_text().count("Prefill batch")


def prefill_drops(pair: PDPair) -> int:
    """How many times the decode server has dropped a prefill server (its heartbeat)."""
    return len(LOST_PREFILL.findall(pair.decode.log_text()))


def long_prompt_in_flight(target: PDTarget, seed: int) -> Tuple[threading.Thread, Dict]:
    """Send a prompt of several chunks; return once the prefill server has computed one."""
    result: Dict = {}
    rng = random.Random(seed)
    ids = [rng.randrange(2, 500) for _ in range(target.context - CHUNK)]
    before = prefill_batches(target.pair)
    call = threading.Thread(target=lambda: result.update(r=post(target.url, body(ids, 8))))
    call.start()
    wait_until(
        lambda: prefill_batches(target.pair) > before, "the long prompt never started", 120, 0.05
    )
    return call, result


def inject(fault: str, target: Target, tally: Tally, seed: int) -> None:
    """Run one fault; its time span excuses the errors of the requests that overlap it."""
    start = time.time()
    span = [start, float("inf"), fault]
    with tally.lock:
        tally.fault_spans.append(span)  # open until the fault is over
    target.note_pids()
    logger.info("fault: %s", fault)
    problems: List[str] = []
    if fault in ("restart", "restart_decode"):
        server = target.offload
        tally.offload += tally.counters(server.offload_state())
        server.kill()
        server.restart().wait_ready(START_TIMEOUT_S)
    elif fault == "kill_prefill":
        call, result = long_prompt_in_flight(target, seed)
        drops = prefill_drops(target.pair)
        target.pair.prefill.kill()
        call.join(REQUEST_TIMEOUT_S)
        status, out = result["r"]
        if status == 200 and not error_message(out):
            problems.append(f"the prompt in flight when the prefill server died got {out}")
        try:  # see LOST_PREFILL
            wait_until(lambda: prefill_drops(target.pair) > drops, "", DROP_TIMEOUT_S, 0.5)
        except AssertionError:
            problems.append(f"the decode server kept the dead prefill server {DROP_TIMEOUT_S} s")
        target.pair.prefill.restart().wait_ready(START_TIMEOUT_S)
    elif fault == "stall_transfer":
        call, result = long_prompt_in_flight(target, seed)
        os.killpg(target.pair.prefill.proc.pid, signal.SIGSTOP)
        time.sleep(STALL_S)
        os.killpg(target.pair.prefill.proc.pid, signal.SIGCONT)
        call.join(REQUEST_TIMEOUT_S)
        problem = response_problem("generate", *result["r"], 8, "")
        problems += [f"stalled transfer: {problem}"] if problem else []
    elif fault == "fail_transfer":
        target.trigger.touch()
        call, result = long_prompt_in_flight(target, seed)
        call.join(REQUEST_TIMEOUT_S)
        if target.trigger.exists():
            problems.append("no transfer was polled while the failure trigger was armed")
        problem = response_problem("generate", *result["r"], 8, fault)
        problems += [f"failed transfer: {problem}"] if problem else []
    with tally.lock:
        span[1] = time.time()
        tally.faults[fault] += 1
    tally.check(f"fault_{fault}", problems)
    target.note_pids()


# ---------------------------------------------------------------------- checkpoints and runs
def checkpoint(target: Target, tally: Tally, reference: Optional[List[int]]) -> List[int]:
    """Once idle, the probes; then the idle checks: leaks, error flags, metrics. Returns the
    probe's tokens."""
    dead = [s.log_path.name for s in target.servers() if not s.alive()]
    if not tally.check("servers_alive", [f"{name}: server exited" for name in dead]):
        raise RuntimeError(f"a server exited: {dead}")
    server = target.offload
    try:  # requests the traffic abandoned may still run: the probes run alone
        server.wait_no_leak(IDLE_TIMEOUT_S)
    except AssertionError:
        pass  # the idle checks below report what stayed
    status, out = post(target.url, body(PROBE, PROBE_TOKENS))
    tokens = out.get("output_ids", []) if status == 200 and isinstance(out, dict) else []
    tally.check("probe_answered", [] if tokens else [f"probe got HTTP {status}: {out}"])
    if reference is not None and tokens:
        tally.check("probe_tokens", probe_problems(reference, tokens))
    status, out = post(target.url, body([PROBE, PROBE[::-1]], RETRACT_PROBE_TOKENS))
    retracted, problems = retraction_probe(status, out)
    with tally.lock:
        tally.retractions += retracted
    tally.check("probe_retracted", problems)
    try:
        state = server.wait_no_leak(IDLE_TIMEOUT_S)
    except AssertionError:
        state = server.offload_state()
    tally.check("idle_state", idle_problems(state))
    tally.last = state
    deadline, problems = time.time() + 30, []
    while time.time() < deadline:  # the Prometheus counters are refreshed once a second
        problems = metrics_problems(state, requests.get(server.url + "/metrics", timeout=30).text)
        if not problems:
            break
        time.sleep(1)
        state = server.offload_state()
    tally.check("metrics_add_up", problems)
    target.note_pids()
    return tokens


def soak(target: Target, duration_s: float, window_s: float, seed: int) -> Dict:
    """Run ``target`` for ``duration_s`` (start-up included; longer if its faults need more
    windows) and return its summary."""
    tally, t0 = Tally(), time.time()
    try:
        target.start()
        reference = checkpoint(target, tally, None)
        traffic = Traffic(target, tally, seed)
        window = 0
        # Until the time is up, and at least once through the faults.
        while window < len(target.faults) or time.time() - t0 < duration_s - window_s / 2:
            deadline = time.time() + window_s
            threads = traffic.run(window, deadline)
            fault = target.faults[window % len(target.faults)]
            if fault:
                time.sleep(random.Random(f"{seed}-{window}").uniform(0.2, 0.5) * window_s)
                inject(fault, target, tally, seed + window)
            for t in threads:
                t.join()
            checkpoint(target, tally, reference)
            window += 1
    except Exception as exc:  # recorded as a failed check; the servers still stop
        logger.exception("soak stopped early")
        tally.check("completed", [f"{type(exc).__name__}: {exc}"])
    finally:
        target.note_pids()
        target.stop()
    pids = list(target.pids)
    deadline = time.time() + IDLE_TIMEOUT_S
    while (alive := target.alive_pids()) and time.time() < deadline:
        time.sleep(1)  # the children exit after the process group leader
    tally.check("no_process_left", [f"processes of ours still alive: {alive}"] if alive else [])
    ours, theirs = leftover_shm(pids)
    tally.check("no_shm_left", [f"/dev/shm files left: {ours}"] if ours else [])
    summary = tally.summary()
    summary.update(wall_s=round(time.time() - t0, 1), shm_left_by_upstream=theirs)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600, help="total, split between modes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("server", "pd", "both"), default="both")
    ap.add_argument("--out", type=Path, required=True, help="the JSON summary")
    ap.add_argument("--window-s", type=float, default=45, help="traffic between checkpoints")
    ap.add_argument("--server-share", type=float, default=0.6, help="of the time, with both")
    ap.add_argument("--tp", type=int, default=1, help="TP size of the single server")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    modes = ["server", "pd"] if a.mode == "both" else [a.mode]
    shares = {"server": a.server_share, "pd": 1 - a.server_share} if a.mode == "both" else {}
    log_dir = a.out.parent / (a.out.stem + "-logs")
    report = {
        "config": {**vars(a), "out": str(a.out), "commit": git_commit()},
        "modes": {},
    }
    for mode in modes:
        (log_dir / mode).mkdir(parents=True, exist_ok=True)
        target = (
            SingleTarget(log_dir / mode, a.tp) if mode == "server" else PDTarget(log_dir / mode)
        )
        duration = a.duration_s * shares.get(mode, 1.0)
        report["modes"][mode] = soak(target, duration, a.window_s, a.seed)
        a.out.write_text(results_json(report))
    report["ok"] = all(m["ok"] for m in report["modes"].values())
    a.out.write_text(results_json(report))
    logger.info("soak %s: %s", "passed" if report["ok"] else "FAILED", a.out)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
