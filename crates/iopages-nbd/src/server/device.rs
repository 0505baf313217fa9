//! What the server needs of a crypt queue, without its cipher type.
//!
//! Owns: the object-safe view ([`Device`]) of a
//! [`CryptQueue`](iopages_crypt::queue::CryptQueue) the connections submit
//! to, FUA (passed down with each write when the target's backend takes
//! it, else the target's flush after the request), and the target's discards, punches and
//! allocation map (done on the connection's thread: a `fallocate` or an
//! `lseek`, no cipher work). Must never: hold the queue inside a
//! completion (a completion holding the last reference would drop the
//! queue on its own worker thread, which joins itself).

use crate::server::buffers::Buf;
use iopages::PageAllocator;
use iopages_crypt::backend::Extent;
use iopages_crypt::queue::{CryptQueue, Payload};
use iopages_crypt::target::{CryptTarget, SectorCipher};
use std::io;
use std::sync::Arc;

/// A write's or flush's completion.
pub(crate) type Done = Box<dyn FnOnce(io::Result<()>) + Send>;
/// A read's completion: the result and the buffer read into.
pub(crate) type ReadDone = Box<dyn FnOnce(io::Result<()>, Buf) + Send>;
/// Flushes the target synchronously: FUA after a request's writes where
/// it does not go down with each ([`fua_per_write`]), on the thread that
/// completes the last of them (a worker or the connection's thread, never
/// a backend's own).
pub(crate) type Flusher = Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

/// A block device served through a queue.
pub(crate) trait Device: Send + Sync {
    fn size_bytes(&self) -> u64;
    fn sector_bytes(&self) -> u32;
    /// The arena the target's out pages come from (payload buffers too).
    fn allocator(&self) -> PageAllocator;
    /// With `fua`, the write is durable before `done` runs (only asked
    /// for when [`Device::native_fua`]; otherwise the request's FUA is a
    /// flush after all its writes). `done` may run on a thread of the
    /// backend's (a remote store's reader): it must not wait for the
    /// device.
    fn submit_write(&self, offset: u64, data: Payload, fua: bool, done: Done);
    /// Whether a request's FUA goes down with each of its writes (see
    /// [`fua_per_write`]) instead of one flush after them all.
    fn native_fua(&self) -> bool;
    fn submit_read(&self, offset: u64, buf: Buf, done: ReadDone);
    fn submit_flush(&self, done: Done);
    fn flusher(&self) -> Flusher;
    /// The target's discard-related calls (see [`CryptTarget`]).
    fn holes(&self) -> &dyn Holes;
}

/// A target's discards, punches and allocation map, called synchronously.
pub(crate) trait Holes: Send + Sync {
    fn discards_allowed(&self) -> bool;
    fn can_punch_zeroes(&self) -> bool;
    fn discard(&self, offset: u64, len: u64) -> io::Result<u64>;
    fn punch_zeroes(&self, offset: u64, len: u64) -> io::Result<()>;
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>>;
}

impl<C: SectorCipher> Holes for CryptTarget<C> {
    fn discards_allowed(&self) -> bool {
        CryptTarget::discards_allowed(self)
    }
    fn can_punch_zeroes(&self) -> bool {
        CryptTarget::can_punch_zeroes(self)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<u64> {
        CryptTarget::discard(self, offset, len)
    }
    fn punch_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        CryptTarget::punch_zeroes(self, offset, len)
    }
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        CryptTarget::extents(self, offset, len, max_extents)
    }
}

/// Whether FUA goes down with each write to `t`: where its backend makes
/// one write durable by itself (an NBD remote offering FUA), and where its
/// writes may end on the backend's own threads (a remote store's started
/// requests: there the write and then a flush run on a worker, because a
/// flush after the request's last write would run on the thread that
/// ended it — the store connection's reader, which would wait for its
/// own reply).
pub(crate) fn fua_per_write<C: SectorCipher>(t: &CryptTarget<C>) -> bool {
    t.native_fua() || t.backend().async_io().is_some()
}

impl<C: SectorCipher + 'static> Device for CryptQueue<C> {
    fn size_bytes(&self) -> u64 {
        self.target().size_bytes()
    }
    fn sector_bytes(&self) -> u32 {
        self.target().sector_size() as u32
    }
    fn allocator(&self) -> PageAllocator {
        self.target().allocator().clone()
    }
    fn submit_write(&self, offset: u64, data: Payload, fua: bool, done: Done) {
        CryptQueue::submit_write_buf(self, offset, data, fua, done);
    }
    fn native_fua(&self) -> bool {
        fua_per_write(self.target())
    }
    fn submit_read(&self, offset: u64, buf: Buf, done: ReadDone) {
        CryptQueue::submit_read_into(self, offset, buf, done);
    }
    fn submit_flush(&self, done: Done) {
        CryptQueue::submit_flush(self, done);
    }
    fn flusher(&self) -> Flusher {
        let t: Arc<CryptTarget<C>> = Arc::clone(self.target());
        Arc::new(move || t.flush())
    }
    fn holes(&self) -> &dyn Holes {
        &**self.target()
    }
}

/// A queue's target served on the submitting thread: each request runs
/// (encrypts or decrypts, and does its backend I/O) on the connection's
/// own thread, and its completion runs there too — dm-crypt's
/// `no_read_workqueue` and `no_write_workqueue` flags, which skip the
/// kcryptd hand-off for devices fast enough that the hand-off costs more
/// than the work (a page-cache file, memory).
///
/// Requests of at most `max_bytes` are served inline. Larger ones go to
/// the queue, whose workers encrypt several at once — unless at least as
/// many connections are in transmission as there are workers: then the
/// connections' own threads already keep every core busy, and the
/// hand-off would only add switches.
pub(crate) struct Inline<C: SectorCipher + 'static> {
    pub(crate) queue: Arc<CryptQueue<C>>,
    pub(crate) max_bytes: usize,
    /// Connections in transmission now.
    pub(crate) active: Arc<std::sync::atomic::AtomicUsize>,
}

impl<C: SectorCipher + 'static> Inline<C> {
    fn here(&self, len: usize) -> bool {
        len <= self.max_bytes
            || self.active.load(std::sync::atomic::Ordering::Relaxed) >= self.queue.workers()
    }
}

impl<C: SectorCipher + 'static> Device for Inline<C> {
    fn size_bytes(&self) -> u64 {
        self.queue.target().size_bytes()
    }
    fn sector_bytes(&self) -> u32 {
        self.queue.target().sector_size() as u32
    }
    fn allocator(&self) -> PageAllocator {
        self.queue.target().allocator().clone()
    }
    fn submit_write(&self, offset: u64, data: Payload, fua: bool, done: Done) {
        if !self.here((*data).as_ref().len()) {
            return Device::submit_write(&*self.queue, offset, data, fua, done);
        }
        let r = self
            .queue
            .target()
            .write_with_fua(offset, (*data).as_ref(), fua);
        drop(data);
        done(r);
    }
    fn native_fua(&self) -> bool {
        fua_per_write(self.queue.target())
    }
    fn submit_read(&self, offset: u64, mut buf: Buf, done: ReadDone) {
        if !self.here(buf.as_ref().len()) {
            return Device::submit_read(&*self.queue, offset, buf, done);
        }
        let r = self.queue.target().read(offset, buf.as_mut());
        done(r, buf);
    }
    fn submit_flush(&self, done: Done) {
        done(self.queue.target().flush());
    }
    fn flusher(&self) -> Flusher {
        self.queue.flusher()
    }
    fn holes(&self) -> &dyn Holes {
        &**self.queue.target()
    }
}
