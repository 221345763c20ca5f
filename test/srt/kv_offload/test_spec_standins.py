"""The S17 stand-ins (speculative decoding's CPU-engine ops) equal upstream's Triton kernels.

Each torch stand-in of ``standins/kv_offload_standins.py`` is checked against the upstream Triton
kernel it mirrors, run here under the Triton interpreter on the same random inputs.
"""

from __future__ import annotations

import kv_offload_standins as standins
import pytest
import torch

POOL_LEN = 96


def _batch(seed: int, bs: int, max_len: int):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 10_000, (bs + 3, POOL_LEN), generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(bs + 3, generator=g)[:bs].to(torch.int64)
    start = torch.randint(0, POOL_LEN - max_len, (bs,), generator=g, dtype=torch.int64)
    end = start + torch.randint(0, max_len + 1, (bs,), generator=g, dtype=torch.int64)
    return g, req_to_token, req_pool_indices, start, end


@pytest.mark.parametrize("seed,bs", [(0, 1), (1, 3), (2, 7)])
def test_assign_req_to_token_pool_cpu(seed, bs):
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    g, table, rows, start, end = _batch(seed, bs, 9)
    locs = torch.randint(0, 10_000, (int((end - start).sum()),), generator=g, dtype=torch.int64)
    want, got = table.clone(), table.clone()
    assign_req_to_token_pool[(bs,)](rows, want, start, end, locs, POOL_LEN, 8)
    standins.assign_req_to_token_pool_cpu(rows, got, start, end, locs, POOL_LEN)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed,bs", [(0, 1), (1, 3), (2, 7)])
def test_assign_extend_and_draft_cache_locs_cpu(seed, bs):
    from sglang.kernels.ops.speculative.cache_locs import (
        assign_draft_cache_locs_contiguous,
        assign_extend_cache_locs,
    )

    _, table, rows, start, end = _batch(seed, bs, 9)
    total = int((end - start).sum())
    want, got = torch.full((total,), -7), torch.full((total,), -7)
    assign_extend_cache_locs[(bs,)](rows, table, start, end, want, POOL_LEN, 8)
    standins.assign_extend_cache_locs_cpu(rows, table, start, end, got, POOL_LEN)
    assert torch.equal(got, want)

    topk, steps = 1, 3
    want, got = torch.full((bs * topk * steps,), -7), torch.full((bs * topk * steps,), -7)
    assign_draft_cache_locs_contiguous[(bs,)](rows, table, start, want, POOL_LEN, topk, steps)
    standins.assign_draft_cache_locs_contiguous_cpu(rows, table, start, got, POOL_LEN, topk, steps)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed,bs,width", [(0, 1, 2), (1, 4, 4), (2, 5, 3)])
def test_fill_bonus_tokens_and_accept_locs_cpu(seed, bs, width):
    from sglang.kernels.ops.speculative.eagle import (
        fill_accept_out_cache_loc,
        fill_bonus_tokens,
    )

    g = torch.Generator().manual_seed(seed)
    accept_lens = torch.randint(1, width + 1, (bs,), generator=g, dtype=torch.int32)
    accept_tokens = torch.randint(0, 1000, (bs, width), generator=g, dtype=torch.int32)
    want, got = torch.full((bs,), -7, dtype=torch.int32), torch.full((bs,), -7, dtype=torch.int32)
    fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, want, width)
    standins.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, width)
    assert torch.equal(got, want)

    # accept_index: request i accepted its first accept_lens[i] verify rows, -1 for the rest.
    cols = torch.arange(width)
    accept_index = torch.where(
        cols < accept_lens[:, None].long(), torch.arange(bs)[:, None] * width + cols, -1
    ).to(torch.int32)
    out_cache_loc = torch.randint(0, 10_000, (bs * width,), generator=g, dtype=torch.int64)
    size = accept_index.numel()
    want, got = torch.full((size,), -7), torch.full((size,), -7)
    fill_accept_out_cache_loc[(size,)](
        accept_index, out_cache_loc, want, 1 << (size - 1).bit_length()
    )
    standins.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert torch.equal(got, want)
