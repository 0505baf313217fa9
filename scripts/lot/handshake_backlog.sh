#!/bin/bash
# Server tasks while N Unix clients each pipeline 20 000 NBD_OPT_LIST and
# read no answer. Usage: scripts/lot/handshake_backlog.sh BINARY [N]
set -e
bin=$1; n=${2:-100}; sock=$(mktemp -u /tmp/iopages-backlog-XXXX.sock)
ulimit -n 8192
"$bin" serve --size 64M --arena 256M --unix "$sock" --max-connections 1100 \
    --max-handshakes 1100 > /dev/null 2>&1 &
pid=$!
for _ in $(seq 1 100); do [ -S "$sock" ] && break; sleep 0.1; done; sleep 0.5
python3 "$(dirname "$0")/handshake_backlog.py" "$sock" $pid "$n" 20000
kill $pid; wait $pid 2>/dev/null || true
