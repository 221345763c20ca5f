"""One GPU arena per layer, shared by kv offload's physical KV rows and logical index pages.

Without kv offload a token costs ``R + 132`` bytes per layer (its KV row and its index keys). With it
a token whose KV lives on the host costs only its index keys, while a token the GPU keeps (a short
request's whole context, a decode tail, a prompt being staged, a sparse slot) still costs both. A
fixed split between the two would either lose to the flag-off server on short contexts or give up
the capacity offloading exists for, so both are carved out of the same bytes:

* each layer owns one ``uint8`` arena; the pool's ``kv_buffer[layer]`` (rows of ``R`` bytes) and
  ``index_k_with_scale_buffer[layer]`` (pages of ``64 x 132`` bytes) are two views of it, so the
  upstream kernels address both as they always do;
* the arena is cut into *units* of ``unit_pages`` physical pages; a unit is owned by the physical
  allocator, by the logical allocator (then only the index pages lying wholly inside it are
  handed out), or by nobody. Unit 0 (both allocators' padding page 0 lies in it) and the remainder
  after the last unit are physical for good;
* the two paged allocators only ever hold pages of units they own (:class:`ArenaPagedAllocator`).
  When one runs short it takes free units (the physical side the lowest, the logical side the
  highest), then units the other side no longer uses: logical units whose pages are all free, and
  physical units whose used pages are first moved into free rows of lower units (physical rows are
  only referenced through tables that :meth:`UnitArena.evacuate` rewrites; logical locs are
  referenced everywhere and never move).

Every ownership change is host-side, between forwards, ordered after the forward in flight by the
relocation listeners; nothing here runs inside a decode step or a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

FREE, PHYSICAL, LOGICAL = 0, 1, 2
"""Owners of a unit."""

MIN_UNITS = 32
"""Smallest number of units a layout aims for: ownership changes in steps of at most ~3 % of the
budget (large budgets use the unit that wastes no index byte, see :func:`plan_arena`)."""


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Where physical pages and logical (index) pages lie in one layer's arena.

    Physical page ``p`` covers bytes ``[p * page_bytes, (p + 1) * page_bytes)`` and logical page
    ``q`` bytes ``[q * index_page_bytes, (q + 1) * index_page_bytes)``. Unit ``k`` covers
    ``[k * unit_bytes, (k + 1) * unit_bytes)``; ``extra_pages`` physical pages follow the last
    unit.
    """

    page_size: int
    row_bytes: int
    index_row_bytes: int
    unit_pages: int
    num_units: int
    extra_pages: int

    def __post_init__(self) -> None:
        if self.num_units < 1 or self.unit_pages < 1 or self.extra_pages < 0:
            raise ValueError(f"invalid arena layout {self}")

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.row_bytes

    @property
    def index_page_bytes(self) -> int:
        return self.page_size * self.index_row_bytes

    @property
    def unit_bytes(self) -> int:
        return self.unit_pages * self.page_bytes

    @property
    def layer_bytes(self) -> int:
        return self.num_units * self.unit_bytes + self.extra_pages * self.page_bytes

    @property
    def physical_pages(self) -> int:
        """Physical page ids ``0 .. physical_pages - 1`` (page 0 is the padding page)."""
        return self.num_units * self.unit_pages + self.extra_pages

    @property
    def index_pages(self) -> int:
        """Index page ids the index view spans (only those inside units 1.. are handed out)."""
        return self.layer_bytes // self.index_page_bytes

    @property
    def logical_pages_per_unit(self) -> int:
        """Index pages a logical unit holds: as many as lie wholly inside every unit, so that
        capacity does not depend on which units turn logical."""
        return min(
            (k + 1) * self.unit_bytes // self.index_page_bytes
            - -(-k * self.unit_bytes // self.index_page_bytes)
            for k in range(1, self.num_units)
        ) if self.num_units > 1 else 0  # fmt: skip

    def logical_page_range(self, unit: int) -> range:
        """Logical page ids a logical ``unit`` hands out (none for unit 0)."""
        if unit == 0:
            return range(0)
        first = -(-unit * self.unit_bytes // self.index_page_bytes)
        return range(first, first + self.logical_pages_per_unit)

    def physical_page_range(self, unit: int) -> range:
        return range(unit * self.unit_pages, (unit + 1) * self.unit_pages)

    @property
    def fixed_physical_pages(self) -> int:
        """Physical pages that are always physical: unit 0 without the padding page, the extra."""
        return self.unit_pages - 1 + self.extra_pages

    @property
    def max_logical_pages(self) -> int:
        return (self.num_units - 1) * self.logical_pages_per_unit

    @property
    def max_physical_pages(self) -> int:
        """Allocatable physical pages when every unit is physical."""
        return self.physical_pages - 1

    def holds(self, physical_pages: int, logical_pages: int) -> bool:
        """Whether an empty arena holds that many physical and logical pages at once."""
        extra = max(0, physical_pages - self.fixed_physical_pages)
        units = -(-extra // self.unit_pages) + -(-logical_pages // self.logical_pages_per_unit)
        return units <= self.num_units - 1

    @property
    def resident_tokens(self) -> int:
        """The most tokens the arena holds with both a KV row and index keys (a workload of
        requests that all stay on the GPU): ``u`` logical units and the rest physical, best ``u``.
        """
        lp, pp = self.logical_pages_per_unit, self.unit_pages
        best = max(
            min(u * lp, self.fixed_physical_pages + (self.num_units - 1 - u) * pp)
            for u in range(self.num_units)
        )
        return best * self.page_size

    def unit_of_physical(self, pages: np.ndarray) -> np.ndarray:
        return np.minimum(pages // self.unit_pages, self.num_units)  # num_units: the extra pages

    def unit_of_logical(self, pages: np.ndarray) -> np.ndarray:
        return (pages * self.index_page_bytes) // self.unit_bytes


def plan_arena(
    layer_bytes: int, row_bytes: int, index_row_bytes: int, page_size: int
) -> ArenaLayout:
    """The layout of an arena of at most ``layer_bytes`` per layer that holds the most logical pages.

    Every candidate unit size keeps the whole arena usable as physical rows (the bytes after the
    last unit become extra physical pages), so the choice only decides how many index pages the
    units hold when they turn logical: a unit wastes the part of its bytes no whole index page
    fits in. The unit of ``lcm(page bytes, index page bytes)`` wastes nothing (33 pages for 656 B
    rows, 11 for 1152 B); smaller units are tried so that the arena has at least ``MIN_UNITS``.
    """
    page_bytes = page_size * row_bytes
    total_pages = int(layer_bytes) // page_bytes
    if total_pages < 2:
        raise ValueError(
            f"kv_offload GPU budget of {layer_bytes} B per layer holds fewer than two KV pages of "
            f"{page_size} x {row_bytes} B; raise --mem-fraction-static or --max-total-tokens"
        )
    lcm_pages = math.lcm(page_bytes, page_size * index_row_bytes) // page_bytes
    sizes = [lcm_pages] if total_pages // lcm_pages >= MIN_UNITS else []
    sizes = sizes or list(range(1, max(1, min(lcm_pages, total_pages // MIN_UNITS)) + 1))
    layouts = [
        ArenaLayout(
            page_size=page_size,
            row_bytes=row_bytes,
            index_row_bytes=index_row_bytes,
            unit_pages=n,
            num_units=total_pages // n,
            extra_pages=total_pages % n,
        )
        for n in sizes
    ]
    return max(layouts, key=lambda layout: layout.max_logical_pages)


class RelocationListener(Protocol):
    """Something that holds physical row ids (the allocator's mapping, the sparse slots, ...)."""

    def before_relocation(self) -> None:
        """Finish or order every use of physical rows in flight (forward, backups)."""

    def relocate_rows(self, remap: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Rewrite held physical row ids through ``remap`` (device, no sync)."""


class UnitArena:
    """Unit ownership of one server's arenas (all layers share it) and the moves between owners.

    Host state only (``owner``), plus the two allocators it feeds. Accounting queries never sync;
    :meth:`reclaim_logical` and :meth:`evacuate_physical`, run only when a side is short, read the
    free lists back (one small device read each).
    """

    def __init__(self, layout: ArenaLayout, kv_rows: Sequence[torch.Tensor], device) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.kv_rows = list(kv_rows)  # per layer, (physical_pages * page, row_bytes) uint8 views
        self.owner = np.full(layout.num_units, FREE, dtype=np.int8)
        self.owner[0] = PHYSICAL
        # Units holding pages a transfer in flight writes (PD staging): they stay physical.
        self.pinned = np.zeros(layout.num_units + 1, dtype=np.int64)
        self.physical: Optional["ArenaPagedAllocator"] = None
        self.logical: Optional["ArenaPagedAllocator"] = None
        self.listeners: List[RelocationListener] = []  # add_listener
        # Free pages each side must keep while the other is granted units (see ensure).
        self._keep = {PHYSICAL: 0, LOGICAL: 0}
        self.stats = {"units_to_physical": 0, "units_to_logical": 0, "evacuated_pages": 0}

    def add_listener(self, listener: RelocationListener) -> None:
        """Ask ``listener`` before, and tell it after, every move of physical rows."""
        self.listeners.append(listener)

    # ------------------------------------------------------------------ page ids
    def pages_of(self, kind: int, units: Sequence[int]) -> torch.Tensor:
        ranges = (
            self.layout.physical_page_range if kind == PHYSICAL else self.layout.logical_page_range
        )
        ids = [i for k in units for i in ranges(int(k))]
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def initial_pages(self, kind: int) -> torch.Tensor:
        """What ``kind``'s allocator holds when every unit but the fixed ones is free."""
        if kind == LOGICAL:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        layout = self.layout
        fixed = list(range(1, layout.unit_pages))
        fixed += range(layout.num_units * layout.unit_pages, layout.physical_pages)
        return torch.tensor(fixed, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        """Every unit but unit 0 back to free (the allocators are cleared with it)."""
        self.owner[:] = FREE
        self.owner[0] = PHYSICAL
        self.pinned[:] = 0

    # ------------------------------------------------------------------ accounting
    def owned_pages(self, kind: int) -> int:
        if kind == PHYSICAL:
            n = int((self.owner[1:] == PHYSICAL).sum())
            return self.layout.fixed_physical_pages + n * self.layout.unit_pages
        return int((self.owner == LOGICAL).sum()) * self.layout.logical_pages_per_unit

    def used_pages(self, kind: int) -> int:
        alloc = self.physical if kind == PHYSICAL else self.logical
        return self.owned_pages(kind) - alloc.available_size() // self.layout.page_size

    def _split(self, physical_pages: int) -> Optional[np.ndarray]:
        """The units that may turn logical while ``physical_pages`` stay physical: free units and
        unpinned physical units beyond the lowest ones the physical side keeps. None if the
        physical side cannot hold that many pages even with every such unit."""
        layout = self.layout
        units = np.arange(layout.num_units)
        pinned = (self.owner == PHYSICAL) & (self.pinned[: layout.num_units] > 0) & (units > 0)
        fixed = layout.fixed_physical_pages + int(pinned.sum()) * layout.unit_pages
        cands = units[((self.owner == FREE) | (self.owner == PHYSICAL)) & ~pinned & (units > 0)]
        keep = max(0, -(-(physical_pages - fixed) // layout.unit_pages))
        if keep > len(cands):
            return None
        return cands[keep:]

    def logical_pages_obtainable(self, physical_pages: int) -> int:
        """Logical pages the logical side can hand out while ``physical_pages`` physical pages
        (used and promised) stay available to the physical side (no sync)."""
        give = self._split(physical_pages)
        if give is None:
            return 0
        owned_free = self.logical.available_size() // self.layout.page_size
        return owned_free + len(give) * self.layout.logical_pages_per_unit

    def fits(self, physical_pages: int, logical_pages: int) -> bool:
        """Whether ``physical_pages`` physical and ``logical_pages`` logical pages in use at once
        fit. Logical units count as whole units (a fully free one is only counted as such after
        :meth:`reclaim_logical`), so a False may turn True after a reclaim."""
        give = self._split(physical_pages)
        if give is None:
            return False
        owned = self.owned_pages(LOGICAL)
        extra = logical_pages - owned
        if extra <= 0:
            return True
        return len(give) * self.layout.logical_pages_per_unit >= extra

    # ------------------------------------------------------------------ moves
    def ensure(self, logical_pages: int, physical_pages: int) -> bool:
        """Grant units until the logical side holds ``logical_pages`` free pages and the physical
        side ``physical_pages``, neither taking from the other what it must keep. False when the
        arena cannot (some units may have changed hands; no page was allocated)."""
        need = {
            LOGICAL: logical_pages - self.logical.available_size() // self.layout.page_size,
            PHYSICAL: physical_pages - self.physical.available_size() // self.layout.page_size,
        }
        self._keep = {LOGICAL: logical_pages, PHYSICAL: physical_pages}
        try:
            return all(need[kind] <= 0 or self.grant(kind, need[kind]) for kind in need)
        finally:
            self._keep = {PHYSICAL: 0, LOGICAL: 0}

    def grant(self, kind: int, pages: int) -> bool:
        """Give ``kind``'s allocator whole units holding at least ``pages`` more pages: free units
        first (the physical side the lowest, the logical side the highest), then units the other
        side gives up. False when even that is not enough (units given so far stay given)."""
        alloc = self.physical if kind == PHYSICAL else self.logical
        per_unit = (
            self.layout.unit_pages if kind == PHYSICAL else self.layout.logical_pages_per_unit
        )
        short = pages
        while short > 0:
            want = -(-short // per_unit)
            units = self._free_units(kind)
            if len(units) < want:
                if kind == PHYSICAL:
                    self.reclaim_logical()
                else:
                    self.evacuate_physical(want - len(units))
                units = self._free_units(kind)
                if len(units) == 0:
                    return False
            units = units[:want]
            self.owner[units] = kind
            self.stats["units_to_physical" if kind == PHYSICAL else "units_to_logical"] += len(
                units
            )
            alloc.add_pages(self.pages_of(kind, units))
            short -= len(units) * per_unit
        return True

    def _free_units(self, kind: int) -> np.ndarray:
        """Free units in the order ``kind`` takes them."""
        free = np.flatnonzero(self.owner == FREE)
        return free if kind == PHYSICAL else free[::-1]

    def reclaim_logical(self) -> int:
        """Free the logical units whose pages are all free; returns how many (one device read)."""
        units = np.flatnonzero(self.owner == LOGICAL)
        if len(units) == 0:
            return 0
        free = self.logical.all_free_pages().cpu().numpy()
        counts = np.bincount(self.layout.unit_of_logical(free), minlength=self.layout.num_units)
        empty = units[counts[units] == self.layout.logical_pages_per_unit]
        # Keep what the logical side is being granted for (the lowest empty units go first).
        spare = len(free) - self._keep[LOGICAL]
        empty = empty[: max(0, spare // self.layout.logical_pages_per_unit)]
        if len(empty):
            self.logical.remove_pages(self.pages_of(LOGICAL, empty))
            self.owner[empty] = FREE
        return len(empty)

    def evacuate_physical(self, units_wanted: int) -> int:
        """Free up to ``units_wanted`` physical units, the highest first, moving their used pages
        into free pages of the units kept; returns how many were freed (a device read, and a copy
        of the moved rows in every layer, ordered after the forward in flight)."""
        layout = self.layout
        units = np.arange(layout.num_units)
        movable = units[(self.owner == PHYSICAL) & (self.pinned[: layout.num_units] == 0)]
        movable = movable[movable > 0][::-1]
        if len(movable) == 0:
            return 0
        free = np.sort(self.physical.all_free_pages().cpu().numpy())
        unit_of = layout.unit_of_physical(free)
        chosen: List[int] = []
        moves_src: List[np.ndarray] = []
        for unit in movable[:units_wanted]:
            pages = np.arange(unit * layout.unit_pages, (unit + 1) * layout.unit_pages)
            in_unit = unit_of == unit
            used = np.setdiff1d(pages, free[in_unit], assume_unique=True)
            # Free pages outside every unit being emptied take the used ones.
            outside = ~np.isin(unit_of, chosen + [int(unit)])
            moved = sum(len(m) for m in moves_src) + len(used)
            if outside.sum() < moved or outside.sum() - moved < self._keep[PHYSICAL]:
                break
            chosen.append(int(unit))
            moves_src.append(used)
        if not chosen:
            return 0
        src = np.concatenate(moves_src) if moves_src else np.empty(0, np.int64)
        dst = free[~np.isin(unit_of, chosen)][: len(src)]
        if len(src):
            self._move_pages(src, dst)
        remove = self.pages_of(PHYSICAL, chosen)
        taken = torch.from_numpy(dst).to(self.device)
        self.physical.remove_pages(torch.cat([remove, taken]))
        self.owner[chosen] = FREE
        self.stats["evacuated_pages"] += len(src)
        return len(chosen)

    def _move_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        page = self.layout.page_size
        offs = np.arange(page)
        src_rows = torch.from_numpy((src[:, None] * page + offs).reshape(-1)).to(self.device)
        dst_rows = torch.from_numpy((dst[:, None] * page + offs).reshape(-1)).to(self.device)
        for listener in self.listeners:
            listener.before_relocation()
        for rows in self.kv_rows:
            rows[dst_rows] = rows[src_rows]
        table = torch.full((self.layout.physical_pages,), -1, dtype=torch.int64, device=self.device)
        table[torch.from_numpy(src).to(self.device)] = torch.from_numpy(dst).to(self.device)

        def remap(rows: torch.Tensor) -> torch.Tensor:
            valid = rows >= 0
            pages = torch.where(valid, rows, 0).to(torch.int64) // page
            moved = valid & (table[pages] >= 0)
            new = table[pages] * page + rows.to(torch.int64) % page
            return torch.where(moved, new.to(rows.dtype), rows)

        for listener in self.listeners:
            listener.relocate_rows(remap)

    # ------------------------------------------------------------------ PD staging
    def pin(self, pages: np.ndarray) -> None:
        """Keep the units of ``pages`` (host page ids a transfer writes) physical until unpinned."""
        np.add.at(self.pinned, self.layout.unit_of_physical(pages), 1)

    def unpin(self, pages: np.ndarray) -> None:
        np.add.at(self.pinned, self.layout.unit_of_physical(pages), -1)

    def state(self) -> Dict[str, int]:
        return {
            "units": self.layout.num_units,
            "unit_pages": self.layout.unit_pages,
            "physical_units": int((self.owner == PHYSICAL).sum()),
            "logical_units": int((self.owner == LOGICAL).sum()),
            "free_units": int((self.owner == FREE).sum()),
            **self.stats,
        }


class ArenaPagedAllocator:
    """Mixin over upstream's paged allocator: holds only pages of units it owns and asks the
    arena for more when an allocation would run short (see :func:`arena_paged_allocator`)."""

    arena: UnitArena
    kind: int

    def clear(self) -> None:
        super().clear()
        self.free_pages = self.arena.initial_pages(self.kind)

    def merge_and_sort_free(self) -> None:
        if not self.staged_pages:
            return
        # The physical side allocates the lowest pages first, the logical side the highest, so
        # that each keeps to its end of the arena and units in between empty out.
        self.free_pages, _ = torch.sort(self.get_all_free_pages(), descending=self.kind == LOGICAL)
        self.staged_pages = []
        self.num_staged_pages = 0

    def all_free_pages(self) -> torch.Tensor:
        self.merge_and_sort_free()
        return self.free_pages

    def add_pages(self, pages: torch.Tensor) -> None:
        self.merge_and_sort_free()
        self.free_pages, _ = torch.sort(
            torch.cat([self.free_pages, pages]), descending=self.kind == LOGICAL
        )

    def remove_pages(self, pages: torch.Tensor) -> None:
        """Drop ``pages`` (all free) from the free list (a device read: the list shrinks by a
        data-dependent count)."""
        self.merge_and_sort_free()
        keep = ~torch.isin(self.free_pages, pages.to(self.free_pages.device))
        self.free_pages = self.free_pages[keep]

    def ensure_free_pages(self, num_pages: int) -> bool:
        have = self.available_size() // self.page_size
        return have >= num_pages or self.arena.grant(self.kind, num_pages - have)

    def alloc(self, need_size: int):
        if not self.ensure_free_pages(-(-need_size // self.page_size)):
            return None
        return super().alloc(need_size)


def arena_paged_allocator(paged_cls: type, arena: UnitArena, kind: int, *args):
    """An instance of ``paged_cls`` (upstream's page allocator for this platform) with the
    :class:`ArenaPagedAllocator` behaviour, bound to ``arena`` as its ``kind`` side."""
    cls = type(f"Arena{paged_cls.__name__}", (ArenaPagedAllocator, paged_cls), {})
    obj = cls.__new__(cls)
    obj.arena = arena
    obj.kind = kind
    cls.__init__(obj, *args)
    return obj
