//! What the server needs of a crypt queue, without its cipher type.
//!
//! Owns: the object-safe view ([`Device`]) of a
//! [`CryptQueue`](iopages_crypt::queue::CryptQueue) the connections submit
//! to, and the target's flush for FUA. Must never: hold the queue inside a
//! completion (a completion holding the last reference would drop the
//! queue on its own worker thread, which joins itself).

use crate::buffers::Buf;
use iopages::PageAllocator;
use iopages_crypt::queue::{CryptQueue, Payload};
use iopages_crypt::target::{CryptTarget, SectorCipher};
use std::io;
use std::sync::Arc;

/// A write's or flush's completion.
pub(crate) type Done = Box<dyn FnOnce(io::Result<()>) + Send>;
/// A read's completion: the result and the buffer read into.
pub(crate) type ReadDone = Box<dyn FnOnce(io::Result<()>, Buf) + Send>;
/// Flushes the target synchronously (for FUA, on a worker thread).
pub(crate) type Flusher = Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

/// A block device served through a queue.
pub(crate) trait Device: Send + Sync {
    fn size_bytes(&self) -> u64;
    fn sector_bytes(&self) -> u32;
    /// The arena the target's out pages come from (payload buffers too).
    fn allocator(&self) -> PageAllocator;
    fn submit_write(&self, offset: u64, data: Payload, done: Done);
    fn submit_read(&self, offset: u64, buf: Buf, done: ReadDone);
    fn submit_flush(&self, done: Done);
    fn flusher(&self) -> Flusher;
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
    fn submit_write(&self, offset: u64, data: Payload, done: Done) {
        CryptQueue::submit_write_buf(self, offset, data, done);
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
}
