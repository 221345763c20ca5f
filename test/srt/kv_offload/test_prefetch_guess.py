"""The two-layer prefetch guess kernel equals its torch definition (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.sparsity.kv_offload.prefetch_guess import TwoLayerGuess

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def _rows(gen, bs, k, span, pad):
    """``bs`` rows of ``k`` distinct positions below ``span``, the last ``pad`` of row 0 -1."""
    rows = torch.stack([torch.randperm(span, generator=gen)[:k] for _ in range(bs)]).int()
    if pad:
        rows[0, -pad:] = -1
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k, bs", [(16, 3), (48, 2), (2048, 2)])
def test_keeps_exactly_the_entries_both_layers_selected(device, k, bs):
    gen = torch.Generator().manual_seed(k)
    guess = TwoLayerGuess(max_bs=4, topk=k, device=torch.device(device))
    prev = _rows(gen, bs, k, 3 * k, pad=k // 4)
    cur = _rows(gen, bs, k, 3 * k, pad=3)
    # Layer 6, first of the forward: nothing to agree with, the row stays whole (and is sorted).
    first = prev.clone().to(device)
    guess.filter_(first, 6, previous_layer=False)
    assert torch.equal(first.cpu(), prev)
    # Layer 7: only what layer 6 selected too.
    got = cur.clone().to(device)
    guess.filter_(got, 7, previous_layer=True)
    both = torch.stack([torch.isin(c, p[p >= 0]) for c, p in zip(cur, prev)]) & (cur >= 0)
    assert torch.equal(got.cpu(), torch.where(both, cur, -1))
    assert 0 < int(both.sum()) < int((cur >= 0).sum())  # a real filter, neither all nor none
    # Rows of a smaller batch leave the other rows' sorted copies alone.
    one = cur[:1].clone().to(device)
    guess.filter_(one, 8, previous_layer=True)
    expect = torch.where(torch.isin(cur[0], cur[0][cur[0] >= 0]) & (cur[0] >= 0), cur[0], -1)
    assert torch.equal(one.cpu()[0], expect)


def test_rejects_a_row_of_another_width():
    guess = TwoLayerGuess(max_bs=2, topk=16, device=torch.device("cpu"))
    with pytest.raises(AssertionError):
        guess.filter_(torch.zeros((1, 8), dtype=torch.int32), 1, previous_layer=False)
