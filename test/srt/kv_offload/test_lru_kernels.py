"""The Triton plan kernel equals the torch reference bit for bit (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import random

import pytest
import torch
from _lru_sim import World, run_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_ref import (
    ERR_MISS_NOT_ON_HOST,
    ERR_SLOT_OVERFLOW,
    PlanResult,
    check_invariants,
    compact_miss_list,
    plan_layer_ref,
)
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import (
    STAT_NAMES,
    PlanWorkspace,
    plan_layer,
)
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import LayerState

SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _clone_state(s: LayerState) -> LayerState:
    return LayerState(*(t.clone() for t in s))


def _pairs(host: torch.Tensor, dst: torch.Tensor):
    order = torch.argsort(dst)
    return host[order], dst[order]


def assert_same(ref: PlanResult, got: PlanResult, compact: bool, n_real: int) -> None:
    assert torch.equal(got.out_indices, ref.out_indices)
    assert torch.equal(got.num_misses[:n_real], ref.num_misses[:n_real])
    assert bool((got.num_misses[n_real:] == 0).all())
    assert torch.equal(got.error_flags, ref.error_flags)
    assert torch.equal(got.miss_count, ref.miss_count)
    if compact:
        cnt = int(got.miss_count[0])
        rh, rd = _pairs(*compact_miss_list(ref))
        gh, gd = _pairs(got.miss_host[:cnt], got.miss_dst[:cnt])
        assert torch.equal(gh, rh) and torch.equal(gd.to(torch.int32), rd)
    else:
        assert torch.equal(got.miss_host, ref.miss_host)
        assert torch.equal(got.miss_dst, ref.miss_dst)


def lockstep(max_bs: int, topk: int, max_slots: int, compact: bool, num_warps: int = 4):
    """A plan function running the reference on a copy of the state, then the kernel, and comparing."""
    ws = PlanWorkspace(max_bs, topk, max_slots, device="cpu")

    def plan(topk_t, rpi, nr, l2h, l2t, state: LayerState) -> PlanResult:
        shadow = _clone_state(state)
        ref = plan_layer_ref(topk_t, rpi, nr, l2h, l2t, shadow)
        ws.reset_errors()
        got = plan_layer(topk_t, rpi, nr, l2h, l2t, state, ws, num_warps=num_warps, compact=compact)
        assert_same(ref, got, compact, int(nr[0]))
        for name, a, b in zip(LayerState._fields, shadow, state):
            assert torch.equal(a, b), f"state {name} differs from the reference"
        assert bool((ws._claim == 0).all()), "hint claims left behind"
        return got

    plan.ws = ws
    return plan


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    topk=st.sampled_from([32, 48]),  # 48: K not a power of two (masked lanes)
    buffer_slots=st.sampled_from([64, 192]),
    max_ctx=st.sampled_from([60, 300]),
    compact=st.booleans(),
    graph_bs=st.sampled_from([None, 6]),
    share=st.booleans(),
)
def test_kernel_equals_reference_on_random_traces(
    seed, topk, buffer_slots, max_ctx, compact, graph_bs, share
):
    max_reqs = 4
    plan = lockstep(max(max_reqs, graph_bs or 0), topk, buffer_slots, compact)
    run_trace(
        seed,
        plan,
        steps=4,
        topk=topk,
        buffer_slots=buffer_slots,
        max_ctx=max_ctx,
        compact=compact,
        graph_bs=graph_bs,
        max_reqs=max_reqs,
        pool_pages=14,
        share=share,
    )


def test_kernel_trace_exercises_every_path():
    plan = lockstep(6, 32, 64, compact=True)
    total = None
    for seed in range(3):
        w = run_trace(
            seed,
            plan,
            steps=5,
            topk=32,
            buffer_slots=64,
            max_ctx=300,
            compact=True,
            graph_bs=6,
            pool_pages=14,
            share=seed > 0,
        )
        for r in list(w.reqs):
            w.release(r)
        assert w.alloc.available_size() == w.free_at_start
        assert not w.loc_refs and bool((w.state.hint == -1).all())
        total = w.stats if total is None else total + w.stats
    for what in ("hits", "misses", "evictions", "tail", "dups", "padded_rows", "row0_padded_rows"):
        assert total[what] > 0, (what, total)
    # shared radix prefixes, and a shared loc in two rows of one launch (claims of two rows)
    for what in ("shared_prefix_tokens", "locs_in_two_rows"):
        assert total[what] > 0, (what, total)


def _fresh_world(ctxs, topk=32, buffer_slots=64, pool_pages=8):
    w = World(
        random.Random(1),
        num_layers=1,
        max_reqs=len(ctxs),
        topk=topk,
        buffer_slots=buffer_slots,
        pool_pages=pool_pages,
    )
    for r, c in enumerate(ctxs, start=1):  # row 0 is the padding row
        assert w.add_request(r, c)
    return w


def _step(w: World, plan, rows, n_real=None, compact=False):
    topk = torch.stack(rows)
    bs = topk.shape[0]
    rpi = torch.arange(bs, dtype=torch.int64) % len(w.reqs) + 1
    nr = torch.tensor([bs if n_real is None else n_real], dtype=torch.int32)
    res = plan(topk, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0))
    w.load_and_check(0, topk, rpi, int(nr[0]), res, compact=compact)
    return res


def test_empty_then_full_cache_short_requests():
    # context <= buffer: the first step loads everything, the next one hits everything
    w = _fresh_world([20, 64])
    plan = lockstep(2, 32, 64, compact=False)
    rows = [
        torch.tensor(w.reqs[r][-32:] + [-1] * max(0, 32 - len(w.reqs[r])), dtype=torch.int32)[:32]
        for r in (1, 2)
    ]
    r1 = _step(w, plan, rows)
    assert r1.num_misses.tolist() == [0, 32]  # request 0's 20 tokens are all tail rows
    r2 = _step(w, plan, rows)
    assert r2.num_misses.tolist() == [0, 0]
    check_invariants(w.state)


def test_all_padding_and_all_minus_one_rows():
    w = _fresh_world([100, 100, 100])
    plan = lockstep(3, 32, 64, compact=True)
    blank = torch.full((32,), -1, dtype=torch.int32)
    res = _step(w, plan, [blank, blank, blank], compact=True)
    assert int(res.miss_count[0]) == 0 and bool((res.out_indices == -1).all())
    before = w.state.slot_loc.clone()
    rows = [torch.tensor(w.reqs[1][:32], dtype=torch.int32)] * 3
    res = _step(w, plan, rows, n_real=0, compact=True)
    assert torch.equal(before, w.state.slot_loc) and int(res.miss_count[0]) == 0


def test_rows_of_request_zero_are_padding_even_when_counted_real():
    """Attention DP's eager decode pads a rank's batch with request row 0 (upstream's padding row)
    and counts the padded rows in ``num_real_reqs``: those rows plan nothing, the real ones as
    usual."""
    w = _fresh_world([100, 100])
    plan = lockstep(4, 32, 64, compact=True)
    rows = [torch.tensor(w.reqs[r][:32], dtype=torch.int32) for r in (1, 2)] * 2
    rpi = torch.tensor([1, 2, 0, 0], dtype=torch.int64)
    nr = torch.tensor([4], dtype=torch.int32)
    res = plan(torch.stack(rows), rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0))
    w.load_and_check(0, torch.stack(rows), rpi, 2, res, compact=True)
    assert bool((res.out_indices[:2] >= 0).all()) and bool((res.out_indices[2:] == -1).all())
    assert res.num_misses.tolist()[2:] == [0, 0] and int(res.miss_count[0]) > 0
    assert int(w.state.num_slots_cpu[0]) == 0 and bool((w.state.slot_loc[0, 0] == -1).all())


def test_overflow_and_missing_host_copy_flags_match_reference():
    # a request owning fewer slots than its unique top-k: contract violation, flagged, no corruption
    K = 128
    state = LayerState(
        hint=torch.full((2, 128), -1, dtype=torch.int16),
        slot_loc=torch.full((2, 64), -1, dtype=torch.int32),  # request 1 (row 0 pads)
        lru=torch.arange(64, dtype=torch.int16).repeat(2, 1),
        out_cache_loc_sparse=torch.arange(64, dtype=torch.int32).repeat(2, 1) + 64,
        num_slots=torch.tensor([0, 64], dtype=torch.int32),
    )
    l2h = torch.arange(512, dtype=torch.int64)
    l2h[7] = -1
    l2t = torch.full((512,), -1, dtype=torch.int64)
    topk = (torch.randperm(290) + 8)[None, :K].to(torch.int32)
    topk[0, 0] = 7
    ws = PlanWorkspace(1, K, 64, device="cpu")
    shadow = _clone_state(state)
    rpi, nr = torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    ref = plan_layer_ref(topk, rpi, nr, l2h, l2t, shadow)
    got = plan_layer(topk, rpi, nr, l2h, l2t, state, ws, compact=False)
    assert int(ref.error_flags[0]) == ERR_SLOT_OVERFLOW | ERR_MISS_NOT_ON_HOST
    assert_same(ref, got, False, 1)
    assert all(torch.equal(a, b) for a, b in zip(shadow, state))
    assert int((got.out_indices >= 0).sum()) == 64
    assert int((state.hint[1] >= 0).sum()) <= 64 and bool((state.hint[0] == -1).all())
    assert bool((ws._claim == 0).all()), "hint claims left behind"


def test_topk_input_is_never_written_and_custom_output():
    w = _fresh_world([200])
    ws = PlanWorkspace(1, 32, 64, device="cpu")
    topk = torch.tensor([w.reqs[1][:32]], dtype=torch.int32)
    keep = topk.clone()
    rpi, nr = torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    shadow = _clone_state(w.state.layer(0))
    ref = plan_layer_ref(topk, rpi, nr, w.loc_to_host, w.loc_to_tail, shadow)
    out = torch.full((1, 32), 123, dtype=torch.int32)
    res = plan_layer(
        topk, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0), ws, out_indices=out
    )
    assert torch.equal(topk, keep) and res.out_indices.data_ptr() == out.data_ptr()
    # The caller's buffer holds the reference's rows, not merely some non-negative ones.
    assert torch.equal(out, ref.out_indices)
    assert_same(ref, res, True, 1)
    for name, a, b in zip(LayerState._fields, shadow, w.state.layer(0)):
        assert torch.equal(a, b), f"state {name} differs from the reference"
    # ... and those rows hold the KV of the requested tokens once the misses are loaded.
    w.load_and_check(0, topk, rpi, 1, res, compact=True)


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compact", [True, False])
def test_gpu_cuda_graph_replay_matches_eager(compact):
    """Plan + a torch-gather load for 2 layers, captured once, replayed with new inputs and padding."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

    dev = torch.device("cuda")
    L, R, K, S, G = 2, 6, 2048, 4096, 4  # G: captured batch size
    ctx = [3000, 9000, 20000, 5000, 700, 12000]
    N = sum(ctx) + 64
    W = 8  # int64 words per fake row
    g = torch.Generator(device="cpu").manual_seed(0)
    host = torch.randint(0, 2**62, (N, W), generator=g).to(dev)  # device stand-in for host KV
    l2h = torch.randperm(N, generator=g).to(dev)
    l2t = torch.full((N,), -1, dtype=torch.int64, device=dev)
    starts = [0]
    for c in ctx:
        starts.append(starts[-1] + c)
    pages = (R * S) // 64 + 8
    tail_base = (pages + 1) * 64
    for r, c in enumerate(ctx):  # the last c % 64 tokens are tail rows
        for i in range(c - c % 64, c):
            l2h[starts[r] + i] = -1
            l2t[starts[r] + i] = tail_base + starts[r] + i
    P = tail_base + N + 1  # last row: dummy target of masked loads

    def make():
        alloc = PagedTokenToKVPoolAllocator(pages * 64, 64, torch.int64, dev, None, False)
        st = SparseCacheState(L, R + 1, S, K, alloc, dev)  # requests 1..R (0 pads)
        for r, c in enumerate(ctx):
            assert st.admit(r + 1, c)
        kv = torch.zeros((L, P, W), dtype=torch.int64, device=dev)
        tl_rows = l2t[l2t >= 0]
        kv[:, tl_rows] = host[torch.nonzero(l2t >= 0).flatten()]  # tail content = "its" row
        return st, kv, PlanWorkspace(G, K, S, dev)

    def topk_for(step):
        gg = torch.Generator(device="cpu").manual_seed(100 + step)
        reqs = torch.randperm(R, generator=gg)[:G]
        rows = []
        for r in reqs.tolist():
            c = ctx[r]
            if c <= K:
                row = torch.full((K,), -1, dtype=torch.int64)
                row[:c] = torch.arange(c) + starts[r]
            else:
                hot = torch.arange(min(c, 2 * K)) + starts[r] + max(0, c - 2 * K)
                row = torch.cat(
                    [
                        hot[torch.randperm(hot.numel(), generator=gg)[: K // 2]],
                        torch.randperm(c, generator=gg)[:K] + starts[r],
                    ]
                )[:K]
                row[torch.randperm(K, generator=gg)[:16]] = row[0].clone()  # duplicates
            rows.append(row)
        topk = torch.stack(rows).to(torch.int32)
        n_real = int(torch.randint(1, G + 1, (1,), generator=gg))
        rpi = (reqs + 1).to(dev)
        return topk.to(dev), rpi, torch.tensor([n_real], dtype=torch.int32, device=dev)

    def layer_step(st, kv, ws, topk, rpi, nr, outs):
        for layer in range(L):
            res = plan_layer(topk, rpi, nr, l2h, l2t, st.layer(layer), ws, compact=compact)
            if compact:
                valid = torch.arange(G * K, device=dev) < res.miss_count
            else:
                valid = res.miss_dst >= 0
            src = torch.where(valid, res.miss_host, 0)
            dst = torch.where(valid, res.miss_dst.long(), P - 1)
            kv[layer].index_copy_(0, dst, host[src])
            outs[layer].copy_(res.out_indices)

    st_g, kv_g, ws_g = make()
    st_e, kv_e, ws_e = make()
    st_w, kv_w, ws_w = make()
    s_topk, s_rpi, s_nr = topk_for(0)
    outs_g = [torch.empty((G, K), dtype=torch.int32, device=dev) for _ in range(L)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile + warm up on a throwaway state
        layer_step(st_w, kv_w, ws_w, s_topk, s_rpi, s_nr, outs_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_step(st_g, kv_g, ws_g, s_topk, s_rpi, s_nr, outs_g)
    outs_e = [torch.empty_like(o) for o in outs_g]
    for step in range(8):
        topk, rpi, nr = topk_for(step)
        s_topk.copy_(topk)
        s_rpi.copy_(rpi)
        s_nr.copy_(nr)
        graph.replay()
        layer_step(st_e, kv_e, ws_e, topk, rpi, nr, outs_e)
        torch.cuda.synchronize()
        n_real = int(nr[0])
        for layer in range(L):
            assert torch.equal(outs_g[layer], outs_e[layer])
            assert bool((outs_g[layer][n_real:] == -1).all())
            o = outs_g[layer][:n_real]
            t = topk[:n_real].long()
            v = t >= 0
            want_rows = torch.where(l2t[t.clamp(min=0)] >= 0, -1, l2h[t.clamp(min=0)])
            got = kv_g[layer][o[v].long()]
            is_tail = want_rows[v] < 0
            assert torch.equal(got[~is_tail], host[want_rows[v][~is_tail]])
            assert torch.equal(got[is_tail], host[t[v][is_tail]])
            assert torch.equal(kv_g[layer][: P - 1], kv_e[layer][: P - 1])
        for a, b in (
            (st_g.hint, st_e.hint),
            (st_g.slot_loc, st_e.slot_loc),
            (st_g.lru, st_e.lru),
        ):
            assert torch.equal(a, b)
        assert int(ws_g.error_flags[0]) == 0


def test_requests_sharing_a_prefix_keep_their_own_slots():
    """A radix prefix: two requests' rows name the same locs. Each request resolves them to its own
    slots (or the loc's tail row), never to the other's; both rows missing a loc in one launch load
    it once per request, within a row a duplicate is loaded once, and from then on both hit: each
    request names its slots in its own hint table."""
    w = World(random.Random(1), num_layers=1, max_reqs=2, topk=32, buffer_slots=128, pool_pages=8)
    assert w.add_request(1, 128)
    assert w.add_request(2, 150, prefix_of=1, prefix_len=128)
    shared = w.reqs[1][:32]
    plan = lockstep(2, 32, 128, compact=True)
    rows = [torch.tensor(shared, dtype=torch.int32)] * 2
    rows[1] = rows[1].clone()
    rows[1][5] = rows[1][3]  # a duplicate in row 1
    rpi = torch.tensor([1, 2], dtype=torch.int64)
    nr = torch.tensor([2], dtype=torch.int32)
    for step in range(3):
        topk = torch.stack(rows)
        res = plan(topk, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0))
        w.load_and_check(0, topk, rpi, 2, res, compact=True)
        own = [set(w.state.out_cache_loc_sparse[r, :128].tolist()) for r in (1, 2)]
        assert set(res.out_indices[0].tolist()) <= own[0]
        assert set(res.out_indices[1].tolist()) <= own[1]
        # both rows miss all 32 locs once (each request loads them into its own slots), then hit
        assert res.num_misses.tolist() == ([32, 31] if step == 0 else [0, 0])
        check_invariants(w.state)
    w.release(1)  # request 2 still uses the prefix: its locs stay, its hits stay correct
    assert all(w.loc_refs[x] == 1 for x in shared)
    res = plan(
        torch.stack(rows[1:]),
        rpi[1:],
        torch.tensor([1], dtype=torch.int32),
        w.loc_to_host,
        w.loc_to_tail,
        w.state.layer(0),
    )
    assert res.num_misses.tolist() == [0]
    w.load_and_check(0, torch.stack(rows[1:]), rpi[1:], 1, res, compact=True)
    w.release(2)
    assert bool((w.state.hint == -1).all()) and not w.loc_refs
    assert w.alloc.available_size() == w.free_at_start


def _prefix_trace_loads(shared: bool, reqs: int = 4, steps: int = 10) -> int:
    """Rows loaded (the kernel's own counter, kernel == reference at every plan) by ``reqs``
    requests decoding together, each row half from a 256-token prefix and half from 64 tokens of
    its own, a quarter of each half replaced per step. ``shared``: one radix prefix (the same
    locs in every request's row); else each request has a copy of its own. The positions drawn are
    the same either way."""
    K, S, prefix, own = 32, 64, 256, 64
    w = World(random.Random(0), num_layers=1, max_reqs=reqs, num_logical=4096, topk=K,
              buffer_slots=S, pool_pages=reqs + 2)  # fmt: skip
    for r in range(1, reqs + 1):
        if shared and r > 1:
            assert w.add_request(r, prefix + own, prefix_of=1, prefix_len=prefix)
        else:
            assert w.add_request(r, prefix + own)
    plan = lockstep(reqs, K, S, compact=True)
    rng = random.Random(1)
    halves = {r: [rng.sample(range(prefix), K // 2), rng.sample(range(prefix, prefix + own), K // 2)]
              for r in w.reqs}  # fmt: skip
    rpi = torch.tensor(list(w.reqs), dtype=torch.int64)
    nr = torch.tensor([reqs], dtype=torch.int32)
    for _ in range(steps):
        rows = []
        for r in w.reqs:
            for half, (lo, hi) in zip(halves[r], ((0, prefix), (prefix, prefix + own))):
                for i in rng.sample(range(K // 2), K // 8):  # churn: fresh positions
                    half[i] = rng.choice([p for p in range(lo, hi) if p not in half])
            rows.append(torch.tensor([w.reqs[r][p] for p in halves[r][0] + halves[r][1]]))
        topk = torch.stack(rows).to(torch.int32)
        res = plan(topk, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0))
        w.load_and_check(0, topk, rpi, reqs, res, compact=True)
    check_invariants(w.state)
    return int(plan.ws.stats[STAT_NAMES.index("loaded")])


def test_a_shared_prefix_loads_what_disjoint_prefixes_load():
    """No reload thrash: requests decoding together over one radix prefix load within 1.1x the rows
    of the same trace over disjoint prefixes (the global per-loc hint made them reload the prefix
    rows they select at every step)."""
    shared, disjoint = _prefix_trace_loads(True), _prefix_trace_loads(False)
    assert disjoint > 4 * 32  # past the first step: churn loads and LRU evictions
    assert shared <= 1.1 * disjoint, (shared, disjoint)


def test_colliding_locs_match_the_reference():
    """Locs that all hash to the same 8 hint entries: contended entries, displaced occupants and
    loads left unnamed, kernel == reference (see test_lru_ref's hand-worked case)."""
    from test_lru_ref import colliding_locs

    w = World(random.Random(1), num_layers=1, max_reqs=1, num_logical=8192, topk=32)
    locs = colliding_locs(12, w.state.hint_buckets)
    w.free_locs = [x for x in w.free_locs if x not in set(locs.tolist())]
    assert w.add_request(1, 200)
    for x in locs.tolist():  # tokens of a cached prefix: on the host only
        w.loc_uid[x] = w.next_uid
        w.next_uid += 1
        w._back_up(x, keep_tail=False)
    plan = lockstep(1, 32, 64, compact=False)
    rpi, nr = torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    misses = []
    for step in range(4):  # rolled: other top-k entries, so other insertion orders
        row = torch.cat([locs.roll(step), torch.tensor(w.reqs[1][:20])]).to(torch.int32)[None]
        res = plan(row, rpi, nr, w.loc_to_host, w.loc_to_tail, w.state.layer(0))
        w.load_and_check(0, row, rpi, 1, res, compact=False)
        misses.append(int(res.num_misses[0]))
        check_invariants(w.state)
    assert misses[0] == 32 and 0 < misses[1] < 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_prefix_equals_reference_and_loads_like_disjoint_prefixes():
    """On a GPU every row of a launch runs at once. Eight requests decode together, each row half
    from a hot 8192-token prefix and half from 3000 tokens of its own, 32 duplicates per row, 20
    steps x 2 layers, once over one shared (radix) prefix and once over a copy per request. Every
    plan equals the reference bit for bit (state is per request: rows cannot race), every row
    reads its own slots with the right content, no flag is raised, and the shared prefix loads
    within 1.1x of the disjoint copies (the kernel's own counter)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

    dev = torch.device("cuda")
    L, R, K, S = 2, 8, 2048, 4096
    prefix, own = 8192, 3000
    W = 4
    loaded = {}
    for shared in (True, False):
        prefix_locs = prefix if shared else R * prefix
        N = prefix_locs + R * own + 64
        g = torch.Generator(device="cpu").manual_seed(0)
        host = torch.randint(0, 2**62, (N, W), generator=g).to(dev)
        l2h = torch.randperm(N, generator=g).to(dev)
        l2t = torch.full((N,), -1, dtype=torch.int64, device=dev)
        pages = (R * S) // 64 + 8
        alloc = PagedTokenToKVPoolAllocator(pages * 64, 64, torch.int64, dev, None, False)
        st = SparseCacheState(L, R + 1, S, K, alloc, dev)
        for r in range(R):
            assert st.admit(r + 1, prefix + own)
        P = (pages + 1) * 64
        kv = torch.zeros((L, P, W), dtype=torch.int64, device=dev)
        ws = PlanWorkspace(R, K, S, dev)
        for step in range(20):
            gg = torch.Generator(device="cpu").manual_seed(step)
            rows = []
            rpi_cpu = torch.randperm(R, generator=gg) + 1
            for r in (rpi_cpu - 1).tolist():
                hot = torch.randperm(prefix // 4, generator=gg)[: K // 2]  # hot prefix, all rows
                hot = hot if shared else hot + r * prefix
                mine = prefix_locs + r * own + torch.randperm(own, generator=gg)[: K // 2]
                row = torch.cat([hot, mine])[torch.randperm(K, generator=gg)]
                row[torch.randperm(K, generator=gg)[:32]] = row[0].clone()
                rows.append(row)
            topk = torch.stack(rows).to(torch.int32).to(dev)
            rpi = rpi_cpu.to(dev)
            nr = torch.tensor([R], dtype=torch.int32, device=dev)
            for layer in range(L):
                shadow = _clone_state(st.layer(layer))
                ref = plan_layer_ref(topk, rpi, nr, l2h, l2t, shadow)
                res = plan_layer(topk, rpi, nr, l2h, l2t, st.layer(layer), ws, compact=True)
                assert_same(ref, res, True, R)
                for name, a, b in zip(LayerState._fields, shadow, st.layer(layer)):
                    assert torch.equal(a, b), f"state {name} differs from the reference"
                valid = torch.arange(R * K, device=dev) < res.miss_count
                src = torch.where(valid, res.miss_host, 0)
                dst = torch.where(valid, res.miss_dst.long(), P - 1)
                kv[layer].index_copy_(0, dst, host[src])
                o = res.out_indices.long()
                assert bool((o >= 0).all())
                assert torch.equal(kv[layer][o], host[l2h[topk.long()]])
                for b in range(R):  # each row reads its own request's slots
                    r = int(rpi[b])
                    owned = torch.isin(o[b], st.out_cache_loc_sparse[r, :S].long())
                    assert bool(owned.all())
            check_invariants(st)
            assert int(ws.error_flags[0]) == 0
        loaded[shared] = int(ws.stats[STAT_NAMES.index("loaded")])
    assert loaded[True] <= 1.1 * loaded[False], loaded
