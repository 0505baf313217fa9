//! # iopages-ffi — the C ABI of iopages
//!
//! `libiopages.so` / `libiopages.a` and `include/iopages.h` (generated from
//! this crate by cbindgen; `build.rs`). C and C++ storage engines get the
//! page allocator (shared and per-thread paths, bulk calls), mempools of
//! pages and of caller-sized objects, per-CPU counters, kvmalloc, folio
//! buffers and bios with their iovecs, statistics and the leak check.
//!
//! Owns: the boundary. Every entry point checks its pointers and numbers
//! before they reach the Rust API (a null pointer, a page outside the arena,
//! a block not allocated when checks are on: `-EINVAL`), turns every error
//! into a negative errno with a thread-local message
//! ([`iopages_last_error`]), and catches panics ([`guard`]) so that none
//! unwinds into C. Must never: let a Rust panic cross into C, or hand C an
//! address outside the memory an object owns.
//!
//! Conventions (the header repeats them):
//! * `int` / `long` results: `>= 0` success, `-errno` failure.
//! * `iopages_page` is a 32-bit page handle, never 0 for a page (0 is "no
//!   page"); its frame number is `page - 1` ([`iopages_page_pfn`]).
//! * Handles are created by `*_create` and given back by `*_destroy`
//!   (`iopages_bio_release` for a bio).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![allow(non_camel_case_types)]
// Every entry point checks its pointers itself and says so in its docs;
// the C contract is in the header, not in Rust `# Safety` sections.
#![allow(clippy::missing_safety_doc)]

mod alloc;
mod counter;
mod io;
mod kv;
mod pool;

pub use alloc::*;
pub use counter::*;
pub use io::*;
pub use kv::*;
pub use pool::*;

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A page handle: the frame number plus one; 0 is "no page".
pub type iopages_page = u32;

/// May start I/O to free memory.
pub const IOPAGES_GFP_IO: u32 = 1 << 0;
/// May call into file-system code to free memory.
pub const IOPAGES_GFP_FS: u32 = 1 << 1;
/// May block and run reclaim in the caller.
pub const IOPAGES_GFP_DIRECT_RECLAIM: u32 = 1 << 2;
/// May wake the background reclaimer.
pub const IOPAGES_GFP_KSWAPD_RECLAIM: u32 = 1 << 3;
/// High priority: may dip below the min watermark (to half of it).
pub const IOPAGES_GFP_HIGH: u32 = 1 << 4;
/// Do not log a failure.
pub const IOPAGES_GFP_NOWARN: u32 = 1 << 5;
/// Retry while reclaim makes progress; fail rather than loop forever.
pub const IOPAGES_GFP_RETRY_MAYFAIL: u32 = 1 << 6;
/// Never fail: block and retry until memory appears.
pub const IOPAGES_GFP_NOFAIL: u32 = 1 << 7;
/// One round of reclaim at most.
pub const IOPAGES_GFP_NORETRY: u32 = 1 << 8;
/// Ignore watermarks entirely (reclaimers only).
pub const IOPAGES_GFP_MEMALLOC: u32 = 1 << 9;
/// Zero the memory before returning it.
pub const IOPAGES_GFP_ZERO: u32 = 1 << 10;
/// Mark a higher-order block as a compound page (a folio).
pub const IOPAGES_GFP_COMP: u32 = 1 << 11;
/// The caller can migrate these pages.
pub const IOPAGES_GFP_MOVABLE: u32 = 1 << 12;
/// The gfp bits the header's inline fast paths hand to the full call: those
/// whose pages need preparing (`ZERO`, `COMP`), `MOVABLE`, and every bit the
/// library does not know. A constant, so that a constant gfp folds the test
/// away as it does in Rust; it equals the view's `careful | ~known` (a test
/// checks), and a library that changes it changes `IOPAGES_FAST_LAYOUT`.
pub const IOPAGES_FAST_GFP_SLOW: u32 =
    IOPAGES_GFP_ZERO | IOPAGES_GFP_COMP | IOPAGES_GFP_MOVABLE | !((IOPAGES_GFP_MOVABLE << 1) - 1);
/// Ordinary allocation: may block, reclaim, do I/O and FS calls.
pub const IOPAGES_GFP_KERNEL: u32 = 0xf;
/// Never blocks, wakes background reclaim, fails quietly.
pub const IOPAGES_GFP_NOWAIT: u32 = 0x28;
/// Never blocks, may use part of the emergency reserve.
pub const IOPAGES_GFP_ATOMIC: u32 = 0x18;
/// May block and reclaim, but must not start I/O.
pub const IOPAGES_GFP_NOIO: u32 = 0xc;
/// May block, reclaim and do I/O, but must not enter a file system.
pub const IOPAGES_GFP_NOFS: u32 = 0xd;

/// Bytes in a page.
pub const IOPAGES_PAGE_SIZE: usize = 4096;
/// Highest block order (blocks of 2^10 pages, 4 MiB).
pub const IOPAGES_MAX_ORDER: u32 = 10;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `msg` as this thread's last error and return `-errno`.
pub(crate) fn fail(errno: c_int, msg: impl Into<String>) -> c_int {
    let mut s = msg.into();
    s.retain(|c| c != '\0');
    let c = CString::new(s).unwrap_or_default();
    // The thread may be exiting (its locals gone): the errno still goes back.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
    -errno
}

/// The gfp flags from C: unknown bits are refused.
pub(crate) fn gfp(bits: u32) -> Result<iopages::Gfp, c_int> {
    iopages::Gfp::from_bits(bits)
        .ok_or_else(|| fail(libc::EINVAL, format!("unknown gfp bits {bits:#x}")))
}

/// Run one entry point: a panic inside becomes `on_panic` with the panic's
/// message as the last error (`-EFAULT` for the int-returning calls), so no
/// unwinding reaches C. iopages panics only on misuse it detects (a block
/// freed with the wrong order, a frame outside the arena); the state it
/// guards was not changed when the check fired.
#[inline(always)]
pub(crate) fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            fail(
                libc::EFAULT,
                format!("iopages panicked (misuse caught): {msg}"),
            );
            on_panic
        }
    }
}

/// `guard` for calls that return an errno: `Err(e)` is `e` (already
/// negative, message set by [`fail`]).
#[inline(always)]
pub(crate) fn guard_int(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    guard(-libc::EFAULT, || f().unwrap_or_else(|e| e))
}

/// `guard` for calls that return a count or an errno.
#[inline(always)]
pub(crate) fn guard_long(f: impl FnOnce() -> Result<isize, c_int>) -> isize {
    guard(-(libc::EFAULT as isize), || {
        f().unwrap_or_else(|e| e as isize)
    })
}

/// A reference from a C pointer, or `-EINVAL` naming the argument.
///
/// # Safety
/// `p` is null or points to a live `T` that no one mutates meanwhile.
pub(crate) unsafe fn obj<'a, T>(p: *const T, what: &str) -> Result<&'a T, c_int> {
    // SAFETY: the caller's contract: null or a live `T`.
    unsafe { p.as_ref() }.ok_or_else(|| fail(libc::EINVAL, format!("{what} is NULL")))
}

/// A mutable reference from a C pointer, or `-EINVAL`.
///
/// # Safety
/// `p` is null or points to a live `T` that only this call uses meanwhile.
pub(crate) unsafe fn obj_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, c_int> {
    // SAFETY: the caller's contract: null or a live `T`, used only here.
    unsafe { p.as_mut() }.ok_or_else(|| fail(libc::EINVAL, format!("{what} is NULL")))
}

/// Write `v` to an out-pointer, or `-EINVAL` when it is null.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub(crate) unsafe fn put<T>(p: *mut T, v: T, what: &str) -> Result<(), c_int> {
    if p.is_null() {
        return Err(fail(libc::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: not null, and the caller's contract says writable.
    unsafe { p.write(v) };
    Ok(())
}

/// A C array as a slice: `n == 0` needs no pointer; otherwise null is
/// `-EINVAL`.
///
/// # Safety
/// `p` is null or valid for reads of `n` elements.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], c_int> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(libc::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: not null, and the caller's contract says `n` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A writable C array as a slice, as [`slice`].
///
/// # Safety
/// `p` is null or valid for reads and writes of `n` elements, used only here.
pub(crate) unsafe fn slice_mut<'a, T>(
    p: *mut T,
    n: usize,
    what: &str,
) -> Result<&'a mut [T], c_int> {
    if n == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(fail(libc::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: not null, and the caller's contract says `n` writable elements.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// The message of the last call that failed on this thread ("" if none).
///
/// **Context:** never blocks. **Returns:** a string owned by the library,
/// valid until the next failing call on this thread; thread-safe (each
/// thread has its own).
#[no_mangle]
pub extern "C" fn iopages_last_error() -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(EMPTY.as_ptr().cast())
}

/// The library's version, "MAJOR.MINOR.PATCH".
///
/// **Context:** never blocks. **Returns:** a static string.
#[no_mangle]
pub extern "C" fn iopages_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopages::Gfp;
    use std::ffi::CStr;

    #[test]
    fn gfp_constants_mirror_the_rust_flags() {
        let pairs = [
            (IOPAGES_GFP_IO, Gfp::IO),
            (IOPAGES_GFP_FS, Gfp::FS),
            (IOPAGES_GFP_DIRECT_RECLAIM, Gfp::DIRECT_RECLAIM),
            (IOPAGES_GFP_KSWAPD_RECLAIM, Gfp::KSWAPD_RECLAIM),
            (IOPAGES_GFP_HIGH, Gfp::HIGH),
            (IOPAGES_GFP_NOWARN, Gfp::NOWARN),
            (IOPAGES_GFP_RETRY_MAYFAIL, Gfp::RETRY_MAYFAIL),
            (IOPAGES_GFP_NOFAIL, Gfp::NOFAIL),
            (IOPAGES_GFP_NORETRY, Gfp::NORETRY),
            (IOPAGES_GFP_MEMALLOC, Gfp::MEMALLOC),
            (IOPAGES_GFP_ZERO, Gfp::ZERO),
            (IOPAGES_GFP_COMP, Gfp::COMP),
            (IOPAGES_GFP_MOVABLE, Gfp::MOVABLE),
            (IOPAGES_GFP_KERNEL, Gfp::KERNEL),
            (IOPAGES_GFP_NOWAIT, Gfp::NOWAIT),
            (IOPAGES_GFP_ATOMIC, Gfp::ATOMIC),
            (IOPAGES_GFP_NOIO, Gfp::NOIO),
            (IOPAGES_GFP_NOFS, Gfp::NOFS),
        ];
        for (c, r) in pairs {
            assert_eq!(c, r.bits(), "{r:?}");
        }
        assert_eq!(IOPAGES_PAGE_SIZE, iopages::PAGE_SIZE);
        assert_eq!(IOPAGES_MAX_ORDER, iopages::MAX_ORDER);
        assert!(gfp(1 << 20).is_err());
    }

    #[test]
    fn errors_are_negative_errnos_with_a_thread_local_message() {
        assert_eq!(fail(libc::EBUSY, "busy\0here"), -libc::EBUSY);
        // SAFETY: the library's string, read before the next failing call.
        let msg = unsafe { CStr::from_ptr(iopages_last_error()) };
        assert_eq!(msg.to_str().unwrap(), "busyhere");
        std::thread::spawn(|| {
            // SAFETY: as above.
            let other = unsafe { CStr::from_ptr(iopages_last_error()) };
            assert_eq!(other.to_bytes(), b"");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_panic_becomes_efault_and_a_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = guard_int(|| panic!("boom"));
        std::panic::set_hook(prev);
        assert_eq!(r, -libc::EFAULT);
        // SAFETY: as above.
        let msg = unsafe { CStr::from_ptr(iopages_last_error()) };
        assert!(msg.to_str().unwrap().contains("boom"));
    }

    #[test]
    fn the_checked_in_header_is_the_generated_one() {
        let fresh = include_str!(concat!(env!("OUT_DIR"), "/iopages.h"));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/iopages.h");
        let checked_in = std::fs::read_to_string(path).unwrap();
        assert!(
            checked_in == fresh,
            "include/iopages.h is stale: regenerate it with \
             IOPAGES_UPDATE_HEADER=1 cargo build -p iopages-ffi"
        );
    }
}
