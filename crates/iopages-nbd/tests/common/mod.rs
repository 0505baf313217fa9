//! Helpers shared by the NBD test files: the volume a test server
//! serves (an arena, a RAM disk, an XTS cipher pool, the target and its
//! queue), a connection of the shared raw client
//! (`iopages_testkit::nbd_client`), nbdkit on a socket. Each test file
//! uses some of them, hence the module-wide allowance.
#![allow(dead_code)]

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::queue::{CryptQueue, QueueConfig};
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
use iopages_crypt::XtsCipher;
use iopages_testkit::nbd_client::Client;
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

/// A client of `server`'s TCP address past the greeting, the client's
/// flags sent (fixed newstyle, no zeroes): the shared raw client.
pub fn connect(server: &iopages_nbd::Server) -> Client {
    Client::tcp(server.tcp_addr().unwrap())
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
