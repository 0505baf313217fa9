//! The bulk allocation contract: array, list and callback forms, and bulk free.

mod common;
use common::{assert_no_leaks, builder};
use iopages::{Gfp, Page, PageAllocator, Watermarks, PAGE_SIZE};
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};

fn small(mib: u64) -> PageAllocator {
    builder(mib).build().expect("allocator")
}

/// Every variant the bulk engine has a separate path for: thread caches on
/// and off, one per-CPU set and several.
fn variants(mib: u64) -> Vec<(&'static str, PageAllocator)> {
    vec![
        ("default", small(mib)),
        (
            "no-tcache",
            builder(mib).thread_cache_pages(0).build().unwrap(),
        ),
        ("one-cpu", builder(mib).nr_cpus(1).build().unwrap()),
        (
            "no-tcache-4-cpus",
            builder(mib)
                .thread_cache_pages(0)
                .nr_cpus(4)
                .build()
                .unwrap(),
        ),
    ]
}

fn in_use(alloc: &PageAllocator) -> usize {
    alloc.accounting().in_use_pages
}

fn free_all(alloc: &PageAllocator, pages: &[Page]) {
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(pages) };
}

#[test]
fn array_fills_only_empty_slots_and_keeps_prefilled_pages() {
    for (name, alloc) in variants(8) {
        let pre: Vec<Page> = (0..5)
            .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
            .collect();
        let mut slots = [None; 40];
        let positions = [0usize, 3, 17, 38, 39];
        for (&i, &p) in positions.iter().zip(&pre) {
            slots[i] = Some(p);
        }
        let n = alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
        assert_eq!(n, slots.len(), "{name}: count includes pre-filled slots");
        for (&i, &p) in positions.iter().zip(&pre) {
            assert_eq!(slots[i], Some(p), "{name}: pre-filled slot {i} was changed");
        }
        let all: Vec<Page> = slots
            .iter()
            .map(|s| s.expect("every slot filled"))
            .collect();
        let distinct: HashSet<u32> = all.iter().map(|p| p.pfn()).collect();
        assert_eq!(
            distinct.len(),
            all.len(),
            "{name}: a page appears twice in the array"
        );
        assert_eq!(
            in_use(&alloc),
            40,
            "{name}: 5 pre-filled + 35 new pages in use"
        );
        free_all(&alloc, &all);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn array_count_includes_prefilled_slots() {
    let alloc = small(4);
    let p = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
    let mut slots = [None, Some(p), None];
    assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 3);
    assert_eq!(slots[1], Some(p));
    let pages: Vec<Page> = slots.iter().flatten().copied().collect();
    free_all(&alloc, &pages);
    assert_no_leaks(&alloc);
}

#[test]
fn full_array_returns_len_without_allocating() {
    let alloc = small(4);
    let pages: Vec<Page> = (0..8)
        .map(|_| alloc.alloc_pages(Gfp::KERNEL, 0).unwrap())
        .collect();
    let mut slots: Vec<Option<Page>> = pages.iter().copied().map(Some).collect();
    let before = alloc.accounting();
    let calls_before = alloc.stats().bulk_alloc_calls;
    assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 8);
    assert_eq!(
        alloc.accounting(),
        before,
        "a full array must not move any page"
    );
    assert_eq!(alloc.stats().bulk_alloc_calls, calls_before);
    assert_eq!(slots, pages.iter().copied().map(Some).collect::<Vec<_>>());
    // An empty array is full too.
    assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut []), 0);
    assert_eq!(alloc.accounting(), before);
    free_all(&alloc, &pages);
    assert_no_leaks(&alloc);
}

#[test]
fn array_partial_fill_when_arena_runs_out_counts_filled_slots() {
    // No watermarks and one per-CPU set, so that every free page is
    // reachable from this thread and the arena can be used to the last page.
    for tcache in [64, 0] {
        let alloc = builder(4)
            .nr_cpus(1)
            .thread_cache_pages(tcache)
            .watermarks(Watermarks {
                min: 0,
                low: 0,
                high: 0,
            })
            .build()
            .unwrap();
        let total = alloc.accounting().total_pages;
        let left = 10;
        let mut held: Vec<Page> = (0..total - left)
            .map(|i| {
                alloc
                    .alloc_pages(Gfp::NOWAIT, 0)
                    .unwrap_or_else(|| panic!("tcache {tcache}: allocation {i} failed"))
            })
            .collect();
        let mut slots = [None; 32];
        slots[4] = held.pop();
        slots[20] = held.pop();
        let (pre4, pre20) = (slots[4], slots[20]);
        let n = alloc.alloc_pages_bulk_array(Gfp::NOWAIT, &mut slots);
        let filled = slots.iter().filter(|s| s.is_some()).count();
        assert_eq!(
            n, filled,
            "tcache {tcache}: count must equal the slots holding a page"
        );
        assert!(
            n < slots.len(),
            "tcache {tcache}: arena has only {left} free pages, got {n}"
        );
        assert_eq!(
            n,
            2 + left,
            "tcache {tcache}: the bulk call should take every page left"
        );
        assert_eq!((slots[4], slots[20]), (pre4, pre20));
        assert_eq!(
            alloc.alloc_pages(Gfp::NOWAIT, 0),
            None,
            "arena should be empty now"
        );
        assert_eq!(in_use(&alloc), total);
        // The list form stops short the same way.
        let mut list = Vec::new();
        assert_eq!(alloc.alloc_pages_bulk_list(Gfp::NOWAIT, 16, &mut list), 0);
        assert!(list.is_empty());
        held.extend(slots.iter().flatten());
        free_all(&alloc, &held);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn list_form_appends_and_returns_the_number_appended() {
    for (name, alloc) in variants(8) {
        let first = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
        let mut list = vec![first];
        assert_eq!(
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 100, &mut list),
            100,
            "{name}"
        );
        assert_eq!(list.len(), 101, "{name}");
        assert_eq!(list[0], first, "{name}: existing entries must stay");
        assert_eq!(
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 0, &mut list),
            0,
            "{name}"
        );
        assert_eq!(
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 7, &mut list),
            7,
            "{name}"
        );
        assert_eq!(list.len(), 108, "{name}");
        let distinct: HashSet<Page> = list.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            list.len(),
            "{name}: duplicate pages in the list"
        );
        assert_eq!(in_use(&alloc), 108, "{name}");
        free_all(&alloc, &list);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn callback_form_calls_f_exactly_n_times_with_distinct_pages() {
    for (name, alloc) in variants(8) {
        // More than one internal chunk, and not a multiple of it.
        for nr in [0usize, 1, 63, 64, 65, 200] {
            let mut got = Vec::new();
            let n = alloc.alloc_pages_bulk_cb(Gfp::KERNEL, nr, |p| got.push(p));
            assert_eq!(n, nr, "{name}: nr {nr}");
            assert_eq!(got.len(), nr, "{name}: f must run once per page");
            let distinct: HashSet<Page> = got.iter().copied().collect();
            assert_eq!(distinct.len(), nr, "{name}: f saw a page twice");
            assert_eq!(in_use(&alloc), nr, "{name}: nr {nr}");
            free_all(&alloc, &got);
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn callback_may_allocate_and_free_inside_f() {
    for (name, alloc) in variants(8) {
        let mut kept = Vec::new();
        let mut nested = Vec::new();
        let mut order1 = Vec::new();
        let n = alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 150, |p| {
            // A single allocation and free inside the callback.
            let q = alloc.alloc_pages(Gfp::KERNEL, 0).expect("alloc inside f");
            assert_ne!(q, p);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(q, 0) };
            // A higher order, kept.
            order1.push(alloc.alloc_pages(Gfp::NOWAIT, 1).expect("order 1 inside f"));
            // A nested bulk call.
            assert_eq!(alloc.alloc_pages_bulk_list(Gfp::KERNEL, 2, &mut nested), 2);
            // Free every other delivered page right away.
            if p.pfn() % 2 == 0 {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, 0) };
            } else {
                kept.push(p);
            }
        });
        assert_eq!(n, 150, "{name}");
        let mut seen = HashSet::new();
        for p in kept.iter().chain(&nested) {
            assert!(
                seen.insert(p.pfn()),
                "{name}: pfn {} handed out twice",
                p.pfn()
            );
        }
        for p in &order1 {
            assert_eq!(p.pfn() % 2, 0, "{name}: order-1 block not aligned");
            assert!(
                seen.insert(p.pfn()) && seen.insert(p.pfn() + 1),
                "{name}: order-1 block overlaps"
            );
        }
        assert_eq!(
            in_use(&alloc),
            kept.len() + nested.len() + 2 * order1.len(),
            "{name}"
        );
        free_all(&alloc, &kept);
        free_all(&alloc, &nested);
        for p in order1 {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(p, 1) };
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn callback_panic_frees_the_undelivered_pages() {
    for (name, alloc) in variants(8) {
        let mut delivered = Vec::new();
        let r = catch_unwind(AssertUnwindSafe(|| {
            alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 100, |p| {
                delivered.push(p);
                if delivered.len() == 10 {
                    panic!("callback gives up");
                }
            })
        }));
        assert!(r.is_err(), "{name}: the panic must propagate");
        assert_eq!(delivered.len(), 10, "{name}");
        assert_eq!(
            in_use(&alloc),
            10,
            "{name}: only the delivered pages may stay allocated"
        );
        free_all(&alloc, &delivered);
        assert_no_leaks(&alloc);

        // A panic in a later chunk: the earlier chunks were all delivered.
        let mut delivered = Vec::new();
        let r = catch_unwind(AssertUnwindSafe(|| {
            alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 200, |p| {
                delivered.push(p);
                if delivered.len() == 70 {
                    panic!("callback gives up later");
                }
            })
        }));
        assert!(r.is_err());
        assert_eq!(in_use(&alloc), 70, "{name}");
        free_all(&alloc, &delivered);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn below_low_watermark_bulk_falls_back_to_a_single_page() {
    for (name, alloc) in variants(4) {
        let total = alloc.accounting().total_pages;
        // Taking 32 pages would leave the zone below low; one page would not.
        alloc
            .set_watermarks(Watermarks {
                min: 0,
                low: total - 24,
                high: total - 24,
            })
            .unwrap();
        let pre = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
        let mut slots = [None; 32];
        slots[7] = Some(pre);
        let populated = 1;
        let n = alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
        assert!(
            n <= populated + 1,
            "{name}: got {n}, fallback allocates one page"
        );
        assert_eq!(
            n,
            populated + 1,
            "{name}: the single-page fallback should succeed"
        );
        assert_eq!(n, slots.iter().filter(|s| s.is_some()).count());
        assert_eq!(slots[7], Some(pre));
        let mut list = Vec::new();
        assert_eq!(
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 32, &mut list),
            1,
            "{name}"
        );
        let mut cb = Vec::new();
        assert_eq!(
            alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 100, |p| cb.push(p)),
            1,
            "{name}"
        );
        let mut all: Vec<Page> = slots.iter().flatten().copied().collect();
        all.extend(list);
        all.extend(cb);
        assert_eq!(all.iter().collect::<HashSet<_>>().len(), all.len());
        free_all(&alloc, &all);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn bulk_with_zone_already_below_low_takes_at_most_one_page() {
    let alloc = builder(4).thread_cache_pages(0).nr_cpus(1).build().unwrap();
    let total = alloc.accounting().total_pages;
    alloc
        .set_watermarks(Watermarks {
            min: 0,
            low: total - 1,
            high: total - 1,
        })
        .unwrap();
    // One single allocation pulls a batch and leaves the zone below low.
    let first = alloc.alloc_pages(Gfp::NOWAIT, 0).unwrap();
    let before = alloc.accounting().buddy_free_pages;
    assert!(
        before < total - 1,
        "the zone should be below low now ({before} free)"
    );
    let mut got = vec![first];
    let n = alloc.alloc_pages_bulk_list(Gfp::NOWAIT, 32, &mut got);
    assert!(n <= 1, "bulk below low must not take a batch, got {n}");
    assert!(before - alloc.accounting().buddy_free_pages <= alloc.pcp_limits().high[0]);
    free_all(&alloc, &got);
    assert_no_leaks(&alloc);
}

#[test]
fn batch_of_one_works_in_every_form() {
    for (name, alloc) in variants(4) {
        let mut slots = [None; 1];
        assert_eq!(
            alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots),
            1,
            "{name}"
        );
        let mut list = Vec::new();
        assert_eq!(
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, 1, &mut list),
            1,
            "{name}"
        );
        let mut cb = Vec::new();
        assert_eq!(
            alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 1, |p| cb.push(p)),
            1,
            "{name}"
        );
        // One empty slot among full ones.
        let held = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
        let mut mixed = [Some(held), None, Some(list[0])];
        assert_eq!(
            alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut mixed),
            3,
            "{name}"
        );
        let pages = [slots[0].unwrap(), list[0], cb[0], held, mixed[1].unwrap()];
        assert_eq!(
            pages.iter().collect::<HashSet<_>>().len(),
            5,
            "{name}: duplicate page"
        );
        assert_eq!(in_use(&alloc), 5, "{name}");
        free_all(&alloc, &pages);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn free_pages_bulk_returns_pages_from_several_bulk_calls() {
    for (name, alloc) in variants(8) {
        let mut all = Vec::new();
        for len in [3usize, 64, 100, 257] {
            let mut slots = vec![None; len];
            assert_eq!(
                alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots),
                len,
                "{name}"
            );
            all.extend(slots.into_iter().flatten());
            alloc.alloc_pages_bulk_list(Gfp::KERNEL, len, &mut all);
        }
        alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 130, |p| all.push(p));
        assert_eq!(in_use(&alloc), all.len(), "{name}");
        // Free in an order unrelated to how they were allocated, in pieces
        // of different sizes, including an empty one.
        all.sort_by_key(|p| std::cmp::Reverse(p.pfn()));
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&[]) };
        let (a, rest) = all.split_at(1);
        let (b, c) = rest.split_at(500);
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(a) };
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(b) };
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(c) };
        assert_eq!(in_use(&alloc), 0, "{name}");
        assert_no_leaks(&alloc);
    }
}

#[test]
fn no_page_is_handed_out_twice_across_all_forms() {
    for (name, alloc) in variants(8) {
        let mut seen = HashSet::new();
        let mut singles = Vec::new();
        let mut pages = Vec::new();
        let note = |p: Page, seen: &mut HashSet<u32>| {
            assert!(
                seen.insert(p.pfn()),
                "{name}: pfn {} handed out twice",
                p.pfn()
            );
        };
        for round in 0..6 {
            let mut slots = vec![None; 50 + round];
            alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
            for p in slots.into_iter().flatten() {
                note(p, &mut seen);
                pages.push(p);
            }
            let mut list = Vec::new();
            alloc.alloc_pages_bulk_list(Gfp::NOWAIT, 70, &mut list);
            for p in list {
                note(p, &mut seen);
                pages.push(p);
            }
            let mut cb = Vec::new();
            alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 90, |p| cb.push(p));
            for p in cb {
                note(p, &mut seen);
                pages.push(p);
            }
            for order in 0..4 {
                let p = alloc.alloc_pages(Gfp::KERNEL, order).unwrap();
                for pfn in p.pfn()..p.pfn() + (1 << order) {
                    note(Page::from_pfn(pfn), &mut seen);
                }
                singles.push((p, order));
            }
            // Give some back so that later rounds reuse frames.
            let back = pages.split_off(pages.len() / 2);
            for p in &back {
                seen.remove(&p.pfn());
            }
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages_bulk(&back) };
        }
        assert_eq!(in_use(&alloc), seen.len(), "{name}");
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&pages) };
        for (p, o) in singles {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(p, o) };
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn bulk_pages_are_usable_memory() {
    for (name, alloc) in variants(8) {
        let mut pages = Vec::new();
        let mut slots = vec![None; 300];
        alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
        pages.extend(slots.into_iter().flatten());
        alloc.alloc_pages_bulk_list(Gfp::KERNEL, 300, &mut pages);
        alloc.alloc_pages_bulk_cb(Gfp::KERNEL, 300, |p| pages.push(p));
        assert_eq!(pages.len(), 900, "{name}");
        let word = |p: Page, i: usize| (p.pfn() as u64) << 32 | i as u64;
        // Write every page in full first, then read all back: overlapping
        // pages or a bad address would show up as a mismatch.
        for &p in &pages {
            let base = alloc.page_address(p).cast::<u64>();
            for i in 0..PAGE_SIZE / 8 {
                // SAFETY: the page is allocated to this test and lies in the arena.
                unsafe { base.add(i).write(word(p, i)) };
            }
        }
        for &p in &pages {
            let base = alloc.page_address(p).cast::<u64>();
            assert_eq!(alloc.page_of_address(base.cast()), Some(p));
            for i in 0..PAGE_SIZE / 8 {
                // SAFETY: as above.
                let v = unsafe { base.add(i).read() };
                assert_eq!(
                    v,
                    word(p, i),
                    "{name}: pfn {} word {i} overwritten",
                    p.pfn()
                );
            }
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&pages) };
        assert_no_leaks(&alloc);
    }
}

#[test]
fn bulk_with_zero_returns_zeroed_pages() {
    for (name, alloc) in variants(4) {
        let mut dirty = Vec::new();
        alloc.alloc_pages_bulk_list(Gfp::KERNEL, 200, &mut dirty);
        for &p in &dirty {
            // SAFETY: allocated to this test.
            unsafe { std::ptr::write_bytes(alloc.page_address(p), 0xa5, PAGE_SIZE) };
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&dirty) };
        let mut zeroed = Vec::new();
        let mut slots = vec![None; 100];
        alloc.alloc_pages_bulk_array(Gfp::KERNEL | Gfp::ZERO, &mut slots);
        zeroed.extend(slots.into_iter().flatten());
        alloc.alloc_pages_bulk_list(Gfp::KERNEL | Gfp::ZERO, 100, &mut zeroed);
        alloc.alloc_pages_bulk_cb(Gfp::KERNEL | Gfp::ZERO, 100, |p| zeroed.push(p));
        assert_eq!(zeroed.len(), 300);
        let reused = zeroed.iter().filter(|p| dirty.contains(p)).count();
        assert!(
            reused > 0,
            "{name}: the test should see dirtied pages come back"
        );
        for &p in &zeroed {
            // SAFETY: allocated to this test.
            let bytes = unsafe { std::slice::from_raw_parts(alloc.page_address(p), PAGE_SIZE) };
            assert!(
                bytes.iter().all(|&b| b == 0),
                "{name}: pfn {} not zeroed",
                p.pfn()
            );
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages_bulk(&zeroed) };
        assert_no_leaks(&alloc);
    }
}

#[test]
fn free_pages_bulk_array_frees_every_page_and_empties_every_slot() {
    for (name, alloc) in variants(8) {
        // A full array, as the array form fills it.
        let mut full = [None; 70];
        assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut full), 70);
        // SAFETY: the test allocated these pages and gives them up here, once.
        let freed = unsafe { alloc.free_pages_bulk_array(&mut full) };
        assert_eq!(freed, 70, "{name}");
        assert!(
            full.iter().all(Option::is_none),
            "{name}: slots must be emptied"
        );
        assert_eq!(in_use(&alloc), 0, "{name}");
        // An array with holes.
        let mut holes = vec![None; 50];
        assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut holes), 50);
        for i in (0..50).step_by(3) {
            let p = holes[i].take().unwrap();
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(p, 0) };
        }
        let left = holes.iter().filter(|s| s.is_some()).count();
        assert_eq!(in_use(&alloc), left, "{name}");
        // SAFETY: the test allocated these pages and gives them up here, once.
        let freed = unsafe { alloc.free_pages_bulk_array(&mut holes) };
        assert_eq!(freed, left, "{name}");
        assert!(holes.iter().all(Option::is_none));
        // Nothing to free.
        // SAFETY: every slot is empty: nothing is given up.
        let freed = unsafe { alloc.free_pages_bulk_array(&mut holes) };
        assert_eq!(freed, 0, "{name}");
        // SAFETY: the test allocated these pages and gives them up here, once.
        assert_eq!(unsafe { alloc.free_pages_bulk_array(&mut []) }, 0, "{name}");
        // One page.
        let mut one = [alloc.alloc_pages(Gfp::KERNEL, 0)];
        // SAFETY: the test allocated these pages and gives them up here, once.
        let freed = unsafe { alloc.free_pages_bulk_array(&mut one) };
        assert_eq!(freed, 1, "{name}");
        assert_eq!(one, [None]);
        assert_no_leaks(&alloc);
    }
}

#[test]
#[should_panic(expected = "not allocated")]
fn free_pages_bulk_array_of_already_freed_pages_panics_when_checks_are_on() {
    let alloc = builder(4).checks(true).build().unwrap();
    let mut slots = [None; 10];
    alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
    let copy = slots;
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk_array(&mut slots) };
    let mut again = copy;
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages_bulk_array(&mut again) };
}

#[test]
fn a_split_block_frees_page_by_page_and_merges_back() {
    for checks in [false, true] {
        let alloc = builder(8).checks(checks).build().unwrap();
        for comp in [Gfp::empty(), Gfp::COMP] {
            let head = alloc.alloc_pages(Gfp::KERNEL | comp, 4).unwrap();
            // SAFETY: the test owns the block and from here owns its pages one by one.
            unsafe { alloc.split_page(head, 4) };
            // Free in an order that forces merging from the middle out.
            let mut pfns: Vec<u32> = (head.pfn()..head.pfn() + 16).collect();
            pfns.reverse();
            pfns.swap(3, 11);
            for pfn in pfns {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(Page::from_pfn(pfn), 0) };
            }
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
#[should_panic(expected = "not the start of an order-3 block")]
fn splitting_a_misaligned_block_panics_with_the_frame_named() {
    let alloc = small(8);
    let p = alloc.alloc_pages(Gfp::KERNEL, 3).unwrap();
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.split_page(Page::from_pfn(p.pfn() + 1), 3) };
}
