#!/usr/bin/env python3
"""Demo of --enable-kv-offload: the flag through the real ServerArgs, then proof by decoding.

1. Flags (short): the flag is parsed by the patched ``ServerArgs`` with an embedded tiny DeepSeek-V3.2
   config; unsupported combinations are rejected with a message that names the fix.
2. Proof by decoding: ``benchmark/kv_offload/nsa_engine.py`` decodes a seeded workload (arrivals,
   finish, abort, retract, sparse-pool pressure, padded CUDA-graph rows) through the real pools and
   the kv_offload coordinator, next to an all-on-GPU run of the same model, and compares every
   layer's attention output and every token bit for bit. Exits non-zero if anything differs or any
   allocator does not return to its start.

Runs on CPU (Triton kernels in the interpreter) in about a minute and a half; ``--device cuda``
selects DeepSeek-V3.2 KV shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "kv_offload"))

import nsa_engine  # noqa: E402  (path set above; imports no sglang module at import time)

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


def show_flags(kv_offload_config: str) -> int:
    """Parse the flag through the real ServerArgs and show the rejected combinations."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # upstream warns about CUDA-only quantization kernels on CPU
    if not torch.cuda.is_available():
        # ServerArgs reads the GPU's compute capability to pick NSA defaults; answer as an H200 does.
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
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
        kv_offload_config,
    ]
    print("$ launch_server " + " ".join(good[2:]))
    server_args = prepare_server_args(good)
    server_args.check_server_args()
    config = validate_server_args(server_args)
    print(
        f"accepted: kv_cache_dtype={server_args.kv_cache_dtype} "
        f"nsa_decode_backend={server_args.nsa_decode_backend} page_size={server_args.page_size}; "
        + ", ".join(f"{k}={v}" for k, v in vars(config).items())
    )
    cases = [
        (
            "--enable-hisparse",
            ["--disable-radix-cache", "--enable-kv-offload", "--enable-hisparse"],
        ),
        ("radix cache left on", ["--enable-kv-offload"]),
        (
            "trtllm decode kernel",
            ["--disable-radix-cache", "--enable-kv-offload", "--nsa-decode-backend", "trtllm"],
        ),
        (
            "buffer below top-k",
            [
                "--disable-radix-cache",
                "--enable-kv-offload",
                "--kv-offload-config",
                '{"sparse_slots_per_req": 1024}',
            ],
        ),
        (
            "unknown key",
            ["--disable-radix-cache", "--enable-kv-offload", "--kv-offload-config", '{"slots": 1}'],
        ),
    ]
    print("rejected combinations:")
    failures = 0
    for label, extra in cases:
        try:
            prepare_server_args(base + extra).check_server_args()
        except KVOffloadConfigError as exc:
            print(f"  {label:22s} -> {exc}")
        else:
            print(f"  {label:22s} -> NOT rejected (bug)")
            failures += 1
    logging.disable(logging.NOTSET)
    return failures


def run_proof(args: argparse.Namespace) -> int:
    """Run the decode engine with a progress bar and print the summary table."""
    from tqdm import tqdm

    cfg, steps, requests = nsa_engine.config_from_args(args)
    print(
        f"\nproof by decoding: {requests} requests, up to {steps} decode steps, {cfg.kv_dtype} KV, "
        f"{cfg.compute_layers} layers, top-k {cfg.topk}, {cfg.buffer_slots} sparse slots/request, "
        f"{cfg.physical_pages * nsa_engine.PAGE} physical rows (oracle: all KV on the device)"
    )
    bar = tqdm(total=steps, unit="step", desc="decode", leave=True, mininterval=0.5)

    def progress(done: int, engine: nsa_engine.Engine) -> None:
        bar.update(done - bar.n)
        st = engine.stats
        bar.set_postfix(
            running=len(engine.offload.seq), finished=st.finished, identical=st.mismatches == 0
        )

    st = nsa_engine.run_engine(cfg, steps, requests, progress)
    bar.close()
    print(nsa_engine.format_table(st))
    if not st.identical:
        print("FAIL: offload and all-on-GPU outputs differ", file=sys.stderr)
    if not st.leak_free:
        print("FAIL: an allocator did not return to its start", file=sys.stderr)
    return 0 if st.identical and st.leak_free else 1


def main() -> int:
    parser = nsa_engine.build_parser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-offload-config", default='{"sparse_slots_per_req": 4096}')
    parser.add_argument("--flags", action="store_true", help="only the flag demonstration")
    parser.add_argument("--no-flags", action="store_true", help="skip the flag demonstration")
    args = parser.parse_args()
    t0 = time.perf_counter()
    nsa_engine.prepare_environment(args.device)
    failures = 0 if args.no_flags else show_flags(args.kv_offload_config)
    rc = 1 if failures else 0
    if not args.flags:
        rc |= run_proof(args)
    print(f"demo wall time {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
