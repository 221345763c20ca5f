"""Test reference: the per-layer plan (``lru_kernels.plan_layer``) in plain torch, bit for bit.

Semantics, per real batch row ``b`` (request ``r = req_pool_indices[b]``, ``n = num_slots[r]``; real
rows name distinct requests):

1. For each top-k entry ``t``: -1 stays -1; a loc with a candidate entry of request ``r``'s hint
   table (``hint_candidates``) naming a slot ``s`` with ``slot_loc[r, s] == t`` is a *hit*;
   otherwise a loc with ``loc_to_tail[t] > 0`` resolves to that tail row (no cache use); anything
   else is a *miss*.
2. Misses are de-duplicated; unique misses are ranked by first occurrence in the row.
3. The request's LRU order is split, keeping relative order, into *evictable* slots (not hit this
   step) and *needed* slots. The ``M`` unique misses take the first ``min(M, E)`` evictable slots
   (least recently used first); the hint entry naming a victim (among its old loc's candidates)
   is cleared.
4. New order: untaken evictable slots, then needed slots, then the newly loaded slots in miss rank
   (hits and loads become most recent).
5. Hints for the loads, in ``HINT_ROUNDS`` rounds over the table as the previous round left it:
   each load still without an entry (top-k entry ``k`` of its loc's first occurrence) picks the
   first empty way, in the order ``(k + w) mod 4``, of its bucket with more empty ways (the first
   bucket on a tie); with none empty, the candidate naming the least recently used slot (by the
   new order) that is not a load of this plan; with none of those either it gives up. Several
   loads picking one entry: the lowest ``k`` gets it, the others try again next round.
6. Outputs: physical rows (tail row, or ``out_cache_loc_sparse[r, slot]``); the miss list packed at
   the front of the row's ``K`` entries, -1 after; ``num_misses[b]``; the total count. (The kernel's
   default *compact* layout holds the same per-row lists back to back, rows in any order.)

Misses beyond the ``E`` evictable slots (contract violation: the request owns too few slots) resolve
to -1 and set bit 0 of the error flags; a miss whose ``loc_to_host`` is -1 sets bit 1. Padded
rows (``b >= num_real_reqs[0]``, or request row 0, upstream's padding row) get -1 outputs and
never touch the state. Each row reads and writes only its request's state, so the order rows are
planned in does not matter (the kernel's programs run in any order).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import (  # noqa: F401
    ERR_MISS_NOT_ON_HOST,
    ERR_SLOT_OVERFLOW,
    HINT_ROUNDS,
    PlanResult,
)
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import (
    HINT_HASHES,
    HINT_WAYS,
    LayerState,
    SparseCacheState,
)

HINT_CANDIDATES = HINT_WAYS * len(HINT_HASHES)
"""Entries a loc may sit in: the first bucket's ways, then the second's."""


def hint_candidates(locs: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``(*locs.shape, HINT_CANDIDATES)`` int64 hint entries where each loc may sit (any loc value,
    including -1, maps to entries below ``num_buckets * HINT_WAYS``)."""
    x = locs.long()
    ways = torch.arange(HINT_WAYS, device=x.device)
    cands = []
    for m in HINT_HASHES:
        bucket = (((x * m) & 0xFFFFFFFF) * num_buckets) >> 32
        cands.append(bucket[..., None] * HINT_WAYS + ways)
    return torch.cat(cands, dim=-1)


def lookup_slots(state: LayerState, req_pool_idx: int, locs: torch.Tensor) -> torch.Tensor:
    """The slot of request ``req_pool_idx`` that holds each of ``locs`` by its hint table, or -1
    (also for a loc of -1): what the plan kernel counts as a hit. int64, eager."""
    hint, slot_loc = state.hint[int(req_pool_idx)], state.slot_loc[int(req_pool_idx)]
    x = locs.to(device=hint.device, dtype=torch.int64)
    e = hint[hint_candidates(x, hint.numel() // HINT_WAYS)].long()
    held = slot_loc[e.clamp(min=0)].long()
    match = (x[..., None] >= 0) & (e >= 0) & (held == x[..., None])
    return torch.where(match, e, -1).amax(dim=-1)


def _unique_first_occurrence(x: torch.Tensor):
    """Unique values of ``x`` ordered by first occurrence, and the index of each first occurrence."""
    if x.numel() == 0:
        return x, x.long()
    uniq, inv = torch.unique(x, return_inverse=True)
    pos = torch.arange(x.numel(), device=x.device)
    first = torch.full((uniq.numel(),), x.numel(), dtype=torch.int64, device=x.device)
    first.scatter_reduce_(0, inv, pos, reduce="amin")
    order = torch.argsort(first)
    return uniq[order], first[order]


def _insert_hints(
    hint_r: torch.Tensor,
    locs: torch.Tensor,
    slots: torch.Tensor,
    lanes: torch.Tensor,
    age: torch.Tensor,
    fresh: int,
) -> None:
    """Step 5 for one row: name ``slots[i]`` for ``locs[i]`` (top-k entry ``lanes[i]``)."""
    nb = hint_r.numel() // HINT_WAYS
    rot = (lanes[:, None] + torch.arange(HINT_WAYS, device=locs.device)) % HINT_WAYS
    cands = hint_candidates(locs, nb)
    cands = torch.cat([cands[:, :HINT_WAYS].gather(1, rot), cands[:, HINT_WAYS:].gather(1, rot)], 1)
    big = torch.iinfo(torch.int64).max
    pend = torch.ones(locs.numel(), dtype=torch.bool, device=locs.device)
    for _ in range(HINT_ROUNDS.value):
        e = hint_r[cands].long()
        empty = (e < 0).to(torch.int8)
        empties = [empty[:, :HINT_WAYS].sum(1), empty[:, HINT_WAYS:].sum(1)]
        first = [
            cands[:, :HINT_WAYS].gather(1, empty[:, :HINT_WAYS].argmax(1, keepdim=True))[:, 0],
            cands[:, HINT_WAYS:].gather(1, empty[:, HINT_WAYS:].argmax(1, keepdim=True))[:, 0],
        ]
        a = torch.where(e >= 0, age[e.clamp(min=0)], big)
        a = torch.where(a < fresh, a, big)
        oldest = cands.gather(1, a.argmin(1, keepdim=True))[:, 0]
        has_oldest = a.amin(1) < big
        tgt = torch.where(
            empties[1] > empties[0], first[1], torch.where(empties[0] > 0, first[0], oldest)
        )
        go = pend & ((empties[0] + empties[1] > 0) | has_oldest)
        best = torch.full((hint_r.numel(),), big, dtype=torch.int64, device=locs.device)
        best.scatter_reduce_(0, tgt[go], lanes[go], reduce="amin")
        won = go & (best[tgt] == lanes)
        hint_r[tgt[won]] = slots[won].to(hint_r.dtype)
        pend = go & ~won


def plan_layer_ref(
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_real_reqs: torch.Tensor,
    loc_to_host: torch.Tensor,
    loc_to_tail: torch.Tensor,
    state: LayerState,
) -> PlanResult:
    """Reference plan for one layer; mutates ``state`` in place like the kernel."""
    bs, K = topk.shape
    dev = topk.device
    out = torch.full((bs, K), -1, dtype=torch.int32, device=dev)
    miss_host = torch.full((bs, K), -1, dtype=torch.int64, device=dev)
    miss_dst = torch.full((bs, K), -1, dtype=torch.int32, device=dev)
    num_misses = torch.zeros((bs,), dtype=torch.int32, device=dev)
    err = 0
    hint, slot_loc, lru, ocls, num_slots = state
    nb = hint.shape[1] // HINT_WAYS

    for b in range(min(int(num_real_reqs[0]), bs)):
        r = int(req_pool_indices[b])
        if r == 0:  # upstream's padding row
            continue
        n = int(num_slots[r])
        t = topk[b].long()
        valid = t >= 0
        tc = t.clamp(min=0)
        slot = lookup_slots(state, r, t)
        hit = slot >= 0
        tail = torch.where(valid & ~hit, loc_to_tail[tc].long(), -1)
        is_tail = tail > 0  # 0 is upstream's "unmapped" (row 0 is the padding row)
        miss = valid & ~hit & ~is_tail
        uq, first = _unique_first_occurrence(t[miss])
        lanes = torch.nonzero(miss).flatten()[first]

        needed = torch.zeros(n, dtype=torch.bool, device=dev)
        needed[slot[hit]] = True
        order = lru[r, :n].long()
        need_o = needed[order]
        evictable, kept = order[~need_o], order[need_o]
        M, E = uq.numel(), evictable.numel()
        Mt = min(M, E)
        if M > E:
            err |= ERR_SLOT_OVERFLOW
        victims = evictable[:Mt]
        old = slot_loc[r, victims].long()
        oc = hint_candidates(old, nb)
        named = (old >= 0)[:, None] & (hint[r][oc].long() == victims[:, None])
        hint[r][oc[named]] = -1
        slot_loc[r, victims] = uq[:Mt].to(torch.int32)
        new_order = torch.cat([evictable[Mt:], kept, victims])
        lru[r, :n] = new_order.to(lru.dtype)
        age = torch.empty(n, dtype=torch.int64, device=dev)
        age[new_order] = torch.arange(n, device=dev)
        _insert_hints(hint[r], uq[:Mt], victims, lanes[:Mt], age, n - Mt)

        # each miss entry takes its loc's victim (-1 past the evictable slots)
        fslot = torch.where(hit, slot, -1)
        if M:
            rank = (t[:, None] == uq[None, :]).to(torch.int8).argmax(dim=1)
            loaded = torch.cat([victims, victims.new_full((M - Mt,), -1)])
            fslot = torch.where(miss, loaded[rank], fslot)
        phys = torch.where(fslot >= 0, ocls[r, fslot.clamp(min=0)].long(), -1)
        out[b] = torch.where(is_tail, tail, phys).to(torch.int32)
        host = loc_to_host[uq[:Mt]].long()
        if bool((host < 0).any()):
            err |= ERR_MISS_NOT_ON_HOST
        miss_host[b, :Mt] = host
        miss_dst[b, :Mt] = ocls[r, victims].to(torch.int32)
        num_misses[b] = Mt

    return PlanResult(
        out,
        miss_host.view(-1),
        miss_dst.view(-1),
        num_misses,
        torch.tensor([err], dtype=torch.int32, device=dev),
        num_misses.sum().view(1).to(torch.int32),
    )


def compact_miss_list(res: PlanResult) -> tuple:
    """(host, dst) of the per-row packed list, concatenated in row order (for comparisons)."""
    keep = res.miss_dst >= 0
    return res.miss_host[keep], res.miss_dst[keep]


def topk_positions_to_locs_ref(
    topk_pos: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    num_real_reqs: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`lru_kernels.topk_positions_to_locs`."""
    bs = topk_pos.shape[0]
    n_real = min(int(num_real_reqs.reshape(-1)[0]), bs)
    out[:bs] = -1
    pos = topk_pos[:n_real].long()
    rows = req_to_token[req_pool_indices[:n_real].long()]
    locs = torch.gather(rows, 1, pos.clamp(min=0)).to(torch.int32)
    out[:n_real] = torch.where(pos >= 0, locs, torch.full_like(locs, -1))
    return out[:bs]


def check_invariants(state: SparseCacheState) -> None:
    """Slow full check of a ``SparseCacheState``; raises AssertionError.

    The LRU orders are permutations; a free request holds nothing; every hint entry names a slot
    the request owns, holding a loc that has this entry among its candidates; no slot and no loc
    is named twice in one layer of one request. (A loc may be held in two slots: the one without
    an entry lost it and ages out.)
    """
    s = state
    pos = torch.arange(s.hint.shape[2], device=s.device)
    for r in range(s.max_reqs):
        n = s.num_slots_cpu[r]
        assert int(s.num_slots[r]) == n, f"num_slots mirror differs for req {r}"
        if n == 0:
            assert bool((s.slot_loc[:, r] == -1).all()), f"free req {r} has resident slots"
            assert bool((s.hint[:, r] == -1).all()), f"free req {r} has hint entries"
            continue
        assert bool((s.out_cache_loc_sparse[r, :n] >= 0).all())
        assert bool((s.slot_loc[:, r, n:] == -1).all())
        for layer in range(s.num_layers):
            where = f"req {r} layer {layer}"
            order = s.lru[layer, r, :n].long()
            assert torch.equal(
                torch.sort(order).values, torch.arange(n, device=s.device)
            ), f"lru of {where} is not a permutation"
            e = s.hint[layer, r].long()
            live = e >= 0
            slots = e[live]
            assert bool((slots < n).all()), f"{where}: a hint names a slot not owned"
            held = s.slot_loc[layer, r, slots].long()
            assert bool((held >= 0).all()), f"{where}: a hint names an empty slot"
            cands = hint_candidates(held, s.hint_buckets)
            assert bool(
                (cands == pos[live][:, None]).any(dim=1).all()
            ), f"{where}: a hint entry outside its loc's candidates"
            assert slots.unique().numel() == slots.numel(), f"{where}: a slot named twice"
            assert held.unique().numel() == held.numel(), f"{where}: a loc named twice"
