//! The key verbs (`cryptsetup luksAddKey`, `luksRemoveKey`,
//! `luksChangeKey`, `luksKillSlot`) for LUKS1 and LUKS2, on a header
//! stored in a file, a block device or any [`Backend`] (a remote NBD
//! export).
//!
//! Owns: the public entry points and [`HeaderDevice`], and the rules
//! common to both versions (which slot a verb may touch, never the last
//! usable one unless forced). The version's own write order lives in
//! `manage1.rs` (LUKS1: one header, the `active` word flipped last when
//! adding and first when removing) and `manage2.rs` (LUKS2: key material,
//! then the secondary copy, then the primary, each synced). Must never:
//! write anything when a verb is refused (wrong passphrase, slot in use or
//! free, table full, damaged header, KDF over the limits), or leave a
//! crash point at which neither the old nor the new passphrases open the
//! volume.
//!
//! **Concurrency:** the verbs read, then write, the header: two writers
//! at once lose one's change. Callers hold a lock (`flock`) on a local
//! device; a remote store offers none, so after a verb the caller checks
//! with [`HeaderDevice::still_holds`] that the header is what was written.

use super::keyslots::{check_not_last, unlock};
pub use super::keyslots::{KeyChange, KeyOptions};
use super::{
    manage1, manage2, open_dev, parse, Dev, KdfLimits, LuksError, LuksInfo, LuksOpenOptions,
    LuksVersion, LuksVolume, LUKS2_KEYSLOTS_MAX,
};
use crate::backend::Backend;
use std::fs::File;

/// A LUKS header's device, readable and writable: a file or block device,
/// or a [`Backend`] (written in whole 4096-byte blocks, the partial
/// blocks at either edge read first; synced with a flush).
pub struct HeaderDevice<'a> {
    dev: Dev<'a>,
}

impl<'a> HeaderDevice<'a> {
    /// A file or block device opened for reading and writing.
    ///
    /// **Returns:** an error when its size cannot be had.
    pub fn file(file: &'a File) -> Result<HeaderDevice<'a>, LuksError> {
        Ok(HeaderDevice {
            dev: Dev::new(file)?,
        })
    }

    /// A backend (a RAM disk, a remote export).
    pub fn backend(backend: &'a dyn Backend) -> HeaderDevice<'a> {
        HeaderDevice {
            dev: Dev::of_backend(backend),
        }
    }

    /// The device's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.dev.size()
    }

    /// The header, read without a passphrase (as [`super::inspect`]).
    pub fn inspect(&self) -> Result<LuksInfo, LuksError> {
        Ok(parse(&self.dev, LUKS2_KEYSLOTS_MAX, &LuksOpenOptions::default())?.info)
    }

    /// Open the volume with `passphrase` (as [`super::open_with`]).
    pub fn open(&self, passphrase: &[u8], limits: &KdfLimits) -> Result<LuksVolume, LuksError> {
        open_dev(&self.dev, passphrase, limits, &LuksOpenOptions::default())
    }

    /// Whether the device's header is still exactly what `change` wrote
    /// (`false`: someone else wrote it since — a lost update).
    ///
    /// **Context:** reads the header again (from the store, for a remote).
    pub fn still_holds(&self, change: &KeyChange) -> Result<bool, LuksError> {
        let mut now = vec![0u8; change.header.len()];
        self.dev.read_at(0, &mut now)?;
        Ok(now == change.header)
    }
}

/// Add `new_passphrase` in a free key slot (`opts.key_slot`, or the
/// lowest free one), unlocking the volume key with `passphrase`; the new
/// slot uses `opts.pbkdf` (LUKS1: PBKDF2 with the header's hash).
///
/// **Context:** runs the key derivations of the slot that opens and of
/// the new slot (seconds with calibrated costs); writes and syncs.
/// **Returns:** what was written; [`LuksError::WrongPassphrase`],
/// [`LuksError::KeySlot`] (slot in use, table full, no room for an area),
/// [`LuksError::InvalidOptions`] / [`LuksError::OverLimit`] for a new
/// KDF cryptsetup would refuse or the limits would not open, header
/// errors — all before anything is written.
pub fn add_key(
    dev: &HeaderDevice<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    match dev.inspect()?.version {
        LuksVersion::Luks1 => manage1::add(&dev.dev, passphrase, new_passphrase, opts),
        LuksVersion::Luks2 => manage2::add(&dev.dev, passphrase, new_passphrase, opts),
    }
}

/// Remove the key slot `passphrase` opens; its key material is
/// overwritten. The last usable slot only with `opts.force`.
///
/// **Returns:** what was written, or (nothing written) the errors of
/// [`add_key`]'s unlock and [`LuksError::KeySlot`] for the last slot.
pub fn remove_key(
    dev: &HeaderDevice<'_>,
    passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let u = unlock(&dev.dev, passphrase, &opts.limits, None)?;
    let slot = u.plan.index;
    check_not_last(&u.info, slot, opts.force)?;
    let version = u.info.version;
    drop(u);
    match version {
        LuksVersion::Luks1 => manage1::remove(&dev.dev, slot),
        LuksVersion::Luks2 => manage2::remove(&dev.dev, slot),
    }
}

/// Give the key slot `passphrase` opens the passphrase `new_passphrase`
/// (new salt, `opts.pbkdf`). The new key material is written and synced
/// before the old is removed, so a crash leaves one of the two working.
/// LUKS2 keeps the slot number (a new area, switched to in one metadata
/// write); LUKS1 moves the passphrase to a free slot (`opts.key_slot` or
/// the lowest) and needs one.
///
/// **Returns:** as [`add_key`].
pub fn change_key(
    dev: &HeaderDevice<'_>,
    passphrase: &[u8],
    new_passphrase: &[u8],
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    match dev.inspect()?.version {
        LuksVersion::Luks1 => manage1::change_key(&dev.dev, passphrase, new_passphrase, opts),
        LuksVersion::Luks2 => manage2::change_key(&dev.dev, passphrase, new_passphrase, opts),
    }
}

/// Remove key slot `slot`; its key material is overwritten. With
/// `passphrase`, it must open another slot (one that stays); without, the
/// slot is removed unverified. The last usable slot only with
/// `opts.force`.
///
/// **Returns:** what was written; [`LuksError::KeySlot`] when `slot` is
/// not in use or is the last usable one, [`LuksError::WrongPassphrase`]
/// when `passphrase` opens no other slot — nothing written.
pub fn kill_slot(
    dev: &HeaderDevice<'_>,
    slot: usize,
    passphrase: Option<&[u8]>,
    opts: &KeyOptions,
) -> Result<KeyChange, LuksError> {
    let info = dev.inspect()?;
    if !info.keyslots.iter().any(|k| k.index == slot) {
        return Err(LuksError::KeySlot(format!("key slot {slot} is not in use")));
    }
    match passphrase {
        Some(p) => {
            unlock(&dev.dev, p, &opts.limits, Some(slot)).map_err(|e| match e {
                LuksError::WrongPassphrase | LuksError::NoKeyslot => LuksError::KeySlot(format!(
                    "the passphrase opens no key slot other than {slot} (give one of a slot that \
                     stays)"
                )),
                other => other,
            })?;
        }
        None => check_not_last(&info, slot, opts.force)?,
    }
    match info.version {
        LuksVersion::Luks1 => manage1::remove(&dev.dev, slot),
        LuksVersion::Luks2 => manage2::remove(&dev.dev, slot),
    }
}
