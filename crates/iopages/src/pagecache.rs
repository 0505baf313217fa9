//! A page cache: 4 KiB pages of data by key, movable and reclaimable.
//!
//! Owns: the key → frame index of cached pages (a hash map, a reverse map
//! from frame to entry, and an LRU list), the copies in and out of those
//! frames, and the two hooks that make the cache give memory back: a
//! [`Shrinker`] that drops the least recently used pages, and a
//! [`MovableOwner`] that lets compaction move them. Must never: hold its
//! lock while allocating (the allocation may run this cache's own
//! shrinker), write or free a page that compaction has isolated, or free a
//! page while compaction may still isolate it.
//!
//! It is the generic keyed cache the crypt target will use for decrypted
//! sectors (key: device and page index). Every page is clean — the cache
//! holds copies of data that lives elsewhere — so reclaim simply drops
//! pages; dirty pages and write-back are out of scope.
//!
//! Pages are allocated with `Gfp::MOVABLE` (plus the configured flags,
//! `NOWAIT` by default: filling a cache should not reclaim), so they come
//! from movable pageblocks, and are freed straight to the zone (see
//! `reclaim/compaction.rs` for why). An entry whose page compaction has isolated
//! can still be read; overwriting or removing it detaches it (the new data
//! goes to a fresh page), and the isolated page is freed when compaction
//! gives it back.

use crate::{
    Error, Gfp, MovableOwner, MovableOwnerId, Page, PageAllocator, Result, Shrinker, ShrinkerId,
    PAGE_SIZE,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// Settings of a [`PageCache`].
#[derive(Clone, Debug)]
pub struct PageCacheConfig {
    /// Flags for page allocations (`Gfp::MOVABLE` is always added).
    pub gfp: Gfp,
    /// Register a shrinker so that reclaim can drop clean pages.
    pub shrinker: bool,
    /// Name for the shrinker and the owner registry.
    pub name: String,
}

impl Default for PageCacheConfig {
    fn default() -> Self {
        PageCacheConfig {
            gfp: Gfp::NOWAIT,
            shrinker: true,
            name: "pagecache".to_string(),
        }
    }
}

/// Counters of a [`PageCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCacheStats {
    /// Pages held now.
    pub pages: usize,
    /// Lookups that found their key.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Inserts that stored a page (new or overwritten).
    pub inserts: u64,
    /// Inserts that failed for want of memory.
    pub insert_failures: u64,
    /// Pages dropped by the shrinker.
    pub reclaimed: u64,
    /// Pages moved by compaction.
    pub migrated: u64,
}

const NONE: u32 = u32::MAX;

struct Slot {
    key: u64,
    page: Page,
    /// LRU neighbours: `prev` towards the most recently used end.
    prev: u32,
    next: u32,
    /// Compaction holds the page: no writes, no free.
    isolated: bool,
    /// Removed while isolated: out of the key map and the LRU, freed when
    /// compaction gives it back.
    dead: bool,
}

#[derive(Default)]
struct State {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    by_key: HashMap<u64, u32>,
    by_pfn: HashMap<u32, u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    nr_isolated: usize,
    /// The cache is being dropped: nothing more may be isolated.
    closed: bool,
    stats: PageCacheStats,
}

impl State {
    fn new() -> State {
        State {
            head: NONE,
            tail: NONE,
            ..State::default()
        }
    }

    fn lru_unlink(&mut self, i: u32) {
        let (prev, next) = (self.slots[i as usize].prev, self.slots[i as usize].next);
        if prev != NONE {
            self.slots[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.slots[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.slots[i as usize].prev = NONE;
        self.slots[i as usize].next = NONE;
    }

    fn lru_push_front(&mut self, i: u32) {
        let old = self.head;
        self.slots[i as usize].prev = NONE;
        self.slots[i as usize].next = old;
        if old != NONE {
            self.slots[old as usize].prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
    }

    fn touch(&mut self, i: u32) {
        if self.head != i {
            self.lru_unlink(i);
            self.lru_push_front(i);
        }
    }

    fn add(&mut self, key: u64, page: Page) -> u32 {
        let slot = Slot {
            key,
            page,
            prev: NONE,
            next: NONE,
            isolated: false,
            dead: false,
        };
        let i = match self.free_slots.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_key.insert(key, i);
        self.by_pfn.insert(page.pfn(), i);
        self.lru_push_front(i);
        i
    }

    /// Take entry `i` out of the key map and the LRU. Returns its page if
    /// it can be freed now; an isolated one becomes dead instead.
    fn detach(&mut self, i: u32) -> Option<Page> {
        self.lru_unlink(i);
        let s = &mut self.slots[i as usize];
        self.by_key.remove(&s.key);
        if s.isolated {
            s.dead = true;
            return None;
        }
        let page = s.page;
        self.by_pfn.remove(&page.pfn());
        self.free_slots.push(i);
        Some(page)
    }
}

struct Shared {
    alloc: PageAllocator,
    gfp: Gfp,
    name: String,
    /// Set once registered (before any page exists).
    owner_id: Option<MovableOwnerId>,
    state: Mutex<State>,
}

impl Shared {
    /// Unmark and free pages taken out of the cache.
    fn release(&self, pages: &[Page]) {
        if pages.is_empty() {
            return;
        }
        for &p in pages {
            self.alloc.movable_owners().clear_owner(p);
        }
        // SAFETY: the pages were taken out of the cache's index (under its
        // lock) by the caller, so the cache, their only owner, gives them
        // up here, once.
        unsafe { self.alloc.free_movable_pages(pages) };
    }

    fn shrink(&self, nr: usize) -> usize {
        let mut pages = Vec::new();
        {
            let mut st = self.state.lock();
            let mut i = st.tail;
            while i != NONE && pages.len() < nr {
                let prev = st.slots[i as usize].prev;
                if !st.slots[i as usize].isolated {
                    if let Some(p) = st.detach(i) {
                        pages.push(p);
                    }
                }
                i = prev;
            }
            st.stats.reclaimed += pages.len() as u64;
        }
        self.release(&pages);
        pages.len()
    }
}

/// A thread-safe cache of 4 KiB pages by `u64` key, whose pages compaction
/// can move and reclaim can drop.
///
/// Dropping it frees every page (waiting for a compaction that holds some
/// of them to let go).
pub struct PageCache {
    shared: Arc<Shared>,
    shrinker: Option<ShrinkerId>,
}

impl PageCache {
    /// A cache on `alloc` with default settings (`NOWAIT` allocations, a
    /// shrinker).
    ///
    /// **Returns:** an error if the allocator has no room for another
    /// movable-page owner.
    pub fn new(alloc: &PageAllocator) -> Result<PageCache> {
        Self::with_config(alloc, PageCacheConfig::default())
    }

    /// A cache on `alloc` with `cfg`.
    ///
    /// **Returns:** as [`PageCache::new`].
    pub fn with_config(alloc: &PageAllocator, cfg: PageCacheConfig) -> Result<PageCache> {
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let owner = alloc
                .movable_owners()
                .register(Arc::new(Hook(weak.clone(), cfg.name.clone())));
            Shared {
                alloc: alloc.clone(),
                gfp: cfg.gfp | Gfp::MOVABLE,
                name: cfg.name.clone(),
                owner_id: owner.ok(),
                state: Mutex::new(State::new()),
            }
        });
        if shared.owner_id.is_none() {
            return Err(Error::setting(
                "movable owners",
                alloc.movable_owners().len(),
                "the allocator has no room for another owner of movable pages",
            ));
        }
        let shrinker = cfg.shrinker.then(|| {
            alloc
                .shrinkers()
                .register(Arc::new(Hook(Arc::downgrade(&shared), cfg.name.clone())))
        });
        Ok(PageCache { shared, shrinker })
    }

    /// Store a copy of `data` under `key`, replacing what was there.
    ///
    /// **Context:** may block only as the configured flags allow.
    /// **Returns:** [`Error::NoMemory`] if no page could be allocated.
    pub fn insert(&self, key: u64, data: &[u8; PAGE_SIZE]) -> Result<()> {
        let s = &*self.shared;
        {
            let mut st = s.state.lock();
            if self.overwrite(&mut st, key, data) {
                return Ok(());
            }
        }
        // Allocate without the lock: the allocation may run our shrinker.
        let Some(page) = s.alloc.alloc_pages(s.gfp, 0) else {
            s.state.lock().stats.insert_failures += 1;
            return Err(Error::NoMemory(format!(
                "{}: no page for key {key:#x}",
                s.name
            )));
        };
        // SAFETY: the page was just allocated to us and nobody else can
        // see it; the arena mapping holds it whole.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), s.alloc.page_address(page), PAGE_SIZE)
        };
        let spare = {
            let mut st = s.state.lock();
            if self.overwrite(&mut st, key, data) {
                // Another thread inserted the key meanwhile.
                Some(page)
            } else {
                if let Some(&i) = st.by_key.get(&key) {
                    // Its page is isolated (else `overwrite` took it):
                    // detached, it is freed when compaction lets go.
                    let freed = st.detach(i);
                    debug_assert!(freed.is_none());
                }
                st.add(key, page);
                st.stats.inserts += 1;
                if let Some(id) = s.owner_id {
                    s.alloc.movable_owners().set_owner(page, id);
                }
                None
            }
        };
        if let Some(p) = spare {
            // SAFETY: `spare` was allocated by this insert and never
            // entered the index: nothing else owns it.
            unsafe { s.alloc.free_movable_pages(&[p]) };
        }
        Ok(())
    }

    /// Write `data` into `key`'s page in place if it has one that is not
    /// isolated.
    fn overwrite(&self, st: &mut State, key: u64, data: &[u8; PAGE_SIZE]) -> bool {
        let Some(&i) = st.by_key.get(&key) else {
            return false;
        };
        if st.slots[i as usize].isolated {
            return false;
        }
        let page = st.slots[i as usize].page;
        // SAFETY: the page belongs to the cache and is not isolated, so
        // only this lock holder touches it; reads happen under the lock.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.shared.alloc.page_address(page),
                PAGE_SIZE,
            )
        };
        st.touch(i);
        st.stats.inserts += 1;
        true
    }

    /// Copy `key`'s page into `buf`. **Returns:** whether the key was
    /// cached.
    ///
    /// **Context:** never blocks (beyond the cache's lock).
    pub fn get(&self, key: u64, buf: &mut [u8; PAGE_SIZE]) -> bool {
        let mut st = self.shared.state.lock();
        let Some(&i) = st.by_key.get(&key) else {
            st.stats.misses += 1;
            return false;
        };
        let page = st.slots[i as usize].page;
        // SAFETY: the page belongs to the cache; writers hold the lock we
        // hold, and compaction only reads an isolated page.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.shared.alloc.page_address(page),
                buf.as_mut_ptr(),
                PAGE_SIZE,
            )
        };
        st.touch(i);
        st.stats.hits += 1;
        true
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: u64) -> bool {
        self.shared.state.lock().by_key.contains_key(&key)
    }

    /// Drop `key`'s page. **Returns:** whether it was cached.
    pub fn remove(&self, key: u64) -> bool {
        let s = &*self.shared;
        let freed = {
            let mut st = s.state.lock();
            let Some(&i) = st.by_key.get(&key) else {
                return false;
            };
            st.detach(i)
        };
        s.release(freed.as_slice());
        true
    }

    /// Drop every page.
    pub fn clear(&self) {
        let s = &*self.shared;
        let pages: Vec<Page> = {
            let mut st = s.state.lock();
            let keys: Vec<u32> = st.by_key.values().copied().collect();
            keys.into_iter().filter_map(|i| st.detach(i)).collect()
        };
        s.release(&pages);
    }

    /// Drop up to `nr` least recently used pages (what the shrinker does).
    /// **Returns:** pages dropped.
    pub fn shrink(&self, nr: usize) -> usize {
        self.shared.shrink(nr)
    }

    /// Pages cached.
    pub fn len(&self) -> usize {
        self.shared.state.lock().by_key.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame holding `key` right now (it changes when compaction moves
    /// it), for inspection and tests.
    pub fn page_of(&self, key: u64) -> Option<Page> {
        let st = self.shared.state.lock();
        st.by_key.get(&key).map(|&i| st.slots[i as usize].page)
    }

    /// Every cached key (in no particular order).
    pub fn keys(&self) -> Vec<u64> {
        self.shared.state.lock().by_key.keys().copied().collect()
    }

    /// Counters.
    pub fn stats(&self) -> PageCacheStats {
        let st = self.shared.state.lock();
        PageCacheStats {
            pages: st.by_key.len(),
            ..st.stats
        }
    }

    /// The cache's handle in the allocator's movable-owner registry.
    pub fn owner_id(&self) -> MovableOwnerId {
        self.shared.owner_id.expect("registered at creation")
    }
}

impl Drop for PageCache {
    fn drop(&mut self) {
        let s = &*self.shared;
        if let Some(id) = self.shrinker {
            s.alloc.shrinkers().unregister(id);
        }
        if let Some(id) = s.owner_id {
            s.alloc.movable_owners().unregister(id);
        }
        // A compaction that fetched our hook before the unregister may
        // still hold isolated pages: refuse new isolations, wait for those.
        loop {
            let mut st = s.state.lock();
            st.closed = true;
            if st.nr_isolated == 0 {
                break;
            }
            drop(st);
            std::thread::yield_now();
        }
        self.clear();
    }
}

/// The cache as its allocator sees it (shrinker, movable owner): a weak
/// reference, so that the allocator does not keep the cache alive.
struct Hook(Weak<Shared>, String);

impl Shrinker for Hook {
    fn name(&self) -> &str {
        &self.1
    }

    fn count_objects(&self) -> usize {
        self.0.upgrade().map_or(0, |s| s.state.lock().by_key.len())
    }

    fn scan_objects(&self, nr_to_scan: usize) -> usize {
        self.0.upgrade().map_or(0, |s| s.shrink(nr_to_scan))
    }
}

impl MovableOwner for Hook {
    fn name(&self) -> &str {
        &self.1
    }

    fn isolate(&self, page: Page) -> bool {
        let Some(s) = self.0.upgrade() else {
            return false;
        };
        let mut st = s.state.lock();
        if st.closed {
            return false;
        }
        let Some(&i) = st.by_pfn.get(&page.pfn()) else {
            return false;
        };
        let slot = &mut st.slots[i as usize];
        if slot.isolated || slot.dead {
            return false;
        }
        slot.isolated = true;
        st.nr_isolated += 1;
        true
    }

    fn migrate(&self, old: Page, new: Page) -> bool {
        let Some(s) = self.0.upgrade() else {
            return false;
        };
        let mut st = s.state.lock();
        let Some(&i) = st.by_pfn.get(&old.pfn()) else {
            return false;
        };
        let slot = &mut st.slots[i as usize];
        if !slot.isolated || slot.dead {
            // Removed meanwhile: keep the old page; put-back frees it.
            return false;
        }
        slot.page = new;
        slot.isolated = false;
        st.nr_isolated -= 1;
        st.by_pfn.remove(&old.pfn());
        st.by_pfn.insert(new.pfn(), i);
        st.stats.migrated += 1;
        true
    }

    fn putback(&self, page: Page) {
        let Some(s) = self.0.upgrade() else {
            return;
        };
        let free = {
            let mut st = s.state.lock();
            let Some(&i) = st.by_pfn.get(&page.pfn()) else {
                return;
            };
            let slot = &mut st.slots[i as usize];
            if !slot.isolated {
                return;
            }
            slot.isolated = false;
            let dead = slot.dead;
            st.nr_isolated -= 1;
            if dead {
                st.by_pfn.remove(&page.pfn());
                st.free_slots.push(i);
            }
            dead
        };
        if free {
            s.release(&[page]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CompactResult, HugePages};

    fn alloc() -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(8 << 20)
            .huge_pages(HugePages::Never)
            .background_reclaim(false)
            .checks(true)
            .build()
            .unwrap()
    }

    fn page_of(tag: u64) -> Box<[u8; PAGE_SIZE]> {
        let mut b = Box::new([0u8; PAGE_SIZE]);
        for (i, c) in b.chunks_mut(8).enumerate() {
            c.copy_from_slice(&(tag ^ i as u64).to_le_bytes());
        }
        b
    }

    #[test]
    fn insert_get_overwrite_remove() {
        let a = alloc();
        let c = PageCache::new(&a).unwrap();
        let mut buf = [0u8; PAGE_SIZE];
        assert!(!c.get(1, &mut buf));
        c.insert(1, &page_of(1)).unwrap();
        c.insert(2, &page_of(2)).unwrap();
        assert!(c.get(1, &mut buf));
        assert_eq!(&buf, &*page_of(1));
        let p = c.page_of(1).unwrap();
        c.insert(1, &page_of(11)).unwrap();
        assert_eq!(c.page_of(1), Some(p), "overwrite in place");
        assert!(c.get(1, &mut buf) && buf == *page_of(11));
        assert_eq!(a.movable_owners().owner_of(p), Some(c.owner_id()));
        assert_eq!(c.len(), 2);
        assert!(c.remove(1));
        assert!(!c.remove(1));
        assert_eq!(a.movable_owners().owner_of(p), None);
        let s = c.stats();
        assert_eq!((s.pages, s.hits, s.misses, s.inserts), (1, 2, 1, 3));
        drop(c);
        assert!(a.leak_check().is_ok());
        assert!(a.shrinkers().is_empty() && a.movable_owners().is_empty());
    }

    #[test]
    fn shrinker_drops_least_recently_used_first() {
        let a = alloc();
        let c = PageCache::new(&a).unwrap();
        for k in 0..10 {
            c.insert(k, &page_of(k)).unwrap();
        }
        let mut buf = [0u8; PAGE_SIZE];
        assert!(c.get(0, &mut buf)); // 0 is now the most recent
        assert_eq!(a.shrinkers().shrink(Gfp::KERNEL, 3), 3);
        for k in 1..4 {
            assert!(!c.contains(k), "{k} was among the oldest");
        }
        assert!(c.contains(0) && c.contains(4));
        assert_eq!(c.stats().reclaimed, 3);
        drop(c);
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn removal_while_isolated_frees_on_putback() {
        let a = alloc();
        let c = PageCache::new(&a).unwrap();
        c.insert(7, &page_of(7)).unwrap();
        let p = c.page_of(7).unwrap();
        let hook = Hook(Arc::downgrade(&c.shared), String::new());
        assert!(hook.isolate(p));
        assert!(!hook.isolate(p), "isolated once");
        // Overwrite goes to a fresh page; the isolated one dies.
        c.insert(7, &page_of(8)).unwrap();
        assert_ne!(c.page_of(7), Some(p));
        let spare = a.alloc_pages(Gfp::KERNEL, 0).unwrap();
        assert!(!hook.migrate(p, spare), "dead entries do not migrate");
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { a.free_pages(spare, 0) };
        hook.putback(p);
        let mut buf = [0u8; PAGE_SIZE];
        assert!(c.get(7, &mut buf) && buf == *page_of(8));
        drop(c);
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn compaction_moves_cache_pages() {
        let a = alloc();
        let c = PageCache::with_config(
            &a,
            PageCacheConfig {
                gfp: Gfp::NOWAIT | Gfp::MEMALLOC,
                shrinker: false,
                ..PageCacheConfig::default()
            },
        )
        .unwrap();
        let mut k = 0;
        while c.insert(k, &page_of(k)).is_ok() {
            k += 1;
        }
        for key in c.keys() {
            if c.page_of(key).unwrap().pfn() % 2 == 0 {
                c.remove(key);
            }
        }
        assert_eq!(a.stats().free_blocks_by_order[1..], [0; 10]);
        assert_eq!(a.compact(6), CompactResult::Success);
        assert_eq!(c.stats().migrated, 32);
        let mut buf = [0u8; PAGE_SIZE];
        for key in c.keys() {
            assert!(c.get(key, &mut buf));
            assert!(buf == *page_of(key), "key {key} intact");
        }
        drop(c);
        assert!(a.leak_check().is_ok());
    }
}
