//! Connections waiting for their clients, held without a thread: [`Parking`].
//!
//! A connection whose client has not sent what comes next — its handshake's
//! next bytes, its next request, the rest of one — gives its thread up
//! (requests in flight or not: their completions send their replies) —
//! in transmission after its watcher has lingered up to
//! `ServerOptions::park_after` while no other connection was ready
//! ([`lot_fd`]): its socket is watched here, in one `epoll` instance,
//! until the client sends something (or hangs up, or the server shuts the
//! socket down for another peer's share), the socket has room for replies
//! waiting for it, a reply finds the socket full (its wake-up descriptor
//! is watched too while requests are in flight), its deadline passes, or
//! the server stops. This is the server's event
//! loop: the watchers below serve every connection that comes back.
//!
//! The threads that wait on the epoll instance serve what they are woken
//! for themselves (leader/followers): the thread that takes a ready
//! connection runs it ([`Parked::run`]) there and then, with no hand-off
//! to another thread and no thread started, so a connection that comes
//! back costs one wake-up, as a thread blocked on its socket would. While
//! one serves, the others keep watching; when none is left watching, the
//! keeper thread (`nbd-idle`, which also closes connections at their idle
//! deadlines) starts another once every watcher has served for [`GRACE`]
//! with none coming back to the epoll instance meanwhile, so a connection
//! that holds its thread (one waiting for the byte budget, a WRITE_ZEROES
//! flood waiting for its share) never holds up the others; watchers
//! serving connections in turn come back between them and get no company.
//! [`watchers_kept`] watchers (one per core) stay however long they wait;
//! more end after [`LINGER`] with nothing to serve, but never the last
//! one watching. Each asks the scheduler for a short time slice, so it
//! runs soon after it wakes.
//!
//! A connection that waits for time itself — a request looking at the
//! byte budget again after a few milliseconds — parks with its deadline
//! set to that look: at it the keeper makes the connection's wake-up
//! descriptor ready ([`Parked::turn`]) instead of closing it, and a
//! watcher runs it.
//!
//! Owns: the epoll instance, the watcher threads and the keeper, the parked
//! connections' resumptions, their idle deadlines and their turns. Must never: resume a
//! connection twice, lose one (every parked connection is run, or closed
//! at its deadline or by [`Parking::stop`], exactly once), take a
//! connection after the stop (the caller keeps it and closes it itself), or
//! end the stop before every thread has ended.

use crate::sys;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a parked connection's socket is watched for, beside a hang-up or
/// an error (always).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Watch {
    /// Input, or the peer's end of sending (not while a request read
    /// whole waits for its place or its bytes: the input behind it stays
    /// unread until then, and would make the socket ready again at once).
    pub(crate) read: bool,
    /// Room to write (replies wait for it).
    pub(crate) out: bool,
}

/// Why a parked connection is closed rather than run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Its idle deadline passed with nothing received.
    Idle,
    /// The server stops.
    Stop,
}

/// A parked connection.
pub(crate) trait Parked: Send + 'static {
    /// What the stop uses to cut it short while a watcher serves it.
    type Handle: Send + 'static;
    /// Its handle, taken when a watcher starts serving it.
    fn handle(&self) -> Self::Handle;
    /// Cut a connection being served short (it ends soon after).
    fn cut(handle: &Self::Handle);
    /// Its client sent something (or hung up): serve it on this thread,
    /// until it parks again or ends.
    fn run(self);
    /// Its idle deadline as it stands now, looked at when the one it was
    /// parked with passes (a connection parked with requests in flight is
    /// idle only from its last completion): a later one keeps it parked,
    /// `None` keeps it without one.
    fn idle_deadline(&self) -> Option<Instant>;
    /// Close it without serving it.
    fn close(self, why: Wake);
    /// Whether the deadline that passed (`now`) is its turn rather than
    /// its close: it waits for time itself (a request's next look at the
    /// byte budget). Parked with a second descriptor, it is then given
    /// [`Parked::turn`] and stays parked without a deadline until a
    /// watcher runs it.
    fn turn_due(&self, _now: Instant) -> bool {
        false
    }
    /// Make its second descriptor ready, so that a watcher runs it
    /// (called by the keeper with the lot unlocked).
    fn turn(_handle: &Self::Handle) {}
}

/// Watchers kept however long they wait, in tests.
#[cfg(test)]
const KEEP: usize = 2;

/// Watchers kept however long they wait: one per core, at least two (so
/// that one watches while another serves).
pub(crate) fn watchers_kept() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
}

/// The time slice a watcher asks the scheduler for (EEVDF's custom slice;
/// the default is 0.75 ms times 1 + log2 of the CPUs).
const WATCHER_SLICE: Duration = Duration::from_micros(100);
/// How long a watcher past those kept waits for a connection before it
/// ends.
pub(crate) const LINGER: Duration = Duration::from_millis(100);

/// How long the keeper lets every watcher serve before it starts another:
/// what a connection that holds its thread (one waiting for the budget)
/// can delay the others by.
const GRACE: Duration = Duration::from_millis(1);

thread_local! {
    /// On a watcher thread, its lot's epoll instance.
    static LOT: std::cell::Cell<Option<RawFd>> = const { std::cell::Cell::new(None) };
    /// On a watcher thread, its number (its key in `State::serving`).
    static WATCHER: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// On a watcher thread, its lot's epoll instance: readable while other
/// connections are ready (a connection lingering for its next request is
/// parked then, so the watcher serves them).
pub(crate) fn lot_fd() -> Option<RawFd> {
    LOT.with(std::cell::Cell::get)
}

/// What the keeper does with every watcher serving.
#[derive(Debug, PartialEq, Eq)]
enum Grace {
    /// Wait (the grace) until then, and look again.
    Until(Instant),
    /// Start a watcher.
    Add,
}

/// The keeper's rule with every watcher serving, at `now`: `graced` is the
/// grace it waits out (the watchers' returns to the lot when it began,
/// and when), `returns` their returns now. A grace begins at the first
/// look and again whenever a watcher came back meanwhile; one that ends
/// with none back starts a watcher.
///
/// **Returns:** the grace to keep, and the step.
fn grace_rule(
    graced: Option<(u64, Instant)>,
    returns: u64,
    now: Instant,
) -> (Option<(u64, Instant)>, Grace) {
    match graced {
        Some((r, since)) if r == returns && now >= since + GRACE => (None, Grace::Add),
        Some((r, since)) if r == returns => (graced, Grace::Until(since + GRACE)),
        _ => (Some((returns, now)), Grace::Until(now + GRACE)),
    }
}

/// The token of the stop's wake-up descriptor.
const WAKE_TOKEN: u64 = 0;

struct Entry<T> {
    fd: RawFd,
    /// A second descriptor watched for the same connection (its wake-up
    /// eventfd, kicked when replies wait for the socket).
    also: Option<RawFd>,
    deadline: Option<Instant>,
    item: T,
}

struct State<T: Parked> {
    entries: HashMap<u64, Entry<T>>,
    /// The entries with a deadline, earliest first.
    deadlines: BTreeSet<(Instant, u64)>,
    /// The next token (0 is the wake-up descriptor's).
    next: u64,
    closed: bool,
    /// Watchers alive, and of them those waiting on the epoll instance.
    alive: usize,
    watching: usize,
    /// Times a watcher came back to the epoll instance: a watcher serving
    /// connections in turn comes back between them.
    returns: u64,
    /// The keeper waits out a grace with every watcher serving: `returns`
    /// and the time when it began.
    graced: Option<(u64, Instant)>,
    /// The connection each serving watcher runs, by watcher.
    serving: HashMap<u64, T::Handle>,
    next_watcher: u64,
    threads: Vec<JoinHandle<()>>,
}

impl<T> Entry<T> {
    /// Stop watching its descriptors.
    fn forget(&self, ep: std::os::fd::BorrowedFd<'_>) {
        sys::epoll_forget(ep, self.fd);
        if let Some(a) = self.also {
            sys::epoll_forget(ep, a);
        }
    }
}

impl<T: Parked> State<T> {
    fn take(&mut self, token: u64) -> Option<Entry<T>> {
        let e = self.entries.remove(&token)?;
        if let Some(d) = e.deadline {
            self.deadlines.remove(&(d, token));
        }
        Some(e)
    }
}

/// The parking lot of a server's idle connections.
pub(crate) struct Parking<T: Parked> {
    ep: OwnedFd,
    /// Written once, at the stop, and never read: every watcher's wait
    /// then ends at once.
    wake: OwnedFd,
    state: Mutex<State<T>>,
    /// The keeper's wait: an earlier deadline, every watcher serving, the
    /// stop.
    keeper_cv: Condvar,
    keeper: Mutex<Option<JoinHandle<()>>>,
    /// Watchers kept, and how long the others linger.
    keep: usize,
    linger: Duration,
}

impl<T: Parked> Parking<T> {
    /// A parking lot with its keeper and `keep` watchers (at least one);
    /// watchers past `keep` end after `linger` without a connection.
    ///
    /// **Returns:** the error of `epoll_create1`, `eventfd` or a thread's
    /// start.
    pub(crate) fn start(keep: usize, linger: Duration) -> io::Result<Arc<Parking<T>>> {
        let p = Arc::new(Parking {
            ep: sys::epoll()?,
            wake: sys::eventfd()?,
            state: Mutex::new(State {
                entries: HashMap::new(),
                deadlines: BTreeSet::new(),
                next: WAKE_TOKEN + 1,
                closed: false,
                alive: 0,
                watching: 0,
                returns: 0,
                graced: None,
                serving: HashMap::new(),
                next_watcher: 0,
                threads: Vec::new(),
            }),
            keeper_cv: Condvar::new(),
            keeper: Mutex::new(None),
            keep: keep.max(1),
            linger,
        });
        sys::epoll_watch(p.ep.as_fd(), p.wake_fd(), WAKE_TOKEN, false)?;
        let p2 = Arc::clone(&p);
        let h = std::thread::Builder::new()
            .name("nbd-idle".into())
            .spawn(move || p2.keep_deadlines())?;
        *p.keeper.lock() = Some(h);
        for _ in 0..p.keep {
            let mut s = p.state.lock();
            if let Err(e) = p.add_watcher(&mut s) {
                drop(s);
                p.stop();
                return Err(e);
            }
        }
        Ok(p)
    }

    fn wake_fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.wake.as_raw_fd()
    }

    /// Start a watcher (the state is locked by the caller).
    fn add_watcher(self: &Arc<Self>, s: &mut State<T>) -> io::Result<()> {
        s.threads.retain(|t| !t.is_finished());
        let id = s.next_watcher;
        let me = Arc::clone(self);
        let t = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || me.watch(id))?;
        s.next_watcher += 1;
        s.alive += 1;
        s.threads.push(t);
        Ok(())
    }

    /// Hold `item`, the connection whose socket is `fd`, until it is
    /// ready — readable, or with `out` writable too (what it has to send
    /// waits for room), or `also` readable — its `deadline` passes or the
    /// server stops; then run or close it (see the module's notes). `fd`
    /// must stay open until then: `item` owns it.
    ///
    /// **Returns:** `Err(item)` after [`Parking::stop`], or when the socket
    /// cannot be watched: the caller goes on serving the connection.
    pub(crate) fn park(
        &self,
        fd: RawFd,
        also: Option<RawFd>,
        watch: Watch,
        deadline: Option<Instant>,
        item: T,
    ) -> Result<(), T> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(item);
        }
        let token = s.next;
        s.next += 1;
        // Parked by the watcher serving it: no longer served (under the
        // same lock, so the stop never both cuts it and closes it).
        if let Some(id) = WATCHER.with(std::cell::Cell::get) {
            s.serving.remove(&id);
        }
        let earliest = s.deadlines.first().map(|(d, _)| *d);
        // Entered before the socket is watched: a watcher woken at once
        // finds it.
        s.entries.insert(
            token,
            Entry {
                fd,
                also,
                deadline,
                item,
            },
        );
        // The socket stays in the epoll instance between parkings (its
        // one-shot watch disarmed when it fired): re-armed in one call.
        let watched =
            sys::epoll_rearm(self.ep.as_fd(), fd, token, watch.read, watch.out).and_then(|()| {
                let Some(a) = also else { return Ok(()) };
                sys::epoll_watch(self.ep.as_fd(), a, token, true).inspect_err(|_| {
                    sys::epoll_forget(self.ep.as_fd(), fd);
                })
            });
        if let Err(e) = watched {
            eprintln!("iopages-nbd: cannot hold an idle connection without its thread: {e}");
            let e = s.entries.remove(&token).expect("entered above");
            return Err(e.item);
        }
        if let Some(d) = deadline {
            s.deadlines.insert((d, token));
            if earliest.is_none_or(|e| d < e) {
                // The keeper may be waiting for a later deadline.
                self.keeper_cv.notify_one();
            }
        }
        Ok(())
    }

    /// How many connections are parked.
    pub(crate) fn parked(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// How many times a watcher has come back to the epoll instance.
    #[cfg(test)]
    pub(crate) fn returns(&self) -> u64 {
        self.state.lock().returns
    }

    /// How many watcher threads are alive.
    #[cfg(test)]
    pub(crate) fn watchers(&self) -> usize {
        self.state.lock().alive
    }

    /// Take no more connections: cut every connection being served short,
    /// close every parked one with [`Wake::Stop`] on the calling thread,
    /// and join every thread. Idempotent.
    pub(crate) fn stop(&self) {
        let left: Vec<Entry<T>> = {
            let mut s = self.state.lock();
            s.closed = true;
            for h in s.serving.values() {
                T::cut(h);
            }
            s.deadlines.clear();
            s.entries.drain().map(|(_, e)| e).collect()
        };
        // Never read: every watcher's wait ends now and at every later
        // try. It cannot fail short of a counter at its maximum.
        sys::eventfd_signal(self.wake.as_fd());
        self.keeper_cv.notify_all();
        for e in left {
            e.forget(self.ep.as_fd());
            e.item.close(Wake::Stop);
        }
        if let Some(h) = self.keeper.lock().take() {
            let _ = h.join();
        }
        // Watchers end at their next look at the state; one serving ends
        // when its cut connection does.
        let threads = std::mem::take(&mut self.state.lock().threads);
        for t in threads {
            let _ = t.join();
        }
    }

    /// A watcher: wait for a ready connection and serve it, until the
    /// stop, or until it has waited `linger` with more than `keep` alive
    /// and another watching.
    fn watch(self: Arc<Self>, id: u64) {
        // A watcher serves every connection that comes back: asked for a
        // short time slice, it is run soon after it wakes rather than
        // after the client threads that its replies woke (best effort:
        // kernels before 6.12 keep their slice).
        let _ = sys::set_time_slice(WATCHER_SLICE);
        {
            use std::os::fd::AsRawFd;
            LOT.with(|l| l.set(Some(self.ep.as_raw_fd())));
        }
        WATCHER.with(|w| w.set(Some(id)));
        let mut tokens = [0u64; 1];
        loop {
            let timeout = {
                let mut s = self.state.lock();
                if s.closed {
                    s.alive -= 1;
                    return;
                }
                s.watching += 1;
                s.returns += 1;
                (s.alive > self.keep).then_some(self.linger)
            };
            let got = sys::epoll_wait(self.ep.as_fd(), &mut tokens, sys::poll_ms(timeout));
            let mut s = self.state.lock();
            s.watching -= 1;
            let n = match got {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Cannot happen with a valid instance and buffer.
                    eprintln!("iopages-nbd: epoll_wait failed: {e}");
                    drop(s);
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            // A watcher past keep ends after its linger only while another
            // watches: the kept ones may all be serving, and the keeper
            // starts one only when a watcher goes to serve.
            if s.closed || (n == 0 && s.alive > self.keep && s.watching > 0) {
                s.alive -= 1;
                return;
            }
            let Some(e) = (n == 1).then(|| s.take(tokens[0])).flatten() else {
                continue;
            };
            s.serving.insert(id, e.item.handle());
            if s.watching == 0 && s.graced.is_none() {
                // None left watching: the keeper starts one if it lasts
                // (one already waiting out a grace looks again at its end).
                self.keeper_cv.notify_one();
            }
            drop(s);
            // The socket's watch fired and is disarmed; it stays for the
            // next parking. A second descriptor is taken out (it may
            // still fire).
            if let Some(a) = e.also {
                sys::epoll_forget(self.ep.as_fd(), a);
            }
            // A connection that panics ends alone (what it held is dropped
            // as it unwinds); the watcher goes on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.item.run()));
            self.state.lock().serving.remove(&id);
        }
    }

    /// Take the entries whose idle deadlines have passed by `now`; one
    /// whose deadline has moved on since it parked stays, under its new
    /// one, and one whose deadline is a turn ([`Parked::turn_due`]) stays,
    /// its handle added to `turns` (to be made ready once the lot is
    /// unlocked).
    fn due(&self, s: &mut State<T>, now: Instant, turns: &mut Vec<T::Handle>) -> Vec<Entry<T>> {
        let mut due = Vec::new();
        while let Some(&(d, t)) = s.deadlines.first() {
            if d > now {
                break;
            }
            s.deadlines.pop_first();
            let Some(e) = s.entries.get_mut(&t) else {
                continue;
            };
            match e.item.idle_deadline() {
                Some(later) if later > now => {
                    e.deadline = Some(later);
                    s.deadlines.insert((later, t));
                }
                None => e.deadline = None,
                Some(_) if e.also.is_some() && e.item.turn_due(now) => {
                    e.deadline = None;
                    turns.push(e.item.handle());
                }
                Some(_) => due.extend(s.entries.remove(&t)),
            }
        }
        due
    }

    /// The keeper's look at the watchers: when every one has served, none
    /// coming back to the epoll instance, for [`GRACE`], start another.
    /// Watchers serving connections in turn come back between them (more
    /// threads would not serve those faster); a watcher held by one
    /// connection — room in its bounds, a budget, long work such
    /// as a WRITE_ZEROES flood — does not, whether it waits or works.
    ///
    /// **Returns:** the end of the grace being waited out, if one is: the
    /// keeper looks again then (or at an earlier deadline).
    fn grace(self: &Arc<Self>, s: &mut State<T>) -> Option<Instant> {
        if s.watching > 0 || s.serving.is_empty() {
            s.graced = None;
            return None;
        }
        let (graced, step) = grace_rule(s.graced, s.returns, Instant::now());
        s.graced = graced;
        match step {
            Grace::Add => {
                if let Err(e) = self.add_watcher(s) {
                    eprintln!("iopages-nbd: cannot start a thread to watch idle connections: {e}");
                }
                None
            }
            Grace::Until(end) => Some(end),
        }
    }

    /// The keeper: close connections at their idle deadlines, and start a
    /// watcher when every one has served for a grace ([`Parking::grace`]).
    fn keep_deadlines(self: Arc<Self>) {
        let mut turns = Vec::new();
        loop {
            let due = {
                let mut s = self.state.lock();
                loop {
                    if s.closed {
                        return;
                    }
                    // Deadlines first: graces that follow each other under
                    // a steady load must not hold idle closes back.
                    let due = self.due(&mut s, Instant::now(), &mut turns);
                    if !due.is_empty() || !turns.is_empty() {
                        break due;
                    }
                    let deadline = s.deadlines.first().map(|(d, _)| *d);
                    let until = match (self.grace(&mut s), deadline) {
                        (Some(g), Some(d)) => Some(g.min(d)),
                        (g, d) => g.or(d),
                    };
                    match until {
                        Some(t) => {
                            self.keeper_cv.wait_until(&mut s, t);
                        }
                        None => self.keeper_cv.wait(&mut s),
                    }
                }
            };
            for h in turns.drain(..) {
                T::turn(&h);
            }
            for e in due {
                e.forget(self.ep.as_fd());
                e.item.close(Wake::Idle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: Watch = Watch {
        read: true,
        out: false,
    };
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::thread::ThreadId;

    /// What happened to a parked test connection.
    #[derive(Debug, PartialEq, Eq)]
    enum Event {
        Ran(ThreadId),
        Closed(Wake),
    }

    /// A parked test connection: its socket, where what happens to it is
    /// reported, and (`hold`) a flag its run waits for, as a stalled
    /// client holds its thread until the stop cuts it.
    struct Item {
        _sock: UnixStream,
        tx: Sender<Event>,
        hold: Option<Arc<AtomicBool>>,
        deadline: Option<Instant>,
    }

    impl Parked for Item {
        type Handle = Option<Arc<AtomicBool>>;
        fn handle(&self) -> Self::Handle {
            self.hold.clone()
        }
        fn cut(h: &Self::Handle) {
            if let Some(h) = h {
                h.store(true, Ordering::SeqCst);
            }
        }
        fn run(self) {
            if let Some(h) = &self.hold {
                while !h.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let _ = self.tx.send(Event::Ran(std::thread::current().id()));
        }
        fn close(self, why: Wake) {
            let _ = self.tx.send(Event::Closed(why));
        }
        fn idle_deadline(&self) -> Option<Instant> {
            self.deadline
        }
    }

    /// A connection parked in `p`: the client's end, what happens to it,
    /// and its hold flag when `hold`.
    fn parked(
        p: &Parking<Item>,
        deadline: Option<Instant>,
        hold: bool,
    ) -> (UnixStream, Receiver<Event>, Option<Arc<AtomicBool>>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        let fd = ours.as_raw_fd();
        let hold = hold.then(|| Arc::new(AtomicBool::new(false)));
        let item = Item {
            _sock: ours,
            tx,
            hold: hold.clone(),
            deadline,
        };
        assert!(p.park(fd, None, READ, deadline, item).is_ok());
        (theirs, rx, hold)
    }

    const LONG: Duration = Duration::from_secs(10);

    fn ran(rx: &Receiver<Event>) -> ThreadId {
        match rx.recv_timeout(LONG) {
            Ok(Event::Ran(id)) => id,
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[test]
    fn input_a_hang_up_and_a_deadline_each_resume_once() {
        let p = Parking::start(KEEP, LINGER).unwrap();
        let (mut a, ra, _) = parked(&p, None, false);
        let (b, rb, _) = parked(&p, None, false);
        let (_c, rc, _) = parked(&p, Some(Instant::now() + Duration::from_millis(50)), false);
        let (_d, rd, _) = parked(&p, Some(Instant::now() + Duration::from_secs(3600)), false);
        assert_eq!(p.parked(), 4);
        a.write_all(b"x").unwrap();
        ran(&ra);
        drop(b);
        ran(&rb);
        assert_eq!(rc.recv_timeout(LONG), Ok(Event::Closed(Wake::Idle)));
        // Each once: the items went with their resumption.
        assert!(ra.recv_timeout(Duration::from_millis(100)).is_err());
        assert!(rb.try_recv().is_err() && rc.try_recv().is_err());
        assert_eq!(p.parked(), 1);
        assert!(rd.try_recv().is_err(), "a far deadline resumed early");
        p.stop();
        assert_eq!(rd.recv_timeout(LONG), Ok(Event::Closed(Wake::Stop)));
        assert_eq!((p.parked(), p.watchers()), (0, 0));
    }

    #[test]
    fn after_the_stop_a_connection_is_handed_back() {
        let p = Parking::start(KEEP, LINGER).unwrap();
        p.stop();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        let fd = ours.as_raw_fd();
        let item = Item {
            _sock: ours,
            tx,
            hold: None,
            deadline: None,
        };
        let back = p
            .park(fd, None, READ, None, item)
            .expect_err("parked after the stop");
        assert_eq!(back._sock.as_raw_fd(), fd);
        assert!(rx.try_recv().is_err(), "resumed although refused");
        p.stop(); // idempotent
    }

    #[test]
    fn an_earlier_deadline_wakes_a_keeper_waiting_for_a_later_one() {
        let p = Parking::start(KEEP, LINGER).unwrap();
        let (_a, ra, _) = parked(&p, Some(Instant::now() + Duration::from_secs(3600)), false);
        // The keeper now waits for an hour; a deadline of 50 ms must cut
        // that wait short.
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        let (_b, rb, _) = parked(&p, Some(Instant::now() + Duration::from_millis(50)), false);
        assert_eq!(rb.recv_timeout(LONG), Ok(Event::Closed(Wake::Idle)));
        assert!(
            t.elapsed() >= Duration::from_millis(50),
            "resumed before its deadline"
        );
        assert!(ra.try_recv().is_err());
        p.stop();
        assert_eq!(ra.recv_timeout(LONG), Ok(Event::Closed(Wake::Stop)));
    }

    #[test]
    fn connections_coming_back_are_served_by_the_watchers_without_new_threads() {
        // Two kept: while one serves, the other watches, so none is ever
        // short and no thread is started.
        let p = Parking::start(2, LONG).unwrap();
        let mut threads = std::collections::HashSet::new();
        for _ in 0..20 {
            let (mut a, ra, _) = parked(&p, None, false);
            a.write_all(b"x").unwrap();
            threads.insert(ran(&ra));
        }
        assert!(threads.len() <= 2, "{} threads served", threads.len());
        assert_eq!(p.watchers(), 2);
        p.stop();
    }

    #[test]
    fn stalled_connections_never_hold_up_the_others_and_the_stop_cuts_them() {
        let p = Parking::start(1, Duration::from_millis(20)).unwrap();
        // Three connections that hold their threads (clients that stop
        // reading), one after the other, and one more after them.
        let mut stalled = Vec::new();
        for _ in 0..3 {
            let (mut a, ra, hold) = parked(&p, None, true);
            a.write_all(b"x").unwrap();
            stalled.push((a, ra, hold.unwrap()));
        }
        let (mut d, rd, _) = parked(&p, None, false);
        d.write_all(b"x").unwrap();
        ran(&rd);
        assert!(p.watchers() >= 4, "{} watchers", p.watchers());
        // Released, the extra watchers end after lingering, down to one.
        let (_, ra0, hold0) = &stalled[0];
        hold0.store(true, Ordering::SeqCst);
        ran(ra0);
        p.stop();
        for (_, ra, _) in &stalled[1..] {
            ran(ra);
        }
        assert_eq!(p.watchers(), 0);
    }

    /// A watcher serving one connection long without waiting on its
    /// client (long work, as WRITE_ZEROES floods make) gets company after
    /// the grace: another connection is served meanwhile.
    #[test]
    fn a_watcher_serving_long_gets_company_after_the_grace() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        let fd = ours.as_raw_fd();
        // Its run takes `.1`.
        struct Spin(Item, Duration);
        impl Parked for Spin {
            type Handle = ();
            fn handle(&self) {}
            fn cut(_: &()) {}
            fn run(self) {
                std::thread::sleep(self.1);
                self.0.run();
            }
            fn close(self, why: Wake) {
                self.0.close(why);
            }
            fn idle_deadline(&self) -> Option<Instant> {
                None
            }
        }
        let q = Parking::start(1, Duration::from_millis(20)).unwrap();
        let item = |sock, tx, spin| {
            let i = Item {
                _sock: sock,
                tx,
                hold: None,
                deadline: None,
            };
            Spin(i, spin)
        };
        let spinning = item(ours, tx, Duration::from_millis(300));
        assert!(q.park(fd, None, READ, None, spinning).is_ok());
        theirs.write_all(b"x").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let (ours_b, mut b) = UnixStream::pair().unwrap();
        let (tb, rb) = channel();
        let fd_b = ours_b.as_raw_fd();
        assert!(q
            .park(fd_b, None, READ, None, item(ours_b, tb, Duration::ZERO))
            .is_ok());
        b.write_all(b"x").unwrap();
        // Served while the first still spins.
        ran(&rb);
        assert!(rx.try_recv().is_err(), "the spinning one ended first");
        ran(&rx);
        q.stop();
    }

    #[test]
    fn a_grace_with_no_watcher_back_starts_one_and_a_return_restarts_it() {
        let t0 = Instant::now();
        // The first look begins a grace.
        let (g, step) = grace_rule(None, 5, t0);
        assert_eq!((g, step), (Some((5, t0)), Grace::Until(t0 + GRACE)));
        // Woken early, none back: the same grace, waited out to its end.
        let early = t0 + GRACE / 2;
        assert_eq!(grace_rule(g, 5, early), (g, Grace::Until(t0 + GRACE)));
        // At its end, none back: a watcher.
        assert_eq!(grace_rule(g, 5, t0 + GRACE), (None, Grace::Add));
        // A watcher came back meanwhile (serving connections in turn): a
        // new grace from now, however long the old one ran.
        let late = t0 + 3 * GRACE;
        assert_eq!(
            grace_rule(g, 6, late),
            (Some((6, late)), Grace::Until(late + GRACE))
        );
    }

    #[test]
    fn a_lingering_watcher_never_leaves_the_lot_unwatched() {
        // One kept: a held connection takes it, the keeper starts a second
        // watcher, and that one lingers past keep. Were it to end, the lot
        // would have no watcher while the held one serves, and a connection
        // coming back would wait forever (the keeper has no deadline to
        // wake for).
        let p = Parking::start(1, Duration::from_millis(10)).unwrap();
        let (mut a, ra, hold) = parked(&p, None, true);
        a.write_all(b"x").unwrap();
        let t = Instant::now();
        while p.watchers() < 2 && t.elapsed() < LONG {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(p.watchers(), 2, "one serving and one watching");
        // Many lingers later, the connection coming back is served.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(p.watchers(), 2, "the only watcher ended");
        let (mut b, rb, _) = parked(&p, None, false);
        b.write_all(b"x").unwrap();
        ran(&rb);
        hold.unwrap().store(true, Ordering::SeqCst);
        ran(&ra);
        p.stop();
        assert_eq!(p.watchers(), 0);
    }

    #[test]
    fn watchers_past_keep_end_after_lingering() {
        let p = Parking::start(1, Duration::from_millis(20)).unwrap();
        let held: Vec<_> = (0..2)
            .map(|_| {
                let (mut a, ra, hold) = parked(&p, None, true);
                a.write_all(b"x").unwrap();
                (a, ra, hold.unwrap())
            })
            .collect();
        let t = Instant::now();
        while p.watchers() < 3 && t.elapsed() < LONG {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(p.watchers(), 3, "two serving and one watching");
        for (_, ra, hold) in &held {
            hold.store(true, Ordering::SeqCst);
            ran(ra);
        }
        let t = Instant::now();
        while p.watchers() > 1 && t.elapsed() < LONG {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(p.watchers(), 1);
        p.stop();
    }
}
