//! Mempools: a reserve of pre-allocated elements that guarantees forward
//! progress to callers that may sleep (the kernel's `mm/mempool.c`).
//!
//! Owns: the order in which an element is looked for — the source with
//! reclaim and I/O masked, the reserve, the source with the caller's full
//! flags, then a sleep until an element comes back — for single, bulk
//! (array) and callback allocations, and the rule that freed elements refill
//! the reserve before they go back to the source. Must never: fail a caller
//! whose flags allow blocking, hand out part of the reserve to a bulk caller
//! that cannot be fully served (two such callers would wait for each other
//! for ever), call the source or a caller's callback with the reserve lock
//! held, or keep an element when the pool is dropped.
//!
//! How the pieces fit:
//! ```text
//! alloc(gfp)        source(gfp − DIRECT_RECLAIM − IO) → reserve (1)
//!                   → source(gfp) → sleep ≤ 5 s until a free, then again
//! alloc_bulk(gfp)   source bulk fills the empty slots it can → reserve
//!                   gives *all* the missing ones at once, or none
//!                   → source bulk with gfp → sleep, then again
//! free(e)           reserve below min_nr? keep it and wake sleepers
//!                   : source.free(e)
//! free_bulk(v)      the front of `v` refills the reserve, the rest goes
//!                   to the source in one bulk free
//! ```
//!
//! The wait/wake core ([`Reserve`]) is generic over its lock, condition
//! variable and length word so that the unit tests model-check it with
//! `loom`: a free that refills the reserve always wakes a caller that found
//! it short, whatever the interleaving.

use crate::sync::{ParkingWait, SeqWord, WaitLock};
use crate::{Error, Gfp, Page, PageAllocator, Result, MAX_ORDER};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a blocked allocation sleeps before it tries the source again
/// even if nothing was freed to the pool (the kernel's
/// `io_schedule_timeout(5 * HZ)`): memory may have come back to the source
/// without passing through the pool.
pub const MEMPOOL_WAIT: Duration = Duration::from_secs(5);

/// Largest reserve a pool accepts, in elements.
pub const MEMPOOL_MIN_NR_MAX: usize = 1 << 20;

/// Where a mempool's elements come from and go back to.
///
/// Only [`ElementSource::alloc`] and [`ElementSource::free`] are required;
/// the bulk and callback forms default to loops over them. A source that
/// can do better (the page allocator's bulk API) overrides them.
pub trait ElementSource: Send + Sync {
    /// What the pool hands out.
    type Elem: Send;

    /// One element, honouring `gfp` as far as the source can.
    ///
    /// **Context:** may block only if `gfp` may block. **Returns:** `None`
    /// when the source has nothing under `gfp`'s rules.
    fn alloc(&self, gfp: Gfp) -> Option<Self::Elem>;

    /// Take an element back.
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// The caller owns `elem`: it came from this source (or a pool over
    /// it) and nothing else uses it as its own afterwards. For elements
    /// that are handles (a [`Page`]) a copy kept and used would be a second
    /// owner of the same memory; an element that owns itself (a `Box`)
    /// meets this by being moved in.
    unsafe fn free(&self, elem: Self::Elem);

    /// Fill the empty (`None`) slots of `slots`, keeping filled ones.
    ///
    /// **Context:** as [`ElementSource::alloc`]. **Returns:** how many slots
    /// hold an element now, counting those filled before the call; may be
    /// fewer than `slots.len()`.
    fn alloc_bulk(&self, gfp: Gfp, slots: &mut [Option<Self::Elem>]) -> usize {
        fill_one_by_one(self, gfp, slots)
    }

    /// Allocate up to `nr` elements and hand each to `f` as it comes.
    ///
    /// **Context:** as [`ElementSource::alloc`]; `f` runs with no lock of
    /// the source held. **Returns:** how many elements were handed to `f`.
    fn alloc_bulk_cb<F: FnMut(Self::Elem)>(&self, gfp: Gfp, nr: usize, f: F) -> usize {
        cb_one_by_one(self, gfp, nr, f)
    }

    /// Take back every element of `elems`, leaving it empty.
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// The caller owns every element of `elems`: each came from this source (or a pool over
    /// it) and nothing else uses them as its own afterwards. For elements
    /// that are handles (a [`Page`]) a copy kept and used would be a second
    /// owner of the same memory; an element that owns itself (a `Box`)
    /// meets this by being moved in.
    unsafe fn free_bulk(&self, elems: &mut Vec<Self::Elem>) {
        for e in elems.drain(..) {
            // SAFETY: the caller owns every element (this fn's contract).
            unsafe { self.free(e) };
        }
    }

    /// Take back the elements held in `slots`, leaving every slot empty.
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// The caller owns every element held in `slots`: each came from this source (or a pool over
    /// it) and nothing else uses them as its own afterwards. For elements
    /// that are handles (a [`Page`]) a copy kept and used would be a second
    /// owner of the same memory; an element that owns itself (a `Box`)
    /// meets this by being moved in.
    unsafe fn free_slots(&self, slots: &mut [Option<Self::Elem>]) {
        for e in slots.iter_mut().filter_map(Option::take) {
            // SAFETY: the caller owns every element (this fn's contract).
            unsafe { self.free(e) };
        }
    }
}

/// The default bulk fill: one [`ElementSource::alloc`] per empty slot,
/// stopping at the first failure (as a bulk allocator does).
fn fill_one_by_one<S: ElementSource + ?Sized>(
    src: &S,
    gfp: Gfp,
    slots: &mut [Option<S::Elem>],
) -> usize {
    let mut filled = slots.iter().filter(|s| s.is_some()).count();
    for slot in slots.iter_mut().filter(|s| s.is_none()) {
        match src.alloc(gfp) {
            Some(e) => {
                *slot = Some(e);
                filled += 1;
            }
            None => break,
        }
    }
    filled
}

fn cb_one_by_one<S: ElementSource + ?Sized>(
    src: &S,
    gfp: Gfp,
    nr: usize,
    mut f: impl FnMut(S::Elem),
) -> usize {
    for done in 0..nr {
        match src.alloc(gfp) {
            Some(e) => f(e),
            None => return done,
        }
    }
    nr
}

/// Pages of one order from a [`PageAllocator`]. Order 0 uses the
/// allocator's bulk API for the bulk and callback forms.
#[derive(Clone)]
pub struct PageSource {
    alloc: PageAllocator,
    order: u32,
}

impl PageSource {
    /// A source of order-`order` blocks from `alloc`.
    ///
    /// **Returns:** an error if `order` is above [`MAX_ORDER`].
    pub fn new(alloc: PageAllocator, order: u32) -> Result<PageSource> {
        if order > MAX_ORDER {
            return Err(Error::setting(
                "order",
                order,
                format!("a page source hands out blocks of order 0..={MAX_ORDER}"),
            ));
        }
        Ok(PageSource { alloc, order })
    }

    /// The allocator the pages come from.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// The order of every block.
    pub fn order(&self) -> u32 {
        self.order
    }
}

impl ElementSource for PageSource {
    type Elem = Page;

    #[inline]
    fn alloc(&self, gfp: Gfp) -> Option<Page> {
        self.alloc.alloc_pages(gfp, self.order)
    }

    #[inline]
    unsafe fn free(&self, page: Page) {
        // SAFETY: the caller owns the page (the trait's contract), which
        // came from this source's allocator with this source's order.
        unsafe { self.alloc.free_pages(page, self.order) }
    }

    fn alloc_bulk(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        if self.order == 0 {
            self.alloc.alloc_pages_bulk_array(gfp, slots)
        } else {
            fill_one_by_one(self, gfp, slots)
        }
    }

    fn alloc_bulk_cb<F: FnMut(Page)>(&self, gfp: Gfp, nr: usize, f: F) -> usize {
        if self.order == 0 {
            self.alloc.alloc_pages_bulk_cb(gfp, nr, f)
        } else {
            cb_one_by_one(self, gfp, nr, f)
        }
    }

    unsafe fn free_bulk(&self, pages: &mut Vec<Page>) {
        if self.order == 0 {
            if !pages.is_empty() {
                // SAFETY: the caller owns the pages (the trait's contract).
                unsafe { self.alloc.free_pages_bulk(pages) };
            }
            pages.clear();
        } else {
            for p in pages.drain(..) {
                // SAFETY: as above.
                unsafe { self.alloc.free_pages(p, self.order) };
            }
        }
    }

    unsafe fn free_slots(&self, slots: &mut [Option<Page>]) {
        if self.order == 0 {
            // SAFETY: the caller owns the pages (the trait's contract).
            unsafe { self.alloc.free_pages_bulk_array(slots) };
        } else {
            for p in slots.iter_mut().filter_map(Option::take) {
                // SAFETY: as above.
                unsafe { self.alloc.free_pages(p, self.order) };
            }
        }
    }
}

/// Boxed objects made by a constructor: shows that a pool is not tied to
/// pages (the kernel's kmalloc- and slab-backed pools). An optional limit
/// on live objects makes the source run dry like a memory budget would.
///
/// `Gfp` is not consulted: the global allocator cannot be told not to
/// block or reclaim.
pub struct BoxSource<T> {
    make: Box<dyn Fn() -> T + Send + Sync>,
    live: AtomicUsize,
    limit: AtomicUsize,
}

impl<T: Send> BoxSource<T> {
    /// A source that builds each object with `make`, with no limit.
    pub fn new(make: impl Fn() -> T + Send + Sync + 'static) -> BoxSource<T> {
        BoxSource {
            make: Box::new(make),
            live: AtomicUsize::new(0),
            limit: AtomicUsize::new(usize::MAX),
        }
    }

    /// At most `max_live` objects from this source may exist at once;
    /// further allocations fail.
    pub fn with_limit(self, max_live: usize) -> BoxSource<T> {
        self.set_limit(max_live);
        self
    }

    /// Change the limit on live objects (objects already out stay out).
    pub fn set_limit(&self, max_live: usize) {
        self.limit.store(max_live, Ordering::Relaxed);
    }

    /// Objects handed out and not yet freed back (the reserve's included).
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

impl<T: Send> ElementSource for BoxSource<T> {
    type Elem = Box<T>;

    fn alloc(&self, _gfp: Gfp) -> Option<Box<T>> {
        let limit = self.limit.load(Ordering::Relaxed);
        self.live
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        Some(Box::new((self.make)()))
    }

    unsafe fn free(&self, elem: Box<T>) {
        drop(elem);
        let was = self.live.fetch_sub(1, Ordering::Relaxed);
        assert!(
            was > 0,
            "BoxSource::free: more objects freed than were allocated"
        );
    }
}

/// A snapshot of a pool's reserve and its counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MempoolStats {
    /// Elements the reserve is kept at.
    pub min_nr: usize,
    /// Elements in the reserve now.
    pub reserve_len: usize,
    /// Elements handed out from the reserve.
    pub reserve_allocs: u64,
    /// Freed elements kept to refill the reserve.
    pub reserve_frees: u64,
    /// Sleeps of blocking callers that found the reserve short.
    pub waits: u64,
    /// Non-blocking calls that came back empty or short.
    pub failures: u64,
}

/// A pool of elements from `S` with `min_nr` of them held in reserve, so
/// that callers that may sleep always get their elements, however short of
/// memory the source is: they sleep until another caller frees one.
///
/// The guarantee holds when every caller returns its elements in finite
/// time and never waits for the pool while holding elements it took in an
/// earlier call (the kernel's rule). A bulk call takes what it needs in one
/// step, so it may hold many elements, but never a part of what it waits for.
///
/// ```
/// use iopages::{Gfp, Mempool, PageAllocator, PageSource};
/// let alloc = PageAllocator::new(8 << 20).unwrap();
/// let pool = Mempool::new(PageSource::new(alloc.clone(), 0).unwrap(), 64).unwrap();
/// let page = pool.alloc(Gfp::NOIO).expect("a blocking allocation never fails");
/// // SAFETY: the page came from this pool and is given up here.
/// unsafe { pool.free_raw(page) };
/// let mut slots = [None; 32];
/// assert_eq!(pool.alloc_bulk(Gfp::NOIO, &mut slots), 32);
/// // SAFETY: as above, for every page in `slots`.
/// unsafe { pool.free_bulk_slots_raw(&mut slots) };
/// drop(pool);
/// assert!(alloc.leak_check().is_ok());
/// ```
pub struct Mempool<S: ElementSource> {
    source: S,
    reserve: Reserve<S::Elem>,
    wait: Duration,
}

/// A pool of pages.
pub type PagePool = Mempool<PageSource>;

impl<S: ElementSource> Mempool<S> {
    /// A pool over `source` whose reserve is filled with `min_nr` elements
    /// now (allocated with [`Gfp::KERNEL`]).
    ///
    /// **Context:** may block while the source allocates. **Returns:** an
    /// error if `min_nr` is above [`MEMPOOL_MIN_NR_MAX`] or the source could
    /// not supply `min_nr` elements; then every element it did supply has
    /// gone back to it.
    pub fn new(source: S, min_nr: usize) -> Result<Mempool<S>> {
        let elems = fill(&source, min_nr, "min_nr")?;
        Ok(Mempool {
            source,
            reserve: Reserve::new(elems, min_nr),
            wait: MEMPOOL_WAIT,
        })
    }

    /// The longest a blocked caller sleeps before it tries the source again
    /// (default [`MEMPOOL_WAIT`]). A wake-up by a free comes first either way.
    pub fn with_wait_timeout(mut self, timeout: Duration) -> Mempool<S> {
        self.wait = timeout;
        self
    }

    /// Allocate one element.
    ///
    /// Order of attempts: the source with `DIRECT_RECLAIM` and `IO` removed
    /// (so it fails fast rather than reclaiming), the reserve, the source
    /// with the full flags, then — if `gfp` may block — a sleep until an
    /// element is freed to the pool (or [`MEMPOOL_WAIT`] passes), and again.
    /// The source always sees `NORETRY | NOWARN` and never `MEMALLOC`,
    /// `NOFAIL` or `ZERO`: the pool is the fallback, and reserve elements
    /// are never zeroed.
    ///
    /// **Context:** blocks only if `gfp` may block. **Returns:** `None`
    /// only when `gfp` cannot block and neither the source nor the reserve
    /// had an element; a blocking call always returns an element.
    pub fn alloc(&self, gfp: Gfp) -> Option<S::Elem> {
        let (full, mut attempt) = source_gfp(gfp);
        loop {
            if let Some(e) = self.source.alloc(attempt) {
                return Some(e);
            }
            let on_short = self.on_short(attempt, full);
            let mut got = None;
            if self.reserve.take(1, on_short, |e| got = Some(e)) {
                return got;
            }
            match on_short {
                OnShort::Retry => attempt = full,
                OnShort::Wait(_) => {}
                OnShort::Fail => return None,
            }
        }
    }

    /// Bulk allocation: fill the empty (`None`) slots of `slots`, keeping
    /// those already filled.
    ///
    /// The source's bulk form fills what it can; when it comes back short,
    /// the reserve gives *all* the missing elements at once if it holds that
    /// many, and none otherwise (then the source is tried with the full
    /// flags, then the caller sleeps until elements are freed). Taking all
    /// or nothing is what keeps two bulk callers from each holding part of
    /// the reserve while waiting for the rest (Linux 6.19's
    /// `mempool_alloc_bulk`).
    ///
    /// **Context:** blocks only if `gfp` may block; flags as
    /// [`Mempool::alloc`]. **Returns:** how many slots hold an element now,
    /// counting those filled before the call: always `slots.len()` when
    /// `gfp` may block; otherwise what the source gave (the reserve is not
    /// touched unless it can fill every empty slot).
    ///
    /// **Panics** if `gfp` may block and more slots are empty than the pool
    /// keeps in reserve (`min_nr`, at least 1): such a call could wait for
    /// ever. Split it, or resize the pool.
    pub fn alloc_bulk(&self, gfp: Gfp, slots: &mut [Option<S::Elem>]) -> usize {
        let (full, mut attempt) = source_gfp(gfp);
        let missing = slots.iter().filter(|s| s.is_none()).count();
        if missing == 0 {
            return slots.len();
        }
        self.assert_servable(missing, full);
        loop {
            let filled = self.source.alloc_bulk(attempt, slots);
            debug_assert_eq!(filled, slots.iter().filter(|s| s.is_some()).count());
            let missing = slots.len() - filled;
            if missing == 0 {
                return filled;
            }
            let on_short = self.on_short(attempt, full);
            let mut empty = slots.iter_mut().filter(|s| s.is_none());
            let taken = self.reserve.take(missing, on_short, |e| {
                *empty
                    .next()
                    .expect("the reserve gives exactly the missing count") = Some(e)
            });
            if taken {
                return slots.len();
            }
            match on_short {
                OnShort::Retry => attempt = full,
                OnShort::Wait(_) => {}
                OnShort::Fail => return filled,
            }
        }
    }

    /// Bulk allocation, callback form: allocate `nr` elements and hand each
    /// to `f` as it comes (to fill an I/O vector directly, seed 000's
    /// variant). Same order of attempts and all-or-nothing reserve rule as
    /// [`Mempool::alloc_bulk`]. `f` runs with no pool lock held; if it
    /// panics, the elements not yet handed over go back to the pool.
    ///
    /// **Context / Panics:** as [`Mempool::alloc_bulk`], with `nr` as the
    /// number of empty slots. **Returns:** how many elements were handed to
    /// `f`: always `nr` when `gfp` may block.
    pub fn alloc_bulk_cb(&self, gfp: Gfp, nr: usize, mut f: impl FnMut(S::Elem)) -> usize {
        let (full, mut attempt) = source_gfp(gfp);
        if nr == 0 {
            return 0;
        }
        self.assert_servable(nr, full);
        let mut done = 0;
        let mut from_reserve = Vec::new();
        loop {
            done += self.source.alloc_bulk_cb(attempt, nr - done, &mut f);
            debug_assert!(done <= nr);
            if done >= nr {
                return nr;
            }
            let missing = nr - done;
            let on_short = self.on_short(attempt, full);
            if self
                .reserve
                .take(missing, on_short, |e| from_reserve.push(e))
            {
                let mut rest = Undelivered {
                    pool: self,
                    elems: from_reserve,
                };
                while let Some(e) = rest.elems.pop() {
                    f(e);
                }
                return nr;
            }
            match on_short {
                OnShort::Retry => attempt = full,
                OnShort::Wait(_) => {}
                OnShort::Fail => return done,
            }
        }
    }

    /// Free one element: it refills the reserve if that is below `min_nr`
    /// (waking anyone sleeping for it), else it goes back to the source
    /// (the kernel's `mempool_free`). Pools of owning elements call the
    /// safe [`Mempool::free`].
    ///
    /// **Context:** never blocks (takes the reserve lock briefly only when
    /// the reserve is short).
    ///
    /// # Safety
    /// The caller owns `elem`: it came from this pool (or its source) and
    /// nothing else uses it as its own afterwards — for a [`Page`], no
    /// copy of the handle, [`crate::PageBox`] or pointer into it.
    pub unsafe fn free_raw(&self, elem: S::Elem) {
        if let Some(e) = self.reserve.give(elem) {
            // SAFETY: the caller gave up `elem` (this fn's contract).
            unsafe { self.source.free(e) };
        }
    }

    /// Free a batch, leaving `elems` empty: elements from the front refill
    /// the reserve up to `min_nr` (one lock hold, sleepers woken), the rest
    /// go to the source in one bulk free.
    ///
    /// **Context:** never blocks. **Returns:** how many went to the reserve.
    ///
    /// # Safety
    /// As [`Mempool::free_raw`], for every element of `elems`.
    pub unsafe fn free_bulk_raw(&self, elems: &mut Vec<S::Elem>) -> usize {
        let kept = self.reserve.give_front(elems);
        if !elems.is_empty() {
            // SAFETY: the caller gave up the elements (this fn's contract).
            unsafe { self.source.free_bulk(elems) };
        }
        kept
    }

    /// Free the elements held in `slots`, leaving every slot empty: the
    /// counterpart of [`Mempool::alloc_bulk`], with
    /// [`Mempool::free_bulk_raw`]'s rule (the first filled slots refill the
    /// reserve).
    ///
    /// **Context:** never blocks. **Returns:** how many went to the reserve.
    ///
    /// # Safety
    /// As [`Mempool::free_raw`], for every element held in `slots`.
    pub unsafe fn free_bulk_slots_raw(&self, slots: &mut [Option<S::Elem>]) -> usize {
        let held = slots.iter().filter(|s| s.is_some()).count();
        let kept = self.reserve.give_front_slots(slots, held);
        if kept < held {
            // SAFETY: the caller gave up the elements (this fn's contract).
            unsafe { self.source.free_slots(slots) };
        }
        kept
    }

    /// Change the number of elements kept in reserve. Shrinking returns the
    /// excess to the source now; growing allocates the new elements now
    /// (with [`Gfp::KERNEL`]).
    ///
    /// Callers already asleep for more elements than the new `min_nr` wait
    /// for the source (every [`MEMPOOL_WAIT`]) rather than the reserve.
    ///
    /// **Context:** may block while the source allocates. **Returns:** an
    /// error if `min_nr` is above [`MEMPOOL_MIN_NR_MAX`] or the source could
    /// not supply the new elements; then the pool keeps its old `min_nr` and
    /// the elements allocated for the attempt have gone back to the source.
    pub fn resize(&self, min_nr: usize) -> Result<()> {
        if min_nr > MEMPOOL_MIN_NR_MAX {
            return Err(Error::setting(
                "min_nr",
                min_nr,
                format!("a pool keeps at most {MEMPOOL_MIN_NR_MAX} elements in reserve"),
            ));
        }
        if min_nr <= self.reserve.min_nr() {
            let mut excess = self.reserve.shrink_to(min_nr);
            // SAFETY: reserve elements belong to the pool alone.
            unsafe { self.source.free_bulk(&mut excess) };
            return Ok(());
        }
        let need = min_nr.saturating_sub(self.reserve.len());
        let mut elems = fill(&self.source, need, "min_nr")?;
        self.reserve.grow_to(min_nr, &mut elems);
        if !elems.is_empty() {
            // Frees refilled the reserve meanwhile.
            // SAFETY: just allocated from the source and never handed out.
            unsafe { self.source.free_bulk(&mut elems) };
        }
        Ok(())
    }

    /// Elements in the reserve now (racy unless the pool is quiet).
    pub fn reserve_len(&self) -> usize {
        self.reserve.len()
    }

    /// Elements the reserve is kept at.
    pub fn min_nr(&self) -> usize {
        self.reserve.min_nr()
    }

    /// The reserve and its counters.
    pub fn stats(&self) -> MempoolStats {
        self.reserve.stats()
    }

    /// The element source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// What to do when the reserve cannot serve a request made with
    /// `attempt` flags: the first miss retries the source with the full
    /// flags at once (the kernel's `gfp_temp != gfp_mask`), later misses
    /// sleep if the caller may block and fail otherwise.
    fn on_short(&self, attempt: Gfp, full: Gfp) -> OnShort {
        if attempt != full {
            OnShort::Retry
        } else if full.may_block() {
            OnShort::Wait(self.wait)
        } else {
            OnShort::Fail
        }
    }

    fn assert_servable(&self, missing: usize, full: Gfp) {
        if full.may_block() {
            let keep = self.reserve.min_nr().max(1);
            assert!(
                missing <= keep,
                "mempool: a blocking bulk allocation of {missing} elements exceeds the reserve of {keep}; it could wait for ever — split the request or resize the pool"
            );
        }
    }
}

/// Sources whose elements own what they hold (a `Box`), so that giving one
/// to the pool moves its only owner in: their pools free with the safe
/// [`Mempool::free`], [`Mempool::free_bulk`] and
/// [`Mempool::free_bulk_slots`]. Sources of handles (pages) do not
/// implement it; their pools free with the `unsafe` `_raw` forms.
///
/// # Safety
/// Implement only when an element cannot leave a second owner behind when
/// it is moved into a free: not `Copy` or `Clone` into something that
/// still owns the resource, and nothing else holds it.
pub unsafe trait OwnedElements: ElementSource {}

// SAFETY: a `Box<T>` is the only owner of its `T`.
unsafe impl<T: Send> OwnedElements for BoxSource<T> {}

impl<S: OwnedElements> Mempool<S> {
    /// Free one element (see [`Mempool::free_raw`]); safe because the
    /// element owns itself.
    ///
    /// **Context:** never blocks.
    pub fn free(&self, elem: S::Elem) {
        // SAFETY: moving an owning element in gives it up entirely
        // (`OwnedElements`' contract).
        unsafe { self.free_raw(elem) }
    }

    /// Free a batch, leaving `elems` empty (see [`Mempool::free_bulk_raw`]).
    ///
    /// **Context:** never blocks. **Returns:** how many went to the reserve.
    pub fn free_bulk(&self, elems: &mut Vec<S::Elem>) -> usize {
        // SAFETY: as in `free`.
        unsafe { self.free_bulk_raw(elems) }
    }

    /// Free the elements held in `slots` (see
    /// [`Mempool::free_bulk_slots_raw`]).
    ///
    /// **Context:** never blocks. **Returns:** how many went to the reserve.
    pub fn free_bulk_slots(&self, slots: &mut [Option<S::Elem>]) -> usize {
        // SAFETY: as in `free`.
        unsafe { self.free_bulk_slots_raw(slots) }
    }
}

impl PagePool {
    /// A pool of order-`order` pages from `alloc` with `min_nr` in reserve.
    ///
    /// **Context / Returns:** as [`PageSource::new`] and [`Mempool::new`].
    pub fn pages(alloc: &PageAllocator, order: u32, min_nr: usize) -> Result<PagePool> {
        Mempool::new(PageSource::new(alloc.clone(), order)?, min_nr)
    }
}

impl<S: ElementSource> Drop for Mempool<S> {
    fn drop(&mut self) {
        let mut elems = self.reserve.take_all();
        // SAFETY: reserve elements belong to the pool alone.
        unsafe { self.source.free_bulk(&mut elems) };
    }
}

/// The flags a pool passes to its source: the full set, and the first
/// attempt's (reclaim and I/O removed so that it fails fast).
fn source_gfp(gfp: Gfp) -> (Gfp, Gfp) {
    debug_assert!(
        !gfp.contains(Gfp::ZERO),
        "mempool: ZERO cannot be honoured for reserve elements"
    );
    let full = (gfp | Gfp::NORETRY | Gfp::NOWARN) - (Gfp::MEMALLOC | Gfp::NOFAIL | Gfp::ZERO);
    (full, full - (Gfp::DIRECT_RECLAIM | Gfp::IO))
}

/// Allocate `nr` elements with [`Gfp::KERNEL`], all or none.
fn fill<S: ElementSource>(source: &S, nr: usize, what: &'static str) -> Result<Vec<S::Elem>> {
    if nr > MEMPOOL_MIN_NR_MAX {
        return Err(Error::setting(
            what,
            nr,
            format!("a pool keeps at most {MEMPOOL_MIN_NR_MAX} elements in reserve"),
        ));
    }
    let mut slots: Vec<Option<S::Elem>> = Vec::with_capacity(nr);
    slots.resize_with(nr, || None);
    let mut got = source.alloc_bulk(Gfp::KERNEL, &mut slots);
    // A bulk source may stop early; single allocations try harder.
    for slot in slots.iter_mut().filter(|s| s.is_none()) {
        match source.alloc(Gfp::KERNEL) {
            Some(e) => {
                *slot = Some(e);
                got += 1;
            }
            None => break,
        }
    }
    if got < nr {
        // SAFETY: just allocated from the source and never handed out.
        unsafe { source.free_slots(&mut slots) };
        return Err(Error::setting(
            what,
            nr,
            format!("the element source supplied only {got} of {nr} elements for the reserve"),
        ));
    }
    Ok(slots.into_iter().flatten().collect())
}

/// Reserve elements taken for a callback caller and not yet handed over;
/// they go back to the pool if the callback panics.
struct Undelivered<'a, S: ElementSource> {
    pool: &'a Mempool<S>,
    elems: Vec<S::Elem>,
}

impl<S: ElementSource> Drop for Undelivered<'_, S> {
    fn drop(&mut self) {
        if !self.elems.is_empty() {
            // SAFETY: reserve elements taken for a caller that never
            // received them: the pool still owns them.
            unsafe { self.pool.free_bulk_raw(&mut self.elems) };
        }
    }
}

// ---- the wait/wake core ----------------------------------------------------

/// What a caller does when the reserve cannot serve it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnShort {
    /// Return at once; the caller retries the source with its full flags.
    Retry,
    /// Sleep (registered as a waiter under the lock) until woken by a free
    /// or the timeout, then return.
    Wait(Duration),
    /// Return at once; counted as a failure.
    Fail,
}

/// The reserve's state, under its lock.
pub(crate) struct ReserveState<E> {
    elems: Vec<E>,
    min_nr: usize,
    /// Callers asleep in [`Reserve::take`]; frees wake only when non-zero.
    waiters: usize,
    stats: MempoolStats,
}

impl<E> ReserveState<E> {
    /// Frees are kept while the reserve holds fewer than this. With
    /// `min_nr` 0 one element is still kept while the reserve is empty, so
    /// that a sleeper in such a pool can be woken with something to take
    /// (the kernel's `min_nr == 0` case).
    #[inline]
    fn keep(&self) -> usize {
        self.min_nr.max(1)
    }
}

/// The reserve: elements under a lock, sleepers, and lock-free mirrors of
/// the length and keep limit so that a free into a full reserve goes
/// straight to the source without the lock.
pub(crate) struct Reserve<E, L = ParkingWait<ReserveState<E>>, W = AtomicUsize>
where
    L: WaitLock<ReserveState<E>>,
    W: SeqWord,
{
    lock: L,
    len: W,
    keep: W,
    _elem: PhantomData<fn() -> E>,
}

impl<E, L: WaitLock<ReserveState<E>>, W: SeqWord> Reserve<E, L, W> {
    pub(crate) fn new(elems: Vec<E>, min_nr: usize) -> Self {
        let len = elems.len();
        let state = ReserveState {
            elems,
            min_nr,
            waiters: 0,
            stats: MempoolStats::default(),
        };
        let keep = state.keep();
        Reserve {
            lock: L::new(state),
            len: W::new(len),
            keep: W::new(keep),
            _elem: PhantomData,
        }
    }

    /// Take `n` elements, all or none; `put` receives them (under the lock:
    /// it must only store them). When the reserve holds fewer, do what
    /// `on_short` says; the check and the registration as a waiter happen
    /// in one lock hold, so a free after the check wakes this caller.
    /// Returns whether the elements were taken.
    pub(crate) fn take(&self, n: usize, on_short: OnShort, mut put: impl FnMut(E)) -> bool {
        let mut g = self.lock.lock();
        if g.elems.len() >= n {
            let at = g.elems.len() - n;
            for e in g.elems.drain(at..) {
                put(e);
            }
            g.stats.reserve_allocs += n as u64;
            self.len.set(at);
            return true;
        }
        match on_short {
            OnShort::Retry => {}
            OnShort::Fail => g.stats.failures += 1,
            OnShort::Wait(timeout) => {
                g.waiters += 1;
                g.stats.waits += 1;
                let mut g = self.lock.wait(g, timeout);
                g.waiters -= 1;
            }
        }
        false
    }

    /// Keep `e` if the reserve is below its keep limit (waking sleepers);
    /// else hand it back for the source.
    pub(crate) fn give(&self, e: E) -> Option<E> {
        if self.len.get() >= self.keep.get() {
            return Some(e);
        }
        let mut g = self.lock.lock();
        if g.elems.len() >= g.keep() {
            return Some(e);
        }
        g.elems.push(e);
        g.stats.reserve_frees += 1;
        self.len.set(g.elems.len());
        self.wake(&g);
        None
    }

    /// Move elements from the front of `elems` into the reserve, up to its
    /// keep limit, in one lock hold. Returns how many were kept.
    pub(crate) fn give_front(&self, elems: &mut Vec<E>) -> usize {
        if elems.is_empty() || self.len.get() >= self.keep.get() {
            return 0;
        }
        let mut g = self.lock.lock();
        let k = g.keep().saturating_sub(g.elems.len()).min(elems.len());
        if k > 0 {
            g.elems.extend(elems.drain(..k));
            g.stats.reserve_frees += k as u64;
            self.len.set(g.elems.len());
            self.wake(&g);
        }
        k
    }

    /// As [`Reserve::give_front`] for the first filled slots of `slots`
    /// (`held` of them are filled).
    pub(crate) fn give_front_slots(&self, slots: &mut [Option<E>], held: usize) -> usize {
        if held == 0 || self.len.get() >= self.keep.get() {
            return 0;
        }
        let mut g = self.lock.lock();
        let k = g.keep().saturating_sub(g.elems.len()).min(held);
        if k > 0 {
            g.elems
                .extend(slots.iter_mut().filter_map(Option::take).take(k));
            g.stats.reserve_frees += k as u64;
            self.len.set(g.elems.len());
            self.wake(&g);
        }
        k
    }

    /// Lower `min_nr`; returns the elements above the new limit.
    pub(crate) fn shrink_to(&self, min_nr: usize) -> Vec<E> {
        let mut g = self.lock.lock();
        g.min_nr = min_nr;
        let at = g.elems.len().min(min_nr);
        let excess = g.elems.split_off(at);
        self.keep.set(g.keep());
        self.len.set(g.elems.len());
        excess
    }

    /// Raise `min_nr` and add elements from `elems` up to it (frees may have
    /// refilled part of it meanwhile; what is not needed stays in `elems`).
    pub(crate) fn grow_to(&self, min_nr: usize, elems: &mut Vec<E>) {
        let mut g = self.lock.lock();
        g.min_nr = g.min_nr.max(min_nr);
        let k = g.keep().saturating_sub(g.elems.len()).min(elems.len());
        g.elems.extend(elems.drain(..k));
        self.keep.set(g.keep());
        self.len.set(g.elems.len());
        self.wake(&g);
    }

    /// Every element, for the pool's destruction.
    pub(crate) fn take_all(&self) -> Vec<E> {
        let mut g = self.lock.lock();
        self.len.set(0);
        std::mem::take(&mut g.elems)
    }

    #[inline]
    fn wake(&self, g: &ReserveState<E>) {
        // A sleeper registered under the lock we hold; it is asleep (the
        // wait released the lock and slept in one step), so this reaches it.
        if g.waiters > 0 {
            self.lock.notify_all();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len.get()
    }

    pub(crate) fn min_nr(&self) -> usize {
        self.lock.lock().min_nr
    }

    pub(crate) fn stats(&self) -> MempoolStats {
        let g = self.lock.lock();
        MempoolStats {
            min_nr: g.min_nr,
            reserve_len: g.elems.len(),
            ..g.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::loom_impls::LoomWait;
    use loom::sync::atomic::AtomicUsize as LoomUsize;
    use loom::sync::Arc;

    type LoomReserve = Reserve<u32, LoomWait<ReserveState<u32>>, LoomUsize>;

    /// Spawn a model thread that first takes and drops the reserve's lock.
    /// Without it, loom 0.7 does not explore the interleavings of a thread
    /// whose first step is an atomic load (tokio-rs/loom#392), as a free's
    /// is.
    fn spawn<T: 'static>(
        r: &Arc<LoomReserve>,
        f: impl FnOnce(&LoomReserve) -> T + 'static,
    ) -> loom::thread::JoinHandle<T> {
        let r = r.clone();
        loom::thread::spawn(move || {
            drop(r.lock.lock());
            f(&r)
        })
    }

    /// A blocking caller's loop with a source that has nothing: take `n`
    /// from the reserve or sleep, until taken.
    fn take_blocking(r: &LoomReserve, n: usize) -> Vec<u32> {
        let mut got = Vec::new();
        while !r.take(n, OnShort::Wait(MEMPOOL_WAIT), |e| got.push(e)) {}
        got
    }

    /// One sleeper and one freer on an empty reserve: in every
    /// interleaving the sleeper gets the freed element. A wake-up lost
    /// between the sleeper's check and its sleep would leave it asleep for
    /// ever, which loom reports as a deadlock.
    #[test]
    fn loom_free_always_wakes_a_sleeper() {
        loom::model(|| {
            let r = Arc::new(LoomReserve::new(Vec::new(), 1));
            let freer = spawn(&r, |r| assert_eq!(r.give(7), None, "reserve was short"));
            assert_eq!(take_blocking(&r, 1), vec![7]);
            freer.join().unwrap();
            assert_eq!(r.len(), 0);
            assert_eq!(r.stats().reserve_allocs, 1);
        });
    }

    /// A bulk sleeper that needs two elements, fed by two frees that
    /// arrive one at a time: the first free wakes it with too little (it
    /// must sleep again, not miss the second), it ends with both elements,
    /// its bulk free refills the reserve, and nothing is duplicated or lost.
    #[test]
    fn loom_bulk_sleeper_woken_short_sleeps_again_then_served() {
        loom::model(|| {
            let r = Arc::new(LoomReserve::new(Vec::new(), 2));
            let bulk = spawn(&r, |r| {
                let got = take_blocking(r, 2);
                assert_eq!(got.len(), 2);
                // Done with them: back to the pool (refills it).
                let mut v = got.clone();
                let kept = r.give_front(&mut v);
                (got, kept, v)
            });
            let freer = spawn(&r, |r| (r.give(1), r.give(2)));
            let (a, b) = freer.join().unwrap();
            // The reserve keeps 2 at most, and nobody has taken yet if the
            // frees came first, so both were kept.
            assert_eq!((a, b), (None, None));
            let (mut got, kept, rest) = bulk.join().unwrap();
            got.sort_unstable();
            assert_eq!(got, vec![1, 2]);
            assert_eq!(kept, 2);
            assert!(rest.is_empty());
            assert_eq!(r.len(), 2);
        });
    }

    /// Two sleepers on a reserve of one and a single free: exactly one
    /// sleeper gets the element; the other is woken and goes back to
    /// sleep, then gets the element the first one frees.
    #[test]
    fn loom_two_sleepers_one_free_each_served_in_turn() {
        loom::model(|| {
            let r = Arc::new(LoomReserve::new(Vec::new(), 1));
            let other = spawn(&r, |r| {
                let got = take_blocking(r, 1);
                assert_eq!(r.give(got[0]), None);
            });
            let freer = spawn(&r, |r| assert_eq!(r.give(9), None));
            let got = take_blocking(&r, 1);
            assert_eq!(got, vec![9]);
            assert_eq!(r.give(got[0]), None);
            other.join().unwrap();
            freer.join().unwrap();
            assert_eq!(r.len(), 1);
        });
    }

    /// A bulk free of two elements and a bulk sleeper that needs both, with
    /// a single free racing with them: the bulk free keeps what fits and
    /// wakes the sleeper, which ends with two elements; the element that
    /// did not fit goes back for the source; nothing is lost.
    #[test]
    fn loom_bulk_free_wakes_a_bulk_sleeper() {
        loom::model(|| {
            let r = Arc::new(LoomReserve::new(Vec::new(), 2));
            let freer = spawn(&r, |r| {
                let mut v = vec![1, 2];
                let kept = r.give_front(&mut v);
                (kept, v)
            });
            let single = spawn(&r, |r| r.give(3));
            let got = take_blocking(&r, 2);
            let (kept, rest) = freer.join().unwrap();
            let spare = single.join().unwrap();
            assert_eq!(got.len(), 2);
            assert_eq!(kept + (spare.is_none() as usize), 2 + r.len());
            let mut all: Vec<u32> = got.into_iter().chain(rest).chain(spare).collect();
            all.extend(r.take_all());
            all.sort_unstable();
            assert_eq!(all, vec![1, 2, 3], "an element was lost or duplicated");
        });
    }

    #[test]
    fn std_reserve_gives_all_or_nothing() {
        let r: Reserve<u32> = Reserve::new(vec![1, 2, 3], 3);
        let mut got = Vec::new();
        assert!(!r.take(4, OnShort::Fail, |e| got.push(e)));
        assert!(got.is_empty());
        assert_eq!(r.len(), 3);
        assert_eq!(r.stats().failures, 1);
        assert!(r.take(2, OnShort::Fail, |e| got.push(e)));
        assert_eq!(got, vec![2, 3]);
        assert_eq!(r.give(5), None);
        assert_eq!(r.give(6), None);
        assert_eq!(r.give(7), Some(7), "a full reserve sends frees on");
    }

    #[test]
    fn source_gfp_masks_reclaim_and_io_first() {
        let (full, first) = source_gfp(Gfp::KERNEL);
        assert!(full.contains(Gfp::KERNEL | Gfp::NORETRY | Gfp::NOWARN));
        assert!(!first.may_block() && !first.contains(Gfp::IO));
        assert!(first.contains(Gfp::FS | Gfp::KSWAPD_RECLAIM));
        let (full, first) = source_gfp(Gfp::NOWAIT | Gfp::MEMALLOC | Gfp::NOFAIL);
        assert_eq!(full, first, "nothing to retry for a non-blocking call");
        assert!(!full.intersects(Gfp::MEMALLOC | Gfp::NOFAIL));
    }
}
