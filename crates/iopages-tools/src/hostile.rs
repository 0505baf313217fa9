//! Hostile NBD peers over raw TCP, and a polite client beside them: the
//! many-tenant tests (crates/iopages-cli/tests/tenants.rs) and the
//! benchmark's hostile row start them against a real server.
//!
//! Every connection is bound to a chosen local IPv4 address before it
//! connects (127.0.0.2–9 on loopback), so the server sees each hostile
//! peer as a source address of its own. The peers: [`silent`] sockets
//! that connect and never send (re-opened when the server closes them, if
//! asked); [`unread_reads`], connections that send READs and never read
//! the replies; [`zero_flood`], a connection keeping huge WRITE_ZEROES in
//! flight. [`NbdClient`] is the minimal plaintext fixed-newstyle client
//! they and the polite [`read_latencies`] use: NBD_OPT_GO, then simple
//! requests and simple replies (no structured replies, no TLS), over the
//! tests' one raw client ([`crate::nbd_client::Client`]).
//!
//! Owns: the sockets it opens and the threads that watch them, stopped
//! and joined on drop. Must never: measure anything beyond what a caller
//! asks for (the latencies of its own reads), or leave a thread running
//! behind a dropped handle.

use std::io::{self, Read};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::nbd_client;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a connect may take (the server's backlog full, say).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the handshake or one reply of [`NbdClient::read_at`] may take.
pub const IO_TIMEOUT: Duration = Duration::from_secs(120);
/// The READ size of [`unread_reads`] (the largest request a server takes).
pub const GREEDY_READ_BYTES: u32 = 32 << 20;
/// The largest WRITE_ZEROES a request can name (4 GiB less a page: the
/// length is a u32).
pub const MAX_ZEROES_BYTES: u32 = 0xFFFF_F000;

fn sockaddr_in(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// The address of the `i`th of many peers of their own: 127.0.x.y with y
/// in 2..=251 (127.0.0.1 is the polite client's), the whole of 127/8
/// being loopback on Linux.
pub fn peer_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, (i / 250) as u8, 2 + (i % 250) as u8)
}

/// `n` clients in transmission on `export`, the `i`th from
/// [`peer_ip`]`(i)` (each a peer of its own), opened by 4 threads at once.
///
/// **Returns:** the clients in order; Err naming the first client that
/// could not connect or open the export.
pub fn open_peers(server: SocketAddr, export: &str, n: usize) -> Result<Vec<NbdClient>, String> {
    let per = n.div_ceil(4);
    let threads: Vec<_> = (0..4)
        .map(|k| {
            let export = export.to_string();
            std::thread::spawn(move || {
                (k * per..((k + 1) * per).min(n))
                    .map(|i| {
                        NbdClient::connect(peer_ip(i), server, &export)
                            .map_err(|e| format!("client {i} from {}: {e}", peer_ip(i)))
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in threads {
        out.extend(t.join().map_err(|_| "a connecting thread panicked")??);
    }
    Ok(out)
}

/// Raise this process's soft limit on open files to its hard limit (a
/// test holding a thousand connections needs more than the usual 1024).
///
/// **Returns:** the soft limit now in force.
pub fn raise_open_files() -> io::Result<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the live local `r`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max;
        // SAFETY: setrlimit only reads the live local `r`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(r.rlim_cur)
}

/// A TCP connection to `server` from `local_ip` (any port): socket, bind,
/// then connect, which std cannot do in this order.
///
/// **Context:** blocks up to [`CONNECT_TIMEOUT`] for the connect.
///
/// **Returns:** the connected, blocking stream (TCP_NODELAY on); Err for
/// an IPv6 `server`, a bind or connect failure, or the timeout.
pub fn connect_from(local_ip: Ipv4Addr, server: SocketAddr) -> io::Result<TcpStream> {
    let SocketAddr::V4(server) = server else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "hostile peers bind IPv4 addresses: the server must be IPv4",
        ));
    };
    let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
    // SAFETY: socket(2) with constant arguments, no memory of ours.
    let fd = unsafe { libc::socket(libc::AF_INET, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket owned by nothing else; the stream
    // closes it on every path from here on.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let local = sockaddr_in(local_ip, 0);
    // SAFETY: `local` is a valid sockaddr_in of `len` bytes.
    if unsafe { libc::bind(fd, std::ptr::from_ref(&local).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let remote = sockaddr_in(*server.ip(), server.port());
    // SAFETY: `remote` is a valid sockaddr_in of `len` bytes.
    if unsafe { libc::connect(fd, std::ptr::from_ref(&remote).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        wait_writable(fd, CONNECT_TIMEOUT)?;
    }
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Wait until the connecting socket `fd` is writable (connected or
/// failed: the caller reads SO_ERROR).
fn wait_writable(fd: libc::c_int, timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, its count 1.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            n if n > 0 => return Ok(()),
            0 => {}
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// What a [`Silent`] group has seen, shared with its watcher thread.
#[derive(Default)]
struct SilentCounts {
    open: AtomicU64,
    closed: AtomicU64,
    reopened: AtomicU64,
}

/// Sockets that connected and never send; a thread watches them (every
/// 20 ms) for the server closing them, and re-opens those when asked.
/// Dropping it stops the thread and closes them all.
pub struct Silent {
    stop: Arc<AtomicBool>,
    counts: Arc<SilentCounts>,
    thread: Option<JoinHandle<()>>,
}

/// `n` sockets from `local_ip` to `server` that never send a byte (they
/// read and drop what the server sends, its greeting); with `reopen`, each
/// one the server closes is opened again at once.
///
/// **Context:** connects all `n` before it returns (each up to
/// [`CONNECT_TIMEOUT`]), then starts one watcher thread.
///
/// **Returns:** the group; Err if any of the first `n` cannot connect.
pub fn silent(
    n: usize,
    local_ip: Ipv4Addr,
    server: SocketAddr,
    reopen: bool,
) -> io::Result<Silent> {
    let mut socks = Vec::with_capacity(n);
    for _ in 0..n {
        let s = connect_from(local_ip, server)?;
        s.set_nonblocking(true)?;
        socks.push(Some(s));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(SilentCounts::default());
    counts.open.store(n as u64, Ordering::Relaxed);
    let (st, c) = (stop.clone(), counts.clone());
    let thread = std::thread::spawn(move || {
        while !st.load(Ordering::Relaxed) {
            for slot in socks.iter_mut() {
                if slot.as_ref().is_some_and(closed_by_peer) {
                    *slot = None;
                    c.open.fetch_sub(1, Ordering::Relaxed);
                    c.closed.fetch_add(1, Ordering::Relaxed);
                }
                if slot.is_none() && reopen {
                    if let Ok(s) = connect_from(local_ip, server) {
                        if s.set_nonblocking(true).is_ok() {
                            *slot = Some(s);
                            c.open.fetch_add(1, Ordering::Relaxed);
                            c.reopened.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    Ok(Silent {
        stop,
        counts,
        thread: Some(thread),
    })
}

/// Whether the non-blocking `s` has been closed by the server (end of
/// stream or an error); what it sent is read and dropped.
fn closed_by_peer(s: &TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match (&*s).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}

impl Silent {
    /// Sockets open now (as the watcher last saw them).
    pub fn open(&self) -> u64 {
        self.counts.open.load(Ordering::Relaxed)
    }

    /// Sockets the server has closed so far.
    pub fn closed_by_server(&self) -> u64 {
        self.counts.closed.load(Ordering::Relaxed)
    }

    /// Sockets opened again after the server closed them.
    pub fn reopened(&self) -> u64 {
        self.counts.reopened.load(Ordering::Relaxed)
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An NBD transmission command ([`NbdClient::send`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Cmd {
    /// NBD_CMD_READ: the reply carries `length` bytes.
    Read = 0,
    /// NBD_CMD_WRITE: the request carries `length` bytes.
    Write = 1,
    /// NBD_CMD_FLUSH.
    Flush = 3,
    /// NBD_CMD_TRIM.
    Trim = 4,
    /// NBD_CMD_WRITE_ZEROES.
    WriteZeroes = 6,
}

pub use crate::nbd_client::Reply;

/// A minimal plaintext fixed-newstyle NBD client: NBD_OPT_GO for one
/// export, then requests with simple replies — the shared
/// [`nbd_client::Client`] with the export's size and flags beside it.
///
/// Owns: the client (its TCP stream and its READs still unanswered).
/// Must never: negotiate structured replies, TLS or meta contexts.
pub struct NbdClient {
    inner: nbd_client::Client<TcpStream>,
    /// The export's size in bytes (NBD_INFO_EXPORT).
    pub size: u64,
    /// The export's transmission flags.
    pub flags: u16,
}

impl NbdClient {
    /// Connect from `local_ip` to `server` ([`connect_from`]) and open
    /// `export` ([`NbdClient::handshake`]).
    pub fn connect(local_ip: Ipv4Addr, server: SocketAddr, export: &str) -> io::Result<NbdClient> {
        NbdClient::handshake(connect_from(local_ip, server)?, export)
    }

    /// The fixed-newstyle handshake on `stream`: the greeting, the client
    /// flags, NBD_OPT_GO for `export` (NBD_REP_INFO, then NBD_REP_ACK).
    ///
    /// **Context:** blocks; the stream's read timeout is set to
    /// [`IO_TIMEOUT`] (the caller may change it through [`Self::stream`]).
    ///
    /// **Returns:** the client in transmission; Err for a bad greeting, a
    /// refused export (NotFound for NBD_REP_ERR_UNKNOWN, PermissionDenied
    /// for ERR_POLICY and ERR_TLS_REQD) or a closed stream.
    pub fn handshake(stream: TcpStream, export: &str) -> io::Result<NbdClient> {
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let mut inner = nbd_client::Client::greet(stream)?;
        let fixed = nbd_client::FLAG_FIXED_NEWSTYLE | nbd_client::FLAG_NO_ZEROES;
        inner.send_client_flags(u32::from(inner.handshake_flags() & fixed))?;
        let e = inner.go(export, &[])?;
        Ok(NbdClient {
            inner,
            size: e.size,
            flags: e.flags,
        })
    }

    /// The TCP stream (for timeouts, or a shutdown from another thread
    /// through `try_clone`).
    pub fn stream(&self) -> &TcpStream {
        self.inner.stream()
    }

    /// Send one request: `cmd` at `offset` for `length` bytes, `payload`
    /// after the header (a WRITE's `length` bytes; empty otherwise).
    ///
    /// **Returns:** its cookie (this client's count of requests).
    pub fn send(&mut self, cmd: Cmd, offset: u64, length: u32, payload: &[u8]) -> io::Result<u64> {
        self.inner.send(cmd as u16, 0, offset, length, payload)
    }

    /// The next simple reply, with its data when it answers a READ
    /// without error.
    ///
    /// **Context:** blocks (the stream's read timeout applies).
    pub fn reply(&mut self) -> io::Result<Reply> {
        self.inner.reply()
    }

    /// One READ of `length` bytes at `offset`, waited for (nothing else
    /// may be in flight).
    ///
    /// **Returns:** the data; Err with the errno the server replied.
    pub fn read_at(&mut self, offset: u64, length: u32) -> io::Result<Vec<u8>> {
        let cookie = self.send(Cmd::Read, offset, length, &[])?;
        let r = self.reply()?;
        if r.cookie != cookie {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "reply to another cookie",
            ));
        }
        match r.error {
            0 => Ok(r.data),
            e => Err(io::Error::from_raw_os_error(e as i32)),
        }
    }
}

/// `conns` connections from `local_ip` to `export`, each sending `k`
/// READs of [`GREEDY_READ_BYTES`] (or the export's size, if smaller),
/// spread over the export, and never reading a reply: the server holds
/// their payload buffers until it gives up on them.
///
/// **Returns:** the connections (keep them to keep the pressure; drop to
/// close); Err if one cannot connect or send.
pub fn unread_reads(
    conns: usize,
    k: usize,
    local_ip: Ipv4Addr,
    server: SocketAddr,
    export: &str,
) -> io::Result<Vec<NbdClient>> {
    let mut out = Vec::with_capacity(conns);
    for c in 0..conns {
        let mut cl = NbdClient::connect(local_ip, server, export)?;
        // In u64: an export a multiple of 4 GiB must not make it 0.
        let len = u64::from(GREEDY_READ_BYTES).min(cl.size & !4095) as u32;
        let span = (cl.size - u64::from(len)) / 4096 + 1;
        for i in 0..k {
            let off = ((c * k + i) as u64 * u64::from(len) / 4096 % span) * 4096;
            cl.send(Cmd::Read, off, len, &[])?;
        }
        out.push(cl);
    }
    Ok(out)
}

/// A connection keeping WRITE_ZEROES in flight ([`zero_flood`]); its
/// thread stops (the stream shut down, the thread joined) on drop.
pub struct Flood {
    stop: Arc<AtomicBool>,
    replies: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    stream: TcpStream,
    thread: Option<JoinHandle<io::Result<()>>>,
}

/// One connection from `local_ip` to `export` that keeps `k`
/// WRITE_ZEROES of the whole export (at most [`MAX_ZEROES_BYTES`]) in
/// flight: it reads each reply and sends the next at once.
///
/// **Context:** connects before it returns, then one thread sends and
/// reads (no read timeout: the drop shuts the stream down).
///
/// **Returns:** the running flood; Err if it cannot connect.
pub fn zero_flood(
    k: usize,
    local_ip: Ipv4Addr,
    server: SocketAddr,
    export: &str,
) -> io::Result<Flood> {
    let mut cl = NbdClient::connect(local_ip, server, export)?;
    cl.stream().set_read_timeout(None)?;
    let stream = cl.stream().try_clone()?;
    let len = MAX_ZEROES_BYTES.min((cl.size & !4095).min(u64::from(u32::MAX)) as u32);
    let stop = Arc::new(AtomicBool::new(false));
    let replies = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let (st, rp, er) = (stop.clone(), replies.clone(), errors.clone());
    let thread = std::thread::spawn(move || -> io::Result<()> {
        for _ in 0..k {
            cl.send(Cmd::WriteZeroes, 0, len, &[])?;
        }
        while !st.load(Ordering::Relaxed) {
            let r = cl.reply()?;
            rp.fetch_add(1, Ordering::Relaxed);
            if r.error != 0 {
                er.fetch_add(1, Ordering::Relaxed);
            }
            cl.send(Cmd::WriteZeroes, 0, len, &[])?;
        }
        Ok(())
    });
    Ok(Flood {
        stop,
        replies,
        errors,
        stream,
        thread: Some(thread),
    })
}

impl Flood {
    /// Replies read so far.
    pub fn replies(&self) -> u64 {
        self.replies.load(Ordering::Relaxed)
    }

    /// Replies that carried an error.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Whether its thread still runs (false once the server closed the
    /// connection or a send failed).
    pub fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The polite client's part: `n` 4 KiB READs through `client`, one at a
/// time, at pseudo-random 4 KiB-aligned offsets over the export.
///
/// **Context:** blocks; each read is timed from its send to its reply.
///
/// **Returns:** the latency of each read, in order; Err at the first
/// read that fails (its errno: ENOMEM when the server's budget turned it
/// away) or breaks the stream.
pub fn read_latencies(client: &mut NbdClient, n: usize) -> io::Result<Vec<Duration>> {
    let pages = (client.size / 4096).max(1);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ client.stream().as_raw_fd() as u64;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = Instant::now();
        let data = client.read_at(x % pages * 4096, 4096)?;
        out.push(t.elapsed());
        if data.len() != 4096 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "short read"));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_connection_comes_from_the_chosen_loopback_address() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let ip = Ipv4Addr::new(127, 0, 0, 7);
        let _c = connect_from(ip, addr).unwrap();
        let (_s, peer) = l.accept().unwrap();
        assert_eq!(peer.ip(), std::net::IpAddr::V4(ip));
    }

    #[test]
    fn silent_sockets_closed_by_the_server_are_counted_and_reopened() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let g = silent(3, Ipv4Addr::new(127, 0, 0, 3), addr, true).unwrap();
        let first: Vec<_> = (0..3).map(|_| l.accept().unwrap().0).collect();
        assert_eq!(g.open(), 3);
        drop(first);
        // Three re-opened connections arrive once the closes are seen.
        let again: Vec<_> = (0..3).map(|_| l.accept().unwrap().0).collect();
        let t = Instant::now();
        while g.reopened() < 3 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!((g.closed_by_server(), g.reopened(), g.open()), (3, 3, 3));
        drop(again);
    }
    /// A scripted server: the greeting, one option read, then `replies`
    /// (type, data) to NBD_OPT_GO; then, if any, one READ answered.
    fn scripted(replies: Vec<(u32, Vec<u8>)>) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut s = nbd_client::Store::new(l.accept().unwrap().0);
            let (option, _) = s.greet_and_read_option();
            assert_eq!(option, nbd_client::OPT_GO);
            for (ty, d) in replies {
                s.reply_option(nbd_client::OPT_GO, ty, &d).unwrap();
            }
            if let Ok(q) = s.read_request() {
                let data = vec![0xa5; q.length as usize];
                s.simple_reply(0, q.cookie, &data).unwrap();
            }
        });
        addr
    }

    #[test]
    fn go_gives_the_export_size_and_a_read_gets_its_data() {
        let info = nbd_client::info_export_data(64 << 20, 1);
        let addr = scripted(vec![
            (nbd_client::REP_INFO, info),
            (nbd_client::REP_ACK, vec![]),
        ]);
        let mut c = NbdClient::connect(Ipv4Addr::new(127, 0, 0, 4), addr, "x").unwrap();
        assert_eq!((c.size, c.flags), (64 << 20, 1));
        assert_eq!(c.read_at(4096, 4096).unwrap(), vec![0xa5; 4096]);
    }

    #[test]
    fn an_unknown_export_is_not_found() {
        let addr = scripted(vec![(
            nbd_client::REP_ERR_UNKNOWN,
            b"no export named x".to_vec(),
        )]);
        let e = NbdClient::connect(Ipv4Addr::new(127, 0, 0, 5), addr, "x")
            .err()
            .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("no export named x"), "{e}");
    }
}
