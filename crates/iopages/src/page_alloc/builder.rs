//! Settings for a page allocator, with defaults and validation.
//!
//! Owns: every tunable of the arena, zone, per-CPU lists and thread caches,
//! and the rules that reject bad values with a message saying what would
//! be accepted. Must never: build anything half-way — a refused setting
//! leaves nothing allocated.

use crate::buddy::arena::{HugePages, ARENA_MIN_BYTES};
use crate::buddy::zone::Watermarks;
use crate::error::{Error, Result};
use crate::page_alloc::PageAllocator;
use crate::percpu::pcp::{PcpLimits, PCP_HIGH_MAX, PCP_ORDERS};

/// Default arena size: 256 MiB.
pub const DEFAULT_ARENA_BYTES: u64 = 256 << 20;
/// Default thread-cache capacity for order 0, in pages.
pub const DEFAULT_THREAD_CACHE_PAGES: usize = 64;
/// Default order-0 capacity of a [`crate::LocalAllocator`]'s cache, in
/// pages (DPDK's largest per-lcore mempool cache).
pub const DEFAULT_LOCAL_CACHE_PAGES: usize = 512;
/// Largest thread-cache capacity accepted, in pages.
pub const THREAD_CACHE_PAGES_MAX: usize = 4096;

/// Builds a [`PageAllocator`]. Every setting has a default; see each method.
#[derive(Clone, Debug)]
pub struct PageAllocatorBuilder {
    pub(crate) size_bytes: u64,
    pub(crate) huge_pages: HugePages,
    pub(crate) populate: bool,
    pub(crate) watermarks: Option<Watermarks>,
    pub(crate) pcp: Option<PcpLimits>,
    pub(crate) nr_cpus: Option<usize>,
    pub(crate) thread_cache_pages: usize,
    pub(crate) local_cache_pages: usize,
    pub(crate) depot_pages: Option<usize>,
    pub(crate) checks: bool,
    pub(crate) fast_path_stats: bool,
    pub(crate) background_reclaim: bool,
    pub(crate) pack_small_batches: Option<bool>,
}

impl Default for PageAllocatorBuilder {
    fn default() -> Self {
        PageAllocatorBuilder {
            size_bytes: DEFAULT_ARENA_BYTES,
            huge_pages: HugePages::Try,
            populate: false,
            watermarks: None,
            pcp: None,
            nr_cpus: None,
            thread_cache_pages: DEFAULT_THREAD_CACHE_PAGES,
            local_cache_pages: DEFAULT_LOCAL_CACHE_PAGES,
            depot_pages: None,
            checks: cfg!(debug_assertions),
            fast_path_stats: false,
            background_reclaim: true,
            pack_small_batches: None,
        }
    }
}

impl PageAllocatorBuilder {
    /// Arena size in bytes: a multiple of 4 MiB, at least 4 MiB
    /// (default 256 MiB).
    pub fn size_bytes(mut self, size_bytes: u64) -> Self {
        self.size_bytes = size_bytes;
        self
    }

    /// Huge-page policy for the arena (default [`HugePages::Try`]).
    pub fn huge_pages(mut self, huge: HugePages) -> Self {
        self.huge_pages = huge;
        self
    }

    /// Fault the whole arena in at creation (default off).
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// Watermarks in pages (default: [`Watermarks::for_zone`]).
    pub fn watermarks(mut self, w: Watermarks) -> Self {
        self.watermarks = Some(w);
        self
    }

    /// Per-CPU `high` and `batch` (default: [`PcpLimits::for_zone`]).
    pub fn pcp_limits(mut self, l: PcpLimits) -> Self {
        self.pcp = Some(l);
        self
    }

    /// Number of per-CPU list sets (default: the CPUs the system has).
    pub fn nr_cpus(mut self, n: usize) -> Self {
        self.nr_cpus = Some(n);
        self
    }

    /// Order-0 capacity of each thread's cache in pages; higher orders get
    /// proportionally less. 0 turns thread caches off, so every allocation
    /// goes through the per-CPU lists (default 64).
    pub fn thread_cache_pages(mut self, pages: usize) -> Self {
        self.thread_cache_pages = pages;
        self
    }

    /// Order-0 capacity of each [`crate::LocalAllocator`]'s cache in pages
    /// (default 512, at most 1/16 of the arena, at least a thread cache's);
    /// higher orders get what a thread cache gets. A handle is created on
    /// purpose by a worker that allocates in batches, so it may keep more
    /// than the implicit per-thread cache.
    pub fn local_cache_pages(mut self, pages: usize) -> Self {
        self.local_cache_pages = pages;
        self
    }

    /// Most free order-0 pages parked in the depot between CPUs (default:
    /// 1/16 of the arena, at least two order-0 batches; 0 turns it off, so
    /// every drained batch goes back to the buddy lists).
    pub fn depot_pages(mut self, pages: usize) -> Self {
        self.depot_pages = Some(pages);
        self
    }

    /// Track allocated frames in their metadata and catch double frees and
    /// frees of pages never allocated (default: on in debug builds).
    pub fn checks(mut self, on: bool) -> Self {
        self.checks = on;
        self
    }

    /// Count every call in [`crate::Stats`], cache hits included (default:
    /// off). Off, the fast paths count nothing — a cache hit is a length
    /// compare and a copy — so `alloc_thread_cache`, `free_thread_cache`,
    /// `bulk_alloc_calls` and `bulk_free_calls` count only the calls that
    /// took the careful path (a refill, a flush, flags that need
    /// preparing, checks, fault injection). On, every call takes the
    /// careful path, which counts it: exact figures, at the careful
    /// path's cost. With checks on, every call is counted either way.
    pub fn fast_path_stats(mut self, on: bool) -> Self {
        self.fast_path_stats = on;
        self
    }

    /// How a [`crate::LocalAllocator`] writes a batch of 2 to 4 pages into
    /// its cache (default: by CPU vendor). Packed (`true`, the default on
    /// AMD): the slots paired into 8-byte stores, as AMD's store-to-load
    /// forwarding predictor misses once per round on one 4-byte store per
    /// slot (14 ns per page at batch 2 against 3.7). One store per slot
    /// (`false`, the default elsewhere): on an Intel Xeon the packing cost
    /// 2.5-3.1 ns per page at batch 4 against 2.0-2.1. The pages cached are the
    /// same either way; only speed differs. The C view carries the choice
    /// to the header's inline batch free.
    pub fn pack_small_batches(mut self, packed: bool) -> Self {
        self.pack_small_batches = Some(packed);
        self
    }

    /// Run background reclaim (a `kswapd` thread, started by the first
    /// wake-up below the low watermark) (default: on). Off, only direct
    /// reclaim runs the shrinkers.
    pub fn background_reclaim(mut self, on: bool) -> Self {
        self.background_reclaim = on;
        self
    }

    /// Create the allocator.
    ///
    /// **Context:** may block while the kernel maps memory. **Returns:** an
    /// error naming the first bad setting, or the system call that failed.
    pub fn build(self) -> Result<PageAllocator> {
        let nr_pages_hint = (self.size_bytes / 4096) as usize;
        if self.size_bytes >= ARENA_MIN_BYTES {
            self.validate(nr_pages_hint)?;
        }
        PageAllocator::from_builder(self)
    }

    pub(super) fn resolved_cpus(&self) -> usize {
        self.nr_cpus.unwrap_or_else(crate::percpu::cpu::nr_cpus)
    }

    pub(super) fn resolved_watermarks(&self, nr_pages: usize) -> Watermarks {
        self.watermarks
            .unwrap_or_else(|| Watermarks::for_zone(nr_pages))
    }

    pub(super) fn resolved_pcp(&self, nr_pages: usize) -> PcpLimits {
        self.pcp
            .unwrap_or_else(|| PcpLimits::for_zone(nr_pages, self.resolved_cpus()))
    }

    /// Depot capacity in pages: 1/16 of the arena, at least two order-0
    /// batches (or as set).
    pub(super) fn resolved_depot(&self, nr_pages: usize, pcp: &PcpLimits) -> usize {
        self.depot_pages
            .unwrap_or_else(|| (nr_pages / 16).max(2 * pcp.batch[0]))
    }

    /// Thread-cache capacity per order, in blocks (all zero when off).
    pub(super) fn resolved_tcache(&self, pcp: &PcpLimits) -> [usize; PCP_ORDERS] {
        let n = self.thread_cache_pages;
        std::array::from_fn(|o| {
            if n == 0 {
                0
            } else if o == 0 {
                n.min(pcp.high[0] * 2).max(2)
            } else {
                (n >> (o + 1)).clamp(2, pcp.high[o].max(2))
            }
        })
    }

    /// A handle's cache capacity per order, in blocks (all zero when
    /// thread caches are off).
    pub(super) fn resolved_local(
        &self,
        tcache: &[usize; PCP_ORDERS],
        nr_pages: usize,
    ) -> [usize; PCP_ORDERS] {
        let mut cap = *tcache;
        if cap[0] > 0 {
            cap[0] = self.local_cache_pages.min(nr_pages / 16).max(cap[0]);
        }
        cap
    }

    pub(super) fn validate(&self, nr_pages: usize) -> Result<()> {
        let cpus = self.resolved_cpus();
        if cpus == 0 || cpus > 4096 {
            return Err(Error::setting(
                "nr_cpus",
                cpus,
                "must be between 1 and 4096",
            ));
        }
        if self.thread_cache_pages > THREAD_CACHE_PAGES_MAX {
            return Err(Error::setting(
                "thread_cache_pages",
                self.thread_cache_pages,
                format!("must be at most {THREAD_CACHE_PAGES_MAX} (0 turns thread caches off)"),
            ));
        }
        if self.local_cache_pages > THREAD_CACHE_PAGES_MAX {
            return Err(Error::setting(
                "local_cache_pages",
                self.local_cache_pages,
                format!("must be at most {THREAD_CACHE_PAGES_MAX}"),
            ));
        }
        if let Some(d) = self.depot_pages {
            if d > nr_pages / 2 {
                return Err(Error::setting(
                    "depot_pages",
                    d,
                    format!("must be at most half the arena ({} pages)", nr_pages / 2),
                ));
            }
        }
        if let Some(w) = self.watermarks {
            if !(w.min <= w.low && w.low <= w.high && w.high < nr_pages) {
                return Err(Error::setting(
                    "watermarks",
                    format!("min {} low {} high {}", w.min, w.low, w.high),
                    format!("need min <= low <= high < {nr_pages} (the arena's pages)"),
                ));
            }
        }
        if let Some(l) = self.pcp {
            for o in 0..PCP_ORDERS {
                if l.high[o] == 0
                    || l.high[o] > PCP_HIGH_MAX
                    || l.batch[o] == 0
                    || l.batch[o] > l.high[o]
                {
                    return Err(Error::setting(
                        "pcp_limits",
                        format!("order {o}: high {} batch {}", l.high[o], l.batch[o]),
                        format!("need 1 <= batch <= high <= {PCP_HIGH_MAX}"),
                    ));
                }
            }
        }
        Ok(())
    }
}
