"""CPU stand-in for sgl_kernel.flash_mla: only the sparse prefill/decode kernel NSA calls (S6)."""

from kv_offload_standins import flash_mla_sparse_fwd  # noqa: F401
