"""A stand-in model runner for ``test_mooncake_pd.py``, the one test that injects transfer faults
(a sender killed mid-transfer, a sender that sends fewer pages) below the real PD pair.

Everything else about serving is tested on the real server (``test_real_server.py``,
``test_pd_real_server.py``); this builds the real kv offload pools through the two factories of
``runtime`` on a ``SimpleNamespace`` runner with the fields they read.
"""

import json
import types
from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.sparsity.kv_offload import runtime

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
