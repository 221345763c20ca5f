"""The upstream classes kv_offload builds on import and construct on CPU from the patched tree."""

import threading
from types import SimpleNamespace

import torch

PAGE = 64


def _nsa_pool(dtype=torch.bfloat16, kv_dim=576, size=4 * PAGE, layers=2):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    return NSATokenToKVPool(
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


def test_nsa_pool_layouts():
    bf16 = _nsa_pool()
    assert bf16.kv_buffer[0].shape == (5 * PAGE, 1, 576)
    # One index page holds 64 fp8 keys of 128 B and 64 fp32 scales: 132 B per token.
    assert bf16.index_k_with_scale_buffer[0].shape[1] == PAGE * 132
    fp8 = _nsa_pool(dtype=torch.float8_e4m3fn, kv_dim=656)
    assert fp8.nsa_kv_cache_store_fp8
    assert fp8.kv_buffer[0].dtype == torch.uint8 and fp8.kv_buffer[0].shape[-1] == 656


def test_hisparse_split_allocator_and_req_to_token():
    from sglang.srt.mem_cache.hisparse_memory_pool import (
        HiSparseNSATokenToKVPool,
        HiSparseTokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = HiSparseNSATokenToKVPool(
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
    req_to_token = ReqToTokenPool(4, 1024, "cpu", False)
    assert req_to_token.req_to_token.shape == (4, 1024)
    req = SimpleNamespace(req_pool_idx=None, is_chunked=0, kv_committed_len=0)
    free_before = req_to_token.available_size()
    assert req_to_token.alloc([req]) == [req.req_pool_idx]
    assert req_to_token.available_size() == free_before - 1
    req_to_token.free(req)
    assert req_to_token.available_size() == free_before


def test_host_pool_and_cache_controller(monkeypatch):
    from sglang.srt.managers import cache_controller
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost

    device_pool = _nsa_pool()
    host = MLATokenToKVPoolHost(
        device_pool, 2.0, 0, PAGE, "layer_first", pin_memory=False, override_kv_cache_dim=576
    )
    # KV only: the index buffer is not part of this host pool.
    assert host.get_size_per_token() == 576 * 2 * 2
    allocator = PagedTokenToKVPoolAllocator(
        4 * PAGE, PAGE, torch.bfloat16, "cpu", device_pool, False
    )
    # Upstream picks its device module at import (torch.get_device_module()): CUDA for a CUDA
    # build of torch even on a machine without a GPU. This pool lives on the CPU.
    monkeypatch.setattr(cache_controller, "device_module", torch.get_device_module("cpu"))
    controller = HiCacheController(
        allocator,
        host,
        PAGE,
        tp_group=None,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
    )
    assert controller.layer_num == 2
    # host_to_device_ratio 2.0 over a 4-page device pool: 512 slots, which upstream's "align up"
    # (size // page + 1 pages) turns into 9 pages even though 512 is already page aligned.
    size = 9 * PAGE
    assert host.size == size and host.available_size() == size
    host_indices = host.alloc(PAGE)
    assert host_indices.numel() == PAGE
    assert host.available_size() == size - PAGE
    assert torch.unique(host_indices).numel() == PAGE
    assert bool((host_indices >= 0).all()) and bool((host_indices < size).all())
    host.free(host_indices)
    assert host.available_size() == size
