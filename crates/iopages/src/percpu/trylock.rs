//! A lock that is only ever tried: the per-CPU lists' lock.
//!
//! Owns: mutual exclusion by one compare-and-swap (acquire) and one store
//! (release). Must never: wait or spin — a caller that finds it held goes
//! elsewhere (the zone), because the holder may be a preempted thread that
//! will not release it soon.
//!
//! Generic over the flag type so that the same code is model-checked with
//! `loom` in the tests.

use crate::sync::Flag;
use std::sync::atomic::AtomicBool;

/// A try-only lock. It guards nothing by itself: the owner pairs it with
/// an `UnsafeCell` and touches the cell only while [`TryLock::try_lock`]'s
/// token is alive.
pub(crate) struct TryLock<F: Flag = AtomicBool> {
    flag: F,
}

/// Proof of holding a [`TryLock`]; releases it when dropped.
pub(crate) struct Held<'a, F: Flag = AtomicBool> {
    lock: &'a TryLock<F>,
}

impl<F: Flag> TryLock<F> {
    pub(crate) fn new() -> Self {
        TryLock {
            flag: F::unlocked(),
        }
    }

    /// Take the lock if it is free; never waits.
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<Held<'_, F>> {
        // Build the token only on success: a token dropped after a failed
        // attempt would release somebody else's lock.
        if self.flag.try_set() {
            Some(Held { lock: self })
        } else {
            None
        }
    }
}

impl<F: Flag> Drop for Held<'_, F> {
    #[inline]
    fn drop(&mut self) {
        self.lock.flag.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Guarded {
        lock: TryLock<loom::sync::atomic::AtomicBool>,
        data: loom::cell::UnsafeCell<u32>,
    }
    // SAFETY: `data` is only touched while `lock` is held (what loom checks).
    unsafe impl Sync for Guarded {}

    /// Every interleaving of three threads trying the lock: at most one is
    /// inside at a time (loom's cell reports any overlapping access), and
    /// every successful holder's write is seen by the next holder.
    #[test]
    fn loom_try_lock_is_mutually_exclusive_and_publishes_writes() {
        loom::model(|| {
            let g = loom::sync::Arc::new(Guarded {
                lock: TryLock::new(),
                data: loom::cell::UnsafeCell::new(0),
            });
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let g = g.clone();
                    loom::thread::spawn(move || match g.lock.try_lock() {
                        Some(_held) => {
                            // SAFETY: the lock is held (what loom checks).
                            g.data.with_mut(|d| unsafe { *d += 1 });
                            1
                        }
                        None => 0,
                    })
                })
                .collect();
            let mine = match g.lock.try_lock() {
                Some(_held) => {
                    // SAFETY: the lock is held (what loom checks).
                    g.data.with_mut(|d| unsafe { *d += 1 });
                    1
                }
                None => 0,
            };
            let total: u32 = mine + handles.into_iter().map(|h| h.join().unwrap()).sum::<u32>();
            assert!(total >= 1, "someone must get a free lock");
            let _held = g.lock.try_lock().expect("free after everyone released");
            assert_eq!(
                // SAFETY: the lock is held (what loom checks).
                g.data.with(|d| unsafe { *d }),
                total,
                "a holder's write was lost"
            );
        });
    }

    #[test]
    fn std_try_lock_excludes_and_releases() {
        let l: TryLock = TryLock::new();
        let h = l.try_lock().unwrap();
        assert!(l.try_lock().is_none());
        assert!(
            l.try_lock().is_none(),
            "a failed attempt must not release the holder's lock"
        );
        drop(h);
        assert!(l.try_lock().is_some());
    }
}
