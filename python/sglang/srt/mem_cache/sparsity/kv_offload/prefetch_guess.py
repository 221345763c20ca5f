"""The cross-layer prefetch's guess from two layers: what layer L and layer L-1 both selected.

Layer L's top-k is the prefetch's guess of layer L+1's: adjacent layers select mostly the same
tokens. A token that two adjacent layers agree on is a better guess than one only layer L picked
(its relevance is more likely shared than layer-specific), so with ``prefetch_guess="two_layers"``
the prefetch loads only the entries of layer L's top-k that layer L-1 selected too. It moves fewer
rows, of which more are used; layer L+1 loads a few more itself.

One program per batch row: sort the row (a bitonic sort over the power-of-two block; kept for the
next layer) and look each entry up in the previous layer's sorted row by binary search. Fixed
shapes, no host sync, no allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PAD = 2**31 - 1  # sorts after every position; never a token position


@triton.jit
def _two_layer_guess_kernel(
    guess_ptr,
    guess_stride,
    sorted_ptr,
    prev_sorted_ptr,
    sorted_stride,
    K,
    BLOCK_K: tl.constexpr,
    LOG2_BLOCK_K: tl.constexpr,
    FILTER: tl.constexpr,
    PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    cur = tl.load(guess_ptr + b * guess_stride + offs, mask=offs < K, other=PAD)
    tl.store(sorted_ptr + b * sorted_stride + offs, tl.sort(cur))
    if FILTER:
        prev = prev_sorted_ptr + b * sorted_stride
        # Lower bound of each entry in the previous layer's sorted row (PAD-filled past its K).
        lo = tl.zeros((BLOCK_K,), dtype=tl.int32)
        hi = tl.full((BLOCK_K,), BLOCK_K, dtype=tl.int32)
        for _ in tl.static_range(LOG2_BLOCK_K + 1):
            active = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(prev + mid, mask=active, other=PAD) < cur
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        found = tl.load(prev + lo, mask=lo < BLOCK_K, other=PAD) == cur
        keep = found & (cur >= 0)
        tl.store(guess_ptr + b * guess_stride + offs, tl.where(keep, cur, -1), mask=offs < K)


class TwoLayerGuess:
    """Sorted copies of the last two layers' top-k rows and the filter between them.

    Args:
        max_bs: rows of the largest batch.
        topk: entries per row (the model's index top-k).
        device: where the rows live.
    """

    def __init__(self, max_bs: int, topk: int, device: torch.device) -> None:
        self.topk = topk
        self.block_k = triton.next_power_of_2(topk)
        self._sorted = torch.full((2, max_bs, self.block_k), _PAD, dtype=torch.int32, device=device)

    def filter_(self, guess: torch.Tensor, layer_id: int, previous_layer: bool) -> None:
        """Keep in ``guess`` ((bs, topk) int32 positions of layer ``layer_id``, -1 padded) only
        the entries the previous layer selected too, -1 elsewhere; without ``previous_layer`` (no
        sorted row of layer ``layer_id - 1`` from this forward) leave it whole. Either way keep
        its sorted row for the next layer."""
        bs, k = guess.shape
        assert k == self.topk and guess.dtype == torch.int32 and guess.stride(1) == 1
        cur, prev = self._sorted[layer_id % 2, :bs], self._sorted[(layer_id - 1) % 2, :bs]
        _two_layer_guess_kernel[(bs,)](
            guess,
            guess.stride(0),
            cur,
            prev,
            cur.stride(0),
            k,
            BLOCK_K=self.block_k,
            LOG2_BLOCK_K=self.block_k.bit_length() - 1,
            FILTER=previous_layer,
            PAD=_PAD,
        )
