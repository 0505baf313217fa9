//! The remote client across store restarts: requests in flight are re-sent
//! on a new connection and nothing fails; the durability contract (a FLUSH
//! after a connection died holding acknowledged, unflushed writes fails,
//! once); reconnecting under TLS (X.509 and PSK); a store that comes back
//! different is refused; and the counters say what happened. Against
//! nbdkit, killed and started again on the same socket. Skipped with a
//! message without nbdkit, a failure under `CI=true`.

mod common;
use iopages_crypt::backend::Backend;
use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
use iopages_testkit::{need_tool, Reaped, TempDir};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An nbdkit on a Unix socket that can be killed and started again with
/// the same arguments.
struct Store {
    nbdkit: PathBuf,
    child: Option<Reaped>,
    _dir: TempDir,
    sock: PathBuf,
    args: Vec<String>,
}

impl Store {
    /// nbdkit with `args`, listening; `None` (skipped) without nbdkit
    /// outside CI. `{dir}` in an argument is the store's directory, where
    /// `disk` is a file of 64 MiB.
    fn start(who: &str, args: &[&str]) -> Option<Store> {
        let nbdkit = need_tool("nbdkit", who)?;
        let dir = TempDir::new("reconnect");
        let disk = std::fs::File::create(dir.join("disk")).unwrap();
        disk.set_len(64 << 20).unwrap();
        let sock = dir.join("nbd.sock");
        let args = args
            .iter()
            .map(|a| a.replace("{dir}", &dir.0.to_string_lossy()))
            .collect();
        let mut s = Store {
            nbdkit,
            child: None,
            _dir: dir,
            sock,
            args,
        };
        s.up();
        Some(s)
    }

    fn up(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.child = Some(common::nbdkit_on(&self.nbdkit, &self.sock, &args));
    }

    /// SIGKILL, waited for; the socket file goes too.
    fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            iopages_testkit::signal(&c.0, libc::SIGKILL);
            let _ = c.0.wait();
        }
        let _ = std::fs::remove_file(&self.sock);
    }

    fn uri(&self, query: &str) -> String {
        format!("nbd+unix:///?socket={}{query}", self.sock.display())
    }

    fn connect(&self, uri: &str, opts: &RemoteOptions) -> Arc<NbdRemote> {
        Arc::new(NbdRemote::connect(&RemoteSpec::parse(uri).unwrap(), opts).unwrap())
    }
}

/// The bytes thread `t` writes at block `b`, generation `g`.
fn block(t: u64, b: u64, g: u64, len: usize) -> Vec<u8> {
    let mut x = (t << 40) ^ (b << 20) ^ g ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `threads` threads write and read back their own blocks (FUA writes:
/// acknowledged means stored) until `stop`, every result checked.
///
/// **Returns:** each thread's operations.
fn load(
    remote: &Arc<NbdRemote>,
    threads: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..threads)
        .map(|t| {
            let (remote, stop) = (remote.clone(), stop.clone());
            std::thread::spawn(move || {
                const LEN: usize = 64 << 10;
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let b = ops % 16;
                    let off = (t * 16 + b) * LEN as u64;
                    let data = block(t, b, ops, LEN);
                    remote
                        .write_at_fua(off, &[&data])
                        .unwrap_or_else(|e| panic!("write: {e}"));
                    let mut back = vec![0u8; LEN];
                    remote
                        .read_at(off, &mut [&mut back])
                        .unwrap_or_else(|e| panic!("read: {e}"));
                    assert!(back == data, "thread {t}: block {b} read back wrong");
                    ops += 1;
                }
                ops
            })
        })
        .collect()
}

#[test]
fn a_store_restarted_under_load_loses_no_request() {
    let Some(mut store) = Store::start("reconnect under load", &["file", "{dir}/disk"]) else {
        return;
    };
    let remote = store.connect(&store.uri(""), &RemoteOptions::default());
    let stop = Arc::new(AtomicBool::new(false));
    let workers = load(&remote, 8, &stop);
    std::thread::sleep(Duration::from_millis(300));
    store.down();
    std::thread::sleep(Duration::from_millis(500));
    assert!(!remote.health().reachable, "{:?}", remote.health());
    store.up();
    let back = Instant::now();
    while !remote.health().reachable {
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "{:?}",
            remote.health()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = workers
        .into_iter()
        .map(|w| w.join().expect("no I/O error"))
        .sum();
    let h = remote.health();
    assert!(ops > 8, "{ops}");
    assert!(h.reconnects >= 1 && h.resent >= 1, "{h:?}");
    assert_eq!(h.connected, remote.connections(), "{h:?}");
    assert_eq!(
        (h.deadline_failures, h.unreachable_failures),
        (0, 0),
        "{h:?}"
    );
}

#[test]
fn a_flush_after_a_restart_fails_once_and_later_ones_succeed() {
    let Some(mut store) = Store::start("reconnect contract", &["memory", "16M"]) else {
        return;
    };
    let remote = store.connect(&store.uri(""), &RemoteOptions::default());
    // Flushed writes are not reported when the store restarts.
    remote.write_at(0, &[&[1u8; 4096]]).unwrap();
    remote.flush().unwrap();
    store.down();
    store.up();
    remote.read_at(0, &mut [&mut [0u8; 4096]]).unwrap();
    remote.flush().unwrap();
    // A write acknowledged, then the store restarts before a flush.
    remote.write_at(4096, &[&[2u8; 4096]]).unwrap();
    store.down();
    store.up();
    let e = remote.flush().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Other, "{e}");
    assert!(e.to_string().contains("may have lost them"), "{e}");
    // Once: writes after it, and a later flush, succeed.
    remote.write_at(8192, &[&[3u8; 4096]]).unwrap();
    remote.flush().unwrap();
    let mut back = [0u8; 4096];
    remote.read_at(8192, &mut [&mut back]).unwrap();
    assert_eq!(back, [3u8; 4096]);
    assert_eq!(remote.health().lost_flushes, 1);
    // FUA writes are stored when acknowledged: nothing to report.
    remote.write_at_fua(12288, &[&[4u8; 4096]]).unwrap();
    store.down();
    store.up();
    remote.flush().unwrap();
}

#[test]
fn tls_connections_reconnect_with_a_full_handshake() {
    let dir = TempDir::new("reconnect-tls");
    let pki = iopages_tools::write_pki(&dir.join("pki")).unwrap();
    let keys = dir.join("keys.psk");
    iopages_tools::write_psk(&keys, "alice").unwrap();
    let certs = format!("--tls-certificates={}", pki.server.display());
    let psk = format!("--tls-psk={}", keys.display());
    let x509 = format!(
        "&tls-certificates={}&tls-hostname=localhost",
        pki.client_no_cert.display()
    );
    let with_psk = format!("&tls-psk-file={}&tls-username=alice", keys.display());
    for (flag, query) in [(&certs, &x509), (&psk, &with_psk)] {
        let Some(mut store) =
            Store::start("reconnect tls", &["--tls=require", flag, "memory", "16M"])
        else {
            return;
        };
        let uri = store.uri(query).replacen("nbd+unix", "nbds+unix", 1);
        let remote = store.connect(&uri, &RemoteOptions::default());
        remote.write_at_fua(0, &[&[7u8; 4096]]).unwrap();
        store.down();
        store.up();
        // The memory store came back empty: the read is the new store's.
        let mut back = [9u8; 4096];
        remote.read_at(0, &mut [&mut back]).unwrap();
        assert_eq!(back, [0u8; 4096], "{uri}");
        assert!(remote.health().reconnects >= 1, "{uri}");
    }
}

#[test]
fn a_store_that_comes_back_different_is_refused() {
    let Some(mut store) = Store::start("reconnect different", &["memory", "16M"]) else {
        return;
    };
    let opts = RemoteOptions {
        reconnect_delay: Duration::from_secs(1),
        ..RemoteOptions::default()
    };
    let remote = store.connect(&store.uri(""), &opts);
    store.down();
    store.args = vec!["memory".into(), "32M".into()];
    store.up();
    std::thread::sleep(Duration::from_millis(1500));
    let e = remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotConnected, "{e}");
    assert!(e.to_string().contains("came back different"), "{e}");
    assert!(e.to_string().contains("33554432 bytes"), "{e}");
    let h = remote.health();
    assert!(!h.reachable && h.reconnects == 0, "{h:?}");
    // The right store again: served once more.
    store.down();
    store.args = vec!["memory".into(), "16M".into()];
    store.up();
    let t = Instant::now();
    while !remote.health().reachable {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{:?}",
            remote.health()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap();
}

#[test]
fn requests_wait_for_the_store_within_the_reconnect_delay_only() {
    let Some(mut store) = Store::start("reconnect delay", &["memory", "16M"]) else {
        return;
    };
    // The URI's reconnect-delay overrides the options'.
    let remote = store.connect(&store.uri("&reconnect-delay=1"), &RemoteOptions::default());
    store.down();
    let t = Instant::now();
    let e = remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(e.to_string().contains("reconnect-delay 1 s"), "{e}");
    // Past the window: at once.
    let t = Instant::now();
    assert!(remote.write_at(0, &[&[0u8; 512]]).is_err());
    assert!(t.elapsed() < Duration::from_millis(200));
    // Attempts go on past the window (every 2 s at most): the store is
    // served again as soon as it is back.
    store.up();
    let back = Instant::now();
    while !remote.health().reachable {
        assert!(
            back.elapsed() < Duration::from_secs(4),
            "{:?}",
            remote.health()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap();
    let h = remote.health();
    assert!(h.unreachable_failures >= 2, "{h:?}");
}
