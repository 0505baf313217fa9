#!/usr/bin/env bash
# A throw-away single-node Ceph cluster and an NBD export of an RBD image on
# it: a remote store for `iopages serve --image nbd+unix://…` that nobody in
# this project wrote (tests/stores.rs, `iopages bench nbd --remote --store
# ceph`).
#
#   scripts/ceph-store.sh up DIR [SIZE]         cluster under DIR, image "vol"
#                                               of SIZE (default 1G), exported;
#                                               the export's NBD URI is the
#                                               last line of stdout
#   scripts/ceph-store.sh export DIR NAME SIZE  one more image in DIR's cluster,
#                                               exported on a socket of its own;
#                                               its URI is the last line
#   scripts/ceph-store.sh down DIR              stop what DIR's pid files name,
#                                               remove DIR (a half-started DIR
#                                               too)
#
# SIZE as `rbd create --size` takes it: a number of MiB, or with M, G or T.
#
# What `up` installs when it is missing (as root, through apt-get; each
# install is announced on stderr): ceph-mon, ceph-osd, ceph-mgr, ceph-common
# (Debian's Ceph), and an exporter. The exporter is qemu-nbd with qemu's rbd
# driver (qemu-block-extra of exactly the installed qemu-utils' version — from
# the backports suite when that is where qemu-utils came from); if that
# cannot be installed, nbdkit's Python plugin over Ceph's rbd binding
# (nbdkit-plugin-python, python3-rbd). IOPAGES_CEPH_EXPORTER=qemu-nbd|nbdkit
# picks one. stderr says which is used.
#
# The cluster: one mon (msgr2 only, on a free port of 127.0.0.1, no
# authentication), one mgr and one OSD on memstore (data in RAM; set
# IOPAGES_CEPH_OBJECTSTORE=bluestore for BlueStore on a file, DIR/osd.block),
# a pool "rbd" of size 1. Images are made with the layering feature only, so
# no exclusive lock moves between the exporter's connections. Every process
# writes its pid file under DIR/run and its log under DIR/log; nothing is
# started outside DIR, and `down` signals only processes whose command line
# names DIR.
#
# Must never: touch a cluster or a process it did not start, or remove a
# directory it did not make (DIR holds a marker file from the first step of
# `up`).
set -euo pipefail

me=${0##*/}
MARK=.iopages-ceph-store
HEALTH_TIMEOUT_S=${IOPAGES_CEPH_HEALTH_TIMEOUT:-120}
STEP_TIMEOUT_S=60

say() { echo "$me: $*" >&2; }
die() {
    say "$*"
    exit 1
}

usage() {
    echo "usage: $me up DIR [SIZE] | export DIR NAME SIZE | down DIR" >&2
    exit 2
}

# Whether every Debian package named is installed.
installed() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || return 1
    done
}

# apt-get install of the packages named that are missing (root only).
apt_install() {
    local missing=() p
    for p in "$@"; do
        installed "${p%%=*}" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        die "missing Debian packages ${missing[*]}: install them as root (apt-get install ${missing[*]})"
    fi
    say "installing ${missing[*]} (apt-get)"
    [ -z "${INSTALL_LOG:-}" ] || echo "${missing[*]}" >>"$INSTALL_LOG"
    export DEBIAN_FRONTEND=noninteractive
    [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq >&2 && APT_UPDATED=1; }
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# qemu's rbd driver for the installed qemu: qemu-block-extra of the same
# version (qemu refuses a module built for another version). Returns 1 when
# no such package can be had.
install_qemu_rbd() {
    command -v qemu-nbd >/dev/null || apt_install qemu-utils
    local v codename suite list
    v=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null) || return 1
    if [ "$(dpkg-query -W -f='${Version}' qemu-block-extra 2>/dev/null || true)" = "$v" ] &&
        installed qemu-block-extra; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || return 1
    if ! apt-cache madison qemu-block-extra 2>/dev/null | grep -F "| $v |" >/dev/null; then
        # A qemu from backports: that suite has its block modules.
        case $v in *~bpo*) ;; *) return 1 ;; esac
        # shellcheck disable=SC1091
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
        [ -n "$codename" ] || return 1
        suite=$codename-backports
        list=/etc/apt/sources.list.d/iopages-$suite.list
        say "qemu-utils $v is from $suite: adding $list for qemu-block-extra"
        echo "deb http://deb.debian.org/debian $suite main" >"$list"
        apt-get update -qq >&2 && APT_UPDATED=1
        apt-cache madison qemu-block-extra | grep -F "| $v |" >/dev/null || return 1
    fi
    apt_install "qemu-block-extra=$v"
}

# Which exporter to use, installing it: "qemu-nbd" or "nbdkit".
choose_exporter() {
    local want=${IOPAGES_CEPH_EXPORTER:-}
    if [ "$want" != nbdkit ] && install_qemu_rbd; then
        echo qemu-nbd
        return
    fi
    [ "$want" = qemu-nbd ] && die "qemu's rbd driver (qemu-block-extra) cannot be installed"
    apt_install nbdkit nbdkit-plugin-python python3-rbd
    echo nbdkit
}

# A TCP port of 127.0.0.1 that nothing listens on, for the mon.
free_port() {
    local p _
    for _ in $(seq 1 50); do
        p=$((20000 + RANDOM % 20000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return
        fi
    done
    die "no free port found for the mon"
}

# Bytes from a SIZE as rbd takes it (MiB without a suffix).
size_bytes() {
    local n=${1%[MmGgTt]} u=${1: -1}
    [[ $n =~ ^[0-9]+$ ]] || die "size $1: give a number of MiB, or with M, G or T"
    case $u in
    [Gg]) echo $((n << 30)) ;;
    [Tt]) echo $((n << 40)) ;;
    *) echo $((n << 20)) ;;
    esac
}

write_conf() {
    local dir=$1 port=$2 fsid=$3 store=$4
    cat >"$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon initial members = a
mon host = [v2:127.0.0.1:$port]
public addr = 127.0.0.1
ms bind msgr1 = false
ms bind msgr2 = true
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
mon warn on pool no redundancy = false
mon allow pool size one = true
mon allow pool delete = true
mon data avail warn = 2
mon data avail crit = 1
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
osd objectstore = $store
memstore device bytes = $((16 << 30))
bluestore block path = $dir/osd.block
bluestore block create = true
bluestore block size = $((8 << 30))
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
mon data = $dir/mon/\$id
mgr data = $dir/mgr/\$id
osd data = $dir/osd/\$id
keyring = $dir/keyring
[client]
admin socket = $dir/run/\$name.\$pid.\$cctid.asok
log file = $dir/log/\$name.\$pid.log
EOF
}

# The tails of the logs under DIR, for an error.
log_tails() {
    local f
    for f in "$1"/log/*.log "$1"/log/*.start; do
        [ -s "$f" ] || continue
        echo "--- tail of $f" >&2
        tail -n 15 "$f" >&2
    done
}

# ceph/rbd against DIR's cluster, each under a time limit.
cephc() { timeout "$STEP_TIMEOUT_S" ceph --connect-timeout 30 "$@"; }
rbdc() { timeout "$STEP_TIMEOUT_S" rbd "$@"; }

start_daemons() {
    local dir=$1 port=$2 fsid=$3
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
    ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    mkdir -p "$dir/mon/a" "$dir/mgr/x" "$dir/osd/0"
    ceph-mon -c "$dir/ceph.conf" --mkfs -i a --monmap "$dir/monmap" >"$dir/log/mkfs-mon.out" 2>&1
    # What a daemon says before its log is open goes to DIR/log/*.start.
    ceph-mon -c "$dir/ceph.conf" -i a 2>>"$dir/log/mon.a.start"
    ceph-mgr -c "$dir/ceph.conf" -i x 2>>"$dir/log/mgr.x.start"
    local uuid
    uuid=$(cat /proc/sys/kernel/random/uuid)
    [ "$(cephc osd new "$uuid")" = 0 ] || die "the new OSD is not osd.0"
    ceph-osd -c "$dir/ceph.conf" -i 0 --mkfs --osd-uuid "$uuid" >"$dir/log/mkfs-osd.out" 2>&1 ||
        { log_tails "$dir"; cat "$dir/log/mkfs-osd.out" >&2; die "ceph-osd --mkfs failed"; }
    ceph-osd -c "$dir/ceph.conf" -i 0 2>>"$dir/log/osd.0.start"
}

# Wait until `ceph health` says HEALTH_OK, at most HEALTH_TIMEOUT_S.
wait_health() {
    local dir=$1 t0=$SECONDS h=""
    while [ $((SECONDS - t0)) -lt "$HEALTH_TIMEOUT_S" ]; do
        h=$(cephc health 2>/dev/null || true)
        if [ "$h" = HEALTH_OK ]; then
            return 0
        fi
        sleep 0.5
    done
    say "the cluster is not HEALTH_OK after $HEALTH_TIMEOUT_S s: ${h:-no answer}"
    cephc health detail >&2 2>/dev/null || true
    log_tails "$dir"
    die "giving up (scripts/ceph-store.sh down $dir stops what was started)"
}

# Export image NAME on DIR/run/NAME.sock; prints its URI.
export_image() {
    local dir=$1 name=$2 sock=$1/run/$2.sock
    case $(cat "$dir/exporter") in
    qemu-nbd)
        # -e 4: four clients at once (qemu then offers multi-conn);
        # --persistent: it stays up between clients; --fork returns once the
        # socket listens.
        qemu-nbd --fork --pid-file "$dir/run/nbd-$name.pid" -k "$sock" -e 4 --persistent \
            -f raw "rbd:rbd/$name:conf=$dir/ceph.conf" 2>>"$dir/log/nbd-$name.log" ||
            { log_tails "$dir"; die "qemu-nbd did not start for image $name"; }
        ;;
    nbdkit)
        # Debian's libpython embeds the system's modules (python3-rbd).
        nbdkit --unix "$sock" --pidfile "$dir/run/nbd-$name.pid" python \
            "$dir/rbd_plugin.py" conf="$dir/ceph.conf" pool=rbd image="$name" \
            2>>"$dir/log/nbd-$name.log" ||
            { log_tails "$dir"; die "nbdkit did not start for image $name"; }
        ;;
    esac
    local t0=$SECONDS
    until nbd_listening "$sock"; do
        [ $((SECONDS - t0)) -lt 30 ] || { log_tails "$dir"; die "no export on $sock"; }
        sleep 0.2
    done
    echo "nbd+unix:///?socket=$sock"
}

nbd_listening() {
    python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])' "$1" 2>/dev/null
}

new_image() {
    local dir=$1 name=$2 size=$3
    [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "image name $name: letters, digits, _ and - only"
    size_bytes "$size" >/dev/null
    rbdc create --size "$size" --image-feature layering "rbd/$name"
    export_image "$dir" "$name"
}

write_plugin() {
    cat >"$1/rbd_plugin.py" <<'EOF'
# nbdkit Python plugin: one RBD image, written by scripts/ceph-store.sh.
# The cluster is opened in open(), after nbdkit has forked.
import nbdkit
import rados
import rbd

API_VERSION = 2
cfg = {"pool": "rbd"}


def config(key, value):
    cfg[key] = value


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def open(readonly):
    cluster = rados.Rados(conffile=cfg["conf"])
    cluster.connect()
    ioctx = cluster.open_ioctx(cfg["pool"])
    return {"c": cluster, "io": ioctx, "img": rbd.Image(ioctx, cfg["image"])}


def close(h):
    h["img"].close()
    h["io"].close()
    h["c"].shutdown()


def get_size(h):
    return h["img"].size()


def can_multi_conn(h):
    return True


def pread(h, buf, offset, flags):
    buf[:] = h["img"].read(offset, len(buf))


def pwrite(h, buf, offset, flags):
    h["img"].write(bytes(buf), offset)
    if flags & nbdkit.FLAG_FUA:
        h["img"].flush()


def flush(h, flags):
    h["img"].flush()


def trim(h, count, offset, flags):
    h["img"].discard(offset, count)


def zero(h, count, offset, flags):
    h["img"].write_zeroes(offset, count)
EOF
}

cmd_up() {
    local dir=$1 size=${2:-1G}
    [ ! -e "$dir" ] || [ -z "$(ls -A "$dir")" ] || die "$dir exists and is not empty"
    size_bytes "$size" >/dev/null
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    : >"$dir/$MARK"
    mkdir -p "$dir/run" "$dir/log"
    local t0=$SECONDS
    INSTALL_LOG=$dir/log/installed.txt
    apt_install ceph-mon ceph-osd ceph-mgr ceph-common
    local exporter
    exporter=$(choose_exporter)
    echo "$exporter" >"$dir/exporter"
    if [ "$exporter" = nbdkit ]; then
        write_plugin "$dir"
    fi
    say "exporter: $exporter$([ "$exporter" = qemu-nbd ] && echo ' (qemu rbd driver)' || echo ' (python plugin over Ceph rbd binding)')"
    [ ! -s "$INSTALL_LOG" ] || say "installing took $((SECONDS - t0)) s"
    local store=${IOPAGES_CEPH_OBJECTSTORE:-memstore} port fsid
    case $store in memstore | bluestore) ;; *) die "IOPAGES_CEPH_OBJECTSTORE: memstore or bluestore" ;; esac
    port=$(free_port)
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$dir" "$port" "$fsid" "$store"
    export CEPH_CONF=$dir/ceph.conf
    t0=$SECONDS
    start_daemons "$dir" "$port" "$fsid"
    if ! { cephc osd pool create rbd 16 16 && cephc osd pool application enable rbd rbd; } \
        >"$dir/log/pool.out" 2>&1; then
        log_tails "$dir"
        cat "$dir/log/pool.out" >&2
        die "the pool rbd could not be made"
    fi
    wait_health "$dir"
    rbdc pool init rbd || { log_tails "$dir"; die "rbd pool init failed"; }
    say "cluster up (mon on 127.0.0.1:$port, $store) in $((SECONDS - t0)) s"
    new_image "$dir" vol "$size"
}

cmd_export() {
    local dir=$1 name=$2 size=$3
    if [ ! -f "$dir/$MARK" ] || [ ! -f "$dir/ceph.conf" ]; then
        die "$dir is not a cluster of $me up"
    fi
    dir=$(cd "$dir" && pwd)
    export CEPH_CONF=$dir/ceph.conf
    [ ! -e "$dir/run/$name.sock" ] || die "image $name is exported already"
    new_image "$dir" "$name" "$size"
}

# The pid in pid file F if that process's command line names DIR (so a
# reused pid is never signalled).
pid_of() {
    local dir=$1 f=$2 pid
    pid=$(cat "$f" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -F "$dir" >/dev/null || return 1
    echo "$pid"
}

# SIGTERM to every pid named, up to 20 s for them to go, then SIGKILL.
stop_pids() {
    local pid _ left
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 1 200); do
        left=()
        for pid in "$@"; do
            if kill -0 "$pid" 2>/dev/null; then left+=("$pid"); fi
        done
        [ ${#left[@]} -gt 0 ] || return 0
        sleep 0.1
    done
    say "still there 20 s after SIGTERM, SIGKILL: ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

cmd_down() {
    local dir=$1 f pid exporters=() osds=() daemons=()
    [ -e "$dir" ] || return 0
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/$MARK" ] || die "$dir was not made by $me up: not touching it"
    for f in "$dir"/run/*.pid; do
        pid=$(pid_of "$dir" "$f") || continue
        case ${f##*/} in
        nbd-*) exporters+=("$pid") ;;
        osd.*) osds+=("$pid") ;;
        *) daemons+=("$pid") ;;
        esac
    done
    # The exporters first: they are the cluster's clients; then the OSD,
    # which says goodbye to the mon on its way out.
    stop_pids "${exporters[@]}"
    stop_pids "${osds[@]}"
    stop_pids "${daemons[@]}"
    rm -rf "$dir"
}

main() {
    [ $# -ge 2 ] || usage
    case $1 in
    up) [ $# -le 3 ] || usage; cmd_up "$2" "${3:-}" ;;
    export) [ $# -eq 4 ] || usage; cmd_export "$2" "$3" "$4" ;;
    down) [ $# -eq 2 ] || usage; cmd_down "$2" ;;
    *) usage ;;
    esac
}

main "$@"
