//! Transmission on one connection: requests in, replies out, many in
//! flight.
//!
//! Owns: the reader loop (it reads each request and its payload, checks it
//! and submits it to the crypt queue in chunks), the reply side (a
//! completion sends its simple reply under the connection's writer lock,
//! in completion order), FUA (the target is flushed after the write and
//! before the reply) and the per-connection bound on requests and bytes in
//! flight. Must never: reply before every chunk of a request has
//! completed, reply to a request twice, submit a write whose payload was
//! not received whole, leave requests in flight when the connection's
//! thread returns, or panic on what a client sends.
//!
//! Errors: EINVAL for malformed or misaligned requests (not whole sectors
//! of the target) and out-of-range reads; ENOSPC for writes, trims and
//! write-zeroes beyond the end; EOVERFLOW for a read or write longer than
//! the maximum block size (a write's payload is read and discarded, so the
//! connection stays usable); EPERM for anything that writes to a read-only
//! export. NBD_CMD_TRIM is checked and then does nothing (the ciphertext
//! stays; a trim is advisory in the protocol, as dm-crypt without
//! `allow_discards`); NBD_CMD_WRITE_ZEROES writes encrypted zeros.

use crate::buffers::{Buf, Buffers};
use crate::device::{Device, Flusher};
use crate::proto::*;
use crate::stats::Counters;
use crate::stream::Stream;
use crate::ExportInfo;
use parking_lot::{Condvar, Mutex};
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes per request submitted to the crypt queue: a longer NBD request is
/// split so one submission never needs more out pages than the target's
/// mempool reserve holds (256 pages by default), which keeps a 32 MiB write
/// from waiting for pages only it could free.
pub const CHUNK_BYTES: usize = 1 << 20;
/// The connection's read buffer: request headers (and small payloads)
/// are read in batches through it.
const READ_BUFFER_BYTES: usize = 64 << 10;
/// Requests of one connection received and not yet answered, at most.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 128;
/// Payload bytes (read buffers and write payloads) of one connection held
/// at once, at most (a single larger request is still admitted alone).
pub const MAX_BYTES_IN_FLIGHT: u64 = 64 << 20;

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
    /// Set on a connection's reader thread while further requests are
    /// already in its buffer: replies completed on that thread (requests
    /// served inline) are queued rather than sent, and leave in one
    /// vectored write when the buffer runs dry (or before the reader waits
    /// for room in the in-flight bound).
    static DEFER_REPLIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A reply waiting to be sent, holding its data.
struct Reply {
    hdr: [u8; SIMPLE_REPLY_BYTES],
    data: Vec<Buf>,
    /// The request's bytes in the in-flight bound, released once sent.
    held_bytes: u64,
}

/// Replies waiting for the sender, and whether a thread is sending.
#[derive(Default)]
struct Outbox {
    queue: Vec<Reply>,
    sending: bool,
}

/// The reply side and the in-flight bound, shared with completions.
struct Conn {
    writer: Mutex<Stream>,
    outbox: Mutex<Outbox>,
    dead: AtomicBool,
    gate: Mutex<(usize, u64)>,
    gate_cv: Condvar,
    counters: Arc<Counters>,
    flusher: Flusher,
}

impl Conn {
    /// Queue a simple reply with `data` (a read's chunks, back to back);
    /// the request's place in the in-flight bound (`held_bytes`) is
    /// released once the reply has been sent (or dropped, the client being
    /// gone), so a client that stops reading cannot make replies pile up.
    ///
    /// Replies are sent in batches: the first completion to find nobody
    /// sending becomes the sender and writes every queued reply with
    /// vectored writes until the queue is empty; completions meanwhile
    /// only queue theirs. Under load one `writev` carries many replies.
    fn reply(&self, error: u32, cookie: u64, data: Vec<Buf>, held_bytes: u64) {
        let mut ob = self.outbox.lock();
        ob.queue.push(Reply {
            hdr: simple_reply(error, cookie),
            data,
            held_bytes,
        });
        if ob.sending || DEFER_REPLIES.with(|d| d.get()) {
            return;
        }
        self.drain(ob);
    }

    /// Send whatever replies are queued, unless a thread is sending.
    fn flush_replies(&self) {
        let ob = self.outbox.lock();
        if ob.sending || ob.queue.is_empty() {
            return;
        }
        self.drain(ob);
    }

    /// Become the sender: send batches until the queue is empty.
    fn drain<'a>(&'a self, mut ob: parking_lot::MutexGuard<'a, Outbox>) {
        ob.sending = true;
        loop {
            let batch = std::mem::take(&mut ob.queue);
            if batch.is_empty() {
                ob.sending = false;
                return;
            }
            drop(ob);
            self.send(&batch);
            for r in batch {
                let held = r.held_bytes;
                drop(r);
                self.release(held);
            }
            ob = self.outbox.lock();
        }
    }

    /// Write `batch` in order, as few `writev` calls as the iovec limit
    /// allows. On an error the connection is marked dead and shut down.
    fn send(&self, batch: &[Reply]) {
        const MAX_IOV: usize = 1024;
        let mut w = self.writer.lock();
        if self.dead.load(Ordering::Relaxed) {
            return;
        }
        let mut slices: Vec<io::IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
        for r in batch {
            slices.push(io::IoSlice::new(&r.hdr));
            for d in &r.data {
                slices.push(io::IoSlice::new(d.as_ref()));
            }
        }
        let mut rest: &mut [io::IoSlice<'_>] = &mut slices;
        let r = loop {
            if rest.is_empty() {
                break Ok(());
            }
            let n = rest.len().min(MAX_IOV);
            match w.write_vectored(&rest[..n]) {
                Ok(0) => break Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(k) => io::IoSlice::advance_slices(&mut rest, k),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        if r.is_err() {
            // The client is gone or stuck: stop answering it; the reader
            // sees the shutdown and ends the connection.
            self.dead.store(true, Ordering::Relaxed);
            w.shutdown();
        }
    }

    fn acquire(&self, bytes: u64) {
        let full = |g: &(usize, u64)| {
            g.0 >= MAX_REQUESTS_IN_FLIGHT || (g.0 > 0 && g.1 + bytes > MAX_BYTES_IN_FLIGHT)
        };
        let mut g = self.gate.lock();
        while full(&g) {
            // Replies deferred on this thread hold slots: send them first.
            drop(g);
            self.flush_replies();
            g = self.gate.lock();
            if !full(&g) {
                break;
            }
            self.gate_cv.wait(&mut g);
        }
        g.0 += 1;
        g.1 += bytes;
    }

    fn release(&self, bytes: u64) {
        let mut g = self.gate.lock();
        g.0 -= 1;
        g.1 -= bytes;
        drop(g);
        self.gate_cv.notify_all();
    }

    fn wait_idle(&self) {
        let mut g = self.gate.lock();
        while g.0 > 0 {
            self.gate_cv.wait(&mut g);
        }
    }
}

/// One request in flight, completed chunk by chunk.
struct Pending {
    conn: Arc<Conn>,
    cookie: u64,
    command: u16,
    length: u64,
    held_bytes: u64,
    fua: bool,
    /// Chunks not yet completed, plus one held by the submitter.
    remaining: AtomicUsize,
    error: AtomicU32,
    /// A read's chunks, in order, as they complete.
    read: Mutex<Vec<Option<Buf>>>,
}

impl Pending {
    fn chunk_done(&self, error: u32) {
        if error != 0 {
            let _ = self
                .error
                .compare_exchange(0, error, Ordering::AcqRel, Ordering::Acquire);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
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
        let data = if error == 0 && self.command == CMD_READ {
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
        self.conn
            .counters
            .command(self.command)
            .done(self.length, error);
        self.conn.reply(error, self.cookie, data, self.held_bytes);
    }
}

/// Serve transmission until the client disconnects, sends NBD_CMD_DISC,
/// breaks the protocol or the socket is shut down; then wait for every
/// request in flight to complete.
pub(crate) fn transmit(
    stream: Stream,
    export: &ExportInfo,
    device: &Arc<dyn Device>,
    counters: &Arc<Counters>,
    buffers: &Buffers,
) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let conn = Arc::new(Conn {
        writer: Mutex::new(writer),
        outbox: Mutex::new(Outbox::default()),
        dead: AtomicBool::new(false),
        gate: Mutex::new((0, 0)),
        gate_cv: Condvar::new(),
        counters: Arc::clone(counters),
        flusher: device.flusher(),
    });
    let mut reader = Reader {
        // Headers of pipelined requests arrive together: one read takes
        // several. A payload larger than the buffer bypasses it and lands
        // in its arena buffer directly.
        stream: io::BufReader::with_capacity(READ_BUFFER_BYTES, stream),
        export,
        device,
        conn: &conn,
        buffers,
        zeros: std::iter::repeat_n(0u8, CHUNK_BYTES).collect(),
    };
    let _ = reader.run();
    DEFER_REPLIES.with(|d| d.set(false));
    conn.flush_replies();
    conn.wait_idle();
    reader.stream.get_ref().shutdown();
}

struct Reader<'a> {
    stream: io::BufReader<Stream>,
    export: &'a ExportInfo,
    device: &'a Arc<dyn Device>,
    conn: &'a Arc<Conn>,
    buffers: &'a Buffers,
    zeros: Arc<[u8]>,
}

/// The first `.1` bytes of a shared buffer of zeros.
struct Zeros(Arc<[u8]>, usize);

impl AsRef<[u8]> for Zeros {
    fn as_ref(&self) -> &[u8] {
        &self.0[..self.1]
    }
}

/// The chunks of `len` bytes at `offset`: (offset, length) pairs.
fn chunks(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize)> {
    let mut at = 0u64;
    std::iter::from_fn(move || {
        if at >= len {
            return None;
        }
        let n = (len - at).min(CHUNK_BYTES as u64);
        let r = (offset + at, n as usize);
        at += n;
        Some(r)
    })
}

impl Reader<'_> {
    fn run(&mut self) -> io::Result<()> {
        loop {
            // Another request already buffered: replies of requests served
            // on this thread wait and go out together; before a read that
            // may block, they are sent.
            let more = self.stream.buffer().len() >= REQUEST_BYTES;
            DEFER_REPLIES.with(|d| d.set(more));
            if !more {
                self.conn.flush_replies();
            }
            let mut h = [0u8; REQUEST_BYTES];
            self.stream.read_exact(&mut h)?;
            let Some(req) = Request::decode(&h) else {
                return Ok(()); // bad magic: the stream is out of step; close
            };
            if req.command == CMD_DISC {
                return Ok(());
            }
            self.request(req)?;
        }
    }

    /// The error a request gets before anything is done, if any.
    fn check(&self, req: &Request) -> u32 {
        let e = self.export;
        let len = req.length as u64;
        let allowed = match req.command {
            CMD_READ | CMD_FLUSH => 0,
            CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
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
        let writes = req.command != CMD_READ;
        if matches!(req.command, CMD_READ | CMD_WRITE) && req.length > e.max_block_bytes {
            return EOVERFLOW;
        }
        if writes && e.read_only {
            return EPERM;
        }
        match req.offset.checked_add(len) {
            Some(end) if end <= e.size_bytes => {}
            _ => return if writes { ENOSPC } else { EINVAL },
        }
        let ss = e.min_block_bytes as u64;
        if len == 0 || !req.offset.is_multiple_of(ss) || !len.is_multiple_of(ss) {
            return EINVAL;
        }
        0
    }

    fn pending(&self, req: &Request, chunks: usize, held_bytes: u64) -> Arc<Pending> {
        Arc::new(Pending {
            conn: Arc::clone(self.conn),
            cookie: req.cookie,
            command: req.command,
            length: if req.command == CMD_FLUSH {
                0
            } else {
                req.length as u64
            },
            held_bytes,
            fua: req.flags & CMD_FLAG_FUA != 0,
            remaining: AtomicUsize::new(chunks + 1),
            error: AtomicU32::new(0),
            read: Mutex::new(Vec::new()),
        })
    }

    fn request(&mut self, req: Request) -> io::Result<()> {
        let error = self.check(&req);
        let len = req.length as u64;
        if error != 0 {
            if req.command == CMD_WRITE {
                // Keep the stream in step: read the payload and drop it.
                let n = io::copy(&mut (&mut self.stream).take(len), &mut io::sink())?;
                if n != len {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            self.conn.counters.command(req.command).done(0, error);
            self.conn.acquire(0);
            self.conn.reply(error, req.cookie, Vec::new(), 0);
            return Ok(());
        }
        match req.command {
            CMD_WRITE => {
                // The whole payload first: a client gone mid-payload has
                // nothing of this write submitted.
                // Straight into arena pages (dropped, and so freed, if
                // the client goes away mid-payload). A payload not yet
                // all buffered may mean a wait on the socket: deferred
                // replies go out first, whatever the client waits for.
                if self.stream.buffer().len() < len as usize {
                    DEFER_REPLIES.with(|d| d.set(false));
                    self.conn.flush_replies();
                }
                let mut bufs = Vec::with_capacity(len.div_ceil(CHUNK_BYTES as u64) as usize);
                for (off, n) in chunks(req.offset, len) {
                    let mut buf = self.buffers.get(n);
                    self.stream.read_exact(buf.as_mut())?;
                    bufs.push((off, buf));
                }
                self.conn.acquire(len);
                let p = self.pending(&req, bufs.len(), len);
                for (off, buf) in bufs {
                    let p = Arc::clone(&p);
                    self.device.submit_write(
                        off,
                        Box::new(buf),
                        Box::new(move |r| p.chunk_done(r.err().map_or(0, |e| errno(&e)))),
                    );
                }
                p.chunk_done(0);
            }
            CMD_WRITE_ZEROES => {
                self.conn.acquire(0);
                let n = chunks(req.offset, len).count();
                let p = self.pending(&req, n, 0);
                for (off, n) in chunks(req.offset, len) {
                    let p = Arc::clone(&p);
                    self.device.submit_write(
                        off,
                        Box::new(Zeros(Arc::clone(&self.zeros), n)),
                        Box::new(move |r| p.chunk_done(r.err().map_or(0, |e| errno(&e)))),
                    );
                }
                p.chunk_done(0);
            }
            CMD_READ => {
                self.conn.acquire(len);
                let n = chunks(req.offset, len).count();
                let p = self.pending(&req, n, len);
                p.read.lock().resize_with(n, || None);
                for (i, (off, n_bytes)) in chunks(req.offset, len).enumerate() {
                    let p = Arc::clone(&p);
                    let buf = self.buffers.get(n_bytes);
                    self.device.submit_read(
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
            CMD_FLUSH => {
                self.conn.acquire(0);
                let p = self.pending(&req, 1, 0);
                let q = Arc::clone(&p);
                self.device.submit_flush(Box::new(move |r| {
                    q.chunk_done(r.err().map_or(0, |e| errno(&e)))
                }));
                p.chunk_done(0);
            }
            CMD_TRIM => {
                // Checked, then nothing to do; FUA still flushes.
                self.conn.acquire(0);
                let p = self.pending(&req, 0, 0);
                p.chunk_done(0);
            }
            _ => unreachable!("check() refuses unknown commands"),
        }
        Ok(())
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
}
