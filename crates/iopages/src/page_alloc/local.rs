//! A per-thread handle on the allocator: the magazine in the caller's hands.
//!
//! Owns: one cache of free blocks (orders 0..=3) that belongs to the handle
//! rather than to a thread, and the lean fast path over it — a length check
//! and a copy, as DPDK's per-lcore mempool cache and SPDK's iobuf channel
//! cost. Must never: let two callers touch the cache at once (every method
//! takes `&mut self`), hide pages from the accounting (the cache is
//! registered with the allocator, and its pages are counted as thread-cache
//! pages), or keep pages after it is dropped (drop gives them all back).
//!
//! Why: [`PageAllocator::alloc_pages`] finds the calling thread's cache
//! through a thread-local table on every call. An I/O engine that
//! allocates in a loop on its own worker knows which cache it uses; holding
//! a `LocalAllocator` hoists the lookup out of the loop. What is left on a
//! hit is DPDK's per-lcore cache operation: one compare of the length with
//! a bound, a copy, one store of the new length. Every other condition
//! lives in the bounds: allocations compare with the fault injector's
//! floor (raised above every length while injection is on, with checks on,
//! or with every call counted), frees with the handle's fast capacity (0
//! with checks or counting on), and flags that need preparing are a mask
//! that folds away when `gfp` is a constant. Nothing is counted on a hit
//! (see [`crate::PageAllocatorBuilder::fast_path_stats`]). The four fast
//! paths are `#[inline(always)]` (DPDK's are `static inline` in its
//! header): called out of line from a large function, as the E1 harness
//! once did, a batch-of-one round trip cost 7.9 ns instead of 5.

use crate::buddy::frame::{copy_pages, copy_pages_rev, Page};
use crate::gfp::Gfp;
use crate::page_alloc::fastpath::PREPARED;
use crate::page_alloc::{Core, PageAllocator};
use crate::percpu::pcp::bump;
use crate::percpu::tcache::{Owner, Tcache};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// A handle that owns a page cache: allocate and free in loops without a
/// thread-local lookup. Create one per worker thread (or per task) with
/// [`PageAllocator::local`]; it may move between threads (`Send`), and every
/// call takes `&mut self`, so one caller at a time uses it. Dropping it
/// gives its cached pages back.
///
/// ```
/// use iopages::{Gfp, PageAllocator};
/// let alloc = PageAllocator::new(8 << 20).unwrap();
/// let mut local = alloc.local();
/// let mut batch = Vec::with_capacity(64);
/// assert_eq!(local.alloc_bulk(Gfp::KERNEL, 64, &mut batch), 64);
/// // SAFETY: the pages were just allocated and nothing else holds them.
/// unsafe { local.free_bulk(&mut batch) }; // empties `batch`
/// let page = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
/// // SAFETY: as above.
/// unsafe { local.free_pages(page, 0) };
/// drop(local);
/// assert!(alloc.leak_check().is_ok());
/// ```
pub struct LocalAllocator {
    /// The order-0 stack of `tc`: `buf[..len]` are cached pages.
    buf: *mut Page,
    /// `tc`'s order-0 length: the one record of how many pages are
    /// cached, read by other threads' accounting, written only here (and
    /// by code using [`LocalAllocator::fast_path`]'s view).
    len: *const AtomicUsize,
    /// Most pages the cache holds.
    cap: usize,
    /// A free is a fast-path hit only below this length: `cap`, or 0 when
    /// every free must be checked or counted.
    fast_cap: usize,
    /// The allocator's allocation floor (kept alive by `alloc`).
    floor: *const AtomicUsize,
    /// Batches of 2 to `SMALL` freed into the cache as packed stores
    /// ([`crate::PageAllocatorBuilder::pack_small_batches`]).
    pack_small: bool,
    tc: Arc<Tcache>,
    alloc: PageAllocator,
}

// The single-page slow paths take what they need from the handle, never
// the handle itself: a loop around the fast paths then keeps the handle's
// fields in registers (its address goes nowhere, so the compiler knows
// that no store to a page writes it), and the cache length's store and
// the next load use one register, which lets the CPU forward between
// them early. With the slot left alone on a free (`push_unchecked`), E1's
// single-page round went from 2.2 to 1.15 ns (Intel Xeon); this alone, to
// 1.9-2.3.
#[cold]
#[inline(never)]
fn alloc_pages_slow(core: &Core, cache: Option<&Tcache>, gfp: Gfp, order: u32) -> Option<Page> {
    core.alloc_cached(gfp, order, move || cache)
}

#[cold]
#[inline(never)]
fn free_pages_slow(core: &Core, cache: Option<&Tcache>, page: Page, order: u32) {
    core.free_cached(page, order, move || cache);
}

/// Flags a fast-path allocation never serves: pages to prepare (`ZERO`,
/// `COMP`) and movable pages (kept out of the type-agnostic caches).
const CAREFUL: Gfp = PREPARED.union(Gfp::MOVABLE);

/// Batches of at most this many pages are freed into the cache through a
/// small array (see [`LocalAllocator::fill_small`]).
const SMALL: usize = 4;

// SAFETY: the raw pointers point into `tc` and the allocator, which the
// handle keeps alive wherever it goes; `tc` is used only through
// `&mut self` (one caller at a time), which is the cache's ownership rule.
unsafe impl Send for LocalAllocator {}

/// Where a handle keeps the state of its order-0 fast paths, for code that
/// runs those fast paths itself: the C ABI's inline functions in
/// `iopages.h`, as DPDK's header inlines its per-lcore cache.
///
/// The view points at the handle's shared record, which is the handle's
/// only copy of its length: code using the view and the handle's own
/// calls may take turns freely (one thread at a time). Code using the view
/// must do what [`LocalAllocator::alloc_cached`] and
/// [`LocalAllocator::free_cached`] do: allocate from `buf[..len]` only
/// when `len > *floor` (and `gfp` has none of `careful`), free above it
/// only when `len < cap`, and store the new length to `len` (relaxed
/// loads and stores: the handle's thread is the only writer); take the
/// full path otherwise. Nothing is counted on the fast path.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LocalFastPath {
    /// The cached order-0 pages, `buf[..len]`, each a [`Page`]'s `u32`
    /// (frame number + 1).
    pub buf: *mut u32,
    /// How many pages are cached.
    pub len: *const AtomicUsize,
    /// A free is a fast-path hit only while `len` is below this: the
    /// cache's capacity, or 0 when checks or counting send every free to
    /// the full path.
    pub cap: usize,
    /// An allocation is a fast-path hit only while `len` is above this
    /// (load relaxed): 0, or `usize::MAX` while fault injection is on, or
    /// for good with checks or counting on.
    pub floor: *const AtomicUsize,
    /// Allocation flags that need the full path.
    pub careful: u32,
    /// Whether the handle writes batches of 2 to 4 pages into the cache
    /// as packed 8-byte stores
    /// ([`crate::PageAllocatorBuilder::pack_small_batches`]); code using
    /// the view should store them the same way (only speed differs).
    pub pack_small: bool,
}

impl PageAllocator {
    /// A handle with its own page cache, for a worker that allocates and
    /// frees in a loop (see [`LocalAllocator`]). With thread caches off
    /// (`thread_cache_pages(0)`) the handle has no cache and every call
    /// takes the shared path.
    ///
    /// **Context:** takes the allocator's registry lock once.
    pub fn local(&self) -> LocalAllocator {
        let core = self.core();
        let tc = Arc::new(Tcache::new(core.local_cap(), core.careful));
        core.tcache_register(&tc);
        LocalAllocator {
            // SAFETY: the handle owns the new cache.
            buf: unsafe { tc.raw(0) },
            len: tc.len_ptr(0),
            cap: tc.cap[0],
            fast_cap: tc.fast_cap,
            floor: self.fault().alloc_floor(),
            pack_small: core.pack_small(),
            tc,
            alloc: self.clone(),
        }
    }
}

impl LocalAllocator {
    /// The allocator this handle allocates from.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// Pages held in this handle's cache.
    pub fn cached_pages(&self) -> usize {
        self.tc.nr_pages()
    }

    /// How many pages are cached (the shared record's relaxed load).
    #[inline(always)]
    fn len(&self) -> usize {
        // SAFETY: the record lives in `tc`, which the handle keeps.
        unsafe { &*self.len }.load(Relaxed)
    }

    #[inline(always)]
    fn set_len(&self, n: usize) {
        debug_assert!(n <= self.cap);
        // SAFETY: as in `len`; the handle's caller is the only writer.
        unsafe { &*self.len }.store(n, Relaxed);
    }

    /// The allocation floor: a hit needs `len > floor`.
    #[inline(always)]
    fn floor(&self) -> usize {
        // SAFETY: the floor lives in the allocator, which `alloc` keeps.
        unsafe { &*self.floor }.load(Relaxed)
    }

    /// Whether an allocation with `gfp` must take the careful path
    /// whatever the cache holds (what the floor and the mask say).
    #[inline(always)]
    fn careful(&self, gfp: Gfp) -> bool {
        gfp.intersects(CAREFUL) || self.floor() == usize::MAX
    }

    /// Allocate a block of 2^`order` frames (as
    /// [`PageAllocator::alloc_pages`]).
    ///
    /// **Context / Returns:** as [`PageAllocator::alloc_pages`].
    #[inline(always)]
    pub fn alloc_pages(&mut self, gfp: Gfp, order: u32) -> Option<Page> {
        if order == 0 {
            if let Some(p) = self.alloc_cached(gfp) {
                return Some(p);
            }
        }
        alloc_pages_slow(self.alloc.core(), self.cache(), gfp, order)
    }

    /// The fast path of [`LocalAllocator::alloc_pages`] alone: an order-0
    /// page from the handle's cache, or `None` where the full path is
    /// needed (the cache is empty; `gfp`, checks or fault injection ask
    /// for the careful path). For callers that keep their own slow path
    /// out of line, as the C ABI does: its fast path then needs no stack
    /// frame.
    ///
    /// **Context:** never blocks.
    #[inline(always)]
    pub fn alloc_cached(&mut self, gfp: Gfp) -> Option<Page> {
        let len = self.len();
        if gfp.intersects(CAREFUL) || len <= self.floor() {
            return None;
        }
        // SAFETY: `0 < len <= cap`: the cache holds `len` pages.
        Some(unsafe { self.pop_unchecked(len) })
    }

    /// The top page of a cache holding `len` pages, taken out of it.
    ///
    /// # Safety
    /// `len` is the cache's length, and `0 < len`.
    #[inline(always)]
    unsafe fn pop_unchecked(&mut self, len: usize) -> Page {
        debug_assert!(len > 0 && len <= self.cap && len == self.len());
        // SAFETY: slots below `len` are initialised (the caller's promise),
        // and the handle is the cache's only user.
        let p = unsafe { self.buf.add(len - 1).read() };
        self.set_len(len - 1);
        p
    }

    /// The handle's cache for the shared paths (none when thread caches
    /// are off).
    #[inline]
    pub(super) fn cache(&self) -> Option<&Tcache> {
        (self.cap > 0).then_some(&*self.tc)
    }

    /// Free a block allocated with this order (by this handle, another
    /// handle, or the allocator).
    ///
    /// **Context:** never blocks. With checks on, a double free panics.
    ///
    /// # Safety
    /// As [`PageAllocator::free_pages`]: the caller owns the block, and
    /// nothing else uses it as its own afterwards.
    #[inline(always)]
    pub unsafe fn free_pages(&mut self, page: Page, order: u32) {
        // SAFETY: the caller's promise, passed on.
        if order == 0 && unsafe { self.free_cached(page) } {
            return;
        }
        free_pages_slow(self.alloc.core(), self.cache(), page, order)
    }

    /// The fast path of [`LocalAllocator::free_pages`] for an order-0
    /// page alone: into the handle's cache, or `false` (nothing done)
    /// where the full path is needed (the cache is full, or checks are
    /// on). The counterpart of [`LocalAllocator::alloc_cached`].
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// As [`LocalAllocator::free_pages`], when it returns `true`.
    #[inline(always)]
    pub unsafe fn free_cached(&mut self, page: Page) -> bool {
        let len = self.len();
        if len >= self.fast_cap {
            return false;
        }
        // SAFETY: `len < fast_cap <= cap`; the caller's promise for `page`.
        unsafe { self.push_unchecked(len, page) };
        true
    }

    /// Put `page` on a cache holding `len` pages.
    ///
    /// # Safety
    /// `len` is the cache's length and `len < cap`; the caller owns `page`.
    #[inline(always)]
    unsafe fn push_unchecked(&mut self, len: usize, page: Page) {
        debug_assert!(len < self.cap && len == self.len());
        // SAFETY: the slot is inside the buffer, whose every slot is
        // initialised memory (zeroed when made; read as a number, as it may
        // hold no page); the handle is the cache's only user.
        unsafe {
            let slot = self.buf.add(len);
            if slot.cast::<u32>().read() != page.slot() {
                slot.write(page);
            }
        }
        self.set_len(len + 1);
    }

    /// Append `nr` order-0 pages to `out` (DPDK's `rte_mempool_get_bulk`,
    /// but it may hand out fewer than asked when memory is short).
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** how many
    /// were appended.
    #[inline(always)]
    pub fn alloc_bulk(&mut self, gfp: Gfp, nr: usize, out: &mut Vec<Page>) -> usize {
        if let Some(len) = self.alloc_room(gfp, nr) {
            out.reserve(nr);
            // SAFETY: `alloc_room` checked `nr <= len`.
            let taken = unsafe { self.take_unchecked(len, nr) };
            // SAFETY: `out` has room for `nr` more; the two buffers are
            // different allocations.
            unsafe {
                copy_pages_rev(out.as_mut_ptr().add(out.len()), taken.as_ptr(), nr);
                out.set_len(out.len() + nr);
            }
            return nr;
        }
        self.alloc_bulk_slow(gfp, nr, out)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn alloc_bulk_slow(&mut self, gfp: Gfp, nr: usize, out: &mut Vec<Page>) -> usize {
        bump(&self.tc.bulk_allocs, 1);
        let start = out.len();
        out.reserve(nr);
        if self.careful(gfp) || self.cap == 0 {
            // Every page a separate attempt with every check: callers see
            // partial fills under fault injection.
            while out.len() - start < nr {
                match self.alloc_pages(gfp, 0) {
                    Some(p) => out.push(p),
                    None => break,
                }
            }
            return out.len() - start;
        }
        let core = self.alloc.core();
        let tc = &*self.tc;
        // What the cache holds, then whole batches: a magazine from the
        // depot or a refill from this CPU's list for small requests, one
        // hold of the list for large ones.
        for _ in 0..3 {
            let want = nr - (out.len() - start);
            let k = tc.len(0).min(want);
            // SAFETY: the handle is the cache's only user; the slice is
            // copied out before the cache is touched again.
            out.extend(unsafe { tc.take_top(0, k) }.iter().rev());
            bump(&tc.allocs, k as u64);
            if k == want {
                break;
            }
            let rest = want - k;
            if rest > self.cap / 2 {
                core.take_fast(0, rest, |run| out.extend_from_slice(run));
            } else if let Some(p) = core.tcache_refill(tc, 0) {
                bump(&tc.allocs, 1);
                out.push(p);
            }
        }
        // Whatever is still missing, one page at a time through the full
        // path: watermarks, the slow path, reclaim.
        while out.len() - start < nr {
            match core.alloc_uncached(gfp, 0) {
                Some(p) => out.push(p),
                None => break,
            }
        }
        out.len() - start
    }

    /// Free every order-0 page in `pages` and empty it (the counterpart of
    /// [`LocalAllocator::alloc_bulk`]).
    ///
    /// **Context:** never blocks. With checks on, a double free panics.
    ///
    /// # Safety
    /// As [`PageAllocator::free_pages_bulk`]: the caller owns every page
    /// of `pages` (each once), and nothing else uses them afterwards.
    #[inline(always)]
    pub unsafe fn free_bulk(&mut self, pages: &mut Vec<Page>) {
        let n = pages.len();
        if let Some(len) = self.free_room(n) {
            // SAFETY: the caller's promise; every slot is written (the
            // buffers are different allocations).
            unsafe {
                self.fill_unchecked(len, n, |slots| {
                    copy_pages(slots.as_mut_ptr().cast(), pages.as_ptr(), n);
                    true
                })
            };
            pages.clear();
            return;
        }
        self.free_bulk_slow(pages)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn free_bulk_slow(&mut self, pages: &mut Vec<Page>) {
        bump(&self.tc.bulk_frees, 1);
        let core = self.alloc.core();
        let tc = &*self.tc;
        if core.checks {
            for &p in pages.iter() {
                core.free_prep(p, 0);
            }
        }
        let room = (self.cap - tc.len(0)).min(pages.len());
        // SAFETY: the handle is the cache's only user; `room` pages fit.
        unsafe { tc.extend(0, &pages[..room]) };
        bump(&tc.frees, room as u64);
        let rest = &pages[room..];
        if !rest.is_empty() {
            if rest.len() <= self.cap / 2 {
                // Make room by handing the oldest half on (a magazine to the
                // depot), then cache the rest: the next allocation finds
                // them warm.
                core.tcache_flush(tc, 0);
                // SAFETY: as above; the flush freed half the cache.
                unsafe { tc.extend(0, rest) };
                bump(&tc.frees, rest.len() as u64);
            } else {
                core.give_pages(0, rest);
            }
        }
        pages.clear();
    }

    /// Allocate `nr` order-0 pages and show them to `take` as one slice,
    /// for callers that keep pages as something else (addresses, another
    /// handle type): [`LocalAllocator::alloc_bulk`] would copy each page into
    /// a vector only for the caller to copy it again. On the fast path the
    /// slice is the top of the handle's cache; otherwise the pages are
    /// gathered in `spill` (cleared first; its capacity is reused, so keep
    /// one per handle). The pages are the caller's from the moment `take`
    /// runs: it must keep (copy out) every one. Their order is unspecified;
    /// on the fast path the last page is the most recently freed, so a
    /// caller that walks the slice from its end hands out the warmest page
    /// first (as [`LocalAllocator::alloc_bulk`] and the C ABI's address
    /// paths do).
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** what
    /// `take` returns; the slice is shorter than `nr` when memory is short.
    #[inline(always)]
    pub fn alloc_bulk_with<R>(
        &mut self,
        gfp: Gfp,
        nr: usize,
        spill: &mut Vec<Page>,
        take: impl FnOnce(&[Page]) -> R,
    ) -> R {
        if let Some(len) = self.alloc_room(gfp, nr) {
            // SAFETY: `alloc_room` checked `nr <= len`.
            return take(unsafe { self.take_unchecked(len, nr) });
        }
        spill.clear();
        self.alloc_bulk_slow(gfp, nr, spill);
        take(spill)
    }

    /// The fast path of [`LocalAllocator::alloc_bulk_with`] alone: `None`
    /// (and `take` not called) where the full path is needed. For callers
    /// that keep their own slow path out of line (the C ABI).
    ///
    /// **Context:** never blocks.
    #[inline(always)]
    pub fn alloc_bulk_cached<R>(
        &mut self,
        gfp: Gfp,
        nr: usize,
        take: impl FnOnce(&[Page]) -> R,
    ) -> Option<R> {
        let len = self.alloc_room(gfp, nr)?;
        // SAFETY: `alloc_room` checked `nr <= len`.
        Some(take(unsafe { self.take_unchecked(len, nr) }))
    }

    /// The cache's length when `nr` pages may be taken on the fast path
    /// (`gfp` needs no preparing, and `nr + floor <= len`: one compare,
    /// the floor raised above every length when calls must be careful).
    #[inline(always)]
    fn alloc_room(&self, gfp: Gfp, nr: usize) -> Option<usize> {
        let len = self.len();
        (!gfp.intersects(CAREFUL) && nr.saturating_add(self.floor()) <= len).then_some(len)
    }

    /// The cache's length when `nr` pages may be freed into it on the
    /// fast path (`len + nr <= fast_cap`: one compare).
    #[inline(always)]
    fn free_room(&self, nr: usize) -> Option<usize> {
        let len = self.len();
        (nr <= self.fast_cap.saturating_sub(len)).then_some(len)
    }

    /// The top `nr` pages of a cache holding `len`, taken out of it.
    ///
    /// # Safety
    /// `len` is the cache's length and `nr <= len`.
    #[inline(always)]
    unsafe fn take_unchecked(&mut self, len: usize, nr: usize) -> &[Page] {
        debug_assert!(nr <= len && len <= self.cap && len == self.len());
        let at = len - nr;
        // The pages leave the cache before the caller sees them, so a
        // panic in the caller loses them rather than leaving them both
        // cached and handed out.
        self.set_len(at);
        // SAFETY: slots `at..at + nr` are initialised and, being above
        // `len` now, no longer the cache's; nothing writes them while the
        // slice borrows the handle.
        unsafe { std::slice::from_raw_parts(self.buf.add(at), nr) }
    }

    /// Free `nr` order-0 pages that `fill` writes straight into the
    /// handle's cache (the counterpart of
    /// [`LocalAllocator::alloc_bulk_with`]): `fill` gets `nr` slots, writes
    /// every one, and returns whether to free them — `false` frees nothing,
    /// for callers that check what they convert and refuse a whole batch
    /// over one bad entry. Where the cache has no room (or checks are on)
    /// the slots are in `spill` and the pages go the slow way.
    ///
    /// **Context:** never blocks. With checks on, a double free panics.
    /// **Returns:** what `fill` returned.
    ///
    /// # Safety
    /// When `fill` returns `true`, it has written all `nr` slots with pages
    /// the caller owns (each once) and that nothing uses afterwards, as for
    /// [`PageAllocator::free_pages_bulk`].
    #[inline(always)]
    pub unsafe fn free_bulk_with(
        &mut self,
        nr: usize,
        spill: &mut Vec<Page>,
        fill: impl FnOnce(&mut [MaybeUninit<Page>]) -> bool,
    ) -> bool {
        if let Some(len) = self.free_room(nr) {
            // SAFETY: the caller's promise, passed on; `nr` slots fit.
            return unsafe { self.fill_unchecked(len, nr, fill) };
        }
        spill.clear();
        spill.reserve(nr);
        if !fill(&mut spill.spare_capacity_mut()[..nr]) {
            return false;
        }
        // SAFETY: `fill` wrote all `nr` slots (the caller's promise).
        unsafe { spill.set_len(nr) };
        self.free_bulk_slow(spill);
        true
    }

    /// The fast path of [`LocalAllocator::free_bulk_with`] alone: `None`
    /// (and `fill` not called) where the full path is needed (no room in
    /// the cache, or checks on). For callers that keep their own slow path
    /// out of line (the C ABI).
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// As [`LocalAllocator::free_bulk_with`].
    #[inline(always)]
    pub unsafe fn free_bulk_cached(
        &mut self,
        nr: usize,
        fill: impl FnOnce(&mut [MaybeUninit<Page>]) -> bool,
    ) -> Option<bool> {
        let len = self.free_room(nr)?;
        // SAFETY: the caller's promise, passed on; `nr` slots fit.
        Some(unsafe { self.fill_unchecked(len, nr, fill) })
    }

    /// `fill` writes `nr` slots above the top of a cache holding `len`;
    /// kept if it says so.
    ///
    /// # Safety
    /// `len` is the cache's length and `len + nr <= cap`; otherwise as
    /// [`LocalAllocator::free_bulk_with`].
    #[inline(always)]
    unsafe fn fill_unchecked(
        &mut self,
        len: usize,
        nr: usize,
        fill: impl FnOnce(&mut [MaybeUninit<Page>]) -> bool,
    ) -> bool {
        debug_assert!(nr <= self.cap - len && len == self.len());
        if nr == 1 {
            let mut one = [MaybeUninit::<Page>::uninit()];
            if !fill(&mut one) {
                return false;
            }
            // SAFETY: `fill` wrote the slot (the caller's promise); `len <
            // cap` as `len + 1 <= cap`.
            unsafe { self.push_unchecked(len, one[0].assume_init()) };
            return true;
        }
        if self.pack_small && (2..=SMALL).contains(&nr) && len + SMALL <= self.cap {
            // SAFETY: as below, for `SMALL` slots.
            return unsafe { self.fill_small(len, nr, fill) };
        }
        // SAFETY: the slots `len..len + nr` are inside the buffer and above
        // `len`, so not the cache's until `len` moves; the handle is the
        // cache's only user.
        let slots = unsafe {
            std::slice::from_raw_parts_mut(self.buf.add(len).cast::<MaybeUninit<Page>>(), nr)
        };
        if !fill(slots) {
            return false;
        }
        self.set_len(len + nr);
        true
    }

    /// [`LocalAllocator::fill_unchecked`] for a batch of 2 to `SMALL`:
    /// `fill` writes a small array, which goes into the cache as one
    /// 8-byte store per two slots. The next allocation reads the slots
    /// one by one (or two by two, vectorised); with fewer, wider stores
    /// behind them the CPU's store-to-load forwarding predictor pairs the
    /// loads with the right stores, where one store per slot made it guess
    /// wrong and flush the pipeline once per round (E1, AMD EPYC: batches
    /// of 2 cost 14 ns per page, of 4 3).
    ///
    /// # Safety
    /// As [`LocalAllocator::fill_unchecked`], and `len + SMALL <= cap`.
    #[inline(always)]
    unsafe fn fill_small(
        &mut self,
        len: usize,
        nr: usize,
        fill: impl FnOnce(&mut [MaybeUninit<Page>]) -> bool,
    ) -> bool {
        let mut tmp = [MaybeUninit::new(Page::from_pfn(0)); SMALL];
        if !fill(&mut tmp[..nr]) {
            return false;
        }
        // Each slot's bits, read as the 4 bytes `fill` wrote; packed in
        // pairs, so each 8-byte store below covers two slots.
        // SAFETY: every element is initialised (placeholders past `nr`).
        let raw = |i: usize| u64::from(unsafe { tmp[i].assume_init() }.pfn().wrapping_add(1));
        // SAFETY: `len + SMALL <= cap`: the slots are inside the buffer,
        // and those from `len` on are not the cache's; the ones past `nr`
        // get placeholders and stay above the length.
        unsafe {
            let at = self.buf.add(len).cast::<u64>();
            at.write_unaligned(raw(0) | raw(1) << 32);
            if nr > 2 {
                at.add(1).write_unaligned(raw(2) | raw(3) << 32);
            }
        }
        self.set_len(len + nr);
        true
    }

    /// The state of this handle's order-0 fast paths, for code that runs
    /// them itself (see [`LocalFastPath`]).
    ///
    /// # Safety
    /// `this` points to a live handle. The pointers are valid while the
    /// handle lives and stays where it is, and may be used only by one
    /// thread at a time and never during a call on the handle.
    pub unsafe fn fast_path(this: *mut LocalAllocator) -> LocalFastPath {
        // SAFETY: `this` is live (the caller's promise); the fields are
        // copied without making a reference to the whole handle.
        unsafe {
            LocalFastPath {
                buf: (*this).buf.cast(),
                len: (*this).len,
                cap: (*this).fast_cap,
                floor: (*this).floor,
                careful: CAREFUL.bits(),
                pack_small: (*this).pack_small,
            }
        }
    }

    /// Give every cached page back to the per-CPU lists.
    ///
    /// **Context:** never blocks.
    pub fn flush(&mut self) {
        self.alloc.core().tcache_flush_all(&self.tc);
    }
}

impl Drop for LocalAllocator {
    fn drop(&mut self) {
        self.alloc.core().tcache_retire(&self.tc);
    }
}

impl std::fmt::Debug for LocalAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalAllocator")
            .field("cached_pages", &self.cached_pages())
            .finish()
    }
}
