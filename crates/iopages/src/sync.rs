//! The synchronisation shims: one place for the traits that let the
//! lock-free and locked cores run on `std`/`parking_lot` in production and
//! on `loom` in the model tests.
//!
//! Owns: each trait a concurrent core is generic over — [`Flag`] (the
//! per-CPU try-lock), [`RingWord`] and [`SlotCell`] (the depot's ring),
//! [`WaitLock`] and [`SeqWord`] (the mempool reserve), [`Atom64`] and
//! [`Lock`] (the per-CPU counter) — with its production implementation
//! here and its `loom` implementation in [`loom_impls`] (tests only).
//! Must never: add behaviour — every method is the one primitive it names,
//! with the ordering the caller passes or the one its doc states, so the
//! model checks the same protocol the production code runs.

use std::cell::UnsafeCell;
use std::ops::DerefMut;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

// ---- the per-CPU try-lock ------------------------------------------------

/// The atomic flag operations the lock needs.
pub(crate) trait Flag {
    /// An unlocked flag.
    fn unlocked() -> Self;
    /// Set the flag if clear, with acquire ordering; whether it was set.
    fn try_set(&self) -> bool;
    /// Clear the flag with release ordering.
    fn clear(&self);
}

impl Flag for AtomicBool {
    fn unlocked() -> Self {
        AtomicBool::new(false)
    }
    #[inline]
    fn try_set(&self) -> bool {
        self.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }
    #[inline]
    fn clear(&self) {
        self.store(false, Ordering::Release)
    }
}

// ---- the depot's ring ----------------------------------------------------

/// The atomic word operations the ring needs.
pub(crate) trait RingWord: Send + Sync {
    fn new(v: usize) -> Self;
    fn load(&self, o: Ordering) -> usize;
    fn store(&self, v: usize, o: Ordering);
    /// Replace `cur` with `new` (relaxed); the value found on failure.
    fn cas(&self, cur: usize, new: usize) -> Result<usize, usize>;
}

impl RingWord for AtomicUsize {
    fn new(v: usize) -> Self {
        AtomicUsize::new(v)
    }
    #[inline]
    fn load(&self, o: Ordering) -> usize {
        AtomicUsize::load(self, o)
    }
    #[inline]
    fn store(&self, v: usize, o: Ordering) {
        AtomicUsize::store(self, v, o)
    }
    #[inline]
    fn cas(&self, cur: usize, new: usize) -> Result<usize, usize> {
        self.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed)
    }
}

/// A cell whose contents the ring's protocol, not the type system, keeps
/// exclusive.
pub(crate) trait SlotCell<T>: Send + Sync {
    fn new(v: T) -> Self;
    /// Run `f` on the contents.
    ///
    /// # Safety
    /// The caller has claimed the slot (no other access can overlap).
    unsafe fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R;
}

/// The production cell.
pub(crate) struct StdCell<T>(UnsafeCell<T>);

// SAFETY: the ring touches a slot's cell only between claiming the slot
// (a successful compare-and-swap on a position whose sequence matched) and
// publishing it (the release store of the next sequence); the protocol
// gives one thread at a time that window.
unsafe impl<T: Send> Sync for StdCell<T> {}

impl<T: Send> SlotCell<T> for StdCell<T> {
    fn new(v: T) -> Self {
        StdCell(UnsafeCell::new(v))
    }
    #[inline]
    unsafe fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

// ---- the mempool reserve -------------------------------------------------

/// A mutex with a condition variable: what the reserve needs to let callers
/// sleep until an element is freed.
pub(crate) trait WaitLock<T> {
    /// Proof of holding the lock; gives access to the data.
    type Guard<'a>: DerefMut<Target = T>
    where
        Self: 'a;
    /// An unlocked lock around `value`.
    fn new(value: T) -> Self;
    /// Take the lock, sleeping while another thread holds it.
    fn lock(&self) -> Self::Guard<'_>;
    /// Release the lock, sleep until notified (or `timeout` passes; a model
    /// checker may ignore it), and take the lock again. Releasing and
    /// starting to sleep are one step: a notification after the release
    /// wakes this sleeper.
    fn wait<'a>(&'a self, guard: Self::Guard<'a>, timeout: Duration) -> Self::Guard<'a>;
    /// Wake every sleeper.
    fn notify_all(&self);
}

/// The production lock: parking_lot's mutex and condition variable.
pub(crate) struct ParkingWait<T> {
    mutex: parking_lot::Mutex<T>,
    cv: parking_lot::Condvar,
}

impl<T> WaitLock<T> for ParkingWait<T> {
    type Guard<'a>
        = parking_lot::MutexGuard<'a, T>
    where
        Self: 'a;

    fn new(value: T) -> Self {
        ParkingWait {
            mutex: parking_lot::Mutex::new(value),
            cv: parking_lot::Condvar::new(),
        }
    }

    #[inline]
    fn lock(&self) -> Self::Guard<'_> {
        self.mutex.lock()
    }

    fn wait<'a>(&'a self, mut guard: Self::Guard<'a>, timeout: Duration) -> Self::Guard<'a> {
        self.cv.wait_for(&mut guard, timeout);
        guard
    }

    fn notify_all(&self) {
        self.cv.notify_all();
    }
}

/// A word read without the lock, sequentially consistent (the mempool
/// reserve's length, its keep limit).
pub(crate) trait SeqWord {
    fn new(v: usize) -> Self;
    fn get(&self) -> usize;
    fn set(&self, v: usize);
}

impl SeqWord for AtomicUsize {
    fn new(v: usize) -> Self {
        AtomicUsize::new(v)
    }
    // Sequentially consistent: a free that reads the reserve as full and
    // sends its element to the source must be ordered against the take that
    // emptied it (which then finds the element's owner still counted).
    #[inline]
    fn get(&self) -> usize {
        self.load(Ordering::SeqCst)
    }
    #[inline]
    fn set(&self, v: usize) {
        self.store(v, Ordering::SeqCst)
    }
}

// ---- the per-CPU counter -------------------------------------------------

/// The 64-bit atomic operations the counter needs.
pub(crate) trait Atom64 {
    fn new(v: u64) -> Self;
    fn load(&self, o: Ordering) -> u64;
    fn store(&self, v: u64, o: Ordering);
    fn swap(&self, v: u64, o: Ordering) -> u64;
    fn compare_exchange(
        &self,
        cur: u64,
        new: u64,
        ok: Ordering,
        err: Ordering,
    ) -> std::result::Result<u64, u64>;
}

impl Atom64 for AtomicU64 {
    fn new(v: u64) -> Self {
        AtomicU64::new(v)
    }
    #[inline]
    fn load(&self, o: Ordering) -> u64 {
        AtomicU64::load(self, o)
    }
    #[inline]
    fn store(&self, v: u64, o: Ordering) {
        AtomicU64::store(self, v, o)
    }
    #[inline]
    fn swap(&self, v: u64, o: Ordering) -> u64 {
        AtomicU64::swap(self, v, o)
    }
    #[inline]
    fn compare_exchange(
        &self,
        cur: u64,
        new: u64,
        ok: Ordering,
        err: Ordering,
    ) -> std::result::Result<u64, u64> {
        AtomicU64::compare_exchange(self, cur, new, ok, err)
    }
}

/// A mutex around the locked paths' statistics.
pub(crate) trait Lock<T> {
    type Guard<'a>: DerefMut<Target = T>
    where
        Self: 'a;
    fn new(v: T) -> Self;
    fn lock(&self) -> Self::Guard<'_>;
}

impl<T> Lock<T> for parking_lot::Mutex<T> {
    type Guard<'a>
        = parking_lot::MutexGuard<'a, T>
    where
        Self: 'a;
    fn new(v: T) -> Self {
        parking_lot::Mutex::new(v)
    }
    #[inline]
    fn lock(&self) -> Self::Guard<'_> {
        parking_lot::Mutex::lock(self)
    }
}

/// The `loom` implementations of every shim, for the model tests.
#[cfg(test)]
pub(crate) mod loom_impls {
    use super::*;

    impl Flag for loom::sync::atomic::AtomicBool {
        fn unlocked() -> Self {
            loom::sync::atomic::AtomicBool::new(false)
        }
        fn try_set(&self) -> bool {
            self.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        }
        fn clear(&self) {
            self.store(false, Ordering::Release)
        }
    }

    impl RingWord for loom::sync::atomic::AtomicUsize {
        fn new(v: usize) -> Self {
            loom::sync::atomic::AtomicUsize::new(v)
        }
        fn load(&self, o: Ordering) -> usize {
            loom::sync::atomic::AtomicUsize::load(self, o)
        }
        fn store(&self, v: usize, o: Ordering) {
            loom::sync::atomic::AtomicUsize::store(self, v, o)
        }
        fn cas(&self, cur: usize, new: usize) -> Result<usize, usize> {
            self.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed)
        }
    }

    pub(crate) struct LoomCell<T>(loom::cell::UnsafeCell<T>);
    // SAFETY: loom checks the exclusivity the ring promises.
    unsafe impl<T: Send> Sync for LoomCell<T> {}
    impl<T: Send> SlotCell<T> for LoomCell<T> {
        fn new(v: T) -> Self {
            LoomCell(loom::cell::UnsafeCell::new(v))
        }
        unsafe fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            self.0.with_mut(f)
        }
    }

    pub(crate) struct LoomWait<T> {
        mutex: loom::sync::Mutex<T>,
        cv: loom::sync::Condvar,
    }

    impl<T> WaitLock<T> for LoomWait<T> {
        type Guard<'a>
            = loom::sync::MutexGuard<'a, T>
        where
            Self: 'a;
        fn new(value: T) -> Self {
            LoomWait {
                mutex: loom::sync::Mutex::new(value),
                cv: loom::sync::Condvar::new(),
            }
        }
        fn lock(&self) -> Self::Guard<'_> {
            self.mutex.lock().unwrap()
        }
        // loom's timed wait never times out: a lost wake-up is a deadlock
        // that the model reports.
        fn wait<'a>(&'a self, guard: Self::Guard<'a>, timeout: Duration) -> Self::Guard<'a> {
            self.cv.wait_timeout(guard, timeout).unwrap().0
        }
        fn notify_all(&self) {
            self.cv.notify_all();
        }
    }

    impl SeqWord for loom::sync::atomic::AtomicUsize {
        fn new(v: usize) -> Self {
            loom::sync::atomic::AtomicUsize::new(v)
        }
        fn get(&self) -> usize {
            self.load(Ordering::SeqCst)
        }
        fn set(&self, v: usize) {
            self.store(v, Ordering::SeqCst)
        }
    }

    impl Atom64 for loom::sync::atomic::AtomicU64 {
        fn new(v: u64) -> Self {
            loom::sync::atomic::AtomicU64::new(v)
        }
        fn load(&self, o: Ordering) -> u64 {
            loom::sync::atomic::AtomicU64::load(self, o)
        }
        fn store(&self, v: u64, o: Ordering) {
            loom::sync::atomic::AtomicU64::store(self, v, o)
        }
        fn swap(&self, v: u64, o: Ordering) -> u64 {
            loom::sync::atomic::AtomicU64::swap(self, v, o)
        }
        fn compare_exchange(
            &self,
            cur: u64,
            new: u64,
            ok: Ordering,
            err: Ordering,
        ) -> std::result::Result<u64, u64> {
            loom::sync::atomic::AtomicU64::compare_exchange(self, cur, new, ok, err)
        }
    }

    impl<T> Lock<T> for loom::sync::Mutex<T> {
        type Guard<'a>
            = loom::sync::MutexGuard<'a, T>
        where
            Self: 'a;
        fn new(v: T) -> Self {
            loom::sync::Mutex::new(v)
        }
        fn lock(&self) -> Self::Guard<'_> {
            loom::sync::Mutex::lock(self).unwrap()
        }
    }
}
