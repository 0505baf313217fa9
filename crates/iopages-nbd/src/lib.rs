//! # iopages-nbd — the crypt target over NBD
//!
//! An NBD server (the newstyle fixed handshake of the NBD protocol,
//! `doc/proto.md` of the NetworkBlockDevice project) exporting one
//! [`CryptTarget`](iopages_crypt::target::CryptTarget) through a
//! [`CryptQueue`](iopages_crypt::queue::CryptQueue), over TCP and Unix
//! sockets, so that the clients people already use (qemu-img, qemu-io,
//! nbd-client, nbdcopy, fio's nbd engine) read and write the encrypted
//! volume.
//!
//! Owns: the export's description ([`ExportConfig`] → what is advertised)
//! and the crate's map. Must never: panic or hang on what a client sends;
//! every protocol error is answered on the wire or closes that one
//! connection.
//!
//! The crate is in layers, each a folder whose `mod.rs` says what it
//! owns and must never do; a layer names only the layers below it:
//!
//! ```text
//!   volume.rs                     crypt stacks (over a file or a remote)
//!   server/         client/       the NBD server; the NBD client (remote store)
//!        transport/               a connection's socket: stream, non-blocking transport
//!           tls/                  one TLS session type for both ends; credentials
//!   proto.rs  stats.rs  error.rs  wire format; counters; errors
//!            sys.rs               every system call, wrapped once
//! ```
//!
//! | piece | file |
//! |---|---|
//! | wire constants and headers | `proto.rs` |
//! | every system call the crate makes (`poll`, eventfd, `O_NONBLOCK`, umask, `SO_PEERCRED`, Unix connect, `sendmsg`, memfd seals) | `sys.rs` |
//! | listeners, threads, server-wide limits, shutdown | `server/serve.rs` |
//! | option haggling (STARTTLS, structured replies, metadata contexts, GO, INFO, EXPORT_NAME, LIST, ABORT) | `server/handshake.rs` |
//! | transmission: requests, chunks, non-blocking batched replies, FUA, errors, deadlines, byte budget | `server/conn.rs` |
//! | payload buffers in the target's arena (kvmalloc) | `server/buffers.rs` |
//! | the queue, or inline service on the connection's thread; discards and the allocation map | `server/device.rs` |
//! | the exports: names, the default, who may use each, opening lazy ones once (retried after a backoff) | `server/export.rs` |
//! | who a client is (address, Unix credentials, TLS identity) and the `allow` rules | `server/peer.rs` |
//! | fair shares of the limits among peers: the handshake pool, connections, bytes | `server/shares.rs` |
//! | an export's rate limits (token buckets) | `server/rate.rs` |
//! | the non-blocking socket, `poll` and the wake-up eventfd; STARTTLS swaps in the connection's TLS session | `transport/nonblocking.rs` |
//! | a socket's byte stream (TCP or Unix, or the remote client's TLS session), cloned for replies | `transport/stream.rs` |
//! | TLS credentials (X.509 directory, psktool key file) | `tls/config.rs` |
//! | what a TLS handshake proved (PSK identity, certificate subject in RFC 4514) | `tls/identity.rs` |
//! | one TLS session for both ends (a server connection, a remote client connection): the handshake by a deadline, non-blocking and timed reads and writes, close_notify | `tls/session.rs` |
//! | what each end verifies of the other | `tls/verify.rs` |
//! | per-command counts, latency and shape histograms | `stats.rs` |
//! | LUKS images and the in-memory LUKS2 volume, set up as crypt stacks | `volume.rs` |
//! | what can go wrong starting or running a server | `error.rs` |
//! | an NBD client as a crypt backend (`iopages_nbd::remote`): ciphertext on a remote NBD server (`nbd://`, `nbd+unix://`, over TLS `nbds://`, `nbds+unix://`) | `client/` (`uri.rs`, `wire.rs`, `conn.rs`, `link.rs`, `mod.rs`) |
//! | the remote client's TLS: URI settings and the OpenSSL connector | `client/tls.rs` |
//!
//! What is served: READ, WRITE, FLUSH, TRIM, WRITE_ZEROES, BLOCK_STATUS
//! and DISC. By default TRIM is checked and then does nothing (the
//! ciphertext stays), WRITE_ZEROES writes encrypted zeros, and block
//! status reports every extent allocated. When the target allows discards
//! ([`TargetConfig::allow_discards`](iopages_crypt::target::TargetConfig),
//! `iopages serve --allow-discards`), TRIM punches the whole encryption
//! sectors inside it out of the image, WRITE_ZEROES without NO_HOLE
//! punches too (and NBD_FLAG_SEND_FAST_ZERO is offered), a sector whose
//! ciphertext is all zeros reads as zeros, and block status reports the
//! image's holes (rounded inward to whole sectors) as HOLE|ZERO. A
//! misaligned TRIM is accepted, as a discard of the whole sectors inside
//! it. FUA on WRITE, WRITE_ZEROES and TRIM flushes the target after the
//! write and before the reply — unless the target's backend takes FUA
//! itself (an NBD remote offering it): then a write's (and encrypted
//! zeros') FUA goes down with each of its writes and nothing is flushed. Block status needs the `base:allocation`
//! metadata context, selected during the handshake. Structured replies when the client asks
//! (NBD_OPT_STRUCTURED_REPLY, forgotten by a later STARTTLS): a read's
//! data is one final OFFSET_DATA chunk (one OFFSET_HOLE chunk and no data
//! when it is all zeros), every error one final ERROR chunk
//! with a message, other successes simple replies (which `proto.md`
//! allows without payload); simple replies to clients that do not ask.
//! Many requests
//! are in flight per connection (the reader submits to the queue, or
//! serves small requests itself with [`ExportConfig::inline_max_bytes`];
//! completions queue their replies, which leave in batches of vectored
//! writes, in completion order), and several connections share one queue
//! (NBD_FLAG_CAN_MULTI_CONN: a flush on any covers writes completed on all).
//! Write payloads are received straight into pages of the target's arena.
//!
//! Against hostile clients ([`ServerOptions`]): a crypt worker never waits
//! on a socket (it tries a non-blocking send; the connection's own thread
//! sends the rest as the client reads), so a client that stops reading
//! delays only itself, and loses its connection once a reply has waited
//! for the reply timeout; the handshake has one deadline in all; idle
//! connections close; open connections and payload bytes in flight over
//! all connections are capped, and shared max-min fairly among the peers
//! (`server/shares.rs`): a peer is its TLS identity once it has one, else its
//! address or Unix uid; handshakes have a pool of their own in which
//! silent sockets only ever push each other out; WRITE_ZEROES and TRIM
//! are charged by the bytes they make the server write or punch. Each
//! export may list who may use it ([`AllowRule`]) and limit its rate
//! ([`RateLimit`]). TLS (NBD_OPT_STARTTLS, X.509 or PSK, offered
//! or required) runs over the same non-blocking transport.
//!
//! A server on a RAM disk, and this crate's own NBD client ([`remote`])
//! writing through it: the client sees its data, the disk holds only
//! ciphertext.
//!
//! ```
//! use iopages::PageAllocator;
//! use iopages_crypt::backend::{Backend, RamDisk};
//! use iopages_crypt::queue::{CryptQueue, QueueConfig};
//! use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
//! use iopages_crypt::XtsCipher;
//! use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
//! use iopages_nbd::{ExportConfig, Listen, Server};
//! use std::sync::Arc;
//!
//! let alloc = PageAllocator::builder().size_bytes(64 << 20).build().unwrap();
//! let disk = Arc::new(RamDisk::new(16 << 20).unwrap());
//! let key: Vec<u8> = (0u8..64).collect();
//! let cipher = CipherPool::new(XtsCipher::new(&key, 512, 0).unwrap(), 2).unwrap();
//! let below: Arc<dyn Backend> = disk.clone();
//! let target = Arc::new(CryptTarget::new(&alloc, cipher, below, TargetConfig::default()).unwrap());
//! let queue = Arc::new(CryptQueue::new(target, QueueConfig::default()).unwrap());
//! let server = Server::start(
//!     queue,
//!     ExportConfig::new("vol"),
//!     &[Listen::Tcp("127.0.0.1:0".parse().unwrap())],
//! )
//! .unwrap();
//! let uri = format!("nbd://{}/vol", server.tcp_addr().unwrap());
//!
//! let client = NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default())
//!     .unwrap();
//! assert_eq!(client.size_bytes(), 16 << 20);
//! let data = vec![0x5au8; 4096];
//! client.write_at(8192, &[&data]).unwrap();
//! client.flush().unwrap();
//! let mut back = vec![0u8; 4096];
//! client.read_at(8192, &mut [&mut back]).unwrap();
//! assert_eq!(back, data);
//! let mut stored = vec![0u8; 4096];
//! disk.read_at(8192, &mut [&mut stored]).unwrap();
//! assert_ne!(stored, data);
//!
//! drop(client);
//! server.shutdown();
//! ```
//!
//! ## Requirements
//!
//! Linux only (memfd, `poll`, eventfd, `SO_PEERCRED`, io_uring for targets
//! on files). TLS is OpenSSL's, built from source through `openssl`'s
//! `vendored` feature: a first build needs a C compiler, `perl` and `make`,
//! and no system libssl. Rust 1.89 or later (`rust-version`); only the
//! current stable toolchain is tested.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod client;
mod error;
pub mod proto;
mod server;
mod stats;
mod sys;
mod tls;
mod transport;
pub mod volume;

/// A remote store: an NBD client the crypt target can sit on, so that a
/// LUKS image's ciphertext lives on another NBD server while the keys and
/// the cipher stay here. [`NbdRemote`](remote::NbdRemote) is a
/// [`Backend`](iopages_crypt::backend::Backend) on the export an NBD URI
/// names ([`RemoteSpec`](remote::RemoteSpec): `nbd://`, `nbd+unix://`,
/// and over TLS `nbds://`, `nbds+unix://`); every request has one
/// deadline, its submission plus
/// [`RemoteOptions::timeout`](remote::RemoteOptions::timeout). Written in
/// the `client/` layer.
pub mod remote {
    pub use crate::client::*;
}

pub use error::{Error, Result};
pub use server::conn::{MAX_BYTES_IN_FLIGHT, MAX_REQUESTS_IN_FLIGHT};
pub use server::export::{
    Export, ExportState, ExportVolume, Opener, OPEN_BACKOFF_FIRST, OPEN_BACKOFF_MAX,
};
pub use server::handshake::MAX_OPTION_BYTES;
pub use server::partial::CHUNK_BYTES;
pub use server::peer::AllowRule;
pub use server::rate::RateLimit;
pub use server::serve::{
    Listen, Listener, Server, ServerOptions, StatsHandle, DEFAULT_IDLE_TIMEOUT, DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_PARK_AFTER, DEFAULT_PEER_MIN_CONNECTIONS, DEFAULT_PEER_MIN_INFLIGHT_BYTES,
    HANDSHAKE_TIMEOUT, REPLY_TIMEOUT,
};
pub use stats::{
    align_bucket, latency_bucket, latency_bucket_bound_us, size_bucket, BufferStats, CommandStats,
    DirShape, ExportFigures, IoShape, Latency, LatencyHist, PeerStats, Stats, LATENCY_BUCKETS,
    SHAPE_BUCKETS,
};
pub use tls::config::{TlsConfig, TlsMode};
pub use tls::identity::TlsIdentity;

/// The default preferred block size advertised (bytes).
pub const DEFAULT_PREFERRED_BLOCK_BYTES: u32 = 4096;
/// The default (and largest) maximum block size advertised: 32 MiB, the
/// largest payload a client may send or ask for in one request.
pub const DEFAULT_MAX_BLOCK_BYTES: u32 = 32 << 20;

/// What to export and how to describe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportConfig {
    /// The export's name (clients ask for it; the empty name also selects
    /// it, as the protocol's default export).
    pub name: String,
    /// A description sent on NBD_INFO_DESCRIPTION (empty: none).
    pub description: String,
    /// Refuse every write (EPERM) and advertise NBD_FLAG_READ_ONLY.
    pub read_only: bool,
    /// A client that has not finished the handshake after this long is
    /// disconnected. Default [`HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: std::time::Duration,
    /// Serve requests of at most this many bytes on their connection's
    /// thread instead of handing them to the crypt queue's workers
    /// (dm-crypt's `no_read_workqueue` / `no_write_workqueue`, by size):
    /// no hand-off per request, but one such request at a time per
    /// connection. For backends fast enough that the hand-off costs more
    /// than the I/O (memory, the page cache); larger requests still go to
    /// the workers, which encrypt several at once — unless at least as
    /// many connections are in transmission as the queue has workers, when
    /// every request is served inline (the connections' threads already
    /// use every core). 0 (default): never inline.
    pub inline_max_bytes: u32,
    /// Preferred block size: a power of two, at least the sector size.
    pub preferred_block_bytes: u32,
    /// Maximum block size: a multiple of the sector size, at most
    /// [`DEFAULT_MAX_BLOCK_BYTES`].
    pub max_block_bytes: u32,
    /// Who may use the export (empty: anyone the server admits). A client
    /// that matches no rule is told there is no such export and does not
    /// see it in NBD_OPT_LIST; a lazy export is opened only for a client
    /// that matches.
    pub allow: Vec<AllowRule>,
    /// Bytes and requests per second over all the export's connections.
    pub rate: RateLimit,
}

impl ExportConfig {
    /// A writable export named `name` with the default block sizes
    /// (minimum: the target's sector size; preferred 4096; maximum 32 MiB).
    pub fn new(name: impl Into<String>) -> ExportConfig {
        ExportConfig {
            name: name.into(),
            description: "iopages encrypted volume (aes-xts-plain64)".into(),
            read_only: false,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            inline_max_bytes: 0,
            preferred_block_bytes: DEFAULT_PREFERRED_BLOCK_BYTES,
            max_block_bytes: DEFAULT_MAX_BLOCK_BYTES,
            allow: Vec::new(),
            rate: RateLimit::default(),
        }
    }
}

/// What is advertised, checked against the target.
#[derive(Clone, Debug)]
pub(crate) struct ExportInfo {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) read_only: bool,
    pub(crate) size_bytes: u64,
    pub(crate) min_block_bytes: u32,
    pub(crate) preferred_block_bytes: u32,
    pub(crate) max_block_bytes: u32,
    /// TRIM discards and holes read as zeros (the target allows discards).
    pub(crate) discards: bool,
    /// WRITE_ZEROES can punch: NBD_FLAG_SEND_FAST_ZERO is advertised.
    pub(crate) fast_zero: bool,
}

impl ExportInfo {
    pub(crate) fn new(c: &ExportConfig, size_bytes: u64, sector_bytes: u32) -> Result<ExportInfo> {
        let bad = |m: String| Err(Error::Config(m));
        if c.name.len() > 4096 || c.name.contains('\0') {
            return bad("the export name must be at most 4096 bytes with no NUL".into());
        }
        if c.description.len() > 4096 || c.description.contains('\0') {
            return bad("the description must be at most 4096 bytes with no NUL".into());
        }
        if !sector_bytes.is_power_of_two() {
            return bad(format!("sector size {sector_bytes} is not a power of two"));
        }
        let preferred = c.preferred_block_bytes.max(sector_bytes);
        if !preferred.is_power_of_two() {
            return bad(format!(
                "preferred block size {preferred} must be a power of two"
            ));
        }
        let max = c.max_block_bytes;
        if max < preferred || !max.is_multiple_of(sector_bytes) || max > DEFAULT_MAX_BLOCK_BYTES {
            return bad(format!(
                "maximum block size {max} must be a multiple of the {sector_bytes}-byte sector, at least the preferred size {preferred} and at most {DEFAULT_MAX_BLOCK_BYTES}"
            ));
        }
        Ok(ExportInfo {
            name: c.name.clone(),
            description: c.description.clone(),
            read_only: c.read_only,
            size_bytes,
            min_block_bytes: sector_bytes,
            preferred_block_bytes: preferred,
            max_block_bytes: max,
            discards: false,
            fast_zero: false,
        })
    }

    pub(crate) fn transmission_flags(&self) -> u16 {
        use proto::*;
        let mut f = TFLAG_HAS_FLAGS
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_SEND_TRIM
            | TFLAG_SEND_WRITE_ZEROES
            | TFLAG_CAN_MULTI_CONN;
        if self.read_only {
            f |= TFLAG_READ_ONLY;
        } else if self.fast_zero {
            f |= TFLAG_SEND_FAST_ZERO;
        }
        f
    }
}
