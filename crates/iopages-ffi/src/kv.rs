//! kvmalloc / kvfree.

use crate::alloc::iopages_allocator;
use crate::{fail, gfp, guard_int, obj, put};
use iopages::{KvBox, KvPolicy, Kvmalloc};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;

/// kvmalloc over an allocator: one contiguous block when it can be had
/// cheaply, else a vmalloc area (pages mapped together); either way one
/// address. The handle remembers every buffer it handed out, so that
/// `iopages_kvfree` refuses addresses it does not know.
///
/// **Thread safety:** every call may be made from any number of threads at
/// once, except `iopages_kvmalloc_destroy`.
pub struct iopages_kvmalloc {
    kv: Kvmalloc,
    live: Mutex<HashMap<usize, KvBox>>,
}

/// kvmalloc policy: the contiguous attempt never reclaims (today's kernel).
pub const IOPAGES_KV_FAIL_FAST: c_int = 0;
/// kvmalloc policy: the contiguous attempt may reclaim and compact once
/// (the kernel before the fix).
pub const IOPAGES_KV_LEGACY: c_int = 1;

/// Create a kvmalloc handle over `a` into `*out`.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for NULL pointers;
/// -ENOMEM if the vmalloc space cannot be set up.
#[no_mangle]
pub unsafe extern "C" fn iopages_kvmalloc_create(
    a: *const iopages_allocator,
    out: *mut *mut iopages_kvmalloc,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let kv = Kvmalloc::new(&a.alloc).map_err(|e| fail(libc::ENOMEM, e.to_string()))?;
        let p = Box::into_raw(Box::new(iopages_kvmalloc {
            kv,
            live: Mutex::new(HashMap::new()),
        }));
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(p) };
        Ok(0)
    })
}

/// Destroy a kvmalloc handle. Buffers still allocated make it refuse
/// with -EBUSY (the handle stays valid).
///
/// **Context:** may block while vmalloc areas are unmapped. **Returns:** 0
/// (NULL does nothing); -EBUSY as above.
#[no_mangle]
pub unsafe extern "C" fn iopages_kvmalloc_destroy(kv: *mut iopages_kvmalloc) -> c_int {
    guard_int(|| {
        if kv.is_null() {
            return Ok(0);
        }
        // SAFETY: a handle from `iopages_kvmalloc_create`, used by no other
        // thread now.
        let n = unsafe { &*kv }
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        if n != 0 {
            return Err(fail(
                libc::EBUSY,
                format!("{n} buffers are still allocated; kvfree them first"),
            ));
        }
        // SAFETY: as above; the box is given back once.
        drop(unsafe { Box::from_raw(kv) });
        Ok(0)
    })
}

/// Allocate `size` bytes into `*ptr` (`IOPAGES_GFP_ZERO` zeroes them).
/// One page is one order-0 allocation; up to 4 MiB a contiguous block is
/// tried with `policy`'s flags, then a vmalloc area; more is vmalloc.
///
/// **Context:** the contiguous attempt blocks only under
/// `IOPAGES_KV_LEGACY` with a blocking `gfp`; the vmalloc fallback may
/// block as `gfp` allows and maps memory (a system call). Thread-safe.
/// **Returns:** 0; -EINVAL for a zero size, one larger than the arena, a
/// bad policy or NULL pointers; -ENOMEM when no memory can be had.
#[no_mangle]
pub unsafe extern "C" fn iopages_kvmalloc_alloc(
    kv: *const iopages_kvmalloc,
    size: usize,
    gfp_flags: u32,
    policy: c_int,
    ptr: *mut *mut c_void,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let kv = unsafe { obj(kv, "kvmalloc")? };
        let g = gfp(gfp_flags)?;
        let policy = match policy {
            IOPAGES_KV_FAIL_FAST => KvPolicy::FailFast,
            IOPAGES_KV_LEGACY => KvPolicy::Legacy,
            p => return Err(fail(libc::EINVAL, format!("policy {p}: 0 or 1"))),
        };
        if ptr.is_null() {
            return Err(fail(libc::EINVAL, "ptr is NULL"));
        }
        let b = kv.kv.kvmalloc(size, g, policy).map_err(|e| {
            let errno = match e {
                iopages::Error::BadSetting { .. } => libc::EINVAL,
                _ => libc::ENOMEM,
            };
            fail(errno, e.to_string())
        })?;
        let addr = b.as_ptr() as usize;
        kv.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, b);
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { put(ptr, addr as *mut c_void, "ptr")? };
        Ok(0)
    })
}

/// Free a buffer from `iopages_kvmalloc_alloc` (NULL does nothing).
///
/// **Context:** never blocks for contiguous buffers; a vmalloc area is
/// unmapped lazily (a batch at a time). Thread-safe. **Returns:** 0;
/// -EINVAL for an address this handle did not hand out (or freed already).
#[no_mangle]
pub unsafe extern "C" fn iopages_kvfree(kv: *const iopages_kvmalloc, ptr: *mut c_void) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let kv = unsafe { obj(kv, "kvmalloc")? };
        if ptr.is_null() {
            return Ok(0);
        }
        let b = kv
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(ptr as usize))
            .ok_or_else(|| {
                fail(
                    libc::EINVAL,
                    format!("{ptr:p} is not a live kvmalloc buffer of this handle (double free?)"),
                )
            })?;
        kv.kv.kvfree(b);
        Ok(0)
    })
}

/// Whether the buffer at `ptr` is one contiguous block (1) or a vmalloc
/// area (0).
///
/// **Context:** never blocks. **Returns:** 1 or 0; -EINVAL for an address
/// this handle did not hand out.
#[no_mangle]
pub unsafe extern "C" fn iopages_kvmalloc_is_contiguous(
    kv: *const iopages_kvmalloc,
    ptr: *const c_void,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let kv = unsafe { obj(kv, "kvmalloc")? };
        let live = kv.live.lock().unwrap_or_else(|e| e.into_inner());
        let b = live
            .get(&(ptr as usize))
            .ok_or_else(|| fail(libc::EINVAL, format!("{ptr:p} is not a live buffer")))?;
        Ok(c_int::from(b.is_contiguous()))
    })
}
