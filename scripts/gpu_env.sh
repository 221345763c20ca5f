#!/usr/bin/env bash
# Source from the repo root on the lent GPU machine (no network there):
#   source scripts/gpu_env.sh
# Needs, carried from the development machine (both git-ignored; `bash scripts/env/fetch_gpu_wheels.sh`
# fills them, then pass carry [".whl", ".gpu"] to the device run):
#   .whl/       py3.12 wheels of the packages the GPU image lacks, listed in scripts/env/gpu-wheels.txt
#               (the HTTP server stack, pydantic, openai, orjson, pybase64, msgspec, pyzmq, IPython, ...,
#               and sglang's pinned transformers 5.3.0 / tokenizers 0.22.2)
#   .gpu/cache/ the pinned sglang sdist (the tool verifies its sha256)
# Builds the patched tree under /tmp and puts it first on PYTHONPATH, with the sgl_kernel import-time
# stand-in (the image has no sgl_kernel). The tiny real server (scripts/tiny_server.py and
# benchmark/kv_offload/tiny_server_gpu.py) adds the rest of its GPU environment itself (see
# server_env: gpu_stubs/flashinfer, the kernel stand-ins and the upstream switches).
KVO_ROOT="$(pwd)"
if ! ls "$KVO_ROOT"/.whl/*.whl >/dev/null 2>&1; then
  echo "gpu_env: no wheels in $KVO_ROOT/.whl (run scripts/env/fetch_gpu_wheels.sh here and carry .whl)" >&2
  return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/kvo-site "$KVO_ROOT"/.whl/*.whl || { echo "gpu_env: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
KV_OFFLOAD_CACHE="$KVO_ROOT/.gpu/cache" python3 "$KVO_ROOT/scripts/kv_offload_tree.py" \
  --build-dir /tmp/kvb build --no-venv || { echo "gpu_env: tree build failed" >&2; return 1 2>/dev/null || exit 1; }
mkdir -p /tmp/kvo-stubs && cp -r "$KVO_ROOT/test/srt/kv_offload/cpu_stubs/sgl_kernel" /tmp/kvo-stubs/
export KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES=1
export PYTHONPATH="/tmp/kvb/sglang/python:/tmp/kvo-stubs:/tmp/kvo-site${PYTHONPATH:+:$PYTHONPATH}"
