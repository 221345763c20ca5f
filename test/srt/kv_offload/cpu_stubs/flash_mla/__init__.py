"""CPU import-time stand-in for the ``sgl-flash-mla`` wheel (``import flash_mla``), new in 0.5.23.

``sglang.kernels.ops.attention.flash_mla_interface`` imports it at module level; the DSA backend's
``flashmla_sparse`` prefill/decode calls ``flash_mla.flash_mla_sparse_fwd`` through it (S6: the torch
reference, imported at the first call: ``standins/`` is on the path in the server processes only).
Every other name is a placeholder that raises when called.
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
