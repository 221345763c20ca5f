"""Standalone loader for SGLang 0.5.23's HiSparse swap-in kernel (``load_cache_to_device_buffer``).

Runs 0.5.23's *own* Python wrapper (``sglang/kernels/ops/kvcache/hisparse.py``, executed from the
release's file) and JIT-builds 0.5.23's *own* CUDA source (``kernels/jit/csrc/kvcacheio/hisparse.cuh``
with the release's ``kernels/jit/include`` headers) without importing the 0.5.23 ``sglang`` package,
so it can sit in the same process as our patched 0.5.23 tree. Only the build plumbing is replaced:
0.5.23's ``load_jit`` (which pulls in ``sglang.srt.environ``, ``msgspec`` and the sglang package) is
swapped for a small builder that writes the same wrapper unit and the same ``build.ninja`` text that
0.5.23's ``kernels/jit/utils/compile/{spec,ninja,toolchain}.py`` generate, runs ninja, and loads the
``.so`` with ``tvm_ffi.load_module`` (0.5.23 does the same: ``compile/loader.py:_load``).

Needs at run time: nvcc (the GPU box has CUDA 13), a host ``c++``, ``ninja``, and the
``apache-tvm-ffi==0.1.11`` wheel (headers, ``libtvm_ffi.so`` and the Python ``tvm_ffi`` module).
Nothing else: no sgl_kernel, flashinfer, cutlass or 0.5.23 Python dependencies.

    from hisparse_0523.loader import load_ops, coordinator_swap_in
    ops = load_ops("/path/to/sglang-0.5.23 tree")    # dir that holds sglang/kernels/...
    ops.load_cache_to_device_buffer_mla(...)          # 0.5.23's function, unchanged
    coordinator_swap_in(ops, ...)                     # ... called as HiSparseCoordinator calls it

``python -m`` / script use (no GPU, no torch needed for these):

    python loader.py extract sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl DEST
    python loader.py ninja SRC --arch 90a --item-size 656 --top-k 2048 --hot 4096 [--block 960]
    python loader.py build SRC --arch 90a ... [--ptxas-v]   # compile only (nvcc + tvm-ffi headers)
    python loader.py scan-sim [--block 256]                  # CPU model of the kernel's prefix scan
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types
import zipfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# ------------------------------------------------------------------------------------------------
# The release and what we take from it
# ------------------------------------------------------------------------------------------------
WHEEL_NAME = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
TVM_FFI_REQUIREMENT = "apache-tvm-ffi==0.1.11"  # sglang-0.5.23 METADATA Requires-Dist

# Coordinator default (srt/managers/hisparse_coordinator.py:546, SparseConfig / parser default 960).
COORDINATOR_BLOCK_SIZE = 960
# Kernel-wrapper default (kernels/ops/kvcache/hisparse.py:371) -- unsafe, see README.md.
WRAPPER_DEFAULT_BLOCK_SIZE = 256

# Files of the wheel the loader (and the README's references) need; ~0.6 MB in all.
_SUBSET_PREFIXES = (
    "sglang/kernels/jit/include/",  # sgl_kernel/*.h, *.cuh headers (only these are #included)
)
_SUBSET_FILES = (
    "sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh",
    "sglang/kernels/ops/kvcache/hisparse.py",  # executed as-is by load_ops()
    "sglang/kernels/jit/utils/compile/cpp_args.py",  # make_cpp_args, executed as-is
    # reference only (not executed): build plumbing we mirror, and the caller
    "sglang/kernels/jit/utils/compile/spec.py",
    "sglang/kernels/jit/utils/compile/ninja.py",
    "sglang/kernels/jit/utils/compile/toolchain.py",
    "sglang/kernels/jit/utils/compile/loader.py",
    "sglang/kernels/jit/utils/compile/paths.py",
    "sglang/kernels/jit/utils/arch.py",
    "sglang/kernels/jit/utils/common.py",
    "sglang/srt/managers/hisparse_coordinator.py",
    "sglang/srt/mem_cache/sparsity/factory.py",
    "sglang/srt/mem_cache/sparsity/core/sparse_coordinator.py",
)


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract_subset(
    wheel: str | os.PathLike, dest: str | os.PathLike, *, verify: bool = True
) -> pathlib.Path:
    """Unpack only the files the loader needs from the 0.5.23 wheel into ``dest`` (returned).

    ``dest`` then holds ``sglang/kernels/...``: pass it as ``src_root`` to :func:`load_ops`.
    """
    wheel, dest = pathlib.Path(wheel), pathlib.Path(dest)
    if verify:
        got = _sha256(wheel)
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{wheel}: sha256 {got} != pinned {WHEEL_SHA256}")
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith("/"):
                continue
            if name in _SUBSET_FILES or name.startswith(_SUBSET_PREFIXES):
                zf.extract(name, dest)
                n += 1
    missing = [f for f in _SUBSET_FILES if not (dest / f).is_file()]
    if missing:
        raise RuntimeError(f"wheel lacks {missing}")
    (dest / "SOURCE").write_text(f"{WHEEL_NAME}\nsha256={WHEEL_SHA256}\nfiles={n}\n")
    return dest


def resolve_src_root(src_root: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory that holds ``sglang/kernels/jit`` (an unpacked wheel or :func:`extract_subset`).

    Default: ``$HISPARSE_0523_SRC``.
    """
    src_root = src_root or os.environ.get("HISPARSE_0523_SRC")
    if not src_root:
        raise RuntimeError(
            "pass src_root or set HISPARSE_0523_SRC to the unpacked sglang 0.5.23 tree"
        )
    root = pathlib.Path(src_root).expanduser().resolve()
    if (root / "sglang").is_dir():
        pass
    elif root.name == "sglang" and (root / "kernels").is_dir():
        root = root.parent
    if not (root / "sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh").is_file():
        raise RuntimeError(f"{root}: no sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh")
    return root


def kernel_path(src_root: pathlib.Path) -> pathlib.Path:
    """0.5.23's ``KERNEL_PATH`` (compile/paths.py): the ``sglang/kernels/jit`` directory."""
    return src_root / "sglang" / "kernels" / "jit"


# ------------------------------------------------------------------------------------------------
# Toolchain (mirrors 0.5.23 kernels/jit/utils/compile/toolchain.py and utils/arch.py)
# ------------------------------------------------------------------------------------------------
def cuda_home() -> str:
    """CUDA_HOME / CUDA_PATH, else ``dirname(dirname(which nvcc))``, else /usr/local/cuda.

    Deviation from 0.5.23 (toolchain.py:cuda_home), which takes ``dirname(dirname(which nvcc))`` as
    is: here nvcc is resolved through symlinks, and candidates are checked, so a
    ``/usr/local/bin/nvcc`` shim (as on the dev machine: a shell script exec'ing cuda-13.0/bin/nvcc)
    still finds the toolkit: the first candidate with both ``bin/nvcc`` and a ``libcudart.so`` wins. The flags are the same once the root is found.
    """
    configured = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if configured:
        return configured
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands += ["/usr/local/cuda"] + sorted(str(p) for p in pathlib.Path("/usr/local").glob("cuda-*"))
    for c in cands:
        if os.path.isfile(os.path.join(c, "bin", "nvcc")) and _find_cudart(pathlib.Path(c)):
            return c
    return cands[0] if cands else "/usr/local/cuda"


def nvcc_path() -> str:
    return os.path.join(cuda_home(), "bin", "nvcc")


def cudart_dir() -> str:
    """Where ``-lcudart`` resolves: 0.5.23 uses ``$CUDA_HOME/lib64``; fall back to lib/ and
    targets/x86_64-linux/lib when lib64 has no libcudart.so."""
    home = pathlib.Path(cuda_home())
    return str(_find_cudart(home) or home / "lib64")


def _find_cudart(home: pathlib.Path) -> Optional[pathlib.Path]:
    for d in (home / "lib64", home / "lib", home / "targets/x86_64-linux/lib"):
        if (d / "libcudart.so").exists():
            return d
    return None


def host_cxx() -> str:
    return os.environ.get("CXX", "c++")


def nvcc_version() -> Tuple[int, int]:
    out = subprocess.check_output([nvcc_path(), "--version"], text=True)
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot parse nvcc --version: {out}")
    return int(m.group(1)), int(m.group(2))


def arch_suffix(major: int, minor: int) -> str:
    """0.5.23 arch.py:_cuda_arch_suffix: 9.x / 10.x+ -> 'a', 12.0 -> 'f' (nvcc >= 12.9)."""
    if major == 9:
        return "a"
    if major == 12:
        if minor == 0 and nvcc_version() >= (12, 9):
            return "f"
        return "a"
    if major >= 10:
        return "a"
    return ""


def detect_arch() -> str:
    """Target of the current CUDA device as 0.5.23 picks it, e.g. ``'90a'`` on H200."""
    import torch

    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return f"{major}{minor}{arch_suffix(major, minor)}"


def _parse_arch(arch: str) -> Tuple[int, int, str]:
    m = re.fullmatch(r"(\d+)(\d)([a-z]?)", arch.replace(".", ""))
    if not m:
        raise ValueError(f"bad arch {arch!r} (expected like '90a')")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def tvm_ffi_root(explicit: str | os.PathLike | None = None) -> pathlib.Path:
    """The installed ``tvm_ffi`` package directory, found without importing it.

    ``explicit`` / ``$TVM_FFI_ROOT`` may point at an unpacked wheel's ``tvm_ffi`` directory (enough to
    *compile*; loading needs the importable package on the GPU box's Python 3.12).
    """
    explicit = explicit or os.environ.get("TVM_FFI_ROOT")
    if explicit:
        root = pathlib.Path(explicit).expanduser().resolve()
    else:
        spec = importlib.util.find_spec("tvm_ffi")  # locates the package; does not run __init__
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                f"tvm_ffi not found: install the {TVM_FFI_REQUIREMENT} wheel "
                "(apache_tvm_ffi-0.1.11-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl)"
            )
        root = pathlib.Path(list(spec.submodule_search_locations)[0]).resolve()
    if not (root / "include/tvm/ffi/container/tensor.h").is_file():
        raise RuntimeError(f"{root}: not a tvm_ffi package (no include/tvm/ffi/container/tensor.h)")
    return root


def tvm_ffi_paths(explicit: str | os.PathLike | None = None) -> Tuple[Tuple[str, ...], str, str]:
    """``(include dirs, lib dir, lib name)`` like 0.5.23 toolchain.tvm_ffi_paths (via tvm_ffi.libinfo:
    find_include_path() and find_dlpack_include_path() are both ``tvm_ffi/include`` in the wheel).
    """
    root = tvm_ffi_root(explicit)
    incs = [root / "include"]
    if not (root / "include/dlpack/dlpack.h").is_file():
        incs.append(root / "3rdparty/dlpack/include")
    lib = root / "lib" / "libtvm_ffi.so"
    if not lib.is_file():
        raise RuntimeError(f"{lib} missing")
    return tuple(dict.fromkeys(str(p) for p in incs)), str(lib.parent), "tvm_ffi"


# ------------------------------------------------------------------------------------------------
# One build, exactly as 0.5.23 describes it
# ------------------------------------------------------------------------------------------------
# compile/spec.py:_FFI_INCLUDES (lines 102-108 of that file)
_FFI_INCLUDES = (
    "#include <tvm/ffi/container/tensor.h>",
    "#include <tvm/ffi/dtype.h>",
    "#include <tvm/ffi/error.h>",
    "#include <tvm/ffi/extra/c_env_api.h>",
    "#include <tvm/ffi/function.h>",
)
_MODULE_NAME_PREFIX = "sgl_kernel_jit_"  # compile/spec.py


def wrapper_source(cuda_files: Sequence[str], wrappers: Sequence[Tuple[str, str]]) -> str:
    """compile/spec.py:_wrapper_source, verbatim logic."""
    lines = list(_FFI_INCLUDES)
    lines += [f'#include "{path}"' for path in cuda_files]
    lines.append("namespace sglang {")
    lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({name}, ({kernel}));" for name, kernel in wrappers]
    lines.append("}  // namespace sglang")
    return "\n".join(lines) + "\n"


def module_name(module_args: Sequence[Any]) -> str:
    return _MODULE_NAME_PREFIX + "_".join(str(a) for a in module_args)


def ninja_text(
    *,
    name: str,
    include_paths: Sequence[str],
    arch: str,
    tvm_ffi: Tuple[Tuple[str, ...], str, str],
    extra_cuda_cflags: Sequence[str] = (),
) -> str:
    """compile/ninja.py:generate for a header-only module with one CUDA unit (``cuda.cu``).

    cudaflags = toolchain.base_cuda_flags() + toolchain.target_flags()
                + arch.get_default_target_flags() + extra + -I(tvm-ffi, then sglang include)
    """
    major, minor, suffix = _parse_arch(arch)
    tvm_incs, tvm_lib_dir, tvm_lib = tvm_ffi
    includes = list(tvm_incs) + list(include_paths)
    inc_flags = [f"-I{_q(p)}" for p in includes]
    cxxflags = ["-fPIC", "-std=c++20", "-O3"] + inc_flags
    cudaflags = (
        ["-Xcompiler", "-fPIC"]
        + [f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"]
        + [
            f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}",
            "-std=c++20",
            "-O3",
            "--expt-relaxed-constexpr",
        ]
        + list(extra_cuda_cflags)
        + inc_flags
    )
    ldflags = [
        "-shared",
        f"-L{_q(tvm_lib_dir)}",
        f"-l{tvm_lib}",
        f"-L{_q(cudart_dir())}",
        "-lcudart",
    ]
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {_q(host_cxx())}",
        f"nvcc = {_q(nvcc_path())}",
        f"cxxflags = {' '.join(cxxflags)}",
        f"cudaflags = {' '.join(cudaflags)}",
        f"ldflags = {' '.join(ldflags)}",
        "",
        "rule compile_cxx",
        "  depfile = $out.d",
        '  command = $cxx -MD -MF "$out.d" $cxxflags -c "$in" -o "$out"',
        "",
        "rule compile_cuda",
        "  depfile = $out.d",
        '  command = $nvcc -MD -MF "$out.d" $cudaflags -c "$in" -o "$out"',
        "",
        "rule link",
        '  command = $cxx $in $ldflags -o "$out"',
        "",
        "build cuda_0.o: compile_cuda cuda.cu",
        "",
        f"build {name}.so: link cuda_0.o",
        "",
        f"default {name}.so",
        "",
    ]
    return "\n".join(lines)


def _q(path: str) -> str:
    import shlex

    return shlex.quote(str(path)).replace("$", "$$")


def cache_root() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("HISPARSE_0523_JIT_CACHE", "~/.cache/kv_offload/hisparse_0523_jit")
    ).expanduser()


def _tree_digest(paths: Iterable[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def build_module(
    src_root: str | os.PathLike,
    module_args: Sequence[Any],
    *,
    cuda_files: Sequence[str],
    cuda_wrappers: Sequence[Tuple[str, str]],
    extra_cuda_cflags: Sequence[str] = (),
    arch: Optional[str] = None,
    tvm_ffi_dir: str | os.PathLike | None = None,
    force: bool = False,
    verbose: bool = False,
) -> pathlib.Path:
    """Compile one 0.5.23 JIT module; return the ``.so`` path (cached by a content key)."""
    root = resolve_src_root(src_root)
    kpath = kernel_path(root)
    arch = arch or detect_arch()
    name = module_name(module_args)
    files = [str((kpath / "csrc" / f).resolve()) for f in cuda_files]
    wrapper = wrapper_source(files, cuda_wrappers)
    tvm = tvm_ffi_paths(tvm_ffi_dir)
    extra = list(extra_cuda_cflags) + (["-Xptxas=-v"] if verbose else [])
    text = ninja_text(
        name=name,
        include_paths=[str(kpath / "include")],
        arch=arch,
        tvm_ffi=tvm,
        extra_cuda_cflags=extra,
    )
    headers = list((kpath / "include").rglob("*")) + [pathlib.Path(f) for f in files]
    key = hashlib.sha256(
        "\0".join([text, wrapper, _tree_digest(p for p in headers if p.is_file())]).encode()
    ).hexdigest()[:16]
    out_dir = cache_root() / f"sm{arch}" / name / key
    so = out_dir / f"{name}.so"
    if so.is_file() and not force:
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    with _lock(out_dir / ".lock"):
        if so.is_file() and not force:
            return so
        (out_dir / "cuda.cu").write_text(wrapper)
        (out_dir / "build.ninja").write_text(text)
        cmd = ["ninja", "-f", "build.ninja"] + (["-v"] if verbose else [])
        if os.environ.get("MAX_JOBS"):
            cmd += ["-j", os.environ["MAX_JOBS"]]
        done = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, check=False)
        (out_dir / "build.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(
                f"building {name} failed in {out_dir}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        if verbose:
            print(done.stdout + done.stderr)
    return so


@contextlib.contextmanager
def _lock(path: pathlib.Path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_so(so: pathlib.Path):
    import tvm_ffi  # apache-tvm-ffi 0.1.11; 0.5.23 compile/loader.py:_load does the same

    return tvm_ffi.load_module(str(so))


# ------------------------------------------------------------------------------------------------
# 0.5.23's own Python wrapper, run against a shim of sglang.kernels.jit.utils
# ------------------------------------------------------------------------------------------------
def _exec_file(path: pathlib.Path, mod_name: str, *, rename_imports: Dict[str, str] | None = None):
    """Execute a .py file as a fresh module, optionally redirecting ``from X import ...`` modules."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and rename_imports and node.module in rename_imports:
            found.add(node.module)
            node.module = rename_imports[node.module]
    if rename_imports and found != set(rename_imports):
        raise RuntimeError(f"{path}: expected imports {set(rename_imports) - found} not found")
    mod = types.ModuleType(mod_name)
    mod.__file__ = str(path)
    sys.modules[mod_name] = mod  # dataclasses / NamedTuple look their module up
    exec(compile(tree, str(path), "exec"), mod.__dict__)
    return mod


def _make_shim(src_root: pathlib.Path, *, arch: Optional[str], tvm_ffi_dir, verbose: bool):
    """A module standing in for 0.5.23's ``sglang.kernels.jit.utils`` (what hisparse.py imports:
    cache_once, is_arch_support_pdl, load_jit, make_cpp_args)."""
    kpath = kernel_path(src_root)
    cpp_args = _exec_file(kpath / "utils/compile/cpp_args.py", "_hisparse0523_cpp_args")
    shim = types.ModuleType("_hisparse0523_jit_utils")

    def cache_once(fn):  # common.py:cache_once, same semantics
        result_map = {}

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            if key not in result_map:
                result_map[key] = fn(*args, **kwargs)
            return result_map[key]

        return wrapper

    @functools.cache
    def is_arch_support_pdl() -> bool:  # arch.py: CUDA major >= 9
        return _parse_arch(arch or detect_arch())[0] >= 9

    def load_jit(
        *args,
        cpp_files=None,
        cuda_files=None,
        cpp_wrappers=None,
        cuda_wrappers=None,
        extra_cflags=None,
        extra_cuda_cflags=None,
        extra_ldflags=None,
        extra_include_paths=None,
        extra_dependencies=None,
        header_only=True,
    ):
        if cpp_files or cpp_wrappers or extra_cflags or extra_ldflags or extra_include_paths:
            raise NotImplementedError("standalone load_jit: CUDA header-only modules only")
        if extra_dependencies or not header_only:
            raise NotImplementedError("standalone load_jit: no registered dependencies")
        so = build_module(
            src_root,
            args,
            cuda_files=cuda_files or [],
            cuda_wrappers=cuda_wrappers or [],
            extra_cuda_cflags=extra_cuda_cflags or [],
            arch=arch,
            tvm_ffi_dir=tvm_ffi_dir,
            verbose=verbose,
        )
        return _load_so(so)

    shim.cache_once = cache_once
    shim.is_arch_support_pdl = is_arch_support_pdl
    shim.load_jit = load_jit
    shim.make_cpp_args = cpp_args.make_cpp_args
    sys.modules[shim.__name__] = shim
    return shim


_OPS_CACHE: Dict[Tuple[str, Optional[str]], types.ModuleType] = {}


def load_ops(
    src_root: str | os.PathLike | None = None,
    *,
    arch: Optional[str] = None,
    tvm_ffi_dir: str | os.PathLike | None = None,
    verbose: bool = False,
) -> types.ModuleType:
    """0.5.23's ``sglang/kernels/ops/kvcache/hisparse.py`` as a module (its code, unchanged), whose
    ``load_jit`` builds with :func:`build_module`. Needs torch to import; builds lazily on first call.
    """
    root = resolve_src_root(src_root)
    key = (str(root), arch)
    if key in _OPS_CACHE:
        return _OPS_CACHE[key]
    shim = _make_shim(root, arch=arch, tvm_ffi_dir=tvm_ffi_dir, verbose=verbose)
    ops = _exec_file(
        kernel_path(root).parent / "ops/kvcache/hisparse.py",
        "_hisparse0523_ops",
        rename_imports={"sglang.kernels.jit.utils": shim.__name__},
    )
    _OPS_CACHE[key] = ops
    return ops


def coordinator_swap_in(
    ops: types.ModuleType,
    *,
    top_k_result,  # [num_reqs, top_k] int32, token positions (-1 allowed) -- the indexer's output
    req_device_buffer_tokens_layer,  # coordinator.req_device_buffer_tokens[layer_id]  int32 [R, S+page]
    req_to_host_pool,  # coordinator.req_to_host_pool                           int64 [R, ctx+page]
    req_device_buffer_token_locs_layer,  # coordinator.req_device_buffer_token_locs[layer_id] int32
    host_kv_buffer_layer,  # mem_pool_host.kv_buffer[layer_id]  (pinned CPU, row stride item_size)
    device_kv_buffer_layer,  # mem_pool_device.kv_buffer[layer_id]  (CUDA)
    top_k_device_locs_buffer,  # coordinator.top_k_device_locs_buffer   int32 [R, top_k]
    req_pool_indices,  # [num_reqs] int64 (int32 also compiled)
    seq_lens,  # [num_reqs] int64/int32: forward_batch.seq_lens in decode
    lru_slots_layer,  # coordinator.lru_slots[layer_id]  int16 [R, S]
    num_real_reqs,  # int32 [1] on the GPU
    item_size_bytes: int,
    top_k: int,
    device_buffer_size: int,
    swap_in_block_size: int = COORDINATOR_BLOCK_SIZE,
    skip_io: bool = False,
):
    """HiSparseCoordinator._run_swap_in_kernel (0.5.23 hisparse_coordinator.py:1467-1529), the
    non-speculative, non-DSv4, no-miss-plan branch: same function, same keyword arguments."""
    num_reqs = req_pool_indices.size(0)
    top_k_indices = top_k_device_locs_buffer[:num_reqs, :top_k]
    ops.load_cache_to_device_buffer_mla(
        top_k_tokens=top_k_result,
        device_buffer_tokens=req_device_buffer_tokens_layer,
        host_cache_locs=req_to_host_pool,
        device_buffer_locs=req_device_buffer_token_locs_layer,
        host_cache=host_kv_buffer_layer,
        device_buffer=device_kv_buffer_layer,
        top_k_device_locs=top_k_indices,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        lru_slots=lru_slots_layer,
        item_size_bytes=item_size_bytes,
        num_top_k=top_k,
        hot_buffer_size=device_buffer_size,
        page_size=1,
        block_size=swap_in_block_size,
        num_real_reqs=num_real_reqs,
        skip_io=skip_io,
    )
    return top_k_indices


def load_swap_in(
    src_root: str | os.PathLike | None = None, *, block_size: int = COORDINATOR_BLOCK_SIZE, **kw
) -> Callable:
    """Drop-in for bench_lru's ``self.community``: 0.5.23's ``load_cache_to_device_buffer_mla`` with
    the coordinator's ``block_size`` forced (callers that pass block_size=1024 get 960, as the
    coordinator would). Set ``block_size=None`` to pass the caller's value through."""
    ops = load_ops(src_root, **kw)
    fn = ops.load_cache_to_device_buffer_mla
    if block_size is None:
        return fn

    @functools.wraps(fn)
    def swap_in(*args, **kwargs):
        kwargs["block_size"] = block_size
        return fn(*args, **kwargs)

    swap_in.block_size = block_size  # type: ignore[attr-defined]
    swap_in.ops = ops  # type: ignore[attr-defined]
    return swap_in


# ------------------------------------------------------------------------------------------------
# Pure-Python model of the kernel's two block-level prefix scans (CUDA branch), for the block-size bug
# ------------------------------------------------------------------------------------------------
def _i32(v: int) -> int:
    """int32 wrap-around, as the kernel's ``int`` arithmetic does on the GPU."""
    return (v + 2**31) % 2**32 - 2**31


def simulate_scan(
    block_size: int, counts: Sequence[int], warp_size: int = 32
) -> Tuple[List[int], int]:
    """Replay ``load_cache_to_device_buffer_kernel``'s chunk scans (hisparse.cuh 513-595 for
    hits/evictables, 597-665 for misses; CUDA ``#else`` branch) on per-chunk ``counts``.

    Returns (the exclusive offsets s_chunk_offset[chunk] each chunk's lanes read, final total).
    Correct output = the plain exclusive prefix sum of ``counts`` and ``sum(counts)``.
    """
    num_warps = block_size // warp_size
    n = len(counts)
    s = [0] * (n + 1)  # s_chunk_offset, zeroed (hisparse.cuh "Initialize shared memory")
    acc = 0  # warp 0's running total (total_hit_count / total_evict_count / total_misses)
    offsets = [0] * n
    iters = (n + num_warps - 1) // num_warps
    for it in range(iters):
        chunks = [w + it * num_warps for w in range(num_warps) if w + it * num_warps < n]
        for c in chunks:  # lane 0 of each warp: s_chunk_offset[chunk_idx + 1] = popc(mask)
            s[c + 1] = counts[c]
        # warp 0: warp_inclusive_scan(s, lane, offset=chunk_idx + 1 (chunk_idx = it*num_warps),
        #                             count=n + 1, accumulator)
        off = it * num_warps + 1
        vals, run = [], 0
        for lane in range(warp_size):
            idx = lane + off
            run = _i32(run + (s[idx] if idx < n + 1 else 0))
            vals.append(_i32(run + acc))
        for lane in range(warp_size):
            idx = lane + off
            if idx < n + 1:
                s[idx] = vals[lane]
        acc = vals[
            -1
        ]  # __shfl_sync(val, WARP_SIZE - 1): includes lanes past this iteration's chunks
        for c in chunks:
            offsets[c] = s[c]
    return offsets, acc


def scan_report(
    block_size: int, *, hot: int = 4096, top_k: int = 2048, hit_rate: float = 0.9
) -> Dict:
    """Hit / evictable / miss offsets for one long request, at ``block_size``, vs the correct ones."""
    import random

    rng = random.Random(0)
    nb = (hot + 31) // 32
    nt = (top_k + 31) // 32
    hits_per_slot = [1 if rng.random() < top_k * hit_rate / hot else 0 for _ in range(hot)]
    hit_c = [sum(hits_per_slot[i * 32 : (i + 1) * 32]) for i in range(nb)]
    evict_c = [32 - h for h in hit_c]
    miss_c = [sum(1 for _ in range(32) if rng.random() > hit_rate) for _ in range(nt)]
    out = {"block_size": block_size, "num_warps": block_size // 32}
    for label, counts, bound in (
        ("hit", hit_c, hot),
        ("evict", evict_c, hot),
        ("miss", miss_c, top_k),
    ):
        offs, total = simulate_scan(block_size, counts)
        want_total = sum(counts)
        out[label] = {
            "total": total,
            "correct_total": want_total,
            "max_offset": max(offs),
            "min_offset": min(offs),
            "ok": total == want_total,
            # the kernel indexes shared memory with these (s_lru_slots_out[HOT-1-offset] etc.)
            "out_of_range": not 0 <= min(offs) <= max(offs) <= bound,
        }
    return out


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _sparse_cache_call(args) -> Tuple[List[str], List[Tuple[str, str]]]:
    """module args + wrapper exactly as 0.5.23 hisparse.py:_jit_sparse_module builds them (MLA)."""
    b = lambda v: "true" if v else "false"  # noqa: E731  make_cpp_args for bools
    tmpl = [str(args.block), str(args.top_k), str(args.hot), "true", b(args.dsv4), "1", "false",
            b(args.plan), b(args.skip_io)]  # fmt: skip
    cache = [str(args.item_size)] + tmpl
    return ["sparse_cache"] + cache, [
        ("load_cache_to_device_buffer", f"load_cache_to_device_buffer<{', '.join(tmpl)}>")
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("wheel")
    e.add_argument("dest")
    for name in ("ninja", "build"):
        q = sub.add_parser(name)
        q.add_argument("src")
        q.add_argument("--arch", default="90a")
        q.add_argument("--item-size", type=int, default=656)
        q.add_argument("--top-k", type=int, default=2048)
        q.add_argument("--hot", type=int, default=4096)
        q.add_argument("--block", type=int, default=COORDINATOR_BLOCK_SIZE)
        q.add_argument("--dsv4", action="store_true")
        q.add_argument("--plan", action="store_true")
        q.add_argument("--skip-io", action="store_true")
        q.add_argument("--tvm-ffi", default=None, help="tvm_ffi package dir (default: find_spec)")
        q.add_argument("--ptxas-v", action="store_true")
        q.add_argument("--force", action="store_true")
    s = sub.add_parser("scan-sim")
    s.add_argument("--block", type=int, nargs="*", default=[256, 384, 480, 512, 768, 960, 1024])
    s.add_argument("--hot", type=int, default=4096)
    s.add_argument("--top-k", type=int, default=2048)
    a = p.parse_args(argv)

    if a.cmd == "extract":
        print(extract_subset(a.wheel, a.dest))
        return 0
    if a.cmd == "scan-sim":
        for bs in a.block:
            print(json.dumps(scan_report(bs, hot=a.hot, top_k=a.top_k)))
        return 0
    root = resolve_src_root(a.src)
    margs, wrappers = _sparse_cache_call(a)
    if a.cmd == "ninja":
        kpath = kernel_path(root)
        files = [str((kpath / "csrc/kvcacheio/hisparse.cuh").resolve())]
        print(ninja_text(name=module_name(margs), include_paths=[str(kpath / "include")], arch=a.arch,
                         tvm_ffi=tvm_ffi_paths(a.tvm_ffi)))  # fmt: skip
        print("----- cuda.cu")
        print(wrapper_source(files, wrappers))
        return 0
    so = build_module(root, margs, cuda_files=["kvcacheio/hisparse.cuh"], cuda_wrappers=wrappers,
                      arch=a.arch, tvm_ffi_dir=a.tvm_ffi, force=a.force, verbose=a.ptxas_v)  # fmt: skip
    print(so)
    return 0


if __name__ == "__main__":
    sys.exit(main())
