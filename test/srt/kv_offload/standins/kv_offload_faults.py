"""Test-only fault injection and settings for the tiny real server (never a stand-in for a
kernel).

Enabled per server process by environment variables (see ``sitecustomize.py``):

* ``KV_OFFLOAD_TEST_HOST_RESERVE_GB=N``: the host memory the host pool keeps free for the rest of
  the process is ``N`` GB instead of upstream HiCache's 10 GiB. The suites run several tiny
  servers side by side (pools of a few MB) on a 24 GiB machine, where the servers' own memory
  can leave less than 10 GiB available (seen in CI as a start-up ``HostPoolSizeError``).

* ``KV_OFFLOAD_TEST_RECORD_DECODE=PATH``: a JSON line is appended to ``PATH`` for every call of
  the DSA backend's offload branch in a decode forward: ``swap_in`` (the adapter's
  ``swap_in_selected_pages``: the layer, the top-k's shape, whether every entry is a token
  position of its row or -1, and the returned tensor's address) and ``attend`` (the fp8 sparse
  attention, ``_forward_flashmla_kv``: the layer and the address of the page table it reads), so a
  test can check what the backend does with the adapter, not only what it calls.
* ``KV_OFFLOAD_TEST_CORRUPT_LOADS=1``: every row loaded host -> device comes from the next host
  slot instead of its own (the negative control: the token comparison must then fail).
* ``KV_OFFLOAD_TEST_FORWARD_DELAY_CYCLES=N`` (CUDA): every forward first spins ``N`` GPU cycles on
  its stream, so under the overlap scheduler the scheduler's work for the next batch runs while
  this forward has not yet written or read anything (widens every race window).
* ``KV_OFFLOAD_TEST_DROP_FORWARD_ORDERING=1``: the coordinator's scheduler-side work no longer
  waits for the in-flight forward (shows that the ordering is what keeps tokens right).
* ``KV_OFFLOAD_TEST_FAIL_TRANSFER_FILE=PATH`` (PD decode server): once ``PATH`` exists, the next
  poll of the decode transfer queue that finds a transfer still in flight reports it ``Failed``
  and removes ``PATH`` (one failure per trigger; the soak driver creates the file). Upstream's ``SGLANG_TEST_DISAGG_FAILURE_PROB``
  fails polls at random, in any state; this fails one transfer when the driver asks.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, Dict

import torch


def _corrupt_loads(module) -> None:
    cls = module.KVOffloadCacheController
    load_one_layer = cls.load_one_layer

    def load_from_wrong_slot(self, layer_id, host_indices, device_slots, *args, **kwargs):
        shifted = (host_indices + 1).clamp_max(self.mem_pool_host.size - 1)
        wrong = torch.where(host_indices >= 0, shifted, host_indices)
        return load_one_layer(self, layer_id, wrong, device_slots, *args, **kwargs)

    cls.load_one_layer = load_from_wrong_slot


def _delay_forwards(cycles: int) -> Callable:
    def patch(module) -> None:
        forward = module.ModelRunner.forward

        def delayed_forward(self, *args, **kwargs):
            torch.cuda._sleep(cycles)
            return forward(self, *args, **kwargs)

        module.ModelRunner.forward = delayed_forward

    return patch


def _drop_forward_ordering(module) -> None:
    module.KVOffloadCoordinator._after_inflight_forward = lambda self: None


def _fail_transfer_on_trigger(path: str) -> Callable:
    def patch(module) -> None:
        queue = module.DecodeTransferQueue
        poll = queue._poll_with_metadata_gate
        done = (module.KVPoll.Success, module.KVPoll.Failed)

        def poll_or_fail(self):
            polls = poll(self)
            in_flight = [i for i, p in enumerate(polls) if p not in done]
            if in_flight and os.path.exists(path):
                try:
                    os.unlink(path)  # consumed: one failure per trigger
                except FileNotFoundError:
                    return polls
                polls[in_flight[0]] = int(module.KVPoll.Failed)
            return polls

        queue._poll_with_metadata_gate = poll_or_fail

    return patch


def _record_decode(path: str) -> Dict[str, Callable]:
    def write(record: Dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def patch_adapter(module) -> None:
        cls = module.DSAOffloadAdapter
        swap_in = cls.swap_in_selected_pages

        @functools.wraps(swap_in)
        def recorded(self, req_pool_indices, seq_lens, topk_indices, layer_id):
            rows = swap_in(self, req_pool_indices, seq_lens, topk_indices, layer_id)
            topk = topk_indices.reshape(topk_indices.shape[0], -1).cpu()
            positions = None  # a speculative verify's lengths are per draft token: not checked
            if topk_indices.dim() == 2:
                lens = seq_lens.cpu()[:, None]
                positions = bool((((topk >= 0) & (topk < lens)) | (topk == -1)).all())
            write(
                {
                    "call": "swap_in",
                    "layer": int(layer_id),
                    "shape": list(topk_indices.shape),
                    "positions": positions,
                    "selected": int((topk >= 0).sum()),
                    "out": rows.data_ptr(),
                }
            )
            return rows

        cls.swap_in_selected_pages = recorded

    def patch_backend(module) -> None:
        cls = module.DeepseekSparseAttnBackend
        forward_decode, attend = cls.forward_decode, cls._forward_flashmla_kv

        @functools.wraps(forward_decode)
        def decode(self, *args, **kwargs):
            self._kv_offload_test_decoding = True
            try:
                return forward_decode(self, *args, **kwargs)
            finally:
                self._kv_offload_test_decoding = False

        @functools.wraps(attend)
        def recorded(self, *args, **kwargs):
            if getattr(self, "_kv_offload_test_decoding", False):
                table = kwargs["page_table_1"]
                write(
                    {"call": "attend", "layer": kwargs["layer"].layer_id, "table": table.data_ptr()}
                )
            return attend(self, *args, **kwargs)

        cls.forward_decode, cls._forward_flashmla_kv = decode, recorded

    return {
        "sglang.srt.layers.attention.dsa_offload.adapter": patch_adapter,
        "sglang.srt.layers.attention.dsa_backend": patch_backend,
    }


def _chain(patches: Dict[str, Callable], name: str, patch: Callable) -> None:
    """Add ``patch`` for module ``name`` after the one already registered, if any."""
    first = patches.get(name)

    def both(module) -> None:
        if first is not None:
            first(module)
        patch(module)

    patches[name] = both


def _host_reserve(gb: float) -> Callable:
    def patch(module) -> None:
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(gb * (1 << 30))

    return patch


def register(patches: Dict[str, Callable]) -> None:
    """Add the faults selected by the environment to the stand-ins' import-time patches."""
    reserve_gb = os.environ.get("KV_OFFLOAD_TEST_HOST_RESERVE_GB")
    if reserve_gb:
        patches["sglang.srt.mem_cache.sparsity.kv_offload.host_pool"] = _host_reserve(
            float(reserve_gb)
        )
    if os.environ.get("KV_OFFLOAD_TEST_CORRUPT_LOADS") == "1":
        patches["sglang.srt.mem_cache.sparsity.kv_offload.controller"] = _corrupt_loads
    cycles = int(os.environ.get("KV_OFFLOAD_TEST_FORWARD_DELAY_CYCLES", "0"))
    if cycles > 0:
        patches["sglang.srt.model_executor.model_runner"] = _delay_forwards(cycles)
    if os.environ.get("KV_OFFLOAD_TEST_DROP_FORWARD_ORDERING") == "1":
        patches["sglang.srt.mem_cache.sparsity.kv_offload.coordinator"] = _drop_forward_ordering
    record = os.environ.get("KV_OFFLOAD_TEST_RECORD_DECODE")
    if record:
        for name, patch in _record_decode(record).items():
            _chain(patches, name, patch)
    fail_transfer = os.environ.get("KV_OFFLOAD_TEST_FAIL_TRANSFER_FILE")
    if fail_transfer:
        patches["sglang.srt.disaggregation.decode"] = _fail_transfer_on_trigger(fail_transfer)
