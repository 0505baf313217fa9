//! A remote store: an NBD client the crypt target can sit on, so that a
//! LUKS image's ciphertext lives on another NBD server (rbd-nbd,
//! qemu-storage-daemon, nbdkit, another host's nbd-server) while the keys
//! and the cipher stay here.
//!
//! Owns: NBD URIs ([`RemoteSpec`]: `nbd://host[:port][/export]`,
//! `nbd+unix:///export?socket=PATH`, and their TLS forms `nbds://` and
//! `nbds+unix://` with libnbd's `tls-*` query parameters), the client side
//! of the fixed newstyle handshake (NBD_OPT_STARTTLS first for `nbds`,
//! NBD_OPT_GO asking for the block sizes, falling back to
//! NBD_OPT_EXPORT_NAME), and transmission with simple replies over one
//! or more connections ([`NbdRemote`], a
//! [`Backend`]). Must never: continue in plaintext when the URI asked for
//! TLS (a remote that does not offer it is refused); hang — every
//! request has one deadline, its submission plus
//! [`RemoteOptions::timeout`], that bounds its wait for an in-flight slot,
//! for the connection's writer, every write of it (however slowly the
//! store reads) and the wait for its reply: past it the request fails with
//! `TimedOut` naming what it waited for, and a connection whose socket is
//! stuck (a request left half sent, or one sent and not answered) is
//! given up; a connection
//! that dies fails every request waiting on it on that connection at
//! once — each is sent again on a live connection until its deadline, and
//! `link.rs` reconnects the dead one in the background; or send a
//! request the export's constraints forbid (out of range, misaligned, a write to a read-only
//! export): those are refused before anything is sent.
//!
//! Threads: each connection has one reader thread, which reads replies
//! and completes the waiting caller by cookie (a map cookie → pending
//! request, each with its own condition variable, under the connection's
//! mutex). Requests are written whole (header and payload) under the
//! connection's writer mutex by the calling thread, with sends that do
//! not block, polled until the request's deadline; the started requests
//! of a thread that holds them back
//! ([`hold_starts`](iopages_crypt::async_io::hold_starts)) are written
//! together, many per `sendmsg` (`started.rs`). The reader reads
//! through a buffer ([`RECV_BUFFER_BYTES`]): one `read` brings in many
//! small replies at once, and a large payload goes past the buffer
//! straight into its destination; it waits for bytes with `poll` for
//! input, not asleep in `recv` (which a Unix socket also wakes for every
//! piece of a write the store takes), and for room while a write the
//! socket took in part is left to it (`tail.rs`). A read's data is put by the reader
//! into the waiting caller's own buffers (registered with the request),
//! so a reply costs one wake-up of its caller and no hand-off of the
//! socket; the caller does not return while the reader may be writing
//! into them. Structured replies are not negotiated. Under TLS every
//! connection does its own STARTTLS, and its stream is a
//! [`ClientTls`](crate::client::tls::ClientTls) session (`client/tls.rs`)
//! read and written the same way.
//!
//! The client layer's files: the URI (`uri.rs`), the client side of the
//! handshake (`wire.rs`), one connection and its reader thread
//! (`conn.rs`), requests started without a waiting thread — the
//! [`AsyncIo`](iopages_crypt::async_io::AsyncIo) the crypt queue starts
//! reads and writes up to 1 MiB through, ended by the reader
//! (`started.rs`), the rest of a write the socket took in part, which
//! the reader sends as the store reads (`tail.rs`),
//! the connections of a remote with their health and
//! counters (`link.rs`), the URI's TLS settings and the connector
//! (`tls.rs`), and the [`Backend`] itself (`backend.rs`); this file keeps
//! the defaults and [`RemoteOptions`]. The threads live in
//! `conn.rs` and `link.rs`: an event loop replacing them changes those
//! files, not the layout. Must never: name the server (`server/`); reach
//! the kernel except through `sys`. It is published as
//! `iopages_nbd::remote`.

pub use crate::client::tls::RemoteTls;
use crate::client::tls::{ClientTls, Connector};
use crate::proto::{
    Request, CMD_DISC, CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES,
    EINVAL, EIO, ENOMEM, ENOSPC, ENOTSUP, EOVERFLOW, EPERM, ESHUTDOWN, FLAG_C_FIXED_NEWSTYLE,
    FLAG_C_NO_ZEROES, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO_BLOCK_SIZE, INFO_EXPORT,
    NBD_MAGIC, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, OPT_REPLY_MAGIC, OPT_STARTTLS, REP_ACK,
    REP_ERR_POLICY, REP_ERR_TLS_REQD, REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_FLAG_ERROR, REP_INFO,
    SIMPLE_REPLY_BYTES, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC, TFLAG_CAN_MULTI_CONN,
    TFLAG_HAS_FLAGS, TFLAG_READ_ONLY, TFLAG_SEND_FLUSH, TFLAG_SEND_FUA, TFLAG_SEND_TRIM,
    TFLAG_SEND_WRITE_ZEROES,
};
use crate::transport::stream::Stream;
use iopages_crypt::backend::{check_range, Backend};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The NBD port a `nbd://` URI without one means.
pub const DEFAULT_PORT: u16 = 10809;
/// Connections opened by default (when the export allows several).
pub const DEFAULT_CONNECTIONS: usize = 4;
/// A request's deadline from its submission by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long requests wait for a store to come back by default.
pub const DEFAULT_RECONNECT_DELAY: Duration = Duration::from_secs(10);
/// The longest `reconnect-delay` accepted (an hour).
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(3600);
/// Requests in flight per connection by default.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;
/// The largest READ or WRITE payload sent in one request (32 MiB, the
/// protocol's default maximum); larger I/Os are split.
pub const MAX_PAYLOAD_BYTES: u32 = 32 << 20;
/// The largest TRIM or WRITE_ZEROES sent in one request (1 GiB); larger
/// ranges are split.
const MAX_EFFECT_BYTES: u64 = 1 << 30;
/// The second 8 bytes of an oldstyle server's greeting.
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Option reply data accepted during the handshake.
const MAX_OPTION_REPLY_BYTES: usize = 64 << 10;
/// Replies to one NBD_OPT_GO a remote may send before its final one (a
/// few NBD_REP_INFO); past it the handshake is given up rather than read
/// for ever.
const MAX_GO_REPLIES: usize = 64;
/// Error reply: the server requires block sizes to be asked for.
const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
/// The reader thread's receive buffer: replies (headers and payloads
/// smaller than it) are read through it, many per `read`.
pub const RECV_BUFFER_BYTES: usize = 64 << 10;

mod backend;
mod conn;
mod link;
mod started;
mod tail;
#[cfg(test)]
mod tests;
pub(crate) mod tls;
mod uri;
mod wire;

pub use backend::{NbdRemote, ASYNC_WRITE_MAX_BYTES};
use conn::*;
pub use link::RemoteHealth;
use link::*;
use started::*;
use tail::Tail;
pub use uri::*;
use wire::*;

/// How to use a remote export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Connections to open when the export advertises
    /// NBD_FLAG_CAN_MULTI_CONN (else one). Default
    /// [`DEFAULT_CONNECTIONS`].
    pub connections: usize,
    /// Refuse every write, punch and discard (`PermissionDenied`), even if
    /// the export is writable.
    pub read_only: bool,
    /// Each request's deadline, from its submission: waiting for a slot
    /// and for the connection's writer, sending it and waiting for its
    /// reply all end within this, else it fails with `TimedOut` (and a
    /// connection left half-sent or unanswered is given up); also the limit
    /// on connecting and on the handshake. Default [`DEFAULT_TIMEOUT`].
    pub timeout: Duration,
    /// Requests in flight per connection; callers wait for a slot beyond
    /// it. Default [`DEFAULT_MAX_IN_FLIGHT`].
    pub max_in_flight: usize,
    /// How long requests wait for a reconnect once no connection to the
    /// store serves, before failing (EIO); reconnect attempts go on
    /// beyond it. A URI's `reconnect-delay=SECS` overrides it. Default
    /// [`DEFAULT_RECONNECT_DELAY`].
    pub reconnect_delay: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connections: DEFAULT_CONNECTIONS,
            read_only: false,
            timeout: DEFAULT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            reconnect_delay: DEFAULT_RECONNECT_DELAY,
        }
    }
}
