//! Helpers shared by the LUKS test files: a temporary directory under
//! the target's temp dir, and finding outside tools (cryptsetup, nbdkit)
//! with the skip-unless-CI rule.

use std::path::PathBuf;

/// A fresh directory `<prefix>-<name>-<pid>` under `CARGO_TARGET_TMPDIR`,
/// removed on drop.
#[allow(dead_code)]
pub struct Dir(pub PathBuf);

#[allow(dead_code)]
impl Dir {
    pub fn new(prefix: &str, name: &str) -> Dir {
        let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{prefix}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
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

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The tool on `PATH`, or in /usr/sbin, /sbin or /usr/bin.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The tool's path; `None` (after a skip line) when it is missing outside
/// CI; a failure when it is missing under `CI=true`.
#[allow(dead_code)]
pub fn need(name: &str, test: &str) -> Option<PathBuf> {
    match find_tool(name) {
        Some(p) => Some(p),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{name} is not installed (CI=true): run scripts/setup-debian.sh")
        }
        None => {
            eprintln!("skip {test}: {name} is not installed (scripts/setup-debian.sh installs it)");
            None
        }
    }
}
