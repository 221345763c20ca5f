"""Benchmark-only: the stand-ins' decode top-k replay (``kv_offload_standins.replay_scores``) as
one Triton kernel for CUDA servers.

The torch replay is a chain of about a hundred elementwise kernels a layer over ``[rows,
context]`` (an integer hash, Box-Muller in float64, the blend), which every server of a serving
benchmark pays in its step (1.0-1.4 ms a 4-layer step on an H100, JOURNAL.md). This kernel computes
the same scores in one pass: the same hash in int64, the same float64 normals, the same float32
blend. ``kv_offload_standins._replayed_logits`` calls it on CUDA; the torch replay stays the
reference (``test_topk_replay.py`` compares them under the interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _low32(h):
    """``h & 0xFFFFFFFF`` for any int64 (arithmetic shifts floor), with no 64-bit literal."""
    return h - ((h >> 32) << 32)


@triton.jit
def _mix(h):
    h = _low32((h ^ (h >> 16)) * 0x45D9F3B)
    h = _low32((h ^ (h >> 16)) * 0x45D9F3B)
    return h ^ (h >> 16)


@triton.jit
def _hash_normal(key, pos, step):
    """``kv_offload_standins._hash_normal``: a standard normal per (key, position, step)."""
    base = (pos * 73856093) ^ (step * 19349663) ^ (key * 83492791)
    u1 = (_mix(base).to(tl.float64) + 0.5) / 4294967296.0
    u2 = (_mix(base ^ 0x5BD1E995).to(tl.float64) + 0.5) / 4294967296.0
    return (tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)).to(tl.float32)


@triton.jit
def _drift(key, pos, n, period):
    """``kv_offload_standins._drift``: unit-variance relevance at context length ``n``."""
    k = n // period
    f = (n % period).to(tl.float64) / period
    g = (1.0 - f) * _hash_normal(key, pos, k).to(tl.float64)
    g += f * _hash_normal(key, pos, k + 1).to(tl.float64)
    return (g / tl.sqrt((1.0 - f) * (1.0 - f) + f * f)).to(tl.float32)


@triton.jit
def _replay_logits_kernel(
    out_ptr,
    lens_ptr,
    width,
    layer_key,
    period,
    share_a,
    share_b,
    SINKS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    pos = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    n = tl.load(lens_ptr + row).to(tl.int64)
    zero = tl.zeros([BLOCK], tl.int64)
    score = share_a * _drift(zero, pos, n, period)
    score = score + share_b * _drift(zero + layer_key, pos, n, period)
    score = tl.where((pos < SINKS) | (pos >= n - WINDOW), 1e4, score)
    score = tl.where(pos >= n, float("-inf"), score)
    tl.store(out_ptr + row.to(tl.int64) * width + pos, score, mask=pos < width)


def replay_logits(
    layer: int,
    lens: torch.Tensor,
    width: int,
    period: int,
    share: float,
    sinks: int,
    window: int,
) -> torch.Tensor:
    """``[rows, width]`` float32 replay scores of ``layer`` for rows of context ``lens``
    (``[rows, 1]``), ``-inf`` at or past each row's length: ``replay_scores`` then its mask."""
    rows = lens.shape[0]
    out = torch.empty(rows, width, dtype=torch.float32, device=lens.device)
    if rows and width:
        grid = (rows, triton.cdiv(width, BLOCK))
        _replay_logits_kernel[grid](
            out,
            lens.reshape(-1).contiguous(),
            width,
            layer + 1,
            period,
            math.sqrt(share),
            math.sqrt(1 - share),
            SINKS=sinks,
            WINDOW=window,
            BLOCK=BLOCK,
        )
    return out
