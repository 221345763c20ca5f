#!/usr/bin/env python3
"""Agent sessions on a DeepSeek-V3.2-shaped server: no flag vs ``--enable-kv-offload`` vs HiSparse.

One command on the lent GPU machine (after ``source scripts/gpu_env.sh``)::

    python3 benchmark/kv_offload/bench_agent.py --out results.json --servers off,offload,hisparse \\
        --model dsv32 --layers 4 --sessions 4 --turns 3 --first-len 32768 --system-len 4096 \\
        --tool-len 2048 --output-len 256 --think-s 1 --max-total-tokens 81920 \\
        --offload-config '{"sparse_slots_per_req": 4096}' --fast-standins --topk-churn 0.4

What it models: the long contexts DeepSeek-V3.2 serves are mostly agent sessions. A session opens
with a long first turn (a system prompt shared by every session, then its own tools and
documents: ``--first-len`` tokens in all, ``--system-len`` of them shared), then each later turn
appends the model's answer and a tool result (``--tool-len`` tokens) to the history and asks again
(``--output-len`` new tokens, greedy, ``ignore_eos``), after a think time (``--think-s``, seeded
jitter of +-50 %). The client is a real one: SGLang's ``POST /generate`` with the session's whole
history as ``input_ids``, streamed, every session its own coroutine (asyncio + aiohttp), all
sessions of a point in flight at once (``--in-flight`` caps them).

For each server in turn it starts the REAL ``python -m sglang.launch_server`` through the serving
harness (``bench_serving_dsa.launch``: the same flags, stand-ins and ``--max-total-tokens`` for
all; upstream's radix cache on for the no-flag and the kv offload server; HiSparse 0.5.23 rejects
the radix cache, so it re-prefills every turn's whole history), and for each point (a number of
sessions, ``--sessions 4,8``; the cache flushed before each) records:

* TTFT p50 / p99 per turn index, over first turns and over returning turns (client side: time to
  the first streamed token);
* output tokens/s (completion tokens of the point / its wall time);
* prefill tokens computed vs served from the cache (``meta_info.cached_tokens`` of every turn; the
  server's ``/metrics`` counters must say the same: ``counters``);
* returning turns: cached tokens against the session's previous history (the page-aligned prompt +
  answer a full hit would reuse), the number of full hits, and ``sessions_held``: sessions whose
  every returning turn found its whole history cached;
* the decode batch sizes (peak and mean running requests, from the server's log), the KV token
  capacity (``max_total_num_tokens``) and, with the flag, the offload state (host rows the tree
  holds, prefix tokens restored, rows loaded).

``--overflow-session`` then runs one more session whose tool results grow its history past the
context length: upstream answers that turn with its context-length error, and after
``/flush_cache`` every free count of the flag-on server is back at its start (the session's cached
pages freed). Results (``--out``) are rewritten after every server, so a run cut short keeps what it
got; the servers' logs lie next to it. Each server, once started, gets an equal share of what is
left of ``--deadline-s``; where
one call cannot run all three, run one server per call (same workload) and join the files with
``--merge``. The summary gives per point and server the headline numbers, and the flag's
returning-turn cached tokens over the no-flag server's (``returning_cached_ratio``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import re
import statistics
import sys
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import PAGE, read_results, results_json  # noqa: E402
from bench_serving_dsa import (  # noqa: E402
    add_server_options,
    launch,
    report_head,
    run_servers,
    running_stats,
    wait_started,
)
from soak import idle_problems  # noqa: E402
from tiny_server_proc import BenchServer, http, wait_until  # noqa: E402

FIRST_TOKEN, LAST_TOKEN = 2, 500  # random prompt ids: past <s>/</s>, inside the tiny tokenizer
STREAM_BUFSIZE = 16 * 1024**2  # one streamed chunk carries every output id so far
REQUEST_TIMEOUT_S = 900  # between two chunks of one stream
# Upstream's two context-length errors (tokenizer manager): the prompt alone, prompt + new tokens.
logger = logging.getLogger("bench_agent")
CONTEXT_ERRORS = ("longer than the model's context length", "exceeds the model's maximum context")


# ------------------------------------------------------------------------------------------------
# workload
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The sessions' shape; every token id and think time follows from ``seed`` and the session's
    and turn's indices, so every server gets the same sessions."""

    turns: int
    first_len: int
    system_len: int
    tool_len: int
    output_len: int
    think_s: float = 0.0
    seed: int = 1

    def ids(self, n: int, key: str) -> List[int]:
        rng = random.Random(f"{self.seed}/{key}")
        return [rng.randrange(FIRST_TOKEN, LAST_TOKEN) for _ in range(n)]

    def first_prompt(self, session: int) -> List[int]:
        """The shared system prompt, then the session's own tools and documents."""
        own = self.first_len - self.system_len
        return self.ids(self.system_len, "system") + self.ids(own, f"first/{session}")

    def tool_result(self, session: int, turn: int) -> List[int]:
        return self.ids(self.tool_len, f"tool/{session}/{turn}")

    def think(self, session: int, turn: int) -> float:
        """Seconds between an answer and the session's next turn: ``think_s`` +-50 %."""
        return self.think_s * random.Random(f"{self.seed}/think/{session}/{turn}").uniform(0.5, 1.5)

    def context_length(self) -> int:
        """The longest history and its answer, plus a page of margin."""
        return self.first_len + self.turns * self.output_len + (self.turns - 1) * self.tool_len + 64


@dataclass
class Turn:
    """One turn as the client saw it: answered, or refused with upstream's error."""

    session: int
    turn: int
    prompt_len: int
    history_len: int  # what a full hit reuses: the previous turn's (see history_len), 0 at turn 0
    sent_s: float
    ttft_s: Optional[float] = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spec_accept_length: Optional[float] = None  # with speculative decoding: tokens per verify
    error: Optional[str] = None
    output_ids: List[int] = field(default_factory=list, repr=False)

    def row(self) -> List[Any]:
        """The turn's numbers in ``TURN_COLUMNS`` order, seconds to the ms (the results file
        keeps no tokens)."""
        values = (getattr(self, c) for c in TURN_COLUMNS)
        return [round(v, 3) if isinstance(v, float) else v for v in values]


# A point's turns in the results file: one row of these per turn, in send order.
TURN_COLUMNS = (
    "session",
    "turn",
    "prompt_len",
    "history_len",
    "sent_s",
    "ttft_s",
    "latency_s",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "spec_accept_length",
    "error",
)


@dataclass
class SessionsRun:
    """Every turn sent (in send order), the prompt each was sent, and the wall time."""

    turns: List[Turn]
    prompts: Dict[Tuple[int, int], List[int]]
    wall_s: float

    def answered(self) -> List[Turn]:
        return [t for t in self.turns if t.error is None]


def history_len(prompt: Sequence[int], output: Sequence[int]) -> int:
    """Tokens a full hit on this turn reuses next turn: the whole pages of its prompt and of every
    output token but the last (whose KV is never computed)."""
    return (len(prompt) + len(output) - 1) // PAGE * PAGE


def page_tokens(run: SessionsRun) -> int:
    """Tokens a radix tree that evicted nothing holds after ``run``: the distinct whole pages of
    every answered turn's prompt and output but the last token (pages named by chained hashes)."""
    pages = set()
    for t in run.answered():
        seq = run.prompts[(t.session, t.turn)] + t.output_ids[:-1]
        h = 0
        for k in range(len(seq) // PAGE):
            h = hash((h, tuple(seq[k * PAGE : (k + 1) * PAGE])))
            pages.add(h)
    return len(pages) * PAGE


# ------------------------------------------------------------------------------------------------
# client
# ------------------------------------------------------------------------------------------------
async def generate(
    client: aiohttp.ClientSession, url: str, turn: Turn, input_ids: List[int], max_new_tokens: int
) -> None:
    """Stream one ``/generate`` of ``input_ids`` and fill in ``turn``: TTFT, output ids and the
    final chunk's counts, or the error upstream answered with (an HTTP error, or an ``error``
    chunk: a streamed request refused after its 200)."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    last: Optional[Dict[str, Any]] = None
    async with client.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            turn.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
        else:
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    turn.error = str(chunk["error"].get("message", chunk["error"]))
                elif chunk.get("output_ids"):
                    turn.ttft_s = turn.ttft_s or time.perf_counter() - t0
                    last = chunk
    turn.latency_s = time.perf_counter() - t0
    if last is None:
        turn.error = turn.error or "the stream ended without a token"
        return
    meta = last["meta_info"]
    turn.prompt_tokens = meta["prompt_tokens"]
    turn.cached_tokens = meta.get("cached_tokens") or 0
    turn.completion_tokens = meta["completion_tokens"]
    turn.spec_accept_length = meta.get("spec_accept_length")
    turn.output_ids = list(last["output_ids"])
    if turn.error is None and len(turn.output_ids) != max_new_tokens:
        turn.error = f"{len(turn.output_ids)} output ids streamed, {max_new_tokens} asked"


async def run_session(
    client: aiohttp.ClientSession, url: str, w: Workload, session: int, t0: float, run: SessionsRun
) -> None:
    """One session's turns in order, until one is refused: each prompt is the previous one, its
    answer and a tool result; ``w.think`` seconds between an answer and the next turn."""
    prompt = w.first_prompt(session)
    answered: Optional[Turn] = None
    for k in range(w.turns):
        hist = 0
        if answered is not None:
            hist = history_len(prompt, answered.output_ids)
            prompt = prompt + answered.output_ids + w.tool_result(session, k)
            await asyncio.sleep(w.think(session, k))
        turn = Turn(session, k, len(prompt), hist, sent_s=time.perf_counter() - t0)
        run.turns.append(turn)
        run.prompts[(session, k)] = prompt
        await generate(client, url, turn, prompt, w.output_len)
        if turn.error is not None:
            return
        answered = turn


async def _run_sessions(url: str, w: Workload, sessions: Sequence[int], in_flight: int):
    gate = asyncio.Semaphore(in_flight or len(sessions))
    run = SessionsRun(turns=[], prompts={}, wall_s=0.0)
    t0 = time.perf_counter()

    async def one(client: aiohttp.ClientSession, session: int) -> None:
        async with gate:
            await run_session(client, url, w, session, t0, run)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=STREAM_BUFSIZE) as client:
        await asyncio.gather(*(one(client, s) for s in sessions))
    run.wall_s = time.perf_counter() - t0
    return run


def run_sessions(url: str, w: Workload, sessions: Sequence[int], in_flight: int = 0) -> SessionsRun:
    """Run ``sessions`` (their indices) against the server at ``url``, at most ``in_flight`` at a
    time (0: all at once; 1: one after another, in the order given, so that two servers see the
    same requests in the same order, each alone)."""
    return asyncio.run(_run_sessions(url, w, sessions, in_flight))


# ------------------------------------------------------------------------------------------------
# what a run shows
# ------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (the value below which ``q`` of the values lie); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ttft_ms(turns: Sequence[Turn]) -> Dict[str, Any]:
    values = [1000 * t.ttft_s for t in turns if t.ttft_s is not None]
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    return {
        "n": len(values),
        "p50": None if p50 is None else round(p50, 1),
        "p99": None if p99 is None else round(p99, 1),
    }


def summarize(run: SessionsRun, turns: int) -> Dict[str, Any]:
    """The client-side numbers of one point (see the module docstring)."""
    ok = run.answered()
    back = [t for t in ok if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    out_tokens = sum(t.completion_tokens for t in ok)
    sessions = sorted({t.session for t in run.turns})
    held = [
        s
        for s in sessions
        if all(
            t.error is None and t.cached_tokens >= t.history_len
            for t in run.turns
            if t.session == s
        )
    ]
    final = {t.session: t.prompt_len + t.completion_tokens for t in ok}
    return {
        "sessions": len(sessions),
        "turns_sent": len(run.turns),
        "turns_answered": len(ok),
        "errors": sorted({t.error for t in run.turns if t.error})[:5],
        "wall_s": round(run.wall_s, 2),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / run.wall_s, 2) if run.wall_s else None,
        "ttft_ms": {
            "all": ttft_ms(ok),
            "first_turns": ttft_ms([t for t in ok if t.turn == 0]),
            "returning": ttft_ms(back),
            "by_turn": [ttft_ms([t for t in ok if t.turn == k]) for k in range(turns)],
        },
        "prefill": {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "cached_share": round(cached / prompt, 4) if prompt else None,
        },
        "returning": {
            "turns": len(back),
            "cached_mean": round(statistics.fmean(t.cached_tokens for t in back), 1) if back else 0,
            "history_mean": round(statistics.fmean(t.history_len for t in back), 1) if back else 0,
            "full_hits": sum(t.cached_tokens >= t.history_len for t in back),
        },
        "sessions_held": len(held),
        "final_history_mean": round(statistics.fmean(final.values()), 1) if final else 0,
        "page_tokens": page_tokens(run),
    }


# ------------------------------------------------------------------------------------------------
# server side
# ------------------------------------------------------------------------------------------------
COUNTER_RE = re.compile(r"^sglang:(prompt_tokens_total|cached_tokens_total)\{[^}]*\} (\S+)$", re.M)


def token_counters(url: str) -> Dict[str, float]:
    """Upstream's ``/metrics`` prompt and cached token counters (``--enable-metrics``), summed over
    their labels."""
    text = http("GET", url + "/metrics", timeout=60)
    out = {"prompt_tokens_total": 0.0, "cached_tokens_total": 0.0}
    for name, value in COUNTER_RE.findall(text):
        out[name] += float(value)
    return out


def offload_state(url: str) -> Optional[Dict[str, Any]]:
    """``internal_states[0]["kv_offload"]`` of ``/server_info`` (None without the flag)."""
    info = http("GET", url + "/server_info", timeout=60)
    return (info.get("internal_states") or [{}])[0].get("kv_offload")


def flush(url: str) -> Optional[Dict[str, Any]]:
    """``POST /flush_cache`` (waiting for the server to go idle), then, with the flag, wait until
    every free count is back at its start; returns that offload state (None without the flag)."""
    for _ in range(10):
        try:
            http("POST", url + "/flush_cache?timeout=60", timeout=90)
            break
        except urllib.error.HTTPError:
            time.sleep(1.0)  # requests still running or waiting
    else:
        raise TimeoutError("/flush_cache refused 10 times: the server never went idle")
    if offload_state(url) is None:
        return None
    try:
        wait_until(lambda: not idle_problems(offload_state(url)), "free counts back", 60, 0.5)
    except AssertionError:
        pass  # reported with the state
    return offload_state(url)


def used(state: Dict[str, Any]) -> Dict[str, int]:
    """Host slots, logical locs and physical rows in use (start minus free)."""
    return {k: state["initial_free"][k] - state["free"][k] for k in ("host", "logical", "physical")}


OFFLOAD_COUNTERS = (
    "shared_prefix_tokens",
    "restored_prefix_tokens",
    "selected",
    "hits",
    "loaded",
    "prefill_waits",
    "admitted",
    "released",
)


def counters_after(url: str, before: Dict[str, float], summary: Dict[str, Any]) -> Dict[str, Any]:
    """The server's token counters over a point against the client's sums (equal once the
    tokenizer has counted every finished request: polled for up to 10 s)."""
    want = {
        "prompt_tokens_total": summary["prefill"]["prompt_tokens"],
        "cached_tokens_total": summary["prefill"]["cached_tokens"],
    }
    got: Dict[str, float] = {}
    for _ in range(20):
        now = token_counters(url)
        got = {k: int(now[k] - before[k]) for k in want}
        if got == want:
            break
        time.sleep(0.5)
    return {"client": want, "server": got, "equal": got == want}


def run_point(server: BenchServer, w: Workload, sessions: int, in_flight: int) -> Dict[str, Any]:
    """One point: the cache flushed, ``sessions`` sessions, then the server's view of them."""
    url = server.url
    start = flush(url)
    before = token_counters(url)
    since = len(server.log_text())
    run = run_sessions(url, w, range(sessions), in_flight)
    point = {"sessions": sessions, **summarize(run, w.turns)}
    state = server.wait_settled()
    point["counters"] = counters_after(url, before, point)
    point.update(running_stats(server.log_text(), since))
    if state is not None:
        point["kv_offload"] = {
            "used": used(state),
            **{k: state[k] - start[k] for k in OFFLOAD_COUNTERS},
        }
    point["turns"] = {"columns": list(TURN_COLUMNS), "rows": [t.row() for t in run.turns]}
    return point


def run_overflow(
    server: BenchServer, w: Workload, context_length: int, session: int
) -> Dict[str, Any]:
    """A session whose tool results (half the context each) outgrow the context length: the turn
    that does is refused with upstream's error; the pages of the turns before stay cached until the
    flush (checked by the caller)."""
    url = server.url
    flush(url)
    step = max(w.tool_len, context_length // 2)
    grow = Workload(
        turns=context_length // step + 2,
        first_len=w.first_len,
        system_len=w.system_len,
        tool_len=step,
        output_len=w.output_len,
        seed=w.seed,
    )
    run = run_sessions(url, grow, [session], in_flight=1)
    refused = run.turns[-1]
    out: Dict[str, Any] = {
        "context_length": context_length,
        "tool_len": step,
        "turns_answered": len(run.answered()),
        "refused_prompt_len": refused.prompt_len if refused.error else None,
        "error": refused.error,
        "upstream_error": any(e in (refused.error or "") for e in CONTEXT_ERRORS),
        "page_tokens": page_tokens(run),
    }
    state = server.wait_settled()
    if state is not None:
        out["used"] = used(state)
    return out


def run_server(
    kind: str, a: argparse.Namespace, w: Workload, out_dir: Path, points_end: Callable[[], float]
) -> Dict[str, Any]:
    server, res = launch(kind, a, out_dir, radix_cache=True)
    res.update(radix_cache=kind != "hisparse", points=[])
    try:
        wait_started(server, res, a)
        deadline = points_end()
        for n in a.sessions:
            if time.time() > deadline - a.point_reserve_s:
                res["points"].append({"sessions": n, "skipped": "deadline"})
                continue
            point = run_point(server, w, n, a.in_flight)
            res["points"].append(point)
            brief = {k: v for k, v in point.items() if k != "turns"}
            logger.info("%s sessions=%d: %s", kind, n, json.dumps(brief)[:800])
        if a.overflow_session:
            res["overflow"] = run_overflow(server, w, a.context_length, max(a.sessions))
        res["after_flush"] = flush(server.url)
        res["leak_problems"] = (
            [] if res["after_flush"] is None else idle_problems(res["after_flush"])
        )
        res["ok"] = not res["leak_problems"] and all(
            p.get("turns_answered") == p["sessions"] * w.turns for p in res["points"]
        )
    except (RuntimeError, TimeoutError, OSError, ValueError, aiohttp.ClientError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
        if not res["ok"]:
            res["log_tail"] = server.log_text()[-3000:]
    return res


def summary_table(report: Dict[str, Any]) -> Dict[str, Any]:
    """Per point (sessions), per server, the headline numbers; and the flag's returning-turn cached
    tokens over the no-flag server's (``returning_cached_ratio``)."""
    out: Dict[str, Any] = {}
    for server in report["servers"]:
        for p in server["points"]:
            if "skipped" in p:
                continue
            row = out.setdefault(str(p["sessions"]), {})
            row[server["kind"]] = {
                "ttft_returning_p50_ms": p["ttft_ms"]["returning"]["p50"],
                "ttft_returning_p99_ms": p["ttft_ms"]["returning"]["p99"],
                "ttft_first_p50_ms": p["ttft_ms"]["first_turns"]["p50"],
                "output_tokens_per_s": p["output_tokens_per_s"],
                "computed_tokens": p["prefill"]["computed_tokens"],
                "cached_tokens": p["prefill"]["cached_tokens"],
                "returning_cached_mean": p["returning"]["cached_mean"],
                "returning_history_mean": p["returning"]["history_mean"],
                "sessions_held": p["sessions_held"],
                # sessions of this point's final length the KV token budget could hold
                "capacity_sessions": round(
                    server["max_total_num_tokens"] / p["final_history_mean"], 1
                ),
                "peak_running": p["peak_running"],
            }
    for row in out.values():
        if "off" in row and "offload" in row and row["off"]["returning_cached_mean"]:
            ratio = row["offload"]["returning_cached_mean"] / row["off"]["returning_cached_mean"]
            row["returning_cached_ratio"] = round(ratio, 2)
    return out


def merge(paths: Sequence[str], out_path: Path) -> Dict[str, Any]:
    """One report of the servers of ``paths`` (each a run of this benchmark with the same workload,
    e.g. one server per call where one call cannot run all three), with their summary."""
    reports = [read_results(path) for path in paths]
    workloads = {json.dumps(r["workload"], sort_keys=True) for r in reports}
    if len(workloads) > 1:
        raise SystemExit(f"--merge: the files ran different workloads: {sorted(workloads)}")
    report = {**reports[0], "merged_from": [r["command"] for r in reports]}
    report["servers"] = [s for r in reports for s in r["servers"]]
    report["summary"] = summary_table(report)
    out_path.write_text(results_json(report))
    return report


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench_agent.json")
    p.add_argument("--sessions", default="8", help="points: sessions per point, comma list")
    p.add_argument("--in-flight", type=int, default=0, help="sessions at once; 0: all")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=32768)
    p.add_argument("--system-len", type=int, default=4096, help="shared by every session")
    p.add_argument("--tool-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--context-length", type=int, default=0, help="0: the longest session's")
    p.add_argument("--overflow-session", action="store_true")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: write to --out these results files' servers as one report (runs of "
        "the same command, one server each), with their summary",
    )
    add_server_options(p, layers=4, max_running=0)  # 0: the most sessions in flight
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if a.merge:
        return merge(a.merge, Path(a.out))
    a.sessions = [int(n) for n in a.sessions.split(",") if n]
    w = Workload(
        turns=a.turns,
        first_len=a.first_len,
        system_len=a.system_len,
        tool_len=a.tool_len,
        output_len=a.output_len,
        think_s=a.think_s,
        seed=a.seed,
    )
    a.context_length = a.context_length or w.context_length()
    a.max_running = a.max_running or a.in_flight or max(a.sessions)
    a.extra_server_args = ["--enable-metrics"] + a.extra_server_args
    out_path = Path(a.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {
        **report_head(a, argv),
        "workload": {
            **asdict(w),
            "sessions": a.sessions,
            "in_flight": a.in_flight,
            "context_length": a.context_length,
            "max_total_tokens": a.max_total_tokens,
            "decode_topk": f"replay, churn {a.topk_churn}" if a.topk_churn else "random weights",
        },
    }
    run_servers(
        a,
        report,
        out_path,
        lambda kind, points_end: run_server(kind, a, w, out_path.parent, points_end),
    )
    report["summary"] = summary_table(report)
    out_path.write_text(results_json(report))
    logger.info("summary: %s", json.dumps(report["summary"]))
    return report


if __name__ == "__main__":
    main()
