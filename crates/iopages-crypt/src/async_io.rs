//! I/O that completes later, on another thread: the contract between the
//! crypt queue and a backend that can start a request and return at once
//! (a remote store's connections, whose reader threads complete it).
//!
//! Owns: [`AsyncIo`] (start a write or a read), what a started
//! request carries ([`Segments`] for a write's ciphertext, [`ReadInto`]
//! for a read's destination and its end) and how it ends ([`Outcome`]).
//! Must never: end a request twice or not at all.
//!
//! A request ends `Again` when the backend could not take it (no live
//! connection, no free slot, a request it only does on its blocking path)
//! or when the connection it went out on died before answering and its
//! deadline had not passed: nothing is known of it, and the caller does it
//! again through the backend's blocking path (which waits for a live
//! connection, resends, refuses what is out of range with its error, and
//! keeps its durability accounting) — one that had been sent within the
//! deadline it had when it first started ([`resumed`], [`began`]), one
//! declined at once ([`declined`]: `WouldBlock`) from scratch. Every
//! other end is final.
//!
//! A thread that knows more requests follow at once (a server reading a
//! client's pipelined requests from its buffer) lets backends hold the
//! ones it starts back and send them together ([`hold_starts`]): one
//! `sendmsg` and one wake-up of the store for many requests. It must send
//! them ([`send_held`], or `hold_starts(false)`) before it waits for
//! anything — a client, a free slot, a page — since what it waits for may
//! be the end of a request it holds.
//!
//! The mirror on the completing side: a thread that ends many requests
//! in a row (a store's reader, with a burst of replies in its buffer)
//! lets what their ends produce — a server's replies — be held back too
//! ([`batch_ends`]), and sends it the same way before it waits.

use std::cell::{Cell, RefCell};
use std::io;
use std::sync::Arc;
use std::time::Instant;

thread_local! {
    /// When the request this thread is doing again first started.
    static BEGAN: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The lane this thread's requests go in now (see [`in_lane`]).
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
    /// Whether requests started on this thread may be held back now.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
    /// What holds requests this thread started, each once.
    static HELD: RefCell<Vec<Arc<dyn Held>>> = const { RefCell::new(Vec::new()) };
    /// Whether this thread ends requests in batches now (see
    /// [`batch_ends`]).
    static BATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Requests started on a thread and held back, to go out together
/// ([`hold_starts`]): a backend's connection, say.
pub trait Held: Send + Sync {
    /// Send every request held back here (or end each as its backend
    /// ends a request it could not send).
    fn send_held(&self);
}

/// Let backends hold back the requests this thread starts from now on
/// (`true`), or send every one held back now and hold no more
/// (`false`). A backend that holds a request calls [`held_by`]; it may
/// still send at once (its batch full). Whoever turns it on sends what is
/// held ([`send_held`]) before the thread waits for anything.
pub fn hold_starts(on: bool) {
    set_or_send(&HOLDING, on);
}

/// Set a thread's flag; turned off, send what the thread holds.
fn set_or_send(flag: &'static std::thread::LocalKey<Cell<bool>>, on: bool) {
    flag.with(|f| f.set(on));
    if !on {
        send_held();
    }
}

/// Whether requests started on this thread now may be held back.
pub fn holding() -> bool {
    HOLDING.with(Cell::get)
}

/// Mark this thread as one that ends many requests in a row (`true`): a
/// store connection's reader, which ends every request whose reply the
/// store sent in one burst. What those ends make for someone else (a
/// server's replies to its clients) may then be held back with
/// [`held_by`] and go out together at the thread's next [`send_held`],
/// which it calls before it waits for anything. `false` sends everything
/// held and holds no more.
pub fn batch_ends(on: bool) {
    set_or_send(&BATCHING, on);
}

/// [`batch_ends`] for a scope: on now, and off (what is held sent) when
/// the guard drops, on unwinding too.
pub fn ends_batched() -> EndsBatched {
    batch_ends(true);
    EndsBatched(())
}

/// The guard of [`ends_batched`].
pub struct EndsBatched(());

impl Drop for EndsBatched {
    fn drop(&mut self) {
        batch_ends(false);
    }
}

/// Whether this thread now ends requests in batches ([`batch_ends`]).
pub fn batching_ends() -> bool {
    BATCHING.with(Cell::get)
}

/// `h` holds requests this thread started: the next [`send_held`] on this
/// thread sends them (`h` is listed once however often it is named).
pub fn held_by(h: Arc<dyn Held>) {
    HELD.with(|v| {
        let mut v = v.borrow_mut();
        if !v
            .iter()
            .any(|x| std::ptr::addr_eq(Arc::as_ptr(x), Arc::as_ptr(&h)))
        {
            v.push(h);
        }
    });
}

/// Send every request held back on this thread now (holding stays as it
/// is). Cheap when nothing is held.
pub fn send_held() {
    loop {
        let list = HELD.with(|v| std::mem::take(&mut *v.borrow_mut()));
        if list.is_empty() {
            return;
        }
        for h in list {
            h.send_held();
        }
    }
}

/// Run `f` with the requests this thread starts marked as lane `lane`: a
/// backend with several connections keeps the requests of one lane on one
/// of them (so that a burst from one client goes out together and its
/// replies wake one reader once), as it otherwise keeps each thread's. A
/// server whose few threads serve many clients in turn gives each client
/// its own lane. Restored afterwards, a panic in `f` included.
pub fn in_lane<R>(lane: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LANE.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(LANE.with(|l| l.replace(Some(lane))));
    f()
}

/// The lane this thread's requests go in now ([`in_lane`]), if any.
pub fn lane() -> Option<usize> {
    LANE.with(Cell::get)
}

/// Run `f` — the blocking path doing a request that ended `Again` — with
/// `began`, the moment the request first started, readable through
/// [`began`], so that a backend's deadline for it runs from that moment
/// and not from the retry: one request, one deadline, whichever paths it
/// takes. `None` (a request that never started) leaves it unset. Restored
/// afterwards, a panic in `f` included.
pub fn resumed<R>(began: Option<Instant>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            BEGAN.with(|b| b.set(self.0));
        }
    }
    let _restore = Restore(BEGAN.with(|b| b.replace(began)));
    f()
}

/// The moment the request this thread is doing first started, when it is
/// one being done again (inside [`resumed`]); `None` otherwise: its
/// deadline starts now.
pub fn began() -> Option<Instant> {
    BEGAN.with(|b| b.get())
}

/// How a started request ended.
#[derive(Debug)]
pub enum Outcome {
    /// Answered: the result (a store's error reply is an error here).
    Done(io::Result<()>),
    /// Not done: declined, or the connection died before answering
    /// within the request's deadline. Do it again on the blocking path.
    Again(io::Error),
}

/// A write's bytes, back to back, kept alive by the backend until the
/// request has been sent (every byte) or given up.
pub trait Segments: Send + Sync {
    /// The bytes as segments.
    fn segments(&self) -> Vec<&[u8]>;
    /// Their total length.
    fn len(&self) -> usize {
        self.segments().iter().map(|s| s.len()).sum()
    }
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A write's end: called exactly once.
pub type WriteEnd = Box<dyn FnOnce(Outcome) + Send>;

/// A read's destination and its end, owned by the backend while the read
/// is in flight.
pub trait ReadInto: Send {
    /// Where the data goes (its length is the read's).
    fn buf(&mut self) -> &mut [u8];
    /// The read ended; on `Done(Ok)` the buffer holds the data. Called
    /// exactly once.
    fn end(self: Box<Self>, outcome: Outcome);
}

/// A backend that can start I/O without waiting for it.
///
/// Both calls return at once and take the request: its end is called
/// exactly once — on a thread of the backend's, or on this one before the
/// call returns (declined, or answered that quickly). Nothing is sent for
/// a request declined (`Again` at once).
pub trait AsyncIo: Send + Sync {
    /// Start writing `data` at byte `offset` (durable before its end with
    /// `fua`).
    fn start_write(&self, offset: u64, data: Arc<dyn Segments>, fua: bool, end: WriteEnd);

    /// Start reading `into.buf().len()` bytes at byte `offset`.
    fn start_read(&self, offset: u64, into: Box<dyn ReadInto>);
}

/// The error an `Again` carries when a backend declines a request.
pub fn declined(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::WouldBlock, why.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lane_holds_for_its_closure_only_nested_ones_too_and_after_a_panic() {
        assert_eq!(lane(), None);
        in_lane(3, || {
            assert_eq!(lane(), Some(3));
            in_lane(9, || assert_eq!(lane(), Some(9)));
            assert_eq!(lane(), Some(3));
            let r = std::panic::catch_unwind(|| in_lane(5, || panic!("inside")));
            assert!(r.is_err());
            assert_eq!(lane(), Some(3));
        });
        assert_eq!(lane(), None);
        // Another thread has its own.
        assert_eq!(
            in_lane(4, || std::thread::spawn(lane).join().unwrap()),
            None
        );
        assert_eq!(
            std::thread::spawn(|| in_lane(4, lane)).join().unwrap(),
            Some(4)
        );
    }

    struct Counted(std::sync::atomic::AtomicUsize);

    impl Held for Counted {
        fn send_held(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn batched_ends_are_apart_from_holding_and_ending_the_batch_sends_what_it_held() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let a = Arc::new(Counted(AtomicUsize::new(0)));
        assert!(!batching_ends());
        batch_ends(true);
        assert!(batching_ends());
        assert!(!holding(), "batching ends does not hold starts");
        assert!(!std::thread::spawn(batching_ends).join().unwrap());
        held_by(a.clone());
        held_by(a.clone());
        assert_eq!(a.0.load(Relaxed), 0);
        batch_ends(false);
        assert!(!batching_ends());
        assert_eq!(a.0.load(Relaxed), 1, "ending the batch sends, once");
    }

    #[test]
    fn held_requests_are_sent_once_per_holder_when_holding_ends_on_this_thread_only() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let (a, b) = (
            Arc::new(Counted(AtomicUsize::new(0))),
            Arc::new(Counted(AtomicUsize::new(0))),
        );
        assert!(!holding());
        hold_starts(true);
        assert!(holding());
        for _ in 0..3 {
            held_by(a.clone());
        }
        held_by(b.clone());
        // Another thread's send sends nothing of this one's.
        std::thread::spawn(send_held).join().unwrap();
        assert_eq!((a.0.load(Relaxed), b.0.load(Relaxed)), (0, 0));
        send_held();
        assert_eq!(
            (a.0.load(Relaxed), b.0.load(Relaxed)),
            (1, 1),
            "each holder once"
        );
        assert!(holding(), "sending does not end holding");
        held_by(a.clone());
        hold_starts(false);
        assert!(!holding());
        assert_eq!(a.0.load(Relaxed), 2, "ending holding sends");
        send_held();
        assert_eq!(
            (a.0.load(Relaxed), b.0.load(Relaxed)),
            (2, 1),
            "nothing left held"
        );
    }

    #[test]
    fn resumed_sets_the_start_for_its_closure_only_and_restores_it_after_a_panic() {
        assert_eq!(began(), None);
        let t = Instant::now() - Duration::from_secs(3);
        assert_eq!(resumed(Some(t), began), Some(t));
        assert_eq!(began(), None);
        let inner = resumed(Some(t), || resumed(None, began));
        assert_eq!(inner, None, "a request that never started has no start");
        let r = std::panic::catch_unwind(|| resumed(Some(t), || panic!("in the closure")));
        assert!(r.is_err());
        assert_eq!(began(), None, "restored after the panic");
    }
}
