"""Test-only torch references for the binary kernels the real DSA server calls (the one list).

The tiny real server (``scripts/tiny_server.py``, the end-to-end tests, ``make serve-tiny``) runs
upstream SGLang 0.5.23 unchanged on machines that lack ``sgl_kernel``, FlashMLA, DeepGEMM and the JIT
kernels (``sglang.kernels.jit``: tvm-ffi modules built by nvcc at first use). Each entry below
replaces one such kernel by the same maths in torch, and nothing else: every kv_offload component
and every other upstream line runs for real (upstream's Triton kernels included). The references
use fixed shapes, masks and no host synchronisation, so they are also safe inside CUDA graphs on the
GPU.

``sitecustomize.py`` beside this file calls :func:`install` in every process of the server
(tokenizer manager, scheduler, detokenizer) when ``KV_OFFLOAD_STANDINS=1``; the patches are applied
when the target module is first imported.

====  =====================================================  =========================================
#     replaces                                               stand-in
====  =====================================================  =========================================
S1    ``dsa_indexer._is_cuda`` off CUDA (CPU)                take the CUDA indexer path (paged /
                                                             ragged logits + top-k) on the CPU too
S2    ``torch.cuda.get_device_capability`` on a CPU torch    report SM90 (H200), so server_args picks
                                                             Hopper's DSA defaults as on the GPU
S3    ``dsa_indexer.rotate_activation`` (JIT Hadamard        Sylvester Hadamard matrix product (CPU
      transform of ``sglang.kernels.jit``)                   and GPU)
S4    DeepGEMM ``fp8_mqa_logits``,                           :func:`fp8_mqa_logits`,
      ``fp8_paged_mqa_logits``,                              :func:`fp8_paged_mqa_logits`, ... (the
      ``get_paged_mqa_logits_metadata``, ``get_num_sms``     ``deep_gemm`` package beside this file)
      (reached through ``dsa.utils.resolve_*``)
S5    ``sgl_kernel.fast_topk_v2``,                           :func:`fast_topk_v2` and the two fused
      ``fast_topk_transform_fused``,                         transforms: ``torch.topk`` with the same
      ``fast_topk_transform_ragged_fused``                   masking and output layout (served by the
                                                             ``sgl_kernel`` stub; the JIT top-k v2 is
                                                             off: ``SGLANG_OPT_USE_TOPK_V2=0``)
S6    ``flash_mla.flash_mla_sparse_fwd`` (the                :func:`flash_mla_sparse_fwd`, sparse MLA
      ``sgl-flash-mla`` wheel, called through                attention over the selected rows (served
      ``kernels.ops.attention.flash_mla_interface``)         by the ``flash_mla`` stub)
S7    ``--load-format dummy``'s uniform +-1e-3 weights       seeded init at a scale where the output
                                                             depends on the context, drawn in the
                                                             checkpoint layout and sharded by the
                                                             model's ``load_weights`` (same weights at
                                                             every TP size)
S9    ``dsa_indexer.can_use_dsa_fused_store`` (JIT fused     ``False``: upstream's own fallback
      index-K store)                                         (act_quant +
                                                             ``set_index_k_scale_buffer``)
S10   CPU:                                                   the same maths with 2-D inputs viewed as
      ``DeepseekScalingRotaryEmbedding.forward_native``      ``[T, 1, d]`` (also G3's maths on the
      broadcasts a 2-D key ``[T, d]`` to ``[T, T, d]`` (the  GPU)
      indexer's key is 2-D; upstream CPU bug)
S11   CPU: ``Indexer._weights_proj_bf16_in_fp32_out`` (the   ``torch.mm`` in fp32
      head-gate GEMM, ``aten::mm.dtype``, is CUDA-only)
S12   CPU: ``Indexer._get_topk_ragged`` asserts a CUDA       the same method, device index 0 when the
      device index (used for the logits memory budget)       tensor has none
S13   CPU:                                                   ``False``: a PD prefill server takes
      ``MooncakeKVSender.supports_host_tensor_indices``      upstream's synchronous page-index path
      (pinned page indices + a CUDA event per chunk)
S14   CPU: ``Indexer._get_mqa_logits_budget_bytes`` (a     a budget of the host's memory, same
      big prefill batch's logits budget) reads the CUDA      fraction
      device's total memory
S15   CPU: ``DeepseekSparseAttnBackend`` lacks               its CUDA-graph fill value (1): the same
      ``get_cpu_graph_seq_len_fill_value``, which attention  seq_len for padded rows as on the GPU
      DP's batch padding calls on the CPU (upstream CPU
      gap)
S16   CPU: ``DeepseekV2ForCausalLM.set_embed_and_head``      the same method without the sync: the
      (the MTP draft shares the target's embedding and       CPU runs every op in order, there is no
      head) ends with ``torch.cuda.synchronize()``, which    device queue to wait for
      a CPU torch cannot run (no CUDA driver)
S17   CPU: speculative decoding's CPU-engine ops of      the maths of upstream's Triton kernel of
      ``sgl_kernel`` (binary), each the CPU twin of an       the same name (without ``_cpu``), in
      upstream Triton kernel:                                torch: :func:`assign_req_to_token_pool_cpu`
      ``assign_req_to_token_pool_cpu``,                      ... (served by the ``sgl_kernel`` stub;
      ``assign_draft_cache_locs_contiguous_cpu``,            reached with ``--speculative-algorithm
      ``assign_extend_cache_locs_cpu``,                      NEXTN/EAGLE``)
      ``fill_bonus_tokens_cpu``,                             ``build_tree_kernel_efficient_cpu`` and
      ``fill_accept_out_cache_loc_cpu``,                     ``verify_tree_greedy_cpu`` call
      ``build_tree_kernel_efficient_cpu``,                   upstream's own Triton versions of
      ``verify_tree_greedy_cpu``                             ``spec_tree.py`` (its XPU path)
S18   CPU: ``kernels.ops.attention.pad.                      the same function without the two
      seqlens_expand_triton`` (the DSA backend's per-token   device asserts: upstream's Triton kernel
      kv lengths of target-verify / draft-extend) asserts    under the interpreter
      CUDA tensors
S19   CPU: ``KVCacheConfigurator.configure`` refuses an     the same method without the refusal for
      fp8 KV cache on the CPU unless the model is MHA        DSA models (other MLA models are still
      ("CPU FP8 KV cache is only supported for MHA"; its     refused): their fp8 pool is written by
      CPU fp8 path is Intel AMX attention)                   upstream's torch/Triton (C2) and read by
                                                             S20
S20   ``flash_mla.flash_mla_with_kvcache`` and               :func:`flash_mla_with_kvcache`: sparse
      ``get_mla_decoding_metadata`` (the ``sgl-flash-mla``   attention over the named 656 B fp8 rows
      wheel), the sparse decode over V3.2's fp8 KV rows      (:func:`dequantize_fp8_rows`: e4m3 x
      that DSA's ``flashmla_kv`` prefill and decode call     fp32 tile scale, rounded to bf16; then
      with ``--kv-cache-dtype fp8_e4m3``, through            the bf16 rope), the S6 maths; an empty
      ``kernels.ops.attention.flash_mla_interface``          schedule (served by the ``flash_mla``
                                                             stub)
G1    CUDA: ``sgl_kernel.rmsnorm`` / ``fused_add_rmsnorm``   upstream's own ``RMSNorm.forward_native``
      (``RMSNorm.forward_cuda``)
G2    CUDA: JIT                                              upstream's own
      ``kernels.ops.activation.activation.silu_and_mul``     ``SiluAndMul.forward_native``
      (``sgl_kernel.silu_and_mul`` for other widths)
      (``SiluAndMul.forward_cuda``)
G3    CUDA: JIT ``apply_rope_with_cos_sin_cache_inplace``    the S10 torch rope (same maths, returns
      of ``kernels.ops.attention.rope``                      new tensors as upstream's torch path
      (``RotaryEmbedding.forward_cuda``)                     does)
G4    CUDA: flashinfer's ``fused_topk_deepseek`` in          ``None``, as upstream sets it without
      ``moe.topk`` (the flashinfer stub would make it look   flashinfer: the router runs upstream's
      available)                                             Triton ``kernels.ops.moe.moe_fused_gate``
G5    CUDA: the Triton fused-MoE runner                      :func:`fused_moe_dense`: every expert on
      (``sgl_kernel.moe_sum_reduce``, JIT                    every token, combined with the top-k
      ``moe_align_block_size`` and ``silu_and_mul``)         weights (0 elsewhere) and
      (``UnquantizedFusedMoEMethod.forward_cuda``)           ``routed_scaling_factor`` (fixed shapes)
G6    CUDA: JIT ``kernels.ops.attention.clamp_position``     upstream's own
      (decode positions in ``ForwardBatch.init_new``)        ``ClampPositionOp.forward_native`` (the
                                                             op's instance pinned to it)
G7    CUDA: JIT ``concat_mla_absorb_q`` in                   ``torch.cat`` (upstream's own branch of
      ``kernels.ops.attention.utils``                        ``concat_mla_absorb_q_general``)
C1    CPU only, for speed: upstream Triton kernels that run  torch of the same maths: the index key +
      per token in the Triton interpreter (100x slower):     scale write into the paged index buffer
      ``SetKAndS.triton`` of                                 (:func:`set_index_k_and_scale`), the
      ``kernels.ops.kvcache.dsa_index_k_cache``,             indexer's block fp8 quantiser
      ``act_quant`` of                                       (:func:`act_quant`)
      ``kernels.ops.quantization.act_quant_triton``
C2    CPU only: the fp8 KV row quantiser                     :func:`quantize_k_cache_fast_separate`:
      ``_quantize_k_cache_fast_separate`` of                 the same maths in torch, whose e4m3 cast
      ``kernels.ops.quantization.dsa_quant_k_cache``         rounds to nearest even as the GPU's
      (Triton): slow in the interpreter, whose fp32 to       does (its bytes are upstream's wherever
      e4m3 cast also drops the carry of a round-up           the interpreter rounds exactly)
      (124.3 -> 64, not 128) and rounds ties away from
      zero
B1    Benchmark only, GPU with production kernels and       the real kernel runs, then the replay's
      ``KV_OFFLOAD_STANDINS_TOPK_PERIOD``: DeepGEMM's       scores (below) overwrite its logits in
      ``fp8_paged_mqa_logits`` (the decode indexer)         place: the same selections as S4's
                                                            replay, the kernel's time kept; on
                                                            CUDA the replay is one Triton kernel
                                                            (``replay_kernel.py``)
====  =====================================================  =========================================

(No S8: 0.5.23 has no ``Indexer._should_chunk_mqa_logits``. On the CPU platform the MLA KV row write
already scatters the rows in torch; with an fp8 KV cache it quantises them first (C2).)

On a CUDA machine without ``sgl_kernel`` (the lent GPU box) the server also needs ``cpu_stubs/``
(``sgl_kernel`` import placeholders with ``KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES=1``, the ``flash_mla``
stub), ``gpu_stubs/`` (``flashinfer`` import placeholders) and upstream switches that select existing
torch/Triton paths (``scripts/tiny_server.py``'s ``GPU_NO_SGL_KERNEL_ENV`` and
``GPU_STANDIN_KERNELS_ENV``, set by ``server_env``): ``SGLANG_IS_FLASHINFER_AVAILABLE=0`` (torch
sampling and norms), ``SGLANG_ENABLE_JIT_DEEPGEMM=0`` (no DeepGEMM GEMMs or warm-up: bf16 weights),
``SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0`` (no FA3 MHA prefill: sparse MLA prefill as on the
CPU), ``SGLANG_OPT_USE_TOPK_V2=0`` (S5, not the JIT top-k v2), ``SGLANG_DISABLE_DSA_INDEXER_FUSION=1``
(no JIT indexer q/k fusion) and ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1``; the top-k and fusion
switches only with ``--kernels standins`` (see :func:`production_kernels`). Upstream's Triton kernels
(MoE router, DSA decode metadata, KV and index-K writes, allocators, act_quant) run unchanged there.

Batch invariance: the indexer logits and the sparse attention are computed in float64 and rounded
once, so a request's tokens do not depend on which requests it is batched with (an fp32 matmul's
reduction order changes with the batch shape on the CPU, and greedy tokens then differ between a
request run alone and the same request batched, with or without kv offload). The end-to-end tests
compare every request with the flag-off server running it alone.

Every reference runs inside CUDA graph capture: fixed shapes, no ``.item()``/host sync, no host to
device copies during capture (the Hadamard matrix is built on the device and cached outside capture).
S16-S18 (speculative decoding) are CPU only and size their outputs from the data; on the GPU upstream
runs its own Triton kernels there.
Large intermediate products (the prefill logits and the sparse attention gather) are computed in row
chunks of at most ``CHUNK_ELEMENTS`` elements; the chunking depends on shapes only.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import math
import os
import sys
from typing import Callable, Dict, Optional, Tuple

import torch

# Index-key page layout of NSA's ``index_k_with_scale_buffer`` (64 tokens a page: 64 x 128 fp8
# values, then 64 fp32 scales).
INDEX_PAGE_TOKENS = 64
INDEX_HEAD_DIM = 128
# Largest intermediate (elements) a reference materialises at once; larger products go in row chunks.
CHUNK_ELEMENTS = 1 << 28


def _fast() -> bool:
    """``KV_OFFLOAD_STANDINS_FAST=1`` (throughput benchmarks only): the logits and the attention in
    bf16 with fp32 softmax instead of float64, and the S7 weights drawn on the GPU. Tokens then
    depend on the batch shape, so the token-equality tests never set it."""
    return os.environ.get("KV_OFFLOAD_STANDINS_FAST") == "1"


def production_kernels() -> bool:
    """``KV_OFFLOAD_KERNELS=production`` (``source scripts/gpu_env.sh production``): FlashMLA,
    DeepGEMM and 0.5.23's JIT kernels are real on the GPU, so S3, S9, G3, G6 and G7 are not
    installed; S4 and S6 are import-time and give way to the real ``deep_gemm`` and ``flash_mla``,
    which come first on the path. The ``sgl_kernel`` ones (S5, G1, G2, G4, G5) and S7 stay."""
    return os.environ.get("KV_OFFLOAD_KERNELS") == "production"


def _cdt() -> torch.dtype:
    """The compute dtype of the logits and attention references."""
    return torch.bfloat16 if _fast() else torch.float64


def _row_chunks(rows: int, elements_per_row: int):
    """Row slices covering ``rows`` with at most ``CHUNK_ELEMENTS`` elements each (shape-only)."""
    step = max(1, CHUNK_ELEMENTS // max(1, elements_per_row))
    return [slice(i, min(rows, i + step)) for i in range(0, rows, step)]


# ------------------------------------------------------------------------------------------------
# S3: Hadamard transform
# ------------------------------------------------------------------------------------------------
_HADAMARD: Dict[Tuple[int, torch.device], torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    h = _HADAMARD.get(key)
    if h is None:
        # Built with device ops (no host to device copy, so also legal during graph capture); cached
        # only outside capture (a tensor made during capture lives in the graph's private pool).
        h = torch.ones(1, 1, dtype=torch.float32, device=device)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        if not _capturing(device):
            _HADAMARD[key] = h
    return h


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y = (x @ H_n) * scale`` over the last dimension (n a power of two), in fp32."""
    h = _hadamard_matrix(x.shape[-1], x.device)
    return (x.float() @ h * scale).to(x.dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``nsa_indexer.rotate_activation`` with the Hadamard kernel replaced (S3)."""
    assert x.dtype == torch.bfloat16
    n = x.size(-1)
    assert n & (n - 1) == 0, "Hidden size must be a power of 2 for Hadamard transform."
    return hadamard_transform(x, scale=n**-0.5)


# ------------------------------------------------------------------------------------------------
# S4: DeepGEMM indexer logits
# ------------------------------------------------------------------------------------------------
def get_num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 1


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int):
    """The schedule is a DeepGEMM implementation detail; the reference needs none."""
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: Tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    """Ragged logits ``[M, N]``: ``sum_h relu(q[m,h] . k[n] * s[n]) * w[m,h]`` for ks <= n < ke."""
    k_fp8, k_scale = kv
    cdt = _cdt()
    k = (k_fp8.double() * k_scale.double().reshape(-1, 1)).to(cdt)
    n = torch.arange(k.shape[0], device=q.device)
    out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    for rows in _row_chunks(q.shape[0], q.shape[1] * k.shape[0]):
        score = torch.einsum("mhd,nd->mhn", q[rows].to(cdt), k).relu()
        logits = (score * weights[rows].to(cdt).unsqueeze(-1)).sum(dim=1).float()
        valid = (n[None, :] >= cu_seqlen_ks[rows, None]) & (n[None, :] < cu_seqlen_ke[rows, None])
        out[rows] = logits.masked_fill(~valid, float("-inf"))
    return out


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: Optional[torch.Tensor],
    max_context_len: int,
    clean_logits: bool = True,
) -> torch.Tensor:
    """Paged logits ``[B * next_n, max_context_len]`` from the paged fp8 index-key cache.

    ``kv_cache`` is ``[num_pages, 64, 1, 132]`` bytes: per page 64 x 128 fp8 keys then 64 fp32
    scales. Positions at or past a row's context length are ``-inf``.
    """
    batch, next_n, heads, dim = q.shape
    pages = kv_cache.shape[0]
    # Views of the pool (no copy: the kernel reads only the pages the block tables name, and a
    # copy of the whole pool would cost time in proportion to the pool, not the batch).
    raw = kv_cache.reshape(pages, -1)
    keys = raw.view(pages, -1, dim)[:, :INDEX_PAGE_TOKENS]  # [pages, 64, 128] bytes
    scales = raw.view(torch.float32)[:, INDEX_PAGE_TOKENS * dim // 4 :]  # [pages, 64]
    pos = torch.arange(max_context_len, device=q.device)
    table = block_tables[:, pos // INDEX_PAGE_TOKENS].long().clamp_min(0)  # [B, L]
    offset = (pos % INDEX_PAGE_TOKENS).expand_as(table)
    cdt = _cdt()
    k = keys[table, offset].view(torch.float8_e4m3fn).to(cdt)  # [B, L, D]
    k = k * scales[table, offset].to(cdt).unsqueeze(-1)
    qf = q.to(cdt).reshape(batch, next_n, heads, dim)
    score = torch.einsum("bthd,bld->bthl", qf, k).relu()
    w = weights.to(cdt).reshape(batch, next_n, heads, 1)
    logits = (score * w).sum(dim=2).float().reshape(batch * next_n, max_context_len)
    if _replay_period() is not None:
        return _replayed_logits(kv_cache, context_lens, batch, next_n, max_context_len)
    lens = _decode_lens(context_lens, batch, next_n)
    return logits.masked_fill(pos[None, :] >= lens, float("-inf"))


def _decode_lens(context_lens: torch.Tensor, batch: int, next_n: int) -> torch.Tensor:
    """``[batch * next_n, 1]`` context length each logits row sees (MTP rows one more each)."""
    lens = context_lens.reshape(batch, -1)[:, -1:].repeat_interleave(next_n, dim=0)
    if next_n > 1:
        arange = torch.arange(next_n, device=context_lens.device)
        lens = lens - (next_n - 1 - arange.repeat(batch)[:, None])
    return lens


# Benchmark-only decode top-k replay (``KV_OFFLOAD_STANDINS_TOPK_PERIOD=T``): random weights give a
# top-k that is random at every step, while real DSA keeps sinks and a local window and changes a
# fraction of the rest per step (benchmark/kv_offload/traces.py). With it the decode logits are
# replaced by relevance scores that depend only on (layer, position, context length): sinks and
# window first, then a stationary random process in the context length that decorrelates over T
# steps, shared by adjacent layers as in traces.py. The same requests thus select the same
# positions in every server (no flag, kv offload, HiSparse). Fixed shapes, device ops only.
REPLAY_SINKS = 4
REPLAY_WINDOW = 128
REPLAY_SHARE = 0.97  # correlation of adjacent layers' relevance (traces.TraceConfig.share)
_REPLAY_LAYERS: Dict[int, int] = {}


def _replay_period() -> Optional[int]:
    period = os.environ.get("KV_OFFLOAD_STANDINS_TOPK_PERIOD")
    return int(period) if period else None


def _replay_layer(index_cache: torch.Tensor) -> int:
    """A layer's ordinal, by its index-key buffer in first-call order (layer 0 calls first)."""
    return _REPLAY_LAYERS.setdefault(index_cache.data_ptr(), len(_REPLAY_LAYERS))


def _hash_normal(key: int, pos: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A standard normal per (key, position, step) from an integer hash (Box-Muller)."""

    def mix(h: torch.Tensor) -> torch.Tensor:
        mask = 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & mask
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & mask
        return h ^ (h >> 16)

    base = (pos * 73856093) ^ (step * 19349663) ^ (key * 83492791)
    u1 = (mix(base).double() + 0.5) / 2**32
    u2 = (mix(base ^ 0x5BD1E995).double() + 0.5) / 2**32
    return (torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).float()


def _drift(key: int, pos: torch.Tensor, n: torch.Tensor, period: int) -> torch.Tensor:
    """Unit-variance relevance at context length ``n``, decorrelating over ``period`` steps."""
    k, f = n // period, (n % period).double() / period
    g = (1 - f) * _hash_normal(key, pos, k) + f * _hash_normal(key, pos, k + 1)
    return (g / torch.sqrt((1 - f) ** 2 + f**2)).float()


def _replayed_logits(
    index_cache: torch.Tensor, context_lens: torch.Tensor, batch: int, next_n: int, width: int
) -> torch.Tensor:
    """The decode logits the replay serves (S4, B1): ``[batch * next_n, width]`` replay scores of
    the layer owning ``index_cache``, ``-inf`` at or past each row's context length."""
    lens = _decode_lens(context_lens, batch, next_n)
    layer, period = _replay_layer(index_cache), _replay_period()
    if lens.is_cuda:  # one fused kernel: the torch replay's hundred launches weigh on every step
        from replay_kernel import replay_logits

        return replay_logits(layer, lens, width, period, REPLAY_SHARE, REPLAY_SINKS, REPLAY_WINDOW)
    pos = torch.arange(width, device=context_lens.device)
    scores = replay_scores(layer, pos, lens, period)
    return scores.masked_fill(pos[None, :] >= lens, float("-inf"))


def replay_scores(layer: int, pos: torch.Tensor, lens: torch.Tensor, period: int) -> torch.Tensor:
    """``[rows, len(pos)]`` relevance of each position for rows of context ``lens`` (``[rows, 1]``)."""
    pos, n = pos.long()[None, :], lens.long()
    score = math.sqrt(REPLAY_SHARE) * _drift(0, pos, n, period)
    score = score + math.sqrt(1 - REPLAY_SHARE) * _drift(layer + 1, pos, n, period)
    pinned = (pos < REPLAY_SINKS) | (pos >= n - REPLAY_WINDOW)
    return torch.where(pinned, torch.full_like(score, 1e4), score)


def _patch_deep_gemm(module) -> None:
    """B1, benchmark-only (production kernels with the top-k replay on): the real DeepGEMM decode
    logits run (their time stays in the step), then the replay's scores overwrite them in place
    (the kernel's own row-padded layout kept), as S4 does with the stand-in's logits."""
    if not production_kernels() or _replay_period() is None:
        return
    real = module.fp8_paged_mqa_logits

    def fp8_paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_context_len,
        clean_logits=True,
    ):  # fmt: skip
        logits = real(
            q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_context_len,
            clean_logits=clean_logits,
        )  # fmt: skip
        batch, next_n = q.shape[:2]
        return logits.copy_(
            _replayed_logits(kv_cache, context_lens, batch, next_n, max_context_len)
        )

    module.fp8_paged_mqa_logits = fp8_paged_mqa_logits


# ------------------------------------------------------------------------------------------------
# S5: sgl_kernel top-k
# ------------------------------------------------------------------------------------------------
def _topk_rows(
    score: torch.Tensor, lengths: torch.Tensor, topk: int, row_starts: Optional[torch.Tensor]
) -> torch.Tensor:
    """Per row, the top-``topk`` positions of ``score[i, s_i : s_i + len_i]`` relative to ``s_i``.

    Rows with fewer than ``topk`` candidates are padded with -1 (the kernel's layout).
    """
    rows, width = score.shape
    cols = torch.arange(width, device=score.device)
    start = (
        row_starts.reshape(-1, 1).long()
        if row_starts is not None
        else torch.zeros((rows, 1), dtype=torch.long, device=score.device)
    )
    rel = cols[None, :] - start
    valid = (rel >= 0) & (rel < lengths.reshape(-1, 1).long())
    masked = torch.where(
        valid, score.float(), torch.full_like(score, float("-inf"), dtype=torch.float)
    )
    k = min(topk, width)
    values, idx = torch.topk(masked, k, dim=-1, sorted=False)
    picked_valid = torch.gather(valid, 1, idx)
    rel_idx = torch.where(picked_valid, idx - start, torch.full_like(idx, -1))
    if k < topk:
        rel_idx = torch.cat([rel_idx, rel_idx.new_full((rows, topk - k), -1)], dim=1)
    return rel_idx.to(torch.int32)


def fast_topk_v2(score, lengths, topk, row_starts=None):
    return _topk_rows(score, lengths, topk, row_starts)


def fast_topk_transform_fused(
    score, lengths, page_table_size_1, cu_seqlens_q, topk, row_starts=None
):
    """Top-k positions mapped through each row's request page table (row -> request by
    ``cu_seqlens_q``)."""
    idx = _topk_rows(score, lengths, topk, row_starts).long()
    rows = score.shape[0]
    row_ids = torch.arange(rows, device=score.device)
    req = torch.searchsorted(cu_seqlens_q[1:].long().contiguous(), row_ids, right=True)
    req = req.clamp_max(page_table_size_1.shape[0] - 1)
    locs = page_table_size_1[req[:, None], idx.clamp_min(0)]
    return torch.where(idx >= 0, locs, torch.full_like(locs, -1)).to(torch.int32)


def fast_topk_transform_ragged_fused(score, lengths, topk_indices_offset, topk, row_starts=None):
    idx = _topk_rows(score, lengths, topk, row_starts)
    shifted = idx + topk_indices_offset.reshape(-1, 1).to(idx.dtype)
    return torch.where(idx >= 0, shifted, torch.full_like(idx, -1))


# ------------------------------------------------------------------------------------------------
# S6: FlashMLA sparse attention
# ------------------------------------------------------------------------------------------------
def flash_mla_sparse_fwd(
    q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, **kwargs
):
    """Sparse MLA: each query token attends to the KV rows named in ``indices`` (-1 = none).

    ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]``, ``indices [s_q, 1, topk]``. Returns
    ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``. 0.5.23 (``flash_mla`` wheel
    signature) adds ``topk_length [s_q]`` (only the first ``topk_length[i]`` indices of row ``i``
    count) and ``attn_sink [h_q]`` (an extra logit per head in the softmax denominator, no value).
    """
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        keep = pos[None, :] < topk_length.reshape(-1, 1).to(pos.dtype)
        indices = torch.where(keep[:, None, :], indices, torch.full_like(indices, -1))
    s_q, h_q, d_qk = q.shape
    topk = indices.shape[-1]
    if s_q * topk * max(d_qk, h_q) <= CHUNK_ELEMENTS:
        out = _flash_mla_sparse_rows(q, kv, indices, sm_scale, d_v)
    else:
        parts = [
            _flash_mla_sparse_rows(q[rows], kv, indices[rows], sm_scale, d_v)
            for rows in _row_chunks(s_q, topk * max(d_qk, h_q))
        ]
        out = tuple(torch.cat(p, dim=0) for p in zip(*parts))
    if attn_sink is not None:
        o, max_logits, lse = out
        sink = attn_sink.double().reshape(1, -1)
        new_lse = torch.logaddexp(lse.double(), sink)
        o = (o.double() * torch.exp(lse.double() - new_lse).unsqueeze(-1)).to(o.dtype)
        out = (o, max_logits, new_lse.float())
    return out


def _flash_mla_sparse_rows(q, kv, indices, sm_scale, d_v):
    idx = indices[:, 0, :].long()
    rows = kv[:, 0, :][idx.clamp_min(0)]  # [s_q, topk, d_qk]
    out, max_logits, lse, _ = _sparse_attend(q, rows, idx >= 0, sm_scale, d_v)
    return out.to(q.dtype), max_logits, lse


def _sparse_attend(q, rows, valid, sm_scale, d_v):
    """Softmax attention of ``q [s, h, d]`` over its own ``rows [s, topk, d]`` where ``valid
    [s, topk]``; values are the first ``d_v`` dims of the rows. Returns the output (softmax
    dtype), max logits, log-sum-exp (natural log; ``log(1e-30)`` past the max for a row with no
    valid entry, whose output is 0) and the softmax denominator."""
    cdt = _cdt()
    sdt = torch.float32 if _fast() else torch.float64  # the softmax's
    rows = rows.to(cdt)
    scores = torch.einsum("shd,std->sht", q.to(cdt), rows).to(sdt) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = scores.amax(dim=-1)
    safe_max = torch.where(torch.isfinite(max_logits), max_logits, torch.zeros_like(max_logits))
    p = torch.exp(scores - safe_max.unsqueeze(-1))
    denom = p.sum(dim=-1)
    out = torch.einsum("sht,std->shd", p.to(cdt), rows[..., :d_v]).to(sdt)
    out = out / denom.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.log(denom.clamp_min(1e-30)) + safe_max
    return out, max_logits.float(), lse.float(), denom


# ------------------------------------------------------------------------------------------------
# S20: FlashMLA's sparse attention over the fp8 KV cache (``flashmla_kv``)
# ------------------------------------------------------------------------------------------------
# DeepSeek-V3.2's fp8 KV row (FlashMLA's "V32" format): 512 e4m3 values of the latent, one fp32
# scale per 128 of them, then the 64 rope values in bf16: 656 B.
FP8_NOPE_DIM = 512
FP8_TILE = 128
FP8_ROPE_DIM = 64
FP8_SCALES_OFFSET = FP8_NOPE_DIM
FP8_ROPE_OFFSET = FP8_NOPE_DIM + FP8_NOPE_DIM // FP8_TILE * 4
FP8_ROW_BYTES = FP8_ROPE_OFFSET + FP8_ROPE_DIM * 2
FLASHMLA_KV_HEADS = (64, 128)  # the head counts the sparse fp8 decode kernel is built for
FLASHMLA_SCHED_META_INTS = 8  # int32 words per SM part of the legacy decode schedule


def dequantize_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[..., 656]`` bytes of V32 fp8 KV rows to ``[..., 576]`` bf16: each e4m3 value times its
    tile's fp32 scale, the product rounded once to bf16 (as FlashMLA's reference and upstream's
    Triton ``dequantize_k_cache`` do), then the rope values as stored."""
    assert rows.shape[-1] == FP8_ROW_BYTES, f"not a 656 B fp8 KV row: {tuple(rows.shape)}"
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, FP8_ROW_BYTES).view(torch.uint8)
    tiles = FP8_NOPE_DIM // FP8_TILE
    # e4m3 -> fp32 by a table of the 256 codes (exact; faster than the cast on the CPU)
    table = torch.arange(256, dtype=torch.uint8, device=rows.device).view(torch.float8_e4m3fn)
    codes = flat[:, :FP8_NOPE_DIM].reshape(-1).int()
    values = table.float().index_select(0, codes).view(-1, tiles, FP8_TILE)
    scales = flat[:, FP8_SCALES_OFFSET:FP8_ROPE_OFFSET].contiguous().view(torch.float32)
    nope = (values * scales.unsqueeze(-1)).to(torch.bfloat16).view(-1, FP8_NOPE_DIM)
    rope = flat[:, FP8_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=-1).view(*lead, FP8_NOPE_DIM + FP8_ROPE_DIM)


def _attendable(rows: torch.Tensor) -> torch.Tensor:
    """Dequantised rows with NaN as 0 (FlashMLA's reference: an unwritten row never poisons the
    sum, its weight being 0)."""
    keys = dequantize_fp8_rows(rows)
    return keys.masked_fill(torch.isnan(keys), 0.0)


def get_mla_decoding_metadata(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    num_heads_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's split-KV schedule: ``([SM parts, 8] int32, [batch + 1] int32)``. The schedule
    is an implementation detail of the kernel; the reference reads neither tensor."""
    device = cache_seqlens.device
    meta = torch.zeros((get_num_sms(), FLASHMLA_SCHED_META_INTS), dtype=torch.int32, device=device)
    num_splits = torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=device)
    return meta, num_splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    kv_format: Optional[str] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decode over V32 fp8 KV rows: each query token attends to the rows its
    ``indices`` name (-1 = none), dequantised (:func:`dequantize_fp8_rows`).

    ``q [b, s_q, h_q, 576]`` bf16 with ``h_q`` 64 or 128, ``k_cache [blocks, page, 1, 656]``
    bytes, ``indices [b, s_q, topk]`` int32 row ids into the cache viewed as ``[-1, 656]``
    (``block * page + offset``). Returns ``(out [b, s_q, h_q, head_dim_v] bf16, lse [b, h_q, s_q]
    fp32)``; a query with no valid index gets ``out`` 0 and ``lse`` +inf (FlashMLA's reference,
    ``tests/ref.py``). Only this mode (``is_fp8_kvcache`` with ``indices``, format V32) is stood
    in; anything else raises."""
    b, s_q, h_q, d_qk = q.shape
    supported = (
        is_fp8_kvcache
        and indices is not None
        and kv_format in (None, "V32")
        and attn_sink is None
        and topk_length is None
        and extra_k_cache is None
        and extra_indices_in_kvcache is None
        and extra_topk_length is None
        and kwargs.get("descale_q") is None
        and kwargs.get("descale_k") is None
    )
    if not supported:
        raise NotImplementedError(
            "flash_mla_with_kvcache stand-in (S20): only what DSA's flashmla_kv calls is stood in, "
            "the sparse decode over V32 fp8 rows (is_fp8_kvcache=True, indices; no attention "
            "sink, topk_length, extra cache or descale)"
        )
    # The kernel's own checks (FlashMLA csrc/api sparse decode).
    assert q.dtype == torch.bfloat16 and d_qk == FP8_NOPE_DIM + FP8_ROPE_DIM, (q.dtype, q.shape)
    assert head_dim_v == FP8_NOPE_DIM, head_dim_v
    assert h_q in FLASHMLA_KV_HEADS, f"FlashMLA sparse decode runs 64 or 128 q heads, not {h_q}"
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1, tuple(k_cache.shape)
    assert k_cache.shape[-1] == FP8_ROW_BYTES, tuple(k_cache.shape)
    assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q), indices.shape
    if softmax_scale is None:
        softmax_scale = d_qk**-0.5
    topk = indices.shape[-1]
    tokens = b * s_q
    cache = k_cache.reshape(-1, FP8_ROW_BYTES)
    idx = indices.reshape(tokens, topk).long()
    valid = idx >= 0
    qf = q.reshape(tokens, h_q, d_qk)
    out = torch.empty((tokens, h_q, head_dim_v), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((tokens, h_q), dtype=torch.float32, device=q.device)
    # Dequantise the fewer rows (shapes only): the whole cache when the queries name more rows
    # than it holds (a prefill), else the named rows.
    dense = _attendable(cache) if cache.shape[0] < tokens * topk else None
    for rows in _row_chunks(tokens, topk * max(d_qk, h_q)):
        named = idx[rows].clamp_min(0)
        keys = dense[named] if dense is not None else _attendable(cache[named])
        o, _, l, denom = _sparse_attend(qf[rows], keys, valid[rows], softmax_scale, head_dim_v)
        out[rows] = o.to(torch.bfloat16)
        lse[rows] = torch.where(denom > 0, l, torch.full_like(l, float("inf")))
    return out.view(b, s_q, h_q, head_dim_v), lse.view(b, s_q, h_q).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# S7: dummy weights whose output depends on the context
# ------------------------------------------------------------------------------------------------
def initialize_dummy_weights(model: torch.nn.Module, *args, seed: int = 1234, **kwargs) -> None:
    """Seeded init at a scale where the output depends on the context (upstream's uniform +-1e-3
    makes every context give the same token): matrices ``N(0, 1/fan_in)``, norm weights ``1``,
    biases ``0``.

    The values are drawn per tensor of the checkpoint layout (HF names, full shapes) and loaded
    through the model's own ``load_weights``, which shards them: every TP size runs the same
    weights. Parameters the checkpoint layout does not cover keep a per-parameter draw."""
    for name, param in model.state_dict().items():
        if torch.is_floating_point(param):
            param.data.copy_(_seeded(f"{seed}:{name}", name, param.shape).to(param.dtype))
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "load_weights") and _is_tiny_deepseek(config):
        model.load_weights(
            (name, _seeded(f"{seed}:{name}", name, shape))
            for name, shape in _deepseek_checkpoint_shapes(config)
        )


def _seeded(key: str, name: str, shape) -> torch.Tensor:
    digest = hashlib.sha256(key.encode()).digest()
    device = "cuda" if _fast() and torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if len(shape) >= 2:
        return torch.randn(tuple(shape), generator=gen, device=device) / math.sqrt(shape[-1])
    if "norm" in name and not name.endswith("bias"):
        return torch.ones(tuple(shape))
    return torch.zeros(tuple(shape))


def _is_tiny_deepseek(config) -> bool:
    return getattr(config, "model_type", "") in ("deepseek_v3", "deepseek_v32")


def _deepseek_checkpoint_shapes(config):
    """(HF name, full shape) of every tensor of a DeepSeek-V3(.2) checkpoint with ``config``."""
    h, v = config.hidden_size, config.vocab_size
    heads, q_rank, kv_rank = config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank
    nope, rope, vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    yield "model.embed_tokens.weight", (v, h)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        a = p + "self_attn."
        yield a + "q_a_proj.weight", (q_rank, h)
        yield a + "q_a_layernorm.weight", (q_rank,)
        yield a + "q_b_proj.weight", (heads * (nope + rope), q_rank)
        yield a + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h)
        yield a + "kv_a_layernorm.weight", (kv_rank,)
        yield a + "kv_b_proj.weight", (heads * (nope + vdim), kv_rank)
        yield a + "o_proj.weight", (h, heads * vdim)
        if hasattr(config, "index_topk"):
            idx_heads, idx_dim = config.index_n_heads, config.index_head_dim
            yield a + "indexer.wq_b.weight", (idx_heads * idx_dim, q_rank)
            yield a + "indexer.wk.weight", (idx_dim, h)
            yield a + "indexer.k_norm.weight", (idx_dim,)
            yield a + "indexer.k_norm.bias", (idx_dim,)
            yield a + "indexer.weights_proj.weight", (idx_heads, h)
        m = p + "mlp."
        if i < config.first_k_dense_replace:
            inter = config.intermediate_size
            yield m + "gate_proj.weight", (inter, h)
            yield m + "up_proj.weight", (inter, h)
            yield m + "down_proj.weight", (h, inter)
            continue
        inter = config.moe_intermediate_size
        yield m + "gate.weight", (config.n_routed_experts, h)
        yield m + "gate.e_score_correction_bias", (config.n_routed_experts,)
        for e in range(config.n_routed_experts):
            yield m + f"experts.{e}.gate_proj.weight", (inter, h)
            yield m + f"experts.{e}.up_proj.weight", (inter, h)
            yield m + f"experts.{e}.down_proj.weight", (h, inter)
        shared = inter * config.n_shared_experts
        yield m + "shared_experts.gate_proj.weight", (shared, h)
        yield m + "shared_experts.up_proj.weight", (shared, h)
        yield m + "shared_experts.down_proj.weight", (h, shared)


# ------------------------------------------------------------------------------------------------
# S17: speculative decoding's CPU-engine ops (twins of upstream Triton kernels)
# ------------------------------------------------------------------------------------------------
def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``mem_cache/allocation.py``'s Triton ``assign_req_to_token_pool``: request ``i`` takes the
    next ``end[i] - start[i]`` entries of ``out_cache_loc`` (requests packed in batch order) at
    positions ``start[i]:end[i]`` of its row ``req_to_token[req_pool_indices[i]]``."""
    assert req_to_token.shape[1] == pool_len
    rows, cols, total = _packed_spans(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _packed_spans(req_pool_indices, start_offset, end_offset):
    """Row, column and packed position of every entry of ``req_to_token[idx[i], start[i]:end[i]]``,
    requests packed in batch order (the Triton kernels' ``out_offset``)."""
    start, end = start_offset.long(), end_offset.long()
    lens = (end - start).clamp_min(0)
    total = int(lens.sum())
    rows = torch.repeat_interleave(req_pool_indices.long(), lens)
    first = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, device=lens.device) - torch.repeat_interleave(first, lens)
    return rows, torch.repeat_interleave(start, lens) + within, total


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``kernels/ops/speculative/cache_locs.py``'s Triton ``assign_extend_cache_locs`` (the
    inverse of the above): ``out_cache_loc`` gets each request's ``start[i]:end[i]`` entries."""
    assert req_to_token.shape[1] == pool_len
    rows, cols, total = _packed_spans(req_pool_indices, start_offset, end_offset)
    out_cache_loc[:total] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """Triton ``assign_draft_cache_locs_contiguous`` (without positions, as upstream's CPU call):
    request ``i``'s ``topk * num_steps`` locs from ``seq_lens[i]`` on go to
    ``out_cache_loc[i * topk * num_steps:]``."""
    width = topk * num_steps
    start = seq_lens.long()
    assign_extend_cache_locs_cpu(
        req_pool_indices, req_to_token, start, start + width, out_cache_loc, pool_len
    )


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Triton ``fill_bonus_tokens``: request ``i``'s bonus token is its last accepted one,
    ``accept_tokens.flatten()[accept_stride * i + accept_lens[i] - 1]``."""
    bs = accept_lens.numel()
    idx = accept_stride * torch.arange(bs, device=accept_lens.device) + accept_lens.long() - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Triton ``fill_accept_out_cache_loc``: the locs of the accepted entries
    (``accept_index != -1``), compacted in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """The EAGLE tree (mask, positions, retrieve links) by upstream's own Triton
    ``sgl_build_tree_kernel_triton`` (``kernels/ops/speculative/spec_tree.py``, its XPU path)."""
    from sglang.kernels.ops.speculative import spec_tree

    spec_tree.sgl_build_tree_kernel_triton(
        parent_list,
        selected_index,
        verified_seq_len,
        tree_mask,
        positions,
        retrieve_index,
        retrieve_next_token,
        retrieve_next_sibling,
        topk,
        depth,
        draft_token_num,
        spec_tree.TreeMaskMode(int(tree_mask_mode)),
    )


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy verification by upstream's own Triton ``verify_tree_greedy_triton`` (its XPU path)."""
    from sglang.kernels.ops.speculative import spec_tree

    spec_tree.verify_tree_greedy_triton(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrieve_index=retrive_index,
        retrieve_next_token=retrive_next_token,
        retrieve_next_sibling=retrive_next_sibling,
        target_predict=target_predict,
    )


# ------------------------------------------------------------------------------------------------
# G5: fused MoE experts
# ------------------------------------------------------------------------------------------------
def fused_moe_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    routed_scaling_factor: Optional[float] = None,
) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's top-k experts ``e``, times
    ``routed_scaling_factor`` (what the Triton runner's ``moe_sum_reduce`` applies on CUDA).

    ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``. Every expert runs on every token
    and the results are combined with a dense ``[T, E]`` weight matrix (0 for experts not picked,
    ids < 0 = padding), so shapes never depend on the routing.
    """
    tokens, experts = x.shape[0], w13.shape[0]
    ids = topk_ids.long()
    valid = ids >= 0
    dense = torch.zeros((tokens, experts), dtype=torch.float32, device=x.device)
    dense.scatter_add_(
        1,
        ids.clamp_min(0),
        torch.where(
            valid, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32)
        ),
    )
    out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    for e in range(experts):
        h = x @ w13[e].t()
        d = h.shape[-1] // 2
        a = torch.nn.functional.silu(h[:, :d]) * h[:, d:]
        out += (a @ w2[e].t()).float() * dense[:, e : e + 1]
    if routed_scaling_factor is not None:
        out *= routed_scaling_factor
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Installation: patch each target module when it is first imported.
# ------------------------------------------------------------------------------------------------
def _patch_server_args(module) -> None:
    if not torch.cuda.is_available():  # S2
        torch.cuda.get_device_capability = lambda device=None: (9, 0)


def _patch_rope_variant(module) -> None:
    def forward_native(self, positions, query, key, offsets=None):  # S10
        pos = torch.add(positions, offsets) if offsets is not None else positions
        cos, sin = self.cos_sin_cache[pos].float().chunk(2, dim=-1)
        if self.is_neox_style:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            rotate = module.rotate_neox
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            rotate = module.rotate_gptj
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def apply(x):
            x3 = x.unsqueeze(1) if x.dim() == 2 else x.view(x.shape[0], -1, x.shape[-1])
            rot = x3[..., : self.rotary_dim].float()
            rot = rot * cos + rotate(rot) * sin
            out = torch.cat([rot.to(x.dtype), x3[..., self.rotary_dim :]], dim=-1)
            return out.view(x.shape)

        return apply(query), apply(key)

    module.DeepseekScalingRotaryEmbedding.forward_native = forward_native
    if (
        torch.cuda.is_available() and not production_kernels()
    ):  # G3: the JIT rope kernel (RotaryEmbedding.forward_cuda)

        def forward_cuda(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
            assert fused_set_kv_buffer_arg is None, "fused rope + KV store is not stood in"
            return forward_native(self, positions, query, key, offsets)

        module.DeepseekScalingRotaryEmbedding.forward_cuda = forward_cuda


def _patch_loader(module) -> None:
    module.initialize_dummy_weights = initialize_dummy_weights  # S7


def _patch_layernorm(module) -> None:
    if torch.cuda.is_available():  # G1: sgl_kernel rmsnorm / fused_add_rmsnorm
        module.RMSNorm.forward_cuda = module.RMSNorm.forward_native


def _patch_activation(module) -> None:
    if torch.cuda.is_available():  # G2: JIT silu_and_mul (sgl_kernel's for other widths)
        module.SiluAndMul.forward_cuda = module.SiluAndMul.forward_native


def _patch_topk(module) -> None:
    if torch.cuda.is_available():  # G4: the flashinfer stub must not look like flashinfer's top-k
        module.fused_topk_deepseek = None


def _patch_unquant(module) -> None:
    if not torch.cuda.is_available():
        return

    def forward_cuda(self, layer, dispatch_output):  # G5
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        config = self.moe_runner_config
        assert config.activation == "silu" and not config.apply_router_weight_on_input
        assert getattr(config, "gemm1_alpha", None) is None
        assert getattr(config, "gemm1_clamp_limit", None) is None
        topk_weights, topk_ids = dispatch_output.topk_output[:2]
        out = fused_moe_dense(
            dispatch_output.hidden_states,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            config.routed_scaling_factor,
        )
        return StandardCombineInput(hidden_states=out)

    module.UnquantizedFusedMoEMethod.forward_cuda = forward_cuda


def _patch_clamp_position(module) -> None:
    if (
        torch.cuda.is_available() and not production_kernels()
    ):  # G6: pin the op to its torch path (upstream's documented pin)
        module._CLAMP_POSITION._forward_method = module._CLAMP_POSITION.forward_native


def _patch_attention_utils(module) -> None:
    if (
        torch.cuda.is_available() and not production_kernels()
    ):  # G7: concat_mla_absorb_q_general's torch.cat branch
        module.concat_mla_absorb_q = lambda q_nope, q_rope: torch.cat([q_nope, q_rope], dim=-1)


# ------------------------------------------------------------------------------------------------
# C1: CPU only, for speed: upstream Triton kernels that the interpreter runs token by token
# ------------------------------------------------------------------------------------------------
FP8_E4M3_MAX = 448.0


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: Optional[str] = None):
    """``nsa.triton_kernel.act_quant``: per ``block_size`` group, ``s = max(|x|, 1e-4) / 448``
    (rounded up to a power of two with ``scale_fmt``) and ``y = clamp(x / s)`` in e4m3."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = amax / FP8_E4M3_MAX
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (groups / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), scale.squeeze(-1)


def set_index_k_and_scale(pool, buf, loc, index_k, index_k_scale) -> None:
    """``SetKAndS.triton``: token ``loc`` of page ``loc // 64`` gets its 128 fp8 key bytes at
    ``(loc % 64) * 128`` and its fp32 scale at ``64 * 128 + (loc % 64) * 4`` (upstream's layout)."""
    page_size, dim = pool.page_size, pool.index_head_dim
    loc = loc.long()
    page, off = loc // page_size, (loc % page_size)[:, None]
    key_cols = off * dim + torch.arange(dim, device=loc.device)
    scale_cols = page_size * dim + off * 4 + torch.arange(4, device=loc.device)
    buf[page[:, None], key_cols] = index_k.reshape(loc.numel(), dim).view(torch.uint8)
    scale = index_k_scale.reshape(loc.numel(), -1).to(torch.float32).contiguous()
    buf[page[:, None], scale_cols] = scale.view(torch.uint8).reshape(loc.numel(), 4)


def quantize_k_cache_fast_separate(
    k_nope: torch.Tensor, k_rope: torch.Tensor, group_size: int = 128
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``dsa_quant_k_cache._quantize_k_cache_fast_separate`` (C2, the fp8 KV row write): per
    ``group_size`` latent values ``s = max|x| / 448`` and ``e4m3(clamp(x * (1 / s)))`` in fp32,
    rounded to nearest even as the GPU's cast rounds; returns ``(nope_part [n, 1, 512 + 4 * 4],
    rope_part [n, 1, 2 * 64])`` bytes: the e4m3 values then the fp32 scales, and the rope values
    unchanged."""
    n, dim_nope = k_nope.shape
    groups = k_nope.float().view(n, dim_nope // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / FP8_E4M3_MAX
    inv = 1.0 / scale
    values = (groups * inv.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    values = values.to(torch.float8_e4m3fn).view(torch.uint8).view(n, dim_nope)
    nope_part = torch.cat([values, scale.view(torch.uint8).view(n, -1)], dim=1)
    rope_part = k_rope.contiguous().view(torch.uint8).view(n, -1)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


def _cpu_only(patch: Callable) -> Callable:
    def apply(module) -> None:
        if not torch.cuda.is_available():
            patch(module)

    return apply


@_cpu_only
def _patch_index_buf_accessor(module) -> None:
    module.SetKAndS.triton = classmethod(
        lambda cls, pool, buf, loc, index_k, index_k_scale: set_index_k_and_scale(
            pool, buf, loc, index_k, index_k_scale
        )
    )


def _patch_dsa_indexer(module) -> None:
    # 0.5.23: nsa/nsa_indexer.py is a re-export shim of dsa/dsa_indexer.py. The logits functions
    # come from `dsa.utils.resolve_*`, which import `deep_gemm` (the S4 package beside this file).
    # (`_is_cuda` also gates the CUDA-JIT indexer fusion, off for this config: rope is neox style.)
    module._is_cuda = True  # S1: forward_cuda raises "only supports CUDA, HIP, and NPU" otherwise
    module.Indexer.forward_native = module.Indexer.forward_cuda  # S1: the indexer has no CPU path
    if not torch.cuda.is_available():  # S11: the CUDA head-gate GEMM, aten::mm.dtype, is CUDA-only

        def _weights_proj_bf16_in_fp32_out(self, x):
            x = x[0] if isinstance(x, tuple) else x
            return torch.mm(x.float(), self.weights_proj.weight.float().t())

        module.Indexer._weights_proj_bf16_in_fp32_out = _weights_proj_bf16_in_fp32_out
        # S12: the ragged (prefill) top-k asserts a device index, used only for the CUDA logits
        # memory budget (reached for big matrices only); a CPU tensor has none.
        _replace_in_method(
            module,
            module.Indexer,
            "_get_topk_ragged",
            "device_index = device.index\n",
            "device_index = device.index if device.index is not None else 0\n",
        )

        # S14: the logits memory budget of a big prefill batch reads the device's total memory
        # (``get_device_properties``, which a CPU torch lacks); on the CPU, the host's.
        def _get_mqa_logits_budget_bytes(self, device_index: int) -> int:
            import psutil

            return max(1, int(psutil.virtual_memory().total * module.MQA_LOGITS_TOTAL_MEM_FRACTION))

        module.Indexer._get_mqa_logits_budget_bytes = _get_mqa_logits_budget_bytes
    if not production_kernels():
        module.rotate_activation = rotate_activation  # S3 (0.5.23 JIT hadamard is CUDA only)
        module.can_use_dsa_fused_store = lambda *args, **kwargs: False  # S9 (JIT: would run nvcc)


def _replace_in_method(module, cls, name: str, old: str, new: str) -> None:
    """Recompile ``cls.name`` from its source with the one line ``old`` replaced by ``new`` (fails
    loudly if ``old`` is not found exactly once, so an upstream change cannot slip through)."""
    import __future__

    import inspect
    import textwrap

    lines, first = inspect.getsourcelines(getattr(cls, name))
    src = textwrap.dedent("".join(lines))
    assert src.count(old) == 1, f"{cls.__name__}.{name}: expected one {old!r}"
    code = compile(
        "\n" * (first - 1) + src.replace(old, new),  # keep upstream's line numbers
        inspect.getsourcefile(cls),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    namespace: Dict[str, object] = {}
    exec(code, module.__dict__, namespace)
    setattr(cls, name, namespace[name])


@_cpu_only
def _patch_act_quant_triton(module) -> None:
    module.act_quant = act_quant  # C1 (0.5.23: moved from nsa.triton_kernel)


@_cpu_only
def _patch_dsa_quant_k_cache(module) -> None:
    # C2: the fp8 KV row write quantises with a Triton kernel; the interpreter runs it program by
    # program and its fp32 -> e4m3 cast drops the carry of a round-up (124.3 -> 64, not 128) and
    # rounds ties away from zero, so on the CPU the bytes would differ from the GPU's.
    module._quantize_k_cache_fast_separate = quantize_k_cache_fast_separate


@_cpu_only
def _patch_mooncake_conn(module) -> None:
    # S13: a PD prefill server copies a chunk's page indices to pinned memory and records a CUDA
    # event when its sender takes host tensors; off CUDA, upstream's other path (the same indices,
    # computed at once) is the one that can run.
    module.MooncakeKVSender.supports_host_tensor_indices = False


@_cpu_only
def _patch_dsa_backend(module) -> None:
    # S15: attention DP pads every rank's batch to a common size (``_pad_inputs_to_size``), asking
    # the backend for the seq_len of padded rows; on the CPU it asks the CPU-graph method, which
    # only the CPU backends define. The DSA backend's CUDA-graph value is the same padding.
    cls = module.DeepseekSparseAttnBackend
    cls.get_cpu_graph_seq_len_fill_value = cls.get_cuda_graph_seq_len_fill_value


@_cpu_only
def _patch_deepseek_v2(module) -> None:
    # S16: speculative decoding (NEXTN / EAGLE on the MTP layer) hands the target's embedding and
    # LM head to the draft model, then waits for the CUDA device; a CPU torch has no driver to wait on.
    _replace_in_method(
        module,
        module.DeepseekV2ForCausalLM,
        "set_embed_and_head",
        "torch.cuda.synchronize()\n",
        "pass  # S16: no device queue on the CPU\n",
    )


@_cpu_only
def _patch_attention_pad(module) -> None:
    # S18: speculative verify / draft extend expand each request's kv length to one per draft token
    # with a Triton kernel that asserts CUDA inputs; the interpreter runs it on CPU tensors.
    _replace_in_method(
        module,
        module,
        "seqlens_expand_triton",
        "assert extend_seq_lens.is_cuda\n    assert seq_lens.is_cuda\n",
        "pass  # S18: CPU tensors under TRITON_INTERPRET\n",
    )


@_cpu_only
def _patch_kv_cache_configurator(module) -> None:
    # S19: upstream's CPU platform keeps an fp8 KV cache for MHA on Intel AMX only; a DSA model's
    # packed fp8 pool (656 B rows) is refused before it is built. The pool's writes are torch and
    # Triton (``quantize_k_cache_separate``); the reads are FlashMLA's (S20). Let DSA through.
    _replace_in_method(
        module,
        module.KVCacheConfigurator,
        "configure",
        "if current_platform.is_cpu() and self.kv_cache_dtype == torch.float8_e4m3fn:\n",
        "if current_platform.is_cpu() and self.kv_cache_dtype == torch.float8_e4m3fn"
        " and not is_deepseek_dsa(self.model_config.hf_config):  # S19\n",
    )


PATCHES: Dict[str, Callable] = {
    "sglang.kernels.ops.attention.pad": _patch_attention_pad,
    "sglang.srt.models.deepseek_v2": _patch_deepseek_v2,
    "sglang.srt.layers.attention.dsa_backend": _patch_dsa_backend,
    "sglang.srt.disaggregation.mooncake.conn": _patch_mooncake_conn,
    # 0.5.23 module moves: nsa.index_buf_accessor -> kernels.ops.kvcache.dsa_index_k_cache,
    # nsa.triton_kernel.act_quant -> kernels.ops.quantization.act_quant_triton
    "sglang.kernels.ops.kvcache.dsa_index_k_cache": _patch_index_buf_accessor,
    "sglang.kernels.ops.quantization.act_quant_triton": _patch_act_quant_triton,
    "sglang.kernels.ops.quantization.dsa_quant_k_cache": _patch_dsa_quant_k_cache,
    "sglang.srt.server_args": _patch_server_args,
    "sglang.srt.mem_cache.kv_cache_configurator": _patch_kv_cache_configurator,
    "sglang.srt.layers.attention.dsa.dsa_indexer": _patch_dsa_indexer,
    "sglang.srt.model_loader.loader": _patch_loader,
    "sglang.srt.layers.rotary_embedding.rope_variant": _patch_rope_variant,
    "deep_gemm": _patch_deep_gemm,  # B1: benchmark-only, production kernels with the replay
    # G1-G7: CUDA only (each patch checks torch.cuda.is_available())
    "sglang.srt.layers.layernorm": _patch_layernorm,
    "sglang.srt.layers.activation": _patch_activation,
    "sglang.srt.layers.moe.topk": _patch_topk,
    "sglang.srt.layers.quantization.unquant": _patch_unquant,
    "sglang.kernels.ops.attention.clamp_position": _patch_clamp_position,
    "sglang.kernels.ops.attention.utils": _patch_attention_utils,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


_TRACED = (
    "hadamard_transform rotate_activation fp8_mqa_logits fp8_paged_mqa_logits "
    "get_paged_mqa_logits_metadata get_num_sms fast_topk_v2 fast_topk_transform_fused "
    "fast_topk_transform_ragged_fused flash_mla_sparse_fwd initialize_dummy_weights act_quant "
    "set_index_k_and_scale fused_moe_dense assign_req_to_token_pool_cpu assign_extend_cache_locs_cpu "
    "assign_draft_cache_locs_contiguous_cpu fill_bonus_tokens_cpu fill_accept_out_cache_loc_cpu "
    "build_tree_kernel_efficient_cpu verify_tree_greedy_cpu get_mla_decoding_metadata "
    "flash_mla_with_kvcache quantize_k_cache_fast_separate"
).split()


def _trace_first_calls() -> None:
    """Debug aid (KV_OFFLOAD_STANDINS_TRACE=1): log the first call of each stand-in to stderr."""
    import functools
    import os

    g = globals()
    for name in _TRACED:
        fn = g[name]

        def wrap(fn=fn, name=name):
            seen = []

            @functools.wraps(fn)
            def traced(*args, **kwargs):
                if not seen:
                    seen.append(1)
                    print(
                        f"[standin] pid {os.getpid()} first call: {name}",
                        file=sys.stderr,
                        flush=True,
                    )
                return fn(*args, **kwargs)

            return traced

        g[name] = wrap()


def install() -> None:
    """Apply every stand-in in this process (modules already imported are patched now)."""
    import os

    if any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        return
    if os.environ.get("KV_OFFLOAD_STANDINS_TRACE") == "1":
        _trace_first_calls()
    # Debug aid: KV_OFFLOAD_STANDINS_SKIP=mod1,mod2 leaves those target modules unpatched.
    for skipped in filter(None, os.environ.get("KV_OFFLOAD_STANDINS_SKIP", "").split(",")):
        PATCHES.pop(skipped, None)
    sys.meta_path.insert(0, _PatchingFinder())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
