//! # iopages — the kernel's I/O memory machinery, in userspace
//!
//! iopages gives userspace I/O engines (block devices, encryption layers,
//! databases, data planes) the memory system the Linux kernel gives its own
//! I/O paths: a page allocator with per-CPU lists and a bulk API, mempools
//! that guarantee forward progress (bulk too), per-CPU counters whose rough
//! reads never contend, large folios with folio-aware I/O vectors (bios),
//! kvmalloc with a real fail-fast path, and the reclaim (shrinkers,
//! background reclaim) and compaction behind it.
//!
//! ## Map: kernel mechanism → module
//!
//! Every module, by layer from the bottom (each names only the layers
//! below it; `docs/architecture.md` has the rule and what enforces it).
//!
//! | kernel | here | file |
//! |---|---|---|
//! | *foundations* | | |
//! | `gfp_t`, `memalloc_noio_save` | [`Gfp`], [`memalloc_noio_scope`] | `gfp.rs` |
//! | `fail_page_alloc` | [`FaultInjector`] | `fault.rs` |
//! | — (errors that name the setting and what would work) | [`Error`] | `error.rs` |
//! | — (loom shims: every trait a concurrent core is generic over) | | `sync.rs` |
//! | *buddy: physical memory and the buddy allocator* | | `buddy/` |
//! | physical memory, direct map | one memfd mapped once ([`Arena`]) | `buddy/arena.rs` |
//! | `struct page` | 16-byte [`Frame`] records, [`Page`] handles, [`flags`] | `buddy/frame.rs` |
//! | buddy allocator, watermarks, grouping by mobility (`mm/page_alloc.c`) | [`Zone`], [`Watermarks`], [`MigrateType`] | `buddy/zone.rs` |
//! | — (transfer cache) | a lock-free ring of order-0 magazines between threads | `buddy/depot.rs` |
//! | *percpu: caches in front of the zone* | | `percpu/` |
//! | `per_cpu_pages` (orders 0..=3, `high`, `batch`) | per-CPU stacks, [`PcpLimits`] | `percpu/pcp.rs` |
//! | the per-CPU lists' lock (try-only since Linux 6.0) | a compare-and-swap try-lock | `percpu/trylock.rs` |
//! | — (userspace only) | per-thread magazines in front of the per-CPU lists | `percpu/tcache.rs` |
//! | `smp_processor_id`, `nr_cpu_ids` | which CPU, how many | `percpu/cpu.rs` |
//! | *reclaim: getting memory back* | | `reclaim/` |
//! | shrinkers, direct reclaim | [`Shrinker`], [`ShrinkerRegistry`] | `reclaim/shrinker.rs` |
//! | `kswapd` (background reclaim) | a thread per allocator, [`PageAllocator::kswapd_stats`] | `reclaim/kswapd.rs` |
//! | compaction (`mm/compaction.c`), `movable_operations` | migrate and free scanners, [`MovableOwner`] callbacks, [`PageAllocator::compact`] | `reclaim/compaction.rs` |
//! | *page_alloc: the allocator* | | `page_alloc/` |
//! | `alloc_pages`, `free_pages` (the handle, its state) | [`PageAllocator`] | `page_alloc/mod.rs` |
//! | the per-CPU fast path, `prep_new_page`, `free_pages_prepare` | | `page_alloc/fastpath.rs` |
//! | `rmqueue_bulk`, `free_pcppages_bulk`, `drain_all_pages` | | `page_alloc/lists.rs` |
//! | `__alloc_pages_bulk` | the array, list and callback forms | `page_alloc/bulk.rs` |
//! | `get_page_from_freelist`, `__alloc_pages_slowpath` | | `page_alloc/slowpath.rs` |
//! | — (safe owner of a block) | [`PageBox`] | `page_alloc/pagebox.rs` |
//! | — (DPDK's per-lcore cache, SPDK's iobuf channel) | [`LocalAllocator`] | `page_alloc/local.rs` |
//! | boot-time sizing (`setup_per_zone_wmarks`, `pcp` high/batch) | [`PageAllocatorBuilder`] | `page_alloc/builder.rs` |
//! | `/proc/vmstat` | [`Stats`], [`Accounting`] | `page_alloc/stats.rs` |
//! | *consumers: the public API only* | | |
//! | page cache (clean pages, shrinker, movable) | [`PageCache`] | `pagecache.rs` |
//! | folios, `_pincount`, `pin_user_pages` | [`Folio`], [`FolioBuffer`], [`PageSlots`], [`PageAllocator::pin_folio`] | `folio.rs` |
//! | `struct bio`, `bio_add_page`, `bio_iov_iter_get_pages` | [`Bio`], [`BioVec`], [`BioLimits`] | `bio.rs` |
//! | `memcpy_to_page`, `memcpy_from_page` | bounds-checked copies into a [`PageBox`] | `page_io.rs` |
//! | `vmalloc`, `vmap`, lazy vunmap | [`Vmalloc`], [`VmBox`] | `vmalloc.rs` |
//! | `kvmalloc` / `kvfree` | [`Kvmalloc`], [`KvPolicy`], [`KvBox`] | `kvmalloc.rs` |
//! | `mm/mempool.c` (incl. `mempool_alloc_bulk`) | [`Mempool`], [`PagePool`], [`ElementSource`] | `mempool.rs` |
//! | `lib/percpu_counter.c` | [`PercpuCounter`] | `percpu_counter.rs` |
//!
//! Public paths: every public item is reached from the crate root
//! (`iopages::PageBox`); the modules are private.
//!
//! ## Implementation notes
//!
//! A [`Page`] is a frame number (4 bytes; `Option<Page>` too). The hot path
//! passes these plain handles around and never touches frame metadata: a
//! free block on a per-CPU list or in a thread cache is just its number in
//! an array. Only the zone writes metadata (its free lists are linked
//! through the frames), plus allocation checks, `ZERO` and `COMP` when asked.
//!
//! A worker that allocates in a loop holds a [`LocalAllocator`] (from
//! [`PageAllocator::local`]): its own cache, no thread-local lookup, the
//! per-call checks folded into one mask, so the fast path is a length check
//! and a copy. Freed pages travel between threads' caches as whole
//! magazines through a lock-free depot (one compare-and-swap per batch).
//!
//! Single-page allocation pops from the calling thread's cache: no lock, no
//! atomic read-modify-write, no CPU lookup. When the cache is empty it
//! takes half a cache from this CPU's list under a try-lock (a thread can
//! migrate at any instant, so "this CPU's" lock may be held by another
//! thread; then the zone is used directly). The per-CPU list refills from
//! the zone a batch at a time under one zone-lock hold. Frees mirror this.
//! Bulk calls take the thread cache and the per-CPU list once per batch.
//!
//! ```
//! use iopages::{Gfp, PageAllocator};
//! let alloc = PageAllocator::new(8 << 20).unwrap();
//! // The safe owner: freed when dropped.
//! let mut block = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
//! block.as_mut_slice()[0] = 1;
//! drop(block);
//! // The kernel-shaped calls on plain handles: frees are `unsafe`,
//! // because a `Page` is a copyable number and the caller vouches that
//! // nothing else owns it.
//! let page = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
//! // SAFETY: `page` was just allocated and nothing else holds it.
//! unsafe { alloc.free_pages(page, 0) };
//! let mut slots = [None; 16];
//! assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 16);
//! let pages: Vec<_> = slots.iter().flatten().copied().collect();
//! // SAFETY: as above, each page once.
//! unsafe { alloc.free_pages_bulk(&pages) };
//! let mut local = alloc.local();
//! let mut batch = Vec::with_capacity(32);
//! assert_eq!(local.alloc_bulk(Gfp::KERNEL, 32, &mut batch), 32);
//! // SAFETY: as above.
//! unsafe { local.free_bulk(&mut batch) };
//! drop(local);
//! assert!(alloc.leak_check().is_ok());
//! ```
//!
//! ## Requirements
//!
//! Linux only: the arena is one `memfd_create` mapping. Huge pages are
//! used when asked for ([`HugePages`]): hugetlbfs pages need a reserve
//! (`vm.nr_hugepages`), otherwise base pages with `MADV_HUGEPAGE`. No
//! cargo features, no C dependencies. Rust 1.80 or later (`rust-version`);
//! only the current stable toolchain is tested.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

// Foundations: used by every layer, use none.
mod error;
mod fault;
mod gfp;
mod sync;

// The allocator's layers, bottom to top: buddy, percpu, reclaim,
// page_alloc (see the map above and docs/architecture.md). Each names only
// the layers below it.
mod buddy;
mod page_alloc;
mod percpu;
mod reclaim;

// Consumers: built on the public API only.
mod bio;
mod folio;
mod kvmalloc;
mod mempool;
mod page_io;
mod pagecache;
mod percpu_counter;
mod vmalloc;

pub use bio::{Bio, BioError, BioLimits, BioVec};
pub use buddy::arena::{Arena, Backing, HugePages};
pub use buddy::frame::{flags, Frame, FrameInfo, Page, MAX_ORDER, PAGE_SIZE};
pub use buddy::zone::{MigrateType, Watermarks, Zone, PAGEBLOCK_NR_PAGES, PAGEBLOCK_ORDER};
pub use error::{Error, Result};
pub use fault::{FaultConfig, FaultInjector};
pub use folio::{Folio, FolioBuffer, PageSlots};
pub use gfp::{memalloc_nofs_scope, memalloc_noio_scope, Gfp, NofsScope, NoioScope};
pub use kvmalloc::{KvBox, KvKind, KvPolicy, KvStats, Kvmalloc};
pub use mempool::{
    BoxSource, ElementSource, Mempool, MempoolStats, OwnedElements, PagePool, PageSource,
    MEMPOOL_MIN_NR_MAX, MEMPOOL_WAIT,
};
pub use page_alloc::{
    Accounting, LocalAllocator, LocalFastPath, PageAllocator, PageAllocatorBuilder, PageBox, Stats,
    DEFAULT_ARENA_BYTES, DEFAULT_LOCAL_CACHE_PAGES, DEFAULT_THREAD_CACHE_PAGES,
    MAX_RECLAIM_RETRIES, NOFAIL_WAIT,
};
pub use pagecache::{PageCache, PageCacheConfig, PageCacheStats};
pub use percpu::pcp::PcpLimits;
pub use percpu_counter::{
    default_batch, PercpuCounter, PercpuCounterStats, PERCPU_BATCH_MAX, PERCPU_SLOTS_MAX,
};
pub use reclaim::compaction::{
    CompactResult, MovableOwner, MovableOwnerId, MovableRegistry, MAX_MOVABLE_OWNERS,
};
pub use reclaim::shrinker::{Shrinker, ShrinkerId, ShrinkerRegistry};
pub use vmalloc::{
    VmBox, VmRun, Vmalloc, VmallocConfig, VmallocStats, DEFAULT_MAX_MAP_COUNT, GUARD_PAGES,
    LAZY_MAX_AREAS, LAZY_MAX_PAGES, VMA_HEADROOM_DIVISOR,
};
