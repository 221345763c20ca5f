"""A persistent GEMM for the decode-compute stand-in (``bench_exposed.py --gemm persistent``).

A fixed number of programs loop over the output's tiles, as DeepGEMM's kernels do: their grid is
the SM count ``deep_gemm.set_num_sms`` sets, which SGLang lowers with
``configure_deep_gemm_num_sms`` while other work holds SMs (two-batch overlap, the DSA indexer
beside a pipeline-parallel receive). cuBLAS's GEMMs instead launch one block per output tile in
waves, so an SM partition taken from them costs whole waves. ``programs`` is the knob: the device's
SM count, or that minus a partition's SMs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _persistent_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    for tile in range(tl.program_id(0), tiles_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rm = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            rk = k + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + rm[:, None] * K + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_ptr + rk[:, None] * N + rn[None, :],
                mask=(rk[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        out = y_ptr + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def persistent_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    programs: int,
    block_n: int = 64,
    block_k: int = 128,
    stages: Optional[int] = None,
    num_warps: int = 4,
) -> None:
    """``out = x @ w`` (row-major, contiguous) by ``programs`` programs looping over the tiles of
    ``out``; capture-safe (fixed grid, no allocation)."""
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or out.shape != (m, n):
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, w {tuple(w.shape)}, out "
            f"{tuple(out.shape)}"
        )
    if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        raise ValueError("x, w and out must be contiguous")
    if programs < 1:
        raise ValueError(f"programs={programs}: need at least one")
    block_m = 64 if m <= 64 else 128
    _persistent_gemm_kernel[(programs,)](
        x,
        w,
        out,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages or (4 if block_m == 64 else 3),
        num_warps=num_warps,
    )


def main() -> None:
    """Time launch shapes against torch.matmul on the stand-in's MoE GEMM shapes (CUDA)."""
    import argparse
    import itertools

    import triton.testing

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--m", default="32,128", help="rows (the batch)")
    p.add_argument("--n", default="65784,99686", help="columns, one per --m")
    p.add_argument("--k", type=int, default=7168)
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n in zip(map(int, a.m.split(",")), map(int, a.n.split(","))):
        x = torch.randn((m, a.k), dtype=torch.bfloat16, device="cuda")
        w = torch.randn((a.k, n), dtype=torch.bfloat16, device="cuda")
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        ref = triton.testing.do_bench(lambda: torch.matmul(x, w, out=out))
        print(f"m {m} n {n}: torch.matmul {ref * 1e3:.0f} us", flush=True)
        for bn, bk, st, nw in itertools.product((64, 128, 256), (64, 128), (3, 4, 5), (4, 8)):
            try:
                run = lambda: persistent_matmul(x, w, out, sms, bn, bk, st, nw)  # noqa: E731
                t = triton.testing.do_bench(run)
            except Exception as e:  # noqa: BLE001 (out of shared memory: skipped)
                print(f"  n{bn} k{bk} s{st} w{nw}: {type(e).__name__}")
                continue
            print(f"  n{bn} k{bk} s{st} w{nw}: {t * 1e3:.0f} us ({ref / t:.2f}x torch)", flush=True)


if __name__ == "__main__":
    main()
