#!/usr/bin/env bash
# Fuzz iopages on stable Rust: libFuzzer through cargo-fuzz, no sanitizer
# (`-s none`), so no nightly and no RUSTC_BOOTSTRAP. See docs/fuzzing.md.
#
# usage: scripts/fuzz.sh [--smoke] [SECONDS] [TARGET...]
#   --smoke   short run for CI (25 s per target unless SECONDS is given)
#   SECONDS   time per target (default 120)
#   TARGET    luks1 luks2 nbd_handshake nbd_transmission integrity (default: all)
#
# Installs cargo-fuzz (pinned) if missing, builds every target into
# $CARGO_TARGET_DIR (default target/fuzz of the main workspace, so CI's
# cache of target/ keeps the vendored OpenSSL build), runs each target for
# SECONDS on its committed seeds (fuzz/corpus/T, read-only) plus a working
# corpus (target/fuzz/work/T), and prints executions, exec/s and coverage
# per target. Exits non-zero if any target crashed, panicked, hung (the
# NBD targets panic on a 5 s stall; libFuzzer's -timeout catches the rest)
# or ran out of memory; the reproducer is in fuzz/artifacts/T/.
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
ALL_TARGETS=(luks1 luks2 nbd_handshake nbd_transmission integrity)

root=$(cd "$(dirname "$0")/.." && pwd)
smoke=0
secs=""
targets=()
for a in "$@"; do
    case "$a" in
    --smoke) smoke=1 ;;
    -h | --help)
        sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *[!0-9]*) targets+=("$a") ;;
    *) secs=$a ;;
    esac
done
if [[ -z "$secs" ]]; then
    if ((smoke)); then secs=25; else secs=120; fi
fi
((${#targets[@]})) || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || {
        echo "fuzz.sh: unknown target $t (have: ${ALL_TARGETS[*]})" >&2
        exit 2
    }
done

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

td=${CARGO_TARGET_DIR:-$root/target/fuzz}
mkdir -p "$td"
td=$(cd "$td" && pwd)
unset CARGO_TARGET_DIR
cd "$root/fuzz"

echo "== building fuzz targets (target dir $td)"
t0=$(date +%s)
cargo fuzz build -s none --target-dir "$td"
echo "== build took $(($(date +%s) - t0)) s"

bin_dir="$td/x86_64-unknown-linux-gnu/release"
logs="$td/logs"
mkdir -p "$logs"
failed=()
declare -A row
for t in "${targets[@]}"; do
    work="$td/work/$t"
    mkdir -p "$work" "artifacts/$t"
    stamp="$logs/$t.stamp"
    touch "$stamp"
    extra=()
    [[ -f "$t.dict" ]] && extra+=("-dict=$t.dict")
    echo "== $t: ${secs} s"
    set +e
    "$bin_dir/$t" "$work" "corpus/$t" \
        -max_total_time="$secs" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="artifacts/$t/" "${extra[@]}" >"$logs/$t.log" 2>&1
    rc=$?
    set -e
    new_artifacts=$(find "artifacts/$t" -type f -newer "$stamp" | sort)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logs/$t.log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9A-Za-z]+' "$logs/$t.log" | tail -1)
    if ((rc != 0)) || [[ -n "$new_artifacts" ]]; then
        failed+=("$t")
        echo "!! $t FAILED (exit $rc); log: $logs/$t.log"
        grep -E "panicked at|ERROR: libFuzzer|deadly signal|Test unit written|SUMMARY" "$logs/$t.log" | head -8 || true
        for a in $new_artifacts; do
            echo "   reproduce: (cd fuzz && cargo fuzz run -s none --target-dir $td $t $a)"
        done
        status="FAILED"
    else
        status="ok"
    fi
    row[$t]=$(printf '%-17s %-7s %12s %9s   %s' "$t" "$status" "${execs:-?}" "${eps:-?}" "${cov:-?}")
    echo "${row[$t]}"
done

echo
echo "== summary (${secs} s per target; coverage as libFuzzer reports it at the end)"
printf '%-17s %-7s %12s %9s   %s\n' target status executions exec/s "coverage (cov = edges, ft = features, corp = units/bytes)"
for t in "${targets[@]}"; do echo "${row[$t]}"; done
if ((${#failed[@]})); then
    echo "fuzz.sh: failures in: ${failed[*]} (reproducers in fuzz/artifacts/)" >&2
    exit 1
fi
