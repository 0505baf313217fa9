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
//! 1. The range is checked with [`check_range`]; nothing is submitted for a
//!    refused request.
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
//!    is resubmitted for the remainder, `EINTR` / `EAGAIN` are retried, a
//!    zero-byte one fails with `WriteZero` / `UnexpectedEof`. After the
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

use crate::backend::{check_range, push_extent, Backend, Extent};
use io_uring::{opcode, types, IoUring};
use iopages::{Gfp, PageAllocator, PageBox, MAX_ORDER, PAGE_SIZE};
use parking_lot::{Mutex, MutexGuard};
use std::alloc::Layout;
use std::collections::VecDeque;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The largest buffer io_uring registers as one fixed buffer; the arena is
/// registered in chunks of this size, and buffer index `i` covers bytes
/// `i << 30 .. (i + 1) << 30` of the arena.
pub const FIXED_BUFFER_MAX_BYTES: usize = 1 << 30;

/// The largest transfer asked of the kernel in one entry.
const MAX_OP_BYTES: usize = 1 << 30;
/// The largest bounce buffer; longer unaligned runs use several.
const BOUNCE_CHUNK_BYTES: usize = 1 << 20;
/// How often one entry is retried after `EINTR` / `EAGAIN`.
const MAX_RETRIES: u32 = 64;
/// Stripe locks serialising read-modify-writes of a shared edge block.
const RMW_STRIPES: usize = 64;
/// Sectors: every device size is a multiple of this.
const SECTOR: u64 = 512;
/// The smallest memory alignment used for `O_DIRECT` buffers.
const MIN_MEM_ALIGN: usize = 4096;
/// `user_data` of a flush entry.
const FLUSH_TAG: u64 = u64::MAX;

/// Whether to use direct I/O (`O_DIRECT`, bypassing the page cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectIo {
    /// Try `O_DIRECT`; if the file system refuses it, use buffered I/O and
    /// record why in [`UringFile::fallbacks`].
    #[default]
    Auto,
    /// `O_DIRECT` or fail the open.
    Require,
    /// Buffered I/O through the page cache.
    Off,
}

/// How to open a [`UringFile`]. Start from [`UringOptions::default`] and
/// set fields directly or with the builder methods.
#[derive(Clone)]
pub struct UringOptions {
    /// Direct or buffered I/O (default [`DirectIo::Auto`]).
    pub direct: DirectIo,
    /// An allocator whose arena is registered as fixed buffers on every
    /// ring; segments inside it use the fixed opcodes, and bounce buffers
    /// come from it. `None` (default): plain opcodes, heap bounce buffers.
    pub arena: Option<PageAllocator>,
    /// How many rings (default: the available parallelism). At least 1.
    pub rings: usize,
    /// Submission queue entries per ring (default 256; the kernel rounds up
    /// to a power of two and clamps to its maximum).
    pub ring_entries: u32,
    /// Create the regular file if missing and extend it to this size if it
    /// is shorter (never truncated); the device is this size. For a block
    /// device, a size up to the device's (the device's first bytes). `None`
    /// (default): the file's size, or the block device's.
    pub create_size: Option<u64>,
    /// Open read-only: writes fail (with the kernel's error).
    pub read_only: bool,
    /// Under buffered I/O, also map the file read-only so that large reads
    /// can be decrypted straight out of the page cache
    /// ([`Backend::mapped`]) instead of copied out of it first. Default
    /// on; ignored under `O_DIRECT`.
    ///
    /// Turn it off for a file another process may cut shorter (an image
    /// file, a block device that can be resized): a read that copies out
    /// of the mapping while the file shrinks under it touches pages past
    /// the new end and the process gets `SIGBUS`. The size check before
    /// each mapped read narrows that window but cannot close it. Safe to
    /// leave on for a memfd sealed with `F_SEAL_SHRINK` (what the served
    /// in-memory volume is) or a file nothing else can open for writing.
    pub map_reads: bool,
    /// Tests only: behave as if the file system refused `O_DIRECT` at open
    /// (`EINVAL`), so the fallback path runs where it does accept it.
    #[doc(hidden)]
    pub refuse_direct_for_tests: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            direct: DirectIo::Auto,
            arena: None,
            rings: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ring_entries: 256,
            create_size: None,
            read_only: false,
            map_reads: true,
            refuse_direct_for_tests: false,
        }
    }
}

impl UringOptions {
    /// Set [`UringOptions::direct`].
    pub fn direct(mut self, direct: DirectIo) -> Self {
        self.direct = direct;
        self
    }

    /// Set [`UringOptions::arena`].
    pub fn arena(mut self, alloc: PageAllocator) -> Self {
        self.arena = Some(alloc);
        self
    }

    /// Set [`UringOptions::rings`].
    pub fn rings(mut self, rings: usize) -> Self {
        self.rings = rings;
        self
    }

    /// Set [`UringOptions::ring_entries`].
    pub fn ring_entries(mut self, entries: u32) -> Self {
        self.ring_entries = entries;
        self
    }

    /// Set [`UringOptions::create_size`].
    pub fn create_size(mut self, size_bytes: u64) -> Self {
        self.create_size = Some(size_bytes);
        self
    }

    /// Set [`UringOptions::read_only`].
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }
}

impl fmt::Debug for UringOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringOptions")
            .field("direct", &self.direct)
            .field(
                "arena_bytes",
                &self.arena.as_ref().map(|a| a.arena().size_bytes()),
            )
            .field("rings", &self.rings)
            .field("ring_entries", &self.ring_entries)
            .field("create_size", &self.create_size)
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// Counters of a [`UringFile`] since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringStats {
    /// Submission entries queued (resubmissions and flushes included).
    pub submissions: u64,
    /// Of those, `ReadFixed` / `WriteFixed` entries.
    pub fixed_ops: u64,
    /// Caller segments that went through a bounce buffer.
    pub bounced_segments: u64,
    /// Entries resubmitted for the rest after a short transfer.
    pub short_resubmissions: u64,
    /// Entries resubmitted after `EINTR` / `EAGAIN`.
    pub retries: u64,
    /// `preadv` / `pwritev` calls (buffered I/O does not go through the
    /// rings; see [`DirectIo::Off`]).
    pub sync_calls: u64,
    /// Reads served from the file's mapping ([`Backend::mapped`]).
    pub mapped_reads: u64,
}

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

/// A read-only shared mapping of the whole file: the page cache's pages
/// themselves, for reads that decrypt straight out of them.
struct FileMap {
    ptr: *mut u8,
    len: usize,
    /// A regular file (which can shrink under us; a block device cannot).
    regular: bool,
}

// SAFETY: the mapping is read-only and shared by design; it is only read,
// through `&self`, and unmapped once, in `Drop`.
unsafe impl Send for FileMap {}
// SAFETY: as above.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// `None` when the file cannot be mapped (the caller reads with
    /// `preadv` then).
    fn new(file: &File, size: u64, is_block: bool) -> Option<FileMap> {
        let len = usize::try_from(size).ok()?;
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an
        // open file; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        Some(FileMap {
            ptr: ptr.cast(),
            len,
            regular: !is_block,
        })
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; no borrow of
        // it outlives `&self` of the file that owns it.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
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

/// One transfer asked of the kernel, resubmitted until `done == len`.
struct Op {
    off: u64,
    ptr: *mut u8,
    len: usize,
    done: usize,
    fixed: Option<u16>,
    started: bool,
    retries: u32,
}

/// Aligned memory from the heap, freed on drop.
struct HeapBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl HeapBuf {
    fn new(len: usize, align: usize) -> io::Result<HeapBuf> {
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no aligned buffer of {len} bytes aligned to {align}"),
            )
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("no memory for an aligned buffer of {len} bytes"),
            ));
        }
        Ok(HeapBuf { ptr, layout })
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this layout, and every
        // entry using it has been reaped (buffers outlive the drive loop).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// What became of an entry after one completion.
enum Outcome {
    /// Every byte moved.
    Done,
    /// Resubmit it (short transfer, or `EINTR` / `EAGAIN`).
    Again,
    /// It failed; nothing more is asked for it.
    Failed(io::Error),
}

/// A bounce buffer: arena pages (which may be fixed buffers) or the heap.
enum BounceMem<'a> {
    Arena(#[allow(dead_code)] PageBox<'a>),
    Heap(#[allow(dead_code)] HeapBuf),
}

/// One bounce buffer standing for `len` bytes of the file at `off`.
struct Bounce<'a> {
    off: u64,
    ptr: *mut u8,
    len: usize,
    _mem: BounceMem<'a>,
}

/// A run of consecutive unaligned segments and the bounce buffers covering
/// it (`cover` is the run widened to block edges).
struct Run {
    segs: std::ops::Range<usize>,
    start: u64,
    end: u64,
    cover_start: u64,
    bounces: std::ops::Range<usize>,
}

impl UringFile {
    /// Open `path` as a backend.
    ///
    /// **Context:** blocks (open, extending the file with `ftruncate`, a
    /// probe read, ring setup and buffer registration).
    /// **Returns:** an error naming `path`: `InvalidInput` for bad options,
    /// a size that is zero or not a multiple of 512, or a path that is
    /// neither a regular file nor a block device; `Unsupported` when
    /// [`DirectIo::Require`] cannot be met; the system's error otherwise.
    pub fn open(path: impl AsRef<Path>, opts: UringOptions) -> io::Result<UringFile> {
        let path = path.as_ref().to_path_buf();
        let named = |kind: io::ErrorKind, msg: String| {
            io::Error::new(kind, format!("{}: {msg}", path.display()))
        };
        let invalid = |msg: String| named(io::ErrorKind::InvalidInput, msg);
        if opts.rings == 0 {
            return Err(invalid("rings must be at least 1".into()));
        }
        if opts.ring_entries == 0 {
            return Err(invalid("ring_entries must be at least 1".into()));
        }
        if let Some(want) = opts.create_size {
            if opts.read_only {
                return Err(invalid(
                    "create_size cannot be used with read_only (nothing may be created)".into(),
                ));
            }
            check_size(want).map_err(invalid)?;
        }

        // Open, with O_DIRECT unless told otherwise.
        let mut fallbacks = Vec::new();
        let open_with = |direct: bool| -> io::Result<File> {
            if direct && opts.refuse_direct_for_tests {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            let mut o = OpenOptions::new();
            o.read(true).write(!opts.read_only);
            if opts.create_size.is_some() {
                o.create(true);
            }
            o.custom_flags(if direct { libc::O_DIRECT } else { 0 });
            o.open(&path)
        };
        let mut direct = opts.direct != DirectIo::Off;
        let file = match open_with(direct) {
            Ok(f) => f,
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                let reason = format!("the file system refused O_DIRECT at open ({e})");
                refuse_direct(&path, opts.direct, &reason, &mut fallbacks)?;
                direct = false;
                open_with(false).map_err(|e| named(e.kind(), format!("open: {e}")))?
            }
            Err(e) => return Err(named(e.kind(), format!("open: {e}"))),
        };

        // Size.
        let meta = file
            .metadata()
            .map_err(|e| named(e.kind(), format!("fstat: {e}")))?;
        let ft = meta.file_type();
        let is_block = ft.is_block_device();
        let size = if ft.is_file() {
            match opts.create_size {
                Some(want) => {
                    if meta.len() < want {
                        file.set_len(want).map_err(|e| {
                            named(e.kind(), format!("extending the file to {want} bytes: {e}"))
                        })?;
                    }
                    want
                }
                None => meta.len(),
            }
        } else if is_block {
            let dev = block_device_size(&file)
                .map_err(|e| named(e.kind(), format!("BLKGETSIZE64: {e}")))?;
            match opts.create_size {
                Some(want) if want > dev => {
                    return Err(invalid(format!(
                        "a block device of {dev} bytes cannot be extended to {want} bytes"
                    )))
                }
                Some(want) => want,
                None => dev,
            }
        } else {
            return Err(invalid("neither a regular file nor a block device".into()));
        };
        check_size(size).map_err(invalid)?;

        // Direct I/O: alignment, then a probe read.
        let mut mem_align = MIN_MEM_ALIGN;
        let mut io_align = SECTOR as usize;
        if direct {
            match check_direct(&file, is_block, size) {
                Ok((mem, io)) => (mem_align, io_align) = (mem, io),
                Err(reason) => {
                    refuse_direct(&path, opts.direct, &reason, &mut fallbacks)?;
                    set_direct_flag(&file, false).map_err(|e| {
                        named(e.kind(), format!("clearing O_DIRECT with fcntl: {e}"))
                    })?;
                    direct = false;
                }
            }
        }

        // Rings, and the arena as fixed buffers on each.
        let mut rings = Vec::with_capacity(opts.rings);
        for _ in 0..opts.rings {
            let ring = IoUring::builder()
                .setup_clamp()
                .build(opts.ring_entries)
                .map_err(|e| {
                    let hint = match e.raw_os_error() {
                        Some(libc::EPERM) | Some(libc::ENOSYS) => {
                            " (io_uring is disabled here: see kernel.io_uring_disabled or seccomp)"
                        }
                        _ => "",
                    };
                    let n = opts.ring_entries;
                    named(e.kind(), format!("io_uring setup ({n} entries): {e}{hint}"))
                })?;
            rings.push(ring);
        }
        let mut fixed = false;
        let arena = opts.arena.as_ref().map(|alloc| ArenaMap {
            alloc: alloc.clone(),
            base: alloc.arena().base() as usize,
            len: alloc.arena().size_bytes(),
        });
        if let Some(a) = &arena {
            match register_arena(&rings, a) {
                Ok(()) => fixed = true,
                Err(reason) => fallbacks.push(reason),
            }
        }

        let map = if !direct && opts.map_reads && size > 0 {
            FileMap::new(&file, size, is_block)
        } else {
            None
        };

        Ok(UringFile {
            map,
            rings: rings.into_iter().map(Mutex::new).collect(),
            next_ring: AtomicUsize::new(0),
            arena,
            file,
            path,
            size,
            is_block,
            read_only: opts.read_only,
            direct,
            fixed,
            mem_align,
            io_align,
            fallbacks,
            rmw_locks: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            short_io: AtomicUsize::new(0),
            counters: Counters::default(),
        })
    }

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

    /// An error about this file.
    fn err(&self, kind: io::ErrorKind, msg: impl fmt::Display) -> io::Error {
        io::Error::new(kind, format!("{}: {msg}", self.path.display()))
    }

    /// A free ring if there is one (round robin from a rotating start),
    /// else wait for the first choice.
    fn ring(&self) -> MutexGuard<'_, IoUring> {
        let n = self.rings.len();
        let start = self.next_ring.fetch_add(1, Relaxed) % n;
        for i in 0..n {
            if let Some(g) = self.rings[(start + i) % n].try_lock() {
                return g;
            }
        }
        self.rings[start].lock()
    }

    /// The fixed buffer index for `len` bytes at `ptr`, if they lie inside
    /// one registered chunk.
    fn fixed_index(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let a = self.arena.as_ref().filter(|_| self.fixed)?;
        let off = (ptr as usize).checked_sub(a.base)?;
        let end = off.checked_add(len)?;
        if len == 0 || end > a.len {
            return None;
        }
        let idx = off / FIXED_BUFFER_MAX_BYTES;
        ((end - 1) / FIXED_BUFFER_MAX_BYTES == idx)
            .then(|| u16::try_from(idx).ok())
            .flatten()
    }

    /// Whether `seg` can go to the kernel as it is.
    fn aligned(&self, seg: &Seg) -> bool {
        !self.direct
            || ((seg.ptr as usize).is_multiple_of(self.mem_align)
                && seg.len.is_multiple_of(self.io_align)
                && seg.off.is_multiple_of(self.io_align as u64))
    }

    /// Append the entries for `len` bytes at `ptr` going to file offset
    /// `off`: at most 1 GiB each, split at fixed buffer edges.
    fn push_ops(&self, ops: &mut Vec<Op>, off: u64, ptr: *mut u8, len: usize) {
        let mut done = 0;
        while done < len {
            let p = ptr.wrapping_add(done);
            let mut n = (len - done).min(MAX_OP_BYTES);
            if let Some(a) = self.arena.as_ref().filter(|_| self.fixed) {
                if let Some(rel) = (p as usize).checked_sub(a.base).filter(|&r| r < a.len) {
                    n = n.min(FIXED_BUFFER_MAX_BYTES - rel % FIXED_BUFFER_MAX_BYTES);
                }
            }
            ops.push(Op {
                off: off + done as u64,
                ptr: p,
                len: n,
                done: 0,
                fixed: self.fixed_index(p, n),
                started: false,
                retries: 0,
            });
            done += n;
        }
    }

    /// An aligned bounce buffer of `len` bytes (a multiple of the block)
    /// for file offset `off`: arena pages when they can be had at once,
    /// else the heap.
    fn bounce(&self, off: u64, len: usize) -> io::Result<Bounce<'_>> {
        if let Some(a) = &self.arena {
            let order = len.div_ceil(PAGE_SIZE).next_power_of_two().trailing_zeros();
            if order <= MAX_ORDER && self.mem_align <= PAGE_SIZE {
                if let Some(b) = a.alloc.alloc_box(Gfp::NOWAIT, order) {
                    let ptr = a.alloc.page_address(b.page());
                    return Ok(Bounce {
                        off,
                        ptr,
                        len,
                        _mem: BounceMem::Arena(b),
                    });
                }
            }
        }
        let h = HeapBuf::new(len, self.mem_align).map_err(|e| self.err(e.kind(), e))?;
        Ok(Bounce {
            off,
            ptr: h.ptr,
            len,
            _mem: BounceMem::Heap(h),
        })
    }

    /// Buffered I/O ([`DirectIo::Off`], or the fallback where `O_DIRECT` is
    /// refused): `preadv` / `pwritev` on the calling thread. Through
    /// io_uring a buffered write to ext4 cannot complete without blocking,
    /// so the kernel hands every one to an io-wq worker thread: two more
    /// context switches per I/O, which cost more than the copy into the
    /// page cache (measured with 4 KiB random writes, `docs/experiments.md`
    /// E6). Short transfers continue where they stopped; `EINTR` retries.
    fn io_sync(&self, segs: &[Seg], write: bool) -> io::Result<()> {
        const MAX_IOV: usize = 1024; // IOV_MAX
        let fd = self.file.as_raw_fd();
        let cap = match self.short_io.load(Relaxed) {
            0 => usize::MAX,
            n => n,
        };
        let mut i = 0; // first segment not fully done
        let mut done_in_first = 0usize; // bytes of segs[i] already moved
        while i < segs.len() {
            let mut iov: Vec<libc::iovec> = Vec::with_capacity((segs.len() - i).min(MAX_IOV));
            let mut asked = 0usize;
            for (k, s) in segs[i..].iter().take(MAX_IOV).enumerate() {
                let skip = if k == 0 { done_in_first } else { 0 };
                let len = (s.len - skip).min(cap - asked);
                iov.push(libc::iovec {
                    iov_base: s.ptr.wrapping_add(skip).cast(),
                    iov_len: len,
                });
                asked += len;
                if asked == cap {
                    break;
                }
            }
            let off = segs[i].off + done_in_first as u64;
            self.counters.sync_calls.fetch_add(1, Relaxed);
            // SAFETY: every iovec describes (the rest of) a caller's segment,
            // valid for the call: readable for a write, writable for a read.
            let n = unsafe {
                if write {
                    libc::pwritev(
                        fd,
                        iov.as_ptr(),
                        iov.len() as libc::c_int,
                        off as libc::off_t,
                    )
                } else {
                    libc::preadv(
                        fd,
                        iov.as_ptr(),
                        iov.len() as libc::c_int,
                        off as libc::off_t,
                    )
                }
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    self.counters.retries.fetch_add(1, Relaxed);
                    continue;
                }
                let what = if write { "pwritev" } else { "preadv" };
                return Err(self.err(e.kind(), format!("{what} at offset {off}: {e}")));
            }
            if n == 0 {
                return Err(self.err(
                    if write {
                        io::ErrorKind::WriteZero
                    } else {
                        io::ErrorKind::UnexpectedEof
                    },
                    format!(
                        "{} moved no bytes at offset {off} (end of file)",
                        if write { "pwritev" } else { "preadv" }
                    ),
                ));
            }
            let mut left = n as usize;
            while left > 0 {
                let rest = segs[i].len - done_in_first;
                if left >= rest {
                    left -= rest;
                    i += 1;
                    done_in_first = 0;
                } else {
                    done_in_first += left;
                    left = 0;
                    self.counters.short_resubmissions.fetch_add(1, Relaxed);
                }
            }
            while i < segs.len() && segs[i].len == 0 {
                i += 1;
            }
        }
        Ok(())
    }

    /// The whole of one read or write call.
    fn io(&self, offset: u64, segs: &[Seg], write: bool) -> io::Result<()> {
        let total = segs
            .iter()
            .try_fold(0u64, |acc, s| acc.checked_add(s.len as u64))
            .ok_or_else(|| self.err(io::ErrorKind::InvalidInput, "segment lengths overflow"))?;
        check_range(offset, total, self.size).map_err(|e| self.err(e.kind(), e))?;
        if total == 0 {
            return Ok(());
        }
        if !self.direct {
            return self.io_sync(segs, write);
        }
        let block = self.io_align as u64;
        let chunk = BOUNCE_CHUNK_BYTES.max(self.io_align);

        // Plan: entries in file order; unaligned runs through bounces.
        let mut ops = Vec::with_capacity(segs.len());
        let mut bounces: Vec<Bounce<'_>> = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let mut run_from: Option<usize> = None;
        for (i, s) in segs.iter().enumerate() {
            if s.len == 0 {
                continue;
            }
            if self.aligned(s) {
                if let Some(from) = run_from.take() {
                    runs.push(self.plan_run(segs, from..i, chunk, &mut ops, &mut bounces)?);
                }
                self.push_ops(&mut ops, s.off, s.ptr, s.len);
            } else if run_from.is_none() {
                run_from = Some(i);
            }
        }
        if let Some(from) = run_from {
            runs.push(self.plan_run(segs, from..segs.len(), chunk, &mut ops, &mut bounces)?);
        }
        let bounced: usize = runs
            .iter()
            .map(|r| segs[r.segs.clone()].iter().filter(|s| s.len > 0).count())
            .sum();
        self.counters
            .bounced_segments
            .fetch_add(bounced as u64, Relaxed);

        let mut ring = self.ring();
        if !write {
            self.drive(&mut ring, &mut ops, false)?;
            for r in &runs {
                self.copy_run(r, segs, &bounces, chunk, false);
            }
            return Ok(());
        }
        // A block at an edge of the call that the write covers only partly
        // is read first (into its own aligned buffer, under its stripe
        // lock, so a concurrent write to the rest of that block is not
        // undone), copied into the bounce, and the caller's bytes over it.
        let mut edges: Vec<(u64, *mut u8)> = Vec::new();
        for r in &runs {
            for pos in [r.start, r.end] {
                let blk = pos / block * block;
                if pos % block != 0 && !edges.iter().any(|&(b, _)| b == blk) {
                    let rel = (blk - r.cover_start) as usize;
                    let b = &bounces[r.bounces.start + rel / chunk];
                    edges.push((blk, b.ptr.wrapping_add(rel % chunk)));
                }
            }
        }
        let mut stripes: Vec<usize> = edges
            .iter()
            .map(|&(b, _)| (b / block) as usize % RMW_STRIPES)
            .collect();
        stripes.sort_unstable();
        stripes.dedup();
        let _locks: Vec<_> = stripes.iter().map(|&s| self.rmw_locks[s].lock()).collect();
        if !edges.is_empty() {
            let bufs = edges
                .iter()
                .map(|_| HeapBuf::new(self.io_align, self.mem_align))
                .collect::<io::Result<Vec<_>>>()
                .map_err(|e| self.err(e.kind(), e))?;
            let mut rmw = Vec::with_capacity(edges.len());
            for (&(blk, _), buf) in edges.iter().zip(&bufs) {
                self.push_ops(&mut rmw, blk, buf.ptr, self.io_align);
            }
            self.drive(&mut ring, &mut rmw, false)?;
            for (&(_, dst), buf) in edges.iter().zip(&bufs) {
                // SAFETY: `buf` holds `io_align` bytes just read (its entry
                // was reaped); `dst` is a block-aligned block inside a bounce
                // buffer (blocks never straddle bounce buffers, whose sizes
                // are multiples of the block), ours alone and not in flight.
                unsafe { std::ptr::copy_nonoverlapping(buf.ptr, dst, self.io_align) };
            }
        }
        for r in &runs {
            self.copy_run(r, segs, &bounces, chunk, true);
        }
        self.drive(&mut ring, &mut ops, true)
        // `bounces` drop after this, once every entry using them was reaped.
    }

    /// Plan a run of unaligned segments: bounce buffers covering it,
    /// widened to block edges, and their entries.
    fn plan_run<'a>(
        &'a self,
        segs: &[Seg],
        range: std::ops::Range<usize>,
        chunk: usize,
        ops: &mut Vec<Op>,
        bounces: &mut Vec<Bounce<'a>>,
    ) -> io::Result<Run> {
        let block = self.io_align as u64;
        let last = &segs[range.end - 1];
        let (start, end) = (segs[range.start].off, last.off + last.len as u64);
        let cover_start = start / block * block;
        let cover_end = end.div_ceil(block) * block;
        let first = bounces.len();
        let mut at = cover_start;
        while at < cover_end {
            let n = (cover_end - at).min(chunk as u64) as usize;
            let b = self.bounce(at, n)?;
            self.push_ops(ops, b.off, b.ptr, b.len);
            bounces.push(b);
            at += n as u64;
        }
        Ok(Run {
            segs: range,
            start,
            end,
            cover_start,
            bounces: first..bounces.len(),
        })
    }

    /// Copy a run's segments into its bounce buffers (`into_bounce`) or
    /// back out of them.
    fn copy_run(&self, r: &Run, segs: &[Seg], bounces: &[Bounce<'_>], chunk: usize, into: bool) {
        for s in &segs[r.segs.clone()] {
            let mut done = 0;
            while done < s.len {
                let rel = (s.off + done as u64 - r.cover_start) as usize;
                let b = &bounces[r.bounces.start + rel / chunk];
                let within = rel % chunk;
                let n = (s.len - done).min(b.len - within);
                let (bp, sp) = (b.ptr.wrapping_add(within), s.ptr.wrapping_add(done));
                // SAFETY: `sp..sp+n` lies inside the caller's segment (done +
                // n <= len) and `bp..bp+n` inside the bounce buffer (within
                // + n <= b.len, as the cover contains the segment); the
                // bounce buffer is ours alone, so they do not overlap, and
                // no entry using either is in flight (the copy in comes
                // before the submission, the copy out after the reaping).
                // A write segment is only read from (`into`).
                unsafe {
                    if into {
                        std::ptr::copy_nonoverlapping(sp, bp, n);
                    } else {
                        std::ptr::copy_nonoverlapping(bp, sp, n);
                    }
                }
                done += n;
            }
        }
    }

    /// Submit every entry in `ops` (in waves of the ring's size if there
    /// are more) and reap them all, resubmitting short and interrupted
    /// transfers. Returns the first error only once nothing is in flight.
    fn drive(&self, ring: &mut IoUring, ops: &mut [Op], write: bool) -> io::Result<()> {
        let cap = ring.params().sq_entries() as usize;
        let fd = types::Fd(self.file.as_raw_fd());
        let short_cap = match self.short_io.load(Relaxed) {
            0 => usize::MAX,
            n if self.direct => {
                let unit = self.io_align.max(self.mem_align);
                (n / unit * unit).max(unit)
            }
            n => n,
        };
        let mut ready: VecDeque<usize> = (0..ops.len()).collect();
        let mut inflight = 0usize;
        let mut first_err: Option<io::Error> = None;
        loop {
            if first_err.is_none() {
                let mut sq = ring.submission();
                let (mut pushed, mut fixed) = (0u64, 0u64);
                while inflight < cap && !sq.is_full() {
                    let Some(i) = ready.pop_front() else { break };
                    let op = &mut ops[i];
                    let was_started = op.started;
                    let mut n = (op.len - op.done).min(u32::MAX as usize);
                    if !op.started {
                        n = n.min(short_cap);
                        op.started = true;
                    }
                    let (ptr, off, n32) = (
                        op.ptr.wrapping_add(op.done),
                        op.off + op.done as u64,
                        n as u32,
                    );
                    let entry = match (write, op.fixed) {
                        (true, Some(idx)) => opcode::WriteFixed::new(fd, ptr, n32, idx)
                            .offset(off)
                            .build(),
                        (true, None) => opcode::Write::new(fd, ptr, n32).offset(off).build(),
                        (false, Some(idx)) => opcode::ReadFixed::new(fd, ptr, n32, idx)
                            .offset(off)
                            .build(),
                        (false, None) => opcode::Read::new(fd, ptr, n32).offset(off).build(),
                    };
                    // SAFETY: the entry points at `n` bytes of a caller
                    // segment or bounce buffer, which stay valid (and, for a
                    // read, unused by anyone else) until this function has
                    // reaped the entry: it returns only with nothing in
                    // flight. A fixed index names the registered chunk that
                    // contains the whole range.
                    if unsafe { sq.push(&entry.user_data(i as u64)) }.is_err() {
                        op.started = was_started;
                        ready.push_front(i);
                        break;
                    }
                    pushed += 1;
                    fixed += op.fixed.is_some() as u64;
                    inflight += 1;
                }
                drop(sq);
                self.counters.submissions.fetch_add(pushed, Relaxed);
                self.counters.fixed_ops.fetch_add(fixed, Relaxed);
            }
            if inflight == 0 {
                break;
            }
            self.enter(ring);
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                let Some(op) = ops.get_mut(i) else { continue };
                inflight -= 1;
                match self.complete(op, cqe.result(), write) {
                    Outcome::Done => {}
                    Outcome::Again => ready.push_back(i),
                    Outcome::Failed(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Account for one completion of `op` with result `res`.
    fn complete(&self, op: &mut Op, res: i32, write: bool) -> Outcome {
        let kind = if write { "write" } else { "read" };
        let at = op.off + op.done as u64;
        let left = op.len - op.done;
        if res < 0 {
            let errno = -res;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && op.retries < MAX_RETRIES {
                op.retries += 1;
                self.counters.retries.fetch_add(1, Relaxed);
                return Outcome::Again;
            }
            let e = io::Error::from_raw_os_error(errno);
            let hint = if write && self.read_only && errno == libc::EBADF {
                " (the file was opened read-only)"
            } else {
                ""
            };
            let msg = format!("{kind} of {left} bytes at offset {at} failed: {e}{hint}");
            return Outcome::Failed(self.err(e.kind(), msg));
        }
        if res == 0 {
            return Outcome::Failed(self.stopped(write, at, left));
        }
        op.done += (res as usize).min(left);
        if op.done == op.len {
            return Outcome::Done;
        }
        if self.direct && !op.done.is_multiple_of(self.io_align) {
            // The rest cannot be asked for under O_DIRECT (its offset is off
            // a block edge): only the end of the file stops a transfer
            // there.
            let at = op.off + op.done as u64;
            return Outcome::Failed(self.stopped(write, at, op.len - op.done));
        }
        self.counters.short_resubmissions.fetch_add(1, Relaxed);
        Outcome::Again
    }

    /// The error for a transfer that stopped at `at` with `left` bytes to go.
    fn stopped(&self, write: bool, at: u64, left: usize) -> io::Error {
        if write {
            let msg = format!("write at offset {at} stopped with {left} bytes left to write");
            self.err(io::ErrorKind::WriteZero, msg)
        } else {
            let msg = format!(
                "read at offset {at} (inside the device's {} bytes) hit the end of the file \
                 with {left} bytes left",
                self.size
            );
            self.err(io::ErrorKind::UnexpectedEof, msg)
        }
    }

    /// Submit what is queued and wait for at least one completion,
    /// retrying what the kernel asks to be retried.
    fn enter(&self, ring: &mut IoUring) {
        let mut failures = 0u32;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => return,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) | Some(libc::EBUSY) => std::thread::yield_now(),
                    _ => {
                        // The ring itself is broken (a kernel or program
                        // bug, never the caller's input). Entries may still
                        // be in flight into caller buffers, so returning
                        // would risk memory corruption; try a few more
                        // times, then stop the process.
                        failures += 1;
                        if failures > 100 {
                            eprintln!(
                                "{}: io_uring_enter keeps failing with I/O in flight: {e}; \
                                 aborting",
                                self.path.display()
                            );
                            std::process::abort();
                        }
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                },
            }
        }
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
        let m = self.map.as_ref()?;
        let end = offset.checked_add(len as u64)?;
        if end > self.size || end > m.len as u64 {
            return None;
        }
        if m.regular {
            // SAFETY: `st` is a valid out-parameter for fstat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above, on our own open descriptor.
            if unsafe { libc::fstat(self.file.as_raw_fd(), &mut st) } != 0
                || (st.st_size as u64) < end
            {
                return None;
            }
        }
        self.counters.mapped_reads.fetch_add(1, Relaxed);
        // SAFETY: `offset..end` lies inside the mapping (checked above),
        // which lives as long as `self`; it is only read.
        Some(unsafe { std::slice::from_raw_parts(m.ptr.add(offset as usize), len) })
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
        let mut ring = self.ring();
        let entry = opcode::Fsync::new(types::Fd(self.file.as_raw_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build()
            .user_data(FLUSH_TAG);
        let mut retries = 0;
        loop {
            // SAFETY: an fsync entry points at no memory.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                // Cannot happen: nothing else is queued on a ring we hold.
                return Err(self.err(io::ErrorKind::Other, "fdatasync: submission queue full"));
            }
            self.counters.submissions.fetch_add(1, Relaxed);
            let res = loop {
                self.enter(&mut ring);
                let done = ring
                    .completion()
                    .filter(|c| c.user_data() == FLUSH_TAG)
                    .map(|c| c.result())
                    .last();
                if let Some(r) = done {
                    break r;
                }
            };
            if res >= 0 {
                return Ok(());
            }
            if (-res == libc::EINTR || -res == libc::EAGAIN) && retries < MAX_RETRIES {
                retries += 1;
                self.counters.retries.fetch_add(1, Relaxed);
                continue;
            }
            let e = io::Error::from_raw_os_error(-res);
            return Err(self.err(e.kind(), format!("fdatasync: {e}")));
        }
    }

    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)`: a regular file (a memfd too)
    /// deallocates the range, a block device (Linux 4.9 and later) zeroes
    /// it without writing zeros, or refuses (`Unsupported`) where it cannot
    /// guarantee zeros. The page cache drops the range (the file's mapping
    /// reads zeros afterwards); this backend keeps no copy of the file's
    /// bytes, so nothing else needs invalidating.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_discard(offset, len, "punch")?;
        if len == 0 {
            return Ok(());
        }
        self.punch_hole(offset, len)
    }

    fn can_punch(&self) -> bool {
        !self.read_only
    }

    /// A regular file: a punched hole. A block device: a zeroing punch
    /// where the device offers one, else `BLKDISCARD` (whose range may read
    /// back as zeros or as what it held).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_discard(offset, len, "discard")?;
        if len == 0 {
            return Ok(());
        }
        match self.punch_hole(offset, len) {
            Err(e) if self.is_block && punch_refused(&e) => {}
            done => return done,
        }
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD reads two u64 (start, length) from the
        // pointer given, which points at `range` for the whole call.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKDISCARD as _, range.as_ptr()) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(self.err(
                os_kind(&e),
                format!("BLKDISCARD of {len} bytes at offset {offset}: {e}"),
            ));
        }
        Ok(())
    }

    /// A regular file's data and holes, from `lseek(SEEK_DATA)` and
    /// `lseek(SEEK_HOLE)`; a block device: all allocated. A file system
    /// without hole tracking reports the whole file as data.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        check_range(offset, len, self.size).map_err(|e| self.err(e.kind(), e))?;
        let end = offset + len;
        let max = max_extents.max(1);
        let mut out: Vec<Extent> = Vec::new();
        if self.is_block {
            push_extent(&mut out, len, false);
            return Ok(out);
        }
        let mut pos = offset;
        while pos < end {
            // The next data at or after `pos`: none (ENXIO) means a hole
            // to the end of the file.
            let data = match self.seek(pos, libc::SEEK_DATA) {
                Ok(d) => d.clamp(pos, end),
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) => return Err(self.err(e.kind(), format!("lseek(SEEK_DATA, {pos}): {e}"))),
            };
            if data > pos {
                if out.last().is_some_and(|x| !x.hole) && out.len() == max {
                    break;
                }
                push_extent(&mut out, data - pos, true);
                pos = data;
                continue;
            }
            // Data at `pos`: it runs to the next hole (the end of the
            // file at the latest).
            let hole = match self.seek(pos, libc::SEEK_HOLE) {
                Ok(h) if h > pos => h.min(end),
                // Cut shorter under us between the two calls: the rest is
                // past the end of the file, a hole.
                Ok(_) => pos,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => pos,
                Err(e) => return Err(self.err(e.kind(), format!("lseek(SEEK_HOLE, {pos}): {e}"))),
            };
            let (next, hole_run) = if hole > pos {
                (hole, false)
            } else {
                (end, true)
            };
            if out.last().is_some_and(|x| x.hole != hole_run) && out.len() == max {
                break;
            }
            push_extent(&mut out, next - pos, hole_run);
            pos = next;
        }
        Ok(out)
    }
}

/// `BLKDISCARD`: `_IO(0x12, 119)`.
const BLKDISCARD: u64 = 0x1277;

/// The kind of an OS error, `Unsupported` for `EOPNOTSUPP` (which the
/// standard library reports as `Other`) and `ENOSYS`.
fn os_kind(e: &io::Error) -> io::ErrorKind {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => io::ErrorKind::Unsupported,
        _ => e.kind(),
    }
}

/// Whether a punch failed because the device does not offer it for this
/// range (`Unsupported`, or `InvalidInput` from `EINVAL`), so a discard
/// falls back to `BLKDISCARD`.
fn punch_refused(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Unsupported | io::ErrorKind::InvalidInput
    )
}

impl UringFile {
    /// Refuse a punch or discard on a read-only file (`PermissionDenied`)
    /// or out of range (`InvalidInput`), before anything is asked.
    fn check_discard(&self, offset: u64, len: u64, what: &str) -> io::Result<()> {
        check_range(offset, len, self.size).map_err(|e| self.err(e.kind(), e))?;
        if self.read_only {
            return Err(self.err(
                io::ErrorKind::PermissionDenied,
                format!("{what} of {len} bytes at offset {offset}: the file is open read-only"),
            ));
        }
        Ok(())
    }

    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)` of a checked, non-empty range.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(self.err(
                io::ErrorKind::InvalidInput,
                format!("punch of {len} bytes at offset {offset}: past the largest file offset"),
            ));
        };
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        loop {
            // SAFETY: fallocate on our own open descriptor; no memory.
            if unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, n) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(self.err(
                os_kind(&e),
                format!("fallocate(PUNCH_HOLE) of {len} bytes at offset {offset}: {e}"),
            ));
        }
    }

    /// `lseek(fd, pos, whence)`. The descriptor's position is never used
    /// for I/O here (every transfer names its offset), so moving it is
    /// harmless.
    fn seek(&self, pos: u64, whence: libc::c_int) -> io::Result<u64> {
        let off = libc::off_t::try_from(pos)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: lseek on our own open descriptor; no memory.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), off, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as u64)
        }
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

/// A device size is a non-zero multiple of 512.
fn check_size(size: u64) -> Result<(), String> {
    if size == 0 || !size.is_multiple_of(SECTOR) {
        Err(format!(
            "size {size} bytes is not a non-zero multiple of {SECTOR} bytes"
        ))
    } else {
        Ok(())
    }
}

/// `O_DIRECT` is unavailable for `reason`: record the fallback (`Auto`) or
/// fail (`Require`).
fn refuse_direct(
    path: &Path,
    mode: DirectIo,
    reason: &str,
    fallbacks: &mut Vec<String>,
) -> io::Result<()> {
    if mode == DirectIo::Require {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{}: O_DIRECT required but unavailable: {reason}",
                path.display()
            ),
        ));
    }
    fallbacks.push(format!("buffered I/O instead of O_DIRECT: {reason}"));
    Ok(())
}

/// Set or clear `O_DIRECT` on an open descriptor.
fn set_direct_flag(file: &File, on: bool) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor we own reads its flags; no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::O_DIRECT
    } else {
        flags & !libc::O_DIRECT
    };
    // SAFETY: F_SETFL with an int argument on a descriptor we own.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The alignments direct I/O needs on `file` (memory, file offset and
/// length), checked by probe reads; `Err` gives why it cannot be used.
fn check_direct(file: &File, is_block: bool, size: u64) -> Result<(usize, usize), String> {
    let fd = file.as_raw_fd();
    let mut mem_align = MIN_MEM_ALIGN;
    let mut io_align = SECTOR as usize;
    // SAFETY: statx writes one `struct statx` into `stx`, which is zeroed
    // plain data; the empty path with AT_EMPTY_PATH names `fd` itself.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        if stx.stx_dio_offset_align == 0 {
            return Err("statx reports no direct I/O support for this file".into());
        }
        mem_align = mem_align.max(stx.stx_dio_mem_align as usize);
        io_align = io_align.max(stx.stx_dio_offset_align as usize);
    } else if is_block {
        let mut lbs: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int to the pointer given.
        if unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs) } == 0 && lbs > 0 {
            io_align = io_align.max(lbs as usize);
        }
    }
    if !mem_align.is_power_of_two() || !io_align.is_power_of_two() {
        return Err(format!(
            "unusable direct I/O alignment (memory {mem_align}, offset {io_align})"
        ));
    }
    let probe = |len: usize, off: u64, align: usize| -> io::Result<()> {
        let buf = HeapBuf::new(len, align)?;
        // SAFETY: `buf` holds `len` writable bytes until it drops, after
        // the call has returned.
        let n = unsafe { libc::pread(fd, buf.ptr.cast(), len, off as libc::off_t) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    let len = io_align.max(4096);
    if let Err(e) = probe(len, 0, mem_align) {
        return Err(format!(
            "a probe read of {len} aligned bytes at offset 0 failed ({e})"
        ));
    }
    // The offset alignment: one block at the second block. A refusal means
    // the device wants larger blocks than reported; use 4096.
    if io_align < 4096 && size >= 2 * io_align as u64 {
        if let Err(e) = probe(io_align, io_align as u64, mem_align) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(format!("a probe read at offset {io_align} failed ({e})"));
            }
            io_align = 4096;
        }
    }
    if !size.is_multiple_of(io_align as u64) {
        return Err(format!(
            "the size ({size} bytes) is not a multiple of the direct I/O block ({io_align} bytes)"
        ));
    }
    Ok((mem_align, io_align))
}

/// The size of a block device in bytes (`BLKGETSIZE64`; the LUKS
/// header code asks the same way).
pub(crate) fn block_device_size(file: &File) -> io::Result<u64> {
    // _IOR(0x12, 114, size_t)
    #[cfg(any(
        target_arch = "powerpc",
        target_arch = "powerpc64",
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    ))]
    const BLKGETSIZE64: u64 = 0x4008_1272;
    #[cfg(not(any(
        target_arch = "powerpc",
        target_arch = "powerpc64",
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    )))]
    const BLKGETSIZE64: u64 = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer given.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Register the arena's mapping, in chunks of at most 1 GiB, on every ring;
/// on a refusal, undo what was registered and say why.
fn register_arena(rings: &[IoUring], a: &ArenaMap) -> Result<(), String> {
    let iovecs: Vec<libc::iovec> = (0..a.len)
        .step_by(FIXED_BUFFER_MAX_BYTES)
        .map(|off| libc::iovec {
            iov_base: (a.base + off) as *mut libc::c_void,
            iov_len: (a.len - off).min(FIXED_BUFFER_MAX_BYTES),
        })
        .collect();
    for (i, ring) in rings.iter().enumerate() {
        // SAFETY: the iovecs cover the arena's mapping, which the
        // `ArenaMap`'s allocator keeps alive for as long as the
        // `UringFile` holds the rings (the rings drop first).
        if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
            for r in &rings[..i] {
                let _ = r.submitter().unregister_buffers();
            }
            let mut why = format!(
                "plain buffers instead of fixed: registering the arena ({} bytes in {} \
                 buffers) on ring {i} failed: {e}",
                a.len,
                iovecs.len()
            );
            if e.raw_os_error() == Some(libc::ENOMEM) {
                let mut rl = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: getrlimit writes one `rlimit` to the pointer.
                if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0 {
                    why.push_str(&format!(
                        " (RLIMIT_MEMLOCK is {} bytes and each ring pins the whole arena; \
                         raise `ulimit -l` or grant CAP_IPC_LOCK)",
                        rl.rlim_cur
                    ));
                }
            }
            return Err(why);
        }
    }
    Ok(())
}
