//! Compaction, grouping by mobility and the movable, reclaimable page cache,
//! through the public API: fragment the arena with cache pages, make
//! high-order blocks by moving them, and check that data, pins and
//! accounting survive.

mod common;

use common::{assert_no_leaks, builder};
use iopages::{
    CompactResult, FaultConfig, Gfp, MigrateType, Page, PageAllocator, PageCache, PageCacheConfig,
    Watermarks, PAGEBLOCK_NR_PAGES, PAGE_SIZE,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

/// An allocator for deterministic tests: no background reclaim, and no
/// watermarks (so a cache can fill the whole arena), checks on.
fn quiet(mib: u64) -> PageAllocator {
    builder(mib)
        .background_reclaim(false)
        .checks(true)
        .watermarks(Watermarks {
            min: 0,
            low: 0,
            high: 0,
        })
        .build()
        .unwrap()
}

/// A cache without a shrinker (so that reclaim cannot make blocks behind
/// compaction's back).
fn cache_without_shrinker(alloc: &PageAllocator) -> PageCache {
    PageCache::with_config(
        alloc,
        PageCacheConfig {
            shrinker: false,
            ..PageCacheConfig::default()
        },
    )
    .unwrap()
}

/// The contents stored under `key` (version `v`): a pseudo-random stream.
fn contents(key: u64, v: u64) -> Box<[u8; PAGE_SIZE]> {
    let mut b = Box::new([0u8; PAGE_SIZE]);
    let mut x = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ v.rotate_left(32) ^ 0x2545_f491;
    for c in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    b[..8].copy_from_slice(&key.to_le_bytes());
    b[8..16].copy_from_slice(&v.to_le_bytes());
    b
}

fn checksum(b: &[u8; PAGE_SIZE]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Fill the arena with cache pages, then drop every cache page on an even
/// frame: every free block is a single frame. Returns each key's checksum.
fn fill_and_fragment(alloc: &PageAllocator, cache: &PageCache) -> HashMap<u64, u64> {
    let mut sums = HashMap::new();
    let mut key = 0u64;
    loop {
        let data = contents(key, 0);
        if cache.insert(key, &data).is_err() {
            break;
        }
        sums.insert(key, checksum(&data));
        key += 1;
    }
    assert!(key as usize >= alloc.stats().total_pages - 64, "filled");
    for k in cache.keys() {
        if cache.page_of(k).unwrap().pfn() % 2 == 0 {
            assert!(cache.remove(k));
            sums.remove(&k);
        }
    }
    let free = alloc.stats().free_blocks_by_order;
    assert_eq!(free[1..], [0; 10], "only single free frames: {free:?}");
    sums
}

fn verify(cache: &PageCache, sums: &HashMap<u64, u64>) {
    let mut buf = [0u8; PAGE_SIZE];
    assert_eq!(cache.len(), sums.len());
    for (&k, &sum) in sums {
        assert!(cache.get(k, &mut buf), "key {k} lost");
        assert_eq!(checksum(&buf), sum, "key {k} corrupted");
    }
}

#[test]
fn high_order_allocations_succeed_through_compaction_orders_4_to_9() {
    for order in 4..=9u32 {
        let alloc = quiet(16);
        let cache = cache_without_shrinker(&alloc);
        let sums = fill_and_fragment(&alloc, &cache);
        let before = alloc.stats();
        let page = alloc
            .alloc_pages(Gfp::KERNEL, order)
            .unwrap_or_else(|| panic!("order {order} after compaction:\n{}", alloc.stats()));
        let s = alloc.stats();
        assert_eq!(s.compact_calls - before.compact_calls, 1);
        assert_eq!(s.compact_success - before.compact_success, 1);
        let moved = s.compact_migrated - before.compact_migrated;
        // Half of one 2^order chunk is cache pages: exactly those move.
        assert_eq!(moved, 1 << (order - 1), "order {order}");
        assert_eq!(cache.stats().migrated, moved);
        assert_eq!(s.compact_migrate_failed, 0);
        eprintln!(
            "order {order}: {moved} pages migrated, {} frames scanned, {} free frames scanned, {} us",
            s.compact_migrate_scanned,
            s.compact_free_scanned,
            s.compact_ns / 1000
        );
        verify(&cache, &sums);
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(page, order) };
        drop(cache);
        assert_no_leaks(&alloc);
    }
}

#[test]
fn direct_compaction_call_makes_blocks_and_keeps_data() {
    let alloc = quiet(16);
    let cache = cache_without_shrinker(&alloc);
    let sums = fill_and_fragment(&alloc, &cache);
    let frames_before: HashMap<u64, u32> = sums
        .keys()
        .map(|&k| (k, cache.page_of(k).unwrap().pfn()))
        .collect();
    assert_eq!(alloc.compact(9), CompactResult::Success);
    assert!(
        alloc.stats().free_blocks_by_order[9..]
            .iter()
            .sum::<usize>()
            > 0
    );
    let moved = frames_before
        .iter()
        .filter(|(&k, &pfn)| cache.page_of(k).unwrap().pfn() != pfn)
        .count();
    assert_eq!(moved, 256);
    assert_eq!(alloc.stats().compact_migrated, 256);
    // Moved pages stay in movable pageblocks and are still the cache's.
    for &k in sums.keys() {
        let p = cache.page_of(k).unwrap();
        assert_eq!(alloc.pageblock_migratetype(p), MigrateType::Movable);
        assert_eq!(alloc.movable_owners().owner_of(p), Some(cache.owner_id()));
    }
    verify(&cache, &sums);
    // A second call finds the block there already and moves nothing.
    assert_eq!(alloc.compact(9), CompactResult::Success);
    assert_eq!(alloc.stats().compact_migrated, 256);
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn pinned_frames_never_move() {
    let alloc = quiet(16);
    let cache = cache_without_shrinker(&alloc);
    let sums = fill_and_fragment(&alloc, &cache);
    // Pin one cache page in every pageblock: no pageblock can be emptied.
    let mut pinned: HashMap<u64, Page> = HashMap::new();
    let mut blocks = HashSet::new();
    let mut keys: Vec<u64> = sums.keys().copied().collect();
    keys.sort_unstable();
    for &k in &keys {
        let p = cache.page_of(k).unwrap();
        if blocks.insert(p.pfn() as usize / PAGEBLOCK_NR_PAGES) {
            alloc.pin_folio(alloc.page_folio(p), 1);
            pinned.insert(k, p);
        }
    }
    assert_eq!(pinned.len(), alloc.stats().total_pages / PAGEBLOCK_NR_PAGES);
    assert_eq!(alloc.compact(9), CompactResult::Failed);
    assert_eq!(
        alloc.stats().compact_migrated,
        0,
        "pinned chunks are skipped whole"
    );
    // Smaller blocks can be made around them; the pinned pages stay.
    for order in [4, 6, 8] {
        assert_eq!(
            alloc.compact(order),
            CompactResult::Success,
            "order {order}"
        );
        let b = alloc.alloc_pages(Gfp::KERNEL, order).unwrap();
        for p in pinned.values() {
            let pfn = p.pfn();
            assert!(!(b.pfn()..b.pfn() + (1 << order)).contains(&pfn));
        }
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(b, order) };
    }
    assert!(alloc.stats().compact_migrated > 0);
    for (&k, &p) in &pinned {
        assert_eq!(cache.page_of(k), Some(p), "pinned key {k} moved");
    }
    verify(&cache, &sums);
    for p in pinned.values() {
        alloc.unpin_folio(alloc.page_folio(*p), 1);
    }
    assert_eq!(
        alloc.compact(9),
        CompactResult::Success,
        "unpinned, they move"
    );
    verify(&cache, &sums);
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn unmovable_pages_in_every_pageblock_make_compaction_fail_cleanly() {
    let alloc = quiet(16);
    let cache = cache_without_shrinker(&alloc);
    let mut sums = HashMap::new();
    let mut key = 0;
    loop {
        let data = contents(key, 0);
        if cache.insert(key, &data).is_err() {
            break;
        }
        sums.insert(key, checksum(&data));
        key += 1;
    }
    // Swap one cache page per pageblock (at offset 5) for an unmovable page.
    let nr_blocks = alloc.stats().total_pages / PAGEBLOCK_NR_PAGES;
    for k in cache.keys() {
        if cache.page_of(k).unwrap().pfn() as usize % PAGEBLOCK_NR_PAGES == 5 {
            cache.remove(k);
            sums.remove(&k);
        }
    }
    let mut unmovable = Vec::new();
    while let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, 0) {
        unmovable.push(p);
    }
    assert_eq!(unmovable.len(), nr_blocks);
    let blocks: HashSet<usize> = unmovable
        .iter()
        .map(|p| p.pfn() as usize / PAGEBLOCK_NR_PAGES)
        .collect();
    assert_eq!(blocks.len(), nr_blocks, "one in every pageblock");
    for k in cache.keys() {
        if cache.page_of(k).unwrap().pfn() % 2 == 0 {
            cache.remove(k);
            sums.remove(&k);
        }
    }
    let before = alloc.stats();
    assert_eq!(alloc.compact(9), CompactResult::Failed);
    assert!(alloc.alloc_pages(Gfp::KERNEL | Gfp::NOWARN, 9).is_none());
    let s = alloc.stats();
    assert_eq!(
        s.compact_migrated, 0,
        "no chunk could be emptied, none was touched"
    );
    assert_eq!(
        s.free_pages, before.free_pages,
        "free scanner's frames returned"
    );
    assert!(s.compact_fail >= 2);
    verify(&cache, &sums);
    // Blocks that fit between the unmovable pages can still be made.
    assert_eq!(alloc.compact(8), CompactResult::Success);
    verify(&cache, &sums);
    for p in unmovable {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn nothing_movable_means_compaction_is_skipped() {
    let alloc = quiet(8);
    let mut held = Vec::new();
    while let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, 0) {
        held.push(p);
    }
    for p in held.iter().filter(|p| p.pfn() % 2 == 0) {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(*p, 0) };
    }
    assert_eq!(alloc.compact(4), CompactResult::Skipped);
    assert_eq!(alloc.stats().compact_skipped, 1);
    for p in held.iter().filter(|p| p.pfn() % 2 == 1) {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(*p, 0) };
    }
    assert_no_leaks(&alloc);
}

#[test]
fn the_shrinker_drops_least_recently_used_pages_and_stops_when_enough_is_freed() {
    let alloc = quiet(8);
    let cache = PageCache::new(&alloc).unwrap();
    for k in 0..100 {
        cache.insert(k, &contents(k, 0)).unwrap();
    }
    let mut buf = [0u8; PAGE_SIZE];
    assert!(cache.get(0, &mut buf));
    assert_eq!(alloc.shrinkers().shrink(Gfp::KERNEL, 30), 30);
    assert_eq!(cache.len(), 70);
    assert!(cache.contains(0), "recently used");
    assert!(
        (1..=30).all(|k| !cache.contains(k)),
        "the oldest went first"
    );
    assert!((31..100).all(|k| cache.contains(k)));
    assert_eq!(alloc.shrinkers().shrink(Gfp::KERNEL, 1000), 70);
    assert_eq!(alloc.shrinkers().shrink(Gfp::KERNEL, 10), 0);
    assert_eq!(cache.stats().reclaimed, 100);
    assert_eq!(alloc.stats().shrinker_pages_freed, 100);
    drop(cache);
    assert!(alloc.shrinkers().is_empty());
    assert_no_leaks(&alloc);
}

#[test]
fn allocations_under_pressure_reclaim_cache_pages() {
    let alloc = builder(8).background_reclaim(false).build().unwrap();
    let cache = PageCache::new(&alloc).unwrap();
    let mut k = 0;
    while cache.insert(k, &contents(k, 0)).is_ok() {
        k += 1;
    }
    let full = cache.len();
    assert!(full > 1800, "{full} cached");
    // Unmovable allocations now need the cache's pages: direct reclaim.
    // The order-6 block needs more: reclaim rounds until compaction has
    // enough free pages to work with (above the min watermark), then
    // compaction.
    let mut held = Vec::new();
    for _ in 0..400 {
        held.push(
            alloc
                .alloc_pages(Gfp::KERNEL, 0)
                .expect("reclaim frees cache pages"),
        );
    }
    let order6 = alloc
        .alloc_pages(Gfp::KERNEL | Gfp::RETRY_MAYFAIL, 6)
        .unwrap_or_else(|| panic!("reclaim and compaction:\n{}", alloc.stats()));
    let s = alloc.stats();
    assert!(s.compact_calls >= 1, "{s}");
    // The zone had only its reserve (the min watermark) left: almost all
    // of the 464 pages came from the cache.
    assert!(s.shrinker_pages_freed >= 400, "{s}");
    assert!(cache.len() <= full - 400);
    let mut buf = [0u8; PAGE_SIZE];
    for key in cache.keys() {
        assert!(cache.get(key, &mut buf));
        assert!(buf == *contents(key, 0), "key {key}");
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages(order6, 6) };
    for p in held {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, 0) };
    }
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn movable_and_unmovable_allocations_land_in_their_own_pageblocks() {
    let alloc = builder(16).background_reclaim(false).build().unwrap();
    let cache = PageCache::new(&alloc).unwrap();
    for k in 0..1500 {
        cache.insert(k, &contents(k, 0)).unwrap();
    }
    let mut unmovable = Vec::new();
    for _ in 0..1000 {
        unmovable.push((alloc.alloc_pages(Gfp::KERNEL, 0).unwrap(), 0));
    }
    for order in 1..=4 {
        for _ in 0..8 {
            unmovable.push((alloc.alloc_pages(Gfp::KERNEL, order).unwrap(), order));
        }
    }
    let mut slots = vec![None; 200];
    assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), 200);
    let movable_blocks: HashSet<usize> = cache
        .keys()
        .into_iter()
        .map(|k| {
            let p = cache.page_of(k).unwrap();
            assert_eq!(alloc.pageblock_migratetype(p), MigrateType::Movable);
            p.pfn() as usize / PAGEBLOCK_NR_PAGES
        })
        .collect();
    let unmovable_blocks: HashSet<usize> = unmovable
        .iter()
        .map(|(p, _)| *p)
        .chain(slots.iter().flatten().copied())
        .map(|p| {
            assert_eq!(alloc.pageblock_migratetype(p), MigrateType::Unmovable);
            p.pfn() as usize / PAGEBLOCK_NR_PAGES
        })
        .collect();
    assert!(
        movable_blocks.is_disjoint(&unmovable_blocks),
        "no pageblock mixes the two: {movable_blocks:?} {unmovable_blocks:?}"
    );
    let (u, m) = alloc.pageblocks_by_type();
    assert_eq!(u + m, 8);
    assert!(u >= 2 && m >= 3, "({u}, {m})");
    for (p, o) in unmovable {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, o) };
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk_array(&mut slots) };
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn injected_faults_in_cache_inserts_return_errors_and_corrupt_nothing() {
    let alloc = quiet(8);
    let cache = cache_without_shrinker(&alloc);
    alloc.fault().enable(FaultConfig {
        probability_ppm: 300_000,
        seed: 7,
        ..FaultConfig::default()
    });
    let mut stored = HashMap::new();
    let mut failed = 0;
    for k in 0..500 {
        let data = contents(k, 1);
        match cache.insert(k, &data) {
            Ok(()) => {
                stored.insert(k, checksum(&data));
            }
            Err(iopages::Error::NoMemory(_)) => failed += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    alloc.fault().disable();
    assert!(failed > 50 && failed < 250, "{failed} failures at 30 %");
    assert_eq!(cache.stats().insert_failures, failed);
    for k in 0..500 {
        assert_eq!(cache.contains(k), stored.contains_key(&k));
    }
    verify(&cache, &stored);
    drop(cache);
    assert_no_leaks(&alloc);
}

#[test]
fn injected_faults_in_compaction_targets_skip_migrations_and_corrupt_nothing() {
    let alloc = quiet(16);
    let cache = cache_without_shrinker(&alloc);
    let sums = fill_and_fragment(&alloc, &cache);
    alloc.fault().enable(FaultConfig {
        interval: 3,
        seed: 11,
        ..FaultConfig::default()
    });
    let r = alloc.compact(7);
    alloc.fault().disable();
    let s = alloc.stats();
    assert!(s.fault_injected > 0);
    assert!(s.compact_migrate_failed > 0, "{s}");
    // Every third target fails: no 64-page chunk can be emptied.
    assert_eq!(r, CompactResult::Failed);
    verify(&cache, &sums);
    for p in sums.keys().map(|&k| cache.page_of(k).unwrap()) {
        assert_eq!(alloc.movable_owners().owner_of(p), Some(cache.owner_id()));
    }
    // Without faults the same request succeeds.
    assert_eq!(alloc.compact(7), CompactResult::Success);
    verify(&cache, &sums);
    // Sometimes-failing targets: some chunks make it, data stays intact.
    alloc.fault().enable(FaultConfig {
        probability_ppm: 20_000,
        seed: 3,
        ..FaultConfig::default()
    });
    let _ = alloc.compact(9);
    alloc.fault().disable();
    verify(&cache, &sums);
    drop(cache);
    assert_no_leaks(&alloc);
}

/// Half the arena as cache pages on odd frames only; returns their keys,
/// sorted.
fn fill_odd_frames(cache: &PageCache) -> Vec<u64> {
    let mut k = 0;
    while cache.insert(k, &contents(k, 0)).is_ok() {
        k += 1;
    }
    for key in cache.keys() {
        if cache.page_of(key).unwrap().pfn() % 2 == 0 {
            cache.remove(key);
        }
    }
    let mut v = cache.keys();
    v.sort_unstable();
    v
}

/// A worker's traffic on its keys until `stop` (and at least 3 rounds):
/// every live key reads back its last version; now and then a key is
/// rewritten or removed. Returns each key's final version (`u64::MAX`:
/// removed).
fn cache_traffic(cache: &PageCache, mine: &[u64], stop: &AtomicBool) -> HashMap<u64, u64> {
    let mut buf = [0u8; PAGE_SIZE];
    let mut version: HashMap<u64, u64> = mine.iter().map(|&k| (k, 0)).collect();
    let mut round = 0u64;
    while !stop.load(Relaxed) || round < 3 {
        round += 1;
        for (i, &k) in mine.iter().enumerate() {
            let v = version[&k];
            if v != u64::MAX {
                assert!(cache.get(k, &mut buf), "key {k} lost");
                assert!(buf == *contents(k, v), "key {k} version {v} corrupted");
            }
            match (i as u64 + round) % 16 {
                0 => {
                    let nv = round;
                    if cache.insert(k, &contents(k, nv)).is_ok() {
                        version.insert(k, nv);
                    }
                }
                1 if v != u64::MAX => {
                    assert!(cache.remove(k));
                    version.insert(k, u64::MAX);
                }
                _ => {}
            }
        }
    }
    version
}

/// One round: compact and take every block made until compaction fails,
/// give the blocks back, and fragment the arena again with filler keys
/// (from `*filler` on) on even frames. Records each compaction's result.
fn compact_and_refragment(
    alloc: &PageAllocator,
    cache: &PageCache,
    filler: &mut u64,
    results: &mut Vec<CompactResult>,
) {
    let mut blocks = Vec::new();
    for i in 0.. {
        let order = 3 + i % 4;
        let r = alloc.compact(order);
        results.push(r);
        if r != CompactResult::Success {
            break;
        }
        match alloc.alloc_pages(Gfp::NOWAIT, order) {
            Some(b) => blocks.push((b, order)),
            None => break,
        }
    }
    for (b, order) in blocks {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(b, order) };
    }
    alloc.drain_all();
    let first = *filler;
    while cache.insert(*filler, &contents(*filler, 0)).is_ok() {
        *filler += 1;
    }
    for key in first..*filler {
        if cache.page_of(key).is_some_and(|p| p.pfn() % 2 == 0) {
            cache.remove(key);
        }
    }
}

#[test]
fn concurrent_cache_traffic_during_compaction_keeps_every_page_intact() {
    let alloc = quiet(16);
    let cache = Arc::new(cache_without_shrinker(&alloc));
    let keys = fill_odd_frames(&cache);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let cache = Arc::clone(&cache);
            let stop = Arc::clone(&stop);
            let mine: Vec<u64> = keys.iter().copied().skip(t).step_by(2).collect();
            std::thread::spawn(move || cache_traffic(&cache, &mine, &stop))
        })
        .collect();
    // Every round moves pages while the workers use them.
    let mut results = Vec::new();
    let mut filler = 1u64 << 40;
    for _round in 0..6 {
        compact_and_refragment(&alloc, &cache, &mut filler, &mut results);
    }
    stop.store(true, Relaxed);
    let mut final_versions = HashMap::new();
    for w in workers {
        final_versions.extend(w.join().unwrap());
    }
    let s = alloc.stats();
    eprintln!(
        "{} compactions ({} succeeded), {} pages migrated, {} not",
        results.len(),
        s.compact_success,
        s.compact_migrated,
        s.compact_migrate_failed,
    );
    assert!(results.contains(&CompactResult::Success));
    assert!(s.compact_migrated > 1000);
    let mut buf = [0u8; PAGE_SIZE];
    for (k, v) in final_versions {
        if v == u64::MAX {
            assert!(!cache.contains(k));
        } else {
            assert!(cache.get(k, &mut buf));
            assert!(buf == *contents(k, v), "key {k}");
        }
    }
    drop(Arc::try_unwrap(cache).ok().expect("workers are gone"));
    assert_no_leaks(&alloc);
}
