//! LUKS1 and LUKS2 against outside implementations and damaged input:
//! volumes `cryptsetup luksFormat` makes open here with the volume key
//! `cryptsetup luksDump --dump-volume-key` reports; volumes made here pass
//! `cryptsetup luksDump` and `cryptsetup open --test-passphrase`; data
//! encrypted with `LuksVolume::xts_cipher` at `data_offset_bytes` reads
//! back as plaintext through nbdkit's luks filter; flipped bytes and
//! truncations give the right error; random and mutated headers never
//! panic.
//!
//! cryptsetup and nbdkit are outside tools: where one is missing the test
//! prints a skip line, except under `CI=true`, where it fails (CI installs
//! them with scripts/setup-debian.sh).

use iopages_crypt::luks::{self, FormatOptions, Hash, LuksError, LuksVersion, LuksVolume, Pbkdf};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{need, Dir};

const PASS: &[u8] = b"correct horse battery staple";
const PASS2: &[u8] = b"second passphrase";
const WRONG: &[u8] = b"not the passphrase";

// ---- helpers ---------------------------------------------------------

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    out
}

fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sparse(p: &Path, size: u64) {
    let f = File::create(p).unwrap();
    f.set_len(size).unwrap();
}

/// `cryptsetup luksDump --dump-volume-key`: the "MK dump:" hex lines.
fn dumped_key(cs: &Path, img: &Path, pass_file: &Path) -> Vec<u8> {
    let out = run_ok(
        Command::new(cs)
            .args(["luksDump", "-q", "--dump-volume-key", "--key-file"])
            .arg(pass_file)
            .arg(img),
    );
    let mut key = Vec::new();
    let mut in_dump = false;
    for line in out.lines() {
        let rest = if let Some(r) = line.strip_prefix("MK dump:") {
            in_dump = true;
            r
        } else if in_dump && line.starts_with(char::is_whitespace) {
            line
        } else {
            in_dump = false;
            continue;
        };
        for h in rest.split_whitespace() {
            key.push(
                u8::from_str_radix(h, 16).unwrap_or_else(|_| panic!("bad hex {h:?} in {out}")),
            );
        }
    }
    assert!(
        key.len() == 32 || key.len() == 64,
        "no volume key in:\n{out}"
    );
    key
}

/// The payload offset `cryptsetup luksDump` reports, in bytes.
fn dumped_data_offset(cs: &Path, img: &Path) -> u64 {
    let out = run_ok(Command::new(cs).arg("luksDump").arg(img));
    for line in out.lines() {
        let l = line.trim();
        if let Some(v) = l.strip_prefix("Payload offset:") {
            return v.trim().parse::<u64>().unwrap() * 512;
        }
        if let Some(v) = l.strip_prefix("offset:") {
            return v.trim().trim_end_matches("[bytes]").trim().parse().unwrap();
        }
    }
    panic!("no payload offset in:\n{out}")
}

fn open_err(img: &Path, pass: &[u8]) -> LuksError {
    match luks::open_path(img, pass) {
        Ok(v) => panic!("{} opened: {v:?}", img.display()),
        Err(e) => e,
    }
}

// ---- cryptsetup → ours ------------------------------------------------

struct Case {
    name: &'static str,
    args: &'static [&'static str],
    size: u64,
    key_bytes: usize,
    sector: usize,
    version: LuksVersion,
    /// luksAddKey's KDF arguments for the second slot.
    add_key: &'static [&'static str],
}

const PBKDF2_1000: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
const ARGON2ID_CHEAP: &[&str] = &[
    "--pbkdf",
    "argon2id",
    "--pbkdf-memory",
    "32",
    "--pbkdf-force-iterations",
    "4",
];

const CASES: &[Case] = &[
    Case {
        name: "luks1-sha256-512",
        args: &[
            "--type",
            "luks1",
            "--key-size",
            "512",
            "--hash",
            "sha256",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
        size: 4 << 20,
        key_bytes: 64,
        sector: 512,
        version: LuksVersion::Luks1,
        add_key: PBKDF2_1000,
    },
    Case {
        name: "luks1-sha1-256",
        args: &[
            "--type",
            "luks1",
            "--key-size",
            "256",
            "--hash",
            "sha1",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
        size: 4 << 20,
        key_bytes: 32,
        sector: 512,
        version: LuksVersion::Luks1,
        add_key: PBKDF2_1000,
    },
    Case {
        name: "luks2-pbkdf2-sha256",
        args: &[
            "--type",
            "luks2",
            "--key-size",
            "512",
            "--sector-size",
            "512",
            "--pbkdf",
            "pbkdf2",
            "--hash",
            "sha256",
            "--pbkdf-force-iterations",
            "1000",
        ],
        size: 20 << 20,
        key_bytes: 64,
        sector: 512,
        version: LuksVersion::Luks2,
        add_key: PBKDF2_1000,
    },
    Case {
        name: "luks2-pbkdf2-sha1-256",
        args: &[
            "--type",
            "luks2",
            "--key-size",
            "256",
            "--sector-size",
            "512",
            "--pbkdf",
            "pbkdf2",
            "--hash",
            "sha1",
            "--pbkdf-force-iterations",
            "1000",
        ],
        size: 20 << 20,
        key_bytes: 32,
        sector: 512,
        version: LuksVersion::Luks2,
        add_key: PBKDF2_1000,
    },
    Case {
        name: "luks2-argon2id",
        args: &[
            "--type",
            "luks2",
            "--key-size",
            "512",
            "--sector-size",
            "512",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
        ],
        size: 20 << 20,
        key_bytes: 64,
        sector: 512,
        version: LuksVersion::Luks2,
        add_key: ARGON2ID_CHEAP,
    },
    Case {
        name: "luks2-argon2i-4-lanes",
        args: &[
            "--type",
            "luks2",
            "--key-size",
            "256",
            "--sector-size",
            "512",
            "--pbkdf",
            "argon2i",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-parallel",
            "4",
        ],
        size: 20 << 20,
        key_bytes: 32,
        sector: 512,
        version: LuksVersion::Luks2,
        add_key: ARGON2ID_CHEAP,
    },
    Case {
        name: "luks2-sector4096",
        args: &[
            "--type",
            "luks2",
            "--key-size",
            "512",
            "--sector-size",
            "4096",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
        ],
        size: 20 << 20,
        key_bytes: 64,
        sector: 4096,
        version: LuksVersion::Luks2,
        add_key: PBKDF2_1000,
    },
];

fn cryptsetup_format(cs: &Path, dir: &Dir, case: &Case, pass_file: &Path) -> PathBuf {
    let img = dir.path(&format!("{}.img", case.name));
    sparse(&img, case.size);
    run_ok(
        Command::new(cs)
            .args(["luksFormat", "-q", "--cipher", "aes-xts-plain64"])
            .args(case.args)
            .arg("--key-file")
            .arg(pass_file)
            .arg(&img),
    );
    img
}

fn check_cryptsetup_volume(cs: &Path, case: &Case) {
    let dir = Dir::new("luks", case.name);
    let pass = dir.file("pass", PASS);
    let pass2 = dir.file("pass2", PASS2);
    let img = cryptsetup_format(cs, &dir, case, &pass);

    let want_key = dumped_key(cs, &img, &pass);
    let vol = luks::open_path(&img, PASS).unwrap_or_else(|e| panic!("{}: {e}", case.name));
    assert_eq!(vol.master_key(), &want_key[..], "{}", case.name);
    assert_eq!(vol.version(), case.version);
    assert_eq!(vol.master_key().len(), case.key_bytes);
    assert_eq!(vol.sector_size(), case.sector);
    assert_eq!(vol.cipher_spec(), "aes-xts-plain64");
    assert_eq!(vol.keyslot(), 0);
    assert!(!vol.used_secondary_header());
    assert_eq!(
        vol.data_offset_bytes(),
        dumped_data_offset(cs, &img),
        "{}",
        case.name
    );
    assert_eq!(
        vol.data_size_bytes(case.size),
        case.size - vol.data_offset_bytes()
    );
    let uuid = run_ok(Command::new(cs).arg("luksUUID").arg(&img));
    assert_eq!(vol.uuid(), uuid.trim());
    let xts = vol.xts_cipher().unwrap();
    assert_eq!(xts.sector_size_bytes(), case.sector);
    // IVs count 512-byte units: sector 1 of a 4096-byte volume has IV 8.
    assert_eq!(xts.iv_sector(1), (case.sector / 512) as u64);

    assert!(
        matches!(open_err(&img, WRONG), LuksError::WrongPassphrase),
        "{}",
        case.name
    );

    // A second keyslot, added by cryptsetup.
    run_ok(
        Command::new(cs)
            .args(["luksAddKey", "-q", "--key-file"])
            .arg(&pass)
            .args(case.add_key)
            .arg(&img)
            .arg(&pass2),
    );
    let vol2 = luks::open_path(&img, PASS2).unwrap();
    assert_eq!(vol2.keyslot(), 1);
    assert_eq!(vol2.master_key(), &want_key[..]);
    assert_eq!(luks::open_path(&img, PASS).unwrap().keyslot(), 0);
    assert!(matches!(open_err(&img, WRONG), LuksError::WrongPassphrase));

    if case.version == LuksVersion::Luks2 {
        // cryptsetup's secondary header copy, when its primary is damaged.
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(b"\xff", 4096 + 10).unwrap();
        drop(f);
        let v = luks::open_path(&img, PASS2).unwrap();
        assert!(v.used_secondary_header(), "{}", case.name);
        assert_eq!(v.master_key(), &want_key[..]);
    }
}

#[test]
fn cryptsetup_volumes_open_here_with_cryptsetups_volume_key() {
    let Some(cs) = need("cryptsetup", "cryptsetup_volumes_open_here") else {
        return;
    };
    for case in CASES {
        check_cryptsetup_volume(&cs, case);
    }
}

// ---- ours → cryptsetup ------------------------------------------------

fn our_cases() -> Vec<(&'static str, FormatOptions)> {
    let l1 = FormatOptions::fast_for_tests(LuksVersion::Luks1);
    let l2 = FormatOptions::fast_for_tests(LuksVersion::Luks2);
    vec![
        ("luks1-sha256-512", l1.clone()),
        (
            "luks1-sha1-256",
            FormatOptions {
                key_bytes: 32,
                pbkdf: Pbkdf::Pbkdf2 {
                    hash: Hash::Sha1,
                    iterations: 1000,
                },
                ..l1
            },
        ),
        (
            "luks2-pbkdf2-sha256",
            FormatOptions {
                pbkdf: Pbkdf::Pbkdf2 {
                    hash: Hash::Sha256,
                    iterations: 1000,
                },
                label: Some("iopages test".to_string()),
                ..l2.clone()
            },
        ),
        ("luks2-argon2id-512", l2.clone()),
        (
            "luks2-argon2i-4096",
            FormatOptions {
                key_bytes: 32,
                sector_size: 4096,
                pbkdf: Pbkdf::Argon2i {
                    time: 4,
                    memory_kib: 32,
                    parallel: 4,
                },
                ..l2.clone()
            },
        ),
        (
            "luks2-argon2id-4096",
            FormatOptions {
                sector_size: 4096,
                ..l2.clone()
            },
        ),
        (
            "luks2-pbkdf2-sha1-4096",
            FormatOptions {
                sector_size: 4096,
                pbkdf: Pbkdf::Pbkdf2 {
                    hash: Hash::Sha1,
                    iterations: 1000,
                },
                ..l2
            },
        ),
    ]
}

#[test]
fn our_volumes_pass_cryptsetup() {
    let Some(cs) = need("cryptsetup", "our_volumes_pass_cryptsetup") else {
        return;
    };
    let dir = Dir::new("luks", "ours");
    let pass = dir.file("pass", PASS);
    let pass2 = dir.file("pass2", PASS2);
    let wrong = dir.file("wrong", WRONG);
    for (name, opts) in our_cases() {
        let img = dir.path(&format!("{name}.img"));
        let size = if opts.version == LuksVersion::Luks1 {
            4 << 20
        } else {
            20 << 20
        };
        let vol = luks::format_path(&img, Some(size), PASS, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(vol.version(), opts.version);
        assert_eq!(vol.sector_size(), opts.sector_size);
        dump_shows_our_volume(&cs, &img, name, &opts, &vol);
        cryptsetup_checks_our_passphrase(&cs, &img, name, &pass, &wrong);
        assert_eq!(dumped_key(&cs, &img, &pass), vol.master_key(), "{name}");
        // And it opens here too.
        let again = luks::open_path(&img, PASS).unwrap();
        assert_eq!(again.master_key(), vol.master_key());
        assert_eq!(again.label(), opts.label.as_deref());
        cryptsetup_adds_a_keyslot_we_open(&cs, &img, name, (&pass, &pass2), &vol);
    }
}

/// `luksDump` of our volume `img` shows its label, uuid, data offset and,
/// for LUKS2, its sector size and KDF.
fn dump_shows_our_volume(
    cs: &Path,
    img: &Path,
    name: &str,
    opts: &FormatOptions,
    vol: &LuksVolume,
) {
    let dump = run_ok(Command::new(cs).arg("luksDump").arg(img));
    if let Some(label) = &opts.label {
        assert!(
            dump.contains(label.as_str()),
            "{name}: label missing from\n{dump}"
        );
    }
    assert!(
        dump.contains(&vol.uuid().to_string()),
        "{name}: uuid missing from\n{dump}"
    );
    assert_eq!(
        dumped_data_offset(cs, img),
        vol.data_offset_bytes(),
        "{name}"
    );
    if opts.version == LuksVersion::Luks2 {
        assert!(
            dump.contains(&format!("sector: {} [bytes]", opts.sector_size)),
            "{name}: sector size missing from\n{dump}"
        );
        assert!(
            dump.contains(opts.pbkdf.name()),
            "{name}: kdf missing from\n{dump}"
        );
    }
}

/// `cryptsetup open --test-passphrase` accepts our volume's passphrase
/// (in the file `pass`) and refuses a wrong one (in `wrong`).
fn cryptsetup_checks_our_passphrase(cs: &Path, img: &Path, name: &str, pass: &Path, wrong: &Path) {
    let ok = run(Command::new(cs)
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass)
        .arg(img));
    assert!(
        ok.status.success(),
        "{name}: cryptsetup open --test-passphrase failed: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad = run(Command::new(cs)
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(wrong)
        .arg(img));
    assert!(
        !bad.status.success(),
        "{name}: cryptsetup accepted a wrong passphrase"
    );
}

/// cryptsetup can add a keyslot to our header (rewriting it), and the
/// result still opens here with either passphrase (`pass`, `pass2`: the
/// files holding them).
fn cryptsetup_adds_a_keyslot_we_open(
    cs: &Path,
    img: &Path,
    name: &str,
    (pass, pass2): (&Path, &Path),
    vol: &LuksVolume,
) {
    run_ok(
        Command::new(cs)
            .args(["luksAddKey", "-q", "--key-file"])
            .arg(pass)
            .args(PBKDF2_1000)
            .arg(img)
            .arg(pass2),
    );
    let second = luks::open_path(img, PASS2).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(second.keyslot(), 1, "{name}");
    assert_eq!(second.master_key(), vol.master_key());
    assert_eq!(luks::open_path(img, PASS).unwrap().keyslot(), 0);
}

// ---- data layout against nbdkit's luks filter (LUKS1) -----------------

/// Sectors of the payload written in plaintext `pattern(s)` and encrypted
/// with `vol.xts_cipher()` at `data_offset_bytes`: reading them back
/// through nbdkit's luks filter gives the plaintext.
fn check_with_nbdkit(nbdkit: &Path, img: &Path, pass_file: &Path, vol: &LuksVolume, dir: &Dir) {
    let pattern = |s: u64| -> Vec<u8> {
        (0..512u64)
            .map(|i| (s.wrapping_mul(131).wrapping_add(i * 7) % 251) as u8)
            .collect()
    };
    let sectors: Vec<u64> = [0u64, 1, 2, 7, 255, 256, 257, 1000, 4095].into();
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    let mut xts = vol.xts_cipher().unwrap();
    for &s in &sectors {
        let mut buf = pattern(s);
        xts.encrypt_sectors_in_place(s, &mut buf).unwrap();
        f.write_all_at(&buf, vol.data_offset_bytes() + s * 512)
            .unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let out = dir.path("plain.out");
    let status = run(Command::new(nbdkit)
        .args(["-U", "-", "--filter=luks", "file"])
        .arg(img)
        .arg(format!("passphrase=+{}", pass_file.display()))
        .arg("--run")
        .arg(format!("nbdcopy \"$uri\" {}", out.display())));
    assert!(
        status.status.success(),
        "nbdkit/nbdcopy failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let plain = std::fs::read(&out).unwrap();
    assert_eq!(
        plain.len() as u64,
        vol.data_size_bytes(std::fs::metadata(img).unwrap().len())
    );
    for &s in &sectors {
        let at = (s * 512) as usize;
        assert_eq!(&plain[at..at + 512], &pattern(s)[..], "sector {s}");
    }
}

#[test]
fn our_ciphertext_reads_back_through_nbdkit_luks_filter() {
    let Some(cs) = need("cryptsetup", "nbdkit_luks_filter") else {
        return;
    };
    let Some(nbdkit) = need("nbdkit", "nbdkit_luks_filter") else {
        return;
    };
    if need("nbdcopy", "nbdkit_luks_filter").is_none() {
        return;
    }
    let dir = Dir::new("luks", "nbdkit");
    let pass = dir.file("pass", PASS);
    // A volume cryptsetup made...
    let img = cryptsetup_format(&cs, &dir, &CASES[0], &pass);
    let vol = luks::open_path(&img, PASS).unwrap();
    check_with_nbdkit(&nbdkit, &img, &pass, &vol, &dir);
    // ...and one made here (header and data both read by nbdkit).
    for (key_bytes, hash) in [(64, Hash::Sha256), (32, Hash::Sha1)] {
        let img = dir.path(&format!("ours-{key_bytes}.img"));
        let opts = FormatOptions {
            key_bytes,
            pbkdf: Pbkdf::Pbkdf2 {
                hash,
                iterations: 1000,
            },
            ..FormatOptions::fast_for_tests(LuksVersion::Luks1)
        };
        let vol = luks::format_path(&img, Some(4 << 20), PASS, &opts).unwrap();
        check_with_nbdkit(&nbdkit, &img, &pass, &vol, &dir);
    }
}

// ---- corruption and truncation (no outside tools) ---------------------

fn bytes_of(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

fn with_bytes(dir: &Dir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn flipped(orig: &[u8], at: usize) -> Vec<u8> {
    let mut b = orig.to_vec();
    b[at] ^= 0x5a;
    b
}

#[test]
fn luks1_corruption_and_truncation_name_what_is_wrong() {
    let dir = Dir::new("luks", "corrupt1");
    let img = dir.path("v.img");
    let vol = luks::format_path(
        &img,
        Some(4 << 20),
        PASS,
        &FormatOptions::fast_for_tests(LuksVersion::Luks1),
    )
    .unwrap();
    assert_eq!(vol.data_offset_bytes(), 2 << 20);
    let orig = bytes_of(&img);
    luks1_damaged_fields_are_named(&dir, &orig);
    luks1_truncation_is_named(&dir, &orig);

    // io::Error conversion keeps the meaning.
    let e: std::io::Error = LuksError::WrongPassphrase.into();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
    let e: std::io::Error = LuksError::Corrupt("x".into()).into();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
}

/// The error of opening `bytes` (written to `name` in `dir`) with [`PASS`].
fn check_in(dir: &Dir, name: &str, bytes: Vec<u8>) -> LuksError {
    open_err(&with_bytes(dir, name, &bytes), PASS)
}

/// A LUKS1 volume (`orig`) with one header field or key material damaged:
/// each refusal names what is wrong.
fn luks1_damaged_fields_are_named(dir: &Dir, orig: &[u8]) {
    let check = |name: &str, bytes: Vec<u8>| check_in(dir, name, bytes);
    let e = check("magic", flipped(orig, 0));
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("magic")),
        "{e}"
    );
    let e = check("version", flipped(orig, 7));
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("magic") || m.contains("version")),
        "{e}"
    );
    let mut b = orig.to_vec();
    b[8..8 + 7].copy_from_slice(b"twofish");
    let e = check("cipher", b);
    assert!(
        matches!(&e, LuksError::UnsupportedCipher(m) if m.contains("twofish")),
        "{e}"
    );
    let mut b = orig.to_vec();
    b[72..72 + 6].copy_from_slice(b"sha384");
    assert!(matches!(check("hash", b), LuksError::UnsupportedKdf(_)));
    // mk-digest (offset 112): the right passphrase no longer checks.
    assert!(matches!(
        check("digest", flipped(orig, 112)),
        LuksError::WrongPassphrase
    ));
    // Key material of slot 0 (sector 8).
    assert!(matches!(
        check("material", flipped(orig, 4096 + 1000)),
        LuksError::WrongPassphrase
    ));
    // Slot 0's state word.
    let e = check("state", flipped(orig, 208));
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("keyslot 0")),
        "{e}"
    );
    // Key size 48 bytes.
    let mut b = orig.to_vec();
    b[108..112].copy_from_slice(&48u32.to_be_bytes());
    assert!(matches!(
        check("keysize", b),
        LuksError::UnsupportedCipher(_)
    ));
    // Every slot disabled.
    let mut b = orig.to_vec();
    b[208..212].copy_from_slice(&0xDEADu32.to_be_bytes());
    assert!(matches!(check("noslot", b), LuksError::NoKeyslot));
}

/// A LUKS1 volume (`orig`) cut short anywhere before the end of its last
/// key-material area: refused as truncated, with the bytes it has.
fn luks1_truncation_is_named(dir: &Dir, orig: &[u8]) {
    let check = |name: &str, bytes: Vec<u8>| check_in(dir, name, bytes);
    let area_end = 4096 + 256_000;
    for len in [0usize, 5, 100, 591, 592, 4096, 100_000, area_end - 1] {
        let e = check(&format!("trunc{len}"), orig[..len].to_vec());
        match e {
            LuksError::Truncated { needed, have } => {
                assert_eq!(have, len as u64, "{len}");
                assert!(needed > have, "{len}: {needed}");
            }
            other => panic!("truncated at {len}: {other}"),
        }
    }
    // The header and key slot 0's material are whole, but a LUKS1 device
    // must hold all eight key-material areas (as cryptsetup requires; a
    // header-only image may end at the last one).
    match check("short", orig[..area_end].to_vec()) {
        LuksError::Truncated { needed, have } => {
            assert_eq!(have, area_end as u64);
            assert_eq!(needed, (8 + 7 * 504 + 500) * 512);
        }
        other => panic!("short: {other}"),
    }
}

/// Rewrite both LUKS2 header copies with edited JSON and fresh checksums.
fn rewrite_luks2_json(b: &mut [u8], edit: impl Fn(&mut serde_json::Value)) {
    for off in [0usize, 16384] {
        let area = &mut b[off..off + 16384];
        let end = area[4096..].iter().position(|&c| c == 0).unwrap();
        let mut j: serde_json::Value = serde_json::from_slice(&area[4096..4096 + end]).unwrap();
        edit(&mut j);
        let text = serde_json::to_vec(&j).unwrap();
        area[4096..].fill(0);
        area[4096..4096 + text.len()].copy_from_slice(&text);
        area[448..512].fill(0);
        let sum = openssl::sha::sha256(area);
        area[448..480].copy_from_slice(&sum);
    }
}

#[test]
fn luks2_corruption_falls_back_to_the_secondary_header_and_names_what_is_wrong() {
    let dir = Dir::new("luks", "corrupt2");
    let img = dir.path("v.img");
    let vol = luks::format_path(
        &img,
        Some((16 << 20) + 4096),
        PASS,
        &FormatOptions::fast_for_tests(LuksVersion::Luks2),
    )
    .unwrap();
    let orig = bytes_of(&img);
    luks2_damaged_copies_fall_back_or_are_named(&dir, &orig, &vol);
    luks2_bad_metadata_is_named(&dir, &orig);
    luks2_truncation_is_named(&dir, &orig);
}

/// A LUKS2 volume (`orig`, formatted as `vol`): intact it opens from the
/// primary; a damaged primary falls back to the secondary; both copies
/// damaged name both reasons; damaged key material is a wrong passphrase.
fn luks2_damaged_copies_fall_back_or_are_named(dir: &Dir, orig: &[u8], vol: &LuksVolume) {
    let open_ok = |name: &str, bytes: &[u8]| -> LuksVolume {
        luks::open_path(with_bytes(dir, name, bytes), PASS)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let check = |name: &str, bytes: Vec<u8>| check_in(dir, name, bytes);
    let v = open_ok("intact", orig);
    assert!(!v.used_secondary_header());
    assert_eq!(v.master_key(), vol.master_key());

    // Primary damaged anywhere: magic, checksum field, JSON, binary fields.
    for (what, at) in [
        ("magic", 1usize),
        ("csum", 450),
        ("json", 4100),
        ("uuid", 170),
        ("hdrsize", 14),
    ] {
        let v = open_ok(what, &flipped(orig, at));
        assert!(v.used_secondary_header(), "{what}");
        assert_eq!(v.master_key(), vol.master_key(), "{what}");
        assert_eq!(v.uuid(), vol.uuid());
    }
    // Both copies damaged: both reasons are named.
    let mut b = flipped(orig, 4100);
    b[16384 + 4100] ^= 1;
    let e = check("both", b);
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("primary") && m.contains("secondary") && m.contains("checksum")),
        "{e}"
    );
    let mut b = flipped(orig, 0);
    b[16384] ^= 1;
    let e = check("bothmagic", b);
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("magic")),
        "{e}"
    );

    // Keyslot area: the passphrase no longer unlocks.
    assert!(matches!(
        check("area", flipped(orig, 32768 + 5000)),
        LuksError::WrongPassphrase
    ));
}

/// A LUKS2 volume (`orig`) whose metadata is bad under valid checksums:
/// each refusal names what is wrong.
fn luks2_bad_metadata_is_named(dir: &Dir, orig: &[u8]) {
    let check = |name: &str, bytes: Vec<u8>| check_in(dir, name, bytes);
    // Valid checksums over bad metadata.
    let edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> LuksError {
        let mut b = orig.to_vec();
        rewrite_luks2_json(&mut b, edit);
        check(name, b)
    };
    let e = edited("digest", &|j| {
        let d = j["digests"]["0"]["digest"].as_str().unwrap().to_string();
        let mut bytes: Vec<u8> = d.into_bytes();
        bytes[0] = if bytes[0] == b'A' { b'B' } else { b'A' };
        j["digests"]["0"]["digest"] = String::from_utf8(bytes).unwrap().into();
    });
    assert!(matches!(e, LuksError::WrongPassphrase), "{e}");
    let e = edited("kdf", &|j| {
        j["keyslots"]["0"]["kdf"]["type"] = "scrypt".into()
    });
    assert!(
        matches!(&e, LuksError::UnsupportedKdf(m) if m.contains("scrypt")),
        "{e}"
    );
    let e = edited("cipher", &|j| {
        j["segments"]["0"]["encryption"] = "aes-cbc-essiv:sha256".into()
    });
    assert!(
        matches!(&e, LuksError::UnsupportedCipher(m) if m.contains("aes-cbc")),
        "{e}"
    );
    let e = edited("areaoff", &|j| {
        j["keyslots"]["0"]["area"]["offset"] = "1024".into()
    });
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("area.offset")),
        "{e}"
    );
    let e = edited("offtype", &|j| {
        j["segments"]["0"]["offset"] = 16777216.into()
    });
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("segments.0.offset") && m.contains("not a string")),
        "{e}"
    );
    let e = edited("nosegs", &|j| j["segments"] = serde_json::json!({}));
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("segments")),
        "{e}"
    );
    let e = edited("jsonsize", &|j| j["config"]["json_size"] = "4096".into());
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("json_size")),
        "{e}"
    );

    // JSON that does not parse, under a valid checksum.
    let mut b = orig.to_vec();
    for off in [0usize, 16384] {
        let area = &mut b[off..off + 16384];
        area[4096..4096 + 3].copy_from_slice(b"{x:");
        area[448..512].fill(0);
        let sum = openssl::sha::sha256(area);
        area[448..480].copy_from_slice(&sum);
    }
    let e = check("badjson", b);
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("bad JSON")),
        "{e}"
    );
}

/// A LUKS2 volume (`orig`) cut short before the primary, the keyslot
/// area, the keyslots area or the data are whole: refused as truncated.
fn luks2_truncation_is_named(dir: &Dir, orig: &[u8]) {
    let check = |name: &str, bytes: Vec<u8>| check_in(dir, name, bytes);
    // Truncation: before the primary is whole, before the keyslot area is.
    for len in [
        0usize,
        7,
        100,
        4096,
        10_000,
        16_384,
        20_000,
        32_768 + 100,
        32_768 + 255_999,
    ] {
        match check(&format!("trunc{len}"), orig[..len].to_vec()) {
            LuksError::Truncated { have, .. } => assert_eq!(have, len as u64, "{len}"),
            other => panic!("truncated at {len}: {other}"),
        }
    }
    // Key slot 0's area is whole but the keyslots area and the data are
    // not: refused (cryptsetup: the device must hold both header copies,
    // the keyslots area and a data sector).
    match check("short", orig[..32_768 + 256_000].to_vec()) {
        LuksError::Truncated { needed, have } => {
            assert_eq!(have, (32_768 + 256_000) as u64);
            assert!(needed >= 16 << 20, "{needed}");
        }
        other => panic!("short: {other}"),
    }
}

#[test]
fn formatting_refuses_what_cryptsetup_would() {
    let dir = Dir::new("luks", "opts");
    let img = dir.path("v.img");
    let l1 = FormatOptions::fast_for_tests(LuksVersion::Luks1);
    let l2 = FormatOptions::fast_for_tests(LuksVersion::Luks2);
    for opts in bad_format_options(&l1, &l2) {
        match luks::format_path(&img, Some(20 << 20), PASS, &opts) {
            Err(LuksError::InvalidOptions(_)) => {}
            other => panic!("{opts:?}: {other:?}"),
        }
    }
    // Too small, or a payload that is not whole 4096-byte sectors.
    for (size, opts) in [
        ((2 << 20) + 100, l1.clone()),
        (16 << 20, l2.clone()),
        (
            (16 << 20) + 512,
            FormatOptions {
                sector_size: 4096,
                ..l2.clone()
            },
        ),
    ] {
        match luks::format_path(&img, Some(size), PASS, &opts) {
            Err(LuksError::InvalidOptions(m)) => assert!(m.contains("bytes"), "{m}"),
            other => panic!("{size}: {other:?}"),
        }
    }
    // Defaults are what the docs promise.
    let d = FormatOptions::default();
    assert_eq!(
        (d.version, d.key_bytes, d.sector_size),
        (LuksVersion::Luks2, 64, 512)
    );
    assert!(matches!(
        d.pbkdf,
        Pbkdf::Argon2id {
            memory_kib: 65536,
            ..
        }
    ));
}

/// Options cryptsetup refuses, from the fast LUKS1 (`l1`) and LUKS2
/// (`l2`) ones: LUKS1 with 4096-byte sectors, Argon2 or a label; LUKS2
/// with a 48-byte key, 1024-byte sectors, a 48-byte label or 10 PBKDF2
/// iterations.
fn bad_format_options(l1: &FormatOptions, l2: &FormatOptions) -> [FormatOptions; 7] {
    [
        FormatOptions {
            sector_size: 4096,
            ..l1.clone()
        },
        FormatOptions {
            pbkdf: l2.pbkdf,
            ..l1.clone()
        },
        FormatOptions {
            label: Some("x".into()),
            ..l1.clone()
        },
        FormatOptions {
            key_bytes: 48,
            ..l2.clone()
        },
        FormatOptions {
            sector_size: 1024,
            ..l2.clone()
        },
        FormatOptions {
            label: Some("x".repeat(48)),
            ..l2.clone()
        },
        FormatOptions {
            pbkdf: Pbkdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 10,
            },
            ..l2.clone()
        },
    ]
}

#[test]
fn is_luks_and_inspect_need_no_passphrase() {
    let dir = Dir::new("luks", "inspect");
    let img = dir.path("v.img");
    let opts = FormatOptions {
        label: Some("data".into()),
        sector_size: 4096,
        ..FormatOptions::fast_for_tests(LuksVersion::Luks2)
    };
    let vol = luks::format_path(&img, Some(17 << 20), PASS, &opts).unwrap();
    let f = File::open(&img).unwrap();
    assert!(luks::is_luks(&f));
    let info = luks::inspect(&f).unwrap();
    assert_eq!(info.uuid, vol.uuid());
    assert_eq!(info.label.as_deref(), Some("data"));
    assert_eq!(info.sector_size, 4096);
    assert_eq!(info.key_bytes, 64);
    assert_eq!(info.data_offset_bytes, 16 << 20);
    assert_eq!(info.keyslots.len(), 1);
    assert_eq!(info.keyslots[0].pbkdf, Some(opts.pbkdf));
    // A shared &File opens while another reader holds it.
    let v = luks::open(&f, PASS).unwrap();
    assert_eq!(v.master_key(), vol.master_key());
    assert_eq!(v.data_size_bytes(17 << 20), 1 << 20);
    assert!(v.master_key_info().is_locked() || v.master_key_info().lock_error().is_some());
    let plain = dir.file("plain", &[0u8; 8192]);
    assert!(!luks::is_luks(&File::open(plain).unwrap()));
    assert!(!luks::is_luks(&File::open(dir.file("empty", b"")).unwrap()));
}

// ---- never panic --------------------------------------------------------

mod never_panic {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// The metadata and keyslot area of a fresh volume (what open reads).
    fn template(version: LuksVersion) -> &'static [u8] {
        static L1: OnceLock<Vec<u8>> = OnceLock::new();
        static L2: OnceLock<Vec<u8>> = OnceLock::new();
        let cell = if version == LuksVersion::Luks1 {
            &L1
        } else {
            &L2
        };
        cell.get_or_init(|| {
            let dir = Dir::new("luks", &format!("tmpl-{version}"));
            let img = dir.path("t.img");
            luks::format_path(
                &img,
                Some(device_len(version)),
                PASS,
                &FormatOptions::fast_for_tests(version),
            )
            .unwrap();
            let keep = if version == LuksVersion::Luks1 {
                4096 + 256_000
            } else {
                32_768 + 258_048
            };
            bytes_of(&img)[..keep].to_vec()
        })
    }

    /// LUKS1 fields whose mutation only makes a KDF slow (iteration
    /// counts): left alone when `open` runs, mutated for `inspect`.
    fn is_luks1_iteration_field(at: usize) -> bool {
        (164..168).contains(&at)
            || (208..592).contains(&at) && (at - 208) % 48 >= 4 && (at - 208) % 48 < 8
    }

    /// The template's whole device size: the template keeps only the
    /// headers and key slot 0's material; the rest of the device (other
    /// key-material areas, the payload) reads as zeros (a sparse tail).
    fn device_len(version: LuksVersion) -> u64 {
        if version == LuksVersion::Luks1 {
            (2 << 20) + 512
        } else {
            (16 << 20) + 512
        }
    }

    /// Run one case: `bytes`, then (unless it was cut) zeros up to the
    /// template's device size, so the size checks pass and the mutated
    /// fields are what is tested.
    fn run_case(name: &str, bytes: &[u8], full_len: Option<u64>, run_open: bool) {
        let dir = Dir::new("luks", name);
        let p = with_bytes(&dir, "m.img", bytes);
        if let Some(len) = full_len {
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            f.set_len(len.max(bytes.len() as u64)).unwrap();
        }
        let f = File::open(&p).unwrap();
        let _ = luks::is_luks(&f);
        let _ = luks::inspect(&f);
        if run_open {
            let _ = luks::open(&f, PASS);
            let _ = luks::open(&f, WRONG);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

        #[test]
        fn random_bytes_are_errors(bytes in proptest::collection::vec(any::<u8>(), 0..70_000)) {
            let dir = Dir::new("luks", "rand");
            let p = with_bytes(&dir, "r.img", &bytes);
            prop_assert!(luks::open_path(&p, PASS).is_err());
        }

        #[test]
        fn random_bytes_after_a_magic_are_errors(
            version in 1u16..=2,
            rest in proptest::collection::vec(any::<u8>(), 0..40_000),
        ) {
            let mut bytes = b"LUKS\xba\xbe".to_vec();
            bytes.extend_from_slice(&version.to_be_bytes());
            bytes.extend_from_slice(&rest);
            let dir = Dir::new("luks", "magic");
            let p = with_bytes(&dir, "r.img", &bytes);
            prop_assert!(luks::open_path(&p, PASS).is_err());
        }

        #[test]
        fn mutated_luks2_headers_never_panic(
            muts in proptest::collection::vec((0usize..32_768 + 4096, any::<u8>()), 1..8),
            cut in proptest::option::of(0usize..32_768 + 258_048),
        ) {
            let mut b = template(LuksVersion::Luks2).to_vec();
            for (at, v) in muts { b[at] = v; }
            let full = match cut {
                Some(c) => { b.truncate(c); None }
                None => Some(device_len(LuksVersion::Luks2)),
            };
            run_case("mut2", &b, full, true);
        }

        #[test]
        fn mutated_luks1_headers_never_panic(
            muts in proptest::collection::vec((0usize..4096 + 512, any::<u8>()), 1..8),
            cut in proptest::option::of(0usize..4096 + 256_000),
        ) {
            let mut b = template(LuksVersion::Luks1).to_vec();
            let mut slow = false;
            for (at, v) in muts {
                slow |= is_luks1_iteration_field(at) && b[at] != v;
                b[at] = v;
            }
            let full = match cut {
                Some(c) => { b.truncate(c); None }
                None => Some(device_len(LuksVersion::Luks1)),
            };
            run_case("mut1", &b, full, !slow);
        }
    }
}

/// A header kept on a backend (a remote export, here a RAM disk holding
/// the image's bytes) opens as the file does: same key, slot and payload
/// offset; a wrong passphrase and a truncated copy fail as they do on a
/// file, and nothing on the backend is written.
#[test]
fn a_header_on_a_backend_opens_as_the_file_does() {
    use iopages_crypt::backend::{Backend, RamDisk};
    let dir = Dir::new("luks", "backend");
    for version in [LuksVersion::Luks1, LuksVersion::Luks2] {
        let img = dir.path(&format!("{version:?}.img"));
        let opts = FormatOptions::fast_for_tests(version);
        let made = luks::format_path(&img, Some(20 << 20), PASS, &opts).unwrap();
        let bytes = bytes_of(&img);
        let disk = RamDisk::new(bytes.len() as u64).unwrap();
        disk.write_at(0, &[&bytes]).unwrap();
        let limits = luks::KdfLimits::default();
        let open = luks::LuksOpenOptions::new();
        let vol = luks::open_backend(&disk, PASS, &limits, &open).unwrap();
        assert_eq!(vol.master_key(), made.master_key(), "{version:?}");
        assert_eq!(vol.data_offset_bytes(), made.data_offset_bytes());
        assert_eq!(vol.keyslot(), made.keyslot());
        assert!(matches!(
            luks::open_backend(&disk, WRONG, &limits, &open),
            Err(LuksError::WrongPassphrase)
        ));
        let mut back = vec![0u8; bytes.len()];
        disk.read_at(0, &mut [&mut back]).unwrap();
        assert!(back == bytes, "opening wrote nothing");
        // Cut inside the header's key material: truncated, as a file.
        let short = RamDisk::new(16 << 10).unwrap();
        short.write_at(0, &[&bytes[..16 << 10]]).unwrap();
        assert!(matches!(
            luks::open_backend(&short, PASS, &limits, &open),
            Err(LuksError::Truncated { .. } | LuksError::Corrupt(_))
        ));
    }
}
