//! LUKS1: the 592-byte `phdr` of the LUKS On-Disk Format Specification
//! 1.2.3, its eight keyslots, and cryptsetup 2.x's layout for new volumes.
//!
//! Owns: parsing the header into a slot plan (magic, version, cipher,
//! hash spec, key size, payload offset, keyslot states and areas, all
//! checked), serialising a header, and formatting a volume. Must never:
//! trust a field before checking it (an offset, stripe count or iteration
//! count of 0 or past the device is an error), or write past the payload
//! offset.
//!
//! Layout (big-endian): `magic[6] version:u16 cipher-name[32]
//! cipher-mode[32] hash-spec[32] payload-offset:u32 key-bytes:u32
//! mk-digest[20] mk-digest-salt[32] mk-digest-iter:u32 uuid[40]`, then 8 ×
//! `active:u32 iterations:u32 salt[32] key-material-offset:u32
//! stripes:u32`. Offsets are in 512-byte sectors.

use super::kdf::{Hash, Pbkdf};
use super::FormatOptions;
use super::{
    af, check_device_size, formatted_volume, random, random_master_key, random_uuid, seal_keyslot,
    Dev, Digest, KeyslotInfo, LuksError, LuksInfo, LuksVersion, Parsed, SlotPlan, CIPHER_SPEC,
    DIGEST_ITERATIONS, MAGIC,
};

/// Header length in bytes.
pub const HEADER_BYTES: usize = 592;
/// Keyslots in a LUKS1 header.
pub const KEY_SLOTS: usize = 8;
/// `active` value of an enabled keyslot.
pub const SLOT_ACTIVE: u32 = 0x00AC_71F3;
/// `active` value of a disabled keyslot.
pub const SLOT_DISABLED: u32 = 0x0000_DEAD;
const SECTOR: u64 = 512;
const SALT_BYTES: usize = 32;
const DIGEST_BYTES: usize = 20;
/// Keyslot areas start here and are aligned to this (sectors).
const SLOT_ALIGN_SECTORS: u64 = 8;
/// Payload alignment (sectors): cryptsetup's default 1 MiB.
const PAYLOAD_ALIGN_SECTORS: u64 = 2048;

/// One LUKS1 keyslot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub active: u32,
    pub iterations: u32,
    pub salt: [u8; SALT_BYTES],
    pub key_material_offset: u32,
    pub stripes: u32,
}

/// A LUKS1 `phdr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_BYTES],
    pub mk_digest_salt: [u8; SALT_BYTES],
    pub mk_digest_iter: u32,
    pub uuid: String,
    pub slots: [Slot; KEY_SLOTS],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A NUL-terminated text field of `len` bytes. As cryptsetup, the last
/// byte is taken as the terminator: a field with no NUL is read as its
/// first `len - 1` bytes.
fn text(b: &[u8], at: usize, len: usize, name: &str) -> Result<String, LuksError> {
    let field = &b[at..at + len - 1];
    let end = field.iter().position(|&c| c == 0).unwrap_or(len - 1);
    let s = std::str::from_utf8(&field[..end])
        .map_err(|_| LuksError::Corrupt(format!("LUKS1 {name} field is not text")))?;
    if s.chars().any(|c| c.is_control()) {
        return Err(LuksError::Corrupt(format!(
            "LUKS1 {name} field holds control characters"
        )));
    }
    Ok(s.to_string())
}

fn put_text(b: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len - 1);
    b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

impl Header {
    /// Decode 592 bytes. Checks the magic and version only; the meaning
    /// of the fields is checked by [`plan`].
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, LuksError> {
        if b[..6] != MAGIC {
            return Err(LuksError::Corrupt(format!(
                "bad magic {:02x?}: not a LUKS header",
                &b[..6]
            )));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(LuksError::Corrupt(format!(
                "LUKS version {version} where 1 was expected"
            )));
        }
        let mut slots = Vec::with_capacity(KEY_SLOTS);
        for i in 0..KEY_SLOTS {
            let at = 208 + 48 * i;
            let mut salt = [0u8; SALT_BYTES];
            salt.copy_from_slice(&b[at + 8..at + 40]);
            slots.push(Slot {
                active: be32(b, at),
                iterations: be32(b, at + 4),
                salt,
                key_material_offset: be32(b, at + 40),
                stripes: be32(b, at + 44),
            });
        }
        let mut mk_digest = [0u8; DIGEST_BYTES];
        mk_digest.copy_from_slice(&b[112..132]);
        let mut mk_digest_salt = [0u8; SALT_BYTES];
        mk_digest_salt.copy_from_slice(&b[132..164]);
        Ok(Header {
            cipher_name: text(b, 8, 32, "cipher-name")?,
            cipher_mode: text(b, 40, 32, "cipher-mode")?,
            hash_spec: text(b, 72, 32, "hash-spec")?,
            payload_offset: be32(b, 104),
            key_bytes: be32(b, 108),
            mk_digest,
            mk_digest_salt,
            mk_digest_iter: be32(b, 164),
            uuid: text(b, 168, 40, "uuid")?,
            slots: slots
                .try_into()
                .map_err(|_| LuksError::Corrupt("LUKS1 keyslot table is incomplete".to_string()))?,
        })
    }

    /// Encode to 592 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..6].copy_from_slice(&MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_text(&mut b, 8, 32, &self.cipher_name);
        put_text(&mut b, 40, 32, &self.cipher_mode);
        put_text(&mut b, 72, 32, &self.hash_spec);
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_digest_salt);
        b[164..168].copy_from_slice(&self.mk_digest_iter.to_be_bytes());
        put_text(&mut b, 168, 40, &self.uuid);
        for (i, s) in self.slots.iter().enumerate() {
            let at = 208 + 48 * i;
            b[at..at + 4].copy_from_slice(&s.active.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&s.iterations.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&s.salt);
            b[at + 40..at + 44].copy_from_slice(&s.key_material_offset.to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        b
    }
}

/// The hash named by `hash-spec`, checked as cryptsetup checks it: a
/// hash whose digest is shorter than the 20-byte `mk-digest` (or that no
/// one knows) makes the header invalid; a real hash other than sha1,
/// sha256 and sha512 is valid LUKS1 that this crate does not do.
fn hash_spec(name: &str) -> Result<Hash, LuksError> {
    if let Some(h) = Hash::from_name(name) {
        return Ok(h);
    }
    let lower = name.to_ascii_lowercase();
    match openssl::hash::MessageDigest::from_name(&lower) {
        Some(md) if md.size() >= DIGEST_BYTES && !lower.is_empty() => {
            Err(LuksError::UnsupportedKdf(format!(
                "LUKS1 hash-spec {name:?}: a hash cryptsetup knows, but only sha1, sha256 and \
                 sha512 are supported here"
            )))
        }
        Some(md) => Err(LuksError::Corrupt(format!(
            "LUKS1 hash-spec {name:?}: its digest is {} bytes, shorter than the {DIGEST_BYTES}-byte \
             mk-digest (LUKS1 needs a hash of at least {DIGEST_BYTES} bytes)",
            md.size()
        ))),
        None => Err(LuksError::Corrupt(format!(
            "LUKS1 hash-spec {name:?}: not the name of a hash (LUKS1 needs a hash with a digest \
             of at least {DIGEST_BYTES} bytes, such as sha1 or sha256)"
        ))),
    }
}

/// Sectors of one key-material area: the AF-split key (`key_bytes` ×
/// 4000 stripes) rounded up to whole 512-byte sectors.
fn area_sectors(key_bytes: u32) -> u64 {
    (u64::from(key_bytes) * u64::from(af::STRIPES)).div_ceil(SECTOR)
}

/// The key-slot rules cryptsetup applies to every LUKS1 header it loads
/// (`LUKS_check_keyslots`), for all eight slots whether enabled or not:
/// a known `active` value, 4000 stripes, key material after the header
/// and wholly before the payload, and no two areas overlapping.
fn check_key_slots(h: &Header, sectors: u64) -> Result<(), LuksError> {
    let payload = u64::from(h.payload_offset);
    for (i, s) in h.slots.iter().enumerate() {
        if s.active != SLOT_ACTIVE && s.active != SLOT_DISABLED {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: active field {:#010x} is neither enabled ({SLOT_ACTIVE:#010x}) \
                 nor disabled ({SLOT_DISABLED:#010x})",
                s.active
            )));
        }
        if s.stripes != af::STRIPES {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: stripes {} where LUKS1 requires {} (every key slot, enabled \
                 or not)",
                s.stripes,
                af::STRIPES
            )));
        }
        let offset = u64::from(s.key_material_offset);
        // cryptsetup computes the byte offset in 32 bits: an offset of
        // 2^23 sectors or more wraps, and a wrapped value inside the header
        // is refused there; refused here too, so both accept the same.
        let wrapped = s.key_material_offset.wrapping_mul(SECTOR as u32);
        if offset >= 1 << 23 && (wrapped as usize) < HEADER_BYTES {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: key-material-offset {offset} times 512 wraps to byte                  {wrapped} in 32 bits, inside the header (cryptsetup computes the byte offset                  in 32 bits and refuses it)"
            )));
        }
        if offset * SECTOR < HEADER_BYTES as u64 {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: key-material-offset {offset} (byte {}) overlaps the header: \
                 key material must start at or after byte {HEADER_BYTES}",
                offset * SECTOR
            )));
        }
        let end = offset + sectors;
        if end > u64::from(u32::MAX) {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: key material at key-material-offset {offset} ({sectors} \
                 sectors) ends at sector {end}, which overflows the 32-bit sector fields"
            )));
        }
        // A detached header (payload-offset 0) keeps its payload on
        // another device: nothing here to run into, as in cryptsetup.
        if payload != 0 && end > payload {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: key material at key-material-offset {offset} ({sectors} \
                 sectors, to sector {end}) runs past the payload offset (payload-offset \
                 {payload}): key material must end at or before the payload"
            )));
        }
    }
    let mut order: [usize; KEY_SLOTS] = std::array::from_fn(|i| i);
    order.sort_by_key(|&i| (h.slots[i].key_material_offset, i));
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        let a_start = u64::from(h.slots[a].key_material_offset);
        let b_start = u64::from(h.slots[b].key_material_offset);
        if b_start < a_start + sectors {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {a} and keyslot {b}: key-material areas overlap (keyslot {a} at \
                 key-material-offset {a_start} runs to sector {}, keyslot {b} starts at \
                 key-material-offset {b_start}): key-material areas must not overlap",
                a_start + sectors
            )));
        }
    }
    Ok(())
}

/// Check a decoded header and turn it into a slot plan. Applies every
/// check cryptsetup makes when it loads a LUKS1 header, and refuses
/// what this crate does not do (ciphers other than `aes-xts-plain64`,
/// hashes other than sha1/sha256/sha512). A detached header (payload
/// offset 0) is accepted: it opens, its payload is elsewhere. The device
/// size is checked by [`parse`].
pub(crate) fn plan(h: &Header) -> Result<Parsed, LuksError> {
    let (hash, key_bytes, sectors) = check_fields(h)?;
    let data_offset = u64::from(h.payload_offset) * SECTOR;
    let (infos, slots) = slot_plans(h, hash, key_bytes, sectors * SECTOR)?;
    Ok(Parsed {
        info: LuksInfo {
            version: LuksVersion::Luks1,
            uuid: h.uuid.clone(),
            label: None,
            cipher_spec: CIPHER_SPEC.to_string(),
            key_bytes,
            sector_size: SECTOR as usize,
            data_offset_bytes: data_offset,
            data_size_bytes: None,
            keyslots: infos,
            used_secondary_header: false,
            integrity: None,
        },
        iv_tweak: 0,
        slots,
    })
}

/// The header's own fields and its key slots ([`check_key_slots`]), in
/// cryptsetup's order: the hash, the key length, the digest's iterations,
/// then the cipher. **Returns:** the hash, the key length and the sectors
/// of one key-material area.
fn check_fields(h: &Header) -> Result<(Hash, usize, u64), LuksError> {
    let hash = hash_spec(&h.hash_spec)?;
    if h.key_bytes == 0 {
        return Err(LuksError::Corrupt(
            "LUKS1 key-bytes 0: a volume key has at least one byte".to_string(),
        ));
    }
    let key_bytes = h.key_bytes as usize;
    if key_bytes != 32 && key_bytes != 64 {
        return Err(LuksError::UnsupportedCipher(format!(
            "aes-xts-plain64 with a {}-bit key (LUKS1 key-bytes {})",
            u64::from(h.key_bytes) * 8,
            h.key_bytes
        )));
    }
    if h.mk_digest_iter == 0 {
        return Err(LuksError::Corrupt(
            "LUKS1 mk-digest-iter 0: the volume-key digest needs at least 1 PBKDF2 iteration"
                .to_string(),
        ));
    }
    let sectors = area_sectors(h.key_bytes);
    check_key_slots(h, sectors)?;
    let spec = format!("{}-{}", h.cipher_name, h.cipher_mode);
    if !h.cipher_name.eq_ignore_ascii_case("aes") || h.cipher_mode != "xts-plain64" {
        return Err(LuksError::UnsupportedCipher(format!(
            "{spec:?} (LUKS1 header)"
        )));
    }
    Ok((hash, key_bytes, sectors))
}

/// What a reader sees of each active key slot, and its plan (both in
/// slot order).
type SlotPlans = (Vec<KeyslotInfo>, Vec<Result<SlotPlan, LuksError>>);

/// The plans of the active key slots (each with `area_len` bytes of key
/// material and the header's volume-key digest), and what each is to a
/// reader; an active slot with 0 iterations is refused.
fn slot_plans(
    h: &Header,
    hash: Hash,
    key_bytes: usize,
    area_len: u64,
) -> Result<SlotPlans, LuksError> {
    let digest = || Digest {
        field: "mk-digest-iter".to_string(),
        hash,
        iterations: h.mk_digest_iter,
        salt: h.mk_digest_salt.to_vec(),
        value: h.mk_digest.to_vec(),
    };
    let mut slots = Vec::new();
    let mut infos = Vec::new();
    for (i, s) in h.slots.iter().enumerate() {
        if s.active != SLOT_ACTIVE {
            continue;
        }
        if s.iterations == 0 {
            return Err(LuksError::Corrupt(format!(
                "LUKS1 keyslot {i}: iterations 0 in an enabled key slot (PBKDF2 needs at least 1)"
            )));
        }
        let pbkdf = Pbkdf::Pbkdf2 {
            hash,
            iterations: s.iterations,
        };
        infos.push(KeyslotInfo {
            index: i,
            pbkdf: Some(pbkdf),
            problem: None,
        });
        slots.push(Ok(SlotPlan {
            index: i,
            pbkdf,
            kdf_field: format!("key-slot {i} "),
            salt: s.salt.to_vec(),
            area_offset: u64::from(s.key_material_offset) * SECTOR,
            area_len,
            area_key_bytes: key_bytes,
            af_hash: hash,
            stripes: s.stripes,
            key_bytes,
            digest: digest(),
        }));
    }
    Ok((infos, slots))
}

/// Bytes a device needs for the header `h` (already planned): the end of
/// the last of the eight key-material areas, as cryptsetup requires. A
/// device that ends there or before the payload is a header-only image (a
/// header backup): it is inspected and opened, never served.
pub(crate) fn device_bytes_needed(h: &Header) -> u64 {
    let sectors = area_sectors(h.key_bytes);
    let areas_end = h
        .slots
        .iter()
        .map(|s| u64::from(s.key_material_offset) + sectors)
        .max()
        .unwrap_or(0);
    areas_end * SECTOR
}

/// Read and plan the LUKS1 header of `dev`, and check that the device
/// holds all eight key-material areas ([`LuksError::Truncated`] names the
/// bytes needed and present).
pub(crate) fn parse(dev: &Dev<'_>) -> Result<Parsed, LuksError> {
    let mut b = [0u8; HEADER_BYTES];
    dev.read_at(0, &mut b)?;
    let h = Header::decode(&b)?;
    let parsed = plan(&h)?;
    let needed = device_bytes_needed(&h);
    if dev.size() < needed {
        return Err(LuksError::Truncated {
            needed,
            have: dev.size(),
        });
    }
    Ok(parsed)
}

/// The layout cryptsetup 2.x gives a LUKS1 volume: keyslot `i` at sector
/// `8 + i × a` where `a` is the AF material's sectors rounded up to 8;
/// payload at the end of the last area rounded up to 1 MiB (4096 sectors,
/// 2 MiB, for both key sizes).
pub(crate) fn layout(key_bytes: usize) -> ([u32; KEY_SLOTS], u32) {
    let af_sectors = (key_bytes as u64 * u64::from(af::STRIPES)).div_ceil(SECTOR);
    let step = af_sectors.div_ceil(SLOT_ALIGN_SECTORS) * SLOT_ALIGN_SECTORS;
    let mut offsets = [0u32; KEY_SLOTS];
    for (i, o) in offsets.iter_mut().enumerate() {
        *o = (SLOT_ALIGN_SECTORS + i as u64 * step) as u32;
    }
    let end = SLOT_ALIGN_SECTORS + KEY_SLOTS as u64 * step;
    let payload = end.div_ceil(PAYLOAD_ALIGN_SECTORS) * PAYLOAD_ALIGN_SECTORS;
    (offsets, payload as u32)
}

/// Format `dev` as LUKS1 (options already checked).
pub(crate) fn format(
    dev: &Dev<'_>,
    passphrase: &[u8],
    opts: &FormatOptions,
) -> Result<super::LuksVolume, LuksError> {
    let Pbkdf::Pbkdf2 { hash, iterations } = opts.pbkdf else {
        return Err(LuksError::InvalidOptions(
            "LUKS1 keyslots use PBKDF2 only".to_string(),
        ));
    };
    let (offsets, payload) = layout(opts.key_bytes);
    let data_offset = u64::from(payload) * SECTOR;
    check_device_size(dev.size(), data_offset, 512, LuksVersion::Luks1)?;

    let key = random_master_key(opts.key_bytes)?;
    let mut mk_digest_salt = [0u8; SALT_BYTES];
    random(&mut mk_digest_salt)?;
    let mut mk_digest = [0u8; DIGEST_BYTES];
    super::kdf::pbkdf2(
        hash,
        key.as_slice(),
        &mk_digest_salt,
        DIGEST_ITERATIONS,
        &mut mk_digest,
    )?;
    let mut salt0 = [0u8; SALT_BYTES];
    random(&mut salt0)?;
    let area = seal_keyslot(key.as_slice(), passphrase, &opts.pbkdf, &salt0, hash)?;

    let uuid = random_uuid()?;
    let header = Header {
        cipher_name: "aes".to_string(),
        cipher_mode: "xts-plain64".to_string(),
        hash_spec: hash.name().to_string(),
        payload_offset: payload,
        key_bytes: opts.key_bytes as u32,
        mk_digest,
        mk_digest_salt,
        mk_digest_iter: DIGEST_ITERATIONS,
        uuid: uuid.clone(),
        slots: format_slots(&offsets, iterations, salt0),
    };
    dev.zero(0, data_offset)?;
    dev.write_at(u64::from(offsets[0]) * SECTOR, area.as_slice())?;
    dev.write_at(0, &header.encode())?;
    Ok(formatted_volume(
        LuksInfo {
            version: LuksVersion::Luks1,
            uuid,
            label: None,
            cipher_spec: CIPHER_SPEC.to_string(),
            key_bytes: opts.key_bytes,
            sector_size: 512,
            data_offset_bytes: data_offset,
            data_size_bytes: None,
            keyslots: vec![KeyslotInfo {
                index: 0,
                pbkdf: Some(opts.pbkdf),
                problem: None,
            }],
            used_secondary_header: false,
            integrity: None,
        },
        key,
    ))
}

/// The key slots of a new volume: slot 0 enabled with `iterations` and
/// `salt0`, the others disabled; each at its offset of `offsets`.
fn format_slots(
    offsets: &[u32; KEY_SLOTS],
    iterations: u32,
    salt0: [u8; SALT_BYTES],
) -> [Slot; KEY_SLOTS] {
    std::array::from_fn(|i| Slot {
        active: if i == 0 { SLOT_ACTIVE } else { SLOT_DISABLED },
        iterations: if i == 0 { iterations } else { 0 },
        salt: if i == 0 { salt0 } else { [0; SALT_BYTES] },
        key_material_offset: offsets[i],
        stripes: af::STRIPES,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_cryptsetup_2() {
        // cryptsetup 2.x: 512-bit keys → slots every 504 sectors from 8,
        // 256-bit keys → every 256 sectors; payload 4096 for both.
        let (o, p) = layout(64);
        assert_eq!(o[0], 8);
        assert_eq!(o[1], 512);
        assert_eq!(o[7], 8 + 7 * 504);
        assert_eq!(p, 4096);
        let (o, p) = layout(32);
        assert_eq!(o[1], 264);
        assert_eq!(p, 4096);
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            cipher_name: "aes".into(),
            cipher_mode: "xts-plain64".into(),
            hash_spec: "sha256".into(),
            payload_offset: 4096,
            key_bytes: 64,
            mk_digest: [1; 20],
            mk_digest_salt: [2; 32],
            mk_digest_iter: 1000,
            uuid: "0b1c5a3e-1111-4222-8333-444455556666".into(),
            slots: std::array::from_fn(|i| Slot {
                active: if i == 3 { SLOT_ACTIVE } else { SLOT_DISABLED },
                iterations: i as u32,
                salt: [i as u8; 32],
                key_material_offset: 8 + 504 * i as u32,
                stripes: 4000,
            }),
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b).unwrap(), h);
        let p = plan(&h).unwrap();
        assert_eq!(p.slots.len(), 1);
        assert_eq!(p.info.data_offset_bytes, 4096 * 512);
    }

    /// A header with the default layout's slot offsets `o`, every slot
    /// disabled, and a cipher this crate refuses (twofish-cbc).
    fn twofish_header(o: &[u32; KEY_SLOTS]) -> Header {
        Header {
            cipher_name: "twofish".into(),
            cipher_mode: "cbc-essiv:sha256".into(),
            hash_spec: "sha1".into(),
            payload_offset: 4096,
            key_bytes: 32,
            mk_digest: [0; 20],
            mk_digest_salt: [0; 32],
            mk_digest_iter: 1000,
            uuid: String::new(),
            slots: std::array::from_fn(|i| Slot {
                active: SLOT_DISABLED,
                iterations: 0,
                salt: [0; 32],
                key_material_offset: o[i],
                stripes: 4000,
            }),
        }
    }

    #[test]
    fn checks_name_what_is_wrong() {
        let (o, _) = layout(32);
        let mut h = twofish_header(&o);
        let e = plan(&h).err().unwrap();
        assert!(
            matches!(&e, LuksError::UnsupportedCipher(s) if s.contains("twofish-cbc-essiv:sha256")),
            "{e}"
        );
        h.cipher_name = "aes".into();
        h.cipher_mode = "xts-plain64".into();
        h.hash_spec = "sha384".into();
        assert!(matches!(plan(&h), Err(LuksError::UnsupportedKdf(_))));
        h.hash_spec = "md5".into();
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("shorter")));
        h.hash_spec = "nonsense".into();
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("hash-spec")));
        h.hash_spec = "SHA1".into();
        h.slots[2].active = 0x1234;
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("keyslot 2")));
        h.slots[2].active = SLOT_ACTIVE;
        h.slots[2].iterations = 1000;
        h.slots[2].stripes = u32::MAX;
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("stripes")));
        key_slot_checks_name_what_is_wrong(&mut h, &o);
        h.slots[2].active = SLOT_DISABLED;
        h.mk_digest_iter = 0;
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("mk-digest-iter")));
        h.mk_digest_iter = 1;
        h.key_bytes = 0;
        assert!(matches!(plan(&h), Err(LuksError::Corrupt(s)) if s.contains("key-bytes 0")));
        h.key_bytes = 32;
        let p = plan(&h).unwrap();
        assert!(p.slots.is_empty());
        // The last key-material area's end (a header-only image may end
        // there).
        assert_eq!(
            device_bytes_needed(&h),
            (u64::from(o[7]) + area_sectors(32)) * 512
        );
    }

    /// Slot 2 of `h` (active, 1000 iterations, bad stripes) moved over the
    /// header, past the offsets, over the payload and over slot 3, then
    /// put back with 0 iterations: each named.
    fn key_slot_checks_name_what_is_wrong(h: &mut Header, o: &[u32; KEY_SLOTS]) {
        h.slots[2].stripes = 4000;
        h.slots[2].key_material_offset = 0;
        assert!(matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("overlaps the header")));
        h.slots[2].key_material_offset = u32::MAX - 10;
        assert!(matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("overflows")));
        // 2^23 sectors × 512 wraps to 0 in 32 bits: cryptsetup refuses it.
        h.slots[2].key_material_offset = 1 << 23;
        assert!(matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("wraps")));
        h.slots[2].key_material_offset = 4090;
        assert!(matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("payload offset")));
        h.slots[2].key_material_offset = o[3] - 1;
        assert!(
            matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("keyslot 2 and keyslot 3"))
        );
        h.slots[2].key_material_offset = o[2];
        h.slots[2].iterations = 0;
        assert!(matches!(plan(h), Err(LuksError::Corrupt(s)) if s.contains("iterations 0")));
    }
}
