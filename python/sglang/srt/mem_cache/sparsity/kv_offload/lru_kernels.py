"""Triton plan kernel for the per-layer sparse KV cache: which top-k rows hit, which load, where.

One program per batch row (request), vectorised over the row's ``K`` top-k entries and its ``S``
slots; no sort, ``O(K + S)`` work with three prefix sums. Exact semantics are specified (and
implemented in plain torch) by the tests' reference (``test/srt/kv_offload/lru_ref.py``); the
kernel equals it bit for bit.

Program outline (``b`` = row, ``r`` = request, ``n`` = its slots):

1. look each top-k loc up in request ``r``'s hint table (its 8 candidate entries; a hit is an entry
   whose slot holds the loc) -> hits; for non-hits gather ``loc_to_tail[t]`` -> tail rows; the
   rest are misses.
2. clear the row's scratch; mark hit slots; each missing loc finds its entry of a per-row hashed
   set (compare-and-swap, linear probing), where ``atomic_min`` of its top-k position elects the
   first occurrence of a duplicated loc (dedup without a sort, deterministic).
3. read the LRU permutation, look up the marks, exclusive prefix sums give each evictable slot its
   eviction rank and each needed slot its new position. The first ``M`` evictable slots are the
   victims (scattered to a rank-indexed scratch); their hint entries are cleared.
4. rewrite the permutation in place (untaken evictables, needed, new loads), fill the victims, then
   resolve every entry to a physical row and write the packed miss list.
5. name each loaded slot in one of its loc's candidate entries (``HINT_ROUNDS`` rounds: an empty
   way of the emptier bucket, else the least recently used occupant; a contended entry goes to
   the earliest top-k entry).

State is per request, and a request has at most one row per launch, so programs never race over
it: results do not depend on the order programs run in. Everything is a fixed-shape tensor
preallocated in :class:`PlanWorkspace`; no host sync, so the call is CUDA-graph capturable. Padded rows (``b >= num_real_reqs[0]``, or request row 0: upstream's
``ReqToTokenPool`` never hands row 0 out and pads batches with it, as attention DP's eager decode
does for ranks with fewer requests) leave the state untouched; their outputs are set to -1 so a
stale miss list is never replayed.
"""

from __future__ import annotations

import logging
from typing import Dict, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from sglang.srt.mem_cache.sparsity.kv_offload import sparse_cache
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

# The hint table's layout (sparse_cache's docstring). The kernel reads a bucket as one 8-byte
# word: way w is bits [16w, 16w + 16), 0xFFFF (-1) when empty.
HINT_HASH_A = tl.constexpr(sparse_cache.HINT_HASHES[0])
HINT_HASH_B = tl.constexpr(sparse_cache.HINT_HASHES[1])
HINT_ROUNDS = tl.constexpr(3)  # insertion rounds of step 5
assert sparse_cache.HINT_WAYS == 4 and len(sparse_cache.HINT_HASHES) == 2
# 2-bit fields: set bits of each 3-bit value; index of the lowest set bit of each 4-bit value.
POPCOUNT3 = tl.constexpr(0xE994)
LOWEST_BIT4 = tl.constexpr(0x12131210)


@triton.jit
def _hint_buckets(t64, num_buckets):
    """The two buckets (int32) loc ``t64`` may sit in, one per multiplier of ``HINT_HASHES``."""
    h1 = (t64 * HINT_HASH_A).to(tl.uint32).to(tl.int64)
    h2 = (t64 * HINT_HASH_B).to(tl.uint32).to(tl.int64)
    return ((h1 * num_buckets) >> 32).to(tl.int32), ((h2 * num_buckets) >> 32).to(tl.int32)


@triton.jit
def _plan_layer_kernel(
    topk_ptr,
    topk_stride,
    rpi_ptr,
    n_real_ptr,
    loc_to_host_ptr,
    loc_to_tail_ptr,
    hint_ptr,
    hint_stride,
    num_buckets,
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
    key_ptr,
    first_ptr,
    claim_ptr,
    claim_stride,
    err_ptr,
    stats_ptr,
    r2t_ptr,
    r2t_stride,
    K,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DEDUP: tl.constexpr,
    DEDUP_BITS: tl.constexpr,
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

        # 1. classify. The request's own hint table names the slot of a resident loc in a way of
        # one of its two buckets; a hit is a way whose slot holds the loc (slot_loc). Only this
        # request's plans touch its table and slots, so rows never race over state.
        st_row = r * state_stride
        hint_row = hint_ptr + r * hint_stride
        hint_words = hint_row.to(tl.pointer_type(tl.int64))
        bucket1, bucket2 = _hint_buckets(t64, num_buckets)
        word1 = tl.load(hint_words + bucket1, mask=valid, other=-1)
        word2 = tl.load(hint_words + bucket2, mask=valid, other=-1)
        slot = neg1_k
        for j in tl.static_range(8):
            if j < 4:
                e = ((word1 >> (16 * j)) & 0xFFFF).to(tl.int32)  # a slot, or 0xFFFF: empty
            else:
                e = ((word2 >> (16 * (j - 4))) & 0xFFFF).to(tl.int32)
            held = tl.load(slot_loc_ptr + st_row + e, mask=e != 0xFFFF, other=-2)
            slot = tl.where(held == t, e, slot)  # (-2 never equals a loc or a -1 entry)
        hit = slot >= 0
        cold = valid & ~hit
        tail = tl.load(loc_to_tail_ptr + t64, mask=cold, other=-1).to(tl.int32)
        # Row 0 is the allocators' reserved padding row, and upstream's logical->physical mapping
        # uses 0 for "unmapped": only a positive row is a tail row.
        is_tail = tail > 0
        miss = cold & (tail <= 0)

        # 2. mark needed slots; dedupe the misses. Each missing loc finds its entry of the row's
        # scratch set (open addressing, compare-and-swap: one entry per distinct loc), then the
        # first top-k entry of the loc wins it with atomic_min: deterministic, no sort.
        offs_s = tl.arange(0, BLOCK_S)
        mark_row = mark_ptr + b.to(tl.int64) * BLOCK_S
        vict_row = vict_ptr + b.to(tl.int64) * BLOCK_K
        offs_d = tl.arange(0, DEDUP)
        key_row = key_ptr + b.to(tl.int64) * DEDUP
        first_row = first_ptr + b.to(tl.int64) * DEDUP
        tl.store(mark_row + offs_s, tl.zeros([BLOCK_S], tl.int32))
        tl.store(key_row + offs_d, tl.full([DEDUP], -1, tl.int32))
        tl.store(first_row + offs_d, tl.full([DEDUP], 2147483647, tl.int32))
        tl.debug_barrier()
        tl.store(mark_row + slot, tl.full([BLOCK_K], 1, tl.int32), mask=hit)
        pos = ((t64 * HINT_HASH_A).to(tl.uint32).to(tl.int64) >> (32 - DEDUP_BITS)).to(tl.int32)
        pend = miss
        while tl.max(pend.to(tl.int32), axis=0) > 0:
            # (atomic_cas has no mask: other lanes compare with -3, which no entry holds)
            prev = tl.atomic_cas(key_row + pos, tl.where(pend, -1, -3), t)
            pend = pend & (prev != -1) & (prev != t)
            pos = tl.where(pend, (pos + 1) & (DEDUP - 1), pos)
        tl.atomic_min(first_row + pos, offs_k, mask=miss)
        tl.debug_barrier()
        # .cg: the atomics went to L2, do not read a stale L1 line
        winner = tl.load(first_row + pos, mask=miss, other=-1, cache_modifier=".cg")
        rep = miss & (winner == offs_k)
        dup = miss & ~rep
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
        # A victim's hint entry (the way naming it, in its old loc's buckets) goes.
        old = tl.load(slot_loc_ptr + st_row + sl, mask=take, other=-1)
        gone = take & (old >= 0)
        if tl.max(gone.to(tl.int32), axis=0) > 0:
            old1, old2 = _hint_buckets(old.to(tl.int64), num_buckets)
            for which in tl.static_range(2):
                ob = old1 if which == 0 else old2
                ow = tl.load(hint_words + ob, mask=gone, other=-1)
                w = tl.full([BLOCK_S], 4, tl.int32)
                for way in tl.static_range(4):
                    w = tl.where(((ow >> (16 * way)) & 0xFFFF).to(tl.int32) == sl, way, w)
                tl.store(hint_row + (ob << 2) + w, tl.full([BLOCK_S], -1, tl.int16), mask=w < 4)
        # needed slot at position p has p - erank[p] needed slots before it
        newpos = tl.where(ev, erank - Mt, (E - Mt) + (offs_s - erank))
        tl.debug_barrier()  # every lru and mark read, victim write and hint clear is done

        # 4. rewrite the order, fill the victims, resolve rows. The mark scratch now holds every
        # slot's new LRU position (for step 5).
        tl.store(lru_ptr + st_row + newpos, sl.to(tl.int16), mask=smask & ~take)
        tl.store(mark_row + sl, newpos, mask=smask & ~take)
        ok = rep & (mrank < Mt)
        v = tl.load(vict_row + mrank, mask=ok, other=-1, cache_modifier=".cg")
        tl.store(lru_ptr + st_row + (n - Mt) + mrank, v.to(tl.int16), mask=ok)
        tl.store(mark_row + v, (n - Mt) + mrank, mask=ok)
        tl.store(slot_loc_ptr + st_row + v, t, mask=ok)
        # A duplicate takes its winner's slot from this row's scratch: vict_row by entry now.
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

        # 5. name each loaded slot in a way of its loc's buckets. A round: each pending load takes
        # the first empty way, from way k mod 4 on (to spread a bucket's loads), of its bucket
        # with more empty ways (the first on a tie); with none empty, the way naming the least
        # recently used slot that this plan did not load. Contenders for one entry keep the
        # earliest top-k entry (atomic_max of K - k in the claim scratch, reset after the round),
        # the others try again next round. A load left without an entry misses when next selected.
        claim_row = claim_ptr + b.to(tl.int64) * claim_stride
        fresh = n - Mt
        prio = K - offs_k
        pend = ok
        rot = offs_k & 3
        for rnd in tl.static_range(HINT_ROUNDS):
            if rnd == 0:
                active = Mt > 0
            else:
                active = tl.max(pend.to(tl.int32), axis=0) > 0
            if active:  # one value for the program: the barriers inside are safe
                word1 = tl.load(hint_words + bucket1, mask=pend, other=0, cache_modifier=".cg")
                word2 = tl.load(hint_words + bucket2, mask=pend, other=0, cache_modifier=".cg")
                # empty ways as 4-bit masks (the sign bit of each way)
                empty1 = (((word1 >> 15) & 1) | ((word1 >> 30) & 2)).to(tl.int32)
                empty1 = empty1 | (((word1 >> 45) & 4) | ((word1 >> 60) & 8)).to(tl.int32)
                empty2 = (((word2 >> 15) & 1) | ((word2 >> 30) & 2)).to(tl.int32)
                empty2 = empty2 | (((word2 >> 45) & 4) | ((word2 >> 60) & 8)).to(tl.int32)
                count1 = ((POPCOUNT3 >> ((empty1 & 7) << 1)) & 3) + (empty1 >> 3)
                count2 = ((POPCOUNT3 >> ((empty2 & 7) << 1)) & 3) + (empty2 >> 3)
                second = count2 > count1
                empty = tl.where(second, empty2, empty1)
                turned = ((empty >> rot) | (empty << (4 - rot))) & 15  # bit i: way (rot + i) % 4
                way = (rot + ((LOWEST_BIT4 >> (turned << 1)) & 3)) & 3
                tgt = tl.where(second, bucket2, bucket1) * 4 + way
                tgt = tl.where(pend & (empty != 0), tgt, -1)
                full = pend & (tgt < 0)
                if tl.max(full.to(tl.int32), axis=0) > 0:
                    oldest = tl.full([BLOCK_K], BLOCK_S, tl.int32)
                    for j in tl.static_range(8):
                        if j < 4:
                            occ = ((word1 >> (16 * j)) & 0xFFFF).to(tl.int32)
                            c = bucket1 * 4 + j
                        else:
                            occ = ((word2 >> (16 * (j - 4))) & 0xFFFF).to(tl.int32)
                            c = bucket2 * 4 + (j - 4)
                        age = tl.load(
                            mark_row + occ, mask=full, other=BLOCK_S, cache_modifier=".cg"
                        )
                        older = (age < fresh) & (age < oldest)
                        tgt = tl.where(older, c, tgt)
                        oldest = tl.where(older, age, oldest)
                go = pend & (tgt >= 0)
                tl.atomic_max(claim_row + tgt, prio, mask=go)
                tl.debug_barrier()
                won = go & (
                    tl.load(claim_row + tgt, mask=go, other=0, cache_modifier=".cg") == prio
                )
                tl.store(hint_row + tgt, v.to(tl.int16), mask=won)
                tl.debug_barrier()
                tl.store(claim_row + tgt, tl.full([BLOCK_K], 0, tl.int32), mask=go)
                pend = go & ~won
                tl.debug_barrier()


class PlanWorkspace:
    """Preallocated outputs and scratch of :func:`plan_layer` for up to ``max_bs`` rows.

    Outputs are reused by every layer: consume them (H2D + attention) before the next layer's plan,
    which is the natural stream order. ``counters_of``: count into that workspace's ``stats`` and
    ``error_flags`` (one set of counters for plans of two row widths, e.g. decode and verify).
    ``max_slots``: the state's ``SparseCacheState.max_slots`` (its hint tables' size follows).
    Per row, besides the outputs: the slot marks (4 B per ``block_s``), the victims (4 B per
    ``block_k``), the dedupe set (8 B per ``2 * block_k``) and the hint claims (4 B per hint entry).
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
        # The dedupe set (loc keys, first top-k entry of each), cleared by every plan; load <= 1/2.
        self.dedup = 2 * self.block_k
        self._key = torch.zeros((max_bs, self.dedup), dtype=torch.int32, device=dev)
        self._first = torch.zeros((max_bs, self.dedup), dtype=torch.int32, device=dev)
        # Hint claims by entry: zero between plans (every plan resets what it touched).
        self.hint_entries = sparse_cache.HINT_ENTRIES_PER_SLOT * max_slots
        self._claim = torch.zeros((max_bs, self.hint_entries), dtype=torch.int32, device=dev)

    def nbytes(self) -> int:
        ts = (
            self.out_indices,
            self.miss_host,
            self.miss_dst,
            self.num_misses,
            self._mark,
            self._vict,
            self._key,
            self._first,
            self._claim,
        )
        return sum(t.numel() * t.element_size() for t in ts)

    def reset_errors(self) -> None:
        self.error_flags.zero_()


class PlanReport:
    """The host's view of a :class:`PlanWorkspace`'s counters and error flags: copied to the host
    behind each decode step's forward (:meth:`launch`) and read one step later, so reading them
    never waits for the device."""

    def __init__(self, workspace: PlanWorkspace, row_bytes: int) -> None:
        self.workspace = workspace
        self.row_bytes = row_bytes  # bytes of one loaded row (``loaded_bytes``)
        self._on_gpu = workspace.stats.device.type == "cuda"
        # Layout: the stats, then the error flags.
        self._report = torch.zeros(
            (len(STAT_NAMES) + 1,), dtype=torch.int64, pin_memory=self._on_gpu
        )
        self._event = torch.cuda.Event() if self._on_gpu else None
        self.error_flags_seen = 0

    def reset(self) -> None:
        """Forget what came before (the CUDA-graph capture warm-ups plan dummy rows of a request
        with no slots)."""
        self.workspace.reset_errors()
        self.workspace.stats.zero_()
        self._report.zero_()

    def launch(self) -> None:
        """Copy the counters and error flags to the host behind the coming forward."""
        n = len(STAT_NAMES)
        self._report[:n].copy_(self.workspace.stats, non_blocking=True)
        self._report[n:].copy_(self.workspace.error_flags, non_blocking=True)
        if self._event is not None:
            self._event.record()

    def new_errors(self) -> int:
        """Error flags first seen in the last completed report (0 if none or not ready)."""
        if self._event is not None and not self._event.query():
            return 0
        flags = int(self._report[-1])
        new = flags & ~self.error_flags_seen
        self.error_flags_seen |= flags
        return new

    def counters(self) -> Dict[str, int]:
        """The running counters as of the last completed report (no device sync)."""
        values = self._report.tolist()
        out = dict(zip(STAT_NAMES, values[: len(STAT_NAMES)]))
        out["loaded_bytes"] = out["loaded"] * self.row_bytes
        return out

    @staticmethod
    def describe(flags: int) -> str:
        """What error ``flags`` mean, for the requests' error and the log."""
        parts = []
        if flags & ERR_SLOT_OVERFLOW:
            parts.append("a request's top-k needed more sparse slots than it holds")
        if flags & ERR_MISS_NOT_ON_HOST:
            parts.append("a top-k token was neither on the GPU nor backed up on the host")
        return "kv offload plan error (" + "; ".join(parts) + ")"


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
    hint, slot_loc, lru, ocls, num_slots = state
    assert slot_loc.stride() == lru.stride() and slot_loc.stride(1) == 1
    assert slot_loc.shape[1] <= ws.block_s and hint.stride(1) == 1
    # The kernel reads a bucket (4 int16 ways) as one 8-byte word.
    assert hint.dtype == torch.int16 and hint.shape[1] <= ws.hint_entries, hint.shape
    assert hint.shape[1] % 4 == 0 and hint.stride(0) % 4 == 0 and hint.data_ptr() % 8 == 0
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
        hint,
        hint.stride(0),
        hint.shape[1] // sparse_cache.HINT_WAYS,
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
        ws._key,
        ws._first,
        ws._claim,
        ws._claim.stride(0),
        ws.error_flags,
        ws.stats,
        r2t,
        r2t.stride(0),
        K,
        BLOCK_K=ws.block_k,
        BLOCK_S=ws.block_s,
        DEDUP=ws.dedup,
        DEDUP_BITS=ws.dedup.bit_length() - 1,
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
