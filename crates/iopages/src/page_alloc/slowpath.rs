//! The slow path: what an allocation does when the free lists are short.
//!
//! Owns: the uncached path (fault injection, the zone with its
//! watermarks), the slow path's order — wake background reclaim, go down
//! to the min watermark, then, if the flags allow blocking, direct reclaim,
//! compaction, drains and retries as the flags say — the `NOFAIL` wait, and
//! the allocator's side of the reclaim layer's interfaces
//! ([`ReclaimTarget`], [`CompactTarget`]). Must never: hold an allocator
//! lock while calling a shrinker or compaction, or retry without a bound
//! unless the request is `NOFAIL`.

use super::{Core, FAST, MAX_RECLAIM_RETRIES, NOFAIL_WAIT};
use crate::buddy::arena::Arena;
use crate::buddy::frame::{Page, MAX_ORDER, PAGE_SIZE};
use crate::buddy::zone::{AllocFlags, MigrateType};
use crate::gfp::Gfp;
use crate::percpu::pcp::PCP_MAX_ORDER;
use crate::reclaim::compaction::{try_to_compact, CompactResult, CompactTarget, MovableRegistry};
use crate::reclaim::kswapd::ReclaimTarget;
use crate::reclaim::shrinker::ShrinkerRegistry;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

impl Core {
    pub(super) fn alloc_uncached(&self, gfp: Gfp, order: u32) -> Option<Page> {
        if order > MAX_ORDER {
            return self.fail(gfp, order);
        }
        if self.fault.is_enabled() && self.fault.should_fail(gfp, order) {
            return self.fail(gfp, order);
        }
        let page = match self.get_page_from_freelist(order, FAST, MigrateType::of(gfp)) {
            Some(p) => p,
            None => self.alloc_slowpath(gfp, order)?,
        };
        Some(self.prep_new_page(page, order, gfp))
    }

    pub(super) fn get_page_from_freelist(
        &self,
        order: u32,
        wm: AllocFlags,
        mt: MigrateType,
    ) -> Option<Page> {
        if order <= PCP_MAX_ORDER && mt == MigrateType::Unmovable {
            if let Some(mut g) = self.this_cpu() {
                let mut out = None;
                if g.take(order, 1, wm, |run| out = Some(run[0])) == 1 {
                    g.note(false, 1);
                }
                return out;
            }
        }
        if !self.zone.watermark_ok(1 << order, wm) {
            return None;
        }
        let pfn = self.zone.lock(&self.arena).alloc_typed(order, mt)?;
        self.counters.zone_allocs.fetch_add(1, Relaxed);
        Some(Page::from_pfn(pfn))
    }

    /// The slow path: wake background reclaim, go down to the min watermark,
    /// then (if the flags allow blocking) reclaim, compact, drain and retry.
    #[cold]
    pub(super) fn alloc_slowpath(&self, gfp: Gfp, order: u32) -> Option<Page> {
        let gfp = gfp.in_current_scope();
        self.counters.slowpath.fetch_add(1, Relaxed);
        if gfp.contains(Gfp::KSWAPD_RECLAIM) {
            self.counters.kswapd_wakeups.fetch_add(1, Relaxed);
            self.wake_kswapd();
        }
        let wm = AllocFlags::WMARK_MIN
            .with_if(gfp.contains(Gfp::HIGH), AllocFlags::HIGH)
            .with_if(gfp.contains(Gfp::MEMALLOC), AllocFlags::NO_WATERMARKS);
        let mt = MigrateType::of(gfp);
        if let Some(p) = self.get_page_from_freelist(order, wm, mt) {
            return Some(p);
        }
        if !gfp.may_block() {
            return self.fail(gfp, order);
        }
        let costly = order > PCP_MAX_ORDER;
        let mut no_progress = 0u32;
        loop {
            let t = std::time::Instant::now();
            let reclaimed = self.shrinkers.shrink(gfp, 1 << order);
            self.counters
                .direct_reclaim_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            self.counters.direct_reclaim.fetch_add(1, Relaxed);
            let mut compacted = false;
            // As the kernel does, a `NORETRY` request still gets one round
            // of compaction with its one round of reclaim; it only gives up
            // sooner.
            if order > 0 {
                compacted = self.compact(order) == CompactResult::Success;
            }
            // Pages parked in this thread's cache and on per-CPU lists are
            // invisible to the zone (a shrinker running here just freed into
            // this thread's cache); give them back before deciding there is
            // no memory.
            self.drain_to_zone_all();
            if let Some(p) = self.get_page_from_freelist(order, wm, mt) {
                return Some(p);
            }
            if gfp.contains(Gfp::NOFAIL) {
                self.wait_for_frees();
                continue;
            }
            if gfp.contains(Gfp::NORETRY) || (costly && !gfp.contains(Gfp::RETRY_MAYFAIL)) {
                return self.fail(gfp, order);
            }
            if reclaimed > 0 || compacted {
                no_progress = 0;
            } else {
                no_progress += 1;
            }
            if no_progress >= MAX_RECLAIM_RETRIES {
                return self.fail(gfp, order);
            }
            std::thread::yield_now();
        }
    }

    #[cold]
    pub(super) fn fail(&self, gfp: Gfp, order: u32) -> Option<Page> {
        self.counters.failures.fetch_add(1, Relaxed);
        if !gfp.contains(Gfp::NOWARN) {
            log::warn!(
                "iopages: order-{order} allocation failed (gfp {gfp:?}): {} pages free, min watermark {}",
                self.zone.nr_free_pages(),
                self.zone.watermarks().min
            );
        }
        None
    }
    /// Wake background reclaim (start it on first use).
    pub(super) fn wake_kswapd(&self) {
        self.kswapd.wake(|| format!("kswapd/{}", self.id));
    }

    /// Sleep until something is freed to the zone or [`NOFAIL_WAIT`] passes.
    pub(super) fn wait_for_frees(&self) {
        self.counters.nofail_waits.fetch_add(1, Relaxed);
        let mut g = self.wait_lock.lock();
        self.waiters.fetch_add(1, Relaxed);
        self.wait_cv.wait_for(&mut g, NOFAIL_WAIT);
        self.waiters.fetch_sub(1, Relaxed);
    }

    #[inline]
    pub(super) fn wake_waiters(&self) {
        if self.waiters.load(Relaxed) > 0 {
            let _g = self.wait_lock.lock();
            self.wait_cv.notify_all();
        }
    }

    pub(super) fn free_uncached(&self, page: Page, order: u32) {
        if order <= PCP_MAX_ORDER {
            self.give_counted(order, 1, std::iter::once(page), true);
        } else {
            self.zone.lock(&self.arena).free(page.pfn(), order);
            self.counters.zone_frees.fetch_add(1, Relaxed);
            self.wake_waiters();
        }
    }

    /// Compact for a free block of `order`, counting the attempt, its work
    /// and its time.
    ///
    /// **Context:** may block; called without allocator locks held.
    pub(super) fn compact(&self, order: u32) -> CompactResult {
        let c = &self.counters;
        c.compact_calls.fetch_add(1, Relaxed);
        let t0 = Instant::now();
        let run = try_to_compact(self, order);
        c.compact_migrate_scanned
            .fetch_add(run.migrate_scanned, Relaxed);
        c.compact_free_scanned.fetch_add(run.free_scanned, Relaxed);
        c.compact_isolated.fetch_add(run.isolated, Relaxed);
        c.compact_migrated.fetch_add(run.migrated, Relaxed);
        c.compact_migrate_failed.fetch_add(run.failed, Relaxed);
        match run.result {
            CompactResult::Success => c.compact_success.fetch_add(1, Relaxed),
            CompactResult::Failed => c.compact_fail.fetch_add(1, Relaxed),
            CompactResult::Skipped => c.compact_skipped.fetch_add(1, Relaxed),
        };
        c.compact_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        run.result
    }

    /// Free order-0 pages straight to the zone, past the type-agnostic
    /// caches (see [`PageAllocator::free_movable_pages`]).
    pub(super) fn free_to_zone(&self, pages: &[Page]) {
        self.free_order0_locked(pages);
        self.counters
            .zone_frees
            .fetch_add(pages.len() as u64, Relaxed);
        self.wake_waiters();
    }

    /// Undo the preparation of order-0 `pages` (with checks on) and free
    /// them to the zone under one lock hold. The callers count and wake.
    fn free_order0_locked(&self, pages: &[Page]) {
        if self.checks {
            for &p in pages {
                self.free_prep(p, 0);
            }
        }
        let mut z = self.zone.lock(&self.arena);
        for p in pages {
            z.free(p.pfn(), 0);
        }
    }
}

impl ReclaimTarget for Core {
    fn free_pages(&self) -> usize {
        self.zone.nr_free_pages() + self.zone.depot.len()
    }
    fn high_watermark(&self) -> usize {
        self.zone.watermarks().high
    }
    fn shrinkers(&self) -> &ShrinkerRegistry {
        &self.shrinkers
    }
    fn drain_to_zone(&self) {
        self.drain_to_zone_all();
    }
}

impl CompactTarget for Core {
    fn arena(&self) -> &Arena {
        &self.arena
    }
    fn movable(&self) -> &MovableRegistry {
        &self.movable
    }
    fn drain_to_zone(&self) {
        self.drain_to_zone_all();
    }
    fn has_free_block(&self, order: u32) -> bool {
        self.zone.has_free_block(order)
    }
    fn room_above_min(&self, nr_pages: usize) -> bool {
        self.zone.nr_free_pages() >= self.zone.watermarks().min + nr_pages
    }
    fn pageblock_type(&self, pfn: u32) -> MigrateType {
        self.zone.pageblock_type(pfn)
    }
    fn isolate_free(&self, start: u32, end: u32, order: u32, out: &mut Vec<Page>) -> usize {
        let mut z = self.zone.lock(&self.arena);
        z.isolate_free_range(start, end, order, out)
    }
    fn inject_failure(&self) -> bool {
        self.fault.is_enabled() && self.fault.should_fail(Gfp::NOWAIT | Gfp::MOVABLE, 0)
    }
    fn migrate_page(&self, old: Page, new: Page) {
        assert_ne!(old, new, "compaction: a page moved onto itself");
        // SAFETY: `old` is isolated (its owner neither writes nor frees
        // it) and `new` was taken off the free lists by this compaction;
        // both are distinct whole frames inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.arena.page_address(old),
                self.arena.page_address(new),
                PAGE_SIZE,
            );
        }
        self.prep_new_page(new, 0, Gfp::empty());
    }
    fn unmigrate(&self, new: Page) {
        if self.checks {
            self.free_prep(new, 0);
        }
    }
    fn put_back_free(&self, pages: &mut Vec<Page>) {
        if pages.is_empty() {
            return;
        }
        let mut z = self.zone.lock(&self.arena);
        for p in pages.drain(..) {
            z.free(p.pfn(), 0);
        }
    }
    fn free_moved(&self, pages: &[Page]) {
        self.free_order0_locked(pages);
        self.wake_waiters();
    }
}
