"""Pinned host pool holding the full latent KV of every running request (KV only, layer_first).

Imported only when ``--enable-kv-offload`` is on.
"""

from __future__ import annotations

import logging
import weakref
from typing import List, Optional, Tuple

import torch
from sglang.srt.mem_cache.host_memory import available_host_memory_bytes
from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES
from sglang.srt.mem_cache.pool_host.common import (
    HostTensorAllocator,
    alloc_with_host_register,
)
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import RowView

logger = logging.getLogger(__name__)

GB = 1e9


class HostPoolSizeError(ValueError):
    """The requested host pool does not fit, or is too small to be useful."""


def host_kv_bytes_per_token(row_bytes: int, num_layers: int) -> int:
    """Host bytes per token: one KV row per layer (656 B fp8 layout or 1152 B bf16)."""
    return row_bytes * num_layers


def host_pool_tokens(
    size_per_token: int,
    page_size: int,
    host_size_gb: float = 0.0,
    host_pool_ratio: float = 0.0,
    ratio_base_tokens: int = 0,
) -> int:
    """Number of host token slots (a multiple of ``page_size``) for the configured size.

    ``host_size_gb`` (decimal GB, as upstream ``--hicache-size``) wins over ``host_pool_ratio``,
    which multiplies ``ratio_base_tokens`` (the logical token capacity of the device pool).
    """
    if host_size_gb and host_size_gb > 0:
        tokens = int(host_size_gb * GB // size_per_token)
    elif host_pool_ratio and host_pool_ratio > 0:
        tokens = int(ratio_base_tokens * host_pool_ratio)
    else:
        raise HostPoolSizeError(
            "kv_offload host pool size is not set: set host_pool_size_gb or host_pool_ratio "
            "in --kv-offload-config"
        )
    return tokens // page_size * page_size


class KVOffloadHostPool:
    """Host pool of kv offload: pinned memory, a page free list and the per-layer row views.

    * KV rows only (the indexer keys stay on the GPU): ``kv_cache_dim * itemsize`` bytes per token
      and layer, i.e. 656 B for the fp8 layout and 1152 B for bf16.
    * ``layer_first`` ``(layers, size, 1, kv_cache_dim)``, so one layer of the pool is a contiguous
      ``(size, row_bytes)`` array the UVA kernels index directly.
    * Allocation in whole pages of ``page_size`` (64) slots.
    * Allocated with upstream HiCache's ``alloc_with_host_register``: pinned with
      ``cudaHostRegister`` on GPU, plain memory on CPU.
    * Its memory comes from ``tensor_allocator`` when given (else upstream's default
      ``HostTensorAllocator``): a
      :class:`~.shared_host.NodeSharedHostAllocator` makes one pool per node that the node's TP
      ranks (the attention-TP group's under attention DP) share, only its first rank writing
      backups (``writes_backups``).
    * The node's free memory, less ``host_reserve_bytes`` (upstream HiCache's reserve by
      default), must hold ``pools_on_node`` such pools (one per attention-DP rank or DP
      replica), which are built at the same time.

    Not an ``MLATokenToKVPoolHost``: that one sizes from device-pool buffer descriptors and a
    host/device ratio, takes its memory from an allocator named by a string, budgets host RAM per
    rank (a node-shared pool is one copy for all ranks) with an out-of-memory message naming the
    HiCache flags, and sets up transfer tables and write-back staging buffers kv offload does not
    use; kv offload hands its pool to no upstream code. The free list follows upstream
    ``HostKVCache``'s (freed slots are merged back lazily), and ``get_contiguous_buf_infos``
    ``MLATokenToKVPoolHost``'s for ``layer_first``.
    """

    def __init__(
        self,
        device_pool,
        host_size_gb: float = 0.0,
        host_pool_ratio: float = 0.0,
        page_size: int = 64,
        ratio_base_tokens: Optional[int] = None,
        pin_memory: Optional[bool] = None,
        host_reserve_bytes: Optional[int] = None,
        tensor_allocator: Optional[HostTensorAllocator] = None,
        pools_on_node: int = 1,
    ):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        on_gpu = str(device_pool.device).startswith("cuda")
        self.pin_memory = on_gpu if pin_memory is None else pin_memory
        if self.pin_memory and not on_gpu:
            raise ValueError("pin_memory=True needs a CUDA device pool")
        allocator = tensor_allocator or HostTensorAllocator()
        # Only the node's first rank writes a shared pool; its other ranks map what it allocated.
        self.writes_backups = getattr(allocator, "is_writer", True)
        self.shared_by_ranks = getattr(allocator, "ranks_per_node", 1)
        layer_num = device_pool.layer_num
        self.start_layer = device_pool.start_layer
        self.row_bytes = device_pool.kv_cache_dim * device_pool.store_dtype.itemsize
        self.size_per_token = host_kv_bytes_per_token(self.row_bytes, layer_num)

        if ratio_base_tokens is None:
            ratio_base_tokens = logical_capacity(device_pool)
        self.size = host_pool_tokens(
            self.size_per_token, page_size, host_size_gb, host_pool_ratio, ratio_base_tokens
        )
        if self.size < page_size:
            raise HostPoolSizeError(
                f"kv_offload host pool holds {self.size} tokens (host_pool_size_gb={host_size_gb}, "
                f"host_pool_ratio={host_pool_ratio}, {self.size_per_token} B/token); it needs at "
                f"least one page of {page_size} tokens. Increase host_pool_size_gb or "
                "host_pool_ratio in --kv-offload-config"
            )
        if self.writes_backups:
            if host_reserve_bytes is None:
                host_reserve_bytes = HICACHE_HOST_MEMORY_RESERVE_BYTES
            self._check_host_memory(
                host_size_gb, host_pool_ratio, host_reserve_bytes, pools_on_node
            )

        self.kv_buffer = alloc_with_host_register(
            (layer_num, self.size, 1, device_pool.kv_cache_dim),
            dtype=device_pool.store_dtype,
            device="cpu",
            pin_memory=self.pin_memory,
            allocator=allocator,
        )
        if self.pin_memory:
            # Upstream registers the buffer with cudaHostRegister and never unregisters it: its
            # pools live as long as the process. A pool that is dropped earlier (tests, benchmarks,
            # a rebuilt engine) must give its pages back, or they stay pinned and, once the freed
            # range is reused by a new allocation, the stale registration redirects later copies
            # into the old pages.
            # The finalizer holds the buffer, so the memory is freed only after the unpin.
            self._unpin = weakref.finalize(
                self, _unpin_host_buffer, self.kv_buffer, torch.device(device_pool.device)
            )
            self._unpin.atexit = False  # the process exit releases everything anyway
        self.row_views: List[RowView] = [RowView(layer) for layer in self.kv_buffer]
        self.clear()
        logger.info(
            "kv_offload host pool: %d tokens x %d layers x %d B = %.2f GB (%s%s)",
            self.size,
            layer_num,
            self.row_bytes,
            self.size * self.size_per_token / GB,
            "pinned" if self.pin_memory else "pageable",
            f", one copy for {self.shared_by_ranks} ranks" if self.shared_by_ranks > 1 else "",
        )

    def _check_host_memory(
        self, host_size_gb, host_pool_ratio, reserve: int, pools_on_node: int
    ) -> None:
        """The node's ``pools_on_node`` pools of this size (built at the same time, so each sees
        the others' memory still free) must fit in its free memory together (upstream's count:
        the host's available memory bounded by the container's cgroup limit)."""
        requested = self.size * self.size_per_token
        available = available_host_memory_bytes(allow_cgroup_fallback=True) - reserve
        share = max(0, available) // pools_on_node
        if requested > share:
            per_token = self.size_per_token
            node = (
                f"; {pools_on_node} pools on this node (one per attention-DP rank or DP replica) "
                f"share it, {share / GB:.2f} GB each"
                if pools_on_node > 1
                else ""
            )
            raise HostPoolSizeError(
                f"kv_offload host pool does not fit in host memory: requested "
                f"{requested / GB:.2f} GB ({self.size} tokens x {per_token} B/token; "
                f"host_pool_size_gb={host_size_gb}, host_pool_ratio={host_pool_ratio}) but only "
                f"{max(0, available) / GB:.2f} GB is free after keeping {reserve / GB:.2f} GB for "
                f"the rest of the process{node}. Set host_pool_size_gb <= {share / GB:.1f} "
                f"(about {share // per_token} tokens) or lower host_pool_ratio in "
                "--kv-offload-config"
            )

    # ------------------------------------------------------------------ views
    def host_row_view(self, layer_id: int) -> torch.Tensor:
        """``(size, row_bytes) uint8`` view of one layer (what the kernels index)."""
        return self.kv_buffer[layer_id - self.start_layer].view(self.size, -1).view(torch.uint8)

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """``(data_ptrs, data_lens, item_lens)`` of the layers, one item a page of one layer, as
        the device pool's (what ``pd_direct_to_host`` registers with the transfer engine)."""
        layers = list(self.kv_buffer)
        return (
            [layer.data_ptr() for layer in layers],
            [layer.nbytes for layer in layers],
            [self.row_bytes * self.page_size] * len(layers),
        )

    # ------------------------------------------------------------------ allocation
    def clear(self) -> None:
        """Every slot free."""
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        # Freed slots wait here and join free_slots only when an alloc needs them (no
        # concatenation on every free).
        self.release_slots: List[torch.Tensor] = []
        self.num_release_slots = 0
        self.slot_used = torch.zeros(self.size, dtype=torch.bool)

    def available_size(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots (CPU int64), in whole pages; ``None`` when the pool is full."""
        if need_size % self.page_size != 0:
            raise ValueError(
                f"kv_offload host pool allocates whole pages: {need_size} tokens is not a "
                f"multiple of page_size {self.page_size}; back up only complete pages"
            )
        if need_size > self.available_size():
            return None
        if need_size > len(self.free_slots):
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
            self.release_slots, self.num_release_slots = [], 0
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        self.slot_used[select] = True
        return select

    def free(self, indices: torch.Tensor) -> int:
        """Returns ``indices`` (slots from ``alloc``) to the pool; their number."""
        indices = indices.cpu()
        not_allocated = int((~self.slot_used[indices]).sum())
        if not_allocated or self.available_size() + len(indices) > self.size:
            raise RuntimeError(
                f"kv_offload host pool double free: freeing {len(indices)} slots "
                f"({not_allocated} of them not allocated) with {self.available_size()} of "
                f"{self.size} already free"
            )
        self.slot_used[indices] = False
        self.release_slots.append(indices)
        self.num_release_slots += len(indices)
        return len(indices)


# Pinned buffers of dropped pools whose unpin had to wait: a pool collected while a CUDA graph is
# being captured (the GC can run at any allocation) must not synchronize the device.
_UNPIN_LATER: List[Tuple[torch.Tensor, torch.device]] = []


def _unpin_host_buffer(buffer: torch.Tensor, device: torch.device) -> None:
    """Finalizer of a pinned host pool: ``cudaHostUnregister`` its buffer, then let it be freed."""
    _UNPIN_LATER.append((buffer, device))
    if torch.cuda.is_current_stream_capturing():
        return  # the next pool finalized outside a capture unpins this one too
    while _UNPIN_LATER:
        buf, dev = _UNPIN_LATER.pop()
        try:
            torch.cuda.synchronize(dev)  # no queued copy may still read or write the pages
            rc = torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        except Exception as e:  # noqa: BLE001 - a finalizer must not raise
            logger.warning("kv_offload host pool: could not unpin %#x: %s", buf.data_ptr(), e)
            continue
        if int(rc) != 0:
            logger.warning(
                "kv_offload host pool: cudaHostUnregister(%#x) returned %s", buf.data_ptr(), rc
            )


def logical_capacity(device_pool) -> int:
    """Token capacity of the logical (req_to_token / index) space of a device pool: for the kv
    offload arena, its logical tokens when every unit is logical."""
    sizing = getattr(device_pool, "sizing", None)
    if sizing is not None:
        return sizing.logical_tokens
    n = getattr(device_pool, "logical_size", None)
    return int(n) if n is not None else int(device_pool.size)
