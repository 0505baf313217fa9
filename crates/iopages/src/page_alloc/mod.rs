//! The page allocator: its handle, its state and how they are put together.
//!
//! Owns: [`PageAllocator`] (the facade every consumer calls), its private
//! state `Core`, construction from the builder's settings, and the
//! accessors. The work is in the child modules, one per path:
//!
//! | file | owns |
//! |---|---|
//! | `fastpath.rs` | one block through the caller's cache; per-page prep and checks |
//! | `lists.rs` | moving blocks between caches, per-CPU lists, depot and zone; drains |
//! | `bulk.rs` | the array, list and callback forms of bulk allocation and free |
//! | `slowpath.rs` | the uncached and slow paths; the allocator's side of reclaim and compaction |
//! | `pagebox.rs` | [`PageBox`], the safe owner of a block |
//! | `local.rs` | [`crate::LocalAllocator`], a handle that owns its cache |
//! | `builder.rs` | settings and their defaults |
//! | `stats.rs` | counters, [`crate::Stats`], [`crate::Accounting`] |
//!
//! Must never: block or take a lock on the fast path, hold any allocator
//! lock while calling a shrinker or a caller's callback, or let a module
//! outside `page_alloc` reach `Core`'s fields (the compiler enforces this
//! one: `Core` and its fields are private here).

mod builder;
mod bulk;
mod fastpath;
mod lists;
mod local;
mod pagebox;
mod slowpath;
mod stats;

pub use builder::{
    PageAllocatorBuilder, DEFAULT_ARENA_BYTES, DEFAULT_LOCAL_CACHE_PAGES,
    DEFAULT_THREAD_CACHE_PAGES,
};
pub use local::{LocalAllocator, LocalFastPath};
pub use pagebox::PageBox;
pub use stats::{Accounting, Stats};

use crate::buddy::arena::Arena;
use crate::buddy::frame::{flags, FrameInfo, Page};
use crate::buddy::zone::{AllocFlags, MigrateType, Watermarks, Zone};
use crate::error::Result;
use crate::fault::FaultInjector;
use crate::percpu::pcp::{PcpLimits, PcpSet, PCP_ORDERS};
use crate::percpu::tcache::{Owner, Tcache, ThreadCaches};
use crate::reclaim::compaction::{CompactResult, MovableRegistry};
use crate::reclaim::kswapd::Kswapd;
use crate::reclaim::shrinker::ShrinkerRegistry;
use parking_lot::{Condvar, Mutex};
use stats::Counters;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Rounds of reclaim without progress before a blocking allocation that is
/// not `NOFAIL` gives up (the kernel's `MAX_RECLAIM_RETRIES`).
pub const MAX_RECLAIM_RETRIES: u32 = 16;
/// How long a `NOFAIL` allocation sleeps between attempts when nothing was
/// freed, at most.
pub const NOFAIL_WAIT: Duration = Duration::from_millis(1);

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

/// The allocator's state. Its fields are private to this module and its
/// children (the fast path, bulk, lists, slow path, stats, local handles):
/// the reclaim layer sees it only through the traits it implements, and
/// consumers only through [`PageAllocator`]'s public methods.
struct Core {
    id: u64,
    arena: Arena,
    zone: Zone,
    pcp: Box<[PcpSet]>,
    limits: PcpLimits,
    tcache_cap: [usize; PCP_ORDERS],
    /// Capacity of a [`crate::LocalAllocator`]'s cache.
    local_cap: [usize; PCP_ORDERS],
    tcache_on: bool,
    checks: bool,
    /// Every call takes the careful path: checks on, or every call
    /// counted ([`PageAllocatorBuilder::fast_path_stats`]).
    careful: bool,
    /// Handles write batches of 2 to 4 pages as packed 8-byte stores
    /// ([`PageAllocatorBuilder::pack_small_batches`]).
    pack_small: bool,
    fault: FaultInjector,
    shrinkers: ShrinkerRegistry,
    /// Owners of movable pages and their migration callbacks.
    movable: MovableRegistry,
    tcaches: Mutex<Vec<Arc<Tcache>>>,
    counters: Counters,
    waiters: AtomicUsize,
    wait_lock: Mutex<()>,
    wait_cv: Condvar,
    /// Background reclaim, started on first wake-up.
    kswapd: Kswapd<Core>,
    /// Drains in progress, which [`Core::accounting`] waits out.
    drains: stats::Drains,
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

    fn from_builder(b: PageAllocatorBuilder) -> Result<PageAllocator> {
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
        let careful = b.checks || b.fast_path_stats;
        let fault = FaultInjector::default();
        if careful {
            fault.set_careful();
        }
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
                careful,
                pack_small: b
                    .pack_small_batches
                    .unwrap_or_else(crate::percpu::cpu::packs_small_batches),
                fault,
                shrinkers: ShrinkerRegistry::default(),
                movable: MovableRegistry::new(nr_pages),
                tcaches: Mutex::new(Vec::new()),
                counters: Counters::default(),
                waiters: AtomicUsize::new(0),
                wait_lock: Mutex::new(()),
                wait_cv: Condvar::new(),
                kswapd: Kswapd::new(me.clone(), b.background_reclaim),
                drains: stats::Drains::default(),
            }),
        })
    }

    /// Split an allocated block of 2^`order` pages into 2^`order` order-0
    /// pages, each of which is then freed on its own with
    /// `free_pages(page, 0)` (the kernel's `split_page`; a compound block
    /// is dismantled first, as `split_folio` would).
    ///
    /// **Context:** never blocks. Panics if `page` is not the start of an
    /// order-`order` block of this arena, or (with checks on) if it is not
    /// allocated.
    ///
    /// # Safety
    /// The caller owns the block, and afterwards owns its pages one by one:
    /// nothing that owned the block as a whole (a
    /// [`PageBox`](crate::PageBox), a folio) may free it with `order` again.
    pub unsafe fn split_page(&self, page: Page, order: u32) {
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
        self.core.kswapd.stats()
    }

    /// Whether background reclaim has nothing in progress: never started,
    /// stopped, or asleep with no wake-up pending. A test waits for this
    /// instead of sleeping.
    pub fn kswapd_idle(&self) -> bool {
        self.core.kswapd.idle()
    }

    /// Whether the background reclaim thread is running.
    pub fn kswapd_running(&self) -> bool {
        self.core.kswapd.running()
    }

    /// Stop the background reclaim thread (it is started again by the
    /// next wake-up only after [`PageAllocator::start_kswapd`]).
    pub fn stop_kswapd(&self) {
        self.core.kswapd.stop();
    }

    /// Allow background reclaim again after [`PageAllocator::stop_kswapd`].
    pub fn start_kswapd(&self) {
        self.core.kswapd.start();
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

    /// Address of `page` in the arena's direct map. Reading or writing
    /// through it is the caller's business (and `unsafe`); a [`PageBox`]
    /// gives the same bytes as slices.
    ///
    /// # Panics
    /// If `page` is outside the arena (in release builds too).
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

    fn core(&self) -> &Core {
        &self.core
    }

    /// Free order-0 movable pages (allocated with `Gfp::MOVABLE`) straight
    /// to the zone, past the type-agnostic thread caches and per-CPU lists,
    /// so that they go back to their pageblocks' lists instead of being
    /// handed to the next unmovable allocation (see the grouping by
    /// mobility in `reclaim/compaction.rs`). Any order-0 page may be freed
    /// this way; only the placement differs from
    /// [`PageAllocator::free_pages_bulk`].
    ///
    /// **Context:** never blocks; takes the zone lock once. With checks on,
    /// a page that is not allocated panics as in
    /// [`PageAllocator::free_pages`].
    ///
    /// # Safety
    /// The caller owns every page of `pages` (each once): it came from this allocator with this order,
    /// and nothing else — no [`PageBox`](crate::PageBox), folio buffer,
    /// bio, pool, copy of the handle or pointer into its bytes — is used
    /// as owning it afterwards. Freeing a frame that something else still
    /// owns lets the allocator hand it out again, so two owners would reach
    /// the same bytes. (With checks on, a block that is not allocated is
    /// caught and panics; a block that is allocated to someone else cannot
    /// be told apart.)
    pub unsafe fn free_movable_pages(&self, pages: &[Page]) {
        self.core.free_to_zone(pages);
    }

    /// Compact the arena until a free block of `order` exists (the
    /// kernel's `compact_zone` for one order), draining the per-CPU lists
    /// first so that their pages count.
    ///
    /// **Context:** may block (owners' callbacks take their locks); never
    /// call it from a [`crate::MovableOwner`] callback.
    pub fn compact(&self, order: u32) -> CompactResult {
        self.core.compact(order)
    }

    /// The migratetype of the pageblock holding `page` (a debugging aid).
    ///
    /// # Panics
    /// If `page` is outside the arena.
    pub fn pageblock_migratetype(&self, page: Page) -> MigrateType {
        assert!((page.pfn() as usize) < self.core.arena.nr_pages());
        self.core.zone.pageblock_type(page.pfn())
    }

    /// Pageblocks of each type right now: (unmovable, movable).
    pub fn pageblocks_by_type(&self) -> (usize, usize) {
        self.core.zone.pageblocks_by_type()
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
        self.core.drain_to_zone_all();
    }

    /// Where every page is right now: exact while the caller's threads
    /// neither allocate nor free (a drain on another thread — background
    /// reclaim's, or a [`PageAllocator::drain_all`] — is waited out, never
    /// half counted); a racy snapshot while they do.
    ///
    /// **Context:** may spin briefly while a drain runs.
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
    fn careful(&self) -> bool {
        self.careful
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

    /// Whether handles pack batches of 2 to 4 pages into 8-byte stores.
    pub(crate) fn pack_small(&self) -> bool {
        self.pack_small
    }

    /// Most pages one thread's cache can hold (0 when caches are off).
    pub(crate) fn thread_cache_max_pages(&self) -> usize {
        (0..PCP_ORDERS).map(|o| self.tcache_cap[o] << o).sum()
    }
}
