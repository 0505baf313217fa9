//! A connection's transport: a non-blocking socket, optionally under TLS,
//! and a wake-up descriptor.
//!
//! Owns: trying reads and writes without ever blocking (plain, or through
//! the connection's [`TlsSession`] after NBD_OPT_STARTTLS — the session
//! is swapped in under the same calls, so nothing above knows TLS is
//! there), waiting for readiness with `poll(2)` up to a deadline, and the
//! eventfd other threads use to wake the connection's own thread. Must
//! never: block a thread other than the connection's own (crypt workers
//! call [`Transport::try_write`] and must get `Blocked` back instead of
//! waiting).

use crate::sys;
pub(crate) use crate::tls::session::Io;
use crate::tls::session::{Accept, Accepting, TlsSession};
use crate::transport::stream::Stream;
use openssl::ssl::SslAcceptor;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// What a wait found.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ready {
    pub(crate) readable: bool,
    pub(crate) writable: bool,
    /// The socket was shut down or failed (reads now end).
    pub(crate) hangup: bool,
    /// Another thread kicked the wake-up descriptor.
    pub(crate) woken: bool,
    /// The other descriptor waited on ([`Transport::wait_also`]) is
    /// readable.
    pub(crate) other: bool,
}

/// A connection's transport.
pub(crate) struct Transport {
    sock: Stream,
    /// The TLS session, from the end of the STARTTLS handshake on.
    tls: OnceLock<TlsSession<Stream>>,
    /// The TLS handshake while it waits for the client.
    accepting: parking_lot::Mutex<Option<Accepting<Stream>>>,
    wake: OwnedFd,
}

impl Transport {
    /// Take `sock` over: it is made non-blocking.
    pub(crate) fn new(sock: Stream) -> io::Result<Transport> {
        sock.set_nonblocking(true)?;
        Ok(Transport {
            sock,
            tls: OnceLock::new(),
            accepting: parking_lot::Mutex::new(None),
            wake: sys::eventfd()?,
        })
    }

    /// The socket's descriptor (for watching it while the connection is
    /// parked; the transport keeps it open).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }

    /// The wake-up descriptor's (watched beside the socket while the
    /// connection is parked with requests in flight: a reply that finds
    /// the socket full kicks it).
    pub(crate) fn wake_fd(&self) -> std::os::fd::RawFd {
        self.wake.as_raw_fd()
    }

    /// Forget kicks already made (before the connection is parked, so
    /// that only a later one resumes it).
    pub(crate) fn clear_kicks(&self) {
        sys::eventfd_drain(self.wake.as_fd());
    }

    /// Whether the session runs under TLS.
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// Whether sealed TLS records wait for the socket (the connection's
    /// thread then waits for "writable" too, and calls
    /// [`Transport::push_out`]).
    pub(crate) fn pending_out(&self) -> bool {
        self.tls.get().is_some_and(TlsSession::pending_out)
    }

    /// Send sealed TLS records waiting for the socket, without blocking.
    pub(crate) fn push_out(&self) -> io::Result<()> {
        match self.tls.get() {
            Some(t) => t.push_out(),
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
        sys::eventfd_signal(self.wake.as_fd());
    }

    /// Try to read into `buf` without blocking.
    pub(crate) fn try_read(&self, buf: &mut [u8]) -> io::Result<Io> {
        if buf.is_empty() {
            return Ok(Io::Done(0));
        }
        if let Some(tls) = self.tls.get() {
            let r = tls.try_read(buf);
            debug_assert!(
                !matches!(r, Ok(Io::Done(n)) if n > buf.len()),
                "a read fills at most its buffer"
            );
            return r;
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
            let r = tls.try_write(bufs);
            debug_assert!(
                !matches!(r, Ok(Io::Done(n)) if n > bufs.iter().map(|b| b.len()).sum()),
                "a write reports at most what it was offered"
            );
            return r;
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
        self.wait_on(true, read, write, timeout, None)
    }

    /// As [`Transport::wait`], and also until `also` is readable (the
    /// parking lot's epoll instance: other connections are ready).
    pub(crate) fn wait_also(
        &self,
        read: bool,
        write: bool,
        timeout: Option<Duration>,
        also: RawFd,
    ) -> io::Result<Ready> {
        self.wait_on(true, read, write, timeout, Some(also))
    }

    /// Wait for a kick or `timeout` only, the socket left out (a dead
    /// connection's socket polls hung up at once: waiting on it would
    /// spin).
    pub(crate) fn wait_kick(&self, timeout: Option<Duration>) -> io::Result<Ready> {
        self.wait_on(false, false, false, timeout, None)
    }

    fn wait_on(
        &self,
        socket: bool,
        read: bool,
        write: bool,
        timeout: Option<Duration>,
        also: Option<RawFd>,
    ) -> io::Result<Ready> {
        debug_assert!(socket || !(read || write), "waiting for a socket left out");
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
            libc::pollfd {
                fd: also.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Rounded up: a wait never ends before its deadline.
        match sys::poll(&mut fds, sys::poll_ms(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(Ready::default()),
            Err(e) => return Err(e),
            Ok(_) => {}
        }
        let s = fds[0].revents;
        let mut ready = Ready {
            readable: s & libc::POLLIN != 0,
            writable: s & libc::POLLOUT != 0,
            hangup: s & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
            woken: fds[1].revents & libc::POLLIN != 0,
            other: fds[2].revents & libc::POLLIN != 0,
        };
        if ready.hangup {
            // Let the caller's next attempt see the end or the error.
            ready.readable = read;
            ready.writable = write;
        }
        if ready.woken {
            sys::eventfd_drain(self.wake.as_fd());
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

    /// Start, or go on with, the server side of a TLS handshake on the
    /// socket, as far as what the client has sent and the socket's room
    /// allow: it never waits. Once it is done every read and write goes
    /// through the session.
    ///
    /// **Returns:** `true` once TLS runs, `false` while the handshake
    /// waits — for the client's next bytes, or for room for the server's
    /// own records ([`Transport::accept_wants_write`]): call again once
    /// the socket is ready for that; `PermissionDenied` when the handshake
    /// fails, `TimedOut` past `deadline`.
    pub(crate) fn accept_tls(&self, acceptor: &SslAcceptor, deadline: Instant) -> io::Result<bool> {
        let mut pending = self.accepting.lock();
        let step = match pending.take() {
            Some(a) => a.resume()?,
            None if self.is_tls() => return Err(io::Error::other("TLS is already running")),
            None => {
                let left = time_left(deadline)?;
                TlsSession::accept_start(self.sock.try_clone()?, acceptor, left)?
            }
        };
        match step {
            Accept::Done(session) => {
                // Only the connection's serving thread starts TLS, once
                // (checked above): a second session here is a bug,
                // answered as before in release.
                self.tls.set(session).map(|()| true).map_err(|_| {
                    debug_assert!(false, "TLS started twice on one connection");
                    io::Error::other("TLS is already running")
                })
            }
            // Waiting for the client's flight, or for room for ours
            // ([`Transport::accept_wants_write`]).
            Accept::Waits(a) => {
                *pending = Some(a);
                Ok(false)
            }
        }
    }

    /// The TLS handshake in progress waits for room to send its own
    /// flight, not for the client's.
    pub(crate) fn accept_wants_write(&self) -> bool {
        self.accepting
            .lock()
            .as_ref()
            .is_some_and(|a| a.wants_write)
    }

    /// What the finished TLS handshake proved about the client: its PSK
    /// identity, or the subject of a client certificate that verified
    /// (`None` without TLS, or with an unverified or absent certificate).
    pub(crate) fn tls_identity(&self) -> Option<crate::tls::identity::TlsIdentity> {
        self.tls.get()?.client_identity()
    }

    /// Send TLS's close_notify (and whatever is still gathered), if it
    /// can leave without waiting.
    pub(crate) fn close_tls(&self) {
        if let Some(tls) = self.tls.get() {
            tls.close_notify();
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
