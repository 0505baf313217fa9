//! Compaction: making high-order blocks by moving in-use movable pages.
//!
//! It sees the allocator only through [`CompactTarget`] (isolate free
//! frames, migrate a page, put frames back, free moved-from frames), which
//! the allocator implements; this module sits below `page_alloc` and does
//! not name it.
//!
//! Owns: the registry of [`MovableOwner`]s (who owns each movable frame,
//! and the isolate / migrate / put-back callbacks), and compaction itself —
//! the kernel's two scanners: a migrate scanner walking the arena from the
//! low end, emptying order-aligned chunks of their movable pages, and a
//! free scanner walking pageblocks from the high end, taking free frames
//! out of the buddy lists to move those pages into. They meet in the
//! middle. Must never: move a pinned frame, move a frame whose owner did
//! not isolate it, or hold an allocator lock while calling an owner.
//!
//! ## Movable pages and their owners
//!
//! A page is movable when its owner registered a [`MovableOwner`] with
//! [`MovableRegistry::register`] and marked the page with
//! [`MovableRegistry::set_owner`] (one byte per frame in a side array; the
//! frame's owner word stays the user's). The owner is the source of truth:
//! compaction reads the side array without locks, so a stale mark (a page
//! freed and reused) only leads to an `isolate` that the owner refuses.
//! Compound pages and pinned frames (`pins > 0`) are never moved.
//!
//! Moving one page: `isolate(old)` (the owner stops writing and freeing
//! it), take a free frame `new` from the free scanner, copy the 4 KiB, mark
//! `new` with the same owner, `migrate(old, new)` (the owner switches its
//! index to `new`), free `old` to the zone. A refused migration puts `old`
//! back (`putback`) and returns `new` to the free scanner's stock.
//!
//! ## Why compaction can succeed: grouping by mobility
//!
//! The zone groups pageblocks by [`MigrateType`] (see `buddy/zone.rs`):
//! `Gfp::MOVABLE` allocations come from movable pageblocks, everything
//! else from unmovable ones, so a pageblock of cache pages holds no
//! unmovable page that would pin it down. The per-CPU lists and thread
//! caches stay type-agnostic (their fast paths are unchanged and refill
//! from unmovable pageblocks): `MOVABLE` allocations of any order bypass
//! them and take the zone lock (a page cache insert copies 4 KiB and
//! updates a map anyway), and owners free movable pages straight to the
//! zone as well, with `PageAllocator::free_movable_pages`. The consequences:
//! bulk allocations ignore `MOVABLE`, and a movable page freed with the
//! plain `free_pages` goes through the caches and may be handed to an
//! unmovable allocation — correct, but it mixes types. In the E5 benchmark's arena (unmovable allocations scattered over
//! many pageblocks, the rest cache pages), compaction succeeds in every
//! order-aligned chunk holding only free and cache pages, and skips a chunk
//! at its first unmovable or pinned frame without moving anything (the
//! kernel's `skip_on_failure`), so failing compaction costs scanning, not
//! copies.
//!
//! The free scanner takes frames only from movable pageblocks, so moved
//! pages stay grouped. Compactions may run concurrently (each isolates
//! through the owners and takes free frames under the zone lock).

use crate::buddy::arena::Arena;
use crate::buddy::frame::{flags, Page, MAX_ORDER};
use crate::buddy::zone::{MigrateType, PAGEBLOCK_NR_PAGES};
use crate::error::{Error, Result};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU8, Ordering::Acquire, Ordering::Relaxed};
use std::sync::Arc;

/// What a compaction attempt achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompactResult {
    /// Compaction did not run: order 0 or above the largest order, too few
    /// free pages to hold such a block above the min watermark (reclaim
    /// must come first), or no owner of movable pages is registered.
    Skipped,
    /// A free block of the asked order exists now.
    Success,
    /// The scanners met without making a free block of the asked order
    /// (unmovable or pinned frames in every chunk, owners refusing, or no
    /// free frames to move pages into).
    Failed,
}

/// An owner of movable pages: the callbacks compaction uses to move them.
///
/// **Context:** every method is called with no allocator lock held, from
/// the thread running compaction (an allocating thread or a caller of
/// [`crate::PageAllocator::compact`]); implementations may take their own locks
/// but must not allocate with an order above 0 and `DIRECT_RECLAIM`.
pub trait MovableOwner: Send + Sync {
    /// A name for logs.
    fn name(&self) -> &str;
    /// Take `page` off the owner's lists so that nobody writes or frees it
    /// until [`MovableOwner::migrate`] or [`MovableOwner::putback`];
    /// readers may go on. Returns false if the page is busy, or is not
    /// (or no longer) one of the owner's pages.
    fn isolate(&self, page: Page) -> bool;
    /// `old`'s contents are copied to `new` already, and `new` is marked
    /// with this owner: switch every reference from `old` to `new`.
    /// Returns true if the owner now uses `new` (compaction frees `old`),
    /// false to keep `old` (compaction frees `new` and calls
    /// [`MovableOwner::putback`] on `old`).
    fn migrate(&self, old: Page, new: Page) -> bool;
    /// The isolation of `page` is undone: it is the owner's again, to use
    /// or free.
    fn putback(&self, page: Page);
}

/// A registered owner's handle: the mark it puts on its frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MovableOwnerId(u8);

/// Most owners one allocator can have registered at a time.
pub const MAX_MOVABLE_OWNERS: usize = 255;

/// The owners of movable pages, and which owner each frame belongs to.
pub struct MovableRegistry {
    owners: RwLock<Vec<Option<Arc<dyn MovableOwner>>>>,
    /// Per frame: 0, or the owner's id.
    owner_of: Box<[AtomicU8]>,
}

impl MovableRegistry {
    pub(crate) fn new(nr_pages: usize) -> MovableRegistry {
        MovableRegistry {
            owners: RwLock::new(Vec::new()),
            owner_of: (0..nr_pages).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    /// Register an owner; its pages become movable once marked with
    /// [`MovableRegistry::set_owner`].
    ///
    /// **Returns:** [`Error::BadSetting`] when [`MAX_MOVABLE_OWNERS`] are
    /// registered already.
    pub fn register(&self, owner: Arc<dyn MovableOwner>) -> Result<MovableOwnerId> {
        let mut l = self.owners.write();
        let slot = match l.iter().position(Option::is_none) {
            Some(i) => i,
            None if l.len() < MAX_MOVABLE_OWNERS => {
                l.push(None);
                l.len() - 1
            }
            None => {
                return Err(Error::setting(
                    "movable owners",
                    l.len() + 1,
                    format!("at most {MAX_MOVABLE_OWNERS} owners per allocator"),
                ))
            }
        };
        l[slot] = Some(owner);
        Ok(MovableOwnerId(slot as u8 + 1))
    }

    /// Remove an owner: compaction stops calling it (a compaction already
    /// running may still finish a call). Its frames should be unmarked
    /// first. Returns whether it was registered.
    pub fn unregister(&self, id: MovableOwnerId) -> bool {
        let mut l = self.owners.write();
        match l.get_mut(id.0 as usize - 1) {
            Some(slot @ Some(_)) => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    /// Owners registered.
    pub fn len(&self) -> usize {
        self.owners.read().iter().flatten().count()
    }

    /// Whether no owner is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Mark the allocated order-0 `page` as `id`'s movable page.
    ///
    /// **Context:** never blocks; the caller owns the page.
    #[inline]
    pub fn set_owner(&self, page: Page, id: MovableOwnerId) {
        self.owner_of[page.pfn() as usize].store(id.0, Relaxed);
    }

    /// Unmark `page` (before freeing it): it is no longer movable.
    #[inline]
    pub fn clear_owner(&self, page: Page) {
        self.owner_of[page.pfn() as usize].store(0, Relaxed);
    }

    /// The owner `page` is marked with, if any.
    #[inline]
    pub fn owner_of(&self, page: Page) -> Option<MovableOwnerId> {
        match self.owner_of[page.pfn() as usize].load(Relaxed) {
            0 => None,
            id => Some(MovableOwnerId(id)),
        }
    }

    fn get(&self, id: u8) -> Option<Arc<dyn MovableOwner>> {
        self.owners.read().get(id as usize - 1)?.clone()
    }
}

/// What compaction needs of the allocator: reads of the buddy layer, and
/// the moves that change who holds a frame — take free frames out of the
/// buddy lists (isolate), copy a page into one and hand it over (migrate),
/// and give frames back (put back, free the moved-from frames). The
/// allocator implements it; compaction never sees its caches, counters or
/// locks.
pub(crate) trait CompactTarget {
    /// Frame metadata (read only here), addresses and the arena's size.
    fn arena(&self) -> &Arena;
    /// The owners of movable pages.
    fn movable(&self) -> &MovableRegistry;
    /// Give pages parked on per-CPU lists and in caches back to the zone,
    /// so that they count and merge.
    fn drain_to_zone(&self);
    /// Whether the zone has a free block of `order` or larger.
    fn has_free_block(&self, order: u32) -> bool;
    /// Whether `nr_pages` more pages fit in the zone's free pages with the
    /// zone still above its min watermark.
    fn room_above_min(&self, nr_pages: usize) -> bool;
    /// The migratetype of the pageblock holding `pfn`.
    fn pageblock_type(&self, pfn: u32) -> MigrateType;
    /// Take the free order-0 frames of `[start, end)` out of the buddy
    /// lists into `out` (skipping blocks of `order` or larger), under one
    /// zone-lock hold. Returns how many were scanned.
    fn isolate_free(&self, start: u32, end: u32, order: u32, out: &mut Vec<Page>) -> usize;
    /// Whether fault injection fails this target allocation.
    fn inject_failure(&self) -> bool;
    /// Copy isolated `old` into isolated free frame `new` and make `new`
    /// an allocated page.
    fn migrate_page(&self, old: Page, new: Page);
    /// Undo [`CompactTarget::migrate_page`]'s allocation of `new` (the
    /// owner refused it); `new` is a free target again.
    fn unmigrate(&self, new: Page);
    /// Return unused free targets to the buddy lists.
    fn put_back_free(&self, pages: &mut Vec<Page>);
    /// Free the allocated frames pages were moved out of.
    fn free_moved(&self, pages: &[Page]);
}

/// One compaction attempt's result and work, for the allocator's counters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompactRun {
    pub(crate) result: CompactResult,
    pub(crate) migrate_scanned: u64,
    pub(crate) free_scanned: u64,
    pub(crate) isolated: u64,
    pub(crate) migrated: u64,
    pub(crate) failed: u64,
}

/// Try to make a free block of `order`.
///
/// **Context:** may block (owners' callbacks); called without allocator
/// locks held. **Returns:** the result and the work done.
pub(crate) fn try_to_compact(target: &dyn CompactTarget, order: u32) -> CompactRun {
    let mut cc = Compaction {
        target,
        order,
        chunk: 1 << order.min(MAX_ORDER),
        targets: Vec::new(),
        free_pfn: 0,
        migrate_end: 0,
        migrate_scanned: 0,
        free_scanned: 0,
        isolated: 0,
        migrated: 0,
        failed: 0,
    };
    let result = cc.run();
    cc.release_targets();
    CompactRun {
        result,
        migrate_scanned: cc.migrate_scanned,
        free_scanned: cc.free_scanned,
        isolated: cc.isolated,
        migrated: cc.migrated,
        failed: cc.failed,
    }
}

/// One compaction run's state (the kernel's `compact_control`).
struct Compaction<'a> {
    target: &'a dyn CompactTarget,
    order: u32,
    /// Frames in the blocks the migrate scanner empties: 2^order.
    chunk: u32,
    /// Free frames taken by the free scanner, not used yet.
    targets: Vec<Page>,
    /// The free scanner's position: the first frame of the lowest
    /// pageblock it has scanned (it moves down).
    free_pfn: u32,
    /// The end of the migrate scanner's current chunk (it moves up).
    migrate_end: u32,
    migrate_scanned: u64,
    free_scanned: u64,
    isolated: u64,
    migrated: u64,
    failed: u64,
}

/// What became of one chunk.
enum Chunk {
    /// Emptied, or given up on; go on to the next.
    Next,
    /// The free scanner met the migrate scanner: stop.
    OutOfTargets,
}

impl Compaction<'_> {
    fn run(&mut self) -> CompactResult {
        let t = self.target;
        if self.order == 0 || self.order > MAX_ORDER || t.movable().is_empty() {
            return CompactResult::Skipped;
        }
        // Free pages on per-CPU lists and in the depot are invisible to
        // the zone and cannot merge: give them back first.
        t.drain_to_zone();
        if t.has_free_block(self.order) {
            return CompactResult::Success;
        }
        // The kernel's `compaction_suitable`: the block must fit in the free
        // pages with the zone still above its min watermark, or the
        // allocation fails anyway and reclaim has to come first.
        if !t.room_above_min(self.chunk as usize) {
            return CompactResult::Skipped;
        }
        let nr_pages = t.arena().nr_pages() as u32;
        self.free_pfn = nr_pages;
        let mut start = 0u32;
        while start + self.chunk <= self.free_pfn {
            self.migrate_end = start + self.chunk;
            let cands = match self.scan_chunk(start) {
                Some(c) if !c.is_empty() => c,
                _ => {
                    start += self.chunk;
                    continue;
                }
            };
            let outcome = self.migrate_chunk(&cands);
            if t.has_free_block(self.order) {
                return CompactResult::Success;
            }
            if let Chunk::OutOfTargets = outcome {
                break;
            }
            start += self.chunk;
        }
        if t.has_free_block(self.order) {
            CompactResult::Success
        } else {
            CompactResult::Failed
        }
    }

    /// The migrate scanner's look at the chunk at `start` (no locks; the
    /// owners decide later): its movable frames, or `None` at the first
    /// frame that can never move (unmovable, compound, pinned, or free but
    /// outside the buddy).
    fn scan_chunk(&mut self, start: u32) -> Option<Vec<Page>> {
        let t = self.target;
        let end = start + self.chunk;
        let mut cands = Vec::new();
        let mut pfn = start;
        while pfn < end {
            self.migrate_scanned += 1;
            let f = t.arena().frame(pfn);
            let fl = f.flags();
            if fl & flags::BUDDY != 0 {
                pfn += 1 << f.order().min(MAX_ORDER);
                continue;
            }
            let page = Page::from_pfn(pfn);
            if fl & (flags::HEAD | flags::TAIL) != 0
                || f.pins.load(Acquire) != 0
                || t.movable().owner_of(page).is_none()
            {
                return None;
            }
            cands.push(page);
            pfn += 1;
        }
        Some(cands)
    }

    /// Isolate every candidate of a chunk, then move them one by one. Any
    /// refusal gives up on the chunk (it could not become free).
    fn migrate_chunk(&mut self, cands: &[Page]) -> Chunk {
        let t = self.target;
        let mut isolated: Vec<(Page, u8, Arc<dyn MovableOwner>)> = Vec::with_capacity(cands.len());
        for &page in cands {
            let ok = t.movable().owner_of(page).and_then(|id| {
                let owner = t.movable().get(id.0)?;
                if t.arena().frame(page.pfn()).pins.load(Acquire) != 0 || !owner.isolate(page) {
                    return None;
                }
                Some((page, id.0, owner))
            });
            match ok {
                Some(entry) => isolated.push(entry),
                None => {
                    putback(isolated);
                    return Chunk::Next;
                }
            }
        }
        self.isolated += isolated.len() as u64;
        let mut freed = Vec::with_capacity(isolated.len());
        let mut outcome = Chunk::Next;
        let mut rest = isolated.into_iter();
        while let Some((old, id, owner)) = rest.next() {
            // Fault injection stands for the target allocation failing:
            // this chunk is given up, the run goes on.
            if t.inject_failure() {
                self.failed += 1;
                owner.putback(old);
                putback(rest.collect());
                break;
            }
            let Some(new) = self.next_target() else {
                outcome = Chunk::OutOfTargets;
                self.failed += 1;
                owner.putback(old);
                putback(rest.collect());
                break;
            };
            if t.arena().frame(old.pfn()).pins.load(Acquire) != 0 {
                self.targets.push(new);
                self.failed += 1;
                owner.putback(old);
                putback(rest.collect());
                break;
            }
            t.migrate_page(old, new);
            t.movable().set_owner(new, MovableOwnerId(id));
            if owner.migrate(old, new) {
                t.movable().clear_owner(old);
                freed.push(old);
                self.migrated += 1;
            } else {
                t.movable().clear_owner(new);
                t.unmigrate(new);
                self.targets.push(new);
                self.failed += 1;
                owner.putback(old);
                putback(rest.collect());
                break;
            }
        }
        self.free_old(&freed);
        outcome
    }

    /// Free the frames pages were moved out of.
    fn free_old(&mut self, pages: &[Page]) {
        if pages.is_empty() {
            return;
        }
        let t = self.target;
        let mut ok = Vec::with_capacity(pages.len());
        for &p in pages {
            // A pin taken behind the owner's back while the page moved:
            // the frame cannot be freed; leave it allocated (leaked) rather
            // than free memory that I/O still uses.
            if t.arena().frame(p.pfn()).pins.load(Acquire) != 0 {
                log::warn!(
                    "compaction: pfn {} was pinned while it moved; left allocated",
                    p.pfn()
                );
                continue;
            }
            ok.push(p);
        }
        t.free_moved(&ok);
    }

    /// A free frame to move a page into, scanning further pageblocks down
    /// from the top when the stock is empty; `None` when the free scanner
    /// reaches the migrate scanner.
    fn next_target(&mut self) -> Option<Page> {
        let t = self.target;
        let pb = PAGEBLOCK_NR_PAGES as u32;
        loop {
            if let Some(p) = self.targets.pop() {
                return Some(p);
            }
            if self.free_pfn < self.migrate_end + pb {
                return None;
            }
            self.free_pfn -= pb;
            if t.pageblock_type(self.free_pfn) != MigrateType::Movable {
                continue;
            }
            let n = t.isolate_free(
                self.free_pfn,
                self.free_pfn + pb,
                self.order,
                &mut self.targets,
            );
            self.free_scanned += n as u64;
            // Use the lowest frames last: the stock is a stack.
            self.targets.reverse();
        }
    }

    /// Give the unused free frames back to the zone.
    fn release_targets(&mut self) {
        if self.targets.is_empty() {
            return;
        }
        self.target.put_back_free(&mut self.targets);
    }
}

/// Undo isolations.
fn putback(isolated: Vec<(Page, u8, Arc<dyn MovableOwner>)>) {
    for (page, _, owner) in isolated {
        owner.putback(page);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Gfp, HugePages, PageAllocator};
    use parking_lot::Mutex;
    use std::collections::HashMap;

    /// An owner that keeps its pages in a map from pfn to a tag.
    struct Owner {
        pages: Mutex<HashMap<u32, (u64, bool)>>,
        refuse_migrate: bool,
    }

    impl MovableOwner for Owner {
        fn name(&self) -> &str {
            "test"
        }
        fn isolate(&self, page: Page) -> bool {
            match self.pages.lock().get_mut(&page.pfn()) {
                Some((_, iso @ false)) => {
                    *iso = true;
                    true
                }
                _ => false,
            }
        }
        fn migrate(&self, old: Page, new: Page) -> bool {
            if self.refuse_migrate {
                return false;
            }
            let mut m = self.pages.lock();
            let (tag, _) = m.remove(&old.pfn()).unwrap();
            m.insert(new.pfn(), (tag, false));
            true
        }
        fn putback(&self, page: Page) {
            self.pages.lock().get_mut(&page.pfn()).unwrap().1 = false;
        }
    }

    fn alloc() -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(8 << 20)
            .huge_pages(HugePages::Never)
            .background_reclaim(false)
            .checks(true)
            .build()
            .unwrap()
    }

    /// Fill with owned movable pages, free every even frame; return them.
    fn fragment(a: &PageAllocator, owner: &Arc<Owner>, id: MovableOwnerId) -> Vec<Page> {
        let mut all = Vec::new();
        while let Some(p) = a.alloc_pages(Gfp::NOWAIT | Gfp::MOVABLE | Gfp::MEMALLOC, 0) {
            all.push(p);
        }
        let mut kept = Vec::new();
        for p in all {
            if p.pfn() % 2 == 0 {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_movable_pages(&[p]) };
            } else {
                // SAFETY: the page is ours.
                unsafe { a.page_address(p).cast::<u64>().write(p.pfn() as u64) };
                owner.pages.lock().insert(p.pfn(), (p.pfn() as u64, false));
                a.movable_owners().set_owner(p, id);
                kept.push(p);
            }
        }
        kept
    }

    fn release(a: &PageAllocator, owner: &Owner) {
        let pages: Vec<Page> = owner
            .pages
            .lock()
            .drain()
            .map(|(pfn, _)| Page::from_pfn(pfn))
            .collect();
        for &p in &pages {
            a.movable_owners().clear_owner(p);
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { a.free_movable_pages(&pages) };
    }

    #[test]
    fn compaction_moves_pages_and_owners_follow() {
        let a = alloc();
        let owner = Arc::new(Owner {
            pages: Mutex::new(HashMap::new()),
            refuse_migrate: false,
        });
        let id = a.movable_owners().register(owner.clone()).unwrap();
        fragment(&a, &owner, id);
        assert_eq!(a.stats().free_blocks_by_order[1..], [0; 10]);
        assert_eq!(a.compact(5), CompactResult::Success);
        assert!(a.stats().free_blocks_by_order[5..].iter().any(|&n| n > 0));
        let s = a.stats();
        assert_eq!(s.compact_migrated, 16, "half of a 32-frame chunk moves");
        for (&pfn, &(tag, iso)) in owner.pages.lock().iter() {
            assert!(!iso);
            // SAFETY: the page is the owner's and allocated.
            let v = unsafe { a.page_address(Page::from_pfn(pfn)).cast::<u64>().read() };
            assert_eq!(v, tag, "contents follow the page");
            assert_eq!(a.movable_owners().owner_of(Page::from_pfn(pfn)), Some(id));
        }
        release(&a, &owner);
        assert!(a.movable_owners().unregister(id));
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn refused_migrations_fail_cleanly() {
        let a = alloc();
        let owner = Arc::new(Owner {
            pages: Mutex::new(HashMap::new()),
            refuse_migrate: true,
        });
        let id = a.movable_owners().register(owner.clone()).unwrap();
        let kept = fragment(&a, &owner, id);
        let free_before = a.stats().free_pages;
        assert_eq!(a.compact(3), CompactResult::Failed);
        let s = a.stats();
        assert_eq!(s.compact_migrated, 0);
        assert!(s.compact_migrate_failed > 0);
        assert_eq!(s.free_pages, free_before, "targets went back");
        let mut now: Vec<u32> = owner.pages.lock().keys().copied().collect();
        now.sort_unstable();
        let mut kept: Vec<u32> = kept.iter().map(|p| p.pfn()).collect();
        kept.sort_unstable();
        assert_eq!(now, kept, "nothing moved");
        assert!(owner.pages.lock().values().all(|&(_, iso)| !iso));
        release(&a, &owner);
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn nothing_registered_or_order_zero_is_skipped() {
        let a = alloc();
        assert_eq!(a.compact(4), CompactResult::Skipped, "no owner");
        let owner = Arc::new(Owner {
            pages: Mutex::new(HashMap::new()),
            refuse_migrate: false,
        });
        let id = a.movable_owners().register(owner).unwrap();
        assert_eq!(a.compact(0), CompactResult::Skipped);
        assert_eq!(a.compact(11), CompactResult::Skipped);
        // Everything free: the block is there already.
        assert_eq!(a.compact(10), CompactResult::Success);
        // Too little free memory to hold the block: reclaim comes first.
        let p: Vec<Page> = (0..2048)
            .map_while(|_| a.alloc_pages(Gfp::NOWAIT | Gfp::MEMALLOC, 0))
            .collect();
        assert_eq!(a.compact(4), CompactResult::Skipped);
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { a.free_pages_bulk(&p) };
        assert_eq!(a.stats().compact_skipped, 4);
        assert!(a.movable_owners().unregister(id));
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn registry_reuses_ids_and_has_a_limit() {
        let r = MovableRegistry::new(16);
        let o: Arc<dyn MovableOwner> = Arc::new(Owner {
            pages: Mutex::new(HashMap::new()),
            refuse_migrate: false,
        });
        let ids: Vec<_> = (0..MAX_MOVABLE_OWNERS)
            .map(|_| r.register(o.clone()).unwrap())
            .collect();
        assert!(r.register(o.clone()).is_err());
        assert!(r.unregister(ids[7]));
        assert!(!r.unregister(ids[7]));
        assert_eq!(r.register(o.clone()).unwrap(), ids[7]);
        r.set_owner(Page::from_pfn(3), ids[2]);
        assert_eq!(r.owner_of(Page::from_pfn(3)), Some(ids[2]));
        r.clear_owner(Page::from_pfn(3));
        assert_eq!(r.owner_of(Page::from_pfn(3)), None);
    }
}
