//! `iopages serve --image nbd…://` over NBD stores nobody in this project
//! wrote: qemu-nbd (several connections at once, multi-conn), Debian's
//! `nbd-server`, and an RBD image of a single-node Ceph cluster exported by
//! scripts/ceph-store.sh. In each, a LUKS2 volume made by cryptsetup is
//! written through iopages (fio with verify, then a known pattern), read
//! back whole through iopages, and after a clean stop the store's bytes —
//! the file, or `rbd export` of the image — are decrypted offline by
//! `iopages luks decrypt` and must be exactly what the clients saw. The
//! server's statistics at the stop must show no connection left open, no
//! in-flight budget still held and no failed request; the Ceph store must
//! leave no process behind.
//!
//! qemu-nbd, nbd-server, nbdcopy, qemu-io, fio and cryptsetup are outside
//! tools: where one is missing the test says so and returns, except under
//! `CI=true` (scripts/setup-debian.sh installs them). Ceph is optional
//! everywhere: the Ceph test runs where ceph-mon, ceph-osd, ceph-mgr and
//! rbd are installed, or with `IOPAGES_CEPH=1`, which lets
//! scripts/ceph-store.sh install them (as root); otherwise it says why it
//! skips and passes.

mod common;

use common::{
    cryptsetup, decrypt, fio_verify, luks2_by_cryptsetup, pattern, run, serve_remote, tools, Dir,
};
use iopages_testkit::{die_with_parent, find_tool, wait_for_socket, Reaped};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The LUKS2 image's size, header included (cryptsetup's LUKS2 header
/// takes 16 MiB: 48 MiB of payload).
const IMAGE_BYTES: u64 = 64 << 20;
/// Where the known pattern goes in the volume, and its length.
const PATTERN_AT: usize = 16 << 20;
const PATTERN_BYTES: usize = 8 << 20;

/// What the clients of `iopages serve` wrote and saw: the whole volume as
/// read back through it, and the pattern written at `PATTERN_AT`.
struct Written {
    through: Vec<u8>,
    pattern: Vec<u8>,
}

/// Through `iopages serve` over the store at `remote`: fio's verify job
/// (random 4 KiB writes with checksums, read back), a known pattern past
/// fio's range by qemu-io, and the whole volume read back by nbdcopy; then
/// SIGTERM (the final flush). The statistics written at the stop must
/// show nothing open, nothing held and nothing failed.
fn write_through_iopages(dir: &Dir, remote: &str, pass: &Path, store: &str) -> Written {
    let stats = dir.join(&format!("{store}-stats.json"));
    let sock = dir.join(&format!("{store}-iopages.sock"));
    let srv = serve_remote(
        remote,
        pass,
        &sock,
        &dir.join(&format!("{store}-serve.err")),
        &["--stats-json", stats.to_str().unwrap()],
    );
    let uri = srv.uri.clone();
    let job = fio_verify(&uri, "8M");
    assert_eq!(job["error"], 0, "{store}: {job}");
    let data = pattern(31, PATTERN_BYTES);
    let src = dir.join(&format!("{store}-pattern.raw"));
    std::fs::write(&src, &data).unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!(
            "write -s {} {PATTERN_AT} {PATTERN_BYTES}",
            src.display()
        ))
        .arg(&uri));
    let through = dir.join(&format!("{store}-through.raw"));
    run(Command::new("nbdcopy").arg(&uri).arg(&through));
    srv.stop();
    nothing_left_in(&stats, store);
    Written {
        through: std::fs::read(&through).unwrap(),
        pattern: data,
    }
}

/// The statistics `iopages serve --stats-json` wrote as it stopped: no
/// connection open, no budget held (every request's buffers given back),
/// no request failed.
fn nothing_left_in(stats: &Path, store: &str) {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(stats).unwrap()).expect("--stats-json's JSON");
    assert_eq!(v["open_connections"], 0, "{store}: {v}");
    assert_eq!(v["budget"]["used_bytes"], 0, "{store}: {v}");
    for cmd in ["read", "write", "flush"] {
        assert_eq!(v[cmd]["errors"], 0, "{store}: {cmd} errors: {v}");
    }
    assert!(v["write"]["requests"].as_u64() > Some(0), "{store}: {v}");
}

/// The store's bytes after the stop (`image`), decrypted offline, must be
/// what the clients read through iopages, the pattern included; the image
/// must still be a LUKS2 volume cryptsetup reads.
fn check_offline(dir: &Dir, image: &Path, pass: &Path, w: &Written, store: &str) {
    let plain = decrypt(image, pass, &dir.join(&format!("{store}.plain")));
    assert_eq!(plain.len(), w.through.len(), "{store}: the volume's size");
    assert!(
        plain[PATTERN_AT..PATTERN_AT + PATTERN_BYTES] == w.pattern[..],
        "{store}: the pattern is on the store"
    );
    if let Some(i) = plain.iter().zip(&w.through).position(|(a, b)| a != b) {
        panic!("{store}: the store's plaintext differs from what iopages served at byte {i}");
    }
    let dump = run(cryptsetup().arg("luksDump").arg(image));
    assert!(dump.contains("Version:       \t2"), "{store}: {dump}");
}

/// A child started to die with the test, with its output into `log`.
fn spawn_store(mut cmd: Command, log: &Path) -> Reaped {
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
    die_with_parent(&mut cmd, libc::SIGTERM);
    Reaped(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")))
}

#[test]
fn a_cryptsetup_volume_on_qemu_nbd_with_several_connections_is_written_through_iopages() {
    if !tools(&[
        "qemu-nbd",
        "qemu-io",
        "nbdinfo",
        "nbdcopy",
        "fio",
        "cryptsetup",
    ]) {
        return;
    }
    let dir = Dir::new("qemu-nbd");
    let (img, pass) = luks2_by_cryptsetup(&dir, IMAGE_BYTES);
    let sock = dir.join("qemu-nbd.sock");
    // -e 4: four clients at once, and then qemu offers multi-conn (one
    // flush covers every connection), so iopages opens several.
    let mut cmd = Command::new("qemu-nbd");
    cmd.args(["-f", "raw", "-e", "4", "--persistent", "-k"])
        .arg(&sock)
        .arg(&img);
    let mut store = spawn_store(cmd, &dir.join("qemu-nbd.log"));
    wait_for_socket(&sock, Duration::from_secs(20), || {
        match store.0.try_wait() {
            Ok(None) => Ok(()),
            other => Err(format!("qemu-nbd exited: {other:?}")),
        }
    })
    .unwrap();
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    let multi = Command::new("nbdinfo")
        .args(["--can", "multi-conn", &remote])
        .status()
        .unwrap();
    assert!(multi.success(), "qemu-nbd -e 4 offers multi-conn");
    let w = write_through_iopages(&dir, &remote, &pass, "qemu-nbd");
    check_offline(&dir, &img, &pass, &w, "qemu-nbd");
}

/// `nbd-server`, which always forks into the background: stopped by the
/// pid it wrote (SIGTERM) when dropped.
struct NbdServer {
    pid_file: PathBuf,
}

impl NbdServer {
    /// nbd-server exporting `img` as `vol` on the Unix socket `sock`, up
    /// once the socket takes connections.
    fn start(dir: &Dir, img: &Path, sock: &Path) -> NbdServer {
        let conf = dir.join("nbd-server.conf");
        std::fs::write(
            &conf,
            format!(
                "[generic]\n    unixsock = {}\n[vol]\n    exportname = {}\n    flush = true\n    fua = true\n    trim = true\n",
                sock.display(),
                img.display()
            ),
        )
        .unwrap();
        // It leaves its socket behind when stopped; a stale one would make
        // it exit at once (EADDRINUSE).
        let _ = std::fs::remove_file(sock);
        let s = NbdServer {
            pid_file: dir.join("nbd-server.pid"),
        };
        run(Command::new(find_tool("nbd-server").unwrap())
            .arg("-C")
            .arg(&conf)
            .arg("-p")
            .arg(&s.pid_file));
        wait_for_socket(sock, Duration::from_secs(20), || Ok(())).unwrap();
        s
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(&self.pid_file).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<libc::pid_t>() {
            // SAFETY: kill(2) on the pid our own nbd-server wrote.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

#[test]
fn a_cryptsetup_volume_on_debians_nbd_server_is_written_through_iopages() {
    if !tools(&["nbd-server", "qemu-io", "nbdcopy", "fio", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("nbd-server");
    let (img, pass) = luks2_by_cryptsetup(&dir, IMAGE_BYTES);
    let sock = dir.join("nbd-server.sock");
    let _store = NbdServer::start(&dir, &img, &sock);
    let remote = format!("nbd+unix:///vol?socket={}", sock.display());
    let w = write_through_iopages(&dir, &remote, &pass, "nbd-server");
    check_offline(&dir, &img, &pass, &w, "nbd-server");
}

/// scripts/ceph-store.sh.
fn ceph_store_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-store.sh")
}

/// Why the Ceph test does not run here, if it does not: Ceph is not
/// installed and `IOPAGES_CEPH=1` does not ask for it.
fn ceph_skip_reason() -> Option<String> {
    if std::env::var("IOPAGES_CEPH").as_deref() == Ok("1") {
        return None;
    }
    let missing: Vec<&str> = ["ceph-mon", "ceph-osd", "ceph-mgr", "rbd"]
        .into_iter()
        .filter(|t| find_tool(t).is_none())
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "Ceph is not installed ({} missing); IOPAGES_CEPH=1 has scripts/ceph-store.sh install it (as root)",
            missing.join(", ")
        )
    })
}

/// A cluster of scripts/ceph-store.sh under `dir`: `ceph-store.sh down`
/// when dropped, however far `up` got.
struct CephStore {
    dir: PathBuf,
}

impl CephStore {
    /// `ceph-store.sh up DIR SIZE`: the guard, and the export's URI (the
    /// last line the script printed).
    fn up(dir: PathBuf, size: &str) -> (CephStore, String) {
        let store = CephStore { dir };
        let out = Command::new("bash")
            .arg(ceph_store_script())
            .arg("up")
            .arg(&store.dir)
            .arg(size)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("bash runs scripts/ceph-store.sh");
        assert!(out.status.success(), "ceph-store.sh up: {}", out.status);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let uri = stdout.lines().last().unwrap_or_default().to_string();
        assert!(uri.starts_with("nbd+unix://"), "{stdout}");
        (store, uri)
    }

    /// `rbd export` of the image `vol` into the file `to`.
    fn rbd_export(&self, to: &Path) {
        run(Command::new("rbd")
            .arg("-c")
            .arg(self.dir.join("ceph.conf"))
            .args(["export", "rbd/vol"])
            .arg(to));
    }
}

impl Drop for CephStore {
    fn drop(&mut self) {
        let st = Command::new("bash")
            .arg(ceph_store_script())
            .arg("down")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .status();
        if !st.as_ref().is_ok_and(|s| s.success()) && !std::thread::panicking() {
            panic!("ceph-store.sh down {} failed: {st:?}", self.dir.display());
        }
    }
}

/// Processes whose command line names `dir`.
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect()
}

#[test]
fn a_cryptsetup_volume_on_a_ceph_rbd_image_is_written_through_iopages_and_read_back_by_rbd() {
    if let Some(why) = ceph_skip_reason() {
        eprintln!("skipped the Ceph store: {why}");
        return;
    }
    if !tools(&["nbdcopy", "qemu-io", "fio", "cryptsetup"]) {
        return;
    }
    let t0 = Instant::now();
    let dir = Dir::new("ceph");
    let cluster = dir.join("cluster");
    let (img, pass) = luks2_by_cryptsetup(&dir, IMAGE_BYTES);
    let t_up = Instant::now();
    let (store, remote) = CephStore::up(cluster.clone(), &format!("{}M", IMAGE_BYTES >> 20));
    let up_s = t_up.elapsed().as_secs_f64();
    // The volume goes onto the RBD image through the export.
    run(Command::new("nbdcopy").arg(&img).arg(&remote));
    let w = write_through_iopages(&dir, &remote, &pass, "ceph");
    let copy = dir.join("rbd-export.img");
    store.rbd_export(&copy);
    check_offline(&dir, &copy, &pass, &w, "ceph");
    drop(store);
    let left = processes_naming(&cluster);
    assert!(left.is_empty(), "ceph-store.sh down left {left:?}");
    assert!(
        !cluster.exists(),
        "ceph-store.sh down removes its directory"
    );
    eprintln!(
        "ceph store: ceph-store.sh up (installs included) {up_s:.1} s, the whole test {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
