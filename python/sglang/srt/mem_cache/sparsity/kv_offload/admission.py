"""Admission control for ``--enable-kv-offload``: the GPU rows each live request is promised.

Every live request (staged for a prefill, pre-allocated for a PD transfer, or admitted) is promised
the physical rows it may come to hold at once (:meth:`AdmissionLedger.promise_rows`): a request
whose whole context takes no more rows than its sparse slots and tail pages is kept on the GPU
whole (*resident*: no backup, no slot, no load; its rows are its context), any other its sparse
slots plus its tail pages. The rows promised and not yet held
(:meth:`AdmissionLedger.owed_rows`) are kept out of the allocator's budget, and a new request is
staged only if its prompt, its promise and its logical locs fit in the arena beside them
(:meth:`AdmissionLedger.can_stage`), so an admitted request always finds its rows.

Host-side only: nothing here reads the device.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from sglang.srt.utils.common import ceil_align, ceil_div


def stays_resident(
    final_len: int, sparse_slots: int, tail_pages: int, page_size: int, lookahead: int = 0
) -> bool:
    """The resident rule: a request that may reach ``final_len`` positions (plus ``lookahead``
    positions allocated ahead) keeps its whole context on the GPU when that takes no more rows
    than going sparse would, its ``sparse_slots`` and its ``tail_pages``."""
    return ceil_align(final_len + lookahead, page_size) <= sparse_slots + tail_pages * page_size


@dataclasses.dataclass
class OffloadedRequest:
    """Host-side bookkeeping of one admitted request."""

    req_pool_idx: int
    seq_len: int  # allocated positions (their logical locs exist)
    written_len: int  # positions whose KV rows are written; only these may be backed up
    backed_up_end: int = 0  # positions [0, backed_up_end) have a backup started (page aligned)
    has_slots: bool = False
    # Pays for its slots with its own prompt rows: granted when their backup frees them (poll).
    slots_from_backup: bool = False
    # Kept on the GPU whole: its context takes no more rows than its sparse slots and tail pages.
    resident: bool = False
    # Radix cache: the prompt pages this request must back up (whole pages of logical locs, on the
    # device) when the rest of [0, backed_up_end) are a shared prefix backed up by another request.
    own_pages: Optional[torch.Tensor] = None
    fail_reason: Optional[str] = None  # fails at its first decode step (see admit)

    def held_rows(self, page_size: int, slots: int) -> int:
        """Physical rows it holds toward its promise: its context rows if resident; once it has
        ``slots`` sparse slots, those and the tail rows of positions no backup has started for;
        before that, those tail rows and its claimed prompt pages (rows whose backup is in flight
        are not subtracted: conservative)."""
        if self.resident:
            return ceil_align(self.seq_len, page_size)
        tail = max(0, ceil_align(self.seq_len, page_size) - self.backed_up_end)
        if self.has_slots:
            return slots + tail
        return tail + (self.own_pages.numel() if self.own_pages is not None else 0)


class AdmissionLedger:
    """The promises of every live request, and the prefill / PD gate that keeps them.

    Args:
        allocator: ``KVOffloadTokenToKVPoolAllocator`` (what fits in the arena now and empty).
        sparse_cache: the GPU LRU state (each request's most sparse slots, and the slots it holds).
        requests: the coordinator's admitted requests (what each holds), read only.
        tail_pages: GPU tail pages a decoding request may hold beyond its slots (2; speculative
            decoding allocates draft positions ahead, see ``runtime.speculative_shape``).
    """

    def __init__(
        self,
        allocator,
        sparse_cache,
        requests: Mapping[int, OffloadedRequest],
        tail_pages: int = 2,
    ) -> None:
        self.allocator = allocator
        self.sparse_cache = sparse_cache
        self.requests = requests
        self.page_size = allocator.page_size
        self.tail_pages = tail_pages
        # Positions a decode step allocates ahead of its committed tokens (speculative drafts).
        self.lookahead = (tail_pages - 2) * self.page_size
        # A sparse request's promise: its most sparse slots and its tail pages. A request whose
        # whole context takes no more rows stays resident.
        self.sparse_rows = sparse_cache.max_slots + tail_pages * self.page_size
        # A final length no resident request has (promised as a sparse one).
        self._sparse_len = self.sparse_rows + 1
        # req_pool_idx -> (final length, positions staged so far, positions its prompt stages in
        # GPU rows in all) before admission, (final length, 0, 0) after.
        self._promises: Dict[int, Tuple[int, int, int]] = {}
        self.prefill_waits = 0  # refusals of the prefill gate

    def __contains__(self, req_pool_idx: Optional[int]) -> bool:
        return req_pool_idx in self._promises  # None: a request with no row yet

    def __len__(self) -> int:
        return len(self._promises)

    def resident_len(self, final_len: int) -> bool:
        """Whether a request that may reach ``final_len`` positions is kept on the GPU whole: its
        whole context (speculative lookahead included) takes no more rows than going sparse
        would (its most sparse slots and its tail pages)."""
        return stays_resident(
            final_len, self.sparse_cache.max_slots, self.tail_pages, self.page_size, self.lookahead
        )

    def promise_rows(self, final_len: int, prompt_rows: int = 0) -> int:
        """Physical rows a request that may reach ``final_len`` positions may come to hold at
        once: its whole context if resident; else its most sparse slots and its tail pages or,
        while the ``prompt_rows`` its prompt stages sit in GPU rows, those rows and the page of its
        first decode token, whichever is more (the backup of those rows pays for its slots: see
        ``KVOffloadCoordinator._grant_slots``)."""
        if self.resident_len(final_len):
            return ceil_align(final_len + self.lookahead, self.page_size)
        return max(self.sparse_rows, prompt_rows + self.page_size + self.lookahead)

    def reserve(
        self,
        req_pool_idx: int,
        final_len: int,
        staged_len: int = 0,
        prompt_len: Optional[int] = None,
    ) -> None:
        """Promise a request its rows: staged for a prefill or pre-allocated for a PD transfer,
        ``staged_len`` positions in GPU rows so far of the ``prompt_len`` (default
        ``staged_len``) its prompt stages there in all; :meth:`withdraw` ends the promise."""
        prompt = int(staged_len if prompt_len is None else prompt_len)
        self._promises[int(req_pool_idx)] = (int(final_len), int(staged_len), prompt)

    def final_len(self, req_pool_idx: int) -> int:
        """The length a request was promised at staging; unknown ones are promised as sparse."""
        return self._promises.get(int(req_pool_idx), (self._sparse_len, 0, 0))[0]

    def admitted(self, req_pool_idx: int, resident_len: Optional[int] = None) -> None:
        """A request's promise once admitted (or gone sparse): its whole context of
        ``resident_len`` positions when it stays resident, else its sparse slots and tail pages."""
        final = self._sparse_len if resident_len is None else int(resident_len)
        self._promises[int(req_pool_idx)] = (final, 0, 0)

    def withdraw(self, req_pool_idx: int) -> None:
        """The request ended (finish, abort, retract, failed transfer): no promise any more."""
        self._promises.pop(int(req_pool_idx), None)

    def owed(self, req_pool_idx: int) -> int:
        """Physical rows request ``req_pool_idx`` is promised and does not hold yet."""
        r = int(req_pool_idx)
        final, staged, prompt = self._promises.get(r, (0, 0, 0))
        promise = self.promise_rows(final, ceil_align(prompt, self.page_size))
        req = self.requests.get(r)
        if req is None:  # staged: its prompt rows so far
            held = ceil_align(staged, self.page_size)
        else:
            held = req.held_rows(self.page_size, int(self.sparse_cache.num_slots_cpu[r]))
        return max(0, promise - held)

    def owed_rows(self) -> int:
        """Physical rows live requests are promised and do not hold yet (no device read)."""
        return sum(self.owed(r) for r in self._promises)

    def can_stage(self, prompts: Sequence[Tuple[int, int, int]]) -> bool:
        """Whether new requests fit beside the live ones: ``prompts`` are ``(staging rows, logical
        locs, final length)`` each, the rows its prompt stages on the GPU (0 when it arrives on the
        host), the logical locs it takes and the length it may reach."""
        return self.allocator.fits(*self.stage_cost(prompts))

    def stage_cost(self, prompts: Sequence[Tuple[int, int, int]]) -> Tuple[int, int]:
        """(physical rows, logical locs) such new requests take from the room beside the live
        ones once staged and promised (``prompts`` as in :meth:`can_stage`)."""
        rows = logical = 0
        for staging, locs, final in prompts:
            rows += self._stage_rows(staging, final)
            logical += locs
        return rows, logical

    def can_ever_stage(self, staging: int, locs: int, final_len: int) -> bool:
        """Whether one such prompt (as in :meth:`can_stage`) fits the whole arena, empty."""
        page = self.page_size
        rows = self._stage_rows(staging, final_len)
        return self.allocator.arena.layout.holds(ceil_div(rows, page), ceil_div(locs, page))

    def _stage_rows(self, staging: int, final_len: int) -> int:
        """Rows a new prompt takes at most: its ``staging`` rows, or its promise if more."""
        prompt_rows = ceil_align(staging, self.page_size)
        return staging + max(0, self.promise_rows(final_len, prompt_rows) - prompt_rows)

    def count_prefill_wait(self) -> None:
        """Count one refusal of the prefill gate (``prefill_waits``)."""
        self.prefill_waits += 1
