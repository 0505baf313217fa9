//! `iopages serve --config FILE`: several volumes behind one socket, each
//! opened at start or on first use; a bad export reported by name while
//! the others serve (or, with --strict, no start); a bad file refused with
//! its line; two exports copied in parallel by nbdcopy.
//!
//! Volumes are made with `iopages luks format` (cheap PBKDF2, so the tests
//! stay fast). nbdcopy and nbdinfo are outside tools: where one is
//! missing the test says so and returns, except under `CI=true`, where a
//! missing one fails.

mod common;

use common::{export_table, luks2_image, pattern, run, serve_cmd, tools, Dir, Served, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A LUKS2 image of `size` payload bytes under `pass` (cheap PBKDF2).
fn image(dir: &Dir, name: &str, size: &str, pass: &[u8]) -> (PathBuf, PathBuf) {
    luks2_image(dir, name, size, pass)
}

fn export(name: &str, img: &Path, pass: &Path, extra: &str) -> String {
    export_table(name, &img.display().to_string(), pass, extra)
}

/// `iopages serve --config CONFIG EXTRA`.
fn serve(config: &Path, extra: &[&str], stderr: PathBuf) -> Served {
    let mut cmd = serve_cmd();
    cmd.arg("--config").arg(config).args(extra);
    Served::spawn(cmd, stderr, |_| {})
}

fn uri(sock: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", sock.display())
}

/// Both exports of the test below written by nbdcopy at once (alpha 16
/// MiB, beta 8 MiB of different patterns), then read back.
///
/// **Returns:** what alpha holds.
fn both_written_at_once_and_read_back(dir: &Dir, sock: &Path) -> Vec<u8> {
    let (da, db) = (pattern(1, 16 << 20), pattern(2, 8 << 20));
    let (fa, fb) = (dir.join("a.raw"), dir.join("b.raw"));
    std::fs::write(&fa, &da).unwrap();
    std::fs::write(&fb, &db).unwrap();
    let copy = |src: String, dst: String| {
        std::thread::spawn(move || run(Command::new("nbdcopy").arg(&src).arg(&dst)))
    };
    let t1 = copy(fa.display().to_string(), uri(sock, "alpha"));
    let t2 = copy(fb.display().to_string(), uri(sock, "beta"));
    t1.join().unwrap();
    t2.join().unwrap();
    let (ba, bb) = (dir.join("a.back"), dir.join("b.back"));
    let t1 = copy(uri(sock, "alpha"), ba.display().to_string());
    let t2 = copy(uri(sock, "beta"), bb.display().to_string());
    t1.join().unwrap();
    t2.join().unwrap();
    assert!(std::fs::read(&ba).unwrap() == da, "alpha reads back");
    assert!(std::fs::read(&bb).unwrap() == db, "beta reads back");
    da
}

#[test]
fn two_exports_serve_at_once_and_keep_their_data_apart() {
    if !tools(&["nbdcopy", "nbdinfo"]) {
        return;
    }
    let dir = Dir::new("config-two");
    let (a, pa) = image(&dir, "a", "16M", b"first passphrase");
    let (b, pb) = image(&dir, "b", "8M", b"second passphrase");
    let sock = dir.join("s.sock");
    let cfg = dir.join("iopages.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nunix = [\"{}\"]\n\n{}{}",
            sock.display(),
            export("alpha", &a, &pa, "description = \"the first\""),
            export("beta", &b, &pb, "allow-discards = true"),
        ),
    )
    .unwrap();
    let s = serve(&cfg, &[], dir.join("err"));
    for name in ["alpha", "beta"] {
        assert!(
            s.banner
                .iter()
                .any(|l| l.starts_with(&format!("export {name}: volume: LUKS2"))),
            "{:?}",
            s.banner
        );
        assert!(s.banner.contains(&format!("serving {}", uri(&sock, name))));
    }
    let list = run(Command::new("nbdinfo").arg("--list").arg(uri(&sock, "")));
    assert!(
        list.contains("export=\"alpha\"") && list.contains("export=\"beta\""),
        "{list}"
    );
    let info = run(Command::new("nbdinfo").arg(uri(&sock, "alpha")));
    assert!(info.contains("description: the first"), "{info}");
    let da = both_written_at_once_and_read_back(&dir, &sock);
    // Discards are per export: alpha (without them) reports no holes.
    let map = run(Command::new("nbdinfo")
        .arg("--map")
        .arg(uri(&sock, "alpha")));
    assert!(!map.contains("hole"), "{map}");
    s.stop();
    // Offline: the images hold what was written, each under its own key.
    let out = dir.join("a.plain");
    run(Command::new(BIN)
        .args(["luks", "decrypt", "--passphrase-file"])
        .arg(&pa)
        .arg(&a)
        .arg(&out));
    assert!(
        std::fs::read(&out).unwrap() == da,
        "alpha's image decrypts offline"
    );
}

#[test]
fn a_bad_export_is_reported_by_name_and_the_others_serve_unless_strict() {
    let dir = Dir::new("config-bad");
    let (a, pa) = image(&dir, "a", "8M", b"right");
    let wrong = dir.join("wrong.pass");
    std::fs::write(&wrong, b"wrong").unwrap();
    let sock = dir.join("s.sock");
    let cfg = dir.join("iopages.toml");
    let body = format!(
        "[server]\nunix = [\"{}\"]\n\n{}{}",
        sock.display(),
        export("good", &a, &pa, ""),
        export("bad", &a, &wrong, ""),
    );
    std::fs::write(&cfg, &body).unwrap();
    let s = serve(&cfg, &[], dir.join("err"));
    assert!(s
        .banner
        .contains(&format!("serving {}", uri(&sock, "good"))));
    assert!(
        !s.banner.iter().any(|l| l.contains("///bad")),
        "{:?}",
        s.banner
    );
    let err = s.stderr_text();
    assert!(
        err.contains("export \"bad\" (line 10)") && err.contains("not served"),
        "{err}"
    );
    s.stop();
    // --strict (or strict = true in the file): no start, the export named.
    for (file, args) in [
        (body.clone(), vec!["--strict"]),
        (
            body.replace("[server]\n", "[server]\nstrict = true\n"),
            vec![],
        ),
    ] {
        std::fs::write(&cfg, file).unwrap();
        let out = Command::new(BIN)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("export \"bad\""), "{err}");
        assert!(!sock.exists(), "nothing was served");
    }
}

#[test]
fn a_lazy_export_unlocks_on_first_use() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let dir = Dir::new("config-lazy");
    let (a, pa) = image(&dir, "a", "8M", b"lazy one");
    let wrong = dir.join("wrong.pass");
    std::fs::write(&wrong, b"wrong").unwrap();
    let sock = dir.join("s.sock");
    let cfg = dir.join("iopages.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nunix = [\"{}\"]\nunlock = \"lazy\"\n\n{}{}",
            sock.display(),
            export("later", &a, &pa, ""),
            export("never", &a, &wrong, ""),
        ),
    )
    .unwrap();
    let s = serve(&cfg, &[], dir.join("err"));
    assert!(
        s.banner
            .contains(&"export later: opened on first use".to_string()),
        "{:?}",
        s.banner
    );
    assert!(
        !s.banner.iter().any(|l| l.contains("volume: LUKS2")),
        "nothing unlocked yet"
    );
    let info = run(Command::new("nbdinfo").arg(uri(&sock, "later")));
    assert!(info.contains("export-size: 8388608"), "{info}");
    // The wrong passphrase: the client gets an error, the log names it.
    let out = Command::new("nbdinfo")
        .arg(uri(&sock, "never"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = s.stderr_text();
    assert!(
        err.contains("export \"never\" could not be opened"),
        "{err}"
    );
    s.stop();
}

#[test]
fn a_bad_file_is_refused_with_its_line_and_flags_that_belong_to_an_export_are_refused() {
    let dir = Dir::new("config-file");
    let cfg = dir.join("iopages.toml");
    std::fs::write(&cfg, "[[export]]\nname = \"x\"\nimag = \"/nope\"\n").unwrap();
    let out = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3:", cfg.display())), "{err}");
    assert!(err.contains("unknown key \"imag\""), "{err}");
    let out = Command::new(BIN)
        .args(["serve", "--image", "/x.luks", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
}
