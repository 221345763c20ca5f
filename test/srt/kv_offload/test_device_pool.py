"""Split NSA device pool + allocator: accounting, sizing, decode tail rows, loc_to_host (CPU)."""

import pytest
import torch
from _pools import offload_device_pool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadTokenToKVPoolAllocator,
    index_bytes_per_logical_token,
    index_row_bytes,
    kv_bytes_per_physical_slot,
    kv_row_bytes,
    physical_slots_needed,
    split_gpu_budget,
)
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool

P = 64
FP8 = (torch.float8_e4m3fn, 656)
BF16 = (torch.bfloat16, 576)


def make(layers=2, dtype_dim=FP8, physical=256, logical=1024, host_ratio=1.0):
    dtype, _ = dtype_dim
    pool = offload_device_pool(physical, logical, layers, dtype_dim)
    alloc = KVOffloadTokenToKVPoolAllocator(P, dtype, "cpu", pool, False)
    host = KVOffloadHostPool(pool, host_pool_ratio=host_ratio, host_reserve_bytes=0)
    alloc.register_host_pool(host)
    return pool, alloc, host


def extend(alloc, lens, prefix=None):
    """Allocate prompts of ``lens`` tokens (real upstream paged alloc_extend)."""
    n = len(lens)
    seq = torch.tensor(lens, dtype=torch.int64)
    pre = torch.zeros(n, dtype=torch.int64) if prefix is None else torch.tensor(prefix)
    last = torch.full((n,), -1, dtype=torch.int64)
    return alloc.alloc_extend(pre, pre, seq, seq, last, int((seq - pre).sum()))


def test_sizing_deepseek_v32():
    layers = 61
    assert index_bytes_per_logical_token(layers, 132) == 132 * 61
    assert index_bytes_per_logical_token(layers, 136) == 8_296
    assert kv_bytes_per_physical_slot(656, layers) == 40_016
    assert kv_bytes_per_physical_slot(1152, layers) == 70_272
    assert kv_row_bytes(656, torch.uint8) == 656 and kv_row_bytes(576, torch.bfloat16) == 1152
    # bs 128, 4096 slots, 32K staging: 128 * (4096 + 2 * 64) + 32768 = 540_672 + 32_768 = 573_440;
    # one staging token more rounds up to a whole page: + 64.
    assert physical_slots_needed(128, 4096, staging_tokens=32768) == 573_440
    assert physical_slots_needed(128, 4096, staging_tokens=32768 + 1) == 573_504
    # 4033 sparse slots round up to 4096: 128 * (4096 + 128) + 0 = 540_672.
    assert physical_slots_needed(128, 4033, staging_tokens=0) == 540_672

    # logical = floor64((budget - phys * R * L) / (idx * L)), worked by hand for a 60 GB budget:
    budget, phys = 60 * 10**9, 573_440
    # fp8 rows (R = 656): kv = 573_440 * 656 * 61 = 376_176_640 * 61 = 22_946_775_040 B,
    # left = 60_000_000_000 - 22_946_775_040 = 37_053_224_960 B.
    #   idx 136 (8_296 B/token): 37_053_224_960 / 8_296 = 4_466_396.45 -> floor64 = 69_787 * 64
    #     = 4_466_368 (docs: "4.47 M tokens"); 4_466_368 * 8_296 = 37_052_988_928 <= left.
    #   idx 132 (8_052 B/token): 37_053_224_960 / 8_052 = 4_601_741.80 -> 71_902 * 64 = 4_601_728.
    # bf16 rows (R = 1152): kv = 573_440 * 1152 * 61 = 660_602_880 * 61 = 40_296_775_680 B,
    # left = 19_703_224_320 B.
    #   idx 136: 19_703_224_320 / 8_296 = 2_375_027.04 -> 37_109 * 64 = 2_374_976.
    #   idx 132: 19_703_224_320 / 8_052 = 2_446_997.56 -> 38_234 * 64 = 2_446_976.
    cases = [
        (656, 136, 22_946_775_040, 4_466_368),
        (656, 132, 22_946_775_040, 4_601_728),
        (1152, 136, 40_296_775_680, 2_374_976),
        (1152, 132, 40_296_775_680, 2_446_976),
    ]
    for row, idx, kv_bytes, logical in cases:
        s = split_gpu_budget(budget, layers, row, phys, index_row_bytes=idx)
        assert (s.logical_tokens, s.physical_slots) == (logical, phys), (row, idx)
        assert s.kv_bytes == kv_bytes and s.index_bytes == logical * idx * 61, (row, idx)
        assert s.total_bytes <= budget < s.total_bytes + P * idx * 61, (row, idx)
    # The NSA index row: 128 B fp8 keys + one 4 B scale per 128-dim block.
    assert index_row_bytes(128) == 132 and index_row_bytes(256) == 264
    # Physical slots round up to a page: 573_441 -> 573_504; kv = 573_504 * 40_016 =
    # 22_949_336_064, left = 37_050_663_936, / 8_296 = 4_466_087.7 -> 69_782 * 64 = 4_466_048.
    s = split_gpu_budget(budget, layers, 656, phys + 1, index_row_bytes=136)
    assert (s.physical_slots, s.logical_tokens, s.kv_bytes) == (573_504, 4_466_048, 22_949_336_064)
    # Too small: the KV rows take the whole budget, or leave less than a page of index keys.
    with pytest.raises(ValueError, match="too small.*physical KV slots"):
        split_gpu_budget(22_946_775_040, layers, 656, phys, index_row_bytes=136)
    with pytest.raises(ValueError, match="too small.*physical KV slots"):
        split_gpu_budget(22_946_775_040 + 63 * 8_296, layers, 656, phys, index_row_bytes=136)
    s = split_gpu_budget(22_946_775_040 + 64 * 8_296, layers, 656, phys, index_row_bytes=136)
    assert s.logical_tokens == 64


@pytest.mark.parametrize("dtype_dim,row", [(FP8, 656), (BF16, 1152)])
def test_allocated_bytes_match_formulas(dtype_dim, row):
    layers, phys, logical = 3, 256, 2048
    pool, alloc, _ = make(layers, dtype_dim, phys, logical)
    got = pool.allocated_bytes()
    assert pool.row_bytes == row
    assert got["kv"] == (phys + P) * row * layers  # + the padding page (slot 0 is a dummy)
    assert got["index"] == ((logical + P + 1) // P) * P * 132 * layers
    assert pool.get_cell_size_per_token() == {"logical": 132 * layers, "physical": row * layers}
    # the same shapes upstream DSATokenToKVPool gives an all-on-GPU pool of `logical` tokens
    ref = DSATokenToKVPool(
        logical, P, 512, dtype_dim[0], 64, layers, "cpu", 128, False, dtype_dim[1]
    )
    assert sum(b.nbytes for b in ref.index_k_with_scale_buffer) == got["index"]
    assert pool.device_row_view(1).shape == (phys + P, row)
    assert alloc.logical_size == logical and alloc.physical_size == phys


def test_loc_to_host_table_and_mapping_are_shared():
    pool, alloc, _ = make()
    assert alloc.loc_to_host.shape == (1024 + P + 1,)
    assert (alloc.loc_to_host == -1).all()
    locs = extend(alloc, [100])
    alloc.set_host_locs(locs[:64], torch.arange(64) + 640)
    assert torch.equal(pool.loc_to_host[locs[:64]], torch.arange(64) + 640)
    phys = pool.full_to_hisparse_device_index_mapping[locs]
    assert (phys > 0).all()
    assert ((phys % P) == (locs % P)).all()  # same in-page offsets in both spaces
    assert pool.full_to_hisparse_device_index_mapping[-1] == -1


def test_decode_tail_gets_physical_rows_and_crosses_pages():
    pool, alloc, host = make(physical=256, logical=1024)
    mapping = alloc.full_to_hisparse_device_index_mapping
    locs = extend(alloc, [64])  # one full prompt page
    # the prompt page is backed up and its physical page released
    alloc.set_host_locs(locs, host.alloc(P))
    alloc.release_physical(locs)
    assert (mapping[locs] == 0).all() and alloc.physical_available_size() == 256
    seq_locs = list(locs)
    for step in range(70):
        seq_len = 64 + step + 1
        last = torch.tensor([seq_locs[-1]])
        new = alloc.alloc_decode(torch.tensor([seq_len]), torch.tensor([seq_len]), last)
        seq_locs.append(int(new[0]))
        ph = int(mapping[new[0]])
        assert ph > 0 and ph % P == (seq_len - 1) % P
        if seq_len % P != 1:
            assert ph == int(mapping[seq_locs[-2]]) + 1  # same physical page as the previous token
    assert alloc.physical_available_size() == 256 - 2 * P
    alloc.free(torch.tensor(seq_locs))
    assert alloc.free_counts() == {"logical": 1024, "physical": 256, "host": host.size}
    assert (alloc.loc_to_host == -1).all() and (mapping[:-1] == 0).all()


def test_alloc_decode_fails_without_side_effects_when_physical_is_full():
    pool, alloc, _ = make(physical=192, logical=1024)
    a = torch.cat([extend(alloc, [64]), extend(alloc, [64])])  # one physical page left
    before = alloc.free_counts()
    assert before["physical"] == P and before["logical"] == 1024 - 2 * P
    seq = torch.tensor([65, 65])  # both start a new page: two needed
    out = alloc.alloc_decode(seq, seq, a.view(2, P)[:, -1].contiguous())
    assert out is None
    assert alloc.free_counts() == before


def test_free_returns_host_slots_page_granular():
    pool, alloc, host = make(physical=512)
    start = alloc.free_counts()
    locs = extend(alloc, [200, 64])
    a, b = locs[:200], locs[200:]
    h = host.alloc(3 * P)
    alloc.set_host_locs(a[: 3 * P], h)
    alloc.release_physical(a[: 3 * P])
    # freeing one token of a page frees the whole logical page, and with it that page's host slots
    alloc.free(a[70:71])
    assert host.available_size() == start["host"] - 2 * P
    assert (alloc.loc_to_host[a[64:128]] == -1).all()
    assert (alloc.loc_to_host[a[:64]] >= 0).all()
    alloc.free(torch.cat([a[:64], a[128:]]))
    alloc.free(b)
    assert alloc.free_counts() == start


def test_bad_sizes():
    with pytest.raises(ValueError, match="multiple of page_size 64"):
        make(physical=100)
    _, alloc, _ = make()
    alloc.host_pool = None
    locs = extend(alloc, [64])
    alloc.set_host_locs(locs, torch.arange(64))
    with pytest.raises(RuntimeError, match="register_host_pool"):
        alloc.free(locs)
