//! vmalloc: virtually contiguous buffers made of runs of arena frames.
//!
//! Owns: reserving a virtual range, mapping runs of physically contiguous
//! arena frames into it from the arena's memfd (one
//! `mmap(MAP_FIXED | MAP_SHARED)` per run), undoing both (`vfree`), the
//! bounded cache of freed areas kept mapped (the userspace form of lazy
//! vunmap) with the shrinker that purges it, and the budget of memory
//! mappings under `vm.max_map_count`. Must never: leave a frame allocated
//! or a mapping in place on a failure path; free a frame while it is still
//! mapped here; hold its cache lock while allocating pages (direct reclaim
//! may call its own shrinker); let the process reach `vm.max_map_count` —
//! it refuses first, with an error naming the limit.
//!
//! ## How an area is built
//!
//! ```text
//! frames   high orders first (NORETRY|NOWARN, no reclaim, started at the
//!          highest order the zone has free), then order-0 bulk, then single
//!          pages through the full path (reclaim, if the flags allow)
//! runs     every frame sorted by pfn, neighbours merged: fewer runs, fewer mmaps
//! reserve  mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE), pages + 1
//! map      per run: mmap(base + off, MAP_FIXED|MAP_SHARED, memfd, pfn × 4096)
//! guard    the last page stays PROT_NONE: an overrun faults, it never
//!          writes into a neighbour
//! ```
//!
//! The buffer aliases the arena: a byte written through the vmalloc'd slice
//! is the same byte as in the frame's direct-map address, and the other way
//! round. An area costs `runs + 1` memory mappings (VMAs).
//!
//! ## The lazy-area cache: frames and mapping are kept
//!
//! In the kernel, lazy vunmap frees the pages at once and defers only the
//! TLB flush. In userspace there is no such split: taking the frames away
//! from a range means replacing its mapping, which is the `munmap` (with
//! its TLB shootdown) that the cache exists to avoid. Keeping only the
//! virtual reservation would save one `mmap(PROT_NONE)` and none of the
//! per-run `mmap`s or the `munmap`. So a freed area is cached whole: frames
//! still allocated, runs still mapped, ready to be handed out again to a
//! request of the same page count with no system call at all (contents are
//! stale unless `Gfp::ZERO` is asked for, as with any vmalloc). The price is
//! memory held and VMAs kept, so the cache is bounded (areas and pages), a
//! [`Shrinker`] registered on the allocator purges it under memory pressure
//! (count = cached pages, scan = unmap and free, oldest first), the VMA
//! budget purges it before refusing, and [`Vmalloc::purge`] empties it.

use crate::{
    Backing, Error, Gfp, Page, PageAllocator, Result, Shrinker, ShrinkerId, MAX_ORDER, PAGE_SIZE,
};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// The kernel's default `vm.max_map_count`, used when
/// `/proc/sys/vm/max_map_count` cannot be read.
pub const DEFAULT_MAX_MAP_COUNT: usize = 65530;
/// One part in this many of `vm.max_map_count` is left to the rest of the
/// process (thread stacks, other allocators, io_uring rings); vmalloc
/// areas may use the remainder.
pub const VMA_HEADROOM_DIVISOR: usize = 16;
/// Inaccessible pages after each area.
pub const GUARD_PAGES: usize = 1;
/// Default most freed areas kept mapped for reuse.
pub const LAZY_MAX_AREAS: usize = 32;
/// Default most pages held by freed areas kept for reuse (32 MiB), further
/// bounded to an eighth of the arena.
pub const LAZY_MAX_PAGES: usize = 8192;
/// Order-0 pages asked for per bulk call.
const BULK_CHUNK: usize = 256;

/// VMAs held by every vmalloc area of the process (all [`Vmalloc`]s).
static PROCESS_MAPS: AtomicUsize = AtomicUsize::new(0);

/// Settings of a [`Vmalloc`]; `Default` gives the ones described per field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmallocConfig {
    /// Most memory mappings this instance may hold (default `None`: what
    /// `vm.max_map_count` leaves after the rest of the process and the
    /// headroom). Never more than that, whatever is asked.
    pub max_maps: Option<usize>,
    /// Use this instead of `/proc/sys/vm/max_map_count` (default `None`).
    /// Only a lower value takes effect: the kernel's limit is the real one.
    pub max_map_count: Option<usize>,
    /// Most freed areas kept mapped for reuse (default [`LAZY_MAX_AREAS`];
    /// 0 turns the cache off).
    pub cache_max_areas: usize,
    /// Most pages those areas may hold (default `None`: [`LAZY_MAX_PAGES`]
    /// or an eighth of the arena, whichever is smaller).
    pub cache_max_pages: Option<usize>,
}

impl Default for VmallocConfig {
    fn default() -> Self {
        VmallocConfig {
            max_maps: None,
            max_map_count: None,
            cache_max_areas: LAZY_MAX_AREAS,
            cache_max_pages: None,
        }
    }
}

/// One run of a vmalloc area: physically contiguous frames mapped with one
/// `mmap`, at the next virtual offset after the previous run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmRun {
    /// The first frame.
    pub page: Page,
    /// Frames in the run.
    pub nr_pages: usize,
}

/// Counters and current state of a [`Vmalloc`] (a racy snapshot).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmallocStats {
    /// Successful `vmalloc` calls (cache hits included).
    pub allocs: u64,
    /// `vmalloc` calls that returned an error.
    pub failures: u64,
    /// Buffers freed (to the cache or for good).
    pub frees: u64,
    /// `vmalloc` calls served by a cached area.
    pub cache_hits: u64,
    /// Areas in the cache now.
    pub cached_areas: usize,
    /// Pages those areas hold now.
    pub cached_pages: usize,
    /// Areas taken out of the cache and released (evicted, purged, shrunk).
    pub purged_areas: u64,
    /// Pages the shrinker freed.
    pub shrinker_pages: u64,
    /// Blocks of order ≥ 1 used for areas.
    pub high_order_blocks: u64,
    /// `mmap` calls made (reservations and runs).
    pub map_calls: u64,
    /// Nanoseconds spent in those calls.
    pub map_ns: u64,
    /// Areas unmapped (one `munmap` each).
    pub unmap_calls: u64,
    /// Nanoseconds spent unmapping.
    pub unmap_ns: u64,
    /// Requests refused by the VMA budget.
    pub budget_refusals: u64,
    /// Memory mappings this instance holds now (cached areas included).
    pub maps_held: usize,
    /// Its budget of memory mappings.
    pub max_maps: usize,
    /// `vm.max_map_count` as read (or as lowered by the configuration).
    pub max_map_count: usize,
}

/// A vmalloc area allocator over one [`PageAllocator`]: builds virtually
/// contiguous buffers ([`VmBox`]) out of any free frames. Cheap to clone
/// (clones share the cache and budget); `Send` and `Sync`.
///
/// It registers a shrinker on the allocator for its cache; the shrinker is
/// unregistered, and the cache emptied, when the last clone and the last
/// buffer are gone.
#[derive(Clone)]
pub struct Vmalloc {
    inner: Arc<Inner>,
}

struct Inner {
    alloc: PageAllocator,
    fd: RawFd,
    budget: Budget,
    cache: Mutex<VecDeque<Area>>,
    /// Pages in `cache`, readable without its lock (changed under it).
    cached_pages: AtomicUsize,
    cache_max_areas: usize,
    cache_max_pages: usize,
    shrinker: ShrinkerId,
    /// Mapping calls left to succeed before an injected failure; `u64::MAX`
    /// means off.
    map_fault: AtomicU64,
    c: Counters,
}

#[derive(Default)]
struct Counters {
    allocs: AtomicU64,
    failures: AtomicU64,
    frees: AtomicU64,
    cache_hits: AtomicU64,
    purged_areas: AtomicU64,
    shrinker_pages: AtomicU64,
    high_order_blocks: AtomicU64,
    map_calls: AtomicU64,
    map_ns: AtomicU64,
    unmap_calls: AtomicU64,
    unmap_ns: AtomicU64,
    budget_refusals: AtomicU64,
}

/// The memory-mapping budget.
struct Budget {
    /// `vm.max_map_count` (or the configured lower value).
    limit: usize,
    /// Mappings the rest of the process held when this instance was made.
    others: usize,
    /// Mappings left to the rest of the process to grow into.
    headroom: usize,
    /// What all vmalloc areas of the process may hold: limit − others − headroom.
    process_cap: usize,
    /// What this instance may hold.
    max_maps: usize,
    /// What this instance holds.
    held: AtomicUsize,
}

/// A mapped area and the frames behind it.
struct Area {
    base: *mut u8,
    nr_pages: usize,
    runs: Vec<VmRun>,
    /// Blocks of order ≥ 1, freed with their order.
    blocks: Vec<(Page, u32)>,
    /// Order-0 pages, freed in bulk.
    singles: Vec<Page>,
    /// Memory mappings charged to the budget for this area.
    maps: usize,
}

// SAFETY: an area's mapping is owned by the area alone (nothing else maps
// or unmaps that range), so moving it between threads is sound.
unsafe impl Send for Area {}
// SAFETY: shared access to an area only reads its bookkeeping or hands out
// `&[u8]` views; writes need `&mut` of the owning `VmBox`.
unsafe impl Sync for Area {}

impl Area {
    fn empty() -> Area {
        Area {
            base: std::ptr::null_mut(),
            nr_pages: 0,
            runs: Vec::new(),
            blocks: Vec::new(),
            singles: Vec::new(),
            maps: 0,
        }
    }
}

/// A virtually contiguous buffer from [`Vmalloc::vmalloc`]: `len()` bytes
/// at one address, backed by runs of arena frames. Freed (to the lazy
/// cache or for good) when dropped.
pub struct VmBox {
    vm: Arc<Inner>,
    area: Area,
    len: usize,
}

impl Vmalloc {
    /// A vmalloc allocator over `alloc` with the default settings.
    ///
    /// **Context:** reads `/proc/sys/vm/max_map_count` and
    /// `/proc/self/maps` once. **Returns:** as [`Vmalloc::with_config`].
    pub fn new(alloc: &PageAllocator) -> Result<Vmalloc> {
        Self::with_config(alloc, VmallocConfig::default())
    }

    /// A vmalloc allocator over `alloc` with `cfg`.
    ///
    /// **Context:** reads `/proc/sys/vm/max_map_count` and
    /// `/proc/self/maps` once, and registers a shrinker on `alloc`.
    /// **Returns:** `BadSetting` when the arena is backed by hugetlb pages
    /// (which cannot be mapped 4 KiB at a time), when `max_maps` is below 2,
    /// or when `vm.max_map_count` leaves no mappings for vmalloc.
    pub fn with_config(alloc: &PageAllocator, cfg: VmallocConfig) -> Result<Vmalloc> {
        let arena = alloc.arena();
        if arena.backing() == Backing::Hugetlb {
            return Err(Error::setting(
                "huge_pages",
                "hugetlb backing",
                "vmalloc maps single 4 KiB frames of the memfd elsewhere, which hugetlbfs \
                 forbids (2 MiB granularity); build the allocator with HugePages::Never",
            ));
        }
        if let Some(m) = cfg.max_maps {
            if m < 1 + GUARD_PAGES {
                return Err(Error::setting(
                    "max_maps",
                    m,
                    format!(
                        "an area needs at least {} mappings (one run and its guard page)",
                        1 + GUARD_PAGES
                    ),
                ));
            }
        }
        let budget = Budget::new(cfg.max_map_count, cfg.max_maps)?;
        let cache_max_pages = cfg
            .cache_max_pages
            .unwrap_or_else(|| LAZY_MAX_PAGES.min(arena.nr_pages() / 8));
        let fd = arena.fd();
        let inner = Arc::new_cyclic(|me: &Weak<Inner>| {
            let shrinker = alloc
                .shrinkers()
                .register(Arc::new(LazyAreaShrinker { vm: me.clone() }));
            Inner {
                alloc: alloc.clone(),
                fd,
                budget,
                cache: Mutex::new(VecDeque::new()),
                cached_pages: AtomicUsize::new(0),
                cache_max_areas: cfg.cache_max_areas,
                cache_max_pages,
                shrinker,
                map_fault: AtomicU64::new(u64::MAX),
                c: Counters::default(),
            }
        });
        Ok(Vmalloc { inner })
    }

    /// Allocate a virtually contiguous buffer of `size_bytes` (rounded up
    /// to whole pages behind the scenes): from the lazy cache if an area of
    /// the same page count is there, else from newly allocated frames
    /// (largest free blocks first, then order-0 pages in bulk), mapped run
    /// by run. `Gfp::ZERO` zeroes it; otherwise its contents are stale.
    ///
    /// **Context:** as `gfp` allows: high-order attempts never reclaim or
    /// block; order-0 pages are taken in bulk, and when the bulk path comes
    /// back empty a single page is asked for through the full path, which
    /// may run direct reclaim (this instance's own shrinker included) if
    /// `gfp` may block. Makes `runs + 1` `mmap` calls. **Returns:**
    /// `BadSetting` for a zero size or one larger than the arena;
    /// [`Error::NoMemory`] when pages run out or the VMA budget would be
    /// exceeded (the message names `vm.max_map_count`); [`Error::Os`] when
    /// `mmap` fails. Nothing stays allocated or mapped on any error. With
    /// `NOFAIL` the pages never run out (the single-page path waits for
    /// frees), but the VMA budget and `mmap` can still refuse.
    pub fn vmalloc(&self, size_bytes: usize, gfp: Gfp) -> Result<VmBox> {
        let r = self.inner.vmalloc(size_bytes, gfp);
        let c = &self.inner.c;
        match &r {
            Ok(_) => c.allocs.fetch_add(1, Relaxed),
            Err(_) => c.failures.fetch_add(1, Relaxed),
        };
        r.map(|area| VmBox {
            vm: Arc::clone(&self.inner),
            area,
            len: size_bytes,
        })
    }

    /// Free a buffer now (the same as dropping it): its area goes to the
    /// lazy cache if it fits there, else it is unmapped and its frames are
    /// freed in bulk.
    ///
    /// **Context:** never blocks on memory; may `munmap`.
    pub fn vfree(&self, buf: VmBox) {
        drop(buf);
    }

    /// Empty the lazy cache: unmap every cached area and free its frames.
    ///
    /// **Returns:** pages freed.
    pub fn purge(&self) -> usize {
        self.inner.purge_pages(usize::MAX)
    }

    /// Make the mapping step fail, as if `mmap` had returned `ENOMEM`,
    /// after `successes` more successful `mmap` calls (reservations and
    /// runs alike), once; `None` turns it off. Fault injection for the step
    /// that page allocation's [`crate::FaultInjector`] does not reach.
    pub fn fail_map_after(&self, successes: Option<u64>) {
        self.inner
            .map_fault
            .store(successes.map_or(u64::MAX, |n| n.min(u64::MAX - 1)), Relaxed);
    }

    /// The page allocator the frames come from.
    pub fn allocator(&self) -> &PageAllocator {
        &self.inner.alloc
    }

    /// Counters and the current cache and budget state.
    pub fn stats(&self) -> VmallocStats {
        let i = &*self.inner;
        let c = &i.c;
        let cached_areas = i.cache.lock().len();
        VmallocStats {
            allocs: c.allocs.load(Relaxed),
            failures: c.failures.load(Relaxed),
            frees: c.frees.load(Relaxed),
            cache_hits: c.cache_hits.load(Relaxed),
            cached_areas,
            cached_pages: i.cached_pages.load(Relaxed),
            purged_areas: c.purged_areas.load(Relaxed),
            shrinker_pages: c.shrinker_pages.load(Relaxed),
            high_order_blocks: c.high_order_blocks.load(Relaxed),
            map_calls: c.map_calls.load(Relaxed),
            map_ns: c.map_ns.load(Relaxed),
            unmap_calls: c.unmap_calls.load(Relaxed),
            unmap_ns: c.unmap_ns.load(Relaxed),
            budget_refusals: c.budget_refusals.load(Relaxed),
            maps_held: i.budget.held.load(Relaxed),
            max_maps: i.budget.max_maps,
            max_map_count: i.budget.limit,
        }
    }
}

impl Inner {
    fn vmalloc(&self, size_bytes: usize, gfp: Gfp) -> Result<Area> {
        let nr = self.check_size(size_bytes)?;
        if let Some(area) = self.cache_take(nr) {
            self.c.cache_hits.fetch_add(1, Relaxed);
            if gfp.contains(Gfp::ZERO) {
                zero(&area);
            }
            return Ok(area);
        }
        let frames = self.alloc_frames(nr, gfp, size_bytes)?;
        let runs = build_runs(&frames.blocks, &frames.singles);
        let maps = runs.len() + GUARD_PAGES;
        self.charge(maps, size_bytes)?;
        let base = match self.map(nr, &runs) {
            Ok(b) => b,
            Err(e) => {
                self.uncharge(maps);
                return Err(e);
            }
        };
        self.c
            .high_order_blocks
            .fetch_add(frames.blocks.len() as u64, Relaxed);
        let (blocks, singles) = frames.into_parts();
        let area = Area {
            base,
            nr_pages: nr,
            runs,
            blocks,
            singles,
            maps,
        };
        if gfp.contains(Gfp::ZERO) {
            zero(&area);
        }
        Ok(area)
    }

    /// Pages for `size_bytes`, or why not.
    fn check_size(&self, size_bytes: usize) -> Result<usize> {
        let arena_bytes = self.alloc.arena().size_bytes();
        if size_bytes == 0 {
            return Err(Error::setting(
                "size_bytes",
                0,
                "vmalloc of zero bytes: ask for at least one byte",
            ));
        }
        if size_bytes > arena_bytes {
            return Err(Error::setting(
                "size_bytes",
                size_bytes,
                format!(
                    "larger than the whole arena ({arena_bytes} bytes); no vmalloc this \
                     large can succeed — build a larger arena or ask for less"
                ),
            ));
        }
        Ok(size_bytes.div_ceil(PAGE_SIZE))
    }

    /// Allocate `nr` frames: the largest blocks to be had without reclaim
    /// first, then order-0 pages in bulk, then single pages through the
    /// full path. Everything is freed again if it falls short.
    fn alloc_frames(&self, nr: usize, gfp: Gfp, size_bytes: usize) -> Result<Frames<'_>> {
        let alloc = &self.alloc;
        let mut f = Frames {
            alloc,
            blocks: Vec::new(),
            singles: Vec::new(),
        };
        let mut left = nr;
        if nr >= 2 {
            // Opportunistic: no reclaim of any kind, not even a wake-up of
            // background reclaim — order-0 pages serve the request as well.
            let opportunistic = Gfp::NOWARN | Gfp::NORETRY | (gfp & Gfp::MOVABLE);
            let free = alloc.stats().free_blocks_by_order;
            let top = free.iter().rposition(|&n| n > 0).unwrap_or(0) as u32;
            let mut order = floor_log2(left).min(top).min(MAX_ORDER);
            while order >= 1 && left >= 2 {
                if 1usize << order > left {
                    order = floor_log2(left);
                    continue;
                }
                match alloc.alloc_pages(opportunistic, order) {
                    Some(p) => {
                        f.blocks.push((p, order));
                        left -= 1 << order;
                    }
                    None => order -= 1,
                }
            }
        }
        // ZERO is done once through the new mapping; COMP means nothing here.
        let page_gfp = gfp.difference(Gfp::ZERO | Gfp::COMP);
        let mut slots = vec![None; left.min(BULK_CHUNK)];
        f.singles.reserve(left);
        while left > 0 {
            let want = left.min(BULK_CHUNK);
            let chunk = &mut slots[..want];
            alloc.alloc_pages_bulk_array(page_gfp, chunk);
            let before = f.singles.len();
            f.singles.extend(chunk.iter_mut().filter_map(Option::take));
            let got = f.singles.len() - before;
            left -= got;
            if got == 0 {
                // The bulk path does not reclaim; the single-page path does,
                // if the flags allow it.
                match alloc.alloc_pages(page_gfp, 0) {
                    Some(p) => {
                        f.singles.push(p);
                        left -= 1;
                    }
                    None => {
                        return Err(Error::NoMemory(format!(
                            "vmalloc of {size_bytes} bytes under {gfp:?}: {left} of its {nr} \
                             pages could not be allocated (everything taken was freed again); \
                             free memory, allow direct reclaim (Gfp::KERNEL) or ask for less"
                        )))
                    }
                }
            }
        }
        Ok(f)
    }

    /// Reserve a range for `nr` pages and its guard, and map `runs` into it.
    fn map(&self, nr: usize, runs: &[VmRun]) -> Result<*mut u8> {
        let bytes = (nr + GUARD_PAGES) * PAGE_SIZE;
        let start = Instant::now();
        self.injected_map_fault("mmap(PROT_NONE) reserving a vmalloc area")?;
        // SAFETY: a new private anonymous mapping at an address the kernel
        // chooses; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::os(format!(
                "mmap(PROT_NONE, {bytes} bytes) reserving a vmalloc area"
            )));
        }
        let base = base.cast::<u8>();
        let mut off = 0;
        for run in runs {
            let len = run.nr_pages * PAGE_SIZE;
            let at = base.wrapping_add(off);
            let mapped = self
                .injected_map_fault("mmap(MAP_FIXED|MAP_SHARED) of a run into a vmalloc area")
                .and_then(|()| {
                    // SAFETY: `at..at + len` lies inside the reservation made
                    // above (runs add up to `nr` pages), which only this call
                    // uses; MAP_FIXED replaces nothing but our own PROT_NONE
                    // pages with frames of the arena's memfd.
                    let p = unsafe {
                        libc::mmap(
                            at.cast(),
                            len,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_SHARED | libc::MAP_FIXED,
                            self.fd,
                            run.page.pfn() as libc::off_t * PAGE_SIZE as libc::off_t,
                        )
                    };
                    if p == libc::MAP_FAILED {
                        return Err(Error::os(format!(
                            "mmap(MAP_FIXED|MAP_SHARED) of {} frames at pfn {} into a vmalloc area",
                            run.nr_pages,
                            run.page.pfn()
                        )));
                    }
                    debug_assert_eq!(p.cast::<u8>(), at);
                    Ok(())
                });
            if let Err(e) = mapped {
                // SAFETY: the whole reservation is ours; unmapping it removes
                // every run mapped so far and the rest of the reservation.
                unsafe { libc::munmap(base.cast(), bytes) };
                return Err(e);
            }
            off += len;
        }
        self.c.map_calls.fetch_add(runs.len() as u64 + 1, Relaxed);
        self.c
            .map_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
        Ok(base)
    }

    /// An injected mapping failure, if one is due now.
    fn injected_map_fault(&self, call: &str) -> Result<()> {
        let due = self
            .map_fault
            .fetch_update(Relaxed, Relaxed, |n| match n {
                u64::MAX => None,
                0 => Some(u64::MAX),
                n => Some(n - 1),
            })
            .is_ok_and(|n| n == 0);
        if due {
            return Err(Error::Os {
                call: format!("{call} (injected failure)"),
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        Ok(())
    }

    /// Charge `need` mappings to the budget, purging the cache once if that
    /// makes room.
    fn charge(&self, need: usize, size_bytes: usize) -> Result<()> {
        let mut refusal = match self.budget.try_charge(need) {
            Ok(()) => return Ok(()),
            Err(why) => why,
        };
        if self.purge_pages(usize::MAX) > 0 {
            match self.budget.try_charge(need) {
                Ok(()) => return Ok(()),
                Err(why) => refusal = why,
            }
        }
        self.c.budget_refusals.fetch_add(1, Relaxed);
        let b = &self.budget;
        Err(Error::NoMemory(format!(
            "vmalloc of {size_bytes} bytes needs {need} memory mappings (one per run of \
             contiguous frames, plus a guard page), but {refusal}; vm.max_map_count = {} \
             ({} mappings held by the rest of the process when this vmalloc was set up, {} \
             kept for it to grow). Free vmalloc'd buffers, allocate from a less fragmented \
             arena (fewer, longer runs), or raise the limit: sysctl -w vm.max_map_count=N",
            b.limit, b.others, b.headroom
        )))
    }

    fn uncharge(&self, maps: usize) {
        self.budget.uncharge(maps);
    }

    /// Take a cached area of exactly `nr` pages, most recently freed first.
    fn cache_take(&self, nr: usize) -> Option<Area> {
        if self.cached_pages.load(Relaxed) < nr {
            return None;
        }
        let mut c = self.cache.lock();
        let i = c.iter().rposition(|a| a.nr_pages == nr)?;
        let area = c.remove(i)?;
        self.cached_pages.fetch_sub(nr, Relaxed);
        Some(area)
    }

    /// Take a freed area: into the cache if it fits (evicting the oldest
    /// beyond the bounds), else release it now.
    fn vfree_area(&self, area: Area) {
        self.c.frees.fetch_add(1, Relaxed);
        if self.cache_max_areas == 0 || area.nr_pages > self.cache_max_pages {
            self.release(area);
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut c = self.cache.lock();
            let mut pages = self.cached_pages.load(Relaxed) + area.nr_pages;
            c.push_back(area);
            while c.len() > self.cache_max_areas || pages > self.cache_max_pages {
                let old = c.pop_front().expect("the cache is not empty");
                pages -= old.nr_pages;
                evicted.push(old);
            }
            self.cached_pages.store(pages, Relaxed);
        }
        for a in evicted {
            self.c.purged_areas.fetch_add(1, Relaxed);
            self.release(a);
        }
    }

    /// Release cached areas, oldest first, until `nr_wanted` pages are
    /// freed or the cache is empty. Returns pages freed.
    fn purge_pages(&self, nr_wanted: usize) -> usize {
        let mut taken = Vec::new();
        let mut pages = 0;
        {
            let mut c = self.cache.lock();
            while pages < nr_wanted {
                let Some(a) = c.pop_front() else { break };
                pages += a.nr_pages;
                taken.push(a);
            }
            self.cached_pages.fetch_sub(pages, Relaxed);
        }
        self.c.purged_areas.fetch_add(taken.len() as u64, Relaxed);
        for a in taken {
            self.release(a);
        }
        pages
    }

    /// Unmap an area, give its mappings back to the budget and free its
    /// frames — in that order, so that no freed frame is still mapped.
    fn release(&self, area: Area) {
        let bytes = (area.nr_pages + GUARD_PAGES) * PAGE_SIZE;
        let start = Instant::now();
        // SAFETY: `base..base + bytes` is exactly the area's reservation,
        // which this area owns; nothing refers to it any more (its VmBox is
        // gone or it was taken out of the cache).
        let rc = unsafe { libc::munmap(area.base.cast(), bytes) };
        if rc != 0 {
            // Never free frames that are still mapped: leak them instead.
            log::error!(
                "iopages: munmap of a {bytes}-byte vmalloc area failed ({}); its {} frames \
                 stay allocated",
                io::Error::last_os_error(),
                area.nr_pages
            );
            return;
        }
        self.c
            .unmap_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
        self.c.unmap_calls.fetch_add(1, Relaxed);
        self.uncharge(area.maps);
        // SAFETY: the area owned its frames, and its mapping is gone (the
        // munmap above succeeded), so nothing reaches them any more.
        unsafe {
            for &(p, order) in &area.blocks {
                self.alloc.free_pages(p, order);
            }
            if !area.singles.is_empty() {
                self.alloc.free_pages_bulk(&area.singles);
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.alloc.shrinkers().unregister(self.shrinker);
        self.purge_pages(usize::MAX);
        debug_assert_eq!(
            self.budget.held.load(Relaxed),
            0,
            "a vmalloc instance is gone with mappings still charged"
        );
    }
}

impl Budget {
    fn new(max_map_count: Option<usize>, max_maps: Option<usize>) -> Result<Budget> {
        let sysctl = read_max_map_count();
        let limit = max_map_count.map_or(sysctl, |m| m.min(sysctl));
        let others = count_maps().saturating_sub(PROCESS_MAPS.load(Relaxed));
        let headroom = limit / VMA_HEADROOM_DIVISOR;
        let process_cap = limit.saturating_sub(others + headroom);
        if process_cap < 1 + GUARD_PAGES {
            return Err(Error::setting(
                "vm.max_map_count",
                limit,
                format!(
                    "leaves no memory mappings for vmalloc: the process holds {others} and \
                     {headroom} are kept for it to grow; raise it (sysctl -w vm.max_map_count=N)"
                ),
            ));
        }
        Ok(Budget {
            limit,
            others,
            headroom,
            process_cap,
            max_maps: max_maps.map_or(process_cap, |m| m.min(process_cap)),
            held: AtomicUsize::new(0),
        })
    }

    /// Take `need` mappings from this instance's budget and the process's;
    /// on refusal, say which was short.
    fn try_charge(&self, need: usize) -> std::result::Result<(), String> {
        if let Err(held) = self.held.fetch_update(Relaxed, Relaxed, |h| {
            (h + need <= self.max_maps).then_some(h + need)
        }) {
            return Err(format!(
                "this vmalloc holds {held} of its budget of {} (max_maps)",
                self.max_maps
            ));
        }
        if let Err(all) = PROCESS_MAPS.fetch_update(Relaxed, Relaxed, |g| {
            (g + need <= self.process_cap).then_some(g + need)
        }) {
            self.held.fetch_sub(need, Relaxed);
            return Err(format!(
                "the process's vmalloc areas hold {all} of the {} the limit leaves them",
                self.process_cap
            ));
        }
        Ok(())
    }

    fn uncharge(&self, maps: usize) {
        self.held.fetch_sub(maps, Relaxed);
        PROCESS_MAPS.fetch_sub(maps, Relaxed);
    }
}

/// The shrinker of one instance's lazy cache. Holds the instance weakly,
/// so that the allocator's registry does not keep it alive.
struct LazyAreaShrinker {
    vm: Weak<Inner>,
}

impl Shrinker for LazyAreaShrinker {
    fn name(&self) -> &str {
        "vmalloc-lazy-areas"
    }

    fn count_objects(&self) -> usize {
        self.vm
            .upgrade()
            .map_or(0, |vm| vm.cached_pages.load(Relaxed))
    }

    fn scan_objects(&self, nr_to_scan: usize) -> usize {
        let Some(vm) = self.vm.upgrade() else {
            return 0;
        };
        let freed = vm.purge_pages(nr_to_scan);
        vm.c.shrinker_pages.fetch_add(freed as u64, Relaxed);
        freed
    }
}

/// Frames being gathered for an area; freed on drop unless taken.
struct Frames<'a> {
    alloc: &'a PageAllocator,
    blocks: Vec<(Page, u32)>,
    singles: Vec<Page>,
}

impl Frames<'_> {
    fn into_parts(mut self) -> (Vec<(Page, u32)>, Vec<Page>) {
        (
            std::mem::take(&mut self.blocks),
            std::mem::take(&mut self.singles),
        )
    }
}

impl Drop for Frames<'_> {
    fn drop(&mut self) {
        // SAFETY: `Frames` owns the frames it allocated until `take` hands
        // them to an area (which empties it); what is left is unmapped and
        // reachable from nowhere else.
        unsafe {
            for &(p, order) in &self.blocks {
                self.alloc.free_pages(p, order);
            }
            if !self.singles.is_empty() {
                self.alloc.free_pages_bulk(&self.singles);
            }
        }
    }
}

impl VmBox {
    /// Bytes in the buffer (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Frames behind the buffer (`len()` rounded up to pages).
    pub fn nr_pages(&self) -> usize {
        self.area.nr_pages
    }

    /// Runs of contiguous frames, in virtual order (one `mmap` each).
    pub fn nr_runs(&self) -> usize {
        self.area.runs.len()
    }

    /// The runs, in virtual order.
    pub fn runs(&self) -> &[VmRun] {
        &self.area.runs
    }

    /// Every frame, in virtual order: page `i` of the buffer is frame
    /// `pages()[i]`.
    pub fn pages(&self) -> Vec<Page> {
        let mut v = Vec::with_capacity(self.area.nr_pages);
        for r in &self.area.runs {
            v.extend((r.page.pfn()..r.page.pfn() + r.nr_pages as u32).map(Page::from_pfn));
        }
        v
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.area.base
    }

    /// Start of the buffer, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.area.base
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `base..base + len` is mapped read/write to frames this
        // buffer owns for its whole life; writes need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.area.base, self.len) }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.area.base, self.len) }
    }
}

impl std::fmt::Debug for VmBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmBox")
            .field("addr", &self.area.base)
            .field("len", &self.len)
            .field("nr_pages", &self.area.nr_pages)
            .field("nr_runs", &self.area.runs.len())
            .finish()
    }
}

impl Drop for VmBox {
    fn drop(&mut self) {
        let area = std::mem::replace(&mut self.area, Area::empty());
        self.vm.vfree_area(area);
    }
}

/// Zero every page of `area` through its mapping.
fn zero(area: &Area) {
    // SAFETY: the area's `nr_pages` pages are mapped read/write and owned
    // by the caller, who has not handed the area out yet.
    unsafe { std::ptr::write_bytes(area.base, 0, area.nr_pages * PAGE_SIZE) };
}

/// Sort the frames by pfn and merge neighbours into runs.
fn build_runs(blocks: &[(Page, u32)], singles: &[Page]) -> Vec<VmRun> {
    let mut extents: Vec<(u32, usize)> = blocks
        .iter()
        .map(|&(p, o)| (p.pfn(), 1usize << o))
        .chain(singles.iter().map(|p| (p.pfn(), 1)))
        .collect();
    extents.sort_unstable_by_key(|e| e.0);
    let mut runs: Vec<VmRun> = Vec::new();
    for (pfn, n) in extents {
        match runs.last_mut() {
            Some(r) if r.page.pfn() as usize + r.nr_pages == pfn as usize => r.nr_pages += n,
            _ => runs.push(VmRun {
                page: Page::from_pfn(pfn),
                nr_pages: n,
            }),
        }
    }
    runs
}

/// log2 of `n` rounded down (`n >= 1`).
fn floor_log2(n: usize) -> u32 {
    usize::BITS - 1 - n.leading_zeros()
}

/// `vm.max_map_count`, or the kernel's default if it cannot be read.
fn read_max_map_count() -> usize {
    match std::fs::read_to_string("/proc/sys/vm/max_map_count") {
        Ok(s) => s.trim().parse().unwrap_or(DEFAULT_MAX_MAP_COUNT),
        Err(e) => {
            log::warn!(
                "iopages: cannot read /proc/sys/vm/max_map_count ({e}); assuming {DEFAULT_MAX_MAP_COUNT}"
            );
            DEFAULT_MAX_MAP_COUNT
        }
    }
}

/// Memory mappings the process holds now (lines of `/proc/self/maps`).
fn count_maps() -> usize {
    match std::fs::read("/proc/self/maps") {
        Ok(b) => count_lines(&b),
        Err(e) => {
            log::warn!("iopages: cannot read /proc/self/maps ({e}); assuming no mappings");
            0
        }
    }
}

fn count_lines(b: &[u8]) -> usize {
    b.iter().filter(|&&c| c == b'\n').count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HugePages;

    fn alloc(mib: u64) -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(mib << 20)
            .huge_pages(HugePages::Never)
            .build()
            .unwrap()
    }

    fn p(pfn: u32) -> Page {
        Page::from_pfn(pfn)
    }

    #[test]
    fn runs_merge_neighbours_in_pfn_order() {
        let runs = build_runs(&[(p(8), 2), (p(0), 1)], &[p(2), p(12), p(13), p(7), p(20)]);
        let got: Vec<(u32, usize)> = runs.iter().map(|r| (r.page.pfn(), r.nr_pages)).collect();
        assert_eq!(got, vec![(0, 3), (7, 7), (20, 1)]);
        assert!(build_runs(&[], &[]).is_empty());
    }

    #[test]
    fn helpers() {
        assert_eq!(floor_log2(1), 0);
        assert_eq!(floor_log2(1023), 9);
        assert_eq!(floor_log2(1024), 10);
        assert_eq!(count_lines(b"a\nb\n"), 2);
        assert!(read_max_map_count() > 0);
        assert!(count_maps() > 0);
    }

    #[test]
    fn budget_charges_and_refuses_per_instance() {
        let b = Budget::new(None, Some(5)).unwrap();
        assert_eq!(b.max_maps, 5);
        b.try_charge(3).unwrap();
        let why = b.try_charge(3).unwrap_err();
        assert!(why.contains("budget of 5"), "{why}");
        b.try_charge(2).unwrap();
        b.uncharge(5);
        assert_eq!(b.held.load(Relaxed), 0);
        assert!(
            Budget::new(Some(3), None).is_err(),
            "a tiny limit is refused"
        );
    }

    #[test]
    fn a_fresh_arena_gives_few_runs_and_the_cache_reuses_them() {
        let a = alloc(16);
        let vm = Vmalloc::new(&a).unwrap();
        let mut b = vm.vmalloc(300 * PAGE_SIZE - 5, Gfp::KERNEL).unwrap();
        assert_eq!(b.nr_pages(), 300);
        // 256 pages from the buddy, 32 + 8 + 4 from the per-CPU lists.
        assert!(b.nr_runs() <= 4, "{b:?}");
        b.as_mut_slice().fill(7);
        let addr = b.as_ptr();
        drop(b);
        let b = vm
            .vmalloc(300 * PAGE_SIZE, Gfp::KERNEL | Gfp::ZERO)
            .unwrap();
        assert_eq!(b.as_ptr(), addr, "same page count: the cached area");
        assert_eq!(vm.stats().cache_hits, 1);
        assert!(b.as_slice().iter().all(|&x| x == 0), "ZERO on a cache hit");
        drop(b);
        assert_eq!(vm.purge(), 300);
        assert_eq!(vm.stats().maps_held, 0);
        drop(vm);
        assert_eq!(a.shrinkers().len(), 0);
        assert!(a.leak_check().is_ok());
    }

    #[test]
    fn injected_map_fault_fires_once() {
        let a = alloc(4);
        let vm = Vmalloc::new(&a).unwrap();
        vm.fail_map_after(Some(1));
        assert!(vm.inner.injected_map_fault("x").is_ok());
        let e = vm.inner.injected_map_fault("x").unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        assert!(vm.inner.injected_map_fault("x").is_ok());
    }
}
