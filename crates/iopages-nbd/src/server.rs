//! The server: listeners, connection threads, shutdown.
//!
//! Owns: binding TCP and Unix listeners (Unix sockets owner-only), one
//! accepting thread per listener, one thread per connection (handshake,
//! then transmission), the server-wide limits ([`ServerOptions`]: open
//! connections, payload bytes in flight, the deadlines), and shutting all
//! of it down in order: stop accepting, shut every connection's socket,
//! wait for their requests in flight to complete, join every thread. Must
//! never: leave a thread or a request behind after [`Server::shutdown`]
//! returns, hold more connections than `max_connections` (one more is
//! closed at once, and counted), or stop serving other clients because
//! one misbehaved.

use crate::buffers::Buffers;
use crate::conn::{self, Budget, ConnEnv, ConnLimits};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::handshake::{self, Outcome};
use crate::stats::{Counters, Stats};
use crate::stream::Stream;
use crate::tls::TlsConfig;
use crate::transport::Transport;
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
/// A reply the client has not taken this long after it was queued ends
/// that client's connection (and only that one); so does a request
/// payload that has not arrived this long after its header.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// A client that has not finished the handshake this long after it
/// connected is disconnected (one deadline for the whole handshake,
/// however slowly the client sends).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections open at once (handshake or transmission), by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Payload bytes in flight over all connections, by default (arena and
/// heap buffers alike).
pub const DEFAULT_MAX_INFLIGHT_BYTES: u64 = 256 << 20;
/// A connection with nothing in flight that sends nothing this long is
/// closed, by default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// Server-wide limits and TLS.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Connections open at once; one more is closed as soon as it is
    /// accepted (and counted in [`Stats::refused_connections`]).
    pub max_connections: usize,
    /// Payload bytes (read buffers and write payloads) in flight over all
    /// connections: a request that would pass it waits for others to
    /// finish, up to the reply timeout, then gets ENOMEM. At least the
    /// export's maximum block size.
    pub max_inflight_bytes: u64,
    /// Close a connection with nothing in flight that sends nothing for
    /// this long (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// See [`REPLY_TIMEOUT`].
    pub reply_timeout: Duration,
    /// TLS credentials and mode (`None`: plaintext only; NBD_OPT_STARTTLS
    /// is refused with NBD_REP_ERR_POLICY).
    pub tls: Option<TlsConfig>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_inflight_bytes: DEFAULT_MAX_INFLIGHT_BYTES,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            reply_timeout: REPLY_TIMEOUT,
            tls: None,
        }
    }
}

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
    t: Arc<Transport>,
    thread: JoinHandle<()>,
}

struct Shared {
    export: ExportInfo,
    device: Arc<dyn Device>,
    counters: Arc<Counters>,
    buffers: Buffers,
    budget: Arc<Budget>,
    zeros: Arc<[u8]>,
    opts: ServerOptions,
    /// When a refused connection was last reported (rate-limits the line).
    refused_said: Mutex<Option<std::time::Instant>>,
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
        Server::start_with(queue, export, ServerOptions::default(), listen)
    }

    /// [`Server::start`] with server-wide limits and TLS.
    ///
    /// **Returns:** also [`Error::Config`] for a zero connection limit or a
    /// byte budget below the export's maximum block size.
    pub fn start_with<C: SectorCipher + 'static>(
        queue: Arc<CryptQueue<C>>,
        export: ExportConfig,
        opts: ServerOptions,
        listen: &[Listen],
    ) -> Result<Server> {
        if listen.is_empty() {
            return Err(Error::Config("no address to listen on".into()));
        }
        if opts.max_connections == 0 {
            return Err(Error::Config(
                "the connection limit must be at least 1".into(),
            ));
        }
        if opts.max_inflight_bytes < export.max_block_bytes as u64 {
            return Err(Error::Config(format!(
                "the in-flight byte budget {} must be at least the maximum block size {}",
                opts.max_inflight_bytes, export.max_block_bytes
            )));
        }
        if opts.reply_timeout.is_zero() || opts.idle_timeout.is_some_and(|t| t.is_zero()) {
            return Err(Error::Config("timeouts must be longer than 0".into()));
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
        let mut info = ExportInfo::new(&export, device.size_bytes(), device.sector_bytes())?;
        info.discards = device.holes().discards_allowed();
        info.fast_zero = info.discards && device.holes().can_punch_zeroes();
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
                    // Owner-only from the start: the socket is created
                    // under a umask that leaves group and others out.
                    let u = {
                        let _g = UMASK.lock();
                        // SAFETY: umask only swaps the process's mask;
                        // UMASK serialises our own changes.
                        let old = unsafe { libc::umask(0o077) };
                        let r = UnixListener::bind(p);
                        // SAFETY: as above.
                        unsafe { libc::umask(old) };
                        r.map_err(err)?
                    };
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
            budget: Arc::new(Budget::new(opts.max_inflight_bytes)),
            zeros: std::iter::repeat_n(0u8, conn::CHUNK_BYTES).collect(),
            opts,
            refused_said: Mutex::new(None),
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
        s.budget_used_bytes = self.shared.budget.used();
        s.shape.sector_bytes = self.shared.export.min_block_bytes as u64;
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
            c.t.shutdown();
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

/// Serialises the process umask changes around Unix socket creation.
static UMASK: Mutex<()> = Mutex::new(());

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
        s.counters.connections.fetch_add(1, Ordering::Relaxed);
        let max = s.opts.max_connections as u64;
        // Taken before anything else, so listeners accepting at once
        // cannot pass the limit together.
        if s.counters.open.fetch_add(1, Ordering::AcqRel) >= max {
            s.counters.open.fetch_sub(1, Ordering::AcqRel);
            // Over the limit: closed at once, before the greeting (the
            // client sees the connection end), and said once a second.
            s.counters.refused.fetch_add(1, Ordering::Relaxed);
            stream.shutdown();
            drop(stream);
            let now = std::time::Instant::now();
            let mut said = s.refused_said.lock();
            if said.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
                *said = Some(now);
                eprintln!("iopages-nbd: refusing connections: {max} are open (--max-connections)");
            }
            continue;
        }
        let t = match Transport::new(stream) {
            Ok(t) => Arc::new(t),
            Err(e) => {
                s.counters.open.fetch_sub(1, Ordering::AcqRel);
                eprintln!("iopages-nbd: cannot set up a connection: {e}");
                continue;
            }
        };
        let mut conns = s.conns.lock();
        // Join the connections that have ended.
        let (done, live): (Vec<_>, Vec<_>) = conns.drain(..).partition(|c| c.thread.is_finished());
        *conns = live;
        for c in done {
            let _ = c.thread.join();
        }
        let s2 = Arc::clone(s);
        let t2 = Arc::clone(&t);
        match std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                serve_connection(&s2, &t2);
                s2.counters.open.fetch_sub(1, Ordering::Relaxed);
            }) {
            Ok(thread) => conns.push(ConnEntry { t, thread }),
            Err(e) => {
                s.counters.open.fetch_sub(1, Ordering::Relaxed);
                eprintln!("iopages-nbd: cannot start a connection thread: {e}");
            }
        }
    }
}

fn serve_connection(s: &Shared, t: &Arc<Transport>) {
    if s.stopping.load(Ordering::SeqCst) {
        return;
    }
    let deadline = std::time::Instant::now() + s.export.handshake_timeout;
    match handshake::negotiate(t, &s.export, s.opts.tls.as_ref(), deadline) {
        Ok(Outcome::Transmission(agreed)) => {
            if t.is_tls() {
                s.counters.tls_sessions.fetch_add(1, Ordering::Relaxed);
            }
            s.counters.sessions.fetch_add(1, Ordering::Relaxed);
            s.active.fetch_add(1, Ordering::Relaxed);
            let env = ConnEnv {
                export: &s.export,
                device: &s.device,
                counters: &s.counters,
                buffers: &s.buffers,
                budget: &s.budget,
                zeros: &s.zeros,
                limits: ConnLimits {
                    reply_timeout: s.opts.reply_timeout,
                    idle_timeout: s.opts.idle_timeout,
                    budget_wait: s.opts.reply_timeout,
                },
                structured: agreed.structured,
                allocation_context: agreed.allocation_context,
            };
            conn::transmit(Arc::clone(t), &env);
            s.active.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(Outcome::Close) => {
            t.close_tls();
            t.shutdown();
        }
        Err(e) => {
            match e.kind() {
                std::io::ErrorKind::TimedOut => {
                    s.counters
                        .handshake_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                }
                std::io::ErrorKind::PermissionDenied => {
                    s.counters.tls_failures.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            t.shutdown();
        }
    }
}
