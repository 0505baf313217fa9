//! LUKS2: two binary headers with JSON metadata (LUKS2 On-Disk Format
//! Specification, cryptsetup `docs/on-disk-format-luks2.pdf`), and the
//! default layout cryptsetup gives new volumes.
//!
//! Owns: the 4096-byte binary header (encode, decode, checksum), finding
//! and choosing a valid header copy (primary at 0, secondary at
//! `hdr_size`; when the primary is damaged the secondary is searched for
//! at every offset the spec allows), the JSON metadata's `keyslots`,
//! `segments`, `digests` and `config` objects, checked field by field into
//! a slot plan, and formatting. Must never: use metadata whose checksum
//! does not match, trust a JSON number or string before checking its type
//! and range, or panic on any JSON (every shape is matched, never
//! indexed).
//!
//! Binary header (big-endian): `magic[6]` ("LUKS\xba\xbe", secondary
//! "SKUL\xba\xbe") `version:u16 hdr_size:u64 seqid:u64 label[48]
//! checksum_alg[32] salt[64] uuid[40] subsystem[48] hdr_offset:u64
//! _pad[184] csum[64] _pad[7×512]`. The checksum is `checksum_alg` over
//! the whole `hdr_size` bytes (binary header and JSON area) with `csum`
//! zeroed. The JSON text follows at byte 4096, NUL-terminated.

use super::integrity_meta::{self, IntegrityInfo, SegmentView, INTEGRITY_REQUIREMENT};
use super::kdf::{Hash, KdfCosts, Pbkdf};
use super::{
    af, check_device_size, formatted_volume, kdf, random, random_master_key, random_uuid, round_up,
    seal_keyslot, Dev, Digest, FormatOptions, KeyslotInfo, LuksError, LuksInfo, LuksVersion,
    LuksVolume, Parsed, SlotPlan, CIPHER_SPEC, DIGEST_ITERATIONS, MAGIC,
};
use crate::integrity::Mac;
use base64::Engine as _;
use serde_json::{json, Map, Value};

/// Secondary header magic.
pub const MAGIC_SECONDARY: [u8; 6] = [b'S', b'K', b'U', b'L', 0xba, 0xbe];
/// Binary header length.
pub const BIN_HEADER_BYTES: usize = 4096;
/// The header-area sizes the spec allows (binary header + JSON area); the
/// secondary copy sits at one of these offsets.
pub const HDR_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
/// Header-area size [`format()`] writes (cryptsetup's default).
pub const FORMAT_HDR_SIZE: u64 = 16 << 10;
/// Where [`format()`] puts keyslot 0's area: after both header copies.
pub const FORMAT_KEYSLOTS_OFFSET: u64 = 2 * FORMAT_HDR_SIZE;
/// Where `luks::format` puts the data segment (cryptsetup's default 16 MiB).
pub const FORMAT_DATA_OFFSET: u64 = 16 << 20;
/// Keyslot areas are aligned to 4 KiB.
pub(super) const AREA_ALIGN: u64 = 4096;

const OFF_VERSION: usize = 6;
const OFF_HDR_SIZE: usize = 8;
const OFF_SEQID: usize = 16;
const OFF_LABEL: usize = 24;
const OFF_CSUM_ALG: usize = 72;
const OFF_SALT: usize = 104;
const OFF_UUID: usize = 168;
const OFF_SUBSYSTEM: usize = 208;
const OFF_HDR_OFFSET: usize = 256;
const OFF_CSUM: usize = 448;
const CSUM_BYTES: usize = 64;

/// One LUKS2 binary header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BinHeader {
    pub secondary: bool,
    pub hdr_size: u64,
    pub seqid: u64,
    pub label: String,
    pub checksum_alg: String,
    pub salt: [u8; 64],
    pub uuid: String,
    pub subsystem: String,
    pub hdr_offset: u64,
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

fn text(b: &[u8], at: usize, len: usize, what: &str) -> Result<String, LuksError> {
    let field = &b[at..at + len];
    let end = field.iter().position(|&c| c == 0).unwrap_or(len);
    std::str::from_utf8(&field[..end])
        .map(str::to_string)
        .map_err(|_| LuksError::Corrupt(format!("{what} field is not UTF-8 text")))
}

fn put_text(b: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len - 1);
    b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

/// The checksum of a header area whose `csum` field is zeroed, or an error
/// naming an algorithm this crate does not compute.
fn checksum(alg: &str, area: &[u8]) -> Result<([u8; 64], usize), LuksError> {
    let hash = Hash::from_name(alg).ok_or_else(|| {
        LuksError::Unsupported(format!("LUKS2 header checksum algorithm {alg:?}"))
    })?;
    let mut out = [0u8; 64];
    hash.digest_into(&[area], &mut out);
    Ok((out, hash.digest_len()))
}

impl BinHeader {
    /// The whole header area: this binary header, `json` (NUL-padded to
    /// `hdr_size - 4096`) and the checksum.
    pub fn encode(&self, json: &[u8]) -> Result<Vec<u8>, LuksError> {
        let size = self.hdr_size as usize;
        if json.len() >= size - BIN_HEADER_BYTES {
            return Err(LuksError::InvalidOptions(format!(
                "LUKS2 metadata of {} bytes does not fit the {}-byte JSON area",
                json.len(),
                size - BIN_HEADER_BYTES
            )));
        }
        let mut b = vec![0u8; size];
        b[..6].copy_from_slice(if self.secondary {
            &MAGIC_SECONDARY
        } else {
            &MAGIC
        });
        b[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&2u16.to_be_bytes());
        b[OFF_HDR_SIZE..OFF_HDR_SIZE + 8].copy_from_slice(&self.hdr_size.to_be_bytes());
        b[OFF_SEQID..OFF_SEQID + 8].copy_from_slice(&self.seqid.to_be_bytes());
        put_text(&mut b, OFF_LABEL, 48, &self.label);
        put_text(&mut b, OFF_CSUM_ALG, 32, &self.checksum_alg);
        b[OFF_SALT..OFF_SALT + 64].copy_from_slice(&self.salt);
        put_text(&mut b, OFF_UUID, 40, &self.uuid);
        put_text(&mut b, OFF_SUBSYSTEM, 48, &self.subsystem);
        b[OFF_HDR_OFFSET..OFF_HDR_OFFSET + 8].copy_from_slice(&self.hdr_offset.to_be_bytes());
        b[BIN_HEADER_BYTES..BIN_HEADER_BYTES + json.len()].copy_from_slice(json);
        let (sum, n) = checksum(&self.checksum_alg, &b)?;
        b[OFF_CSUM..OFF_CSUM + n].copy_from_slice(&sum[..n]);
        Ok(b)
    }
}

/// Read and check the header copy at `offset`: magic, version, size,
/// offset, checksum, the JSON area's framing, and the metadata rules
/// cryptsetup checks before it uses a copy ([`validate`]). A copy that
/// fails any of them is not used (the other copy may be).
fn read_copy(
    dev: &Dev<'_>,
    offset: u64,
    secondary: bool,
    max_keyslots: usize,
) -> Result<(BinHeader, Value), LuksError> {
    let which = if secondary { "secondary" } else { "primary" };
    let what =
        |m: String| LuksError::Corrupt(format!("LUKS2 {which} header at offset {offset}: {m}"));
    let mut b = vec![0u8; BIN_HEADER_BYTES];
    dev.read_at(offset, &mut b)?;
    let (hdr_size, hdr_offset) = check_fixed_fields(&b, offset, secondary, &what)?;
    let checksum_alg = text(&b, OFF_CSUM_ALG, 32, "checksum_alg")?;
    let area = read_checked_area(dev, &b, (offset, hdr_size), &checksum_alg, &what)?;
    let json = json_text(&area[BIN_HEADER_BYTES..]).map_err(what)?;
    let header = BinHeader {
        secondary,
        hdr_size,
        seqid: be64(&b, OFF_SEQID),
        label: text(&b, OFF_LABEL, 48, "label")?,
        checksum_alg,
        salt: {
            let mut s = [0u8; 64];
            s.copy_from_slice(&b[OFF_SALT..OFF_SALT + 64]);
            s
        },
        uuid: text(&b, OFF_UUID, 40, "uuid")?,
        subsystem: text(&b, OFF_SUBSYSTEM, 48, "subsystem")?,
        hdr_offset,
    };
    validate(&json, hdr_size, max_keyslots).map_err(|e| match e {
        LuksError::Corrupt(m) => what(m.strip_prefix("LUKS2 ").unwrap_or(&m).to_string()),
        other => other,
    })?;
    Ok((header, json))
}

/// The fixed fields of the binary header `b` read at `offset`: magic,
/// version, a size the spec allows (the secondary's equal to its offset)
/// and the offset it says it lives at; `what` words a refusal.
/// **Returns:** `hdr_size` and `hdr_offset`.
fn check_fixed_fields(
    b: &[u8],
    offset: u64,
    secondary: bool,
    what: &dyn Fn(String) -> LuksError,
) -> Result<(u64, u64), LuksError> {
    let magic = if secondary { MAGIC_SECONDARY } else { MAGIC };
    if b[..6] != magic {
        return Err(what(format!(
            "bad magic {:02x?} (expected {:02x?})",
            &b[..6],
            magic
        )));
    }
    let version = u16::from_be_bytes([b[OFF_VERSION], b[OFF_VERSION + 1]]);
    if version != 2 {
        return Err(what(format!("version {version} where 2 was expected")));
    }
    let hdr_size = be64(b, OFF_HDR_SIZE);
    if !HDR_SIZES.contains(&hdr_size) {
        return Err(what(format!(
            "header size {hdr_size} is not one the spec allows (16 KiB to 4 MiB, a power of two)"
        )));
    }
    if secondary && hdr_size != offset {
        return Err(what(format!(
            "header size {hdr_size} does not match its offset (the secondary copy sits right \
             after a primary of the same size)"
        )));
    }
    let hdr_offset = be64(b, OFF_HDR_OFFSET);
    if hdr_offset != offset {
        return Err(what(format!("it says it lives at offset {hdr_offset}")));
    }
    Ok((hdr_size, hdr_offset))
}

/// The whole header area of the copy at `offset` (`hdr_size` bytes, its
/// binary header `b` first), its checksum with `checksum_alg` checked
/// against the stored one; `what` words a mismatch.
fn read_checked_area(
    dev: &Dev<'_>,
    b: &[u8],
    (offset, hdr_size): (u64, u64),
    checksum_alg: &str,
    what: &dyn Fn(String) -> LuksError,
) -> Result<Vec<u8>, LuksError> {
    let mut area = vec![0u8; hdr_size as usize];
    area[..BIN_HEADER_BYTES].copy_from_slice(b);
    dev.read_at(
        offset + BIN_HEADER_BYTES as u64,
        &mut area[BIN_HEADER_BYTES..],
    )?;
    let mut stored = [0u8; CSUM_BYTES];
    stored.copy_from_slice(&area[OFF_CSUM..OFF_CSUM + CSUM_BYTES]);
    area[OFF_CSUM..OFF_CSUM + CSUM_BYTES].fill(0);
    let (sum, n) = checksum(checksum_alg, &area)?;
    if sum[..n] != stored[..n] {
        return Err(what(format!(
            "bad checksum ({checksum_alg} over the {hdr_size}-byte header area does not match)"
        )));
    }
    Ok(area)
}

/// The JSON area's framing, as cryptsetup reads it: the text starts at
/// the area's first byte with `{`, is one JSON object, and every byte
/// after it to the end of the area is zero (so the text is
/// NUL-terminated and nothing hides behind it).
fn json_text(json_area: &[u8]) -> Result<Value, String> {
    let first = json_area.first().copied().unwrap_or(0);
    if first != b'{' {
        return Err(format!(
            "the JSON area starts with byte 0x{first:02x}: the metadata must start at its first \
             byte with '{{'"
        ));
    }
    let nul = json_area
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| "the JSON area is not NUL-terminated".to_string())?;
    let mut stream = serde_json::Deserializer::from_slice(&json_area[..nul]).into_iter::<Value>();
    let json = match stream.next() {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Err(format!("bad JSON: {e}")),
        None => return Err("bad JSON: empty".to_string()),
    };
    let end = stream.byte_offset();
    if let Some(p) = json_area[end..].iter().position(|&c| c != 0) {
        return Err(format!(
            "byte 0x{:02x} at offset {} of the JSON area, after the JSON text (which ends at \
             {end}): every byte after the JSON text must be zero",
            json_area[end + p],
            end + p
        ));
    }
    Ok(json)
}

/// What the primary header area holds when it is not a LUKS2 header:
/// other formats' signatures, each named with its offset (empty when
/// there is none: a merely damaged or wiped primary). The probes are
/// blkid's magics for the formats that replace a LUKS volume most often.
fn foreign_signatures(dev: &Dev<'_>) -> Vec<String> {
    let rd = |off: u64, len: usize| -> Option<Vec<u8>> {
        let mut b = vec![0u8; len];
        dev.read_at(off, &mut b).ok().map(|()| b)
    };
    let is = |off: u64, magic: &[u8]| rd(off, magic.len()).is_some_and(|b| b == magic);
    let mut found = Vec::new();
    let head = rd(0, 8).unwrap_or_default();
    // A damaged LUKS2 primary keeps its magic; its first 512 bytes are
    // header fields and checksum, not another format's boot sector.
    let luks2_primary = head.len() == 8 && head[..6] == MAGIC && head[6..8] == [0, 2];
    if head.len() == 8 && head[..6] == MAGIC && head[6..8] == [0, 1] {
        found.push("a LUKS1 header (\"LUKS\\xba\\xbe\" version 1 at offset 0)".to_string());
    }
    if is(0, b"XFSB") {
        found.push("an XFS superblock (\"XFSB\" at offset 0)".to_string());
    }
    lvm_labels(&rd, &mut found);
    if is(1024 + 56, &[0x53, 0xef]) {
        found.push("an ext2/ext3/ext4 superblock (magic 0xEF53 at offset 1080)".to_string());
    }
    swap_signatures(&is, &mut found);
    if is(65536 + 64, b"_BHRfS_M") {
        found.push("a btrfs superblock (\"_BHRfS_M\" at offset 65600)".to_string());
    }
    md_superblocks(&is, dev.size(), &mut found);
    if is(512, b"EFI PART") {
        found.push("a GPT partition table (\"EFI PART\" at offset 512)".to_string());
    }
    if !luks2_primary {
        boot_sectors(&is, &mut found);
    }
    found
}

/// LVM2 physical volume labels in the first four sectors.
fn lvm_labels(rd: &dyn Fn(u64, usize) -> Option<Vec<u8>>, found: &mut Vec<String>) {
    for sector in 0..4u64 {
        let at = sector * 512;
        if let Some(b) = rd(at, 32) {
            if &b[..8] == b"LABELONE" && &b[24..32] == b"LVM2 001" {
                found.push(format!(
                    "an LVM2 physical volume label (\"LABELONE\" at offset {at}, type \"LVM2 001\" \
                     at offset {})",
                    at + 24
                ));
            }
        }
    }
}

/// Swap signatures at the end of the first page, for the page sizes
/// Linux uses.
fn swap_signatures(is: &dyn Fn(u64, &[u8]) -> bool, found: &mut Vec<String>) {
    for page in [4096u64, 8192, 16384, 65536] {
        for magic in [&b"SWAPSPACE2"[..], b"SWAP-SPACE"] {
            if is(page - 10, magic) {
                found.push(format!(
                    "a swap signature (\"{}\" at offset {})",
                    String::from_utf8_lossy(magic),
                    page - 10
                ));
            }
        }
    }
}

/// MD RAID superblocks of every version, at the start or the end of a
/// device of `size` bytes.
fn md_superblocks(is: &dyn Fn(u64, &[u8]) -> bool, size: u64, found: &mut Vec<String>) {
    const MD_MAGIC: [u8; 4] = [0xfc, 0x4e, 0x2b, 0xa9];
    let mut md = vec![(0u64, "1.1"), (4096, "1.2")];
    if size >= 65536 * 2 {
        md.push(((size & !65535) - 65536, "0.90"));
    }
    if size >= 8192 * 2 {
        md.push(((size - 8192) & !4095, "1.0"));
    }
    for (at, v) in md {
        if is(at, &MD_MAGIC) {
            found.push(format!(
                "an MD RAID superblock (version {v}, magic 0xa92b4efc at offset {at})"
            ));
        }
    }
}

/// Boot sectors in the first 512 bytes: NTFS, FAT, or a DOS/MBR boot
/// signature.
fn boot_sectors(is: &dyn Fn(u64, &[u8]) -> bool, found: &mut Vec<String>) {
    if is(3, b"NTFS    ") {
        found.push("an NTFS boot sector (\"NTFS\" at offset 3)".to_string());
    }
    if is(510, &[0x55, 0xaa]) {
        let fat = is(82, b"FAT32") || is(54, b"FAT12") || is(54, b"FAT16") || is(54, b"FAT  ");
        found.push(if fat {
            "a FAT filesystem boot sector (0x55AA at offset 510, \"FAT\" type)".to_string()
        } else {
            "a DOS/MBR boot signature (0x55AA at offset 510: a partition table or boot \
             sector)"
                .to_string()
        });
    }
}

/// Find the header copy to use. Returns it, its JSON, and whether it is
/// the secondary. The secondary is used when it is newer, or when the
/// primary is unusable and its area carries no other format's signature
/// (or `allow_secondary_header` says to use it anyway).
pub(crate) fn load(
    dev: &Dev<'_>,
    max_keyslots: usize,
    allow_secondary_header: bool,
) -> Result<(BinHeader, Value, bool), LuksError> {
    let primary = read_copy(dev, 0, false, max_keyslots);
    let offsets: Vec<u64> = match &primary {
        Ok((h, _)) => vec![h.hdr_size],
        Err(_) => HDR_SIZES.to_vec(),
    };
    let mut secondary = None;
    let mut secondary_error = None;
    for off in offsets {
        let mut magic = [0u8; 6];
        if dev.read_at(off, &mut magic).is_err() || magic != MAGIC_SECONDARY {
            continue;
        }
        match read_copy(dev, off, true, max_keyslots) {
            Ok(s) => {
                secondary = Some(s);
                break;
            }
            Err(e) => {
                secondary_error.get_or_insert(e);
            }
        }
    }
    match (primary, secondary) {
        (Ok((p, pj)), Some((s, sj))) => {
            if s.seqid > p.seqid {
                Ok((s, sj, true))
            } else {
                Ok((p, pj, false))
            }
        }
        (Ok((p, pj)), None) => Ok((p, pj, false)),
        (Err(pe), Some((s, sj))) => {
            let found = foreign_signatures(dev);
            if found.is_empty() || allow_secondary_header {
                return Ok((s, sj, true));
            }
            Err(LuksError::AmbiguousSignatures(format!(
                "the LUKS2 primary header is not usable ({pe}) and the primary header area now \
                 holds {}: the device was probably reformatted. Not falling back to the old \
                 LUKS2 secondary header at offset {} (cryptsetup refuses too: \"Device contains \
                 ambiguous signatures, cannot auto-recover LUKS2\"): writing through it would \
                 overwrite the other format's data. To use the LUKS2 volume on purpose, open it \
                 with LuksOpenOptions::allow_secondary_header, or remove the other signature \
                 (wipefs) and let `cryptsetup repair` rewrite the primary header from the \
                 secondary",
                found.join(" and "),
                s.hdr_offset
            )))
        }
        (Err(LuksError::Corrupt(m)), None) => {
            let second = match secondary_error {
                Some(LuksError::Corrupt(m2)) => m2,
                Some(e) => format!("secondary header: {e}"),
                None => "no LUKS2 secondary header found either".to_string(),
            };
            Err(LuksError::Corrupt(format!("{m}; {second}")))
        }
        (Err(e), None) => Err(e),
    }
}

/// Read, choose and plan the LUKS2 header of `dev`; a device too short
/// for both header copies and the whole keyslots area is refused.
pub(crate) fn parse(
    dev: &Dev<'_>,
    max_keyslots: usize,
    allow_secondary_header: bool,
) -> Result<Parsed, LuksError> {
    let (h, json, used_secondary) = load(dev, max_keyslots, allow_secondary_header)?;
    let parsed = plan(&h, &json, used_secondary, max_keyslots)?;
    // validate() checked that keyslots_size is a number of at most 128 MiB.
    let keyslots_size = json
        .get("config")
        .and_then(|c| c.get("keyslots_size"))
        .and_then(Value::as_str)
        .and_then(decimal)
        .unwrap_or(0);
    let needed = 2 * h.hdr_size + keyslots_size;
    if dev.size() < needed {
        return Err(LuksError::Truncated {
            needed,
            have: dev.size(),
        });
    }
    Ok(parsed)
}

// ---- cryptsetup's metadata rules (LUKS2_hdr_validate) ----------------

/// Largest `config.keyslots_size` cryptsetup accepts (128 MiB).
const MAX_KEYSLOTS_SIZE: u64 = 128 << 20;

/// A decimal number as the spec writes offsets and sizes: ASCII digits
/// only (no sign, no space), within u64.
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// An object key that must be a number ("0", "1"...): digits only, no
/// leading zero.
fn numbered(key: &str, section: &str) -> Result<u32, LuksError> {
    let ok = decimal(key).is_some() && (key == "0" || !key.starts_with('0'));
    match key.parse::<u32>() {
        Ok(n) if ok => Ok(n),
        _ => Err(corrupt(
            section,
            &format!("has a key {key:?} that is not a number (0, 1, 2...)"),
        )),
    }
}

/// `m[key]` is an array of strings, each naming a member of `section`.
fn refs(
    m: &Map<String, Value>,
    key: &str,
    path: &str,
    section: &Map<String, Value>,
    section_name: &str,
) -> Result<(), LuksError> {
    let p = format!("{path}.{key}");
    let arr = field(m, key, path)?
        .as_array()
        .ok_or_else(|| corrupt(&p, "is not an array"))?;
    for (i, v) in arr.iter().enumerate() {
        let name = v
            .as_str()
            .ok_or_else(|| corrupt(&format!("{p}[{i}]"), &format!("{v} is not a string")))?;
        if !section.get(name).is_some_and(Value::is_object) {
            return Err(corrupt(
                &format!("{p}[{i}]"),
                &format!("names {section_name} {name:?}, which does not exist"),
            ));
        }
    }
    Ok(())
}

/// An optional member that, when present, is an array of strings.
fn string_array_opt(m: &Map<String, Value>, key: &str, path: &str) -> Result<(), LuksError> {
    let Some(v) = m.get(key) else {
        return Ok(());
    };
    let p = format!("{path}.{key}");
    let arr = v.as_array().ok_or_else(|| corrupt(&p, "is not an array"))?;
    for (i, x) in arr.iter().enumerate() {
        if !x.is_string() {
            return Err(corrupt(
                &p,
                &format!("holds something that is not a string ({x} at index {i})"),
            ));
        }
    }
    Ok(())
}

/// Whether `digests` lists `name` under `member` (`keyslots`,
/// `segments`), and how many do.
fn listing(digests: &Map<String, Value>, member: &str, name: &str) -> usize {
    digests
        .values()
        .filter(|d| {
            d.get(member)
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(name)))
        })
        .count()
}

/// The metadata rules cryptsetup checks on a header copy before it uses
/// it (its `LUKS2_hdr_validate` and the keyslot validation after it):
/// section shapes, numbered keys, references between sections, segment
/// offsets and sizes, `config` (json_size, keyslots_size), and keyslot
/// areas inside the keyslots area without overlap. What a valid header
/// may hold that this crate does not implement (ciphers, KDFs, segment
/// types...) is left to [`plan`]. More than `max_keyslots` keyslots is
/// refused first, before any is looked at.
pub(super) fn validate(json: &Value, hdr_size: u64, max_keyslots: usize) -> Result<(), LuksError> {
    let root = obj(json, "the top level")?;
    let keyslots = obj(field(root, "keyslots", "")?, "keyslots")?;
    check_keyslot_count(keyslots.len(), max_keyslots)?;
    let tokens = obj(field(root, "tokens", "")?, "tokens")?;
    let digests = obj(field(root, "digests", "")?, "digests")?;
    let segments = obj(field(root, "segments", "")?, "segments")?;
    let config = obj(field(root, "config", "")?, "config")?;

    validate_tokens(tokens, keyslots)?;
    validate_digests(digests, keyslots, segments)?;
    let data_offset = validate_segments(segments, digests)?;
    validate_keyslots(keyslots, digests)?;
    let keyslots_size = validate_config(config, hdr_size, data_offset)?;
    validate_keyslot_areas(keyslots, hdr_size, keyslots_size)
}

/// `tokens`: numbered, each with a `type` and the keyslots it names.
fn validate_tokens(
    tokens: &Map<String, Value>,
    keyslots: &Map<String, Value>,
) -> Result<(), LuksError> {
    for (key, t) in tokens {
        numbered(key, "tokens")?;
        let path = format!("tokens.{key}");
        let t = obj(t, &path)?;
        str_of(t, "type", &path)?;
        refs(t, "keyslots", &path, keyslots, "keyslot")?;
    }
    Ok(())
}

/// `digests`: numbered, each with a `type` and the keyslots and segments
/// it names.
fn validate_digests(
    digests: &Map<String, Value>,
    keyslots: &Map<String, Value>,
    segments: &Map<String, Value>,
) -> Result<(), LuksError> {
    for (key, d) in digests {
        numbered(key, "digests")?;
        let path = format!("digests.{key}");
        let d = obj(d, &path)?;
        str_of(d, "type", &path)?;
        refs(d, "keyslots", &path, keyslots, "keyslot")?;
        refs(d, "segments", &path, segments, "segment")?;
    }
    Ok(())
}

/// `segments`: not empty, every segment checked ([`validate_segment`]).
/// **Returns:** the lowest crypt segment offset; 0 (a detached header)
/// ends the search, as in cryptsetup.
fn validate_segments(
    segments: &Map<String, Value>,
    digests: &Map<String, Value>,
) -> Result<Option<u64>, LuksError> {
    if segments.is_empty() {
        return Err(corrupt("segments", "is empty: no data segment"));
    }
    let mut data_offset: Option<u64> = None;
    for (key, s) in segments {
        if let Some(offset) = validate_segment(key, s, digests)? {
            if data_offset != Some(0) {
                data_offset = Some(data_offset.map_or(offset, |o| o.min(offset)));
            }
        }
    }
    Ok(data_offset)
}

/// One segment: a numbered key, its type, a sector-aligned offset, a
/// `size` that is `"dynamic"` or a positive multiple of 512, string
/// `flags`; a crypt segment's fields too ([`validate_crypt_segment`]).
/// **Returns:** a crypt segment's offset; `None` for other types.
fn validate_segment(
    key: &str,
    s: &Value,
    digests: &Map<String, Value>,
) -> Result<Option<u64>, LuksError> {
    numbered(key, "segments")?;
    let path = format!("segments.{key}");
    let s = obj(s, &path)?;
    let ty = str_of(s, "type", &path)?;
    let offset = u64_str(s, "offset", &path)?;
    let size = match str_of(s, "size", &path)? {
        "dynamic" => None,
        _ => Some(u64_str(s, "size", &path)?),
    };
    if !offset.is_multiple_of(512) {
        return Err(corrupt(
            &format!("{path}.offset"),
            &format!("{offset} is not aligned to 512-byte sectors"),
        ));
    }
    if let Some(size) = size {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(corrupt(
                &format!("{path}.size"),
                &format!("{size} is not a positive multiple of 512 bytes"),
            ));
        }
    }
    string_array_opt(s, "flags", &path)?;
    if ty != "crypt" {
        return Ok(None);
    }
    validate_crypt_segment(s, &path, size)?;
    if listing(digests, "segments", key) == 0 {
        return Err(corrupt(&path, "is not assigned to any digest"));
    }
    Ok(Some(offset))
}

/// A crypt segment's own fields: a decimal `iv_tweak`, an `encryption`, a
/// `sector_size` that is a positive multiple of 512 and divides a fixed
/// `size`.
fn validate_crypt_segment(
    s: &Map<String, Value>,
    path: &str,
    size: Option<u64>,
) -> Result<(), LuksError> {
    let tweak = str_of(s, "iv_tweak", path)?;
    if decimal(tweak).is_none() {
        return Err(corrupt(
            &format!("{path}.iv_tweak"),
            &format!("{tweak:?} is not a decimal number"),
        ));
    }
    str_of(s, "encryption", path)?;
    let sector = num_u32(s, "sector_size", path)?;
    if sector == 0 || !sector.is_multiple_of(512) {
        return Err(corrupt(
            &format!("{path}.sector_size"),
            &format!("{sector} is not a positive multiple of 512"),
        ));
    }
    if let Some(size) = size {
        if !size.is_multiple_of(u64::from(sector)) {
            return Err(corrupt(
                &format!("{path}.size"),
                &format!("{size} is not a multiple of the {sector}-byte sector size"),
            ));
        }
    }
    Ok(())
}

/// `keyslots`: numbered, each with a `type` and a `key_size`; a `luks2`
/// keyslot's `kdf`, `af` and `area` shapes too, and exactly one digest.
fn validate_keyslots(
    keyslots: &Map<String, Value>,
    digests: &Map<String, Value>,
) -> Result<(), LuksError> {
    for (key, k) in keyslots {
        numbered(key, "keyslots")?;
        let path = format!("keyslots.{key}");
        let k = obj(k, &path)?;
        let ty = str_of(k, "type", &path)?;
        num_u32(k, "key_size", &path)?;
        if ty != "luks2" {
            continue;
        }
        validate_keyslot_kdf(k, &path)?;
        validate_keyslot_af(k, &path)?;
        validate_keyslot_area_shape(k, &path)?;
        let n = listing(digests, "keyslots", key);
        if n != 1 {
            return Err(corrupt(
                &path,
                &format!("is assigned to {n} digests: a keyslot belongs to exactly one digest"),
            ));
        }
    }
    Ok(())
}

/// A `luks2` keyslot's `kdf`: a `type`, and the fields of a PBKDF2 or
/// Argon2 KDF (other types are left to [`plan`]).
fn validate_keyslot_kdf(k: &Map<String, Value>, path: &str) -> Result<(), LuksError> {
    let kdf_path = format!("{path}.kdf");
    let kdf = obj(field(k, "kdf", path)?, &kdf_path)?;
    match str_of(kdf, "type", &kdf_path)? {
        "pbkdf2" => {
            str_of(kdf, "hash", &kdf_path)?;
            num_u32(kdf, "iterations", &kdf_path)?;
            str_of(kdf, "salt", &kdf_path)?;
        }
        "argon2i" | "argon2id" => {
            num_u32(kdf, "time", &kdf_path)?;
            num_u32(kdf, "memory", &kdf_path)?;
            num_u32(kdf, "cpus", &kdf_path)?;
            str_of(kdf, "salt", &kdf_path)?;
        }
        _ => {}
    }
    Ok(())
}

/// A `luks2` keyslot's `af`: type `"luks1"`, a `hash` and `stripes`.
fn validate_keyslot_af(k: &Map<String, Value>, path: &str) -> Result<(), LuksError> {
    let af_path = format!("{path}.af");
    let af = obj(field(k, "af", path)?, &af_path)?;
    let af_ty = str_of(af, "type", &af_path)?;
    if af_ty != "luks1" {
        return Err(corrupt(
            &format!("{af_path}.type"),
            &format!("{af_ty:?} is not an AF type (only \"luks1\" exists)"),
        ));
    }
    str_of(af, "hash", &af_path)?;
    num_u32(af, "stripes", &af_path)?;
    Ok(())
}

/// A `luks2` keyslot's `area`: type `"raw"`, an `encryption` and a
/// `key_size` (where it lies is [`validate_keyslot_areas`]' check).
fn validate_keyslot_area_shape(k: &Map<String, Value>, path: &str) -> Result<(), LuksError> {
    let area_path = format!("{path}.area");
    let area = obj(field(k, "area", path)?, &area_path)?;
    let area_ty = str_of(area, "type", &area_path)?;
    if area_ty != "raw" {
        return Err(corrupt(
            &format!("{area_path}.type"),
            &format!("{area_ty:?} is not a luks2 keyslot area type (only \"raw\")"),
        ));
    }
    str_of(area, "encryption", &area_path)?;
    num_u32(area, "key_size", &area_path)?;
    Ok(())
}

/// `config`: `json_size` matching `hdr_size`, a `keyslots_size` that is a
/// multiple of 4096 (at most `MAX_KEYSLOTS_SIZE`) and ends before the
/// data segment at `data_offset`, string `flags` and
/// `requirements.mandatory`.
/// **Returns:** `keyslots_size`.
fn validate_config(
    config: &Map<String, Value>,
    hdr_size: u64,
    data_offset: Option<u64>,
) -> Result<u64, LuksError> {
    let json_size = u64_str(config, "json_size", "config")?;
    if json_size != hdr_size - BIN_HEADER_BYTES as u64 {
        return Err(corrupt(
            "config.json_size",
            &format!(
                "{json_size} does not match the binary header's hdr_size {hdr_size} (json_size \
                 must be hdr_size - 4096 = {})",
                hdr_size - BIN_HEADER_BYTES as u64
            ),
        ));
    }
    let keyslots_size = u64_str(config, "keyslots_size", "config")?;
    if !keyslots_size.is_multiple_of(4096) || keyslots_size > MAX_KEYSLOTS_SIZE {
        return Err(corrupt(
            "config.keyslots_size",
            &format!(
                "{keyslots_size} is not a multiple of 4096 bytes of at most {MAX_KEYSLOTS_SIZE}"
            ),
        ));
    }
    let areas_start = 2 * hdr_size;
    let areas_end = areas_start + keyslots_size;
    if let Some(off) = data_offset.filter(|&o| o != 0) {
        if off < areas_end {
            return Err(corrupt(
                "config.keyslots_size",
                &format!(
                    "{keyslots_size}: the keyslots area [{areas_start}, {areas_end}) after the two \
                     {hdr_size}-byte header copies runs past the data segment at offset {off}"
                ),
            ));
        }
    }
    string_array_opt(config, "flags", "config")?;
    if let Some(req) = config.get("requirements") {
        let req = obj(req, "config.requirements")?;
        string_array_opt(req, "mandatory", "config.requirements")?;
    }
    Ok(keyslots_size)
}

/// Keyslot areas: inside [2 × hdr_size, 2 × hdr_size + keyslots_size),
/// not empty, not overlapping.
fn validate_keyslot_areas(
    keyslots: &Map<String, Value>,
    hdr_size: u64,
    keyslots_size: u64,
) -> Result<(), LuksError> {
    let mut areas = Vec::with_capacity(keyslots.len());
    for (key, k) in keyslots {
        let (offset, end) = keyslot_area_extent(key, k, hdr_size, keyslots_size)?;
        areas.push((offset, end, key.as_str()));
    }
    areas.sort_unstable();
    for w in areas.windows(2) {
        let ((a0, a1, ak), (b0, b1, bk)) = (w[0], w[1]);
        if b0 < a1 {
            return Err(corrupt(
                &format!("keyslots.{ak}.area"),
                &format!("[{a0}, {a1}) overlaps keyslots.{bk}.area [{b0}, {b1})"),
            ));
        }
    }
    Ok(())
}

/// One keyslot's area, checked to lie inside the keyslots area and not to
/// be empty. **Returns:** its `[offset, end)`.
fn keyslot_area_extent(
    key: &str,
    k: &Value,
    hdr_size: u64,
    keyslots_size: u64,
) -> Result<(u64, u64), LuksError> {
    let areas_start = 2 * hdr_size;
    let areas_end = areas_start + keyslots_size;
    let path = format!("keyslots.{key}.area");
    let area = obj(
        field(obj(k, &path)?, "area", &format!("keyslots.{key}"))?,
        &path,
    )?;
    let offset = u64_str(area, "offset", &path)?;
    let size = u64_str(area, "size", &path)?;
    if offset < areas_start {
        return Err(corrupt(
            &format!("{path}.offset"),
            &format!(
                "{offset} is inside the two {hdr_size}-byte header copies (the keyslots area \
                 starts at {areas_start})"
            ),
        ));
    }
    if size == 0 {
        return Err(corrupt(
            &format!("{path}.size"),
            "is 0: an area cannot be empty",
        ));
    }
    let end = offset.checked_add(size).ok_or_else(|| {
        corrupt(
            &format!("{path}.size"),
            &format!("{size} at offset {offset}: the area's end overflows"),
        )
    })?;
    if end > areas_end {
        return Err(corrupt(
            &path,
            &format!(
                "[{offset}, {end}) runs past the end of the keyslots area at {areas_end} \
                 (2 × hdr_size {hdr_size} + config.keyslots_size {keyslots_size})"
            ),
        ));
    }
    Ok((offset, end))
}

// ---- JSON access, every shape checked -------------------------------

fn corrupt(path: &str, m: &str) -> LuksError {
    LuksError::Corrupt(format!("LUKS2 metadata: {path} {m}"))
}

pub(super) fn obj<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, LuksError> {
    v.as_object()
        .ok_or_else(|| corrupt(path, "is not an object"))
}

pub(super) fn field<'a>(
    m: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a Value, LuksError> {
    m.get(key).ok_or_else(|| {
        if path.is_empty() {
            corrupt(key, "is missing")
        } else {
            corrupt(&format!("{path}.{key}"), "is missing")
        }
    })
}

fn str_of<'a>(m: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a str, LuksError> {
    field(m, key, path)?
        .as_str()
        .ok_or_else(|| corrupt(&format!("{path}.{key}"), "is not a string"))
}

/// A u64 the spec writes as a decimal string (offsets, sizes).
pub(super) fn u64_str(m: &Map<String, Value>, key: &str, path: &str) -> Result<u64, LuksError> {
    let s = str_of(m, key, path)?;
    decimal(s).ok_or_else(|| {
        corrupt(
            &format!("{path}.{key}"),
            &format!("{s:?} is not a number (decimal digits, at most 2^64 - 1)"),
        )
    })
}

/// A number the spec writes as a JSON integer.
fn num(m: &Map<String, Value>, key: &str, path: &str) -> Result<u64, LuksError> {
    field(m, key, path)?
        .as_u64()
        .ok_or_else(|| corrupt(&format!("{path}.{key}"), "is not a non-negative integer"))
}

fn num_u32(m: &Map<String, Value>, key: &str, path: &str) -> Result<u32, LuksError> {
    u32::try_from(num(m, key, path)?)
        .map_err(|_| corrupt(&format!("{path}.{key}"), "is out of range"))
}

fn b64(m: &Map<String, Value>, key: &str, path: &str) -> Result<Vec<u8>, LuksError> {
    let s = str_of(m, key, path)?;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| corrupt(&format!("{path}.{key}"), &format!("is not base64 ({e})")))
}

fn hash_of(m: &Map<String, Value>, key: &str, path: &str) -> Result<Hash, LuksError> {
    let s = str_of(m, key, path)?;
    Hash::from_name(s).ok_or_else(|| {
        LuksError::UnsupportedKdf(format!(
            "{path}.{key} is {s:?}: only sha1, sha256 and sha512 are supported"
        ))
    })
}

fn id_of(key: &str, path: &str) -> Result<u32, LuksError> {
    numbered(key, path)
}

fn id_list(m: &Map<String, Value>, key: &str, path: &str) -> Result<Vec<u32>, LuksError> {
    let arr = field(m, key, path)?
        .as_array()
        .ok_or_else(|| corrupt(&format!("{path}.{key}"), "is not an array"))?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| corrupt(&format!("{path}.{key}"), "holds a non-string"))
                .and_then(|s| id_of(s, &format!("{path}.{key}")))
        })
        .collect()
}

struct SegmentJson {
    id: u32,
    offset: u64,
    size: Option<u64>,
    iv_tweak: u64,
    sector_size: usize,
}

fn parse_segment(json: &Map<String, Value>, hdr_size: u64) -> Result<SegmentJson, LuksError> {
    let segs = obj(field(json, "segments", "")?, "segments")?;
    if segs.is_empty() {
        return Err(corrupt("segments", "is empty: no data segment"));
    }
    if segs.len() > 1 {
        return Err(LuksError::Unsupported(format!(
            "{} data segments (an interrupted reencryption?); only one is supported",
            segs.len()
        )));
    }
    let (key, v) = segs
        .iter()
        .next()
        .ok_or_else(|| corrupt("segments", "is empty"))?;
    let path = format!("segments.{key}");
    let id = id_of(key, "segments")?;
    let s = obj(v, &path)?;
    let ty = str_of(s, "type", &path)?;
    if ty != "crypt" {
        return Err(LuksError::Unsupported(format!("segment type {ty:?}")));
    }
    if s.contains_key("integrity") {
        return Err(LuksError::Unsupported(
            "LUKS2 integrity protection (dm-integrity)".to_string(),
        ));
    }
    let enc = str_of(s, "encryption", &path)?;
    if enc != CIPHER_SPEC {
        return Err(LuksError::UnsupportedCipher(format!(
            "{enc:?} (LUKS2 {path})"
        )));
    }
    let sector = num(s, "sector_size", &path)?;
    if sector != 512 && sector != 4096 {
        return Err(LuksError::Unsupported(format!(
            "sector size {sector} bytes (only 512 and 4096 are supported)"
        )));
    }
    let offset = u64_str(s, "offset", &path)?;
    // Offset 0 is a detached header (cryptsetup --header): the data lives
    // on another device; the header opens, its payload is elsewhere.
    if offset != 0 && offset < 2 * hdr_size {
        return Err(corrupt(
            &format!("{path}.offset"),
            &format!("{offset} overlaps the two {hdr_size}-byte header copies"),
        ));
    }
    if !offset.is_multiple_of(sector) {
        return Err(corrupt(
            &format!("{path}.offset"),
            &format!("{offset} is not a multiple of the {sector}-byte sector"),
        ));
    }
    let size = match str_of(s, "size", &path)? {
        "dynamic" => None,
        _ => Some(u64_str(s, "size", &path)?),
    };
    Ok(SegmentJson {
        id,
        offset,
        size,
        iv_tweak: u64_str(s, "iv_tweak", &path)?,
        sector_size: sector as usize,
    })
}

struct DigestJson {
    keyslots: Vec<u32>,
    segments: Vec<u32>,
    digest: Result<Digest, LuksError>,
}

fn parse_digests(json: &Map<String, Value>) -> Result<Vec<DigestJson>, LuksError> {
    let ds = obj(field(json, "digests", "")?, "digests")?;
    let mut out = Vec::new();
    for (key, v) in ds {
        let path = format!("digests.{key}");
        id_of(key, "digests")?;
        let d = obj(v, &path)?;
        let keyslots = id_list(d, "keyslots", &path)?;
        let segments = id_list(d, "segments", &path)?;
        let ty = str_of(d, "type", &path)?;
        let digest = if ty != "pbkdf2" {
            Err(LuksError::UnsupportedKdf(format!("{path} has type {ty:?}")))
        } else {
            (|| {
                let value = b64(d, "digest", &path)?;
                if value.is_empty() || value.len() > 64 {
                    return Err(corrupt(&format!("{path}.digest"), "has a bad length"));
                }
                Ok(Digest {
                    field: format!("{path}.iterations"),
                    hash: hash_of(d, "hash", &path)?,
                    iterations: num_u32(d, "iterations", &path)?,
                    salt: b64(d, "salt", &path)?,
                    value,
                })
            })()
        };
        out.push(DigestJson {
            keyslots,
            segments,
            digest,
        });
    }
    Ok(out)
}

fn parse_kdf(k: &Map<String, Value>, path: &str) -> Result<(Pbkdf, Vec<u8>), LuksError> {
    let ty = str_of(k, "type", path)?;
    let pbkdf = match ty {
        "pbkdf2" => Pbkdf::Pbkdf2 {
            hash: hash_of(k, "hash", path)?,
            iterations: num_u32(k, "iterations", path)?,
        },
        "argon2i" | "argon2id" => {
            let time = num_u32(k, "time", path)?;
            let memory_kib = num_u32(k, "memory", path)?;
            let parallel = num_u32(k, "cpus", path)?;
            Pbkdf::argon2(ty, time, memory_kib, parallel)
                .ok_or_else(|| LuksError::UnsupportedKdf(format!("{path}: kdf type {ty}")))?
        }
        other => {
            return Err(LuksError::UnsupportedKdf(format!(
                "{path}.type {other:?} (pbkdf2, argon2i and argon2id are supported)"
            )))
        }
    };
    Ok((pbkdf, b64(k, "salt", path)?))
}

fn key_bytes_ok(n: u64, what: &str) -> Result<usize, LuksError> {
    if n == 32 || n == 64 {
        Ok(n as usize)
    } else {
        Err(LuksError::UnsupportedCipher(format!(
            "aes-xts-plain64 with a {}-bit key ({what})",
            n.saturating_mul(8)
        )))
    }
}

/// One keyslot's plan; `seg` is the data segment, `digests` all digests.
fn plan_keyslot(
    id: u32,
    k: &Map<String, Value>,
    seg: &SegmentJson,
    digests: &[DigestJson],
    hdr_size: u64,
) -> Result<SlotPlan, LuksError> {
    let path = format!("keyslots.{id}");
    let ty = str_of(k, "type", &path)?;
    if ty != "luks2" {
        return Err(LuksError::Unsupported(format!(
            "keyslot {id} of type {ty:?}"
        )));
    }
    let key_bytes = key_bytes_ok(num(k, "key_size", &path)?, &format!("{path}.key_size"))?;
    let (stripes, af_hash) = keyslot_af(k, &path)?;
    let (area_key_bytes, area_offset, area_size) = keyslot_area(k, &path)?;
    let area_len = keyslot_area_len(
        &path,
        (key_bytes, stripes),
        (area_offset, area_size),
        seg.offset,
        hdr_size,
    )?;
    let (pbkdf, salt) = parse_kdf(
        obj(field(k, "kdf", &path)?, &format!("{path}.kdf"))?,
        &format!("{path}.kdf"),
    )?;
    let digest = keyslot_digest(id, &path, seg, digests)?;
    Ok(SlotPlan {
        index: id as usize,
        pbkdf,
        kdf_field: format!("{path}.kdf."),
        salt,
        area_offset,
        area_len,
        area_key_bytes,
        af_hash,
        stripes,
        key_bytes,
        digest,
    })
}

/// The keyslot at `path`'s AF splitter: the `luks1` type only.
/// **Returns:** its stripes and hash.
fn keyslot_af(k: &Map<String, Value>, path: &str) -> Result<(u32, Hash), LuksError> {
    let af_path = format!("{path}.af");
    let afj = obj(field(k, "af", path)?, &af_path)?;
    let af_ty = str_of(afj, "type", &af_path)?;
    if af_ty != "luks1" {
        return Err(LuksError::Unsupported(format!(
            "{af_path}.type {af_ty:?} (only the luks1 AF splitter exists)"
        )));
    }
    let stripes = num_u32(afj, "stripes", &af_path)?;
    let af_hash = hash_of(afj, "hash", &af_path)?;
    Ok((stripes, af_hash))
}

/// The keyslot at `path`'s area: `raw`, encrypted with [`CIPHER_SPEC`].
/// **Returns:** its key length, offset and size.
fn keyslot_area(k: &Map<String, Value>, path: &str) -> Result<(usize, u64, u64), LuksError> {
    let area_path = format!("{path}.area");
    let area = obj(field(k, "area", path)?, &area_path)?;
    let area_ty = str_of(area, "type", &area_path)?;
    if area_ty != "raw" {
        return Err(LuksError::Unsupported(format!(
            "{area_path}.type {area_ty:?} (only raw keyslot areas are supported)"
        )));
    }
    let enc = str_of(area, "encryption", &area_path)?;
    if enc != CIPHER_SPEC {
        return Err(LuksError::UnsupportedCipher(format!(
            "{enc:?} ({area_path}.encryption)"
        )));
    }
    let area_key_bytes = key_bytes_ok(
        num(area, "key_size", &area_path)?,
        &format!("{area_path}.key_size"),
    )?;
    let area_offset = u64_str(area, "offset", &area_path)?;
    let area_size = u64_str(area, "size", &area_path)?;
    Ok((area_key_bytes, area_offset, area_size))
}

/// The length of the AF-split key material of `stripes` stripes of
/// `key_bytes` (whole 512-byte sectors), checked to fit the keyslot's
/// area at `area_offset` of `area_size` bytes, and the area to lie between
/// the header copies and the data at `data_offset`.
fn keyslot_area_len(
    path: &str,
    (key_bytes, stripes): (usize, u32),
    (area_offset, area_size): (u64, u64),
    data_offset: u64,
    hdr_size: u64,
) -> Result<u64, LuksError> {
    let (af_path, area_path) = (format!("{path}.af"), format!("{path}.area"));
    let af_bytes = af::split_len(key_bytes, stripes)
        .filter(|_| stripes > 0)
        .ok_or_else(|| corrupt(&format!("{af_path}.stripes"), "is 0"))?;
    let area_len = round_up(af_bytes as u64, 512).unwrap_or(u64::MAX);
    if area_size < area_len {
        return Err(corrupt(
            &format!("{area_path}.size"),
            &format!(
                "{area_size} cannot hold the AF-split key material: {stripes} stripes of \
                 {key_bytes} bytes need {area_len} bytes (whole 512-byte sectors)"
            ),
        ));
    }
    // validate() kept every area inside the keyslots area; a detached
    // header's data (offset 0) is on another device and bounds nothing.
    let past_data = data_offset != 0 && area_offset.saturating_add(area_len) > data_offset;
    if area_offset < 2 * hdr_size || past_data {
        return Err(corrupt(
            &format!("{area_path}.offset"),
            &format!(
                "{area_offset} puts the keyslot outside the keyslots area (between the header \
                 copies and the data at {data_offset})"
            ),
        ));
    }
    Ok(area_len)
}

/// The digest of keyslot `id`, which must also be bound to the data
/// segment `seg`.
fn keyslot_digest(
    id: u32,
    path: &str,
    seg: &SegmentJson,
    digests: &[DigestJson],
) -> Result<Digest, LuksError> {
    let d = digests
        .iter()
        .find(|d| d.keyslots.contains(&id))
        .ok_or_else(|| corrupt(path, "is not referenced by any digest"))?;
    if !d.segments.contains(&seg.id) {
        return Err(LuksError::Unsupported(format!(
            "keyslot {id} is not bound to the data segment (an unbound key)"
        )));
    }
    match &d.digest {
        Ok(x) => Ok(Digest {
            field: x.field.clone(),
            hash: x.hash,
            iterations: x.iterations,
            salt: x.salt.clone(),
            value: x.value.clone(),
        }),
        Err(e) => Err(LuksError::Corrupt(format!("digest of keyslot {id}: {e}"))),
    }
}

/// `config.requirements`, as cryptsetup reads it: an object whose
/// `mandatory` member, if present, is an array of strings. This crate
/// implements one requirement, its own [`INTEGRITY_REQUIREMENT`] (an
/// authenticated volume; whether its token is there and right is
/// [`integrity_meta::check`]'s question); any other mandatory one
/// (online reencryption, ...) makes the volume unsupported, as an unknown
/// one does in cryptsetup. Other members (`optional`...) are ignored, as
/// there.
///
/// **Returns:** whether [`INTEGRITY_REQUIREMENT`] is listed.
fn check_requirements(config: &Map<String, Value>) -> Result<bool, LuksError> {
    let Some(req) = config.get("requirements") else {
        return Ok(false);
    };
    let req = obj(req, "config.requirements")?;
    let Some(mandatory) = req.get("mandatory") else {
        return Ok(false);
    };
    let path = "config.requirements.mandatory";
    let list = mandatory
        .as_array()
        .ok_or_else(|| corrupt(path, "is not an array"))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| corrupt(path, "holds something that is not a string"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let ours = list.iter().filter(|r| **r == INTEGRITY_REQUIREMENT).count();
    let others: Vec<&str> = list
        .iter()
        .copied()
        .filter(|r| *r != INTEGRITY_REQUIREMENT)
        .collect();
    if !others.is_empty() {
        return Err(LuksError::Unsupported(format!(
            "LUKS2 mandatory requirements {others:?} ({path}): only {INTEGRITY_REQUIREMENT:?} \
             is implemented here"
        )));
    }
    if ours > 1 {
        return Err(corrupt(
            path,
            &format!("lists {INTEGRITY_REQUIREMENT:?} {ours} times"),
        ));
    }
    Ok(ours == 1)
}

fn check_keyslot_count(n: usize, max_keyslots: usize) -> Result<(), LuksError> {
    if n > max_keyslots {
        return Err(LuksError::OverLimit(format!(
            "the LUKS2 header has {n} keyslots, over the limit of {max_keyslots} \
             (KdfLimits::max_keyslots; cryptsetup's LUKS2_KEYSLOTS_MAX is {})",
            super::LUKS2_KEYSLOTS_MAX
        )));
    }
    Ok(())
}

/// Check the metadata and turn it into a slot plan; a header with more
/// than `max_keyslots` keyslots is refused before any is planned.
pub(crate) fn plan(
    h: &BinHeader,
    json: &Value,
    used_secondary: bool,
    max_keyslots: usize,
) -> Result<Parsed, LuksError> {
    let root = obj(json, "the top level")?;
    let config = obj(field(root, "config", "")?, "config")?;
    let required = check_requirements(config)?;
    let seg = parse_segment(root, h.hdr_size)?;
    let integrity = integrity_of(root, required, &seg)?;
    let digests = parse_digests(root)?;
    let keyslots = obj(field(root, "keyslots", "")?, "keyslots")?;
    check_keyslot_count(keyslots.len(), max_keyslots)?;
    // (priority, id, slot): priority 2 (high) first, then 1 (normal);
    // 0 (ignore) is never tried, as in cryptsetup.
    let mut order = Vec::new();
    let mut key_bytes = None;
    for (key, v) in keyslots {
        let id = id_of(key, "keyslots")?;
        let path = format!("keyslots.{id}");
        let k = obj(v, &path)?;
        let priority = match k.get("priority") {
            None => 1,
            Some(p) => p
                .as_u64()
                .filter(|&p| p <= 2)
                .ok_or_else(|| corrupt(&format!("{path}.priority"), "is not 0, 1 or 2"))?,
        };
        let plan = plan_keyslot(id, k, &seg, &digests, h.hdr_size);
        if let Ok(p) = &plan {
            key_bytes.get_or_insert(p.key_bytes);
        }
        order.push((priority, id, plan));
    }
    let (infos, slots) = try_order(order);
    Ok(Parsed {
        info: LuksInfo {
            version: LuksVersion::Luks2,
            uuid: h.uuid.clone(),
            label: (!h.label.is_empty()).then(|| h.label.clone()),
            cipher_spec: CIPHER_SPEC.to_string(),
            key_bytes: key_bytes.unwrap_or(0),
            sector_size: seg.sector_size,
            data_offset_bytes: seg.offset,
            data_size_bytes: seg.size,
            keyslots: infos,
            used_secondary_header: used_secondary,
            integrity,
        },
        iv_tweak: seg.iv_tweak,
        slots,
    })
}

/// The authenticated volume the metadata `root` describes, if any:
/// `required` (the requirement is listed) and the tokens checked against
/// the data segment `seg`.
fn integrity_of(
    root: &Map<String, Value>,
    required: bool,
    seg: &SegmentJson,
) -> Result<Option<IntegrityInfo>, LuksError> {
    let tokens = obj(field(root, "tokens", "")?, "tokens")?;
    let path = format!("segments.{}", seg.id);
    let view = SegmentView {
        path: &path,
        offset: seg.offset,
        size: seg.size,
        sector_size: seg.sector_size as u64,
    };
    integrity_meta::check(required, tokens, &view)
}

/// The keyslots' `(priority, id, plan)` in the order they are tried
/// (priority 2 first, then 1, each by id), and what each is to a reader.
/// **Returns:** every keyslot's [`KeyslotInfo`], and the plans of those
/// tried (priority 0, "ignore", is never tried, as in cryptsetup).
fn try_order(
    mut order: Vec<(u64, u32, Result<SlotPlan, LuksError>)>,
) -> (Vec<KeyslotInfo>, Vec<Result<SlotPlan, LuksError>>) {
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut infos = Vec::new();
    let mut slots = Vec::new();
    for (priority, id, plan) in order {
        let (pbkdf, problem) = match &plan {
            Ok(p) if priority == 0 => (
                Some(p.pbkdf),
                Some("priority 0 (ignore): not tried".to_string()),
            ),
            Ok(p) => (Some(p.pbkdf), None),
            Err(e) => (None, Some(e.to_string())),
        };
        infos.push(KeyslotInfo {
            index: id as usize,
            pbkdf,
            problem,
        });
        if priority > 0 {
            slots.push(plan);
        }
    }
    (infos, slots)
}

pub(super) fn b64e(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// A keyslot's `kdf` object for `pbkdf` with `salt`.
pub(super) fn kdf_json(pbkdf: &Pbkdf, salt: &[u8]) -> Value {
    match pbkdf.costs() {
        KdfCosts::Pbkdf2 { hash, iterations } => json!({
            "type": "pbkdf2",
            "hash": hash.name(),
            "iterations": iterations,
            "salt": b64e(salt),
        }),
        KdfCosts::Argon2 {
            time,
            memory_kib,
            parallel,
        } => json!({
            "type": pbkdf.name(),
            "time": time,
            "memory": memory_kib,
            "cpus": parallel,
            "salt": b64e(salt),
        }),
    }
}

/// Format `dev` as LUKS2 (options already checked); with `integrity`, an
/// authenticated volume whose tags use that MAC (the header only: the
/// caller initialises the area).
pub(crate) fn format(
    dev: &Dev<'_>,
    passphrase: &[u8],
    opts: &FormatOptions,
    integrity: Option<Mac>,
) -> Result<LuksVolume, LuksError> {
    let integrity = match integrity {
        Some(mac) => Some(integrity_meta::fit(mac, dev.size(), FORMAT_DATA_OFFSET)?),
        None => {
            check_device_size(
                dev.size(),
                FORMAT_DATA_OFFSET,
                opts.sector_size,
                LuksVersion::Luks2,
            )?;
            None
        }
    };
    let key = random_master_key(opts.key_bytes)?;
    let af_hash = Hash::Sha256;
    let mut digest_salt = [0u8; 32];
    random(&mut digest_salt)?;
    let mut digest = [0u8; 32];
    kdf::pbkdf2(
        Hash::Sha256,
        key.as_slice(),
        &digest_salt,
        DIGEST_ITERATIONS,
        &mut digest,
    )?;
    let mut slot_salt = [0u8; 32];
    random(&mut slot_salt)?;
    let area = seal_keyslot(key.as_slice(), passphrase, &opts.pbkdf, &slot_salt, af_hash)?;
    let area_size = round_up(area.len() as u64, AREA_ALIGN).unwrap_or(u64::MAX);
    let keyslot = format_keyslot(opts, af_hash, area_size, &slot_salt);
    let mut metadata = format_metadata(opts, keyslot, &digest_salt, &digest);
    if let Some(i) = &integrity {
        integrity_meta::add_to_metadata(&mut metadata, i);
    }
    let text = serde_json::to_vec(&metadata)
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("JSON: {e}"))))?;
    let uuid = random_uuid()?;
    let label = opts.label.clone().unwrap_or_default();
    let primary = format_bin_header(false, &label, &uuid, &text)?;
    let secondary = format_bin_header(true, &label, &uuid, &text)?;
    dev.zero(0, FORMAT_DATA_OFFSET)?;
    dev.write_at(FORMAT_KEYSLOTS_OFFSET, area.as_slice())?;
    dev.write_at(FORMAT_HDR_SIZE, &secondary)?;
    dev.write_at(0, &primary)?;
    Ok(formatted_volume(format_info(opts, uuid, integrity), key))
}

/// What a new volume's header says: `opts`, `uuid`, keyslot 0, and the
/// `integrity` area if it is authenticated (its segment then fixed).
fn format_info(opts: &FormatOptions, uuid: String, integrity: Option<IntegrityInfo>) -> LuksInfo {
    LuksInfo {
        version: LuksVersion::Luks2,
        uuid,
        label: opts.label.clone(),
        cipher_spec: CIPHER_SPEC.to_string(),
        key_bytes: opts.key_bytes,
        sector_size: opts.sector_size,
        data_offset_bytes: FORMAT_DATA_OFFSET,
        data_size_bytes: integrity.as_ref().map(|i| i.layout.data_bytes()),
        keyslots: vec![KeyslotInfo {
            index: 0,
            pbkdf: Some(opts.pbkdf),
            problem: None,
        }],
        used_secondary_header: false,
        integrity,
    }
}

/// Keyslot 0 of a new volume: `opts.pbkdf` with `slot_salt`, the AF
/// splitter with `af_hash`, its `area_size`-byte area at
/// [`FORMAT_KEYSLOTS_OFFSET`].
fn format_keyslot(opts: &FormatOptions, af_hash: Hash, area_size: u64, slot_salt: &[u8]) -> Value {
    json!({
        "type": "luks2",
        "key_size": opts.key_bytes,
        "af": { "type": "luks1", "stripes": af::STRIPES, "hash": af_hash.name() },
        "area": {
            "type": "raw",
            "offset": FORMAT_KEYSLOTS_OFFSET.to_string(),
            "size": area_size.to_string(),
            "encryption": CIPHER_SPEC,
            "key_size": opts.key_bytes,
        },
        "kdf": kdf_json(&opts.pbkdf, slot_salt),
    })
}

/// The JSON metadata of a new volume: `keyslot` as keyslot 0, one
/// dynamic crypt segment at [`FORMAT_DATA_OFFSET`], the volume key's
/// PBKDF2 `digest` with `digest_salt`, and the config of the default
/// layout.
fn format_metadata(
    opts: &FormatOptions,
    keyslot: Value,
    digest_salt: &[u8],
    digest: &[u8],
) -> Value {
    json!({
        "keyslots": { "0": keyslot },
        "tokens": {},
        "segments": {
            "0": {
                "type": "crypt",
                "offset": FORMAT_DATA_OFFSET.to_string(),
                "size": "dynamic",
                "iv_tweak": "0",
                "encryption": CIPHER_SPEC,
                "sector_size": opts.sector_size,
            }
        },
        "digests": {
            "0": {
                "type": "pbkdf2",
                "keyslots": ["0"],
                "segments": ["0"],
                "hash": "sha256",
                "iterations": DIGEST_ITERATIONS,
                "salt": b64e(digest_salt),
                "digest": b64e(digest),
            }
        },
        "config": {
            "json_size": (FORMAT_HDR_SIZE - BIN_HEADER_BYTES as u64).to_string(),
            "keyslots_size": (FORMAT_DATA_OFFSET - FORMAT_KEYSLOTS_OFFSET).to_string(),
        }
    })
}

/// A new volume's primary or `secondary` binary header (a fresh random
/// salt, sequence id 1) over the JSON `text`.
fn format_bin_header(
    secondary: bool,
    label: &str,
    uuid: &str,
    text: &[u8],
) -> Result<Vec<u8>, LuksError> {
    let mut salt = [0u8; 64];
    random(&mut salt)?;
    BinHeader {
        secondary,
        hdr_size: FORMAT_HDR_SIZE,
        seqid: 1,
        label: label.to_string(),
        checksum_alg: "sha256".to_string(),
        salt,
        uuid: uuid.to_string(),
        subsystem: String::new(),
        hdr_offset: if secondary { FORMAT_HDR_SIZE } else { 0 },
    }
    .encode(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(secondary: bool) -> BinHeader {
        BinHeader {
            secondary,
            hdr_size: FORMAT_HDR_SIZE,
            seqid: 7,
            label: "lbl".into(),
            checksum_alg: "sha256".into(),
            salt: [3; 64],
            uuid: "u".into(),
            subsystem: String::new(),
            hdr_offset: if secondary { FORMAT_HDR_SIZE } else { 0 },
        }
    }

    #[test]
    fn encoded_header_has_the_spec_offsets_and_a_checksum_over_the_area() {
        let b = header(false).encode(br#"{"config":{}}"#).unwrap();
        assert_eq!(b.len(), 16384);
        assert_eq!(&b[..6], &MAGIC);
        assert_eq!(u16::from_be_bytes([b[6], b[7]]), 2);
        assert_eq!(be64(&b, 8), 16384);
        assert_eq!(be64(&b, 16), 7);
        assert_eq!(&b[24..27], b"lbl");
        assert_eq!(&b[72..78], b"sha256");
        assert_eq!(&b[4096..4096 + 13], br#"{"config":{}}"#);
        let mut z = b.clone();
        z[448..512].fill(0);
        assert_eq!(&b[448..480], &openssl::sha::sha256(&z)[..]);
        assert!(b[480..512].iter().all(|&x| x == 0));
        let s = header(true).encode(b"{}").unwrap();
        assert_eq!(&s[..6], &MAGIC_SECONDARY);
        assert_eq!(be64(&s, 256), 16384);
    }

    #[test]
    fn oversized_json_is_refused() {
        let big = vec![b' '; 12288];
        assert!(matches!(
            header(false).encode(&big),
            Err(LuksError::InvalidOptions(_))
        ));
    }

    #[test]
    fn unsupported_json_shapes_are_named() {
        let h = header(false);
        let base = json!({
            "keyslots": {}, "tokens": {}, "digests": {},
            "segments": {"0": {"type": "crypt", "offset": "16777216", "size": "dynamic",
                               "iv_tweak": "0", "encryption": "serpent-xts-plain64", "sector_size": 512}},
            "config": {"json_size": "12288", "keyslots_size": "16744448"}
        });
        assert!(
            matches!(plan(&h, &base, false, 32), Err(LuksError::UnsupportedCipher(s)) if s.contains("serpent"))
        );
        let mut j = base.clone();
        j["segments"]["0"]["encryption"] = json!("aes-xts-plain64");
        j["segments"]["0"]["sector_size"] = json!(2048);
        assert!(matches!(
            plan(&h, &j, false, 32),
            Err(LuksError::Unsupported(_))
        ));
        j["segments"]["0"]["sector_size"] = json!("512");
        assert!(
            matches!(plan(&h, &j, false, 32), Err(LuksError::Corrupt(s)) if s.contains("sector_size"))
        );
        j["segments"]["0"]["sector_size"] = json!(512);
        j["config"]["requirements"] = json!({"mandatory": ["online-reencrypt"]});
        assert!(
            matches!(plan(&h, &j, false, 32), Err(LuksError::Unsupported(s)) if s.contains("online-reencrypt"))
        );
        for bad in [json!([]), json!(null), json!({"segments": 3})] {
            assert!(matches!(
                plan(&h, &bad, false, 32),
                Err(LuksError::Corrupt(_))
            ));
        }
    }
}
