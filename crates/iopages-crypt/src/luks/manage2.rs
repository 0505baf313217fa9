//! The key verbs on a LUKS2 header: add a keyslot to the JSON metadata,
//! take one out, or give one a new passphrase in a new area.
//!
//! Owns: the order of LUKS2's writes. The metadata has two copies, each
//! with its own checksum, and the reader (`luks2::load`) uses the valid
//! copy with the higher `seqid` (either one when the other is damaged).
//! So every change is:
//!
//! 1. new key material (if any) into an area no keyslot uses, synced —
//!    nothing points at it yet;
//! 2. the secondary copy with `seqid + 1`, synced;
//! 3. the primary copy with `seqid + 1`, synced;
//! 4. removed key material (if any) overwritten with random bytes, synced.
//!
//! A crash in step 1 or a torn step 2 leaves the old primary as the only
//! newest valid copy (the old passphrases); once step 2 is complete the
//! secondary is the newest valid copy whatever step 3 leaves (the new
//! passphrases); after step 3 both copies agree. Secondary first because
//! the primary is the copy that identifies the device (blkid,
//! `cryptsetup isLuks`, the magic at byte 0): it stays intact and
//! consistent until the new metadata is already safe in the other copy.
//! A crash in step 4 leaves unreferenced key material that the next
//! change reusing the area overwrites. `change_key` keeps the slot number
//! (the switch to the new area is one metadata change, as atomic as the
//! others). Must never: write a metadata copy whose JSON this crate's own
//! reader would refuse, or write before every check and derivation has
//! passed.

use super::keyslots::{check_new_kdf, salt, unlock, wipe_area, KeyChange, KeyOptions, Unlocked};
use super::luks2::{self, field, kdf_json, obj, u64_str, BinHeader, AREA_ALIGN};
use super::{
    af, random, round_up, seal_keyslot, Dev, Hash, LuksError, LuksVersion, Pbkdf, CIPHER_SPEC,
    LUKS2_KEYSLOTS_MAX,
};
use serde_json::{json, Map, Value};

/// The chosen header copy and its metadata.
struct Meta {
    h: BinHeader,
    json: Value,
}

fn load(dev: &Dev<'_>) -> Result<Meta, LuksError> {
    let (h, json, _) = luks2::load(dev, LUKS2_KEYSLOTS_MAX, false)?;
    Ok(Meta { h, json })
}

fn section<'a>(json: &'a Value, name: &str) -> Result<&'a Map<String, Value>, LuksError> {
    obj(field(obj(json, "the top level")?, name, "")?, name)
}

fn section_mut<'a>(
    json: &'a mut Value,
    name: &str,
) -> Result<&'a mut Map<String, Value>, LuksError> {
    json.get_mut(name)
        .and_then(Value::as_object_mut)
        .ok_or_else(|| LuksError::Corrupt(format!("LUKS2 metadata: {name} is not an object")))
}

/// The keyslot id a new passphrase goes to: `wanted` if free, else the
/// lowest free one.
fn free_id(keyslots: &Map<String, Value>, wanted: Option<usize>) -> Result<usize, LuksError> {
    if let Some(n) = wanted {
        if n >= LUKS2_KEYSLOTS_MAX {
            return Err(LuksError::KeySlot(format!(
                "key slot {n} does not exist: LUKS2 has slots 0 to {}",
                LUKS2_KEYSLOTS_MAX - 1
            )));
        }
        if keyslots.contains_key(&n.to_string()) {
            return Err(LuksError::KeySlot(format!(
                "key slot {n} is in use (remove or kill it first, or pick a free slot)"
            )));
        }
        return Ok(n);
    }
    (0..LUKS2_KEYSLOTS_MAX)
        .find(|i| !keyslots.contains_key(&i.to_string()))
        .ok_or_else(|| {
            LuksError::KeySlot(format!(
                "all {LUKS2_KEYSLOTS_MAX} LUKS2 key slots are in use: remove a key or kill a slot \
                 first"
            ))
        })
}

/// A keyslot's area as (offset, size).
fn area_of(k: &Value, id: &str) -> Result<(u64, u64), LuksError> {
    let path = format!("keyslots.{id}.area");
    let area = obj(field(obj(k, &path)?, "area", &path)?, &path)?;
    Ok((
        u64_str(area, "offset", &path)?,
        u64_str(area, "size", &path)?,
    ))
}

/// The first 4 KiB-aligned gap of `len` bytes in the keyslots area that
/// no keyslot's area touches.
fn find_area(meta: &Meta, len: u64) -> Result<u64, LuksError> {
    let config = section(&meta.json, "config")?;
    let start = 2 * meta.h.hdr_size;
    let end = start + u64_str(config, "keyslots_size", "config")?;
    let mut used = section(&meta.json, "keyslots")?
        .iter()
        .map(|(id, k)| area_of(k, id).map(|(o, s)| (o, o.saturating_add(s))))
        .collect::<Result<Vec<_>, _>>()?;
    used.sort_unstable();
    let mut at = start;
    for (o, e) in used {
        if at + len <= o {
            break;
        }
        at = at.max(round_up(e, AREA_ALIGN).unwrap_or(u64::MAX));
    }
    if at.checked_add(len).is_some_and(|stop| stop <= end) {
        return Ok(at);
    }
    Err(LuksError::KeySlot(format!(
        "no free {len}-byte area left in the keyslots area [{start}, {end}): remove a key or \
         kill a slot first"
    )))
}

/// The id of the digest `slot` belongs to.
fn digest_of_slot(json: &Value, slot: usize) -> Result<String, LuksError> {
    let id = slot.to_string();
    section(json, "digests")?
        .iter()
        .find(|(_, d)| {
            d.get("keyslots")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(&id)))
        })
        .map(|(k, _)| k.clone())
        .ok_or_else(|| LuksError::Corrupt(format!("LUKS2 keyslot {slot} has no digest")))
}

/// Remove keyslot `slot` and every digest's and token's reference to it.
fn unlink(json: &mut Value, slot: usize) -> Result<(), LuksError> {
    let id = slot.to_string();
    section_mut(json, "keyslots")?.remove(&id);
    for name in ["digests", "tokens"] {
        for v in section_mut(json, name)?.values_mut() {
            if let Some(list) = v.get_mut("keyslots").and_then(Value::as_array_mut) {
                list.retain(|x| x.as_str() != Some(&id));
            }
        }
    }
    Ok(())
}

/// The new key material for `new_passphrase` and its keyslot object, in
/// a free area: (keyslot JSON, sealed area, area offset).
fn seal_new(
    meta: &Meta,
    u: &Unlocked,
    new_passphrase: &[u8],
    pbkdf: &Pbkdf,
) -> Result<(Value, super::key::SecretBuf, u64), LuksError> {
    let key_bytes = u.plan.key_bytes;
    let af_bytes = af::split_len(key_bytes, af::STRIPES)
        .ok_or_else(|| LuksError::Corrupt(format!("key size {key_bytes}")))?;
    let area_size = round_up(
        round_up(af_bytes as u64, 512).unwrap_or(u64::MAX),
        AREA_ALIGN,
    )
    .unwrap_or(u64::MAX);
    let offset = find_area(meta, area_size)?;
    let salt = salt()?;
    let area = seal_keyslot(u.key.as_slice(), new_passphrase, pbkdf, &salt, Hash::Sha256)?;
    assert!(area.len() as u64 <= area_size, "sealed area fits its size");
    let slot = json!({
        "type": "luks2",
        "key_size": key_bytes,
        "af": { "type": "luks1", "stripes": af::STRIPES, "hash": Hash::Sha256.name() },
        "area": {
            "type": "raw",
            "offset": offset.to_string(),
            "size": area_size.to_string(),
            "encryption": CIPHER_SPEC,
            "key_size": key_bytes,
        },
        "kdf": kdf_json(pbkdf, &salt),
    });
    Ok((slot, area, offset))
}

/// Write both metadata copies with `json` and the next `seqid`, secondary
/// first, each synced (module notes).
///
/// **Returns:** the primary and secondary copies as written.
fn write_meta(dev: &Dev<'_>, meta: &Meta, json: &Value) -> Result<Vec<u8>, LuksError> {
    luks2::validate(json, meta.h.hdr_size, LUKS2_KEYSLOTS_MAX)?;
    let text = serde_json::to_vec(json)
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("JSON: {e}"))))?;
    let seqid =
        meta.h.seqid.checked_add(1).ok_or_else(|| {
            LuksError::Corrupt("LUKS2 seqid cannot grow past 2^64 - 1".to_string())
        })?;
    let copy = |secondary: bool| -> Result<Vec<u8>, LuksError> {
        let mut salt = [0u8; 64];
        random(&mut salt)?;
        BinHeader {
            secondary,
            seqid,
            salt,
            hdr_offset: if secondary { meta.h.hdr_size } else { 0 },
            ..meta.h.clone()
        }
        .encode(&text)
    };
    let primary = copy(false)?;
    let secondary = copy(true)?;
    // What is written must be what this crate's reader plans from.
    luks2::plan(&meta.h, json, false, LUKS2_KEYSLOTS_MAX)?;
    assert_eq!(primary.len() as u64, meta.h.hdr_size);
    assert_eq!(secondary.len(), primary.len());
    dev.write_at(meta.h.hdr_size, &secondary)?;
    dev.sync()?;
    dev.write_at(0, &primary)?;
    dev.sync()?;
    let mut both = primary;
    both.extend_from_slice(&secondary);
    Ok(both)
}

fn change(header: Vec<u8>, added: Option<usize>, removed: Option<usize>) -> KeyChange {
    KeyChange {
        version: LuksVersion::Luks2,
        added,
        removed,
        header,
    }
}

/// Write sealed key material to a free area and make it durable.
fn write_area(dev: &Dev<'_>, offset: u64, area: &[u8]) -> Result<(), LuksError> {
    dev.write_at(offset, area)?;
    dev.sync()
}

/// `add_key` on LUKS2.
pub(crate) fn add(
    dev: &Dev<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let meta = load(dev)?;
    let id = free_id(section(&meta.json, "keyslots")?, opts.key_slot)?;
    opts.pbkdf.check_for_format()?;
    let u = unlock(dev, passphrase, &opts.limits, None)?;
    check_new_kdf(&opts.pbkdf, id, &u.plan, &opts.limits)?;
    let (slot, area, offset) = seal_new(&meta, &u, new_passphrase, &opts.pbkdf)?;
    let digest = digest_of_slot(&meta.json, u.plan.index)?;
    let mut json = meta.json.clone();
    section_mut(&mut json, "keyslots")?.insert(id.to_string(), slot);
    if let Some(list) = json["digests"][&digest]["keyslots"].as_array_mut() {
        list.push(Value::String(id.to_string()));
    }
    write_area(dev, offset, area.as_slice())?;
    let header = write_meta(dev, &meta, &json)?;
    Ok(change(header, Some(id), None))
}

/// Remove keyslot `slot` (already checked to be allowed to go).
pub(crate) fn remove(dev: &Dev<'_>, slot: usize) -> Result<KeyChange, LuksError> {
    let meta = load(dev)?;
    let id = slot.to_string();
    let k = section(&meta.json, "keyslots")?
        .get(&id)
        .ok_or_else(|| LuksError::KeySlot(format!("key slot {slot} is not in use")))?;
    let (offset, size) = area_of(k, &id)?;
    let mut json = meta.json.clone();
    unlink(&mut json, slot)?;
    let header = write_meta(dev, &meta, &json)?;
    wipe_area(dev, offset, size)?;
    Ok(change(header, None, Some(slot)))
}

/// `change_key` on LUKS2: the slot the passphrase opens gets the new
/// passphrase in a new area (same slot number, same priority); the old
/// area is wiped once the metadata points away from it.
pub(crate) fn change_key(
    dev: &Dev<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let meta = load(dev)?;
    opts.pbkdf.check_for_format()?;
    let u = unlock(dev, passphrase, &opts.limits, None)?;
    let slot = u.plan.index;
    check_new_kdf(&opts.pbkdf, slot, &u.plan, &opts.limits)?;
    let id = slot.to_string();
    let old = section(&meta.json, "keyslots")?
        .get(&id)
        .cloned()
        .ok_or_else(|| LuksError::KeySlot(format!("key slot {slot} is not in use")))?;
    let (old_offset, old_size) = area_of(&old, &id)?;
    let (mut new, area, offset) = seal_new(&meta, &u, new_passphrase, &opts.pbkdf)?;
    if let Some(p) = old.get("priority") {
        new["priority"] = p.clone();
    }
    let mut json = meta.json.clone();
    section_mut(&mut json, "keyslots")?.insert(id, new);
    write_area(dev, offset, area.as_slice())?;
    let header = write_meta(dev, &meta, &json)?;
    wipe_area(dev, old_offset, old_size)?;
    Ok(change(header, Some(slot), Some(slot)))
}
