"""Test reference: the per-layer plan (``lru_kernels.plan_layer``) in plain torch, bit for bit.

Semantics, per real batch row ``b`` (request ``r = req_pool_indices[b]``, ``n = num_slots[r]``):

1. For each top-k entry ``t``: -1 stays -1; a loc whose hint names a slot of this request holding
   it (``s = loc_to_slot[t] >= 0`` and ``slot_loc[r, s] == t``) is a *hit*; otherwise a loc with
   ``loc_to_tail[t] > 0`` resolves to that tail row (no cache use); anything else is a *miss*.
   ``loc_to_slot`` is a hint because a shared prefix's locs (radix cache) belong to several
   requests: it names the slot of the request that loaded the loc last.
2. Misses are de-duplicated; unique misses are ranked by first occurrence in the row.
3. The request's LRU order is split, keeping relative order, into *evictable* slots (not hit this
   step) and *needed* slots. The ``M`` unique misses take the first ``min(M, E)`` evictable slots
   (least recently used first); each victim's previous loc is unmapped if its hint still names
   that slot. The loaded misses' hints then name their new slots; overflowed ones become -1.
4. New order: untaken evictable slots, then needed slots, then the newly loaded slots in miss rank
   (hits and loads become most recent).
5. Outputs: physical rows (tail row, or ``out_cache_loc_sparse[r, slot]``); the miss list packed at
   the front of the row's ``K`` entries, -1 after; ``num_misses[b]``; the total count. (The kernel's
   default *compact* layout holds the same per-row lists back to back, rows in any order.)

Misses beyond the ``E`` evictable slots (contract violation: the request owns too few slots) resolve
to -1 and set bit 0 of the error flags; a miss whose ``loc_to_host`` is -1 sets bit 1. Padded
rows (``b >= num_real_reqs[0]``, or request row 0, upstream's padding row) get -1 outputs and
never touch the state. Rows are planned in order, each seeing the state the rows before it left:
what the kernel does under ``TRITON_INTERPRET=1`` (one program after the other). On a GPU, rows
sharing a loc race only over its hint: the rows' outputs stay correct, the final hint may differ.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import (  # noqa: F401
    ERR_MISS_NOT_ON_HOST,
    ERR_SLOT_OVERFLOW,
    PlanResult,
)
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import LayerState


def _unique_first_occurrence(x: torch.Tensor) -> torch.Tensor:
    """Unique values of ``x`` ordered by first occurrence."""
    if x.numel() == 0:
        return x
    uniq, inv = torch.unique(x, return_inverse=True)
    pos = torch.arange(x.numel(), device=x.device)
    first = torch.full((uniq.numel(),), x.numel(), dtype=torch.int64, device=x.device)
    first.scatter_reduce_(0, inv, pos, reduce="amin")
    return uniq[torch.argsort(first)]


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
    loc_to_slot, slot_loc, lru, ocls, num_slots = state

    for b in range(min(int(num_real_reqs[0]), bs)):
        r = int(req_pool_indices[b])
        if r == 0:  # upstream's padding row
            continue
        n = int(num_slots[r])
        t = topk[b].long()
        valid = t >= 0
        tc = t.clamp(min=0)
        hint = torch.where(valid, loc_to_slot[tc].long(), -1)
        held = torch.where(hint >= 0, slot_loc[r, hint.clamp(min=0)].long(), -1)
        hit = valid & (hint >= 0) & (held == t)
        slot = torch.where(hit, hint, -1)
        tail = torch.where(valid & ~hit, loc_to_tail[tc].long(), -1)
        is_tail = tail > 0  # 0 is upstream's "unmapped" (row 0 is the padding row)
        miss = valid & ~hit & ~is_tail
        uq = _unique_first_occurrence(t[miss])

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
        gone = old >= 0
        # unmap only where the hint still names the victim slot (not another request's slot)
        cur = loc_to_slot[old[gone]].long()
        loc_to_slot[old[gone][cur == victims[gone]]] = -1
        loc_to_slot[uq[:Mt]] = victims.to(torch.int32)
        loc_to_slot[uq[Mt:]] = -1  # overflowed misses: their claim goes back to -1
        slot_loc[r, victims] = uq[:Mt].to(torch.int32)
        lru[r, :n] = torch.cat([evictable[Mt:], kept, victims]).to(lru.dtype)

        fslot = torch.where(valid & ~is_tail, loc_to_slot[tc].long(), -1)
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
