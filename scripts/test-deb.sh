#!/usr/bin/env bash
# Install the Debian package, use it as an operator would, and purge it.
#
#   scripts/test-deb.sh [PACKAGE.deb]   (default: target/debian/iopages_*.deb)
#
# Needs root (dpkg -i). CI runs it after scripts/build-deb.sh; without root
# it says so and stops (an error under CI=true). These machines have no
# systemd as PID 1, so the socket unit is exercised the way systemd would
# run it: systemd-socket-activate binds the unit's ListenStream= socket and
# starts the unit's own ExecStart= line (with %i and %d filled in) as the
# unit's User=, with the passphrase in a credentials directory.
#
# Checks, in order: dpkg -i; `iopages --version` and `iopages serve --help`
# from /usr/bin; the iopages user and the directories with their owners and
# modes; man pages and completions in place; systemd-analyze verify on the
# installed units; a volume formatted, served through the socket, written,
# read back and found encrypted on disk; a clean stop on SIGTERM; dpkg -P
# leaves none of the package's files behind, only /var/lib/iopages.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "test-deb: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

if [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = true ]; then fail "must run as root under CI=true"; fi
  say "skipped: needs root (dpkg -i)"; exit 0
fi
deb=${1:-}
if [ -z "$deb" ]; then
  for f in target/debian/iopages_*.deb; do deb=$f; done
fi
[ -f "$deb" ] || fail "no package: run scripts/build-deb.sh first"

name=debtest
unit_dir=/usr/lib/systemd/system
work=$(mktemp -d)
server=
sock=
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  rm -rf "$work" "/etc/iopages/$name.pass" "/var/lib/iopages/$name.luks" ${sock:+"$sock"}
}
trap cleanup EXIT

install_package() {
  if dpkg-query -W -f='${Status}' iopages 2>/dev/null | grep -q installed; then
    say "purging an iopages package already installed"
    dpkg -P iopages >/dev/null
  fi
  say "dpkg -i $deb"
  dpkg -i "$deb" >/dev/null
  dpkg -L iopages > "$work/files"
}

check_binary() {
  [ "$(command -v iopages)" = /usr/bin/iopages ] || fail "iopages on PATH is $(command -v iopages), not /usr/bin/iopages"
  /usr/bin/iopages --version > "$work/version" || fail "iopages --version failed"
  grep -q "$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)" "$work/version" \
    || fail "iopages --version does not name the version: $(cat "$work/version")"
  grep -Eq '^commit: ([0-9a-f]{12}|built outside a git checkout)' "$work/version" \
    || fail "iopages --version does not say which commit it was built from"
  grep -q '^aes-xts: ' "$work/version" || fail "iopages --version does not name the AES-XTS path"
  /usr/bin/iopages serve --help | grep -q -- '--image' || fail "iopages serve --help does not list --image"
  say "/usr/bin/iopages --version: $(tr '\n' ';' < "$work/version")"
}

# owner, group and mode of a path, as "user:group mode".
perms() { stat -c '%U:%G %a' "$1"; }

check_layout() {
  getent passwd iopages | grep -q ':/usr/sbin/nologin$' || fail "no iopages system user with a nologin shell"
  [ "$(perms /var/lib/iopages)" = "iopages:iopages 700" ] || fail "/var/lib/iopages is $(perms /var/lib/iopages)"
  [ "$(perms /etc/iopages)" = "root:root 700" ] || fail "/etc/iopages is $(perms /etc/iopages)"
  for f in /usr/share/man/man1/iopages.1.gz /usr/share/man/man1/iopages-serve.1.gz \
      /usr/share/man/man5/iopages.toml.5.gz /usr/share/bash-completion/completions/iopages \
      /usr/share/doc/iopages/examples/iopages.toml /usr/share/doc/iopages/copyright \
      /usr/share/doc/iopages/examples/prometheus/iopages.rules.yml \
      /usr/share/doc/iopages/examples/grafana/iopages.json \
      "$unit_dir/iopages@.service" "$unit_dir/iopages@.socket"; do
    [ -s "$f" ] || fail "$f is missing or empty"
  done
  bash -n /usr/share/bash-completion/completions/iopages || fail "the bash completion does not parse"
}

check_units() {
  # --man=no: man(1) may be absent; the pages' presence is checked above.
  if ! systemd-analyze verify --man=no "$unit_dir/iopages@$name.socket" "$unit_dir/iopages@$name.service" \
      > "$work/verify" 2>&1; then
    cat "$work/verify" >&2
    fail "systemd-analyze verify rejected the installed units"
  fi
  if [ -s "$work/verify" ]; then cat "$work/verify" >&2; fail "systemd-analyze verify warned"; fi
  say "systemd-analyze verify: the units are clean"
}

# A unit's KEY= value for instance $name, credentials directory $2.
unit_value() {
  local v
  v=$(sed -n "s/^$1=//p" "$3" | head -n1)
  v=${v//%i/$name}
  v=${v//%d/$2}
  case "$v" in *%*) fail "unhandled specifier in $1=$v" ;; esac
  printf '%s' "$v"
}

make_volume() {
  (umask 077; printf %s 'operator passphrase' > "/etc/iopages/$name.pass")
  /usr/bin/iopages luks format --size 16M --type luks2 --pbkdf argon2id --iterations 4 --memory 1024 \
    --passphrase-file "/etc/iopages/$name.pass" "/var/lib/iopages/$name.luks" >/dev/null
  chown iopages: "/var/lib/iopages/$name.luks"
}

# Sets $sock and $server.
start_server() {
  local creds=$work/credentials cmd
  chmod 0711 "$work" # the server's user reaches its credentials, nothing else
  install -d -o iopages -g iopages -m 0500 "$creds"
  install -o iopages -g iopages -m 0400 "/etc/iopages/$name.pass" "$creds/$name.pass"
  sock=$(unit_value ListenStream "$creds" "$unit_dir/iopages@.socket")
  cmd=$(unit_value ExecStart "$creds" "$unit_dir/iopages@.service")
  install -d -m 0755 "$(dirname "$sock")"
  say "systemd-socket-activate -l $sock setpriv (as iopages) $cmd"
  # setpriv execs in place, so LISTEN_PID names the server itself.
  # shellcheck disable=SC2086
  systemd-socket-activate -l "$sock" \
    setpriv --reuid=iopages --regid=iopages --init-groups $cmd > "$work/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || { cat "$work/server.log" >&2; fail "no socket at $sock"; }
}

use_volume() {
  local uri
  uri="nbd+unix:///?socket=$sock"
  python3 -c "import sys; sys.stdout.buffer.write((b'iopages-deb-plaintext-marker ' * 40000)[:1 << 20])" > "$work/in"
  nbdcopy "$work/in" "$uri" || { cat "$work/server.log" >&2; fail "nbdcopy into the volume failed"; }
  nbdcopy "$uri" "$work/back"
  cmp -s -n 1048576 "$work/in" "$work/back" || fail "what was read back differs from what was written"
  if grep -q 'iopages-deb-plaintext-marker' "/var/lib/iopages/$name.luks"; then
    fail "the image holds the plaintext"
  fi
  say "1 MiB written through the socket, read back equal, ciphertext on disk"
}

stop_server() {
  kill -TERM "$server"
  local rc=0
  wait "$server" || rc=$?
  server=
  [ "$rc" = 0 ] || { cat "$work/server.log" >&2; fail "the server exited $rc on SIGTERM"; }
  say "stopped cleanly on SIGTERM"
}

purge_package() {
  rm -f "/etc/iopages/$name.pass"
  dpkg -P iopages >/dev/null || fail "dpkg -P failed"
  local left=0 f
  while read -r f; do
    [ -e "$f" ] || continue
    if [ -d "$f" ] && [ -n "$(ls -A "$f")" ]; then continue; fi # shared, still in use
    say "left behind: $f"; left=1
  done < "$work/files"
  [ "$left" = 0 ] || fail "dpkg -P left files of the package behind"
  [ ! -e /etc/iopages ] || fail "/etc/iopages is still there after purge (it was empty)"
  [ -f "/var/lib/iopages/$name.luks" ] || fail "purge removed the data directory's volume"
  say "purged: nothing left but /var/lib/iopages"
}

install_package
check_binary
check_layout
check_units
make_volume
start_server
use_volume
stop_server
purge_package
say "passed"
