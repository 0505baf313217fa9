//! What `iopages --version` says: the version, what the binary was built
//! from and with, and which code paths this machine gives it.
//!
//! Owns: the text of the long version. The commit and the compiler come
//! from `build.rs` (at build time); the cipher's instructions and whether
//! io_uring works are asked of iopages-crypt on this machine when the
//! text is made. Must never: be computed for a command that did not ask
//! for it (the io_uring probe sets up a ring), or fail — a path that is
//! not there is a line that says so.

use iopages_crypt::XtsBackend;

/// The commit the binary was built from, `-dirty` marked, or `built
/// outside a git checkout` (see build.rs).
pub const BUILD_COMMIT: &str = env!("IOPAGES_BUILD_COMMIT");

/// `rustc --version` of the compiler that built it.
pub const BUILD_RUSTC: &str = env!("IOPAGES_BUILD_RUSTC");

/// The text after `iopages ` that `iopages --version` prints: the
/// version on the first line, then one `what: value` line each for the
/// commit, the compiler, the AES-XTS code in use and io_uring.
///
/// **Context:** sets up and closes one io_uring ring (the probe).
pub fn long_version() -> String {
    let xts = XtsBackend::default();
    let uring = match iopages_crypt::uring::probe() {
        Ok(()) => "available".to_string(),
        Err(e) => format!("unavailable: {e}"),
    };
    let text = format!(
        "{}\ncommit: {BUILD_COMMIT}\nrustc: {BUILD_RUSTC}\naes-xts: {} ({})\nio_uring: {uring}",
        env!("CARGO_PKG_VERSION"),
        xts.name(),
        xts.instructions(),
    );
    debug_assert_eq!(text.lines().count(), 5, "{text}");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_is_twelve_hex_digits_or_says_there_was_no_checkout() {
        let hex = BUILD_COMMIT.strip_suffix("-dirty").unwrap_or(BUILD_COMMIT);
        let is_commit = hex.len() >= 12 && hex.bytes().all(|b| b.is_ascii_hexdigit());
        assert!(
            is_commit || BUILD_COMMIT.starts_with("built outside a git checkout"),
            "{BUILD_COMMIT:?}"
        );
        assert!(BUILD_RUSTC.starts_with("rustc ") || BUILD_RUSTC.starts_with("unknown"));
    }
}
