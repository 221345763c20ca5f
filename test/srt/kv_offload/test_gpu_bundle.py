"""The production-kernel bundle for the GPU machine and the harnesses' ``--kernels`` switch, on the CPU.

The bundle itself (about 40 MiB fetched from PyPI and a DeepGEMM git clone) is not fetched here:
CI checks the logic that builds, verifies and installs it, on small synthetic inputs, plus what
can be read off the pinned sglang wheel the tree is built from (what trimming drops). The GPU
machine runs ``gpu_bundle.py check`` on the real one (``source scripts/gpu_env.sh``).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "env"))
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402
import kv_offload_tree  # noqa: E402
import tiny_server  # noqa: E402

BASE = kv_offload_tree.Base("pkg", "1.0", "pkg-1.0-py3-none-any.whl", "")


def record_line(name: str, data: bytes) -> list:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def write_wheel(path: Path, members: dict) -> kv_offload_tree.Base:
    """A wheel of ``members`` with its RECORD (CSV, as pip writes it); its Base."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for name, data in members.items():
        writer.writerow(record_line(name, data))
    writer.writerow(["pkg-1.0.dist-info/RECORD", "", ""])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/RECORD", out.getvalue())
    return kv_offload_tree.Base(
        BASE.name, BASE.version, path.name, kv_offload_tree.sha256_file(path)
    )


MEMBERS = {
    "pkg/__init__.py": b"x = 1\n",
    "pkg/configs/world=16,H=7168.json": b"{}",  # a comma: RECORD quotes the path
    "pkg/ext/_server.cpython-311-x86_64-linux-gnu.so": b"\0ELF",
}


# ------------------------------------------------------------------------------------------------
# the trimmed sglang wheel (kv_offload_tree.write_trimmed_base / verify_trimmed_base)
# ------------------------------------------------------------------------------------------------
def test_trimmed_wheel_keeps_verified_members_only(tmp_path, monkeypatch):
    base = write_wheel(tmp_path / BASE.wheel, MEMBERS)
    out = tmp_path / "cache" / "pkg-1.0-py3-none-any.trimmed.zip"
    out.parent.mkdir()
    dropped = kv_offload_tree.write_trimmed_base(tmp_path / base.wheel, base, ("pkg/ext/_",), out)
    assert dropped == ["pkg/ext/_server.cpython-311-x86_64-linux-gnu.so"]
    kv_offload_tree.verify_trimmed_base(out, base)
    with zipfile.ZipFile(out) as zf:
        assert "pkg/configs/world=16,H=7168.json" in zf.namelist()
        assert not any(n.startswith("pkg/ext/") for n in zf.namelist())
    # Where only the trimmed copy was carried, the tree tool builds from it.
    monkeypatch.setattr(kv_offload_tree, "CACHE", out.parent)
    assert kv_offload_tree.fetch_wheel(base) == out


def test_trimmed_wheel_with_other_bytes_or_from_another_wheel_is_refused(tmp_path):
    base = write_wheel(tmp_path / BASE.wheel, MEMBERS)
    out = tmp_path / "trimmed.zip"
    kv_offload_tree.write_trimmed_base(tmp_path / base.wheel, base, ("pkg/ext/_",), out)
    with zipfile.ZipFile(out) as src, zipfile.ZipFile(tmp_path / "t.zip", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"x = 2\n" if info.filename == "pkg/__init__.py" else data)
    (tmp_path / "t.zip").replace(out)
    with pytest.raises(kv_offload_tree.TreeError, match="pkg/__init__.py differs"):
        kv_offload_tree.verify_trimmed_base(out, base)
    other = kv_offload_tree.Base(base.name, base.version, base.wheel, "0" * 64)
    with pytest.raises(kv_offload_tree.TreeError, match="not from patches/base"):
        kv_offload_tree.verify_trimmed_base(out, other)
    Path(f"{out}.json").unlink()
    with pytest.raises(kv_offload_tree.TreeError, match="no trimmed.zip.json"):
        kv_offload_tree.verify_trimmed_base(out, base)


def test_trimming_drops_only_what_the_server_never_imports():
    """On the pinned sglang wheel: the four cp311 Rust extension modules and multimodal_gen go,
    their package stays, no patched file goes, and nothing under sglang/srt imports
    multimodal_gen."""
    base = kv_offload_tree.read_base()
    with zipfile.ZipFile(kv_offload_tree.fetch_wheel(base)) as zf:
        names = zf.namelist()
    dropped = [n for n in names if n.startswith(gpu_bundle.SGLANG_DROP)]
    so = sorted(n for n in dropped if n.endswith(".so"))
    assert [Path(n).name.split(".")[0] for n in so] == ["_bench", "_grpc", "_multimodal", "_server"]
    assert all(n.startswith("sglang/multimodal_gen/") for n in set(dropped) - set(so))
    assert "sglang/srt/rust_extensions/__init__.py" in names
    assert "sglang/srt/rust_extensions/__init__.py" not in dropped
    patched = set()
    for patch in (ROOT / "patches").glob("*.patch"):
        patched |= set(re.findall(r"^\+\+\+ b/python/(\S+)", patch.read_text(), re.M))
    assert patched and not patched & set(dropped)
    srt = ROOT / "build" / "sglang" / "python" / "sglang" / "srt"
    importers = [
        str(p)
        for p in srt.rglob("*.py")
        if re.search(r"^\s*(from|import) sglang\.multimodal_gen", p.read_text(), re.M)
    ]
    assert not importers


# ------------------------------------------------------------------------------------------------
# the DeepGEMM source tarball and the bundle check
# ------------------------------------------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture()
def deepgemm_clone(tmp_path, monkeypatch):
    """A clone-like repository with DeepGEMM's layout; its commit becomes the pin."""
    repo = tmp_path / "DeepGEMM"
    for name, text in {
        "LICENSE": "MIT\n",
        "csrc/python_api.cpp": "// api\n",
        "deep_gemm/__init__.py": "__version__ = '2.6.1'\n",
        "deep_gemm/include/deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh": "// kernel\n",
        "tests/test_attention.py": "# not bundled\n",
    }.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "DeepGEMM")
    monkeypatch.setattr(gpu_bundle, "DEEPGEMM_COMMIT", git(repo, "rev-parse", "HEAD").strip())
    headers = tmp_path / gpu_bundle.SGL_DEEP_GEMM.filename
    with zipfile.ZipFile(headers, "w") as zf:
        zf.writestr("deep_gemm/include/cute/tensor.hpp", "// cute\n")
        zf.writestr("deep_gemm/include/cutlass/cutlass.h", "// cutlass\n")
        zf.writestr("deep_gemm/_C.so", "\0ELF")  # built for another torch: not bundled
    sha = kv_offload_tree.sha256_file(headers)
    monkeypatch.setattr(gpu_bundle, "SGL_DEEP_GEMM", gpu_bundle.PinnedWheel(headers.name, sha))
    return repo, headers


def test_deepgemm_tarball_holds_the_sources_and_the_headers(tmp_path, deepgemm_clone):
    repo, headers = deepgemm_clone
    out = tmp_path / "deep_gemm-src.tar.gz"
    manifest = gpu_bundle.write_deepgemm_tarball(repo / ".git", headers, out)
    with tarfile.open(out) as tar:
        names = sorted(tar.getnames())
    assert names == [
        "LICENSE",
        "csrc/python_api.cpp",
        "deep_gemm/__init__.py",
        "deep_gemm/include/cute/tensor.hpp",
        "deep_gemm/include/cutlass/cutlass.h",
        "deep_gemm/include/deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh",
    ]
    assert manifest["files"] == len(names)
    assert manifest["deepgemm"]["commit"] == gpu_bundle.DEEPGEMM_COMMIT
    assert json.loads(Path(f"{out}.json").read_text())["sha256"] == kv_offload_tree.sha256_file(out)
    assert gpu_bundle._check_deepgemm(out) == []
    out.write_bytes(out.read_bytes() + b"\0")
    assert gpu_bundle._check_deepgemm(out) == [f"{out}: sha256 differs from its manifest"]


def test_deepgemm_tarball_needs_the_pinned_commit(tmp_path, deepgemm_clone, monkeypatch):
    repo, headers = deepgemm_clone
    monkeypatch.setattr(gpu_bundle, "DEEPGEMM_COMMIT", "1" * 40)
    with pytest.raises(gpu_bundle.BundleError, match="DEEPGEMM_GIT"):
        gpu_bundle.write_deepgemm_tarball(repo / ".git", headers, tmp_path / "dg.tar.gz")


@pytest.fixture()
def bundle_root(tmp_path, monkeypatch, deepgemm_clone):
    """A repo root whose .whl and .gpu hold a complete bundle of synthetic pinned parts."""
    repo, headers = deepgemm_clone
    root = tmp_path / "root"
    (root / "scripts" / "env").mkdir(parents=True)
    (root / "scripts" / "env" / "gpu-wheels.txt").write_text(
        "# test pins\nfoo-bar==1.0\nsgl-flash-mla==1.0.0\n"
    )
    (root / ".whl").mkdir()
    (root / ".whl" / "foo_bar-1.0-py3-none-any.whl").write_bytes(b"foo")
    flash = root / ".whl" / gpu_bundle.FLASH_MLA.filename
    flash.write_bytes(b"flash")
    monkeypatch.setattr(
        gpu_bundle,
        "FLASH_MLA",
        gpu_bundle.PinnedWheel(flash.name, kv_offload_tree.sha256_file(flash)),
    )
    (root / ".gpu" / "cache").mkdir(parents=True)
    gpu_bundle.write_deepgemm_tarball(repo / ".git", headers, root / gpu_bundle.DEEPGEMM_TARBALL)
    base = write_wheel(tmp_path / BASE.wheel, MEMBERS)
    monkeypatch.setattr(kv_offload_tree, "read_base", lambda: base)
    trimmed = gpu_bundle.trimmed_sglang(root)
    kv_offload_tree.write_trimmed_base(tmp_path / base.wheel, base, ("pkg/ext/_",), trimmed)
    (root / gpu_bundle.HISPARSE_DIR).mkdir(parents=True)
    (root / gpu_bundle.HISPARSE_DIR / "SOURCE").write_text("sglang-0.5.23\n")
    return root


def test_bundle_check_passes_a_complete_bundle_and_counts_the_carry(bundle_root):
    report = gpu_bundle.check_bundle(bundle_root, tree=1000)
    sizes = report["bytes"]
    assert sizes["tree"] == 1000 and sizes[".whl"] == len(b"foo") + len(b"flash")
    assert sizes[".gpu"] == sum(
        f.stat().st_size for f in (bundle_root / ".gpu").rglob("*") if f.is_file()
    )


def test_bundle_check_names_each_missing_or_stale_part(bundle_root, monkeypatch):
    (bundle_root / ".whl" / "foo_bar-0.9-py3-none-any.whl").write_bytes(b"old")
    (bundle_root / gpu_bundle.DEEPGEMM_TARBALL).unlink()
    (bundle_root / ".whl" / gpu_bundle.FLASH_MLA.filename).write_bytes(b"other")
    monkeypatch.setattr(gpu_bundle, "CARRY_LIMIT_BYTES", 1000)
    with pytest.raises(gpu_bundle.BundleError) as err:
        gpu_bundle.check_bundle(bundle_root, tree=0)
    msg = str(err.value)
    assert "fetch_gpu_wheels.sh" in msg
    assert "foo_bar==1.0 expected once, found ['0.9', '1.0']" in msg
    assert "deep_gemm-src.tar.gz (+ .json) missing" in msg
    assert "sha256 is not the pinned" in msg
    assert "exceeds the 0 MiB of a device call" in msg
    # fetch's first step: the former list's wheel goes
    assert [p.name for p in gpu_bundle.prune_wheels(bundle_root)] == [
        "foo_bar-0.9-py3-none-any.whl"
    ]


def test_gpu_env_accepts_only_the_two_kernel_sets():
    res = subprocess.run(
        ["bash", "-c", "source scripts/gpu_env.sh bogus"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 1
    assert "kernels must be 'production' or 'standins', not 'bogus'" in res.stderr


# ------------------------------------------------------------------------------------------------
# the --kernels switch of scripts/tiny_server.py (used by tiny_server_gpu.py, bench_serving_dsa.py)
# ------------------------------------------------------------------------------------------------
GPU_BASE = {"KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES": "1", "PYTHONPATH": "/tmp/kvb:/tmp/kvo-site"}


def test_production_puts_the_real_kernels_first_and_lets_the_jit_kernels_run():
    env = tiny_server.server_env(dict(GPU_BASE), cpu=False, kernels="production")
    paths = env["PYTHONPATH"].split(":")
    assert paths[:2] == ["/tmp/kvb", "/tmp/kvo-site"]  # real flash_mla / deep_gemm win
    assert set(paths[2:]) == {
        str(tiny_server.STANDINS),
        str(tiny_server.GPU_STUBS),
        str(tiny_server.CPU_STUBS),
    }
    assert env["KV_OFFLOAD_KERNELS"] == "production"
    assert env["SGLANG_IS_FLASHINFER_AVAILABLE"] == "0"  # sgl_kernel / flashinfer still absent
    assert not set(tiny_server.GPU_STANDIN_KERNELS_ENV) & set(env)
    standins = tiny_server.server_env(dict(GPU_BASE), cpu=False, kernels="standins")
    assert standins["PYTHONPATH"].split(":")[0] == str(tiny_server.STANDINS)
    assert standins["SGLANG_OPT_USE_TOPK_V2"] == "0"
    assert standins["KV_OFFLOAD_KERNELS"] == "standins"
    # gpu_env.sh's export is the default
    from_env = tiny_server.server_env(dict(GPU_BASE, KV_OFFLOAD_KERNELS="production"), cpu=False)
    assert from_env["KV_OFFLOAD_KERNELS"] == "production"
    with pytest.raises(ValueError, match="CUDA machine"):
        tiny_server.server_env({}, cpu=True, kernels="production")
    with pytest.raises(ValueError, match="kernels must be one of"):
        tiny_server.server_env({}, cpu=True, kernels="real")


def test_production_command_runs_the_fp8_recipe_with_deepgemm_heads(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_server, "_lacks_gpu_kernels", lambda env: True)
    overrides = ["--json-model-override-args", json.dumps({"index_topk": 256})]
    cmd, _ = tiny_server.build_command(overrides, tmp_path, cpu=False, kernels="production")
    recipe = tiny_server.PRODUCTION_DEFAULTS
    at = next(i for i in range(len(cmd)) if cmd[i : i + len(recipe)] == recipe)
    assert at > cmd.index("--kv-cache-dtype")  # after the tiny defaults: the recipe wins
    last = len(cmd) - 1 - cmd[::-1].index("--json-model-override-args")
    assert json.loads(cmd[last + 1]) == {"index_n_heads": 32, "index_topk": 256}
    mine = tiny_server.merge_model_overrides(
        ["--json-model-override-args", '{"index_n_heads": 64}'], {"index_n_heads": 32}
    )
    assert json.loads(mine[1]) == {"index_n_heads": 64}  # ARGS win
    cmd, _ = tiny_server.build_command([], tmp_path, cpu=False, kernels="standins")
    assert "flashmla_kv" not in cmd and "--json-model-override-args" not in cmd


def test_kernel_report_refuses_stand_ins_for_production_kernels():
    """On this machine flash_mla is the CPU stub and deep_gemm the S4 package: a production run
    must stop before any server starts, naming them and what to source."""
    env = dict(tiny_server.server_env(cpu=True), KV_OFFLOAD_KERNELS="production")
    with pytest.raises(RuntimeError) as err:
        tiny_server.kernel_report(env)
    msg = str(err.value)
    assert "flash_mla, deep_gemm is missing or a stand-in" in msg
    assert "0.0.0+cpustub" in msg and "standins/deep_gemm" in msg
    assert "source scripts/gpu_env.sh production" in msg
