"""The interface between upstream SGLang and kv offload.

Every call from an upstream file into kv offload goes through one of these:

* :func:`~sglang.srt.mem_cache.sparsity.kv_offload.runtime.device_pool_factory` and
  :func:`~sglang.srt.mem_cache.sparsity.kv_offload.runtime.build_allocator`, which
  ``KVCacheConfigurator`` calls in place of the DSA pool class and its allocator, and
  :func:`~sglang.srt.mem_cache.sparsity.kv_offload.runtime.init_offload`, which
  ``ModelRunner._init_post_memory_pool_components`` calls beside HiSparse's coordinator set-up;
* :class:`KVOffloadHooks`, the per-server object the scheduler and the PD decode queue call. It is
  reached as ``token_to_kv_pool_allocator.kv_offload``: every upstream call site already holds the
  allocator, so no process-global state and no new plumbing is needed;
* the attention side: ``DeepseekSparseAttnBackend`` reaches the sparse buffer through the model
  runner's sparse-KV coordinator slot (``sparse_kv_coordinator``, patch 0005), which the model
  runner and CUDA-graph capture and replay keep current. kv offload installs
  :class:`~sglang.srt.layers.attention.dsa_offload.adapter.DSAOffloadAdapter` there, HiSparse its
  own coordinator; :class:`SparseKVCoordinator` is what upstream uses on it.

``test_hooks_contract.py`` checks the patch series against this file: every ``kv_offload.<name>(``
call in a patch is a method below with the same arguments, every attribute upstream's model side
uses on the slot is a member of :class:`SparseKVCoordinator`, and the real DSA backend, built on
CPU with the adapter in the slot, decodes through the adapter's rows (and without it, does not).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch


@runtime_checkable
class SparseKVCoordinator(Protocol):
    """What upstream's DSA model side uses on ``model_runner.sparse_kv_coordinator``.

    ``DeepseekSparseAttnBackend`` (read when built), ``ModelRunner`` and the decode CUDA-graph
    runner use exactly these on the slot. Upstream's ``HiSparseCoordinator`` provides them (HiSparse
    puts it in this slot and in its own ``hisparse_coordinator``), and so does kv offload's
    ``DSAOffloadAdapter``; ``test_hooks_contract.py`` checks both against the upstream sources.
    """

    num_real_reqs: torch.Tensor
    """``(1,)`` int32 on the device: rows ``>= num_real_reqs[0]`` of a decode batch are CUDA-graph
    padding. Set before every decode forward and graph replay."""

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        topk_indices: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """One decode layer's top-k (token positions, -1 padded) -> rows of that layer's KV
        buffer for attention (-1 kept); CUDA-graph capturable; the input is never written."""

    def wait_for_pending_backup(self) -> None:
        """Before a decode forward: wait for whatever must land before attention reads KV."""


class KVOffloadHooks(abc.ABC):
    """What the scheduler (co-located and PD decode) calls, one object per server process."""

    # ------------------------------------------------------------------ scheduler
    @abc.abstractmethod
    def prepare_decode_step(self, batch: "ScheduleBatch") -> None:
        """``ScheduleBatch.prepare_for_decode``, after this step's locs are allocated: admit new
        requests, complete and start backups, grow sparse slots; a request that cannot be served
        gets ``to_finish`` set to an abort naming the fix."""

    @abc.abstractmethod
    def prepare_extend(self, batch: "ScheduleBatch") -> None:
        """``ScheduleBatch.prepare_for_extend``, after the extend's locs are allocated: cached
        prefix pages (radix cache) held on the host only are read back into GPU rows for the
        prefill, until the next scheduler iteration."""

    @abc.abstractmethod
    def can_stage_prefill(self, req: "Req", scheduled: Sequence["Req"]) -> bool:
        """``PrefillAdder.add_one_req``: whether ``req``'s prompt staging rows and promised sparse
        slots fit in GPU KV rows beside ``scheduled`` and the running requests."""

    @abc.abstractmethod
    def release_request(self, req_pool_idx: Optional[int], kv_len: int = 0) -> None:
        """``release_kv_cache``, before the request's KV is freed (finish, abort, retract,
        failed transfer); ``kv_len``: positions of its row whose KV is written (committed)."""

    @abc.abstractmethod
    def on_scheduler_iteration(self) -> bool:
        """Once per scheduler loop iteration: complete finished backups (never blocks). True when
        :meth:`can_stage_prefill` refused a prompt and GPU rows were freed since: the scheduler
        then retries its waiting prompts (``batch_is_full`` reset)."""

    @abc.abstractmethod
    def internal_state(self) -> Dict[str, object]:
        """``SchedulerInternalStateController.get_internal_state``: the ``kv_offload`` entry of
        ``GET /server_info``. A pure read: it completes no backup and frees nothing."""

    # ------------------------------------------------------------------ PD decode queue
    @abc.abstractmethod
    def pd_kv_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """``DecodePreallocQueue._init_kv_manager``: the KV buffers registered for transfers."""

    @abc.abstractmethod
    def pd_can_admit(self, req: "Req") -> bool:
        """``pop_preallocated`` / ``resume_retracted_reqs``, before ``_pre_alloc``."""

    @abc.abstractmethod
    def pd_prealloc(self, req: "Req", fill_len: int, prefix_len: int) -> Optional[torch.Tensor]:
        """``DecodePreallocQueue._alloc_for_decode_prealloc``: logical locs for positions
        ``[prefix_len, fill_len)`` (the first ``prefix_len``, whole pages, are the decode radix
        cache's; sets ``req.kv.kv_allocated_len``), or None."""

    @abc.abstractmethod
    def pd_kv_destination_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """``translate_kv_indices_for_transfer`` of the allocator (``pop_preallocated``): where
        the prompt's KV rows go (physical rows or host slots)."""

    @abc.abstractmethod
    def admit_transferred(self, reqs: Sequence["Req"]) -> None:
        """``process_decode_queue``: requests whose prompt transfer has just succeeded."""
