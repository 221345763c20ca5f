#!/usr/bin/env bash
# Fill the git-ignored carry folders for the lent GPU machine (Python 3.12, x86-64, no network there).
# Run from the repo root on a machine with PyPI access:
#   bash scripts/env/fetch_gpu_wheels.sh
# * .whl/: the wheels listed in scripts/env/gpu-wheels.txt (the server's pure-Python dependencies and
#   the FlashMLA wheel);
# * .gpu/: DeepGEMM's sources, the pinned sglang wheel trimmed of what the server never imports, and
#   0.5.23's HiSparse sources (scripts/env/gpu_bundle.py fetch; DeepGEMM comes from a git clone,
#   DEEPGEMM_GIT, default the session's mirror of github:deepseek-ai/DeepGEMM).
# Then `gpu_bundle.py check` verifies it all and prints the carry against the 64 MiB a device call
# takes. Pass carry [".whl", ".gpu"] to the device run and `source scripts/gpu_env.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .gpu/cache
grep -v '^\s*#' scripts/env/gpu-wheels.txt | grep -v '^\s*$' >.whl/.reqs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl -r .whl/.reqs
rm -f .whl/.reqs
rm -f .gpu/cache/*.whl .gpu/cache/*.whl.tmp .gpu/cache/*.tar.gz  # the full wheel, the 0.5.10 sdist
python3 scripts/env/gpu_bundle.py fetch
ls .whl | wc -l | xargs echo "wheels in .whl:"
python3 scripts/env/gpu_bundle.py check
