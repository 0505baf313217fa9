//! Finding outside tools (cryptsetup, nbdkit, qemu-nbd, fio, …).
//!
//! Owns: where a tool is looked for and the one rule for a missing one.
//! Must never: install anything, or decide a test passed — a skipped test
//! says so on stderr, and under `CI=true` a missing tool is a failure.

use std::path::PathBuf;

/// Directories searched after `PATH`: the admin tools (cryptsetup) live in
/// sbin, which an ordinary user's `PATH` often leaves out.
const EXTRA_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/local/sbin", "/usr/bin"];

/// Whether this is a CI run (`CI=true`): there, scripts/setup-debian.sh
/// has installed every outside tool, so a missing one is a failure.
pub fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// The executable `name` on `PATH`, or in /usr/sbin, /sbin,
/// /usr/local/sbin or /usr/bin.
///
/// **Returns:** `None` where there is no such executable file.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(EXTRA_DIRS.map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// The tool `name`, which `who` (a test's name, or what it is for) needs.
///
/// **Returns:** its path; `None` after a `skipped:` line on stderr when it
/// is missing outside CI.
///
/// **Panics:** when it is missing under `CI=true`.
pub fn need_tool(name: &str, who: &str) -> Option<PathBuf> {
    let found = find_tool(name);
    if found.is_none() {
        if ci() {
            panic!("{name} is not installed (CI=true, {who}): scripts/setup-debian.sh installs it");
        }
        eprintln!("skipped {who}: {name} is not installed (scripts/setup-debian.sh installs it)");
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shell_is_found_and_a_made_up_tool_is_not() {
        assert!(find_tool("sh").is_some());
        assert!(find_tool("iopages-no-such-tool-here").is_none());
    }
}
