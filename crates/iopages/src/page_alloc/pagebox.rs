//! PageBox: an owned block of pages, freed when dropped.
//!
//! Owns: the safe owner of one allocated block — the common way to hold
//! pages without calling the raw (and `unsafe`) `free_pages`. Must never:
//! free its block twice or let its bytes be reached after the block is
//! freed (the slices borrow the box).
//!
//! Why the raw frees are `unsafe`: a [`Page`] is a `Copy` frame number, so
//! a safe `free_pages(page)` could free a block that a `PageBox` still
//! owns; the allocator would hand it out again and two boxes would give
//! `&mut` slices of the same bytes. That program no longer compiles:
//!
//! ```compile_fail,E0133
//! use iopages::{Gfp, PageAllocator};
//! let alloc = PageAllocator::new(8 << 20).unwrap();
//! let mut a = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
//! alloc.free_pages(a.page(), 0); // error[E0133]: requires an unsafe block
//! let mut b = alloc.alloc_box(Gfp::KERNEL, 0).unwrap(); // the same frame
//! a.as_mut_slice()[0] = 1;
//! b.as_mut_slice()[0] = 2; // two owners of one frame
//! ```
//!
//! The safe form of the same steps gives two distinct blocks:
//!
//! ```
//! use iopages::{Gfp, PageAllocator};
//! let alloc = PageAllocator::new(8 << 20).unwrap();
//! let a = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
//! let b = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
//! assert_ne!(a.page(), b.page());
//! drop((a, b));
//! assert!(alloc.leak_check().is_ok());
//! ```

use super::PageAllocator;
use crate::buddy::frame::{Page, PAGE_SIZE};
use crate::gfp::Gfp;

impl PageAllocator {
    /// Allocate a block that frees itself when dropped.
    ///
    /// **Context / Returns:** as [`PageAllocator::alloc_pages`].
    pub fn alloc_box(&self, gfp: Gfp, order: u32) -> Option<PageBox<'_>> {
        self.alloc_pages(gfp, order).map(|page| PageBox {
            alloc: self,
            page,
            order,
        })
    }
}

/// An owned block of pages that is freed when dropped: the safe layer over
/// plain [`Page`] handles.
pub struct PageBox<'a> {
    alloc: &'a PageAllocator,
    page: Page,
    order: u32,
}

impl<'a> PageBox<'a> {
    /// The first frame.
    pub fn page(&self) -> Page {
        self.page
    }

    /// The block's order.
    pub fn order(&self) -> u32 {
        self.order
    }

    /// Bytes in the block.
    pub fn len(&self) -> usize {
        PAGE_SIZE << self.order
    }

    /// Always false: a block holds at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The block's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the block is allocated to this box for its whole life and
        // lies inside the arena's mapping, which outlives the allocator
        // reference the box holds.
        unsafe { std::slice::from_raw_parts(self.alloc.page_address(self.page), self.len()) }
    }

    /// The block's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.page_address(self.page), self.len()) }
    }

    /// Give up ownership without freeing: the caller now owns the block
    /// and frees it with [`PageAllocator::free_pages`] and this order, or
    /// gives it back to a box with [`PageBox::from_raw`].
    pub fn into_raw(self) -> Page {
        let p = self.page;
        std::mem::forget(self);
        p
    }

    /// Take ownership of a block allocated from `alloc` with `order` (the
    /// counterpart of [`PageBox::into_raw`]).
    ///
    /// # Safety
    /// The caller owns the block and gives it up: it came from `alloc`
    /// with this `order`, is not freed, and nothing else uses it as its
    /// own afterwards (another box over it would be a second owner).
    ///
    /// # Panics
    /// If `page` is not an order-`order` block of `alloc`'s arena.
    pub unsafe fn from_raw(alloc: &'a PageAllocator, page: Page, order: u32) -> PageBox<'a> {
        assert!(
            (page.pfn() as usize) < alloc.arena().nr_pages()
                && page.pfn() & ((1 << order.min(31)) - 1) == 0
                && order <= crate::buddy::frame::MAX_ORDER,
            "PageBox::from_raw: pfn {} is not an order-{order} block of this arena",
            page.pfn()
        );
        PageBox { alloc, page, order }
    }
}

impl Drop for PageBox<'_> {
    fn drop(&mut self) {
        // SAFETY: the box owns its block (allocated for it, or handed over
        // through `from_raw`, whose caller promised as much) and gives it up
        // exactly once, here.
        unsafe { self.alloc.free_pages(self.page, self.order) };
    }
}
