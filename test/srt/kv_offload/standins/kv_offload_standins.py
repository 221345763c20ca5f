"""Test-only torch references for the binary kernels the real NSA server calls (the one list).

The tiny real server (``scripts/tiny_server.py``, the end-to-end tests, ``make serve-tiny``) runs
upstream SGLang unchanged on machines that lack ``sgl_kernel``, DeepGEMM and the JIT kernels. Each
entry below replaces one binary kernel by the same maths in torch, and nothing else: every kv_offload
component and every other upstream line runs for real. The references use fixed shapes, masks and
no host synchronisation, so they are also safe inside CUDA graphs on the GPU.

``sitecustomize.py`` beside this file calls :func:`install` in every process of the server
(tokenizer manager, scheduler, detokenizer) when ``KV_OFFLOAD_STANDINS=1``; the patches are applied
when the target module is first imported.

====  =====================================================  =========================================
#     replaces                                               stand-in
====  =====================================================  =========================================
S1    ``nsa_indexer._is_cuda`` off CUDA (CPU)                 take the CUDA indexer path (paged /
                                                             ragged logits + top-k) on the CPU too
S2    ``torch.cuda.get_device_capability`` on a CPU torch      report SM90 (H200), so server_args picks
                                                             Hopper's NSA defaults as on the GPU
S3    ``jit_kernel.hadamard.hadamard_transform``              Sylvester Hadamard matrix product
S4    DeepGEMM ``fp8_mqa_logits``, ``fp8_paged_mqa_logits``,   :func:`fp8_mqa_logits`,
      ``get_paged_mqa_logits_metadata``, ``get_num_sms``      :func:`fp8_paged_mqa_logits`, ... (the
                                                             ``deep_gemm`` package beside this file)
S5    ``sgl_kernel.fast_topk_v2``,                            :func:`fast_topk_v2` and the two fused
      ``fast_topk_transform_fused``,                          transforms: ``torch.topk`` with the same
      ``fast_topk_transform_ragged_fused``                    masking and output layout
S6    ``sgl_kernel.flash_mla.flash_mla_sparse_fwd``           :func:`flash_mla_sparse_fwd`, sparse MLA
                                                             attention over the selected rows
S7    ``--load-format dummy``'s uniform +-1e-3 weights         seeded per-parameter init at a scale where
                                                             the output depends on the context
S8    ``Indexer._should_chunk_mqa_logits`` (reads             never chunk (tiny shapes)
      ``torch.cuda.mem_get_info``)
S9    ``jit_kernel.fused_store_index_cache`` (JIT, CUDA)      upstream's own fallback (act_quant +
                                                             ``set_index_k_scale_buffer``)
S10   CPU only: ``DeepseekScalingRotaryEmbedding``'s torch    the same maths with 2-D inputs viewed as
      path broadcasts a 2-D key ``[T, d]`` to ``[T, T, d]``     ``[T, 1, d]`` (the indexer's key is 2-D;
      (the GPU uses the CUDA rope kernel)                     upstream CPU bug)
====  =====================================================  =========================================
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import math
import sys
from typing import Callable, Dict, Optional, Tuple

import torch

# Index-key page layout of NSA's ``index_k_with_scale_buffer`` (64 tokens a page: 64 x 128 fp8
# values, then 64 fp32 scales).
INDEX_PAGE_TOKENS = 64
INDEX_HEAD_DIM = 128


# ------------------------------------------------------------------------------------------------
# S3: Hadamard transform
# ------------------------------------------------------------------------------------------------
_HADAMARD: Dict[Tuple[int, torch.device], torch.Tensor] = {}


def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = h.to(device)
    return _HADAMARD[key]


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
    k = k_fp8.float() * k_scale.float().reshape(-1, 1)
    score = torch.einsum("mhd,nd->mhn", q.float(), k).relu()
    logits = (score * weights.float().unsqueeze(-1)).sum(dim=1)
    n = torch.arange(k.shape[0], device=q.device)
    valid = (n[None, :] >= cu_seqlen_ks[:, None]) & (n[None, :] < cu_seqlen_ke[:, None])
    return logits.masked_fill(~valid, float("-inf"))


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
    raw = kv_cache.reshape(pages, -1)
    keys = raw[:, : INDEX_PAGE_TOKENS * dim].contiguous().view(torch.float8_e4m3fn)
    keys = keys.view(pages, INDEX_PAGE_TOKENS, dim)
    scales = raw[:, INDEX_PAGE_TOKENS * dim :].contiguous().view(torch.float32)
    scales = scales.view(pages, INDEX_PAGE_TOKENS)
    pos = torch.arange(max_context_len, device=q.device)
    table = block_tables[:, pos // INDEX_PAGE_TOKENS].long().clamp_min(0)  # [B, L]
    offset = (pos % INDEX_PAGE_TOKENS).expand_as(table)
    k = keys[table, offset].float() * scales[table, offset].unsqueeze(-1)  # [B, L, D]
    qf = q.float().reshape(batch, next_n, heads, dim)
    score = torch.einsum("bthd,bld->bthl", qf, k).relu()
    w = weights.float().reshape(batch, next_n, heads, 1)
    logits = (score * w).sum(dim=2).reshape(batch * next_n, max_context_len)
    lens = context_lens.reshape(batch, -1)[:, -1:].repeat_interleave(next_n, dim=0)
    if next_n > 1:  # MTP rows see one more token each
        lens = lens - (next_n - 1 - torch.arange(next_n, device=q.device).repeat(batch)[:, None])
    return logits.masked_fill(pos[None, :] >= lens, float("-inf"))


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
    masked = torch.where(valid, score.float(), torch.full_like(score, float("-inf"), dtype=torch.float))
    k = min(topk, width)
    values, idx = torch.topk(masked, k, dim=-1, sorted=False)
    picked_valid = torch.gather(valid, 1, idx)
    rel_idx = torch.where(picked_valid, idx - start, torch.full_like(idx, -1))
    if k < topk:
        rel_idx = torch.cat([rel_idx, rel_idx.new_full((rows, topk - k), -1)], dim=1)
    return rel_idx.to(torch.int32)


def fast_topk_v2(score, lengths, topk, row_starts=None):
    return _topk_rows(score, lengths, topk, row_starts)


def fast_topk_transform_fused(score, lengths, page_table_size_1, cu_seqlens_q, topk, row_starts=None):
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
def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
    """Sparse MLA: each query token attends to the KV rows named in ``indices`` (-1 = none).

    ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]``, ``indices [s_q, 1, topk]``. Returns
    ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``.
    """
    idx = indices[:, 0, :].long()
    valid = idx >= 0
    rows = kv[:, 0, :][idx.clamp_min(0)].float()  # [s_q, topk, d_qk]
    scores = torch.einsum("shd,std->sht", q.float(), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = scores.amax(dim=-1)
    safe_max = torch.where(torch.isfinite(max_logits), max_logits, torch.zeros_like(max_logits))
    p = torch.exp(scores - safe_max.unsqueeze(-1))
    denom = p.sum(dim=-1)
    out = torch.einsum("sht,std->shd", p, rows[..., :d_v]) / denom.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.log(denom.clamp_min(1e-30)) + safe_max
    return out.to(q.dtype), max_logits, lse


# ------------------------------------------------------------------------------------------------
# S7: dummy weights whose output depends on the context
# ------------------------------------------------------------------------------------------------
def initialize_dummy_weights(model: torch.nn.Module, *args, seed: int = 1234, **kwargs) -> None:
    """Seeded per-parameter init (seed from the name): matrices ``N(0, 1/fan_in)``, norm weights
    ``1``, biases ``0``. Upstream's uniform +-1e-3 makes every context give the same token."""
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        if param.dim() >= 2:
            std = 1.0 / math.sqrt(param.shape[-1])
            values = torch.randn(param.shape, generator=gen) * std
        elif "norm" in name:
            values = torch.ones(param.shape)
        else:
            values = torch.zeros(param.shape)
        param.data.copy_(values.to(param.dtype))


# ------------------------------------------------------------------------------------------------
# Installation: patch each target module when it is first imported.
# ------------------------------------------------------------------------------------------------
def _patch_server_args(module) -> None:
    if not torch.cuda.is_available():  # S2
        torch.cuda.get_device_capability = lambda device=None: (9, 0)


def _patch_nsa_indexer(module) -> None:
    import deep_gemm

    module._is_cuda = True  # S1 (already true on CUDA)
    module.Indexer.forward_native = module.Indexer.forward_cuda  # S1: the indexer has no CPU path
    module.deep_gemm = deep_gemm  # S4
    module.rotate_activation = rotate_activation  # S3
    module.can_use_nsa_fused_store = lambda *args, **kwargs: False  # S9
    module.Indexer._should_chunk_mqa_logits = lambda self, *args, **kwargs: (False, 0)  # S8


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


def _patch_loader(module) -> None:
    module.initialize_dummy_weights = initialize_dummy_weights  # S7


PATCHES: Dict[str, Callable] = {
    "sglang.srt.server_args": _patch_server_args,
    "sglang.srt.layers.attention.nsa.nsa_indexer": _patch_nsa_indexer,
    "sglang.srt.model_loader.loader": _patch_loader,
    "sglang.srt.layers.rotary_embedding.rope_variant": _patch_rope_variant,
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


def install() -> None:
    """Apply every stand-in in this process (modules already imported are patched now)."""
    if any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchingFinder())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
