"""GPU LRU state of the per-layer sparse KV cache (``--enable-kv-offload``).

Every request owns sparse slots: physical KV rows, granted page by page. Layers may have different
slot budgets (``layer_slots_per_req``); layers with the same budget form a *budget group*. The
smallest budget's slots (the *base* slots) come from the physical pool shared with the decode
tails and staged prompts, and are the same rows in every layer; a group with a larger budget holds
its slots beyond the base in rows of its own (``extra_allocators``: rows past the shared ones in
its layers' KV buffers). With one budget (the default) there is one group and no extra rows.
Slot ``s`` of request ``r`` is the physical row ``out_cache_loc_sparse[g, r, s]`` of its layer's
KV buffer, ``g`` the layer's group; what it holds differs per layer. A request's slots are
``[0, base)`` base rows, then its group's extra rows (base slots fill before any extra is granted).

Per layer ``l`` the state is

* ``loc_to_slot[l, loc]`` (int32): local slot of logical loc ``loc`` in its request, -1 if not resident
  (the seed's ``cpu_slot_to_gpu_slot``, keyed by logical loc);
* ``slot_loc[l, r, s]`` (int32): logical loc held by slot ``s``, -1 if empty (``cache_ids_inverse``);
* ``lru[l, r, :num_slots[g, r]]`` (int16): a dense permutation of the request's slots, least recently
  used first (replaces ``cache_ids``/``cache_lens``). The plan kernel keeps it dense, so the seed's
  per-step ``CompactCacheIdsBlock``/``ReorderOutCacheLocSparse`` passes do not exist here.

Invariant (checked by :meth:`SparseCacheState.check_invariants`): ``loc_to_slot[l, x] == s >= 0`` iff
``slot_loc[l, r, s] == x`` for the request ``r`` owning ``x``.

Admission, growth and release run between forward passes (scheduler side, eager, may sync); only the
plan kernel (``lru_kernels.plan_layer``) runs inside the CUDA graph.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

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
    out_cache_loc_sparse: torch.Tensor  # (R, S_max) int32, shared by the layer's budget group
    num_slots: torch.Tensor  # (R,) int32, shared by the layer's budget group


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class SparseCacheState:
    """GPU LRU state of the sparse KV cache for all layers and request slots.

    Args:
        num_layers: layers that own a sparse cache.
        num_logical_locs: size of the logical loc space (``loc_to_slot`` length; every top-k loc and
            every loc passed to :meth:`mark_resident` must be below it).
        max_reqs: ``req_to_token_pool`` size (request pool indices are below it).
        buffer_slots: sparse slots per request at most (rounded up to the page size), one number
            for every layer or one per layer; each must be ``>= topk`` so a long request can
            always hold a full top-k.
        topk: indexer top-k (2048 for DeepSeek-V3.2).
        allocator: physical row allocator shared with the tail pages (page-aligned ``alloc``); it
            grants the base slots.
        device: where the state lives.
        extra_allocators: per budget larger than the smallest, the allocator of that group's
            extra rows (required exactly for those budgets).
        extra_row_offset: added to an extra allocator's rows to address the layer's KV buffer
            (its rows past the shared pool's).
    """

    def __init__(
        self,
        num_layers: int,
        num_logical_locs: int,
        max_reqs: int,
        buffer_slots: Union[int, Sequence[int]],
        topk: int,
        allocator: SlotAllocator,
        device: torch.device | str = "cuda",
        extra_allocators: Optional[Mapping[int, SlotAllocator]] = None,
        extra_row_offset: int = 0,
    ) -> None:
        allocators = [allocator, *(extra_allocators or {}).values()]
        for a in allocators:
            page = getattr(a, "page_size", PAGE_SIZE)
            if page != PAGE_SIZE:
                raise ValueError(f"kv_offload sparse cache needs page_size {PAGE_SIZE}, got {page}")
        if isinstance(buffer_slots, int):
            buffer_slots = [buffer_slots] * num_layers
        if len(buffer_slots) != num_layers:
            raise ValueError(f"{len(buffer_slots)} slot budgets for {num_layers} layers")
        layer_slots = [_round_up(int(n), PAGE_SIZE) for n in buffer_slots]
        if min(layer_slots) < topk:
            raise ValueError(
                f"sparse buffer ({min(buffer_slots)} slots/request) must hold a full top-k ({topk})"
            )
        if max(layer_slots) > MAX_SLOTS_PER_REQ:
            raise ValueError(
                f"sparse buffer too large ({max(layer_slots)} > {MAX_SLOTS_PER_REQ} slots)"
            )
        budgets = sorted(set(layer_slots))
        extra = dict(extra_allocators or {})
        if sorted(extra) != budgets[1:]:
            raise ValueError(
                f"extra row allocators for budgets {sorted(extra)}; the layer budgets {budgets} "
                f"need one for each of {budgets[1:]}"
            )
        self.num_layers = num_layers
        self.num_logical_locs = num_logical_locs
        self.max_reqs = max_reqs
        self.layer_slots: Tuple[int, ...] = tuple(layer_slots)
        self.max_slots = budgets[-1]
        self.base_slots = budgets[0]
        self.group_slots: Tuple[int, ...] = tuple(budgets)
        self.layer_group: Tuple[int, ...] = tuple(budgets.index(n) for n in layer_slots)
        self.topk = topk
        self.allocator = allocator
        self.extra_allocators: Dict[int, SlotAllocator] = extra
        self.extra_row_offset = extra_row_offset
        self.device = torch.device(device)

        i32 = dict(dtype=torch.int32, device=self.device)
        groups = len(budgets)
        self.loc_to_slot = torch.full((num_layers, num_logical_locs), -1, **i32)
        self.slot_loc = torch.full((num_layers, max_reqs, self.max_slots), -1, **i32)
        self.lru = torch.zeros(
            (num_layers, max_reqs, self.max_slots), dtype=torch.int16, device=self.device
        )
        self.out_cache_loc_sparse = torch.full((groups, max_reqs, self.max_slots), -1, **i32)
        self.num_slots = torch.zeros((groups, max_reqs), **i32)
        self._group_layers = [
            torch.tensor(
                [l for l in range(num_layers) if self.layer_group[l] == g],
                dtype=torch.int64,
                device=self.device,
            )
            for g in range(groups)
        ]
        # Host mirror: admission decisions must not sync with the device. A request's slots in
        # the largest budget's layers; each group holds ``min(budget, granted)`` of them.
        self.granted_cpu: List[int] = [0] * max_reqs

    # ------------------------------------------------------------------ sizing
    def slots_for(self, context_len: int) -> int:
        """Base slots (shared-pool rows) a request of ``context_len`` tokens owns:
        ``min(smallest budget, context)`` page-rounded."""
        return min(self.base_slots, self._granted_for(context_len))

    def _granted_for(self, context_len: int) -> int:
        return min(self.max_slots, _round_up(max(int(context_len), 1), PAGE_SIZE))

    def group_slots_for(self, granted: int) -> List[int]:
        """Slots each budget group holds for a request granted ``granted`` slots."""
        return [min(n, granted) for n in self.group_slots]

    def _rows_needed(self, old: int, new: int) -> List[int]:
        """Rows each group's pool grants to take a request from ``old`` to ``new`` granted slots:
        shared rows for group 0, the group's own for the others (after the shared ones)."""
        base_old, base_new = min(self.base_slots, old), min(self.base_slots, new)
        return [base_new - base_old] + [
            min(n, new) - max(min(n, old), base_new) for n in self.group_slots[1:]
        ]

    def _group_pool(self, g: int) -> Tuple[SlotAllocator, int]:
        """Group ``g``'s row allocator and the offset of its rows in the layers' KV buffers."""
        if g == 0:
            return self.allocator, 0
        return self.extra_allocators[self.group_slots[g]], self.extra_row_offset

    def can_admit(self, context_len: int) -> bool:
        need = self._rows_needed(0, self._granted_for(context_len))
        return all(self._group_pool(g)[0].available_size() >= n for g, n in enumerate(need))

    def shared_slots_held(self, req_pool_idx: int) -> int:
        """Slots the request holds in the shared pool's rows (its base slots)."""
        return min(self.base_slots, self.granted_cpu[int(req_pool_idx)])

    def shared_slots_total(self) -> int:
        """Slots all requests hold in the shared pool's rows."""
        return sum(min(self.base_slots, granted) for granted in self.granted_cpu)

    def own_rows_held(self, req_pool_idx: int, budget: int) -> int:
        """Rows of budget group ``budget``'s own pool that the request holds."""
        held = self._rows_needed(0, self.granted_cpu[int(req_pool_idx)])
        return held[self.group_slots.index(budget)]

    def layer(self, layer_id: int) -> LayerState:
        g = self.layer_group[layer_id]
        return LayerState(
            self.loc_to_slot[layer_id],
            self.slot_loc[layer_id],
            self.lru[layer_id],
            self.out_cache_loc_sparse[g],
            self.num_slots[g],
        )

    # --------------------------------------------------------------- lifecycle
    def _take_rows(self, old: int, new: int) -> Optional[List[Optional[torch.Tensor]]]:
        """Rows that take a request from ``old`` to ``new`` granted slots, per group (the base
        rows for group 0, the group's own for the others); None, with nothing taken, if a pool
        is short."""
        taken: List[Optional[torch.Tensor]] = []
        for g, need in enumerate(self._rows_needed(old, new)):
            rows = None
            if need > 0:
                alloc, offset = self._group_pool(g)
                rows = alloc.alloc(need)
                if rows is None:
                    self._give_back(taken)
                    return None
                rows = rows + offset
            taken.append(rows)
        return taken

    def _give_back(self, per_group: Sequence[Optional[torch.Tensor]]) -> None:
        for g, rows in enumerate(per_group):
            if rows is None or rows.numel() == 0:
                continue
            alloc, offset = self._group_pool(g)
            pages = (rows.to(torch.int64) - offset)[::PAGE_SIZE] // PAGE_SIZE
            alloc.free_page_ids(pages)

    def _place(self, r: int, old: int, new: int, taken: List[Optional[torch.Tensor]]) -> None:
        """Write the rows of slots ``[old, new)`` (per group) and put them at the LRU end."""
        base_rows = taken[0]
        for g, n in enumerate(self.group_slots):
            lo, hi = min(n, old), min(n, new)
            if hi <= lo:
                continue
            ocls = self.out_cache_loc_sparse[g, r]
            at = lo
            if base_rows is not None:
                ocls[at : at + base_rows.numel()] = base_rows.to(torch.int32)
                at += base_rows.numel()
            if g and taken[g] is not None:
                ocls[at:hi] = taken[g].to(torch.int32)
            layers = self._group_layers[g]
            fresh = torch.arange(lo, hi, dtype=torch.int16, device=self.device)
            if lo:
                kept = self.lru[layers, r, :lo]
                self.lru[layers, r, hi - lo : hi] = kept
            self.lru[layers, r, : hi - lo] = fresh
            self.num_slots[g, r : r + 1] = hi  # a slice fills on the device: no sync
        self.slot_loc[:, r, old:new] = -1

    def admit(self, req_pool_idx: int, context_len: int) -> bool:
        """Grant slots to a new request. Returns False (state untouched) if a pool is exhausted.

        Raises:
            RuntimeError: the request already owns slots (admission is exactly-once).
        """
        r = int(req_pool_idx)
        if self.granted_cpu[r] != 0:
            raise RuntimeError(f"req_pool_idx {r} already owns {self.granted_cpu[r]} sparse slots")
        granted = self._granted_for(context_len)
        taken = self._take_rows(0, granted)
        if taken is None:
            logger.debug(
                "sparse slot pool exhausted: need %d, have %d",
                granted,
                self.allocator.available_size(),
            )
            return False
        self._place(r, 0, granted, taken)
        self.granted_cpu[r] = granted
        return True

    def grow(self, req_pool_idx: int, new_context_len: int) -> bool:
        """Grow a request's slots towards ``new_context_len``.

        New (empty) slots go to the LRU end of every layer's order so they are filled before any
        resident token is evicted. Returns False (state untouched) if a pool is exhausted; the
        caller must then retract the request or accept slot overflow (see ``plan_layer``).
        """
        r = int(req_pool_idx)
        old = self.granted_cpu[r]
        if old == 0:
            raise RuntimeError(f"req_pool_idx {r} owns no sparse slots; admit it first")
        new = self._granted_for(new_context_len)
        if new <= old:
            return True
        taken = self._take_rows(old, new)
        if taken is None:
            return False
        self._place(r, old, new, taken)
        self.granted_cpu[r] = new
        return True

    def mark_resident(self, req_pool_idx: int, locs: torch.Tensor) -> torch.Tensor:
        """Declare that slot ``i`` holds logical loc ``locs[i]`` in every layer (freshly admitted only).

        Use it when a request's KV is already on the GPU at admission (e.g. a short prompt): the
        caller copies each layer's rows of ``locs`` into the returned physical rows (base rows:
        the same in every layer). Those tokens start as most recent; the remaining slots stay empty.
        """
        r = int(req_pool_idx)
        n = self.shared_slots_held(r)
        m = int(locs.numel())
        if m > n:
            raise ValueError(f"{m} resident tokens do not fit in {n} slots")
        if m == 0:
            return self.out_cache_loc_sparse[0, r, :0]
        granted = self.granted_cpu[r]
        if bool((self.slot_loc[:, r, :granted] >= 0).any()):
            raise RuntimeError("mark_resident needs a request whose slots are all empty")
        locs = locs.to(device=self.device, dtype=torch.int64)
        slots = torch.arange(m, dtype=torch.int32, device=self.device)
        self.loc_to_slot[:, locs] = slots
        self.slot_loc[:, r, :m] = locs.to(torch.int32)
        for g, held in enumerate(self.group_slots_for(granted)):
            order = torch.cat(
                [torch.arange(m, held, device=self.device), torch.arange(m, device=self.device)]
            ).to(torch.int16)
            self.lru[self._group_layers[g], r, :held] = order
        return self.out_cache_loc_sparse[0, r, :m]

    def release(self, req_pool_idx: int) -> int:
        """Free the request's slots and clear every map entry it set. Returns the base rows freed
        (shared-pool rows; a group's own rows go back to its allocator too).

        Idempotent: a second call (e.g. abort after finish) frees nothing, so no row is freed twice.
        """
        r = int(req_pool_idx)
        granted = self.granted_cpu[r]
        if granted == 0:
            return 0
        n = self.shared_slots_held(r)
        locs = self.slot_loc[:, r, :granted].long()
        # Empty slots hold -1; they clear the padding entry (the last, always -1) instead of being
        # masked out, and index_fill_ takes no host value: no device sync.
        width = self.num_logical_locs
        locs = torch.where(locs < 0, width - 1, locs)
        layer_base = torch.arange(self.num_layers, device=self.device)[:, None] * width
        self.loc_to_slot.view(-1).index_fill_(0, (layer_base + locs).reshape(-1), -1)
        self.slot_loc[:, r, :granted] = -1
        self.lru[:, r, :granted] = 0
        ocls = self.out_cache_loc_sparse[:, r]
        # Group 0 holds the base rows; every other group its own rows past them.
        held = self.group_slots_for(granted)
        self._give_back([ocls[0, :n]] + [ocls[g, n : held[g]] for g in range(1, len(held))])
        ocls[:, :granted] = -1
        self.num_slots[:, r] = 0
        self.granted_cpu[r] = 0
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

    def check_invariants(self) -> None:
        """Slow full check of the state (tests and debugging); raises AssertionError."""
        L = self.num_layers
        for r in range(self.max_reqs):
            granted = self.granted_cpu[r]
            held = self.group_slots_for(granted)
            assert self.num_slots[:, r].tolist() == held, f"num_slots mirror differs for req {r}"
            if granted == 0:
                assert bool((self.slot_loc[:, r] == -1).all()), f"free req {r} has resident slots"
                continue
            base = self.out_cache_loc_sparse[0, r, : held[0]]
            for g, n in enumerate(held):
                rows = self.out_cache_loc_sparse[g, r, :n]
                assert bool((rows >= 0).all())
                assert torch.equal(rows[: held[0]], base), f"req {r} group {g}: base rows differ"
                own = rows[held[0] :]
                assert bool((own >= self.extra_row_offset).all()), f"req {r}: own rows overlap"
            for layer in range(L):
                n = held[self.layer_group[layer]]
                order = self.lru[layer, r, :n].long()
                assert torch.equal(
                    torch.sort(order).values, torch.arange(n, device=self.device)
                ), f"lru of req {r} layer {layer} is not a permutation"
                assert bool((self.slot_loc[layer, r, n:] == -1).all())
        # Map <-> inverse agreement, all layers at once.
        for layer in range(L):
            m = self.loc_to_slot[layer]
            assert bool((m >= -1).all()), "transient claim left in loc_to_slot"
            resident = torch.nonzero(m >= 0).flatten()
            sl = self.slot_loc[layer]
            owners = []
            for r in range(self.max_reqs):
                n = self.group_slots_for(self.granted_cpu[r])[self.layer_group[layer]]
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
