//! What the key verbs of both LUKS versions share: their options
//! ([`KeyOptions`]), the record of what a verb wrote ([`KeyChange`]),
//! unlocking the volume key with a passphrase (optionally not through a
//! given slot), the checks a new key slot must pass before anything is
//! written, and wiping a removed slot's key material.
//!
//! Owns: the rules every verb applies before its first write. Must
//! never: write to the device before every check and every key
//! derivation of the verb has succeeded (a refused verb changes
//! nothing), or hold the volume key outside `SecretBuf`.

use super::key::SecretBuf;
use super::{
    parse, random, try_slot, Dev, Digest, KdfLimits, LuksError, LuksInfo, LuksOpenOptions,
    LuksVersion, Pbkdf, SlotPlan,
};

/// How a key verb makes a new key slot and unlocks the volume.
#[derive(Clone, Debug)]
pub struct KeyOptions {
    /// The new slot's key derivation ([`crate::luks::add_key`],
    /// [`crate::luks::change_key`]); LUKS1 takes PBKDF2 with the header's
    /// hash only.
    pub pbkdf: Pbkdf,
    /// Where [`crate::luks::add_key`] puts the new passphrase; `None`: the
    /// lowest free slot.
    pub key_slot: Option<usize>,
    /// Costs a slot may ask for when unlocking with the given passphrase;
    /// the new slot must fit them too (else it could not be opened).
    pub limits: KdfLimits,
    /// Let [`crate::luks::remove_key`] and [`crate::luks::kill_slot`]
    /// remove the last usable key slot (the volume can then never be
    /// opened again).
    pub force: bool,
}

impl KeyOptions {
    /// A new slot with `pbkdf`, in the lowest free slot, default limits,
    /// not forced.
    pub fn new(pbkdf: Pbkdf) -> KeyOptions {
        KeyOptions {
            pbkdf,
            key_slot: None,
            limits: KdfLimits::default(),
            force: false,
        }
    }
}

/// What a key verb did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyChange {
    /// The volume's LUKS version.
    pub version: LuksVersion,
    /// The slot that now holds the new passphrase.
    pub added: Option<usize>,
    /// The slot that no longer holds a passphrase (LUKS2 `change_key`
    /// reuses the slot number: then `added == removed`).
    pub removed: Option<usize>,
    /// The header as last written, from byte 0: LUKS1's 592 bytes, LUKS2's
    /// primary and secondary copies. [`crate::luks::HeaderDevice::still_holds`]
    /// compares it with the device.
    pub header: Vec<u8>,
}

/// A volume key opened by a passphrase, and the slot that opened it.
pub(crate) struct Unlocked {
    pub info: LuksInfo,
    pub plan: SlotPlan,
    pub key: SecretBuf,
}

/// Open the volume key with `passphrase`, trying every usable slot but
/// `skip`.
///
/// **Returns:** the key and the slot; otherwise, as [`super::open`]: a
/// damaged slot or one over `limits` before [`LuksError::WrongPassphrase`],
/// [`LuksError::NoKeyslot`] when nothing could be tried.
pub(crate) fn unlock(
    dev: &Dev<'_>,
    passphrase: &[u8],
    limits: &KdfLimits,
    skip: Option<usize>,
) -> Result<Unlocked, LuksError> {
    let parsed = parse(dev, limits.max_keyslots, &LuksOpenOptions::default())?;
    limits.check_keyslot_count(parsed.info.version, parsed.info.keyslots.len())?;
    let mut first_error = None;
    let mut tried = 0usize;
    for slot in parsed.slots {
        limits.check_cancel()?;
        let plan = match slot {
            Ok(p) if Some(p.index) != skip => p,
            Ok(_) => continue,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        tried += 1;
        match try_slot(dev, &plan, passphrase, limits) {
            Ok(Some(key)) => {
                return Ok(Unlocked {
                    info: parsed.info,
                    plan,
                    key,
                })
            }
            Ok(None) => {}
            Err(e @ (LuksError::Io(_) | LuksError::Cancelled)) => return Err(e),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(
            e @ (LuksError::Corrupt(_) | LuksError::Truncated { .. } | LuksError::OverLimit(_)),
        ) => Err(e),
        _ if tried > 0 => Err(LuksError::WrongPassphrase),
        Some(e) => Err(e),
        None => Err(LuksError::NoKeyslot),
    }
}

/// Refuse a new slot's key derivation that cryptsetup would not write or
/// that `limits` would not let anyone open; `like` is the slot that
/// opened (its digest is the new slot's too).
pub(crate) fn check_new_kdf(
    pbkdf: &Pbkdf,
    index: usize,
    like: &SlotPlan,
    limits: &KdfLimits,
) -> Result<(), LuksError> {
    pbkdf.check_for_format()?;
    let probe = SlotPlan {
        index,
        pbkdf: *pbkdf,
        kdf_field: "new key slot ".to_string(),
        salt: Vec::new(),
        area_offset: 0,
        area_len: 0,
        area_key_bytes: like.area_key_bytes,
        af_hash: like.af_hash,
        stripes: like.stripes,
        key_bytes: like.key_bytes,
        digest: Digest {
            field: like.digest.field.clone(),
            hash: like.digest.hash,
            iterations: like.digest.iterations,
            salt: Vec::new(),
            value: Vec::new(),
        },
    };
    limits.check_slot(&probe)
}

/// Refuse to remove `slot` when no other usable slot would remain,
/// unless `force`.
pub(crate) fn check_not_last(info: &LuksInfo, slot: usize, force: bool) -> Result<(), LuksError> {
    let others = info
        .keyslots
        .iter()
        .filter(|k| k.index != slot && k.problem.is_none())
        .count();
    if others == 0 && !force {
        return Err(LuksError::KeySlot(format!(
            "key slot {slot} is the last usable key slot: removing it leaves no passphrase that \
             opens the volume, ever (force to remove it anyway)"
        )));
    }
    Ok(())
}

/// Overwrite `len` bytes of removed key material at `offset` with random
/// bytes and make that durable.
pub(crate) fn wipe_area(dev: &Dev<'_>, offset: u64, len: u64) -> Result<(), LuksError> {
    const CHUNK: u64 = 256 << 10;
    let mut noise = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(CHUNK) as usize;
        random(&mut noise[..n])?;
        dev.write_at(offset + done, &noise[..n])?;
        done += n as u64;
    }
    dev.sync()
}

/// Random bytes for a new slot's salt.
pub(crate) fn salt() -> Result<[u8; 32], LuksError> {
    let mut s = [0u8; 32];
    random(&mut s)?;
    Ok(s)
}
