//! `iopages serve` and `iopages luks` against the tools people use:
//! cryptsetup (formats volumes we open, checks volumes we make), nbdkit's
//! luks filter (reads back what we wrote, as a second LUKS
//! implementation), nbdcopy, qemu-io, qemu-img and fio's nbd engine as
//! clients.
//!
//! Every server is a real `iopages serve` process on a Unix socket,
//! stopped with SIGTERM (which must flush and exit 0). Where a tool is
//! missing the test says so and returns, except under `CI=true`, where
//! scripts/setup-debian.sh has installed them all and a missing one fails.

mod common;

use common::{
    cryptsetup, decrypt, fio_verify, luks_format, pattern, run, serve_cmd, tools, Dir, Served, BIN,
};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `iopages serve ARGS --unix SOCK --arena 128M`.
fn serve(args: &[&str], sock: &Path, stderr: PathBuf) -> Served {
    let mut cmd = serve_cmd();
    cmd.args(args)
        .arg("--unix")
        .arg(sock)
        .args(["--arena", "128M"]);
    let srv = Served::spawn(cmd, stderr, |_| {});
    assert!(srv.uri.starts_with("nbd+unix:///"), "{:?}", srv.banner);
    srv
}

fn write_pass(dir: &Dir, name: &str, pass: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pass).unwrap();
    p
}

fn luks1_by_cryptsetup(dir: &Dir, size: u64, pass: &Path) -> PathBuf {
    let img = dir.join("luks1.img");
    luks_format(
        &img,
        size,
        pass,
        "--type luks1 --cipher aes-xts-plain64 --key-size 512 --hash sha256 --pbkdf-force-iterations 1000",
    );
    img
}

/// Copy `src` into the export with nbdcopy.
fn nbdcopy_in(src: &Path, uri: &str) {
    run(Command::new("nbdcopy").arg(src).arg(uri));
}

/// The whole export through nbdkit's luks filter over `img`.
fn read_through_nbdkit(dir: &Dir, img: &Path, pass: &Path) -> Vec<u8> {
    let out = dir.join("nbdkit.raw");
    run(Command::new("nbdkit")
        .args(["-U", "-", "--filter=luks", "file"])
        .arg(img)
        .arg(format!("passphrase=+{}", pass.display()))
        .arg("--run")
        .arg(format!("nbdcopy \"$uri\" {}", out.display())));
    std::fs::read(out).unwrap()
}

fn decrypt_offline(dir: &Dir, img: &Path, pass: &Path) -> Vec<u8> {
    decrypt(img, pass, &dir.join("offline.raw"))
}

#[test]
fn cryptsetup_luks1_written_by_nbdcopy_reads_back_through_nbdkit_and_offline() {
    if !tools(&["cryptsetup", "nbdkit", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("luks1");
    let pass = write_pass(&dir, "pass", b"correct horse battery staple");
    let img = luks1_by_cryptsetup(&dir, 24 << 20, &pass);
    let before = std::fs::read(&img).unwrap();
    let srv = serve(
        &[
            "--image",
            img.to_str().unwrap(),
            "--passphrase-file",
            pass.to_str().unwrap(),
        ],
        &dir.join("sock"),
        dir.join("serve.err"),
    );
    assert!(
        srv.banner
            .iter()
            .any(|l| l.contains("LUKS1 aes-xts-plain64, 512-bit key, 512-byte sectors")),
        "{:?}",
        srv.banner
    );
    // The payload: 24 MiB minus the 2 MiB header.
    let payload = (24 << 20) - 4096 * 512;
    let data = pattern(1, payload);
    let src = dir.join("data.raw");
    std::fs::write(&src, &data).unwrap();
    nbdcopy_in(&src, &srv.uri);
    srv.stop();
    let after = std::fs::read(&img).unwrap();
    assert_eq!(
        &after[..4096 * 512],
        &before[..4096 * 512],
        "the header and key slots are untouched"
    );
    assert_ne!(
        &after[4096 * 512..4096 * 512 + 4096],
        &data[..4096],
        "the payload is encrypted"
    );
    let outside = read_through_nbdkit(&dir, &img, &pass);
    assert_eq!(outside.len(), data.len());
    assert!(
        outside == data,
        "nbdkit's luks filter reads what was written through iopages"
    );
    assert!(
        decrypt_offline(&dir, &img, &pass) == data,
        "the offline reader agrees"
    );
}

/// qemu-io writes two patterns to the export `iopages` on `sock`, FUA
/// on one (0x5a over the first MiB, 0xa5 over 256 KiB at 4 MiB), and
/// reads them back.
fn qemu_io_writes_two_patterns_and_reads_them_back(sock: &Path) {
    let out = run(Command::new("qemu-io")
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,server.type=unix,server.path={},export=iopages",
            sock.display()
        ))
        .args([
            "-c",
            "write -P 0x5a 0 1M",
            "-c",
            "write -f -P 0xa5 4M 256k",
            "-c",
            "read -P 0x5a 0 1M",
            "-c",
            "read -P 0xa5 4M 256k",
            "-c",
            "flush",
        ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
}

#[test]
fn cryptsetup_luks2_argon2id_4k_sectors_round_trip_through_qemu_io_and_offline() {
    if !tools(&["cryptsetup", "qemu-io", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("luks2");
    let pass = write_pass(&dir, "pass", b"luks2 passphrase");
    let img = dir.join("luks2.img");
    luks_format(
        &img,
        24 << 20,
        &pass,
        "--type luks2 --cipher aes-xts-plain64 --key-size 256 --sector-size 4096 --pbkdf argon2id --pbkdf-memory 32 --pbkdf-force-iterations 4",
    );
    // Through the page cache: small requests inline, large reads
    // decrypted straight from the mapped file.
    let srv = serve(
        &[
            "--image",
            img.to_str().unwrap(),
            "--passphrase-file",
            pass.to_str().unwrap(),
            "--io",
            "buffered",
        ],
        &dir.join("sock"),
        dir.join("serve.err"),
    );
    assert!(
        srv.banner
            .iter()
            .any(|l| l.contains("LUKS2 aes-xts-plain64, 256-bit key, 4096-byte sectors")),
        "{:?}",
        srv.banner
    );
    assert!(
        srv.banner.iter().any(|l| l.contains("(buffered")),
        "{:?}",
        srv.banner
    );
    qemu_io_writes_two_patterns_and_reads_them_back(&dir.join("sock"));
    let uri = srv.uri.clone();
    // And qemu-img convert reads the whole export.
    let raw = dir.join("export.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(&uri)
        .arg(&raw));
    let got = std::fs::read(&raw).unwrap();
    srv.stop();
    let offline = decrypt_offline(&dir, &img, &pass);
    assert_eq!(got.len(), offline.len());
    assert!(
        got == offline,
        "qemu-img through the server and the offline reader agree"
    );
    assert!(offline[..1 << 20].iter().all(|&b| b == 0x5a));
    assert!(offline[4 << 20..(4 << 20) + (256 << 10)]
        .iter()
        .all(|&b| b == 0xa5));
}

/// The volumes `iopages luks format` makes in the test below: LUKS1 with
/// PBKDF2, LUKS2 with Argon2id and 4096-byte sectors, LUKS2 with PBKDF2
/// over SHA-1 and a 256-bit key.
fn format_variants() -> [(&'static str, Vec<&'static str>); 3] {
    [
        (
            "l1.img",
            vec![
                "--type",
                "luks1",
                "--pbkdf",
                "pbkdf2",
                "--iterations",
                "1000",
            ],
        ),
        (
            "l2.img",
            vec![
                "--type",
                "luks2",
                "--pbkdf",
                "argon2id",
                "--iterations",
                "4",
                "--memory",
                "64",
                "--sector-size",
                "4096",
            ],
        ),
        (
            "l2p.img",
            vec![
                "--type",
                "luks2",
                "--pbkdf",
                "pbkdf2",
                "--hash",
                "sha1",
                "--iterations",
                "1000",
                "--key-size",
                "256",
            ],
        ),
    ]
}

/// `iopages luks format IMG --size 4M ARGS` succeeds, and a second
/// format without --yes is refused (the data would be lost).
fn format_once_then_refused_without_yes(img: &Path, pass: &Path, args: &[&str]) {
    let out = run(Command::new(BIN)
        .args(["luks", "format"])
        .arg(img)
        .args(["--size", "4M", "--passphrase-file"])
        .arg(pass)
        .args(args));
    assert!(out.contains("aes-xts-plain64"), "{out}");
    let again = Command::new(BIN)
        .args(["luks", "format"])
        .arg(img)
        .args(["--size", "4M", "--passphrase-file"])
        .arg(pass)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--yes"));
}

/// cryptsetup dumps `img`'s header, opens it with `pass` and refuses
/// `wrong`.
fn cryptsetup_opens_with_the_passphrase_only(img: &Path, pass: &Path, wrong: &Path) {
    run(cryptsetup().arg("luksDump").arg(img));
    run(cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass)
        .arg(img));
    let bad = cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(wrong)
        .arg(img)
        .output()
        .unwrap();
    assert!(
        !bad.status.success(),
        "cryptsetup must refuse the wrong passphrase"
    );
}

#[test]
fn volumes_made_by_iopages_luks_format_open_in_cryptsetup_and_nbdkit() {
    if !tools(&["cryptsetup", "nbdkit", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("format");
    let pass = write_pass(&dir, "pass", b"made here");
    let wrong = write_pass(&dir, "wrong", b"made elsewhere");
    for (name, args) in format_variants() {
        let img = dir.join(name);
        format_once_then_refused_without_yes(&img, &pass, &args);
        cryptsetup_opens_with_the_passphrase_only(&img, &pass, &wrong);
        // Written through our server: LUKS1 is read back by nbdkit.
        let sock = dir.join(&format!("{name}.sock"));
        let srv = serve(
            &[
                "--image",
                img.to_str().unwrap(),
                "--passphrase-file",
                pass.to_str().unwrap(),
            ],
            &sock,
            dir.join("serve.err"),
        );
        let data = pattern(7, 4 << 20);
        let src = dir.join("data.raw");
        std::fs::write(&src, &data).unwrap();
        nbdcopy_in(&src, &srv.uri);
        srv.stop();
        if name == "l1.img" {
            assert!(
                read_through_nbdkit(&dir, &img, &pass) == data,
                "nbdkit reads our LUKS1 volume"
            );
        }
        assert!(decrypt_offline(&dir, &img, &pass) == data);
    }
}

#[test]
fn the_default_in_memory_volume_serves_fio_verify_and_prints_statistics() {
    if !tools(&["fio", "nbdcopy", "cryptsetup"]) {
        return;
    }
    let dir = Dir::new("default");
    let srv = serve(&["--size", "64M"], &dir.join("sock"), dir.join("serve.err"));
    let pass_line = srv
        .banner
        .iter()
        .find_map(|l| l.strip_prefix("passphrase (shown once): "))
        .expect("the generated passphrase is printed")
        .to_string();
    assert_eq!(pass_line.len(), 24);
    assert!(
        srv.banner
            .iter()
            .any(|l| l.contains("LUKS2 aes-xts-plain64, 512-bit key, 4096-byte sectors")),
        "{:?}",
        srv.banner
    );
    let uri = srv.uri.clone();
    // fio's nbd engine: random writes with checksums, then reads them back.
    let job = &fio_verify(&uri, "16M");
    assert_eq!(job["error"], 0, "{job}");
    assert!(
        job["write"]["io_bytes"].as_u64().unwrap() >= 16 << 20,
        "{job}"
    );
    assert!(
        job["read"]["io_bytes"].as_u64().unwrap() >= 16 << 20,
        "fio read everything back to verify: {job}"
    );
    // SIGUSR1: a statistics line.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(srv.pid(), libc::SIGUSR1) };
    let line = srv
        .line_within(Duration::from_secs(10))
        .expect("a statistics line");
    assert!(
        line.contains("write ") && line.contains("out pages") && line.contains("payload buffers"),
        "{line}"
    );
    let rest = srv.stop();
    assert!(
        rest.iter().any(|l| l.contains("out pages")),
        "final statistics: {rest:?}"
    );
}

#[test]
fn libnbd_negotiates_structured_replies_and_reads_back_what_it_wrote() {
    if !tools(&["nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("structured");
    let srv = serve(&["--size", "16M"], &dir.join("sock"), dir.join("serve.err"));
    // libnbd asks for structured replies and checks every chunk it gets.
    let info = run(Command::new("nbdinfo").arg("--json").arg(&srv.uri));
    let v: serde_json::Value = serde_json::from_str(&info).expect("nbdinfo's JSON");
    assert_eq!(v["structured"], true, "{v}");
    let data = pattern(0x5c, 16 << 20);
    let src = dir.join("src.img");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(&srv.uri));
    let back = dir.join("back.img");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "read back through structured replies differs"
    );
    srv.stop();
}

#[test]
fn stats_json_carries_the_io_shape_and_a_bad_path_is_refused() {
    if !tools(&["nbdcopy"]) {
        return;
    }
    let dir = Dir::new("statsjson");
    // A path that cannot be written: refused before serving.
    let out = Command::new(BIN)
        .args(["serve", "--size", "16M", "--arena", "128M", "--unix"])
        .arg(dir.join("bad.sock"))
        .arg("--stats-json")
        .arg(dir.join("no/such/dir/stats.json"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot write --stats-json"), "{err}");
    let json = dir.join("stats.json");
    let json_arg = json.to_str().unwrap().to_string();
    let srv = serve(
        &[
            "--size",
            "16M",
            "--stats-interval",
            "1",
            "--stats-json",
            &json_arg,
        ],
        &dir.join("sock"),
        dir.join("serve.err"),
    );
    let src = dir.join("src.img");
    std::fs::write(&src, pattern(7, 16 << 20)).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(&srv.uri));
    // The next interval's snapshot has the writes.
    let mut v = serde_json::Value::Null;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let Ok(text) = std::fs::read_to_string(&json) else {
            continue;
        };
        v = serde_json::from_str(&text).expect("whole JSON, never half a file");
        if v["write"]["bytes"].as_u64() == Some(16 << 20) {
            break;
        }
    }
    assert_eq!(v["write"]["bytes"], 16 << 20, "{v}");
    let w = &v["shape"]["write"];
    assert_eq!(v["shape"]["sector_bytes"], 4096);
    assert!(w["requests"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(w["partial_sector"], 0, "nbdcopy writes whole sectors: {v}");
    assert_eq!(w["amplification"], 1.0);
    assert_eq!(w["sizes_log2"].as_array().unwrap().len(), 26);
    let line = srv
        .line_within(Duration::from_secs(5))
        .expect("a statistics line");
    assert!(line.contains("| shape: write "), "{line}");
    srv.stop();
}

/// Run `iopages ARGS` (standard input empty), which must fail.
///
/// **Returns:** its standard error, in lower case.
fn fail(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{args:?} must fail");
    String::from_utf8_lossy(&out.stderr).to_lowercase()
}

/// `serve` refuses `img` (LUKS1 under `pass`) with the `wrong`
/// passphrase, without one, with --size; and an image that is missing or
/// not LUKS; each error naming what is wrong.
fn serve_refuses_bad_passphrases_and_images(dir: &Dir, img: &Path, pass: &Path, wrong: &Path) {
    let e = fail(&[
        "serve",
        "--image",
        img.to_str().unwrap(),
        "--passphrase-file",
        wrong.to_str().unwrap(),
        "--unix",
        dir.join("s1").to_str().unwrap(),
    ]);
    assert!(e.contains("passphrase"), "{e}");
    let e = fail(&[
        "serve",
        "--image",
        img.to_str().unwrap(),
        "--unix",
        dir.join("s2").to_str().unwrap(),
    ]);
    assert!(e.contains("--passphrase-file"), "{e}");
    let e = fail(&[
        "serve",
        "--image",
        img.to_str().unwrap(),
        "--passphrase-file",
        pass.to_str().unwrap(),
        "--size",
        "8M",
    ]);
    assert!(e.contains("--size"), "{e}");
    let missing = dir.join("missing.img");
    let e = fail(&[
        "serve",
        "--image",
        missing.to_str().unwrap(),
        "--passphrase-file",
        pass.to_str().unwrap(),
    ]);
    assert!(e.contains("missing.img"), "{e}");
    let plain = dir.join("plain.img");
    std::fs::write(&plain, vec![0u8; 1 << 20]).unwrap();
    let e = fail(&[
        "serve",
        "--image",
        plain.to_str().unwrap(),
        "--passphrase-file",
        pass.to_str().unwrap(),
    ]);
    assert!(e.contains("luks") && e.contains("plain.img"), "{e}");
}

/// `luks check`, `luks decrypt` and `luks format` refuse the `wrong`
/// passphrase or a bad key size, a failed decrypt leaving no output
/// behind; `luks check` opens `img` with `pass`.
fn luks_tools_refuse_bad_passphrases_and_keys(dir: &Dir, img: &Path, pass: &Path, wrong: &Path) {
    let e = fail(&[
        "luks",
        "check",
        img.to_str().unwrap(),
        "--passphrase-file",
        wrong.to_str().unwrap(),
    ]);
    assert!(e.contains("passphrase"), "{e}");
    let ok = run(Command::new(BIN)
        .args(["luks", "check"])
        .arg(img)
        .arg("--passphrase-file")
        .arg(pass));
    assert!(ok.contains("LUKS1") && ok.contains("key slot 0"), "{ok}");
    // A failed decrypt leaves no output behind.
    let out = dir.join("never.raw");
    fail(&[
        "luks",
        "decrypt",
        img.to_str().unwrap(),
        out.to_str().unwrap(),
        "--passphrase-file",
        wrong.to_str().unwrap(),
    ]);
    assert!(!out.exists());
    let e = fail(&[
        "luks",
        "format",
        dir.join("x.img").to_str().unwrap(),
        "--size",
        "4M",
        "--passphrase-file",
        pass.to_str().unwrap(),
        "--key-size",
        "128",
    ]);
    assert!(e.contains("key-size"), "{e}");
}

/// `luks check --passphrase-file -` opens `img` with a passphrase line
/// ("right") on standard input.
fn a_passphrase_line_on_stdin_opens_it(img: &Path) {
    let mut stdin_pass = Command::new(BIN)
        .args(["luks", "check"])
        .arg(img)
        .args(["--passphrase-file", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    stdin_pass
        .stdin
        .take()
        .unwrap()
        .write_all(b"right\n")
        .unwrap();
    let mut s = String::new();
    stdin_pass
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    assert!(
        stdin_pass.wait().unwrap().success(),
        "a passphrase line on stdin opens it"
    );
    assert!(s.contains("LUKS1"));
}

#[test]
fn bad_passphrases_and_images_are_refused_with_clear_errors() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("bad");
    let pass = write_pass(&dir, "pass", b"right");
    let wrong = write_pass(&dir, "wrong", b"wrong");
    let img = luks1_by_cryptsetup(&dir, 4 << 20, &pass);
    serve_refuses_bad_passphrases_and_images(&dir, &img, &pass, &wrong);
    luks_tools_refuse_bad_passphrases_and_keys(&dir, &img, &pass, &wrong);
    a_passphrase_line_on_stdin_opens_it(&img);
}
