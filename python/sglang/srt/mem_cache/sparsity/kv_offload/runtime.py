"""kv offload's side of the upstream hooks: building the pools, and the per-server hook object.

``ModelRunnerKVCacheMixin._init_pools`` calls :func:`build_device_pool` in place of the NSA pool and
:func:`build_allocator` where upstream builds the token allocator. The second builds everything
else (host pool, controller, GPU LRU, coordinator), installs :class:`KVOffloadRuntime` as the
allocator's ``kv_offload`` (what the scheduler and the PD decode queue call, see :mod:`hooks`) and
the attention adapter as the model runner's sparse-attention coordinator (what
``NativeSparseAttnBackend`` calls). Each scheduler process (one per TP rank) has its own.
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from sglang.srt.configs.model_config import get_nsa_index_topk
from sglang.srt.layers.attention.nsa_offload.adapter import NSAOffloadAdapter
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig, KVOffloadConfigError
from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    LOGICAL_STATE_BYTES_PER_LAYER,
    KVOffloadNSATokenToKVPool,
    KVOffloadTokenToKVPoolAllocator,
    index_row_bytes,
    kv_row_bytes,
    physical_slots_needed,
    split_gpu_budget,
)
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
from sglang.srt.mem_cache.sparsity.kv_offload.metrics import KVOffloadMetrics
from sglang.srt.mem_cache.sparsity.kv_offload.shared_host import NodeSharedHostAllocator
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import default_group_launch_config

logger = logging.getLogger(__name__)


def build_device_pool(runner, nsa_pool_kwargs: dict) -> KVOffloadNSATokenToKVPool:
    """``ModelRunnerKVCacheMixin._init_pools`` hook: the split NSA device pool.

    Called in place of the NSA pool. The profiler granted ``max_total_num_tokens`` tokens at the
    full per-token cost (KV + index); that byte budget is re-split into physical KV rows (sparse
    slots, decode tails, prompt staging) and logical tokens (index keys only).
    """
    server_args = runner.server_args
    config = KVOffloadConfig.from_json(server_args.kv_offload_config)
    config.check(index_topk=get_nsa_index_topk(runner.model_config.hf_config))
    layers = nsa_pool_kwargs["layer_num"]
    dtype = nsa_pool_kwargs["dtype"]
    store_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    row = kv_row_bytes(nsa_pool_kwargs["kv_cache_dim"], store_dtype)
    index_row = index_row_bytes(nsa_pool_kwargs["index_head_dim"])
    page = nsa_pool_kwargs["page_size"]
    budget = runner.max_total_num_tokens * (row + index_row) * layers
    max_running = runner.req_to_token_pool.size
    staging = max(runner.model_config.context_len, server_args.chunked_prefill_size or 0)
    physical = config.sparse_pool_slots or physical_slots_needed(
        max_running, config.sparse_slots_per_req, staging, page
    )
    if config.pd_direct_to_host:
        # admit_from_host must always find every running request's slots and tail pages.
        floor = physical_slots_needed(max_running, config.sparse_slots_per_req, 0, page)
        if physical < floor:
            raise KVOffloadConfigError(
                f"--kv-offload-config: sparse_pool_slots={physical} is too small for "
                f"pd_direct_to_host: {max_running} requests x (sparse_slots_per_req="
                f"{config.sparse_slots_per_req} + 2 tail pages) need {floor}. Set it to 0 (auto) "
                f"or at least {floor}."
            )
    # Otherwise any prompt the server accepts must be able to stage in GPU rows beside one
    # request's promise (sparse slots + 2 tail pages), or it would wait for ever.
    elif physical < physical_slots_needed(1, config.sparse_slots_per_req, staging, page):
        floor = physical_slots_needed(1, config.sparse_slots_per_req, staging, page)
        raise KVOffloadConfigError(
            f"--kv-offload-config: sparse_pool_slots={physical} cannot stage a prompt of the "
            f"context length ({staging} tokens) beside one request's sparse slots "
            f"(sparse_slots_per_req={config.sparse_slots_per_req} + 2 tail pages): it needs at "
            f"least {floor}. Set it to 0 (auto), at least {floor}, or lower --context-length."
        )
    sizing = split_gpu_budget(
        budget,
        layers,
        row,
        physical,
        page,
        index_row_bytes=index_row + LOGICAL_STATE_BYTES_PER_LAYER,
    )
    kwargs = dict(nsa_pool_kwargs)
    del kwargs["size"]
    pool = KVOffloadNSATokenToKVPool(
        physical_size=sizing.physical_slots, logical_size=sizing.logical_tokens, **kwargs
    )
    pool.offload_config = config
    pool.offload_sizing = sizing
    return pool


def build_allocator(runner, need_sort: bool) -> KVOffloadTokenToKVPoolAllocator:
    """``ModelRunnerKVCacheMixin._init_pools`` hook, where upstream builds the token allocator.

    Builds the split allocator over :func:`build_device_pool`'s pool, the host pool, the controller,
    the GPU LRU and the coordinator; installs :class:`KVOffloadRuntime` as ``allocator.kv_offload``
    and the attention adapter as ``runner.hisparse_coordinator``, and sets ``max_total_num_tokens``
    to what the allocator reports free when idle.
    """
    server_args = runner.server_args
    pool: KVOffloadNSATokenToKVPool = runner.token_to_kv_pool
    config: KVOffloadConfig = pool.offload_config
    sizing = pool.offload_sizing
    allocator = KVOffloadTokenToKVPoolAllocator(
        sizing.logical_tokens,
        sizing.physical_slots,
        runner.page_size,
        runner.kv_cache_dtype,
        runner.device,
        pool,
        need_sort,
    )
    tp_group = getattr(runner, "tp_group", None)
    host = KVOffloadHostPool(
        pool,
        host_size_gb=config.host_pool_size_gb,
        host_pool_ratio=0.0 if config.host_pool_size_gb > 0 else config.host_pool_ratio,
        ratio_base_tokens=sizing.logical_tokens,
        pin_memory=config.pin_host_memory and str(pool.device).startswith("cuda"),
        tensor_allocator=_shared_host_allocator(config, server_args, tp_group),
    )
    group_load_config = None
    if config.h2d_programs_per_req:
        base = default_group_launch_config(torch.device(runner.device))
        group_load_config = dataclasses.replace(base, num_programs=config.h2d_programs_per_req)
    controller = KVOffloadCacheController(
        allocator,
        host,
        # Backup completion counts are agreed over the CPU (gloo) group, as upstream HiCache does.
        tp_group=tp_group.cpu_group if tp_group is not None else None,
        group_load_config=group_load_config,
    )
    # A PD decode server's request pool has pre-allocation rows beyond ``size``; every row that can
    # reach a decode step needs LRU state.
    max_reqs = runner.req_to_token_pool.req_to_token.shape[0]
    sparse = SparseCacheState(
        num_layers=pool.layer_num,
        num_logical_locs=allocator.full_to_hisparse_device_index_mapping.numel(),
        max_reqs=max_reqs,
        buffer_slots=config.sparse_slots_per_req,
        topk=get_nsa_index_topk(runner.model_config.hf_config),
        allocator=allocator.hisparse_attn_allocator,
        device=runner.device,
    )
    max_bs = max(server_args.cuda_graph_max_bs or 0, runner.req_to_token_pool.size)
    coordinator = KVOffloadCoordinator(
        runner.req_to_token_pool.req_to_token,
        allocator,
        controller,
        sparse,
        max_bs=max_bs,
        grouped_loads=config.h2d_programs_per_req > 0,
        pd_direct_to_host=config.pd_direct_to_host,
        status_log_interval=config.status_log_interval,
        forward_stream=getattr(runner, "forward_stream", None),
        prefetch_next_layer=config.prefetch_next_layer,
    )
    metrics = None
    if server_args.enable_metrics:
        labels = {"model_name": server_args.served_model_name, "tp_rank": str(runner.tp_rank)}
        metrics = KVOffloadMetrics(labels)
    allocator.kv_offload = KVOffloadRuntime(coordinator, metrics)
    runner.hisparse_coordinator = NSAOffloadAdapter(coordinator)
    # The scheduler's token accounting compares the allocator's available_size() (logical tokens,
    # capped by host slots) with max_total_num_tokens, e.g. in the idle leak check, so the two
    # must agree when nothing is allocated.
    runner.max_total_num_tokens = allocator.available_size()
    logger.info(
        "kv offload: %d logical tokens (index %.2f GB), %d physical KV rows (%.2f GB, %d B x %d "
        "layers), host pool %d tokens (%.2f GB), %d sparse slots per request",
        sizing.logical_tokens,
        sizing.index_bytes / 1e9,
        sizing.physical_slots,
        sizing.kv_bytes / 1e9,
        pool.row_bytes,
        pool.layer_num,
        host.size,
        host.size * host.get_size_per_token() / 1e9,
        config.sparse_slots_per_req,
    )
    return allocator


def _shared_host_allocator(config: KVOffloadConfig, server_args, tp_group):
    """The node-shared host memory of ``share_host_pool``, or None for a pool of this rank's own."""
    ranks_per_node = server_args.tp_size // max(server_args.nnodes, 1)
    if not config.share_host_pool or tp_group is None or ranks_per_node <= 1:
        return None
    return NodeSharedHostAllocator(tp_group.cpu_group, ranks_per_node)


class KVOffloadRuntime(KVOffloadHooks):
    """The hook object of one server process: what the scheduler and the PD decode queue call.

    Holds no state of its own beyond the PD bookkeeping below; everything else is the
    coordinator's (request state, promises, counters) and the allocator's (free lists).
    """

    def __init__(
        self, coordinator: KVOffloadCoordinator, metrics: Optional[KVOffloadMetrics] = None
    ) -> None:
        self.coordinator = coordinator
        self.metrics = metrics  # with --enable-metrics
        self.allocator: KVOffloadTokenToKVPoolAllocator = coordinator.allocator
        # pd_direct_to_host: requests pre-allocated into host pages, to be admitted from the host
        # when their transfer succeeds (admit_transferred), never at a decode step.
        self._host_prealloc: Set[int] = set()

    # ------------------------------------------------------------------ scheduler
    def prepare_decode_step(self, batch) -> None:
        coordinator = self.coordinator
        req_pool_indices = [req.req_pool_idx for req in batch.reqs]
        seq_lens = batch.seq_lens_cpu.tolist()
        for r, n in zip(req_pool_indices, seq_lens):
            if r in coordinator.requests:
                continue
            if r in self._host_prealloc:
                raise RuntimeError(
                    f"kv offload: req_pool_idx {r} reached a decode step without admission; with "
                    "pd_direct_to_host every request is admitted when its transfer completes "
                    "(KVOffloadHooks.admit_transferred in the PD decode queue)"
                )
            # Its prompt (or a resumed request's restored context) is in GPU rows; the token
            # about to be decoded has a loc but no KV yet.
            coordinator.admit(r, n, written_len=n - 1)
        failed = dict(coordinator.before_decode_step(req_pool_indices, seq_lens))
        for req in batch.reqs:
            reason = failed.get(req.req_pool_idx)
            if reason is not None and not req.finished():
                # This step's output of the request is discarded and it ends with the error.
                req.to_finish = FINISH_ABORT(reason, HTTPStatus.SERVICE_UNAVAILABLE, "kv_offload")

    def can_stage_prefill(self, req, scheduled: Sequence) -> bool:
        # The token budget (available_size) counts logical tokens and host slots; this gate checks
        # the GPU KV rows: the rest of the prompt stages in GPU rows until its pages are backed
        # up, and once decoding the request may hold its sparse slots and two tail pages.
        coordinator = self.coordinator
        page = coordinator.page_size

        def rows(r) -> int:
            staging = -(-(len(r.fill_ids) - len(r.prefix_indices)) // page) * page
            promised = r.req_pool_idx is not None and r.req_pool_idx in coordinator.reservations
            return staging + (0 if promised else coordinator.rows_promised)

        need = rows(req) + sum(rows(r) for r in scheduled)
        if coordinator.unreserved_physical_rows() >= need:
            return True
        coordinator.stats["prefill_waits"] += 1
        return False

    def release_request(self, req_pool_idx: Optional[int]) -> None:
        # The logical locs are freed next by upstream's path through the kv offload allocator,
        # which also returns their physical rows and host slots.
        if req_pool_idx is None:
            return
        self._host_prealloc.discard(req_pool_idx)
        self.coordinator.release(req_pool_idx)

    def on_scheduler_iteration(self) -> None:
        if self.metrics is not None and self.metrics.due():
            self.metrics.update(self.coordinator.offload_state())  # polls too
        else:
            self.coordinator.poll()

    def internal_state(self) -> Dict[str, object]:
        return self.coordinator.offload_state()

    # ------------------------------------------------------------------ PD decode queue
    # The prompt KV destination is either the GPU physical pages (the default: backed up to the
    # host after admission) or, with ``pd_direct_to_host``, host pool pages written by the prefill
    # side directly. The NSA index state always goes to the logical pages.
    def pd_kv_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        # Host pool layers are laid out one item a page, as on the GPU, so the prefill side's page
        # arithmetic is unchanged.
        if self.coordinator.pd_direct_to_host:
            return self.allocator.host_pool.get_contiguous_buf_infos()
        return self.allocator.get_kvcache().get_contiguous_buf_infos()

    def _stages_on_gpu(self, req) -> bool:
        # Always, except a fresh direct-to-host transfer: a resumed retracted request (it has
        # output tokens) is restored by load_kv_cache into GPU rows in both modes.
        return not self.coordinator.pd_direct_to_host or len(req.output_ids) > 0

    def pd_can_admit(self, req) -> bool:
        fill_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        page = self.coordinator.page_size
        staging = -(-fill_len // page) * page if self._stages_on_gpu(req) else 0
        return self.coordinator.can_reserve(staging)

    def pd_prealloc(self, req, fill_len: int) -> Optional[torch.Tensor]:
        to_host = not self._stages_on_gpu(req)
        locs = self.allocator.alloc_prompt(fill_len, to_host=to_host)
        if locs is not None:
            self.coordinator.reserve(req.req_pool_idx)
            if to_host:
                self._host_prealloc.add(req.req_pool_idx)
        return locs

    def pd_kv_destination_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        # The prefill side writes KV pages by page id: physical pages (alloc_prompt gives each
        # logical page one with the same in-page offsets) or whole aligned host pages.
        if self.coordinator.pd_direct_to_host:
            table = self.allocator.loc_to_host
        else:
            table = self.allocator.full_to_hisparse_device_index_mapping
        return table[logical_locs.to(table.device, torch.int64)].to(logical_locs.dtype)

    def admit_transferred(self, reqs: Sequence) -> None:
        # Direct-to-host requests are admitted from the host before their first decode step
        # allocates a token in their last page; the others at that step, from GPU rows.
        for req in reqs:
            if req.req_pool_idx in self._host_prealloc:
                self._host_prealloc.discard(req.req_pool_idx)
                self.coordinator.admit_from_host(req.req_pool_idx, req.kv_allocated_len)
