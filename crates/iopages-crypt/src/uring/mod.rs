//! The io_uring backend: the crypt target's ciphertext on a real file or
//! block device.
//!
//! Owns: one open file (regular file or block device), a small set of
//! io_uring instances over it, the choice between direct (`O_DIRECT`) and
//! buffered I/O, the registration of a page allocator's arena as fixed
//! buffers, and the bounce buffers that make unaligned requests legal under
//! `O_DIRECT`. Must never: accept a short or zero-byte transfer silently
//! (a short one is resubmitted for the rest, a zero-byte one is an error),
//! return while the kernel may still read or write a caller's buffer (every
//! submitted entry is reaped first, errors included; should the ring itself
//! keep failing with entries in flight — a kernel bug, never the caller's
//! input — the process aborts instead of returning), touch the file for a
//! request that leaves the device, take a fallback without recording why,
//! or lose a concurrent writer's bytes when two unaligned writes share a
//! block (the read-modify-write of a shared edge block is serialised).
//!
//! ## How one call runs
//!
//! 1. The range is checked with
//!    [`check_range`](crate::backend::check_range); nothing is submitted
//!    for a refused request.
//! 2. A ring is picked: `try_lock` round robin from a rotating start, then a
//!    blocking lock, so several threads have I/Os in flight at once.
//! 3. Each segment becomes one or more submission entries (at most 1 GiB
//!    each, and never across a fixed buffer's edge). A segment inside the
//!    registered arena goes out as `WriteFixed` / `ReadFixed` with the index
//!    of its 1 GiB chunk; others as plain `Write` / `Read`.
//! 4. Under `O_DIRECT`, segments that are not aligned (address to
//!    [`UringFile::mem_align`], file offset and length to
//!    [`UringFile::io_align`]) are gathered into runs and go through aligned
//!    bounce buffers (arena pages when an arena is given, else an aligned
//!    heap allocation). A write whose first or last byte does not fall on a
//!    block edge reads that edge block first (read-modify-write), under a
//!    per-block stripe lock.
//! 5. Every entry of the call is queued at once (in waves of the ring's
//!    size when there are more), then completions are reaped: a short one
//!    is resubmitted for the remainder, `EINTR` / `EAGAIN` / `ECANCELED` are
//!    retried (at most 64 times per entry), a zero-byte one fails with
//!    `WriteZero` / `UnexpectedEof`. After the
//!    first error nothing new is submitted, but every outstanding entry is
//!    still reaped before the error (naming the path and offset) returns.
//!
//! `O_DIRECT` is tried unless [`DirectIo::Off`]: the open, the alignment the
//! kernel reports (`statx` with `STATX_DIOALIGN`, or the block device's
//! logical block size) and a probe read must all succeed. With
//! [`DirectIo::Auto`] a refusal switches the descriptor to buffered I/O and
//! the reason is kept in [`UringFile::fallbacks`]; with
//! [`DirectIo::Require`] it fails the open. (tmpfs refused `O_DIRECT` before
//! Linux 6.6 and accepts it since.)
//!
//! Hole punches (`fallocate(PUNCH_HOLE | KEEP_SIZE)`), discards (a punch,
//! or `BLKDISCARD` on a block device that cannot punch) and the file's
//! data and holes (`lseek(SEEK_DATA / SEEK_HOLE)`) are plain system calls
//! on the calling thread, outside the rings.
//!
//! Fixed buffers are pinned memory: without `CAP_IPC_LOCK` they count
//! against `RLIMIT_MEMLOCK`, once per ring. A refused registration is
//! recorded as a fallback and the plain opcodes are used.
//!
//! ## Files
//!
//! | file | owns |
//! |---|---|
//! | `options.rs` | [`DirectIo`], [`UringOptions`], [`UringStats`] |
//! | `open.rs` | [`UringFile::open`]: the file, its size, the `O_DIRECT` checks and fallback, the rings, the arena's registration; `block_device_size`; [`probe`] |
//! | `call.rs` | one read or write call (step 1), and the buffered `preadv` / `pwritev` path |
//! | `bounce.rs` | step 4: bounce buffers, the plan of a direct call, edge-block read-modify-write |
//! | `submit.rs` | steps 2, 3 and 5: the ring choice, entries, the drive loop, `fdatasync` |
//! | `map.rs` | the read-only mapping of the file for [`Backend::mapped`] |
//! | `holes.rs` | punches, discards and extents |
//!
//! This file holds [`UringFile`] itself (its fields are private to this
//! folder), its accessors and its [`Backend`] implementation, which hands
//! each call to the file that owns it. Layering inside the folder: `call`
//! names `bounce`; `open` names `bounce`, `map` and `options`; `bounce`
//! names `submit`; `submit`, `map`, `holes` and `options` name no sibling.

mod bounce;
mod call;
mod holes;
mod map;
mod open;
mod options;
mod submit;

pub(crate) use open::block_device_size;
pub use open::{probe, IO_WORKERS};
pub use options::{DirectIo, UringOptions, UringStats};

use crate::backend::{Backend, Extent};
use io_uring::IoUring;
use iopages::PageAllocator;
use map::FileMap;
use parking_lot::Mutex;
use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The largest buffer io_uring registers as one fixed buffer; the arena is
/// registered in chunks of this size, and buffer index `i` covers bytes
/// `i << 30 .. (i + 1) << 30` of the arena.
pub const FIXED_BUFFER_MAX_BYTES: usize = 1 << 30;

/// Stripe locks serialising read-modify-writes of a shared edge block.
const RMW_STRIPES: usize = 64;

#[derive(Default)]
struct Counters {
    submissions: AtomicU64,
    fixed_ops: AtomicU64,
    bounced_segments: AtomicU64,
    short_resubmissions: AtomicU64,
    retries: AtomicU64,
    sync_calls: AtomicU64,
    mapped_reads: AtomicU64,
}

/// The registered arena: the allocator (which keeps the mapping alive) and
/// the mapping's extent.
struct ArenaMap {
    alloc: PageAllocator,
    base: usize,
    len: usize,
}

/// A file or block device driven through io_uring. `Send` and `Sync`: any
/// number of threads may call it at once, each call on its own ring.
pub struct UringFile {
    // Field order is drop order: the rings (which hold the registration of
    // the arena's pages) go before the allocator that owns the mapping, and
    // before the file they point at.
    rings: Box<[Mutex<IoUring>]>,
    next_ring: AtomicUsize,
    arena: Option<ArenaMap>,
    file: File,
    path: PathBuf,
    size: u64,
    /// The file mapped read-only (buffered I/O with `map_reads`).
    map: Option<FileMap>,
    /// A block device (else a regular file).
    is_block: bool,
    read_only: bool,
    direct: bool,
    fixed: bool,
    mem_align: usize,
    io_align: usize,
    fallbacks: Vec<String>,
    rmw_locks: Box<[Mutex<()>]>,
    short_io: AtomicUsize,
    faults: submit::Faults,
    counters: Counters,
}

/// One caller segment: where it goes in the file and its memory. For a
/// write the memory is only ever read (by us or the kernel).
#[derive(Clone, Copy)]
struct Seg {
    off: u64,
    ptr: *mut u8,
    len: usize,
}

impl UringFile {
    /// The path the file was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT`).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Whether the arena is registered as fixed buffers on every ring.
    pub fn fixed_buffers(&self) -> bool {
        self.fixed
    }

    /// Why each fallback was taken (buffered instead of direct I/O, plain
    /// instead of fixed buffers), in the order they happened; empty when
    /// everything asked for is in use.
    pub fn fallbacks(&self) -> &[String] {
        &self.fallbacks
    }

    /// Memory alignment a segment needs to skip the bounce buffer under
    /// `O_DIRECT` (at least 4096).
    pub fn mem_align(&self) -> usize {
        self.mem_align
    }

    /// File offset and length alignment a segment needs to skip the bounce
    /// buffer under `O_DIRECT` (at least 512).
    pub fn io_align(&self) -> usize {
        self.io_align
    }

    /// Number of rings.
    pub fn nr_rings(&self) -> usize {
        self.rings.len()
    }

    /// The io_uring worker limits ([bounded, unbounded]) of the calling
    /// thread's io-wq, as the first ring reports them: [`IO_WORKERS`]
    /// once this thread has submitted I/O through the file; zeros before
    /// (the thread has no io-wq yet).
    ///
    /// **Returns:** the kernel's error (`EINVAL` before Linux 5.15).
    pub fn io_worker_limits(&self) -> io::Result<[u32; 2]> {
        let mut query = [0u32; 2];
        self.rings[0]
            .lock()
            .submitter()
            .register_iowq_max_workers(&mut query)?;
        Ok(query)
    }

    /// Counters since the open.
    pub fn stats(&self) -> UringStats {
        let c = &self.counters;
        UringStats {
            submissions: c.submissions.load(Relaxed),
            fixed_ops: c.fixed_ops.load(Relaxed),
            bounced_segments: c.bounced_segments.load(Relaxed),
            short_resubmissions: c.short_resubmissions.load(Relaxed),
            retries: c.retries.load(Relaxed),
            sync_calls: c.sync_calls.load(Relaxed),
            mapped_reads: c.mapped_reads.load(Relaxed),
        }
    }

    /// Tests only: ask the kernel for at most `max_bytes` (rounded down to
    /// [`UringFile::io_align`] under `O_DIRECT`, at least one block) on the
    /// first attempt of every entry, so the short-transfer resubmission
    /// path runs. `None` turns it off.
    #[doc(hidden)]
    pub fn set_short_io_for_tests(&self, max_bytes: Option<usize>) {
        self.short_io
            .store(max_bytes.map_or(0, |n| n.max(1)), Relaxed);
    }

    /// Tests only: replace the result of every `every`-th completion of
    /// this file's rings (reads, writes and flushes through a ring; not
    /// the `preadv` / `pwritev` of buffered I/O) with `-errno`, as if the
    /// kernel had failed it, so the drive loop's error paths run: `EINTR`,
    /// `EAGAIN` and `ECANCELED` are retried (at most 64 times per entry),
    /// any other fails the call. `None` turns it off.
    #[doc(hidden)]
    pub fn fail_completions_for_tests(&self, fault: Option<(i32, u32)>) {
        let (errno, every) = fault.unwrap_or((0, 0));
        self.faults.set(errno, every);
    }

    /// An error about this file.
    fn err(&self, kind: io::ErrorKind, msg: impl fmt::Display) -> io::Error {
        io::Error::new(kind, format!("{}: {msg}", self.path.display()))
    }
}

impl Backend for UringFile {
    fn size_bytes(&self) -> u64 {
        self.size
    }

    /// The bytes at `offset` in the page cache, when the file is mapped
    /// (buffered I/O) and still holds them. A regular file is checked
    /// with `fstat` first: if it has been cut shorter, `None` sends the
    /// read to `preadv`, which reports the end of file (a mapping would
    /// fault). A truncation racing with the copy itself is not covered.
    fn mapped(&self, offset: u64, len: usize) -> Option<&[u8]> {
        self.mapped_bytes(offset, len)
    }

    /// Buffered I/O copies a write into the page cache (the kernel reads
    /// the ciphertext right after it is made); `O_DIRECT` hands the pages
    /// to the device.
    fn reads_writes(&self) -> bool {
        !self.direct
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let mut at = offset;
        let segs: Vec<Seg> = segments
            .iter()
            .map(|s| {
                let seg = Seg {
                    off: at,
                    // Only ever read through (see `Seg`).
                    ptr: s.as_ptr().cast_mut(),
                    len: s.len(),
                };
                at = at.wrapping_add(s.len() as u64);
                seg
            })
            .collect();
        self.io(offset, &segs, true)
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let mut at = offset;
        let segs: Vec<Seg> = segments
            .iter_mut()
            .map(|s| {
                let seg = Seg {
                    off: at,
                    ptr: s.as_mut_ptr(),
                    len: s.len(),
                };
                at = at.wrapping_add(s.len() as u64);
                seg
            })
            .collect();
        self.io(offset, &segs, false)
    }

    fn flush(&self) -> io::Result<()> {
        self.fdatasync()
    }

    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)`: a regular file (a memfd too)
    /// deallocates the range, a block device (Linux 4.9 and later) zeroes
    /// it without writing zeros, or refuses (`Unsupported`) where it cannot
    /// guarantee zeros. The page cache drops the range (the file's mapping
    /// reads zeros afterwards); this backend keeps no copy of the file's
    /// bytes, so nothing else needs invalidating.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.punch_range(offset, len)
    }

    fn can_punch(&self) -> bool {
        !self.read_only
    }

    /// A regular file: a punched hole. A block device: a zeroing punch
    /// where the device offers one, else `BLKDISCARD` (whose range may read
    /// back as zeros or as what it held).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.discard_range(offset, len)
    }

    /// A regular file's data and holes, from `lseek(SEEK_DATA)` and
    /// `lseek(SEEK_HOLE)`; a block device: all allocated. A file system
    /// without hole tracking reports the whole file as data.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        self.extents_of(offset, len, max_extents)
    }
}

impl fmt::Debug for UringFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringFile")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("direct_io", &self.direct)
            .field("fixed_buffers", &self.fixed)
            .field("rings", &self.rings.len())
            .field("fallbacks", &self.fallbacks)
            .finish()
    }
}
