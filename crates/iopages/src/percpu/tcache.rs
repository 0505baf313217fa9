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

use crate::buddy::arena::Arena;
use crate::buddy::frame::{copy_pages, Page};
use crate::percpu::pcp::PCP_ORDERS;
use std::cell::{Cell, UnsafeCell};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// One thread's cache for one allocator: a fixed-capacity stack of blocks
/// per order. The stack lengths are atomics written only by the owner with
/// plain stores, so other threads can count the cached pages without
/// touching the stacks.
pub(crate) struct Tcache {
    bufs: [UnsafeCell<Box<[MaybeUninit<Page>]>>; PCP_ORDERS],
    lens: [AtomicUsize; PCP_ORDERS],
    pub cap: [usize; PCP_ORDERS],
    /// The order-0 length below which a fast-path free may push: the
    /// capacity, or 0 for a careful allocator (checks on, or every call
    /// counted), whose frees all take the careful path.
    pub fast_cap: usize,
    pub allocs: AtomicU64,
    pub frees: AtomicU64,
    pub refills: AtomicU64,
    pub flushes: AtomicU64,
    pub bulk_allocs: AtomicU64,
    pub bulk_frees: AtomicU64,
}

// SAFETY: the stacks are only touched by the owning thread (the one whose
// thread-local table holds this cache, or whose exit is flushing it), as the
// `unsafe fn`s below require; other threads read only the atomics.
unsafe impl Sync for Tcache {}
// SAFETY: as above; the cache moves between threads only inside an `Arc`
// that the registry holds for reading counts.
unsafe impl Send for Tcache {}

impl Tcache {
    pub(crate) fn new(cap: [usize; PCP_ORDERS], careful: bool) -> Tcache {
        Tcache {
            fast_cap: if careful { 0 } else { cap[0] },
            bufs: std::array::from_fn(|o| {
                UnsafeCell::new((0..cap[o]).map(|_| MaybeUninit::zeroed()).collect())
            }),
            lens: Default::default(),
            cap,
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            refills: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            bulk_allocs: AtomicU64::new(0),
            bulk_frees: AtomicU64::new(0),
        }
    }

    /// The stack buffer of `order`.
    ///
    /// # Safety
    /// Owner thread only (see the type's notes), and no other reference
    /// from `buf` for the same order may be alive. Every `unsafe fn` below
    /// has the same owner-thread precondition; the others each one states
    /// are also `debug_assert`ed.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    unsafe fn buf(&self, order: u32) -> &mut [MaybeUninit<Page>] {
        // SAFETY: only the owner thread touches the stacks, and it keeps
        // one reference per order at a time (the caller's promise).
        unsafe { &mut *self.bufs[order as usize].get() }
    }

    /// Blocks held of `order`.
    #[inline]
    pub(crate) fn len(&self, order: u32) -> usize {
        self.lens[order as usize].load(Relaxed)
    }

    /// The shared count of blocks held of `order` (for
    /// [`crate::LocalFastPath`]).
    pub(crate) fn len_ptr(&self, order: u32) -> *const AtomicUsize {
        &self.lens[order as usize]
    }

    #[inline]
    pub(crate) fn set_len(&self, order: u32, n: usize) {
        debug_assert!(n <= self.cap[order as usize]);
        self.lens[order as usize].store(n, Relaxed);
    }

    /// The stack of `order` as a raw pointer to its first slot (the buffer
    /// never moves while the cache lives).
    ///
    /// # Safety
    /// Owner only; writes through it must keep `len` slots initialised.
    #[inline]
    pub(crate) unsafe fn raw(&self, order: u32) -> *mut Page {
        // SAFETY: owner thread (the caller's promise).
        unsafe { self.buf(order) }.as_mut_ptr().cast::<Page>()
    }

    /// The fast path's pop: the most recently cached block when more than
    /// `floor` are cached (`floor`: [`crate::fault::FaultInjector::alloc_floor`]),
    /// with no other test — no statistics, no preparation, no checks.
    ///
    /// # Safety
    /// Owner thread only.
    #[inline(always)]
    pub(crate) unsafe fn pop_unchecked(&self, order: u32, floor: usize) -> Option<Page> {
        let n = self.len(order);
        if n <= floor {
            return None;
        }
        debug_assert!(n <= self.cap[order as usize]);
        self.set_len(order, n - 1);
        // SAFETY: owner thread; slots below the old `len` are initialised.
        Some(unsafe { self.buf(order)[n - 1].assume_init() })
    }

    /// The fast path's push of an order-0 block: `false` (nothing done)
    /// unless the stack is below [`Tcache::fast_cap`]; no other test.
    ///
    /// # Safety
    /// Owner thread only; the caller owns `page`.
    #[inline(always)]
    pub(crate) unsafe fn push_unchecked(&self, page: Page) -> bool {
        let n = self.len(0);
        if n >= self.fast_cap {
            return false;
        }
        debug_assert!(self.fast_cap <= self.cap[0]);
        // SAFETY: owner thread; `n < fast_cap <= cap`.
        unsafe { self.buf(0)[n].write(page) };
        self.set_len(0, n + 1);
        true
    }

    /// Pop the most recently cached block.
    ///
    /// # Safety
    /// Owner thread only.
    #[inline]
    pub(crate) unsafe fn pop(&self, order: u32) -> Option<Page> {
        let n = self.len(order);
        if n == 0 {
            return None;
        }
        self.set_len(order, n - 1);
        // SAFETY: owner thread; slots below the old `len` are initialised.
        Some(unsafe { self.buf(order)[n - 1].assume_init() })
    }

    /// Push a block; `false` (and nothing done) when the stack is full.
    ///
    /// # Safety
    /// Owner thread only.
    #[inline]
    pub(crate) unsafe fn push(&self, order: u32, page: Page) -> bool {
        let n = self.len(order);
        if n == self.cap[order as usize] {
            return false;
        }
        // SAFETY: owner thread.
        let buf = unsafe { self.buf(order) };
        buf[n].write(page);
        self.set_len(order, n + 1);
        true
    }

    /// Push `pages`.
    ///
    /// # Safety
    /// Owner thread only; `pages` must fit (`len + pages.len() <= cap`,
    /// asserted in debug builds; slicing panics otherwise).
    #[inline]
    pub(crate) unsafe fn extend(&self, order: u32, pages: &[Page]) {
        let n = self.len(order);
        debug_assert!(n + pages.len() <= self.cap[order as usize]);
        // SAFETY: owner thread.
        let dst = &mut unsafe { self.buf(order) }[n..n + pages.len()];
        // SAFETY: `MaybeUninit<Page>` has `Page`'s layout; the ranges have
        // equal length and belong to different allocations.
        unsafe { copy_pages(dst.as_mut_ptr().cast::<Page>(), pages.as_ptr(), pages.len()) };
        self.set_len(order, n + pages.len());
    }

    /// The `k` most recently cached blocks, removed from the stack. The
    /// slice stays valid until the next push.
    ///
    /// # Safety
    /// Owner thread only; `k <= len` (asserted in debug builds); the slice
    /// must be dropped before the next write to this order's stack.
    #[inline]
    pub(crate) unsafe fn take_top(&self, order: u32, k: usize) -> &[Page] {
        let n = self.len(order);
        debug_assert!(k <= n);
        self.set_len(order, n - k);
        // SAFETY: owner thread.
        let run = &unsafe { self.buf(order) }[n - k..n];
        // SAFETY: those slots are initialised; `MaybeUninit<Page>` has
        // `Page`'s layout.
        unsafe { std::slice::from_raw_parts(run.as_ptr().cast::<Page>(), k) }
    }

    /// The `k` oldest blocks, for handing back; remove them with
    /// [`Tcache::remove_bottom`] once they have been given away.
    ///
    /// # Safety
    /// Owner thread only; `k <= len` (asserted in debug builds); the slice
    /// must be dropped before the next write to this order's stack.
    #[inline]
    pub(crate) unsafe fn bottom(&self, order: u32, k: usize) -> &[Page] {
        debug_assert!(k <= self.len(order));
        // SAFETY: owner thread.
        let run = &unsafe { self.buf(order) }[..k];
        // SAFETY: as in `take_top`.
        unsafe { std::slice::from_raw_parts(run.as_ptr().cast::<Page>(), k) }
    }

    /// Drop the `k` oldest blocks, moving the rest down.
    ///
    /// # Safety
    /// Owner thread only; `k <= len` (asserted in debug builds).
    pub(crate) unsafe fn remove_bottom(&self, order: u32, k: usize) {
        let n = self.len(order);
        debug_assert!(k <= n);
        // SAFETY: owner thread.
        let buf = unsafe { self.buf(order) };
        buf.copy_within(k..n, 0);
        self.set_len(order, n - k);
    }

    /// Free room for blocks of `order`, filled with [`Tcache::commit`].
    ///
    /// # Safety
    /// Owner thread only; the slice must be dropped before any other call
    /// on this order's stack.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn spare(&self, order: u32) -> &mut [MaybeUninit<Page>] {
        let n = self.len(order);
        // SAFETY: owner thread.
        let buf = unsafe { self.buf(order) };
        &mut buf[n..]
    }

    /// Count `k` blocks written into [`Tcache::spare`] as cached.
    ///
    /// # Safety
    /// Owner thread only; the first `k` slots of [`Tcache::spare`] have been
    /// written, and `len + k <= cap` (asserted in debug builds).
    #[inline]
    pub(crate) unsafe fn commit(&self, order: u32, k: usize) {
        debug_assert!(self.len(order) + k <= self.cap[order as usize]);
        self.set_len(order, self.len(order) + k);
    }

    /// Assert the stacks' invariants (allocation checks run this where the
    /// cache meets the per-CPU lists and the depot): no stack above its
    /// capacity, every block in the arena and aligned to its order.
    ///
    /// # Safety
    /// Owner thread only.
    #[cold]
    pub(crate) unsafe fn check(&self, arena: &Arena) {
        for order in 0..PCP_ORDERS as u32 {
            let n = self.len(order);
            assert!(
                n <= self.cap[order as usize],
                "thread cache of order {order} holds {n} blocks, above its capacity {}",
                self.cap[order as usize]
            );
            // SAFETY: owner thread (the caller's promise); `n` slots are
            // initialised.
            for &p in unsafe { self.bottom(order, n) } {
                arena.check_block(p, order, "thread cache");
            }
        }
    }

    /// Pages held (racy snapshot from other threads; exact from the owner).
    pub(crate) fn nr_pages(&self) -> usize {
        (0..PCP_ORDERS).map(|o| self.len(o as u32) << o).sum()
    }
}

/// Who owns a registered cache: the allocator's identity, so a cache
/// outlives neither the allocator's usefulness nor its identity.
pub(crate) trait Owner: Send + Sync + 'static {
    fn id(&self) -> u64;
    fn tcache_cap(&self) -> [usize; PCP_ORDERS];
    /// Whether every call takes the careful path (checks on, or every
    /// call counted): new caches then refuse fast-path frees.
    fn careful(&self) -> bool;
    fn tcache_register(&self, tc: &Arc<Tcache>);
    /// Flush `tc` into the allocator and drop it from the registry (the
    /// owning thread is exiting).
    fn tcache_retire(&self, tc: &Tcache);
}

thread_local! {
    /// The thread's most recently used cache: (allocator id, cache). Plain
    /// data with no destructor, so reading it is one thread-local load with
    /// no "initialised yet?" check; the table below keeps the cache alive
    /// and clears this when the thread exits. Allocator ids are never
    /// reused, so an entry for a dropped allocator is never matched again.
    pub(crate) static LAST: Cell<(u64, *const Tcache)> = const { Cell::new((0, std::ptr::null())) };
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
                let tc = Arc::new(Tcache::new(owner.tcache_cap(), owner.careful()));
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
        let tc: &Tcache = &entries[0].tc;
        let _ = LAST.try_with(|l| l.set((id, tc)));
        tc
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
        let _ = LAST.try_with(|l| l.set((0, std::ptr::null())));
        for e in self.entries.get_mut().drain(..) {
            if let Some(owner) = e.owner.upgrade() {
                owner.tcache_retire(&e.tc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buddy::arena::HugePages;

    fn arena() -> Arena {
        Arena::new(4 << 20, HugePages::Never, false).unwrap()
    }

    #[test]
    fn check_accepts_blocks_in_range_and_aligned() {
        let a = arena();
        let tc = Tcache::new([4, 2, 2, 2], false);
        // SAFETY: this thread owns the cache; the pages fit.
        unsafe {
            tc.extend(0, &[Page::from_pfn(0), Page::from_pfn(1023)]);
            tc.extend(3, &[Page::from_pfn(8)]);
            tc.check(&a);
        }
    }

    #[test]
    #[should_panic(expected = "not an order-0 block of this arena")]
    fn check_catches_a_block_outside_the_arena() {
        let a = arena();
        let tc = Tcache::new([4, 2, 2, 2], false);
        // SAFETY: this thread owns the cache; the page fits.
        unsafe {
            tc.extend(0, &[Page::from_pfn(1024)]);
            tc.check(&a);
        }
    }

    #[test]
    #[should_panic(expected = "not an order-2 block of this arena")]
    fn check_catches_a_misaligned_block() {
        let a = arena();
        let tc = Tcache::new([4, 2, 2, 2], false);
        // SAFETY: this thread owns the cache; the page fits.
        unsafe {
            tc.extend(2, &[Page::from_pfn(6)]);
            tc.check(&a);
        }
    }
}
