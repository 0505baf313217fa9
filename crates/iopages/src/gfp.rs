//! Allocation context flags (`Gfp`) and the scoped NOIO/NOFS guards.
//!
//! Owns: the meaning of every flag and the kernel's named sets, and the
//! thread-local scope that masks I/O and file-system reclaim. Must never:
//! be consulted on the allocation fast path — flags only matter once an
//! allocation leaves the per-thread and per-CPU caches.

use std::cell::Cell;

bitflags::bitflags! {
    /// What an allocation may do to succeed, in the kernel's vocabulary.
    ///
    /// Use the named sets ([`Gfp::KERNEL`], [`Gfp::NOWAIT`], [`Gfp::ATOMIC`],
    /// [`Gfp::NOIO`], [`Gfp::NOFS`]) and add modifiers with `|`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Gfp: u32 {
        /// May start I/O to free memory (shrinkers that write back).
        const IO = 1 << 0;
        /// May call into file-system code to free memory.
        const FS = 1 << 1;
        /// May block and run reclaim (shrinkers, compaction) in the caller.
        const DIRECT_RECLAIM = 1 << 2;
        /// May wake the background reclaimer.
        const KSWAPD_RECLAIM = 1 << 3;
        /// High priority: may dip below the min watermark (to half of it).
        const HIGH = 1 << 4;
        /// Do not log a failure.
        const NOWARN = 1 << 5;
        /// Retry while reclaim makes progress; fail rather than loop forever.
        const RETRY_MAYFAIL = 1 << 6;
        /// Never fail: block and retry until memory appears.
        const NOFAIL = 1 << 7;
        /// One round of reclaim at most, no compaction retries.
        const NORETRY = 1 << 8;
        /// Ignore watermarks entirely (the reclaimer's own allocations).
        const MEMALLOC = 1 << 9;
        /// Zero the memory before returning it.
        const ZERO = 1 << 10;
        /// Mark a higher-order block as a compound page (head + tails).
        const COMP = 1 << 11;
        /// The caller can migrate these pages (grouped for compaction).
        const MOVABLE = 1 << 12;

        /// Both reclaim modes.
        const RECLAIM = Self::DIRECT_RECLAIM.bits() | Self::KSWAPD_RECLAIM.bits();
        /// Ordinary allocation: may block, reclaim, do I/O and FS calls.
        const KERNEL = Self::RECLAIM.bits() | Self::IO.bits() | Self::FS.bits();
        /// Never blocks, wakes background reclaim, fails quietly.
        const NOWAIT = Self::KSWAPD_RECLAIM.bits() | Self::NOWARN.bits();
        /// Never blocks, may use part of the emergency reserve.
        const ATOMIC = Self::HIGH.bits() | Self::KSWAPD_RECLAIM.bits();
        /// May block and reclaim, but must not start I/O.
        const NOIO = Self::RECLAIM.bits();
        /// May block, reclaim and do I/O, but must not enter a file system.
        const NOFS = Self::RECLAIM.bits() | Self::IO.bits();
    }
}

impl Gfp {
    /// Whether an allocation with these flags may put the caller to sleep.
    #[inline]
    pub fn may_block(self) -> bool {
        self.contains(Gfp::DIRECT_RECLAIM)
    }

    /// These flags as the current thread's NOIO/NOFS scope allows them
    /// (the kernel's `current_gfp_context`).
    pub fn in_current_scope(self) -> Gfp {
        let scope = SCOPE.with(|s| s.get());
        let mut gfp = self;
        if scope.noio > 0 {
            gfp.remove(Gfp::IO | Gfp::FS);
        } else if scope.nofs > 0 {
            gfp.remove(Gfp::FS);
        }
        gfp
    }
}

#[derive(Clone, Copy, Default)]
struct Scope {
    noio: u32,
    nofs: u32,
}

thread_local! {
    static SCOPE: Cell<Scope> = const { Cell::new(Scope { noio: 0, nofs: 0 }) };
}

/// Inside this scope the thread's allocations may not start I/O or enter a
/// file system, whatever flags they pass (the kernel's
/// `memalloc_noio_save`). Scopes nest; dropping the guard restores the
/// previous state.
#[must_use = "the scope ends when the guard is dropped"]
pub struct NoioScope {
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Inside this scope the thread's allocations may not enter a file system
/// (the kernel's `memalloc_nofs_save`). Scopes nest.
#[must_use = "the scope ends when the guard is dropped"]
pub struct NofsScope {
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Enter a NOIO scope on the current thread.
pub fn memalloc_noio_scope() -> NoioScope {
    SCOPE.with(|s| {
        let mut v = s.get();
        v.noio += 1;
        s.set(v);
    });
    NoioScope {
        _not_send: std::marker::PhantomData,
    }
}

/// Enter a NOFS scope on the current thread.
pub fn memalloc_nofs_scope() -> NofsScope {
    SCOPE.with(|s| {
        let mut v = s.get();
        v.nofs += 1;
        s.set(v);
    });
    NofsScope {
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for NoioScope {
    fn drop(&mut self) {
        SCOPE.with(|s| {
            let mut v = s.get();
            debug_assert!(v.noio > 0, "NOIO scope underflow");
            v.noio -= 1;
            s.set(v);
        });
    }
}

impl Drop for NofsScope {
    fn drop(&mut self) {
        SCOPE.with(|s| {
            let mut v = s.get();
            debug_assert!(v.nofs > 0, "NOFS scope underflow");
            v.nofs -= 1;
            s.set(v);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_sets_match_the_kernel() {
        assert!(Gfp::KERNEL.may_block());
        assert!(Gfp::NOIO.may_block());
        assert!(Gfp::NOFS.may_block());
        assert!(!Gfp::NOWAIT.may_block());
        assert!(!Gfp::ATOMIC.may_block());
        assert!(Gfp::ATOMIC.contains(Gfp::HIGH));
        assert!(!Gfp::NOIO.contains(Gfp::IO));
        assert!(Gfp::NOFS.contains(Gfp::IO) && !Gfp::NOFS.contains(Gfp::FS));
    }

    #[test]
    fn noio_scope_masks_io_and_fs_and_nests() {
        assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::KERNEL);
        {
            let _outer = memalloc_noio_scope();
            {
                let _inner = memalloc_noio_scope();
                assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::NOIO);
            }
            assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::NOIO);
        }
        assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::KERNEL);
    }

    #[test]
    fn nofs_scope_masks_fs_only() {
        let _g = memalloc_nofs_scope();
        assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::NOFS);
        let _n = memalloc_noio_scope();
        assert_eq!(Gfp::KERNEL.in_current_scope(), Gfp::NOIO);
    }

    #[test]
    fn scope_is_per_thread() {
        let _g = memalloc_noio_scope();
        let other = std::thread::spawn(|| Gfp::KERNEL.in_current_scope())
            .join()
            .unwrap();
        assert_eq!(other, Gfp::KERNEL);
    }
}
