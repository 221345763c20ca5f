#!/usr/bin/env bash
# Native libraries that the mooncake-transfer-engine-non-cuda wheel loads at import time and that a
# slim Debian image lacks: libibverbs.so.1 and its libnl dependencies (no RDMA device is needed: on a
# machine without one Mooncake falls back to TCP). Nothing is installed system-wide: the .debs are
# fetched with `apt-get download` (then `apt-get update` and a retry if that fails) and unpacked with
# `dpkg-deb -x`; the shared objects end up, flat, in DEST/lib.
#
#   scripts/env/fetch_debian_libs.sh [DEST]     DEST defaults to ${KV_OFFLOAD_CACHE:-~/.cache/kv-offload}/debroot
#
# Prints DEST/lib on success. Idempotent: does nothing when DEST/lib already holds every library.
set -euo pipefail

PACKAGES=(libibverbs1 libnl-3-200 libnl-route-3-200)
SONAMES=(libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200)

cache="${KV_OFFLOAD_CACHE:-$HOME/.cache/kv-offload}"
dest="${1:-$cache/debroot}"
lib="$dest/lib"

have_all() {
  local so
  for so in "${SONAMES[@]}"; do
    [ -e "$lib/$so" ] || return 1
  done
}

if have_all; then
  echo "$lib"
  exit 0
fi

for tool in apt-get dpkg-deb; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "fetch_debian_libs: '$tool' not found; install ${PACKAGES[*]} another way and put ${SONAMES[*]} in $lib" >&2
    exit 1
  fi
done

mkdir -p "$dest"
work="$(mktemp -d "$dest/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt's _apt sandbox user must be able to write the .debs

download() { (cd "$work/debs" && apt-get download -q "${PACKAGES[@]}") >"$work/apt.log" 2>&1; }

mkdir -p "$work/debs" "$work/root" "$work/lib"
chmod 777 "$work/debs"
if ! download; then
  echo "fetch_debian_libs: apt-get download failed; running apt-get update and retrying" >&2
  if ! apt-get update -q >"$work/update.log" 2>&1 || ! download; then
    echo "fetch_debian_libs: could not download ${PACKAGES[*]}:" >&2
    cat "$work/update.log" "$work/apt.log" >&2 2>/dev/null || true
    exit 1
  fi
fi

for deb in "$work"/debs/*.deb; do
  dpkg-deb -x "$deb" "$work/root"
done
# Flatten: every shared object (files and their soname links) from the multiarch lib folders.
find "$work/root" \( -type f -o -type l \) -name '*.so*' -exec cp -P {} "$work/lib/" \;

for so in "${SONAMES[@]}"; do
  if [ ! -e "$work/lib/$so" ]; then
    echo "fetch_debian_libs: $so missing from the unpacked packages (${PACKAGES[*]})" >&2
    exit 1
  fi
done

rm -rf "$lib"
mv "$work/lib" "$lib"
echo "$lib"
