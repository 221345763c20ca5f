"""Lifecycle of the sparse-cache state with the real upstream page allocator."""

from __future__ import annotations

import pytest
import torch
from _lru_sim import make_allocator, run_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_ref import check_invariants, plan_layer_ref
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import (
    HINT_ENTRIES_PER_SLOT,
    SparseCacheState,
)

SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _state(pages=8, layers=2, reqs=4, buffer=128, topk=32):
    alloc = make_allocator(pages)
    return SparseCacheState(layers, reqs, buffer, topk, alloc, "cpu"), alloc


def _snapshot(s: SparseCacheState):
    return [t.clone() for t in (s.hint, s.slot_loc, s.lru, s.out_cache_loc_sparse, s.num_slots)] + [
        list(s.num_slots_cpu),
        s.allocator.available_size(),
    ]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_elastic_slot_counts():
    s, alloc = _state(buffer=130)  # rounded up to 192
    assert s.max_slots == 192
    assert [s.slots_for(c) for c in (0, 1, 64, 65, 191, 192, 10**6)] == [
        64,
        64,
        64,
        128,
        192,
        192,
        192,
    ]
    start = alloc.available_size()
    assert s.admit(0, 70)
    assert s.num_slots_cpu[0] == 128 and alloc.available_size() == start - 128
    rows = s.out_cache_loc_sparse[0, :128]
    assert bool((rows % 64 == torch.arange(128) % 64).all())  # whole pages
    assert bool((s.out_cache_loc_sparse[0, 128:] == -1).all())
    assert s.grow(0, 100) and s.num_slots_cpu[0] == 128  # no-op
    assert s.grow(0, 129) and s.num_slots_cpu[0] == 192
    assert s.grow(0, 5000) and s.num_slots_cpu[0] == 192  # capped at the buffer
    check_invariants(s)
    assert s.release(0) == 192 and alloc.available_size() == start


def test_grow_puts_new_slots_at_the_lru_end():
    s, _ = _state(buffer=128, layers=1)
    s.admit(1, 10)
    s.lru[0, 1, :64] = torch.arange(64).flip(0).to(torch.int16)
    assert s.grow(1, 100)
    assert s.lru[0, 1, :128].tolist() == list(range(64, 128)) + list(range(63, -1, -1))
    check_invariants(s)


def test_admission_failure_under_exhaustion_leaves_state_intact():
    s, alloc = _state(pages=3, buffer=128)
    assert s.admit(0, 128)
    assert alloc.available_size() == 64  # one page left: 128 slots do not fit, 64 do
    before = _snapshot(s)
    assert s.admit(1, 128) is False
    assert _same(before, _snapshot(s))
    assert s.admit(1, 64)  # the last page still fits
    before = _snapshot(s)
    assert s.grow(1, 128) is False
    assert _same(before, _snapshot(s))
    check_invariants(s)


def test_lifecycle_misuse():
    s, alloc = _state()
    start = alloc.available_size()
    with pytest.raises(RuntimeError):
        s.grow(0, 10)
    assert s.admit(0, 10)
    with pytest.raises(RuntimeError):
        s.admit(0, 10)
    assert s.release(0) == 64
    assert s.release(0) == 0  # idempotent: nothing freed twice
    assert alloc.available_size() == start
    with pytest.raises(ValueError):
        _state(buffer=16, topk=128)  # 64 slots cannot hold a full top-k
    with pytest.raises(ValueError):
        SparseCacheState(1, 1, 128, 32, make_allocator_with_page(16), "cpu")


def make_allocator_with_page(page: int):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(page * 8, page, torch.int64, "cpu", None, False)


def test_release_clears_every_entry_after_real_traffic():
    w = run_trace(3, plan_layer_ref, steps=6, max_ctx=300, buffer_slots=64, pool_pages=14)
    assert w.stats["misses"] > 0
    for r in list(w.reqs):
        w.release(r)
    s = w.state
    assert bool((s.hint == -1).all()) and bool((s.slot_loc == -1).all())
    assert bool((s.out_cache_loc_sparse == -1).all()) and bool((s.num_slots == 0).all())
    assert w.alloc.available_size() == w.free_at_start
    check_invariants(s)


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "release"]), st.integers(0, 3), st.integers(1, 400)
        ),
        max_size=40,
    )
)
def test_random_lifecycle_conserves_slots(ops):
    s, alloc = _state(pages=6, buffer=128, layers=1)
    start = alloc.available_size()
    for op, r, ctx in ops:
        before = _snapshot(s)
        if op == "admit":
            if s.num_slots_cpu[r]:
                with pytest.raises(RuntimeError):
                    s.admit(r, ctx)
            elif not s.admit(r, ctx):
                assert _same(before, _snapshot(s)) and alloc.available_size() < s.slots_for(ctx)
        elif op == "grow":
            if s.num_slots_cpu[r] and not s.grow(r, ctx):
                assert _same(before, _snapshot(s))
        else:
            s.release(r)
        owned = sum(s.num_slots_cpu)
        assert alloc.available_size() + owned == start
        rows = torch.cat([s.out_cache_loc_sparse[q, : s.num_slots_cpu[q]] for q in range(4)])
        assert rows.numel() == torch.unique(rows).numel(), "a row granted twice"
        check_invariants(s)
    for r in range(4):
        s.release(r)
    assert alloc.available_size() == start


def test_metadata_budget():
    """Nothing per logical token: per slot and layer 4 B of slot_loc, 2 B of lru and 4 B of hint
    table (2 entries of 2 B); per slot 4 B of physical row. At 128K, 61 layers, 656 B rows and
    4096 slots that is 0.048 % of the KV bytes a request's slots manage (design reference)."""
    s, _ = _state(pages=4, layers=3, reqs=2, buffer=64, topk=32)
    assert s.hint.shape == (3, 2, 128) and s.hint.dtype == torch.int16
    tables = (s.hint, s.slot_loc, s.lru, s.out_cache_loc_sparse, s.num_slots)
    per_slot_layer = 4 + 2 + 2 * HINT_ENTRIES_PER_SLOT
    want = 3 * 2 * 64 * per_slot_layer + 2 * 64 * 4 + 2 * 4
    assert sum(t.numel() * t.element_size() for t in tables) == want
    slots, layers, ctx, row = 4096, 61, 128 * 1024, 656
    frac = (per_slot_layer * slots * layers + 4 * slots + 4) / (row * ctx * layers)
    assert round(100 * frac, 3) == 0.048
