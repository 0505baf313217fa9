//! `iopages luks dump`, `header-backup` and `header-restore`: the header
//! verbs, which need no passphrase.
//!
//! Owns: their command lines and the backup file's life — created 0600
//! under a temporary name in the same directory, written, synced, then
//! linked to its name (`link(2)` fails on an existing name, a symbolic
//! link included), so FILE appears whole or not at all and nothing is
//! ever written through a link or over an existing file. Must never: show
//! key material (a dump shows what `cryptsetup luksDump` shows: salts and
//! digests, never a key slot's area), print a header string unescaped, or
//! change an image when a restore is refused. IMAGE may be a path or an
//! NBD URI ([`crate::luks_target`]).

use crate::luks_target::{self, Target};
use iopages_crypt::luks::{self, LuksError, RestoreOptions};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// `iopages luks dump`.
#[derive(clap::Args)]
pub struct DumpArgs {
    /// The LUKS image: a file, a block device, or an NBD URI (nbd://,
    /// nbd+unix://, nbds://, nbds+unix://). A header backup will do.
    image: PathBuf,
    /// Print the LUKS2 JSON metadata as stored (LUKS1 has none).
    #[arg(long)]
    json: bool,
}

/// `iopages luks header-backup`.
#[derive(clap::Args)]
pub struct HeaderBackupArgs {
    /// The LUKS image: a file, a block device, or an NBD URI.
    image: PathBuf,
    /// Where the header goes: created with mode 0600; must not exist
    /// (never overwritten, never a symbolic link).
    file: PathBuf,
}

/// `iopages luks header-restore`.
#[derive(clap::Args)]
pub struct HeaderRestoreArgs {
    /// The LUKS image whose header is replaced: a file, a block device,
    /// or an NBD URI.
    image: PathBuf,
    /// The header backup (from `iopages luks header-backup` or
    /// `cryptsetup luksHeaderBackup`).
    file: PathBuf,
    /// Replace the header of another volume (a different UUID) or write
    /// over an image that holds no valid LUKS header.
    #[arg(long)]
    yes: bool,
}

/// A verb's error naming the image.
fn image_error(t: &Target, e: LuksError) -> String {
    format!("{}: {e}", t.describe())
}

/// Run `file_op` on a local image or `backend_op` on a remote one.
fn on_target<T>(
    t: &Target,
    file_op: impl FnOnce(&File) -> Result<T, LuksError>,
    backend_op: impl FnOnce(&dyn iopages_crypt::backend::Backend) -> Result<T, LuksError>,
) -> Result<T, String> {
    let r = match (t.file(), t.backend()) {
        (Some(f), _) => file_op(f),
        (None, Some(b)) => backend_op(b),
        (None, None) => return Err(format!("{}: neither a file nor a remote", t.describe())),
    };
    r.map_err(|e| image_error(t, e))
}

/// `iopages luks dump IMAGE [--json]`.
pub fn dump(a: DumpArgs) -> Result<(), String> {
    let t = luks_target::open(&a.image, false)?;
    let d = on_target(&t, luks::dump, luks::dump_backend)?;
    let mut out = std::io::stdout().lock();
    let written = if a.json {
        let json = d.json_text().ok_or_else(|| {
            format!(
                "{}: a LUKS1 header has no JSON metadata (--json is for LUKS2)",
                t.describe()
            )
        })?;
        writeln!(out, "{json}")
    } else {
        write!(out, "{d}")
    };
    written
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing the dump: {e}"))
}

fn is_symlink(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// A private temporary file next to `file` (same file system, so it can
/// be linked to `file`'s name): its path and the open file.
fn temporary_next_to(file: &Path) -> Result<(PathBuf, File), String> {
    let name = file
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", file.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".iopages-{}.tmp", std::process::id()));
    let tmp = file.with_file_name(tmp_name);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    Ok((tmp, f))
}

/// The directory holding `file`, synced so that its new name is durable.
fn sync_parent(file: &Path) -> Result<(), String> {
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("syncing {}: {e}", dir.display()))
}

/// `iopages luks header-backup IMAGE FILE`.
pub fn header_backup(a: HeaderBackupArgs) -> Result<(), String> {
    if is_symlink(&a.file) {
        return Err(format!(
            "{} is a symbolic link: a header backup is never written through one",
            a.file.display()
        ));
    }
    if std::fs::symlink_metadata(&a.file).is_ok() {
        return Err(format!(
            "{} exists: a header backup never overwrites a file",
            a.file.display()
        ));
    }
    let t = luks_target::open(&a.image, false)?;
    let (tmp, f) = temporary_next_to(&a.file)?;
    let result = write_backup(&t, &f, &tmp, &a.file);
    drop(f);
    // The temporary name goes whether or not FILE got the backup.
    let _ = std::fs::remove_file(&tmp);
    let area = result?;
    sync_parent(&a.file)?;
    println!(
        "{}: {} header of {} (UUID {}), {} bytes",
        a.file.display(),
        area.version,
        t.describe(),
        luks::printable(&area.uuid),
        area.len_bytes
    );
    Ok(())
}

/// Copy the header into `f` (at `tmp`), sync it and link it to `file`.
fn write_backup(t: &Target, f: &File, tmp: &Path, file: &Path) -> Result<luks::HeaderArea, String> {
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let copied = match (t.file(), t.backend()) {
        (Some(dev), _) => luks::backup_header(dev, &mut w),
        (None, Some(dev)) => luks::backup_header_backend(dev, &mut w),
        (None, None) => return Err(format!("{}: neither a file nor a remote", t.describe())),
    };
    let area = copied.map_err(|e| image_error(t, e))?;
    drop(w);
    f.sync_all()
        .map_err(|e| format!("syncing {}: {e}", tmp.display()))?;
    std::fs::hard_link(tmp, file).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            format!(
                "{} exists (made while the header was read): a header backup never \
                 overwrites a file",
                file.display()
            )
        } else {
            format!("cannot create {}: {e}", file.display())
        }
    })?;
    Ok(area)
}

/// `iopages luks header-restore IMAGE FILE [--yes]`.
pub fn header_restore(a: HeaderRestoreArgs) -> Result<(), String> {
    let backup =
        File::open(&a.file).map_err(|e| format!("cannot open {}: {e}", a.file.display()))?;
    let t = luks_target::open(&a.image, true)?;
    let opts = RestoreOptions {
        replace_other_volume: a.yes,
    };
    let restored = match (t.file(), t.backend()) {
        (Some(dev), _) => luks::restore_header(dev, &backup, &opts),
        (None, Some(dev)) => luks::restore_header_backend(dev, &backup, &opts),
        (None, None) => return Err(format!("{}: neither a file nor a remote", t.describe())),
    };
    let r = restored.map_err(|e| {
        let hint = match &e {
            LuksError::RestoreRefused(m) if m.contains("replace_other_volume") => {
                " [--yes allows it]"
            }
            _ => "",
        };
        format!("{}: {e}{hint}", t.describe())
    })?;
    let replaced = match &r.replaced_uuid {
        Some(u) => format!(", replacing volume UUID {}", luks::printable(u)),
        None => String::new(),
    };
    println!(
        "{}: {} header (UUID {}) restored from {}, {} bytes written{replaced}",
        t.describe(),
        r.area.version,
        luks::printable(&r.area.uuid),
        a.file.display(),
        r.written_bytes
    );
    Ok(())
}
