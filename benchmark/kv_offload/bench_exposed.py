"""Exposed offload time per layer: kv offload on a DeepSeek-V3.2 decode step's critical path.

Each point builds the real pools (split NSA device pool, pinned host pool, allocator, controller,
GPU LRU, coordinator, attention adapter) for ``bs`` requests of ``ctx`` tokens whose KV is on the
host (admitted as a PD direct-to-host decode server admits them), and replays a decode step of
``--layers`` layers from one CUDA graph. Per layer, on the forward stream:

* ``compute``: a stand-in for one DeepSeek-V3.2 layer's decode work on one rank of a TP8 / EP8 node:
  the sparse attention's read of ``topk`` KV rows per request from the sparse buffer (a row gather),
  the attention projections (q_a, q_b, kv_a, o_proj; 16 heads a rank) and the MoE (the rank's 32 of
  256 experts that this batch's tokens route to, ``32 * (1 - (1 - 8/256) ** bs)`` in expectation,
  plus the shared expert), as bf16 GEMMs that read the same bytes as the fp8 weights;
* ``offload``: the same with kv offload's swap-in before the attention read (the adapter's launches:
  plan and load, exactly as ``NativeSparseAttnBackend.forward_decode`` calls it);
* ``offload+prefetch``: the same with ``prefetch_next_layer`` (each layer's top-k planned and loaded
  for the next layer on a side stream, forked and joined inside the graph);
* ``hisparse-0.5.23``: SGLang 0.5.23's HiSparse swap-in in place of ours, on the same host rows
  (``hisparse_0523/loader.py``; needs ``.gpu/sglang-0.5.23``, extracted from the carried sglang wheel
  by ``scripts/gpu_env.sh``, and apache-tvm-ffi from ``.whl``; skipped when absent).

Top-k comes from ``traces.py`` (realistic: sinks, window, drifting relevance, per-layer churn,
adjacent layers sharing most of their selection). The exposed time per layer is
``(step time - compute step time) / layers``: what offload adds to the critical path. Each variant
starts from the same cold sparse state and replays the same steps (warm-up steps not timed).

    source scripts/gpu_env.sh
    python3 benchmark/kv_offload/bench_exposed.py --out results/bench_exposed-h200.json

writes the JSON and a plot next to it (``--plot-only JSON`` redraws it). ``--timeline`` adds, per
variant, where each layer's time goes (``kernel_timeline.py``: the offload's kernels between two
layers' compute, and how much longer the compute runs beside the prefetch). ``--gemm persistent``
runs the stand-in's GEMMs as ``persistent_gemm.py``'s one-program-per-SM kernel instead of cuBLAS's.
``--prefetch-oracle`` adds the prefetch guessing the next layer's own top-k, which no server knows
in advance: the floor of any guess (``oracle_guess_adapter``). ``--speculative-indexer`` adds each oracle form
with the least a speculative indexer would add before it (``spec_indexer.py``: the next layer's
indexer logits over every request's keys, on the forward stream before each layer's swap-in), which
no guess near the oracle's can skip. ``--prefetch-green-priority0`` adds
each partition form with its stream at priority 0 (``SmPartition``'s before it took the highest).
``--compute-confined`` adds each partition form with the compute on the other SMs' green context.
With ``--gemm-carveout``, each ``--prefetch-shapes`` form is timed with the GEMMs told as well.

``--device cpu`` runs the same code eagerly under the Triton interpreter (tiny sizes; a smoke test,
no timing claims).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traces as realistic  # noqa: E402
from bench_common import (  # noqa: E402
    FP8_ROW_BYTES,
    INDEX_DIM,
    KV_LORA,
    PAGE,
    ROPE,
    prepare_environment,
    read_results,
    results_json,
)
from kernel_timeline import Kernel, layer_breakdown, profile_kernels  # noqa: E402
from persistent_gemm import fastest, padded, persistent_matmul, tune  # noqa: E402
from spec_indexer import SpeculativeIndexer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 7168
EXPERT_BYTES = 3 * HIDDEN * 2048  # gate, up, down of one routed expert, fp8
ATTN_PROJ_BYTES = (  # one rank of TP8, fp8: q_a, q_b (16 heads x 192), kv_a, o_proj (16 x 128)
    HIDDEN * 1536 + 1536 * 16 * 192 + HIDDEN * (KV_LORA + ROPE) + 16 * 128 * HIDDEN
)
LOCAL_EXPERTS, ROUTED, TOP_EXPERTS = 32, 256, 8


def moe_bytes(bs: int) -> int:
    """Expected fp8 expert bytes one EP8 rank reads for ``bs`` tokens (plus the shared expert)."""
    touched = LOCAL_EXPERTS * (1 - (1 - TOP_EXPERTS / ROUTED) ** bs)
    return int((touched + 1) * EXPERT_BYTES)


class LayerCompute:
    """The per-layer compute stand-in (see module docstring); fixed buffers, graph-capturable."""

    def __init__(
        self, bs: int, topk: int, device: torch.device, scale: float = 1.0, gemm: str = "cublas"
    ):
        cols = lambda nbytes: max(1, int(nbytes * scale) // (HIDDEN * 2))  # noqa: E731 (bf16)
        self.persistent = gemm == "persistent"  # --gemm
        # The persistent kernel's TMA descriptors need 16-byte aligned rows.
        matrix = functools.partial(
            padded if self.persistent else lambda r, c, **kw: torch.empty((r, c), **kw),
            dtype=torch.bfloat16,
            device=device,
        )
        self.x = torch.randn((bs, HIDDEN), dtype=torch.bfloat16, device=device)
        self.w_attn = matrix(HIDDEN, cols(ATTN_PROJ_BYTES)).normal_()
        self.w_moe = matrix(HIDDEN, cols(moe_bytes(bs))).normal_()
        self.y_attn = matrix(bs, self.w_attn.shape[1])
        self.y_moe = matrix(bs, self.w_moe.shape[1])
        self.read = torch.empty((bs * topk, FP8_ROW_BYTES), dtype=torch.uint8, device=device)
        # --gemm persistent: each GEMM's fastest launch shape on every SM, timed alone; ``shapes``
        # records it with its time and cuBLAS's on the same operands.
        self.launch: Dict[str, Dict[str, int]] = {}
        self.shapes: Dict[str, Dict] = {}
        if self.persistent:
            self.sms = torch.cuda.get_device_properties(device).multi_processor_count
            for name, w, y in (("attn", self.w_attn, self.y_attn), ("moe", self.w_moe, self.y_moe)):
                self.launch[name], ms = min(tune(self.x, w, y, self.sms), key=fastest)
                dense = torch.empty(y.shape, dtype=y.dtype, device=device)
                cublas_ms = triton.testing.do_bench(lambda: torch.matmul(self.x, w, out=dense))
                self.shapes[name] = dict(self.launch[name], ms=ms, cublas_ms=cublas_ms)
        # SMs each GEMM leaves free (--gemm-carveout), set around a variant's capture.
        self.carveout: Dict[str, Optional[int]] = dict(attn=None, moe=None)

    def _matmul(self, name: str, w: torch.Tensor, out: torch.Tensor, carve: Optional[int]) -> None:
        if self.persistent:
            persistent_matmul(self.x, w, out, self.sms - (carve or 0), **self.launch[name])
            return
        with gemm_carveout(carve):
            torch.matmul(self.x, w, out=out)

    def __call__(self, kv_rows: torch.Tensor, rows: torch.Tensor) -> None:
        # The attention read: every selected row of this layer (padding -1 clamps to row 0).
        torch.index_select(kv_rows, 0, rows.reshape(-1).clamp_min(0), out=self.read)
        self._matmul("attn", self.w_attn, self.y_attn, self.carveout["attn"])
        self._matmul("moe", self.w_moe, self.y_moe, self.carveout["moe"])


class HiSparseLayers:
    """SGLang 0.5.23's HiSparse swap-in per layer, on the same host rows, called as its coordinator
    calls it (``hisparse_0523/loader.py``: its kernel built from that release, block size 960).

    Its state per layer: the hot buffer's token table, device rows and LRU (``hot`` slots plus one
    page for the newest tokens), and the request's position -> host slot table, which here is the
    kv offload host pool's (``loc_to_host`` through ``req_to_token``) so both read the same rows.
    """

    def __init__(self, point: "Point", swap_in, slots: int, topk: int):
        bs, ctx, dev = point.bs, point.ctx, point.device
        self.point, self.swap_in, self.slots, self.topk = point, swap_in, slots, topk
        locs = point.r2t.req_to_token[:bs, :ctx].long()
        self.host_locs = point.alloc.loc_to_host[locs].contiguous()
        width = slots + PAGE
        rows = bs * width + PAGE
        self.device_rows = [
            torch.zeros((rows, 1, FP8_ROW_BYTES), dtype=torch.uint8, device=dev)
            for _ in range(point.layers)
        ]
        base = (torch.arange(bs * width, dtype=torch.int32, device=dev) + PAGE).view(bs, width)
        self.buffer_locs = [base.clone() for _ in range(point.layers)]
        self.tokens = [torch.full_like(base, -1) for _ in range(point.layers)]
        self.lru = [
            torch.arange(slots, dtype=torch.int16, device=dev).repeat(bs, 1).contiguous()
            for _ in range(point.layers)
        ]
        self.cold = [t.clone() for t in self.tokens + self.lru]
        self.rpi = torch.arange(bs, dtype=torch.int64, device=dev)
        self.seq = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        self.num_real = torch.tensor([bs], dtype=torch.int32, device=dev)
        self.out = torch.full((bs, topk), -1, dtype=torch.int32, device=dev)

    def reset(self) -> None:
        for t, c in zip(self.tokens + self.lru, self.cold):
            t.copy_(c)

    def __call__(self, topk: torch.Tensor, layer: int) -> torch.Tensor:
        host = self.point.host.host_row_view(layer).view(-1, 1, FP8_ROW_BYTES)
        self.swap_in(
            top_k_tokens=topk,
            device_buffer_tokens=self.tokens[layer],
            host_cache_locs=self.host_locs,
            device_buffer_locs=self.buffer_locs[layer],
            host_cache=host,
            device_buffer=self.device_rows[layer],
            top_k_device_locs=self.out,
            req_pool_indices=self.rpi,
            seq_lens=self.seq,
            lru_slots=self.lru[layer],
            item_size_bytes=FP8_ROW_BYTES,
            num_top_k=self.topk,
            hot_buffer_size=self.slots,
            page_size=1,
            num_real_reqs=self.num_real,
        )
        return self.out


def launch_shape(text: str, sms: int, base):
    """``programs per SM[:rows per tile[:warps]]`` on ``sms`` SMs as a copy launch config; the
    fields left out keep ``base``'s."""
    per_sm, rows, warps = (text.split(":") + ["", ""])[:3]
    return dataclasses.replace(
        base,
        num_programs=max(1, round(float(per_sm) * sms)),
        rows_per_program=int(rows or base.rows_per_program),
        num_warps=int(warps or base.num_warps),
    )


@contextlib.contextmanager
def plan_launch(shape: str):
    """The adapter's plan kernels launched with ``warps`` warps inside ('': unchanged)."""
    from sglang.srt.layers.attention.dsa_offload import adapter
    from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import plan_layer

    if not shape:
        yield
        return
    adapter.plan_layer = functools.partial(plan_layer, num_warps=int(shape))
    try:
        yield
    finally:
        adapter.plan_layer = plan_layer


@contextlib.contextmanager
def gemm_carveout(sms: Optional[int]):
    """GEMMs issued inside (and so captured) go through cuBLASLt targeting ``sms`` SMs fewer than
    the device has (torch's SM carveout, which only its cuBLASLt path reads); ``None``: unchanged.
    """
    if sms is None:
        yield
        return
    library = torch.backends.cuda.preferred_blas_library()
    before = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(library)


def oracle_guess_adapter(topk: torch.Tensor, coordinator, offset: int = 0, **adapter_args):
    """A bench-only adapter whose prefetch of layer L+1 plans layer L+1's own top-k (the replayed
    trace holds it before that layer's indexer would run) instead of layer L's: it loads exactly
    the next layer's misses, so its exposed time is the floor any guess could reach with this
    overlap (``--prefetch-oracle``). Not a guess a server could make. With ``offset`` it plans
    ``topk[offset + L + 1]`` instead: a guess of known accuracy (``mixed_guess``)."""
    from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter

    class OracleGuessAdapter(DSAOffloadAdapter):
        def _prefetch(self, req_pool_indices, guess, layer_id):
            own = topk[offset + layer_id, : guess.shape[0]]
            super()._prefetch(req_pool_indices, own, layer_id)

    return OracleGuessAdapter(coordinator, **adapter_args)


def mixed_guess(trace: torch.Tensor, catch: float, seed: int) -> torch.Tensor:
    """Per step and layer L+1, a guess of its top-k that keeps a random ``catch`` of its entries
    and fills the rest with layer L's entries outside it (then -1): what a speculative indexer
    right on ``catch`` of its selection would prefetch, wrong guesses included (``--oracle-catch``).
    Rows stay unique; layer 0's guess is its own top-k (no layer guesses it)."""
    g = torch.Generator(device=trace.device).manual_seed(seed)
    own, alt = trace[:, 1:], trace[:, :-1].contiguous()
    drop = torch.rand(own.shape, generator=g, device=trace.device) >= catch
    # Membership of each alt entry in its own row: a search of the sorted row (rows are unique).
    sorted_own = own.sort(dim=-1).values
    at = torch.searchsorted(sorted_own, alt).clamp_max(own.shape[-1] - 1)
    outside = sorted_own.gather(-1, at) != alt
    order = torch.sort((~outside).to(torch.int8), dim=-1, stable=True).indices
    # Layer L's entries outside L+1's first (stable), then the rest as -1.
    fill = torch.where(outside.gather(-1, order), alt.gather(-1, order), -1)
    rank = drop.to(torch.int64).cumsum(-1) - 1
    picked = fill.gather(-1, rank.clamp(0, fill.shape[-1] - 1))
    return torch.cat([trace[:, :1], torch.where(drop, picked, own)], dim=1)


def load_hisparse(src: str):
    """0.5.23's swap-in (block size 960), or None with the reason printed."""
    if not Path(src).is_dir():
        print(f"[skip] HiSparse 0.5.23: no sources at {src} (source scripts/gpu_env.sh)")
        return None
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "hisparse_0523"))
        from loader import load_swap_in

        return load_swap_in(src)
    except Exception as e:  # noqa: BLE001
        print(f"[skip] HiSparse 0.5.23 not loadable ({type(e).__name__}: {e})")
        return None


class Point:
    """Real kv offload pools and coordinators for ``bs`` requests of ``ctx`` tokens on the host."""

    def __init__(self, a, bs: int, ctx: int, device: torch.device):
        from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
        from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
            KVOffloadDSATokenToKVPool,
            KVOffloadTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
        from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

        self.bs, self.ctx, self.layers, self.device = bs, ctx, a.layers, device
        logical = bs * ctx
        physical = bs * (a.slots + 2 * PAGE) + PAGE
        self.pool = KVOffloadDSATokenToKVPool(
            physical_size=physical,
            logical_size=logical,
            page_size=PAGE,
            kv_lora_rank=KV_LORA,
            dtype=torch.float8_e4m3fn,
            qk_rope_head_dim=ROPE,
            layer_num=a.layers,
            device=str(device),
            index_head_dim=INDEX_DIM,
            enable_memory_saver=False,
            kv_cache_dim=FP8_ROW_BYTES,
        )
        self.alloc = KVOffloadTokenToKVPoolAllocator(
            logical, physical, PAGE, torch.float8_e4m3fn, str(device), self.pool, False
        )
        t0 = time.time()
        self.host = KVOffloadHostPool(self.pool, host_pool_ratio=1.0)
        self._fill_host(a.seed)
        self.host_s = time.time() - t0
        controller = KVOffloadCacheController(self.alloc, self.host)
        self.r2t = ReqToTokenPool(bs, ctx + PAGE, str(device), False)
        self.sparse = SparseCacheState(
            num_layers=a.layers,
            num_logical_locs=self.alloc.full_to_hisparse_device_index_mapping.numel(),
            max_reqs=bs,
            buffer_slots=a.slots,
            topk=a.topk,
            allocator=self.alloc.hisparse_attn_allocator,
            device=device,
        )
        self.adapters = {}
        for prefetch in (False, True):
            coord = KVOffloadCoordinator(
                self.r2t.req_to_token,
                self.alloc,
                controller,
                self.sparse,
                max_bs=bs,
                prefetch_next_layer=prefetch,
            )
            self.adapters[prefetch] = DSAOffloadAdapter(coord, a.prefetch_stream_priority)
        admitting = self.adapters[False].coordinator
        for r in range(bs):
            locs = self.alloc.alloc_extend_to_host(ctx)
            assert locs is not None, "host pool too small for the point"
            self.r2t.req_to_token[r, :ctx] = locs.to(torch.int32)
            admitting.admit_from_host(r, ctx)
        for adapter in self.adapters.values():
            adapter.num_real_reqs.fill_(bs)
        self.cold = [
            t.clone() for t in (self.sparse.loc_to_slot, self.sparse.slot_loc, self.sparse.lru)
        ]

    def _fill_host(self, seed: int) -> None:
        """Random rows (a repeated 64 MB tile: the bytes moved do not depend on their values)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for layer in range(self.layers):
            view = self.host.host_row_view(layer)
            tile_rows = min(view.shape[0], (64 << 20) // view.shape[1])
            tile = torch.randint(
                0,
                256,
                (tile_rows, view.shape[1]),
                dtype=torch.uint8,
                device=self.device,
                generator=g,
            )
            for i in range(0, view.shape[0], tile_rows):
                n = min(tile_rows, view.shape[0] - i)
                view[i : i + n].copy_(tile[:n])

    def reset(self) -> None:
        for t, c in zip(
            (self.sparse.loc_to_slot, self.sparse.slot_loc, self.sparse.lru), self.cold
        ):
            t.copy_(c)

    @staticmethod
    def stats(coord) -> List[int]:
        main = coord.workspace.stats.tolist()
        ws = coord.prefetch_workspace
        return main + (ws.stats.tolist() if ws is not None else [0] * len(main))


def verify_rows(
    point: Point,
    adapter,
    graph: "torch.cuda.CUDAGraph",
    trace: torch.Tensor,
    topk: torch.Tensor,
    eager_steps: int,
) -> bool:
    """Replay the trace again from the cold state, the last ``eager_steps`` steps eagerly, and
    check that every row each layer resolved holds its token's host row when attention would read
    it (a snapshot on the forward stream right after the layer's swap-in, so the prefetch of the
    next layer still runs beside what follows)."""
    point.reset()
    steps = trace.shape[0]
    rpi = torch.arange(point.bs, dtype=torch.int64, device=point.device)
    seq = torch.full((point.bs,), point.ctx, dtype=torch.int64, device=point.device)
    exact = True
    for t in range(steps):
        topk.copy_(trace[t])
        if t < steps - eager_steps:
            graph.replay()
            continue
        seen = []
        for layer in range(point.layers):
            rows = adapter.swap_in_selected_pages(rpi, seq, topk[layer], layer)
            seen.append(point.pool.device_row_view(layer)[rows.clamp_min(0).long()])
        torch.cuda.synchronize()
        for layer, got in enumerate(seen):
            pos = topk[layer].long()
            valid = pos >= 0
            locs = point.r2t.req_to_token[rpi[:, None], pos.clamp_min(0)].long()
            host = point.alloc.loc_to_host[locs].cpu()
            truth = point.host.host_row_view(layer)[host.view(-1)].view(got.shape)
            exact &= bool((got == truth.to(got.device))[valid].all())
    return exact


def run_point(a, bs: int, ctx: int, device: torch.device, hisparse_fn=None) -> Dict:
    point = Point(a, bs, ctx, device)
    steps = a.warm + a.steps
    cfg = realistic.TraceConfig.for_topk(
        a.topk,
        batch=bs,
        context=ctx,
        layers=a.layers,
        steps=steps,
        churn=a.churn,
        share=a.share,
        seed=a.seed,
    )
    trace = realistic.generate(cfg, device=device)  # (steps, layers, bs, topk) positions
    trace_stats = realistic.measure(trace[:, :, :1])
    # --oracle-catch: guesses of known accuracy, replayed as more layers of the trace.
    catches = {f"+guess{round(c * 100)}": c for c in a.oracle_catch}
    offsets = {form: a.layers * (i + 1) for i, form in enumerate(catches)}
    trace = torch.cat([trace] + [mixed_guess(trace, c, a.seed) for c in catches.values()], dim=1)
    compute = LayerCompute(bs, a.topk, device, a.compute_scale, a.gemm)
    topk = torch.full(trace.shape[1:], -1, dtype=torch.int32, device=device)
    rpi = torch.arange(bs, dtype=torch.int64, device=device)
    seq = torch.full((bs,), ctx, dtype=torch.int64, device=device)
    static_rows = torch.arange(bs * a.topk, device=device).remainder(point.pool.physical_size - 1)
    static_rows = (static_rows + 1).view(bs, a.topk).to(torch.int32)

    # --speculative-indexer: the next layer's indexer logits before each layer's swap-in.
    spec = None
    oracle_forms = ["+oracle"]
    if a.speculative_indexer:
        spec = SpeculativeIndexer(point.pool, point.r2t.req_to_token, bs, ctx, a.seed)
        oracle_forms.append("+oracle+specidx")
        oracle_forms += [form + "+specidx" for form in catches]

    hisparse = None
    if hisparse_fn is not None:
        hisparse = HiSparseLayers(point, hisparse_fn, a.slots, a.topk)

    # --compute-confined: variant -> the stream of the SMs outside its partition, which runs the
    # layer's compute (forked from the forward stream and joined back, inside the graph).
    confined: Dict[str, torch.cuda.Stream] = {}

    def layer_compute(variant: str, kv_rows: torch.Tensor, rows: torch.Tensor) -> None:
        stream = confined.get(variant)
        if stream is None:
            compute(kv_rows, rows)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compute(kv_rows, rows)
        torch.cuda.current_stream().wait_stream(stream)

    def step(variant: str) -> None:
        for layer in range(a.layers):
            kv_rows = point.pool.device_row_view(layer)
            if variant.startswith("compute"):
                layer_compute(variant, kv_rows, static_rows)
                continue
            if variant == "hisparse-0.5.23":
                rows = hisparse(topk[layer], layer)
                compute(hisparse.device_rows[layer].view(-1, FP8_ROW_BYTES), rows)
                continue
            if "+specidx" in variant and layer + 1 < a.layers:
                spec(layer + 1)  # forks of the prefetch below are ordered after it
            rows = adapters[variant].swap_in_selected_pages(rpi, seq, topk[layer], layer)
            layer_compute(variant, kv_rows, rows)

    out: Dict = dict(
        bs=bs,
        ctx=ctx,
        layers=a.layers,
        topk=a.topk,
        slots=a.slots,
        row_bytes=FP8_ROW_BYTES,
        host_gb=point.host.size * point.host.size_per_token / 1e9,
        host_fill_s=round(point.host_s, 1),
        compute_gb_per_layer=(ATTN_PROJ_BYTES + moe_bytes(bs)) * a.compute_scale / 1e9,
        trace_stats=trace_stats,
    )
    if compute.shapes:
        out["gemm_shapes"] = compute.shapes
    if spec is not None:
        out["speculative_indexer"] = dict(key_mb_per_layer=spec.key_bytes / 1e6)
        if spec.ms is not None:  # timed as its launch was picked
            out["speculative_indexer"].update(
                ms_alone=spec.ms, gb_per_s=spec.key_bytes / spec.ms / 1e6, launch=spec.launch
            )
    controller = point.adapters[True].coordinator.controller
    default_prefetch = controller.prefetch_load_config
    sweep = [f"offload+prefetch@{n}" for n in a.prefetch_programs_per_sm]
    adapters = {"offload": point.adapters[False]}
    adapters.update({v: point.adapters[True] for v in ("offload+prefetch", *sweep)})

    def guess_offset(name: str) -> int:
        return next((offsets[form] for form in offsets if form + "+" in name + "+"), 0)

    for form in oracle_forms if a.prefetch_oracle else []:
        sweep.append("offload+prefetch" + form)
        adapters[sweep[-1]] = oracle_guess_adapter(
            topk,
            point.adapters[True].coordinator,
            guess_offset(form),
            prefetch_stream_priority=a.prefetch_stream_priority,
        )
        adapters[sweep[-1]].num_real_reqs.fill_(bs)
    green: List[str] = []
    carveouts: Dict[str, int] = {}  # variant -> SMs its GEMMs leave free (--gemm-carveout)
    for n in a.prefetch_green_sms:
        # The prefetch's load on a green context of n SMs (the miss load's grid), the rest on all.
        from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
        from sglang.srt.mem_cache.sparsity.kv_offload.sm_partition import SmPartition

        variant = f"offload+prefetch@green{n}"
        try:
            part = SmPartition(n, device, with_remainder=a.compute_confined)
        except Exception as e:  # noqa: BLE001 (recorded; the other variants still run)
            out[variant] = dict(error=f"{type(e).__name__}: {e}")
            continue
        forms = [(variant, False)] + [(f"{variant}@{shape}", False) for shape in a.prefetch_shapes]
        if a.prefetch_serial:
            forms.append((variant + "+serial", True))
        forms += [(f"{variant}+plan{shape}", False) for shape in a.plan_shapes]
        if a.prefetch_oracle:
            forms += [(variant + form, False) for form in oracle_forms]
        if a.gemm_carveout:
            # The GEMMs told to leave the partition's SMs (as SGLang's overlap modes size
            # DeepGEMM's), and the compute alone so told, which is what that costs it.
            carved_forms = [variant + "+carveout"]
            carved_forms += [f"{variant}@{shape}+carveout" for shape in a.prefetch_shapes]
            if a.prefetch_oracle:
                carved_forms += [variant + "+carveout" + form for form in oracle_forms]
            forms += [(name, False) for name in carved_forms]
            carveouts[f"compute+carveout{n}"] = part.sms
            if a.gemm == "cublas":
                carveouts["compute+cublaslt"] = 0  # the library change alone
        streams = {"": part.stream}
        if a.prefetch_green_priority0:  # each form again with the partition's stream at priority 0
            streams["+prio0"] = SmPartition(n, device, priority=0).stream
        if a.compute_confined:  # each form again with the compute on the other SMs' green context
            streams["+confined"] = part.stream
            confined[f"compute+confined{n}"] = part.rest_stream
            carveouts[f"compute+confined{n}"] = part.sms
        coordinator = point.adapters[True].coordinator
        for suffix, stream in streams.items():
            for form, serial in forms:
                name = form + suffix
                if "+carveout" in name or suffix == "+confined":  # a persistent grid of the rest
                    carveouts[name] = part.sms
                if suffix == "+confined":
                    confined[name] = part.rest_stream
                if "+oracle" in name or "+guess" in name:
                    adapters[name] = oracle_guess_adapter(
                        topk, coordinator, guess_offset(name), prefetch_stream=stream
                    )
                else:
                    adapters[name] = DSAOffloadAdapter(coordinator, prefetch_stream=stream)
                adapters[name].num_real_reqs.fill_(bs)
                if serial:  # the form before the next layer's load ran beside the prefetch's
                    adapters[name]._overlaps_prefetch_load = False
                green.append(name)
    theirs = ["hisparse-0.5.23"] if hisparse is not None else []
    carved = [v for v in carveouts if v.startswith("compute")]
    kernels: Dict[str, List[Kernel]] = {}  # --timeline: the profiled step's kernels per variant
    # Green-context variants last: a capture that fails there leaves the others measured.
    for variant in ("compute", *carved, "offload", "offload+prefetch", *sweep, *theirs, *green):
        point.reset()
        if hisparse is not None:
            hisparse.reset()
        controller.prefetch_load_config = default_prefetch
        if "@green" in variant:
            sms, _, shape = variant.partition("@green")[2].partition("@")
            shape = shape.partition("+")[0]  # the shape, without a form's suffixes
            load = controller.load_config
            partition_sms = int(sms.partition("+")[0])
            controller.prefetch_load_config = (
                launch_shape(shape, partition_sms, load) if shape else load
            )
        elif "@" in variant and device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            controller.prefetch_load_config = launch_shape(
                variant.split("@")[1], sms, default_prefetch
            )
        times, graph = [], None
        cuda = device.type == "cuda"
        if cuda:
            try:
                topk.copy_(trace[0])
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                carve = carveouts.get(variant)
                both = a.gemm_carveout == "all" or variant in confined
                compute.carveout = dict(attn=carve if both else None, moe=carve)
                plan_shape = variant.partition("+plan")[2]
                with torch.cuda.stream(side), plan_launch(plan_shape):
                    step(variant)  # compile and warm outside the capture
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                point.reset()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph), plan_launch(plan_shape):
                    step(variant)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                if variant not in green:
                    raise
                out[variant] = dict(error=f"{type(e).__name__}: {e}")
                continue
            finally:  # the captured graph keeps its grids; later captures choose their own
                compute.carveout = dict(attn=None, moe=None)
            point.reset()
            if hisparse is not None:
                hisparse.reset()
        coord = adapters.get(variant, point.adapters[False]).coordinator
        # With --timeline the last step is replayed under the profiler, outside the timing.
        timed_end = steps - 1 if cuda and a.timeline else steps
        before = after = None
        for t in range(steps):
            topk.copy_(trace[t])
            if t == a.warm:
                before = point.stats(coord)
            if t == timed_end:
                after = point.stats(coord)
                kernels[variant] = profile_kernels(graph.replay)
                continue
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True
                )
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step(variant)
                elapsed = (time.perf_counter() - t0) * 1e3
            if t >= a.warm:
                times.append(elapsed)
        after = after or point.stats(coord)
        delta = [x - y for x, y in zip(after, before)]
        exact = None
        if cuda and variant.startswith("offload") and a.verify_steps:
            exact = verify_rows(point, adapters[variant], graph, trace, topk, a.verify_steps)
        ms = statistics.median(times)
        entry = dict(step_ms=ms, ms_per_layer=ms / a.layers)
        if variant.startswith("offload"):
            selected, hits, tail, loaded, _, _, _, pre_loaded = delta
            flags = int(coord.workspace.error_flags[0])
            if coord.prefetch_workspace is not None:
                flags |= int(coord.prefetch_workspace.error_flags[0])
            assert flags == 0, f"plan error flags {flags} in {variant}"
            per = (timed_end - a.warm) * a.layers
            assert exact is not False, f"{variant} resolved a row to the wrong KV"
            entry.update(
                rows_exact=exact,
                hit_rate=hits / max(1, selected),
                loaded_rows_per_layer=loaded / per,
                prefetched_rows_per_layer=pre_loaded / per,
                loaded_mb_per_layer=loaded * FP8_ROW_BYTES / per / 1e6,
            )
        if variant in kernels:
            ks = kernels[variant]
            entry["timeline"] = layer_breakdown(
                ks,
                # A carveout can pick other GEMM kernels.
                compute_names={k.name for v in ("compute", *carved) for k in kernels.get(v, [])},
                read_name=kernels["compute"][0].name,
                copy_tag="copy_rows",
                compute_alone_ms=out.get("compute", {}).get("timeline", {}).get("compute_ms"),
            )
            entry["kernels"] = [
                [
                    k.name[:80],
                    k.stream,
                    round(k.start - ks[0].start, 2),
                    round(k.end - ks[0].start, 2),
                    list(k.grid),
                    list(k.block),
                    k.registers,
                    k.shared_memory,
                ]
                for k in ks
            ]
        out[variant] = entry
    base = out["compute"]["ms_per_layer"]
    for variant in ("offload", "offload+prefetch", *sweep, *theirs, *green):
        if "ms_per_layer" in out[variant]:
            out[variant]["exposed_ms_per_layer"] = out[variant]["ms_per_layer"] - base
    if hisparse is not None:
        ours, hs = out["offload"]["exposed_ms_per_layer"], out["hisparse-0.5.23"]
        hs["exposed_vs_ours"] = hs["exposed_ms_per_layer"] / max(ours, 1e-9)
    out["prefetch_programs"] = default_prefetch.num_programs
    return out


def plot(rows: List[Dict], path: Path) -> None:
    """Exposed ms per layer by batch size, one panel per context: ours, ours + prefetch, HiSparse."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[skip] matplotlib not importable: no plot")
        return
    contexts = sorted({r["ctx"] for r in rows})
    # The legend goes beside the last panel: 4.5 inches more.
    width_in = 6.5 * len(contexts) + 4.5
    fig, axes = plt.subplots(1, len(contexts), figsize=(width_in, 4.2), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    series = [
        ("offload", "kv offload"),
        ("offload+prefetch", "kv offload + prefetch"),
        ("offload+prefetch+oracle", "kv offload + prefetch, oracle guess (floor)"),
        (
            "offload+prefetch+oracle+specidx",
            "kv offload + prefetch, oracle guess + speculative indexer logits",
        ),
        ("hisparse-0.5.23", "HiSparse 0.5.23"),
    ]

    def green_sms(key: str) -> int:
        return int(re.match(r"\d+", key.rpartition("green")[2]).group())

    green = sorted(
        {k for r in rows for k, v in r.items() if "@green" in k and "exposed_ms_per_layer" in v},
        key=lambda k: (green_sms(k), k),
    )

    def green_label(key: str) -> str:
        forms = (
            ("+fullplan", "plan on all"),  # recorded before the plan left the partition (e765ffc)
            ("+serial", "next layer waits for all of it"),
            (
                "+carveout+oracle+specidx",
                "GEMMs told to leave those SMs, oracle guess + speculative indexer logits",
            ),
            ("+carveout+oracle", "GEMMs told to leave those SMs, oracle guess (floor)"),
            ("+oracle+specidx", "oracle guess + speculative indexer logits"),
            ("+oracle", "oracle guess: the next layer's own top-k (floor)"),
            ("+carveout", "GEMMs told to leave those SMs"),
            # Reverted guesses (14556ee, b3a8c0f); kept to redraw their results.
            ("+twolayers", "two-layer guess"),
            ("+union", "guess of two layers' top-k"),
        )
        text = next((text for tag, text in forms if tag in key), None)
        catch = re.search(r"\+guess(\d+)", key)
        if catch:
            text = f"guess catching {catch.group(1)} % of the oracle's + speculative indexer logits"
            if "+carveout" in key:
                text = "GEMMs told to leave those SMs, " + text
        where = f"prefetch load on {green_sms(key)} SMs"
        if "+prio0" in key:
            where += " at priority 0"
        if "+confined" in key:
            where += ", compute on the other SMs"
        shape = key.rpartition("green")[2].partition("@")[2]
        if shape:
            where += " ({} programs/SM x {} rows x {} warps)".format(*shape.split(":"))
        return f"{where}, {text}" if text else f"{where} (green context)"

    series += [(k, green_label(k)) for k in green]
    series = [(k, label) for k, label in series if all(k in r for r in rows)]
    width = 0.8 / len(series)
    for ax, ctx in zip(axes[0], contexts):
        points = [r for r in rows if r["ctx"] == ctx]
        x = range(len(points))
        for i, (key, label) in enumerate(series):
            ax.bar(
                [j + (i - (len(series) - 1) / 2) * width for j in x],
                [r[key]["exposed_ms_per_layer"] for r in points],
                width,
                label=label,
                color=colors[i % len(colors)],
            )
        ax.plot(
            list(x),
            [r["compute"]["ms_per_layer"] for r in points],
            "k.--",
            label="layer compute (stand-in)",
        )
        ax.set_xticks(list(x), [f"bs {r['bs']}" for r in points])
        ax.set_ylabel("ms per layer")
        ax.set_title(f"Exposed offload time per layer, ctx {ctx // 1024}K")
    # Beside the last panel, so that no bar is hidden behind it.
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"[plot] {path}")


def comma_list(text: str) -> List[str]:
    """``a,b,c`` -> ``["a", "b", "c"]`` (empty items dropped)."""
    return [x for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", default="1,8,32,64,128")
    p.add_argument("--ctx", default="32768,131072")
    p.add_argument("--max-tokens", type=int, default=4 << 20, help="skip points with more bs*ctx")
    p.add_argument("--layers", type=int, default=8, help="layers in the replayed step")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--slots", type=int, default=4096, help="sparse_slots_per_req")
    p.add_argument("--churn", type=float, default=0.4, help="mean top-k churn per step")
    p.add_argument("--share", type=float, default=0.97, help="adjacent-layer relevance correlation")
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--prefetch-programs-per-sm",
        type=comma_list,
        default=[],
        help="also time the prefetch load on its ordinary stream with these grids: programs per "
        "SM[:rows per tile[:warps]], e.g. 0.25,1,1:8,1:4:1",
    )
    p.add_argument(
        "--prefetch-green-sms",
        type=lambda text: [int(x) for x in comma_list(text)],
        default=[],
        help="also time the prefetch with its load on a green context of this many SMs (CUDA; "
        "its plan on every SM, as prefetch_sms runs it), e.g. 8,16",
    )
    p.add_argument(
        "--prefetch-shapes",
        type=comma_list,
        default=[],
        help="also time each --prefetch-green-sms variant with these load shapes instead of the "
        "miss load's: programs per partition SM:rows per tile:warps, e.g. 2:16:4,8:4:4",
    )
    p.add_argument(
        "--gemm-carveout",
        choices=("all", "moe"),
        help="also time each --prefetch-green-sms variant with the compute's GEMMs (all, or the "
        "MoE GEMM only) targeting the SMs outside the partition, beside the compute alone so "
        "targeted (CUDA): cuBLAS through torch's SM carveout, --gemm persistent by its grid",
    )
    p.add_argument(
        "--gemm",
        choices=("cublas", "persistent"),
        default="cublas",
        help="the compute stand-in's GEMMs: torch's (cuBLAS: one block per output tile, in "
        "waves) or persistent_gemm.py's (a grid of one program per SM looping over the tiles, "
        "as DeepGEMM's; CUDA)",
    )
    p.add_argument(
        "--plan-shapes",
        type=comma_list,
        default=[],
        help="also time each --prefetch-green-sms variant with its plan kernels (the next layer's "
        "and the prefetch's) launched with these warps, e.g. 4,16",
    )
    p.add_argument(
        "--prefetch-oracle",
        action="store_true",
        help="also time the prefetch (on its ordinary stream and on each --prefetch-green-sms "
        "partition, with and without --gemm-carveout) guessing the next layer's own top-k: the "
        "floor of any guess (bench-only; a server cannot know it in advance)",
    )
    p.add_argument(
        "--speculative-indexer",
        action="store_true",
        help="with --prefetch-oracle: also time each oracle form with the next layer's indexer "
        "logits over every request's keys before each layer's swap-in (spec_indexer.py: the "
        "least work a speculative indexer, the guess that could approach the oracle's, adds)",
    )
    p.add_argument(
        "--oracle-catch",
        type=lambda text: [float(x) for x in comma_list(text)],
        default=[],
        help="with --speculative-indexer: also time the oracle forms with guesses that catch only "
        "this share of the next layer's top-k, the rest filled from layer L's (mixed_guess), e.g. "
        "0.9,0.95",
    )
    p.add_argument(
        "--prefetch-green-priority0",
        action="store_true",
        help="also time each --prefetch-green-sms form with the partition's stream at CUDA "
        "priority 0 instead of the device's highest (SmPartition's default since this option)",
    )
    p.add_argument(
        "--compute-confined",
        action="store_true",
        help="also time each --prefetch-green-sms form with the layer's compute on a green "
        "context of the other SMs (bench-only: a server's forward keeps every SM), beside the "
        "compute alone so confined",
    )
    p.add_argument(
        "--prefetch-serial",
        action="store_true",
        help="also time each --prefetch-green-sms variant with the next layer's plan waiting for "
        "the whole prefetch (the form before its load ran beside the prefetch's load)",
    )
    p.add_argument(
        "--verify-steps",
        type=int,
        default=2,
        help="after timing, replay the last N steps of each kv offload variant eagerly and check "
        "every resolved row against the host (CUDA; 0: skip)",
    )
    p.add_argument(
        "--prefetch-stream-priority",
        type=int,
        default=None,
        help="CUDA priority of the prefetch side stream (default: the adapter's, the highest)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="replay each variant's last step under torch.profiler (untimed) and record where "
        "its time goes per layer (kernel_timeline.py; CUDA)",
    )
    p.add_argument("--compute-scale", type=float, default=1.0, help="scale the compute stand-in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hisparse-src",
        default=os.environ.get("HISPARSE_0523_SRC", str(ROOT / ".gpu" / "sglang-0.5.23")),
        help="SGLang 0.5.23 sources for its HiSparse kernel (skipped when absent)",
    )
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_exposed.json"))
    p.add_argument("--plot-only", metavar="JSON", help="only draw the plot of a results file")
    a = p.parse_args()
    if a.gemm == "persistent" and a.device != "cuda":
        p.error("--gemm persistent needs --device cuda (its kernel is timed, not interpreted)")
    if a.speculative_indexer and not a.prefetch_oracle:
        p.error("--speculative-indexer times the oracle forms: add --prefetch-oracle")
    if a.oracle_catch and not a.speculative_indexer:
        p.error(
            "--oracle-catch times guesses a speculative indexer makes: add --speculative-indexer"
        )
    if any(not 0 <= c < 1 for c in a.oracle_catch):
        p.error(f"--oracle-catch {a.oracle_catch}: shares in [0, 1) (1 is --prefetch-oracle)")
    if a.plot_only:
        plot(
            read_results(a.plot_only)["rows"],
            Path(a.plot_only.removesuffix(".gz")).with_suffix(".png"),
        )
        return
    prepare_environment(a.device)
    device = torch.device(a.device)
    hisparse_fn = load_hisparse(a.hisparse_src) if device.type == "cuda" else None
    rows: List[Dict] = []
    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        args=vars(a),
        torch=torch.__version__,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for ctx in (int(x) for x in a.ctx.split(",")):
        for bs in (int(x) for x in a.bs.split(",")):
            if bs * ctx > a.max_tokens:
                print(f"[skip] bs {bs} x ctx {ctx} > --max-tokens {a.max_tokens}", flush=True)
                continue
            r = run_point(a, bs, ctx, device, hisparse_fn)
            if device.type == "cuda":  # the point's pools are gone with run_point's frame
                torch.cuda.empty_cache()
            rows.append(r)
            Path(a.out).write_text(results_json(dict(meta=meta, rows=rows)))  # per point
            c, o, f = r["compute"], r["offload"], r["offload+prefetch"]
            print(
                f"bs {bs:4d} ctx {ctx:7d}: compute {c['ms_per_layer']:.3f} ms/layer; exposed "
                f"offload {o['exposed_ms_per_layer']:.3f}, with prefetch "
                f"{f['exposed_ms_per_layer']:.3f} ms/layer; critical-path rows/layer "
                f"{o['loaded_rows_per_layer']:.0f} -> {f['loaded_rows_per_layer']:.0f} "
                f"(+{f['prefetched_rows_per_layer']:.0f} prefetched); hit {o['hit_rate']:.3f}"
                f" / {f['hit_rate']:.3f}"
                + "".join(
                    f"; {k.partition('+')[2]} {v.get('exposed_ms_per_layer', v.get('error'))}"
                    for k, v in r.items()
                    if k.startswith("offload+prefetch@")
                )
                + (
                    f"; HiSparse 0.5.23 {r['hisparse-0.5.23']['exposed_ms_per_layer']:.3f}"
                    if "hisparse-0.5.23" in r
                    else ""
                ),
                flush=True,
            )
            for name, v in r.items():
                if isinstance(v, dict) and "timeline" in v:
                    print(f"  {name}: {json.dumps(v['timeline'])}", flush=True)
    print(f"wrote {a.out}")
    plot(rows, Path(a.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
