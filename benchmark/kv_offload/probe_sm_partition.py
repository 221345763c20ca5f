"""Can the host gather hide under a decode layer's compute when the two own disjoint SMs? One-run probe.

``bench_exposed.py`` found that the cross-layer prefetch's SM gather does not run beside the
layer's GEMMs: cuBLAS kernels fill every SM, so the side stream's programs mostly run after them.
CUDA green contexts partition the SMs. On the GPU machine, this times

* ``compute``: ``bench_exposed.LayerCompute`` at ``--bs`` (the stand-in for one DeepSeek-V3.2 layer
  on one TP8 / EP8 rank), ``--layers`` times;
* ``copy``: ``transfer.copy_rows`` of ``--rows`` random 656 B rows from a pinned host buffer of
  ``--host-gb`` into device rows (the miss load's launch shape), ``--layers`` times;

each alone and both at once: on two ordinary streams (the copy's at the highest priority, as the
prefetch runs today), and for each ``n`` in ``--copy-sms`` with the copy on a green context of
``n`` SMs and the compute on a green context of the other SMs (kv offload's ``SmPartition``), or on an
ordinary stream over every SM (``green-copy-only``: only the copy's stream changed). ``overlap = (compute + copy - both) /
min(compute, copy)``: 1 when the shorter one hides completely, 0 when they serialize. A mode that
cannot run (no green-context support in the driver) is recorded with its error.

    source scripts/gpu_env.sh
    python3 benchmark/kv_offload/probe_sm_partition.py --out results/probe_sm_partition-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import FP8_ROW_BYTES, prepare_environment, write_results  # noqa: E402


def timed(streams: List[torch.cuda.Stream], works: List[Callable[[], None]], iters: int) -> float:
    """Median ms of running ``works[i]`` on ``streams[i]``, all at once, from one start to all done."""
    main = torch.cuda.current_stream()
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for stream, work in zip(streams, works):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work()
        for stream in streams:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument(
        "--rows", type=int, default=75224, help="rows per layer (bs 128 misses, realistic trace)"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--host-gb", type=float, default=8.0)
    p.add_argument("--copy-sms", default="8,16,32,64")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "probe_sm_partition.json")
    )
    a = p.parse_args()
    prepare_environment("cuda")
    from bench_exposed import LayerCompute
    from sglang.srt.mem_cache.sparsity.kv_offload import transfer
    from sglang.srt.mem_cache.sparsity.kv_offload.sm_partition import SmPartition

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    compute = LayerCompute(a.bs, a.topk, dev)
    kv_rows = torch.randint(0, 256, (a.bs * a.topk, FP8_ROW_BYTES), dtype=torch.uint8, device=dev)
    read_rows = torch.randperm(kv_rows.shape[0], device=dev)[: a.bs * a.topk].view(a.bs, a.topk)
    host_rows = int(a.host_gb * 1e9) // FP8_ROW_BYTES
    host = torch.empty((host_rows, FP8_ROW_BYTES), dtype=torch.uint8, pin_memory=True)
    host[:: max(1, host_rows // 4096)].fill_(7)
    dst = torch.zeros((a.rows, FP8_ROW_BYTES), dtype=torch.uint8, device=dev)
    src_idx = [
        torch.randperm(host_rows, device=dev)[: a.rows].to(torch.int64) for _ in range(a.layers)
    ]
    dst_idx = torch.arange(a.rows, dtype=torch.int64, device=dev)
    config = transfer.default_load_launch_config(dev)

    def run_compute() -> None:
        for _ in range(a.layers):
            compute(kv_rows, read_rows)

    def run_copy() -> None:
        for idx in src_idx:
            transfer.copy_rows(host, dst, idx, dst_idx, config=config)

    run_compute(), run_copy()
    torch.cuda.synchronize()
    mb = a.rows * FP8_ROW_BYTES / 1e6
    res: Dict = dict(
        meta=dict(
            device=torch.cuda.get_device_name(dev), sms=sms, torch=torch.__version__, args=vars(a)
        ),
        copy_mb_per_layer=mb,
        modes=[],
    )

    def record(name: str, streams: Callable[[], Dict]) -> None:
        entry: Dict = dict(mode=name)
        try:
            lanes = streams()
            compute_s, copy_s = lanes.pop("compute"), lanes.pop("copy")
            entry.update(lanes)
            c = timed([compute_s], [run_compute], a.iters) / a.layers
            x = timed([copy_s], [run_copy], a.iters) / a.layers
            both = timed([compute_s, copy_s], [run_compute, run_copy], a.iters) / a.layers
            entry.update(
                compute_ms=c,
                copy_ms=x,
                copy_GBps=mb / x,
                both_ms=both,
                overlap=(c + x - both) / min(c, x),
            )
        except Exception as e:  # noqa: BLE001 (a probe records what did not run)
            entry["error"] = f"{type(e).__name__}: {e}"
        res["modes"].append(entry)
        print(json.dumps(entry), flush=True)

    def partition(n: int) -> Dict:
        part = SmPartition(n, dev, with_remainder=True)
        return dict(
            copy_sms=part.sms,
            compute_sms=part.rest_sms,
            compute=part.rest_stream,
            copy=part.stream,
        )

    high = torch.cuda.Stream.priority_range()[1]
    main = torch.cuda.Stream()
    record(
        "streams",
        lambda: dict(
            copy_sms=sms,
            compute_sms=sms,
            compute=torch.cuda.Stream(),
            copy=torch.cuda.Stream(priority=high),
        ),
    )
    for n in (int(v) for v in a.copy_sms.split(",")):
        record("green", lambda n=n: partition(n))
    for n in (int(v) for v in a.copy_sms.split(",")):
        # Only the copy confined (what swapping the prefetch's side stream alone would give).
        record("green-copy-only", lambda n=n: dict(partition(n), compute_sms=sms, compute=main))
    full = res["modes"][0]
    if "compute_ms" in full:
        for m in res["modes"]:
            if "both_ms" in m:
                m["exposed_ms"] = m["both_ms"] - full["compute_ms"]
    write_results(a.out, res)


if __name__ == "__main__":
    main()
