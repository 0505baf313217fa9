//! One raw NBD client in the tests: no test file under `crates/*/tests`,
//! and no module of this crate outside `src/nbd_client/`, may speak the
//! NBD handshake by hand again — name a magic number of the protocol
//! (as a constant, an identifier or its ASCII), or encode with the
//! server's own `proto` module (iopages-nbd's) instead of the
//! independent `iopages_testkit::nbd_client` (iopages-tools', re-exported). A new test that needs something the
//! client lacks adds it there.
//!
//! The patterns are assembled from pieces, so that this file does not
//! match itself.

use std::path::PathBuf;

mod common;
use common::{root, rs_files};

/// Files that may keep a pattern, each with the reason.
const ALLOWED: &[(&str, &str)] = &[];

/// The protocol's magic numbers as hex digits, lower case, no `0x`
/// (written in two halves each).
fn magic_hex() -> Vec<String> {
    [
        ("49484156", "454f5054"), // the options' magic
        ("4e42444d", "41474943"), // the greeting's first magic
        ("3e8890", "4565a9"),     // option replies
        ("6744", "6698"),         // simple replies
        ("668e", "33ef"),         // structured replies
        ("2560", "9513"),         // requests
    ]
    .iter()
    .map(|(a, b)| format!("{a}{b}"))
    .collect()
}

/// Words that only a hand-written handshake needs.
fn magic_words() -> Vec<String> {
    let mut v: Vec<String> = ["IHAVE", "NBDMA", "NBD_MA"]
        .iter()
        .zip(["OPT", "GIC", "GIC"])
        .map(|(a, b)| format!("{a}{b}"))
        .collect();
    v.push(format!("REPLY_{}", "MAGIC"));
    v.push(format!("REQUEST_{}", "MAGIC"));
    v.push(format!("iopages_nbd::{}", "proto"));
    v
}

/// What in `text` looks like a hand-written handshake: the patterns it
/// contains.
fn hand_written(text: &str) -> Vec<String> {
    // Hex literals compared without their `_` separators, in lower case
    // (upper-case hex digits and `_` groups name the same number).
    let hex: String = text.replace('_', "").to_lowercase();
    let mut found: Vec<String> = magic_hex()
        .into_iter()
        .filter(|m| hex.contains(&format!("0x{m}")) || hex.contains(&format!("0x000{m}")))
        .map(|m| format!("0x{m}"))
        .collect();
    found.extend(
        magic_words()
            .into_iter()
            .filter(|w| text.contains(w.as_str())),
    );
    found
}

/// The files this rule covers: every test file of every crate, and the
/// sources of the test-support crates (this one and iopages-tools) outside
/// the client.
fn covered() -> Vec<PathBuf> {
    let root = root();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        files.extend(rs_files(&krate.path().join("tests")));
    }
    let client = root.join("crates/iopages-tools/src/nbd_client");
    let mut own = Vec::new();
    own.extend(rs_files(&root.join("crates/iopages-testkit/src")));
    own.extend(rs_files(&root.join("crates/iopages-tools/src")));
    files.extend(own.into_iter().filter(|p| !p.starts_with(&client)));
    files
}

#[test]
fn no_test_file_writes_the_nbd_handshake_by_hand() {
    let root = root().canonicalize().unwrap();
    let files = covered();
    assert!(
        files.len() > 20,
        "found only {} files to check",
        files.len()
    );
    let mut offenders = Vec::new();
    for f in files {
        let rel = f.canonicalize().unwrap();
        let rel = rel
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .to_string();
        if ALLOWED.iter().any(|(p, _)| *p == rel) {
            continue;
        }
        let found = hand_written(&std::fs::read_to_string(&f).unwrap());
        if !found.is_empty() {
            offenders.push(format!("{rel}: {}", found.join(", ")));
        }
    }
    assert!(
        offenders.is_empty(),
        "speak NBD through iopages_testkit::nbd_client (add what it lacks there), \
         not by hand:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_detector_sees_the_client_s_own_wire_module() {
    let wire = root().join("crates/iopages-tools/src/nbd_client/wire.rs");
    let found = hand_written(&std::fs::read_to_string(wire).unwrap());
    // All six magic numbers, and the words.
    assert!(found.len() >= 6 + 3, "{found:?}");
    let literal = format!("let m = 0x4948_4156_{}u64;", "454F_5054");
    assert_eq!(
        hand_written(&literal),
        vec![format!("0x{}", magic_hex()[0])]
    );
    assert!(hand_written("s.write_all(&simple_reply(0, c))").is_empty());
}
