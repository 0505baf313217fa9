//! The export's connections across store restarts: one thread per
//! connection that reads its replies and, when it dies, reconnects (the
//! handshake, TLS included, redone in full); the write accounting behind
//! the durability contract; and the counters the metrics show.
//!
//! The contract: a write the store acknowledged without FUA may sit in its
//! cache until a FLUSH; if the connection it was acknowledged on dies
//! before a successful FLUSH covered it, the store may have lost it, so the
//! export's next FLUSH fails (EIO) — once — and a FLUSH that succeeds
//! covers every write acknowledged before it was sent. No acknowledged
//! payload is kept for replay; requests not yet answered are re-sent by
//! their callers, who still hold their buffers.

use super::*;
use crate::stats::{LatencyCounter, LatencyHist};
use iopages_crypt::async_io;
use parking_lot::RwLock;
use std::sync::atomic::AtomicU64;

/// The first wait before reconnecting, doubled after each failed attempt.
pub(super) const RECONNECT_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between two attempts: a store back from a restart is
/// taken again within half a second (with 2 s, a store down for 2 s was
/// taken back 1.1 s after it returned). An attempt at a store that is
/// down costs a refused connect, or at most the connect timeout.
pub(super) const RECONNECT_MAX: Duration = Duration::from_millis(500);

/// Unflushed writes, by number, and the losses a FLUSH must report.
#[derive(Default)]
pub(super) struct Durability {
    /// Writes acknowledged without FUA so far (each one's number).
    acked: AtomicU64,
    /// Every write numbered up to this was covered by a successful FLUSH.
    flushed: AtomicU64,
    /// Connections that died holding acknowledged, unflushed writes.
    lost: AtomicU64,
    /// `lost` as the last FLUSH reported it.
    reported: AtomicU64,
}

impl Durability {
    /// Number the write just acknowledged.
    ///
    /// **Returns:** its number (the newest).
    pub(super) fn acked(&self) -> u64 {
        self.acked.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The newest write number so far (taken before a FLUSH is sent: the
    /// FLUSH covers up to it).
    pub(super) fn newest(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }

    /// A connection whose newest acknowledged write is `last_ack` died.
    pub(super) fn connection_died(&self, last_ack: u64) {
        if last_ack > self.flushed.load(Ordering::SeqCst) {
            self.lost.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A FLUSH sent when the newest write was `upto` succeeded.
    ///
    /// **Returns:** whether writes may have been lost since the last FLUSH
    /// reported (each loss is reported once).
    pub(super) fn flushed(&self, upto: u64) -> bool {
        debug_assert!(
            upto <= self.acked.load(Ordering::SeqCst),
            "a FLUSH covers writes not yet acknowledged"
        );
        self.flushed.fetch_max(upto, Ordering::SeqCst);
        let lost = self.lost.load(Ordering::SeqCst);
        self.reported.swap(lost, Ordering::SeqCst) != lost
    }
}

/// Counters of one remote export, for the metrics.
#[derive(Default)]
pub(super) struct RemoteCounters {
    pub(super) reconnects: AtomicU64,
    pub(super) resent: AtomicU64,
    pub(super) started: AtomicU64,
    pub(super) deadline_failures: AtomicU64,
    pub(super) unreachable_failures: AtomicU64,
    pub(super) lost_flushes: AtomicU64,
    /// From sending a request to its reply.
    pub(super) rtt: LatencyCounter,
}

/// A remote export's state as the metrics and health checks see it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RemoteHealth {
    /// Connections serving now.
    pub connected: usize,
    /// Connections wanted (every one reconnects on its own).
    pub connections: usize,
    /// Whether the store is reachable: at least one connection serves.
    pub reachable: bool,
    /// Seconds since no connection has served (0 while reachable).
    pub down_seconds: f64,
    /// Why the last connection or attempt failed.
    pub last_error: Option<String>,
    /// Connections made again after one died.
    pub reconnects: u64,
    /// Requests sent again after their connection died unanswered.
    pub resent: u64,
    /// Requests started without a waiting thread (sent by the submitting
    /// thread, ended by the connection's reader).
    pub started: u64,
    /// Requests failed for their deadline.
    pub deadline_failures: u64,
    /// Requests failed because the store stayed unreachable past
    /// `reconnect-delay`.
    pub unreachable_failures: u64,
    /// FLUSHes failed because acknowledged writes may have been lost.
    pub lost_flushes: u64,
    /// Store round trips (a request sent to its reply).
    pub round_trips: LatencyHist,
}

/// The connections' state, under the pool's mutex.
struct PoolState {
    /// The socket each connection's thread is handshaking on now, to shut
    /// down at stop.
    connecting: Vec<Option<Stream>>,
    /// Since when no connection has served.
    down_since: Option<Instant>,
    /// Why the last connection to die died.
    lost: Option<String>,
    /// Why the last reconnect attempt failed (cleared by a success).
    attempt: Option<String>,
    stopping: bool,
    /// Requests finding no connection fail at once.
    no_waiting: bool,
}

impl PoolState {
    /// Why the store is not served: the last death, and the last failed
    /// attempt since.
    fn why(&self) -> String {
        match (&self.lost, &self.attempt) {
            (Some(l), Some(a)) => format!("{l}; then {a}"),
            (Some(e), None) | (None, Some(e)) => e.clone(),
            (None, None) => "no connection".into(),
        }
    }
}

/// The export's connections: what callers pick from, and what each
/// connection's thread replaces.
pub(super) struct Pool {
    /// The live connection of each slot (`None` while it reconnects).
    conns: RwLock<Vec<Option<Arc<Conn>>>>,
    state: Mutex<PoolState>,
    /// Notified when a connection comes or goes, and at stop.
    changed: Condvar,
    next: AtomicUsize,
    pub(super) durability: Arc<Durability>,
    pub(super) counters: Arc<RemoteCounters>,
    pub(super) dialer: Dialer,
    /// What the first handshake learnt: a store that comes back with
    /// anything else is refused.
    info: ExportInfo,
    reconnect_delay: Duration,
}

impl Pool {
    /// A pool of `n` connections, none installed yet.
    pub(super) fn new(n: usize, dialer: Dialer, info: ExportInfo, reconnect: Duration) -> Pool {
        Pool {
            conns: RwLock::new(vec![None; n]),
            state: Mutex::new(PoolState {
                connecting: (0..n).map(|_| None).collect(),
                down_since: None,
                lost: None,
                attempt: None,
                stopping: false,
                no_waiting: false,
            }),
            changed: Condvar::new(),
            next: AtomicUsize::new(0),
            durability: Arc::default(),
            counters: Arc::default(),
            dialer,
            info,
            reconnect_delay: reconnect,
        }
    }

    /// A live connection without waiting: each thread keeps to its own
    /// (threads are spread round-robin), so that the requests one client
    /// connection sends in a burst reach the store on one connection and
    /// their replies wake one reader once for many; the next live one
    /// when its own is down.
    pub(super) fn pick(&self) -> Option<Arc<Conn>> {
        let conns = self.conns.read();
        let first = self.in_turn(&conns).next().cloned();
        first
    }

    /// The live connections, this thread's own first (see
    /// [`Pool::pick`]), then the others in turn.
    pub(super) fn live_from_mine(&self) -> Vec<Arc<Conn>> {
        let conns = self.conns.read();
        let live = self.in_turn(&conns).cloned().collect();
        live
    }

    /// The live ones of `conns`, from this thread's own on: its lane's
    /// ([`async_io::in_lane`]: a server thread serving one client among
    /// many), else the thread's (threads are numbered round-robin on
    /// first use).
    fn in_turn<'a>(&self, conns: &'a [Option<Arc<Conn>>]) -> impl Iterator<Item = &'a Arc<Conn>> {
        thread_local!(static MINE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) });
        let n = conns.len();
        let first = async_io::lane().unwrap_or_else(|| {
            MINE.with(|m| {
                if m.get() == usize::MAX {
                    m.set(self.next.fetch_add(1, Ordering::Relaxed));
                }
                m.get()
            })
        }) % n;
        (0..n)
            .filter_map(move |i| conns[(first + i) % n].as_ref())
            .filter(|c| c.is_alive())
    }

    /// A live connection for `what`: at once when one serves, else waiting
    /// for a reconnect by `deadline` and within `reconnect-delay` of the
    /// moment the store became unreachable.
    ///
    /// **Returns:** the connection; `TimedOut` when the deadline passed
    /// first; `NotConnected` (EIO to NBD clients) naming the last failure
    /// once the store stayed unreachable past `reconnect-delay`, or at
    /// stop.
    pub(super) fn live(
        &self,
        what: &dyn Fn() -> String,
        deadline: Instant,
    ) -> io::Result<Arc<Conn>> {
        if let Some(c) = self.pick() {
            return Ok(c);
        }
        let mut s = self.state.lock();
        loop {
            if let Some(c) = self.pick() {
                return Ok(c);
            }
            let since = *s.down_since.get_or_insert_with(Instant::now);
            let window = since + self.reconnect_delay;
            let why = self.why(&s);
            if s.stopping || s.no_waiting {
                return Err(io::Error::new(
                    ErrorKind::NotConnected,
                    format!(
                        "{}: {} failed: the server is stopping: {why}",
                        self.dialer.uri,
                        what()
                    ),
                ));
            }
            let now = Instant::now();
            if now >= window {
                self.counters
                    .unreachable_failures
                    .fetch_add(1, Ordering::Relaxed);
                return Err(io::Error::new(
                    ErrorKind::NotConnected,
                    format!(
                        "{}: {} failed: the store has been unreachable for {:.1} s \
                         (reconnect-delay {} s): {why}",
                        self.dialer.uri,
                        what(),
                        now.duration_since(since).as_secs_f64(),
                        self.reconnect_delay.as_secs_f64()
                    ),
                ));
            }
            if now >= deadline {
                self.counters
                    .deadline_failures
                    .fetch_add(1, Ordering::Relaxed);
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "{}: {} failed: no connection to the store came back within {:?} \
                         of its submission: {why}",
                        self.dialer.uri,
                        what(),
                        self.dialer.timeout
                    ),
                ));
            }
            self.changed.wait_until(&mut s, window.min(deadline));
        }
    }

    /// Why the store is not served: [`PoolState::why`], or the reason a
    /// connection just given up died (before its thread took it out).
    fn why(&self, s: &PoolState) -> String {
        let dying = || {
            self.conns
                .read()
                .iter()
                .flatten()
                .find(|c| !c.is_alive())
                .cloned()
        };
        match (&s.lost, dying()) {
            (None, Some(c)) => c.death(),
            _ => s.why(),
        }
    }

    /// [`Pool::why`] once anything failed (a connection given up, taken
    /// out or not, or an attempt); `None` before.
    fn why_any(&self, s: &PoolState) -> Option<String> {
        let dying = self.conns.read().iter().flatten().any(|c| !c.is_alive());
        (s.lost.is_some() || s.attempt.is_some() || dying).then(|| self.why(s))
    }

    /// Put `conn` in slot `i` (the store is reachable again).
    ///
    /// **Returns:** `false` at stop (then `conn` is closed instead).
    pub(super) fn install(&self, i: usize, conn: Arc<Conn>) -> bool {
        let mut s = self.state.lock();
        if s.stopping {
            drop(s);
            conn.close();
            conn.ctl.shutdown();
            return false;
        }
        self.conns.write()[i] = Some(conn);
        s.down_since = None;
        s.attempt = None;
        self.changed.notify_all();
        true
    }

    /// Slot `i`'s connection `conn` died: take it out, and when none is
    /// left note since when the store has been unreachable.
    fn remove(&self, i: usize, conn: &Conn) {
        let mut s = self.state.lock();
        let why = conn.death();
        let mut conns = self.conns.write();
        conns[i] = None;
        if !conns.iter().flatten().any(|c| c.is_alive()) && s.down_since.is_none() {
            s.down_since = Some(Instant::now());
        }
        drop(conns);
        if !s.stopping {
            eprintln!("iopages-nbd: {why}; reconnecting");
        }
        s.lost = Some(why);
        self.changed.notify_all();
    }

    /// Requests finding no connection fail at once from now on.
    pub(super) fn stop_waiting(&self) {
        self.state.lock().no_waiting = true;
        self.changed.notify_all();
    }

    /// Stop: no more reconnecting, and handshakes in progress are cut.
    pub(super) fn stop(&self) {
        let mut s = self.state.lock();
        s.stopping = true;
        for c in s.connecting.iter().flatten() {
            c.shutdown();
        }
        self.changed.notify_all();
    }

    /// The live connections now (to close them at stop).
    pub(super) fn live_conns(&self) -> Vec<Arc<Conn>> {
        self.conns.read().iter().flatten().cloned().collect()
    }

    /// Connections serving now.
    pub(super) fn connected(&self) -> usize {
        self.conns
            .read()
            .iter()
            .flatten()
            .filter(|c| c.is_alive())
            .count()
    }

    /// The state and counters for the metrics and health checks.
    pub(super) fn health(&self) -> RemoteHealth {
        let s = self.state.lock();
        let connected = self.connected();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteHealth {
            connected,
            connections: self.conns.read().len(),
            reachable: connected > 0,
            down_seconds: match (connected, s.down_since) {
                (0, Some(t)) => t.elapsed().as_secs_f64(),
                _ => 0.0,
            },
            last_error: self.why_any(&s),
            reconnects: get(&c.reconnects),
            resent: get(&c.resent),
            started: get(&c.started),
            deadline_failures: get(&c.deadline_failures),
            unreachable_failures: get(&c.unreachable_failures),
            lost_flushes: get(&c.lost_flushes),
            round_trips: c.rtt.get(),
        }
    }

    /// Wait `d` unless stopping.
    ///
    /// **Returns:** `false` at stop.
    fn pause(&self, d: Duration) -> bool {
        let mut s = self.state.lock();
        let until = Instant::now() + d;
        while !s.stopping && !self.changed.wait_until(&mut s, until).timed_out() {}
        !s.stopping
    }

    /// One attempt at connection `i`: dial, handshake, check the export is
    /// the one first met.
    fn attempt(&self, i: usize) -> io::Result<(Arc<Conn>, Stream)> {
        let register = |s: &Stream| -> io::Result<()> {
            let mut st = self.state.lock();
            if st.stopping {
                return Err(io::Error::new(ErrorKind::NotConnected, "stopping"));
            }
            st.connecting[i] = Some(s.try_clone()?);
            Ok(())
        };
        let opened = self.dialer.open(&register);
        self.state.lock().connecting[i] = None;
        let (stream, info) = opened?;
        if info != self.info {
            return Err(io::Error::new(
                ErrorKind::InvalidData,
                format!(
                    "the store came back different ({}; it was {}): refused",
                    info.describe(),
                    self.info.describe()
                ),
            ));
        }
        self.dialer.conn(i, stream, self)
    }

    /// Reconnect slot `i`, backing off from [`RECONNECT_FIRST`] to
    /// [`RECONNECT_MAX`], until it works or the pool stops.
    ///
    /// **Returns:** the new connection and its read half; `None` at stop.
    fn reconnect(&self, i: usize) -> Option<(Arc<Conn>, Stream)> {
        let mut delay = RECONNECT_FIRST;
        let mut said = String::new();
        loop {
            if !self.pause(delay) {
                return None;
            }
            match self.attempt(i) {
                Ok(c) => {
                    if !self.install(i, c.0.clone()) {
                        return None;
                    }
                    self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "iopages-nbd: {} (connection {i}): reconnected",
                        self.dialer.uri
                    );
                    return Some(c);
                }
                Err(e) => {
                    let msg = format!("{} (connection {i}): reconnecting: {e}", self.dialer.uri);
                    if msg != said {
                        eprintln!("iopages-nbd: {msg}");
                        said = msg.clone();
                    }
                    self.state.lock().attempt = Some(msg);
                }
            }
            delay = (delay * 2).min(RECONNECT_MAX);
        }
    }

    /// Connection `i`'s thread: read replies while it lives, reconnect
    /// when it dies, until the pool stops. `first` is the connection made
    /// (and installed) at open.
    pub(super) fn run(self: Arc<Pool>, i: usize, first: (Arc<Conn>, Stream)) {
        let mut next = Some(first);
        while let Some((conn, read_half)) = next.take() {
            conn.clone().reader(read_half);
            self.remove(i, &conn);
            next = self.reconnect(i);
        }
    }
}

/// How to open one connection to the store.
pub(super) struct Dialer {
    pub(super) spec: RemoteSpec,
    pub(super) uri: String,
    pub(super) tls: Option<Connector>,
    pub(super) timeout: Duration,
    pub(super) max_in_flight: usize,
}

impl Dialer {
    /// Dial and handshake (TLS included), each within the timeout;
    /// `register` sees the socket first (to be shut down at stop).
    pub(super) fn open(
        &self,
        register: &dyn Fn(&Stream) -> io::Result<()>,
    ) -> io::Result<(Stream, ExportInfo)> {
        let mut s = dial(&self.spec, self.timeout)?;
        register(&s)?;
        s.set_timeouts(self.timeout, self.timeout)?;
        // One deadline for the whole handshake (and its TLS handshake).
        let deadline = Instant::now() + self.timeout;
        let info = handshake(&mut s, &self.spec.export, self.tls.as_ref(), deadline)?;
        Ok((s, info))
    }

    /// Connection `i` over `s`, handshake done, and its read half.
    pub(super) fn conn(&self, i: usize, s: Stream, pool: &Pool) -> io::Result<(Arc<Conn>, Stream)> {
        let tick = (self.timeout / 8).clamp(Duration::from_millis(1), Duration::from_millis(250));
        s.set_timeouts(tick, self.timeout)?;
        let (writer, ctl) = (s.try_clone()?, s.try_clone()?);
        let conn = Arc::new(Conn {
            name: format!("{} (connection {i})", self.uri),
            writer: Mutex::new(writer),
            ctl,
            shared: Mutex::new(Shared {
                pending: HashMap::new(),
                next_cookie: 1,
                dead: None,
                closing: false,
                last_ack: 0,
                reader_gone: false,
            }),
            room: Condvar::new(),
            alive: AtomicBool::new(true),
            max_in_flight: self.max_in_flight,
            timeout: self.timeout,
            durability: pool.durability.clone(),
            counters: pool.counters.clone(),
            held: Mutex::new(Vec::new()),
            tail: Mutex::new(None),
            has_tail: AtomicBool::new(false),
            tail_done: Condvar::new(),
            wake: crate::sys::eventfd()?,
        });
        Ok((conn, s))
    }
}

impl ExportInfo {
    /// E.g. "67108864 bytes, flags 0x1cd, blocks 1/4096/33554432".
    fn describe(&self) -> String {
        format!(
            "{} bytes, flags {:#x}, blocks {}/{}/{}",
            self.size, self.flags, self.min_block, self.pref_block, self.max_block
        )
    }
}
