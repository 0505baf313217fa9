//! Temporary directories for tests and benchmark runs.
//!
//! Owns: a directory of its own, removed when dropped. Must never: remove
//! anything it did not create (the name carries the process id and a
//! counter, so two tests or two processes never share one).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory `<base>/<name>-<pid>-<n>`, removed (with what is in
/// it) on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Create `<base>/<name>-<pid>-<n>`, `n` counting the directories this
    /// process has made.
    ///
    /// **Panics:** if the directory cannot be created (a test cannot go on).
    pub fn new_in(base: &Path, name: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let p = base.join(format!("{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", p.display()));
        TempDir(p)
    }

    /// The same under the system's temporary directory.
    pub fn new(name: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), name)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `f` inside the directory.
    pub fn join(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_dirs_of_one_name_differ_and_are_removed_on_drop() {
        let (a, b) = (TempDir::new("testkit"), TempDir::new("testkit"));
        assert_ne!(a.path(), b.path());
        let p = a.path().to_path_buf();
        std::fs::write(a.join("f"), b"x").unwrap();
        drop(a);
        assert!(!p.exists());
    }
}
