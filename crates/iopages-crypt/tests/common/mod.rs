//! Helpers shared by the crypt test files: a temporary directory under
//! the target's temp dir, and finding outside tools (cryptsetup, nbdkit)
//! with the skip-unless-CI rule — both from `iopages-testkit`, shared with
//! the other crates' tests and the benchmarks; and for the target,
//! discard and io_uring tests a small arena, removed-on-drop image files
//! (`TempFile`) and the target's scratch directory.

use iopages_testkit::TempDir;
use std::path::PathBuf;

#[allow(unused_imports)]
pub use iopages_testkit::{ci, find_tool};

/// A fresh directory `<prefix>-<name>-<pid>-<n>` under
/// `CARGO_TARGET_TMPDIR`, removed on drop.
#[allow(dead_code)]
pub struct Dir(pub PathBuf, TempDir);

#[allow(dead_code)]
impl Dir {
    pub fn new(prefix: &str, name: &str) -> Dir {
        let t = TempDir::new_in(
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")),
            &format!("{prefix}-{name}"),
        );
        Dir(t.path().to_path_buf(), t)
    }

    pub fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }

    /// A file holding `bytes` (a passphrase file: no newline).
    pub fn file(&self, f: &str, bytes: &[u8]) -> PathBuf {
        let p = self.path(f);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

/// The tool's path; `None` (after a skip line) when it is missing outside
/// CI; a failure when it is missing under `CI=true`.
#[allow(dead_code)]
pub fn need(name: &str, test: &str) -> Option<PathBuf> {
    iopages_testkit::need_tool(name, test)
}

/// `cryptsetup <verb...>` with the cheap KDF every volume here uses
/// (PBKDF2, 1000 iterations), batch mode, and `--key-file` last: the
/// caller appends the key file and the rest.
#[allow(dead_code)]
pub fn cryptsetup_fast(cs: &std::path::Path, verb: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(cs);
    cmd.args(verb).args([
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--batch-mode",
        "--key-file",
    ]);
    cmd
}

/// An arena of `mib` MiB on base pages, for the target and backend tests.
#[allow(dead_code)]
pub fn arena(mib: u64) -> iopages::PageAllocator {
    iopages::PageAllocator::builder()
        .size_bytes(mib << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap()
}

/// A file path `iopages-<tag>-<pid>-<n>.img` under `dir`, removed (if
/// there) when made and when dropped.
#[allow(dead_code)]
pub struct TempFile(pub PathBuf);

#[allow(dead_code)]
impl TempFile {
    pub fn new(dir: &std::path::Path, tag: &str) -> TempFile {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = dir.join(format!("iopages-{tag}-{}-{n}.img", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempFile(p)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// This test target's scratch directory (`CARGO_TARGET_TMPDIR`), made if
/// missing.
#[allow(dead_code)]
pub fn target_tmp() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Bytes of one LUKS2 header copy as `luks::format` and cryptsetup make
/// it (16 KiB: 4 KiB binary header, then the JSON area).
#[allow(dead_code)]
pub const LUKS2_HDR: usize = 16384;

/// Recompute the sha256 checksum of the LUKS2 header copy at `off` of
/// the image `b` (after a test edited it).
#[allow(dead_code)]
pub fn luks2_reseal(b: &mut [u8], off: usize) {
    let area = &mut b[off..off + LUKS2_HDR];
    assert_eq!(&area[72..78], b"sha256");
    area[448..512].fill(0);
    let sum = openssl::sha::sha256(area);
    area[448..480].copy_from_slice(&sum);
}

/// The JSON metadata of the LUKS2 header copy at `off` of the image `b`.
#[allow(dead_code)]
pub fn luks2_json(b: &[u8], off: usize) -> serde_json::Value {
    let area = &b[off + 4096..off + LUKS2_HDR];
    let end = area.iter().position(|&c| c == 0).unwrap();
    serde_json::from_slice(&area[..end]).unwrap()
}
