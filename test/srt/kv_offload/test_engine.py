"""Proof by decoding on CPU: the NSA-shaped engine with kv offload equals the all-on-GPU run bit for bit.

``benchmark/kv_offload/nsa_engine.py`` decodes through the real pools (``NSATokenToKVPool`` for the
oracle; the split pool, host pool, controller, GPU LRU and coordinator for offload) and compares
every layer's attention output and every token at every prefill and decode step. These tests run its
CPU configuration (Triton kernels in the interpreter) with arrivals, finish, abort, retract, sparse
pool pressure, contexts below top-k, below and above the sparse buffer, and padded CUDA-graph rows;
after every run each allocator must be back at its start.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(
    0,
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmark", "kv_offload"),
)

import nsa_engine  # noqa: E402
from nsa_engine import EngineConfig, RequestSpec  # noqa: E402

nsa_engine.prepare_environment("cpu")


def _check_all_back_at_start(engine: nsa_engine.Engine) -> None:
    off = engine.offload
    assert off.free_counts() == off.start_free, "logical/physical/host allocators leaked"
    assert engine.oracle.free_counts() == engine.oracle.start_free
    # The sparse slots come from the physical allocator; every grant must be returned.
    assert off.sparse.allocator.available_size() == off.start_free["physical"]
    assert not any(off.sparse.num_slots_cpu)
    assert bool((off.sparse.loc_to_slot == -1).all()) and bool((off.sparse.slot_loc == -1).all())
    assert not off.coord.requests and not off.controller.has_inflight()
    off.sparse.check_invariants()
    assert engine.stats.leak_free


def _check_identical(st: nsa_engine.RunStats) -> None:
    assert st.mismatches == 0, st.first_mismatch
    # Every prefill and decode step compares one tensor per layer plus the tokens.
    layers = st.config["compute_layers"]
    assert st.compared_tensors == st.prefills * layers + st.decode_steps * (layers + 1)
    assert st.identical


def test_fp8_lifecycles_under_pressure_equal_all_on_gpu():
    # The demo's configuration: 15 physical pages (960 rows) for up to 4 requests of up to ~700
    # tokens, so prefills wait and some admissions find no sparse slots; capture sizes (1, 4, 8)
    # pad batches of 2 and 3.
    cfg = EngineConfig.cpu(kv_dtype="fp8")
    assert cfg.physical_pages == 15 and cfg.capture_sizes == (1, 4, 8)
    steps = 130
    workload = nsa_engine.make_workload(7, steps, cfg.seed, cfg)
    engine = nsa_engine.Engine(cfg)
    st = engine.run(workload, steps)

    _check_identical(st)
    _check_all_back_at_start(engine)
    assert st.decode_steps >= 100
    assert st.padded_steps > 0
    assert st.finished >= 3 and st.aborted >= 1 and st.retracted >= 1
    assert st.admitted == st.prefills > st.requests - st.aborted  # retracted ones re-prefilled
    # Pressure: the head of the queue waited for rows, and admissions that found no free slots took
    # them from their own prompt pages (the coordinator's last resort) instead of waiting.
    assert st.admission_waits > 0 and engine.offload.coord.stats["forced_backups"] > 0
    # Contexts below top-k and above the sparse buffer; the cache both hit and missed.
    assert min(s.prompt_len for s in workload) < cfg.topk
    assert st.max_context > 4 * cfg.buffer_slots
    assert st.misses > 0 and st.topk_entries - st.tail_entries - st.misses > 0
    assert st.backup_tokens > 0 and st.d2h_bytes == st.backup_tokens * 656 * cfg.memory_layers
    assert st.peak_gpu_bytes_offload < st.peak_gpu_bytes_oracle


def test_bf16_prompt_filling_the_pool_pays_for_its_slots():
    # 6 physical pages: the 150-token request finds no free slots. Before the coordinator's last
    # resort it ran without slots until the short one needed a page and the newest request was
    # retracted (twice); now it backs up its own complete pages and takes its slots from them.
    cfg = EngineConfig.cpu(kv_dtype="bf16", physical_pages=6, max_running=3)
    workload = [
        RequestSpec(0, 0, 20, 75),
        RequestSpec(1, 0, 150, 60),
        RequestSpec(2, 5, 40, 20, abort_after=12),
    ]
    engine = nsa_engine.Engine(cfg)
    st = engine.run(workload, 120)

    _check_identical(st)
    _check_all_back_at_start(engine)
    assert engine.offload.coord.stats["forced_backups"] == 1
    assert st.pressure_retracted == 0 and st.ran_without_slots == 0
    assert st.finished == 2 and st.aborted == 1
    assert st.decode_steps >= 70
    assert st.d2h_bytes == st.backup_tokens * 1152 * cfg.memory_layers


def test_pages_completed_by_the_pending_token_wait_for_its_write():
    """A page completed by the token about to be decoded must not be backed up before the forward
    writes that token (found by this engine: the stale host copy was loaded later). Both length
    contracts must equal the all-on-GPU run; the 60-token prompt completes a page at decode step 4.
    """
    for contract in ("allocated", "written"):
        cfg = EngineConfig.cpu(seq_lens_contract=contract)
        engine = nsa_engine.Engine(cfg)
        st = engine.run([RequestSpec(0, 0, 60, 40)], 40)
        assert st.mismatches == 0, (contract, st.first_mismatch)


def test_torch_index_and_kv_io_match_upstream_pool_methods():
    """The CPU fast path writes and reads the same bytes as the upstream (Triton) pool methods."""
    from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache_separate

    gen = torch.Generator().manual_seed(7)
    n = 70
    nope = (torch.randn(n, 512, generator=gen) * 3).to(torch.bfloat16)
    rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16)
    rows = nsa_engine.quantize_kv_fp8(nope, rope)
    up_nope, up_rope = quantize_k_cache_separate(nope, rope)
    # Scales and rope bytes are exact. The fp8 values are not compared: the Triton 3.8
    # interpreter's fp32 -> e4m3 cast drops the carry of a round-up (127.54 -> 64, not 128).
    assert torch.equal(rows[:, 512:528], up_nope.view(n, -1)[:, 512:])
    assert torch.equal(rows[:, 528:], up_rope.view(n, -1))
    deq = nsa_engine.dequantize_rows(rows, "fp8")
    assert torch.equal(deq[:, 512:], rope.float())
    tiles = nope.float().view(n, 4, 128).abs().amax(-1, keepdim=True)
    err = (deq[:, :512] - nope.float()).view(n, 4, 128).abs()
    assert bool((err <= tiles / 16 + 1e-6).all())  # e4m3: 3 mantissa bits, half an ulp

    k_fp8, k_scale = nsa_engine.quantize_index_k(torch.randn(n, 128, generator=gen))
    for upstream in (True, False):
        cfg = EngineConfig.cpu(kv_dtype="bf16", upstream_kernels=upstream)
        be = nsa_engine.OffloadBackend(cfg)
        assert be.alloc_prefill(0, n)
        locs = be.locs(0, 0, n)
        be.write_index(1, locs, k_fp8, k_scale)
        be.write_kv(1, locs, nope, rope)
        keys = be.index_keys(1, 0, n)
        if upstream:
            expect = (keys, be.pool.index_k_with_scale_buffer[1].clone(), be.kv_rows(1).clone())
        else:
            assert torch.equal(keys, expect[0])
            assert torch.equal(be.pool.index_k_with_scale_buffer[1], expect[1])
            assert torch.equal(be.kv_rows(1), expect[2])
        assert torch.equal(keys, k_fp8.float() * k_scale)
        phys = be.physical(locs)
        assert bool((phys > 0).all())
        assert torch.equal(be.kv_rows(1)[phys], nsa_engine.kv_bf16_bytes(nope, rope))
        be.release(0)
        assert be.free_counts() == be.start_free
