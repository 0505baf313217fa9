//! Background reclaim: woken below the low watermark, it runs the
//! shrinkers until the zone is above its high watermark, then sleeps with
//! no timer; it can be stopped and started again.
//!
//! The test orders itself on the thread's state, never on sleeps: it waits
//! for `kswapd_idle()` (asleep, no wake-up pending) before it reads
//! settled statistics.

mod common;
use common::{builder, Holding, HoldingShrinker};
use iopages::{Gfp, PageAllocator, Shrinker};
use std::time::{Duration, Instant};

/// Fill the arena with cache pages until an allocation drops the zone
/// below its low watermark (which wakes background reclaim).
fn fill(alloc: &PageAllocator, cache: &HoldingShrinker) {
    let low = alloc.watermarks().low;
    while alloc.accounting().buddy_free_pages + alloc.accounting().depot_pages > low / 2 {
        match alloc.alloc_pages(Gfp::NOWAIT, 0) {
            Some(p) => cache.hold(p),
            None => break,
        }
    }
}

/// Poll `f` (yielding between tries) until it holds; a bound, not an
/// ordering: the test fails if it takes longer than 20 s.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::yield_now();
    }
}

#[test]
fn below_low_it_reclaims_to_high_then_sleeps_and_can_be_stopped() {
    let alloc = builder(16).build().unwrap();
    let bulk = Holding {
        free_in_bulk: true,
        ..Holding::default()
    };
    let cache = HoldingShrinker::new(&alloc, Vec::new(), bulk);
    let id = alloc.shrinkers().register(cache.clone());
    assert!(!alloc.kswapd_running(), "started only by a wake-up");
    fill(&alloc, &cache);
    let held = cache.count_objects();
    assert!(held > 0);
    let high = alloc.watermarks().high;
    // A round's counters are bumped after its pages are freed: wait for
    // both, or the statistics can be read between the two.
    wait_until("background reclaim to reach the high watermark", || {
        let a = alloc.accounting();
        a.buddy_free_pages + a.depot_pages >= high && alloc.kswapd_stats().0 >= 1
    });
    let (rounds, reclaimed) = alloc.kswapd_stats();
    assert!(
        rounds >= 1 && reclaimed > 0,
        "rounds {rounds}, reclaimed {reclaimed}"
    );
    assert!(cache.scans() > 0);
    assert!(
        (reclaimed as usize) < held,
        "it stops near high instead of emptying the cache ({reclaimed} of {held})"
    );
    // Quiet when idle: once asleep with no wake-up pending, work that
    // stays above the low watermark does not wake it (no timer does).
    wait_until("background reclaim to go to sleep", || alloc.kswapd_idle());
    let settled = alloc.kswapd_stats();
    for _ in 0..64 {
        let p = alloc.alloc_pages(Gfp::NOWAIT, 0).expect("above high");
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    assert!(
        alloc.kswapd_idle(),
        "kswapd woke while memory was plentiful"
    );
    assert_eq!(alloc.kswapd_stats(), settled, "kswapd ran while idle");
    // Stopped, it does nothing however low memory gets: the stop flag is
    // set before the wake-ups, and a round starts only after the thread
    // has seen the flag clear, so no round can begin from here on.
    alloc.stop_kswapd();
    assert!(!alloc.kswapd_running());
    assert!(alloc.kswapd_idle());
    fill(&alloc, &cache);
    assert_eq!(alloc.kswapd_stats(), settled, "a stopped kswapd ran");
    // Started again, the next wake-up brings it back.
    alloc.start_kswapd();
    wait_until("a restarted kswapd to run", || {
        // Keep allocating below low: past the thread's cache, an
        // allocation reaches the zone, fails the low watermark and wakes
        // background reclaim.
        if let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, 0) {
            cache.hold(p);
        }
        alloc.kswapd_stats().0 > settled.0
    });
    alloc.shrinkers().unregister(id);
    let rest = cache.take_all();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&rest) };
    common::assert_no_leaks(&alloc);
}

#[test]
fn an_allocator_with_a_running_kswapd_drops_cleanly() {
    for _ in 0..20 {
        let alloc = builder(8).build().unwrap();
        let mut held = Vec::new();
        while let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, 0) {
            held.push(p);
        }
        assert!(alloc.kswapd_running());
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&held) };
        drop(alloc);
    }
}
