use super::*;
use crate::transport::stream::Stream;

fn transport() -> (Arc<Transport>, std::os::unix::net::UnixStream) {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    (Arc::new(Transport::new(Stream::Unix(a)).unwrap()), b)
}

fn limits(conns: usize, handshakes: usize, bytes: u64) -> ShareLimits {
    ShareLimits {
        max_connections: conns,
        max_handshakes: handshakes,
        min_connections: 2,
        max_bytes: bytes,
        min_bytes: 16,
        max_request_bytes: 32,
    }
}

/// Whether the other end of a transport sees it shut down.
fn is_shut(other: &std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    other.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    matches!((&*other).read(&mut b), Ok(0))
}

/// Every count of the shares back at zero, and the peers forgotten.
fn assert_empty(sh: &Shares) {
    let s = sh.state.lock();
    assert!(s.peers.is_empty() && s.handshakes.is_empty() && s.connections.is_empty());
    assert!(s.waiters.is_empty());
    assert_eq!((s.active, s.bytes, s.under_waiting), (0, 0, 0));
}

#[test]
fn a_full_handshake_pool_closes_the_least_advanced_handshake_of_the_biggest_holder() {
    let sh = Arc::new(Shares::new(limits(8, 4, 1 << 20)));
    // The polite client's handshake, then a hostile peer's silent sockets
    // fill the pool and keep coming: each newcomer of the peer holding
    // the most is closed at once (no slot, no thread).
    let (t, polite_end) = transport();
    let polite = sh.admit_handshake("ip:127.0.0.1", &t).unwrap();
    let mut ends = Vec::new();
    let mut slots = Vec::new();
    for _ in 0..50 {
        let (t, end) = transport();
        slots.extend(sh.admit_handshake("ip:127.0.0.2", &t));
        ends.push(end);
    }
    assert_eq!(slots.len(), 3, "three fit beside the polite one");
    assert_eq!(sh.snapshot().handshakes, 4);
    assert_eq!(sh.counters.handshake_evictions.load(Ordering::Relaxed), 47);
    assert!(!is_shut(&polite_end), "the polite handshake was closed");
    assert!(!ends[..3].iter().any(is_shut));
    // A third peer's newcomer closes a handshake of the biggest holder:
    // its least advanced, the oldest among equals.
    slots[0].progressed_by(1);
    let (t, _third_end) = transport();
    let third = sh.admit_handshake("ip:127.0.0.3", &t).unwrap();
    assert!(is_shut(&ends[1]) && !is_shut(&ends[0]) && !is_shut(&ends[2]));
    assert!(!is_shut(&polite_end));
    drop((polite, slots, third));
    assert_empty(&sh);
}

#[test]
fn a_peer_under_its_share_gets_a_connection_from_the_peer_furthest_over() {
    let sh = Arc::new(Shares::new(limits(8, 64, 1 << 20)));
    let mut greedy = Vec::new();
    for _ in 0..8 {
        let (t, end) = transport();
        let mut s = sh.admit_handshake("ip:127.0.0.2", &t).unwrap();
        s.enter_transmission("ip:127.0.0.2", &t).unwrap();
        greedy.push((s, end));
    }
    // The greedy peer's newest connection is busy: its newest idle goes.
    greedy[7].0.busy().store(1, Ordering::Relaxed);
    let (t, _end) = transport();
    let mut polite = sh.admit_handshake("ip:127.0.0.1", &t).unwrap();
    polite.enter_transmission("ip:127.0.0.1", &t).unwrap();
    assert!(is_shut(&greedy[6].1) && !is_shut(&greedy[7].1));
    assert_eq!(sh.counters.share_evictions.load(Ordering::Relaxed), 1);
    // Two peers: a guarantee of 4 each. The greedy one (7) cannot take
    // more; the polite one may, up to its guarantee.
    let (t, _e) = transport();
    let mut more = sh.admit_handshake("ip:127.0.0.2", &t).unwrap();
    let e = more.enter_transmission("ip:127.0.0.2", &t).unwrap_err();
    assert!(e.contains("too many connections"), "{e}");
    assert_eq!(sh.counters.refused.load(Ordering::Relaxed), 1);
    let mut polite_more = Vec::new();
    for _ in 0..3 {
        let (t, e) = transport();
        let mut s = sh.admit_handshake("ip:127.0.0.1", &t).unwrap();
        s.enter_transmission("ip:127.0.0.1", &t).unwrap();
        polite_more.push((s, e));
    }
    let snap = sh.snapshot();
    assert_eq!(
        (snap.connections, snap.peers, snap.peers_at_share),
        (8, 2, 2)
    );
    let (t, _e) = transport();
    let mut fifth = sh.admit_handshake("ip:127.0.0.1", &t).unwrap();
    assert!(fifth.enter_transmission("ip:127.0.0.1", &t).is_err());
    drop((greedy, polite, more, polite_more, fifth));
    assert_empty(&sh);
}

#[test]
fn a_slot_dropped_by_a_panic_gives_its_place_back() {
    let sh = Arc::new(Shares::new(limits(1, 1, 1 << 20)));
    let sh2 = Arc::clone(&sh);
    let r = std::thread::spawn(move || {
        let (t, _e) = transport();
        let mut s = sh2.admit_handshake("ip:127.0.0.1", &t).unwrap();
        s.enter_transmission("ip:127.0.0.1", &t).unwrap();
        assert!(s.budget().try_take(8, &mut Claim::default()));
        panic!("injected");
    })
    .join();
    assert!(r.is_err());
    // The bytes are the connection's requests': given back by them (here
    // by hand), the place by the slot's drop during the unwind.
    assert_eq!(sh.snapshot().connections, 0);
    let b = PeerBudget {
        shares: Arc::clone(&sh),
        peer: "ip:127.0.0.1".into(),
    };
    b.give_back(8, false);
    assert_empty(&sh);
}

/// A peer with a connection in transmission and its budget.
fn in_transmission(sh: &Arc<Shares>, peer: &str) -> (Slot, PeerBudget) {
    let (t, _e) = transport();
    let mut s = sh.admit_handshake(peer, &t).unwrap();
    s.enter_transmission(peer, &t).unwrap();
    let b = s.budget();
    (s, b)
}

#[test]
fn bytes_are_shared_with_a_reserve_that_greedy_peers_cannot_take() {
    // 256 bytes, floor 16, largest request 32: reserve 16.
    let sh = Arc::new(Shares::new(limits(64, 64, 256)));
    let greedy: Vec<_> = (2..10)
        .map(|i| in_transmission(&sh, &format!("ip:127.0.0.{i}")))
        .collect();
    // Eight peers: 32 each guaranteed, but the last 16 stay free.
    let mut took = 0;
    for (_, b) in &greedy {
        let mut c = Claim::default();
        if b.try_take(32, &mut c) {
            took += 32;
        } else {
            b.give_up(&mut c);
        }
    }
    assert_eq!(took, 224);
    // A newcomer's small request is served from the reserve at once.
    let (_s, polite) = in_transmission(&sh, "ip:127.0.0.1");
    let mut c = Claim::default();
    assert!(polite.try_take(4, &mut c));
    // A borrower waits while a peer under its guarantee waits.
    // Nine peers: 28 guaranteed each. 20 more is within the polite
    // peer's guarantee but would leave less than the reserve free: it
    // waits, under its share.
    let mut under = Claim::default();
    assert!(!polite.try_take(20, &mut under));
    assert!(under.under);
    let mut over = Claim::default();
    assert!(!greedy[0].1.try_take(4, &mut over));
    polite.give_up(&mut under);
    greedy[0].1.give_up(&mut over);
    polite.give_back(4, false);
    for (_, b) in &greedy[..7] {
        b.give_back(32, false);
    }
    drop((greedy, _s));
    assert_empty(&sh);
}

#[test]
fn an_under_share_waiter_goes_before_a_borrower() {
    let sh = Arc::new(Shares::new(limits(64, 64, 256)));
    let (_a, big) = in_transmission(&sh, "psk:big");
    assert!(big.try_take(200, &mut Claim::default()));
    let (_b, small) = in_transmission(&sh, "psk:small");
    // Two peers: 128 each. big is over; small asks for 48 (within its
    // guarantee) but only 56 are free and 48 would eat into the reserve.
    let mut waiting = Claim::default();
    assert!(!small.try_take(48, &mut waiting));
    // big may not borrow even 4 bytes now: small waits under its share.
    let mut c = Claim::default();
    assert!(!big.try_take(4, &mut c));
    assert_eq!(sh.counters.budget_share_waits.load(Ordering::Relaxed), 1);
    big.give_back(100, false);
    assert!(small.try_take(48, &mut waiting));
    assert!(big.try_take(4, &mut c));
    big.give_back(104, false);
    small.give_back(48, false);
    drop((_a, _b));
    assert_empty(&sh);
}

#[test]
fn random_traffic_never_passes_the_limit_and_counts_every_byte() {
    let sh = Arc::new(Shares::new(limits(16, 16, 1000)));
    let peers: Vec<_> = (0..5)
        .map(|i| in_transmission(&sh, &format!("ip:10.0.0.{i}")))
        .collect();
    let mut held = vec![Vec::new(); peers.len()];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let p = (x % 5) as usize;
        if x & 0x100 != 0 {
            let n = (x >> 16) % 33;
            let mut c = Claim::default();
            if peers[p].1.try_take(n, &mut c) {
                held[p].push(n);
            } else {
                peers[p].1.give_up(&mut c);
            }
        } else if let Some(n) = held[p].pop() {
            peers[p].1.give_back(n, false);
        }
        let s = sh.state.lock();
        let sum: u64 = held.iter().flatten().sum();
        assert_eq!(s.bytes, sum);
        assert!(s.bytes <= 1000);
        assert_eq!(s.under_waiting, 0);
    }
    for (p, h) in held.iter().enumerate() {
        for &n in h {
            peers[p].1.give_back(n, false);
        }
    }
    drop(peers);
    assert_empty(&sh);
}

#[test]
fn a_waiter_under_its_share_recalls_bytes_from_the_peer_furthest_over() {
    let sh = Arc::new(Shares::new(limits(64, 64, 256)));
    let (t, greedy_end) = transport();
    let mut g = sh.admit_handshake("ip:127.0.0.2", &t).unwrap();
    g.enter_transmission("ip:127.0.0.2", &t).unwrap();
    let greedy = g.budget();
    assert!(greedy.try_take(200, &mut Claim::default()));
    g.busy().store(2, Ordering::Relaxed);
    let (_s, small) = in_transmission(&sh, "ip:127.0.0.1");
    // 56 free, 48 asked within a guarantee of 128: it waits (reserve).
    let mut c = Claim::default();
    assert!(!small.try_take(48, &mut c));
    assert!(PeerBudget::waits_under_share(&c));
    assert!(small.recall());
    assert!(is_shut(&greedy_end));
    assert_eq!(sh.counters.share_evictions.load(Ordering::Relaxed), 1);
    // The closed connection's requests complete and give their bytes back.
    greedy.give_back(200, false);
    assert!(small.try_take(48, &mut c));
    assert!(!small.recall(), "nobody is over their guarantee now");
    small.give_back(48, false);
    drop((g, _s));
    assert_empty(&sh);
}

#[test]
fn a_peer_has_at_most_its_work_window_of_work_in_flight() {
    let sh = Arc::new(Shares::new(ShareLimits {
        max_request_bytes: 1 << 20,
        ..limits(64, 64, 256 << 20)
    }));
    let (_s, b) = in_transmission(&sh, "ip:127.0.0.2");
    let chunk = 1 << 20;
    let n = WORK_WINDOW_BYTES / chunk;
    for _ in 0..n {
        assert!(b.try_take(chunk, &mut Claim::new(true)));
    }
    // The window is full: no more work, though the share has room ...
    let mut c = Claim::new(true);
    assert!(!b.try_take(chunk, &mut c));
    assert!(
        !PeerBudget::waits_under_share(&c),
        "its own window, not the share"
    );
    // ... and payloads are not held back by it.
    assert!(b.try_take(chunk, &mut Claim::new(false)));
    b.give_back(chunk, true);
    assert!(b.try_take(chunk, &mut Claim::new(true)));
    for _ in 0..n {
        b.give_back(chunk, true);
    }
    b.give_back(chunk, false);
    drop(_s);
    assert_empty(&sh);
}

#[test]
fn a_peer_first_handshake_gets_in_whatever_many_addresses_hold() {
    // Four addresses with one silent socket each fill the pool.
    let sh = Arc::new(Shares::new(limits(8, 4, 1 << 20)));
    let mut ends = Vec::new();
    let mut slots = Vec::new();
    for i in 2..6 {
        let (t, end) = transport();
        slots.push(sh.admit_handshake(&format!("ip:10.0.0.{i}"), &t).unwrap());
        ends.push(end);
    }
    // A new client gets in: the oldest silent one is closed.
    let (t, polite_end) = transport();
    let polite = sh.admit_handshake("ip:127.0.0.1", &t).unwrap();
    assert!(is_shut(&ends[0]) && !ends[1..].iter().any(is_shut));
    // An address that holds one already and re-opens is closed at once.
    let (t, _e) = transport();
    assert!(sh.admit_handshake("ip:10.0.0.3", &t).is_none());
    assert!(!is_shut(&polite_end));
    drop((slots, polite));
    assert_empty(&sh);
}

/// Whether `t` was kicked since the last look (and forget the kick).
fn kicked(t: &Transport) -> bool {
    let woken = t.wait_kick(Some(Duration::ZERO)).unwrap().woken;
    t.clear_kicks();
    woken
}

#[test]
fn bytes_given_back_kick_the_waiters_they_may_serve() {
    // Those under their peer's guarantee first, each side longest waiting
    // first, as many as the bytes cover, at least one.
    let mut s = State::default();
    let ts: Vec<_> = (0..4).map(|_| transport()).collect();
    for (i, (t, _)) in ts.iter().enumerate() {
        s.waiters.push_back(Waiter {
            token: i as u64,
            bytes: 8,
            under: i % 2 == 1,
            t: Arc::clone(t),
        });
    }
    let tokens = |s: &State| s.waiters.iter().map(|w| w.token).collect::<Vec<_>>();
    let kicked_now: Vec<_> = s.serve_waiters(16).iter().map(|t| t.wake_fd()).collect();
    assert_eq!(kicked_now, [ts[1].0.wake_fd(), ts[3].0.wake_fd()]);
    assert_eq!(tokens(&s), [0, 2]);
    // One byte: still one waiter looks.
    assert_eq!(s.serve_waiters(1).len(), 1);
    assert_eq!(tokens(&s), [2]);
    assert_eq!(s.serve_waiters(0).len(), 1);
    assert!(s.serve_waiters(64).is_empty());
}

#[test]
fn a_budget_wait_is_kicked_when_bytes_come_back_and_forgotten_when_dropped() {
    let sh = Arc::new(Shares::new(limits(64, 64, 64)));
    let (_a, big) = in_transmission(&sh, "psk:big");
    assert!(big.try_take(48, &mut Claim::default()));
    let (t, _end) = transport();
    let now = Instant::now();
    let mut claim = Claim::default();
    assert!(!big.try_take(32, &mut claim));
    let mut w = BudgetWait::new(&big, claim, &t, Duration::from_secs(10), now);
    assert!(matches!(w.look(32, now), Look::Wait));
    assert!(w.next() > now && w.next() <= now + LOOK_AGAIN);
    assert!(!kicked(&t));
    assert_eq!(sh.state.lock().waiters.len(), 1);
    // Another request of the peer ends: its bytes kick the waiter, which
    // takes them at its look (64 bytes, a reserve of 16).
    big.give_back(32, false);
    assert!(kicked(&t));
    assert!(matches!(w.look(32, Instant::now()), Look::Taken));
    assert!(sh.state.lock().waiters.is_empty());
    // A wait dropped unserved is no longer a waiter; one past its
    // patience is refused.
    let mut claim = Claim::default();
    assert!(!big.try_take(8, &mut claim));
    let mut w = BudgetWait::new(&big, claim, &t, Duration::ZERO, now);
    assert!(matches!(w.look(8, now), Look::Refused));
    assert!(sh.state.lock().waiters.is_empty());
    let mut claim = Claim::default();
    assert!(!big.try_take(8, &mut claim));
    let mut w = BudgetWait::new(&big, claim, &t, Duration::from_secs(10), now);
    assert!(matches!(w.look(8, now), Look::Wait));
    drop(w);
    assert!(sh.state.lock().waiters.is_empty());
    big.give_back(48, false);
    drop(_a);
    assert_empty(&sh);
}
