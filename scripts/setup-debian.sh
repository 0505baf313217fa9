#!/usr/bin/env bash
# Install the Debian packages the workspace needs to build, test and run its
# benchmarks, when they are missing. Idempotent: installs nothing (and does
# not touch the network) when everything is there.
#
#   openssl               the `openssl speed` reference row of `iopages bench xts`
#   python3-cryptography  the outside implementation the crypt tests decrypt
#                         the backends' ciphertext with
#   qemu-utils            qemu-io, qemu-img and qemu-nbd: NBD clients of the
#                         server's interop tests, qemu's LUKS driver, a peer
#                         of `iopages bench nbd`, and qemu-nbd a remote store
#                         of tests/stores.rs
#   nbd-server            Debian's NBD server: a remote store of
#                         tests/stores.rs
#   cryptsetup-bin        cryptsetup: formats the LUKS volumes the tests open,
#                         and checks the ones `iopages luks format` makes
#   nbdkit                nbdkit and its luks filter: reads our LUKS1 volumes
#                         in the interop tests, a peer of `iopages bench nbd`
#   libnbd-bin            nbdcopy and nbdinfo, NBD clients of the tests and
#                         the benchmark
#   fio                   fio's nbd engine: the verify job of the tests and
#                         the load of `iopages bench nbd`
#   gcc, g++              the C ABI's tests: the C programs and examples
#                         (also under AddressSanitizer), and the header
#                         compiled as C++
#   prometheus            promtool: checks a live /metrics scrape and the
#                         alert rules in contrib/prometheus/
#   systemd               systemd-analyze (verifies the packaged units) and
#                         systemd-socket-activate (starts the packaged
#                         binary as its socket unit would) for
#                         scripts/test-deb.sh; no systemd as PID 1 is needed
#   groff-base            groff: tests/manual.rs renders every man page and
#                         fails on any warning
#   dpkg-dev              dpkg-shlibdeps and dpkg-architecture for
#                         scripts/build-deb.sh (dpkg-deb itself is dpkg's)
#
# Ceph (the third store of tests/stores.rs, and `iopages bench nbd --remote
# --store ceph`) is not installed here: scripts/ceph-store.sh installs it
# when asked (IOPAGES_CEPH=1 for the test).
#
# (The `openssl` crate builds OpenSSL from source — its `vendored` feature —
# so building and testing need no -dev package.)
#
# Usage: scripts/setup-debian.sh   (as root, or with the packages installed)
set -euo pipefail
pkgs=(openssl python3-cryptography qemu-utils nbd-server cryptsetup-bin nbdkit libnbd-bin fio gcc g++ prometheus systemd groff-base dpkg-dev)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-debian: missing packages ${missing[*]}: install them (apt-get install ${missing[*]}) or run this script as root" >&2
  exit 1
fi
echo "setup-debian: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
