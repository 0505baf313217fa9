//! Clients that try to stall or exhaust the server: one that never reads
//! its replies, one that dribbles its handshake, one that idles, too many
//! connections, too many bytes in flight; and TLS (STARTTLS with PSK and
//! X.509, refused keys, the protocol's FORCEDTLS rules) driven by an
//! OpenSSL client. Bounds here are correctness bounds (seconds, far from
//! the milliseconds these take), never speed targets.

use iopages::PageAllocator;
use iopages_nbd::{ExportConfig, Listen, Server, ServerOptions, TlsConfig, TlsMode};
use iopages_testkit::nbd_client::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;
use common::crypt_queue;

const DISK: u64 = 64 << 20;
const NAME: &str = "vol";

fn start(opts: ServerOptions, export: impl FnOnce(&mut ExportConfig)) -> (PageAllocator, Server) {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(3) ^ 0x11).collect();
    let (alloc, queue) = crypt_queue(128 << 20, DISK, &key, 512);
    let mut cfg = ExportConfig::new(NAME);
    export(&mut cfg);
    let server = Server::start_with(
        queue,
        cfg,
        opts,
        &[Listen::Tcp("127.0.0.1:0".parse().unwrap())],
    )
    .unwrap();
    (alloc, server)
}

fn finish(alloc: PageAllocator, server: Server) {
    // Clients just dropped: their connections wind down, then every byte
    // of the budget must be back.
    let t = Instant::now();
    while (server.stats().open_connections > 0 || server.stats().budget_used_bytes > 0)
        && t.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = server.stats();
    server.shutdown();
    assert_eq!(st.open_connections, 0, "every connection ended");
    assert_eq!(st.budget_used_bytes, 0, "no payload bytes left held");
    alloc.leak_check().expect("every page freed after shutdown");
}

/// A client of `server` past the greeting (a newstyle one), the
/// client's flags sent.
fn connect(server: &Server) -> Client {
    Client::tcp(server.tcp_addr().unwrap())
}

/// NBD_OPT_GO for the export, over any stream.
///
/// **Panics:** if the server refuses.
fn go<S: Read + Write>(c: &mut Client<S>) {
    if let Err(e) = c.go(NAME, &[]) {
        panic!("GO refused: {e}");
    }
}

/// True once the peer has closed (EOF or reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 4096];
    let until = Instant::now() + within;
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(e) => {
                eprintln!("closed_within: {e}");
                return false;
            }
        }
        if Instant::now() >= until {
            return false;
        }
    }
}

fn tiny_socket_buffers(s: &TcpStream) {
    // A small receive buffer makes "stops reading" bite at once.
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    let v: libc::c_int = 4096;
    // SAFETY: setsockopt on our own socket with a valid int.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

#[test]
fn clients_that_never_read_cannot_delay_another_clients_reply() {
    // Two crypt workers, two clients each with 8 x 1 MiB reads queued that
    // they never read: before, the workers blocked in their sends and a
    // third client's 4 KiB read waited for the write timeout (121 s).
    let (alloc, server) = start(ServerOptions::default(), |_| {});
    let mut stuck = Vec::new();
    for _ in 0..2 {
        let mut c = connect(&server);
        tiny_socket_buffers(c.stream());
        go(&mut c);
        for i in 0..8u64 {
            c.send(CMD_READ, 0, i << 20, 1 << 20, &[]).unwrap();
        }
        stuck.push(c);
    }
    // Their replies wait for room with the connections in the parking
    // lot: no thread waits for them to read.
    let t = Instant::now();
    while server.stats().parked_connections < 2 {
        assert!(t.elapsed() < Duration::from_secs(10), "never parked");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut ok = connect(&server);
    go(&mut ok);
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(ok.read(0, 4096).unwrap().len(), 4096);
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "another client's read took {took:?}"
        );
    }
    assert_eq!(ok.write(8192, &[7u8; 4096], 0), 0);
    drop(stuck);
    drop(ok);
    finish(alloc, server);
}

#[test]
fn clients_stalled_mid_payload_cannot_delay_another_clients_reply() {
    // More clients than the server keeps watchers (one per core, at least
    // two), each stalled halfway through a 1 MiB WRITE's payload: each
    // parks with what it sent (or, while a watcher lingers for the rest,
    // holds it), and a further client is served all the same.
    let (alloc, server) = start(ServerOptions::default(), |_| {});
    let mut ok = connect(&server);
    go(&mut ok);
    let before = ok.read(0, 4096).unwrap();
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let half = vec![5u8; 512 << 10];
    let mut stalled = Vec::new();
    for i in 0..cores.max(2) as u64 + 2 {
        let mut c = connect(&server);
        go(&mut c);
        c.send(CMD_WRITE, 0, i << 20, 1 << 20, &half).unwrap();
        stalled.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(ok.read(32 << 20, 4096).unwrap().len(), 4096);
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "another client's read took {took:?}"
        );
    }
    assert_eq!(ok.write(32 << 20, &[7u8; 4096], 0), 0);
    assert!(ok.read(32 << 20, 4096).unwrap() == [7u8; 4096], "a write");
    // Nothing of the stalled writes landed, and nothing timed out yet.
    assert!(
        ok.read(0, 4096).unwrap() == before,
        "a stalled write landed"
    );
    assert_eq!(server.stats().payload_timeouts, 0);
    drop(stalled);
    drop(ok);
    finish(alloc, server);
}

#[test]
fn a_client_that_stops_reading_loses_its_own_connection_after_the_reply_timeout() {
    let opts = ServerOptions {
        reply_timeout: Duration::from_secs(1),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut c = connect(&server);
    tiny_socket_buffers(c.stream());
    go(&mut c);
    for i in 0..8u64 {
        c.send(CMD_READ, 0, i << 20, 1 << 20, &[]).unwrap();
    }
    // Not reading: the replies stay queued past the timeout, then the
    // connection is given up and its bytes released.
    let t = Instant::now();
    while server.stats().reply_timeouts == 0 && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.stats().reply_timeouts, 1);
    let t = Instant::now();
    while server.stats().budget_used_bytes > 0 && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.stats().budget_used_bytes, 0);
    // Its connection is gone on the server's side (the client, reading
    // through a tiny window, would take long to see the end).
    let t = Instant::now();
    while server.stats().open_connections > 0 && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.stats().open_connections, 0);
    drop(c);
    // The server serves others as before.
    let mut ok = connect(&server);
    go(&mut ok);
    assert_eq!(ok.read(0, 4096).unwrap().len(), 4096);
    drop(ok);
    finish(alloc, server);
}

#[test]
fn the_handshake_has_one_deadline_however_slowly_bytes_come() {
    let (alloc, server) = start(ServerOptions::default(), |e| {
        e.handshake_timeout = Duration::from_secs(2)
    });
    let mut c = Client::greet(TcpStream::connect(server.tcp_addr().unwrap()).unwrap()).unwrap();
    // One byte every 300 ms: each restarted a per-byte timeout before.
    let t = Instant::now();
    let mut sent = 0;
    let flags = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes();
    let opt = option_bytes(OPT_LIST, &[]);
    let bytes: Vec<u8> = flags.iter().chain(opt.iter()).copied().collect();
    for &b in bytes.iter().cycle().take(100) {
        if c.send_raw(&[b]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(300));
        if t.elapsed() > Duration::from_secs(8) {
            break;
        }
    }
    assert!(closed_within(c.stream_mut(), Duration::from_secs(5)));
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "closed after {took:?} ({sent} bytes)"
    );
    assert_eq!(server.stats().handshake_timeouts, 1);
    finish(alloc, server);
}

#[test]
fn an_idle_connection_is_closed_and_a_busy_one_is_not() {
    // Idle timeout 2 s; the busy client sends every 100 ms for 3.5 s (a
    // wide margin on a loaded machine), the idle one nothing.
    let opts = ServerOptions {
        idle_timeout: Some(Duration::from_secs(2)),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut idle = connect(&server);
    go(&mut idle);
    let mut busy = connect(&server);
    go(&mut busy);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(3500) {
        assert_eq!(busy.read(0, 4096).unwrap().len(), 4096);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed_within(idle.stream_mut(), Duration::from_secs(5)));
    assert_eq!(busy.read(0, 4096).unwrap().len(), 4096);
    assert_eq!(server.stats().idle_closes, 1);
    drop(busy);
    finish(alloc, server);
}

#[test]
fn a_peer_at_its_share_is_refused_at_go_by_policy_and_counted() {
    // One peer (every client here is 127.0.0.1): its share is the whole
    // limit of 3.
    let opts = ServerOptions {
        max_connections: 3,
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut held: Vec<_> = (0..3).map(|_| connect(&server)).collect();
    for c in &mut held {
        go(c);
    }
    for _ in 0..5 {
        let mut c = connect(&server);
        let r = c.option(OPT_GO, &info_data(NAME, &[]));
        let (kind, msg) = (r[0].kind, &r[0].data);
        assert_eq!(kind, REP_ERR_POLICY, "{}", String::from_utf8_lossy(msg));
        assert!(String::from_utf8_lossy(msg).contains("too many connections"));
    }
    let st = server.stats();
    assert_eq!(st.refused_connections, 5);
    assert_eq!(st.peers.active, 1);
    // One leaves; a new one is served.
    drop(held.pop());
    let t = Instant::now();
    while server.stats().open_connections > 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = connect(&server);
    go(&mut c);
    assert_eq!(c.read(0, 4096).unwrap().len(), 4096);
    drop(held);
    drop(c);
    finish(alloc, server);
}

#[test]
fn a_write_zeroes_of_the_whole_volume_is_served_within_the_byte_budget() {
    // The smallest budget there is (one 32 MiB request) and a
    // WRITE_ZEROES twice as large: charged chunk by chunk, it completes
    // without ever holding more than the budget, and gives it all back.
    let opts = ServerOptions {
        max_inflight_bytes: 32 << 20,
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut c = connect(&server);
    go(&mut c);
    assert_eq!(c.write(DISK - 4096, &[7u8; 4096], 0), 0);
    let cookie = c.send(CMD_WRITE_ZEROES, 0, 0, DISK as u32, &[]).unwrap();
    assert_eq!(c.read_simple_reply().unwrap(), (0, cookie));
    assert_eq!(c.read(DISK - 4096, 4096).unwrap(), vec![0u8; 4096]);
    let st = server.stats();
    assert_eq!(st.write_zeroes.requests, 1);
    assert_eq!(st.write_zeroes.bytes, DISK);
    assert_eq!(st.budget_refusals, 0);
    drop(c);
    finish(alloc, server);
}

#[test]
fn an_export_rate_limit_is_never_exceeded() {
    // 10 requests and 1 MiB a second, one second of each in the bucket.
    let (alloc, server) = start(ServerOptions::default(), |e| {
        e.rate = iopages_nbd::RateLimit {
            bytes_per_second: Some(1 << 20),
            requests_per_second: Some(10),
        };
    });
    let mut c = connect(&server);
    go(&mut c);
    let t = Instant::now();
    for i in 0..25u64 {
        assert_eq!(c.read(i * 4096, 4096).unwrap().len(), 4096);
    }
    // 25 requests at 10 a second with 10 in the bucket: at least 1.4 s
    // (a lower bound: a slow machine only takes longer).
    assert!(
        t.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t.elapsed()
    );
    let t = Instant::now();
    for i in 0..4u64 {
        assert_eq!(c.write(i << 20, &vec![1u8; 1 << 20], 0), 0);
    }
    // 4 MiB at 1 MiB a second: at most the bucket's second (1 MiB) is
    // free, the next request may run into debt, each later one waits
    // for the debt before it: at least 1.9 s.
    assert!(
        t.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        t.elapsed()
    );
    let st = server.export_stats(NAME).unwrap();
    assert!(st.export.rate_waits >= 15, "{}", st.export.rate_waits);
    assert_eq!(st.export.rate_requests_per_second, 10);
    drop(c);
    finish(alloc, server);
}

#[test]
fn silent_sockets_only_push_each_other_out_of_a_full_handshake_pool() {
    let opts = ServerOptions {
        max_handshakes: 4,
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    // A client that has taken a step (an option answered) ...
    let mut polite = connect(&server);
    assert_eq!(polite.option(0xdead, &[])[0].kind, REP_ERR_UNSUP);
    // ... beside many sockets that never send a byte.
    let silent: Vec<_> = (0..20)
        .map(|_| TcpStream::connect(server.tcp_addr().unwrap()).unwrap())
        .collect();
    let t = Instant::now();
    while server.stats().peers.handshake_evictions < 17 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = server.stats();
    assert_eq!(
        st.peers.handshake_evictions, 17,
        "21 handshakes into a pool of 4"
    );
    assert_eq!(st.peers.handshakes_open, 4);
    go(&mut polite);
    assert_eq!(polite.read(0, 4096).unwrap().len(), 4096);
    drop((silent, polite));
    finish(alloc, server);
}

#[test]
fn the_byte_budget_bounds_payloads_in_flight_across_connections() {
    // 40 connections each asking for 4 x 8 MiB and reading nothing: the
    // payload bytes held never pass the budget (before: 1.14 GB of RSS
    // for 4 x 32 MiB each), the others wait or get ENOMEM, and a polite
    // client is answered once the budget frees.
    let budget: u64 = 48 << 20;
    let opts = ServerOptions {
        max_inflight_bytes: budget,
        reply_timeout: Duration::from_secs(2),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |e| e.max_block_bytes = 8 << 20);
    let mut hogs = Vec::new();
    for _ in 0..40 {
        let mut c = connect(&server);
        tiny_socket_buffers(c.stream());
        go(&mut c);
        for i in 0..4u64 {
            c.send(CMD_READ, 0, i << 23, 8 << 20, &[]).unwrap();
        }
        hogs.push(c);
    }
    let t = Instant::now();
    let mut peak = 0;
    while t.elapsed() < Duration::from_millis(1500) {
        peak = peak.max(server.stats().budget_used_bytes);
        assert!(peak <= budget, "{peak} bytes held, budget {budget}");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(peak > 0);
    assert!(server.stats().budget_waits > 0);
    // A polite client: answered (data or ENOMEM, never a hang).
    let mut ok = connect(&server);
    go(&mut ok);
    let got = ok.read(0, 4096);
    assert!(matches!(got, Ok(_) | Err(ENOMEM)), "{got:?}");
    drop(hogs);
    let t = Instant::now();
    while server.stats().budget_used_bytes > 0 && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ok.read(0, 4096).unwrap().len(), 4096);
    drop(ok);
    finish(alloc, server);
}

#[test]
fn a_long_export_name_is_not_echoed_back_whole() {
    let (alloc, server) = start(ServerOptions::default(), |_| {});
    let mut c = connect(&server);
    let name = "x".repeat(60_000);
    let r = c.option(OPT_INFO, &info_data(&name, &[]));
    let (kind, msg) = (r[0].kind, &r[0].data);
    assert_eq!(kind, REP_ERR_UNKNOWN);
    assert!(msg.len() < 256, "{} bytes of message", msg.len());
    assert!(String::from_utf8_lossy(msg).contains("60000 bytes"));
    drop(c);
    finish(alloc, server);
}

// ---- TLS ----

use openssl::pkey::{PKey, Private};
use openssl::ssl::{SslConnector, SslMethod, SslStream, SslVerifyMode};
use openssl::x509::X509;

struct TmpDir(std::path::PathBuf);

impl TmpDir {
    fn new(tag: &str) -> TmpDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("iopages-hostile-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TmpDir(p)
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A CA, a server certificate and a client certificate, from the
/// benchmark's generator (`iopages_tools::write_pki`, the files
/// `bench nbd --tls` serves with): the server's directory
/// (server-cert.pem, server-key.pem, ca-cert.pem) and the client's pieces.
struct Pki {
    _tmp: TmpDir,
    server: std::path::PathBuf,
    ca: X509,
    client: (X509, PKey<Private>),
    /// A client certificate's key from another CA (matches no server
    /// certificate).
    foreign_key: std::path::PathBuf,
}

fn pki() -> Pki {
    let tmp = TmpDir::new("pki");
    let files = iopages_tools::write_pki(&tmp.0).unwrap();
    let read = |d: &std::path::Path, f: &str| std::fs::read(d.join(f)).unwrap();
    let ca = X509::from_pem(&read(&files.server, "ca-cert.pem")).unwrap();
    let client = (
        X509::from_pem(&read(&files.client, "client-cert.pem")).unwrap(),
        PKey::private_key_from_pem(&read(&files.client, "client-key.pem")).unwrap(),
    );
    Pki {
        _tmp: tmp,
        server: files.server,
        ca,
        client,
        foreign_key: files.foreign.join("client-key.pem"),
    }
}

/// Send STARTTLS, expect the ACK, and run the client side of TLS.
fn starttls(
    mut c: Client<TcpStream>,
    connector: SslConnector,
) -> Result<Client<SslStream<TcpStream>>, String> {
    let r = c.option(OPT_STARTTLS, &[]);
    let (opt, kind) = (r[0].option, r[0].kind);
    assert_eq!((opt, kind), (OPT_STARTTLS, REP_ACK));
    let mut cfg = connector.configure().unwrap();
    cfg.set_verify_hostname(true);
    cfg.connect("localhost", c.into_stream())
        .map(Client::new)
        .map_err(|e| e.to_string())
}

fn psk_connector(identity: &'static [u8], key: Vec<u8>) -> SslConnector {
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    b.set_psk_client_callback(move |_, _hint, id, psk| {
        id[..identity.len()].copy_from_slice(identity);
        id[identity.len()] = 0;
        psk[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    b.build()
}

/// A server requiring TLS with one PSK identity, "alice" (the key its
/// second value), its key file in the first.
fn psk_server(tag: &str) -> (TmpDir, Vec<u8>, PageAllocator, Server) {
    let dir = TmpDir::new(tag);
    let file = dir.0.join("keys.psk");
    let key: Vec<u8> = (0..32u8).collect();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&file, format!("alice:{hex}\n")).unwrap();
    let opts = ServerOptions {
        tls: Some(TlsConfig::psk(&file, TlsMode::Require).unwrap()),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    (dir, key, alloc, server)
}

#[test]
fn psk_sessions_serve_and_a_wrong_key_or_identity_is_refused() {
    let (_dir, key, alloc, server) = psk_server("psk");
    let mut c = starttls(connect(&server), psk_connector(b"alice", key.clone())).unwrap();
    // Options answered one at a time under TLS: each reply leaves before
    // the handshake waits for the next option.
    assert_eq!(c.list(), [NAME]);
    assert_eq!(c.list(), [NAME]);
    go(&mut c);
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(c.write(1 << 20, &data, 0), 0);
    assert_eq!(c.read(1 << 20, 1 << 20).unwrap(), data);
    // Idle, the TLS session waits without a thread, and is served again
    // when the client sends.
    let t = Instant::now();
    while server.stats().parked_connections < 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "never parked");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(c.read(0, 4096).unwrap().len(), 4096);
    assert_eq!(c.read(1 << 20, 1 << 20).unwrap(), data);
    drop(c);
    let mut wrong = key.clone();
    wrong[0] ^= 1;
    assert!(starttls(connect(&server), psk_connector(b"alice", wrong)).is_err());
    assert!(starttls(connect(&server), psk_connector(b"mallory", key)).is_err());
    let t = Instant::now();
    while server.stats().tls_failures < 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = server.stats();
    assert_eq!((st.tls_sessions, st.tls_failures), (1, 2));
    finish(alloc, server);
}

/// Clients that send STARTTLS and then wait before their TLS handshake
/// (more of them than the server keeps watchers) wait in the parking lot,
/// none holding a thread; each then runs its handshake, a flight at a
/// time, and is served.
#[test]
fn tls_handshakes_wait_for_their_clients_without_a_thread() {
    let (_dir, key, alloc, server) = psk_server("psk-wait");
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let n = cores.max(2) + 4;
    let acked: Vec<_> = (0..n)
        .map(|_| {
            let mut c = connect(&server);
            let r = c.option(OPT_STARTTLS, &[]);
            assert_eq!((r[0].option, r[0].kind), (OPT_STARTTLS, REP_ACK));
            c
        })
        .collect();
    let t = Instant::now();
    loop {
        let st = server.stats();
        if st.parked_connections == n as u64 && st.peers.handshakes_open == n as u64 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} of {n} parked",
            st.parked_connections
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in acked {
        let mut cfg = psk_connector(b"alice", key.clone()).configure().unwrap();
        cfg.set_verify_hostname(true);
        let mut c = Client::new(cfg.connect("localhost", c.into_stream()).unwrap());
        assert_eq!(c.list(), [NAME]);
        go(&mut c);
        assert_eq!(c.read(0, 4096).unwrap().len(), 4096);
    }
    let st = server.stats();
    assert_eq!((st.tls_sessions, st.tls_failures), (n as u64, 0));
    finish(alloc, server);
}

#[test]
fn a_psk_identity_decides_the_exports_under_tls_1_2_and_1_3() {
    use openssl::ssl::SslVersion;
    let dir = TmpDir::new("psk-allow");
    let file = dir.0.join("keys.psk");
    let key: Vec<u8> = (0..32u8).collect();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&file, format!("alice:{hex}\nbob:{hex}\n")).unwrap();
    let opts = ServerOptions {
        tls: Some(TlsConfig::psk(&file, TlsMode::Require).unwrap()),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |e| e.allow = vec!["psk:alice".parse().unwrap()]);
    for v in [SslVersion::TLS1_2, SslVersion::TLS1_3] {
        let pinned = |id: &'static [u8]| {
            let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
            b.set_verify(SslVerifyMode::NONE);
            b.set_min_proto_version(Some(v)).unwrap();
            b.set_max_proto_version(Some(v)).unwrap();
            // TLS 1.2 offers PSK only in PSK suites.
            b.set_cipher_list("ECDHE-PSK-AES128-CBC-SHA256:PSK-AES128-GCM-SHA256")
                .unwrap();
            let key = key.clone();
            b.set_psk_client_callback(move |_, _hint, out_id, psk| {
                out_id[..id.len()].copy_from_slice(id);
                out_id[id.len()] = 0;
                psk[..key.len()].copy_from_slice(&key);
                Ok(key.len())
            });
            b.build()
        };
        let mut alice = starttls(connect(&server), pinned(b"alice")).unwrap();
        go(&mut alice);
        assert_eq!(alice.read(0, 4096).unwrap().len(), 4096, "{v:?}");
        drop(alice);
        let mut bob = starttls(connect(&server), pinned(b"bob")).unwrap();
        let r = bob.option(OPT_GO, &info_data(NAME, &[]));
        assert_eq!(r[0].kind, REP_ERR_UNKNOWN, "{v:?}");
    }
    assert_eq!(server.stats().peers.authorization_refusals, 2);
    finish(alloc, server);
}

fn x509_connector(ca: &X509, client: Option<&(X509, PKey<Private>)>) -> SslConnector {
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.cert_store_mut().add_cert(ca.clone()).unwrap();
    if let Some((c, k)) = client {
        b.set_certificate(c).unwrap();
        b.set_private_key(k).unwrap();
    }
    b.build()
}

#[test]
fn x509_sessions_verify_the_server_and_the_client() {
    let p = pki();
    let opts = ServerOptions {
        tls: Some(TlsConfig::x509(&p.server, true, TlsMode::Require).unwrap()),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut c = starttls(connect(&server), x509_connector(&p.ca, Some(&p.client))).unwrap();
    go(&mut c);
    assert_eq!(c.write(0, &[0x42u8; 65536], 0), 0);
    assert_eq!(c.read(0, 65536).unwrap(), vec![0x42u8; 65536]);
    drop(c);
    // No client certificate: refused (the failure shows on the first read
    // under TLS 1.3, when the server's alert arrives).
    let refused = match starttls(connect(&server), x509_connector(&p.ca, None)) {
        Err(_) => true,
        Ok(mut c) => {
            let _ = c.send_option(OPT_GO, &info_data(NAME, &[]));
            let mut b = [0u8; 1];
            !matches!(c.stream_mut().read(&mut b), Ok(1))
        }
    };
    assert!(refused, "a client without a certificate is refused");
    // A client that trusts another CA refuses the server.
    let other = pki();
    assert!(starttls(connect(&server), x509_connector(&other.ca, Some(&p.client))).is_err());
    finish(alloc, server);
}

#[test]
fn forced_tls_refuses_options_before_starttls_and_starttls_rules_hold() {
    let p = pki();
    let opts = ServerOptions {
        tls: Some(TlsConfig::x509(&p.server, false, TlsMode::Require).unwrap()),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    // Before TLS: LIST, INFO, GO and unknown options get TLS_REQD.
    let mut c = connect(&server);
    for opt in [OPT_LIST, OPT_GO, OPT_INFO, 99] {
        let data = if opt == OPT_LIST {
            Vec::new()
        } else {
            info_data(NAME, &[])
        };
        let r = c.option(opt, &data);
        let (o, kind) = (r[0].option, r[0].kind);
        assert_eq!((o, kind), (opt, REP_ERR_TLS_REQD));
    }
    // STARTTLS with data is invalid; then a proper one works; a second
    // one under TLS is invalid too.
    assert_eq!(c.option(OPT_STARTTLS, &[1])[0].kind, REP_ERR_INVALID);
    let mut t = starttls(c, x509_connector(&p.ca, None)).unwrap();
    assert_eq!(t.option(OPT_STARTTLS, &[])[0].kind, REP_ERR_INVALID);
    go(&mut t);
    assert_eq!(t.read(0, 4096).unwrap().len(), 4096);
    drop(t);
    // EXPORT_NAME before TLS cannot be refused: the server closes.
    let mut c = connect(&server);
    c.send_option(OPT_EXPORT_NAME, NAME.as_bytes()).unwrap();
    assert!(closed_within(c.stream_mut(), Duration::from_secs(5)));
    // ABORT before TLS is answered.
    let mut c = connect(&server);
    assert_eq!(c.option(OPT_ABORT, &[])[0].kind, REP_ACK);
    finish(alloc, server);
}

#[test]
fn starttls_without_tls_is_refused_by_policy_and_tls_on_serves_both() {
    let (alloc, server) = start(ServerOptions::default(), |_| {});
    let mut c = connect(&server);
    assert_eq!(c.option(OPT_STARTTLS, &[])[0].kind, REP_ERR_POLICY);
    go(&mut c);
    assert_eq!(c.read(0, 512).unwrap().len(), 512);
    drop(c);
    finish(alloc, server);

    let p = pki();
    let opts = ServerOptions {
        tls: Some(TlsConfig::x509(&p.server, false, TlsMode::On).unwrap()),
        ..ServerOptions::default()
    };
    let (alloc, server) = start(opts, |_| {});
    let mut plain = connect(&server);
    go(&mut plain);
    assert_eq!(plain.read(0, 512).unwrap().len(), 512);
    let mut t = starttls(connect(&server), x509_connector(&p.ca, None)).unwrap();
    go(&mut t);
    assert_eq!(t.read(0, 512).unwrap().len(), 512);
    drop((plain, t));
    finish(alloc, server);
}

#[test]
fn bad_tls_credentials_are_clear_errors() {
    let dir = TmpDir::new("bad");
    let e = TlsConfig::x509(&dir.0, false, TlsMode::Require).unwrap_err();
    assert!(e.to_string().contains("server-cert.pem is missing"), "{e}");
    let p = pki();
    std::fs::copy(&p.foreign_key, p.server.join("server-key.pem")).unwrap();
    let e = TlsConfig::x509(&p.server, false, TlsMode::Require).unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("server-key.pem") && e.contains("mismatch"),
        "{e}"
    );
    let f = dir.0.join("keys.psk");
    std::fs::write(&f, "alice:xyz\n").unwrap();
    let e = TlsConfig::psk(&f, TlsMode::Require).unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn a_handshake_whose_replies_are_not_read_waits_for_room_without_a_thread() {
    // A client on a Unix socket (fixed buffers of about 200 KiB) pipelining
    // 10 000 LISTs and reading none of the 450 KB of answers: once the
    // socket is full the handshake waits for room in the parking lot
    // (before, its watcher waited in a blocking write until the
    // handshake's deadline), reads nothing more meanwhile, and goes on as
    // the client reads.
    const N: usize = 10_000;
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(3) ^ 0x11).collect();
    let (alloc, queue) = crypt_queue(128 << 20, DISK, &key, 512);
    let path = std::env::temp_dir().join(format!("iopages-hostile-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listen = [Listen::Unix(path.clone())];
    let opts = ServerOptions::default();
    let server = Server::start_with(queue, ExportConfig::new(NAME), opts, &listen).unwrap();
    let mut c = Client::unix(&path);
    let mut w = c.stream().try_clone().unwrap();
    let lists: Vec<u8> = (0..N).flat_map(|_| option_bytes(OPT_LIST, &[])).collect();
    let writer = std::thread::spawn(move || w.write_all(&lists).unwrap());
    // The replies fill the socket; then the handshake stays parked.
    let t = Instant::now();
    while server.stats().parked_connections < 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "never parked");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let st = server.stats();
    assert_eq!((st.parked_connections, st.peers.handshakes_open), (1, 1));
    for i in 0..N {
        for want in [REP_SERVER, REP_ACK] {
            let r = c.read_option_reply().unwrap();
            assert_eq!((r.option, r.kind), (OPT_LIST, want), "LIST {i}");
        }
    }
    writer.join().unwrap();
    go(&mut c);
    assert_eq!(c.read(0, 4096).unwrap().len(), 4096);
    drop(c);
    finish(alloc, server);
}
