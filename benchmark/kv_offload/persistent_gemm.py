"""A persistent GEMM for the decode-compute stand-in (``bench_exposed.py --gemm persistent``).

A fixed number of programs loop over the output's tiles, loading them through TMA descriptors, as
DeepGEMM's kernels do: their grid is the SM count ``deep_gemm.set_num_sms`` sets, which SGLang
lowers with ``configure_deep_gemm_num_sms`` while other work holds SMs (two-batch overlap, the DSA
indexer beside a pipeline-parallel receive). cuBLAS's GEMMs instead launch one block per output
tile in waves, so an SM partition taken from them costs whole waves. ``programs`` is the knob: the
device's SM count, or that minus a partition's SMs.
"""

from __future__ import annotations

import functools
import itertools
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _persistent_gemm_kernel(
    x_desc,
    w_desc,
    y_desc,
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
        om = (tile % tiles_m) * BLOCK_M
        on = (tile // tiles_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc = tl.dot(x_desc.load([om, k]), w_desc.load([k, on]), acc)
        y_desc.store([om, on], acc.to(y_desc.dtype))


def padded(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised ``(rows, cols)`` view whose row stride is a multiple of 16 bytes, as a TMA
    descriptor needs (``persistent_matmul``'s operands)."""
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return torch.empty((rows, -(-cols // align) * align), dtype=dtype, device=device)[:, :cols]


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
    """``out = x @ w`` by ``programs`` programs looping over the tiles of ``out``, each loading
    its tiles through TMA descriptors (row-major operands, rows 16-byte aligned: ``padded``);
    capture-safe (fixed grid, no allocation)."""
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or out.shape != (m, n):
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, w {tuple(w.shape)}, out "
            f"{tuple(out.shape)}"
        )
    for name, t in (("x", x), ("w", w), ("out", out)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(
                f"{name} needs unit column stride and 16-byte aligned rows (strides "
                f"{t.stride()}); allocate it with persistent_gemm.padded"
            )
    if programs < 1:
        raise ValueError(f"programs={programs}: need at least one")
    block_m = 64 if m <= 64 else 128
    _persistent_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(w, [block_k, block_n]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages or (4 if block_m == 64 else 3),
        num_warps=num_warps,
    )


SHAPES = tuple(itertools.product((64, 128, 256), (64, 128), (3, 4, 5), (4, 8)))
"""Launch shapes ``tune`` tries: block_n, block_k, stages, num_warps."""


def tune(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, programs: int
) -> List[Tuple[Dict[str, int], Optional[float]]]:
    """Every shape of ``SHAPES`` with its time in ms on this GEMM, timed alone (None: it does not
    launch, e.g. too much shared memory); the fastest is ``min(..., key=fastest)``."""
    import triton.testing

    timed = []
    for bn, bk, st, nw in SHAPES:
        cfg = dict(block_n=bn, block_k=bk, stages=st, num_warps=nw)
        run = functools.partial(persistent_matmul, x, w, out, programs, **cfg)
        try:
            timed.append((cfg, triton.testing.do_bench(run, warmup=5, rep=20)))
        except Exception:  # noqa: BLE001 (a shape the device cannot launch)
            timed.append((cfg, None))
    return timed


def fastest(item: Tuple[Dict[str, int], Optional[float]]) -> float:
    return float("inf") if item[1] is None else item[1]


def main() -> None:
    """Time every launch shape against torch.matmul on the stand-in's MoE GEMM shapes (CUDA)."""
    import argparse

    import triton.testing

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--m", default="32,128", help="rows (the batch)")
    p.add_argument("--n", default="65784,99686", help="columns, one per --m")
    p.add_argument("--k", type=int, default=7168)
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n in zip(map(int, a.m.split(",")), map(int, a.n.split(","))):
        x = torch.randn((m, a.k), dtype=torch.bfloat16, device="cuda")
        w = padded(a.k, n, torch.bfloat16, "cuda").normal_()
        out = padded(m, n, torch.bfloat16, "cuda")
        ref_out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        ref = triton.testing.do_bench(lambda: torch.matmul(x, w, out=ref_out))
        print(f"m {m} n {n}: torch.matmul {ref * 1e3:.0f} us", flush=True)
        for cfg, t in sorted(tune(x, w, out, sms), key=fastest):
            shape = "n{block_n} k{block_k} s{stages} w{num_warps}".format(**cfg)
            took = "does not launch" if t is None else f"{t * 1e3:.0f} us ({ref / t:.2f}x torch)"
            print(f"  {shape}: {took}")


if __name__ == "__main__":
    main()
