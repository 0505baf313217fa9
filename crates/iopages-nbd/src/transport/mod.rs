//! The transport layer, below the server and the remote client: a
//! connection's socket as a byte stream, and the server connection's
//! non-blocking transport over it.
//!
//! Owns: [`Stream`](stream::Stream) — a TCP or Unix socket, or the remote
//! client's TLS session over one — read, written, cloned and shut down
//! (`stream.rs`); [`Transport`](nonblocking::Transport) — a non-blocking socket whose reads and
//! writes never wait, the TLS session swapped in under them at STARTTLS,
//! readiness waits up to a deadline and the wake-up eventfd
//! (`nonblocking.rs`).
//!
//! Must never: name the server (`server/`) or the remote client
//! (`client/`), or interpret a byte of the NBD protocol; system calls go
//! through `sys`.
//!
//! Depends on: `tls` (the session under a stream), `sys`.

pub(crate) mod nonblocking;
pub(crate) mod stream;
