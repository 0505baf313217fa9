//! Key verbs on a volume `iopages serve` is serving, while fio writes and
//! verifies through it: the server never writes or caches the header, so
//! `add-key`, `change-key` and `remove-key` run beside it without a verify
//! error, and the passphrases they leave are the ones that open the image
//! afterwards (checked by `iopages luks check` and by cryptsetup). The
//! same on a remote store (nbdkit `file`), where the verbs and the server
//! reach the header through two different NBD connections.
//!
//! fio, cryptsetup and nbdkit are outside tools: where one is missing the
//! test says so and returns, except under `CI=true`.

mod common;

use common::{
    cryptsetup, fio_verify, luks2_image, run, serve_cmd, tools, Dir, NbdKit, Served, BIN,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `iopages luks ARGS…`.
fn luks(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("luks");
    for a in args {
        cmd.arg(a);
    }
    cmd.stdin(Stdio::null()).output().expect("iopages runs")
}

fn ok(out: Output, what: &str) -> String {
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what}: {said}");
    said
}

/// Whether `iopages luks check IMAGE` opens with the passphrase in `pass`.
fn opens(image: &str, pass: &Path) -> bool {
    luks(&[&"check", &image, &"--passphrase-file", &pass])
        .status
        .success()
}

/// `iopages serve` of `image` on a Unix socket in `dir`.
fn serve(dir: &Dir, image: &str, pass: &Path) -> Served {
    let mut cmd = serve_cmd();
    let sock = dir.join("s.sock");
    cmd.args(["--arena", "64M", "--image", image, "--passphrase-file"])
        .arg(pass)
        .arg("--unix")
        .arg(&sock);
    let mut srv = Served::spawn(cmd, dir.join("serve.err"), |_| {});
    srv.uri = format!("nbd+unix:///iopages?socket={}", sock.display());
    srv
}

/// Key changes on `image` (served by `srv`) while fio verifies through
/// it; then the passphrases expected open it and the old one does not.
fn rotate_while_served(dir: &Dir, image: &str, old: &Path, srv: Served) {
    let (a, b) = (dir.join("a.pass"), dir.join("b.pass"));
    std::fs::write(&a, b"second passphrase").unwrap();
    std::fs::write(&b, b"third passphrase").unwrap();
    let uri = srv.uri.clone();
    let fio = std::thread::spawn(move || fio_verify(&uri, "64M"));
    std::thread::sleep(Duration::from_millis(300));
    let cheap: [&dyn AsRef<std::ffi::OsStr>; 4] = [&"--pbkdf", &"pbkdf2", &"--iterations", &"1000"];
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"add-key",
        &image,
        &"--passphrase-file",
        &old,
        &"--new-passphrase-file",
        &a,
    ];
    args.extend(cheap);
    ok(luks(&args), "add-key while served");
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"change-key",
        &image,
        &"--passphrase-file",
        &a,
        &"--new-passphrase-file",
        &b,
    ];
    args.extend(cheap);
    ok(luks(&args), "change-key while served");
    ok(
        luks(&[&"remove-key", &image, &"--passphrase-file", &old]),
        "remove-key while served",
    );
    assert!(!fio.is_finished(), "the key changes overlapped the I/O");
    let job = fio.join().expect("fio ran");
    assert_eq!(job["error"], 0, "fio verify while the keys changed: {job}");
    srv.stop();
    assert!(opens(image, &b), "the passphrase left opens it");
    assert!(
        !opens(image, old) && !opens(image, &a),
        "the removed ones do not"
    );
}

#[test]
fn key_verbs_on_a_served_file_leave_the_clients_undisturbed() {
    if !tools(&["fio", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("online");
    let (img, pass) = luks2_image(&dir, "disk", "64M", b"first passphrase");
    let image = img.display().to_string();
    let srv = serve(&dir, &image, &pass);
    rotate_while_served(&dir, &image, &pass, srv);
    let b = dir.join("b.pass");
    run(cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(&b)
        .arg(&img));
}

#[test]
fn key_verbs_on_a_served_remote_leave_the_clients_undisturbed() {
    if !tools(&["fio", "nbdkit", "nbdinfo"]) {
        return;
    }
    let dir = Dir::new("online-remote");
    let (img, pass) = luks2_image(&dir, "disk", "64M", b"first passphrase");
    let sock: PathBuf = dir.join("store.sock");
    let (store, _) = NbdKit::file(&sock, &img);
    let image = format!("nbd+unix:///?socket={}", sock.display());
    let srv = serve(&dir, &image, &pass);
    rotate_while_served(&dir, &image, &pass, srv);
    drop(store);
    // Offline, the file itself: the same passphrases.
    assert!(opens(&img.display().to_string(), &dir.join("b.pass")));
    assert!(!opens(&img.display().to_string(), &pass));
}

#[test]
fn a_verb_racing_another_on_one_image_fails_at_once_with_nothing_changed() {
    if !tools(&["flock"]) {
        return;
    }
    let dir = Dir::new("online-race");
    let (img, pass) = luks2_image(&dir, "disk", "16M", b"first passphrase");
    let new = dir.join("new.pass");
    std::fs::write(&new, b"second passphrase").unwrap();
    let before = std::fs::read(&img).unwrap();
    // Another writer holds the image's lock (as a running verb does).
    // -o: flock keeps the lock itself (not its child), so killing it
    // releases the lock.
    let mut holder = Command::new("flock")
        .args(["-x", "-o"])
        .arg(&img)
        .args(["sleep", "30"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let out = luks(&[
        &"add-key",
        &img,
        &"--passphrase-file",
        &pass,
        &"--new-passphrase-file",
        &new,
        &"--pbkdf",
        &"pbkdf2",
        &"--iterations",
        &"1000",
    ]);
    let _ = holder.kill();
    let _ = holder.wait();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("is locked"),
        "{said}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "no waiting for the lock"
    );
    assert!(std::fs::read(&img).unwrap() == before, "nothing changed");
    // Once the other is done, the verb goes through.
    let args: [&dyn AsRef<std::ffi::OsStr>; 10] = [
        &"add-key",
        &img,
        &"--passphrase-file",
        &pass,
        &"--new-passphrase-file",
        &new,
        &"--pbkdf",
        &"pbkdf2",
        &"--iterations",
        &"1000",
    ];
    ok(luks(&args), "add-key after the race");
    assert!(opens(&img.display().to_string(), &new));
}
