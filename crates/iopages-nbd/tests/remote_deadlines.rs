//! One deadline per remote request (`iopages_nbd::remote`): submission +
//! `RemoteOptions::timeout` bounds the wait for a slot, for the writer,
//! every write of the request and the wait for its reply, whatever the
//! store does. Scripted stores on a Unix socket that stop reading, stop
//! replying, trickle (take 64 KiB every 500 ms, so every write call makes
//! progress) or answer each request just before a per-send timeout would
//! trip; and a `Server` over each stalled store stops within the deadline
//! plus a few seconds. Every wait is guarded by a thread, so a hang fails
//! the test instead of hanging it.

mod common;
use iopages::PageAllocator;
use iopages_crypt::backend::Backend;
use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
use iopages_testkit::nbd_client::{self, *};
use iopages_testkit::TempDir;
use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The remote's timeout in these tests: every request's deadline is its
/// submission plus this.
const T: Duration = Duration::from_secs(2);
/// The export's size.
const SIZE: u64 = 64 << 20;
/// The large write that cannot be sent in time.
const BIG: usize = 4 << 20;

/// Run `f` on a thread; its result within `limit`, else the test fails
/// (naming `what`) rather than hangs.
fn within<R: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what}: not done within {limit:?} (a hang)"))
}

/// A scripted store on a Unix socket: `script` runs on the accepted
/// connection (the socket stays open until it returns).
fn fake_store(script: impl FnOnce(UnixStream) + Send + 'static) -> (TempDir, RemoteSpec) {
    let dir = TempDir::new("remote-deadline");
    let sock = dir.join("store.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        if let Ok((s, _)) = listener.accept() {
            script(s);
        }
    });
    let spec = RemoteSpec::parse(&format!("nbd+unix:///x?socket={}", sock.display())).unwrap();
    (dir, spec)
}

/// The store's side of the handshake: greeting (fixed newstyle, no
/// zeroes), the client's flags, its NBD_OPT_GO answered with a
/// [`SIZE`]-byte export offering flush.
fn accept_go(s: &mut UnixStream) {
    nbd_client::Store::new(s).accept_go(SIZE, TFLAG_SEND_FLUSH);
}

/// Stores that misbehave after the handshake.
#[derive(Clone, Copy, Debug)]
enum Store {
    /// Reads nothing more (the socket stays open).
    StopsReading,
    /// Reads every request (and payload) and never replies.
    StopsReplying,
    /// Reads 64 KiB every 500 ms and never replies.
    Trickles,
}

impl Store {
    /// Start the store; the client's spec.
    fn start(self) -> (TempDir, RemoteSpec) {
        fake_store(move |mut s| {
            accept_go(&mut s);
            let mut buf = vec![0u8; 64 << 10];
            match self {
                Store::StopsReading => std::thread::sleep(Duration::from_secs(300)),
                Store::StopsReplying => while matches!(s.read(&mut buf), Ok(n) if n > 0) {},
                Store::Trickles => loop {
                    std::thread::sleep(Duration::from_millis(500));
                    if s.read_exact(&mut buf).is_err() {
                        return;
                    }
                },
            }
        })
    }
}

/// A client of `spec` over one connection, `max_in_flight` requests,
/// timeout [`T`].
fn client(spec: &RemoteSpec, max_in_flight: usize) -> Arc<NbdRemote> {
    let opts = RemoteOptions {
        connections: 1,
        max_in_flight,
        timeout: T,
        ..RemoteOptions::default()
    };
    Arc::new(NbdRemote::connect(spec, &opts).unwrap())
}

/// On a thread: a [`BIG`] write at 0 and, 100 ms later, a 4 KiB read at
/// 32 MiB through `remote`; each result with how long it took from its
/// submission.
type Timed = (std::io::Result<()>, Duration);
fn write_then_read(remote: &Arc<NbdRemote>) -> mpsc::Receiver<(&'static str, Timed)> {
    let (tx, rx) = mpsc::channel();
    let (r, t) = (remote.clone(), tx.clone());
    std::thread::spawn(move || {
        let start = Instant::now();
        let res = r.write_at(0, &[&vec![7u8; BIG]]);
        let _ = t.send(("write", (res, start.elapsed())));
    });
    let r = remote.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        let res = r.read_at(32 << 20, &mut [&mut [0u8; 4096]]);
        let _ = tx.send(("read", (res, start.elapsed())));
    });
    rx
}

/// Both requests of [`write_then_read`] fail with `TimedOut` within the
/// deadline + `slack` of their submission; the messages.
fn both_time_out(rx: &mpsc::Receiver<(&'static str, Timed)>, slack: Duration) -> Vec<String> {
    let mut msgs = Vec::new();
    for _ in 0..2 {
        let (what, (res, took)) = rx
            .recv_timeout(T + Duration::from_secs(3))
            .unwrap_or_else(|_| panic!("a request did not end by its deadline (a hang)"));
        let e = res.expect_err(what);
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{what}: {e}");
        assert!(took < T + slack, "{what}: {took:?} ({e})");
        msgs.push(format!("{what}: {e}"));
    }
    msgs
}

/// Drop `remote` (NBD_CMD_DISC, the readers joined) within a few seconds.
fn drop_within(remote: Arc<NbdRemote>) {
    within(Duration::from_secs(5), "dropping the remote", move || {
        drop(remote)
    });
}

#[test]
fn a_store_that_stops_reading_fails_the_stuck_write_and_the_read_behind_it() {
    let (_dir, spec) = Store::StopsReading.start();
    let remote = client(&spec, 64);
    // Nothing is taken: both end within a second of their deadline.
    let msgs = both_time_out(&write_then_read(&remote), Duration::from_secs(1));
    assert!(
        msgs.iter()
            .any(|m| m.contains("WRITE of 4194304 bytes at offset 0 not sent within")),
        "{msgs:?}"
    );
    // The connection is given up; a later request (on a reconnected
    // connection the store does not read either, or none) fails by its
    // deadline too.
    let t = Instant::now();
    assert!(remote.read_at(0, &mut [&mut [0u8; 4096]]).is_err());
    assert!(t.elapsed() < T + Duration::from_secs(1));
    drop_within(remote);
}

#[test]
fn a_store_that_stops_replying_fails_every_request_by_its_deadline() {
    let (_dir, spec) = Store::StopsReplying.start();
    // One slot: the requests after the first wait for it, within the
    // same deadline.
    let remote = client(&spec, 1);
    let (tx, rx) = mpsc::channel();
    for i in 0..4u64 {
        let (r, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let res = r.read_at(i << 20, &mut [&mut [0u8; 4096]]);
            let _ = tx.send((res, start.elapsed()));
        });
    }
    for _ in 0..4 {
        let (res, took) = rx
            .recv_timeout(T + Duration::from_secs(3))
            .expect("a read did not end by its deadline (a hang)");
        let e = res.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(took < T + Duration::from_secs(2), "{took:?} ({e})");
    }
    drop_within(remote);
}

#[test]
fn a_request_waiting_for_a_slot_is_answered_or_fails_by_its_deadline() {
    // The store answers each read 1.5 s after it arrives (under the
    // timeout each time), one slot: the fourth read, submitted with the
    // first, would be answered after 6 s; its deadline ends it at 2 s.
    let (_dir, spec) = fake_store(|mut s| {
        accept_go(&mut s);
        let mut s = nbd_client::Store::new(s);
        while let Ok(req) = s.read_request() {
            if req.command == CMD_DISC {
                return;
            }
            std::thread::sleep(Duration::from_millis(1500));
            let data = vec![0u8; req.length as usize];
            if s.simple_reply(0, req.cookie, &data).is_err() {
                return;
            }
        }
    });
    let remote = client(&spec, 1);
    let (tx, rx) = mpsc::channel();
    for i in 0..4u64 {
        let (r, tx) = (remote.clone(), tx.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let res = r.read_at(i << 20, &mut [&mut [0u8; 4096]]);
            let _ = tx.send((res, start.elapsed()));
        });
    }
    let mut failed = 0;
    for _ in 0..4 {
        let (res, took) = rx
            .recv_timeout(T + Duration::from_secs(3))
            .expect("a read did not end by its deadline (a hang)");
        assert!(took < T + Duration::from_secs(2), "{took:?} ({res:?})");
        if let Err(e) = res {
            assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
            failed += 1;
        }
    }
    assert!(failed >= 2, "{failed} reads failed");
    drop_within(remote);
}

#[test]
fn a_trickling_store_fails_a_large_write_by_its_deadline_though_each_send_progresses() {
    let (_dir, spec) = Store::Trickles.start();
    let remote = client(&spec, 64);
    let msgs = both_time_out(&write_then_read(&remote), Duration::from_secs(2));
    assert!(
        msgs.iter().any(|m| m.contains("not sent within")),
        "{msgs:?}"
    );
    drop_within(remote);
}

/// A `Server` exporting "vol" on 127.0.0.1: XTS over `store`'s remote
/// (4096-byte sectors, the remote's only handle); a client connected and
/// past NBD_OPT_GO.
fn server_over(store: Store) -> (TempDir, PageAllocator, iopages_nbd::Server, Client) {
    let (dir, spec) = store.start();
    let remote: Arc<dyn Backend> = Arc::new(
        NbdRemote::connect(
            &spec,
            &RemoteOptions {
                connections: 1,
                timeout: T,
                ..RemoteOptions::default()
            },
        )
        .unwrap(),
    );
    let (alloc, server) = common::iopages_server(remote, None);
    let mut c = common::connect(&server);
    let replies = c.option(OPT_GO, &info_data("vol", &[]));
    assert_eq!(replies.last().unwrap().kind, REP_ACK);
    (dir, alloc, server, c)
}

/// A client's [`BIG`] write in flight to a server over `store`, then the
/// server stops within the deadline + 3 s.
fn server_stops_within_the_deadline(store: Store) {
    let (_dir, _alloc, server, mut c) = server_over(store);
    let req = Request {
        flags: 0,
        command: CMD_WRITE,
        cookie: 1,
        offset: 0,
        length: BIG as u32,
    };
    c.send_request(req, &vec![5u8; BIG]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    within(T + Duration::from_secs(3), "the server's stop", move || {
        server.shutdown()
    });
    eprintln!("{store:?}: the server stopped in {:?}", t.elapsed());
    drop(c);
}

#[test]
fn a_server_over_a_store_that_stops_reading_stops_within_the_deadline() {
    server_stops_within_the_deadline(Store::StopsReading);
}

#[test]
fn a_server_over_a_store_that_stops_replying_stops_within_the_deadline() {
    server_stops_within_the_deadline(Store::StopsReplying);
}

#[test]
fn a_server_over_a_trickling_store_stops_within_the_deadline() {
    server_stops_within_the_deadline(Store::Trickles);
}
