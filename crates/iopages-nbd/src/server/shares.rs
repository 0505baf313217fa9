//! Fair shares of the server's limits among its peers.
//!
//! Owns: the handshake pool (connections that have not reached
//! transmission), the connection pool (connections in transmission) and
//! the byte budget (payload bytes and work in flight), each kept per peer
//! ([`Peer::share_key`](crate::server::peer::Peer::share_key)), and the slots
//! that give a connection's place back when its thread ends — also when
//! it panics. Must never: let one peer keep another out, hold more
//! handshakes than the pool (one more closes the least advanced
//! handshake of the peer holding the most), or lose count of a byte.
//!
//! The shares are max-min fair, in the manner of a fair queue: with `n`
//! peers in transmission each is *guaranteed* `max(floor, limit ÷ n)`
//! connections and bytes, may *borrow* what the others leave unused, and
//! gives borrowed capacity back when a peer under its guarantee needs it:
//!
//! - **Connections.** While the pool has room anyone is admitted. When it
//!   is full, a peer under its guarantee is admitted by closing a
//!   connection of the peer furthest over its own — its newest idle one
//!   (nothing in flight), else its newest; a peer at its guarantee is
//!   refused.
//! - **Bytes.** A request within its peer's guarantee goes first; a peer
//!   past its guarantee may borrow only while no peer under its guarantee
//!   waits, and only while a reserve of `min(floor, limit − largest
//!   request)` bytes stays free for peers holding less than the reserve.
//!   The reserve is what makes the guarantee real against a client that
//!   never reads its replies: borrowed bytes of such a client come back
//!   only when its connection dies, so a newcomer cannot be made to wait
//!   for them. A request under its guarantee that still waits a second
//!   recalls borrowed bytes: the newest busy connection of the peer
//!   furthest over its byte guarantee is closed (its requests complete,
//!   their replies are dropped, their bytes come back).
//! - **Handshakes** have a pool of their own, so no number of silent
//!   sockets can keep an authenticating client out: when it is full, a new
//!   connection closes one handshake of the peer holding the most
//!   handshakes — the one that has made the least progress, the oldest
//!   among equals — or, when its own peer already holds one and the most
//!   (ties included), is itself closed at once, before a thread is
//!   started for it. A peer's first handshake always gets in.

use crate::transport::nonblocking::Transport;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a request under its peer's guarantee waits for bytes before the
/// server closes a connection of the peer furthest over its own to get
/// them back (and again after each such wait).
const RECALL_AFTER: Duration = Duration::from_secs(1);
/// How often a request waiting for bytes looks again by itself: bytes
/// coming back kick the waiters they may serve (those under their peer's
/// guarantee first), so this only bounds what no kick tells — a peer's
/// share grown because another peer left, a borrower allowed again
/// because no one under their guarantee waits any more. (Looking every
/// 5 ms, 200 parked waiters cost the watchers 40 000 turns a second.)
const LOOK_AGAIN: Duration = RECALL_AFTER;

/// The limits the shares are cut from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShareLimits {
    /// Connections in transmission, over all peers.
    pub(crate) max_connections: usize,
    /// Connections in the handshake, over all peers.
    pub(crate) max_handshakes: usize,
    /// Each peer's guarantee of connections is at least this.
    pub(crate) min_connections: usize,
    /// Bytes in flight, over all peers.
    pub(crate) max_bytes: u64,
    /// Each peer's guarantee of bytes is at least this.
    pub(crate) min_bytes: u64,
    /// The largest single request (bytes): the reserve leaves room for it.
    pub(crate) max_request_bytes: u64,
}

impl ShareLimits {
    /// Bytes kept free for peers holding less than this much.
    fn reserve_bytes(&self) -> u64 {
        self.min_bytes
            .min(self.max_bytes.saturating_sub(self.max_request_bytes))
    }
}

/// What the shares have counted (read by [`Shares::snapshot`]).
#[derive(Default)]
pub(crate) struct ShareCounters {
    pub(crate) handshake_evictions: AtomicU64,
    pub(crate) share_evictions: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) budget_share_waits: AtomicU64,
}

/// Work (the chunks WRITE_ZEROES and TRIM are served in) one peer may
/// have in flight at once, within its byte share: four 1 MiB chunks keep
/// the crypt workers of a small machine busy with one peer's zeroing,
/// while eight peers flooding put at most 32 MiB of it ahead of anyone
/// else's request in the crypt queue (their whole byte shares would be
/// 224 MiB).
pub(crate) const WORK_WINDOW_BYTES: u64 = 4 << 20;

/// A peer's holdings.
#[derive(Default)]
struct Holding {
    handshakes: usize,
    connections: usize,
    bytes: u64,
    /// Of `bytes`, those that are work.
    work: u64,
}

impl Holding {
    fn is_empty(&self) -> bool {
        self.handshakes == 0 && self.connections == 0 && self.bytes == 0
    }
}

/// A connection in one of the pools.
struct Member {
    id: u64,
    peer: Arc<str>,
    t: Arc<Transport>,
    /// Handshake: steps taken. Transmission: requests in flight.
    progress: Arc<AtomicUsize>,
}

#[derive(Default)]
struct State {
    peers: HashMap<Arc<str>, Holding>,
    handshakes: Vec<Member>,
    connections: Vec<Member>,
    /// Peers with a connection in transmission.
    active: usize,
    bytes: u64,
    /// Requests of peers under their guarantee waiting for bytes.
    under_waiting: usize,
    /// Requests waiting for bytes, in the order they began to wait
    /// (again), kicked when bytes come back.
    waiters: VecDeque<Waiter>,
    next_waiter: u64,
}

/// A request waiting for bytes.
struct Waiter {
    token: u64,
    /// The bytes it asks for.
    bytes: u64,
    /// It waits under its peer's guarantee (goes first).
    under: bool,
    /// Its connection.
    t: Arc<Transport>,
}

impl State {
    fn holding(&mut self, peer: &Arc<str>) -> &mut Holding {
        self.peers.entry(Arc::clone(peer)).or_default()
    }

    /// Take the waiters `bytes` given back may serve off the list, those
    /// under their peer's guarantee first, each side longest waiting
    /// first: as many as the bytes cover, at least one.
    ///
    /// **Returns:** their connections, to kick.
    fn serve_waiters(&mut self, bytes: u64) -> Vec<Arc<Transport>> {
        let mut kicks = Vec::new();
        let mut room = bytes;
        for under in [true, false] {
            let mut i = 0;
            while i < self.waiters.len() {
                let w = &self.waiters[i];
                if w.under != under {
                    i += 1;
                    continue;
                }
                if !kicks.is_empty() && w.bytes > room {
                    return kicks;
                }
                room = room.saturating_sub(w.bytes);
                kicks.extend(self.waiters.remove(i).map(|w| w.t));
            }
        }
        kicks
    }

    /// Forget `peer` once it holds nothing.
    fn tidy(&mut self, peer: &Arc<str>) {
        if self.peers.get(peer).is_some_and(Holding::is_empty) {
            self.peers.remove(peer);
        }
    }

    fn remove_handshake(&mut self, id: u64) -> Option<Member> {
        let i = self.handshakes.iter().position(|m| m.id == id)?;
        let m = self.handshakes.swap_remove(i);
        let h = self.holding(&m.peer);
        assert!(
            h.handshakes >= 1,
            "a peer ends a handshake it does not hold"
        );
        h.handshakes -= 1;
        self.tidy(&m.peer);
        Some(m)
    }

    fn remove_connection(&mut self, id: u64) -> Option<Member> {
        let i = self.connections.iter().position(|m| m.id == id)?;
        let m = self.connections.remove(i);
        let h = self.holding(&m.peer);
        assert!(
            h.connections >= 1,
            "a peer ends a connection it does not hold"
        );
        h.connections -= 1;
        if h.connections == 0 {
            debug_assert!(self.active >= 1, "more peers leave than are active");
            self.active -= 1;
        }
        self.tidy(&m.peer);
        Some(m)
    }
}

/// The server's shares (one per server).
pub(crate) struct Shares {
    limits: ShareLimits,
    state: Mutex<State>,
    next_id: AtomicU64,
    pub(crate) counters: ShareCounters,
}

/// A figure of the shares at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShareSnapshot {
    pub(crate) handshakes: u64,
    pub(crate) connections: u64,
    pub(crate) peers: u64,
    pub(crate) peers_at_share: u64,
    pub(crate) bytes: u64,
}

impl Shares {
    pub(crate) fn new(limits: ShareLimits) -> Shares {
        assert!(limits.max_connections > 0 && limits.max_handshakes > 0);
        assert!(limits.max_bytes >= limits.max_request_bytes);
        // A floor above its limit would guarantee more than there is.
        let limits = ShareLimits {
            min_connections: limits.min_connections.min(limits.max_connections),
            min_bytes: limits.min_bytes.min(limits.max_bytes),
            ..limits
        };
        Shares {
            limits,
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(1),
            counters: ShareCounters::default(),
        }
    }

    /// The guarantee of `n` active peers: (connections, bytes).
    fn guarantee(&self, n: usize) -> (usize, u64) {
        let n = n.max(1);
        let l = &self.limits;
        (
            (l.max_connections / n).max(l.min_connections),
            (l.max_bytes / n as u64).max(l.min_bytes),
        )
    }

    /// Take a place in the handshake pool for a new connection of `peer`,
    /// closing another handshake if the pool is full (see the module
    /// doc).
    ///
    /// **Context:** takes the shares' lock; never blocks on a socket.
    /// **Returns:** `None` when the newcomer is itself the one to close
    /// (its peer already holds a handshake and, with it, the most, ties
    /// included; it has done nothing yet): the caller closes it at once,
    /// before any thread is started for it — so a peer re-opening silent
    /// sockets costs the server an accept and a close each, nothing
    /// more.
    pub(crate) fn admit_handshake(
        self: &Arc<Self>,
        peer: &str,
        t: &Arc<Transport>,
    ) -> Option<Slot> {
        let peer: Arc<str> = peer.into();
        let progress = Arc::new(AtomicUsize::new(0));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut s = self.state.lock();
        if s.handshakes.len() >= self.limits.max_handshakes {
            self.counters
                .handshake_evictions
                .fetch_add(1, Ordering::Relaxed);
            let victim = self.handshake_victim(&s, &peer)?;
            let m = s
                .remove_handshake(victim)
                .expect("the victim is in the pool");
            m.t.shutdown();
        }
        s.holding(&peer).handshakes += 1;
        s.handshakes.push(Member {
            id,
            peer: Arc::clone(&peer),
            t: Arc::clone(t),
            progress: Arc::clone(&progress),
        });
        debug_assert!(s.handshakes.len() <= self.limits.max_handshakes);
        Some(Slot {
            shares: Arc::clone(self),
            id,
            peer,
            progress,
            stage: Stage::Handshake,
        })
    }

    /// The handshake to close for a newcomer of `newcomer`: of the peer
    /// holding the most (the newcomer counted), the least advanced, the
    /// oldest among equals; `None` when that is the newcomer itself (its
    /// peer holds one already and the most, ties included).
    fn handshake_victim(&self, s: &State, newcomer: &Arc<str>) -> Option<u64> {
        let held = |p: &Arc<str>| s.peers.get(p).map_or(0, |h| h.handshakes);
        let most = s.peers.values().map(|h| h.handshakes).max().unwrap_or(0);
        let mine = held(newcomer);
        // A peer's first handshake always gets in (a peer holding none
        // is never the one to close), so no number of addresses holding
        // one silent socket each can keep a new client out.
        if mine > 0 && mine + 1 >= most {
            return None;
        }
        s.handshakes
            .iter()
            .filter(|m| held(&m.peer) == most)
            .min_by_key(|m| (m.progress.load(Ordering::Relaxed), m.id))
            .map(|m| m.id)
    }

    /// Bytes the pools hold, and who: a snapshot for the statistics.
    pub(crate) fn snapshot(&self) -> ShareSnapshot {
        let s = self.state.lock();
        let (gc, gb) = self.guarantee(s.active);
        ShareSnapshot {
            handshakes: s.handshakes.len() as u64,
            connections: s.connections.len() as u64,
            peers: s.peers.len() as u64,
            peers_at_share: s
                .peers
                .values()
                .filter(|h| h.connections >= gc || h.bytes >= gb)
                .count() as u64,
            bytes: s.bytes,
        }
    }
}

/// Which pool a slot is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Handshake,
    Transmission,
}

/// A connection's place in the pools: given back when dropped (the
/// connection's thread ends, by returning or by a panic), unless the
/// connection was closed for another's sake, which gave it back then.
pub(crate) struct Slot {
    shares: Arc<Shares>,
    id: u64,
    peer: Arc<str>,
    progress: Arc<AtomicUsize>,
    stage: Stage,
}

impl Slot {
    /// `steps` of the handshake were taken (they make the connection a
    /// later choice for closing when the pool is full).
    pub(crate) fn progressed_by(&self, steps: usize) {
        self.progress.fetch_add(steps, Ordering::Relaxed);
    }

    /// Move from the handshake pool into transmission as `peer` (now
    /// perhaps a TLS identity), in the connection pool's fair share.
    ///
    /// **Returns:** `Err` with the reason when the pool is full and the
    /// peer already holds its guarantee (the slot is then given back
    /// whole when dropped).
    pub(crate) fn enter_transmission(
        &mut self,
        peer: &str,
        t: &Arc<Transport>,
    ) -> Result<(), String> {
        assert_eq!(self.stage, Stage::Handshake);
        let sh = Arc::clone(&self.shares);
        let peer: Arc<str> = peer.into();
        let mut s = sh.state.lock();
        let held = s.peers.get(&peer).map_or(0, |h| h.connections);
        let n = s.active + usize::from(held == 0);
        let (g, _) = sh.guarantee(n);
        let max = sh.limits.max_connections;
        if s.connections.len() >= max {
            let victim = (held < g).then(|| connection_victim(&s, g)).flatten();
            let Some(victim) = victim else {
                sh.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Err(format!(
                    "too many connections: {max} are open and this client holds {held} (its share is {g})"
                ));
            };
            let m = s
                .remove_connection(victim)
                .expect("the victim is in the pool");
            m.t.shutdown();
            sh.counters.share_evictions.fetch_add(1, Ordering::Relaxed);
        }
        if s.remove_handshake(self.id).is_none() {
            // Closed for a newcomer meanwhile: its socket is shut down.
            return Err("the handshake was closed for another connection".into());
        }
        let h = s.holding(&peer);
        h.connections += 1;
        if h.connections == 1 {
            s.active += 1;
        }
        self.progress.store(0, Ordering::Relaxed);
        s.connections.push(Member {
            id: self.id,
            peer: Arc::clone(&peer),
            t: Arc::clone(t),
            progress: Arc::clone(&self.progress),
        });
        debug_assert!(s.connections.len() <= max);
        self.peer = peer;
        self.stage = Stage::Transmission;
        Ok(())
    }

    /// The requests-in-flight count that marks the connection busy (an
    /// idle one is closed first when a peer must give one back).
    pub(crate) fn busy(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.progress)
    }

    /// The byte budget as this connection's peer sees it.
    pub(crate) fn budget(&self) -> PeerBudget {
        PeerBudget {
            shares: Arc::clone(&self.shares),
            peer: Arc::clone(&self.peer),
        }
    }
}

/// The connection of the peer furthest over the guarantee `g` to close:
/// its newest idle connection, else its newest. `None` when no peer is
/// over `g`.
fn connection_victim(s: &State, g: usize) -> Option<u64> {
    let (peer, _) = s
        .peers
        .iter()
        .filter(|(_, h)| h.connections > g)
        .max_by_key(|(_, h)| h.connections)?;
    let mine = || s.connections.iter().rev().filter(|m| &m.peer == peer);
    mine()
        .find(|m| m.progress.load(Ordering::Relaxed) == 0)
        .or_else(|| mine().next())
        .map(|m| m.id)
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.shares.state.lock();
        match self.stage {
            Stage::Handshake => drop(s.remove_handshake(self.id)),
            Stage::Transmission => drop(s.remove_connection(self.id)),
        }
    }
}

/// A request's wait for bytes: whether it is counted among the requests
/// under their peer's guarantee that go first.
#[derive(Default)]
pub(crate) struct Claim {
    /// The bytes are work (chunks of WRITE_ZEROES or TRIM), also bounded
    /// by the peer's work window.
    work: bool,
    under: bool,
    /// Its wait behind a peer under its share was counted.
    counted: bool,
}

impl Claim {
    /// A request's claim: of payload bytes, or of `work`.
    pub(crate) fn new(work: bool) -> Claim {
        Claim {
            work,
            ..Claim::default()
        }
    }
}

/// One peer's view of the byte budget (a connection's).
#[derive(Clone)]
pub(crate) struct PeerBudget {
    shares: Arc<Shares>,
    peer: Arc<str>,
}

impl PeerBudget {
    /// Take `bytes` if this peer's share allows it now (see the module
    /// doc); if not, `claim` records whether the request waits under its
    /// peer's guarantee (others then wait behind it). Pair a `false` that
    /// is given up with [`PeerBudget::give_up`].
    pub(crate) fn try_take(&self, bytes: u64, claim: &mut Claim) -> bool {
        if bytes == 0 {
            return true;
        }
        let sh = &*self.shares;
        let mut s = sh.state.lock();
        let (_, g) = sh.guarantee(s.active);
        let (held, work) = s
            .peers
            .get(&self.peer)
            .map_or((0, 0), |h| (h.bytes, h.work));
        if claim.work && work + bytes > WORK_WINDOW_BYTES.max(bytes) {
            // Its own window: it waits for its own chunks, nobody else.
            return false;
        }
        let within = held + bytes <= g;
        let limit = sh.limits.max_bytes;
        let fits = s.bytes + bytes <= limit;
        let reserve = sh.limits.reserve_bytes();
        let keeps_reserve =
            fits && (limit - (s.bytes + bytes) >= reserve || held + bytes <= reserve);
        let others_waiting = s.under_waiting - usize::from(claim.under);
        if fits && keeps_reserve && (within || others_waiting == 0) {
            if claim.under {
                s.under_waiting -= 1;
                claim.under = false;
            }
            s.bytes += bytes;
            debug_assert!(s.bytes <= limit, "the server's budget is overdrawn");
            let h = s.holding(&self.peer);
            h.bytes += bytes;
            if claim.work {
                h.work += bytes;
            }
            return true;
        }
        if within != claim.under {
            if within {
                s.under_waiting += 1;
            } else {
                s.under_waiting -= 1;
            }
            claim.under = within;
        }
        if !within && others_waiting > 0 && !claim.counted {
            claim.counted = true;
            sh.counters
                .budget_share_waits
                .fetch_add(1, Ordering::Relaxed);
        }
        false
    }

    /// Whether the last [`PeerBudget::try_take`] with `claim` left it
    /// waiting under its peer's guarantee.
    pub(crate) fn waits_under_share(claim: &Claim) -> bool {
        claim.under
    }

    /// Take borrowed bytes back for a request waiting under its peer's
    /// guarantee: close the newest busy connection of the peer furthest
    /// over its byte guarantee (its requests complete, their replies are
    /// dropped, and their bytes come back — the only way back for bytes
    /// held by replies a client never reads). Counted with the share
    /// evictions.
    ///
    /// **Returns:** whether a connection was closed (none: no peer holds
    /// more than its guarantee in a busy connection).
    pub(crate) fn recall(&self) -> bool {
        let sh = &*self.shares;
        let mut s = sh.state.lock();
        let (_, g) = sh.guarantee(s.active);
        let Some(peer) = s
            .peers
            .iter()
            .filter(|(p, h)| h.bytes > g && **p != self.peer)
            .max_by_key(|(_, h)| h.bytes)
            .map(|(p, _)| Arc::clone(p))
        else {
            return false;
        };
        let victim = s
            .connections
            .iter()
            .rev()
            .find(|m| m.peer == peer && m.progress.load(Ordering::Relaxed) > 0)
            .map(|m| m.id);
        let Some(id) = victim else {
            return false;
        };
        let m = s.remove_connection(id).expect("found above");
        m.t.shutdown();
        sh.counters.share_evictions.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Stop waiting (the request gave up).
    pub(crate) fn give_up(&self, claim: &mut Claim) {
        if claim.under {
            let mut s = self.shares.state.lock();
            assert!(s.under_waiting >= 1, "a claim stops waiting twice");
            s.under_waiting -= 1;
            claim.under = false;
        }
    }

    /// Give back `bytes` taken by [`PeerBudget::try_take`] (`work`: taken
    /// as work).
    pub(crate) fn give_back(&self, bytes: u64, work: bool) {
        if bytes == 0 {
            return;
        }
        let mut s = self.shares.state.lock();
        let h = s.holding(&self.peer);
        assert!(
            h.bytes >= bytes,
            "a peer gives back more bytes than it holds"
        );
        h.bytes -= bytes;
        if work {
            assert!(h.work >= bytes, "a peer gives back more work than it holds");
            h.work -= bytes;
        }
        assert!(
            s.bytes >= bytes,
            "the server's budget gets back more than it lent"
        );
        s.bytes -= bytes;
        s.tidy(&self.peer);
        let kicks = s.serve_waiters(bytes);
        drop(s);
        for t in kicks {
            t.kick();
        }
    }

    /// Count a request of `bytes` as waiting (again, after a kick took it
    /// off) behind those waiting before it, its connection `t` kicked
    /// when bytes come back (`under`: it waits under its peer's
    /// guarantee). `token`: its number, given at the first wait.
    fn await_bytes(&self, token: &mut Option<u64>, bytes: u64, under: bool, t: &Arc<Transport>) {
        let mut s = self.shares.state.lock();
        let token = *token.get_or_insert_with(|| {
            s.next_waiter += 1;
            s.next_waiter
        });
        match s.waiters.iter_mut().find(|w| w.token == token) {
            Some(w) => w.under = under,
            None => s.waiters.push_back(Waiter {
                token,
                bytes,
                under,
                t: Arc::clone(t),
            }),
        }
    }

    /// A request waits no more (served, refused or dropped).
    fn stop_waiting(&self, token: Option<u64>) {
        if let Some(id) = token {
            self.shares.state.lock().waiters.retain(|w| w.token != id);
        }
    }
}

/// A request's wait for bytes of its peer's share, kept across looks —
/// on its connection's thread, or with the connection parked between
/// them: its claim (given up when the wait is dropped unserved), when it
/// gives up, when it next recalls borrowed bytes, and when it looks next.
pub(crate) struct BudgetWait {
    budget: PeerBudget,
    claim: Claim,
    /// Its connection, kicked when bytes come back.
    kick: Arc<Transport>,
    /// Its number among the waiters (`None`: not yet counted).
    token: Option<u64>,
    give_up: Instant,
    recall_at: Instant,
    next: Instant,
}

/// What one look at the budget found.
pub(crate) enum Look {
    /// The bytes are taken.
    Taken,
    /// Not yet: look again at [`BudgetWait::next`].
    Wait,
    /// The wait ran out (its claim is given up).
    Refused,
}

impl BudgetWait {
    /// A wait that began at `now` for `claim` (its first try failed) on
    /// the connection `kick`, given up after `patience`.
    pub(crate) fn new(
        budget: &PeerBudget,
        claim: Claim,
        kick: &Arc<Transport>,
        patience: Duration,
        now: Instant,
    ) -> Self {
        BudgetWait {
            budget: budget.clone(),
            claim,
            kick: Arc::clone(kick),
            token: None,
            give_up: now + patience,
            recall_at: now + RECALL_AFTER,
            next: now,
        }
    }

    /// When the wait looks next.
    pub(crate) fn next(&self) -> Instant {
        self.next
    }

    /// Look at `now`: take `bytes` if the share allows; if not, recall
    /// borrowed bytes once a second while under its guarantee, give up
    /// past the patience, or wait — counted among the waiters, whom bytes
    /// coming back kick, and looking again by itself after
    /// [`LOOK_AGAIN`].
    pub(crate) fn look(&mut self, bytes: u64, now: Instant) -> Look {
        if self.budget.try_take(bytes, &mut self.claim) {
            self.budget.stop_waiting(self.token.take());
            return Look::Taken;
        }
        let under = PeerBudget::waits_under_share(&self.claim);
        if now >= self.recall_at && under {
            // Under its guarantee and still waiting: take borrowed bytes
            // back from the peer furthest over its own.
            self.budget.recall();
            self.recall_at = now + RECALL_AFTER;
        }
        if now >= self.give_up {
            self.budget.give_up(&mut self.claim);
            self.budget.stop_waiting(self.token.take());
            return Look::Refused;
        }
        // Counted before the last try: bytes that come back after it kick.
        self.budget
            .await_bytes(&mut self.token, bytes, under, &self.kick);
        if self.budget.try_take(bytes, &mut self.claim) {
            self.budget.stop_waiting(self.token.take());
            return Look::Taken;
        }
        self.next = (now + LOOK_AGAIN).min(self.give_up);
        Look::Wait
    }
}

impl Drop for BudgetWait {
    /// A wait dropped unserved (its connection died or closed) stops
    /// counting among those that go first, and among the waiters.
    fn drop(&mut self) {
        self.budget.give_up(&mut self.claim);
        self.budget.stop_waiting(self.token.take());
    }
}

#[cfg(test)]
mod tests;
