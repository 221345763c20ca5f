"""Top-k traces that look like DeepSeek-V3.2's sparse attention, for the kv offload benchmarks.

``bench_lru.make_traces`` replaces a fixed fraction of the top-k each step with never-seen positions:
uniform churn. Real DSA top-k differs in ways that matter to a cache:

* **sink tokens**: the first positions are selected at every step of every layer;
* **a local window**: the most recent positions are always selected (and move with the context);
* **drift**: the relevance of the other positions changes a little each step, so positions near the
  selection threshold leave and come back. GVR (arXiv 2604.22312) reports that about 40 % of the
  top-2048 changes per step on average;
* **churn that differs by layer**: each layer drifts at its own rate;
* **adjacent layers share most of their top-k**: IndexCache (arXiv 2603.12201) measures 70-100 %.

Model: each layer ``l`` scores every position of a request with
``sqrt(share) * shared + sqrt(1 - share) * own_l``, both AR(1) processes over steps
(``x <- rho * x + sqrt(1 - rho^2) * noise``), and selects the sinks, the window and the best-scored
rest. ``rho`` (per layer, spread around the value that gives ``churn``) sets how fast relevance
drifts: a position near the threshold crosses it back and forth, which is what makes a cache of
recent selections useful. ``share`` sets how much adjacent layers agree. :func:`measure` reports what
a trace actually has (churn per layer, adjacent-layer overlap, returns), so results are quoted with
the measured figures, not the knobs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple, Union

import torch


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """A realistic-trace workload. Defaults follow the figures in the module docstring."""

    batch: int = 1
    context: int = 32768  # positions at the last step
    topk: int = 2048
    layers: int = 4
    steps: int = 16
    sinks: int = 4
    window: int = 128
    churn: float = 0.4  # mean fraction of the drifting part replaced per step
    churn_spread: float = 0.5  # layer churn in [churn * (1 - spread), churn * (1 + spread)]
    share: float = 0.97  # correlation of adjacent layers. relevance
    seed: int = 0

    @classmethod
    def for_topk(cls, topk: int, **fields) -> "TraceConfig":
        """A workload of ``topk`` entries whose local window keeps at most the default's share of
        them (128 of DeepSeek-V3.2's 2048: a sixteenth), so small smoke-run top-k stay drifting."""
        return cls(topk=topk, window=min(cls.window, topk // 16), **fields)


def _rho_for_churn(churn: float, free: int, pool: int, seed: int) -> float:
    """The AR(1) coefficient that gives ``churn`` of ``free`` best of ``pool`` per step (bisection
    on a small simulation; churn falls as rho rises)."""
    g = torch.Generator().manual_seed(seed)

    def measured(rho: float) -> float:
        x = torch.randn(pool, generator=g)
        prev = set(x.topk(free).indices.tolist())
        total = 0.0
        for _ in range(8):
            x = rho * x + math.sqrt(1 - rho * rho) * torch.randn(pool, generator=g)
            cur = set(x.topk(free).indices.tolist())
            total += 1 - len(cur & prev) / free
            prev = cur
        return total / 8

    lo, hi = 0.0, 0.99999
    for _ in range(30):
        mid = (lo + hi) / 2
        if measured(mid) > churn:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def generate(
    cfg: TraceConfig, device="cpu", scores: bool = False
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``(steps, layers, batch, topk)`` int32 token positions, unique per row.

    At step ``t`` the context is ``context - steps + 1 + t`` positions; every row holds the sinks,
    the window and ``topk - sinks - window`` drifting picks from the positions in between. With
    ``scores``, also the ``(steps, layers, batch, context)`` relevance each pick was ranked by
    (-inf for the sinks, the window and positions not yet in the context): what a policy that
    read the indexer's scores would know.
    """
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    free = cfg.topk - cfg.sinks - cfg.window
    if free <= 0 or cfg.context - cfg.steps < cfg.topk:
        raise ValueError(f"{cfg}: the context must exceed top-k, and top-k sinks + window")
    pool = cfg.context  # scores for every position that will exist
    middle_size = cfg.context - cfg.sinks - cfg.window
    spread = torch.linspace(1 - cfg.churn_spread, 1 + cfg.churn_spread, cfg.layers).tolist()
    rhos = [
        _rho_for_churn(min(0.95, cfg.churn * s), free, middle_size, cfg.seed + i)
        for i, s in enumerate(spread)
    ]
    shape = (cfg.batch, pool)
    shared = torch.randn(shape, generator=g, device=device)
    own = [torch.randn(shape, generator=g, device=device) for _ in range(cfg.layers)]
    a, b = math.sqrt(cfg.share), math.sqrt(1 - cfg.share)
    positions = torch.arange(pool, device=device)
    out = torch.empty((cfg.steps, cfg.layers, cfg.batch, cfg.topk), dtype=torch.int32)
    relevance = torch.empty((cfg.steps, cfg.layers, cfg.batch, pool)) if scores else None
    shared_rho = sum(rhos) / len(rhos)
    for t in range(cfg.steps):
        n = cfg.context - cfg.steps + 1 + t
        middle = (positions >= cfg.sinks) & (positions < n - cfg.window)
        fixed = torch.cat(
            [torch.arange(cfg.sinks, device=device), torch.arange(n - cfg.window, n, device=device)]
        ).expand(cfg.batch, -1)
        for layer in range(cfg.layers):
            score = (a * shared + b * own[layer]).masked_fill(~middle, -math.inf)
            picks = score.topk(free, dim=1).indices
            if scores:
                relevance[t, layer] = score.cpu()
            out[t, layer] = torch.cat([fixed, picks], dim=1).to(torch.int32).cpu()
            rho = rhos[layer]
            own[layer] = rho * own[layer] + math.sqrt(1 - rho * rho) * torch.randn(
                shape, generator=g, device=device
            )
        shared = shared_rho * shared + math.sqrt(1 - shared_rho**2) * torch.randn(
            shape, generator=g, device=device
        )
    return (out, relevance) if scores else out


def measure(trace: torch.Tensor) -> Dict[str, object]:
    """What a ``(steps, layers, batch, topk)`` trace has: per-layer mean churn (fraction of a row
    not selected at the previous step), mean adjacent-layer overlap, and the fraction of newly
    selected positions that had been selected at an earlier step (returns)."""
    steps, layers, batch, k = trace.shape
    churn: List[float] = []
    returns_new, new_total = 0, 0
    for layer in range(layers):
        per_step = []
        for r in range(batch):
            seen = set(trace[0, layer, r].tolist())
            prev = seen
            for t in range(1, steps):
                cur = set(trace[t, layer, r].tolist())
                new = cur - prev
                per_step.append(len(new) / k)
                returns_new += len(new & seen)
                new_total += len(new)
                seen |= cur
                prev = cur
        churn.append(sum(per_step) / len(per_step))
    overlap = [
        len(set(trace[t, l, r].tolist()) & set(trace[t, l + 1, r].tolist())) / k
        for t in range(steps)
        for l in range(layers - 1)
        for r in range(batch)
    ]
    return {
        "churn_per_layer": churn,
        "adjacent_layer_overlap": sum(overlap) / len(overlap) if overlap else 1.0,
        "returns": returns_new / max(new_total, 1),
    }
