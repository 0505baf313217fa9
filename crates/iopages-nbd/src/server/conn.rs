//! Transmission on one connection: requests in, replies out, many in
//! flight, and nothing any other thread waits on.
//!
//! Owns: the connection's thread while it has one (it reads each request
//! and its payload, checks it and submits it to the crypt queue in
//! chunks, and is the only thread that ever waits on the socket; between
//! two requests, or partway through one (what arrived kept in a
//! [`Partial`]), once nothing more has arrived and nothing waits to be
//! sent, it returns — on a watcher after lingering up to
//! `ServerOptions::park_after` while no other connection is ready,
//! elsewhere at once — so the connection waits in the parking lot
//! without a thread), the reply side (a completion
//! queues its simple reply and, if nobody is sending, tries to send the
//! queue without blocking; what the socket does not take stays queued,
//! and the connection's thread sends it as the socket drains), FUA (the
//! target is flushed after the write and before the reply), the
//! per-connection bound on requests and bytes in flight and the server's
//! byte budget, and the deadlines: a reply must be taken by the client
//! within the reply timeout of being queued, a request's header must be
//! whole within it of its first byte and its payload within it of the
//! header, and a connection with nothing in
//! flight that sends nothing for the idle timeout is closed. Must never:
//! block a crypt worker on a client (a worker only ever tries a
//! non-blocking send), reply before every chunk of a request has
//! completed, reply to a request twice, submit a write whose payload was
//! not received whole, allocate a payload buffer before the request holds
//! its bytes of the budget, close the connection with requests in flight
//! (it may park with them, their completions sending the replies, but it
//! closes only once each has completed), or panic on what a client sends.
//!
//! Errors (NBD's `proto.md`): EINVAL for unknown commands or flags,
//! misaligned requests (not whole sectors of the target; a TRIM may be
//! misaligned), reads, trims and block status beyond the end, block
//! status without a selected metadata context, FAST_ZERO where it was not
//! advertised, and reads or writes longer than the maximum block size
//! (a write's payload is read and discarded, so the connection stays
//! usable; a length beyond 32 MiB, which the protocol lets a server treat
//! as an attack, closes the connection); ENOSPC for writes and
//! write-zeroes beyond the end; EPERM for anything that writes to a
//! read-only export; ENOMEM when the server's byte budget stays exhausted
//! for the budget wait. The checks run in that order: flags, read-only,
//! bounds, alignment, size. NBD_CMD_FLAG_FUA is accepted on every command
//! (READ, FLUSH and BLOCK_STATUS ignore it: they write nothing). Unless
//! the target allows discards, NBD_CMD_TRIM is checked and then does
//! nothing (the ciphertext stays; a trim is advisory in the protocol, as
//! dm-crypt without `allow_discards`) and NBD_CMD_WRITE_ZEROES writes
//! encrypted zeros; with discards, both punch (WRITE_ZEROES only without
//! NO_HOLE), and a FAST_ZERO request that cannot punch fails at once with
//! ENOTSUP. Block status is answered on the connection's thread.

use crate::proto::*;
use crate::server::buffers::{Buf, Buffers};
use crate::server::device::{Device, Flusher};
use crate::server::inbuf::InBuf;
use crate::server::park;
use crate::server::partial::{chunks, Partial, Whole, CHUNK_BYTES};
use crate::server::rate::Rate;
use crate::server::shares::{BudgetWait, Claim, Look, PeerBudget};
use crate::stats::Counters;
use crate::transport::nonblocking::{Io, Transport};
use crate::ExportInfo;
use iopages_crypt::async_io;
use iopages_crypt::backend::Extent;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io::{self, BufRead, Read};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The connection's read buffer: request headers (and small payloads)
/// are read in batches through it.
const READ_BUFFER_BYTES: usize = 64 << 10;
/// Requests of one connection received and not yet answered, at most.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 128;
/// Payload bytes (read buffers and write payloads) of one connection held
/// at once, at most (a single larger request is still admitted alone).
pub const MAX_BYTES_IN_FLIGHT: u64 = 64 << 20;
/// A request length beyond this closes the connection (`proto.md` lets a
/// server treat payloads over 2^25 bytes as an attack): reading and
/// discarding gigabytes just to answer EINVAL would keep the server busy.
const MAX_DISCARD_BYTES: u64 = 32 << 20;

/// The deadlines and limits a connection runs under.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
    /// A reply not taken by the client this long after it was queued ends
    /// the connection; so does a request header not whole this long after
    /// its first byte, or a payload not received this long after its
    /// header.
    pub(crate) reply_timeout: Duration,
    /// A connection with nothing in flight that sends nothing for this long
    /// is closed (`None`: never).
    pub(crate) idle_timeout: Option<Duration>,
    /// How long a request waits for the server's byte budget before it is
    /// answered ENOMEM.
    pub(crate) budget_wait: Duration,
}

/// What a connection shares with the rest of the server.
pub(crate) struct ConnEnv<'a> {
    pub(crate) export: &'a ExportInfo,
    pub(crate) device: &'a Arc<dyn Device>,
    pub(crate) counters: &'a Arc<Counters>,
    pub(crate) buffers: &'a Buffers,
    /// The server's byte budget as this connection's peer sees it.
    pub(crate) budget: PeerBudget,
    /// Set to the requests in flight (a connection with none is the first
    /// closed when its peer must give one back).
    pub(crate) busy: Arc<AtomicUsize>,
    /// The export's rate limits.
    pub(crate) rate: &'a Rate,
    pub(crate) zeros: &'a Arc<[u8]>,
    pub(crate) limits: ConnLimits,
    /// The client negotiated structured replies.
    pub(crate) structured: bool,
    /// The id of `base:allocation`, if the client selected it.
    pub(crate) allocation_context: Option<u32>,
}

/// Extents in one block status reply, at most (8 bytes each on the wire):
/// enough for a copy to skip the holes of a fragmented stretch, while the
/// `lseek` calls one request costs stay bounded. A client asks again from
/// where the reply stopped (`proto.md` allows a shorter reply).
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 2048;

/// Map a target error to the protocol's error code.
fn errno(e: &io::Error) -> u32 {
    match e.kind() {
        io::ErrorKind::InvalidInput => EINVAL,
        io::ErrorKind::OutOfMemory => ENOMEM,
        io::ErrorKind::StorageFull => ENOSPC,
        io::ErrorKind::PermissionDenied => EPERM,
        _ => EIO,
    }
}

thread_local! {
    /// Set on a connection's thread while further requests are already in
    /// its buffer: replies completed on that thread (requests served
    /// inline) are queued rather than sent, and leave in one vectored
    /// write before the thread next waits on anything.
    static DEFER_REPLIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Most replies a thread ending requests in batches holds back on one
/// connection ([`Conn::reply`]); the next goes out with them.
const HELD_REPLIES_MAX: usize = 32;

/// Largest reply (head and data) held back that way: one 4 KiB read
/// and more; a bigger reply goes out at once (its `sendmsg` is worth its
/// bytes), with any held before it.
const HELD_REPLY_BYTES: usize = 64 << 10;

/// Bytes of the longest fixed reply head: a structured chunk header and a
/// hole's offset and length.
const HEAD_BYTES: usize = STRUCTURED_REPLY_BYTES + 12;

/// What a reply carries, beyond its error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplyKind {
    /// No data.
    Plain,
    /// A read's data, from this offset.
    Read { offset: u64 },
    /// A read whose `len` bytes at `offset` are all zeros: no data.
    Hole { offset: u64, len: u32 },
    /// Block status descriptors of this metadata context.
    BlockStatus { context: u32 },
}

/// What a reply starts with: a simple reply header, or a structured
/// chunk's header and fixed fields, then an error chunk's message.
struct Head {
    bytes: [u8; HEAD_BYTES],
    len: usize,
    message: &'static [u8],
}

impl Head {
    /// The head of the reply to a request: simple replies unless the
    /// client negotiated structured ones; then a read's data is one
    /// `OFFSET_DATA` chunk and every error one `ERROR` chunk with a
    /// message, both final (a read's chunks are all in before its reply
    /// is queued, so no error can follow); other successes stay simple
    /// replies, which `proto.md` allows for replies without payload; a
    /// read that found only zeros is one final OFFSET_HOLE chunk (no data
    /// on the wire); block status is one final BLOCK_STATUS chunk.
    fn new(structured: bool, error: u32, cookie: u64, kind: ReplyKind, data_len: usize) -> Head {
        if !structured || (error == 0 && kind == ReplyKind::Plain) {
            let mut h = Head {
                bytes: [0; HEAD_BYTES],
                len: SIMPLE_REPLY_BYTES,
                message: &[],
            };
            h.bytes[..SIMPLE_REPLY_BYTES].copy_from_slice(&simple_reply(error, cookie));
            return h;
        }
        if error != 0 {
            let msg = error_message(error).as_bytes();
            let mut fixed = [0u8; 6];
            fixed[..4].copy_from_slice(&error.to_be_bytes());
            fixed[4..].copy_from_slice(&(msg.len() as u16).to_be_bytes());
            return Head::chunk(REPLY_TYPE_ERROR, cookie, &fixed, msg, 0);
        }
        match kind {
            ReplyKind::Read { offset } => Head::chunk(
                REPLY_TYPE_OFFSET_DATA,
                cookie,
                &offset.to_be_bytes(),
                &[],
                data_len,
            ),
            ReplyKind::Hole { offset, len } => {
                let mut fixed = [0u8; 12];
                fixed[..8].copy_from_slice(&offset.to_be_bytes());
                fixed[8..].copy_from_slice(&len.to_be_bytes());
                Head::chunk(REPLY_TYPE_OFFSET_HOLE, cookie, &fixed, &[], 0)
            }
            ReplyKind::BlockStatus { context } => Head::chunk(
                REPLY_TYPE_BLOCK_STATUS,
                cookie,
                &context.to_be_bytes(),
                &[],
                data_len,
            ),
            ReplyKind::Plain => unreachable!("a plain success is a simple reply"),
        }
    }

    /// A final chunk of type `kind`: its header, its `fixed` fields, then
    /// `message`; `data_len` more payload bytes follow the head.
    fn chunk(
        kind: u16,
        cookie: u64,
        fixed: &[u8],
        message: &'static [u8],
        data_len: usize,
    ) -> Head {
        // Payloads are at most a read (the export's 32 MiB maximum block
        // size) or a short message.
        let payload = u32::try_from(fixed.len() + message.len() + data_len)
            .expect("a chunk's payload fits its length field");
        let mut h = Head {
            bytes: [0; HEAD_BYTES],
            len: STRUCTURED_REPLY_BYTES + fixed.len(),
            message,
        };
        h.bytes[..STRUCTURED_REPLY_BYTES].copy_from_slice(&structured_reply(
            REPLY_FLAG_DONE,
            kind,
            cookie,
            payload,
        ));
        h.bytes[STRUCTURED_REPLY_BYTES..h.len].copy_from_slice(fixed);
        h
    }

    fn parts(&self) -> [&[u8]; 2] {
        [&self.bytes[..self.len], self.message]
    }
}

/// A reply waiting to be sent, holding its data.
struct Reply {
    head: Head,
    data: Vec<Buf>,
    /// Bytes on the wire: the head and the data.
    len: usize,
    /// The request's bytes in the in-flight bounds, released once sent.
    held_bytes: u64,
    /// When it was queued: the client must have taken it by
    /// `queued + reply_timeout`.
    queued: Instant,
}

/// Replies waiting to be sent, in order.
#[derive(Default)]
struct Outbox {
    queue: VecDeque<Reply>,
    /// Bytes of the first reply already sent.
    front_sent: usize,
    /// A thread is sending (it holds the front of the queue).
    sending: bool,
}

/// The reply side and the in-flight bounds, shared with completions; it
/// outlives the threads that serve the connection in turn.
pub(crate) struct Conn {
    t: Arc<Transport>,
    outbox: Mutex<Outbox>,
    /// The connection has been given up: nothing more is sent.
    dead: AtomicBool,
    /// Requests and bytes in flight on this connection.
    gate: Mutex<(usize, u64)>,
    /// When it was opened, and when (nanoseconds after) a completion last
    /// left nothing in flight: where a parked connection's idle time
    /// starts.
    born: Instant,
    idle_from: AtomicU64,
    /// What the connection's thread, (about to be) waiting in `poll`,
    /// must be kicked for: [`Wake`] as a `u8`, 0 while it is not waiting.
    parked: AtomicU8,
    counters: Arc<Counters>,
    budget: PeerBudget,
    busy: Arc<AtomicUsize>,
    flusher: Flusher,
    limits: ConnLimits,
    /// The client negotiated structured replies.
    structured: bool,
    /// The request received in part when the connection last gave its
    /// thread up (only ever touched by the thread serving it).
    partial: Mutex<Option<Partial>>,
    /// Bytes of the stream read and not consumed when the connection gave
    /// its thread up (pipelined requests behind one waiting for its
    /// place): read first when it is served again.
    unread: Mutex<Vec<u8>>,
    /// A WRITE_ZEROES whose next chunk waits for bytes of the budget
    /// while the connection is parked ([`Partial::Work`]).
    work: Mutex<Option<ZeroWork>>,
}

/// Replies held back by a thread ending requests in batches go out
/// together, as any completion's do: without blocking, the connection's
/// thread kicked to send what the socket does not take.
impl async_io::Held for Conn {
    fn send_held(&self) {
        self.flush(true);
    }
}

impl Conn {
    /// Queue the reply to a request (see [`Head::new`]) with `data` (a
    /// read's chunks, back to back);
    /// the request's place in the in-flight bounds (`held_bytes`) is
    /// released once the reply has been sent (or dropped, the connection
    /// being given up), so a client that stops reading cannot make
    /// replies pile up past them.
    ///
    /// The first completion to find nobody sending becomes the sender and
    /// writes every queued reply it can without blocking; completions
    /// meanwhile only queue theirs. Under load one `writev` carries many
    /// replies. What the socket does not take is left for the
    /// connection's thread.
    ///
    /// A thread that ends requests in batches (a remote store's reader,
    /// [`async_io::batch_ends`]) holds a small reply back instead, up to
    /// [`HELD_REPLIES_MAX`] on the connection: it sends them all at its
    /// next [`async_io::send_held`], before it waits for anything.
    fn reply(
        self: &Arc<Self>,
        error: u32,
        cookie: u64,
        kind: ReplyKind,
        data: Vec<Buf>,
        held_bytes: u64,
    ) {
        let data_len: usize = data.iter().map(|d| d.as_ref().len()).sum();
        let head = Head::new(self.structured, error, cookie, kind, data_len);
        let r = Reply {
            len: head.len + head.message.len() + data_len,
            head,
            data,
            held_bytes,
            queued: Instant::now(),
        };
        if self.dead.load(Ordering::Acquire) {
            self.retire(r);
            return;
        }
        let small = r.len <= HELD_REPLY_BYTES;
        let mut ob = self.outbox.lock();
        ob.queue.push_back(r);
        if ob.sending || DEFER_REPLIES.with(|d| d.get()) {
            return;
        }
        if small && ob.queue.len() < HELD_REPLIES_MAX && async_io::batching_ends() {
            drop(ob);
            async_io::held_by(Arc::clone(self) as Arc<dyn async_io::Held>);
            return;
        }
        self.drain(ob, true);
    }

    /// Send what is queued without blocking, unless a thread is sending.
    /// Called by the connection's own thread, which waits for the socket
    /// next: it is not kicked (a kick to itself would end that wait at
    /// once, and a client that stops reading would have it spin).
    fn flush_replies(&self) {
        self.flush(false);
    }

    /// Send what is queued without blocking, unless a thread is sending
    /// (see [`Conn::drain`] for `kick`).
    fn flush(&self, kick: bool) {
        let ob = self.outbox.lock();
        if ob.sending || ob.queue.is_empty() {
            return;
        }
        self.drain(ob, kick);
    }

    /// Become the sender: send until the queue is empty or the socket is
    /// full; in the second case, with `kick` (a sender other than the
    /// connection's thread), the connection's thread is kicked so it
    /// waits for the socket to drain.
    fn drain<'a>(&'a self, mut ob: parking_lot::MutexGuard<'a, Outbox>, kick: bool) {
        ob.sending = true;
        loop {
            if ob.queue.is_empty() {
                ob.sending = false;
                drop(ob);
                // Everything is sealed, but the socket may not have taken
                // the last records: the connection's thread sends them as
                // it drains.
                if kick && self.t.pending_out() {
                    self.t.kick();
                }
                return;
            }
            let mut batch = std::mem::take(&mut ob.queue);
            let mut sent = std::mem::take(&mut ob.front_sent);
            drop(ob);
            let r = self.send(&mut batch, &mut sent);
            ob = self.outbox.lock();
            if !batch.is_empty() {
                // What is left goes back ahead of what arrived meanwhile.
                batch.append(&mut ob.queue);
                ob.queue = batch;
                ob.front_sent = sent;
            }
            match r {
                Ok(true) => continue,
                Ok(false) => {
                    ob.sending = false;
                    drop(ob);
                    if kick {
                        self.t.kick();
                    }
                    return;
                }
                Err(_) => {
                    ob.sending = false;
                    drop(ob);
                    self.kill();
                    self.discard_if_dead();
                    return;
                }
            }
        }
    }

    /// Write `batch` in order without blocking, `sent` bytes of its first
    /// reply being gone already; every reply sent whole leaves `batch` and
    /// releases its bytes. `Ok(true)`: all sent; `Ok(false)`: the socket
    /// is full.
    fn send(&self, batch: &mut VecDeque<Reply>, sent: &mut usize) -> io::Result<bool> {
        const MAX_IOV: usize = 1024;
        if self.dead.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        loop {
            if batch.is_empty() {
                return Ok(true);
            }
            let n = {
                let mut slices: Vec<io::IoSlice<'_>> = Vec::with_capacity(MAX_IOV);
                let mut skip = *sent;
                'fill: for r in batch.iter() {
                    let head = r.head.parts();
                    for part in head.into_iter().chain(r.data.iter().map(|d| d.as_ref())) {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        slices.push(io::IoSlice::new(&part[skip..]));
                        skip = 0;
                        if slices.len() == MAX_IOV {
                            break 'fill;
                        }
                    }
                }
                let wrote = self.t.try_write(&slices)?;
                self.counters.reply_writes.fetch_add(1, Ordering::Relaxed);
                match wrote {
                    Io::Done(n) => n,
                    Io::Blocked { .. } => return Ok(false),
                }
            };
            let mut left = *sent + n;
            while let Some(front) = batch.front() {
                let len = front.len;
                if left < len {
                    break;
                }
                left -= len;
                let r = batch.pop_front().expect("front exists");
                self.retire(r);
            }
            *sent = left;
        }
    }

    /// Give the connection up: shut the socket, drop the queued replies
    /// (releasing their bytes); completions still to come release theirs
    /// as they arrive.
    fn kill(&self) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.t.shutdown();
        // A sender holding a batch puts it back and finds the socket shut;
        // then it discards what is left itself.
        self.discard_if_dead();
    }

    /// Drop replies queued on a dead connection (a sender that found the
    /// socket shut leaves them).
    fn discard_if_dead(&self) {
        if !self.dead.load(Ordering::Acquire) {
            return;
        }
        let mut ob = self.outbox.lock();
        if ob.sending {
            return;
        }
        let q = std::mem::take(&mut ob.queue);
        ob.front_sent = 0;
        drop(ob);
        for r in q {
            self.retire(r);
        }
    }

    /// A reply is sent or dropped: free its buffers, then its place in the
    /// in-flight bounds.
    fn retire(&self, r: Reply) {
        let held = r.held_bytes;
        drop(r);
        self.release(held);
    }

    /// Wait (on the connection's thread only) until a release kicks the
    /// thread and `ready` holds, or `deadline` passes: [`Conn::pump`] for
    /// neither reading nor writing.
    fn await_release(&self, deadline: Option<Instant>, ready: impl Fn() -> bool) -> io::Result<()> {
        self.pump(false, false, deadline, Wake::OnRelease, ready, None)
            .map(|_| ())
    }

    /// Wait (on the connection's thread only) until the socket is
    /// readable (`read`) or writable (`write`), a release `wake` asks for
    /// or a backlog kicks the thread, or `deadline` passes; meanwhile
    /// queued replies are sent as the socket drains, and a reply older
    /// than the reply timeout gives the connection up. `ready` is checked
    /// after the thread is marked parked, so a release just before cannot
    /// be missed. With `lot` (the parking lot's epoll instance,
    /// on a watcher lingering for its connection's next request), also
    /// until other connections are ready there.
    ///
    /// **Returns:** whether other connections are ready in the lot.
    fn pump(
        &self,
        read: bool,
        write: bool,
        deadline: Option<Instant>,
        wake: Wake,
        ready: impl Fn() -> bool,
        lot: Option<RawFd>,
    ) -> io::Result<bool> {
        // What this thread holds back for the store may be what it waits
        // for.
        async_io::send_held();
        self.flush_replies();
        self.discard_if_dead();
        let dead = self.dead.load(Ordering::Acquire);
        let (queued, oldest) = {
            let ob = self.outbox.lock();
            (!ob.queue.is_empty(), ob.queue.front().map(|r| r.queued))
        };
        // Sealed TLS records the socket has not taken yet count as backlog.
        let backlog = queued || self.t.pending_out();
        let now = Instant::now();
        let mut until = deadline;
        if let (false, Some(q)) = (dead, oldest) {
            let due = q + self.limits.reply_timeout;
            if now >= due {
                self.counters.reply_timeouts.fetch_add(1, Ordering::Relaxed);
                self.kill();
                return Ok(false);
            }
            until = Some(until.map_or(due, |u| u.min(due)));
        }
        self.parked.store(wake as u8, Ordering::SeqCst);
        if ready() {
            self.parked.store(0, Ordering::SeqCst);
            return Ok(false);
        }
        let timeout = until.map(|u| u.saturating_duration_since(now));
        let r = match lot {
            Some(lot) if !dead => self.t.wait_also(read, write || backlog, timeout, lot),
            _ if dead => self.t.wait_kick(timeout),
            _ => self.t.wait(read, write || backlog, timeout),
        };
        self.parked.store(0, Ordering::SeqCst);
        let r = r?;
        if r.hangup && !read && !dead {
            // Shut down under us (the connection was closed for another
            // peer's share) or broken: nothing more can be sent, and a
            // wait that polled it again would return at once.
            self.kill();
            return Ok(false);
        }
        if r.writable && backlog {
            if self.t.push_out().is_err() {
                self.kill();
                return Ok(false);
            }
            self.flush_replies();
        }
        Ok(r.other)
    }

    /// Whether a request of `bytes` has room in the bounds now; if not,
    /// the next release kicks the connection (its wake-up descriptor,
    /// watched while it is parked with requests in flight).
    fn room_or_wake(&self, bytes: u64) -> bool {
        if !self.full(&self.gate.lock(), bytes) {
            return true;
        }
        self.parked.store(Wake::OnRelease as u8, Ordering::SeqCst);
        // A release between the first look and the mark kicked nobody.
        if !self.full(&self.gate.lock(), bytes) {
            self.parked.store(0, Ordering::SeqCst);
            return true;
        }
        false
    }

    fn full(&self, g: &(usize, u64), bytes: u64) -> bool {
        g.0 >= MAX_REQUESTS_IN_FLIGHT || (g.0 > 0 && g.1 + bytes > MAX_BYTES_IN_FLIGHT)
    }

    /// Take a place in flight for a request of `bytes` payload bytes:
    /// first in this connection's bounds, then in its peer's share of the
    /// server's budget, looking again (`wait`, a wait begun before) or
    /// for the first time. With `park`, a request the budget has no bytes
    /// for now does not wait on this thread: [`Admit::Wait`] hands its
    /// wait back, nothing held, to be taken up at its next look.
    fn acquire(&self, bytes: u64, wait: Option<Box<BudgetWait>>, park: bool) -> io::Result<Admit> {
        loop {
            {
                let mut g = self.gate.lock();
                if !self.full(&g, bytes) {
                    g.0 += 1;
                    g.1 += bytes;
                    self.busy.store(g.0, Ordering::Relaxed);
                    break;
                }
            }
            if self.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let room = || !self.full(&self.gate.lock(), bytes);
            self.await_release(None, room)?;
        }
        let r = self.charge_for(bytes, false, wait, park);
        if !matches!(r, Ok(Admit::Taken)) {
            let mut g = self.gate.lock();
            assert!(
                g.0 >= 1 && g.1 >= bytes,
                "a place in flight is undone twice"
            );
            g.0 -= 1;
            g.1 -= bytes;
            self.busy.store(g.0, Ordering::Relaxed);
        }
        r
    }

    /// [`Conn::acquire`] waiting on this thread. `Ok(false)`: refused.
    fn acquire_here(&self, bytes: u64) -> io::Result<bool> {
        Ok(matches!(self.acquire(bytes, None, false)?, Admit::Taken))
    }

    /// Take `bytes` of the peer's share now, or begin a wait for them
    /// (counted). `work`: the bytes are a chunk of work.
    fn first_look(&self, bytes: u64, work: bool) -> Option<Box<BudgetWait>> {
        let mut claim = Claim::new(work);
        if self.budget.try_take(bytes, &mut claim) {
            return None;
        }
        self.counters.budget_waits.fetch_add(1, Ordering::Relaxed);
        let patience = self.limits.budget_wait;
        Some(Box::new(BudgetWait::new(
            &self.budget,
            claim,
            &self.t,
            patience,
            Instant::now(),
        )))
    }

    /// Bytes of the peer's share for a request's payload (or, `work`, a
    /// chunk of work): with `park`, one look ([`Conn::charge_once`],
    /// taking up `wait`); without, waiting here ([`Conn::charge`]).
    fn charge_for(
        &self,
        bytes: u64,
        work: bool,
        wait: Option<Box<BudgetWait>>,
        park: bool,
    ) -> io::Result<Admit> {
        if park {
            return Ok(self.charge_once(bytes, work, wait));
        }
        Ok(match self.charge(bytes, work)? {
            true => Admit::Taken,
            false => Admit::Refused,
        })
    }

    /// One look for a request's payload bytes (or, `work`, a chunk of
    /// work) without waiting: taken,
    /// refused (the wait ran out: counted), or the wait to take up again
    /// at its next look — meanwhile a release of this connection kicks it.
    fn charge_once(&self, bytes: u64, work: bool, wait: Option<Box<BudgetWait>>) -> Admit {
        let Some(mut w) = wait.or_else(|| self.first_look(bytes, work)) else {
            return Admit::Taken;
        };
        match w.look(bytes, Instant::now()) {
            Look::Taken => Admit::Taken,
            Look::Refused => {
                self.counters
                    .budget_refusals
                    .fetch_add(1, Ordering::Relaxed);
                Admit::Refused
            }
            Look::Wait => {
                self.parked.store(Wake::OnRelease as u8, Ordering::SeqCst);
                Admit::Wait(w)
            }
        }
    }

    /// Take `bytes` of the peer's share of the server's budget, waiting
    /// on this thread (and sending replies meanwhile) up to the budget
    /// wait: for a request's payload, or a chunk of the work a request
    /// causes. `Ok(false)`: the wait ran out (counted); `Err`: the
    /// connection died. `work`: the bytes are a chunk of work (bounded by
    /// the peer's work window too).
    fn charge(&self, bytes: u64, work: bool) -> io::Result<bool> {
        let Some(mut w) = self.first_look(bytes, work) else {
            return Ok(true);
        };
        loop {
            if self.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            match w.look(bytes, Instant::now()) {
                Look::Taken => return Ok(true),
                Look::Refused => {
                    self.counters
                        .budget_refusals
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(false);
                }
                Look::Wait => self.await_release(Some(w.next()), || false)?,
            }
        }
    }

    /// Give back what [`Conn::charge`] took; `idle`: nothing is left in
    /// flight now (see [`Conn::wake`]).
    fn uncharge(&self, bytes: u64, work: bool, idle: bool) {
        self.budget.give_back(bytes, work);
        self.wake(idle);
    }

    /// Kick the connection's thread if it waits for what a release gives
    /// back: every release while it waits for room ([`Wake::OnRelease`]),
    /// only the one that leaves nothing in flight (`idle`) while it waits
    /// for the client ([`Wake::WhenIdle`]).
    fn wake(&self, idle: bool) {
        let parked = self.parked.load(Ordering::SeqCst);
        if parked == Wake::OnRelease as u8 || (idle && parked == Wake::WhenIdle as u8) {
            self.t.kick();
        }
    }

    /// Wait, sending replies meanwhile, until the export's rate limits
    /// admit a request of `bytes`.
    fn throttle(&self, rate: &Rate, bytes: u64) -> io::Result<()> {
        let mut waited = false;
        while let Err(wait) = rate.try_take(bytes) {
            if !waited {
                rate.waits.fetch_add(1, Ordering::Relaxed);
                waited = true;
            }
            if self.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let until = Some(Instant::now() + wait);
            self.await_release(until, || false)?;
        }
        Ok(())
    }

    fn release(&self, bytes: u64) {
        let idle = {
            let mut g = self.gate.lock();
            assert!(g.0 >= 1, "a reply releases a place in flight nobody holds");
            assert!(
                g.1 >= bytes,
                "a reply releases more bytes than are in flight"
            );
            g.0 -= 1;
            g.1 -= bytes;
            self.busy.store(g.0, Ordering::Relaxed);
            g.0 == 0
        };
        if idle {
            let at = self.born.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            self.idle_from.fetch_max(at, Ordering::Relaxed);
        }
        self.uncharge(bytes, false, idle);
    }

    /// Drop a request received in part: its buffers freed, its place and
    /// bytes in flight, if it took them, given back.
    fn abandon(&self, p: Partial) {
        if matches!(p, Partial::Work) {
            let work = self.work.lock().take();
            if let Some(w) = work {
                w.fail(EIO);
            }
        }
        let held = p.held_bytes();
        drop(p);
        if let Some(bytes) = held {
            self.release(bytes);
        }
    }

    /// Nothing waits to be sent: no reply queued (or one being sent by a
    /// completion, which kicks the connection if the socket is full) and
    /// no sealed TLS record.
    pub(crate) fn quiet(&self) -> bool {
        let ob = self.outbox.lock();
        (ob.queue.is_empty() || ob.sending) && !self.t.pending_out()
    }

    /// When a parked connection falls to the idle timeout: the timeout
    /// after its last completion, or after now while requests are in
    /// flight (looked at again then). `None` without an idle timeout.
    /// Parked with a request received in part: that request's deadline.
    /// Parked with replies the socket has not taken: the oldest one's
    /// reply timeout, if that is earlier.
    pub(crate) fn idle_deadline(&self) -> Option<Instant> {
        let due = self.reply_due();
        let base = if let Some(p) = &*self.partial.lock() {
            // A request received in part: due whole by its deadline (one
            // waiting for its place has none of its own; one waiting for
            // bytes looks again then).
            self.parked_deadline(p)
        } else if let Some(timeout) = self.limits.idle_timeout {
            if self.busy() {
                Some(Instant::now() + timeout)
            } else {
                let from = Duration::from_nanos(self.idle_from.load(Ordering::Relaxed));
                Some(self.born + from + timeout)
            }
        } else {
            None
        };
        match (base, due) {
            (Some(b), Some(d)) => Some(b.min(d)),
            (b, d) => b.or(d),
        }
    }

    /// When the oldest reply waiting for the socket must have been taken
    /// by the client (none waiting: `None`).
    pub(crate) fn reply_due(&self) -> Option<Instant> {
        let ob = self.outbox.lock();
        ob.queue
            .front()
            .map(|r| r.queued + self.limits.reply_timeout)
    }

    /// A request waits for its place in the bounds or for bytes of the
    /// budget: a parked connection's wake-up descriptor must be watched (a
    /// release, or the keeper at the next look, kicks it), whether or not
    /// anything is still in flight by then.
    pub(crate) fn waits_for_place(&self) -> bool {
        matches!(
            *self.partial.lock(),
            Some(Partial::Place { .. } | Partial::Work)
        )
    }

    /// A request waits for bytes of the budget, its next look has come by
    /// `now`, and no reply is overdue: the lot runs the parked connection
    /// (which looks) rather than closing it.
    pub(crate) fn budget_look_due(&self, now: Instant) -> bool {
        let look = match &*self.partial.lock() {
            Some(
                p @ (Partial::Place {
                    budget: Some(_), ..
                }
                | Partial::Work),
            ) => self.parked_deadline(p),
            _ => return false,
        };
        look.is_some_and(|l| l <= now) && self.reply_due().is_none_or(|d| d > now)
    }

    /// The deadline of a connection parked with `p`: when the request must
    /// be whole, or, waiting for bytes, when it looks again (a
    /// WRITE_ZEROES's work: its next chunk's).
    fn parked_deadline(&self, p: &Partial) -> Option<Instant> {
        match p {
            Partial::Work => self.work.lock().as_ref()?.wait.as_ref().map(|w| w.next()),
            p => p.by(),
        }
    }

    /// Requests are in flight (a parked connection's replies are still to
    /// come).
    pub(crate) fn busy(&self) -> bool {
        self.in_flight() > 0
    }

    fn in_flight(&self) -> usize {
        self.gate.lock().0
    }

    /// Wait until every request in flight has completed and its reply has
    /// been sent (or dropped with the connection).
    fn wait_idle(&self) {
        loop {
            self.discard_if_dead();
            let idle = || self.in_flight() == 0;
            if idle() {
                return;
            }
            if self.await_release(None, idle).is_err() {
                // poll itself failed: give up on the client, then wait
                // for the completions to release their places.
                self.kill();
                while self.in_flight() > 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                return;
            }
        }
    }
}

/// One request in flight, completed chunk by chunk.
struct Pending {
    conn: Arc<Conn>,
    cookie: u64,
    command: u16,
    offset: u64,
    length: u64,
    held_bytes: u64,
    fua: bool,
    /// Chunks not yet completed, plus one held by the submitter.
    remaining: AtomicUsize,
    error: AtomicU32,
    /// A read's chunks, in order, as they complete.
    read: Mutex<Vec<Option<Buf>>>,
    /// When its header arrived (the latency histograms' start).
    received: Instant,
}

/// A WRITE_ZEROES of encrypted zeros under way: its request (counting
/// every chunk, and one more the submitter holds until the last is
/// submitted), the next chunk's offset, the end, FUA on each chunk, and
/// its next chunk's wait for bytes, if it waits.
struct ZeroWork {
    p: Arc<Pending>,
    at: u64,
    end: u64,
    fua_down: bool,
    wait: Option<Box<BudgetWait>>,
}

impl ZeroWork {
    fn new(p: Arc<Pending>, offset: u64, len: u64, fua_down: bool) -> ZeroWork {
        ZeroWork {
            p,
            at: offset,
            end: offset + len,
            fua_down,
            wait: None,
        }
    }

    /// Fail the chunks not submitted with `error`, and give the
    /// submitter's count up: the request completes once those submitted
    /// have.
    fn fail(self, error: u32) {
        for _ in chunks(self.at, self.end - self.at) {
            self.p.chunk_done(error);
        }
        self.p.chunk_done(0);
    }
}

impl Pending {
    fn chunk_done(&self, error: u32) {
        if error != 0 {
            let _ = self
                .error
                .compare_exchange(0, error, Ordering::AcqRel, Ordering::Acquire);
        }
        let left = self.remaining.fetch_sub(1, Ordering::AcqRel);
        // A chunk completed twice would send the reply twice.
        assert!(
            left >= 1,
            "a request's chunks complete more often than there are"
        );
        if left == 1 {
            self.finish();
        }
    }

    fn finish(&self) {
        let mut error = self.error.load(Ordering::Acquire);
        if error == 0 && self.fua {
            if let Err(e) = (self.conn.flusher)() {
                error = errno(&e);
            }
        }
        let chunks = std::mem::take(&mut *self.read.lock());
        let mut data = if error == 0 && self.command == CMD_READ {
            match chunks.into_iter().collect::<Option<Vec<Buf>>>() {
                Some(d) => d,
                // Every chunk completed without error, so each is here.
                None => {
                    error = EIO;
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        let counters = &self.conn.counters;
        counters.command(self.command).done(self.length, error);
        counters
            .latency(self.command)
            .record(self.received.elapsed());
        let was = counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        debug_assert!(was >= 1, "the server's in-flight count underflows");
        let kind = if self.command != CMD_READ {
            ReplyKind::Plain
        } else if error == 0 && self.conn.structured && data.iter().all(|d| all_zero(d.as_ref())) {
            // A read wholly in zeros (a hole, or zeros written): its data
            // stays home. Its length is a u32 on the wire.
            data = Vec::new();
            ReplyKind::Hole {
                offset: self.offset,
                len: self.length as u32,
            }
        } else {
            ReplyKind::Read {
                offset: self.offset,
            }
        };
        self.conn
            .reply(error, self.cookie, kind, data, self.held_bytes);
    }
}

/// Where the connection's thread is in reading the stream.
#[derive(Clone, Copy)]
enum Phase {
    /// Waiting for a request header: the idle timeout applies while
    /// nothing is in flight.
    Header { since: Instant },
    /// Receiving a payload: it must be whole by the deadline.
    Payload { by: Instant },
}

/// The connection's reading side: every wait goes through the pump, so
/// replies keep leaving while the thread waits for the client.
struct ConnRead {
    conn: Arc<Conn>,
    phase: Phase,
    /// Nothing of the next request has been read yet, and the thread may
    /// be given up after lingering this long (`ServerOptions::park_after`).
    park_after: Option<Duration>,
    /// The wait for a header began with requests in flight: its idle
    /// timers start when the last of them completes, which kicks it.
    busy: bool,
    /// The thread's linger for the next request, before it is given up.
    linger: Linger,
}

/// A connection's thread lingering for its next request before it is
/// given up (and its watcher goes back to the parking lot).
#[derive(Default)]
struct Linger {
    /// The wait [`ConnRead::wait_until`] set up is a linger: for the next
    /// request, nothing waiting to be sent, the thread to be given up at
    /// its end. Any other wait (a backlog the client does not take) is
    /// one on the client.
    on: bool,
    /// When the linger with requests in flight began (the idle linger
    /// counts from `Phase::Header`'s start).
    from: Option<Instant>,
    /// Other connections became ready in the parking lot meanwhile: the
    /// linger ends at once.
    others_ready: bool,
}

/// What kicks a connection's thread waiting in [`Conn::pump`], besides
/// its socket, a backlog of replies and its deadline.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Wake {
    /// Every release (a place in flight, budget given back): the thread
    /// waits for room.
    OnRelease = 1,
    /// Only the release that leaves nothing in flight: the thread waits
    /// for the client, and its idle timers start then. (Kicking it for
    /// every completion cost a wake-up, a `poll` and a failed `recv` per
    /// request under load.)
    WhenIdle = 2,
}

/// What ends a [`transmit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The connection is closed, every request in flight completed.
    Closed,
    /// Nothing buffered, nothing received for `park_after` (or less, when
    /// another connection is ready) and nothing waiting to be sent: the
    /// connection may wait without a thread, its requests in flight, if
    /// any, completing meanwhile. Its idle deadline, if any, is
    /// `deadline`.
    Idle { deadline: Option<Instant> },
}

/// What became of a request's bid for its place and bytes in flight.
enum Admit {
    /// Both taken.
    Taken,
    /// The budget stayed exhausted for the budget wait (counted): the
    /// request is answered ENOMEM and holds nothing.
    Refused,
    /// No bytes for it yet: its wait, to take up again at its next look
    /// (nothing held meanwhile).
    Wait(Box<BudgetWait>),
}

/// The error a read returns to unwind to [`Reader::run`] for parking.
fn park_signal() -> io::Error {
    io::Error::new(io::ErrorKind::WouldBlock, ParkSignal)
}

/// Marks [`park_signal`]'s error.
#[derive(Debug)]
struct ParkSignal;

impl std::fmt::Display for ParkSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("idle: the connection gives its thread up")
    }
}

impl std::error::Error for ParkSignal {}

fn is_park_signal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<ParkSignal>())
}

impl Read for ConnRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.conn.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let write = match self.conn.t.try_read(buf)? {
                Io::Done(n) => {
                    // Mid-request, a linger counts from the last bytes.
                    self.linger.from = None;
                    return Ok(n);
                }
                Io::Blocked { write } => write,
            };
            let deadline = self.wait_until(Instant::now())?;
            let (conn, busy) = (&self.conn, self.busy);
            // Lingering for the next request on a watcher: other
            // connections ready in the lot end the linger.
            let lot = self.linger.on.then(park::lot_fd).flatten();
            let others = conn.pump(
                !write,
                write,
                deadline,
                Wake::WhenIdle,
                || busy && conn.in_flight() == 0,
                lot,
            )?;
            self.linger.others_ready |= others;
        }
    }
}

impl ConnRead {
    /// Until when the thread may wait for the client now: the payload's
    /// deadline, or (waiting for a header with nothing in flight) the idle
    /// timeout and the time to give the thread up, whichever is first.
    ///
    /// **Returns:** `TimedOut` (counted) when a deadline has passed;
    /// [`park_signal`] when the thread should be given up.
    fn wait_until(&mut self, now: Instant) -> io::Result<Option<Instant>> {
        self.linger.on = false;
        let counters = &self.conn.counters;
        if matches!(self.phase, Phase::Payload { .. }) {
            // A payload's wait is not about idleness.
            self.busy = false;
        }
        let since = match &mut self.phase {
            Phase::Payload { by } if now >= *by => {
                counters.payload_timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(io::ErrorKind::TimedOut.into());
            }
            Phase::Payload { by } => {
                let by = *by;
                return self.linger_mid_request(now, by);
            }
            Phase::Header { since } => since,
        };
        if self.conn.in_flight() > 0 {
            *since = now;
            self.busy = true;
            let Some(linger) = self.park_after else {
                return Ok(None);
            };
            // Kicks made before are forgotten first, so a connection
            // parked from here is resumed by a later one only.
            self.conn.t.clear_kicks();
            // Between two requests: after the linger (or at once, others
            // being ready) the connection parks; the replies of those in
            // flight go out from their completions, a backlog the socket
            // has not taken waits for room (the parked socket is watched
            // for it), and a reply finding the socket full kicks it back
            // onto a thread.
            let until = *self.linger.from.get_or_insert(now) + linger;
            if std::mem::take(&mut self.linger.others_ready) || now >= until {
                return Err(park_signal());
            }
            self.linger.on = true;
            return Ok(Some(until));
        }
        if std::mem::take(&mut self.busy) {
            // Woken by the last completion: idle from now.
            *since = now;
        }
        let idle = self.conn.limits.idle_timeout.map(|i| *since + i);
        if idle.is_some_and(|i| now >= i) {
            counters.idle_closes.fetch_add(1, Ordering::Relaxed);
            return Err(io::ErrorKind::TimedOut.into());
        }
        // Sealed TLS records still leaving wait for room in the lot, as a
        // backlog of replies does.
        let park = self.park_after.map(|p| *since + p);
        // Other connections ready: the linger ends now.
        let others = std::mem::take(&mut self.linger.others_ready);
        if park.is_some_and(|p| now >= p || others) {
            return Err(park_signal());
        }
        self.linger.on = park.is_some();
        Ok(match (idle, park) {
            (Some(i), Some(p)) => Some(i.min(p)),
            (i, p) => i.or(p),
        })
    }
}

impl ConnRead {
    /// Mid-request (a header begun, a payload on its way) on a thread that
    /// may be given up: linger for the rest as for a next request, then
    /// give the thread up, what has arrived kept ([`Partial`]); elsewhere
    /// wait until the request is due.
    ///
    /// **Returns:** as [`ConnRead::wait_until`].
    fn linger_mid_request(&mut self, now: Instant, by: Instant) -> io::Result<Option<Instant>> {
        let Some(linger) = self.park_after else {
            return Ok(Some(by));
        };
        // As between requests: kicks made before are forgotten, and a
        // backlog of replies waits for room in the lot.
        self.conn.t.clear_kicks();
        let until = *self.linger.from.get_or_insert(now) + linger;
        if std::mem::take(&mut self.linger.others_ready) || now >= until {
            return Err(park_signal());
        }
        self.linger.on = true;
        Ok(Some(until.min(by)))
    }
}

/// The reply side and bounds of a connection entering transmission.
pub(crate) fn open(t: Arc<Transport>, env: &ConnEnv<'_>) -> Arc<Conn> {
    Arc::new(Conn {
        t,
        outbox: Mutex::new(Outbox::default()),
        dead: AtomicBool::new(false),
        gate: Mutex::new((0, 0)),
        born: Instant::now(),
        idle_from: AtomicU64::new(0),
        parked: AtomicU8::new(0),
        counters: Arc::clone(env.counters),
        budget: env.budget.clone(),
        busy: Arc::clone(&env.busy),
        flusher: env.device.flusher(),
        limits: env.limits,
        structured: env.structured,
        partial: Mutex::new(None),
        unread: Mutex::new(Vec::new()),
        work: Mutex::new(None),
    })
}

/// Serve transmission until the client disconnects, sends NBD_CMD_DISC,
/// breaks the protocol, misses a deadline or the socket is shut down;
/// then wait for every request in flight to complete and close it. With
/// `park_after`, return [`Ended::Idle`] instead once the connection has
/// had nothing in flight and received nothing for that long, between two
/// requests: a later call serves it again.
pub(crate) fn transmit(conn: &Arc<Conn>, env: &ConnEnv<'_>, park_after: Option<Duration>) -> Ended {
    // A release marked to kick it while it waited in the lot has, or
    // need not any more: only a wait from here marks again.
    conn.parked.store(0, Ordering::SeqCst);
    let mut reader = Reader {
        // Headers of pipelined requests arrive together: one read takes
        // several. A payload larger than the buffer bypasses it and lands
        // in its arena buffer directly.
        stream: InBuf::new(
            READ_BUFFER_BYTES,
            ConnRead {
                conn: Arc::clone(conn),
                phase: Phase::Header {
                    since: Instant::now(),
                },
                park_after: None,
                busy: false,
                linger: Linger::default(),
            },
        ),
        env,
        conn,
        received: Instant::now(),
        park_after,
    };
    reader
        .stream
        .put_back(&std::mem::take(&mut *conn.unread.lock()));
    let r = {
        // Requests held back for the store leave however `run` ends (an
        // unwinding panic too): nothing held outlives the turn.
        struct SendHeld;
        impl Drop for SendHeld {
            fn drop(&mut self) {
                async_io::hold_starts(false);
            }
        }
        let _send = SendHeld;
        reader.run()
    };
    DEFER_REPLIES.with(|d| d.set(false));
    if let Ok(idle @ Ended::Idle { .. }) = r {
        // Replies held back for a batch leave before the thread is given
        // up (what the socket has no room for waits in the lot).
        conn.flush_replies();
        return idle;
    }
    conn.flush_replies();
    conn.wait_idle();
    // Every request has completed and released its place and its bytes.
    debug_assert_eq!(
        *conn.gate.lock(),
        (0, 0),
        "a connection ends with requests in flight"
    );
    close(conn, false);
    Ended::Closed
}

/// Close a parked connection: a reply it has not taken past the reply
/// timeout gives it up (counted as a reply timeout), a request it had
/// received in part is dropped (its deadline passing is counted as a
/// payload timeout), its requests in flight complete and their replies go
/// first, as far as the client takes them (at the stop, `idle_timeout`
/// false: what the socket does not take at once is dropped); then as
/// [`close`].
pub(crate) fn close_parked(conn: &Conn, idle_timeout: bool) {
    // A reply the client has not taken in time (or, at the stop, at all:
    // the stop waits for no client): the connection is given up, its
    // queued replies dropped, as on a thread.
    let overdue = conn.reply_due().is_some_and(|d| Instant::now() >= d);
    if !idle_timeout {
        conn.flush_replies();
        if !conn.quiet() {
            conn.kill();
        }
    }
    if overdue {
        conn.counters.reply_timeouts.fetch_add(1, Ordering::Relaxed);
        conn.kill();
    }
    let idle_timeout = idle_timeout && !overdue;
    let partial = conn.partial.lock().take();
    let late = partial.is_some() && idle_timeout;
    if let Some(p) = partial {
        conn.abandon(p);
    }
    if late {
        // Its deadline was the request's, not an idle one.
        conn.counters
            .payload_timeouts
            .fetch_add(1, Ordering::Relaxed);
    }
    conn.flush_replies();
    conn.wait_idle();
    close(conn, idle_timeout && !late);
}

/// Close a connection with nothing in flight (an idle one: `idle_timeout`
/// counts it as closed for idleness): TLS's close notice, if it runs TLS,
/// then the socket.
pub(crate) fn close(conn: &Conn, idle_timeout: bool) {
    if idle_timeout {
        conn.counters.idle_closes.fetch_add(1, Ordering::Relaxed);
    }
    conn.t.close_tls();
    conn.t.shutdown();
}

struct Reader<'a, 'e> {
    stream: InBuf<ConnRead>,
    env: &'a ConnEnv<'e>,
    conn: &'a Arc<Conn>,
    /// Give the thread up after this long idle between requests.
    park_after: Option<Duration>,
    /// When the header of the request being read arrived.
    received: Instant,
}

/// Whether `b` is all zero bytes: cheap for data (real data differs in its
/// first bytes), a vectorised OR per 4 KiB for zeros.
fn all_zero(b: &[u8]) -> bool {
    if b.iter().take(16).any(|&x| x != 0) {
        return false;
    }
    b.chunks(4096)
        .all(|c| c.iter().fold(0u8, |acc, &x| acc | x) == 0)
}

/// The first `.1` bytes of a shared buffer of zeros.
struct Zeros(Arc<[u8]>, usize);

impl AsRef<[u8]> for Zeros {
    fn as_ref(&self) -> &[u8] {
        &self.0[..self.1]
    }
}

/// The error a request gets before anything is done (0: none), checked
/// in `proto.md`'s terms: flags, read-only, bounds, alignment, size.
pub(crate) fn check_request(e: &ExportInfo, req: &Request) -> u32 {
    let len = req.length as u64;
    // FUA is valid on every command once NBD_FLAG_SEND_FUA is advertised.
    let allowed = match req.command {
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM => CMD_FLAG_FUA,
        // FAST_ZERO only where NBD_FLAG_SEND_FAST_ZERO was advertised.
        CMD_WRITE_ZEROES if e.fast_zero => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => return EINVAL,
    };
    if req.flags & !allowed != 0 {
        return EINVAL;
    }
    if req.command == CMD_FLUSH {
        return if req.offset == 0 && req.length == 0 {
            0
        } else {
            EINVAL
        };
    }
    let writes = !matches!(req.command, CMD_READ | CMD_BLOCK_STATUS);
    if writes && e.read_only {
        return EPERM;
    }
    match req.offset.checked_add(len) {
        Some(end) if end <= e.size_bytes => {}
        _ => {
            return if matches!(req.command, CMD_WRITE | CMD_WRITE_ZEROES) {
                ENOSPC
            } else {
                EINVAL
            }
        }
    }
    let ss = e.min_block_bytes as u64;
    if len == 0 {
        return EINVAL;
    }
    // A discard is advisory: a misaligned TRIM is served for the whole
    // sectors inside it and leaves its partial head and tail alone (a
    // deliberate departure from proto.md's SHOULD for misaligned requests,
    // TRIM only: qemu splits a 512-byte-block guest's discard of a large
    // disk at unaligned points and fails the guest's whole discard on
    // EINVAL). Every other command must be aligned.
    if req.command != CMD_TRIM && (!req.offset.is_multiple_of(ss) || !len.is_multiple_of(ss)) {
        return EINVAL;
    }
    if matches!(req.command, CMD_READ | CMD_WRITE) && req.length > e.max_block_bytes {
        return EINVAL;
    }
    0
}

impl Reader<'_, '_> {
    /// Whether a WRITE_ZEROES is served by punching: discards allowed,
    /// a backend that can punch, and no NO_HOLE.
    fn punches(&self, req: &Request) -> bool {
        self.env.export.fast_zero && req.flags & CMD_FLAG_NO_HOLE == 0
    }

    /// Write encrypted zeros for `w` chunk by chunk from where it stands
    /// (one chunk of its request each, with FUA when it says so), each
    /// chunk charged to the peer's share and its work window before it is
    /// submitted and given back when written, so a huge WRITE_ZEROES holds
    /// at most its share of the server and interleaves with other
    /// clients' requests; chunks the share did not admit within the
    /// budget wait fail with ENOMEM (and are not written). On a thread that may be given up, a chunk the
    /// share has no bytes for now does not wait here: the work is handed
    /// back with its wait, to be taken up at its next look
    /// ([`Partial::Work`]); elsewhere it waits here.
    ///
    /// **Returns:** the work to take up again, if any; `Err` when the
    /// connection died (the chunks left are failed).
    fn write_zeroes(&self, mut w: ZeroWork) -> io::Result<Option<ZeroWork>> {
        let park = self.park_after.is_some();
        while w.at < w.end {
            let n = (w.end - w.at).min(CHUNK_BYTES as u64);
            match self.conn.charge_for(n, true, w.wait.take(), park) {
                Err(e) => {
                    w.fail(EIO);
                    return Err(e);
                }
                Ok(Admit::Taken) => {}
                Ok(Admit::Refused) => {
                    w.fail(ENOMEM);
                    return Ok(None);
                }
                Ok(Admit::Wait(wait)) => {
                    w.wait = Some(wait);
                    return Ok(Some(w));
                }
            }
            let (p, conn) = (Arc::clone(&w.p), Arc::clone(self.conn));
            self.env.device.submit_write(
                w.at,
                Box::new(Zeros(Arc::clone(self.env.zeros), n as usize)),
                w.fua_down,
                Box::new(move |r| {
                    conn.uncharge(n, true, false);
                    p.chunk_done(r.err().map_or(0, |e| errno(&e)))
                }),
            );
            w.at += n;
        }
        // Every chunk submitted: the submitter's own count goes.
        w.p.chunk_done(0);
        Ok(None)
    }

    /// Start or go on with `w`; work that waits for bytes is kept with
    /// the connection, which parks ([`Partial::Work`]).
    fn zero_on(&mut self, w: ZeroWork) -> io::Result<Option<Partial>> {
        let Some(w) = self.write_zeroes(w)? else {
            return Ok(None);
        };
        *self.conn.work.lock() = Some(w);
        Ok(Some(Partial::Work))
    }

    /// Take up the WRITE_ZEROES kept while the connection was parked.
    fn resume_work(&mut self) -> io::Result<Option<Partial>> {
        // Kicks made before are spent: only a release from now brings a
        // parked connection back.
        self.conn.t.clear_kicks();
        let work = self.conn.work.lock().take();
        match work {
            Some(w) => self.zero_on(w),
            None => Ok(None),
        }
    }

    /// Punch (or discard) `len` bytes at `offset` with `f`, in one call,
    /// charged to the peer's share (and its work window) as one chunk
    /// while it runs. One call, not chunks: a punch runs on this
    /// connection's own thread and queues nothing for the crypt workers,
    /// and a cut between two calls could leave the file-system block it
    /// falls in unpunched (a LUKS1 payload may start 512 bytes off one).
    ///
    /// **Returns:** `f`'s result, ENOMEM as an error when the share did
    /// not admit it in time; `Err` outside when the connection died.
    fn punch(
        &self,
        offset: u64,
        len: u64,
        f: impl Fn(u64, u64) -> io::Result<()>,
    ) -> io::Result<io::Result<()>> {
        let units = len.min(CHUNK_BYTES as u64);
        if !self.conn.charge(units, true)? {
            return Ok(Err(io::Error::from_raw_os_error(libc::ENOMEM)));
        }
        let r = f(offset, len);
        self.conn.uncharge(units, true, false);
        Ok(r)
    }

    /// Whether `req`'s FUA goes down with each of its writes
    /// ([`Device::native_fua`](crate::server::device::Device::native_fua))
    /// instead of a flush of the target after them.
    fn fua_down(&self, req: &Request) -> bool {
        req.flags & CMD_FLAG_FUA != 0 && self.env.device.native_fua()
    }

    /// Answer NBD_CMD_BLOCK_STATUS (checked) from the target's allocation
    /// map: with discards allowed a hole is HOLE|ZERO (it reads as zeros);
    /// without, every extent is reported allocated (status 0: a hole in
    /// the image decrypts to noise, not zeros). At most
    /// [`MAX_BLOCK_STATUS_EXTENTS`] descriptors, one with REQ_ONE.
    fn block_status(&mut self, req: &Request) -> io::Result<()> {
        let context = self.env.allocation_context.expect("checked by request()");
        let len = req.length as u64;
        let max = if req.flags & CMD_FLAG_REQ_ONE != 0 {
            1
        } else {
            MAX_BLOCK_STATUS_EXTENTS
        };
        let extents = if self.env.export.discards {
            self.env.device.holes().extents(req.offset, len, max)
        } else {
            Ok(vec![Extent {
                len_bytes: len,
                hole: false,
            }])
        };
        let descriptors: Vec<(u32, u32)> = match extents {
            // Each extent lies inside the request, whose length is a u32.
            Ok(v) if !v.is_empty() => v
                .iter()
                .filter(|x| x.len_bytes > 0)
                .map(|x| {
                    let status = if x.hole { STATE_HOLE | STATE_ZERO } else { 0 };
                    (x.len_bytes.min(len) as u32, status)
                })
                .collect(),
            Ok(_) => Vec::new(),
            Err(e) => return self.answer(req, errno(&e)),
        };
        if descriptors.is_empty() {
            // The target reported nothing (it always reports at least one
            // extent for a non-empty range): an I/O error, not a hang.
            return self.answer(req, EIO);
        }
        let bytes = descriptors.len() * 8;
        if !self.conn.acquire_here(bytes as u64)? {
            return self.answer(req, ENOMEM);
        }
        let mut buf = self.env.buffers.get(bytes);
        for (d, (l, st)) in buf.as_mut().chunks_exact_mut(8).zip(&descriptors) {
            d[..4].copy_from_slice(&l.to_be_bytes());
            d[4..].copy_from_slice(&st.to_be_bytes());
        }
        self.conn.counters.command(req.command).done(len, 0);
        let kind = ReplyKind::BlockStatus { context };
        self.conn
            .reply(0, req.cookie, kind, vec![buf], bytes as u64);
        Ok(())
    }

    fn run(&mut self) -> io::Result<Ended> {
        // A request received in part when the connection last parked.
        let mut next = self.conn.partial.lock().take();
        if self.client_gone(&mut next)? {
            return Ok(Ended::Closed);
        }
        loop {
            let mut p = match next.take() {
                Some(p) => p,
                None => match self.next_request()? {
                    Ok(p) => p,
                    Err(idle) => return Ok(idle),
                },
            };
            let whole = match self.receive(&mut p) {
                Ok(w) => w,
                Err(e) if is_park_signal(&e) => {
                    // The rest of it is awaited without a thread.
                    let deadline = p.by();
                    *self.conn.partial.lock() = Some(p);
                    return Ok(Ended::Idle { deadline });
                }
                Err(e) => {
                    self.conn.abandon(p);
                    return Err(e);
                }
            };
            next = match whole {
                Whole::Header(h) => {
                    self.received = Instant::now();
                    let Some(req) = Request::decode(&h) else {
                        return Ok(Ended::Closed); // bad magic: out of step; close
                    };
                    if req.command == CMD_DISC {
                        return Ok(Ended::Closed);
                    }
                    self.request(req)?
                }
                Whole::Write(req, bufs) => {
                    self.submit_write(&req, bufs);
                    None
                }
                Whole::Refused(req, error) => {
                    self.answer(&req, error)?;
                    None
                }
                Whole::Place(req, wait) => self.admit(req, wait)?,
                Whole::Work => self.resume_work()?,
            };
            if let Some(p @ (Partial::Place { .. } | Partial::Work)) = next {
                // No room in the bounds: the connection waits for a
                // release in the lot, which kicks it back, with what it
                // has read of the requests behind this one. No bytes in
                // the budget (for a request, or a WRITE_ZEROES's next
                // chunk): the same, and the keeper kicks it at its next
                // look.
                let deadline = self.conn.parked_deadline(&p);
                *self.conn.partial.lock() = Some(p);
                *self.conn.unread.lock() = self.stream.take_buffered();
                return Ok(Ended::Idle { deadline });
            }
        }
    }

    /// Parked for its place or its bytes (`next`), its socket not watched
    /// for input, a connection may come back for the socket's hang-up or
    /// error: its client is gone, and what waited is dropped (`next`
    /// emptied).
    fn client_gone(&mut self, next: &mut Option<Partial>) -> io::Result<bool> {
        let waiting = matches!(next, Some(Partial::Place { .. } | Partial::Work));
        if !waiting || !self.conn.t.wait(false, false, Some(Duration::ZERO))?.hangup {
            return Ok(false);
        }
        if let Some(p) = next.take() {
            self.conn.abandon(p);
        }
        self.conn.kill();
        Ok(true)
    }

    /// Between requests: wait for the next one's first bytes.
    ///
    /// **Returns:** its header, to be read (due whole within the reply
    /// timeout from now); `Err(Ended::Idle)` when the thread should be
    /// given up first.
    fn next_request(&mut self) -> io::Result<Result<Partial, Ended>> {
        // Another request already buffered: replies of requests served
        // on this thread wait and go out together; before anything
        // may wait, the pump sends them.
        let more = self.stream.buffer().len() >= REQUEST_BYTES;
        DEFER_REPLIES.with(|d| d.set(more));
        // So do requests this thread starts on a remote store: held back
        // while more are buffered, sent together before anything waits.
        async_io::hold_starts(more);
        if !more {
            self.conn.flush_replies();
        }
        self.stream.get_mut().phase = Phase::Header {
            since: Instant::now(),
        };
        if let Some(idle) = self.await_request()? {
            return Ok(Err(idle));
        }
        // Where the thread is not given up the first bytes are awaited
        // here, under the idle timeout.
        self.stream.fill_buf()?;
        let by = Instant::now() + self.env.limits.reply_timeout;
        Ok(Ok(Partial::header(by)))
    }

    /// Read on until `p` is whole (due by its deadline), lingering and
    /// then giving the thread up ([`park_signal`]) where it may be.
    fn receive(&mut self, p: &mut Partial) -> io::Result<Whole> {
        let cr = self.stream.get_mut();
        if let Some(by) = p.by() {
            cr.phase = Phase::Payload { by };
        }
        cr.park_after = self.park_after;
        cr.linger.from = None;
        let r = p.receive(&mut self.stream, self.env.buffers);
        self.stream.get_mut().park_after = None;
        r
    }

    /// At a request boundary with nothing buffered, wait for the next
    /// request's first bytes where the thread may be given up.
    ///
    /// **Returns:** `Some(Ended::Idle)` when it should be (nothing of the
    /// stream has been consumed); `None` when bytes arrived or there was
    /// nothing to wait for here.
    fn await_request(&mut self) -> io::Result<Option<Ended>> {
        if self.park_after.is_none() || !self.stream.buffer().is_empty() {
            return Ok(None);
        }
        let cr = self.stream.get_mut();
        cr.park_after = self.park_after;
        cr.linger.from = None;
        let r = self.stream.fill_buf().map(|_| ());
        let cr = self.stream.get_mut();
        cr.park_after = None;
        match r {
            Err(e) if is_park_signal(&e) => {
                let Phase::Header { since } = cr.phase else {
                    unreachable!("a header is awaited");
                };
                let idle = self.conn.limits.idle_timeout;
                Ok(Some(Ended::Idle {
                    deadline: idle.map(|i| since + i),
                }))
            }
            Err(e) => Err(e),
            Ok(()) => Ok(None),
        }
    }

    fn pending(&self, req: &Request, chunks: usize, held_bytes: u64) -> Arc<Pending> {
        self.pending_fua(req, chunks, held_bytes, true)
    }

    /// As [`Reader::pending`]; `flush_for_fua` false when the request's
    /// FUA went down with its writes (no flush after them).
    fn pending_fua(
        &self,
        req: &Request,
        chunks: usize,
        held_bytes: u64,
        flush_for_fua: bool,
    ) -> Arc<Pending> {
        // Answered (and taken off again) in `Pending::finish`.
        self.conn.counters.in_flight.fetch_add(1, Ordering::Relaxed);
        Arc::new(Pending {
            conn: Arc::clone(self.conn),
            cookie: req.cookie,
            command: req.command,
            offset: req.offset,
            length: if req.command == CMD_FLUSH {
                0
            } else {
                req.length as u64
            },
            held_bytes,
            fua: flush_for_fua && req.flags & CMD_FLAG_FUA != 0 && req.command != CMD_READ,
            remaining: AtomicUsize::new(chunks + 1),
            error: AtomicU32::new(0),
            read: Mutex::new(Vec::new()),
            received: self.received,
        })
    }

    /// Answer `req` with `error` (nothing held, nothing done); a WRITE's
    /// payload is read and dropped first, to keep the stream in step.
    ///
    /// **Returns:** the WRITE's payload to drop, if any; `Err` for a
    /// length the protocol lets a server treat as an attack.
    fn refuse(&mut self, req: &Request, error: u32) -> io::Result<Option<Partial>> {
        let len = req.length as u64;
        if req.command != CMD_WRITE {
            self.answer(req, error)?;
            return Ok(None);
        }
        if len > MAX_DISCARD_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request length beyond 32 MiB",
            ));
        }
        Ok(Some(Partial::Discard {
            req: *req,
            error,
            left: len,
            by: Instant::now() + self.env.limits.reply_timeout,
        }))
    }

    /// Answer a refused request `error` once nothing of it is left to read.
    fn answer(&mut self, req: &Request, error: u32) -> io::Result<()> {
        self.conn.counters.command(req.command).done(0, error);
        self.conn.acquire_here(0)?;
        let kind = if req.command == CMD_READ {
            ReplyKind::Read { offset: req.offset }
        } else {
            ReplyKind::Plain
        };
        self.conn.reply(error, req.cookie, kind, Vec::new(), 0);
        Ok(())
    }

    /// Serve a checked WRITE_ZEROES or TRIM (its place taken): punched
    /// when discards are allowed (WRITE_ZEROES without NO_HOLE), else
    /// encrypted zeros for WRITE_ZEROES and nothing for TRIM. The work is
    /// charged to the peer's share chunk by chunk.
    ///
    /// **Returns:** [`Partial::Work`] when the encrypted zeros' next chunk
    /// waits for bytes with the connection parked; `Err` only when the
    /// connection died (the request is completed, with an error, either
    /// way).
    fn zero_or_trim(&mut self, req: &Request, fast_zero: bool) -> io::Result<Option<Partial>> {
        let (offset, len) = (req.offset, req.length as u64);
        let holes = self.env.device.holes();
        if req.command == CMD_WRITE_ZEROES && !self.punches(req) {
            let n = chunks(offset, len).count();
            let down = self.fua_down(req);
            let p = self.pending_fua(req, n, 0, !down);
            return self.zero_on(ZeroWork::new(p, offset, len, down));
        }
        if req.command == CMD_TRIM && !self.env.export.discards {
            // Checked, then nothing to do; FUA still flushes.
            self.pending(req, 0, 0).chunk_done(0);
            return Ok(None);
        }
        // Punched: the whole sectors inside (a misaligned TRIM's head and
        // tail stay: a discard is advisory).
        let p = self.pending(req, 1, 0);
        let r = if req.command == CMD_TRIM {
            self.punch(offset, len, |o, n| holes.discard(o, n).map(|_| ()))
        } else {
            self.punch(offset, len, |o, n| holes.punch_zeroes(o, n))
        };
        let done = match r {
            Err(dead) => Err((EIO, dead)),
            Ok(Ok(())) => Ok(0),
            // The backend cannot punch after all: write encrypted zeros (a
            // fast-zero request fails instead).
            Ok(Err(e))
                if e.kind() == io::ErrorKind::Unsupported && req.command == CMD_WRITE_ZEROES =>
            {
                if fast_zero {
                    Ok(ENOTSUP)
                } else {
                    p.remaining
                        .fetch_add(chunks(offset, len).count(), Ordering::AcqRel);
                    p.chunk_done(0);
                    return self.zero_on(ZeroWork::new(p, offset, len, false));
                }
            }
            Ok(Err(e)) => Ok(errno(&e)),
        };
        p.chunk_done(match &done {
            Ok(e) | Err((e, _)) => *e,
        });
        p.chunk_done(0);
        done.map(|_| None).map_err(|(_, dead)| dead)
    }

    /// Serve `req`, or refuse it.
    ///
    /// **Returns:** a WRITE's payload to receive (served, or dropped when
    /// refused).
    fn request(&mut self, req: Request) -> io::Result<Option<Partial>> {
        self.record_shape(&req);
        let fast_zero = req.flags & CMD_FLAG_FAST_ZERO != 0;
        let error = self.request_error(&req, fast_zero);
        if error != 0 {
            return self.refuse(&req, error);
        }
        self.conn.throttle(self.env.rate, self.rate_bytes(&req))?;
        if req.command == CMD_BLOCK_STATUS {
            return self.block_status(&req).map(|()| None);
        }
        self.admit(req, None)
    }

    /// Take `req`'s place in the connection's bounds, and its payload
    /// bytes in the budget (`wait`: the wait for them begun before),
    /// before any buffer is allocated; then serve it. On a thread that may
    /// be given up, a request with no room now waits for a release without
    /// the thread, and one with no bytes in the budget for its next look
    /// ([`Partial::Place`]).
    ///
    /// **Returns:** as [`Reader::request`].
    fn admit(
        &mut self,
        req: Request,
        wait: Option<Box<BudgetWait>>,
    ) -> io::Result<Option<Partial>> {
        let fast_zero = req.flags & CMD_FLAG_FAST_ZERO != 0;
        let payload = if matches!(req.command, CMD_READ | CMD_WRITE) {
            req.length as u64
        } else {
            0
        };
        let park = self.park_after.is_some();
        if park {
            // Kicks made before are spent: only a release from now brings
            // a parked connection back.
            self.conn.t.clear_kicks();
            if !self.conn.room_or_wake(payload) {
                return Ok(Some(Partial::Place { req, budget: wait }));
            }
        }
        match self.conn.acquire(payload, wait, park)? {
            Admit::Taken => {}
            Admit::Refused => return self.refuse(&req, ENOMEM),
            Admit::Wait(w) => {
                return Ok(Some(Partial::Place {
                    req,
                    budget: Some(w),
                }))
            }
        }
        match req.command {
            CMD_WRITE => {
                // The payload comes next, due within the reply timeout.
                return Ok(Some(Partial::Write {
                    req,
                    whole: Vec::new(),
                    filling: None,
                    by: Instant::now() + self.env.limits.reply_timeout,
                }));
            }
            CMD_WRITE_ZEROES | CMD_TRIM => return self.zero_or_trim(&req, fast_zero),
            CMD_READ => self.serve_read(&req),
            CMD_FLUSH => self.serve_flush(&req),
            _ => unreachable!("check_request() refuses unknown commands"),
        }
        Ok(None)
    }

    /// Count the shape of what the client sends, served or not.
    fn record_shape(&self, req: &Request) {
        let shape = match req.command {
            CMD_READ => Some(&self.conn.counters.read_shape),
            CMD_WRITE => Some(&self.conn.counters.write_shape),
            _ => None,
        };
        if let Some(c) = shape {
            let ss = self.env.export.min_block_bytes as u64;
            c.record(req.offset, req.length as u64, ss);
        }
    }

    /// The errno `req` is refused with before anything is done, 0 when it
    /// is served.
    fn request_error(&self, req: &Request, fast_zero: bool) -> u32 {
        let error = check_request(self.env.export, req);
        if error == 0 && req.command == CMD_BLOCK_STATUS && self.env.allocation_context.is_none() {
            // No metadata context was selected: nothing to report on.
            return EINVAL;
        }
        if error == 0 && req.command == CMD_WRITE_ZEROES && fast_zero && !self.punches(req) {
            // Encrypted zeros are no faster than a write: fail at once,
            // with nothing changed (proto.md's fast-zero contract).
            return ENOTSUP;
        }
        error
    }

    /// The bytes `req` counts against the export's rate: what it reads,
    /// writes, zeroes or punches (a flush, a block status query or a TRIM
    /// that does nothing moves none).
    fn rate_bytes(&self, req: &Request) -> u64 {
        let moves = match req.command {
            CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES => true,
            CMD_TRIM => self.env.export.discards,
            _ => false,
        };
        if moves {
            req.length as u64
        } else {
            0
        }
    }

    /// NBD_CMD_WRITE, its payload received whole (a client gone
    /// mid-payload has nothing of its write submitted; the payload landed
    /// straight in arena pages, chunk by chunk, [`Partial`]): one
    /// submission per chunk.
    fn submit_write(&mut self, req: &Request, bufs: Vec<(u64, Buf)>) {
        let down = self.fua_down(req);
        let p = self.pending_fua(req, bufs.len(), req.length as u64, !down);
        for (off, buf) in bufs {
            let p = Arc::clone(&p);
            self.env.device.submit_write(
                off,
                Box::new(buf),
                down,
                Box::new(move |r| p.chunk_done(r.err().map_or(0, |e| errno(&e)))),
            );
        }
        p.chunk_done(0);
    }

    /// NBD_CMD_READ: one submission per chunk, each chunk's data kept in
    /// its place until the reply is sent whole.
    fn serve_read(&mut self, req: &Request) {
        let len = req.length as u64;
        let n = chunks(req.offset, len).count();
        let p = self.pending(req, n, len);
        p.read.lock().resize_with(n, || None);
        for (i, (off, n_bytes)) in chunks(req.offset, len).enumerate() {
            let p = Arc::clone(&p);
            let buf = self.env.buffers.get(n_bytes);
            self.env.device.submit_read(
                off,
                buf,
                Box::new(move |r, buf| match r {
                    Ok(()) => {
                        p.read.lock()[i] = Some(buf);
                        p.chunk_done(0);
                    }
                    Err(e) => {
                        drop(buf);
                        p.chunk_done(errno(&e))
                    }
                }),
            );
        }
        p.chunk_done(0);
    }

    /// NBD_CMD_FLUSH: one flush of the device.
    fn serve_flush(&mut self, req: &Request) {
        let p = self.pending(req, 1, 0);
        let q = Arc::clone(&p);
        self.env.device.submit_flush(Box::new(move |r| {
            q.chunk_done(r.err().map_or(0, |e| errno(&e)))
        }));
        p.chunk_done(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order() {
        let v: Vec<_> = chunks(4096, (CHUNK_BYTES * 2 + 512) as u64).collect();
        assert_eq!(
            v,
            vec![
                (4096, CHUNK_BYTES),
                (4096 + CHUNK_BYTES as u64, CHUNK_BYTES),
                (4096 + 2 * CHUNK_BYTES as u64, 512)
            ]
        );
        assert_eq!(chunks(0, 0).count(), 0);
    }

    #[test]
    fn all_zero_finds_a_single_set_byte_anywhere() {
        assert!(all_zero(&[]));
        let mut v = vec![0u8; 3 * 4096 + 100];
        assert!(all_zero(&v));
        for at in [0, 15, 16, 4095, 4096, v.len() - 1] {
            v[at] = 1;
            assert!(!all_zero(&v), "a byte set at {at}");
            v[at] = 0;
        }
    }
}
