"""CPU import-time stand-in for the ``sgl-flash-mla`` wheel (``import flash_mla``), new in 0.5.23.

``sglang.kernels.ops.attention.flash_mla_interface`` imports it at module level; through it the DSA
backend's ``flashmla_sparse`` prefill/decode calls ``flash_mla.flash_mla_sparse_fwd`` (S6) and its
``flashmla_kv`` prefill/decode (the fp8 KV cache) calls ``flash_mla.get_mla_decoding_metadata`` and
``flash_mla.flash_mla_with_kvcache`` (S20): the torch references, imported at the first call
(``standins/`` is on the path in the server processes only). Every other name is a placeholder that
raises when called.
"""

__version__ = "0.0.0+cpustub"


def flash_mla_sparse_fwd(
    q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True,
    return_log2_lse=None,
):
    import math

    from kv_offload_standins import flash_mla_sparse_fwd as _sparse_fwd

    out, max_logits, lse = _sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if return_log2_lse:  # the legacy kernel's statistics are base 2
        max_logits, lse = max_logits / math.log(2), lse / math.log(2)
    return out, max_logits, lse


def get_mla_decoding_metadata(
    cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
    topk=None, *, use_legacy=True,
):
    from kv_offload_standins import get_mla_decoding_metadata as _metadata

    return _metadata(
        cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk
    )


def flash_mla_with_kvcache(
    q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
    softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
    extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
    *, use_legacy=True, kv_format=None, descale_q=None, descale_k=None,
):
    from kv_offload_standins import flash_mla_with_kvcache as _with_kvcache

    return _with_kvcache(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
        softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache,
        extra_indices_in_kvcache, topk_length, extra_topk_length, kv_format,
        descale_q=descale_q, descale_k=descale_k,
    )


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not available on this machine (flash_mla stub)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"flash_mla.{name}")


fused_norm_rope_attn_rope_cast = _Unavailable("flash_mla.fused_norm_rope_attn_rope_cast")
