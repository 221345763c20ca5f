"""A simulated decode side for the sparse-cache tests (not collected by pytest).

``World`` owns the real upstream ``PagedTokenToKVPoolAllocator`` (physical sparse slots), a
:class:`SparseCacheState`, the per-logical-loc ``loc_to_host`` / ``loc_to_tail`` tables, a fake
pinned host KV and per-layer device KV buffers. Every token gets a globally unique id; its KV row in
layer ``l`` is ``uid * L + l`` (plus derived words), so a stale hit on a reused logical loc reads the
wrong content and is caught.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch
from lru_ref import check_invariants, lookup_slots
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import PlanResult
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import (
    PAGE_SIZE,
    SparseCacheState,
)

D = 3  # int64 words per fake KV row


def make_allocator(num_pages: int) -> PagedTokenToKVPoolAllocator:
    # kvcache is only stored by the allocator (for get_cpu_copy); the sparse cache never uses it.
    return PagedTokenToKVPoolAllocator(
        num_pages * PAGE_SIZE, PAGE_SIZE, torch.int64, "cpu", None, False
    )


class World:
    def __init__(
        self,
        rng: random.Random,
        num_layers: int = 2,
        max_reqs: int = 4,
        num_logical: int = 2048,
        topk: int = 32,
        buffer_slots: int = 64,
        pool_pages: int = 8,
        tail_rows: int = 512,
    ) -> None:
        self.rng = rng
        self.L = num_layers
        self.K = topk
        self.alloc = make_allocator(pool_pages)
        self.free_at_start = self.alloc.available_size()
        # Requests are rows 1..max_reqs: row 0 is upstream's padding row, as in ReqToTokenPool.
        self.state = SparseCacheState(
            num_layers, max_reqs + 1, buffer_slots, topk, self.alloc, "cpu"
        )
        self.loc_to_host = torch.full((num_logical,), -1, dtype=torch.int64)
        self.loc_to_tail = torch.full((num_logical,), -1, dtype=torch.int64)
        self.loc_uid = torch.full((num_logical,), -1, dtype=torch.int64)
        tail_base = (pool_pages + 1) * PAGE_SIZE
        self.num_phys = tail_base + tail_rows
        self.host_kv = torch.zeros((num_layers, num_logical, D), dtype=torch.int64)
        self.dev_kv = torch.zeros((num_layers, self.num_phys, D), dtype=torch.int64)
        # The last loc is padding, never a token's: as in the server's mapping (index -1).
        self.free_locs: List[int] = list(range(num_logical - 1))
        rng.shuffle(self.free_locs)
        self.free_host: List[int] = list(range(num_logical))
        rng.shuffle(self.free_host)
        self.free_tail: List[int] = list(range(tail_base, self.num_phys))
        self.reqs: Dict[int, List[int]] = {}
        # Shared prefixes (the radix cache): a loc lives while any request's row names it.
        self.loc_refs: Counter = Counter()
        self.prev_topk: Dict[int, torch.Tensor] = {}
        self.next_uid = 1
        # shadow LRU clock per (layer, request, slot), for the independent victim-order check
        self.clock = 0
        self.last_used = torch.full(
            (num_layers, max_reqs + 1, self.state.max_slots), -1, dtype=torch.int64
        )
        self.stats: Counter = Counter()  # what a trace exercised (tests assert coverage)

    # ----------------------------------------------------------------- content
    def row(self, uid: torch.Tensor, layer: int) -> torch.Tensor:
        base = uid * self.L + layer
        return torch.stack([base, base * 7 + 3, -base], dim=-1)

    def _new_token(self) -> int:
        loc = self.free_locs.pop()
        self.loc_uid[loc] = self.next_uid
        self.next_uid += 1
        return loc

    def _make_tail(self, loc: int) -> None:
        row = self.free_tail.pop()
        self.loc_to_tail[loc] = row
        uid = self.loc_uid[loc : loc + 1]
        for layer in range(self.L):
            self.dev_kv[layer, row] = self.row(uid, layer)[0]

    def _back_up(self, loc: int, keep_tail: bool) -> None:
        h = self.free_host.pop()
        self.loc_to_host[loc] = h
        uid = self.loc_uid[loc : loc + 1]
        for layer in range(self.L):
            self.host_kv[layer, h] = self.row(uid, layer)[0]
        if not keep_tail and self.loc_to_tail[loc] >= 0:
            self.free_tail.append(int(self.loc_to_tail[loc]))
            self.loc_to_tail[loc] = -1

    # --------------------------------------------------------------- lifecycle
    def can_add(self, ctx: int) -> bool:
        return len(self.free_locs) >= ctx + 64 and len(self.free_tail) >= 128

    def add_request(
        self, r: int, ctx: int, prefix_of: Optional[int] = None, prefix_len: int = 0
    ) -> bool:
        """Admit request ``r`` with ``ctx`` tokens; with ``prefix_of``, its first ``prefix_len``
        (whole pages, as the radix cache matches) are request ``prefix_of``'s locs: same index
        keys, same host rows (or still its tail rows), no second copy."""
        prefix: List[int] = []
        if prefix_of is not None:
            assert prefix_len % PAGE_SIZE == 0 and prefix_len <= ctx
            prefix = self.reqs[prefix_of][:prefix_len]
            assert len(prefix) == prefix_len
        if not self.state.admit(r, ctx):
            return False
        locs = prefix + [self._new_token() for _ in range(ctx - len(prefix))]
        n_tail = ctx % PAGE_SIZE
        for i, loc in enumerate(locs):
            if i < len(prefix):
                continue
            if i < ctx - n_tail:
                self._back_up(loc, keep_tail=False)
            else:
                self._make_tail(loc)
        if prefix:
            self.stats.update(shared_prefix_tokens=len(prefix))
        self.loc_refs.update(locs)
        self.reqs[r] = locs
        return True

    def decode_token(self, r: int) -> None:
        """Append a token (tail); a completed page is backed up, its tail rows freed at random later."""
        locs = self.reqs[r]
        loc = self._new_token()
        self._make_tail(loc)
        locs.append(loc)
        self.loc_refs[loc] += 1
        if len(locs) % PAGE_SIZE == 0:
            keep = self.rng.random() < 0.3  # backed up but tail not yet freed: both tables set
            for x in locs[-PAGE_SIZE:]:
                self._back_up(x, keep_tail=keep)
        elif len(locs) % PAGE_SIZE == 5:
            for x in locs[: len(locs) - 5]:
                if self.loc_to_tail[x] >= 0 and self.loc_to_host[x] >= 0:
                    self.free_tail.append(int(self.loc_to_tail[x]))
                    self.loc_to_tail[x] = -1
        self.state.grow(r, len(locs))

    def release(self, r: int) -> None:
        self.state.release(r)
        for loc in self.reqs.pop(r):
            self.loc_refs[loc] -= 1
            if self.loc_refs[loc] > 0:  # a shared prefix another request still uses
                continue
            del self.loc_refs[loc]
            if self.loc_to_host[loc] >= 0:
                self.free_host.append(int(self.loc_to_host[loc]))
            if self.loc_to_tail[loc] >= 0:
                self.free_tail.append(int(self.loc_to_tail[loc]))
            self.loc_to_host[loc] = -1
            self.loc_to_tail[loc] = -1
            self.loc_uid[loc] = -1
            self.free_locs.append(loc)
        self.last_used[:, r] = -1
        self.prev_topk.pop(r, None)

    # ------------------------------------------------------------------- top-k
    def topk_row(
        self, r: int, churn: float = 0.3, dup: float = 0.1, holes: float = 0.1
    ) -> torch.Tensor:
        """A top-k row like the fused indexer's, plus test-only duplicates and -1 holes."""
        rng, K = self.rng, self.K
        locs = self.reqs[r]
        if len(locs) <= K:
            row = locs + [-1] * (K - len(locs))
        else:
            prev = self.prev_topk.get(r)
            if prev is not None and rng.random() < 0.7:
                # step-to-step churn: keep most of the previous selection
                row = prev.tolist()
                chosen = set(row)
                pool = [x for x in locs if x not in chosen]
                n_new = min(len(pool), max(1, int(churn * K)))
                fresh = rng.sample(pool, n_new)
                for i, x in zip(rng.sample(range(K), n_new), fresh):
                    row[i] = x
            else:
                row = rng.sample(locs, K)
            self.prev_topk[r] = torch.tensor(row)
        row = list(row)
        for i in range(K):
            u = rng.random()
            if u < dup:
                row[i] = row[rng.randrange(K)]
            elif u < dup + holes:
                row[i] = -1
        return torch.tensor(row, dtype=torch.int32)

    # -------------------------------------------------------------- checking
    def load_and_check(
        self,
        layer: int,
        topk: torch.Tensor,
        rpi: torch.Tensor,
        n_real: int,
        res: PlanResult,
        compact: bool,
    ) -> None:
        """Simulate the H2D of the miss list, then check every resolved row's content."""
        if compact:
            cnt = int(res.miss_count[0])
            mh, md = res.miss_host[:cnt], res.miss_dst[:cnt]
            assert bool((mh >= 0).all()) and bool((md >= 0).all())
        else:
            keep = res.miss_dst >= 0
            assert torch.equal(keep, res.miss_host >= 0)
            mh, md = res.miss_host[keep], res.miss_dst[keep]
        assert md.numel() == torch.unique(md).numel(), "two misses load into one row"
        self.dev_kv[layer, md.long()] = self.host_kv[layer, mh.long()]
        bs = topk.shape[0]
        for b in range(bs):
            out = res.out_indices[b]
            if b >= n_real:
                assert bool((out == -1).all()), "padded row got indices"
                continue
            t = topk[b].long()
            valid = t >= 0
            assert torch.equal(out >= 0, valid), "a valid entry did not resolve"
            got = self.dev_kv[layer, out[valid].long()]
            want = self.row(self.loc_uid[t[valid]], layer)
            assert torch.equal(got, want), f"layer {layer} row {b}: wrong KV content"
            # sparse slots must belong to this request; tails are its own rows
            r = int(rpi[b])
            own = set(self.state.out_cache_loc_sparse[r, : self.state.num_slots_cpu[r]].tolist())
            tails = self.loc_to_tail[t[valid]]
            for o, tl_ in zip(out[valid].tolist(), tails.tolist()):
                assert o in own or o == tl_, "row resolved outside the request's slots"

    def check_lru_step(
        self,
        layer: int,
        r: int,
        topk_row: torch.Tensor,
        found: torch.Tensor,
        before_slot_loc: torch.Tensor,
        loaded_rows: torch.Tensor,
        overflow: bool,
    ) -> None:
        """Independent LRU check for one (layer, request) planned from ``topk_row``: ``found`` is
        what ``lookup_slots`` gave for it before the plan, ``loaded_rows`` the physical
        rows of the row's miss list."""
        st = self.state
        n = st.num_slots_cpu[r]
        after = st.slot_loc[layer, r, :n]
        rows = st.out_cache_loc_sparse[r, :n]
        loaded_slots = {int(s) for s in torch.nonzero(torch.isin(rows, loaded_rows)).flatten()}
        valid = topk_row >= 0
        t, f = topk_row[valid].tolist(), found[valid].tolist()
        needed = {s for s in f if s >= 0}
        hit_locs = {x for x, s in zip(t, f) if s >= 0}
        non_tail = {x for x in t if x in hit_locs or self.loc_to_tail[x] < 0}
        misses = non_tail - hit_locs
        held = {int(x) for x in before_slot_loc[: st.num_slots_cpu[r]] if int(x) >= 0}
        loaded = {int(after[s]) for s in loaded_slots}
        if not overflow:
            assert loaded == misses, "loaded set differs from the unique misses"
        else:
            assert loaded <= misses
        assert len(loaded) == len(loaded_slots), "a miss loaded twice"
        assert not (loaded_slots & needed), "evicted a slot needed this step"
        before = before_slot_loc[:n]
        empty_before = int((before < 0).sum())
        evicted = [s for s in loaded_slots if int(before[s]) >= 0]
        # what the new loads made unfindable: their own entry or another's
        after_found = lookup_slots(st.layer(layer), r, torch.tensor(sorted(loaded | hit_locs)))
        self.stats.update(
            hits=len(hit_locs),
            misses=len(misses),
            evictions=len(evicted),
            tail=sum(1 for x in t if x not in non_tail),
            dups=len(t) - len(set(t)),
            overflow=int(overflow),
            unnamed=int((after_found < 0).sum()),
            # misses of locs the request held in a slot: its hint entry was lost (an exact map
            # from loc to slot would have hit them)
            held_misses=len(misses & held),
        )
        lu = self.last_used[layer, r]
        if evicted:
            assert len(loaded_slots) > empty_before, "evicted while empty slots were left"
            kept = [
                s for s in range(n) if s not in needed and s not in loaded_slots and before[s] >= 0
            ]
            if kept:
                ev_t = max(int(lu[s]) for s in evicted)
                kept_t = min(int(lu[s]) for s in kept)
                assert ev_t <= kept_t, "victim is not among the least recently used"
        # hits and loads are the most recent end of the order
        used = needed | loaded_slots
        order = st.lru[layer, r, :n].long()
        if used:
            tail_slots = {int(x) for x in order[n - len(used) :]}
            assert tail_slots == used, "hits and loads are not the most recent"
        self.clock += 1
        for s in used:
            lu[s] = self.clock


def run_trace(
    seed: int,
    plan: Callable[..., PlanResult],
    steps: int = 6,
    num_layers: int = 2,
    max_reqs: int = 4,
    topk: int = 32,
    buffer_slots: int = 64,
    pool_pages: int = 8,
    max_ctx: int = 200,
    compact: bool = False,
    graph_bs: Optional[int] = None,
    check: bool = True,
    on_step: Optional[Callable[[World, int, Dict], None]] = None,
    share: bool = False,
) -> World:
    """Drive a random multi-request, multi-layer decode trace through ``plan``."""
    rng = random.Random(seed)
    w = World(
        rng, num_layers, max_reqs, topk=topk, buffer_slots=buffer_slots, pool_pages=pool_pages
    )
    for step in range(steps):
        # lifecycle: finish some, admit some (logical locs get reused)
        for r in list(w.reqs):
            if rng.random() < 0.1:
                w.release(r)
        for r in range(1, max_reqs + 1):
            if r not in w.reqs and rng.random() < 0.6:
                ctx = rng.choice(
                    [1, rng.randint(2, topk)] + [rng.randint(64, max(64, max_ctx))] * 3
                )
                donors = [q for q in w.reqs if len(w.reqs[q]) >= PAGE_SIZE]
                if share and donors and rng.random() < 0.5:
                    q = rng.choice(donors)
                    p = PAGE_SIZE * rng.randint(1, len(w.reqs[q]) // PAGE_SIZE)
                    ctx = p + rng.randint(0, max_ctx // 2)
                    if w.can_add(ctx - p):
                        w.add_request(r, ctx, prefix_of=q, prefix_len=p)
                elif w.can_add(ctx):
                    w.add_request(r, ctx)
        for r in list(w.reqs):
            w.decode_token(r)
        live = list(w.reqs)
        rng.shuffle(live)
        if not live:
            continue
        n_real = len(live)
        bs = max(n_real, graph_bs or n_real)
        # Padded rows: a CUDA graph's (beyond num_real_reqs, stale request indices, possibly of
        # live requests), or attention DP's eager padding (counted in num_real_reqs, request 0).
        dp_padding = bs > n_real and rng.random() < 0.5
        w.stats.update(padded_rows=bs - n_real, row0_padded_rows=(bs - n_real) * dp_padding)
        pad = [0 if dp_padding else rng.randrange(max_reqs + 1) for _ in range(bs - n_real)]
        rpi_list = live + pad
        rpi = torch.tensor(rpi_list, dtype=torch.int64)
        nr = torch.tensor([bs if dp_padding else n_real], dtype=torch.int32)
        for layer in range(num_layers):
            rows = [w.topk_row(r) for r in live]
            if share:
                seen = Counter(x for row in rows for x in set(row.tolist()) if x >= 0)
                w.stats.update(locs_in_two_rows=sum(1 for c in seen.values() if c > 1))
            rows += [torch.randint(-1, 50, (topk,), dtype=torch.int32) for _ in range(bs - n_real)]
            topk_t = torch.stack(rows)
            topk_copy = topk_t.clone()
            before = w.state.slot_loc[layer].clone()
            found = [lookup_slots(w.state.layer(layer), r, topk_t[b]) for b, r in enumerate(live)]
            res = plan(topk_t, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(layer))
            assert torch.equal(topk_t, topk_copy), "plan rewrote the indexer's top-k"
            overflow = bool(int(res.error_flags[0]) & 1)
            if check:
                w.load_and_check(layer, topk_t, rpi, n_real, res, compact)
                for b, r in enumerate(live):
                    w.check_lru_step(
                        layer,
                        r,
                        topk_t[b],
                        found[b],
                        before[r],
                        _row_misses(res, b, compact),
                        overflow,
                    )
                # padded rows' stale requests that are not live must be untouched
                for r in set(rpi_list[n_real:]) - set(live):
                    assert torch.equal(before[r], w.state.slot_loc[layer, r])
            if on_step is not None:
                on_step(w, layer, dict(topk=topk_t, rpi=rpi, n_real=n_real, res=res))
        if check:
            check_invariants(w.state)
    return w


def _row_misses(res: PlanResult, b: int, compact: bool) -> torch.Tensor:
    """Physical rows of batch row ``b``'s misses (its destinations in the miss list)."""
    n = int(res.num_misses[b])
    if not compact:
        K = res.out_indices.shape[1]
        return res.miss_dst[b * K : b * K + n]
    # compact: rows' lists are back to back in any order; row b's destinations are its rows
    dst = res.miss_dst[: int(res.miss_count[0])]
    return dst[torch.isin(dst, res.out_indices[b])]
