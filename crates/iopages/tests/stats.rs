//! Statistics and accounting move as the allocator is used.

mod common;
use common::{assert_no_leaks, assert_no_leaks_after, builder};
use iopages::{Accounting, Gfp, Page, PageAllocator, Stats, Watermarks, MAX_ORDER};
use std::sync::{Arc, Barrier};

fn assert_adds_up(a: &Accounting) {
    assert!(
        a.buddy_free_pages + a.depot_pages + a.pcp_pages + a.thread_cache_pages <= a.total_pages,
        "more free pages than the arena has: {a}"
    );
    assert_eq!(
        a.buddy_free_pages + a.depot_pages + a.pcp_pages + a.thread_cache_pages + a.in_use_pages,
        a.total_pages,
        "{a}"
    );
}

fn assert_consistent(s: &Stats) {
    let counted: usize = s
        .free_blocks_by_order
        .iter()
        .enumerate()
        .map(|(o, n)| n << o)
        .sum();
    assert_eq!(
        counted, s.free_pages,
        "free blocks by order must add up to the zone's free pages"
    );
    assert_eq!(
        s.free_pages + s.depot_pages + s.pcp_pages + s.thread_cache_pages + s.in_use_pages,
        s.total_pages
    );
}

#[test]
fn a_new_allocator_has_everything_free_in_largest_blocks_and_zero_counters() {
    let alloc = builder(16).build().unwrap();
    let s = alloc.stats();
    assert_eq!(s.total_pages, 4096);
    assert_eq!(s.free_pages, 4096);
    assert_eq!(s.free_blocks_by_order[MAX_ORDER as usize], 4);
    assert_eq!(s.free_blocks_by_order.iter().sum::<usize>(), 4);
    assert_eq!(
        (s.pcp_pages, s.thread_cache_pages, s.in_use_pages),
        (0, 0, 0)
    );
    assert_eq!(
        (
            s.alloc_thread_cache,
            s.alloc_pcp,
            s.alloc_zone,
            s.bulk_alloc_calls,
            s.failures,
            s.slowpath
        ),
        (0, 0, 0, 0, 0, 0)
    );
    let w = alloc.watermarks();
    assert_eq!(s.watermarks, (w.min, w.low, w.high));
    assert_eq!(
        s.pcp_max_pages,
        alloc.pcp_limits().max_pages_per_cpu() * alloc.nr_cpus()
    );
    assert_consistent(&s);
}

#[test]
fn thread_cache_allocs_and_frees_are_counted() {
    // One per-CPU set: the default limits then give each thread cache 64 pages.
    let alloc = builder(8).nr_cpus(1).fast_path_stats(true).build().unwrap();
    let pages: Vec<Page> = (0..10)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    let s = alloc.stats();
    assert_eq!(s.alloc_thread_cache, 10, "{s}");
    assert!(s.thread_cache_refills >= 1);
    assert_eq!(s.thread_caches, 1);
    assert_eq!(s.thread_cache_max_pages, alloc.thread_cache_max_pages());
    assert!(s.thread_cache_max_pages > 0);
    assert_eq!(s.in_use_pages, 10);
    for p in pages {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    let s = alloc.stats();
    assert_eq!(s.free_thread_cache, 10, "{s}");
    assert_eq!(s.in_use_pages, 0);
    assert!(
        s.thread_cache_pages >= 10,
        "freed pages stay in the cache: {s}"
    );
    assert_consistent(&s);
    assert_no_leaks(&alloc);
}

#[test]
fn without_thread_caches_single_allocations_are_served_by_per_cpu_lists() {
    let alloc = builder(8).thread_cache_pages(0).nr_cpus(1).build().unwrap();
    let pages: Vec<Page> = (0..10)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    for p in pages {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    let s = alloc.stats();
    assert_eq!((s.alloc_thread_cache, s.free_thread_cache), (0, 0), "{s}");
    assert_eq!((s.alloc_pcp, s.free_pcp), (10, 10), "{s}");
    assert_eq!(s.thread_cache_pages, 0);
    assert_eq!(s.thread_caches, 0);
    assert_no_leaks(&alloc);
}

#[test]
fn higher_orders_bypass_the_per_cpu_lists_and_count_as_zone_traffic() {
    let alloc = builder(8).build().unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL, 5).unwrap();
    assert_eq!(alloc.stats().alloc_zone, 1);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 5) };
    assert_eq!(alloc.stats().free_zone, 1);
    assert_no_leaks(&alloc);
}

#[test]
fn pcp_refills_and_drains_happen_under_churn() {
    for tcache in [64, 0] {
        let alloc = builder(8)
            .thread_cache_pages(tcache)
            .nr_cpus(1)
            .build()
            .unwrap();
        for round in 0..5 {
            let pages: Vec<Page> = (0..600)
                .map(|_| alloc.alloc_pages(Gfp::KERNEL, round % 2).unwrap())
                .collect();
            for p in pages {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, round % 2) };
            }
        }
        let s = alloc.stats();
        assert!(s.pcp_refills > 0, "tcache {tcache}: {s}");
        assert!(s.pcp_refill_pages >= s.pcp_refills, "tcache {tcache}: {s}");
        assert!(
            s.pcp_drains > 0,
            "frees above high must drain: tcache {tcache}: {s}"
        );
        assert!(s.pcp_drain_pages >= s.pcp_drains);
        let drains = s.drain_all;
        alloc.drain_all();
        let s2 = alloc.stats();
        assert_eq!(s2.drain_all, drains + 1);
        assert_eq!(s2.pcp_pages, 0, "drain_all empties the per-CPU lists");
        assert_eq!(
            s2.thread_cache_pages, 0,
            "drain_all flushes this thread's cache"
        );
        assert!(s2.pcp_drain_pages >= s.pcp_drain_pages);
        if tcache > 0 {
            assert!(s.thread_cache_flushes > 0, "{s}");
            assert!(s.thread_cache_refills > 0, "{s}");
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn bulk_alloc_calls_counts_calls() {
    for tcache in [64, 0] {
        let alloc = builder(8).thread_cache_pages(tcache).build().unwrap();
        let mut pages = Vec::new();
        for _ in 0..5 {
            let mut slots = [None; 16];
            assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 16);
            pages.extend(slots.iter().flatten());
        }
        for _ in 0..3 {
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 40, &mut pages);
        }
        alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 20, |p| pages.push(p));
        let s = alloc.stats();
        assert_eq!(s.bulk_alloc_calls, 9, "tcache {tcache}: {s}");
        assert_eq!(s.in_use_pages, pages.len());
        assert_no_leaks_after(&alloc, &pages);
    }
}

#[test]
fn bulk_free_calls_counts_calls() {
    for tcache in [64, 0] {
        let alloc = builder(8).thread_cache_pages(tcache).build().unwrap();
        let mut slots = vec![None; 100];
        assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 100);
        let pages: Vec<Page> = slots.iter().flatten().copied().collect();
        let before = alloc.stats().bulk_free_calls;
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&pages[..10]) };
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&pages[10..80]) };
        let mut rest: Vec<Option<Page>> = pages[80..].iter().copied().map(Some).collect();
        // SAFETY: the test allocated these pages and gives them up here, once.
        assert_eq!(unsafe { alloc.free_pages_bulk_array(&mut rest) }, 20);
        assert_eq!(alloc.stats().bulk_free_calls, before + 3, "tcache {tcache}");
        assert_no_leaks(&alloc);
    }
}

#[test]
fn bulk_free_calls_does_not_move_when_nothing_is_freed() {
    for tcache in [64, 0] {
        let alloc = builder(8).thread_cache_pages(tcache).build().unwrap();
        let mut pages = Vec::new();
        alloc.alloc_pages_bulk_list(Gfp::KERNEL, 40, &mut pages);
        alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 150, |p| pages.push(p));
        let s = alloc.stats();
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&pages) };
        assert_no_leaks(&alloc);
        assert_eq!(
            s.bulk_free_calls, 0,
            "tcache {tcache}: nothing was freed yet:\n{s}"
        );
    }
}

#[test]
fn bulk_alloc_calls_counts_every_call_once_whatever_path_serves_it() {
    let alloc = builder(8).fast_path_stats(true).build().unwrap();
    let mut pages = Vec::new();
    // One empty slot: served by the single-page path.
    let mut one = [None; 1];
    alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut one);
    pages.extend(one.iter().flatten());
    // One callback call for 200 pages.
    alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 200, |p| pages.push(p));
    // One call under the low watermark: served by the single-page fallback.
    let total = alloc.accounting().total_pages;
    alloc
        .set_watermarks(Watermarks {
            min: 0,
            low: total - 100,
            high: total - 100,
        })
        .unwrap();
    assert_eq!(
        alloc.alloc_pages_bulk_list(Gfp::KERNEL, 200, &mut pages),
        1,
        "below low, the list form falls back to one page"
    );
    let s = alloc.stats();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&pages) };
    assert_no_leaks(&alloc);
    assert_eq!(s.bulk_alloc_calls, 3, "three bulk calls were made:\n{s}");
}

#[test]
fn slow_path_and_failures_are_counted() {
    let alloc = builder(4).thread_cache_pages(0).nr_cpus(1).build().unwrap();
    let mut held = Vec::new();
    while let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, 0) {
        held.push(p);
    }
    let s = alloc.stats();
    assert!(s.slowpath >= 1, "{s}");
    assert!(
        s.kswapd_wakeups >= 1,
        "NOWAIT wakes background reclaim: {s}"
    );
    assert_eq!(s.failures, 1);
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 0), None);
    let s2 = alloc.stats();
    assert_eq!(s2.failures, 2);
    assert!(
        s2.direct_reclaim > s.direct_reclaim,
        "KERNEL runs direct reclaim: {s2}"
    );
    assert!(
        s2.drain_all > s.drain_all,
        "the slow path drains the per-CPU lists: {s2}"
    );
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 6), None);
    assert!(alloc.stats().compact_calls > 0, "order 6 tries compaction");
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn display_has_one_name_value_line_per_counter_and_order() {
    let alloc = builder(8).build().unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL, 3).unwrap();
    let s = alloc.stats();
    let text = s.to_string();
    assert!(text.contains("nr_free_pages "), "{text}");
    assert!(text.contains("free_blocks_order10 "), "{text}");
    let mut names = std::collections::HashSet::new();
    for line in text.lines() {
        let (name, value) = line
            .split_once(' ')
            .unwrap_or_else(|| panic!("not a 'name value' line: {line:?}"));
        assert!(!name.is_empty() && !name.contains(' '));
        value
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("value of {name} is not a number: {value:?}"));
        assert!(names.insert(name.to_string()), "{name} listed twice");
    }
    for o in 0..=MAX_ORDER {
        assert!(
            names.contains(&format!("free_blocks_order{o}")),
            "order {o} missing"
        );
    }
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing"))
            .parse()
            .unwrap()
    };
    assert_eq!(value("nr_pages"), s.total_pages as u64);
    assert_eq!(value("nr_free_pages"), s.free_pages as u64);
    assert_eq!(value("nr_in_use_pages"), 8);
    assert_eq!(
        value("free_blocks_order10"),
        s.free_blocks_by_order[10] as u64
    );
    assert_eq!(value("alloc_zone"), s.alloc_zone);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 3) };
    assert_no_leaks(&alloc);
}

#[test]
fn accounting_adds_up_at_every_step() {
    let alloc = builder(8).build().unwrap();
    let mut held: Vec<(Page, u32)> = Vec::new();
    let mut x = 12345u64;
    for step in 0..2000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        match x % 5 {
            0..=1 => {
                let order = (x >> 8) as u32 % 6;
                if let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, order) {
                    held.push((p, order));
                }
            }
            2 => {
                let mut list = Vec::new();
                alloc.alloc_pages_bulk_list(Gfp::NOWAIT, (x >> 8) as usize % 50, &mut list);
                held.extend(list.into_iter().map(|p| (p, 0)));
            }
            _ => {
                if !held.is_empty() {
                    let (p, o) = held.swap_remove((x >> 8) as usize % held.len());
                    // SAFETY: the test allocated these pages and gives them up here, once.
                    unsafe { alloc.free_pages(p, o) };
                }
            }
        }
        let a = alloc.accounting();
        assert_adds_up(&a);
        let mine: usize = held.iter().map(|&(_, o)| 1usize << o).sum();
        assert_eq!(a.in_use_pages, mine, "step {step}: {a}");
        if step % 100 == 0 {
            let s = alloc.stats();
            assert_consistent(&s);
            assert_eq!(s.in_use_pages, mine);
        }
    }
    for (p, o) in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, o) };
    }
    assert_no_leaks(&alloc);
}

#[test]
fn other_threads_caches_are_counted_and_their_counters_survive_exit() {
    // One per-CPU set: the default limits then give each thread cache 64 pages.
    let alloc = builder(8).nr_cpus(1).fast_path_stats(true).build().unwrap();
    let ready = Arc::new(Barrier::new(2));
    let go = Arc::new(Barrier::new(2));
    let h = {
        let (a, ready, go) = (alloc.clone(), ready.clone(), go.clone());
        std::thread::spawn(move || {
            let pages: Vec<Page> = (0..30)
                .map(|_| a.alloc_pages(Gfp::KERNEL, 0).unwrap())
                .collect();
            for p in pages {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_pages(p, 0) };
            }
            let mut bulk = [None; 8];
            assert_eq!(a.alloc_pages_bulk_array(Gfp::KERNEL, &mut bulk), 8);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { a.free_pages_bulk_array(&mut bulk) };
            ready.wait();
            go.wait();
        })
    };
    ready.wait();
    let s = alloc.stats();
    assert_eq!(s.thread_caches, 1, "{s}");
    assert!(s.thread_cache_pages >= 30, "{s}");
    assert_eq!(s.alloc_thread_cache, 38, "{s}");
    assert_eq!(s.free_thread_cache, 38, "{s}");
    assert_eq!(s.bulk_alloc_calls, 1);
    assert_eq!(s.bulk_free_calls, 1);
    assert_adds_up(&alloc.accounting());
    go.wait();
    h.join().unwrap();
    let s = alloc.stats();
    assert_eq!(
        s.thread_caches, 0,
        "the exited thread's cache is retired: {s}"
    );
    assert_eq!(s.thread_cache_pages, 0);
    assert_eq!(
        s.alloc_thread_cache, 38,
        "counters of exited threads are kept: {s}"
    );
    assert_eq!(s.free_thread_cache, 38);
    assert_eq!(s.bulk_alloc_calls, 1);
    assert_eq!(s.bulk_free_calls, 1);
    assert_no_leaks(&alloc);
}

#[test]
fn drained_batches_park_in_the_depot_and_come_back_without_the_buddy() {
    let build = |depot: usize| {
        PageAllocator::builder()
            .size_bytes(8 << 20)
            .nr_cpus(1)
            .thread_cache_pages(0)
            .pcp_limits(iopages::PcpLimits {
                high: [8, 4, 2, 2],
                batch: [4, 2, 1, 1],
            })
            .depot_pages(depot)
            .build()
            .unwrap()
    };
    let alloc = build(64);
    let pages: Vec<_> = (0..40)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    for &p in &pages {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    let a = alloc.accounting();
    assert!(
        a.depot_pages > 0,
        "per-CPU drains must park in the depot: {a}"
    );
    assert!(a.depot_pages <= 64 && a.pcp_pages <= 8, "{a}");
    assert_eq!(a.in_use_pages, 0, "{a}");
    let buddy_before = a.buddy_free_pages;
    // Refills take the parked batches first: the buddy lists are not touched.
    let again: Vec<_> = (0..8)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    assert_eq!(alloc.accounting().buddy_free_pages, buddy_before);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&again) };
    let done = alloc.leak_check().expect("nothing in use");
    assert_eq!(
        done.depot_pages, 0,
        "drain_all must empty the depot: {done}"
    );
    assert_eq!(
        alloc.stats().free_blocks_by_order[10],
        2,
        "merges must restore the largest blocks"
    );

    let off = build(0);
    let pages: Vec<_> = (0..40)
        .map(|_| off.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { off.free_pages_bulk(&pages) };
    assert_eq!(
        off.accounting().depot_pages,
        0,
        "a zero-sized depot holds nothing"
    );
    off.leak_check().unwrap();
}

/// Counting off (the default) and checks off: a cache hit counts nothing;
/// the careful path (a refill, a flush, a handle's slow path) still
/// counts, the counts never go down, and a handle's are kept when it is
/// dropped.
#[test]
fn without_fast_path_stats_hits_are_not_counted_and_nothing_is_lost() {
    let alloc = builder(8).nr_cpus(1).checks(false).build().unwrap();
    let pages: Vec<Page> = (0..10)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    let s = alloc.stats();
    // The first call found the cache empty: the careful path refilled it
    // and counted that one page; the nine hits after it count nothing.
    assert_eq!(s.alloc_thread_cache, 1, "{s}");
    assert_eq!(s.thread_cache_refills, 1, "{s}");
    assert_eq!(s.in_use_pages, 10);
    for p in pages {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    let s2 = alloc.stats();
    assert_eq!(s2.free_thread_cache, 0, "every free was a hit: {s2}");
    assert!(s2.alloc_thread_cache >= s.alloc_thread_cache);
    // A handle: its first bulk call takes the careful path (counted), a
    // second one from the warm cache is a hit (not counted); both are
    // kept after the handle is dropped.
    let mut local = alloc.local();
    let mut v = Vec::new();
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 8, &mut v), 8);
    // SAFETY: just allocated here, each once.
    unsafe { local.free_bulk(&mut v) };
    assert_eq!(local.alloc_bulk(Gfp::KERNEL, 8, &mut v), 8);
    // SAFETY: as above.
    unsafe { local.free_bulk(&mut v) };
    let s3 = alloc.stats();
    assert_eq!(s3.bulk_alloc_calls - s2.bulk_alloc_calls, 1, "{s3}");
    assert_eq!(s3.alloc_thread_cache - s2.alloc_thread_cache, 8, "{s3}");
    drop(local);
    let s4 = alloc.stats();
    assert_eq!(
        s4.bulk_alloc_calls, s3.bulk_alloc_calls,
        "folded on drop: {s4}"
    );
    assert_eq!(s4.alloc_thread_cache, s3.alloc_thread_cache);
    assert_eq!(s4.thread_cache_flushes, s3.thread_cache_flushes + 1);
    assert_no_leaks(&alloc);
}

#[test]
fn a_drain_on_another_thread_does_not_make_pages_vanish_from_the_count() {
    // The allocator's own background reclaim drains the per-CPU lists on
    // its thread while the caller counts; here a second thread stands in
    // for it. Pages are moving from the lists to the zone, never in use.
    let alloc = builder(8).thread_cache_pages(0).build().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drainer = {
        let (a, stop) = (alloc.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.drain_all();
                n += 1;
                // Drains come and go, as background reclaim's rounds do.
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
            n
        })
    };
    let mut held: Vec<Page> = Vec::new();
    for step in 0..100_000u32 {
        if step % 3 == 2 {
            while held.len() > 10 {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(held.pop().unwrap(), 0) };
            }
        } else {
            held.extend((0..20).filter_map(|_| alloc.alloc_pages(Gfp::NOWAIT, 0)));
        }
        let a = alloc.accounting();
        assert_adds_up(&a);
        assert_eq!(a.in_use_pages, held.len(), "step {step}: {a}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(drainer.join().unwrap() > 0, "the drainer never ran");
    for p in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    assert_no_leaks(&alloc);
}
