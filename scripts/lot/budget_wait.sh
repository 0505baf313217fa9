#!/bin/bash
# Server tasks and CPU while 200 requests wait for the byte budget (8
# clients hold it with unread replies). Usage: scripts/lot/budget_wait.sh
# BINARY [HOGS [WAITERS]]  (BINARY: a release build of iopages)
set -e
bin=$1; hogs=${2:-8}; waiters=${3:-200}; port=10897
ulimit -n 8192
"$bin" serve --size 64M --arena 512M --listen 127.0.0.1:$port --max-connections 1100 \
    --max-handshakes 1100 --max-inflight 64M > /dev/null 2>&1 &
pid=$!
for _ in $(seq 1 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
python3 "$(dirname "$0")/budget_wait.py" $port $pid "$hogs" "$waiters"
kill $pid; wait $pid 2>/dev/null || true
