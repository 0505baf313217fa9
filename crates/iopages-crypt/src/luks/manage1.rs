//! The key verbs on a LUKS1 header: put a passphrase into one of the
//! eight slots, take one out.
//!
//! Owns: the order of LUKS1's writes. LUKS1 has one header copy, so every
//! step changes as little as one write can and is synced before the next:
//!
//! - adding: the key material into the (disabled) slot's area, synced;
//!   then the slot's salt and iterations with the slot still disabled,
//!   synced; then only the slot's `active` word, synced. A crash before
//!   the last write leaves the slot disabled (the old passphrases); after
//!   it, the slot works (the new ones).
//! - removing: only the `active` word set to disabled, synced (from here
//!   the old passphrase opens nothing); then the key material overwritten
//!   with random bytes, synced; then the salt and iterations cleared,
//!   synced.
//!
//! The `active` word (4 bytes, aligned, inside one 512-byte sector) is
//! the only field whose change makes a slot usable or not, so even a
//! write torn at a sector boundary leaves either state. Must never:
//! change a slot in place (`change_key` needs a free slot: the new
//! passphrase is added before the old one is removed), or write before
//! every check and derivation has passed.

use super::keyslots::{check_new_kdf, salt, unlock, wipe_area, KeyChange, KeyOptions, Unlocked};
use super::luks1::{Header, HEADER_BYTES, KEY_SLOTS, SLOT_ACTIVE, SLOT_DISABLED};
use super::{seal_keyslot, Dev, Hash, LuksError, LuksVersion, Pbkdf};

const SECTOR: u64 = 512;

/// Read and decode the header (its rules are checked by `unlock`'s
/// parse, which every verb runs first or next).
fn read_header(dev: &Dev<'_>) -> Result<Header, LuksError> {
    let mut b = [0u8; HEADER_BYTES];
    dev.read_at(0, &mut b)?;
    Header::decode(&b)
}

/// Write the header and make it durable.
fn write_header(dev: &Dev<'_>, h: &Header) -> Result<(), LuksError> {
    dev.write_at(0, &h.encode())?;
    dev.sync()
}

/// The slot a new passphrase goes to: `wanted` if it is free, else the
/// lowest free one.
fn free_slot(h: &Header, wanted: Option<usize>) -> Result<usize, LuksError> {
    if let Some(n) = wanted {
        if n >= KEY_SLOTS {
            return Err(LuksError::KeySlot(format!(
                "key slot {n} does not exist: LUKS1 has slots 0 to {}",
                KEY_SLOTS - 1
            )));
        }
        if h.slots[n].active == SLOT_ACTIVE {
            return Err(LuksError::KeySlot(format!(
                "key slot {n} is in use (remove or kill it first, or pick a free slot)"
            )));
        }
        return Ok(n);
    }
    h.slots
        .iter()
        .position(|s| s.active != SLOT_ACTIVE)
        .ok_or_else(|| {
            LuksError::KeySlot(format!(
                "all {KEY_SLOTS} LUKS1 key slots are in use: remove a key or kill a slot first"
            ))
        })
}

/// PBKDF2's iterations for a new slot: LUKS1 slots use the header's hash.
fn iterations_for(h: &Header, pbkdf: &Pbkdf) -> Result<(Hash, u32), LuksError> {
    let header_hash = Hash::from_name(&h.hash_spec)
        .ok_or_else(|| LuksError::UnsupportedKdf(format!("LUKS1 hash-spec {:?}", h.hash_spec)))?;
    match *pbkdf {
        Pbkdf::Pbkdf2 { hash, iterations } if hash == header_hash => Ok((hash, iterations)),
        Pbkdf::Pbkdf2 { hash, .. } => Err(LuksError::InvalidOptions(format!(
            "PBKDF2-{}: every LUKS1 key slot uses the header's hash-spec {}",
            hash.name(),
            header_hash.name()
        ))),
        other => Err(LuksError::InvalidOptions(format!(
            "{}: LUKS1 key slots use PBKDF2 only",
            other.name()
        ))),
    }
}

/// Bytes of a slot's key material.
fn area_bytes(h: &Header) -> u64 {
    (u64::from(h.key_bytes) * u64::from(super::af::STRIPES)).div_ceil(SECTOR) * SECTOR
}

/// Seal the unlocked key for `new_passphrase` into `slot` of `h` and
/// write it in the crash-safe order (module notes); `h` is updated.
fn write_new_slot(
    dev: &Dev<'_>,
    h: &mut Header,
    slot: usize,
    u: &Unlocked,
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<(), LuksError> {
    let (hash, iterations) = iterations_for(h, &opts.pbkdf)?;
    check_new_kdf(&opts.pbkdf, slot, &u.plan, &opts.limits)?;
    let salt = salt()?;
    let area = seal_keyslot(u.key.as_slice(), new_passphrase, &opts.pbkdf, &salt, hash)?;
    if area.len() as u64 != area_bytes(h) {
        return Err(LuksError::Corrupt(format!(
            "LUKS1 key-bytes {} changed while the key slot was made",
            h.key_bytes
        )));
    }
    assert_ne!(
        h.slots[slot].active, SLOT_ACTIVE,
        "a new slot is a free one"
    );
    let at = u64::from(h.slots[slot].key_material_offset) * SECTOR;
    dev.write_at(at, area.as_slice())?;
    dev.sync()?;
    h.slots[slot].salt = salt;
    h.slots[slot].iterations = iterations;
    write_header(dev, h)?;
    h.slots[slot].active = SLOT_ACTIVE;
    write_header(dev, h)
}

/// Disable `slot`, wipe its key material, clear its fields, in the
/// crash-safe order (module notes); `h` is updated.
fn clear_slot(dev: &Dev<'_>, h: &mut Header, slot: usize) -> Result<(), LuksError> {
    assert!(slot < KEY_SLOTS);
    h.slots[slot].active = SLOT_DISABLED;
    write_header(dev, h)?;
    let at = u64::from(h.slots[slot].key_material_offset) * SECTOR;
    wipe_area(dev, at, area_bytes(h))?;
    h.slots[slot].iterations = 0;
    h.slots[slot].salt = [0; 32];
    write_header(dev, h)
}

fn change(version_header: &Header, added: Option<usize>, removed: Option<usize>) -> KeyChange {
    KeyChange {
        version: LuksVersion::Luks1,
        added,
        removed,
        header: version_header.encode().to_vec(),
    }
}

/// `add_key` on LUKS1.
pub(crate) fn add(
    dev: &Dev<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let mut h = read_header(dev)?;
    let slot = free_slot(&h, opts.key_slot)?;
    iterations_for(&h, &opts.pbkdf)?;
    let u = unlock(dev, passphrase, &opts.limits, None)?;
    write_new_slot(dev, &mut h, slot, &u, new_passphrase, opts)?;
    Ok(change(&h, Some(slot), None))
}

/// Remove `slot` (already checked to be in use and allowed to go).
pub(crate) fn remove(dev: &Dev<'_>, slot: usize) -> Result<KeyChange, LuksError> {
    let mut h = read_header(dev)?;
    if slot >= KEY_SLOTS || h.slots[slot].active != SLOT_ACTIVE {
        return Err(LuksError::KeySlot(format!("key slot {slot} is not in use")));
    }
    clear_slot(dev, &mut h, slot)?;
    Ok(change(&h, None, Some(slot)))
}

/// `change_key` on LUKS1: the new passphrase goes to a free slot first,
/// then the old slot is removed (so LUKS1 needs one free slot).
pub(crate) fn change_key(
    dev: &Dev<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let mut h = read_header(dev)?;
    let slot = free_slot(&h, opts.key_slot).map_err(|e| {
        LuksError::KeySlot(format!(
            "{e}; LUKS1 change-key writes the new passphrase to a free slot before it removes \
             the old one, so that a crash never leaves neither"
        ))
    })?;
    iterations_for(&h, &opts.pbkdf)?;
    let u = unlock(dev, passphrase, &opts.limits, None)?;
    let old = u.plan.index;
    write_new_slot(dev, &mut h, slot, &u, new_passphrase, opts)?;
    clear_slot(dev, &mut h, old)?;
    Ok(change(&h, Some(slot), Some(old)))
}
