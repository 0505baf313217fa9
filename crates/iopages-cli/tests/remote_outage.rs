//! `iopages serve` over a remote store that goes away: nbdkit killed and
//! started again on the same socket under fio's verify load (no verify
//! error, no hang), `/healthz` and `/healthz/EXPORT` before, during and
//! after the outage, the remote's metrics, the final flush telling of
//! writes the store may have lost, and SIGTERM while the store is
//! stopped (SIGSTOP) in the middle of requests: the server exits within
//! the requests' deadline and a few seconds.
//!
//! nbdkit, nbdinfo, fio and qemu-io are outside tools: where one is
//! missing the test says so and returns, except under `CI=true`.

mod common;

use common::{fio_verify, get, luks2_image, serve_cmd, tools, Dir, NbdKit, Served};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// nbdkit's `file` plugin over `img` on `sock` (a socket file a killed
/// one left removed first).
fn store(sock: &Path, img: &Path) -> NbdKit {
    let _ = std::fs::remove_file(sock);
    NbdKit::file(sock, img).0
}

/// `iopages serve` of the image on the store at `sock` as the export
/// `disk` (a config file, so `extra` keys apply), with its metrics: the
/// server and the metrics' address.
fn serve(dir: &Dir, sock: &Path, pass: &Path, extra: &str) -> (Served, SocketAddr) {
    let image = format!("nbd+unix:///?socket={}", sock.display());
    let conf: PathBuf = dir.join("serve.toml");
    let text = common::export_table("disk", &image, pass, extra);
    std::fs::write(
        &conf,
        format!(
            "[server]\nunix = [\"{}\"]\n{text}",
            dir.join("s.sock").display()
        ),
    )
    .unwrap();
    let mut cmd = serve_cmd();
    cmd.arg("--config").arg(&conf);
    Served::spawn_with_metrics(cmd, dir.join("serve.err"))
}

/// Poll `path` until it answers `code` (within 10 s): its body.
fn until(addr: SocketAddr, path: &str, code: u16) -> String {
    let t = Instant::now();
    loop {
        let (c, _, body) = get(addr, path);
        if c == code {
            return body;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{path}: {c} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the sample line starting with `series` in `text`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {series} in the metrics"))
}

#[test]
fn a_store_restarted_under_fio_verify_loses_nothing_and_health_follows_it() {
    if !tools(&["nbdkit", "nbdinfo", "fio"]) {
        return;
    }
    let dir = Dir::new("outage");
    let (img, pass) = luks2_image(&dir, "disk.img", "64M", b"outage");
    let sock = dir.join("store.sock");
    let mut kid = store(&sock, &img);
    let (srv, m) = serve(&dir, &sock, &pass, "");
    until(m, "/healthz", 200);
    until(m, "/healthz/disk", 200);
    assert_eq!(get(m, "/healthz/nosuch").0, 404);
    let uri = format!("nbd+unix:///disk?socket={}", dir.join("s.sock").display());
    let fio = std::thread::spawn(move || fio_verify(&uri, "48M"));
    std::thread::sleep(Duration::from_millis(1500));
    drop(kid);
    let all = until(m, "/healthz", 503);
    assert!(
        all.contains("\"disk\"") && all.contains("unreachable"),
        "{all}"
    );
    let one = until(m, "/healthz/disk", 503);
    assert!(one.contains("remote store is unreachable"), "{one}");
    std::thread::sleep(Duration::from_secs(1));
    kid = store(&sock, &img);
    until(m, "/healthz", 200);
    until(m, "/healthz/disk", 200);
    let job = fio.join().expect("fio ran");
    assert_eq!(job["error"], 0, "fio: {job}");
    let (_, _, text) = get(m, "/metrics");
    let l = "{export=\"disk\"}";
    assert!(sample(&text, &format!("iopages_remote_reconnects_total{l}")) >= 1.0);
    assert!(sample(&text, &format!("iopages_remote_reachable{l}")) == 1.0);
    assert!(
        sample(
            &text,
            &format!("iopages_remote_round_trip_seconds_count{l}")
        ) > 0.0
    );
    // fio sent no FLUSH: writes acknowledged on the connections that died
    // may be lost for all the store said, so the final flush says so (the
    // durability contract) and the server exits non-zero.
    let err = srv.stderr.clone();
    let (st, _) = srv.terminate();
    let said = std::fs::read_to_string(err).unwrap();
    assert!(
        !st.success() && said.contains("may have lost them"),
        "{st}: {said}"
    );
    drop(kid);
}

#[test]
fn sigterm_while_the_store_is_stopped_exits_within_the_deadline() {
    if !tools(&["nbdkit", "nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("outage-stop");
    let (img, pass) = luks2_image(&dir, "disk.img", "64M", b"outage");
    let sock = dir.join("store.sock");
    let kid = store(&sock, &img);
    let (srv, m) = serve(&dir, &sock, &pass, "");
    until(m, "/healthz", 200);
    let pid = kid.pid();
    // SAFETY: kill has no memory arguments; the pid is our own child's.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let uri = format!("nbd+unix:///disk?socket={}", dir.join("s.sock").display());
    let mut io = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 7 0 4M", "-c", "read 8M 1M"])
        .arg(&uri)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    let (st, _) = srv.terminate();
    let took = t.elapsed();
    // The remote's requests have 30 s from submission; a second to stop.
    assert!(took < Duration::from_secs(33), "{took:?}");
    assert!(
        !st.success(),
        "the final flush could not reach the store: {st}"
    );
    let _ = io.kill();
    let _ = io.wait();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    drop(kid);
}
