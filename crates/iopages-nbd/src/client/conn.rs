//! One connection to the remote: requests in flight by cookie, their
//! deadlines, and the reader thread that completes them.

use super::*;
use crate::sys;
use iopages_crypt::async_io;

/// Whether `e` is a socket timeout (SO_RCVTIMEO / SO_SNDTIMEO expired).
pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Write all of `bufs` to `s` by `deadline`, however the remote reads:
/// each attempt waits at most what is left (a socket's send timeout
/// would start again with every byte the remote takes, so a remote that
/// trickles could stretch a request for ever).
///
/// **Returns:** `TimedOut` naming how far it got when the deadline
/// passes first; the socket's error.
pub(super) fn write_all_by(
    s: &Stream,
    bufs: &mut [IoSlice<'_>],
    deadline: Instant,
) -> io::Result<()> {
    let mut bufs = bufs;
    let mut sent = 0usize;
    while !bufs.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = match s {
            _ if left.is_zero() => Err(ErrorKind::WouldBlock.into()),
            Stream::Tls(t) => {
                t.set_write_timeout(left);
                t.write_vectored(bufs)
            }
            _ => sys::send_nowait(s.as_raw_fd(), bufs),
        };
        match got {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                sent += n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                if !sys::poll_until(s.as_raw_fd(), libc::POLLOUT, deadline)? {
                    let why = match sent {
                        0 => "the store stopped reading".to_string(),
                        n => format!(
                            "only {n} bytes left: the store stopped reading or reads too slowly"
                        ),
                    };
                    return Err(io::Error::new(ErrorKind::TimedOut, why));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Of segments of lengths `lens` (back to back), the pieces covering
/// `len` bytes from `start`: (segment, offset in it, bytes).
pub(super) fn segment_ranges(
    lens: impl Iterator<Item = usize>,
    start: usize,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let (mut skip, mut left) = (start, len);
    lens.enumerate()
        .map_while(move |(i, seg)| {
            if left == 0 {
                return None;
            }
            if skip >= seg {
                skip -= seg;
                return Some(None);
            }
            let n = (seg - skip).min(left);
            let piece = (i, skip, n);
            skip = 0;
            left -= n;
            Some(Some(piece))
        })
        .flatten()
}

/// The parts of `segs` (back to back) covering `len` bytes from `start`.
pub(super) fn sub_slices<'a>(segs: &[&'a [u8]], start: usize, len: usize) -> Vec<&'a [u8]> {
    segment_ranges(segs.iter().map(|s| s.len()), start, len)
        .map(|(i, from, n)| &segs[i][from..from + n])
        .collect()
}

/// The reader thread's side of the socket: what was read and not yet
/// used stays in `buf[pos..end]`.
pub(super) struct Recv {
    pub(super) stream: Stream,
    pub(super) buf: Box<[u8]>,
    pub(super) pos: usize,
    pub(super) end: usize,
    /// How long one wait for bytes lasts before `fill` asks its tick.
    tick: Duration,
    /// The connection whose tail (`tail.rs`) this reader sends while it
    /// waits for input.
    tail_of: Option<Arc<Conn>>,
}

impl Recv {
    pub(super) fn new(stream: Stream, bytes: usize, tick: Duration) -> Recv {
        Recv {
            stream,
            buf: vec![0; bytes].into_boxed_slice(),
            pos: 0,
            end: 0,
            tick,
            tail_of: None,
        }
    }

    /// The reader of `conn`: it sends the connection's tail while it waits.
    pub(super) fn tending(mut self, conn: Arc<Conn>) -> Recv {
        self.tail_of = Some(conn);
        self
    }

    /// One read into `buf`; a wait for bytes lasts at most the tick and
    /// then reads as a timeout. A plain socket is waited on with `poll`
    /// for input alone: a thread asleep inside `recv` on a Unix socket is
    /// also woken each time the store takes some of what the writer sends
    /// (the socket has one wait queue for both), five times or more for a
    /// 1 MiB write.
    fn read_some(
        stream: &Stream,
        tail_of: Option<&Conn>,
        buf: &mut [u8],
        tick: Duration,
    ) -> io::Result<usize> {
        if let Stream::Tls(_) = stream {
            // Its read may wait: what this thread holds goes first.
            async_io::send_held();
            let mut s = stream;
            return s.read(buf);
        }
        let fd = stream.as_raw_fd();
        if let Some(c) = tail_of {
            c.tend_tail(true);
        }
        match sys::recv_nowait(fd, buf) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // Nothing more to read now: what the ends of the replies
                // read so far made goes out before the wait.
                async_io::send_held();
                let input = match tail_of {
                    Some(c) => c.wait_input(fd, tick)?,
                    None => sys::poll_until(fd, libc::POLLIN, Instant::now() + tick)?,
                };
                if input {
                    sys::recv_nowait(fd, buf)
                } else {
                    Err(e)
                }
            }
            r => r,
        }
    }

    /// Fill `out`, first from the buffer, then from the socket: into the
    /// buffer while what is missing is smaller than it (one `read` may
    /// bring the next replies too), else straight into `out`. On each
    /// socket timeout `tick` is asked what to do (it is told the bytes of
    /// `out` filled so far): `Err` gives up, `Ok(true)` means "idle, keep
    /// waiting", `Ok(false)` lets the stall rule decide: no byte for
    /// `stall` gives up with `TimedOut`.
    pub(super) fn fill(
        &mut self,
        out: &mut [u8],
        stall: Duration,
        tick: &mut dyn FnMut(usize) -> io::Result<bool>,
    ) -> io::Result<()> {
        let mut done = 0;
        let mut last = Instant::now();
        while done < out.len() {
            if self.pos < self.end {
                let n = (self.end - self.pos).min(out.len() - done);
                out[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
                self.pos += n;
                done += n;
                continue;
            }
            let direct = out.len() - done >= self.buf.len();
            let tail_of = self.tail_of.as_deref();
            let got = if direct {
                Self::read_some(&self.stream, tail_of, &mut out[done..], self.tick)
            } else {
                self.pos = 0;
                self.end = 0;
                Self::read_some(&self.stream, tail_of, &mut self.buf, self.tick)
            };
            match got {
                Ok(0) => {
                    return Err(io::Error::new(
                        ErrorKind::ConnectionAborted,
                        "the remote closed the connection",
                    ))
                }
                Ok(n) if direct => {
                    done += n;
                    last = Instant::now();
                }
                Ok(n) => {
                    self.end = n;
                    last = Instant::now();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => {
                    if tick(done)? {
                        last = Instant::now();
                    } else if last.elapsed() >= stall {
                        return Err(io::Error::new(
                            ErrorKind::TimedOut,
                            format!("the remote sent nothing for {stall:?}"),
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fill the parts of `dest`, one after the other; a stall of `stall`
    /// gives up.
    pub(super) fn fill_dest(&mut self, dest: &Dest, stall: Duration) -> io::Result<()> {
        for &(ptr, len) in &dest.parts {
            // SAFETY: `dest` was made by `Dest::new` from buffers of the
            // caller of `Conn::call`, which does not return (nor touch
            // them) while its request is `Slot::Filling`, the only time
            // the reader holds a `Dest`; the parts do not overlap.
            let part = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            self.fill(part, stall, &mut |_| Ok(false))?;
        }
        Ok(())
    }
}

/// Where a read's data goes: the bytes `start..start + len` of the
/// caller's buffers (back to back), as raw parts the reader thread fills
/// while the caller waits.
pub(super) struct Dest {
    pub(super) parts: Vec<(*mut u8, usize)>,
}

// SAFETY: the parts are plain bytes of buffers the caller lends for the
// duration of its call; only one thread (the reader, while the request is
// `Slot::Filling`) ever writes through them.
unsafe impl Send for Dest {}

impl Dest {
    pub(super) fn new(segs: &mut [&mut [u8]], start: usize, len: usize) -> Dest {
        let ranges: Vec<_> = segment_ranges(segs.iter().map(|s| s.len()), start, len).collect();
        let parts = ranges
            .into_iter()
            .map(|(i, from, n)| (segs[i][from..from + n].as_mut_ptr(), n))
            .collect::<Vec<(*mut u8, usize)>>();
        debug_assert_eq!(
            parts.iter().map(|p| p.1).sum::<usize>(),
            len,
            "a read's buffers cover it"
        );
        Dest { parts }
    }
}

/// A command's name, for messages.
pub(super) fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        _ => "command",
    }
}

/// The I/O error kind and name of an NBD error code.
pub(super) fn errno_kind(errno: u32) -> (ErrorKind, &'static str) {
    match errno {
        EPERM => (ErrorKind::PermissionDenied, "EPERM"),
        EIO => (ErrorKind::Other, "EIO"),
        ENOMEM => (ErrorKind::OutOfMemory, "ENOMEM"),
        EINVAL => (ErrorKind::InvalidInput, "EINVAL"),
        ENOSPC => (ErrorKind::StorageFull, "ENOSPC"),
        EOVERFLOW => (ErrorKind::InvalidInput, "EOVERFLOW"),
        ENOTSUP => (ErrorKind::Unsupported, "ENOTSUP"),
        ESHUTDOWN => (ErrorKind::ConnectionAborted, "ESHUTDOWN"),
        _ => (ErrorKind::Other, "an unknown error"),
    }
}

/// Where a request stands.
pub(super) enum Slot {
    /// Sent (or being sent), no reply yet.
    Waiting,
    /// A successful read's reply arrived: the reader is putting its data
    /// into the caller's buffers (the caller must not return meanwhile).
    Filling,
    /// The reply arrived (and a read's data is in the caller's buffers):
    /// its error code (0: success).
    Replied(u32),
    /// The connection was given up.
    Failed(ErrorKind, String),
}

/// A request in flight.
pub(super) struct Pending {
    /// Its submission plus the timeout: every step (slot, writer, send,
    /// reply) ends by it.
    pub(super) deadline: Instant,
    /// Sent whole: from now on only its reply is awaited (the reader's
    /// `overdue` check looks at these).
    pub(super) sent: bool,
    /// Its sender may have begun writing it: false only while it is held
    /// back (`started.rs`). A reply to a request not on the wire answers
    /// something the store was never sent, and gives the connection up.
    pub(super) on_wire: bool,
    /// A READ's destination: a successful reply carries data, which the
    /// reader puts there (taken when it starts).
    pub(super) dest: Option<Dest>,
    /// What the caller waits on.
    pub(super) cv: Arc<Condvar>,
    pub(super) state: Slot,
    /// A write the store may hold only in its cache once answered (WRITE
    /// without FUA, WRITE_ZEROES, TRIM): its success is counted as
    /// unflushed by the reader, before its caller can see it.
    pub(super) unflushed: bool,
    /// A request started asynchronously: no caller waits on `cv`; its
    /// end is called by whoever takes it out of the map (`started.rs`).
    pub(super) then: Option<Then>,
}

/// One request as its caller gives it.
pub(super) struct Req<'p, 'r, 'b> {
    pub(super) flags: u16,
    pub(super) command: u16,
    pub(super) offset: u64,
    pub(super) length: u32,
    /// A WRITE's payload: bytes `start..start + length` of these.
    pub(super) payload: &'p [&'p [u8]],
    /// A READ's destination: bytes `start..start + length` of these.
    pub(super) read: Option<&'r mut [&'b mut [u8]]>,
    pub(super) start: usize,
}

/// What a request is, for its messages, and its deadline.
pub(super) struct Call {
    pub(super) command: u16,
    pub(super) offset: u64,
    pub(super) length: u32,
    /// Submission plus the timeout: every step ends by it.
    pub(super) deadline: Instant,
}

impl Call {
    /// E.g. "WRITE of 4194304 bytes at offset 0", "FLUSH".
    pub(super) fn what(&self) -> String {
        Call::describe(self.command, self.offset, self.length)
    }

    /// A request named as [`Call::what`] names it.
    pub(super) fn describe(command: u16, offset: u64, length: u32) -> String {
        match command {
            CMD_FLUSH | CMD_DISC => command_name(command).to_string(),
            c => format!("{} of {length} bytes at offset {offset}", command_name(c)),
        }
    }
}

impl Req<'_, '_, '_> {
    /// A request without payload or destination.
    pub(super) fn bare(command: u16, offset: u64, length: u32) -> Self {
        Req {
            flags: 0,
            command,
            offset,
            length,
            payload: &[],
            read: None,
            start: 0,
        }
    }
}

/// A connection's state, under its mutex.
pub(super) struct Shared {
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) next_cookie: u64,
    /// Why the connection was given up.
    pub(super) dead: Option<(ErrorKind, String)>,
    /// The remote is being dropped: EOF is expected.
    pub(super) closing: bool,
    /// The newest acknowledged-and-unflushed write on this connection (its
    /// number in [`Durability::acked`]; 0: none).
    pub(super) last_ack: u64,
    /// The reader has ended: a started request sent from now on is ended
    /// by its sender.
    pub(super) reader_gone: bool,
}

/// One connection to the remote.
pub(super) struct Conn {
    /// "URI (connection N)", for messages.
    pub(super) name: String,
    /// The write half: requests are written whole under it.
    pub(super) writer: Mutex<Stream>,
    /// A handle to shut the socket down with.
    pub(super) ctl: Stream,
    pub(super) shared: Mutex<Shared>,
    /// Callers wait here for an in-flight slot.
    pub(super) room: Condvar,
    pub(super) alive: AtomicBool,
    pub(super) max_in_flight: usize,
    pub(super) timeout: Duration,
    /// The export's write accounting, shared by its connections.
    pub(super) durability: Arc<Durability>,
    /// The export's counters (round trips).
    pub(super) counters: Arc<RemoteCounters>,
    /// Started requests registered and held back to be sent together
    /// (`started.rs`, [`async_io::hold_starts`]).
    pub(super) held: Mutex<Vec<HeldReq>>,
    /// The rest of a write the socket took in part, sent by the reader
    /// (`tail.rs`); `has_tail` says whether there is one.
    pub(super) tail: Mutex<Option<Tail>>,
    pub(super) has_tail: AtomicBool,
    /// Writers waiting for the tail to go out wait here.
    pub(super) tail_done: Condvar,
    /// Written when a tail is left: the reader's wait ends.
    pub(super) wake: std::os::fd::OwnedFd,
}

impl Conn {
    /// Give the connection up: fail every request still waiting, refuse
    /// later ones, and shut the socket down (waking the reader and any
    /// blocked send; a read being filled fails when the reader's next
    /// `read` does).
    pub(super) fn kill(&self, s: &mut Shared, kind: ErrorKind, msg: String) {
        if s.dead.is_none() {
            s.dead = Some((kind, msg));
            // Before any caller learns of the death (and re-sends a FLUSH
            // elsewhere): the writes it acknowledged unflushed may be lost.
            self.durability.connection_died(s.last_ack);
        }
        self.alive.store(false, Ordering::Release);
        let (kind, msg) = s.dead.clone().expect("set above");
        for p in s.pending.values_mut() {
            if matches!(p.state, Slot::Waiting) {
                p.state = Slot::Failed(kind, msg.clone());
                p.cv.notify_one();
            }
        }
        self.room.notify_all();
        self.ctl.shutdown();
    }

    /// The error for a request on a connection given up.
    pub(super) fn dead_error(&self, s: &Shared) -> io::Error {
        let (kind, msg) = s.dead.clone().expect("a dead connection");
        io::Error::new(kind, msg)
    }

    /// Send `req` and wait for its reply, all by `deadline` (the slot, the
    /// writer, every write and the reply); a read's data goes into its
    /// buffers.
    ///
    /// **Returns:** the reply's error code; an I/O error when the
    /// connection failed (it is then given up: see [`Conn::is_alive`]);
    /// `TimedOut` naming the request and what it waited for once its
    /// deadline passed.
    pub(super) fn call(&self, req: Req<'_, '_, '_>, deadline: Instant) -> io::Result<u32> {
        // What this thread holds back may be what the store answers first.
        async_io::send_held();
        let call = Call {
            command: req.command,
            offset: req.offset,
            length: req.length,
            deadline,
        };
        let cv = Arc::new(Condvar::new());
        let dest = match req.read {
            Some(segs) if req.command == CMD_READ => {
                Some(Dest::new(segs, req.start, req.length as usize))
            }
            _ => None,
        };
        let unflushed = matches!(req.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM)
            && req.flags & CMD_FLAG_FUA == 0;
        let cookie = self.take_slot(&call, dest, &cv, unflushed)?;
        let header = Request {
            flags: req.flags,
            command: req.command,
            cookie,
            offset: req.offset,
            length: req.length,
        }
        .encode();
        let parts = if req.command == CMD_WRITE {
            sub_slices(req.payload, req.start, req.length as usize)
        } else {
            Vec::new()
        };
        let sent_at = Instant::now();
        self.send(&call, cookie, &cv, &header, &parts)?;
        let errno = self.wait_reply(&call, cookie, &cv)?;
        self.counters.rtt.record(sent_at.elapsed());
        Ok(errno)
    }

    /// Whether the connection still serves (not given up).
    pub(super) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Why the connection was given up ("closed" when it was not).
    pub(super) fn death(&self) -> String {
        let s = self.shared.lock();
        s.dead
            .as_ref()
            .map_or_else(|| format!("{}: closed", self.name), |d| d.1.clone())
    }

    /// Close the connection at stop: NBD_CMD_DISC when it lives, then our
    /// side of the socket is shut (the reader ends at the store's EOF).
    pub(super) fn close(&self) {
        {
            let mut s = self.shared.lock();
            // No caller is left: each took its request out of the map.
            // Started requests may be (their starter did not wait): the
            // reader ends them, by their replies or, past their deadline
            // or at the connection's end, by its sweep.
            debug_assert!(
                s.pending.values().all(|p| p.then.is_some()),
                "a connection closes with callers' requests pending"
            );
            s.closing = true;
        }
        if !self.is_alive() {
            return;
        }
        let header = Request {
            flags: 0,
            command: CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        }
        .encode();
        // No caller is left; a writer stuck past its deadline gave the
        // connection up, so this waits for nothing long.
        let deadline = Instant::now() + self.timeout;
        let w = self
            .writer
            .try_lock_until(deadline)
            .and_then(|w| self.without_tail(w, deadline));
        if let Some(w) = w {
            let _ = write_all_by(&w, &mut [IoSlice::new(&header)], deadline);
        }
        self.ctl.shutdown_how(Shutdown::Write);
    }

    /// Wait (by the request's deadline) for an in-flight slot and register
    /// the request in it.
    ///
    /// **Returns:** its cookie; the connection's error when it was given
    /// up; `TimedOut` when no slot came free in time (the connection is
    /// kept: the requests holding the slots end by their own deadlines).
    pub(super) fn take_slot(
        &self,
        call: &Call,
        dest: Option<Dest>,
        cv: &Arc<Condvar>,
        unflushed: bool,
    ) -> io::Result<u64> {
        let mut s = self.shared.lock();
        loop {
            if s.dead.is_some() {
                return Err(self.dead_error(&s));
            }
            if s.pending.len() < self.max_in_flight {
                break;
            }
            if self.room.wait_until(&mut s, call.deadline).timed_out()
                && s.dead.is_none()
                && s.pending.len() >= self.max_in_flight
            {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "{}: {} not sent within {:?} (no request slot came free: {} in flight)",
                        self.name,
                        call.what(),
                        self.timeout,
                        self.max_in_flight
                    ),
                ));
            }
        }
        let cookie = s.next_cookie;
        s.next_cookie += 1;
        let pending = Pending {
            deadline: call.deadline,
            sent: false,
            on_wire: true,
            dest,
            cv: cv.clone(),
            state: Slot::Waiting,
            unflushed,
            then: None,
        };
        let was = s.pending.insert(cookie, pending);
        assert!(was.is_none(), "cookie {cookie} is pending twice");
        debug_assert!(
            s.pending.len() <= self.max_in_flight,
            "more requests than slots"
        );
        Ok(cookie)
    }

    /// Write the request (`header`, then `parts`) whole under the writer
    /// lock, both by its deadline. A request that could not take the lock
    /// in time fails alone (nothing of it was sent); one whose writing
    /// fails or stalls past the deadline gives the connection up (the
    /// stream is left mid-request).
    ///
    /// **Returns:** the error the request fails with; it is then out of
    /// the map (its buffers the caller's again).
    pub(super) fn send(
        &self,
        call: &Call,
        cookie: u64,
        cv: &Condvar,
        header: &[u8],
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let sent = self.write_request(call, header, parts);
        let mut s = self.shared.lock();
        let e = match sent {
            Ok(()) => {
                let done = self.mark_sent(&mut s, cookie);
                debug_assert!(done.is_none(), "a caller's request is not started");
                return Ok(());
            }
            Err(e) => self.send_failed(&mut s, call, e),
        };
        self.release(&mut s, cookie, cv);
        Err(e)
    }

    /// Write the request (`header`, then `parts`) whole under the writer
    /// lock, both by the call's deadline.
    ///
    /// **Returns:** `Err(None)` when the lock did not come in time
    /// (nothing sent); `Err(Some(e))` when writing failed.
    pub(super) fn write_request(
        &self,
        call: &Call,
        header: &[u8],
        parts: &[&[u8]],
    ) -> Result<(), Option<io::Error>> {
        let mut bufs: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(header))
            .chain(parts.iter().map(|p| IoSlice::new(p)))
            .collect();
        let w = self
            .writer
            .try_lock_until(call.deadline)
            .and_then(|w| self.without_tail(w, call.deadline));
        match w {
            None => Err(None),
            // Given up while this one waited: `kill` failed it already.
            Some(_) if !self.alive.load(Ordering::Acquire) => {
                Err(Some(io::Error::from(ErrorKind::NotConnected)))
            }
            Some(w) => write_all_by(&w, &mut bufs, call.deadline).map_err(Some),
        }
    }

    /// The error a request fails with when [`Conn::write_request`] failed;
    /// a failed write gives the connection up (the stream is left
    /// mid-request).
    pub(super) fn send_failed(
        &self,
        s: &mut Shared,
        call: &Call,
        sent: Option<io::Error>,
    ) -> io::Error {
        match sent {
            None => io::Error::new(
                ErrorKind::TimedOut,
                format!(
                    "{}: {} not sent within {:?} (another request being sent held the \
                     connection: the store reads too slowly)",
                    self.name,
                    call.what(),
                    self.timeout
                ),
            ),
            Some(e) => {
                let msg = match e.kind() {
                    ErrorKind::TimedOut => format!(
                        "{}: {} not sent within {:?} ({e}); connection given up",
                        self.name,
                        call.what(),
                        self.timeout
                    ),
                    _ => format!("{}: sending {} failed: {e}", self.name, call.what()),
                };
                self.kill(s, e.kind(), msg);
                self.dead_error(s)
            }
        }
    }

    /// The request `cookie` was sent whole: from now on only its reply is
    /// awaited. A started request whose reply came while it was being
    /// sent, or whose connection's reader has ended, is its sender's to
    /// end: taken out of the map and returned.
    pub(super) fn mark_sent(&self, s: &mut Shared, cookie: u64) -> Option<Pending> {
        let p = s.pending.get_mut(&cookie)?;
        p.sent = true;
        let answered = matches!(p.state, Slot::Replied(_));
        if p.then.is_none() || !(answered || s.reader_gone) {
            return None;
        }
        let gone = s.pending.remove(&cookie);
        self.room.notify_one();
        gone
    }

    /// Take a request that will not be answered out of the map: first
    /// wait while the reader fills its buffers (a reply may come before
    /// its request is all sent, the remote answering a header it has
    /// read; a shut socket ends that `read` at once), then free its slot.
    pub(super) fn release(
        &self,
        s: &mut parking_lot::MutexGuard<'_, Shared>,
        cookie: u64,
        cv: &Condvar,
    ) {
        while s
            .pending
            .get(&cookie)
            .is_some_and(|p| matches!(p.state, Slot::Filling))
        {
            cv.wait(s);
        }
        // Only its caller takes a request out of the map, once.
        let gone = s.pending.remove(&cookie);
        assert!(gone.is_some(), "cookie {cookie} is released twice");
        self.room.notify_one();
    }

    /// Wait, by the request's deadline, for the reply to the request sent
    /// as `cookie`. Past the deadline the connection is given up; a read
    /// being filled then is waited for until the reader lets go of its
    /// buffers (the shut socket fails its `read` at once).
    ///
    /// **Returns:** the reply's error code; the connection's error.
    pub(super) fn wait_reply(&self, call: &Call, cookie: u64, cv: &Condvar) -> io::Result<u32> {
        let mut s = self.shared.lock();
        loop {
            let p = s.pending.get(&cookie).expect("only its caller removes it");
            match &p.state {
                Slot::Waiting | Slot::Filling => {}
                Slot::Replied(errno) => {
                    let errno = *errno;
                    self.release(&mut s, cookie, cv);
                    return Ok(errno);
                }
                Slot::Failed(kind, msg) => {
                    let e = io::Error::new(*kind, msg.clone());
                    self.release(&mut s, cookie, cv);
                    return Err(e);
                }
            }
            if s.dead.is_some() && matches!(p.state, Slot::Filling) {
                cv.wait(&mut s);
                continue;
            }
            if cv.wait_until(&mut s, call.deadline).timed_out() {
                let p = s.pending.get(&cookie).expect("only its caller removes it");
                if matches!(p.state, Slot::Waiting | Slot::Filling) {
                    let msg = format!(
                        "{}: the remote did not answer {} within {:?} of its submission; \
                         connection given up",
                        self.name,
                        call.what(),
                        self.timeout
                    );
                    // A waiting request is failed by `kill`; a read being
                    // filled waits above for the reader to let go.
                    self.kill(&mut s, ErrorKind::TimedOut, msg);
                }
            }
        }
    }

    /// Whether a request sent whole is past its deadline (checked on each
    /// idle tick of the reader).
    pub(super) fn overdue(&self, s: &Shared) -> Option<String> {
        let now = Instant::now();
        s.pending
            .values()
            .filter(|p| p.sent && matches!(p.state, Slot::Waiting))
            .any(|p| p.deadline <= now)
            .then(|| {
                format!(
                    "{}: the remote did not answer a request within {:?}; connection given up",
                    self.name, self.timeout
                )
            })
    }

    /// The read `cookie` could not be filled (`e`): fail it and give the
    /// connection up, with the reason it was given up for already if it
    /// was (its caller's deadline passed, which shut the socket).
    pub(super) fn fill_failed(&self, s: &mut Shared, cookie: u64, e: io::Error) {
        let (kind, msg) = s.dead.clone().unwrap_or_else(|| {
            let msg = format!("{}: receiving READ data failed: {e}", self.name);
            (e.kind(), msg)
        });
        if let Some(p) = s.pending.get_mut(&cookie) {
            p.state = Slot::Failed(kind, msg.clone());
            p.cv.notify_one();
        }
        self.kill(s, kind, msg);
    }

    /// The next reply header; `None` once the connection failed, stalled
    /// past a request's deadline or closed (it is then given up).
    fn next_header(&self, rx: &mut Recv) -> Option<[u8; SIMPLE_REPLY_BYTES]> {
        let mut h = [0u8; SIMPLE_REPLY_BYTES];
        let got = rx.fill(&mut h, self.timeout, &mut |done| {
            let s = self.shared.lock();
            if s.dead.is_some() || (s.closing && s.pending.is_empty()) {
                return Err(io::Error::new(ErrorKind::ConnectionAborted, "closed"));
            }
            if done > 0 {
                return Ok(false);
            }
            match self.overdue(&s) {
                Some(msg) => Err(io::Error::new(ErrorKind::TimedOut, msg)),
                None => Ok(true),
            }
        });
        let Err(e) = got else {
            return Some(h);
        };
        let mut s = self.shared.lock();
        if s.closing && s.pending.is_empty() {
            let msg = format!("{}: closed", self.name);
            self.kill(&mut s, ErrorKind::ConnectionAborted, msg);
        } else if e.kind() == ErrorKind::TimedOut && e.to_string().contains(&self.name) {
            self.kill(&mut s, e.kind(), e.to_string());
        } else {
            let msg = format!("{}: the connection failed: {e}", self.name);
            self.kill(&mut s, e.kind(), msg);
        }
        None
    }

    /// The reader thread: reply headers in, callers completed by cookie;
    /// at its end, the started requests left are ended.
    ///
    /// It ends requests in batches ([`async_io::batch_ends`]): what the
    /// ends of a burst of replies make (a server's replies to its
    /// clients) goes out together when the reader next waits for the
    /// store ([`Recv`] sends it first), and at its end.
    pub(super) fn reader(self: Arc<Conn>, stream: Stream) {
        let _batch = async_io::ends_batched();
        self.read_replies(stream);
        self.sweep();
        self.end_tail();
    }

    fn read_replies(self: &Arc<Conn>, stream: Stream) {
        let tick = (self.timeout / 8).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let mut rx = Recv::new(stream, RECV_BUFFER_BYTES, tick).tending(Arc::clone(self));
        let mut checked = Instant::now();
        loop {
            if !self.check_overdue(&mut checked, tick) {
                return;
            }
            let Some(h) = self.next_header(&mut rx) else {
                return;
            };
            let mut s = self.shared.lock();
            let (errno, cookie) = match parse_reply(&h) {
                Ok(r) => r,
                Err(what) => {
                    let msg = format!("{}: the remote sent {what}", self.name);
                    self.kill(&mut s, ErrorKind::InvalidData, msg);
                    return;
                }
            };
            if let Some(why) = unexpected(&s, cookie) {
                let msg = format!("{}: the remote answered cookie {cookie}, {why}", self.name);
                self.kill(&mut s, ErrorKind::InvalidData, msg);
                return;
            }
            let sh = &mut *s;
            let p = sh.pending.get_mut(&cookie).expect("checked above");
            if errno == 0 && p.unflushed {
                sh.last_ack = self.durability.acked();
            }
            if p.then.is_some() {
                if !self.answer_started(s, &mut rx, cookie, errno) {
                    return;
                }
                continue;
            }
            let dest = if errno == 0 { p.dest.take() } else { None };
            let Some(dest) = dest else {
                p.state = Slot::Replied(errno);
                p.cv.notify_one();
                continue;
            };
            p.state = Slot::Filling;
            drop(s);
            let filled = rx.fill_dest(&dest, self.timeout);
            drop(dest);
            let mut s = self.shared.lock();
            let p = s
                .pending
                .get_mut(&cookie)
                .expect("its caller waits while it is filled");
            debug_assert!(matches!(p.state, Slot::Filling), "a read is answered twice");
            match filled {
                Ok(()) => {
                    p.state = Slot::Replied(0);
                    p.cv.notify_one();
                }
                Err(e) => {
                    self.fill_failed(&mut s, cookie, e);
                    return;
                }
            }
        }
    }
}

/// Why a reply to `cookie` answers nothing this connection awaits: no
/// request waits for it, or the one registered under it was not sent.
fn unexpected(s: &Shared, cookie: u64) -> Option<&'static str> {
    match s.pending.get(&cookie) {
        Some(p) if matches!(p.state, Slot::Waiting) && p.on_wire => None,
        Some(p) if matches!(p.state, Slot::Waiting) => Some("which it was not sent"),
        _ => Some("which is not in flight"),
    }
}

/// A simple reply header's error code and cookie.
///
/// **Returns:** what is wrong with one that is not a simple reply.
fn parse_reply(h: &[u8; SIMPLE_REPLY_BYTES]) -> Result<(u32, u64), String> {
    let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let errno = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    let mut c = [0u8; 8];
    c.copy_from_slice(&h[8..16]);
    match magic {
        SIMPLE_REPLY_MAGIC => Ok((errno, u64::from_be_bytes(c))),
        STRUCTURED_REPLY_MAGIC => Err("a structured reply, which was not negotiated".into()),
        m => Err(format!("a reply with the bad magic {m:#010x}")),
    }
}
