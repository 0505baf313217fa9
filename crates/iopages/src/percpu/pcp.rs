//! Per-CPU page lists (the kernel's `per_cpu_pages`).
//!
//! Owns: for every CPU, one stack of free blocks per order 0..=3, each with
//! `high` and `batch`, behind one per-CPU lock. Refills take blocks from the
//! zone and drains give them back, always in batches under one zone-lock
//! hold. Must never: wait for its lock — a thread can be preempted or
//! migrated at any instant, so another thread may hold "this CPU's" lock;
//! the lock is tried and, when busy, the caller goes to the zone instead
//! (as Linux does since 6.0).
//!
//! The lists are arrays (stacks of [`Page`]), not linked lists: taking or
//! giving a batch is a copy, and a block in a list is never touched through
//! its frame metadata.

use crate::buddy::arena::Arena;
use crate::buddy::frame::Page;
use crate::buddy::zone::{AllocFlags, Zone};
use crate::percpu::trylock::{Held, TryLock};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Orders kept on the per-CPU lists: 0..=PCP_MAX_ORDER (the kernel's
/// `PAGE_ALLOC_COSTLY_ORDER`).
pub const PCP_MAX_ORDER: u32 = 3;
/// Number of per-CPU orders.
pub const PCP_ORDERS: usize = PCP_MAX_ORDER as usize + 1;
/// Upper bound on `high` for any list, in blocks.
pub const PCP_HIGH_MAX: usize = 1 << 14;

/// `high` and `batch` for each per-CPU order, in blocks of that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PcpLimits {
    /// Most blocks a list keeps before draining a batch to the zone.
    pub high: [usize; PCP_ORDERS],
    /// Blocks moved per refill or drain.
    pub batch: [usize; PCP_ORDERS],
}

impl PcpLimits {
    /// Defaults: all lists of all CPUs together hold at most 1/8 of the
    /// zone (the kernel's `percpu_pagelist_high_fraction` idea); order 0
    /// keeps at most 512 blocks and moves 64 at a time; higher orders keep
    /// proportionally fewer.
    pub fn for_zone(nr_pages: usize, nr_cpus: usize) -> PcpLimits {
        let budget = (nr_pages / 8 / nr_cpus.max(1)).max(PCP_ORDERS);
        let mut l = PcpLimits {
            high: [0; PCP_ORDERS],
            batch: [0; PCP_ORDERS],
        };
        for o in 0..PCP_ORDERS {
            let high = ((budget / PCP_ORDERS).min(512) >> o).max(1);
            l.high[o] = high;
            l.batch[o] = (high / 4).clamp(1, 64);
        }
        l
    }

    /// Most pages one CPU's lists can hold.
    pub fn max_pages_per_cpu(&self) -> usize {
        (0..PCP_ORDERS).map(|o| self.high[o] << o).sum()
    }
}

struct Lists {
    stacks: [Vec<Page>; PCP_ORDERS],
    /// Order-0 pages on their way out, gathered into whole magazines for
    /// the depot.
    outgoing: Vec<Page>,
}

/// Statistics of one CPU's lists, written under its lock.
#[derive(Default)]
pub(crate) struct PcpCounters {
    pub refills: AtomicU64,
    pub refill_pages: AtomicU64,
    pub drains: AtomicU64,
    pub drain_pages: AtomicU64,
    pub lock_busy: AtomicU64,
    pub allocs: AtomicU64,
    pub frees: AtomicU64,
}

/// One CPU's lists.
#[repr(align(128))]
pub(crate) struct PcpSet {
    lock: TryLock,
    lists: UnsafeCell<Lists>,
    /// Pages held (sum over orders of blocks << order), for accounting.
    nr_pages: AtomicUsize,
    pub counters: PcpCounters,
}

// SAFETY: `lists` is only reached through a `PcpGuard`, which exists only
// while `lock` is held by its creator.
unsafe impl Sync for PcpSet {}

impl PcpSet {
    pub(crate) fn new(limits: &PcpLimits) -> PcpSet {
        PcpSet {
            lock: TryLock::new(),
            lists: UnsafeCell::new(Lists {
                stacks: std::array::from_fn(|o| Vec::with_capacity(limits.high[o])),
                outgoing: Vec::new(),
            }),
            nr_pages: AtomicUsize::new(0),
            counters: PcpCounters::default(),
        }
    }

    /// Try to take this set's lock; `None` if another thread holds it.
    #[inline]
    pub(crate) fn try_lock<'a>(
        &'a self,
        zone: &'a Zone,
        arena: &'a Arena,
        limits: &'a PcpLimits,
    ) -> Option<PcpGuard<'a>> {
        match self.lock.try_lock() {
            Some(held) => Some(PcpGuard {
                set: self,
                zone,
                arena,
                limits,
                _held: held,
            }),
            None => {
                // Not the holder: other failed callers may count at once.
                self.counters.lock_busy.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Pages held on this CPU's lists (racy snapshot).
    pub(crate) fn nr_pages(&self) -> usize {
        self.nr_pages.load(Ordering::Relaxed)
    }
}

/// Add to a counter that only the lock holder writes: no atomic RMW needed.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// One CPU's lists, locked.
pub(crate) struct PcpGuard<'a> {
    set: &'a PcpSet,
    zone: &'a Zone,
    arena: &'a Arena,
    limits: &'a PcpLimits,
    _held: Held<'a>,
}

impl Drop for PcpGuard<'_> {
    fn drop(&mut self) {
        let lists = self.lists();
        let pages: usize = (0..PCP_ORDERS).map(|o| lists.stacks[o].len() << o).sum();
        self.set.nr_pages.store(pages, Ordering::Relaxed);
        // `_held` releases the lock after this.
    }
}

impl PcpGuard<'_> {
    #[inline]
    #[allow(clippy::mut_from_ref)]
    fn lists(&self) -> &mut Lists {
        // SAFETY: the guard holds the set's lock, so no other reference to
        // the lists exists; callers never keep two of these alive at once.
        unsafe { &mut *self.set.lists.get() }
    }

    /// Take up to `nr` blocks of `order`, refilling from the zone in
    /// batches; `put` receives them a run at a time (a slice, so callers
    /// copy rather than push one by one). Returns how many were taken
    /// (fewer when the zone is at its watermark or empty).
    #[inline]
    pub(crate) fn take(
        &mut self,
        order: u32,
        nr: usize,
        wm: AllocFlags,
        mut put: impl FnMut(&[Page]),
    ) -> usize {
        let o = order as usize;
        let mut got = 0;
        while got < nr {
            if self.lists().stacks[o].is_empty() && self.refill(order, nr - got, wm) == 0 {
                break;
            }
            let stack = &mut self.lists().stacks[o];
            let k = stack.len().min(nr - got);
            let at = stack.len() - k;
            put(&stack[at..]);
            stack.truncate(at);
            got += k;
        }
        got
    }

    /// Refill an empty list with at least a batch (more if `want` is larger,
    /// up to `high`) under one zone-lock hold.
    #[cold]
    fn refill(&mut self, order: u32, want: usize, wm: AllocFlags) -> usize {
        let o = order as usize;
        if !self.zone.watermark_ok(1 << order, wm) {
            return 0;
        }
        let batch = self.limits.batch[o];
        let nr = want
            .div_ceil(batch)
            .saturating_mul(batch)
            .min(self.limits.high[o]);
        let stack = &mut self.lists().stacks[o];
        debug_assert!(stack.is_empty());
        if order == 0 {
            // Whole magazines from the depot first, as many as fit.
            let mag = self.zone.depot.magazine();
            while stack.len() < nr
                && stack.len() + mag <= self.limits.high[0].max(mag)
                && self.zone.depot.take(|m| stack.extend_from_slice(m))
            {}
        }
        if !stack.is_empty() {
            bump(&self.set.counters.refills, 1);
            bump(&self.set.counters.refill_pages, stack.len() as u64);
            return stack.len();
        }
        let mut z = self.zone.lock(self.arena);
        for _ in 0..nr {
            match z.alloc(order) {
                Some(pfn) => stack.push(Page::from_pfn(pfn)),
                None => break,
            }
        }
        drop(z);
        let got = stack.len();
        bump(&self.set.counters.refills, 1);
        bump(&self.set.counters.refill_pages, (got << o) as u64);
        got
    }

    /// Take `n` blocks of `order` back from `pages`. Whatever would push
    /// the list past `high` goes to the zone, oldest first, at least a
    /// batch at a time, under one zone-lock hold.
    #[inline]
    pub(crate) fn give(&mut self, order: u32, n: usize, mut pages: impl Iterator<Item = Page>) {
        let o = order as usize;
        let high = self.limits.high[o];
        let stack = &mut self.lists().stacks[o];
        let total = stack.len() + n;
        if total <= high {
            stack.extend(pages.take(n));
            return;
        }
        let excess = (total - high).max(self.limits.batch[o]).min(total);
        let from_list = excess.min(stack.len());
        let from_new = excess - from_list;
        if order == 0 {
            // Order-0 pages park in the depot as whole magazines when it has
            // room, so the CPU that allocates next takes them without
            // merging and splitting; only what does not fit goes to the
            // zone.
            let lists = self.lists();
            let out = &mut lists.outgoing;
            out.clear();
            out.extend(lists.stacks[0].drain(..from_list));
            out.extend(pages.by_ref().take(from_new));
            let mut parked = 0;
            for m in out.chunks_exact(self.zone.depot.magazine()) {
                if !self.zone.depot.put(m) {
                    break;
                }
                parked += m.len();
            }
            if parked < out.len() {
                let mut z = self.zone.lock(self.arena);
                for p in &out[parked..] {
                    z.free(p.pfn(), 0);
                }
            }
        } else {
            let mut z = self.zone.lock(self.arena);
            for p in stack
                .drain(..from_list)
                .chain(pages.by_ref().take(from_new))
            {
                z.free(p.pfn(), order);
            }
        }
        let stack = &mut self.lists().stacks[o];
        stack.extend(pages.take(n - from_new));
        debug_assert!(stack.len() <= high);
        bump(&self.set.counters.drains, 1);
        bump(&self.set.counters.drain_pages, (excess << o) as u64);
    }

    /// Assert the lists' invariants (allocation checks run this at the
    /// boundary with the caches): no list above `high`, every block in the
    /// arena and aligned to its order.
    #[cold]
    pub(crate) fn check(&self) {
        for (o, stack) in self.lists().stacks.iter().enumerate() {
            assert!(
                stack.len() <= self.limits.high[o],
                "per-CPU list of order {o} holds {} blocks, above high {}",
                stack.len(),
                self.limits.high[o]
            );
            for &p in stack {
                self.arena.check_block(p, o as u32, "per-CPU list");
            }
        }
    }

    /// Count single allocations (`frees == false`) or frees served here.
    #[inline]
    pub(crate) fn note(&self, frees: bool, n: u64) {
        let c = &self.set.counters;
        bump(if frees { &c.frees } else { &c.allocs }, n);
    }

    /// Return every block on every list to the zone. Returns pages drained.
    pub(crate) fn drain(&mut self) -> usize {
        let mut z = self.zone.lock(self.arena);
        let mut pages = 0;
        for o in 0..PCP_ORDERS {
            let stack = &mut self.lists().stacks[o];
            pages += stack.len() << o;
            for p in stack.drain(..) {
                z.free(p.pfn(), o as u32);
            }
        }
        drop(z);
        if pages > 0 {
            bump(&self.set.counters.drains, 1);
            bump(&self.set.counters.drain_pages, pages as u64);
        }
        pages
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buddy::arena::HugePages;
    use crate::buddy::zone::Watermarks;

    const ANY: AllocFlags = AllocFlags::WMARK_MIN.with(AllocFlags::NO_WATERMARKS);

    #[test]
    fn default_limits_fit_in_an_eighth_of_the_zone() {
        for (pages, cpus) in [
            (1024, 1),
            (1024, 64),
            (262_144, 2),
            (262_144, 16),
            (4 << 20, 256),
        ] {
            let l = PcpLimits::for_zone(pages, cpus);
            for o in 0..PCP_ORDERS {
                assert!(l.batch[o] >= 1 && l.batch[o] <= l.high[o], "{l:?}");
            }
            if pages / 8 / cpus >= 64 {
                assert!(
                    l.max_pages_per_cpu() * cpus <= pages / 8 + cpus * 64,
                    "{pages} {cpus} {l:?}"
                );
            }
        }
        let big = PcpLimits::for_zone(262_144, 2);
        assert_eq!((big.high[0], big.batch[0]), (512, 64));
    }

    #[test]
    fn refill_and_drain_move_whole_batches_and_keep_high() {
        let a = Arena::new(8 << 20, HugePages::Never, false).unwrap();
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        let limits = PcpLimits {
            high: [16, 8, 4, 2],
            batch: [4, 2, 1, 1],
        };
        let set = PcpSet::new(&limits);
        let mut g = set.try_lock(&z, &a, &limits).unwrap();
        assert!(
            set.try_lock(&z, &a, &limits).is_none(),
            "the lock must be exclusive"
        );
        let mut got = Vec::new();
        assert_eq!(g.take(0, 1, ANY, |p| got.extend_from_slice(p)), 1);
        // One batch of 4 came from the zone, one went out.
        assert_eq!(z.nr_free_pages(), 2048 - 4);
        assert_eq!(g.take(0, 10, ANY, |p| got.extend_from_slice(p)), 10);
        assert_eq!(got.len(), 11);
        g.give(0, got.len(), got.iter().copied());
        assert!(g.lists().stacks[0].len() <= 16);
        let held = 2048 - z.nr_free_pages();
        assert_eq!(g.drain(), held);
        drop(g);
        assert_eq!(z.nr_free_pages(), 2048);
        assert_eq!(set.nr_pages(), 0);
        assert!(set.counters.refills.load(Ordering::Relaxed) >= 2);
    }

    #[test]
    fn refill_stops_at_the_watermark() {
        let a = Arena::new(4 << 20, HugePages::Never, false).unwrap();
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        z.set_watermarks(Watermarks {
            min: 2000,
            low: 2000,
            high: 2000,
        });
        let limits = PcpLimits::for_zone(a.nr_pages(), 1);
        let set = PcpSet::new(&limits);
        let mut g = set.try_lock(&z, &a, &limits).unwrap();
        let low = AllocFlags::WMARK_LOW;
        assert_eq!(g.take(0, 1, low, |_| panic!("nothing to take")), 0);
        assert_eq!(z.nr_free_pages(), 1024);
    }
}
