//! Mempools: blocking callers always get whole results (single, bulk and
//! callback forms) however dry the source is, non-blocking callers fail
//! cleanly, bulk callers cannot wedge each other, frees refill the reserve
//! first, and nothing leaks — with pages from the allocator (fault
//! injection included) and with boxed objects.
//!
//! Every test that runs threads waits for them with a deadline and fails
//! loudly, naming what is stuck, instead of hanging.

mod common;
use common::{assert_no_leaks, builder};
use iopages::{
    memalloc_noio_scope, BoxSource, ElementSource, Error, FaultConfig, Gfp, Mempool, Page,
    PageAllocator, PagePool, PageSource,
};
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long any multi-threaded test may take before it is declared stuck.
const DEADLINE: Duration = Duration::from_secs(60);

fn small(mib: u64) -> PageAllocator {
    builder(mib).build().unwrap()
}

/// Take every page the arena has, reserves below the watermarks included,
/// so that the pool's source is dry.
fn consume_arena(alloc: &PageAllocator) -> Vec<Page> {
    let gfp = Gfp::KERNEL | Gfp::MEMALLOC | Gfp::NORETRY | Gfp::NOWARN;
    let mut held = Vec::new();
    while let Some(p) = alloc.alloc_pages(gfp, 0) {
        held.push(p);
    }
    assert_eq!(alloc.stats().free_pages, 0, "the arena is not empty");
    assert_eq!(alloc.alloc_pages(Gfp::NOWAIT, 0), None);
    held
}

/// Run `f(t)` on `n` threads and wait for all of them until [`DEADLINE`];
/// a thread that has not finished by then fails the test (a deadlock or a
/// lost wake-up), and a thread's panic is passed on.
fn run_bounded<F>(what: &str, n: usize, f: F)
where
    F: Fn(usize) + Send + Sync + 'static,
{
    struct Done(usize, mpsc::Sender<usize>);
    impl Drop for Done {
        fn drop(&mut self) {
            let _ = self.1.send(self.0);
        }
    }
    let f = Arc::new(f);
    let start_line = Arc::new(Barrier::new(n));
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = (0..n)
        .map(|t| {
            let (f, tx, start_line) = (f.clone(), tx.clone(), start_line.clone());
            thread::spawn(move || {
                let _done = Done(t, tx);
                start_line.wait();
                f(t)
            })
        })
        .collect();
    let start = Instant::now();
    let mut finished = HashSet::new();
    while finished.len() < n {
        let left = DEADLINE.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok(t) => {
                finished.insert(t);
            }
            Err(_) => {
                let stuck: Vec<usize> = (0..n).filter(|t| !finished.contains(t)).collect();
                panic!(
                    "{what}: threads {stuck:?} still blocked after {DEADLINE:?}: a deadlock or a lost wake-up"
                );
            }
        }
    }
    for h in handles {
        if let Err(e) = h.join() {
            std::panic::resume_unwind(e);
        }
    }
}

/// Write a tag into a page, and check it later: a page handed to two
/// holders at once is caught.
fn tag(alloc: &PageAllocator, p: Page, v: u64) {
    // SAFETY: the page is allocated to the caller and lies in the arena.
    unsafe { alloc.page_address(p).cast::<u64>().write_volatile(v) }
}

fn check(alloc: &PageAllocator, p: Page, v: u64) {
    // SAFETY: as in `tag`.
    let got = unsafe { alloc.page_address(p).cast::<u64>().read_volatile() };
    assert_eq!(got, v, "pfn {}: tag overwritten, handed out twice", p.pfn());
}

// ---- forward progress ----------------------------------------------------------

/// One blocking single allocation: tagged, checked after a yield, freed.
fn pool_single(pool: &PagePool, alloc: &PageAllocator, stamp: u64) {
    let p = pool.alloc(Gfp::KERNEL).expect("blocking alloc failed");
    tag(alloc, p, stamp);
    thread::yield_now();
    check(alloc, p, stamp);
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_raw(p) };
}

/// One blocking bulk (array) allocation of `k` pages: every slot filled,
/// tagged, checked after a yield, freed and emptied.
fn pool_bulk_array(pool: &PagePool, alloc: &PageAllocator, k: usize, stamp: u64) {
    let mut slots = vec![None; k];
    assert_eq!(pool.alloc_bulk(Gfp::KERNEL, &mut slots), k);
    for (j, p) in slots.iter().enumerate() {
        tag(alloc, p.expect("every slot filled"), stamp + (j as u64) * 7);
    }
    thread::yield_now();
    for (j, p) in slots.iter().enumerate() {
        check(alloc, p.unwrap(), stamp + (j as u64) * 7);
    }
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_bulk_slots_raw(&mut slots) };
    assert!(slots.iter().all(Option::is_none));
}

/// One blocking callback allocation of `k` pages into `pages` (empty on
/// entry and on return): tagged, checked after a yield, freed.
fn pool_bulk_cb(
    pool: &PagePool,
    alloc: &PageAllocator,
    k: usize,
    stamp: u64,
    pages: &mut Vec<Page>,
) {
    assert_eq!(pool.alloc_bulk_cb(Gfp::NOIO, k, |p| pages.push(p)), k);
    assert_eq!(pages.len(), k);
    for (j, &p) in pages.iter().enumerate() {
        tag(alloc, p, stamp ^ j as u64);
    }
    thread::yield_now();
    for (j, &p) in pages.iter().enumerate() {
        check(alloc, p, stamp ^ j as u64);
    }
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_bulk_raw(pages) };
    assert!(pages.is_empty());
}

/// One blocking single allocation inside a NOIO scope.
fn pool_single_noio(pool: &PagePool, alloc: &PageAllocator, stamp: u64) {
    let _noio = memalloc_noio_scope();
    let p = pool.alloc(Gfp::KERNEL).expect("blocking alloc failed");
    tag(alloc, p, stamp);
    check(alloc, p, stamp);
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_raw(p) };
}

/// The headline test: the arena completely consumed by another
/// holder, six threads each doing 1500 blocking cycles of single, bulk
/// (array) and callback allocations of up to 16 pages against a reserve of
/// 24 — together they want more than the reserve, so they sleep and wake.
/// Every call comes back with all its pages, no page is handed to two
/// holders, and the reserve ends at `min_nr`.
#[test]
fn blocking_callers_always_get_their_pages_with_the_arena_exhausted() {
    const THREADS: usize = 6;
    const CYCLES: usize = 1500;
    let alloc = small(8);
    let pool = Arc::new(PagePool::pages(&alloc, 0, 24).unwrap());
    let hog = consume_arena(&alloc);
    {
        let (pool, alloc) = (pool.clone(), alloc.clone());
        run_bounded("page pool", THREADS, move |t| {
            let mut pages = Vec::new();
            for i in 0..CYCLES {
                let k = 1 + (i * 7 + t) % 16;
                let stamp = ((t as u64) << 32) | i as u64;
                match (i + t) % 4 {
                    0 => pool_single(&pool, &alloc, stamp),
                    1 => pool_bulk_array(&pool, &alloc, k, stamp),
                    2 => pool_bulk_cb(&pool, &alloc, k, stamp, &mut pages),
                    _ => pool_single_noio(&pool, &alloc, !stamp),
                }
            }
        });
    }
    let s = pool.stats();
    assert_eq!(pool.reserve_len(), pool.min_nr(), "{s:?}");
    assert!(
        s.reserve_allocs > 0,
        "the source was dry: the reserve must have served"
    );
    drop(pool);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&hog) };
    assert_no_leaks(&alloc);
}

/// An object that counts the live instances of its kind.
struct Tracked {
    value: u64,
    live: Arc<AtomicI64>,
}

impl Tracked {
    fn source(live: &Arc<AtomicI64>) -> BoxSource<Tracked> {
        let live = live.clone();
        BoxSource::new(move || {
            live.fetch_add(1, SeqCst);
            Tracked {
                value: 0,
                live: live.clone(),
            }
        })
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, SeqCst);
    }
}

/// The same with boxed objects whose source is capped at the reserve's
/// size: the pool is generic, and its guarantee does not depend on pages.
/// Dropping the pool destroys every object.
#[test]
fn blocking_callers_always_get_their_objects_from_a_capped_box_source() {
    const THREADS: usize = 5;
    const CYCLES: usize = 2000;
    let objects = Arc::new(AtomicI64::new(0));
    let pool = Arc::new(Mempool::new(Tracked::source(&objects).with_limit(32), 32).unwrap());
    assert_eq!(pool.source().live(), 32);
    {
        let pool = pool.clone();
        run_bounded("box pool", THREADS, move |t| {
            for i in 0..CYCLES {
                let stamp = ((t as u64) << 32) | i as u64;
                if i % 2 == 0 {
                    let mut b = pool.alloc(Gfp::KERNEL).expect("blocking alloc failed");
                    b.value = stamp;
                    thread::yield_now();
                    assert_eq!(b.value, stamp, "object shared by two holders");
                    pool.free(b);
                } else {
                    let k = 1 + (i + t) % 12;
                    let mut slots: Vec<Option<Box<Tracked>>> = (0..k).map(|_| None).collect();
                    assert_eq!(pool.alloc_bulk(Gfp::KERNEL, &mut slots), k);
                    for (j, b) in slots.iter_mut().enumerate() {
                        b.as_mut().unwrap().value = stamp + j as u64;
                    }
                    thread::yield_now();
                    for (j, b) in slots.iter().enumerate() {
                        assert_eq!(b.as_ref().unwrap().value, stamp + j as u64);
                    }
                    pool.free_bulk_slots(&mut slots);
                }
            }
        });
    }
    assert_eq!(pool.reserve_len(), 32);
    assert_eq!(pool.source().live(), 32, "objects lost or duplicated");
    assert_eq!(objects.load(SeqCst), 32);
    drop(Arc::try_unwrap(pool).ok().expect("all threads joined"));
    assert_eq!(objects.load(SeqCst), 0, "the pool kept objects");
}

/// Two bulk callers that each want 6 of a reserve of 8 (12 together) with
/// the source dry: all-or-nothing draws mean one waits while the other
/// holds its 6, instead of both holding 4 and waiting for ever.
#[test]
fn two_bulk_callers_wanting_more_than_the_reserve_together_both_progress() {
    const CYCLES: usize = 3000;
    let pool = Arc::new(Mempool::new(BoxSource::new(|| 0u32).with_limit(8), 8).unwrap());
    {
        let pool = pool.clone();
        run_bounded("two bulk callers", 2, move |t| {
            for i in 0..CYCLES {
                let mut slots: Vec<Option<Box<u32>>> = (0..6).map(|_| None).collect();
                assert_eq!(pool.alloc_bulk(Gfp::KERNEL, &mut slots), 6);
                for b in slots.iter_mut() {
                    **b.as_mut().unwrap() = (t * CYCLES + i) as u32;
                }
                thread::yield_now();
                for b in &slots {
                    assert_eq!(**b.as_ref().unwrap(), (t * CYCLES + i) as u32);
                }
                if i % 2 == 0 {
                    pool.free_bulk_slots(&mut slots);
                } else {
                    let mut v: Vec<Box<u32>> = slots.into_iter().flatten().collect();
                    pool.free_bulk(&mut v);
                }
            }
        });
    }
    assert_eq!(pool.reserve_len(), 8);
    assert_eq!(pool.source().live(), 8);
}

/// Why the bulk draw is all or nothing, shown without threads: two callers
/// building 6-element batches from single allocations take 4 each and
/// both find the reserve empty (blocking, each would wait for the other
/// for ever). Bulk calls leave the second caller holding nothing, so the
/// first can finish and free.
#[test]
fn single_allocations_can_wedge_two_callers_where_bulk_cannot() {
    let pool = Mempool::new(BoxSource::new(|| 0u8).with_limit(8), 8).unwrap();
    let mut a: Vec<_> = (0..4).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    let mut b: Vec<_> = (0..4).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    assert!(pool.alloc(Gfp::NOWAIT).is_none() && pool.alloc(Gfp::NOWAIT).is_none());
    assert_eq!(pool.reserve_len(), 0, "both callers are stuck halfway");
    pool.free_bulk(&mut a);
    pool.free_bulk(&mut b);

    let mut first: Vec<Option<Box<u8>>> = (0..6).map(|_| None).collect();
    let mut second: Vec<Option<Box<u8>>> = (0..6).map(|_| None).collect();
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut first), 6);
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut second), 0);
    assert_eq!(
        pool.reserve_len(),
        2,
        "a short bulk call leaves the reserve alone"
    );
    assert!(second.iter().all(Option::is_none));
    assert_eq!(pool.free_bulk_slots(&mut first), 6);
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut second), 6);
    pool.free_bulk_slots(&mut second);
    assert_eq!(pool.reserve_len(), 8);
}

// ---- order of attempts, waiting and waking ---------------------------------------

/// A source that logs the flags it is asked with and fails on command.
struct ScriptSource {
    fail: AtomicBool,
    log: Mutex<Vec<Gfp>>,
    live: AtomicU32,
}

impl ScriptSource {
    fn new() -> ScriptSource {
        ScriptSource {
            fail: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
            live: AtomicU32::new(0),
        }
    }
    fn take_log(&self) -> Vec<Gfp> {
        std::mem::take(&mut self.log.lock().unwrap())
    }
}

impl ElementSource for ScriptSource {
    type Elem = u32;
    fn alloc(&self, gfp: Gfp) -> Option<u32> {
        self.log.lock().unwrap().push(gfp);
        if self.fail.load(SeqCst) {
            return None;
        }
        Some(self.live.fetch_add(1, SeqCst))
    }
    unsafe fn free(&self, _: u32) {
        self.live.fetch_sub(1, SeqCst);
    }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// The kernel's order: the source without direct reclaim and I/O (and with
/// NORETRY | NOWARN), then the reserve; when the reserve is empty, the
/// source again with the caller's full flags, then a sleep that a free
/// ends. A non-blocking caller tries the source once and fails.
#[test]
fn alloc_tries_masked_source_then_reserve_then_full_source_then_sleeps() {
    let pool = Arc::new(Mempool::new(ScriptSource::new(), 1).unwrap());
    pool.source().take_log();
    pool.source().fail.store(true, SeqCst);
    let masked = (Gfp::KERNEL | Gfp::NORETRY | Gfp::NOWARN) - (Gfp::DIRECT_RECLAIM | Gfp::IO);
    let full = Gfp::KERNEL | Gfp::NORETRY | Gfp::NOWARN;

    let e = pool.alloc(Gfp::KERNEL).expect("served by the reserve");
    assert_eq!(pool.source().take_log(), vec![masked]);
    assert_eq!(pool.reserve_len(), 0);

    assert_eq!(pool.alloc(Gfp::NOWAIT), None);
    assert_eq!(
        pool.source().take_log(),
        vec![Gfp::NOWAIT | Gfp::NORETRY],
        "nothing to retry for a non-blocking caller"
    );
    assert_eq!(pool.stats().failures, 1);

    let waiter = {
        let pool = pool.clone();
        thread::spawn(move || pool.alloc(Gfp::KERNEL))
    };
    wait_until("the caller to sleep", || pool.stats().waits >= 1);
    assert_eq!(pool.source().take_log()[..2], [masked, full]);
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_raw(e) };
    wait_until("the sleeper to wake with the element", || {
        waiter.is_finished()
    });
    assert_eq!(waiter.join().unwrap(), Some(e));
    assert_eq!(pool.stats().reserve_allocs, 2);
}

/// A sleeper also wakes on its own every `wait_timeout` and retries the
/// source: memory that comes back to the source, not the pool, is found.
#[test]
fn sleeper_retries_the_source_after_the_wait_timeout() {
    let pool = Arc::new(
        Mempool::new(ScriptSource::new(), 0)
            .unwrap()
            .with_wait_timeout(Duration::from_millis(5)),
    );
    pool.source().fail.store(true, SeqCst);
    let waiter = {
        let pool = pool.clone();
        thread::spawn(move || pool.alloc(Gfp::NOIO))
    };
    wait_until("the caller to sleep twice", || pool.stats().waits >= 2);
    pool.source().fail.store(false, SeqCst);
    wait_until("the sleeper to find the source", || waiter.is_finished());
    assert!(waiter.join().unwrap().is_some());
    assert_eq!(pool.stats().reserve_allocs, 0);
}

// ---- non-blocking callers ----------------------------------------------------

/// With the source dry and the reserve empty, every non-blocking form
/// returns at once with a clear result — `None`, a short count, no
/// callback — and touches nothing it was given.
#[test]
fn nonblocking_calls_fail_cleanly_when_source_and_reserve_are_empty() {
    let pool = Mempool::new(BoxSource::new(|| 7u16).with_limit(4), 4).unwrap();
    let held: Vec<_> = (0..4).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    assert_eq!(pool.reserve_len(), 0);
    assert!(pool.alloc(Gfp::NOWAIT).is_none());
    assert!(pool.alloc(Gfp::ATOMIC).is_none());
    let mut slots: Vec<Option<Box<u16>>> = vec![None, None];
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut slots), 0);
    assert!(slots.iter().all(Option::is_none));
    let mut called = 0;
    assert_eq!(pool.alloc_bulk_cb(Gfp::ATOMIC, 3, |_| called += 1), 0);
    assert_eq!(called, 0);
    let mut prefilled = vec![Some(Box::new(99u16)), None];
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut prefilled), 1);
    assert_eq!(prefilled[0].as_deref(), Some(&99));
    assert_eq!(pool.stats().failures, 5);

    let mut held = held;
    pool.free(held.pop().unwrap());
    assert_eq!(
        pool.alloc_bulk(Gfp::NOWAIT, &mut slots),
        0,
        "1 in reserve cannot serve 2"
    );
    assert_eq!(pool.reserve_len(), 1, "a short bulk call takes nothing");
    held.push(pool.alloc(Gfp::NOWAIT).expect("one in reserve"));
    pool.free_bulk(&mut held);
    assert_eq!(pool.reserve_len(), 4);
    assert_eq!(pool.source().live(), 4);
}

#[test]
fn nonblocking_page_allocations_fail_cleanly_with_the_arena_and_reserve_exhausted() {
    let alloc = small(4);
    let pool = PagePool::pages(&alloc, 0, 8).unwrap();
    let hog = consume_arena(&alloc);
    let mut held = Vec::new();
    assert_eq!(pool.alloc_bulk_cb(Gfp::NOWAIT, 8, |p| held.push(p)), 8);
    assert_eq!(pool.alloc(Gfp::NOWAIT), None);
    assert_eq!(pool.alloc(Gfp::ATOMIC), None);
    let mut slots = [None; 4];
    assert_eq!(pool.alloc_bulk(Gfp::NOWAIT, &mut slots), 0);
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_bulk_raw(&mut held) };
    assert_eq!(pool.reserve_len(), 8);
    drop(pool);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&hog) };
    assert_no_leaks(&alloc);
}

// ---- bulk details ------------------------------------------------------------

#[test]
fn alloc_bulk_fills_only_empty_slots_and_counts_prefilled_ones() {
    let alloc = small(4);
    let pool = PagePool::pages(&alloc, 0, 16).unwrap();
    let keep = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
    let mut slots = [None, Some(keep), None, None];
    assert_eq!(pool.alloc_bulk(Gfp::KERNEL, &mut slots), 4);
    assert_eq!(slots[1], Some(keep));
    let distinct: HashSet<_> = slots.iter().flatten().collect();
    assert_eq!(distinct.len(), 4);
    assert_eq!(
        pool.alloc_bulk(Gfp::KERNEL, &mut slots),
        4,
        "a full array is left alone"
    );
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pool.free_bulk_slots_raw(&mut slots) };
    drop(pool);
    assert_no_leaks(&alloc);
}

/// A pool of numbered objects whose source is dry once the reserve is
/// filled.
fn numbered_pool(min_nr: usize) -> Mempool<BoxSource<u32>> {
    let next = AtomicU32::new(0);
    let pool = Mempool::new(BoxSource::new(move || next.fetch_add(1, SeqCst)), min_nr).unwrap();
    pool.source().set_limit(min_nr);
    pool
}

/// `free_bulk` refills the reserve from the front of the batch and returns
/// how many went back; the rest goes to the source.
#[test]
fn free_bulk_refills_the_reserve_from_the_front_and_returns_the_rest() {
    let pool = numbered_pool(4);
    let mut from_reserve: Vec<_> = (0..3).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    assert_eq!(pool.reserve_len(), 1);
    pool.source().set_limit(usize::MAX);
    let mut batch: Vec<_> = (0..5).map(|_| pool.alloc(Gfp::KERNEL).unwrap()).collect();
    let front: HashSet<u32> = batch[..3].iter().map(|b| **b).collect();
    assert_eq!(pool.source().live(), 9);
    assert_eq!(pool.free_bulk(&mut batch), 3);
    assert!(batch.is_empty());
    assert_eq!(pool.reserve_len(), 4);
    assert_eq!(pool.source().live(), 7, "the other two went to the source");
    pool.source().set_limit(7);
    let back: Vec<_> = (0..3).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    assert_eq!(back.iter().map(|b| **b).collect::<HashSet<_>>(), front);
    from_reserve.extend(back);
    assert_eq!(
        pool.free_bulk(&mut from_reserve),
        3,
        "the reserve takes what it lacks"
    );
    assert_eq!(pool.source().live(), 4);
}

/// The slot form keeps the first *filled* slots, skipping empty ones.
#[test]
fn free_bulk_slots_refills_the_reserve_from_the_first_filled_slots() {
    let pool = numbered_pool(4);
    let r: Vec<_> = (0..3).map(|_| pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    pool.source().set_limit(5);
    let x = pool.alloc(Gfp::KERNEL).unwrap();
    let [r1, r2, r3]: [Box<u32>; 3] = r.try_into().unwrap();
    let want: HashSet<u32> = [*r1, *r2, *x].into();
    let mut slots = vec![None, Some(r1), None, Some(r2), Some(x), Some(r3)];
    assert_eq!(pool.free_bulk_slots(&mut slots), 3);
    assert!(slots.iter().all(Option::is_none));
    assert_eq!(pool.source().live(), 4, "the last one went to the source");
    pool.source().set_limit(4);
    let got: HashSet<u32> = (0..3).map(|_| *pool.alloc(Gfp::NOWAIT).unwrap()).collect();
    assert_eq!(got, want);
}

/// The callback form hands over exactly `nr` elements; when the callback
/// panics, the reserve elements it has not received go back to the pool.
#[test]
fn callback_panic_returns_the_undelivered_reserve_elements() {
    let pool = Mempool::new(BoxSource::new(|| 0i32).with_limit(8), 8).unwrap();
    let delivered = Mutex::new(Vec::new());
    let r = catch_unwind(AssertUnwindSafe(|| {
        pool.alloc_bulk_cb(Gfp::KERNEL, 6, |b| {
            let mut d = delivered.lock().unwrap();
            d.push(b);
            if d.len() == 3 {
                panic!("callback failed");
            }
        })
    }));
    assert!(r.is_err());
    let mut delivered = delivered.into_inner().unwrap_or_else(|e| e.into_inner());
    assert_eq!(delivered.len(), 3);
    assert_eq!(pool.reserve_len(), 8 - 3, "the 3 undelivered went back");
    pool.free_bulk(&mut delivered);
    assert_eq!(pool.reserve_len(), 8);
    assert_eq!(pool.source().live(), 8);
}

#[test]
#[should_panic(expected = "exceeds the reserve")]
fn blocking_bulk_request_larger_than_the_reserve_is_refused() {
    let pool = Mempool::new(BoxSource::new(|| 0u8), 4).unwrap();
    let mut slots: Vec<Option<Box<u8>>> = (0..5).map(|_| None).collect();
    pool.alloc_bulk(Gfp::KERNEL, &mut slots);
}

// ---- fault injection -----------------------------------------------------------

/// With half of the page allocator's attempts failing on purpose, every
/// form still returns whole results to blocking callers (the reserve
/// covers the failures), non-blocking ones report exactly what they
/// filled, no page is handed out twice, the reserve ends full and nothing
/// leaks.
#[test]
fn fault_injected_source_still_gives_whole_results_and_leaks_nothing() {
    let alloc = small(8);
    let pool = PagePool::pages(&alloc, 0, 64).unwrap();
    alloc.fault().enable(FaultConfig {
        probability_ppm: 500_000,
        seed: 42,
        ..FaultConfig::default()
    });
    for round in 0..200u64 {
        // At most `min_nr` held at once: a single thread never waits.
        let mut singles: Vec<Page> = (0..20)
            .map(|_| pool.alloc(Gfp::KERNEL).expect("blocking alloc failed"))
            .collect();
        let mut slots = [None; 24];
        assert_eq!(pool.alloc_bulk(Gfp::KERNEL, &mut slots), 24);
        let mut cb = Vec::new();
        assert_eq!(pool.alloc_bulk_cb(Gfp::NOIO, 20, |p| cb.push(p)), 20);
        let all: Vec<Page> = singles
            .iter()
            .chain(slots.iter().flatten())
            .chain(&cb)
            .copied()
            .collect();
        assert_eq!(all.iter().collect::<HashSet<_>>().len(), 64, "a page twice");
        for (i, &p) in all.iter().enumerate() {
            tag(&alloc, p, round << 8 | i as u64);
        }
        for (i, &p) in all.iter().enumerate() {
            check(&alloc, p, round << 8 | i as u64);
        }
        match round % 3 {
            // SAFETY: the pages came from this pool and are given up here, once.
            0 => singles.drain(..).for_each(|p| unsafe { pool.free_raw(p) }),
            1 => {
                // SAFETY: the elements came from this pool and are given up here, once.
                unsafe { pool.free_bulk_raw(&mut singles) };
            }
            _ => {
                let mut s: Vec<Option<Page>> = singles.drain(..).map(Some).collect();
                // SAFETY: the elements came from this pool and are given up here, once.
                unsafe { pool.free_bulk_slots_raw(&mut s) };
            }
        }
        // SAFETY: the elements came from this pool and are given up here, once.
        unsafe { pool.free_bulk_slots_raw(&mut slots) };
        // SAFETY: the elements came from this pool and are given up here, once.
        unsafe { pool.free_bulk_raw(&mut cb) };

        let mut nb = [None; 16];
        let n = pool.alloc_bulk(Gfp::NOWAIT, &mut nb);
        assert_eq!(n, nb.iter().flatten().count(), "count must match the slots");
        assert!(nb[..n].iter().all(Option::is_some), "a prefix is filled");
        // SAFETY: the elements came from this pool and are given up here, once.
        unsafe { pool.free_bulk_slots_raw(&mut nb) };
        if let Some(p) = pool.alloc(Gfp::ATOMIC) {
            // SAFETY: the elements came from this pool and are given up here, once.
            unsafe { pool.free_raw(p) };
        }
    }
    assert!(alloc.fault().injected() > 100);
    assert_eq!(pool.reserve_len(), 64);
    alloc.fault().disable();
    drop(pool);
    assert_no_leaks(&alloc);
}

/// Creating a pool whose source fails part-way returns a clear error and
/// gives back the elements it did get.
#[test]
fn pool_creation_fails_cleanly_when_the_source_runs_dry() {
    let alloc = small(4);
    alloc.fault().enable(FaultConfig {
        interval: 5,
        ..FaultConfig::default()
    });
    match PagePool::pages(&alloc, 0, 16) {
        Err(Error::BadSetting { name, reason, .. }) => {
            assert_eq!(name, "min_nr");
            assert!(reason.contains("supplied only"), "{reason}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("the pool cannot be filled"),
    }
    alloc.fault().disable();
    assert_no_leaks(&alloc);

    let src = BoxSource::new(|| 0u8).with_limit(3);
    assert!(Mempool::new(src, 4).is_err());
    assert!(PageSource::new(alloc.clone(), 11).is_err());
    assert!(Mempool::new(BoxSource::new(|| 0u8), iopages::MEMPOOL_MIN_NR_MAX + 1).is_err());
}

/// Growing the reserve allocates now, shrinking returns the excess now, a
/// failed grow leaves the pool as it was, and dropping the pool returns
/// every element.
#[test]
fn resize_grows_and_shrinks_the_reserve_and_drop_returns_everything() {
    let pool = Mempool::new(BoxSource::new(|| [0u8; 64]), 4).unwrap();
    pool.resize(10).unwrap();
    assert_eq!((pool.min_nr(), pool.reserve_len()), (10, 10));
    assert_eq!(pool.source().live(), 10);
    pool.resize(2).unwrap();
    assert_eq!((pool.min_nr(), pool.reserve_len()), (2, 2));
    assert_eq!(pool.source().live(), 2);
    pool.source().set_limit(5);
    assert!(pool.resize(8).is_err());
    assert_eq!((pool.min_nr(), pool.reserve_len()), (2, 2));
    assert_eq!(pool.source().live(), 2, "the partial grow was given back");
    pool.source().set_limit(usize::MAX);
    pool.resize(0).unwrap();
    assert_eq!((pool.min_nr(), pool.reserve_len()), (0, 0));
    assert_eq!(pool.source().live(), 0);

    // min_nr 0 still parks one freed element while the reserve is empty,
    // so a sleeper can be woken with something to take.
    let b = pool.alloc(Gfp::KERNEL).unwrap();
    pool.free(b);
    assert_eq!(pool.reserve_len(), 1);

    let alloc = small(4);
    let pages = PagePool::pages(&alloc, 2, 8).unwrap();
    pages.resize(20).unwrap();
    let p = pages.alloc(Gfp::KERNEL).unwrap();
    assert_eq!(p.pfn() % 4, 0, "order-2 blocks");
    // SAFETY: the elements came from this pool and are given up here, once.
    unsafe { pages.free_raw(p) };
    alloc.fault().enable(FaultConfig::default());
    assert!(pages.resize(40).is_err());
    alloc.fault().disable();
    assert_eq!(pages.reserve_len(), 20);
    drop(pages);
    assert_no_leaks(&alloc);
}
