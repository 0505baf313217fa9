//! Where an `iopages luks` verb's IMAGE is: a file or block device, or a
//! remote NBD export (`nbd://`, `nbd+unix://`, `nbds://`, `nbds+unix://`),
//! opened for reading or for writing its header.
//!
//! Owns: opening the image, and the locks that make two header writers
//! exclude each other on one host — `flock` on the image itself, and for a
//! block device also cryptsetup's own lock file (`/run/cryptsetup/L_MAJ:MIN`,
//! flocked the same way), so `iopages luks` and `cryptsetup` exclude each
//! other too. Must never: wait for a lock (a verb that finds the header
//! locked fails at once, saying who may hold it), or write through a
//! remote opened read-only. A remote store offers no lock and no
//! compare-and-swap: two hosts changing one remote header at once are not
//! excluded here (the verbs re-read and verify what they wrote).

use crate::served::image_spec;
use iopages_crypt::backend::Backend;
use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where cryptsetup keeps its device lock files.
const CRYPTSETUP_LOCK_DIR: &str = "/run/cryptsetup";

/// An opened IMAGE; its locks are held until it is dropped.
pub enum Target {
    /// A file or block device.
    Local {
        file: File,
        path: PathBuf,
        /// cryptsetup's lock file of a block device, flocked.
        _device_lock: Option<File>,
    },
    /// A remote NBD export.
    Remote { remote: Arc<NbdRemote>, uri: String },
}

impl Target {
    /// The file or block device, if IMAGE is one.
    pub fn file(&self) -> Option<&File> {
        match self {
            Target::Local { file, .. } => Some(file),
            Target::Remote { .. } => None,
        }
    }

    /// The remote export, if IMAGE is one.
    pub fn backend(&self) -> Option<&dyn Backend> {
        match self {
            Target::Local { .. } => None,
            Target::Remote { remote, .. } => Some(&**remote),
        }
    }

    /// The remote export as a shared backend, if IMAGE is one.
    pub fn shared(&self) -> Option<Arc<dyn Backend>> {
        match self {
            Target::Local { .. } => None,
            Target::Remote { remote, .. } => Some(Arc::clone(remote) as Arc<dyn Backend>),
        }
    }

    /// The path or URI, for messages.
    pub fn describe(&self) -> String {
        match self {
            Target::Local { path, .. } => path.display().to_string(),
            Target::Remote { uri, .. } => uri.clone(),
        }
    }
}

/// Open `image` to read its header, or (`write`) to change it: a path
/// gets an exclusive `flock` (shared for reading), a block device also
/// cryptsetup's lock; an NBD URI is connected (one connection, read-only
/// unless `write`).
///
/// **Returns:** the target; an error naming the image and what failed
/// (not found, permission, locked by another process, the store
/// unreachable).
pub fn open(image: &Path, write: bool) -> Result<Target, String> {
    match image_spec(image) {
        crate::config::ImageSpec::Nbd(uri) => open_remote(&uri, write),
        crate::config::ImageSpec::Path(path) => open_local(&path, write),
    }
}

fn open_remote(uri: &str, write: bool) -> Result<Target, String> {
    let spec = RemoteSpec::parse(uri).map_err(|e| format!("{uri}: {e}"))?;
    let opts = RemoteOptions {
        connections: 1,
        read_only: !write,
        ..RemoteOptions::default()
    };
    let remote =
        NbdRemote::connect(&spec, &opts).map_err(|e| format!("cannot reach {uri}: {e}"))?;
    if write && remote.is_read_only() {
        return Err(format!(
            "{uri}: the remote export is read-only: its header cannot be changed"
        ));
    }
    Ok(Target::Remote {
        remote: Arc::new(remote),
        uri: uri.to_string(),
    })
}

fn open_local(path: &Path, write: bool) -> Result<Target, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let what = path.display().to_string();
    lock(&file, write, &what)?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let device_lock = if meta.file_type().is_block_device() {
        Some(device_lock(meta.rdev(), write, &what)?)
    } else {
        None
    };
    Ok(Target::Local {
        file,
        path: path.to_path_buf(),
        _device_lock: device_lock,
    })
}

/// `flock` `file`, exclusive for `write`, shared otherwise, without
/// waiting.
fn lock(file: &File, write: bool, what: &str) -> Result<(), String> {
    let op = if write { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    let Err(e) = crate::sys::flock(file.as_raw_fd(), op) else {
        return Ok(());
    };
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(format!(
            "{what} is locked by another process changing its header (iopages luks or \
             cryptsetup): try again once it is done"
        ));
    }
    Err(format!("cannot lock {what}: {e}"))
}

/// cryptsetup's lock of the block device `rdev`: its lock file, created
/// if missing (mode 0600 in a 0700 directory), flocked as [`lock`] does.
fn device_lock(rdev: u64, write: bool, what: &str) -> Result<File, String> {
    let dir = Path::new(CRYPTSETUP_LOCK_DIR);
    if !dir.is_dir() {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let name = format!("L_{}:{}", libc::major(rdev), libc::minor(rdev));
    let p = dir.join(name);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&p)
        .map_err(|e| format!("cannot open cryptsetup's lock {}: {e}", p.display()))?;
    lock(
        &f,
        write,
        &format!("{what} (cryptsetup's lock {})", p.display()),
    )?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_at_once_and_readers_share() {
        let dir = iopages_testkit::TempDir::new("luks-target");
        let img = dir.join("img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        let first = open(&img, true).unwrap();
        let e = open(&img, true).err().unwrap();
        assert!(e.contains("is locked by another process"), "{e}");
        assert!(open(&img, false).is_err(), "a reader waits for no writer");
        drop(first);
        let r1 = open(&img, false).unwrap();
        let r2 = open(&img, false).unwrap();
        assert!(open(&img, true).is_err());
        assert_eq!(r1.describe(), img.display().to_string());
        assert!(r2.file().is_some() && r2.backend().is_none());
    }

    #[test]
    fn a_missing_image_and_a_bad_uri_say_what_is_wrong() {
        let e = open(Path::new("/nonexistent/iopages-image"), false)
            .err()
            .unwrap();
        assert!(e.contains("cannot open /nonexistent/iopages-image"), "{e}");
        let e = open(Path::new("nbd://h/e?bogus=1"), true).err().unwrap();
        assert!(e.contains("unknown query parameter"), "{e}");
    }
}
