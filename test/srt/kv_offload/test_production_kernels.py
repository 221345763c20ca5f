"""The production kernels against the stand-ins' maths, on the same inputs.

Every launch recipe runs ``--kv-cache-dtype fp8_e4m3 --dsa-decode-backend flashmla_kv``: DSA attention
is FlashMLA's sparse fp8 kernel over 656 B KV rows (512 e4m3 values, 4 fp32 tile scales, 64 bf16
rope values; ``flash_mla_with_kvcache``) and the indexer is DeepGEMM's (``fp8_paged_mqa_logits``,
``fp8_mqa_logits``, ``get_paged_mqa_logits_metadata``). The GPU tests (``-m gpu``, on the GPU machine
after ``source scripts/gpu_env.sh production``) call the real kernels as 0.5.23 calls them and compare
them with ``kv_offload_standins``' references (S6, S4, S3); the CPU tests check what those
comparisons rest on: the 656 B rows that upstream's quantizer writes, and the reference decode's
reading of FlashMLA's flat token indices (``page * 64 + offset``, ``-1`` = none).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import List, Tuple

import kv_offload_standins as S
import pytest
import torch
from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache
from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache

TEST_DIR = Path(__file__).resolve().parent

NOPE, ROPE, TILE, PAGE = 512, 64, 128, 64
DIM = NOPE + ROPE  # 576: q and dequantized k
ROW_BYTES = NOPE + NOPE // TILE * 4 + ROPE * 2  # 656
FP8_MAX = 448.0
INDEX_DIM, INDEX_ROW = 128, 132  # index key: 128 e4m3 values + 1 fp32 scale

production = pytest.mark.skipif(
    os.environ.get("KV_OFFLOAD_KERNELS") != "production" or not torch.cuda.is_available(),
    reason="needs the GPU machine with `source scripts/gpu_env.sh production`",
)


# ------------------------------------------------------------------------------------------------
# inputs and the reference, shared by the CPU and GPU tests
# ------------------------------------------------------------------------------------------------
def make_kv_cache(pages: int, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(k [pages * 64, 576] bf16, cache [pages, 64, 1, 656])``: random latent rows written by
    upstream's DSA fp8 quantizer, the kernel the server's KV store runs."""
    k = torch.randn(pages * PAGE, DIM, generator=gen, device=gen.device).to(torch.bfloat16)
    return k, quantize_k_cache(k.view(pages, PAGE, 1, DIM))


def make_indices(n_valid: List[int], topk: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, 1, topk]`` int32 flat token indices (``page * 64 + offset``): row ``b`` names
    ``n_valid[b]`` distinct tokens, then ``-1`` (the top-k transform's padding)."""
    rows = []
    for n in n_valid:
        picked = torch.randperm(tokens, generator=gen, device=gen.device)[:n].to(torch.int32)
        rows.append(torch.cat([picked, picked.new_full((topk - n,), -1)]))
    return torch.stack(rows).unsqueeze(1)


def reference_decode(
    q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """The stand-ins' sparse decode of ``q [B, 1, H, 576]`` over the fp8 ``cache``: upstream's
    dequantizer, then S6 (``flash_mla_sparse_fwd``) on the bf16 rows. ``[B, 1, H, 512]``."""
    kv = dequantize_k_cache(cache).view(-1, 1, DIM)
    out, _, _ = S.flash_mla_sparse_fwd(q[:, 0], kv, indices, sm_scale, d_v=NOPE)
    return out.unsqueeze(1)


def make_index_cache(pages: int, gen: torch.Generator) -> torch.Tensor:
    """The indexer's paged key cache as DeepGEMM reads it: ``[pages, 64, 1, 132]`` bytes, per page
    64 x 128 e4m3 keys and then 64 fp32 scales."""
    dev = gen.device
    keys = torch.randn(pages, PAGE * INDEX_DIM, generator=gen, device=dev).to(torch.float8_e4m3fn)
    scales = torch.rand(pages, PAGE, generator=gen, device=dev) * 0.02 + 0.005
    raw = torch.cat([keys.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return raw.view(pages, PAGE, 1, INDEX_ROW)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref| / |ref|`` (L2) over the rows of the last dimension."""
    out, ref = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()


# ------------------------------------------------------------------------------------------------
# CPU: what the GPU comparisons rest on
# ------------------------------------------------------------------------------------------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fp8_rows_are_656_bytes_of_values_scales_and_rope():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k, cache = make_kv_cache(1, gen)
    assert cache.shape == (1, PAGE, 1, ROW_BYTES) and cache.element_size() == 1
    rows = cache.view(PAGE, ROW_BYTES).view(torch.uint8)
    values = rows[:, :NOPE].view(torch.float8_e4m3fn).float()
    scales = rows[:, NOPE : NOPE + 16].contiguous().view(torch.float32)
    rope = rows[:, NOPE + 16 :].contiguous().view(torch.bfloat16)
    tiles = k[:, :NOPE].float().view(PAGE, NOPE // TILE, TILE)
    amax = tiles.abs().amax(dim=-1)
    torch.testing.assert_close(scales, amax / FP8_MAX)  # one fp32 scale per 128 values
    assert torch.equal(rope, k[:, NOPE:])  # rope kept in bf16, bit for bit
    approx = values.view(PAGE, NOPE // TILE, TILE) * scales.unsqueeze(-1)
    # e4m3 has 3 mantissa bits: rounding to nearest is within amax / 16. Triton's CPU interpreter
    # casts some values to a neighbouring binade (124.3 -> 64), so there only misplaced bytes
    # (errors of the order of amax) are caught.
    bound = amax.unsqueeze(-1) / (16 if DEVICE == "cuda" else 4)
    assert ((approx - tiles).abs() <= bound).all()
    deq = dequantize_k_cache(cache).view(PAGE, DIM).float()
    torch.testing.assert_close(deq[:, :NOPE], approx.view(PAGE, NOPE), rtol=2**-7, atol=0)  # bf16
    assert torch.equal(deq[:, NOPE:], k[:, NOPE:].float())


def test_reference_decode_reads_flat_token_indices():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    pages, heads, topk, scale = 2, 2, 16, 0.07
    _, cache = make_kv_cache(pages, gen)
    indices = make_indices([topk, 5], topk, pages * PAGE, gen)
    indices[0, 0, 3] = -1  # a hole in the middle is no token either
    q = torch.randn(2, 1, heads, DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = reference_decode(q, cache, indices, scale)
    assert out.shape == (2, 1, heads, NOPE)
    kv = dequantize_k_cache(cache).view(-1, DIM).double()  # token t = page t // 64, offset t % 64
    for b in range(2):
        idx = indices[b, 0]
        rows = kv[idx[idx >= 0].long()]
        p = torch.softmax(q[b, 0].double() @ rows.T * scale, dim=-1)
        torch.testing.assert_close(out[b, 0].double(), p @ rows[:, :NOPE], atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# GPU: the production kernels
# ------------------------------------------------------------------------------------------------
def import_real(name: str) -> ModuleType:
    """``name`` from outside this test folder (whose ``standins``/``cpu_stubs`` hold stand-ins of
    the same name on ``sys.path``)."""
    mod = sys.modules.get(name)
    if mod is not None and str(TEST_DIR) in str(getattr(mod, "__file__", "")):
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if not p.startswith(str(TEST_DIR))]
    try:
        mod = importlib.import_module(name)
    finally:
        sys.path[:] = saved
    assert str(TEST_DIR) not in str(mod.__file__), mod.__file__
    return mod


@pytest.mark.gpu
@production
def test_production_packages_are_the_real_ones():
    flash_mla, deep_gemm = import_real("flash_mla"), import_real("deep_gemm")
    assert flash_mla.__version__ == "1.0.0" and flash_mla.has_legacy()  # SM90 + V3.2 formats
    assert deep_gemm.__version__ and deep_gemm.get_num_sms() > 0
    import sglang.kernels.ops.attention.flash_mla_interface as iface

    assert iface.flash_mla is flash_mla


@pytest.mark.gpu
@production
@pytest.mark.parametrize("topk", [512, 2048])
def test_flashmla_fp8_sparse_decode_matches_the_standin(topk):
    """``flash_mla_with_kvcache`` over 656 B rows, called as ``DeepseekSparseAttnBackend.
    _forward_flashmla_kv`` calls it (heads padded to 64, scheduler metadata from
    ``get_mla_metadata``, ``kv_format="V32"``), against dequantize + S6."""
    import_real("flash_mla")
    from sglang.kernels.ops.attention.flash_mla_interface import (
        flash_mla_with_kvcache,
        get_mla_metadata,
    )

    gen = torch.Generator(device="cuda").manual_seed(2)
    heads, pages, scale = 64, 2 * topk // PAGE, DIM**-0.5
    n_valid = [topk, topk - 37, topk // 2 + 5, 1]
    batch = len(n_valid)
    _, cache = make_kv_cache(pages, gen)
    indices = make_indices(n_valid, topk, pages * PAGE, gen)
    q = torch.randn(batch, 1, heads, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    seqlens = torch.tensor(n_valid, dtype=torch.int32, device="cuda")
    sched, splits = get_mla_metadata(
        cache_seqlens=seqlens,
        num_q_tokens_per_head_k=heads,
        num_heads_k=1,
        num_heads_q=heads,
        is_fp8_kvcache=True,
        topk=topk,
    )
    out, _ = flash_mla_with_kvcache(
        q=q,
        k_cache=cache,
        cache_seqlens=seqlens,
        head_dim_v=NOPE,
        tile_scheduler_metadata=sched,
        num_splits=splits,
        softmax_scale=scale,
        indices=indices,
        block_table=torch.empty((batch, 0), dtype=torch.int32, device="cuda"),
        is_fp8_kvcache=True,
        kv_format="V32",
    )
    ref = reference_decode(q, cache, indices, scale)
    assert out.shape == ref.shape == (batch, 1, heads, NOPE)
    assert relative_error(out, ref) < 2e-2
    # S20, the CPU servers' stand-in of this very call
    standin, _ = S.flash_mla_with_kvcache(
        q, cache, None, seqlens, NOPE, None, softmax_scale=scale, is_fp8_kvcache=True,
        indices=indices, kv_format="V32",
    )  # fmt: skip
    assert relative_error(out, standin) < 2e-2


@pytest.mark.gpu
@production
def test_deepgemm_paged_mqa_logits_match_the_standin():
    """Decode logits over the paged index-key cache, as the indexer asks for them (next_n 1, 64
    heads, ``clean_logits=False``: only positions below each context length are compared)."""
    deep_gemm = import_real("deep_gemm")
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, lens = 64, [4096, 4000, 2049, 64, 63, 1, 3000, 17]
    batch, max_len = len(lens), max(lens)
    width = max_len // PAGE
    cache = make_index_cache(batch * width, gen)
    table = torch.randperm(batch * width, generator=gen, device="cuda").to(torch.int32)
    table = table.view(batch, width)
    q = torch.randn(batch, 1, heads, INDEX_DIM, generator=gen, device="cuda")
    q = q.to(torch.float8_e4m3fn)
    weights = torch.randn(batch, heads, generator=gen, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda").view(batch, 1)
    sched = deep_gemm.get_paged_mqa_logits_metadata(ctx, PAGE, deep_gemm.get_num_sms())
    out = deep_gemm.fp8_paged_mqa_logits(q, cache, weights, ctx, table, sched, max_len, False)
    ref = S.fp8_paged_mqa_logits(q, cache, weights, ctx, table, None, max_len)
    for b, n in enumerate(lens):
        a, r = out[b, :n].double(), ref[b, :n].double()
        assert (a - r).abs().max() <= 1e-3 * r.abs().max() + 1e-5, b


@pytest.mark.gpu
@production
def test_deepgemm_ragged_mqa_logits_match_the_standin():
    """Prefill logits over ragged keys (each query row sees keys ``[ks, ke)``)."""
    deep_gemm = import_real("deep_gemm")
    gen = torch.Generator(device="cuda").manual_seed(4)
    rows, keys, heads = 512, 1536, 64
    q = torch.randn(rows, heads, INDEX_DIM, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(keys, INDEX_DIM, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    k_scale = torch.rand(keys, generator=gen, device="cuda") * 0.02 + 0.005
    weights = torch.randn(rows, heads, generator=gen, device="cuda")
    ke = torch.arange(rows, device="cuda", dtype=torch.int32) * 2 + 512  # causal-like windows
    ks = (ke - 700).clamp_min(0).to(torch.int32)
    out = deep_gemm.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, clean_logits=False)
    ref = S.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke)
    for m in range(0, rows, 37):
        a, r = out[m, ks[m] : ke[m]].double(), ref[m, ks[m] : ke[m]].double()
        assert (a - r).abs().max() <= 1e-3 * r.abs().max() + 1e-5, m


@pytest.mark.gpu
@production
def test_jit_hadamard_matches_the_standin():
    """0.5.23's own JIT Hadamard (tvm-ffi + nvcc), the indexer's ``rotate_activation``, against S3."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(256, 64, INDEX_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    assert dsa_indexer.rotate_activation is not S.rotate_activation  # upstream's, unpatched
    out = dsa_indexer.rotate_activation(x)
    assert relative_error(out, S.rotate_activation(x)) < 1e-2
