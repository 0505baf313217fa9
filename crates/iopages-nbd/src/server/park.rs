//! Idle connections held without a thread: [`Parking`].
//!
//! A connection in transmission with nothing in flight, nothing buffered
//! and nothing received for [`PARK_AFTER`](crate::server::conn::PARK_AFTER)
//! gives its thread up: its socket is watched here, in one `epoll`
//! instance served by one thread, until the client sends something (or
//! hangs up, or the server shuts the socket down for another peer's
//! share), its idle deadline passes, or the server stops. Then its
//! `resume` runs with the reason — on the parking thread, which must
//! therefore never do more there than hand the connection to a thread of
//! its own or close it (nothing is in flight, so closing never waits).
//! The parking lot holds the connections as values of the caller's type
//! (`T`) and hands each back to one function, so a connection it cannot
//! take is handed back to the caller whole.
//!
//! Owns: the epoll instance, the parked connections' resumptions and
//! their idle deadlines. Must never: resume a connection twice, lose one
//! (every parked connection is resumed exactly once: by readiness, by its
//! deadline or by [`Parking::stop`]), or take a connection after the stop
//! (the caller keeps it and closes it itself).

use crate::sys;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Why a parked connection is resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Its socket has input, or hung up.
    Ready,
    /// Its idle deadline passed with nothing received.
    Idle,
    /// The server stops.
    Stop,
}

/// The token of the parking thread's own wake-up descriptor.
const WAKE_TOKEN: u64 = 0;

struct Entry<T> {
    fd: RawFd,
    deadline: Option<Instant>,
    item: T,
}

struct State<T> {
    entries: HashMap<u64, Entry<T>>,
    /// The entries with a deadline, earliest first.
    deadlines: BTreeSet<(Instant, u64)>,
    /// The next token (0 is the wake-up descriptor's).
    next: u64,
    closed: bool,
}

impl<T> State<T> {
    fn take(&mut self, token: u64) -> Option<Entry<T>> {
        let e = self.entries.remove(&token)?;
        if let Some(d) = e.deadline {
            self.deadlines.remove(&(d, token));
        }
        Some(e)
    }
}

/// The parking lot of a server's idle connections.
pub(crate) struct Parking<T> {
    ep: OwnedFd,
    /// Written to end the thread's wait: an earlier deadline, or the stop.
    wake: OwnedFd,
    state: Mutex<State<T>>,
    /// What every parked connection is handed back to, once.
    resume: fn(T, Wake),
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<T: Send + 'static> Parking<T> {
    /// A parking lot whose connections are resumed by `resume`, and its
    /// thread.
    ///
    /// **Returns:** the error of `epoll_create1`, `eventfd` or the thread's
    /// start.
    pub(crate) fn start(resume: fn(T, Wake)) -> io::Result<Arc<Parking<T>>> {
        let p = Arc::new(Parking {
            ep: sys::epoll()?,
            wake: sys::eventfd()?,
            state: Mutex::new(State {
                entries: HashMap::new(),
                deadlines: BTreeSet::new(),
                next: WAKE_TOKEN + 1,
                closed: false,
            }),
            resume,
            thread: Mutex::new(None),
        });
        sys::epoll_watch(p.ep.as_fd(), p.wake_fd(), WAKE_TOKEN, false)?;
        let p2 = Arc::clone(&p);
        let h = std::thread::Builder::new()
            .name("nbd-idle".into())
            .spawn(move || p2.run())?;
        *p.thread.lock() = Some(h);
        Ok(p)
    }

    fn wake_fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.wake.as_raw_fd()
    }

    /// Hold `item`, the connection whose socket is `fd`, until it is
    /// ready, its `deadline` passes or the server stops; then resume it
    /// (see the module's notes). `fd` must stay open until then: `item`
    /// owns it.
    ///
    /// **Returns:** `Err(item)` after [`Parking::stop`], or when the socket
    /// cannot be watched: the caller goes on serving the connection.
    pub(crate) fn park(&self, fd: RawFd, deadline: Option<Instant>, item: T) -> Result<(), T> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(item);
        }
        let token = s.next;
        s.next += 1;
        let earliest = s.deadlines.first().map(|(d, _)| *d);
        if let Err(e) = sys::epoll_watch(self.ep.as_fd(), fd, token, true) {
            eprintln!("iopages-nbd: cannot hold an idle connection without its thread: {e}");
            return Err(item);
        }
        s.entries.insert(token, Entry { fd, deadline, item });
        if let Some(d) = deadline {
            s.deadlines.insert((d, token));
            if earliest.is_none_or(|e| d < e) {
                // The thread may be waiting for a later deadline.
                sys::eventfd_signal(self.wake.as_fd());
            }
        }
        Ok(())
    }

    /// How many connections are parked.
    pub(crate) fn parked(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// Take no more connections, end the thread and resume every parked
    /// connection with [`Wake::Stop`] on the calling thread. Idempotent.
    pub(crate) fn stop(&self) {
        self.state.lock().closed = true;
        sys::eventfd_signal(self.wake.as_fd());
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        let left: Vec<Entry<T>> = {
            let mut s = self.state.lock();
            s.deadlines.clear();
            s.entries.drain().map(|(_, e)| e).collect()
        };
        for e in left {
            sys::epoll_forget(self.ep.as_fd(), e.fd);
            (self.resume)(e.item, Wake::Stop);
        }
    }

    fn run(&self) {
        let mut tokens = [0u64; 64];
        loop {
            let timeout = {
                let s = self.state.lock();
                if s.closed {
                    return;
                }
                let next = s.deadlines.first().map(|(d, _)| *d);
                sys::poll_ms(next.map(|d| d.saturating_duration_since(Instant::now())))
            };
            let n = match sys::epoll_wait(self.ep.as_fd(), &mut tokens, timeout) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    // Cannot happen with a valid instance and buffer; say
                    // so and keep the deadlines going.
                    eprintln!("iopages-nbd: epoll_wait failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    0
                }
            };
            for (e, why) in self.due(&tokens[..n]) {
                (self.resume)(e.item, why);
            }
        }
    }

    /// The entries to resume after a wait that found `tokens` ready, with
    /// why; each leaves the epoll instance and the state here.
    fn due(&self, tokens: &[u64]) -> Vec<(Entry<T>, Wake)> {
        let mut s = self.state.lock();
        if s.closed {
            // Left for `stop`, which resumes every entry.
            return Vec::new();
        }
        let mut out = Vec::new();
        for &t in tokens {
            if t == WAKE_TOKEN {
                sys::eventfd_drain(self.wake.as_fd());
            } else if let Some(e) = s.take(t) {
                out.push((e, Wake::Ready));
            }
        }
        let now = Instant::now();
        while let Some(&(d, t)) = s.deadlines.first() {
            if d > now {
                break;
            }
            if let Some(e) = s.take(t) {
                out.push((e, Wake::Idle));
            }
        }
        drop(s);
        for (e, _) in &out {
            sys::epoll_forget(self.ep.as_fd(), e.fd);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::time::Duration;

    /// A parked test connection: its socket, and where its resumption is
    /// reported.
    type Item = (UnixStream, Sender<Wake>);

    fn report((_, tx): Item, why: Wake) {
        let _ = tx.send(why);
    }

    fn parked(p: &Parking<Item>, deadline: Option<Instant>) -> (UnixStream, Receiver<Wake>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        let fd = ours.as_raw_fd();
        assert!(p.park(fd, deadline, (ours, tx)).is_ok());
        (theirs, rx)
    }

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn input_a_hang_up_and_a_deadline_each_resume_once() {
        let p = Parking::start(report).unwrap();
        let (mut a, ra) = parked(&p, None);
        let (b, rb) = parked(&p, None);
        let (_c, rc) = parked(&p, Some(Instant::now() + Duration::from_millis(50)));
        let (_d, rd) = parked(&p, Some(Instant::now() + Duration::from_secs(3600)));
        assert_eq!(p.parked(), 4);
        a.write_all(b"x").unwrap();
        assert_eq!(ra.recv_timeout(LONG), Ok(Wake::Ready));
        drop(b);
        assert_eq!(rb.recv_timeout(LONG), Ok(Wake::Ready));
        assert_eq!(rc.recv_timeout(LONG), Ok(Wake::Idle));
        // Each once: the items went with their resumption.
        assert!(ra.recv_timeout(Duration::from_millis(100)).is_err());
        assert!(rb.try_recv().is_err() && rc.try_recv().is_err());
        assert_eq!(p.parked(), 1);
        assert!(rd.try_recv().is_err(), "a far deadline resumed early");
        p.stop();
        assert_eq!(rd.recv_timeout(LONG), Ok(Wake::Stop));
        assert_eq!(p.parked(), 0);
    }

    #[test]
    fn after_the_stop_a_connection_is_handed_back() {
        let p = Parking::start(report).unwrap();
        p.stop();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        let fd = ours.as_raw_fd();
        let back = p
            .park(fd, None, (ours, tx))
            .expect_err("parked after the stop");
        assert_eq!(back.0.as_raw_fd(), fd);
        assert!(rx.try_recv().is_err(), "resumed although refused");
        p.stop(); // idempotent
    }

    #[test]
    fn an_earlier_deadline_wakes_a_thread_waiting_for_a_later_one() {
        let p = Parking::start(report).unwrap();
        let (_a, ra) = parked(&p, Some(Instant::now() + Duration::from_secs(3600)));
        // The thread now waits for an hour; a deadline of 50 ms must cut
        // that wait short.
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        let (_b, rb) = parked(&p, Some(Instant::now() + Duration::from_millis(50)));
        assert_eq!(rb.recv_timeout(LONG), Ok(Wake::Idle));
        assert!(
            t.elapsed() >= Duration::from_millis(50),
            "resumed before its deadline"
        );
        assert!(ra.try_recv().is_err());
        p.stop();
        assert_eq!(ra.recv_timeout(LONG), Ok(Wake::Stop));
    }
}
