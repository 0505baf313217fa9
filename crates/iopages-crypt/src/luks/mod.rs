//! LUKS1 and LUKS2 volumes: open what `cryptsetup luksFormat` makes, and
//! make what cryptsetup opens, for `aes-xts-plain64`.
//!
//! Owns: the public API ([`open`], [`open_with`] and its [`KdfLimits`],
//! [`format()`], [`format_integrity`], [`inspect`], [`is_luks`], [`LuksVolume`],
//! [`FormatOptions`], [`LuksError`], [`printable`]), reading and writing
//! the device through positioned I/O (`pread`/`pwrite` on a shared
//! `&File`), the keyslot loop common to both versions (read area → derive
//! → decrypt → AF merge → check digest) and the keyslot-area cipher.
//! Must never: panic on any byte of a device (every length and offset read
//! from a header is checked, every failure is a [`LuksError`]), allocate
//! from an unchecked header length, run a key derivation whose costs were
//! not first checked against the caller's [`KdfLimits`], keep key
//! material outside `key::SecretBuf`, or write anything when opening.
//!
//! ```
//! use iopages_crypt::luks::{self, FormatOptions, LuksVersion};
//! let path = std::env::temp_dir().join(format!("luks-doc-{}", std::process::id()));
//! // Cheap KDF parameters for the example; real volumes use the defaults.
//! let opts = FormatOptions::fast_for_tests(LuksVersion::Luks2);
//! let made = luks::format_path(&path, Some((16 << 20) + 4096), b"pw", &opts).unwrap();
//! let vol = luks::open_path(&path, b"pw").unwrap();
//! assert_eq!(vol.master_key(), made.master_key());
//! assert_eq!(vol.data_offset_bytes(), 16 << 20);
//! let mut xts = vol.xts_cipher().unwrap(); // sector 0 = byte data_offset_bytes()
//! let mut sector = vec![0u8; 512];
//! xts.encrypt_sectors_in_place(0, &mut sector).unwrap();
//! assert!(matches!(luks::open_path(&path, b"no"), Err(luks::LuksError::WrongPassphrase)));
//! # std::fs::remove_file(&path).unwrap();
//! ```
//!
//! ## Map: LUKS structure → code
//!
//! | on disk (spec) | here | file |
//! |---|---|---|
//! | LUKS1 `phdr` (592 bytes, big-endian; spec 1.2.3 §2.4) | `luks1::Header` (decode, encode), `luks1::plan`, `luks1::layout` | `luks1.rs` |
//! | LUKS1 `key-slot` (48 bytes × 8) | `luks1::Slot` | `luks1.rs` |
//! | LUKS1 `mk-digest` (PBKDF2, 20 bytes) | `Digest` in the slot plan | `luks1.rs`, this file |
//! | LUKS2 binary header (4096 bytes ×2, spec §2) and its checksum | `luks2::BinHeader`, `luks2::load` (primary at 0, secondary at `hdr_size`, newest valid `seqid` wins) | `luks2.rs` |
//! | LUKS2 JSON area: `keyslots`, `segments`, `digests`, `config` | `luks2::plan` (serde_json `Value`, checked field by field into a slot plan) | `luks2.rs` |
//! | AF splitter, diffuse `H` (LUKS1 §2.4; LUKS2 `af.type = "luks1"`) | `af::split`, `af::merge` | `af.rs` |
//! | PBKDF2 (`hash-spec`, `kdf.type = "pbkdf2"`), Argon2i/Argon2id | [`Pbkdf`], [`enum@Hash`] | `kdf.rs` |
//! | limits on KDF costs and keyslot count (cryptsetup's `crypt_pbkdf_get_limits`, `LUKS2_KEYSLOTS_MAX`) | [`KdfLimits`] | `limits.rs` |
//! | keyslot area cipher (`aes-xts-plain64`, 512-byte sectors, IV from 0) | `area_cipher` | this file |
//! | the header's public fields (`luksDump`), LUKS2 JSON as stored | [`dump()`], [`LuksDump`] | `dump.rs` |
//! | the header area (`luksHeaderBackup`/`luksHeaderRestore`) | [`backup_header`], [`restore_header`] | `backup.rs` |
//! | `struct volume_key`, wiped and locked | [`MasterKey`], `SecretBuf` | `key.rs` |
//! | dm-crypt table cryptsetup would load | [`LuksVolume::xts_cipher`] | this file |
//! | an authenticated volume: `config.requirements.mandatory` `iopages-integrity-v1`, the `iopages-integrity` token, the integrity area after a fixed data segment | [`IntegrityInfo`], [`format_integrity`] | `integrity_meta.rs` |
//!
//! ## IV convention of the data segment
//!
//! dm-crypt numbers IVs in 512-byte units unless the table carries
//! `iv_large_sectors`, and cryptsetup never sets that option for LUKS
//! volumes: cryptsetup-open(8) of 2.6.1 says `--iv-large-sectors` "can be
//! used only with plain device type", and the GRUB commit that taught its
//! LUKS2 reader larger sectors (cf3a3acff057, G. Washburn, 2020) counts
//! their IV in 512-byte units, noting that cryptsetup supports
//! `--iv-large-sectors` "not with LUKS headers (only with --type plain)"
//! and that keyslot areas stay in 512-byte sectors. So a
//! LUKS2 volume with 4096-byte sectors gives sector `s` the IV `8·s +
//! iv_tweak`, and [`LuksVolume::xts_cipher`] builds its cipher with
//! `iv_large_sectors(false)`. Keyslot areas are always encrypted with
//! 512-byte sectors and IVs counted from the area's start.
//!
//! ## Departures from cryptsetup
//!
//! - Only `aes-xts-plain64` with 32- or 64-byte keys, for data and
//!   keyslots; other ciphers are refused with [`LuksError::UnsupportedCipher`].
//!   A detached header opens (key verbs, dump) but is not served: its
//!   data is on another device. No LUKS2 integrity (cryptsetup's
//!   dm-integrity segments), no online-reencryption segments; tokens are
//!   validated (shape, keyslots they name) but not used — except this
//!   crate's own authenticated volumes ([`format_integrity`]): a
//!   mandatory requirement of their own, which cryptsetup refuses to open,
//!   and a token with the integrity area's geometry, checked field by
//!   field at every open ([`LuksVolume::integrity`]).
//! - Validation follows cryptsetup's metadata rules for every field read:
//!   LUKS1 (every slot's state, stripes and key-material area, no
//!   overlaps, the device holding all eight areas)
//!   and LUKS2 (the JSON area's framing, `keyslots_size` and every area
//!   inside it without overlaps, digests/keyslots/segments/tokens
//!   referring to each other, segment alignment and flags, the device
//!   holding both header copies and the keyslots area). A device that
//!   ends there, with no payload sector (a header backup), is a
//!   header-only image: inspected, dumped and opened, never served
//!   ([`LuksVolume::payload_bytes`], [`LuksError::NoPayload`]).
//!   The LUKS2 secondary header is never used when the primary area holds
//!   another format's signature (LVM2, ext4, XFS, btrfs, swap, MD RAID,
//!   partition tables, LUKS1): [`LuksError::AmbiguousSignatures`], unless
//!   [`LuksOpenOptions::allow_secondary_header`]. Stricter than cryptsetup
//!   in a few places (a bad LUKS1 `active` value refuses the header where
//!   cryptsetup skips the slot; zero iteration counts are refused at load).
//! - KDF costs: `iopages luks format` benchmarks them as cryptsetup does
//!   (`calibrate`: a target unlock time, 2 s by default; Argon2 memory up
//!   to 1 GiB and half the available memory, then more passes; PBKDF2
//!   iterations from a timed run), lowered to fit the open-side
//!   [`KdfLimits`]. [`FormatOptions::default`] and the library keep fixed
//!   costs ([`Pbkdf::pbkdf2_default`], [`Pbkdf::argon2id_default`]) unless
//!   asked to calibrate ([`FormatOptions::calibrated`]). The volume-key
//!   digest uses PBKDF2 with 1000 iterations (cryptsetup's minimum, where
//!   cryptsetup spends ~125 ms): the key it protects is random, so more
//!   iterations buy nothing.
//! - [`format()`] writes one keyslot (slot 0). The LUKS1 layout is
//!   cryptsetup 2.x's (keyslots at 4 KiB boundaries from sector 8, payload
//!   at 2 MiB); LUKS2's is its default (16 KiB header copies, keyslots
//!   from 32 KiB, data at 16 MiB).
//! - Opening bounds what a header may cost ([`KdfLimits`]): by default
//!   1 GiB of Argon2 memory per keyslot (cryptsetup accepts up to 4 GiB),
//!   50 M PBKDF2 iterations (cryptsetup: 2^32 - 1), 16 lanes, 64 GiB-passes
//!   of Argon2 work, 32 keyslots (as cryptsetup). A keyslot over a limit
//!   is not tried. A fixed data segment running past the device is
//!   refused (dm-crypt would refuse the table).
//! - The volume key is `mlock`ed alone, not the whole process
//!   (cryptsetup's `mlockall`).

mod af;
mod argon2;
mod backup;
mod calibrate;
mod dump;
mod integrity_meta;
mod kdf;
mod key;
mod keyslots;
mod limits;
mod luks1;
mod luks2;
mod manage;
mod manage1;
mod manage2;

pub use af::STRIPES;
pub use backup::{
    backup_header, backup_header_backend, restore_header, restore_header_backend, HeaderArea,
    RestoreOptions, Restored,
};
pub use calibrate::{
    argon2_memory_cap, available_memory_kib, calibrate, default_lanes, Calibrated, KdfKind,
    KdfTarget, DEFAULT_ARGON2_MEMORY_CAP_KIB, DEFAULT_ITER_TIME,
};
pub use dump::{dump, dump_backend, LuksDump};
pub use integrity_meta::{IntegrityInfo, INTEGRITY_REQUIREMENT, INTEGRITY_TOKEN};
pub use kdf::{
    Hash, Pbkdf, ARGON2_MAX_MEMORY_KIB, ARGON2_MAX_PARALLEL_FORMAT, ARGON2_MIN_MEMORY_KIB,
    ARGON2_MIN_TIME, PBKDF2_MIN_ITERATIONS,
};
pub use key::MasterKey;
pub use limits::{KdfLimits, LUKS2_KEYSLOTS_MAX};
pub use luks2::FORMAT_DATA_OFFSET;
pub use manage::{add_key, change_key, kill_slot, remove_key, HeaderDevice, KeyChange, KeyOptions};

use crate::integrity::{Anchor, Mac};
use crate::XtsCipher;
pub(crate) use key::SecretBuf;
use std::borrow::Cow;
use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;

/// LUKS1 and LUKS2 primary header magic.
pub(crate) const MAGIC: [u8; 6] = [b'L', b'U', b'K', b'S', 0xba, 0xbe];
/// The only cipher this crate opens or makes.
pub const CIPHER_SPEC: &str = "aes-xts-plain64";
/// Key-area sector size: keyslot material is always encrypted in
/// 512-byte sectors.
const AREA_SECTOR: usize = 512;
/// Iterations of the PBKDF2 volume-key digest written by [`format()`].
pub const DIGEST_ITERATIONS: u32 = 1000;
/// Largest anti-forensic material accepted from a header (cryptsetup
/// writes 64 × 4000 = 256 000 bytes at most).
const MAX_AF_BYTES: u64 = 64 << 20;

/// LUKS header version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LuksVersion {
    /// LUKS1: one 592-byte binary header, PBKDF2 keyslots.
    Luks1,
    /// LUKS2: two binary headers with JSON metadata, PBKDF2 or Argon2
    /// keyslots, 512- or 4096-byte sectors.
    Luks2,
}

impl std::fmt::Display for LuksVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LuksVersion::Luks1 => "LUKS1",
            LuksVersion::Luks2 => "LUKS2",
        })
    }
}

/// Errors from opening, inspecting or formatting a LUKS volume. Messages
/// are written for a command-line user and never contain key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LuksError {
    /// No active keyslot opens with this passphrase.
    #[error("no keyslot opens with this passphrase (wrong passphrase?)")]
    WrongPassphrase,
    /// The header has no active keyslot at all.
    #[error("the volume has no active keyslot: no passphrase can open it")]
    NoKeyslot,
    /// The volume (or a keyslot) uses a cipher this crate does not do.
    #[error("unsupported cipher {0}: only aes-xts-plain64 with 256- or 512-bit keys is supported")]
    UnsupportedCipher(String),
    /// A keyslot uses a key derivation this crate does not do.
    #[error("unsupported key derivation: {0}")]
    UnsupportedKdf(String),
    /// A LUKS feature this crate does not implement (integrity,
    /// reencryption segments, unusual sector size...).
    #[error("unsupported LUKS feature: {0}")]
    Unsupported(String),
    /// The header is damaged or not a LUKS header; the message names what
    /// is wrong.
    #[error("corrupt or invalid LUKS header: {0}")]
    Corrupt(String),
    /// The device ends before a structure the header points at.
    #[error("device truncated: {needed} bytes needed but it has {have} bytes")]
    Truncated {
        /// Bytes the read needed (its end offset).
        needed: u64,
        /// The device's size.
        have: u64,
    },
    /// Reading or writing the device failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The format options (or the device's size) do not make a volume
    /// cryptsetup accepts.
    #[error("invalid format options: {0}")]
    InvalidOptions(String),
    /// A keyslot's key derivation (or its volume-key digest), or the
    /// number of keyslots, is over the [`KdfLimits`] the open was given;
    /// nothing was derived for it. The message names the keyslot, the
    /// header field, its value and the limit.
    #[error("{0}: refused before deriving anything (raise the limit if the volume is genuine)")]
    OverLimit(String),
    /// The open was cancelled through [`KdfLimits::cancel`].
    #[error("opening the volume was cancelled")]
    Cancelled,
    /// The LUKS2 primary header is unusable and its area now carries
    /// another format's signature (an LVM label, a filesystem...): the
    /// device was probably reformatted, so the old secondary header is
    /// not used (cryptsetup refuses too). The message names what was found
    /// and how to recover on purpose
    /// ([`LuksOpenOptions::allow_secondary_header`]).
    #[error("ambiguous signatures: {0}")]
    AmbiguousSignatures(String),
    /// A key verb ([`add_key`], [`remove_key`], [`change_key`],
    /// [`kill_slot`]) cannot be done as asked: the slot is in use or not,
    /// the slot table is full, or it would remove the last usable slot.
    /// Nothing was written.
    #[error("{0}")]
    KeySlot(String),
    /// The image holds a whole header but no payload sector after it (a
    /// header backup, an image cut at its data offset) or its payload is
    /// elsewhere (a detached header): it can be inspected, dumped and
    /// opened, never served or decrypted. The message says why.
    #[error("no payload: a header-only image ({0})")]
    NoPayload(String),
    /// A header restore ([`restore_header`]) was refused before anything
    /// was written: the backup is not a LUKS header, or does not fit the
    /// image, or is another volume's and replacing it was not allowed
    /// ([`RestoreOptions::replace_other_volume`]). The message says which.
    #[error("header restore refused: {0}")]
    RestoreRefused(String),
}

impl From<LuksError> for std::io::Error {
    /// `Io` unwrapped; wrong passphrase and no keyslot as
    /// `PermissionDenied`; unsupported features as `Unsupported`; a corrupt
    /// header and a cost over the limits as `InvalidData`; truncation as
    /// `UnexpectedEof`; bad options as `InvalidInput`; cancellation as
    /// `Other`.
    fn from(e: LuksError) -> std::io::Error {
        use std::io::ErrorKind;
        let kind = match &e {
            LuksError::Io(inner) => inner.kind(),
            LuksError::WrongPassphrase | LuksError::NoKeyslot => ErrorKind::PermissionDenied,
            LuksError::UnsupportedCipher(_)
            | LuksError::UnsupportedKdf(_)
            | LuksError::Unsupported(_) => ErrorKind::Unsupported,
            LuksError::Corrupt(_) | LuksError::OverLimit(_) | LuksError::AmbiguousSignatures(_) => {
                ErrorKind::InvalidData
            }
            LuksError::Truncated { .. } | LuksError::NoPayload(_) => ErrorKind::UnexpectedEof,
            LuksError::InvalidOptions(_) | LuksError::KeySlot(_) | LuksError::RestoreRefused(_) => {
                ErrorKind::InvalidInput
            }
            LuksError::Cancelled => ErrorKind::Other,
        };
        match e {
            LuksError::Io(inner) => inner,
            other => std::io::Error::new(kind, other),
        }
    }
}

/// What [`format()`] makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatOptions {
    /// LUKS1 or LUKS2.
    pub version: LuksVersion,
    /// Volume key length: 32 (AES-128-XTS) or 64 (AES-256-XTS).
    pub key_bytes: usize,
    /// Data sector size: 512, or 4096 (LUKS2 only).
    pub sector_size: usize,
    /// The keyslot's key derivation (LUKS1: PBKDF2 only).
    pub pbkdf: Pbkdf,
    /// LUKS2 label (at most 47 bytes); LUKS1 has none.
    pub label: Option<String>,
}

impl Default for FormatOptions {
    /// LUKS2, AES-256-XTS (64-byte key), 512-byte sectors,
    /// [`Pbkdf::argon2id_default`].
    fn default() -> Self {
        FormatOptions {
            version: LuksVersion::Luks2,
            key_bytes: 64,
            sector_size: 512,
            pbkdf: Pbkdf::argon2id_default(),
            label: None,
        }
    }
}

impl FormatOptions {
    /// LUKS1, AES-256-XTS, [`Pbkdf::pbkdf2_default`].
    pub fn luks1() -> Self {
        FormatOptions {
            version: LuksVersion::Luks1,
            pbkdf: Pbkdf::pbkdf2_default(),
            ..FormatOptions::default()
        }
    }

    /// The cheapest parameters cryptsetup accepts, for tests only:
    /// PBKDF2-SHA256 with 1000 iterations (LUKS1) or Argon2id with 32 KiB,
    /// 4 passes, 1 lane (LUKS2). **Never for real data.**
    pub fn fast_for_tests(version: LuksVersion) -> Self {
        let pbkdf = match version {
            LuksVersion::Luks1 => Pbkdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: PBKDF2_MIN_ITERATIONS,
            },
            LuksVersion::Luks2 => Pbkdf::Argon2id {
                time: ARGON2_MIN_TIME,
                memory_kib: ARGON2_MIN_MEMORY_KIB,
                parallel: 1,
            },
        };
        FormatOptions {
            version,
            pbkdf,
            ..FormatOptions::default()
        }
    }

    /// cryptsetup's defaults for `version` with the keyslot's key
    /// derivation calibrated for `iter_time` of unlock time on this
    /// machine (see [`calibrate()`]): LUKS1 PBKDF2-SHA256, LUKS2 Argon2id
    /// (memory up to 1 GiB and half the available memory, 4 lanes or one
    /// per CPU). The benchmark takes a fraction of `iter_time`.
    ///
    /// **Returns:** the options and what the calibration chose (print it:
    /// `Calibrated` displays as `argon2id, 1048576 KiB, 5 passes, 4
    /// lanes (about 2.0 s to unlock, benchmarked)`).
    pub fn calibrated(
        version: LuksVersion,
        iter_time: std::time::Duration,
    ) -> Result<(FormatOptions, Calibrated), LuksError> {
        let (opts, kind) = match version {
            LuksVersion::Luks1 => (FormatOptions::luks1(), KdfKind::Pbkdf2(Hash::Sha256)),
            LuksVersion::Luks2 => (FormatOptions::default(), KdfKind::Argon2id),
        };
        opts.with_calibrated_kdf(&KdfTarget::new(kind, iter_time))
    }

    /// These options with the keyslot's key derivation chosen by
    /// [`calibrate()`] for `target` (costs fixed in `target` are kept; a
    /// PBKDF2 target is calibrated for this key size). A KDF the version
    /// cannot have (Argon2 in LUKS1) is refused before benchmarking.
    pub fn with_calibrated_kdf(
        mut self,
        target: &KdfTarget,
    ) -> Result<(FormatOptions, Calibrated), LuksError> {
        if self.version == LuksVersion::Luks1 && !matches!(target.kind, KdfKind::Pbkdf2(_)) {
            return Err(LuksError::InvalidOptions(format!(
                "{}: LUKS1 keyslots use PBKDF2 only",
                target.kind.name()
            )));
        }
        // Everything but the KDF is checked before the benchmark runs.
        FormatOptions {
            pbkdf: FormatOptions::fast_for_tests(self.version).pbkdf,
            ..self.clone()
        }
        .check()?;
        let c = calibrate::calibrate(target, self.key_bytes)?;
        self.pbkdf = c.pbkdf;
        self.check()?;
        Ok((self, c))
    }

    /// Check that these options can make an authenticated volume with
    /// tags under `mac`: LUKS2 with 4096-byte sectors (one tag covers one
    /// 4 KiB block).
    fn check_integrity(&self, mac: Mac) -> Result<(), LuksError> {
        if self.version != LuksVersion::Luks2 {
            return Err(LuksError::InvalidOptions(format!(
                "integrity ({mac}): an authenticated volume needs LUKS2 (its requirement and \
                 token live in the LUKS2 JSON metadata); LUKS1 cannot carry one"
            )));
        }
        if self.sector_size != 4096 {
            return Err(LuksError::InvalidOptions(format!(
                "sector size {}: an authenticated volume ({mac}) has 4096-byte sectors, one tag \
                 per 4 KiB block",
                self.sector_size
            )));
        }
        Ok(())
    }

    /// Check everything that does not depend on the device.
    fn check(&self) -> Result<(), LuksError> {
        if self.key_bytes != 32 && self.key_bytes != 64 {
            return Err(LuksError::InvalidOptions(format!(
                "key size {} bytes: aes-xts-plain64 takes 32 (AES-128) or 64 (AES-256) bytes",
                self.key_bytes
            )));
        }
        self.pbkdf.check_for_format()?;
        match self.version {
            LuksVersion::Luks1 => {
                if self.sector_size != 512 {
                    return Err(LuksError::InvalidOptions(format!(
                        "sector size {}: LUKS1 has 512-byte sectors only (use LUKS2 for 4096)",
                        self.sector_size
                    )));
                }
                if !matches!(self.pbkdf, Pbkdf::Pbkdf2 { .. }) {
                    return Err(LuksError::InvalidOptions(format!(
                        "{}: LUKS1 keyslots use PBKDF2 only",
                        self.pbkdf.name()
                    )));
                }
                if self.label.is_some() {
                    return Err(LuksError::InvalidOptions(
                        "LUKS1 headers have no label (use LUKS2)".to_string(),
                    ));
                }
            }
            LuksVersion::Luks2 => {
                if self.sector_size != 512 && self.sector_size != 4096 {
                    return Err(LuksError::InvalidOptions(format!(
                        "sector size {}: use 512 or 4096",
                        self.sector_size
                    )));
                }
                if let Some(l) = &self.label {
                    if l.len() > 47 || l.as_bytes().contains(&0) {
                        return Err(LuksError::InvalidOptions(format!(
                            "label {l:?}: at most 47 bytes and no NUL"
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

/// An opened LUKS volume: its geometry and its volume key.
pub struct LuksVolume {
    version: LuksVersion,
    uuid: String,
    label: Option<String>,
    cipher_spec: String,
    key: MasterKey,
    sector_size: usize,
    data_offset: u64,
    /// `None`: to the end of the device (LUKS1, LUKS2 `"dynamic"`).
    data_size: Option<u64>,
    iv_tweak: u64,
    keyslot: usize,
    used_secondary: bool,
    integrity: Option<IntegrityInfo>,
}

impl std::fmt::Debug for LuksVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("LuksVolume")
            .field("version", &self.version)
            .field("uuid", &self.uuid)
            .field("label", &self.label)
            .field("cipher_spec", &self.cipher_spec)
            .field("key", &self.key)
            .field("sector_size", &self.sector_size)
            .field("data_offset", &self.data_offset)
            .field("data_size", &self.data_size)
            .field("iv_tweak", &self.iv_tweak)
            .field("keyslot", &self.keyslot)
            .field("used_secondary_header", &self.used_secondary)
            .field("integrity", &self.integrity)
            .finish()
    }
}

impl LuksVolume {
    /// LUKS1 or LUKS2.
    pub fn version(&self) -> LuksVersion {
        self.version
    }

    /// The volume's UUID as written in the header.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// The LUKS2 label, if one is set.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// The data cipher in dm-crypt notation: always `"aes-xts-plain64"`.
    pub fn cipher_spec(&self) -> &str {
        &self.cipher_spec
    }

    /// The volume key: 32 or 64 bytes, data key then tweak key.
    pub fn master_key(&self) -> &[u8] {
        self.key.as_bytes()
    }

    /// The volume key with its lock status.
    pub fn master_key_info(&self) -> &MasterKey {
        &self.key
    }

    /// Data sector size: 512 or 4096.
    pub fn sector_size(&self) -> usize {
        self.sector_size
    }

    /// Byte offset of the encrypted payload on the device.
    pub fn data_offset_bytes(&self) -> u64 {
        self.data_offset
    }

    /// Payload length on a device of `device_bytes`: to the device's end
    /// (LUKS1, LUKS2 `"dynamic"`) or the segment's fixed size, whichever
    /// is shorter, rounded down to whole sectors. ([`open`] refuses a
    /// fixed size that runs past the device it opened; a caller handing
    /// in another size checks [`Self::segment_size_bytes`] itself.)
    pub fn data_size_bytes(&self, device_bytes: u64) -> u64 {
        let to_end = device_bytes.saturating_sub(self.data_offset);
        let len = self.data_size.map_or(to_end, |s| s.min(to_end));
        len - len % self.sector_size as u64
    }

    /// The payload to serve or decrypt on a device of `device_bytes`:
    /// [`Self::data_size_bytes`], which must hold at least one sector.
    ///
    /// **Returns:** [`LuksError::NoPayload`] for a header-only image (the
    /// device ends within the first payload sector) or a detached header
    /// (data offset 0: the payload is on another device).
    pub fn payload_bytes(&self, device_bytes: u64) -> Result<u64, LuksError> {
        if self.data_offset == 0 {
            return Err(LuksError::NoPayload(
                "a detached header: its payload is on another device".to_string(),
            ));
        }
        let size = self.data_size_bytes(device_bytes);
        if size == 0 {
            return Err(LuksError::NoPayload(format!(
                "the {device_bytes}-byte image ends before a {}-byte payload sector at offset {}",
                self.sector_size, self.data_offset
            )));
        }
        Ok(size)
    }

    /// The data segment's fixed size in bytes (LUKS2), or `None` when it
    /// runs to the end of the device (LUKS1, LUKS2 `"dynamic"`).
    pub fn segment_size_bytes(&self) -> Option<u64> {
        self.data_size
    }

    /// dm-crypt's `iv_offset` for the segment (LUKS2 `iv_tweak`, in
    /// 512-byte units; 0 for LUKS1 and for anything cryptsetup formats).
    pub fn iv_offset(&self) -> u64 {
        self.iv_tweak
    }

    /// The data cipher as cryptsetup would set dm-crypt up for this
    /// volume: the volume key, the segment's sector size, IVs in 512-byte
    /// units (`iv_large_sectors` off — cryptsetup never sets it for LUKS,
    /// see the module notes) starting at the segment's `iv_tweak` (0).
    /// Sector 0 of the cipher is the sector at
    /// [`Self::data_offset_bytes`].
    pub fn xts_cipher(&self) -> crate::Result<XtsCipher> {
        XtsCipher::builder(self.key.as_bytes())
            .sector_size_bytes(self.sector_size)
            .iv_large_sectors(false)
            .iv_offset(self.iv_tweak)
            .build()
    }

    /// The keyslot that opened (or, after [`format()`], was written).
    pub fn keyslot(&self) -> usize {
        self.keyslot
    }

    /// Whether the LUKS2 primary header was damaged (or older) and the
    /// secondary copy was used. Always `false` for LUKS1.
    pub fn used_secondary_header(&self) -> bool {
        self.used_secondary
    }

    /// Where the tags and tree of an authenticated volume (`luks format
    /// --integrity`) live; `None` for a volume without them. Its data
    /// segment then has the fixed size `layout.data_bytes()`
    /// ([`Self::segment_size_bytes`]).
    pub fn integrity(&self) -> Option<&IntegrityInfo> {
        self.integrity.as_ref()
    }
}

/// One keyslot as [`inspect`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyslotInfo {
    /// Slot number.
    pub index: usize,
    /// Its key derivation, or `None` where it is one this crate does not
    /// do (see `problem`).
    pub pbkdf: Option<Pbkdf>,
    /// Why this slot cannot be used here, if it cannot.
    pub problem: Option<String>,
}

/// A volume's header, read without a passphrase (`cryptsetup luksDump`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksInfo {
    /// LUKS1 or LUKS2.
    pub version: LuksVersion,
    /// UUID.
    pub uuid: String,
    /// LUKS2 label.
    pub label: Option<String>,
    /// Data cipher (always `aes-xts-plain64`: others are refused).
    pub cipher_spec: String,
    /// Volume key length in bytes.
    pub key_bytes: usize,
    /// Data sector size.
    pub sector_size: usize,
    /// Payload offset in bytes.
    pub data_offset_bytes: u64,
    /// Fixed payload size, or `None` to the end of the device.
    pub data_size_bytes: Option<u64>,
    /// Active keyslots, in the order they are tried.
    pub keyslots: Vec<KeyslotInfo>,
    /// LUKS2: the secondary header copy was used.
    pub used_secondary_header: bool,
    /// LUKS2: an authenticated volume's integrity area (the
    /// `iopages-integrity-v1` requirement and its token).
    pub integrity: Option<IntegrityInfo>,
}

/// How to check a candidate volume key.
pub(crate) struct Digest {
    /// The header field of `iterations`, for messages
    /// (`mk-digest-iter`, `digests.0.iterations`).
    pub field: String,
    pub hash: Hash,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub value: Vec<u8>,
}

/// One keyslot, ready to try.
pub(crate) struct SlotPlan {
    pub index: usize,
    pub pbkdf: Pbkdf,
    /// Prefix of the KDF's header fields, for messages (`key-slot 0 `,
    /// `keyslots.0.kdf.`).
    pub kdf_field: String,
    pub salt: Vec<u8>,
    /// Byte offset and length (whole 512-byte sectors) of the area.
    pub area_offset: u64,
    pub area_len: u64,
    /// Key size of the area cipher (the derived key's length).
    pub area_key_bytes: usize,
    pub af_hash: Hash,
    pub stripes: u32,
    /// Volume key length.
    pub key_bytes: usize,
    pub digest: Digest,
}

/// A parsed header: what [`inspect`] shows and what [`open`] tries.
pub(crate) struct Parsed {
    pub info: LuksInfo,
    pub iv_tweak: u64,
    /// In try order; `Err` for slots that cannot be used here.
    pub slots: Vec<Result<SlotPlan, LuksError>>,
}

/// Where a header is read from: a file or block device, or any backend
/// (a remote NBD export), read only.
enum Src<'a> {
    File(&'a File),
    Backend(&'a dyn crate::backend::Backend),
}

/// A device: a shared file (or a backend) with its size.
pub(crate) struct Dev<'a> {
    src: Src<'a>,
    size: u64,
}

/// A backend is read in whole aligned blocks of this many bytes (a remote
/// export may refuse smaller or unaligned requests).
const BACKEND_READ_ALIGN: u64 = 4096;

impl<'a> Dev<'a> {
    pub(crate) fn new(file: &'a File) -> Result<Dev<'a>, LuksError> {
        let meta = file.metadata()?;
        let size = if meta.file_type().is_block_device() {
            block_device_size(file)?
        } else {
            meta.len()
        };
        Ok(Dev {
            src: Src::File(file),
            size,
        })
    }

    fn of_backend(b: &'a dyn crate::backend::Backend) -> Dev<'a> {
        Dev {
            src: Src::Backend(b),
            size: b.size_bytes(),
        }
    }

    fn file(&self) -> Result<&'a File, LuksError> {
        match self.src {
            Src::File(f) => Ok(f),
            Src::Backend(_) => Err(LuksError::Io(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "a header read through a backend cannot be written",
            ))),
        }
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Read exactly `buf.len()` bytes at `offset`, or say where the device
    /// ends.
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), LuksError> {
        let end = offset.checked_add(buf.len() as u64).ok_or_else(|| {
            LuksError::Corrupt(format!("offset {offset} + length {} overflows", buf.len()))
        })?;
        if end > self.size {
            return Err(LuksError::Truncated {
                needed: end,
                have: self.size,
            });
        }
        let read = match self.src {
            Src::File(f) => f.read_exact_at(buf, offset),
            Src::Backend(b) => read_aligned(b, offset, buf, self.size),
        };
        read.map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                LuksError::Truncated {
                    needed: end,
                    have: self.size,
                }
            } else {
                LuksError::Io(e)
            }
        })
    }

    /// Write `buf` at `offset`: a file with one positioned write, a
    /// backend with one write of whole [`BACKEND_READ_ALIGN`]-byte blocks
    /// (the partial blocks at either edge read first and merged).
    pub(crate) fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), LuksError> {
        match self.src {
            Src::File(f) => Ok(f.write_all_at(buf, offset)?),
            Src::Backend(b) => Ok(write_aligned(b, offset, buf, self.size)?),
        }
    }

    /// Make every write so far durable: `fsync` for a file, a flush for a
    /// backend. The key verbs call it between the steps whose order keeps
    /// a volume openable through a crash.
    pub(crate) fn sync(&self) -> Result<(), LuksError> {
        match self.src {
            Src::File(f) => Ok(f.sync_all()?),
            Src::Backend(b) => Ok(b.flush()?),
        }
    }

    /// Write zeros over `[offset, offset + len)`.
    pub(crate) fn zero(&self, offset: u64, len: u64) -> Result<(), LuksError> {
        let chunk = vec![0u8; 1 << 20];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(chunk.len() as u64) as usize;
            self.write_at(offset + done, &chunk[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

/// Read `buf.len()` bytes at `offset` of `b` (of `size` bytes) through
/// whole [`BACKEND_READ_ALIGN`]-byte blocks, clipped to the device's end.
fn read_aligned(
    b: &dyn crate::backend::Backend,
    offset: u64,
    buf: &mut [u8],
    size: u64,
) -> std::io::Result<()> {
    let start = offset & !(BACKEND_READ_ALIGN - 1);
    let end = round_up(offset + buf.len() as u64, BACKEND_READ_ALIGN)
        .unwrap_or(u64::MAX)
        .min(size);
    let mut block = vec![0u8; (end - start) as usize];
    b.read_at(start, &mut [&mut block[..]])?;
    let from = (offset - start) as usize;
    buf.copy_from_slice(&block[from..from + buf.len()]);
    Ok(())
}

/// Write `buf` at `offset` of `b` (of `size` bytes) as one write of whole
/// [`BACKEND_READ_ALIGN`]-byte blocks (clipped to the device's end); the
/// bytes of the edge blocks outside `buf` are read first and kept.
fn write_aligned(
    b: &dyn crate::backend::Backend,
    offset: u64,
    buf: &[u8],
    size: u64,
) -> std::io::Result<()> {
    let end = offset + buf.len() as u64;
    if end > size {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "write of {} bytes at {offset} leaves the {size}-byte device",
                buf.len()
            ),
        ));
    }
    let start = offset & !(BACKEND_READ_ALIGN - 1);
    let stop = round_up(end, BACKEND_READ_ALIGN)
        .unwrap_or(u64::MAX)
        .min(size);
    let mut block = vec![0u8; (stop - start) as usize];
    if start != offset || stop != end {
        b.read_at(start, &mut [&mut block[..]])?;
    }
    let from = (offset - start) as usize;
    block[from..from + buf.len()].copy_from_slice(buf);
    b.write_at(start, &[&block[..]])
}

/// A block device's size: `BLKGETSIZE64`, as the io_uring backend asks it.
fn block_device_size(file: &File) -> Result<u64, LuksError> {
    Ok(crate::uring::block_device_size(file)?)
}

/// The keyslot-area cipher: `aes-xts-plain64`, 512-byte sectors, IV 0 at
/// the area's start.
pub(crate) fn area_cipher(key: &[u8]) -> Result<XtsCipher, LuksError> {
    XtsCipher::builder(key)
        .sector_size_bytes(AREA_SECTOR)
        .iv_large_sectors(true)
        .build()
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("keyslot cipher: {e}"))))
}

/// Round `n` up to a multiple of `to` (a power of two), `None` on overflow.
pub(crate) fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v & !(to - 1))
}

/// Random bytes from OpenSSL's CSPRNG.
pub(crate) fn random(buf: &mut [u8]) -> Result<(), LuksError> {
    openssl::rand::rand_bytes(buf)
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("OpenSSL random: {e}"))))
}

/// A random version-4 UUID in the usual 8-4-4-4-12 lowercase form.
pub(crate) fn random_uuid() -> Result<String, LuksError> {
    let mut b = [0u8; 16];
    random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// A fresh random volume key whose halves differ (XTS needs independent
/// data and tweak keys).
pub(crate) fn random_master_key(len: usize) -> Result<SecretBuf, LuksError> {
    let mut k = kdf::derived(len)?;
    loop {
        random(k.as_mut_slice())?;
        let (a, b) = k.as_slice().split_at(len / 2);
        if a != b {
            return Ok(k);
        }
    }
}

/// The PBKDF2 digest of `key` as `d` describes it.
pub(crate) fn digest_of(key: &[u8], d: &Digest) -> Result<Vec<u8>, LuksError> {
    let mut out = vec![0u8; d.value.len()];
    kdf::pbkdf2(d.hash, key, &d.salt, d.iterations, &mut out)?;
    Ok(out)
}

/// Try one keyslot: `Ok(Some(key))` when the passphrase opens it.
fn try_slot(
    dev: &Dev<'_>,
    slot: &SlotPlan,
    passphrase: &[u8],
    limits: &KdfLimits,
) -> Result<Option<SecretBuf>, LuksError> {
    // Every cost is checked before anything is read, allocated or derived.
    limits.check_slot(slot)?;
    limits.check_cancel()?;
    if slot.area_len > MAX_AF_BYTES {
        return Err(LuksError::Corrupt(format!(
            "keyslot {}: area of {} bytes is larger than any LUKS keyslot",
            slot.index, slot.area_len
        )));
    }
    // Read first: a truncated device is reported before the slow KDF.
    let mut area = kdf::derived(slot.area_len as usize)?;
    dev.read_at(slot.area_offset, area.as_mut_slice())?;
    let mut dk = kdf::derived(slot.area_key_bytes)?;
    slot.pbkdf
        .derive(passphrase, &slot.salt, dk.as_mut_slice())?;
    let (a, b) = dk.as_slice().split_at(dk.len() / 2);
    if a == b {
        // Only a 2^-128 chance for a right passphrase; XTS refuses the key.
        return Ok(None);
    }
    let mut cipher = area_cipher(dk.as_slice())?;
    cipher
        .decrypt_sectors_in_place(0, area.as_mut_slice())
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("keyslot cipher: {e}"))))?;
    drop(cipher);
    let key = af::merge(area.as_slice(), slot.key_bytes, slot.stripes, slot.af_hash)?;
    limits.check_cancel()?;
    let got = digest_of(key.as_slice(), &slot.digest)?;
    if kdf::ct_eq(&got, &slot.digest.value) {
        Ok(Some(key))
    } else {
        Ok(None)
    }
}

fn parse(dev: &Dev<'_>, max_keyslots: usize, opts: &LuksOpenOptions) -> Result<Parsed, LuksError> {
    let mut head = [0u8; 8];
    match dev.read_at(0, &mut head) {
        Ok(()) => {}
        Err(LuksError::Truncated { have, .. }) if have < 8 => {
            return Err(LuksError::Truncated { needed: 8, have })
        }
        Err(e) => return Err(e),
    }
    let version = u16::from_be_bytes([head[6], head[7]]);
    if head[..6] == MAGIC && version == 1 {
        return luks1::parse(dev);
    }
    if head[..6] == MAGIC && version != 2 {
        // A damaged LUKS2 primary may still have a good secondary copy.
        return luks2::parse(dev, max_keyslots, opts.allow_secondary_header).map_err(|e| match e {
            LuksError::Corrupt(m) => LuksError::Corrupt(format!(
                "LUKS version {version} at offset 0: only versions 1 and 2 exist ({m})"
            )),
            other => other,
        });
    }
    // LUKS2, or a damaged primary header whose secondary copy may live on.
    luks2::parse(dev, max_keyslots, opts.allow_secondary_header)
}

/// How to open (or inspect) a volume, beyond the passphrase and the
/// [`KdfLimits`]. `LuksOpenOptions::default()` is what [`open_with`] and
/// [`inspect`] use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LuksOpenOptions {
    /// Use the LUKS2 secondary header even when the primary header area
    /// carries another format's signature (an LVM2 label, an ext4, XFS or
    /// btrfs superblock, swap, MD RAID, a partition table...). Off by
    /// default: such a device was most likely reformatted, and serving
    /// the old LUKS volume would write over the new format's data, so the
    /// open fails with [`LuksError::AmbiguousSignatures`] (cryptsetup
    /// refuses likewise). A primary that is merely damaged or wiped (no
    /// other signature) falls back to the secondary whatever this says.
    /// Turn it on only to recover the LUKS2 volume on purpose.
    pub allow_secondary_header: bool,
}

impl LuksOpenOptions {
    /// The defaults: no secondary header over another format's signature.
    pub fn new() -> Self {
        LuksOpenOptions::default()
    }

    /// Set [`Self::allow_secondary_header`].
    pub fn allow_secondary_header(mut self, yes: bool) -> Self {
        self.allow_secondary_header = yes;
        self
    }
}

/// Read a volume's header without a passphrase.
///
/// **Returns:** the header's description, or the error [`open`] would give
/// before trying any passphrase.
pub fn inspect(dev: &File) -> Result<LuksInfo, LuksError> {
    inspect_with_options(dev, &LuksOpenOptions::default())
}

/// [`inspect`] with [`LuksOpenOptions`].
pub fn inspect_with_options(dev: &File, opts: &LuksOpenOptions) -> Result<LuksInfo, LuksError> {
    Ok(parse(&Dev::new(dev)?, LUKS2_KEYSLOTS_MAX, opts)?.info)
}

/// Open a LUKS1 or LUKS2 volume with the default [`KdfLimits`]: see
/// [`open_with`].
pub fn open(dev: &File, passphrase: &[u8]) -> Result<LuksVolume, LuksError> {
    open_with(dev, passphrase, &KdfLimits::default())
}

/// Open a LUKS1 or LUKS2 volume: try every usable keyslot with
/// `passphrase` (LUKS2 in priority order) until one's digest checks.
/// Each keyslot's KDF costs (and its digest's iterations) are checked
/// against `limits` before anything is derived for it, and the keyslot
/// count when the header is parsed; the cancel flag in `limits` is looked
/// at before every derivation.
///
/// Reads only, with positioned reads, so a `&File` shared with other
/// readers works; block devices and regular files alike.
///
/// **Returns:** [`LuksError::WrongPassphrase`] when no slot opens,
/// [`LuksError::NoKeyslot`] when none is active,
/// [`LuksError::OverLimit`] when no slot opens and one was not tried for
/// its cost (or the header has too many keyslots),
/// [`LuksError::Cancelled`] once cancelled, the slot's own error when no
/// slot could even be tried (unsupported KDF...), and header errors
/// ([`LuksError::Corrupt`] — among them a fixed data segment running
/// past the end of the device —, [`LuksError::Truncated`],
/// [`LuksError::UnsupportedCipher`]...) before any KDF runs.
pub fn open_with(
    dev: &File,
    passphrase: &[u8],
    limits: &KdfLimits,
) -> Result<LuksVolume, LuksError> {
    open_with_options(dev, passphrase, limits, &LuksOpenOptions::default())
}

/// [`open_with`] with [`LuksOpenOptions`] (e.g. to open through the LUKS2
/// secondary header on purpose when the primary area carries another
/// format's signature).
pub fn open_with_options(
    dev: &File,
    passphrase: &[u8],
    limits: &KdfLimits,
    opts: &LuksOpenOptions,
) -> Result<LuksVolume, LuksError> {
    open_dev(&Dev::new(dev)?, passphrase, limits, opts)
}

/// [`open_with_options`] on a [`Backend`](crate::backend::Backend) instead
/// of a file: a header stored on a remote export, read in whole 4096-byte
/// blocks.
pub fn open_backend(
    dev: &dyn crate::backend::Backend,
    passphrase: &[u8],
    limits: &KdfLimits,
    opts: &LuksOpenOptions,
) -> Result<LuksVolume, LuksError> {
    open_dev(&Dev::of_backend(dev), passphrase, limits, opts)
}

fn open_dev(
    dev: &Dev<'_>,
    passphrase: &[u8],
    limits: &KdfLimits,
    opts: &LuksOpenOptions,
) -> Result<LuksVolume, LuksError> {
    let Parsed {
        info,
        iv_tweak,
        slots,
    } = parse(dev, limits.max_keyslots, opts)?;
    limits.check_keyslot_count(info.version, info.keyslots.len())?;
    // A device ending at or before the data offset is a header-only image
    // (a header backup): it opens, as cryptsetup opens one for its key
    // verbs; [`LuksVolume::payload_bytes`] refuses to serve it.
    if dev.size() > info.data_offset_bytes {
        check_extents(&info, dev.size())?;
    }
    // Damage (a truncated or corrupt slot) outranks a slot over the
    // limits (the passphrase may be its), which outranks a wrong
    // passphrase, which outranks a slot this crate cannot use.
    let mut damage = None;
    let mut over = None;
    let mut unsupported = None;
    let mut tried = 0usize;
    for slot in slots {
        limits.check_cancel()?;
        let outcome = slot.and_then(|s| {
            tried += 1;
            try_slot(dev, &s, passphrase, limits).map(|k| k.map(|k| (s.index, k)))
        });
        match outcome {
            Ok(Some((index, key))) => return Ok(volume(info, key, index, iv_tweak)),
            Ok(None) => {}
            Err(e @ (LuksError::Io(_) | LuksError::Cancelled)) => return Err(e),
            Err(e @ LuksError::OverLimit(_)) => {
                over.get_or_insert(e);
            }
            Err(
                e @ (LuksError::UnsupportedCipher(_)
                | LuksError::UnsupportedKdf(_)
                | LuksError::Unsupported(_)),
            ) => {
                unsupported.get_or_insert(e);
            }
            Err(e) => {
                damage.get_or_insert(e);
            }
        }
    }
    if let Some(e) = damage.or(over) {
        return Err(e);
    }
    if tried > 0 {
        return Err(LuksError::WrongPassphrase);
    }
    Err(unsupported.unwrap_or(LuksError::NoKeyslot))
}

/// Check that what the header places after its data offset lies inside
/// the device of `size` bytes: a fixed data segment (dm-crypt would refuse
/// the table) and an authenticated volume's integrity area.
fn check_extents(info: &LuksInfo, size: u64) -> Result<(), LuksError> {
    if let Some(seg) = info.data_size_bytes {
        let end = info.data_offset_bytes.checked_add(seg);
        if end.is_none_or(|end| end > size) {
            return Err(LuksError::Corrupt(format!(
                "the data segment's size {seg} at offset {} runs past the end of the \
                 {size}-byte device (a truncated image, or a bad size field)",
                info.data_offset_bytes,
            )));
        }
    }
    if let Some(i) = &info.integrity {
        if i.area_end() > size {
            return Err(LuksError::Corrupt(format!(
                "the integrity area [{}, {}) runs past the end of the {size}-byte device (a \
                 truncated image, or a bad {INTEGRITY_TOKEN} token)",
                i.area_offset,
                i.area_end()
            )));
        }
    }
    Ok(())
}

/// [`open`] the file or block device at `path`, read-only.
pub fn open_path(path: impl AsRef<Path>, passphrase: &[u8]) -> Result<LuksVolume, LuksError> {
    open_path_with(path, passphrase, &KdfLimits::default())
}

/// [`open_with`] the file or block device at `path`, read-only.
pub fn open_path_with(
    path: impl AsRef<Path>,
    passphrase: &[u8],
    limits: &KdfLimits,
) -> Result<LuksVolume, LuksError> {
    open_path_with_options(path, passphrase, limits, &LuksOpenOptions::default())
}

/// [`open_with_options`] the file or block device at `path`, read-only.
pub fn open_path_with_options(
    path: impl AsRef<Path>,
    passphrase: &[u8],
    limits: &KdfLimits,
    opts: &LuksOpenOptions,
) -> Result<LuksVolume, LuksError> {
    let f = File::open(path.as_ref())?;
    open_with_options(&f, passphrase, limits, opts)
}

/// `s` safe to print on a terminal: control characters (C0, DEL, C1 —
/// terminal escapes among them), the Unicode bidirectional overrides and
/// isolates (which reorder what follows them) and backslashes are
/// escaped Rust-style (`\u{1b}`, `\n`, `\\`); anything else is kept.
/// Borrowed when there is nothing to escape. For header strings
/// (UUID, label, subsystem) before they are shown.
pub fn printable(s: &str) -> Cow<'_, str> {
    fn risky(c: char) -> bool {
        c.is_control()
            || c == '\\'
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }
    if !s.chars().any(risky) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if risky(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Whether `dev` starts with a LUKS1 or LUKS2 primary header magic and
/// version (as `cryptsetup isLuks`; a volume whose primary header is
/// destroyed answers `false` even if [`open`] could use its secondary).
pub fn is_luks(dev: &File) -> bool {
    let mut head = [0u8; 8];
    if dev.read_exact_at(&mut head, 0).is_err() {
        return false;
    }
    head[..6] == MAGIC && matches!(u16::from_be_bytes([head[6], head[7]]), 1 | 2)
}

/// Write a new LUKS header with one keyslot (slot 0) for `passphrase` and
/// a random volume key; everything between the device start and the
/// payload is overwritten (zeros, then the headers and key material). The
/// payload itself is not touched.
///
/// The device must already have its size: at least the header plus one
/// sector of payload (2 MiB + 512 bytes for LUKS1, 16 MiB + one sector for
/// LUKS2), and for LUKS2 a payload that is a whole number of sectors, as
/// cryptsetup requires.
///
/// **Returns:** the opened volume, or [`LuksError::InvalidOptions`] for
/// options cryptsetup would refuse or a device too small.
pub fn format(
    dev: &File,
    passphrase: &[u8],
    opts: &FormatOptions,
) -> Result<LuksVolume, LuksError> {
    Ok(format_with(dev, passphrase, opts, None)?.0)
}

/// [`format()`] an authenticated volume whose tags use `mac`: a LUKS2
/// header whose data segment has a fixed size and is followed by the
/// integrity area, the largest [`Layout::fit`](crate::integrity::Layout::fit)
/// gives for the device after the 16 MiB header; the header's
/// `config.requirements.mandatory` lists [`INTEGRITY_REQUIREMENT`] (so
/// cryptsetup refuses to open it) and one [`INTEGRITY_TOKEN`] token holds
/// the geometry. The area's superblock (epoch 0, empty tree) is written
/// after the header ([`crate::integrity::format_area`]).
///
/// **Returns:** the opened volume (its [`LuksVolume::integrity`] set) and
/// the anchor a new state file holds; [`LuksError::InvalidOptions`] for
/// LUKS1, a sector size other than 4096, or a device too small for one
/// data block and its area.
pub fn format_integrity(
    dev: &File,
    passphrase: &[u8],
    opts: &FormatOptions,
    mac: Mac,
) -> Result<(LuksVolume, Anchor), LuksError> {
    let (vol, anchor) = format_with(dev, passphrase, opts, Some(mac))?;
    let anchor = anchor.expect("an authenticated format returns its anchor");
    assert_eq!(anchor.mac, mac);
    Ok((vol, anchor))
}

/// [`format()`] or [`format_integrity`]: the anchor is `Some` with `mac`.
fn format_with(
    dev: &File,
    passphrase: &[u8],
    opts: &FormatOptions,
    mac: Option<Mac>,
) -> Result<(LuksVolume, Option<Anchor>), LuksError> {
    opts.check()?;
    if let Some(mac) = mac {
        opts.check_integrity(mac)?;
    }
    let dev = Dev::new(dev)?;
    let vol = match opts.version {
        LuksVersion::Luks1 => luks1::format(&dev, passphrase, opts)?,
        LuksVersion::Luks2 => luks2::format(&dev, passphrase, opts, mac)?,
    };
    let anchor = match vol.integrity() {
        Some(i) => Some(integrity_meta::format_area(
            &dev,
            i,
            vol.master_key(),
            vol.uuid(),
        )?),
        None => None,
    };
    assert_eq!(anchor.is_some(), mac.is_some());
    dev.file()?.sync_all()?;
    Ok((vol, anchor))
}

/// [`format()`] the file or block device at `path`. With `size_bytes`, a
/// regular file is created if missing and set to that size first.
pub fn format_path(
    path: impl AsRef<Path>,
    size_bytes: Option<u64>,
    passphrase: &[u8],
    opts: &FormatOptions,
) -> Result<LuksVolume, LuksError> {
    let f = open_for_format(path.as_ref(), size_bytes)?;
    format(&f, passphrase, opts)
}

/// The device at `path` opened for writing; with `size_bytes`, a regular
/// file created if missing and set to that size.
fn open_for_format(path: &Path, size_bytes: Option<u64>) -> Result<File, LuksError> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(size_bytes.is_some())
        .truncate(false)
        .open(path)?;
    if let Some(size) = size_bytes {
        if !f.metadata()?.file_type().is_file() {
            return Err(LuksError::InvalidOptions(format!(
                "{} is not a regular file: a size can only be set on a regular file",
                path.display()
            )));
        }
        f.set_len(size)?;
    }
    Ok(f)
}

/// [`format_integrity`] the file or block device at `path`. With
/// `size_bytes`, a regular file is created if missing and set to that
/// size first (the header, the data and the integrity area all fit in
/// it).
pub fn format_integrity_path(
    path: impl AsRef<Path>,
    size_bytes: Option<u64>,
    passphrase: &[u8],
    opts: &FormatOptions,
    mac: Mac,
) -> Result<(LuksVolume, Anchor), LuksError> {
    // Refused before the file is created or resized.
    opts.check()?;
    opts.check_integrity(mac)?;
    let f = open_for_format(path.as_ref(), size_bytes)?;
    format_integrity(&f, passphrase, opts, mac)
}

/// Build a [`LuksVolume`] for a freshly formatted volume.
pub(crate) fn formatted_volume(info: LuksInfo, key: SecretBuf) -> LuksVolume {
    volume(info, key, 0, 0)
}

/// The opened volume: the header's description, the volume key that
/// `keyslot` gave, and the data segment's IV tweak.
fn volume(info: LuksInfo, key: SecretBuf, keyslot: usize, iv_tweak: u64) -> LuksVolume {
    LuksVolume {
        version: info.version,
        uuid: info.uuid,
        label: info.label,
        cipher_spec: info.cipher_spec,
        key: MasterKey::from_secret(key),
        sector_size: info.sector_size,
        data_offset: info.data_offset_bytes,
        data_size: info.data_size_bytes,
        iv_tweak,
        keyslot,
        used_secondary: info.used_secondary_header,
        integrity: info.integrity,
    }
}

/// Encrypt `key` into a keyslot area: AF-split it, pad to whole 512-byte
/// sectors, encrypt with the key derived from `passphrase`.
pub(crate) fn seal_keyslot(
    key: &[u8],
    passphrase: &[u8],
    pbkdf: &Pbkdf,
    salt: &[u8],
    af_hash: Hash,
) -> Result<SecretBuf, LuksError> {
    let split = af::split(key, STRIPES, af_hash)?;
    let len = round_up(split.len() as u64, AREA_SECTOR as u64).unwrap_or(u64::MAX) as usize;
    let mut area = kdf::derived(len)?;
    area.as_mut_slice()[..split.len()].copy_from_slice(split.as_slice());
    drop(split);
    let mut dk = kdf::derived(key.len())?;
    pbkdf.derive(passphrase, salt, dk.as_mut_slice())?;
    let (a, b) = dk.as_slice().split_at(dk.len() / 2);
    if a == b {
        return Err(LuksError::Io(std::io::Error::other(
            "the derived keyslot key has equal halves (a 2^-128 event): format again",
        )));
    }
    let mut cipher = area_cipher(dk.as_slice())?;
    cipher
        .encrypt_sectors_in_place(0, area.as_mut_slice())
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("keyslot cipher: {e}"))))?;
    Ok(area)
}

/// Check that `size` holds a header ending at `data_offset` plus one
/// payload sector.
pub(crate) fn check_device_size(
    size: u64,
    data_offset: u64,
    sector: usize,
    version: LuksVersion,
) -> Result<(), LuksError> {
    let need = data_offset + sector as u64;
    if size < need {
        return Err(LuksError::InvalidOptions(format!(
            "the device is {size} bytes; a {version} volume needs at least {need} bytes \
             ({data_offset} bytes of header and keyslots plus one {sector}-byte sector)"
        )));
    }
    if !(size - data_offset).is_multiple_of(sector as u64) {
        return Err(LuksError::InvalidOptions(format!(
            "the payload ({} bytes after the {data_offset}-byte header) is not a whole number \
             of {sector}-byte sectors; cryptsetup would refuse to open it",
            size - data_offset
        )));
    }
    Ok(())
}
