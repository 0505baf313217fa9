//! Allocator statistics, vmstat style.
//!
//! Owns: the counters kept off the fast path, the gathering of per-CPU and
//! per-thread counters into one [`Stats`], and its text form. Must never:
//! add a shared atomic read-modify-write to the fast path — the per-thread
//! and per-CPU counters are written only by their owner (or lock holder)
//! with plain stores and summed here.

use crate::buddy::frame::NR_ORDERS;
use crate::buddy::zone::Watermarks;
use crate::page_alloc::Core;
use crate::percpu::tcache::Tcache;
use std::fmt;
use std::sync::atomic::{fence, AtomicU64, Ordering, Ordering::Relaxed};

/// Counters of the uncached and slow paths (shared atomics).
#[derive(Default)]
pub(crate) struct Counters {
    pub zone_allocs: AtomicU64,
    pub zone_frees: AtomicU64,
    pub bulk_allocs: AtomicU64,
    pub bulk_frees: AtomicU64,
    pub slowpath: AtomicU64,
    pub kswapd_wakeups: AtomicU64,
    pub direct_reclaim: AtomicU64,
    pub direct_reclaim_ns: AtomicU64,
    pub compact_calls: AtomicU64,
    pub compact_success: AtomicU64,
    pub compact_fail: AtomicU64,
    pub compact_skipped: AtomicU64,
    pub compact_migrate_scanned: AtomicU64,
    pub compact_free_scanned: AtomicU64,
    pub compact_isolated: AtomicU64,
    pub compact_migrated: AtomicU64,
    pub compact_migrate_failed: AtomicU64,
    pub compact_ns: AtomicU64,
    pub drain_all: AtomicU64,
    pub nofail_waits: AtomicU64,
    pub failures: AtomicU64,
    // Folded in from thread caches whose threads exited.
    pub tc_allocs: AtomicU64,
    pub tc_frees: AtomicU64,
    pub tc_refills: AtomicU64,
    pub tc_flushes: AtomicU64,
}

impl Counters {
    pub(super) fn fold_tcache(&self, tc: &Tcache) {
        self.tc_allocs.fetch_add(tc.allocs.load(Relaxed), Relaxed);
        self.tc_frees.fetch_add(tc.frees.load(Relaxed), Relaxed);
        self.tc_refills.fetch_add(tc.refills.load(Relaxed), Relaxed);
        self.tc_flushes.fetch_add(tc.flushes.load(Relaxed), Relaxed);
        self.bulk_allocs
            .fetch_add(tc.bulk_allocs.load(Relaxed), Relaxed);
        self.bulk_frees
            .fetch_add(tc.bulk_frees.load(Relaxed), Relaxed);
    }
}

/// Where the arena's pages are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accounting {
    /// Pages in the arena.
    pub total_pages: usize,
    /// Free in the zone's buddy lists.
    pub buddy_free_pages: usize,
    /// Free in the depot between the per-CPU lists and the zone.
    pub depot_pages: usize,
    /// Free on per-CPU lists.
    pub pcp_pages: usize,
    /// Free in threads' caches.
    pub thread_cache_pages: usize,
    /// Held by callers: the rest.
    pub in_use_pages: usize,
}

impl fmt::Display for Accounting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} pages: {} free in the zone, {} in the depot, {} on per-CPU lists, {} in thread caches, {} in use",
            self.total_pages,
            self.buddy_free_pages,
            self.depot_pages,
            self.pcp_pages,
            self.thread_cache_pages,
            self.in_use_pages
        )
    }
}

/// A snapshot of the allocator's statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Pages in the arena.
    pub total_pages: usize,
    /// Free pages in the zone.
    pub free_pages: usize,
    /// Free blocks in the zone, by order.
    pub free_blocks_by_order: [usize; NR_ORDERS],
    /// Pages parked in the depot.
    pub depot_pages: usize,
    /// Most pages the depot holds.
    pub depot_max_pages: usize,
    /// Pages on per-CPU lists.
    pub pcp_pages: usize,
    /// Pages in threads' caches.
    pub thread_cache_pages: usize,
    /// Pages held by callers.
    pub in_use_pages: usize,
    /// Watermarks (min, low, high) in pages.
    pub watermarks: (usize, usize, usize),
    /// Blocks allocated from a thread's cache (single and bulk).
    pub alloc_thread_cache: u64,
    /// Blocks freed into a thread's cache.
    pub free_thread_cache: u64,
    /// Single allocations served by a per-CPU list directly.
    pub alloc_pcp: u64,
    /// Single frees given to a per-CPU list directly.
    pub free_pcp: u64,
    /// Blocks taken from the zone bypassing the per-CPU lists.
    pub alloc_zone: u64,
    /// Blocks returned to the zone bypassing the per-CPU lists.
    pub free_zone: u64,
    /// Bulk allocation calls (any form).
    pub bulk_alloc_calls: u64,
    /// Bulk free calls.
    pub bulk_free_calls: u64,
    /// Per-CPU list refills from the zone (one zone-lock hold each).
    pub pcp_refills: u64,
    /// Pages moved by those refills.
    pub pcp_refill_pages: u64,
    /// Per-CPU list drains to the zone (one zone-lock hold each).
    pub pcp_drains: u64,
    /// Pages moved by those drains.
    pub pcp_drain_pages: u64,
    /// Times a per-CPU lock was found busy (the caller used the zone).
    pub pcp_lock_busy: u64,
    /// Thread-cache refills from a per-CPU list.
    pub thread_cache_refills: u64,
    /// Thread-cache flushes to a per-CPU list.
    pub thread_cache_flushes: u64,
    /// Live thread caches.
    pub thread_caches: usize,
    /// Most pages one thread cache can hold.
    pub thread_cache_max_pages: usize,
    /// Most pages all per-CPU lists can hold.
    pub pcp_max_pages: usize,
    /// Allocations that entered the slow path.
    pub slowpath: u64,
    /// Background-reclaim wake-ups requested.
    pub kswapd_wakeups: u64,
    /// Direct reclaim rounds.
    pub direct_reclaim: u64,
    /// Time allocating threads spent in direct reclaim (the shrinkers),
    /// in nanoseconds.
    pub direct_reclaim_ns: u64,
    /// Pages freed by shrinkers.
    pub shrinker_pages_freed: u64,
    /// Compaction attempts (slow path and [`crate::PageAllocator::compact`]).
    pub compact_calls: u64,
    /// Attempts that left a free block of the asked order.
    pub compact_success: u64,
    /// Attempts whose scanners met without making one.
    pub compact_fail: u64,
    /// Attempts that did not run (nothing movable, too little free memory).
    pub compact_skipped: u64,
    /// Frames the migrate scanner looked at.
    pub compact_migrate_scanned: u64,
    /// Frames the free scanner looked at.
    pub compact_free_scanned: u64,
    /// Pages isolated for migration.
    pub compact_isolated: u64,
    /// Pages moved (the kernel's `pgmigrate_success`).
    pub compact_migrated: u64,
    /// Isolated pages not moved (the kernel's `pgmigrate_fail`).
    pub compact_migrate_failed: u64,
    /// Time spent compacting, in nanoseconds.
    pub compact_ns: u64,
    /// Allocations served by stealing from the other migratetype.
    pub pageblock_steals: u64,
    /// Pageblocks whose migratetype changed.
    pub pageblock_conversions: u64,
    /// Drains of all per-CPU lists.
    pub drain_all: u64,
    /// Sleeps of `NOFAIL` allocations waiting for frees.
    pub nofail_waits: u64,
    /// Allocations that failed.
    pub failures: u64,
    /// Of those, failures injected on purpose.
    pub fault_injected: u64,
}

/// Drains in progress, for [`Core::accounting`]: a drain moves free pages
/// from the per-CPU lists, the depot and a thread's cache to the zone, and
/// a count taken halfway would see a page in neither place (counted in
/// use) or in both. Background reclaim drains on its own thread, so a
/// caller whose threads are all quiet still meets one.
#[derive(Default)]
pub(super) struct Drains {
    begun: AtomicU64,
    ended: AtomicU64,
}

/// Ends a drain's window when dropped (a panicking drain ends it too, so
/// the count never waits for a drain that is gone).
pub(super) struct DrainWindow<'a>(&'a Drains);

impl Drains {
    /// Open a drain's window: every move made before the returned value
    /// drops is inside it.
    pub(super) fn begin(&self) -> DrainWindow<'_> {
        self.begun.fetch_add(1, Relaxed);
        // The moves that follow are seen only after the count that says a
        // drain began (a reader's acquire fence pairs with this).
        fence(Ordering::Release);
        DrainWindow(self)
    }
}

impl Drop for DrainWindow<'_> {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Release);
    }
}

/// How many times a count is taken again while drains keep overlapping it
/// before the last one is returned as it is.
const ACCOUNTING_TRIES: u32 = 10_000;

impl Core {
    /// Where every page is: a count no drain overlapped (each drain is
    /// short and ends, so this waits briefly at most), or after
    /// [`ACCOUNTING_TRIES`] overlapped counts, the last one.
    pub(super) fn accounting(&self) -> Accounting {
        let d = &self.drains;
        let mut tries = 0u32;
        loop {
            let ended = d.ended.load(Ordering::Acquire);
            let begun = d.begun.load(Ordering::Acquire);
            let a = self.count_pages();
            fence(Ordering::Acquire);
            let quiet = begun == ended && d.begun.load(Relaxed) == begun;
            tries += 1;
            if quiet || tries >= ACCOUNTING_TRIES {
                return a;
            }
            if tries % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// One pass over every place a free page can be (racy on its own).
    fn count_pages(&self) -> Accounting {
        let total = self.arena.nr_pages();
        let buddy = self.zone.nr_free_pages();
        let depot = self.zone.depot.len();
        let pcp: usize = self.pcp.iter().map(|s| s.nr_pages()).sum();
        let tc: usize = self.tcaches.lock().iter().map(|t| t.nr_pages()).sum();
        Accounting {
            total_pages: total,
            buddy_free_pages: buddy,
            depot_pages: depot,
            pcp_pages: pcp,
            thread_cache_pages: tc,
            in_use_pages: total.saturating_sub(buddy + depot + pcp + tc),
        }
    }

    pub(super) fn stats(&self) -> Stats {
        let a = self.accounting();
        let c = &self.counters;
        let w: Watermarks = self.zone.watermarks();
        let mut s = Stats {
            total_pages: a.total_pages,
            free_pages: a.buddy_free_pages,
            free_blocks_by_order: self.zone.free_blocks_by_order(),
            depot_pages: a.depot_pages,
            depot_max_pages: self.zone.depot.capacity(),
            pcp_pages: a.pcp_pages,
            thread_cache_pages: a.thread_cache_pages,
            in_use_pages: a.in_use_pages,
            watermarks: (w.min, w.low, w.high),
            alloc_thread_cache: c.tc_allocs.load(Relaxed),
            free_thread_cache: c.tc_frees.load(Relaxed),
            alloc_zone: c.zone_allocs.load(Relaxed),
            free_zone: c.zone_frees.load(Relaxed),
            bulk_alloc_calls: c.bulk_allocs.load(Relaxed),
            bulk_free_calls: c.bulk_frees.load(Relaxed),
            thread_cache_refills: c.tc_refills.load(Relaxed),
            thread_cache_flushes: c.tc_flushes.load(Relaxed),
            pcp_max_pages: self.limits.max_pages_per_cpu() * self.pcp.len(),
            thread_cache_max_pages: self.thread_cache_max_pages(),
            slowpath: c.slowpath.load(Relaxed),
            kswapd_wakeups: c.kswapd_wakeups.load(Relaxed),
            compact_calls: c.compact_calls.load(Relaxed),
            compact_success: c.compact_success.load(Relaxed),
            compact_fail: c.compact_fail.load(Relaxed),
            compact_skipped: c.compact_skipped.load(Relaxed),
            compact_migrate_scanned: c.compact_migrate_scanned.load(Relaxed),
            compact_free_scanned: c.compact_free_scanned.load(Relaxed),
            compact_isolated: c.compact_isolated.load(Relaxed),
            compact_migrated: c.compact_migrated.load(Relaxed),
            compact_migrate_failed: c.compact_migrate_failed.load(Relaxed),
            compact_ns: c.compact_ns.load(Relaxed),
            direct_reclaim_ns: c.direct_reclaim_ns.load(Relaxed),
            drain_all: c.drain_all.load(Relaxed),
            nofail_waits: c.nofail_waits.load(Relaxed),
            failures: c.failures.load(Relaxed),
            fault_injected: self.fault.injected(),
            ..Stats::default()
        };
        (s.direct_reclaim, s.shrinker_pages_freed) = self.shrinkers.totals();
        (s.pageblock_steals, s.pageblock_conversions) = self.zone.fallback_stats();
        for set in self.pcp.iter() {
            let k = &set.counters;
            s.pcp_refills += k.refills.load(Relaxed);
            s.pcp_refill_pages += k.refill_pages.load(Relaxed);
            s.pcp_drains += k.drains.load(Relaxed);
            s.pcp_drain_pages += k.drain_pages.load(Relaxed);
            s.pcp_lock_busy += k.lock_busy.load(Relaxed);
            s.alloc_pcp += k.allocs.load(Relaxed);
            s.free_pcp += k.frees.load(Relaxed);
        }
        for t in self.tcaches.lock().iter() {
            s.thread_caches += 1;
            s.alloc_thread_cache += t.allocs.load(Relaxed);
            s.free_thread_cache += t.frees.load(Relaxed);
            s.thread_cache_refills += t.refills.load(Relaxed);
            s.thread_cache_flushes += t.flushes.load(Relaxed);
            s.bulk_alloc_calls += t.bulk_allocs.load(Relaxed);
            s.bulk_free_calls += t.bulk_frees.load(Relaxed);
        }
        s
    }
}

impl fmt::Display for Stats {
    /// One `name value` line per counter, like `/proc/vmstat`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: [(&str, u64); 49] = [
            ("nr_pages", self.total_pages as u64),
            ("nr_free_pages", self.free_pages as u64),
            ("nr_depot_pages", self.depot_pages as u64),
            ("depot_max_pages", self.depot_max_pages as u64),
            ("nr_pcp_pages", self.pcp_pages as u64),
            ("nr_thread_cache_pages", self.thread_cache_pages as u64),
            ("nr_in_use_pages", self.in_use_pages as u64),
            ("watermark_min", self.watermarks.0 as u64),
            ("watermark_low", self.watermarks.1 as u64),
            ("watermark_high", self.watermarks.2 as u64),
            ("alloc_thread_cache", self.alloc_thread_cache),
            ("free_thread_cache", self.free_thread_cache),
            ("alloc_pcp", self.alloc_pcp),
            ("free_pcp", self.free_pcp),
            ("alloc_zone", self.alloc_zone),
            ("free_zone", self.free_zone),
            ("bulk_alloc_calls", self.bulk_alloc_calls),
            ("bulk_free_calls", self.bulk_free_calls),
            ("pcp_refills", self.pcp_refills),
            ("pcp_refill_pages", self.pcp_refill_pages),
            ("pcp_drains", self.pcp_drains),
            ("pcp_drain_pages", self.pcp_drain_pages),
            ("pcp_lock_busy", self.pcp_lock_busy),
            ("pcp_max_pages", self.pcp_max_pages as u64),
            ("thread_caches", self.thread_caches as u64),
            ("thread_cache_max_pages", self.thread_cache_max_pages as u64),
            ("thread_cache_refills", self.thread_cache_refills),
            ("thread_cache_flushes", self.thread_cache_flushes),
            ("slowpath", self.slowpath),
            ("kswapd_wakeups", self.kswapd_wakeups),
            ("direct_reclaim", self.direct_reclaim),
            ("direct_reclaim_time_ns", self.direct_reclaim_ns),
            ("shrinker_pages_freed", self.shrinker_pages_freed),
            ("compact_calls", self.compact_calls),
            ("compact_success", self.compact_success),
            ("compact_fail", self.compact_fail),
            ("compact_skipped", self.compact_skipped),
            ("compact_migrate_scanned", self.compact_migrate_scanned),
            ("compact_free_scanned", self.compact_free_scanned),
            ("compact_isolated", self.compact_isolated),
            ("pgmigrate_success", self.compact_migrated),
            ("pgmigrate_fail", self.compact_migrate_failed),
            ("compact_time_ns", self.compact_ns),
            ("pageblock_steals", self.pageblock_steals),
            ("pageblock_conversions", self.pageblock_conversions),
            ("drain_all", self.drain_all),
            ("nofail_waits", self.nofail_waits),
            ("alloc_failures", self.failures),
            ("fault_injected", self.fault_injected),
        ];
        for (name, v) in rows {
            writeln!(f, "{name} {v}")?;
        }
        for (o, n) in self.free_blocks_by_order.iter().enumerate() {
            writeln!(f, "free_blocks_order{o} {n}")?;
        }
        Ok(())
    }
}
