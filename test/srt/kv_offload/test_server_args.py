"""--enable-kv-offload through the real (patched) ServerArgs, offline, on a tiny DeepSeek-V3.2 config."""

import os
import subprocess
import sys

import pytest
import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfigError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
DSA_MODEL = os.path.join(FIXTURES, "tiny-deepseek-v32")
LLAMA_MODEL = os.path.join(FIXTURES, "tiny-llama")
BASE = ["--device", "cpu", "--attention-backend", "nsa", "--disable-radix-cache"]


@pytest.fixture(autouse=True)
def _hopper_capability(monkeypatch):
    # ServerArgs asks the GPU for its compute capability to pick NSA defaults; answer as an H200 does.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


def make_args(*extra, model=DSA_MODEL):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", model, *BASE, *extra])


def rejected(args) -> str:
    with pytest.raises(KVOffloadConfigError) as info:
        args.check_server_args()
    return str(info.value)


def test_flag_parses_and_validates():
    args = make_args("--enable-kv-offload", "--kv-offload-config", '{"sparse_slots_per_req": 8192}')
    assert args.enable_kv_offload is True
    assert args.kv_offload_config == '{"sparse_slots_per_req": 8192}'
    args.check_server_args()


def test_flag_off_by_default():
    args = make_args()
    assert args.enable_kv_offload is False and args.kv_offload_config is None
    args.check_server_args()


def test_fp8_kv_with_flashmla_kv_is_accepted():
    make_args("--enable-kv-offload", "--kv-cache-dtype", "fp8_e4m3").check_server_args()


def test_config_without_flag():
    msg = rejected(make_args("--kv-offload-config", "{}"))
    assert "without --enable-kv-offload" in msg


def test_not_an_nsa_model():
    msg = rejected(make_args("--enable-kv-offload", model=LLAMA_MODEL))
    assert "LlamaForCausalLM" in msg and "not an NSA/DSA" in msg


def test_attention_backend_not_nsa():
    args = make_args("--enable-kv-offload")
    args.decode_attention_backend = "flashinfer"
    msg = rejected(args)
    assert "--decode-attention-backend is 'flashinfer'" in msg and "nsa" in msg


def test_page_size_not_64():
    args = make_args("--enable-kv-offload")
    args.page_size = 1  # what DSA gets on ROCm
    assert "--page-size 64" in rejected(args)


@pytest.mark.parametrize(
    "flag",
    [
        "--enable-hisparse",
        "--enable-hierarchical-cache",
        "--disaggregation-decode-enable-offload-kvcache",
    ],
)
def test_mutually_exclusive_flags(flag):
    args = make_args("--enable-kv-offload")
    setattr(args, flag[2:].replace("-", "_"), True)
    msg = rejected(args)
    assert f"cannot be combined with {flag}" in msg


def test_hisparse_from_cli_is_rejected():
    msg = rejected(make_args("--enable-kv-offload", "--enable-hisparse"))
    assert "--enable-hisparse" in msg


def test_speculative_decoding():
    args = make_args("--enable-kv-offload")
    args.speculative_algorithm = "EAGLE"
    assert "speculative decoding" in rejected(args)


def test_dp_attention():
    args = make_args("--enable-kv-offload")
    args.enable_dp_attention = True
    assert "--enable-dp-attention" in rejected(args)


def test_prefill_server():
    args = make_args("--enable-kv-offload")
    args.disaggregation_mode = "prefill"
    assert "decode server only" in rejected(args)


def test_direct_to_host_needs_a_decode_server():
    direct = '{"pd_direct_to_host": true}'
    msg = rejected(make_args("--enable-kv-offload", "--kv-offload-config", direct))
    assert "pd_direct_to_host" in msg and "--disaggregation-mode is 'null'" in msg
    args = make_args("--enable-kv-offload", "--kv-offload-config", direct)
    args.disaggregation_mode = "decode"
    args.disaggregation_transfer_backend = "nixl"
    msg = rejected(args)
    assert "--disaggregation-transfer-backend mooncake" in msg and "'nixl'" in msg
    args.disaggregation_transfer_backend = "mooncake"
    args.check_server_args()


def test_radix_cache_on():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        [
            "--model-path",
            DSA_MODEL,
            "--device",
            "cpu",
            "--attention-backend",
            "nsa",
            "--enable-kv-offload",
        ]
    )
    assert "--disable-radix-cache" in rejected(args)


def test_decode_backend_must_read_flat_slots():
    msg = rejected(make_args("--enable-kv-offload", "--nsa-decode-backend", "trtllm"))
    assert "--nsa-decode-backend trtllm" in msg and "fa3 or flashmla_sparse" in msg
    msg = rejected(
        make_args(
            "--enable-kv-offload", "--kv-cache-dtype", "fp8_e4m3", "--nsa-decode-backend", "fa3"
        )
    )
    assert "Use --nsa-decode-backend flashmla_kv" in msg


@pytest.mark.parametrize(
    "config, needle",
    [
        ('{"bogus": 1}', "unknown key(s) ['bogus']"),
        ('{"sparse_slots_per_req": -64}', "positive multiple of 64"),
        ('{"sparse_slots_per_req": 1000}', "multiple of 64"),
        ('{"sparse_slots_per_req": 1024}', "index_topk=2048"),
        ('{"host_pool_ratio": -2}', "must be >= 1"),
    ],
)
def test_bad_config_values(config, needle):
    msg = rejected(make_args("--enable-kv-offload", "--kv-offload-config", config))
    assert needle in msg


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=os.environ
    )


def test_default_path_imports_no_kv_offload_module():
    code = f"""
import sys, torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args({["--model-path", DSA_MODEL, *BASE]!r})
args.check_server_args()
assert args.enable_kv_offload is False
# The patched upstream modules import nothing of kv offload while the flag is off.
import sglang.srt.managers.scheduler, sglang.srt.managers.schedule_batch, sglang.srt.mem_cache.common
import sglang.srt.model_executor.model_runner, sglang.srt.disaggregation.decode
loaded = sorted(m for m in sys.modules if "kv_offload" in m or "nsa_offload" in m)
print("LOADED", loaded)
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LOADED []" in res.stdout


def test_launch_server_help_lists_the_flags():
    res = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--enable-kv-offload" in res.stdout
    assert "--kv-offload-config" in res.stdout
    assert "sparse_slots_per_req" in res.stdout


def _documented_decode_command() -> list:
    """The decode-node command of docs/kv_offload.md ("Launching a PD pair"), as argv."""
    import shlex

    docs = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "kv_offload.md")
    text = open(docs).read()
    start = text.index("# decode node: kv offload on")
    end = text.index("# router", start)
    command = text[start:end].split("\n", 1)[1].replace("\\\n", " ")
    return shlex.split(command)


def test_documented_pd_decode_command_validates():
    argv = _documented_decode_command()
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and "--enable-kv-offload" in argv
    argv = argv[3:]
    # Offline and on CPU: the tiny config stands in for the checkpoint; one rank, no RDMA.
    argv[argv.index("--model-path") + 1] = DSA_MODEL
    for flag in ("--tp", "--disaggregation-ib-device"):
        i = argv.index(flag)
        del argv[i : i + 2]
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args([*argv, "--device", "cpu"])
    assert args.enable_kv_offload and args.disaggregation_mode == "decode"
    assert args.kv_cache_dtype == "fp8_e4m3" and args.nsa_decode_backend == "flashmla_kv"
    args.check_server_args()
