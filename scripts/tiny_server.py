#!/usr/bin/env python3
"""The tiny DeepSeek-V3.2 real server: ``python -m sglang.launch_server`` on a random-weight model.

``python scripts/tiny_server.py [ARGS...]`` writes the tiny model (the real ``DeepseekV32ForCausalLM``
architecture, 2 layers, small dims, a byte-level BPE tokenizer trained here: no hub download) and
execs the real ``python -m sglang.launch_server`` with the tiny-model defaults, then ``ARGS``
unchanged (a later flag wins, so ``ARGS`` can override any default). The process tree is upstream
SGLang's own (tokenizer manager -> scheduler subprocess -> ModelRunner -> NSA backend); only the
binary kernels that cannot be installed here run as test-only torch references
(``test/srt/kv_offload/standins/kv_offload_standins.py`` lists them). ``--print-command`` prints the
command and environment instead of running it (the tests use it). ``--kernels production|standins``
(ours, default ``KV_OFFLOAD_KERNELS`` as ``scripts/gpu_env.sh`` exports it, else ``standins``) picks
the GPU kernels: their stand-ins, or FlashMLA, DeepGEMM and 0.5.23's JIT kernels with the launch
recipes' fp8 KV cache (:data:`PRODUCTION_DEFAULTS`).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
TEST_DIR = ROOT / "test" / "srt" / "kv_offload"
MODEL_CONFIG = TEST_DIR / "fixtures" / "tiny-deepseek-v32" / "config.json"
STANDINS = TEST_DIR / "standins"
CPU_STUBS = TEST_DIR / "cpu_stubs"
GPU_STUBS = TEST_DIR / "gpu_stubs"
DEFAULT_MODEL_DIR = Path(os.environ.get("KV_OFFLOAD_CACHE", Path.home() / ".cache" / "kv-offload"))
TOKENIZER_VOCAB = 512
TOKENIZER_CORPUS_SEED = 0

# What an NSA model needs on this stack: the NSA backend with its sparse decode kernel, bf16 KV
# (``--kv-cache-dtype fp8_e4m3 --dsa-decode-backend flashmla_kv`` selects the fp8 rows; the prefill
# backend follows the KV dtype as upstream resolves it: flashmla_sparse for bf16, flashmla_kv for
# fp8), no grammar backend (no xgrammar wheel). The radix cache is off by default (tests compare
# greedy tokens request by request); ``--tiny-radix-cache`` (ours, not upstream's) leaves it on.
TINY_DEFAULTS = [
    "--attention-backend", "dsa",  # 0.5.23: NSA renamed DSA ("nsa" is a deprecated alias)
    "--dsa-decode-backend", "flashmla_sparse",  # 0.5.23: --nsa-*-backend flags are gone
    "--kv-cache-dtype", "bfloat16",
    "--page-size", "64",
    "--load-format", "dummy",
    "--disable-radix-cache",
    "--grammar-backend", "none",
    "--skip-server-warmup",
    "--mem-fraction-static", "0.5",
]  # fmt: skip
RADIX_FLAG = "--tiny-radix-cache"  # keep upstream's default radix cache on
# The KV formats of the real-server suites and the soak. fp8 is what every recipe of
# docs/kv_offload.md runs (its flags as written: 656 B rows of 512 e4m3 values, 4 fp32 scales and 64
# bf16 rope values, read by FlashMLA's sparse kernel, which upstream then also picks for prefill)
# and the suites' default; bf16 (1152 B rows) where a test is about bf16.
FP8_KV = ["--kv-cache-dtype", "fp8_e4m3", "--dsa-decode-backend", "flashmla_kv"]
BF16_KV = ["--kv-cache-dtype", "bfloat16", "--dsa-decode-backend", "flashmla_sparse"]
FP8_ROW = 656
BF16_ROW = 1152
CPU_DEFAULTS = [
    "--device", "cpu",
    "--max-total-tokens", "16384",
    "--max-running-requests", "8",
    "--context-length", "8192",
]  # fmt: skip
# A CUDA machine without sgl_kernel and flashinfer (the lent GPU box; sglang-kernel cannot travel):
# import placeholders (cpu_stubs/sgl_kernel with every name, gpu_stubs/flashinfer), the G* stand-ins of
# kv_offload_standins.py for its norms, activations, router and MoE, and upstream switches that select
# existing torch/Triton paths instead of them. The same with either kernel set.
GPU_NO_SGL_KERNEL_ENV = {
    "KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES": "1",
    "SGLANG_IS_FLASHINFER_AVAILABLE": "0",  # no flashinfer norm/sampling/top-k paths
    # no DeepGEMM GEMMs or warm-up: the tiny and dsv32-shaped models have bf16 weights (the indexer
    # calls DeepGEMM, or the S4 stand-in, directly)
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",  # sparse MLA prefill, no FA3 MHA
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
}
# ``--kernels standins`` (cpu_stubs/flash_mla, standins/deep_gemm, the S3/S9 stand-ins) also keeps
# 0.5.23's JIT kernels that they would feed off.
GPU_STANDIN_KERNELS_ENV = {
    "SGLANG_OPT_USE_TOPK_V2": "0",  # sgl_kernel DSA top-k (S5 stand-ins), not the JIT top-k v2
    "SGLANG_DISABLE_DSA_INDEXER_FUSION": "1",  # no JIT indexer q/k fusion (taken for non-neox rope)
}
# ``--kernels production`` (``source scripts/gpu_env.sh production``): FlashMLA, DeepGEMM and
# 0.5.23's JIT kernels for real, with every launch recipe's KV cache: fp8 rows of 656 B read by
# FlashMLA's sparse fp8 kernel (flash_mla_with_kvcache) in prefill and decode.
KERNELS = ("standins", "production")
PRODUCTION_DEFAULTS = [
    "--kv-cache-dtype", "fp8_e4m3",
    "--dsa-prefill-backend", "flashmla_kv",
    "--dsa-decode-backend", "flashmla_kv",
]  # fmt: skip
# DeepGEMM's SM90 indexer kernels take 32 or 64 heads (the tiny model has 4); merged under any
# --json-model-override-args of ARGS (theirs win).
PRODUCTION_MODEL_OVERRIDES = {"index_n_heads": 32}
OVERRIDES_FLAG = "--json-model-override-args"


def _corpus() -> List[str]:
    import random

    rng = random.Random(TOKENIZER_CORPUS_SEED)
    words = (
        "the a of to and in is it you that he was for on are with as his they be at one have this "
        "from or had by hot word but what some we can out other were all there when up use your "
        "how said an each she which do their time if will way about many then them write would "
        "like so these her long make thing see him two has look more day could go come did number "
        "sound no most people my over know water than call first who may down side been now find"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]


def write_tiny_model(model_dir: Path) -> Path:
    """Write ``config.json`` and a byte-level BPE tokenizer into ``model_dir`` (idempotent)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(MODEL_CONFIG.read_text())
    stamp = json.dumps([config, TOKENIZER_VOCAB, TOKENIZER_CORPUS_SEED], sort_keys=True)
    if (model_dir / ".stamp").exists() and (model_dir / ".stamp").read_text() == stamp:
        return model_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>"],  # ids 0 and 1: the config's bos/eos
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() <= config["vocab_size"]
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": config["max_position_embeddings"],
            }
        )
    )
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    (model_dir / ".stamp").write_text(stamp)
    return model_dir


def kernels_of(env: Dict[str, str], kernels: Optional[str] = None) -> str:
    """``kernels`` if given, else ``KV_OFFLOAD_KERNELS`` (exported by scripts/gpu_env.sh), else
    ``standins``; raises ``ValueError`` for anything but :data:`KERNELS`."""
    kernels = kernels or env.get("KV_OFFLOAD_KERNELS") or "standins"
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {kernels!r}")
    return kernels


def server_env(
    base: Optional[Dict[str, str]] = None,
    cpu: Optional[bool] = None,
    kernels: Optional[str] = None,
) -> Dict[str, str]:
    """The environment of the server processes: stand-ins on the path and switched on.

    With ``kernels="production"`` (GPU only) the stand-in folders go last on the path, so that the
    real ``flash_mla`` and ``deep_gemm`` that ``scripts/gpu_env.sh production`` put on it are the
    ones imported (:func:`kernel_report` checks that they are)."""
    env = dict(os.environ if base is None else base)
    if cpu is None:
        cpu = not _has_cuda()
    kernels = kernels_of(env, kernels)
    if kernels == "production" and cpu:
        raise ValueError(
            "production kernels need a CUDA machine (source scripts/gpu_env.sh production there)"
        )
    paths = [str(STANDINS)]
    no_kernels = not cpu and _lacks_gpu_kernels(env)
    if no_kernels:
        env.update(GPU_NO_SGL_KERNEL_ENV)
        if kernels == "standins":
            env.update(GPU_STANDIN_KERNELS_ENV)
        paths.append(str(GPU_STUBS))
    if cpu or no_kernels:
        paths.append(str(CPU_STUBS))
    if env.get("PYTHONPATH"):
        if kernels == "production":
            paths.insert(0, env["PYTHONPATH"])
        else:
            paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["KV_OFFLOAD_STANDINS"] = "1"
    env["KV_OFFLOAD_KERNELS"] = kernels
    # Three processes import sglang at start; let them reuse compiled bytecode.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if cpu:
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels (ours and upstream's) on CPU tensors
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # upstream's switch for its CPU code paths
        # Upstream wraps the MoE top-k and the indexer head gates in torch.compile; on 2 CPU cores
        # Inductor's C++ build makes the first forward take a minute. Run them eagerly.
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
        # A CUDA build of torch ships libnccl, and upstream then builds an NCCL communicator for
        # a TP group even on the CPU (and fails: "Expected a cuda device"). A CPU torch has none,
        # which upstream handles by using the gloo group alone; give it the same here.
        env.setdefault("SGLANG_NCCL_SO_PATH", "libnccl-absent-on-a-cpu-server.so")
        # 0.5.23: the sgl-kernel DSA top-k defaults to the DeepSeek-V4 "top-k v2" JIT kernel (nvcc);
        # off, it takes the fused sgl_kernel transforms (S5 stand-ins), as 0.5.10 did.
        env.setdefault("SGLANG_OPT_USE_TOPK_V2", "0")
    return env


def _lacks_gpu_kernels(env: Dict[str, str]) -> bool:
    """True on a CUDA machine without the real sgl_kernel (the stub counts as missing)."""
    if env.get("KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES") == "1":
        return True
    import importlib.util

    return importlib.util.find_spec("sgl_kernel") is None


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def kernel_report(env: Dict[str, str]) -> Dict[str, object]:
    """Which kernels a server with ``env`` runs: the mode and, from a subprocess with that
    environment, each kernel package's version and file (``scripts/env/gpu_bundle.py versions``).
    Raises ``RuntimeError`` when production kernels are asked for and FlashMLA or DeepGEMM is
    missing or a stand-in."""
    import subprocess

    bundle = ROOT / "scripts" / "env" / "gpu_bundle.py"
    proc = subprocess.run(
        [sys.executable, str(bundle), "versions"], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{bundle} versions failed:\n{proc.stderr[-2000:]}")
    packages = json.loads(proc.stdout)
    kernels = kernels_of(env)
    if kernels == "production":
        fake = [
            name
            for name in ("flash_mla", "deep_gemm")
            if "cpustub" in str(packages[name].get("version")) or not packages[name].get("version")
        ]
        if fake:
            raise RuntimeError(
                f"production kernels asked for, but {', '.join(fake)} is missing or a stand-in "
                f"({json.dumps({n: packages[n] for n in fake})}); run "
                "`source scripts/gpu_env.sh production` first"
            )
    return {"kernels": kernels, "packages": packages}


def add_kernels_argument(parser) -> None:
    """The harnesses' ``--kernels`` option (an ``argparse`` parser's)."""
    parser.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="GPU kernels: their torch stand-ins, or FlashMLA, DeepGEMM and 0.5.23's JIT kernels "
        "with the fp8 KV cache (`source scripts/gpu_env.sh production` first); default: "
        "KV_OFFLOAD_KERNELS as gpu_env.sh exported it, else standins",
    )


def merge_model_overrides(args: List[str], overrides: Dict[str, object]) -> List[str]:
    """``args`` with ``overrides`` under the last ``--json-model-override-args`` (its keys win), or
    with that flag added."""
    args = list(args)
    if OVERRIDES_FLAG not in args:
        return args + [OVERRIDES_FLAG, json.dumps(overrides)]
    i = len(args) - 1 - args[::-1].index(OVERRIDES_FLAG)
    args[i + 1] = json.dumps({**overrides, **json.loads(args[i + 1])})
    return args


def build_command(
    args: List[str],
    model_dir: Optional[Path] = None,
    cpu: Optional[bool] = None,
    kernels: Optional[str] = None,
) -> Tuple[List[str], Dict[str, str]]:
    """``python -m sglang.launch_server`` with the tiny model, the defaults (with production
    kernels, :data:`PRODUCTION_DEFAULTS` after them) and then ``args``."""
    if cpu is None:
        cpu = not _has_cuda()
    env = server_env(cpu=cpu, kernels=kernels)
    model = write_tiny_model(model_dir or DEFAULT_MODEL_DIR / "tiny-deepseek-v32")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model)]
    defaults = TINY_DEFAULTS
    if RADIX_FLAG in args:
        args = [a for a in args if a != RADIX_FLAG]
        defaults = [a for a in TINY_DEFAULTS if a != "--disable-radix-cache"]
    if env["KV_OFFLOAD_KERNELS"] == "production":
        defaults = defaults + PRODUCTION_DEFAULTS
        args = merge_model_overrides(args, PRODUCTION_MODEL_OVERRIDES)
    cmd += defaults + (CPU_DEFAULTS if cpu else []) + list(args)
    return cmd, env


def main(argv: List[str]) -> None:
    print_only = "--print-command" in argv
    args = [a for a in argv if a != "--print-command"]
    kernels = None
    if "--kernels" in args:  # ours, not upstream's: production | standins
        i = args.index("--kernels")
        kernels = args[i + 1] if i + 1 < len(args) else ""
        args = args[:i] + args[i + 2 :]
    cmd, env = build_command(args, kernels=kernels)
    if print_only:
        print(shlex.join(cmd))
        return
    print("[tiny_server] " + shlex.join(cmd), flush=True)
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main(sys.argv[1:])
