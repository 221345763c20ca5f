"""The fp8 KV stand-ins of ``standins/kv_offload_standins.py`` (S19, S20, C2) checked on the CPU.

* C2, the fp8 KV row quantiser, writes upstream's Triton kernel's bytes wherever the Triton
  interpreter rounds exactly, and otherwise rounds to the nearest e4m3 value, ties to even (the GPU
  cast); the interpreter's own cast drops the carry of a round-up.
* S20, FlashMLA's sparse decode over 656 B rows (what DSA's ``flashmla_kv`` prefill and decode call,
  through upstream's ``flash_mla_interface``), equals a dense reference: the whole cache dequantised
  as FlashMLA defines it (its dequantiser also checked against upstream's Triton
  ``dequantize_k_cache``), attention over every row weighted by how often the query's indices name
  it.
* S19, the CPU harness's override of upstream's "CPU FP8 KV cache is only supported for MHA": a DSA
  model passes, any other MLA model is still refused.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import kv_offload_standins as standins
import pytest
import torch

PAGE = 64
ROW = 656  # 512 e4m3 values, 4 fp32 scales, 64 bf16 rope values
NOPE, ROPE = 512, 64
E4M3_MAX = 448.0


def latent(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    nope = (torch.randn(n, NOPE, generator=g) * 3).to(torch.bfloat16)
    rope = torch.randn(n, ROPE, generator=g).to(torch.bfloat16)
    return nope, rope


def quantised_rows(n: int, seed: int) -> torch.Tensor:
    """``[n, 656]`` fp8 KV rows of a random latent, as the C2 quantiser writes them."""
    nope_part, rope_part = standins.quantize_k_cache_fast_separate(*latent(n, seed))
    return torch.cat([nope_part[:, 0], rope_part[:, 0]], dim=1)


def upstream_quantise(nope, rope):
    from sglang.kernels.ops.quantization import dsa_quant_k_cache

    return dsa_quant_k_cache._quantize_k_cache_fast_separate(nope, rope)


def test_quantiser_writes_upstream_bytes_where_the_interpreter_rounds_exactly():
    """Latent values that are e4m3 values times a power of two, with 448 in every tile: the scale
    is that power of two and no value needs rounding, so the interpreter's cast is exact."""
    n = 96
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (n, NOPE), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x38 is 1.0)
    values = codes.view(torch.float8_e4m3fn).float().view(n, 4, 128)
    values[:, :, 0] = E4M3_MAX * torch.sign(torch.randn(n, 4, generator=g))
    scale = torch.exp2(torch.randint(-10, 5, (n, 4, 1), generator=g).float())
    nope = (values * scale).view(n, NOPE).to(torch.bfloat16)
    assert torch.equal(nope.float().view(n, 4, 128), values * scale)  # exact in bf16
    rope = latent(n, 4)[1]
    want = upstream_quantise(nope, rope)
    got = standins.quantize_k_cache_fast_separate(nope, rope)
    assert [t.shape for t in got] == [t.shape for t in want] == [(n, 1, 528), (n, 1, 128)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def nearest_e4m3_ties_to_even(x: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``x`` (``|x| <= 448``) by search over every finite code: the nearest value,
    on a tie the even code, the sign of ``x`` (-0.0 included)."""
    mags = torch.arange(0x7F, dtype=torch.uint8)  # 0x7F is NaN
    table = mags.view(torch.float8_e4m3fn).double()
    dist = (x.abs().double()[:, None] - table[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    # Of one or two nearest codes, the even one (adjacent codes differ in their last bit).
    pick = (nearest & (mags[None, :] % 2 == 0)) | (nearest & (nearest.sum(1, keepdim=True) == 1))
    code = pick.to(torch.uint8).argmax(dim=1).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 7)


def test_quantiser_rounds_to_nearest_even_and_keeps_scales_and_rope():
    n = 64
    nope, rope = latent(n, 5)
    got_nope, got_rope = standins.quantize_k_cache_fast_separate(nope, rope)
    want_nope, want_rope = upstream_quantise(nope, rope)
    # The scales (max |x| / 448 per 128 values) and the rope bytes are upstream's exactly.
    assert torch.equal(got_nope[:, 0, NOPE:], want_nope[:, 0, NOPE:])
    assert torch.equal(got_rope, want_rope)
    groups = nope.float().view(n, 4, 128)
    scale = got_nope[:, 0, NOPE:].contiguous().view(torch.float32)
    assert torch.equal(scale, groups.abs().amax(-1) / E4M3_MAX)
    scaled = (groups * (1.0 / scale).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).view(-1)
    assert torch.equal(got_nope[:, 0, :NOPE].reshape(-1), nearest_e4m3_ties_to_even(scaled))


def dequantise_reference(rows: torch.Tensor) -> torch.Tensor:
    """FlashMLA's definition (``tests/quant.py``, V32): per 128-value tile, the e4m3 values as
    fp32 times the tile's fp32 scale, stored as bf16 (round to nearest even); then the rope."""
    n = rows.shape[0]
    out = torch.empty((n, NOPE + ROPE), dtype=torch.bfloat16)
    scales = rows[:, NOPE : NOPE + 16].contiguous().view(torch.float32)
    for tile in range(4):
        cols = slice(tile * 128, (tile + 1) * 128)
        out[:, cols] = rows[:, cols].view(torch.float8_e4m3fn).float() * scales[:, tile : tile + 1]
    out[:, NOPE:] = rows[:, NOPE + 16 :].contiguous().view(torch.bfloat16)
    return out


def test_dequantise_matches_flashmla_and_upstream_and_inverts_the_quantiser():
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache

    n = 2 * PAGE
    nope, rope = latent(n, 6)
    rows = quantised_rows(n, 6)
    got = standins.dequantize_fp8_rows(rows.view(2, PAGE, 1, ROW))
    assert got.dtype == torch.bfloat16 and got.shape == (2, PAGE, 1, NOPE + ROPE)
    got = got.view(n, -1)
    assert torch.equal(got, dequantise_reference(rows))
    # Upstream's Triton kernel computes the same fp32 products; the interpreter rounds them to
    # bf16 toward zero where the GPU (and this reference) rounds to nearest: at most one bf16 step.
    want = dequantize_k_cache(rows.view(torch.float8_e4m3fn).view(2, PAGE, 1, ROW)).view(n, -1)
    step = torch.finfo(torch.bfloat16).eps * got.float().abs()
    assert bool(((got.float() - want.float()).abs() <= step).all())
    assert torch.equal(got[:, NOPE:], want[:, NOPE:]) and torch.equal(got[:, NOPE:], rope)
    # Half an e4m3 step (3 mantissa bits) of the tile's largest value, plus the bf16 rounding.
    err = (got[:, :NOPE].float() - nope.float()).view(n, 4, 128).abs()
    bound = nope.float().view(n, 4, 128).abs().amax(-1, keepdim=True) / 16 * (1 + 2**-7)
    assert bool((err <= bound).all())


def dense_reference(q, cache_rows, indices, sm_scale):
    """Attention of each query over the whole dequantised cache, every row weighted by the number
    of times the query's indices name it (0: not attended). float64; ``(out, lse [b, h, 1])``."""
    n = cache_rows.shape[0]
    dense = dequantise_reference(cache_rows).double()
    b, _, h, _ = q.shape
    counts = torch.zeros((b, n), dtype=torch.float64)
    for i in range(b):
        for r in indices[i, 0].tolist():
            if r >= 0:
                counts[i, r] += 1
    logits = torch.einsum("bhd,nd->bhn", q[:, 0].double(), dense) * sm_scale
    weights = counts[:, None, :] * torch.exp(logits - logits.amax(-1, keepdim=True))
    total = weights.sum(-1)
    out = torch.einsum("bhn,nd->bhd", weights, dense[:, :NOPE]) / total.clamp_min(1e-300)[..., None]
    lse = torch.log(total) + logits.amax(-1)
    lse = torch.where(total > 0, lse, torch.full_like(lse, float("inf")))
    return out.unsqueeze(1), lse.unsqueeze(-1)


@pytest.mark.parametrize("batch,heads,topk", [(3, 64, 64), (2, 128, 128), (6, 64, 64)])
def test_sparse_decode_equals_the_dense_dequantised_reference(batch, heads, topk):
    """Through upstream's ``flash_mla_interface`` as DSA's ``_forward_flashmla_kv`` calls it:
    -1 entries, duplicated rows, and one query with no valid index (output 0, lse +inf); the
    stand-in dequantises the named rows, or (6 x 64 names > 256 rows) the whole cache."""
    from sglang.kernels.ops.attention.flash_mla_interface import (
        flash_mla_with_kvcache,
        get_mla_metadata,
    )

    pages = 4
    rows = quantised_rows(pages * PAGE, 7)
    g = torch.Generator().manual_seed(8)
    q = (torch.randn(batch, 1, heads, NOPE + ROPE, generator=g) * 0.2).to(torch.bfloat16)
    indices = torch.randint(0, pages * PAGE, (batch, 1, topk), generator=g, dtype=torch.int32)
    indices[0, 0, : topk // 2] = indices[0, 0, topk // 2 :]  # every row named twice
    indices[1 % batch, 0, ::3] = -1
    indices[batch - 1, 0, :] = -1  # nothing to attend
    seqlens = torch.full((batch,), pages * PAGE, dtype=torch.int32)
    meta, splits = get_mla_metadata(
        cache_seqlens=seqlens,
        num_q_tokens_per_head_k=heads,
        num_heads_k=1,
        num_heads_q=heads,
        is_fp8_kvcache=True,
        topk=topk,
    )
    sm_scale = 0.1
    out, lse = flash_mla_with_kvcache(
        q=q,
        k_cache=rows.view(pages, PAGE, 1, ROW),
        cache_seqlens=seqlens,
        head_dim_v=NOPE,
        tile_scheduler_metadata=meta,
        num_splits=splits,
        softmax_scale=sm_scale,
        indices=indices,
        block_table=torch.empty((batch, 0), dtype=torch.int32),
        is_fp8_kvcache=True,
        kv_format="V32",
    )
    want_out, want_lse = dense_reference(q, rows, indices, sm_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, 1, heads, NOPE)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, 1)
    # float64 in both, each rounded once: at most one bf16 step apart.
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert bool((out[batch - 1] == 0).all()) and bool(torch.isinf(lse[batch - 1]).all())


def test_sparse_decode_refuses_what_the_kernel_refuses():
    rows = quantised_rows(PAGE, 9).view(1, PAGE, 1, ROW)
    indices = torch.zeros((1, 1, 64), dtype=torch.int32)
    q = torch.zeros((1, 1, 4, NOPE + ROPE), dtype=torch.bfloat16)  # 4 heads: not padded to 64
    with pytest.raises(AssertionError, match="64 or 128 q heads"):
        standins.flash_mla_with_kvcache(q, rows, None, None, NOPE, None, 0.1, False, True, indices)
    q = torch.zeros((1, 1, 64, NOPE + ROPE), dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="V32 fp8 rows"):
        standins.flash_mla_with_kvcache(q, rows, None, None, NOPE, None, 0.1, False, False, indices)


def fresh_configurator_module(monkeypatch):
    """A private copy of upstream's ``kv_cache_configurator`` (patching it leaves the imported
    module alone)."""
    import sglang.srt.mem_cache.kv_cache_configurator as upstream

    name = "kv_offload_test_configurator_copy"
    spec = importlib.util.spec_from_file_location(name, upstream.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dsa", [True, False], ids=["dsa", "other-mla"])
def test_cpu_fp8_check_lets_dsa_through_only(dsa, monkeypatch):
    module = fresh_configurator_module(monkeypatch)
    standins._patch_kv_cache_configurator(module)
    # The server's platform (SGLANG_USE_CPU_ENGINE=1); this test process's is the generic one.
    monkeypatch.setattr(module, "current_platform", SimpleNamespace(is_cpu=lambda: True))
    hf_config = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"] if dsa else ["X"])
    if dsa:
        hf_config.index_topk = 2048
    fake = SimpleNamespace(
        kv_cache_dtype=torch.float8_e4m3fn,
        use_mla_backend=True,
        model_config=SimpleNamespace(hf_config=hf_config),
    )
    with pytest.raises(Exception) as info:
        module.KVCacheConfigurator.configure(fake, pre_model_load_memory=0)
    refused = "CPU FP8 KV cache is only supported for MHA" in str(info.value)
    # The DSA model passes the check (and fails later, on what this stand-in object lacks).
    assert refused != dsa, info.value


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_quantiser_writes_the_gpu_kernels_bytes():
    """On the GPU upstream's Triton kernel runs for real (C2 is CPU only): the torch port's bytes
    must be its bytes, on any latent."""
    nope, rope = (t.cuda() for t in latent(4 * PAGE, 10))
    want = upstream_quantise(nope, rope)
    got = standins.quantize_k_cache_fast_separate(nope, rope)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@gpu
def test_sparse_decode_replays_in_a_cuda_graph():
    """S20 under CUDA-graph capture (as the decode step runs it): replay equals eager."""
    pages, batch, heads, topk = 4, 3, 64, 64
    cache = quantised_rows(pages * PAGE, 11).cuda().view(pages, PAGE, 1, ROW)
    g = torch.Generator().manual_seed(12)
    q = (torch.randn(batch, 1, heads, NOPE + ROPE, generator=g) * 0.2).to(torch.bfloat16).cuda()
    indices = torch.randint(0, pages * PAGE, (batch, 1, topk), generator=g, dtype=torch.int32)
    indices[1, 0, ::2] = -1
    indices = indices.cuda()

    def step():
        return standins.flash_mla_with_kvcache(
            q, cache, None, None, NOPE, None, 0.1, False, True, indices
        )

    eager = step()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
