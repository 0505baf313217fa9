//! Headers that ask too much of the host: KDF costs over [`KdfLimits`],
//! too many keyslots, malformed `config.requirements`, a data segment
//! larger than the device; and [`luks::printable`]. Every case is an
//! error naming the field and the limit, returned before any key
//! derivation runs — never a panic, an allocation of what the header asks
//! for, or a long wait.

use iopages_crypt::luks::{self, FormatOptions, KdfLimits, LuksError, LuksVersion};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PASS: &[u8] = b"correct horse battery staple";

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("luks-limits-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn with_bytes(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh volume's bytes (cheap KDF).
fn fresh(dir: &Dir, version: LuksVersion) -> Vec<u8> {
    let p = dir.0.join(format!("fresh-{version}.img"));
    let size = match version {
        LuksVersion::Luks1 => 4 << 20,
        LuksVersion::Luks2 => (16 << 20) + (1 << 20),
    };
    luks::format_path(
        &p,
        Some(size),
        PASS,
        &FormatOptions::fast_for_tests(version),
    )
    .unwrap();
    std::fs::read(&p).unwrap()
}

/// Rewrite both LUKS2 header copies (16 KiB each) with edited JSON and
/// fresh SHA-256 checksums over the header area.
fn edit_luks2(b: &mut [u8], edit: impl Fn(&mut Value)) {
    for off in [0usize, 16384] {
        let area = &mut b[off..off + 16384];
        let end = area[4096..].iter().position(|&c| c == 0).unwrap();
        let mut j: Value = serde_json::from_slice(&area[4096..4096 + end]).unwrap();
        edit(&mut j);
        let text = serde_json::to_vec(&j).unwrap();
        assert!(text.len() < 12288, "edited JSON too large: {}", text.len());
        area[4096..].fill(0);
        area[4096..4096 + text.len()].copy_from_slice(&text);
        area[448..512].fill(0);
        let sum = openssl::sha::sha256(area);
        area[448..480].copy_from_slice(&sum);
    }
}

/// Open with `limits`, timing it: every refusal here must come before
/// any expensive derivation.
fn open_fast(p: &Path, limits: &KdfLimits) -> Result<luks::LuksVolume, LuksError> {
    let t0 = Instant::now();
    let r = luks::open_path_with(p, PASS, limits);
    if r.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "refusal took {:?}",
            t0.elapsed()
        );
    }
    r
}

fn over_limit(r: Result<luks::LuksVolume, LuksError>) -> String {
    match r {
        Err(e @ LuksError::OverLimit(_)) => e.to_string(),
        Err(e) => panic!("expected OverLimit, got {e:?}"),
        Ok(_) => panic!("expected OverLimit, it opened"),
    }
}

#[test]
fn luks1_slot_with_u32_max_iterations_is_an_error_naming_the_field_not_a_panic() {
    let dir = Dir::new("l1iter");
    let orig = fresh(&dir, LuksVersion::Luks1);
    // Keyslot 0's iteration count (big-endian u32 at 208 + 4).
    let mut b = orig.clone();
    b[212..216].copy_from_slice(&u32::MAX.to_be_bytes());
    let p = dir.with_bytes("iter.img", &b);
    let m = over_limit(open_fast(&p, &KdfLimits::default()));
    assert_eq!(
        m,
        "keyslot 0: PBKDF2 iterations 4294967295 (key-slot 0 iterations) is over the limit of \
         50000000 (KdfLimits::max_pbkdf2_iterations): refused before deriving anything (raise \
         the limit if the volume is genuine)"
    );
    // Even with the limit lifted, OpenSSL's int range is an error, not
    // the wrapper's panic.
    let unlimited = KdfLimits {
        max_pbkdf2_iterations: u32::MAX,
        ..KdfLimits::default()
    };
    let e = luks::open_path_with(&p, PASS, &unlimited).unwrap_err();
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("4294967295") && m.contains("2147483647")),
        "{e}"
    );
    // The volume-key digest's count is bounded too.
    let mut b = orig.clone();
    b[164..168].copy_from_slice(&0xFFFF_FFFFu32.to_be_bytes());
    let m = over_limit(open_fast(
        &dir.with_bytes("digest.img", &b),
        &KdfLimits::default(),
    ));
    assert!(
        m.contains("mk-digest-iter") && m.contains("50000000"),
        "{m}"
    );
    // Below the cap it still opens; a lowered cap refuses it.
    let p = dir.with_bytes("ok.img", &orig);
    assert!(luks::open_path(&p, PASS).is_ok());
    let low = KdfLimits {
        max_pbkdf2_iterations: 999,
        ..KdfLimits::default()
    };
    let m = over_limit(open_fast(&p, &low));
    assert!(m.contains("keyslot 0") && m.contains("999"), "{m}");
    // io::Error keeps the meaning.
    let e: std::io::Error = LuksError::OverLimit("x".into()).into();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
}

#[test]
fn argon2_memory_over_the_limit_is_refused_before_allocating() {
    let dir = Dir::new("argmem");
    let mut b = fresh(&dir, LuksVersion::Luks2);
    // 4 GiB: cryptsetup's own maximum, over the 1 GiB default. Were it
    // allocated and filled, this would take seconds and 4 GiB.
    edit_luks2(&mut b, |j| {
        j["keyslots"]["0"]["kdf"]["memory"] = json!(4u64 << 20)
    });
    let p = dir.with_bytes("mem.img", &b);
    let m = over_limit(open_fast(&p, &KdfLimits::default()));
    assert_eq!(
        m,
        "keyslot 0: argon2id memory 4194304 KiB (keyslots.0.kdf.memory) is over the limit of \
         1048576 KiB (KdfLimits::max_argon2_memory_kib): refused before deriving anything \
         (raise the limit if the volume is genuine)"
    );
    // The byte-sized setter (the CLI's --max-kdf-memory).
    let m = over_limit(open_fast(
        &p,
        &KdfLimits::default().with_max_argon2_memory_bytes(16 << 20),
    ));
    assert!(m.contains("16384 KiB"), "{m}");
    let l = KdfLimits::default().with_max_argon2_memory_bytes(u64::MAX);
    assert_eq!(l.max_argon2_memory_kib, 4 << 20);
    assert!(l.max_argon2_work_kib >= 64 * (4 << 20));
}

#[test]
fn argon2_time_lanes_and_work_are_bounded() {
    let dir = Dir::new("argother");
    let orig = fresh(&dir, LuksVersion::Luks2);
    let cases: [(&str, Value, &str, &str); 3] = [
        (
            "time",
            json!(u32::MAX),
            "keyslots.0.kdf.time",
            "max_argon2_time",
        ),
        (
            "cpus",
            json!(1000),
            "keyslots.0.kdf.cpus",
            "max_argon2_lanes",
        ),
        // 1 GiB (allowed) × 100 passes (allowed) is over the work cap.
        (
            "time",
            json!(100),
            "keyslots.0.kdf.time",
            "max_argon2_work_kib",
        ),
    ];
    for (i, (key, value, field, knob)) in cases.into_iter().enumerate() {
        let mut b = orig.clone();
        edit_luks2(&mut b, |j| {
            j["keyslots"]["0"]["kdf"][key] = value.clone();
            if knob == "max_argon2_work_kib" {
                j["keyslots"]["0"]["kdf"]["memory"] = json!(1u64 << 20);
            }
        });
        let p = dir.with_bytes(&format!("c{i}.img"), &b);
        let m = over_limit(open_fast(&p, &KdfLimits::default()));
        assert!(m.contains(field) && m.contains(knob), "{m}");
    }
}

#[test]
fn a_slot_over_the_limits_is_skipped_when_another_opens() {
    let dir = Dir::new("skip");
    let mut b = fresh(&dir, LuksVersion::Luks2);
    // Keyslot 1: a copy of 0 (its key material copied into an area of its
    // own — areas may not overlap — so the same passphrase opens it) with
    // an absurd cost, tried first (priority 2).
    let (from, len, to) = (32_768usize, 258_048usize, 32_768usize + 258_048);
    let material = b[from..from + len].to_vec();
    b[to..to + len].copy_from_slice(&material);
    edit_luks2(&mut b, |j| {
        let mut k = j["keyslots"]["0"].clone();
        k["kdf"]["memory"] = json!(4u64 << 20);
        k["priority"] = json!(2);
        k["area"]["offset"] = json!(to.to_string());
        j["keyslots"]["1"] = k;
        j["digests"]["0"]["keyslots"] = json!(["0", "1"]);
    });
    let p = dir.with_bytes("two.img", &b);
    let v = open_fast(&p, &KdfLimits::default()).unwrap();
    assert_eq!(v.keyslot(), 0);
    // With slot 0 unusable, the limit is reported rather than a wrong
    // passphrase.
    let e = luks::open_path(&p, b"other").unwrap_err();
    assert!(
        matches!(&e, LuksError::OverLimit(m) if m.contains("keyslot 1")),
        "{e}"
    );
}

#[test]
fn more_than_32_luks2_keyslots_are_refused_at_parse_time() {
    let dir = Dir::new("slots");
    let orig = fresh(&dir, LuksVersion::Luks2);
    let with_slots = |n: usize| {
        let mut b = orig.clone();
        // Valid extra slots (copies of 0 in areas of their own, with no key
        // material: they never open); with too many, the count is checked
        // before any is planned.
        edit_luks2(&mut b, |j| {
            let mut ids = vec![json!("0")];
            for i in 1..n {
                let mut k = j["keyslots"]["0"].clone();
                k["area"]["offset"] = json!((32_768 + i * 258_048).to_string());
                j["keyslots"][i.to_string()] = k;
                ids.push(json!(i.to_string()));
            }
            j["digests"]["0"]["keyslots"] = json!(ids);
        });
        b
    };
    let p = dir.with_bytes("33.img", &with_slots(33));
    let m = over_limit(open_fast(&p, &KdfLimits::default()));
    assert!(
        m.starts_with("the LUKS2 header has 33 keyslots, over the limit of 32"),
        "{m}"
    );
    let f = std::fs::File::open(&p).unwrap();
    assert!(matches!(luks::inspect(&f), Err(LuksError::OverLimit(_))));
    // 32 is within cryptsetup's limit: slot 0 opens.
    let p = dir.with_bytes("32.img", &with_slots(32));
    assert_eq!(luks::open_path(&p, PASS).unwrap().keyslot(), 0);
    // A lower limit applies to LUKS1's eight slots too.
    let p1 = dir.with_bytes("l1.img", &fresh(&dir, LuksVersion::Luks1));
    let none = KdfLimits {
        max_keyslots: 0,
        ..KdfLimits::default()
    };
    let m = over_limit(open_fast(&p1, &none));
    assert!(m.contains("LUKS1 header has 1 keyslots"), "{m}");
}

#[test]
fn malformed_requirements_are_refused() {
    let dir = Dir::new("req");
    let orig = fresh(&dir, LuksVersion::Luks2);
    let open_req = |name: &str, req: Value| {
        let mut b = orig.clone();
        edit_luks2(&mut b, |j| j["config"]["requirements"] = req.clone());
        luks::open_path(dir.with_bytes(name, &b), PASS)
    };
    for (name, req, field) in [
        ("arr", json!([]), "config.requirements is not an object"),
        ("str", json!("x"), "config.requirements is not an object"),
        (
            "mstr",
            json!({"mandatory": "online-reencrypt"}),
            "config.requirements.mandatory is not an array",
        ),
        (
            "mnum",
            json!({"mandatory": [1]}),
            "config.requirements.mandatory holds something that is not a string",
        ),
    ] {
        match open_req(name, req) {
            Err(LuksError::Corrupt(m)) => assert!(m.contains(field), "{name}: {m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    match open_req("known", json!({"mandatory": ["online-reencrypt-v2"]})) {
        Err(LuksError::Unsupported(m)) => assert!(m.contains("online-reencrypt-v2"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Empty or optional-only requirements are fine.
    assert!(open_req("empty", json!({"mandatory": []})).is_ok());
    assert!(open_req("opt", json!({"optional": ["x"]})).is_ok());
}

#[test]
fn a_fixed_segment_larger_than_the_device_is_refused() {
    let dir = Dir::new("seg");
    let orig = fresh(&dir, LuksVersion::Luks2);
    let payload = orig.len() as u64 - (16 << 20);
    let with_size = |name: &str, size: u64| {
        let mut b = orig.clone();
        edit_luks2(&mut b, |j| {
            j["segments"]["0"]["size"] = json!(size.to_string())
        });
        dir.with_bytes(name, &b)
    };
    let e = luks::open_path(with_size("big", payload + 512), PASS).unwrap_err();
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains(&format!("size {}", payload + 512))
            && m.contains("runs past the end")),
        "{e}"
    );
    let e = luks::open_path(with_size("huge", u64::MAX - 1000), PASS).unwrap_err();
    assert!(matches!(&e, LuksError::Corrupt(_)), "{e}");
    // Exactly the device, or less, opens.
    let v = luks::open_path(with_size("exact", payload), PASS).unwrap();
    assert_eq!(v.segment_size_bytes(), Some(payload));
    assert_eq!(v.data_size_bytes(orig.len() as u64), payload);
    let v = luks::open_path(with_size("less", 4096), PASS).unwrap();
    assert_eq!(v.data_size_bytes(orig.len() as u64), 4096);
}

#[test]
fn a_set_cancel_flag_stops_the_open() {
    let dir = Dir::new("cancel");
    let p = dir.with_bytes("v.img", &fresh(&dir, LuksVersion::Luks2));
    let flag = Arc::new(AtomicBool::new(true));
    let limits = KdfLimits::default().with_cancel(Arc::clone(&flag));
    assert!(matches!(
        luks::open_path_with(&p, PASS, &limits),
        Err(LuksError::Cancelled)
    ));
    flag.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(luks::open_path_with(&p, PASS, &limits).is_ok());
}

#[test]
fn printable_escapes_control_and_bidi_characters() {
    assert!(matches!(
        luks::printable("0b6f0c1e-9a5e-4d5b-8f3a-2c1d0e9f8a7b"),
        Cow::Borrowed(_)
    ));
    assert!(matches!(luks::printable("étiquette"), Cow::Borrowed(_)));
    assert_eq!(luks::printable("a\x1b[2Jb"), "a\\u{1b}[2Jb");
    assert_eq!(luks::printable("x\ny\r\t"), "x\\ny\\r\\t");
    assert_eq!(luks::printable("\u{9b}31m\x7f"), "\\u{9b}31m\\u{7f}");
    assert_eq!(luks::printable("ab\u{202e}cd"), "ab\\u{202e}cd");
    assert_eq!(luks::printable("a\\u{1b}"), "a\\\\u{1b}");
}

#[test]
fn a_luks2_uuid_with_escapes_opens_and_prints_escaped() {
    let dir = Dir::new("uuid");
    let mut b = fresh(&dir, LuksVersion::Luks2);
    // Binary header uuid field (offset 168, 40 bytes) in both copies.
    for off in [0usize, 16384] {
        let area = &mut b[off..off + 16384];
        area[168..208].fill(0);
        area[168..168 + 8].copy_from_slice(b"\x1b]0;pwn\x07");
        area[448..512].fill(0);
        let sum = openssl::sha::sha256(area);
        area[448..480].copy_from_slice(&sum);
    }
    let v = luks::open_path(dir.with_bytes("u.img", &b), PASS).unwrap();
    assert_eq!(v.uuid(), "\x1b]0;pwn\x07");
    assert_eq!(luks::printable(v.uuid()), "\\u{1b}]0;pwn\\u{7}");
}
