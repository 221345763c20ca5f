#!/usr/bin/env bash
# Download the wheels listed in scripts/env/gpu-wheels.txt into .whl/ (git-ignored) for the lent GPU
# machine (Python 3.12, x86-64, no network there). Run from the repo root on a machine with PyPI access:
#   bash scripts/env/fetch_gpu_wheels.sh
# Also copies the pinned sglang wheel (patches/base `wheel=`, sha256-checked) into .gpu/cache/:
# scripts/gpu_env.sh builds the patched tree from it there (the tree tool finds it in KV_OFFLOAD_CACHE
# and fetches nothing). Then pass carry [".whl", ".gpu"] to the device run and `source
# scripts/gpu_env.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .gpu/cache
grep -v '^\s*#' scripts/env/gpu-wheels.txt | grep -v '^\s*$' >.whl/.reqs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl -r .whl/.reqs
rm -f .whl/.reqs
# One version of each package (pip install refuses two): drop wheels a former list left behind.
python3 - <<'PY'
import pathlib, re
want = {}
for line in pathlib.Path("scripts/env/gpu-wheels.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = line.split("==")
        want[re.sub(r"[-_.]+", "_", name).lower()] = version
for whl in pathlib.Path(".whl").glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    if want.get(re.sub(r"[-_.]+", "_", name).lower()) != version:
        print(f"removing {whl} (not in scripts/env/gpu-wheels.txt)")
        whl.unlink()
PY
wheel="$(sed -n 's/^wheel=//p' patches/base)"
sha="$(sed -n 's/^sha256=//p' patches/base)"
cache="${KV_OFFLOAD_CACHE:-$HOME/.cache/kv-offload}"
rm -f .gpu/cache/*.tar.gz .gpu/cache/*.whl.tmp  # the 0.5.10 sdist
if [ ! -f ".gpu/cache/$wheel" ] || ! echo "$sha  .gpu/cache/$wheel" | sha256sum -c --quiet; then
  if [ ! -f "$cache/$wheel" ]; then
    python3 scripts/kv_offload_tree.py check >/dev/null  # fetches and sha256-checks the pinned wheel
  fi
  cp "$cache/$wheel" ".gpu/cache/$wheel.tmp"
  echo "$sha  .gpu/cache/$wheel.tmp" | sha256sum -c --quiet
  mv ".gpu/cache/$wheel.tmp" ".gpu/cache/$wheel"
fi
# SGLang 0.5.23's HiSparse sources for the side-by-side benchmarks (.gpu/sglang-0.5.23) are extracted
# from this wheel by scripts/gpu_env.sh on the GPU machine, so .gpu holds only the wheel.
rm -rf .gpu/sglang-0.5.23
ls .whl | wc -l | xargs echo "wheels in .whl:"
python3 - <<'PY'
import os, pathlib, subprocess
mib = lambda n: n / 1048576
carry = sum(f.stat().st_size for d in (".whl", ".gpu") for f in pathlib.Path(d).rglob("*") if f.is_file())
files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
print(f"carry .whl + .gpu: {mib(carry):.1f} MiB; with this work tree ({mib(tree):.1f} MiB): "
      f"{mib(carry + tree):.1f} MiB of the 64 MiB a device call takes")
PY
