//! Helpers shared by the NBD test files: the volume a test server
//! serves (an arena, a RAM disk, an XTS cipher pool, the target and its
//! queue) and the raw client's wire helpers. Each test file uses some
//! of them, hence the module-wide allowance.
#![allow(dead_code)]

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::queue::{CryptQueue, QueueConfig};
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
use iopages_crypt::XtsCipher;
use iopages_nbd::proto::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

/// An arena of `arena_bytes` (no huge pages) and a queue (depth 32, two
/// workers) over an encrypted RAM disk of `disk_bytes`: XTS with `key`
/// and `sector`-byte sectors, two ciphers in the pool.
pub fn crypt_queue(
    arena_bytes: u64,
    disk_bytes: u64,
    key: &[u8],
    sector: usize,
) -> (PageAllocator, Arc<CryptQueue<CipherPool>>) {
    let alloc = PageAllocator::builder()
        .size_bytes(arena_bytes)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let disk: Arc<dyn Backend> = Arc::new(RamDisk::new(disk_bytes).unwrap());
    let queue = queue_over(&alloc, disk, key, sector, TargetConfig::default());
    (alloc, queue)
}

/// A queue (depth 32, two workers) over `disk`, encrypted with XTS under
/// `key` in `sector`-byte sectors, its target set up with `cfg`.
pub fn queue_over(
    alloc: &PageAllocator,
    disk: Arc<dyn Backend>,
    key: &[u8],
    sector: usize,
    cfg: TargetConfig,
) -> Arc<CryptQueue<CipherPool>> {
    let cipher = CipherPool::new(XtsCipher::new(key, sector, 0).unwrap(), 2).unwrap();
    let target = Arc::new(CryptTarget::new(alloc, cipher, disk, cfg).unwrap());
    Arc::new(
        CryptQueue::new(
            target,
            QueueConfig {
                queue_depth: 32,
                workers: 2,
                preallocated_out: false,
            },
        )
        .unwrap(),
    )
}

/// Send one option: IHAVEOPT, the option, the data's length, the data.
pub fn send_option(s: &mut impl Write, option: u32, data: &[u8]) {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    s.write_all(&v).unwrap();
}

/// The next option reply: (option, reply type, data).
pub fn read_opt_reply(s: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u64::from_be_bytes(h[0..8].try_into().unwrap()),
        OPT_REPLY_MAGIC
    );
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut data = vec![0u8; len];
    s.read_exact(&mut data).unwrap();
    (
        u32::from_be_bytes(h[8..12].try_into().unwrap()),
        u32::from_be_bytes(h[12..16].try_into().unwrap()),
        data,
    )
}

/// The data of NBD_OPT_GO / NBD_OPT_INFO: the export name and the
/// information requests.
pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// The next simple reply: (error, cookie).
pub fn read_simple_reply(s: &mut impl Read) -> (u32, u64) {
    let mut h = [0u8; SIMPLE_REPLY_BYTES];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
    )
}

/// A structured reply chunk: (flags, type, cookie, payload).
pub struct Chunk {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

/// The next structured reply chunk (its magic checked).
pub fn read_chunk(s: &mut impl Read) -> Chunk {
    let mut h = [0u8; STRUCTURED_REPLY_BYTES];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        STRUCTURED_REPLY_MAGIC,
        "a structured reply chunk"
    );
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).unwrap();
    Chunk {
        flags: u16::from_be_bytes([h[4], h[5]]),
        kind: u16::from_be_bytes([h[6], h[7]]),
        cookie: u64::from_be_bytes(h[8..16].try_into().unwrap()),
        payload,
    }
}

/// A TCP connection to `server` past the handshake's greeting (20 s read
/// timeout), the client's flags sent: fixed newstyle, no zeroes.
pub fn connect(server: &iopages_nbd::Server) -> TcpStream {
    let mut s = TcpStream::connect(server.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

/// Send an option; every reply up to and including the final one (an
/// ACK or an error), as (reply type, data).
pub fn option_replies(
    s: &mut (impl Read + Write),
    option: u32,
    data: &[u8],
) -> Vec<(u32, Vec<u8>)> {
    send_option(s, option, data);
    let mut v = Vec::new();
    loop {
        let (o, kind, data) = read_opt_reply(s);
        assert_eq!(o, option);
        v.push((kind, data));
        if kind == REP_ACK || kind & REP_FLAG_ERROR != 0 {
            return v;
        }
    }
}

/// Send one request: its header, then `payload`.
pub fn send_request(s: &mut impl Write, request: Request, payload: &[u8]) {
    let mut v = request.encode().to_vec();
    v.extend_from_slice(payload);
    s.write_all(&v).unwrap();
}

/// iopages's own server on 127.0.0.1 exporting "vol": an XTS target
/// (4096-byte sectors) over `disk` in an arena of its own, with `tls`.
pub fn iopages_server(
    disk: Arc<dyn Backend>,
    tls: Option<iopages_nbd::TlsConfig>,
) -> (PageAllocator, iopages_nbd::Server) {
    use iopages_nbd::{ExportConfig, Listen, Server, ServerOptions};
    let alloc = PageAllocator::builder()
        .size_bytes(64 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let key: Vec<u8> = (0u8..64).map(|i| i ^ 0x5a).collect();
    let queue = queue_over(&alloc, disk, &key, 4096, TargetConfig::default());
    let server = Server::start_with(
        queue,
        ExportConfig::new("vol"),
        ServerOptions {
            tls,
            ..ServerOptions::default()
        },
        &[Listen::Tcp("127.0.0.1:0".parse().unwrap())],
    )
    .unwrap();
    (alloc, server)
}

/// `nbdkit -U SOCK --foreground --exit-with-parent ARGS…` (the tool at
/// `nbdkit`), waited for until its socket takes connections; killed when
/// dropped.
pub fn nbdkit_on(
    nbdkit: &std::path::Path,
    sock: &std::path::Path,
    args: &[&str],
) -> iopages_testkit::Reaped {
    let mut cmd = std::process::Command::new(nbdkit);
    cmd.arg("-U")
        .arg(sock)
        .args(["--foreground", "--exit-with-parent"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    iopages_testkit::die_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = iopages_testkit::Reaped(cmd.spawn().expect("nbdkit starts"));
    iopages_testkit::wait_for_socket(sock, Duration::from_secs(20), || match child.0.try_wait() {
        Ok(None) => Ok(()),
        other => Err(format!("nbdkit exited: {other:?}")),
    })
    .unwrap();
    child
}

/// A scripted store's greeting (fixed newstyle, no zeroes); the client's
/// flags.
pub fn store_greeting(s: &mut std::os::unix::net::UnixStream) -> u32 {
    let mut g = NBD_MAGIC.to_be_bytes().to_vec();
    g.extend_from_slice(&IHAVEOPT.to_be_bytes());
    g.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&g).unwrap();
    let mut f = [0u8; 4];
    s.read_exact(&mut f).unwrap();
    u32::from_be_bytes(f)
}
