"""--enable-kv-offload through the real (patched) ServerArgs, offline, on a tiny DeepSeek-V3.2 config."""

import dataclasses
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfigError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
DSA_MODEL = os.path.join(FIXTURES, "tiny-deepseek-v32")
LLAMA_MODEL = os.path.join(FIXTURES, "tiny-llama")
BASE = ["--device", "cpu", "--attention-backend", "nsa", "--disable-radix-cache"]


@pytest.fixture(autouse=True)
def _hopper_capability(monkeypatch):
    # Resolution asks the GPU for its compute capability to pick DSA defaults; answer as an H200.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


def parse(*extra, model=DSA_MODEL, base=BASE):
    """ServerArgs as the CLI gives them, resolved (model defaults, backends) as at launch."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", model, *base, *extra])
    args.resolve_once()
    return args


def make_args(*extra, model=DSA_MODEL):
    return parse(*extra, model=model)


def rejected(args) -> str:
    with pytest.raises(KVOffloadConfigError) as info:
        args.check_server_args()
    return str(info.value)


def resolved(args, **fields):
    """``args`` with ``fields`` resolved to these values (as a model override or another
    resolution step would declare them), for cases the CLI cannot reach on this machine."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(args, "test", **fields)
    return args


def test_flag_parses_and_validates():
    from sglang.srt.mem_cache.sparsity.kv_offload.config import (
        KVOffloadConfig,
        validate_server_args,
    )

    args = make_args("--enable-kv-offload", "--kv-offload-config", '{"sparse_slots_per_req": 8192}')
    assert args.enable_kv_offload is True
    assert args.kv_offload_config == '{"sparse_slots_per_req": 8192}'
    args.check_server_args()
    assert validate_server_args(args) == KVOffloadConfig(sparse_slots_per_req=8192)


def test_flag_off_by_default(monkeypatch):
    import sglang.srt.mem_cache.sparsity.kv_offload.config as kv_offload_config

    def must_not_run(server_args):
        raise AssertionError("kv offload validation ran with the flag off")

    monkeypatch.setattr(kv_offload_config, "validate_server_args", must_not_run)
    args = make_args("--page-size", "32")  # rejected with the flag on (test_page_size_not_64)
    assert args.enable_kv_offload is False and args.kv_offload_config is None
    args.check_server_args()
    # The same settings with the flag on do reach the (patched-out) validation.
    with pytest.raises(AssertionError, match="ran with the flag off"):
        make_args("--page-size", "32", "--enable-kv-offload").check_server_args()


def test_fp8_kv_with_flashmla_kv_is_accepted():
    from sglang.srt.arg_groups.overrides import resolved_view

    args = make_args("--enable-kv-offload", "--kv-cache-dtype", "fp8_e4m3")
    # Resolution picks flashmla_kv for fp8 KV on SM90 when no decode backend is given.
    view = resolved_view(args)
    assert view.kv_cache_dtype == "fp8_e4m3" and view.dsa_decode_backend == "flashmla_kv"
    args.check_server_args()


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp", "2", "--attn-dp-size", "2"],
        ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"],  # the deprecated spelling
    ],
)
def test_attention_dp_is_accepted(argv):
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.mem_cache.sparsity.kv_offload.config import validate_server_args

    args = make_args("--enable-kv-offload", *argv)
    assert resolved_view(args).attn_dp_size == 2
    args.check_server_args()
    validate_server_args(args)


def test_default_bf16_backends_are_accepted():
    from sglang.srt.arg_groups.overrides import resolved_view

    args = parse("--enable-kv-offload", base=["--device", "cpu", "--disable-radix-cache"])
    args = resolved(args, attention_backend="dsa")  # what a CUDA device resolves to
    assert resolved_view(args).dsa_decode_backend == "fa3"  # SM90 bf16 default
    args.check_server_args()


def test_config_without_flag():
    msg = rejected(make_args("--kv-offload-config", "{}"))
    assert "without --enable-kv-offload" in msg


def test_not_a_dsa_model():
    msg = rejected(make_args("--enable-kv-offload", model=LLAMA_MODEL))
    assert "LlamaForCausalLM" in msg and "not a DSA" in msg


def test_attention_backend_not_dsa():
    msg = rejected(make_args("--enable-kv-offload", "--decode-attention-backend", "flashinfer"))
    assert "--decode-attention-backend is 'flashinfer'" in msg and "dsa" in msg


def test_page_size_given_other_than_64_is_rejected():
    # Resolution sets every DSA model's page size to 64 whatever --page-size says: the flag as
    # given is checked.
    message = rejected(make_args("--enable-kv-offload", "--page-size", "32"))
    assert "--page-size is 32" in message and "Use --page-size 64" in message
    make_args("--enable-kv-offload", "--page-size", "64").check_server_args()


def test_page_size_resolved_other_than_64_is_rejected():
    args = resolved(make_args("--enable-kv-offload"), page_size=1)  # what DSA gets on ROCm
    assert "--page-size 64" in rejected(args)


@pytest.mark.parametrize(
    "flag",
    # --enable-hisparse: test_hisparse_from_cli_is_rejected (upstream's HiSparse checks run first).
    ["--enable-hierarchical-cache", "--disaggregation-decode-enable-offload-kvcache"],
)
def test_mutually_exclusive_flags(flag):
    args = resolved(make_args("--enable-kv-offload"), **{flag[2:].replace("-", "_"): True})
    assert f"cannot be combined with {flag}" in rejected(args)


def test_hisparse_from_cli_is_rejected():
    msg = rejected(make_args("--enable-kv-offload", "--enable-hisparse"))
    assert "--enable-hisparse" in msg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pp-size", "2"], "--pp-size 2"),
        (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
        (["--disaggregation-mode", "prefill"], "decode server only"),
        (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
        (["--tp", "2", "--dcp-size", "2"], "--dcp-size 2"),
        (["--enable-streaming-session"], "--enable-streaming-session"),
        (["--dsa-prefill-backend", "flashmla_sparse_q8"], "flashmla_sparse_q8"),
    ],
)
def test_unsupported_launches_are_rejected(argv, needle):
    assert needle in rejected(make_args("--enable-kv-offload", *argv))


def test_other_speculative_algorithms_are_rejected():
    # Upstream's own checks of NGRAM / STANDALONE need CUDA here; resolve the field directly.
    args = resolved(make_args("--enable-kv-offload"), speculative_algorithm="NGRAM")
    assert "--speculative-algorithm NGRAM is not supported" in rejected(args)


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN"])
def test_mtp_chain_draft_is_accepted(algorithm):
    spec = ["--speculative-algorithm", algorithm, "--speculative-num-steps", "3"]
    spec += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    make_args("--enable-kv-offload", *spec).check_server_args()


@pytest.mark.parametrize(
    "field",
    ["enable_prefill_cp", "enable_kv_cache_sharding", "enable_unified_memory"],
)
def test_unsupported_resolved_features_are_rejected(field):
    flag = "--" + field.replace("_", "-")
    assert flag in rejected(resolved(make_args("--enable-kv-offload"), **{field: True}))


def test_unpinned_host_memory_on_cuda():
    config = '{"pin_host_memory": false}'
    args = resolved(make_args("--enable-kv-offload", "--kv-offload-config", config), device="cuda")
    assert "pin_host_memory=false on CUDA" in rejected(args)
    # The CPU server has nothing to pin for.
    make_args("--enable-kv-offload", "--kv-offload-config", config).check_server_args()


def test_direct_to_host_needs_a_decode_server():
    direct = ["--enable-kv-offload", "--kv-offload-config", '{"pd_direct_to_host": true}']
    msg = rejected(make_args(*direct))
    assert "pd_direct_to_host" in msg and "--disaggregation-mode is 'null'" in msg
    decode = [*direct, "--disaggregation-mode", "decode"]
    msg = rejected(make_args(*decode, "--disaggregation-transfer-backend", "nixl"))
    assert "--disaggregation-transfer-backend mooncake" in msg and "'nixl'" in msg
    make_args(*decode, "--disaggregation-transfer-backend", "mooncake").check_server_args()


def test_decode_host_receive_path_is_rejected():
    args = make_args(
        "--enable-kv-offload",
        "--disaggregation-mode",
        "decode",
        "--disaggregation-decode-host-receive-threshold",
        "0.5",
    )
    assert "--disaggregation-decode-host-receive-threshold" in rejected(args)


def test_radix_cache_on_is_accepted_also_on_a_pd_decode_server():
    from sglang.srt.mem_cache.sparsity.kv_offload.config import validate_server_args

    args = parse("--enable-kv-offload", base=["--device", "cpu", "--attention-backend", "nsa"])
    assert not args.disable_radix_cache
    validate_server_args(args)
    args = make_args(
        "--enable-kv-offload",
        "--disaggregation-mode",
        "decode",
        "--disaggregation-decode-enable-radix-cache",
    )
    validate_server_args(args)


@pytest.mark.parametrize(
    "dtype, backend, needle",
    [
        ("bfloat16", "trtllm", "Use --dsa-decode-backend fa3 or flashmla_sparse"),
        ("bfloat16", "flashmla_kv", "Use --dsa-decode-backend fa3 or flashmla_sparse"),
        ("fp8_e4m3", "fa3", "Use --dsa-decode-backend flashmla_kv"),
        ("fp8_e4m3", "flashmla_sparse", "Use --dsa-decode-backend flashmla_kv"),
        ("fp8_e4m3", "flashmla_auto", "Use --dsa-decode-backend flashmla_kv"),
        ("fp8_e4m3", "trtllm", "Use --dsa-decode-backend flashmla_kv"),
    ],
)
def test_decode_backend_must_read_flat_slots(dtype, backend, needle):
    msg = rejected(
        make_args("--enable-kv-offload", "--kv-cache-dtype", dtype, "--dsa-decode-backend", backend)
    )
    assert f"--dsa-decode-backend {backend} is not supported with --kv-cache-dtype {dtype}" in msg
    assert needle in msg


@pytest.mark.parametrize("backend", ["flashmla_sparse", "triton_sparse_mla", "flashmla_auto"])
def test_fp8_prefill_backend_must_read_physical_rows(backend):
    """Seen on the CPU real server: fp8 with --dsa-prefill-backend flashmla_sparse and the flag
    gives other tokens than without it (a chunked prompt's earlier chunks are read by logical
    token from the physical rows); the flashmla_kv prefill gives the same tokens."""
    msg = rejected(
        make_args(
            "--enable-kv-offload", "--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", backend
        )
    )
    assert f"--dsa-prefill-backend {backend} with --kv-cache-dtype fp8_e4m3" in msg
    assert "Use --dsa-prefill-backend flashmla_kv" in msg
    # The bf16 cache's sparse prefill reads rows through the translated page table: accepted.
    make_args("--enable-kv-offload", "--dsa-prefill-backend", "flashmla_sparse").check_server_args()


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "mxfp8"])
def test_kv_dtype_without_a_row_layout_is_refused(dtype):
    """Upstream resolves a DSA model's KV dtype to fp8_e4m3 or bfloat16 on CUDA (and asserts that
    it did); a platform whose resolution keeps another dtype must not reach the host pool."""
    args = resolved(make_args("--enable-kv-offload"), kv_cache_dtype=dtype)
    msg = rejected(args)
    assert f"--kv-cache-dtype {dtype} is not supported" in msg
    assert (
        "Use --kv-cache-dtype fp8_e4m3 (with --dsa-decode-backend flashmla_kv) or bfloat16 "
        "(with --dsa-decode-backend fa3 or flashmla_sparse)"
    ) in msg


def test_kv_dtype_upstream_refuses_for_dsa_stays_refused():
    with pytest.raises(
        AssertionError, match="DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3"
    ):
        make_args("--enable-kv-offload", "--kv-cache-dtype", "fp8_e5m2")


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
    """Flag off: no kv offload module is importable, yet the patched upstream paths run as upstream's.

    A meta-path finder refuses every kv offload import, so a flag-off path that reached one would
    fail; upstream's release_kv_cache (patched by 0003) must still hand the request to the tree
    cache and free its req_to_token row. With the flag turned on the same call must reach kv
    offload (an import or the allocator's ``kv_offload``), which shows the finder and stand-ins
    would catch it.
    """
    code = f"""
import sys, torch

BLOCKED = ("sglang.srt.mem_cache.sparsity.kv_offload", "sglang.srt.layers.attention.dsa_offload")
attempts = []


class RefuseKVOffload:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            attempts.append(name)
            raise ImportError("kv offload imported on the flag-off path: " + name)
        return None


sys.meta_path.insert(0, RefuseKVOffload())
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import prepare_server_args

argv = {["--model-path", DSA_MODEL, *BASE]!r}
args = prepare_server_args(argv)
args.resolve_once()
args.check_server_args()
assert args.enable_kv_offload is False
# The patched upstream modules import nothing of kv offload while the flag is off.
import sglang.srt.managers.scheduler, sglang.srt.managers.schedule_batch, sglang.srt.mem_cache.common
import sglang.srt.model_executor.model_runner, sglang.srt.disaggregation.decode
import sglang.srt.mem_cache.kv_cache_configurator
from sglang.srt.mem_cache.common import release_kv_cache

publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
touched = []


class Recorder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        touched.append(self._name + "." + attr)
        return Recorder(self._name + "." + attr)

    def __call__(self, *a, **k):
        touched.append(self._name + "()")
        return None


class KV:
    holds_kv, is_kv_released, holds_mamba = True, False, False
    req_pool_idx, kv_allocated_len, kv_committed_len, cache_protected_len = 3, 100, 100, 0

    def mark_kv_released(self):
        self.holds_kv, self.is_kv_released = False, True


class Req:
    rid, lock, skip_radix_cache_insert, finished_len = "r", None, False, None

    def __init__(self):
        self.kv = KV()

    def owned_kv_len(self):
        return self.kv.kv_committed_len


class ReqToTokenPool:
    def __init__(self):
        self.freed = []

    def free(self, req):
        self.freed.append(req)


class Allocator:
    page_size = 64

    def __init__(self):
        self.kv_offload = Recorder("allocator.kv_offload")


class Tree:
    def __init__(self):
        self.rows = []
        self.req_to_token_pool = ReqToTokenPool()
        self.token_to_kv_pool_allocator = Allocator()

    def supports_mamba(self):
        return False

    def claim_kv_row(self, req):
        return False

    def free_kv_row(self, kv, segments):
        self.rows.append((kv, segments))

    def unlock(self, lock):
        pass

    def on_release(self, req, checkpointed):
        pass


req, tree = Req(), Tree()
release_kv_cache(req, tree, checkpoint=False)
assert tree.rows == [(req.kv, [(0, 100)])] and tree.req_to_token_pool.freed == [req]
assert req.kv.is_kv_released
assert touched == [] and attempts == [], (touched, attempts)
loaded = sorted(m for m in sys.modules if "kv_offload" in m or "dsa_offload" in m)
print("LOADED", loaded)

# Control: the same call with the flag on does reach kv offload.
on = prepare_server_args(argv + ["--enable-kv-offload"])
on.resolve_once()
reset_context()
publish(on, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
try:
    release_kv_cache(Req(), Tree(), checkpoint=False)
    outcome = "returned"
except Exception as exc:
    outcome = type(exc).__name__
print("FLAG-ON", outcome, bool(attempts), bool(touched))
assert attempts or touched, outcome
"""
    res = _run(code)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "LOADED []" in res.stdout
    assert "FLAG-ON" in res.stdout


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_GUARD = re.compile(r"^\s*(if|elif)\b")
_REFERENCE = re.compile(r"\.kv_offload\b(?!_config)")
# Patch 0001 declares the flags themselves: the memory namespace's fields.
_FLAG_DECLARATIONS = re.compile(r"^\s*\w*kv_offload\w*\s*:")


def _patch_hunks(text: str):
    """(file, hunk lines with their ' '/'+'/'-' tag) for each hunk of a git patch."""
    lines, i, path = text.splitlines(), 0, None
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("+++ "):
            path = line[4:].removeprefix("b/")
            continue
        m = _HUNK.match(line)
        if not m or path is None:
            continue
        old, new, body = int(m.group(1) or 1), int(m.group(2) or 1), []
        while (old > 0 or new > 0) and i < len(lines):
            line = lines[i] or " "
            i += 1
            if line.startswith("\\"):
                continue
            body.append(line)
            old -= line[0] in " -"
            new -= line[0] in " +"
        yield path, body


def _indent(code: str) -> int:
    return len(code) - len(code.lstrip())


def _code(code: str) -> str:
    """The line without a comment; '' for comment lines and string-literal (help text) lines."""
    stripped = code.strip()
    if stripped.startswith(("#", '"', "'", 'f"', "f'", "help=")):
        return ""
    return re.sub(r"\s+#.*$", "", code)


def _is_guard(statement: str) -> bool:
    return (
        bool(_GUARD.match(statement))
        and "enable_kv_offload" in statement
        and not re.search(r"\bnot\s+[\w.()]*enable_kv_offload", statement)
    )


def _guarded(body, k: int) -> bool:
    """Is added line ``k`` inside an ``if``/``elif`` block that tests enable_kv_offload?"""
    line = body[k][1:]
    if _is_guard(line):  # e.g. `if self.enable_kv_offload or self.kv_offload_config ...:`
        return True
    indent = _indent(line)
    for j in range(k - 1, -1, -1):
        if body[j][0] == "-":
            continue  # not in the patched file
        prev = body[j][1:]
        if not prev.strip() or prev.strip().startswith("#") or _indent(prev) >= indent:
            continue
        statement, level = prev, _indent(prev)
        if prev.strip().startswith((")", "]")):  # a multi-line condition: join it back to its start
            for jj in range(j - 1, -1, -1):
                if body[jj][0] != "-":
                    statement = body[jj][1:] + " " + statement
                    if body[jj][1:].strip() and _indent(body[jj][1:]) == level:
                        break
        if _is_guard(statement):
            return True
        indent = level
    return False


def unguarded_kv_offload_lines(patch_text: str):
    """(added kv offload references, those outside an enable_kv_offload block) of one patch."""
    references, unguarded = [], []
    for path, body in _patch_hunks(patch_text):
        for k, line in enumerate(body):
            if line[0] != "+":
                continue
            code = _code(line[1:])
            # A reference: the kv offload package or the allocator's ``kv_offload`` hook object
            # (not a name that merely contains the words, such as a contributor method's).
            if not _REFERENCE.search(code):
                continue
            if path.endswith("arg_groups/fields/memory.py") and _FLAG_DECLARATIONS.match(code):
                continue
            references.append((path, line))
            if not _guarded(body, k):
                unguarded.append((path, line))
    return references, unguarded


def test_every_patched_kv_offload_reference_is_behind_the_flag():
    patches = sorted(glob.glob(os.path.join(ROOT, "patches", "*.patch")))
    assert patches
    total = 0
    for name in patches:
        references, unguarded = unguarded_kv_offload_lines(open(name).read())
        where = os.path.basename(name)
        assert unguarded == [], f"{where}: not behind enable_kv_offload: {unguarded}"
        total += len(references)
    assert total >= len(patches)  # every patch hooks kv offload somewhere


def test_flag_guard_check_finds_unguarded_references():
    bad = textwrap.dedent("""\
        diff --git a/python/x.py b/python/x.py
        --- a/python/x.py
        +++ b/python/x.py
        @@ -1,3 +1,17 @@
         def f(args, alloc):
        +    if args.enable_kv_offload:
        +        alloc.kv_offload.guarded()
        +    else:
        +        alloc.kv_offload.in_else()
        +    alloc.kv_offload.after_the_block()
        +    from sglang.srt.mem_cache.sparsity.kv_offload import runtime  # unguarded
        +    if not args.enable_kv_offload:
        +        alloc.kv_offload.negated()
        +    if (
        +        args.enable_kv_offload
        +        and alloc is not None
        +    ):
        +        alloc.kv_offload.multi_line_guard()
        +    # kv_offload in a comment is fine
             x = 1
             return x
        """)
    references, unguarded = unguarded_kv_offload_lines(bad)
    assert len(references) == 6
    assert [line.split("kv_offload")[1][:12] for _, line in unguarded] == [
        ".in_else()",
        ".after_the_b",
        " import runt",
        ".negated()",
    ]


def test_launch_server_help_lists_the_flags():
    """In the project's environment as installed: no import stand-ins on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--enable-kv-offload" in res.stdout
    assert "--kv-offload-config" in res.stdout
    from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig

    help_text = " ".join(res.stdout.split())  # argparse wraps lines
    missing = [f.name for f in dataclasses.fields(KVOffloadConfig) if f.name not in help_text]
    assert not missing, f"--kv-offload-config help does not list {missing}"


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
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    view = resolved_view(args)
    assert view.enable_kv_offload and view.disaggregation_mode == "decode"
    assert view.kv_cache_dtype == "fp8_e4m3" and view.dsa_decode_backend == "flashmla_kv"
    args.check_server_args()


@pytest.mark.parametrize(
    "heading, attn_dp_size",
    [
        ("**Launch (co-located, one node, TP8):**", 1),
        ("**Launch (co-located, one node, TP8 with attention DP 8):**", 8),
        ("**Launch (co-located, one node, TP8, MTP):**", 1),
    ],
)
def test_documented_colocated_commands_validate(heading, attn_dp_size):
    """The co-located launches of docs/kv_offload.md ("Deployer's guide") pass the real checks."""
    import shlex

    docs = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "kv_offload.md")
    text = open(docs).read()
    start = text.index(heading)
    block = text[text.index("```", start) + 3 : text.index("```", text.index("```", start) + 3)]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and "--enable-kv-offload" in argv
    argv = argv[3:]
    argv[argv.index("--model-path") + 1] = DSA_MODEL  # offline: the tiny config
    i = argv.index("--tp")
    argv[i + 1] = str(attn_dp_size)  # one rank per attention-DP group, as documented
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    view = resolved_view(args)
    assert view.enable_kv_offload and view.disaggregation_mode == "null"
    assert view.attn_dp_size == attn_dp_size
    assert view.kv_cache_dtype == "fp8_e4m3" and view.dsa_decode_backend == "flashmla_kv"
    args.check_server_args()
