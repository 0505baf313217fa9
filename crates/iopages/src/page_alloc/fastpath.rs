//! The fast path: one block from the caller's cache, and back.
//!
//! Owns: single-block allocation and free through the thread's cache (or a
//! [`crate::LocalAllocator`]'s), the thread-cache lookup, the cache's refill
//! and flush edges, and the per-page preparation and checks (`prep_new_page`,
//! `free_prep`). Must never: block, take a lock other than one per-CPU
//! try-lock or one zone-lock hold per refill or flush, or touch frame
//! metadata unless a flag or the `checks` setting asks for it.
//!
//! ```text
//! alloc_pages(gfp, order ≤ 3)  → pop from this thread's cache
//!     empty  → refill half a cache from the depot or this CPU's list
//!              list empty → refill a batch from the zone (one zone lock)
//! free_pages(page, order ≤ 3)  → push on this thread's cache
//!     full   → give the older half to the depot or this CPU's list
//!              list above high → a batch back to the zone (one zone lock)
//! ```

use super::{Core, PageAllocator, CACHES, FAST};
use crate::buddy::frame::{flags, Page, MAX_ORDER, PAGE_SIZE};
use crate::gfp::Gfp;
use crate::percpu::pcp::{bump, PCP_MAX_ORDER};
use crate::percpu::tcache::{Tcache, LAST};
use std::cell::Cell;
use std::sync::atomic::{Ordering::Acquire, Ordering::Relaxed};

/// Flags whose pages need preparing (zeroing, a compound head): never a
/// fast-path hit.
pub(super) const PREPARED: Gfp = Gfp::ZERO.union(Gfp::COMP);

impl PageAllocator {
    /// Allocate a block of 2^`order` contiguous frames.
    ///
    /// **Context:** never blocks unless `gfp` may block and the fast paths
    /// are empty; then it may run shrinkers, compaction and drains, and
    /// (`NOFAIL`) wait for frees. **Returns:** `None` when no block could be
    /// found under `gfp`'s rules (orders above 10 always fail).
    #[inline]
    pub fn alloc_pages(&self, gfp: Gfp, order: u32) -> Option<Page> {
        self.core.alloc_cached(gfp, order, || self.tcache())
    }

    /// Free a block from [`PageAllocator::alloc_pages`] with the same order:
    /// the kernel's `free_pages`, a raw-handle call. Safe code holds blocks
    /// in a [`PageBox`](crate::PageBox) (freed on drop) instead.
    ///
    /// **Context:** never blocks. With checks on, freeing a block that is
    /// not allocated (a double free) panics with the frame named.
    ///
    /// # Safety
    /// The caller owns the block `page`: it came from this allocator with this order,
    /// and nothing else — no [`PageBox`](crate::PageBox), folio buffer,
    /// bio, pool, copy of the handle or pointer into its bytes — is used
    /// as owning it afterwards. Freeing a frame that something else still
    /// owns lets the allocator hand it out again, so two owners would reach
    /// the same bytes. (With checks on, a block that is not allocated is
    /// caught and panics; a block that is allocated to someone else cannot
    /// be told apart.)
    #[inline]
    pub unsafe fn free_pages(&self, page: Page, order: u32) {
        self.core.free_cached(page, order, || self.tcache())
    }

    /// This thread's cache for this allocator: `None` when thread caches
    /// are off or the thread is exiting. One thread-local load and one
    /// compare in the common case. The reference must stay on this thread
    /// (every caller uses it and drops it within the call).
    #[inline(always)]
    pub(super) fn tcache(&self) -> Option<&Tcache> {
        if !self.core.tcache_on {
            return None;
        }
        let (id, tc) = LAST.with(Cell::get);
        if id == self.core.id {
            // SAFETY: `LAST` names a cache that this thread's table keeps
            // alive until the thread exits (the table clears `LAST` before
            // dropping it), and only this thread uses it.
            return Some(unsafe { &*tc });
        }
        self.tcache_slow()
    }

    #[cold]
    pub(super) fn tcache_slow(&self) -> Option<&Tcache> {
        let tc: *const Tcache = CACHES
            .try_with(|c| c.get(&self.core) as *const Tcache)
            .ok()?;
        // SAFETY: as in `tcache`: the table keeps the cache alive until the
        // thread exits, and the reference does not leave this thread.
        Some(unsafe { &*tc })
    }
}

impl Core {
    // ---- fast path -------------------------------------------------------

    /// One block through a page cache (`cache()`: the caller's thread
    /// cache or handle, asked only when a cache may serve), else the
    /// uncached path. The hit is one compare of the cache's length with
    /// the fault injector's floor ([`Tcache::pop_unchecked`]), after tests
    /// of `order` and `gfp` that fold away when they are constants; every
    /// other condition (fault injection, checks, counting every call) has
    /// raised the floor, and sends the call to [`Core::alloc_careful`].
    /// Movable pages bypass the type-agnostic caches (see compaction.rs).
    #[inline(always)]
    pub(super) fn alloc_cached<'t>(
        &self,
        gfp: Gfp,
        order: u32,
        cache: impl FnOnce() -> Option<&'t Tcache>,
    ) -> Option<Page> {
        if order > PCP_MAX_ORDER || gfp.contains(Gfp::MOVABLE) {
            return self.alloc_uncached(gfp, order);
        }
        let tc = cache();
        if let Some(tc) = tc.filter(|_| !gfp.intersects(PREPARED)) {
            let floor = self.fault.alloc_floor().load(Relaxed);
            // SAFETY: `tc` is the caller's own cache (true of every `tc`
            // in this file).
            if let Some(page) = unsafe { tc.pop_unchecked(order, floor) } {
                return Some(page);
            }
        }
        self.alloc_careful(gfp, order, tc)
    }

    /// Everything a cache hit skips: fault injection (which sees every
    /// attempt), the refill, preparation (`ZERO`, `COMP`, checks) and the
    /// statistics. `order <= PCP_MAX_ORDER`, not movable.
    #[cold]
    #[inline(never)]
    pub(super) fn alloc_careful(&self, gfp: Gfp, order: u32, tc: Option<&Tcache>) -> Option<Page> {
        debug_assert!(order <= PCP_MAX_ORDER && !gfp.contains(Gfp::MOVABLE));
        if let Some(tc) = tc.filter(|_| !self.fault.is_enabled()) {
            if let Some(page) = self.tcache_alloc(tc, order) {
                return Some(self.prep_new_page(page, order, gfp));
            }
        }
        self.alloc_uncached(gfp, order)
    }

    /// Free one block through a page cache (as [`Core::alloc_cached`]):
    /// an order-0 page is one compare of the cache's length with its
    /// fast capacity ([`Tcache::push_unchecked`]; 0 when every call must
    /// be checked or counted); the rest goes to [`Core::free_careful`].
    #[inline(always)]
    pub(super) fn free_cached<'t>(
        &self,
        page: Page,
        order: u32,
        cache: impl FnOnce() -> Option<&'t Tcache>,
    ) {
        if order > PCP_MAX_ORDER {
            return self.free_careful(page, order, None);
        }
        let tc = cache();
        if let Some(tc) = tc.filter(|_| order == 0) {
            // SAFETY: the caller owns `page` (its promise, passed on).
            if unsafe { tc.push_unchecked(page) } {
                return;
            }
        }
        self.free_careful(page, order, tc)
    }

    /// The checks a fast free skips, then the cache (flushing half when
    /// full, counting the free) or the uncached path.
    #[cold]
    #[inline(never)]
    pub(super) fn free_careful(&self, page: Page, order: u32, tc: Option<&Tcache>) {
        if order > 0 || self.checks {
            self.free_prep(page, order);
        }
        match tc {
            Some(tc) if order <= PCP_MAX_ORDER => self.tcache_free(tc, page, order),
            _ => self.free_uncached(page, order),
        }
    }

    #[inline]
    pub(super) fn tcache_alloc(&self, tc: &Tcache, order: u32) -> Option<Page> {
        // SAFETY: this thread owns `tc` (true of every `tc` below).
        let page = match unsafe { tc.pop(order) } {
            Some(p) => p,
            None => self.tcache_refill(tc, order)?,
        };
        bump(&tc.allocs, 1);
        Some(page)
    }

    /// Refill an empty cache stack with half its capacity — a magazine
    /// from the depot for order 0 (what other threads freed), else from
    /// this CPU's list — and pop one.
    #[cold]
    pub(super) fn tcache_refill(&self, tc: &Tcache, order: u32) -> Option<Page> {
        let want = (tc.cap[order as usize] / 2).max(1);
        // SAFETY: owner thread; the stack is empty, so `want` fits.
        let spare = unsafe { tc.spare(order) };
        if order == 0 {
            // Whole magazines, as many as half the cache holds.
            let mag = self.zone.depot.magazine();
            let mut got = 0;
            while got + mag <= want.max(mag).min(spare.len())
                && self.zone.depot.take(|m| {
                    for (d, &p) in spare[got..].iter_mut().zip(m) {
                        d.write(p);
                    }
                    got += m.len();
                })
            {}
            if got > 0 {
                bump(&tc.refills, 1);
                // SAFETY: owner thread; `got` slots were just written.
                unsafe { tc.commit(0, got) };
                self.check_tcache(tc);
                // SAFETY: owner thread.
                return unsafe { tc.pop(0) };
            }
        }
        let mut at = 0;
        let got = self.take(order, want, FAST, |run| {
            for (d, &p) in spare[at..at + run.len()].iter_mut().zip(run) {
                d.write(p);
            }
            at += run.len();
        });
        if got == 0 {
            return None;
        }
        bump(&tc.refills, 1);
        // SAFETY: owner thread; `got` slots were just written.
        unsafe { tc.commit(order, got) };
        self.check_tcache(tc);
        // SAFETY: owner thread.
        unsafe { tc.pop(order) }
    }

    #[inline]
    pub(super) fn tcache_free(&self, tc: &Tcache, page: Page, order: u32) {
        // SAFETY: owner thread.
        if !unsafe { tc.push(order, page) } {
            self.tcache_flush(tc, order);
            // SAFETY: owner thread; the flush made room.
            let pushed = unsafe { tc.push(order, page) };
            debug_assert!(pushed);
        }
        bump(&tc.frees, 1);
    }

    /// Give the older half of a full cache stack away: order-0 pages to the
    /// depot as whole magazines (another thread takes them whole), the rest
    /// to the per-CPU list.
    #[cold]
    pub(super) fn tcache_flush(&self, tc: &Tcache, order: u32) {
        let half = (tc.len(order) / 2).max(1);
        // SAFETY: owner thread (here and below).
        let old = unsafe { tc.bottom(order, half) };
        let mut parked = 0;
        if order == 0 {
            for m in old.chunks_exact(self.zone.depot.magazine()) {
                if !self.zone.depot.put(m) {
                    break;
                }
                parked += m.len();
            }
        }
        if parked < half {
            self.give(order, half - parked, old[parked..].iter().copied());
        }
        // SAFETY: as above; the `half` oldest blocks have been given away.
        unsafe { tc.remove_bottom(order, half) };
        self.check_tcache(tc);
        bump(&tc.flushes, 1);
    }

    pub(super) fn tcache_flush_all(&self, tc: &Tcache) {
        for order in 0..=PCP_MAX_ORDER {
            let n = tc.len(order);
            if n > 0 {
                // SAFETY: called by the owning thread (or at its exit).
                unsafe {
                    self.give(order, n, tc.take_top(order, n).iter().copied());
                }
            }
        }
        bump(&tc.flushes, 1);
    }

    /// With checks on, assert `tc`'s invariants (see [`Tcache::check`]).
    /// `tc` is the calling thread's (or the handle's) own cache.
    #[inline]
    pub(super) fn check_tcache(&self, tc: &Tcache) {
        if self.checks {
            // SAFETY: every caller passes its own cache.
            unsafe { tc.check(&self.arena) };
        }
    }

    /// Prepare a page for its caller: zero it, make it compound, record it
    /// as allocated — only what the flags and settings ask for.
    #[inline]
    pub(super) fn prep_new_page(&self, page: Page, order: u32, gfp: Gfp) -> Page {
        if gfp.intersects(Gfp::ZERO | Gfp::COMP) || self.checks {
            self.prep_slow(page, order, gfp);
        }
        page
    }

    #[cold]
    pub(super) fn prep_slow(&self, page: Page, order: u32, gfp: Gfp) {
        if self.checks {
            self.arena.check_block(page, order, "handed to the caller");
        }
        let head = self.arena.frame(page.pfn());
        let mut fl = head.flags();
        if self.checks {
            assert!(
                fl & (flags::ALLOCATED | flags::BUDDY) == 0,
                "allocator handed out pfn {} twice (flags {fl:#x})",
                page.pfn()
            );
            fl |= flags::ALLOCATED;
        }
        if gfp.contains(Gfp::COMP) && order > 0 {
            fl |= flags::HEAD;
            head.set_order(order);
            for pfn in page.pfn() + 1..page.pfn() + (1 << order) {
                let tail = self.arena.frame(pfn);
                tail.set_flags(flags::TAIL);
                tail.link_or_owner.store(page.pfn(), Relaxed);
            }
        }
        head.set_flags(fl);
        head.link_prev.store(0, Relaxed);
        head.link_or_owner.store(0, Relaxed);
        if gfp.contains(Gfp::ZERO) {
            // SAFETY: the block is ours and lies inside the mapping.
            unsafe { std::ptr::write_bytes(self.arena.page_address(page), 0, PAGE_SIZE << order) };
        }
    }

    /// Undo `prep_slow` before a block goes back: check it was allocated
    /// (with checks on) and dismantle a compound page.
    #[cold]
    pub(super) fn free_prep(&self, page: Page, order: u32) {
        assert!(
            order <= MAX_ORDER,
            "free_pages: order {order} is above {MAX_ORDER}"
        );
        assert!(
            (page.pfn() as usize) < self.arena.nr_pages() && page.pfn() & ((1 << order) - 1) == 0,
            "free_pages: pfn {} is not the start of an order-{order} block in this arena",
            page.pfn()
        );
        let head = self.arena.frame(page.pfn());
        let fl = head.flags();
        let pins = head.pins.load(Acquire);
        assert!(
            pins == 0,
            "free_pages: pfn {} is pinned ({pins} pins): a pinned frame is never freed",
            page.pfn()
        );
        if self.checks {
            assert!(
                fl & flags::ALLOCATED != 0,
                "free_pages: pfn {} order {order} is not allocated (double free?), flags {fl:#x}",
                page.pfn()
            );
        }
        if fl & flags::HEAD != 0 {
            assert_eq!(
                head.order(),
                order,
                "free_pages: compound pfn {} freed with the wrong order",
                page.pfn()
            );
            for pfn in page.pfn() + 1..page.pfn() + (1 << order) {
                let tail = self.arena.frame(pfn);
                tail.set_flags(0);
                tail.link_or_owner.store(0, Relaxed);
            }
        }
        head.set_flags(fl & !(flags::ALLOCATED | flags::HEAD));
    }
}
