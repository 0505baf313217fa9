//! `iopages luks dump`, `header-backup` and `header-restore` against
//! cryptsetup: the dump shows luksDump's fields with luksDump's values,
//! `--json` is the JSON area; a backup restores with `cryptsetup
//! luksHeaderRestore` and cryptsetup's backup restores with ours; a
//! restore that does not fit is refused with the image unchanged; a
//! header-only image and a detached header are checked and dumped,
//! never decrypted; key verbs on a detached header; the same
//! verbs on a remote nbdkit store (`nbd+unix://`).
//!
//! cryptsetup, nbdkit and nbdinfo are outside tools: where one is missing
//! the test says so and returns, except under `CI=true`.

mod common;

use common::{cryptsetup, dump_fields, luks_format, run, tools, Dir, NbdKit, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const FAST: &str = "--pbkdf pbkdf2 --pbkdf-force-iterations 1000";

fn iopages(args: &[&str], paths: &[&Path]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("luks").args(args).args(paths);
    c
}

/// `cmd` must fail; its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success(), "{cmd:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A 20 MiB cryptsetup volume of `ty` in `dir` and its passphrase file.
fn volume(dir: &Dir, name: &str, ty: &str) -> (PathBuf, PathBuf) {
    let (img, pass) = (dir.join(name), dir.join("pass"));
    std::fs::write(&pass, b"header passphrase").unwrap();
    luks_format(&img, 20 << 20, &pass, &format!("--type {ty} {FAST}"));
    (img, pass)
}

/// The JSON area of the LUKS2 image's primary header, parsed.
fn json_area(img: &Path) -> serde_json::Value {
    let b = std::fs::read(img).unwrap();
    let area = &b[4096..16384];
    let end = area.iter().position(|&c| c == 0).unwrap();
    serde_json::from_slice(&area[..end]).unwrap()
}

#[test]
fn dump_shows_luksdumps_fields_and_json_is_the_json_area() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("dump");
    for ty in ["luks1", "luks2"] {
        let (img, _) = volume(&dir, &format!("{ty}.img"), ty);
        let ours = run(&mut iopages(&["dump"], &[&img]));
        let theirs = run(cryptsetup().arg("luksDump").arg(&img));
        let (o, t) = (dump_fields(&ours), dump_fields(&theirs));
        assert_eq!(o, t, "{ty}: ours\n{ours}\ntheirs\n{theirs}");
        assert!(o.contains_key("UUID") && o.len() > 10, "{o:?}");
    }
    let json = run(&mut iopages(&["dump", "--json"], &[&dir.join("luks2.img")]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v, json_area(&dir.join("luks2.img")));
    let e = fails(&mut iopages(&["dump", "--json"], &[&dir.join("luks1.img")]));
    assert!(e.contains("a LUKS1 header has no JSON metadata"), "{e}");
}

/// The image with its header area (the first `len` bytes) zeroed.
fn wiped_copy(img: &Path, to: &Path, len: usize) {
    let mut b = std::fs::read(img).unwrap();
    b[..len].fill(0);
    std::fs::write(to, b).unwrap();
}

#[test]
fn our_backup_restores_with_cryptsetup_and_theirs_with_ours() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("interop");
    for (ty, len) in [("luks1", 2068480usize), ("luks2", 16 << 20)] {
        let (img, pass) = volume(&dir, &format!("{ty}.img"), ty);
        let ours = dir.join(&format!("{ty}.ours"));
        run(&mut iopages(&["header-backup"], &[&img, &ours]));
        assert_eq!(std::fs::metadata(&ours).unwrap().len(), len as u64);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&ours).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // The backup is a header-only image: cryptsetup and we read it.
        run(cryptsetup().arg("luksDump").arg(&ours));
        let check = run(iopages(&["check"], &[&ours])
            .arg("--passphrase-file")
            .arg(&pass));
        assert!(check.contains("no payload: a header-only image"), "{check}");
        // Ours → cryptsetup luksHeaderRestore onto a wiped copy.
        let copy = dir.join(&format!("{ty}.copy"));
        wiped_copy(&img, &copy, len);
        run(cryptsetup()
            .args(["luksHeaderRestore", "--batch-mode", "--header-backup-file"])
            .arg(&ours)
            .arg(&copy));
        assert!(std::fs::read(&copy).unwrap() == std::fs::read(&img).unwrap());
        // cryptsetup luksHeaderBackup → ours onto a wiped copy (no LUKS
        // header there: --yes).
        let theirs = dir.join(&format!("{ty}.theirs"));
        run(cryptsetup()
            .args(["luksHeaderBackup", "--header-backup-file"])
            .arg(&theirs)
            .arg(&img));
        wiped_copy(&img, &copy, len);
        let e = fails(&mut iopages(&["header-restore"], &[&copy, &theirs]));
        assert!(
            e.contains("no valid LUKS header") && e.contains("--yes"),
            "{e}"
        );
        run(&mut iopages(
            &["header-restore", "--yes"],
            &[&copy, &theirs],
        ));
        assert!(std::fs::read(&copy).unwrap() == std::fs::read(&img).unwrap());
        run(cryptsetup()
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(&pass)
            .arg(&copy));
    }
}

#[test]
fn restore_refuses_what_does_not_fit_with_the_image_unchanged() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("refuse");
    let (img, _) = volume(&dir, "a.img", "luks2");
    let (other, _) = volume(&dir, "b.img", "luks2");
    let other_hdr = dir.join("b.hdr");
    run(&mut iopages(&["header-backup"], &[&other, &other_hdr]));
    let junk = dir.join("junk");
    std::fs::write(&junk, vec![0x5au8; 1 << 20]).unwrap();
    let before = std::fs::read(&img).unwrap();
    let e = fails(&mut iopages(&["header-restore", "--yes"], &[&img, &junk]));
    assert!(e.contains("not a valid LUKS header"), "{e}");
    let e = fails(&mut iopages(&["header-restore"], &[&img, &other_hdr]));
    assert!(e.contains("another volume") && e.contains("--yes"), "{e}");
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refused restore wrote"
    );
    // The backup file is never overwritten nor written through a link.
    let e = fails(&mut iopages(&["header-backup"], &[&img, &other_hdr]));
    assert!(e.contains("exists"), "{e}");
    let link = dir.join("link");
    std::os::unix::fs::symlink(dir.join("nowhere"), &link).unwrap();
    let e = fails(&mut iopages(&["header-backup"], &[&img, &link]));
    assert!(e.contains("symbolic link"), "{e}");
    assert!(!dir.join("nowhere").exists());
    // With --yes another volume's header replaces this one's.
    run(&mut iopages(
        &["header-restore", "--yes"],
        &[&img, &other_hdr],
    ));
    let d = dump_fields(&run(&mut iopages(&["dump"], &[&img])));
    let o = dump_fields(&run(&mut iopages(&["dump"], &[&other])));
    assert_eq!(d["UUID"], o["UUID"]);
}

#[test]
fn a_header_only_image_is_checked_and_dumped_but_never_decrypted() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("header-only");
    let (img, pass) = volume(&dir, "v.img", "luks2");
    // Cut at the data offset: what `check` used to call truncated.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let check = run(iopages(&["check"], &[&img])
        .arg("--passphrase-file")
        .arg(&pass));
    assert!(check.contains("key slot 0 opened"), "{check}");
    let dump = run(&mut iopages(&["dump"], &[&img]));
    assert_eq!(
        dump_fields(&dump),
        dump_fields(&run(cryptsetup().arg("luksDump").arg(&img)))
    );
    let out = dir.join("plain");
    let e = fails(
        iopages(&["decrypt"], &[&img, &out])
            .arg("--passphrase-file")
            .arg(&pass),
    );
    assert!(e.contains("no payload: a header-only image"), "{e}");
    assert!(!out.exists(), "decrypt left an output behind");
}

/// A detached header (`cryptsetup luksFormat --header`, data offset 0)
/// is checked, dumped and takes key verbs that cryptsetup then honours;
/// decrypting it says its payload is elsewhere.
#[test]
fn a_detached_header_takes_key_verbs_but_is_never_decrypted() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("detached");
    let (data, old, new) = (dir.join("data"), dir.join("old"), dir.join("new"));
    std::fs::write(&old, b"detached old").unwrap();
    std::fs::write(&new, b"detached new").unwrap();
    std::fs::File::create(&data)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    for ty in ["luks1", "luks2"] {
        let hdr = dir.join(&format!("{ty}.hdr"));
        std::fs::File::create(&hdr)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        run(cryptsetup()
            .args(["luksFormat", "--batch-mode", "--type", ty, "--header"])
            .arg(&hdr)
            .args(FAST.split_whitespace())
            .arg("--key-file")
            .arg(&old)
            .arg(&data));
        let check = run(iopages(&["check"], &[&hdr])
            .arg("--passphrase-file")
            .arg(&old));
        assert!(check.contains("a detached header"), "{ty}: {check}");
        run(iopages(&["change-key"], &[&hdr])
            .args(["--passphrase-file"])
            .arg(&old)
            .arg("--new-passphrase-file")
            .arg(&new)
            .args(["--pbkdf", "pbkdf2", "--iter-time", "50"]));
        let opens = |pass: &Path| {
            cryptsetup()
                .args(["open", "--test-passphrase", "--header"])
                .arg(&hdr)
                .arg("--key-file")
                .arg(pass)
                .arg(&data)
                .status()
                .unwrap()
                .success()
        };
        assert!(
            opens(&new) && !opens(&old),
            "{ty}: cryptsetup after change-key"
        );
        assert_eq!(
            dump_fields(&run(&mut iopages(&["dump"], &[&hdr]))),
            dump_fields(&run(cryptsetup().arg("luksDump").arg(&hdr))),
            "{ty}"
        );
        let out = dir.join("plain");
        let e = fails(
            iopages(&["decrypt"], &[&hdr, &out])
                .arg("--passphrase-file")
                .arg(&new),
        );
        assert!(e.contains("a detached header"), "{ty}: {e}");
        assert!(!out.exists(), "{ty}: decrypt left an output behind");
    }
}

#[test]
fn the_header_verbs_work_on_a_remote_store() {
    if !tools(&["cryptsetup", "nbdkit", "nbdinfo"]) {
        return;
    }
    let dir = Dir::new("remote");
    let (img, pass) = volume(&dir, "v.img", "luks2");
    let (other, _) = volume(&dir, "o.img", "luks2");
    let local_dump = run(&mut iopages(&["dump"], &[&img]));
    let local_json = run(&mut iopages(&["dump", "--json"], &[&img]));
    let (kit, uri) = NbdKit::file(&dir.join("sock"), &img);
    let remote = PathBuf::from(&uri);
    assert_eq!(run(&mut iopages(&["dump"], &[&remote])), local_dump);
    assert_eq!(
        run(&mut iopages(&["dump", "--json"], &[&remote])),
        local_json
    );
    let hdr = dir.join("remote.hdr");
    run(&mut iopages(&["header-backup"], &[&remote, &hdr]));
    assert!(std::fs::read(&hdr).unwrap() == std::fs::read(&img).unwrap()[..16 << 20]);
    // Another volume's header: refused without --yes, then restored.
    let other_hdr = dir.join("o.hdr");
    run(&mut iopages(&["header-backup"], &[&other, &other_hdr]));
    let before = std::fs::read(&img).unwrap();
    let e = fails(&mut iopages(&["header-restore"], &[&remote, &other_hdr]));
    assert!(e.contains("another volume"), "{e}");
    assert!(std::fs::read(&img).unwrap() == before);
    run(&mut iopages(
        &["header-restore", "--yes"],
        &[&remote, &other_hdr],
    ));
    // And back: the original header from the backup taken remotely.
    run(&mut iopages(&["header-restore", "--yes"], &[&remote, &hdr]));
    drop(kit);
    assert!(std::fs::read(&img).unwrap() == before);
    run(cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(&pass)
        .arg(&img));
}
