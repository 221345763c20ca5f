"""KVOffloadHostPool: sizing, layout, page-aligned allocation, clear errors, unpinning."""

import gc
import logging

import psutil
import pytest
import torch
from _pools import offload_device_pool
from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES
from sglang.srt.mem_cache.sparsity.kv_offload import host_pool as host_pool_mod
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import (
    HostPoolSizeError,
    KVOffloadHostPool,
    host_kv_bytes_per_token,
    host_pool_tokens,
)

P = 64
FP8 = (torch.float8_e4m3fn, 656)  # NSA fp8 layout: 512 fp8 + 16 B scales + 64 bf16 rope
BF16 = (torch.bfloat16, 576)


def device_pool(layers=2, dtype_dim=FP8, physical=256, logical=1024):
    return offload_device_pool(physical, logical, layers, dtype_dim)


def test_sizing_formulas_deepseek_v32():
    assert host_kv_bytes_per_token(656, 61) == 656 * 61 == 40016
    assert host_kv_bytes_per_token(1152, 61) == 70272
    # 100 GB of host at 40016 B/token, page aligned down
    assert host_pool_tokens(40016, P, host_size_gb=100) == (int(100e9 // 40016) // P) * P
    assert host_pool_tokens(40016, P, host_pool_ratio=2.5, ratio_base_tokens=1000) == 2496
    # GB wins over ratio
    assert (
        host_pool_tokens(1000, P, host_size_gb=1e-3, host_pool_ratio=9, ratio_base_tokens=10**6)
        == 960
    )


@pytest.mark.parametrize("dtype_dim,row", [(FP8, 656), (BF16, 1152)])
def test_real_pool_bytes_per_token_61_layers(dtype_dim, row):
    pool = device_pool(layers=61, dtype_dim=dtype_dim, physical=64, logical=128)
    host = KVOffloadHostPool(pool, host_pool_ratio=1, host_reserve_bytes=0)
    n = pool.sizing.logical_tokens  # the arena's logical tokens when every unit is logical
    assert host.size_per_token == row * 61
    assert host.row_bytes == row
    assert host.size == n >= 128
    assert tuple(host.kv_buffer.shape[:2]) == (61, n)
    assert host.kv_buffer.nbytes == n * row * 61
    assert host.host_row_view(60).shape == (n, row)


@pytest.mark.parametrize("dtype_dim", [FP8, BF16])
def test_layout_and_row_view_share_memory(dtype_dim):
    pool = device_pool(dtype_dim=dtype_dim)
    host = KVOffloadHostPool(pool, host_size_gb=0.0002)  # 200 kB
    row = host.row_bytes
    assert host.size == int(200_000 // (row * 2)) // P * P
    assert not host.pin_memory
    assert host.kv_buffer.dtype == pool.store_dtype
    v = host.host_row_view(1)
    layer0 = host.kv_buffer[0].clone()  # the pool is torch.empty: compare, do not expect zeros
    assert v.dtype == torch.uint8 and v.shape == (host.size, row)
    v[5].fill_(7)
    assert (host.kv_buffer[1, 5].view(torch.uint8) == 7).all()
    # Bytes, not values: the uninitialised pool may hold NaN bit patterns (NaN != NaN).
    assert torch.equal(host.kv_buffer[0].view(torch.uint8), layer0.view(torch.uint8))
    assert host.row_views[1].words.data_ptr() == host.kv_buffer[1].data_ptr()
    # What pd_direct_to_host registers with Mooncake (as upstream MLATokenToKVPoolHost's): a page
    # of one layer per item, at the layer's rows.
    ptrs, lens, items = host.get_contiguous_buf_infos()
    assert ptrs == [host.kv_buffer[i].data_ptr() for i in range(2)]
    assert lens == [host.size * row] * 2 and items == [P * row] * 2


def test_ratio_is_relative_to_logical_capacity():
    pool = device_pool(physical=256, logical=1024)
    host = KVOffloadHostPool(pool, host_pool_ratio=1.5, host_reserve_bytes=0)
    # The arena's logical tokens when every unit is logical, not what either side holds now.
    assert host.size == int(pool.sizing.logical_tokens * 1.5) // P * P


def test_alloc_is_page_aligned_after_churn():
    host = KVOffloadHostPool(device_pool(), host_pool_ratio=1)
    start = host.available_size()
    a = host.alloc(3 * P)
    b = host.alloc(P)
    c = host.alloc(2 * P)
    host.free(b)
    host.free(a)
    d = host.alloc(4 * P)
    for t in (c, d):
        pages = t.view(-1, P)
        assert (pages[:, 0] % P == 0).all()
        assert (pages - pages[:, :1] == torch.arange(P)).all()
    host.free(c)
    host.free(d)
    assert host.available_size() == start
    assert host.alloc(start + P) is None
    assert host.available_size() == start


def test_errors():
    pool = device_pool()
    host = KVOffloadHostPool(pool, host_pool_ratio=1)
    with pytest.raises(ValueError, match="multiple of page_size 64"):
        host.alloc(65)
    with pytest.raises(RuntimeError, match="double free"):
        host.free(torch.arange(P))
    a = host.alloc(2 * P)
    host.free(a[:P])
    with pytest.raises(RuntimeError, match=f"double free: freeing {P} slots \\({P} of them not"):
        host.free(a[:P])  # the count still fits: the slots' own state tells
    host.free(a[P:])
    with pytest.raises(HostPoolSizeError, match="host_pool_size_gb or host_pool_ratio"):
        KVOffloadHostPool(pool)
    with pytest.raises(HostPoolSizeError, match="at least one page"):
        KVOffloadHostPool(pool, host_size_gb=1e-6)
    with pytest.raises(ValueError, match="needs a CUDA device pool"):
        KVOffloadHostPool(pool, host_pool_ratio=1, pin_memory=True)


def test_too_large_names_the_numbers_and_keys():
    pool = device_pool()
    free_gb = psutil.virtual_memory().available / 1e9
    with pytest.raises(HostPoolSizeError) as ei:
        KVOffloadHostPool(pool, host_size_gb=free_gb * 4)
    msg = str(ei.value)
    assert "requested" in msg and "GB" in msg and "is free" in msg
    assert "host_pool_size_gb" in msg and "host_pool_ratio" in msg and "--kv-offload-config" in msg


def test_pools_of_one_node_must_fit_together(monkeypatch):
    """Attention-DP ranks (or DP replicas) build their pools at the same time, each seeing the
    others' memory still free: a pool that fits alone is refused when the node's pools do not."""
    pool = device_pool()
    probe = KVOffloadHostPool(pool, host_pool_ratio=1)
    requested = probe.size * probe.size_per_token
    reserve = 1 << 20
    free = 3 * requested + reserve + 1  # three such pools fit, four do not

    monkeypatch.setattr(host_pool_mod, "available_host_memory_bytes", lambda **_: free)
    KVOffloadHostPool(pool, host_pool_ratio=1, host_reserve_bytes=reserve, pools_on_node=3)
    with pytest.raises(HostPoolSizeError) as ei:
        KVOffloadHostPool(pool, host_pool_ratio=1, host_reserve_bytes=reserve, pools_on_node=4)
    assert "4 pools on this node" in str(ei.value)


def test_default_reserve_is_upstreams(monkeypatch):
    """Without ``host_reserve_bytes`` the pool keeps upstream HiCache's host reserve free."""
    pool = device_pool()
    probe = KVOffloadHostPool(pool, host_pool_ratio=1, host_reserve_bytes=0)
    fits = probe.size * probe.size_per_token + HICACHE_HOST_MEMORY_RESERVE_BYTES
    monkeypatch.setattr(host_pool_mod, "available_host_memory_bytes", lambda **_: fits)
    KVOffloadHostPool(pool, host_pool_ratio=1)
    monkeypatch.setattr(host_pool_mod, "available_host_memory_bytes", lambda **_: fits - 1)
    with pytest.raises(HostPoolSizeError, match="after keeping 10.74 GB"):
        KVOffloadHostPool(pool, host_pool_ratio=1)


def test_unpin_syncs_before_unregistering_and_waits_out_a_capture(monkeypatch, caplog):
    """The pinned pool's finalizer (CUDA calls replaced by recorders so it runs on CPU)."""
    calls, state = [], {"capturing": False, "rc": 0}

    class Cudart:
        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return state["rc"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(host_pool_mod, "_UNPIN_LATER", [])
    a, b = torch.zeros(16), torch.zeros(16)
    dev = torch.device("cuda", 0)

    state["capturing"] = True  # collected during a graph capture: no device sync, keep it pinned
    host_pool_mod._unpin_host_buffer(a, dev)
    assert calls == [] and [x[0] for x in host_pool_mod._UNPIN_LATER] == [a]
    state["capturing"] = False  # the next finalizer outside a capture unpins both
    host_pool_mod._unpin_host_buffer(b, dev)
    assert calls == [
        ("sync",),
        ("unregister", b.data_ptr()),
        ("sync",),
        ("unregister", a.data_ptr()),
    ]
    assert host_pool_mod._UNPIN_LATER == []

    state["rc"] = 713
    with caplog.at_level(logging.WARNING):
        host_pool_mod._unpin_host_buffer(a, dev)
    assert "cudaHostUnregister" in caplog.text and host_pool_mod._UNPIN_LATER == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dropped_pinned_pool_is_unregistered():
    host = KVOffloadHostPool(
        offload_device_pool(256, 1024, 2, FP8, device="cuda"), host_pool_ratio=1
    )
    assert host.pin_memory
    buf = host.kv_buffer  # keeps the memory allocated, so its address stays meaningful
    del host
    gc.collect()
    cudart = torch.cuda.cudart()
    # Registering again succeeds only if the dropped pool unpinned its buffer.
    assert int(cudart.cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)) == 0
    assert int(cudart.cudaHostUnregister(buf.data_ptr())) == 0
