#!/usr/bin/env bash
# Build libiopages (crates/iopages-ffi) in release and install it for C and
# C++ users: PREFIX/lib/libiopages.so and libiopages.a, PREFIX/include/iopages.h
# and PREFIX/lib/pkgconfig/iopages.pc (from crates/iopages-ffi/iopages.pc.in).
#
# Usage: scripts/install-c.sh PREFIX
# Then:  PKG_CONFIG_PATH=PREFIX/lib/pkgconfig cc app.c $(pkg-config --cflags --libs iopages)
#        (static: pkg-config --static --libs iopages, with PREFIX/lib/libiopages.a)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX" >&2
  exit 64
fi
mkdir -p "$1"
prefix=$(cd "$1" && pwd)

cargo build --release -p iopages-ffi
target=${CARGO_TARGET_DIR:-target}/release
# cargo names them libiopages_ffi.*; they are installed as libiopages.*
# (the shared library's soname is libiopages.so).
for f in libiopages_ffi.so libiopages_ffi.a; do
  [ -f "$target/$f" ] || { echo "install-c: $target/$f was not built" >&2; exit 1; }
done
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)

install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/libiopages_ffi.so" "$prefix/lib/libiopages.so"
install -m 0644 "$target/libiopages_ffi.a" "$prefix/lib/libiopages.a"
install -m 0644 crates/iopages-ffi/include/iopages.h "$prefix/include/iopages.h"
sed -e "s|@PREFIX@|$prefix|g" -e "s|@VERSION@|$version|g" \
  crates/iopages-ffi/iopages.pc.in >"$prefix/lib/pkgconfig/iopages.pc"
echo "install-c: installed libiopages $version under $prefix" >&2
