//! The TLS layer, shared by the server and the remote client: one
//! session type for both ends, the credentials it runs with, and what a
//! finished handshake proved.
//!
//! Owns: the server's credentials — an X.509 directory or a psktool key
//! file — and the psktool file format both ends read (`config.rs`); the
//! identity of the other end and its RFC 4514 spelling (`identity.rs`);
//! the one [`TlsSession`](session::TlsSession) over any
//! [`Socket`](session::Socket), its handshake by a deadline, its
//! non-blocking and timed reads and writes and close_notify
//! (`session.rs`); what each end verifies of the other (`verify.rs`).
//!
//! Must never: name the server (`server/`), the remote client
//! (`client/`) or the transport above it; a connection reaches TLS only
//! through a session it owns. There is one session type: the server's
//! connections and the remote client's run the same code.
//!
//! Depends on: `sys` (poll), `error`.

pub(crate) mod config;
pub(crate) mod identity;
pub(crate) mod session;
pub(crate) mod verify;
