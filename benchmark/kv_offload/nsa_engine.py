"""Proof by decoding: a small NSA-shaped decode engine run all-on-GPU and with ``--enable-kv-offload``.

The engine is a toy DeepSeek-V3.2-shaped model (random seeded weights) whose every KV byte goes
through the real SGLang pools:

* **DSA lightning indexer**: per token and layer an index key ``k_idx`` (128-d) is computed from the
  hidden state, quantised to fp8 with one fp32 scale (upstream ``act_quant`` maths) and stored in the
  pool's paged ``index_k_with_scale_buffer``. The query's scores over every context token are
  ``sum_h w_h * relu(q_h . k_t)`` over ``index_heads`` heads, with the keys read back from the paged
  buffer through ``req_to_token``; the top-k positions (stable sort: ties go to the earlier position)
  become ``(bs, K)`` int32 *logical* locs, -1 padded when the context is shorter than K.
* **Latent KV**: the token's 576-d latent row (512 ``kv_lora`` + 64 rope) is written into the
  layer's KV buffer in the NSA fp8 layout (512 fp8 + 4 fp32 tile scales + 64 bf16 rope = 656 B) or
  in bf16 (1152 B).
* **Sparse MLA attention**: the selected rows are gathered by physical row id, dequantised, and
  attended to by ``heads`` absorbed queries of 576 dims; the (heads x 512) output is projected back
  and added to the residual. The next token is the argmax of a vocabulary projection (greedy).

Two backends share the weights and every op:

* ``oracle``: a plain ``NSATokenToKVPool`` sized for every token; top-k logical locs index the KV
  buffer directly.
* ``offload``: ``KVOffloadNSATokenToKVPool`` (index keys for every logical token, KV rows only for a
  small physical pool), ``KVOffloadHostPool``, ``KVOffloadCacheController``, ``SparseCacheState`` and
  ``KVOffloadCoordinator``. Each layer calls ``coordinator.swap_in_selected_pages`` and attends to
  the physical rows it returns (sparse-cache hits, host loads of the misses, or decode-tail rows).

A scheduler drives both backends in lockstep (same batches, same order): requests arrive, prefill,
decode, finish, abort and retract (release, then re-prefill of prompt + generated tokens, i.e.
recompute) while the physical pool that holds the sparse slots is smaller than the sum of the
demands. Every prefill and decode step compares every layer's attention output and the sampled
tokens of the two backends bit for bit.

Prompt KV is produced by running the model over the prompt (a causal sparse prefill with the same
indexer, in query chunks); in offload mode the prompt lands in physical tail rows (as after a PD
transfer) and is admitted to the coordinator once written.

Run ``python benchmark/kv_offload/nsa_engine.py --help``; ``scripts/demo.py`` wraps it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from sglang.srt.layers.attention.nsa_offload.adapter import NSAOffloadAdapter

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_STUBS = os.path.join(ROOT, "test", "srt", "kv_offload", "cpu_stubs")

PAGE = 64
KV_LORA = 512
ROPE = 64
LATENT = KV_LORA + ROPE  # 576
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4  # fp8 key + fp32 scale
FP8_ROW_BYTES = KV_LORA + KV_LORA // 128 * 4 + ROPE * 2  # 656
BF16_ROW_BYTES = LATENT * 2  # 1152
FP8_MAX = 448.0


def prepare_environment(device: str) -> None:
    """Set up a process before sglang is imported: Triton interpreter on CPU, import stand-ins.

    ``TRITON_INTERPRET`` must be set before any ``@triton.jit`` module is imported; the
    ``sgl_kernel`` / ``torchvision`` stand-ins are added only where the real packages are missing.
    """
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The engine's matmuls are tiny: with a second busy process on a small box, intra-op
        # threads cost far more in contention than they gain (30x on the 2-core CI machine).
        torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    missing = any(importlib.util.find_spec(p) is None for p in ("sgl_kernel", "torchvision"))
    if missing and CPU_STUBS not in sys.path:
        sys.path.insert(0, CPU_STUBS)


# --------------------------------------------------------------------------------------------------
# Configuration and workload
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EngineConfig:
    """Model shapes, pool sizes and scheduler limits."""

    device: str = "cpu"
    kv_dtype: str = "fp8"  # "fp8" (656 B rows) or "bf16" (1152 B rows)
    hidden: int = 256
    vocab: int = 512
    heads: int = 4  # absorbed MLA query heads
    index_heads: int = 4
    compute_layers: int = 2
    memory_layers: int = 2  # layers allocated in every pool (>= compute_layers)
    topk: int = 32
    buffer_slots: int = 128  # sparse slots per request (sparse_slots_per_req)
    logical_pages: int = 64  # index keys / req_to_token space (both backends)
    physical_pages: int = 15  # offload: KV rows for sparse slots + tails + prompt staging
    host_pool_ratio: float = 1.0
    max_running: int = 4
    max_context: int = 1024  # req_to_token width
    # CUDA-graph batch sizes; sparse on CPU so that batches of 2 and 3 run with padded rows.
    capture_sizes: Tuple[int, ...] = (1, 4, 8)
    seed: int = 0
    upstream_kernels: Optional[bool] = None  # None: upstream pool kernels on CUDA, torch on CPU
    grouped_loads: Optional[bool] = None  # coordinator H2D path; None: the coordinator's default
    # Lengths given to before_decode_step: "written" (tokens whose KV the forward has written) or
    # "allocated" (+ the token about to be decoded, as runtime.prepare_decode_step passes today).
    seq_lens_contract: str = "allocated"
    chunk_bytes: int = 256 << 20  # prefill working-set bound per query chunk

    @classmethod
    def cpu(cls, **overrides: Any) -> "EngineConfig":
        """Small enough for CI under the Triton interpreter on two cores."""
        return cls(**overrides)

    @classmethod
    def cuda(cls, **overrides: Any) -> "EngineConfig":
        """DeepSeek-V3.2 KV shapes (61 layers of pools, top-k 2048, 4096 slots), 4 compute layers."""
        base = dict(
            device="cuda",
            hidden=2048,
            vocab=16384,
            heads=16,
            index_heads=64,
            compute_layers=4,
            memory_layers=61,
            topk=2048,
            buffer_slots=4096,
            logical_pages=8 * 30000 // PAGE,
            # 40K rows: the longest prompt's staging (~20.5K) plus a few requests' 4096 slots; eight
            # running requests would want 8 x (4096 + 128) = 33.8K for slots and tails alone.
            physical_pages=640,
            max_running=8,
            max_context=32768,
            capture_sizes=(1, 2, 4, 8, 12, 16, 24, 32),
            chunk_bytes=2 << 30,
        )
        base.update(overrides)
        return cls(**base)

    @property
    def row_bytes(self) -> int:
        return FP8_ROW_BYTES if self.kv_dtype == "fp8" else BF16_ROW_BYTES

    @property
    def use_upstream_kernels(self) -> bool:
        if self.upstream_kernels is None:
            return self.device.startswith("cuda")
        return self.upstream_kernels

    def validate(self) -> None:
        if self.seq_lens_contract not in ("written", "allocated"):
            raise ValueError("seq_lens_contract must be 'written' or 'allocated'")
        if self.kv_dtype not in ("fp8", "bf16"):
            raise ValueError(f"kv_dtype must be fp8 or bf16, got {self.kv_dtype!r}")
        if not 1 <= self.compute_layers <= self.memory_layers:
            raise ValueError("need 1 <= compute_layers <= memory_layers")
        if self.buffer_slots % PAGE or self.buffer_slots < self.topk:
            raise ValueError("buffer_slots must be a multiple of 64 and >= topk")


@dataclasses.dataclass
class RequestSpec:
    """One request of the workload; ``abort_after`` / ``retract_after`` count decoded tokens."""

    rid: int
    arrival: int  # scheduler step at which it arrives
    prompt_len: int
    max_new_tokens: int
    abort_after: Optional[int] = None
    retract_after: Optional[int] = None


def make_workload(num_requests: int, steps: int, seed: int, cfg: EngineConfig) -> List[RequestSpec]:
    """Seeded arrivals over the first 60 % of the run, prompts below and above the buffer size.

    Prompt lengths cycle through shorter-than-top-k, below-buffer and above-buffer contexts; every
    fifth request aborts and every fourth is retracted once (then recomputed).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    k, buf = cfg.topk, cfg.buffer_slots
    lens = [k // 2 + 4, 5 * buf + 50, buf // 2 + 30, 3 * buf + 60, buf + 70]
    specs = []
    for i in range(num_requests):
        # A burst of two at the start (a short one, then a long one that finds the pool tight).
        arrival = 0 if i < 2 else int(torch.randint(0, max(1, steps * 3 // 5), (1,), generator=gen))
        base = lens[i % len(lens)]
        prompt = max(1, base + int(torch.randint(-8, 9, (1,), generator=gen)))
        new = int(torch.randint(max(8, steps // 5), max(9, steps * 2 // 5), (1,), generator=gen))
        abort = new // 2 if i % 5 == 4 else None
        retract = new // 3 if i % 4 == 1 else None
        specs.append(RequestSpec(i, arrival, prompt, new, abort, retract))
    specs.sort(key=lambda s: (s.arrival, s.rid))
    return specs


# --------------------------------------------------------------------------------------------------
# Quantisation (byte layouts of the upstream pools)
# --------------------------------------------------------------------------------------------------


def quantize_index_k(k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Upstream ``act_quant`` (block 128, no scale rounding): fp8 keys and one fp32 scale each."""
    x = k.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    scale = amax * (1.0 / FP8_MAX)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def quantize_kv_fp8(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """NSA fp8 KV layout (656 B per row), the maths of upstream's ``_quantize_k_cache_fast_kernel``.

    ``[512 x fp8 | 4 x fp32 tile scale | 64 x bf16 rope]``; per 128-wide tile the fp32 scale is
    amax / 448 and the values are ``clamp(x * (1 / scale))`` cast to e4m3 (round to nearest even).
    """
    n = nope.shape[0]
    x = nope.float().view(n, KV_LORA // 128, 128)
    scale = x.abs().amax(dim=-1) / FP8_MAX
    q = (x * (1.0 / scale[..., None])).clamp(-FP8_MAX, FP8_MAX)
    q = q.to(torch.float8_e4m3fn).view(n, KV_LORA)
    out = torch.empty((n, FP8_ROW_BYTES), dtype=torch.uint8, device=nope.device)
    out[:, :KV_LORA] = q.view(torch.uint8)
    out[:, KV_LORA : KV_LORA + 16] = scale.contiguous().view(torch.uint8)
    out[:, KV_LORA + 16 :] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def kv_bf16_bytes(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """bf16 MLA row (576 x bf16 = 1152 B)."""
    row = torch.cat([nope.to(torch.bfloat16), rope.to(torch.bfloat16)], dim=-1).contiguous()
    return row.view(torch.uint8)


def dequantize_rows(rows: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """``(..., row_bytes)`` uint8 rows -> ``(..., 576)`` float32 latent KV."""
    shape = rows.shape[:-1]
    flat = rows.reshape(-1, rows.shape[-1])
    if kv_dtype == "bf16":
        return flat.view(torch.bfloat16).float().view(*shape, LATENT)
    n = flat.shape[0]
    q = flat[:, :KV_LORA].contiguous().view(torch.float8_e4m3fn).float().view(n, 4, 128)
    scale = flat[:, KV_LORA : KV_LORA + 16].contiguous().view(torch.float32)
    rope = flat[:, KV_LORA + 16 :].contiguous().view(torch.bfloat16).float()
    nope = (q * scale[..., None]).view(n, KV_LORA)
    return torch.cat([nope, rope], dim=-1).view(*shape, LATENT)


def apply_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last (64) dims; ``pos`` broadcasts over the leading dims."""
    half = x.shape[-1] // 2
    inv = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32)[..., None] * inv
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------------
# Backends: where the bytes live
# --------------------------------------------------------------------------------------------------


class _LayerRef:
    """What upstream pool methods need from a ``RadixAttention``: the layer id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


class _Backend:
    """Common index-buffer and KV-row I/O over an ``NSATokenToKVPool`` (or the offload subclass)."""

    name = "?"

    def __init__(self, cfg: EngineConfig) -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.store_dtype = torch.float8_e4m3fn if cfg.kv_dtype == "fp8" else torch.bfloat16
        self.kv_dim = FP8_ROW_BYTES if cfg.kv_dtype == "fp8" else LATENT
        self.r2t = ReqToTokenPool(cfg.max_running * 2 + 2, cfg.max_context, cfg.device, False)
        self.pool: Any = None
        self.seq: Dict[int, int] = {}  # req_pool_idx -> tokens with a loc (written or about to be)

    def pool_kwargs(self) -> Dict[str, Any]:
        return dict(
            page_size=PAGE,
            kv_lora_rank=KV_LORA,
            dtype=self.store_dtype,
            qk_rope_head_dim=ROPE,
            layer_num=self.cfg.memory_layers,
            device=self.cfg.device,
            index_head_dim=INDEX_DIM,
            enable_memory_saver=False,
            kv_cache_dim=self.kv_dim,
        )

    # ------------------------------------------------------------------ index keys
    def write_index(self, layer: int, locs: torch.Tensor, k_fp8: torch.Tensor, scale: torch.Tensor):
        if self.cfg.use_upstream_kernels:
            self.pool.set_index_k_scale_buffer(layer, locs.to(torch.int64), k_fp8, scale)
            return
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import set_index_rows

        # Same bytes as upstream SetKAndS: keys at page[off*128], scales at page[64*128 + off*4].
        rows = torch.cat([k_fp8.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)
        set_index_rows(
            self.pool.index_k_with_scale_buffer[layer], locs.to(torch.int64), rows, self.pool
        )

    def index_keys(self, layer: int, req: int, n: int) -> torch.Tensor:
        """Dequantised index keys of positions ``[0, n)`` read back through ``req_to_token``."""
        pages = (self.r2t.req_to_token[req, :n:PAGE] // PAGE).to(torch.int64)
        if self.cfg.use_upstream_kernels:
            k = self.pool.get_index_k_continuous(layer, n, pages)
            s = self.pool.get_index_k_scale_continuous(layer, n, pages)
        else:
            buf = self.pool.index_k_with_scale_buffer[layer][pages]
            k = buf[:, : PAGE * INDEX_DIM].reshape(-1, INDEX_DIM)[:n]
            s = buf[:, PAGE * INDEX_DIM :].reshape(-1, 4)[:n]
        k = k.contiguous().view(torch.float8_e4m3fn).float()
        s = s.contiguous().view(torch.float32)
        return k * s

    # ------------------------------------------------------------------ latent KV rows
    def kv_rows(self, layer: int) -> torch.Tensor:
        """``(rows, row_bytes)`` uint8 view of a layer's KV buffer."""
        buf = self.pool.kv_buffer[layer]
        return buf.view(buf.shape[0], -1).view(torch.uint8)

    def physical(self, locs: torch.Tensor) -> torch.Tensor:
        return locs.to(torch.int64)

    def write_kv(self, layer: int, locs: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor):
        if self.cfg.use_upstream_kernels:
            # Upstream quantises (fp8) and translates logical -> physical (offload pool) itself.
            self.pool.set_mla_kv_buffer(_LayerRef(layer), locs, nope[:, None], rope[:, None])
            return
        rows = (
            quantize_kv_fp8(nope, rope) if self.cfg.kv_dtype == "fp8" else kv_bf16_bytes(nope, rope)
        )
        phys = self.physical(locs)
        self.kv_rows(layer)[phys] = rows

    def locs(self, req: int, start: int, end: int) -> torch.Tensor:
        return self.r2t.req_to_token[req, start:end].to(torch.int64)

    # Both backends allocate the same way; only where KV rows live differs.
    def alloc_prefill(self, req: int, n: int) -> bool:
        locs = _alloc_extend(self.alloc, n, self.device)
        if locs is None:
            return False
        self.r2t.req_to_token[req, :n] = locs.to(torch.int32)
        self.seq[req] = n
        return True

    def alloc_decode(self, reqs: Sequence[int]) -> bool:
        new = _alloc_decode(self.alloc, self.r2t.req_to_token, reqs, [self.seq[r] for r in reqs])
        if new is None:
            return False
        for i, r in enumerate(reqs):
            self.r2t.req_to_token[r, self.seq[r]] = new[i].to(torch.int32)
            self.seq[r] += 1
        return True


class OracleBackend(_Backend):
    """All KV on the GPU: one plain ``NSATokenToKVPool`` sized for every logical token."""

    name = "oracle"

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        size = cfg.logical_pages * PAGE
        self.pool = NSATokenToKVPool(size=size, **self.pool_kwargs())
        self.alloc = PagedTokenToKVPoolAllocator(
            size, PAGE, self.store_dtype, cfg.device, self.pool, False
        )
        self.start_free = self.free_counts()

    def free_counts(self) -> Dict[str, int]:
        return {"logical": self.alloc.available_size()}

    def used_tokens(self) -> int:
        return self.alloc.size - self.alloc.available_size()

    def admit(self, req: int) -> None:
        pass

    def resolve_prefill(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        return locs

    def resolve_decode(self, layer, rpi, seq_lens, topk_pos, topk_locs, bs) -> torch.Tensor:
        return topk_locs[:bs]

    def release(self, req: int) -> None:
        n = self.seq.pop(req)
        self.alloc.free(self.locs(req, 0, n))
        self.r2t.req_to_token[req, :n] = 0

    def drain(self) -> None:
        pass


class OffloadBackend(_Backend):
    """The split pool, host pool, controller, GPU LRU and coordinator of ``--enable-kv-offload``."""

    name = "offload"

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
        from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
            KVOffloadNSATokenToKVPool,
            KVOffloadTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
        from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

        logical, physical = cfg.logical_pages * PAGE, cfg.physical_pages * PAGE
        kw = self.pool_kwargs()
        kw.pop("page_size")
        self.pool = KVOffloadNSATokenToKVPool(
            physical_size=physical, logical_size=logical, page_size=PAGE, **kw
        )
        self.alloc = KVOffloadTokenToKVPoolAllocator(
            logical, physical, PAGE, self.store_dtype, cfg.device, self.pool, False
        )
        self.host = KVOffloadHostPool(self.pool, host_pool_ratio=cfg.host_pool_ratio)
        self.controller = KVOffloadCacheController(self.alloc, self.host)
        self.sparse = SparseCacheState(
            num_layers=cfg.memory_layers,
            num_logical_locs=self.alloc.full_to_hisparse_device_index_mapping.numel(),
            max_reqs=self.r2t.size,
            buffer_slots=cfg.buffer_slots,
            topk=cfg.topk,
            allocator=self.alloc.hisparse_attn_allocator,
            device=cfg.device,
        )
        max_bs = min(s for s in cfg.capture_sizes if s >= cfg.max_running)
        extra = {} if cfg.grouped_loads is None else {"grouped_loads": cfg.grouped_loads}
        self.coord = KVOffloadCoordinator(
            self.r2t.req_to_token, self.alloc, self.controller, self.sparse, max_bs=max_bs, **extra
        )
        self.adapter = NSAOffloadAdapter(self.coord)
        self.mapping = self.alloc.full_to_hisparse_device_index_mapping
        self.start_free = self.free_counts()
        # Device-side counters (no sync inside the forward); read once per step.
        self.misses = torch.zeros((), dtype=torch.int64, device=self.device)
        self.tail_hits = torch.zeros((), dtype=torch.int64, device=self.device)
        self.entries = torch.zeros((), dtype=torch.int64, device=self.device)

    def free_counts(self) -> Dict[str, int]:
        return self.alloc.free_counts()

    def used(self) -> Tuple[int, int, int]:
        """(logical tokens, physical rows, host slots) in use, page granular."""
        return (
            self.alloc.logical_size - self.alloc.logical_available_size(),
            self.alloc.physical_size - self.alloc.physical_available_size(),
            self.host.size - self.host.available_size(),
        )

    def kv_rows(self, layer: int) -> torch.Tensor:
        return self.pool.device_row_view(layer)

    def physical(self, locs: torch.Tensor) -> torch.Tensor:
        return self.pool.translate_loc_to_hisparse_device(locs).to(torch.int64)

    def admit(self, req: int) -> None:
        """After the prefill wrote every prompt row: back up its pages, ask for sparse slots."""
        self.coord.admit(req, self.seq[req])

    def before_decode(self, reqs: Sequence[int], allocated: bool) -> None:
        """``before_decode_step``, before (``allocated=False``) or after this step's allocation.

        "allocated" (the default, what ``runtime.prepare_decode_step`` does): after this step's
        allocation, lengths include the token about to be decoded; the coordinator backs up only the
        written ``seq_len - 1`` positions. "written": before the allocation, lengths count written
        tokens only (the coordinator then lags one more token, which is also correct).
        """
        if allocated != (self.cfg.seq_lens_contract == "allocated"):
            if not allocated:
                self.coord.poll()  # free backed-up pages before this step's allocation
            return
        self.coord.before_decode_step(list(reqs), [self.seq[r] for r in reqs])

    def slots(self, req: int) -> int:
        return self.sparse.num_slots_cpu[req]

    def has_slots(self, req: int) -> bool:
        r = self.coord.requests.get(req)
        return bool(r is not None and r.has_slots)

    def resolve_prefill(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        # The whole prompt sits in tail rows until the coordinator admits it after the prefill.
        rows = torch.where(locs >= 0, self.mapping[locs.clamp(min=0)], torch.full_like(locs, -1))
        if bool((rows == 0).any()):
            raise AssertionError("a prompt token has no physical tail row during its prefill")
        return rows

    def resolve_decode(self, layer, rpi, seq_lens, topk_pos, topk_locs, bs) -> torch.Tensor:
        # HiSparse's contract: the unfused indexer's top-k *positions*; the coordinator translates
        # them through req_to_token on the device (the logical locs are used for statistics only).
        locs = topk_locs[:bs]
        valid = locs >= 0
        tail = valid & (self.mapping[locs.clamp(min=0).long()] > 0)
        rows = self.adapter.swap_in_selected_pages(rpi, seq_lens, topk_pos, layer)
        self.misses += self.coord.workspace.num_misses[:bs].sum()
        self.tail_hits += tail.sum()
        self.entries += valid.sum()
        return rows

    def release(self, req: int) -> None:
        n = self.seq.pop(req)
        self.coord.release(req, free_kv=False)
        # Upstream's release_kv_cache path: free the logical locs through the same allocator (it
        # frees their physical rows and host slots too).
        self.alloc.free(self.locs(req, 0, n))
        self.r2t.req_to_token[req, :n] = 0

    def drain(self) -> None:
        self.coord.drain()


def _alloc_extend(alloc: Any, n: int, device: torch.device) -> Optional[torch.Tensor]:
    z = torch.zeros(1, dtype=torch.int64, device=device)
    seq = torch.tensor([n], dtype=torch.int64, device=device)
    last = torch.full((1,), -1, dtype=torch.int64, device=device)
    return alloc.alloc_extend(z, z.cpu(), seq, seq.cpu(), last, n)


def _alloc_decode(
    alloc: Any, r2t: torch.Tensor, reqs: Sequence[int], lens: Sequence[int]
) -> Optional[torch.Tensor]:
    device = r2t.device
    idx = torch.tensor(list(reqs), dtype=torch.int64, device=device)
    old = torch.tensor(list(lens), dtype=torch.int64, device=device)
    last = r2t[idx, old - 1].to(torch.int64)
    seq = old + 1
    return alloc.alloc_decode(seq, seq.cpu(), last)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


class NSAModel:
    """Random seeded weights and the forward maths, shared by both backends."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        d, dev = cfg.hidden, torch.device(cfg.device)

        def w(rows: int, cols: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) / math.sqrt(fan_in)).to(dev)

        self.embed = torch.randn(cfg.vocab, d, generator=gen).to(dev)
        self.layers = []
        for _ in range(cfg.compute_layers):
            self.layers.append(
                dict(
                    wk_idx=w(d, INDEX_DIM, d),
                    wq_idx=w(d, cfg.index_heads * INDEX_DIM, d),
                    ww=w(d, cfg.index_heads, d),
                    wkv=w(d, LATENT, d),
                    wq=w(d, cfg.heads * LATENT, d),
                    wo=w(cfg.heads * KV_LORA, d, cfg.heads * KV_LORA),
                )
            )
        self.w_out = w(d, cfg.vocab, d)
        self.softmax_scale = LATENT**-0.5
        self.index_scale = cfg.index_heads**-0.5 * INDEX_DIM**-0.5

    # ------------------------------------------------------------------ pieces
    def project(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Per-token projections of one layer: indexer q/k/weights, latent KV, absorbed q."""
        p, cfg = self.layers[layer], self.cfg
        h = rms_norm(x)
        n = h.shape[0]
        k_idx = (h @ p["wk_idx"]).to(torch.bfloat16)
        q_idx = (h @ p["wq_idx"]).view(n, cfg.index_heads, INDEX_DIM).to(torch.bfloat16)
        q_fp8, q_scale = quantize_index_k(q_idx)
        c = h @ p["wkv"]
        q = (h @ p["wq"]).view(n, cfg.heads, LATENT)
        q = torch.cat([q[..., :KV_LORA], apply_rope(q[..., KV_LORA:], pos[:, None])], dim=-1)
        return dict(
            k_idx=quantize_index_k(k_idx),
            q_idx=q_fp8.float() * q_scale,
            w_idx=(h @ p["ww"]) * self.index_scale,
            nope=c[:, :KV_LORA].to(torch.bfloat16),
            rope=apply_rope(c[:, KV_LORA:], pos).to(torch.bfloat16),
            q=q,
        )

    def index_scores(
        self, q_idx: torch.Tensor, w_idx: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """``sum_h w_h * relu(q_h . k_t)``: ``(m, H_i, 128) x (t, 128) -> (m, t)``."""
        s = torch.einsum("mhd,td->mht", q_idx, keys).relu_()
        return (s * w_idx[:, :, None]).sum(dim=1)

    def select(self, scores: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """Top-k positions per row among ``[0, limit)``, -1 padded; ties go to the earlier position."""
        t = scores.shape[1]
        ar = torch.arange(t, device=scores.device)
        masked = scores.masked_fill(ar[None, :] >= limit[:, None], float("-inf"))
        order = torch.sort(masked, dim=1, descending=True, stable=True).indices
        k = self.cfg.topk
        if t < k:
            order = torch.cat([order, order.new_full((order.shape[0], k - t), -1)], dim=1)
        pos = order[:, :k]
        return torch.where(pos < limit[:, None], pos, torch.full_like(pos, -1))

    def attend(
        self, layer: int, q: torch.Tensor, kv_rows: torch.Tensor, rows: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sparse MLA over ``rows`` (m, K) of ``kv_rows``; returns (H x 512 output, residual delta)."""
        valid = rows >= 0
        kv = dequantize_rows(kv_rows[rows.clamp(min=0).long()], self.cfg.kv_dtype)
        kv = torch.where(valid[..., None], kv, torch.zeros_like(kv))
        logits = torch.einsum("mhc,mkc->mhk", q, kv) * self.softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out = torch.einsum("mhk,mkc->mhc", p, kv[..., :KV_LORA])
        delta = out.reshape(out.shape[0], -1) @ self.layers[layer]["wo"]
        return out, delta

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x) @ self.w_out

    # ------------------------------------------------------------------ passes
    def prefill(
        self, be: _Backend, req: int, tokens: torch.Tensor
    ) -> Tuple[int, List[torch.Tensor]]:
        """Causal sparse prefill of ``tokens`` into ``be``; returns (next token, per-layer outputs)."""
        n = tokens.shape[0]
        dev = tokens.device
        pos = torch.arange(n, device=dev)
        locs = be.locs(req, 0, n)
        x = self.embed[tokens]
        outs = []
        # Rows per chunk so that the (rows, H_i, n) scores and (rows, K, 576) gathers stay bounded.
        per_row = 4 * (self.cfg.index_heads * n + self.cfg.topk * (LATENT + self.cfg.heads))
        chunk = max(1, min(n, self.cfg.chunk_bytes // per_row))
        for layer in range(self.cfg.compute_layers):
            pr = self.project(layer, x, pos)
            be.write_index(layer, locs, *pr["k_idx"])
            be.write_kv(layer, locs, pr["nope"], pr["rope"])
            keys = be.index_keys(layer, req, n)
            kv_rows = be.kv_rows(layer)
            out_l, delta_l = [], []
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                scores = self.index_scores(pr["q_idx"][s:e], pr["w_idx"][s:e], keys[:e])
                sel = self.select(scores, pos[s:e] + 1)
                topk = torch.where(sel >= 0, locs[sel.clamp(min=0)], torch.full_like(sel, -1))
                rows = be.resolve_prefill(layer, topk)
                o, d = self.attend(layer, pr["q"][s:e], kv_rows, rows)
                out_l.append(o)
                delta_l.append(d)
            out = torch.cat(out_l)
            x = x + torch.cat(delta_l)
            outs.append(out)
        token = int(self.logits(x[-1:]).argmax(dim=-1))
        return token, outs

    def decode(
        self,
        be: _Backend,
        reqs: Sequence[int],
        tokens: torch.Tensor,
        pad_to: int,
        stale_req: int,
        garbage: torch.Tensor,
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """One decode step of ``reqs`` (their new token's loc is allocated: ``be.seq[r]``).

        Offload runs on a CUDA-graph-shaped batch of ``pad_to`` rows: rows past ``len(reqs)`` carry
        a stale request index and garbage top-k, and must resolve to nothing.
        """
        bs = len(reqs)
        dev = tokens.device
        lens = torch.tensor([be.seq[r] for r in reqs], dtype=torch.int64, device=dev)
        pos = lens - 1
        req_t = torch.tensor(list(reqs), dtype=torch.int64, device=dev)
        new_locs = be.r2t.req_to_token[req_t, pos].to(torch.int64)
        rpi = torch.cat([req_t, req_t.new_full((pad_to - bs,), stale_req)])
        seq_pad = torch.cat([lens, lens.new_ones(pad_to - bs)])
        x = self.embed[tokens]
        outs = []
        for layer in range(self.cfg.compute_layers):
            pr = self.project(layer, x, pos)
            be.write_index(layer, new_locs, *pr["k_idx"])
            be.write_kv(layer, new_locs, pr["nope"], pr["rope"])
            topk_pos = torch.full((pad_to, self.cfg.topk), -1, dtype=torch.int32, device=dev)
            topk_locs = torch.full_like(topk_pos, -1)
            for b, r in enumerate(reqs):
                n = int(lens[b])
                keys = be.index_keys(layer, r, n)
                scores = self.index_scores(pr["q_idx"][b : b + 1], pr["w_idx"][b : b + 1], keys)
                sel = self.select(scores, lens[b : b + 1])[0]
                ok = sel >= 0
                topk_pos[b] = sel.to(torch.int32)
                topk_locs[b, ok] = be.r2t.req_to_token[r, sel[ok]]
            topk_pos[bs:] = garbage[: pad_to - bs]
            rows = be.resolve_decode(layer, rpi, seq_pad, topk_pos, topk_locs, bs)
            if pad_to > bs and not bool((rows[bs:pad_to] == -1).all()):
                raise AssertionError("a padded CUDA-graph row resolved to KV rows")
            out, delta = self.attend(layer, pr["q"], be.kv_rows(layer), rows[:bs])
            x = x + delta
            outs.append(out)
        return self.logits(x).argmax(dim=-1), outs


# --------------------------------------------------------------------------------------------------
# Scheduler and statistics
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunStats:
    """What a run did and what it proved."""

    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    decode_steps: int = 0
    padded_steps: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    decoded_tokens: int = 0
    requests: int = 0
    admitted: int = 0  # prefills, re-admissions after retraction included
    finished: int = 0
    aborted: int = 0
    retracted: int = 0  # scripted retractions
    pressure_retracted: int = 0  # retractions because the physical pool ran out
    ran_without_slots: int = 0  # admissions that decoded all-on-GPU while the sparse pool was full
    unfinished: int = 0  # still running or waiting when max_steps ran out (then released)
    admission_waits: int = 0  # scheduler steps where the head request could not be prefilled
    max_context: int = 0
    topk_entries: int = 0
    tail_entries: int = 0
    misses: int = 0
    backup_tokens: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    peak_gpu_bytes_offload: int = 0
    peak_gpu_bytes_oracle: int = 0
    peak_host_bytes: int = 0
    sum_gpu_bytes_offload: int = 0  # summed over decode steps (for the mean)
    sum_gpu_bytes_oracle: int = 0
    compared_tensors: int = 0
    mismatches: int = 0
    first_mismatch: str = ""
    leak_free: bool = False
    wall_s: float = 0.0

    @property
    def identical(self) -> bool:
        return self.mismatches == 0 and self.compared_tensors > 0

    @property
    def hit_rate(self) -> float:
        """Sparse-cache hits / entries that needed the cache (tail rows and -1 excluded)."""
        nontail = self.topk_entries - self.tail_entries
        return (nontail - self.misses) / nontail if nontail else float("nan")


@dataclasses.dataclass
class _Running:
    spec: RequestSpec
    req: int
    tokens: List[int]  # prompt + generated
    decoded: int = 0  # tokens generated so far (survives retraction)
    retracted: bool = False


class Engine:
    """Runs a workload through both backends in lockstep and compares every step."""

    def __init__(self, cfg: EngineConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # Equality holds either way (same kernels on the same bytes); keep fp32 honest.
            torch.backends.cuda.matmul.allow_tf32 = False
        self.model = NSAModel(cfg)
        self.oracle = OracleBackend(cfg)
        self.offload = OffloadBackend(cfg)
        self.backends = (self.oracle, self.offload)
        self.gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.free_req_idx = list(range(self.oracle.r2t.size - 1, -1, -1))
        self.stale_req = 0
        self.stats = RunStats(config=dataclasses.asdict(cfg))

    # ------------------------------------------------------------------ comparison
    def _compare(self, what: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
        for i, (x, y) in enumerate(zip(a, b)):
            self.stats.compared_tensors += 1
            if not torch.equal(x, y):
                self.stats.mismatches += 1
                if not self.stats.first_mismatch:
                    diff = (x.float() - y.float()).abs().max().item()
                    self.stats.first_mismatch = f"{what} tensor {i}: max |diff| {diff:.3g}"
                    logger.error("outputs differ: %s", self.stats.first_mismatch)

    # ------------------------------------------------------------------ request life cycle
    def _try_prefill(self, run: _Running) -> bool:
        n = len(run.tokens)
        if n + 1 > self.cfg.max_context:
            raise ValueError(f"request {run.spec.rid}: context {n} exceeds max_context")
        req = self.free_req_idx.pop()
        ok = [be.alloc_prefill(req, n) for be in self.backends]
        if not all(ok):
            for be, done in zip(self.backends, ok):
                if done:
                    be.release(req)
            self.free_req_idx.append(req)
            return False
        run.req = req
        tokens = torch.tensor(run.tokens, dtype=torch.int64, device=self.device)
        results = [self.model.prefill(be, req, tokens) for be in self.backends]
        self._compare(f"prefill rid {run.spec.rid}", results[0][1], results[1][1])
        if results[0][0] != results[1][0]:
            self.stats.mismatches += 1
            self.stats.first_mismatch = self.stats.first_mismatch or f"prefill token {run.spec.rid}"
        for be in self.backends:
            be.admit(req)
        if not self.offload.has_slots(req):
            self.stats.ran_without_slots += 1
        self._account_memory()
        run.tokens.append(results[0][0])
        run.decoded += 1
        self.stats.prefills += 1
        self.stats.prefill_tokens += n
        self.stats.admitted += 1
        return True

    def _release(self, run: _Running) -> None:
        for be in self.backends:
            be.release(run.req)
        self.free_req_idx.append(run.req)
        self.stale_req = (
            run.req
        )  # a later padded row reuses this index, as a stale graph buffer does

    # ------------------------------------------------------------------ main loop
    def run(
        self,
        workload: Sequence[RequestSpec],
        max_steps: int,
        progress: Optional[Callable[[int, "Engine"], None]] = None,
    ) -> RunStats:
        """Drive ``workload`` for at most ``max_steps`` decode steps (then everything is released)."""
        t0 = time.perf_counter()
        st = self.stats
        st.requests = len(workload)
        pending = sorted(workload, key=lambda s: (s.arrival, s.rid))
        waiting: List[_Running] = []
        running: List[_Running] = []
        clock = 0
        while (pending or waiting or running) and st.decode_steps < max_steps:
            while pending and pending[0].arrival <= clock:
                s = pending.pop(0)
                gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + s.rid)
                prompt = torch.randint(0, self.cfg.vocab, (s.prompt_len,), generator=gen).tolist()
                waiting.append(_Running(s, -1, prompt))
            while waiting and len(running) < self.cfg.max_running:
                if not self._try_prefill(waiting[0]):
                    st.admission_waits += 1
                    break  # pools full: retry after something finishes
                running.append(waiting.pop(0))
            self._scripted_events(running, waiting)
            running = [r for r in running if not self._finish_if_done(r)]
            if running:
                running = self._decode_step(running, waiting)
                running = [r for r in running if not self._finish_if_done(r)]
            clock += 1
            if progress is not None:
                progress(st.decode_steps, self)
        st.unfinished = len(running) + len(waiting) + len(pending)
        for r in running:
            self._release(r)
        self._finalize(t0)
        return st

    def _scripted_events(self, running: List[_Running], waiting: List[_Running]) -> None:
        for r in list(running):
            s = r.spec
            if s.abort_after is not None and r.decoded >= s.abort_after:
                self._release(r)
                running.remove(r)
                self.stats.aborted += 1
            elif s.retract_after is not None and not r.retracted and r.decoded >= s.retract_after:
                self._retract(r, running, waiting)
                self.stats.retracted += 1

    def _retract(self, r: _Running, running: List[_Running], waiting: List[_Running]) -> None:
        """Release everything; the request re-prefills prompt + generated tokens later."""
        self._release(r)
        running.remove(r)
        r.retracted = True
        r.req = -1
        waiting.insert(0, r)

    def _finish_if_done(self, r: _Running) -> bool:
        if r.decoded < r.spec.max_new_tokens:
            return False
        self._release(r)
        self.stats.finished += 1
        return True

    def _decode_step(self, running: List[_Running], waiting: List[_Running]) -> List[_Running]:
        st, off = self.stats, self.offload
        reqs = [r.req for r in running]
        while True:
            off.before_decode(reqs, allocated=False)
            # A request whose grant could not grow with its context could overflow its slots.
            short = [
                r
                for r in running
                if off.has_slots(r.req) and off.slots(r.req) < min(self.cfg.topk, off.seq[r.req])
            ]
            if short:
                self._retract(short[-1], running, waiting)
                st.pressure_retracted += 1
            elif off.alloc_decode(reqs):
                break
            elif len(running) > 1:
                self._retract(running[-1], running, waiting)  # newest first, like SGLang
                st.pressure_retracted += 1
            else:
                raise RuntimeError("kv_offload physical pool cannot hold a single request")
            reqs = [r.req for r in running]
            if not running:
                return running
        off.before_decode(reqs, allocated=True)
        if not self.oracle.alloc_decode(reqs):
            raise RuntimeError("oracle pool too small for the workload")
        bs = len(reqs)
        pad_to = min(s for s in self.cfg.capture_sizes if s >= bs)
        st.padded_steps += pad_to > bs
        garbage = torch.randint(
            0, self.cfg.max_context, (pad_to, self.cfg.topk), generator=self.gen
        ).to(device=self.device, dtype=torch.int32)
        tokens = torch.tensor([r.tokens[-1] for r in running], device=self.device)
        off.adapter.num_real_reqs.fill_(bs)
        res = [
            self.model.decode(be, reqs, tokens, pad_to, self.stale_req, garbage)
            for be in self.backends
        ]
        self._compare(f"decode step {st.decode_steps}", res[0][1], res[1][1])
        self._compare(f"decode step {st.decode_steps} tokens", [res[0][0]], [res[1][0]])
        if int(off.coord.workspace.error_flags[0]) != 0:
            raise RuntimeError(f"plan error flags {int(off.coord.workspace.error_flags[0])}")
        for r, t in zip(running, res[0][0].tolist()):
            r.tokens.append(t)
            r.decoded += 1
        st.decode_steps += 1
        st.decoded_tokens += bs
        st.max_context = max(st.max_context, max(off.seq[q] for q in reqs))
        self._account_memory(decode=True)
        return running

    def _account_memory(self, decode: bool = False) -> None:
        """GPU KV bytes in use (page granular): offload = index keys of every logical token +
        physical rows (sparse slots, tails, prompts not yet backed up); all-on-GPU = both per token.
        """
        cfg, st = self.cfg, self.stats
        layers, row = cfg.memory_layers, cfg.row_bytes
        logical, physical, host = self.offload.used()
        off = (logical * INDEX_ROW_BYTES + physical * row) * layers
        ora = self.oracle.used_tokens() * (INDEX_ROW_BYTES + row) * layers
        st.peak_gpu_bytes_offload = max(st.peak_gpu_bytes_offload, off)
        st.peak_gpu_bytes_oracle = max(st.peak_gpu_bytes_oracle, ora)
        st.peak_host_bytes = max(st.peak_host_bytes, host * row * layers)
        if decode:
            st.sum_gpu_bytes_offload += off
            st.sum_gpu_bytes_oracle += ora

    def _finalize(self, t0: float) -> None:
        st, off, cfg = self.stats, self.offload, self.cfg
        for be in self.backends:
            be.drain()
        st.topk_entries = int(off.entries)
        st.tail_entries = int(off.tail_hits)
        st.misses = int(off.misses)
        st.backup_tokens = off.coord.stats["backup_tokens"]
        st.h2d_bytes = st.misses * cfg.row_bytes
        st.d2h_bytes = st.backup_tokens * cfg.row_bytes * cfg.memory_layers
        off.sparse.check_invariants()
        st.leak_free = (
            off.free_counts() == off.start_free
            and self.oracle.free_counts() == self.oracle.start_free
            and not off.coord.requests
            and not any(off.sparse.num_slots_cpu)
            and not off.controller.has_inflight()
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        st.wall_s = time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# Reporting and CLI
# --------------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def format_table(st: RunStats) -> str:
    """The demo's summary table (Markdown)."""
    c = st.config
    steps = max(1, st.decode_steps)
    mean_off, mean_ora = st.sum_gpu_bytes_offload / steps, st.sum_gpu_bytes_oracle / steps
    rows = [
        (
            "configuration",
            f"{c['device']}, {c['kv_dtype']} ({FP8_ROW_BYTES if c['kv_dtype'] == 'fp8' else BF16_ROW_BYTES} B rows), "
            f"{c['compute_layers']} compute / {c['memory_layers']} pool layers, top-k {c['topk']}, "
            f"{c['buffer_slots']} slots/request, {c['physical_pages'] * PAGE} physical rows",
        ),
        ("decode steps (padded graph batches)", f"{st.decode_steps} ({st.padded_steps})"),
        ("tokens decoded / prefilled", f"{st.decoded_tokens} / {st.prefill_tokens}"),
        (
            "requests",
            f"{st.requests}: admitted {st.admitted}, finished {st.finished}, "
            f"aborted {st.aborted}, retracted {st.retracted} scripted + {st.pressure_retracted} pressure, "
            f"{st.unfinished} cut off by the step limit",
        ),
        (
            "admissions without sparse slots / waits",
            f"{st.ran_without_slots} / {st.admission_waits}",
        ),
        ("longest context", str(st.max_context)),
        (
            "sparse-cache hit rate",
            f"{100 * st.hit_rate:.1f} % ({st.topk_entries - st.tail_entries - st.misses} hits, "
            f"{st.misses} misses, {st.tail_entries} tail rows)",
        ),
        ("bytes H2D (misses)", _fmt_bytes(st.h2d_bytes)),
        ("bytes D2H (backups)", _fmt_bytes(st.d2h_bytes)),
        (
            "GPU KV held, offload: mean / peak",
            f"{_fmt_bytes(mean_off)} / {_fmt_bytes(st.peak_gpu_bytes_offload)}",
        ),
        (
            "GPU KV held, all on GPU: mean / peak",
            f"{_fmt_bytes(mean_ora)} / {_fmt_bytes(st.peak_gpu_bytes_oracle)}",
        ),
        ("peak host KV held", _fmt_bytes(st.peak_host_bytes)),
        (
            "identical outputs",
            f"{'yes' if st.identical else 'NO'} ({st.compared_tensors} tensors compared"
            + (f"; first: {st.first_mismatch}" if st.first_mismatch else "")
            + ")",
        ),
        ("allocators back at start", "yes" if st.leak_free else "NO"),
        ("wall time", f"{st.wall_s:.1f} s"),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"| {'metric'.ljust(w)} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def build_parser(
    description: str = "kv_offload proof-by-decoding engine",
) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cpu", help="cpu (CI shapes) or cuda (DeepSeek-V3.2 shapes)")
    p.add_argument("--steps", type=int, default=None, help="decode steps at most")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--compute-layers", type=int, default=None)
    return p


def config_from_args(args: argparse.Namespace) -> Tuple[EngineConfig, int, int]:
    """(config, steps, requests) for the chosen device with its defaults."""
    over: Dict[str, Any] = dict(seed=args.seed, kv_dtype=args.kv_dtype)
    if args.compute_layers:
        over["compute_layers"] = args.compute_layers
    if args.device.startswith("cuda"):
        cfg = EngineConfig.cuda(device=args.device, **over)
        steps, reqs = args.steps or 400, args.requests or 12
    else:
        cfg = EngineConfig.cpu(**over)
        steps, reqs = args.steps or 240, args.requests or 9
    return cfg, steps, reqs


def run_engine(
    cfg: EngineConfig,
    steps: int,
    requests: int,
    progress: Optional[Callable[[int, Engine], None]] = None,
) -> RunStats:
    engine = Engine(cfg)
    return engine.run(make_workload(requests, steps, cfg.seed, cfg), steps, progress)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    prepare_environment(args.device)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg, steps, reqs = config_from_args(args)
    st = run_engine(cfg, steps, reqs)
    print(format_table(st))
    return 0 if st.identical and st.leak_free else 1


if __name__ == "__main__":
    sys.exit(main())
