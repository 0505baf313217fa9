//! Property test: a LUKS2 header made by cryptsetup, its JSON and keyslot
//! fields mutated (with valid checksums, in both copies or only the
//! primary), never panics the reader, and whatever is accepted opens with
//! the right passphrase only, to the right volume key, with a payload.
//!
//! cryptsetup is an outside tool: where it is missing the test prints a
//! skip line, except under `CI=true`, where it fails.

use iopages_crypt::luks::{self, KdfLimits, LuksError};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

mod common;
use common::cryptsetup_fast;

const PASS: &[u8] = b"correct horse battery staple";
const WRONG: &[u8] = b"not the passphrase";
const SIZE: u64 = 17 << 20;
const HDR: usize = 16384;

fn cryptsetup() -> Option<PathBuf> {
    iopages_testkit::need_tool("cryptsetup", "luks2_props")
}

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("luks2-props-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// cryptsetup's volume (two PBKDF2 keyslots: `PASS` and another) and its
/// volume key.
fn base() -> Option<&'static (Vec<u8>, Vec<u8>)> {
    static BASE: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    let cs = cryptsetup()?;
    Some(BASE.get_or_init(|| {
        let d = dir();
        let (img, pass, pass2) = (d.join("base.img"), d.join("pass"), d.join("pass2"));
        std::fs::write(&pass, PASS).unwrap();
        std::fs::write(&pass2, b"other").unwrap();
        File::create(&img).unwrap().set_len(SIZE).unwrap();
        for args in [&["luksFormat", "--type", "luks2"][..], &["luksAddKey"][..]] {
            let mut c = cryptsetup_fast(&cs, args);
            c.arg(&pass).arg(&img);
            if args[0] == "luksAddKey" {
                c.arg(&pass2);
            }
            let out = c.output().unwrap();
            assert!(out.status.success(), "{c:?}: {out:?}");
        }
        let key = luks::open_path(&img, PASS).unwrap().master_key().to_vec();
        let bytes = std::fs::read(&img).unwrap();
        std::fs::remove_file(&img).unwrap();
        (bytes, key)
    }))
}

/// Field paths the mutations aim at (every field the reader uses, and the
/// sections around them).
const PATHS: &[&[&str]] = &[
    &["keyslots"],
    &["keyslots", "0"],
    &["keyslots", "0", "type"],
    &["keyslots", "0", "key_size"],
    &["keyslots", "0", "priority"],
    &["keyslots", "0", "area"],
    &["keyslots", "0", "area", "offset"],
    &["keyslots", "0", "area", "size"],
    &["keyslots", "0", "area", "type"],
    &["keyslots", "0", "area", "key_size"],
    &["keyslots", "0", "area", "encryption"],
    &["keyslots", "0", "af", "stripes"],
    &["keyslots", "0", "af", "hash"],
    &["keyslots", "0", "af", "type"],
    &["keyslots", "0", "kdf", "type"],
    &["keyslots", "0", "kdf", "iterations"],
    &["keyslots", "0", "kdf", "hash"],
    &["keyslots", "0", "kdf", "salt"],
    &["keyslots", "1", "area", "offset"],
    &["keyslots", "1", "area", "size"],
    &["keyslots", "2"],
    &["digests", "0", "keyslots"],
    &["digests", "0", "segments"],
    &["digests", "0", "iterations"],
    &["digests", "0", "hash"],
    &["digests", "0", "salt"],
    &["digests", "0", "digest"],
    &["digests", "0", "type"],
    &["digests", "1"],
    &["segments", "0", "offset"],
    &["segments", "0", "size"],
    &["segments", "0", "iv_tweak"],
    &["segments", "0", "sector_size"],
    &["segments", "0", "encryption"],
    &["segments", "0", "type"],
    &["segments", "0", "flags"],
    &["segments", "1"],
    &["tokens"],
    &["tokens", "0"],
    &["config", "json_size"],
    &["config", "keyslots_size"],
    &["config", "flags"],
    &["config", "requirements"],
];

/// Values the mutations put there (`None`: remove the field).
fn values() -> Vec<Option<Value>> {
    [
        json!("0"),
        json!("1"),
        json!("512"),
        json!("4096"),
        json!("12288"),
        json!("16384"),
        json!("32768"),
        json!("290816"),
        json!("258048"),
        json!("16744448"),
        json!("16777216"),
        json!("16777217"),
        json!("18446744073709551615"),
        json!("18446744073709551616"),
        json!("-1"),
        json!("+1"),
        json!(" 1"),
        json!(""),
        json!("dynamic"),
        json!("luks2"),
        json!("pbkdf2"),
        json!("sha256"),
        json!("aes-xts-plain64"),
        json!("crypt"),
        json!("raw"),
        json!("AAAA"),
        json!(0),
        json!(1),
        json!(2),
        json!(32),
        json!(64),
        json!(512),
        json!(1000),
        json!(4000),
        json!(4096),
        json!(u32::MAX),
        json!(u64::MAX),
        json!(-1),
        json!(1.5),
        json!(true),
        json!(null),
        json!([]),
        json!(["0"]),
        json!(["1"]),
        json!(["0", "1"]),
        json!(["7"]),
        json!([0]),
        json!({}),
        json!({"type": "t", "keyslots": ["0"]}),
        json!({"type": "t", "keyslots": ["5"]}),
    ]
    .into_iter()
    .map(Some)
    .chain([None, None, None])
    .collect()
}

fn set(j: &mut Value, path: &[&str], v: Option<Value>) {
    let (last, parents) = path.split_last().unwrap();
    let mut cur = j;
    for p in parents {
        match cur.get_mut(*p) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        match v {
            Some(v) => {
                m.insert(last.to_string(), v);
            }
            None => {
                m.remove(*last);
            }
        }
    }
}

fn json_of(b: &[u8], off: usize) -> Value {
    let area = &b[off + 4096..off + HDR];
    let end = area.iter().position(|&c| c == 0).unwrap();
    serde_json::from_slice(&area[..end]).unwrap()
}

/// Write `j` into the copy at `off` and reseal it (sha256).
fn put(b: &mut [u8], off: usize, j: &Value) -> bool {
    let text = serde_json::to_vec(j).unwrap();
    if text.len() >= HDR - 4096 {
        return false;
    }
    let area = &mut b[off..off + HDR];
    area[4096..].fill(0);
    area[4096..4096 + text.len()].copy_from_slice(&text);
    area[448..512].fill(0);
    let sum = openssl::sha::sha256(area);
    area[448..480].copy_from_slice(&sum);
    true
}

static CASE: AtomicUsize = AtomicUsize::new(0);

fn check(bytes: &[u8], key: &[u8], len: u64) {
    let p = dir().join(format!("case{}.img", CASE.fetch_add(1, Ordering::Relaxed)));
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let f = File::create(&p).unwrap();
    f.write_all_at(&bytes[..end.min(len as usize)], 0).unwrap();
    f.set_len(len).unwrap();
    // Cheap limits: a mutated cost is refused, not run.
    let limits = KdfLimits {
        max_pbkdf2_iterations: 20_000,
        max_argon2_memory_kib: 1 << 16,
        max_argon2_time: 4,
        ..KdfLimits::default()
    };
    let _ = luks::inspect(&f);
    let right = luks::open_path_with(&p, PASS, &limits);
    let wrong = luks::open_path_with(&p, WRONG, &limits);
    std::fs::remove_file(&p).unwrap();
    if let Ok(v) = wrong {
        panic!("a wrong passphrase opened: {v:?}");
    }
    if let Ok(v) = right {
        assert_eq!(v.master_key(), key, "opened to another key");
        // A header-only result, or a detached header (data offset 0: the
        // payload is on another device), opens but has no payload to
        // serve here (`payload_bytes`' two refusals).
        match v.payload_bytes(len) {
            Ok(n) => assert!(n > 0 && v.data_offset_bytes() + n <= len, "{v:?}"),
            Err(LuksError::NoPayload(_)) => assert!(
                v.data_size_bytes(len) == 0 || v.data_offset_bytes() == 0,
                "{v:?}"
            ),
            Err(e) => panic!("payload of an opened volume: {e}"),
        }
    } else if let Err(e) = right {
        // Every refusal is a described error.
        assert!(!e.to_string().is_empty());
        let _: std::io::Error = e.into();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn mutated_luks2_metadata_opens_with_the_right_passphrase_only(
        muts in proptest::collection::vec((0..PATHS.len(), 0..53usize), 1..4),
        primary_only in any::<bool>(),
        flips in proptest::collection::vec((32768usize..(2 << 20), any::<u8>()), 0..2),
        cut in proptest::option::weighted(0.15, 0u64..SIZE),
    ) {
        let Some((orig, key)) = base() else { return Ok(()) };
        let vals = values();
        let mut j = json_of(orig, 0);
        for (p, v) in &muts {
            set(&mut j, PATHS[*p], vals[*v % vals.len()].clone());
        }
        let mut b = orig.clone();
        let offs: &[usize] = if primary_only { &[0] } else { &[0, HDR] };
        for &off in offs {
            if !put(&mut b, off, &j) {
                return Ok(());
            }
        }
        // Flipped bytes in the keyslot areas.
        for (at, x) in &flips {
            b[*at] ^= x | 1;
        }
        check(&b, key, cut.unwrap_or(SIZE));
    }
}

/// The unmutated volume passes the same checks (the property is not
/// vacuous).
#[test]
fn unmutated_volume_opens() {
    let Some((orig, key)) = base() else { return };
    let p = dir().join("plain.img");
    std::fs::write(&p, orig).unwrap();
    assert_eq!(luks::open_path(&p, PASS).unwrap().master_key(), &key[..]);
    assert!(matches!(
        luks::open_path(&p, WRONG),
        Err(LuksError::WrongPassphrase)
    ));
    std::fs::remove_file(&p).unwrap();
}
