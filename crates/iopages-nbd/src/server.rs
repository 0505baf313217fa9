//! The server: listeners, connection threads, shutdown.
//!
//! Owns: binding TCP and Unix listeners, one accepting thread per
//! listener, one thread per connection (handshake, then transmission),
//! and shutting all of it down in order: stop accepting, shut every
//! connection's socket, wait for their requests in flight to complete,
//! join every thread. Must never: leave a thread or a request behind after
//! [`Server::shutdown`] returns, or stop serving other clients because one
//! misbehaved.

use crate::buffers::Buffers;
use crate::conn;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::handshake::{self, Outcome};
use crate::stats::{Counters, Stats};
use crate::stream::Stream;
use crate::{ExportConfig, ExportInfo};
use iopages_crypt::queue::CryptQueue;
use iopages_crypt::target::SectorCipher;
use parking_lot::Mutex;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The default TCP address: loopback, the NBD port.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";
/// A reply that cannot be written for this long ends the connection.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// A client that has not finished the handshake after this long is
/// disconnected (a connection that says nothing holds no thread forever).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where to listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A TCP address (port 0: an ephemeral port, see [`Server::addresses`]).
    Tcp(SocketAddr),
    /// A Unix socket path (must not exist yet).
    Unix(PathBuf),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

enum Acceptor {
    Tcp(TcpListener),
    Unix(UnixListener),
}

struct ConnEntry {
    stream: Stream,
    thread: JoinHandle<()>,
}

struct Shared {
    export: ExportInfo,
    device: Arc<dyn Device>,
    counters: Arc<Counters>,
    buffers: Buffers,
    /// Connections in transmission now.
    active: Arc<AtomicUsize>,
    stopping: AtomicBool,
    conns: Mutex<Vec<ConnEntry>>,
}

/// An NBD server exporting one crypt target.
///
/// Dropping it shuts it down as [`Server::shutdown`] does.
pub struct Server {
    shared: Arc<Shared>,
    addresses: Vec<Listen>,
    acceptors: Vec<JoinHandle<()>>,
}

impl Server {
    /// Serve `queue`'s target as the export `export` on every address of
    /// `listen`, each connection submitting its requests to `queue` (one
    /// queue for all connections, so a flush on one covers writes
    /// completed on every other).
    ///
    /// **Context:** returns once the listeners are bound; the serving
    /// runs on threads of its own. **Returns:** [`Error::Config`] for
    /// inconsistent block sizes or no address, [`Error::Listen`] if an
    /// address cannot be bound.
    pub fn start<C: SectorCipher + 'static>(
        queue: Arc<CryptQueue<C>>,
        export: ExportConfig,
        listen: &[Listen],
    ) -> Result<Server> {
        if listen.is_empty() {
            return Err(Error::Config("no address to listen on".into()));
        }
        let active = Arc::new(AtomicUsize::new(0));
        let device: Arc<dyn Device> = if export.inline_max_bytes > 0 {
            Arc::new(crate::device::Inline {
                queue,
                max_bytes: export.inline_max_bytes as usize,
                active: Arc::clone(&active),
            })
        } else {
            queue
        };
        let device_alloc = device.allocator();
        let info = ExportInfo::new(&export, device.size_bytes(), device.sector_bytes())?;
        let mut bound = Vec::with_capacity(listen.len());
        let mut acceptors = Vec::with_capacity(listen.len());
        for l in listen {
            let err = |source| Error::Listen {
                addr: l.to_string(),
                source,
            };
            match l {
                Listen::Tcp(a) => {
                    let t = TcpListener::bind(a).map_err(err)?;
                    bound.push(Listen::Tcp(t.local_addr().map_err(err)?));
                    acceptors.push(Acceptor::Tcp(t));
                }
                Listen::Unix(p) => {
                    let u = UnixListener::bind(p).map_err(err)?;
                    bound.push(Listen::Unix(p.clone()));
                    acceptors.push(Acceptor::Unix(u));
                }
            }
        }
        let shared = Arc::new(Shared {
            export: info,
            device,
            counters: Arc::new(Counters::default()),
            buffers: Buffers::new(&device_alloc),
            active,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let mut server = Server {
            shared,
            addresses: bound,
            acceptors: Vec::new(),
        };
        for (i, a) in acceptors.into_iter().enumerate() {
            let s = Arc::clone(&server.shared);
            let h = std::thread::Builder::new()
                .name(format!("nbd-accept/{i}"))
                .spawn(move || accept_loop(&s, a))?;
            server.acceptors.push(h);
        }
        Ok(server)
    }

    /// The addresses served, with ephemeral ports resolved.
    pub fn addresses(&self) -> &[Listen] {
        &self.addresses
    }

    /// The first TCP address served, if any.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.addresses.iter().find_map(|l| match l {
            Listen::Tcp(a) => Some(*a),
            Listen::Unix(_) => None,
        })
    }

    /// The export's name.
    pub fn export_name(&self) -> &str {
        &self.shared.export.name
    }

    /// Requests and bytes per command so far, and where payload buffers
    /// came from.
    pub fn stats(&self) -> Stats {
        let mut s = self.shared.counters.snapshot();
        s.buffers = self.shared.buffers.stats();
        s
    }

    /// Block until the server is shut down from another thread (never, in
    /// a process that only serves: it ends with the process).
    pub fn wait(mut self) {
        for h in self.acceptors.drain(..) {
            let _ = h.join();
        }
    }

    /// Stop accepting, disconnect every client after its requests in
    /// flight complete, and join every thread.
    pub fn shutdown(self) {
        drop(self);
    }

    fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake each acceptor with a connection of our own.
        for a in &self.addresses {
            match a {
                Listen::Tcp(addr) => {
                    let mut addr = *addr;
                    if addr.ip().is_unspecified() {
                        addr.set_ip(match addr.ip() {
                            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                        });
                    }
                    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
                }
                Listen::Unix(p) => {
                    let _ = UnixStream::connect(p);
                }
            }
        }
        for h in self.acceptors.drain(..) {
            let _ = h.join();
        }
        for a in &self.addresses {
            if let Listen::Unix(p) = a {
                let _ = std::fs::remove_file(p);
            }
        }
        let conns = std::mem::take(&mut *self.shared.conns.lock());
        for c in &conns {
            c.stream.shutdown();
        }
        for c in conns {
            let _ = c.thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(s: &Arc<Shared>, a: Acceptor) {
    loop {
        let accepted = match &a {
            Acceptor::Tcp(l) => l.accept().map(|(t, _)| {
                let _ = t.set_nodelay(true);
                Stream::Tcp(t)
            }),
            Acceptor::Unix(l) => l.accept().map(|(u, _)| Stream::Unix(u)),
        };
        if s.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok(st) => st,
            Err(e) => {
                // EMFILE and the like: say so, back off, keep serving.
                eprintln!("iopages-nbd: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        s.counters
            .connections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let mut conns = s.conns.lock();
        // Join the connections that have ended.
        let (done, live): (Vec<_>, Vec<_>) = conns.drain(..).partition(|c| c.thread.is_finished());
        *conns = live;
        for c in done {
            let _ = c.thread.join();
        }
        let s2 = Arc::clone(s);
        match std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || serve_connection(&s2, stream))
        {
            Ok(thread) => conns.push(ConnEntry {
                stream: handle,
                thread,
            }),
            Err(e) => eprintln!("iopages-nbd: cannot start a connection thread: {e}"),
        }
    }
}

fn serve_connection(s: &Shared, mut stream: Stream) {
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_read_timeout(Some(s.export.handshake_timeout));
    if s.stopping.load(Ordering::SeqCst) {
        return;
    }
    match handshake::negotiate(&mut stream, &s.export) {
        Ok(Outcome::Transmission) => {
            // Idle clients are fine once in transmission.
            if stream.set_read_timeout(None).is_err() {
                stream.shutdown();
                return;
            }
            s.counters.sessions.fetch_add(1, Ordering::Relaxed);
            s.active.fetch_add(1, Ordering::Relaxed);
            conn::transmit(stream, &s.export, &s.device, &s.counters, &s.buffers);
            s.active.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(Outcome::Close) | Err(_) => stream.shutdown(),
    }
}
