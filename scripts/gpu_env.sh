#!/usr/bin/env bash
# Source from the repo root on the lent GPU machine (no network there):
#   source scripts/gpu_env.sh
# Needs, carried from the development machine (both git-ignored):
#   .whl/       py3.12 wheels of the pure-Python packages the GPU image lacks (pybase64, orjson, openai,
#               msgspec, gguf, compressed-tensors, IPython, ..., apache-tvm-ffi for the community JIT kernels)
#   .gpu/cache/ the pinned sglang sdist (the tool verifies its sha256)
# Builds the patched tree under /tmp and puts it first on PYTHONPATH, with the sgl_kernel import-time
# stand-in (the image has no sgl_kernel; nothing here calls its ops).
KVO_ROOT="$(pwd)"
python3 -m pip install -q --no-index --no-deps --target /tmp/kvo-site "$KVO_ROOT"/.whl/*.whl
KV_OFFLOAD_CACHE="$KVO_ROOT/.gpu/cache" python3 "$KVO_ROOT/scripts/kv_offload_tree.py" \
  --build-dir /tmp/kvb build --no-venv
mkdir -p /tmp/kvo-stubs && cp -r "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/sgl_kernel" /tmp/kvo-stubs/
export KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES=1
export PYTHONPATH="/tmp/kvb/sglang/python:/tmp/kvo-stubs:/tmp/kvo-site${PYTHONPATH:+:$PYTHONPATH}"
