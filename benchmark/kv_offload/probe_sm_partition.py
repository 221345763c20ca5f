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
``n`` SMs and the compute on a green context of the other SMs (kv offload's ``SmPartition``), or
on an ordinary stream over every SM (``green-copy-only``: only the copy's stream changed).
``overlap = (compute + copy - both) / min(compute, copy)``: 1 when the shorter one hides
completely, 0 when they serialize. A mode that cannot run (no green-context support in the driver)
is recorded with its error.

``--partners N`` asks why the compute runs longer beside the copy even on SMs of its own
(``bench_exposed.py --compute-confined``): with the copy's green context of ``N`` SMs and the
compute on the other SMs' green context, it times the compute alone and beside each partner on the
partition, each repeated to outlast the compute: the host gather at several grid sizes
(``--host-programs``; ``--host-region-gb``: from smaller regions, whose translations stay
warmer; ``--vmm``: from a ``cuMemCreate`` host buffer of 2 MB granularity; ``--host-writes``: the
same rows written to the host, the backups' direction), the same gather from a device buffer of the
same size (``--device-programs``: HBM traffic at rates from below to far above the host's), and a
kernel that only computes (as long as the host gather; SMs busy, no memory traffic).
``slowdown`` = compute beside / alone - 1. With ``--clocks``, ``nvidia-smi`` samples the SM clock
and the power while each pair runs for a second.

``--backups`` times what a co-located server does while a prompt's pages are backed up: the
compute on an ordinary stream over every SM beside ``copy_rows`` of ``--rows`` contiguous device
rows per layer to contiguous host rows on another ordinary stream of priority 0 (the controller's
``write_stream``), with the backups' launch shape (``default_backup_launch_config``), their former
one (``default_launch_config``: 4 programs per SM) and others (``--backup-programs``).

    source scripts/gpu_env.sh
    python3 benchmark/kv_offload/probe_sm_partition.py --out results/probe_sm_partition-h200.json
    python3 benchmark/kv_offload/probe_sm_partition.py --gemm persistent --partners 16 --clocks \
        --out results/probe_sm_partition_partners-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import FP8_ROW_BYTES, prepare_environment, write_results  # noqa: E402
from probe_host_mapping import _alloc, _free, _launch_gather  # noqa: E402


def timed(
    streams: List[torch.cuda.Stream], works: List[Callable[[], None]], iters: int
) -> Tuple[float, List[float]]:
    """Medians over ``iters`` runs of ``works[i]`` on ``streams[i]``, all started at once: ms from
    the start to all done, and ms from the start to each stream's end."""
    main = torch.cuda.current_stream()
    times: List[float] = []
    spans: List[List[float]] = [[] for _ in streams]
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
        start.record(main)
        for stream, work, done in zip(streams, works, ends):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work()
            done.record(stream)
        for stream in streams:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
            for span, done in zip(spans, ends):
                span.append(start.elapsed_time(done))
    return statistics.median(times), [statistics.median(span) for span in spans]


@triton.jit
def _spin_kernel(out_ptr, iters, BLOCK: tl.constexpr):
    """Arithmetic only: keeps its SMs busy for ``iters`` steps with no memory traffic."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = offs.to(tl.float32)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(out_ptr + offs, x)


class ClockSampler:
    """``nvidia-smi`` sampling the SM clock (MHz) and board power (W) every 20 ms while open."""

    QUERY = "clocks.sm,power.draw"

    def __init__(self, index: int):
        self.cmd = ["nvidia-smi", f"--id={index}", f"--query-gpu={self.QUERY}"]
        self.cmd += ["--format=csv,noheader,nounits", "-lms", "20"]
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ClockSampler":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # nvidia-smi's start-up
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        out = self.proc.communicate()[0]
        rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
        samples = [(float(a), float(b)) for a, b in rows if a.strip() and b.strip()][5:]
        self.result = dict(
            samples=len(samples),
            sm_mhz=statistics.median(c for c, _ in samples) if samples else None,
            power_w=statistics.median(w for _, w in samples) if samples else None,
        )


def partners_probe(a: argparse.Namespace, compute, run_compute, host, dst, src_idx) -> Dict:
    """``--partners``: the confined compute alone and beside each partner on the partition.
    ``run_compute`` runs ``compute`` over every layer (main's)."""
    from sglang.srt.mem_cache.sparsity.kv_offload import transfer
    from sglang.srt.mem_cache.sparsity.kv_offload.sm_partition import SmPartition

    dev = dst.device
    part = SmPartition(a.partners, dev, with_remainder=True)
    if compute.persistent:  # a persistent grid of the SMs the compute has
        compute.carveout = dict(attn=part.sms, moe=part.sms)
    device_src = torch.empty_like(host, device=dev)
    device_src[:: max(1, host.shape[0] // 4096)].fill_(7)
    dst_idx = torch.arange(a.rows, dtype=torch.int64, device=dev)
    spin_out = torch.empty(part.sms * 4 * 512, dtype=torch.float32, device=dev)
    keep: List = []  # host buffers the partners read, alive until the probe ends

    def copier(
        src, programs: int, repeat: int, indices: List[torch.Tensor] = src_idx, scatter=False
    ) -> Callable[[], None]:
        """A gather of ``indices`` from ``src`` (a tensor, or a raw VMM address) ``repeat`` times;
        with ``scatter``, the same rows written from the device rows to those host rows instead."""
        config = transfer.CopyLaunchConfig(num_programs=programs, rows_per_program=1, num_warps=4)

        def run() -> None:
            for _ in range(repeat):
                for idx in indices:
                    if scatter:
                        transfer.copy_rows(dst, src, dst_idx, idx, config=config)
                    elif isinstance(src, int):
                        _launch_gather(src, dst, idx, dst_idx, FP8_ROW_BYTES, config)
                    else:
                        transfer.copy_rows(src, dst, idx, dst_idx, config=config)

        return run

    def spinner(iters: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(a.layers):
                _spin_kernel[(part.sms * 4,)](spin_out, iters, BLOCK=512, num_warps=4)

        return run

    def alone(stream: torch.cuda.Stream, work: Callable[[], None]) -> float:
        return timed([stream], [work], a.iters)[0]

    compute_ms = alone(part.rest_stream, run_compute)
    mb = a.rows * FP8_ROW_BYTES / 1e6 * a.layers  # one run of a gather, once over every layer
    partners: List[Tuple[str, Dict, Callable[[], None]]] = []
    host_programs = [int(v) for v in a.host_programs.split(",")]
    for programs in host_programs:
        partners.append(
            (
                f"host gather, {programs} programs",
                dict(programs=programs, mb=mb),
                copier(host, programs, 1),
            )
        )
    for gb in (float(v) for v in a.host_region_gb.split(",") if v):
        # The same gather from a region small enough for its translations to stay warm.
        region = int(gb * 1e9) // FP8_ROW_BYTES
        warm = [torch.randint(0, region, (a.rows,), device=dev) for _ in range(a.layers)]
        partners.append(
            (
                f"host gather from {gb} GB, {host_programs[0]} programs",
                dict(programs=host_programs[0], mb=mb),
                copier(host, host_programs[0], 1, warm),
            )
        )
    if a.host_writes:  # the backups' direction: device rows written to scattered host rows
        partners.append(
            (
                f"host scatter (writes), {host_programs[0]} programs",
                dict(programs=host_programs[0], mb=mb),
                copier(host, host_programs[0], 1, scatter=True),
            )
        )
    if a.vmm:  # the same buffer size from cuMemCreate on the host: large GPU pages
        vmm, vmm_ptr, vmm_info = _alloc("vmm", host.numel(), 0, dev)
        keep.append(vmm)
        for programs in host_programs:
            partners.append(
                (
                    f"host gather (VMM), {programs} programs",
                    dict(programs=programs, mb=mb, **vmm_info),
                    copier(vmm_ptr, programs, 1),
                )
            )
    for programs in (int(v) for v in a.device_programs.split(",")):
        once = alone(part.stream, copier(device_src, programs, 1))
        repeat = max(1, int(1.5 * compute_ms / once) + 1)  # outlast the compute
        partners.append(
            (
                f"device gather, {programs} programs",
                dict(programs=programs, repeat=repeat, mb=mb * repeat),
                copier(device_src, programs, repeat),
            )
        )
    host_ms = alone(part.stream, partners[0][2])
    probe_iters = 1 << 12
    per_iter = alone(part.stream, spinner(probe_iters)) / probe_iters
    spin_iters = int(max(host_ms, 1.5 * compute_ms) / per_iter)
    partners.append(("compute-only kernel", dict(iters=spin_iters), spinner(spin_iters)))

    out: Dict = dict(
        copy_sms=part.sms, compute_sms=part.rest_sms, compute_alone_ms=compute_ms / a.layers
    )
    if a.clocks:
        with ClockSampler(dev.index or 0) as idle:
            time.sleep(1.0)
        out["clocks_idle"] = idle.result
        out["clocks_compute_alone"] = sample_while(a, dev, [part.rest_stream], [run_compute])
    rows = []
    for name, params, work in partners:
        partner_ms = alone(part.stream, work)
        both, (compute_span, partner_span) = timed(
            [part.rest_stream, part.stream], [run_compute, work], a.iters
        )
        entry = dict(partner=name, **params, partner_alone_ms=partner_ms / a.layers)
        if "mb" in params:
            entry["partner_GBps"] = params["mb"] / partner_ms
        entry.update(
            compute_beside_ms=compute_span / a.layers,
            partner_beside_ms=partner_span / a.layers,
            slowdown=compute_span / compute_ms - 1,
        )
        if a.clocks:
            entry["clocks"] = sample_while(
                a, dev, [part.rest_stream, part.stream], [run_compute, work]
            )
        rows.append(entry)
        print(json.dumps(entry), flush=True)
    out["partners"] = rows
    for buf in keep:
        _free("vmm", buf)
    return out


def backups_probe(a: argparse.Namespace, run_compute, host, dst) -> Dict:
    """``--backups``: the compute on every SM beside a prompt's backup on an ordinary stream."""
    from sglang.srt.mem_cache.sparsity.kv_offload import transfer

    dev = dst.device
    rows = torch.arange(a.rows, dtype=torch.int64, device=dev)  # whole pages, in order
    compute_s, write_s = torch.cuda.Stream(), torch.cuda.Stream()  # priority 0, as the write stream

    def backup(config) -> Callable[[], None]:
        def run() -> None:
            for layer in range(a.layers):  # each layer's rows to their own host slab
                transfer.copy_rows(dst, host, rows, rows + layer * a.rows, config=config)

        return run

    compute_ms = timed([compute_s], [run_compute], a.iters)[0]
    mb = a.rows * FP8_ROW_BYTES / 1e6 * a.layers
    default = transfer.default_backup_launch_config(dev)
    former = transfer.default_launch_config(dev)  # the backups' shape before the backup default
    shapes = [(c.num_programs, c.rows_per_program) for c in (default, former)]
    for text in (v for v in a.backup_programs.split(",") if v):
        programs, _, tile = text.partition(":")
        shapes.append((int(programs), int(tile or default.rows_per_program)))
    out: Dict = dict(compute_alone_ms=compute_ms / a.layers, backup_mb=mb, backups=[])
    for programs, tile in dict.fromkeys(shapes):
        config = dataclasses.replace(default, num_programs=programs, rows_per_program=tile)
        work = backup(config)
        alone = timed([write_s], [work], a.iters)[0]
        both, (compute_span, backup_span) = timed(
            [compute_s, write_s], [run_compute, work], a.iters
        )
        entry = dict(  # the backup's times are for all --layers, the compute's per layer
            programs=programs,
            rows_per_program=tile,
            backup_alone_ms=alone,
            backup_GBps=mb / alone,
            backup_beside_ms=backup_span,
            compute_beside_ms=compute_span / a.layers,
            slowdown=compute_span / compute_ms - 1,
            both_ms=both,
        )
        out["backups"].append(entry)
        print(json.dumps(entry), flush=True)
    return out


def sample_while(a, dev, streams, works) -> Dict:
    """The clocks while ``works`` run on ``streams`` back to back for about a second."""
    with ClockSampler(dev.index or 0) as sampler:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            timed(streams, works, 1)
    return sampler.result


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
    p.add_argument("--gemm", choices=("cublas", "persistent"), default="cublas")
    p.add_argument(
        "--partners",
        type=int,
        default=0,
        help="copy SMs of the partners probe (module docstring); 0: the modes above instead",
    )
    p.add_argument("--host-programs", default="16896,2048,512", help="--partners host grids")
    p.add_argument("--device-programs", default="16,64,256,2048", help="--partners device grids")
    p.add_argument("--clocks", action="store_true", help="--partners: sample SM clock and power")
    p.add_argument(
        "--host-region-gb",
        default="",
        help="--partners: also the host gather from random rows of the first GB, e.g. 0.25,2.75",
    )
    p.add_argument(
        "--backups",
        action="store_true",
        help="instead: the compute on every SM beside a prompt's backup (module docstring)",
    )
    p.add_argument(
        "--backup-programs",
        default="",
        help="--backups: launch shapes besides the backups' default and former default, "
        "programs[:rows per tile]",
    )
    p.add_argument(
        "--host-writes",
        action="store_true",
        help="--partners: also the same rows written device -> host (the backups' direction)",
    )
    p.add_argument(
        "--vmm",
        action="store_true",
        help="--partners: also the host gather from a cuMemCreate host buffer (2 MB granularity)",
    )
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
    compute = LayerCompute(a.bs, a.topk, dev, gemm=a.gemm)
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
    if a.backups:
        res.pop("modes")
        res.update(backups_probe(a, run_compute, host, dst))
        write_results(a.out, res)
        return
    if a.partners:
        res.pop("modes")
        res.update(partners_probe(a, compute, run_compute, host, dst, src_idx))
        write_results(a.out, res)
        return

    def record(name: str, streams: Callable[[], Dict]) -> None:
        entry: Dict = dict(mode=name)
        try:
            lanes = streams()
            compute_s, copy_s = lanes.pop("compute"), lanes.pop("copy")
            entry.update(lanes)
            c = timed([compute_s], [run_compute], a.iters)[0] / a.layers
            x = timed([copy_s], [run_copy], a.iters)[0] / a.layers
            both = timed([compute_s, copy_s], [run_compute, run_copy], a.iters)[0] / a.layers
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
