//! LUKS2 metadata rules as cryptsetup applies them (its LUKS2 JSON
//! validation), one test per rule: a header `cryptsetup luksFormat --type
//! luks2` made, damaged in exactly one way with its checksums recomputed
//! (so the rule under test is the check that fires), and the error must
//! name the field, the value and the rule. Also: truncation at every
//! structural boundary is an error, never an open with a short payload.
//!
//! cryptsetup is an outside tool: where it is missing the tests print a
//! skip line, except under `CI=true`, where they fail.

use iopages_crypt::luks::{self, KdfLimits, LuksError, LuksOpenOptions, LuksVolume};
use serde_json::{json, Value};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::{cryptsetup_fast, luks2_json as json_of, luks2_reseal as reseal, need};

const PASS: &[u8] = b"correct horse battery staple";
const PASS2: &[u8] = b"second passphrase";
const WRONG: &[u8] = b"not the passphrase";
/// Image size: cryptsetup's 16 MiB of header and keyslots, 1 MiB of data.
const SIZE: u64 = 17 << 20;
const HDR: usize = 16384;
const DATA_OFFSET: u64 = 16 << 20;

// ---- helpers ---------------------------------------------------------

/// cryptsetup's path; `None` (after a skip line) when it is missing
/// outside CI; a failure when it is missing under `CI=true`.
fn cryptsetup(test: &str) -> Option<PathBuf> {
    need("cryptsetup", test)
}

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("luks2-rules-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A LUKS2 volume made by cryptsetup (PBKDF2, 1000 iterations) with
/// keyslot 0 for `PASS` and keyslot 1 for `PASS2`, its bytes and volume
/// key. Made once per test process.
struct Base {
    bytes: Vec<u8>,
    key: Vec<u8>,
    sector: usize,
}

fn base(test: &str) -> Option<&'static Base> {
    static BASE: OnceLock<Base> = OnceLock::new();
    let cs = cryptsetup(test)?;
    Some(BASE.get_or_init(|| {
        let d = dir();
        let img = d.join("base.img");
        let pass = d.join("pass");
        let pass2 = d.join("pass2");
        std::fs::write(&pass, PASS).unwrap();
        std::fs::write(&pass2, PASS2).unwrap();
        File::create(&img).unwrap().set_len(SIZE).unwrap();
        run_ok(
            cryptsetup_fast(&cs, &["luksFormat", "--type", "luks2"])
                .arg(&pass)
                .arg(&img),
        );
        run_ok(
            cryptsetup_fast(&cs, &["luksAddKey"])
                .arg(&pass)
                .arg(&img)
                .arg(&pass2),
        );
        let vol = luks::open_path(&img, PASS).expect("cryptsetup's volume opens");
        assert_eq!(vol.keyslot(), 0);
        assert_eq!(luks::open_path(&img, PASS2).unwrap().keyslot(), 1);
        assert!(!vol.used_secondary_header());
        let bytes = std::fs::read(&img).unwrap();
        std::fs::remove_file(&img).unwrap();
        Base {
            bytes,
            key: vol.master_key().to_vec(),
            sector: vol.sector_size(),
        }
    }))
}

/// Write `bytes` (a sparse file: trailing zeros are a hole) of length
/// `len` under a unique name.
fn image(name: &str, bytes: &[u8], len: u64) -> PathBuf {
    let p = dir().join(format!("{name}.img"));
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let f = File::create(&p).unwrap();
    f.write_all_at(&bytes[..end.min(len as usize)], 0).unwrap();
    f.set_len(len).unwrap();
    p
}

fn open(name: &str, bytes: &[u8]) -> Result<LuksVolume, LuksError> {
    let p = image(name, bytes, bytes.len() as u64);
    let r = luks::open_path(&p, PASS);
    let _ = std::fs::remove_file(&p);
    r
}

fn open_err(name: &str, bytes: &[u8]) -> LuksError {
    match open(name, bytes) {
        Ok(v) => panic!("{name}: opened: {v:?}"),
        Err(e) => e,
    }
}

/// Replace the JSON area of the copy at `off` with `raw` (zero-padded)
/// and reseal it.
fn put_raw_json(b: &mut [u8], off: usize, raw: &[u8]) {
    let area = &mut b[off + 4096..off + HDR];
    area.fill(0);
    area[..raw.len()].copy_from_slice(raw);
    reseal(b, off);
}

/// Both copies with edited JSON and valid checksums.
fn edited(base: &Base, edit: impl Fn(&mut Value)) -> Vec<u8> {
    let mut b = base.bytes.clone();
    for off in [0, HDR] {
        let mut j = json_of(&b, off);
        edit(&mut j);
        put_raw_json(&mut b, off, &serde_json::to_vec(&j).unwrap());
    }
    b
}

/// The error of a volume whose JSON was edited, which must be
/// `Corrupt` and mention every one of `words`.
fn corrupt_with(base: &Base, name: &str, edit: impl Fn(&mut Value), words: &[&str]) -> String {
    let e = open_err(name, &edited(base, edit));
    let LuksError::Corrupt(m) = &e else {
        panic!("{name}: not Corrupt: {e:?}")
    };
    for w in words {
        assert!(m.contains(w), "{name}: {w:?} not in: {m}");
    }
    // Both copies were damaged the same way: both are named.
    assert!(m.contains("primary") && m.contains("secondary"), "{m}");
    m.clone()
}

// ---- the rules -------------------------------------------------------

/// Zero the first 4096 bytes (the primary's binary header).
fn wipe(b: &mut [u8]) {
    b[..4096].fill(0);
}

/// Stamp another format's signature over an image.
type Stamp = fn(&mut Vec<u8>);

/// Other formats' signatures, as blkid probes them: a name, the stamp,
/// and the words that must name what was found.
fn foreign_stamps() -> Vec<(&'static str, Stamp, &'static str)> {
    vec![
        (
            "lvm",
            |b| {
                b[512..520].copy_from_slice(b"LABELONE");
                b[536..544].copy_from_slice(b"LVM2 001");
            },
            "LVM2 physical volume label (\"LABELONE\" at offset 512",
        ),
        (
            "ext4",
            |b| b[1080..1082].copy_from_slice(&[0x53, 0xef]),
            "ext2/ext3/ext4 superblock (magic 0xEF53 at offset 1080)",
        ),
        (
            "xfs",
            |b| b[..4].copy_from_slice(b"XFSB"),
            "XFS superblock (\"XFSB\" at offset 0)",
        ),
        (
            "swap",
            |b| b[4086..4096].copy_from_slice(b"SWAPSPACE2"),
            "swap signature (\"SWAPSPACE2\" at offset 4086)",
        ),
        (
            "swap-old",
            |b| b[4086..4096].copy_from_slice(b"SWAP-SPACE"),
            "swap signature (\"SWAP-SPACE\" at offset 4086)",
        ),
        (
            "btrfs",
            |b| b[65600..65608].copy_from_slice(b"_BHRfS_M"),
            "btrfs superblock (\"_BHRfS_M\" at offset 65600)",
        ),
        (
            "md12",
            |b| b[4096..4100].copy_from_slice(&[0xfc, 0x4e, 0x2b, 0xa9]),
            "MD RAID superblock (version 1.2",
        ),
        (
            "vfat",
            |b| {
                b[82..87].copy_from_slice(b"FAT32");
                b[510..512].copy_from_slice(&[0x55, 0xaa]);
            },
            "FAT filesystem boot sector",
        ),
        (
            "gpt",
            |b| b[512..520].copy_from_slice(b"EFI PART"),
            "GPT partition table",
        ),
    ]
}

/// The primary wiped and stamped with another format's signature: open
/// and inspect refuse it as ambiguous (naming what was found and how to
/// proceed); asked on purpose, both use the secondary and open with the
/// right passphrase only.
fn other_format_is_named_and_opens_only_on_purpose(
    base: &Base,
    name: &str,
    stamp: Stamp,
    found: &str,
) {
    let mut b = base.bytes.clone();
    wipe(&mut b);
    stamp(&mut b);
    let e = open_err(name, &b);
    let LuksError::AmbiguousSignatures(m) = &e else {
        panic!("{name}: {e:?}")
    };
    for w in [
        found,
        "primary header",
        "secondary header at offset 16384",
        "allow_secondary_header",
        "cryptsetup repair",
    ] {
        assert!(m.contains(w), "{name}: {w:?} not in: {e}");
    }
    assert!(e.to_string().starts_with("ambiguous signatures: "), "{e}");
    let p = image(name, &b, b.len() as u64);
    // inspect refuses alike; asked on purpose, both use the secondary.
    let f = File::open(&p).unwrap();
    assert!(matches!(
        luks::inspect(&f),
        Err(LuksError::AmbiguousSignatures(_))
    ));
    let on_purpose = LuksOpenOptions::new().allow_secondary_header(true);
    assert!(
        luks::inspect_with_options(&f, &on_purpose)
            .unwrap()
            .used_secondary_header
    );
    // (PASS2: keyslot 1's area is past everything stamped; btrfs's
    // magic lands in keyslot 0's.)
    let v = luks::open_path_with_options(&p, PASS2, &KdfLimits::default(), &on_purpose)
        .unwrap_or_else(|e| panic!("{name}: on purpose: {e}"));
    assert!(v.used_secondary_header());
    assert_eq!(v.master_key(), &base.key[..]);
    assert!(matches!(
        luks::open_path_with_options(&p, WRONG, &KdfLimits::default(), &on_purpose),
        Err(LuksError::WrongPassphrase)
    ));
    std::fs::remove_file(&p).unwrap();
}

/// Rule 1: a primary header area that now holds another format never
/// falls back to the old secondary header, unless asked on purpose; a
/// primary that is merely damaged still falls back, and says so.
#[test]
fn rule1_other_format_over_the_primary_refuses_the_secondary_header() {
    let Some(base) = base("rule1") else { return };
    for (name, stamp, found) in foreign_stamps() {
        other_format_is_named_and_opens_only_on_purpose(base, name, stamp, found);
    }
    // A LUKS1 header written over the LUKS2 one is read as LUKS1 (and
    // here refused as damaged LUKS1), never opened through the old
    // LUKS2 secondary.
    let mut b = base.bytes.clone();
    wipe(&mut b);
    b[..8].copy_from_slice(b"LUKS\xba\xbe\x00\x01");
    let e = open_err("luks1", &b);
    assert!(!matches!(e, LuksError::WrongPassphrase), "{e}");

    // Merely damaged primaries, no other signature: the secondary is
    // used, and the volume says so.
    let mut zeroed = base.bytes.clone();
    wipe(&mut zeroed);
    let mut bad_sum = base.bytes.clone();
    bad_sum[4096 + 10] ^= 0x20;
    let mut all_zero = base.bytes.clone();
    all_zero[..HDR].fill(0);
    for (name, b) in [
        ("zeroed", zeroed),
        ("badsum", bad_sum),
        ("allzero", all_zero),
    ] {
        let v = open(name, &b).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(v.used_secondary_header(), "{name}");
        assert_eq!(v.master_key(), &base.key[..]);
    }
}

/// Rule 2: `config.keyslots_size` and the keyslot areas.
#[test]
fn rule2_keyslots_size_and_keyslot_areas() {
    let Some(base) = base("rule2") else { return };
    let j = json_of(&base.bytes, 0);
    assert_eq!(j["config"]["keyslots_size"], json!("16744448"));
    let area0 = j["keyslots"]["0"]["area"].clone();
    keyslots_size_is_checked(base);
    keyslot_areas_are_checked(base, &area0);
}

/// Rule 2, `config.keyslots_size` and `json_size`: present, a decimal
/// string, aligned, ending before the data segment, matching `hdr_size`.
fn keyslots_size_is_checked(base: &Base) {
    corrupt_with(
        base,
        "ks-missing",
        |j| {
            j["config"].as_object_mut().unwrap().remove("keyslots_size");
        },
        &["config.keyslots_size is missing"],
    );
    corrupt_with(
        base,
        "ks-number",
        |j| j["config"]["keyslots_size"] = json!(16744448),
        &["config.keyslots_size is not a string"],
    );
    corrupt_with(
        base,
        "ks-sign",
        |j| j["config"]["keyslots_size"] = json!("+16744448"),
        &["config.keyslots_size \"+16744448\" is not a number"],
    );
    corrupt_with(
        base,
        "ks-align",
        |j| j["config"]["keyslots_size"] = json!("16744449"),
        &["config.keyslots_size 16744449 is not a multiple of 4096"],
    );
    corrupt_with(
        base,
        "ks-too-big",
        |j| j["config"]["keyslots_size"] = json!("16748544"),
        &[
            "config.keyslots_size 16748544",
            "[32768, 16781312)",
            "runs past the data segment at offset 16777216",
        ],
    );
    corrupt_with(
        base,
        "json-size",
        |j| j["config"]["json_size"] = json!("4096"),
        &["config.json_size 4096 does not match", "hdr_size 16384"],
    );
}

/// Rule 2, the keyslot areas (`area0` is keyslot 0's): inside the
/// keyslots area, not in the header copies, not overflowing, not empty,
/// not overlapping, large enough for the key material.
fn keyslot_areas_are_checked(base: &Base, area0: &Value) {
    // A keyslot area past the (shrunk) keyslots area.
    corrupt_with(
        base,
        "area-past",
        |j| j["config"]["keyslots_size"] = json!("4096"),
        &[
            "keyslots.0.area [32768, 290816) runs past the end of the keyslots area at 36864",
            "config.keyslots_size 4096",
        ],
    );
    corrupt_with(
        base,
        "area-in-hdr",
        |j| j["keyslots"]["0"]["area"]["offset"] = json!("16384"),
        &["keyslots.0.area.offset 16384 is inside the two 16384-byte header copies"],
    );
    corrupt_with(
        base,
        "area-overflow",
        |j| j["keyslots"]["0"]["area"]["offset"] = json!("18446744073709551000"),
        &[
            "keyslots.0.area.size 258048 at offset 18446744073709551000",
            "overflows",
        ],
    );
    corrupt_with(
        base,
        "area-zero",
        |j| j["keyslots"]["0"]["area"]["size"] = json!("0"),
        &["keyslots.0.area.size is 0"],
    );
    corrupt_with(
        base,
        "area-overlap",
        |j| j["keyslots"]["1"]["area"] = area0.clone(),
        &["keyslots.0.area [32768, 290816) overlaps keyslots.1.area [32768, 290816)"],
    );
    // Overlap by one byte's worth of sector, from below.
    corrupt_with(
        base,
        "area-overlap-partial",
        |j| {
            let o: u64 = j["keyslots"]["0"]["area"]["offset"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            j["keyslots"]["1"]["area"]["offset"] = json!((o + 4096).to_string());
        },
        &["overlaps keyslots.1.area [36864,"],
    );
    // The area cannot hold the AF-split key material: that keyslot
    // cannot be used (as in cryptsetup, which fails it when opening).
    let e = open_err(
        "area-small",
        &edited(base, |j| j["keyslots"]["0"]["area"]["size"] = json!("4096")),
    );
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("keyslots.0.area.size 4096 cannot hold the AF-split key material")
            && m.contains("4000 stripes")),
        "{e}"
    );
}

/// Rule 3: digests, tokens, segment flags, sizes and offsets.
#[test]
fn rule3_digests_tokens_and_segments() {
    let Some(base) = base("rule3") else { return };
    digest_references_are_checked(base);
    tokens_are_checked(base);
    segment_fields_are_checked(base);
    // A valid token (as systemd-cryptenroll writes) is accepted.
    let b = edited(base, |j| {
        j["tokens"]["0"] = json!({"type": "systemd-recovery", "keyslots": ["1"], "x": 1})
    });
    assert_eq!(open("token-ok", &b).unwrap().master_key(), &base.key[..]);
    // So is a fixed segment size that is whole sectors.
    let b = edited(base, |j| {
        j["segments"]["0"]["size"] = json!("1048576");
        j["segments"]["0"]["flags"] = json!(["x"]);
    });
    let v = open("size-ok", &b).unwrap();
    assert_eq!(v.segment_size_bytes(), Some(1 << 20));
}

/// Rule 3, digests: each keyslot in exactly one digest, every keyslot and
/// segment a digest names exists (named by string), every segment has a
/// digest.
fn digest_references_are_checked(base: &Base) {
    corrupt_with(
        base,
        "slot-no-digest",
        |j| j["digests"]["0"]["keyslots"] = json!(["0"]),
        &["keyslots.1 is assigned to 0 digests", "exactly one digest"],
    );
    corrupt_with(
        base,
        "slot-two-digests",
        |j| {
            let d = j["digests"]["0"].clone();
            j["digests"]["1"] = d;
        },
        &["is assigned to 2 digests", "exactly one digest"],
    );
    corrupt_with(
        base,
        "digest-missing-slot",
        |j| j["digests"]["0"]["keyslots"] = json!(["0", "1", "7"]),
        &["digests.0.keyslots[2] names keyslot \"7\", which does not exist"],
    );
    corrupt_with(
        base,
        "digest-missing-segment",
        |j| j["digests"]["0"]["segments"] = json!(["0", "3"]),
        &["digests.0.segments[1] names segment \"3\", which does not exist"],
    );
    corrupt_with(
        base,
        "digest-number-ref",
        |j| j["digests"]["0"]["keyslots"] = json!([0, 1]),
        &["digests.0.keyslots[0] 0 is not a string"],
    );
    corrupt_with(
        base,
        "segment-no-digest",
        |j| j["digests"]["0"]["segments"] = json!([]),
        &["segments.0 is not assigned to any digest"],
    );
}

/// Rule 3, tokens: an object of numbered objects, each with a string
/// `type` and an array of existing keyslots.
fn tokens_are_checked(base: &Base) {
    corrupt_with(
        base,
        "tokens-array",
        |j| j["tokens"] = json!([]),
        &["tokens is not an object"],
    );
    corrupt_with(
        base,
        "tokens-missing",
        |j| {
            j.as_object_mut().unwrap().remove("tokens");
        },
        &["tokens is missing"],
    );
    corrupt_with(
        base,
        "token-not-object",
        |j| j["tokens"]["0"] = json!("x"),
        &["tokens.0 is not an object"],
    );
    corrupt_with(
        base,
        "token-no-type",
        |j| j["tokens"]["0"] = json!({"keyslots": ["0"]}),
        &["tokens.0.type is missing"],
    );
    corrupt_with(
        base,
        "token-type-number",
        |j| j["tokens"]["0"] = json!({"type": 5, "keyslots": ["0"]}),
        &["tokens.0.type is not a string"],
    );
    corrupt_with(
        base,
        "token-slot-missing",
        |j| j["tokens"]["0"] = json!({"type": "systemd-tpm2", "keyslots": ["9"]}),
        &["tokens.0.keyslots[0] names keyslot \"9\", which does not exist"],
    );
    corrupt_with(
        base,
        "token-slots-object",
        |j| j["tokens"]["0"] = json!({"type": "systemd-tpm2", "keyslots": {}}),
        &["tokens.0.keyslots is not an array"],
    );
    corrupt_with(
        base,
        "token-key",
        |j| j["tokens"]["x"] = json!({"type": "t", "keyslots": []}),
        &["tokens has a key \"x\" that is not a number"],
    );
}

/// Rule 3, segments (and `config.flags`): flags arrays of strings, sizes,
/// offsets, sector sizes and `iv_tweak`.
fn segment_fields_are_checked(base: &Base) {
    corrupt_with(
        base,
        "flags-string",
        |j| j["segments"]["0"]["flags"] = json!("backup"),
        &["segments.0.flags is not an array"],
    );
    corrupt_with(
        base,
        "flags-number",
        |j| j["segments"]["0"]["flags"] = json!(["a", 1]),
        &["segments.0.flags holds something that is not a string (1 at index 1)"],
    );
    corrupt_with(
        base,
        "config-flags",
        |j| j["config"]["flags"] = json!([true]),
        &["config.flags holds something that is not a string (true at index 0)"],
    );
    corrupt_with(
        base,
        "size-512",
        |j| j["segments"]["0"]["size"] = json!("1000"),
        &["segments.0.size 1000 is not a positive multiple of 512 bytes"],
    );
    corrupt_with(
        base,
        "size-zero",
        |j| j["segments"]["0"]["size"] = json!("0"),
        &["segments.0.size 0 is not a positive multiple of 512 bytes"],
    );
    corrupt_with(
        base,
        "size-sector",
        |j| {
            j["segments"]["0"]["sector_size"] = json!(4096);
            j["segments"]["0"]["size"] = json!("4608");
        },
        &["segments.0.size 4608 is not a multiple of the 4096-byte sector size"],
    );
    corrupt_with(
        base,
        "offset-align",
        |j| j["segments"]["0"]["offset"] = json!("16777217"),
        &["segments.0.offset 16777217 is not aligned to 512-byte sectors"],
    );
    corrupt_with(
        base,
        "sector-zero",
        |j| j["segments"]["0"]["sector_size"] = json!(0),
        &["segments.0.sector_size 0 is not a positive multiple of 512"],
    );
    corrupt_with(
        base,
        "iv-tweak",
        |j| j["segments"]["0"]["iv_tweak"] = json!("-1"),
        &["segments.0.iv_tweak \"-1\" is not a decimal number"],
    );
}

/// Rule 4: the JSON area starts with `{` and is zero after the text.
#[test]
fn rule4_json_area_framing() {
    let Some(base) = base("rule4") else { return };
    let text = serde_json::to_vec(&json_of(&base.bytes, 0)).unwrap();
    let framed = |name: &str, raw: &[u8], words: &[&str]| {
        let mut b = base.bytes.clone();
        for off in [0, HDR] {
            put_raw_json(&mut b, off, raw);
        }
        let e = open_err(name, &b);
        for w in words {
            assert!(e.to_string().contains(w), "{name}: {w:?} not in {e}");
        }
    };
    let mut lead = b" ".to_vec();
    lead.extend_from_slice(&text);
    framed(
        "leading-space",
        &lead,
        &["the JSON area starts with byte 0x20", "with '{'"],
    );
    let mut trail = text.clone();
    trail.extend_from_slice(b"\n");
    framed(
        "trailing-newline",
        &trail,
        &[
            &format!("byte 0x0a at offset {} of the JSON area", text.len()),
            "every byte after the JSON text must be zero",
        ],
    );
    // Garbage after the terminating NUL, at the end of the JSON area.
    let mut b = base.bytes.clone();
    for off in [0, HDR] {
        b[off + HDR - 1] = b'x';
        reseal(&mut b, off);
    }
    let e = open_err("after-nul", &b);
    assert!(
        e.to_string().contains(&format!(
            "byte 0x78 at offset {} of the JSON area",
            HDR - 4096 - 1
        )),
        "{e}"
    );
    // Only the primary so: the secondary is used.
    let mut b = base.bytes.clone();
    b[HDR - 1] = b'x';
    reseal(&mut b, 0);
    assert!(open("after-nul-primary", &b)
        .unwrap()
        .used_secondary_header());
}

/// Rule 5: the device holds both header copies and the whole keyslots
/// area; one that ends there (a header backup) opens, with no payload.
#[test]
fn rule5_device_must_hold_headers_keyslots_and_data() {
    let Some(base) = base("rule5") else { return };
    let ks_end = 2 * HDR as u64 + 16744448;
    assert_eq!(ks_end, DATA_OFFSET);
    for len in [ks_end - 4096, ks_end - 1] {
        let p = image(&format!("short{len}"), &base.bytes, len);
        match luks::open_path(&p, PASS) {
            Err(LuksError::Truncated { needed, have }) => {
                assert_eq!((needed, have), (ks_end, len))
            }
            other => panic!("{len}: {other:?}"),
        }
        assert!(matches!(
            luks::inspect(&File::open(&p).unwrap()),
            Err(LuksError::Truncated { .. })
        ));
        std::fs::remove_file(&p).unwrap();
    }
    // Ending at the data offset (or within its first sector): a
    // header-only image, which opens but has no payload to serve.
    for len in [DATA_OFFSET, DATA_OFFSET + base.sector as u64 - 1] {
        let p = image(&format!("at-data{len}"), &base.bytes, len);
        let v = luks::open_path(&p, PASS).unwrap();
        match v.payload_bytes(len) {
            Err(e @ LuksError::NoPayload(_)) => {
                assert!(e.to_string().contains("header-only"), "{e}")
            }
            other => panic!("at data offset: {other:?}"),
        }
        std::fs::remove_file(&p).unwrap();
    }
    // One sector of data: it opens.
    let p = image("one-sector", &base.bytes, DATA_OFFSET + base.sector as u64);
    let v = luks::open_path(&p, PASS).unwrap();
    assert_eq!(
        v.data_size_bytes(DATA_OFFSET + base.sector as u64),
        base.sector as u64
    );
    std::fs::remove_file(&p).unwrap();
}

/// Rule 6: a detached header (data segment at offset 0) opens as
/// cryptsetup opens it (for `check`, `dump` and the key verbs) and has no
/// payload here: its data is on another device.
#[test]
fn rule6_detached_header_opens_without_a_payload() {
    let Some(base) = base("rule6") else { return };
    let v = open(
        "detached-edit",
        &edited(base, |j| j["segments"]["0"]["offset"] = json!("0")),
    )
    .unwrap();
    assert_eq!(v.data_offset_bytes(), 0);
    assert!(
        matches!(v.payload_bytes(1 << 30), Err(LuksError::NoPayload(m)) if m.contains("detached header"))
    );
    // A header cryptsetup made with --header.
    let Some(cs) = cryptsetup("rule6") else {
        return;
    };
    let d = dir();
    let (hdr, data, pass) = (d.join("d.hdr"), d.join("d.data"), d.join("d.pass"));
    std::fs::write(&pass, PASS).unwrap();
    File::create(&data).unwrap().set_len(4 << 20).unwrap();
    run_ok(
        cryptsetup_fast(&cs, &["luksFormat", "--type", "luks2"])
            .arg(&pass)
            .arg("--header")
            .arg(&hdr)
            .arg(&data),
    );
    let v = luks::open_path(&hdr, PASS).unwrap();
    assert_eq!(v.data_offset_bytes(), 0);
    luks::inspect(&File::open(&hdr).unwrap()).unwrap();
    // The data device has no header at all.
    assert!(luks::open_path(&data, PASS).is_err());
    for p in [hdr, data, pass] {
        std::fs::remove_file(p).unwrap();
    }
}

/// Truncation at every structural boundary (around each header copy,
/// JSON area, keyslot area and the keyslots area) before the data offset
/// is an error, never an open with a short header.
#[test]
fn truncation_at_every_structural_boundary_is_an_error() {
    let Some(base) = base("truncation") else {
        return;
    };
    let j = json_of(&base.bytes, 0);
    let mut bounds = vec![0u64, 8, 512, 4096, HDR as u64, HDR as u64 + 4096];
    bounds.push(2 * HDR as u64);
    for k in j["keyslots"].as_object().unwrap().values() {
        let o: u64 = k["area"]["offset"].as_str().unwrap().parse().unwrap();
        let s: u64 = k["area"]["size"].as_str().unwrap().parse().unwrap();
        bounds.extend([o, o + s]);
    }
    bounds.push(DATA_OFFSET);
    let mut lens: Vec<u64> = bounds
        .iter()
        .flat_map(|&b| [b.saturating_sub(1), b, b + 1])
        .filter(|&l| l < DATA_OFFSET)
        .collect();
    lens.sort_unstable();
    lens.dedup();
    for len in lens {
        let p = image(&format!("trunc{len}"), &base.bytes, len);
        let r = luks::open_path(&p, PASS);
        std::fs::remove_file(&p).unwrap();
        match r {
            Ok(v) => panic!("truncated at {len}: opened with {v:?}"),
            Err(LuksError::Truncated { needed, have }) => {
                assert_eq!(have, len);
                assert!(needed > have, "{len}: {needed}");
            }
            Err(LuksError::Corrupt(m)) if len < 2 * HDR as u64 => {
                // Both copies cut: named as such.
                assert!(m.contains("primary"), "{len}: {m}")
            }
            Err(e) => panic!("truncated at {len}: {e:?}"),
        }
    }
}
