//! `iopages luks add-key | remove-key | change-key | kill-slot` against
//! cryptsetup, both ways: what iopages changes, cryptsetup opens (and
//! `luksDump` lists); what cryptsetup's `luksAddKey`, `luksChangeKey`,
//! `luksRemoveKey` and `luksKillSlot` change, iopages opens; and the same
//! verbs on a header stored behind nbdkit (`nbd+unix://`); on a loop
//! device, cryptsetup waits for the lock iopages holds. Cheap KDFs
//! throughout (PBKDF2, 1000 iterations).

mod common;

use common::{cryptsetup, luks_format, run, tools, Dir, NbdKit, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const CHEAP: [&str; 4] = ["--pbkdf", "pbkdf2", "--iterations", "1000"];
const TYPES: [&str; 2] = ["luks1", "luks2"];

/// Passphrase files `a` to `e` in `dir`.
fn passes(dir: &Dir) -> Vec<PathBuf> {
    ["a", "b", "c", "d", "e"]
        .iter()
        .map(|n| {
            let p = dir.join(n);
            std::fs::write(&p, format!("passphrase {n}")).unwrap();
            p
        })
        .collect()
}

/// A volume made by cryptsetup of type `ty` under passphrase file `key`.
fn cryptsetup_image(dir: &Dir, ty: &str, key: &Path) -> PathBuf {
    let img = dir.join(&format!("{ty}.img"));
    let args = format!(
        "--type {ty} --cipher aes-xts-plain64 --key-size 512 --pbkdf pbkdf2 \
         --pbkdf-force-iterations 1000"
    );
    luks_format(&img, 20 << 20, key, &args);
    img
}

/// Whether cryptsetup accepts passphrase file `key` for `img`.
fn cryptsetup_opens(img: &Path, key: &Path) -> bool {
    cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(key)
        .arg(img)
        .stdin(Stdio::null())
        .output()
        .unwrap()
        .status
        .success()
}

/// Whether `iopages luks check` opens `img` with passphrase file `key`.
fn iopages_opens(img: &Path, key: &Path) -> bool {
    Command::new(BIN)
        .args(["luks", "check"])
        .arg(img)
        .arg("--passphrase-file")
        .arg(key)
        .stdin(Stdio::null())
        .output()
        .unwrap()
        .status
        .success()
}

/// The open/closed pattern of passphrase files `keys` on `img` must be
/// `want` for cryptsetup and for iopages alike.
fn both_agree(img: &Path, keys: &[PathBuf], want: &[bool], what: &str) {
    for (k, w) in keys.iter().zip(want) {
        assert_eq!(cryptsetup_opens(img, k), *w, "{what}: cryptsetup, {k:?}");
        assert_eq!(iopages_opens(img, k), *w, "{what}: iopages, {k:?}");
    }
}

fn luks_dump(img: &Path) -> String {
    run(cryptsetup().arg("luksDump").arg(img))
}

/// The four iopages verbs on `image` (a path or a URI) whose header is in
/// the file `file`, checked by cryptsetup and iopages after each.
fn iopages_verbs(image: &str, file: &Path, k: &[PathBuf], what: &str) {
    let p = |i: usize| k[i].display().to_string();
    let verb = |name: &str, args: &[&str], cheap: bool| {
        let mut c = Command::new(BIN);
        c.args(["luks", name, image]).args(args);
        if cheap {
            c.args(CHEAP);
        }
        run(&mut c)
    };
    let out = verb(
        "add-key",
        &["--passphrase-file", &p(0), "--new-passphrase-file", &p(1)],
        true,
    );
    assert!(out.contains("key slot 1 added"), "{what}: {out}");
    if image.starts_with("nbd") {
        assert!(
            out.contains("read back from the store: as written"),
            "{what}: {out}"
        );
    }
    both_agree(
        file,
        &k[..3],
        &[true, true, false],
        &format!("{what} add-key"),
    );
    let out = verb(
        "change-key",
        &["--passphrase-file", &p(1), "--new-passphrase-file", &p(2)],
        true,
    );
    assert!(out.contains("changed"), "{what}: {out}");
    both_agree(
        file,
        &k[..3],
        &[true, false, true],
        &format!("{what} change-key"),
    );
    let out = verb("remove-key", &["--passphrase-file", &p(0)], false);
    assert!(out.contains("key slot 0 removed"), "{what}: {out}");
    both_agree(
        file,
        &k[..3],
        &[false, false, true],
        &format!("{what} remove-key"),
    );
    let to_five = [
        "--passphrase-file",
        &p(2),
        "--new-passphrase-file",
        &p(3),
        "--key-slot",
        "5",
    ];
    verb("add-key", &to_five, true);
    let out = verb("kill-slot", &["5", "--passphrase-file", &p(2)], false);
    assert!(out.contains("key slot 5 removed"), "{what}: {out}");
    both_agree(file, &k[2..4], &[true, false], &format!("{what} kill-slot"));
    let dump = luks_dump(file);
    if dump.contains("Key Slot 5:") {
        assert!(dump.contains("Key Slot 5: DISABLED"), "{what}: {dump}");
    } else {
        assert!(!dump.contains("  5: luks2"), "{what}: {dump}");
        assert!(dump.contains("  1: luks2"), "{what}: {dump}");
    }
}

#[test]
fn iopages_key_verbs_are_what_cryptsetup_opens() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    for ty in TYPES {
        for maker in ["iopages", "cryptsetup"] {
            let dir = Dir::new(&format!("{ty}-{maker}"));
            let k = passes(&dir);
            let img = if maker == "cryptsetup" {
                cryptsetup_image(&dir, ty, &k[0])
            } else {
                let img = dir.join("img");
                run(Command::new(BIN)
                    .args(["luks", "format", "--type", ty, "--size", "1M"])
                    .args(CHEAP)
                    .arg("--passphrase-file")
                    .arg(&k[0])
                    .arg(&img));
                img
            };
            let what = format!("{ty} made by {maker}");
            iopages_verbs(&img.display().to_string(), &img, &k, &what);
        }
    }
}

#[test]
fn cryptsetup_key_verbs_are_what_iopages_opens() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    for ty in TYPES {
        let dir = Dir::new(ty);
        let k = passes(&dir);
        let img = cryptsetup_image(&dir, ty, &k[0]);
        let cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
        let cs = |verb: &str, extra: &[&Path]| {
            let mut c = cryptsetup();
            c.args([verb, "--batch-mode"]).args(cheap);
            for e in extra {
                c.arg(e);
            }
            run(&mut c)
        };
        cs("luksAddKey", &[Path::new("--key-file"), &k[0], &img, &k[1]]);
        both_agree(
            &img,
            &k[..3],
            &[true, true, false],
            &format!("{ty} luksAddKey"),
        );
        cs(
            "luksChangeKey",
            &[Path::new("--key-file"), &k[1], &img, &k[2]],
        );
        both_agree(
            &img,
            &k[..3],
            &[true, false, true],
            &format!("{ty} luksChangeKey"),
        );
        run(cryptsetup()
            .args(["luksRemoveKey", "--batch-mode"])
            .arg(&img)
            .arg(&k[0]));
        both_agree(
            &img,
            &k[..3],
            &[false, false, true],
            &format!("{ty} luksRemoveKey"),
        );
        cs("luksAddKey", &[Path::new("--key-file"), &k[2], &img, &k[3]]);
        // "d" went to the lowest free slot, 0 (removed above).
        run(cryptsetup()
            .args(["luksKillSlot", "--batch-mode"])
            .arg(&img)
            .arg("0")
            .arg("--key-file")
            .arg(&k[2]));
        both_agree(
            &img,
            &k[2..4],
            &[true, false],
            &format!("{ty} luksKillSlot"),
        );
    }
}

#[test]
fn refusals_change_nothing_and_say_why() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("refusals");
    let k = passes(&dir);
    let p = |i: usize| k[i].display().to_string();
    let img = cryptsetup_image(&dir, "luks2", &k[0]);
    let before = std::fs::read(&img).unwrap();
    let img_s = img.display().to_string();
    let fail = |verb: &str, args: &[&str], want: &str| {
        let mut c = Command::new(BIN);
        c.args(["luks", verb, &img_s]).args(args).args(CHEAP);
        let out = c.stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success() && err.contains(want), "{c:?}: {err}");
    };
    let (a, b, c) = (p(0), p(1), p(2));
    fail(
        "add-key",
        &["--passphrase-file", &b, "--new-passphrase-file", &c],
        "wrong passphrase",
    );
    let stdin = ["--passphrase-file", "-", "--new-passphrase-file", "-"];
    fail("add-key", &stdin, "cannot both be");
    let in_use = [
        "--passphrase-file",
        &a,
        "--new-passphrase-file",
        &c,
        "--key-slot",
        "0",
    ];
    fail("add-key", &in_use, "is in use");
    let run_plain = |verb: &str, args: &[&str], want: &str| {
        let mut cmd = Command::new(BIN);
        cmd.args(["luks", verb, &img_s]).args(args);
        let out = cmd.stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !out.status.success() && err.contains(want),
            "{cmd:?}: {err}"
        );
    };
    run_plain(
        "remove-key",
        &["--passphrase-file", &a],
        "last usable key slot",
    );
    run_plain("kill-slot", &["0"], "last usable key slot");
    run_plain("kill-slot", &["3"], "not in use");
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refused verb changed the image"
    );
}

#[test]
fn key_verbs_on_a_remote_header_behind_nbdkit() {
    if !tools(&["cryptsetup", "nbdkit"]) {
        return;
    }
    for ty in TYPES {
        let dir = Dir::new(&format!("remote-{ty}"));
        let k = passes(&dir);
        let img = cryptsetup_image(&dir, ty, &k[0]);
        let (_kid, uri) = NbdKit::file(&dir.join("sock"), &img);
        iopages_verbs(&uri, &img, &k, &format!("{ty} behind nbdkit"));
    }
}

/// A loop device over a new sparse file, detached when dropped; `None`
/// where loop devices cannot be had (not root, no losetup, refused).
struct LoopDev {
    dev: PathBuf,
}

impl LoopDev {
    fn new(file: &Path, size: u64) -> Option<LoopDev> {
        // SAFETY: geteuid reads the caller's effective user id; no memory.
        if unsafe { libc::geteuid() } != 0 || !tools(&["losetup"]) {
            eprintln!("skipped: loop devices need root and losetup");
            return None;
        }
        std::fs::File::create(file).unwrap().set_len(size).unwrap();
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!("skipped: losetup: {}", String::from_utf8_lossy(&out.stderr));
            return None;
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Some(LoopDev { dev })
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// `iopages luks add-key` of a slow slot (about 3 s of PBKDF2), which
/// keeps iopages in its verb with the locks held from the start.
fn slow_add_key(dev: &Path, old: &Path, new: &Path) -> std::process::Child {
    Command::new(BIN)
        .args(["luks", "add-key"])
        .arg(dev)
        .arg("--passphrase-file")
        .arg(old)
        .arg("--new-passphrase-file")
        .arg(new)
        .args(["--pbkdf", "pbkdf2", "--iter-time", "3000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// On a block device iopages takes cryptsetup's own lock
/// (`/run/cryptsetup/L_MAJ:MIN`) beside its flock: a `cryptsetup
/// luksAddKey` started while `iopages luks add-key` derives a slow slot
/// waits for it, and both slots are there afterwards — neither change is
/// lost. And a second iopages verb meanwhile fails at once.
#[test]
fn on_a_block_device_cryptsetup_waits_for_iopages_lock() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("keys-blockdev");
    let k = passes(&dir);
    let Some(lo) = LoopDev::new(&dir.join("backing"), 24 << 20) else {
        return;
    };
    run(cryptsetup()
        .args(["luksFormat", "--batch-mode", "--type", "luks2"])
        .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
        .arg("--key-file")
        .arg(&k[0])
        .arg(&lo.dev));
    let start = std::time::Instant::now();
    let ours = slow_add_key(&lo.dev, &k[0], &k[1]);
    std::thread::sleep(std::time::Duration::from_millis(700));
    let racing = Command::new(BIN)
        .args(["luks", "kill-slot", "--yes"])
        .arg(&lo.dev)
        .arg("0")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!racing.status.success(), "a second iopages verb ran");
    let why = String::from_utf8_lossy(&racing.stderr);
    assert!(why.contains("is locked by another process"), "{why}");
    let theirs = cryptsetup()
        .args(["luksAddKey", "--batch-mode"])
        .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
        .arg("--key-file")
        .arg(&k[0])
        .arg(&lo.dev)
        .arg(&k[2])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let cs_done = start.elapsed();
    let ours_out = ours.wait_with_output().unwrap();
    assert!(
        ours_out.status.success(),
        "iopages add-key: {}",
        String::from_utf8_lossy(&ours_out.stderr)
    );
    assert!(
        theirs.status.success(),
        "cryptsetup luksAddKey: {}",
        String::from_utf8_lossy(&theirs.stderr)
    );
    // cryptsetup's own KDF is cheap: it could only take this long by
    // waiting for the lock iopages held through its ~3 s derivation.
    assert!(
        cs_done >= std::time::Duration::from_millis(2000),
        "cryptsetup finished after {cs_done:?}, while iopages held the lock"
    );
    for key in &k[..3] {
        assert!(cryptsetup_opens(&lo.dev, key), "{key:?} does not open");
    }
}
