//! The zone: a binary buddy allocator over the arena's frames, with
//! watermarks, grouped by mobility.
//!
//! Owns: the free lists of orders 0..=10 per migratetype (doubly linked
//! through the frames' metadata), the free counts, the min/low/high
//! watermarks, and the migratetype of every pageblock. Must never: be
//! entered without its lock, or look at per-CPU or per-thread caches —
//! pages in those are "allocated" as far as the zone knows, exactly as in
//! the kernel.
//!
//! A free block of order k starting at frame p has `BUDDY` set and order k on
//! frame p; its buddy is p ^ 2^k. Freeing merges with the buddy for as long
//! as the buddy is a free block of the same order, so the largest blocks come
//! back whenever everything is free.
//!
//! ## Grouping by mobility
//!
//! The arena is cut into pageblocks of 2^[`PAGEBLOCK_ORDER`] frames (2 MiB,
//! the kernel's x86 choice: half a largest block, so that compaction can
//! make blocks up to order 9 inside one pageblock). Each pageblock has a
//! [`MigrateType`], kept in a side array of the zone (one byte per
//! pageblock; the frame's spare byte is not the zone's to take). A free
//! block always sits on the list of its pageblock's type; a block of order
//! 10 spans two pageblocks, which then always have the same type (merging
//! two free halves unifies them — a wholly free pageblock's type is
//! irrelevant).
//!
//! An allocation prefers its own type (the smallest fitting block, as
//! before). When its type has nothing, it steals from the other: the
//! *largest* free block there (large steals keep the types apart, as the
//! kernel's `__rmqueue_fallback`), converting the pageblock holding the
//! allocation to its own type when at least half of that pageblock is free
//! (moving the pageblock's other free blocks to the new type's lists). All
//! pageblocks start movable, as in the kernel: unmovable allocations carve
//! whole pageblocks out of them.
//!
//! The zone's plain `alloc` (used by the per-CPU lists and every type-agnostic
//! path) prefers unmovable pageblocks; only the allocator's `MOVABLE` path
//! asks for movable ones (see `page_alloc/fastpath.rs`, `alloc_cached`).

use crate::buddy::arena::Arena;
use crate::buddy::depot::Depot;
use crate::buddy::frame::{flags, Page, MAX_ORDER, NIL, NR_ORDERS};
use crate::gfp::Gfp;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};

/// log2 of the frames in a pageblock, the unit of grouping by mobility.
pub const PAGEBLOCK_ORDER: u32 = 9;
/// Frames in a pageblock (512, 2 MiB).
pub const PAGEBLOCK_NR_PAGES: usize = 1 << PAGEBLOCK_ORDER;
/// Number of migratetypes.
pub(crate) const NR_MIGRATETYPES: usize = 2;

/// What kind of allocations a pageblock serves (the kernel's
/// `MIGRATE_UNMOVABLE` / `MIGRATE_MOVABLE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MigrateType {
    /// Pages that stay where they are (kernel data, I/O buffers, pinned
    /// memory): every allocation without `Gfp::MOVABLE`.
    Unmovable = 0,
    /// Pages whose owner can move them (registered with the allocator's
    /// movable-owner registry), allocated with `Gfp::MOVABLE`.
    Movable = 1,
}

impl MigrateType {
    /// The type an allocation with `gfp` asks for.
    #[inline]
    pub fn of(gfp: Gfp) -> MigrateType {
        if gfp.contains(Gfp::MOVABLE) {
            MigrateType::Movable
        } else {
            MigrateType::Unmovable
        }
    }

    #[inline]
    fn from_u8(v: u8) -> MigrateType {
        if v == MigrateType::Movable as u8 {
            MigrateType::Movable
        } else {
            MigrateType::Unmovable
        }
    }

    #[inline]
    fn other(self) -> MigrateType {
        match self {
            MigrateType::Unmovable => MigrateType::Movable,
            MigrateType::Movable => MigrateType::Unmovable,
        }
    }
}

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

/// How an allocation may use the zone's reserves, as one bit set passed
/// down the allocation path (the kernel's `alloc_flags`): which watermark
/// it must keep the zone above, whether it may dip below it (`HIGH`), or
/// ignore watermarks altogether (`NO_WATERMARKS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AllocFlags(u8);

impl AllocFlags {
    /// Keep the zone above its min watermark.
    pub(crate) const WMARK_MIN: AllocFlags = AllocFlags(0);
    /// Keep the zone above its low watermark (the fast path's rule).
    pub(crate) const WMARK_LOW: AllocFlags = AllocFlags(1);
    const WMARK_MASK: u8 = 3;
    /// May go down to half the watermark (`Gfp::HIGH`).
    pub(crate) const HIGH: AllocFlags = AllocFlags(4);
    /// Ignores watermarks (`Gfp::MEMALLOC`).
    pub(crate) const NO_WATERMARKS: AllocFlags = AllocFlags(8);

    /// Both sets.
    #[inline]
    pub(crate) const fn with(self, other: AllocFlags) -> AllocFlags {
        AllocFlags(self.0 | other.0)
    }

    /// `other` added when `on`.
    #[inline]
    pub(crate) const fn with_if(self, on: bool, other: AllocFlags) -> AllocFlags {
        if on {
            self.with(other)
        } else {
            self
        }
    }

    #[inline]
    const fn has(self, bit: AllocFlags) -> bool {
        self.0 & bit.0 != 0
    }
}

/// The free lists, guarded by the zone lock.
pub(crate) struct FreeArea {
    head: [[u32; NR_ORDERS]; NR_MIGRATETYPES],
    nr_free: [[usize; NR_ORDERS]; NR_MIGRATETYPES],
}

/// A buddy zone over every frame of an arena.
pub struct Zone {
    area: Mutex<FreeArea>,
    /// Free pages in the buddy, readable without the lock (for watermarks).
    nr_free_pages: AtomicUsize,
    wmark: [AtomicUsize; 3],
    nr_pages: usize,
    /// The migratetype of every pageblock (written under the zone lock,
    /// read anywhere).
    pageblock: Box<[AtomicU8]>,
    /// Allocations served from the other type's lists.
    steals: AtomicU64,
    /// Pageblocks whose type changed.
    conversions: AtomicU64,
    /// Full magazines of free order-0 pages in transit between CPUs.
    pub(crate) depot: Depot,
}

impl Zone {
    /// A zone whose every frame is free (as largest blocks), every
    /// pageblock movable.
    /// `depot_pages` is the depot's capacity, in magazines of
    /// `depot_magazine` pages.
    pub(crate) fn new(
        arena: &Arena,
        wmark: Watermarks,
        depot_pages: usize,
        depot_magazine: usize,
    ) -> Zone {
        let nr_pageblocks = arena.nr_pages().div_ceil(PAGEBLOCK_NR_PAGES);
        let zone = Zone {
            area: Mutex::new(FreeArea {
                head: [[NIL; NR_ORDERS]; NR_MIGRATETYPES],
                nr_free: [[0; NR_ORDERS]; NR_MIGRATETYPES],
            }),
            nr_free_pages: AtomicUsize::new(0),
            wmark: [
                AtomicUsize::new(wmark.min),
                AtomicUsize::new(wmark.low),
                AtomicUsize::new(wmark.high),
            ],
            nr_pages: arena.nr_pages(),
            pageblock: (0..nr_pageblocks)
                .map(|_| AtomicU8::new(MigrateType::Movable as u8))
                .collect(),
            steals: AtomicU64::new(0),
            conversions: AtomicU64::new(0),
            depot: Depot::new(depot_pages, depot_magazine),
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

    /// Whether taking `nr` more pages leaves the zone above the watermark
    /// `flags` names, by `flags`' rules.
    #[inline]
    pub(crate) fn watermark_ok(&self, nr: usize, flags: AllocFlags) -> bool {
        if flags.has(AllocFlags::NO_WATERMARKS) {
            return true;
        }
        let mut line = self.wmark[(flags.0 & AllocFlags::WMARK_MASK) as usize].load(Relaxed);
        if flags.has(AllocFlags::HIGH) {
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

    /// Free blocks per order, both migratetypes together (takes the lock
    /// briefly).
    pub fn free_blocks_by_order(&self) -> [usize; NR_ORDERS] {
        let a = self.area.lock();
        std::array::from_fn(|o| a.nr_free.iter().map(|t| t[o]).sum())
    }

    /// Free blocks per order on `mt`'s lists (takes the lock briefly).
    pub fn free_blocks_of_type(&self, mt: MigrateType) -> [usize; NR_ORDERS] {
        self.area.lock().nr_free[mt as usize]
    }

    /// Whether a free block of at least `order` exists, of either type
    /// (takes the lock briefly).
    pub fn has_free_block(&self, order: u32) -> bool {
        let a = self.area.lock();
        (order..=MAX_ORDER).any(|o| a.nr_free.iter().any(|t| t[o as usize] > 0))
    }

    /// Pageblocks in the zone.
    pub fn nr_pageblocks(&self) -> usize {
        self.pageblock.len()
    }

    /// The migratetype of the pageblock holding frame `pfn` (a racy read;
    /// types change only under the zone lock).
    ///
    /// # Panics
    /// If `pfn` is outside the zone.
    #[inline]
    pub fn pageblock_type(&self, pfn: u32) -> MigrateType {
        MigrateType::from_u8(self.pageblock[(pfn >> PAGEBLOCK_ORDER) as usize].load(Relaxed))
    }

    /// Pageblocks of each type right now: (unmovable, movable).
    pub fn pageblocks_by_type(&self) -> (usize, usize) {
        let movable = self
            .pageblock
            .iter()
            .filter(|t| t.load(Relaxed) == MigrateType::Movable as u8)
            .count();
        (self.pageblock.len() - movable, movable)
    }

    /// (allocations served by stealing from the other type, pageblocks
    /// converted) since the zone was made.
    pub fn fallback_stats(&self) -> (u64, u64) {
        (self.steals.load(Relaxed), self.conversions.load(Relaxed))
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
    #[inline]
    fn pb_type(&self, pfn: u32) -> MigrateType {
        self.zone.pageblock_type(pfn)
    }

    fn set_pb_type(&self, pfn: u32, mt: MigrateType) {
        let slot = &self.zone.pageblock[(pfn >> PAGEBLOCK_ORDER) as usize];
        if slot.swap(mt as u8, Relaxed) != mt as u8 {
            self.zone.conversions.fetch_add(1, Relaxed);
        }
    }

    /// Put a free block on the list of its pageblock's type; a block
    /// larger than a pageblock gives all its pageblocks the first one's
    /// type.
    fn list_add(&mut self, pfn: u32, order: u32) {
        let mt = self.pb_type(pfn);
        if order > PAGEBLOCK_ORDER {
            for pb in (pfn..pfn + (1 << order))
                .step_by(PAGEBLOCK_NR_PAGES)
                .skip(1)
            {
                self.zone.pageblock[(pb >> PAGEBLOCK_ORDER) as usize].store(mt as u8, Relaxed);
            }
        }
        self.list_add_mt(pfn, order, mt);
    }

    fn list_add_mt(&mut self, pfn: u32, order: u32, mt: MigrateType) {
        let f = self.arena.frame(pfn);
        let head = self.area.head[mt as usize][order as usize];
        debug_assert_eq!(f.flags() & flags::BUDDY, 0, "pfn {pfn} already free");
        f.set_flags(flags::BUDDY);
        f.set_order(order);
        f.set_prev(NIL);
        f.set_next(head);
        if head != NIL {
            self.arena.frame(head).set_prev(pfn);
        }
        self.area.head[mt as usize][order as usize] = pfn;
        self.area.nr_free[mt as usize][order as usize] += 1;
    }

    /// Take a free block off the list of its pageblock's type.
    fn list_del(&mut self, pfn: u32, order: u32) {
        let mt = self.pb_type(pfn);
        self.list_del_mt(pfn, order, mt)
    }

    fn list_del_mt(&mut self, pfn: u32, order: u32, mt: MigrateType) {
        let f = self.arena.frame(pfn);
        debug_assert!(f.flags() & flags::BUDDY != 0 && f.order() == order);
        let (prev, next) = (f.prev(), f.next());
        if prev != NIL {
            self.arena.frame(prev).set_next(next);
        } else {
            debug_assert_eq!(self.area.head[mt as usize][order as usize], pfn);
            self.area.head[mt as usize][order as usize] = next;
        }
        if next != NIL {
            self.arena.frame(next).set_prev(prev);
        }
        f.set_flags(0);
        f.set_prev(0);
        f.set_next(0);
        self.area.nr_free[mt as usize][order as usize] -= 1;
    }

    /// Take a block of exactly `order`, splitting a larger one if needed,
    /// preferring unmovable pageblocks. Returns its first frame.
    #[inline]
    pub(crate) fn alloc(&mut self, order: u32) -> Option<u32> {
        self.alloc_typed(order, MigrateType::Unmovable)
    }

    /// Take a block of exactly `order` for an allocation of type `mt`: the
    /// smallest fitting block on `mt`'s lists, else the largest block of
    /// the other type (stealing, see the module doc). Returns its first
    /// frame.
    pub(crate) fn alloc_typed(&mut self, order: u32, mt: MigrateType) -> Option<u32> {
        debug_assert!(order <= MAX_ORDER);
        let lists = &self.area.head[mt as usize];
        let pfn = match (order..=MAX_ORDER).find(|&o| lists[o as usize] != NIL) {
            Some(found) => {
                let pfn = self.area.head[mt as usize][found as usize];
                self.list_del_mt(pfn, found, mt);
                self.expand(pfn, order, found);
                pfn
            }
            None => self.steal(order, mt)?,
        };
        self.delta -= 1 << order;
        Some(pfn)
    }

    /// Hand back the upper halves of a block of `found` split down to
    /// `order`, largest first, each to its pageblock's list.
    #[inline]
    fn expand(&mut self, pfn: u32, order: u32, found: u32) {
        let mut o = found;
        while o > order {
            o -= 1;
            self.list_add(pfn + (1 << o), o);
        }
    }

    /// The fallback: the largest free block of the other type, converting
    /// the pageblock(s) the allocation lands in when at least half free.
    #[cold]
    fn steal(&mut self, order: u32, mt: MigrateType) -> Option<u32> {
        let from = mt.other();
        let found = (order..=MAX_ORDER)
            .rev()
            .find(|&o| self.area.head[from as usize][o as usize] != NIL)?;
        let pfn = self.area.head[from as usize][found as usize];
        self.list_del_mt(pfn, found, from);
        self.zone.steals.fetch_add(1, Relaxed);
        if found >= PAGEBLOCK_ORDER {
            // Whole pageblocks: the ones the allocation covers become ours;
            // the split-off halves keep their pageblocks' type.
            let covered = 1u32 << order.max(PAGEBLOCK_ORDER);
            for pb in (pfn..pfn + covered).step_by(PAGEBLOCK_NR_PAGES) {
                self.set_pb_type(pb, mt);
            }
        } else {
            let start = pfn & !(PAGEBLOCK_NR_PAGES as u32 - 1);
            let free = (1usize << found) + self.free_pages_in_pageblock(start);
            if free >= PAGEBLOCK_NR_PAGES / 2 {
                self.move_freepages_block(start, from, mt);
            }
        }
        self.expand(pfn, order, found);
        Some(pfn)
    }

    /// Free pages on the lists inside the pageblock starting at `start`
    /// (smaller than a pageblock each).
    fn free_pages_in_pageblock(&self, start: u32) -> usize {
        let end = (start as usize + PAGEBLOCK_NR_PAGES).min(self.arena.nr_pages()) as u32;
        let mut pfn = start;
        let mut n = 0;
        while pfn < end {
            let f = self.arena.frame(pfn);
            if f.flags() & flags::BUDDY != 0 {
                n += 1usize << f.order();
                pfn += 1 << f.order();
            } else {
                pfn += 1;
            }
        }
        n
    }

    /// Change the type of the pageblock starting at `start` from `from` to
    /// `to`, moving its free blocks to `to`'s lists.
    fn move_freepages_block(&mut self, start: u32, from: MigrateType, to: MigrateType) {
        let end = (start as usize + PAGEBLOCK_NR_PAGES).min(self.arena.nr_pages()) as u32;
        let mut pfn = start;
        while pfn < end {
            let f = self.arena.frame(pfn);
            if f.flags() & flags::BUDDY != 0 {
                let o = f.order();
                self.list_del_mt(pfn, o, from);
                self.list_add_mt(pfn, o, to);
                pfn += 1 << o;
            } else {
                pfn += 1;
            }
        }
        self.set_pb_type(start, to);
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

    /// Take every free block of order below `below_order` that starts in
    /// `start..end` off the free lists and append its frames to `out` as
    /// order-0 pages (compaction's free scanner). Returns frames scanned.
    pub(crate) fn isolate_free_range(
        &mut self,
        start: u32,
        end: u32,
        below_order: u32,
        out: &mut Vec<Page>,
    ) -> usize {
        let end = end.min(self.arena.nr_pages() as u32);
        let mut pfn = start;
        let mut scanned = 0;
        while pfn < end {
            scanned += 1;
            let f = self.arena.frame(pfn);
            if f.flags() & flags::BUDDY == 0 {
                pfn += 1;
                continue;
            }
            let o = f.order();
            if o < below_order {
                self.list_del(pfn, o);
                self.delta -= 1 << o;
                out.extend((pfn..pfn + (1 << o)).map(Page::from_pfn));
            }
            pfn += 1 << o;
        }
        scanned
    }

    /// Free blocks per order, both types together.
    #[cfg(test)]
    pub(crate) fn nr_free(&self) -> [usize; NR_ORDERS] {
        std::array::from_fn(|o| self.area.nr_free.iter().map(|t| t[o]).sum())
    }

    /// Walk every free list: each block is a free head of its list's
    /// order, on the list of its pageblocks' type, and the counts add up.
    /// Allocation checks run it at drain points; it costs a walk of every
    /// free block.
    pub(crate) fn check_lists(&self) {
        for (t, lists) in self.area.head.iter().enumerate() {
            for (o, &first) in lists.iter().enumerate() {
                let (mut pfn, mut n, mut prev) = (first, 0, NIL);
                while pfn != NIL {
                    let f = self.arena.frame(pfn);
                    assert_ne!(f.flags() & flags::BUDDY, 0, "pfn {pfn} listed but not free");
                    assert_eq!(f.order() as usize, o, "pfn {pfn} on the wrong order");
                    assert_eq!(f.prev(), prev, "pfn {pfn}: broken back link");
                    for pb in (pfn..pfn + (1 << o)).step_by(PAGEBLOCK_NR_PAGES) {
                        assert_eq!(self.pb_type(pb) as usize, t, "pfn {pfn} on the wrong type");
                    }
                    n += 1;
                    prev = pfn;
                    pfn = f.next();
                }
                assert_eq!(n, self.area.nr_free[t][o], "count of type {t} order {o}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buddy::arena::HugePages;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn arena(mib: u64) -> Arena {
        Arena::new(mib << 20, HugePages::Never, false).unwrap()
    }

    #[test]
    fn a_new_zone_is_all_largest_blocks() {
        let a = arena(8);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        assert_eq!(z.nr_free_pages(), 2048);
        let by_order = z.free_blocks_by_order();
        assert_eq!(by_order[MAX_ORDER as usize], 2);
        assert_eq!(by_order.iter().sum::<usize>(), 2);
    }

    #[test]
    fn split_then_free_merges_back() {
        let a = arena(4);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
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

    #[test]
    fn movable_and_unmovable_allocations_use_separate_pageblocks() {
        let a = arena(8);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        assert_eq!(
            z.pageblocks_by_type(),
            (0, 4),
            "every pageblock starts movable"
        );
        let mut l = z.lock(&a);
        // An unmovable page steals a largest block and converts its pageblock.
        let u = l.alloc(0).unwrap();
        assert_eq!(z.pageblock_type(u), MigrateType::Unmovable);
        let m = l.alloc_typed(0, MigrateType::Movable).unwrap();
        assert_eq!(z.pageblock_type(m), MigrateType::Movable);
        assert_ne!(u >> PAGEBLOCK_ORDER, m >> PAGEBLOCK_ORDER);
        // More of each stay in their own pageblocks while there is room.
        let us: Vec<u32> = (0..300).map(|_| l.alloc(0).unwrap()).collect();
        let ms: Vec<u32> = (0..300)
            .map(|_| l.alloc_typed(0, MigrateType::Movable).unwrap())
            .collect();
        assert!(us
            .iter()
            .all(|&p| z.pageblock_type(p) == MigrateType::Unmovable));
        assert!(ms
            .iter()
            .all(|&p| z.pageblock_type(p) == MigrateType::Movable));
        assert_eq!(z.pageblocks_by_type(), (1, 3));
        assert_eq!(z.fallback_stats(), (1, 1));
        l.check_lists();
        for p in us.into_iter().chain(ms).chain([u, m]) {
            l.free(p, 0);
        }
        l.check_lists();
        assert_eq!(l.nr_free()[MAX_ORDER as usize], 2, "merging ignores types");
    }

    #[test]
    fn a_small_steal_converts_only_a_mostly_free_pageblock() {
        let a = arena(4);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        let mut l = z.lock(&a);
        // Fill the lower pageblock with movable pages and the upper one with
        // unmovable pages (stolen, converted), then free 8 movable pages:
        // an unmovable allocation takes one without converting the block.
        let low: Vec<u32> = (0..512)
            .map(|_| l.alloc_typed(0, MigrateType::Movable).unwrap())
            .collect();
        assert!(low.iter().all(|&p| p < 512));
        let rest: Vec<u32> = std::iter::from_fn(|| l.alloc(0)).collect();
        assert_eq!(rest.len(), 512);
        assert_eq!(z.pageblock_type(512), MigrateType::Unmovable);
        let (steals_before, conv_before) = z.fallback_stats();
        for &p in &low[..8] {
            l.free(p, 0);
        }
        let u = l.alloc(0).unwrap();
        assert!(u < 512);
        assert_eq!(
            z.pageblock_type(u),
            MigrateType::Movable,
            "8 free of 512: no conversion"
        );
        assert_eq!(z.fallback_stats(), (steals_before + 1, conv_before));
        l.check_lists();
        l.free(u, 0);
        for p in low.into_iter().skip(8).chain(rest) {
            l.free(p, 0);
        }
        l.check_lists();
        assert_eq!(l.nr_free()[MAX_ORDER as usize], 1);
    }

    #[test]
    fn isolate_free_range_takes_only_small_free_blocks() {
        let a = arena(4);
        let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
        let mut l = z.lock(&a);
        let p = l.alloc_typed(0, MigrateType::Movable).unwrap();
        assert_eq!(p, 0);
        // Free now: 1@1, 2@2, 4@4, ..., 256@256, and 512@512.
        let mut out = Vec::new();
        l.isolate_free_range(0, 512, 3, &mut out);
        let got: Vec<u32> = out.iter().map(|p| p.pfn()).collect();
        assert_eq!(got, (1..8).collect::<Vec<u32>>(), "orders 0, 1 and 2");
        drop(l);
        assert_eq!(z.nr_free_pages(), 1024 - 8);
        let mut l = z.lock(&a);
        l.check_lists();
        for q in out {
            l.free(q.pfn(), 0);
        }
        l.free(p, 0);
        assert_eq!(l.nr_free()[MAX_ORDER as usize], 1);
    }

    proptest! {
        /// No frame is handed out twice, the free count always adds up, every
        /// free block is on its pageblock type's list, and freeing everything
        /// restores the largest blocks, whatever mix of types was allocated.
        #[test]
        fn buddy_invariants(ops in proptest::collection::vec((0u32..=MAX_ORDER, any::<bool>(), any::<prop::sample::Index>(), any::<bool>()), 1..300)) {
            let a = arena(8);
            let z = Zone::new(&a, Watermarks::for_zone(a.nr_pages()), 0, 1);
            let total = a.nr_pages();
            let mut held: Vec<(u32, u32)> = Vec::new();
            let mut used: BTreeSet<u32> = BTreeSet::new();
            for (order, alloc, idx, movable) in ops {
                if alloc || held.is_empty() {
                    let mt = if movable { MigrateType::Movable } else { MigrateType::Unmovable };
                    let got = z.lock(&a).alloc_typed(order, mt);
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
                z.lock(&a).check_lists();
            }
            for (pfn, order) in held.drain(..) {
                z.lock(&a).free(pfn, order);
            }
            prop_assert_eq!(z.nr_free_pages(), total);
            prop_assert_eq!(z.free_blocks_by_order()[MAX_ORDER as usize], total >> MAX_ORDER);
        }
    }
}
