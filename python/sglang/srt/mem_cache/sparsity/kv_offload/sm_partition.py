"""A CUDA stream confined to a few SMs (a green context), for the cross-layer prefetch.

The host gather is bound by address translation and PCIe latency, not by SMs: on the H200 it moves
the same 21 GB/s from 8 SMs as from all 132 (``benchmark/kv_offload/probe_sm_partition.py``). On an
ordinary stream, though, it cannot run beside the layer's GEMMs, which fill every SM: the two
serialize (1-2 % overlap). Confined to its own SMs it overlaps them (58-74 %), and the prefetch
leaves the critical path (``bench_exposed.py --prefetch-green-sms``).

A green context is made through the CUDA driver API (CUDA 12.4+ drivers): the device's SM resource
is split into a group of at least ``num_sms`` SMs (rounded up to the device's granularity) and the
remainder, a green context is made from the group and a stream from that context. The stream is a
``torch.cuda.ExternalStream``: work issued on it (Triton kernels included) runs on the group's SMs,
it orders with other streams through events, and CUDA graphs capture it like any side stream.
SGLang's PD multiplexing makes its streams the same way (``sgl_kernel``'s spatial streams).
torch's own ``GreenContext.create`` always takes the device's first SMs, so two of its contexts
overlap; here the remainder can get a stream of its own (``with_remainder``, for benchmarks).
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
# CUdevResource: a 4 B type, 92 B of padding, then a 48 B union whose SM member starts with
# smCount (144 B in CUDA 12.4-13.x). Each buffer holds one resource, so only this prefix matters.
RESOURCE_BYTES = 256
SM_COUNT_OFFSET = 96


class SmPartitionError(RuntimeError):
    """The driver could not make the partition; the message names the call and the fix."""


class SmPartition:
    """``stream``: a stream on at least ``num_sms`` SMs of ``device``; ``sms``: how many it got.

    ``priority``: the CUDA priority of ``stream`` (lower is higher); by default the device's
    highest, as the prefetch's plan stream has. Kernels of other contexts still run on the
    partition's SMs; at priority 0 a kernel issued there waited until a compute kernel of many
    programs had dispatched its last one (at bs 128, 0.11-0.13 ms more exposed time per layer on
    the H200: ``bench_exposed.py --prefetch-green-priority0``). With ``with_remainder``,
    ``rest_stream`` (priority 0) runs on the other ``rest_sms`` SMs. The green contexts are never
    destroyed: like the streams made from them (and graphs that captured those), they live until
    the process exits.
    """

    def __init__(
        self,
        num_sms: int,
        device: torch.device,
        with_remainder: bool = False,
        priority: Optional[int] = None,
    ):
        device = torch.device(device)
        if device.type != "cuda":
            raise SmPartitionError(f"an SM partition needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).multi_processor_count
        if not 0 < num_sms < total:
            raise SmPartitionError(
                f"cannot confine a stream to {num_sms} of the {total} SMs of {device}: "
                f"ask for 1 to {total - 1}"
            )
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise SmPartitionError(f"the CUDA driver library is not loadable ({exc})") from None
        torch.cuda.init()  # the primary context exists before the driver calls below
        self._device = ctypes.c_int()
        self._check(self._cu.cuDeviceGet(ctypes.byref(self._device), index), "cuDeviceGet")
        full = ctypes.create_string_buffer(RESOURCE_BYTES)
        self._check(
            self._cu.cuDeviceGetDevResource(self._device, full, CU_DEV_RESOURCE_TYPE_SM),
            "cuDeviceGetDevResource",
        )
        group, rest = (ctypes.create_string_buffer(RESOURCE_BYTES) for _ in range(2))
        groups = ctypes.c_uint(1)
        self._check(
            self._cu.cuDevSmResourceSplitByCount(
                group, ctypes.byref(groups), full, rest, 0, num_sms
            ),
            "cuDevSmResourceSplitByCount",
        )
        self._contexts: List[ctypes.c_void_p] = []
        if priority is None:
            priority = torch.cuda.Stream.priority_range()[1]
        self.sms = self._sm_count(group)
        self.stream = self._stream(group, priority)
        self.rest_sms: Optional[int] = self._sm_count(rest) if with_remainder else None
        self.rest_stream = self._stream(rest, 0) if with_remainder else None

    @staticmethod
    def _sm_count(resource) -> int:
        return struct.unpack_from("I", resource.raw, SM_COUNT_OFFSET)[0]

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise SmPartitionError(
                f"{call} returned CUresult {rc}: green contexts need a CUDA 12.4+ driver on a GPU "
                "that supports them; turn prefetch_sms off (0) to use an ordinary stream"
            )

    def _stream(self, resource, priority: int) -> torch.cuda.ExternalStream:
        desc, ctx, handle = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(
            self._cu.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1),
            "cuDevResourceGenerateDesc",
        )
        self._check(
            self._cu.cuGreenCtxCreate(
                ctypes.byref(ctx), desc, self._device, CU_GREEN_CTX_DEFAULT_STREAM
            ),
            "cuGreenCtxCreate",
        )
        self._contexts.append(ctx)
        self._check(
            self._cu.cuGreenCtxStreamCreate(
                ctypes.byref(handle), ctx, CU_STREAM_NON_BLOCKING, priority
            ),
            "cuGreenCtxStreamCreate",
        )
        return torch.cuda.ExternalStream(handle.value)
