//! The remote store as the crypt target's [`Backend`]: [`NbdRemote`].
//!
//! Owns: what a caller's I/O becomes on the wire — checked against the
//! export (range, minimum block size, writability) before anything is
//! sent, split at the maximum payload (TRIM and WRITE_ZEROES at 1 GiB),
//! spread over the live connections, sent again on another connection
//! when its own died before the deadline — and FLUSH with the
//! durability contract (a FLUSH after a connection died holding writes
//! no FLUSH had covered fails once). Must never: send what the export's
//! constraints forbid, or report a FLUSH good when acknowledged writes
//! may have been lost.

use super::*;
use iopages_crypt::async_io::{began, declined, AsyncIo, Outcome, ReadInto, Segments, WriteEnd};

/// An NBD export used as the crypt target's backend: its ciphertext lives
/// on another NBD server.
///
/// I/Os are checked (range, the export's minimum block size, writability)
/// before anything is sent, split at the maximum payload, and spread over
/// the connections round-robin; many callers' requests are in flight at
/// once (up to [`RemoteOptions::max_in_flight`] per connection).
pub struct NbdRemote {
    uri: String,
    pool: Arc<Pool>,
    /// Each connection's thread (replies, reconnects).
    threads: Vec<JoinHandle<()>>,
    info: ExportInfo,
    read_only: bool,
    timeout: Duration,
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
                Some(crate::client::tls::connector(t, host).map_err(ctx)?)
            }
            None => None,
        };
        let dialer = Dialer {
            spec: spec.clone(),
            uri: uri.clone(),
            tls,
            timeout: opts.timeout,
            max_in_flight: opts.max_in_flight,
        };
        let (first, info) = dialer.open(&|_| Ok(())).map_err(ctx)?;
        let n = if info.flags & TFLAG_CAN_MULTI_CONN != 0 {
            opts.connections
        } else {
            1
        };
        let delay = spec.reconnect_delay.unwrap_or(opts.reconnect_delay);
        let pool = Arc::new(Pool::new(n, dialer, info, delay));
        let mut conns = vec![pool.dialer.conn(0, first, &pool).map_err(ctx)?];
        for i in 1..n {
            let (s, again) = pool.dialer.open(&|_| Ok(())).map_err(ctx)?;
            if again != info {
                return Err(ctx(io::Error::new(
                    ErrorKind::InvalidData,
                    "the connections describe the export differently",
                )));
            }
            conns.push(pool.dialer.conn(i, s, &pool).map_err(ctx)?);
        }
        let mut remote = NbdRemote {
            uri: uri.clone(),
            pool: pool.clone(),
            threads: Vec::with_capacity(n),
            info,
            read_only: opts.read_only || info.flags & TFLAG_READ_ONLY != 0,
            timeout: opts.timeout,
        };
        for (i, c) in conns.into_iter().enumerate() {
            pool.install(i, c.0.clone());
            let p = pool.clone();
            let thread = std::thread::Builder::new()
                .name(format!("nbd-remote-{i}"))
                .spawn(move || p.run(i, c))
                .map_err(ctx)?;
            remote.threads.push(thread);
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
            self.connections(),
            if self.connections() == 1 { "" } else { "s" },
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
        self.threads.len()
    }

    /// From now on a request finding no connection serving fails at once
    /// instead of waiting for a reconnect (the server is stopping);
    /// requests in flight still end by their own deadlines.
    pub fn stop_waiting(&self) {
        self.pool.stop_waiting();
    }

    /// Whether the store is reachable, and the counters of its
    /// connections (reconnects, re-sent requests, failures, round trips).
    ///
    /// **Returns:** a snapshot; `reachable` is false while no connection
    /// serves (all of them reconnecting).
    pub fn health(&self) -> RemoteHealth {
        self.pool.health()
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

    /// Send `req` by `deadline` on a live connection, and again on
    /// another (or a reconnected one) while the one it went out on dies
    /// before answering it and the deadline allows.
    ///
    /// **Returns:** the reply's error code; the request's error (counted
    /// as a deadline failure when it is `TimedOut`).
    fn call(&self, mut req: Req<'_, '_, '_>, deadline: Instant) -> io::Result<u32> {
        let mut resend = false;
        loop {
            let what = || Call::describe(req.command, req.offset, req.length);
            let conn = self.pool.live(&what, deadline)?;
            if resend {
                self.pool.counters.resent.fetch_add(1, Ordering::Relaxed);
            }
            let attempt = Req {
                read: req.read.as_deref_mut(),
                ..req
            };
            match conn.call(attempt, deadline) {
                Ok(errno) => return Ok(errno),
                Err(_) if !conn.is_alive() && Instant::now() < deadline => resend = true,
                Err(e) => {
                    if e.kind() == ErrorKind::TimedOut {
                        let c = &self.pool.counters;
                        c.deadline_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    return Err(e);
                }
            }
        }
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
        debug_assert!(
            offset + len <= self.info.size,
            "a checked range lies in the export"
        );
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

    /// A blocking request's deadline: the timeout from now, or from when
    /// the request first started where it is one being done again after
    /// ending `Again` (`async_io::began`): one deadline per request,
    /// whichever path it takes.
    fn deadline(&self) -> Instant {
        request_deadline(began(), Instant::now(), self.timeout)
    }

    /// The error for an NBD error reply.
    fn reply_error(&self, errno: u32, command: u16, offset: u64, len: u64) -> io::Error {
        reply_error(&self.uri, errno, command, offset, len)
    }

    /// Start `then` on a live connection — this thread's own, else the
    /// first other one that takes it — or end it `Again` (nothing sent)
    /// when none serves or none has a free slot and a free writer.
    fn start(&self, mut then: Then) {
        for conn in self.pool.live_from_mine() {
            match conn.start(then) {
                Ok(()) => return,
                Err(t) => then = t,
            }
        }
        then.end(Outcome::Again(declined(
            "no connection to the store could take the request now",
        )));
    }

    /// Whether a READ or WRITE of `len` bytes at `offset` goes out as one
    /// request the export takes (else the blocking path splits or refuses
    /// it).
    fn fits(&self, offset: u64, len: usize) -> bool {
        len > 0 && len <= self.info.max_block as usize && self.check(offset, len as u64).is_ok()
    }

    /// WRITE `segments` at `offset` with command `flags`, split at the
    /// maximum payload.
    fn write_flags(&self, flags: u16, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        self.check(offset, total as u64)?;
        self.check_writable("WRITE", offset, total as u64)?;
        let deadline = self.deadline();
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(self.info.max_block as usize);
            let at = offset + pos as u64;
            let req = Req {
                flags,
                command: CMD_WRITE,
                offset: at,
                length: n as u32,
                payload: segments,
                read: None,
                start: pos,
            };
            debug_assert!(n > 0, "a split write makes progress");
            let errno = self.call(req, deadline)?;
            if errno != 0 {
                return Err(self.reply_error(errno, CMD_WRITE, at, n as u64));
            }
            pos += n;
        }
        debug_assert_eq!(pos, total, "every byte of the write was sent once");
        Ok(())
    }

    /// One command without payload (TRIM, WRITE_ZEROES) over `len` bytes
    /// at `offset`, split at 1 GiB.
    fn effect(&self, command: u16, offset: u64, len: u64) -> io::Result<()> {
        let deadline = self.deadline();
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(MAX_EFFECT_BYTES);
            debug_assert!(
                n > 0 && n <= u64::from(u32::MAX),
                "a request's length fits NBD's"
            );
            let errno = self.call(Req::bare(command, offset + pos, n as u32), deadline)?;
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

    /// A write is copied into the socket (or read by TLS) as it is sent:
    /// the ciphertext is read right after it is made.
    fn reads_writes(&self) -> bool {
        true
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        self.check(offset, total as u64)?;
        let deadline = self.deadline();
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(self.info.max_block as usize);
            let at = offset + pos as u64;
            let req = Req {
                read: Some(&mut *segments),
                start: pos,
                ..Req::bare(CMD_READ, at, n as u32)
            };
            debug_assert!(n > 0, "a split read makes progress");
            let errno = self.call(req, deadline)?;
            if errno != 0 {
                return Err(self.reply_error(errno, CMD_READ, at, n as u64));
            }
            pos += n;
        }
        debug_assert_eq!(pos, total, "every byte of the read was asked for once");
        Ok(())
    }

    /// NBD_CMD_FLUSH on one connection when the export offers it (with
    /// several connections the export is multi-conn, where a flush on one
    /// covers the writes completed on all); nothing otherwise. Then the
    /// durability contract: when a connection died holding writes it had
    /// acknowledged and no FLUSH had covered, the store may have lost
    /// them, and this FLUSH fails (once) with EIO saying so.
    fn flush(&self) -> io::Result<()> {
        let upto = self.pool.durability.newest();
        if self.info.flags & TFLAG_SEND_FLUSH != 0 {
            let deadline = Instant::now() + self.timeout;
            let errno = self.call(Req::bare(CMD_FLUSH, 0, 0), deadline)?;
            if errno != 0 {
                return Err(self.reply_error(errno, CMD_FLUSH, 0, 0));
            }
        }
        if self.pool.durability.flushed(upto) {
            self.pool
                .counters
                .lost_flushes
                .fetch_add(1, Ordering::Relaxed);
            return Err(io::Error::other(format!(
                "{}: FLUSH: a connection to the store died after the store had \
                 acknowledged writes no FLUSH had covered; the store may have lost them \
                 (redo the writes since the last successful FLUSH)",
                self.uri
            )));
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

    fn async_io(&self) -> Option<&dyn AsyncIo> {
        Some(self)
    }
}

/// The largest WRITE started without waiting: the submitting thread
/// encrypts it and sends what the socket takes at once; the connection's
/// reader sends the rest as the store reads (`tail.rs`), so that no
/// submitting thread waits on the store. Larger writes go to the crypt
/// workers (their encryption is long work for a connection's thread).
pub const ASYNC_WRITE_MAX_BYTES: usize = 1 << 20;

/// The deadline of a request whose timeout is `timeout`: from `began`
/// when it started before (never later than `now`), else from `now`.
fn request_deadline(began: Option<Instant>, now: Instant, timeout: Duration) -> Instant {
    began.map_or(now, |b| b.min(now)) + timeout
}

/// READ and WRITE of one request each, sent by the submitting thread and
/// ended by the connection's reader (`started.rs`); what does not fit one
/// request, FUA where the export lacks it, a read-only remote and a store
/// with no live connection or free slot are declined (`Again`: the
/// blocking path does them, with its errors).
impl AsyncIo for NbdRemote {
    fn start_write(&self, offset: u64, data: Arc<dyn Segments>, fua: bool, end: WriteEnd) {
        let len = data.len();
        let large = len > ASYNC_WRITE_MAX_BYTES;
        if large || !self.fits(offset, len) || self.read_only || (fua && !self.native_fua()) {
            return end(Outcome::Again(declined("a write for the blocking path")));
        }
        self.start(Then {
            flags: if fua { CMD_FLAG_FUA } else { 0 },
            command: CMD_WRITE,
            offset,
            length: len as u32,
            data: Some(data),
            write_end: Some(end),
            read_into: None,
            sent_at: None,
        });
    }

    fn start_read(&self, offset: u64, mut into: Box<dyn ReadInto>) {
        let len = into.buf().len();
        if !self.fits(offset, len) {
            return into.end(Outcome::Again(declined("a read for the blocking path")));
        }
        self.start(Then {
            flags: 0,
            command: CMD_READ,
            offset,
            length: len as u32,
            data: None,
            write_end: None,
            read_into: Some(into),
            sent_at: None,
        });
    }
}

impl Drop for NbdRemote {
    /// Reconnecting stops; NBD_CMD_DISC on each live connection, then the
    /// connections' threads are joined (they stop at the server's EOF, or
    /// at their next tick).
    fn drop(&mut self) {
        self.pool.stop();
        let conns = self.pool.live_conns();
        for c in &conns {
            c.close();
        }
        // Dropped by a request's end on a reader thread (the last
        // reference to the volume released there): that thread is left to
        // end by itself (it sees the connection closing), not joined.
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        for c in &conns {
            c.ctl.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::request_deadline;
    use std::time::{Duration, Instant};

    #[test]
    fn a_request_done_again_keeps_the_deadline_of_its_first_start() {
        let now = Instant::now();
        let t = Duration::from_secs(30);
        assert_eq!(request_deadline(None, now, t), now + t);
        let began = now - Duration::from_secs(12);
        assert_eq!(request_deadline(Some(began), now, t), began + t);
        // A start in the future (a clock read on another thread a moment
        // later) counts from now.
        let later = now + Duration::from_millis(5);
        assert_eq!(request_deadline(Some(later), now, t), now + t);
    }
}
