//! Bios: the I/O vector of one request, in multi-page segments, built
//! folio by folio.
//!
//! Owns: [`Bio`] — segments of (first frame, offset, length) that may run
//! across physically contiguous frames, bounded in count and size; merging
//! a page or folio range into the previous segment when it continues it;
//! building a bio from a page array folio by folio, pinning each folio
//! once for all the pages it covers (seed 002), with the page-by-page
//! builder kept as the baseline; releasing the pins folio by folio; and
//! the segments as slices borrowed from the [`crate::FolioBuffer`] that
//! owns their memory (for `readv`/`writev` and the backends), checked to
//! lie inside it. Must never: cover a byte twice or skip one, exceed its
//! limits (an add that would is refused and changes nothing), leave pins
//! behind on an error, or turn a segment into a slice of memory the
//! buffer it is given does not own (this file has no `unsafe`: the buffer
//! makes the slices).
//!
//! The folio-aware builder trusts the page array to list each folio's
//! frames in order, as an address range's frames are (what
//! [`crate::FolioBuffer::pages`] returns): it checks only the last frame
//! of each run it skips (all of them with the allocator's checks on) and
//! falls back to one page when that check fails.

use crate::{FolioBuffer, Page, PageAllocator, PAGE_SIZE};
use std::io::{IoSlice, IoSliceMut};

/// One segment: `len` bytes from `offset` bytes into frame `page`,
/// continuing into the frames after it when longer than the rest of that
/// frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioVec {
    /// First frame.
    pub page: Page,
    /// Byte offset into the first frame (below 4096).
    pub offset: u32,
    /// Bytes.
    pub len: u32,
}

impl BioVec {
    /// Byte position of the segment's start in the arena.
    #[inline]
    fn start(&self) -> usize {
        self.page.pfn() as usize * PAGE_SIZE + self.offset as usize
    }

    /// Frames the segment touches.
    pub fn nr_pages(&self) -> usize {
        (self.offset as usize + self.len as usize).div_ceil(PAGE_SIZE)
    }
}

/// A bio's bounds (the block layer's `max_segments` and
/// `max_segment_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioLimits {
    /// Most segments (default 256, the kernel's `BIO_MAX_VECS`).
    pub max_segments: usize,
    /// Most bytes in one segment (default 64 KiB, the block layer's
    /// default `max_segment_size`).
    pub max_segment_bytes: usize,
}

impl Default for BioLimits {
    fn default() -> Self {
        BioLimits {
            max_segments: 256,
            max_segment_bytes: 64 << 10,
        }
    }
}

/// Why a bio could not take a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BioError {
    /// The range needs more segments than the limit allows.
    #[error("the bio is full: {max_segments} segments of at most {max_segment_bytes} bytes")]
    Full {
        /// The segment limit.
        max_segments: usize,
        /// The segment size limit.
        max_segment_bytes: usize,
    },
    /// The range does not fit what it was taken from.
    #[error("{what}: {offset} + {len} bytes exceeds {limit} bytes")]
    OutOfRange {
        /// Which range.
        what: &'static str,
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The size it must fit in.
        limit: usize,
    },
    /// A segment is not memory of the buffer its bytes were asked from.
    #[error("segment {index} (arena byte {start}, {len} bytes): {why}")]
    NotInBuffer {
        /// The segment's index.
        index: usize,
        /// Its first byte, counted from the arena's start.
        start: usize,
        /// Its length.
        len: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The limits themselves are unusable.
    #[error("bio limits need at least one segment of at least one page, got {0:?}")]
    BadLimits(BioLimits),
}

/// The I/O vector of one request.
#[derive(Debug)]
pub struct Bio {
    segs: Vec<BioVec>,
    len: usize,
    limits: BioLimits,
    /// Pins were taken for the segments (by a `from_pages` builder) and
    /// are owed back by `release`.
    pinned: bool,
}

impl Bio {
    /// An empty bio.
    ///
    /// **Returns:** [`BioError::BadLimits`] for no segments or segments
    /// smaller than a page.
    pub fn new(limits: BioLimits) -> Result<Bio, BioError> {
        if limits.max_segments == 0 || limits.max_segment_bytes < PAGE_SIZE {
            return Err(BioError::BadLimits(limits));
        }
        Ok(Bio {
            segs: Vec::with_capacity(limits.max_segments.min(16)),
            len: 0,
            limits,
            pinned: false,
        })
    }

    /// Bytes covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bio covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[BioVec] {
        &self.segs
    }

    /// The limits.
    pub fn limits(&self) -> BioLimits {
        self.limits
    }

    /// Whether the bio holds pins that [`Bio::release`] gives back.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    fn full(&self) -> BioError {
        BioError::Full {
            max_segments: self.limits.max_segments,
            max_segment_bytes: self.limits.max_segment_bytes,
        }
    }

    /// Segments needed to add `len` bytes at arena byte `start`.
    fn segments_needed(&self, start: usize, len: usize) -> usize {
        let max = self.limits.max_segment_bytes;
        let mut room = 0;
        if let Some(last) = self.segs.last() {
            if last.start() + last.len as usize == start {
                room = max - last.len as usize;
            }
        }
        len.saturating_sub(room).div_ceil(max)
    }

    /// Append `len` bytes starting at arena byte `start`, merging with the
    /// last segment when it ends where this starts; nothing changes if the
    /// segments would run out.
    fn push(&mut self, start: usize, len: usize) -> Result<(), BioError> {
        if len == 0 {
            return Ok(());
        }
        if self.segs.len() + self.segments_needed(start, len) > self.limits.max_segments {
            return Err(self.full());
        }
        let max = self.limits.max_segment_bytes;
        let (mut start, mut left) = (start, len);
        if let Some(last) = self.segs.last_mut() {
            if last.start() + last.len as usize == start {
                let n = (max - last.len as usize).min(left);
                last.len += n as u32;
                start += n;
                left -= n;
            }
        }
        while left > 0 {
            let n = max.min(left);
            self.segs.push(BioVec {
                page: Page::from_pfn((start / PAGE_SIZE) as u32),
                offset: (start % PAGE_SIZE) as u32,
                len: n as u32,
            });
            start += n;
            left -= n;
        }
        self.len += len;
        Ok(())
    }

    /// Add `len` bytes of `page` from `offset`, merged into the last
    /// segment when physically contiguous with it.
    ///
    /// **Returns:** [`BioError::OutOfRange`] past the page's end,
    /// [`BioError::Full`] when no segment is left (the bio unchanged).
    pub fn add_page(&mut self, page: Page, offset: usize, len: usize) -> Result<(), BioError> {
        if !offset.checked_add(len).is_some_and(|end| end <= PAGE_SIZE) {
            return Err(BioError::OutOfRange {
                what: "add_page",
                offset,
                len,
                limit: PAGE_SIZE,
            });
        }
        self.push(page.pfn() as usize * PAGE_SIZE + offset, len)
    }

    /// Add `len` bytes of `folio` from byte `offset` in one step.
    ///
    /// **Returns:** as [`Bio::add_page`], against the folio's size.
    pub fn add_folio(
        &mut self,
        folio: crate::Folio,
        offset: usize,
        len: usize,
    ) -> Result<(), BioError> {
        if !offset
            .checked_add(len)
            .is_some_and(|end| end <= folio.size_bytes())
        {
            return Err(BioError::OutOfRange {
                what: "add_folio",
                offset,
                len,
                limit: folio.size_bytes(),
            });
        }
        self.push(folio.page().pfn() as usize * PAGE_SIZE + offset, len)
    }

    /// An empty bio that will hold pins, for a range checked against the
    /// page array.
    fn pinned_for(
        pages: &[Page],
        offset: usize,
        len: usize,
        limits: BioLimits,
    ) -> Result<Bio, BioError> {
        Self::check_range(pages, offset, len)?;
        let mut bio = Bio::new(limits)?;
        bio.pinned = true;
        Ok(bio)
    }

    /// The pages a bio of `len` bytes at `offset` of `pages` covers must be
    /// frames of `alloc`'s arena (a page outside it is refused: pinning it
    /// would touch no frame of this arena) and, with checks on, none may
    /// head a free block in the zone (a use after free; it panics, naming
    /// the frame). A freed page still in a per-CPU list or thread cache
    /// carries no mark a check could read, so the precondition stays the
    /// caller's (see `from_pages`).
    fn check_pages(
        alloc: &PageAllocator,
        pages: &[Page],
        offset: usize,
        len: usize,
    ) -> Result<(), BioError> {
        let (first, end) = (offset / PAGE_SIZE, (offset + len).div_ceil(PAGE_SIZE));
        let checks = alloc.checks_enabled();
        for (i, &p) in pages[first..end].iter().enumerate() {
            let Some(info) = alloc.frame_info(p) else {
                return Err(BioError::OutOfRange {
                    what: "page frame number",
                    offset: p.pfn() as usize,
                    len: 1,
                    limit: alloc.arena().nr_pages(),
                });
            };
            if checks {
                assert!(
                    info.flags & crate::flags::BUDDY == 0,
                    "bio: page {} of the range (pfn {}) is free",
                    first + i,
                    p.pfn()
                );
            }
        }
        Ok(())
    }

    fn check_range(pages: &[Page], offset: usize, len: usize) -> Result<(), BioError> {
        let limit = pages.len() * PAGE_SIZE;
        if !offset.checked_add(len).is_some_and(|end| end <= limit) {
            return Err(BioError::OutOfRange {
                what: "page array",
                offset,
                len,
                limit,
            });
        }
        Ok(())
    }

    /// Build a bio for `len` bytes from byte `offset` of the memory the
    /// page array `pages` lists, folio by folio: each folio's part of the
    /// range is added in one step and its pins taken with one atomic add
    /// (one pin per page covered); the array's other pages of that folio
    /// are skipped, not visited.
    ///
    /// The pages must be allocated pages of `alloc`'s arena that stay
    /// allocated while the bio holds its pins: a page outside the arena is
    /// refused, and with checks on ([`crate::PageAllocatorBuilder::checks`])
    /// a page heading a free block of the zone panics.
    ///
    /// **Returns:** [`BioError::OutOfRange`] if the range leaves the
    /// array or a page of it is not a frame of the arena,
    /// [`BioError::Full`] if it needs more segments than `limits` allow —
    /// in every case with no pin left behind.
    pub fn from_pages(
        alloc: &PageAllocator,
        pages: &[Page],
        offset: usize,
        len: usize,
        limits: BioLimits,
    ) -> Result<Bio, BioError> {
        Self::check_range(pages, offset, len)?;
        Self::check_pages(alloc, pages, offset, len)?;
        let mut bio = Self::pinned_for(pages, offset, len, limits)?;
        let checks = alloc.checks_enabled();
        let (mut i, mut off, mut left) = (offset / PAGE_SIZE, offset % PAGE_SIZE, len);
        while left > 0 {
            let page = pages[i];
            let folio = alloc.page_folio(page);
            if folio.order() == 0 {
                // A single page: nothing to skip.
                let bytes = (PAGE_SIZE - off).min(left);
                if let Err(e) = bio.push(page.pfn() as usize * PAGE_SIZE + off, bytes) {
                    bio.release(alloc);
                    return Err(e);
                }
                alloc.pin_folio(folio, 1);
                i += 1;
                off = 0;
                left -= bytes;
                continue;
            }
            let idx = (page.pfn() - folio.page().pfn()) as usize;
            let run = (folio.nr_pages() - idx).min(pages.len() - i);
            let bytes = (run * PAGE_SIZE - off).min(left);
            let mut n = (off + bytes).div_ceil(PAGE_SIZE);
            let consecutive = |k: usize| pages[i + k].pfn() == page.pfn() + k as u32;
            let ok = if checks {
                (0..n).all(consecutive)
            } else {
                consecutive(n - 1)
            };
            let bytes = if ok {
                bytes
            } else {
                n = 1;
                (PAGE_SIZE - off).min(left)
            };
            if let Err(e) = bio.push(page.pfn() as usize * PAGE_SIZE + off, bytes) {
                bio.release(alloc);
                return Err(e);
            }
            alloc.pin_folio(folio, n as u32);
            i += n;
            off = 0;
            left -= bytes;
        }
        Ok(bio)
    }

    /// The page-by-page baseline of [`Bio::from_pages`]: every page of the
    /// range is added (and merged) and pinned on its own. Same segments,
    /// same pins.
    ///
    /// **Returns:** as [`Bio::from_pages`].
    pub fn from_pages_by_page(
        alloc: &PageAllocator,
        pages: &[Page],
        offset: usize,
        len: usize,
        limits: BioLimits,
    ) -> Result<Bio, BioError> {
        Self::check_range(pages, offset, len)?;
        Self::check_pages(alloc, pages, offset, len)?;
        let mut bio = Self::pinned_for(pages, offset, len, limits)?;
        let (mut i, mut off, mut left) = (offset / PAGE_SIZE, offset % PAGE_SIZE, len);
        while left > 0 {
            let n = (PAGE_SIZE - off).min(left);
            if let Err(e) = bio.add_page(pages[i], off, n) {
                bio.release_by_page(alloc);
                return Err(e);
            }
            alloc.pin_page(pages[i]);
            i += 1;
            off = 0;
            left -= n;
        }
        Ok(bio)
    }

    /// Give back the pins a `from_pages` builder took, folio by folio (one
    /// atomic subtract per folio a segment touches). A bio built with
    /// `add_page` / `add_folio` holds no pins; releasing it does nothing.
    pub fn release(mut self, alloc: &PageAllocator) {
        if !std::mem::take(&mut self.pinned) {
            return;
        }
        for (mut pfn, end) in self.pinned_ranges() {
            while pfn < end {
                let folio = alloc.page_folio(Page::from_pfn(pfn));
                let folio_end = folio.page().pfn() + folio.nr_pages() as u32;
                let n = folio_end.min(end) - pfn;
                alloc.unpin_folio(folio, n);
                pfn += n;
            }
        }
    }

    /// The page-by-page baseline of [`Bio::release`]: one unpin per page.
    pub fn release_by_page(mut self, alloc: &PageAllocator) {
        if !std::mem::take(&mut self.pinned) {
            return;
        }
        for (first, end) in self.pinned_ranges() {
            for pfn in first..end {
                alloc.unpin_page(Page::from_pfn(pfn));
            }
        }
    }

    /// The frames each segment pinned, as pfn ranges `[first, end)`. A page
    /// split between two segments (at a segment-size boundary) was pinned
    /// once: a segment's first page is left out when the segment before
    /// ended in it.
    fn pinned_ranges(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut last_page = None;
        self.segs.iter().map(move |s| {
            let end = s.page.pfn() + s.nr_pages() as u32;
            let first = s.page.pfn() + u32::from(last_page == Some(s.page.pfn()));
            last_page = Some(end - 1);
            (first, end)
        })
    }

    /// The segments as (address, length) in the arena's mapping — what an
    /// iovec array for io_uring holds. Only addresses: reaching the bytes
    /// takes [`Bio::slices`] / [`Bio::slices_mut`] and the buffer that owns
    /// them.
    pub fn iovecs<'a>(
        &'a self,
        alloc: &'a PageAllocator,
    ) -> impl Iterator<Item = (*mut u8, usize)> + 'a {
        self.segs.iter().map(move |s| {
            let p = alloc.page_address(s.page).wrapping_add(s.offset as usize);
            (p, s.len as usize)
        })
    }

    /// The segments as byte slices of `buf`, the buffer whose memory the
    /// bio was built over, in order: what `write_at` of a backend or
    /// `writev` takes. The slices borrow `buf`.
    ///
    /// **Returns:** [`BioError::NotInBuffer`] when a segment leaves the
    /// buffer's folios (a bio built over other memory).
    pub fn slices<'b>(&self, buf: &'b FolioBuffer) -> Result<Vec<&'b [u8]>, BioError> {
        let ranges = self.arena_ranges();
        buf.arena_slices(&ranges)
            .map_err(|k| self.outside(k, "not in the buffer's folios"))
    }

    /// The segments as writable byte slices of `buf`, in order: what
    /// `read_at` of a backend or `readv` fills. The slices borrow `buf`
    /// mutably, so nothing else touches those bytes while they live.
    ///
    /// **Returns:** [`BioError::NotInBuffer`] when a segment leaves the
    /// buffer's folios or overlaps another segment (one byte cannot be
    /// filled twice through two slices).
    pub fn slices_mut<'b>(&self, buf: &'b mut FolioBuffer) -> Result<Vec<&'b mut [u8]>, BioError> {
        let ranges = self.arena_ranges();
        buf.arena_slices_mut(&ranges).map_err(|k| {
            self.outside(
                k,
                "not in the buffer's folios, or overlapping another segment",
            )
        })
    }

    /// [`Bio::slices`] as [`IoSlice`]s, for `write_vectored` / `writev`.
    ///
    /// **Returns:** as [`Bio::slices`].
    pub fn io_slices<'b>(&self, buf: &'b FolioBuffer) -> Result<Vec<IoSlice<'b>>, BioError> {
        Ok(self.slices(buf)?.into_iter().map(IoSlice::new).collect())
    }

    /// [`Bio::slices_mut`] as [`IoSliceMut`]s, for `read_vectored` /
    /// `readv`.
    ///
    /// **Returns:** as [`Bio::slices_mut`].
    pub fn io_slices_mut<'b>(
        &self,
        buf: &'b mut FolioBuffer,
    ) -> Result<Vec<IoSliceMut<'b>>, BioError> {
        Ok(self
            .slices_mut(buf)?
            .into_iter()
            .map(IoSliceMut::new)
            .collect())
    }

    /// Each segment as (arena byte, length).
    fn arena_ranges(&self) -> Vec<(usize, usize)> {
        self.segs
            .iter()
            .map(|s| (s.start(), s.len as usize))
            .collect()
    }

    fn outside(&self, index: usize, why: &'static str) -> BioError {
        let s = self.segs[index];
        BioError::NotInBuffer {
            index,
            start: s.start(),
            len: s.len as usize,
            why,
        }
    }
}

impl Drop for Bio {
    fn drop(&mut self) {
        if self.pinned && !std::thread::panicking() {
            debug_assert!(
                false,
                "a bio holding pins was dropped without release(): its folios stay pinned"
            );
        }
    }
}
