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

/// Where a remote export is: a TCP host and port, or a Unix socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteAddress {
    /// `nbd://host[:port]`: a host name or address, and a port.
    Tcp {
        /// Host name, IPv4 or IPv6 address (without brackets).
        host: String,
        /// TCP port.
        port: u16,
    },
    /// `nbd+unix://…?socket=PATH`: a Unix socket.
    Unix(PathBuf),
}

/// A remote export, as an NBD URI names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteSpec {
    /// Where the server listens.
    pub address: RemoteAddress,
    /// The export's name ("" : the server's default export).
    pub export: String,
    /// `nbds://`, `nbds+unix://`: TLS is required, with these settings.
    pub tls: Option<RemoteTls>,
}

/// An `InvalidInput` error about the URI `uri`.
fn bad_uri(uri: &str, msg: &str) -> io::Error {
    io::Error::new(
        ErrorKind::InvalidInput,
        format!(
            "remote {uri:?}: {msg} (expected nbd[s]://host[:port][/export] or \
             nbd[s]+unix:///export?socket=PATH)"
        ),
    )
}

/// Decode `%XX` escapes; the result must be UTF-8.
fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(v) => out.push(v),
                None => return Err(format!("a bad %-escape in {s:?}")),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once %-decoded"))
}

/// `%XX`-escape everything but unreserved characters and `/`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~/".contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

impl RemoteSpec {
    /// Parse an NBD URI: `nbd://host[:port][/export]` (port 10809 by
    /// default, IPv6 addresses in brackets, the export `%`-escaped, "" when
    /// absent) or `nbd+unix:///export?socket=PATH`; `nbds://` and
    /// `nbds+unix://` require TLS, set with the query parameters
    /// `tls-certificates=DIR`, `tls-psk-file=FILE`, `tls-username=NAME`
    /// (or `nbds://NAME@host`), `tls-hostname=NAME`,
    /// `tls-verify-peer=true|false` (also `1|0`) and `tls-type=x509|psk`.
    ///
    /// **Context:** pure. **Returns:** `InvalidInput` naming what is wrong
    /// for anything else: other schemes, user info without TLS, fragments,
    /// a missing host or socket, a bad port, unknown or repeated query
    /// keys, `tls-*` keys without TLS, an export name over 4096 bytes.
    pub fn parse(uri: &str) -> io::Result<RemoteSpec> {
        let bad = |m: &str| bad_uri(uri, m);
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| bad("not an NBD URI"))?;
        let scheme = scheme.to_ascii_lowercase();
        let (unix, tls) = match scheme.as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            _ => return Err(bad(&format!("scheme {scheme:?} is not supported"))),
        };
        if rest.contains('#') {
            return Err(bad("a fragment (#...) is not allowed"));
        }
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path).map_err(|m| bad(&m))?;
        if export.len() > 4096 {
            return Err(bad("the export name is longer than 4096 bytes"));
        }
        let mut socket = None;
        let mut settings = RemoteTls::new();
        let mut seen: Vec<&str> = Vec::new();
        let mut tls_type = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&key) {
                return Err(bad(&format!("{key}= is given twice")));
            }
            seen.push(key);
            let value = percent_decode(value).map_err(|m| bad(&m))?;
            if key.starts_with("tls-") && !tls {
                return Err(bad(&format!(
                    "{key}= needs TLS: use nbds:// or nbds+unix://"
                )));
            }
            let path = |v: String| {
                if v.is_empty() {
                    Err(bad(&format!("{key}= is empty")))
                } else {
                    Ok(Some(PathBuf::from(v)))
                }
            };
            match key {
                "socket" if unix => socket = Some(value),
                "tls-certificates" => settings.certificates = path(value)?,
                "tls-psk-file" => settings.psk_file = path(value)?,
                "tls-username" if !value.is_empty() => settings.username = Some(value),
                "tls-hostname" if !value.is_empty() => settings.hostname = Some(value),
                "tls-verify-peer" => {
                    settings.verify_peer = match value.to_ascii_lowercase().as_str() {
                        "1" | "true" | "yes" | "on" => true,
                        "0" | "false" | "no" | "off" => false,
                        _ => {
                            return Err(bad(&format!(
                                "tls-verify-peer={value:?} is not a boolean (true or false)"
                            )))
                        }
                    }
                }
                "tls-type" => tls_type = Some(value.to_ascii_lowercase()),
                "tls-username" | "tls-hostname" => return Err(bad(&format!("{key}= is empty"))),
                _ => return Err(bad(&format!("unknown query parameter {key:?}"))),
            }
        }
        match tls_type.as_deref() {
            None => {}
            Some("x509") if settings.psk_file.is_none() => {}
            Some("psk") if settings.psk_file.is_some() => {}
            Some("psk") => return Err(bad("tls-type=psk needs tls-psk-file=FILE")),
            Some("x509") => return Err(bad("tls-type=x509 with tls-psk-file= given")),
            Some(t) => {
                return Err(bad(&format!(
                    "tls-type={t:?} is not supported (x509 or psk)"
                )))
            }
        }
        if settings.psk_file.is_some() && settings.certificates.is_some() {
            return Err(bad("give tls-certificates= or tls-psk-file=, not both"));
        }
        let authority = match authority.rsplit_once('@') {
            Some((user, host)) if tls => {
                let user = percent_decode(user).map_err(|m| bad(&m))?;
                if user.is_empty() || user.contains(':') {
                    return Err(bad("user info must be a user name alone (user@host)"));
                }
                if settings.username.is_some() {
                    return Err(bad("a user name both as user@ and tls-username="));
                }
                settings.username = Some(user);
                host
            }
            _ => authority,
        };
        if authority.contains('@') {
            return Err(bad("user info (user@) is only for TLS (nbds://user@host)"));
        }
        let address = if unix {
            if !authority.is_empty() {
                return Err(bad(&format!(
                    "{scheme}:// takes no host ({scheme}:///export?socket=PATH)"
                )));
            }
            match socket {
                Some(s) if !s.is_empty() => RemoteAddress::Unix(PathBuf::from(s)),
                _ => return Err(bad(&format!("{scheme}:// needs ?socket=PATH"))),
            }
        } else {
            if authority.matches(':').count() > 1 && !authority.starts_with('[') {
                return Err(bad("an IPv6 address must be in brackets ([::1]:10809)"));
            }
            let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
                let (host, after) = v6
                    .split_once(']')
                    .ok_or_else(|| bad("an IPv6 address without its closing ]"))?;
                match after {
                    "" => (host, None),
                    p => match p.strip_prefix(':') {
                        Some(p) => (host, Some(p)),
                        None => return Err(bad("junk after the IPv6 address")),
                    },
                }
            } else {
                match authority.split_once(':') {
                    Some((h, p)) => (h, Some(p)),
                    None => (authority, None),
                }
            };
            if host.is_empty() {
                return Err(bad("no host"));
            }
            let port = match port {
                None | Some("") => DEFAULT_PORT,
                Some(p) => match p.parse::<u16>() {
                    Ok(n) if n > 0 && p.bytes().all(|c| c.is_ascii_digit()) => n,
                    _ => return Err(bad(&format!("bad port {p:?}"))),
                },
            };
            RemoteAddress::Tcp {
                host: host.to_string(),
                port,
            }
        };
        Ok(RemoteSpec {
            address,
            export,
            tls: tls.then_some(settings),
        })
    }

    /// The URI naming this export (what [`RemoteSpec::parse`] reads back).
    ///
    /// **Returns:** `nbd[s]://…` or `nbd[s]+unix://…`, names `%`-escaped,
    /// the TLS settings as query parameters.
    pub fn uri(&self) -> String {
        let export = percent_encode(&self.export);
        let s = if self.tls.is_some() { "s" } else { "" };
        let mut query = Vec::new();
        let base = match &self.address {
            RemoteAddress::Tcp { host, port } if host.contains(':') => {
                format!("nbd{s}://[{host}]:{port}/{export}")
            }
            RemoteAddress::Tcp { host, port } => format!("nbd{s}://{host}:{port}/{export}"),
            RemoteAddress::Unix(p) => {
                query.push(format!("socket={}", percent_encode(&p.to_string_lossy())));
                format!("nbd{s}+unix:///{export}")
            }
        };
        if let Some(t) = &self.tls {
            let mut add = |k: &str, v: &str| query.push(format!("{k}={}", percent_encode(v)));
            if let Some(d) = &t.certificates {
                add("tls-certificates", &d.to_string_lossy());
            }
            if let Some(f) = &t.psk_file {
                add("tls-psk-file", &f.to_string_lossy());
            }
            if let Some(u) = &t.username {
                add("tls-username", u);
            }
            if let Some(h) = &t.hostname {
                add("tls-hostname", h);
            }
            if !t.verify_peer {
                add("tls-verify-peer", "false");
            }
        }
        if query.is_empty() {
            base
        } else {
            format!("{base}?{}", query.join("&"))
        }
    }
}

impl std::fmt::Display for RemoteSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

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

/// Whether `e` is a socket timeout (SO_RCVTIMEO / SO_SNDTIMEO expired).
fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// The most buffers one `sendmsg` takes (Linux's UIO_MAXIOV).
const MAX_IOV: usize = 1024;

/// One `sendmsg` of a prefix of `bufs` that does not wait
/// (`MSG_DONTWAIT` for this call alone: the socket stays blocking for
/// the reader; `MSG_NOSIGNAL`: a closed peer is `EPIPE`, not a signal).
fn send_nowait(fd: std::os::fd::RawFd, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix; sendmsg only reads
    // the buffers.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len().min(MAX_IOV) as _;
    // SAFETY: `msg` points at `bufs`, live for the call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Write all of `bufs` to `s` by `deadline`, however the remote reads:
/// each attempt waits at most what is left (a socket's send timeout
/// would start again with every byte the remote takes, so a remote that
/// trickles could stretch a request for ever).
///
/// **Returns:** `TimedOut` naming how far it got when the deadline
/// passes first; the socket's error.
fn write_all_by(s: &Stream, bufs: &mut [IoSlice<'_>], deadline: Instant) -> io::Result<()> {
    let mut bufs = bufs;
    let mut sent = 0usize;
    while !bufs.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = match s {
            _ if left.is_zero() => Err(ErrorKind::WouldBlock.into()),
            Stream::Tls(t) => {
                t.set_write_timeout(left);
                t.write_vectored(bufs)
            }
            _ => send_nowait(s.as_raw_fd(), bufs),
        };
        match got {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                sent += n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                if !crate::remote_tls::poll_until(s.as_raw_fd(), libc::POLLOUT, deadline)? {
                    let why = match sent {
                        0 => "the store stopped reading".to_string(),
                        n => format!(
                            "only {n} bytes left: the store stopped reading or reads too slowly"
                        ),
                    };
                    return Err(io::Error::new(ErrorKind::TimedOut, why));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Of segments of lengths `lens` (back to back), the pieces covering
/// `len` bytes from `start`: (segment, offset in it, bytes).
fn segment_ranges(
    lens: impl Iterator<Item = usize>,
    start: usize,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let (mut skip, mut left) = (start, len);
    lens.enumerate()
        .map_while(move |(i, seg)| {
            if left == 0 {
                return None;
            }
            if skip >= seg {
                skip -= seg;
                return Some(None);
            }
            let n = (seg - skip).min(left);
            let piece = (i, skip, n);
            skip = 0;
            left -= n;
            Some(Some(piece))
        })
        .flatten()
}

/// The parts of `segs` (back to back) covering `len` bytes from `start`.
fn sub_slices<'a>(segs: &[&'a [u8]], start: usize, len: usize) -> Vec<&'a [u8]> {
    segment_ranges(segs.iter().map(|s| s.len()), start, len)
        .map(|(i, from, n)| &segs[i][from..from + n])
        .collect()
}

/// The reader thread's side of the socket: what was read and not yet
/// used stays in `buf[pos..end]`.
struct Recv {
    stream: Stream,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl Recv {
    fn new(stream: Stream, bytes: usize) -> Recv {
        Recv {
            stream,
            buf: vec![0; bytes].into_boxed_slice(),
            pos: 0,
            end: 0,
        }
    }

    /// Fill `out`, first from the buffer, then from the socket: into the
    /// buffer while what is missing is smaller than it (one `read` may
    /// bring the next replies too), else straight into `out`. On each
    /// socket timeout `tick` is asked what to do (it is told the bytes of
    /// `out` filled so far): `Err` gives up, `Ok(true)` means "idle, keep
    /// waiting", `Ok(false)` lets the stall rule decide: no byte for
    /// `stall` gives up with `TimedOut`.
    fn fill(
        &mut self,
        out: &mut [u8],
        stall: Duration,
        tick: &mut dyn FnMut(usize) -> io::Result<bool>,
    ) -> io::Result<()> {
        let mut done = 0;
        let mut last = Instant::now();
        while done < out.len() {
            if self.pos < self.end {
                let n = (self.end - self.pos).min(out.len() - done);
                out[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
                self.pos += n;
                done += n;
                continue;
            }
            let direct = out.len() - done >= self.buf.len();
            let got = if direct {
                self.stream.read(&mut out[done..])
            } else {
                self.pos = 0;
                self.end = 0;
                self.stream.read(&mut self.buf)
            };
            match got {
                Ok(0) => {
                    return Err(io::Error::new(
                        ErrorKind::ConnectionAborted,
                        "the remote closed the connection",
                    ))
                }
                Ok(n) if direct => {
                    done += n;
                    last = Instant::now();
                }
                Ok(n) => {
                    self.end = n;
                    last = Instant::now();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => {
                    if tick(done)? {
                        last = Instant::now();
                    } else if last.elapsed() >= stall {
                        return Err(io::Error::new(
                            ErrorKind::TimedOut,
                            format!("the remote sent nothing for {stall:?}"),
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fill the parts of `dest`, one after the other; a stall of `stall`
    /// gives up.
    fn fill_dest(&mut self, dest: &Dest, stall: Duration) -> io::Result<()> {
        for &(ptr, len) in &dest.parts {
            // SAFETY: `dest` was made by `Dest::new` from buffers of the
            // caller of `Conn::call`, which does not return (nor touch
            // them) while its request is `Slot::Filling`, the only time
            // the reader holds a `Dest`; the parts do not overlap.
            let part = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            self.fill(part, stall, &mut |_| Ok(false))?;
        }
        Ok(())
    }
}

/// Where a read's data goes: the bytes `start..start + len` of the
/// caller's buffers (back to back), as raw parts the reader thread fills
/// while the caller waits.
struct Dest {
    parts: Vec<(*mut u8, usize)>,
}

// SAFETY: the parts are plain bytes of buffers the caller lends for the
// duration of its call; only one thread (the reader, while the request is
// `Slot::Filling`) ever writes through them.
unsafe impl Send for Dest {}

impl Dest {
    fn new(segs: &mut [&mut [u8]], start: usize, len: usize) -> Dest {
        let ranges: Vec<_> = segment_ranges(segs.iter().map(|s| s.len()), start, len).collect();
        let parts = ranges
            .into_iter()
            .map(|(i, from, n)| (segs[i][from..from + n].as_mut_ptr(), n))
            .collect();
        Dest { parts }
    }
}

/// A command's name, for messages.
fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        _ => "command",
    }
}

/// The I/O error kind and name of an NBD error code.
fn errno_kind(errno: u32) -> (ErrorKind, &'static str) {
    match errno {
        EPERM => (ErrorKind::PermissionDenied, "EPERM"),
        EIO => (ErrorKind::Other, "EIO"),
        ENOMEM => (ErrorKind::OutOfMemory, "ENOMEM"),
        EINVAL => (ErrorKind::InvalidInput, "EINVAL"),
        ENOSPC => (ErrorKind::StorageFull, "ENOSPC"),
        EOVERFLOW => (ErrorKind::InvalidInput, "EOVERFLOW"),
        ENOTSUP => (ErrorKind::Unsupported, "ENOTSUP"),
        ESHUTDOWN => (ErrorKind::ConnectionAborted, "ESHUTDOWN"),
        _ => (ErrorKind::Other, "an unknown error"),
    }
}

/// Where a request stands.
enum Slot {
    /// Sent (or being sent), no reply yet.
    Waiting,
    /// A successful read's reply arrived: the reader is putting its data
    /// into the caller's buffers (the caller must not return meanwhile).
    Filling,
    /// The reply arrived (and a read's data is in the caller's buffers):
    /// its error code (0: success).
    Replied(u32),
    /// The connection was given up.
    Failed(ErrorKind, String),
}

/// A request in flight.
struct Pending {
    /// Its submission plus the timeout: every step (slot, writer, send,
    /// reply) ends by it.
    deadline: Instant,
    /// Sent whole: from now on only its reply is awaited (the reader's
    /// `overdue` check looks at these).
    sent: bool,
    /// A READ's destination: a successful reply carries data, which the
    /// reader puts there (taken when it starts).
    dest: Option<Dest>,
    /// What the caller waits on.
    cv: Arc<Condvar>,
    state: Slot,
}

/// What a request is, for its messages, and its deadline.
struct Call {
    command: u16,
    offset: u64,
    length: u32,
    /// Submission plus the timeout: every step ends by it.
    deadline: Instant,
}

impl Call {
    /// E.g. "WRITE of 4194304 bytes at offset 0", "FLUSH".
    fn what(&self) -> String {
        match self.command {
            CMD_FLUSH | CMD_DISC => command_name(self.command).to_string(),
            c => format!(
                "{} of {} bytes at offset {}",
                command_name(c),
                self.length,
                self.offset
            ),
        }
    }
}

/// A connection's state, under its mutex.
struct Shared {
    pending: HashMap<u64, Pending>,
    next_cookie: u64,
    /// Why the connection was given up.
    dead: Option<(ErrorKind, String)>,
    /// The remote is being dropped: EOF is expected.
    closing: bool,
}

/// One connection to the remote.
struct Conn {
    /// "URI (connection N)", for messages.
    name: String,
    /// The write half: requests are written whole under it.
    writer: Mutex<Stream>,
    /// A handle to shut the socket down with.
    ctl: Stream,
    shared: Mutex<Shared>,
    /// Callers wait here for an in-flight slot.
    room: Condvar,
    alive: AtomicBool,
    max_in_flight: usize,
    timeout: Duration,
}

impl Conn {
    /// Give the connection up: fail every request still waiting, refuse
    /// later ones, and shut the socket down (waking the reader and any
    /// blocked send; a read being filled fails when the reader's next
    /// `read` does).
    fn kill(&self, s: &mut Shared, kind: ErrorKind, msg: String) {
        if s.dead.is_none() {
            s.dead = Some((kind, msg));
        }
        self.alive.store(false, Ordering::Release);
        let (kind, msg) = s.dead.clone().expect("set above");
        for p in s.pending.values_mut() {
            if matches!(p.state, Slot::Waiting) {
                p.state = Slot::Failed(kind, msg.clone());
                p.cv.notify_one();
            }
        }
        self.room.notify_all();
        self.ctl.shutdown();
    }

    /// The error for a request on a connection given up.
    fn dead_error(&self, s: &Shared) -> io::Error {
        let (kind, msg) = s.dead.clone().expect("a dead connection");
        io::Error::new(kind, msg)
    }

    /// Send one request (with `payload`'s bytes `start..start + length` for
    /// a write) and wait for its reply; a read's data goes into `read`'s
    /// bytes `start..start + length`.
    ///
    /// **Returns:** the reply's error code, or an I/O error when the
    /// connection failed (it is then given up).
    fn call(
        &self,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[&[u8]],
        read: Option<&mut [&mut [u8]]>,
        start: usize,
    ) -> io::Result<u32> {
        self.call_flags(0, command, offset, length, payload, read, start)
    }

    /// [`Conn::call`] with command flags (NBD_CMD_FLAG_FUA): one deadline,
    /// its submission plus the timeout, for the slot, the writer, every
    /// write and the reply.
    ///
    /// **Returns:** as [`Conn::call`]; `TimedOut` naming the request and
    /// what it waited for once its deadline passed.
    #[allow(clippy::too_many_arguments)]
    fn call_flags(
        &self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[&[u8]],
        read: Option<&mut [&mut [u8]]>,
        start: usize,
    ) -> io::Result<u32> {
        let call = Call {
            command,
            offset,
            length,
            deadline: Instant::now() + self.timeout,
        };
        let cv = Arc::new(Condvar::new());
        let dest = match read {
            Some(segs) if command == CMD_READ => Some(Dest::new(segs, start, length as usize)),
            _ => None,
        };
        let cookie = self.take_slot(&call, dest, &cv)?;
        let header = Request {
            flags,
            command,
            cookie,
            offset,
            length,
        }
        .encode();
        let parts = if command == CMD_WRITE {
            sub_slices(payload, start, length as usize)
        } else {
            Vec::new()
        };
        self.send(&call, cookie, &cv, &header, &parts)?;
        self.wait_reply(&call, cookie, &cv)
    }

    /// Wait (by the request's deadline) for an in-flight slot and register
    /// the request in it.
    ///
    /// **Returns:** its cookie; the connection's error when it was given
    /// up; `TimedOut` when no slot came free in time (the connection is
    /// kept: the requests holding the slots end by their own deadlines).
    fn take_slot(&self, call: &Call, dest: Option<Dest>, cv: &Arc<Condvar>) -> io::Result<u64> {
        let mut s = self.shared.lock();
        loop {
            if s.dead.is_some() {
                return Err(self.dead_error(&s));
            }
            if s.pending.len() < self.max_in_flight {
                break;
            }
            if self.room.wait_until(&mut s, call.deadline).timed_out()
                && s.dead.is_none()
                && s.pending.len() >= self.max_in_flight
            {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "{}: {} not sent within {:?} (no request slot came free: {} in flight)",
                        self.name,
                        call.what(),
                        self.timeout,
                        self.max_in_flight
                    ),
                ));
            }
        }
        let cookie = s.next_cookie;
        s.next_cookie += 1;
        let pending = Pending {
            deadline: call.deadline,
            sent: false,
            dest,
            cv: cv.clone(),
            state: Slot::Waiting,
        };
        s.pending.insert(cookie, pending);
        Ok(cookie)
    }

    /// Write the request (`header`, then `parts`) whole under the writer
    /// lock, both by its deadline. A request that could not take the lock
    /// in time fails alone (nothing of it was sent); one whose writing
    /// fails or stalls past the deadline gives the connection up (the
    /// stream is left mid-request).
    ///
    /// **Returns:** the error the request fails with; it is then out of
    /// the map (its buffers the caller's again).
    fn send(
        &self,
        call: &Call,
        cookie: u64,
        cv: &Condvar,
        header: &[u8],
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let mut bufs: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(header))
            .chain(parts.iter().map(|p| IoSlice::new(p)))
            .collect();
        let sent = match self.writer.try_lock_until(call.deadline) {
            None => Err(None),
            // Given up while this one waited: `kill` failed it already.
            Some(_) if !self.alive.load(Ordering::Acquire) => {
                Err(Some(io::Error::from(ErrorKind::NotConnected)))
            }
            Some(w) => write_all_by(&w, &mut bufs, call.deadline).map_err(Some),
        };
        let mut s = self.shared.lock();
        let e = match sent {
            Ok(()) => {
                if let Some(p) = s.pending.get_mut(&cookie) {
                    p.sent = true;
                }
                return Ok(());
            }
            Err(None) => io::Error::new(
                ErrorKind::TimedOut,
                format!(
                    "{}: {} not sent within {:?} (another request being sent held the \
                     connection: the store reads too slowly)",
                    self.name,
                    call.what(),
                    self.timeout
                ),
            ),
            Err(Some(e)) => {
                let msg = match e.kind() {
                    ErrorKind::TimedOut => format!(
                        "{}: {} not sent within {:?} ({e}); connection given up",
                        self.name,
                        call.what(),
                        self.timeout
                    ),
                    _ => format!("{}: sending {} failed: {e}", self.name, call.what()),
                };
                self.kill(&mut s, e.kind(), msg);
                self.dead_error(&s)
            }
        };
        self.release(&mut s, cookie, cv);
        Err(e)
    }

    /// Take a request that will not be answered out of the map: first
    /// wait while the reader fills its buffers (a reply may come before
    /// its request is all sent, the remote answering a header it has
    /// read; a shut socket ends that `read` at once), then free its slot.
    fn release(&self, s: &mut parking_lot::MutexGuard<'_, Shared>, cookie: u64, cv: &Condvar) {
        while s
            .pending
            .get(&cookie)
            .is_some_and(|p| matches!(p.state, Slot::Filling))
        {
            cv.wait(s);
        }
        s.pending.remove(&cookie);
        self.room.notify_one();
    }

    /// Wait, by the request's deadline, for the reply to the request sent
    /// as `cookie`. Past the deadline the connection is given up; a read
    /// being filled then is waited for until the reader lets go of its
    /// buffers (the shut socket fails its `read` at once).
    ///
    /// **Returns:** the reply's error code; the connection's error.
    fn wait_reply(&self, call: &Call, cookie: u64, cv: &Condvar) -> io::Result<u32> {
        let mut s = self.shared.lock();
        loop {
            let p = s.pending.get(&cookie).expect("only its caller removes it");
            match &p.state {
                Slot::Waiting | Slot::Filling => {}
                Slot::Replied(errno) => {
                    let errno = *errno;
                    self.release(&mut s, cookie, cv);
                    return Ok(errno);
                }
                Slot::Failed(kind, msg) => {
                    let e = io::Error::new(*kind, msg.clone());
                    self.release(&mut s, cookie, cv);
                    return Err(e);
                }
            }
            if s.dead.is_some() && matches!(p.state, Slot::Filling) {
                cv.wait(&mut s);
                continue;
            }
            if cv.wait_until(&mut s, call.deadline).timed_out() {
                let p = s.pending.get(&cookie).expect("only its caller removes it");
                if matches!(p.state, Slot::Waiting | Slot::Filling) {
                    let msg = format!(
                        "{}: the remote did not answer {} within {:?} of its submission; \
                         connection given up",
                        self.name,
                        call.what(),
                        self.timeout
                    );
                    // A waiting request is failed by `kill`; a read being
                    // filled waits above for the reader to let go.
                    self.kill(&mut s, ErrorKind::TimedOut, msg);
                }
            }
        }
    }

    /// Whether a request sent whole is past its deadline (checked on each
    /// idle tick of the reader).
    fn overdue(&self, s: &Shared) -> Option<String> {
        let now = Instant::now();
        s.pending
            .values()
            .filter(|p| p.sent && matches!(p.state, Slot::Waiting))
            .any(|p| p.deadline <= now)
            .then(|| {
                format!(
                    "{}: the remote did not answer a request within {:?}; connection given up",
                    self.name, self.timeout
                )
            })
    }

    /// The read `cookie` could not be filled (`e`): fail it and give the
    /// connection up, with the reason it was given up for already if it
    /// was (its caller's deadline passed, which shut the socket).
    fn fill_failed(&self, s: &mut Shared, cookie: u64, e: io::Error) {
        let (kind, msg) = s.dead.clone().unwrap_or_else(|| {
            let msg = format!("{}: receiving READ data failed: {e}", self.name);
            (e.kind(), msg)
        });
        if let Some(p) = s.pending.get_mut(&cookie) {
            p.state = Slot::Failed(kind, msg.clone());
            p.cv.notify_one();
        }
        self.kill(s, kind, msg);
    }

    /// The reader thread: reply headers in, callers completed by cookie.
    fn reader(self: Arc<Conn>, stream: Stream) {
        let mut rx = Recv::new(stream, RECV_BUFFER_BYTES);
        loop {
            let mut h = [0u8; SIMPLE_REPLY_BYTES];
            let got = rx.fill(&mut h, self.timeout, &mut |done| {
                let s = self.shared.lock();
                if s.dead.is_some() || (s.closing && s.pending.is_empty()) {
                    return Err(io::Error::new(ErrorKind::ConnectionAborted, "closed"));
                }
                if done > 0 {
                    return Ok(false);
                }
                match self.overdue(&s) {
                    Some(msg) => Err(io::Error::new(ErrorKind::TimedOut, msg)),
                    None => Ok(true),
                }
            });
            let mut s = self.shared.lock();
            if let Err(e) = got {
                let msg = if e.kind() == ErrorKind::TimedOut && e.to_string().contains(&self.name) {
                    e.to_string()
                } else {
                    format!("{}: the connection failed: {e}", self.name)
                };
                if s.closing && s.pending.is_empty() {
                    self.kill(
                        &mut s,
                        ErrorKind::ConnectionAborted,
                        format!("{}: closed", self.name),
                    );
                } else {
                    self.kill(&mut s, e.kind(), msg);
                }
                return;
            }
            let magic = u32::from_be_bytes(h[0..4].try_into().expect("4 bytes"));
            let errno = u32::from_be_bytes(h[4..8].try_into().expect("4 bytes"));
            let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
            if magic != SIMPLE_REPLY_MAGIC {
                let what = if magic == STRUCTURED_REPLY_MAGIC {
                    "a structured reply, which was not negotiated".to_string()
                } else {
                    format!("a reply with the bad magic {magic:#010x}")
                };
                let msg = format!("{}: the remote sent {what}", self.name);
                self.kill(&mut s, ErrorKind::InvalidData, msg);
                return;
            }
            let Some(p) = s
                .pending
                .get_mut(&cookie)
                .filter(|p| matches!(p.state, Slot::Waiting))
            else {
                let msg = format!(
                    "{}: the remote answered cookie {cookie}, which is not in flight",
                    self.name
                );
                self.kill(&mut s, ErrorKind::InvalidData, msg);
                return;
            };
            let dest = if errno == 0 { p.dest.take() } else { None };
            let Some(dest) = dest else {
                p.state = Slot::Replied(errno);
                p.cv.notify_one();
                continue;
            };
            p.state = Slot::Filling;
            drop(s);
            let filled = rx.fill_dest(&dest, self.timeout);
            drop(dest);
            let mut s = self.shared.lock();
            let p = s
                .pending
                .get_mut(&cookie)
                .expect("its caller waits while it is filled");
            match filled {
                Ok(()) => {
                    p.state = Slot::Replied(0);
                    p.cv.notify_one();
                }
                Err(e) => {
                    self.fill_failed(&mut s, cookie, e);
                    return;
                }
            }
        }
    }
}

/// What the handshake learnt about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ExportInfo {
    size: u64,
    flags: u16,
    min_block: u32,
    pref_block: u32,
    max_block: u32,
}

/// Handshake reads, all of them before `deadline`: each read waits at most
/// what is left, so a remote that trickles bytes cannot stretch the
/// handshake past its one timeout.
fn hs_read(s: &mut Stream, buf: &mut [u8], what: &str, deadline: Instant) -> io::Result<()> {
    let timed_out = || {
        io::Error::new(
            ErrorKind::TimedOut,
            format!("handshake: timed out waiting for {what}"),
        )
    };
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        s.set_timeouts(left, left)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    ErrorKind::ConnectionAborted,
                    format!("handshake: the remote closed the connection before sending {what}"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(timed_out()),
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("handshake: reading {what}: {e}"),
                ))
            }
        }
    }
    Ok(())
}

/// One option reply to `option` (`name` in messages): its reply type and
/// data, the header checked and the data bounded by
/// [`MAX_OPTION_REPLY_BYTES`].
fn option_reply(
    s: &mut Stream,
    option: u32,
    name: &str,
    deadline: Instant,
) -> io::Result<(u32, Vec<u8>)> {
    let invalid = |m: String| io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"));
    let mut h = [0u8; 20];
    hs_read(s, &mut h, &format!("the reply to {name}"), deadline)?;
    let magic = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
    let got = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let reply = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
    if magic != OPT_REPLY_MAGIC || got != option {
        return Err(invalid(format!(
            "a bad option reply to {name} (magic {magic:#x}, option {got})"
        )));
    }
    if len > MAX_OPTION_REPLY_BYTES {
        return Err(invalid(format!("an option reply of {len} bytes")));
    }
    let mut d = vec![0u8; len];
    hs_read(
        s,
        &mut d,
        &format!("the data of the reply to {name}"),
        deadline,
    )?;
    Ok((reply, d))
}

/// Send one option.
fn send_option(s: &mut Stream, option: u32, data: &[u8]) -> io::Result<()> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    s.write_all(&v)
}

/// NBD_OPT_GO for `export`, asking for the block sizes.
///
/// **Returns:** `None` when the server does not know NBD_OPT_GO.
fn opt_go(s: &mut Stream, export: &str, deadline: Instant) -> io::Result<Option<ExportInfo>> {
    let mut data = (export.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, OPT_GO, &data)?;
    let invalid = |m: String| io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"));
    let mut export_info = None;
    let mut sizes = (1u32, 4096u32, MAX_PAYLOAD_BYTES);
    for _ in 0..MAX_GO_REPLIES {
        let (reply, d) = option_reply(s, OPT_GO, "NBD_OPT_GO", deadline)?;
        let text = String::from_utf8_lossy(&d).into_owned();
        match reply {
            REP_ACK => {
                let (size, flags) = export_info
                    .ok_or_else(|| invalid("NBD_OPT_GO ended without the export's size".into()))?;
                let (min_block, pref_block, max_block) = sizes;
                return Ok(Some(ExportInfo {
                    size,
                    flags,
                    min_block,
                    pref_block,
                    max_block,
                }));
            }
            REP_INFO if d.len() >= 2 => match u16::from_be_bytes([d[0], d[1]]) {
                INFO_EXPORT if d.len() == 12 => {
                    export_info = Some((
                        u64::from_be_bytes(d[2..10].try_into().expect("8 bytes")),
                        u16::from_be_bytes([d[10], d[11]]),
                    ))
                }
                INFO_BLOCK_SIZE if d.len() == 14 => {
                    let n = |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().expect("4"));
                    sizes = (n(2), n(6), n(10));
                }
                INFO_EXPORT | INFO_BLOCK_SIZE => {
                    return Err(invalid(format!(
                        "an information reply of {} bytes",
                        d.len()
                    )))
                }
                _ => {} // other information is not needed
            },
            REP_INFO => return Err(invalid("an empty information reply".into())),
            REP_ERR_UNSUP => return Ok(None),
            REP_ERR_UNKNOWN => {
                return Err(io::Error::new(
                    ErrorKind::NotFound,
                    format!("the remote has no export named {export:?} ({text})"),
                ))
            }
            REP_ERR_TLS_REQD => {
                return Err(io::Error::new(
                    ErrorKind::PermissionDenied,
                    "the remote requires TLS: use nbds:// (or nbds+unix://) with \
                     tls-certificates=DIR or tls-psk-file=FILE",
                ))
            }
            REP_ERR_POLICY => {
                return Err(io::Error::new(
                    ErrorKind::PermissionDenied,
                    format!("the remote refused export {export:?} by policy ({text})"),
                ))
            }
            REP_ERR_BLOCK_SIZE_REQD => {
                return Err(invalid("block sizes required although asked for".into()))
            }
            r if r & REP_FLAG_ERROR != 0 => {
                return Err(io::Error::other(format!(
                    "the remote refused export {export:?}: error {:#x} ({text})",
                    r & !REP_FLAG_ERROR
                )))
            }
            _ => {} // unknown replies are skipped
        }
    }
    Err(invalid(format!(
        "more than {MAX_GO_REPLIES} replies to NBD_OPT_GO without a final one"
    )))
}

/// NBD_OPT_EXPORT_NAME for `export` (servers without NBD_OPT_GO).
fn opt_export_name(
    s: &mut Stream,
    export: &str,
    no_zeroes: bool,
    deadline: Instant,
) -> io::Result<ExportInfo> {
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
    let mut d = [0u8; 10];
    hs_read(s, &mut d, "the export's size (no such export?)", deadline).map_err(|e| {
        if e.kind() == ErrorKind::ConnectionAborted {
            io::Error::new(
                ErrorKind::NotFound,
                format!("the remote refused export {export:?} (NBD_OPT_EXPORT_NAME)"),
            )
        } else {
            e
        }
    })?;
    if !no_zeroes {
        let mut z = [0u8; 124];
        hs_read(s, &mut z, "the handshake's padding", deadline)?;
    }
    Ok(ExportInfo {
        size: u64::from_be_bytes(d[0..8].try_into().expect("8 bytes")),
        flags: u16::from_be_bytes([d[8], d[9]]),
        min_block: 1,
        pref_block: 4096,
        max_block: MAX_PAYLOAD_BYTES,
    })
}

/// NBD_OPT_STARTTLS, then the TLS handshake: `s` becomes the session.
///
/// **Returns:** `PermissionDenied` when the remote does not offer TLS
/// (NBD_OPT_ABORT is sent; nothing continues in plaintext) or the TLS
/// handshake fails; `InvalidData` for a reply breaking the protocol.
fn starttls(s: &mut Stream, tls: &Connector, deadline: Instant) -> io::Result<()> {
    send_option(s, OPT_STARTTLS, &[])?;
    let invalid = |m: String| io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"));
    let (reply, d) = option_reply(s, OPT_STARTTLS, "NBD_OPT_STARTTLS", deadline)?;
    let len = d.len();
    match reply {
        REP_ACK if len == 0 => {}
        REP_ACK => {
            return Err(invalid(format!(
                "NBD_OPT_STARTTLS acknowledged with {len} bytes"
            )))
        }
        r if r & REP_FLAG_ERROR != 0 => {
            // Leave politely; the session ends here either way.
            let _ = send_option(s, OPT_ABORT, &[]);
            let text = String::from_utf8_lossy(&d);
            return Err(io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "the remote does not offer TLS (NBD_OPT_STARTTLS refused: {}{}{}); \
                     nbds:// never falls back to plaintext (use nbd:// for a plaintext remote)",
                    match r {
                        REP_ERR_UNSUP => "unsupported".to_string(),
                        REP_ERR_POLICY => "by policy".to_string(),
                        r => format!("error {:#x}", r & !REP_FLAG_ERROR),
                    },
                    if text.is_empty() { "" } else { ", " },
                    text
                ),
            ));
        }
        r => return Err(invalid(format!("reply {r} to NBD_OPT_STARTTLS"))),
    }
    let plain = s.try_clone()?;
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            ErrorKind::TimedOut,
            "handshake: timed out before the TLS handshake",
        ));
    }
    *s = Stream::Tls(Arc::new(ClientTls::connect(plain, tls, left)?));
    Ok(())
}

/// The fixed newstyle handshake for `export`, after NBD_OPT_STARTTLS
/// with `tls`.
fn handshake(
    s: &mut Stream,
    export: &str,
    tls: Option<&Connector>,
    deadline: Instant,
) -> io::Result<ExportInfo> {
    let mut b = [0u8; 8];
    hs_read(s, &mut b, "the greeting", deadline)?;
    if u64::from_be_bytes(b) != NBD_MAGIC {
        return Err(io::Error::new(ErrorKind::InvalidData, "not an NBD server"));
    }
    hs_read(s, &mut b, "the greeting", deadline)?;
    match u64::from_be_bytes(b) {
        IHAVEOPT => {}
        OLDSTYLE_MAGIC => {
            return Err(io::Error::new(
                ErrorKind::Unsupported,
                "an oldstyle NBD server (only newstyle is supported)",
            ))
        }
        m => {
            return Err(io::Error::new(
                ErrorKind::InvalidData,
                format!("an NBD server with the unknown magic {m:#x}"),
            ))
        }
    }
    let mut f = [0u8; 2];
    hs_read(s, &mut f, "the handshake flags", deadline)?;
    let flags = u16::from_be_bytes(f);
    let fixed = flags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let client = if fixed { FLAG_C_FIXED_NEWSTYLE } else { 0 }
        | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&client.to_be_bytes())?;
    if let Some(tls) = tls {
        if !fixed {
            return Err(io::Error::new(
                ErrorKind::PermissionDenied,
                "the remote does not offer TLS (not a fixed newstyle server, so no \
                 NBD_OPT_STARTTLS); nbds:// never falls back to plaintext",
            ));
        }
        starttls(s, tls, deadline)?;
    }
    let mut info = match fixed {
        true => opt_go(s, export, deadline)?,
        false => None,
    };
    if info.is_none() {
        info = Some(opt_export_name(s, export, no_zeroes, deadline)?);
    }
    let mut info = info.expect("set above");
    if info.flags & TFLAG_HAS_FLAGS == 0 {
        info.flags = 0;
    }
    let (min, pref, max) = (info.min_block, info.pref_block, info.max_block);
    if !min.is_power_of_two() || min > 65536 || max < min {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("handshake: bad block sizes (minimum {min}, preferred {pref}, maximum {max})"),
        ));
    }
    // Payloads: at most 32 MiB, whole minimum blocks.
    info.max_block = max.min(MAX_PAYLOAD_BYTES) / min * min;
    Ok(info)
}

/// Connect to `spec`'s server within `timeout`.
fn dial(spec: &RemoteSpec, timeout: Duration) -> io::Result<Stream> {
    // One deadline for every attempt (the name lookup itself is the
    // system resolver's and not bounded here).
    let deadline = Instant::now() + timeout;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| io::Error::new(ErrorKind::TimedOut, "connect timed out"))
    };
    match &spec.address {
        RemoteAddress::Unix(p) => Ok(Stream::Unix(connect_unix(p, deadline)?)),
        RemoteAddress::Tcp { host, port } => {
            let mut last = io::Error::new(ErrorKind::NotFound, format!("{host} has no address"));
            for addr in (host.as_str(), *port).to_socket_addrs()? {
                match TcpStream::connect_timeout(&addr, left()?) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        return Ok(Stream::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// Connect to the Unix socket at `path` by `deadline`: a listener whose
/// backlog is full refuses a non-blocking connect (EAGAIN) rather than
/// making it wait, so the attempt is repeated until it is taken or the
/// deadline passes (a blocking `connect` would wait as long as the server
/// does not accept). The stream returned is blocking.
fn connect_unix(path: &std::path::Path, deadline: Instant) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::FromRawFd;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("{}: not a usable socket path", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    // SAFETY: socket has no memory arguments; a non-negative result is a
    // new descriptor, owned by the stream made from it at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    loop {
        // SAFETY: `addr` is a live, initialised sockaddr_un of that size.
        let r = unsafe {
            libc::connect(
                fd,
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r == 0 {
            stream.set_nonblocking(false)?;
            return Ok(stream);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(libc::EAGAIN) => {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    "connect timed out (the server accepts nothing)",
                ));
            }
            _ => return Err(e),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> RemoteSpec {
        RemoteSpec {
            address: RemoteAddress::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
            tls: None,
        }
    }

    #[test]
    fn good_uris_parse_and_round_trip() {
        let cases = [
            ("nbd://example.com", tcp("example.com", 10809, "")),
            ("nbd://example.com/", tcp("example.com", 10809, "")),
            (
                "nbd://example.com:10900/disk",
                tcp("example.com", 10900, "disk"),
            ),
            ("NBD://h:1/a%20b/c", tcp("h", 1, "a b/c")),
            ("nbd://[::1]:2000/x", tcp("::1", 2000, "x")),
            ("nbd://[fe80::1]", tcp("fe80::1", 10809, "")),
            ("nbd://10.0.0.1:/e", tcp("10.0.0.1", 10809, "e")),
            (
                "nbd+unix:///vol?socket=/run/nbd.sock",
                RemoteSpec {
                    address: RemoteAddress::Unix("/run/nbd.sock".into()),
                    export: "vol".into(),
                    tls: None,
                },
            ),
            (
                "nbd+unix://?socket=/tmp/a%26b",
                RemoteSpec {
                    address: RemoteAddress::Unix("/tmp/a&b".into()),
                    export: "".into(),
                    tls: None,
                },
            ),
            (
                "nbds://h/e?tls-certificates=/etc/pki/nbd",
                RemoteSpec {
                    tls: Some(RemoteTls {
                        certificates: Some("/etc/pki/nbd".into()),
                        ..RemoteTls::new()
                    }),
                    ..tcp("h", 10809, "e")
                },
            ),
            (
                "NBDS://alice@[::1]:99/e?tls-psk-file=/k%26s.psk&tls-type=psk",
                RemoteSpec {
                    tls: Some(RemoteTls {
                        psk_file: Some("/k&s.psk".into()),
                        username: Some("alice".into()),
                        ..RemoteTls::new()
                    }),
                    ..tcp("::1", 99, "e")
                },
            ),
            (
                "nbds+unix:///luks?socket=/s&tls-certificates=/c&tls-hostname=nbd.example\
                 &tls-verify-peer=0",
                RemoteSpec {
                    address: RemoteAddress::Unix("/s".into()),
                    export: "luks".into(),
                    tls: Some(RemoteTls {
                        certificates: Some("/c".into()),
                        hostname: Some("nbd.example".into()),
                        verify_peer: false,
                        ..RemoteTls::new()
                    }),
                },
            ),
            (
                "nbds://h?tls-username=bob&tls-verify-peer=true",
                RemoteSpec {
                    tls: Some(RemoteTls {
                        username: Some("bob".into()),
                        ..RemoteTls::new()
                    }),
                    ..tcp("h", 10809, "")
                },
            ),
        ];
        for (uri, want) in cases {
            let got = RemoteSpec::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
            assert_eq!(got, want, "{uri}");
            assert_eq!(
                RemoteSpec::parse(&got.uri()).unwrap(),
                want,
                "{}",
                got.uri()
            );
        }
    }

    #[test]
    fn bad_uris_are_refused_with_a_reason() {
        let cases = [
            ("", "not an NBD URI"),
            ("example.com:10809", "not an NBD URI"),
            ("http://h/e", "not supported"),
            ("nbd+vsock://1:2/e", "not supported"),
            ("nbd:///e", "no host"),
            ("nbd://:10809/e", "no host"),
            ("nbd://h:0/e", "bad port"),
            ("nbd://h:65536/e", "bad port"),
            ("nbd://h:+1/e", "bad port"),
            ("nbd://h:x/e", "bad port"),
            ("nbd://::1/e", "in brackets"),
            ("nbd://[::1/e", "closing ]"),
            ("nbd://[::1]x/e", "junk"),
            ("nbd://u@h/e", "only for TLS"),
            ("nbd://h/e#f", "fragment"),
            ("nbd://h/e?tls-certificates=/x", "needs TLS: use nbds://"),
            ("nbd+unix:///e?socket=/s&tls-psk-file=/k", "needs TLS"),
            ("nbds+unix:///e", "nbds+unix:// needs ?socket=PATH"),
            ("nbds://h/e?tls-certificates=", "is empty"),
            ("nbds://h/e?tls-hostname=", "is empty"),
            ("nbds://h/e?tls-verify-peer=maybe", "not a boolean"),
            ("nbds://h/e?tls-type=anon", "not supported (x509 or psk)"),
            ("nbds://h/e?tls-type=psk", "needs tls-psk-file"),
            ("nbds://h/e?tls-certificates=/c&tls-psk-file=/k", "not both"),
            (
                "nbds://h/e?tls-certificates=/c&tls-certificates=/d",
                "twice",
            ),
            ("nbds://a@h/e?tls-username=b", "both as user@"),
            ("nbds://a:pw@h/e", "a user name alone"),
            ("nbds://h/e?tls-foo=1", "unknown query parameter"),
            ("nbds://h/e?socket=/s", "unknown query parameter"),
            ("nbd://h/e?socket=/x", "unknown query parameter"),
            ("nbd+unix:///e", "needs ?socket=PATH"),
            ("nbd+unix:///e?socket=", "needs ?socket=PATH"),
            ("nbd+unix://host/e?socket=/s", "takes no host"),
            ("nbd+unix:///e?socket=/s&socket=/t", "twice"),
            ("nbd+unix:///e?socket=/s&tls=on", "unknown query parameter"),
            ("nbd://h/%zz", "%-escape"),
            ("nbd://h/%ff", "UTF-8"),
        ];
        for (uri, why) in cases {
            let e = RemoteSpec::parse(uri).expect_err(uri);
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{uri}");
            assert!(e.to_string().contains(why), "{uri}: {e}");
        }
        let long = format!("nbd://h/{}", "x".repeat(4097));
        assert!(RemoteSpec::parse(&long).is_err());
    }

    #[test]
    fn segments_are_cut_at_any_byte() {
        let (a, b, c) = ([1u8; 3], [2u8; 4], [3u8; 5]);
        let segs: [&[u8]; 3] = [&a, &b, &c];
        let cut = sub_slices(&segs, 2, 7);
        assert_eq!(cut.concat(), vec![1, 2, 2, 2, 2, 3, 3]);
        assert_eq!(sub_slices(&segs, 7, 5).concat(), vec![3; 5]);
        assert!(sub_slices(&segs, 12, 0).is_empty());
    }

    #[test]
    fn error_codes_map_to_kinds() {
        assert_eq!(errno_kind(EIO).0, ErrorKind::Other);
        assert_eq!(errno_kind(ENOSPC).0, ErrorKind::StorageFull);
        assert_eq!(errno_kind(EPERM).0, ErrorKind::PermissionDenied);
        assert_eq!(errno_kind(EINVAL).0, ErrorKind::InvalidInput);
        assert_eq!(errno_kind(ENOTSUP).0, ErrorKind::Unsupported);
        assert_eq!(errno_kind(12345).0, ErrorKind::Other);
    }
}
