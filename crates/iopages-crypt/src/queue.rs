//! Many I/Os in flight: a queue of bounded depth in front of a crypt
//! target, served by worker threads (dm-crypt's `kcryptd` workqueue).
//!
//! Owns: admitting at most `queue_depth` requests at a time (submitters
//! wait for room, as a block device's tag set makes them), handing them to
//! `workers` threads that run the target's synchronous paths, and calling
//! each request's completion exactly once with its result. Must never:
//! lose a request (dropping the queue completes every request already
//! admitted before the workers exit), run a completion twice, or let a
//! panicking completion take a worker down with requests still queued.
//!
//! Each worker encrypts with the target's cipher (a [`CipherPool`] gives
//! every worker its own instance) and blocks in the backend for its
//! request, so up to `workers` requests are at the backend at once and the
//! rest wait, already admitted, in the queue.
//!
//! Over a backend that starts I/O without waiting
//! ([`AsyncIo`](crate::async_io::AsyncIo): a remote store) a write is
//! encrypted on the submitting thread and started, and a read started,
//! with no worker: each ends on the backend's thread (a read decrypted
//! there, in its buffer), which runs the completion; one that comes back
//! `Again` goes to the workers as it was submitted. Either way it holds
//! its admission until its completion has run.
//!
//! [`CipherPool`]: crate::target::CipherPool

use crate::admission::{Admission, PlCell};
use crate::async_io::{resumed, Outcome, ReadInto as AsyncReadInto, WriteEnd};
use crate::target::{CryptTarget, SectorCipher};
use iopages::FolioBuffer;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Settings of a [`CryptQueue`].
#[derive(Clone, Copy, Debug)]
pub struct QueueConfig {
    /// Requests admitted at once (queued or being served). Default 128.
    pub queue_depth: usize,
    /// Worker threads. Default: one per core.
    pub workers: usize,
    /// Every worker writes through its own out buffer, reused for every
    /// write ([`CryptTarget::write_with_folios`]) instead of allocating:
    /// the pipeline without allocation, for measuring what allocation
    /// costs. Default off.
    pub preallocated_out: bool,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            queue_depth: 128,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            preallocated_out: false,
        }
    }
}

type WriteDone = Box<dyn FnOnce(io::Result<()>) + Send>;
type ReadDone = Box<dyn FnOnce(io::Result<Vec<u8>>) + Send>;

/// A read into a caller's buffer, and the caller's completion.
trait ReadJob: Send {
    fn offset(&self) -> u64;
    fn buf(&mut self) -> &mut [u8];
    /// Hand the result and the buffer to the caller's completion.
    fn finish(self: Box<Self>, result: io::Result<()>);
}

struct ReadOf<B, F> {
    offset: u64,
    buf: B,
    done: F,
}

impl<B, F> ReadJob for ReadOf<B, F>
where
    B: AsMut<[u8]> + Send,
    F: FnOnce(io::Result<()>, B) + Send,
{
    fn offset(&self) -> u64 {
        self.offset
    }
    fn buf(&mut self) -> &mut [u8] {
        self.buf.as_mut()
    }
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let ReadOf { buf, done, .. } = *self;
        done(result, buf);
    }
}

/// A write's payload: any bytes the queue may hold until the write has
/// completed (a heap buffer, or pages of the arena such as a
/// [`KvBox`](iopages::KvBox)). Dropped on the worker after the completion.
pub type Payload = Box<dyn AsRef<[u8]> + Send>;

enum Request {
    Write {
        offset: u64,
        data: Payload,
        /// Durable before `done` ([`CryptTarget::write_fua`]).
        fua: bool,
        done: WriteDone,
        /// When it first started, for one that ended `Again`.
        began: Option<Instant>,
    },
    Read {
        offset: u64,
        len: usize,
        done: ReadDone,
    },
    /// A read into the caller's buffer, and when it first started (for
    /// one that ended `Again`).
    ReadInto(Box<dyn ReadJob>, Option<Instant>),
    Flush {
        done: WriteDone,
    },
}

struct State {
    queue: VecDeque<Request>,
    shutdown: bool,
}

/// Completions between wake-ups of waiting submitters: a full queue is
/// refilled half at a time (at most 128) instead of waking a submitter for
/// every completion. Each wake-up costs the worker that makes it more than
/// the futex call: the woken submitter is often placed on the waker's CPU
/// and runs there first. At depth 256 (E2, 2 vCPU Intel Xeon) a batch of
/// 32 left the worker idle 2.4–2.8 % of the time, a batch of 128 1.3–1.6 %.
fn wake_batch(depth: usize) -> usize {
    (depth / 2).clamp(1, 128)
}

struct Shared<C: SectorCipher> {
    target: Arc<CryptTarget<C>>,
    preallocated_out: bool,
    /// At most `queue_depth` requests admitted; submitters sleep here.
    gate: Admission<PlCell>,
    state: Mutex<State>,
    /// Workers wait here for requests.
    work: Condvar,
}

/// A crypt target with a queue depth and worker threads.
pub struct CryptQueue<C: SectorCipher + 'static> {
    shared: Arc<Shared<C>>,
    workers: Vec<JoinHandle<()>>,
}

impl<C: SectorCipher + 'static> CryptQueue<C> {
    /// Start `cfg.workers` threads serving `target`.
    ///
    /// **Returns:** `InvalidInput` for a zero queue depth or worker count,
    /// or the error of a thread that could not be started.
    pub fn new(target: Arc<CryptTarget<C>>, cfg: QueueConfig) -> io::Result<CryptQueue<C>> {
        if cfg.queue_depth == 0 || cfg.workers == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "queue depth ({}) and workers ({}) must both be at least 1",
                    cfg.queue_depth, cfg.workers
                ),
            ));
        }
        let shared = Arc::new(Shared {
            target,
            preallocated_out: cfg.preallocated_out,
            gate: Admission::new(cfg.queue_depth, wake_batch(cfg.queue_depth)),
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(cfg.queue_depth),
                shutdown: false,
            }),
            work: Condvar::new(),
        });
        let mut q = CryptQueue {
            shared,
            workers: Vec::with_capacity(cfg.workers),
        };
        for i in 0..cfg.workers {
            let s = Arc::clone(&q.shared);
            let h = std::thread::Builder::new()
                .name(format!("kcryptd/{i}"))
                .spawn(move || worker(&s))?;
            q.workers.push(h);
        }
        Ok(q)
    }

    /// The target served.
    pub fn target(&self) -> &Arc<CryptTarget<C>> {
        &self.shared.target
    }

    /// Queue depth.
    pub fn queue_depth(&self) -> usize {
        self.shared.gate.depth()
    }

    /// Worker threads.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Requests admitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.shared.gate.admitted()
    }

    fn submit(&self, r: Request) {
        if !self.shared.gate.try_admit() {
            // Requests this thread holds back may be what frees a slot.
            crate::async_io::send_held();
            self.shared.gate.admit();
        }
        if let Some(r) = start(&self.shared, r) {
            queue(&self.shared, r);
        }
    }

    /// Queue a write of `data` at byte `offset`; `done` gets its result on
    /// a worker thread. A bad request completes with `InvalidInput`.
    ///
    /// **Context:** blocks while `queue_depth` requests are in flight.
    pub fn submit_write(
        &self,
        offset: u64,
        data: Arc<[u8]>,
        done: impl FnOnce(io::Result<()>) + Send + 'static,
    ) {
        self.submit_write_buf(offset, Box::new(data), false, done);
    }

    /// Queue a write of the bytes of `data` (any buffer, for instance
    /// arena pages a payload was received into) at byte `offset`; `data`
    /// is dropped on the worker once `done` has run. With `fua`, the write
    /// is durable before `done` runs ([`CryptTarget::write_fua`]: FUA
    /// passed down to a backend that takes it, else a whole flush after
    /// the write).
    ///
    /// **Context:** blocks while `queue_depth` requests are in flight.
    pub fn submit_write_buf(
        &self,
        offset: u64,
        data: Payload,
        fua: bool,
        done: impl FnOnce(io::Result<()>) + Send + 'static,
    ) {
        self.submit(Request::Write {
            offset,
            data,
            fua,
            done: Box::new(done),
            began: None,
        });
    }

    /// Queue a read of `buf.as_mut().len()` bytes at byte `offset` into
    /// `buf`; `done` gets the result and the buffer back on a worker
    /// thread (on an error the buffer's contents are unspecified).
    ///
    /// **Context:** blocks while `queue_depth` requests are in flight.
    pub fn submit_read_into<B: AsMut<[u8]> + Send + 'static>(
        &self,
        offset: u64,
        buf: B,
        done: impl FnOnce(io::Result<()>, B) + Send + 'static,
    ) {
        self.submit(Request::ReadInto(
            Box::new(ReadOf { offset, buf, done }),
            None,
        ));
    }

    /// Queue a read of `len` bytes at byte `offset`; `done` gets the
    /// plaintext or the error on a worker thread.
    ///
    /// **Context:** blocks while `queue_depth` requests are in flight.
    pub fn submit_read(
        &self,
        offset: u64,
        len: usize,
        done: impl FnOnce(io::Result<Vec<u8>>) + Send + 'static,
    ) {
        self.submit(Request::Read {
            offset,
            len,
            done: Box::new(done),
        });
    }

    /// Queue a flush: writes completed before it is served are made
    /// durable.
    ///
    /// **Context:** blocks while `queue_depth` requests are in flight.
    pub fn submit_flush(&self, done: impl FnOnce(io::Result<()>) + Send + 'static) {
        self.submit(Request::Flush {
            done: Box::new(done),
        });
    }

    /// Wait until every admitted request has completed.
    pub fn wait_idle(&self) {
        self.shared.gate.wait_idle();
    }

    /// Write synchronously through the queue (submit and wait).
    pub fn write(&self, offset: u64, data: Arc<[u8]>) -> io::Result<()> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.submit_write(offset, data, move |r| {
            let _ = tx.send(r);
        });
        rx.recv()
            .unwrap_or_else(|_| Err(io::Error::other("the write's completion was lost")))
    }

    /// Read synchronously through the queue (submit and wait).
    pub fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.submit_read(offset, len, move |r| {
            let _ = tx.send(r);
        });
        rx.recv()
            .unwrap_or_else(|_| Err(io::Error::other("the read's completion was lost")))
    }
}

impl<C: SectorCipher + 'static> Drop for CryptQueue<C> {
    /// Complete every admitted request, then stop the workers.
    fn drop(&mut self) {
        // Requests started on the backend may come back for the workers.
        self.shared.gate.wait_idle();
        self.shared.state.lock().shutdown = true;
        self.shared.work.notify_all();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Hand `r` (admitted) to the workers.
fn queue<C: SectorCipher>(s: &Shared<C>, r: Request) {
    s.state.lock().queue.push_back(r);
    s.work.notify_one();
}

/// Start `r` on the target's asynchronous backend where it has one and
/// takes this request, on the submitting thread: a write is encrypted
/// here, a read decrypted where its data arrives, and each completes
/// there, with no worker in between. **Returns:** the request when it
/// goes to the workers instead.
fn start<C: SectorCipher + 'static>(s: &Arc<Shared<C>>, r: Request) -> Option<Request> {
    if s.preallocated_out || s.target.backend().async_io().is_none() {
        return Some(r);
    }
    match r {
        Request::Write {
            offset,
            data,
            fua,
            done,
            began: None,
        } => start_write(s, offset, data, fua, done),
        Request::ReadInto(job, None) => start_read(s, job),
        r => Some(r),
    }
}

fn start_write<C: SectorCipher + 'static>(
    s: &Arc<Shared<C>>,
    offset: u64,
    data: Payload,
    fua: bool,
    done: WriteDone,
) -> Option<Request> {
    let (since, began) = (s.target.clock(), Instant::now());
    let (a, sealed) = match s.target.seal(offset, (*data).as_ref(), fua) {
        Some(sealed) => {
            let a = s.target.backend().async_io();
            (a.expect("sealed only for an asynchronous backend"), sealed)
        }
        None => {
            return Some(Request::Write {
                offset,
                data,
                fua,
                done,
                began: None,
            })
        }
    };
    let (sh, len) = (Arc::clone(s), sealed.len());
    let end: WriteEnd = Box::new(move |o| match o {
        Outcome::Done(res) => {
            sh.target.finish_write(len, &res, since);
            complete(&sh, || done(res));
            drop(data);
        }
        Outcome::Again(e) => {
            let r = Request::Write {
                offset,
                data,
                fua,
                done,
                began: sent_before(&e).then_some(began),
            };
            queue(&sh, r)
        }
    });
    a.start_write(offset, sealed, fua, end);
    None
}

fn start_read<C: SectorCipher + 'static>(
    s: &Arc<Shared<C>>,
    mut job: Box<dyn ReadJob>,
) -> Option<Request> {
    let offset = job.offset();
    let a = s.target.backend().async_io();
    match a {
        Some(a) if s.target.reads_async(offset, job.buf().len()) => {
            let (shared, began) = (Arc::clone(s), Instant::now());
            a.start_read(offset, Box::new(Started { job, shared, began }));
            None
        }
        _ => Some(Request::ReadInto(job, None)),
    }
}

/// Whether a request that ended `Again` with `e` had been sent (its
/// connection died before answering), so that doing it again keeps its
/// first start's deadline; one declined at once (`WouldBlock`, from
/// [`declined`](crate::async_io::declined)) never left and starts over on
/// the blocking path, like any request queued there.
fn sent_before(e: &io::Error) -> bool {
    e.kind() != io::ErrorKind::WouldBlock
}

/// Run a request's completion (a panic in it is caught and reported) and
/// give its slot back.
fn complete<C: SectorCipher>(s: &Shared<C>, done: impl FnOnce()) {
    report_panic(catch_unwind(AssertUnwindSafe(done)));
    s.gate.complete();
}

/// Report a completion that panicked (caught, so the queue goes on).
fn report_panic<T>(outcome: std::thread::Result<T>) {
    if outcome.is_err() {
        eprintln!("iopages-crypt: a request's completion panicked; the queue goes on");
    }
}

/// A read started on the asynchronous backend: decrypted in its buffer
/// where the ciphertext arrived, then completed there; back to the workers
/// when it comes back undone.
struct Started<C: SectorCipher> {
    job: Box<dyn ReadJob>,
    shared: Arc<Shared<C>>,
    /// When it started (the deadline of its retry runs from here).
    began: Instant,
}

impl<C: SectorCipher> AsyncReadInto for Started<C> {
    fn buf(&mut self) -> &mut [u8] {
        self.job.buf()
    }

    fn end(self: Box<Self>, outcome: Outcome) {
        let Started {
            mut job,
            shared,
            began,
        } = *self;
        match outcome {
            Outcome::Done(res) => {
                let offset = job.offset();
                let res = res.and_then(|()| shared.target.decrypt_read(offset, job.buf()));
                complete(&shared, || job.finish(res));
            }
            Outcome::Again(e) => {
                let began = sent_before(&e).then_some(began);
                queue(&shared, Request::ReadInto(job, began))
            }
        }
    }
}

fn worker<C: SectorCipher>(s: &Shared<C>) {
    // The worker's own out buffer (when `preallocated_out`): it owns its
    // pages and frees them when the worker exits.
    let mut buf = FolioBuffer::new(s.target.allocator());
    loop {
        let mut st = s.state.lock();
        let r = loop {
            if let Some(r) = st.queue.pop_front() {
                break r;
            }
            if st.shutdown {
                return;
            }
            s.work.wait(&mut st);
        };
        drop(st);
        serve(&s.target, r, s.preallocated_out.then_some(&mut buf));
        s.gate.complete();
    }
}

/// Run one request and its completion; a panicking completion is caught
/// (and reported) so the worker goes on serving the queue.
fn serve<C: SectorCipher>(t: &CryptTarget<C>, r: Request, buf: Option<&mut FolioBuffer>) {
    let outcome = match r {
        Request::Write {
            offset,
            data,
            fua,
            done,
            began,
        } => {
            let res = resumed(began, || match buf {
                Some(b) if !fua => t.write_with_folios(offset, (*data).as_ref(), b),
                _ => t.write_with_fua(offset, (*data).as_ref(), fua),
            });
            let outcome = catch_unwind(AssertUnwindSafe(|| done(res)));
            drop(data);
            outcome
        }
        Request::ReadInto(mut job, began) => {
            let res = resumed(began, || t.read(job.offset(), job.buf()));
            catch_unwind(AssertUnwindSafe(|| job.finish(res)))
        }
        Request::Read { offset, len, done } => {
            let mut buf = vec![0u8; len];
            let res = t.read(offset, &mut buf).map(|()| buf);
            catch_unwind(AssertUnwindSafe(|| done(res)))
        }
        Request::Flush { done } => {
            let res = t.flush();
            catch_unwind(AssertUnwindSafe(|| done(res)))
        }
    };
    report_panic(outcome);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{PageStore, RamDisk};
    use crate::strategy::Strategy;
    use crate::target::{CipherPool, TargetConfig};
    use iopages::PageAllocator;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A test arena of `bytes`, without huge pages.
    fn arena(bytes: u64) -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(bytes)
            .huge_pages(iopages::HugePages::Never)
            .build()
            .unwrap()
    }

    fn queue(workers: usize, depth: usize, store: bool) -> (PageAllocator, CryptQueue<CipherPool>) {
        queue_with(workers, depth, store, false)
    }

    fn queue_with(
        workers: usize,
        depth: usize,
        store: bool,
        preallocated_out: bool,
    ) -> (PageAllocator, CryptQueue<CipherPool>) {
        let alloc = arena(64 << 20);
        let backend: Arc<dyn crate::backend::Backend> = if store {
            Arc::new(PageStore::new(&alloc, 8 << 20).unwrap())
        } else {
            Arc::new(RamDisk::new(8 << 20).unwrap())
        };
        let key: Vec<u8> = (0..64u8).collect();
        let cipher =
            CipherPool::new(crate::XtsCipher::new(&key, 4096, 0).unwrap(), workers).unwrap();
        let cfg = TargetConfig {
            strategy: Strategy::Bulk,
            min_nr: 64,
            ..TargetConfig::default()
        };
        let t = Arc::new(CryptTarget::new(&alloc, cipher, backend, cfg).unwrap());
        let q = CryptQueue::new(
            t,
            QueueConfig {
                queue_depth: depth,
                workers,
                preallocated_out,
            },
        )
        .unwrap();
        (alloc, q)
    }

    #[test]
    fn many_writes_in_flight_all_complete_once_and_read_back() {
        for store in [false, true] {
            let (alloc, q) = queue(3, 16, store);
            let completed = Arc::new(AtomicUsize::new(0));
            let max_seen = Arc::new(AtomicUsize::new(0));
            for i in 0..256u64 {
                let data: Arc<[u8]> = vec![i as u8; 32 << 10].into();
                let (c, m) = (Arc::clone(&completed), Arc::clone(&max_seen));
                q.submit_write(i % 256 * (32 << 10), data, move |r| {
                    r.unwrap();
                    c.fetch_add(1, Ordering::Relaxed);
                });
                m.fetch_max(q.in_flight(), Ordering::Relaxed);
                assert!(q.in_flight() <= 16, "the queue depth is a bound");
            }
            q.wait_idle();
            assert_eq!(completed.load(Ordering::Relaxed), 256);
            assert!(max_seen.load(Ordering::Relaxed) > 1, "requests overlapped");
            for i in (0..256u64).step_by(37) {
                let back = q.read(i * (32 << 10), 32 << 10).unwrap();
                assert!(back.iter().all(|&b| b == i as u8), "write {i}");
            }
            let (tx, rx) = std::sync::mpsc::channel();
            q.submit_flush(move |r| tx.send(r.is_ok()).unwrap());
            assert!(rx.recv().unwrap());
            let stats = q.target().stats();
            assert_eq!(stats.writes, 256);
            assert_eq!(q.target().out_pages().allocated_pages(), 0);
            drop(q);
            alloc.leak_check().unwrap();
        }
    }

    #[test]
    fn arena_payloads_write_and_reads_land_in_the_callers_buffer() {
        let (alloc, q) = queue(2, 8, false);
        let kv = iopages::Kvmalloc::new(&alloc).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..16u64 {
            let mut b = kv
                .kvmalloc(64 << 10, iopages::Gfp::KERNEL, iopages::KvPolicy::FailFast)
                .unwrap();
            b.as_mut_slice().fill(i as u8 + 1);
            let tx = tx.clone();
            q.submit_write_buf(i * (64 << 10), Box::new(b), false, move |r| {
                tx.send(r).unwrap()
            });
        }
        for _ in 0..16 {
            rx.recv().unwrap().unwrap();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..16u64 {
            let b = kv
                .kvmalloc(64 << 10, iopages::Gfp::KERNEL, iopages::KvPolicy::FailFast)
                .unwrap();
            let tx = tx.clone();
            q.submit_read_into(i * (64 << 10), b, move |r, b| {
                tx.send((i, r, b)).unwrap();
            });
        }
        for _ in 0..16 {
            let (i, r, b) = rx.recv().unwrap();
            r.unwrap();
            assert!(b.as_slice().iter().all(|&x| x == i as u8 + 1), "read {i}");
        }
        // An out-of-range read completes with the error and the buffer.
        let (tx, rx) = std::sync::mpsc::channel();
        q.submit_read_into(64 << 20, vec![0u8; 4096], move |r, b| {
            tx.send((r.map_err(|e| e.kind()), b.len())).unwrap();
        });
        assert_eq!(rx.recv().unwrap(), (Err(io::ErrorKind::InvalidInput), 4096));
        q.wait_idle();
        drop(q);
        drop(kv);
        alloc.leak_check().unwrap();
    }

    #[test]
    fn workers_with_their_own_out_buffers_write_the_same_bytes_and_free_them_at_exit() {
        for store in [false, true] {
            let (alloc, q) = queue_with(2, 8, store, true);
            for i in 0..64u64 {
                q.submit_write(i * (64 << 10), vec![i as u8 ^ 0x3c; 64 << 10].into(), |r| {
                    r.unwrap()
                });
            }
            q.wait_idle();
            for i in (0..64u64).step_by(9) {
                let back = q.read(i * (64 << 10), 64 << 10).unwrap();
                assert!(back.iter().all(|&b| b == i as u8 ^ 0x3c), "write {i}");
            }
            let t = Arc::clone(q.target());
            assert_eq!(t.stats().writes, 64);
            assert_eq!(t.out_pages().allocated_pages(), 0);
            drop(q);
            drop(t);
            alloc.leak_check().unwrap();
        }
    }

    #[test]
    fn bad_requests_complete_with_an_error_and_a_panicking_completion_spares_the_queue() {
        let (alloc, q) = queue(1, 4, false);
        let e = q.write(100, vec![0u8; 4096].into()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(q.read(8 << 20, 4096).is_err());
        q.submit_write(0, vec![1u8; 4096].into(), |_| panic!("completion bug"));
        q.write(4096, vec![2u8; 4096].into()).unwrap();
        assert_eq!(q.read(4096, 4096).unwrap(), vec![2u8; 4096]);
        assert!(CryptQueue::new(
            Arc::clone(q.target()),
            QueueConfig {
                queue_depth: 0,
                ..QueueConfig::default()
            }
        )
        .is_err());
        drop(q);
        alloc.leak_check().unwrap();
    }

    #[test]
    fn dropping_the_queue_completes_what_was_admitted() {
        let (alloc, q) = queue(2, 64, true);
        let completed = Arc::new(AtomicUsize::new(0));
        for i in 0..64u64 {
            let c = Arc::clone(&completed);
            q.submit_write(i * 4096, vec![i as u8; 4096].into(), move |r| {
                r.unwrap();
                c.fetch_add(1, Ordering::Relaxed);
            });
        }
        let t = Arc::clone(q.target());
        drop(q);
        assert_eq!(completed.load(Ordering::Relaxed), 64);
        assert_eq!(t.out_pages().allocated_pages(), 0);
        drop(t);
        alloc.leak_check().unwrap();
    }

    /// A backend whose reads and writes start asynchronously and end on
    /// a thread of their own, by request number: every 4th from the
    /// second is declined at once (on the caller's thread), every 4th
    /// from the third comes back `Again` from the other thread, every
    /// 7th from the fourth ends with an error; the rest are done there.
    /// Blocking calls (what comes back to the workers) are counted.
    struct Later {
        disk: RamDisk,
        started: AtomicUsize,
        blocking: AtomicUsize,
        /// For each blocking call: how long before it the request had
        /// first started (`async_io::began`), if it had.
        ages: parking_lot::Mutex<Vec<Option<Duration>>>,
        delay: Duration,
        me: std::sync::Weak<Later>,
    }

    use crate::async_io::{declined, AsyncIo, ReadInto, Segments};
    use crate::backend::Backend as _;
    use std::time::Duration;

    impl Later {
        fn new(delay: Duration) -> Arc<Later> {
            Arc::new_cyclic(|me| Later {
                disk: RamDisk::new(8 << 20).unwrap(),
                started: AtomicUsize::new(0),
                blocking: AtomicUsize::new(0),
                ages: parking_lot::Mutex::new(Vec::new()),
                delay,
                me: me.clone(),
            })
        }

        /// What request `n` does: None to decline it at once.
        fn fate(n: usize) -> Option<&'static str> {
            match n {
                _ if n % 4 == 1 => None,
                _ if n % 4 == 2 => Some("again"),
                _ if n % 7 == 3 => Some("error"),
                _ => Some("done"),
            }
        }

        fn note_blocking(&self) {
            self.blocking.fetch_add(1, Ordering::Relaxed);
            let age = crate::async_io::began().map(|b| b.elapsed());
            self.ages.lock().push(age);
        }

        fn later(&self, f: impl FnOnce(&Later) + Send + 'static) {
            let me = self.me.upgrade().unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(me.delay);
                f(&me);
            });
        }
    }

    impl crate::backend::Backend for Later {
        fn size_bytes(&self) -> u64 {
            self.disk.size_bytes()
        }
        fn write_at(&self, offset: u64, segs: &[&[u8]]) -> io::Result<()> {
            self.note_blocking();
            self.disk.write_at(offset, segs)
        }
        fn read_at(&self, offset: u64, segs: &mut [&mut [u8]]) -> io::Result<()> {
            self.note_blocking();
            self.disk.read_at(offset, segs)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn async_io(&self) -> Option<&dyn AsyncIo> {
            Some(self)
        }
    }

    fn fated(fate: &str) -> Outcome {
        match fate {
            "again" => Outcome::Again(io::Error::other("connection died")),
            _ => Outcome::Done(Err(io::Error::other("EIO from the store"))),
        }
    }

    impl AsyncIo for Later {
        fn start_write(&self, offset: u64, data: Arc<dyn Segments>, _: bool, end: WriteEnd) {
            let n = self.started.fetch_add(1, Ordering::Relaxed);
            let Some(fate) = Later::fate(n) else {
                return end(Outcome::Again(declined("busy")));
            };
            self.later(move |me| match fate {
                "done" => {
                    let r = me.disk.write_at(offset, &data.segments());
                    drop(data);
                    end(Outcome::Done(r))
                }
                f => {
                    drop(data);
                    end(fated(f))
                }
            });
        }
        fn start_read(&self, offset: u64, mut into: Box<dyn ReadInto>) {
            let n = self.started.fetch_add(1, Ordering::Relaxed);
            let Some(fate) = Later::fate(n) else {
                return into.end(Outcome::Again(declined("busy")));
            };
            self.later(move |me| match fate {
                "done" => {
                    let r = me.disk.read_at(offset, &mut [into.buf()]);
                    into.end(Outcome::Done(r))
                }
                f => into.end(fated(f)),
            });
        }
    }

    /// The arena's accounting once every reference to the target is gone:
    /// a started request's end may still hold the last one for a moment
    /// after the queue's drop returned (it gives its slot back first).
    fn leak_check_soon(alloc: &PageAllocator) {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while alloc.leak_check().is_err() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        alloc.leak_check().unwrap();
    }

    fn later_queue(delay: Duration) -> (PageAllocator, Arc<Later>, CryptQueue<CipherPool>) {
        let alloc = arena(64 << 20);
        let later = Later::new(delay);
        let key: Vec<u8> = (0..64u8).collect();
        let cipher = CipherPool::new(crate::XtsCipher::new(&key, 4096, 0).unwrap(), 2).unwrap();
        let backend: Arc<dyn crate::backend::Backend> = later.clone();
        let cfg = TargetConfig::default();
        let t = Arc::new(CryptTarget::new(&alloc, cipher, backend, cfg).unwrap());
        let cfg = QueueConfig {
            queue_depth: 32,
            workers: 2,
            preallocated_out: false,
        };
        (alloc, later, CryptQueue::new(t, cfg).unwrap())
    }

    #[test]
    fn started_requests_end_once_and_what_comes_back_again_goes_to_the_workers() {
        let (alloc, later, q) = later_queue(Duration::from_millis(1));
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..64u64 {
            let tx = tx.clone();
            let data: Arc<[u8]> = vec![i as u8 + 1; 8192].into();
            q.submit_write(i * 8192, data, move |r| tx.send((i, r.is_ok())).unwrap());
        }
        let mut ok = vec![0usize; 64];
        for _ in 0..64 {
            let (i, good) = rx.recv().unwrap();
            ok[i as usize] += usize::from(good);
        }
        q.wait_idle();
        assert!(rx.try_recv().is_err(), "a write completed twice");
        // Started n: declined (n % 4 == 1) and Again (n % 4 == 2) went to
        // the workers and were written; errors (n % 7 == 3 otherwise)
        // failed; the rest were written by the backend's own thread.
        let failed: Vec<usize> = (0..64)
            .filter(|&n| n % 4 != 1 && n % 4 != 2 && n % 7 == 3)
            .collect();
        assert_eq!(
            ok.iter().filter(|&&c| c == 0).count(),
            failed.len(),
            "{ok:?}"
        );
        assert_eq!(
            later.blocking.load(Ordering::Relaxed),
            32,
            "declined and Again"
        );
        assert_eq!(q.target().stats().writes, 64 - failed.len() as u64);
        assert_eq!(q.target().stats().write_errors, failed.len() as u64);
        assert_eq!(
            q.target().out_pages().allocated_pages(),
            0,
            "every out page back"
        );
        // Reads of what was written (the failed writes' blocks are
        // zeros), whichever way each goes.
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..64u64 {
            let tx = tx.clone();
            q.submit_read_into(i * 8192, vec![0u8; 8192], move |r, b| {
                tx.send((i, r.is_ok(), b)).unwrap()
            });
        }
        let mut seen = 0;
        for _ in 0..64 {
            let (i, good, b) = rx.recv().unwrap();
            seen += 1;
            if good && ok[i as usize] == 1 {
                assert!(b.iter().all(|&x| x == i as u8 + 1), "read {i}");
            }
        }
        assert_eq!(seen, 64);
        drop(q);
        leak_check_soon(&alloc);
    }

    /// A request sent that ends `Again` is done on the blocking path
    /// inside its first start's time: the backend sees when it began, so
    /// its deadline runs from there, not from the retry. One declined at
    /// once starts over.
    #[test]
    fn a_request_done_again_keeps_the_moment_it_first_started() {
        let delay = Duration::from_millis(40);
        let (alloc, later, q) = later_queue(delay);
        // Fates by start: 0 done, 1 declined, 2 again, 3 error, 4 done,
        // 5 declined, 6 again, 7 done.
        for i in 0..8u64 {
            q.submit_write(i * 4096, vec![1u8; 4096].into(), |_| {});
        }
        q.wait_idle();
        let ages = later.ages.lock().clone();
        assert_eq!(ages.len(), 4, "declined and Again went blocking: {ages:?}");
        // The two declined at once never left: they start over. The two
        // whose connection "died" began a whole delay before.
        assert_eq!(ages.iter().filter(|a| a.is_none()).count(), 2, "{ages:?}");
        let waited = ages.iter().flatten().filter(|&&a| a >= delay).count();
        assert_eq!(
            waited, 2,
            "the two Again ones began a delay earlier: {ages:?}"
        );
        drop(q);
        leak_check_soon(&alloc);
    }

    #[test]
    fn dropping_the_queue_waits_for_started_requests() {
        let (alloc, later, q) = later_queue(Duration::from_millis(100));
        let done = Arc::new(AtomicUsize::new(0));
        for i in 0..8u64 {
            let d = Arc::clone(&done);
            q.submit_write(i * 4096, vec![1u8; 4096].into(), move |_| {
                d.fetch_add(1, Ordering::Relaxed);
            });
        }
        drop(q);
        assert_eq!(
            done.load(Ordering::Relaxed),
            8,
            "every write ended before the drop returned"
        );
        assert!(later.started.load(Ordering::Relaxed) >= 8);
        leak_check_soon(&alloc);
    }

    /// A backend that holds what a holding thread starts until that
    /// thread sends it (`async_io::hold_starts`), then ends it there.
    struct Holder {
        disk: RamDisk,
        held: parking_lot::Mutex<Vec<Box<dyn ReadInto>>>,
        sends: AtomicUsize,
        me: std::sync::Weak<Holder>,
    }

    impl crate::async_io::Held for Holder {
        fn send_held(&self) {
            self.sends.fetch_add(1, Ordering::Relaxed);
            let held = std::mem::take(&mut *self.held.lock());
            for mut into in held {
                into.buf().fill(0);
                into.end(Outcome::Done(Ok(())));
            }
        }
    }

    impl crate::backend::Backend for Holder {
        fn size_bytes(&self) -> u64 {
            self.disk.size_bytes()
        }
        fn write_at(&self, offset: u64, segs: &[&[u8]]) -> io::Result<()> {
            self.disk.write_at(offset, segs)
        }
        fn read_at(&self, offset: u64, segs: &mut [&mut [u8]]) -> io::Result<()> {
            self.disk.read_at(offset, segs)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn async_io(&self) -> Option<&dyn AsyncIo> {
            Some(self)
        }
    }

    impl AsyncIo for Holder {
        fn start_write(&self, _: u64, _: Arc<dyn Segments>, _: bool, end: WriteEnd) {
            end(Outcome::Again(declined("reads only")));
        }
        fn start_read(&self, _: u64, into: Box<dyn ReadInto>) {
            assert!(crate::async_io::holding(), "started by the holding thread");
            self.held.lock().push(into);
            let me: Arc<dyn crate::async_io::Held> = self.me.upgrade().unwrap();
            crate::async_io::held_by(me);
        }
    }

    #[test]
    fn a_thread_holding_started_requests_sends_them_before_it_waits_for_a_slot() {
        let alloc = arena(16 << 20);
        let holder = Arc::new_cyclic(|me| Holder {
            disk: RamDisk::new(1 << 20).unwrap(),
            held: parking_lot::Mutex::new(Vec::new()),
            sends: AtomicUsize::new(0),
            me: me.clone(),
        });
        let key: Vec<u8> = (0..64u8).collect();
        let cipher = CipherPool::new(crate::XtsCipher::new(&key, 4096, 0).unwrap(), 1).unwrap();
        let backend: Arc<dyn crate::backend::Backend> = holder.clone();
        let t =
            Arc::new(CryptTarget::new(&alloc, cipher, backend, TargetConfig::default()).unwrap());
        let cfg = QueueConfig {
            queue_depth: 4,
            workers: 1,
            preallocated_out: false,
        };
        let q = Arc::new(CryptQueue::new(t, cfg).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let q2 = Arc::clone(&q);
        // Twelve reads through a gate of four on a thread that holds
        // what it starts: the fifth finds the gate full, and only the
        // held four can free it.
        std::thread::spawn(move || {
            crate::async_io::hold_starts(true);
            for i in 0..12u64 {
                let tx = tx.clone();
                q2.submit_read_into(i * 4096, vec![1u8; 4096], move |r, _| {
                    tx.send(r.is_ok()).unwrap()
                });
            }
            crate::async_io::hold_starts(false);
        });
        for i in 0..12 {
            let ok = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| {
                    panic!(
                        "read {i} of 12 never ended: the submitter waits on its own held requests"
                    )
                });
            assert!(ok, "read {i}");
        }
        assert!(
            holder.sends.load(Ordering::Relaxed) >= 3,
            "sent at each full gate"
        );
        q.wait_idle();
        drop(q);
        leak_check_soon(&alloc);
    }
}
