"""Real kv offload device pools for tests: DeepSeek-V3.2 NSA row shapes, few layers."""

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import KVOffloadDSATokenToKVPool

P = 64
FP8 = (torch.float8_e4m3fn, 656)  # 656 B rows: 512 fp8 + 4 fp32 scales + 64 bf16 rope
BF16 = (torch.bfloat16, 576)  # 1152 B rows


def offload_device_pool(
    physical: int, logical: int, layers: int = 2, dtype_dim=FP8, device: str = "cpu"
) -> KVOffloadDSATokenToKVPool:
    dtype, dim = dtype_dim
    return KVOffloadDSATokenToKVPool(
        physical_size=physical,
        logical_size=logical,
        page_size=P,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=layers,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=dim,
    )
