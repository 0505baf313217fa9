//! `iopages serve --image nbd+unix://…`: the LUKS image (header and
//! ciphertext) on another NBD server — here nbdkit's `file` and `memory`
//! plugins — and iopages encrypting in front of it. A cryptsetup-made
//! LUKS2 volume is written through iopages by fio with verify and by
//! nbdcopy, read back offline (nbdcopy of the remote export, then
//! `iopages luks decrypt`); the same over TLS (`nbds+unix://` to an nbdkit
//! requiring it, client writes with FUA); a remote killed mid-run gives the
//! client errors, not a hang, and what was flushed before is on the
//! remote.
//!
//! nbdkit, nbdcopy, qemu-io, fio and cryptsetup are outside tools: where
//! one is missing the test says so and returns, except under `CI=true`,
//! where a missing one fails.

mod common;

use common::{
    cryptsetup, decrypt, fio_verify, luks2_by_cryptsetup, pattern, run, serve_cmd, serve_remote,
    tools, Dir, Served,
};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child killed if the test fails before it is stopped.
struct Kid(Option<Child>);

impl Drop for Kid {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// nbdkit serving `plugin args` on the Unix socket `sock` (the socket is
/// up when this returns).
fn nbdkit(sock: &Path, plugin: &[&str]) -> Kid {
    nbdkit_probed(sock, plugin, &remote_uri(sock))
}

/// As [`nbdkit`], up once nbdinfo reaches it at `uri` (a TLS URI for a
/// server requiring TLS).
fn nbdkit_probed(sock: &Path, plugin: &[&str], uri: &str) -> Kid {
    let child = Command::new("nbdkit")
        .arg("-U")
        .arg(sock)
        .args(["--foreground", "--exit-with-parent"])
        .args(plugin)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nbdkit starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    while Command::new("nbdinfo")
        .arg("--size")
        .arg(uri)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| !s.success())
    {
        assert!(Instant::now() < deadline, "nbdkit did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Kid(Some(child))
}

fn remote_uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

/// `iopages serve` over the remote image at `remote`; its URI is that of
/// its export on `sock`.
fn serve(remote: &str, pass: &Path, sock: &Path, stderr: &Path) -> Served {
    serve_remote(remote, pass, sock, stderr, &[])
}

#[test]
fn a_cryptsetup_volume_on_a_remote_file_and_memory_export_is_written_through_iopages() {
    if !tools(&["nbdkit", "nbdinfo", "nbdcopy", "fio", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("remote");
    let (img, pass) = luks2_by_cryptsetup(&dir, 64 << 20);
    for plugin in ["file", "memory"] {
        let rsock = dir.join(&format!("{plugin}.sock"));
        let _remote = match plugin {
            "file" => nbdkit(&rsock, &["file", &img.display().to_string()]),
            _ => {
                // The memory plugin starts empty: the image is copied in.
                let k = nbdkit(&rsock, &["memory", "64M"]);
                run(Command::new("nbdcopy").arg(&img).arg(remote_uri(&rsock)));
                k
            }
        };
        let sock = dir.join(&format!("{plugin}-iopages.sock"));
        let srv = serve(&remote_uri(&rsock), &pass, &sock, &dir.join("err"));
        let uri = srv.uri.clone();
        // fio's nbd engine: random writes with checksums, read back.
        let job = fio_verify(&uri, "8M");
        assert_eq!(job["error"], 0, "{job}");
        // A known pattern past fio's range, then a clean stop (flush).
        let data = pattern(7, 8 << 20);
        let src = dir.join("data.raw");
        std::fs::write(&src, &data).unwrap();
        run(Command::new("qemu-io")
            .args(["-f", "raw", "-c"])
            .arg(format!("write -s {} 16M 8M", src.display()))
            .arg(&uri));
        srv.stop();
        // Offline: the remote's bytes, decrypted without any server.
        let copy = dir.join(&format!("{plugin}.img"));
        run(Command::new("nbdcopy").arg(remote_uri(&rsock)).arg(&copy));
        let plain = decrypt(&copy, &pass, &dir.join(&format!("{plugin}.plain")));
        assert!(
            plain[16 << 20..24 << 20] == data[..],
            "{plugin}: the data is on the remote"
        );
        run(cryptsetup().arg("luksDump").arg(&copy));
    }
}

#[test]
fn a_remote_killed_mid_run_gives_errors_and_keeps_what_was_flushed() {
    if !tools(&["nbdkit", "nbdinfo", "qemu-io", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("remote-kill");
    let (img, pass) = luks2_by_cryptsetup(&dir, 48 << 20);
    let rsock = dir.join("r.sock");
    let mut remote = nbdkit(&rsock, &["file", &img.display().to_string()]);
    let sock = dir.join("s.sock");
    let err = dir.join("err");
    // Requests wait 1 s for the store to come back (it does not).
    let store = format!("{}&reconnect-delay=1", remote_uri(&rsock));
    let srv = serve(&store, &pass, &sock, &err);
    let uri = srv.uri.clone();
    let data = pattern(11, 4 << 20);
    let src = dir.join("data.raw");
    std::fs::write(&src, &data).unwrap();
    // Written and flushed: acknowledged.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -s {} 0 4M", src.display()))
        .args(["-c", "flush"])
        .arg(&uri));
    let mut r = remote.0.take().unwrap();
    r.kill().unwrap();
    r.wait().unwrap();
    // Now every request fails, once the reconnect delay has passed.
    let t = Instant::now();
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 1 8M 1M", "-c", "read 0 4k"])
        .arg(&uri)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("error") || said.contains("Input/output"),
        "{said}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "errors, not a hang");
    // The server stops on SIGTERM; its final flush fails and says so.
    let (st, _) = srv.terminate();
    assert!(!st.success());
    let e = std::fs::read_to_string(&err).unwrap();
    assert!(e.contains("final flush"), "{e}");
    // What was flushed before the kill is in the image.
    let plain = decrypt(&img, &pass, &dir.join("plain"));
    assert!(
        plain[..4 << 20] == data[..],
        "flushed data survived the remote's death"
    );
}

/// Serving an image on the TLS-only remote at `rsock` over plaintext
/// (`nbd+unix://`) is refused, and the message says what to use.
fn plaintext_to_a_tls_remote_is_refused(rsock: &Path, pass: &Path, sock: &Path) {
    let mut plain = serve_cmd();
    plain
        .args([
            "--arena",
            "64M",
            "--image",
            &remote_uri(rsock),
            "--passphrase-file",
        ])
        .arg(pass)
        .arg("--unix")
        .arg(sock)
        .stdin(Stdio::null());
    let out = plain.output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(said.contains("requires TLS: use nbds://"), "{said}");
}

#[test]
fn a_cryptsetup_volume_on_a_tls_remote_is_written_and_read_back_through_iopages() {
    if !tools(&["nbdkit", "nbdinfo", "nbdcopy", "qemu-io", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("remote-tls");
    let (img, pass) = luks2_by_cryptsetup(&dir, 48 << 20);
    let pki = iopages_bench::nbd::write_pki(&dir.join("pki")).unwrap();
    let rsock = dir.join("tls.sock");
    // nbdinfo (libnbd) checks nothing on a Unix socket by default: only
    // the probe; iopages verifies the certificate against tls-hostname.
    let probe = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        rsock.display(),
        pki.client.display()
    );
    let _remote = nbdkit_probed(
        &rsock,
        &[
            "--tls=require",
            &format!("--tls-certificates={}", pki.server.display()),
            "--tls-verify-peer",
            "file",
            &img.display().to_string(),
        ],
        &probe,
    );
    let sock = dir.join("iopages.sock");
    plaintext_to_a_tls_remote_is_refused(&rsock, &pass, &sock);
    let remote = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=localhost",
        rsock.display(),
        pki.client.display()
    );
    let srv = serve(&remote, &pass, &sock, &dir.join("err"));
    let uri = srv.uri.clone();
    // Written with FUA (qemu-io's -f), then read back through iopages.
    let data = pattern(23, 4 << 20);
    let src = dir.join("data.raw");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -f -s {} 8M 4M", src.display()))
        .arg(&uri));
    let back = dir.join("back.raw");
    run(Command::new("nbdcopy").arg(&uri).arg(&back));
    let back = std::fs::read(&back).unwrap();
    assert!(
        back[8 << 20..12 << 20] == data[..],
        "read back through iopages"
    );
    srv.stop();
    // Offline: the remote's bytes (over TLS), decrypted without a server.
    let copy = dir.join("copy.img");
    run(Command::new("nbdcopy").arg(&probe).arg(&copy));
    let plain = decrypt(&copy, &pass, &dir.join("plain"));
    assert!(
        plain[8 << 20..12 << 20] == data[..],
        "the data is on the remote"
    );
}
