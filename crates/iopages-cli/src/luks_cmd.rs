//! `iopages luks`: make LUKS volumes, check a passphrase, and read a
//! volume's plaintext offline.
//!
//! Owns: the command line of the LUKS tools. Must never: overwrite a
//! non-empty file without `--yes`, leave a half-written output behind
//! (a failed `decrypt` removes what it wrote), write plaintext that others
//! can read or through a symbolic link, or print a header's strings
//! unescaped.

use crate::luks_kdf::{kdf_limits, HashArg, KdfCostArgs, PbkdfArg};
use crate::passphrase::read_passphrase;
use iopages_crypt::integrity::{Anchor, Mac, StateFile};
use iopages_crypt::luks::{self, FormatOptions, KdfLimits, LuksOpenOptions, LuksVersion};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum LuksCommand {
    /// Make a LUKS volume (header and one key slot) that cryptsetup opens.
    Format(FormatArgs),
    /// Open a volume's header with a passphrase and describe it.
    Check {
        /// The LUKS image: a file, a block device, or an NBD URI
        /// (`nbd://`, `nbd+unix://`, `nbds://`, `nbds+unix://`).
        image: PathBuf,
        /// The passphrase: the file's exact bytes, or `-` for one line of
        /// standard input.
        #[arg(long, value_name = "FILE")]
        passphrase_file: PathBuf,
        /// Most Argon2 memory a key slot may ask for (K, M, G suffixes;
        /// default 1G, at most 4G): a key slot asking more is not tried.
        #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
        max_kdf_memory: Option<u64>,
        /// Use the LUKS2 secondary header even though the primary header
        /// area now carries another format's signature (the device was
        /// probably reformatted: only to recover the old volume on purpose).
        #[arg(long)]
        allow_secondary_header: bool,
        /// An authenticated volume's freshness state file: its tags and
        /// tree are then all verified (every block read) against it, so a store rolled back whole is
        /// caught too (without it: against the store's own superblock).
        #[arg(long, value_name = "FILE")]
        freshness: Option<PathBuf>,
    },
    /// Decrypt a volume's whole payload into a raw file (offline, no
    /// server).
    Decrypt {
        /// The LUKS image (file or block device).
        image: PathBuf,
        /// Where the plaintext goes: created with mode 0600 (must not
        /// exist, unless --yes; never a symbolic link).
        output: PathBuf,
        /// The passphrase: the file's exact bytes, or `-` for one line of
        /// standard input.
        #[arg(long, value_name = "FILE")]
        passphrase_file: PathBuf,
        /// Overwrite OUTPUT if it exists (a regular file is then set to
        /// mode 0600).
        #[arg(long)]
        yes: bool,
        /// Most Argon2 memory a key slot may ask for (K, M, G suffixes;
        /// default 1G, at most 4G): a key slot asking more is not tried.
        #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
        max_kdf_memory: Option<u64>,
        /// Use the LUKS2 secondary header even though the primary header
        /// area now carries another format's signature (the device was
        /// probably reformatted: only to recover the old volume on purpose).
        #[arg(long)]
        allow_secondary_header: bool,
        /// An authenticated volume's freshness state file: its tags and
        /// tree are then verified (every block) against it; if any block fails, OUTPUT is removed and the error names the blocks, so a store rolled back whole is
        /// caught too (without it: against the store's own superblock).
        #[arg(long, value_name = "FILE")]
        freshness: Option<PathBuf>,
    },
    /// Show a volume's header as `cryptsetup luksDump` does (no
    /// passphrase; never key material); --json prints LUKS2's metadata.
    Dump(crate::luks_header::DumpArgs),
    /// Save a volume's whole header area (headers and key slots) to a new
    /// file, as `cryptsetup luksHeaderBackup` does.
    HeaderBackup(crate::luks_header::HeaderBackupArgs),
    /// Write a saved header area back over a volume's header, as
    /// `cryptsetup luksHeaderRestore` does (--yes to replace another
    /// volume's header).
    HeaderRestore(crate::luks_header::HeaderRestoreArgs),
    /// Add a passphrase in a free key slot, unlocked by an existing one
    /// (as `cryptsetup luksAddKey`).
    AddKey(crate::luks_keys::AddKeyArgs),
    /// Remove the key slot a passphrase opens (as `cryptsetup
    /// luksRemoveKey`).
    RemoveKey(crate::luks_keys::RemoveKeyArgs),
    /// Replace the passphrase of the key slot it opens (as `cryptsetup
    /// luksChangeKey`).
    ChangeKey(crate::luks_keys::ChangeKeyArgs),
    /// Remove a key slot by number (as `cryptsetup luksKillSlot`).
    KillSlot(crate::luks_keys::KillSlotArgs),
}

#[derive(clap::Args)]
pub struct FormatArgs {
    /// The image: a file (created if missing) or a block device.
    image: PathBuf,
    /// The passphrase: the file's exact bytes, or `-` for one line of
    /// standard input.
    #[arg(long, value_name = "FILE")]
    passphrase_file: PathBuf,
    /// Payload size: the file is made the header plus this many bytes; K,
    /// M, G suffixes (with --integrity the data and its integrity area
    /// share them). Without it the file's present size is used.
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    size: Option<u64>,
    /// LUKS version.
    #[arg(long = "type", value_enum, default_value_t = VersionArg::Luks2)]
    version: VersionArg,
    /// Key size in bits (aes-xts-plain64: 256 or 512).
    #[arg(long, value_name = "BITS", default_value_t = 512)]
    key_size: usize,
    /// Encryption sector size (4096 only with LUKS2) [default: 512; 4096
    /// with --integrity, which takes no other].
    #[arg(long, value_name = "BYTES")]
    sector_size: Option<usize>,
    /// Key derivation of the key slot (default: argon2id for LUKS2,
    /// pbkdf2 for LUKS1, which has no other).
    #[arg(long, value_enum)]
    pbkdf: Option<PbkdfArg>,
    /// PBKDF2's hash (and LUKS1's hash spec).
    #[arg(long, value_enum, default_value_t = HashArg::Sha256)]
    hash: HashArg,
    #[command(flatten)]
    costs: KdfCostArgs,
    /// A label (LUKS2).
    #[arg(long)]
    label: Option<String>,
    /// Make an authenticated volume (LUKS2, 4096-byte sectors): a tag of
    /// every 4 KiB block's ciphertext under this MAC, and a hash tree over
    /// the tags, in an integrity area after the data (about 6% of the
    /// image). cryptsetup will not map it or change its keys.
    #[arg(long, value_enum, value_name = "MAC")]
    integrity: Option<IntegrityArg>,
    /// With --integrity: write the new volume's freshness state (the
    /// root of its empty tree) to FILE, which must not exist yet; keep it
    /// off the image's store, so that a store rolled back is caught.
    #[arg(long, value_name = "FILE", requires = "integrity")]
    freshness: Option<PathBuf>,
    /// Overwrite an image that is not empty (its data is lost).
    #[arg(long)]
    yes: bool,
}

/// The tags' MAC of an authenticated volume.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IntegrityArg {
    /// HMAC-SHA256 over each block's number, epoch and ciphertext.
    #[value(name = "hmac-sha256")]
    HmacSha256,
    /// GMAC (AES-256-GCM, a random nonce per tag): the faster one.
    Aead,
}

impl IntegrityArg {
    fn mac(self) -> Mac {
        match self {
            IntegrityArg::HmacSha256 => Mac::HmacSha256,
            IntegrityArg::Aead => Mac::Gmac,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum VersionArg {
    Luks1,
    Luks2,
}

fn version_name(v: LuksVersion) -> &'static str {
    match v {
        LuksVersion::Luks1 => "LUKS1",
        LuksVersion::Luks2 => "LUKS2",
    }
}

pub fn run(cmd: LuksCommand) -> Result<(), String> {
    match cmd {
        LuksCommand::Format(a) => format(a),
        LuksCommand::Check {
            image,
            passphrase_file,
            max_kdf_memory,
            allow_secondary_header,
            freshness,
        } => check(
            &image,
            &passphrase_file,
            &kdf_limits(max_kdf_memory),
            &LuksOpenOptions::new().allow_secondary_header(allow_secondary_header),
            freshness.as_deref(),
        ),
        LuksCommand::Decrypt {
            image,
            output,
            passphrase_file,
            yes,
            max_kdf_memory,
            allow_secondary_header,
            freshness,
        } => decrypt(
            &image,
            &output,
            &passphrase_file,
            yes,
            &kdf_limits(max_kdf_memory),
            &LuksOpenOptions::new().allow_secondary_header(allow_secondary_header),
            freshness.as_deref(),
        ),
        LuksCommand::Dump(a) => crate::luks_header::dump(a),
        LuksCommand::HeaderBackup(a) => crate::luks_header::header_backup(a),
        LuksCommand::HeaderRestore(a) => crate::luks_header::header_restore(a),
        LuksCommand::AddKey(a) => crate::luks_keys::add_key(a),
        LuksCommand::RemoveKey(a) => crate::luks_keys::remove_key(a),
        LuksCommand::ChangeKey(a) => crate::luks_keys::change_key(a),
        LuksCommand::KillSlot(a) => crate::luks_keys::kill_slot(a),
    }
}

/// "payload N bytes at offset O", or why there is none (a header-only
/// image, a detached header).
fn payload_text(v: &luks::LuksVolume, device_bytes: u64) -> String {
    match v.payload_bytes(device_bytes) {
        Ok(n) => format!("payload {n} bytes at offset {}", v.data_offset_bytes()),
        Err(e) => e.to_string(),
    }
}

/// ", authenticated (MAC tags, ...)" for a volume with an integrity area;
/// empty for one without.
fn integrity_text(v: &luks::LuksVolume) -> String {
    v.integrity().map_or(String::new(), |i| {
        format!(
            ", authenticated ({} tags, integrity area {} bytes at offset {})",
            i.mac(),
            i.area_bytes(),
            i.area_offset
        )
    })
}

/// `luks check`: open IMAGE (a file, a block device or an NBD URI) with
/// the passphrase and describe it.
fn check(
    image: &Path,
    passphrase_file: &Path,
    limits: &KdfLimits,
    opts: &LuksOpenOptions,
    freshness: Option<&Path>,
) -> Result<(), String> {
    let pass = read_passphrase(passphrase_file)?;
    let target = crate::luks_target::open(image, false)?;
    let (v, dev) = match (target.file(), target.backend()) {
        (Some(_), _) => (
            luks::open_path_with_options(image, &pass, limits, opts)
                .map_err(|e| open_error(image, e))?,
            device_bytes(image)?,
        ),
        (None, Some(b)) => (
            luks::open_backend(b, &pass, limits, opts).map_err(|e| open_error(image, e))?,
            b.size_bytes(),
        ),
        (None, None) => return Err(format!("{}: nothing to open", target.describe())),
    };
    println!(
        "{}: {} {}, {}-bit key, {}-byte sectors, {}{}, key slot {} opened{}, uuid {}",
        image.display(),
        version_name(v.version()),
        v.cipher_spec(),
        v.master_key().len() * 8,
        v.sector_size(),
        payload_text(&v, dev),
        integrity_text(&v),
        v.keyslot(),
        if v.used_secondary_header() {
            " (primary header damaged: the secondary copy was used)"
        } else {
            ""
        },
        luks::printable(v.uuid())
    );
    let device = match target.shared() {
        Some(b) => b,
        None => crate::luks_integrity::local_device(image)?,
    };
    check_tags(image, &v, &device, freshness)
}

/// `luks check` of an authenticated volume: every block and the tree
/// verified; any failure is an error naming the blocks.
fn check_tags(
    image: &Path,
    v: &luks::LuksVolume,
    device: &std::sync::Arc<dyn iopages_crypt::backend::Backend>,
    freshness: Option<&Path>,
) -> Result<(), String> {
    let name = image.display().to_string();
    let Some(auth) = crate::luks_integrity::open(device, v, freshness, &name)? else {
        return Ok(());
    };
    let bad = crate::luks_integrity::read_all(&auth, |_, _| Ok(()))?;
    let blocks = auth.layout().data_blocks();
    if !bad.is_empty() {
        return Err(format!(
            "{name}: {} of {blocks} blocks failed verification: {} (4096-byte blocks of the volume)",
            bad.len(),
            iopages_crypt::integrity::block_ranges(&bad)
        ));
    }
    println!(
        "{name}: all {blocks} blocks and the tag tree verified ({} tags){}",
        auth.layout().mac(),
        if freshness.is_some() {
            ", fresh as the state file says"
        } else {
            ""
        }
    );
    Ok(())
}

/// An open error for the command line: a key slot over the memory limit
/// names the flag that raises it.
fn open_error(image: &Path, e: luks::LuksError) -> String {
    let hint = match &e {
        luks::LuksError::OverLimit(m) if m.contains("max_argon2_memory_kib") => {
            " [--max-kdf-memory raises the memory limit]"
        }
        luks::LuksError::AmbiguousSignatures(_) => {
            " [--allow-secondary-header opens the old volume on purpose]"
        }
        _ => "",
    };
    format!("{}: {e}{hint}", image.display())
}

fn device_bytes(path: &Path) -> Result<u64, String> {
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    use std::io::Seek;
    let mut f = f;
    f.seek(std::io::SeekFrom::End(0))
        .map_err(|e| format!("cannot size {}: {e}", path.display()))
}

fn format(a: FormatArgs) -> Result<(), String> {
    let (base, target) = format_plan(&a)?;
    check_freshness_file(a.freshness.as_deref())?;
    let pass = read_passphrase(&a.passphrase_file)?;
    let existing = std::fs::metadata(&a.image).ok();
    let is_file = existing.as_ref().is_none_or(|m| m.is_file());
    if let Some(m) = &existing {
        let non_empty = if m.is_file() { m.len() > 0 } else { true };
        if non_empty && !a.yes {
            return Err(format!(
                "{} is not empty: formatting destroys its data; add --yes to go ahead",
                a.image.display()
            ));
        }
    }
    // Benchmarked only once the image may be written: a refusal above
    // costs no benchmark.
    let (opts, chosen) = base
        .with_calibrated_kdf(&target)
        .map_err(|e| format!("{}: {e}", a.image.display()))?;
    println!("key slot 0: {chosen}");
    let t0 = Instant::now();
    let (vol, anchor) = format_image(&a, &pass, &opts, existing.is_some(), is_file)?;
    let dev = device_bytes(&a.image)?;
    if let Some(anchor) = anchor {
        integrity_done(&a, &vol, anchor)?;
    }
    println!(
        "{}: {} {}, {}-bit key, {}-byte sectors, payload {} bytes at offset {}, uuid {} ({:.1} s)",
        a.image.display(),
        version_name(vol.version()),
        vol.cipher_spec(),
        vol.master_key().len() * 8,
        vol.sector_size(),
        vol.data_size_bytes(dev),
        vol.data_offset_bytes(),
        luks::printable(vol.uuid()),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--freshness FILE`: refused when FILE exists (a state file is never
/// replaced by a format: it may be another volume's), before anything
/// is written.
fn check_freshness_file(path: Option<&Path>) -> Result<(), String> {
    let Some(p) = path else { return Ok(()) };
    match std::fs::symlink_metadata(p) {
        Ok(_) => Err(format!(
            "--freshness {}: the file exists (it may hold another volume's state): remove it \
             or name a new file; nothing was written",
            p.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("--freshness {}: {e}", p.display())),
    }
}

/// After an authenticated format: the freshness state written (with
/// `--freshness`) and what was chosen printed.
fn integrity_done(a: &FormatArgs, vol: &luks::LuksVolume, anchor: Anchor) -> Result<(), String> {
    let i = vol
        .integrity()
        .ok_or("an authenticated format made a volume without integrity")?;
    let state = match &a.freshness {
        Some(p) => {
            StateFile {
                anchor,
                clean: true,
            }
            .store(p)
            .map_err(|e| {
                format!(
                    "{} is formatted, but its freshness state could not be written to {}: {e}",
                    a.image.display(),
                    p.display()
                )
            })?;
            format!(", freshness state in {}", p.display())
        }
        None => String::new(),
    };
    println!(
        "integrity: {} tags, data {} bytes ({} blocks of 4096), integrity area {} bytes at \
         offset {}{state}",
        i.mac(),
        i.layout.data_bytes(),
        i.layout.data_blocks(),
        i.area_bytes(),
        i.area_offset
    );
    Ok(())
}

/// `format`'s flags as the volume's options (their KDF still to be
/// calibrated) and what to calibrate it for.
///
/// **Returns:** the error for a key size aes-xts-plain64 does not take,
/// KDF flags that do not go together, or `--integrity` with LUKS1 or a
/// sector size other than 4096.
fn format_plan(a: &FormatArgs) -> Result<(FormatOptions, luks::KdfTarget), String> {
    let version = match a.version {
        VersionArg::Luks1 => LuksVersion::Luks1,
        VersionArg::Luks2 => LuksVersion::Luks2,
    };
    if a.key_size != 256 && a.key_size != 512 {
        return Err(format!(
            "--key-size {} is not one aes-xts-plain64 takes: 256 or 512",
            a.key_size
        ));
    }
    let pbkdf_kind = a.pbkdf.unwrap_or(match version {
        LuksVersion::Luks1 => PbkdfArg::Pbkdf2,
        LuksVersion::Luks2 => PbkdfArg::Argon2id,
    });
    let kind = pbkdf_kind.kind(a.hash.hash());
    let target = a.costs.target(kind)?;
    let sector_size = match (a.integrity, a.sector_size) {
        (None, s) => s.unwrap_or(512),
        (Some(_), _) if version == LuksVersion::Luks1 => {
            return Err(
                "--integrity needs LUKS2 (--type luks2): LUKS1 cannot carry an \
                        authenticated volume"
                    .into(),
            )
        }
        (Some(_), None | Some(4096)) => 4096,
        (Some(_), Some(s)) => {
            return Err(format!(
                "--sector-size {s} with --integrity: an authenticated volume has 4096-byte \
                 sectors (one tag per 4 KiB block); leave --sector-size out"
            ))
        }
    };
    let base = FormatOptions {
        version,
        key_bytes: a.key_size / 8,
        sector_size,
        // Replaced by the calibrated (or given) costs.
        pbkdf: FormatOptions::fast_for_tests(version).pbkdf,
        label: a.label.clone(),
    };
    Ok((base, target))
}

/// Write the header and key slot: with `--size`, a file made the header
/// plus that payload; without, the image (`exists`) at its present size.
/// An authenticated volume (`--integrity`) fits its data and integrity
/// area in that payload, and comes with its anchor.
fn format_image(
    a: &FormatArgs,
    pass: &[u8],
    opts: &FormatOptions,
    exists: bool,
    is_file: bool,
) -> Result<(luks::LuksVolume, Option<Anchor>), String> {
    let at = |e: luks::LuksError| format!("{}: {e}", a.image.display());
    if a.size.is_none() && !exists {
        return Err(format!(
            "{} does not exist: give --size to make it",
            a.image.display()
        ));
    }
    if a.size.is_some() && !is_file {
        return Err("--size makes a file; leave it out for a block device".into());
    }
    if let Some(mac) = a.integrity.map(IntegrityArg::mac) {
        // LUKS2's header is always FORMAT_DATA_OFFSET bytes: the file is
        // made its final size before the layout is fitted to it.
        let size = a.size.map(|s| luks::FORMAT_DATA_OFFSET + s);
        let (v, anchor) =
            luks::format_integrity_path(&a.image, size, pass, opts, mac).map_err(at)?;
        return Ok((v, Some(anchor)));
    }
    let Some(size) = a.size else {
        return Ok((
            luks::format_path(&a.image, None, pass, opts).map_err(at)?,
            None,
        ));
    };
    // Room for any header, then the file is cut to header + size.
    let v = luks::format_path(&a.image, Some((32 << 20) + size), pass, opts)
        .map_err(|e| format!("{}: {e}", a.image.display()))?;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&a.image)
        .map_err(|e| format!("cannot open {}: {e}", a.image.display()))?;
    f.set_len(v.data_offset_bytes() + size)
        .map_err(|e| format!("cannot size {}: {e}", a.image.display()))?;
    Ok((v, None))
}

/// Create (or with `yes` truncate) the plaintext output: mode 0600,
/// never through a symbolic link (`O_NOFOLLOW`), never over an existing
/// file without `yes` (`O_EXCL`). An existing regular file taken over
/// with `yes` is set to 0600 before anything is written to it.
fn create_output(output: &Path, yes: bool) -> Result<std::fs::File, String> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    if yes {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    let out = o.open(output).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) || is_symlink(output) {
            format!(
                "{} is a symbolic link: plaintext is never written through one",
                output.display()
            )
        } else if e.kind() == std::io::ErrorKind::AlreadyExists {
            format!("{} exists: add --yes to overwrite it", output.display())
        } else {
            format!("cannot create {}: {e}", output.display())
        }
    })?;
    let meta = out
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", output.display()))?;
    if meta.is_file() && meta.permissions().mode() & 0o7777 != 0o600 {
        out.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot make {} private (0600): {e}", output.display()))?;
    }
    Ok(out)
}

fn is_symlink(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

fn decrypt(
    image: &Path,
    output: &Path,
    passphrase_file: &Path,
    yes: bool,
    limits: &KdfLimits,
    open: &LuksOpenOptions,
    freshness: Option<&Path>,
) -> Result<(), String> {
    // Refused early, before the slow key derivation (and again, without a
    // race, when the output is created).
    if is_symlink(output) {
        return Err(format!(
            "{} is a symbolic link: plaintext is never written through one",
            output.display()
        ));
    }
    if !yes && std::fs::symlink_metadata(output).is_ok() {
        return Err(format!(
            "{} exists: add --yes to overwrite it",
            output.display()
        ));
    }
    let pass = read_passphrase(passphrase_file)?;
    let src =
        std::fs::File::open(image).map_err(|e| format!("cannot open {}: {e}", image.display()))?;
    let vol =
        luks::open_with_options(&src, &pass, limits, open).map_err(|e| open_error(image, e))?;
    let dev = device_bytes(image)?;
    let ss = vol.sector_size() as u64;
    // A header-only image (a header backup) opens but has no payload.
    let size = vol.payload_bytes(dev).map_err(|e| open_error(image, e))? / ss * ss;
    let mut cipher = vol
        .xts_cipher()
        .map_err(|e| format!("cannot set up {}: {e}", vol.cipher_spec()))?;
    let auth = tag_layer(image, &vol, freshness)?;
    let out = create_output(output, yes)?;
    let from = Plaintext {
        src: &src,
        image,
        data_offset: vol.data_offset_bytes(),
        sector_bytes: ss,
        size,
    };
    let copied = match &auth {
        Some(a) => decrypt_verified(a, &mut cipher, &out, output),
        None => from.copy(&mut cipher, &out, output),
    };
    if let Err(e) = copied {
        // Only a regular file is removed (never a device node given as
        // the output with --yes).
        let regular = out.metadata().is_ok_and(|m| m.is_file());
        drop(out);
        if regular {
            let _ = std::fs::remove_file(output);
            return Err(format!("{e} ({} removed)", output.display()));
        }
        return Err(e);
    }
    println!(
        "{}: {} bytes of plaintext from {} ({})",
        output.display(),
        size,
        image.display(),
        version_name(vol.version())
    );
    Ok(())
}

/// The tag layer of an authenticated volume at `image`, read-only; `None`
/// for a volume without one (where `--freshness` is an error).
fn tag_layer(
    image: &Path,
    vol: &luks::LuksVolume,
    freshness: Option<&Path>,
) -> Result<Option<iopages_crypt::integrity::AuthBackend>, String> {
    let name = image.display().to_string();
    match vol.integrity() {
        Some(_) => {
            let device = crate::luks_integrity::local_device(image)?;
            crate::luks_integrity::open(&device, vol, freshness, &name)
        }
        None if freshness.is_some() => Err(format!(
            "{name}: --freshness given, but the volume is not authenticated"
        )),
        None => Ok(None),
    }
}

/// Decrypt an authenticated volume through its tag layer: every block
/// verified first; a never-written or discarded block is zeros. Any block
/// that fails makes it an error naming the blocks (the caller removes the
/// output: nothing unverified is handed on).
fn decrypt_verified(
    auth: &iopages_crypt::integrity::AuthBackend,
    cipher: &mut iopages_crypt::XtsCipher,
    out: &std::fs::File,
    output: &Path,
) -> Result<(), String> {
    let bad = crate::luks_integrity::read_all(auth, |at, b| {
        let mut b = b.to_vec();
        for (i, sector) in b.chunks_mut(4096).enumerate() {
            if sector.iter().any(|&x| x != 0) {
                cipher
                    .decrypt_sectors_in_place(at / 4096 + i as u64, sector)
                    .map_err(|e| format!("decrypting at {at}: {e}"))?;
            }
        }
        out.write_all_at(&b, at)
            .map_err(|e| format!("writing {}: {e}", output.display()))
    })?;
    out.sync_all()
        .map_err(|e| format!("syncing {}: {e}", output.display()))?;
    if bad.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} block(s) failed verification: {} (4096-byte blocks of the volume); refusing to \
         decrypt a tampered volume",
        bad.len(),
        iopages_crypt::integrity::block_ranges(&bad)
    ))
}

/// The payload of an opened image, to decrypt.
struct Plaintext<'a> {
    src: &'a std::fs::File,
    /// The image's name, for messages.
    image: &'a Path,
    data_offset: u64,
    sector_bytes: u64,
    /// Whole sectors to decrypt, from the payload's start.
    size: u64,
}

impl Plaintext<'_> {
    /// Decrypt the whole payload into `out` (named `output`) a MiB at a
    /// time, showing progress each second on standard error, then sync
    /// it.
    ///
    /// **Returns:** the first read, decryption, write or sync error.
    fn copy(
        &self,
        cipher: &mut iopages_crypt::XtsCipher,
        out: &std::fs::File,
        output: &Path,
    ) -> Result<(), String> {
        let (size, ss) = (self.size, self.sector_bytes);
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0u64;
        let t0 = Instant::now();
        let mut last = t0;
        while at < size {
            let n = ((size - at) as usize).min(buf.len());
            let b = &mut buf[..n];
            let from = self.data_offset + at;
            self.src
                .read_exact_at(b, from)
                .map_err(|e| format!("reading {} at {from}: {e}", self.image.display()))?;
            cipher
                .decrypt_sectors_in_place(at / ss, b)
                .map_err(|e| format!("decrypting at {at}: {e}"))?;
            out.write_all_at(b, at)
                .map_err(|e| format!("writing {}: {e}", output.display()))?;
            at += n as u64;
            if last.elapsed().as_secs() >= 1 {
                last = Instant::now();
                eprint!("\rdecrypted {} of {} MiB", at >> 20, size >> 20);
                let _ = std::io::stderr().flush();
            }
        }
        out.sync_all()
            .map_err(|e| format!("syncing {}: {e}", output.display()))?;
        if t0.elapsed().as_secs() >= 1 {
            eprintln!();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let d = std::env::temp_dir()
                .join(format!("iopages-luks-cmd-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A LUKS1 image with 8 KiB of payload, and its passphrase file.
    fn volume(dir: &Dir) -> (PathBuf, PathBuf) {
        let img = dir.0.join("v.img");
        luks::format_path(
            &img,
            Some((2 << 20) + 8192),
            b"pw",
            &FormatOptions::fast_for_tests(LuksVersion::Luks1),
        )
        .unwrap();
        let pass = dir.0.join("pass");
        std::fs::write(&pass, b"pw").unwrap();
        (img, pass)
    }

    #[test]
    fn decrypt_output_is_private_and_never_a_symlink_or_an_existing_file() {
        let dir = Dir::new("decrypt");
        let (img, pass) = volume(&dir);
        let limits = KdfLimits::default();
        let to = |out: &Path, yes: bool| {
            decrypt(
                &img,
                out,
                &pass,
                yes,
                &limits,
                &LuksOpenOptions::new(),
                None,
            )
        };
        let out = dir.0.join("plain");
        to(&out, false).unwrap();
        let m = std::fs::metadata(&out).unwrap();
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(m.len(), 8192);

        // Existing file without --yes: refused, untouched.
        std::fs::write(&out, b"keep").unwrap();
        let e = to(&out, false).unwrap_err();
        assert!(e.contains("exists: add --yes"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"keep");
        // With --yes a world-readable file is taken over and made 0600.
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
        to(&out, true).unwrap();
        let m = std::fs::metadata(&out).unwrap();
        assert_eq!((m.mode() & 0o777, m.len()), (0o600, 8192));

        // A symbolic link at the output: refused, with or without --yes,
        // dangling or not; its target is untouched.
        let target = dir.0.join("target");
        std::fs::write(&target, b"target").unwrap();
        let link = dir.0.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let dangling = dir.0.join("dangling");
        std::os::unix::fs::symlink(dir.0.join("nowhere"), &dangling).unwrap();
        for (l, yes) in [
            (&link, false),
            (&link, true),
            (&dangling, false),
            (&dangling, true),
        ] {
            let e = to(l, yes).unwrap_err();
            assert!(e.contains("is a symbolic link"), "{e}");
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"target");
        assert!(!dir.0.join("nowhere").exists());
        // The race-free check at creation holds on its own too.
        for yes in [false, true] {
            let e = create_output(&link, yes).unwrap_err();
            assert!(e.contains("is a symbolic link"), "{e}");
        }
    }

    fn format_args(image: PathBuf, pass: PathBuf) -> FormatArgs {
        FormatArgs {
            image,
            passphrase_file: pass,
            size: Some(8192),
            version: VersionArg::Luks1,
            key_size: 512,
            sector_size: Some(512),
            pbkdf: None,
            hash: HashArg::Sha256,
            costs: KdfCostArgs {
                iter_time: 100,
                iterations: None,
                memory: None,
                parallel: None,
            },
            label: None,
            integrity: None,
            freshness: None,
            yes: false,
        }
    }

    #[test]
    fn format_calibrates_for_iter_time_and_refuses_argon2_costs_for_pbkdf2() {
        let dir = Dir::new("format");
        let pass = dir.0.join("pass");
        std::fs::write(&pass, b"pw").unwrap();
        // --iter-time 100: a benchmarked PBKDF2 count, and the volume opens.
        let img = dir.0.join("l1.img");
        format(format_args(img.clone(), pass.clone())).unwrap();
        let v = luks::open_path(&img, b"pw").unwrap();
        let info = luks::inspect(&std::fs::File::open(&img).unwrap()).unwrap();
        match info.keyslots[0].pbkdf {
            Some(luks::Pbkdf::Pbkdf2 { iterations, .. }) => assert!(iterations >= 1000),
            other => panic!("{other:?}"),
        }
        assert_eq!(v.version(), LuksVersion::Luks1);
        // Memory or lanes for PBKDF2: refused, nothing written.
        let img2 = dir.0.join("l1b.img");
        for (memory, parallel) in [(Some(1024), None), (None, Some(2))] {
            let base = format_args(img2.clone(), pass.clone());
            let e = format(FormatArgs {
                costs: KdfCostArgs {
                    memory,
                    parallel,
                    ..base.costs
                },
                ..base
            })
            .unwrap_err();
            assert!(e.contains("Argon2 costs"), "{e}");
        }
        assert!(!img2.exists());
        let base = format_args(img2.clone(), pass.clone());
        let e = format(FormatArgs {
            costs: KdfCostArgs {
                iter_time: 0,
                ..base.costs
            },
            ..base
        })
        .unwrap_err();
        assert!(e.contains("--iter-time 0"), "{e}");
        // Every Argon2 cost given: kept as given.
        let img3 = dir.0.join("l2.img");
        let base = format_args(img3.clone(), pass.clone());
        format(FormatArgs {
            version: VersionArg::Luks2,
            size: Some(4096),
            costs: KdfCostArgs {
                iterations: Some(4),
                memory: Some(64),
                parallel: Some(1),
                ..base.costs
            },
            ..base
        })
        .unwrap();
        let info = luks::inspect(&std::fs::File::open(&img3).unwrap()).unwrap();
        assert_eq!(
            info.keyslots[0].pbkdf,
            Some(luks::Pbkdf::Argon2id {
                time: 4,
                memory_kib: 64,
                parallel: 1
            })
        );
    }

    #[test]
    fn a_key_slot_over_the_memory_limit_names_the_flag() {
        let dir = Dir::new("limit");
        let (img, pass) = volume(&dir);
        // LUKS1 is PBKDF2: the memory flag does not refuse it.
        let out = dir.0.join("plain");
        decrypt(
            &img,
            &out,
            &pass,
            false,
            &kdf_limits(Some(4096)),
            &LuksOpenOptions::new(),
            None,
        )
        .unwrap();
        assert_eq!(kdf_limits(Some(16 << 20)).max_argon2_memory_kib, 16 << 10);
        assert_eq!(
            kdf_limits(None).max_argon2_memory_kib,
            KdfLimits::default().max_argon2_memory_kib
        );
        let e = luks::LuksError::OverLimit(
            "keyslot 0: argon2id memory 4194304 KiB (keyslots.0.kdf.memory) is over the limit of \
             1048576 KiB (KdfLimits::max_argon2_memory_kib)"
                .into(),
        );
        let m = open_error(Path::new("v.img"), e);
        assert!(
            m.ends_with("[--max-kdf-memory raises the memory limit]"),
            "{m}"
        );
    }
}
