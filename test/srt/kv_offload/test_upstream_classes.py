"""The upstream classes kv_offload builds on import and construct on CPU from the patched tree."""

from types import SimpleNamespace

import torch

PAGE = 64


def _dsa_pool(dtype=torch.bfloat16, kv_dim=576, size=4 * PAGE, layers=2):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=size,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_dim,
    )


def test_dsa_pool_layouts():
    bf16 = _dsa_pool()
    assert bf16.kv_buffer[0].shape == (5 * PAGE, 1, 576)
    # One index page holds 64 fp8 keys of 128 B and 64 fp32 scales: 132 B per token.
    assert bf16.index_k_with_scale_buffer[0].shape[1] == PAGE * 132
    fp8 = _dsa_pool(dtype=torch.float8_e4m3fn, kv_dim=656)
    assert fp8.dsa_kv_cache_store_fp8
    assert fp8.kv_buffer[0].dtype == torch.uint8 and fp8.kv_buffer[0].shape[-1] == 656


def test_hisparse_split_allocator_and_req_to_token():
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = HiSparseDSATokenToKVPool(
        size=4 * PAGE,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=2,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=576,
        host_to_device_ratio=2,
    )
    alloc = HiSparseTokenToKVPoolAllocator(
        4 * PAGE, PAGE, torch.bfloat16, "cpu", pool, need_sort=False, host_to_device_ratio=2
    )
    logical_free = alloc.logical_attn_allocator.available_size()
    assert logical_free == 8 * PAGE
    assert alloc.hisparse_attn_allocator.available_size() == 4 * PAGE
    # The exact-page free kv offload's sparse slots and backups use.
    pages = alloc.hisparse_attn_allocator.alloc(2 * PAGE)[::PAGE] // PAGE
    alloc.hisparse_attn_allocator.free_page_ids(pages)
    assert alloc.hisparse_attn_allocator.available_size() == 4 * PAGE
    req_to_token = ReqToTokenPool(4, 1024, "cpu", False)
    assert req_to_token.req_to_token.shape[1] == 1024
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=None, holds_kv=False))
    free_before = req_to_token.available_size()
    assert req_to_token.alloc([req]) == [req.kv.req_pool_idx]
    assert req_to_token.available_size() == free_before - 1
