"""GPU LRU state of the per-layer sparse KV cache (``--enable-kv-offload``).

Every request owns ``num_slots[r]`` physical KV rows (its *sparse slots*), granted page by page from a
pool shared by all requests. Slot ``s`` of request ``r`` is the physical row
``out_cache_loc_sparse[r, s]`` in every layer's KV buffer; what it holds differs per layer.

Per layer ``l`` the state is

* ``slot_loc[l, r, s]`` (int32): logical loc held by slot ``s``, -1 if empty (``cache_ids_inverse``);
* ``lru[l, r, :num_slots[r]]`` (int16): a dense permutation of the request's slots, least recently used
  first. The plan kernel keeps it dense, so no per-step pass compacts or reorders it;
* ``hint[l, r, :]`` (int16): the request's own hashed table from loc to slot:
  ``HINT_ENTRIES_PER_SLOT`` entries per slot of
  ``max_slots``, in buckets of ``HINT_WAYS``. A loc may sit in any way of two buckets, one per
  multiplier of ``HINT_HASHES``; an entry holds a slot or -1.

A loc ``x`` is a hit of request ``r`` iff some candidate entry of ``x`` in ``hint[l, r]`` names a slot
``s`` with ``slot_loc[l, r, s] == x``. The table is only ever read and written by request ``r``'s own
plans, so requests sharing locs (radix prefixes) never take each other's entries. It is a hint: an
entry lost to a full pair of buckets makes its loc a later miss (loaded into another slot, the old
copy ages out), never a wrong row. Invariants (the tests check them after every step):
every entry names a slot holding a loc that has the entry among its candidates; no slot and no loc
is named twice.

Admission, growth and release run between forward passes (scheduler side, eager, may sync); only the
plan kernel (``lru_kernels.plan_layer``) runs inside the CUDA graph.
"""

from __future__ import annotations

import logging
from typing import List, NamedTuple, Optional, Protocol

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import MAX_SLOTS_PER_REQ, PAGE_SIZE
from sglang.srt.utils.common import ceil_align

logger = logging.getLogger(__name__)

HINT_WAYS = 4
"""Entries per bucket of a request's hint table."""
HINT_HASHES = (0x5BD1E995, 0x27D4EB2F)
"""Odd multipliers below 2**31, one per bucket a loc may sit in: the bucket is the top bits of
``(loc * m) mod 2**32`` scaled to the bucket count (``lru_kernels`` does the same arithmetic)."""
HINT_ENTRIES_PER_SLOT = 2
"""Hint entries per slot of ``max_slots``: at most half of them are in use."""


class SlotAllocator(Protocol):
    """What we need from the physical page allocator (``PagedTokenToKVPoolAllocator``)."""

    page_size: int

    def alloc(self, need_size: int) -> Optional[torch.Tensor]: ...

    def available_size(self) -> int: ...

    def free_page_ids(self, page_ids: torch.Tensor) -> None: ...


class LayerState(NamedTuple):
    """Views of one layer's LRU state, as the plan kernel (and its reference) consume it."""

    hint: torch.Tensor  # (R, H) int16, H = HINT_ENTRIES_PER_SLOT * S_max
    slot_loc: torch.Tensor  # (R, S_max) int32
    lru: torch.Tensor  # (R, S_max) int16
    out_cache_loc_sparse: torch.Tensor  # (R, S_max) int32, shared by all layers
    num_slots: torch.Tensor  # (R,) int32, shared by all layers


class SparseCacheState:
    """GPU LRU state of the sparse KV cache for all layers and request slots.

    Args:
        num_layers: layers that own a sparse cache.
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
        max_reqs: int,
        buffer_slots: int,
        topk: int,
        allocator: SlotAllocator,
        device: torch.device | str = "cuda",
    ) -> None:
        page = getattr(allocator, "page_size", PAGE_SIZE)
        if page != PAGE_SIZE:
            raise ValueError(f"kv_offload sparse cache needs page_size {PAGE_SIZE}, got {page}")
        max_slots = ceil_align(buffer_slots, PAGE_SIZE)
        if max_slots < topk:
            raise ValueError(
                f"sparse buffer ({buffer_slots} slots/request) must hold a full top-k ({topk})"
            )
        if max_slots > MAX_SLOTS_PER_REQ:
            raise ValueError(f"sparse buffer too large ({max_slots} > {MAX_SLOTS_PER_REQ} slots)")
        self.num_layers = num_layers
        self.max_reqs = max_reqs
        self.max_slots = max_slots
        self.topk = topk
        self.allocator = allocator
        self.device = torch.device(device)

        i32 = dict(dtype=torch.int32, device=self.device)
        self.hint_buckets = HINT_ENTRIES_PER_SLOT * max_slots // HINT_WAYS
        self.hint = torch.full(
            (num_layers, max_reqs, self.hint_buckets * HINT_WAYS),
            -1,
            dtype=torch.int16,
            device=self.device,
        )
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
        return min(self.max_slots, ceil_align(max(int(context_len), 1), PAGE_SIZE))

    def layer(self, layer_id: int) -> LayerState:
        return LayerState(
            self.hint[layer_id],
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
        self.hint[:, r] = -1
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

    def release(self, req_pool_idx: int) -> int:
        """Free the request's slots and clear its hint table. Returns the rows freed.

        Idempotent: a second call (e.g. abort after finish) frees nothing, so no row is freed twice.
        """
        r = int(req_pool_idx)
        n = self.num_slots_cpu[r]
        if n == 0:
            return 0
        self.hint[:, r] = -1
        self.slot_loc[:, r, :n] = -1
        self.lru[:, r, :n] = 0
        rows = self.out_cache_loc_sparse[r, :n].to(torch.int64)
        self.allocator.free_page_ids(rows[::PAGE_SIZE] // PAGE_SIZE)
        self.out_cache_loc_sparse[r, :n] = -1
        self.num_slots[r : r + 1] = 0
        self.num_slots_cpu[r] = 0
        return n
