#!/usr/bin/env python3
"""The production-kernel bundle for the lent GPU machine (no network there): pins, fetch, check, build.

SGLang 0.5.23 with ``--kv-cache-dtype fp8_e4m3`` runs its DSA attention through FlashMLA
(``flash_mla_with_kvcache``, the ``sgl-flash-mla`` wheel) and its indexer through DeepGEMM
(``fp8_paged_mqa_logits``, ``fp8_mqa_logits``, ``get_paged_mqa_logits_metadata``); its own top-k,
Hadamard, fused index-K store and rope kernels it JIT-builds with nvcc through apache-tvm-ffi. What
travels for that (git-ignored carry folders, see ``scripts/gpu_env.sh``):

* ``.whl/``: the ``sgl-flash-mla`` wheel (listed in ``gpu-wheels.txt``; it links only torch's stable
  C ABI, so the image's torch loads it), sha256-pinned here;
* ``.gpu/deep_gemm-src.tar.gz`` (+ ``.json``): DeepGEMM's sources, built on the GPU machine against
  its torch (``build-deepgemm``). The ``sgl-deep-gemm`` wheels link libtorch's unstable ABI of the
  torch they were built for and ship no host sources (PyPI has no sdist, and no stored snapshot of
  the fork holds the 0.2.3.post2 ``torch_library_api.cpp``), so the host library and kernels come
  from upstream DeepGEMM at :data:`DEEPGEMM_COMMIT`, whose SM90 ``fp8_paged_mqa_logits`` kernel and
  scheduler are byte-identical to ``sgl-deep-gemm==0.2.3.post2``'s (0.5.23's pin). The cute/cutlass
  headers the kernels include come from that pinned wheel (upstream keeps them in a submodule);
* ``.gpu/cache/<sglang wheel stem>.trimmed.zip`` (+ ``.json``): the pinned sglang wheel without what
  the server never imports (its cp311 Rust extension modules and ``multimodal_gen``), verified
  member by member by ``scripts/kv_offload_tree.py`` (``verify_trimmed_base``);
* ``.gpu/sglang-0.5.23``: 0.5.23's HiSparse sources for the side-by-side benchmarks.

Commands::

    python3 scripts/env/gpu_bundle.py fetch            # the .gpu parts (fetch_gpu_wheels.sh runs it)
    python3 scripts/env/gpu_bundle.py check            # pins, contents and the 64 MiB carry budget
    python3 scripts/env/gpu_bundle.py build-deepgemm DEST   # GPU machine: unpack + compile
    python3 scripts/env/gpu_bundle.py versions         # the kernel packages this Python imports
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import kv_offload_tree  # noqa: E402

logger = logging.getLogger("gpu_bundle")

CARRY_LIMIT_BYTES = 64 << 20  # what one device call takes: the work tree plus carried folders
CARRY_DIRS = (".whl", ".gpu")


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel pinned by file name (name, version and tags) and sha256."""

    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        name, version = self.filename.split("-")[:2]
        return f"{name.replace('_', '-')}=={version}"


# FlashMLA for 0.5.23 (its pin); carried in .whl/ through gpu-wheels.txt.
FLASH_MLA = PinnedWheel(
    "sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl",
    "95d2761376337af4568dbadedc1807b0d90e4d8383c63fa859518a34937392b3",
)
# 0.5.23's DeepGEMM pin: the source of the cute/cutlass headers only (see the module docstring).
SGL_DEEP_GEMM = PinnedWheel(
    "sgl_deep_gemm-0.2.3.post2-py3-none-manylinux2014_x86_64.whl",
    "d1e3e1421d6624a16f32f2dee35c026d64d2f77799e5c0c5eaba68c27023630c",
)
CUTLASS_PREFIXES = ("deep_gemm/include/cute/", "deep_gemm/include/cutlass/")

DEEPGEMM_REPO = "deepseek-ai/DeepGEMM"
DEEPGEMM_COMMIT = "54e22612409371d6364144b69086735beb54e98b"  # 2026-06-23, __version__ 2.6.1
DEEPGEMM_PATHS = ("LICENSE", "csrc", "deep_gemm")
# Where the session's `fetch` tool leaves github:deepseek-ai/DeepGEMM (a git directory); any clone
# that has DEEPGEMM_COMMIT serves (DEEPGEMM_GIT=...).
DEEPGEMM_GIT_DEFAULT = Path("/work/.mirror/deepseek-ai+DeepGEMM/repo")

DEEPGEMM_TARBALL = Path(".gpu") / "deep_gemm-src.tar.gz"
HISPARSE_DIR = Path(".gpu") / "sglang-0.5.23"
# Members of the sglang wheel the GPU server never imports: the Rust extension modules are cp311
# (the image runs Python 3.12; 0.5.23 loads them lazily, for its Rust server and gRPC only) and
# multimodal_gen is the diffusion runtime.
SGLANG_DROP = tuple(
    f"sglang/srt/rust_extensions/{ext}.cpython-311-"
    for ext in ("_bench", "_grpc", "_multimodal", "_server")
) + ("sglang/multimodal_gen/",)


class BundleError(RuntimeError):
    """What is wrong with the bundle and what to run; printed without a traceback."""


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    return kv_offload_tree.sha256_file(path)


def pinned_gpu_wheels(root: Path = ROOT) -> Dict[str, str]:
    """``normalised name -> version`` of ``scripts/env/gpu-wheels.txt``."""
    out = {}
    for line in (root / "scripts" / "env" / "gpu-wheels.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[normalise(name)] = version
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def trimmed_sglang(root: Path = ROOT) -> Path:
    base = kv_offload_tree.read_base()
    return root / ".gpu" / "cache" / f"{Path(base.wheel).stem}.trimmed.zip"


def _pip_download(wheel: PinnedWheel, dest: Path) -> Path:
    """``wheel`` from the package index into ``dest``, sha256-checked."""
    path = dest / wheel.filename
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--platform"]
        cmd += ["manylinux2014_x86_64", "-d", str(dest), wheel.requirement]
        subprocess.run(cmd, check=True)
    if sha256_file(path) != wheel.sha256:
        raise BundleError(f"{path}: sha256 is not the pinned {wheel.sha256}")
    return path


def _git(git_dir: Path, *args: str) -> bytes:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True
    ).stdout


def _git_dir(path: Path) -> Path:
    """The git directory of a clone (``path/.git``) or of a bare repository / mirror (``path``)."""
    return path / ".git" if (path / ".git").exists() else path


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


# ------------------------------------------------------------------------------------------------
# fetch (development machine)
# ------------------------------------------------------------------------------------------------
def write_deepgemm_tarball(git_dir: Path, cutlass_wheel: Path, out: Path) -> Dict[str, object]:
    """``out``: DeepGEMM's :data:`DEEPGEMM_PATHS` at :data:`DEEPGEMM_COMMIT` from ``git_dir``, with
    the cute/cutlass headers of ``cutlass_wheel`` under ``deep_gemm/include``; the manifest
    (``out.json``) records where each part came from and the tarball's sha256."""
    try:
        _git(git_dir, "cat-file", "-e", f"{DEEPGEMM_COMMIT}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise BundleError(
            f"{git_dir} has no DeepGEMM commit {DEEPGEMM_COMMIT}: set DEEPGEMM_GIT to a clone of "
            f"github.com/{DEEPGEMM_REPO} that has it (the session's fetch tool: "
            f"github:{DEEPGEMM_REPO})"
        ) from exc
    archive = _git(git_dir, "archive", "--format=tar", DEEPGEMM_COMMIT, *DEEPGEMM_PATHS)
    files = 0
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        with tarfile.open(fileobj=io.BytesIO(archive)) as src:
            for member in src.getmembers():
                if member.isfile():
                    _tar_add(tar, member.name, src.extractfile(member).read())
                    files += 1
        with zipfile.ZipFile(cutlass_wheel) as zf:
            for name in sorted(zf.namelist()):
                if name.startswith(CUTLASS_PREFIXES) and not name.endswith("/"):
                    _tar_add(tar, name, zf.read(name))
                    files += 1
    tmp.replace(out)
    manifest = {
        "deepgemm": {"repo": DEEPGEMM_REPO, "commit": DEEPGEMM_COMMIT, "paths": DEEPGEMM_PATHS},
        "cutlass_headers": {"wheel": cutlass_wheel.name, "sha256": sha256_file(cutlass_wheel)},
        "files": files,
        "sha256": sha256_file(out),
    }
    Path(f"{out}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def prune_wheels(root: Path) -> List[Path]:
    """Remove the wheels of ``.whl`` that ``gpu-wheels.txt`` does not pin (a former list's: pip
    refuses to install two versions of one package). Returns those removed."""
    want = pinned_gpu_wheels(root)
    stale = []
    for whl in sorted((root / ".whl").glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if want.get(normalise(name)) != version:
            whl.unlink()
            stale.append(whl)
    return stale


def cmd_fetch(args: argparse.Namespace) -> None:
    root = Path(args.root)
    for whl in prune_wheels(root):
        logger.info("removed %s (not in scripts/env/gpu-wheels.txt)", whl.name)
    (root / ".gpu" / "cache").mkdir(parents=True, exist_ok=True)
    base = kv_offload_tree.read_base()
    whl = kv_offload_tree.fetch_wheel(base)  # the pinned sglang wheel, sha256-checked
    dropped = kv_offload_tree.write_trimmed_base(whl, base, SGLANG_DROP, trimmed_sglang(root))
    logger.info("sglang: %s without %d members", trimmed_sglang(root).name, len(dropped))
    if not (root / HISPARSE_DIR / "SOURCE").exists():
        loader = ROOT / "benchmark" / "kv_offload" / "hisparse_0523" / "loader.py"
        subprocess.run([sys.executable, loader, "extract", whl, root / HISPARSE_DIR], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        cutlass_wheel = _pip_download(SGL_DEEP_GEMM, Path(tmp))
        git_dir = _git_dir(Path(os.environ.get("DEEPGEMM_GIT", DEEPGEMM_GIT_DEFAULT)))
        manifest = write_deepgemm_tarball(git_dir, cutlass_wheel, root / DEEPGEMM_TARBALL)
    logger.info("DeepGEMM %s: %d files", DEEPGEMM_COMMIT[:12], manifest["files"])


# ------------------------------------------------------------------------------------------------
# check (either machine)
# ------------------------------------------------------------------------------------------------
def tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends besides the carry: tracked and untracked-not-ignored files
    (0 outside a git checkout, e.g. on the GPU machine, where the call has already been made)."""
    try:
        res = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
        )
    except OSError:  # no git
        return 0
    if res.returncode != 0:
        return 0
    out = res.stdout
    paths = [root / p.decode() for p in out.split(b"\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def carry_bytes(root: Path) -> Dict[str, int]:
    return {
        d: sum(f.stat().st_size for f in (root / d).rglob("*") if f.is_file())
        for d in CARRY_DIRS
        if (root / d).exists()
    }


def check_bundle(root: Path, tree: Optional[int] = None) -> Dict[str, object]:
    """Every part of the bundle present, pinned and verified, and the whole call within
    :data:`CARRY_LIMIT_BYTES`; raises :class:`BundleError` naming each problem."""
    problems: List[str] = []
    want = pinned_gpu_wheels(root)
    have: Dict[str, List[str]] = {}
    for whl in sorted((root / ".whl").glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        have.setdefault(normalise(name), []).append(version)
    for name, version in want.items():
        if have.get(name) != [version]:
            problems.append(f".whl: {name}=={version} expected once, found {have.get(name)}")
    flash_mla = root / ".whl" / FLASH_MLA.filename
    if flash_mla.exists() and sha256_file(flash_mla) != FLASH_MLA.sha256:
        problems.append(f"{flash_mla}: sha256 is not the pinned {FLASH_MLA.sha256}")
    if want.get(normalise("sgl-flash-mla")) != FLASH_MLA.requirement.split("==")[1]:
        problems.append(f"gpu-wheels.txt must pin {FLASH_MLA.requirement} (gpu_bundle.FLASH_MLA)")
    problems += _check_deepgemm(root / DEEPGEMM_TARBALL)
    trimmed = trimmed_sglang(root)
    try:
        kv_offload_tree.verify_trimmed_base(trimmed, kv_offload_tree.read_base())
    except (kv_offload_tree.TreeError, FileNotFoundError) as exc:
        problems.append(f"sglang: {exc}")
    if not (root / HISPARSE_DIR / "SOURCE").exists():
        problems.append(f"{HISPARSE_DIR}/SOURCE missing")
    sizes = carry_bytes(root)
    sizes["tree"] = tree_bytes(root) if tree is None else tree
    total = sum(sizes.values())
    if total > CARRY_LIMIT_BYTES:
        problems.append(
            f"carry {total / 2**20:.1f} MiB exceeds the {CARRY_LIMIT_BYTES >> 20} MiB of a device "
            "call: remove stale files from .whl/.gpu (fetch_gpu_wheels.sh rewrites them)"
        )
    if problems:
        raise BundleError(
            "GPU bundle incomplete (run `bash scripts/env/fetch_gpu_wheels.sh`):\n  "
            + "\n  ".join(problems)
        )
    return {"bytes": sizes, "total_mib": round(total / 2**20, 1)}


def _check_deepgemm(tarball: Path) -> List[str]:
    manifest_path = Path(f"{tarball}.json")
    if not tarball.exists() or not manifest_path.exists():
        return [f"{tarball} (+ .json) missing"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    if manifest.get("deepgemm", {}).get("commit") != DEEPGEMM_COMMIT:
        problems.append(f"{tarball} is not DeepGEMM {DEEPGEMM_COMMIT}")
    if manifest.get("cutlass_headers", {}).get("sha256") != SGL_DEEP_GEMM.sha256:
        problems.append(f"{tarball}: cute/cutlass headers not from {SGL_DEEP_GEMM.filename}")
    if sha256_file(tarball) != manifest.get("sha256"):
        problems.append(f"{tarball}: sha256 differs from its manifest")
    return problems


def cmd_check(args: argparse.Namespace) -> None:
    report = check_bundle(Path(args.root))
    mib = {k: round(v / 2**20, 1) for k, v in report["bytes"].items()}
    logger.info(
        "GPU bundle complete: %s MiB (%s) of the %d MiB a device call takes",
        report["total_mib"],
        ", ".join(f"{k} {v}" for k, v in mib.items()),
        CARRY_LIMIT_BYTES >> 20,
    )


# ------------------------------------------------------------------------------------------------
# build-deepgemm (GPU machine)
# ------------------------------------------------------------------------------------------------
def build_deepgemm(tarball: Path, dest: Path, jobs: int) -> Path:
    """Unpack the DeepGEMM sources into ``dest`` (the package is then ``dest/deep_gemm``) and compile
    its host library (``csrc/python_api.cpp``, a torch extension) against this machine's torch;
    the kernels are JIT-compiled at first use. Skips the build when ``dest`` already holds one
    from the same tarball. Returns the library's path."""
    problems = _check_deepgemm(tarball)
    if problems:
        raise BundleError("; ".join(problems))
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    stamp = dest / ".built-from"
    want = f"{sha256_file(tarball)} torch {torch.__version__}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    lib = dest / "deep_gemm" / f"_C{suffix}"
    if lib.exists() and stamp.exists() and stamp.read_text() == want:
        return lib
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.exists():
        raise BundleError(f"{python_h} missing: DeepGEMM's host library needs the Python headers")
    if cpp_extension.CUDA_HOME is None:
        raise BundleError("no CUDA toolkit found (CUDA_HOME, nvcc on PATH or /usr/local/cuda)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    build_dir = dest / "build"
    build_dir.mkdir(exist_ok=True)
    os.environ["MAX_JOBS"] = str(jobs)
    # No .cu source, so no arch flag is used; torch derives one anyway and fails without a GPU.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    cuda = Path(cpp_extension.CUDA_HOME)
    includes = [dest / "deep_gemm" / "include", cuda / "include", cuda / "include" / "cccl"]
    built = cpp_extension.load(
        name="_C",
        sources=[str(dest / "csrc" / "python_api.cpp")],
        extra_cflags=["-O3", "-Wno-psabi", "-Wno-deprecated-declarations"],
        extra_include_paths=[str(p) for p in includes if p.exists()],
        extra_ldflags=[f"-L{cuda / 'lib64'}", "-lnvrtc", "-lcublasLt", "-lcublas"],
        build_directory=str(build_dir),
        with_cuda=True,
        is_python_module=False,
        verbose=False,
    )
    del built
    (build_dir / "_C.so").replace(lib)
    stamp.write_text(want)
    return lib


def cmd_build_deepgemm(args: argparse.Namespace) -> None:
    lib = build_deepgemm(Path(args.root) / DEEPGEMM_TARBALL, Path(args.dest), args.jobs)
    logger.info("DeepGEMM host library: %s", lib)


# ------------------------------------------------------------------------------------------------
# versions (either machine)
# ------------------------------------------------------------------------------------------------
KERNEL_MODULES = ("flash_mla", "deep_gemm", "sgl_kernel", "tvm_ffi")


def kernel_versions() -> Dict[str, Dict[str, Optional[str]]]:
    """Version and file of each kernel package this interpreter imports (``error`` if none)."""
    import importlib

    out: Dict[str, Dict[str, Optional[str]]] = {}
    for name in KERNEL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # an import that fails is a finding to report, not to raise
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        out[name] = {
            "version": getattr(mod, "__version__", None),
            "file": getattr(mod, "__file__", None),
        }
    manifest = Path(f"{ROOT / DEEPGEMM_TARBALL}.json")
    if "deep_gemm" in out and manifest.exists():
        out["deep_gemm"]["source"] = json.loads(manifest.read_text())["deepgemm"]["commit"]
    return out


def cmd_versions(args: argparse.Namespace) -> None:
    print(json.dumps(kernel_versions(), indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[gpu_bundle] %(message)s")
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default=str(ROOT), help="the repo root holding .whl and .gpu")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch").set_defaults(fn=cmd_fetch)
    sub.add_parser("check").set_defaults(fn=cmd_check)
    build = sub.add_parser("build-deepgemm")
    build.add_argument("dest")
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    build.set_defaults(fn=cmd_build_deepgemm)
    sub.add_parser("versions").set_defaults(fn=cmd_versions)
    args = p.parse_args(argv)
    try:
        args.fn(args)
    except (BundleError, kv_offload_tree.TreeError) as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
