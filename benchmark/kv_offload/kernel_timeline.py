"""Where a replayed decode step's time goes, per layer, from its CUDA kernel trace.

``profile_kernels(fn)`` runs ``fn`` (e.g. one CUDA-graph replay) under ``torch.profiler`` and
returns its kernels (name, stream, start and end in us). ``layer_breakdown`` splits a step of
layers at the forward stream's attention reads and reports, as medians over the layer boundaries,
what sits between one layer's compute and the next layer's attention read (the offload's part of
the critical path): its length, the forward stream's own kernels in it and the time it idles
(waiting on an event), the side streams' busy time in it, and how long a forward-stream copy ran
beside a side-stream copy (two loads sharing the host link). ``bench_exposed.py --timeline``
records it for each variant.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Sequence, Set, Tuple


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float  # us
    end: float


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
        Kernel(e["name"], int(e["args"]["stream"]), float(e["ts"]), float(e["ts"]) + e["dur"])
        for e in events
        if e.get("cat") == "kernel"
    ]
    return sorted(out, key=lambda k: k.start)


def _busy(intervals: Iterable[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total, reach = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= reach:
            continue
        total += e - max(s, reach)
        reach = e
    return total


def _overlap(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> float:
    """Time during which some interval of ``a`` and some interval of ``b`` both run."""
    return sum(_busy(b, s, e) for s, e in a)


def layer_breakdown(
    kernels: Sequence[Kernel], compute_names: Set[str], read_name: str, copy_tag: str
) -> Dict:
    """Per-layer medians (ms) of a step's kernels; see the module docstring.

    ``compute_names``: the kernels of the compute alone (everything else is the offload's);
    ``read_name``: the kernel that starts each layer's compute (the attention read);
    ``copy_tag``: a substring of the host -> device copy kernels' names.
    """
    reads = [k for k in kernels if k.name == read_name]
    if len(reads) < 2:
        return dict(error=f"{len(reads)} '{read_name}' kernels: no layer boundary to split at")
    fw = reads[0].stream
    rows: List[Dict] = []
    for prev, read in zip(reads, reads[1:]):
        layer = [k for k in kernels if k.stream == fw and prev.start <= k.start < read.start]
        compute_end = max(k.end for k in layer if k.name in compute_names)
        fw_offload = [k for k in layer if k.name not in compute_names]
        side = [
            k for k in kernels if k.stream != fw and k.start < read.start and k.end > prev.start
        ]
        fw_copies = [(k.start, k.end) for k in fw_offload if copy_tag in k.name]
        side_copies = [(k.start, k.end) for k in side if copy_tag in k.name]
        by_name: Dict[str, float] = {}
        for k in fw_offload:
            by_name[k.name] = by_name.get(k.name, 0.0) + k.end - k.start
        side_by_name: Dict[str, float] = {}
        for k in side:
            if prev.start <= k.start < read.start:
                side_by_name[k.name] = side_by_name.get(k.name, 0.0) + k.end - k.start
        gap = read.start - compute_end
        rows.append(
            dict(
                gap=gap,
                compute=compute_end - prev.start,
                fw=by_name,
                fw_idle=gap
                - _busy(((k.start, k.end) for k in fw_offload), compute_end, read.start),
                side=side_by_name,
                side_in_gap=_busy(((k.start, k.end) for k in side), compute_end, read.start),
                copies_together=_overlap(fw_copies, side_copies),
            )
        )

    def med(values: List[float]) -> float:
        return round(statistics.median(values) / 1e3, 4)

    def med_by_name(key: str) -> Dict[str, float]:
        names = sorted({n for r in rows for n in r[key]})
        return {n: med([r[key].get(n, 0.0) for r in rows]) for n in names}

    return dict(
        boundaries=len(rows),
        gap_ms=med([r["gap"] for r in rows]),
        compute_ms=med([r["compute"] for r in rows]),
        forward_kernels_ms=med_by_name("fw"),
        forward_idle_ms=med([r["fw_idle"] for r in rows]),
        side_kernels_ms=med_by_name("side"),
        side_busy_in_gap_ms=med([r["side_in_gap"] for r in rows]),
        copies_together_ms=med([r["copies_together"] for r in rows]),
    )
