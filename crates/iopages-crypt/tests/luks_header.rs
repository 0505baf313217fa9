//! The header verbs of the library against cryptsetup 2.x: `luks::dump`
//! shows every field `cryptsetup luksDump` shows with the same values
//! (field for field), its JSON is the JSON area's; `backup_header` writes
//! what `cryptsetup luksHeaderBackup` writes, byte for byte; a restore
//! refuses what does not fit (not LUKS, another layout, another volume)
//! without writing; a header-only image is inspected, dumped and opened,
//! and has no payload to serve.
//!
//! cryptsetup is an outside tool: where it is missing the test says so
//! and returns, except under `CI=true`.

mod common;

use common::{cryptsetup_fast, need, Dir};
use iopages_crypt::luks::{self, LuksError, LuksVersion, RestoreOptions};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::process::Command;

const PASS: &[u8] = b"header verbs passphrase";

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("cryptsetup runs");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A 20 MiB image formatted by cryptsetup with `args`, under `PASS`.
fn made(dir: &Dir, cs: &Path, name: &str, args: &[&str]) -> std::path::PathBuf {
    let img = dir.path(name);
    File::create(&img).unwrap().set_len(20 << 20).unwrap();
    let key = dir.file("key", PASS);
    run(cryptsetup_fast(cs, &[&["luksFormat"][..], args].concat())
        .arg(&key)
        .arg(&img));
    img
}

/// A `luksDump` report as `section/item/field → value` (hex continued on
/// later lines joined, white space collapsed): the same map for
/// cryptsetup's report and ours when they show the same fields.
fn fields(text: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let (mut section, mut item, mut last) = (String::new(), String::new(), String::new());
    for l in text.lines() {
        let words = l.split_whitespace().collect::<Vec<_>>().join(" ");
        if words.is_empty() {
            continue;
        }
        let Some((name, value)) = words.split_once(':') else {
            if l.starts_with(char::is_whitespace) && !last.is_empty() {
                let v: &mut String = map.get_mut(&last).unwrap();
                v.push(' ');
                v.push_str(&words);
            }
            continue;
        };
        let (name, value) = (name.trim().to_string(), value.trim().to_string());
        let key = if l.starts_with('\t') && item.is_empty() {
            format!("{section}/{name}")
        } else if l.starts_with('\t') {
            format!("{section}/{item}/{name}")
        } else if l.starts_with("  ") {
            item = name.clone();
            format!("{section}/{name}")
        } else if value.is_empty() {
            section = name.clone();
            name
        } else {
            section = name.clone();
            item.clear();
            name
        };
        map.insert(key.clone(), value);
        last = key;
    }
    map
}

fn cs_dump(cs: &Path, img: &Path) -> String {
    run(Command::new(cs).arg("luksDump").arg(img))
}

fn our_dump(img: &Path) -> luks::LuksDump {
    luks::dump(&File::open(img).unwrap()).unwrap()
}

#[test]
fn luks1_dump_shows_every_field_luksdump_shows() {
    let Some(cs) = need("cryptsetup", "luks1_dump") else {
        return;
    };
    let dir = Dir::new("luks-header", "dump1");
    let img = made(&dir, &cs, "l1.img", &["--type", "luks1"]);
    let key = dir.path("key");
    let key2 = dir.file("key2", b"second");
    run(cryptsetup_fast(&cs, &["luksAddKey", "--key-slot", "5"])
        .arg(&key)
        .arg(&img)
        .arg(&key2));
    let ours = fields(&our_dump(&img).to_string());
    let theirs = fields(&cs_dump(&cs, &img));
    assert_eq!(ours, theirs, "ours:\n{}", our_dump(&img));
    assert_eq!(ours["Key Slot 5"], "ENABLED");
    assert_eq!(ours["Key Slot 1"], "DISABLED");
    assert_eq!(ours["Key Slot 5/Iterations"], "1000");
    assert_eq!(our_dump(&img).version(), LuksVersion::Luks1);
    assert!(our_dump(&img).json_text().is_none(), "LUKS1 has no JSON");
}

#[test]
fn luks2_dump_shows_every_field_luksdump_shows() {
    let Some(cs) = need("cryptsetup", "luks2_dump") else {
        return;
    };
    let dir = Dir::new("luks-header", "dump2");
    let args = [
        "--type",
        "luks2",
        "--label",
        "lab\u{1b}el",
        "--subsystem",
        "sub",
    ];
    let img = made(&dir, &cs, "l2.img", &args);
    let key = dir.path("key");
    let key2 = dir.file("key2", b"second");
    let mut add = Command::new(&cs);
    add.args(["luksAddKey", "--batch-mode", "--pbkdf", "argon2id"])
        .args(["--pbkdf-memory", "32", "--pbkdf-force-iterations", "4"])
        .args(["--pbkdf-parallel", "1", "--key-slot", "3", "--key-file"])
        .arg(&key)
        .arg(&img)
        .arg(&key2);
    run(&mut add);
    let token = r#"{"type":"iopages-test","keyslots":["3"],"x":1}"#;
    let mut import = Command::new(&cs);
    import.args(["token", "import", "--json-file"]);
    std::fs::write(dir.path("token.json"), token).unwrap();
    run(import.arg(dir.path("token.json")).arg(&img));
    let d = our_dump(&img);
    let ours = fields(&d.to_string());
    let mut theirs = fields(&cs_dump(&cs, &img));
    // cryptsetup prints the label's escape byte raw; we escape it.
    assert_eq!(
        theirs.insert("Label".into(), "lab\\u{1b}el".into()),
        Some("lab\u{1b}el".into())
    );
    assert_eq!(ours, theirs, "ours:\n{d}");
    assert_eq!(ours["Keyslots/3/PBKDF"], "argon2id");
    assert_eq!(ours["Keyslots/3/Memory"], "32");
    assert_eq!(ours["Keyslots/0/Iterations"], "1000");
    assert_eq!(ours["Tokens/0"], "iopages-test");
    assert!(!d.to_string().contains('\u{1b}'), "header strings escaped");
    // --dump-json-metadata and our stored text are one JSON value.
    let cs_json = run(Command::new(&cs)
        .args(["luksDump", "--dump-json-metadata"])
        .arg(&img));
    let a: serde_json::Value = serde_json::from_str(d.json_text().unwrap()).unwrap();
    let b: serde_json::Value = serde_json::from_str(&cs_json).unwrap();
    assert_eq!(a, b);
}

/// The dump names no secret: neither the volume key nor a byte run of a
/// key slot's (encrypted) area shows up in it.
#[test]
fn a_dump_shows_no_key_material() {
    let dir = Dir::new("luks-header", "secret");
    let img = dir.path("v.img");
    for version in [LuksVersion::Luks1, LuksVersion::Luks2] {
        let opts = luks::FormatOptions::fast_for_tests(version);
        let v = luks::format_path(&img, Some(17 << 20), PASS, &opts).unwrap();
        let text = our_dump(&img).to_string();
        let hex = |b: &[u8]| {
            b.iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let compact = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(!compact.contains(&hex(&v.master_key()[..8])), "{version}");
        let bytes = std::fs::read(&img).unwrap();
        let area_at = if version == LuksVersion::Luks1 {
            4096
        } else {
            32768
        };
        assert!(
            !compact.contains(&hex(&bytes[area_at..area_at + 8])),
            "{version}"
        );
        std::fs::remove_file(&img).unwrap();
    }
}

#[test]
fn backup_is_what_luksheaderbackup_writes_byte_for_byte() {
    let Some(cs) = need("cryptsetup", "backup") else {
        return;
    };
    let dir = Dir::new("luks-header", "backup");
    for (name, ty) in [("b1.img", "luks1"), ("b2.img", "luks2")] {
        let img = made(&dir, &cs, name, &["--type", ty]);
        let theirs = dir.path(&format!("{name}.cs"));
        run(Command::new(&cs)
            .args(["luksHeaderBackup", "--header-backup-file"])
            .arg(&theirs)
            .arg(&img));
        let mut ours = Vec::new();
        let area = luks::backup_header(&File::open(&img).unwrap(), &mut ours).unwrap();
        assert_eq!(area.len_bytes, ours.len() as u64);
        assert!(
            ours == std::fs::read(&theirs).unwrap(),
            "{ty}: backups differ"
        );
        // The backup is a header-only image: inspected, opened, dumped,
        // with no payload.
        let only = dir.file(&format!("{name}.ours"), &ours);
        let info = luks::inspect(&File::open(&only).unwrap()).unwrap();
        assert_eq!(info.uuid, area.uuid);
        let v = luks::open_path(&only, PASS).unwrap();
        assert!(matches!(
            v.payload_bytes(ours.len() as u64),
            Err(LuksError::NoPayload(_))
        ));
        assert_eq!(
            fields(&our_dump(&only).to_string()),
            fields(&our_dump(&img).to_string())
        );
    }
}

/// Restores refused for what does not fit, the image unchanged; one of
/// the same volume and one with `replace_other_volume` go through, and
/// the result opens with the backup's passphrase.
#[test]
fn restore_refuses_what_does_not_fit_and_writes_nothing() {
    let dir = Dir::new("luks-header", "restore");
    let make = |name: &str, version, pass: &[u8]| {
        let p = dir.path(name);
        let opts = luks::FormatOptions::fast_for_tests(version);
        luks::format_path(&p, Some(17 << 20), pass, &opts).unwrap();
        p
    };
    let img = make("img", LuksVersion::Luks2, PASS);
    let other = make("other", LuksVersion::Luks2, b"other");
    let l1 = make("l1", LuksVersion::Luks1, PASS);
    let not_luks = dir.file("junk", &vec![7u8; 1 << 20]);
    let backup = |src: &Path| {
        let mut b = Vec::new();
        luks::backup_header(&File::open(src).unwrap(), &mut b).unwrap();
        dir.file(
            &format!("{}.hdr", src.file_name().unwrap().to_str().unwrap()),
            &b,
        )
    };
    let (other_hdr, l1_hdr) = (backup(&other), backup(&l1));
    let before = std::fs::read(&img).unwrap();
    let rw = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .unwrap()
    };
    let no = RestoreOptions::default();
    let yes = RestoreOptions {
        replace_other_volume: true,
    };
    for (bk, opts, what) in [
        (&not_luks, &yes, "not a valid LUKS header"),
        (&l1_hdr, &yes, "data offset 2097152 differs"),
        (&other_hdr, &no, "another volume"),
    ] {
        let e = luks::restore_header(&rw(), &File::open(bk).unwrap(), opts).unwrap_err();
        assert!(
            matches!(&e, LuksError::RestoreRefused(m) if m.contains(what)),
            "{e}"
        );
        assert!(
            std::fs::read(&img).unwrap() == before,
            "{what}: the image changed"
        );
    }
    let r = luks::restore_header(&rw(), &File::open(&other_hdr).unwrap(), &yes).unwrap();
    assert_eq!(r.written_bytes, 16 << 20);
    assert!(r.replaced_uuid.is_some());
    luks::open_path(&img, b"other").unwrap();
    assert!(matches!(
        luks::open_path(&img, PASS),
        Err(LuksError::WrongPassphrase)
    ));
    // The payload was not touched.
    let after = std::fs::read(&img).unwrap();
    assert!(after[16 << 20..] == before[16 << 20..]);
}

/// An image with no LUKS header is written over only with
/// `replace_other_volume`.
#[test]
fn restore_over_an_image_with_no_luks_header_needs_replace_other_volume() {
    let dir = Dir::new("luks-header", "blank");
    let l1 = dir.path("l1");
    let opts = luks::FormatOptions::fast_for_tests(LuksVersion::Luks1);
    luks::format_path(&l1, Some(3 << 20), PASS, &opts).unwrap();
    let mut b = Vec::new();
    luks::backup_header(&File::open(&l1).unwrap(), &mut b).unwrap();
    let l1_hdr = dir.file("l1.hdr", &b);
    let no = RestoreOptions::default();
    let yes = RestoreOptions {
        replace_other_volume: true,
    };
    let blank = dir.file("blank", &vec![0u8; 17 << 20]);
    let rw_blank = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&blank)
            .unwrap()
    };
    let e = luks::restore_header(&rw_blank(), &File::open(&l1_hdr).unwrap(), &no).unwrap_err();
    assert!(e.to_string().contains("no valid LUKS header"), "{e}");
    assert!(std::fs::read(&blank).unwrap().iter().all(|&b| b == 0));
    luks::restore_header(&rw_blank(), &File::open(&l1_hdr).unwrap(), &yes).unwrap();
    assert_eq!(
        luks::open_path(&blank, PASS).unwrap().version(),
        LuksVersion::Luks1
    );
}
