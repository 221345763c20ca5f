"""kv offload's side of the upstream hooks: building the pools, and the per-server hook object.

``KVCacheConfigurator`` builds the DSA pool through :func:`device_pool_factory` and the token
allocator through :func:`build_allocator`; ``ModelRunner._init_post_memory_pool_components`` then
calls :func:`init_offload`, which builds everything else (host pool, controller, GPU LRU,
coordinator), installs :class:`KVOffloadRuntime` as the allocator's ``kv_offload`` (what the
scheduler and the PD decode queue call, see :mod:`hooks`) and the attention adapter as the model
runner's sparse-attention coordinator (what ``DeepseekSparseAttnBackend`` calls). Each scheduler
process (one per TP rank) has its own. Under attention DP each attention-DP rank has its own
requests, so its host pool and its backup agreement span its attention-TP group only (upstream's
``get_dp_tp_group``, as HiSparse's coordinator).
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from sglang.srt.configs.model_config import get_dsa_index_topk
from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig, KVOffloadConfigError
from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    LOGICAL_LOC_STATE_BYTES,
    KVOffloadDSATokenToKVPool,
    KVOffloadTokenToKVPoolAllocator,
    index_row_bytes,
    kv_row_bytes,
    size_arena,
)
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
from sglang.srt.mem_cache.sparsity.kv_offload.metrics import KVOffloadMetrics
from sglang.srt.mem_cache.sparsity.kv_offload.shared_host import NodeSharedHostAllocator
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState
from sglang.srt.runtime_context import (
    get_exec,
    get_memory,
    get_observability,
    get_parallel,
    get_serving,
    get_spec,
)
from sglang.srt.utils.common import ceil_align

logger = logging.getLogger(__name__)


def speculative_shape(page_size: int) -> Tuple[int, int]:
    """``(verify tokens per request, decode tail pages per request)`` of this server.

    Without speculative decoding: one token, two tail pages (the page being written and the
    previous one while its backup is in flight). With it, target verify checks
    ``--speculative-num-draft-tokens`` tokens per request, and each decode step allocates locs up
    to upstream's reserve (``get_alloc_reserve_per_decode``) past the committed tokens, so the
    tail may reach that many positions further.
    """
    spec = get_spec()
    if spec.speculative_algorithm is None:
        return 1, 2
    reserve_pages = -(-get_alloc_reserve_per_decode() // page_size)
    return int(spec.speculative_num_draft_tokens), 2 + reserve_pages


def device_pool_factory(
    model_config, max_running_requests: int
) -> Callable[..., KVOffloadDSATokenToKVPool]:
    """``KVCacheConfigurator`` hook: the DSA pool class to build, as a factory.

    Takes the DSA pool's arguments (``size`` is what the profiler granted at the full per-token
    cost, KV + index) and lays that byte budget out as one arena per layer, shared by physical KV
    rows and logical index pages (:mod:`~.arena`).
    """

    def build(size: int, **kwargs) -> KVOffloadDSATokenToKVPool:
        return build_device_pool(model_config, max_running_requests, size, **kwargs)

    return build


def build_device_pool(
    model_config,
    max_running: int,
    size: int,
    *,
    index_kpool: int = 1,
    index_kpool_compress: bool = False,
    skip_topk_layers: Optional[List[bool]] = None,
    dcp_replicated: bool = False,
    **pool_kwargs,
) -> KVOffloadDSATokenToKVPool:
    """The arena DSA device pool for a profiled budget of ``size`` full-cost tokens: the same bytes
    upstream would give ``size`` tokens of KV rows and index keys, as one arena per layer."""
    if index_kpool != 1 or index_kpool_compress or dcp_replicated or any(skip_topk_layers or ()):
        raise KVOffloadConfigError(
            "--enable-kv-offload needs one index key per token in every layer (index_kpool 1, "
            "no compression, no skipped top-k layers) and no decode context parallelism; this "
            "model or launch has another layout. Drop the flag."
        )
    config = KVOffloadConfig.from_json(get_memory().kv_offload_config)
    topk = get_dsa_index_topk(model_config.hf_config)
    config.check(index_topk=topk)
    layers = pool_kwargs["layer_num"]
    dtype = pool_kwargs["dtype"]
    store_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    row = kv_row_bytes(pool_kwargs["kv_cache_dim"], store_dtype)
    index_row = index_row_bytes(pool_kwargs["index_head_dim"])
    page = pool_kwargs["page_size"]
    verify_tokens, tail_pages = speculative_shape(page)
    slots = config.sparse_slots_per_req
    if slots < verify_tokens * topk:
        # A verify step's draft tokens may select disjoint top-k sets, all resident at once.
        raise KVOffloadConfigError(
            f"--kv-offload-config: sparse_slots_per_req={slots} cannot hold "
            f"the union of the top-k ({topk}) of the {verify_tokens} tokens a speculative verify "
            f"step checks per request. Set sparse_slots_per_req to at least "
            f"{ceil_align(verify_tokens * topk, page)} or lower --speculative-num-draft-tokens."
        )
    budget = size * (row + index_row) * layers
    sizing = size_arena(
        budget,
        layers,
        row,
        index_row,
        page,
        logical_loc_bytes=LOGICAL_LOC_STATE_BYTES
        + _draft_bytes_per_token(model_config, row + index_row),
    )
    # One sparse request must fit beside a prompt page: its slots and tail pages.
    most = (sizing.physical_rows - (tail_pages + 1) * page) // page * page
    if slots > most:
        raise KVOffloadConfigError(
            f"--kv-offload-config: sparse_slots_per_req={slots} does not fit this GPU budget, "
            f"whose arena holds {sizing.physical_rows} KV rows per layer: a sparse request holds "
            f"its slots and {tail_pages} tail pages. Use at most {max(most, 0)} (and at least the "
            f"top-k, {ceil_align(topk, page)}), or raise --mem-fraction-static."
        )
    sizing = dataclasses.replace(sizing, tail_pages=tail_pages, verify_tokens=verify_tokens)
    return KVOffloadDSATokenToKVPool(sizing=sizing, offload_config=config, **pool_kwargs)


def _draft_bytes_per_token(model_config, layer_bytes: int) -> int:
    """GPU bytes per logical token of the speculative draft model's KV: the MTP layer keeps a dense
    DSA pool (KV row and index keys) indexed by the target's logical locs, so it grows with them."""
    if get_spec().speculative_algorithm is None:
        return 0
    return layer_bytes * max(1, getattr(model_config.hf_config, "num_nextn_predict_layers", 1) or 1)


def build_allocator(pool: KVOffloadDSATokenToKVPool, need_sort: bool):
    """``KVCacheConfigurator`` hook, where upstream builds the token allocator: the split
    allocator over :func:`build_device_pool`'s pool."""
    return KVOffloadTokenToKVPoolAllocator(pool.page_size, pool.dtype, pool.device, pool, need_sort)


def init_offload(runner) -> None:
    """``ModelRunner._init_post_memory_pool_components`` hook.

    Builds the host pool, the controller, the GPU LRU and the coordinator over the allocator;
    installs :class:`KVOffloadRuntime` as ``allocator.kv_offload`` and the attention adapter as
    ``runner.sparse_kv_coordinator`` (read by the attention backend when it is built, next), and
    sets ``max_total_num_tokens`` to what the allocator reports free when idle.
    """
    allocator: KVOffloadTokenToKVPoolAllocator = runner.token_to_kv_pool_allocator
    pool: KVOffloadDSATokenToKVPool = allocator.get_kvcache()
    config: KVOffloadConfig = pool.offload_config
    sizing = pool.sizing
    parallel = get_parallel()
    # The ranks that run this scheduler's batches (the attention-TP group under attention DP).
    group = get_dp_tp_group()
    tp_group = group if group.world_size > 1 else None
    tensor_allocator = _shared_host_allocator(config, parallel, tp_group)
    ranks_per_pool = tensor_allocator.ranks_per_node if tensor_allocator is not None else 1
    host = KVOffloadHostPool(
        pool,
        host_size_gb=config.host_pool_size_gb,
        host_pool_ratio=0.0 if config.host_pool_size_gb > 0 else config.host_pool_ratio,
        ratio_base_tokens=sizing.logical_tokens,
        pin_memory=config.pin_host_memory and str(pool.device).startswith("cuda"),
        tensor_allocator=tensor_allocator,
        pools_on_node=_ranks_on_node(parallel) // ranks_per_pool,
    )
    controller = KVOffloadCacheController(
        allocator,
        host,
        # Backup completion counts are agreed over the CPU (gloo) group, as upstream HiCache does.
        tp_group=tp_group.cpu_group if tp_group is not None else None,
    )
    # A PD decode server's request pool has pre-allocation rows beyond ``size``; every row that can
    # reach a decode step needs LRU state.
    max_reqs = runner.req_to_token_pool.req_to_token.shape[0]
    sparse = SparseCacheState(
        num_layers=pool.layer_num,
        max_reqs=max_reqs,
        buffer_slots=config.sparse_slots_per_req,
        topk=get_dsa_index_topk(runner.model_config.hf_config),
        allocator=allocator.hisparse_attn_allocator,
        device=runner.device,
    )
    graph_max_bs = get_exec().graph.cuda_graph_config.decode.max_bs or 0
    max_bs = max(graph_max_bs, runner.req_to_token_pool.size)
    coordinator = KVOffloadCoordinator(
        runner.req_to_token_pool.req_to_token,
        allocator,
        controller,
        sparse,
        max_bs=max_bs,
        pd_direct_to_host=config.pd_direct_to_host,
        status_log_interval=config.status_log_interval,
        forward_stream=getattr(runner, "forward_stream", None),
        tail_pages=pool.sizing.tail_pages,
        verify_tokens=pool.sizing.verify_tokens,
        # The radix cache (upstream's default) shares prefix pages between requests' rows.
        share_prefixes=not get_memory().disable_radix_cache,
    )
    metrics = None
    if get_observability().enable_metrics:
        labels = {
            "model_name": get_serving().served_model_name,
            "tp_rank": str(parallel.tp_rank),
        }
        if parallel.dp_rank is not None:
            labels["dp_rank"] = str(parallel.dp_rank)
        metrics = KVOffloadMetrics(labels)
    allocator.attach(coordinator.admission.owed_rows, coordinator)
    allocator.kv_offload = KVOffloadRuntime(coordinator, runner.req_to_token_pool, metrics)
    runner.sparse_kv_coordinator = DSAOffloadAdapter(
        runner.req_to_token_pool.req_to_token,
        allocator,
        sparse,
        controller,
        coordinator.workspace,
        coordinator.verify_workspace,
    )
    # The scheduler's token accounting compares the allocator's available_size() (logical tokens,
    # capped by host slots) with max_total_num_tokens, e.g. in the idle leak check, so the two
    # must agree when nothing is allocated.
    runner.max_total_num_tokens = allocator.available_size()
    layout = sizing.layout
    logger.info(
        "kv offload: GPU arena %.2f GB (%d layers x %d units of %d KV pages or %d index pages): up "
        "to %d logical tokens or %d KV rows (%d B); host pool %d tokens (%.2f GB); requests up to "
        "%d tokens stay on the GPU, longer ones hold %d sparse slots",
        sizing.arena_bytes / 1e9,
        pool.layer_num,
        layout.num_units,
        layout.unit_pages,
        layout.logical_pages_per_unit,
        sizing.logical_tokens,
        sizing.physical_rows,
        pool.row_bytes,
        host.size,
        host.size * host.size_per_token / 1e9,
        config.sparse_slots_per_req,
        config.sparse_slots_per_req,
    )


def _ranks_on_node(parallel) -> int:
    """Scheduler processes on this node: every DP replica's TP ranks."""
    return max(1, parallel.dp_size * parallel.tp_size // max(parallel.nnodes, 1))


def _shared_host_allocator(config: KVOffloadConfig, parallel, tp_group):
    """The node-shared host memory of ``share_host_pool`` for the node's ranks of ``tp_group``, or
    None for a pool of this rank's own."""
    if not config.share_host_pool or tp_group is None:
        return None
    ranks_per_node = min(tp_group.world_size, parallel.tp_size // max(parallel.nnodes, 1))
    if ranks_per_node <= 1:
        return None
    return NodeSharedHostAllocator(tp_group.cpu_group, ranks_per_node)


class KVOffloadRuntime(KVOffloadHooks):
    """The hook object of one server process: what the scheduler and the PD decode queue call.

    Holds no state of its own beyond the PD bookkeeping and the prefill gate's last refusal
    below; everything else is the coordinator's (request state, counters), its admission ledger's
    (promises) and the allocator's (free lists).
    """

    def __init__(
        self,
        coordinator: KVOffloadCoordinator,
        req_to_token_pool,
        metrics: Optional[KVOffloadMetrics] = None,
    ) -> None:
        self.coordinator = coordinator
        self.req_to_token_pool = req_to_token_pool  # its rows in use: the live requests
        self.metrics = metrics  # with --enable-metrics
        self.allocator: KVOffloadTokenToKVPoolAllocator = coordinator.allocator
        self.admission = coordinator.admission  # the promises the prefill and PD gates keep
        # pd_direct_to_host: requests pre-allocated into host pages, to be admitted from the host
        # when their transfer succeeds (admit_transferred), never at a decode step.
        self._host_prealloc: Set[int] = set()
        # PD requests whose transfer lands in GPU rows: (first position, positions) pinned in the
        # arena until the transfer ends.
        self._gpu_prealloc: Dict[int, Tuple[int, int]] = {}
        # The GPU room (_gpu_room) the round in which the prefill gate last refused a prompt
        # leaves, once the prompts it let through hold their rows.
        self._refused_room: Optional[Tuple[int, int]] = None

    # ------------------------------------------------------------------ scheduler
    def prepare_decode_step(self, batch) -> None:
        coordinator = self.coordinator
        req_pool_indices = [req.kv.req_pool_idx for req in batch.reqs]
        if batch.spec_algorithm.is_none():
            seq_lens = batch.seq_lens_cpu.tolist()
            written_lens = [n - 1 for n in seq_lens]
        else:
            # Locs are allocated ahead for the draft tokens; only committed KV is final (under
            # the overlap scheduler the host's count lags a step behind, which only delays
            # backups).
            seq_lens = [req.kv.kv_allocated_len for req in batch.reqs]
            written_lens = [req.kv.kv_committed_len for req in batch.reqs]
        for r, n, w in zip(req_pool_indices, seq_lens, written_lens):
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
            self._unpin(r)
            coordinator.admit(r, n, written_len=w)
        failed = dict(coordinator.before_decode_step(req_pool_indices, seq_lens, written_lens))
        for req in batch.reqs:
            reason = failed.get(req.kv.req_pool_idx)
            if reason is not None and not req.finished():
                # This step's output of the request is discarded and it ends with the error.
                req.to_finish = FINISH_ABORT(reason, HTTPStatus.SERVICE_UNAVAILABLE, "kv_offload")

    def _final_len(self, req) -> int:
        """Positions a request may reach: its prompt and its most new tokens, within the context."""
        context = self.req_to_token_pool.req_to_token.shape[1]
        max_new = req.sampling_params.max_new_tokens
        total = len(req.origin_input_ids) + (context if max_new is None else max_new)
        return min(total, context)

    def prepare_extend(self, batch) -> None:
        # After alloc_for_extend: each row's [0, prefix_len) holds its prefix's logical locs, and
        # [prefix_len, seq_len) this chunk's. Every staged request is promised its rows from now.
        coordinator = self.coordinator
        for req in batch.reqs:
            r = req.kv.req_pool_idx
            if r not in coordinator.requests:
                self.admission.reserve(
                    r,
                    self._final_len(req),
                    staged_len=req.kv.kv_allocated_len,
                    prompt_len=len(req.full_untruncated_fill_ids),
                )
        rows = self.req_to_token_pool.req_to_token
        prefixes = [rows[r.kv.req_pool_idx, : r.prefix_len] for r in batch.reqs if r.prefix_len]
        if prefixes:
            coordinator.restore_for_extend(prefixes)

    def can_stage_prefill(self, req, scheduled: Sequence) -> bool:
        # The token budget (available_size) counts logical locs and host slots; this gate checks the
        # arena for the GPU KV rows too: the rest of each new prompt stages in GPU rows (chunks
        # included) until the request decodes, and each is promised its rows (its whole context
        # if it stays resident, else the more of its staged prompt and its sparse slots and tail
        # pages), beside the requests already promised theirs (staged ones included:
        # prepare_extend promised them).
        admission = self.admission
        page = admission.page_size
        # With the radix cache a prefix may be cached pages on the host, read back into GPU rows
        # for the prefill (prepare_extend): counted as staging (a chunked prompt's own earlier
        # chunks, already in GPU rows, then count twice: conservative).
        shared = self.coordinator.share_prefixes
        # A chunked prompt part way is promised its rows since its first chunk.
        new = [r for r in (req, *scheduled) if r.kv.req_pool_idx not in admission]
        prompts = []
        for r in new:
            rest = len(r.full_untruncated_fill_ids) - r.prefix_len
            staging = rest + (r.prefix_len if shared else 0)
            prompts.append((ceil_align(staging, page), ceil_align(rest, page), self._final_len(r)))
        if new and new[0] is req and not admission.can_ever_stage(*prompts[0]):
            # It would wait for ever: the token budget (logical locs) admits longer prompts than
            # the GPU can stage. Upstream's abort leaves a one-token prompt that prefills next
            # round and ends with this error.
            held = self.allocator.arena.layout.resident_tokens
            req.set_finish_with_abort(
                f"kv offload: this prompt ({len(req.full_untruncated_fill_ids)} tokens, "
                f"{self._final_len(req)} with its new tokens) needs more GPU KV rows at once than "
                f"the whole GPU budget holds ({held} tokens kept on the GPU). Send a shorter "
                "prompt or raise --mem-fraction-static."
            )
            return False
        if admission.can_stage(prompts):
            self._refused_room = None
            return True
        admission.count_prefill_wait()
        # The prompts let through in this round take their rows after this refusal: the room to
        # beat is what they leave (counted before they took them, their own admission, their
        # backups freeing the staged rows down to their promises, would never beat it).
        rows, logical = admission.stage_cost([p for r, p in zip(new, prompts) if r is not req])
        free_rows, free_logical = self._gpu_room()
        self._refused_room = (free_rows - rows, free_logical - logical)
        return False

    def _gpu_room(self) -> Tuple[int, int]:
        """(physical rows free beyond those promised, logical locs free): host-side, no device read."""
        free = self.allocator.free_counts()
        return free["physical"] - self.admission.owed_rows(), free["logical"]

    def release_request(self, req_pool_idx: Optional[int], kv_len: int = 0) -> None:
        # The logical locs are freed next by upstream's path through the kv offload allocator,
        # which also returns their physical rows and host slots.
        if req_pool_idx is None:
            return
        self._host_prealloc.discard(req_pool_idx)
        self._unpin(req_pool_idx)
        self.coordinator.release(req_pool_idx, kv_len=kv_len)

    def on_scheduler_iteration(self) -> bool:
        """Between forwards: release restored prefix rows, complete finished backups, refresh the
        metrics. Returns True when the prefill gate refused a prompt and GPU rows or index pages
        have been freed since (a backup completed, a staged request was admitted, a request
        ended): the scheduler then lets its waiting prompts try again, as it does when a request
        finishes (upstream retries only then, which would hold a staged burst to one wave)."""
        self.coordinator.release_restored()
        self.coordinator.poll()
        if self.metrics is not None and self.metrics.due():
            self.metrics.update(self.coordinator.offload_state())
        if self._refused_room is None:
            return False
        rows, logical = self._gpu_room()
        if rows <= self._refused_room[0] and logical <= self._refused_room[1]:
            return False
        self._refused_room = None
        return True

    def internal_state(self) -> Dict[str, object]:
        return self.coordinator.offload_state()

    # ------------------------------------------------------------------ PD decode queue
    # The prompt KV destination is either the GPU physical pages (the default: backed up to the
    # host after admission) or, with ``pd_direct_to_host``, host pool pages written by the prefill
    # side directly. The DSA index state always goes to the logical pages.
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
        staging = ceil_align(fill_len, page) if self._stages_on_gpu(req) else 0
        prompt = (staging, ceil_align(fill_len, page), self._final_len(req))
        return self.admission.can_stage([prompt])

    def pd_prealloc(self, req, fill_len: int, prefix_len: int) -> Optional[torch.Tensor]:
        # The prefix (``--disaggregation-decode-enable-radix-cache``) is the tree's; the prefill
        # side sends only the rest.
        if prefix_len % self.coordinator.page_size:
            raise ValueError(
                f"kv_offload: a cached prefix of {prefix_len} tokens is not whole pages of "
                f"{self.coordinator.page_size}"
            )
        to_host = not self._stages_on_gpu(req)
        locs = self.allocator.alloc_prompt(fill_len - prefix_len, to_host=to_host)
        if locs is not None:
            r = req.kv.req_pool_idx
            req.kv.kv_allocated_len = fill_len
            # A direct-to-host prompt stages nothing in GPU rows.
            self.admission.reserve(r, self._final_len(req), staged_len=0 if to_host else fill_len)
            if to_host:
                self._host_prealloc.add(r)
            elif locs.numel():
                self._gpu_prealloc[r] = (prefix_len, fill_len - prefix_len)
        return locs

    def _unpin(self, req_pool_idx: int) -> None:
        span = self._gpu_prealloc.pop(req_pool_idx, None)
        if span is not None:
            start, n = span
            locs = self.req_to_token_pool.req_to_token[req_pool_idx, start : start + n]
            self.allocator.unpin_prompt(locs)

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
            r = req.kv.req_pool_idx
            if r in self._host_prealloc:
                self._host_prealloc.discard(r)
                self.coordinator.admit_from_host(r, req.kv.kv_allocated_len, req.prefix_len)
            else:
                self._unpin(r)
