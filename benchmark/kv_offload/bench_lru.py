"""Per-layer sparse-cache swap-in: our plan kernel + H2D row gather vs community HiSparse.

For each (bs, context, churn, row size) point, the same step-to-step top-k traces (generated on the
GPU) drive

* ours: ``lru_kernels.plan_layer`` (compact miss list) + ``transfer.copy_rows`` (Triton UVA gather
  from the pinned host pool; a minimal built-in gather if ``transfer`` is absent), eager and replayed
  from a CUDA graph; also plan-only time and the row-packed miss-list variant;
* community: ``sglang.jit_kernel.hisparse.load_cache_to_device_buffer_mla`` (one fused CUDA kernel;
  needs nvcc + apache-tvm-ffi; skipped with a message if it does not import);
* ``cudaMemcpy`` of the same number of miss bytes from pinned memory (the bandwidth ceiling).

Reports median ms per layer (steps after warm-up), misses, hit rate, GB/s, speedup vs community and
fraction of memcpy bandwidth, and checks the last step (device rows read through the rewritten indices
equal the host rows). Writes JSON (``--out``, default ``$OUT/bench_lru.json``) and a PNG next to it.

    python benchmark/kv_offload/bench_lru.py --quick      # bs128 / 32K / 10% / 656 B, tunes warps
    python benchmark/kv_offload/bench_lru.py              # full sweep (~54 points)
    python benchmark/kv_offload/bench_lru.py --device cpu --bs 2 --ctx 512 --churn 0.1 \
        --rows 656 --topk 64 --buffer 128 --steps 4 --warm 2   # logic smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional

if "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traces as realistic  # noqa: E402  (imports torch only)
from bench_common import results_json  # noqa: E402

logger = logging.getLogger("bench_lru")
ROOT = Path(__file__).resolve().parents[2]
PKG = "sglang.srt.mem_cache.sparsity.kv_offload"
OURS_DIR = ROOT / "python" / "sglang" / "srt" / "mem_cache" / "sparsity" / "kv_offload"


# ------------------------------------------------------------------------------------ imports
def _load_ours() -> Dict[str, types.ModuleType]:
    """Import our modules in-tree, or standalone when the patched tree cannot be imported here.

    The GPU machine has no sgl_kernel/torchvision, so ``sglang.srt.mem_cache.sparsity``'s package
    init may fail; our three modules only need each other, so register their package by path.
    """
    try:
        return {
            "lru": importlib.import_module(f"{PKG}.lru_kernels"),
            "state": importlib.import_module(f"{PKG}.sparse_cache"),
        }
    except Exception as e:  # noqa: BLE001
        logger.warning(
            "in-tree import failed (%s: %s); loading %s by path", type(e).__name__, e, OURS_DIR
        )
    parts = PKG.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001
                mod = types.ModuleType(name)
                mod.__path__ = []  # type: ignore[attr-defined]
                sys.modules[name] = mod
    pkg = types.ModuleType(PKG)
    pkg.__path__ = [str(OURS_DIR)]  # type: ignore[attr-defined]
    sys.modules[PKG] = pkg
    for sub in [m for m in list(sys.modules) if m.startswith(PKG + ".")]:
        del sys.modules[sub]
    return {
        "lru": importlib.import_module(f"{PKG}.lru_kernels"),
        "state": importlib.import_module(f"{PKG}.sparse_cache"),
    }


def _load_transfer():
    try:
        mod = importlib.import_module(f"{PKG}.transfer")
        return mod if hasattr(mod, "copy_rows") else None
    except Exception as e:  # noqa: BLE001
        logger.warning("kv_offload.transfer unavailable (%s); using the built-in gather", e)
        return None


HISPARSE_0523_SRC = ROOT / ".gpu" / "sglang-0.5.23"


def _load_community() -> Optional[Callable]:
    """HiSparse's swap-in kernel: SGLang 0.5.23's (``hisparse_0523/loader.py``, built from that
    release's sources, called with its coordinator's block size 960) when its sources are in
    ``.gpu/sglang-0.5.23`` (``$HISPARSE_0523_SRC``)."""
    src = Path(os.environ.get("HISPARSE_0523_SRC", HISPARSE_0523_SRC))
    try:
        if not src.is_dir():
            raise FileNotFoundError(f"no 0.5.23 sources in {src}")
        sys.path.insert(0, str(Path(__file__).resolve().parent / "hisparse_0523"))
        from loader import load_swap_in

        fn = load_swap_in(src)
        fn.version = "0.5.23"  # type: ignore[attr-defined]
        return fn
    except Exception as e:  # noqa: BLE001
        print(
            f"[skip] community HiSparse kernel not importable ({type(e).__name__}: {e}); "
            "carry apache-tvm-ffi (.whl) and the 0.5.23 sources (.gpu/sglang-0.5.23; "
            "scripts/env/fetch_gpu_wheels.sh) (needs nvcc)"
        )
        return None


# ----------------------------------------------------------------- fallback H2D gather
class _HostPtr:
    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@triton.jit
def _gather_rows_kernel(
    src,
    dst,
    src_idx,
    dst_idx,
    count_ptr,
    n_entries,
    ROW_WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
):
    n = tl.minimum(tl.load(count_ptr), n_entries)
    cols = tl.arange(0, BLOCK_W)
    for tile in range(tl.program_id(0), tl.cdiv(n, ROWS), tl.num_programs(0)):
        e = tile * ROWS + tl.arange(0, ROWS)
        ok = e < n
        s = tl.load(src_idx + e, mask=ok, other=-1).to(tl.int64)
        d = tl.load(dst_idx + e, mask=ok, other=-1).to(tl.int64)
        m = ((s >= 0) & (d >= 0))[:, None] & (cols < ROW_WORDS)[None, :]
        v = tl.load(src + s[:, None] * ROW_WORDS + cols[None, :], mask=m)
        tl.store(dst + d[:, None] * ROW_WORDS + cols[None, :], v, mask=m)


def _fallback_copy(host_words, dev_words, src_idx, dst_idx, count, programs):
    row_words = host_words.shape[1]
    src = _HostPtr(host_words) if dev_words.is_cuda else host_words
    _gather_rows_kernel[(programs,)](
        src,
        dev_words,
        src_idx,
        dst_idx,
        count,
        src_idx.numel(),
        ROW_WORDS=row_words,
        BLOCK_W=triton.next_power_of_2(row_words),
        ROWS=4,
        num_warps=4,
    )


# ------------------------------------------------------------------------------- timing
class Clock:
    """CUDA events (perf_counter on CPU). ``start()`` first queues a short GPU spin so the launches
    that follow are already enqueued when the start event fires: we time GPU work, not Python."""

    def __init__(self, device: torch.device, spin_cycles: int = 0):
        self.cuda = device.type == "cuda"
        self.spin_cycles = spin_cycles

    def start(self):
        self.sync()
        if self.cuda and self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)
        return self.mark()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------- traces
def make_traces(bs: int, ctx: int, K: int, churn: float, steps: int, device, seed: int):
    """Top-k positions in [0, ctx-1), unique per row; each step replaces ``churn`` of the previous
    step's entries by positions not selected before (vectorised: no per-row Python loop)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    P = ctx - 1
    cur = torch.rand((bs, P), generator=g, device=device).topk(K, dim=1).indices
    k = max(1, int(K * churn))
    out = [cur.to(torch.int32)]
    for _ in range(steps - 1):
        member = torch.zeros((bs, P), dtype=torch.bool, device=device)
        member.scatter_(1, cur, True)
        score = torch.rand((bs, P), generator=g, device=device).masked_fill_(member, -1.0)
        fresh = score.topk(k, dim=1).indices
        where = torch.rand((bs, K), generator=g, device=device).topk(k, dim=1).indices
        cur = cur.clone().scatter_(1, where, fresh)
        out.append(cur.to(torch.int32))
    return out


def host_layers(a, bs: int, ctx: int, row: int) -> int:
    """Host regions (layers) a point's steps rotate through.

    ``--host-layers N`` fixes N; 0 gives every point the host footprint of a ``--pool-layers``
    pool (61 for DeepSeek-V3.2), as many layers as fit in ``--max-host-gb``.
    """
    if a.host_layers > 0:
        return a.host_layers
    per_layer_gb = bs * ctx * row / 1e9
    return max(1, min(a.pool_layers, int(a.max_host_gb // per_layer_gb)))


# --------------------------------------------------------------------------------- bench
class Bench:
    def __init__(self, args, device: torch.device):
        self.a = args
        self.dev = device
        self.clock = Clock(device, args.spin_cycles)
        mods = _load_ours()
        self.lru, self.state_mod = mods["lru"], mods["state"]
        self.transfer = None if args.builtin_gather else _load_transfer()
        self.community = None if args.no_community or device.type != "cuda" else _load_community()
        self.host: Dict[int, torch.Tensor] = {}
        self.period: Optional[int] = None  # host content period in rows (set by main)
        self._cursor = 0  # next layer region: every pass continues the rotation (see _regions)
        self.copy_cfg = None
        self.sort_misses = False
        if self.transfer is not None:
            self.copy_cfg = self.transfer.default_load_launch_config(device)  # the controller's
        if self.transfer is not None and args.copy_programs:
            self.copy_cfg = self.transfer.CopyLaunchConfig(
                num_programs=args.copy_programs,
                rows_per_program=args.copy_rows,
                num_warps=args.copy_warps,
            )

    # host pool: one pinned buffer per row size, reused by every point
    def host_buffer(self, row: int, rows: int) -> torch.Tensor:
        buf = self.host.get(row)
        if buf is not None and buf.shape[0] >= rows:
            return buf
        self.release_host()  # points are sorted by footprint: the previous buffer is done
        t0 = time.time()
        pin = self.dev.type == "cuda"
        if pin and rows * row > (8 << 30):
            # One cudaHostAlloc of ~80 GB fails; pin as the host pool does (cudaHostRegister).
            buf = torch.empty((rows, row), dtype=torch.uint8)
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {buf.nbytes / 1e9:.1f} GB failed: {rc}")
            buf._kvo_registered = True
        else:
            buf = torch.empty((rows, row), dtype=torch.uint8, pin_memory=pin)
        # Steps rotate through layer regions but share one LRU state, so a row cached from one
        # region is read back as a hit at another step: every region must hold the same rows. The
        # content repeats every ``period`` rows (a divisor of every point's region), generated on
        # the device and tiled.
        period = min(rows, self.period or rows)
        chunk = period * max(1, (256 << 20) // (period * row))
        g = torch.Generator(device=self.dev).manual_seed(self.a.seed)
        tile = torch.randint(0, 256, (period, row), dtype=torch.uint8, device=self.dev, generator=g)
        tile = tile.repeat(chunk // period, 1) if chunk > period else tile
        for i in range(0, rows, chunk):
            n = min(chunk, rows - i)
            buf[i : i + n].copy_(tile[:n])
        del tile
        self.clock.sync()
        print(
            f"[host] {rows * row / 1e9:.1f} GB {'pinned' if pin else ''} buffer for {row} B rows "
            f"in {time.time() - t0:.1f} s",
            flush=True,
        )
        self.host[row] = buf
        return buf

    def _regions(self, steps: int, layers: int) -> List[int]:
        """Layer regions for the next ``steps`` steps of a pass.

        Every pass (ours eager, row-packed, graph, community) continues one rotation, so a region
        comes back only after the other ``layers - 1``, as a layer's host rows do in a decode step;
        restarting at region 0 would hand later passes translations that earlier passes warmed.
        """
        out = [(self._cursor + i) % layers for i in range(steps)]
        self._cursor = (self._cursor + steps) % layers
        return out

    def release_host(self) -> None:
        """Unpin and drop the host buffers (the next row size pins its own)."""
        self._views = self._views_of = None  # the cached kernel views would keep a buffer alive
        self.clock.sync()  # nothing queued may still read a buffer being unpinned
        for buf in self.host.values():
            if self.dev.type == "cuda" and getattr(buf, "_kvo_registered", False):
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self.host.clear()
        if self.dev.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the pinned pages back before pinning more

    def _state(self, bs: int, S: int):
        """Requests 1..bs (request row 0 is upstream's padding row, as in ReqToTokenPool)."""
        dev = self.dev
        rows = bs + 1
        ocls = (torch.arange(rows * (S + 64), dtype=torch.int32, device=dev) + 64).view(
            rows, S + 64
        )
        num_slots = torch.full((rows,), S, dtype=torch.int32, device=dev)
        num_slots[0] = 0
        return self.state_mod.LayerState(
            hint=torch.full(
                (rows, self.state_mod.HINT_ENTRIES_PER_SLOT * S), -1, dtype=torch.int16, device=dev
            ),
            slot_loc=torch.full((rows, S), -1, dtype=torch.int32, device=dev),
            lru=torch.arange(S, dtype=torch.int16, device=dev).repeat(rows, 1).contiguous(),
            out_cache_loc_sparse=ocls[:, :S].contiguous(),
            num_slots=num_slots,
        )

    def _copy(self, host_w, dev_w, res, compact: bool):
        count = res.miss_count if compact else None
        if self.transfer is not None:
            if getattr(self, "_views_of", None) != (host_w.data_ptr(), dev_w.data_ptr()):
                self._views = (self.transfer.RowView(host_w), self.transfer.RowView(dev_w))
                self._views_of = (host_w.data_ptr(), dev_w.data_ptr())
            src, dst = res.miss_host, res.miss_dst
            if compact and self.sort_misses:
                # Experiment: misses in host-address order; entries past the device-side count
                # (stale or -1) sort last.
                live = torch.arange(src.shape[0], device=src.device) < count
                key = torch.where(live & (src >= 0), src, torch.full_like(src, 2**62))
                order = torch.sort(key).indices
                src, dst = src[order], dst[order]
            self.transfer.copy_rows(*self._views, src, dst, num_valid=count, config=self.copy_cfg)
        else:
            if count is None:
                count = self._full_count
            _fallback_copy(
                host_w, dev_w, res.miss_host, res.miss_dst, count, self._fallback_programs
            )

    def run_point(
        self, bs: int, ctx: int, churn: float, row: int, num_warps: int, plan_only: bool = False
    ) -> Dict:
        a, dev, clock = self.a, self.dev, self.clock
        K, S = a.topk, a.buffer
        layers = host_layers(a, bs, ctx, row)
        region = bs * ctx  # one layer's host rows; step i reads layer i % layers
        host = self.host_buffer(row, region * layers)
        word = 8 if row % 8 == 0 else 4
        host_w = host.view(torch.int64 if word == 8 else torch.int32)
        dev_rows = (bs + 1) * (S + 64) + 64  # _state: padding row 0 and bs requests
        devbuf = torch.zeros((dev_rows, row), dtype=torch.uint8, device=dev)
        dev_w = devbuf.view(host_w.dtype)
        if a.trace == "realistic":
            cfg = realistic.TraceConfig.for_topk(
                K, batch=bs, context=ctx - 1, layers=2, steps=a.steps, churn=churn, seed=a.seed
            )
            trace = realistic.generate(cfg, device=dev)
            trace_stats = realistic.measure(trace[:, :, :1])
            traces = [trace[t, 0].to(dev) for t in range(a.steps)]
        else:
            traces = make_traces(bs, ctx, K, churn, a.steps, dev, seed=a.seed)
            trace_stats = None
        rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=dev)  # row 0 pads (_state)
        nr = torch.tensor([bs], dtype=torch.int32, device=dev)
        base = (torch.arange(bs, dtype=torch.int32, device=dev) * ctx)[:, None]
        locs = [t + base for t in traces]  # logical loc = r * ctx + position (req_to_token)
        l2h = torch.arange(bs * ctx, dtype=torch.int64, device=dev)

        # Step i reads layer (i % host_layers)'s region: the host footprint of a multi-layer pool.
        def l2h_for_pass() -> List[torch.Tensor]:
            return [l2h + j * region for j in self._regions(len(locs), layers)]

        l2h_steps = l2h_for_pass()
        l2t = torch.full((bs * ctx,), -1, dtype=torch.int32, device=dev)
        ws = self.lru.PlanWorkspace(bs, K, S, dev)
        self._full_count = torch.tensor([bs * K], dtype=torch.int32, device=dev)
        self._fallback_programs = 4 * (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        )
        r: Dict = dict(
            bs=bs,
            ctx=ctx,
            churn=churn,
            trace=a.trace,
            trace_stats=trace_stats,
            row_bytes=row,
            host_layers=layers,
            host_gb=region * layers * row / 1e9,
            topk=K,
            buffer=S,
            steps=a.steps,
            warm=a.warm,
            num_warps=num_warps,
        )

        def eager_pass(compact: bool, with_copy: bool = True):
            st = self._state(bs, S)
            t_all, t_plan, misses = [], [], []
            res = None
            for i, lt in enumerate(locs):
                e0 = clock.start()
                res = self.lru.plan_layer(
                    lt, rpi, nr, l2h_steps[i], l2t, st, ws, num_warps=num_warps, compact=compact
                )
                e1 = clock.mark()
                if with_copy:
                    self._copy(host_w, dev_w, res, compact)
                e2 = clock.mark()
                if i >= a.warm:
                    t_plan.append(clock.ms(e0, e1))
                    t_all.append(clock.ms(e0, e2))
                    misses.append(int(res.num_misses.sum()))
            return _median(t_all), _median(t_plan), misses, res, st

        ms, plan_ms, misses, res, _ = eager_pass(True, with_copy=not plan_only)
        r["ours_plan_ms"] = plan_ms
        if plan_only:
            return r
        r["ours_ms"] = ms
        r["misses_ours"] = int(_median(misses))
        r["hit_rate_ours"] = 1 - r["misses_ours"] / (bs * K)
        r["ours_GBps"] = r["misses_ours"] * row / ms / 1e6
        r["err_flags"] = int(ws.error_flags[0])
        r["correct_ours"] = self._check(devbuf, host, res.out_indices, locs[-1], l2h_steps[-1])

        if a.rowpacked:
            devbuf.zero_()
            l2h_steps = l2h_for_pass()
            ms_rp, _, _, res_rp, _ = eager_pass(False)
            r["ours_rowpacked_ms"] = ms_rp
            r["correct_ours_rowpacked"] = self._check(
                devbuf, host, res_rp.out_indices, locs[-1], l2h_steps[-1]
            )

        if dev.type == "cuda" and not a.no_graph:
            r.update(
                self._graph_pass(
                    bs,
                    ctx,
                    S,
                    locs,
                    rpi,
                    nr,
                    l2h_for_pass(),
                    l2t,
                    host,
                    host_w,
                    devbuf,
                    dev_w,
                    num_warps,
                )
            )

        # memcpy of the same bytes (contiguous, pinned -> device)
        nbytes = r["misses_ours"] * row
        if nbytes:
            src, dst = host.view(-1)[:nbytes], devbuf.view(-1)[:nbytes]
            ts = []
            for i in range(a.warm + 5):
                e0 = clock.start()
                dst.copy_(src, non_blocking=True)
                e1 = clock.mark()
                if i >= a.warm:
                    ts.append(clock.ms(e0, e1))
            r["memcpy_ms"] = _median(ts)
            r["memcpy_GBps"] = nbytes / r["memcpy_ms"] / 1e6
            r["frac_memcpy_bw"] = r["ours_GBps"] / r["memcpy_GBps"]

        if self.community is not None:
            r.update(self._community_pass(bs, ctx, S, K, row, traces, host, layers))
            if r.get("community_ms"):
                r["speedup_vs_community"] = r["community_ms"] / r["ours_ms"]
                if "ours_graph_ms" in r:
                    r["speedup_graph_vs_community"] = r["community_ms"] / r["ours_graph_ms"]
        del devbuf
        return r

    def _check(self, devbuf, host, out, loc_last, l2h) -> bool:
        """Rows read through the rewritten indices equal the host rows (sampled batch rows)."""
        bs = out.shape[0]
        rows = sorted({0, bs - 1, *torch.randperm(bs)[:6].tolist()})
        for b in rows:
            o = out[b].long()
            if bool((o < 0).any()):
                return False
            want = host[l2h[loc_last[b].long()].cpu()]
            if not torch.equal(devbuf[o].cpu(), want):
                return False
        return True

    def _graph_pass(
        self, bs, ctx, S, locs, rpi, nr, l2h_steps, l2t, host, host_w, devbuf, dev_w, num_warps
    ) -> Dict:
        a, clock = self.a, self.clock
        K = a.topk
        l2h = l2h_steps[0].clone()  # static graph input, refilled per step
        st = self._state(bs, S)
        ws = self.lru.PlanWorkspace(bs, K, S, self.dev)
        static = locs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles) on a throwaway state
            tmp = self._state(bs, S)
            res = self.lru.plan_layer(static, rpi, nr, l2h, l2t, tmp, ws, num_warps=num_warps)
            self._copy(host_w, dev_w, res, True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = self.lru.plan_layer(static, rpi, nr, l2h, l2t, st, ws, num_warps=num_warps)
            self._copy(host_w, dev_w, res, True)
        devbuf.zero_()
        ts = []
        for i, lt in enumerate(locs):
            static.copy_(lt)
            l2h.copy_(l2h_steps[i])
            e0 = clock.start()
            g.replay()
            e1 = clock.mark()
            if i >= a.warm:
                ts.append(clock.ms(e0, e1))
        out = ws.out_indices[:bs]
        return {
            "ours_graph_ms": _median(ts),
            "correct_ours_graph": self._check(devbuf, host, out, locs[-1], l2h_steps[-1]),
        }

    def _community_pass(self, bs, ctx, S, K, row, traces, host, layers) -> Dict:
        a, dev, clock = self.a, self.dev, self.clock
        R = bs
        region = R * ctx
        hc = host.view(-1, 1, row)
        devbuf = torch.zeros((R * (S + 64) + 64, 1, row), dtype=torch.uint8, device=dev)
        host_locs = torch.arange(R * ctx, device=dev, dtype=torch.int64).view(R, ctx)
        locs = (torch.arange(R * (S + 64), dtype=torch.int32, device=dev) + 64).view(R, S + 64)
        toks = torch.full_like(locs, -1)
        lru = torch.arange(S, dtype=torch.int16, device=dev).repeat(R, 1).contiguous()
        rpi = torch.arange(bs, device=dev, dtype=torch.int64)
        seq = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        n = torch.tensor([bs], dtype=torch.int32, device=dev)
        out = torch.full((bs, K), -1, dtype=torch.int32, device=dev)
        host_locs_steps = [host_locs + j * region for j in self._regions(len(traces), layers)]
        ts, misses = [], []
        try:
            for i, tk in enumerate(traces):
                out.fill_(-1)
                if i >= a.warm:
                    before = toks[:, :S].long()
                    cached = torch.zeros((bs, ctx + 1), dtype=torch.bool, device=dev)
                    cached.scatter_(1, torch.where(before >= 0, before, ctx), True)
                    misses.append(int((~cached.gather(1, tk.long())).sum()))
                e0 = clock.start()
                self.community(
                    top_k_tokens=tk,
                    device_buffer_tokens=toks,
                    host_cache_locs=host_locs_steps[i],
                    device_buffer_locs=locs,
                    host_cache=hc,
                    device_buffer=devbuf,
                    top_k_device_locs=out,
                    req_pool_indices=rpi,
                    seq_lens=seq,
                    lru_slots=lru,
                    item_size_bytes=row,
                    num_top_k=K,
                    hot_buffer_size=S,
                    page_size=1,
                    block_size=1024,
                    num_real_reqs=n,
                )
                e1 = clock.mark()
                if i >= a.warm:
                    ts.append(clock.ms(e0, e1))
        except Exception as e:  # noqa: BLE001
            return {"community_error": f"{type(e).__name__}: {e}"[:300]}
        ok = True
        for b in sorted({0, bs - 1}):
            ok &= torch.equal(
                devbuf[out[b].long()].view(K, row).cpu(),
                host[host_locs_steps[-1][b, traces[-1][b].long()].cpu()],
            )
        m = int(_median(misses))
        cms = _median(ts)
        return {
            "community_ms": cms,
            "misses_community": m,
            "hit_rate_community": 1 - m / (bs * K),
            "community_GBps": m * row / cms / 1e6,
            "correct_community": bool(ok),
        }


# ---------------------------------------------------------------------------------- main
def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def _fmt(v, spec):
    if isinstance(v, (int, float)) and not math.isnan(v):
        return format(v, spec)
    return format("-", ">" + spec.split(".")[0])


def print_table(rows: List[Dict], header: bool = True) -> None:
    hdr = (
        f"{'bs':>4} {'ctx':>7} {'churn':>5} {'row':>5} {'L':>3} | {'plan':>6} {'ours':>6} {'graph':>6} "
        f"{'comm':>6} {'memcpy':>6} | {'miss':>6} {'hit%':>5} {'GB/s':>5} {'xComm':>5} "
        f"{'%mcpy':>5} ok"
    )
    if header:
        print(hdr)
        print("-" * len(hdr))
    for r in rows:
        ok = r.get("correct_ours") and r.get("correct_ours_graph", True) and not r.get("err_flags")
        print(
            f"{r['bs']:>4} {r['ctx']:>7} {r['churn']:>5.2f} {r['row_bytes']:>5} "
            f"{r.get('host_layers', 1):>3} | "
            f"{_fmt(r.get('ours_plan_ms'), '6.3f')} {_fmt(r.get('ours_ms'), '6.3f')} "
            f"{_fmt(r.get('ours_graph_ms'), '6.3f')} {_fmt(r.get('community_ms'), '6.3f')} "
            f"{_fmt(r.get('memcpy_ms'), '6.3f')} | {r.get('misses_ours', 0):>6} "
            f"{_fmt(100 * r.get('hit_rate_ours', float('nan')), '5.1f')} "
            f"{_fmt(r.get('ours_GBps'), '5.1f')} {_fmt(r.get('speedup_vs_community'), '5.2f')} "
            f"{_fmt(100 * r.get('frac_memcpy_bw', float('nan')), '5.1f')} "
            f"{'yes' if ok else 'NO'}",
            flush=True,
        )


def plot(rows: List[Dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("[skip] matplotlib not importable: no plot")
        return
    rows = [r for r in rows if "ours_ms" in r]
    if not rows:
        return
    labels = [
        f"{r['bs']}/{r['ctx'] // 1024}K/{int(r['churn'] * 100)}%/{r['row_bytes']}" for r in rows
    ]
    x = range(len(rows))
    fig, ax = plt.subplots(2, 1, figsize=(max(8, 0.35 * len(rows)), 8), sharex=True)
    for key, name in (
        ("ours_ms", "ours eager"),
        ("ours_graph_ms", "ours graph"),
        ("community_ms", "HiSparse"),
        ("memcpy_ms", "memcpy same bytes"),
    ):
        ax[0].plot(x, [r.get(key, float("nan")) for r in rows], "o-", label=name, ms=3)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("ms / layer")
    ax[0].legend()
    ax[1].bar(x, [r.get("speedup_vs_community", float("nan")) for r in rows])
    ax[1].axhline(1.3, color="r", ls="--", lw=1)
    ax[1].set_ylabel("speedup vs HiSparse")
    ax[1].set_xticks(list(x))
    ax[1].set_xticklabels(labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[plot] {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="headline point bs128/32K/10%%/656 + tune")
    p.add_argument("--bs", type=_csv(int), default=[1, 32, 128])
    p.add_argument("--ctx", type=_csv(int), default=[8192, 32768, 131072])
    p.add_argument("--churn", type=_csv(float), default=[0.05, 0.10, 0.30])
    p.add_argument("--rows", type=_csv(int), default=[656, 1152])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--buffer", type=int, default=4096, help="sparse slots per request (HOT)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--trace",
        choices=["uniform", "realistic"],
        default="uniform",
        help="uniform: each step replaces --churn of the top-k by never-seen positions; "
        "realistic: traces.py (sinks, local window, drifting relevance with returns, layer "
        "sharing) calibrated to --churn of the drifting part",
    )
    p.add_argument("--warm", type=int, default=6)
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--tune", action="store_true", help="pick num_warps by plan time first")
    p.add_argument("--copy-programs", type=int, default=0, help="transfer grid (0: its default)")
    p.add_argument("--copy-rows", type=int, default=4)
    p.add_argument("--copy-warps", type=int, default=4)
    p.add_argument(
        "--builtin-gather",
        action="store_true",
        help="use the minimal built-in gather instead of kv_offload.transfer",
    )
    p.add_argument("--no-community", action="store_true")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-rowpacked", dest="rowpacked", action="store_false")
    p.add_argument("--max-host-gb", type=float, default=60.0)
    p.add_argument(
        "--compact-variants",
        default="",
        help="comma list of PROGRAMSxROWSxWARPS[:sort] for the compact path, run in one process "
        "(e.g. 528x4x4,2112x4x4:sort); ':sort' orders the miss list by host address first",
    )
    p.add_argument(
        "--host-layers",
        type=int,
        default=1,
        help="host regions (one per layer) the steps rotate through: the host footprint of a "
        "multi-layer pool (61 layers of bs 128 x 32K x 656 B = 168 GB); 1 = one layer; 0 = per "
        "point, --pool-layers layers capped by --max-host-gb",
    )
    p.add_argument(
        "--pool-layers", type=int, default=61, help="layers of the pool (--host-layers 0)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spin-cycles",
        type=int,
        default=400_000,
        help="GPU spin before each timed call so launch latency is not timed (0: off)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.quick:
        a.bs, a.ctx, a.churn, a.rows, a.tune = [128], [32768], [0.10], [656], True
    dev = torch.device(a.device)
    out = Path(a.out) if a.out else Path(os.environ.get("OUT", ".")) / "bench_lru.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    bench = Bench(a, dev)
    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "transfer": f"{PKG}.transfer.copy_rows" if bench.transfer else "built-in fallback gather",
        "community": bool(bench.community),
        "community_version": (bench.community.version if bench.community else None),
    }
    print(json.dumps(env))

    points, skipped = [], []
    for row in a.rows:
        for bs in a.bs:
            for ctx in a.ctx:
                gb = bs * ctx * row * host_layers(a, bs, ctx, row) / 1e9
                if gb > a.max_host_gb:
                    skipped.append(dict(bs=bs, ctx=ctx, row_bytes=row, host_gb=gb))
                    continue
                for churn in a.churn:
                    points.append((bs, ctx, churn, row))
    # Host content repeats every gcd(region sizes) rows, so each point's layer regions (bs * ctx
    # rows apart) hold the same rows whichever point pinned the shared buffer.
    if any(host_layers(a, p[0], p[1], p[3]) > 1 for p in points):
        bench.period = functools.reduce(math.gcd, (p[0] * p[1] for p in points))
    # largest host buffer first per row size: pinned once, then reused
    points.sort(
        key=lambda p: (p[3], -p[0] * p[1] * host_layers(a, p[0], p[1], p[3]), p[0], p[1], p[2])
    )

    warps = a.num_warps
    tuning = {}
    if a.tune and points:
        bs, ctx, churn, row = min(
            points, key=lambda p: (p[0] != 128, p[1] != 32768, abs(p[2] - 0.1), p[3] != 656)
        )
        for w in (4, 8, 16):
            tuning[w] = bench.run_point(bs, ctx, churn, row, w, plan_only=True)["ours_plan_ms"]
            print(f"[tune] num_warps={w}: plan {tuning[w]:.4f} ms", flush=True)
        warps = min(tuning, key=tuning.get)

    results = []
    variants = [(None, False)]
    if (
        a.compact_variants
    ):  # launch shapes x host-order sorting of the compact path, one host buffer
        variants = []
        for spec in a.compact_variants.split(","):
            shape, _, sort = spec.partition(":")
            progs, rows, warps_ = (int(v) for v in shape.split("x"))
            variants.append(((progs, rows, warps_), sort == "sort"))

    def write() -> None:  # after every point: a long sweep that dies keeps what it measured
        doc = {
            "env": env,
            "args": vars(a),
            "num_warps": warps,
            "tuning_plan_ms": tuning,
            "host_period_rows": bench.period,
            "results": results,
            "skipped": skipped,
            "wall_s": time.time() - t_start,
        }
        out.write_text(results_json(doc))

    for (bs, ctx, churn, row), (shape, sort) in ((pt, v) for pt in points for v in variants):
        if shape is not None:
            bench.copy_cfg = bench.transfer.CopyLaunchConfig(*shape)
        bench.sort_misses = sort
        cfg = bench.copy_cfg
        try:
            results.append(bench.run_point(bs, ctx, churn, row, warps))
        except torch.cuda.OutOfMemoryError as e:
            skipped.append(dict(bs=bs, ctx=ctx, churn=churn, row_bytes=row, error=str(e)[:200]))
            torch.cuda.empty_cache()
            continue
        results[-1]["compact_shape"] = (
            None if cfg is None else [cfg.num_programs, cfg.rows_per_program, cfg.num_warps]
        )
        results[-1]["sorted_misses"] = sort
        print_table(results[-1:], header=len(results) == 1)
        write()
    print()
    print_table(results)
    for s in skipped:
        print(f"[skip] {s}")
    write()
    print(f"[json] {out}  ({time.time() - t_start:.0f} s)")
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
