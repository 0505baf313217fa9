//! The zone: a binary buddy allocator over the arena's frames, with
//! watermarks.
//!
//! Owns: the free lists of orders 0..=10 (doubly linked through the frames'
//! metadata), the free counts per order, and the min/low/high watermarks.
//! Must never: be entered without its lock, or look at per-CPU or per-thread
//! caches — pages in those are "allocated" as far as the zone knows, exactly
//! as in the kernel.
//!
//! A free block of order k starting at frame p has `BUDDY` set and order k on
//! frame p; its buddy is p ^ 2^k. Freeing merges with the buddy for as long
//! as the buddy is a free block of the same order, so the largest blocks come
//! back whenever everything is free.

use crate::arena::Arena;
use crate::depot::Depot;
use crate::frame::{flags, MAX_ORDER, NIL, NR_ORDERS};
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The three watermarks, in pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watermarks {
    /// Below this only `MEMALLOC` (and, to half of it, `HIGH`) may allocate.
    pub min: usize,
    /// Below this the background reclaimer is woken.
    pub low: usize,
    /// Background reclaim stops above this.
    pub high: usize,
}

impl Watermarks {
    /// Defaults for a zone of `nr_pages`, the kernel's proportions: min is
    /// 1/128 of the zone (at least 16 pages), low = min + min/4, high = min +
    /// min/2.
    pub fn for_zone(nr_pages: usize) -> Watermarks {
        let min = (nr_pages / 128).max(16).min(nr_pages / 8);
        Watermarks {
            min,
            low: min + min / 4,
            high: min + min / 2,
        }
    }
}

/// Which watermark an allocation must keep the zone above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    Min,
    Low,
}

/// The free lists, guarded by the zone lock.
pub(crate) struct FreeArea {
    head: [u32; NR_ORDERS],
    nr_free: [usize; NR_ORDERS],
}

/// A buddy zone over every frame of an arena.
pub struct Zone {
    area: Mutex<FreeArea>,
    /// Free pages in the buddy, readable without the lock (for watermarks).
    nr_free_pages: AtomicUsize,
    wmark: [AtomicUsize; 3],
    nr_pages: usize,
    /// Whole batches of free order-0 pages in transit between CPUs.
    pub(crate) depot: Depot,
}

impl Zone {
    /// A zone whose every frame is free (as largest blocks).
    pub(crate) fn new(arena: &Arena, wmark: Watermarks, depot_pages: usize) -> Zone {
        let zone = Zone {
            area: Mutex::new(FreeArea {
                head: [NIL; NR_ORDERS],
                nr_free: [0; NR_ORDERS],
            }),
            nr_free_pages: AtomicUsize::new(0),
            wmark: [
                AtomicUsize::new(wmark.min),
                AtomicUsize::new(wmark.low),
                AtomicUsize::new(wmark.high),
            ],
            nr_pages: arena.nr_pages(),
            depot: Depot::new(depot_pages),
        };
        {
            let mut z = zone.lock(arena);
            let step = 1usize << MAX_ORDER;
            for pfn in (0..arena.nr_pages()).step_by(step) {
                z.free(pfn as u32, MAX_ORDER);
            }
        }
        zone
    }

    /// Take the zone lock.
    #[inline]
    pub(crate) fn lock<'a>(&'a self, arena: &'a Arena) -> Locked<'a> {
        Locked {
            area: self.area.lock(),
            zone: self,
            arena,
            delta: 0,
        }
    }

    /// Free pages in the buddy (a racy but never torn read).
    #[inline]
    pub fn nr_free_pages(&self) -> usize {
        self.nr_free_pages.load(Relaxed)
    }

    /// Pages managed by the zone.
    pub fn nr_pages(&self) -> usize {
        self.nr_pages
    }

    /// The current watermarks.
    pub fn watermarks(&self) -> Watermarks {
        Watermarks {
            min: self.wmark[0].load(Relaxed),
            low: self.wmark[1].load(Relaxed),
            high: self.wmark[2].load(Relaxed),
        }
    }

    pub(crate) fn set_watermarks(&self, w: Watermarks) {
        self.wmark[0].store(w.min, Relaxed);
        self.wmark[1].store(w.low, Relaxed);
        self.wmark[2].store(w.high, Relaxed);
    }

    /// Whether taking `nr` more pages leaves the zone above `mark`, for an
    /// allocation allowed `high` (dip to half of min) or `no_watermarks`.
    #[inline]
    pub(crate) fn watermark_ok(
        &self,
        nr: usize,
        mark: Mark,
        high: bool,
        no_watermarks: bool,
    ) -> bool {
        if no_watermarks {
            return true;
        }
        let mut line = match mark {
            Mark::Min => self.wmark[0].load(Relaxed),
            Mark::Low => self.wmark[1].load(Relaxed),
        };
        if high {
            line -= line / 2;
        }
        // Pages parked in the depot are free and ready for order-0 use.
        (self.nr_free_pages() + self.depot.len()).saturating_sub(nr) >= line
    }

    /// Return every page parked in the depot to the buddy lists.
    pub(crate) fn drain_depot(&self, arena: &Arena) -> usize {
        if self.depot.len() == 0 {
            return 0;
        }
        let mut z = self.lock(arena);
        self.depot.drain(|run| {
            for p in run {
                z.free(p.pfn(), 0);
            }
        })
    }

    /// Free blocks per order (takes the lock briefly).
    pub fn free_blocks_by_order(&self) -> [usize; NR_ORDERS] {
        self.area.lock().nr_free
    }
}

/// The zone, locked. Counts changes and publishes them on drop.
pub(crate) struct Locked<'a> {
    area: MutexGuard<'a, FreeArea>,
    zone: &'a Zone,
    arena: &'a Arena,
    delta: isize,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if self.delta >= 0 {
            self.zone
                .nr_free_pages
                .fetch_add(self.delta as usize, Relaxed);
        } else {
            self.zone
                .nr_free_pages
                .fetch_sub(self.delta.unsigned_abs(), Relaxed);
        }
    }
}

impl Locked<'_> {
    fn list_add(&mut self, pfn: u32, order: u32) {
        let f = self.arena.frame(pfn);
        let head = self.area.head[order as usize];
        debug_assert_eq!(f.flags() & flags::BUDDY, 0, "pfn {pfn} already free");
        f.set_flags(flags::BUDDY);
        f.set_order(order);
        f.set_prev(NIL);
        f.set_next(head);
        if head != NIL {
            self.arena.frame(head).set_prev(pfn);
        }
        self.area.head[order as usize] = pfn;
        self.area.nr_free[order as usize] += 1;
    }

    fn list_del(&mut self, pfn: u32, order: u32) {
        let f = self.arena.frame(pfn);
        debug_assert!(f.flags() & flags::BUDDY != 0 && f.order() == order);
        let (prev, next) = (f.prev(), f.next());
        if prev != NIL {
            self.arena.frame(prev).set_next(next);
        } else {
            debug_assert_eq!(self.area.head[order as usize], pfn);
            self.area.head[order as usize] = next;
        }
        if next != NIL {
            self.arena.frame(next).set_prev(prev);
        }
        f.set_flags(0);
        f.set_prev(0);
        f.set_next(0);
        self.area.nr_free[order as usize] -= 1;
    }

    /// Take a block of exactly `order`, splitting a larger one if needed.
    /// Returns its first frame.
    pub(crate) fn alloc(&mut self, order: u32) -> Option<u32> {
        debug_assert!(order <= MAX_ORDER);
        let found = (order..=MAX_ORDER).find(|&o| self.area.head[o as usize] != NIL)?;
        let pfn = self.area.head[found as usize];
        self.list_del(pfn, found);
        // Hand back the upper halves, largest first.
        let mut o = found;
        while o > order {
            o -= 1;
            self.list_add(pfn + (1 << o), o);
        }
        self.delta -= 1 << order;
        Some(pfn)
    }

    /// Return a block of `order` starting at `pfn`, merging with free buddies.
    pub(crate) fn free(&mut self, mut pfn: u32, mut order: u32) {
        let nr_pages = self.arena.nr_pages() as u32;
        debug_assert!(
            pfn < nr_pages && pfn & ((1 << order) - 1) == 0,
            "bad block {pfn}/{order}"
        );
        self.delta += 1 << order;
        while order < MAX_ORDER {
            let buddy = pfn ^ (1 << order);
            if buddy >= nr_pages {
                break;
            }
            let b = self.arena.frame(buddy);
            if b.flags() & flags::BUDDY == 0 || b.order() != order {
                break;
            }
            self.list_del(buddy, order);
            pfn &= buddy;
            order += 1;
        }
        self.list_add(pfn, order);
    }

    /// Free blocks per order.
    #[cfg(test)]
    pub(crate) fn nr_free(&self) -> [usize; NR_ORDERS] {
        self.area.nr_free
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::HugePages;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn arena(mib: u64) -> Arena {
        Arena::new(mib << 20, HugePages::Never, false).unwrap()
    }

    #[test]
    fn a_new_zone_is_all_largest_blocks() {
        let a = arena(8);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0);
        assert_eq!(z.nr_free_pages(), 2048);
        let by_order = z.free_blocks_by_order();
        assert_eq!(by_order[MAX_ORDER as usize], 2);
        assert_eq!(by_order.iter().sum::<usize>(), 2);
    }

    #[test]
    fn split_then_free_merges_back() {
        let a = arena(4);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0);
        let mut l = z.lock(&a);
        let p = l.alloc(0).unwrap();
        assert_eq!(p, 0);
        // 1 + 2 + 4 + ... + 512 = 1023 pages left, one block of each order 0..=9.
        assert_eq!(l.nr_free()[..10], [1; 10]);
        l.free(p, 0);
        assert_eq!(l.nr_free()[MAX_ORDER as usize], 1);
        drop(l);
        assert_eq!(z.nr_free_pages(), 1024);
    }

    #[test]
    fn watermarks_follow_the_kernel_proportions() {
        let w = Watermarks::for_zone(262_144);
        assert_eq!(w.min, 2048);
        assert_eq!(w.low, 2560);
        assert_eq!(w.high, 3072);
        let small = Watermarks::for_zone(1024);
        assert!(small.min <= small.low && small.low <= small.high && small.high < 1024);
    }

    proptest! {
        /// No frame is handed out twice, the free count always adds up, and
        /// freeing everything restores the largest blocks.
        #[test]
        fn buddy_invariants(ops in proptest::collection::vec((0u32..=MAX_ORDER, any::<bool>(), any::<prop::sample::Index>()), 1..300)) {
            let a = arena(8);
            let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0);
            let total = a.nr_pages();
            let mut held: Vec<(u32, u32)> = Vec::new();
            let mut used: BTreeSet<u32> = BTreeSet::new();
            for (order, alloc, idx) in ops {
                if alloc || held.is_empty() {
                    let got = z.lock(&a).alloc(order);
                    if let Some(pfn) = got {
                        prop_assert_eq!(pfn % (1 << order), 0, "block not aligned to its order");
                        for f in pfn..pfn + (1 << order) {
                            prop_assert!(used.insert(f), "frame {} handed out twice", f);
                        }
                        held.push((pfn, order));
                    }
                } else {
                    let (pfn, order) = held.swap_remove(idx.index(held.len()));
                    for f in pfn..pfn + (1 << order) {
                        used.remove(&f);
                    }
                    z.lock(&a).free(pfn, order);
                }
                prop_assert_eq!(z.nr_free_pages() + used.len(), total);
                let by_order = z.free_blocks_by_order();
                let counted: usize = by_order.iter().enumerate().map(|(o, n)| n << o).sum();
                prop_assert_eq!(counted, z.nr_free_pages());
            }
            for (pfn, order) in held.drain(..) {
                z.lock(&a).free(pfn, order);
            }
            prop_assert_eq!(z.nr_free_pages(), total);
            prop_assert_eq!(z.free_blocks_by_order()[MAX_ORDER as usize], total >> MAX_ORDER);
        }
    }
}
