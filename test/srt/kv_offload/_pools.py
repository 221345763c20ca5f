"""Real kv offload device pools for tests: DeepSeek-V3.2 DSA row shapes, few layers."""

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.arena import plan_arena
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (
    KVOffloadDSATokenToKVPool,
    OffloadPoolSizing,
)

P = 64
FP8 = (torch.float8_e4m3fn, 656)  # 656 B rows: 512 fp8 + 4 fp32 scales + 64 bf16 rope
BF16 = (torch.bfloat16, 576)  # 1152 B rows
INDEX_ROW = 132


def row_bytes(dtype_dim) -> int:
    dtype, dim = dtype_dim
    return dim if dtype == torch.float8_e4m3fn else dim * 2


def offload_device_pool(
    physical: int, logical: int, layers: int = 2, dtype_dim=FP8, device: str = "cpu"
) -> KVOffloadDSATokenToKVPool:
    """A pool whose arena has the bytes of ``physical`` KV rows and ``logical`` index rows (plus
    the padding page) per layer; either side may take more while the other uses less."""
    dtype, dim = dtype_dim
    row = row_bytes(dtype_dim)
    layout = plan_arena((physical + P) * row + logical * INDEX_ROW, row, INDEX_ROW, P)
    return KVOffloadDSATokenToKVPool(
        sizing=OffloadPoolSizing(layout=layout, num_layers=layers),
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
