//! The page allocator: creation, pages by handle and by address, bulk
//! calls, the per-thread handle, statistics and the leak check.

use crate::{
    fail, gfp, guard, guard_int, guard_long, iopages_page, obj, obj_mut, put, slice, slice_mut,
};
use iopages::{
    Gfp, HugePages, LocalAllocator, Page, PageAllocator, PageAllocatorBuilder, MAX_ORDER, PAGE_SIZE,
};
use std::ffi::{c_char, c_int, c_void};
use std::fmt::Write as _;

/// The allocator: an arena (one memfd mapped once), its buddy zone,
/// per-CPU lists and per-thread caches.
///
/// **Thread safety:** every call on an allocator may be made from any
/// number of threads at once, except `iopages_allocator_destroy`.
pub struct iopages_allocator {
    pub(crate) alloc: PageAllocator,
}

/// A per-thread allocation handle with its own page cache: the lean path
/// for a worker that allocates and frees in a loop (no thread-local lookup
/// per call).
///
/// **Thread safety:** one thread at a time (it may move between threads,
/// but two threads must never use it at once).
pub struct iopages_local {
    local: LocalAllocator,
    scratch: Vec<Page>,
    nr_pages: u32,
    base: usize,
    /// The view the header's inline functions use (filled once, from the
    /// pointer `iopages_local_create` hands out).
    fast: iopages_local_fast,
}

/// The state of a handle's fast paths, for the inline functions below
/// (`iopages_fast_*`), which serve the handle's cache without a call into
/// the library — as DPDK's header inlines `rte_mempool_get_bulk` over its
/// per-lcore cache. Get it once per handle with `iopages_local_fast_path`;
/// it is valid until the handle is destroyed, and belongs to the handle's
/// thread, like the handle. Read-only for callers: the inline functions
/// are the only code meant to follow its pointers. The length is the
/// handle's shared record (other threads read it for the accounting): the
/// handle's thread is its only writer, and loads and stores it with
/// relaxed atomics. Inline hits count nothing (the library counts them
/// only when built to count every call, and then serves every call).
///
/// The view never changes after `iopages_local_create`, so a copy is as
/// good as the original: in a hot loop, copy it into a local variable
/// (`const iopages_local_fast f = *iopages_local_fast_path(l);`, then
/// pass `&f`). The compiler keeps a local copy's fields in registers;
/// through a pointer it must load them again after every store through
/// a `char *` — every write to a page — since such a store may alias
/// anything. E1's single-page round trip, first byte written: 43
/// instructions through the thread's pointer, 36 through a local copy
/// (the Rust handle: 30).
#[repr(C)]
pub struct iopages_local_fast {
    /// The handle, for the full path.
    pub local: *mut iopages_local,
    /// The cached pages, `buf[0 .. *len]` (page handles).
    pub buf: *mut u32,
    /// How many pages are cached: the handle's only copy of its length.
    pub len: *mut usize,
    /// A free is served inline only while `*len` is below this: the
    /// cache's capacity, or 0 when checks or counting every call send
    /// every free to the library.
    pub cap: usize,
    /// An allocation is served inline only while `*len` is above this
    /// (load with relaxed atomics): 0, or `SIZE_MAX` while fault
    /// injection is on, or for good with checks or counting on. One
    /// compare stands for every condition but the gfp mask.
    pub floor: *const usize,
    /// First byte of the arena.
    pub base: *mut u8,
    /// Arena size in bytes.
    pub arena_bytes: usize,
    /// gfp bits that need the full path.
    pub careful: u32,
    /// Every gfp bit the library knows (others: the full path refuses).
    pub known: u32,
    /// Nonzero: the inline batch free writes batches of 2 to 4 pages into
    /// the cache as packed 8-byte stores; zero: one store per slot. The
    /// handle's choice (`PageAllocatorBuilder::pack_small_batches`: by
    /// default packed on AMD and Hygon cores only), so that C and Rust
    /// store small batches alike.
    pub small_packed: u32,
}

impl iopages_local_fast {
    /// Before the handle exists (replaced at once in `iopages_local_create`).
    const EMPTY: iopages_local_fast = iopages_local_fast {
        local: std::ptr::null_mut(),
        buf: std::ptr::null_mut(),
        len: std::ptr::null_mut(),
        cap: 0,
        floor: std::ptr::null(),
        base: std::ptr::null_mut(),
        arena_bytes: 0,
        careful: 0,
        known: 0,
        small_packed: 0,
    };
}

/// The handle behind `l` (NULL: `None`). The header's inline functions
/// change the handle's shared record, which is the handle's only copy of
/// its state, so nothing needs taking back.
///
/// # Safety
/// `l` is NULL or a live handle only this thread uses.
#[inline(always)]
unsafe fn handle_mut<'a>(l: *mut iopages_local) -> Option<&'a mut iopages_local> {
    // SAFETY: the caller's promise.
    unsafe { l.as_mut() }
}

/// Huge pages: base pages only.
pub const IOPAGES_HUGE_NEVER: c_int = 0;
/// Huge pages: try hugetlb, then transparent huge pages, else base pages.
pub const IOPAGES_HUGE_TRY: c_int = 1;
/// Huge pages: fail unless hugetlb pages back the arena.
pub const IOPAGES_HUGE_REQUIRE: c_int = 2;

/// Settings of a new allocator. Start from `iopages_config_default` and
/// change what you need; `-1` in a signed field means "the default".
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct iopages_config {
    /// Arena size in bytes: a multiple of 4 MiB, at least 4 MiB
    /// (default 256 MiB).
    pub size_bytes: u64,
    /// `IOPAGES_HUGE_NEVER`, `IOPAGES_HUGE_TRY` (default) or
    /// `IOPAGES_HUGE_REQUIRE`.
    pub huge_pages: c_int,
    /// Fault the whole arena in at creation (default false).
    pub populate: bool,
    /// Allocation checks: 1 on (double frees and frees of blocks never
    /// allocated are refused with -EINVAL), 0 off (the fast setting), -1
    /// the library's build default (off in release builds).
    pub checks: c_int,
    /// Background reclaim thread: 1 on (default), 0 off.
    pub background_reclaim: c_int,
    /// Per-CPU list sets (-1: the CPUs the system has).
    pub nr_cpus: i64,
    /// Order-0 capacity of each thread's implicit cache in pages; 0 turns
    /// thread caches off (-1: default 64).
    pub thread_cache_pages: i64,
    /// Order-0 capacity of each `iopages_local` handle's cache (-1: 512).
    pub local_cache_pages: i64,
}

/// Where the arena's pages are (`iopages_leak_check`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iopages_accounting {
    /// Pages in the arena.
    pub total_pages: u64,
    /// Free in the zone's buddy lists.
    pub buddy_free_pages: u64,
    /// Free in the depot between the per-CPU lists and the zone.
    pub depot_pages: u64,
    /// Free on per-CPU lists.
    pub pcp_pages: u64,
    /// Free in threads' caches and `iopages_local` handles.
    pub thread_cache_pages: u64,
    /// Held by callers (mempool reserves included).
    pub in_use_pages: u64,
}

/// A snapshot of the allocator's statistics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iopages_stats {
    /// Pages in the arena.
    pub total_pages: u64,
    /// Free pages in the zone.
    pub free_pages: u64,
    /// Free blocks in the zone, by order (0..=10).
    pub free_blocks_by_order: [u64; 11],
    /// Pages parked in the depot.
    pub depot_pages: u64,
    /// Pages on per-CPU lists.
    pub pcp_pages: u64,
    /// Pages in threads' caches.
    pub thread_cache_pages: u64,
    /// Pages held by callers.
    pub in_use_pages: u64,
    /// Watermarks in pages.
    pub watermark_min: u64,
    /// Low watermark in pages.
    pub watermark_low: u64,
    /// High watermark in pages.
    pub watermark_high: u64,
    /// Blocks allocated from a thread's cache.
    pub alloc_thread_cache: u64,
    /// Blocks freed into a thread's cache.
    pub free_thread_cache: u64,
    /// Single allocations served by a per-CPU list.
    pub alloc_pcp: u64,
    /// Single frees given to a per-CPU list.
    pub free_pcp: u64,
    /// Blocks taken from the zone directly.
    pub alloc_zone: u64,
    /// Blocks returned to the zone directly.
    pub free_zone: u64,
    /// Bulk allocation calls.
    pub bulk_alloc_calls: u64,
    /// Bulk free calls.
    pub bulk_free_calls: u64,
    /// Per-CPU list refills from the zone.
    pub pcp_refills: u64,
}

/// Fill `cfg` with the defaults.
///
/// **Context:** never blocks. **Returns:** 0, or -EINVAL if `cfg` is NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_config_default(cfg: *mut iopages_config) -> c_int {
    guard_int(|| {
        let d = iopages_config {
            size_bytes: iopages::DEFAULT_ARENA_BYTES,
            huge_pages: IOPAGES_HUGE_TRY,
            populate: false,
            checks: -1,
            background_reclaim: 1,
            nr_cpus: -1,
            thread_cache_pages: -1,
            local_cache_pages: -1,
        };
        // SAFETY: the caller passes NULL or a writable config.
        unsafe { put(cfg, d, "cfg")? };
        Ok(0)
    })
}

fn setting(v: i64, name: &str) -> Result<Option<usize>, c_int> {
    match v {
        -1 => Ok(None),
        v if v >= 0 => Ok(Some(v as usize)),
        v => Err(fail(libc::EINVAL, format!("{name} = {v}: -1 or >= 0"))),
    }
}

/// The allocator builder `c` asks for.
///
/// **Returns:** -EINVAL (the message names the setting) for a value out of
/// range.
fn builder_from(c: &iopages_config) -> Result<PageAllocatorBuilder, c_int> {
    let huge = match c.huge_pages {
        IOPAGES_HUGE_NEVER => HugePages::Never,
        IOPAGES_HUGE_TRY => HugePages::Try,
        IOPAGES_HUGE_REQUIRE => HugePages::Require,
        h => return Err(fail(libc::EINVAL, format!("huge_pages = {h}: 0, 1 or 2"))),
    };
    let mut b = PageAllocator::builder()
        .size_bytes(c.size_bytes)
        .huge_pages(huge)
        .populate(c.populate);
    match c.checks {
        -1 => {}
        0 | 1 => b = b.checks(c.checks == 1),
        v => return Err(fail(libc::EINVAL, format!("checks = {v}: -1, 0 or 1"))),
    }
    match c.background_reclaim {
        0 | 1 => b = b.background_reclaim(c.background_reclaim == 1),
        v => {
            return Err(fail(
                libc::EINVAL,
                format!("background_reclaim = {v}: 0 or 1"),
            ))
        }
    }
    if let Some(n) = setting(c.nr_cpus, "nr_cpus")? {
        b = b.nr_cpus(n);
    }
    if let Some(n) = setting(c.thread_cache_pages, "thread_cache_pages")? {
        b = b.thread_cache_pages(n);
    }
    if let Some(n) = setting(c.local_cache_pages, "local_cache_pages")? {
        b = b.local_cache_pages(n);
    }
    Ok(b)
}

/// Create an allocator with `cfg` (NULL: the defaults) into `*out`.
///
/// **Context:** may block while the kernel maps memory (and faults it in
/// with `populate`). **Returns:** 0; -EINVAL for a bad setting (the
/// message names it) or a NULL `out`; -ENOMEM when the arena cannot be
/// mapped or huge pages were required and are not available.
#[no_mangle]
pub unsafe extern "C" fn iopages_allocator_create(
    cfg: *const iopages_config,
    out: *mut *mut iopages_allocator,
) -> c_int {
    guard_int(|| {
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let mut c = iopages_config {
            size_bytes: 0,
            huge_pages: 0,
            populate: false,
            checks: 0,
            background_reclaim: 0,
            nr_cpus: 0,
            thread_cache_pages: 0,
            local_cache_pages: 0,
        };
        // SAFETY: `c` is a valid, writable config.
        unsafe { iopages_config_default(&mut c) };
        // SAFETY: the caller passes NULL or a readable config.
        if let Some(given) = unsafe { cfg.as_ref() } {
            c = *given;
        }
        let alloc = builder_from(&c)?.build().map_err(|e| {
            let errno = match e {
                iopages::Error::BadArenaSize { .. } | iopages::Error::BadSetting { .. } => {
                    libc::EINVAL
                }
                _ => libc::ENOMEM,
            };
            fail(errno, e.to_string())
        })?;
        let a = Box::into_raw(Box::new(iopages_allocator { alloc }));
        // SAFETY: checked not NULL above; the caller's contract says writable.
        unsafe { out.write(a) };
        Ok(0)
    })
}

/// Destroy an allocator. Pages still allocated (by you, a mempool's
/// reserve, a folio buffer, a kvmalloc buffer) make it refuse: it returns
/// -EBUSY, says how many pages in `iopages_last_error`, and the allocator
/// stays valid — free them and call again. Objects made from the
/// allocator that hold no pages (`iopages_local` handles, counters) keep
/// the arena mapped until they are destroyed themselves.
///
/// **Context:** may block (joins the background reclaim thread when the
/// last user goes). **Returns:** 0 (NULL is accepted and does nothing);
/// -EBUSY as above.
#[no_mangle]
pub unsafe extern "C" fn iopages_allocator_destroy(a: *mut iopages_allocator) -> c_int {
    guard_int(|| {
        if a.is_null() {
            return Ok(0);
        }
        // SAFETY: the caller passes an allocator from `iopages_allocator_create`
        // that no other thread uses during this call.
        let alloc = unsafe { &(*a).alloc };
        if let Err(acc) = alloc.leak_check() {
            return Err(fail(
                libc::EBUSY,
                format!(
                    "{} pages are still allocated ({acc}); free them first",
                    acc.in_use_pages
                ),
            ));
        }
        // SAFETY: as above; the box is given back once.
        drop(unsafe { Box::from_raw(a) });
        Ok(0)
    })
}

pub(crate) fn to_page(nr_pages: u32, id: iopages_page) -> Result<Page, c_int> {
    if id == 0 || id > nr_pages {
        return Err(fail(
            libc::EINVAL,
            format!("page {id} is not a page of this arena ({nr_pages} pages)"),
        ));
    }
    Ok(Page::from_pfn(id - 1))
}

fn nr_pages(alloc: &PageAllocator) -> u32 {
    alloc.arena().nr_pages() as u32
}

#[inline]
fn id(p: Page) -> iopages_page {
    p.pfn() + 1
}

/// Check that `page` may be freed as an order-`order` block: in the arena,
/// aligned, not pinned, and (checks on) allocated.
pub(crate) fn check_free(alloc: &PageAllocator, page: Page, order: u32) -> Result<(), c_int> {
    if order > MAX_ORDER {
        return Err(fail(
            libc::EINVAL,
            format!("order {order} is above {MAX_ORDER}"),
        ));
    }
    if page.pfn() & ((1 << order) - 1) != 0
        || page.pfn() as usize + (1 << order) > alloc.arena().nr_pages()
    {
        return Err(fail(
            libc::EINVAL,
            format!(
                "page {} does not start an order-{order} block of this arena",
                id(page)
            ),
        ));
    }
    let Some(info) = alloc.frame_info(page) else {
        return Err(fail(libc::EINVAL, "page outside the arena"));
    };
    if info.pincount != 0 {
        return Err(fail(
            libc::EBUSY,
            format!("page {} is pinned by a bio", id(page)),
        ));
    }
    if alloc.checks_enabled() && info.flags & iopages::flags::ALLOCATED == 0 {
        return Err(fail(
            libc::EINVAL,
            format!(
                "page {} order {order} is not allocated (double free?)",
                id(page)
            ),
        ));
    }
    if info.flags & iopages::flags::HEAD != 0 && info.order != order {
        return Err(fail(
            libc::EINVAL,
            format!(
                "page {} is a folio of order {}, freed as order {order}",
                id(page),
                info.order
            ),
        ));
    }
    Ok(())
}

/// Allocate a block of 2^`order` contiguous pages into `*page`.
///
/// **Context:** never blocks unless `gfp` may block
/// (`IOPAGES_GFP_DIRECT_RECLAIM`, e.g. `IOPAGES_GFP_KERNEL`) and the caches
/// are empty; then it may run reclaim and (`NOFAIL`) wait for frees.
/// Thread-safe. **Returns:** 0; -ENOMEM when no block could be found under
/// `gfp`'s rules; -EINVAL for an order above 10, unknown gfp bits or NULL
/// pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_alloc_pages(
    a: *const iopages_allocator,
    order: u32,
    gfp_flags: u32,
    page: *mut iopages_page,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        // SAFETY: the caller passes NULL or a writable page.
        unsafe { alloc_into(order, gfp_flags, page, |g| a.alloc.alloc_pages(g, order)) }
    })
}

/// The checks and the result of `iopages_alloc_pages` and
/// `iopages_local_alloc_pages`: `alloc` runs once the order, the flags
/// and `page` are good, and its block is written to `page`.
///
/// # Safety
/// `page` is NULL or valid for a write.
unsafe fn alloc_into(
    order: u32,
    gfp_flags: u32,
    page: *mut iopages_page,
    alloc: impl FnOnce(Gfp) -> Option<Page>,
) -> Result<c_int, c_int> {
    let g = gfp(gfp_flags)?;
    if order > MAX_ORDER {
        return Err(fail(
            libc::EINVAL,
            format!("order {order} is above {MAX_ORDER}"),
        ));
    }
    if page.is_null() {
        return Err(fail(libc::EINVAL, "page is NULL"));
    }
    let p = alloc(g).ok_or_else(|| {
        fail(
            libc::ENOMEM,
            format!("no order-{order} block under gfp {gfp_flags:#x}"),
        )
    })?;
    // SAFETY: checked not NULL; the caller's contract says writable.
    unsafe { page.write(id(p)) };
    Ok(0)
}

/// Free a block from `iopages_alloc_pages` with the same order. The caller
/// gives it up: no pointer into it may be used afterwards.
///
/// **Context:** never blocks; thread-safe. **Returns:** 0; -EINVAL for a
/// page outside the arena, not aligned to `order`, a folio freed with the
/// wrong order, or (allocator created with checks on) a block not
/// allocated — a double free; -EBUSY if a bio still pins it. Without
/// checks, a double free is not detected and corrupts the allocator; nor
/// is a block allocated without `IOPAGES_GFP_COMP` freed with a smaller
/// order than it was allocated with (pass the same order).
#[no_mangle]
pub unsafe extern "C" fn iopages_free_pages(
    a: *const iopages_allocator,
    page: iopages_page,
    order: u32,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let p = to_page(nr_pages(&a.alloc), page)?;
        check_free(&a.alloc, p, order)?;
        // SAFETY: checked to be an allocated block of the arena (fully with
        // checks on); the caller gives it up (this function's contract).
        unsafe { a.alloc.free_pages(p, order) };
        Ok(0)
    })
}

/// Allocate up to `n` order-0 pages into `pages[0..returned]` in one call
/// (the kernel's `alloc_pages_bulk`); the rest of the array is set to 0.
///
/// **Context:** as `iopages_alloc_pages`; thread-safe. **Returns:** how
/// many pages were allocated (may be fewer than `n`, 0 included, when
/// memory is short); -EINVAL for NULL pointers or unknown gfp bits.
#[no_mangle]
pub unsafe extern "C" fn iopages_alloc_pages_bulk(
    a: *const iopages_allocator,
    gfp_flags: u32,
    pages: *mut iopages_page,
    n: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let g = gfp(gfp_flags)?;
        // SAFETY: the caller passes NULL or an array of `n` pages.
        let pages = unsafe { slice_mut(pages, n, "pages")? };
        pages.fill(0);
        // SAFETY: `Page` is a transparent `NonZeroU32`, so `Option<Page>` has
        // `u32`'s layout with 0 for `None` (a guaranteed niche); every u32 is
        // a valid `Option<Page>`, and the slice is ours for this call.
        let slots =
            unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<Option<Page>>(), n) };
        let got = a.alloc.alloc_pages_bulk_array(g, slots);
        Ok(got as isize)
    })
}

/// Check every handle of `pages` as an order-0 page to free, then view them
/// as `Page`s.
fn checked_pages<'p>(
    alloc: &PageAllocator,
    pages: &'p [iopages_page],
) -> Result<&'p [Page], c_int> {
    let n = nr_pages(alloc);
    let checks = alloc.checks_enabled();
    for (i, &p) in pages.iter().enumerate() {
        if p == 0 || p > n {
            return Err(fail(
                libc::EINVAL,
                format!("pages[{i}] = {p} is not a page of this arena; nothing freed"),
            ));
        }
        if checks {
            check_free(alloc, Page::from_pfn(p - 1), 0)
                .map_err(|_| fail(libc::EINVAL, format!("pages[{i}] = {p}: cannot be freed (not allocated: double free?); nothing freed")))?;
        }
    }
    // SAFETY: every element is non-zero (checked), and `Page` is a
    // transparent `NonZeroU32`: same layout as `u32`.
    Ok(unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<Page>(), pages.len()) })
}

/// Free `n` order-0 pages in one call. Every page is checked first (in the
/// arena; allocated, with checks on); if one fails, nothing is freed.
///
/// **Context:** never blocks; thread-safe. **Returns:** 0; -EINVAL as
/// above or for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_free_pages_bulk(
    a: *const iopages_allocator,
    pages: *const iopages_page,
    n: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        // SAFETY: the caller passes NULL or an array of `n` pages.
        let pages = unsafe { slice(pages, n, "pages")? };
        let pages = checked_pages(&a.alloc, pages)?;
        if !pages.is_empty() {
            // SAFETY: checked pages of this arena, given up by the caller.
            unsafe { a.alloc.free_pages_bulk(pages) };
        }
        Ok(0)
    })
}

/// The address of `page` in the arena's mapping (valid for
/// `IOPAGES_PAGE_SIZE << order` bytes of an allocated block).
///
/// **Context:** never blocks; thread-safe. **Returns:** the address, or
/// NULL for a page outside the arena (message set).
#[no_mangle]
pub unsafe extern "C" fn iopages_page_address(
    a: *const iopages_allocator,
    page: iopages_page,
) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes NULL or a live allocator.
        let Ok(a) = (unsafe { obj(a, "allocator") }) else {
            return std::ptr::null_mut();
        };
        match to_page(nr_pages(&a.alloc), page) {
            Ok(p) => a.alloc.page_address(p).cast(),
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// The page containing `addr`, for any address inside the arena.
///
/// **Context:** never blocks; thread-safe. **Returns:** 0; -EINVAL for an
/// address outside the arena or NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_address_page(
    a: *const iopages_allocator,
    addr: *const c_void,
    page: *mut iopages_page,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let p = a
            .alloc
            .page_of_address(addr.cast())
            .ok_or_else(|| fail(libc::EINVAL, format!("{addr:p} is not in the arena")))?;
        // SAFETY: the caller passes NULL or a writable handle.
        unsafe { put(page, id(p), "page")? };
        Ok(0)
    })
}

/// The frame number of a page handle (`page - 1`), for logs and arithmetic
/// on contiguous blocks (page + i is the i-th page of a block).
///
/// **Context:** never blocks. **Returns:** the frame number; UINT32_MAX
/// for 0.
#[no_mangle]
pub extern "C" fn iopages_page_pfn(page: iopages_page) -> u32 {
    page.wrapping_sub(1)
}

/// Pages in the allocator's arena.
///
/// **Context:** never blocks; thread-safe. **Returns:** the count, 0 for
/// NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_allocator_nr_pages(a: *const iopages_allocator) -> u64 {
    // SAFETY: the caller passes NULL or a live allocator.
    match unsafe { a.as_ref() } {
        Some(a) => a.alloc.arena().nr_pages() as u64,
        None => 0,
    }
}

/// Whether the allocator was created with checks on (1) or off (0).
///
/// **Context:** never blocks. **Returns:** 1, 0, or -EINVAL for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_allocator_checks(a: *const iopages_allocator) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        Ok(c_int::from(a.alloc.checks_enabled()))
    })
}

/// Check that nothing is allocated: drains this thread's cache and the
/// per-CPU lists, then counts. `acc` (may be NULL) receives the
/// accounting either way.
///
/// **Context:** takes the per-CPU and zone locks briefly; thread-safe.
/// **Returns:** 0 when no page is in use; -EBUSY when some are (count in
/// `acc` and the message); -EINVAL for a NULL allocator.
#[no_mangle]
pub unsafe extern "C" fn iopages_leak_check(
    a: *const iopages_allocator,
    acc: *mut iopages_accounting,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let (r, x) = match a.alloc.leak_check() {
            Ok(x) => (Ok(0), x),
            Err(x) => (
                Err(fail(
                    libc::EBUSY,
                    format!("{} pages in use: {x}", x.in_use_pages),
                )),
                x,
            ),
        };
        if !acc.is_null() {
            let c = iopages_accounting {
                total_pages: x.total_pages as u64,
                buddy_free_pages: x.buddy_free_pages as u64,
                depot_pages: x.depot_pages as u64,
                pcp_pages: x.pcp_pages as u64,
                thread_cache_pages: x.thread_cache_pages as u64,
                in_use_pages: x.in_use_pages as u64,
            };
            // SAFETY: not NULL; the caller's contract says writable.
            unsafe { acc.write(c) };
        }
        r
    })
}

/// The allocator's statistics into `*out`.
///
/// **Context:** never blocks (reads counters; racy while others allocate);
/// thread-safe. **Returns:** 0; -EINVAL for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_stats_get(
    a: *const iopages_allocator,
    out: *mut iopages_stats,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let s = a.alloc.stats();
        let mut by_order = [0u64; 11];
        for (d, s) in by_order.iter_mut().zip(s.free_blocks_by_order.iter()) {
            *d = *s as u64;
        }
        let c = iopages_stats {
            total_pages: s.total_pages as u64,
            free_pages: s.free_pages as u64,
            free_blocks_by_order: by_order,
            depot_pages: s.depot_pages as u64,
            pcp_pages: s.pcp_pages as u64,
            thread_cache_pages: s.thread_cache_pages as u64,
            in_use_pages: s.in_use_pages as u64,
            watermark_min: s.watermarks.0 as u64,
            watermark_low: s.watermarks.1 as u64,
            watermark_high: s.watermarks.2 as u64,
            alloc_thread_cache: s.alloc_thread_cache,
            free_thread_cache: s.free_thread_cache,
            alloc_pcp: s.alloc_pcp,
            free_pcp: s.free_pcp,
            alloc_zone: s.alloc_zone,
            free_zone: s.free_zone,
            bulk_alloc_calls: s.bulk_alloc_calls,
            bulk_free_calls: s.bulk_free_calls,
            pcp_refills: s.pcp_refills,
        };
        // SAFETY: the caller passes NULL or a writable struct.
        unsafe { put(out, c, "out")? };
        Ok(0)
    })
}

/// Copy `text` into `buf` as snprintf does.
pub(crate) fn snprint(text: &str, buf: *mut c_char, len: usize) -> isize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller passes `len` writable bytes at `buf`; `n < len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            buf.add(n).write(0);
        }
    }
    text.len() as isize
}

/// The statistics as text (several lines, like /proc/vmstat), written to
/// `buf` as snprintf does: at most `len - 1` bytes and a NUL.
///
/// **Context:** never blocks; thread-safe. **Returns:** the length of the
/// whole text (call again with a larger buffer if it is >= `len`);
/// -EINVAL for a NULL allocator (`buf` may be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn iopages_stats_text(
    a: *const iopages_allocator,
    buf: *mut c_char,
    len: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let mut text = String::new();
        let _ = write!(text, "{}", a.alloc.stats());
        if !text.ends_with('\n') {
            text.push('\n');
        }
        Ok(snprint(&text, buf, len))
    })
}

// ---- the per-thread handle ------------------------------------------------

/// Create a per-thread handle on `a` into `*out`.
///
/// **Context:** takes the allocator's registry lock once. **Returns:** 0;
/// -EINVAL for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_create(
    a: *const iopages_allocator,
    out: *mut *mut iopages_local,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let n = nr_pages(&a.alloc);
        let base = a.alloc.arena().base() as usize;
        let raw = Box::into_raw(Box::new(iopages_local {
            local: a.alloc.local(),
            scratch: Vec::with_capacity(1024),
            nr_pages: n,
            base,
            fast: iopages_local_fast::EMPTY,
        }));
        // SAFETY: `raw` is the live handle just boxed, which never moves;
        // the view is derived from the pointer C will hold, not from a
        // reference, so every later call's reference ends before C follows
        // the view's pointers again (one thread at a time, the handle's
        // contract).
        unsafe {
            let v = LocalAllocator::fast_path(std::ptr::addr_of_mut!((*raw).local));
            std::ptr::addr_of_mut!((*raw).fast).write(iopages_local_fast {
                local: raw,
                buf: v.buf,
                len: v.len as *mut usize,
                cap: v.cap,
                floor: v.floor.cast(),
                base: base as *mut u8,
                arena_bytes: n as usize * PAGE_SIZE,
                careful: v.careful,
                known: Gfp::all().bits(),
                small_packed: u32::from(v.pack_small),
            });
        }
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(raw) };
        Ok(0)
    })
}

/// The view of a handle's fast paths for the inline `iopages_fast_*`
/// functions of this header (see `iopages_local_fast`). Call it as
/// `iopages_local_fast_path(l)`: the header maps that name to this
/// symbol, whose suffix is the view's layout version — a program built
/// against another layout then fails to load (an undefined symbol)
/// instead of misreading the view.
///
/// **Context:** never blocks. **Returns:** the view, valid until the
/// handle is destroyed; NULL for a NULL handle.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_fast_path_v4(
    l: *mut iopages_local,
) -> *const iopages_local_fast {
    if l.is_null() {
        fail(libc::EINVAL, "local is NULL");
        return std::ptr::null();
    }
    // SAFETY: a live handle (the caller's contract); no reference made.
    unsafe { std::ptr::addr_of!((*l).fast) }
}

/// Destroy a handle: its cached pages go back to the allocator.
///
/// **Context:** never blocks for long (one drain of its cache).
/// **Returns:** 0 (NULL does nothing).
#[no_mangle]
pub unsafe extern "C" fn iopages_local_destroy(l: *mut iopages_local) -> c_int {
    guard_int(|| {
        if !l.is_null() {
            // SAFETY: a handle from `iopages_local_create`, given back once.
            drop(unsafe { Box::from_raw(l) });
        }
        Ok(0)
    })
}

/// As `iopages_alloc_pages`, through the handle's cache (order 0 with
/// plain flags is a length check and a copy).
///
/// **Context:** as `iopages_alloc_pages`; the handle's thread only.
/// **Returns:** as `iopages_alloc_pages`.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_alloc_pages(
    l: *mut iopages_local,
    order: u32,
    gfp_flags: u32,
    page: *mut iopages_page,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        // SAFETY: the caller passes NULL or a writable page.
        unsafe { alloc_into(order, gfp_flags, page, |g| l.local.alloc_pages(g, order)) }
    })
}

/// As `iopages_free_pages`, into the handle's cache.
///
/// **Context:** never blocks; the handle's thread only. **Returns:** as
/// `iopages_free_pages`.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_free_pages(
    l: *mut iopages_local,
    page: iopages_page,
    order: u32,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        let p = to_page(l.nr_pages, page)?;
        check_free(l.local.allocator(), p, order)?;
        // SAFETY: checked to be an allocated block of the arena (fully with
        // checks on); the caller gives it up.
        unsafe { l.local.free_pages(p, order) };
        Ok(0)
    })
}

/// As `iopages_alloc_pages_bulk` (order-0 pages into `pages[0..returned]`),
/// through the handle's cache.
///
/// **Context:** as `iopages_alloc_pages`; the handle's thread only.
/// **Returns:** how many pages were allocated; -EINVAL for NULL pointers
/// or unknown gfp bits.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_alloc_bulk(
    l: *mut iopages_local,
    gfp_flags: u32,
    pages: *mut iopages_page,
    n: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        let g = gfp(gfp_flags)?;
        // SAFETY: the caller passes NULL or an array of `n` pages.
        let out = unsafe { slice_mut(pages, n, "pages")? };
        let got = l.local.alloc_bulk_with(g, n, &mut l.scratch, |pages| {
            for (d, &p) in out.iter_mut().zip(pages.iter().rev()) {
                *d = id(p);
            }
            pages.len()
        });
        Ok(got as isize)
    })
}

/// As `iopages_free_pages_bulk`, into the handle's cache (every page is
/// checked first; if one fails, nothing is freed).
///
/// **Context:** never blocks; the handle's thread only. **Returns:** 0;
/// -EINVAL as `iopages_free_pages_bulk`.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_free_bulk(
    l: *mut iopages_local,
    pages: *const iopages_page,
    n: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        // SAFETY: the caller passes NULL or an array of `n` pages.
        let pages = unsafe { slice(pages, n, "pages")? };
        let pages = checked_pages(l.local.allocator(), pages)?;
        // SAFETY: checked pages of this arena, given up by the caller; all
        // `n` slots are written.
        unsafe {
            l.local
                .free_bulk_with(pages.len(), &mut l.scratch, |slots| {
                    for (d, &p) in slots.iter_mut().zip(pages) {
                        d.write(p);
                    }
                    true
                })
        };
        Ok(0)
    })
}

/// Allocate one order-0 page and return its address (4096 bytes,
/// page-aligned): the malloc-shaped form of `iopages_local_alloc_pages`.
///
/// **Context:** as `iopages_alloc_pages`; the handle's thread only.
/// **Returns:** the address; NULL when no page could be had under `gfp`
/// (or for a NULL handle or unknown gfp bits), with the message set.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_alloc_page_ptr(
    l: *mut iopages_local,
    gfp_flags: u32,
) -> *mut c_void {
    // The fast path: a page from the handle's cache, where nothing can fail
    // or panic, so it needs neither the panic guard nor a stack frame;
    // everything else, every error message included, is the cold path's.
    // SAFETY: the caller passes NULL or a handle only this thread uses.
    if let Some(h) = unsafe { handle_mut(l) } {
        if let Some(g) = Gfp::from_bits(gfp_flags) {
            if let Some(p) = h.local.alloc_cached(g) {
                return ptr_of_page(h.base, p);
            }
        }
    }
    // SAFETY: as above.
    unsafe { local_alloc_page_ptr_slow(l, gfp_flags) }
}

/// The full path of `iopages_local_alloc_page_ptr`: every check, every error message, the
/// allocator's slow paths.
///
/// # Safety
/// As `iopages_local_alloc_page_ptr`.
#[cold]
#[inline(never)]
unsafe fn local_alloc_page_ptr_slow(l: *mut iopages_local, gfp_flags: u32) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let Ok(l) = (unsafe { obj_mut(l, "local") }) else {
            return std::ptr::null_mut();
        };
        let Ok(g) = gfp(gfp_flags) else {
            return std::ptr::null_mut();
        };
        match l.local.alloc_pages(g, 0) {
            Some(p) => ptr_of_page(l.base, p),
            None => {
                fail(libc::ENOMEM, format!("no page under gfp {gfp_flags:#x}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// Free one order-0 page by address (from `iopages_local_alloc_page_ptr`,
/// `iopages_local_alloc_bulk_ptrs` or `iopages_page_address`).
///
/// **Context:** never blocks; the handle's thread only. **Returns:** 0;
/// -EINVAL for an address that is not a page start in the arena, or (checks
/// on) a page not allocated; NULL pointers refused.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_free_page_ptr(
    l: *mut iopages_local,
    ptr: *mut c_void,
) -> c_int {
    // The fast path (see `iopages_local_alloc_page_ptr`): a page start
    // inside the arena, into the handle's cache, checks off.
    // SAFETY: the caller passes NULL or a handle only this thread uses.
    if let Some(h) = unsafe { handle_mut(l) } {
        if let Some(page) = page_of_ptr(h.base, h.nr_pages, ptr) {
            // SAFETY: a page of this arena, given up by the caller; with
            // checks on `free_cached` declines and the cold path checks.
            if unsafe { h.local.free_cached(page) } {
                return 0;
            }
        }
    }
    // SAFETY: as above.
    unsafe { local_free_page_ptr_slow(l, ptr) }
}

/// The full path of `iopages_local_free_page_ptr`: every check, every error message, the
/// allocator's slow paths.
///
/// # Safety
/// As `iopages_local_free_page_ptr`.
#[cold]
#[inline(never)]
unsafe fn local_free_page_ptr_slow(l: *mut iopages_local, ptr: *mut c_void) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        let Some(page) = page_of_ptr(l.base, l.nr_pages, ptr) else {
            return Err(fail(
                libc::EINVAL,
                format!("{ptr:p} is not a page of the arena"),
            ));
        };
        if l.local.allocator().checks_enabled() {
            check_free(l.local.allocator(), page, 0)?;
        }
        // SAFETY: a page of this arena (checked; allocated, with checks on),
        // given up by the caller.
        unsafe { l.local.free_pages(page, 0) };
        Ok(0)
    })
}

/// Allocate up to `n` order-0 pages as addresses into `ptrs[0..returned]`
/// (each 4096 bytes, page-aligned): the malloc-shaped form of
/// `iopages_local_alloc_bulk`. A batch the handle's cache serves comes
/// most recently freed first (the pages likeliest to be in the caches).
///
/// **Context:** as `iopages_alloc_pages`; the handle's thread only.
/// **Returns:** how many were allocated; -EINVAL for NULL pointers or
/// unknown gfp bits.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_alloc_bulk_ptrs(
    l: *mut iopages_local,
    gfp_flags: u32,
    ptrs: *mut *mut c_void,
    n: usize,
) -> isize {
    // The fast path (see `iopages_local_alloc_page_ptr`): the whole batch
    // from the handle's cache, straight into `ptrs`.
    // SAFETY: the caller passes NULL or a handle only this thread uses.
    let h = unsafe { handle_mut(l) };
    if let (Some(h), Some(g), false) = (h, Gfp::from_bits(gfp_flags), ptrs.is_null()) {
        // SAFETY: not NULL; the caller passes an array of `n` pointers.
        let out = unsafe { std::slice::from_raw_parts_mut(ptrs, n) };
        let base = h.base;
        if let Some(got) = h.local.alloc_bulk_cached(g, n, |pages| {
            pages_to_ptrs(pages, base, out);
            pages.len()
        }) {
            return got as isize;
        }
    }
    // SAFETY: as above.
    unsafe { local_alloc_bulk_ptrs_slow(l, gfp_flags, ptrs, n) }
}

/// The full path of `iopages_local_alloc_bulk_ptrs`: every check, every error message, the
/// allocator's slow paths.
///
/// # Safety
/// As `iopages_local_alloc_bulk_ptrs`.
#[cold]
#[inline(never)]
unsafe fn local_alloc_bulk_ptrs_slow(
    l: *mut iopages_local,
    gfp_flags: u32,
    ptrs: *mut *mut c_void,
    n: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        let g = gfp(gfp_flags)?;
        // SAFETY: the caller passes NULL or an array of `n` pointers.
        let out = unsafe { slice_mut(ptrs, n, "ptrs")? };
        let base = l.base;
        // Straight from the handle's cache into `ptrs`: one pass, no copy
        // into a vector of handles first.
        let got = l.local.alloc_bulk_with(g, n, &mut l.scratch, |pages| {
            pages_to_ptrs(pages, base, &mut out[..pages.len()]);
            pages.len()
        });
        Ok(got as isize)
    })
}

/// Free `n` order-0 pages given by address (from
/// `iopages_local_alloc_bulk_ptrs` or `iopages_page_address`). Every
/// address is checked first (page-aligned, in the arena; allocated, with
/// checks on); if one fails, nothing is freed.
///
/// **Context:** never blocks; the handle's thread only. **Returns:** 0;
/// -EINVAL as above or for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_local_free_bulk_ptrs(
    l: *mut iopages_local,
    ptrs: *const *mut c_void,
    n: usize,
) -> c_int {
    // The fast path (see `iopages_local_alloc_page_ptr`): every address
    // good, the handles written straight into the handle's cache.
    // SAFETY: the caller passes NULL or a handle only this thread uses.
    if let (Some(h), false) = (unsafe { handle_mut(l) }, ptrs.is_null()) {
        // SAFETY: not NULL; the caller passes an array of `n` pointers.
        let ptrs = unsafe { std::slice::from_raw_parts(ptrs, n) };
        let (base, size) = (h.base, h.nr_pages as usize * PAGE_SIZE);
        // SAFETY: on `true` every slot holds a page of this arena (checked
        // to be a page start inside it), given up by the caller; with
        // checks on `free_bulk_cached` declines and the cold path checks.
        let done = unsafe {
            h.local.free_bulk_cached(n, |slots| {
                // SAFETY: `slots` has room for `n` pages.
                !ptrs_to_pages(ptrs, base, size, slots.as_mut_ptr().cast())
            })
        };
        if done == Some(true) {
            return 0;
        }
    }
    // SAFETY: as above; a batch refused above changed nothing.
    unsafe { local_free_bulk_ptrs_slow(l, ptrs, n) }
}

/// The full path of `iopages_local_free_bulk_ptrs`: every check, every error message, the
/// allocator's slow paths.
///
/// # Safety
/// As `iopages_local_free_bulk_ptrs`.
#[cold]
#[inline(never)]
unsafe fn local_free_bulk_ptrs_slow(
    l: *mut iopages_local,
    ptrs: *const *mut c_void,
    n: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a handle only this thread uses.
        let l = unsafe { obj_mut(l, "local")? };
        // SAFETY: the caller passes NULL or an array of `n` pointers.
        let ptrs = unsafe { slice(ptrs, n, "ptrs")? };
        let (base, size) = (l.base, l.nr_pages as usize * PAGE_SIZE);
        let n = ptrs.len();
        let bad = if l.local.allocator().checks_enabled() {
            // Checks on: every page checked to be allocated before any is
            // freed, so a double free is an error rather than a panic.
            l.scratch.clear();
            l.scratch.reserve(n);
            // SAFETY: room for `n` handles was reserved.
            let bad = unsafe { ptrs_to_pages(ptrs, base, size, l.scratch.as_mut_ptr().cast()) };
            if !bad {
                // SAFETY: the conversion wrote the first `n` slots.
                unsafe { l.scratch.set_len(n) };
                for &page in &l.scratch {
                    if let Err(e) = check_free(l.local.allocator(), page, 0) {
                        l.scratch.clear();
                        return Err(e);
                    }
                }
                // SAFETY: checked pages of this arena, given up by the
                // caller.
                unsafe { l.local.free_bulk(&mut l.scratch) };
            }
            bad
        } else {
            // Checks off: the handles are written straight into the
            // handle's cache, and committed only if every address was good.
            // SAFETY: on `true` every slot holds a page of this arena
            // (checked to be a page start inside it), given up by the
            // caller.
            !unsafe {
                l.local.free_bulk_with(n, &mut l.scratch, |slots| {
                    // SAFETY: `slots` has room for `n` pages.
                    !ptrs_to_pages(ptrs, base, size, slots.as_mut_ptr().cast())
                })
            }
        };
        if bad {
            let (i, p) = ptrs
                .iter()
                .enumerate()
                .find(|(_, &p)| page_of_ptr(base, l.nr_pages, p).is_none())
                .map(|(i, &p)| (i, p))
                .unwrap_or((0, std::ptr::null_mut()));
            return Err(fail(
                libc::EINVAL,
                format!("ptrs[{i}] = {p:p} is not a page of the arena; nothing freed"),
            ));
        }
        Ok(0)
    })
}

/// The address of page `p` of the arena at `base`.
#[inline(always)]
fn ptr_of_page(base: usize, p: Page) -> *mut c_void {
    (base + p.pfn() as usize * PAGE_SIZE) as *mut c_void
}

/// The page `ptr` is the start of, in the arena of `nr_pages` pages at
/// `base`; `None` for anything else.
#[inline(always)]
fn page_of_ptr(base: usize, nr_pages: u32, ptr: *mut c_void) -> Option<Page> {
    let off = (ptr as usize).wrapping_sub(base);
    (off % PAGE_SIZE == 0 && off / PAGE_SIZE < nr_pages as usize)
        .then(|| Page::from_pfn((off / PAGE_SIZE) as u32))
}

/// The address of every page of `pages` into `out` (the same length), in
/// one pass (it vectorises), last page first: `pages` is a run of the
/// handle's stack, whose top is the most recently freed page, so the
/// caller gets the pages most likely still in its caches first (as
/// [`iopages::LocalAllocator::alloc_bulk`] and DPDK's cache hand a batch
/// out). A batch freed and taken again is then walked in the opposite
/// order each time: the first-byte lines of page-aligned buffers all fall
/// in one L1 set, and a batch larger than its ways then finds the last
/// ones it touched still there (Intel Xeon, batch 16: 4.2 → 2.5 ns per
/// page in E1).
#[inline]
fn pages_to_ptrs(pages: &[Page], base: usize, out: &mut [*mut c_void]) {
    for (d, p) in out.iter_mut().zip(pages.iter().rev()) {
        *d = ptr_of_page(base, *p);
    }
}

/// Write the page handle of every address of `ptrs` to `dst[..ptrs.len()]`
/// in one pass without early exits (it vectorises), and say whether any
/// address was not a page start inside the arena `base..base + size`
/// (those slots hold a harmless non-zero value).
///
/// # Safety
/// `dst` has room for `ptrs.len()` `u32`s.
#[inline]
unsafe fn ptrs_to_pages(ptrs: &[*mut c_void], base: usize, size: usize, dst: *mut u32) -> bool {
    let mut bad = false;
    let handle = |p: *mut c_void, bad: &mut bool| {
        let off = (p as usize).wrapping_sub(base);
        *bad |= (off % PAGE_SIZE != 0) | (off >= size);
        // Masked below 2^31, so the handle (pfn + 1) is never 0: `Page`
        // is a transparent `NonZeroU32`.
        ((off / PAGE_SIZE) as u32 & 0x7fff_ffff) + 1
    };
    // Four handles per 16-byte store: `free_bulk` copies them with 16-byte
    // loads, and a load that spans several narrower stores would stall on
    // store forwarding.
    let mut quads = ptrs.chunks_exact(4);
    let mut at = 0;
    for q in &mut quads {
        let v = [
            handle(q[0], &mut bad),
            handle(q[1], &mut bad),
            handle(q[2], &mut bad),
            handle(q[3], &mut bad),
        ];
        // SAFETY: `at + 4 <= ptrs.len()`, which `dst` has room for.
        unsafe { dst.add(at).cast::<[u32; 4]>().write_unaligned(v) };
        at += 4;
    }
    for &p in quads.remainder() {
        let h = handle(p, &mut bad);
        // SAFETY: as above, `at < ptrs.len()`.
        unsafe { dst.add(at).write(h) };
        at += 1;
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(checks: c_int) -> *mut iopages_allocator {
        let mut cfg = std::mem::MaybeUninit::<iopages_config>::uninit();
        // SAFETY: a writable config.
        assert_eq!(unsafe { iopages_config_default(cfg.as_mut_ptr()) }, 0);
        // SAFETY: filled by `iopages_config_default`.
        let mut cfg = unsafe { cfg.assume_init() };
        cfg.size_bytes = 8 << 20;
        cfg.huge_pages = IOPAGES_HUGE_NEVER;
        cfg.checks = checks;
        let mut a = std::ptr::null_mut();
        // SAFETY: valid config and out-pointer.
        assert_eq!(unsafe { iopages_allocator_create(&cfg, &mut a) }, 0);
        a
    }

    #[test]
    fn pages_round_trip_and_double_frees_are_refused_with_checks() {
        let a = small(1);
        let mut p = 0;
        // SAFETY: a live allocator and valid pointers throughout.
        unsafe {
            assert_eq!(
                iopages_alloc_pages(a, 1, IOPAGES_GFP_KERNEL_BITS, &mut p),
                0
            );
            assert_ne!(p, 0);
            assert!(!iopages_page_address(a, p).is_null());
            assert_eq!(iopages_allocator_destroy(a), -libc::EBUSY);
            assert_eq!(iopages_free_pages(a, p, 1), 0);
            assert_eq!(iopages_free_pages(a, p, 1), -libc::EINVAL);
            let mut v = [0u32; 16];
            assert_eq!(
                iopages_alloc_pages_bulk(a, IOPAGES_GFP_KERNEL_BITS, v.as_mut_ptr(), 16),
                16
            );
            assert!(v.iter().all(|&p| p != 0));
            assert_eq!(iopages_free_pages_bulk(a, v.as_ptr(), 16), 0);
            assert_eq!(iopages_free_pages_bulk(a, v.as_ptr(), 16), -libc::EINVAL);
            assert_eq!(iopages_leak_check(a, std::ptr::null_mut()), 0);
            assert_eq!(iopages_allocator_destroy(a), 0);
        }
    }

    #[test]
    fn handles_by_address_refuse_foreign_pointers() {
        let a = small(0);
        let mut l = std::ptr::null_mut();
        // SAFETY: a live allocator and handle, valid pointers throughout.
        unsafe {
            assert_eq!(iopages_local_create(a, &mut l), 0);
            let mut v = [std::ptr::null_mut(); 13];
            assert_eq!(
                iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL_BITS, v.as_mut_ptr(), 13),
                13
            );
            let mut x = 0u8;
            let keep = v[5];
            v[5] = (&mut x as *mut u8).cast();
            assert_eq!(
                iopages_local_free_bulk_ptrs(l, v.as_ptr(), 13),
                -libc::EINVAL
            );
            v[5] = keep;
            assert_eq!(iopages_local_free_bulk_ptrs(l, v.as_ptr(), 13), 0);
            assert_eq!(iopages_local_destroy(l), 0);
            assert_eq!(iopages_leak_check(a, std::ptr::null_mut()), 0);
            assert_eq!(iopages_allocator_destroy(a), 0);
        }
    }

    #[test]
    fn the_headers_slow_gfp_bits_are_the_views() {
        for checks in [0, 1] {
            let a = small(checks);
            let mut l = std::ptr::null_mut();
            // SAFETY: a live allocator and handle; the view is read while
            // the handle lives and nothing else uses it.
            unsafe {
                assert_eq!(iopages_local_create(a, &mut l), 0);
                let f = &*iopages_local_fast_path_v4(l);
                assert_eq!(f.careful | !f.known, crate::IOPAGES_FAST_GFP_SLOW);
                assert_eq!(crate::IOPAGES_FAST_GFP_SLOW & IOPAGES_GFP_KERNEL_BITS, 0);
                assert_eq!(iopages_local_destroy(l), 0);
                assert_eq!(iopages_allocator_destroy(a), 0);
            }
        }
    }

    const IOPAGES_GFP_KERNEL_BITS: u32 = crate::IOPAGES_GFP_KERNEL;
}
