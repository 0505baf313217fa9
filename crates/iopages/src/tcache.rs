//! Per-thread page caches (magazines) in front of the per-CPU lists.
//!
//! Owns: one small stack of free blocks per order 0..=3 for each (thread,
//! allocator) pair, and the thread-local table that finds it. Must never:
//! be touched by any thread but its owner (other threads only read its
//! published counts), or hold more than its capacity.
//!
//! Why it exists: a per-CPU list has to be locked, because the thread can
//! migrate or be preempted while it holds the list. Taking that lock (an
//! atomic compare-and-swap) and asking for the CPU costs more than the whole
//! single-page budget. A cache that belongs to the thread needs no lock at
//! all. The price is stranded pages: each thread that allocated keeps at
//! most `capacity` blocks per order that no other thread can use until the
//! owner frees through them, calls [`crate::PageAllocator::flush_thread_cache`],
//! drains, or exits. The bound is published in [`crate::Stats`].

use crate::frame::Page;
use crate::pcp::PCP_ORDERS;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// One thread's cache for one allocator.
pub(crate) struct Tcache {
    stacks: [UnsafeCell<Vec<Page>>; PCP_ORDERS],
    pub cap: [usize; PCP_ORDERS],
    /// Pages held, published for accounting by other threads.
    nr_pages: AtomicUsize,
    pub allocs: AtomicU64,
    pub frees: AtomicU64,
    pub refills: AtomicU64,
    pub flushes: AtomicU64,
    pub bulk_allocs: AtomicU64,
    pub bulk_frees: AtomicU64,
}

// SAFETY: `stacks` is only touched by the owning thread (the one whose
// thread-local table holds this cache, or whose exit is flushing it); other
// threads read only the atomics.
unsafe impl Sync for Tcache {}
// SAFETY: as above; the cache moves between threads only inside an `Arc`
// that the registry holds for reading counts.
unsafe impl Send for Tcache {}

impl Tcache {
    pub(crate) fn new(cap: [usize; PCP_ORDERS]) -> Tcache {
        Tcache {
            stacks: std::array::from_fn(|o| UnsafeCell::new(Vec::with_capacity(cap[o]))),
            cap,
            nr_pages: AtomicUsize::new(0),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            refills: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            bulk_allocs: AtomicU64::new(0),
            bulk_frees: AtomicU64::new(0),
        }
    }

    /// The owner's stack of `order`.
    ///
    /// # Safety
    /// Only the owning thread may call this, and it must not keep two
    /// results alive at once.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn stack(&self, order: u32) -> &mut Vec<Page> {
        &mut *self.stacks[order as usize].get()
    }

    /// Record that the owner added (`+`) or removed (`-`) pages.
    #[inline]
    pub(crate) fn account(&self, delta_pages: isize) {
        let v = self.nr_pages.load(Relaxed) as isize + delta_pages;
        debug_assert!(v >= 0);
        self.nr_pages.store(v as usize, Relaxed);
    }

    /// Pages held (racy snapshot).
    pub(crate) fn nr_pages(&self) -> usize {
        self.nr_pages.load(Relaxed)
    }

    /// Most pages this cache can hold.
    pub(crate) fn max_pages(&self) -> usize {
        (0..PCP_ORDERS).map(|o| self.cap[o] << o).sum()
    }
}

/// Who owns a registered cache: the allocator's identity, so a cache
/// outlives neither the allocator's usefulness nor its identity.
pub(crate) trait Owner: Send + Sync + 'static {
    fn id(&self) -> u64;
    fn tcache_cap(&self) -> [usize; PCP_ORDERS];
    fn tcache_register(&self, tc: &Arc<Tcache>);
    /// Flush `tc` into the allocator and drop it from the registry (the
    /// owning thread is exiting).
    fn tcache_retire(&self, tc: &Tcache);
}

struct Entry<O: Owner> {
    id: u64,
    owner: Weak<O>,
    tc: Arc<Tcache>,
}

/// The thread's table of caches, one per allocator it used.
pub(crate) struct ThreadCaches<O: Owner> {
    entries: UnsafeCell<Vec<Entry<O>>>,
}

impl<O: Owner> ThreadCaches<O> {
    pub(crate) const fn new() -> Self {
        ThreadCaches {
            entries: UnsafeCell::new(Vec::new()),
        }
    }

    /// This thread's cache for `owner`, creating it on first use. The
    /// common case (the thread's most recently used allocator) is one load
    /// and one compare.
    #[inline]
    pub(crate) fn get(&self, owner: &Arc<O>) -> &Tcache {
        // SAFETY: the table is thread-local and no reference into the Vec
        // escapes across a call that could modify it (see `slow_get`).
        let entries = unsafe { &*self.entries.get() };
        if let Some(e) = entries.first() {
            if e.id == owner.id() {
                return &e.tc;
            }
        }
        self.slow_get(owner)
    }

    #[cold]
    fn slow_get(&self, owner: &Arc<O>) -> &Tcache {
        // SAFETY: thread-local; the shared borrow taken in `get` is no
        // longer used.
        let entries = unsafe { &mut *self.entries.get() };
        // Forget caches of allocators that no longer exist.
        entries.retain(|e| e.owner.strong_count() > 0);
        let id = owner.id();
        match entries.iter().position(|e| e.id == id) {
            Some(i) => entries.swap(0, i),
            None => {
                let tc = Arc::new(Tcache::new(owner.tcache_cap()));
                owner.tcache_register(&tc);
                entries.push(Entry {
                    id,
                    owner: Arc::downgrade(owner),
                    tc,
                });
                let last = entries.len() - 1;
                entries.swap(0, last);
            }
        }
        &entries[0].tc
    }

    /// This thread's cache for `owner` if it has one (never creates).
    pub(crate) fn existing(&self, id: u64) -> Option<&Tcache> {
        // SAFETY: thread-local; see `get`.
        let entries = unsafe { &*self.entries.get() };
        entries.iter().find(|e| e.id == id).map(|e| &*e.tc)
    }
}

impl<O: Owner> Drop for ThreadCaches<O> {
    fn drop(&mut self) {
        for e in self.entries.get_mut().drain(..) {
            if let Some(owner) = e.owner.upgrade() {
                owner.tcache_retire(&e.tc);
            }
        }
    }
}
