"""GPU side of kv_offload: logical/physical split DSA pool, its allocator and GPU sizing.

* Logical locations (``req_to_token`` entries) address the indexer key buffer
  (``index_k_with_scale_buffer``, :func:`index_row_bytes` per token and layer: 132 B for
  DeepSeek-V3.2's 128-dim keys) for the whole context of every request.
* Physical KV rows (656 B fp8 layout / 1152 B bf16 per token and layer) exist only for the sparse
  cache slots and for tokens not yet backed up to the host (prompt pages in flight, decode tail).
* ``full_to_hisparse_device_index_mapping[logical] -> physical row`` (0 = none) is upstream's
  HiSparse table, reused as is; ``loc_to_host[logical] -> host slot`` (-1 = not backed up) is ours.

The plan kernel resolves a top-k logical loc as: ``loc_to_host >= 0`` -> sparse cache (hit) or host
(miss); otherwise the physical tail row from the mapping.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.sparsity.kv_offload.config import PAGE_SIZE, KVOffloadConfig
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import RowView
from sglang.srt.platforms import current_platform
from sglang.srt.utils.common import ceil_align, get_num_new_pages

logger = logging.getLogger(__name__)

# Per logical token and layer besides its index keys: the GPU LRU's ``loc_to_slot`` entry (int32).
LOGICAL_STATE_BYTES_PER_LAYER = 4


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


def index_bytes_per_logical_token(num_layers: int, index_row_bytes: int) -> int:
    return index_row_bytes * num_layers


def kv_bytes_per_physical_slot(row_bytes: int, num_layers: int) -> int:
    return row_bytes * num_layers


@dataclass(frozen=True)
class OffloadPoolSizing:
    """The GPU split, and the per-request decode shape it was sized for (tail pages promised
    per request, tokens a verify step plans per request; see ``runtime.speculative_shape``)."""

    logical_tokens: int
    physical_slots: int
    index_bytes: int
    kv_bytes: int
    tail_pages: int = 2
    verify_tokens: int = 1

    @property
    def total_bytes(self) -> int:
        return self.index_bytes + self.kv_bytes


def physical_slots_needed(
    max_running_requests: int,
    sparse_slots_per_request: int,
    staging_tokens: int,
    page_size: int = PAGE_SIZE,
    tail_pages: int = 2,
) -> int:
    """Physical rows for a decode batch.

    Per request: its sparse slots and ``tail_pages`` pages of decode tail (the page being written and
    the previous one while its backup is in flight; speculative decoding adds the pages its draft
    tokens are allocated ahead into). Plus ``staging_tokens`` for prompt KV that has arrived but is
    not yet backed up.
    """
    per_req = ceil_align(sparse_slots_per_request, page_size) + tail_pages * page_size
    total = max_running_requests * per_req + ceil_align(staging_tokens, page_size)
    return total


def split_gpu_budget(
    budget_bytes: int,
    num_layers: int,
    row_bytes: int,
    physical_slots: int,
    page_size: int = PAGE_SIZE,
    *,
    index_row_bytes: int,
    draft_bytes_per_token: int = 0,
) -> OffloadPoolSizing:
    """Split a GPU byte budget into (logical tokens, physical slots).

    Physical rows cost ``row_bytes * num_layers`` each; every remaining byte goes to logical tokens
    at ``index_row_bytes * num_layers`` each (what is really allocated per token once the KV is on
    the host: index keys plus LRU state), plus ``draft_bytes_per_token`` (a speculative draft
    model's dense KV, which upstream sizes by the same logical locs). Both counts are page
    aligned. Upstream ``get_cell_size_per_token`` charges ``(row + index row) * layers`` per token,
    which overstates an offloaded token's cost by ~6x.
    """
    physical_slots = ceil_align(physical_slots, page_size)
    kv_bytes = physical_slots * kv_bytes_per_physical_slot(row_bytes, num_layers)
    per_logical = index_bytes_per_logical_token(num_layers, index_row_bytes) + draft_bytes_per_token
    left = budget_bytes - kv_bytes
    logical = max(0, left) // per_logical // page_size * page_size
    if logical < page_size:
        raise ValueError(
            f"kv_offload GPU budget of {budget_bytes / 1e9:.3f} GB is too small: {physical_slots} "
            f"physical KV slots take {kv_bytes / 1e9:.3f} GB ({row_bytes} B x {num_layers} layers "
            f"each), leaving no room for a page of index keys ({per_logical} B/token). Lower the "
            "sparse slots per request or max_running_requests, or raise --mem-fraction-static"
        )
    return OffloadPoolSizing(
        logical_tokens=logical,
        physical_slots=physical_slots,
        index_bytes=logical * per_logical,
        kv_bytes=kv_bytes,
    )


# --------------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------------


class KVOffloadDSATokenToKVPool(HiSparseDSATokenToKVPool):
    """DSA pool with ``physical_size`` KV rows and ``logical_size`` index-key tokens.

    Upstream ``HiSparseDSATokenToKVPool`` ties the two with an integer ratio; here they are sized
    independently (see :func:`split_gpu_budget`), so its ``__init__`` is skipped for
    ``DSATokenToKVPool``'s (upstream could take an explicit index-buffer size there instead of the
    ratio, and this class would call it). KV reads and writes by logical loc are translated through
    the HiSparse mapping (inherited).

    ``offload_config`` and ``sizing`` are what the server built the pool from (the parsed
    ``--kv-offload-config`` and the budget split); ``runtime`` hands them on from here to the
    allocator and the offload set-up. Pools built directly (tests, benchmarks) may leave them out.
    """

    def __init__(
        self,
        physical_size: int,
        logical_size: int,
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
        sizing: Optional[OffloadPoolSizing] = None,
    ):
        for name, n in (("physical_size", physical_size), ("logical_size", logical_size)):
            if n <= 0 or n % page_size != 0:
                raise ValueError(
                    f"kv_offload {name}={n} must be a positive multiple of page_size {page_size}"
                )
        # Skip HiSparseDSATokenToKVPool.__init__: it derives index_buf_size from an integer ratio.
        DSATokenToKVPool.__init__(
            self,
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
            index_buf_size=logical_size,
            tail_extra_slots=tail_extra_slots,
            max_running_requests=max_running_requests,
        )
        self.bytes_per_token = self.kv_cache_dim * self.store_dtype.itemsize
        self.data_strides = torch.full_like(self.data_ptrs, self.bytes_per_token)
        self.physical_size = physical_size
        self.logical_size = logical_size
        self.loc_to_host: Optional[torch.Tensor] = None
        self.offload_config = offload_config
        self.sizing = sizing
        self.row_views: List[RowView] = [RowView(buf) for buf in self.kv_buffer]

    @property
    def row_bytes(self) -> int:
        return self.bytes_per_token

    def register_loc_to_host(self, loc_to_host: torch.Tensor) -> None:
        self.loc_to_host = loc_to_host

    def device_row_view(self, layer_id: int) -> torch.Tensor:
        """``(physical_size + page_size, row_bytes) uint8`` view of one layer's KV rows."""
        buf = self.kv_buffer[layer_id - self.start_layer]
        return buf.view(buf.shape[0], -1).view(torch.uint8)

    def allocated_bytes(self) -> Dict[str, int]:
        """Bytes really allocated on the device, by kind."""
        kv = sum(b.nbytes for b in self.kv_buffer)
        index = sum(b.nbytes for b in self.index_k_with_scale_buffer)
        return {"kv": kv, "index": index, "total": kv + index}

    def get_cell_size_per_token(self) -> Dict[str, int]:
        """Per-unit costs: index bytes per logical token, KV bytes per physical slot."""
        index_row = self.index_k_with_scale_buffer[0].shape[1] // self.page_size
        return {
            "logical": index_row * self.layer_num,
            "physical": self.bytes_per_token * self.layer_num,
        }


class KVOffloadTokenToKVPoolAllocator(HiSparseTokenToKVPoolAllocator):
    """Logical + physical page allocators of the split pool, plus the ``loc_to_host`` table.

    Differences from upstream HiSparse:
    * independent logical / physical sizes;
    * ``alloc_decode`` also gives each new token a physical row (the decode tail lives on the GPU
      until its page is complete and backed up);
    * ``free`` also returns the host slots of the freed logical pages (page granular, like the
      device allocators), so finish / abort / retract through the ordinary free path leak nothing.

    ``kv_offload`` is the server's :class:`~.hooks.KVOffloadHooks`, set by
    ``runtime.init_offload``: upstream's hooks reach kv offload through the allocator they
    already hold.
    """

    kv_offload: Optional[KVOffloadHooks] = None

    def __init__(
        self,
        logical_size: int,
        physical_size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: KVOffloadDSATokenToKVPool,
        need_sort: bool,
    ):
        # Skip HiSparseTokenToKVPoolAllocator.__init__: it sizes the logical space as an integer
        # multiple of the physical one (size * host_to_device_ratio). Taking the logical size
        # itself there (a keyword defaulting to that product) would let this call it.
        self._kvcache = kvcache
        self._size_full = logical_size
        self._size_hisparse = physical_size
        self.compress_ratio = 1
        self.dtype = dtype
        self.device = device
        self.page_size = page_size
        self.need_sort = need_sort
        # No speculative decoding under kv offload: request_slot_reserve charges nothing.
        self._spec_scratch_capacity = 0
        self._spec_device_buffer_size = 0
        paged_cls = current_platform.get_paged_allocator_cls() or PagedTokenToKVPoolAllocator
        self.logical_attn_allocator = paged_cls(
            logical_size, page_size, dtype, device, kvcache, need_sort
        )
        self.hisparse_attn_allocator = paged_cls(
            physical_size, page_size, dtype, device, kvcache, need_sort
        )
        # Trailing -1 mirrors upstream: index -1 (padding) resolves to "no row".
        self.full_to_hisparse_device_index_mapping = torch.cat(
            [
                torch.zeros(logical_size + page_size, dtype=torch.int64, device=device),
                torch.tensor([-1], dtype=torch.int64, device=device),
            ]
        )
        self.loc_to_host = torch.full(
            (logical_size + page_size + 1,), -1, dtype=torch.int64, device=device
        )
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        self.host_pool = None
        # Host slots of cancelled backups, returned when their copy completes (controller.poll).
        self.host_pending_free = 0
        self.free_pages = None
        self.release_pages = None
        self.free_group = None
        self.clear()
        self._kvcache.register_mapping(weakref.proxy(self.full_to_hisparse_device_index_mapping))
        self._kvcache.register_loc_to_host(weakref.proxy(self.loc_to_host))

    # ------------------------------------------------------------------ wiring / views
    def register_host_pool(self, host_pool) -> None:
        """Lets ``free`` return host slots; ``host_pool`` is a ``KVOffloadHostPool``."""
        self.host_pool = host_pool

    @property
    def logical_size(self) -> int:
        return self._size_full

    @property
    def physical_size(self) -> int:
        return self._size_hisparse

    def logical_available_size(self) -> int:
        return self.logical_attn_allocator.available_size()

    def physical_available_size(self) -> int:
        return self.hisparse_attn_allocator.available_size()

    def available_size(self) -> int:
        """Tokens new requests may still take (what the scheduler's admission and retraction and
        its idle leak check read).

        An offloaded token holds a logical loc (its index keys) and, once its page is backed up, a
        host slot; it holds a GPU KV row only while it is in a decode tail, a sparse slot or a
        prompt being staged, which are gated per request (``runtime.can_stage_prefill``,
        ``runtime.pd_can_admit``). So this is the logical free count, capped by the host slots not
        yet owed to allocated tokens that have no backup yet. Host slots of cancelled backups
        count as free: they return at the next completion poll.
        """
        logical_free = self.logical_available_size()
        if self.host_pool is None:
            return min(logical_free, self.physical_available_size())
        host_free = self.host_pool.available_size() + self.host_pending_free
        unbacked = (self.logical_size - logical_free) - (self.host_pool.size - host_free)
        return max(0, min(logical_free, host_free - max(0, unbacked)))

    def free_counts(self) -> Dict[str, int]:
        """Free slots of every allocator involved (what leak checks compare)."""
        out = {
            "logical": self.logical_available_size(),
            "physical": self.physical_available_size(),
        }
        if self.host_pool is not None:
            out["host"] = self.host_pool.available_size()
        return out

    # ------------------------------------------------------------------ allocation
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
        if need_pages > len(self.logical_attn_allocator.free_pages) or need_pages > len(
            self.hisparse_attn_allocator.free_pages
        ):
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
        """Logical locs for a prefill or staged transfer, each with a physical row behind it.

        Upstream HiSparse's allocation; the capacity check is on the two pools it takes from
        (``available_size`` is the scheduler's budget, which also counts host slots).
        """
        need = extend_num_tokens + len(seq_lens) * self.page_size
        if need > min(self.logical_available_size(), self.physical_available_size()):
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
        )
        assert logical is not None and physical is not None
        self.full_to_hisparse_device_index_mapping[logical] = physical
        return logical

    def alloc_prompt(self, num_tokens: int, to_host: bool) -> Optional[torch.Tensor]:
        """PD pre-allocation for ``num_tokens`` prompt positions of a new request, starting at a
        page boundary (position 0, or the end of a cached prefix): whole logical pages, and behind
        each either a physical page with the same in-page offsets (the transfer lands in GPU rows)
        or, ``to_host``, a host page (:meth:`alloc_extend_to_host`). Returns the logical locs
        (int64 on the device), or ``None`` with nothing taken when a pool is short."""
        if to_host:
            return self.alloc_extend_to_host(num_tokens)
        page = self.page_size
        # One page more than the prompt's: its first decode token may open a new page.
        need = ceil_align(int(num_tokens), page)
        if need == 0:  # the whole prompt is a cached prefix
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        if need + page > min(self.logical_available_size(), self.physical_available_size()):
            return None
        logical = self.logical_attn_allocator.alloc(need)
        physical = self.hisparse_attn_allocator.alloc(need)
        self.full_to_hisparse_device_index_mapping[logical] = physical
        return logical[:num_tokens]

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
        need = ceil_align(int(num_tokens), page)
        if need == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        if need > self.logical_available_size() or need > self.host_pool.available_size():
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
    def set_host_locs(self, logical_locs: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.loc_to_host[logical_locs] = host_slots.to(self.loc_to_host.device)

    def release_physical(self, logical_locs: torch.Tensor) -> None:
        """Free the physical rows behind ``logical_locs`` (whole, page-aligned logical pages, as
        backups are) and clear their mapping. No device sync: each logical page's physical page is
        read from its first row's mapping, so no ``unique`` or mask is needed."""
        first = logical_locs[:: self.page_size]
        pages = self.full_to_hisparse_device_index_mapping[first] // self.page_size
        # index_fill_, not ``[idx] = 0``: a Python scalar value is copied to the device (a sync).
        self.full_to_hisparse_device_index_mapping.index_fill_(0, logical_locs, 0)
        self.hisparse_attn_allocator.free_page_ids(pages)

    def _whole_pages(self, locs: torch.Tensor) -> torch.Tensor:
        pages = torch.unique(locs // self.page_size)
        pages = pages[pages > 0]
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free_host(self, logical_locs: torch.Tensor) -> int:
        """Return the host slots of the logical pages touched by ``logical_locs``."""
        if logical_locs.numel() == 0:
            return 0
        locs = self._whole_pages(logical_locs.to(self.loc_to_host.device))
        host = self.loc_to_host[locs]
        host = host[host >= 0]
        self.loc_to_host.index_fill_(0, locs, -1)
        if host.numel() == 0:
            return 0
        if self.host_pool is None:
            raise RuntimeError(
                "kv_offload allocator holds host slots but no host pool is registered "
                "(call register_host_pool)"
            )
        self.host_pool.free(host)
        return host.numel()

    def free(self, free_index: torch.Tensor):
        # No free groups (upstream HiSparse's free_group_begin/end are no-ops): the mappings are
        # cleared at once.
        if free_index.numel() == 0:
            return
        self.free_host(free_index)
        super().free(free_index)

    def translate_kv_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """PD decode: where the prefill side writes the prompt KV (physical rows or host pages);
        the DSA index state keeps the logical page ids."""
        return self.kv_offload.pd_kv_destination_locs(kv_indices)

    def clear(self):
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
