"""How the host buffer is mapped into the GPU decides the UVA gather rate. One-run probe (GPU).

Two questions, answered in one run with memcpy of the same bytes as the ceiling:

1. **Mapping**: ~24.5K random 656 B rows (the bs 128 / 32K / 10 % miss volume) gathered with fresh
   addresses every call from host buffers of 2.8, 11 and 22 GB, allocated three ways:
   ``torch`` pinned (``cudaHostAlloc``), ``register`` (``malloc`` + ``cudaHostRegister``, upstream's
   ``alloc_with_host_register``) and ``vmm`` (driver VMM: ``cuMemCreate`` on a host location with
   the recommended granularity, ``cuMemMap`` + ``cuMemSetAccess``). The first two are mapped into
   the GPU's page tables in small pages, so a random row is almost always a GPU TLB miss once the
   buffer is larger than the TLB reach; the VMM allocation is backed by large physically contiguous
   chunks.
2. **Row size**: with warm TLBs (the same index list every call), the useful bandwidth for rows of
   512 ... 1280 B, to see the read granularity of PCIe gathers (656 B rows start 16 B aligned, so
   each one touches 11 64-byte lines; 640 B and 1152 B rows touch whole lines only).

Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import write_results  # noqa: E402
from probe_uva_gather import bench, transfer  # noqa: E402  (same loader and timing loop)

ROW = 656


# ------------------------------------------------------------------------------------ driver VMM
class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Loc),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA = 1, 2, 3


class VmmHostBuffer:
    """Pinned host memory from ``cuMemCreate`` mapped for the GPU (and the CPU where allowed)."""

    def __init__(self, nbytes: int, loc_type: int, loc_id: int, device: int = 0):
        self.cu = ctypes.CDLL("libcuda.so.1")
        prop = _Prop()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Loc(loc_type, loc_id)
        gran = ctypes.c_size_t()
        self._ok(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1))
        self.granularity = gran.value
        self.size = (nbytes + gran.value - 1) // gran.value * gran.value
        self.handle = ctypes.c_ulonglong()
        self._ok(
            self.cu.cuMemCreate(
                ctypes.byref(self.handle),
                ctypes.c_size_t(self.size),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            )
        )
        self.ptr = ctypes.c_ulonglong()
        self._ok(
            self.cu.cuMemAddressReserve(
                ctypes.byref(self.ptr),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(gran.value),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            )
        )
        self._ok(
            self.cu.cuMemMap(
                self.ptr,
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(0),
                self.handle,
                ctypes.c_ulonglong(0),
            )
        )
        acc = _Access(_Loc(LOC_DEVICE, device), 3)  # READWRITE
        self._ok(
            self.cu.cuMemSetAccess(
                self.ptr, ctypes.c_size_t(self.size), ctypes.byref(acc), ctypes.c_size_t(1)
            )
        )
        # CPU access: allowed for host locations on recent drivers; recorded, not required here.
        host_acc = _Access(_Loc(loc_type, loc_id), 3)
        self.cpu_access_rc = int(
            self.cu.cuMemSetAccess(
                self.ptr, ctypes.c_size_t(self.size), ctypes.byref(host_acc), ctypes.c_size_t(1)
            )
        )

    @staticmethod
    def _ok(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"CUDA driver call failed with CUresult {rc}")

    def data_ptr(self) -> int:
        return self.ptr.value

    def close(self) -> None:
        self.cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size))
        self.cu.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size))
        self.cu.cuMemRelease(self.handle)


class _RawRows:
    """A kernel argument for a raw GPU-visible address (``transfer`` only needs data_ptr/dtype)."""

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


def _launch_gather(src_ptr: int, dst: torch.Tensor, src_idx, dst_idx, row: int, cfg):
    """``transfer``'s row-copy kernel on a raw source address (the VMM buffer has no tensor)."""
    words = row // 8 if row % 8 == 0 else row // 4
    dt = torch.int64 if row % 8 == 0 else torch.int32
    block = 1 << (words - 1).bit_length()
    transfer._copy_rows_kernel[(cfg.num_programs,)](
        _RawRows(src_ptr, dt),
        dst.view(dt),
        src_idx,
        dst_idx,
        src_idx,
        src_idx.shape[0],
        HAS_NUM_VALID=False,
        ROW_WORDS=words,
        BLOCK_W=block,
        ROWS=cfg.rows_per_program,
        num_warps=cfg.num_warps,
    )


def _fill_from_device(ptr: int, nbytes: int, dev: torch.device) -> None:
    """Random content written by the GPU through the mapping (as backups do)."""
    cu = ctypes.CDLL("libcuda.so.1")
    chunk = 256 << 20
    src = torch.randint(0, 256, (chunk,), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    for off in range(0, nbytes, chunk):
        n = min(chunk, nbytes - off)
        rc = cu.cuMemcpy(
            ctypes.c_ulonglong(ptr + off), ctypes.c_ulonglong(src.data_ptr()), ctypes.c_size_t(n)
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpy failed: {rc}")
    torch.cuda.synchronize()


def _alloc(kind: str, nbytes: int, numa: int, dev: torch.device):
    if kind == "torch":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t, t.data_ptr(), {}
    if kind == "register":
        t = torch.empty(nbytes, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {rc}")
        return t, t.data_ptr(), {}
    loc = LOC_HOST_NUMA if kind == "vmm_numa" else LOC_HOST
    b = VmmHostBuffer(nbytes, loc, numa if kind == "vmm_numa" else 0, dev.index or 0)
    return b, b.data_ptr(), {"granularity": b.granularity, "cpu_access_rc": b.cpu_access_rc}


def _free(kind: str, obj) -> None:
    if kind == "register":
        torch.cuda.cudart().cudaHostUnregister(obj.data_ptr())
    elif kind.startswith("vmm"):
        obj.close()
    del obj
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def probe_mapping(args, dev, res: Dict) -> None:
    n = args.rows
    cfg = transfer.CopyLaunchConfig(2112, 4, 4)
    dst = torch.zeros((4 * n, ROW), dtype=torch.uint8, device=dev)
    di = torch.randperm(4 * n, device=dev)[:n].to(torch.int64)
    for gb in args.sizes_gb:
        rows_total = int(gb * 1e9) // ROW
        for kind in args.kinds:
            t0 = time.time()
            try:
                obj, ptr, extra = _alloc(kind, rows_total * ROW, args.numa, dev)
            except Exception as e:  # a kind the driver refuses is a result, not a crash
                res["mapping"].append(dict(kind=kind, host_gb=gb, error=str(e)))
                print(f"{kind:9s} {gb:5.1f} GB  error {e}", flush=True)
                continue
            _fill_from_device(ptr, rows_total * ROW, dev)
            alloc_s = time.time() - t0
            fresh = [
                torch.randint(0, rows_total, (n,), device=dev, dtype=torch.int64) for _ in range(32)
            ]
            it = iter(range(10**9))
            pt = dict(kind=kind, host_gb=gb, alloc_and_fill_s=alloc_s, **extra)
            pt["fresh_ms"] = bench(
                lambda: _launch_gather(ptr, dst, fresh[next(it) % 32], di, ROW, cfg)
            )
            pt["repeat_ms"] = bench(lambda: _launch_gather(ptr, dst, fresh[0], di, ROW, cfg))
            for k in ("fresh", "repeat"):
                pt[f"{k}_GBps"] = n * ROW / pt[f"{k}_ms"] / 1e6
            # Exactness: the gathered rows equal the host rows (read back through the mapping).
            _launch_gather(ptr, dst, fresh[1], di, ROW, cfg)
            torch.cuda.synchronize()
            back = torch.empty((n, ROW), dtype=torch.uint8, device=dev)
            cu = ctypes.CDLL("libcuda.so.1")
            idx = fresh[1][:256].tolist()
            for j, r in enumerate(idx):
                cu.cuMemcpy(
                    ctypes.c_ulonglong(back[j].data_ptr()),
                    ctypes.c_ulonglong(ptr + r * ROW),
                    ctypes.c_size_t(ROW),
                )
            torch.cuda.synchronize()
            pt["exact"] = bool(torch.equal(back[: len(idx)], dst[di[: len(idx)]]))
            res["mapping"].append(pt)
            print(
                f"{kind:9s} {gb:5.1f} GB  fresh {pt['fresh_GBps']:.1f} GB/s  repeat "
                f"{pt['repeat_GBps']:.1f} GB/s  exact {pt['exact']}  {extra}",
                flush=True,
            )
            _free(kind, obj)
            del obj


def probe_row_sizes(args, dev, res: Dict) -> None:
    n = args.rows
    cfg = transfer.CopyLaunchConfig(2112, 4, 4)
    for row in args.row_sizes:
        host = torch.empty((n * 8, row), dtype=torch.uint8, pin_memory=True)
        host[::97].fill_(5)
        dst = torch.zeros((n, row), dtype=torch.uint8, device=dev)
        si = torch.randperm(n * 8, device=dev)[:n]
        di = torch.arange(n, device=dev)
        hv, dv = transfer.RowView(host), transfer.RowView(dst)
        ms = bench(lambda: transfer.copy_rows(hv, dv, si, di, config=cfg))
        flat_h = torch.empty(n * row, dtype=torch.uint8, pin_memory=True)
        flat_d = torch.empty(n * row, dtype=torch.uint8, device=dev)
        mc = bench(lambda: flat_d.copy_(flat_h, non_blocking=True))
        # 64 B lines touched by a row starting at a 16 B-aligned offset (row % 64 decides).
        starts = (torch.arange(64, dtype=torch.int64) * row) % 64
        lines = ((starts + row + 63) // 64).float().mean().item()
        pt = dict(
            row_bytes=row,
            ms=ms,
            GBps=n * row / ms / 1e6,
            memcpy_ms=mc,
            memcpy_GBps=n * row / mc / 1e6,
            lines64_per_row=lines,
            line_GBps=n * lines * 64 / ms / 1e6,
        )
        pt["frac_memcpy"] = pt["GBps"] / pt["memcpy_GBps"]
        res["row_sizes"].append(pt)
        print(
            f"row {row:5d} B  {pt['GBps']:.1f} GB/s = {pt['frac_memcpy']:.1%} of memcpy; "
            f"{lines:.2f} lines/row, {pt['line_GBps']:.1f} GB/s of 64 B lines",
            flush=True,
        )
        host = flat_h = None  # unpin before the next row size


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "probe_host_mapping.json")
    )
    ap.add_argument("--rows", type=int, default=24534)
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[2.8, 11.0, 22.0])
    ap.add_argument("--kinds", nargs="+", default=["torch", "register", "vmm_host", "vmm_numa"])
    ap.add_argument("--numa", type=int, default=0, help="host NUMA node for vmm_numa")
    ap.add_argument(
        "--row-sizes", type=int, nargs="+", default=[512, 576, 640, 656, 704, 768, 1152, 1280]
    )
    ap.add_argument("--skip-mapping", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.cuda.init()
    res: Dict = {
        "rows": args.rows,
        "args": vars(args),
        "mapping": [],
        "row_sizes": [],
        "env": {"torch": torch.__version__, "device": torch.cuda.get_device_name()},
    }
    probe_row_sizes(args, dev, res)
    write_results(args.out, res)
    if not args.skip_mapping:
        probe_mapping(args, dev, res)
    write_results(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
