//! The per-thread handle (`LocalAllocator`) and the depot between threads.
//!
//! Contracts: a handle's pages are counted while it holds them and come
//! back when it is flushed or dropped; every path (cache, depot, per-CPU
//! list, zone, slow path, fault injection) hands a page to one owner at a
//! time; nothing leaks. The 16-thread test passes pages between threads
//! through handles and the shared API at once, with a tag in every page.

mod common;
use common::{assert_no_leaks, builder};
use iopages::{FaultConfig, Gfp, LocalAllocator, LocalFastPath, Page, PageAllocator, PAGE_SIZE};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;

fn write_tag(alloc: &PageAllocator, p: Page, tag: u64) {
    let base = alloc.page_address(p);
    // SAFETY: the page is allocated to the caller and lies in the arena.
    unsafe {
        base.cast::<u64>().write_volatile(tag);
        base.add(PAGE_SIZE - 8).cast::<u64>().write_volatile(!tag);
    }
}

fn check_tag(alloc: &PageAllocator, p: Page, tag: u64) {
    let base = alloc.page_address(p);
    // SAFETY: as in `write_tag`.
    let got = unsafe {
        (
            base.cast::<u64>().read_volatile(),
            base.add(PAGE_SIZE - 8).cast::<u64>().read_volatile(),
        )
    };
    assert_eq!(
        got,
        (tag, !tag),
        "pfn {}: tag overwritten, the page had two owners",
        p.pfn()
    );
}

#[test]
fn a_handle_counts_its_cached_pages_and_gives_them_back_on_drop() {
    let alloc = builder(8).checks(true).build().unwrap();
    let mut local = alloc.local();
    let mut batch = Vec::new();
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 48, &mut batch), 48);
    let mut seen = batch.clone();
    seen.sort_by_key(|p| p.pfn());
    seen.dedup();
    assert_eq!(seen.len(), 48, "a bulk allocation handed a page out twice");
    assert_eq!(alloc.accounting().in_use_pages, 48);
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut batch) };
    assert!(batch.is_empty(), "free_bulk empties the vector");
    let a = alloc.accounting();
    assert_eq!(a.in_use_pages, 0, "cached pages are free: {a}");
    assert!(local.cached_pages() > 0);
    assert_eq!(a.thread_cache_pages, local.cached_pages());
    let single = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    let order2 = local.alloc_pages(Gfp::KERNEL, 2).unwrap();
    let big = local.alloc_pages(Gfp::KERNEL, 6).unwrap();
    assert_eq!(order2.pfn() % 4, 0);
    assert_eq!(alloc.accounting().in_use_pages, 1 + 4 + 64);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(single, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(order2, 2) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(big, 6) };
    drop(local);
    assert_eq!(alloc.accounting().thread_cache_pages, 0);
    assert_no_leaks(&alloc);
}

#[test]
fn a_batch_comes_back_most_recently_freed_first() {
    let alloc = builder(8).checks(false).build().unwrap();
    let mut local = alloc.local();
    let mut v = Vec::new();
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 16, &mut v), 16);
    let freed = v.clone();
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 16, &mut v), 16);
    let mut reversed = freed.clone();
    reversed.reverse();
    assert_eq!(
        v, reversed,
        "the last page freed must be the first handed out"
    );
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    assert_eq!(local.alloc_pages(Gfp::KERNEL, 0), Some(freed[0]));
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(freed[0], 0) };
    drop(local);
    assert_no_leaks(&alloc);
}

/// Batches of 2 to 4 freed into the cache packed into 8-byte stores or
/// one store per slot (the builder's choice; the default follows the
/// CPU): the same pages come back, most recently freed first, and none
/// is lost.
#[test]
fn small_batches_round_trip_packed_or_not() {
    for packed in [false, true] {
        let alloc = builder(8)
            .checks(false)
            .pack_small_batches(packed)
            .build()
            .unwrap();
        let mut local = alloc.local();
        for n in 1..=5 {
            let mut v = Vec::new();
            assert_eq!(local.alloc_bulk(Gfp::KERNEL, n, &mut v), n);
            let freed = v.clone();
            // SAFETY: the pages came from this allocator and are given up here, once.
            unsafe { local.free_bulk(&mut v) };
            assert_eq!(local.alloc_bulk(Gfp::KERNEL, n, &mut v), n);
            let mut reversed = freed.clone();
            reversed.reverse();
            assert_eq!(v, reversed, "packed {packed}, batch {n}");
            // SAFETY: as above.
            unsafe { local.free_bulk(&mut v) };
        }
        drop(local);
        assert_no_leaks(&alloc);
    }
}

/// A single free stores its page unless the slot above the length holds
/// it already (the page the last allocation took): a page freed out of
/// that order is the next one out, and none is handed out twice.
#[test]
fn a_single_free_out_of_order_is_stored() {
    let alloc = builder(8).checks(false).build().unwrap();
    let mut local = alloc.local();
    let p = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    let q = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    assert_ne!(p, q);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(p, 0) }; // q's slot is above the length
    assert_eq!(local.alloc_pages(Gfp::KERNEL, 0), Some(p));
    // SAFETY: as above.
    unsafe { local.free_pages(p, 0) }; // p's slot: no store
    assert_eq!(local.alloc_pages(Gfp::KERNEL, 0), Some(p));
    // SAFETY: as above.
    unsafe { local.free_pages(q, 0) };
    // SAFETY: as above.
    unsafe { local.free_pages(p, 0) };
    assert_eq!(local.alloc_pages(Gfp::KERNEL, 0), Some(p));
    assert_eq!(local.alloc_pages(Gfp::KERNEL, 0), Some(q));
    // SAFETY: as above.
    unsafe { local.free_pages(q, 0) };
    // SAFETY: as above.
    unsafe { local.free_pages(p, 0) };
    drop(local);
    assert_no_leaks(&alloc);
}

#[test]
fn a_handle_double_free_is_caught_with_checks_on() {
    let alloc = builder(4).checks(true).build().unwrap();
    let mut local = alloc.local();
    let p = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(p, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        local.free_pages(p, 0)
    }));
    assert!(r.is_err(), "a double free through a handle must panic");
}

#[test]
fn batches_larger_than_the_cache_and_the_arena_are_served_then_cut_short() {
    for checks in [false, true] {
        let alloc = builder(4).checks(checks).build().unwrap();
        let total = alloc.accounting().total_pages;
        let mut local = alloc.local();
        let mut v = Vec::new();
        for nr in [1, 63, 64, 65, 256, 1000] {
            assert_eq!(local.alloc_bulk(Gfp::KERNEL, nr, &mut v), nr);
            for (i, &p) in v.iter().enumerate() {
                write_tag(&alloc, p, i as u64);
            }
            for (i, &p) in v.iter().enumerate() {
                check_tag(&alloc, p, i as u64);
            }
            // SAFETY: the pages came from this allocator and are given up here, once.
            unsafe { local.free_bulk(&mut v) };
        }
        // More than the arena holds: a short count, every page distinct,
        // nothing lost when they are freed.
        let got = local.alloc_bulk(Gfp::KERNEL | Gfp::NOWARN, total + 10, &mut v);
        assert!(got < total && got > total / 2, "got {got} of {total}");
        let mut s = v.clone();
        s.sort_by_key(|p| p.pfn());
        s.dedup();
        assert_eq!(s.len(), got);
        // SAFETY: the pages came from this allocator and are given up here, once.
        unsafe { local.free_bulk(&mut v) };
        drop(local);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn fault_injection_reaches_the_handle_and_partial_fills_leak_nothing() {
    let alloc = builder(8).build().unwrap();
    let mut local = alloc.local();
    // Warm the cache so that the fast path would serve everything.
    let mut v = Vec::new();
    local.alloc_bulk(Gfp::KERNEL, 64, &mut v);
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    alloc.fault().enable(FaultConfig {
        probability_ppm: 300_000,
        ..FaultConfig::default()
    });
    let (mut short, mut none) = (0, 0);
    for _ in 0..200 {
        let got = local.alloc_bulk(Gfp::KERNEL | Gfp::NOWARN, 16, &mut v);
        short += (got < 16) as u32;
        // SAFETY: the pages came from this allocator and are given up here, once.
        unsafe { local.free_bulk(&mut v) };
        match local.alloc_pages(Gfp::KERNEL | Gfp::NOWARN, 0) {
            // SAFETY: the test allocated these pages and gives them up here, once.
            Some(p) => unsafe { local.free_pages(p, 0) },
            None => none += 1,
        }
    }
    alloc.fault().disable();
    assert!(
        short > 0 && none > 0,
        "injected failures must reach the handle"
    );
    drop(local);
    assert_no_leaks(&alloc);
}

#[test]
fn zeroed_and_movable_requests_take_the_careful_path() {
    let alloc = builder(8).checks(false).build().unwrap();
    let mut local = alloc.local();
    let mut v = Vec::new();
    local.alloc_bulk(Gfp::KERNEL, 8, &mut v);
    for &p in &v {
        write_tag(&alloc, p, 0xdead);
    }
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    // The dirty pages are cached; ZERO must still hand out zeroes.
    assert_eq!(local.alloc_bulk(Gfp::KERNEL | Gfp::ZERO, 8, &mut v), 8);
    for &p in &v {
        // SAFETY: allocated to this thread.
        let bytes = unsafe { std::slice::from_raw_parts(alloc.page_address(p), PAGE_SIZE) };
        assert!(bytes.iter().all(|&b| b == 0), "Gfp::ZERO page not zeroed");
    }
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    let p = local.alloc_pages(Gfp::ZERO, 0).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { *alloc.page_address(p) }, 0);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(p, 0) };
    drop(local);
    assert_no_leaks(&alloc);
}

#[test]
fn handles_work_with_thread_caches_off() {
    let alloc = builder(8)
        .thread_cache_pages(0)
        .checks(true)
        .build()
        .unwrap();
    let mut local = alloc.local();
    let mut v = Vec::new();
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 100, &mut v), 100);
    assert_eq!(local.cached_pages(), 0);
    // SAFETY: the pages came from this allocator and are given up here, once.
    unsafe { local.free_bulk(&mut v) };
    let p = local.alloc_pages(Gfp::KERNEL, 1).unwrap();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { local.free_pages(p, 1) };
    drop(local);
    assert_no_leaks(&alloc);
}

#[test]
fn a_handle_moves_to_another_thread() {
    let alloc = builder(8).build().unwrap();
    let mut local = alloc.local();
    let mut v = Vec::new();
    local.alloc_bulk(Gfp::KERNEL, 32, &mut v);
    let h = thread::spawn(move || {
        // SAFETY: the pages came from this allocator and are given up here, once.
        unsafe { local.free_bulk(&mut v) };
        local
    });
    let mut local = h.join().unwrap();
    local.flush();
    assert_eq!(local.cached_pages(), 0);
    drop(local);
    assert_no_leaks(&alloc);
}

#[test]
fn pages_cross_threads_through_the_depot_as_whole_magazines() {
    // A producer allocates, a consumer frees: the consumer's full cache
    // parks magazines in the depot and the producer takes them, so the
    // zone sees few refills.
    let alloc = builder(16).checks(false).build().unwrap();
    let (tx, rx) = mpsc::sync_channel::<Vec<Page>>(4);
    let prod = {
        let a = alloc.clone();
        thread::spawn(move || {
            let mut local = a.local();
            for i in 0..4000u64 {
                let mut v = Vec::with_capacity(64);
                assert_eq!(local.alloc_bulk(Gfp::KERNEL, 64, &mut v), 64);
                for &p in &v {
                    write_tag(&a, p, i << 32 | u64::from(p.pfn()));
                }
                tx.send(v).unwrap();
            }
        })
    };
    let cons = {
        let a = alloc.clone();
        thread::spawn(move || {
            let mut local = a.local();
            for (i, mut v) in rx.into_iter().enumerate() {
                for &p in &v {
                    check_tag(&a, p, (i as u64) << 32 | u64::from(p.pfn()));
                }
                // SAFETY: the pages came from this allocator and are given up here, once.
                unsafe { local.free_bulk(&mut v) };
            }
        })
    };
    prod.join().unwrap();
    cons.join().unwrap();
    let s = alloc.stats();
    assert!(
        s.alloc_zone < 4000 * 64 / 4,
        "most pages should have come back through the depot, not the zone:\n{s}"
    );
    assert_no_leaks(&alloc);
}

/// A batch of tagged pages passed around the ring.
type Batch = Vec<(Page, u64)>;

/// 16 threads in a ring: each allocates (handle or shared API, single or
/// bulk), tags, sends to the next thread, which checks and frees (again
/// through a handle or the shared API). On 2 cores this oversubscribes.
fn ring_stress(alloc: PageAllocator) {
    const THREADS: usize = 16;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::sync_channel::<Batch>(8)).unzip();
    let mut rxs: Vec<_> = rxs.into_iter().map(Some).collect();
    let start = Arc::new(Barrier::new(THREADS));
    let hs: Vec<_> = txs
        .into_iter()
        .enumerate()
        .map(|(id, tx)| {
            let rx = rxs[(id + THREADS - 1) % THREADS].take().unwrap();
            let (a, start) = (alloc.clone(), start.clone());
            thread::spawn(move || ring_member(&a, id, &start, tx, rx))
        })
        .collect();
    let (mut sent, mut freed) = (0, 0);
    for h in hs {
        let (s, f) = h.join().expect("a stress thread panicked");
        sent += s;
        freed += f;
    }
    assert_eq!(sent, freed, "every page sent must be freed");
    assert!(sent > 16 * 1500, "too few pages moved: {sent}");
    assert_eq!(alloc.accounting().thread_cache_pages, 0);
    assert_no_leaks(&alloc);
}

/// Thread `id` of the ring (even ids through a handle, odd ones through
/// the shared API): allocate, tag and send a batch each round, check and
/// free what the previous thread sent. Returns (pages sent, pages freed).
fn ring_member(
    a: &PageAllocator,
    id: usize,
    start: &Barrier,
    tx: mpsc::SyncSender<Batch>,
    rx: mpsc::Receiver<Batch>,
) -> (u64, u64) {
    const ROUNDS: u64 = 1500;
    let mut local = a.local();
    let use_handle = id % 2 == 0;
    let mut sent = 0u64;
    let mut freed = 0u64;
    start.wait();
    for i in 0..ROUNDS {
        let nr = 1 + (i as usize * 7 + id) % 64;
        let mut pages = Vec::new();
        if use_handle {
            local.alloc_bulk(Gfp::KERNEL | Gfp::NOWARN, nr, &mut pages);
        } else {
            a.alloc_pages_bulk_list(Gfp::KERNEL | Gfp::NOWARN, nr, &mut pages);
        }
        let batch: Batch = pages
            .into_iter()
            .map(|p| {
                let t = (id as u64) << 48 | i << 16 | u64::from(p.pfn() & 0xffff);
                write_tag(a, p, t);
                (p, t)
            })
            .collect();
        sent += batch.len() as u64;
        tx.send(batch).unwrap();
        while let Ok(b) = rx.try_recv() {
            freed += free_ring_batch(a, &mut local, b, i, use_handle);
        }
    }
    drop(tx);
    for b in rx.iter() {
        freed += free_ring_batch(a, &mut local, b, 0, use_handle);
    }
    (sent, freed)
}

/// Check a received batch's tags and free it: one by one through the
/// handle every third round, else in bulk through the handle or the
/// shared API. Returns how many pages it freed.
fn free_ring_batch(
    a: &PageAllocator,
    local: &mut LocalAllocator,
    batch: Batch,
    i: u64,
    use_handle: bool,
) -> u64 {
    for &(p, t) in &batch {
        check_tag(a, p, t);
    }
    let mut pages: Vec<Page> = batch.iter().map(|&(p, _)| p).collect();
    if i % 3 == 0 {
        for p in pages {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { local.free_pages(p, 0) };
        }
    } else if use_handle {
        // SAFETY: the pages came from this allocator and are given up here, once.
        unsafe { local.free_bulk(&mut pages) };
    } else {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { a.free_pages_bulk(&pages) };
    }
    batch.len() as u64
}

#[test]
fn sixteen_threads_pass_pages_around_with_checks_on() {
    ring_stress(builder(32).checks(true).build().unwrap());
}

#[test]
fn sixteen_threads_pass_pages_around_with_checks_off() {
    ring_stress(builder(32).checks(false).build().unwrap());
}

#[test]
fn sixteen_threads_in_a_tight_arena_with_a_small_depot() {
    // 8 MiB for 16 threads: allocations come back short, the depot fills,
    // the per-CPU lists and the zone take the overflow.
    ring_stress(builder(8).depot_pages(128).nr_cpus(2).build().unwrap());
}

/// The callback forms (`alloc_bulk_with`, `free_bulk_with`) and the
/// fast-path-only forms (`alloc_cached`, `free_cached`,
/// `alloc_bulk_cached`, `free_bulk_cached`) hand out and take back the
/// same pages as the vector forms: each page to one owner, counted while
/// held, refused batches changing nothing, with checks on and off, in the
/// cache and past it.
#[test]
fn the_slice_and_slot_forms_hand_each_page_to_one_owner_and_refuse_cleanly() {
    for checks in [false, true] {
        let alloc = builder(4).checks(checks).build().unwrap();
        let mut local = alloc.local();
        let mut spill = Vec::new();
        // Warm the cache, then sizes inside it and past it (slow path).
        let mut v = Vec::new();
        assert_eq!(local.alloc_bulk(Gfp::KERNEL, 32, &mut v), 32);
        // SAFETY: just allocated here, given up once.
        unsafe { local.free_bulk(&mut v) };
        for nr in [0, 1, 8, 32, 300] {
            callback_forms_round_trip(&alloc, &mut local, &mut spill, checks, nr);
        }
        fast_path_only_forms(&mut local, checks);
        drop(local);
        assert_no_leaks(&alloc);
    }
}

/// `nr` pages through `alloc_bulk_with`, each to one owner and counted
/// while held; a refused `free_bulk_with` frees nothing, an accepted one
/// frees them all.
fn callback_forms_round_trip(
    alloc: &PageAllocator,
    local: &mut LocalAllocator,
    spill: &mut Vec<Page>,
    checks: bool,
    nr: usize,
) {
    let mut held: Vec<Page> = local.alloc_bulk_with(Gfp::KERNEL, nr, spill, |s| s.to_vec());
    assert_eq!(held.len(), nr, "checks {checks}, nr {nr}");
    let mut s = held.clone();
    s.sort_by_key(|p| p.pfn());
    s.dedup();
    assert_eq!(s.len(), nr, "a page handed out twice");
    assert_eq!(alloc.accounting().in_use_pages, nr);
    for (i, &p) in held.iter().enumerate() {
        write_tag(alloc, p, i as u64);
    }
    // Pages still held are never handed out again.
    let other = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    assert!(
        !held.contains(&other),
        "pfn {} handed out while held",
        other.pfn()
    );
    // SAFETY: allocated here, given up once.
    unsafe { local.free_pages(other, 0) };
    for (i, &p) in held.iter().enumerate() {
        check_tag(alloc, p, i as u64);
    }
    // A refused batch frees nothing: the pages are still held.
    // SAFETY: `fill` returns false, so nothing is given up.
    let kept = unsafe {
        local.free_bulk_with(nr, spill, |slots| {
            for (d, &p) in slots.iter_mut().zip(&held) {
                d.write(p);
            }
            false
        })
    };
    assert!(!kept);
    assert_eq!(
        alloc.accounting().in_use_pages,
        nr,
        "a refused batch freed pages"
    );
    // SAFETY: every slot written with a page held here, given up once.
    let freed = unsafe {
        local.free_bulk_with(nr, spill, |slots| {
            for (d, &p) in slots.iter_mut().zip(&held) {
                d.write(p);
            }
            true
        })
    };
    assert!(freed);
    held.clear();
    assert_eq!(alloc.accounting().in_use_pages, 0);
}

/// The fast-path-only forms: served from the cache with checks off,
/// declined (nothing done) where the full path is needed.
fn fast_path_only_forms(local: &mut LocalAllocator, checks: bool) {
    let got = local.alloc_bulk_cached(Gfp::KERNEL, 8, |s| s.to_vec());
    let single = local.alloc_cached(Gfp::KERNEL);
    assert_eq!(got.is_some(), !checks);
    assert_eq!(single.is_some(), !checks);
    assert!(local
        .alloc_bulk_cached(Gfp::KERNEL, 1 << 20, |s| s.len())
        .is_none());
    assert!(local.alloc_cached(Gfp::KERNEL | Gfp::ZERO).is_none());
    let p = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
    // SAFETY: allocated here, given up once (when accepted).
    let took = unsafe { local.free_cached(p) };
    assert_eq!(took, !checks);
    if !took {
        // SAFETY: declined above, so still ours; given up once.
        unsafe { local.free_pages(p, 0) };
    }
    let mut back: Vec<Page> = got.into_iter().flatten().chain(single).collect();
    let n = back.len();
    // SAFETY: every slot written with a page held here, given up once.
    let r = unsafe {
        local.free_bulk_cached(n, |slots| {
            for (d, &p) in slots.iter_mut().zip(&back) {
                d.write(p);
            }
            true
        })
    };
    // An empty batch has nothing to check: served either way.
    assert_eq!(r, (!checks || n == 0).then_some(true));
    if r.is_none() {
        // SAFETY: declined, so still ours; given up once.
        unsafe { local.free_bulk(&mut back) };
    }
}

/// What the C header's inline functions do through the view: pop and push
/// on the shared record alone (relaxed loads and stores), one compare each.
mod view {
    use iopages::{Gfp, LocalFastPath, Page};
    use std::sync::atomic::Ordering::Relaxed;

    pub fn pop(v: &LocalFastPath) -> Option<Page> {
        // SAFETY: the view's pointers are live while the handle is; the
        // test's thread owns the handle.
        let (len, floor) = unsafe { (&*v.len, &*v.floor) };
        let n = len.load(Relaxed);
        if Gfp::KERNEL.bits() & v.careful != 0 || n <= floor.load(Relaxed) {
            return None;
        }
        // SAFETY: slots below `n` hold cached pages.
        let raw = unsafe { v.buf.add(n - 1).read() };
        len.store(n - 1, Relaxed);
        Some(Page::from_pfn(raw - 1))
    }

    pub fn push(v: &LocalFastPath, p: Page) -> bool {
        // SAFETY: as in `pop`.
        let len = unsafe { &*v.len };
        let n = len.load(Relaxed);
        if n >= v.cap {
            return false;
        }
        // SAFETY: the slot is inside the buffer.
        unsafe { v.buf.add(n).write(p.pfn() + 1) };
        len.store(n + 1, Relaxed);
        true
    }
}

/// Why every call is careful: nothing, checks, or every call counted.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Careful {
    No,
    Checks,
    Counted,
}

#[test]
fn the_fast_path_view_and_the_handle_take_turns() {
    for careful in [Careful::No, Careful::Checks, Careful::Counted] {
        view_and_handle(careful);
    }
}

/// What one run of [`view_and_handle`] holds and counted.
#[derive(Default)]
struct Turns {
    held: Vec<(Page, u64)>,
    tag: u64,
    via_view_allocs: u64,
    via_view_frees: u64,
    handle_allocs: u64,
    handle_frees: u64,
}

/// Every method uses the handle through `raw` only, one call at a time,
/// and frees only pages held here, once.
impl Turns {
    /// Tag `p` with a fresh tag and hold it.
    fn hold(&mut self, alloc: &PageAllocator, p: Page) {
        self.tag += 1;
        write_tag(alloc, p, self.tag);
        self.held.push((p, self.tag));
    }

    /// One page, from the view when it has one.
    fn alloc_one(&mut self, alloc: &PageAllocator, raw: *mut LocalAllocator, v: &LocalFastPath) {
        let p = match pop_or_refill(raw, v) {
            (p, true) => {
                self.via_view_allocs += 1;
                p
            }
            (p, false) => {
                self.handle_allocs += 1;
                p
            }
        };
        self.hold(alloc, p);
    }

    /// A bulk allocation through the handle.
    fn alloc_batch(&mut self, alloc: &PageAllocator, raw: *mut LocalAllocator, r: u32) {
        let mut batch = Vec::new();
        // SAFETY: `raw` is the live handle, used by one call at a time.
        let n = unsafe { (*raw).alloc_bulk(Gfp::KERNEL, 1 + (r as usize >> 4) % 90, &mut batch) };
        assert_eq!(n, batch.len());
        self.handle_allocs += n as u64;
        for p in batch {
            self.hold(alloc, p);
        }
    }

    /// Free the newest page: into the view, or (cache full) the handle.
    fn free_one(&mut self, alloc: &PageAllocator, raw: *mut LocalAllocator, v: &LocalFastPath) {
        let (p, t) = self.held.pop().unwrap();
        check_tag(alloc, p, t);
        if view::push(v, p) {
            self.via_view_frees += 1;
        } else {
            self.handle_frees += 1;
            // SAFETY: the page is held here once and given up.
            unsafe { (*raw).free_pages(p, 0) };
        }
    }

    /// Free a batch of the newest pages in bulk through the handle.
    fn free_batch(&mut self, alloc: &PageAllocator, raw: *mut LocalAllocator, r: u32) {
        let k = (1 + (r as usize >> 4) % 70).min(self.held.len());
        let mut batch: Vec<Page> = Vec::new();
        for (p, t) in self.held.drain(self.held.len() - k..) {
            check_tag(alloc, p, t);
            batch.push(p);
        }
        self.handle_frees += k as u64;
        // SAFETY: the pages are held here once each and given up.
        unsafe { (*raw).free_bulk(&mut batch) };
    }

    /// Step `r` of the pseudo-random walk.
    fn step(&mut self, alloc: &PageAllocator, raw: *mut LocalAllocator, v: &LocalFastPath, r: u32) {
        match r % 6 {
            0 | 1 if self.held.len() < 1500 => self.alloc_one(alloc, raw, v),
            2 if self.held.len() < 1400 => self.alloc_batch(alloc, raw, r),
            3 | 4 if !self.held.is_empty() => self.free_one(alloc, raw, v),
            _ if !self.held.is_empty() => self.free_batch(alloc, raw, r),
            _ => {}
        }
    }
}

fn view_and_handle(careful: Careful) {
    let alloc = builder(16)
        .checks(careful == Careful::Checks)
        .fast_path_stats(careful == Careful::Counted)
        .build()
        .unwrap();
    let mut local = alloc.local();
    let raw: *mut LocalAllocator = &mut local;
    // SAFETY: `local` lives and stays put for the whole test; the view is
    // used only between calls on the handle.
    let v = unsafe { LocalAllocator::fast_path(raw) };
    let mut turns = Turns::default();
    let counts = || {
        let s = alloc.stats();
        (s.alloc_thread_cache, s.free_thread_cache)
    };
    let mut last = counts();
    for step in 0..4000u32 {
        let r = step.wrapping_mul(2_654_435_761) >> 7;
        turns.step(&alloc, raw, &v, r);
        let now = counts();
        assert!(
            now.0 >= last.0 && now.1 >= last.1,
            "step {step}: counts went down, {last:?} -> {now:?}"
        );
        last = now;
        if step % 250 == 0 {
            let a = alloc.accounting();
            assert_eq!(a.in_use_pages, turns.held.len(), "step {step}");
        }
    }
    if careful == Careful::No {
        assert!(turns.via_view_allocs > 100 && turns.via_view_frees > 100);
    } else {
        // Careful: the view declines every call, and the full path
        // counts every page (the counts are exact).
        assert_eq!((turns.via_view_allocs, turns.via_view_frees), (0, 0));
        assert!(
            last.0 >= turns.handle_allocs && last.1 >= turns.handle_frees,
            "{last:?}"
        );
    }
    for (p, t) in turns.held.drain(..) {
        check_tag(&alloc, p, t);
        // SAFETY: the page is held here once and given up.
        unsafe { (*raw).free_pages(p, 0) };
    }
    drop(local);
    assert_no_leaks(&alloc);
}

/// A page from the view, or (cache empty) from the handle; `true` when
/// the view served it.
fn pop_or_refill(raw: *mut LocalAllocator, v: &LocalFastPath) -> (Page, bool) {
    if let Some(p) = view::pop(v) {
        return (p, true);
    }
    // SAFETY: see the test.
    unsafe { ((*raw).alloc_pages(Gfp::KERNEL, 0).expect("a page"), false) }
}

#[test]
fn with_checks_on_every_flag_set_takes_the_checked_path_even_none() {
    // An empty flag set intersects nothing, so a fast path that tested
    // "any careful flag" alone served it from the cache unchecked: the
    // page was never marked allocated and its free was refused.
    let alloc = builder(16).checks(true).build().unwrap();
    let mut local = alloc.local();
    let mut warm = Vec::new();
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 32, &mut warm), 32);
    // SAFETY: just allocated here, each once.
    unsafe { local.free_bulk(&mut warm) };
    assert!(local.cached_pages() > 0);
    for gfp in [Gfp::empty(), Gfp::NOWARN, Gfp::KERNEL] {
        let p = local.alloc_pages(gfp, 0).expect("a page");
        write_tag(&alloc, p, 7);
        // SAFETY: allocated here, freed once.
        unsafe { local.free_pages(p, 0) };
        let mut v = Vec::new();
        assert_eq!(local.alloc_bulk(gfp, 4, &mut v), 4);
        // SAFETY: as above.
        unsafe { local.free_bulk(&mut v) };
    }
    drop(local);
    assert_no_leaks(&alloc);
}

/// The fast paths decline exactly when a careful condition holds: fault
/// injection switched on (and only while it is), flags that need
/// preparing, checks, counting every call — and serve otherwise.
#[test]
fn the_fast_path_declines_exactly_when_the_call_must_be_careful() {
    for (checks, counted) in [(false, false), (true, false), (false, true)] {
        let alloc = builder(8)
            .checks(checks)
            .fast_path_stats(counted)
            .build()
            .unwrap();
        let careful = checks || counted;
        let mut local = alloc.local();
        let mut warm = Vec::new();
        assert_eq!(local.alloc_bulk(Gfp::KERNEL, 16, &mut warm), 16);
        // SAFETY: just allocated here, each once.
        unsafe { local.free_bulk(&mut warm) };
        assert!(local.cached_pages() >= 16);
        let hit = |local: &mut LocalAllocator, gfp: Gfp| {
            let p = local.alloc_cached(gfp);
            if let Some(p) = p {
                // SAFETY: allocated here, given up once.
                unsafe { local.free_pages(p, 0) };
            }
            p.is_some()
        };
        assert_eq!(hit(&mut local, Gfp::KERNEL), !careful);
        assert!(!hit(&mut local, Gfp::KERNEL | Gfp::ZERO));
        assert!(!hit(&mut local, Gfp::KERNEL | Gfp::MOVABLE));
        alloc.fault().enable(iopages::FaultConfig::default());
        assert!(!hit(&mut local, Gfp::KERNEL), "fault injection on");
        assert!(local.alloc_pages(Gfp::KERNEL, 0).is_none(), "injected");
        assert!(
            alloc.alloc_pages(Gfp::KERNEL, 0).is_none(),
            "thread cache too"
        );
        alloc.fault().disable();
        assert_eq!(
            hit(&mut local, Gfp::KERNEL),
            !careful,
            "injection off again"
        );
        // Frees: served below the fast capacity, declined when careful.
        let p = local.alloc_pages(Gfp::KERNEL, 0).unwrap();
        // SAFETY: allocated here, given up once (when accepted).
        let took = unsafe { local.free_cached(p) };
        assert_eq!(took, !careful);
        if !took {
            // SAFETY: declined, so still ours.
            unsafe { local.free_pages(p, 0) };
        }
        drop(local);
        assert_no_leaks(&alloc);
    }
}
