"""PD decode hooks: pre-allocation, transfer destinations, the decode step and request release.

Drives the patched upstream functions themselves (``DecodePreallocQueue._pre_alloc``,
``ScheduleBatch.prepare_for_decode``, ``release_kv_cache``, ``ChunkCache``) with the real pools on
CPU, through a stand-in model runner. Co-located serving is tested on the real server
(test_real_server.py); these remain until the PD pair runs as real servers.
"""

import json
import types
from types import SimpleNamespace

import pytest
import sglang.srt.server_args as server_args_module
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.sparsity.kv_offload import runtime
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfigError
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadNSATokenToKVPool,
    KVOffloadTokenToKVPoolAllocator,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

P = 64
TOPK = 64
LAYERS = 2


def make_runner(max_total_tokens=4096, max_reqs=4, config=None):
    hf_config = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], index_topk=TOPK)
    runner = SimpleNamespace(
        server_args=SimpleNamespace(
            kv_offload_config=json.dumps(config or {"sparse_slots_per_req": 128}),
            disaggregation_mode="decode",
            chunked_prefill_size=256,
            cuda_graph_max_bs=4,
        ),
        model_config=SimpleNamespace(hf_config=hf_config, context_len=512),
        max_total_num_tokens=max_total_tokens,
        req_to_token_pool=ReqToTokenPool(max_reqs, 2048, "cpu", False),
        hisparse_coordinator=None,
        page_size=P,
        kv_cache_dtype=torch.float8_e4m3fn,
        device="cpu",
    )
    nsa_pool_kwargs = dict(
        size=max_total_tokens,
        page_size=P,
        dtype=torch.float8_e4m3fn,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        kv_cache_dim=656,
        enable_memory_saver=False,
        start_layer=None,
        end_layer=None,
        index_head_dim=128,
    )
    # The two hooks of ModelRunnerKVCacheMixin._init_pools, in upstream's order.
    runner.token_to_kv_pool = runtime.build_device_pool(runner, nsa_pool_kwargs)
    runner.token_to_kv_pool_allocator = runtime.build_allocator(runner, need_sort=True)
    return runner


def offload_global_server_args() -> SimpleNamespace:
    """The global server args fields the patched scheduler functions read, flag on."""
    return SimpleNamespace(
        enable_kv_offload=True,
        page_size=P,
        speculative_algorithm=None,
        attention_backend="nsa",
        enable_mamba_extra_buffer=lambda: False,
    )


@pytest.fixture()
def offload_server_args():
    saved = server_args_module._global_server_args
    server_args_module.set_global_server_args_for_scheduler(offload_global_server_args())
    yield
    server_args_module._global_server_args = saved


def chunk_cache(runner) -> ChunkCache:
    """The tree cache of a PD decode server (radix cache disabled)."""
    return ChunkCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            page_size=P,
        )
    )


def _batch(runner, tree_cache, reqs):
    """A decode ScheduleBatch's fields, as prepare_for_decode reads them."""
    rpi = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    seq = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        reqs=reqs,
        input_embeds=None,
        is_spec_v2=False,
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        sampling_info=SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False)),
        output_ids=torch.ones(len(reqs), dtype=torch.int64),
        model_config=SimpleNamespace(is_encoder_decoder=False),
        tree_cache=tree_cache,
        req_to_token_pool=runner.req_to_token_pool,
        req_pool_indices=rpi,
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        orig_seq_lens=seq.clone(),
        seq_lens_sum=int(seq.sum()),
        enable_overlap=False,
        hisparse_coordinator=None,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        device="cpu",
    )
    batch.maybe_evict_swa = types.MethodType(ScheduleBatch.maybe_evict_swa, batch)
    return batch


def new_req(prompt_len):
    """The ``Req`` fields PD pre-allocation and ``release_kv_cache`` use, with Req's own methods."""
    req = SimpleNamespace(
        req_pool_idx=None,
        is_chunked=0,
        origin_input_ids=list(range(prompt_len)),
        output_ids=[],
        prefix_indices=[],
        logprob_start_len=-1,
        kv_committed_len=prompt_len,
        kv_allocated_len=prompt_len,
        kv_committed_freed=False,
        kv_overallocated_freed=False,
        decode_batch_idx=0,
        mamba_pool_idx=None,
    )
    for name in ("pop_committed_kv_cache", "pop_overallocated_kv_cache", "set_extend_input_len"):
        setattr(req, name, types.MethodType(getattr(Req, name), req))
    return req


def pd_prealloc_through_decode_queue(runner, prompt_len):
    """The patched ``DecodePreallocQueue._pre_alloc`` (kv offload branch) for a new request."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    queue = SimpleNamespace(
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        scheduler=SimpleNamespace(
            enable_hisparse=False, server_args=SimpleNamespace(enable_kv_offload=True)
        ),
    )
    req = new_req(prompt_len)
    DecodePreallocQueue._pre_alloc(queue, req)
    return req


@pytest.mark.parametrize("direct", [False, True], ids=["gpu_pages", "direct_to_host"])
@pytest.mark.parametrize("ending", ["finish", "abort_mid_backup"])
def test_pd_request_life_through_the_patched_scheduler_functions(
    offload_server_args, ending, direct
):
    config = {"sparse_slots_per_req": 128, "pd_direct_to_host": direct}
    runner = make_runner(config=config)
    allocator = runner.token_to_kv_pool_allocator
    kv_offload = allocator.kv_offload
    coordinator = kv_offload.coordinator
    start = allocator.free_counts()
    tree_cache = chunk_cache(runner)
    if direct:
        reqs = [pd_prealloc_through_decode_queue(runner, n) for n in (130, 64)]
        assert allocator.physical_available_size() == start["physical"]
        kv_offload.admit_transferred(reqs)  # the patched process_decode_queue, at transfer success
    else:
        reqs = [pd_prealloc_through_decode_queue(runner, n) for n in (130, 64)]
    steps = 1 if ending == "abort_mid_backup" else 70
    for _ in range(steps):
        batch = _batch(runner, tree_cache, reqs)
        ScheduleBatch.prepare_for_decode(batch)  # patched: allocates, then calls kv offload
        for r in reqs:
            assert r.req_pool_idx in coordinator.requests
            assert coordinator.requests[r.req_pool_idx].seq_len == r.kv_committed_len
        if ending == "finish":
            coordinator.drain()
    # Complete pages went to the host; their physical rows came back to the allocator.
    n0 = reqs[0].kv_committed_len
    locs = runner.req_to_token_pool.req_to_token[reqs[0].req_pool_idx, :n0].long()
    on_host = allocator.loc_to_host[locs] >= 0
    if ending == "finish":
        assert bool(on_host[: n0 // P * P].all())
    else:
        assert coordinator.has_inflight_backups() or bool(on_host.any())
    for r in reqs:
        idx = r.req_pool_idx
        release_kv_cache(r, tree_cache, is_insert=False)  # patched: releases offload state first
        assert idx not in coordinator.requests
    coordinator.drain()
    assert allocator.free_counts() == start
    assert allocator.available_size() == runner.max_total_num_tokens  # idle leak check holds
    assert not coordinator.requests
    coordinator.sparse_cache.check_invariants()


def test_direct_to_host_destination_is_the_host_pages(offload_server_args):
    from sglang.srt.disaggregation.utils import kv_to_page_indices

    runner = make_runner(config={"sparse_slots_per_req": 128, "pd_direct_to_host": True})
    allocator = runner.token_to_kv_pool_allocator
    kv_offload = allocator.kv_offload
    host = allocator.host_pool
    # The registered KV buffers are the host pool's layers, one item a GPU-sized page.
    ptrs, lens, items = kv_offload.pd_kv_buf_infos()
    assert ptrs == [host.kv_buffer[i].data_ptr() for i in range(LAYERS)]
    assert lens == [host.size * 656] * LAYERS
    assert items == runner.token_to_kv_pool.get_contiguous_buf_infos()[2] == [P * 656] * LAYERS
    req = pd_prealloc_through_decode_queue(runner, 150)
    logical = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :150]
    slots = kv_offload.pd_kv_destination_locs(logical)
    assert torch.equal(slots.long(), allocator.loc_to_host[logical.long()])
    pages = kv_to_page_indices(slots.numpy(), P)
    assert len(pages) == 3 and bool((torch.from_numpy(slots.numpy()) % P == logical % P).all())
    # A request that skipped admission at transfer success is refused at its first decode step.
    with pytest.raises(RuntimeError, match="without admission"):
        kv_offload.prepare_decode_step(
            SimpleNamespace(reqs=[req], seq_lens_cpu=torch.tensor([151]))
        )
    kv_offload.release_request(req.req_pool_idx)
    allocator.free(logical.long())
    assert allocator.host_pool.available_size() == host.size


def test_direct_to_host_sparse_pool_must_fit_every_request():
    config = {"sparse_slots_per_req": 128, "sparse_pool_slots": 512, "pd_direct_to_host": True}
    with pytest.raises(KVOffloadConfigError, match="too small for pd_direct_to_host"):
        make_runner(config=config)


def test_pd_destination_pages_are_the_physical_pages(offload_server_args):
    from sglang.srt.disaggregation.utils import kv_to_page_indices

    runner = make_runner()
    pool = runner.token_to_kv_pool
    req = pd_prealloc_through_decode_queue(runner, 150)
    logical = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :150]
    physical = runner.token_to_kv_pool_allocator.kv_offload.pd_kv_destination_locs(logical)
    assert physical.dtype == logical.dtype
    # Same in-page offsets, whole physical pages: the page ids the prefill side writes to.
    assert torch.equal(physical % P, logical % P)
    pages = kv_to_page_indices(physical.numpy(), P)
    assert len(pages) == 3 and len(set(pages.tolist())) == 3
    # A page written at those physical ids is what attention reads through the logical locs.
    rows = torch.randint(0, 256, (150, 656), dtype=torch.uint8)
    flat = pool.device_row_view(0)
    for i, page in enumerate(pages.tolist()):
        chunk = rows[i * P : (i + 1) * P]
        flat[page * P : page * P + chunk.shape[0]] = chunk
    mapping = runner.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
    assert torch.equal(flat[mapping[logical.long()]], rows)
