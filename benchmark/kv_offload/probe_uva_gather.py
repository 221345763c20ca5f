"""Why is the UVA gather slower on a large host pool? One-run probe on the GPU machine.

Gathers ~24.5K random 656 B rows (the bs128/32K/10% miss volume) from pinned host buffers of growing
size, with host memory pinned by torch (cudaHostAlloc) or mmap'ed with transparent huge pages and then
cudaHostRegister'ed, across launch shapes of ``transfer.copy_rows``; memcpy of the same bytes as the
ceiling. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import mmap
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "kvo_transfer", ROOT / "python/sglang/srt/mem_cache/sparsity/kv_offload/transfer.py"
)
transfer = importlib.util.module_from_spec(spec)
sys.modules["kvo_transfer"] = transfer
spec.loader.exec_module(transfer)

ROW = 656
MADV_HUGEPAGE = 14


def bench(fn, iters=20):
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


def thp_pinned(nbytes):
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    rc_madv = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(1)  # fault the pages in (huge where THP allows)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    return t, buf, int(rc_madv), int(rc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "probe_uva_gather.json")
    )
    ap.add_argument("--rows", type=int, default=24534)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.rows
    res = {"rows": n, "row_bytes": ROW, "points": []}
    dst = torch.zeros((4 * n, ROW), dtype=torch.uint8, device=dev)
    di = torch.randperm(4 * n, device=dev)[:n].to(torch.int32)
    ref_h = torch.empty(n * ROW, dtype=torch.uint8, pin_memory=True)
    ref_d = torch.empty_like(ref_h, device=dev)
    res["memcpy_ms"] = bench(lambda: ref_d.copy_(ref_h, non_blocking=True))
    configs = [
        (528, 4, 4),
        (1056, 4, 4),
        (2112, 4, 4),
        (4224, 2, 4),
        (4224, 4, 4),
        (8448, 2, 2),
        (1056, 8, 8),
        (264, 16, 8),
    ]
    for kind in ("torch_pinned",):
        for gb in (0.6, 2.8, 11.0):
            rows_total = int(gb * 1e9) // ROW
            if kind == "torch_pinned":
                host = torch.empty((rows_total, ROW), dtype=torch.uint8, pin_memory=True)
                extra = {}
            else:
                flat, keep, rc_madv, rc = thp_pinned(rows_total * ROW)
                host = flat.view(rows_total, ROW)
                extra = {"madvise_rc": rc_madv, "register_rc": rc}
            host[:: max(1, rows_total // 4096)].fill_(3)
            si = torch.randint(0, rows_total, (n,), device=dev, dtype=torch.int64)
            sorted_si = torch.sort(si).values
            # Fresh addresses every call, as in decode (repeating one list keeps GPU TLBs warm).
            fresh = [
                torch.randint(0, rows_total, (n,), device=dev, dtype=torch.int64) for _ in range(32)
            ]
            it = iter(range(10**9))
            view_h, view_d = transfer.RowView(host), transfer.RowView(dst)
            for progs, rpp, warps in configs:
                cfg = transfer.CopyLaunchConfig(progs, rpp, warps)
                for order, idx in (("random", si), ("sorted", sorted_si), ("fresh", None)):
                    if idx is None:
                        fn = lambda: transfer.copy_rows(  # noqa: E731
                            view_h, view_d, fresh[next(it) % 32], di, config=cfg
                        )
                    else:
                        fn = lambda: transfer.copy_rows(
                            view_h, view_d, idx, di, config=cfg
                        )  # noqa: E731
                    ms = bench(fn)
                    res["points"].append(
                        dict(
                            kind=kind,
                            host_gb=gb,
                            programs=progs,
                            rows_per_program=rpp,
                            warps=warps,
                            order=order,
                            ms=ms,
                            GBps=n * ROW / ms / 1e6,
                            **extra,
                        )
                    )
            transfer.copy_rows(view_h, view_d, sorted_si, di)
            torch.cuda.synchronize()
            ok = torch.equal(dst[di.long()].cpu(), host[sorted_si.cpu()])
            res["points"][-1]["exact"] = bool(ok)
            best = max(
                (p for p in res["points"] if p["kind"] == kind and p["host_gb"] == gb),
                key=lambda p: p["GBps"],
            )
            print(f"{kind:15s} {gb:5.1f} GB  best {best['GBps']:.1f} GB/s {best}", flush=True)
            if kind == "torch_pinned":
                del host
            else:
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
                del host, flat
            torch.cuda.empty_cache()
    res["memcpy_GBps"] = n * ROW / res["memcpy_ms"] / 1e6
    print("memcpy", res["memcpy_GBps"])
    write_results(args.out, res)


if __name__ == "__main__":
    main()
