//! Backends: where the crypt target's ciphertext lives.
//!
//! Owns: the [`Backend`] contract (positional reads and writes of whole
//! buffers, flush, a write made durable by itself — FUA — which flushes
//! everything by default; hole punches, discards and the allocation map as
//! [`Extent`]s, refused by default) and two RAM disks: [`RamDisk`], which copies what it is
//! given as the kernel's `brd` does, and [`PageStore`], which keeps the
//! very pages a write hands it and gives back the pages they replace (no
//! copy: the crypt target's out pages become the disk's pages); and
//! [`Window`], a byte range of another backend (a LUKS volume's payload
//! after its header, as dm-crypt's table starts at the payload offset).
//! Must never: accept a short read or write silently — an I/O either moves
//! every byte or returns an error, and an out-of-range request is refused
//! before anything is touched; or reach a stored page's bytes through an
//! address: each stripe's pages are owned by a [`FolioBuffer`], which
//! hands out their bytes and moves pages in and out (this file has no
//! `unsafe`).

use crate::async_io::{declined, AsyncIo, Outcome, ReadInto, Segments, WriteEnd};
use iopages::{FolioBuffer, Gfp, PageAllocator, PageSlots, PAGE_SIZE};
use parking_lot::RwLock;
use std::io;
use std::sync::Arc;

/// A block device the crypt target can sit on.
pub trait Backend: Send + Sync {
    /// Bytes the device holds.
    fn size_bytes(&self) -> u64;

    /// Write `segments` back to back starting at byte `offset`.
    ///
    /// **Context:** may block. **Returns:** an error (and possibly a
    /// partial write, as any device may leave) if any byte could not be
    /// written; `InvalidInput` before touching anything if the range
    /// leaves the device.
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()>;

    /// Fill `segments` back to back from byte `offset`.
    ///
    /// **Context:** may block. **Returns:** an error if any byte could not
    /// be read; `InvalidInput` if the range leaves the device.
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()>;

    /// Make completed writes durable.
    fn flush(&self) -> io::Result<()>;

    /// Write `segments` at `offset` as [`Backend::write_at`] does, durable
    /// when this returns (a block layer's REQ_FUA, NBD_CMD_FLAG_FUA).
    ///
    /// **Context:** may block. **Returns:** as [`Backend::write_at`], or
    /// the flush's error. The default writes, then flushes the whole
    /// backend; a backend that can make one write durable by itself (see
    /// [`Backend::native_fua`]) overrides it.
    fn write_at_fua(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        self.write_at(offset, segments)?;
        self.flush()
    }

    /// Whether [`Backend::write_at_fua`] makes just that write durable
    /// (cheaper than a whole flush), so callers should pass FUA down per
    /// write rather than flush once after a request's writes.
    ///
    /// **Returns:** `false` by default (the default `write_at_fua` flushes
    /// everything).
    fn native_fua(&self) -> bool {
        false
    }

    /// The page store behind this backend, if it is one: the crypt target
    /// then hands it whole out pages instead of having them copied.
    fn page_store(&self) -> Option<&PageStore> {
        None
    }

    /// Whether this backend reads what it is given to write before it
    /// lets go of it (an authenticated volume's tag layer MACs each
    /// block; a buffered file, a RAM disk or a socket copies it): the
    /// target then encrypts into the caches rather than past them, so
    /// that the second pass finds the ciphertext there.
    ///
    /// **Returns:** `false` by default.
    fn reads_writes(&self) -> bool {
        false
    }

    /// `len` bytes at `offset` readable in place (a file's mapped page
    /// cache), if this backend can offer them: the crypt target then
    /// decrypts straight from them instead of reading a copy first.
    /// `None` (default): read with [`Backend::read_at`].
    fn mapped(&self, _offset: u64, _len: usize) -> Option<&[u8]> {
        None
    }

    /// Deallocate `len` bytes at `offset`: they read back as zeros
    /// afterwards (a hole punched in a file, a RAM disk's bytes zeroed).
    ///
    /// **Context:** may block. **Returns:** `InvalidInput` before touching
    /// anything if the range leaves the device; `Unsupported` where the
    /// backend cannot guarantee zeros (the default, after the range check);
    /// `PermissionDenied` on a read-only backend.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes())?;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("this backend cannot punch holes ({len} bytes at offset {offset})"),
        ))
    }

    /// Whether [`Backend::punch`] can work on this backend at all (it may
    /// still fail fast for a given range, as a block device that cannot
    /// guarantee zeros does).
    ///
    /// **Returns:** `false` by default.
    fn can_punch(&self) -> bool {
        false
    }

    /// Discard `len` bytes at `offset`: afterwards they read as zeros or as
    /// what they held (a block device's discard guarantees neither).
    ///
    /// **Context:** may block. **Returns:** as [`Backend::punch`], which the
    /// default calls.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.punch(offset, len)
    }

    /// Reads and writes started without waiting ([`AsyncIo`]), where the
    /// backend has them (a remote store). The default: none.
    fn async_io(&self) -> Option<&dyn AsyncIo> {
        None
    }

    /// The allocation of the bytes from `offset`: consecutive extents, the
    /// first starting at `offset`, adjacent ones differing in
    /// [`Extent::hole`], at most `max_extents` of them (0 is taken as 1),
    /// covering at most `len` bytes (fewer when `max_extents` is reached).
    ///
    /// **Context:** may block. **Returns:** at least one extent when
    /// `len > 0`, none when it is 0; `InvalidInput` if the range leaves the
    /// device. The default: one allocated extent of `len` bytes.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        let _ = max_extents;
        check_range(offset, len, self.size_bytes())?;
        let mut out = Vec::new();
        push_extent(&mut out, len, false);
        Ok(out)
    }
}

/// A run of a backend's bytes: allocated, or a hole (reads as zeros,
/// stores nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Bytes in the run.
    pub len_bytes: u64,
    /// Whether the run is a hole.
    pub hole: bool,
}

/// Append `len_bytes` of kind `hole` to `out`, merged into the last extent
/// when it is of the same kind (nothing for zero bytes).
///
/// **Returns:** nothing; `out` keeps adjacent extents of different kinds.
pub fn push_extent(out: &mut Vec<Extent>, len_bytes: u64, hole: bool) {
    if len_bytes == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.hole == hole => last.len_bytes += len_bytes,
        _ => out.push(Extent { len_bytes, hole }),
    }
}

/// Check that `len` bytes at `offset` lie inside a device of `size` bytes.
pub fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O of {len} bytes at offset {offset} leaves the device ({size} bytes)"),
        )),
    }
}

/// Check that segments of `lens` bytes, back to back from `offset`, lie
/// inside a device of `size` bytes; returns their total length.
fn check_segments(offset: u64, lens: impl Iterator<Item = usize>, size: u64) -> io::Result<usize> {
    let total: usize = lens.sum();
    check_range(offset, total as u64, size)?;
    Ok(total)
}

/// Bytes per lock stripe of the RAM disk.
pub const RAMDISK_STRIPE_BYTES: usize = 64 << 10;

/// A RAM disk: memory split into 64 KiB stripes, each behind its own
/// reader-writer lock, so I/Os to different stripes run in parallel and
/// overlapping ones are serialised (never torn within a stripe).
pub struct RamDisk {
    stripes: Box<[RwLock<Box<[u8]>>]>,
    size_bytes: u64,
}

impl RamDisk {
    /// A zero-filled RAM disk of `size_bytes` (a multiple of 4096).
    ///
    /// **Returns:** `InvalidInput` for a zero or unaligned size.
    pub fn new(size_bytes: u64) -> io::Result<RamDisk> {
        if size_bytes == 0 || !size_bytes.is_multiple_of(4096) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("RAM disk size {size_bytes} must be a non-zero multiple of 4096 bytes"),
            ));
        }
        let n = (size_bytes as usize).div_ceil(RAMDISK_STRIPE_BYTES);
        let stripes = (0..n)
            .map(|i| {
                let len =
                    (size_bytes as usize - i * RAMDISK_STRIPE_BYTES).min(RAMDISK_STRIPE_BYTES);
                RwLock::new(vec![0u8; len].into_boxed_slice())
            })
            .collect();
        Ok(RamDisk {
            stripes,
            size_bytes,
        })
    }

    /// Visit the stripes covering `len` bytes at `offset`, in order, with
    /// (stripe index, offset inside the stripe, bytes in this stripe).
    fn spans(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let mut pos = offset as usize;
        let end = pos + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let (i, off) = (pos / RAMDISK_STRIPE_BYTES, pos % RAMDISK_STRIPE_BYTES);
            let n = (RAMDISK_STRIPE_BYTES - off).min(end - pos);
            pos += n;
            Some((i, off, n))
        })
    }
}

impl Backend for RamDisk {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.size_bytes)?;
        let mut at = offset;
        for seg in segments {
            let mut done = 0;
            for (i, off, n) in Self::spans(at, seg.len()) {
                self.stripes[i].write()[off..off + n].copy_from_slice(&seg[done..done + n]);
                done += n;
            }
            at += seg.len() as u64;
        }
        Ok(())
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.size_bytes)?;
        let mut at = offset;
        for seg in segments.iter_mut() {
            let mut done = 0;
            let len = seg.len();
            for (i, off, n) in Self::spans(at, len) {
                seg[done..done + n].copy_from_slice(&self.stripes[i].read()[off..off + n]);
                done += n;
            }
            at += len as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    /// Zero the bytes (a RAM disk has nothing to deallocate).
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes)?;
        for (i, off, n) in Self::spans(offset, len as usize) {
            self.stripes[i].write()[off..off + n].fill(0);
        }
        Ok(())
    }

    fn can_punch(&self) -> bool {
        true
    }

    /// A write is copied into the disk's memory: the ciphertext is read
    /// right after it is made.
    fn reads_writes(&self) -> bool {
        true
    }
}

/// One stripe of the page store: its blocks' pages (an empty slot: a block
/// never written, which reads as zeros).
type Stripe = RwLock<PageSlots>;

/// A folio move the page store checked beforehand failed anyway.
fn move_error(e: iopages::Error) -> io::Error {
    io::Error::other(format!("page store: {e}"))
}

/// Pages per lock stripe of the page store (64 KiB, as the RAM disk).
const STORE_STRIPE_PAGES: usize = RAMDISK_STRIPE_BYTES / PAGE_SIZE;

/// A RAM disk that stores pages of an iopages arena, one per 4 KiB block.
///
/// A page-aligned write of whole pages can hand its pages over
/// ([`PageStore::store_pages`]): they are swapped into the block slots and
/// the pages they replace come back to the writer, so encrypting into
/// fresh out pages and storing them costs no copy. Other writes copy into
/// the stored pages (allocating zeroed pages for blocks never written).
/// Blocks never written read as zeros. Slots sit in 64 KiB stripes, each
/// behind its own reader-writer lock.
pub struct PageStore {
    alloc: PageAllocator,
    stripes: Box<[Stripe]>,
    size_bytes: u64,
}

impl PageStore {
    /// An empty page store of `size_bytes` (a non-zero multiple of 4096)
    /// whose pages come from and go back to `alloc`.
    ///
    /// **Returns:** `InvalidInput` for a zero or unaligned size.
    pub fn new(alloc: &PageAllocator, size_bytes: u64) -> io::Result<PageStore> {
        if size_bytes == 0 || !size_bytes.is_multiple_of(PAGE_SIZE as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("page store size {size_bytes} must be a non-zero multiple of 4096 bytes"),
            ));
        }
        let nr = (size_bytes / PAGE_SIZE as u64) as usize;
        let stripes = (0..nr.div_ceil(STORE_STRIPE_PAGES))
            .map(|i| {
                let len = (nr - i * STORE_STRIPE_PAGES).min(STORE_STRIPE_PAGES);
                RwLock::new(PageSlots::new(alloc, len))
            })
            .collect();
        Ok(PageStore {
            alloc: alloc.clone(),
            stripes,
            size_bytes,
        })
    }

    /// The allocator the stored pages belong to.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// Blocks that hold a page (have been written).
    pub fn stored_pages(&self) -> usize {
        self.stripes.iter().map(|s| s.read().filled()).sum()
    }

    /// Take the pages of `pages` as the blocks starting at byte `offset`,
    /// moving them out of it (it is left empty); the pages they replace
    /// move into `replaced` (blocks never written replace nothing).
    ///
    /// **Context:** never blocks on memory. **Returns:** `InvalidInput`,
    /// with nothing moved, for an offset that is not page-aligned, a range
    /// that leaves the device, a buffer of another arena, or one that holds
    /// a compound folio (split it first).
    pub fn store_pages(
        &self,
        offset: u64,
        pages: &mut FolioBuffer,
        replaced: &mut FolioBuffer,
    ) -> io::Result<()> {
        let bad = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if !offset.is_multiple_of(PAGE_SIZE as u64) {
            return bad(format!("page store: offset {offset} is not page-aligned"));
        }
        let n = pages.folios().len();
        check_range(offset, (n * PAGE_SIZE) as u64, self.size_bytes)?;
        if !pages.allocator().same_allocator(&self.alloc)
            || !replaced.allocator().same_allocator(&self.alloc)
        {
            return bad("page store: pages of another arena".into());
        }
        if pages.folios().iter().any(|f| f.order() > 0) {
            return bad(
                "page store: compound folios are stored as single pages (split them)".into(),
            );
        }
        // Stripe by stripe from the last: each takes `pages`' last folios,
        // and gives its replaced pages back reversed, so that the whole
        // write's are in reverse block order and one reversal at the end
        // puts them in block order.
        let replaced_from = replaced.folios().len();
        let first = (offset / PAGE_SIZE as u64) as usize;
        let mut block = first + n;
        while block > first {
            let i = (block - 1) / STORE_STRIPE_PAGES;
            let low = (i * STORE_STRIPE_PAGES).max(first);
            let chunk = replaced.folios().len();
            self.stripes[i]
                .write()
                .store_last(low % STORE_STRIPE_PAGES, block - low, pages, replaced)
                .map_err(move_error)?;
            replaced.reverse_from(chunk);
            block = low;
        }
        // The replaced pages in block order again: they go back to the
        // allocator's LIFO lists in that order, and the next write's out
        // pages come out as runs of adjacent frames, encrypted in one call
        // each (block order reversed here cost E2's bulk pipeline a third).
        replaced.reverse_from(replaced_from);
        Ok(())
    }

    /// Visit the blocks covering `len` bytes at `offset` with (stripe,
    /// slot in the stripe, byte offset in the block, bytes).
    fn blocks(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        let mut pos = offset as usize;
        let end = pos + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let (block, off) = (pos / PAGE_SIZE, pos % PAGE_SIZE);
            let n = (PAGE_SIZE - off).min(end - pos);
            pos += n;
            Some((
                block / STORE_STRIPE_PAGES,
                block % STORE_STRIPE_PAGES,
                off,
                n,
            ))
        })
    }
}

impl Backend for PageStore {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let total = check_segments(offset, segments.iter().map(|s| s.len()), self.size_bytes)?;
        // Pages for the blocks never written, allocated before anything is
        // touched so that running out of memory writes nothing.
        let missing = Self::blocks(offset, total)
            .filter(|&(i, at, _, _)| !self.stripes[i].read().is_filled(at))
            .count();
        let mut spare = FolioBuffer::with_capacity(&self.alloc, missing);
        for _ in 0..missing {
            if !spare.push_alloc(Gfp::NOIO | Gfp::ZERO, 0) {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("page store: no memory for {missing} new blocks at offset {offset}"),
                ));
            }
        }
        let mut at = offset;
        for seg in segments {
            let mut done = 0;
            for (i, slot, off, n) in Self::blocks(at, seg.len()) {
                let mut stripe = self.stripes[i].write();
                if !stripe.is_filled(slot) {
                    // Another writer may have filled a counted block
                    // first; then allocate (rare) or use a spare.
                    if spare.folios().is_empty() {
                        let got = spare.push_alloc(Gfp::NOIO | Gfp::ZERO | Gfp::NOFAIL, 0);
                        assert!(got, "a NOFAIL allocation never fails");
                    }
                    let filled = stripe.fill_from(slot, &mut spare).map_err(move_error)?;
                    assert!(filled, "a spare page");
                }
                // The stripe's write lock excludes every other access.
                let page = stripe.page_bytes_mut(slot).expect("filled above");
                page[off..off + n].copy_from_slice(&seg[done..done + n]);
                done += n;
            }
            at += seg.len() as u64;
        }
        Ok(())
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.size_bytes)?;
        let mut at = offset;
        for seg in segments.iter_mut() {
            let mut done = 0;
            let len = seg.len();
            for (i, slot, off, n) in Self::blocks(at, len) {
                // The read lock keeps writers out while the page is copied.
                let stripe = self.stripes[i].read();
                let dst = &mut seg[done..done + n];
                match stripe.page_bytes(slot) {
                    None => dst.fill(0),
                    Some(page) => dst.copy_from_slice(&page[off..off + n]),
                }
                done += n;
            }
            at += len as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn page_store(&self) -> Option<&PageStore> {
        Some(self)
    }

    /// Zero the bytes. A block wholly inside the range is zeroed in its
    /// page rather than emptied: [`PageSlots`] offers no way to take a
    /// page out of a slot, so a punched block keeps its page (and counts
    /// as allocated in [`Backend::extents`]) until a later write replaces
    /// it.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes)?;
        // Whole blocks give their pages back (the slot is empty again: a
        // hole in `extents`); a partial head or tail block is zeroed in
        // place. The pages are freed after the stripe locks are dropped.
        let mut freed = FolioBuffer::new(&self.alloc);
        for (i, slot, off, n) in Self::blocks(offset, len as usize) {
            let mut stripe = self.stripes[i].write();
            if n == PAGE_SIZE {
                stripe.take(slot, &mut freed).map_err(move_error)?;
            } else if let Some(page) = stripe.page_bytes_mut(slot) {
                // An empty slot already reads as zeros.
                page[off..off + n].fill(0);
            }
        }
        drop(freed);
        Ok(())
    }

    fn can_punch(&self) -> bool {
        true
    }

    /// Holes are the blocks never written (empty slots), 4096 bytes each,
    /// clipped to the range asked for.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        check_range(offset, len, self.size_bytes)?;
        let max = max_extents.max(1);
        let mut out: Vec<Extent> = Vec::new();
        let mut stripe: Option<(usize, parking_lot::RwLockReadGuard<'_, PageSlots>)> = None;
        for (i, slot, _, n) in Self::blocks(offset, len as usize) {
            if stripe.as_ref().is_none_or(|(at, _)| *at != i) {
                stripe = Some((i, self.stripes[i].read()));
            }
            let hole = !stripe.as_ref().expect("locked above").1.is_filled(slot);
            if out.last().is_some_and(|e| e.hole != hole) && out.len() == max {
                break;
            }
            push_extent(&mut out, n as u64, hole);
        }
        Ok(out)
    }
}

/// A window of `len` bytes at `start` of another backend: offset 0 here
/// is byte `start` there, and nothing outside the window can be reached
/// (a LUKS payload behind its header).
pub struct Window {
    inner: std::sync::Arc<dyn Backend>,
    start: u64,
    len: u64,
}

impl Window {
    /// The window `start..start + len` of `inner`.
    ///
    /// **Returns:** `InvalidInput` if the window is empty or leaves
    /// `inner`.
    pub fn new(inner: std::sync::Arc<dyn Backend>, start: u64, len: u64) -> io::Result<Window> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "an empty window at byte {start} of a {}-byte device",
                    inner.size_bytes()
                ),
            ));
        }
        check_range(start, len, inner.size_bytes())?;
        Ok(Window { inner, start, len })
    }

    /// Where the window starts in the backend below.
    pub fn start(&self) -> u64 {
        self.start
    }
}

impl Backend for Window {
    fn size_bytes(&self) -> u64 {
        self.len
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.len)?;
        self.inner.write_at(self.start + offset, segments)
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.len)?;
        self.inner.read_at(self.start + offset, segments)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn write_at_fua(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        check_segments(offset, segments.iter().map(|s| s.len()), self.len)?;
        self.inner.write_at_fua(self.start + offset, segments)
    }

    fn native_fua(&self) -> bool {
        self.inner.native_fua()
    }

    fn mapped(&self, offset: u64, len: usize) -> Option<&[u8]> {
        check_range(offset, len as u64, self.len).ok()?;
        self.inner.mapped(self.start + offset, len)
    }

    fn reads_writes(&self) -> bool {
        self.inner.reads_writes()
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.len)?;
        self.inner.punch(self.start + offset, len)
    }

    fn can_punch(&self) -> bool {
        self.inner.can_punch()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.len)?;
        self.inner.discard(self.start + offset, len)
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        check_range(offset, len, self.len)?;
        self.inner.extents(self.start + offset, len, max_extents)
    }

    fn async_io(&self) -> Option<&dyn AsyncIo> {
        self.inner.async_io().map(|_| self as &dyn AsyncIo)
    }
}

/// The window's starts, shifted: a request leaving the window is declined
/// (the blocking path then refuses it with its error).
impl AsyncIo for Window {
    fn start_write(&self, offset: u64, data: Arc<dyn Segments>, fua: bool, end: WriteEnd) {
        match self.inner.async_io() {
            Some(a) if check_range(offset, data.len() as u64, self.len).is_ok() => {
                a.start_write(self.start + offset, data, fua, end)
            }
            _ => end(Outcome::Again(declined("outside the window"))),
        }
    }

    fn start_read(&self, offset: u64, mut into: Box<dyn ReadInto>) {
        let len = into.buf().len() as u64;
        match self.inner.async_io() {
            Some(a) if check_range(offset, len, self.len).is_ok() => {
                a.start_read(self.start + offset, into)
            }
            _ => into.end(Outcome::Again(declined("outside the window"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_shifts_offsets_and_keeps_inside() {
        let d: std::sync::Arc<dyn Backend> = std::sync::Arc::new(RamDisk::new(64 << 10).unwrap());
        assert!(Window::new(d.clone(), 4096, 0).is_err());
        assert!(Window::new(d.clone(), 60 << 10, 8 << 10).is_err());
        let w = Window::new(d.clone(), 4096, 16 << 10).unwrap();
        assert_eq!(w.size_bytes(), 16 << 10);
        w.write_at(512, &[&[7u8; 1024]]).unwrap();
        let mut below = vec![0u8; 2048];
        d.read_at(4096, &mut [&mut below]).unwrap();
        assert!(below[..512].iter().all(|&b| b == 0));
        assert!(below[512..1536].iter().all(|&b| b == 7));
        assert!(below[1536..].iter().all(|&b| b == 0));
        let e = w.write_at((16 << 10) - 512, &[&[1u8; 1024]]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let mut after = vec![9u8; 1024];
        d.read_at(4096 + (16 << 10) - 512, &mut [&mut after])
            .unwrap();
        assert!(
            after.iter().all(|&b| b == 0),
            "a refused write touched the device"
        );
        let mut back = vec![0u8; 1024];
        w.read_at(512, &mut [&mut back]).unwrap();
        assert!(back.iter().all(|&b| b == 7));
        assert!(w.read_at(16 << 10, &mut [&mut back]).is_err());
        // A window copies what the device under it copies.
        assert!(d.reads_writes() && w.reads_writes());
    }

    #[test]
    fn writes_across_stripes_read_back() {
        let d = RamDisk::new(1 << 20).unwrap();
        let a: Vec<u8> = (0..70_000u32).map(|i| (i * 7) as u8).collect();
        let b = vec![0xabu8; 5000];
        let off = RAMDISK_STRIPE_BYTES as u64 - 1000;
        d.write_at(off, &[&a, &b]).unwrap();
        let mut x = vec![0u8; a.len()];
        let mut y = vec![0u8; b.len()];
        d.read_at(off, &mut [&mut x, &mut y]).unwrap();
        assert_eq!((x, y), (a, b));
    }

    #[test]
    fn out_of_range_and_bad_sizes_are_errors_and_touch_nothing() {
        assert!(RamDisk::new(0).is_err());
        assert!(RamDisk::new(4097).is_err());
        let d = RamDisk::new(8192).unwrap();
        let e = d.write_at(4096, &[&[1u8; 4097]]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("leaves the device"), "{e}");
        let mut back = [9u8; 8192];
        d.read_at(0, &mut [&mut back]).unwrap();
        assert!(
            back.iter().all(|&b| b == 0),
            "a refused write must not write anything"
        );
        assert!(d.read_at(u64::MAX, &mut [&mut [0u8; 1]]).is_err());
    }

    fn arena() -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(8 << 20)
            .huge_pages(iopages::HugePages::Never)
            .build()
            .unwrap()
    }

    #[test]
    fn the_page_store_keeps_handed_pages_and_gives_back_the_replaced_ones() {
        let alloc = arena();
        let store = PageStore::new(&alloc, 1 << 20).unwrap();
        // Handed pages are kept, never read: ciphertext goes past the caches.
        assert!(!store.reads_writes());
        let mut zeros = vec![1u8; 8192];
        store.read_at(4096, &mut [&mut zeros]).unwrap();
        assert!(
            zeros.iter().all(|&b| b == 0),
            "unwritten blocks read as zeros"
        );
        let mut pages = FolioBuffer::new(&alloc);
        for i in 0..20 {
            assert!(pages.push_alloc(Gfp::KERNEL, 0));
            pages.folio_bytes_mut(i).fill(i as u8 + 1);
        }
        let all = pages.pages();
        let mut second = pages.split_off(10);
        let mut replaced = FolioBuffer::new(&alloc);
        store
            .store_pages(60 << 10, &mut pages, &mut replaced)
            .unwrap();
        assert!(replaced.folios().is_empty() && pages.folios().is_empty());
        // An unaligned offset is refused with nothing stored or moved.
        let e = store
            .store_pages((80 << 10) + 512, &mut second, &mut replaced)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(second.folios().len(), 10);
        // Overlap the second half: five of the first ten come back, in
        // block order (the order the allocator's lists get them back in,
        // so the next write's pages are adjacent runs again).
        store
            .store_pages(80 << 10, &mut second, &mut replaced)
            .unwrap();
        assert!(second.folios().is_empty());
        assert_eq!(replaced.pages(), all[5..10].to_vec());
        let mut back = vec![0u8; 15 * PAGE_SIZE];
        store.read_at(60 << 10, &mut [&mut back]).unwrap();
        for (i, chunk) in back.chunks(PAGE_SIZE).enumerate() {
            let want = if i < 5 { i + 1 } else { i + 6 } as u8;
            assert!(chunk.iter().all(|&b| b == want), "block {i}");
        }
        drop(replaced);
        assert_eq!(store.stored_pages(), 15);
        copied_writes_land_and_refused_pages_stay_put(&alloc, &store);
        drop(store);
        alloc.leak_check().unwrap();
    }

    /// A copied, unaligned write lands in the stored pages and in new
    /// zeroed pages for blocks never written; pages past the end, a
    /// compound folio, or another arena's page are refused, nothing moved.
    fn copied_writes_land_and_refused_pages_stay_put(alloc: &PageAllocator, store: &PageStore) {
        let data = vec![0xeeu8; 6000];
        store.write_at((200 << 10) - 1000, &[&data]).unwrap();
        let mut back = vec![0u8; 8192];
        store.read_at((200 << 10) - 4096, &mut [&mut back]).unwrap();
        assert!(back[..3096].iter().all(|&b| b == 0));
        assert!(back[3096..].iter().all(|&b| b == 0xee));
        assert!(store.write_at(1 << 20, &[&[0u8; 512]]).is_err());
        // Past the end, a compound folio, or another arena's page: refused,
        // nothing moved.
        let mut replaced = FolioBuffer::new(alloc);
        let mut one = FolioBuffer::new(alloc);
        assert!(one.push_alloc(Gfp::KERNEL, 0));
        assert!(store.store_pages(1 << 20, &mut one, &mut replaced).is_err());
        let mut big = FolioBuffer::new(alloc);
        assert!(big.push_alloc(Gfp::KERNEL, 1));
        let e = store.store_pages(0, &mut big, &mut replaced).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let other = arena();
        let mut foreign = FolioBuffer::new(&other);
        assert!(foreign.push_alloc(Gfp::KERNEL, 0));
        let e = store
            .store_pages(0, &mut foreign, &mut replaced)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            (
                one.folios().len(),
                big.folios().len(),
                foreign.folios().len()
            ),
            (1, 1, 1)
        );
        assert!(replaced.folios().is_empty());
        drop((one, big, foreign, replaced));
        other.leak_check().unwrap();
    }
}
