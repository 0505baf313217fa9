//! Authenticated LUKS2 volumes (`luks::format_integrity`): the header
//! carries the `iopages-integrity-v1` requirement and one
//! `iopages-integrity` token, the data segment has a fixed size and the
//! integrity area follows it. Specified here: what format writes (the
//! geometry `Layout::fit` gives, the area's superblock), that every open
//! checks the token field by field (each rule broken alone, checksums
//! recomputed, must be refused naming the field), that the key verbs keep
//! the requirement and the token, that `dump` shows them, and that
//! cryptsetup refuses to open such a volume while it opens a plain one.
//!
//! cryptsetup is an outside tool: where it is missing that test prints a
//! skip line, except under `CI=true`, where it fails.

use iopages_crypt::integrity::{self, layout::Entry, state, Keys, Layout, Mac};
use iopages_crypt::luks::{
    self, FormatOptions, HeaderDevice, IntegrityInfo, KeyOptions, LuksError, LuksVersion, Pbkdf,
    INTEGRITY_REQUIREMENT, INTEGRITY_TOKEN,
};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{cryptsetup_fast, luks2_json as json_of, luks2_reseal as reseal, need, Dir};

const PASS: &[u8] = b"correct horse battery staple";
const PASS2: &[u8] = b"second passphrase";
const DATA_OFFSET: u64 = 16 << 20;
/// Header-area size of what format writes (16 KiB copies).
const HDR: usize = 16384;
/// Image size: the header and 4 MiB for data and area.
const SIZE: u64 = DATA_OFFSET + (4 << 20);

fn opts() -> FormatOptions {
    FormatOptions {
        sector_size: 4096,
        ..FormatOptions::fast_for_tests(LuksVersion::Luks2)
    }
}

/// A new authenticated volume at `dir/name.img`.
fn made(dir: &Dir, name: &str, mac: Mac) -> (PathBuf, luks::LuksVolume, integrity::Anchor) {
    let img = dir.path(&format!("{name}.img"));
    let (vol, anchor) = luks::format_integrity_path(&img, Some(SIZE), PASS, &opts(), mac)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    (img, vol, anchor)
}

#[test]
fn format_writes_the_fitted_layout_and_open_reports_it() {
    let dir = Dir::new("luks-integrity", "layout");
    for mac in [Mac::HmacSha256, Mac::Gmac] {
        let (img, vol, _) = made(&dir, mac.name(), mac);
        let layout = Layout::fit(mac, SIZE - DATA_OFFSET).unwrap();
        let want = IntegrityInfo {
            area_offset: DATA_OFFSET + layout.data_bytes(),
            layout: layout.clone(),
        };
        assert_eq!(vol.integrity(), Some(&want), "{mac}");
        let again = luks::open_path(&img, PASS).unwrap();
        assert_eq!(again.integrity(), Some(&want), "{mac}");
        assert_eq!(again.master_key(), vol.master_key());
        assert_eq!(again.sector_size(), 4096);
        assert_eq!(again.segment_size_bytes(), Some(layout.data_bytes()));
        assert_eq!(again.payload_bytes(SIZE).unwrap(), layout.data_bytes());
        assert!(want.area_end() <= SIZE);
        // The largest that fits: one more block would not.
        let more = Layout::new(mac, layout.data_blocks() + 1).unwrap();
        assert!(
            DATA_OFFSET + more.data_bytes() + more.area_bytes() > SIZE,
            "{mac}"
        );
        let info = luks::inspect(&File::open(&img).unwrap()).unwrap();
        assert_eq!(info.integrity, Some(want));
        assert_eq!(info.data_size_bytes, Some(layout.data_bytes()));
    }
    // A plain volume has none.
    let plain = dir.path("plain.img");
    let v = luks::format_path(&plain, Some(SIZE), PASS, &opts()).unwrap();
    assert_eq!(v.integrity(), None);
    assert_eq!(luks::open_path(&plain, PASS).unwrap().integrity(), None);
}

#[test]
fn the_superblock_format_writes_decodes_at_area_block_0() {
    let dir = Dir::new("luks-integrity", "superblock");
    for mac in [Mac::HmacSha256, Mac::Gmac] {
        let (img, vol, anchor) = made(&dir, mac.name(), mac);
        let info = vol.integrity().unwrap();
        let f = File::open(&img).unwrap();
        let mut sb = vec![0u8; 4096];
        f.read_exact_at(&mut sb, info.area_offset).unwrap();
        let keys = Keys::derive(mac, vol.master_key()).unwrap();
        let got = state::decode_superblock(&sb, &keys).expect("the superblock decodes");
        assert_eq!(got, anchor);
        assert_eq!(got.epoch, 0);
        assert_eq!(got.root, Entry::default(), "the empty tree");
        assert!(got.root.is_empty());
        assert_eq!(got.mac, mac);
        assert_eq!(got.data_blocks, info.layout.data_blocks());
        assert_eq!(got.volume, state::volume_id(vol.uuid()));
        // Slot 1 is zeroed; another key does not accept slot 0.
        f.read_exact_at(&mut sb, info.area_offset + 4096).unwrap();
        assert!(sb.iter().all(|&b| b == 0));
        let other = Keys::derive(mac, &[7u8; 64]).unwrap();
        f.read_exact_at(&mut sb, info.area_offset).unwrap();
        assert_eq!(state::decode_superblock(&sb, &other), None);
    }
}

#[test]
fn format_refuses_luks1_a_512_byte_sector_and_a_device_too_small() {
    let dir = Dir::new("luks-integrity", "refused");
    let l1 = FormatOptions::fast_for_tests(LuksVersion::Luks1);
    let small = FormatOptions {
        sector_size: 512,
        ..opts()
    };
    for (name, o, words) in [
        ("luks1", &l1, "LUKS1"),
        ("sector512", &small, "sector size 512"),
    ] {
        let img = dir.path(&format!("{name}.img"));
        let e =
            luks::format_integrity_path(&img, Some(SIZE), PASS, o, Mac::HmacSha256).unwrap_err();
        assert!(
            matches!(&e, LuksError::InvalidOptions(m) if m.contains(words)),
            "{name}: {e}"
        );
        assert!(!img.exists(), "{name}: nothing is created before the check");
    }
    let img = dir.path("tiny.img");
    let e =
        luks::format_integrity_path(&img, Some(DATA_OFFSET + 4 * 4096), PASS, &opts(), Mac::Gmac)
            .unwrap_err();
    assert!(
        matches!(&e, LuksError::InvalidOptions(m) if m.contains("authenticated volume needs")),
        "{e}"
    );
    // The least that fits: one data block and its four area blocks.
    let (vol, _) =
        luks::format_integrity_path(&img, Some(DATA_OFFSET + 5 * 4096), PASS, &opts(), Mac::Gmac)
            .unwrap();
    assert_eq!(vol.integrity().unwrap().layout.data_blocks(), 1);
}

// ---- every rule of the token, broken one at a time -------------------

/// The image `bytes` with both copies' JSON edited and resealed.
fn edited(bytes: &[u8], edit: &dyn Fn(&mut Value)) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for off in [0, HDR] {
        let mut j = json_of(&b, off);
        edit(&mut j);
        let raw = serde_json::to_vec(&j).unwrap();
        let area = &mut b[off + 4096..off + HDR];
        area.fill(0);
        area[..raw.len()].copy_from_slice(&raw);
        reseal(&mut b, off);
    }
    b
}

fn open_bytes(dir: &Dir, name: &str, bytes: &[u8]) -> Result<luks::LuksVolume, LuksError> {
    let p = dir.path(&format!("{name}.img"));
    std::fs::write(&p, bytes).unwrap();
    let r = luks::open_path(&p, PASS);
    std::fs::remove_file(&p).unwrap();
    r
}

/// An edit of the metadata: a name, the edit, and the words the error
/// must hold (the field first).
type Rule = (&'static str, Box<dyn Fn(&mut Value)>, Vec<&'static str>);

/// Set the member at JSON pointer `at` to `v`.
fn set(at: &'static str, v: Value) -> Box<dyn Fn(&mut Value)> {
    Box::new(move |j: &mut Value| *j.pointer_mut(at).unwrap() = v.clone())
}

/// Remove member `key` of token 0.
fn remove(key: &'static str) -> Box<dyn Fn(&mut Value)> {
    Box::new(move |j: &mut Value| {
        j["tokens"]["0"].as_object_mut().unwrap().remove(key);
    })
}

/// The token's own fields: MAC, block size, keyslots, number syntax.
fn field_rules(data_blocks: u64) -> Vec<Rule> {
    let t = "/tokens/0";
    vec![
        (
            "mac-unknown",
            set("/tokens/0/mac", json!("hmac-md5")),
            vec!["tokens.0.mac", "hmac-md5"],
        ),
        (
            "mac-missing",
            remove("mac"),
            vec!["tokens.0.mac", "missing"],
        ),
        (
            "mac-number",
            set("/tokens/0/mac", json!(1)),
            vec!["tokens.0.mac"],
        ),
        (
            "block-size",
            set("/tokens/0/block_size", json!(512)),
            vec!["tokens.0.block_size", "4096"],
        ),
        (
            "block-size-string",
            set("/tokens/0/block_size", json!("4096")),
            vec!["tokens.0.block_size"],
        ),
        (
            "token-keyslots",
            set("/tokens/0/keyslots", json!(["0"])),
            vec!["tokens.0.keyslots"],
        ),
        ("token-not-object", set(t, json!(["x"])), vec!["tokens.0"]),
        (
            "blocks-zero",
            set("/tokens/0/data_blocks", json!("0")),
            vec!["tokens.0.data_blocks", "0 is not a block count"],
        ),
        (
            "blocks-not-decimal",
            set("/tokens/0/data_blocks", json!("0x10")),
            vec!["tokens.0.data_blocks", "decimal"],
        ),
        (
            "blocks-a-number",
            set("/tokens/0/data_blocks", json!(data_blocks)),
            vec!["tokens.0.data_blocks", "string"],
        ),
        (
            "area-offset-missing",
            remove("area_offset"),
            vec!["tokens.0.area_offset", "missing"],
        ),
        (
            "area-size-overflow",
            set("/tokens/0/area_size", json!("18446744073709551616")),
            vec!["tokens.0.area_size"],
        ),
    ]
}

/// The token against the data segment and itself: sizes, offsets.
fn geometry_rules(data_blocks: u64, data_bytes: u64) -> Vec<Rule> {
    let one_more = (data_blocks + 1).to_string();
    let one_less = (data_bytes - 4096).to_string();
    let past = (DATA_OFFSET + data_bytes + 4096).to_string();
    vec![
        (
            "blocks-huge",
            set("/tokens/0/data_blocks", json!("1099511627777")),
            vec!["tokens.0.data_blocks"],
        ),
        (
            "blocks-overflow",
            set("/tokens/0/data_blocks", json!("99999999999999999999999")),
            vec!["tokens.0.data_blocks", "2^64"],
        ),
        (
            "blocks-one-more",
            set("/tokens/0/data_blocks", json!(one_more)),
            vec!["segments.0.size", "data_blocks"],
        ),
        (
            "segment-dynamic",
            set("/segments/0/size", json!("dynamic")),
            vec!["segments.0.size", "dynamic"],
        ),
        (
            "segment-one-block-less",
            set("/segments/0/size", json!(one_less)),
            vec!["segments.0.size"],
        ),
        (
            "sector-512",
            set("/segments/0/sector_size", json!(512)),
            vec!["segments.0.sector_size", "4096"],
        ),
        (
            "area-size",
            set("/tokens/0/area_size", json!("4096")),
            vec!["tokens.0.area_size", "4096"],
        ),
        (
            "area-offset",
            set("/tokens/0/area_offset", json!(past)),
            vec!["tokens.0.area_offset", "right after"],
        ),
        (
            "segment-offset-overflow",
            set("/segments/0/offset", json!("18446744073709547520")),
            vec!["tokens.0.area_offset"],
        ),
    ]
}

/// The requirement and the token go together, one of each.
fn pairing_rules() -> Vec<Rule> {
    let dup = Box::new(|j: &mut Value| {
        let t = j["tokens"]["0"].clone();
        j["tokens"]["1"] = t;
    });
    let no_req = Box::new(|j: &mut Value| {
        j["config"].as_object_mut().unwrap().remove("requirements");
    });
    let twice = json!([INTEGRITY_REQUIREMENT, INTEGRITY_REQUIREMENT]);
    vec![
        (
            "token-without-requirement",
            no_req,
            vec!["tokens.0", INTEGRITY_REQUIREMENT, "does not list"],
        ),
        (
            "requirement-without-token",
            set("/tokens", json!({})),
            vec!["tokens", "exactly one"],
        ),
        ("two-tokens", dup, vec!["tokens", "2 tokens", "exactly one"]),
        (
            "requirement-twice",
            set("/config/requirements/mandatory", twice),
            vec!["config.requirements.mandatory", "2 times"],
        ),
    ]
}

#[test]
fn every_token_rule_broken_alone_is_refused_naming_the_field() {
    let dir = Dir::new("luks-integrity", "rules");
    let (img, vol, _) = made(&dir, "base", Mac::HmacSha256);
    let info = vol.integrity().unwrap().clone();
    let bytes = std::fs::read(&img).unwrap();
    // The unedited copy opens after a reseal: the edit is what fails.
    assert!(open_bytes(&dir, "same", &edited(&bytes, &|_| {})).is_ok());
    let (blocks, bytes_) = (info.layout.data_blocks(), info.layout.data_bytes());
    let mut rules = field_rules(blocks);
    rules.extend(geometry_rules(blocks, bytes_));
    rules.extend(pairing_rules());
    for (name, edit, words) in &rules {
        let e = open_bytes(&dir, name, &edited(&bytes, edit.as_ref())).unwrap_err();
        let LuksError::Corrupt(m) = &e else {
            panic!("{name}: not Corrupt: {e:?}");
        };
        for w in words.iter() {
            assert!(m.contains(w), "{name}: {w:?} not in: {m}");
        }
        // inspect (no passphrase) refuses it the same way.
        let p = dir.path(&format!("{name}-inspect.img"));
        std::fs::write(&p, edited(&bytes, edit.as_ref())).unwrap();
        assert!(luks::inspect(&File::open(&p).unwrap()).is_err(), "{name}");
    }
}

// ---- the token's numbers, any of them -------------------------------

/// The header of an authenticated volume made once (its first MiB: both
/// copies and keyslot 0), and its geometry.
fn prop_base() -> &'static (Vec<u8>, IntegrityInfo) {
    static BASE: std::sync::OnceLock<(Vec<u8>, IntegrityInfo)> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let dir = Dir::new("luks-integrity", "prop-base");
        let (img, vol, _) = made(&dir, "base", Mac::HmacSha256);
        let mut head = std::fs::read(&img).unwrap();
        head.truncate(1 << 20);
        (head, vol.integrity().unwrap().clone())
    })
}

/// Whether a token of these numbers over a segment of `seg_size` bytes at
/// the data offset describes a volume inside a `SIZE`-byte device: the
/// rules, written out independently of the reader.
fn consistent(blocks: u64, seg_size: u64, area_offset: u64, area_size: u64) -> bool {
    let Some(layout) = Layout::new(Mac::HmacSha256, blocks) else {
        return false;
    };
    let end = area_offset.checked_add(area_size);
    blocks.checked_mul(4096) == Some(seg_size)
        && area_size == layout.area_bytes()
        && DATA_OFFSET.checked_add(seg_size) == Some(area_offset)
        && end.is_some_and(|e| e <= SIZE)
}

/// A number near `good`: itself, a neighbour, or anything.
fn near(good: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => Just(good),
        1 => Just(good.wrapping_add(4096)),
        1 => Just(good.wrapping_sub(4096)),
        1 => Just(good.wrapping_add(1)),
        1 => Just(u64::MAX - good % 4096),
        1 => any::<u64>(),
    ]
}

fn numbers() -> impl Strategy<Value = (u64, u64, u64, u64)> {
    let l = &prop_base().1.layout;
    let area_offset = prop_base().1.area_offset;
    (
        near(l.data_blocks()),
        near(l.data_bytes()),
        near(area_offset),
        near(l.area_bytes()),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Any numbers in the token and the segment size: the volume opens
    /// exactly when they are consistent and inside the device (never a
    /// panic, never an overflow), and then reports them.
    #[test]
    fn a_token_opens_exactly_when_its_numbers_are_consistent(
        (blocks, seg_size, area_offset, area_size) in numbers()
    ) {
        let (head, _) = prop_base();
        let b = edited(head, &move |j: &mut Value| {
            j["tokens"]["0"]["data_blocks"] = json!(blocks.to_string());
            j["tokens"]["0"]["area_offset"] = json!(area_offset.to_string());
            j["tokens"]["0"]["area_size"] = json!(area_size.to_string());
            j["segments"]["0"]["size"] = json!(seg_size.to_string());
        });
        let dir = Dir::new("luks-integrity", "prop");
        let p = dir.path("v.img");
        let f = File::create(&p).unwrap();
        f.write_all_at(&b, 0).unwrap();
        f.set_len(SIZE).unwrap();
        let r = luks::open_path(&p, PASS);
        let ok = consistent(blocks, seg_size, area_offset, area_size);
        prop_assert_eq!(r.is_ok(), ok, "{:?}", r.as_ref().err());
        if let Ok(v) = r {
            let i = v.integrity().unwrap();
            prop_assert_eq!(i.layout.data_blocks(), blocks);
            prop_assert_eq!(i.area_offset, area_offset);
            prop_assert_eq!(v.segment_size_bytes(), Some(seg_size));
        } else if let Err(e) = r {
            let fine = matches!(e, LuksError::Corrupt(_));
            prop_assert!(fine, "{:?}", e);
        }
    }
}

#[test]
fn another_requirement_is_still_refused_beside_ours() {
    let dir = Dir::new("luks-integrity", "other-req");
    let (img, _, _) = made(&dir, "base", Mac::Gmac);
    let bytes = std::fs::read(&img).unwrap();
    for list in [
        json!([INTEGRITY_REQUIREMENT, "online-reencrypt-v2"]),
        json!(["online-reencrypt-v2"]),
        json!(["iopages-integrity-v2"]),
    ] {
        let edit = set("/config/requirements/mandatory", list.clone());
        let e = open_bytes(&dir, "req", &edited(&bytes, edit.as_ref())).unwrap_err();
        assert!(
            matches!(&e, LuksError::Unsupported(m) if m.contains("mandatory requirements")),
            "{list}: {e:?}"
        );
    }
}

#[test]
fn an_area_past_the_end_of_the_device_is_refused() {
    let dir = Dir::new("luks-integrity", "truncated");
    let (img, vol, _) = made(&dir, "base", Mac::HmacSha256);
    let info = vol.integrity().unwrap().clone();
    // The data segment still fits; the area does not.
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(info.area_end() - 4096).unwrap();
    let e = luks::open_path(&img, PASS).unwrap_err();
    assert!(
        matches!(&e, LuksError::Corrupt(m) if m.contains("integrity area") && m.contains("runs past")),
        "{e:?}"
    );
    // A header-only image (a backup) still opens, as a plain one does.
    f.set_len(DATA_OFFSET).unwrap();
    let v = luks::open_path(&img, PASS).unwrap();
    assert_eq!(v.integrity(), Some(&info));
}

// ---- the key verbs keep the requirement and the token ----------------

fn key_opts() -> KeyOptions {
    KeyOptions::new(Pbkdf::Pbkdf2 {
        hash: luks::Hash::Sha256,
        iterations: 1000,
    })
}

/// `verb` on the header of `img`; the volume reopened with `pass` still
/// reports `want`, and the metadata still holds the requirement.
fn after_verb(
    img: &Path,
    name: &str,
    pass: &[u8],
    want: &IntegrityInfo,
    verb: impl FnOnce(&HeaderDevice<'_>) -> Result<luks::KeyChange, LuksError>,
) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let dev = HeaderDevice::file(&f).unwrap();
    verb(&dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    let v = luks::open_path(img, pass).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(v.integrity(), Some(want), "{name}");
    let dump = luks::dump(&File::open(img).unwrap()).unwrap();
    let j: Value = serde_json::from_str(dump.json_text().unwrap()).unwrap();
    assert_eq!(
        j["config"]["requirements"]["mandatory"],
        json!([INTEGRITY_REQUIREMENT]),
        "{name}"
    );
    assert_eq!(j["tokens"]["0"]["type"], json!(INTEGRITY_TOKEN), "{name}");
    assert_eq!(j["tokens"].as_object().unwrap().len(), 1, "{name}");
}

#[test]
fn the_key_verbs_keep_the_requirement_and_the_token() {
    let dir = Dir::new("luks-integrity", "verbs");
    let (img, vol, _) = made(&dir, "base", Mac::Gmac);
    let want = vol.integrity().unwrap().clone();
    let token_before = json_of(&std::fs::read(&img).unwrap(), 0)["tokens"].clone();
    after_verb(&img, "add-key", PASS2, &want, |d| {
        luks::add_key(d, PASS, PASS2, &key_opts())
    });
    after_verb(&img, "change-key", b"third", &want, |d| {
        luks::change_key(d, PASS2, b"third", &key_opts())
    });
    after_verb(&img, "remove-key", PASS, &want, |d| {
        luks::remove_key(d, b"third", &key_opts())
    });
    after_verb(&img, "add-key-again", PASS2, &want, |d| {
        luks::add_key(d, PASS, PASS2, &key_opts())
    });
    after_verb(&img, "kill-slot", PASS2, &want, |d| {
        luks::kill_slot(d, 0, Some(PASS2), &key_opts())
    });
    let after = std::fs::read(&img).unwrap();
    assert_eq!(
        json_of(&after, 0)["tokens"],
        token_before,
        "the token is unchanged"
    );
    assert_eq!(json_of(&after, HDR)["tokens"], token_before);
    assert!(luks::open_path(&img, PASS).is_err(), "slot 0 was killed");
}

#[test]
fn dump_shows_the_requirement_and_the_token() {
    let dir = Dir::new("luks-integrity", "dump");
    let (img, vol, _) = made(&dir, "base", Mac::HmacSha256);
    let info = vol.integrity().unwrap();
    let text = luks::dump(&File::open(&img).unwrap()).unwrap().to_string();
    let has = |s: &str| assert!(text.contains(s), "{s:?} not in:\n{text}");
    has(&format!("Requirements:   {INTEGRITY_REQUIREMENT}\n"));
    has(&format!("Tokens:\n  0: {INTEGRITY_TOKEN}\n"));
    has("\tMAC:        hmac-sha256\n");
    has(&format!("\tData blocks:{}\n", info.layout.data_blocks()));
    has(&format!("\tArea offset:{} [bytes]\n", info.area_offset));
    has(&format!("\tArea length:{} [bytes]\n", info.area_bytes()));
    has(&format!("length:     {} [bytes]", info.layout.data_bytes()));
    let plain = dir.path("plain.img");
    luks::format_path(&plain, Some(SIZE), PASS, &opts()).unwrap();
    let text = luks::dump(&File::open(&plain).unwrap())
        .unwrap()
        .to_string();
    assert!(!text.contains("Requirements:"), "{text}");
}

// ---- cryptsetup keeps out ---------------------------------------------

fn run(cmd: &mut Command) -> std::process::Output {
    cmd.output().unwrap()
}

/// cryptsetup's verbs that change a header or map the data check the
/// requirements it does not know ("Unmet LUKS2 requirements detected");
/// each must fail on `img` and leave its bytes as they were.
fn cryptsetup_refuses_changes(cs: &Path, img: &Path, pass: &Path, name: &str) {
    let before = std::fs::read(img).unwrap();
    let verbs: [(&str, Command); 3] = [
        ("luksAddKey", {
            let mut c = cryptsetup_fast(cs, &["luksAddKey"]);
            c.arg(pass).arg(img).arg(pass);
            c
        }),
        ("luksChangeKey", {
            let mut c = cryptsetup_fast(cs, &["luksChangeKey"]);
            c.arg(pass).arg(img).arg(pass);
            c
        }),
        ("config --label", {
            let mut c = Command::new(cs);
            c.args(["config", "--label", "taken"]).arg(img);
            c
        }),
    ];
    for (verb, mut cmd) in verbs {
        let out = run(&mut cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: cryptsetup {verb} succeeded");
        assert!(
            err.contains("Unmet LUKS2 requirements"),
            "{name}: cryptsetup {verb} refused for another reason: {err}"
        );
    }
    assert!(
        std::fs::read(img).unwrap() == before,
        "{name}: cryptsetup wrote"
    );
}

#[test]
fn cryptsetup_refuses_an_authenticated_volume_and_opens_a_plain_one() {
    let Some(cs) = need("cryptsetup", "cryptsetup_refuses_an_authenticated_volume") else {
        return;
    };
    let dir = Dir::new("luks-integrity", "cryptsetup");
    let pass = dir.file("pass", PASS);
    let plain = dir.path("plain.img");
    luks::format_path(&plain, Some(SIZE), PASS, &opts()).unwrap();
    let add = run(cryptsetup_fast(&cs, &["luksAddKey"])
        .arg(&pass)
        .arg(&plain)
        .arg(&pass));
    assert!(
        add.status.success(),
        "plain: {}",
        String::from_utf8_lossy(&add.stderr)
    );
    for mac in [Mac::HmacSha256, Mac::Gmac] {
        let (img, _, _) = made(&dir, mac.name(), mac);
        // The header is one cryptsetup reads: the passphrase checks (no
        // mapping is made, and cryptsetup checks requirements only where
        // it writes the header or maps the data: LUKS2_activate).
        let test = run(Command::new(&cs)
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(&pass)
            .arg(&img));
        assert!(
            test.status.success(),
            "{mac}: {}",
            String::from_utf8_lossy(&test.stderr)
        );
        cryptsetup_refuses_changes(&cs, &img, &pass, mac.name());
        // luksDump shows the requirement it does not meet, and the token.
        let dump = run(Command::new(&cs).arg("luksDump").arg(&img));
        let text = String::from_utf8_lossy(&dump.stdout);
        assert!(
            dump.status.success(),
            "{mac}: {}",
            String::from_utf8_lossy(&dump.stderr)
        );
        assert!(
            text.contains(&format!("Requirements:\t{INTEGRITY_REQUIREMENT}")),
            "{mac}: {text}"
        );
        assert!(
            text.contains(&format!("0: {INTEGRITY_TOKEN}")),
            "{mac}: {text}"
        );
    }
}

#[test]
fn a_slot_cryptsetup_kills_leaves_the_requirement_and_the_token() {
    let Some(cs) = need("cryptsetup", "a_slot_cryptsetup_kills") else {
        return;
    };
    // luksKillSlot is the one header change cryptsetup makes despite the
    // requirement (a volume can always be destroyed): it keeps both.
    let dir = Dir::new("luks-integrity", "cs-kill");
    let (img, vol, _) = made(&dir, "base", Mac::HmacSha256);
    let want = vol.integrity().unwrap().clone();
    after_verb(&img, "add-key", PASS2, &want, |d| {
        luks::add_key(d, PASS, PASS2, &key_opts())
    });
    let kill = run(Command::new(&cs)
        .args(["luksKillSlot", "--batch-mode"])
        .arg(&img)
        .arg("0"));
    assert!(
        kill.status.success(),
        "{}",
        String::from_utf8_lossy(&kill.stderr)
    );
    let v = luks::open_path(&img, PASS2).unwrap();
    assert_eq!(v.integrity(), Some(&want));
    assert!(matches!(
        luks::open_path(&img, PASS),
        Err(LuksError::WrongPassphrase)
    ));
}
