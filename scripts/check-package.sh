#!/usr/bin/env bash
# Checks that the published crates (iopages, iopages-crypt, iopages-nbd,
# iopages-ffi) package for crates.io, without publishing anything:
#
# 1. each crate's README shows the same example as its crate-level docs
#    (where `cargo test --doc` runs it);
# 2. `cargo package --list` per crate: no file under a target/ directory,
#    none over 1 MiB;
# 3. `cargo package` of the four at once, in dependency order against a
#    local overlay registry (the siblings are not on crates.io), including
#    verification: each unpacked .crate is built on its own. The builds use
#    the workspace's target directory and [profile.test]'s opt-level, so
#    they reuse what `cargo test` built (the vendored OpenSSL is not built
#    again);
# 4. the .crate files themselves: their sizes, a README in each, nothing
#    over 1 MiB and nothing from a target/ directory inside.
#
# With --install-check, also `cargo install --path crates/iopages-cli`
# into a temporary root (release profile, the same target directory) and
# runs the installed `iopages --help`.
#
# Needs a clean git tree in the packaged crates (as a CI checkout is) and
# network access to the crates.io index. Prints how long each step took.
set -euo pipefail
cd "$(dirname "$0")/.."

install_check=0
for arg in "$@"; do
  case "$arg" in
    --install-check) install_check=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "check-package: unknown argument $arg (only --install-check)" >&2
      exit 2
      ;;
  esac
done

crates=(iopages iopages-crypt iopages-nbd iopages-ffi)
max_bytes=$((1 << 20))
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# Verification builds each unpacked crate with the dev profile, and a
# packaged manifest carries none of the workspace's [profile.*] tables.
# With the dev profile's opt-level set to [profile.test]'s, those builds
# reuse every dependency `cargo test` has built in the target directory
# (the vendored OpenSSL above all) instead of building them all again:
# cargo's artifact hashes depend on a profile's settings, not its name.
test_opt_level=$(awk '
  /^\[/ { in_test = ($0 == "[profile.test]") }
  in_test && $1 == "opt-level" { gsub(/[" ]/, "", $3); print $3 }
' Cargo.toml)
export CARGO_PROFILE_DEV_OPT_LEVEL="${CARGO_PROFILE_DEV_OPT_LEVEL:-${test_opt_level:-0}}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
fail=0

step_start() {
  step_name=$1
  step_t0=$SECONDS
  echo "check-package: $step_name"
}
step_end() {
  echo "check-package: $step_name took $((SECONDS - step_t0)) s"
}
bad() {
  echo "check-package: FAIL: $*" >&2
  fail=1
}

# The first fenced code block that is Rust (no info string or `rust`) of a
# README, or of a lib.rs's `//!` lines.
first_example() {
  awk -v docs="$2" '
    docs == 1 { if ($0 !~ /^\/\/!/) next; sub(/^\/\/! ?/, "") }
    !open && /^[[:space:]]*```/ {
      lang = $0; sub(/^[[:space:]]*```/, "", lang); sub(/,.*/, "", lang)
      gsub(/[[:space:]]/, "", lang); open = 1; body = ""; next
    }
    open && /^[[:space:]]*```[[:space:]]*$/ {
      if (lang == "" || lang == "rust") { printf "%s", body; found = 1; exit }
      open = 0; next
    }
    open { body = body $0 "\n" }
    END { if (!found) exit 1 }
  ' "$1"
}

step_start "README examples match the crate docs"
for c in "${crates[@]}"; do
  dir=crates/$c
  if ! readme=$(first_example "$dir/README.md" 0); then
    bad "$dir/README.md has no Rust example"
    continue
  fi
  if ! docs=$(first_example "$dir/src/lib.rs" 1); then
    bad "$dir/src/lib.rs has no crate-level example"
    continue
  fi
  if [ "$readme" != "$docs" ]; then
    bad "$dir/README.md's example differs from the one in $dir/src/lib.rs:"
    diff <(printf '%s\n' "$docs") <(printf '%s\n' "$readme") >&2 || true
  fi
done
step_end

step_start "cargo package --list"
for c in "${crates[@]}"; do
  list=$(cargo package --list --locked -q -p "$c")
  echo "$c: $(printf '%s\n' "$list" | wc -l) files"
  while IFS= read -r f; do
    case "/$f" in */target/*) bad "$c would package $f (a build directory)" ;; esac
    # Generated files (Cargo.toml.orig, .cargo_vcs_info.json, Cargo.lock)
    # are not in the crate's directory; the .crate check below sees them.
    if [ -f "crates/$c/$f" ]; then
      size=$(stat -c %s "crates/$c/$f")
      if [ "$size" -gt "$max_bytes" ]; then
        bad "$c would package $f, $size bytes (over 1 MiB)"
      fi
    fi
  done <<<"$list"
done
step_end
[ "$fail" = 0 ] || exit 1

step_start "cargo package (with verification)"
# cargo unpacks the overlay registry's crates under CARGO_HOME, in a
# folder named after the registry's path (target/package/tmp-registry):
# a checkout at the same path as an earlier one would find that run's
# sources of these crates already unpacked, at the same version, and
# verify against them instead of this tree's. Remove them first.
version=$(cargo pkgid --locked -p iopages | sed 's/.*[@#]//')
cargo_home=${CARGO_HOME:-$HOME/.cargo}
for reg in "$cargo_home"/registry/src/-* "$cargo_home"/registry/cache/-*; do
  [ -d "$reg" ] || continue
  for c in "${crates[@]}"; do
    rm -rf "${reg:?}/$c-$version" "${reg:?}/$c-$version.crate"
  done
done
pkg_args=()
for c in "${crates[@]}"; do pkg_args+=(-p "$c"); done
cargo package --locked "${pkg_args[@]}"
step_end

step_start "the .crate files"
version=$(cargo pkgid --locked -p iopages | sed 's/.*[@#]//')
for c in "${crates[@]}"; do
  file=$CARGO_TARGET_DIR/package/$c-$version.crate
  if [ ! -f "$file" ]; then
    bad "$file is missing"
    continue
  fi
  entries=$(tar -tzvf "$file")
  printf '%8d bytes  %4d files  %s\n' "$(stat -c %s "$file")" \
    "$(printf '%s\n' "$entries" | wc -l)" "$file"
  # tar -tv: mode owner/group size date time path
  while read -r _ _ size _ _ path; do
    case "$path" in
      "$c-$version"/*) ;;
      *) bad "$file holds $path, outside $c-$version/" ;;
    esac
    case "/$path" in */target/*) bad "$file holds $path (a build directory)" ;; esac
    if [ "$size" -gt "$max_bytes" ]; then
      bad "$file holds $path, $size bytes (over 1 MiB)"
    fi
  done <<<"$entries"
  if ! printf '%s\n' "$entries" | grep -q " $c-$version/README.md\$"; then
    bad "$file has no README.md"
  fi
done
step_end

if [ "$install_check" = 1 ]; then
  step_start "cargo install --path crates/iopages-cli"
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  cargo install --locked --path crates/iopages-cli --root "$root" \
    --target-dir "$CARGO_TARGET_DIR"
  # As a user finds it: through PATH, the way ~/.cargo/bin is.
  found=$(PATH="$root/bin:$PATH" command -v iopages || true)
  [ "$found" = "$root/bin/iopages" ] || bad "iopages on PATH is '$found', not the installed $root/bin/iopages"
  if help=$(PATH="$root/bin:$PATH" iopages --help); then
    for word in serve luks bench; do
      if ! printf '%s\n' "$help" | grep -qw "$word"; then
        bad "the installed iopages --help does not mention $word"
      fi
    done
    echo "$root/bin/iopages --help: ok ($(printf '%s\n' "$help" | wc -l) lines)"
  else
    bad "the installed $root/bin/iopages --help failed"
  fi
  step_end
fi

[ "$fail" = 0 ] || exit 1
echo "check-package: ok in $SECONDS s"
