#!/usr/bin/env python3
"""Show --enable-kv-offload on the patched tree with an embedded tiny DeepSeek-V3.2 config.

Runs on CPU: parses the flag through the real ServerArgs, prints the resolved settings, and shows that
each unsupported combination is rejected with a message that names the fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = os.path.join(ROOT, "test", "srt", "kv_offload", "cpu_stubs")

TINY_DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 2048,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-06,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
}


def _prepare_cpu() -> None:
    import warnings

    warnings.filterwarnings("ignore")  # upstream warns about CUDA-only quantization kernels on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if any(importlib.util.find_spec(p) is None for p in ("sgl_kernel", "torchvision")):
        sys.path.insert(0, STUBS)
    import torch

    if not torch.cuda.is_available():
        # ServerArgs reads the GPU's compute capability to pick NSA defaults; answer as an H200 does.
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-offload-config", default='{"sparse_slots_per_req": 4096}')
    args = parser.parse_args()
    _prepare_cpu()
    import logging

    logging.disable(logging.WARNING)
    from sglang.srt.mem_cache.sparsity.kv_offload.config import (
        KVOffloadConfigError,
        validate_server_args,
    )
    from sglang.srt.server_args import prepare_server_args

    model_dir = tempfile.mkdtemp(prefix="tiny-dsa-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_DSA_CONFIG, f)
    base = ["--model-path", model_dir, "--device", "cpu", "--attention-backend", "nsa"]
    good = base + [
        "--disable-radix-cache",
        "--enable-kv-offload",
        "--kv-offload-config",
        args.kv_offload_config,
    ]
    print("$ launch_server " + " ".join(good[2:]))
    server_args = prepare_server_args(good)
    server_args.check_server_args()
    config = validate_server_args(server_args)
    print(f"accepted: kv_cache_dtype={server_args.kv_cache_dtype} "
          f"nsa_decode_backend={server_args.nsa_decode_backend} page_size={server_args.page_size}")
    for key, value in vars(config).items():
        print(f"  {key:22s} {value}")

    print("\nrejected combinations:")
    cases = [
        ("--enable-hisparse", ["--disable-radix-cache", "--enable-kv-offload", "--enable-hisparse"]),
        ("radix cache left on", ["--enable-kv-offload"]),
        ("trtllm decode kernel", ["--disable-radix-cache", "--enable-kv-offload", "--nsa-decode-backend", "trtllm"]),
        ("buffer below top-k", ["--disable-radix-cache", "--enable-kv-offload", "--kv-offload-config",
                                '{"sparse_slots_per_req": 1024}']),
        ("unknown key", ["--disable-radix-cache", "--enable-kv-offload", "--kv-offload-config", '{"slots": 1}']),
    ]
    failures = 0
    for label, extra in cases:
        try:
            prepare_server_args(base + extra).check_server_args()
        except KVOffloadConfigError as exc:
            print(f"  {label:22s} -> {exc}")
        else:
            print(f"  {label:22s} -> NOT rejected (bug)")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
