"""Triton plan kernel for the per-layer sparse KV cache (PrepareIntraLayerH2D equivalent).

One program per batch row (request), vectorised over the row's ``K`` top-k entries and its ``S``
slots; no sort, ``O(K + S)`` work with three prefix sums. Exact semantics are specified (and
implemented in plain torch) by the tests' reference (``test/srt/kv_offload/lru_ref.py``); the
kernel equals it bit for bit.

Program outline (``b`` = row, ``r`` = request, ``n`` = its slots):

1. gather ``loc_to_slot[t]`` for the row's top-k -> hits; for non-hits gather ``loc_to_tail[t]``
   -> tail rows; the rest are misses.
2. clear the row's slot mark scratch; mark hit slots; claim each missing loc in ``loc_to_slot``
   with ``atomic_min`` of a negative code ordered by top-k position, so the first occurrence of a
   duplicated loc wins (dedup without a sort, deterministic).
3. read the LRU permutation, look up the marks, exclusive prefix sums give each evictable slot its
   eviction rank and each needed slot its new position. The first ``M`` evictable slots are the
   victims (scattered to a rank-indexed scratch); their old locs are unmapped.
4. rewrite the permutation in place (untaken evictables, needed, new loads), map the claimed locs to
   their victims, then resolve every entry to a physical row and write the packed miss list.

Everything is a fixed-shape tensor preallocated in :class:`PlanWorkspace`; no host sync, so the
call is CUDA-graph capturable. Padded rows (``b >= num_real_reqs[0]``, or request row 0: upstream's
``ReqToTokenPool`` never hands row 0 out and pads batches with it, as attention DP's eager decode
does for ranks with fewer requests) leave the state untouched; their outputs are set to -1 so a
stale miss list is never replayed.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import LayerState

logger = logging.getLogger(__name__)

# Sticky error flags of a plan (PlanWorkspace.error_flags), OR-ed over every plan.
ERR_SLOT_OVERFLOW = 1  # a request's unique misses exceeded its evictable slots
ERR_MISS_NOT_ON_HOST = 2  # a miss had no host copy


class PlanResult(NamedTuple):
    out_indices: torch.Tensor  # (bs, K) int32 physical rows, -1 padded
    miss_host: torch.Tensor  # (bs*K,) int64 host slots, per-row packed, -1 padded
    miss_dst: torch.Tensor  # (bs*K,) int32 physical rows, same layout
    num_misses: torch.Tensor  # (bs,) int32
    error_flags: torch.Tensor  # (1,) int32, OR of ERR_* bits
    miss_count: torch.Tensor  # (1,) int32 total misses (length of the compact list)


# Indices of PlanWorkspace.stats, counters accumulated over every plan since start.
STAT_SELECTED = tl.constexpr(0)  # valid top-k entries
STAT_HITS = tl.constexpr(1)  # resident in a sparse slot
STAT_TAIL = tl.constexpr(2)  # read in place from a GPU tail row
STAT_LOADED = tl.constexpr(3)  # loaded host -> device
STAT_NAMES = ("selected", "hits", "tail", "loaded")


@triton.jit
def _plan_layer_kernel(
    topk_ptr,
    topk_stride,
    rpi_ptr,
    n_real_ptr,
    loc_to_host_ptr,
    loc_to_tail_ptr,
    loc_to_slot_ptr,
    slot_loc_ptr,
    lru_ptr,
    state_stride,
    ocls_ptr,
    ocls_stride,
    num_slots_ptr,
    out_ptr,
    out_stride,
    miss_host_ptr,
    miss_dst_ptr,
    num_miss_ptr,
    miss_total_ptr,
    mark_ptr,
    vict_ptr,
    err_ptr,
    stats_ptr,
    r2t_ptr,
    r2t_stride,
    K,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    COMPACT: tl.constexpr,
    POSITIONS: tl.constexpr,
):
    b = tl.program_id(0)
    n_real = tl.load(n_real_ptr)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    row_out = out_ptr + b.to(tl.int64) * out_stride
    row_miss = b.to(tl.int64) * K
    neg1_k = tl.full([BLOCK_K], -1, tl.int32)
    r = tl.load(rpi_ptr + b).to(tl.int64)
    if (b >= n_real) | (r == 0):
        tl.store(row_out + offs_k, neg1_k, mask=kmask)
        if not COMPACT:
            tl.store(miss_host_ptr + row_miss + offs_k, neg1_k.to(tl.int64), mask=kmask)
            tl.store(miss_dst_ptr + row_miss + offs_k, neg1_k, mask=kmask)
        tl.store(num_miss_ptr + b, 0)
    else:
        n = tl.load(num_slots_ptr + r)
        t = tl.load(topk_ptr + b.to(tl.int64) * topk_stride + offs_k, mask=kmask, other=-1)
        if POSITIONS:  # token positions of request r -> its logical locs (req_to_token)
            t = tl.load(r2t_ptr + r * r2t_stride + t.to(tl.int64), mask=t >= 0, other=-1)
            t = t.to(tl.int32)
        valid = t >= 0
        t64 = t.to(tl.int64)

        # 1. classify. loc_to_slot is a hint: a loc of a shared prefix (radix cache) is in the
        # req_to_token rows of several requests, each with slots of its own, and the hint names
        # the slot of the last request that loaded it. It is a hit only if this request's slot
        # holds the loc (slot_loc, written by this request's plans only).
        st_row = r * state_stride
        hint = tl.load(loc_to_slot_ptr + t64, mask=valid, other=-1)
        held = tl.load(slot_loc_ptr + st_row + hint, mask=valid & (hint >= 0), other=-1)
        hit = valid & (hint >= 0) & (held == t)
        slot = tl.where(hit, hint, -1)
        cold = valid & ~hit
        tail = tl.load(loc_to_tail_ptr + t64, mask=cold, other=-1).to(tl.int32)
        # Row 0 is the allocators' reserved padding row, and upstream's logical->physical mapping
        # uses 0 for "unmapped": only a positive row is a tail row.
        is_tail = tail > 0
        miss = cold & (tail <= 0)

        # 2. mark needed slots, claim missing locs. A claim code names its row and entry:
        # -(2 + b*K + (K-1-k)), so within a row the first occurrence of a loc wins the atomic_min.
        # An entry whose loc holds a code of another entry of its own row is a duplicate; any
        # other value (its own code, another row's code, or what another row wrote after its own
        # claim) makes it a unique miss: rows never wait for each other, and a row that lost the
        # loc to another row loads it into its own slot.
        offs_s = tl.arange(0, BLOCK_S)
        mark_row = mark_ptr + b.to(tl.int64) * BLOCK_S
        vict_row = vict_ptr + b.to(tl.int64) * BLOCK_K
        tl.store(mark_row + offs_s, tl.zeros([BLOCK_S], tl.int32))
        tl.debug_barrier()
        tl.store(mark_row + slot, tl.full([BLOCK_K], 1, tl.int32), mask=hit)
        bk = b.to(tl.int32) * K
        code = -2 - (bk + (K - 1 - offs_k))
        tl.atomic_min(loc_to_slot_ptr + t64, code, mask=miss)
        tl.debug_barrier()
        # .cg: the atomics went to L2, do not read a stale L1 line from step 1
        claim = tl.load(loc_to_slot_ptr + t64, mask=miss, other=0, cache_modifier=".cg")
        cval = -2 - claim  # b*K + (K-1-k) of the winning entry, if claim is a code
        mine = (claim <= -2) & (cval >= bk) & (cval < bk + K)
        rep = miss & ((claim == code) | ~mine)
        dup = miss & ~rep
        winner = (K - 1) - (cval - bk)  # the row's first entry of the loc, for duplicates
        rep_i = rep.to(tl.int32)
        M = tl.sum(rep_i, axis=0)
        mrank = tl.cumsum(rep_i, axis=0) - rep_i

        # 3. split the LRU order into evictable / needed, pick victims
        smask = offs_s < n
        sl = tl.load(lru_ptr + st_row + offs_s, mask=smask, other=0).to(tl.int32)
        need = tl.load(mark_row + sl, mask=smask, other=0, cache_modifier=".cg")
        ev = smask & (need == 0)
        ev_i = ev.to(tl.int32)
        E = tl.sum(ev_i, axis=0)
        erank = tl.cumsum(ev_i, axis=0) - ev_i
        Mt = tl.minimum(M, E)
        take = ev & (erank < Mt)
        tl.store(vict_row + erank, sl, mask=take)
        old = tl.load(slot_loc_ptr + st_row + sl, mask=take, other=-1)
        # Unmap an evicted loc only if the hint still names this slot (another request may hold
        # it, or this row may be claiming it). Not atomic: a race only loses a hint (a later
        # miss) or turns another row's claim into a unique miss; neither resolves a wrong row.
        old64 = old.to(tl.int64)
        gone = take & (old >= 0)
        cur = tl.load(loc_to_slot_ptr + old64, mask=gone, other=-1, cache_modifier=".cg")
        tl.store(loc_to_slot_ptr + old64, tl.full([BLOCK_S], -1, tl.int32), mask=gone & (cur == sl))
        # needed slot at position p has p - erank[p] needed slots before it
        newpos = tl.where(ev, erank - Mt, (E - Mt) + (offs_s - erank))
        tl.debug_barrier()  # every lru read and victim write is done

        # 4. rewrite the order, map claimed locs, resolve rows
        tl.store(lru_ptr + st_row + newpos, sl.to(tl.int16), mask=smask & ~take)
        ok = rep & (mrank < Mt)
        v = tl.load(vict_row + mrank, mask=ok, other=-1, cache_modifier=".cg")
        tl.store(lru_ptr + st_row + (n - Mt) + mrank, v.to(tl.int16), mask=ok)
        tl.store(slot_loc_ptr + st_row + v, t, mask=ok)
        tl.store(loc_to_slot_ptr + t64, v, mask=rep)  # overflowed claims go back to -1
        # A duplicate takes its winner's slot from this row's scratch, never from loc_to_slot
        # (which another row may have rewritten since): vict_row by entry now, not by rank.
        tl.debug_barrier()
        tl.store(vict_row + offs_k, v, mask=rep)
        tl.debug_barrier()
        wslot = tl.load(vict_row + winner, mask=dup, other=-1, cache_modifier=".cg")
        fslot = tl.where(hit, slot, tl.where(rep, v, wslot))
        phys = tl.load(ocls_ptr + r * ocls_stride + fslot, mask=fslot >= 0, other=-1)
        tl.store(row_out + offs_k, tl.where(is_tail, tail, phys), mask=kmask)
        host = tl.load(loc_to_host_ptr + t64, mask=ok, other=-1).to(tl.int64)
        if COMPACT:
            # rows reserve their range in arrival order; within a row the order is the miss rank
            dst_off = tl.atomic_add(miss_total_ptr, Mt).to(tl.int64) + mrank
        else:
            tl.atomic_add(miss_total_ptr, Mt)
            dst_off = row_miss + mrank
            pad = kmask & (offs_k >= Mt)
            tl.store(miss_host_ptr + row_miss + offs_k, neg1_k.to(tl.int64), mask=pad)
            tl.store(miss_dst_ptr + row_miss + offs_k, neg1_k, mask=pad)
        tl.store(miss_host_ptr + dst_off, host, mask=ok)
        tl.store(miss_dst_ptr + dst_off, phys, mask=ok)
        tl.store(num_miss_ptr + b, Mt)
        # Running counters (selected, hits, tail reads, loads) for the operator's metrics.
        tl.atomic_add(stats_ptr + STAT_SELECTED, tl.sum(valid.to(tl.int64), axis=0))
        tl.atomic_add(stats_ptr + STAT_HITS, tl.sum(hit.to(tl.int64), axis=0))
        tl.atomic_add(stats_ptr + STAT_TAIL, tl.sum(is_tail.to(tl.int64), axis=0))
        tl.atomic_add(stats_ptr + STAT_LOADED, Mt.to(tl.int64))
        if M > E:
            tl.atomic_or(err_ptr, 1)
        bad = tl.sum((ok & (host < 0)).to(tl.int32), axis=0)
        if bad > 0:
            tl.atomic_or(err_ptr, 2)


class PlanWorkspace:
    """Preallocated outputs and scratch of :func:`plan_layer` for up to ``max_bs`` rows.

    Outputs are reused by every layer: consume them (H2D + attention) before the next layer's plan,
    which is the natural stream order. ``counters_of``: count into that workspace's ``stats`` and
    ``error_flags`` (one set of counters for plans of two row widths, e.g. decode and verify).
    """

    def __init__(
        self,
        max_bs: int,
        topk: int,
        max_slots: int,
        device: torch.device | str = "cuda",
        counters_of: Optional["PlanWorkspace"] = None,
    ) -> None:
        self.max_bs = max_bs
        self.topk = topk
        self.block_k = triton.next_power_of_2(topk)
        self.block_s = triton.next_power_of_2(max_slots)
        dev = torch.device(device)
        self.out_indices = torch.full((max_bs, topk), -1, dtype=torch.int32, device=dev)
        self.miss_host = torch.full((max_bs * topk,), -1, dtype=torch.int64, device=dev)
        self.miss_dst = torch.full((max_bs * topk,), -1, dtype=torch.int32, device=dev)
        self.num_misses = torch.zeros((max_bs,), dtype=torch.int32, device=dev)
        self.miss_count = torch.zeros((1,), dtype=torch.int32, device=dev)
        if counters_of is not None:
            self.error_flags, self.stats = counters_of.error_flags, counters_of.stats
        else:
            self.error_flags = torch.zeros((1,), dtype=torch.int32, device=dev)
            self.stats = torch.zeros((len(STAT_NAMES),), dtype=torch.int64, device=dev)
        self._mark = torch.zeros((max_bs, self.block_s), dtype=torch.int32, device=dev)
        self._vict = torch.zeros((max_bs, self.block_k), dtype=torch.int32, device=dev)

    def nbytes(self) -> int:
        ts = (
            self.out_indices,
            self.miss_host,
            self.miss_dst,
            self.num_misses,
            self._mark,
            self._vict,
        )
        return sum(t.numel() * t.element_size() for t in ts)

    def reset_errors(self) -> None:
        self.error_flags.zero_()


def plan_layer(
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_real_reqs: torch.Tensor,
    loc_to_host: torch.Tensor,
    loc_to_tail: torch.Tensor,
    state: LayerState,
    ws: PlanWorkspace,
    num_warps: int = 8,
    compact: bool = True,
    out_indices: Optional[torch.Tensor] = None,
    req_to_token: Optional[torch.Tensor] = None,
) -> PlanResult:
    """Plan one layer: resolve ``topk`` to physical rows, pick victims, emit the miss list.

    Args:
        topk: (bs, K) int32 logical locs from the indexer, -1 padded; read only. With
            ``req_to_token``: token positions of each row's request instead (the unfused decode
            indexer's output), translated to logical locs inside the kernel.
        req_pool_indices: (bs,) int64 request of each row (stale for padded rows); request row 0
            is upstream's padding row, so a row of request 0 is padding too.
        num_real_reqs: (1,) int32 device tensor; rows ``>= num_real_reqs[0]`` are padding.
        loc_to_host: (N_logical,) int64 host slot per logical loc, -1 if not backed up.
        loc_to_tail: (N_logical,) int32/int64 physical tail row per logical loc; <= 0 (the
            upstream mapping's 0, or -1) means none.
        state: ``SparseCacheState.layer(layer_id)``; updated in place.
        ws: preallocated workspace (``max_bs >= bs``, same K, ``block_s`` covering the slots).
        num_warps: Triton warps per program (tuning knob).
        compact: True: the miss list is one dense prefix of ``miss_count[0]`` entries (rows in a
            nondeterministic order, each row's misses in rank order; entries past the count are
            stale), for ``transfer.copy_rows(..., num_valid=miss_count)``. False: row ``b``'s
            misses sit at ``[b*K, b*K + num_misses[b])``, the rest of the row is -1 (deterministic).
        out_indices: optional (bs, K) int32 destination instead of ``ws.out_indices[:bs]``.
        req_to_token: ``ReqToTokenPool.req_to_token`` (int32, rows by ``req_pool_indices``); makes
            ``topk`` positions (one launch instead of a translation launch plus the plan).

    Returns:
        Views of the workspace: rewritten indices, per-row packed miss list (host slot, physical
        row; -1 padded), per-row miss counts and the sticky error flags (``ERR_*``).
    """
    bs, K = topk.shape
    positions = req_to_token is not None
    assert K == ws.topk and bs <= ws.max_bs, (bs, K, ws.max_bs, ws.topk)
    # Locs are int32 (slot_loc stores them); the indexer's positions may be int64.
    assert topk.stride(1) == 1 and (topk.dtype == torch.int32 or positions), topk.dtype
    loc_to_slot, slot_loc, lru, ocls, num_slots = state
    assert slot_loc.stride() == lru.stride() and slot_loc.stride(1) == 1
    assert slot_loc.shape[1] <= ws.block_s
    out = ws.out_indices[:bs] if out_indices is None else out_indices
    assert out.dtype == torch.int32 and out.stride(1) == 1 and tuple(out.shape) == (bs, K)
    ws.miss_count.zero_()
    if positions:
        assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    r2t = req_to_token if positions else topk  # unused without positions
    _plan_layer_kernel[(bs,)](
        topk,
        topk.stride(0),
        req_pool_indices,
        num_real_reqs,
        loc_to_host,
        loc_to_tail,
        loc_to_slot,
        slot_loc,
        lru,
        slot_loc.stride(0),
        ocls,
        ocls.stride(0),
        num_slots,
        out,
        out.stride(0),
        ws.miss_host,
        ws.miss_dst,
        ws.num_misses,
        ws.miss_count,
        ws._mark,
        ws._vict,
        ws.error_flags,
        ws.stats,
        r2t,
        r2t.stride(0),
        K,
        BLOCK_K=ws.block_k,
        BLOCK_S=ws.block_s,
        COMPACT=compact,
        POSITIONS=positions,
        num_warps=num_warps,
    )
    return PlanResult(
        out,
        ws.miss_host[: bs * K],
        ws.miss_dst[: bs * K],
        ws.num_misses[:bs],
        ws.error_flags,
        ws.miss_count,
    )
