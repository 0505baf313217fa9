//! Configuration errors, and what each allocation flag means.

mod common;
use common::{assert_no_leaks, builder, BarrenShrinker, Holding, HoldingShrinker};
use iopages::flags;
use iopages::{
    memalloc_nofs_scope, memalloc_noio_scope, Error, Gfp, Page, PageAllocator,
    PageAllocatorBuilder, PcpLimits, Watermarks, MAX_ORDER, MAX_RECLAIM_RETRIES, PAGE_SIZE,
};
use std::sync::Arc;

fn build_err(b: PageAllocatorBuilder) -> Error {
    match b.build() {
        Ok(_) => panic!("the setting should have been refused"),
        Err(e) => e,
    }
}

// ---- configuration ------------------------------------------------------

#[test]
fn arena_sizes_that_are_zero_tiny_or_unaligned_are_errors_naming_4_mib() {
    for size in [
        0u64,
        1,
        4096,
        (4 << 20) - 4096,
        5 << 20,
        (4 << 20) + 4096,
        6 << 20,
    ] {
        let e = build_err(PageAllocator::builder().size_bytes(size));
        assert!(
            matches!(e, Error::BadArenaSize { size_bytes, .. } if size_bytes == size),
            "{size}: {e:?}"
        );
        assert!(e.to_string().contains("4 MiB"), "{size}: {e}");
        assert!(PageAllocator::new(size).is_err(), "{size}");
    }
    let e = build_err(PageAllocator::builder().size_bytes(5 << 20));
    assert!(e.to_string().contains("4 MiB or 8 MiB"), "{e}");
    let e = build_err(PageAllocator::builder().size_bytes((8 << 40) + (4 << 20)));
    assert!(matches!(e, Error::BadArenaSize { .. }), "{e}");
    // The boundaries are accepted.
    assert!(PageAllocator::new(4 << 20).is_ok());
    assert!(PageAllocator::new(12 << 20).is_ok());
}

#[test]
fn an_unaligned_size_with_a_bad_setting_is_still_an_error() {
    let e = build_err(PageAllocator::builder().size_bytes(4096).nr_cpus(0));
    assert!(
        e.to_string().contains("4 MiB") || e.to_string().contains("nr_cpus"),
        "{e}"
    );
}

#[test]
fn order_above_max_returns_none_without_panicking() {
    let alloc = builder(8).build().unwrap();
    let failures = alloc.stats().failures;
    for order in [MAX_ORDER + 1, MAX_ORDER + 2, 31, 32, u32::MAX] {
        assert_eq!(alloc.alloc_pages(Gfp::KERNEL, order), None, "order {order}");
        assert_eq!(alloc.alloc_pages(Gfp::NOWAIT, order), None, "order {order}");
        // Not even NOFAIL can make a block that does not exist.
        assert_eq!(
            alloc.alloc_pages(Gfp::KERNEL | Gfp::NOFAIL, order),
            None,
            "order {order}"
        );
        assert!(alloc.alloc_box(Gfp::ATOMIC, order).is_none());
    }
    assert_eq!(alloc.stats().failures, failures + 20);
    // MAX_ORDER itself works.
    let p = alloc.alloc_pages(Gfp::KERNEL, MAX_ORDER).unwrap();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, MAX_ORDER) };
    assert_no_leaks(&alloc);
}

#[test]
fn builder_rejects_watermarks_out_of_order() {
    let bad = [
        Watermarks {
            min: 50,
            low: 40,
            high: 60,
        },
        Watermarks {
            min: 10,
            low: 70,
            high: 60,
        },
        Watermarks {
            min: 10,
            low: 20,
            high: 1024,
        },
    ];
    for w in bad {
        let e = build_err(builder(4).watermarks(w));
        assert!(
            matches!(
                e,
                Error::BadSetting {
                    name: "watermarks",
                    ..
                }
            ),
            "{w:?}: {e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("min <= low <= high"), "{msg}");
        assert!(
            msg.contains("1024"),
            "the message should name the arena's pages: {msg}"
        );
    }
    let ok = Watermarks {
        min: 10,
        low: 10,
        high: 1023,
    };
    assert_eq!(builder(4).watermarks(ok).build().unwrap().watermarks(), ok);
}

#[test]
fn set_watermarks_rejects_min_above_low_and_keeps_the_old_ones() {
    let alloc = builder(4).build().unwrap();
    let before = alloc.watermarks();
    for w in [
        Watermarks {
            min: 50,
            low: 40,
            high: 60,
        },
        Watermarks {
            min: 1,
            low: 2,
            high: 1,
        },
        Watermarks {
            min: 1,
            low: 2,
            high: 2000,
        },
    ] {
        let e = alloc.set_watermarks(w).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadSetting {
                    name: "watermarks",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("min <= low <= high < 1024"), "{e}");
        assert_eq!(
            alloc.watermarks(),
            before,
            "a refused change must not apply"
        );
    }
    let w = Watermarks {
        min: 1,
        low: 2,
        high: 3,
    };
    alloc.set_watermarks(w).unwrap();
    assert_eq!(alloc.watermarks(), w);
    assert_eq!(alloc.stats().watermarks, (1, 2, 3));
}

#[test]
fn pcp_limits_with_batch_zero_or_above_high_are_rejected() {
    let good = PcpLimits {
        high: [8, 4, 2, 2],
        batch: [2, 1, 1, 1],
    };
    let mut bad = Vec::new();
    for o in 0..4 {
        let mut zero = good;
        zero.batch[o] = 0;
        bad.push(zero);
        let mut above = good;
        above.batch[o] = above.high[o] + 1;
        bad.push(above);
        let mut no_high = good;
        no_high.high[o] = 0;
        bad.push(no_high);
        let mut huge = good;
        huge.high[o] = (1 << 14) + 1;
        bad.push(huge);
    }
    for l in bad {
        let e = build_err(builder(4).pcp_limits(l));
        assert!(
            matches!(
                e,
                Error::BadSetting {
                    name: "pcp_limits",
                    ..
                }
            ),
            "{l:?}: {e:?}"
        );
        assert!(e.to_string().contains("1 <= batch <= high"), "{e}");
    }
    let alloc = builder(4).pcp_limits(good).build().unwrap();
    assert_eq!(alloc.pcp_limits(), good);
}

#[test]
fn thread_cache_pages_above_the_limit_is_rejected() {
    for pages in [4097usize, 1 << 20, usize::MAX] {
        let e = build_err(builder(4).thread_cache_pages(pages));
        assert!(
            matches!(
                e,
                Error::BadSetting {
                    name: "thread_cache_pages",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("at most 4096"), "{e}");
    }
    assert!(builder(4).thread_cache_pages(4096).build().is_ok());
    let off = builder(4).thread_cache_pages(0).build().unwrap();
    assert_eq!(off.thread_cache_max_pages(), 0);
}

#[test]
fn nr_cpus_zero_is_rejected() {
    for n in [0usize, 4097] {
        let e = build_err(builder(4).nr_cpus(n));
        assert!(
            matches!(
                e,
                Error::BadSetting {
                    name: "nr_cpus",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("between 1 and 4096"), "{e}");
    }
    assert_eq!(builder(4).nr_cpus(1).build().unwrap().nr_cpus(), 1);
    assert_eq!(builder(4).nr_cpus(4096).build().unwrap().nr_cpus(), 4096);
}

// ---- GFP semantics --------------------------------------------------------

/// A deterministic arena: one per-CPU set, no thread caches, per-CPU batches
/// of one page, so that the zone's free count moves one page per allocation.
/// Watermarks 64/80/96 of 1024 pages.
const MIN: usize = 64;

fn exact() -> PageAllocator {
    exact_builder().thread_cache_pages(0).build().unwrap()
}

/// The same arena and watermarks with the default per-CPU limits and
/// thread caches on. Background reclaim is off: these tests pin down what
/// direct reclaim does, and a background thread running the same
/// shrinkers would blur it (`tests/kswapd.rs` tests that thread).
fn cached() -> PageAllocatorBuilder {
    builder(4)
        .nr_cpus(1)
        .background_reclaim(false)
        .watermarks(Watermarks {
            min: MIN,
            low: 80,
            high: 96,
        })
}

fn exact_builder() -> PageAllocatorBuilder {
    cached().pcp_limits(PcpLimits {
        high: [4, 2, 2, 2],
        batch: [1, 1, 1, 1],
    })
}

/// Allocate order-0 pages with `gfp` until it fails.
fn exhaust(alloc: &PageAllocator, gfp: Gfp) -> Vec<Page> {
    std::iter::from_fn(|| alloc.alloc_pages(gfp, 0)).collect()
}

fn is_zero(alloc: &PageAllocator, p: Page, order: u32) -> bool {
    // SAFETY: the block is allocated to the caller.
    let bytes = unsafe { std::slice::from_raw_parts(alloc.page_address(p), PAGE_SIZE << order) };
    bytes.iter().all(|&b| b == 0)
}

fn dirty(alloc: &PageAllocator, p: Page, order: u32) {
    // SAFETY: the block is allocated to the caller.
    unsafe { std::ptr::write_bytes(alloc.page_address(p), 0xc3, PAGE_SIZE << order) };
}

#[test]
fn zero_returns_zeroed_memory() {
    for tcache in [64, 0] {
        let alloc = builder(8).thread_cache_pages(tcache).build().unwrap();
        for order in [0u32, 2, 3, 6] {
            let dirtied: Vec<Page> = (0..16)
                .map(|_| alloc.alloc_pages(Gfp::KERNEL, order).unwrap())
                .collect();
            for &p in &dirtied {
                dirty(&alloc, p, order);
            }
            for &p in dirtied.iter().rev() {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, order) };
            }
            let zeroed: Vec<Page> = (0..16)
                .map(|_| alloc.alloc_pages(Gfp::KERNEL | Gfp::ZERO, order).unwrap())
                .collect();
            assert!(
                zeroed.iter().any(|p| dirtied.contains(p)),
                "tcache {tcache} order {order}: expected dirtied blocks to come back"
            );
            for &p in &zeroed {
                assert!(
                    is_zero(&alloc, p, order),
                    "tcache {tcache} order {order} pfn {}",
                    p.pfn()
                );
            }
            for p in zeroed {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, order) };
            }
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn comp_marks_head_and_tails_and_free_clears_them() {
    let alloc = builder(8).build().unwrap();
    for order in [1u32, 3, 5, MAX_ORDER] {
        let p = alloc.alloc_pages(Gfp::KERNEL | Gfp::COMP, order).unwrap();
        let head = alloc.frame_info(p).unwrap();
        assert_ne!(
            head.flags & flags::HEAD,
            0,
            "order {order}: head not marked"
        );
        assert_eq!(head.flags & flags::TAIL, 0);
        assert_eq!(head.order, order);
        for pfn in p.pfn() + 1..p.pfn() + (1 << order) {
            let t = alloc.frame_info(Page::from_pfn(pfn)).unwrap();
            assert_ne!(
                t.flags & flags::TAIL,
                0,
                "order {order}: pfn {pfn} not a tail"
            );
            assert_eq!(t.flags & flags::HEAD, 0);
            assert_eq!(t.owner, p.pfn(), "a tail points at its head");
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, order) };
        for pfn in p.pfn()..p.pfn() + (1 << order) {
            let f = alloc.frame_info(Page::from_pfn(pfn)).unwrap();
            assert_eq!(
                f.flags & (flags::HEAD | flags::TAIL),
                0,
                "order {order}: pfn {pfn} still compound"
            );
        }
    }
    // Order 0 and plain allocations are not compound.
    let a = alloc.alloc_pages(Gfp::KERNEL | Gfp::COMP, 0).unwrap();
    let b = alloc.alloc_pages(Gfp::KERNEL, 3).unwrap();
    assert_eq!(
        alloc.frame_info(a).unwrap().flags & (flags::HEAD | flags::TAIL),
        0
    );
    for pfn in b.pfn()..b.pfn() + 8 {
        assert_eq!(
            alloc.frame_info(Page::from_pfn(pfn)).unwrap().flags & (flags::HEAD | flags::TAIL),
            0
        );
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(a, 0) };
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(b, 3) };
    assert_no_leaks(&alloc);
}

#[test]
#[should_panic(expected = "wrong order")]
fn compound_page_freed_with_the_wrong_order_panics() {
    let alloc = builder(4).build().unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL | Gfp::COMP, 3).unwrap();
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages(p, 2) };
}

#[test]
fn checks_mark_allocated_frames() {
    let alloc = builder(4).checks(true).build().unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
    assert_ne!(alloc.frame_info(p).unwrap().flags & flags::ALLOCATED, 0);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 0) };
    assert_eq!(alloc.frame_info(p).unwrap().flags & flags::ALLOCATED, 0);
    assert_no_leaks(&alloc);
}

#[test]
fn nowait_stops_at_min_and_memalloc_allocates_below_it() {
    let alloc = exact();
    let total = alloc.accounting().total_pages;
    let mut held = exhaust(&alloc, Gfp::NOWAIT);
    assert_eq!(
        held.len(),
        total - MIN,
        "NOWAIT may use the zone down to min"
    );
    assert_eq!(alloc.accounting().buddy_free_pages, MIN);
    assert_eq!(
        alloc.alloc_pages(Gfp::KERNEL, 0),
        None,
        "KERNEL has nothing to reclaim"
    );
    // MEMALLOC ignores the watermarks: the reserve is all its own.
    let reserve = exhaust(&alloc, Gfp::NOWAIT | Gfp::MEMALLOC);
    assert_eq!(reserve.len(), MIN, "MEMALLOC may empty the zone");
    assert_eq!(alloc.accounting().buddy_free_pages, 0);
    assert_eq!(alloc.accounting().in_use_pages, total);
    assert_eq!(
        alloc.alloc_pages(Gfp::NOWAIT | Gfp::MEMALLOC, 0),
        None,
        "the arena is empty"
    );
    held.extend(reserve);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn atomic_goes_below_min_down_to_half_of_min() {
    let alloc = exact();
    let total = alloc.accounting().total_pages;
    let mut held = exhaust(&alloc, Gfp::NOWAIT);
    assert_eq!(held.len(), total - MIN);
    let atomic = exhaust(&alloc, Gfp::ATOMIC);
    assert_eq!(atomic.len(), MIN / 2, "ATOMIC may use half of the reserve");
    assert_eq!(alloc.accounting().buddy_free_pages, MIN / 2);
    assert_eq!(alloc.alloc_pages(Gfp::NOWAIT, 0), None);
    assert_eq!(
        alloc.alloc_pages(Gfp::KERNEL | Gfp::HIGH, 0),
        None,
        "HIGH stops at half of min too"
    );
    let rest = exhaust(&alloc, Gfp::ATOMIC | Gfp::MEMALLOC);
    assert_eq!(rest.len(), MIN / 2);
    held.extend(atomic);
    held.extend(rest);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

/// A cache whose reclaim may start I/O.
const NEEDS_IO: Holding = Holding {
    needs_io: true,
    needs_fs: false,
    free_in_bulk: false,
};

/// A cache whose reclaim may enter the filesystem.
const NEEDS_FS: Holding = Holding {
    needs_io: false,
    needs_fs: true,
    free_in_bulk: false,
};

/// Exhaust with NOWAIT, hand `give` of the held pages to a shrinker.
fn exhausted_with_shrinker(
    alloc: &PageAllocator,
    give: usize,
    how: Holding,
) -> (Vec<Page>, Arc<HoldingShrinker>, iopages::ShrinkerId) {
    let mut held = exhaust(alloc, Gfp::NOWAIT);
    assert!(held.len() > give);
    let given = held.split_off(held.len() - give);
    let s = HoldingShrinker::new(alloc, given, how);
    let id = alloc.shrinkers().register(s.clone());
    (held, s, id)
}

#[test]
fn kernel_allocation_in_an_exhausted_arena_succeeds_through_a_shrinker() {
    let alloc = exact();
    let (mut held, s, id) = exhausted_with_shrinker(&alloc, 16, Holding::default());
    assert_eq!(
        alloc.alloc_pages(Gfp::NOWAIT, 0),
        None,
        "NOWAIT does not reclaim"
    );
    assert_eq!(s.scans(), 0);
    let before = alloc.stats();
    let p = alloc
        .alloc_pages(Gfp::KERNEL, 0)
        .expect("direct reclaim should free a page");
    assert!(s.scans() >= 1, "the shrinker must be called");
    let after = alloc.stats();
    assert!(after.direct_reclaim > before.direct_reclaim);
    assert!(after.shrinker_pages_freed > before.shrinker_pages_freed);
    assert!(after.slowpath > before.slowpath);
    held.push(p);
    assert!(alloc.shrinkers().unregister(id));
    held.extend(s.take_all());
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn kernel_allocation_uses_pages_a_shrinker_frees_on_the_allocating_thread() {
    // Thread caches on (64 pages), default per-CPU limits: a shrinker that
    // frees 16 pages, one per reclaim round, from the allocating thread.
    let alloc = cached().build().unwrap();
    let (mut held, s, id) = exhausted_with_shrinker(&alloc, 16, Holding::default());
    let got = alloc.alloc_pages(Gfp::KERNEL, 0);
    let freed = alloc.stats().shrinker_pages_freed;
    assert!(
        got.is_some(),
        "the shrinker freed {freed} pages (zone {} free, this thread's cache {}), yet the allocation failed",
        alloc.accounting().buddy_free_pages,
        alloc.accounting().thread_cache_pages
    );
    held.extend(got);
    alloc.shrinkers().unregister(id);
    held.extend(s.take_all());
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn higher_order_allocation_uses_the_callers_cached_pages() {
    // Default per-CPU limits, so this thread's cache has room for 64 pages.
    let alloc = cached().build().unwrap();
    let mut held = exhaust(&alloc, Gfp::NOWAIT);
    // Give back 16 pairs of buddies: 32 pages that make 16 order-1 blocks.
    held.sort_by_key(|p| p.pfn());
    let mut back = Vec::new();
    let mut i = 0;
    while back.len() < 32 && i + 1 < held.len() {
        let (a, b) = (held[i], held[i + 1]);
        if a.pfn() % 2 == 0 && b.pfn() == a.pfn() + 1 {
            back.extend([a, b]);
            held.drain(i..i + 2);
        } else {
            i += 1;
        }
    }
    assert_eq!(back.len(), 32);
    for &p in &back {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    let cached = alloc.accounting().thread_cache_pages;
    let got = alloc.alloc_pages(Gfp::KERNEL, 1);
    assert!(
        got.is_some(),
        "16 order-1 buddy pairs were freed ({cached} pages still in this thread's cache), yet order 1 failed: {}",
        alloc.accounting()
    );
    if let Some(p) = got {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 1) };
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn noretry_fails_after_one_reclaim_round() {
    let alloc = exact();
    let held = exhaust(&alloc, Gfp::NOWAIT);
    let s = BarrenShrinker::claiming_one();
    let id = alloc.shrinkers().register(s.clone());
    let before = alloc.stats().direct_reclaim;
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL | Gfp::NORETRY, 0), None);
    assert_eq!(s.scans(), 1, "NORETRY: one round of reclaim");
    assert_eq!(alloc.stats().direct_reclaim, before + 1);
    // Without NORETRY it retries until MAX_RECLAIM_RETRIES rounds made no
    // progress.
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 0), None);
    assert_eq!(s.scans(), 1 + MAX_RECLAIM_RETRIES as usize);
    // Costly orders give up after one round unless RETRY_MAYFAIL.
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 4), None);
    assert_eq!(s.scans(), 2 + MAX_RECLAIM_RETRIES as usize);
    assert_eq!(alloc.alloc_pages(Gfp::KERNEL | Gfp::RETRY_MAYFAIL, 4), None);
    assert_eq!(s.scans(), 2 + 2 * MAX_RECLAIM_RETRIES as usize);
    assert!(alloc.shrinkers().unregister(id));
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn noio_scope_keeps_a_needs_io_shrinker_from_being_called() {
    let alloc = exact();
    let (mut held, io, id) = exhausted_with_shrinker(&alloc, 16, NEEDS_IO);
    {
        let _noio = memalloc_noio_scope();
        assert_eq!(alloc.alloc_pages(Gfp::KERNEL, 0), None);
        assert_eq!(
            io.scans(),
            0,
            "NOIO scope must skip a shrinker that needs I/O"
        );
    }
    assert_eq!(alloc.alloc_pages(Gfp::NOIO, 0), None);
    assert_eq!(
        io.scans(),
        0,
        "NOIO flags must skip a shrinker that needs I/O"
    );
    // NOFS still allows I/O.
    let p = alloc
        .alloc_pages(Gfp::NOFS, 0)
        .expect("NOFS may call an I/O shrinker");
    assert!(io.scans() >= 1);
    held.push(p);
    // Outside the scope, KERNEL may call it as well.
    let scans = io.scans();
    let q = alloc
        .alloc_pages(Gfp::KERNEL, 0)
        .expect("the scope has ended");
    assert!(io.scans() > scans);
    held.push(q);
    alloc.shrinkers().unregister(id);
    held.extend(io.take_all());
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn noio_and_nofs_scopes_keep_a_needs_fs_shrinker_from_being_called_but_not_others() {
    let alloc = exact();
    let (mut held, fs, fs_id) = exhausted_with_shrinker(&alloc, 8, NEEDS_FS);
    let plain = HoldingShrinker::new(&alloc, held.split_off(held.len() - 8), Holding::default());
    let plain_id = alloc.shrinkers().register(plain.clone());
    {
        let _nofs = memalloc_nofs_scope();
        let p = alloc
            .alloc_pages(Gfp::KERNEL, 0)
            .expect("the plain shrinker can help");
        held.push(p);
    }
    {
        let _noio = memalloc_noio_scope();
        let p = alloc
            .alloc_pages(Gfp::KERNEL, 0)
            .expect("the plain shrinker can help");
        held.push(p);
    }
    assert_eq!(
        fs.scans(),
        0,
        "NOFS and NOIO scopes must skip a shrinker that needs the FS"
    );
    assert!(plain.scans() >= 2);
    alloc.shrinkers().unregister(fs_id);
    alloc.shrinkers().unregister(plain_id);
    held.extend(fs.take_all());
    held.extend(plain.take_all());
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
    assert_no_leaks(&alloc);
}

#[test]
fn page_box_frees_on_drop_and_as_mut_slice_writes() {
    let alloc = builder(4).build().unwrap();
    {
        let mut b = alloc.alloc_box(Gfp::KERNEL, 2).unwrap();
        assert_eq!(b.order(), 2);
        assert_eq!(b.len(), 4 * PAGE_SIZE);
        assert!(!b.is_empty());
        assert_eq!(
            b.as_slice().as_ptr(),
            alloc.page_address(b.page()).cast_const()
        );
        for (i, byte) in b.as_mut_slice().iter_mut().enumerate() {
            *byte = (i % 251) as u8;
        }
        // The write went to the arena.
        // SAFETY: the box holds the block.
        let last = unsafe { alloc.page_address(b.page()).add(4 * PAGE_SIZE - 1).read() };
        assert_eq!(last, ((4 * PAGE_SIZE - 1) % 251) as u8);
        assert!(b
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 251) as u8));
        assert_eq!(alloc.accounting().in_use_pages, 4);
    }
    assert_eq!(
        alloc.accounting().in_use_pages,
        0,
        "drop must free the block"
    );
    let raw = alloc.alloc_box(Gfp::KERNEL, 1).unwrap().into_raw();
    assert_eq!(alloc.accounting().in_use_pages, 2, "into_raw must not free");
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(raw, 1) };
    assert_no_leaks(&alloc);
}

#[test]
#[should_panic(expected = "not allocated")]
fn double_free_panics_when_checks_are_on() {
    let alloc = builder(4).checks(true).build().unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL, 0).unwrap();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 0) };
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages(p, 0) };
}

#[test]
#[should_panic(expected = "not allocated")]
fn double_free_of_a_higher_order_block_panics_when_checks_are_on() {
    let alloc = builder(4)
        .checks(true)
        .thread_cache_pages(0)
        .build()
        .unwrap();
    let p = alloc.alloc_pages(Gfp::KERNEL, 4).unwrap();
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(p, 4) };
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages(p, 4) };
}

#[test]
#[should_panic(expected = "not allocated")]
fn double_free_through_free_pages_bulk_panics_when_checks_are_on() {
    let alloc = builder(4).checks(true).build().unwrap();
    let mut pages = Vec::new();
    alloc.alloc_pages_bulk_list(Gfp::KERNEL, 8, &mut pages);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&pages) };
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages_bulk(&pages[3..4]) };
}

#[test]
#[should_panic(expected = "not allocated")]
fn freeing_a_page_never_allocated_panics_when_checks_are_on() {
    let alloc = builder(4).checks(true).build().unwrap();
    // SAFETY: deliberately broken, in a test of the checks: the frame
    // is not handed out again before the bad free, which the checks must
    // catch and panic on.
    unsafe { alloc.free_pages(Page::from_pfn(100), 0) };
}

#[test]
fn nofail_waits_for_another_thread_to_free_and_then_succeeds() {
    let alloc = PageAllocator::builder()
        .size_bytes(4 << 20)
        .nr_cpus(1)
        .thread_cache_pages(0)
        .build()
        .unwrap();
    let held = exhaust(&alloc, Gfp::KERNEL | Gfp::MEMALLOC | Gfp::NOWARN);
    assert_eq!(
        alloc.alloc_pages(Gfp::NOWAIT, 0),
        None,
        "the arena must be exhausted"
    );
    let freer = {
        let alloc = alloc.clone();
        let held = held.clone();
        std::thread::spawn(move || {
            // Hand-off: free only once the allocating thread has gone to
            // sleep waiting for frees (no sleep-ordered guess).
            let t = std::time::Instant::now();
            while alloc.stats().nofail_waits == 0 {
                assert!(t.elapsed().as_secs() < 20, "NOFAIL never waited");
                std::thread::yield_now();
            }
            for p in held {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, 0) };
            }
        })
    };
    let page = alloc
        .alloc_pages(Gfp::KERNEL | Gfp::NOFAIL, 0)
        .expect("NOFAIL never returns None");
    freer.join().unwrap();
    assert!(
        alloc.stats().nofail_waits > 0,
        "NOFAIL must have slept while nothing was free"
    );
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(page, 0) };
    assert_no_leaks(&alloc);
}

#[test]
fn a_depot_larger_than_half_the_arena_is_rejected() {
    let err = PageAllocator::builder()
        .size_bytes(4 << 20)
        .depot_pages(600)
        .build()
        .err()
        .expect("600 of 1024 pages is more than half");
    assert!(err.to_string().contains("depot_pages"), "{err}");
    assert!(PageAllocator::builder()
        .size_bytes(4 << 20)
        .depot_pages(512)
        .build()
        .is_ok());
}
