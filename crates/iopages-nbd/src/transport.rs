//! A connection's transport: a non-blocking socket, optionally under TLS,
//! and a wake-up descriptor.
//!
//! Owns: trying reads and writes without ever blocking (plain or through
//! OpenSSL after NBD_OPT_STARTTLS), waiting for readiness with `poll(2)`
//! up to a deadline, the TLS handshake under a deadline, and the eventfd
//! other threads use to wake the connection's own thread. Must never:
//! block a thread other than the connection's own (crypt workers call
//! [`Transport::try_write`] and must get `Blocked` back instead of
//! waiting), or let two threads drive the TLS session at once (one lock
//! around it; nobody waits while holding it).

use crate::stream::Stream;
use openssl::ssl::{ErrorCode, HandshakeError, Ssl, SslAcceptor, SslStream};
use parking_lot::Mutex;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The outcome of a non-blocking attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Io {
    /// This many bytes moved (0 on a read: end of stream).
    Done(usize),
    /// Nothing can move until the socket is ready: readable (`false`) or
    /// writable (`true`). A TLS session may need either for either.
    Blocked { write: bool },
}

/// What a wait found.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ready {
    pub(crate) readable: bool,
    pub(crate) writable: bool,
    /// The socket was shut down or failed (reads now end).
    pub(crate) hangup: bool,
    /// Another thread kicked the wake-up descriptor.
    pub(crate) woken: bool,
}

/// A TLS record's largest plaintext: small pieces (reply headers, small
/// reads) are gathered into one record's worth before sealing; a piece at
/// least this large is sealed straight from where it lies.
pub(crate) const TLS_RECORD_BYTES: usize = 16 << 10;

/// Sealed records waiting for the socket, at most (past it, OpenSSL is
/// told to retry: the session's writes stop until the socket drains).
const TLS_OUT_BYTES: usize = 256 << 10;

/// The socket as OpenSSL sees it: records it seals are gathered here and
/// leave in one `send` of up to [`TLS_OUT_BYTES`] instead of one system
/// call per 16 KiB record (which cost the server and the client a wake-up
/// each). Reads go straight to the socket (OpenSSL reads ahead).
struct SealedOut {
    sock: Stream,
    out: Vec<u8>,
    sent: usize,
}

impl SealedOut {
    fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Send what is gathered, without blocking; `Ok` even when the socket
    /// takes only part (the rest waits for the next call).
    fn push(&mut self) -> io::Result<()> {
        while self.sent < self.out.len() {
            match (&self.sock).write(&self.out[self.sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        Ok(())
    }
}

impl Read for SealedOut {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.sock).read(buf)
    }
}

impl Write for SealedOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.pending() + buf.len() > TLS_OUT_BYTES {
            self.push()?;
            if self.pending() + buf.len() > TLS_OUT_BYTES && self.pending() > 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
        if self.sent > 0 && self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    /// OpenSSL flushes at the end of each handshake flight: send what the
    /// socket takes now; the rest goes as the caller waits for the socket
    /// (every wait includes "writable" while records are pending).
    fn flush(&mut self) -> io::Result<()> {
        self.push()
    }
}

struct Tls {
    ssl: SslStream<SealedOut>,
    /// Small pieces gathered for one record (OpenSSL has no vectored
    /// write), and how much of it OpenSSL has taken.
    stage: Vec<u8>,
    staged_sent: usize,
}

impl Tls {
    /// Seal and send a prefix of `bufs` without blocking.
    ///
    /// The caller keeps unsent bytes in order and offers them again, from
    /// the first byte not reported written: so staged bytes not yet taken
    /// are the front of `bufs`, and are sent from the stage without a
    /// second copy; and after `WANT_WRITE` OpenSSL gets the same bytes
    /// again (at least as many), as it requires of a retried write.
    fn write(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
        let r = self.seal(bufs);
        self.ssl.get_mut().push()?;
        r
    }

    /// Sealed records not yet taken by the socket.
    fn pending(&self) -> bool {
        self.ssl.get_ref().pending() > 0
    }

    fn seal(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
        let mut done = 0usize;
        loop {
            let r = if self.staged_sent < self.stage.len() {
                let r = self.ssl.ssl_write(&self.stage[self.staged_sent..]);
                if let Ok(n) = r {
                    self.staged_sent += n;
                }
                r
            } else {
                // The front: `done` bytes into `bufs`.
                let mut skip = done;
                let mut at = None;
                for (i, b) in bufs.iter().enumerate() {
                    if skip < b.len() {
                        at = Some((i, skip));
                        break;
                    }
                    skip -= b.len();
                }
                let Some((i, off)) = at else {
                    return Ok(Io::Done(done));
                };
                if bufs[i].len() - off >= TLS_RECORD_BYTES {
                    self.ssl.ssl_write(&bufs[i][off..])
                } else {
                    self.stage.clear();
                    self.staged_sent = 0;
                    let mut off = off;
                    for b in &bufs[i..] {
                        let room = TLS_RECORD_BYTES - self.stage.len();
                        if room == 0 {
                            break;
                        }
                        let piece = &b[off..];
                        self.stage
                            .extend_from_slice(&piece[..piece.len().min(room)]);
                        off = 0;
                    }
                    continue;
                }
            };
            match r {
                Ok(n) => done += n,
                Err(e) => {
                    let write = match e.code() {
                        ErrorCode::WANT_WRITE => true,
                        ErrorCode::WANT_READ => false,
                        _ => return Err(ssl_err(e)),
                    };
                    return Ok(if done > 0 {
                        Io::Done(done)
                    } else {
                        Io::Blocked { write }
                    });
                }
            }
        }
    }
}

/// A connection's transport.
pub(crate) struct Transport {
    sock: Stream,
    tls: OnceLock<Mutex<Tls>>,
    wake: OwnedFd,
}

fn ssl_err(e: openssl::ssl::Error) -> io::Error {
    match e.into_io_error() {
        Ok(io) => io,
        Err(e) => io::Error::other(format!("TLS: {e}")),
    }
}

impl Transport {
    /// Take `sock` over: it is made non-blocking.
    pub(crate) fn new(sock: Stream) -> io::Result<Transport> {
        sock.set_nonblocking(true)?;
        // SAFETY: plain syscall; the descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Transport {
            sock,
            tls: OnceLock::new(),
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Whether the session runs under TLS.
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// Whether sealed TLS records wait for the socket (the connection's
    /// thread then waits for "writable" too, and calls
    /// [`Transport::push_out`]).
    pub(crate) fn pending_out(&self) -> bool {
        self.tls.get().is_some_and(|t| t.lock().pending())
    }

    /// Send sealed TLS records waiting for the socket, without blocking.
    pub(crate) fn push_out(&self) -> io::Result<()> {
        match self.tls.get() {
            Some(t) => t.lock().ssl.get_mut().push(),
            None => Ok(()),
        }
    }

    /// Shut both directions down: a thread waiting on it wakes up, and
    /// every later read or write fails.
    pub(crate) fn shutdown(&self) {
        self.sock.shutdown();
    }

    /// Wake the connection's thread from [`Transport::wait`].
    pub(crate) fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our own eventfd. A full
        // counter (EAGAIN) already means "woken".
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            );
        }
    }

    /// Try to read into `buf` without blocking.
    pub(crate) fn try_read(&self, buf: &mut [u8]) -> io::Result<Io> {
        if buf.is_empty() {
            return Ok(Io::Done(0));
        }
        if let Some(tls) = self.tls.get() {
            let mut t = tls.lock();
            return match t.ssl.ssl_read(buf) {
                Ok(n) => Ok(Io::Done(n)),
                Err(e) => match e.code() {
                    ErrorCode::WANT_READ => Ok(Io::Blocked { write: false }),
                    ErrorCode::WANT_WRITE => Ok(Io::Blocked { write: true }),
                    // A close_notify, or the peer gone without one: the
                    // end of the stream either way.
                    ErrorCode::ZERO_RETURN => Ok(Io::Done(0)),
                    ErrorCode::SYSCALL if e.io_error().is_none() => Ok(Io::Done(0)),
                    _ => Err(ssl_err(e)),
                },
            };
        }
        loop {
            match (&self.sock).read(buf) {
                Ok(n) => return Ok(Io::Done(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(Io::Blocked { write: false })
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Try to write a prefix of `bufs` without blocking. After `Blocked`
    /// or a short write, the next call must offer the unsent bytes again,
    /// in order, from the first one not reported written (the outbox does):
    /// under TLS, sealed or staged bytes are pending on them.
    pub(crate) fn try_write(&self, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
        if let Some(tls) = self.tls.get() {
            return tls.lock().write(bufs);
        }
        loop {
            match (&self.sock).write_vectored(bufs) {
                Ok(0) if bufs.iter().any(|b| !b.is_empty()) => {
                    return Err(io::ErrorKind::WriteZero.into())
                }
                Ok(n) => return Ok(Io::Done(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(Io::Blocked { write: true })
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Wait until the socket is readable (`read`), writable (`write`),
    /// the wake-up descriptor is kicked, or `timeout` passes (`None`:
    /// no limit). A kick is consumed. A socket hung up or in error ends
    /// the wait too (`Ready::hangup`), even with neither `read` nor
    /// `write`.
    pub(crate) fn wait(
        &self,
        read: bool,
        write: bool,
        timeout: Option<Duration>,
    ) -> io::Result<Ready> {
        self.wait_on(true, read, write, timeout)
    }

    /// Wait for a kick or `timeout` only, the socket left out (a dead
    /// connection's socket polls hung up at once: waiting on it would
    /// spin).
    pub(crate) fn wait_kick(&self, timeout: Option<Duration>) -> io::Result<Ready> {
        self.wait_on(false, false, false, timeout)
    }

    fn wait_on(
        &self,
        socket: bool,
        read: bool,
        write: bool,
        timeout: Option<Duration>,
    ) -> io::Result<Ready> {
        let mut events = 0;
        if read {
            events |= libc::POLLIN;
        }
        if write {
            events |= libc::POLLOUT;
        }
        let mut fds = [
            libc::pollfd {
                // A negative descriptor is skipped by poll.
                fd: if socket { self.sock.as_raw_fd() } else { -1 },
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = match timeout {
            None => -1,
            // Round up: a wait never ends before its deadline.
            Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
        };
        // SAFETY: `fds` is a valid array of two pollfds for the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(Ready::default());
            }
            return Err(e);
        }
        let s = fds[0].revents;
        let mut ready = Ready {
            readable: s & libc::POLLIN != 0,
            writable: s & libc::POLLOUT != 0,
            hangup: s & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
            woken: fds[1].revents & libc::POLLIN != 0,
        };
        if ready.hangup {
            // Let the caller's next attempt see the end or the error.
            ready.readable = read;
            ready.writable = write;
        }
        if ready.woken {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a local from our own eventfd.
            unsafe {
                libc::read(
                    self.wake.as_raw_fd(),
                    (&mut v as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                );
            }
        }
        Ok(ready)
    }

    /// Write all of `buf`, waiting up to `deadline` in all.
    pub(crate) fn write_all_by(&self, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
        while !buf.is_empty() {
            match self.try_write(&[IoSlice::new(buf)])? {
                Io::Done(n) => buf = &buf[n..],
                Io::Blocked { write } => self.wait_by(!write, write, deadline)?,
            }
        }
        Ok(())
    }

    /// Wait for the socket up to `deadline`; records pending in the TLS
    /// session's buffer are sent as the socket drains meanwhile.
    pub(crate) fn wait_by(&self, read: bool, write: bool, deadline: Instant) -> io::Result<()> {
        self.push_out()?;
        let left = time_left(deadline)?;
        let write = write || self.pending_out();
        let r = self.wait(read, write, Some(left))?;
        if r.writable {
            self.push_out()?;
        }
        Ok(())
    }

    /// Run the server side of a TLS handshake on the socket, all of it
    /// before `deadline`; from then on every read and write goes through
    /// the session.
    pub(crate) fn start_tls(&self, acceptor: &SslAcceptor, deadline: Instant) -> io::Result<()> {
        if self.is_tls() {
            return Err(io::Error::other("TLS is already running"));
        }
        let ssl = Ssl::new(acceptor.context()).map_err(io::Error::other)?;
        let sock = SealedOut {
            sock: self.sock.try_clone()?,
            out: Vec::new(),
            sent: 0,
        };
        let mut step = ssl.accept(sock);
        loop {
            let mut mid = match step {
                Ok(s) => return self.set_tls(s),
                Err(HandshakeError::WouldBlock(m)) => m,
                Err(HandshakeError::SetupFailure(e)) => return Err(io::Error::other(e)),
                Err(HandshakeError::Failure(mut m)) => {
                    // The alert, so the client learns why.
                    let _ = m.get_mut().push();
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("TLS handshake failed: {}", m.error()),
                    ));
                }
            };
            // Records of the last flight may still be gathered: wait for
            // the socket to take them as well as for the client's answer.
            mid.get_mut().push()?;
            let write = mid.error().code() == ErrorCode::WANT_WRITE || mid.get_ref().pending() > 0;
            self.wait(true, write, Some(time_left(deadline)?))?;
            mid.get_mut().push()?;
            step = mid.handshake();
        }
    }

    fn set_tls(&self, mut ssl: SslStream<SealedOut>) -> io::Result<()> {
        ssl.get_mut().push()?;
        self.tls
            .set(Mutex::new(Tls {
                ssl,
                stage: Vec::with_capacity(TLS_RECORD_BYTES),
                staged_sent: 0,
            }))
            .map_err(|_| io::Error::other("TLS is already running"))
    }

    /// What the finished TLS handshake proved about the client: its PSK
    /// identity, or the subject of a client certificate that verified
    /// (`None` without TLS, or with an unverified or absent certificate).
    pub(crate) fn tls_identity(&self) -> Option<crate::peer::TlsIdentity> {
        use crate::peer::TlsIdentity;
        let t = self.tls.get()?.lock();
        let ssl = t.ssl.ssl();
        // The identity the server's PSK callback found a key for (TLS 1.2
        // and 1.3 alike; OpenSSL's own record of it is empty under 1.3).
        let kept = crate::tls::psk_identity_index()
            .ok()
            .and_then(|i| ssl.ex_data(i));
        if let Some(id) = kept.map(Vec::as_slice).or_else(|| ssl.psk_identity()) {
            return Some(TlsIdentity::Psk(String::from_utf8_lossy(id).into_owned()));
        }
        if ssl.verify_result() != openssl::x509::X509VerifyResult::OK {
            return None;
        }
        let cert = ssl.peer_certificate()?;
        Some(TlsIdentity::Subject(crate::peer::rfc4514(
            cert.subject_name(),
        )))
    }

    /// Send TLS's close_notify (and whatever is still gathered), if it
    /// can leave without waiting.
    pub(crate) fn close_tls(&self) {
        if let Some(tls) = self.tls.get() {
            let mut t = tls.lock();
            let _ = t.ssl.shutdown();
            let _ = t.ssl.get_mut().push();
        }
    }
}

/// Time until `deadline`, or `TimedOut` once it has passed.
fn time_left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the deadline passed",
        ));
    }
    Ok(left)
}
