#!/usr/bin/env bash
# Source from the repo root on the lent GPU machine (no network there):
#   source scripts/gpu_env.sh
# Needs, carried from the development machine (both git-ignored; `bash scripts/env/fetch_gpu_wheels.sh`
# fills them and prints their size, then pass carry [".whl", ".gpu"] to the device run; about 50 MiB
# with the work tree's 2, of the 64 MiB a call takes):
#   .whl/       py3.12 wheels of the packages the GPU image lacks, listed in scripts/env/gpu-wheels.txt
#               (the HTTP server stack, pydantic, openai, orjson, pybase64, msgspec, pyzmq, xgrammar,
#               apache-tvm-ffi, soundfile, ...; the image's transformers 5.17 and tokenizers 0.23.2 serve)
#   .gpu/cache/ the pinned sglang wheel (patches/base `wheel=`; the tree tool verifies its sha256 and,
#               finding it in KV_OFFLOAD_CACHE, fetches nothing)
# Builds the patched tree under /tmp from that wheel's Python sources (its cp311 Rust extension
# modules load lazily and are not used), extracts the HiSparse sources of the side-by-side benchmarks
# into .gpu/sglang-0.5.23, and puts the tree first on PYTHONPATH with the sgl_kernel and flash_mla
# import-time stand-ins (the image has neither). The tiny real server (scripts/tiny_server.py and
# benchmark/kv_offload/tiny_server_gpu.py) adds the rest of its GPU environment itself (see
# server_env: gpu_stubs/flashinfer, the kernel stand-ins and the upstream switches).
KVO_ROOT="$(pwd)"
if ! ls "$KVO_ROOT"/.whl/*.whl >/dev/null 2>&1; then
  echo "gpu_env: no wheels in $KVO_ROOT/.whl (run scripts/env/fetch_gpu_wheels.sh here and carry .whl)" >&2
  return 1 2>/dev/null || exit 1
fi
if ! ls "$KVO_ROOT"/.gpu/cache/"$(sed -n 's/^wheel=//p' "$KVO_ROOT/patches/base")" >/dev/null 2>&1; then
  echo "gpu_env: the pinned sglang wheel is not in $KVO_ROOT/.gpu/cache (run scripts/env/fetch_gpu_wheels.sh here and carry .gpu)" >&2
  return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/kvo-site "$KVO_ROOT"/.whl/*.whl || { echo "gpu_env: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
KV_OFFLOAD_CACHE="$KVO_ROOT/.gpu/cache" python3 "$KVO_ROOT/scripts/kv_offload_tree.py" \
  --build-dir /tmp/kvb build --no-venv || { echo "gpu_env: tree build failed" >&2; return 1 2>/dev/null || exit 1; }
# SGLang 0.5.23's HiSparse sources for the side-by-side benchmarks (benchmark/kv_offload/hisparse_0523,
# bench_exposed.py): a subset of the same wheel, sha256-checked by the loader.
if [ ! -f "$KVO_ROOT/.gpu/sglang-0.5.23/SOURCE" ]; then
  python3 "$KVO_ROOT/benchmark/kv_offload/hisparse_0523/loader.py" extract \
    "$KVO_ROOT/.gpu/cache/$(sed -n 's/^wheel=//p' "$KVO_ROOT/patches/base")" "$KVO_ROOT/.gpu/sglang-0.5.23" >/dev/null \
    || echo "gpu_env: could not extract the HiSparse sources (only the side-by-side benchmarks need them)" >&2
fi
rm -rf /tmp/kvo-stubs && mkdir -p /tmp/kvo-stubs
cp -r "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/sgl_kernel" "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/flash_mla" /tmp/kvo-stubs/
export KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONPATH="/tmp/kvb/sglang/python:/tmp/kvo-stubs:/tmp/kvo-site${PYTHONPATH:+:$PYTHONPATH}"
