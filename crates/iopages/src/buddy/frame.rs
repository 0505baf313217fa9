//! Page handles and the per-frame metadata (`struct page`, in 16 bytes).
//!
//! Owns: the [`Page`] handle (a frame number, 4 bytes, `Option<Page>` too)
//! and the [`Frame`] record kept for every 4 KiB frame of the arena. Must
//! never: decide policy — the zone, the per-CPU lists and the folio code
//! read and write these fields under their own rules, written next to each
//! field below.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU8, Ordering::Relaxed};

/// Bytes in one frame.
pub const PAGE_SIZE: usize = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
/// The largest order the buddy allocator manages (blocks of 2^10 frames, 4 MiB).
pub const MAX_ORDER: u32 = 10;
/// Number of orders, `0..=MAX_ORDER`.
pub const NR_ORDERS: usize = MAX_ORDER as usize + 1;
/// Frames in the largest block.
pub const MAX_ORDER_NR_PAGES: usize = 1 << MAX_ORDER;

/// A handle to one frame (or the first frame of a block): its frame number.
///
/// Plain data, `Copy`, 4 bytes, and `Option<Page>` is 4 bytes too. Holding a
/// `Page` does not keep the frame allocated: the hot path passes these
/// around like the kernel passes `struct page *`. For ownership that frees
/// itself, use [`crate::PageBox`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct Page(NonZeroU32);

impl Page {
    /// The page with frame number `pfn`.
    ///
    /// # Panics
    /// If `pfn == u32::MAX` (never a valid frame).
    #[inline]
    pub fn from_pfn(pfn: u32) -> Page {
        Page(NonZeroU32::new(pfn.wrapping_add(1)).expect("pfn u32::MAX is not a frame number"))
    }

    /// This page's frame number: its offset in the arena divided by 4096.
    #[inline]
    pub fn pfn(self) -> u32 {
        self.0.get() - 1
    }

    /// The number a cache slot holds for this page (its frame number + 1,
    /// as the C view's slots).
    #[inline(always)]
    pub(crate) fn slot(self) -> u32 {
        self.0.get()
    }
}

impl std::fmt::Debug for Page {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Page(pfn {})", self.pfn())
    }
}

/// Copy `n` page handles from `src` to `dst`.
///
/// Short runs are the common case of small bulk calls, and a `memcpy` call
/// costs more than moving a few words; a loop would be turned into that
/// call by the compiler, so lengths up to 16 become copies of constant size
/// (plain moves), longer ones one `memcpy`.
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `n` handles (in the
/// layout of `Page`, which `Option<Page>` and `MaybeUninit<Page>` share), and
/// the ranges must not overlap.
#[inline(always)]
pub(crate) unsafe fn copy_pages(dst: *mut Page, src: *const Page, n: usize) {
    macro_rules! fixed {
        ($($k:literal)*) => {
            match n {
                0 => {}
                // SAFETY: the caller's promise: `n` handles readable at
                // `src`, writable at `dst`, no overlap (`[Page; k]` has
                // alignment 4, as `Page` has).
                $($k => unsafe { std::ptr::copy_nonoverlapping(src.cast::<[Page; $k]>(), dst.cast::<[Page; $k]>(), 1) },)*
                // SAFETY: as above.
                _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, n) },
            }
        };
    }
    fixed!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
}

/// Copy `n` page handles from `src` to `dst` in reverse order: `dst[0]` is
/// `src[n - 1]`. Taking a run off the top of a stack this way hands out the
/// most recently freed (cache-warmest) page first, as a stack pop does; and
/// when the caller frees the run in the order it got it, the next run comes
/// back reversed again, so a loop over the pages alternates direction and
/// finds the last pages it wrote still in cache (a run longer than a cache
/// set's ways, walked in the same direction every time, misses on every
/// page under LRU).
///
/// # Safety
/// As [`copy_pages`].
#[inline(always)]
pub(crate) unsafe fn copy_pages_rev(dst: *mut Page, src: *const Page, n: usize) {
    macro_rules! fixed {
        ($($k:literal)*) => {
            match n {
                0 => {}
                $($k => {
                    // SAFETY: the caller's promise: `n` handles readable at
                    // `src` and writable at `dst`.
                    let mut run = unsafe { src.cast::<[Page; $k]>().read_unaligned() };
                    run.reverse();
                    // SAFETY: as above.
                    unsafe { dst.cast::<[Page; $k]>().write_unaligned(run) };
                })*
                _ => {
                    for i in 0..n {
                        // SAFETY: `i` and `n - 1 - i` are below `n`, inside
                        // both ranges the caller vouches for.
                        unsafe { dst.add(i).write(src.add(n - 1 - i).read()) };
                    }
                }
            }
        };
    }
    fixed!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
}

/// Set `n` slots to `None` (zero bits), with constant-size stores for short
/// runs as in [`copy_pages`].
///
/// # Safety
/// `dst` must be valid for writing `n` slots.
#[inline(always)]
pub(crate) unsafe fn clear_slots(dst: *mut Option<Page>, n: usize) {
    macro_rules! fixed {
        ($($k:literal)*) => {
            match n {
                0 => {}
                // SAFETY: the caller's promise: `n` slots writable at `dst`.
                $($k => unsafe { dst.cast::<[Option<Page>; $k]>().write([None; $k]) },)*
                // SAFETY: as above; all-zero bits are `None`.
                _ => unsafe { std::ptr::write_bytes(dst, 0, n) },
            }
        };
    }
    fixed!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
}

/// Frame flags (bits of a frame's flags word, see [`FrameInfo::flags`]).
pub mod flags {
    /// Head of a free block in the buddy's free lists; `order` is its order.
    pub const BUDDY: u16 = 1 << 0;
    /// Handed out to a caller (kept only when allocation checks are on).
    pub const ALLOCATED: u16 = 1 << 1;
    /// First frame of a compound page; `order` is the compound order.
    pub const HEAD: u16 = 1 << 2;
    /// A later frame of a compound page; the owner word holds the head's pfn.
    pub const TAIL: u16 = 1 << 3;
}

/// No frame: the end of a free list.
pub(crate) const NIL: u32 = u32::MAX;

/// Metadata for one frame: 16 bytes (the kernel's `struct page` is 64).
///
/// Layout and who may touch what:
/// - `flags`, `order`: written by the zone under its lock while the frame
///   is free, and by the allocation path when it hands a frame out with
///   checks on or as a compound page.
/// - `pins`: on a folio's head frame, the pins I/O holds on its pages
///   (`pin_folio`); zero whenever the frame is free — a pinned folio is
///   never freed.
/// - `link_prev`: while free in the buddy, the previous block on its free
///   list.
/// - `link_or_owner`: while free in the buddy, the next block on its free
///   list; while allocated, an owner word for the user (or, on a compound
///   tail, the head's pfn).
///
/// All fields are atomics so that readers outside the zone lock (statistics,
/// pins) are well defined; the zone's own accesses are `Relaxed` under its
/// lock and compile to plain loads and stores.
#[repr(C)]
#[derive(Default)]
pub struct Frame {
    pub(crate) flags: AtomicU16,
    pub(crate) order: AtomicU8,
    _reserved: u8,
    pub(crate) pins: AtomicU32,
    pub(crate) link_prev: AtomicU32,
    pub(crate) link_or_owner: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Frame>() == 16);
const _: () = assert!(std::mem::size_of::<Option<Page>>() == 4);

impl Frame {
    #[inline]
    pub(crate) fn flags(&self) -> u16 {
        self.flags.load(Relaxed)
    }
    #[inline]
    pub(crate) fn set_flags(&self, v: u16) {
        self.flags.store(v, Relaxed)
    }
    #[inline]
    pub(crate) fn order(&self) -> u32 {
        self.order.load(Relaxed) as u32
    }
    #[inline]
    pub(crate) fn set_order(&self, order: u32) {
        debug_assert!(order <= MAX_ORDER);
        self.order.store(order as u8, Relaxed)
    }
    #[inline]
    pub(crate) fn prev(&self) -> u32 {
        self.link_prev.load(Relaxed)
    }
    #[inline]
    pub(crate) fn next(&self) -> u32 {
        self.link_or_owner.load(Relaxed)
    }
    #[inline]
    pub(crate) fn set_prev(&self, v: u32) {
        self.link_prev.store(v, Relaxed)
    }
    #[inline]
    pub(crate) fn set_next(&self, v: u32) {
        self.link_or_owner.store(v, Relaxed)
    }
}

/// A snapshot of one frame's metadata, for inspection and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameInfo {
    /// Flag bits, see [`flags`].
    pub flags: u16,
    /// Order recorded on the frame (meaningful on buddy and compound heads).
    pub order: u32,
    /// Pins held on the folio this frame heads.
    pub pincount: u32,
    /// Owner word while allocated (a free-list link while free).
    pub owner: u32,
}

impl Frame {
    pub(crate) fn info(&self) -> FrameInfo {
        FrameInfo {
            flags: self.flags(),
            order: self.order(),
            pincount: self.pins.load(Relaxed),
            owner: self.link_or_owner.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn reversed_copies_of_every_length_are_exact() {
        for n in 0..40u32 {
            let src: Vec<Page> = (0..n).map(Page::from_pfn).collect();
            let mut dst = vec![Page::from_pfn(999); n as usize + 1];
            // SAFETY: both buffers hold at least `n` handles.
            unsafe { copy_pages_rev(dst.as_mut_ptr(), src.as_ptr(), n as usize) };
            let want: Vec<Page> = (0..n).rev().map(Page::from_pfn).collect();
            assert_eq!(&dst[..n as usize], &want[..], "n = {n}");
            assert_eq!(dst[n as usize], Page::from_pfn(999), "wrote past n = {n}");
        }
    }

    use super::*;

    #[test]
    fn page_round_trips_pfn_including_zero() {
        for pfn in [0u32, 1, 4095, u32::MAX - 1] {
            assert_eq!(Page::from_pfn(pfn).pfn(), pfn);
        }
    }

    #[test]
    fn frame_metadata_is_16_bytes() {
        assert_eq!(std::mem::size_of::<Frame>(), 16);
    }
}
