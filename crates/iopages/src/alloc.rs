//! The page allocator: fast path, slow path and the bulk API.
//!
//! Owns: the order in which memory is looked for — the thread's cache, this
//! CPU's lists, the zone, then the slow path (wake background reclaim,
//! direct reclaim, compaction, drain the per-CPU lists, retry as the flags
//! say) — and the array, list and callback forms of bulk allocation.
//! Must never: block or take a lock on the fast path, or hold any allocator
//! lock while calling a shrinker or a caller's callback.
//!
//! The fast path, in full:
//! ```text
//! alloc_pages(gfp, order ≤ 3)  → pop from this thread's cache
//!     empty  → refill half a cache from this CPU's list (one try-lock)
//!              list empty → refill a batch from the zone (one zone lock)
//! free_pages(page, order ≤ 3)  → push on this thread's cache
//!     full   → give the older half to this CPU's list (one try-lock)
//!              list above high → a batch back to the zone (one zone lock)
//! ```

use crate::arena::Arena;
use crate::builder::PageAllocatorBuilder;
use crate::compaction::{try_to_compact, CompactResult, MovableRegistry};
use crate::error::Result;
use crate::fault::FaultInjector;
use crate::frame::{clear_slots, copy_pages, flags, FrameInfo, Page, MAX_ORDER, PAGE_SIZE};
use crate::gfp::Gfp;
use crate::pcp::{bump, PcpGuard, PcpLimits, PcpSet, PCP_MAX_ORDER, PCP_ORDERS};
use crate::reclaim::ShrinkerRegistry;
use crate::stats::{Accounting, Counters, Stats};
use crate::tcache::{Owner, Tcache, ThreadCaches, LAST};
use crate::zone::{AllocFlags, MigrateType, Watermarks, Zone};
use parking_lot::{Condvar, Mutex};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Rounds of reclaim without progress before a blocking allocation that is
/// not `NOFAIL` gives up (the kernel's `MAX_RECLAIM_RETRIES`).
pub const MAX_RECLAIM_RETRIES: u32 = 16;
/// How long a `NOFAIL` allocation sleeps between attempts when nothing was
/// freed, at most.
pub const NOFAIL_WAIT: Duration = Duration::from_millis(1);
/// Pages gathered per callback round of [`PageAllocator::alloc_pages_bulk_cb`].
const CB_CHUNK: usize = 64;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static CACHES: ThreadCaches<Core> = const { ThreadCaches::new() };
}

/// A page allocator over its own arena. Cheap to clone (the clones share
/// the allocator); `Send` and `Sync`.
#[derive(Clone)]
pub struct PageAllocator {
    core: Arc<Core>,
}

pub(crate) struct Core {
    id: u64,
    pub(crate) arena: Arena,
    pub(crate) zone: Zone,
    pub(crate) pcp: Box<[PcpSet]>,
    pub(crate) limits: PcpLimits,
    tcache_cap: [usize; PCP_ORDERS],
    /// Capacity of a [`crate::LocalAllocator`]'s cache.
    local_cap: [usize; PCP_ORDERS],
    tcache_on: bool,
    pub(crate) checks: bool,
    pub(crate) fault: FaultInjector,
    pub(crate) shrinkers: ShrinkerRegistry,
    /// Owners of movable pages and their migration callbacks.
    pub(crate) movable: MovableRegistry,
    pub(crate) tcaches: Mutex<Vec<Arc<Tcache>>>,
    pub(crate) counters: Counters,
    waiters: AtomicUsize,
    wait_lock: Mutex<()>,
    wait_cv: Condvar,
    /// Background reclaim, started on first wake-up.
    kswapd: Kswapd,
}

/// Watermark rules of the fast path: stay above low.
const FAST: AllocFlags = AllocFlags::WMARK_LOW;

impl PageAllocator {
    /// Settings with defaults; finish with [`PageAllocatorBuilder::build`].
    pub fn builder() -> PageAllocatorBuilder {
        PageAllocatorBuilder::default()
    }

    /// An allocator over an arena of `size_bytes` with every other setting
    /// at its default.
    pub fn new(size_bytes: u64) -> Result<PageAllocator> {
        Self::builder().size_bytes(size_bytes).build()
    }

    pub(crate) fn from_builder(b: PageAllocatorBuilder) -> Result<PageAllocator> {
        let arena = Arena::new(b.size_bytes, b.huge_pages, b.populate)?;
        let nr_pages = arena.nr_pages();
        let limits = b.resolved_pcp(nr_pages);
        let tcache_cap = b.resolved_tcache(&limits);
        let local_cap = b.resolved_local(&tcache_cap, nr_pages);
        let depot_pages = b.resolved_depot(nr_pages, &limits);
        // A magazine is what a full thread cache hands over (half of it),
        // or a per-CPU batch when thread caches are off.
        let magazine = if tcache_cap[0] >= 2 {
            tcache_cap[0] / 2
        } else {
            limits.batch[0]
        };
        let zone = Zone::new(
            &arena,
            b.resolved_watermarks(nr_pages),
            depot_pages,
            magazine,
        );
        let pcp = (0..b.resolved_cpus())
            .map(|_| PcpSet::new(&limits))
            .collect();
        Ok(PageAllocator {
            core: Arc::new_cyclic(|me| Core {
                id: NEXT_ID.fetch_add(1, Relaxed),
                arena,
                zone,
                pcp,
                limits,
                tcache_cap,
                local_cap,
                tcache_on: tcache_cap[0] > 0,
                checks: b.checks,
                fault: FaultInjector::default(),
                shrinkers: ShrinkerRegistry::default(),
                movable: MovableRegistry::new(nr_pages),
                tcaches: Mutex::new(Vec::new()),
                counters: Counters::default(),
                waiters: AtomicUsize::new(0),
                wait_lock: Mutex::new(()),
                wait_cv: Condvar::new(),
                kswapd: Kswapd {
                    started: AtomicBool::new(false),
                    shared: Arc::new(KswapdShared {
                        stop: AtomicBool::new(!b.background_reclaim),
                        ..KswapdShared::default()
                    }),
                    core: me.clone(),
                },
            }),
        })
    }

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

    /// Count one bulk call (`frees`: a bulk free) in this thread's cache's
    /// counters, or the shared ones when the thread has no cache.
    #[inline]
    fn count_bulk(&self, frees: bool) {
        match self.tcache() {
            Some(tc) => bump(
                if frees {
                    &tc.bulk_frees
                } else {
                    &tc.bulk_allocs
                },
                1,
            ),
            None => {
                let c = &self.core.counters;
                let c = if frees { &c.bulk_frees } else { &c.bulk_allocs };
                c.fetch_add(1, Relaxed);
            }
        }
    }

    /// Free a block from [`PageAllocator::alloc_pages`] with the same order.
    ///
    /// **Context:** never blocks. With checks on, freeing a block that is
    /// not allocated (a double free) panics with the frame named.
    #[inline]
    pub fn free_pages(&self, page: Page, order: u32) {
        self.core.free_cached(page, order, || self.tcache())
    }

    /// This thread's cache for this allocator: `None` when thread caches
    /// are off or the thread is exiting. One thread-local load and one
    /// compare in the common case. The reference must stay on this thread
    /// (every caller uses it and drops it within the call).
    #[inline(always)]
    fn tcache(&self) -> Option<&Tcache> {
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
    fn tcache_slow(&self) -> Option<&Tcache> {
        let tc: *const Tcache = CACHES
            .try_with(|c| c.get(&self.core) as *const Tcache)
            .ok()?;
        // SAFETY: as in `tcache`: the table keeps the cache alive until the
        // thread exits, and the reference does not leave this thread.
        Some(unsafe { &*tc })
    }

    /// Bulk allocation, array form: fill the empty (`None`) slots of `slots`
    /// with order-0 pages; slots already holding a page are kept.
    ///
    /// Takes this thread's cache and this CPU's list once for the batch.
    /// Falls back to allocating a single page through the full path when the
    /// zone is below its low watermark or only one slot is empty.
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** how many
    /// slots hold a page now, counting those filled before the call; may be
    /// fewer than `slots.len()`.
    #[inline]
    pub fn alloc_pages_bulk_array(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        let core = &*self.core;
        let nr = slots.len();
        if let [slot @ None] = slots {
            self.count_bulk(false);
            *slot = self.alloc_pages(gfp, 0);
            return slot.is_some() as usize;
        }
        if nr > 1 && !core.fault.is_enabled() && !core.checks && !gfp.contains(Gfp::ZERO) {
            // Fast path: every slot empty and the whole batch in this
            // thread's cache — one copy.
            if let Some(tc) = self.tcache() {
                if tc.len(0) >= nr && slots.iter().all(Option::is_none) {
                    bump(&tc.bulk_allocs, 1);
                    // SAFETY: this thread owns `tc`.
                    copy_into(slots, unsafe { tc.take_top(0, nr) });
                    bump(&tc.allocs, nr as u64);
                    return nr;
                }
            }
        }
        self.bulk_array_slow(gfp, slots)
    }

    #[inline(never)]
    fn bulk_array_slow(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        let populated = slots.iter().filter(|s| s.is_some()).count();
        let need = slots.len() - populated;
        if need == 0 {
            return populated;
        }
        if populated == 0 {
            return self.bulk_fill(gfp, slots, true);
        }
        // Some slots are taken: fill a dense scratch array, then scatter.
        let mut scratch = vec![None; need];
        let got = self.bulk_fill(gfp, &mut scratch, true);
        let empty = slots.iter_mut().filter(|s| s.is_none());
        for (slot, p) in empty.zip(&scratch[..got]) {
            *slot = *p;
        }
        populated + got
    }

    /// Bulk allocation, list form: append up to `nr` order-0 pages to
    /// `list`. **Returns:** how many were appended (may be fewer than `nr`).
    pub fn alloc_pages_bulk_list(&self, gfp: Gfp, nr: usize, list: &mut Vec<Page>) -> usize {
        let start = list.len();
        list.reserve(nr);
        self.alloc_pages_bulk_cb(gfp, nr, |p| list.push(p));
        list.len() - start
    }

    /// Bulk allocation, callback form: allocate up to `nr` order-0 pages and
    /// hand each to `f` (to fill an I/O vector directly). `f` runs with no
    /// allocator lock held and may itself allocate or free. If `f` panics,
    /// the pages not yet handed over are freed.
    ///
    /// **Returns:** how many pages were handed to `f`.
    pub fn alloc_pages_bulk_cb(&self, gfp: Gfp, nr: usize, mut f: impl FnMut(Page)) -> usize {
        let mut done = 0;
        let mut first = true;
        while done < nr {
            let mut chunk = [None; CB_CHUNK];
            let want = (nr - done).min(CB_CHUNK);
            // Count the call once, not once per chunk.
            let got = self.bulk_fill(gfp, &mut chunk[..want], first);
            first = false;
            let mut guard = Undelivered {
                alloc: self,
                pages: &mut chunk[..got],
                next: 0,
            };
            while guard.next < got {
                let p = guard.pages[guard.next]
                    .take()
                    .expect("bulk fills a prefix of the slots");
                guard.next += 1;
                f(p);
            }
            done += got;
            if got < want {
                break;
            }
        }
        done
    }

    /// Free order-0 pages in bulk: this thread's cache takes what fits, the
    /// rest goes to this CPU's list in one hold.
    ///
    /// **Context:** never blocks.
    pub fn free_pages_bulk(&self, pages: &[Page]) {
        if self.core.checks {
            for &p in pages {
                self.core.free_prep(p, 0);
            }
        }
        self.bulk_free(pages, true);
    }

    /// Free the order-0 pages held in `slots` in bulk, leaving every slot
    /// empty: the counterpart of [`PageAllocator::alloc_pages_bulk_array`].
    ///
    /// **Context:** never blocks. **Returns:** how many pages were freed.
    #[inline]
    pub fn free_pages_bulk_array(&self, slots: &mut [Option<Page>]) -> usize {
        let nr = slots.len();
        if let [Some(page)] = *slots {
            slots[0] = None;
            self.count_bulk(true);
            self.free_pages(page, 0);
            return 1;
        }
        if nr > 1 && !self.core.checks {
            // Fast path: every slot full and room for all in this thread's
            // cache — one copy in, one clear.
            if let Some(tc) = self.tcache() {
                if tc.cap[0] - tc.len(0) >= nr && slots.iter().all(Option::is_some) {
                    bump(&tc.bulk_frees, 1);
                    // SAFETY: every slot is `Some`, which has exactly the
                    // page's representation; this thread owns `tc` and the
                    // pages fit.
                    unsafe {
                        tc.extend(
                            0,
                            std::slice::from_raw_parts(slots.as_ptr().cast::<Page>(), nr),
                        );
                        clear_slots(slots.as_mut_ptr(), nr);
                    }
                    bump(&tc.frees, nr as u64);
                    return nr;
                }
            }
        }
        self.free_slots(slots, true)
    }

    #[inline(never)]
    fn free_slots(&self, slots: &mut [Option<Page>], count_call: bool) -> usize {
        if let [Some(page)] = *slots {
            slots[0] = None;
            if count_call {
                self.count_bulk(true);
            }
            self.free_pages(page, 0);
            return 1;
        }
        let n = slots.iter().filter(|s| s.is_some()).count();
        if self.core.checks {
            for &p in slots.iter().flatten() {
                self.core.free_prep(p, 0);
            }
        }
        if n == slots.len() {
            // SAFETY: every slot is `Some`, and `Some(p)` has exactly `p`'s
            // representation (`Page` is a transparent `NonZeroU32`; the
            // standard library guarantees this for `Option`).
            let pages = unsafe { std::slice::from_raw_parts(slots.as_ptr().cast::<Page>(), n) };
            self.bulk_free(pages, count_call);
            // SAFETY: `slots` is valid for `n` writes.
            unsafe { clear_slots(slots.as_mut_ptr(), n) };
        } else {
            let pages: Vec<Page> = slots.iter_mut().filter_map(Option::take).collect();
            self.bulk_free(&pages, count_call);
        }
        n
    }

    /// The bulk allocation engine behind every form when the inlined fast
    /// path cannot serve the call: fill `out` (every slot empty) from the
    /// front, from this thread's cache and then this CPU's list, one hold
    /// each. `count_call` counts one bulk call. Returns how many slots were
    /// filled.
    #[inline(never)]
    fn bulk_fill(&self, gfp: Gfp, out: &mut [Option<Page>], count_call: bool) -> usize {
        let core = &*self.core;
        let nr = out.len();
        debug_assert!(out.iter().all(Option::is_none));
        if nr == 0 {
            return 0;
        }
        if core.fault.is_enabled() {
            // Every page is a separate, injectable attempt, so callers see
            // partial fills.
            if count_call {
                core.counters.bulk_allocs.fetch_add(1, Relaxed);
            }
            return core.bulk_one_by_one(gfp, out);
        }
        // One page, or a zone below its low watermark: one page through the
        // full path, as the kernel does.
        let single = nr == 1 || !core.zone.watermark_ok(nr, FAST);
        let from_cache = self.tcache().map(|tc| {
            if count_call {
                bump(&tc.bulk_allocs, 1);
            }
            if single {
                return core.tcache_alloc(tc, 0).map_or(0, |p| {
                    out[0] = Some(p);
                    1
                });
            }
            let k = tc.len(0).min(nr);
            // SAFETY: this thread owns `tc`.
            copy_into(&mut out[..k], unsafe { tc.take_top(0, k) });
            bump(&tc.allocs, k as u64);
            k
        });
        let mut got = match from_cache {
            Some(k) => k,
            None => {
                if count_call {
                    core.counters.bulk_allocs.fetch_add(1, Relaxed);
                }
                0
            }
        };
        if single {
            if got == 0 {
                out[0] = core.alloc_uncached(gfp, 0);
                return out[0].is_some() as usize;
            }
        } else if got < nr {
            let rest = &mut out[got..];
            let mut at = 0;
            got += core.take(0, rest.len(), FAST, |run| {
                copy_into(&mut rest[at..at + run.len()], run);
                at += run.len();
            });
        }
        if gfp.contains(Gfp::ZERO) || core.checks {
            for p in out[..got].iter().flatten() {
                core.prep_new_page(*p, 0, gfp);
            }
        }
        got
    }

    /// The bulk free engine: this thread's cache takes what fits, the rest
    /// goes to this CPU's list in one hold. Callers have run the allocation
    /// checks already.
    #[inline]
    fn bulk_free(&self, pages: &[Page], count_call: bool) {
        let core = &*self.core;
        let taken = self.tcache().map(|tc| {
            if count_call {
                bump(&tc.bulk_frees, 1);
            }
            let room = (tc.cap[0] - tc.len(0)).min(pages.len());
            // SAFETY: this thread owns `tc`, and `room` pages fit.
            unsafe { tc.extend(0, &pages[..room]) };
            bump(&tc.frees, room as u64);
            room
        });
        let rest = match taken {
            Some(room) => &pages[room..],
            None => {
                if count_call {
                    core.counters.bulk_frees.fetch_add(1, Relaxed);
                }
                pages
            }
        };
        if !rest.is_empty() {
            core.give(0, rest.len(), rest.iter().copied());
        }
    }

    /// Allocate a block that frees itself when dropped.
    ///
    /// **Context / Returns:** as [`PageAllocator::alloc_pages`].
    pub fn alloc_box(&self, gfp: Gfp, order: u32) -> Option<PageBox<'_>> {
        self.alloc_pages(gfp, order).map(|page| PageBox {
            alloc: self,
            page,
            order,
        })
    }

    /// Split an allocated block of 2^`order` pages into 2^`order` order-0
    /// pages, each of which is then freed on its own with
    /// `free_pages(page, 0)` (the kernel's `split_page`; a compound block
    /// is dismantled first, as `split_folio` would).
    ///
    /// **Context:** never blocks; the caller owns the block. Panics if
    /// `page` is not the start of an order-`order` block of this arena, or
    /// (with checks on) if it is not allocated.
    pub fn split_page(&self, page: Page, order: u32) {
        if order == 0 {
            return;
        }
        let core = &*self.core;
        core.free_prep(page, order);
        if core.checks {
            for pfn in page.pfn()..page.pfn() + (1 << order) {
                let f = core.arena.frame(pfn);
                f.set_flags(f.flags() | flags::ALLOCATED);
            }
        }
    }

    /// Background reclaim's work so far: (rounds run, pages reclaimed).
    pub fn kswapd_stats(&self) -> (u64, u64) {
        let k = &self.core.kswapd.shared;
        (k.rounds.load(Relaxed), k.reclaimed.load(Relaxed))
    }

    /// Whether the background reclaim thread is running.
    pub fn kswapd_running(&self) -> bool {
        self.core.kswapd.started.load(Relaxed) && !self.core.kswapd.shared.stop.load(Relaxed)
    }

    /// Stop the background reclaim thread (it is started again by the
    /// next wake-up only after [`PageAllocator::start_kswapd`]).
    pub fn stop_kswapd(&self) {
        self.core.kswapd.stop();
    }

    /// Allow background reclaim again after [`PageAllocator::stop_kswapd`].
    pub fn start_kswapd(&self) {
        let k = &self.core.kswapd;
        if k.shared.stop.swap(false, Relaxed) {
            k.started.store(false, Relaxed);
        }
    }

    /// Whether allocation checks (double-free detection and the like) are
    /// on.
    pub fn checks_enabled(&self) -> bool {
        self.core.checks
    }

    /// Whether `other` is a handle on this same allocator (same arena).
    pub fn same_allocator(&self, other: &PageAllocator) -> bool {
        Arc::ptr_eq(&self.core, &other.core)
    }

    /// Address of `page` in the arena's direct map.
    #[inline]
    pub fn page_address(&self, page: Page) -> *mut u8 {
        self.core.arena.page_address(page)
    }

    /// The page containing `addr`, if it lies in the arena.
    pub fn page_of_address(&self, addr: *const u8) -> Option<Page> {
        self.core.arena.page_of_address(addr)
    }

    /// The arena (memfd, mapping, frame metadata).
    pub fn arena(&self) -> &Arena {
        &self.core.arena
    }

    /// A snapshot of `page`'s frame metadata.
    pub fn frame_info(&self, page: Page) -> Option<FrameInfo> {
        self.core.arena.frame_info(page)
    }

    /// Fault injection for this allocator (off by default).
    pub fn fault(&self) -> &FaultInjector {
        &self.core.fault
    }

    /// The shrinkers that direct reclaim calls.
    pub fn shrinkers(&self) -> &ShrinkerRegistry {
        &self.core.shrinkers
    }

    /// The owners of movable pages, whose callbacks compaction uses.
    pub fn movable_owners(&self) -> &MovableRegistry {
        &self.core.movable
    }

    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// Free order-0 pages straight to the zone, past the type-agnostic
    /// caches, so that movable pages go back to their pageblocks' lists
    /// instead of being handed to the next unmovable allocation.
    pub(crate) fn free_pages_to_zone(&self, pages: &[Page]) {
        let core = &*self.core;
        if core.checks {
            for &p in pages {
                core.free_prep(p, 0);
            }
        }
        let mut z = core.zone.lock(&core.arena);
        for p in pages {
            z.free(p.pfn(), 0);
        }
        drop(z);
        core.counters
            .zone_frees
            .fetch_add(pages.len() as u64, Relaxed);
        core.wake_waiters();
    }

    /// The zone's watermarks.
    pub fn watermarks(&self) -> Watermarks {
        self.core.zone.watermarks()
    }

    /// Change the watermarks.
    ///
    /// **Returns:** an error unless `min <= low <= high < pages in the arena`.
    pub fn set_watermarks(&self, w: Watermarks) -> Result<()> {
        let n = self.core.arena.nr_pages();
        if !(w.min <= w.low && w.low <= w.high && w.high < n) {
            return Err(crate::error::Error::setting(
                "watermarks",
                format!("min {} low {} high {}", w.min, w.low, w.high),
                format!("need min <= low <= high < {n} (the arena's pages)"),
            ));
        }
        self.core.zone.set_watermarks(w);
        Ok(())
    }

    /// The per-CPU lists' `high` and `batch`.
    pub fn pcp_limits(&self) -> PcpLimits {
        self.core.limits
    }

    /// Number of per-CPU list sets.
    pub fn nr_cpus(&self) -> usize {
        self.core.pcp.len()
    }

    /// Most pages one thread's cache can hold (0 when thread caches are off).
    pub fn thread_cache_max_pages(&self) -> usize {
        self.core.thread_cache_max_pages()
    }

    /// Give this thread's cached pages back to the per-CPU lists.
    ///
    /// **Context:** never blocks.
    pub fn flush_thread_cache(&self) {
        self.core.flush_own_cache();
    }

    /// Return every page on every CPU's lists, and this thread's cache, to
    /// the zone (the kernel's `drain_all_pages`). Other threads' caches are
    /// not touched: they flush when their threads exit or call
    /// [`PageAllocator::flush_thread_cache`].
    ///
    /// **Context:** may spin briefly for per-CPU locks held by other threads.
    pub fn drain_all(&self) {
        self.flush_thread_cache();
        self.core.drain_all_pcp();
    }

    /// Where every page is right now (racy unless the allocator is quiet).
    pub fn accounting(&self) -> Accounting {
        self.core.accounting()
    }

    /// Check that nothing is allocated: drain this thread's cache and the
    /// per-CPU lists, then compare the zone's free pages with the total
    /// (minus pages that live threads' caches hold).
    ///
    /// **Returns:** the accounting as the error when pages are in use.
    pub fn leak_check(&self) -> std::result::Result<Accounting, Accounting> {
        self.drain_all();
        let a = self.accounting();
        if a.in_use_pages == 0 {
            Ok(a)
        } else {
            Err(a)
        }
    }

    /// Statistics: calls by path, per-CPU refills and drains, free pages by
    /// order, failures.
    pub fn stats(&self) -> Stats {
        self.core.stats()
    }
}

impl Owner for Core {
    fn id(&self) -> u64 {
        self.id
    }
    fn tcache_cap(&self) -> [usize; PCP_ORDERS] {
        self.tcache_cap
    }
    fn tcache_register(&self, tc: &Arc<Tcache>) {
        self.tcaches.lock().push(Arc::clone(tc));
    }
    fn tcache_retire(&self, tc: &Tcache) {
        self.tcache_flush_all(tc);
        self.counters.fold_tcache(tc);
        self.tcaches.lock().retain(|t| !std::ptr::eq(&**t, tc));
    }
}

impl Core {
    /// Blocks per order a [`crate::LocalAllocator`]'s cache holds.
    pub(crate) fn local_cap(&self) -> [usize; PCP_ORDERS] {
        self.local_cap
    }

    /// Most pages one thread's cache can hold (0 when caches are off).
    pub(crate) fn thread_cache_max_pages(&self) -> usize {
        (0..PCP_ORDERS).map(|o| self.tcache_cap[o] << o).sum()
    }

    // ---- fast path -------------------------------------------------------

    /// One block through a page cache (`cache()`: the caller's thread
    /// cache or handle, asked only when a cache may serve), else the
    /// uncached path. Movable pages bypass the type-agnostic caches (see
    /// compaction.rs), and fault injection sees every attempt.
    #[inline(always)]
    pub(crate) fn alloc_cached<'t>(
        &self,
        gfp: Gfp,
        order: u32,
        cache: impl FnOnce() -> Option<&'t Tcache>,
    ) -> Option<Page> {
        if order <= PCP_MAX_ORDER && !self.fault.is_enabled() && !gfp.contains(Gfp::MOVABLE) {
            if let Some(tc) = cache() {
                if let Some(page) = self.tcache_alloc(tc, order) {
                    return Some(self.prep_new_page(page, order, gfp));
                }
            }
        }
        self.alloc_uncached(gfp, order)
    }

    /// Free one block through a page cache (as [`Core::alloc_cached`]),
    /// after the allocation checks.
    #[inline(always)]
    pub(crate) fn free_cached<'t>(
        &self,
        page: Page,
        order: u32,
        cache: impl FnOnce() -> Option<&'t Tcache>,
    ) {
        if order > 0 || self.checks {
            self.free_prep(page, order);
        }
        if order <= PCP_MAX_ORDER {
            if let Some(tc) = cache() {
                self.tcache_free(tc, page, order);
                return;
            }
        }
        self.free_uncached(page, order);
    }

    #[inline]
    pub(crate) fn tcache_alloc(&self, tc: &Tcache, order: u32) -> Option<Page> {
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
    pub(crate) fn tcache_refill(&self, tc: &Tcache, order: u32) -> Option<Page> {
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
                unsafe {
                    tc.commit(0, got);
                    return tc.pop(0);
                }
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
        unsafe {
            tc.commit(order, got);
            tc.pop(order)
        }
    }

    #[inline]
    pub(crate) fn tcache_free(&self, tc: &Tcache, page: Page, order: u32) {
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
    pub(crate) fn tcache_flush(&self, tc: &Tcache, order: u32) {
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
        bump(&tc.flushes, 1);
    }

    pub(crate) fn tcache_flush_all(&self, tc: &Tcache) {
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

    /// Prepare a page for its caller: zero it, make it compound, record it
    /// as allocated — only what the flags and settings ask for.
    #[inline]
    pub(crate) fn prep_new_page(&self, page: Page, order: u32, gfp: Gfp) -> Page {
        if gfp.intersects(Gfp::ZERO | Gfp::COMP) || self.checks {
            self.prep_slow(page, order, gfp);
        }
        page
    }

    #[cold]
    fn prep_slow(&self, page: Page, order: u32, gfp: Gfp) {
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
    pub(crate) fn free_prep(&self, page: Page, order: u32) {
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

    // ---- per-CPU lists and zone ------------------------------------------

    /// This CPU's list set, locked, or `None` if another thread holds it.
    #[inline]
    fn this_cpu(&self) -> Option<PcpGuard<'_>> {
        let set = &self.pcp[crate::cpu::slot(self.pcp.len())];
        set.try_lock(&self.zone, &self.arena, &self.limits)
    }

    /// Take up to `nr` blocks through this CPU's list (or the zone if the
    /// list is busy), under one hold; `put` receives them a run at a time.
    fn take(&self, order: u32, nr: usize, wm: AllocFlags, mut put: impl FnMut(&[Page])) -> usize {
        if let Some(mut g) = self.this_cpu() {
            return g.take(order, nr, wm, &mut put);
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
    fn give_counted(&self, order: u32, n: usize, pages: impl Iterator<Item = Page>, single: bool) {
        if let Some(mut g) = self.this_cpu() {
            g.give(order, n, pages);
            if single {
                g.note(true, 1);
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

    fn give(&self, order: u32, n: usize, pages: impl Iterator<Item = Page>) {
        self.give_counted(order, n, pages, false)
    }

    /// Give `pages` (blocks of `order`) to this CPU's list, or the zone.
    pub(crate) fn give_pages(&self, order: u32, pages: &[Page]) {
        self.give(order, pages.len(), pages.iter().copied())
    }

    /// Take up to `nr` blocks of `order` through this CPU's list under the
    /// fast path's watermark, when the zone stays above it with all of
    /// them gone; `put` receives them a run at a time.
    pub(crate) fn take_fast(&self, order: u32, nr: usize, put: impl FnMut(&[Page])) -> usize {
        if !self.zone.watermark_ok(nr << order, FAST) {
            return 0;
        }
        self.take(order, nr, FAST, put)
    }

    /// Flush the calling thread's cache, if it has one.
    pub(crate) fn flush_own_cache(&self) {
        let _ = CACHES.try_with(|c| {
            if let Some(tc) = c.existing(self.id) {
                self.tcache_flush_all(tc);
            }
        });
    }

    pub(crate) fn drain_all_pcp(&self) {
        for set in self.pcp.iter() {
            let mut spins = 0u32;
            loop {
                if let Some(mut g) = set.try_lock(&self.zone, &self.arena, &self.limits) {
                    g.drain();
                    break;
                }
                spins += 1;
                if spins % 64 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        self.zone.drain_depot(&self.arena);
        self.counters.drain_all.fetch_add(1, Relaxed);
        self.wake_waiters();
    }

    // ---- uncached and slow paths -----------------------------------------

    pub(crate) fn alloc_uncached(&self, gfp: Gfp, order: u32) -> Option<Page> {
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

    fn get_page_from_freelist(&self, order: u32, wm: AllocFlags, mt: MigrateType) -> Option<Page> {
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
    fn alloc_slowpath(&self, gfp: Gfp, order: u32) -> Option<Page> {
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
                compacted = try_to_compact(self, order) == CompactResult::Success;
            }
            // Pages parked in this thread's cache and on per-CPU lists are
            // invisible to the zone (a shrinker running here just freed into
            // this thread's cache); give them back before deciding there is
            // no memory.
            self.flush_own_cache();
            self.drain_all_pcp();
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
    fn fail(&self, gfp: Gfp, order: u32) -> Option<Page> {
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
    fn wake_kswapd(&self) {
        let k = &self.kswapd;
        if k.shared.stop.load(Relaxed) {
            return;
        }
        if !k.started.load(Relaxed) && !k.started.swap(true, Relaxed) {
            let weak = k.core.clone();
            let shared = Arc::clone(&k.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("kswapd/{}", self.id))
                .spawn(move || kswapd_main(weak, shared));
            if spawned.is_err() {
                // No thread: direct reclaim still works; try again later.
                k.started.store(false, Relaxed);
                return;
            }
        }
        let mut pending = k.shared.pending.lock();
        if !*pending {
            *pending = true;
            k.shared.cv.notify_one();
        }
    }

    /// One round of background reclaim: shrink until the zone is above its
    /// high watermark or the shrinkers free nothing more. Returns pages
    /// reclaimed.
    fn kswapd_round(&self) -> usize {
        let high = self.zone.watermarks().high;
        let mut total = 0;
        loop {
            let free = self.zone.nr_free_pages() + self.zone.depot.len();
            if free >= high || self.kswapd.shared.stop.load(Relaxed) {
                break;
            }
            let want = (high - free).min(KSWAPD_BATCH);
            let got = self.shrinkers.shrink(Gfp::KERNEL, want);
            // What the shrinkers freed sits in this thread's cache and its
            // CPU's list: hand it to the zone, where the watermarks see it.
            self.flush_own_cache();
            self.drain_all_pcp();
            total += got;
            if got == 0 {
                break;
            }
        }
        total
    }

    /// Sleep until something is freed to the zone or [`NOFAIL_WAIT`] passes.
    fn wait_for_frees(&self) {
        self.counters.nofail_waits.fetch_add(1, Relaxed);
        let mut g = self.wait_lock.lock();
        self.waiters.fetch_add(1, Relaxed);
        self.wait_cv.wait_for(&mut g, NOFAIL_WAIT);
        self.waiters.fetch_sub(1, Relaxed);
    }

    #[inline]
    pub(crate) fn wake_waiters(&self) {
        if self.waiters.load(Relaxed) > 0 {
            let _g = self.wait_lock.lock();
            self.wait_cv.notify_all();
        }
    }

    pub(crate) fn free_uncached(&self, page: Page, order: u32) {
        if order <= PCP_MAX_ORDER {
            self.give_counted(order, 1, std::iter::once(page), true);
        } else {
            self.zone.lock(&self.arena).free(page.pfn(), order);
            self.counters.zone_frees.fetch_add(1, Relaxed);
            self.wake_waiters();
        }
    }

    #[cold]
    fn bulk_one_by_one(&self, gfp: Gfp, out: &mut [Option<Page>]) -> usize {
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = self.alloc_uncached(gfp, 0);
            if slot.is_none() {
                return i;
            }
        }
        out.len()
    }
}

/// Copy pages into empty slots: a plain memory copy, because `Some(p)`
/// has exactly `p`'s representation.
#[inline]
fn copy_into(out: &mut [Option<Page>], pages: &[Page]) {
    assert_eq!(out.len(), pages.len());
    // SAFETY: the lengths match, the two slices cannot overlap (one is
    // borrowed mutably), and writing a valid `Page` into an `Option<Page>`
    // makes it `Some(page)` (`Page` is a transparent `NonZeroU32`).
    unsafe { copy_pages(out.as_mut_ptr().cast::<Page>(), pages.as_ptr(), pages.len()) };
}

/// Pages background reclaim asks the shrinkers for at a time.
const KSWAPD_BATCH: usize = 128;

/// Background reclaim's shared state (the kernel's `kswapd`).
#[derive(Default)]
struct KswapdShared {
    /// A wake-up not yet served.
    pending: Mutex<bool>,
    cv: Condvar,
    stop: AtomicBool,
    rounds: AtomicU64,
    reclaimed: AtomicU64,
}

/// The background reclaim thread of one allocator: started by the first
/// wake-up, asleep (no timer) until the next, gone when stopped or when
/// the allocator is dropped.
pub(crate) struct Kswapd {
    started: AtomicBool,
    shared: Arc<KswapdShared>,
    /// The allocator it serves, not kept alive by it.
    core: std::sync::Weak<Core>,
}

impl Kswapd {
    fn stop(&self) {
        self.shared.stop.store(true, Relaxed);
        let _g = self.shared.pending.lock();
        self.shared.cv.notify_all();
    }
}

impl Drop for Kswapd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: wait for a wake-up, run a round against the allocator if
/// it still exists, repeat.
fn kswapd_main(core: std::sync::Weak<Core>, shared: Arc<KswapdShared>) {
    loop {
        {
            let mut pending = shared.pending.lock();
            while !*pending && !shared.stop.load(Relaxed) {
                shared.cv.wait(&mut pending);
            }
            *pending = false;
        }
        if shared.stop.load(Relaxed) {
            return;
        }
        let Some(core) = core.upgrade() else { return };
        let got = core.kswapd_round();
        shared.rounds.fetch_add(1, Relaxed);
        shared.reclaimed.fetch_add(got as u64, Relaxed);
        drop(core);
    }
}

/// Frees the pages of a callback round that `f` never received (it panicked).
struct Undelivered<'a> {
    alloc: &'a PageAllocator,
    pages: &'a mut [Option<Page>],
    next: usize,
}

impl Drop for Undelivered<'_> {
    fn drop(&mut self) {
        let rest = &mut self.pages[self.next..];
        if rest.iter().any(Option::is_some) {
            self.alloc.free_slots(rest, false);
        }
    }
}

/// An owned block of pages that is freed when dropped: the safe layer over
/// plain [`Page`] handles.
pub struct PageBox<'a> {
    alloc: &'a PageAllocator,
    page: Page,
    order: u32,
}

impl PageBox<'_> {
    /// The first frame.
    pub fn page(&self) -> Page {
        self.page
    }

    /// The block's order.
    pub fn order(&self) -> u32 {
        self.order
    }

    /// Bytes in the block.
    pub fn len(&self) -> usize {
        PAGE_SIZE << self.order
    }

    /// Always false: a block holds at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The block's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the block is allocated to this box for its whole life and
        // lies inside the arena's mapping, which outlives the allocator
        // reference the box holds.
        unsafe { std::slice::from_raw_parts(self.alloc.page_address(self.page), self.len()) }
    }

    /// The block's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.page_address(self.page), self.len()) }
    }

    /// Give up ownership without freeing: the caller frees with
    /// [`PageAllocator::free_pages`] and this order.
    pub fn into_raw(self) -> Page {
        let p = self.page;
        std::mem::forget(self);
        p
    }
}

impl Drop for PageBox<'_> {
    fn drop(&mut self) {
        self.alloc.free_pages(self.page, self.order);
    }
}
