#!/usr/bin/env bash
# One fio load through `iopages serve --image nbd+unix://…` in front of an
# nbdkit file store, and what the server spent on it: MiB/s, IOPS, server
# CPU-seconds per GiB, and the server's context switches per request,
# summed by thread kind (kcryptd workers, nbd-remote store readers,
# nbd-conn connection threads; /proc/PID/task/*/status).
#
#   scripts/remote/switches.sh BINARY [write|read|randrw] [SECONDS]
#   STORE=tcp scripts/remote/switches.sh …   (the store on 127.0.0.1:$PORT,
#                                             default 10901, not a Unix socket)
#
# 1 MiB requests at queue depth 16 for write and read, 4 KiB randrw (50 %
# reads) with 2 jobs × depth 32. A 256 MiB LUKS1 image is made once under
# $WORK (default /tmp/iopages-switches). Needs nbdkit and fio (nbd engine).
set -euo pipefail
bin=$(realpath "${1:?usage: $0 BINARY [write|read|randrw] [SECONDS]}")
rw=${2:-write}
secs=${3:-5}
work=${WORK:-/tmp/iopages-switches}
mkdir -p "$work"
cd "$work"
if [ ! -f img ]; then
    printf 'pw' > pw
    "$bin" luks format --type luks1 --passphrase-file pw --size 256M \
        --pbkdf pbkdf2 --iter-time 10 img > /dev/null
fi
rm -f store.sock srv.sock
if [ "${STORE:-unix}" = tcp ]; then
    port=${PORT:-10901}
    nbdkit -p "$port" --exit-with-parent file img > /dev/null 2>&1 &
    store=$!
    image="nbd://127.0.0.1:$port/"
    for _ in $(seq 1 100); do nbdinfo --size "$image" > /dev/null 2>&1 && break; sleep 0.1; done
else
    nbdkit -U store.sock --exit-with-parent file img > /dev/null 2>&1 &
    store=$!
    image="nbd+unix:///?socket=$work/store.sock"
    for _ in $(seq 1 100); do [ -S store.sock ] && break; sleep 0.1; done
fi
"$bin" serve --image "$image" --passphrase-file pw \
    --unix srv.sock --name v > srv.log 2>&1 &
srv=$!
trap 'kill $srv $store 2> /dev/null; wait $srv $store 2> /dev/null || true' EXIT
for _ in $(seq 1 100); do [ -S srv.sock ] && break; sleep 0.1; done
sleep 2
switches() {
    for t in /proc/$srv/task/*; do
        echo "$(sed 's/[-/][0-9]*$//' "$t/comm") $(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status")"
    done | awk '{a[$1] += $2} END {for (k in a) printf "%s=%d ", k, a[k]}'
}
ticks() { awk '{print $14 + $15}' /proc/$1/stat; }
if [ "$rw" = randrw ]; then
    args=(--bs=4k --rwmixread=50 --iodepth=32 --numjobs=2)
else
    args=(--bs=1M --iodepth=16 --numjobs=1)
fi
s0=$(switches); t0=$(ticks $srv); k0=$(ticks $store)
fio --thread --ioengine=nbd --uri="nbd+unix:///v?socket=$work/srv.sock" --rw="$rw" \
    "${args[@]}" --runtime="${secs}s" --time_based --size=256M --name=j \
    --group_reporting --output-format=json 2> /dev/null > fio.json
s1=$(switches); t1=$(ticks $srv); k1=$(ticks $store)
python3 - "$s0" "$s1" $((t1 - t0)) "$(getconf CLK_TCK)" "$rw" $((k1 - k0)) <<'PY'
import json, sys
text = open("fio.json").read()
job = json.loads(text[text.index("{"):])["jobs"][0]
w, r = job["write"], job["read"]
ios = w["total_ios"] + r["total_ios"]
gib = (w["io_bytes"] + r["io_bytes"]) / 2**30
before = dict(x.split("=") for x in sys.argv[1].split())
after = dict(x.split("=") for x in sys.argv[2].split())
per = {k: (int(v) - int(before.get(k, 0))) / ios for k, v in after.items()}
cpu = int(sys.argv[3]) / int(sys.argv[4])
store = int(sys.argv[6]) / int(sys.argv[4])
print(f"{sys.argv[5]}: {(w['bw'] + r['bw']) / 1024:.0f} MiB/s, {w['iops'] + r['iops']:.0f} IOPS, "
      f"server {cpu / gib:.3f} CPU-s/GiB, {cpu * 1e6 / ios:.1f} CPU-µs/request, "
      f"store {store * 1e6 / ios:.1f} CPU-µs/request, "
      f"{sum(per.values()):.2f} switches/request "
      + " ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()) if v >= 0.05))
PY
