"""Host tier controller for kv_offload: per-layer sparse loads and page backups.

* ``load_one_layer``: misses of one layer, host pool -> sparse slots, on the caller's stream, inside
  the decode CUDA graph (no sync, no allocation, no event query).
* ``backup_batch``: complete pages (prompt or decode tail) of all layers of several requests,
  device -> freshly allocated host slots, on ``write_stream``. ``poll`` completes finished backups
  without blocking: it records their host slots in ``loc_to_host`` and frees their physical pages.
* ``cancel``: an aborted request's in-flight backups free their host slots when the copy is done
  (never earlier: the write stream may still be storing into them).

Imported only when ``--enable-kv-offload`` is on.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadDSATokenToKVPool,
    KVOffloadTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import (
    CopyLaunchConfig,
    copy_rows,
    copy_rows_all_layers,
    default_backup_launch_config,
    default_load_launch_config,
)

logger = logging.getLogger(__name__)

_DEBUG = os.environ.get("SGLANG_KV_OFFLOAD_DEBUG", "0").lower() in ("1", "true")


@dataclass(eq=False)
class BackupHandle:
    """One request's pages in one backup launch."""

    id: int
    tag: Hashable
    logical_locs: torch.Tensor  # device int64, whole pages
    host_slots: torch.Tensor  # CPU int64, same length
    host_slots_device: torch.Tensor
    start: int = -1  # token positions in the request, when known
    end: int = -1
    finish_event: Any = None
    cancelled: bool = False
    done: bool = False

    @property
    def num_tokens(self) -> int:
        return self.host_slots.numel()


class KVOffloadCacheController:
    """kv offload's host tier: token-granular loads into sparse slots and page backups.

    Not a ``HiCacheController``: its operation queues allocate device rows per load and its layer
    counters wait per layer on a load stream, while kv offload's loads go into slots planned
    inside the forward, on the forward stream. It keeps HiCache's conventions: backups on a
    dedicated ``write_stream`` ordered after the forward by events, completion agreed across TP
    ranks by a MIN all-reduce over the CPU group. With a node-shared host pool only its writer
    rank copies; the others complete a backup (and free its GPU rows) when that MIN says the
    writer's copy has finished.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator: KVOffloadTokenToKVPoolAllocator,
        mem_pool_host: KVOffloadHostPool,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        load_config: Optional[CopyLaunchConfig] = None,
        backup_config: Optional[CopyLaunchConfig] = None,
        debug: bool = _DEBUG,
    ):
        pool: KVOffloadDSATokenToKVPool = token_to_kv_pool_allocator.get_kvcache()
        self.mem_pool_device = pool
        self.mem_pool_host = mem_pool_host
        self.page_size = mem_pool_host.page_size
        self.tp_group = tp_group
        self.device = pool.device
        # The pool's device decides (a CUDA build of torch on a CPU-only machine reports CUDA as
        # its accelerator even though none is present).
        self.device_module = torch.get_device_module(torch.device(pool.device))
        self.write_stream = self.device_module.Stream()
        if pool.row_bytes != mem_pool_host.row_bytes:
            raise ValueError(
                f"device KV rows are {pool.row_bytes} B but host rows {mem_pool_host.row_bytes} B; "
                "build the host pool from this device pool"
            )
        if mem_pool_host.page_size != pool.page_size:
            raise ValueError(
                f"host page_size {mem_pool_host.page_size} != device page_size {pool.page_size}"
            )
        token_to_kv_pool_allocator.register_host_pool(mem_pool_host)
        self.allocator = token_to_kv_pool_allocator
        dev = torch.device(pool.device)
        self.load_config = load_config or default_load_launch_config(dev)
        self.backup_config = backup_config or default_backup_launch_config(dev)
        self.debug = debug
        self.tp_world_size = (
            torch.distributed.get_world_size(group=tp_group) if tp_group is not None else 1
        )
        self.inflight: List[BackupHandle] = []
        self._ids = itertools.count()
        self._device_views = pool.row_views
        self._host_views = mem_pool_host.row_views
        self._start_layer = pool.start_layer

    # ------------------------------------------------------------------ loads (critical path)
    def load_one_layer(
        self,
        layer_id: int,
        host_indices: torch.Tensor,
        device_slots: torch.Tensor,
        num_valid: Optional[torch.Tensor] = None,
    ) -> None:
        """Copy ``host[host_indices[i]] -> kv_buffer[layer][device_slots[i]]`` on the current stream.

        ``host_indices`` / ``device_slots`` are device int32/int64 of a fixed length; entries with a
        -1 host index are skipped, and only the first ``num_valid[0]`` are read when given.
        Capture-safe.
        """
        l = layer_id - self._start_layer
        copy_rows(
            self._host_views[l],
            self._device_views[l],
            host_indices,
            device_slots,
            num_valid,
            self.load_config,
        )

    # ------------------------------------------------------------------ admission from the host
    def load_rows(self, host_slots: torch.Tensor, device_rows: torch.Tensor) -> None:
        """Copy ``host[host_slots] -> kv_buffer[layer][device_rows]`` for every layer.

        On the current stream, so the forward that follows reads the rows. Used once per
        direct-to-host admission for the prompt rows of a partial last page.
        """
        copy_rows_all_layers(
            self._host_views,
            self._device_views,
            host_slots.to(self.device),
            device_rows.to(self.device),
            config=self.load_config,
        )

    def free_host_when_read(self, host_slots: torch.Tensor) -> None:
        """Return ``host_slots`` (whole pages) once the copies queued so far have read them.

        The free is deferred to ``poll`` (a cancelled handle), never immediate: a slot freed now
        could become a PD transfer destination before the current stream's load has run.
        """
        event = self.device_module.Event()
        event.record()
        host_cpu = host_slots.to("cpu", torch.int64)
        self.inflight.append(
            BackupHandle(
                id=next(self._ids),
                tag=None,
                logical_locs=host_slots.new_empty((0,)),
                host_slots=host_cpu,
                host_slots_device=host_slots,
                finish_event=event,
                cancelled=True,
            )
        )
        self.allocator.host_pending_free += host_cpu.numel()

    # ------------------------------------------------------------------ backups
    def backup_batch(
        self, items: Sequence[Tuple[Hashable, torch.Tensor, int, int]]
    ) -> Optional[List[BackupHandle]]:
        """Several ``(tag, logical_locs, start, end)`` backups in one launch per layer.

        All or nothing: ``None`` when the host pool cannot hold every item.
        """
        page = self.page_size
        items = [it for it in items if it[1].numel() > 0]
        if not items:
            return []
        for tag, locs, _, _ in items:
            if locs.numel() % page != 0:
                raise ValueError(
                    f"kv_offload backup of {locs.numel()} tokens (tag={tag!r}) is not a whole number "
                    f"of pages of {page}; back up complete pages only and keep the tail on the GPU"
                )
            if self.debug:
                self._check_whole_pages(locs, tag)
        total = sum(it[1].numel() for it in items)
        host_all = self.mem_pool_host.alloc(total)
        if host_all is None:
            logger.warning(
                "kv_offload host pool full: %d tokens requested, %d free; backup deferred",
                total,
                self.mem_pool_host.available_size(),
            )
            return None

        locs_all = torch.cat([it[1] for it in items]).to(torch.int64)
        device_rows = self.allocator.full_to_hisparse_device_index_mapping[locs_all]
        if host_all.device.type == "cpu" and torch.device(self.device).type == "cuda":
            host_all = host_all.pin_memory()  # a pageable source would make the copy synchronous
        host_dev = host_all.to(self.device, non_blocking=True)

        start_event = self.device_module.Event()
        finish_event = self.device_module.Event()
        # The forward that wrote these rows runs on the current stream; order the copy after it.
        start_event.record()
        with self.device_module.stream(self.write_stream):
            start_event.wait(self.write_stream)
            if self.mem_pool_host.writes_backups:
                copy_rows_all_layers(
                    self._device_views,
                    self._host_views,
                    device_rows,
                    host_dev,
                    config=self.backup_config,
                )
            finish_event.record()
            if device_rows.is_cuda:
                device_rows.record_stream(self.write_stream)
                host_dev.record_stream(self.write_stream)

        handles = []
        off = 0
        for tag, locs, start, end in items:
            n = locs.numel()
            handles.append(
                BackupHandle(
                    id=next(self._ids),
                    tag=tag,
                    logical_locs=locs_all[off : off + n],
                    host_slots=host_all[off : off + n],
                    host_slots_device=host_dev[off : off + n],
                    start=start,
                    end=end,
                    finish_event=finish_event,
                )
            )
            off += n
        self.inflight.extend(handles)
        return handles

    def _check_whole_pages(self, locs: torch.Tensor, tag: Hashable) -> None:
        pages = locs.view(-1, self.page_size)
        expect = pages[:, :1] + torch.arange(self.page_size, device=locs.device)
        phys = self.allocator.full_to_hisparse_device_index_mapping[locs]
        if not bool(((pages == expect) & (pages[:, :1] % self.page_size == 0)).all()):
            raise ValueError(f"kv_offload backup (tag={tag!r}): logical locs are not whole pages")
        if not bool((phys > 0).all()):
            raise ValueError(
                f"kv_offload backup (tag={tag!r}): some logical locs have no physical KV row"
            )

    def host_pool_info(self) -> Dict[str, object]:
        """Size and sharing of the host pool (``/server_info``)."""
        host = self.mem_pool_host
        return {
            "bytes": host.size * host.size_per_token,
            "tokens": host.size,
            "shared_by_ranks": host.shared_by_ranks,
            "writes_backups": host.writes_backups,
        }

    # ------------------------------------------------------------------ completion
    def poll(self, before_complete: Optional[Callable[[], None]] = None) -> List[BackupHandle]:
        """Complete finished backups without blocking; returns the non-cancelled ones.

        FIFO on one stream, so the finished ones are a prefix. Under TP every rank completes the
        same count (MIN over ranks), keeping the schedulers in lockstep. ``before_complete`` runs
        first when at least one completes (the caller orders its state changes there).
        """
        n = 0
        for h in self.inflight:
            if not h.finish_event.query():
                break
            n += 1
        if self.tp_world_size > 1:
            count = torch.tensor(n, dtype=torch.int)
            torch.distributed.all_reduce(
                count, op=torch.distributed.ReduceOp.MIN, group=self.tp_group
            )
            n = int(count.item())
        if n and before_complete is not None:
            before_complete()
        return self._complete(n)

    def drain(self) -> List[BackupHandle]:
        """Wait for every in-flight backup and complete it (shutdown, tests)."""
        self.wait_copies()
        return self.poll()

    def wait_copies(self) -> None:
        """Wait until every in-flight backup's copy has finished reading its GPU rows, without
        completing it (:meth:`poll` still does)."""
        for h in self.inflight:
            h.finish_event.synchronize()

    def _complete(self, n: int) -> List[BackupHandle]:
        done, self.inflight = self.inflight[:n], self.inflight[n:]
        finished = []
        for h in done:
            h.done = True
            if h.cancelled:
                self.allocator.host_pending_free -= h.num_tokens
                self.mem_pool_host.free(h.host_slots)
                continue
            self.allocator.set_host_locs(h.logical_locs, h.host_slots_device)
            self.allocator.release_physical(h.logical_locs)
            finished.append(h)
        return finished

    def cancel(self, handle: BackupHandle) -> bool:
        """Abort an in-flight backup: its host slots are freed once its copy has finished.

        Returns False when the handle had already completed (its slots then belong to
        ``loc_to_host`` and are freed with the request's logical locs).
        """
        if handle.done or handle.cancelled:
            return False
        handle.cancelled = True
        self.allocator.host_pending_free += handle.num_tokens
        return True

    def cancel_tag(self, tag: Hashable) -> int:
        """Cancel every in-flight backup of ``tag``; returns how many."""
        return sum(self.cancel(h) for h in self.inflight if h.tag == tag)

    def has_inflight(self, tag: Hashable = None) -> bool:
        if tag is None:
            return bool(self.inflight)
        return any(h.tag == tag and not h.cancelled for h in self.inflight)
