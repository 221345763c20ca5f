#!/usr/bin/env python3
"""Serving throughput of a DeepSeek-V3.2-shaped server: no flag vs ``--enable-kv-offload`` vs HiSparse.

One command on the lent GPU machine (after ``source scripts/gpu_env.sh production|standins``)::

    python3 benchmark/kv_offload/bench_serving_dsa.py --out results.json \\
        --servers off,offload,hisparse --layers 8 --input-len 32768 --output-len 2048 \\
        --concurrency 1,8,32 [--kernels production|standins]

For each server in turn it starts the REAL ``python -m sglang.launch_server`` (through
``scripts/tiny_server.py``: random weights; ``--kernels production``: FlashMLA, DeepGEMM and 0.5.23's
JIT kernels with the fp8 KV cache, ``standins``: the torch references of
``test/srt/kv_offload/standins``; the ``sgl_kernel`` ones stay stand-ins in both, and the JSON
records the kernel packages and every stand-in that ran) with CUDA graphs and the overlap scheduler on and the
same ``--mem-fraction-static``, drives it with SGLang's own client, ``python -m sglang.bench_serving
--backend sglang --dataset-name random-ids`` (fixed lengths, one seed, so every server gets the same
prompts), once per concurrency, and records what the client reports (output tokens/s, TPOT p50/p99,
TTFT p50) beside what the server logged (decode batch sizes: peak and mean running requests) and
its KV token capacity (``max_total_num_tokens`` of ``GET /server_info``).

``--model dsv32`` overrides the tiny model's shapes with DeepSeek-V3.2's attention and indexer
(hidden 7168, 128 heads, kv_lora_rank 512, rope 64, q_lora_rank 1536, indexer 64 heads x 128,
top-k 2048) and a narrower MoE (``--experts``, each token still runs 8 routed + 1 shared expert
of DeepSeek-V3.2's width), over ``--layers`` layers; ``--model tiny`` keeps the tiny model (CPU CI).

``--pd`` makes each server a PD pair on the CPU tiny model (prefill, decode and SGLang's mini load
balancer; the offload flags on the decode server, whose log and state are reported).

``--profile-concurrency C`` then runs that point's workload once more, unmeasured, and asks the
server (upstream's ``POST /start_profile`` with ``num_steps``) for a torch-profiler trace of
``--profile-steps`` forward steps once its decode batch has held ``--profile-batch`` requests
(default ``C``; ``kind=B`` pairs give each server its own, e.g. the flag-off server's KV-bound
batch) for longer than the client's warm-up request decodes, and reports the GPU kernel time per
step split into kv offload's launches, HiSparse's and the rest, against the wall span of the steps
(:func:`summarize_trace`). The trace's export pauses the server (about a second), so the point's
latencies come from the run before it.

Results (``--out``) are rewritten after every point, so a run cut short keeps what it got; each
server's log and each point's bench_serving output lie next to it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "scripts")]
import tiny_server  # noqa: E402
from bench_common import git_commit, results_json  # noqa: E402
from tiny_pd import PDPair  # noqa: E402
from tiny_server_gpu import SETTLE_S, machine_info, parse_log, step_ms_by_batch  # noqa: E402
from tiny_server_proc import BenchServer as Server  # noqa: E402
from tiny_server_proc import http  # noqa: E402

logger = logging.getLogger("bench_serving_dsa")

# DeepSeek-V3.2's attention and indexer shapes (config.json of deepseek-ai/DeepSeek-V3.2-Exp).
DSV32_SHAPES: Dict[str, Any] = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
}

# Kernels kv offload launches inside a decode step (lru_kernels.py, transfer.py).
OFFLOAD_KERNELS = ("_plan_layer_kernel", "_copy_rows")
# HiSparse 0.5.23's swap-in kernels (JIT kvcacheio) and its Triton helpers.
HISPARSE_KERNELS = ("hisparse", "load_cache_to_device_buffer")


def model_overrides(a: argparse.Namespace) -> Dict[str, Any]:
    over: Dict[str, Any] = {"num_hidden_layers": a.layers}
    if a.model == "dsv32":
        over.update(DSV32_SHAPES)
        over["n_routed_experts"] = a.experts
        over["num_experts_per_tok"] = min(8, a.experts)
    if a.index_topk:
        over["index_topk"] = a.index_topk
    return over


def topk_of(a: argparse.Namespace) -> int:
    return model_overrides(a).get("index_topk", 2048)


def server_args(kind: str, a: argparse.Namespace, radix_cache: bool = False) -> List[str]:
    """The launch flags of one server; everything but the offload flags (:func:`kind_args`) is
    the same for all.

    ``radix_cache`` keeps upstream's prefix cache on (``tiny_server.RADIX_FLAG``) for every kind
    but HiSparse, which 0.5.23 runs only without it.
    """
    args = common_args(a) + kind_args(kind, a)
    if radix_cache and kind != "hisparse":
        args.append(tiny_server.RADIX_FLAG)
    return args + a.extra_server_args


def common_args(a: argparse.Namespace) -> List[str]:
    args = [
        "--context-length", str(a.context_length),
        "--mem-fraction-static", str(a.mem_fraction_static),
        "--max-running-requests", str(a.max_running),
        "--cuda-graph-max-bs-decode", str(a.max_running),
        "--disable-prefill-cuda-graph",  # needs sgl_kernel's weak_ref_tensor (decode graphs stay)
        "--chunked-prefill-size", str(a.chunked_prefill_size),
        "--decode-log-interval", "1",
        "--json-model-override-args", json.dumps(model_overrides(a)),
    ]  # fmt: skip
    if a.max_total_tokens:
        args += ["--max-total-tokens", str(a.max_total_tokens)]
    return args


def kind_args(kind: str, a: argparse.Namespace) -> List[str]:
    """The flags that make a server of ``kind``: none, kv offload's or HiSparse's."""
    if kind == "offload":
        return ["--enable-kv-offload", "--kv-offload-config", json.dumps(a.offload_config)]
    if kind == "hisparse":
        cfg = {"top_k": topk_of(a), "device_buffer_size": 2 * topk_of(a)}
        cfg.update(a.hisparse_config)
        return ["--enable-hisparse", "--hisparse-config", json.dumps(cfg)]
    if kind != "off":
        raise ValueError(f"unknown server kind {kind!r}: off, offload or hisparse")
    return []


def bench_serving_cmd(port: int, tokenizer: str, conc: int, out_file: Path, a) -> List[str]:
    num = max(a.min_prompts, a.prompts_per_concurrency * conc)
    cmd = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang",
        "--host", "127.0.0.1", "--port", str(port),
        "--tokenizer", tokenizer,
        "--dataset-name", "random-ids", "--tokenize-prompt",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", str(a.random_range_ratio),
        "--num-prompts", str(num), "--max-concurrency", str(conc),
        "--seed", str(a.seed), "--output-file", str(out_file),
        "--warmup-requests", "1", "--disable-tqdm",
    ]  # fmt: skip
    return cmd


# bench_serving's warm-up request decodes min(--output-len, 32) tokens, each a decode log line.
WARMUP_DECODE_TOKENS = 32


def profile_batch(a: argparse.Namespace, kind: str, conc: int) -> int:
    """The decode batch at which ``kind``'s profile starts: its ``--profile-batch`` entry, else the
    bare number given, else the concurrency."""
    batch = conc
    for item in filter(None, a.profile_batch.split(",")):
        name, _, value = item.rpartition("=")
        if name in ("", kind):
            batch = int(value)
            if name:
                break
    return max(1, min(batch, conc))


def profile_when_batch(
    server: Server, since: int, batch: int, prof_dir: Path, a, stop: threading.Event
) -> Dict[str, Any]:
    """Watch the log after byte ``since``; once ``batch`` or more requests have been running for
    more decode lines in a row than bench_serving's warm-up request decodes (so neither the warm-up
    nor a prompt's prefill falls in the trace), ask the server for a trace of the next
    ``--profile-steps`` forward steps. Returns (filled in as it happens) the batch that started
    it and the server's answer."""
    started: Dict[str, Any] = {}

    def watch() -> None:
        pos, run = since, 0  # complete lines read so far; decode lines in a row at >= batch
        while not stop.is_set():
            text = server.log_text()
            end = text.rfind("\n", pos) + 1 or pos
            hit = None
            for x in parse_log(text[pos:end])["decode_lines"]:
                run = run + 1 if x["running"] >= batch else 0
                if run > WARMUP_DECODE_TOKENS:
                    hit = x
                    break
            pos = end
            if hit is not None:
                body = {
                    "output_dir": str(prof_dir),
                    "num_steps": a.profile_steps,
                    # GPU only: a small trace, whose export pauses the server. A CPU server
                    # (the tiny model in CI) has no GPU activity to record.
                    "activities": ["GPU"] if a.on_gpu else ["CPU"],
                    "with_stack": False,
                    "record_shapes": False,
                }
                started["running"] = hit["running"]
                started["answer"] = http("POST", server.url + "/start_profile", body, timeout=60)
                return
            stop.wait(0.5)

    threading.Thread(target=watch, daemon=True).start()
    return started


def point_client(
    server: Server,
    kind: str,
    conc: int,
    a: argparse.Namespace,
    out_dir: Path,
    tokenizer: str,
    deadline: float,
    tag: str = "",
) -> Dict[str, Any]:
    """One ``bench_serving`` run of a point against ``server`` (:func:`run_client`), its result
    line in ``bench_{kind}_c{conc}{tag}.jsonl`` and its output in the ``.log`` beside it."""
    out_file = out_dir / f"bench_{kind}_c{conc}{tag}.jsonl"
    out_file.unlink(missing_ok=True)
    return run_client(
        bench_serving_cmd(server.port, tokenizer, conc, out_file, a),
        out_file,
        out_file.with_suffix(".log"),
        max(30.0, deadline - time.time()),
    )


def profile_pass(
    server: Server,
    kind: str,
    conc: int,
    a: argparse.Namespace,
    out_dir: Path,
    tokenizer: str,
    deadline: float,
) -> Dict[str, Any]:
    """The point's workload again (:func:`point_client`), its client output kept apart
    (``..._profile.jsonl``) and not reported, with a trace of ``--profile-steps`` steps once the
    batch has held (:func:`profile_when_batch`). Returns the batch that started it, the server's
    answer and the trace's summary, or ``error``."""
    prof_dir = out_dir / f"profile_{kind}"
    since = len(server.log_text())
    batch = profile_batch(a, kind, conc)
    stop = threading.Event()
    started = profile_when_batch(server, since, batch, prof_dir, a, stop)
    try:
        client = point_client(server, kind, conc, a, out_dir, tokenizer, deadline, "_profile")
    finally:
        stop.set()
    profile: Dict[str, Any] = {"batch": batch, "started": dict(started)}
    if started and wait_for_log(server, "Profiling done", since, timeout=180.0):
        traces = sorted(
            glob.glob(str(prof_dir / "**" / "*.trace.json*"), recursive=True),
            key=os.path.getmtime,
        )
        profile.update(summarize_trace(traces[-1], a.profile_steps))
    else:
        profile["error"] = client.get("error") or "no trace written"
    return profile


def running_stats(log_text: str, since: int) -> Dict[str, Any]:
    """Peak and mean ``#running-req`` of the decode log lines written after byte ``since``."""
    lines = parse_log(log_text[since:])["decode_lines"]
    running = [x["running"] for x in lines]
    return {
        "decode_log_lines": len(lines),
        "peak_running": max(running, default=0),
        "mean_running": statistics.fmean(running) if running else 0.0,
        "all_cuda_graph": all(x["cuda_graph"] for x in lines) if lines else None,
        "step_ms_median": statistics.median([x["step_ms"] for x in lines]) if lines else None,
        # The step at each batch size: servers that ran different batches compare at equal ones.
        "step_ms_by_running": step_ms_by_batch(lines),
    }


def wait_for_log(server: Server, text: str, since: int, timeout: float) -> bool:
    """Wait until ``text`` appears in the server's log after byte ``since``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if text in server.log_text()[since:]:
            return True
        time.sleep(1.0)
    return False


def summarize_trace(path: str, steps: int) -> Dict[str, Any]:
    """GPU kernel time of a torch-profiler chrome trace, per step: in all, kv offload's and
    HiSparse's kernels apart, the time some kernel runs (busy) and the wall span of the kernels
    (span less busy: the GPU waited on the host); and the ten largest kernels."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_name: Dict[str, List[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    total = sum(sum(v) for v in by_name.values())

    def share(names) -> float:
        return sum(sum(v) for k, v in by_name.items() if any(n in k for n in names))

    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    span = (
        max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels) if kernels else 0
    )
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals (streams overlap)
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    per = max(1, steps)
    return {
        "trace": os.path.basename(path),
        "steps": steps,
        "kernels": len(kernels),
        "kernel_us_per_step": total / per,
        "offload_us_per_step": share(OFFLOAD_KERNELS) / per,
        "hisparse_us_per_step": share(HISPARSE_KERNELS) / per,
        "busy_us_per_step": busy / per,
        "span_us_per_step": span / per,
        "top_kernels": [
            [name[:80], len(v), round(sum(v) / per, 1), round(statistics.median(v), 1)]
            for name, v in top
        ],
    }


# Decorrelation period of the stand-ins' top-k replay (``KV_OFFLOAD_STANDINS_TOPK_PERIOD``) for
# each per-step churn of the drifting top-k, measured at top-k 2048 and 32K context
# (test_topk_replay.py checks these).
TOPK_REPLAY_PERIODS = {0.4: 3, 0.1: 12}


class PDServer:
    """A PD pair (``--pd``: ``scripts/tiny_pd.py``, the offload flags on the decode server) seen
    as one benchmark server: the client talks to its load balancer (``port``); the decode
    server's address, command, log and state are the server's."""

    def __init__(self, args: List[str], decode_extra: List[str], log_dir: Path, env: Dict):
        self.pair = PDPair(args, decode_extra, log_dir, decode_env=env)
        self.decode = self.pair.decode
        self.port, self.url, self.cmd = self.pair.lb.port, self.decode.url, self.decode.cmd

    def wait_ready(self, timeout: float) -> float:
        t0 = time.time()
        self.pair.wait_ready()  # each of the three within tiny_server_proc's start time-out
        if time.time() - t0 > timeout:
            raise TimeoutError(f"the PD pair took {time.time() - t0:.0f} s to start")
        return time.time() - t0

    def log_text(self) -> str:
        return self.decode.log_text()

    def wait_settled(self, timeout: float, strict: bool = True) -> Optional[Dict]:
        return self.decode.wait_settled(timeout, strict=strict)

    def stop(self) -> None:
        self.pair.stop()


def launch(
    kind: str, a: argparse.Namespace, out_dir: Path, radix_cache: bool = False
) -> Tuple[Any, Dict[str, Any]]:
    """Start one server of ``kind`` (not waited for; with ``--pd`` a PD pair, :class:`PDServer`)
    and its result record (kind, args, command): the stand-ins' switches (``--fast-standins``,
    ``--topk-churn``) and the profiler's folder in its environment, its log in ``out_dir``."""
    args = server_args(kind, a, radix_cache)
    env = {"SGLANG_TORCH_PROFILER_DIR": str(out_dir / f"profile_{kind}")}
    if a.fast_standins or (a.fast_standins is None and a.model == "dsv32"):
        env["KV_OFFLOAD_STANDINS_FAST"] = "1"
    if a.topk_churn:
        env["KV_OFFLOAD_STANDINS_TOPK_PERIOD"] = str(TOPK_REPLAY_PERIODS[a.topk_churn])
    if a.pd:
        if kind == "hisparse" or radix_cache:
            raise ValueError("--pd serves the off and offload kinds, without the radix cache")
        common = common_args(a) + a.extra_server_args
        server = PDServer(common, kind_args(kind, a), out_dir / f"pd_{kind}", env)
    else:
        server = Server(args, out_dir / f"server_{kind}.log", env, kernels=a.kernels)
    return server, {"kind": kind, "args": args, "command": shlex.join(server.cmd), "ok": False}


def wait_started(server: Server, res: Dict[str, Any], a: argparse.Namespace) -> None:
    """Wait for ``server`` to answer (at most ``--startup-timeout-s``, and not past the run's
    deadline) and record its start-up time, KV token capacity (``max_total_num_tokens``) and
    offload state."""
    left = a.run_deadline - time.time() - 60
    res["startup_s"] = server.wait_ready(max(60.0, min(a.startup_timeout_s, left)))
    info = http("GET", server.url + "/server_info", timeout=60)
    state = (info.get("internal_states") or [{}])[0]
    res["max_total_num_tokens"] = state.get(
        "max_total_num_tokens", info.get("max_total_num_tokens")
    )
    res["kv_offload_start"] = state.get("kv_offload")


def run_server(
    kind: str, a: argparse.Namespace, out_dir: Path, points_end: Callable[[], float]
) -> Dict[str, Any]:
    server, res = launch(kind, a, out_dir)
    res["points"] = []
    try:
        wait_started(server, res, a)
        deadline = points_end()
        tokenizer = server.cmd[server.cmd.index("--model-path") + 1]
        for conc in a.concurrency:
            if time.time() > deadline - a.point_reserve_s:
                res["points"].append({"concurrency": conc, "skipped": "deadline"})
                continue
            since = len(server.log_text())
            point = {"concurrency": conc}
            point.update(point_client(server, kind, conc, a, out_dir, tokenizer, deadline))
            point.update(running_stats(server.log_text(), since))
            if a.profile_concurrency == conc:
                point["profile"] = (
                    profile_pass(server, kind, conc, a, out_dir, tokenizer, deadline)
                    if time.time() < deadline - a.point_reserve_s
                    else {"error": "no time left for the profile run"}
                )
            res["points"].append(point)
            print(f"[bench_serving_dsa] {kind} c={conc}: {json.dumps(point)[:600]}", flush=True)
        res["kv_offload_end"] = server.wait_settled(SETTLE_S, strict=False)
        res["standins_called"] = parse_log(server.log_text())["standins_called"]
        res["ok"] = all("error" not in p for p in res["points"])
    except (
        RuntimeError,
        TimeoutError,
        OSError,
        subprocess.TimeoutExpired,
        urllib.error.URLError,
    ) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
        tail = server.log_text()[-3000:]
        if not res["ok"]:
            res["log_tail"] = tail
    return res


def run_client(cmd: List[str], out_file: Path, log_file: Path, timeout: float) -> Dict[str, Any]:
    """Run one ``bench_serving`` client; its output goes to ``log_file``. Returns the point's
    fields: ``wall_s``, ``returncode`` and :data:`BENCH_KEYS` of its result line, or ``error``.
    A client stopped by ``timeout`` after it wrote its result line (it ends with the last request)
    keeps that result, marked ``timed_out``; one stopped while writing it has none."""
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = "".join(
            x.decode(errors="replace") if isinstance(x, bytes) else x or ""
            for x in (exc.stdout, exc.stderr)
        )
        output += f"\n[bench_serving_dsa] client stopped after {timeout:.0f} s\n"
    point: Dict[str, Any] = {"wall_s": time.time() - t0, "returncode": returncode}
    log_file.write_text(output)
    lines = out_file.read_text().strip().splitlines() if out_file.exists() else []
    try:
        row = json.loads(lines[-1]) if returncode in (0, None) and lines else None
    except json.JSONDecodeError:  # stopped in the middle of writing it
        row = None
    if row is None:
        point["error"] = output[-2000:]
        return point
    if returncode is None:
        point["timed_out"] = True
    point.update({k: row.get(k) for k in BENCH_KEYS})
    return point


# What each point keeps of bench_serving's result line.
BENCH_KEYS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_ttft_ms",
    "median_itl_ms",
    "max_concurrency",
)


def add_server_options(p: argparse.ArgumentParser, layers: int, max_running: int) -> None:
    """The options of the servers a serving benchmark starts (``server_args``, ``launch``) and of
    its time limit (``run_servers``)."""
    p.add_argument("--servers", default="off,offload,hisparse")
    p.add_argument(
        "--pd",
        action="store_true",
        help="each server a PD pair (prefill + decode + SGLang's mini load balancer, Mooncake over "
        "TCP: the CPU tiny model); the flags of --servers go to the decode server",
    )
    p.add_argument("--model", choices=["dsv32", "tiny"], default="dsv32")
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--experts", type=int, default=8, help="routed experts of the narrower MoE")
    p.add_argument("--index-topk", type=int, default=0, help="0: the model's (2048)")
    p.add_argument("--max-running", type=int, default=max_running)
    p.add_argument("--max-total-tokens", type=int, default=0, help="0: what the memory gives")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--chunked-prefill-size", type=int, default=16384)
    p.add_argument("--offload-config", type=json.loads, default={})
    p.add_argument("--hisparse-config", type=json.loads, default={})
    p.add_argument(
        "--fast-standins",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the kernel stand-ins compute in bf16/fp32 instead of float64 (their batch "
        "invariance is for token equality, not throughput) and S7 draws the dummy weights on the "
        "GPU; default: on with --model dsv32, whose 1.2 GB a layer the CPU draws for minutes",
    )
    p.add_argument(
        "--topk-churn",
        type=float,
        choices=sorted(TOPK_REPLAY_PERIODS),
        default=0.0,
        help="replace the random-weight decode top-k by the stand-ins' realistic replay (sinks, "
        "window, this fraction of the rest changing per step; the same in every server); 0: the "
        "raw random top-k",
    )
    tiny_server.add_kernels_argument(p)
    p.add_argument("--deadline-s", type=float, default=570)
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=420,
        help="the longest a server may take to start (on a fresh GPU machine the first server "
        "compiles the JIT and DeepGEMM kernels while capturing its first decode graph: 2 min)",
    )
    p.add_argument("--point-reserve-s", type=float, default=30)
    p.add_argument("extra_server_args", nargs="*", help="after --: appended to every server")


def report_head(a: argparse.Namespace, argv: Optional[List[str]]) -> Dict[str, Any]:
    """What every serving benchmark's results start with: commit, machine, command and model."""
    _, env = tiny_server.build_command([], kernels=a.kernels)
    return {
        "commit": git_commit(),
        "machine": machine_info(),
        "kernels": tiny_server.kernel_report(env),
        "server_env": {k: v for k, v in env.items() if k.startswith(("SGLANG_", "KV_OFFLOAD"))},
        "command": shlex.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "model": {"kind": a.model, "overrides": model_overrides(a)},
    }


def run_servers(
    a: argparse.Namespace,
    report: Dict[str, Any],
    out_path: Path,
    run_one: Callable[[str, Callable[[], float]], Dict[str, Any]],
) -> None:
    """``run_one(kind, points_end)`` for each of ``--servers`` in turn, its result appended to
    ``report["servers"]`` and the report written to ``out_path`` after each. A server first starts
    (``wait_started``); ``points_end()``, called then, gives the end of its equal share of the time
    left before ``--deadline-s`` (counted from now), so neither a slow start nor a slow server
    leaves the later ones nothing."""
    a.run_deadline = time.time() + a.deadline_s
    kinds = [s for s in a.servers.split(",") if s]
    report["servers"] = []
    for i, kind in enumerate(kinds):
        logger.info("starting %s", kind)
        left = len(kinds) - i
        report["servers"].append(
            run_one(kind, lambda: time.time() + (a.run_deadline - time.time()) / left)
        )
        out_path.write_text(results_json(report))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench_serving_dsa.json")
    p.add_argument("--input-len", type=int, default=32768)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="bench_serving's: lengths uniform in [ratio x len, len]; 1: fixed lengths",
    )
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--profile-concurrency", type=int, default=0, help="profile the point at this; 0: none"
    )
    p.add_argument(
        "--profile-batch",
        default="",
        help="the decode batch that starts the profile: B, or kind=B pairs (off=6,offload=16); "
        "default: the concurrency",
    )
    p.add_argument("--profile-steps", type=int, default=8)
    add_server_options(p, layers=8, max_running=64)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    a.concurrency = [int(c) for c in a.concurrency.split(",") if c]
    if a.profile_concurrency and a.profile_concurrency not in a.concurrency:
        p.error(f"--profile-concurrency {a.profile_concurrency} is not in --concurrency")
    a.context_length = a.input_len + a.output_len + 64
    out_path = Path(a.out).resolve()
    out_dir = out_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {
        **report_head(a, argv),
        "workload": {
            "input_len": a.input_len,
            "output_len": a.output_len,
            "concurrency": a.concurrency,
            "dataset": "random-ids",
            "seed": a.seed,
            "decode_topk": f"replay, churn {a.topk_churn}" if a.topk_churn else "random weights",
        },
    }
    a.on_gpu = "gpu" in report["machine"]
    run_servers(
        a, report, out_path, lambda kind, points_end: run_server(kind, a, out_dir, points_end)
    )
    report["summary"] = {
        s["kind"]: {
            p["concurrency"]: {
                k: p.get(k)
                for k in ("output_throughput", "median_tpot_ms", "peak_running", "completed")
            }
            for p in s["points"]
        }
        for s in report["servers"]
    }
    out_path.write_text(results_json(report))
    print("[bench_serving_dsa] summary: " + json.dumps(report["summary"]), flush=True)
    return report


if __name__ == "__main__":
    main()
