//! PageBox: an owned block of pages, freed when dropped.
//!
//! Owns: the safe owner of one allocated block — the common way to hold
//! pages without calling the raw `free_pages`. Must never: free its block
//! twice or let its bytes be reached after the block is freed (the slices
//! borrow the box).

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

impl PageBox<'_> {
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

    /// Give up ownership without freeing: the caller frees with
    /// [`PageAllocator::free_pages`] and this order.
    pub fn into_raw(self) -> Page {
        let p = self.page;
        std::mem::forget(self);
        p
    }
}

impl Drop for PageBox<'_> {
    fn drop(&mut self) {
        self.alloc.free_pages(self.page, self.order);
    }
}
