//! `iopages luks add-key | remove-key | change-key | kill-slot`: manage a
//! volume's passphrases, on a file, a block device or a remote NBD export.
//!
//! Owns: the key verbs' command line — their arguments, the new slot's
//! KDF (chosen as `luks format` chooses it: benchmarked for `--iter-time`
//! unless its costs are given), progress while it runs, and after every
//! write a read-back of the header (a remote store has no lock and no
//! compare-and-swap: a lost update is reported, not hidden). Must never:
//! read both passphrases from standard input, write a header without the
//! image's exclusive lock (`luks_target`), or print a passphrase.

use crate::luks_kdf::{kdf_limits, HashArg, KdfCostArgs, PbkdfArg};
use crate::luks_target::{self, Target};
use crate::passphrase::read_passphrase;
use iopages_crypt::luks::{
    self, Hash, HeaderDevice, KdfKind, KeyChange, KeyOptions, LuksError, LuksInfo, LuksVersion,
    Pbkdf,
};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The new key slot's key derivation, as `luks format` takes it.
#[derive(clap::Args)]
pub struct KdfArgs {
    /// Key derivation of the new key slot (default: argon2id for LUKS2,
    /// pbkdf2 for LUKS1, which has no other).
    #[arg(long, value_enum)]
    pbkdf: Option<PbkdfArg>,
    /// PBKDF2's hash (LUKS1: default and only choice the header's hash).
    #[arg(long, value_enum)]
    hash: Option<HashArg>,
    #[command(flatten)]
    costs: KdfCostArgs,
    /// Most Argon2 memory a key slot may ask for when unlocking (K, M, G
    /// suffixes; default 1G, at most 4G).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    max_kdf_memory: Option<u64>,
}

#[derive(clap::Args)]
pub struct AddKeyArgs {
    /// The LUKS image: a file, a block device or an NBD URI.
    image: PathBuf,
    /// An existing passphrase: the file's exact bytes, or `-` for one line
    /// of standard input.
    #[arg(long, value_name = "FILE")]
    passphrase_file: PathBuf,
    /// The new passphrase (`-`: one line of standard input).
    #[arg(long, value_name = "FILE")]
    new_passphrase_file: PathBuf,
    /// The key slot to fill (default: the lowest free one).
    #[arg(long, value_name = "N")]
    key_slot: Option<usize>,
    #[command(flatten)]
    kdf: KdfArgs,
}

#[derive(clap::Args)]
pub struct RemoveKeyArgs {
    /// The LUKS image: a file, a block device or an NBD URI.
    image: PathBuf,
    /// The passphrase to remove (`-`: one line of standard input).
    #[arg(long, value_name = "FILE")]
    passphrase_file: PathBuf,
    /// Remove it even if it is the last usable key slot (the volume can
    /// then never be opened again).
    #[arg(long)]
    yes: bool,
    /// Most Argon2 memory a key slot may ask for (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    max_kdf_memory: Option<u64>,
}

#[derive(clap::Args)]
pub struct ChangeKeyArgs {
    /// The LUKS image: a file, a block device or an NBD URI.
    image: PathBuf,
    /// The passphrase to replace (`-`: one line of standard input).
    #[arg(long, value_name = "FILE")]
    passphrase_file: PathBuf,
    /// The new passphrase (`-`: one line of standard input).
    #[arg(long, value_name = "FILE")]
    new_passphrase_file: PathBuf,
    #[command(flatten)]
    kdf: KdfArgs,
}

#[derive(clap::Args)]
pub struct KillSlotArgs {
    /// The LUKS image: a file, a block device or an NBD URI.
    image: PathBuf,
    /// The key slot to remove.
    slot: usize,
    /// A passphrase of a key slot that stays (checked before the slot is
    /// removed); without it the slot is removed unverified.
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
    /// Remove it even if it is the last usable key slot.
    #[arg(long)]
    yes: bool,
    /// Most Argon2 memory a key slot may ask for (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    max_kdf_memory: Option<u64>,
}

/// A passphrase, wiped when dropped.
type Secret = zeroize::Zeroizing<Vec<u8>>;

/// Both passphrase files, refusing two reads of standard input.
fn two_passphrases(old: &Path, new: &Path) -> Result<(Secret, Secret), String> {
    let stdin = Path::new("-");
    if old == stdin && new == stdin {
        return Err(
            "--passphrase-file and --new-passphrase-file cannot both be `-` (standard input)"
                .to_string(),
        );
    }
    Ok((read_passphrase(old)?, read_passphrase(new)?))
}

/// The image opened for writing its header, and its header device.
fn with_device<T>(
    image: &Path,
    verb: impl FnOnce(&Target, &HeaderDevice<'_>) -> Result<T, String>,
) -> Result<T, String> {
    let target = luks_target::open(image, true)?;
    let dev = match (target.file(), target.backend()) {
        (Some(f), _) => HeaderDevice::file(f).map_err(|e| format!("{}: {e}", target.describe()))?,
        (None, Some(b)) => HeaderDevice::backend(b),
        (None, None) => return Err(format!("{}: nothing to open", target.describe())),
    };
    verb(&target, &dev)
}

/// A library error for the command line, with the flag that helps.
fn verb_error(target: &Target, e: LuksError) -> String {
    let hint = match &e {
        LuksError::OverLimit(m) if m.contains("max_argon2_memory_kib") => {
            " [--max-kdf-memory raises the memory limit]"
        }
        LuksError::KeySlot(m) if m.contains("last usable") => " [--yes removes it anyway]",
        _ => "",
    };
    format!("{}: {e}{hint}", target.describe())
}

/// The new slot's KDF for the volume `info` describes, benchmarked (and
/// said so) unless its costs are given.
fn new_slot_kdf(a: &KdfArgs, info: &LuksInfo) -> Result<Pbkdf, String> {
    let header_hash = info.keyslots.iter().find_map(|k| match k.pbkdf {
        Some(Pbkdf::Pbkdf2 { hash, .. }) if info.version == LuksVersion::Luks1 => Some(hash),
        _ => None,
    });
    let hash = a
        .hash
        .map_or(header_hash.unwrap_or(Hash::Sha256), HashArg::hash);
    let kind = match a.pbkdf {
        Some(p) => p.kind(hash),
        None if info.version == LuksVersion::Luks1 => KdfKind::Pbkdf2(hash),
        None => KdfKind::Argon2id,
    };
    if info.version == LuksVersion::Luks1 && !matches!(kind, KdfKind::Pbkdf2(_)) {
        return Err(format!("{}: LUKS1 key slots use PBKDF2 only", kind.name()));
    }
    let target = a.costs.target(kind)?;
    let benchmark = match kind {
        KdfKind::Pbkdf2(_) => a.costs.iterations.is_none(),
        _ => a.costs.iterations.is_none() || a.costs.memory.is_none(),
    };
    if benchmark {
        eprintln!("benchmarking {} for the new key slot...", kind.name());
    }
    let chosen = luks::calibrate(&target, info.key_bytes).map_err(|e| e.to_string())?;
    println!("new key slot: {chosen}");
    Ok(chosen.pbkdf)
}

/// Say that the slow part starts (every key slot tried runs its KDF).
fn unlocking(target: &Target) -> Instant {
    eprintln!(
        "{}: unlocking with the passphrase and deriving the new key slot's key...",
        target.describe()
    );
    Instant::now()
}

/// Read the header back: it must be what the verb wrote.
fn verify(target: &Target, dev: &HeaderDevice<'_>, change: &KeyChange) -> Result<(), String> {
    match dev.still_holds(change) {
        Ok(true) => {
            if target.backend().is_some() {
                println!("header read back from the store: as written");
            }
            Ok(())
        }
        Ok(false) => Err(format!(
            "{}: LOST UPDATE: the header read back differs from what was just written — another \
             host or process changed it at the same time (a remote store has no lock). Check \
             the key slots with `iopages luks check` for each passphrase before relying on them",
            target.describe()
        )),
        Err(e) => Err(format!(
            "{}: cannot read the header back to verify it: {e}",
            target.describe()
        )),
    }
}

/// `luks add-key`.
pub fn add_key(a: AddKeyArgs) -> Result<(), String> {
    let (old, new) = two_passphrases(&a.passphrase_file, &a.new_passphrase_file)?;
    with_device(&a.image, |target, dev| {
        let info = dev.inspect().map_err(|e| verb_error(target, e))?;
        let opts = KeyOptions {
            key_slot: a.key_slot,
            limits: kdf_limits(a.kdf.max_kdf_memory),
            ..KeyOptions::new(new_slot_kdf(&a.kdf, &info)?)
        };
        let t0 = unlocking(target);
        let c = luks::add_key(dev, &old, &new, &opts).map_err(|e| verb_error(target, e))?;
        verify(target, dev, &c)?;
        println!(
            "{}: {} key slot {} added ({:.1} s)",
            target.describe(),
            c.version,
            c.added.unwrap_or_default(),
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    })
}

/// `luks change-key`.
pub fn change_key(a: ChangeKeyArgs) -> Result<(), String> {
    let (old, new) = two_passphrases(&a.passphrase_file, &a.new_passphrase_file)?;
    with_device(&a.image, |target, dev| {
        let info = dev.inspect().map_err(|e| verb_error(target, e))?;
        let opts = KeyOptions {
            limits: kdf_limits(a.kdf.max_kdf_memory),
            ..KeyOptions::new(new_slot_kdf(&a.kdf, &info)?)
        };
        let t0 = unlocking(target);
        let c = luks::change_key(dev, &old, &new, &opts).map_err(|e| verb_error(target, e))?;
        verify(target, dev, &c)?;
        let (added, removed) = (c.added.unwrap_or_default(), c.removed.unwrap_or_default());
        let moved = if added == removed {
            format!("key slot {added} changed")
        } else {
            format!("key slot {removed} changed: the new passphrase is in key slot {added}, key slot {removed} removed")
        };
        println!(
            "{}: {} {moved} ({:.1} s)",
            target.describe(),
            c.version,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    })
}

/// `luks remove-key`.
pub fn remove_key(a: RemoveKeyArgs) -> Result<(), String> {
    let pass = read_passphrase(&a.passphrase_file)?;
    with_device(&a.image, |target, dev| {
        let opts = KeyOptions {
            limits: kdf_limits(a.max_kdf_memory),
            force: a.yes,
            ..KeyOptions::new(Pbkdf::pbkdf2_default())
        };
        eprintln!("{}: unlocking with the passphrase...", target.describe());
        let c = luks::remove_key(dev, &pass, &opts).map_err(|e| verb_error(target, e))?;
        verify(target, dev, &c)?;
        println!(
            "{}: {} key slot {} removed",
            target.describe(),
            c.version,
            c.removed.unwrap_or_default()
        );
        Ok(())
    })
}

/// `luks kill-slot`.
pub fn kill_slot(a: KillSlotArgs) -> Result<(), String> {
    let pass = a
        .passphrase_file
        .as_deref()
        .map(read_passphrase)
        .transpose()?;
    with_device(&a.image, |target, dev| {
        let opts = KeyOptions {
            limits: kdf_limits(a.max_kdf_memory),
            force: a.yes,
            ..KeyOptions::new(Pbkdf::pbkdf2_default())
        };
        if pass.is_some() {
            eprintln!("{}: checking the passphrase...", target.describe());
        }
        let c = luks::kill_slot(dev, a.slot, pass.as_deref().map(|p| &p[..]), &opts)
            .map_err(|e| verb_error(target, e))?;
        verify(target, dev, &c)?;
        println!(
            "{}: {} key slot {} removed",
            target.describe(),
            c.version,
            a.slot
        );
        Ok(())
    })
}
