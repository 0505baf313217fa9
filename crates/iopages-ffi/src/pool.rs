//! Mempools: of pages (from an allocator) and of caller-sized objects.

use crate::alloc::{check_free, iopages_allocator, to_page};
use crate::{fail, gfp, guard_int, guard_long, iopages_page, obj, put, slice, slice_mut};
use iopages::{ElementSource, Gfp, Mempool, Page, PageAllocator, PagePool, PAGE_SIZE};
use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// A mempool: `min_nr` elements held in reserve so that callers that may
/// block always get one (they sleep until another caller frees one). Pools
/// of pages hand out order-`order` blocks of an allocator (as handles or
/// addresses); pools of objects hand out `size`-byte objects from the C
/// heap (`posix_memalign`).
///
/// **Thread safety:** every call may be made from any number of threads at
/// once, except `iopages_mempool_destroy`.
pub struct iopages_mempool {
    kind: Kind,
    /// Elements handed out and not yet freed (for the destroy check and to
    /// refuse more frees than allocations).
    out: AtomicUsize,
}

enum Kind {
    Pages {
        pool: PagePool,
        alloc: PageAllocator,
        order: u32,
    },
    Objects(Mempool<ObjSource>),
}

/// A heap object (`posix_memalign`).
struct Obj(NonNull<u8>);
// SAFETY: the object is plain memory owned by whoever holds the `Obj`.
unsafe impl Send for Obj {}

/// Objects of one size and alignment from the C heap, with an optional
/// limit on live objects (so that the pool's reserve can be seen at work).
struct ObjSource {
    size: usize,
    align: usize,
    max_live: usize,
    live: AtomicUsize,
}

impl ElementSource for ObjSource {
    type Elem = Obj;

    fn alloc(&self, _gfp: Gfp) -> Option<Obj> {
        if self.max_live != 0
            && self
                .live
                .fetch_update(Relaxed, Relaxed, |n| (n < self.max_live).then_some(n + 1))
                .is_err()
        {
            return None;
        }
        if self.max_live == 0 {
            self.live.fetch_add(1, Relaxed);
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; size and alignment were
        // checked at creation (alignment a power of two, a multiple of the
        // pointer size).
        let rc = unsafe { libc::posix_memalign(&mut p, self.align, self.size) };
        match NonNull::new(p.cast::<u8>()) {
            Some(p) if rc == 0 => Some(Obj(p)),
            _ => {
                self.live.fetch_sub(1, Relaxed);
                None
            }
        }
    }

    unsafe fn free(&self, elem: Obj) {
        self.live.fetch_sub(1, Relaxed);
        // SAFETY: the object came from `posix_memalign` above and its owner
        // gives it up (the trait's contract).
        unsafe { libc::free(elem.0.as_ptr().cast()) };
    }
}

fn new_pool(kind: Kind) -> *mut iopages_mempool {
    Box::into_raw(Box::new(iopages_mempool {
        kind,
        out: AtomicUsize::new(0),
    }))
}

/// Create a pool of order-`order` page blocks from `a`, with `min_nr`
/// blocks allocated into the reserve now, into `*out`.
///
/// **Context:** may block while the reserve is filled. **Returns:** 0;
/// -EINVAL for NULL pointers or an order above 10; -ENOMEM when the
/// reserve could not be filled (nothing stays allocated).
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_create_pages(
    a: *const iopages_allocator,
    order: u32,
    min_nr: usize,
    out: *mut *mut iopages_mempool,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        if order > iopages::MAX_ORDER {
            return Err(fail(libc::EINVAL, format!("order {order} is above 10")));
        }
        let pool = iopages::PagePool::new(
            iopages::PageSource::new(a.alloc.clone(), order)
                .map_err(|e| fail(libc::EINVAL, e.to_string()))?,
            min_nr,
        )
        .map_err(|e| fail(libc::ENOMEM, e.to_string()))?;
        let p = new_pool(Kind::Pages {
            pool,
            alloc: a.alloc.clone(),
            order,
        });
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(p) };
        Ok(0)
    })
}

/// Create a pool of `size`-byte objects aligned to `align` (a power of two,
/// at least `sizeof(void *)`; 0 means 16) from the C heap, with `min_nr` in
/// reserve now, into `*out`. `max_live` (0: no limit) caps the objects the
/// heap side may have alive at once, reserve included: a memory budget
/// past which only the reserve serves.
///
/// **Context:** may block while the reserve is filled. **Returns:** 0;
/// -EINVAL for a zero size, a bad alignment, `max_live < min_nr` or NULL
/// `out`; -ENOMEM when the reserve could not be filled.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_create_objects(
    size: usize,
    align: usize,
    min_nr: usize,
    max_live: usize,
    out: *mut *mut iopages_mempool,
) -> c_int {
    guard_int(|| {
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let align = if align == 0 { 16 } else { align };
        if size == 0 || !align.is_power_of_two() || align < std::mem::size_of::<*mut u8>() {
            return Err(fail(
                libc::EINVAL,
                format!(
                    "size {size}, align {align}: size > 0, align a power of two >= sizeof(void *)"
                ),
            ));
        }
        if max_live != 0 && max_live < min_nr {
            return Err(fail(
                libc::EINVAL,
                format!("max_live {max_live} is below min_nr {min_nr}"),
            ));
        }
        let src = ObjSource {
            size,
            align,
            max_live,
            live: AtomicUsize::new(0),
        };
        let pool = Mempool::new(src, min_nr).map_err(|e| fail(libc::ENOMEM, e.to_string()))?;
        let p = new_pool(Kind::Objects(pool));
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(p) };
        Ok(0)
    })
}

/// Destroy a pool: its reserve goes back to its source. Elements still
/// out make it refuse with -EBUSY (the pool stays valid).
///
/// **Context:** never blocks for long. **Returns:** 0 (NULL does nothing);
/// -EBUSY as above.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_destroy(p: *mut iopages_mempool) -> c_int {
    guard_int(|| {
        if p.is_null() {
            return Ok(0);
        }
        // SAFETY: a pool from a create call, used by no other thread now.
        let out = unsafe { &*p }.out.load(Relaxed);
        if out != 0 {
            return Err(fail(
                libc::EBUSY,
                format!("{out} elements are still out; free them first"),
            ));
        }
        // SAFETY: as above; the box is given back once.
        drop(unsafe { Box::from_raw(p) });
        Ok(0)
    })
}

fn take_out(p: &iopages_mempool, n: usize) -> Result<(), c_int> {
    p.out
        .fetch_update(Relaxed, Relaxed, |o| o.checked_sub(n))
        .map(|_| ())
        .map_err(|o| {
            fail(
                libc::EINVAL,
                format!("{n} elements freed but only {o} are out (double free?)"),
            )
        })
}

fn empty(flags: u32) -> c_int {
    fail(
        libc::ENOMEM,
        format!("the pool's source and reserve are empty (gfp {flags:#x} cannot wait)"),
    )
}

/// Allocate one element into `*elem`: an object, or a page block's
/// address. The source is tried first, then the reserve; a `gfp` that may
/// block (`IOPAGES_GFP_KERNEL`, `_NOIO`, `_NOFS`) then sleeps until an
/// element is freed to the pool.
///
/// **Context:** blocks only if `gfp` may block; thread-safe. **Returns:**
/// 0; -ENOMEM (only for a `gfp` that cannot block) when source and reserve
/// are empty; -EINVAL for NULL pointers or unknown gfp bits.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_alloc(
    p: *const iopages_mempool,
    gfp_flags: u32,
    elem: *mut *mut c_void,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let g = gfp(gfp_flags)?;
        if elem.is_null() {
            return Err(fail(libc::EINVAL, "elem is NULL"));
        }
        let addr: *mut c_void = match &p.kind {
            Kind::Pages { pool, alloc, .. } => {
                let pg = pool.alloc(g).ok_or_else(|| empty(gfp_flags))?;
                alloc.page_address(pg).cast()
            }
            Kind::Objects(pool) => pool
                .alloc(g)
                .ok_or_else(|| empty(gfp_flags))?
                .0
                .as_ptr()
                .cast(),
        };
        p.out.fetch_add(1, Relaxed);
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { elem.write(addr) };
        Ok(0)
    })
}

/// Free one element from `iopages_mempool_alloc`: it refills the reserve
/// if that is short (waking a sleeper), else goes back to the source.
/// Contract: `elem` came from this pool and is given up (for objects this
/// cannot be checked beyond the count of elements out; for pages, the
/// address must be a block start in the arena).
///
/// **Context:** never blocks; thread-safe. **Returns:** 0; -EINVAL for
/// NULL, an address that is not a block of a page pool, or more frees than
/// allocations.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_free(
    p: *const iopages_mempool,
    elem: *mut c_void,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let e =
            NonNull::new(elem.cast::<u8>()).ok_or_else(|| fail(libc::EINVAL, "elem is NULL"))?;
        match &p.kind {
            Kind::Pages { pool, alloc, order } => {
                let pg = page_of_block(alloc, e.as_ptr(), *order)?;
                take_out(p, 1)?;
                // SAFETY: a block of this arena (checked); the caller gives
                // it up and it came from this pool (the contract above).
                unsafe { pool.free_raw(pg) };
            }
            Kind::Objects(pool) => {
                take_out(p, 1)?;
                // SAFETY: the caller gives up an object of this pool.
                unsafe { pool.free_raw(Obj(e)) };
            }
        }
        Ok(0)
    })
}

fn page_of_block(alloc: &PageAllocator, addr: *const u8, order: u32) -> Result<Page, c_int> {
    let pg = alloc
        .page_of_address(addr)
        .filter(|pg| std::ptr::eq(alloc.page_address(*pg), addr))
        .ok_or_else(|| fail(libc::EINVAL, format!("{addr:p} is not a page of the arena")))?;
    check_free(alloc, pg, order)?;
    Ok(pg)
}

/// Allocate up to `n` elements into `elems[0..returned]` in one step (the
/// kernel's `mempool_alloc_bulk`): a `gfp` that may block gets all `n`
/// (waiting for frees if needed); one that cannot gets what the source
/// gave, plus the reserve only if the reserve can supply every missing
/// element (all or nothing, so that two callers never each hold part of
/// it).
///
/// **Context:** as `iopages_mempool_alloc`. **Returns:** how many;
/// -EINVAL for NULL pointers, unknown gfp bits, or a `gfp` that may block
/// with `n` above the pool's `min_nr` (such a call could wait for ever).
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_alloc_bulk(
    p: *const iopages_mempool,
    gfp_flags: u32,
    elems: *mut *mut c_void,
    n: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let g = gfp(gfp_flags)?;
        // SAFETY: the caller passes NULL or an array of `n` pointers.
        let out = unsafe { slice_mut(elems, n, "elems")? };
        let min_nr = match &p.kind {
            Kind::Pages { pool, .. } => pool.min_nr(),
            Kind::Objects(pool) => pool.min_nr(),
        };
        if g.may_block() && n > min_nr {
            return Err(fail(
                libc::EINVAL,
                format!(
                    "a blocking bulk allocation of {n} elements exceeds the reserve of {min_nr}: \
                     it could wait for ever; split it or use a gfp that cannot block"
                ),
            ));
        }
        let mut got = 0usize;
        match &p.kind {
            Kind::Pages { pool, alloc, .. } => {
                pool.alloc_bulk_cb(g, n, |pg| {
                    out[got] = alloc.page_address(pg).cast();
                    got += 1;
                });
            }
            Kind::Objects(pool) => {
                pool.alloc_bulk_cb(g, n, |o| {
                    out[got] = o.0.as_ptr().cast();
                    got += 1;
                });
            }
        }
        p.out.fetch_add(got, Relaxed);
        Ok(got as isize)
    })
}

/// Free `n` elements in one step (the front ones refill the reserve, the
/// rest go to the source in one bulk free). Page addresses are all checked
/// first; if one fails, nothing is freed.
///
/// **Context:** never blocks; thread-safe. **Returns:** 0; -EINVAL as
/// `iopages_mempool_free`.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_free_bulk(
    p: *const iopages_mempool,
    elems: *const *mut c_void,
    n: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        // SAFETY: the caller passes NULL or an array of `n` pointers.
        let elems = unsafe { slice(elems, n, "elems")? };
        match &p.kind {
            Kind::Pages { pool, alloc, order } => {
                let mut v = Vec::with_capacity(n);
                for &e in elems {
                    v.push(page_of_block(alloc, e.cast(), *order)?);
                }
                take_out(p, n)?;
                // SAFETY: blocks of this arena (checked), given up by the
                // caller, from this pool (the contract).
                unsafe { pool.free_bulk_raw(&mut v) };
            }
            Kind::Objects(pool) => {
                let mut v = Vec::with_capacity(n);
                for &e in elems {
                    v.push(Obj(NonNull::new(e.cast::<u8>()).ok_or_else(|| {
                        fail(libc::EINVAL, "a NULL element; nothing freed")
                    })?));
                }
                take_out(p, n)?;
                // SAFETY: objects of this pool given up by the caller.
                unsafe { pool.free_bulk_raw(&mut v) };
            }
        }
        Ok(0)
    })
}

/// For page pools: allocate one block as a page handle into `*page` (as
/// `iopages_mempool_alloc`).
///
/// **Context / Returns:** as `iopages_mempool_alloc`; -EINVAL on an
/// object pool.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_alloc_page(
    p: *const iopages_mempool,
    gfp_flags: u32,
    page: *mut iopages_page,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let g = gfp(gfp_flags)?;
        let Kind::Pages { pool, .. } = &p.kind else {
            return Err(fail(libc::EINVAL, "not a page pool"));
        };
        if page.is_null() {
            return Err(fail(libc::EINVAL, "page is NULL"));
        }
        let pg = pool.alloc(g).ok_or_else(|| empty(gfp_flags))?;
        p.out.fetch_add(1, Relaxed);
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { put(page, pg.pfn() + 1, "page")? };
        Ok(0)
    })
}

/// For page pools: free one block by handle (as `iopages_mempool_free`).
///
/// **Context / Returns:** as `iopages_mempool_free`.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_free_page(
    p: *const iopages_mempool,
    page: iopages_page,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let Kind::Pages { pool, alloc, order } = &p.kind else {
            return Err(fail(libc::EINVAL, "not a page pool"));
        };
        let pg = to_page(alloc.arena().nr_pages() as u32, page)?;
        check_free(alloc, pg, *order)?;
        take_out(p, 1)?;
        // SAFETY: a checked block of the arena from this pool, given up.
        unsafe { pool.free_raw(pg) };
        Ok(0)
    })
}

/// The element size of a pool in bytes (a page pool's block size).
///
/// **Context:** never blocks. **Returns:** the size; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_element_size(p: *const iopages_mempool) -> usize {
    // SAFETY: the caller passes NULL or a live pool.
    match unsafe { p.as_ref() } {
        Some(p) => match &p.kind {
            Kind::Pages { order, .. } => PAGE_SIZE << order,
            Kind::Objects(pool) => pool.source().size,
        },
        None => 0,
    }
}

/// A pool's reserve and counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iopages_mempool_stats {
    /// Elements the reserve is kept at.
    pub min_nr: u64,
    /// Elements in the reserve now.
    pub reserve_len: u64,
    /// Elements handed out from the reserve.
    pub reserve_allocs: u64,
    /// Freed elements kept to refill the reserve.
    pub reserve_frees: u64,
    /// Sleeps of blocking callers that found the reserve short.
    pub waits: u64,
    /// Non-blocking calls that came back empty or short.
    pub failures: u64,
    /// Elements handed out and not freed yet.
    pub out: u64,
}

/// A pool's statistics into `*out`.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_mempool_stats_get(
    p: *const iopages_mempool,
    out: *mut iopages_mempool_stats,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live pool.
        let p = unsafe { obj(p, "pool")? };
        let s = match &p.kind {
            Kind::Pages { pool, .. } => pool.stats(),
            Kind::Objects(pool) => pool.stats(),
        };
        let c = iopages_mempool_stats {
            min_nr: s.min_nr as u64,
            reserve_len: s.reserve_len as u64,
            reserve_allocs: s.reserve_allocs,
            reserve_frees: s.reserve_frees,
            waits: s.waits,
            failures: s.failures,
            out: p.out.load(Relaxed) as u64,
        };
        // SAFETY: the caller passes NULL or a writable struct.
        unsafe { put(out, c, "out")? };
        Ok(0)
    })
}
