"""PD decode admission control and retraction with kv offload, through the patched upstream code.

* ``DecodePreallocQueue._allocatable_tokens`` counts what offloaded requests really hold on the
  device (index keys; KV on the host), not ``min(logical, physical)`` free rows.
* ``pd_can_admit`` (in ``pop_preallocated`` and ``resume_retracted_reqs``) admits a request only when
  its prompt staging and its promised sparse slots + tail pages fit beside the rows promised to the
  requests already pre-allocated or running; the queue waits otherwise.
* Retraction: upstream ``ScheduleBatch.release_req`` saves the request with
  ``Req.offload_kv_cache`` (our allocator's ``get_cpu_copy``: KV rows from the GPU tail or the host,
  and the index keys), frees it, and ``resume_retracted_reqs`` restores it with ``load_kv_cache``
  into GPU rows (in both PD modes); its first decode step admits it again. Bytes are checked at
  every stage, and every allocator's free count returns to its start.
* A request alone with a physical pool full of its own prompt takes its slots from its own rows.
"""

import types
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.common import release_kv_cache
from test_coordinator import DEVICES, Harness, _seeded_draw
from test_runtime_hooks import offload_server_args  # noqa: F401  (fixture)
from test_runtime_hooks import LAYERS, P, _batch, chunk_cache, make_runner, new_req

ROW = 656
INDEX_ROW = 132
CONFIG = {"sparse_slots_per_req": 128}


def decode_queue(runner, retracted=()):
    """A ``DecodePreallocQueue`` with the fields its patched methods read, and those methods."""
    queue = SimpleNamespace(
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        scheduler=SimpleNamespace(
            enable_hisparse=False,
            server_args=SimpleNamespace(enable_kv_offload=True),
            running_batch=SimpleNamespace(reqs=[]),
            waiting_queue=[],
            last_batch=None,
        ),
        num_reserved_decode_tokens=8,
        retracted_queue=list(retracted),
        transfer_queue=SimpleNamespace(queue=[]),
    )
    for name in ("_allocatable_tokens", "_pre_alloc", "resume_retracted_reqs"):
        setattr(queue, name, types.MethodType(getattr(DecodePreallocQueue, name), queue))
    return queue


class _PDReq(SimpleNamespace):
    seqlen = Req.seqlen  # upstream's property


def pd_req(prompt_len, output_len=0):
    req = _PDReq(**vars(new_req(prompt_len)))
    req.output_ids = list(range(output_len))
    req.rid = f"r{prompt_len}-{output_len}"
    req.is_retracted = output_len > 0
    req.retraction_count = 0
    req.input_embeds = None
    for name in (
        "pop_committed_kv_cache",
        "pop_overallocated_kv_cache",
        "set_extend_input_len",
        "offload_kv_cache",
        "load_kv_cache",
        "reset_for_retract",
    ):
        setattr(req, name, types.MethodType(getattr(Req, name), req))
    return req


class Truth:
    """The bytes each position of a request must hold: KV rows and index-key rows per layer."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = [torch.empty((0, ROW), dtype=torch.uint8) for _ in range(LAYERS)]
        self.index = [torch.empty((0, INDEX_ROW), dtype=torch.uint8) for _ in range(LAYERS)]

    def append(self, n):
        for layer in range(LAYERS):
            new_kv = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=self.gen)
            new_ix = torch.randint(0, 256, (n, INDEX_ROW), dtype=torch.uint8, generator=self.gen)
            self.kv[layer] = torch.cat([self.kv[layer], new_kv])
            self.index[layer] = torch.cat([self.index[layer], new_ix])


def write_positions(runner, req, truth, start, end, to_host):
    """What a PD transfer / a forward writes: KV rows (GPU row or host slot) and index keys."""
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import set_index_rows

    allocator, pool = runner.token_to_kv_pool_allocator, runner.token_to_kv_pool
    locs = runner.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].long()
    for layer in range(LAYERS):
        if to_host:
            host = allocator.loc_to_host[locs]
            assert bool((host >= 0).all())
            allocator.host_pool.host_row_view(layer)[host] = truth.kv[layer][start:end]
        else:
            phys = allocator.full_to_hisparse_device_index_mapping[locs]
            assert bool((phys > 0).all())
            pool.device_row_view(layer)[phys] = truth.kv[layer][start:end]
        set_index_rows(
            pool.index_k_with_scale_buffer[layer], locs, truth.index[layer][start:end], pool
        )


def assert_holds(runner, req, truth, n):
    """Positions [0, n) of ``req`` read back (GPU row, else host slot) equal the truth."""
    saved = runner.token_to_kv_pool_allocator.get_cpu_copy(
        runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n]
    )
    for layer in range(LAYERS):
        assert torch.equal(saved[layer][0], truth.kv[layer][:n]), f"KV layer {layer}"
        assert torch.equal(saved[layer][1], truth.index[layer][:n]), f"index layer {layer}"


@pytest.mark.parametrize("direct", [False, True], ids=["gpu_pages", "direct_to_host"])
def test_retract_and_resume_through_upstream(offload_server_args, direct):  # noqa: F811
    runner = make_runner(config={**CONFIG, "pd_direct_to_host": direct})
    allocator = runner.token_to_kv_pool_allocator
    coordinator = allocator.kv_offload.coordinator
    start = allocator.free_counts()
    tree_cache = chunk_cache(runner)
    queue = decode_queue(runner)
    prompt = 150
    req = pd_req(prompt)
    queue._pre_alloc(req)  # patched: pd_prealloc, with its promise of rows
    assert req.req_pool_idx in coordinator.reservations
    truth = Truth()
    truth.append(prompt)
    write_positions(runner, req, truth, 0, prompt, to_host=direct)
    req.output_ids = [7]  # the first token arrives with the transfer
    allocator.kv_offload.admit_transferred(
        [req]
    )  # direct: admitted from the host now; else at the first step
    for step in range(80):
        batch = _batch(runner, tree_cache, [req])
        ScheduleBatch.prepare_for_decode(batch)  # allocates the token's loc, admits, backs up
        n = req.kv_committed_len
        truth.append(1)
        write_positions(runner, req, truth, n - 1, n, to_host=False)  # the forward writes it
        req.output_ids.append(step)
        coordinator.drain()
    n = req.kv_committed_len
    locs = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
    assert bool((allocator.loc_to_host[locs[: n // P * P - P]] >= 0).all()), "pages on the host"
    assert_holds(runner, req, truth, n)

    # Retract: upstream's release_req (decode mode) saves the KV, then frees everything.
    retract_batch = SimpleNamespace(
        reqs=[req],
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache,
    )
    ScheduleBatch.release_req(retract_batch, 0, 0, SimpleNamespace(disaggregation_mode="decode"))
    coordinator.drain()
    assert req.is_retracted and not coordinator.requests and not coordinator.reservations
    assert allocator.free_counts() == start
    saved = req.kv_cache_cpu
    for layer in range(LAYERS):
        assert torch.equal(saved[layer][0], truth.kv[layer][:n])
        assert torch.equal(saved[layer][1], truth.index[layer][:n])

    # Resume: the patched resume_retracted_reqs restores it into GPU rows, in both modes.
    queue.retracted_queue = [req]
    assert queue.resume_retracted_reqs() == [req] and not queue.retracted_queue
    assert req.kv_committed_len == n
    assert_holds(runner, req, truth, n)
    locs = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
    assert bool((allocator.full_to_hisparse_device_index_mapping[locs] > 0).all())
    for _ in range(3):
        batch = _batch(runner, tree_cache, [req])
        ScheduleBatch.prepare_for_decode(batch)  # first step admits the restored request again
        n = req.kv_committed_len
        truth.append(1)
        write_positions(runner, req, truth, n - 1, n, to_host=False)
        coordinator.drain()
    assert req.req_pool_idx in coordinator.requests
    locs = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
    assert bool((allocator.loc_to_host[locs[: (n - 1) // P * P]] >= 0).all())
    assert_holds(runner, req, truth, n)
    release_kv_cache(req, tree_cache, is_insert=False)
    coordinator.drain()
    assert allocator.free_counts() == start and not coordinator.reservations


def test_allocatable_tokens_count_index_and_host_not_gpu_rows(offload_server_args):  # noqa: F811
    runner = make_runner(config=CONFIG)
    allocator = runner.token_to_kv_pool_allocator
    queue = decode_queue(runner)
    tokens = queue._allocatable_tokens(count_retracted=False)
    logical, host = allocator.logical_available_size(), allocator.host_pool.available_size()
    assert tokens == allocator.available_size() == min(logical, host)
    # An offloaded token costs no GPU KV row: the budget is far above the physical rows.
    assert tokens > allocator.physical_available_size()


def _saved_copy(fill_len):
    """A saved KV copy (the format get_cpu_copy returns) of ``fill_len`` positions."""
    return [
        (
            torch.zeros((fill_len, ROW), dtype=torch.uint8),
            torch.zeros((fill_len, INDEX_ROW), dtype=torch.uint8),
        )
        for _ in range(LAYERS)
    ]


@pytest.mark.parametrize("direct", [False, True], ids=["gpu_pages", "direct_to_host"])
def test_queue_waits_for_rows_promised_to_others(offload_server_args, direct):  # noqa: F811
    # 4 requests x (128 slots + 2 tail pages) + one 512-token prompt = 1536 physical rows.
    runner = make_runner(config={**CONFIG, "pd_direct_to_host": direct})
    allocator = runner.token_to_kv_pool_allocator
    coordinator = allocator.kv_offload.coordinator
    start = allocator.free_counts()
    assert allocator.physical_size == 1536
    tree_cache = chunk_cache(runner)
    queue = decode_queue(runner)
    fresh = [pd_req(200) for _ in range(2)]
    for req in fresh:
        assert allocator.kv_offload.pd_can_admit(req)
        queue._pre_alloc(req)
    staged = 0 if direct else 2 * 256
    assert allocator.physical_available_size() == 1536 - staged
    assert coordinator.unreserved_physical_rows() == 1536 - staged - 2 * 256
    # Two retracted requests of 200 + 56 positions each want 256 staging rows + 256 promised rows.
    retracted = [pd_req(200, output_len=57) for _ in range(2)]
    for req in retracted:
        req.kv_cache_cpu = _saved_copy(256)
    queue.retracted_queue = list(retracted)
    resumed = queue.resume_retracted_reqs()
    expect = 2 if direct else 1  # gpu pages: the fresh prompts' staging leaves room for one
    assert resumed == retracted[:expect] and queue.retracted_queue == retracted[expect:]
    assert coordinator.unreserved_physical_rows() >= 0
    if not direct:
        assert not allocator.kv_offload.pd_can_admit(retracted[1])
        # A fresh request finishes: its staging and promise come back, the other one resumes.
        release_kv_cache(fresh[0], tree_cache, is_insert=False)
        assert queue.resume_retracted_reqs() == retracted[1:]
    for req in fresh[(0 if direct else 1) :] + retracted:
        release_kv_cache(req, tree_cache, is_insert=False)
    coordinator.drain()
    assert allocator.free_counts() == start and not coordinator.reservations


@pytest.mark.parametrize("device", DEVICES)
def test_request_alone_with_its_prompt_filling_the_pool_takes_slots_from_it(device):
    # 5 physical pages; a 250-token prompt stages in 4, leaving 64 rows for its 128 slots.
    h = Harness(physical_pages=5, buffer_slots=128, max_reqs=2, device=device)
    assert h.admit(250)
    (r,) = h.kv
    assert h.coord.requests[r].has_slots, "slots taken from its own backed-up pages"
    assert h.coord.stats["forced_backups"] == 1
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
    from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import index_rows, set_index_rows

    h = Harness(physical_pages=12, buffer_slots=64, max_reqs=3, device=device)
    assert h.admit(150)
    (r,) = h.kv
    pool, alloc = h.pool, h.alloc
    n0 = 150
    locs = h.r2t.req_to_token[r, :n0].long()
    index = [
        torch.randint(0, 256, (n0, INDEX_ROW), dtype=torch.uint8).to(device) for _ in range(LAYERS)
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
