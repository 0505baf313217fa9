//! `iopages serve` refusing what it should before it serves: a signal
//! during a slow key derivation ends it at once, a plaintext listener on a
//! non-loopback address needs `--allow-plaintext`, and bad TLS or limit
//! flags are clear errors.

mod common;

use common::{Dir, BIN};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `iopages luks format --type TYPE --size 1M EXTRA...` makes `DIR/v.img`
/// with the passphrase `pass` (in `DIR/pass`): the image and the
/// passphrase file.
fn format_image(d: &Dir, luks_type: &str, pass: &[u8], extra: &[&str]) -> (PathBuf, PathBuf) {
    let img = d.join("v.img");
    let pass_file = d.join("pass");
    std::fs::write(&pass_file, pass).unwrap();
    let out = Command::new(BIN)
        .args(["luks", "format", "--type", luks_type, "--size", "1M"])
        .args(extra)
        .arg("--passphrase-file")
        .arg(&pass_file)
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (img, pass_file)
}

fn serve_fails(args: &[&str], want: &str) {
    let out = Command::new(BIN)
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve {args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(want), "serve {args:?}: {err}");
}

/// [`serve_fails`] for `serve --image IMG --passphrase-file PASS` on a
/// loopback port.
fn serve_image_fails(img: &Path, pass: &Path, want: &str) {
    serve_fails(
        &[
            "--image",
            img.to_str().unwrap(),
            "--passphrase-file",
            pass.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        want,
    );
}

#[test]
fn sigint_during_a_slow_key_derivation_stops_serve_at_once() {
    let d = Dir::new("kdf");
    let (img, pass) = format_image(&d, "luks1", b"correct horse", &["--iterations", "1000"]);
    // Make key slot 0 slow (LUKS1 has no header checksum): 40 M PBKDF2
    // iterations, under the 50 M limit, tens of seconds of derivation.
    let mut h = std::fs::read(&img).unwrap();
    h[212..216].copy_from_slice(&40_000_000u32.to_be_bytes());
    std::fs::write(&img, &h).unwrap();
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--image")
        .arg(&img)
        .arg("--passphrase-file")
        .arg(&pass)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let t = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("serve still deriving 10 s after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(status.code(), Some(128 + libc::SIGINT));
    let mut err = String::new();
    for l in BufReader::new(child.stderr.take().unwrap()).lines() {
        err.push_str(&l.unwrap());
    }
    assert!(err.contains("stopped while opening the volume"), "{err}");
}

#[test]
fn a_slot_over_the_kdf_limits_is_refused_before_deriving() {
    let d = Dir::new("limit");
    let (img, pass) = format_image(&d, "luks1", b"pw", &["--iterations", "1000"]);
    let mut h = std::fs::read(&img).unwrap();
    h[212..216].copy_from_slice(&u32::MAX.to_be_bytes());
    std::fs::write(&img, &h).unwrap();
    let t = Instant::now();
    serve_image_fails(&img, &pass, "is over the limit");
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn plaintext_off_loopback_and_bad_tls_flags_are_refused_clearly() {
    serve_fails(&["--listen", "0.0.0.0:0"], "--allow-plaintext");
    serve_fails(
        &[
            "--listen",
            "0.0.0.0:0",
            "--tls",
            "on",
            "--tls-psk",
            "/nonexistent",
        ],
        "PSK file",
    );
    serve_fails(
        &["--tls", "require"],
        "--tls-certificates DIR or --tls-psk FILE",
    );
    serve_fails(&["--tls-psk", "x"], "need --tls on or --tls require");
    serve_fails(
        &["--tls", "on", "--tls-certificates", "/nonexistent"],
        "missing",
    );
    serve_fails(&["--max-connections", "0"], "--max-connections");
    serve_fails(&["--max-inflight", "1M"], "--max-inflight");
    serve_fails(&["--reply-timeout", "0"], "--reply-timeout");
}

#[test]
fn a_luks2_image_reformatted_as_lvm_is_refused_unless_recovered_on_purpose() {
    let d = Dir::new("lvm");
    let (img, pass) = format_image(
        &d,
        "luks2",
        b"pw",
        &[
            "--pbkdf",
            "argon2id",
            "--iterations",
            "4",
            "--memory",
            "32",
            "--parallel",
            "1",
        ],
    );
    // What pvcreate writes in the second sector: the primary LUKS2 header
    // is no longer valid, and the area now says "LVM physical volume".
    let mut b = std::fs::read(&img).unwrap();
    b[512..520].copy_from_slice(b"LABELONE");
    b[536..544].copy_from_slice(b"LVM2 001");
    std::fs::write(&img, &b).unwrap();
    let check = |extra: &[&str]| {
        Command::new(BIN)
            .args(["luks", "check"])
            .arg(&img)
            .arg("--passphrase-file")
            .arg(&pass)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = check(&[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ambiguous signatures"), "{err}");
    assert!(err.contains("LVM2"), "{err}");
    assert!(err.contains("--allow-secondary-header"), "{err}");
    // serve refuses it the same way.
    serve_image_fails(&img, &pass, "ambiguous signatures");
    let out = check(&["--allow-secondary-header"]);
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(so.contains("secondary copy was used"), "{so}");
}
