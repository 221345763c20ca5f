"""Test-only stand-in for DeepGEMM's indexer-logits entry points (S4 in kv_offload_standins)."""

from kv_offload_standins import (  # noqa: F401
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    get_num_sms,
    get_paged_mqa_logits_metadata,
)
