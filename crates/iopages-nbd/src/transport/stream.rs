//! A connection's byte stream: TCP or a Unix socket, or (the remote
//! store's client side only) a TLS session over one.
//!
//! Owns: reading and writing one socket, cloning it for the reply side,
//! and shutting it down; and lending the plain socket to a
//! [`TlsSession`] (the [`Socket`] it runs over, on the server's side and
//! the client's). Must never: hide an I/O error (every error goes to the
//! caller, which closes the connection).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use crate::tls::session::{Socket, TlsSession};

/// An accepted connection.
#[derive(Debug)]
pub enum Stream {
    /// A TCP connection.
    Tcp(TcpStream),
    /// A Unix-domain socket connection.
    Unix(UnixStream),
    /// A client TLS session (the remote store after NBD_OPT_STARTTLS):
    /// clones share the session; the socket is non-blocking underneath
    /// and the timeouts are the session's.
    Tls(Arc<TlsSession<Stream>>),
}

impl Stream {
    /// Another handle to the same socket.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tls(t) => Stream::Tls(t.clone()),
        })
    }

    /// Shut both directions down: a thread blocked reading it wakes up.
    pub fn shutdown(&self) {
        self.shutdown_how(Shutdown::Both);
    }

    /// Shut `how` down (errors ignored: the socket may be gone already);
    /// a TLS session sends its close_notify first when it can at once.
    pub fn shutdown_how(&self, how: Shutdown) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tls(t) => {
                t.shutdown_how(how);
                Ok(())
            }
        };
    }

    /// Blocking reads and writes time out after `read` and `write`.
    pub fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(read))?;
                s.set_write_timeout(Some(write))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(read))?;
                s.set_write_timeout(Some(write))
            }
            Stream::Tls(t) => {
                t.set_timeouts(read, write);
                Ok(())
            }
        }
    }
}

impl Stream {
    /// Make reads and writes return `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
            // The session's socket is non-blocking already; its reads and
            // writes wait (up to the timeouts) by design.
            Stream::Tls(_) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a TLS stream cannot be made non-blocking",
            )),
        }
    }
}

/// The plain socket under a TLS session. A session's own stream is never
/// one (`Tls` only ever wraps a `Tcp` or `Unix` stream).
impl Socket for Stream {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut s = self;
        s.read(buf)
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self;
        s.write(buf)
    }

    fn nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }

    fn shut(&self, how: Shutdown) {
        self.shutdown_how(how);
    }
}

impl std::os::fd::AsRawFd for Stream {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(t) => t.raw_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
            Stream::Unix(s) => (&*s).write_vectored(bufs),
            Stream::Tls(t) => t.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tls(t) => t.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
            Stream::Tls(_) => Ok(()),
        }
    }
}
