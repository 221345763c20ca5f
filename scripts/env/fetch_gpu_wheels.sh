#!/usr/bin/env bash
# Download the wheels listed in scripts/env/gpu-wheels.txt into .whl/ (git-ignored) for the lent GPU
# machine (Python 3.12, x86-64, no network there). Run from the repo root on a machine with PyPI access:
#   bash scripts/env/fetch_gpu_wheels.sh
# Also copies the pinned sglang sdist into .gpu/cache/ (scripts/gpu_env.sh builds the tree from it).
# Then pass carry [".whl", ".gpu"] to the device run and `source scripts/gpu_env.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .gpu/cache
grep -v '^\s*#' scripts/env/gpu-wheels.txt | grep -v '^\s*$' >.whl/.reqs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl -r .whl/.reqs
rm -f .whl/.reqs
sdist="$(sed -n 's/^sdist=//p' patches/base)"
cache="${KV_OFFLOAD_CACHE:-$HOME/.cache/kv-offload}"
if [ ! -f ".gpu/cache/$sdist" ]; then
  if [ ! -f "$cache/$sdist" ]; then
    python3 scripts/kv_offload_tree.py check >/dev/null  # fetches and sha256-checks the pinned sdist
  fi
  cp "$cache/$sdist" ".gpu/cache/$sdist"
fi
# SGLang 0.5.23's HiSparse sources (about 0.8 MB of its cp311-only wheel, sha256-checked by the
# loader) for the side-by-side benchmarks: benchmark/kv_offload/hisparse_0523/README.md
if [ ! -f .gpu/sglang-0.5.23/SOURCE ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_34_x86_64 -d "${TMPDIR:-/tmp}/sg0523" sglang==0.5.23
  python3 benchmark/kv_offload/hisparse_0523/loader.py extract \
    "${TMPDIR:-/tmp}"/sg0523/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl .gpu/sglang-0.5.23
fi
ls .whl | wc -l | xargs echo "wheels in .whl:"
du -sh .whl .gpu | tr '\n' ' '; echo
