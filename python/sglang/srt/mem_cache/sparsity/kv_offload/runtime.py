"""What the upstream hooks call: pool construction, the per-step call and request release.

The model side needs no hook of its own: the coordinator is installed as the model runner's
``hisparse_coordinator``, so HiSparse's existing plumbing (``forward_batch.hisparse_coordinator``,
``num_real_reqs`` on eager forwards, CUDA-graph capture and replay, ``swap_in_selected_pages`` in
``NativeSparseAttnBackend.forward_decode``, logical->physical translation in ``forward_extend``) drives
kv offload unchanged. The scheduler side has two hooks, in ``ScheduleBatch.prepare_for_decode`` and in
``release_kv_cache`` (the one function that finish, abort, retract and failed PD transfers all go
through).

One coordinator per process (SGLang runs one scheduler and one model runner per TP rank process).
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig, KVOffloadConfigError

logger = logging.getLogger(__name__)

# Per logical token and layer besides the 132 B of index keys: the LRU's ``loc_to_slot`` (int32).
LOGICAL_STATE_BYTES_PER_LAYER = 4

_coordinator = None


def get_coordinator():
    """The process's coordinator, or None when kv offload is off or not built yet."""
    return _coordinator


def set_coordinator(coordinator) -> None:
    global _coordinator
    _coordinator = coordinator


def build_device_pool(runner, nsa_pool_kwargs: dict):
    """``ModelRunnerKVCacheMixin._init_pools`` hook: the split NSA device pool.

    Called in place of the NSA pool. The profiler granted ``max_total_num_tokens`` tokens at the
    full per-token cost (KV + index); that byte budget is re-split into physical KV rows (sparse
    slots, decode tails, prompt staging) and logical tokens (index keys only). The allocator, host
    pool, controller and coordinator are built by :func:`build_allocator`, where upstream builds
    the allocator.
    """
    from sglang.srt.configs.model_config import get_nsa_index_topk
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
        NSA_INDEX_ROW_BYTES,
        KVOffloadNSATokenToKVPool,
        kv_row_bytes,
        physical_slots_needed,
        split_gpu_budget,
    )

    server_args = runner.server_args
    config = KVOffloadConfig.from_json(server_args.kv_offload_config)
    config.check(index_topk=get_nsa_index_topk(runner.model_config.hf_config))
    layers = nsa_pool_kwargs["layer_num"]
    dtype = nsa_pool_kwargs["dtype"]
    store_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    row = kv_row_bytes(nsa_pool_kwargs["kv_cache_dim"], store_dtype)
    budget = runner.max_total_num_tokens * (row + NSA_INDEX_ROW_BYTES) * layers
    max_running = runner.req_to_token_pool.size
    staging = max(runner.model_config.context_len, server_args.chunked_prefill_size or 0)
    physical = config.sparse_pool_slots or physical_slots_needed(
        max_running, config.sparse_slots_per_req, staging
    )
    if config.pd_direct_to_host:
        # admit_from_host must always find every running request's slots and tail pages.
        floor = physical_slots_needed(max_running, config.sparse_slots_per_req, 0)
        if physical < floor:
            raise KVOffloadConfigError(
                f"--kv-offload-config: sparse_pool_slots={physical} is too small for "
                f"pd_direct_to_host: {max_running} requests x (sparse_slots_per_req="
                f"{config.sparse_slots_per_req} + 2 tail pages) need {floor}. Set it to 0 (auto) "
                f"or at least {floor}."
            )
    # Otherwise any prompt the server accepts must be able to stage in GPU rows beside one
    # request's promise (sparse slots + 2 tail pages), or it would wait for ever.
    elif physical < physical_slots_needed(1, config.sparse_slots_per_req, staging):
        floor = physical_slots_needed(1, config.sparse_slots_per_req, staging)
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
        index_row_bytes=NSA_INDEX_ROW_BYTES + LOGICAL_STATE_BYTES_PER_LAYER,
    )
    kwargs = dict(nsa_pool_kwargs)
    del kwargs["size"]
    pool = KVOffloadNSATokenToKVPool(
        physical_size=sizing.physical_slots, logical_size=sizing.logical_tokens, **kwargs
    )
    pool.offload_config = config
    pool.offload_sizing = sizing
    return pool


def build_allocator(runner, need_sort: bool):
    """``ModelRunnerKVCacheMixin._init_pools`` hook, where upstream builds the token allocator.

    Builds the split allocator over :func:`build_device_pool`'s pool, the host pool, the controller,
    the GPU LRU and the coordinator (installed as ``runner.hisparse_coordinator``), and sets
    ``max_total_num_tokens`` to what the allocator reports free when idle.
    """
    from sglang.srt.configs.model_config import get_nsa_index_topk
    from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
    from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
        KVOffloadTokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
    from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState
    from sglang.srt.mem_cache.sparsity.kv_offload.transfer import default_group_launch_config

    server_args = runner.server_args
    pool = runner.token_to_kv_pool
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
    host = KVOffloadHostPool(
        pool,
        host_size_gb=config.host_pool_size_gb,
        host_pool_ratio=0.0 if config.host_pool_size_gb > 0 else config.host_pool_ratio,
        ratio_base_tokens=sizing.logical_tokens,
        pin_memory=config.pin_host_memory and str(pool.device).startswith("cuda"),
    )
    group_load_config = None
    if config.h2d_programs_per_req:
        base = default_group_launch_config(torch.device(runner.device))
        group_load_config = dataclasses.replace(base, num_programs=config.h2d_programs_per_req)
    tp_group = getattr(runner, "tp_group", None)
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
    )
    # The scheduler's token accounting compares the allocator's available_size() (logical tokens,
    # capped by host slots) with max_total_num_tokens, e.g. in the idle leak check, so the two
    # must agree when nothing is allocated.
    runner.max_total_num_tokens = allocator.available_size()
    runner.hisparse_coordinator = coordinator
    set_coordinator(coordinator)
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


def prepare_decode_step(batch) -> None:
    """``ScheduleBatch.prepare_for_decode`` hook, after this step's locs are allocated.

    Requests seen for the first time are admitted here (their prompt KV sits in GPU tail rows, so
    they decode at once); then finished backups complete, new complete pages are backed up and
    sparse slots grow with the context.
    """
    coordinator = get_coordinator()
    if coordinator is None:
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req_pool_indices = [req.req_pool_idx for req in batch.reqs]
    seq_lens = batch.seq_lens_cpu.tolist()
    mapping = coordinator.allocator.full_to_hisparse_device_index_mapping
    for r, n in zip(req_pool_indices, seq_lens):
        if r not in coordinator.requests:
            # A resumed (retracted) request is restored into GPU rows in both PD modes.
            if coordinator.pd_direct_to_host and int(mapping[coordinator.req_to_token[r, 0]]) <= 0:
                raise RuntimeError(
                    f"kv offload: req_pool_idx {r} reached a decode step without admission; with "
                    "pd_direct_to_host every request is admitted when its transfer completes "
                    "(runtime.admit_transferred in the PD decode queue)"
                )
            # The token about to be decoded has a loc but no KV yet.
            coordinator.admit(r, n, written_len=n - 1)
    failed = dict(coordinator.before_decode_step(req_pool_indices, seq_lens))
    for req in batch.reqs:
        reason = failed.get(req.req_pool_idx)
        if reason is not None and not req.finished():
            # This step's output of the request is discarded and it ends with the error.
            req.to_finish = FINISH_ABORT(reason, HTTPStatus.SERVICE_UNAVAILABLE, "kv_offload")


def can_stage_prefill(req, scheduled: Sequence) -> bool:
    """``PrefillAdder.add_one_req`` hook (co-located servers), before ``req`` joins a prefill batch.

    The scheduler's token budget (``available_size``) counts logical tokens and host slots; this
    gate checks the GPU KV rows: the rest of ``req``'s prompt stages in GPU rows until its pages
    are backed up, and once decoding it may hold its sparse slots and two tail pages. Both must
    fit beside the rows promised to running requests and to the requests already scheduled in
    this batch (``scheduled``). False makes the request wait, as a short token budget does.
    """
    coordinator = _require_coordinator()
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


def internal_state() -> Dict[str, object]:
    """``Scheduler.get_internal_state`` hook: the ``kv_offload`` entry of ``/get_server_info``."""
    return _require_coordinator().offload_state()


def release_request(req_pool_idx: Optional[int]) -> None:
    """``release_kv_cache`` hook, before the request's KV is freed (finish, abort, retract, failure).

    Frees the sparse slots and LRU entries and cancels in-flight backups; the logical locs are then
    freed by upstream's path through the kv offload allocator, which also returns physical rows and
    host slots.
    """
    coordinator = get_coordinator()
    if coordinator is not None and req_pool_idx is not None:
        coordinator.release(req_pool_idx)


def _require_coordinator():
    coordinator = get_coordinator()
    if coordinator is None:
        raise RuntimeError(
            "kv offload is enabled but its pools were not built in this process; "
            "check that the model is an NSA model and --attention-backend is nsa"
        )
    return coordinator


# -------------------------------------------------------------------------------------------------
# PD decode (disaggregation/decode.py). The prompt KV destination is either the GPU physical pages
# (the default: backed up to the host after admission) or, with ``pd_direct_to_host``, host pool
# pages written by the prefill side directly. The NSA index state always goes to the logical pages.
# -------------------------------------------------------------------------------------------------


def pd_kv_buf_infos(device_pool) -> Tuple[List[int], List[int], List[int]]:
    """``DecodePreallocQueue._init_kv_manager`` hook: the KV buffers registered for transfers.

    The host pool's per-layer buffers with ``pd_direct_to_host`` (one item a page, as on the
    GPU, so the prefill side's page arithmetic is unchanged), else the device pool's.
    """
    coordinator = _require_coordinator()
    if coordinator.pd_direct_to_host:
        return coordinator.allocator.host_pool.get_contiguous_buf_infos()
    return device_pool.get_contiguous_buf_infos()


def _stages_on_gpu(coordinator, req) -> bool:
    """Whether ``req``'s KV arrives in GPU rows: always, except a fresh direct-to-host transfer.

    A retracted request being resumed (it has output tokens) is restored by ``load_kv_cache`` into
    GPU rows and admitted like a staged prompt, in both modes.
    """
    return not coordinator.pd_direct_to_host or len(req.output_ids) > 0


def pd_can_admit(req) -> bool:
    """``pop_preallocated`` / ``resume_retracted_reqs`` hook, before ``_pre_alloc``.

    True when the physical pool can take the request's prompt staging (none for a direct-to-host
    transfer) and promise it its sparse slots and tail pages, without rows promised to requests
    already pre-allocated or running. False makes the queue wait (FIFO), as a short token budget
    does.
    """
    coordinator = _require_coordinator()
    fill_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
    page = coordinator.page_size
    staging = -(-fill_len // page) * page if _stages_on_gpu(coordinator, req) else 0
    return coordinator.can_reserve(staging)


def pd_prealloc(req, fill_len: int) -> Optional[torch.Tensor]:
    """``DecodePreallocQueue._pre_alloc`` hook: logical locs for ``req``'s ``fill_len`` tokens.

    Default (and every resumed request): upstream's ``alloc_extend`` (a physical row behind every
    logical loc). A fresh transfer with ``pd_direct_to_host``: logical locs and host pages only
    (``alloc_extend_to_host``). The request is promised its physical rows (``reserve``) until it
    is released. Returns ``None`` when the pools are short, as ``alloc_extend`` does.
    """
    coordinator = _require_coordinator()
    allocator = coordinator.allocator
    if not _stages_on_gpu(coordinator, req):
        locs = allocator.alloc_extend_to_host(fill_len)
    else:
        locs = _alloc_extend(allocator, fill_len)
    if locs is not None:
        coordinator.reserve(req.req_pool_idx)
    return locs


def _alloc_extend(allocator, fill_len: int) -> Optional[torch.Tensor]:
    device = allocator.device
    return allocator.alloc_extend(
        prefix_lens=torch.tensor([0], dtype=torch.int64, device=device),
        prefix_lens_cpu=torch.tensor([0], dtype=torch.int64),
        seq_lens=torch.tensor([fill_len], dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor([fill_len], dtype=torch.int64),
        last_loc=torch.tensor([-1], dtype=torch.int64, device=device),
        extend_num_tokens=fill_len,
    )


def pd_kv_destination_locs(logical_locs: torch.Tensor) -> torch.Tensor:
    """``pop_preallocated`` hook: where the prompt's KV rows go, for the transfer engine.

    The prefill side writes KV pages by page id. Default: the physical rows (``alloc_extend``
    gives each logical page a physical page with the same in-page offsets). With
    ``pd_direct_to_host``: the host slots (whole aligned host pages). The caller keeps the logical
    page ids for the NSA index state.
    """
    coordinator = _require_coordinator()
    if coordinator.pd_direct_to_host:
        table = coordinator.allocator.loc_to_host
    else:
        table = coordinator.allocator.full_to_hisparse_device_index_mapping
    return table[logical_locs.to(table.device, torch.int64)].to(logical_locs.dtype)


def physical_kv_locs(logical_locs: torch.Tensor) -> torch.Tensor:
    """The physical rows behind ``logical_locs`` (the default PD destination)."""
    mapping = _require_coordinator().allocator.full_to_hisparse_device_index_mapping
    return mapping[logical_locs.to(mapping.device, torch.int64)].to(logical_locs.dtype)


def admit_transferred(reqs) -> None:
    """``process_decode_queue`` hook, for requests whose prompt transfer has just succeeded.

    With ``pd_direct_to_host`` each is admitted from the host here, before its first decode step
    allocates a token in its last page (which must then already be a GPU page). Default mode:
    nothing (requests are admitted at their first decode step, from GPU rows).
    """
    coordinator = get_coordinator()
    if coordinator is None or not coordinator.pd_direct_to_host:
        return
    for req in reqs:
        coordinator.admit_from_host(req.req_pool_idx, req.kv_allocated_len)
