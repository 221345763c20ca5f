"""DeepSeek-V3.2-sized decode with ``--enable-kv-offload``: GPU memory, concurrency and offload time.

Run on the GPU machine (``source scripts/gpu_env.sh`` first). For each ``(batch, context)`` point:

1. **Memory per request** (61 layers, fp8 656 B rows, 132 B index rows, real upstream pools): the
   GPU bytes ``torch.cuda.memory_allocated`` grows by when building (a) upstream's
   ``DSATokenToKVPool`` for ``batch x context`` tokens (all KV on the GPU) and (b) kv_offload's
   split pool + allocator tables + GPU LRU state + plan workspace for the same batch (index keys for
   every token; KV rows only for ``batch x (sparse_slots + one page of decode tail)``). The host
   bytes of (b) are reported beside it.
2. **Concurrency in a GPU KV budget** (default 40 GB): the largest batch of that context whose
   pools fit, both ways; the offload side is then really allocated at that batch and measured.
   With PD over the GPU, one arriving prompt is staged in physical rows before its backup: the
   offload batch is given with and without that staging (direct-to-host ingestion needs none).
3. **Offload time per step**: the real host pool (pinned, ``host_layers`` layers), controller,
   GPU LRU and coordinator at that batch. Prompts are written to physical rows and admitted (the
   prompt backup is timed), then decode steps run: ``alloc_decode`` + ``before_decode_step`` (page
   backups) and, for every layer, ``swap_in_selected_pages`` (positions -> locs, plan, H2D load)
   replayed from one CUDA graph. Random weights give no realistic top-k, so the positions follow a
   trace (``--trace``): ``uniform`` replaces ``churn`` of the previous step's top-k per layer with
   never-seen positions (as in bench_lru); ``realistic`` is ``traces.py`` (sinks, local window,
   drifting relevance with returns, churn that differs by layer, adjacent layers sharing most of
   their top-k; its measured churn, overlap and returns are reported). Reported per layer and per
   61-layer step, beside the time of the attention-side
   compute of the same layer written with torch ops (indexer scores over the whole context, top-k,
   sparse MLA over 2048 rows, 128 heads): production kernels are faster, so the share of the step
   given here is a lower bound.
4. **Correctness at scale**: after the last step, every row the last layer's swap-in returned
   equals the host copy (or the GPU tail row) of the token it stands for.

Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_common as ne  # noqa: E402  (imports no sglang module at import time)

logger = logging.getLogger("bench_decode_scale")

LAYERS = 61
GB = 1e9
MLA_HEADS = 128


def _median_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    """Median CUDA-event time of ``fn`` in ms over ``iters`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _measure(build: Callable[[], Any]) -> Tuple[Any, int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    m0 = torch.cuda.memory_allocated()
    obj = build()
    torch.cuda.synchronize()
    return obj, torch.cuda.memory_allocated() - m0


def _pool_kwargs(layers: int) -> Dict[str, Any]:
    return dict(
        page_size=ne.PAGE,
        kv_lora_rank=ne.KV_LORA,
        dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=ne.ROPE,
        layer_num=layers,
        device="cuda",
        index_head_dim=ne.INDEX_DIM,
        enable_memory_saver=False,
        kv_cache_dim=ne.FP8_ROW_BYTES,
    )


class OffloadStack:
    """The kv_offload objects a model runner builds (runtime.build_device_pool + build_allocator), sized here."""

    def __init__(
        self,
        reqs: int,
        logical_tokens: int,
        physical_rows: int,
        layers: int,
        slots: int,
        topk: int,
        max_context: int,
        with_host: bool,
    ) -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
            KVOffloadDSATokenToKVPool,
            KVOffloadTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import PlanWorkspace
        from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

        logical = -(-logical_tokens // ne.PAGE) * ne.PAGE
        physical = -(-physical_rows // ne.PAGE) * ne.PAGE
        kw = _pool_kwargs(layers)
        kw.pop("page_size")
        self.r2t = ReqToTokenPool(reqs + 1, max_context, "cuda", False)
        self.pool = KVOffloadDSATokenToKVPool(
            physical_size=physical, logical_size=logical, page_size=ne.PAGE, **kw
        )
        self.alloc = KVOffloadTokenToKVPoolAllocator(
            logical, physical, ne.PAGE, torch.float8_e4m3fn, "cuda", self.pool, False
        )
        self.sparse = SparseCacheState(
            num_layers=layers,
            max_reqs=self.r2t.req_to_token.shape[0],  # row 0 pads, requests 1..reqs
            buffer_slots=slots,
            topk=topk,
            allocator=self.alloc.hisparse_attn_allocator,
            device="cuda",
        )
        self.host = self.controller = self.coord = self.workspace = None
        if not with_host:  # the coordinator's own workspace, for the memory count
            self.workspace = PlanWorkspace(reqs, topk, self.sparse.max_slots, torch.device("cuda"))
        else:
            from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
            from sglang.srt.mem_cache.sparsity.kv_offload.controller import (
                KVOffloadCacheController,
            )
            from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
            from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool

            self.host = KVOffloadHostPool(self.pool, host_pool_ratio=1.0)
            self.controller = KVOffloadCacheController(self.alloc, self.host)
            self.coord = KVOffloadCoordinator(
                self.r2t.req_to_token, self.alloc, self.controller, self.sparse, max_bs=reqs
            )
            self.adapter = DSAOffloadAdapter(self.coord)


def offload_physical_rows(reqs: int, slots: int, staging: int) -> int:
    """Sparse slots + one page of decode tail per request, plus prompt staging rows."""
    return reqs * (slots + ne.PAGE) + staging


# ------------------------------------------------------------------------------------ memory
def memory_point(bs: int, ctx: int, a) -> Dict[str, Any]:
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    out: Dict[str, Any] = dict(bs=bs, ctx=ctx, layers=LAYERS, slots=a.slots)
    pool, full = _measure(lambda: DSATokenToKVPool(size=bs * ctx, **_pool_kwargs(LAYERS)))
    del pool
    out["full_gpu_bytes"] = full
    build = lambda n, staging: OffloadStack(  # noqa: E731
        n, n * ctx, offload_physical_rows(n, a.slots, staging), LAYERS, a.slots, a.topk, ctx, False
    )
    stack, off = _measure(lambda: build(bs, 0))
    del stack
    out["offload_gpu_bytes"] = off
    out["full_per_req"] = full / bs
    out["offload_per_req"] = off / bs
    out["host_per_req"] = ctx * LAYERS * ne.FP8_ROW_BYTES
    out["gpu_ratio"] = full / off
    budget = a.budget_gb * GB
    staging_bytes = ctx * LAYERS * ne.FP8_ROW_BYTES
    out["max_bs_full"] = int(budget // out["full_per_req"])
    out["max_bs_offload_direct"] = int(budget // out["offload_per_req"])
    out["max_bs_offload_staged"] = int((budget - staging_bytes) // out["offload_per_req"])
    # Really allocate the offload side at the staged maximum (the conservative one) and measure.
    n = out["max_bs_offload_staged"]
    stack, used = _measure(lambda: build(n, ctx))
    del stack
    out["offload_alloc_at_max_staged"] = used
    out["offload_fits"] = used <= budget
    out["concurrency_gain_staged"] = n / max(1, out["max_bs_full"])
    out["concurrency_gain_direct"] = out["max_bs_offload_direct"] / max(1, out["max_bs_full"])
    torch.cuda.empty_cache()
    logger.info(
        "memory bs %d ctx %d: full %.2f GB/req, offload %.3f GB/req (%.1fx); in %.0f GB: %d full vs "
        "%d offload (staged, allocated %.1f GB) / %d (direct)",
        bs,
        ctx,
        out["full_per_req"] / GB,
        out["offload_per_req"] / GB,
        out["gpu_ratio"],
        a.budget_gb,
        out["max_bs_full"],
        n,
        used / GB,
        out["max_bs_offload_direct"],
    )
    return out


# ------------------------------------------------------------------------------------ timing
def _uniform_traces(
    bs: int, ctx: int, topk: int, churn: float, steps: int, seed: int, device: str
) -> List[torch.Tensor]:
    """Per step ``(bs, topk)`` int32 positions in ``[0, ctx)`` (bench_lru's generator, chunked)."""
    from bench_lru import make_traces

    parts = [
        make_traces(min(16, bs - s), ctx, topk, churn, steps, device, seed + s)
        for s in range(0, bs, 16)
    ]
    return [torch.cat([p[i] for p in parts]) for i in range(steps)]


def layer_traces(
    bs: int, ctx: int, layers: int, a, device: str = "cuda"
) -> Tuple[List[List[torch.Tensor]], Dict]:
    """``[layer][step]`` ``(bs, topk)`` int32 positions in ``[0, ctx)`` and what the trace has."""
    if a.trace == "uniform":
        per_layer = [
            _uniform_traces(bs, ctx, a.topk, a.churn, a.steps, a.seed + 7 * layer, device)
            for layer in range(layers)
        ]
        return per_layer, dict(kind="uniform", churn=a.churn)
    import traces as realistic

    cfg = realistic.TraceConfig(
        batch=bs, context=ctx, topk=a.topk, layers=layers, steps=a.steps, churn=a.churn, seed=a.seed
    )
    trace = realistic.generate(cfg, device=device).to(device)  # (steps, layers, bs, topk)
    stats = realistic.measure(trace[:, :, :1].cpu())
    churn = stats["churn_per_layer"]
    info = dict(
        kind="realistic",
        churn_knob=a.churn,
        churn_per_layer_min=min(churn),
        churn_per_layer_max=max(churn),
        adjacent_layer_overlap=stats["adjacent_layer_overlap"],
        returns=stats["returns"],
    )
    return [[trace[t, layer] for t in range(a.steps)] for layer in range(layers)], info


def _attention_side_ms(bs: int, ctx: int, a, kv_rows: torch.Tensor) -> float:
    """Indexer scores over the context + top-k + sparse MLA (128 heads), torch ops, one layer."""
    dev = torch.device("cuda")
    q_idx = torch.randn(bs, 64, ne.INDEX_DIM, device=dev, dtype=torch.bfloat16)
    w = torch.randn(bs, 64, device=dev, dtype=torch.float32)
    keys = torch.randn(bs, ctx, ne.INDEX_DIM, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, MLA_HEADS, ne.LATENT, device=dev, dtype=torch.bfloat16)
    rows = torch.randint(0, kv_rows.shape[0], (bs, a.topk), device=dev)

    def layer():
        s = torch.einsum("bhd,btd->bht", q_idx, keys).relu_()
        scores = (s.float() * w[:, :, None]).sum(dim=1)
        torch.topk(scores, a.topk, dim=1)
        kv = ne.dequantize_rows(kv_rows[rows], "fp8").to(torch.bfloat16)
        p = torch.softmax(torch.einsum("bhc,bkc->bhk", q, kv).float() * ne.LATENT**-0.5, -1)
        torch.einsum("bhk,bkc->bhc", p.to(torch.bfloat16), kv[..., : ne.KV_LORA])

    return _median_ms(layer, iters=5)


def timing_point(bs: int, ctx: int, a) -> Dict[str, Any]:
    layers = a.host_layers
    out: Dict[str, Any] = dict(bs=bs, ctx=ctx, host_layers=layers, churn=a.churn, steps=a.steps)
    out["trace"] = a.trace
    max_ctx = ctx + a.steps + ne.PAGE
    t0 = time.time()
    st = OffloadStack(
        bs,
        bs * max_ctx,
        offload_physical_rows(bs, a.slots, ctx + ne.PAGE),
        layers,
        a.slots,
        a.topk,
        max_ctx,
        True,
    )
    out["setup_s"] = time.time() - t0
    out["host_gb"] = st.host.size * st.host.size_per_token / GB
    logger.info(
        "timing bs %d ctx %d: pools ready in %.1f s (host %.1f GB pinned, %d layers)",
        bs,
        ctx,
        out["setup_s"],
        out["host_gb"],
        layers,
    )
    start_free = st.alloc.free_counts()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    lens = [ctx - (r % ne.PAGE) for r in range(bs)]  # pages complete on different steps
    # Prompts: write random KV into their physical rows, admit, back up; time the backups.
    backup_s, backup_bytes = 0.0, 0
    reqs = list(range(1, bs + 1))  # request row 0 is upstream's padding row
    for r, n in zip(reqs, lens):
        locs = ne.alloc_extend(st.alloc, n, dev)
        st.r2t.req_to_token[r, :n] = locs.to(torch.int32)
        phys = st.pool.translate_loc_to_hisparse_device(locs).to(torch.int64)
        for layer in range(layers):
            rows = st.pool.device_row_view(layer)
            rows[phys] = torch.randint(
                0, 256, (n, rows.shape[1]), device=dev, dtype=torch.uint8, generator=gen
            )
        torch.cuda.synchronize()
        t = time.time()
        st.coord.admit(r, n)
        st.coord.drain()
        backup_s += time.time() - t
        backup_bytes += n // ne.PAGE * ne.PAGE * layers * ne.FP8_ROW_BYTES
    out["prompt_backup_GBps"] = backup_bytes / backup_s / GB
    out["prompt_backup_ms_per_request"] = 1e3 * backup_s / bs
    logger.info(
        "prompt backups: %.1f GB/s, %.1f ms per %d-token request (%d layers)",
        out["prompt_backup_GBps"],
        out["prompt_backup_ms_per_request"],
        ctx,
        layers,
    )

    traces, out["trace_stats"] = layer_traces(bs, ctx - ne.PAGE, layers, a)
    topk_static = [torch.empty((bs, a.topk), dtype=torch.int32, device=dev) for _ in range(layers)]
    rpi = torch.tensor(reqs, dtype=torch.int64, device=dev)
    seq_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    misses = torch.zeros((), dtype=torch.int64, device=dev)
    results: List[torch.Tensor] = []
    st.adapter.num_real_reqs.fill_(bs)

    def swap_all_layers():
        for layer in range(layers):
            res = st.adapter.swap_in_selected_pages(rpi, seq_t, topk_static[layer], layer)
            misses.add_(st.coord.workspace.num_misses[:bs].sum())
        results.append(res)

    for layer in range(layers):
        topk_static[layer].copy_(traces[layer][0])
    graph = None
    if not a.eager:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            swap_all_layers()  # warm-up (compiles, mutates the LRU like a first step)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            swap_all_layers()
    step_ms, prep_ms, miss_counts = [], [], []
    cur = list(lens)
    for step in range(1, a.steps):
        for layer in range(layers):
            topk_static[layer].copy_(traces[layer][step])
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        misses.zero_()
        e0.record()
        locs = ne.alloc_decode(st.alloc, st.r2t.req_to_token, reqs, cur)
        cur = [n + 1 for n in cur]
        st.r2t.req_to_token[rpi, torch.tensor(cur, device=dev) - 1] = locs.to(torch.int32)
        st.coord.before_decode_step(reqs, cur, [n - 1 for n in cur])
        e1.record()
        if graph is not None:
            graph.replay()
        else:
            swap_all_layers()
        e2.record()
        torch.cuda.synchronize()
        if step >= a.warm:
            prep_ms.append(e0.elapsed_time(e1))
            step_ms.append(e1.elapsed_time(e2))
            miss_counts.append(int(misses))
    seq_t.copy_(torch.tensor(cur, device=dev))
    st.coord.drain()
    # Correctness: the last layer's rows hold the host copy (or the tail row) of each token.
    last = layers - 1
    rows = results[-1][:bs].to(torch.int64)
    pos = traces[last][a.steps - 1].to(torch.int64)
    loc = st.r2t.req_to_token[rpi[:, None], pos].to(torch.int64)
    dev_rows = st.pool.device_row_view(last)[rows.clamp(min=0)]
    h = st.alloc.loc_to_host[loc]
    tail = st.alloc.full_to_hisparse_device_index_mapping[loc]
    on_host = h >= 0
    host_rows = st.host.host_row_view(last)[h.clamp(min=0).cpu()].to(dev)
    ok_host = bool((dev_rows == host_rows).all(dim=-1)[on_host].all())
    ok_tail = bool((rows == tail)[~on_host].all())
    out["exact"] = ok_host and ok_tail and bool((rows >= 0).all())
    out["graph"] = graph is not None
    lay_ms = statistics.median(step_ms) / layers
    out["offload_ms_per_layer"] = lay_ms
    out["offload_ms_per_step_61"] = lay_ms * LAYERS
    out["prep_ms_per_step"] = statistics.median(prep_ms)
    out["misses_per_layer"] = statistics.median(miss_counts) / layers
    out["hit_rate"] = 1 - out["misses_per_layer"] / (bs * a.topk)
    out["h2d_GBps"] = out["misses_per_layer"] * ne.FP8_ROW_BYTES / lay_ms / 1e6
    attn = _attention_side_ms(bs, ctx, a, st.pool.device_row_view(0))
    out["attention_side_ms_per_layer"] = attn
    out["offload_share_lower_bound"] = lay_ms / (lay_ms + attn)
    # Release everything; the free counts return to where they started.
    for r in reqs:
        n = st.coord.requests[r].seq_len
        st.coord.release(r)
        st.alloc.free(st.r2t.req_to_token[r, :n].to(torch.int64))
    st.coord.drain()
    out["leak_free"] = st.alloc.free_counts() == start_free
    logger.info(
        "bs %d ctx %d: offload %.3f ms/layer (%.1f ms per 61-layer step, prep %.2f ms), hit %.3f, "
        "%.1f GB/s H2D, attention-side torch %.3f ms/layer -> share <= %.1f%%; exact %s, leak-free %s",
        bs,
        ctx,
        lay_ms,
        out["offload_ms_per_step_61"],
        out["prep_ms_per_step"],
        out["hit_rate"],
        out["h2d_GBps"],
        attn,
        100 * out["offload_share_lower_bound"],
        out["exact"],
        out["leak_free"],
    )
    st = traces = None  # free the pools before the next point
    torch.cuda.empty_cache()
    return out


def plot(res: Dict[str, Any], path: str) -> None:
    """Memory per request, concurrency in the budget, offload time per layer (one figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[skip] matplotlib not importable: no plot")
        return
    mem, tim = res.get("memory", []), res.get("timing", [])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [f"bs {m['bs']}\n{m['ctx'] // 1024}K" for m in mem]
    x = list(range(len(mem)))
    w = 0.38
    ax = axes[0]
    ax.bar([i - w / 2 for i in x], [m["full_per_req"] / GB for m in mem], w, label="all on GPU")
    ax.bar([i + w / 2 for i in x], [m["offload_per_req"] / GB for m in mem], w, label="kv_offload")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GPU GB per request (61 layers)")
    ax.set_title("GPU memory per request")
    ax.legend()
    ax = axes[1]
    budget = res["args_memory"]["budget_gb"] if "args_memory" in res else res["args"]["budget_gb"]
    ax.bar([i - w / 2 for i in x], [m["max_bs_full"] for m in mem], w, label="all on GPU")
    ax.bar(
        [i + w / 2 for i in x],
        [m["max_bs_offload_staged"] for m in mem],
        w,
        label="kv_offload (one prompt staged)",
    )
    for i, m in enumerate(mem):
        ax.text(
            i + w / 2,
            m["max_bs_offload_staged"],
            f"{m['concurrency_gain_staged']:.1f}x",
            ha="center",
            va="bottom",
        )
    ax.set_xticks(x, labels)
    ax.set_ylabel("requests")
    ax.set_title(f"Largest batch in a {budget:.0f} GB GPU KV budget")
    ax.legend()
    ax = axes[2]
    tl = [f"bs {t['bs']}\n{t['ctx'] // 1024}K" for t in tim]
    tx = list(range(len(tim)))
    ax.bar(
        [i - w / 2 for i in tx],
        [t["offload_ms_per_layer"] for t in tim],
        w,
        label="offload (swap-in) per layer",
    )
    ax.bar(
        [i + w / 2 for i in tx],
        [t["attention_side_ms_per_layer"] for t in tim],
        w,
        label="attention-side compute (torch ops)",
    )
    ax.set_xticks(tx, tl)
    ax.set_ylabel("ms per layer")
    args = res.get("args_timing") or res["args"]
    trace = args.get("trace", "uniform")
    ax.set_title(f"Offload time per layer ({trace} trace, churn {args['churn']:g})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[plot] {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--points", nargs="+", default=["64x32768", "16x131072"], help="BATCHxCONTEXT points"
    )
    p.add_argument("--slots", type=int, default=4096, help="sparse slots per request")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--budget-gb", type=float, default=40.0)
    p.add_argument(
        "--host-layers",
        type=int,
        default=8,
        help="layers of the timed stack (host pool pinned for these layers)",
    )
    p.add_argument(
        "--trace",
        choices=["uniform", "realistic"],
        default="uniform",
        help="top-k trace: uniform churn (bench_lru) or traces.py's realistic model",
    )
    p.add_argument(
        "--churn", type=float, default=0.1, help="top-k churn per step (the realistic model's knob)"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="no CUDA graph for the layer loop")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--plot-only", metavar="JSON", help="only draw the plot of a results file")
    p.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "bench_decode_scale.json")
    )
    a = p.parse_args(argv)
    if a.plot_only:
        plot(
            ne.read_results(a.plot_only),
            os.path.splitext(a.plot_only.removesuffix(".gz"))[0] + ".png",
        )
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ne.prepare_environment("cuda")
    points = [tuple(int(v) for v in s.split("x")) for s in a.points]
    res: Dict[str, Any] = dict(
        args=vars(a),
        env=dict(torch=torch.__version__, device=torch.cuda.get_device_name()),
        memory=[],
        timing=[],
    )
    t0 = time.time()
    for bs, ctx in points:
        if not a.skip_memory:
            res["memory"].append(memory_point(bs, ctx, a))
            ne.write_results(a.out, res)
    for bs, ctx in points:
        if not a.skip_timing:
            res["timing"].append(timing_point(bs, ctx, a))
            ne.write_results(a.out, res)
    res["wall_s"] = time.time() - t0
    ne.write_results(a.out, res)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
