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
//! `LocalAllocator` hoists the lookup and the checks out of the loop. The
//! checks are folded into one mask tested with the flags (allocation checks
//! make every flag set take the careful path) plus the fault-injection
//! switch; statistics are per-handle counters, summed when read.

use crate::alloc::PageAllocator;
use crate::frame::Page;
use crate::gfp::Gfp;
use crate::pcp::{bump, PCP_MAX_ORDER};
use crate::tcache::{Owner, Tcache};
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
/// local.free_bulk(&mut batch); // empties `batch`
/// let page = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
/// local.free_pages(page, 0);
/// drop(local);
/// assert!(alloc.leak_check().is_ok());
/// ```
pub struct LocalAllocator {
    alloc: PageAllocator,
    tc: Arc<Tcache>,
    /// Flags that need the careful path: `ZERO`, `COMP` and `MOVABLE`, or
    /// every flag when allocation checks are on.
    careful: Gfp,
    checks: bool,
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
        let tc = Arc::new(Tcache::new(core.tcache_cap()));
        core.tcache_register(&tc);
        let checks = self.checks_enabled();
        LocalAllocator {
            alloc: self.clone(),
            tc,
            careful: if checks {
                Gfp::all()
            } else {
                Gfp::ZERO | Gfp::COMP | Gfp::MOVABLE
            },
            checks,
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
    fn fast(&self, gfp: Gfp) -> bool {
        !gfp.intersects(self.careful) && !self.alloc.fault().is_enabled()
    }

    /// Allocate a block of 2^`order` frames (as
    /// [`PageAllocator::alloc_pages`]).
    ///
    /// **Context / Returns:** as [`PageAllocator::alloc_pages`].
    #[inline]
    pub fn alloc_pages(&mut self, gfp: Gfp, order: u32) -> Option<Page> {
        if order <= PCP_MAX_ORDER && self.fast(gfp) {
            // SAFETY: `&mut self` makes this caller the cache's only user.
            if let Some(p) = unsafe { self.tc.pop(order) } {
                bump(&self.tc.allocs, 1);
                return Some(p);
            }
        }
        self.alloc_pages_slow(gfp, order)
    }

    #[cold]
    #[inline(never)]
    fn alloc_pages_slow(&mut self, gfp: Gfp, order: u32) -> Option<Page> {
        let core = self.alloc.core();
        if order <= PCP_MAX_ORDER
            && self.tc.cap[0] > 0
            && !self.alloc.fault().is_enabled()
            && !gfp.contains(Gfp::MOVABLE)
        {
            if let Some(p) = core.tcache_alloc(&self.tc, order) {
                return Some(core.prep_new_page(p, order, gfp));
            }
        }
        core.alloc_uncached(gfp, order)
    }

    /// Free a block allocated with this order (by this handle, another
    /// handle, or the allocator).
    ///
    /// **Context:** never blocks. With checks on, a double free panics.
    #[inline]
    pub fn free_pages(&mut self, page: Page, order: u32) {
        if order == 0 && !self.checks {
            // SAFETY: as in `alloc_pages`.
            if unsafe { self.tc.push(0, page) } {
                bump(&self.tc.frees, 1);
                return;
            }
        }
        self.free_pages_slow(page, order)
    }

    #[cold]
    #[inline(never)]
    fn free_pages_slow(&mut self, page: Page, order: u32) {
        let core = self.alloc.core();
        if order > 0 || self.checks {
            core.free_prep(page, order);
        }
        if order <= PCP_MAX_ORDER && self.tc.cap[0] > 0 {
            core.tcache_free(&self.tc, page, order);
        } else {
            core.free_uncached(page, order);
        }
    }

    /// Append `nr` order-0 pages to `out` (DPDK's `rte_mempool_get_bulk`,
    /// but it may hand out fewer than asked when memory is short).
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** how many
    /// were appended.
    #[inline]
    pub fn alloc_bulk(&mut self, gfp: Gfp, nr: usize, out: &mut Vec<Page>) -> usize {
        if nr <= self.tc.len(0) && self.fast(gfp) {
            // SAFETY: as in `alloc_pages`; the slice is copied out before the
            // cache is touched again.
            out.extend_from_slice(unsafe { self.tc.take_top(0, nr) });
            bump(&self.tc.allocs, nr as u64);
            bump(&self.tc.bulk_allocs, 1);
            return nr;
        }
        self.alloc_bulk_slow(gfp, nr, out)
    }

    #[cold]
    #[inline(never)]
    fn alloc_bulk_slow(&mut self, gfp: Gfp, nr: usize, out: &mut Vec<Page>) -> usize {
        bump(&self.tc.bulk_allocs, 1);
        let start = out.len();
        if !self.fast(gfp) || self.tc.cap[0] == 0 {
            // Every page a separate attempt with every check: callers see
            // partial fills under fault injection.
            out.reserve(nr);
            while out.len() - start < nr {
                match self.alloc_pages(gfp, 0) {
                    Some(p) => out.push(p),
                    None => break,
                }
            }
            return out.len() - start;
        }
        let core = self.alloc.core();
        out.reserve(nr);
        // What the cache holds, then whole batches: a magazine from the
        // depot or a refill from this CPU's list for small requests, one
        // hold of the list for large ones.
        let mut tries = 0;
        while out.len() - start < nr {
            let want = nr - (out.len() - start);
            let k = self.tc.len(0).min(want);
            // SAFETY: as in `alloc_bulk`.
            out.extend_from_slice(unsafe { self.tc.take_top(0, k) });
            bump(&self.tc.allocs, k as u64);
            if k == want {
                break;
            }
            let rest = want - k;
            if rest > self.tc.cap[0] / 2 {
                core.take_fast(0, rest, |run| out.extend_from_slice(run));
            } else if let Some(p) = core.tcache_refill(&self.tc, 0) {
                out.push(p);
            }
            tries += 1;
            if tries > 2 {
                break;
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
    #[inline]
    pub fn free_bulk(&mut self, pages: &mut Vec<Page>) {
        let n = pages.len();
        if !self.checks && n <= self.tc.cap[0] - self.tc.len(0) {
            // SAFETY: as in `alloc_pages`; the pages fit.
            unsafe { self.tc.extend(0, pages) };
            bump(&self.tc.frees, n as u64);
            bump(&self.tc.bulk_frees, 1);
            pages.clear();
            return;
        }
        self.free_bulk_slow(pages)
    }

    #[cold]
    #[inline(never)]
    fn free_bulk_slow(&mut self, pages: &mut Vec<Page>) {
        bump(&self.tc.bulk_frees, 1);
        let core = self.alloc.core();
        if self.checks {
            for &p in pages.iter() {
                core.free_prep(p, 0);
            }
        }
        let room = (self.tc.cap[0] - self.tc.len(0)).min(pages.len());
        // SAFETY: as in `alloc_pages`; `room` pages fit.
        unsafe { self.tc.extend(0, &pages[..room]) };
        bump(&self.tc.frees, room as u64);
        let rest = &pages[room..];
        if !rest.is_empty() {
            if rest.len() <= self.tc.cap[0] / 2 {
                // Make room by handing the oldest half on (a magazine to the
                // depot), then cache the rest: the next allocation finds
                // them warm.
                core.tcache_flush(&self.tc, 0);
                // SAFETY: as above; the flush freed half the cache.
                unsafe { self.tc.extend(0, rest) };
                bump(&self.tc.frees, rest.len() as u64);
            } else {
                core.give_pages(0, rest);
            }
        }
        pages.clear();
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
