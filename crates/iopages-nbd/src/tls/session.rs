//! One TLS session for both ends of NBD_OPT_STARTTLS: a server
//! connection's (`transport/nonblocking.rs`) and each of the remote store's client
//! connections (`client/tls.rs`, the `Tls` variant of `transport/stream.rs`).
//!
//! Owns: the handshake by a deadline ([`TlsSession::accept`] for the
//! server, [`TlsSession::connect`] for the client), reads and writes that
//! never wait ([`TlsSession::try_read`], [`TlsSession::try_write`]: the
//! server's connection thread and crypt workers), reads and writes that
//! wait up to a timeout ([`TlsSession::read`], [`TlsSession::write`]: the
//! remote client's reader and writers), close_notify and shutdown, and —
//! in `tls/verify.rs` — what each end checks of the other. Must
//! never: wait for the socket while holding the session's lock (so any
//! number of threads use one session: the server's reader and its
//! repliers, the remote client's reader and its writers); continue in
//! plaintext or exchange application data before the peer is checked;
//! or wait past the caller's deadline.
//!
//! # How a session runs
//!
//! The socket becomes the session's at the STARTTLS acknowledgement, as a
//! connection's receive and send are swapped over in nbdkit: everything
//! after goes through one `SslStream` over [`SealedOut`], behind one
//! mutex. Every operation is an *attempt* under that mutex — one
//! `SSL_read`, or sealing as much of the caller's iovecs as OpenSSL takes
//! — whose `WANT_READ`/`WANT_WRITE` becomes [`Io::Blocked`], the direction
//! to wait for; the waiting is the caller's, outside the lock: the
//! server's `Transport` polls with its wake-up eventfd, the timed
//! operations here poll the socket up to their deadline. OpenSSL has no
//! vectored write, so small iovecs are gathered into one record's worth
//! (the stage) and sealed together; a piece of a record or more is sealed
//! where it lies. The two ends differ in one thing only, where sealed
//! records go: the server gathers them and sends up to 256 KiB in one
//! system call, pushed later by its connection thread when the socket is
//! full ([`Sending::Batched`]); the client's writers wait for the socket
//! themselves, so its records go straight to it ([`Sending::Direct`]).

use openssl::ssl::{
    ErrorCode, HandshakeError, MidHandshakeSslStream, Ssl, SslAcceptor, SslConnector, SslStream,
};
use parking_lot::Mutex;
use std::io::{self, ErrorKind, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::sys::poll_until;
use crate::tls::verify::{self, StoreCheck};

/// A TLS record's largest plaintext: small pieces (reply headers, small
/// reads, request headers) are gathered into one record's worth before
/// sealing; a piece at least this large is sealed straight from where it
/// lies.
pub(crate) const TLS_RECORD_BYTES: usize = 16 << 10;

/// Sealed records waiting for the socket, at most, in a batched session
/// (past it, OpenSSL is told to retry: the session's writes stop until
/// the socket drains).
const TLS_OUT_BYTES: usize = 256 << 10;

/// While a timed write waits for OpenSSL to read (a TLS 1.2
/// renegotiation), the socket is polled in slices this long: the reader
/// thread may take the bytes first.
const WRITE_WANTS_READ_SLICE: Duration = Duration::from_millis(10);

/// The outcome of a non-blocking attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Io {
    /// This many bytes moved (0 on a read: end of stream).
    Done(usize),
    /// Nothing can move until the socket is ready: readable (`false`) or
    /// writable (`true`). A TLS session may need either for either.
    Blocked { write: bool },
}

/// The plain socket a session runs over (`stream::Stream`).
pub trait Socket: AsRawFd + Send + 'static {
    /// One `read(2)`.
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// One `write(2)`.
    fn send(&self, buf: &[u8]) -> io::Result<usize>;
    /// Make reads and writes return `WouldBlock` instead of waiting.
    fn nonblocking(&self) -> io::Result<()>;
    /// `shutdown(2)`, errors ignored (the socket may be gone already).
    fn shut(&self, how: Shutdown);
}

/// Where the records a session seals go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sending {
    /// Gathered, and sent up to [`TLS_OUT_BYTES`] at a time instead of
    /// one system call per 16 KiB record (which cost the server and its
    /// client a wake-up each); what the socket does not take waits for
    /// [`TlsSession::push_out`]. The server's.
    Batched,
    /// Straight to the socket as OpenSSL writes them (a full socket is
    /// `WANT_WRITE`): no copy, nothing left behind. The remote client's,
    /// whose writers wait for the socket themselves.
    Direct,
}

/// The socket as OpenSSL sees it. Reads go straight to the socket
/// (OpenSSL reads ahead on the server); writes as [`Sending`] says.
struct SealedOut<S> {
    sock: S,
    sending: Sending,
    out: Vec<u8>,
    sent: usize,
}

impl<S: Socket> SealedOut<S> {
    fn new(sock: S, sending: Sending) -> SealedOut<S> {
        SealedOut {
            sock,
            sending,
            out: Vec::new(),
            sent: 0,
        }
    }

    /// Sealed bytes the socket has not taken (always 0 when direct).
    fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Send what is gathered, without blocking; `Ok` even when the socket
    /// takes only part (the rest waits for the next call).
    fn push(&mut self) -> io::Result<()> {
        while self.sent < self.out.len() {
            match self.sock.send(&self.out[self.sent..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    debug_assert!(
                        n <= self.out.len() - self.sent,
                        "send took what was offered"
                    );
                    self.sent += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
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

impl<S: Socket> Read for SealedOut<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf)
    }
}

impl<S: Socket> Write for SealedOut<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.sending == Sending::Direct {
            debug_assert_eq!(self.pending(), 0, "a direct session gathers nothing");
            return self.sock.send(buf);
        }
        if self.pending() + buf.len() > TLS_OUT_BYTES {
            self.push()?;
            if self.pending() + buf.len() > TLS_OUT_BYTES && self.pending() > 0 {
                return Err(ErrorKind::WouldBlock.into());
            }
        }
        if self.sent > 0 && self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        self.out.extend_from_slice(buf);
        // Bounded: past the bound only when the gathered bytes were all sent.
        debug_assert!(
            self.pending() <= TLS_OUT_BYTES.max(buf.len()),
            "the sealed-out buffer stays within its bound"
        );
        Ok(buf.len())
    }

    /// OpenSSL flushes at the end of each handshake flight: send what the
    /// socket takes now; the rest goes as the caller waits for the socket
    /// (every wait includes "writable" while records are pending).
    fn flush(&mut self) -> io::Result<()> {
        self.push()
    }
}

/// What the session's lock guards.
struct Sealed<S> {
    ssl: SslStream<SealedOut<S>>,
    /// Small pieces gathered for one record (OpenSSL has no vectored
    /// write), and how much of it OpenSSL has taken.
    stage: Vec<u8>,
    staged_sent: usize,
}

impl<S: Socket> Sealed<S> {
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

    fn seal(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
        let mut done = 0usize;
        loop {
            let r = if self.staged_sent < self.stage.len() {
                let r = self.ssl.ssl_write(&self.stage[self.staged_sent..]);
                if let Ok(n) = r {
                    self.staged_sent += n;
                    debug_assert!(
                        self.staged_sent <= self.stage.len(),
                        "OpenSSL took the stage once"
                    );
                }
                r
            } else {
                let Some((i, off)) = front(bufs, done) else {
                    return Ok(Io::Done(done));
                };
                if bufs[i].len() - off >= TLS_RECORD_BYTES {
                    self.ssl.ssl_write(&bufs[i][off..])
                } else {
                    self.stage_from(&bufs[i..], off);
                    continue;
                }
            };
            match r {
                Ok(n) => done += n,
                Err(e) => {
                    let write = match e.code() {
                        ErrorCode::WANT_WRITE => true,
                        ErrorCode::WANT_READ => false,
                        _ => return Err(ssl_io_error(e)),
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

    /// Gather up to one record's worth of `bufs`, from `off` bytes into
    /// the first, into the stage.
    fn stage_from(&mut self, bufs: &[IoSlice<'_>], mut off: usize) {
        debug_assert_eq!(self.staged_sent, self.stage.len(), "the stage is sent");
        self.stage.clear();
        self.staged_sent = 0;
        for b in bufs {
            let room = TLS_RECORD_BYTES - self.stage.len();
            if room == 0 {
                break;
            }
            let piece = &b[off..];
            self.stage
                .extend_from_slice(&piece[..piece.len().min(room)]);
            off = 0;
        }
        debug_assert!(!self.stage.is_empty(), "a front piece is never empty");
    }
}

/// Where the byte `done` bytes into `bufs` lies: (iovec, offset), or
/// `None` past the end.
fn front(bufs: &[IoSlice<'_>], done: usize) -> Option<(usize, usize)> {
    let mut skip = done;
    for (i, b) in bufs.iter().enumerate() {
        if skip < b.len() {
            return Some((i, skip));
        }
        skip -= b.len();
    }
    None
}

/// A TLS session on a non-blocking socket, shared by the threads of one
/// connection.
pub struct TlsSession<S: Socket> {
    state: Mutex<Sealed<S>>,
    /// The socket's descriptor (owned by the session's `SealedOut`), for
    /// `poll`.
    fd: RawFd,
    sending: Sending,
    /// How long [`TlsSession::read`] and [`TlsSession::write`] wait.
    read_timeout_ns: AtomicU64,
    write_timeout_ns: AtomicU64,
}

impl<S: Socket> std::fmt::Debug for TlsSession<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSession")
            .field("fd", &self.fd)
            .field("sending", &self.sending)
            .finish()
    }
}

/// How a handshake ended, when it ended in the protocol.
enum Finished<S> {
    Done(SslStream<SealedOut<S>>),
    /// The peer failed it, or it failed the peer (its alert was sent).
    Failed(MidHandshakeSslStream<SealedOut<S>>),
}

/// Where a handshake stands after a step.
enum Advance<S> {
    Done(SslStream<SealedOut<S>>),
    /// It waits for the socket: readable (`read`), writable (`write`:
    /// OpenSSL wants to write, or records of its last flight are still
    /// gathered).
    Wait {
        mid: MidHandshakeSslStream<SealedOut<S>>,
        read: bool,
        write: bool,
    },
    /// The peer failed it, or it failed the peer (its alert was sent).
    Failed(MidHandshakeSslStream<SealedOut<S>>),
}

/// Take one step of a handshake's result: what it finished, or what it
/// waits for (what it has sealed sent as far as the socket takes it).
fn advance<S: Socket>(
    step: Result<SslStream<SealedOut<S>>, HandshakeError<SealedOut<S>>>,
) -> io::Result<Advance<S>> {
    match step {
        Ok(mut s) => {
            // The last flight may still be gathered.
            s.get_mut().push()?;
            Ok(Advance::Done(s))
        }
        Err(HandshakeError::WouldBlock(mut mid)) => {
            mid.get_mut().push()?;
            let want_write = mid.error().code() == ErrorCode::WANT_WRITE;
            let write = want_write || mid.get_ref().pending() > 0;
            Ok(Advance::Wait {
                mid,
                read: !want_write,
                write,
            })
        }
        Err(HandshakeError::SetupFailure(e)) => Err(setup_error(e)),
        Err(HandshakeError::Failure(mut m)) => {
            // The alert, so the peer learns why.
            let _ = m.get_mut().push();
            Ok(Advance::Failed(m))
        }
    }
}

/// Drive a handshake from its first `step` to its end: `wait(read,
/// write)` waits for the socket (and fails once the caller's deadline
/// passes).
fn drive<S: Socket>(
    step: Result<SslStream<SealedOut<S>>, HandshakeError<SealedOut<S>>>,
    mut wait: impl FnMut(bool, bool) -> io::Result<()>,
) -> io::Result<Finished<S>> {
    let mut a = advance(step)?;
    loop {
        match a {
            Advance::Done(s) => return Ok(Finished::Done(s)),
            Advance::Failed(m) => return Ok(Finished::Failed(m)),
            Advance::Wait {
                mut mid,
                read,
                write,
            } => {
                wait(read, write)?;
                mid.get_mut().push()?;
                a = advance(mid.handshake())?;
            }
        }
    }
}

/// The server side of a handshake that waits for its socket
/// ([`TlsSession::accept_start`]): kept while its connection waits for
/// the client without a thread, and resumed when the socket is ready.
pub(crate) struct Accepting<S: Socket> {
    mid: MidHandshakeSslStream<SealedOut<S>>,
    fd: RawFd,
    timeout: Duration,
    /// It waits for the socket to take its records (not for the client).
    pub(crate) wants_write: bool,
}

/// Where a server handshake driven without waiting stands.
pub(crate) enum Accept<S: Socket> {
    /// Finished: the session.
    Done(TlsSession<S>),
    /// It waits for the socket.
    Waits(Accepting<S>),
}

impl<S: Socket> Accepting<S> {
    /// Go on from where the socket stopped it.
    ///
    /// **Returns:** as [`TlsSession::accept_start`].
    pub(crate) fn resume(mut self) -> io::Result<Accept<S>> {
        self.mid.get_mut().push()?;
        TlsSession::accepted(advance(self.mid.handshake())?, self.fd, self.timeout)
    }
}

impl<S: Socket> TlsSession<S> {
    fn new(ssl: SslStream<SealedOut<S>>, fd: RawFd, timeout: Duration) -> TlsSession<S> {
        let sending = ssl.get_ref().sending;
        let ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        TlsSession {
            state: Mutex::new(Sealed {
                ssl,
                stage: Vec::with_capacity(TLS_RECORD_BYTES),
                staged_sent: 0,
            }),
            fd,
            sending,
            read_timeout_ns: AtomicU64::new(ns),
            write_timeout_ns: AtomicU64::new(ns),
        }
    }

    /// Run the server side of the handshake on `sock` (NBD_OPT_STARTTLS
    /// acknowledged); `wait(read, write)` waits for the socket and fails
    /// once the caller's deadline has passed. Sealed records are batched.
    /// Timed reads and writes would wait `timeout`. (The server drives
    /// its handshakes without waiting, [`TlsSession::accept_start`]; the
    /// remote client's tests serve TLS with this.)
    ///
    /// **Context:** blocks (in `wait`) for up to the caller's deadline.
    ///
    /// **Returns:** `PermissionDenied` naming OpenSSL's reason when the
    /// handshake fails (the alert sent first); `wait`'s error.
    #[cfg(test)]
    pub(crate) fn accept(
        sock: S,
        acceptor: &SslAcceptor,
        timeout: Duration,
        wait: impl FnMut(bool, bool) -> io::Result<()>,
    ) -> io::Result<TlsSession<S>> {
        sock.nonblocking()?;
        let fd = sock.as_raw_fd();
        let ssl = Ssl::new(acceptor.context()).map_err(setup_error)?;
        match drive(ssl.accept(SealedOut::new(sock, Sending::Batched)), wait)? {
            Finished::Done(s) => Ok(TlsSession::new(s, fd, timeout)),
            Finished::Failed(m) => Err(io::Error::new(
                ErrorKind::PermissionDenied,
                format!("TLS handshake failed: {}", m.error()),
            )),
        }
    }

    /// Start the server side of the handshake on `sock` (NBD_OPT_STARTTLS
    /// acknowledged) without waiting for the client: as far as what has
    /// arrived allows. Sealed records are batched; timed reads and writes
    /// would wait `timeout`.
    ///
    /// **Returns:** the session, or the handshake waiting for its socket
    /// ([`Accepting::resume`] goes on); `PermissionDenied` naming
    /// OpenSSL's reason when it fails (the alert sent first).
    pub(crate) fn accept_start(
        sock: S,
        acceptor: &SslAcceptor,
        timeout: Duration,
    ) -> io::Result<Accept<S>> {
        sock.nonblocking()?;
        let fd = sock.as_raw_fd();
        let ssl = Ssl::new(acceptor.context()).map_err(setup_error)?;
        let step = ssl.accept(SealedOut::new(sock, Sending::Batched));
        TlsSession::accepted(advance(step)?, fd, timeout)
    }

    fn accepted(a: Advance<S>, fd: RawFd, timeout: Duration) -> io::Result<Accept<S>> {
        match a {
            Advance::Done(s) => Ok(Accept::Done(TlsSession::new(s, fd, timeout))),
            Advance::Failed(m) => Err(io::Error::new(
                ErrorKind::PermissionDenied,
                format!("TLS handshake failed: {}", m.error()),
            )),
            Advance::Wait { mid, write, .. } => Ok(Accept::Waits(Accepting {
                mid,
                fd,
                timeout,
                wants_write: write,
            })),
        }
    }

    /// Run the client side of the handshake on `sock` (NBD_OPT_STARTTLS
    /// acknowledged) with `connector`, the store held to `check`, all
    /// within `timeout` — which reads and writes then wait, until set
    /// otherwise. Records go straight to the socket.
    ///
    /// **Context:** blocks up to `timeout`.
    ///
    /// **Returns:** `PermissionDenied` naming why the store was not
    /// accepted (its certificate's verification error and what it was
    /// checked against; a store that authenticated otherwise than asked:
    /// what was expected and what it offered) or why the handshake
    /// failed; `TimedOut`.
    pub(crate) fn connect(
        sock: S,
        connector: &SslConnector,
        check: &StoreCheck,
        timeout: Duration,
    ) -> io::Result<TlsSession<S>> {
        let deadline = Instant::now() + timeout;
        sock.nonblocking()?;
        let fd = sock.as_raw_fd();
        let presented = verify::Presented::default();
        let ssl = check
            .ssl(connector, presented.clone())
            .map_err(setup_error)?;
        let wait = |read: bool, write: bool| match poll_until(fd, events(read, write), deadline)? {
            true => Ok(()),
            false => Err(io::Error::new(
                ErrorKind::TimedOut,
                format!("TLS handshake with the remote: no answer within {timeout:?}"),
            )),
        };
        match drive(ssl.connect(SealedOut::new(sock, Sending::Direct)), wait)? {
            Finished::Done(s) => {
                // Nothing has been sent through the session yet.
                check.check_session(s.ssl())?;
                Ok(TlsSession::new(s, fd, timeout))
            }
            Finished::Failed(m) => {
                let seen = presented.lock().take();
                Err(check.refusal(m.ssl(), m.error(), seen))
            }
        }
    }

    /// What the finished server handshake proved about the client: its
    /// PSK identity, or the subject of a client certificate that verified
    /// (`None` with an unverified or absent certificate).
    pub(crate) fn client_identity(&self) -> Option<crate::tls::identity::TlsIdentity> {
        verify::client_identity(self.state.lock().ssl.ssl())
    }

    /// Try to read plaintext into `buf` (not empty) without blocking;
    /// `Done(0)` at the end of the stream.
    ///
    /// **Context:** takes the session's lock for one `SSL_read`.
    pub(crate) fn try_read(&self, buf: &mut [u8]) -> io::Result<Io> {
        debug_assert!(!buf.is_empty(), "an empty read would read as the end");
        match self.state.lock().ssl.ssl_read(buf) {
            Ok(n) => Ok(Io::Done(n)),
            Err(e) => match e.code() {
                ErrorCode::WANT_READ => Ok(Io::Blocked { write: false }),
                ErrorCode::WANT_WRITE => Ok(Io::Blocked { write: true }),
                // A close_notify, or the peer gone without one: the end
                // of the stream either way.
                ErrorCode::ZERO_RETURN => Ok(Io::Done(0)),
                ErrorCode::SYSCALL if e.io_error().is_none() => Ok(Io::Done(0)),
                _ => Err(ssl_io_error(e)),
            },
        }
    }

    /// Try to seal and send a prefix of `bufs` without blocking. After
    /// `Blocked` or a short write, the next call must offer the unsent
    /// bytes again, in order, from the first one not reported written:
    /// sealed or staged bytes are pending on them.
    ///
    /// **Context:** takes the session's lock; never waits.
    pub(crate) fn try_write(&self, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
        self.state.lock().write(bufs)
    }

    /// Whether sealed records wait for the socket (batched sessions only;
    /// their owner then waits for "writable" too, and calls
    /// [`TlsSession::push_out`]).
    pub(crate) fn pending_out(&self) -> bool {
        self.state.lock().ssl.get_ref().pending() > 0
    }

    /// Send sealed records waiting for the socket, without blocking.
    pub(crate) fn push_out(&self) -> io::Result<()> {
        self.state.lock().ssl.get_mut().push()
    }

    /// Send close_notify (and whatever is still gathered), if it can
    /// leave without waiting.
    pub(crate) fn close_notify(&self) {
        let mut st = self.state.lock();
        let _ = st.ssl.shutdown();
        let _ = st.ssl.get_mut().push();
    }

    /// Send close_notify unless only reads are shut, then shut `how` of
    /// the socket down (a thread waiting on it wakes up).
    pub(crate) fn shutdown_how(&self, how: Shutdown) {
        let mut st = self.state.lock();
        if how != Shutdown::Read {
            let _ = st.ssl.shutdown();
            let _ = st.ssl.get_mut().push();
        }
        st.ssl.get_ref().sock.shut(how);
    }

    /// The socket's descriptor.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Timed reads and writes: the remote client's, over a direct session.
impl<S: Socket> TlsSession<S> {
    /// Reads and writes wait at most this long for the socket (then
    /// `WouldBlock`, as a socket timeout would).
    pub(crate) fn set_timeouts(&self, read: Duration, write: Duration) {
        self.read_timeout_ns
            .store(read.as_nanos() as u64, Ordering::Relaxed);
        self.write_timeout_ns
            .store(write.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Writes wait at most `write` for the socket (reads keep theirs).
    pub(crate) fn set_write_timeout(&self, write: Duration) {
        self.write_timeout_ns
            .store(write.as_nanos() as u64, Ordering::Relaxed);
    }

    fn deadline(ns: &AtomicU64) -> Instant {
        Instant::now() + Duration::from_nanos(ns.load(Ordering::Relaxed))
    }

    /// Read plaintext; `Ok(0)` at the end of the stream.
    ///
    /// **Context:** blocks up to the read timeout, never holding the
    /// session's lock while it waits.
    ///
    /// **Returns:** `WouldBlock` when the timeout passes; the session's
    /// error, named as TLS's.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        debug_assert_eq!(self.sending, Sending::Direct, "nothing pushes a batch");
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = Self::deadline(&self.read_timeout_ns);
        loop {
            let write = match self.try_read(buf)? {
                Io::Done(n) => return Ok(n),
                Io::Blocked { write } => write,
            };
            if !poll_until(self.fd, events(!write, write), deadline)? {
                return Err(timed_out("waiting for the remote's data"));
            }
        }
    }

    /// Seal and send a prefix of `buf`.
    ///
    /// **Context** and **Returns:** as [`TlsSession::write_vectored`].
    pub(crate) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    /// Seal and send a prefix of `bufs` (small pieces gathered into one
    /// record). After an error the session is not to be written again.
    ///
    /// **Context:** blocks up to the write timeout, never holding the
    /// session's lock while it waits.
    ///
    /// **Returns:** `WouldBlock` when the timeout passes with nothing
    /// sent; the session's error, named as TLS's.
    pub(crate) fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        debug_assert_eq!(self.sending, Sending::Direct, "nothing pushes a batch");
        let deadline = Self::deadline(&self.write_timeout_ns);
        loop {
            let (events, until) = match self.try_write(bufs)? {
                Io::Done(n) => return Ok(n),
                Io::Blocked { write: true } => (libc::POLLOUT, deadline),
                Io::Blocked { write: false } => (
                    libc::POLLIN,
                    deadline.min(Instant::now() + WRITE_WANTS_READ_SLICE),
                ),
            };
            if !poll_until(self.fd, events, until)? && Instant::now() >= deadline {
                return Err(timed_out("waiting for the remote to take data"));
            }
        }
    }
}

/// `poll` events for reading and writing.
fn events(read: bool, write: bool) -> libc::c_short {
    let mut ev = 0;
    if read {
        ev |= libc::POLLIN;
    }
    if write {
        ev |= libc::POLLOUT;
    }
    ev
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(ErrorKind::WouldBlock, format!("TLS: timed out {what}"))
}

/// An error setting a session up (not the peer's doing).
fn setup_error(e: openssl::error::ErrorStack) -> io::Error {
    io::Error::other(format!("TLS: {e}"))
}

/// An error of the session after the handshake (a server refusing the
/// client's certificate under TLS 1.3 says so only now), named as TLS's:
/// the socket's error keeps its kind, a protocol error is `InvalidData`.
fn ssl_io_error(e: openssl::ssl::Error) -> io::Error {
    match e.into_io_error() {
        Ok(io) => io::Error::new(io.kind(), format!("TLS session: {io}")),
        Err(e) => io::Error::new(ErrorKind::InvalidData, format!("TLS session: {e}")),
    }
}
