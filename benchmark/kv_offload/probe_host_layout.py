"""Does the host pool's layout change the gather rate of a decode step? One-run probe (GPU).

The host pool is ``layer_first`` (``KVOffloadHostPool``): layer ``l`` of token slot ``t`` is row
``l * N + t``, so one layer's rows sit in one ``N * row_bytes`` slab and consecutive layers read
different slabs. In ``page_first`` order (row ``t * L + l``) a token's layers are adjacent, so the
rows that layer ``l + 1`` reads for the tokens layer ``l`` also selected (most of them: adjacent
layers share most of their top-k) lie in the pages layer ``l`` has just read. The miss load is
bound by address translation (``probe_host_mapping.py``), so that locality could raise its rate.

Per batch size it builds a realistic trace (``traces.py``), takes per step and layer the rows a
decode step loads, and gathers them in decode order from one pinned buffer of ``N * L`` rows, once
per layout, with the miss load's kernel and launch shape (``transfer.copy_rows``,
``default_load_launch_config``). Two orders:

* ``misses``: layer ``l``'s misses (its top-k minus its previous step's), layer after layer;
* ``prefetch``: each layer's misses, then the cross-layer prefetch's guess for layer ``l + 1``
  (layer ``l``'s top-k minus layer ``l + 1``'s previous step), as ``prefetch_next_layer`` runs.

The misses are a set difference with the previous step, not an LRU replay: the probe is about where
the rows lie, not how many there are. The first ``--warm`` steps warm up; the rest are timed as one
sequence (CUDA events), and memcpy of the same bytes from the same buffer is the ceiling.

    python3 benchmark/kv_offload/probe_host_layout.py --bs 32,64,128 --out probe_host_layout.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traces as realistic  # noqa: E402
from bench_common import FP8_ROW_BYTES, write_results  # noqa: E402
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import (  # noqa: E402
    RowView,
    copy_rows,
    default_load_launch_config,
)

LAYOUTS = ("layer_first", "page_first")
ORDERS = ("misses", "prefetch")


def _row(layout: str, layer: torch.Tensor, token: torch.Tensor, n: int, layers: int):
    return layer * n + token if layout == "layer_first" else token * layers + layer


def _minus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Entries of ``a`` (flat global token slots, -1 dropped) not in ``b``."""
    a = a[a >= 0]
    return a[~torch.isin(a, b)]


def gathers(trace: torch.Tensor, ctx: int, order: str) -> List[List[Tuple[int, torch.Tensor]]]:
    """Per step (from 1), the ``(layer, token slots)`` lists a decode step loads, in order."""
    steps, layers, bs, _ = trace.shape
    base = (torch.arange(bs, device=trace.device) * ctx).view(bs, 1)
    glob = torch.where(trace >= 0, trace + base, trace)  # request r's tokens at r * ctx + pos
    out = []
    for s in range(1, steps):
        lists = []
        for layer in range(layers):
            lists.append((layer, _minus(glob[s, layer], glob[s - 1, layer])))
            if order == "prefetch" and layer + 1 < layers:
                lists.append((layer + 1, _minus(glob[s, layer], glob[s - 1, layer + 1])))
        out.append(lists)
    return out


def time_gathers(host: RowView, dst: RowView, lists, layout: str, n: int, layers: int, cfg):
    """Time the lists gathered from ``host`` in ``layout``; returns (ms, rows)."""
    idx = []
    for layer, tokens in lists:
        src = _row(layout, torch.full_like(tokens, layer), tokens, n, layers)
        idx.append(
            (src.to(torch.int64), torch.arange(src.numel(), dtype=torch.int32, device=src.device))
        )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for src, d in idx:
        copy_rows(host, dst, src, d, config=cfg)
    end.record()
    end.synchronize()
    return start.elapsed_time(end), sum(int(s.numel()) for s, _ in idx)


def probe(a, bs: int, dev: torch.device, host_t: torch.Tensor) -> Dict:
    layers, row = a.layers, a.row_bytes
    n = bs * a.ctx
    cfg = realistic.TraceConfig.for_topk(
        a.topk,
        batch=bs,
        context=a.ctx,
        layers=layers,
        steps=a.warm + a.steps + 1,
        churn=a.churn,
        share=a.share,
        seed=a.seed,
    )
    trace = realistic.generate(cfg).to(dev)
    host = RowView(host_t[: n * layers * row].view(n * layers, row))
    dst_t = torch.empty((bs * a.topk * 2, row), dtype=torch.uint8, device=dev)
    dst = RowView(dst_t)
    lcfg = default_load_launch_config(dev)
    res: Dict = dict(bs=bs, ctx=a.ctx, layers=layers, host_gb=n * layers * row / 1e9)
    for order in ORDERS:
        per_step = gathers(trace, a.ctx, order)
        warm = [x for st in per_step[: a.warm] for x in st]
        timed = [x for st in per_step[a.warm :] for x in st]
        for layout in LAYOUTS:
            time_gathers(host, dst, warm, layout, n, layers, lcfg)
            ms, rows = time_gathers(host, dst, timed, layout, n, layers, lcfg)
            gbps = rows * row / ms / 1e6
            res[f"{order}/{layout}"] = dict(
                ms_per_layer=ms / (a.steps * layers),
                rows_per_layer=rows / (a.steps * layers),
                gb_s=gbps,
            )
            print(
                f"bs {bs} {order:8s} {layout:11s}: {rows / (a.steps * layers):8.0f} rows/layer "
                f"{ms / (a.steps * layers):.3f} ms/layer {gbps:5.1f} GB/s",
                flush=True,
            )
        nbytes = int(res[f"{order}/layer_first"]["rows_per_layer"]) * row
        flat = host_t[:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        buf.copy_(flat, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            buf.copy_(flat, non_blocking=True)
        end.record()
        end.synchronize()
        res[f"{order}/memcpy_gb_s"] = nbytes * 10 / start.elapsed_time(end) / 1e6
    return res


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bs", default="32,128")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--row-bytes", type=int, default=FP8_ROW_BYTES)
    p.add_argument("--churn", type=float, default=0.4)
    p.add_argument("--share", type=float, default=0.97)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="probe_host_layout.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    sizes = [int(x) for x in a.bs.split(",")]
    host_t = torch.empty(
        max(sizes) * a.ctx * a.layers * a.row_bytes, dtype=torch.uint8, pin_memory=True
    )
    rows = [probe(a, bs, dev, host_t) for bs in sizes]
    out = dict(
        meta=dict(device=torch.cuda.get_device_name(dev), args=vars(a), torch=torch.__version__),
        rows=rows,
    )
    write_results(a.out, out)
    return out


if __name__ == "__main__":
    main()
