"""Per-layer sparse-slot budgets: how many hits would a ragged split of the same slots buy?

Layers differ in churn, so the same sparse slots per request in every layer (what kv offload and
HiSparse do) may not be the best split of a fixed GPU budget. This benchmark answers that before
any pool is made ragged: it replays realistic top-k traces (``traces.py``) through an LRU per layer
and request (the policy of kv offload's plan kernel and of HiSparse 0.5.23, whose hit rates agree
within 0.05 points on these traces; see docs/kv_offload.md) and compares, on the same steps:

* ``uniform``: ``--slots`` per request in every layer;
* ``per_layer``: the same total, split by measured hit statistics: each layer's hit curve is
  measured on the first ``--calibrate`` steps at several budgets, then slots go, in ``--unit``
  steps, to whichever layer gains the most hits from them (greedy on the measured marginal gains),
  never below top-k (a step's selection must fit);
* ``oracle``: the split that the evaluated steps' own hit curves (measured from cold caches) pick:
  what knowing the future would buy.

Hit rates are counted after ``--warm`` steps (cold caches excluded) on the steps after the
calibration. The LRU is a torch replay (a recency per position, evict the least
recently used resident that the current step does not select, in the plan's order; a test checks
it hit for hit against ``lru_ref.plan_layer_ref``); it is a policy simulation, so it runs on the
CPU and makes no timing claims.

    python3 benchmark/kv_offload/bench_layer_budgets.py --out results/bench_layer_budgets.json

The measured split is what ``--kv-offload-config``'s ``layer_slots_per_req`` takes: with
``--emit-config FILE`` (one trace: one ``--share`` and ``--churn-spread``) the script writes that
config, ``{"sparse_slots_per_req": --slots, "layer_slots_per_req": [...]}``, for a server whose
model has ``--layers`` layers. ``--trace-file`` replays recorded top-k instead of a generated trace:
a ``torch.save``'d int tensor ``(steps, layers, requests, topk)`` of positions (unique per row and
step, each below ``--ctx``); its shape sets ``--layers``, ``--batch`` and ``--topk``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traces as realistic  # noqa: E402
from bench_common import write_results  # noqa: E402

NEVER = -1


def lru_hits(trace: torch.Tensor, capacity: torch.Tensor, context: int, first: int) -> torch.Tensor:
    """Hits per row of an LRU of ``capacity[row]`` positions replaying ``trace``.

    ``trace``: ``(steps, rows, topk)`` positions (unique per row and step); ``capacity``: ``(rows,)``
    with every entry >= topk. Returns ``(rows,)`` hits counted from step ``first`` on. The order
    is the plan's (``lru_ref.plan_layer_ref``): after a step its hits are the most recent but the
    step's loads, hits keeping their previous relative order and loads their order in the row.
    """
    steps, rows, topk = trace.shape
    if int(capacity.min()) < topk:
        raise ValueError(f"capacity {int(capacity.min())} below top-k {topk}: a step cannot fit")
    # recency[row, position]: step * topk + rank within that step (larger is more recent).
    recency = torch.full((rows, context), NEVER, dtype=torch.int64)
    hits = torch.zeros(rows, dtype=torch.int64)
    row_ids = torch.arange(rows)[:, None]
    in_row = torch.arange(topk).expand(rows, -1)
    for t in range(steps):
        sel = trace[t].to(torch.int64)
        prev = recency[row_ids, sel]
        hit = prev != NEVER
        if t >= first:
            hits += hit.sum(dim=1)
        order = torch.where(hit, prev, t * topk + in_row).argsort(dim=1)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, in_row)
        recency[row_ids, sel] = t * topk + rank
        excess = (recency != NEVER).sum(dim=1) - capacity
        if int(excess.max()) <= 0:
            continue
        # Evict the ``excess`` least recent residents (never this step's: capacity >= topk).
        key = torch.where(recency == NEVER, torch.iinfo(torch.int64).max, recency)
        by_age = key.argsort(dim=1)
        age = torch.empty_like(by_age)
        age.scatter_(1, by_age, torch.arange(context).expand(rows, -1))
        recency[age < excess.clamp(min=0)[:, None]] = NEVER
    return hits


def layer_hits(trace: torch.Tensor, split: Sequence[int], context: int, first: int) -> torch.Tensor:
    """``(layers,)`` hits of each layer of ``trace`` (``(steps, layers, batch, topk)``, all
    requests) with ``split[layer]`` slots per request, counted from step ``first`` on."""
    steps, layers, batch, topk = trace.shape
    cap = torch.tensor(split, dtype=torch.int64).repeat_interleave(batch)
    hits = lru_hits(trace.reshape(steps, layers * batch, topk), cap, context, first)
    return hits.view(layers, batch).sum(dim=1)


def hit_curves(
    trace: torch.Tensor, budgets: Sequence[int], context: int, first: int
) -> torch.Tensor:
    """``(layers, len(budgets))`` hits of each layer (all requests) at each per-request budget."""
    layers = trace.shape[1]
    return torch.stack([layer_hits(trace, [b] * layers, context, first) for b in budgets], dim=1)


def split_budget(curves: torch.Tensor, budgets: Sequence[int], total: int) -> List[int]:
    """Per-layer budgets (entries of ``budgets``) summing to at most ``total``, greedily giving each
    next step of ``budgets`` to the layer whose measured hits grow most per slot."""
    layers = curves.shape[0]
    level = [0] * layers
    spent = budgets[0] * layers
    if spent > total:
        raise ValueError(f"{total} slots cannot give {layers} layers {budgets[0]} each")
    while True:
        best, best_gain = -1, 0.0
        for layer in range(layers):
            j = level[layer]
            if j + 1 >= len(budgets) or spent + budgets[j + 1] - budgets[j] > total:
                continue
            gain = float(curves[layer, j + 1] - curves[layer, j]) / (budgets[j + 1] - budgets[j])
            if gain > best_gain:
                best, best_gain = layer, gain
        if best < 0:
            return [budgets[j] for j in level]
        spent += budgets[level[best] + 1] - budgets[level[best]]
        level[best] += 1


def evaluate(trace: torch.Tensor, split: Sequence[int], context: int, first: int) -> float:
    """Hit rate of ``trace`` (``(steps, layers, batch, topk)``) with per-layer budgets ``split``."""
    steps, layers, batch, topk = trace.shape
    hits = layer_hits(trace, split, context, first)
    return int(hits.sum()) / ((steps - first) * layers * batch * topk)


def load_trace(a) -> torch.Tensor:
    """A recorded ``(steps, layers, requests, topk)`` trace; sets ``a.layers/batch/topk`` from it."""
    trace = torch.load(a.trace_file, map_location="cpu")
    if not isinstance(trace, torch.Tensor) or trace.dim() != 4 or trace.is_floating_point():
        raise ValueError(
            f"--trace-file {a.trace_file}: need an int tensor (steps, layers, requests, topk), got "
            f"{type(trace).__name__} {getattr(trace, 'shape', '')}"
        )
    steps = a.calibrate + a.steps
    if trace.shape[0] < steps or int(trace.min()) < 0 or int(trace.max()) >= a.ctx:
        raise ValueError(
            f"--trace-file {a.trace_file}: {trace.shape[0]} steps with positions in "
            f"[{int(trace.min())}, {int(trace.max())}]; need >= {steps} steps (--calibrate + "
            f"--steps) and positions in [0, --ctx {a.ctx})"
        )
    _, a.layers, a.batch, a.topk = trace.shape
    return trace[:steps]


def emit_config(path: str, slots: int, split: Sequence[int]) -> Dict:
    """Write the ``--kv-offload-config`` that runs ``split`` in the server; return it."""
    config = {"sparse_slots_per_req": slots, "layer_slots_per_req": list(split)}
    Path(path).write_text(json.dumps(config) + "\n")
    print(f"wrote {path}: --kv-offload-config '{json.dumps(config)}'", flush=True)
    return config


def run(a) -> Dict:
    cfg = realistic.TraceConfig(
        batch=a.batch,
        context=a.ctx,
        topk=a.topk,
        layers=a.layers,
        steps=a.calibrate + a.steps,
        churn=a.churn,
        churn_spread=a.churn_spread,
        share=a.share,
        seed=a.seed,
    )
    t0 = time.time()
    trace = load_trace(a) if a.trace_file else realistic.generate(cfg)
    stats = realistic.measure(trace[:, :, :1])
    calib, test = trace[: a.calibrate], trace[a.calibrate :]
    budgets = list(range(a.topk, a.max_slots + 1, a.unit))
    if a.slots not in budgets:
        raise ValueError(f"--slots {a.slots} is not top-k plus a multiple of --unit {a.unit}")
    total = a.slots * a.layers
    curves = hit_curves(calib, budgets, a.ctx, a.warm)
    measured = split_budget(curves, budgets, total)
    oracle = split_budget(hit_curves(test, budgets, a.ctx, a.warm), budgets, total)
    counted = (a.calibrate - a.warm) * a.batch * a.topk
    # The evaluated steps continue the calibration's caches: replay the whole trace and count the
    # evaluated steps only.
    first = a.calibrate + a.warm
    result = {
        "uniform": evaluate(trace, [a.slots] * a.layers, a.ctx, first),
        "per_layer": evaluate(trace, measured, a.ctx, first),
        "oracle": evaluate(trace, oracle, a.ctx, first),
    }
    return dict(
        args=vars(a),
        trace_stats=stats,
        # Calibration hit rate per layer at each uniform budget: the curves the split reads.
        budgets=budgets,
        layer_hit_curves=(curves.double() / counted).tolist(),
        uniform_hit_curve=(curves.sum(dim=0).double() / (counted * a.layers)).tolist(),
        split_measured=measured,
        split_oracle=oracle,
        hit_rate=result,
        gain_points=100 * (result["per_layer"] - result["uniform"]),
        seconds=round(time.time() - t0, 1),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2, help="requests (rows per layer)")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--slots", type=int, default=4096, help="uniform sparse slots per request")
    p.add_argument("--max-slots", type=int, default=8192, help="largest per-layer budget")
    p.add_argument("--unit", type=int, default=512, help="budget step (slots)")
    p.add_argument("--calibrate", type=int, default=24, help="steps that measure the hit curves")
    p.add_argument("--steps", type=int, default=24, help="steps evaluated after the calibration")
    p.add_argument("--warm", type=int, default=4, help="steps not counted (cold caches)")
    p.add_argument("--churn", type=float, default=0.4)
    p.add_argument(
        "--churn-spread",
        default="0.5",
        help="layer churn in churn * [1 - spread, 1 + spread]; a comma list runs each",
    )
    p.add_argument(
        "--share",
        default="0.97",
        help="adjacent layers' relevance correlation; a comma list runs each (with each spread)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-file", help="recorded top-k to replay instead of a generated trace")
    p.add_argument("--emit-config", help="write the measured split as a --kv-offload-config")
    p.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "bench_layer_budgets.json")
    )
    a = p.parse_args()
    rows = []
    grid = [
        (float(share), float(spread))
        for share in a.share.split(",")
        for spread in a.churn_spread.split(",")
    ]
    if (a.emit_config or a.trace_file) and len(grid) > 1:
        p.error("--emit-config and --trace-file take one trace: one --share and --churn-spread")
    for share, spread in grid:
        point = argparse.Namespace(**{**vars(a), "churn_spread": spread, "share": share})
        del point.out
        r = run(point)
        rows.append(r)
        h = r["hit_rate"]
        print(
            f"share {share} churn spread {spread}: adjacent-layer overlap "
            f"{r['trace_stats']['adjacent_layer_overlap']:.2f}, measured churn/layer "
            f"{min(r['trace_stats']['churn_per_layer']):.2f}-"
            f"{max(r['trace_stats']['churn_per_layer']):.2f}; hit rate uniform {h['uniform']:.4f}, "
            f"per-layer {h['per_layer']:.4f} ({r['gain_points']:+.2f} points), oracle "
            f"{h['oracle']:.4f}; split {r['split_measured']}; uniform hit rate by slots "
            + ", ".join(f"{b}: {x:.3f}" for b, x in zip(r["budgets"], r["uniform_hit_curve"])),
            flush=True,
        )
    write_results(a.out, dict(rows=rows))
    if a.emit_config:
        emit_config(a.emit_config, a.slots, rows[0]["split_measured"])


if __name__ == "__main__":
    main()
