"""GPU LRU state of the per-layer sparse KV cache (``--enable-kv-offload``).

Every request owns ``num_slots[r]`` physical KV rows (its *sparse slots*), granted page by page from a
pool shared by all requests. Slot ``s`` of request ``r`` is the physical row
``out_cache_loc_sparse[r, s]`` in every layer's KV buffer; what it holds differs per layer.

Per layer ``l`` the state is

* ``loc_to_slot[l, loc]`` (int32): local slot of logical loc ``loc`` in the request that loaded it
  last, -1 if none (the seed's ``cpu_slot_to_gpu_slot``, keyed by logical loc; a hint, see below);
* ``slot_loc[l, r, s]`` (int32): logical loc held by slot ``s``, -1 if empty (``cache_ids_inverse``);
* ``lru[l, r, :num_slots[r]]`` (int16): a dense permutation of the request's slots, least recently used
  first (replaces ``cache_ids``/``cache_lens``). The plan kernel keeps it dense, so the seed's
  per-step ``CompactCacheIdsBlock``/``ReorderOutCacheLocSparse`` passes do not exist here.

``loc_to_slot`` is a hint: with the radix cache a prefix's locs are in several requests' rows, each
request holding them in slots of its own, so the plan counts a hit only if ``slot_loc[l, r, s] == x``
for ``s = loc_to_slot[l, x]`` (the slot of the request that loaded ``x`` last). Invariants (checked
by :meth:`SparseCacheState.check_invariants`): every hint ``s >= 0`` names a slot holding ``x`` in
some request; without shared locs, ``loc_to_slot[l, x] == s >= 0`` iff ``slot_loc[l, r, s] == x``
for the request ``r`` owning ``x``.

Admission, growth and release run between forward passes (scheduler side, eager, may sync); only the
plan kernel (``lru_kernels.plan_layer``) runs inside the CUDA graph.
"""

from __future__ import annotations

import logging
from typing import List, NamedTuple, Optional, Protocol

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import MAX_SLOTS_PER_REQ, PAGE_SIZE

logger = logging.getLogger(__name__)


class SlotAllocator(Protocol):
    """What we need from the physical page allocator (``PagedTokenToKVPoolAllocator``)."""

    page_size: int

    def alloc(self, need_size: int) -> Optional[torch.Tensor]: ...

    def available_size(self) -> int: ...

    def free_page_ids(self, page_ids: torch.Tensor) -> None: ...


class LayerState(NamedTuple):
    """Views of one layer's LRU state, as the plan kernel (and its reference) consume it."""

    loc_to_slot: torch.Tensor  # (N_logical,) int32
    slot_loc: torch.Tensor  # (R, S_max) int32
    lru: torch.Tensor  # (R, S_max) int16
    out_cache_loc_sparse: torch.Tensor  # (R, S_max) int32, shared by all layers
    num_slots: torch.Tensor  # (R,) int32, shared by all layers


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class SparseCacheState:
    """GPU LRU state of the sparse KV cache for all layers and request slots.

    Args:
        num_layers: layers that own a sparse cache.
        num_logical_locs: size of the logical loc space (``loc_to_slot`` length; every top-k loc and
            every loc passed to :meth:`mark_resident` must be below it).
        max_reqs: ``req_to_token_pool`` size (request pool indices are below it).
        buffer_slots: sparse slots per request at most (rounded up to the page size); must be
            ``>= topk`` so a long request can always hold a full top-k.
        topk: indexer top-k (2048 for DeepSeek-V3.2).
        allocator: physical row allocator shared with the tail pages (page-aligned ``alloc``).
        device: where the state lives.
    """

    def __init__(
        self,
        num_layers: int,
        num_logical_locs: int,
        max_reqs: int,
        buffer_slots: int,
        topk: int,
        allocator: SlotAllocator,
        device: torch.device | str = "cuda",
    ) -> None:
        page = getattr(allocator, "page_size", PAGE_SIZE)
        if page != PAGE_SIZE:
            raise ValueError(f"kv_offload sparse cache needs page_size {PAGE_SIZE}, got {page}")
        max_slots = _round_up(buffer_slots, PAGE_SIZE)
        if max_slots < topk:
            raise ValueError(
                f"sparse buffer ({buffer_slots} slots/request) must hold a full top-k ({topk})"
            )
        if max_slots > MAX_SLOTS_PER_REQ:
            raise ValueError(f"sparse buffer too large ({max_slots} > {MAX_SLOTS_PER_REQ} slots)")
        self.num_layers = num_layers
        self.num_logical_locs = num_logical_locs
        self.max_reqs = max_reqs
        self.max_slots = max_slots
        self.topk = topk
        self.allocator = allocator
        self.device = torch.device(device)

        i32 = dict(dtype=torch.int32, device=self.device)
        self.loc_to_slot = torch.full((num_layers, num_logical_locs), -1, **i32)
        self.slot_loc = torch.full((num_layers, max_reqs, max_slots), -1, **i32)
        self.lru = torch.zeros(
            (num_layers, max_reqs, max_slots), dtype=torch.int16, device=self.device
        )
        self.out_cache_loc_sparse = torch.full((max_reqs, max_slots), -1, **i32)
        self.num_slots = torch.zeros((max_reqs,), **i32)
        # Host mirror: admission decisions must not sync with the device.
        self.num_slots_cpu: List[int] = [0] * max_reqs

    # ------------------------------------------------------------------ sizing
    def slots_for(self, context_len: int) -> int:
        """Slots a request of ``context_len`` tokens owns: ``min(buffer, context)`` page-rounded."""
        return min(self.max_slots, _round_up(max(int(context_len), 1), PAGE_SIZE))

    def can_admit(self, context_len: int) -> bool:
        return self.allocator.available_size() >= self.slots_for(context_len)

    def layer(self, layer_id: int) -> LayerState:
        return LayerState(
            self.loc_to_slot[layer_id],
            self.slot_loc[layer_id],
            self.lru[layer_id],
            self.out_cache_loc_sparse,
            self.num_slots,
        )

    # --------------------------------------------------------------- lifecycle
    def admit(self, req_pool_idx: int, context_len: int) -> bool:
        """Grant slots to a new request. Returns False (state untouched) if the pool is exhausted.

        Raises:
            RuntimeError: the request already owns slots (admission is exactly-once).
        """
        r = int(req_pool_idx)
        if self.num_slots_cpu[r] != 0:
            raise RuntimeError(
                f"req_pool_idx {r} already owns {self.num_slots_cpu[r]} sparse slots"
            )
        n = self.slots_for(context_len)
        rows = self.allocator.alloc(n)
        if rows is None:
            logger.debug(
                "sparse slot pool exhausted: need %d, have %d", n, self.allocator.available_size()
            )
            return False
        self.out_cache_loc_sparse[r, :n] = rows.to(device=self.device, dtype=torch.int32)
        order = torch.arange(n, dtype=torch.int16, device=self.device)
        self.lru[:, r, :n] = order
        self.slot_loc[:, r, :n] = -1
        self.num_slots[r : r + 1] = n  # a slice fills on the device; [r] = n would copy (sync)
        self.num_slots_cpu[r] = n
        return True

    def grow(self, req_pool_idx: int, new_context_len: int) -> bool:
        """Grow a request's slots towards ``slots_for(new_context_len)``.

        New (empty) slots go to the LRU end of every layer's order so they are filled before any
        resident token is evicted. Returns False (state untouched) if the pool is exhausted; the
        caller must then retract the request or accept slot overflow (see ``plan_layer``).
        """
        r = int(req_pool_idx)
        n = self.num_slots_cpu[r]
        if n == 0:
            raise RuntimeError(f"req_pool_idx {r} owns no sparse slots; admit it first")
        target = self.slots_for(new_context_len)
        if target <= n:
            return True
        rows = self.allocator.alloc(target - n)
        if rows is None:
            return False
        self.out_cache_loc_sparse[r, n:target] = rows.to(device=self.device, dtype=torch.int32)
        fresh = torch.arange(n, target, dtype=torch.int16, device=self.device)
        old = self.lru[:, r, :n].clone()
        self.lru[:, r, : target - n] = fresh
        self.lru[:, r, target - n : target] = old
        self.slot_loc[:, r, n:target] = -1
        self.num_slots[r : r + 1] = target
        self.num_slots_cpu[r] = target
        return True

    def mark_resident(self, req_pool_idx: int, locs: torch.Tensor) -> torch.Tensor:
        """Declare that slot ``i`` holds logical loc ``locs[i]`` in every layer (freshly admitted only).

        Use it when a request's KV is already on the GPU at admission (e.g. a short prompt): the
        caller copies each layer's rows of ``locs`` into the returned physical rows. Those tokens
        start as most recent; the remaining slots stay empty.
        """
        r = int(req_pool_idx)
        n = self.num_slots_cpu[r]
        m = int(locs.numel())
        if m > n:
            raise ValueError(f"{m} resident tokens do not fit in {n} slots")
        if m == 0:
            return self.out_cache_loc_sparse[r, :0]
        if bool((self.slot_loc[:, r, :n] >= 0).any()):
            raise RuntimeError("mark_resident needs a request whose slots are all empty")
        locs = locs.to(device=self.device, dtype=torch.int64)
        slots = torch.arange(m, dtype=torch.int32, device=self.device)
        self.loc_to_slot[:, locs] = slots
        self.slot_loc[:, r, :m] = locs.to(torch.int32)
        order = torch.cat(
            [torch.arange(m, n, device=self.device), torch.arange(m, device=self.device)]
        ).to(torch.int16)
        self.lru[:, r, :n] = order
        return self.out_cache_loc_sparse[r, :m]

    def release(self, req_pool_idx: int) -> int:
        """Free the request's slots and clear every map entry it set. Returns the rows freed.

        Idempotent: a second call (e.g. abort after finish) frees nothing, so no row is freed twice.
        """
        r = int(req_pool_idx)
        n = self.num_slots_cpu[r]
        if n == 0:
            return 0
        locs = self.slot_loc[:, r, :n].long()
        # Empty slots hold -1; they name the padding entry (the last, always -1) instead of being
        # masked out: no device sync. A loc's hint is cleared only where it names the slot that
        # held it (a shared prefix's loc may be another request's hit); amin, because a request
        # may hold a loc in two slots (see check_invariants) and only one of them is named.
        width = self.num_logical_locs
        locs = torch.where(locs < 0, width - 1, locs)
        layer_base = torch.arange(self.num_layers, device=self.device)[:, None] * width
        idx = (layer_base + locs).reshape(-1)
        flat = self.loc_to_slot.view(-1)
        cur = flat[idx]
        mine = cur == torch.arange(n, dtype=cur.dtype, device=self.device).repeat(self.num_layers)
        flat.scatter_reduce_(0, idx, torch.where(mine, -1, cur), reduce="amin")
        self.slot_loc[:, r, :n] = -1
        self.lru[:, r, :n] = 0
        rows = self.out_cache_loc_sparse[r, :n].to(torch.int64)
        self.allocator.free_page_ids(rows[::PAGE_SIZE] // PAGE_SIZE)
        self.out_cache_loc_sparse[r, :n] = -1
        self.num_slots[r : r + 1] = 0
        self.num_slots_cpu[r] = 0
        return n

    # ------------------------------------------------------------ bookkeeping
    def metadata_bytes(self) -> int:
        """Bytes of LRU state (excluding the KV rows themselves and the per-batch plan workspace)."""
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.loc_to_slot,
                self.slot_loc,
                self.lru,
                self.out_cache_loc_sparse,
                self.num_slots,
            )
        )

    @staticmethod
    def metadata_fraction(
        context_len: int = 128 * 1024,
        num_layers: int = 61,
        row_bytes: int = 656,
        buffer_slots: int = 4096,
    ) -> float:
        """Metadata / managed KV bytes for one request of ``context_len`` tokens.

        Per token and layer: ``loc_to_slot`` 4 B. Per request and layer: ``slot_loc`` 4 B +
        ``lru`` 2 B per slot. Per request: ``out_cache_loc_sparse`` 4 B per slot + ``num_slots``.
        At 128K, 61 layers, 656 B rows, 4096 slots: (4*131072*61 + 6*4096*61 + 4*4096 + 4) /
        (656*131072*61) = 0.64 %.
        """
        slots = _round_up(buffer_slots, PAGE_SIZE)
        meta = 4 * context_len * num_layers + 6 * slots * num_layers + 4 * slots + 4
        return meta / (row_bytes * context_len * num_layers)

    def check_invariants(self, exact_hints: bool = True) -> None:
        """Slow full check of the state (tests and debugging); raises AssertionError.

        Always: the LRU orders are permutations, no claim code is left, and every hint names a
        slot that holds its loc in some request. ``exact_hints`` (no loc was ever in two
        requests' ``req_to_token`` rows, i.e. no shared prefix): every held loc is held once and
        its hint names its slot. With shared prefixes a request that lost a loc's hint to another
        request loads it again, so it may hold it twice, and a held loc's hint may be -1.
        """
        L = self.num_layers
        for r in range(self.max_reqs):
            n = self.num_slots_cpu[r]
            assert int(self.num_slots[r]) == n, f"num_slots mirror differs for req {r}"
            if n == 0:
                assert bool((self.slot_loc[:, r] == -1).all()), f"free req {r} has resident slots"
                continue
            assert bool((self.out_cache_loc_sparse[r, :n] >= 0).all())
            for layer in range(L):
                order = self.lru[layer, r, :n].long()
                assert torch.equal(
                    torch.sort(order).values, torch.arange(n, device=self.device)
                ), f"lru of req {r} layer {layer} is not a permutation"
            assert bool((self.slot_loc[:, r, n:] == -1).all())
        for layer in range(L):
            m = self.loc_to_slot[layer]
            assert bool((m >= -1).all()), "transient claim left in loc_to_slot"
            resident = torch.nonzero(m >= 0).flatten()
            sl = self.slot_loc[layer]
            named = sl[:, m[resident].long()] == resident.to(torch.int32)[None, :]
            assert bool(named.any(dim=0).all()), f"layer {layer}: stale loc_to_slot hints"
            if not exact_hints:
                continue
            owners = []
            for r in range(self.max_reqs):
                n = self.num_slots_cpu[r]
                if n:
                    held = sl[r, :n]
                    idx = torch.nonzero(held >= 0).flatten()
                    assert bool(
                        (m[held[idx].long()] == idx.to(torch.int32)).all()
                    ), f"layer {layer} req {r}: slot_loc and loc_to_slot disagree"
                    owners.append(held[idx].long())
            all_held = torch.cat(owners) if owners else resident.new_empty(0)
            assert all_held.numel() == torch.unique(all_held).numel(), "a loc is in two slots"
            assert all_held.numel() == resident.numel(), f"layer {layer}: stale loc_to_slot entries"
