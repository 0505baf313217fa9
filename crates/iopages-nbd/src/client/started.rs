//! Requests started without a waiting caller ([`AsyncIo`]): sent by the
//! submitting thread, ended by the connection's reader thread.
//!
//! Owns: registering a started request ([`Conn::start`]: a free slot or
//! nothing), the reader's side of its reply (a READ's data straight into
//! its destination, then its end), the periodic deadline check while
//! replies keep coming, and the sweep when the reader ends. Must never:
//! end a request twice or not at all, free a WRITE's bytes while they may
//! still be sent, or end a request whose sender is still writing it — one
//! answered before it was sent whole, or sent after the reader ended, is
//! its sender's to end ([`Conn::mark_sent`]).
//!
//! Who ends a started request: the reader, when its reply is in and it was
//! sent whole; the sender, when the reply came first, when its send
//! failed, or when the reader had already ended; the reader's sweep at its
//! end, for every request sent whole and not answered. A request of a
//! connection that died ends `Again` (the caller does it on the blocking
//! path, which resends it on a live connection) while its deadline has
//! not passed, and with `TimedOut` after.

use super::*;
use crate::proto::REQUEST_BYTES;
use crate::sys;
use iopages_crypt::async_io::{self, declined, Outcome, ReadInto, Segments, WriteEnd};

/// A started request: what it is, and how it ends.
pub(super) struct Then {
    pub(super) flags: u16,
    pub(super) command: u16,
    pub(super) offset: u64,
    pub(super) length: u32,
    /// A WRITE's bytes, kept alive while it is sent.
    pub(super) data: Option<Arc<dyn Segments>>,
    /// A WRITE's end.
    pub(super) write_end: Option<WriteEnd>,
    /// A READ's destination and end (taken by the reader while it fills
    /// it).
    pub(super) read_into: Option<Box<dyn ReadInto>>,
    /// When its sending began (for the round-trip counter).
    pub(super) sent_at: Option<Instant>,
}

impl Then {
    /// Call the request's end.
    pub(super) fn end(self, outcome: Outcome) {
        // A write's pages go back before its end reports it.
        drop(self.data);
        match (self.read_into, self.write_end) {
            (Some(into), _) => into.end(outcome),
            (None, Some(end)) => end(outcome),
            (None, None) => debug_assert!(false, "a started request without an end"),
        }
    }

    /// Its request, cookie 0 (set once it is registered).
    fn request(&self) -> Request {
        Request {
            flags: self.flags,
            command: self.command,
            cookie: 0,
            offset: self.offset,
            length: self.length,
        }
    }

    fn call(&self, deadline: Instant) -> Call {
        Call {
            command: self.command,
            offset: self.offset,
            length: self.length,
            deadline,
        }
    }
}

impl Conn {
    /// Start `then` on this connection without waiting: registered in a
    /// free slot and sent whole by this thread, its reply awaited by the
    /// reader thread. Only when the writer is free and the socket takes
    /// the request's first bytes at once; the rest of a request the socket
    /// took in part is left to the reader (`tail.rs`). While this thread
    /// holds requests back ([`async_io::hold_starts`]) it is registered
    /// and held instead, and sent with the others held here
    /// ([`Conn::send_held_now`]).
    ///
    /// **Returns:** `Err(then)`, nothing sent, when the connection was
    /// given up, has no free slot, or its writer or socket is busy (a
    /// write left in part included);
    /// otherwise its end is called exactly once (here, when its sending
    /// failed or its reply came first).
    pub(super) fn start(self: &Arc<Self>, then: Then) -> Result<(), Then> {
        if async_io::holding() {
            return self.hold(then);
        }
        let Some(w) = self.writer.try_lock() else {
            return Err(then);
        };
        let req = self.register_req(then, true)?;
        let cookie = req.cookie;
        match self.write_reqs(&w, vec![req]) {
            Written::Declined(_) => {
                drop(w);
                self.unstart(cookie)
            }
            written => {
                drop(w);
                self.after_written(written);
                Ok(())
            }
        }
    }

    /// Register `then` (see [`Conn::register`]) as a request to write:
    /// now (`on_wire`), or held back until its batch is sent.
    fn register_req(&self, then: Then, on_wire: bool) -> Result<HeldReq, Then> {
        let now = Instant::now();
        let deadline = now + self.timeout;
        let call = then.call(deadline);
        let data = then.data.clone();
        let mut req = then.request();
        req.cookie = self.register(then, now, deadline, on_wire)?;
        Ok(HeldReq {
            cookie: req.cookie,
            header: req.encode(),
            data,
            call,
        })
    }

    /// Register `then` in a free slot, started at `now`.
    ///
    /// **Returns:** its cookie; `Err(then)` when the connection was given
    /// up or has no free slot.
    fn register(
        &self,
        mut then: Then,
        now: Instant,
        deadline: Instant,
        on_wire: bool,
    ) -> Result<u64, Then> {
        let unflushed = matches!(then.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM)
            && then.flags & CMD_FLAG_FUA == 0;
        let mut s = self.shared.lock();
        if s.dead.is_some() || s.pending.len() >= self.max_in_flight {
            return Err(then);
        }
        then.sent_at = Some(now);
        let cookie = s.next_cookie;
        s.next_cookie += 1;
        let pending = Pending {
            deadline,
            sent: false,
            on_wire,
            dest: None,
            cv: Arc::new(Condvar::new()),
            state: Slot::Waiting,
            unflushed,
            then: Some(then),
        };
        let was = s.pending.insert(cookie, pending);
        assert!(was.is_none(), "cookie {cookie} is pending twice");
        Ok(cookie)
    }

    /// Register `then` and hold it back with the others held on this
    /// connection; they go out together at this thread's next
    /// [`async_io::send_held`], or now when they fill a batch.
    fn hold(self: &Arc<Self>, then: Then) -> Result<(), Then> {
        if self.tail_busy() {
            // Mid-request: another connection may take it now.
            return Err(then);
        }
        let req = self.register_req(then, false)?;
        let full = {
            let mut held = self.held.lock();
            held.push(req);
            let bytes: usize = held
                .iter()
                .filter_map(|r| r.data.as_ref())
                .map(|d| d.len())
                .sum();
            held.len() >= HOLD_MAX_REQUESTS || bytes >= HOLD_MAX_BYTES
        };
        if full {
            async_io::Held::send_held(&**self);
        } else {
            async_io::held_by(Arc::clone(self) as Arc<dyn async_io::Held>);
        }
        Ok(())
    }

    /// Write `reqs` (headers and payloads in order, one `sendmsg`) under
    /// the writer `w` (held). The first attempt does not wait. What a
    /// plain socket did not take at once is left to the connection's
    /// reader (`tail.rs`), which sends it as the store reads, by the
    /// requests' deadline; a TLS stream is written whole here by then.
    fn write_reqs(&self, w: &Stream, reqs: Vec<HeldReq>) -> Written {
        if !self.alive.load(Ordering::Acquire) || self.tail_busy() {
            // Given up since it was picked, or mid-request: nothing sent.
            return Written::Declined(reqs);
        }
        let Some(deadline) = reqs.iter().map(|r| r.call.deadline).min() else {
            return Written::Ended(reqs, Ok(()));
        };
        let (first, total) = {
            let parts: Vec<Vec<&[u8]>> = reqs.iter().map(HeldReq::parts).collect();
            let mut bufs = reqs_bufs(&reqs, &parts);
            if let Stream::Tls(_) = w {
                let sent = write_all_by(w, &mut bufs, deadline).map_err(Some);
                drop(bufs);
                return Written::Ended(reqs, sent);
            }
            let total: usize = bufs.iter().map(|b| b.len()).sum();
            (sys::send_nowait(w.as_raw_fd(), &bufs), total)
        };
        match first {
            Ok(0) => Written::Ended(reqs, Err(Some(ErrorKind::WriteZero.into()))),
            Ok(n) if n == total => Written::Ended(reqs, Ok(())),
            Ok(n) => match self.leave_tail(reqs, n) {
                Ok(()) => Written::Left,
                Err((reqs, e)) => Written::Ended(reqs, Err(Some(e))),
            },
            Err(e) if is_timeout(&e) || e.kind() == ErrorKind::Interrupted => {
                Written::Declined(reqs)
            }
            Err(e) => Written::Ended(reqs, Err(Some(e))),
        }
    }

    /// Each request of a write that ended (`Written::Ended`) ends as its
    /// sender's side says ([`Conn::after_send`]); declined ones end
    /// `Again`.
    pub(super) fn after_written(&self, written: Written) {
        match written {
            Written::Left => {}
            Written::Declined(reqs) => {
                for r in reqs {
                    if let Err(then) = self.unstart(r.cookie) {
                        then.end(Outcome::Again(declined(
                            "the store connection could not take the requests held for it",
                        )));
                    }
                }
            }
            Written::Ended(reqs, sent) => {
                let n = reqs.len() as u64;
                self.counters.started.fetch_add(n, Ordering::Relaxed);
                // The bytes are the requests' own from here (in the map).
                let ends: Vec<(u64, Call)> = reqs.into_iter().map(|r| (r.cookie, r.call)).collect();
                for (cookie, call) in ends {
                    self.after_send(&call, cookie, copy_sent(&sent));
                }
            }
        }
    }

    /// Take back a request nothing of which was sent.
    ///
    /// **Returns:** `Err(then)` to decline it; `Ok` when the reader is
    /// filling a reply to it already (a store answering what it was never
    /// sent): the reader ends it.
    fn unstart(&self, cookie: u64) -> Result<(), Then> {
        let mut s = self.shared.lock();
        let p = s
            .pending
            .get_mut(&cookie)
            .expect("only its sender takes it now");
        if matches!(p.state, Slot::Filling) {
            p.sent = true;
            return Ok(());
        }
        let p = s.pending.remove(&cookie).expect("found above");
        self.room.notify_one();
        let mut then = p.then.expect("started");
        then.sent_at = None;
        Err(then)
    }

    /// Send every request held back here in one write (header and
    /// payload after header), under the writer if it is free; each then
    /// ends as a request sent alone would: declined (`Again`) when nothing
    /// of them was sent, failed with the connection when the write failed.
    fn send_held_now(&self) {
        let held = std::mem::take(&mut *self.held.lock());
        if held.is_empty() {
            return;
        }
        let written = match self.writer.try_lock() {
            Some(w) => {
                self.put_on_wire(&held);
                self.write_reqs(&w, held)
            }
            None => Written::Declined(held),
        };
        self.after_written(written);
    }

    /// Requests held back are about to be written: from now on the store
    /// may answer them.
    fn put_on_wire(&self, reqs: &[HeldReq]) {
        let mut s = self.shared.lock();
        for r in reqs {
            if let Some(p) = s.pending.get_mut(&r.cookie) {
                p.on_wire = true;
            }
        }
    }

    /// The sender's side once its request was written (or not): mark it
    /// sent, or fail it; end it here when that falls to the sender.
    fn after_send(&self, call: &Call, cookie: u64, sent: Result<(), Option<io::Error>>) {
        let mut s = self.shared.lock();
        let ended = match sent {
            Ok(()) => self.mark_sent(&mut s, cookie),
            Err(e) => {
                let e = self.send_failed(&mut s, call, e);
                let p = s
                    .pending
                    .get_mut(&cookie)
                    .expect("only its sender takes it now");
                match p.state {
                    // The reader is filling its reply: the reader ends it.
                    Slot::Filling => {
                        p.sent = true;
                        None
                    }
                    // Answered before its sending failed: the answer holds.
                    Slot::Replied(_) => s.pending.remove(&cookie),
                    Slot::Waiting | Slot::Failed(..) => {
                        p.state = Slot::Failed(e.kind(), e.to_string());
                        s.pending.remove(&cookie)
                    }
                }
            }
        };
        if ended.is_some() {
            self.room.notify_one();
        }
        drop(s);
        if let Some(p) = ended {
            self.end_started(p);
        }
    }

    /// End a started request taken out of the map, by its state.
    pub(super) fn end_started(&self, p: Pending) {
        let Some(then) = p.then else {
            debug_assert!(false, "only started requests end here");
            return;
        };
        if let (Slot::Replied(_), Some(at)) = (&p.state, then.sent_at) {
            self.counters.rtt.record(at.elapsed());
        }
        let outcome = match p.state {
            Slot::Replied(0) => Outcome::Done(Ok(())),
            Slot::Replied(errno) => Outcome::Done(Err(reply_error(
                &self.name,
                errno,
                then.command,
                then.offset,
                then.length.into(),
            ))),
            Slot::Failed(kind, msg) if Instant::now() < p.deadline => {
                self.counters.resent.fetch_add(1, Ordering::Relaxed);
                Outcome::Again(io::Error::new(kind, msg))
            }
            Slot::Failed(kind, msg) => {
                if kind == ErrorKind::TimedOut {
                    self.counters
                        .deadline_failures
                        .fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Done(Err(io::Error::new(kind, msg)))
            }
            Slot::Waiting | Slot::Filling => {
                debug_assert!(false, "a started request ends unanswered");
                Outcome::Done(Err(io::Error::other("ended unanswered")))
            }
        };
        then.end(outcome);
    }

    /// The reader's side of the reply (`errno`) to the started request
    /// `cookie`: a successful READ's data into its destination, then its
    /// end when it was sent whole.
    ///
    /// **Returns:** false when the connection failed while filling (it was
    /// given up; the reader ends).
    pub(super) fn answer_started<'a>(
        &'a self,
        mut s: parking_lot::MutexGuard<'a, Shared>,
        rx: &mut Recv,
        cookie: u64,
        errno: u32,
    ) -> bool {
        let p = s.pending.get_mut(&cookie).expect("the reader found it");
        let into = match p.then.as_mut() {
            Some(t) if errno == 0 => t.read_into.take(),
            _ => None,
        };
        if let Some(mut into) = into {
            p.state = Slot::Filling;
            drop(s);
            let filled = rx.fill(into.buf(), self.timeout, &mut |_| Ok(false));
            s = self.shared.lock();
            let p = s
                .pending
                .get_mut(&cookie)
                .expect("no one takes a request being filled");
            p.then.as_mut().expect("started").read_into = Some(into);
            if let Err(e) = filled {
                p.state = Slot::Waiting;
                self.fill_failed(&mut s, cookie, e);
                return false;
            }
        }
        let p = s.pending.get_mut(&cookie).expect("the reader found it");
        p.state = Slot::Replied(errno);
        if !p.sent {
            // Its sender is still writing it: the sender ends it.
            return true;
        }
        let p = s.pending.remove(&cookie).expect("the reader found it");
        self.room.notify_one();
        drop(s);
        self.end_started(p);
        true
    }

    /// The reader has ended: every started request sent whole and not
    /// answered ends (`Again` within its deadline); one still being sent
    /// is ended by its sender.
    pub(super) fn sweep(&self) {
        let mut s = self.shared.lock();
        s.reader_gone = true;
        if s.dead.is_none() {
            let msg = format!("{}: the connection ended", self.name);
            self.kill(&mut s, ErrorKind::ConnectionAborted, msg);
        }
        let (kind, msg) = s.dead.clone().expect("given up above");
        let mine: Vec<u64> = s
            .pending
            .iter()
            .filter(|(_, p)| p.then.is_some() && p.sent)
            .map(|(c, _)| *c)
            .collect();
        let mut ended = Vec::with_capacity(mine.len());
        for c in mine {
            let mut p = s.pending.remove(&c).expect("listed above");
            if !matches!(p.state, Slot::Replied(_) | Slot::Failed(..)) {
                p.state = Slot::Failed(kind, msg.clone());
            }
            ended.push(p);
        }
        self.room.notify_all();
        drop(s);
        for p in ended {
            self.end_started(p);
        }
    }

    /// While replies keep coming the reader's idle tick does not fire:
    /// every `tick` it checks the deadlines of requests sent whole here.
    ///
    /// **Returns:** false when one is overdue (the connection is then
    /// given up).
    pub(super) fn check_overdue(&self, last: &mut Instant, tick: Duration) -> bool {
        if last.elapsed() < tick {
            return true;
        }
        *last = Instant::now();
        let mut s = self.shared.lock();
        match self.overdue(&s) {
            Some(msg) => {
                self.kill(&mut s, ErrorKind::TimedOut, msg);
                false
            }
            None => true,
        }
    }
}

impl async_io::Held for Conn {
    fn send_held(&self) {
        self.send_held_now();
    }
}

/// A started request registered on its connection and held back
/// ([`async_io::hold_starts`]): sent with the others held there.
pub(super) struct HeldReq {
    pub(super) cookie: u64,
    pub(super) header: [u8; REQUEST_BYTES],
    /// A WRITE's bytes (the map's `Then` keeps them too).
    pub(super) data: Option<Arc<dyn Segments>>,
    pub(super) call: Call,
}

impl HeldReq {
    /// Its payload's parts (none but a WRITE's).
    pub(super) fn parts(&self) -> Vec<&[u8]> {
        self.data.as_ref().map_or_else(Vec::new, |d| d.segments())
    }
}

/// What became of requests written together ([`Conn::write_reqs`]).
pub(super) enum Written {
    /// Nothing of them was sent: the socket took nothing, the writer was
    /// mid-request, or the connection was given up.
    Declined(Vec<HeldReq>),
    /// Sent whole (`Ok`), or the write failed.
    Ended(Vec<HeldReq>, Result<(), Option<io::Error>>),
    /// Sent in part; the connection's reader sends the rest and ends them.
    Left,
}

/// The most requests held back on one connection: the next one sends
/// them all.
const HOLD_MAX_REQUESTS: usize = 32;
/// The most WRITE payload bytes held back on one connection.
const HOLD_MAX_BYTES: usize = 256 << 10;

/// Requests' buffers, in order: each one's header, then its payload's
/// parts (`parts`, one list per request).
pub(super) fn reqs_bufs<'a>(reqs: &'a [HeldReq], parts: &'a [Vec<&'a [u8]>]) -> Vec<IoSlice<'a>> {
    let mut bufs = Vec::with_capacity(reqs.len() + parts.iter().map(Vec::len).sum::<usize>());
    for (r, p) in reqs.iter().zip(parts) {
        bufs.push(IoSlice::new(&r.header));
        bufs.extend(p.iter().map(|x| IoSlice::new(x)));
    }
    bufs
}

/// The outcome of one write of several requests, for each of them.
pub(super) fn copy_sent(sent: &Result<(), Option<io::Error>>) -> Result<(), Option<io::Error>> {
    match sent {
        Ok(()) => Ok(()),
        Err(None) => Err(None),
        Err(Some(e)) => Err(Some(io::Error::new(e.kind(), e.to_string()))),
    }
}

/// The error for an NBD error reply to `command` from `who` (a URI, or a
/// connection's name).
pub(super) fn reply_error(who: &str, errno: u32, command: u16, offset: u64, len: u64) -> io::Error {
    let (kind, name) = errno_kind(errno);
    io::Error::new(
        kind,
        format!(
            "{who}: {} of {len} bytes at offset {offset} failed on the remote: {name} ({})",
            command_name(command),
            crate::proto::error_message(errno)
        ),
    )
}
