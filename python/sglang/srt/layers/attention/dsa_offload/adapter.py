"""The attention side of kv offload: one DSA decode layer's top-k -> sparse-buffer rows.

``DeepseekSparseAttnBackend.forward_decode`` asks the model runner's sparse-KV coordinator
(``sparse_kv_coordinator``, read when the backend is built) for the KV rows of each layer's
selected tokens (``swap_in_selected_pages``, the ``hooks.SparseKVCoordinator`` protocol that
HiSparse's coordinator also provides) and switches the decode indexer to unfused top-k (token
positions) when one is installed; the model runner calls ``wait_for_pending_backup`` and sets
``num_real_reqs`` before every decode forward, as CUDA-graph capture and replay do. kv offload
installs this adapter there (``runtime.init_offload``).

Per layer, on the forward stream, two launches and no host sync (CUDA-graph safe: fixed shapes,
device-side counts, no allocation):

1. the plan (``plan_layer`` in positions mode): each top-k position to its logical loc through
   ``req_to_token``, then hits in the request's sparse slots, rows still in the GPU tail, and for
   each miss an LRU victim slot and the host slot to load;
2. the host -> device load of the misses into those slots (``controller.load_one_layer``), ordered
   before this layer's attention by stream order.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import (
    PlanResult,
    PlanWorkspace,
    plan_layer,
)


class DSAOffloadAdapter:
    """What the DSA backend, the model runner and the CUDA-graph runner call on the forward side.

    It only reads the scheduler side's state and plans into its workspaces, on the forward
    stream; the coordinator (``KVOffloadCoordinator``) changes that state between forwards.

    Args:
        req_to_token: ``ReqToTokenPool.req_to_token`` (logical locs per request position).
        allocator: ``KVOffloadTokenToKVPoolAllocator`` (``loc_to_host`` and the logical->physical
            mapping the plan reads).
        sparse_cache: the GPU LRU state (each layer's slots, planned into in place).
        controller: ``KVOffloadCacheController`` (the host -> device load of the misses).
        workspace: the decode plan's workspace (the coordinator reads its counters).
        verify_workspace: a speculative target verify's (None without speculation).
    """

    def __init__(
        self,
        req_to_token: torch.Tensor,
        allocator,
        sparse_cache,
        controller,
        workspace: PlanWorkspace,
        verify_workspace: Optional[PlanWorkspace] = None,
    ) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.sparse_cache = sparse_cache
        self.controller = controller
        self.workspace = workspace
        self.verify_workspace = verify_workspace
        # Rows >= num_real_reqs[0] of a CUDA-graph batch are padding; upstream fills it before
        # every eager forward and graph replay.
        self.num_real_reqs = torch.zeros((1,), dtype=torch.int32, device=sparse_cache.device)

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
        if topk_indices.dim() == 3:
            # One plan row per request over its draft tokens' top-k: the plan dedupes a row, so the
            # union of their misses is loaded once. Draft tokens' own KV is in GPU tail rows.
            bs, tokens, topk = topk_indices.shape
            flat = topk_indices.view(bs, tokens * topk)
            plan = self._plan(req_pool_indices, flat, layer_id, self.verify_workspace)
            self._load(plan, layer_id)
            return plan.out_indices.view(bs, tokens, topk)
        plan = self._plan(req_pool_indices, topk_indices, layer_id, self.workspace)
        self._load(plan, layer_id)
        return plan.out_indices

    def _plan(
        self,
        req_pool_indices: torch.Tensor,
        topk_indices: torch.Tensor,
        layer_id: int,
        workspace: PlanWorkspace,
    ) -> PlanResult:
        return plan_layer(
            topk_indices,
            req_pool_indices,
            self.num_real_reqs,
            self.allocator.loc_to_host,
            self.allocator.full_to_hisparse_device_index_mapping,
            self.sparse_cache.layer(layer_id),
            workspace,
            req_to_token=self.req_to_token,
        )

    def _load(self, plan: PlanResult, layer_id: int) -> None:
        self.controller.load_one_layer(
            layer_id, plan.miss_host, plan.miss_dst, num_valid=plan.miss_count
        )
