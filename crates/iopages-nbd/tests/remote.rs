//! The NBD client backend (`iopages_nbd::remote`) against nbdkit: many
//! threads' I/O over several connections, flush, refusals before anything
//! is sent, read-only exports, a crypt target over the remote, and a
//! remote that dies or stops answering (errors within seconds, no hang).
//! Skipped with a message without nbdkit, a failure under `CI=true`.

mod common;
use common::iopages_server;
use iopages::PageAllocator;
use iopages_crypt::backend::Backend;
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
use iopages_crypt::XtsCipher;
use iopages_nbd::remote::{
    NbdRemote, RemoteAddress, RemoteOptions, RemoteSpec, DEFAULT_MAX_IN_FLIGHT,
};
use iopages_testkit::nbd_client::*;
use iopages_testkit::XorShift as Rng;
use iopages_testkit::{die_with_parent, need_tool, Reaped, TempDir};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// An nbdkit serving on a Unix socket in its own directory.
struct Nbdkit {
    child: Reaped,
    dir: TempDir,
    sock: PathBuf,
}

impl Nbdkit {
    /// `nbdkit -U SOCK --foreground --exit-with-parent ARGS…`, listening;
    /// `None` (skipped) without nbdkit outside CI.
    fn start(who: &str, args: &[&str]) -> Option<Nbdkit> {
        let nbdkit = need_tool("nbdkit", who)?;
        let dir = TempDir::new("remote");
        let sock = dir.join("nbd.sock");
        let child = common::nbdkit_on(&nbdkit, &sock, args);
        Some(Nbdkit { child, dir, sock })
    }

    fn spec(&self) -> RemoteSpec {
        RemoteSpec::parse(&format!("nbd+unix:///?socket={}", self.sock.display())).unwrap()
    }

    fn connect(&self, opts: &RemoteOptions) -> NbdRemote {
        NbdRemote::connect(&self.spec(), opts).unwrap()
    }
}

#[test]
fn uris_parse_and_bad_ones_are_refused() {
    let s = RemoteSpec::parse("nbd://storage.example:10900/images/vol1").unwrap();
    assert_eq!(
        s.address,
        RemoteAddress::Tcp {
            host: "storage.example".into(),
            port: 10900
        }
    );
    assert_eq!(s.export, "images/vol1");
    let s = RemoteSpec::parse("nbd://10.1.2.3").unwrap();
    assert_eq!(
        (s.address, s.export),
        (
            RemoteAddress::Tcp {
                host: "10.1.2.3".into(),
                port: 10809
            },
            String::new()
        )
    );
    let s = RemoteSpec::parse("nbd+unix:///disk?socket=/run/rbd.sock").unwrap();
    assert_eq!(s.address, RemoteAddress::Unix("/run/rbd.sock".into()));
    assert_eq!(s.export, "disk");
    let s = RemoteSpec::parse("nbds://h/e?tls-certificates=/etc/pki/nbd").unwrap();
    let tls = s.tls.expect("nbds:// requires TLS");
    assert_eq!(tls.certificates, Some(PathBuf::from("/etc/pki/nbd")));
    assert!(tls.verify_peer);
    assert!(RemoteSpec::parse("nbd://h/e").unwrap().tls.is_none());
    for (uri, why) in [
        ("nbd://h/e?tls-certificates=/x", "needs TLS: use nbds://"),
        ("nbds+unix:///e?tls-psk-file=/k", "needs ?socket=PATH"),
        ("nbd://h/e?foo=bar", "unknown query parameter"),
        ("nbd+unix:///e", "socket"),
        ("file:///tmp/x", "not supported"),
        ("nbd://h:99999", "bad port"),
    ] {
        let e = RemoteSpec::parse(uri).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{uri}");
        assert!(e.to_string().contains(why), "{uri}: {e}");
    }
}

#[test]
fn many_threads_write_and_read_back_over_several_connections() {
    let Some(k) = Nbdkit::start("remote many threads", &["memory", "64M"]) else {
        return;
    };
    let remote = Arc::new(k.connect(&RemoteOptions::default()));
    assert_eq!(remote.size_bytes(), 64 << 20);
    let info = remote.info();
    assert!(info.contains("67108864 bytes"), "{info}");
    if info.contains("multi-conn") {
        assert_eq!(remote.connections(), 4, "{info}");
    }
    // Each thread owns 8 MiB and keeps a model of it.
    const PART: usize = 8 << 20;
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let remote = remote.clone();
            std::thread::spawn(move || {
                let base = t * PART as u64;
                let mut model = vec![0u8; PART];
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t + 1) * 0x1234_5678));
                for round in 0..150 {
                    let sectors = 1 + rng.below(64) as usize;
                    let len = sectors * 512;
                    let off = rng.below(((PART - len) / 512) as u64 + 1) as usize * 512;
                    if round % 3 != 2 {
                        let mut data = vec![0u8; len];
                        rng.fill(&mut data);
                        // Two segments, cut at a sector.
                        let cut = rng.below(sectors as u64 + 1) as usize * 512;
                        let (a, b) = data.split_at(cut);
                        remote.write_at(base + off as u64, &[a, b]).unwrap();
                        model[off..off + len].copy_from_slice(&data);
                    } else {
                        let mut back = vec![0u8; len];
                        let (a, b) = back.split_at_mut(len / 2);
                        remote.read_at(base + off as u64, &mut [a, b]).unwrap();
                        assert!(back == model[off..off + len], "thread {t} round {round}");
                    }
                }
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    remote.flush().unwrap();
    for (t, model) in models.iter().enumerate() {
        let mut back = vec![0u8; PART];
        remote.read_at((t * PART) as u64, &mut [&mut back]).unwrap();
        assert!(back == *model, "thread {t}'s part reads back");
    }
}

#[test]
fn large_io_is_split_and_flush_reaches_the_file() {
    let Some(k) = Nbdkit::start("remote flush", &["memory", "1M"]) else {
        return;
    };
    drop(k);
    let dir = TempDir::new("remote-file");
    let file = dir.join("disk.img");
    std::fs::write(&file, vec![0u8; 48 << 20]).unwrap();
    let arg = format!("file={}", file.display());
    let Some(k) = Nbdkit::start("remote flush", &["file", &arg]) else {
        return;
    };
    let remote = k.connect(&RemoteOptions {
        connections: 2,
        ..RemoteOptions::default()
    });
    assert!(remote.info().contains("flush"), "{}", remote.info());
    // 40 MiB: more than one 32 MiB request each way.
    let mut rng = Rng(77);
    let mut data = vec![0u8; 40 << 20];
    rng.fill(&mut data);
    remote.write_at(4096, &[&data]).unwrap();
    remote.flush().unwrap();
    let on_disk = std::fs::read(&file).unwrap();
    assert!(on_disk[4096..4096 + data.len()] == data[..]);
    let mut back = vec![0u8; data.len()];
    remote.read_at(4096, &mut [&mut back]).unwrap();
    assert!(back == data);
}

#[test]
fn out_of_range_and_misaligned_io_is_refused_with_nothing_sent() {
    let dir = TempDir::new("remote-log");
    let log = dir.join("requests.log");
    let logfile = format!("logfile={}", log.display());
    let Some(k) = Nbdkit::start(
        "remote refusals",
        &[
            "--filter=log",
            "--filter=blocksize-policy",
            "memory",
            "1M",
            &logfile,
            "blocksize-minimum=512",
        ],
    ) else {
        return;
    };
    let remote = k.connect(&RemoteOptions::default());
    assert_eq!(remote.min_block_bytes(), 512, "{}", remote.info());
    let e = remote
        .write_at((1 << 20) - 512, &[&[1u8; 1024]])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("leaves the device"), "{e}");
    let e = remote
        .read_at(u64::MAX - 511, &mut [&mut [0u8; 512]])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let e = remote.write_at(100, &[&[1u8; 512]]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("512-byte blocks"), "{e}");
    let e = remote.read_at(0, &mut [&mut [0u8; 700]]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        remote.punch(1 << 20, 512).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        remote.discard(0, 100).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    drop(remote);
    let text = std::fs::read_to_string(&log).unwrap();
    for verb in ["Read", "Write", "Zero", "Trim"] {
        assert!(
            !text.lines().any(|l| l.contains(&format!(" {verb} "))),
            "a refused {verb} reached the remote:\n{text}"
        );
    }
    // The log filter does see requests that are sent.
    let remote = k.connect(&RemoteOptions::default());
    remote.write_at(0, &[&[1u8; 512]]).unwrap();
    drop(remote);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(" Write "), "{text}");
}

#[test]
fn a_read_only_export_refuses_writes_and_still_reads() {
    let Some(k) = Nbdkit::start("remote read-only", &["-r", "memory", "1M"]) else {
        return;
    };
    let remote = k.connect(&RemoteOptions::default());
    assert!(remote.is_read_only());
    assert!(remote.info().contains("read-only"), "{}", remote.info());
    let e = remote.write_at(0, &[&[1u8; 512]]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(
        remote.punch(0, 512).unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
    assert!(!remote.can_punch());
    let mut back = [9u8; 4096];
    remote.read_at(0, &mut [&mut back]).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    drop(remote);
    drop(k);
    // A writable export opened read-only.
    let Some(k) = Nbdkit::start("remote read-only", &["memory", "1M"]) else {
        return;
    };
    let remote = k.connect(&RemoteOptions {
        read_only: true,
        ..RemoteOptions::default()
    });
    let e = remote.write_at(0, &[&[1u8; 512]]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    assert_eq!(
        remote.discard(0, 512).unwrap_err().kind(),
        ErrorKind::PermissionDenied
    );
}

#[test]
fn punch_writes_zeroes_and_discard_trims() {
    let Some(k) = Nbdkit::start("remote punch", &["memory", "1M"]) else {
        return;
    };
    let remote = k.connect(&RemoteOptions::default());
    assert!(remote.can_punch(), "{}", remote.info());
    remote.write_at(0, &[&[7u8; 16384]]).unwrap();
    remote.punch(4096, 4096).unwrap();
    let mut back = vec![0u8; 16384];
    remote.read_at(0, &mut [&mut back]).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 7));
    assert!(back[4096..8192].iter().all(|&b| b == 0));
    assert!(back[8192..].iter().all(|&b| b == 7));
    remote.discard(8192, 8192).unwrap();
    remote.flush().unwrap();
}

#[test]
fn a_crypt_target_keeps_its_ciphertext_on_the_remote() {
    let Some(k) = Nbdkit::start("remote crypt target", &["memory", "16M"]) else {
        return;
    };
    let remote = Arc::new(k.connect(&RemoteOptions::default()));
    // The socket copies every write: the ciphertext is made in the caches.
    assert!(remote.reads_writes());
    let alloc = PageAllocator::builder()
        .size_bytes(32 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let key: Vec<u8> = (0u8..64).collect();
    let cipher = CipherPool::new(XtsCipher::new(&key, 4096, 0).unwrap(), 2).unwrap();
    let disk: Arc<dyn Backend> = remote.clone();
    let target = Arc::new(CryptTarget::new(&alloc, cipher, disk, TargetConfig::default()).unwrap());
    assert_eq!(target.size_bytes(), 16 << 20);
    let mut rng = Rng(5);
    let mut plain = vec![0u8; 1 << 20];
    rng.fill(&mut plain);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (target, plain) = (target.clone(), plain.clone());
            std::thread::spawn(move || {
                let at = t * (4 << 20);
                target.write(at, &plain).unwrap();
                let mut back = vec![0u8; plain.len()];
                target.read(at, &mut back).unwrap();
                assert!(back == plain, "thread {t} reads its plaintext back");
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    target.flush().unwrap();
    // The remote holds ciphertext, not the plaintext.
    let mut raw = vec![0u8; plain.len()];
    remote.read_at(0, &mut [&mut raw]).unwrap();
    assert!(raw != plain);
    assert!(raw.windows(64).all(|w| w != &plain[..64]));
    drop(target);
    alloc.leak_check().unwrap();
}

/// Receive within `limit` or fail the test (no hang).
fn within<T>(rx: &mpsc::Receiver<T>, limit: Duration, what: &str) -> T {
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what}: nothing within {limit:?} (a hang)"))
}

#[test]
fn a_killed_remote_fails_in_flight_and_later_requests_after_the_reconnect_delay() {
    let Some(mut k) = Nbdkit::start("remote killed", &["memory", "64M"]) else {
        return;
    };
    // Requests wait 1 s for the store to come back; it does not.
    let remote = Arc::new(k.connect(&RemoteOptions {
        timeout: Duration::from_secs(10),
        reconnect_delay: Duration::from_secs(1),
        ..RemoteOptions::default()
    }));
    let (tx, rx) = mpsc::channel();
    for t in 0..6u64 {
        let (remote, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut buf = vec![t as u8; 1 << 20];
            let mut ops = 0u64;
            let err = loop {
                let off = (t * 8 + ops % 8) << 20;
                let r = if ops.is_multiple_of(2) {
                    remote.write_at(off, &[&buf])
                } else {
                    remote.read_at(off, &mut [&mut buf])
                };
                if let Err(e) = r {
                    break e;
                }
                ops += 1;
            };
            let _ = tx.send((ops, err, Instant::now()));
        });
    }
    drop(tx);
    std::thread::sleep(Duration::from_millis(300));
    iopages_testkit::signal(&k.child.0, libc::SIGKILL);
    let killed = Instant::now();
    let _ = k.child.0.wait();
    for _ in 0..6 {
        let (ops, e, when) = within(&rx, Duration::from_secs(5), "an I/O thread");
        assert!(ops > 0, "the thread did I/O before the kill");
        let after = when.duration_since(killed);
        assert!(after >= Duration::from_millis(900), "{after:?}: {e}");
        assert!(after < Duration::from_secs(4), "{after:?}: {e}");
        assert_eq!(e.kind(), ErrorKind::NotConnected, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("nbd+unix://") && m.contains("reconnect-delay 1 s"),
            "{e}"
        );
    }
    let h = remote.health();
    assert!(!h.reachable && h.unreachable_failures >= 6, "{h:?}");
    // Later requests fail at once.
    let t = Instant::now();
    let e = remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1), "{e}");
    assert!(remote.write_at(0, &[&[0u8; 512]]).is_err());
    assert!(remote.flush().is_err());
    // Dropping it does not hang either.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(remote);
        let _ = tx.send(());
    });
    within(&rx, Duration::from_secs(5), "dropping the remote");
    drop(k.dir);
}

#[test]
fn a_remote_that_stops_answering_times_out() {
    let Some(mut k) = Nbdkit::start(
        "remote timeout",
        &["--filter=delay", "memory", "1M", "delay-read=60"],
    ) else {
        return;
    };
    // One connection: once it is given up nothing else can answer (with
    // several, later requests go to the connections still alive).
    let remote = Arc::new(k.connect(&RemoteOptions {
        timeout: Duration::from_secs(2),
        connections: 1,
        ..RemoteOptions::default()
    }));
    // Writes are not delayed.
    remote.write_at(0, &[&[3u8; 4096]]).unwrap();
    let (tx, rx) = mpsc::channel();
    for _ in 0..3 {
        let (remote, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let t = Instant::now();
            let r = remote.read_at(0, &mut [&mut [0u8; 4096]]);
            let _ = tx.send((r, t.elapsed()));
        });
    }
    for _ in 0..3 {
        let (r, took) = within(&rx, Duration::from_secs(8), "a delayed read");
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(took >= Duration::from_millis(1900), "{took:?}");
        assert!(took < Duration::from_secs(6), "{took:?}");
    }
    let h = remote.health();
    assert!(h.deadline_failures >= 3, "{h:?}");
    assert!(h.last_error.unwrap().contains("did not answer"));
    // The connection given up is replaced: writes (not delayed) work —
    // unless nbdkit itself fell over (its delay filter can abort on an
    // assertion when several delayed reads lose their connection).
    let t = Instant::now();
    let w = remote.write_at(0, &[&[3u8; 4096]]);
    if k.child.0.try_wait().unwrap().is_none() {
        w.unwrap();
        assert!(remote.health().reconnects >= 1);
    } else {
        eprintln!("nbdkit exited when the connection was given up: not checking the reconnect");
        assert!(t.elapsed() < Duration::from_secs(3), "{w:?}");
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(remote);
        let _ = tx.send(());
    });
    within(&rx, Duration::from_secs(5), "dropping the remote");
}

#[test]
fn servers_without_fixed_newstyle_or_no_zeroes_use_export_name() {
    // Mask 0: plain newstyle (EXPORT_NAME, 124 zero bytes after it);
    // mask 2: NO_ZEROES only; mask 1: fixed newstyle without NO_ZEROES.
    for mask in ["0", "2", "1"] {
        let flag = format!("--mask-handshake={mask}");
        let Some(k) = Nbdkit::start("remote export name", &[&flag, "memory", "1M"]) else {
            return;
        };
        let remote = k.connect(&RemoteOptions::default());
        assert_eq!(remote.size_bytes(), 1 << 20, "mask {mask}");
        remote.write_at(512, &[&[5u8; 1024]]).unwrap();
        let mut back = [0u8; 2048];
        remote.read_at(0, &mut [&mut back]).unwrap();
        assert!(back[..512].iter().all(|&b| b == 0), "mask {mask}");
        assert!(back[512..1536].iter().all(|&b| b == 5), "mask {mask}");
        assert!(back[1536..].iter().all(|&b| b == 0), "mask {mask}");
    }
    let Some(k) = Nbdkit::start("remote oldstyle", &["-o", "memory", "1M"]) else {
        return;
    };
    let e = NbdRemote::connect(&k.spec(), &RemoteOptions::default())
        .err()
        .expect("an oldstyle server is refused");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("oldstyle"), "{e}");
}

#[test]
fn error_replies_map_to_kinds_and_keep_the_connection() {
    let Some(k) = Nbdkit::start(
        "remote error replies",
        &[
            "--filter=error",
            "memory",
            "1M",
            "error-pread=EIO",
            "error-pread-rate=100%",
            "error-pwrite=ENOSPC",
            "error-pwrite-rate=100%",
        ],
    ) else {
        return;
    };
    let remote = k.connect(&RemoteOptions {
        connections: 1,
        ..RemoteOptions::default()
    });
    for _ in 0..3 {
        let e = remote.read_at(4096, &mut [&mut [0u8; 4096]]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Other, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("EIO") && msg.contains("READ of 4096 bytes at offset 4096"),
            "{msg}"
        );
        assert!(msg.contains("nbd+unix://"), "{msg}");
        let e = remote.write_at(0, &[&[1u8; 512]]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::StorageFull, "{e}");
        assert!(e.to_string().contains("ENOSPC"), "{e}");
    }
    // The connection is still good for what does not fail.
    remote.punch(0, 4096).unwrap();
    remote.flush().unwrap();
}

#[test]
fn eight_callers_share_one_request_slot_and_read_back_their_writes() {
    let Some(k) = Nbdkit::start("remote in-flight limit", &["memory", "8M"]) else {
        return;
    };
    let remote = Arc::new(k.connect(&RemoteOptions {
        connections: 1,
        max_in_flight: 1,
        ..RemoteOptions::default()
    }));
    assert_eq!(remote.connections(), 1);
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let remote = remote.clone();
            std::thread::spawn(move || {
                let at = t as u64 * (1 << 20);
                for i in 0..50u64 {
                    let data = vec![t ^ i as u8; 4096];
                    remote.write_at(at + i * 4096, &[&data]).unwrap();
                    let mut back = vec![0u8; 4096];
                    remote.read_at(at + i * 4096, &mut [&mut back]).unwrap();
                    assert!(back == data);
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
}

/// One round of the in-flight store: up to `limit` WRITEs read with
/// their payloads (the first waited for up to 10 s, each other one for
/// 150 ms); their cookies.
fn take_writes(s: &mut std::os::unix::net::UnixStream, limit: usize) -> Vec<u64> {
    use std::io::ErrorKind as K;
    let mut out = Vec::new();
    while out.len() < limit {
        // The first request of a round may take its time; the others are
        // given 150 ms to arrive.
        let wait = if out.is_empty() { 10_000 } else { 150 };
        s.set_read_timeout(Some(Duration::from_millis(wait)))
            .unwrap();
        let req = match Store::new(&mut *s).read_request() {
            Ok(req) => req,
            Err(e) if matches!(e.kind(), K::WouldBlock | K::TimedOut) => break,
            Err(e) => panic!("reading a request: {e}"),
        };
        assert_eq!(req.command, CMD_WRITE);
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Store::new(&mut *s).read_raw(req.length as usize).unwrap();
        out.push(req.cookie);
    }
    out
}

/// Nothing more may come for 150 ms while `out` requests are unanswered.
fn assert_nothing_more(s: &mut std::os::unix::net::UnixStream, out: usize) {
    use std::io::{ErrorKind as K, Read};
    s.set_read_timeout(Some(Duration::from_millis(150)))
        .unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Err(e) if matches!(e.kind(), K::WouldBlock | K::TimedOut) => {}
        other => panic!("a request beyond {out} in flight: {other:?}"),
    }
}

#[test]
fn the_in_flight_limit_is_never_exceeded() {
    const THREADS: usize = 6;
    const EACH: usize = 4;
    const LIMIT: usize = 2;
    // The server holds every reply until it has seen LIMIT requests
    // outstanding (or none came for 150 ms), then checks that nothing more
    // arrives for 150 ms before it answers them: with the limit at LIMIT
    // on one connection, a client may never have more out at once.
    let (_dir, spec, server) = fake_server(move |mut s| {
        accept_go(&mut s, 0);
        let mut answered = 0;
        let mut most = 0;
        while answered < THREADS * EACH {
            let out = take_writes(&mut s, LIMIT);
            assert_nothing_more(&mut s, out.len());
            most = most.max(out.len());
            for c in out {
                Store::new(&mut s).simple_reply(0, c, &[]).unwrap();
                answered += 1;
            }
        }
        assert_eq!(most, LIMIT, "the client never reached its limit");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        expect_disc(&mut s);
    });
    let remote = one_connection(&spec, LIMIT, Duration::from_secs(30));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let remote = remote.clone();
            std::thread::spawn(move || {
                for i in 0..EACH {
                    let at = ((t * EACH + i) * 4096) as u64;
                    remote.write_at(at, &[&[t as u8; 4096]]).unwrap();
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    drop(remote);
    server
        .join()
        .expect("the server never saw more than the limit in flight");
}

/// A scripted NBD server on a Unix socket: `script` runs on the accepted
/// connection, on a thread the caller joins to see its assertions.
fn fake_server(
    script: impl FnOnce(std::os::unix::net::UnixStream) + Send + 'static,
) -> (TempDir, RemoteSpec, std::thread::JoinHandle<()>) {
    let dir = TempDir::new("remote-fake");
    let sock = dir.join("fake.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        if let Ok((s, _)) = listener.accept() {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            script(s);
        }
    });
    let spec = RemoteSpec::parse(&format!("nbd+unix:///x?socket={}", sock.display())).unwrap();
    (dir, spec, server)
}

/// A client of `spec` over one connection with `max_in_flight` requests
/// and `timeout`, shared by the test's threads.
fn one_connection(spec: &RemoteSpec, max_in_flight: usize, timeout: Duration) -> Arc<NbdRemote> {
    let opts = RemoteOptions {
        connections: 1,
        max_in_flight,
        timeout,
        // The scripted servers serve one connection: nothing to wait for.
        reconnect_delay: Duration::ZERO,
        ..RemoteOptions::default()
    };
    Arc::new(NbdRemote::connect(spec, &opts).unwrap())
}

/// `n` threads each reading `len` bytes at `t * len` through `remote`;
/// each sends its result and how long the read took.
fn readers(
    remote: &Arc<NbdRemote>,
    n: usize,
    len: usize,
) -> mpsc::Receiver<(std::io::Result<()>, Duration)> {
    let (tx, rx) = mpsc::channel();
    for t in 0..n {
        let (remote, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; len];
            let start = Instant::now();
            let r = remote.read_at((t * len) as u64, &mut [&mut buf]);
            let _ = tx.send((r, start.elapsed()));
        });
    }
    rx
}

/// The scripted server's last read: the client's disconnect request.
fn expect_disc(s: &mut std::os::unix::net::UnixStream) {
    Store::new(s).expect_disconnect();
}

/// The server's side of the handshake up to the client's first option:
/// greeting (fixed newstyle, no zeroes), the client's flags, the first
/// option's number and data.
fn greet(s: &mut std::os::unix::net::UnixStream) -> (u32, Vec<u8>) {
    Store::new(s).greet_and_read_option()
}

/// The server's side up to transmission: greet, take the client's
/// NBD_OPT_GO and answer it: a 1 MiB export with `flags`, then ACK.
fn accept_go(s: &mut std::os::unix::net::UnixStream, flags: u16) {
    Store::new(s).accept_go(STORE_EXPORT_BYTES, flags);
}

#[test]
fn a_silent_server_times_out_the_handshake() {
    let (_dir, spec, _server) = fake_server(|s| {
        std::thread::sleep(Duration::from_secs(5));
        drop(s);
    });
    let t = Instant::now();
    let e = NbdRemote::connect(
        &spec,
        &RemoteOptions {
            timeout: Duration::from_secs(1),
            ..RemoteOptions::default()
        },
    )
    .err()
    .expect("no greeting");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

#[test]
fn go_refused_as_unsupported_falls_back_to_export_name() {
    use std::io::{Read, Write};
    let (_dir, spec, server) = fake_server(|mut s| {
        let (option, data) = greet(&mut s);
        assert_eq!(option, OPT_GO);
        // The export name, then one information request: block sizes.
        assert_eq!(&data[4..5], b"x");
        assert_eq!(&data[5..], &[0, 1, 0, 3]);
        s.write_all(&option_reply_bytes(OPT_GO, REP_ERR_UNSUP, b"no GO here"))
            .unwrap();
        let (option, name) = Store::new(&mut s).read_option().unwrap();
        assert_eq!(option, OPT_EXPORT_NAME);
        assert_eq!(name, b"x");
        let mut reply = (2u64 << 20).to_be_bytes().to_vec();
        reply.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_READ_ONLY).to_be_bytes());
        s.write_all(&reply).unwrap();
        // One read, answered with data; then the disconnect.
        let mut r = [0u8; REQUEST_BYTES];
        s.read_exact(&mut r).unwrap();
        let req = Request::parse(&r).unwrap();
        assert_eq!((req.command, req.offset, req.length), (CMD_READ, 4096, 512));
        s.write_all(&simple_reply_bytes(0, req.cookie)).unwrap();
        s.write_all(&[0xa5; 512]).unwrap();
        s.read_exact(&mut r).unwrap();
        assert_eq!(Request::parse(&r).unwrap().command, CMD_DISC);
    });
    let remote = NbdRemote::connect(&spec, &RemoteOptions::default()).unwrap();
    assert_eq!(remote.size_bytes(), 2 << 20);
    assert!(remote.is_read_only());
    let mut back = [0u8; 512];
    remote.read_at(4096, &mut [&mut back]).unwrap();
    assert_eq!(back, [0xa5; 512]);
    drop(remote);
    server
        .join()
        .expect("the server saw what it expected, DISC last");
}

#[test]
fn a_reply_with_a_bad_magic_gives_the_connection_up() {
    use std::io::{Read, Write};
    for structured in [false, true] {
        let (_dir, spec, server) = fake_server(move |mut s| {
            accept_go(&mut s, TFLAG_SEND_FLUSH);
            let mut r = [0u8; REQUEST_BYTES];
            s.read_exact(&mut r).unwrap();
            let req = Request::parse(&r).unwrap();
            let bad = if structured {
                structured_reply_bytes(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req.cookie, 0).to_vec()
            } else {
                let mut b = simple_reply_bytes(0, req.cookie);
                b[0] ^= 0xff;
                b.to_vec()
            };
            s.write_all(&bad).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let opts = RemoteOptions {
            reconnect_delay: Duration::ZERO,
            ..RemoteOptions::default()
        };
        let remote = NbdRemote::connect(&spec, &opts).unwrap();
        let e = remote.flush().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotConnected, "{e}");
        let want = if structured {
            "structured reply"
        } else {
            "bad magic"
        };
        assert!(e.to_string().contains(want), "{e}");
        let t = Instant::now();
        let e = remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotConnected, "{e}");
        assert!(e.to_string().contains(want), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        drop(remote);
        server.join().expect("the scripted server");
    }
}

// TLS to the remote: nbds:// and nbds+unix://, against nbdkit and against
// iopages's own server.

/// A CA, server and client certificates from the benchmark's generator
/// (`bench nbd --tls` serves with them): the server's directory
/// (server-cert.pem for localhost and 127.0.0.1), a client's, a client
/// without a certificate, and an unrelated CA's.
fn pki(dir: &TempDir) -> iopages_tools::Pki {
    iopages_tools::write_pki(&dir.join("pki")).unwrap()
}

/// nbdkit listening on 127.0.0.1 (a port found free first); `None`
/// (skipped) without nbdkit outside CI.
fn nbdkit_tcp(who: &str, args: &[&str]) -> Option<(Reaped, u16)> {
    let nbdkit = need_tool("nbdkit", who)?;
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cmd = Command::new(&nbdkit);
        cmd.args(["-i", "127.0.0.1", "-p", &port.to_string()])
            .args(["--foreground", "--exit-with-parent"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        die_with_parent(&mut cmd, libc::SIGKILL);
        let mut child = Reaped(cmd.spawn().expect("nbdkit starts"));
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if !matches!(child.0.try_wait(), Ok(None)) {
                break; // the port was taken meanwhile: another one
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some((child, port));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("nbdkit did not listen on any port tried");
}

/// Several threads write their own random 1 MiB (records far past one
/// TLS record, small and large requests) and read it back, over every
/// connection at once; then flush.
fn write_and_read_back(remote: &Arc<NbdRemote>) {
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let remote = remote.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0xabcd ^ (t + 1));
                let base = t * (2 << 20);
                for len in [4096usize, 8192, 100 << 10, 1 << 20] {
                    let mut data = vec![0u8; len];
                    rng.fill(&mut data);
                    let (a, b) = data.split_at(len / 2);
                    remote.write_at(base, &[a, b]).unwrap();
                    let mut back = vec![0u8; len];
                    remote.read_at(base, &mut [&mut back]).unwrap();
                    assert!(back == data, "thread {t}: {len} bytes read back");
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    remote.flush().unwrap();
}

fn refused(spec: &RemoteSpec) -> std::io::Error {
    let t = Instant::now();
    let e = NbdRemote::connect(
        spec,
        &RemoteOptions {
            timeout: Duration::from_secs(10),
            ..RemoteOptions::default()
        },
    )
    .err()
    .unwrap_or_else(|| panic!("{spec} was accepted"));
    assert!(t.elapsed() < Duration::from_secs(9), "{:?}", t.elapsed());
    e
}

/// nbds+unix:// to nbdkit `k` (X.509, client certificates `p`): served
/// with tls-hostname; without it refused, unless verification is off.
fn nbds_over_unix(k: &Nbdkit, p: &iopages_tools::Pki) {
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=localhost",
        k.sock.display(),
        p.client_no_cert.display()
    );
    let remote = Arc::new(
        NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default()).unwrap(),
    );
    assert!(remote.is_tls());
    let info = remote.info();
    assert!(
        info.contains("over TLS") && info.starts_with("nbds+unix://"),
        "{info}"
    );
    if info.contains("multi-conn") {
        assert_eq!(
            remote.connections(),
            4,
            "every connection did STARTTLS: {info}"
        );
    }
    write_and_read_back(&remote);
    drop(remote);
    // Without tls-hostname, a Unix socket has no name to check.
    let bare = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        k.sock.display(),
        p.client_no_cert.display()
    );
    let e = refused(&RemoteSpec::parse(&bare).unwrap());
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("tls-hostname=NAME"), "{e}");
    // ... unless verification is off.
    let unverified = format!("{bare}&tls-verify-peer=false");
    let remote = NbdRemote::connect(
        &RemoteSpec::parse(&unverified).unwrap(),
        &RemoteOptions::default(),
    )
    .unwrap();
    remote.write_at(0, &[&[7u8; 4096]]).unwrap();
    drop(remote);
}

/// nbds:// over TCP to an nbdkit with the server certificates `certs`
/// that checks client certificates too: the name in the URI is checked
/// against the certificate's; skipped without nbdkit outside CI.
fn nbds_over_tcp(certs: &str, p: &iopages_tools::Pki) {
    // TCP, the server checking client certificates too: the name in the
    // URI is checked against the certificate's.
    let Some((_child, port)) = nbdkit_tcp(
        "remote nbds x509 tcp",
        &["--tls=require", certs, "--tls-verify-peer", "memory", "16M"],
    ) else {
        return;
    };
    let uri = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        p.client.display()
    );
    let remote = Arc::new(
        NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default()).unwrap(),
    );
    assert!(remote.is_tls());
    write_and_read_back(&remote);
    drop(remote);
    // 127.0.0.1 is in the certificate too.
    let uri = format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        p.client.display()
    );
    NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default()).unwrap();
    // No client certificate: this server refuses.
    let uri = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        p.client_no_cert.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert!(e.to_string().contains("TLS"), "{e}");
}

#[test]
fn nbds_with_x509_over_unix_and_tcp_writes_and_reads_back() {
    let dir = TempDir::new("remote-x509");
    let p = pki(&dir);
    let certs = format!("--tls-certificates={}", p.server.display());
    let Some(k) = Nbdkit::start(
        "remote nbds x509",
        &["--tls=require", &certs, "memory", "16M"],
    ) else {
        return;
    };
    nbds_over_unix(&k, &p);
    nbds_over_tcp(&certs, &p);
}

#[test]
fn a_server_certificate_from_another_ca_or_for_another_name_is_refused() {
    let dir = TempDir::new("remote-x509-bad");
    let p = pki(&dir);
    let certs = format!("--tls-certificates={}", p.server.display());
    let Some(k) = Nbdkit::start(
        "remote nbds wrong CA",
        &["--tls=require", &certs, "memory", "1M"],
    ) else {
        return;
    };
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=localhost",
        k.sock.display(),
        p.foreign.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("the server's certificate was not accepted")
            && msg.contains(&p.foreign.join("ca-cert.pem").display().to_string()),
        "{msg}"
    );
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=other.example",
        k.sock.display(),
        p.client_no_cert.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.to_string().contains("not accepted") && e.to_string().contains("other.example"),
        "{e}"
    );
    // A directory without ca-cert.pem cannot verify anything.
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=localhost",
        k.sock.display(),
        empty.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("ca-cert.pem is missing"), "{e}");
}

#[test]
fn nbds_with_a_psk_writes_and_reads_back_and_a_wrong_key_is_refused() {
    let dir = TempDir::new("remote-psk");
    let keys = dir.join("keys.psk");
    iopages_tools::write_psk(&keys, "alice").unwrap();
    let psk = format!("--tls-psk={}", keys.display());
    let Some(k) = Nbdkit::start("remote nbds psk", &["--tls=require", &psk, "memory", "64M"])
    else {
        return;
    };
    let uri = format!(
        "nbds+unix:///?socket={}&tls-psk-file={}&tls-username=alice",
        k.sock.display(),
        keys.display()
    );
    let remote = Arc::new(
        NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default()).unwrap(),
    );
    assert!(remote.is_tls());
    write_and_read_back(&remote);
    // 40 MiB: more than one 32 MiB request each way, the socket full.
    let mut big = vec![0u8; 40 << 20];
    Rng(99).fill(&mut big);
    remote.write_at(16 << 20, &[&big]).unwrap();
    let mut back = vec![0u8; big.len()];
    remote.read_at(16 << 20, &mut [&mut back]).unwrap();
    assert!(back == big, "40 MiB read back over TLS");
    drop(remote);
    // An identity the file does not have: refused before connecting.
    let uri = format!(
        "nbds+unix:///?socket={}&tls-psk-file={}&tls-username=bob",
        k.sock.display(),
        keys.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(
        e.to_string().contains("no key for the username \"bob\""),
        "{e}"
    );
    // The right identity with another key: the handshake fails.
    let other = dir.join("other.psk");
    iopages_tools::write_psk(&other, "alice").unwrap();
    let uri = format!(
        "nbds+unix:///?socket={}&tls-psk-file={}&tls-username=alice",
        k.sock.display(),
        other.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert!(e.to_string().contains("TLS"), "{e}");
}

#[test]
fn nbds_to_a_server_without_tls_is_refused_and_never_continues_in_plaintext() {
    let Some(k) = Nbdkit::start("remote nbds plaintext", &["--tls=off", "memory", "1M"]) else {
        return;
    };
    let uri = format!(
        "nbds+unix:///?socket={}&tls-verify-peer=false",
        k.sock.display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.to_string().contains("does not offer TLS")
            && e.to_string().contains("never falls back to plaintext"),
        "{e}"
    );
    // On the wire: STARTTLS first; after the refusal, ABORT, never GO.
    let (dir, _, server) = fake_server(|mut s| {
        let (option, _) = greet(&mut s);
        assert_eq!(option, OPT_STARTTLS);
        use std::io::Write;
        s.write_all(&option_reply_bytes(
            OPT_STARTTLS,
            REP_ERR_UNSUP,
            b"no TLS here",
        ))
        .unwrap();
        let (option, _) = Store::new(&mut s).read_option().unwrap();
        assert_eq!(option, OPT_ABORT);
    });
    let uri = format!(
        "nbds+unix:///x?socket={}&tls-verify-peer=false",
        dir.join("fake.sock").display()
    );
    let e = refused(&RemoteSpec::parse(&uri).unwrap());
    assert!(e.to_string().contains("no TLS here"), "{e}");
    server.join().expect("STARTTLS, then ABORT");
}

#[test]
fn nbd_to_a_server_requiring_tls_says_to_use_nbds() {
    let dir = TempDir::new("remote-tls-reqd");
    let keys = dir.join("keys.psk");
    iopages_tools::write_psk(&keys, "alice").unwrap();
    let psk = format!("--tls-psk={}", keys.display());
    let Some(k) = Nbdkit::start(
        "remote nbd to tls",
        &["--tls=require", &psk, "memory", "1M"],
    ) else {
        return;
    };
    let e = refused(&k.spec());
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("requires TLS: use nbds://"), "{e}");
}

#[test]
fn iopages_own_tls_server_as_the_remote() {
    use iopages_nbd::{TlsConfig, TlsMode};
    let dir = TempDir::new("remote-own-tls");
    let p = pki(&dir);
    let disk: Arc<dyn Backend> = Arc::new(iopages_crypt::backend::RamDisk::new(16 << 20).unwrap());
    let tls = TlsConfig::x509(&p.server, true, TlsMode::Require).unwrap();
    let (_alloc, server) = iopages_server(disk, Some(tls));
    let port = server.tcp_addr().unwrap().port();
    let uri = format!(
        "nbds://localhost:{port}/vol?tls-certificates={}",
        p.client.display()
    );
    let remote = Arc::new(
        NbdRemote::connect(&RemoteSpec::parse(&uri).unwrap(), &RemoteOptions::default()).unwrap(),
    );
    assert_eq!(remote.size_bytes(), 16 << 20);
    assert!(remote.info().contains("over TLS"), "{}", remote.info());
    write_and_read_back(&remote);
    drop(remote);
    assert!(server.stats().tls_sessions >= 1);
    // Plaintext to it: the clear error.
    let plain = RemoteSpec::parse(&format!("nbd://127.0.0.1:{port}/vol")).unwrap();
    let e = refused(&plain);
    assert!(e.to_string().contains("requires TLS: use nbds://"), "{e}");
    server.shutdown();
}

// FUA passed through: a write with FUA reaches the remote as a WRITE with
// NBD_CMD_FLAG_FUA, and no FLUSH is sent for it.

/// An NBD client of `server`'s export "vol" over TCP, one connection.
fn client_of(server: &iopages_nbd::Server) -> NbdRemote {
    let port = server.tcp_addr().unwrap().port();
    NbdRemote::connect(
        &RemoteSpec::parse(&format!("nbd://127.0.0.1:{port}/vol")).unwrap(),
        &RemoteOptions {
            connections: 1,
            ..RemoteOptions::default()
        },
    )
    .unwrap()
}

/// The requests nbdkit's log filter saw: (verb, the line), verbs as the
/// filter names them (Write, Flush, ...).
fn logged(log: &std::path::Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            ["Read", "Write", "Flush", "Zero", "Trim"]
                .iter()
                .find(|v| l.contains(&format!(" {v} ")))
                .map(|v| (v.to_string(), l.to_string()))
        })
        .collect()
}

/// The requests logged past the first `skip`, once at least `n` are there
/// (the log may trail the reply a little), and a moment more for any
/// straggler.
fn logged_after(log: &std::path::Path, skip: usize, n: usize) -> Vec<(String, String)> {
    let t = Instant::now();
    while logged(log).len() < skip + n && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    logged(log).into_iter().skip(skip).collect()
}

#[test]
fn a_fua_write_reaches_the_remote_with_fua_and_no_flush() {
    let dir = TempDir::new("remote-fua");
    let log = dir.join("requests.log");
    let logfile = format!("logfile={}", log.display());
    let Some(k) = Nbdkit::start("remote fua", &["--filter=log", "memory", "16M", &logfile]) else {
        return;
    };
    let remote = Arc::new(k.connect(&RemoteOptions::default()));
    assert!(remote.native_fua(), "{}", remote.info());
    remote
        .write_at_fua(8192, &[&[3u8; 4096], &[4u8; 4096]])
        .unwrap();
    let seen = logged_after(&log, 0, 1);
    let writes: Vec<_> = seen.iter().filter(|(v, _)| v == "Write").collect();
    assert_eq!(writes.len(), 1, "{seen:?}");
    assert!(writes[0].1.contains("fua=1"), "{seen:?}");
    assert!(!seen.iter().any(|(v, _)| v == "Flush"), "{seen:?}");

    // Through iopages's own server: a client's WRITE with FUA is
    // encrypted and sent on with FUA; nothing flushes the remote.
    let (_alloc, server) = iopages_server(remote.clone(), None);
    let client = client_of(&server);
    assert!(client.native_fua(), "iopages offers FUA: {}", client.info());
    let before = logged(&log).len();
    client.write_at_fua(0, &[&[9u8; 12288]]).unwrap();
    client.write_at(65536, &[&[8u8; 4096]]).unwrap();
    let seen = logged_after(&log, before, 2);
    let writes: Vec<_> = seen.iter().filter(|(v, _)| v == "Write").collect();
    assert_eq!(writes.len(), 2, "{seen:?}");
    assert!(
        writes[0].1.contains("fua=1") && writes[0].1.contains("offset=0x0 "),
        "{seen:?}"
    );
    assert!(
        writes[1].1.contains("fua=0"),
        "a plain write stays plain: {seen:?}"
    );
    assert!(
        !seen.iter().any(|(v, _)| v == "Flush"),
        "no flush for FUA: {seen:?}"
    );
    // The data went through the cipher and back.
    let mut back = vec![0u8; 12288];
    client.read_at(0, &mut [&mut back]).unwrap();
    assert!(back.iter().all(|&b| b == 9));
    let mut raw = vec![0u8; 12288];
    remote.read_at(0, &mut [&mut raw]).unwrap();
    assert!(raw != back, "the remote holds ciphertext");
    drop(client);
    server.shutdown();
}

#[test]
fn without_fua_on_the_remote_a_fua_write_is_a_write_then_a_flush() {
    let dir = TempDir::new("remote-no-fua");
    let log = dir.join("requests.log");
    let logfile = format!("logfile={}", log.display());
    let Some(k) = Nbdkit::start(
        "remote no fua",
        &[
            "--filter=log",
            "--filter=fua",
            "memory",
            "1M",
            // The fua filter's default mode: FUA not advertised.
            &logfile,
        ],
    ) else {
        return;
    };
    let remote = Arc::new(k.connect(&RemoteOptions {
        connections: 1,
        timeout: Duration::from_secs(5),
        ..RemoteOptions::default()
    }));
    assert!(!remote.native_fua(), "{}", remote.info());
    remote.write_at_fua(0, &[&[5u8; 4096]]).unwrap();
    let seen = logged_after(&log, 0, 2);
    let verbs: Vec<&str> = seen.iter().map(|(v, _)| v.as_str()).collect();
    assert_eq!(verbs, ["Write", "Flush"], "{seen:?}");
    assert!(seen[0].1.contains("fua=0"), "{seen:?}");

    // Through iopages's own server on one store connection: a client's
    // FUA write is a write and then a flush, both done by a crypt worker
    // (a flush run where the write ended — the connection's reader —
    // would wait for a reply only that reader can read).
    let (_alloc, server) = iopages_server(remote.clone(), None);
    let client = client_of(&server);
    let before = logged(&log).len();
    let t = Instant::now();
    for i in 0..8u64 {
        client.write_at_fua(i * 4096, &[&[i as u8; 4096]]).unwrap();
    }
    let seen = logged_after(&log, before, 16);
    let verbs: Vec<&str> = seen.iter().map(|(v, _)| v.as_str()).collect();
    assert_eq!(verbs, ["Write", "Flush"].repeat(8), "{seen:?}");
    let h = remote.health();
    assert_eq!(h.deadline_failures + h.resent, 0, "{h:?}");
    eprintln!("8 FUA writes through the server in {:?}", t.elapsed());
    let mut back = vec![0u8; 4096];
    client.read_at(3 * 4096, &mut [&mut back]).unwrap();
    assert!(back.iter().all(|&b| b == 3));
    drop(client);
    server.shutdown();
}

#[test]
fn a_server_that_acks_starttls_and_then_stalls_or_misbehaves_is_given_up() {
    use std::io::{Read, Write};
    // ACK, then silence instead of the TLS handshake: the connect timeout.
    let (dir, _, server) = fake_server(|mut s| {
        let (option, _) = greet(&mut s);
        assert_eq!(option, OPT_STARTTLS);
        s.write_all(&option_reply_bytes(OPT_STARTTLS, REP_ACK, &[]))
            .unwrap();
        // Read the ClientHello and whatever follows, never answering,
        // until the client gives up and closes (not until this read's own
        // 20 s timeout: that would be a client that never let go).
        let mut rest = [0u8; 4096];
        loop {
            match s.read(&mut rest) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => panic!("the client never closed the connection: {e}"),
            }
        }
    });
    let uri = format!(
        "nbds+unix:///x?socket={}&tls-verify-peer=false",
        dir.join("fake.sock").display()
    );
    let t = Instant::now();
    let e = NbdRemote::connect(
        &RemoteSpec::parse(&uri).unwrap(),
        &RemoteOptions {
            timeout: Duration::from_secs(1),
            ..RemoteOptions::default()
        },
    )
    .err()
    .expect("no TLS handshake");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    server
        .join()
        .expect("the server saw STARTTLS first and the client close");
    // An oversized or malformed reply to STARTTLS: refused, not read.
    for (reply, len, why) in [
        (REP_ACK, 1u32 << 30, "option reply of"),
        (REP_ACK, 3, "acknowledged with 3 bytes"),
        (REP_INFO, 0, "reply 3 to NBD_OPT_STARTTLS"),
    ] {
        let (dir, _, server) = fake_server(move |mut s| {
            let (option, _) = greet(&mut s);
            assert_eq!(option, OPT_STARTTLS);
            let mut r = option_reply_bytes(OPT_STARTTLS, reply, &[]);
            r[16..20].copy_from_slice(&len.to_be_bytes());
            s.write_all(&r).unwrap();
            let _ = s.write_all(&[0u8; 3]);
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let uri = format!(
            "nbds+unix:///x?socket={}&tls-verify-peer=false",
            dir.join("fake.sock").display()
        );
        let e = refused(&RemoteSpec::parse(&uri).unwrap());
        assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
        server.join().unwrap();
    }
}

/// The bytes a scripted server returns for a read at `offset`: each byte
/// names its own position, so a reply put into the wrong caller's buffer
/// (or at the wrong place in it) shows.
fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i) ^ ((offset + i) >> 9)) as u8)
        .collect()
}

/// Read `n` requests of a scripted connection (none may be a write).
fn take_requests(s: &mut std::os::unix::net::UnixStream, n: usize) -> Vec<Request> {
    (0..n)
        .map(|_| {
            let req = Store::new(&mut *s).read_request().unwrap();
            assert_eq!(req.command, CMD_READ);
            req
        })
        .collect()
}

#[test]
fn many_reads_answered_out_of_order_each_reach_their_own_buffers() {
    use iopages_nbd::remote::RECV_BUFFER_BYTES;
    use std::io::Write;
    // 48 readers at once: small reads (many replies in one `read` of the
    // client), reads larger than the receive buffer (read past it), and
    // reads into several segments; the server answers them all in
    // reverse order, several replies per write, once every one is in.
    const N: usize = 48;
    let len_of = |t: usize| match t % 3 {
        0 => 4096,
        1 => 512,
        _ => RECV_BUFFER_BYTES + 3 * 4096,
    };
    let (_dir, spec, server) = fake_server(move |mut s| {
        accept_go(&mut s, 0);
        let mut reqs = take_requests(&mut s, N);
        reqs.reverse();
        for batch in reqs.chunks(5) {
            let mut out = Vec::new();
            for r in batch {
                out.extend_from_slice(&simple_reply_bytes(0, r.cookie));
                out.extend_from_slice(&pattern(r.offset, r.length as usize));
            }
            s.write_all(&out).unwrap();
        }
        expect_disc(&mut s);
    });
    let remote = one_connection(&spec, N, Duration::from_secs(10));
    let (tx, rx) = mpsc::channel();
    for t in 0..N {
        let (remote, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let len = len_of(t);
            let offset = (t as u64) * (16 << 10);
            // Three segments of unequal sizes for every other reader.
            let mut buf = vec![0u8; len];
            let r = if t % 2 == 0 {
                let (a, rest) = buf.split_at_mut(len / 4);
                let (b, c) = rest.split_at_mut(len / 8);
                remote.read_at(offset, &mut [a, b, c])
            } else {
                remote.read_at(offset, &mut [&mut buf])
            };
            drop(remote);
            let _ = tx.send((t, r, buf == pattern(offset, len)));
        });
    }
    drop(tx);
    let mut seen = [false; N];
    for _ in 0..N {
        let (t, r, right) = within(&rx, Duration::from_secs(10), "an out-of-order read");
        r.unwrap_or_else(|e| panic!("reader {t}: {e}"));
        assert!(right, "reader {t} got another request's bytes");
        seen[t] = true;
    }
    assert!(seen.iter().all(|&s| s));
    drop(Arc::try_unwrap(remote).ok().expect("every reader is done"));
    server.join().expect("the scripted server");
}

#[test]
fn a_connection_that_dies_inside_a_reply_fails_every_read_in_flight() {
    use std::io::Write;
    const N: usize = 12;
    // The server answers one read with its header and half its data, then
    // closes: the read being filled and every other read waiting fail at
    // once (no timeout), and so does everything after.
    let (_dir, spec, server) = fake_server(move |mut s| {
        accept_go(&mut s, 0);
        let reqs = take_requests(&mut s, N);
        let r = &reqs[N / 2];
        s.write_all(&simple_reply_bytes(0, r.cookie)).unwrap();
        s.write_all(&pattern(r.offset, r.length as usize / 2))
            .unwrap();
        drop(s);
    });
    let remote = one_connection(&spec, DEFAULT_MAX_IN_FLIGHT, Duration::from_secs(20));
    let started = Instant::now();
    let rx = readers(&remote, N, 8192);
    for _ in 0..N {
        let (r, _) = within(&rx, Duration::from_secs(5), "a read on a dead connection");
        let e = r.unwrap_err();
        assert_ne!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("nbd+unix://"), "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    let e = remote.read_at(0, &mut [&mut [0u8; 512]]).unwrap_err();
    assert_ne!(e.kind(), ErrorKind::TimedOut, "{e}");
    server.join().expect("the scripted server");
}

#[test]
fn a_reply_whose_data_stalls_times_out_its_read_and_the_others() {
    use std::io::Write;
    const N: usize = 6;
    // Header and a few bytes of one read's data, then silence with the
    // socket open: the read being filled gives up after the timeout (its
    // caller does not return while the reader may still write into its
    // buffer), and so do the reads waiting behind it.
    let (_dir, spec, server) = fake_server(move |mut s| {
        accept_go(&mut s, 0);
        let reqs = take_requests(&mut s, N);
        let r = &reqs[0];
        s.write_all(&simple_reply_bytes(0, r.cookie)).unwrap();
        s.write_all(&pattern(r.offset, 100)).unwrap();
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    });
    let remote = one_connection(&spec, DEFAULT_MAX_IN_FLIGHT, Duration::from_secs(1));
    let rx = readers(&remote, N, 4096);
    for _ in 0..N {
        let (r, took) = within(&rx, Duration::from_secs(6), "a stalled read");
        let e = r.unwrap_err();
        // Its own deadline, or (a read with a moment left when another's
        // deadline gave the connection up) no connection to re-send on.
        let kind = e.kind();
        assert!(
            kind == ErrorKind::TimedOut || kind == ErrorKind::NotConnected,
            "{e}"
        );
        assert!(e.to_string().contains("within 1s"), "{e}");
        assert!(took < Duration::from_secs(4), "{took:?}");
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(remote);
        let _ = tx.send(());
    });
    within(&rx, Duration::from_secs(5), "dropping the remote");
    server.join().expect("the scripted server");
}

/// Every block of `vol` written at once (the queue holds up to its
/// depth), then every block read at once; each reads back what was
/// written.
fn write_and_read_every_block(vol: &iopages_nbd::volume::Volume, blocks: u64) {
    let block = |i: u64| -> Arc<[u8]> { Arc::from(pattern(i * 4096 + 7, 4096)) };
    // Every block written at once (the queue holds up to its depth), then
    // every block read at once into buffers of the arena's pages.
    let (tx, rx) = mpsc::channel();
    for i in 0..blocks {
        let tx = tx.clone();
        vol.queue
            .submit_write(i * 4096, block(i), move |r| drop(tx.send((i, r))));
    }
    for _ in 0..blocks {
        let (i, r) = within(&rx, Duration::from_secs(20), "a queued write");
        r.unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    let (tx, rx) = mpsc::channel();
    for i in 0..blocks {
        let tx = tx.clone();
        vol.queue
            .submit_read_into(i * 4096, vec![0u8; 4096], move |r, buf| {
                drop(tx.send((i, r, buf)))
            });
    }
    for _ in 0..blocks {
        let (i, r, buf) = within(&rx, Duration::from_secs(20), "a queued read");
        r.unwrap_or_else(|e| panic!("read {i}: {e}"));
        assert!(*buf == *block(i), "block {i} reads back what was written");
    }
}

#[test]
fn a_remote_volume_keeps_many_requests_in_flight_and_leaks_no_page() {
    use iopages_crypt::luks::{self, FormatOptions, LuksVersion};
    use iopages_nbd::volume::{self, VolumeOptions, DEFAULT_REMOTE_WORKERS};
    let Some(nbdkit) = need_tool("nbdkit", "remote volume workers") else {
        return;
    };
    drop(nbdkit);
    let dir = TempDir::new("remote-volume");
    let img = dir.join("v.img");
    luks::format_path(
        &img,
        Some(8 << 20),
        b"pw",
        &FormatOptions::fast_for_tests(LuksVersion::Luks1),
    )
    .unwrap();
    let img_arg = format!("file={}", img.display());
    let k = Nbdkit::start("remote volume workers", &["file", &img_arg]).unwrap();
    let remote = Arc::new(k.connect(&RemoteOptions::default()));
    let health = {
        let r = Arc::clone(&remote);
        move || r.health()
    };
    let vol = volume::open_remote(
        "nbd+unix:///",
        remote,
        b"pw",
        &VolumeOptions {
            arena_bytes: 16 << 20,
            ..VolumeOptions::default()
        },
    )
    .unwrap();
    // A worker waits on the remote for each request it serves (those not
    // started on the submitting thread): a remote volume gets enough of
    // them to keep many requests in flight, however few cores there are.
    assert_eq!(vol.queue.workers(), DEFAULT_REMOTE_WORKERS);
    let blocks = vol.queue.target().size_bytes() / 4096;
    write_and_read_every_block(&vol, blocks);
    vol.queue.wait_idle();
    // Started on the submitting thread and ended by the connections'
    // readers (a request finding its connection's slots full goes to the
    // workers instead).
    let h = health();
    eprintln!("started {} of {} requests", h.started, 2 * blocks);
    assert!(
        h.started >= blocks,
        "started {} of {}",
        h.started,
        2 * blocks
    );
    let alloc = vol.alloc.clone();
    drop(vol);
    alloc.leak_check().unwrap();
    drop(k);
}

#[test]
fn a_unix_remote_that_accepts_nothing_times_out_the_connect() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let dir = TempDir::new("remote-backlog");
    let sock = dir.join("full.sock");
    // A listener with the smallest backlog that never accepts, its queue
    // filled by the test's own connections: a blocking connect would wait
    // for as long as it stays so.
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // SAFETY: listen on a descriptor the test owns.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let mut filling = Vec::new();
    loop {
        // SAFETY: a new descriptor, owned at once.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
        assert!(fd >= 0);
        // SAFETY: as above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain data; zero is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let path = sock.as_os_str().as_encoded_bytes();
        for (d, &b) in addr.sun_path.iter_mut().zip(path) {
            *d = b as libc::c_char;
        }
        // SAFETY: a live sockaddr_un of that size.
        let r = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r != 0 {
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN)
            );
            break;
        }
        filling.push(fd);
        assert!(filling.len() < 1000, "the backlog never filled");
    }
    let spec = RemoteSpec::parse(&format!("nbd+unix:///x?socket={}", sock.display())).unwrap();
    let t = Instant::now();
    let e = NbdRemote::connect(
        &spec,
        &RemoteOptions {
            timeout: Duration::from_secs(1),
            ..RemoteOptions::default()
        },
    )
    .err()
    .expect("nothing accepts");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}
