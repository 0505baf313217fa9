//! Moving blocks between the layers: caches, per-CPU lists, depot, zone.
//!
//! Owns: taking blocks through this CPU's list (or the zone when the list
//! is busy), giving them back the same way, and the drains (the calling
//! thread's cache, every CPU's list, the depot). Must never: wait for a
//! per-CPU lock except in a drain, and there only a bounded number of
//! tries; or hold a per-CPU lock and the zone lock in the other order.

use super::{Core, CACHES, FAST};
use crate::buddy::frame::Page;
use crate::buddy::zone::AllocFlags;
use crate::percpu::pcp::PcpGuard;
use std::sync::atomic::Ordering::Relaxed;

/// Tries per CPU's lock before a drain gives up on that CPU's lists: about
/// a thousand yields, far longer than any holder's critical section (a
/// batch moved under one zone-lock hold) unless the holder is descheduled.
pub(super) const DRAIN_TRIES_MAX: u32 = 1 << 16;

impl Core {
    // ---- per-CPU lists and zone ------------------------------------------

    /// This CPU's list set, locked, or `None` if another thread holds it.
    #[inline]
    pub(super) fn this_cpu(&self) -> Option<PcpGuard<'_>> {
        let set = &self.pcp[crate::percpu::cpu::slot(self.pcp.len())];
        set.try_lock(&self.zone, &self.arena, &self.limits)
    }

    /// Take up to `nr` blocks through this CPU's list (or the zone if the
    /// list is busy), under one hold; `put` receives them a run at a time.
    pub(super) fn take(
        &self,
        order: u32,
        nr: usize,
        wm: AllocFlags,
        mut put: impl FnMut(&[Page]),
    ) -> usize {
        if self.checks {
            let mut checked = |run: &[Page]| {
                for &p in run {
                    self.arena
                        .check_block(p, order, "taken from the per-CPU list");
                }
                put(run)
            };
            return self.take_inner::<true>(order, nr, wm, &mut checked);
        }
        self.take_inner::<false>(order, nr, wm, put)
    }

    /// [`Core::take`] past the per-block checks; `CHECK` (the `checks`
    /// setting, already tested by the caller) asks for the list walk after.
    #[inline]
    fn take_inner<const CHECK: bool>(
        &self,
        order: u32,
        nr: usize,
        wm: AllocFlags,
        mut put: impl FnMut(&[Page]),
    ) -> usize {
        if let Some(mut g) = self.this_cpu() {
            let got = g.take(order, nr, wm, &mut put);
            if CHECK {
                g.check();
            }
            return got;
        }
        if !self.zone.watermark_ok(1 << order, wm) {
            return 0;
        }
        let mut z = self.zone.lock(&self.arena);
        let mut n = 0;
        while n < nr {
            match z.alloc(order) {
                Some(pfn) => put(&[Page::from_pfn(pfn)]),
                None => break,
            }
            n += 1;
        }
        drop(z);
        self.counters.zone_allocs.fetch_add(n as u64, Relaxed);
        n
    }

    /// Give `n` blocks to this CPU's list (or the zone if the list is busy).
    /// `single` counts it as one caller's free served by the list.
    pub(super) fn give_counted(
        &self,
        order: u32,
        n: usize,
        pages: impl Iterator<Item = Page>,
        single: bool,
    ) {
        if self.checks {
            // Collected so that the unchecked path keeps the caller's
            // iterator as it is (a slice's copies extend a list as one
            // `memcpy`; any adapter around them would not).
            let pages: Vec<Page> = pages.take(n).collect();
            for &p in &pages {
                self.arena
                    .check_block(p, order, "given to the per-CPU list");
            }
            self.give_inner::<true>(order, pages.len(), pages.into_iter(), single);
        } else {
            self.give_inner::<false>(order, n, pages, single);
        }
    }

    /// [`Core::give_counted`] past the per-block checks; `CHECK` (the
    /// `checks` setting, already tested by the caller) asks for the list
    /// walk after.
    #[inline]
    fn give_inner<const CHECK: bool>(
        &self,
        order: u32,
        n: usize,
        pages: impl Iterator<Item = Page>,
        single: bool,
    ) {
        if let Some(mut g) = self.this_cpu() {
            g.give(order, n, pages);
            if single {
                g.note(true, 1);
            }
            if CHECK {
                g.check();
            }
        } else {
            let mut z = self.zone.lock(&self.arena);
            for p in pages.take(n) {
                z.free(p.pfn(), order);
            }
            drop(z);
            self.counters.zone_frees.fetch_add(n as u64, Relaxed);
        }
        self.wake_waiters();
    }

    pub(super) fn give(&self, order: u32, n: usize, pages: impl Iterator<Item = Page>) {
        self.give_counted(order, n, pages, false)
    }

    /// Give `pages` (blocks of `order`) to this CPU's list, or the zone.
    pub(super) fn give_pages(&self, order: u32, pages: &[Page]) {
        self.give(order, pages.len(), pages.iter().copied())
    }

    /// Take up to `nr` blocks of `order` through this CPU's list under the
    /// fast path's watermark, when the zone stays above it with all of
    /// them gone; `put` receives them a run at a time.
    pub(super) fn take_fast(&self, order: u32, nr: usize, put: impl FnMut(&[Page])) -> usize {
        if !self.zone.watermark_ok(nr << order, FAST) {
            return 0;
        }
        self.take(order, nr, FAST, put)
    }

    /// Give every free page this thread can reach back to the zone: its
    /// own cache, every CPU's lists and the depot (one drain for
    /// [`Core::accounting`], from the first page moved to the last).
    pub(super) fn drain_to_zone_all(&self) {
        let _window = self.drains.begin();
        self.flush_own_cache();
        self.drain_all_pcp();
    }

    /// Flush the calling thread's cache, if it has one.
    pub(super) fn flush_own_cache(&self) {
        let _ = CACHES.try_with(|c| {
            if let Some(tc) = c.existing(self.id) {
                self.tcache_flush_all(tc);
            }
        });
    }

    /// Return every CPU's lists and the depot to the zone (the kernel's
    /// `drain_all_pages`). A set whose lock stays held for
    /// [`DRAIN_TRIES_MAX`] tries is skipped (its holder is inside a short
    /// critical section that gives back what exceeds `high` itself), so a
    /// drain always ends. With checks on, the zone's lists are walked
    /// afterwards.
    ///
    /// Pages move from the lists to the zone here: callers open a drain
    /// window first ([`Core::drain_to_zone_all`] does), or
    /// [`Core::accounting`] could count a page in flight.
    pub(super) fn drain_all_pcp(&self) {
        for (cpu, set) in self.pcp.iter().enumerate() {
            let mut tries = 0u32;
            loop {
                if let Some(mut g) = set.try_lock(&self.zone, &self.arena, &self.limits) {
                    g.drain();
                    break;
                }
                tries += 1;
                if tries >= DRAIN_TRIES_MAX {
                    log::warn!(
                        "iopages: drain skipped CPU {cpu}'s lists: still locked after {tries} tries"
                    );
                    break;
                }
                if tries % 64 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        self.zone.drain_depot(&self.arena);
        if self.checks {
            self.zone.lock(&self.arena).check_lists();
        }
        self.counters.drain_all.fetch_add(1, Relaxed);
        self.wake_waiters();
    }
}

#[cfg(test)]
mod tests {
    use crate::{Gfp, HugePages, PageAllocator};

    /// A CPU's lock held for good (a descheduled holder) costs a drain at
    /// most `DRAIN_TRIES_MAX` tries: the drain ends and drains the rest.
    #[test]
    fn a_drain_ends_when_a_cpu_lock_stays_held() {
        let alloc = PageAllocator::builder()
            .size_bytes(4 << 20)
            .huge_pages(HugePages::Never)
            .nr_cpus(2)
            .thread_cache_pages(0)
            .background_reclaim(false)
            .checks(true)
            .build()
            .unwrap();
        let b = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
        drop(b);
        let core = alloc.core();
        let held = core.pcp[0].try_lock(&core.zone, &core.arena, &core.limits);
        assert!(held.is_some());
        core.drain_all_pcp();
        assert_eq!(
            core.counters
                .drain_all
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        drop(held);
        assert!(alloc.leak_check().is_ok());
    }
}
