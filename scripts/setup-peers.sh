#!/usr/bin/env bash
# Build the E1 peer harness once per allocator users would pick instead of
# iopages: glibc, jemalloc, mimalloc, tcmalloc (gperftools) and DPDK's
# rte_mempool. Installs the Debian packages it needs when they are missing
# (as root), then compiles peers/peer_bench.c into OUT/peer-NAME.
# A peer that cannot be built gets OUT/peer-NAME.err with the reason instead;
# the benchmark reports it and runs the others.
#
# Usage: scripts/setup-peers.sh [OUT]   (default: target/peers)
set -u
cd "$(dirname "$0")/.."
out=${1:-target/peers}
mkdir -p "$out"
src=peers/peer_bench.c
pkgs=(gcc pkg-config libjemalloc-dev libmimalloc-dev libgoogle-perftools-dev libdpdk-dev)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-peers: installing ${missing[*]}" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$out/apt.log" 2>&1 \
      || echo "setup-peers: apt-get failed, see $out/apt.log" >&2
  else
    echo "setup-peers: missing packages ${missing[*]} (run as root, or install them)" >&2
  fi
fi

build() { # name, then compiler flags
  local name=$1; shift
  rm -f "$out/peer-$name" "$out/peer-$name.err"
  if ! gcc -O2 -g -std=gnu11 -Wall -o "$out/peer-$name" "$src" "$@" -lpthread >"$out/peer-$name.log" 2>&1; then
    { echo "build failed: gcc $*"; tail -n 5 "$out/peer-$name.log"; } >"$out/peer-$name.err"
    rm -f "$out/peer-$name"
    echo "setup-peers: $name: $(head -n 1 "$out/peer-$name.err")" >&2
    return
  fi
  echo "setup-peers: built $out/peer-$name" >&2
}

build glibc -DPEER_GLIBC
build jemalloc -DPEER_JEMALLOC -ljemalloc
build mimalloc -DPEER_MIMALLOC -lmimalloc
build tcmalloc -DPEER_TCMALLOC -ltcmalloc
if pkg-config --exists libdpdk 2>/dev/null; then
  # shellcheck disable=SC2046
  build dpdk -DPEER_DPDK $(pkg-config --cflags libdpdk) $(pkg-config --libs libdpdk)
  # shellcheck disable=SC2046
  build dpdk-aligned -DPEER_DPDK_ALIGNED $(pkg-config --cflags libdpdk) $(pkg-config --libs libdpdk)
else
  rm -f "$out/peer-dpdk" "$out/peer-dpdk-aligned"
  echo "libdpdk not found by pkg-config (package libdpdk-dev)" >"$out/peer-dpdk.err"
  echo "libdpdk not found by pkg-config (package libdpdk-dev)" >"$out/peer-dpdk-aligned.err"
  echo "setup-peers: dpdk: libdpdk-dev missing" >&2
fi
exit 0
