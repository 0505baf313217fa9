//! The crate's one error type.
//!
//! Owns: every error a caller of `iopages` can see from configuration or the
//! operating system. Must never: be used for an ordinary allocation failure —
//! those return `None` (or a count) on the hot path, like the kernel's NULL.

use std::io;

/// Errors from building an arena or allocator, or from the operating system.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The requested arena size cannot be used.
    #[error("arena size {size_bytes} bytes is not usable: {reason}")]
    BadArenaSize {
        /// What was asked for.
        size_bytes: u64,
        /// Why it was refused and what to ask for instead.
        reason: String,
    },
    /// A setting is outside its allowed range.
    #[error("invalid setting {name} = {value}: {reason}")]
    BadSetting {
        /// The setting's name as the builder spells it.
        name: &'static str,
        /// The value given.
        value: String,
        /// The allowed range or rule.
        reason: String,
    },
    /// Huge pages were required but the kernel refused them.
    #[error("huge pages were required for the arena but are not available: {0}")]
    HugePagesUnavailable(io::Error),
    /// A folio is pinned by I/O and cannot be freed.
    #[error("the folio at pfn {pfn} is pinned ({pins} pins) and cannot be freed until its I/O releases it")]
    Pinned {
        /// The folio's head frame.
        pfn: u32,
        /// Pins held.
        pins: u32,
    },
    /// No memory for a request that may fail.
    #[error("out of memory: {0}")]
    NoMemory(String),
    /// A system call failed.
    #[error("{call} failed: {source}")]
    Os {
        /// The call that failed, with its key argument.
        call: String,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub(crate) fn os(call: impl Into<String>) -> Error {
        Error::Os {
            call: call.into(),
            source: io::Error::last_os_error(),
        }
    }

    pub(crate) fn setting(
        name: &'static str,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Error {
        Error::BadSetting {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
