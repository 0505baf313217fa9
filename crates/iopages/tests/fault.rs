//! Fault injection: every injected failure returns cleanly, leaks nothing,
//! and the configuration's filters are observed through the public API.

mod common;
use common::assert_no_leaks;
use iopages::{FaultConfig, Gfp, HugePages, Page, PageAllocator, MAX_ORDER};

fn small() -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(8 << 20)
        .huge_pages(HugePages::Never)
        .build()
        .unwrap()
}

/// Fill this thread's cache, so that a failure cannot be explained by an
/// empty cache.
fn warm_thread_cache(alloc: &PageAllocator) {
    let pages: Vec<Page> = (0..16)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    for p in pages {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    assert!(alloc.accounting().thread_cache_pages > 0);
}

#[test]
fn single_alloc_fails_while_enabled_and_succeeds_after_disable() {
    let alloc = small();
    warm_thread_cache(&alloc);
    let held = alloc.alloc_pages(Gfp::KERNEL, 2).unwrap();
    alloc.fault().enable(FaultConfig::default());
    assert!(alloc.fault().is_enabled());
    assert_eq!(
        alloc.alloc_pages(Gfp::KERNEL, 0),
        None,
        "cached pages must not bypass injection"
    );
    assert_eq!(alloc.alloc_pages(Gfp::NOWAIT, 0), None);
    assert_eq!(alloc.alloc_pages(Gfp::ATOMIC, 3), None);
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, MAX_ORDER), None);
    assert!(alloc.alloc_box(Gfp::KERNEL, 1).is_none());
    // Frees still work while injection is on.
    // SAFETY: the test allocated this block and gives it up here, once.
    unsafe { alloc.free_pages(held, 2) };
    assert_eq!(alloc.accounting().in_use_pages, 0);
    alloc.fault().disable();
    assert!(!alloc.fault().is_enabled());
    let p = alloc
        .alloc_pages(Gfp::KERNEL, 0)
        .expect("succeeds after disable");
    let q = alloc
        .alloc_pages(Gfp::NOWAIT, 3)
        .expect("succeeds after disable");
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(q, 3) };
    assert_no_leaks(&alloc);
}

#[test]
fn every_failure_path_returns_none_and_leaks_nothing() {
    let alloc = small();
    alloc.fault().enable(FaultConfig::default());
    let flags = [
        Gfp::KERNEL,
        Gfp::NOWAIT,
        Gfp::ATOMIC,
        Gfp::NOIO,
        Gfp::NOFS,
        Gfp::KERNEL | Gfp::NORETRY,
        Gfp::KERNEL | Gfp::RETRY_MAYFAIL,
        Gfp::KERNEL | Gfp::ZERO | Gfp::COMP,
        Gfp::NOWAIT | Gfp::MEMALLOC,
    ];
    let mut expected = 0;
    for gfp in flags {
        for order in 0..=MAX_ORDER {
            assert_eq!(alloc.alloc_pages(gfp, order), None, "{gfp:?} order {order}");
            expected += 1;
        }
        let mut slots = [None; 8];
        assert_eq!(alloc.alloc_pages_bulk_array(gfp, &mut slots), 0, "{gfp:?}");
        assert_eq!(slots, [None; 8]);
        let mut list = Vec::new();
        assert_eq!(alloc.alloc_pages_bulk_list(gfp, 8, &mut list), 0);
        assert!(list.is_empty());
        let mut calls = 0;
        assert_eq!(alloc.alloc_pages_bulk_cb(gfp, 100, |_| calls += 1), 0);
        assert_eq!(calls, 0);
        expected += 3;
        assert_eq!(alloc.accounting().in_use_pages, 0, "{gfp:?}");
    }
    assert_eq!(alloc.fault().injected(), expected);
    alloc.fault().disable();
    assert_no_leaks(&alloc);
}

#[test]
fn nofail_is_never_failed() {
    let alloc = small();
    alloc.fault().enable(FaultConfig::default());
    let before = alloc.fault().injected();
    let mut held = Vec::new();
    for order in [0, 0, 1, 3, 4, 7] {
        let p = alloc
            .alloc_pages(Gfp::KERNEL | Gfp::NOFAIL, order)
            .unwrap_or_else(|| panic!("NOFAIL order {order} failed under injection"));
        held.push((p, order));
    }
    assert_eq!(
        alloc.fault().injected(),
        before,
        "NOFAIL must not count as an injected failure"
    );
    // Others still fail.
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 0), None);
    for (p, o) in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, o) };
    }
    alloc.fault().disable();
    assert_no_leaks(&alloc);
}

#[test]
fn interval_and_times_are_observed_through_alloc_pages() {
    let alloc = small();
    alloc.fault().enable(FaultConfig {
        interval: 3,
        times: Some(2),
        ..FaultConfig::default()
    });
    let mut held = Vec::new();
    let mut failed = Vec::new();
    for i in 0..12 {
        match alloc.alloc_pages(Gfp::NOWAIT, 0) {
            Some(p) => held.push(p),
            None => failed.push(i),
        }
    }
    assert_eq!(failed, vec![2, 5], "every 3rd attempt fails, twice at most");
    assert_eq!(alloc.fault().injected(), 2);

    // Re-enabling restarts the count; without `times` it never stops.
    alloc.fault().enable(FaultConfig {
        interval: 4,
        ..FaultConfig::default()
    });
    let mut failed = Vec::new();
    for i in 0..20 {
        match alloc.alloc_pages(Gfp::KERNEL, 0) {
            Some(p) => held.push(p),
            None => failed.push(i),
        }
    }
    assert_eq!(failed, vec![3, 7, 11, 15, 19]);
    assert_eq!(alloc.fault().injected(), 7);

    // times = Some(0): nothing fails.
    alloc.fault().enable(FaultConfig {
        times: Some(0),
        ..FaultConfig::default()
    });
    for _ in 0..5 {
        held.push(alloc.alloc_pages(Gfp::KERNEL, 0).expect("times exhausted"));
    }
    assert_eq!(alloc.fault().injected(), 7);
    alloc.fault().disable();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn min_order_spares_smaller_orders() {
    let alloc = small();
    alloc.fault().enable(FaultConfig {
        min_order: 3,
        ..FaultConfig::default()
    });
    let mut held = Vec::new();
    for order in 0..3 {
        held.push((
            alloc
                .alloc_pages(Gfp::KERNEL, order)
                .expect("below min_order"),
            order,
        ));
    }
    for order in 3..=MAX_ORDER {
        assert_eq!(alloc.alloc_pages(Gfp::KERNEL, order), None, "order {order}");
    }
    // Bulk allocations are order 0: spared.
    let mut list = Vec::new();
    assert_eq!(alloc.alloc_pages_bulk_list(Gfp::KERNEL, 20, &mut list), 20);
    assert_eq!(alloc.fault().injected(), u64::from(MAX_ORDER - 2));
    alloc.fault().disable();
    for (p, o) in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, o) };
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&list) };
    assert_no_leaks(&alloc);
}

#[test]
fn fail_nowait_false_spares_allocations_that_cannot_block() {
    let alloc = small();
    alloc.fault().enable(FaultConfig {
        fail_nowait: false,
        ..FaultConfig::default()
    });
    let a = alloc.alloc_pages(Gfp::NOWAIT, 0).expect("NOWAIT spared");
    let b = alloc.alloc_pages(Gfp::ATOMIC, 2).expect("ATOMIC spared");
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 0), None);
    assert_eq!(alloc.alloc_pages(Gfp::NOIO, 0), None);
    assert_eq!(alloc.alloc_pages(Gfp::NOFS, 1), None);
    alloc.fault().disable();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(a, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(b, 2) };
    assert_no_leaks(&alloc);
}

#[test]
fn fail_blocking_false_spares_allocations_that_may_block() {
    let alloc = small();
    alloc.fault().enable(FaultConfig {
        fail_blocking: false,
        ..FaultConfig::default()
    });
    let a = alloc.alloc_pages(Gfp::KERNEL, 0).expect("KERNEL spared");
    let b = alloc.alloc_pages(Gfp::NOIO, 1).expect("NOIO spared");
    assert_eq!(alloc.alloc_pages(Gfp::NOWAIT, 0), None);
    assert_eq!(alloc.alloc_pages(Gfp::ATOMIC, 0), None);
    alloc.fault().disable();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(a, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(b, 1) };
    assert_no_leaks(&alloc);
}

#[test]
fn bulk_under_half_probability_returns_partial_fills_and_never_leaks() {
    let alloc = small();
    warm_thread_cache(&alloc);
    alloc.fault().enable(FaultConfig {
        probability_ppm: 500_000,
        seed: 42,
        ..FaultConfig::default()
    });
    let mut held: Vec<Page> = Vec::new();
    let (mut partial, mut nonempty, mut calls) = (0, 0, 0);
    for round in 0..60 {
        let want = 32;
        let n = match round % 3 {
            0 => {
                let mut slots = vec![None; want];
                let pre = alloc.alloc_pages(Gfp::NOFAIL | Gfp::KERNEL, 0).unwrap();
                slots[round % want] = Some(pre);
                let n = alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
                assert_eq!(n, slots.iter().filter(|s| s.is_some()).count());
                assert_eq!(slots[round % want], Some(pre), "pre-filled slot changed");
                held.extend(slots.iter().flatten());
                n
            }
            1 => {
                let mut list = Vec::new();
                let n = alloc.alloc_pages_bulk_list(Gfp::NOWAIT, want, &mut list);
                assert_eq!(n, list.len());
                held.extend(list);
                n
            }
            _ => {
                let mut got = 0;
                let n = alloc.alloc_pages_bulk_cb(Gfp::KERNEL, want, |p| {
                    got += 1;
                    held.push(p);
                });
                assert_eq!(n, got);
                n
            }
        };
        calls += 1;
        if n < want {
            partial += 1;
        }
        if n > usize::from(round % 3 == 0) {
            nonempty += 1;
        }
        assert_eq!(alloc.accounting().in_use_pages, held.len(), "round {round}");
    }
    assert!(partial > 0, "some bulk calls must come back short");
    assert!(
        nonempty > 0,
        "some bulk calls must get pages: {nonempty} of {calls}"
    );
    assert!(alloc.fault().injected() >= partial);
    let distinct: std::collections::HashSet<Page> = held.iter().copied().collect();
    assert_eq!(distinct.len(), held.len());
    // Free while still enabled: frees are never injected.
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    alloc.fault().disable();
    assert_no_leaks(&alloc);
}

#[test]
fn stats_count_injected_failures() {
    let alloc = small();
    let s0 = alloc.stats();
    assert_eq!((s0.fault_injected, s0.failures), (0, 0));
    alloc.fault().enable(FaultConfig {
        probability_ppm: 300_000,
        ..FaultConfig::default()
    });
    let mut none = 0u64;
    let mut held = Vec::new();
    for i in 0..400u32 {
        let order = i % 4;
        match alloc.alloc_pages(Gfp::NOWAIT, order) {
            Some(p) => held.push((p, order)),
            None => none += 1,
        }
    }
    let s = alloc.stats();
    assert!(none > 40 && none < 400, "{none} failures at 30 %");
    assert_eq!(s.fault_injected, none);
    assert_eq!(alloc.fault().injected(), none);
    assert_eq!(s.failures, none, "every injected failure is a failure");
    assert!(
        s.to_string().contains(&format!("fault_injected {none}\n")),
        "{s}"
    );
    alloc.fault().disable();
    for (p, o) in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, o) };
    }
    assert_no_leaks(&alloc);
}

#[test]
fn same_seed_gives_the_same_failures() {
    let pattern = || {
        let alloc = small();
        alloc.fault().enable(FaultConfig {
            probability_ppm: 400_000,
            seed: 7,
            ..FaultConfig::default()
        });
        let mut held = Vec::new();
        let out: Vec<bool> = (0..200)
            .map(|_| match alloc.alloc_pages(Gfp::NOWAIT, 0) {
                Some(p) => {
                    held.push(p);
                    true
                }
                None => false,
            })
            .collect();
        alloc.fault().disable();
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&held) };
        assert_no_leaks(&alloc);
        out
    };
    let a = pattern();
    assert_eq!(a, pattern());
    assert!(a.contains(&true) && a.contains(&false));
}
