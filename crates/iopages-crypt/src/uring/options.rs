//! How a [`UringFile`] is opened and what it counts:
//! the public options and the statistics.
//!
//! Owns: [`DirectIo`], [`UringOptions`] (fields, defaults and builder
//! methods) and [`UringStats`]. Must never: open, map or register
//! anything — `open.rs` acts on these options; this file only describes
//! them.

#[cfg(doc)]
use super::UringFile;
#[cfg(doc)]
use crate::backend::Backend;
use iopages::PageAllocator;
use std::fmt;

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
    /// leave on for a memfd sealed with `F_SEAL_SHRINK` or a file nothing
    /// else can open for writing — but a memfd's hole read through the
    /// mapping is filled (shmem allocates a page on the read fault, where
    /// `preadv` reads zeros and allocates nothing), so a sparse memfd
    /// (the served in-memory volume) is not mapped either.
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
