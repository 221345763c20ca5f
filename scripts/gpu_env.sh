#!/usr/bin/env bash
# Source from the repo root on the lent GPU machine (no network there):
#   source scripts/gpu_env.sh production    # FlashMLA, DeepGEMM and 0.5.23's JIT kernels
#   source scripts/gpu_env.sh [standins]    # every binary kernel as its torch stand-in (the default,
#                                           # what the journal's GPU figures so far ran)
# Needs the carry folders that `bash scripts/env/fetch_gpu_wheels.sh` fills here (both git-ignored;
# pass carry [".whl", ".gpu"] to the device run; `python3 scripts/env/gpu_bundle.py check` prints
# their size against the 64 MiB a call takes):
#   .whl/  py3.12 wheels the GPU image lacks (scripts/env/gpu-wheels.txt: the HTTP server stack,
#          apache-tvm-ffi for 0.5.23's JIT kernels, the sgl-flash-mla wheel, pytest, ...)
#   .gpu/  DeepGEMM's sources, the pinned sglang wheel trimmed of what the server never imports,
#          0.5.23's HiSparse sources (scripts/env/gpu_bundle.py says what each is and why)
# Builds the patched tree under /tmp/kvb from the trimmed wheel (scripts/kv_offload_tree.py verifies
# it against the wheel's RECORD), installs the wheels into /tmp/kvo-site and exports
# KV_OFFLOAD_KERNELS, which scripts/tiny_server.py (the tiny real server, tiny_server_gpu.py,
# bench_serving_dsa.py) and the stand-ins read. With production kernels it also builds DeepGEMM's
# host library against this torch (/tmp/kvo-deepgemm, about a minute; kept on a warm machine) and
# leaves only the sgl_kernel import stand-in on the path (sglang-kernel, 356 MiB, cannot travel: its
# norms, activations, sampling and MoE stay stand-ins, the same in every server compared).
KVO_KERNELS="${1:-standins}"
if [ "$KVO_KERNELS" != production ] && [ "$KVO_KERNELS" != standins ]; then
  echo "gpu_env: kernels must be 'production' or 'standins', not '$KVO_KERNELS'" >&2
  return 1 2>/dev/null || exit 1
fi
KVO_ROOT="$(pwd)"
python3 "$KVO_ROOT/scripts/env/gpu_bundle.py" check || { echo "gpu_env: the carried bundle is incomplete (see above)" >&2; return 1 2>/dev/null || exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/kvo-site "$KVO_ROOT"/.whl/*.whl || { echo "gpu_env: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
KV_OFFLOAD_CACHE="$KVO_ROOT/.gpu/cache" python3 "$KVO_ROOT/scripts/kv_offload_tree.py" \
  --build-dir /tmp/kvb build --no-venv || { echo "gpu_env: tree build failed" >&2; return 1 2>/dev/null || exit 1; }
rm -rf /tmp/kvo-stubs && mkdir -p /tmp/kvo-stubs
cp -r "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/sgl_kernel" /tmp/kvo-stubs/
KVO_PATH="/tmp/kvb/sglang/python:/tmp/kvo-stubs"
if [ "$KVO_KERNELS" = production ]; then
  python3 "$KVO_ROOT/scripts/env/gpu_bundle.py" build-deepgemm /tmp/kvo-deepgemm \
    || { echo "gpu_env: DeepGEMM build failed" >&2; return 1 2>/dev/null || exit 1; }
  KVO_PATH="$KVO_PATH:/tmp/kvo-deepgemm"
else
  cp -r "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/flash_mla" /tmp/kvo-stubs/
fi
export KV_OFFLOAD_KERNELS="$KVO_KERNELS"
export KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONPATH="$KVO_PATH:/tmp/kvo-site${PYTHONPATH:+:$PYTHONPATH}"
# The JIT caches (0.5.23's JIT kernels, DeepGEMM, Triton) in one folder. On a fresh machine the
# first server compiles them while capturing its first decode graph (about 2 minutes at the
# DeepSeek-V3.2 shapes); a carried .gpu/jit-cache.tar.gz, a tar of that folder from an earlier
# call (`tar -czf "$OUT/jit-cache.tar.gz" -C /tmp/kvo-jit .`), spares it that.
export SGLANG_JIT_CACHE_DIR=/tmp/kvo-jit/sglang
export DG_JIT_CACHE_DIR=/tmp/kvo-jit/deep_gemm
export TRITON_CACHE_DIR=/tmp/kvo-jit/triton
mkdir -p /tmp/kvo-jit
if [ -f "$KVO_ROOT/.gpu/jit-cache.tar.gz" ] && [ ! -e /tmp/kvo-jit/.restored ]; then
  tar -xzf "$KVO_ROOT/.gpu/jit-cache.tar.gz" -C /tmp/kvo-jit && touch /tmp/kvo-jit/.restored \
    || echo "gpu_env: could not restore .gpu/jit-cache.tar.gz; kernels compile again" >&2
fi
