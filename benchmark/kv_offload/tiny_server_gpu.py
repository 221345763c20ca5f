#!/usr/bin/env python3
"""The tiny real DeepSeek-V3.2 server on one GPU, ``--enable-kv-offload`` off vs on.

One command on the lent GPU machine (after ``source scripts/gpu_env.sh production|standins``)::

    python3 benchmark/kv_offload/tiny_server_gpu.py --out results.json [--configs topk256,topk2048] \
        [--kernels production|standins]

For each config (a model ``index_topk`` override and a ``sparse_slots_per_req`` near it, so that the
GPU LRU evicts and reloads at 32K contexts) it starts the REAL ``python -m sglang.launch_server``
through ``scripts/tiny_server.py`` (tiny random-weight model; ``--kernels production``: FlashMLA,
DeepGEMM and 0.5.23's JIT kernels with the fp8 KV cache, ``standins``: their torch references of
``test/srt/kv_offload/standins/kv_offload_standins.py``; the ``sgl_kernel`` ones stay stand-ins in
both, and the JSON records the kernel packages and every stand-in that ran) with CUDA graphs
and the overlap scheduler on (upstream defaults), first without and then with ``--enable-kv-offload``,
and for each server:

* sends ``--batched-requests`` greedy requests (contexts up to ``--batched-max-ctx``) in ONE
  ``/generate`` call, so that both servers run the same batches (``run_batched``): this model's
  decode rounds differently per batch shape, and with the same shapes in both servers tokens that
  differ there come from the offload path, at decode batch sizes above one;
* sends one fixed set of greedy requests all at once (``input_ids`` of random tokens from a fixed
  seed, default 32 requests with contexts from 512 to 32K tokens, ``ignore_eos`` so every request
  decodes ``--max-new-tokens`` tokens) and records every output token;
* reads the decode step time from the server's ``Decode batch ... gen throughput`` log lines
  (``1000 * #running-req / throughput`` ms per step: every running request gains one token per
  step), per decode batch size, and the client-side wall time. The two servers put the same
  requests into different batches (with the flag on, prompts longer than the GPU staging rows are
  admitted one at a time), so compare step times at the batch sizes both ran
  (``step_ms_common_batch``); the sequential phase below always gives batch size 1 on both;
* sends the first ``--sequential-requests`` (the longest) requests again one at a time: a batch of
  one has the same prefill chunks and decode graph in both servers, so tokens that differ there
  come from the offload path, not from batch-shape dependent rounding;
* reads ``GET /get_server_info`` (``internal_states[0]["kv_offload"]``) after the warm-up and at
  the end (the difference is what the workload did) and the ``kv_offload:`` status lines of the
  log.

Then it compares the two runs' tokens request by request (concurrent and sequential), and each
server's concurrent tokens with its sequential ones (the model's own batch-shape sensitivity).
``--preflight`` (default on) first checks, in one subprocess with the server's environment, that the
server modules import and that every stand-in runs inside CUDA graph capture. The JSON (``--out``)
is rewritten after every stage, and each server's log is written next to it, so a run cut short
still reports what it got. Results of one H200 run: ``results/tiny_server_gpu-h200.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_server  # noqa: E402
from bench_common import results_json  # noqa: E402
from tiny_server_proc import BenchServer, http  # noqa: E402

VOCAB = 1024  # the tiny model's vocab (fixtures/tiny-deepseek-v32/config.json)
FIRST_TOKEN = 2  # skip <s>/</s> (ids 0 and 1)
# Seconds to wait for a server's offload state to settle between phases (no request live, no
# backup in flight); then the last state read is recorded.
SETTLE_S = 30.0

# name -> (index_topk override or None for the model's 2048, sparse_slots_per_req)
CONFIGS: Dict[str, Tuple[Optional[int], int]] = {
    "topk256": (256, 512),
    "topk512": (512, 1024),
    "topk2048": (None, 4096),
}

STANDIN_RE = re.compile(r"\[standin\] pid \d+ first call: (\w+)")
DECODE_RE = re.compile(
    r"Decode batch.*?#running-req: (\d+),.*?(?:cuda|cpu) graph: (\w+), "
    r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)"
)


# ------------------------------------------------------------------------------------------------
# workload
# ------------------------------------------------------------------------------------------------
def context_lengths(num: int, max_ctx: int) -> List[int]:
    """A fixed mix of context lengths: an eighth each at max, 3/4, 1/2 and 1/4 of ``max_ctx``, then
    1/8, 1/16, 2048 and 512 tokens (``num`` requests, cycling through that pattern)."""
    pattern = [max_ctx, max_ctx * 3 // 4, max_ctx // 2, max_ctx // 4, max_ctx // 8, max_ctx // 16]
    pattern += [2048, 512]
    pattern = [max(16, min(max_ctx, p)) for p in pattern]
    per = max(1, num // len(pattern))
    out: List[int] = []
    for p in pattern:
        out += [p] * per
    while len(out) < num:
        out.append(pattern[len(out) % len(pattern)])
    return out[:num]


def make_requests(num: int, max_ctx: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)] for n in context_lengths(num, max_ctx)
    ]


def step_ms_by_batch(lines: List[Dict[str, Any]]) -> Dict[int, Dict[str, float]]:
    """Median decode step time per ``#running-req``; a line whose interval spans idle time (the
    first after a pause: far above its batch size's median) is left out."""
    by: Dict[int, List[float]] = {}
    for x in lines:
        by.setdefault(x["running"], []).append(x["step_ms"])
    out = {}
    for running, vals in sorted(by.items()):
        med = statistics.median(vals)
        kept = [v for v in vals if v <= 5 * med] or vals
        out[running] = {
            "lines": len(kept),
            "median_ms": statistics.median(kept),
            "min_ms": min(kept),
        }
    return out


def parse_log(text: str) -> Dict[str, Any]:
    lines = []
    for m in DECODE_RE.finditer(text):
        running, graph, tput, queue = (
            int(m.group(1)),
            m.group(2),
            float(m.group(3)),
            int(m.group(4)),
        )
        if tput > 0:
            lines.append(
                {
                    "running": running,
                    "cuda_graph": graph == "True",
                    "throughput": tput,
                    "queue": queue,
                    "step_ms": 1000.0 * running / tput,
                }
            )
    by_batch = step_ms_by_batch(lines)
    full = max(by_batch, default=0)
    kv_lines = [
        ln.split("kv_offload: ", 1)[1] for ln in text.splitlines() if "kv_offload: step" in ln
    ]
    errors = [ln for ln in text.splitlines() if "kv offload plan error" in ln or "Traceback" in ln]
    standins = sorted(set(STANDIN_RE.findall(text)))
    return {
        "decode_lines": lines,
        "step_ms_by_batch": by_batch,
        "largest_batch": full,
        "step_ms_largest_batch_median": by_batch[full]["median_ms"] if full else None,
        "all_decode_lines_cuda_graph": all(x["cuda_graph"] for x in lines) if lines else None,
        "kv_offload_status_lines": kv_lines[-5:],
        "error_lines": errors[:20],
        "standins_called": standins,
    }


def common_batch_steps(off: Dict[str, Any], on: Dict[str, Any]) -> Dict[int, Dict[str, float]]:
    """Median step ms at the decode batch sizes both servers ran (the like-for-like comparison:
    the two servers schedule the same requests into different batches)."""
    a, b = off.get("step_ms_by_batch") or {}, on.get("step_ms_by_batch") or {}
    return {
        n: {
            "off_ms": a[n]["median_ms"],
            "on_ms": b[n]["median_ms"],
            "on_over_off": b[n]["median_ms"] / a[n]["median_ms"],
        }
        for n in sorted(set(a) & set(b))
    }


def run_server(
    name: str,
    server_args: List[str],
    prompts: List[List[int]],
    max_new_tokens: int,
    out_dir: Path,
    deadline: float,
    sequential: int = 0,
    env_extra: Optional[Dict[str, str]] = None,
    concurrent: bool = True,
    batched: Optional[List[List[int]]] = None,
    kernels: Optional[str] = None,
) -> Dict[str, Any]:
    res: Dict[str, Any] = {"name": name, "args": server_args, "env": env_extra or {}, "ok": False}
    log_path = out_dir / f"server_{name}.log"
    t0 = time.time()
    server = BenchServer(server_args, log_path, env_extra, kernels=kernels)
    res["command"] = server.cmd
    try:
        res["startup_s"] = server.wait_ready(max(30.0, min(420.0, deadline - time.time() - 60)))
        # Warm-up; retried, because a failed first request is a finding to report, not a reason to
        # give up on the run (see the report's "warmup_errors").
        res["warmup_errors"] = []
        for attempt in range(3):
            try:
                warm = http(
                    "POST",
                    server.url + "/generate",
                    {
                        "input_ids": prompts[-1][:64],
                        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                    },
                    timeout=120,
                )
                res["warmup_tokens"] = warm.get("output_ids") if isinstance(warm, dict) else warm
                break
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")[:500]
                res["warmup_errors"].append(f"attempt {attempt}: HTTP {exc.code}: {body}")
                time.sleep(2)
        else:
            raise RuntimeError("warm-up failed 3 times: " + " | ".join(res["warmup_errors"]))
        res["kv_offload_after_warmup"] = server.wait_settled(SETTLE_S, strict=False)
        sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        if batched:
            res["batched"] = run_batched(server, batched, sampling, deadline)
        outs: List[Optional[dict]] = [None] * len(prompts)
        lat: List[Optional[float]] = [None] * len(prompts)
        timeout = max(30.0, deadline - time.time() - 30)

        def one(i: int) -> None:
            s = time.time()
            outs[i] = http(
                "POST",
                server.url + "/generate",
                {"input_ids": prompts[i], "sampling_params": sampling},
                timeout=timeout,
            )
            lat[i] = time.time() - s

        t1 = time.time()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            for f in [pool.submit(one, i) for i in range(len(prompts) if concurrent else 0)]:
                f.result()
        res["wall_s"] = time.time() - t1
        res["latency_s"] = lat
        if concurrent:
            res["tokens"] = [o.get("output_ids") for o in outs]
            res["finish_reasons"] = [o.get("meta_info", {}).get("finish_reason") for o in outs]
        # Then the first ``sequential`` requests again, one at a time (batch of one, the same
        # prefill chunks and decode graph in both servers, so no batch-shape dependent numerics).
        seq, t2 = [], time.time()
        for i in range(min(sequential, len(prompts))):
            if time.time() > deadline - 45:
                res["sequential_skipped_from"] = i
                break
            o = http(
                "POST",
                server.url + "/generate",
                {"input_ids": prompts[i], "sampling_params": sampling},
                timeout=max(30.0, deadline - time.time() - 30),
            )
            seq.append(o.get("output_ids"))
        res["tokens_sequential"] = seq
        res["sequential_wall_s"] = time.time() - t2
        res["kv_offload"] = server.wait_settled(SETTLE_S, strict=False)
        res["kv_offload_workload_delta"] = counter_delta(
            res["kv_offload_after_warmup"], res["kv_offload"]
        )
        res["ok"] = True
    except Exception as exc:  # keep going: the other server and the JSON still matter
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
    finally:
        server.stop()
        res["total_s"] = time.time() - t0
        text = server.log_text()
        res.update(parse_log(text))
        res["log_tail"] = text.splitlines()[-60:] if not res["ok"] else text.splitlines()[-5:]
    return res


def run_batched(
    server: BenchServer, prompts: List[List[int]], sampling: Dict[str, Any], deadline: float
) -> Dict[str, Any]:
    """All ``prompts`` in ONE ``/generate`` call: the scheduler receives them in one message, so two
    servers whose admission decisions agree run the same prefill chunks and the same decode
    batches (CUDA graphs of the same size), and their greedy tokens must agree even though this
    model's decode depends on the batch shape. The decode ``#running-req`` sequence of the phase
    (from the log) shows whether the batches did agree."""
    start = len(server.log_text())
    before = server.wait_settled(SETTLE_S, strict=False)
    t0 = time.time()
    outs = http(
        "POST",
        server.url + "/generate",
        {"input_ids": prompts, "sampling_params": sampling},
        timeout=max(30.0, deadline - time.time() - 30),
    )
    wall = time.time() - t0
    time.sleep(1.0)  # the last decode log line of the phase
    lines = parse_log(server.log_text()[start:])["decode_lines"]
    return {
        "wall_s": wall,
        "tokens": [o.get("output_ids") for o in outs],
        "finish_reasons": [o.get("meta_info", {}).get("finish_reason") for o in outs],
        "decode_running": [x["running"] for x in lines],
        "all_decode_lines_cuda_graph": all(x["cuda_graph"] for x in lines) if lines else None,
        "kv_offload_delta": counter_delta(before, server.wait_settled(SETTLE_S, strict=False)),
    }


def counter_delta(before: Optional[dict], after: Optional[dict]) -> Optional[Dict[str, int]]:
    """``after - before`` for the numeric top-level counters (what the workload itself did)."""
    if not before or not after:
        return None
    return {
        k: after[k] - before[k]
        for k in after
        if isinstance(after[k], (int, float)) and isinstance(before.get(k), (int, float))
    }


def compare(off: Dict[str, Any], on: Dict[str, Any]) -> Dict[str, Any]:
    return compare_lists(off.get("tokens"), on.get("tokens"))


def compare_batched(off: Dict[str, Any], on: Dict[str, Any]) -> Dict[str, Any]:
    """The batched phase's tokens, and whether both servers logged the same decode batch sizes."""
    a, b = off.get("batched") or {}, on.get("batched") or {}
    out = compare_lists(a.get("tokens"), b.get("tokens"))
    if out["compared"]:
        out["same_decode_batches"] = a.get("decode_running") == b.get("decode_running")
    return out


def compare_lists(a: Optional[list], b: Optional[list]) -> Dict[str, Any]:
    if not a or not b:
        return {"compared": False}
    eq = [x == y for x, y in zip(a, b)]
    first = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            first.append(
                {"request": i, "first_diff_at": j, "off": x[j : j + 4], "on": y[j : j + 4]}
            )
    return {"compared": True, "tokens_equal": eq, "all_equal": all(eq), "mismatches": first[:8]}


# ------------------------------------------------------------------------------------------------
# preflight: imports and graph capture of the stand-ins, in the server's environment
# ------------------------------------------------------------------------------------------------
PREFLIGHT = r"""
import importlib, json, sys, traceback
import torch
report = {"imports": {}, "graph_capture": {}}
mods = ["sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
        "sglang.srt.models.deepseek_v2", "sglang.srt.layers.attention.dsa_backend",
        "sglang.srt.layers.moe.topk", "sglang.srt.layers.quantization.unquant",
        "sglang.srt.layers.sampler", "sglang.srt.managers.detokenizer_manager",
        "sglang.srt.managers.overlap_utils", "sglang.srt.mem_cache.sparsity.kv_offload.runtime"]
for m in mods:
    try:
        importlib.import_module(m); report["imports"][m] = "ok"
    except BaseException:
        report["imports"][m] = traceback.format_exc()[-1500:]
import kv_offload_standins as S
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
def cases():
    B, L, H, D = 8, 4096, 4, 128
    pages = L // 64 * B
    q8 = torch.randn(B, 1, H, D, device=dev).to(torch.float8_e4m3fn)
    keys = torch.randn(pages, 64 * 128, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.full((pages, 64), 0.01, device=dev).view(torch.uint8)
    cache = torch.cat([keys, scales], dim=1).view(pages, 64, 1, 132)
    w = torch.randn(B, H, device=dev)
    lens = torch.full((B,), L - 3, device=dev, dtype=torch.int32)
    bt = torch.arange(pages, device=dev, dtype=torch.int32).view(B, -1)
    yield "fp8_paged_mqa_logits", lambda: S.fp8_paged_mqa_logits(q8, cache, w, lens, bt, None, L)
    logits = torch.randn(B, L, device=dev)
    yield "fast_topk_v2", lambda: S.fast_topk_v2(logits, lens, 256)
    pt = torch.arange(B * L, device=dev, dtype=torch.int32).view(B, L)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    yield "fast_topk_transform_fused", lambda: S.fast_topk_transform_fused(logits, lens, pt, cu, 256)
    qm = torch.randn(B, 64, 576, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(B * L, 1, 576, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(-1, B * L, (B, 1, 2048), device=dev, dtype=torch.int32)
    yield "flash_mla_sparse_fwd", lambda: S.flash_mla_sparse_fwd(qm, kv, idx, 0.1, 512)
    xb = torch.randn(B, 4, 128, device=dev, dtype=torch.bfloat16)
    yield "rotate_activation", lambda: S.rotate_activation(xb)
    gl = torch.randn(B, 4, device=dev)
    bias4 = torch.zeros(4, device=dev)
    def triton_gate():  # G4: no stand-in; upstream's Triton router (the tiny model's sigmoid gate)
        from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate
        return moe_fused_gate(gl, bias4, 2, scoring_func="sigmoid", renormalize=True)
    yield "upstream triton moe_fused_gate", triton_gate
    x = torch.randn(B, 256, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(4, 256, 256, device=dev, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(4, 256, 128, device=dev, dtype=torch.bfloat16) * 0.05
    tw = torch.rand(B, 2, device=dev); ti = torch.randint(0, 4, (B, 2), device=dev, dtype=torch.int32)
    ti[-1] = -1
    yield "fused_moe_dense", lambda: S.fused_moe_dense(x, w13, w2, tw, ti, 2.5)
for name, fn in cases():
    try:
        S._HADAMARD.clear()
        ref = fn(); torch.cuda.synchronize()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        S._HADAMARD.clear()  # the first call inside capture must build it on the device
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay(); torch.cuda.synchronize()
        flat = lambda t: [t] if isinstance(t, torch.Tensor) else [u for v in t for u in flat(v)]
        same = all(torch.equal(a, b) for a, b in zip(flat(ref), flat(out)))
        report["graph_capture"][name] = "ok" if same else "captured, replay differs from eager"
    except BaseException:
        report["graph_capture"][name] = traceback.format_exc()[-1500:]
print("PREFLIGHT_JSON " + json.dumps(report))
"""


def preflight(timeout: float, kernels: Optional[str] = None) -> Dict[str, Any]:
    _, env = tiny_server.build_command([], kernels=kernels)
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PREFLIGHT],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    out = {"seconds": time.time() - t0, "returncode": proc.returncode}
    for line in proc.stdout.splitlines():
        if line.startswith("PREFLIGHT_JSON "):
            out.update(json.loads(line[len("PREFLIGHT_JSON ") :]))
    if "imports" not in out:
        out["stderr_tail"] = proc.stderr[-4000:]
    return out


# ------------------------------------------------------------------------------------------------
def server_args(topk: Optional[int], slots: int, offload: bool, a: argparse.Namespace) -> List[str]:
    args = [
        "--context-length", str(a.max_ctx + a.max_new_tokens + 256),
        "--max-total-tokens", str(a.max_total_tokens),
        "--max-running-requests", str(a.max_running),
        "--cuda-graph-max-bs-decode", str(a.max_running),
        # 0.5.23 also captures prefill graphs (breakable CUDA graphs), which need sgl_kernel's
        # weak_ref_tensor; decode graphs (what kv offload runs in) are unaffected.
        "--disable-prefill-cuda-graph",
        "--chunked-prefill-size", str(a.chunked_prefill_size),
        "--mem-fraction-static", str(a.mem_fraction_static),
        "--decode-log-interval", str(a.decode_log_interval),
    ]  # fmt: skip
    if topk is not None:
        args += ["--json-model-override-args", json.dumps({"index_topk": topk})]
    if offload:
        cfg = {"sparse_slots_per_req": slots, "status_log_interval": a.status_log_interval}
        cfg.update(a.offload_config)
        args += ["--enable-kv-offload", "--kv-offload-config", json.dumps(cfg)]
    return args + a.extra_server_args


def machine_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="tiny_server_gpu.json")
    p.add_argument("--configs", default="topk256", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-ctx", type=int, default=32768)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=0, help="0: fits every request at once")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--decode-log-interval", type=int, default=8)
    p.add_argument("--status-log-interval", type=int, default=32)
    p.add_argument(
        "--offload-config",
        type=json.loads,
        default={},
        help="more --kv-offload-config keys for the flag-on server, e.g. '{\"host_pool_ratio\": 2}'",
    )
    p.add_argument("--deadline-s", type=float, default=560, help="stop starting work after this")
    p.add_argument(
        "--sequential-requests",
        type=int,
        default=8,
        help="then send the first N (longest) requests again one at a time",
    )
    p.add_argument(
        "--batched-requests",
        type=int,
        default=16,
        help="first, this many requests in one /generate call (0: skip that phase)",
    )
    p.add_argument(
        "--batched-max-ctx",
        type=int,
        default=4096,
        help="the batched phase's longest context: every prompt of that phase must fit the "
        "flag-on server's GPU staging rows at once, or it admits them in a different order",
    )
    p.add_argument("--no-preflight", action="store_true")
    tiny_server.add_kernels_argument(p)
    p.add_argument("--only", choices=["off", "on"], default=None, help="run one side only")
    p.add_argument(
        "--race-delay-cycles",
        type=int,
        default=0,
        help="overlap race check instead of the timing run: every forward first spins this many "
        "GPU cycles (test-only fault injection), widening the window in which the scheduler "
        "prepares the next batch while the forward runs; the flag-on server runs with the "
        "coordinator's ordering against the in-flight forward and with it removed, requests one "
        "at a time; tokens are compared with the flag-off server's",
    )
    p.add_argument("extra_server_args", nargs="*", help="after --: appended to every server")
    a = p.parse_args()
    deadline = time.time() + a.deadline_s
    prompts = make_requests(a.num_requests, a.max_ctx, a.seed)
    batched = make_requests(a.batched_requests, a.batched_max_ctx, a.seed + 1)
    # Every request of either phase runs at once.
    a.max_running = max(a.num_requests, a.batched_requests)
    if a.max_total_tokens <= 0:
        need = max(sum(len(x) + a.max_new_tokens for x in phase) for phase in (prompts, batched))
        a.max_total_tokens = (need * 5 // 4 + 8191) // 8192 * 8192
    out_path = Path(a.out).resolve()
    out_dir = out_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    _, env = tiny_server.build_command([], kernels=a.kernels)
    report: Dict[str, Any] = {
        "machine": machine_info(),
        "kernels": tiny_server.kernel_report(env),
        "workload": {
            "num_requests": a.num_requests,
            "context_lengths": [len(x) for x in prompts],
            "batched_context_lengths": [len(x) for x in batched],
            "max_new_tokens": a.max_new_tokens,
            "seed": a.seed,
            "vocab": VOCAB,
            "greedy": True,
            "ignore_eos": True,
        },
        "server": {
            "max_total_tokens": a.max_total_tokens,
            "chunked_prefill_size": a.chunked_prefill_size,
            "cuda_graph_max_bs": a.max_running,
            "overlap_scheduler": "default (on)",
            "env": {k: v for k, v in env.items() if k.startswith(("SGLANG_", "KV_OFFLOAD"))},
        },
        "configs": [],
    }

    def save() -> None:
        out_path.write_text(results_json(report))

    if not a.no_preflight:
        report["preflight"] = preflight(min(300.0, deadline - time.time()), a.kernels)
        save()
        print("[tiny_server_gpu] preflight:", json.dumps(report["preflight"])[:3000], flush=True)
    for name in [c for c in a.configs.split(",") if c]:
        topk, slots = CONFIGS[name]
        entry: Dict[str, Any] = {
            "name": name,
            "index_topk": topk or 2048,
            "sparse_slots_per_req": slots,
        }
        report["configs"].append(entry)
        delay = {"KV_OFFLOAD_TEST_FORWARD_DELAY_CYCLES": str(a.race_delay_cycles)}
        sides = {"off": (False, {}), "on": (True, {})}
        if a.race_delay_cycles:
            sides = {
                "off": (False, {}),
                "on_delay": (True, delay),
                "on_delay_unordered": (
                    True,
                    dict(delay, KV_OFFLOAD_TEST_DROP_FORWARD_ORDERING="1"),
                ),
            }
        for side, (offload, env_extra) in sides.items():
            if a.only and side != a.only:
                continue
            if time.time() > deadline - 90:
                entry[side] = {"skipped": "deadline"}
                continue
            print(f"[tiny_server_gpu] {name} kv offload {side}", flush=True)
            entry[side] = run_server(
                f"{name}_{side}", server_args(topk, slots, offload, a), prompts,
                a.max_new_tokens, out_dir, deadline, a.sequential_requests,
                env_extra=env_extra, concurrent=not a.race_delay_cycles,
                batched=None if a.race_delay_cycles else batched, kernels=a.kernels,
            )  # fmt: skip
            r = entry[side]
            print(
                f"[tiny_server_gpu]   ok={r['ok']} startup={r.get('startup_s')} wall={r.get('wall_s')} "
                f"largest decode batch={r.get('largest_batch')} "
                f"step_ms there={r.get('step_ms_largest_batch_median')} "
                f"error={r.get('error')}",
                flush=True,
            )
            save()
        if a.race_delay_cycles:
            entry["race"] = {
                side: compare_lists(
                    entry["off"].get("tokens_sequential"), entry[side].get("tokens_sequential")
                )
                for side in ("on_delay", "on_delay_unordered")
                if side in entry and "off" in entry
            }
            print(f"[tiny_server_gpu]   race: {json.dumps(entry['race'])[:800]}", flush=True)
        if "off" in entry and "on" in entry:
            entry["compare"] = compare(entry["off"], entry["on"])
            entry["compare_batched"] = compare_batched(entry["off"], entry["on"])
            entry["compare_sequential"] = compare_lists(
                entry["off"].get("tokens_sequential"), entry["on"].get("tokens_sequential")
            )
            # batch-shape sensitivity of the model itself: the same server, concurrent vs alone
            for side in ("off", "on"):
                entry[f"{side}_concurrent_vs_sequential"] = compare_lists(
                    entry[side].get("tokens"), entry[side].get("tokens_sequential")
                )
            entry["step_ms_by_batch"] = {s: entry[s].get("step_ms_by_batch") for s in ("off", "on")}
            entry["step_ms_common_batch"] = common_batch_steps(entry["off"], entry["on"])
            print(f"[tiny_server_gpu]   compare: {json.dumps(entry['compare'])[:600]}", flush=True)
            print(
                f"[tiny_server_gpu]   batched: {json.dumps(entry['compare_batched'])[:600]}",
                flush=True,
            )
            print(
                "[tiny_server_gpu]   sequential: "
                f"{json.dumps(entry['compare_sequential'])[:600]}; off concurrent vs sequential: "
                f"{json.dumps(entry['off_concurrent_vs_sequential'])[:400]}",
                flush=True,
            )
        save()
    # tokens are large: keep them, but summarise at the top
    report["summary"] = [
        {
            "config": e["name"],
            "all_tokens_equal": e.get("compare", {}).get("all_equal"),
            "requests_equal": sum(e.get("compare", {}).get("tokens_equal") or []),
            "batched_all_equal": e.get("compare_batched", {}).get("all_equal"),
            "batched_requests_equal": sum(e.get("compare_batched", {}).get("tokens_equal") or []),
            "batched_same_decode_batches": e.get("compare_batched", {}).get("same_decode_batches"),
            "sequential_all_equal": e.get("compare_sequential", {}).get("all_equal"),
            "sequential_requests_equal": sum(
                e.get("compare_sequential", {}).get("tokens_equal") or []
            ),
            "off_concurrent_vs_sequential_equal": sum(
                e.get("off_concurrent_vs_sequential", {}).get("tokens_equal") or []
            ),
            "step_ms_by_batch": e.get("step_ms_by_batch"),
            "step_ms_common_batch": e.get("step_ms_common_batch"),
            "race": e.get("race"),
            "warmup_errors_on": (e.get("on") or {}).get("warmup_errors"),
            "kv_offload_workload_delta": (e.get("on") or {}).get("kv_offload_workload_delta"),
            "kv_offload": (e.get("on") or {}).get("kv_offload"),
        }
        for e in report["configs"]
    ]
    save()
    print("[tiny_server_gpu] summary: " + json.dumps(report["summary"]), flush=True)


if __name__ == "__main__":
    main()
