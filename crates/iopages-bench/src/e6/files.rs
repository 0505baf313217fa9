//! The files of an E6 run: its directories, the LUKS1 image and the
//! passphrase, the copy's source file, and the certificates of `--tls`.
//!
//! Owns: [`Files`], [`TlsSetup`], [`work_dirs`] and [`RemoveDirs`] (made
//! afresh, removed on drop), [`fill_file`], [`luks_format`] (its
//! cryptsetup part [`format_luks1`]) and [`make_image`], [`sync_file`] and [`fs_type`]. Must never: leave a
//! directory behind — bind the `RemoveDirs` before any server starts.

use super::common::{os, workload, MIB};
use super::tools::{parse_payload_offset, Tools};
use crate::BenchError;
use iopages_tools::pki::{write_pki, Pki};
use iopages_tools::{run_tool, tail_lines};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The volume's passphrase (the file holds exactly these bytes, no newline:
/// cryptsetup's `--key-file` takes the whole file).
const PASSPHRASE: &[u8] = b"iopages-e6-bench-passphrase";

/// LUKS1 with a 512-bit key puts the payload at sector 4096 (2 MiB).
pub(crate) const LUKS_HEADER_BYTES: u64 = 2 << 20;

/// The certificates of a `--tls` run.
pub struct TlsSetup {
    /// The servers', the clients' (and unused others).
    pub(super) pki: Pki,
    /// `HOME` for fio: `.pki/libnbd` holds the client's certificates.
    pub(super) home: PathBuf,
}

impl TlsSetup {
    /// Certificates under `dir`, and fio's `HOME` with the client's.
    pub(super) fn make(dir: &Path) -> Result<TlsSetup, String> {
        let pki = write_pki(dir)?;
        let home = dir.join("home");
        let libnbd = home.join(".pki/libnbd");
        std::fs::create_dir_all(&libnbd)
            .map_err(|e| format!("cannot create {}: {e}", libnbd.display()))?;
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            std::fs::copy(pki.client.join(f), libnbd.join(f))
                .map_err(|e| format!("cannot copy {f} into {}: {e}", libnbd.display()))?;
        }
        Ok(TlsSetup { pki, home })
    }
}

/// Paths of one bench run.
pub(crate) struct Files {
    /// Image, source file, logs: under the report's directory.
    pub(crate) work: PathBuf,
    /// Unix sockets: under the temporary directory (socket paths are short).
    pub(crate) socks: PathBuf,
    pub(crate) image: PathBuf,
    pub(crate) pass: PathBuf,
    pub(crate) source: PathBuf,
    /// With `--tls`.
    pub(crate) tls: Option<TlsSetup>,
    /// Every server exports the image read-only (the sparse copy's).
    pub(crate) read_only: bool,
}

impl Files {
    /// E6's files in `work` (`luks1.img`, `passphrase`, `source.bin`),
    /// sockets in `socks`, read-write.
    pub(crate) fn e6(work: &Path, socks: PathBuf, tls: Option<TlsSetup>) -> Files {
        Files {
            image: work.join("luks1.img"),
            pass: work.join("passphrase"),
            source: work.join("source.bin"),
            work: work.to_path_buf(),
            socks,
            tls,
            read_only: false,
        }
    }
}

/// Checks that `iopages_bin` exists, then makes afresh the work
/// directory `TAG-work-PID` beside the report `json_path` and the
/// sockets' directory `iopages-TAG-PID` under the temporary directory.
/// Returns the work directory (canonical), the sockets' and what removes
/// both when dropped: bind it before starting any server.
pub(crate) fn work_dirs(
    iopages_bin: &Path,
    json_path: &Path,
    tag: &str,
) -> Result<(PathBuf, PathBuf, RemoveDirs), BenchError> {
    if !iopages_bin.is_file() {
        return Err(workload(format!(
            "{} not found: build it (cargo build --release -p iopages-cli)",
            iopages_bin.display()
        )));
    }
    let report_dir = json_path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let pid = std::process::id();
    let work = report_dir.join(format!("{tag}-work-{pid}"));
    let socks = std::env::temp_dir().join(format!("iopages-{tag}-{pid}"));
    let mk = |d: &Path| {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).map_err(|e| BenchError::Write {
            path: d.to_path_buf(),
            source: e,
        })
    };
    let dirs = RemoveDirs(vec![work.clone(), socks.clone()]);
    mk(&work)?;
    mk(&socks)?;
    let work = work.canonicalize().unwrap_or(work);
    Ok((work, socks, dirs))
}

/// Removes the directories it holds when dropped.
pub(crate) struct RemoveDirs(pub(crate) Vec<PathBuf>);

impl Drop for RemoveDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The volume: data everywhere (no holes to read), then the LUKS header,
/// and the source file of nbdcopy's write. Returns the export's size.
pub(super) fn make_image(tools: &Tools, f: &Files, payload: u64) -> Result<u64, BenchError> {
    fill_file(&f.image, payload + LUKS_HEADER_BYTES, 0x9E37_79B9_7F4A_7C15)?;
    let dev = luks_format(tools, f)?;
    fill_file(&f.source, dev, 0xD1B5_4A32_D192_ED03)?;
    Ok(dev)
}

/// The passphrase file, then `cryptsetup luksFormat` of the file `f.image`
/// as E6 makes it (LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000
/// PBKDF2 iterations): only the header is written, the payload's bytes are
/// left as they are. Returns the export's size (the file's bytes past the
/// payload offset), with the image synced.
pub(crate) fn luks_format(tools: &Tools, f: &Files) -> Result<u64, BenchError> {
    let write_err = |e| BenchError::Write {
        path: f.pass.clone(),
        source: e,
    };
    std::fs::File::create(&f.pass)
        .and_then(|mut p| p.write_all(PASSPHRASE))
        .map_err(write_err)?;
    let len = std::fs::metadata(&f.image)
        .map_err(|e| BenchError::Write {
            path: f.image.clone(),
            source: e,
        })?
        .len();
    format_luks1(&tools.cryptsetup, &f.pass, &f.image, len, &f.work).map_err(workload)
}

/// `cryptsetup luksFormat` of the file `image` (`len` bytes) as E6 makes
/// it, with the key file `pass`, run in `work` (E6 and E6 remote). Returns
/// the export's size (the bytes past the payload offset), with the image
/// synced.
pub(crate) fn format_luks1(
    cryptsetup: &Path,
    pass: &Path,
    image: &Path,
    len: u64,
    work: &Path,
) -> Result<u64, String> {
    let fmt = run_tool(
        cryptsetup,
        &os(&[
            &"luksFormat",
            &"-q",
            &"--type",
            &"luks1",
            &"--cipher",
            &"aes-xts-plain64",
            &"--key-size",
            &"512",
            &"--hash",
            &"sha256",
            &"--pbkdf-force-iterations",
            &"1000",
            &"--key-file",
            &pass,
            &image,
        ]),
        work,
        Duration::from_secs(120),
        &[],
    )?;
    if !fmt.status.success() {
        return Err(format!(
            "cryptsetup luksFormat {}: {}",
            fmt.status,
            tail_lines(&fmt.stderr)
        ));
    }
    let dump = run_tool(
        cryptsetup,
        &os(&[&"luksDump", &image]),
        work,
        Duration::from_secs(60),
        &[],
    )?;
    let offset =
        parse_payload_offset(&dump.stdout).ok_or("cryptsetup luksDump shows no payload offset")?;
    let dev = len.checked_sub(offset).ok_or_else(|| {
        format!("the image ({len} bytes) ends before its payload offset {offset}")
    })?;
    sync_file(image);
    Ok(dev)
}

/// Fill `path` with `bytes` of pseudo-random data and flush it to disk.
pub(crate) fn fill_file(path: &Path, bytes: u64, seed: u64) -> Result<(), BenchError> {
    let err = |e| BenchError::Write {
        path: path.to_path_buf(),
        source: e,
    };
    let mut file = std::fs::File::create(path).map_err(err)?;
    let mut x = seed | 1;
    let mut buf = vec![0u8; MIB as usize];
    for _ in 0..bytes.div_ceil(MIB) {
        for w in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        file.write_all(&buf).map_err(err)?;
    }
    file.set_len(bytes).map_err(err)?;
    file.sync_all().map_err(err)
}

pub(crate) fn sync_file(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// The file system `dir` is on, for the report.
pub(crate) fn fs_type(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: `statfs` is plain old data, for which all zeros is valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is NUL-terminated and outlives the call; statfs
    // writes only into `st`.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown".into();
    }
    match st.f_type as u64 {
        0xEF53 => "ext2/3/4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794C_7630 => "overlayfs".into(),
        t => format!("f_type {t:#x}"),
    }
}
