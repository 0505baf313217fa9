#!/usr/bin/env bash
# Install the Debian packages the workspace needs to build, test and run its
# benchmarks, when they are missing. Idempotent: installs nothing (and does
# not touch the network) when everything is there.
#
#   openssl               the `openssl speed` reference row of `iopages bench xts`
#   python3-cryptography  the outside implementation the crypt tests decrypt
#                         the backends' ciphertext with
#   qemu-utils            qemu-io and qemu-img, the NBD clients the server's
#                         interop tests run
#
# (The `openssl` crate builds OpenSSL from source — its `vendored` feature —
# so building and testing need no -dev package.)
#
# Usage: scripts/setup-debian.sh   (as root, or with the packages installed)
set -euo pipefail
pkgs=(openssl python3-cryptography qemu-utils)

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
