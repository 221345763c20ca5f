"""Split NSA device pool + allocator: accounting, sizing, decode tail rows, loc_to_host (CPU)."""

import pytest
import torch
from _pools import offload_device_pool
from sglang.srt.mem_cache.sparsity.kv_offload.arena import MIN_UNITS, plan_arena
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    LOGICAL_LOC_STATE_BYTES,
    KVOffloadTokenToKVPoolAllocator,
    index_row_bytes,
    kv_row_bytes,
    size_arena,
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


@pytest.mark.parametrize("row", [656, 1152])
def test_arena_sizing_deepseek_v32(row):
    """61 layers, a 60 GB budget: the arena holds what upstream gives the same bytes (tokens that
    stay on the GPU, KV and index keys), less the 16 B of state per logical loc (all layers), and
    about (R + 132) / 132 times as many logical tokens."""
    layers, budget, idx, state = 61, 60 * 10**9, 132, LOGICAL_LOC_STATE_BYTES
    flag_off = budget // ((row + idx) * layers)  # upstream's max_total_num_tokens
    s = size_arena(budget, layers, row, idx, P, logical_loc_bytes=state)
    layout = s.layout
    lcm_pages = {656: 33, 1152: 11}[row]  # lcm(64 R, 64 x 132) / (64 R): no index byte wasted
    assert layout.unit_pages == lcm_pages and layout.logical_pages_per_unit * 64 * idx == (
        lcm_pages * 64 * row
    )
    ids = layout.index_pages * P  # every logical loc the index view spans has its state
    assert s.arena_bytes + ids * state <= budget
    assert (
        budget - (s.arena_bytes + ids * state) < (layout.unit_bytes + state * ids / layers) * layers
    )
    # Resident: the per-loc state is the only cost beyond upstream's (16 B of 61 x (R + 132)).
    assert 0.995 * flag_off <= layout.resident_tokens <= flag_off
    # Offloaded: 132 B per token and layer and 16 B per token instead of (R + 132) per layer.
    assert s.logical_tokens >= 0.999 * budget / (idx * layers + state) - layout.unit_bytes
    assert s.logical_tokens / flag_off > (row + idx) * layers / (idx * layers + state) * 0.99
    assert s.physical_rows * row * layers <= s.arena_bytes
    # The NSA index row: 128 B fp8 keys + one 4 B scale per 128-dim block.
    assert index_row_bytes(128) == 132 and index_row_bytes(256) == 264
    assert kv_row_bytes(656, torch.uint8) == 656 and kv_row_bytes(576, torch.bfloat16) == 1152


def test_small_arena_keeps_units_fine_and_refuses_less_than_two_pages():
    layout = plan_arena(8192 * (1152 + 132), 1152, 132, P)  # the CPU tiny server's budget
    assert layout.num_units >= MIN_UNITS and layout.layer_bytes <= 8192 * (1152 + 132)
    assert layout.physical_pages == 8192 * (1152 + 132) // (P * 1152)  # every byte usable as rows
    with pytest.raises(ValueError, match="fewer than two KV pages"):
        plan_arena(P * 656 + 1, 656, 132, P)


@pytest.mark.parametrize("dtype_dim,row", [(FP8, 656), (BF16, 1152)])
def test_kv_rows_and_index_pages_are_views_of_one_arena(dtype_dim, row):
    layers = 3
    pool, alloc, _ = make(layers, dtype_dim, 256, 2048)
    layout = pool.sizing.layout
    assert pool.row_bytes == row
    for i in range(layers):
        arena = pool.arenas[i]
        assert arena.numel() == layout.layer_bytes
        kv, index = pool.kv_buffer[i], pool.index_k_with_scale_buffer[i]
        assert kv.data_ptr() == index.data_ptr() == arena.data_ptr()
        assert kv.nbytes == layout.physical_pages * P * row <= arena.numel()
        assert index.shape == (layout.index_pages, P * 132) and index.nbytes <= arena.numel()
    assert pool.device_row_view(1).shape == (layout.physical_pages * P, row)
    assert alloc.logical_size == (layout.index_pages - 1) * P
    assert alloc.physical_size == layout.max_physical_pages * P


def test_loc_to_host_table_and_mapping_are_shared():
    pool, alloc, _ = make()
    assert alloc.loc_to_host.shape == (alloc.logical_size + P + 1,)
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
    start = alloc.free_counts()
    mapping = alloc.full_to_hisparse_device_index_mapping
    locs = extend(alloc, [64])  # one full prompt page
    # the prompt page is backed up and its physical page released
    alloc.set_host_locs(locs, host.alloc(P))
    alloc.release_physical(locs)
    assert (mapping[locs] == 0).all()
    assert alloc.physical_available_size() == start["physical"]
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
    assert alloc.physical_available_size() == start["physical"] - 2 * P
    alloc.free(torch.tensor(seq_locs))
    assert alloc.free_counts() == start
    assert (alloc.loc_to_host == -1).all() and (mapping[:-1] == 0).all()


def test_alloc_decode_fails_without_side_effects_when_the_arena_is_full():
    pool, alloc, _ = make(physical=192, logical=1024)
    start = alloc.free_counts()
    prompts = []
    while (locs := extend(alloc, [64])) is not None:  # whole arena: rows + index keys
        prompts.append(locs)
    a = torch.cat(prompts[-2:])
    before = alloc.free_counts()
    seq = torch.tensor([65, 65])  # both start a new page
    out = alloc.alloc_decode(seq, seq, a.view(2, P)[:, -1].contiguous())
    assert out is None
    assert alloc.free_counts() == before
    assert len(prompts) * P >= 0.9 * pool.sizing.layout.resident_tokens  # no unit left idle
    alloc.free(torch.cat(prompts))
    assert alloc.free_counts() == start


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


def test_free_without_a_host_pool_names_the_fix():
    _, alloc, _ = make()
    alloc.host_pool = None
    locs = extend(alloc, [64])
    alloc.set_host_locs(locs, torch.arange(64))
    with pytest.raises(RuntimeError, match="register_host_pool"):
        alloc.free(locs)


@pytest.mark.parametrize("how", ["decode_ahead", "prompt_page"])
def test_free_unmaps_whole_logical_pages_so_reused_locs_have_no_stale_rows(how):
    """A free frees whole logical pages, and with them every physical row their locs map to, even
    locs it was not passed: the overlap scheduler's loc allocated ahead of a finished request's last
    token (release_kv_cache frees [0, committed) and leaves an allocated-ahead loc sharing that page),
    or the rest of alloc_prompt's last page. Otherwise such a loc keeps a physical row after its
    page is freed, a direct-to-host pre-allocation (which maps nothing) hands it out again, and its
    free frees that row's page a second time (the PD soak's physical free count above the start)."""
    pool, alloc, host = make(physical=512)
    mapping = alloc.full_to_hisparse_device_index_mapping
    start = alloc.free_counts()
    if how == "decode_ahead":
        locs = extend(alloc, [10])
        seq = torch.tensor([11])
        ahead = alloc.alloc_decode(seq, seq, locs[-1:])
        assert int(ahead[0]) // P == int(locs[0]) // P and int(mapping[ahead[0]]) > 0
    else:
        locs = alloc.alloc_prompt(10, to_host=False)  # a resumed request's GPU staging
        alloc.unpin_prompt(locs)  # its transfer ended
    page = int(locs[0]) // P
    alloc.free(locs)
    assert bool((mapping[page * P : (page + 1) * P] == 0).all()), "a freed loc kept its row"
    assert alloc.free_counts() == start
    again = alloc.alloc_prompt(P, to_host=True)  # direct-to-host: logical locs and host pages
    assert int(again[0]) // P == page, "the freed logical page is handed out again"
    assert bool((mapping[again] == 0).all())
    alloc.free(again)
    assert alloc.free_counts() == start
    free = alloc.hisparse_attn_allocator.all_free_pages()
    assert free.unique().numel() == free.numel() and not bool((free == 0).any())
