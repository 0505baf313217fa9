//! Folios: a compound allocation handled as one unit, its pins, and
//! application buffers made of folios.
//!
//! Owns: the [`Folio`] handle (head frame and order), finding a frame's
//! folio (a tail frame's owner word names its head), pin counts kept on the
//! head frame (one atomic add of N pins N pages, as the kernel's
//! `_pincount`), and [`FolioBuffer`]: N bytes as large folios, preferring a
//! configured size and falling back to smaller ones; the buffer is the
//! owner of its folios, so it alone hands out their bytes — per folio, per
//! physically contiguous run, or per arena range (what a bio's segments
//! name) — and it alone moves a folio to another buffer of the same arena.
//! Must never: free a pinned folio ([`PageAllocator::folio_put`] refuses
//! with [`Error::Pinned`]), let an unpin take more pins than were taken (it
//! panics, naming the frame), or hand out a view of bytes it does not own
//! or two views of the same bytes of which one is writable.
//!
//! Pins are valid for every allocated frame: they are zero whenever a
//! frame is free, and only this module changes them. The raw
//! [`PageAllocator::free_pages`] checks them too, except on the order-0
//! fast path with checks off, which never reads a frame — free folios with
//! `folio_put`.
//!
//! The `unsafe` here is all of one kind: turning folios the buffer owns
//! into slices of the arena's mapping. It rests on one invariant of
//! [`FolioBuffer`]: every folio in it lies inside the arena, is owned by
//! this buffer alone (allocated here, moved in from another buffer of the
//! same arena, or handed in through the `unsafe` [`FolioBuffer::push_raw`])
//! and appears once — so distinct folios never overlap, and a borrow of
//! the buffer is a borrow of their bytes.

use crate::{flags, Error, Gfp, Page, PageAllocator, Result, MAX_ORDER, PAGE_SIZE};
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};

/// A folio: 2^order contiguous frames allocated as one compound unit
/// (order 0: a single frame). Plain data, like [`Page`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Folio {
    head: Page,
    order: u32,
}

impl Folio {
    /// The head (first) frame.
    #[inline]
    pub fn page(self) -> Page {
        self.head
    }

    /// log2 of the frames in the folio.
    #[inline]
    pub fn order(self) -> u32 {
        self.order
    }

    /// Frames in the folio.
    #[inline]
    pub fn nr_pages(self) -> usize {
        1 << self.order
    }

    /// Bytes in the folio.
    #[inline]
    pub fn size_bytes(self) -> usize {
        PAGE_SIZE << self.order
    }

    /// The `i`-th frame (`i < nr_pages()`).
    #[inline]
    pub fn page_at(self, i: usize) -> Page {
        debug_assert!(i < self.nr_pages());
        Page::from_pfn(self.head.pfn() + i as u32)
    }

    /// Index of `page` in this folio, if it is one of its frames.
    #[inline]
    pub fn index_of(self, page: Page) -> Option<usize> {
        let i = page.pfn().wrapping_sub(self.head.pfn()) as usize;
        (i < self.nr_pages()).then_some(i)
    }
}

impl PageAllocator {
    /// Allocate a folio of 2^`order` frames (compound for order > 0).
    ///
    /// **Context / Returns:** as [`PageAllocator::alloc_pages`].
    pub fn folio_alloc(&self, gfp: Gfp, order: u32) -> Option<Folio> {
        let gfp = if order > 0 { gfp | Gfp::COMP } else { gfp };
        let head = self.alloc_pages(gfp, order)?;
        Some(Folio { head, order })
    }

    /// Free a folio from [`PageAllocator::folio_alloc`] (a raw-handle call:
    /// a [`FolioBuffer`] frees its folios safely).
    ///
    /// **Context:** never blocks. **Returns:** [`Error::Pinned`], with the
    /// folio kept allocated, if I/O still holds pins on it.
    ///
    /// # Safety
    /// As [`PageAllocator::free_pages`]: the caller owns the folio (a
    /// [`Folio`] is a `Copy` handle) and nothing else — a buffer, a box, a
    /// copy of the handle — uses it as its own once this returns `Ok`.
    pub unsafe fn folio_put(&self, folio: Folio) -> Result<()> {
        let pins = self.folio_pins(folio);
        if pins != 0 {
            return Err(Error::Pinned {
                pfn: folio.head.pfn(),
                pins,
            });
        }
        // SAFETY: the caller owns the folio (this fn's contract), which
        // `folio_alloc` allocated with this order.
        unsafe { self.free_pages(folio.head, folio.order) };
        Ok(())
    }

    /// The folio `page` belongs to: itself at order 0, or the compound
    /// page whose head a tail frame names.
    ///
    /// **Context:** never blocks; `page` must be allocated (a free frame's
    /// answer is meaningless, though never unsafe).
    #[inline]
    pub fn page_folio(&self, page: Page) -> Folio {
        let arena = self.arena();
        let f = arena.frame(page.pfn());
        let fl = f.flags();
        if fl & flags::TAIL != 0 {
            let head = Page::from_pfn(f.link_or_owner.load(Relaxed));
            let order = arena.frame(head.pfn()).order();
            Folio { head, order }
        } else if fl & flags::HEAD != 0 {
            Folio {
                head: page,
                order: f.order(),
            }
        } else {
            Folio {
                head: page,
                order: 0,
            }
        }
    }

    /// The folio holding arena address `addr`, and `addr`'s byte offset in
    /// it; `None` outside the arena.
    pub fn folio_of_address(&self, addr: *const u8) -> Option<(Folio, usize)> {
        let page = self.page_of_address(addr)?;
        let folio = self.page_folio(page);
        let off = addr as usize - self.page_address(folio.head) as usize;
        Some((folio, off))
    }

    /// Take `n` pins on `folio` (one per page an I/O covers) with one
    /// atomic add.
    ///
    /// **Context:** never blocks; the folio must be allocated.
    #[inline]
    pub fn pin_folio(&self, folio: Folio, n: u32) {
        self.arena()
            .frame(folio.head.pfn())
            .pins
            .fetch_add(n, Relaxed);
    }

    /// Drop `n` pins from `folio` with one atomic subtract.
    ///
    /// **Context:** never blocks. Panics, naming the frame, if the folio
    /// holds fewer than `n` pins (an unpin without a pin).
    #[inline]
    pub fn unpin_folio(&self, folio: Folio, n: u32) {
        let pins = &self.arena().frame(folio.head.pfn()).pins;
        let old = pins.fetch_sub(n, AcqRel);
        if old < n {
            pins.fetch_add(n, Relaxed);
            panic!(
                "unpin_folio: pfn {} has {old} pins, {n} were dropped (an unpin without a pin)",
                folio.head.pfn()
            );
        }
    }

    /// Pins held on `folio`.
    #[inline]
    pub fn folio_pins(&self, folio: Folio) -> u32 {
        self.arena().frame(folio.head.pfn()).pins.load(Acquire)
    }

    /// Pin one page (its folio, one pin): the page-by-page baseline.
    #[inline]
    pub fn pin_page(&self, page: Page) {
        self.pin_folio(self.page_folio(page), 1)
    }

    /// Unpin one page (its folio, one pin): the page-by-page baseline.
    #[inline]
    pub fn unpin_page(&self, page: Page) {
        self.unpin_folio(self.page_folio(page), 1)
    }

    /// A buffer of `len_bytes` (rounded up to whole pages) made of folios
    /// of `1 << prefer_order` pages where the length allows, smaller ones
    /// for the tail or when a large block cannot be had (high orders are
    /// tried with `NORETRY | NOWARN`).
    ///
    /// **Context:** as `gfp` allows. **Returns:** `BadSetting` for an order
    /// above 10, [`Error::NoMemory`] (with everything allocated so far
    /// freed) when even single pages run out.
    pub fn alloc_buffer(
        &self,
        gfp: Gfp,
        len_bytes: usize,
        prefer_order: u32,
    ) -> Result<FolioBuffer> {
        if prefer_order > MAX_ORDER {
            return Err(Error::setting(
                "prefer_order",
                prefer_order,
                format!("folio orders go up to {MAX_ORDER}"),
            ));
        }
        let mut buf = FolioBuffer {
            alloc: self.clone(),
            folios: Vec::new(),
            len: len_bytes,
            held: 0,
        };
        let mut left = len_bytes.div_ceil(PAGE_SIZE);
        while left > 0 {
            let mut order = prefer_order.min(usize::BITS - 1 - left.leading_zeros());
            let folio = loop {
                let g = if order > 0 {
                    gfp | Gfp::NORETRY | Gfp::NOWARN
                } else {
                    gfp
                };
                if let Some(f) = self.folio_alloc(g, order) {
                    break Some(f);
                }
                if order == 0 {
                    break None;
                }
                order -= 1;
            };
            let Some(folio) = folio else {
                return Err(Error::NoMemory(format!(
                    "a {len_bytes}-byte buffer: {} pages still needed",
                    left
                )));
            };
            left -= folio.nr_pages();
            buf.held += folio.size_bytes();
            buf.folios.push(folio);
        }
        Ok(buf)
    }
}

/// An application buffer made of folios: `len()` bytes, in order, across
/// the folios (each folio contiguous; folios need not be adjacent).
/// Frees its folios when dropped.
pub struct FolioBuffer {
    alloc: PageAllocator,
    folios: Vec<Folio>,
    len: usize,
    /// Bytes of all the folios (`len` rounded up to the last folio's end).
    held: usize,
}

impl FolioBuffer {
    /// The allocator the folios belong to.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The folios, in order.
    #[inline]
    pub fn folios(&self) -> &[Folio] {
        &self.folios
    }

    /// Every frame of the buffer, in order (what pinning an address range
    /// yields: the page array a bio is built from).
    pub fn pages(&self) -> Vec<Page> {
        let mut v = Vec::with_capacity(self.folios.iter().map(|f| f.nr_pages()).sum());
        for f in &self.folios {
            v.extend((0..f.nr_pages()).map(|i| f.page_at(i)));
        }
        v
    }

    /// The contiguous pieces of the buffer as byte slices, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let mut left = self.len;
        self.folios.iter().map(move |f| {
            let n = f.size_bytes().min(left);
            left -= n;
            // SAFETY: the folio belongs to this buffer, lies inside the
            // arena's mapping, and is only written through `&mut self`.
            unsafe { std::slice::from_raw_parts(self.alloc.page_address(f.page()), n) }
        })
    }

    /// The contiguous pieces of the buffer as mutable byte slices.
    pub fn chunks_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        let mut left = self.len;
        let alloc = &self.alloc;
        self.folios.iter().map(move |f| {
            let n = f.size_bytes().min(left);
            left -= n;
            // SAFETY: as in `chunks`; `&mut self` makes this the only
            // access, and the folios do not overlap.
            unsafe { std::slice::from_raw_parts_mut(alloc.page_address(f.page()), n) }
        })
    }

    /// Copy `src` into the buffer from its start.
    ///
    /// **Returns:** `BadSetting` if `src` is longer than the buffer.
    pub fn copy_from(&mut self, src: &[u8]) -> Result<()> {
        if src.len() > self.len {
            return Err(Error::setting(
                "src.len()",
                src.len(),
                format!("the buffer holds {} bytes", self.len),
            ));
        }
        let mut done = 0;
        for c in self.chunks_mut() {
            let n = c.len().min(src.len() - done);
            c[..n].copy_from_slice(&src[done..done + n]);
            done += n;
            if done == src.len() {
                break;
            }
        }
        Ok(())
    }

    /// The buffer's bytes, copied out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        for c in self.chunks() {
            v.extend_from_slice(c);
        }
        v
    }

    /// Free the folios now, last first.
    ///
    /// **Returns:** [`Error::Pinned`] at the first pinned folio met, with
    /// the buffer back: that folio and the ones before it stay allocated
    /// and in it (the ones after it were freed).
    pub fn free(mut self) -> std::result::Result<(), (Error, FolioBuffer)> {
        match self.release() {
            Ok(()) => Ok(()),
            Err(e) => Err((e, self)),
        }
    }

    fn release(&mut self) -> Result<()> {
        while let Some(&f) = self.folios.last() {
            // SAFETY: the buffer owns its folios; `f` leaves it (popped
            // below) as it is freed, so it is freed once and never reached
            // through the buffer again.
            unsafe { self.alloc.folio_put(f)? };
            self.folios.pop();
            self.held -= f.size_bytes();
            self.len = self.len.min(self.held);
        }
        Ok(())
    }
}

/// Ownership moves and borrowed views: everything a consumer needs to use
/// a buffer's bytes without touching an address.
impl FolioBuffer {
    /// An empty buffer of `alloc`'s folios, filled with
    /// [`FolioBuffer::push_alloc`], [`FolioBuffer::push_from`] or
    /// [`FolioBuffer::push_raw`].
    ///
    /// **Context:** never blocks; allocates nothing but the handle.
    pub fn new(alloc: &PageAllocator) -> FolioBuffer {
        FolioBuffer {
            alloc: alloc.clone(),
            folios: Vec::new(),
            len: 0,
            held: 0,
        }
    }

    /// An empty buffer with room for `nr_folios` folios before its list
    /// grows.
    ///
    /// **Context:** never blocks.
    pub fn with_capacity(alloc: &PageAllocator, nr_folios: usize) -> FolioBuffer {
        let mut b = FolioBuffer::new(alloc);
        b.folios.reserve(nr_folios);
        b
    }

    /// Append a folio the caller already owns; the buffer grows to its
    /// end (a partial last folio becomes whole first).
    ///
    /// **Context:** never blocks. Panics if the block leaves the arena.
    ///
    /// # Safety
    /// The block of 2^`order` frames at `page` must have been allocated
    /// from this buffer's allocator (compound when `order > 0`, as
    /// [`PageAllocator::folio_alloc`] makes it), be owned by the caller,
    /// and be neither freed nor read or written by anyone else from here
    /// on: the buffer owns it, hands out its bytes and frees it.
    pub unsafe fn push_raw(&mut self, page: Page, order: u32) {
        let end = page.pfn() as usize + (1usize << order);
        assert!(
            order <= MAX_ORDER && end <= self.alloc.arena().nr_pages(),
            "push_raw: pfn {} order {order} is not a block of this arena",
            page.pfn()
        );
        self.push(Folio { head: page, order });
    }

    /// Allocate a folio of 2^`order` frames and append it.
    ///
    /// **Context / Returns:** as [`PageAllocator::folio_alloc`]; `false`
    /// (the buffer unchanged) where that returns `None`.
    pub fn push_alloc(&mut self, gfp: Gfp, order: u32) -> bool {
        match self.alloc.folio_alloc(gfp, order) {
            Some(f) => {
                self.push(f);
                true
            }
            None => false,
        }
    }

    /// Move `other`'s last folio to the end of this buffer.
    ///
    /// **Context:** never blocks. **Returns:** the folio's index here,
    /// `None` (nothing moved) when `other` is empty; `BadSetting` when the
    /// buffers belong to different arenas.
    #[inline]
    pub fn push_from(&mut self, other: &mut FolioBuffer) -> Result<Option<usize>> {
        self.check_same(other)?;
        let Some(f) = other.folios.pop() else {
            return Ok(None);
        };
        other.held -= f.size_bytes();
        other.len = other.len.min(other.held);
        self.push(f);
        Ok(Some(self.folios.len() - 1))
    }

    /// Move all of `other`'s folios, in order, to the end of this buffer.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting` (nothing
    /// moved) when the buffers belong to different arenas.
    pub fn append(&mut self, other: &mut FolioBuffer) -> Result<()> {
        self.check_same(other)?;
        for f in std::mem::take(&mut other.folios) {
            self.push(f);
        }
        other.len = 0;
        other.held = 0;
        Ok(())
    }

    /// Exchange folio `i` of this buffer with folio `j` of `other` (same
    /// order), each buffer keeping its length.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting` (nothing
    /// moved) for buffers of different arenas or folios of different
    /// orders. Panics if an index is out of range.
    #[inline]
    pub fn swap_folio(&mut self, i: usize, other: &mut FolioBuffer, j: usize) -> Result<()> {
        self.check_same(other)?;
        let (a, b) = (self.folios[i], other.folios[j]);
        if a.order != b.order {
            return Err(Error::setting(
                "swap_folio",
                format!("orders {} and {}", a.order, b.order),
                "only folios of one order can be exchanged",
            ));
        }
        std::mem::swap(&mut self.folios[i], &mut other.folios[j]);
        Ok(())
    }

    /// Move folios `at..` to a new buffer; this one keeps `..at` and its
    /// length shrinks to their end at most.
    ///
    /// **Context:** never blocks. Panics if `at` is past the last folio.
    pub fn split_off(&mut self, at: usize) -> FolioBuffer {
        let folios = self.folios.split_off(at);
        let moved: usize = folios.iter().map(|f| f.size_bytes()).sum();
        self.held -= moved;
        let len = self.len.saturating_sub(self.held).min(moved);
        self.len = self.len.min(self.held);
        FolioBuffer {
            alloc: self.alloc.clone(),
            folios,
            len,
            held: moved,
        }
    }

    /// Reverse the order of folios `at..`: the same folios and length,
    /// visited (by `chunks`, `runs_mut`) the other way round.
    ///
    /// **Context:** never blocks. Panics if `at` is past the last folio.
    pub fn reverse_from(&mut self, at: usize) {
        self.folios[at..].reverse();
    }

    /// Split every compound folio into order-0 folios (the kernel's
    /// `split_folio`), in place: the same frames and bytes, each frame now
    /// a folio of its own that can move to another buffer alone.
    ///
    /// **Context:** never blocks. Panics if a compound folio is pinned.
    pub fn split_folios(&mut self) {
        if self.folios.iter().all(|f| f.order == 0) {
            return;
        }
        let mut singles = Vec::with_capacity(self.held / PAGE_SIZE);
        for &f in &self.folios {
            if f.order > 0 {
                assert_eq!(
                    self.alloc.folio_pins(f),
                    0,
                    "split_folios: pfn {} is pinned",
                    f.head.pfn()
                );
                // SAFETY: the buffer owns the folio and replaces it below by
                // its order-0 pages, which it then owns one by one.
                unsafe { self.alloc.split_page(f.head, f.order) };
            }
            singles.extend((0..f.nr_pages()).map(|i| Folio {
                head: f.page_at(i),
                order: 0,
            }));
        }
        self.folios = singles;
    }

    /// Give up ownership of the folios without freeing them: the caller
    /// frees them ([`PageAllocator::folio_put`], or the mempool they came
    /// from).
    pub fn into_raw(mut self) -> Vec<Folio> {
        self.len = 0;
        self.held = 0;
        std::mem::take(&mut self.folios)
    }

    /// The whole of folio `i`'s bytes (past `len()` too, for the last).
    ///
    /// **Context:** never blocks. Panics if `i` is out of range.
    pub fn folio_bytes(&self, i: usize) -> &[u8] {
        let f = self.folios[i];
        // SAFETY: by the buffer's invariant (module docs) the folio lies in
        // the arena's mapping, which `self.alloc` keeps alive, and only
        // `&mut self` writes it; `&self` is borrowed for the slice's life.
        unsafe { std::slice::from_raw_parts(self.alloc.page_address(f.head), f.size_bytes()) }
    }

    /// The whole of folio `i`'s bytes, writable.
    ///
    /// **Context:** never blocks. Panics if `i` is out of range.
    pub fn folio_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        let f = self.folios[i];
        // SAFETY: as in `folio_bytes`; `&mut self`, borrowed for the
        // slice's life, makes it the only view of the buffer's bytes.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.page_address(f.head), f.size_bytes()) }
    }

    /// The buffer's `len()` bytes as writable runs: folios that follow
    /// each other in the arena make one slice (one cipher call, one I/O
    /// segment), in order.
    pub fn runs_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        let (alloc, folios) = (&self.alloc, &self.folios[..]);
        let (mut left, mut i) = (self.len, 0);
        std::iter::from_fn(move || {
            if left == 0 || i == folios.len() {
                return None;
            }
            let first = folios[i];
            let (mut bytes, mut end) = (first.size_bytes(), first.head.pfn() + (1 << first.order));
            i += 1;
            while bytes < left && i < folios.len() && folios[i].head.pfn() == end {
                bytes += folios[i].size_bytes();
                end += 1 << folios[i].order;
                i += 1;
            }
            let n = bytes.min(left);
            left -= n;
            // SAFETY: the run is folios `first..i` of this buffer, which
            // follow each other in the arena (each starts where the one
            // before ends), so `n` bytes from the first are one range of
            // the mapping that the buffer alone owns (module docs); every
            // run covers other folios, and `&mut self` is borrowed for as
            // long as any of them lives.
            Some(unsafe { std::slice::from_raw_parts_mut(alloc.page_address(first.head), n) })
        })
    }

    /// Copy `src` into the buffer from byte `offset` on.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting` (nothing
    /// copied) when the range leaves `len()`.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range("write_at", offset, src.len())?;
        let (mut pos, mut done) = (0, 0);
        for chunk in self.chunks_mut() {
            if done == src.len() {
                break;
            }
            let at = offset + done;
            if at < pos + chunk.len() {
                let from = at - pos;
                let n = (chunk.len() - from).min(src.len() - done);
                chunk[from..from + n].copy_from_slice(&src[done..done + n]);
                done += n;
            }
            pos += chunk.len();
        }
        Ok(())
    }

    /// Copy bytes from `offset` on into `dst`.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting` (nothing
    /// copied) when the range leaves `len()`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range("read_at", offset, dst.len())?;
        let (mut pos, mut done) = (0, 0);
        for chunk in self.chunks() {
            if done == dst.len() {
                break;
            }
            let at = offset + done;
            if at < pos + chunk.len() {
                let from = at - pos;
                let n = (chunk.len() - from).min(dst.len() - done);
                dst[done..done + n].copy_from_slice(&chunk[from..from + n]);
                done += n;
            }
            pos += chunk.len();
        }
        Ok(())
    }

    /// Views of arena byte ranges `(start, len)` (what bio segments name),
    /// each of which must lie inside this buffer's folios.
    ///
    /// **Returns:** the index of the first range that does not.
    pub(crate) fn arena_slices(
        &self,
        ranges: &[(usize, usize)],
    ) -> std::result::Result<Vec<&[u8]>, usize> {
        let runs = self.arena_runs();
        let base = self.alloc.page_address(Page::from_pfn(0));
        let mut out = Vec::with_capacity(ranges.len());
        for (k, &(start, len)) in ranges.iter().enumerate() {
            if !Self::covered(&runs, start, len) {
                return Err(k);
            }
            // SAFETY: the range lies inside folios this buffer owns
            // (checked just above against them), so inside the mapping that
            // starts at pfn 0's address; only `&mut self` writes them and
            // `&self` is borrowed for the slices' life.
            out.push(unsafe { std::slice::from_raw_parts(base.add(start).cast_const(), len) });
        }
        Ok(out)
    }

    /// Writable views of arena byte ranges, which must lie inside this
    /// buffer's folios and not overlap one another.
    ///
    /// **Returns:** the index of the first range that leaves the buffer
    /// or overlaps another.
    pub(crate) fn arena_slices_mut(
        &mut self,
        ranges: &[(usize, usize)],
    ) -> std::result::Result<Vec<&mut [u8]>, usize> {
        let runs = self.arena_runs();
        if let Some(k) = ranges
            .iter()
            .position(|&(s, l)| !Self::covered(&runs, s, l))
        {
            return Err(k);
        }
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_unstable_by_key(|&k| ranges[k].0);
        for w in order.windows(2) {
            let (a, b) = (ranges[w[0]], ranges[w[1]]);
            if a.1 > 0 && b.1 > 0 && a.0 + a.1 > b.0 {
                return Err(w[1]);
            }
        }
        let base = self.alloc.page_address(Page::from_pfn(0));
        Ok(ranges
            .iter()
            .map(|&(start, len)| {
                // SAFETY: as in `arena_slices`, and the ranges were checked
                // not to overlap, so with `&mut self` borrowed for their
                // life each is the only view of its bytes.
                unsafe { std::slice::from_raw_parts_mut(base.add(start), len) }
            })
            .collect())
    }

    /// Take the last folio out (the caller now owns it).
    #[inline]
    fn pop_last(&mut self) -> Folio {
        let f = self.folios.pop().expect("a folio to take");
        self.held -= f.size_bytes();
        self.len = self.len.min(self.held);
        f
    }

    #[inline]
    fn push(&mut self, f: Folio) {
        self.len = self.held + f.size_bytes();
        self.held = self.len;
        self.folios.push(f);
    }

    #[inline]
    fn check_same(&self, other: &FolioBuffer) -> Result<()> {
        if self.alloc.same_allocator(&other.alloc) {
            Ok(())
        } else {
            Err(Error::setting(
                "other",
                "a buffer of another arena",
                "folios move only between buffers of one arena",
            ))
        }
    }

    fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_some_and(|end| end <= self.len) {
            Ok(())
        } else {
            Err(Error::setting(
                what,
                format!("{len} bytes at {offset}"),
                format!("the buffer holds {} bytes", self.len),
            ))
        }
    }

    /// The folios as arena byte ranges `[start, end)`, sorted, adjacent
    /// ones merged.
    fn arena_runs(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = self
            .folios
            .iter()
            .map(|f| {
                let s = f.head.pfn() as usize * PAGE_SIZE;
                (s, s + f.size_bytes())
            })
            .collect();
        v.sort_unstable();
        v.dedup_by(|b, a| {
            if a.1 == b.0 {
                a.1 = b.1;
                true
            } else {
                false
            }
        });
        v
    }

    fn covered(runs: &[(usize, usize)], start: usize, len: usize) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        let i = runs.partition_point(|r| r.0 <= start);
        i > 0 && end <= runs[i - 1].1
    }
}

impl Drop for FolioBuffer {
    /// Free the folios. A folio still pinned by I/O is never freed: it is
    /// left allocated (leaked) and reported on stderr.
    fn drop(&mut self) {
        while !self.folios.is_empty() {
            if let Err(e) = self.release() {
                eprintln!("iopages: dropping a FolioBuffer: {e}; the folio is leaked");
                if let Some(f) = self.folios.pop() {
                    self.held -= f.size_bytes();
                }
            }
        }
    }
}

/// A fixed number of slots, each empty or the owner of one order-0 page
/// of one arena: the blocks of a RAM disk that keeps the pages handed to
/// it. The slots hand out their pages' bytes and exchange pages with a
/// [`FolioBuffer`] of the same arena; the pages are freed when it is
/// dropped.
///
/// It rests on the same invariant as [`FolioBuffer`]: every page in it
/// lies in the arena, came from a buffer that owned it, and sits in one
/// slot only, so a borrow of the slots is a borrow of their bytes.
pub struct PageSlots {
    alloc: PageAllocator,
    slots: Box<[Option<Page>]>,
}

impl PageSlots {
    /// `n` empty slots for pages of `alloc`'s arena.
    pub fn new(alloc: &PageAllocator, n: usize) -> PageSlots {
        PageSlots {
            alloc: alloc.clone(),
            slots: vec![None; n].into_boxed_slice(),
        }
    }

    /// Slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no slots at all.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether slot `i` holds a page. Panics if `i` is out of range.
    #[inline]
    pub fn is_filled(&self, i: usize) -> bool {
        self.slots[i].is_some()
    }

    /// Slots that hold a page.
    pub fn filled(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Slot `i`'s page's bytes, `None` for an empty slot. Panics if `i` is
    /// out of range.
    #[inline]
    pub fn page_bytes(&self, i: usize) -> Option<&[u8]> {
        let p = self.slots[i]?;
        // SAFETY: the slot owns `p`, a page of this arena (type invariant),
        // and `&self` keeps every writable view of the slots away for the
        // slice's life.
        Some(unsafe { std::slice::from_raw_parts(self.alloc.page_address(p), PAGE_SIZE) })
    }

    /// Slot `i`'s page's bytes, writable; `None` for an empty slot. Panics
    /// if `i` is out of range.
    #[inline]
    pub fn page_bytes_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let p = self.slots[i]?;
        // SAFETY: as `page_bytes`; `&mut self` makes this the only view.
        Some(unsafe { std::slice::from_raw_parts_mut(self.alloc.page_address(p), PAGE_SIZE) })
    }

    /// Fill empty slot `i` with `src`'s last folio.
    ///
    /// **Context:** never blocks. **Returns:** `false` (nothing moved) when
    /// `src` is empty; `BadSetting` (nothing moved) for a buffer of another
    /// arena, a compound last folio, or a slot that already holds a page.
    /// Panics if `i` is out of range.
    pub fn fill_from(&mut self, i: usize, src: &mut FolioBuffer) -> Result<bool> {
        self.check_src(src)?;
        if self.slots[i].is_some() {
            return Err(Error::setting(
                "slot",
                format!("slot {i}"),
                "only an empty slot can be filled",
            ));
        }
        match src.folios.last() {
            None => Ok(false),
            Some(f) if f.order > 0 => Err(compound(*f)),
            Some(_) => {
                let f = src.pop_last();
                self.slots[i] = Some(f.head);
                Ok(true)
            }
        }
    }

    /// Empty slot `i`, moving its page to the end of `dst` (a discarded
    /// block: the slot reads as empty again, and the page is freed with
    /// `dst`).
    ///
    /// **Context:** never blocks. **Returns:** `false` (nothing moved) for
    /// an empty slot; `BadSetting` (nothing moved) for a buffer of another
    /// arena. Panics if `i` is out of range.
    pub fn take(&mut self, i: usize, dst: &mut FolioBuffer) -> Result<bool> {
        self.check_src(dst)?;
        match self.slots[i].take() {
            None => Ok(false),
            Some(head) => {
                dst.push(Folio { head, order: 0 });
                Ok(true)
            }
        }
    }

    /// Put `src`'s last `n` folios into slots `at..at + n`, in order (the
    /// first of them into slot `at`). The pages those slots held move to
    /// the end of `displaced`, in slot order.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting` (nothing moved)
    /// for buffers of another arena, fewer than `n` folios in `src`, or a
    /// compound folio among the `n`. Panics if `at + n` passes the last
    /// slot.
    pub fn store_last(
        &mut self,
        at: usize,
        n: usize,
        src: &mut FolioBuffer,
        displaced: &mut FolioBuffer,
    ) -> Result<()> {
        self.check_src(src)?;
        self.check_src(displaced)?;
        assert!(
            at + n <= self.slots.len(),
            "store_last: slots {at}..{} of {}",
            at + n,
            self.slots.len()
        );
        let Some(from) = src.folios.len().checked_sub(n) else {
            return Err(Error::setting(
                "n",
                format!("{n} folios from a buffer of {}", src.folios.len()),
                "the buffer holds fewer folios than asked for",
            ));
        };
        if let Some(f) = src.folios[from..].iter().find(|f| f.order > 0) {
            return Err(compound(*f));
        }
        for (slot, f) in self.slots[at..at + n].iter_mut().zip(&src.folios[from..]) {
            if let Some(old) = slot.replace(f.head) {
                displaced.push(Folio {
                    head: old,
                    order: 0,
                });
            }
        }
        src.folios.truncate(from);
        src.held -= n * PAGE_SIZE;
        src.len = src.len.min(src.held);
        Ok(())
    }

    fn check_src(&self, buf: &FolioBuffer) -> Result<()> {
        if self.alloc.same_allocator(&buf.alloc) {
            Ok(())
        } else {
            Err(Error::setting(
                "other",
                "a buffer of another arena",
                "pages move only between slots and buffers of one arena",
            ))
        }
    }
}

fn compound(f: Folio) -> Error {
    Error::setting(
        "folio",
        format!("pfn {} of order {}", f.head.pfn(), f.order),
        "slots hold single pages: split compound folios first",
    )
}

impl Drop for PageSlots {
    /// Free the pages (through a buffer that takes them over, so a pinned
    /// page is reported and kept as a buffer's would be).
    fn drop(&mut self) {
        let mut buf = FolioBuffer::with_capacity(&self.alloc, self.filled());
        for p in self.slots.iter_mut().filter_map(Option::take) {
            buf.push(Folio { head: p, order: 0 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena() -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(16 << 20)
            .huge_pages(crate::HugePages::Never)
            .build()
            .unwrap()
    }

    #[test]
    fn page_slots_exchange_pages_with_buffers_in_order_and_free_them_when_dropped() {
        let alloc = arena();
        let mut src = FolioBuffer::new(&alloc);
        for i in 0..6 {
            assert!(src.push_alloc(Gfp::KERNEL, 0));
            src.folio_bytes_mut(i).fill(i as u8 + 1);
        }
        let first: Vec<Page> = src.pages();
        let mut slots = PageSlots::new(&alloc, 8);
        let mut displaced = FolioBuffer::new(&alloc);
        assert_eq!((slots.len(), slots.filled()), (8, 0));
        assert!(slots.page_bytes(3).is_none());
        // The last four folios go to slots 2..6, in order; nothing held.
        slots.store_last(2, 4, &mut src, &mut displaced).unwrap();
        assert_eq!(src.folios().len(), 2);
        assert_eq!(src.len(), 2 * PAGE_SIZE);
        assert!(displaced.is_empty());
        for (k, slot) in (2..6).enumerate() {
            assert!(slots
                .page_bytes(slot)
                .unwrap()
                .iter()
                .all(|&b| b == k as u8 + 3));
        }
        // Two more into slots 4..6 displace the pages there, in slot order.
        slots.store_last(4, 2, &mut src, &mut displaced).unwrap();
        assert!(src.is_empty());
        assert_eq!(displaced.pages(), first[4..6].to_vec());
        assert!(slots.page_bytes(4).unwrap().iter().all(|&b| b == 1));
        // Refused, nothing moved: too few folios, a compound folio, another
        // arena, a filled slot.
        let mut one = FolioBuffer::new(&alloc);
        assert!(one.push_alloc(Gfp::KERNEL, 0));
        assert!(slots.store_last(0, 2, &mut one, &mut displaced).is_err());
        let mut big = FolioBuffer::new(&alloc);
        assert!(big.push_alloc(Gfp::KERNEL, 1));
        assert!(slots.store_last(0, 1, &mut big, &mut displaced).is_err());
        assert!(slots.fill_from(0, &mut big).is_err());
        let other = arena();
        let mut foreign = FolioBuffer::new(&other);
        assert!(foreign.push_alloc(Gfp::KERNEL, 0));
        assert!(slots
            .store_last(0, 1, &mut foreign, &mut displaced)
            .is_err());
        assert!(slots.fill_from(0, &mut foreign).is_err());
        assert!(slots.fill_from(2, &mut one).is_err(), "slot 2 is filled");
        assert_eq!((one.folios().len(), big.folios().len()), (1, 1));
        assert_eq!(foreign.folios().len(), 1);
        // Filling an empty slot; an empty source moves nothing.
        assert!(slots.fill_from(0, &mut one).unwrap());
        assert!(!slots.fill_from(1, &mut one).unwrap());
        slots.page_bytes_mut(0).unwrap()[..3].copy_from_slice(b"abc");
        assert_eq!(&slots.page_bytes(0).unwrap()[..3], b"abc");
        assert_eq!(slots.filled(), 5);
        drop((slots, displaced, big, foreign));
        alloc.leak_check().unwrap();
        other.leak_check().unwrap();
    }

    #[test]
    fn every_frame_finds_its_folio_and_index() {
        let a = arena();
        for order in 0..=MAX_ORDER {
            let f = a.folio_alloc(Gfp::KERNEL, order).unwrap();
            for i in 0..f.nr_pages() {
                let p = f.page_at(i);
                assert_eq!(a.page_folio(p), f, "order {order} frame {i}");
                assert_eq!(f.index_of(p), Some(i));
                let addr = a.page_address(p).wrapping_add(100).cast_const();
                assert_eq!(a.folio_of_address(addr), Some((f, i * PAGE_SIZE + 100)));
            }
            assert_eq!(
                f.index_of(Page::from_pfn(f.page().pfn() + f.nr_pages() as u32)),
                None
            );
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { a.folio_put(f) }.unwrap();
        }
        a.leak_check().unwrap();
    }

    #[test]
    fn a_pinned_folio_is_refused_until_unpinned() {
        let a = arena();
        let f = a.folio_alloc(Gfp::KERNEL, 4).unwrap();
        a.pin_folio(f, 16);
        a.pin_page(f.page_at(3));
        assert_eq!(a.folio_pins(f), 17);
        // SAFETY: the test allocated these pages and gives them up here, once.
        match unsafe { a.folio_put(f) } {
            Err(Error::Pinned { pfn, pins }) => assert_eq!((pfn, pins), (f.page().pfn(), 17)),
            other => panic!("expected Pinned, got {other:?}"),
        }
        a.unpin_page(f.page_at(3));
        a.unpin_folio(f, 16);
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { a.folio_put(f) }.unwrap();
        a.leak_check().unwrap();
    }

    #[test]
    #[should_panic(expected = "an unpin without a pin")]
    fn an_unpin_without_a_pin_panics() {
        let a = arena();
        let f = a.folio_alloc(Gfp::KERNEL, 2).unwrap();
        a.pin_folio(f, 2);
        a.unpin_folio(f, 3);
    }

    #[test]
    #[should_panic(expected = "is pinned")]
    fn free_pages_refuses_a_pinned_block() {
        let a = arena();
        let f = a.folio_alloc(Gfp::KERNEL, 1).unwrap();
        a.pin_folio(f, 1);
        // SAFETY: deliberately a free of a pinned block, which must panic
        // before anything is freed.
        unsafe { a.free_pages(f.page(), 1) };
    }

    #[test]
    fn buffers_prefer_the_configured_size_and_fall_back() {
        let a = arena();
        let mut b = a.alloc_buffer(Gfp::KERNEL, 200 << 10, 4).unwrap();
        let orders: Vec<u32> = b.folios().iter().map(|f| f.order()).collect();
        assert_eq!(orders, vec![4, 4, 4, 1], "3 × 64 KiB + 8 KiB");
        assert_eq!(b.pages().len(), 50);
        let data: Vec<u8> = (0..200 << 10).map(|i: u32| (i * 7) as u8).collect();
        b.copy_from(&data).unwrap();
        assert_eq!(b.to_vec(), data);
        assert!(b.copy_from(&vec![0; (200 << 10) + 1]).is_err());
        assert!(a.alloc_buffer(Gfp::KERNEL, 4096, 11).is_err());
        // A pinned buffer cannot be freed; unpinned, it can.
        let f = b.folios()[1];
        a.pin_folio(f, 1);
        let b = match b.free() {
            Err((Error::Pinned { pfn, .. }, b)) => {
                assert_eq!(pfn, f.page().pfn());
                assert_eq!(
                    b.folios().len(),
                    2,
                    "the pinned folio and the one before it"
                );
                b
            }
            other => panic!("expected Pinned, got {:?}", other.map_err(|(e, _)| e)),
        };
        a.unpin_folio(f, 1);
        b.free().map_err(|(e, _)| e).unwrap();
        a.leak_check().unwrap();
    }

    #[test]
    fn a_buffer_falls_back_to_small_folios_when_large_blocks_are_gone() {
        let a = arena();
        // Take everything in order-4 blocks; give back two whole blocks
        // and every other page of four more (those cannot merge).
        let mut hog = Vec::new();
        while let Some(p) = a.alloc_pages(Gfp::NOWAIT | Gfp::MEMALLOC, 4) {
            hog.push(p);
        }
        for p in hog.drain(..2) {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { a.free_pages(p, 4) };
        }
        let split: Vec<Page> = hog.drain(..4).collect();
        for &p in &split {
            // SAFETY: the test owns the block and from here owns its pages one by one.
            unsafe { a.split_page(p, 4) };
            for i in (0..16).step_by(2) {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_pages(Page::from_pfn(p.pfn() + i), 0) };
            }
        }
        // The zone is far below its watermarks: ignore them, as the test
        // is about the fallback.
        let b = a
            .alloc_buffer(Gfp::KERNEL | Gfp::MEMALLOC, 256 << 10, 4)
            .unwrap();
        let orders: Vec<u32> = b.folios().iter().map(|f| f.order()).collect();
        assert_eq!(orders.iter().filter(|&&o| o == 4).count(), 2, "{orders:?}");
        assert_eq!(orders.iter().filter(|&&o| o == 0).count(), 32, "{orders:?}");
        assert_eq!(b.pages().len(), 64);
        drop(b);
        for p in hog {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { a.free_pages(p, 4) };
        }
        for p in split {
            for i in (1..16).step_by(2) {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_pages(Page::from_pfn(p.pfn() + i), 0) };
            }
        }
        a.leak_check().unwrap();
    }

    #[test]
    fn folios_move_between_buffers_of_one_arena_and_are_freed_once() {
        let a = arena();
        let mut x = FolioBuffer::with_capacity(&a, 4);
        let mut y = FolioBuffer::new(&a);
        assert!(x.is_empty() && x.push_alloc(Gfp::KERNEL, 0) && x.push_alloc(Gfp::KERNEL, 2));
        assert!(y.push_alloc(Gfp::KERNEL, 0));
        assert_eq!(x.len(), 5 * PAGE_SIZE);
        x.folio_bytes_mut(0).fill(1);
        y.folio_bytes_mut(0).fill(2);
        // A swap exchanges ownership, bytes and all; lengths stay.
        x.swap_folio(0, &mut y, 0).unwrap();
        assert!(x.folio_bytes(0).iter().all(|&b| b == 2));
        assert!(y.folio_bytes(0).iter().all(|&b| b == 1));
        assert!(x.swap_folio(1, &mut y, 0).is_err(), "orders 2 and 0");
        // Moves take the last folio; an empty source moves nothing.
        assert_eq!(y.push_from(&mut x).unwrap(), Some(1));
        assert_eq!((x.len(), y.len()), (PAGE_SIZE, 5 * PAGE_SIZE));
        let mut tail = y.split_off(1);
        assert_eq!((y.folios().len(), tail.folios().len()), (1, 1));
        assert_eq!((y.len(), tail.len()), (PAGE_SIZE, 4 * PAGE_SIZE));
        tail.append(&mut y).unwrap();
        assert!(y.folios().is_empty() && y.is_empty());
        assert_eq!(y.push_from(&mut FolioBuffer::new(&a)).unwrap(), None);
        // Another arena's buffer is refused, nothing moved.
        let b = arena();
        let mut z = FolioBuffer::new(&b);
        assert!(z.push_alloc(Gfp::KERNEL, 0));
        assert!(z.push_from(&mut x).is_err() && x.push_from(&mut z).is_err());
        assert!(x.append(&mut z).is_err() && x.swap_folio(0, &mut z, 0).is_err());
        assert_eq!((x.folios().len(), z.folios().len()), (1, 1));
        drop(z);
        b.leak_check().unwrap();
        // Given up, the folios are the caller's to free.
        for f in tail.into_raw() {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { a.folio_put(f) }.unwrap();
        }
        drop(x);
        a.leak_check().unwrap();
    }

    #[test]
    fn runs_join_folios_that_follow_each_other_and_cover_exactly_len() {
        let a = arena();
        let mut b = FolioBuffer::new(&a);
        assert!(b.push_alloc(Gfp::KERNEL, 2));
        b.split_folios();
        assert_eq!(b.folios().len(), 4);
        assert!(b.folios().iter().all(|f| f.order() == 0));
        assert_eq!(
            b.runs_mut().map(|r| r.len()).collect::<Vec<_>>(),
            [4 * PAGE_SIZE]
        );
        // Reordered: [2, 3, 0, 1] is two runs of two frames.
        let mut c = b.split_off(2);
        c.append(&mut b).unwrap();
        for (i, r) in c.runs_mut().enumerate() {
            assert_eq!(r.len(), 2 * PAGE_SIZE);
            r.fill(i as u8 + 1);
        }
        let v = c.to_vec();
        assert!(v[..2 * PAGE_SIZE].iter().all(|&x| x == 1));
        assert!(v[2 * PAGE_SIZE..].iter().all(|&x| x == 2));
        // A buffer shorter than its folios: the runs stop at its length.
        let mut d = a.alloc_buffer(Gfp::KERNEL, 3 * PAGE_SIZE + 100, 0).unwrap();
        assert_eq!(
            d.runs_mut().map(|r| r.len()).sum::<usize>(),
            3 * PAGE_SIZE + 100
        );
        drop((c, d));
        a.leak_check().unwrap();
    }

    #[test]
    fn byte_copies_cross_folios_and_refuse_ranges_past_the_length() {
        let a = arena();
        let len = 3 * PAGE_SIZE + 100;
        let mut b = a.alloc_buffer(Gfp::KERNEL | Gfp::ZERO, len, 1).unwrap();
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        for offset in [0, PAGE_SIZE - 1, 2 * PAGE_SIZE - 2500, len - data.len()] {
            b.write_at(offset, &data).unwrap();
            let mut back = vec![0; data.len()];
            b.read_at(offset, &mut back).unwrap();
            assert_eq!(back, data, "offset {offset}");
            assert_eq!(b.to_vec()[offset..offset + data.len()], data[..]);
        }
        let before = b.to_vec();
        for (offset, n) in [(len - 1, 2), (len + 1, 0), (usize::MAX, 1)] {
            assert!(b.write_at(offset, &vec![9; n]).is_err(), "{offset}+{n}");
            assert!(b.read_at(offset, &mut vec![0; n]).is_err());
        }
        assert_eq!(b.to_vec(), before, "a refused copy writes nothing");
        b.write_at(len, &[]).unwrap();
        drop(b);
        a.leak_check().unwrap();
    }

    #[test]
    fn a_raw_block_handed_in_is_owned_and_freed_by_the_buffer() {
        let a = arena();
        let mut b = FolioBuffer::new(&a);
        let p = a.alloc_pages(Gfp::KERNEL, 0).unwrap();
        // SAFETY: the page was just allocated here and is given up.
        unsafe { b.push_raw(p, 0) };
        b.folio_bytes_mut(0)[7] = 7;
        assert_eq!(b.to_vec()[7], 7);
        drop(b);
        a.leak_check().unwrap();
    }

    #[test]
    #[should_panic(expected = "is not a block of this arena")]
    fn a_raw_block_outside_the_arena_is_refused() {
        let a = arena();
        let mut b = FolioBuffer::new(&a);
        let past = Page::from_pfn(a.arena().nr_pages() as u32);
        // SAFETY: refused before the buffer takes it.
        unsafe { b.push_raw(past, 0) };
    }
}
