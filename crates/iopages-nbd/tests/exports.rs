//! Several exports behind one server: listing, selecting by name (the
//! empty name is the first), volumes kept apart, per-export counters, and
//! lazy exports opened once by the first allowed client that asks — a
//! failure remembered for a backoff, then tried again — and the `allow`
//! rules that hide an export from the clients who may not use it.

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::target::TargetConfig;
use iopages_nbd::{
    AllowRule, Export, ExportConfig, ExportState, ExportVolume, Listen, Server, ServerOptions,
    OPEN_BACKOFF_FIRST,
};
use iopages_testkit::nbd_client::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::{connect, queue_over};

fn key(seed: u8) -> Vec<u8> {
    (0..64u8).map(|i| i.wrapping_mul(29) ^ seed).collect()
}

fn arena() -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(32 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap()
}

/// A volume of `bytes` over a RAM disk, in `alloc`'s arena.
fn volume(alloc: &PageAllocator, bytes: u64, seed: u8) -> ExportVolume {
    let disk: Arc<dyn Backend> = Arc::new(RamDisk::new(bytes).unwrap());
    ExportVolume::new(queue_over(
        alloc,
        disk,
        &key(seed),
        4096,
        TargetConfig::default(),
    ))
}

fn listen() -> Vec<Listen> {
    vec![Listen::Tcp("127.0.0.1:0".parse().unwrap())]
}

/// NBD_OPT_INFO or GO for `name`: the export's size, or the error
/// reply's type.
fn size_of(c: &mut Client, option: u32, name: &str) -> Result<u64, u32> {
    c.export_info(option, name, &[])
        .map(|e| e.size)
        .map_err(|r| r.kind)
}

#[test]
fn exports_are_listed_selected_by_name_and_kept_apart() {
    let (a1, a2) = (arena(), arena());
    let server = Server::start_exports(
        vec![
            Export::ready(ExportConfig::new("first"), volume(&a1, 4 << 20, 1)),
            Export::ready(ExportConfig::new("second"), volume(&a2, 8 << 20, 2)),
        ],
        ServerOptions::default(),
        &listen(),
    )
    .unwrap();
    assert_eq!(server.export_names(), vec!["first", "second"]);
    let mut c = connect(&server);
    assert_eq!(c.list(), vec!["first", "second"]);
    assert_eq!(
        size_of(&mut c, OPT_INFO, ""),
        Ok(4 << 20),
        "the empty name: the first"
    );
    assert_eq!(size_of(&mut c, OPT_INFO, "second"), Ok(8 << 20));
    assert_eq!(size_of(&mut c, OPT_INFO, "third"), Err(REP_ERR_UNKNOWN));
    assert_eq!(size_of(&mut c, OPT_GO, "second"), Ok(8 << 20));
    let data = vec![0x33u8; 8192];
    assert_eq!(c.write(4 << 20, &data, 0), 0, "past the first's end");
    assert_eq!(c.read(4 << 20, 8192), Ok(data.clone()));
    drop(c);
    let mut c = connect(&server);
    size_of(&mut c, OPT_GO, "first").unwrap();
    assert_eq!(c.write(0, &data, 0), 0);
    let first = c.read(0, 8192);
    assert_eq!(first, Ok(data.clone()));
    drop(c);
    let mut c = connect(&server);
    size_of(&mut c, OPT_GO, "second").unwrap();
    let second = c.read(0, 8192);
    assert_ne!(second, Ok(data), "the first's write is not in the second");
    drop(c);
    // Per-export counters, and the server's totals over both.
    std::thread::sleep(Duration::from_millis(100));
    let (s1, s2) = (
        server.export_stats("first").unwrap(),
        server.export_stats("second").unwrap(),
    );
    assert_eq!((s1.write.requests, s1.read.requests), (1, 1));
    assert_eq!((s2.write.requests, s2.read.requests), (1, 2));
    let all = server.stats();
    assert_eq!((all.write.requests, all.read.requests), (2, 3));
    assert_eq!(all.sessions, 3);
    assert!(server.export_stats("third").is_none());
    server.shutdown();
    a1.leak_check().unwrap();
    a2.leak_check().unwrap();
}

#[test]
fn a_lazy_export_opens_once_on_first_use_and_a_failure_is_kept() {
    let alloc = arena();
    let opened = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let (o, f, a) = (Arc::clone(&opened), Arc::clone(&failed), alloc.clone());
    let server = Server::start_exports(
        vec![
            Export::lazy(
                ExportConfig::new("lazy"),
                Box::new(move || {
                    o.fetch_add(1, Ordering::SeqCst);
                    // Slow, as a key derivation is: concurrent clients wait.
                    std::thread::sleep(Duration::from_millis(200));
                    Ok(volume(&a, 4 << 20, 3))
                }),
            ),
            Export::lazy(
                ExportConfig::new("broken"),
                Box::new(move || {
                    f.fetch_add(1, Ordering::SeqCst);
                    Err("the passphrase opens no key slot".into())
                }),
            ),
        ],
        ServerOptions::default(),
        &listen(),
    )
    .unwrap();
    let mut c = connect(&server);
    assert_eq!(c.list(), vec!["lazy", "broken"]);
    assert_eq!(opened.load(Ordering::SeqCst), 0, "LIST opens nothing");
    assert_eq!(server.export_is_open("lazy"), Some(false));
    // Four clients ask at once: one opening.
    let addr = server.tcp_addr().unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Client::tcp(addr);
                size_of(&mut c, OPT_INFO, "lazy")
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), Ok(4 << 20));
    }
    assert_eq!(opened.load(Ordering::SeqCst), 1);
    assert_eq!(server.export_is_open("lazy"), Some(true));
    // The broken one: an error each time, the opener run once.
    for _ in 0..3 {
        assert_eq!(size_of(&mut c, OPT_INFO, "broken"), Err(REP_ERR_UNKNOWN));
    }
    assert_eq!(failed.load(Ordering::SeqCst), 1);
    assert_eq!(server.export_is_open("broken"), Some(false));
    // EXPORT_NAME of the broken one closes the connection.
    c.send_option(OPT_EXPORT_NAME, b"broken").unwrap();
    assert!(c.closed());
    let mut c = connect(&server);
    assert_eq!(size_of(&mut c, OPT_GO, "lazy"), Ok(4 << 20));
    assert_eq!(c.write(0, &[9u8; 4096], 0), 0);
    assert_eq!(c.read(0, 4096), Ok(vec![9u8; 4096]));
    drop(c);
    server.shutdown();
    alloc.leak_check().unwrap();
}

/// A lazy export's opening (a key derivation: long work) runs on the
/// long-work thread, not on a watcher: while it goes on, other clients
/// get through their handshakes and are served; the client that asked
/// is answered once it is done.
#[test]
fn a_lazy_export_opens_off_the_watchers_while_others_are_served() {
    let alloc = arena();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let (began_tx, began) = std::sync::mpsc::channel::<String>();
    let a = alloc.clone();
    let server = Server::start_exports(
        vec![
            Export::lazy(
                ExportConfig::new("slow"),
                Box::new(move || {
                    let me = std::thread::current().name().unwrap_or("").to_string();
                    began_tx.send(me).unwrap();
                    // Held until the test lets it go, as a long derivation.
                    released.lock().unwrap().recv().unwrap();
                    Ok(volume(&a, 4 << 20, 4))
                }),
            ),
            Export::ready(ExportConfig::new("quick"), volume(&alloc, 4 << 20, 5)),
        ],
        ServerOptions::default(),
        &listen(),
    )
    .unwrap();
    let addr = server.tcp_addr().unwrap();
    let asker = std::thread::spawn(move || {
        let mut c = Client::tcp(addr);
        let size = size_of(&mut c, OPT_GO, "slow");
        (size, c.write(0, &[3u8; 4096], 0), c.read(0, 4096))
    });
    let on = began.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(on, "nbd-long-work", "the opening ran on a watcher");
    for _ in 0..20 {
        let mut c = connect(&server);
        assert_eq!(size_of(&mut c, OPT_GO, "quick"), Ok(4 << 20));
        assert_eq!(c.read(0, 4096).map(|d| d.len()), Ok(4096));
    }
    assert_eq!(server.export_is_open("slow"), Some(false));
    release.send(()).unwrap();
    let (size, wrote, read) = asker.join().unwrap();
    assert_eq!((size, wrote), (Ok(4 << 20), 0));
    assert_eq!(read, Ok(vec![3u8; 4096]));
    assert_eq!(server.export_is_open("slow"), Some(true));
    server.shutdown();
    alloc.leak_check().unwrap();
}

#[test]
fn a_failed_lazy_export_is_tried_again_after_its_backoff() {
    let alloc = arena();
    let tries = Arc::new(AtomicUsize::new(0));
    let (t, a) = (Arc::clone(&tries), alloc.clone());
    let server = Server::start_exports(
        vec![Export::lazy(
            ExportConfig::new("store"),
            Box::new(move || {
                // The store is down for the first two tries.
                if t.fetch_add(1, Ordering::SeqCst) < 2 {
                    return Err("cannot reach the store".into());
                }
                Ok(volume(&a, 4 << 20, 5))
            }),
        )],
        ServerOptions::default(),
        &listen(),
    )
    .unwrap();
    let mut c = connect(&server);
    assert_eq!(size_of(&mut c, OPT_INFO, "store"), Err(REP_ERR_UNKNOWN));
    // Within the first backoff (1 s): refused without trying again.
    assert_eq!(size_of(&mut c, OPT_INFO, "store"), Err(REP_ERR_UNKNOWN));
    assert_eq!(tries.load(Ordering::SeqCst), 1);
    assert_eq!(server.export_state("store"), Some(ExportState::Failed));
    std::thread::sleep(OPEN_BACKOFF_FIRST + Duration::from_millis(100));
    assert_eq!(size_of(&mut c, OPT_INFO, "store"), Err(REP_ERR_UNKNOWN));
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    // The backoff doubled: 2 s.
    std::thread::sleep(OPEN_BACKOFF_FIRST + Duration::from_millis(100));
    assert_eq!(size_of(&mut c, OPT_INFO, "store"), Err(REP_ERR_UNKNOWN));
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    std::thread::sleep(OPEN_BACKOFF_FIRST);
    assert_eq!(size_of(&mut c, OPT_GO, "store"), Ok(4 << 20));
    assert_eq!(tries.load(Ordering::SeqCst), 3);
    assert_eq!(server.export_state("store"), Some(ExportState::Open));
    assert_eq!(
        server.export_stats("store").unwrap().export.open_failures,
        2
    );
    assert_eq!(c.write(0, &[4u8; 4096], 0), 0);
    drop(c);
    server.shutdown();
    alloc.leak_check().unwrap();
}

#[test]
fn an_export_a_client_may_not_use_is_hidden_and_unknown_to_it() {
    let alloc = arena();
    let opened = Arc::new(AtomicUsize::new(0));
    let (o, a) = (Arc::clone(&opened), alloc.clone());
    let rule = |r: &str| vec![r.parse::<AllowRule>().unwrap()];
    let mut mine = ExportConfig::new("mine");
    mine.allow = rule("ip:127.0.0.0/8");
    let mut theirs = ExportConfig::new("theirs");
    theirs.allow = rule("ip:10.0.0.0/8");
    let server = Server::start_exports(
        vec![
            Export::ready(mine, volume(&alloc, 4 << 20, 6)),
            Export::lazy(
                theirs,
                Box::new(move || {
                    o.fetch_add(1, Ordering::SeqCst);
                    Ok(volume(&a, 4 << 20, 7))
                }),
            ),
            Export::ready(ExportConfig::new("public"), volume(&alloc, 4 << 20, 8)),
        ],
        ServerOptions::default(),
        &listen(),
    )
    .unwrap();
    let mut c = connect(&server);
    assert_eq!(c.list(), vec!["mine", "public"]);
    // Not allowed: told exactly what a missing export is told.
    let refused = c.option(OPT_INFO, &info_data("theirs", &[]));
    let missing = c.option(OPT_INFO, &info_data("nosuch", &[]));
    assert_eq!(refused[0].kind, REP_ERR_UNKNOWN);
    assert_eq!(missing[0].kind, REP_ERR_UNKNOWN);
    assert_eq!(
        String::from_utf8_lossy(&refused[0].data).replace("theirs", "X"),
        String::from_utf8_lossy(&missing[0].data).replace("nosuch", "X")
    );
    assert_eq!(size_of(&mut c, OPT_GO, "theirs"), Err(REP_ERR_UNKNOWN));
    assert_eq!(
        opened.load(Ordering::SeqCst),
        0,
        "opened for a client not allowed"
    );
    assert_eq!(server.stats().peers.authorization_refusals, 2);
    assert_eq!(size_of(&mut c, OPT_GO, "mine"), Ok(4 << 20));
    assert!(c.read(0, 4096).is_ok());
    // EXPORT_NAME of an export not allowed closes the connection.
    let mut c = connect(&server);
    c.send_option(OPT_EXPORT_NAME, b"theirs").unwrap();
    assert!(c.closed());
    drop(c);
    server.shutdown();
    alloc.leak_check().unwrap();
}

#[test]
fn two_exports_with_one_name_or_none_are_refused() {
    let alloc = arena();
    let e = Server::start_exports(
        vec![
            Export::ready(ExportConfig::new("x"), volume(&alloc, 1 << 20, 1)),
            Export::ready(ExportConfig::new("x"), volume(&alloc, 1 << 20, 2)),
        ],
        ServerOptions::default(),
        &listen(),
    )
    .err()
    .expect("refused");
    assert!(e.to_string().contains("two exports are named \"x\""), "{e}");
    let e = Server::start_exports(Vec::new(), ServerOptions::default(), &listen())
        .err()
        .expect("refused");
    assert!(e.to_string().contains("no export"), "{e}");
    alloc.leak_check().unwrap();
}

#[test]
fn shutdown_is_prompt_when_the_socket_file_was_removed_or_replaced() {
    let alloc = arena();
    let dir = std::env::temp_dir().join(format!("iopages-nbd-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for replace in [false, true] {
        let sock = dir.join("s.sock");
        let server = Server::start_exports(
            vec![Export::ready(
                ExportConfig::new("v"),
                volume(&alloc, 1 << 20, 1),
            )],
            ServerOptions::default(),
            &[Listen::Unix(sock.clone())],
        )
        .unwrap();
        std::fs::remove_file(&sock).unwrap();
        // Another listener now owns the path.
        let other = replace.then(|| std::os::unix::net::UnixListener::bind(&sock).unwrap());
        let t = std::time::Instant::now();
        server.shutdown();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "stop does not wait on the path"
        );
        assert_eq!(
            sock.exists(),
            replace,
            "only the server's own socket file is removed"
        );
        drop(other);
        let _ = std::fs::remove_file(&sock);
    }
    let _ = std::fs::remove_dir_all(&dir);
    alloc.leak_check().unwrap();
}

/// A server of one export on an inherited Unix socket: the test plays
/// the socket's owner (systemd), binds it in a directory of its own
/// (`tag`), keeps a copy and hands the server the other. Returns the
/// directory, the socket's path, the owner's copy and the server.
fn serve_inherited(
    alloc: &PageAllocator,
    tag: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    std::os::unix::net::UnixListener,
    Server,
) {
    let dir = std::env::temp_dir().join(format!("iopages-nbd-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("inherited.sock");
    let owner = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = Server::start_exports_on(
        vec![Export::ready(
            ExportConfig::new("v"),
            volume(alloc, 1 << 20, 1),
        )],
        ServerOptions::default(),
        &[],
        vec![iopages_nbd::Listener::Unix(owner.try_clone().unwrap())],
    )
    .unwrap();
    (dir, sock, owner, server)
}

#[test]
fn shutdown_is_prompt_with_an_inherited_socket_whose_file_was_removed() {
    use std::os::unix::net::UnixStream;
    let alloc = arena();
    let (dir, sock, owner, server) = serve_inherited(&alloc, "inh");
    // Served: the greeting.
    let c = UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    Client::greet(c).expect("a newstyle greeting");
    // The path goes (a second name of the socket stays, for the check
    // below): nothing can connect through it to wake the acceptor, and
    // stop must not wait for that.
    let alias = dir.join("alias.sock");
    std::fs::hard_link(&sock, &alias).unwrap();
    std::fs::remove_file(&sock).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        server.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("shutdown returns with the inherited socket's file gone");
    // The owner's socket still listens (nothing shut it down), and is
    // blocking again, as it was handed over.
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFL on a descriptor the test owns.
    let flags = unsafe { libc::fcntl(owner.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(flags & libc::O_NONBLOCK, 0, "the socket's mode is put back");
    let _client = UnixStream::connect(&alias).expect("the owner's socket still listens");
    owner
        .accept()
        .expect("and its connection reaches the owner");
    let _ = std::fs::remove_dir_all(&dir);
    alloc.leak_check().unwrap();
}

/// CPU time (user + system, in clock ticks) of this process's threads
/// named `nbd-accept/…`.
fn acceptors_cpu_ticks() -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("nbd-accept/") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis: state is the
        // first, utime and stime the 12th and 13th.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() > 12 {
                total += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
            }
        }
    }
    total
}

#[test]
fn an_inherited_socket_shut_down_by_its_owner_does_not_spin_the_acceptor() {
    use std::os::fd::AsRawFd;
    let alloc = arena();
    let (dir, _sock, owner, server) = serve_inherited(&alloc, "hup");
    // The owner shuts the socket down under the server: the listener
    // polls ready (hung up) from now on.
    // SAFETY: shutdown on a descriptor the test owns.
    let rc = unsafe { libc::shutdown(owner.as_raw_fd(), libc::SHUT_RDWR) };
    assert_eq!(rc, 0);
    std::thread::sleep(Duration::from_millis(100));
    let before = acceptors_cpu_ticks();
    std::thread::sleep(Duration::from_millis(1000));
    let spent = acceptors_cpu_ticks() - before;
    // A busy acceptor would take about a second (100 ticks); an idle one
    // none. Other tests' acceptors in this process add a little.
    assert!(
        spent < 30,
        "acceptors used {spent} ticks in one idle second"
    );
    let t = std::time::Instant::now();
    server.shutdown();
    assert!(t.elapsed() < Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
    alloc.leak_check().unwrap();
}

#[test]
fn a_failed_start_leaves_no_socket_file_behind() {
    let alloc = arena();
    let dir = std::env::temp_dir().join(format!("iopages-nbd-fail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("first.sock");
    // The second address is taken: binding it fails after the first
    // address's socket file was made.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = Server::start_exports(
        vec![Export::ready(
            ExportConfig::new("v"),
            volume(&alloc, 1 << 20, 1),
        )],
        ServerOptions::default(),
        &[
            Listen::Unix(sock.clone()),
            Listen::Tcp(taken.local_addr().unwrap()),
        ],
    )
    .err()
    .expect("the second address is in use");
    assert!(e.to_string().contains("127.0.0.1"), "{e}");
    assert!(
        !sock.exists(),
        "the first address's socket file was removed"
    );
    let _ = std::fs::remove_dir_all(&dir);
    alloc.leak_check().unwrap();
}
