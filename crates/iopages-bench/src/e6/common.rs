//! What every part of E6 shares: the unit of its figures, its error, and
//! the argument lists and log tails of the tools it runs.
//!
//! Owns: `MIB`, [`workload`] (E6's error), [`os`] (argument lists) and
//! [`tail`] (a log's last lines for an error). Must never: name another
//! E6 module — everything else builds on this.

use crate::BenchError;
use iopages_tools::tail_lines;
use std::ffi::OsString;
use std::path::Path;

pub(crate) const MIB: u64 = 1 << 20;

/// E6's error: a workload error saying "nbd: ".
pub(crate) fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd: {e}"))
}

/// The log file `path`'s last lines, for error messages.
pub(super) fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let t = tail_lines(&s);
    if t.is_empty() {
        "(nothing on stderr)".into()
    } else {
        t
    }
}

/// An argument list of paths and strings.
pub(crate) fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}
