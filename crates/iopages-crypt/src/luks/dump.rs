//! `luksDump`: every public field of a LUKS1 or LUKS2 header, read without
//! a passphrase, as text a person reads and (LUKS2) the JSON metadata as
//! stored.
//!
//! Owns: the report's layout — the fields `cryptsetup luksDump` shows,
//! under the same names, one `Name: value` per line (hex bytes 16 to a
//! line, continued on lines of their own), so a reader who knows
//! cryptsetup's report finds every field where they expect it (field for
//! field, not byte for byte). Must never: show key material (there is
//! none in a header: key-slot areas are never read here; salts and
//! digests are public, as in cryptsetup), print a header string unescaped
//! (every string goes through [`printable`]), or show a header that
//! [`super::inspect`] would refuse as damaged or truncated — a header this
//! crate merely cannot use (another cipher, a detached header) is shown.

use super::integrity_meta::INTEGRITY_TOKEN;
use super::luks1::{self, SLOT_ACTIVE, SLOT_DISABLED};
use super::luks2::{self, BIN_HEADER_BYTES};
use super::MAGIC;
use super::{parse, printable, Dev, LuksError, LuksOpenOptions, LuksVersion, LUKS2_KEYSLOTS_MAX};
use base64::Engine as _;
use serde_json::{Map, Value};
use std::fmt::Write as _;
use std::fs::File;

/// Bytes shown on one line of a hex dump.
const HEX_PER_LINE: usize = 16;
/// Width of a top-level field's name column (`Payload offset:` fits).
const TOP_WIDTH: usize = 16;
/// Width of a LUKS1 key slot's field column (`Key material offset:`).
const SLOT_WIDTH: usize = 21;
/// Width of a LUKS2 keyslot, segment, token or digest field column.
const ITEM_WIDTH: usize = 12;

/// A header's description, as [`dump`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksDump {
    version: LuksVersion,
    uuid: String,
    text: String,
    json: Option<String>,
}

impl LuksDump {
    /// LUKS1 or LUKS2.
    pub fn version(&self) -> LuksVersion {
        self.version
    }

    /// The UUID as stored (unescaped: pass it through [`printable`]
    /// before showing it).
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// The LUKS2 JSON metadata exactly as stored in the header copy used
    /// (its text up to the terminating NUL), with every non-ASCII
    /// character written as a JSON `\u` escape so that it is safe on a
    /// terminal and still the same JSON value; `None` for LUKS1, which has
    /// no JSON metadata.
    pub fn json_text(&self) -> Option<&str> {
        self.json.as_deref()
    }
}

impl std::fmt::Display for LuksDump {
    /// The report, in `cryptsetup luksDump`'s order and field names.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// Describe the header of `dev` (a file or block device) without a
/// passphrase, as `cryptsetup luksDump` does. A header-only image (a
/// header backup) is described like a whole volume.
///
/// **Context:** reads the header (LUKS2: both copies) and nothing else.
///
/// **Returns:** the description, or the error [`super::inspect`] gives for
/// a header that is not LUKS, damaged or truncated. Ciphers, key
/// derivations and features this crate does not use are described, not
/// refused.
pub fn dump(dev: &File) -> Result<LuksDump, LuksError> {
    dump_dev(&Dev::new(dev)?)
}

/// [`dump`] of a header on a [`Backend`](crate::backend::Backend) (a
/// remote export), read in whole 4096-byte blocks.
pub fn dump_backend(dev: &dyn crate::backend::Backend) -> Result<LuksDump, LuksError> {
    dump_dev(&Dev::of_backend(dev))
}

/// Whether `dev` holds a LUKS header [`super::inspect`] accepts, or one
/// it refuses only for what this crate does not use (a cipher, a key
/// derivation, a detached header): such a header is still shown and
/// backed up.
pub(super) fn parses_for_inspection(dev: &Dev<'_>) -> Result<(), LuksError> {
    match parse(dev, LUKS2_KEYSLOTS_MAX, &LuksOpenOptions::default()) {
        Ok(_)
        | Err(
            LuksError::UnsupportedCipher(_)
            | LuksError::UnsupportedKdf(_)
            | LuksError::Unsupported(_),
        ) => Ok(()),
        Err(e) => Err(e),
    }
}

fn dump_dev(dev: &Dev<'_>) -> Result<LuksDump, LuksError> {
    parses_for_inspection(dev)?;
    let mut head = [0u8; 8];
    dev.read_at(0, &mut head)?;
    if head[..6] == MAGIC && head[6..8] == [0, 1] {
        dump_luks1(dev)
    } else {
        dump_luks2(dev)
    }
}

/// `bytes` as lowercase hex pairs, [`HEX_PER_LINE`] to a line; lines after
/// the first start with `indent`.
fn hex(bytes: &[u8], indent: &str) -> String {
    let mut out = String::new();
    for (i, line) in bytes.chunks(HEX_PER_LINE).enumerate() {
        if i > 0 {
            out.push('\n');
            out.push_str(indent);
        }
        let pairs: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
        out.push_str(&pairs.join(" "));
    }
    out
}

/// One `Name: value` line, the name padded to `width` after `prefix`;
/// a multi-line value continues under its first line.
fn line(out: &mut String, prefix: &str, width: usize, name: &str, value: &str) {
    let _ = writeln!(out, "{prefix}{:<width$}{value}", format!("{name}:"));
}

/// A field whose value is a hex dump.
fn hex_line(out: &mut String, prefix: &str, width: usize, name: &str, bytes: &[u8]) {
    let indent = format!("{prefix}{:width$}", "");
    line(out, prefix, width, name, &hex(bytes, &indent));
}

fn dump_luks1(dev: &Dev<'_>) -> Result<LuksDump, LuksError> {
    let mut b = [0u8; luks1::HEADER_BYTES];
    dev.read_at(0, &mut b)?;
    let h = luks1::Header::decode(&b)?;
    let mut out = String::from("LUKS header information\n");
    let top = |out: &mut String, name: &str, value: &str| line(out, "", TOP_WIDTH, name, value);
    top(&mut out, "Version", "1");
    top(&mut out, "Cipher name", &printable(&h.cipher_name));
    top(&mut out, "Cipher mode", &printable(&h.cipher_mode));
    top(&mut out, "Hash spec", &printable(&h.hash_spec));
    top(&mut out, "Payload offset", &h.payload_offset.to_string());
    top(
        &mut out,
        "MK bits",
        &(u64::from(h.key_bytes) * 8).to_string(),
    );
    hex_line(&mut out, "", TOP_WIDTH, "MK digest", &h.mk_digest);
    hex_line(&mut out, "", TOP_WIDTH, "MK salt", &h.mk_digest_salt);
    top(&mut out, "MK iterations", &h.mk_digest_iter.to_string());
    top(&mut out, "UUID", &printable(&h.uuid));
    out.push('\n');
    for (i, s) in h.slots.iter().enumerate() {
        let state = match s.active {
            SLOT_ACTIVE => "ENABLED".to_string(),
            SLOT_DISABLED => "DISABLED".to_string(),
            other => format!("INVALID (active 0x{other:08x})"),
        };
        let _ = writeln!(out, "Key Slot {i}: {state}");
        if s.active != SLOT_ACTIVE {
            continue;
        }
        let slot =
            |out: &mut String, name: &str, value: &str| line(out, "\t", SLOT_WIDTH, name, value);
        slot(&mut out, "Iterations", &s.iterations.to_string());
        hex_line(&mut out, "\t", SLOT_WIDTH, "Salt", &s.salt);
        slot(
            &mut out,
            "Key material offset",
            &s.key_material_offset.to_string(),
        );
        slot(&mut out, "AF stripes", &s.stripes.to_string());
    }
    Ok(LuksDump {
        version: LuksVersion::Luks1,
        uuid: h.uuid,
        text: out,
        json: None,
    })
}

/// The stored JSON text of the header copy at `hdr_offset` (of
/// `hdr_size` bytes), up to its NUL, with non-ASCII characters escaped.
fn stored_json(dev: &Dev<'_>, hdr_offset: u64, hdr_size: u64) -> Result<String, LuksError> {
    let mut area = vec![0u8; (hdr_size as usize).saturating_sub(BIN_HEADER_BYTES)];
    dev.read_at(hdr_offset + BIN_HEADER_BYTES as u64, &mut area)?;
    let end = area.iter().position(|&c| c == 0).unwrap_or(area.len());
    let text = std::str::from_utf8(&area[..end])
        .map_err(|e| LuksError::Corrupt(format!("LUKS2 JSON area: not UTF-8 ({e})")))?;
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{u:04x}");
            }
        }
    }
    Ok(out)
}

fn dump_luks2(dev: &Dev<'_>) -> Result<LuksDump, LuksError> {
    let (h, json, used_secondary) = luks2::load(dev, LUKS2_KEYSLOTS_MAX, false)?;
    let root = json
        .as_object()
        .ok_or_else(|| LuksError::Corrupt("LUKS2 metadata is not an object".to_string()))?;
    let mut out = String::from("LUKS header information\n");
    let top = |out: &mut String, name: &str, value: &str| line(out, "", TOP_WIDTH, name, value);
    let config = root.get("config");
    top(&mut out, "Version", "2");
    top(&mut out, "Epoch", &h.seqid.to_string());
    top(
        &mut out,
        "Metadata area",
        &format!("{} [bytes]", h.hdr_size),
    );
    let keyslots_size = text_of(config.and_then(|c| c.get("keyslots_size")));
    top(
        &mut out,
        "Keyslots area",
        &format!("{keyslots_size} [bytes]"),
    );
    top(&mut out, "UUID", &printable(&h.uuid));
    let or = |s: &str, none: &str| {
        if s.is_empty() {
            none.to_string()
        } else {
            printable(s).into_owned()
        }
    };
    top(&mut out, "Label", &or(&h.label, "(no label)"));
    top(&mut out, "Subsystem", &or(&h.subsystem, "(no subsystem)"));
    let flags = list_of(config.and_then(|c| c.get("flags")));
    top(&mut out, "Flags", &or(&flags, "(no flags)"));
    let required = config
        .and_then(|c| c.get("requirements"))
        .and_then(|r| r.get("mandatory"));
    let required = list_of(required);
    if !required.is_empty() {
        // cryptsetup shows this line only when something is required.
        top(&mut out, "Requirements", &required);
    }
    if used_secondary {
        top(
            &mut out,
            "Header copy",
            &format!(
                "secondary at offset {} (the primary is damaged)",
                h.hdr_offset
            ),
        );
    }
    out.push('\n');
    dump_segments(&mut out, root.get("segments"));
    out.push('\n');
    dump_keyslots(&mut out, root.get("keyslots"), root.get("digests"));
    dump_tokens(&mut out, root.get("tokens"));
    dump_digests(&mut out, root.get("digests"));
    Ok(LuksDump {
        version: LuksVersion::Luks2,
        uuid: h.uuid,
        text: out,
        json: Some(stored_json(dev, h.hdr_offset, h.hdr_size)?),
    })
}

/// A JSON value as one printable word: a string unquoted, a number as
/// written, anything else as compact JSON; `(missing)` for none.
fn text_of(v: Option<&Value>) -> String {
    match v {
        None => "(missing)".to_string(),
        Some(Value::String(s)) => printable(s).into_owned(),
        Some(other) => printable(&other.to_string()).into_owned(),
    }
}

/// A JSON array of strings (flags, keyslot lists) joined by spaces; empty
/// for none.
fn list_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| text_of(Some(i)))
            .collect::<Vec<_>>()
            .join(" "),
        None => String::new(),
        Some(other) => text_of(Some(other)),
    }
}

/// Objects of a JSON section in numeric key order (`"10"` after `"9"`).
fn numbered(section: Option<&Value>) -> Vec<(&str, &Map<String, Value>)> {
    let mut items: Vec<(&str, &Map<String, Value>)> = section
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_object().map(|o| (k.as_str(), o)))
                .collect()
        })
        .unwrap_or_default();
    items.sort_by_key(|(k, _)| (k.len(), k.to_string()));
    items
}

/// One keyslot, segment, token or digest field line.
fn item(out: &mut String, name: &str, value: &str) {
    line(out, "\t", ITEM_WIDTH, name, value);
}

/// A base64 field as hex (or, when it is not base64, as the text stored).
fn b64_item(out: &mut String, name: &str, v: Option<&Value>) {
    let decoded = v
        .and_then(Value::as_str)
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok());
    match decoded {
        Some(bytes) => hex_line(out, "\t", ITEM_WIDTH, name, &bytes),
        None => item(out, name, &text_of(v)),
    }
}

fn bits(v: Option<&Value>) -> String {
    match v.and_then(Value::as_u64) {
        Some(bytes) => format!("{} bits", bytes.saturating_mul(8)),
        None => text_of(v),
    }
}

fn dump_segments(out: &mut String, segments: Option<&Value>) {
    out.push_str("Data segments:\n");
    for (id, s) in numbered(segments) {
        let _ = writeln!(out, "  {}: {}", printable(id), text_of(s.get("type")));
        item(
            out,
            "offset",
            &format!("{} [bytes]", text_of(s.get("offset"))),
        );
        let length = match s.get("size").and_then(Value::as_str) {
            Some("dynamic") => "(whole device)".to_string(),
            _ => format!("{} [bytes]", text_of(s.get("size"))),
        };
        item(out, "length", &length);
        item(out, "cipher", &text_of(s.get("encryption")));
        item(
            out,
            "sector",
            &format!("{} [bytes]", text_of(s.get("sector_size"))),
        );
        if let Some(i) = s.get("integrity") {
            item(out, "integrity", &text_of(i.get("type")));
        }
        let flags = list_of(s.get("flags"));
        if !flags.is_empty() {
            item(out, "flags", &flags);
        }
    }
}

/// The digest that lists keyslot `id`, if one does.
fn digest_of_keyslot<'a>(digests: Option<&'a Value>, id: &str) -> Option<&'a str> {
    numbered(digests).into_iter().find_map(|(d, m)| {
        m.get("keyslots")
            .and_then(Value::as_array)
            .is_some_and(|ks| ks.iter().any(|k| k.as_str() == Some(id)))
            .then_some(d)
    })
}

fn dump_keyslots(out: &mut String, keyslots: Option<&Value>, digests: Option<&Value>) {
    out.push_str("Keyslots:\n");
    for (id, k) in numbered(keyslots) {
        let _ = writeln!(out, "  {}: {}", printable(id), text_of(k.get("type")));
        item(out, "Key", &bits(k.get("key_size")));
        let priority = match k.get("priority").and_then(Value::as_u64) {
            None if k.get("priority").is_none() => "normal".to_string(),
            Some(0) => "ignored".to_string(),
            Some(1) => "normal".to_string(),
            Some(2) => "preferred".to_string(),
            _ => text_of(k.get("priority")),
        };
        item(out, "Priority", &priority);
        let area = k.get("area");
        item(
            out,
            "Cipher",
            &text_of(area.and_then(|a| a.get("encryption"))),
        );
        item(
            out,
            "Cipher key",
            &bits(area.and_then(|a| a.get("key_size"))),
        );
        dump_kdf(out, k.get("kdf"));
        let af = k.get("af");
        item(
            out,
            "AF stripes",
            &text_of(af.and_then(|a| a.get("stripes"))),
        );
        item(out, "AF hash", &text_of(af.and_then(|a| a.get("hash"))));
        let area_field = |f: &str| format!("{} [bytes]", text_of(area.and_then(|a| a.get(f))));
        item(out, "Area offset", &area_field("offset"));
        item(out, "Area length", &area_field("size"));
        let digest = digest_of_keyslot(digests, id).map_or("(none)".into(), printable);
        item(out, "Digest ID", &digest);
    }
}

fn dump_kdf(out: &mut String, kdf: Option<&Value>) {
    let field = |f: &str| kdf.and_then(|k| k.get(f));
    item(out, "PBKDF", &text_of(field("type")));
    if field("type").and_then(Value::as_str) == Some("pbkdf2") {
        item(out, "Hash", &text_of(field("hash")));
        item(out, "Iterations", &text_of(field("iterations")));
    } else {
        item(out, "Time cost", &text_of(field("time")));
        item(out, "Memory", &text_of(field("memory")));
        item(out, "Threads", &text_of(field("cpus")));
    }
    b64_item(out, "Salt", field("salt"));
}

fn dump_tokens(out: &mut String, tokens: Option<&Value>) {
    out.push_str("Tokens:\n");
    for (id, t) in numbered(tokens) {
        let _ = writeln!(out, "  {}: {}", printable(id), text_of(t.get("type")));
        if let Some(Value::Array(ks)) = t.get("keyslots") {
            for k in ks {
                item(out, "Keyslot", &text_of(Some(k)));
            }
        }
        if t.get("type").and_then(Value::as_str) == Some(INTEGRITY_TOKEN) {
            dump_integrity_token(out, t);
        }
    }
}

/// The geometry an `iopages-integrity` token carries.
fn dump_integrity_token(out: &mut String, t: &Map<String, Value>) {
    let bytes = |f: &str| format!("{} [bytes]", text_of(t.get(f)));
    item(out, "MAC", &text_of(t.get("mac")));
    item(out, "Data blocks", &text_of(t.get("data_blocks")));
    item(out, "Block size", &bytes("block_size"));
    item(out, "Area offset", &bytes("area_offset"));
    item(out, "Area length", &bytes("area_size"));
}

fn dump_digests(out: &mut String, digests: Option<&Value>) {
    out.push_str("Digests:\n");
    for (id, d) in numbered(digests) {
        let _ = writeln!(out, "  {}: {}", printable(id), text_of(d.get("type")));
        item(out, "Hash", &text_of(d.get("hash")));
        item(out, "Iterations", &text_of(d.get("iterations")));
        b64_item(out, "Salt", d.get("salt"));
        b64_item(out, "Digest", d.get("digest"));
    }
}
