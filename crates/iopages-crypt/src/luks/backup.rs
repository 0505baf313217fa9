//! Header backup and restore: the whole header area of a volume copied out
//! to a file, and a saved header area written back over a volume.
//!
//! Owns: how long a header area is — LUKS1 to the end of its last
//! key-material area rounded up to 4 KiB (never past the payload), LUKS2
//! both binary headers with their JSON areas and the keyslots area
//! (`2 × hdr_size + config.keyslots_size`), the lengths cryptsetup's
//! `luksHeaderBackup` writes, so each side restores the other's backups —
//! and the rules a restore is checked against before anything is written.
//! Must never: write to the image when a restore is refused (the backup is
//! not a LUKS header, its data offset differs from the image's, it is of
//! another volume and the caller did not say to replace it, the image is
//! too small), write past the backup's header area (the payload is never
//! touched), or report success before the written bytes are synced and
//! read back equal.
//!
//! A header-only image (a backup file) is a valid LUKS image: it can be
//! inspected, dumped, opened and restored from; only serving or decrypting
//! it fails ([`LuksError::NoPayload`]).

use super::dump::parses_for_inspection;
use super::luks1;
use super::luks2;
use super::{round_up, Dev, LuksError, LuksVersion, LUKS2_KEYSLOTS_MAX, MAGIC};
use serde_json::Value;
use std::fs::File;

/// Bytes copied per read or write.
const CHUNK_BYTES: u64 = 1 << 20;
/// LUKS1 header areas are rounded up to this (cryptsetup: a page).
const LUKS1_AREA_ALIGN: u64 = 4096;

/// Where a volume's header lies, as a backup or restore sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderArea {
    /// LUKS1 or LUKS2.
    pub version: LuksVersion,
    /// The volume's UUID (unescaped: print it through
    /// [`super::printable`]).
    pub uuid: String,
    /// Where the payload starts (0: a detached header).
    pub data_offset_bytes: u64,
    /// The header area's length: what a backup holds.
    pub len_bytes: u64,
    /// The fewest bytes that still hold every structure of the header
    /// (LUKS1: the last key-material area's end; LUKS2: `len_bytes`).
    pub min_len_bytes: u64,
}

/// What [`restore_header`] may replace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreOptions {
    /// Replace the header of another volume (a different UUID or LUKS
    /// version) or write over an image that holds no valid LUKS header.
    /// Off: only a backup of the volume now on the image is restored.
    pub replace_other_volume: bool,
}

/// The header area of the volume on `dev`, read without a passphrase.
///
/// **Returns:** the area, or the error [`super::inspect`] gives for a
/// header that is not LUKS, damaged or truncated (a header this crate
/// cannot use, with another cipher or a detached header, is measured).
fn area_of(dev: &Dev<'_>) -> Result<HeaderArea, LuksError> {
    parses_for_inspection(dev)?;
    let mut head = [0u8; 8];
    dev.read_at(0, &mut head)?;
    if head[..6] == MAGIC && head[6..8] == [0, 1] {
        let mut b = [0u8; luks1::HEADER_BYTES];
        dev.read_at(0, &mut b)?;
        let h = luks1::Header::decode(&b)?;
        let min = luks1::device_bytes_needed(&h);
        let data_offset = u64::from(h.payload_offset) * 512;
        let mut len = round_up(min, LUKS1_AREA_ALIGN).unwrap_or(min);
        if data_offset > 0 {
            len = len.min(data_offset).max(min);
        }
        return Ok(HeaderArea {
            version: LuksVersion::Luks1,
            uuid: h.uuid,
            data_offset_bytes: data_offset,
            len_bytes: len,
            min_len_bytes: min,
        });
    }
    let (h, json, _) = luks2::load(dev, LUKS2_KEYSLOTS_MAX, false)?;
    let number = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .and_then(|s| s.parse::<u64>().ok())
    };
    let keyslots_size = number(json.get("config").and_then(|c| c.get("keyslots_size")));
    let data_offset = json
        .get("segments")
        .and_then(Value::as_object)
        .and_then(|m| m.values().filter_map(|s| number(s.get("offset"))).min());
    let (Some(keyslots_size), Some(data_offset)) = (keyslots_size, data_offset) else {
        return Err(LuksError::Corrupt(
            "LUKS2 metadata: no keyslots area size or data segment offset".to_string(),
        ));
    };
    let len = 2 * h.hdr_size + keyslots_size;
    Ok(HeaderArea {
        version: LuksVersion::Luks2,
        uuid: h.uuid,
        data_offset_bytes: data_offset,
        len_bytes: len,
        min_len_bytes: len,
    })
}

/// Copy the header area of the volume on `dev` (a file or block device)
/// to `out`, as `cryptsetup luksHeaderBackup` does: everything from byte 0
/// to [`HeaderArea::len_bytes`] (bytes past the end of a header-only
/// image are written as zeros). No passphrase is needed: the area holds
/// the key slots, still encrypted.
///
/// **Context:** reads `dev` in 1 MiB pieces; the caller makes `out`
/// private, syncs it, and removes it if this fails.
///
/// **Returns:** what was copied, or the header's error (not LUKS, damaged,
/// truncated), or the error writing `out`.
pub fn backup_header(dev: &File, out: &mut dyn std::io::Write) -> Result<HeaderArea, LuksError> {
    backup_dev(&Dev::new(dev)?, out)
}

/// [`backup_header`] of a header on a [`Backend`](crate::backend::Backend)
/// (a remote export).
pub fn backup_header_backend(
    dev: &dyn crate::backend::Backend,
    out: &mut dyn std::io::Write,
) -> Result<HeaderArea, LuksError> {
    backup_dev(&Dev::of_backend(dev), out)
}

fn backup_dev(dev: &Dev<'_>, out: &mut dyn std::io::Write) -> Result<HeaderArea, LuksError> {
    let area = area_of(dev)?;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    let mut at = 0u64;
    while at < area.len_bytes {
        let n = (area.len_bytes - at).min(CHUNK_BYTES);
        let chunk = &mut buf[..n as usize];
        chunk.fill(0);
        let have = dev.size().saturating_sub(at).min(n) as usize;
        dev.read_at(at, &mut chunk[..have])?;
        out.write_all(chunk)?;
        at += n;
    }
    out.flush()?;
    Ok(area)
}

/// What [`restore_header`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    /// The restored header's area (its version and UUID).
    pub area: HeaderArea,
    /// Bytes written from offset 0.
    pub written_bytes: u64,
    /// The UUID of the volume whose header was replaced, when it was
    /// another volume's (`None`: the same volume, or no LUKS header).
    pub replaced_uuid: Option<String>,
}

/// Write the header area saved in `backup` (a file made by
/// [`backup_header`] or `cryptsetup luksHeaderBackup`) over the start of
/// `dev`, as `cryptsetup luksHeaderRestore` does.
///
/// Refused, with nothing written: a backup that is not a valid LUKS
/// header; an image whose LUKS header puts the payload elsewhere (its data
/// offset differs); a backup of another volume (UUID or version differs)
/// or an image with no valid LUKS header unless
/// [`RestoreOptions::replace_other_volume`]; an image too small for the
/// header.
///
/// **Context:** the caller holds the image's lock; reads the backup and
/// the image's header, writes at most the backup's header area, syncs,
/// then reads it back.
///
/// **Returns:** what was written, or why not ([`LuksError::RestoreRefused`]
/// for a refusal, an I/O error).
pub fn restore_header(
    dev: &File,
    backup: &File,
    opts: &RestoreOptions,
) -> Result<Restored, LuksError> {
    restore_dev(&Dev::new(dev)?, &Dev::new(backup)?, opts)
}

/// [`restore_header`] onto a header on a
/// [`Backend`](crate::backend::Backend) (a remote export, written in whole
/// 4096-byte blocks and flushed).
pub fn restore_header_backend(
    dev: &dyn crate::backend::Backend,
    backup: &File,
    opts: &RestoreOptions,
) -> Result<Restored, LuksError> {
    restore_dev(&Dev::of_backend(dev), &Dev::new(backup)?, opts)
}

/// The checks of a restore; the bytes to write and the UUID replaced.
fn check_restore(
    dev: &Dev<'_>,
    saved: &HeaderArea,
    backup_bytes: u64,
    opts: &RestoreOptions,
) -> Result<(u64, Option<String>), LuksError> {
    let refuse = |m: String| Err(LuksError::RestoreRefused(m));
    let mut len = saved.len_bytes.min(backup_bytes);
    let replaced = match area_of(dev) {
        Ok(now) => {
            if now.data_offset_bytes != saved.data_offset_bytes {
                return refuse(format!(
                    "the backup's data offset {} differs from the image's {}: it is the header \
                     of a volume with another layout, and restoring it would misplace the \
                     payload",
                    saved.data_offset_bytes, now.data_offset_bytes
                ));
            }
            let other = now.uuid != saved.uuid || now.version != saved.version;
            if other && !opts.replace_other_volume {
                return refuse(format!(
                    "the backup is of another volume ({} UUID {}) than the image's ({} UUID {}): \
                     restoring it replaces that volume's key slots (RestoreOptions::replace_other_volume \
                     allows it)",
                    saved.version,
                    super::printable(&saved.uuid),
                    now.version,
                    super::printable(&now.uuid)
                ));
            }
            other.then_some(now.uuid)
        }
        Err(LuksError::Io(e)) => return Err(LuksError::Io(e)),
        Err(e) if !opts.replace_other_volume => {
            return refuse(format!(
                "the image holds no valid LUKS header ({e}): restoring writes over its first \
                 {len} bytes (RestoreOptions::replace_other_volume allows it)"
            ))
        }
        Err(_) => None,
    };
    // A header-only image shorter than the rounded area keeps its size.
    len = len.min(dev.size().max(saved.min_len_bytes));
    if dev.size() < len {
        return refuse(format!(
            "the image ({} bytes) is smaller than the backup's {len}-byte header area",
            dev.size()
        ));
    }
    Ok((len, replaced))
}

fn restore_dev(
    dev: &Dev<'_>,
    backup: &Dev<'_>,
    opts: &RestoreOptions,
) -> Result<Restored, LuksError> {
    let saved = area_of(backup).map_err(|e| match e {
        LuksError::Io(e) => LuksError::Io(e),
        other => {
            LuksError::RestoreRefused(format!("the backup is not a valid LUKS header: {other}"))
        }
    })?;
    let (len, replaced_uuid) = check_restore(dev, &saved, backup.size(), opts)?;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(CHUNK_BYTES) as usize;
        backup.read_at(at, &mut buf[..n])?;
        dev.write_at(at, &buf[..n])?;
        at += n as u64;
    }
    dev.sync()?;
    verify_restored(dev, backup, len)?;
    Ok(Restored {
        area: saved,
        written_bytes: len,
        replaced_uuid,
    })
}

/// Read back the first `len` bytes of `dev`: they must equal `backup`'s.
fn verify_restored(dev: &Dev<'_>, backup: &Dev<'_>, len: u64) -> Result<(), LuksError> {
    let mut want = vec![0u8; CHUNK_BYTES as usize];
    let mut got = vec![0u8; CHUNK_BYTES as usize];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(CHUNK_BYTES) as usize;
        backup.read_at(at, &mut want[..n])?;
        dev.read_at(at, &mut got[..n])?;
        if want[..n] != got[..n] {
            return Err(LuksError::Io(std::io::Error::other(format!(
                "the restored header reads back different from the backup within bytes \
                 {at}..{}: another writer, or a device that lost the write",
                at + n as u64
            ))));
        }
        at += n as u64;
    }
    Ok(())
}
