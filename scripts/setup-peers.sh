#!/usr/bin/env bash
# Build the E1 peer harness once per allocator users would pick instead of
# iopages: glibc, jemalloc, mimalloc, tcmalloc (gperftools) and DPDK's
# rte_mempool — and iopages itself through its C ABI when libiopages can be
# found or built (peer-iopages-c). Installs the Debian packages it needs
# when they are missing (as root), then compiles peers/peer_bench.c into
# OUT/peer-NAME.
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
# iopages itself through its C ABI (crates/iopages-ffi): optional. The
# library comes from IOPAGES_PREFIX (an install by scripts/install-c.sh),
# else pkg-config, else a release build of this workspace. Without it the
# row is reported as unavailable and everything above is unaffected.
build_iopages() {
  rm -f "$out/peer-iopages-c" "$out/peer-iopages-c.err"
  local cflags libs
  if [ -n "${IOPAGES_PREFIX:-}" ] && [ -f "$IOPAGES_PREFIX/include/iopages.h" ]; then
    cflags="-I$IOPAGES_PREFIX/include"
    libs="-L$IOPAGES_PREFIX/lib -Wl,-rpath,$IOPAGES_PREFIX/lib -liopages"
  elif pkg-config --exists iopages 2>/dev/null; then
    cflags=$(pkg-config --cflags iopages)
    libs="$(pkg-config --libs iopages) -Wl,-rpath,$(pkg-config --variable=libdir iopages)"
  elif command -v cargo >/dev/null && cargo build --release -q -p iopages-ffi >"$out/iopages-ffi-build.log" 2>&1; then
    local tdir=${CARGO_TARGET_DIR:-target}/release
    tdir=$(cd "$tdir" && pwd)
    cflags="-Icrates/iopages-ffi/include"
    # cargo's libiopages_ffi.so answers to libiopages.so (its soname): a
    # link of that name beside the harness.
    ln -sf "$tdir/libiopages_ffi.so" "$out/libiopages.so"
    libs="-L$out -Wl,-rpath,$out -liopages"
  else
    echo "libiopages not found (set IOPAGES_PREFIX, install it with scripts/install-c.sh, or make cargo build -p iopages-ffi work; see $out/iopages-ffi-build.log)" >"$out/peer-iopages-c.err"
    echo "setup-peers: iopages-c: libiopages not available" >&2
    return
  fi
  # shellcheck disable=SC2086
  build iopages-c -DPEER_IOPAGES -DHAVE_IOPAGES $cflags $libs
}
build_iopages
exit 0
