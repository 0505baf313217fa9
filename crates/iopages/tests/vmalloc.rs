//! vmalloc and kvmalloc: buffers alias the arena's frames across run
//! boundaries, fragmented arenas still serve them, the lazy-area cache is
//! reused and shrunk, the VMA budget refuses before the kernel would, every
//! injected failure (page allocation or mapping) returns cleanly, and the
//! two kvmalloc policies differ exactly in direct reclaim.
//!
//! Every test that creates mappings holds `VMAS` shared; the one that walks
//! the process up to its real mapping budget, and those that count the
//! process's mappings, hold it exclusively.

mod common;
use common::{assert_no_leaks, builder, BarrenShrinker};
use iopages::{
    FaultConfig, Gfp, KvKind, KvPolicy, Kvmalloc, Page, PageAllocator, VmBox, Vmalloc,
    VmallocConfig, MAX_ORDER, PAGE_SIZE,
};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread;

static VMAS: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    VMAS.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    VMAS.write().unwrap_or_else(|e| e.into_inner())
}

fn arena(mib: u64) -> PageAllocator {
    builder(mib).build().unwrap()
}

/// Allocate every frame of the arena (watermarks ignored), then free those
/// for which `free(pfn)` holds. Returns the frames still held.
fn fragment(alloc: &PageAllocator, free: impl Fn(u32) -> bool) -> Vec<Page> {
    let gfp = Gfp::ATOMIC | Gfp::MEMALLOC | Gfp::NOWARN;
    let mut all = Vec::new();
    loop {
        while let Some(p) = alloc.alloc_pages(gfp, 0) {
            all.push(p);
        }
        // Pages on other CPUs' lists are free too: take them as well.
        alloc.drain_all();
        match alloc.alloc_pages(gfp, 0) {
            Some(p) => all.push(p),
            None => break,
        }
    }
    assert_eq!(
        alloc.accounting().in_use_pages,
        alloc.arena().nr_pages(),
        "every frame taken"
    );
    let (freed, held): (Vec<Page>, Vec<Page>) = all.into_iter().partition(|p| free(p.pfn()));
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&freed) };
    alloc.drain_all();
    held
}

fn release(alloc: &PageAllocator, held: Vec<Page>) {
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&held) };
}

fn pattern(i: usize, seed: u8) -> u8 {
    (i as u8).wrapping_mul(31) ^ (i / PAGE_SIZE) as u8 ^ seed
}

/// Write through the vmalloc'd slice and read through the frames' direct
/// map, then the other way round: the area really aliases those frames.
fn check_aliasing(alloc: &PageAllocator, b: &mut VmBox, seed: u8) {
    let len = b.len();
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = pattern(i, seed);
    }
    let pages = b.pages();
    assert_eq!(pages.len(), b.nr_pages());
    assert_eq!(
        b.runs().iter().map(|r| r.nr_pages).sum::<usize>(),
        b.nr_pages()
    );
    for (k, &p) in pages.iter().enumerate() {
        let n = (len - k * PAGE_SIZE).min(PAGE_SIZE);
        // SAFETY: the frame is allocated to `b`, lies in the direct map, and
        // `b` is not accessed while this view lives.
        let direct = unsafe { std::slice::from_raw_parts(alloc.page_address(p), n) };
        for (j, &x) in direct.iter().enumerate() {
            assert_eq!(
                x,
                pattern(k * PAGE_SIZE + j, seed),
                "byte {} (page {k}, pfn {})",
                k * PAGE_SIZE + j,
                p.pfn()
            );
        }
        // SAFETY: as above, writable: nothing else uses the frame now.
        let direct = unsafe { std::slice::from_raw_parts_mut(alloc.page_address(p), n) };
        for (j, x) in direct.iter_mut().enumerate() {
            *x = !pattern(k * PAGE_SIZE + j, seed);
        }
    }
    for (i, &x) in b.as_slice().iter().enumerate() {
        assert_eq!(
            x,
            !pattern(i, seed),
            "byte {i} written through the direct map"
        );
    }
}

fn no_cache() -> VmallocConfig {
    VmallocConfig {
        cache_max_areas: 0,
        ..VmallocConfig::default()
    }
}

/// Mappings of `alloc`'s memfd in this process (its direct map and any
/// vmalloc runs).
fn memfd_maps(alloc: &PageAllocator) -> usize {
    // SAFETY: `stat` is plain data; fstat fills it for a valid descriptor.
    let ino = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(alloc.arena().fd(), &mut st), 0);
        st.st_ino
    };
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains("memfd") && l.split_whitespace().nth(4) == Some(&ino.to_string()))
        .count()
}

/// Inaccessible private mappings of exactly `bytes` in this process.
fn prot_none_maps_of(bytes: usize) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| {
            let mut f = l.split_whitespace();
            let range = f.next().unwrap_or("");
            let perms = f.next().unwrap_or("");
            let (a, b) = range.split_once('-').unwrap_or(("0", "0"));
            let len = usize::from_str_radix(b, 16).unwrap_or(0)
                - usize::from_str_radix(a, 16).unwrap_or(0);
            perms == "---p" && len == bytes
        })
        .count()
}

fn count_maps() -> usize {
    std::fs::read("/proc/self/maps")
        .unwrap()
        .iter()
        .filter(|&&c| c == b'\n')
        .count()
}

#[test]
fn data_crosses_run_boundaries_and_aliases_the_frames() {
    let _g = shared();
    let alloc = arena(16);
    // Free runs of three frames between held runs of three.
    let held = fragment(&alloc, |pfn| (pfn / 3) % 2 == 0);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let mut b = vm.vmalloc(700 * PAGE_SIZE - 100, Gfp::KERNEL).unwrap();
    assert_eq!(b.len(), 700 * PAGE_SIZE - 100);
    assert_eq!(b.nr_pages(), 700);
    assert!(b.nr_runs() >= 700 / 3, "{b:?}");
    assert!(b.runs().iter().all(|r| r.nr_pages <= 3), "{:?}", b.runs());
    check_aliasing(&alloc, &mut b, 1);
    let s = vm.stats();
    assert_eq!(s.maps_held, b.nr_runs() + 1, "one mapping per run + guard");
    assert_eq!(s.map_calls, b.nr_runs() as u64 + 1);
    drop(b);
    assert_eq!(vm.stats().maps_held, 0);
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn a_fresh_arena_uses_large_blocks_and_few_runs() {
    let _g = shared();
    let alloc = arena(32);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let mut b = vm.vmalloc(3 << 20, Gfp::KERNEL).unwrap();
    assert!(b.nr_runs() <= 4, "{b:?}");
    assert!(vm.stats().high_order_blocks >= 1);
    check_aliasing(&alloc, &mut b, 2);
    vm.vfree(b);
    assert_no_leaks(&alloc);
}

#[test]
fn every_other_frame_free_still_vmallocs_with_many_runs() {
    let _g = shared();
    let alloc = arena(16);
    let held = fragment(&alloc, |pfn| pfn % 2 == 1);
    assert_eq!(
        alloc.stats().free_blocks_by_order[1..]
            .iter()
            .sum::<usize>(),
        0,
        "no block above order 0 is free"
    );
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let mut b = vm.vmalloc(1500 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    assert_eq!(b.nr_runs(), 1500, "every frame is its own run");
    check_aliasing(&alloc, &mut b, 3);
    let mut z = vm
        .vmalloc(100 * PAGE_SIZE + 1, Gfp::KERNEL | Gfp::ZERO)
        .unwrap();
    assert!(z.as_slice().iter().all(|&x| x == 0));
    check_aliasing(&alloc, &mut z, 4);
    drop((b, z));
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn kvfree_of_both_kinds_leaks_nothing() {
    let _g = shared();
    let alloc = arena(16);
    let kv = Kvmalloc::new(&alloc).unwrap();
    let mut c = kv
        .kvmalloc(64 << 10, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap();
    assert_eq!(c.kind(), KvKind::Contiguous { order: 4 });
    c.as_mut_slice().fill(0xa5);
    assert_eq!(c.pages().len(), 16);
    let held = fragment(&alloc, |pfn| pfn % 2 == 1);
    let mut v = kv
        .kvmalloc(64 << 10, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap();
    assert_eq!(v.kind(), KvKind::Vmalloc { nr_runs: 16 });
    v.as_mut_slice().fill(0x5a);
    assert!(c.as_slice().iter().all(|&x| x == 0xa5));
    assert!(v.as_slice().iter().all(|&x| x == 0x5a));
    let st = kv.stats(KvPolicy::FailFast);
    assert_eq!((st.contiguous, st.vmalloc_fallbacks), (1, 1));
    assert_eq!(st.contiguous_attempts, 2);
    kv.kvfree(c);
    kv.kvfree(v);
    kv.vmalloc().purge();
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn the_vma_budget_refuses_with_the_limit_named_and_recovers() {
    let _g = shared();
    let alloc = arena(16);
    let held = fragment(&alloc, |pfn| pfn % 2 == 1);
    let vm = Vmalloc::with_config(
        &alloc,
        VmallocConfig {
            max_maps: Some(40),
            ..VmallocConfig::default()
        },
    )
    .unwrap();
    // Ten isolated frames: ten runs and a guard page, 11 mappings each.
    let a = vm.vmalloc(10 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    let b = vm.vmalloc(10 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    let c = vm.vmalloc(10 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    assert_eq!(vm.stats().maps_held, 33);
    let in_use = alloc.accounting().in_use_pages;
    let e = vm.vmalloc(10 * PAGE_SIZE, Gfp::KERNEL).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("vm.max_map_count"), "{msg}");
    assert!(msg.contains("budget of 40"), "{msg}");
    assert!(msg.contains("needs 11 memory mappings"), "{msg}");
    let s = vm.stats();
    assert_eq!((s.budget_refusals, s.maps_held, s.failures), (1, 33, 1));
    assert_eq!(
        alloc.accounting().in_use_pages,
        in_use,
        "the refused request's frames were freed"
    );
    // A freed area stays cached, mappings and all; a request of another
    // size purges the cache to make room instead of failing.
    drop(a);
    assert_eq!(vm.stats().maps_held, 33);
    let d = vm.vmalloc(9 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    let s = vm.stats();
    assert_eq!((s.cached_areas, s.maps_held, s.budget_refusals), (0, 32, 1));
    drop((b, c, d));
    vm.purge();
    assert_eq!(vm.stats().maps_held, 0);
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn the_default_budget_refuses_before_the_kernel_limit() {
    let _g = exclusive();
    // 512 MiB of frames, every other one free: enough isolated frames to
    // need more mappings than vm.max_map_count allows. Nothing is written,
    // so the memfd stays sparse.
    let alloc = arena(512);
    let held = fragment(&alloc, |pfn| pfn % 2 == 1);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let limit = vm.stats().max_map_count;
    let mut bufs = Vec::new();
    let err = loop {
        match vm.vmalloc(4000 * PAGE_SIZE, Gfp::KERNEL) {
            Ok(b) => bufs.push(b),
            Err(e) => break e,
        }
        assert!(bufs.len() < 100, "the budget never refused");
    };
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("vm.max_map_count = {limit}")),
        "{msg}"
    );
    let s = vm.stats();
    let maps_now = count_maps();
    assert!(
        maps_now < limit,
        "{maps_now} mappings reached the limit {limit}"
    );
    assert!(
        s.maps_held + 4001 > s.max_maps,
        "refused only when full: {s:?}"
    );
    // The kernel still has room: an ordinary mapping succeeds.
    // SAFETY: a fresh anonymous mapping, unmapped right away.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            PAGE_SIZE,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        libc::munmap(p, PAGE_SIZE);
    }
    drop(bufs);
    let s = vm.stats();
    assert_eq!(s.maps_held, 0);
    // Measured, not asserted: the cost of one mapping call and of unmapping
    // a 4000-run area.
    eprintln!(
        "mmap: {} calls, {} ns each; munmap: {} areas, {} ns each",
        s.map_calls,
        s.map_ns / s.map_calls.max(1),
        s.unmap_calls,
        s.unmap_ns / s.unmap_calls.max(1)
    );
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn the_lazy_cache_reuses_areas_is_bounded_and_its_shrinker_purges_it() {
    let _g = shared();
    let alloc = arena(32);
    let vm = Vmalloc::with_config(
        &alloc,
        VmallocConfig {
            cache_max_areas: 3,
            cache_max_pages: Some(1000),
            ..VmallocConfig::default()
        },
    )
    .unwrap();
    assert_eq!(alloc.shrinkers().len(), 1);
    let mut a = vm.vmalloc(100 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    a.as_mut_slice()[0] = 42;
    let addr = a.as_ptr();
    drop(a);
    let s = vm.stats();
    assert_eq!((s.cached_areas, s.cached_pages), (1, 100));
    assert_eq!(
        alloc.accounting().in_use_pages,
        100,
        "cached frames stay allocated"
    );
    let maps_before = vm.stats().map_calls;
    let b = vm.vmalloc(100 * PAGE_SIZE - 7, Gfp::KERNEL).unwrap();
    assert_eq!(b.as_ptr(), addr);
    assert_eq!(
        b.as_slice()[0],
        42,
        "a cache hit is not zeroed unless asked"
    );
    let s = vm.stats();
    assert_eq!((s.cache_hits, s.cached_areas), (1, 0));
    assert_eq!(s.map_calls, maps_before, "a cache hit makes no mmap call");
    drop(b);
    // Other sizes miss; the cache keeps the three most recent areas.
    for pages in [50, 60, 70, 80] {
        drop(vm.vmalloc(pages * PAGE_SIZE, Gfp::KERNEL).unwrap());
    }
    let s = vm.stats();
    assert_eq!((s.cache_hits, s.cached_areas, s.cached_pages), (1, 3, 210));
    assert_eq!(s.purged_areas, 2);
    // Too big for the cache: released at once.
    drop(vm.vmalloc(1001 * PAGE_SIZE, Gfp::KERNEL).unwrap());
    assert_eq!(vm.stats().cached_pages, 210);
    assert_eq!(alloc.accounting().in_use_pages, 210);
    // Direct reclaim asks for 10 pages: the oldest area (60) goes.
    assert_eq!(alloc.shrinkers().shrink(Gfp::KERNEL, 10), 60);
    assert_eq!(vm.stats().cached_pages, 150);
    assert_eq!(alloc.shrinkers().shrink(Gfp::KERNEL, usize::MAX), 150);
    let s = vm.stats();
    assert_eq!((s.cached_areas, s.maps_held, s.shrinker_pages), (0, 0, 210));
    assert_no_leaks(&alloc);
    drop(vm);
    assert_eq!(
        alloc.shrinkers().len(),
        0,
        "the shrinker leaves with the vmalloc"
    );
}

#[test]
fn dropping_the_vmalloc_with_cached_areas_frees_them() {
    let _g = shared();
    let alloc = arena(16);
    let vm = Vmalloc::new(&alloc).unwrap();
    let b = vm.vmalloc(64 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    drop(vm);
    // The buffer keeps the instance alive; it is cached on drop, then the
    // cache goes with the instance.
    assert_eq!(alloc.shrinkers().len(), 1);
    drop(b);
    assert_eq!(alloc.shrinkers().len(), 0);
    assert_no_leaks(&alloc);
}

#[test]
fn memory_pressure_purges_the_cache_through_direct_reclaim() {
    let _g = shared();
    let alloc = arena(16);
    let vm = Vmalloc::with_config(
        &alloc,
        VmallocConfig {
            cache_max_pages: Some(4096),
            ..VmallocConfig::default()
        },
    )
    .unwrap();
    drop(vm.vmalloc(3000 * PAGE_SIZE, Gfp::KERNEL).unwrap());
    assert_eq!(vm.stats().cached_pages, 3000);
    // Another size: its pages exist only if the cached area is given back,
    // which direct reclaim does from inside this very vmalloc.
    let mut b = vm.vmalloc(3001 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    let s = vm.stats();
    assert_eq!((s.cached_pages, s.shrinker_pages), (0, 3000), "{s:?}");
    check_aliasing(&alloc, &mut b, 5);
    drop(b);
    vm.purge();
    assert_no_leaks(&alloc);
}

#[test]
fn a_page_shortage_fails_cleanly_with_or_without_reclaim() {
    let _g = shared();
    let alloc = arena(16);
    let held = fragment(&alloc, |pfn| pfn < 300);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let in_use = alloc.accounting().in_use_pages;
    for gfp in [Gfp::NOWAIT, Gfp::KERNEL | Gfp::NOWARN] {
        let e = vm.vmalloc(400 * PAGE_SIZE, gfp).unwrap_err().to_string();
        assert!(
            e.contains("out of memory") && e.contains("of its 400 pages"),
            "{e}"
        );
        assert_eq!(alloc.accounting().in_use_pages, in_use, "{gfp:?}");
    }
    assert_eq!(vm.stats().maps_held, 0);
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn injected_page_allocation_failures_return_errors_and_leak_nothing() {
    let _g = shared();
    let alloc = arena(16);
    let held = fragment(&alloc, |pfn| (pfn / 3) % 2 == 0);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let kv = Kvmalloc::with_vmalloc(vm.clone());
    let base = alloc.accounting().in_use_pages;
    let configs = (1..=12)
        .map(|interval| FaultConfig {
            interval,
            times: Some(1),
            ..FaultConfig::default()
        })
        .chain((1..=10).map(|seed| FaultConfig {
            probability_ppm: 200_000,
            seed,
            ..FaultConfig::default()
        }))
        .chain([
            FaultConfig::default(),
            FaultConfig {
                min_order: 1,
                ..FaultConfig::default()
            },
            FaultConfig {
                fail_blocking: false,
                ..FaultConfig::default()
            },
        ]);
    let (mut ok, mut failed) = (0, 0);
    for cfg in configs {
        alloc.fault().enable(cfg.clone());
        for gfp in [Gfp::KERNEL, Gfp::NOWAIT] {
            match vm.vmalloc(300 * PAGE_SIZE, gfp) {
                Ok(mut b) => {
                    ok += 1;
                    check_aliasing(&alloc, &mut b, 6);
                }
                Err(e) => {
                    failed += 1;
                    assert!(e.to_string().contains("out of memory"), "{cfg:?}: {e}");
                }
            }
            assert_eq!(alloc.accounting().in_use_pages, base, "{cfg:?} {gfp:?}");
            for policy in KvPolicy::ALL {
                if let Ok(mut b) = kv.kvmalloc(64 << 10, gfp, policy) {
                    b.as_mut_slice().fill(9);
                }
                assert_eq!(alloc.accounting().in_use_pages, base, "{cfg:?} {policy:?}");
            }
        }
        alloc.fault().disable();
    }
    assert!(ok > 0 && failed > 0, "{ok} succeeded, {failed} failed");
    assert_eq!(vm.stats().maps_held, 0);
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn high_order_failures_fall_back_to_single_pages() {
    let _g = shared();
    let alloc = arena(16);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let kv = Kvmalloc::with_vmalloc(vm.clone());
    alloc.fault().enable(FaultConfig {
        min_order: 1,
        ..FaultConfig::default()
    });
    let mut b = vm.vmalloc(200 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    assert_eq!(vm.stats().high_order_blocks, 0);
    check_aliasing(&alloc, &mut b, 7);
    let k = kv
        .kvmalloc(128 << 10, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap();
    assert!(!k.is_contiguous());
    assert_eq!(kv.stats(KvPolicy::FailFast).vmalloc_fallbacks, 1);
    alloc.fault().disable();
    drop((b, k));
    assert_no_leaks(&alloc);
}

#[test]
fn injected_mapping_failures_undo_every_mapping() {
    let _g = shared();
    let alloc = arena(16);
    let held = fragment(&alloc, |pfn| (pfn / 2) % 2 == 0);
    let vm = Vmalloc::with_config(&alloc, no_cache()).unwrap();
    let base_pages = alloc.accounting().in_use_pages;
    assert_eq!(memfd_maps(&alloc), 1, "the direct map");
    let reservation = 41 * PAGE_SIZE;
    let base_reserved = prot_none_maps_of(reservation);
    // Learn the number of mmap calls one request makes.
    let b = vm.vmalloc(40 * PAGE_SIZE, Gfp::KERNEL).unwrap();
    let calls = b.nr_runs() as u64 + 1;
    assert!(calls > 3, "{b:?}");
    assert_eq!(
        memfd_maps(&alloc) as u64,
        calls,
        "the direct map and the runs"
    );
    drop(b);
    for k in 0..calls {
        vm.fail_map_after(Some(k));
        let e = vm.vmalloc(40 * PAGE_SIZE, Gfp::KERNEL).unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        assert_eq!(vm.stats().maps_held, 0, "after failing mmap {k}");
        assert_eq!(
            memfd_maps(&alloc),
            1,
            "runs left mapped after failing mmap {k}"
        );
        assert_eq!(
            prot_none_maps_of(reservation),
            base_reserved,
            "reservation left after failing mmap {k}"
        );
        assert_eq!(alloc.accounting().in_use_pages, base_pages);
    }
    // Past the last call, nothing fails (and the injection is turned off).
    vm.fail_map_after(Some(calls + 1000));
    drop(vm.vmalloc(40 * PAGE_SIZE, Gfp::KERNEL).unwrap());
    vm.fail_map_after(None);
    // The same through kvmalloc's fallback.
    let kv = Kvmalloc::with_vmalloc(vm.clone());
    vm.fail_map_after(Some(0));
    let e = kv
        .kvmalloc(5 << 20, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(kv.stats(KvPolicy::FailFast).failures, 1);
    assert_eq!(memfd_maps(&alloc), 1);
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn fail_fast_skips_direct_reclaim_and_legacy_runs_it() {
    let _g = shared();
    let alloc = arena(16);
    let kv = Kvmalloc::new(&alloc).unwrap();
    // Both policies get contiguous memory while it is there.
    for policy in KvPolicy::ALL {
        let b = kv.kvmalloc(256 << 10, Gfp::KERNEL, policy).unwrap();
        assert_eq!(b.kind(), KvKind::Contiguous { order: 6 }, "{policy:?}");
    }
    let watcher = BarrenShrinker::watching_this_thread();
    let id = alloc.shrinkers().register(watcher.clone());
    let held = fragment(&alloc, |pfn| pfn % 2 == 1);

    let wakeups = alloc.stats().kswapd_wakeups;
    let mut b = kv
        .kvmalloc(64 << 10, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap();
    assert_eq!(b.kind(), KvKind::Vmalloc { nr_runs: 16 });
    b.as_mut_slice().fill(1);
    assert_eq!(watcher.counts(), 0, "fail-fast ran direct reclaim");
    assert!(
        alloc.stats().kswapd_wakeups > wakeups,
        "fail-fast wakes background reclaim"
    );

    let mut c = kv
        .kvmalloc(64 << 10, Gfp::KERNEL, KvPolicy::Legacy)
        .unwrap();
    assert_eq!(c.kind(), KvKind::Vmalloc { nr_runs: 16 });
    c.as_mut_slice().fill(2);
    assert!(
        watcher.counts() >= 1,
        "legacy runs direct reclaim before falling back"
    );

    for policy in KvPolicy::ALL {
        let s = kv.stats(policy);
        assert_eq!(
            (s.contiguous, s.vmalloc_fallbacks, s.contiguous_attempts),
            (1, 1, 2),
            "{policy:?}: {s:?}"
        );
        assert!(s.contiguous_ns > 0);
    }
    drop((b, c));
    alloc.shrinkers().unregister(id);
    kv.vmalloc().purge();
    release(&alloc, held);
    assert_no_leaks(&alloc);
}

#[test]
fn large_sizes_go_straight_to_vmalloc() {
    let _g = shared();
    let alloc = arena(32);
    let kv = Kvmalloc::new(&alloc).unwrap();
    let max = PAGE_SIZE << MAX_ORDER;
    let b = kv.kvmalloc(max, Gfp::KERNEL, KvPolicy::FailFast).unwrap();
    assert_eq!(b.kind(), KvKind::Contiguous { order: MAX_ORDER });
    for policy in KvPolicy::ALL {
        let mut v = kv.kvmalloc(max + 1, Gfp::KERNEL, policy).unwrap();
        assert!(!v.is_contiguous());
        assert_eq!(v.len(), max + 1);
        v.as_mut_slice()[max] = 3;
        let s = kv.stats(policy);
        assert_eq!(s.vmalloc_direct, 1, "{policy:?}");
    }
    assert_eq!(kv.stats(KvPolicy::Legacy).contiguous_attempts, 0);
    // One page: a single order-0 allocation either way.
    let one = kv.kvmalloc(1, Gfp::KERNEL, KvPolicy::Legacy).unwrap();
    assert_eq!(one.kind(), KvKind::Contiguous { order: 0 });
    drop((b, one));
    kv.vmalloc().purge();
    assert_no_leaks(&alloc);
}

#[test]
fn zero_and_absurd_sizes_give_clear_errors() {
    let _g = shared();
    let alloc = arena(8);
    let vm = Vmalloc::new(&alloc).unwrap();
    let kv = Kvmalloc::with_vmalloc(vm.clone());
    let e = vm.vmalloc(0, Gfp::KERNEL).unwrap_err().to_string();
    assert!(e.contains("zero bytes"), "{e}");
    let e = kv
        .kvmalloc(0, Gfp::KERNEL, KvPolicy::FailFast)
        .unwrap_err()
        .to_string();
    assert!(e.contains("zero bytes"), "{e}");
    for size in [(8 << 20) + 1, usize::MAX] {
        let e = vm.vmalloc(size, Gfp::KERNEL).unwrap_err().to_string();
        assert!(e.contains("larger than the whole arena"), "{e}");
        let e = kv
            .kvmalloc(size, Gfp::KERNEL, KvPolicy::Legacy)
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than the whole arena"), "{e}");
    }
    let e = Vmalloc::with_config(
        &alloc,
        VmallocConfig {
            max_maps: Some(1),
            ..VmallocConfig::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("max_maps"), "{e}");
    assert_eq!(vm.stats().failures, 3);
    assert_eq!(kv.stats(KvPolicy::Legacy).failures, 2);
    assert_no_leaks(&alloc);
}

#[test]
fn threads_share_a_vmalloc_and_its_cache() {
    let _g = shared();
    let alloc = arena(64);
    let vm = Vmalloc::new(&alloc).unwrap();
    thread::scope(|s| {
        for t in 0..4u8 {
            let vm = vm.clone();
            let alloc = &alloc;
            s.spawn(move || {
                for i in 0..40usize {
                    let pages = 1 + (i * 7 + t as usize) % 48;
                    let mut b = vm.vmalloc(pages * PAGE_SIZE, Gfp::KERNEL).unwrap();
                    check_aliasing(alloc, &mut b, t);
                }
                alloc.flush_thread_cache();
            });
        }
    });
    assert!(vm.stats().cache_hits > 0);
    vm.purge();
    assert_no_leaks(&alloc);
}
