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
//! that dies fails every request waiting on it and every later one at
//! once (there is no reconnect); or send a request the export's
//! constraints forbid (out of range, misaligned, a write to a read-only
//! export): those are refused before anything is sent.
//!
//! Threads: each connection has one reader thread, which reads replies
//! and completes the waiting caller by cookie (a map cookie → pending
//! request, each with its own condition variable, under the connection's
//! mutex). Requests are written whole (header and payload) under the
//! connection's writer mutex by the calling thread, with sends that do
//! not block, polled until the request's deadline. The reader reads
//! through a buffer ([`RECV_BUFFER_BYTES`]): one `read` brings in many
//! small replies at once, and a large payload goes past the buffer
//! straight into its destination. A read's data is put by the reader
//! into the waiting caller's own buffers (registered with the request),
//! so a reply costs one wake-up of its caller and no hand-off of the
//! socket; the caller does not return while the reader may be writing
//! into them. Structured replies are not negotiated. Under TLS every
//! connection does its own STARTTLS, and its stream is a
//! [`ClientTls`](crate::remote_tls::ClientTls) session (`remote_tls.rs`)
//! read and written the same way.

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
pub use crate::remote_tls::RemoteTls;
use crate::remote_tls::{ClientTls, Connector};
use crate::stream::Stream;
use iopages_crypt::backend::{check_range, Backend};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
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

mod conn;
#[cfg(test)]
mod tests;
mod uri;
mod wire;

use conn::*;
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
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connections: DEFAULT_CONNECTIONS,
            read_only: false,
            timeout: DEFAULT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }
}

/// An NBD export used as the crypt target's backend: its ciphertext lives
/// on another NBD server.
///
/// I/Os are checked (range, the export's minimum block size, writability)
/// before anything is sent, split at the maximum payload, and spread over
/// the connections round-robin; many callers' requests are in flight at
/// once (up to [`RemoteOptions::max_in_flight`] per connection).
pub struct NbdRemote {
    uri: String,
    conns: Vec<Arc<Conn>>,
    readers: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    info: ExportInfo,
    read_only: bool,
}

impl NbdRemote {
    /// Connect to `spec` and negotiate its export: one connection, or
    /// `opts.connections` when the export advertises
    /// NBD_FLAG_CAN_MULTI_CONN, each with its reader thread.
    ///
    /// **Context:** blocks (connecting, the handshakes): each connection's
    /// connect (over all of a host's addresses; a Unix socket that accepts
    /// nothing included) and its whole handshake (TLS included) at most
    /// `opts.timeout` each; the host name lookup is the system resolver's. **Returns:** `InvalidInput` for options of zero;
    /// the connect error; `NotFound` for an export the server does not
    /// have; `InvalidData` for a server breaking the protocol (or
    /// connections that disagree about the export); `TimedOut` when the
    /// server does not answer.
    pub fn connect(spec: &RemoteSpec, opts: &RemoteOptions) -> io::Result<NbdRemote> {
        let uri = spec.uri();
        if opts.connections == 0 || opts.max_in_flight == 0 || opts.timeout.is_zero() {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("{uri}: connections, max_in_flight and timeout must be non-zero"),
            ));
        }
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("{uri}: {e}"));
        let tls = match &spec.tls {
            Some(t) => {
                let host = match &spec.address {
                    RemoteAddress::Tcp { host, .. } => Some(host.as_str()),
                    RemoteAddress::Unix(_) => None,
                };
                Some(crate::remote_tls::connector(t, host).map_err(ctx)?)
            }
            None => None,
        };
        let open = || -> io::Result<(Stream, ExportInfo)> {
            let mut s = dial(spec, opts.timeout)?;
            s.set_timeouts(opts.timeout, opts.timeout)?;
            // One deadline for the whole handshake (and its TLS handshake).
            let deadline = Instant::now() + opts.timeout;
            let info = handshake(&mut s, &spec.export, tls.as_ref(), deadline)?;
            Ok((s, info))
        };
        let (first, info) = open().map_err(ctx)?;
        let n = if info.flags & TFLAG_CAN_MULTI_CONN != 0 {
            opts.connections
        } else {
            1
        };
        let mut streams = vec![first];
        for _ in 1..n {
            let (s, again) = open().map_err(ctx)?;
            if again != info {
                return Err(ctx(io::Error::new(
                    ErrorKind::InvalidData,
                    "the connections describe the export differently",
                )));
            }
            streams.push(s);
        }
        let tick = (opts.timeout / 8).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let mut remote = NbdRemote {
            uri: uri.clone(),
            conns: Vec::with_capacity(n),
            readers: Vec::with_capacity(n),
            next: AtomicUsize::new(0),
            info,
            read_only: opts.read_only || info.flags & TFLAG_READ_ONLY != 0,
        };
        for (i, s) in streams.into_iter().enumerate() {
            let prepared = (|| {
                s.set_timeouts(tick, opts.timeout)?;
                Ok::<_, io::Error>((s.try_clone()?, s.try_clone()?, s))
            })();
            let (writer, ctl, read_half) = prepared.map_err(ctx)?;
            let conn = Arc::new(Conn {
                name: format!("{uri} (connection {i})"),
                writer: Mutex::new(writer),
                ctl,
                shared: Mutex::new(Shared {
                    pending: HashMap::new(),
                    next_cookie: 1,
                    dead: None,
                    closing: false,
                }),
                room: Condvar::new(),
                alive: AtomicBool::new(true),
                max_in_flight: opts.max_in_flight,
                timeout: opts.timeout,
            });
            let c = conn.clone();
            let reader = std::thread::Builder::new()
                .name(format!("nbd-remote-{i}"))
                .spawn(move || c.reader(read_half))
                .map_err(ctx)?;
            remote.conns.push(conn);
            remote.readers.push(reader);
        }
        Ok(remote)
    }

    /// One line describing the remote: its URI, size, connections, block
    /// sizes and what the export offers.
    ///
    /// **Returns:** e.g. `nbd+unix:///?socket=/s: 67108864 bytes, 4
    /// connections, blocks 1/4096/33554432, flush fua trim write-zeroes
    /// multi-conn`.
    pub fn info(&self) -> String {
        let f = self.info.flags;
        let mut offers = Vec::new();
        for (bit, name) in [
            (TFLAG_READ_ONLY, "read-only"),
            (TFLAG_SEND_FLUSH, "flush"),
            (TFLAG_SEND_FUA, "fua"),
            (TFLAG_SEND_TRIM, "trim"),
            (TFLAG_SEND_WRITE_ZEROES, "write-zeroes"),
            (TFLAG_CAN_MULTI_CONN, "multi-conn"),
        ] {
            if f & bit != 0 {
                offers.push(name);
            }
        }
        if self.read_only && f & TFLAG_READ_ONLY == 0 {
            offers.push("opened read-only");
        }
        if self.is_tls() {
            offers.push("over TLS");
        }
        format!(
            "{}: {} bytes, {} connection{}, blocks {}/{}/{}, {}",
            self.uri,
            self.info.size,
            self.conns.len(),
            if self.conns.len() == 1 { "" } else { "s" },
            self.info.min_block,
            self.info.pref_block,
            self.info.max_block,
            if offers.is_empty() {
                "no optional commands".to_string()
            } else {
                offers.join(" ")
            }
        )
    }

    /// The URI of the remote export.
    ///
    /// **Returns:** what [`RemoteSpec::uri`] gave when connecting.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Whether the connections run under TLS.
    ///
    /// **Returns:** `true` for an `nbds://` or `nbds+unix://` remote
    /// (every connection did NBD_OPT_STARTTLS and its TLS handshake).
    pub fn is_tls(&self) -> bool {
        self.uri.starts_with("nbds")
    }

    /// Connections in use.
    ///
    /// **Returns:** 1 unless the export advertises NBD_FLAG_CAN_MULTI_CONN,
    /// then [`RemoteOptions::connections`].
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// The export's minimum block size: I/Os must be whole blocks.
    ///
    /// **Returns:** what the server advertised (NBD_INFO_BLOCK_SIZE), 1
    /// when it advertised none.
    pub fn min_block_bytes(&self) -> u32 {
        self.info.min_block
    }

    /// The largest READ or WRITE sent in one request.
    ///
    /// **Returns:** the server's maximum payload, at most
    /// [`MAX_PAYLOAD_BYTES`], in whole minimum blocks.
    pub fn max_payload_bytes(&self) -> u32 {
        self.info.max_block
    }

    /// Whether writes are refused.
    ///
    /// **Returns:** `true` when the export is read-only or
    /// [`RemoteOptions::read_only`] was set.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The next connection, round-robin, skipping those given up while
    /// any is alive.
    fn pick(&self) -> &Conn {
        let n = self.conns.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| &*self.conns[(first + i) % n])
            .find(|c| c.alive.load(Ordering::Acquire))
            .unwrap_or(&self.conns[first])
    }

    /// Refuse, before anything is sent, what leaves the export or is not
    /// whole minimum blocks.
    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.info.size)?;
        let min = self.info.min_block as u64;
        if !offset.is_multiple_of(min) || !len.is_multiple_of(min) {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{}: I/O of {len} bytes at offset {offset} is not whole {min}-byte blocks",
                    self.uri
                ),
            ));
        }
        Ok(())
    }

    /// Refuse writes to a read-only remote.
    fn check_writable(&self, what: &str, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{}: {what} of {len} bytes at offset {offset} refused: the remote is read-only",
                    self.uri
                ),
            ));
        }
        Ok(())
    }

    /// The error for an NBD error reply.
    fn reply_error(&self, errno: u32, command: u16, offset: u64, len: u64) -> io::Error {
        let (kind, name) = errno_kind(errno);
        io::Error::new(
            kind,
            format!(
                "{}: {} of {len} bytes at offset {offset} failed on the remote: {name} ({})",
                self.uri,
                command_name(command),
                crate::proto::error_message(errno)
            ),
        )
    }

    /// WRITE `segments` at `offset` with command `flags`, split at the
    /// maximum payload.
    fn write_flags(&self, flags: u16, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        self.check(offset, total as u64)?;
        self.check_writable("WRITE", offset, total as u64)?;
        let conn = self.pick();
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(self.info.max_block as usize);
            let at = offset + pos as u64;
            let errno = conn.call_flags(flags, CMD_WRITE, at, n as u32, segments, None, pos)?;
            if errno != 0 {
                return Err(self.reply_error(errno, CMD_WRITE, at, n as u64));
            }
            pos += n;
        }
        Ok(())
    }

    /// One command without payload (TRIM, WRITE_ZEROES) over `len` bytes
    /// at `offset`, split at 1 GiB.
    fn effect(&self, command: u16, offset: u64, len: u64) -> io::Result<()> {
        let conn = self.pick();
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(MAX_EFFECT_BYTES);
            let errno = conn.call(command, offset + pos, n as u32, &[], None, 0)?;
            if errno != 0 {
                return Err(self.reply_error(errno, command, offset + pos, n));
            }
            pos += n;
        }
        Ok(())
    }
}

impl Backend for NbdRemote {
    fn size_bytes(&self) -> u64 {
        self.info.size
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        self.write_flags(0, offset, segments)
    }

    /// NBD_CMD_WRITE with NBD_CMD_FLAG_FUA (each request of a split write)
    /// when the export offers FUA; else the write, then a flush.
    fn write_at_fua(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        if self.info.flags & TFLAG_SEND_FUA == 0 {
            self.write_at(offset, segments)?;
            return self.flush();
        }
        self.write_flags(CMD_FLAG_FUA, offset, segments)
    }

    /// `true` when the export offers FUA (NBD_FLAG_SEND_FUA).
    fn native_fua(&self) -> bool {
        self.info.flags & TFLAG_SEND_FUA != 0
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        self.check(offset, total as u64)?;
        let conn = self.pick();
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(self.info.max_block as usize);
            let at = offset + pos as u64;
            let errno = conn.call(CMD_READ, at, n as u32, &[], Some(&mut *segments), pos)?;
            if errno != 0 {
                return Err(self.reply_error(errno, CMD_READ, at, n as u64));
            }
            pos += n;
        }
        Ok(())
    }

    /// NBD_CMD_FLUSH on one connection when the export offers it (with
    /// several connections the export is multi-conn, where a flush on one
    /// covers the writes completed on all); nothing otherwise.
    fn flush(&self) -> io::Result<()> {
        if self.info.flags & TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        let errno = self.pick().call(CMD_FLUSH, 0, 0, &[], None, 0)?;
        if errno != 0 {
            return Err(self.reply_error(errno, CMD_FLUSH, 0, 0));
        }
        Ok(())
    }

    /// NBD_CMD_WRITE_ZEROES without NO_HOLE (the remote may deallocate).
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        self.check_writable("WRITE_ZEROES", offset, len)?;
        if self.info.flags & TFLAG_SEND_WRITE_ZEROES == 0 {
            return Err(io::Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: the remote export does not offer WRITE_ZEROES ({len} bytes at offset {offset})",
                    self.uri
                ),
            ));
        }
        self.effect(CMD_WRITE_ZEROES, offset, len)
    }

    fn can_punch(&self) -> bool {
        !self.read_only && self.info.flags & TFLAG_SEND_WRITE_ZEROES != 0
    }

    /// NBD_CMD_TRIM where the export offers it, else a punch.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.info.flags & TFLAG_SEND_TRIM == 0 {
            return self.punch(offset, len);
        }
        self.check(offset, len)?;
        self.check_writable("TRIM", offset, len)?;
        self.effect(CMD_TRIM, offset, len)
    }
}

impl Drop for NbdRemote {
    /// NBD_CMD_DISC on each live connection, then the reader threads are
    /// joined (they stop at the server's EOF, or at their next tick).
    fn drop(&mut self) {
        for c in &self.conns {
            c.shared.lock().closing = true;
            if c.alive.load(Ordering::Acquire) {
                let header = Request {
                    flags: 0,
                    command: CMD_DISC,
                    cookie: 0,
                    offset: 0,
                    length: 0,
                }
                .encode();
                // No caller is left; a writer stuck past its deadline gave
                // the connection up, so this waits for nothing long.
                let deadline = Instant::now() + c.timeout;
                if let Some(w) = c.writer.try_lock_until(deadline) {
                    let _ = write_all_by(&w, &mut [IoSlice::new(&header)], deadline);
                }
                c.ctl.shutdown_how(Shutdown::Write);
            }
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        for c in &self.conns {
            c.ctl.shutdown();
        }
    }
}
