#!/usr/bin/env python3
"""How many requests the flag-on server holds at once beside the flag-off server, by prompt length.

Two modes, both written as results JSON (``--out``):

``sizing``: DeepSeek-V3.2's fp8 shapes (61 layers, 656 B KV rows, 132 B index rows) and one GPU's KV
budget, worked out by the product's own sizing code (``device_pool.size_arena`` and the arena layout
the server builds): for each prompt length (plus ``--output-len``), the requests and tokens the
flag-off budget holds (``max_total_num_tokens`` / request length) and those the flag-on arena holds
(a request no longer than its ``sparse_slots_per_req`` and two tail pages keeps its whole context on
the GPU, a longer one its slots and two tail pages; every token keeps its index keys), the server's own
``max_total_num_tokens`` with and without the flag, and the host memory the flag-on batch needs.

``serve``: the real tiny servers on this machine (``scripts/tiny_server.py``, CPU), flag off and on
with the same ``--max-total-tokens``, driven by SGLang's own ``bench_serving`` through
``bench_serving_dsa.py --model tiny``, one point per prompt length: every request served, the KV
token capacity and the peak / mean running requests each server logged. ``--pd``: PD pairs instead
(the flag, and ``--offload-config`` such as ``{"pd_direct_to_host": true}``, on the decode server;
the counts are the decode server's): how fast a decode server admits the transferred prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import results_json  # noqa: E402

DSV32 = {"layers": 61, "row": 656, "index_row": 132, "topk": 2048}
PAGE = 64
LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def _most(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``k`` in ``[0, hi]`` with ``fits(k)`` (``fits`` monotone, ``fits(0)``)."""
    lo = 0
    while lo < hi:
        k = (lo + hi + 1) // 2
        lo, hi = (k, hi) if fits(k) else (lo, k - 1)
    return lo


def sizing_point(
    sizing, flag_off_tokens: int, length: int, slots: int, tail_pages: int, prompt_len: int = 0
) -> Dict:
    """Requests of ``length`` tokens held at once without and with the flag; with ``prompt_len``,
    also the flag-on peak when such prompts keep arriving: a sparse prompt stages in a GPU row per
    token (its promise, ``AdmissionLedger.promise_rows``: its prompt pages and the page of its
    first decode token, or its slots and tail if more) beside the requests already running, so
    ``k`` run and one stages when both fit, and ``k + 1`` run at most."""
    from sglang.srt.mem_cache.sparsity.kv_offload.admission import stays_resident

    layout = sizing.layout
    off = flag_off_tokens // (_pages(length) * PAGE)
    sparse = slots // PAGE + tail_pages
    resident = stays_resident(length, slots, tail_pages, PAGE)
    phys = _pages(length) if resident else sparse
    logical = _pages(length)
    most = sizing.logical_tokens // PAGE + 1
    # k requests fit if their physical and logical pages do, in whole units.
    on = _most(lambda k: layout.holds(k * phys, k * logical), most)
    point = {
        "length": length,
        "mode": "resident" if resident else "sparse",
        "flag_off_requests": off,
        "flag_on_requests": on,
        "ratio": round(on / off, 3) if off else None,
        "flag_off_tokens": off * length,
        "flag_on_tokens": on * length,
        "flag_on_host_gb": round(
            0 if resident else on * length * layout.row_bytes * sizing.num_layers / 1e9, 1
        ),
    }
    if prompt_len:
        staged = phys if resident else max(sparse, _pages(prompt_len) + 1)
        running = _most(lambda k: layout.holds(k * phys + staged, (k + 1) * logical), most)
        point["flag_on_running_while_staging"] = min(on, running + 1)
    return point


def run_sizing(args) -> Dict:
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
        LOGICAL_LOC_STATE_BYTES,
        size_arena,
    )

    layers, row, index_row = DSV32["layers"], DSV32["row"], DSV32["index_row"]
    budget = int(args.budget_gb * 1e9)
    flag_off = budget // ((row + index_row) * layers)
    sizing = size_arena(
        budget, layers, row, index_row, PAGE, logical_loc_bytes=LOGICAL_LOC_STATE_BYTES
    )
    points = []
    for n in args.lengths:
        point = sizing_point(sizing, flag_off, n + args.output_len, args.slots, 2, prompt_len=n)
        point["prompt_len"] = n
        points.append(point)
    return {
        "mode": "sizing",
        "model": "DeepSeek-V3.2 fp8 (61 layers, 656 B KV rows, 132 B index rows)",
        "budget_gb": args.budget_gb,
        "output_len": args.output_len,
        "sparse_slots_per_req": args.slots,
        "max_total_num_tokens": {"flag_off": flag_off, "flag_on": sizing.logical_tokens},
        "capacity_ratio": round(sizing.logical_tokens / flag_off, 3),
        "arena": {
            "unit_pages": sizing.layout.unit_pages,
            "units": sizing.layout.num_units,
            "resident_tokens": sizing.layout.resident_tokens,
        },
        "points": points,
    }


def offload_config(args) -> Dict:
    return {"sparse_slots_per_req": args.slots, **args.offload_config}


def serve_point(args, prompt_len: int, out_dir: Path) -> Dict:
    """One prompt length on the tiny servers, flag off then on (``bench_serving_dsa.py``)."""
    import bench_serving_dsa

    report = bench_serving_dsa.main(
        [
            "--model", "tiny", "--layers", str(args.layers), "--servers", "off,offload",
            "--out", str(out_dir / f"{prompt_len}.json"),
            "--input-len", str(prompt_len), "--output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio),
            "--concurrency", str(args.concurrency),
            "--min-prompts", str(args.prompts), "--prompts-per-concurrency", "1",
            "--max-running", str(args.max_running),
            "--max-total-tokens", str(args.max_total_tokens),
            "--chunked-prefill-size", str(args.chunked_prefill_size),
            "--index-topk", str(args.topk),
            "--offload-config", json.dumps(offload_config(args)),
            "--deadline-s", str(args.point_deadline_s),
        ]
        + (["--pd"] if args.pd else [])
        + (["--fast-standins"] if args.fast_standins else [])
    )  # fmt: skip
    row: Dict = {"prompt_len": prompt_len}
    for server in report["servers"]:
        point = (server["points"] or [{}])[0]
        end = server.get("kv_offload_end") or {}
        row[server["kind"]] = {
            "started": "startup_s" in server,
            "error": server.get("error") or point.get("error"),
            "max_total_num_tokens": server.get("max_total_num_tokens"),
            "completed": point.get("completed"),
            "peak_running": point.get("peak_running"),
            "mean_running": point.get("mean_running"),
            "output_throughput": point.get("output_throughput"),
            "leak_free": end.get("free") == end.get("initial_free") if end else None,
            "resident_requests": end.get("resident"),
            "loaded_rows": end.get("loaded"),
            "prefill_waits": end.get("prefill_waits"),
        }
    return row


def run_serve(args) -> Dict:
    out_dir = Path(tempfile.mkdtemp(prefix="kvcap-"))  # short: ZMQ ipc paths
    return {
        "mode": "serve",
        "model": f"tiny DeepSeek-V3.2 ({args.layers} layers, bf16, CPU)",
        "max_total_tokens": args.max_total_tokens,
        "max_running": args.max_running,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "concurrency": args.concurrency,
        "prompts": args.prompts,
        "offload_config": offload_config(args),
        "pd": args.pd,
        "fast_standins": args.fast_standins,
        "index_topk": args.topk,
        "points": [serve_point(args, n, out_dir) for n in args.lengths],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("sizing")
    s.add_argument("--budget-gb", type=float, default=30.0, help="one GPU's KV budget")
    s.add_argument("--output-len", type=int, default=1024)
    s.add_argument("--slots", type=int, default=4096)
    s.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=LENGTHS)
    v = sub.add_parser("serve")
    v.add_argument(
        "--lengths",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[128, 256, 512, 1024, 2048, 4096],
    )
    v.add_argument("--output-len", type=int, default=32)
    v.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="prompt and output lengths uniform in [ratio x len, len] (a mixed workload); 1: fixed",
    )
    v.add_argument("--concurrency", type=int, default=32)
    v.add_argument("--prompts", type=int, default=64)
    v.add_argument("--max-running", type=int, default=48)
    v.add_argument("--max-total-tokens", type=int, default=8192)
    v.add_argument("--chunked-prefill-size", type=int, default=2048)
    v.add_argument("--slots", type=int, default=128)
    v.add_argument("--topk", type=int, default=64)
    v.add_argument("--layers", type=int, default=8, help="the tiny model's layers")
    v.add_argument("--point-deadline-s", type=float, default=1200)
    v.add_argument(
        "--offload-config", type=json.loads, default={}, help="more --kv-offload-config keys"
    )
    v.add_argument("--pd", action="store_true", help="PD pairs, the flag on the decode server")
    v.add_argument(
        "--fast-standins",
        action="store_true",
        help="the stand-ins in bf16/fp32 (bench_serving_dsa.py's): counts, not tokens, at long prompts",
    )
    for sp in (s, v):
        sp.add_argument("--out", required=True)
    args = p.parse_args()
    result = run_sizing(args) if args.mode == "sizing" else run_serve(args)
    Path(args.out).write_text(results_json(result))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
