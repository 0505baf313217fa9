//! Folios: a compound allocation handled as one unit, its pins, and
//! application buffers made of folios.
//!
//! Owns: the [`Folio`] handle (head frame and order), finding a frame's
//! folio (a tail frame's owner word names its head), pin counts kept on the
//! head frame (one atomic add of N pins N pages, as the kernel's
//! `_pincount`), and [`FolioBuffer`]: N bytes as large folios, preferring a
//! configured size and falling back to smaller ones. Must never: free a
//! pinned folio ([`PageAllocator::folio_put`] refuses with
//! [`Error::Pinned`]), or let an unpin take more pins than were taken (it
//! panics, naming the frame).
//!
//! Pins are valid for every allocated frame: they are zero whenever a
//! frame is free, and only this module changes them. The raw
//! [`PageAllocator::free_pages`] checks them too, except on the order-0
//! fast path with checks off, which never reads a frame — free folios with
//! `folio_put`.

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

    /// Free a folio from [`PageAllocator::folio_alloc`].
    ///
    /// **Context:** never blocks. **Returns:** [`Error::Pinned`], with the
    /// folio kept allocated, if I/O still holds pins on it.
    pub fn folio_put(&self, folio: Folio) -> Result<()> {
        let pins = self.folio_pins(folio);
        if pins != 0 {
            return Err(Error::Pinned {
                pfn: folio.head.pfn(),
                pins,
            });
        }
        self.free_pages(folio.head, folio.order);
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
            self.alloc.folio_put(f)?;
            self.folios.pop();
        }
        Ok(())
    }
}

impl Drop for FolioBuffer {
    /// Free the folios. A folio still pinned by I/O is never freed: it is
    /// left allocated (leaked) and reported on stderr.
    fn drop(&mut self) {
        while !self.folios.is_empty() {
            if let Err(e) = self.release() {
                eprintln!("iopages: dropping a FolioBuffer: {e}; the folio is leaked");
                self.folios.pop();
            }
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
    fn every_frame_finds_its_folio_and_index() {
        let a = arena();
        for order in 0..=MAX_ORDER {
            let f = a.folio_alloc(Gfp::KERNEL, order).unwrap();
            for i in 0..f.nr_pages() {
                let p = f.page_at(i);
                assert_eq!(a.page_folio(p), f, "order {order} frame {i}");
                assert_eq!(f.index_of(p), Some(i));
                let addr = unsafe { a.page_address(p).add(100) };
                assert_eq!(a.folio_of_address(addr), Some((f, i * PAGE_SIZE + 100)));
            }
            assert_eq!(
                f.index_of(Page::from_pfn(f.page().pfn() + f.nr_pages() as u32)),
                None
            );
            a.folio_put(f).unwrap();
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
        match a.folio_put(f) {
            Err(Error::Pinned { pfn, pins }) => assert_eq!((pfn, pins), (f.page().pfn(), 17)),
            other => panic!("expected Pinned, got {other:?}"),
        }
        a.unpin_page(f.page_at(3));
        a.unpin_folio(f, 16);
        a.folio_put(f).unwrap();
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
        a.free_pages(f.page(), 1);
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
            a.free_pages(p, 4);
        }
        let split: Vec<Page> = hog.drain(..4).collect();
        for &p in &split {
            a.split_page(p, 4);
            for i in (0..16).step_by(2) {
                a.free_pages(Page::from_pfn(p.pfn() + i), 0);
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
            a.free_pages(p, 4);
        }
        for p in split {
            for i in (1..16).step_by(2) {
                a.free_pages(Page::from_pfn(p.pfn() + i), 0);
            }
        }
        a.leak_check().unwrap();
    }
}
