"""GPU side of kv_offload: the DSA pool over one arena per layer, its allocator and GPU sizing.

* Logical locations (``req_to_token`` entries) address the indexer key buffer
  (``index_k_with_scale_buffer``, :func:`index_row_bytes` per token and layer: 132 B for
  DeepSeek-V3.2's 128-dim keys) for the whole context of every request.
* Physical KV rows (656 B fp8 layout / 1152 B bf16 per token and layer) exist only for tokens the GPU
  keeps: the whole context of a request no longer than its sparse slots and tail pages, sparse slots, decode tails and
  prompts not yet backed up.
* Both live in the same bytes (:mod:`arena`): the KV buffer and the index buffer of a layer are two
  views of one arena, whose units move between the physical and the logical allocator as requests
  need them, so a token the GPU keeps costs what it costs without kv offload.
* ``full_to_hisparse_device_index_mapping[logical] -> physical row`` (0 = none) is upstream's
  HiSparse table, reused as is; ``loc_to_host[logical] -> host slot`` (-1 = not backed up) is ours.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.sparsity.kv_offload.arena import (
    LOGICAL,
    PHYSICAL,
    ArenaLayout,
    UnitArena,
    arena_paged_allocator,
    plan_arena,
)
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import RowView
from sglang.srt.platforms import current_platform
from sglang.srt.utils.common import get_num_new_pages

logger = logging.getLogger(__name__)

# Per logical loc (all layers) besides its index keys: its physical row
# (``full_to_hisparse_device_index_mapping``) and its host slot (``loc_to_host``), int64 each.
LOGICAL_LOC_STATE_BYTES = 16


# --------------------------------------------------------------------------------------------------
# Sizing
# --------------------------------------------------------------------------------------------------


def kv_row_bytes(kv_cache_dim: int, store_dtype: torch.dtype) -> int:
    """656 for the DSA fp8 layout (uint8 store), 1152 for bf16 (576 x 2)."""
    return kv_cache_dim * torch.empty((), dtype=store_dtype).element_size()


def index_row_bytes(index_head_dim: int) -> int:
    """Bytes of one token's indexer key per layer in ``DSATokenToKVPool``: fp8 keys plus one fp32
    scale per 128-dim quantisation block (132 for DeepSeek-V3.2's ``index_head_dim`` 128)."""
    return index_head_dim + index_head_dim // DSATokenToKVPool.quant_block_size * 4


@dataclass(frozen=True)
class OffloadPoolSizing:
    """The arena layout of every layer, and the per-request decode shape it serves (tail pages a
    sparse request may hold, tokens a verify step plans per request; see
    ``runtime.speculative_shape``)."""

    layout: ArenaLayout
    num_layers: int
    tail_pages: int = 2
    verify_tokens: int = 1

    @property
    def logical_tokens(self) -> int:
        """Logical locs when every unit but unit 0 is logical: the most tokens the GPU can index."""
        return self.layout.max_logical_pages * self.layout.page_size

    @property
    def physical_rows(self) -> int:
        """Physical KV rows when every unit is physical: the most tokens the GPU can keep."""
        return self.layout.max_physical_pages * self.layout.page_size

    @property
    def arena_bytes(self) -> int:
        return self.layout.layer_bytes * self.num_layers


def size_arena(
    budget_bytes: int,
    num_layers: int,
    row_bytes: int,
    index_row_bytes: int,
    page_size: int,
    *,
    logical_loc_bytes: int = 0,
) -> OffloadPoolSizing:
    """Size the arenas for a GPU byte budget.

    Besides the arenas, every logical loc the index view spans costs ``logical_loc_bytes`` of state
    outside them (:data:`LOGICAL_LOC_STATE_BYTES`, a speculative draft model's dense KV),
    so the arenas take ``budget / (layers + logical_loc_bytes / index_row_bytes)`` bytes per layer.
    A token the GPU keeps then costs ``row_bytes + index_row_bytes (+ its state)`` per layer, as
    upstream charges, and a token on the host only its index keys (and state).
    """
    per_layer = budget_bytes / (num_layers + logical_loc_bytes / index_row_bytes)
    layout = plan_arena(int(per_layer), row_bytes, index_row_bytes, page_size)
    return OffloadPoolSizing(layout=layout, num_layers=num_layers)


# --------------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------------


class KVOffloadDSATokenToKVPool(HiSparseDSATokenToKVPool):
    """DSA pool whose KV rows and index pages are two views of one arena per layer (``sizing``).

    Both views span the whole arena, so the logical size (index keys) is given to
    ``HiSparseDSATokenToKVPool`` explicitly (``logical_size``, patch 0002) instead of as an integer
    multiple of the physical one. The two buffer hooks (``_create_buffers`` for the KV rows,
    ``_create_index_key_cache`` for the index pages) build the views. KV reads and writes by
    logical loc are translated through the HiSparse mapping (inherited).

    ``offload_config`` is the parsed ``--kv-offload-config`` the server built the pool from;
    ``runtime`` hands it and ``sizing`` on to the allocator and the offload set-up.
    """

    def __init__(
        self,
        sizing: OffloadPoolSizing,
        page_size: int,
        kv_lora_rank: int,
        dtype: torch.dtype,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        index_head_dim: int,
        enable_memory_saver: bool,
        kv_cache_dim: int,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        tail_extra_slots: int = 0,
        max_running_requests: Optional[int] = None,
        offload_config: Optional[KVOffloadConfig] = None,
    ):
        layout = sizing.layout
        if layout.page_size != page_size:
            raise ValueError(f"arena page size {layout.page_size} != pool page size {page_size}")
        self.sizing = sizing
        physical_size = layout.max_physical_pages * page_size
        logical_size = (layout.index_pages - 1) * page_size
        super().__init__(
            size=physical_size,
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            dtype=dtype,
            qk_rope_head_dim=qk_rope_head_dim,
            layer_num=layer_num,
            device=device,
            index_head_dim=index_head_dim,
            enable_memory_saver=enable_memory_saver,
            kv_cache_dim=kv_cache_dim,
            start_layer=start_layer,
            end_layer=end_layer,
            tail_extra_slots=tail_extra_slots,
            max_running_requests=max_running_requests,
            logical_size=logical_size,
        )
        if self.bytes_per_token != layout.row_bytes:
            raise ValueError(
                f"arena rows of {layout.row_bytes} B do not match the pool's "
                f"{self.kv_cache_dim} x {self.store_dtype} KV rows"
            )
        self.physical_size, self.logical_size = physical_size, logical_size
        self.loc_to_host: Optional[torch.Tensor] = None
        self.offload_config = offload_config
        self.row_views: List[RowView] = [RowView(buf) for buf in self.kv_buffer]

    def _create_buffers(self) -> None:
        layout = self.sizing.layout
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            with (
                torch.cuda.use_mem_pool(self.custom_mem_pool)
                if self.custom_mem_pool
                else nullcontext()
            ):
                self.arenas = [
                    torch.zeros((layout.layer_bytes,), dtype=torch.uint8, device=self.device)
                    for _ in range(self.layer_num)
                ]
        rows = layout.physical_pages * layout.page_size
        self.kv_buffer = [
            arena.view(self.store_dtype).view(rows, 1, self.kv_cache_dim) for arena in self.arenas
        ]

    def _create_index_key_cache(self) -> IndexKeyCache:
        layout = self.sizing.layout
        # The parent builds one-page placeholders; the arena views replace them.
        cache = IndexKeyCache(self, 0)
        cache.buffer = [
            arena[: layout.index_pages * layout.index_page_bytes].view(
                layout.index_pages, layout.index_page_bytes
            )
            for arena in self.arenas
        ]
        return cache

    def get_contiguous_buf_infos(self):
        """PD transfer registration of the KV rows: the whole arena of each layer (see
        :meth:`get_state_buf_infos`)."""
        ptrs, _, item_lens = super().get_contiguous_buf_infos()
        return ptrs, [arena.nbytes for arena in self.arenas], item_lens

    def get_state_buf_infos(self):
        """PD transfer registration of the index pages: the whole arena of each layer too. Both
        views start at the arena, and a transfer engine that keys registered memory by its
        address keeps one of the two: registered alike, either one covers both."""
        ptrs, _, item_lens = super().get_state_buf_infos()
        return ptrs, [arena.nbytes for arena in self.arenas], item_lens

    @property
    def row_bytes(self) -> int:
        return self.bytes_per_token

    def register_loc_to_host(self, loc_to_host: torch.Tensor) -> None:
        self.loc_to_host = loc_to_host

    def device_row_view(self, layer_id: int) -> torch.Tensor:
        """``(physical_size + page_size, row_bytes) uint8`` view of one layer's KV rows."""
        buf = self.kv_buffer[layer_id - self.start_layer]
        return buf.view(buf.shape[0], -1).view(torch.uint8)


class KVOffloadTokenToKVPoolAllocator(HiSparseTokenToKVPoolAllocator):
    """Logical + physical page allocators over the pool's arena, plus the ``loc_to_host`` table.

    Differences from upstream HiSparse:
    * the two allocators share the arena's units (:class:`~.arena.UnitArena`): each holds only
      pages of units it owns and takes more when it runs short;
    * ``alloc_decode`` also gives each new token a physical row (the decode tail lives on the GPU
      until its page is complete and backed up, or for good in a request the GPU keeps whole);
    * ``free`` also returns the host slots of the freed logical pages (page granular, like the
      device allocators), so finish / abort / retract through the ordinary free path leak nothing.

    ``kv_offload`` is the server's :class:`~.hooks.KVOffloadHooks`, set by
    ``runtime.init_offload``: upstream's hooks reach kv offload through the allocator they
    already hold. :meth:`attach` (also there) connects the admission ledger and the coordinator.
    """

    kv_offload: Optional[KVOffloadHooks] = None

    def __init__(
        self,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: KVOffloadDSATokenToKVPool,
        need_sort: bool,
    ):
        # Read by clear(), which HiSparse's constructor calls.
        self.arena = UnitArena(
            kvcache.sizing.layout,
            [kvcache.device_row_view(kvcache.start_layer + i) for i in range(kvcache.layer_num)],
            device,
        )
        self.loc_to_host: Optional[torch.Tensor] = None
        self.host_pool = None
        super().__init__(
            kvcache.physical_size,
            page_size,
            dtype,
            device,
            kvcache,
            need_sort,
            logical_size=kvcache.logical_size,
        )
        # The arena's page allocators take the place of HiSparse's two (same sizes): each holds
        # pages of the units it owns and takes more from the other side when it runs short.
        paged_cls = current_platform.get_paged_allocator_cls() or PagedTokenToKVPoolAllocator
        args = (page_size, dtype, device, kvcache, need_sort)
        self.logical_attn_allocator = arena_paged_allocator(
            paged_cls, self.arena, LOGICAL, self.logical_size, *args
        )
        self.hisparse_attn_allocator = arena_paged_allocator(
            paged_cls, self.arena, PHYSICAL, self.physical_size, *args
        )
        self.arena.logical = self.logical_attn_allocator
        self.arena.physical = self.hisparse_attn_allocator
        self.arena.add_listener(self)
        self.physical_owed: Callable[[], int] = lambda: 0
        self.loc_to_host = torch.full(
            (self.logical_size + page_size + 1,), -1, dtype=torch.int64, device=device
        )
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        # Host slots of cancelled backups, returned when their copy completes (controller.poll).
        self.host_pending_free = 0
        self.clear()
        self._kvcache.register_loc_to_host(weakref.proxy(self.loc_to_host))

    # ------------------------------------------------------------------ wiring / views
    def attach(self, physical_owed: Callable[[], int], relocation_listener) -> None:
        """Connect the scheduler side: ``physical_owed`` returns the physical rows live requests
        are promised and do not hold yet (the logical budget keeps them free); the
        ``relocation_listener`` (an ``arena.RelocationListener``: the coordinator, whose state
        holds physical rows) is asked before and told after the arena moves physical rows."""
        self.physical_owed = physical_owed
        self.arena.add_listener(relocation_listener)

    def register_host_pool(self, host_pool) -> None:
        """Lets ``free`` return host slots; ``host_pool`` is a ``KVOffloadHostPool``."""
        self.host_pool = host_pool

    @property
    def logical_size(self) -> int:
        return self._size_full

    @property
    def physical_size(self) -> int:
        return self._size_hisparse

    def logical_obtainable(self) -> int:
        """Logical locs obtainable now, keeping the physical rows in use and owed."""
        page = self.page_size
        owed = -(-self.physical_owed() // page)
        used = self.arena.used_pages(PHYSICAL)
        return self.arena.logical_pages_obtainable(used + owed) * page

    def physical_available_size(self) -> int:
        """Physical rows not in use, of the most the arena holds (what leak checks compare; what
        the physical side can take now is :meth:`fits`'s question)."""
        return self.free_counts()["physical"]

    def fits(self, physical_rows: int, logical_tokens: int, owed: bool = True) -> bool:
        """Whether ``physical_rows`` more physical rows (beyond those in use and, with ``owed``,
        those promised) and ``logical_tokens`` more logical locs fit in the arena at once.
        Reclaims free logical units (one device read) before answering no."""
        page = self.page_size
        arena = self.arena
        promised = self.physical_owed() if owed else 0
        phys = arena.used_pages(PHYSICAL) + -(-(promised + physical_rows) // page)
        logical = arena.used_pages(LOGICAL) + -(-logical_tokens // page)
        if arena.fits(phys, logical):
            return True
        return arena.reclaim_logical() > 0 and arena.fits(phys, logical)

    def available_size(self) -> int:
        """Tokens new requests may still take (what the scheduler's admission and retraction and
        its idle leak check read).

        An offloaded token holds a logical loc (its index keys) and, once its page is backed up, a
        host slot; GPU KV rows are gated per request (``runtime.can_stage_prefill``,
        ``runtime.pd_can_admit``) and kept out of this count while promised. So this is the
        logical locs obtainable, capped by the host slots not yet owed to allocated tokens that
        have no backup yet. Host slots of cancelled backups count as free: they return at the next
        completion poll.
        """
        logical_free = self.logical_obtainable()
        if self.host_pool is None:
            return logical_free
        host_free = self.host_pool.available_size() + self.host_pending_free
        used = self.arena.used_pages(LOGICAL) * self.page_size
        unbacked = used - (self.host_pool.size - host_free)
        return max(0, min(logical_free, host_free - max(0, unbacked)))

    def free_counts(self) -> Dict[str, int]:
        """Free pages of every allocator involved, as tokens, whichever side owns the units
        (what leak checks compare)."""
        sizing = self._kvcache.sizing
        page = self.page_size
        out = {
            "logical": sizing.logical_tokens - self.arena.used_pages(LOGICAL) * page,
            "physical": sizing.physical_rows - self.arena.used_pages(PHYSICAL) * page,
        }
        if self.host_pool is not None:
            out["host"] = self.host_pool.available_size()
        return out

    # ------------------------------------------------------------------ arena relocation
    def before_relocation(self) -> None:
        """The mapping is only read by forwards, which the coordinator (a listener too) orders."""

    def relocate_rows(self, remap: Callable[[torch.Tensor], torch.Tensor]) -> None:
        mapping = self.full_to_hisparse_device_index_mapping
        mapping[:-1] = remap(mapping[:-1])

    # ------------------------------------------------------------------ allocation
    def _ensure(self, logical_pages: int, physical_pages: int) -> bool:
        """Grant units so that both sides hold this many free pages at once."""
        return self.arena.ensure(logical_pages, physical_pages)

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """One logical loc per request and a physical tail row mapped to it."""
        need_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        for a in (self.logical_attn_allocator, self.hisparse_attn_allocator):
            if a.need_sort and need_pages > len(a.free_pages):
                a.merge_and_sort_free()
        # Check both first: the paged allocator cannot roll back one side if the other fails.
        if not self._ensure(need_pages, need_pages):
            return None
        logical = self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        # When a token starts a new page the kernel ignores last_loc, so a previous page that has
        # already been backed up and released (mapping 0) is harmless.
        physical_last = self.full_to_hisparse_device_index_mapping[last_loc]
        physical = self.hisparse_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, physical_last)
        assert logical is not None and physical is not None
        self.full_to_hisparse_device_index_mapping[logical] = physical
        return logical

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Logical locs for a prefill or staged transfer, each with a physical row behind it."""
        need = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
        if not self._ensure(need, need):
            return None
        logical = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        physical = self.hisparse_attn_allocator.alloc_extend(
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            self.get_last_loc_hisparse_device(last_loc),
            len(logical),
            num_new_pages=need,
        )
        assert logical is not None and physical is not None
        self.full_to_hisparse_device_index_mapping[logical] = physical
        return logical

    def alloc_prompt(self, num_tokens: int, to_host: bool) -> Optional[torch.Tensor]:
        """PD pre-allocation for ``num_tokens`` prompt positions of a new request, starting at a
        page boundary (position 0, or the end of a cached prefix): whole logical pages, and behind
        each either a physical page with the same in-page offsets (the transfer lands in GPU rows;
        their units are pinned physical until :meth:`unpin_prompt`) or, ``to_host``, a host page
        (:meth:`alloc_extend_to_host`). Returns the logical locs (int64 on the device), or
        ``None`` with nothing taken when a pool is short."""
        if to_host:
            return self.alloc_extend_to_host(num_tokens)
        page = self.page_size
        pages = -(-int(num_tokens) // page)
        if pages == 0:  # the whole prompt is a cached prefix
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        # One page more than the prompt's: its first decode token may open a new page.
        if not self.fits((pages + 1) * page, (pages + 1) * page) or not self._ensure(pages, pages):
            return None
        logical = self.logical_attn_allocator.alloc(pages * page)
        physical = self.hisparse_attn_allocator.alloc(pages * page)
        self.full_to_hisparse_device_index_mapping[logical] = physical
        # The prefill side writes these rows while the scheduler runs: their units must not move.
        self.arena.pin(physical[::page].cpu().numpy() // page)
        return logical[:num_tokens]

    def unpin_prompt(self, logical_locs: torch.Tensor) -> None:
        """The transfer into :meth:`alloc_prompt`'s rows has ended (admitted or failed)."""
        page = self.page_size
        if logical_locs.numel() == 0:
            return
        first = logical_locs.to(self.device, torch.int64)[::page]
        physical = self.full_to_hisparse_device_index_mapping[first]
        self.arena.unpin(physical.cpu().numpy() // page)

    def alloc_extend_to_host(self, num_tokens: int) -> Optional[torch.Tensor]:
        """PD direct-to-host pre-allocation for ``num_tokens`` positions from a page boundary.

        Takes logical locs (``req_to_token`` and the index buffer) and host pages, and records the
        host slot of every loc of each logical page in ``loc_to_host`` (the partial last page
        included, so ``free`` returns whole host pages); no physical row is taken. Returns the
        logical locs (int64 on the device), or ``None`` with nothing taken when the logical space or
        the host pool is short.
        """
        if self.host_pool is None:
            raise RuntimeError(
                "kv_offload direct-to-host pre-allocation needs the host pool "
                "(call register_host_pool first)"
            )
        page = self.page_size
        need = -(-int(num_tokens) // page) * page
        if need == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        if need > self.logical_obtainable() or need > self.host_pool.available_size():
            return None
        if not self._ensure(need // page, 0):
            return None
        host = self.host_pool.alloc(need)
        if host is None:
            return None
        runs = host.view(-1, page)
        if not bool(((runs - runs[:, :1]) == torch.arange(page)).all()) or bool(
            (runs[:, 0] % page != 0).any()
        ):
            self.host_pool.free(host)
            raise RuntimeError(
                "kv_offload host pool returned slots that are not whole aligned pages; a PD "
                "transfer writes whole pages, so every host allocation and free must be in pages "
                f"of {page}"
            )
        logical = self.logical_attn_allocator.alloc(need)
        if logical is None:
            self.host_pool.free(host)
            return None
        self.loc_to_host[logical] = host.to(self.loc_to_host.device)
        return logical[:num_tokens]

    # ------------------------------------------------------------------ retraction (PD decode)
    def get_cpu_copy(
        self, indices: torch.Tensor, mamba_indices=None, req_pool_index=None
    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """What ``Req.offload_kv_cache`` saves when PD decode retracts a request (before its locs
        are freed): per layer, the KV rows ``(n, row_bytes)`` and the index-key rows ``(n, 132)``
        of the logical locs ``indices``, on the CPU.

        A row still behind a physical loc (the GPU tail, or a page whose backup has not completed)
        is read from the GPU, every other row from its host slot. As upstream's DSA pool does, the
        index keys are saved too, so the resumed request's indexer sees its context.
        """
        kv = self._kvcache
        locs = indices.to(self.device, torch.int64)
        physical = self.full_to_hisparse_device_index_mapping[locs]
        host = self.loc_to_host[locs]
        on_gpu = physical > 0
        missing = ~on_gpu & (host < 0)
        if bool(missing.any()):
            raise RuntimeError(
                f"kv_offload: {int(missing.sum())} of {locs.numel()} locs of a retracted request "
                "have neither a GPU row nor a host slot; their KV is lost (was the request "
                "released before Req.offload_kv_cache?)"
            )
        on_gpu_cpu, host_cpu = on_gpu.cpu(), host.cpu()
        gpu_rows = physical[on_gpu]
        pin = str(self.device).startswith("cuda")
        # Every layer's device -> host copies go into pinned buffers (DMA, not bounced), one wait.
        staged = []
        for i in range(kv.layer_num):
            from_gpu = torch.empty(
                (gpu_rows.numel(), kv.row_bytes), dtype=torch.uint8, pin_memory=pin
            )
            from_gpu.copy_(kv.device_row_view(kv.start_layer + i)[gpu_rows], non_blocking=pin)
            index = index_rows(kv.index_k_with_scale_buffer[i], locs, kv)
            index_cpu = torch.empty(index.shape, dtype=index.dtype, pin_memory=pin)
            index_cpu.copy_(index, non_blocking=pin)
            staged.append((from_gpu, index_cpu))
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        out = []
        for i, (from_gpu, index_cpu) in enumerate(staged):
            rows = torch.empty((locs.numel(), kv.row_bytes), dtype=torch.uint8)
            rows[on_gpu_cpu] = from_gpu
            host_view = self.host_pool.host_row_view(kv.start_layer + i)
            rows[~on_gpu_cpu] = host_view[host_cpu[~on_gpu_cpu]]
            out.append((rows, index_cpu))
        return out

    def load_cpu_copy(
        self, kv_cache_cpu, indices: torch.Tensor, mamba_indices=None, req_pool_index=None
    ) -> None:
        """``Req.load_kv_cache`` when a retracted request resumes: write what
        :meth:`get_cpu_copy` saved into the new logical locs ``indices``, KV rows into their
        physical rows (``alloc_extend`` gave every loc one) and index keys into the index buffer."""
        kv = self._kvcache
        locs = indices.to(self.device, torch.int64)
        physical = self.full_to_hisparse_device_index_mapping[locs]
        if len(kv_cache_cpu) != kv.layer_num or bool((physical <= 0).any()):
            raise RuntimeError(
                "kv_offload: a resumed request's KV must be restored into GPU rows of the same "
                f"layers ({kv.layer_num}); got {len(kv_cache_cpu)} layers and "
                f"{int((physical <= 0).sum())} locs without a physical row"
            )
        for i, (rows, saved_index) in enumerate(kv_cache_cpu):
            if rows.shape[0] != locs.numel():
                raise ValueError(f"{rows.shape[0]} saved rows for {locs.numel()} locs")
            kv.device_row_view(kv.start_layer + i)[physical] = rows.to(self.device)
            set_index_rows(kv.index_k_with_scale_buffer[i], locs, saved_index.to(self.device), kv)

    # ------------------------------------------------------------------ host bookkeeping
    def set_host_locs(
        self, logical_locs: torch.Tensor, host_slots: Union[torch.Tensor, int]
    ) -> None:
        """Record the host slot of each of ``logical_locs`` (-1: none; a scalar fills them all,
        without a host->device copy)."""
        if isinstance(host_slots, int):
            self.loc_to_host.index_fill_(0, logical_locs, host_slots)
        else:
            self.loc_to_host[logical_locs] = host_slots.to(self.loc_to_host.device)

    def map_rows(self, logical_locs: torch.Tensor, physical_rows: torch.Tensor) -> None:
        """Point ``logical_locs`` at GPU rows the caller took from the physical allocator (a PD
        decode tail, a cached prefix read back from the host); :meth:`release_physical` or
        :meth:`free` gives them back."""
        mapping = self.full_to_hisparse_device_index_mapping
        mapping[logical_locs] = physical_rows.to(mapping.device, mapping.dtype)

    def release_physical(self, logical_locs: torch.Tensor) -> None:
        """Free the physical rows behind ``logical_locs`` (whole, page-aligned logical pages, as
        backups are) and clear their mapping. No device sync: each logical page's physical page is
        read from its first row's mapping, so no ``unique`` or mask is needed.

        Every page must have rows: a page without (mapping 0) would free the padding page 0. A
        backup's pages keep theirs until it completes: a request's backups are cancelled (or, with
        the radix cache, waited for) before its locs are freed, and :meth:`free` unmaps a freed
        page whole, so a later owner of its locs starts unmapped."""
        first = logical_locs[:: self.page_size]
        pages = self.full_to_hisparse_device_index_mapping[first] // self.page_size
        # index_fill_, not ``[idx] = 0``: a Python scalar value is copied to the device (a sync).
        self.full_to_hisparse_device_index_mapping.index_fill_(0, logical_locs, 0)
        self.hisparse_attn_allocator.free_page_ids(pages)

    def _whole_pages(self, locs: torch.Tensor) -> torch.Tensor:
        pages = torch.unique(locs // self.page_size)
        pages = pages[pages > 0]
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free(self, free_index: torch.Tensor):
        """Free the logical pages touched by ``free_index`` whole, as the paged allocators do,
        with the physical rows and host slots behind every loc of those pages, passed or not.

        Callers pass a request's locs up to its committed length, which may leave out locs of its
        last page that have rows: one the overlap scheduler allocated ahead, the rest of
        :meth:`alloc_prompt`'s last page. Their page is freed all the same, so their rows are too,
        and every free loc maps to no row and no host slot; an allocation that maps none itself
        (:meth:`alloc_extend_to_host`) relies on that. No free groups (upstream HiSparse's
        ``free_group_begin``/``end`` are no-ops): the mappings are cleared at once.
        """
        if free_index.numel() == 0:
            return
        locs = self._whole_pages(free_index.to(self.loc_to_host.device))
        self._free_host(locs)
        super().free(locs)

    def _free_host(self, locs: torch.Tensor) -> None:
        """Return the host slots of ``locs`` (whole logical pages) and clear their entries."""
        host = self.loc_to_host[locs]
        host = host[host >= 0]
        self.loc_to_host.index_fill_(0, locs, -1)
        if host.numel() == 0:
            return
        if self.host_pool is None:
            raise RuntimeError(
                "kv_offload allocator holds host slots but no host pool is registered "
                "(call register_host_pool)"
            )
        self.host_pool.free(host)

    def translate_kv_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """PD decode: where the prefill side writes the prompt KV (physical rows or host pages);
        the DSA index state keeps the logical page ids."""
        return self.kv_offload.pd_kv_destination_locs(kv_indices)

    def clear(self):
        self.arena.reset()
        super().clear()
        if self.loc_to_host is not None:
            # /flush_cache when idle: the radix cache's locs are dropped with their host slots.
            if self.host_pool is not None:
                host = self.loc_to_host[self.loc_to_host >= 0]
                if host.numel():
                    self.host_pool.free(host)
            self.loc_to_host.fill_(-1)


def _index_byte_offsets(locs: torch.Tensor, pool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page, byte offsets in the page) of each loc's index key and scale in the paged layout of
    ``DSATokenToKVPool.index_k_with_scale_buffer``: keys at ``off * D``, scales at
    ``page_size * D + off * 4``."""
    page, off = locs // pool.page_size, (locs % pool.page_size)[:, None]
    dim = pool.index_head_dim
    key = off * dim + torch.arange(dim, device=locs.device)
    scale = pool.page_size * dim + off * 4 + torch.arange(4, device=locs.device)
    return page[:, None], torch.cat([key, scale], dim=1)


def index_rows(buf: torch.Tensor, locs: torch.Tensor, pool) -> torch.Tensor:
    """``(n, D + 4)`` bytes (key, then fp32 scale) of ``locs`` in one layer's index buffer."""
    page, cols = _index_byte_offsets(locs, pool)
    return buf[page, cols]


def set_index_rows(buf: torch.Tensor, locs: torch.Tensor, rows: torch.Tensor, pool) -> None:
    """Write ``(n, D + 4)`` bytes (key, then fp32 scale) of ``locs`` (upstream SetKAndS layout)."""
    page, cols = _index_byte_offsets(locs, pool)
    buf[page, cols] = rows
