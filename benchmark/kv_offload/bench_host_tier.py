"""Host-tier benchmark for kv_offload (run on a GPU).

1. ``load_one_layer``: random unique host rows -> random unique device rows (pinned host, UVA),
   4K / 26K / 131K rows of 656 B and 1152 B, against a pinned ``copy_`` of the same bytes in the same
   run. Sweeps the kernel launch shape (coarse grid at 26K rows, then the best few at every size).
2. Prompt backup of a 32K-token request over 61 layers, device -> host, through the controller's
   ``backup_batch`` + ``poll`` (or, when the upstream pools cannot be imported, the same
   ``copy_rows_all_layers`` call the controller makes).

Writes ``$OUT/bench_host_tier.json`` (or ``--out``) and prints a table. Timings: CUDA events around
each call, warmup, median.

    PYTHONPATH=python:build/sglang/python[:<sgl_kernel stand-in>] python benchmark/kv_offload/bench_host_tier.py
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRANSFER_PY = os.path.join(REPO, "python/sglang/srt/mem_cache/sparsity/kv_offload/transfer.py")


def load_transfer():
    """The kernel module; by file path if the sglang package cannot be imported here."""
    try:
        from sglang.srt.mem_cache.sparsity.kv_offload import transfer

        return transfer, "package"
    except Exception as e:  # torchvision / sgl_kernel missing on the box
        spec = importlib.util.spec_from_file_location("kv_offload_transfer", TRANSFER_PY)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod, f"file ({type(e).__name__}: {e})"


T, TRANSFER_SRC = load_transfer()
# Host pools are cudaHostRegister'ed and, as upstream, never unregistered: keep them alive so a later
# buffer cannot land on a freed but still registered address range.
_KEEP_ALIVE = []
DEV = torch.device("cuda")
LAYOUTS = {
    656: (torch.float8_e4m3fn, 656, torch.uint8),
    1152: (torch.bfloat16, 576, torch.bfloat16),
}


def time_ms(fn, iters, warmup=3, stream=None):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        fn()
        e.record(stream)
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def fill_random_pinned(t: torch.Tensor, chunk_bytes=1 << 28):
    """Random bytes into a (large) host tensor via the GPU: CPU RNG would take seconds."""
    flat = t.view(-1).view(torch.uint8)
    for off in range(0, flat.numel(), chunk_bytes):
        n = min(chunk_bytes, flat.numel() - off)
        flat[off : off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV))
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# 1. per-layer load
# --------------------------------------------------------------------------------------------------


class LoadTarget:
    """The host pool + device rows the loads use; real pools + controller when importable."""

    def __init__(self, row, host_rows, dev_rows):
        self.row = row
        self.path = "direct"
        self.cc = None
        try:
            self._build_controller(row, host_rows, dev_rows)
            self.path = "controller.load_one_layer"
        except Exception:
            self.error = traceback.format_exc(limit=3)
            self.host = torch.empty(host_rows, row, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.zeros(dev_rows, row, dtype=torch.uint8, device=DEV)
            self.host_view, self.dev_view = T.RowView(self.host), T.RowView(self.dev)
        fill_random_pinned(self.host)

    def _build_controller(self, row, host_rows, dev_rows):
        from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
            KVOffloadDSATokenToKVPool,
            KVOffloadTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool

        dtype, dim, _ = LAYOUTS[row]
        phys = -(-dev_rows // 64) * 64
        pool = KVOffloadDSATokenToKVPool(
            phys, 64 * 64, 64, 512, dtype, 64, 1, "cuda", 128, False, dim
        )
        alloc = KVOffloadTokenToKVPoolAllocator(64 * 64, phys, 64, dtype, "cuda", pool, False)
        host = KVOffloadHostPool(
            pool, host_size_gb=(host_rows + 64) * row / 1e9, host_reserve_bytes=0
        )
        self.cc = KVOffloadCacheController(alloc, host)
        _KEEP_ALIVE.append((pool, alloc, host, self.cc))
        self.host = host.host_row_view(0)
        self.dev = pool.device_row_view(0)

    def load(self, si, di, cfg, num_valid=None):
        if self.cc is not None:
            self.cc.load_config = cfg
            self.cc.load_one_layer(0, si, di, num_valid)
        else:
            T.copy_rows(self.host_view, self.dev_view, si, di, num_valid, cfg)


def bench_loads(row, sizes, grid, iters, budget_s, t0):
    host_rows = max(1 << 20, 4 * max(sizes))
    tgt = LoadTarget(row, host_rows, 2 * max(sizes))
    sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    out = {"row_bytes": row, "path": tgt.path, "host_rows": host_rows, "sizes": {}}
    if tgt.path == "direct":
        out["controller_error"] = tgt.error
    idx = {}
    for n in sizes:
        si = torch.randperm(host_rows, device=DEV)[:n].to(torch.int32)
        di = torch.randperm(2 * max(sizes), device=DEV)[:n].to(torch.int32)
        idx[n] = (si, di)

    # pinned memcpy of the same bytes, same run
    memcpy = {}
    for n in sizes:
        h = torch.empty(n * row, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(n * row, dtype=torch.uint8, device=DEV)
        ms = time_ms(lambda: d.copy_(h, non_blocking=True), iters)
        memcpy[n] = n * row / ms / 1e6

    # phase 1: coarse sweep at the middle size
    n_sweep = sizes[len(sizes) // 2]
    si, di = idx[n_sweep]
    sweep = []
    for rows, warps, word, progs_per_sm in grid:
        if time.time() - t0 > budget_s:
            out["sweep_truncated"] = True
            break
        cfg = T.CopyLaunchConfig(progs_per_sm * sm, rows, warps, word)
        try:
            ms = time_ms(lambda: tgt.load(si, di, cfg), iters)
        except Exception as e:
            sweep.append({"cfg": cfg.__dict__, "error": repr(e)[:200]})
            continue
        sweep.append({"cfg": cfg.__dict__, "ms": ms, "GBps": n_sweep * row / ms / 1e6})
    ok = sorted((s for s in sweep if "ms" in s), key=lambda s: s["ms"])
    out["sweep_at_rows"] = n_sweep
    out["sweep"] = ok + [s for s in sweep if "ms" not in s]

    # phase 2: the best few at every size, correctness of the best
    finalists = [T.CopyLaunchConfig(**s["cfg"]) for s in ok[:4]]
    finalists.append(T.default_launch_config(DEV))
    for n in sizes:
        si, di = idx[n]
        nv = torch.tensor([n], dtype=torch.int32, device=DEV)
        res = []
        for cfg in finalists:
            ms = time_ms(lambda: tgt.load(si, di, cfg), iters)
            ms_nv = time_ms(lambda: tgt.load(si, di, cfg, nv), iters)
            res.append((ms, ms_nv, cfg))
        ms, ms_nv, best = min(res, key=lambda r: r[0])
        tgt.dev.zero_()
        tgt.load(si, di, best, nv)
        torch.cuda.synchronize()
        exact = torch.equal(tgt.dev[di.long()].cpu(), tgt.host[si.long().cpu()])
        dflt = res[-1]
        out["sizes"][n] = {
            "bytes": n * row,
            "memcpy_GBps": memcpy[n],
            "best_cfg": best.__dict__,
            "best_ms": ms,
            "best_GBps": n * row / ms / 1e6,
            "best_with_num_valid_ms": ms_nv,
            "best_pct_of_memcpy": 100 * (n * row / ms / 1e6) / memcpy[n],
            "default_cfg": dflt[2].__dict__,
            "default_GBps": n * row / dflt[0] / 1e6,
            "bit_exact": bool(exact),
        }
    return out


# --------------------------------------------------------------------------------------------------
# 2. prompt backup
# --------------------------------------------------------------------------------------------------


def bench_backup(row, tokens, layers, iters, configs):
    dtype, dim, _ = LAYOUTS[row]
    res = {"row_bytes": row, "tokens": tokens, "layers": layers, "bytes": tokens * layers * row}
    try:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
        from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
            KVOffloadDSATokenToKVPool,
            KVOffloadTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
    except Exception:
        res["controller_error"] = traceback.format_exc(limit=3)
        return bench_backup_direct(res, row, tokens, layers, iters, configs)

    size = tokens + 2 * 64
    pool = KVOffloadDSATokenToKVPool(
        size, size, 64, 512, dtype, 64, layers, "cuda", 128, False, dim
    )
    alloc = KVOffloadTokenToKVPoolAllocator(size, size, 64, dtype, "cuda", pool, False)
    host = KVOffloadHostPool(
        pool, host_size_gb=(tokens + 64) * row * layers / 1e9, host_reserve_bytes=0
    )
    cc = KVOffloadCacheController(alloc, host)
    _KEEP_ALIVE.append((pool, alloc, host, cc))
    r2t = ReqToTokenPool(1, size, "cuda", False)
    for l in range(layers):
        pool.device_row_view(l).random_(0, 256) if row == 656 else pool.kv_buffer[l].normal_()
    res["path"] = "controller.backup_batch+poll"
    res["free_counts_before"] = alloc.free_counts()
    seq = torch.tensor([tokens])
    z = torch.zeros(1, dtype=torch.int64)

    def run_once(cfg, check=False):
        locs = alloc.alloc_extend(
            z.cuda(), z, seq.cuda(), seq, torch.full((1,), -1, device="cuda"), tokens
        )
        r2t.req_to_token[0, :tokens] = locs.to(torch.int32)
        phys = alloc.full_to_hisparse_device_index_mapping[locs]
        cc.backup_config = cfg
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w0 = time.perf_counter()
        s.record()
        full = tokens // 64 * 64  # whole pages; the tail stays on the GPU
        cc.backup_batch([("bench", r2t.req_to_token[0, :full].to(torch.int64), 0, full)])
        e.record(cc.write_stream)
        submit_ms = (time.perf_counter() - w0) * 1e3
        done = []
        while not done:
            done = cc.poll()
        wall_ms = (time.perf_counter() - w0) * 1e3
        e.synchronize()
        exact = None
        if check:
            l = layers - 1
            exact = torch.equal(
                host.host_row_view(l)[alloc.loc_to_host[locs].cpu()].cuda(),
                pool.device_row_view(l)[phys],
            )
        cc.cancel_tag("bench")  # finish, as the coordinator releases a request
        alloc.free(locs)
        return s.elapsed_time(e), wall_ms, submit_ms, exact

    out = []
    for cfg in configs:
        run_once(cfg)  # warmup / compile
        runs = [run_once(cfg) for _ in range(iters)]
        exact = run_once(cfg, check=True)[3]
        gpu_ms = statistics.median(r[0] for r in runs)
        out.append(
            {
                "cfg": cfg.__dict__,
                "gpu_ms": gpu_ms,
                "GBps": res["bytes"] / gpu_ms / 1e6,
                "wall_ms_until_poll_done": statistics.median(r[1] for r in runs),
                "host_submit_ms": statistics.median(r[2] for r in runs),
                "bit_exact_last_layer": bool(exact),
            }
        )
    res["free_counts_after"] = alloc.free_counts()
    res["runs"] = sorted(out, key=lambda r: r["gpu_ms"])
    res["best"] = res["runs"][0]
    return res


def bench_backup_direct(res, row, tokens, layers, iters, configs):
    res["path"] = "copy_rows_all_layers (direct)"
    dev = [
        torch.randint(0, 256, (tokens + 64, row), dtype=torch.uint8, device=DEV)
        for _ in range(layers)
    ]
    host_all = torch.empty(layers, tokens + 64, row, dtype=torch.uint8, pin_memory=True)
    host = [host_all[l] for l in range(layers)]
    dv, hv = [T.RowView(d) for d in dev], [T.RowView(h) for h in host]
    src = torch.arange(64, tokens + 64, device=DEV)
    dst = torch.arange(tokens, device=DEV)
    stream = torch.cuda.Stream()
    out = []
    for cfg in configs:

        def f():
            with torch.cuda.stream(stream):
                T.copy_rows_all_layers(dv, hv, src, dst, config=cfg)

        ms = time_ms(f, iters, stream=stream)
        out.append({"cfg": cfg.__dict__, "gpu_ms": ms, "GBps": res["bytes"] / ms / 1e6})
    res["runs"] = sorted(out, key=lambda r: r["gpu_ms"])
    res["best"] = res["runs"][0]
    res["bit_exact_last_layer"] = bool(torch.equal(host[-1][:tokens].cuda(), dev[-1][64:]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "bench_host_tier.json")
    )
    ap.add_argument("--rows", default="656,1152")
    ap.add_argument("--sizes", default="4096,26214,131072")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="small sweep grid")
    ap.add_argument("--sweep-budget-s", type=float, default=45.0, help="per row size")
    ap.add_argument("--backup-tokens", type=int, default=32768)
    ap.add_argument("--backup-layers", type=int, default=61)
    args = ap.parse_args()

    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import prepare_environment, write_results

    prepare_environment("cuda")  # the upstream pools read a published configuration
    t_start = time.time()
    rows = [int(x) for x in args.rows.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.quick:
        grid = list(itertools.product([2, 4, 8], [4], [8], [2, 4]))
    else:
        grid = list(itertools.product([1, 2, 4, 8, 16], [2, 4, 8], [8, 4], [1, 2, 4, 8]))
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transfer_module": TRANSFER_SRC,
        "loads": {},
        "backup": {},
    }
    for row in rows:
        t0 = time.time()
        result["loads"][row] = bench_loads(row, sizes, grid, args.iters, args.sweep_budget_s, t0)
        torch.cuda.empty_cache()

    for row in rows:
        sweep = result["loads"][row]["sweep"]
        cfgs = [T.CopyLaunchConfig(**s["cfg"]) for s in sweep[:2] if "ms" in s]
        cfgs += [T.default_backup_launch_config(DEV), T.default_launch_config(DEV)]
        result["backup"][row] = bench_backup(row, args.backup_tokens, args.backup_layers, 3, cfgs)
    result["total_s"] = time.time() - t_start

    write_results(args.out, json.loads(json.dumps(result, default=str)))

    print(f"device {result['device']}  torch {result['torch']}  triton {result['triton']}")
    print(f"transfer module from {TRANSFER_SRC}")
    print(
        f"{'row':>5} {'rows':>7} {'MB':>7} {'memcpy':>7} {'best':>7} {'%':>5} {'dflt':>7} exact  best cfg"
    )
    for row, r in result["loads"].items():
        for n, s in r["sizes"].items():
            c = s["best_cfg"]
            print(
                f"{row:>5} {n:>7} {s['bytes'] / 1e6:>7.1f} {s['memcpy_GBps']:>7.1f} "
                f"{s['best_GBps']:>7.1f} {s['best_pct_of_memcpy']:>5.1f} {s['default_GBps']:>7.1f} "
                f"{str(s['bit_exact']):>5}  progs={c['num_programs']} rows={c['rows_per_program']} "
                f"warps={c['num_warps']} word={c['word_bytes']}"
            )
        print(f"      path: {r['path']}")
    for row, b in result["backup"].items():
        best = b["best"]
        print(
            f"backup {row} B x {b['layers']} layers x {b['tokens']} tokens "
            f"({b['bytes'] / 1e9:.2f} GB) via {b['path']}: {best['gpu_ms']:.1f} ms "
            f"= {best['GBps']:.1f} GB/s  cfg={best['cfg']}"
        )
    print(f"total {result['total_s']:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
