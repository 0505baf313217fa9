//! The crate's error type.
//!
//! Owns: what can go wrong starting or running a server, with messages
//! that say what to do. Must never: carry a protocol error a client caused
//! (those are answered on the wire, not returned).

use std::io;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listening socket could not be set up.
    #[error("cannot listen on {addr}: {source} (pick another address with --listen or --unix, remove a stale socket file, or stop what holds the address)")]
    Listen {
        /// The address asked for.
        addr: String,
        /// The cause.
        source: io::Error,
    },
    /// The export's settings are inconsistent.
    #[error("bad export settings: {0}")]
    Config(String),
    /// Another I/O failure (a thread could not be started, …).
    #[error("NBD server I/O error: {0}")]
    Io(#[from] io::Error),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
