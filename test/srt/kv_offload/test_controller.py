"""KVOffloadCacheController with the real upstream pools and allocators (CPU).

Prompt / decode-page backups device -> host, per-layer loads host -> sparse slots, completion,
cancellation and leak checks. The GPU-only tests at the bottom cover pinned UVA and CUDA graphs.
"""

import time

import pytest
import torch
from _pools import offload_device_pool
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.sparsity.kv_offload.controller import KVOffloadCacheController
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.sparsity.kv_offload.host_pool import KVOffloadHostPool

P = 64
LAYOUTS = {656: (torch.float8_e4m3fn, 656), 1152: (torch.bfloat16, 576)}
LENGTHS = [1, 63, 64, 65, 2047, 2048, 2049, 8191]


class Tier:
    """Real pools + controller on one device, with a small request table."""

    def __init__(self, row, physical, logical, host_tokens=None, layers=2, device="cpu"):
        dtype, _ = LAYOUTS[row]
        self.pool = offload_device_pool(physical, logical, layers, LAYOUTS[row], device)
        self.alloc = KVOffloadTokenToKVPoolAllocator(P, dtype, device, self.pool, need_sort=False)
        # host_tokens: a host pool of that many tokens; default: one per logical token.
        gb = None if host_tokens is None else (host_tokens * row * layers + 1) / 1e9
        self.host = KVOffloadHostPool(
            self.pool,
            host_size_gb=gb or 0.0,
            host_pool_ratio=0.0 if gb else 1.0,
            host_reserve_bytes=0,
        )
        self.cc = KVOffloadCacheController(self.alloc, self.host, debug=True)
        self.r2t = ReqToTokenPool(
            size=8, max_context_len=logical, device=device, enable_memory_saver=False
        )
        self.layers, self.row, self.device = layers, row, device
        self.mapping = self.alloc.full_to_hisparse_device_index_mapping
        self.start = self.alloc.free_counts()
        self.gen = torch.Generator().manual_seed(0)

    def rand_rows(self, n):
        return torch.randint(0, 256, (n, self.row), dtype=torch.uint8, generator=self.gen).to(
            self.device
        )

    def admit(self, req, n):
        """A prompt of ``n`` tokens arrives in GPU pages (what PD decode does), random KV bytes."""
        seq = torch.tensor([n], dtype=torch.int64)
        z = torch.zeros(1, dtype=torch.int64)
        locs = self.alloc.alloc_extend(
            z.to(self.device),
            z,
            seq.to(self.device),
            seq,
            torch.full((1,), -1, device=self.device),
            n,
        )
        assert locs is not None
        self.r2t.req_to_token[req, :n] = locs.to(torch.int32)
        kv = [self.rand_rows(n) for _ in range(self.layers)]
        phys = self.mapping[locs]
        for l in range(self.layers):
            self.pool.device_row_view(l)[phys] = kv[l]
        return locs, kv

    def backup(self, req, start, end, tag=None):
        """Back up the complete pages of positions ``[start, end)`` of ``req`` (``start`` page
        aligned, the end rounded down as the coordinator does); None without a complete page or
        when the host pool is full."""
        end = end // P * P
        if end <= start:
            return None
        locs = self.r2t.req_to_token[req, start:end].to(torch.int64)
        handles = self.cc.backup_batch([(tag, locs, start, end)])
        return handles[0] if handles else None

    def decode_one(self, req, seq_len_before, kv):
        """One decode token: logical loc + physical tail row, then its KV is written."""
        seq = torch.tensor([seq_len_before + 1])
        last = self.r2t.req_to_token[req, seq_len_before - 1 : seq_len_before].long()
        new = self.alloc.alloc_decode(seq.to(self.device), seq, last)
        assert new is not None
        self.r2t.req_to_token[req, seq_len_before] = new.to(torch.int32)
        for l in range(self.layers):
            row = self.rand_rows(1)
            self.pool.device_row_view(l)[self.mapping[new]] = row
            kv[l] = torch.cat([kv[l], row])
        return new

    def host_bytes(self, l, locs):
        return self.host.host_row_view(l)[self.alloc.loc_to_host[locs].cpu()].to(self.device)

    def release(self, req, n, tag):
        """Finish / abort / retract, as the coordinator and release_kv_cache do it."""
        self.cc.cancel_tag(tag)
        self.alloc.free(self.r2t.req_to_token[req, :n].long())


class _Gate:
    """Holds a backup 'in flight' on CPU, where real events complete at once."""

    def __init__(self, event):
        self.event, self.open = event, False

    def query(self):
        return self.open and self.event.query()

    def synchronize(self):
        assert self.open, "drain() would block on an unfinished copy"
        self.event.synchronize()


@pytest.fixture(scope="module", params=[656, 1152])
def big_tier(request):
    # room for an 8191-token prompt + its tail + 8192 sparse slots
    return Tier(request.param, physical=8192 + 8192 + 2 * P, logical=8192 + 2 * P)


@pytest.mark.parametrize("n", LENGTHS)
def test_prompt_round_trip_bit_exact(big_tier, n):
    t = big_tier
    locs, kv = t.admit(0, n)
    h = t.backup(0, 0, n, tag="r0")
    full = n // P * P
    if full == 0:
        assert h is None and not t.cc.has_inflight()
    else:
        assert (h.start, h.end, h.num_tokens) == (0, full, full)
        assert t.cc.poll() == [h]
    # complete pages: on the host, physical rows released; the tail < 64 stays on the GPU
    assert (t.alloc.loc_to_host[locs[:full]] >= 0).all()
    assert (t.mapping[locs[:full]] == 0).all()
    assert (t.alloc.loc_to_host[locs[full:]] == -1).all()
    assert (t.mapping[locs[full:]] > 0).all()
    tail_pages = -(-(n - full) // P)
    assert t.alloc.physical_available_size() == t.start["physical"] - tail_pages * P
    assert t.host.available_size() == t.start["host"] - full
    for l in range(t.layers):
        assert torch.equal(t.host_bytes(l, locs[:full]), kv[l][:full])
        assert torch.equal(t.pool.device_row_view(l)[t.mapping[locs[full:]]], kv[l][full:])

    # load back in a shuffled order into sparse slots, through a fixed-size padded miss list
    if full:
        slots = t.alloc.hisparse_attn_allocator.alloc(-(-full // P) * P)[:full]
        perm = torch.randperm(full, generator=t.gen)
        cap = full + 37
        host_idx = torch.full((cap,), -1, dtype=torch.int64)
        dev_slots = torch.zeros(cap, dtype=torch.int32)
        live = torch.ones(cap, dtype=torch.bool)
        live[torch.randperm(cap, generator=t.gen)[:37]] = False  # -1 padding scattered inside
        host_idx[live] = t.alloc.loc_to_host[locs[perm]]
        dev_slots[live] = slots.to(torch.int32)
        num_valid = torch.tensor([cap], dtype=torch.int32)
        for l in range(t.layers):
            before = t.pool.device_row_view(l).clone()
            t.cc.load_one_layer(l, host_idx, dev_slots, num_valid)
            after = t.pool.device_row_view(l)
            assert torch.equal(after[slots], kv[l][perm])
            untouched = torch.ones(after.shape[0], dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(after[untouched], before[untouched])
        t.alloc.free_hisparse_indices(slots)
    t.release(0, n, "r0")
    assert t.alloc.free_counts() == t.start
    assert (t.alloc.loc_to_host == -1).all()


def test_load_respects_num_valid_and_skips_minus_one():
    t = Tier(656, physical=512, logical=512)
    locs, kv = t.admit(0, 128)
    t.backup(0, 0, 128, tag=0)
    t.cc.poll()
    slots = t.alloc.hisparse_attn_allocator.alloc(128)
    host_idx = t.alloc.loc_to_host[locs].clone()
    host_idx[5] = -1
    for count in (0, 40, 128):
        view = t.pool.device_row_view(1)
        view[slots] = 0
        t.cc.load_one_layer(1, host_idx, slots, torch.tensor([count], dtype=torch.int32))
        got = view[slots]
        want = torch.zeros_like(kv[1])
        want[:count] = kv[1][:count]
        if count > 5:
            want[5] = 0
        assert torch.equal(got, want), count


def test_decode_tail_pages_are_backed_up_as_they_complete():
    t = Tier(1152, physical=1024, logical=1024)
    n0 = 100
    locs, kv = t.admit(0, n0)
    h = t.backup(0, 0, n0, tag="a")
    backed = h.end
    t.cc.poll()
    seq = n0
    completed = []
    for _ in range(200):
        t.decode_one(0, seq, kv)
        seq += 1
        h = t.backup(0, backed, seq, tag="a")
        if h is not None:
            assert seq % P == 0 and h.end == seq and h.num_tokens == P
            backed = h.end
        completed += t.cc.poll()
        # physical rows: only the current tail page (the previous page is released on completion)
        assert t.alloc.physical_available_size() == t.start["physical"] - (P if seq % P else 0)
    assert [c.start for c in completed] == [64, 128, 192]  # prompt page 0 was done first
    all_locs = t.r2t.req_to_token[0, :seq].long()
    full = seq // P * P
    for l in range(t.layers):
        assert torch.equal(t.host_bytes(l, all_locs[:full]), kv[l][:full])
        assert torch.equal(t.pool.device_row_view(l)[t.mapping[all_locs[full:]]], kv[l][full:])
    t.release(0, seq, "a")
    assert t.alloc.free_counts() == t.start


def test_abort_during_inflight_backup_frees_host_once_after_copy():
    t = Tier(656, physical=1024, logical=1024)
    la, _ = t.admit(0, 192)
    lb, kvb = t.admit(1, 128)
    ha = t.backup(0, 0, 192, tag="a")
    hb = t.backup(1, 0, 128, tag="b")
    ga, gb = _Gate(ha.finish_event), _Gate(hb.finish_event)
    ha.finish_event, hb.finish_event = ga, gb
    gb.open = True
    # FIFO: b finished but a did not, so nothing completes yet
    assert t.cc.poll() == []
    assert (t.alloc.loc_to_host[lb] == -1).all() and (t.mapping[lb] > 0).all()

    assert t.cc.cancel_tag("a") == 1
    t.release(0, 192, "a")  # abort: logical + physical go now, host slots must wait for the copy
    assert t.host.available_size() == t.start["host"] - 192 - 128
    assert t.alloc.free_counts()["logical"] == t.start["logical"] - 128
    assert t.cc.poll() == []
    assert t.host.available_size() == t.start["host"] - 320

    ga.open = True
    assert t.cc.poll() == [hb]
    assert t.host.available_size() == t.start["host"] - 128
    assert not t.cc.cancel(ha) and not t.cc.cancel(hb)  # already completed: no-op
    assert t.cc.poll() == []  # nothing freed twice
    assert torch.equal(t.host_bytes(0, lb), kvb[0])
    t.release(1, 128, "b")
    assert t.alloc.free_counts() == t.start


def test_many_requests_lifecycle_no_leak():
    t = Tier(656, physical=8192, logical=8192)
    g = torch.Generator().manual_seed(1)
    live = {}
    for i in range(16):
        req = i % 8
        if req in live:
            n, tag, kind = live.pop(req)
            if kind == "abort":
                t.cc.cancel_tag(tag)  # may be in flight (not yet polled)
            t.release(req, n, tag)
        n = int(torch.randint(1, 300, (1,), generator=g))
        locs, kv = t.admit(req, n)
        tag = f"r{i}"
        h = t.backup(req, 0, n, tag=tag)
        backed = h.end if h else 0
        for _ in range(int(torch.randint(0, 70, (1,), generator=g))):
            t.decode_one(req, n, kv)
            n += 1
            h = t.backup(req, backed, n, tag=tag)
            backed = h.end if h else backed
        if i % 3:
            t.cc.poll()
        live[req] = (n, tag, "abort" if i % 4 == 0 else "finish")
    for req, (n, tag, _) in live.items():
        t.cc.cancel_tag(tag)
        t.release(req, n, tag)
    t.cc.drain()
    assert t.alloc.free_counts() == t.start
    assert (t.alloc.loc_to_host == -1).all() and (t.mapping[:-1] == 0).all()


def test_host_full_defers_without_side_effects():
    t = Tier(656, physical=1024, logical=1024, host_tokens=128)
    locs, _ = t.admit(0, 192)
    before = t.alloc.free_counts()
    assert t.backup(0, 0, 192, tag="x") is None
    assert t.alloc.free_counts() == before and not t.cc.has_inflight()
    assert t.backup(0, 0, 128, tag="x") is not None
    t.cc.drain()
    t.release(0, 192, "x")
    assert t.alloc.free_counts() == t.start


def test_alignment_violations_raise_clearly():
    t = Tier(656, physical=1024, logical=1024)
    locs, _ = t.admit(0, 200)
    with pytest.raises(ValueError, match="65 tokens .* not a whole number of pages of 64"):
        t.cc.backup_batch([(None, locs[:65], -1, -1)])
    with pytest.raises(ValueError, match="not whole pages"):
        t.cc.backup_batch([(None, locs[1:65], -1, -1)])
    t.cc.backup_batch([(None, locs[:64], -1, -1)])
    t.cc.poll()
    with pytest.raises(ValueError, match="no physical KV row"):
        t.cc.backup_batch([(None, locs[:64], -1, -1)])  # already backed up and released
    assert t.host.available_size() == t.start["host"] - 64  # failed calls allocated nothing


def test_row_size_mismatch_is_rejected():
    t = Tier(656, physical=256, logical=256)
    other = Tier(1152, physical=256, logical=256)
    with pytest.raises(ValueError, match="device KV rows are 656 B but host rows 1152 B"):
        KVOffloadCacheController(t.alloc, other.host)


# --------------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("row", [656, 1152])
def test_gpu_backup_poll_and_graph_replay_of_load_one_layer(row):
    from sglang.srt.mem_cache.sparsity.kv_offload.transfer import BACKUP_PROGRAMS

    t = Tier(row, physical=16384, logical=16384, device="cuda")
    assert t.host.pin_memory
    # Backups run beside the decode forward on a small fixed grid (default_backup_launch_config).
    assert t.cc.backup_config.num_programs == BACKUP_PROGRAMS
    n = 4096
    locs, kv = t.admit(0, n)
    h = t.backup(0, 0, n, tag="g")
    deadline = time.time() + 30
    done = []
    while not done:  # poll never blocks
        done = t.cc.poll()
        assert time.time() < deadline
    assert done == [h]
    for l in range(t.layers):
        assert torch.equal(t.host_bytes(l, locs), kv[l])

    cap = 1024
    slots = t.alloc.hisparse_attn_allocator.alloc(cap)
    host_idx = torch.full((cap,), -1, dtype=torch.int64, device="cuda")
    dev_slots = slots.clone()
    num_valid = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside capture
            for l in range(t.layers):
                t.cc.load_one_layer(l, host_idx, dev_slots, num_valid)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for l in range(t.layers):
            t.cc.load_one_layer(l, host_idx, dev_slots, num_valid)
    for trial, count in enumerate([cap, 17, 0, 600]):
        pick = torch.randperm(n, device="cuda")[:cap]
        host_idx.copy_(t.alloc.loc_to_host[locs[pick]])
        host_idx[::7] = -1
        num_valid.fill_(count)
        for l in range(t.layers):
            t.pool.device_row_view(l)[slots] = 0
        graph.replay()
        torch.cuda.synchronize()
        for l in range(t.layers):
            got = t.pool.device_row_view(l)[slots]
            want = kv[l][pick].clone()
            want[count:] = 0
            want[::7] = 0
            assert torch.equal(got, want), (trial, l)


def test_poll_orders_only_when_a_backup_completes():
    """``poll(before_complete=)`` runs the caller's ordering (the coordinator's wait for the
    in-flight forward) before it changes any state, and only when something completes."""
    t = Tier(656, physical=1024, logical=1024)
    la, _ = t.admit(0, 128)
    h = t.backup(0, 0, 128, tag="a")
    gate = _Gate(h.finish_event)
    h.finish_event = gate
    seen = []

    def before():  # state still untouched when it runs
        seen.append((t.alloc.loc_to_host[la] == -1).all().item())

    assert t.cc.poll(before_complete=before) == [] and seen == []
    gate.open = True
    assert t.cc.poll(before_complete=before) == [h] and seen == [True]
    assert t.cc.poll(before_complete=before) == [] and seen == [True]
    t.release(0, 128, "a")
    assert t.alloc.free_counts() == t.start
