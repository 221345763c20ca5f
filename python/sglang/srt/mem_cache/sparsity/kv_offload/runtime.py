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
from typing import Optional

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig

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


def build_for_model_runner(runner, nsa_pool_kwargs: dict) -> None:
    """Build the split device pool, allocator, host pool, controller, LRU and coordinator.

    Called from ``ModelRunnerKVCacheMixin._init_pools`` in place of the NSA pool. The profiler granted
    ``max_total_num_tokens`` tokens at the full per-token cost (KV + index); that byte budget is
    re-split into physical KV rows (sparse slots, decode tails, prompt staging) and logical tokens
    (index keys only). ``max_total_num_tokens`` becomes what the allocator reports free when idle.
    """
    from sglang.srt.configs.model_config import get_nsa_index_topk
    from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
    from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
        NSA_INDEX_ROW_BYTES,
        KVOffloadNSATokenToKVPool,
        KVOffloadTokenToKVPoolAllocator,
        kv_row_bytes,
        physical_slots_needed,
        split_gpu_budget,
    )
    from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
    from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState
    from sglang.srt.mem_cache.sparsity.kv_offload.transfer import default_group_launch_config

    server_args = runner.server_args
    config = KVOffloadConfig.from_json(server_args.kv_offload_config)
    topk = get_nsa_index_topk(runner.model_config.hf_config)
    config.check(index_topk=topk)
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
    need_sort = server_args.disaggregation_mode in ("decode", "prefill")
    allocator = KVOffloadTokenToKVPoolAllocator(
        sizing.logical_tokens,
        sizing.physical_slots,
        nsa_pool_kwargs["page_size"],
        dtype,
        nsa_pool_kwargs["device"],
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
        base = default_group_launch_config(torch.device(nsa_pool_kwargs["device"]))
        group_load_config = dataclasses.replace(base, num_programs=config.h2d_programs_per_req)
    controller = KVOffloadCacheController(
        allocator,
        host,
        tp_group=getattr(runner, "tp_group", None),
        group_load_config=group_load_config,
    )
    sparse = SparseCacheState(
        num_layers=layers,
        num_logical_locs=allocator.full_to_hisparse_device_index_mapping.numel(),
        max_reqs=max_running,
        buffer_slots=config.sparse_slots_per_req,
        topk=topk,
        allocator=allocator.hisparse_attn_allocator,
        device=nsa_pool_kwargs["device"],
    )
    max_bs = max(server_args.cuda_graph_max_bs or 0, max_running)
    coordinator = KVOffloadCoordinator(
        runner.req_to_token_pool.req_to_token, allocator, controller, sparse, max_bs=max_bs
    )
    runner.token_to_kv_pool = pool
    runner.token_to_kv_pool_allocator = allocator
    # The scheduler's token accounting compares the allocator's available_size() (inherited from
    # HiSparse: min(logical, physical) free) with max_total_num_tokens, e.g. in the idle leak check,
    # so the two must agree when nothing is allocated.
    runner.max_total_num_tokens = min(sizing.logical_tokens, sizing.physical_slots)
    runner.hisparse_coordinator = coordinator
    set_coordinator(coordinator)
    logger.info(
        "kv offload: %d logical tokens (index %.2f GB), %d physical KV rows (%.2f GB, %d B x %d "
        "layers), host pool %d tokens (%.2f GB), %d sparse slots per request",
        sizing.logical_tokens,
        sizing.index_bytes / 1e9,
        sizing.physical_slots,
        sizing.kv_bytes / 1e9,
        row,
        layers,
        host.size,
        host.size * host.get_size_per_token() / 1e9,
        config.sparse_slots_per_req,
    )


def prepare_decode_step(batch) -> None:
    """``ScheduleBatch.prepare_for_decode`` hook, after this step's locs are allocated.

    Requests seen for the first time are admitted here (their prompt KV sits in GPU tail rows, so
    they decode at once); then finished backups complete, new complete pages are backed up and
    sparse slots grow with the context.
    """
    coordinator = get_coordinator()
    if coordinator is None:
        return
    req_pool_indices = [req.req_pool_idx for req in batch.reqs]
    seq_lens = batch.seq_lens_cpu.tolist()
    for r, n in zip(req_pool_indices, seq_lens):
        if r not in coordinator.requests:
            # The token about to be decoded has a loc but no KV yet.
            coordinator.admit(r, n, written_len=n - 1)
    coordinator.before_decode_step(req_pool_indices, seq_lens)


def release_request(req_pool_idx: Optional[int]) -> None:
    """``release_kv_cache`` hook, before the request's KV is freed (finish, abort, retract, failure).

    Frees the sparse slots and LRU entries and cancels in-flight backups; the logical locs are then
    freed by upstream's path through the kv offload allocator, which also returns physical rows and
    host slots.
    """
    coordinator = get_coordinator()
    if coordinator is not None and req_pool_idx is not None:
        coordinator.release(req_pool_idx)


def physical_kv_locs(logical_locs: torch.Tensor) -> torch.Tensor:
    """PD decode hook: where a prompt's KV rows are, for the transfer engine's KV destination.

    The prefill side writes KV pages into the decode side's KV buffer by page id; with the split pool
    those rows are physical (``alloc_extend`` gives each logical page a physical page with the same
    in-page offsets), while the NSA index state keeps its logical page ids.
    """
    coordinator = get_coordinator()
    if coordinator is None:
        raise RuntimeError(
            "kv offload is enabled but its pools were not built in this process; "
            "check that the model is an NSA model and --attention-backend is nsa"
        )
    mapping = coordinator.allocator.full_to_hisparse_device_index_mapping
    physical = mapping[logical_locs.to(mapping.device, torch.int64)]
    return physical.to(logical_locs.dtype)
