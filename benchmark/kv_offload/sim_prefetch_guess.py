"""How good is the cross-layer prefetch's guess? A CPU simulation of the per-layer LRU on traces.

Replays realistic top-k traces (``traces.py``) through one exact LRU of ``--slots`` tokens per layer
and request (a hit moves to the most recent end; a miss evicts the least recent), with the prefetch
as the adapter runs it: after layer L's own plan, an ordinary plan of
layer L+1's LRU with a guess. Per guess it reports, per selected entry, the rows loaded on the
critical path, the rows prefetched, and the share of prefetched rows that layer L+1 then selected.

Guesses:

* ``none``: no prefetch;
* ``previous_layer``: layer L's top-k (what ``prefetch_next_layer`` loads);
* ``two_layers``: the entries of layer L's top-k that layer L-1 selected too (built in 14556ee and
  reverted: on the H200 it moved the rows predicted here, but its sort cost more than they saved;
  docs/kv_offload.md, "A guess from two layers").

Simplifications: no GPU tail (every selected token is either in a slot or loaded), no request
growth within the replay, and one plan's entries take the most recent places in row order (the plan
kernel keeps its hits in their earlier relative order, then its loads; only the order among one
step's entries differs); timing is not modelled (``bench_exposed.py`` measures that).
``bench_layer_budgets.lru_hits`` replays the plan's exact order, vectorised, but counts only hits of
fixed-width rows, not which tokens each plan loads, which the guess's accounting needs.

    python benchmark/kv_offload/sim_prefetch_guess.py --out results/sim_prefetch_guess.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traces as realistic  # noqa: E402
from bench_common import write_results  # noqa: E402

GUESSES = ("none", "previous_layer", "two_layers")


def _access(
    lru: "collections.OrderedDict[int, None]", tokens: Iterable[int], slots: int
) -> List[int]:
    """One plan of ``tokens`` against ``lru``; returns the tokens it loads."""
    loads = []
    for t in tokens:
        if t in lru:
            lru.move_to_end(t)
        else:
            loads.append(t)
            lru[t] = None
            if len(lru) > slots:
                lru.popitem(last=False)
    return loads


def simulate(trace: torch.Tensor, slots: int, guess: str, warm: int) -> Dict[str, float]:
    """Replay ``trace`` ``(steps, layers, batch, topk)``; counts after ``warm`` steps, per selected."""
    steps, layers, batch, _ = trace.shape
    lrus = [[collections.OrderedDict() for _ in range(batch)] for _ in range(layers)]
    n = collections.Counter()
    for s in range(steps):
        prefetched: Dict[tuple, Set[int]] = {}
        previous: List[Set[int]] = [set() for _ in range(batch)]  # layer L-1's top-k, this step
        for layer in range(layers):
            for r in range(batch):
                cur = [t for t in trace[s, layer, r].tolist() if t >= 0]
                loads = _access(lrus[layer][r], cur, slots)
                chosen = set(cur)
                if s >= warm:
                    n["selected"] += len(cur)
                    n["critical"] += len(loads)
                    n["used"] += len(prefetched.get((layer, r), set()) & chosen)
                if guess != "none" and layer + 1 < layers:
                    rows = cur
                    if guess == "two_layers" and layer > 0:
                        rows = [t for t in cur if t in previous[r]]
                    pre = _access(lrus[layer + 1][r], rows, slots)
                    prefetched[(layer + 1, r)] = set(pre)
                    if s >= warm:
                        n["prefetched"] += len(pre)
                previous[r] = chosen
    sel = max(n["selected"], 1)
    return dict(
        critical_per_selected=n["critical"] / sel,
        prefetched_per_selected=n["prefetched"] / sel,
        used_of_prefetched=n["used"] / max(n["prefetched"], 1),
        moved_per_selected=(n["critical"] + n["prefetched"]) / sel,
    )


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    realistic.add_sweep_arguments(p, steps=14, shares="0.9,0.97,0.99")
    p.add_argument("--slots", default="4096", help="slots per request; a comma list runs each")
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--out", default="sim_prefetch_guess.json")
    a = p.parse_args(argv)
    rows = []
    for share, churn, cfg in realistic.sweep(a):
        trace = realistic.generate(cfg)
        stats = realistic.measure(trace)
        for slots in (int(x) for x in a.slots.split(",")):
            row = dict(share=share, churn=churn, slots=slots, trace_stats=stats)
            row.update({g: simulate(trace, slots, g, a.warm) for g in GUESSES})
            rows.append(row)
            print(
                f"share {share} churn {churn} slots {slots}: "
                + " | ".join(
                    f"{g} critical {row[g]['critical_per_selected']:.3f} prefetched "
                    f"{row[g]['prefetched_per_selected']:.3f} "
                    f"used {row[g]['used_of_prefetched']:.2f}"
                    for g in GUESSES
                ),
                flush=True,
            )
    out = dict(args=vars(a), rows=rows)
    write_results(a.out, out)
    return out


if __name__ == "__main__":
    main()
