"""CPU stand-in: nsa_backend imports these names at module level; calling them is an error."""


def flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError("sgl_kernel.flash_attn is not available on CPU")


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("sgl_kernel.flash_attn is not available on CPU")
