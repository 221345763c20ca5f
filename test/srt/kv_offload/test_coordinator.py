"""KVOffloadCoordinator end to end on CPU with the real pools, allocator, host pool and controller.

Random interleavings of admit / decode step / finish / abort / retract under sparse-pool pressure:
every step each layer's top-k resolves to physical rows whose bytes equal the request's KV, and at
the end every allocator's free count is back where it started.
"""

import pytest
import torch
from _pools import offload_device_pool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_ref import check_invariants, lookup_slots
from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
from sglang.srt.mem_cache.sparsity.kv_offload.coordinator import KVOffloadCoordinator
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadTokenToKVPoolAllocator,
    index_row_bytes,
    index_rows,
    set_index_rows,
)
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import STAT_NAMES
from sglang.srt.mem_cache.sparsity.kv_offload.runtime import KVOffloadRuntime
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

P = 64
LAYERS = 2
# CPU always; CUDA where present (marked gpu, run on the GPU machine).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
TOPK = 16
ROW = 656


class Harness:
    """A tiny decode server: real pools, coordinator, and the KV truth of every request."""

    def __init__(
        self,
        physical_pages=12,
        logical_pages=40,
        buffer_slots=64,
        max_reqs=6,
        device="cpu",
        debug=True,
        verify_tokens=1,
        tail_pages=2,
        share_prefixes=False,
    ):
        self.device = device
        self.pool = offload_device_pool(
            physical_pages * P, logical_pages * P, LAYERS, (torch.float8_e4m3fn, ROW), device
        )
        self.alloc = KVOffloadTokenToKVPoolAllocator(
            P, torch.float8_e4m3fn, device, self.pool, False
        )
        self.host = KVOffloadHostPool(self.pool, host_pool_ratio=1.0, host_reserve_bytes=0)
        self.controller = KVOffloadCacheController(self.alloc, self.host, debug=debug)
        self.r2t = ReqToTokenPool(max_reqs, logical_pages * P, device, False)
        self.sparse = SparseCacheState(
            num_layers=LAYERS,
            max_reqs=max_reqs + 1,  # request rows 1..max_reqs; row 0 is the padding row
            buffer_slots=buffer_slots,
            topk=TOPK,
            allocator=self.alloc.hisparse_attn_allocator,
            device=device,
        )
        self.coord = KVOffloadCoordinator(
            self.r2t.req_to_token,
            self.alloc,
            self.controller,
            self.sparse,
            max_bs=max_reqs,
            verify_tokens=verify_tokens,
            tail_pages=tail_pages,
            share_prefixes=share_prefixes,
        )
        self.alloc.attach(self.coord.admission.owed_rows, self.coord)  # as init_offload does
        self.adapter = DSAOffloadAdapter(  # the attention side
            self.r2t.req_to_token,
            self.alloc,
            self.sparse,
            self.controller,
            self.coord.workspace,
            self.coord.verify_workspace,
        )
        self.start = self.alloc.free_counts()
        self.free_reqs = list(range(1, max_reqs + 1))
        self.filler = []  # physical pages squeeze_physical took
        self.kv = {}  # req -> list per layer of (seq_len, ROW) uint8 truth
        self.gen = torch.Generator().manual_seed(1)

    def squeeze_physical(self, rows_left: int, owed: bool = False) -> None:
        """Take physical pages (pinned, so the arena never moves them) until the physical side can
        get at most ``rows_left`` more rows (beyond the rows promised, with ``owed``): a physical
        pool of that size from here on."""
        taken = []
        while self.alloc.fits(rows_left + P, 0, owed=owed):
            page = self.alloc.hisparse_attn_allocator.alloc(P)
            assert page is not None
            taken.append(page[:1] // P)
        if taken:
            pages = torch.cat(taken)
            self.alloc.arena.pin(pages.cpu().numpy())
            self.filler.append(pages)

    def release_filler(self) -> None:
        for pages in self.filler:
            self.alloc.arena.unpin(pages.cpu().numpy())
            self.alloc.hisparse_attn_allocator.free_page_ids(pages)
        self.filler = []

    def rand_rows(self, n):
        return torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=self.gen).to(
            self.device
        )

    def write_rows(self, locs, rows_per_layer):
        phys = self.alloc.full_to_hisparse_device_index_mapping[locs]
        assert bool((phys > 0).all())
        for layer in range(LAYERS):
            self.pool.device_row_view(layer)[phys] = rows_per_layer[layer]

    def admit(self, prompt_len) -> bool:
        if not self.free_reqs:
            return False
        seq = torch.tensor([prompt_len])
        z = torch.zeros(1, dtype=torch.int64)
        d = self.device
        locs = self.alloc.alloc_extend(
            z.to(d), z, seq.to(d), seq, torch.full((1,), -1, device=d), prompt_len
        )
        if locs is None:
            return False
        r = self.free_reqs.pop()
        self.r2t.req_to_token[r, :prompt_len] = locs.to(torch.int32)
        rows = [self.rand_rows(prompt_len) for _ in range(LAYERS)]
        self.write_rows(locs, rows)
        self.kv[r] = rows
        self.coord.admit(r, prompt_len)
        return True

    def admit_from_host(self, prompt_len):
        """PD direct to host: logical locs + host pages, the prompt written into the host pages as
        a prefill server's whole-page transfer does (junk past the prompt), then admission."""
        if not self.free_reqs:
            return None
        locs = self.alloc.alloc_extend_to_host(prompt_len)
        if locs is None:
            return None
        r = self.free_reqs.pop()
        self.r2t.req_to_token[r, :prompt_len] = locs.to(torch.int32)
        host = self.alloc.loc_to_host[locs].cpu()
        pages = torch.unique(host // P)
        whole = (pages[:, None] * P + torch.arange(P)).reshape(-1)
        rows = [self.rand_rows(prompt_len).cpu() for _ in range(LAYERS)]
        for layer in range(LAYERS):
            view = self.host.host_row_view(layer)
            view[whole] = self.rand_rows(whole.numel()).cpu()
            view[host] = rows[layer]
        self.kv[r] = [x.to(self.device) for x in rows]
        self.coord.admit_from_host(r, prompt_len)
        return r

    def seq_len(self, r):
        return self.kv[r][0].shape[0]

    def decode_token(self, r) -> bool:
        n = self.seq_len(r)
        seq = torch.tensor([n + 1])
        last = self.r2t.req_to_token[r, n - 1 : n].long()
        new = self.alloc.alloc_decode(seq.to(self.device), seq, last)
        if new is None:
            return False
        self.r2t.req_to_token[r, n] = new.to(torch.int32)
        rows = [self.rand_rows(1) for _ in range(LAYERS)]
        self.write_rows(new, rows)
        for layer in range(LAYERS):
            self.kv[r][layer] = torch.cat([self.kv[r][layer], rows[layer]])
        return True

    def step(self, reqs, draw_topk):
        """One decode step of ``reqs``; checks every layer's resolved rows against the truth."""
        reqs = [r for r in reqs if self.decode_token(r) or self.retire(r)]
        if not reqs:
            return
        lens = [self.seq_len(r) for r in reqs]
        self.coord.before_decode_step(reqs, lens, [n - 1 for n in lens])
        bs = len(reqs)
        rpi = torch.tensor(reqs, dtype=torch.int64, device=self.device)
        seq_lens = torch.tensor([self.seq_len(r) for r in reqs], device=self.device)
        # A padded CUDA-graph row: stale request index, must be left alone.
        padded = torch.cat([rpi, rpi[:1]])
        self.adapter.num_real_reqs.fill_(bs)
        for layer in range(LAYERS):
            positions = [draw_topk(self.seq_len(r)) for r in reqs] + [list(range(TOPK))]
            topk = torch.full((bs + 1, TOPK), -1, dtype=torch.int32, device=self.device)
            # The indexer's unfused top-k: token positions, -1 padded (HiSparse's decode contract).
            for b, pos in enumerate(positions[:bs]):
                topk[b, : len(pos)] = torch.tensor(pos, dtype=torch.int32)
            topk[bs] = 7  # garbage in the padded row
            before = topk.clone()
            rows = self.adapter.swap_in_selected_pages(padded, seq_lens, topk, layer)
            assert torch.equal(topk, before), "the indexer's top-k must not be rewritten"
            assert int(self.coord.workspace.error_flags[0]) == 0
            assert bool((rows[bs] == -1).all()), "padded rows resolve to nothing"
            view = self.pool.device_row_view(layer)
            for b, pos in enumerate(positions[:bs]):
                got = rows[b, : len(pos)].long()
                assert bool((got > 0).all()) and bool((rows[b, len(pos) :] == -1).all())
                expect = self.kv[reqs[b]][layer][torch.tensor(pos, dtype=torch.int64)]
                assert torch.equal(view[got], expect), f"layer {layer} req {reqs[b]} wrong rows"
        check_invariants(self.sparse)

    def retire(self, r) -> bool:
        """Release a request (finish / abort / retract all free the same way)."""
        n = self.seq_len(r)
        held = self.coord.requests[r].seq_len
        assert self.coord.release(r)
        assert not self.coord.release(r), "release is exactly once"
        self.alloc.free(self.r2t.req_to_token[r, :held].to(torch.int64))  # upstream's part
        self.r2t.req_to_token[r, :n] = 0
        del self.kv[r]
        self.free_reqs.append(r)
        return False

    def finish_all(self):
        for r in list(self.kv):
            self.retire(r)
        self.release_filler()
        self.coord.drain()
        assert self.alloc.free_counts() == self.start
        check_invariants(self.sparse)
        assert not self.coord.requests


def _topk_drawer(data):
    def draw(seq_len):
        k = min(TOPK, seq_len)
        pos = data.draw(st.lists(st.integers(0, seq_len - 1), min_size=k, max_size=k), label="topk")
        return pos  # duplicates allowed: they must resolve to the same row

    return draw


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_random_lifecycles_resolve_rows_and_leak_nothing(data):
    h = Harness()
    draw_topk = _topk_drawer(data)
    for _ in range(data.draw(st.integers(4, 10), label="steps")):
        op = data.draw(st.sampled_from(["admit", "step", "step", "finish", "abort"]), label="op")
        if op == "admit":
            h.admit(data.draw(st.integers(1, 200), label="prompt"))
        elif op in ("finish", "abort") and h.kv:
            h.retire(data.draw(st.sampled_from(sorted(h.kv)), label="victim"))
        elif h.kv:
            h.step(sorted(h.kv), draw_topk)
        h.coord.poll()
    h.finish_all()


def test_offload_state_is_a_pure_read_and_the_scheduler_iteration_completes_backups():
    """``/server_info``'s offload state completes no backup and frees nothing, however often it
    is read; the scheduler iteration completes the finished backups and frees their rows."""
    h = Harness()
    gate = KVOffloadRuntime(h.coord, h.r2t)
    assert h.admit(200)  # sparse: the backup of its 3 complete pages starts, not waited for
    state = gate.internal_state()
    assert state["backups_in_flight"] == 1 and gate.internal_state() == state
    assert not gate.on_scheduler_iteration()
    done = gate.internal_state()
    assert done["backups_in_flight"] == 0
    assert done["free"]["physical"] == state["free"]["physical"] + 3 * P
    h.finish_all()


def test_speculative_verify_loads_the_union_once_and_backs_up_committed_pages_only():
    """EAGLE-style steps: locs allocated ahead of the committed tokens, ``D`` tokens verified per
    step (their KV written into tail rows, rejected ones rewritten next step), each layer's
    ``[bs, D, K]`` top-k resolved in one plan row per request."""
    D, reserve = 3, 6
    h = Harness(physical_pages=20, buffer_slots=D * TOPK, verify_tokens=D, tail_pages=3)
    assert h.admit(150) and h.admit(70)
    reqs = sorted(h.kv)
    allocated = {r: h.seq_len(r) for r in reqs}
    gen = torch.Generator().manual_seed(5)
    loaded = 0
    for _ in range(40):
        committed = {r: h.seq_len(r) for r in reqs}
        for r in reqs:  # upstream's alloc_for_spec_decode: whole pages past committed + reserve
            a, nxt = allocated[r], -(-(committed[r] + reserve) // P) * P
            if nxt > a:
                d = h.device
                pre, seq = torch.tensor([a]), torch.tensor([nxt])
                last = h.r2t.req_to_token[r, a - 1 : a].long()
                new = h.alloc.alloc_extend(pre.to(d), pre, seq.to(d), seq, last, nxt - a)
                assert new is not None
                h.r2t.req_to_token[r, a:nxt] = new.to(torch.int32)
                allocated[r] = nxt
        failed = h.coord.before_decode_step(
            reqs, [allocated[r] for r in reqs], [committed[r] for r in reqs]
        )
        assert not failed
        # Verify writes the KV of the bonus token and the D - 1 drafts.
        drafts = {}
        for r in reqs:
            c = committed[r]
            drafts[r] = [h.rand_rows(D) for _ in range(LAYERS)]
            h.write_rows(h.r2t.req_to_token[r, c : c + D].long(), drafts[r])
        rpi = torch.tensor(reqs, dtype=torch.int64)
        h.adapter.num_real_reqs.fill_(len(reqs))
        for layer in range(LAYERS):
            topk = torch.full((len(reqs), D, TOPK), -1, dtype=torch.int32)
            truth = {}
            for b, r in enumerate(reqs):
                c = committed[r]
                rows = torch.cat([h.kv[r][layer], drafts[r][layer]])
                shared = torch.randint(0, c, (TOPK // 2,), generator=gen)
                for j in range(D):  # draft token j sees c + j + 1 tokens; half its top-k shared
                    own = torch.randint(0, c + j + 1, (TOPK - TOPK // 2,), generator=gen)
                    topk[b, j] = torch.cat([shared, own]).to(torch.int32)
                truth[r] = rows
            # The union of the request's D rows, minus what is resident: each loaded once.
            state = h.sparse.layer(layer)
            expect = 0
            for b, r in enumerate(reqs):
                locs = h.r2t.req_to_token[r][topk[b].flatten().long()].long().unique()
                resident = (lookup_slots(state, r, locs) >= 0) | (
                    h.alloc.full_to_hisparse_device_index_mapping[locs] > 0
                )
                expect += int((~resident).sum())
            out = h.adapter.swap_in_selected_pages(rpi, None, topk, layer)
            assert out.shape == topk.shape
            assert int(h.coord.verify_workspace.error_flags[0]) == 0
            assert int(h.coord.verify_workspace.miss_count[0]) == expect
            loaded += expect
            view = h.pool.device_row_view(layer)
            for b, r in enumerate(reqs):
                got = out[b].flatten().long()
                assert torch.equal(view[got], truth[r][topk[b].flatten().long()])
        # Accept a random number of drafts: the bonus token and the accepted drafts commit.
        for r in reqs:
            accepted = int(torch.randint(0, D, (1,), generator=gen))
            for layer in range(LAYERS):
                h.kv[r][layer] = torch.cat([h.kv[r][layer], drafts[r][layer][: accepted + 1]])
        check_invariants(h.sparse)
    assert h.coord.stats["admitted"] == 2 and loaded > 0
    assert int(h.coord.workspace.stats[STAT_NAMES.index("loaded")]) == loaded
    h.coord.drain()
    for r in reqs:  # backups cover committed whole pages only, never positions allocated ahead
        locs = h.r2t.req_to_token[r, : allocated[r]].long()
        on_host = (h.alloc.loc_to_host[locs] >= 0).tolist()
        done = h.seq_len(r) // P * P
        assert all(on_host[:done]) and not any(on_host[done:])
        h.kv[r] = [torch.zeros((allocated[r], ROW), dtype=torch.uint8)] * LAYERS  # free them all
    h.finish_all()


def test_long_request_pages_move_to_host_and_come_back():
    h = Harness(physical_pages=16)
    assert h.admit(190)
    r = next(iter(h.kv))
    gen = torch.Generator().manual_seed(3)

    def draw(seq_len):
        return torch.randint(0, seq_len, (min(TOPK, seq_len),), generator=gen).tolist()

    for _ in range(80):
        h.step([r], draw)
        h.coord.drain()
    # Everything but the tail page is on the host; the tail and the sparse slots are on the GPU.
    n = h.seq_len(r)
    locs = h.r2t.req_to_token[r, :n].long()
    on_host = h.alloc.loc_to_host[locs] >= 0
    done = (n - 1) // P * P
    assert bool(on_host[:done].all()) and not bool(on_host[done:].any())
    # The last token counts as not yet written (the forward writes it): its page waits a step.
    assert h.coord.stats["backup_tokens"] == (n - 1) // P * P
    h.finish_all()


def test_admission_without_slots_keeps_request_on_gpu():
    # 4 physical pages: the first request's prompt and slots take them all.
    h = Harness(physical_pages=4, buffer_slots=64)
    assert h.admit(64)
    assert h.admit(64)
    reqs = sorted(h.kv)
    held = [h.coord.requests[r].has_slots for r in reqs]
    gen = torch.Generator().manual_seed(5)

    def draw(seq_len):
        return torch.randint(0, seq_len, (min(TOPK, seq_len),), generator=gen).tolist()

    h.step(reqs, draw)  # decodes and resolves rows whether or not a request got slots
    assert any(held)
    h.finish_all()


def _seeded_draw(seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(seq_len):
        return torch.randint(0, seq_len, (min(TOPK, seq_len),), generator=gen).tolist()

    return draw


@pytest.mark.parametrize("device", DEVICES)
def test_admit_from_host_then_decode_across_page_boundaries(device):
    """Prompts already in host pages: no physical row until admission, no backup of the prompt,
    the partial last page becomes the GPU tail, and once decode completes that page its host copy
    holds all 64 rows (prompt rows from the host, decode rows from the GPU)."""
    h = Harness(physical_pages=24, logical_pages=40, buffer_slots=64, device=device)
    lengths = (1, 63, 64, 65, 130)
    physical = h.alloc.physical_available_size()
    host = h.host.available_size()
    reqs = []
    for n in lengths:
        free_rows = h.alloc.physical_available_size()
        locs = h.alloc.alloc_extend_to_host(n)
        # Pre-allocation takes logical locs and whole host pages, no physical row.
        assert h.alloc.physical_available_size() == free_rows
        assert bool((h.alloc.full_to_hisparse_device_index_mapping[locs] == 0).all())
        h.alloc.free(locs)  # (undo: the harness allocates again below)
        reqs.append(h.admit_from_host(n))
    assert h.coord.stats["backup_tokens"] == 0 and h.coord.stats["admitted_from_host"] == 5
    held = sum(h.sparse.slots_for(n) + (P if n % P else 0) for n in lengths)
    assert physical - h.alloc.physical_available_size() == held
    for r, n in zip(reqs, lengths):
        locs = h.r2t.req_to_token[r, :n].long()
        full = n // P * P
        assert bool((h.alloc.loc_to_host[locs[:full]] >= 0).all())
        assert bool((h.alloc.full_to_hisparse_device_index_mapping[locs[:full]] == 0).all())
        assert bool((h.alloc.loc_to_host[locs[full:]] == -1).all())
        view = h.pool.device_row_view(0)
        rows = h.alloc.full_to_hisparse_device_index_mapping[locs[full:]]
        assert torch.equal(view[rows], h.kv[r][0][full:]), "partial page not loaded to the GPU"
    h.coord.drain()  # the partial pages' host pages come back once their load has read them
    assert host - h.host.available_size() == sum(n // P * P for n in lengths)
    draw = _seeded_draw(7)
    for _ in range(70):
        h.step(reqs, draw)  # every layer's rows equal the request's KV (hits, misses, tails)
        h.coord.drain()
    for r in reqs:
        n = h.seq_len(r)
        full = (n - 1) // P * P
        locs = h.r2t.req_to_token[r, :full].long()
        slots = h.alloc.loc_to_host[locs]
        assert bool((slots >= 0).all())
        for layer in range(LAYERS):
            assert torch.equal(
                h.host.host_row_view(layer)[slots.cpu()], h.kv[r][layer][:full].cpu()
            )
    h.finish_all()


def test_direct_to_host_failed_transfer_frees_host_pages_and_locs():
    h = Harness()
    locs = h.alloc.alloc_extend_to_host(130)
    taken = dict(h.start, logical=h.start["logical"] - 3 * P, host=h.start["host"] - 3 * P)
    assert h.alloc.free_counts() == taken
    # KVPoll.Failed: release_kv_cache -> the release hook (nothing admitted) -> allocator.free.
    assert not h.coord.release(0)
    h.alloc.free(locs)
    assert h.alloc.free_counts() == h.start


def _prealloc_to_host(h, r, n):
    locs = h.alloc.alloc_extend_to_host(n)
    h.r2t.req_to_token[r, :n] = locs.to(torch.int32)
    return locs


@pytest.mark.parametrize("rows_left, needle", [(0, "no sparse slots"), (P, "no physical page")])
def test_admit_from_host_refused_changes_nothing(rows_left, needle):
    # Two admitted 65-token prompts hold 2 pages each (64 slots + the tail page); with the rest of
    # the arena taken, a third finds no slots (0 rows left) or slots but no tail page (one page).
    h = Harness(buffer_slots=64)
    assert h.admit_from_host(65) is not None and h.admit_from_host(65) is not None
    r = h.free_reqs.pop()
    locs = _prealloc_to_host(h, r, 65)
    h.squeeze_physical(rows_left)
    before = h.alloc.free_counts()
    with pytest.raises(RuntimeError, match=needle):
        h.coord.admit_from_host(r, 65)
    assert h.alloc.free_counts() == before and r not in h.coord.requests
    check_invariants(h.sparse)
    h.alloc.free(locs)
    h.free_reqs.append(r)
    h.finish_all()


def test_admit_from_host_refuses_a_prompt_that_is_not_on_the_host():
    h = Harness()
    z = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([100])
    locs = h.alloc.alloc_extend(z, z, seq, seq, torch.full((1,), -1), 100)  # GPU rows, no host
    h.r2t.req_to_token[0, :100] = locs.to(torch.int32)
    before = h.alloc.free_counts()
    with pytest.raises(
        RuntimeError, match="100 of 100 transferred prompt positions without a host slot"
    ):
        h.coord.admit_from_host(0, 100)
    assert h.alloc.free_counts() == before and not h.coord.requests
    h.alloc.free(locs)
    assert h.alloc.free_counts() == h.start


@pytest.mark.parametrize("n_real", [3, 2])
def test_plan_on_positions_equals_plan_on_their_locs(n_real):
    """The plan kernel's positions mode (translation through req_to_token inside the kernel,
    what the adapter uses) gives the rows, miss list, counters and LRU state that translating
    first (the reference) and planning the locs gives; padded rows resolve to nothing."""
    from lru_ref import topk_positions_to_locs_ref
    from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import PlanWorkspace, plan_layer

    runs = []
    for positions_mode in (True, False):
        h = Harness(physical_pages=24, buffer_slots=64)
        for n in (130, 200, 90):
            assert h.admit(n)
        h.coord.drain()  # complete pages on the host, their tail rows freed: they can miss
        reqs = sorted(h.kv)
        gen = torch.Generator().manual_seed(5)
        pos = torch.stack(
            [torch.randperm(h.seq_len(r), generator=gen)[:TOPK].to(torch.int32) for r in reqs]
        )
        pos[0, -3:] = -1
        rpi = torch.tensor(reqs, dtype=torch.int64)
        n = torch.tensor([n_real], dtype=torch.int32)
        ws = PlanWorkspace(len(reqs), TOPK, h.sparse.max_slots, "cpu")
        layer = h.sparse.layer(0)
        tables = (h.alloc.loc_to_host, h.alloc.full_to_hisparse_device_index_mapping)
        if positions_mode:
            plan = plan_layer(pos, rpi, n, *tables, layer, ws, req_to_token=h.r2t.req_to_token)
        else:
            locs = torch.full_like(pos, 7)
            topk_positions_to_locs_ref(pos, rpi, h.r2t.req_to_token, n, locs)
            plan = plan_layer(locs, rpi, n, *tables, layer, ws)
        count = int(plan.miss_count[0])
        runs.append(
            (
                plan.out_indices.clone(),
                plan.num_misses.clone(),
                sorted(zip(plan.miss_host[:count].tolist(), plan.miss_dst[:count].tolist())),
                ws.stats.clone(),
                [t.clone() for t in layer],
            )
        )
    (out_a, nm_a, miss_a, st_a, lay_a), (out_b, nm_b, miss_b, st_b, lay_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(nm_a, nm_b) and miss_a == miss_b
    assert torch.equal(st_a, st_b) and all(torch.equal(x, y) for x, y in zip(lay_a, lay_b))
    assert bool((out_a[n_real:] == -1).all()) and int(st_a[3]) > 0  # padded rows; loads happened


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_swap_in_captured_in_cuda_graph_matches_eager():
    """Positions -> locs, plan and load_one_layer in one CUDA graph, replayed with new top-k and a
    padded row, give the same rows, state and KV bytes as eager calls from the same state."""
    h = Harness(physical_pages=24, logical_pages=64, buffer_slots=64, device="cuda")
    for n in (150, 230, 300):
        assert h.admit(n)
    reqs = sorted(h.kv)
    gen = torch.Generator().manual_seed(11)

    def draw(seq_len):
        return torch.randint(0, seq_len, (min(TOPK, seq_len),), generator=gen).tolist()

    for _ in range(3):
        h.step(reqs, draw)
        h.coord.drain()
    bs = len(reqs)
    rpi = torch.tensor(reqs + [reqs[0]], dtype=torch.int64, device="cuda")
    seq = torch.tensor([h.seq_len(r) for r in reqs] + [1], device="cuda")
    topk = torch.full((bs + 1, TOPK), -1, dtype=torch.int32, device="cuda")
    h.adapter.num_real_reqs.fill_(bs)
    state = [h.sparse.hint, h.sparse.slot_loc, h.sparse.lru] + list(h.pool.kv_buffer)

    def run():
        return [
            h.adapter.swap_in_selected_pages(rpi, seq, topk, layer).clone()
            for layer in range(LAYERS)
        ]

    def fresh_topk():
        for b, r in enumerate(reqs):
            topk[b] = torch.randint(0, h.seq_len(r), (TOPK,), generator=gen).to(torch.int32)
        topk[bs] = 3

    fresh_topk()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # The workspace output is reused by every layer (consumed before the next plan): keep copies.
        graph_out = [
            h.adapter.swap_in_selected_pages(rpi, seq, topk, layer).clone()
            for layer in range(LAYERS)
        ]
    for _ in range(4):
        fresh_topk()
        before = [t.clone() for t in state]
        eager = run()
        after_eager = [t.clone() for t in state]
        for t, b in zip(state, before):
            t.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        for e, g in zip(eager, graph_out):
            assert torch.equal(e, g)
            assert bool((g[bs] == -1).all())
        for t, a in zip(state, after_eager):
            assert torch.equal(t, a)
        assert int(h.coord.workspace.error_flags[0]) == 0
    h.finish_all()


@pytest.mark.parametrize("device", DEVICES)
def test_request_alone_with_its_prompt_filling_the_pool_takes_slots_from_it(device):
    # A 250-token prompt staged in 4 pages, and 64 rows left in the arena for its 128 slots.
    h = Harness(buffer_slots=128, max_reqs=2, device=device)
    real_admit = h.coord.admit
    h.coord.admit = lambda r, n: (h.squeeze_physical(P), real_admit(r, n))
    assert h.admit(250)
    h.coord.admit = real_admit
    (r,) = h.kv
    req = h.coord.requests[r]
    assert not req.has_slots and req.slots_from_backup, "its own prompt pages pay for its slots"
    assert h.coord.stats["slots_from_own_rows"] == 1
    # An arena relocation waits for the backup's copy but completes nothing: no row is freed and
    # no slot taken while it picks the pages it moves.
    free = h.alloc.free_counts()
    h.coord.before_relocation()
    assert h.alloc.free_counts() == free and not req.has_slots
    assert h.coord.poll() >= 1  # the backup completes and frees its rows: the slots are granted
    assert req.has_slots and not req.slots_from_backup and req.fail_reason is None
    locs = h.r2t.req_to_token[r, :192].long()
    assert bool((h.alloc.loc_to_host[locs] >= 0).all())
    draw = _seeded_draw(3)
    for _ in range(70):  # across a page boundary: the tail page is backed up and freed normally
        h.step([r], draw)
        h.coord.poll()
    h.finish_all()


@pytest.mark.parametrize("device", DEVICES)
def test_retraction_copy_round_trip(device):
    """get_cpu_copy reads GPU tail rows and host rows (pinned on CUDA) alike; load_cpu_copy puts
    them, and the index keys, into fresh GPU rows that then decode like a staged prompt."""
    h = Harness(physical_pages=12, buffer_slots=64, max_reqs=3, device=device)
    assert h.admit(150)
    (r,) = h.kv
    pool, alloc = h.pool, h.alloc
    n0 = 150
    locs = h.r2t.req_to_token[r, :n0].long()
    index = [
        torch.randint(0, 256, (n0, index_row_bytes(pool.index_head_dim)), dtype=torch.uint8).to(
            device
        )
        for _ in range(LAYERS)
    ]
    for layer in range(LAYERS):
        set_index_rows(pool.index_k_with_scale_buffer[layer], locs, index[layer], pool)
    draw = _seeded_draw(3)
    for _ in range(20):
        h.step([r], draw)
    h.coord.drain()
    n = h.seq_len(r)
    locs = h.r2t.req_to_token[r, :n].long()
    on_host = alloc.loc_to_host[locs] >= 0
    assert bool(on_host[:128].all()) and not bool(on_host[-10:].any()), "host and GPU rows mixed"
    saved = alloc.get_cpu_copy(locs)
    for layer in range(LAYERS):
        assert torch.equal(saved[layer][0], h.kv[r][layer].cpu())
        assert torch.equal(saved[layer][1][:n0], index[layer].cpu())
    truth = [h.kv[r][layer] for layer in range(LAYERS)]
    h.retire(r)
    h.coord.drain()
    assert alloc.free_counts() == h.start
    # Resume into fresh locs with physical rows (what pd_prealloc does for a resumed request).
    seq = torch.tensor([n])
    z = torch.zeros(1, dtype=torch.int64)
    new = alloc.alloc_extend(
        z.to(device), z, seq.to(device), seq, torch.full((1,), -1, device=device), n
    )
    alloc.load_cpu_copy(saved, new)
    phys = alloc.full_to_hisparse_device_index_mapping[new]
    for layer in range(LAYERS):
        assert torch.equal(pool.device_row_view(layer)[phys], truth[layer])
        got = index_rows(pool.index_k_with_scale_buffer[layer], new, pool)
        assert torch.equal(got[:n0], index[layer])
    r2 = h.free_reqs.pop()
    h.r2t.req_to_token[r2, :n] = new.to(torch.int32)
    h.kv[r2] = truth
    h.coord.admit(r2, n)
    for _ in range(5):
        h.step([r2], draw)
    h.finish_all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_scheduler_step_and_forward_side_never_sync_the_device():
    """The per-step path (backup completion poll, decode-step bookkeeping with page backups and
    slot growth, the per-layer swap-in) runs with CUDA's sync debug mode set to raise: one
    synchronizing call (``.item()``, a mask index, ``unique``, a pageable copy) fails the test."""
    # debug=False: SGLANG_KV_OFFLOAD_DEBUG's page checks sync on purpose.
    h = Harness(physical_pages=24, logical_pages=40, buffer_slots=128, device="cuda", debug=False)
    for n in (130, 200, 60):
        assert h.admit(n)
    reqs = sorted(h.kv)
    bs = len(reqs)
    rpi = torch.tensor(reqs, dtype=torch.int64, device="cuda")
    topk = torch.arange(TOPK, dtype=torch.int32, device="cuda").repeat(bs, 1)
    backed_up = h.coord.stats["backup_tokens"]
    for _ in range(140):  # every request crosses two page boundaries: backups start and complete
        for r in reqs:
            assert h.decode_token(r)
        seq_lens = [h.seq_len(r) for r in reqs]
        seq = torch.tensor(seq_lens, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            h.coord.poll()
            assert not h.coord.before_decode_step(reqs, seq_lens, [n - 1 for n in seq_lens])
            h.adapter.num_real_reqs.fill_(bs)
            for layer in range(LAYERS):
                h.adapter.swap_in_selected_pages(rpi, seq, topk, layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    h.coord.poll()
    assert h.coord.stats["backup_tokens"] > backed_up
    assert int(h.coord.workspace.error_flags[0]) == 0
    for r in reqs:
        n = h.coord.requests[r].seq_len
        h.coord.release(r)
        h.alloc.free(h.r2t.req_to_token[r, :n].to(torch.int64))
    h.coord.drain()
    assert h.alloc.free_counts() == h.start


def _prompt(n, req_pool_idx=None, max_new=None):
    """What the prefill gate and prepare_extend read of a request: its prompt, its request row
    (if any) and its most new tokens."""
    from types import SimpleNamespace

    kv = SimpleNamespace(req_pool_idx=req_pool_idx, kv_allocated_len=n)
    params = SimpleNamespace(max_new_tokens=max_new)
    return SimpleNamespace(
        kv=kv,
        full_untruncated_fill_ids=[0] * n,
        origin_input_ids=[0] * n,
        prefix_len=0,
        sampling_params=params,
    )


def _batch(reqs):
    from types import SimpleNamespace

    return SimpleNamespace(reqs=reqs)


def _stage(h: Harness, gate: KVOffloadRuntime, req) -> int:
    """A prefill batch of ``req`` (a :func:`_prompt`): a request row, its prompt's rows written,
    its promise (``prepare_extend``). Returns the request row."""
    n = len(req.full_untruncated_fill_ids)
    r = h.free_reqs.pop()  # a request row (>= 1) the scheduler's pool hands out
    h.r2t.free_slots.remove(r)
    seq, z = torch.tensor([n]), torch.zeros(1, dtype=torch.int64)
    locs = h.alloc.alloc_extend(z, z, seq, seq, torch.full((1,), -1), n)
    h.r2t.req_to_token[r, :n] = locs.to(torch.int32)
    h.kv[r] = [h.rand_rows(n) for _ in range(LAYERS)]
    h.write_rows(locs, h.kv[r])
    req.kv.req_pool_idx = r
    gate.prepare_extend(_batch([req]))
    return r


def test_prefill_gate_promises_staged_prompts_no_decode_step_admitted_yet():
    """A prompt prefilled in an earlier batch holds its request row and staged rows, and is promised
    its rows from its prefill (prepare_extend) until its first decode step admits it; the gate
    counts that promise, or a later batch takes the rows its slots need (seen on the H200:
    requests left without slots, forced backups, two prompts held back a whole wave)."""
    h = Harness(buffer_slots=64)
    gate = KVOffloadRuntime(h.coord, h.r2t)
    promise = h.coord.admission.promise_rows(128 + 80)  # sparse: 64 slots + 2 tail pages = 192 rows
    assert (
        promise == 64 + 2 * P and h.coord.admission.promise_rows(48) == P
    )  # resident: its context
    # Resident while the whole context takes no more rows than going sparse would.
    assert h.coord.admission.resident_len(promise) and not h.coord.admission.resident_len(
        promise + 1
    )
    assert h.coord.admission.promise_rows(promise + 1) == promise

    def stage(n):
        return _stage(h, gate, _prompt(n, max_new=80))

    # A sparse prompt's staged rows count toward its promise: their backup pays for its slots,
    # so while staged it holds the more of them and its first decode page, or its promise.
    assert h.coord.admission.promise_rows(128 + 80, prompt_rows=128) == promise
    assert h.coord.admission.promise_rows(128 + 80, prompt_rows=4 * P) == 5 * P
    a = stage(128)
    assert h.coord.admission.owed_rows() == promise - 128
    # Room for exactly one more staged prompt with its promise, and two pages.
    h.squeeze_physical(promise + 2 * P, owed=True)
    assert gate.can_stage_prefill(_prompt(128, max_new=80), [])
    b = stage(128)
    assert not gate.can_stage_prefill(_prompt(128, max_new=80), [])
    assert h.coord.admission.prefill_waits == 1
    assert not gate.on_scheduler_iteration()  # nothing freed: the scheduler need not retry
    # A short request that stays resident needs only its context's page, which is still there.
    assert gate.can_stage_prefill(_prompt(48, max_new=16), [])
    assert not gate.can_stage_prefill(_prompt(128, max_new=80), [])
    # Their first decode step admits them (promised, slots granted from the room their promises
    # kept, backups started). Their backups free the staged rows, which their promises keep for
    # their tail pages: no room beyond the promises opens, so nothing is retried.
    for r in (a, b):
        h.coord.admit(r, 128)
        assert not h.coord.requests[r].resident and h.coord.requests[r].has_slots
    h.coord.drain()
    assert not gate.on_scheduler_iteration()
    assert not gate.can_stage_prefill(_prompt(128, max_new=80), [])
    # An admitted request owes its promise less its slots and its tail rows: a decode token that
    # opens a page past its backed-up prompt is a tail row it holds toward its promise.
    slots = sum(int(h.sparse.num_slots_cpu[r]) for r in (a, b))
    assert h.coord.admission.owed_rows() == 2 * promise - slots
    h.coord.requests[a].seq_len += 1
    assert h.coord.admission.owed_rows() == 2 * promise - slots - P
    h.coord.requests[a].seq_len -= 1
    # A request that ends frees its rows and its promise: the scheduler retries its waiting
    # prompts once (upstream would retry only when a request finishes) and the prompt fits.
    h.retire(a)
    assert gate.on_scheduler_iteration() and not gate.on_scheduler_iteration()
    assert gate.can_stage_prefill(_prompt(128, max_new=80), [])
    h.finish_all()


def test_prefill_gate_retries_once_rows_beyond_the_refusing_round_are_freed():
    """The prompts the gate let through in a round take their rows after it refused the next one:
    the room to beat is the round's, once they hold them. Counted before they took them, their
    own admission (their backups free the staged rows down to their promises) never beats it,
    and a burst waited for a request to finish (seen in the capacity benchmark: 3 of 8 requests
    running, 90 s, where 5 fit)."""
    h = Harness(buffer_slots=64)  # sparse promise: 64 slots + 2 tail pages = 3 pages
    gate = KVOffloadRuntime(h.coord, h.r2t)
    n, max_new = 256, 80  # a staged prompt takes its 4 pages and its first decode page: 5
    first, second = _prompt(n, max_new=max_new), _prompt(n, max_new=max_new)
    h.squeeze_physical(10 * P, owed=True)  # one staged prompt fits, two (and their keys) do not
    assert gate.can_stage_prefill(first, [])
    assert not gate.can_stage_prefill(second, [first])  # the round ends here (NO_TOKEN)
    r = _stage(h, gate, first)  # after the adder: the round's batch takes its rows
    assert not gate.on_scheduler_iteration()  # nothing freed since the round
    # Its first decode step admits it; the backup of its prompt pays for its slots and frees the
    # staged rows beyond its 3-page promise: now the second prompt fits, and is retried.
    h.coord.admit(r, n)
    h.coord.drain()
    assert h.coord.requests[r].has_slots
    assert gate.on_scheduler_iteration() and not gate.on_scheduler_iteration()
    assert gate.can_stage_prefill(second, [])
    assert h.coord.admission.prefill_waits == 1
    h.finish_all()


def test_a_staged_sparse_prompt_is_promised_its_remaining_chunks_and_first_decode_page():
    """Chunk by chunk a sparse prompt holds the rows it staged so far; it is owed the rest of its
    prompt and its first decode page (or its sparse promise, if more). A direct-to-host prompt
    stages nothing on the GPU and is owed its slots and tail pages."""
    h = Harness(buffer_slots=64)  # sparse promise: 64 slots + 2 tail pages = 3 pages
    h.coord.admission.reserve(1, final_len=400, staged_len=64, prompt_len=256)
    assert h.coord.admission.owed_rows() == 256 + P - 64
    h.coord.admission.reserve(1, final_len=400, staged_len=256, prompt_len=256)
    assert h.coord.admission.owed_rows() == P
    h.coord.admission.reserve(2, final_len=400)
    assert h.coord.admission.owed_rows() == P + 3 * P
    assert not h.coord.release(1) and not h.coord.release(2)  # never admitted
    assert h.coord.admission.owed_rows() == 0
    h.finish_all()


def _uniform_drawer(seed: int):
    """Top-k positions drawn uniformly from a request's context (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(0, n, (min(TOPK, n),), generator=gen).tolist()


def test_shared_prefix_is_backed_up_once_read_back_for_prefill_and_kept_on_the_host():
    """The radix cache's path, driven by hand: request B's row starts with request A's first two
    pages (a cached prefix). B's prefill reads them back from the host (restore_for_extend), B's
    admission leaves their backup to A, both decode on them; A's release flushes its backups (the
    tree keeps host rows only), B still reads the prefix from the host; after both and the tree's
    eviction every free count is back at start."""
    h = Harness(physical_pages=20, share_prefixes=True)
    draw = _uniform_drawer(3)
    assert h.admit(200)
    (a,) = h.kv
    for _ in range(3):
        h.step([a], draw)
    h.coord.drain()
    prefix = h.r2t.req_to_token[a, :128].long()
    assert bool((h.alloc.loc_to_host[prefix] >= 0).all())  # A backed them up
    assert bool((h.alloc.full_to_hisparse_device_index_mapping[prefix] == 0).all())
    # B: the prefix, then 60 tokens of its own (prefilled: the extend allocates them)
    b = h.free_reqs.pop()
    n = 188
    pre = torch.tensor([128])
    seq = torch.tensor([n])
    d = h.device
    own = h.alloc.alloc_extend(pre.to(d), pre, seq.to(d), seq, prefix[-1:], n - 128)
    h.r2t.req_to_token[b, :128] = prefix.to(torch.int32)
    h.r2t.req_to_token[b, 128:n] = own.to(torch.int32)
    rows = [h.rand_rows(n - 128) for _ in range(LAYERS)]
    h.write_rows(own, rows)
    h.kv[b] = [torch.cat([h.kv[a][layer][:128], rows[layer]]) for layer in range(LAYERS)]
    h.coord.restore_for_extend([prefix])  # the prefill reads the prefix through the mapping
    phys = h.alloc.full_to_hisparse_device_index_mapping[prefix]
    assert bool((phys > 0).all())
    for layer in range(LAYERS):
        assert torch.equal(h.pool.device_row_view(layer)[phys], h.kv[a][layer][:128])
    h.coord.release_restored()  # next scheduler iteration
    assert bool((h.alloc.full_to_hisparse_device_index_mapping[prefix] == 0).all())
    backed = h.coord.stats["backup_tokens"]
    h.coord.admit(b, n)
    assert h.coord.stats["shared_prefix_tokens"] == 128
    for _ in range(4):
        h.step([a, b], draw)
    h.coord.drain()
    # B backed up nothing of the prefix: its own first page (128..191) is not complete before 192
    assert h.coord.stats["backup_tokens"] - backed == (h.seq_len(a) - 1) // P * P - 192
    # A ends; the tree keeps its first two pages and frees the rest
    n_a = h.seq_len(a)
    assert h.coord.release(a, kv_len=n_a)
    assert not h.coord.controller.has_inflight()
    locs_a = h.r2t.req_to_token[a, :n_a].long()
    h.alloc.free(locs_a[128:])
    del h.kv[a]
    assert bool((h.alloc.loc_to_host[prefix] >= 0).all())
    for _ in range(3):
        h.step([b], draw)
    n_b = h.seq_len(b)
    assert h.coord.release(b, kv_len=n_b)
    h.alloc.free(h.r2t.req_to_token[b, 128:n_b].long())
    del h.kv[b]
    # the tree's pages: logical locs and host slots only, no GPU row
    free = h.alloc.free_counts()
    assert free["physical"] == h.start["physical"]
    assert h.start["logical"] - free["logical"] == 128 == h.start["host"] - free["host"]
    h.alloc.free(prefix)  # evicted
    assert h.alloc.free_counts() == h.start
    check_invariants(h.sparse)
    assert bool((h.sparse.hint == -1).all())


def test_direct_to_host_admission_after_a_cached_prefix():
    """PD decode radix cache with ``pd_direct_to_host``: request B's row starts with two cached
    prefix pages, one backed up by request A (host only) and one the tree kept in GPU rows with no
    backup (the host pool was full when its request ended); the transferred rest is in host pages.
    Admission checks host slots for the transferred positions only, shares A's page, claims and
    backs up the GPU-only page, and B decodes on the right rows throughout."""
    h = Harness(physical_pages=20, share_prefixes=True)
    draw = _uniform_drawer(5)
    assert h.admit(100)
    (a,) = h.kv
    h.step([a], draw)
    h.coord.drain()
    shared = h.r2t.req_to_token[a, :P].long()
    assert bool((h.alloc.loc_to_host[shared] >= 0).all())
    # the tree's page in GPU rows, never backed up
    d = h.device
    z, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([P])
    kept = h.alloc.alloc_extend(z.to(d), z, seq.to(d), seq, torch.full((1,), -1, device=d), P)
    kept_rows = [h.rand_rows(P) for _ in range(LAYERS)]
    h.write_rows(kept, kept_rows)
    # B: the two prefix pages, then 65 transferred tokens in host pages
    b = h.free_reqs.pop()
    n, prefix = 2 * P + 65, 2 * P
    h.r2t.req_to_token[b, :P] = shared.to(torch.int32)
    h.r2t.req_to_token[b, P:prefix] = kept.to(torch.int32)
    rest = h.alloc.alloc_extend_to_host(n - prefix)
    h.r2t.req_to_token[b, prefix:n] = rest.to(torch.int32)
    host = h.alloc.loc_to_host[rest].cpu()
    rest_rows = [h.rand_rows(n - prefix) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        h.host.host_row_view(layer)[host] = rest_rows[layer].cpu()
    h.kv[b] = [
        torch.cat([h.kv[a][layer][:P], kept_rows[layer], rest_rows[layer]])
        for layer in range(LAYERS)
    ]
    backed = h.coord.stats["backup_tokens"]
    h.coord.admit_from_host(b, n, prefix)
    assert h.coord.stats["shared_prefix_tokens"] == P  # A's page; the kept page is B's to back up
    h.coord.drain()
    assert h.coord.stats["backup_tokens"] - backed == P
    assert bool((h.alloc.loc_to_host[kept] >= 0).all())
    assert bool((h.alloc.full_to_hisparse_device_index_mapping[kept] == 0).all())
    for _ in range(4):
        h.step([a, b], draw)
    # the tree keeps B's prefix pages (host rows only); everything else ends
    n_b = h.seq_len(b)
    assert h.coord.release(b, kv_len=n_b)
    h.alloc.free(h.r2t.req_to_token[b, prefix:n_b].long())
    del h.kv[b]
    h.alloc.free(kept)
    h.finish_all()
