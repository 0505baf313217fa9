//! Per-CPU counters (`lib/percpu_counter.c`).

use crate::{fail, guard, guard_int, obj, put};
use iopages::PercpuCounter;
use std::cmp::Ordering;
use std::ffi::c_int;

/// A per-CPU counter: cheap adds and rough reads that never contend, an
/// exact sum when asked, and a limit that holds under races.
///
/// **Thread safety:** every call may be made from any number of threads at
/// once, except `iopages_counter_destroy`.
pub struct iopages_counter {
    c: PercpuCounter,
}

/// Create a counter starting at `initial` into `*out`. `nr_slots` and
/// `batch` 0 mean the defaults (one slot per CPU; a batch from the CPU
/// count).
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for a bad setting or
/// NULL `out`.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_create(
    initial: i64,
    nr_slots: usize,
    batch: i64,
    out: *mut *mut iopages_counter,
) -> c_int {
    guard_int(|| {
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let c = if nr_slots == 0 && batch == 0 {
            PercpuCounter::new(initial)
        } else {
            let slots = if nr_slots == 0 {
                PercpuCounter::new(0).nr_slots()
            } else {
                nr_slots
            };
            let batch = if batch == 0 {
                iopages::default_batch(slots)
            } else {
                batch
            };
            PercpuCounter::with_settings(initial, slots, batch)
                .map_err(|e| fail(libc::EINVAL, e.to_string()))?
        };
        let p = Box::into_raw(Box::new(iopages_counter { c }));
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(p) };
        Ok(0)
    })
}

/// Destroy a counter.
///
/// **Context:** never blocks. **Returns:** 0 (NULL does nothing).
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_destroy(c: *mut iopages_counter) -> c_int {
    guard_int(|| {
        if !c.is_null() {
            // SAFETY: a counter from `iopages_counter_create`, given back once.
            drop(unsafe { Box::from_raw(c) });
        }
        Ok(0)
    })
}

/// Add `amount` (negative to subtract) to this CPU's slot; folded into the
/// total when the slot passes the batch.
///
/// **Context:** never blocks (a fold takes the counter's lock briefly).
/// **Returns:** 0; -EINVAL for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_add(c: *const iopages_counter, amount: i64) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { obj(c, "counter")? }.c.add(amount);
        Ok(0)
    })
}

/// The rough count: the folded total without the slots (within
/// `iopages_counter_error_bound` of the exact total). Never contends.
///
/// **Context:** never blocks. **Returns:** the count; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_read(c: *const iopages_counter) -> i64 {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { c.as_ref() }.map_or(0, |c| c.c.read())
    })
}

/// `iopages_counter_read`, clamped at 0.
///
/// **Context:** never blocks. **Returns:** the count; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_read_positive(c: *const iopages_counter) -> i64 {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { c.as_ref() }.map_or(0, |c| c.c.read_positive())
    })
}

/// The exact total: the folded count plus every slot.
///
/// **Context:** takes the counter's lock (may wait for another summer);
/// O(slots). **Returns:** the total; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_sum(c: *const iopages_counter) -> i64 {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { c.as_ref() }.map_or(0, |c| c.c.sum())
    })
}

/// `iopages_counter_sum`, clamped at 0.
///
/// **Context:** as `iopages_counter_sum`. **Returns:** the total; 0 for
/// NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_sum_positive(c: *const iopages_counter) -> i64 {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { c.as_ref() }.map_or(0, |c| c.c.sum_positive())
    })
}

/// Compare the total with `rhs`, from the rough count when that decides,
/// else from the exact sum.
///
/// **Context:** takes the lock only near `rhs`. **Returns:** -1, 0 or 1
/// (total less than, equal to, greater than `rhs`); -EINVAL for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_compare(c: *const iopages_counter, rhs: i64) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live counter.
        let c = unsafe { obj(c, "counter")? };
        Ok(match c.c.compare(rhs) {
            Ordering::Less => -1,
            Ordering::Equal => 0,
            Ordering::Greater => 1,
        })
    })
}

/// Add `amount` only if the exact total stays within `limit` (at most
/// `limit` for `amount > 0`, at least `limit` for `amount < 0`). The limit
/// holds under races when every increase goes through this call.
///
/// **Context:** one compare-and-swap far from the limit; near it, takes
/// the counter's lock. **Returns:** 1 if added, 0 if not; -EINVAL for
/// NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_limited_add(
    c: *const iopages_counter,
    limit: i64,
    amount: i64,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live counter.
        let c = unsafe { obj(c, "counter")? };
        Ok(c_int::from(c.c.limited_add(limit, amount)))
    })
}

/// Set the total to `value` (slots cleared).
///
/// **Context:** takes the counter's lock. **Returns:** 0; -EINVAL for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_set(c: *const iopages_counter, value: i64) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live counter.
        unsafe { obj(c, "counter")? }.c.set(value);
        Ok(0)
    })
}

/// How far `iopages_counter_read` may be from the exact total.
///
/// **Context:** never blocks. **Returns:** the bound into `*out`, 0;
/// -EINVAL for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_counter_error_bound(
    c: *const iopages_counter,
    out: *mut i64,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live counter.
        let c = unsafe { obj(c, "counter")? };
        // SAFETY: the caller passes NULL or a writable i64.
        unsafe { put(out, c.c.error_bound(), "out")? };
        Ok(0)
    })
}
