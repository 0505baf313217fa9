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
//! through a thread-local table on every call and runs every per-call check
//! (fault injection, allocation checks, flags). An I/O engine that allocates
//! in a loop on its own worker knows which cache it uses; holding a
//! `LocalAllocator` hoists the lookup and the checks out of the loop: the
//! allocation-checks flag, one mask of the flags that need the careful
//! path, and the fault-injection switch; statistics are per-handle
//! counters, summed when read. The four
//! fast paths are `#[inline(always)]` (DPDK's are `static inline` in its
//! header): called out of line from a large function, as the E1 harness
//! once did, a batch-of-one round trip cost 7.9 ns instead of 5.

use crate::buddy::frame::{copy_pages, copy_pages_rev, Page};
use crate::gfp::Gfp;
use crate::page_alloc::PageAllocator;
use crate::percpu::pcp::bump;
use crate::percpu::tcache::{Owner, Tcache};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
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
    /// The order-0 stack of `tc`, held here as plain state so that a loop
    /// keeps it in registers: `buf[..len]` are cached pages. Every change
    /// is mirrored into `tc` with plain stores (no read-modify-write), so
    /// other threads' accounting and statistics stay exact.
    buf: *mut Page,
    len: usize,
    cap: usize,
    /// Counts, mirrored into `tc` likewise.
    allocs: u64,
    frees: u64,
    bulk_allocs: u64,
    bulk_frees: u64,
    /// Flags that need the careful path: `ZERO`, `COMP` and `MOVABLE`
    /// (with allocation checks on, every call takes it: `checks`).
    careful: Gfp,
    checks: bool,
    /// The allocator's fault-injection switch (kept alive by `alloc`).
    fault_on: *const AtomicBool,
    tc: Arc<Tcache>,
    alloc: PageAllocator,
}

// SAFETY: the raw pointers point into `tc` and the allocator, which the
// handle keeps alive wherever it goes; `tc` is used only through
// `&mut self` (one caller at a time), which is the cache's ownership rule.
unsafe impl Send for LocalAllocator {}

/// Where a handle keeps the state of its order-0 fast paths, for code that
/// runs those fast paths itself: the C ABI's inline functions in
/// `iopages.h`, as DPDK's header inlines its per-lcore cache.
///
/// The view points at the handle's shared record (the atomics other
/// threads read), which is always current: the handle mirrors every change
/// into it. Code using the view must do what
/// [`LocalAllocator::alloc_cached`], [`LocalAllocator::free_cached`] and
/// their bulk forms do, on that record alone: take pages from
/// `buf[..len]` or put them above it, store the new length to `len`, and
/// add to each count (each a relaxed load and a relaxed store: the
/// handle's thread is the only writer); and take the full path whenever
/// those functions would decline. The handle's own copies of the length
/// and counts (kept for Rust loops, in registers) are then stale: call
/// [`LocalAllocator::resync`] before the next call on the handle.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LocalFastPath {
    /// The cached order-0 pages, `buf[..len]`, each a [`Page`]'s `u32`
    /// (frame number + 1).
    pub buf: *mut u32,
    /// How many pages are cached.
    pub len: *const AtomicUsize,
    /// Most pages the cache holds.
    pub cap: usize,
    /// Pages allocated through the handle's cache.
    pub allocs: *const AtomicU64,
    /// Pages freed into the handle's cache.
    pub frees: *const AtomicU64,
    /// Bulk allocation calls.
    pub bulk_allocs: *const AtomicU64,
    /// Bulk free calls.
    pub bulk_frees: *const AtomicU64,
    /// Allocation flags that need the full path.
    pub careful: u32,
    /// Allocation checks are on: every call takes the full path.
    pub checks: bool,
    /// Fault injection is on (load relaxed): allocations take the full path.
    pub fault_on: *const AtomicBool,
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
        let tc = Arc::new(Tcache::new(core.local_cap()));
        core.tcache_register(&tc);
        let checks = self.checks_enabled();
        LocalAllocator {
            // SAFETY: the handle owns the new cache.
            buf: unsafe { tc.raw(0) },
            len: 0,
            cap: tc.cap[0],
            allocs: 0,
            frees: 0,
            bulk_allocs: 0,
            bulk_frees: 0,
            careful: Gfp::ZERO | Gfp::COMP | Gfp::MOVABLE,
            checks,
            fault_on: self.fault().enabled_flag(),
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

    #[inline(always)]
    pub(super) fn fast(&self, gfp: Gfp) -> bool {
        // `checks` on its own: an empty flag set intersects nothing, so
        // the mask alone would let it past the allocation checks.
        // SAFETY: the switch lives in the allocator, which `alloc` keeps.
        !self.checks && !gfp.intersects(self.careful) && !unsafe { &*self.fault_on }.load(Relaxed)
    }

    /// Mirror the order-0 length and the counts into the shared record.
    #[inline(always)]
    pub(super) fn publish(&self) {
        self.tc.set_len(0, self.len);
    }

    /// Take the order-0 length and the counts back from the shared record:
    /// after a shared-path call (the record is current before one: every
    /// change is mirrored), or after code using
    /// [`LocalAllocator::fast_path`]'s view changed it.
    /// Costs five loads; needed before the handle's next call whenever
    /// such code ran (the C ABI does it at every entry).
    ///
    /// **Context:** never blocks.
    #[inline]
    pub fn resync(&mut self) {
        self.len = self.tc.len(0);
        self.allocs = self.tc.allocs.load(Relaxed);
        self.frees = self.tc.frees.load(Relaxed);
        self.bulk_allocs = self.tc.bulk_allocs.load(Relaxed);
        self.bulk_frees = self.tc.bulk_frees.load(Relaxed);
    }

    #[inline(always)]
    pub(super) fn count(c: &mut u64, shared: &AtomicU64, n: u64) {
        *c += n;
        shared.store(*c, Relaxed);
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
        self.alloc_pages_slow(gfp, order)
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
        if self.len == 0 || !self.fast(gfp) {
            return None;
        }
        self.len -= 1;
        // SAFETY: slots below the old `len` are initialised, and the
        // handle is the cache's only user.
        let p = unsafe { self.buf.add(self.len).read() };
        self.publish();
        Self::count(&mut self.allocs, &self.tc.allocs, 1);
        Some(p)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn alloc_pages_slow(&mut self, gfp: Gfp, order: u32) -> Option<Page> {
        let p = self.alloc.core().alloc_cached(gfp, order, || self.cache());
        self.resync();
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
        self.free_pages_slow(page, order)
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
        if self.checks || self.len >= self.cap {
            return false;
        }
        // SAFETY: the slot is inside the buffer; the handle is the cache's
        // only user.
        unsafe { self.buf.add(self.len).write(page) };
        self.len += 1;
        self.publish();
        Self::count(&mut self.frees, &self.tc.frees, 1);
        true
    }

    #[cold]
    #[inline(never)]
    pub(super) fn free_pages_slow(&mut self, page: Page, order: u32) {
        self.alloc.core().free_cached(page, order, || self.cache());
        self.resync();
    }

    /// Append `nr` order-0 pages to `out` (DPDK's `rte_mempool_get_bulk`,
    /// but it may hand out fewer than asked when memory is short).
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** how many
    /// were appended.
    #[inline(always)]
    pub fn alloc_bulk(&mut self, gfp: Gfp, nr: usize, out: &mut Vec<Page>) -> usize {
        if nr <= self.len && self.fast(gfp) {
            out.reserve(nr);
            let taken = self.take_cached(nr);
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
        Self::count(&mut self.bulk_allocs, &self.tc.bulk_allocs, 1);
        let start = out.len();
        out.reserve(nr);
        if !self.fast(gfp) || self.cap == 0 {
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
        self.resync();
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
        if !self.checks && n <= self.cap - self.len {
            // SAFETY: the caller's promise; every slot is written (the
            // buffers are different allocations).
            unsafe {
                self.fill_cached(n, |slots| {
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
        Self::count(&mut self.bulk_frees, &self.tc.bulk_frees, 1);
        let core = self.alloc.core();
        let tc = &*self.tc;
        if self.checks {
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
        self.resync();
    }

    /// Allocate `nr` order-0 pages and show them to `take` as one slice,
    /// for callers that keep pages as something else (addresses, another
    /// handle type): [`LocalAllocator::alloc_bulk`] would copy each page into
    /// a vector only for the caller to copy it again. On the fast path the
    /// slice is the top of the handle's cache; otherwise the pages are
    /// gathered in `spill` (cleared first; its capacity is reused, so keep
    /// one per handle). The pages are the caller's from the moment `take`
    /// runs: it must keep (copy out) every one. Their order is unspecified.
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
        if nr <= self.len && self.fast(gfp) {
            return take(self.take_cached(nr));
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
        if nr > self.len || !self.fast(gfp) {
            return None;
        }
        Some(take(self.take_cached(nr)))
    }

    /// The top `nr` pages of the cache, taken out of it (`nr <= len`).
    #[inline(always)]
    fn take_cached(&mut self, nr: usize) -> &[Page] {
        debug_assert!(nr <= self.len);
        let at = self.len - nr;
        // The pages leave the cache before the caller sees them, so a
        // panic in the caller loses them rather than leaving them both
        // cached and handed out.
        self.len = at;
        self.publish();
        Self::count(&mut self.allocs, &self.tc.allocs, nr as u64);
        Self::count(&mut self.bulk_allocs, &self.tc.bulk_allocs, 1);
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
        if !self.checks && nr <= self.cap - self.len {
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.fill_cached(nr, fill) };
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
        if self.checks || nr > self.cap - self.len {
            return None;
        }
        // SAFETY: the caller's promise, passed on.
        Some(unsafe { self.fill_cached(nr, fill) })
    }

    /// `fill` writes `nr` slots above the cache's top; kept if it says so
    /// (`nr <= cap - len`, checks off).
    ///
    /// # Safety
    /// As [`LocalAllocator::free_bulk_with`].
    #[inline(always)]
    unsafe fn fill_cached(
        &mut self,
        nr: usize,
        fill: impl FnOnce(&mut [MaybeUninit<Page>]) -> bool,
    ) -> bool {
        debug_assert!(!self.checks && nr <= self.cap - self.len);
        // SAFETY: the slots `len..len + nr` are inside the buffer and above
        // `len`, so not the cache's until `len` moves; the handle is the
        // cache's only user.
        let slots = unsafe {
            std::slice::from_raw_parts_mut(self.buf.add(self.len).cast::<MaybeUninit<Page>>(), nr)
        };
        if !fill(slots) {
            return false;
        }
        self.len += nr;
        self.publish();
        Self::count(&mut self.frees, &self.tc.frees, nr as u64);
        Self::count(&mut self.bulk_frees, &self.tc.bulk_frees, 1);
        true
    }

    /// The state of this handle's order-0 fast paths, for code that runs
    /// them itself (see [`LocalFastPath`]).
    ///
    /// # Safety
    /// `this` points to a live handle. The pointers are valid while the
    /// handle lives and stays where it is, and may be used only by one
    /// thread at a time and only between calls on the handle; after using
    /// them, call [`LocalAllocator::resync`] before the handle's next call.
    pub unsafe fn fast_path(this: *mut LocalAllocator) -> LocalFastPath {
        // SAFETY: `this` is live (the caller's promise); `buf` is copied
        // without making a reference to the whole handle, and `tc` is
        // reached through a shared reference that ends here (the pointers
        // into it stay valid: the handle keeps the `Arc`).
        unsafe {
            let tc: &Tcache = &(*this).tc;
            LocalFastPath {
                buf: (*this).buf.cast(),
                len: tc.len_ptr(0),
                cap: (*this).cap,
                allocs: &tc.allocs,
                frees: &tc.frees,
                bulk_allocs: &tc.bulk_allocs,
                bulk_frees: &tc.bulk_frees,
                careful: (*this).careful.bits(),
                checks: (*this).checks,
                fault_on: (*this).fault_on,
            }
        }
    }

    /// Give every cached page back to the per-CPU lists.
    ///
    /// **Context:** never blocks.
    pub fn flush(&mut self) {
        self.alloc.core().tcache_flush_all(&self.tc);
        self.resync();
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
