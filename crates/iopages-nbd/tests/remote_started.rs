//! Requests started without a waiting thread (the remote client's
//! `AsyncIo`): sent by the caller, ended once by the connection's reader
//! — or by the sender, or by the reader's sweep when the connection dies.
//! Scripted stores on a Unix socket answer, fail with EIO, reset the
//! connection in the middle of a READ's data, stop answering, stop
//! reading, or answer a WRITE before reading its payload. Every wait is
//! bounded, so a hang fails the test instead of hanging it; the only
//! timings asserted are liveness bounds and "not before the deadline".

use iopages_crypt::async_io::{Outcome, ReadInto, Segments};
use iopages_crypt::backend::Backend;
use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
use iopages_testkit::nbd_client::{self, *};
use iopages_testkit::TempDir;
use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The remote's timeout: every request's deadline is its start plus this.
const T: Duration = Duration::from_secs(2);
/// The export's size.
const SIZE: u64 = 16 << 20;
/// Requests at or past this offset are answered with EIO by the memory
/// store.
const FAILING: u64 = 8 << 20;

/// A scripted store on a Unix socket: `script` runs on the first
/// connection; later ones (reconnects) are refused.
fn fake_store(script: impl FnOnce(UnixStream) + Send + 'static) -> (TempDir, RemoteSpec) {
    let dir = TempDir::new("remote-started");
    let sock = dir.join("store.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            nbd_client::Store::new(&mut s).accept_go(SIZE, TFLAG_SEND_FLUSH);
            drop(listener);
            script(s);
        }
    });
    let spec = RemoteSpec::parse(&format!("nbd+unix:///x?socket={}", sock.display())).unwrap();
    (dir, spec)
}

/// A client over one connection, deadline [`T`].
fn client(spec: &RemoteSpec) -> NbdRemote {
    let opts = RemoteOptions {
        connections: 1,
        max_in_flight: 64,
        timeout: T,
        reconnect_delay: Duration::from_millis(200),
        ..RemoteOptions::default()
    };
    NbdRemote::connect(spec, &opts).unwrap()
}

/// How a started request ended.
#[derive(Debug)]
enum Ended {
    /// Done: a READ's data (empty for a WRITE).
    Ok(Vec<u8>),
    Again(String),
    Failed(ErrorKind, String),
}

fn ended(o: Outcome, data: Vec<u8>) -> Ended {
    match o {
        Outcome::Done(Ok(())) => Ended::Ok(data),
        Outcome::Done(Err(e)) => Ended::Failed(e.kind(), e.to_string()),
        Outcome::Again(e) => Ended::Again(e.to_string()),
    }
}

struct Bytes(Vec<u8>);

impl Segments for Bytes {
    fn segments(&self) -> Vec<&[u8]> {
        vec![&self.0]
    }
}

struct Into {
    tag: u64,
    buf: Vec<u8>,
    tx: Sender<(u64, Ended, Instant)>,
}

impl ReadInto for Into {
    fn buf(&mut self) -> &mut [u8] {
        &mut self.buf
    }
    fn end(self: Box<Self>, outcome: Outcome) {
        let _ = self
            .tx
            .send((self.tag, ended(outcome, self.buf), Instant::now()));
    }
}

type Ends = (
    Sender<(u64, Ended, Instant)>,
    Receiver<(u64, Ended, Instant)>,
);

fn start_write(
    r: &NbdRemote,
    tx: &Sender<(u64, Ended, Instant)>,
    tag: u64,
    offset: u64,
    data: Vec<u8>,
) {
    let a = r.async_io().expect("a remote starts requests");
    let tx = tx.clone();
    let end = Box::new(move |o| {
        let _ = tx.send((tag, ended(o, Vec::new()), Instant::now()));
    });
    a.start_write(offset, Arc::new(Bytes(data)), false, end);
}

fn start_read(
    r: &NbdRemote,
    tx: &Sender<(u64, Ended, Instant)>,
    tag: u64,
    offset: u64,
    len: usize,
) {
    let a = r.async_io().expect("a remote starts requests");
    let into = Into {
        tag,
        buf: vec![0; len],
        tx: tx.clone(),
    };
    a.start_read(offset, Box::new(into));
}

/// The ends of `n` requests, each within `limit`; then no other end
/// comes (none ends twice).
fn ends(
    rx: &Receiver<(u64, Ended, Instant)>,
    n: usize,
    limit: Duration,
) -> Vec<(u64, Ended, Instant)> {
    let mut v: Vec<_> = (0..n)
        .map(|i| {
            rx.recv_timeout(limit)
                .unwrap_or_else(|_| panic!("request end {i} of {n} did not come within {limit:?}"))
        })
        .collect();
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "a request ended twice"
    );
    v.sort_by_key(|e| e.0);
    let tags: Vec<u64> = v.iter().map(|e| e.0).collect();
    let mut unique = tags.clone();
    unique.dedup();
    assert_eq!(tags, unique, "a request ended twice");
    v
}

/// A store that keeps the export in memory and answers every request,
/// with EIO at and past [`FAILING`].
fn memory_store(s: UnixStream) {
    let mut mem = vec![0u8; SIZE as usize];
    let mut st = nbd_client::Store::new(s);
    while let Ok(r) = st.read_request() {
        let (at, n) = (r.offset as usize, r.length as usize);
        let errno = if r.offset >= FAILING { 5 } else { 0 };
        let sent = match r.command {
            CMD_WRITE => {
                let data = st.read_raw(n).unwrap();
                if errno == 0 {
                    mem[at..at + n].copy_from_slice(&data);
                }
                st.simple_reply(errno, r.cookie, &[])
            }
            CMD_READ if errno == 0 => st.simple_reply(0, r.cookie, &mem[at..at + n]),
            CMD_DISC => return,
            _ => st.simple_reply(errno, r.cookie, &[]),
        };
        if sent.is_err() {
            return;
        }
    }
}

#[test]
fn started_reads_and_writes_end_once_with_the_stores_answers_and_errors() {
    let (_dir, spec) = fake_store(memory_store);
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    for i in 0..32u64 {
        start_write(&r, &tx, i, i * 4096, vec![i as u8 + 1; 4096]);
    }
    start_write(&r, &tx, 32, FAILING, vec![9; 4096]);
    for (tag, ended, _) in ends(&rx, 33, T * 2) {
        match (tag, ended) {
            (32, Ended::Failed(kind, msg)) => {
                assert_eq!(kind, ErrorKind::Other);
                assert!(
                    msg.contains("WRITE of 4096 bytes at offset 8388608") && msg.contains("EIO"),
                    "{msg}"
                );
            }
            (_, Ended::Ok(_)) if tag < 32 => {}
            (tag, e) => panic!("write {tag}: {e:?}"),
        }
    }
    for i in 0..32u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    start_read(&r, &tx, 32, FAILING + 4096, 4096);
    for (tag, ended, _) in ends(&rx, 33, T * 2) {
        match (tag, ended) {
            (32, Ended::Failed(_, msg)) => {
                assert!(msg.contains("READ") && msg.contains("EIO"), "{msg}")
            }
            (_, Ended::Ok(data)) if tag < 32 => {
                assert!(data.iter().all(|&b| b == tag as u8 + 1), "read {tag}")
            }
            (tag, e) => panic!("read {tag}: {e:?}"),
        }
    }
    let h = r.health();
    assert_eq!(h.started, 66, "every request started on the connection");
    assert_eq!(h.resent + h.deadline_failures, 0);
    // The blocking path still reads what the started writes wrote.
    let mut back = vec![0u8; 4096];
    r.read_at(5 * 4096, &mut [&mut back]).unwrap();
    assert!(back.iter().all(|&b| b == 6));
}

#[test]
fn a_connection_reset_mid_reply_ends_every_started_request_again() {
    let (_dir, spec) = fake_store(|s| {
        let mut st = nbd_client::Store::new(s);
        let first = st.read_request().unwrap();
        for _ in 0..2 {
            st.read_request().unwrap();
        }
        // Half of the first READ's data, then the connection is reset.
        let _ = st.simple_reply(0, first.cookie, &[7u8; 2048]);
        std::thread::sleep(Duration::from_millis(50));
    });
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    let t0 = Instant::now();
    for i in 0..3u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    for (tag, ended, at) in ends(&rx, 3, T * 2) {
        match ended {
            Ended::Again(msg) => assert!(
                at < t0 + T,
                "read {tag} ended Again past its deadline: {msg}"
            ),
            e => panic!("read {tag}: {e:?}"),
        }
    }
    assert_eq!(r.health().resent, 3, "each goes again on the blocking path");
    // With no connection serving, a new start is declined at once.
    start_read(&r, &tx, 9, 0, 4096);
    assert!(matches!(ends(&rx, 1, T)[0].1, Ended::Again(_)));
}

#[test]
fn a_store_that_stops_answering_fails_started_requests_at_their_deadline() {
    let (_dir, spec) = fake_store(|s| {
        let mut st = nbd_client::Store::new(s);
        while st.read_request().is_ok() {}
    });
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    let t0 = Instant::now();
    for i in 0..4u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    for (tag, ended, at) in ends(&rx, 4, T + Duration::from_secs(3)) {
        match ended {
            Ended::Failed(ErrorKind::TimedOut, msg) => {
                assert!(msg.contains("did not answer"), "{msg}");
                assert!(at >= t0 + T, "read {tag} failed before its deadline");
            }
            e => panic!("read {tag}: {e:?}"),
        }
    }
    assert_eq!(r.health().deadline_failures, 4);
}

#[test]
fn a_store_that_stops_reading_holds_no_sender_and_fails_what_it_took() {
    let (_dir, spec) = fake_store(|_s| std::thread::sleep(Duration::from_secs(30)));
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    // 8 MiB of 128 KiB writes, far past what the socket holds: the
    // socket takes the first ones whole, one in part (its rest left to
    // the reader, which fails it at its deadline), and the rest find the
    // connection mid-request or given up: declined, nothing of them
    // sent.
    let t0 = Instant::now();
    for i in 0..64u64 {
        start_write(&r, &tx, i, i * (128 << 10), vec![3u8; 128 << 10]);
    }
    assert!(
        t0.elapsed() < T + Duration::from_secs(3),
        "the starts returned within the deadline"
    );
    let all = ends(&rx, 64, T + Duration::from_secs(3));
    let again = all
        .iter()
        .filter(|e| matches!(e.1, Ended::Again(_)))
        .count();
    let timed_out = all
        .iter()
        .filter(|e| matches!(e.1, Ended::Failed(ErrorKind::TimedOut, _)))
        .count();
    assert!(again >= 32, "most were declined: {again} of 64");
    assert!(timed_out >= 1, "what was sent timed out: {all:?}");
    assert_eq!(again + timed_out, 64, "{all:?}");
}

#[test]
fn a_reply_before_a_write_was_sent_whole_ends_it_once_with_its_bytes_all_sent() {
    let (got_tx, got_rx) = mpsc::channel();
    let (_dir, spec) = fake_store(move |s| {
        let mut st = nbd_client::Store::new(s);
        let r = st.read_request().unwrap();
        st.simple_reply(0, r.cookie, &[]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let mut data = vec![0u8; r.length as usize];
        st.stream_mut().read_exact(&mut data).unwrap();
        got_tx.send(data).unwrap();
        memory_store(st.into_stream());
    });
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    let data: Vec<u8> = (0..128u32 << 10).map(|i| (i % 251) as u8).collect();
    start_write(&r, &tx, 1, 0, data.clone());
    let e = ends(&rx, 1, T * 2);
    assert!(matches!(e[0].1, Ended::Ok(_)), "{:?}", e[0].1);
    let got = got_rx.recv_timeout(T).expect("the store read the payload");
    assert!(got == data, "the store got the write's bytes");
    // The stream is still in step: the next request is answered.
    start_read(&r, &tx, 2, 0, 4096);
    assert!(matches!(ends(&rx, 1, T * 2)[0].1, Ended::Ok(_)));
}

#[test]
fn a_remote_dropped_with_started_requests_in_flight_ends_each_once() {
    let (_dir, spec) = fake_store(|s| {
        let mut st = nbd_client::Store::new(s);
        let reqs: Vec<_> = (0..4).map(|_| st.read_request().unwrap()).collect();
        std::thread::sleep(Duration::from_millis(300));
        for r in reqs {
            let _ = st.simple_reply(0, r.cookie, &vec![r.offset as u8 + 1; r.length as usize]);
        }
        let _ = st.read_request();
    });
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    for i in 0..4u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    let t0 = Instant::now();
    drop(r);
    assert!(
        t0.elapsed() < T + Duration::from_secs(3),
        "the drop returned"
    );
    for (tag, ended, _) in ends(&rx, 4, T) {
        match ended {
            Ended::Ok(data) => assert!(data.iter().all(|&b| b == (tag * 4096) as u8 + 1)),
            e => panic!("read {tag}: {e:?}"),
        }
    }
}

/// A store that keeps the export in memory and answers in order (all at
/// offsets below [`FAILING`]); with `tell`, it hands each request's
/// offset there once answered; with `slow`, it reads each WRITE's payload
/// only after `slow` says so, 64 KiB at a time, 5 ms apart.
fn scripted_store(
    tell: Option<Sender<u64>>,
    slow: Option<Receiver<()>>,
) -> impl FnOnce(UnixStream) + Send + 'static {
    move |s| {
        let mut mem = vec![0u8; SIZE as usize];
        let mut st = nbd_client::Store::new(s);
        while let Ok(r) = st.read_request() {
            let (at, n) = (r.offset as usize, r.length as usize);
            let sent = match r.command {
                CMD_WRITE => {
                    if let Some(go) = &slow {
                        let _ = go.recv_timeout(T * 2);
                    }
                    let step = if slow.is_some() { 64 << 10 } else { n };
                    let mut got = 0;
                    while got < n {
                        let k = (n - got).min(step);
                        let part = st.read_raw(k).unwrap();
                        mem[at + got..at + got + k].copy_from_slice(&part);
                        got += k;
                        if slow.is_some() {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                    st.simple_reply(0, r.cookie, &[])
                }
                CMD_READ => st.simple_reply(0, r.cookie, &mem[at..at + n]),
                _ => return,
            };
            let told = tell.as_ref().map_or(Ok(()), |t| t.send(r.offset));
            if sent.is_err() || told.is_err() {
                return;
            }
        }
    }
}

/// [`scripted_store`] that tells each request's offset to `tx`.
fn telling_store(tx: Sender<u64>) -> impl FnOnce(UnixStream) + Send + 'static {
    scripted_store(Some(tx), None)
}

#[test]
fn requests_held_back_go_out_together_when_sent_or_when_a_batch_is_full() {
    use iopages_crypt::async_io::hold_starts;
    let (seen_tx, seen) = mpsc::channel();
    let (_dir, spec) = fake_store(telling_store(seen_tx));
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    // Held: nothing reaches the store until they are sent.
    hold_starts(true);
    for i in 0..8u64 {
        start_write(&r, &tx, i, i * 4096, vec![i as u8 + 1; 4096]);
    }
    assert!(
        seen.recv_timeout(Duration::from_millis(300)).is_err(),
        "a held request reached the store before it was sent"
    );
    hold_starts(false);
    assert_eq!(ends(&rx, 8, T * 2).len(), 8);
    let got: Vec<u64> = (0..8).map(|_| seen.recv_timeout(T).unwrap()).collect();
    assert_eq!(
        got,
        (0..8).map(|i| i * 4096).collect::<Vec<_>>(),
        "in order"
    );
    // A full batch (32 requests) goes at once; the 33rd waits for its send.
    hold_starts(true);
    for i in 0..33u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    let first: Vec<u64> = (0..32).map(|_| seen.recv_timeout(T).unwrap()).collect();
    assert_eq!(first, (0..32).map(|i| i * 4096).collect::<Vec<_>>());
    assert!(
        seen.recv_timeout(Duration::from_millis(300)).is_err(),
        "the 33rd went out before it was sent"
    );
    hold_starts(false);
    for (tag, ended, _) in ends(&rx, 33, T * 2) {
        match ended {
            Ended::Ok(data) if tag < 8 => assert!(data.iter().all(|&b| b == tag as u8 + 1)),
            Ended::Ok(data) => assert!(data.iter().all(|&b| b == 0), "read {tag}"),
            e => panic!("read {tag}: {e:?}"),
        }
    }
    assert_eq!(seen.recv_timeout(T).unwrap(), 32 * 4096);
    let h = r.health();
    assert_eq!(h.started, 41, "every request started on the connection");
    assert_eq!(h.resent + h.deadline_failures, 0);
}

#[test]
fn a_thread_holding_requests_sends_them_before_it_blocks_on_the_store() {
    let (seen_tx, _seen) = mpsc::channel();
    let (_dir, spec) = fake_store(telling_store(seen_tx));
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    iopages_crypt::async_io::hold_starts(true);
    start_write(&r, &tx, 1, 0, vec![5u8; 4096]);
    // A blocking call on the same thread: the held write goes first (the
    // store answers in order), and nothing waits for the deadline.
    let t0 = Instant::now();
    let mut back = vec![0u8; 4096];
    r.read_at(0, &mut [&mut back]).unwrap();
    assert!(
        t0.elapsed() < T,
        "the blocking read waited for its deadline"
    );
    assert!(
        back.iter().all(|&b| b == 5),
        "the held write went out first"
    );
    assert!(matches!(ends(&rx, 1, T)[0].1, Ended::Ok(_)));
    iopages_crypt::async_io::hold_starts(false);
}

#[test]
fn requests_held_on_a_connection_that_dies_end_again_once() {
    let (go_tx, go) = mpsc::channel::<()>();
    let (_dir, spec) = fake_store(move |s| {
        let _ = go.recv_timeout(T);
        drop(s);
    });
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    iopages_crypt::async_io::hold_starts(true);
    for i in 0..3u64 {
        start_read(&r, &tx, i, i * 4096, 4096);
    }
    go_tx.send(()).unwrap();
    // The reader sees the store go; the held requests were never sent.
    let until = Instant::now() + T;
    while r.health().connected > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(100)).is_err(),
        "a held request ended before it was sent"
    );
    iopages_crypt::async_io::hold_starts(false);
    for (tag, ended, _) in ends(&rx, 3, T) {
        match ended {
            Ended::Again(msg) => assert!(msg.contains("held"), "read {tag}: {msg}"),
            e => panic!("read {tag}: {e:?}"),
        }
    }
}

/// [`scripted_store`] that reads each WRITE's payload slowly, after `go`.
fn slow_reading_store(go: Receiver<()>) -> impl FnOnce(UnixStream) + Send + 'static {
    scripted_store(None, Some(go))
}

/// Start a WRITE of `data` at `offset`; its end reports the thread it
/// ran on.
fn start_write_on(
    r: &NbdRemote,
    tx: &Sender<(Ended, std::thread::ThreadId)>,
    offset: u64,
    data: Vec<u8>,
) {
    let tx = tx.clone();
    let end = Box::new(move |o| {
        let _ = tx.send((ended(o, Vec::new()), std::thread::current().id()));
    });
    let a = r.async_io().expect("a remote starts requests");
    a.start_write(offset, Arc::new(Bytes(data)), false, end);
}

#[test]
fn a_write_the_socket_takes_in_part_is_finished_by_the_reader_not_its_starter() {
    let (go_tx, go) = mpsc::channel();
    let (_dir, spec) = fake_store(slow_reading_store(go));
    let r = client(&spec);
    let (tx, rx) = mpsc::channel();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
    // The store reads nothing of the payload until told: a starter that
    // waited for it to be sent would never return to tell it.
    start_write_on(&r, &tx, 4096, data.clone());
    go_tx.send(()).unwrap();
    let (e, on) = rx.recv_timeout(T * 2).expect("the write ended");
    assert!(matches!(e, Ended::Ok(_)), "{e:?}");
    assert_ne!(on, std::thread::current().id(), "ended by the reader");
    // A blocking read of the same bytes: the store answers in order.
    let mut back = vec![0u8; 1 << 20];
    r.read_at(4096, &mut [&mut back]).unwrap();
    assert!(back == data, "the store got the write's bytes");
    assert_eq!(r.health().started, 1);
}

#[test]
fn a_blocking_request_waits_for_a_write_left_in_part_and_follows_it() {
    let (go_tx, go) = mpsc::channel();
    let (_dir, spec) = fake_store(slow_reading_store(go));
    let r = client(&spec);
    let (tx, rx) = mpsc::channel();
    start_write_on(&r, &tx, 0, vec![7u8; 1 << 20]);
    go_tx.send(()).unwrap();
    // Sent after the write's last byte on the one connection, never
    // inside it: the store reads it as a request of its own.
    let mut back = vec![0u8; 8192];
    r.read_at((1 << 20) - 4096, &mut [&mut back]).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 7) && back[4096..].iter().all(|&b| b == 0));
    let (e, _) = rx.recv_timeout(T).expect("the write ended");
    assert!(matches!(e, Ended::Ok(_)), "{e:?}");
}

#[test]
fn a_store_that_stops_reading_mid_write_fails_it_at_its_deadline_on_the_reader() {
    let (_go_tx, go) = mpsc::channel::<()>();
    // Told nothing, the store never reads the payload (it waits 2 × T).
    let (_dir, spec) = fake_store(slow_reading_store(go));
    let r = client(&spec);
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    start_write_on(&r, &tx, 0, vec![1u8; 1 << 20]);
    let (e, on) = rx
        .recv_timeout(T + Duration::from_secs(3))
        .expect("the write ended by its deadline");
    assert_ne!(on, std::thread::current().id(), "its starter did not wait");
    match e {
        Ended::Failed(ErrorKind::TimedOut, msg) => {
            assert!(msg.contains("bytes left"), "{msg}");
            assert!(t0.elapsed() >= T, "failed before its deadline");
        }
        e => panic!("{e:?}"),
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "ended once"
    );
}

#[test]
fn a_connection_that_ends_mid_write_ends_it_again_once() {
    let (seen_tx, seen) = mpsc::channel();
    let (_dir, spec) = fake_store(move |s| {
        let mut st = nbd_client::Store::new(s);
        let r = st.read_request().unwrap();
        let _ = st.read_raw(64 << 10);
        seen_tx.send(r.command).unwrap();
        // Gone with most of the payload unread.
    });
    let r = client(&spec);
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    start_write_on(&r, &tx, 0, vec![2u8; 1 << 20]);
    let (e, _) = rx.recv_timeout(T * 2).expect("the write ended");
    match e {
        Ended::Again(msg) => assert!(t0.elapsed() < T, "Again past the deadline: {msg}"),
        e => panic!("{e:?}"),
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "ended once"
    );
    assert_eq!(seen.recv_timeout(T).unwrap(), CMD_WRITE, "it was started");
}

/// What `f` gives once it gives something, asked every 5 ms; `what` is
/// the failure past `limit`.
fn within<V>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<V>) -> V {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A store that answers nothing until `n` requests are in, then every
/// one of them in one write (a burst); again for the next `n`.
fn bursting_store(n: usize) -> impl FnOnce(UnixStream) + Send + 'static {
    move |s| {
        let mut st = nbd_client::Store::new(s);
        loop {
            let mut burst = Vec::new();
            for _ in 0..n {
                let Ok(r) = st.read_request() else { return };
                burst.extend_from_slice(&simple_reply_bytes(0, r.cookie));
                burst.resize(burst.len() + r.length as usize, r.cookie as u8);
            }
            if st.send_raw(&burst).is_err() {
                return;
            }
        }
    }
}

/// What the ends of reads held ([`async_io::held_by`]), and how much of
/// it each send found.
struct Tally {
    held: std::sync::atomic::AtomicUsize,
    sends: std::sync::Mutex<Vec<usize>>,
}

impl iopages_crypt::async_io::Held for Tally {
    fn send_held(&self) {
        let held = self.held.load(std::sync::atomic::Ordering::SeqCst);
        self.sends.lock().unwrap().push(held);
    }
}

/// A read whose end tells whether its thread ends requests in batches,
/// and holds something back there.
struct Holding {
    buf: Vec<u8>,
    tally: Arc<Tally>,
    tx: Sender<bool>,
}

impl ReadInto for Holding {
    fn buf(&mut self) -> &mut [u8] {
        &mut self.buf
    }
    fn end(self: Box<Self>, outcome: Outcome) {
        use iopages_crypt::async_io;
        assert!(matches!(outcome, Outcome::Done(Ok(()))), "{outcome:?}");
        self.tally
            .held
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async_io::held_by(self.tally.clone());
        let _ = self.tx.send(async_io::batching_ends());
    }
}

/// The reader ends a burst of replies as a batch: each end sees
/// `batching_ends`, and what the ends hold back goes out once the burst
/// is read — before the reader waits for the store again, which then
/// sends nothing more — in fewer sends than ends.
#[test]
fn the_reader_ends_a_burst_of_replies_as_a_batch_and_sends_what_it_held_before_it_waits() {
    const N: usize = 16;
    let (_dir, spec) = fake_store(bursting_store(N));
    let r = client(&spec);
    let a = r.async_io().expect("a remote starts requests");
    let tally = Arc::new(Tally {
        held: Default::default(),
        sends: Default::default(),
    });
    let (tx, rx) = mpsc::channel();
    for i in 0..N as u64 {
        let into = Holding {
            buf: vec![0; 512],
            tally: tally.clone(),
            tx: tx.clone(),
        };
        a.start_read(i * 512, Box::new(into));
    }
    for i in 0..N {
        let batched = rx
            .recv_timeout(T * 2)
            .unwrap_or_else(|_| panic!("read {i} of {N} never ended"));
        assert!(batched, "ended outside a batch");
    }
    within(T * 2, "what the ends held was never sent", || {
        (tally.sends.lock().unwrap().last() == Some(&N)).then_some(())
    });
    let sends = tally.sends.lock().unwrap().clone();
    assert!(
        sends.len() < N,
        "{} sends for {N} ends: {sends:?}",
        sends.len()
    );
    assert!(
        !iopages_crypt::async_io::batching_ends(),
        "the caller's thread is not the reader's"
    );
}

/// A store that, once told, answers cookie 1 — the first request the
/// client registers on the connection — whether or not it got it.
fn guessing_store(go: Receiver<()>) -> impl FnOnce(UnixStream) + Send + 'static {
    move |s| {
        let mut st = nbd_client::Store::new(s);
        if go.recv_timeout(T * 2).is_ok() {
            let _ = st.send_raw(&simple_reply_bytes(0, 1));
        }
        // Keep the connection until the client gives it up.
        while st.read_request().is_ok() {}
    }
}

/// A reply to a request still held back (registered, not a byte of it
/// written) answers what the store was never sent: the connection is
/// given up with that said, and the held request ends `Again`, once.
#[test]
fn a_store_answering_a_request_it_was_not_sent_is_given_up() {
    use iopages_crypt::async_io::hold_starts;
    let (go_tx, go) = mpsc::channel();
    let (_dir, spec) = fake_store(guessing_store(go));
    let r = client(&spec);
    let (tx, rx): Ends = mpsc::channel();
    hold_starts(true);
    start_write(&r, &tx, 0, 0, vec![7; 4096]);
    go_tx.send(()).unwrap();
    let said = within(T * 2, "the connection was never given up", || {
        r.health().last_error
    });
    assert!(said.contains("which it was not sent"), "{said}");
    hold_starts(false);
    match ends(&rx, 1, T * 2).pop().unwrap().1 {
        Ended::Again(_) => {}
        e => panic!("the held write ended {e:?}"),
    }
}
