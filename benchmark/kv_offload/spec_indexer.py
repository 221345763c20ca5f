"""The least work a speculative indexer adds to a decode layer (``bench_exposed.py
--speculative-indexer``).

A guess near the oracle's (the next layer's own top-k) has to score the next layer's index keys
before that layer runs, as InfiniGen speculates the next layer's attention: layer L+1's indexer on
layer L's input. Whatever its accuracy, it must read every index key of every request and take
DeepSeek-V3.2's indexer logits over them (``deep_gemm.fp8_paged_mqa_logits``' maths: per token,
the sum over heads of the head weight times ReLU(q . k), times the key's fp32 scale), here on the
paged ``DSATokenToKVPool.index_k_with_scale_buffer`` layout (per page, ``page`` fp8 keys of ``dim``
bytes, then their ``page`` fp32 scales). The query projections and the top-k selection are left out,
so its time is a lower bound on the speculation's.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

INDEX_HEADS = 64  # DeepSeek-V3.2's index_n_heads


@triton.jit
def _paged_index_logits_kernel(
    q_ptr,  # (bs, HEADS, DIM) fp8, or fp32 where FP8_DOT is off
    w_ptr,  # (bs, HEADS) fp32
    cache_ptr,  # (pages, PAGE * (DIM + 4)) uint8
    page_table_ptr,  # (bs, pages_per_req) int32
    out_ptr,  # (bs, pages_per_req * PAGE) fp32
    pages_per_req,
    PAGES_PER_PROGRAM: tl.constexpr,
    PAGE: tl.constexpr,
    DIM: tl.constexpr,
    HEADS: tl.constexpr,
    FP8_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    req = tl.program_id(0)
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, DIM)
    toks = tl.arange(0, PAGE)
    q = tl.load(q_ptr + (req * HEADS + heads[:, None]) * DIM + dims[None, :])
    w = tl.load(w_ptr + req * HEADS + heads)
    first = tl.program_id(1) * PAGES_PER_PROGRAM
    last = tl.minimum(first + PAGES_PER_PROGRAM, pages_per_req)
    for p in tl.range(first, last, num_stages=STAGES):
        page = tl.load(page_table_ptr + req * pages_per_req + p).to(tl.int64)
        base = cache_ptr + page * (PAGE * (DIM + 4))
        keys = tl.load(base + toks[:, None] * DIM + dims[None, :])
        scale = tl.load((base + PAGE * DIM).to(tl.pointer_type(tl.float32)) + toks)
        if FP8_DOT:
            keys = keys.to(tl.float8e4nv, bitcast=True)
        else:  # the Triton interpreter: the same maths in fp32
            keys = keys.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # (PAGE, HEADS): the sum over heads stays within each warp's rows.
        scores = tl.dot(keys, tl.trans(q))
        logits = tl.sum(tl.maximum(scores, 0.0) * w[None, :], axis=1) * scale
        tl.store(out_ptr + req * pages_per_req * PAGE + p * PAGE + toks, logits)


def paged_index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    out: torch.Tensor,
    pages_per_program: int = 8,
    num_warps: int = 4,
    stages: int = 1,
) -> torch.Tensor:
    """``out[r, t]`` = sum over heads h of ``weights[r, h] * relu(q[r, h] . key) * scale`` for the
    t-th token of request r, whose page is ``page_table[r, t // page]``; one launch, fixed grid."""
    bs, heads, dim = q.shape
    pages_per_req = page_table.shape[1]
    page = cache.shape[1] // (dim + 4)
    if cache.shape[1] != page * (dim + 4) or out.shape != (bs, pages_per_req * page):
        raise ValueError(
            f"cache rows of {cache.shape[1]} B and out {tuple(out.shape)} do not fit {bs} requests"
            f" of {pages_per_req} pages of {dim}-byte keys; pass one layer's"
            " index_k_with_scale_buffer and a (bs, pages * page) fp32 out"
        )
    fp8 = q.dtype == torch.float8_e4m3fn
    grid = (bs, triton.cdiv(pages_per_req, pages_per_program))
    _paged_index_logits_kernel[grid](
        q,
        weights,
        cache,
        page_table,
        out,
        pages_per_req,
        PAGES_PER_PROGRAM=pages_per_program,
        PAGE=page,
        DIM=dim,
        HEADS=heads,
        FP8_DOT=fp8,
        STAGES=stages,
        num_warps=num_warps,
    )
    return out


def paged_index_logits_ref(
    q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor
) -> torch.Tensor:
    """``paged_index_logits`` in torch (the tests' reference)."""
    bs, heads, dim = q.shape
    page = cache.shape[1] // (dim + 4)
    pages = cache[page_table.long()]  # (bs, pages_per_req, page * (dim + 4))
    keys = pages[..., : page * dim].reshape(bs, -1, dim).view(torch.float8_e4m3fn).float()
    scale = pages[..., page * dim :].contiguous().view(torch.float32).reshape(bs, -1)
    scores = torch.einsum("bhd,btd->bht", q.float(), keys).clamp_min(0)
    return (scores * weights[:, :, None]).sum(1) * scale


class SpeculativeIndexer:
    """Per decode point: the next layer's indexer logits over every request's keys in the real
    pool's index buffer (fixed buffers, graph-capturable)."""

    def __init__(self, pool, req_to_token: torch.Tensor, bs: int, ctx: int, seed: int = 0):
        device = req_to_token.device
        g = torch.Generator(device=device).manual_seed(seed)
        fp8 = device.type == "cuda"
        shape = (bs, INDEX_HEADS, pool.index_head_dim)
        q = torch.randn(shape, generator=g, device=device)
        self.q = q.to(torch.float8_e4m3fn) if fp8 else q.to(torch.float8_e4m3fn).float()
        self.weights = torch.rand((bs, INDEX_HEADS), generator=g, device=device)
        pages = -(-ctx // pool.page_size)
        firsts = req_to_token[:bs, : pages * pool.page_size : pool.page_size]
        self.page_table = (firsts // pool.page_size).to(torch.int32).contiguous()
        tokens = self.page_table.long()[:, :, None] * pool.page_size + torch.arange(
            pool.page_size, device=device
        )
        if not torch.equal(tokens.view(bs, -1)[:, :ctx], req_to_token[:bs, :ctx].long()):
            raise ValueError("requests' tokens are not page-contiguous in req_to_token")
        self.out = torch.empty((bs, pages * pool.page_size), dtype=torch.float32, device=device)
        self.buffers = pool.index_k_with_scale_buffer
        # The fastest launch on CUDA (a lower bound should not pay for a slow shape), and its time
        # (``ms``; None off CUDA, where nothing is timed).
        self.launch, self.ms = dict(pages_per_program=8, num_warps=4), None
        if fp8:
            for p, w, n in itertools.product((4, 8, 16), (4, 8), (1, 2, 3)):
                launch = dict(pages_per_program=p, num_warps=w, stages=n)
                ms = triton.testing.do_bench(lambda: paged_index_logits(*self._args(0), **launch))
                if self.ms is None or ms < self.ms:
                    self.launch, self.ms = launch, ms

    def _args(self, layer: int):
        return self.q, self.weights, self.buffers[layer], self.page_table, self.out

    @property
    def key_bytes(self) -> int:
        """Index key bytes one call reads (keys and scales)."""
        return self.page_table.numel() * self.buffers[0].shape[1]

    def __call__(self, layer: int) -> torch.Tensor:
        return paged_index_logits(*self._args(layer), **self.launch)
