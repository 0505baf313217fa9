#!/usr/bin/env bash
# Compare two builds of iopages on the quick benchmarks, side by side in
# one run: each experiment runs A, B, A, B (so drift on a shared machine
# hits both alike), and every number of each report's `summary` is printed
# as A's and B's median over their runs, with B / A.
#
#   scripts/ab-quick.sh OLD_BINARY NEW_BINARY [EXPERIMENT ...] [-- OUT_DIR]
#
# Experiments default to bulk mempool counter xts crypt bio kvmalloc (nbd
# needs the peers: add it by name). Reports are kept under OUT_DIR
# (default /tmp/ab-quick), as <experiment>-<a|b><round>.json.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 OLD_BINARY NEW_BINARY [EXPERIMENT ...] [-- OUT_DIR]" >&2
    exit 2
fi
a=$1 b=$2
shift 2
for bin in "$a" "$b"; do
    if [ ! -x "$bin" ]; then
        echo "$0: $bin is not an executable" >&2
        exit 2
    fi
done
exps=()
out=/tmp/ab-quick
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then
        out=${2:?"-- needs an output directory"}
        break
    fi
    exps+=("$1")
    shift
done
[ ${#exps[@]} -gt 0 ] || exps=(bulk mempool counter xts crypt bio kvmalloc)
mkdir -p "$out"

for e in "${exps[@]}"; do
    for round in 1 2; do
        for side in a b; do
            bin=$a
            [ "$side" = b ] && bin=$b
            echo "[ab-quick] $e: $side round $round" >&2
            "$bin" bench "$e" --quick --json "$out/$e-$side$round.json" >/dev/null
        done
    done
done

python3 - "$out" "${exps[@]}" <<'EOF'
import json, statistics, sys
out, exps = sys.argv[1], sys.argv[2:]

def numbers(v, path=""):
    if isinstance(v, bool):
        return
    if isinstance(v, (int, float)):
        yield path, float(v)
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from numbers(x, f"{path}.{k}" if path else k)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from numbers(x, f"{path}[{i}]")

for e in exps:
    sides = {}
    for side in "ab":
        runs = [dict(numbers(json.load(open(f"{out}/{e}-{side}{r}.json")).get("summary", {})))
                for r in (1, 2)]
        sides[side] = {k: statistics.median(r[k] for r in runs if k in r) for k in runs[0]}
    print(f"\n{e}: summary, median of 2 runs each (A = first binary, B = second)")
    for k, va in sides["a"].items():
        vb = sides["b"].get(k)
        if vb is None:
            print(f"  {k:<50} {va:>14.4g} {'(gone)':>14}")
            continue
        ratio = f"{vb / va:6.3f}" if va else "     -"
        print(f"  {k:<50} {va:>14.4g} {vb:>14.4g}  B/A {ratio}")
    for k in sides["b"]:
        if k not in sides["a"]:
            print(f"  {k:<50} {'(new)':>14} {sides['b'][k]:>14.4g}")
EOF
