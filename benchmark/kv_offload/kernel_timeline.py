"""Where a replayed decode step's time goes, per layer, from its CUDA kernel trace.

``profile_kernels(fn)`` runs ``fn`` (e.g. one CUDA-graph replay) under ``torch.profiler`` and
returns its kernels (name, stream, start and end in us). ``layer_breakdown`` splits a step of
layers at the forward stream's attention reads and reports, as medians over the layer boundaries,
what sits between one layer's compute and the next layer's attention read (the offload's part of
the critical path): its length, each offload kernel's busy time in it and the time no offload
kernel runs (waits and launch gaps), how long two copies ran at once in it (two loads sharing the
host link), the compute's length (against the compute alone: how much the offload work running
beside it slows it) and each offload kernel's busy time under it. Given the compute alone's length,
it also reports the steady-state exposed time: what one layer boundary adds to the critical path
(gap plus compute, less the compute alone), which leaves out the first layer's own load (no layer
before it prefetches for it). ``bench_exposed.py --timeline`` records it for each variant.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float  # us
    end: float
    grid: Tuple[int, ...] = ()  # blocks per dimension, where the trace records it
    block: Tuple[int, ...] = ()  # threads per block per dimension
    registers: int = 0  # per thread
    shared_memory: int = 0  # bytes per block


def profile_kernels(fn: Callable[[], None]) -> List[Kernel]:
    """The CUDA kernels ``fn`` ran, in start order (CUDA-graph replays included)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return kernels_from_trace(events)


def kernels_from_trace(events: Iterable[Dict]) -> List[Kernel]:
    """The kernel events of a chrome trace (``cat == "kernel"``), in start order."""
    out = [
        Kernel(
            e["name"],
            int(e["args"]["stream"]),
            float(e["ts"]),
            float(e["ts"]) + e["dur"],
            tuple(e["args"].get("grid", ())),
            tuple(e["args"].get("block", ())),
            int(e["args"].get("registers per thread", 0)),
            int(e["args"].get("shared memory", 0)),
        )
        for e in events
        if e.get("cat") == "kernel"
    ]
    return sorted(out, key=lambda k: k.start)


def _busy(intervals: Iterable[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total, reach = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= max(s, reach):  # outside the window, or already counted
            continue
        total += e - max(s, reach)
        reach = e
    return total


def _together(intervals: Sequence[Tuple[float, float]], lo: float, hi: float) -> float:
    """Time within ``[lo, hi]`` during which at least two of ``intervals`` run."""
    edges = sorted(
        [(max(s, lo), 1) for s, e in intervals if e > lo and s < hi]
        + [(min(e, hi), -1) for s, e in intervals if e > lo and s < hi]
    )
    total, running, last = 0.0, 0, lo
    for t, step in edges:
        if running >= 2:
            total += t - last
        running += step
        last = t
    return total


def short_name(name: str) -> str:
    """A kernel's name without its return type and arguments, at most 60 characters."""
    return name.removeprefix("void ").split("(")[0][:60]


def layer_breakdown(
    kernels: Sequence[Kernel],
    compute_names: Set[str],
    read_name: str,
    copy_tag: str,
    compute_alone_ms: Optional[float] = None,
) -> Dict:
    """Per-layer medians (ms) of a step's kernels; see the module docstring.

    ``compute_names``: the kernels of the compute alone (everything else is the offload's);
    ``read_name``: the kernel that starts each layer's compute (the attention read);
    ``copy_tag``: a substring of the host -> device copy kernels' names. Kernels are told apart by
    name and time, not by stream: a CUDA graph's replay runs its branches on streams of its own.
    ``compute_alone_ms``: the compute alone's ``compute_ms``; adds ``steady_exposed_ms``.
    """
    reads = [k for k in kernels if k.name == read_name]
    if len(reads) < 2:
        return dict(error=f"{len(reads)} '{read_name}' kernels: no layer boundary to split at")
    offload = [(short_name(k.name), k.start, k.end) for k in kernels if k.name not in compute_names]
    names = sorted({n for n, _, _ in offload})
    copies = [
        (k.start, k.end) for k in kernels if k.name not in compute_names and copy_tag in k.name
    ]

    def busy(lo: float, hi: float, name: Optional[str] = None) -> float:
        """Busy time in ``[lo, hi]`` of the offload's kernels (of one short name, or of all)."""
        return _busy(((s, e) for n, s, e in offload if name in (None, n)), lo, hi)

    rows: List[Dict] = []
    for prev, read in zip(reads, reads[1:]):
        compute_end = max(
            k.end for k in kernels if k.name in compute_names and prev.start <= k.start < read.start
        )
        rows.append(
            dict(
                gap=read.start - compute_end,
                compute=compute_end - prev.start,
                in_gap={n: busy(compute_end, read.start, n) for n in names},
                idle=read.start - compute_end - busy(compute_end, read.start),
                under_compute={n: busy(prev.start, compute_end, n) for n in names},
                copies_together=_together(copies, compute_end, read.start),
            )
        )

    def med(values: List[float]) -> float:
        return round(statistics.median(values) / 1e3, 4)

    def med_by_name(key: str) -> Dict[str, float]:
        names = sorted({n for r in rows for n in r[key]})
        return {n: med([r[key].get(n, 0.0) for r in rows]) for n in names}

    out = dict(
        boundaries=len(rows),
        gap_ms=med([r["gap"] for r in rows]),
        compute_ms=med([r["compute"] for r in rows]),
        offload_in_gap_ms=med_by_name("in_gap"),
        idle_in_gap_ms=med([r["idle"] for r in rows]),
        offload_under_compute_ms=med_by_name("under_compute"),
        copies_together_in_gap_ms=med([r["copies_together"] for r in rows]),
    )
    if compute_alone_ms is not None:
        steady = med([r["gap"] + r["compute"] for r in rows]) - compute_alone_ms
        out["steady_exposed_ms"] = round(steady, 4)
    return out
