"""The attention side of kv offload: one DSA decode layer's top-k -> sparse-buffer rows.

``DeepseekSparseAttnBackend.forward_decode`` asks the model runner's sparse-attention coordinator
(read when the backend is built) for the KV rows of each layer's selected tokens
(``swap_in_selected_pages``, HiSparse's contract) and switches the decode indexer to unfused top-k
(token positions) when one is installed; the model runner calls ``wait_for_pending_backup`` and
sets ``num_real_reqs`` before every decode forward, as CUDA-graph capture and replay do. kv offload
installs this adapter there (``runtime.init_offload``), so the backend needs no kv offload hook of
its own.

Per layer, on the forward stream, two launches and no host sync (CUDA-graph safe: fixed shapes,
device-side counts, no allocation):

1. the plan (``plan_layer`` in positions mode): each top-k position to its logical loc through
   ``req_to_token``, then hits in the request's sparse slots, rows still in the GPU tail, and for
   each miss an LRU victim slot and the host slot to load;
2. the host -> device load of the misses into those slots (``controller.load_one_layer``), ordered
   before this layer's attention by stream order.

With ``prefetch_next_layer`` each layer's top-k is also planned and loaded for the next layer, on a
side stream, while this layer's attention and MLP and the next layer's indexer run: adjacent layers
select mostly the same tokens, so the next layer's own plan then finds most of them resident and
loads only what the guess missed. The prefetch is an ordinary plan of the next layer's LRU (an
extra step with the guess), so a wrong guess costs bandwidth and LRU order, never correctness.
This layer's plan kernel writes the guess (``plan_layer(guess_out=)``), so it needs no launch of
its own. The next layer's plan waits for the prefetch's plan; its own load of what the guess missed
then runs beside the prefetch's load, and its attention waits for both (events, captured into the
CUDA graph as forks and joins). That is safe when a request's slots are at least twice the top-k:
the next layer's victims are then always slots the prefetch did not load into (see
``_victims_avoid_prefetch``); with fewer slots the next layer's plan waits for the whole prefetch.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import (
    PlanResult,
    PlanWorkspace,
    plan_layer,
)


class DSAOffloadAdapter:
    """What the DSA backend, the model runner and the CUDA-graph runner call on the forward side.

    Args:
        coordinator: the server's :class:`KVOffloadCoordinator` (request state, LRU, plan
            workspace and controller); the adapter only reads and plans, on the forward stream.
        prefetch_stream_priority: CUDA priority of the cross-layer prefetch's side stream; by
            default the device's highest, so that its programs take SMs as the layer's compute
            kernels release them instead of queueing behind them.
        prefetch_max_bs: batches of more requests (the padded CUDA-graph batch size) skip the
            prefetch; 0: none does. A batch's decision is fixed by its shape, so each captured
            graph either always or never prefetches.
    """

    def __init__(
        self,
        coordinator: KVOffloadCoordinator,
        prefetch_stream_priority: Optional[int] = None,
        prefetch_max_bs: int = 0,
    ) -> None:
        self.coordinator = coordinator
        self.prefetch_max_bs = prefetch_max_bs
        device = coordinator.device
        # Rows >= num_real_reqs[0] of a CUDA-graph batch are padding; upstream fills it before
        # every eager forward and graph replay.
        self.num_real_reqs = torch.zeros((1,), dtype=torch.int32, device=device)
        self.num_layers = coordinator.sparse_cache.num_layers
        ws = coordinator.prefetch_workspace
        self._prefetch_topk = (
            None if ws is None else ws.out_indices.new_full((ws.max_bs, ws.topk), -1)
        )
        self._side_stream = None  # CPU: the prefetch runs in order
        if ws is not None and device.type == "cuda":
            if prefetch_stream_priority is None:
                prefetch_stream_priority = torch.cuda.Stream.priority_range()[1]
            self._side_stream = torch.cuda.Stream(device, priority=prefetch_stream_priority)
        on_cuda = self._side_stream is not None
        self._prefetch_planned = torch.cuda.Event() if on_cuda else None
        self._prefetch_done = torch.cuda.Event() if on_cuda else None
        self._prefetch_in_flight = False
        self._overlaps_prefetch_load = ws is not None and _victims_avoid_prefetch(
            coordinator.sparse_cache.max_slots, ws.topk
        )

    def wait_for_pending_backup(self) -> None:
        """Nothing to wait for: a backup copies GPU rows to the host, and a row stays on the GPU
        (and is what attention reads) until its backup has completed."""

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        topk_indices: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Resolve one layer's top-k to rows of ``kv_buffer[layer]``, loading the misses first.

        ``topk_indices`` are token positions (-1 padded): ``(bs, topk)`` in decode, ``(bs, draft
        tokens, topk)`` in a speculative target verify. Returns int32 rows of the same shape (-1
        kept) in a workspace tensor; the indexer's tensor is never written (the next layer may
        reuse it).
        """
        del seq_lens  # tail rows are found through the logical->physical mapping instead
        coord = self.coordinator
        if topk_indices.dim() == 3:
            # One plan row per request over its draft tokens' top-k: the plan dedupes a row, so the
            # union of their misses is loaded once. Draft tokens' own KV is in GPU tail rows.
            bs, tokens, topk = topk_indices.shape
            flat = topk_indices.view(bs, tokens * topk)
            plan = self._plan(req_pool_indices, flat, layer_id, coord.verify_workspace)
            self._load(plan, layer_id, prefetch=False)
            return plan.out_indices.view(bs, tokens, topk)
        # The previous layer's prefetch of this one, if any.
        forward = torch.cuda.current_stream() if self._prefetch_in_flight else None
        overlap = forward is not None and self._overlaps_prefetch_load
        if forward is not None:
            forward.wait_event(self._prefetch_planned if overlap else self._prefetch_done)
            self._prefetch_in_flight = False
        bs = topk_indices.shape[0]
        prefetches = self._prefetches(bs) and layer_id + 1 < self.num_layers
        # The plan writes the next layer's guess (the indexer's buffer is reused by that layer).
        guess = self._prefetch_topk[:bs] if prefetches else None
        plan = self._plan(req_pool_indices, topk_indices, layer_id, coord.workspace, guess)
        self._load(plan, layer_id, prefetch=False)
        if overlap:  # attention reads the prefetched rows too
            forward.wait_event(self._prefetch_done)
        if prefetches:
            self._prefetch(req_pool_indices, guess, layer_id + 1)
        return plan.out_indices

    def _prefetches(self, bs: int) -> bool:
        """Whether a batch of ``bs`` rows prefetches (a shape, so fixed within a CUDA graph)."""
        if self.coordinator.prefetch_workspace is None:
            return False
        return not self.prefetch_max_bs or bs <= self.prefetch_max_bs

    def _plan(
        self,
        req_pool_indices: torch.Tensor,
        topk_indices: torch.Tensor,
        layer_id: int,
        workspace: PlanWorkspace,
        guess_out: Optional[torch.Tensor] = None,
    ) -> PlanResult:
        coord = self.coordinator
        allocator = coord.allocator
        return plan_layer(
            topk_indices,
            req_pool_indices,
            self.num_real_reqs,
            allocator.loc_to_host,
            allocator.full_to_hisparse_device_index_mapping,
            coord.sparse_cache.layer(layer_id),
            workspace,
            compact=not coord.grouped_loads,
            req_to_token=coord.req_to_token,
            guess_out=guess_out,
        )

    def _load(self, plan: PlanResult, layer_id: int, prefetch: bool) -> None:
        coord = self.coordinator
        if coord.grouped_loads:
            coord.controller.load_one_layer(
                layer_id, plan.miss_host, plan.miss_dst, group_counts=plan.num_misses
            )
        else:
            coord.controller.load_one_layer(
                layer_id,
                plan.miss_host,
                plan.miss_dst,
                num_valid=plan.miss_count,
                prefetch=prefetch,
            )

    def _prefetch(self, req_pool_indices: torch.Tensor, guess: torch.Tensor, layer_id: int) -> None:
        """Plan and load ``guess`` (the previous layer's top-k, written by its plan) into
        ``layer_id``."""
        workspace = self.coordinator.prefetch_workspace
        if self._side_stream is None:  # CPU: in order
            plan = self._plan(req_pool_indices, guess, layer_id, workspace)
            self._load(plan, layer_id, prefetch=True)
            return
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            plan = self._plan(req_pool_indices, guess, layer_id, workspace)
            self._prefetch_planned.record()
            self._load(plan, layer_id, prefetch=True)
            self._prefetch_done.record()
        self._prefetch_in_flight = True


def _victims_avoid_prefetch(max_slots: int, topk: int) -> bool:
    """Whether a layer's plan can run while the prefetch's load into that layer is in flight.

    The prefetch loads at most ``topk`` rows into slots it moves to the most recent end of the LRU;
    the layer's plan then evicts at most ``topk - hits`` slots, least recent first, never one it
    hits. With ``n`` slots, at least ``n - topk`` slots outside the prefetch's loads are evictable
    beside the hits, so ``n >= 2 * topk`` keeps every victim out of the prefetch's in-flight rows.
    A request holding fewer slots holds its whole context (``slots_for``): its victims are empty
    slots, which precede every loaded one. So the bound on the largest grant suffices. (A request
    whose slots could not grow with its context is failed at that step by the coordinator.)
    """
    return max_slots >= 2 * topk
