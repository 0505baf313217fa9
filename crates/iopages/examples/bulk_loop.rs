//! A tight alloc+free loop for profilers: `bulk_loop <batch> <rounds>
//! [local]` (batch 0 = single-page API). `local` runs the loop through a
//! `LocalAllocator` handle and writes the first byte of every page, as the
//! E1 peer workload does, so that instruction counts (callgrind, the
//! difference between two round counts) compare with the peer harness's.
use iopages::{Gfp, PageAllocator};
use std::hint::black_box;

fn main() {
    let mut args = std::env::args().skip(1);
    let batch: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let rounds: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let local = args.next().as_deref() == Some("local");
    let alloc = PageAllocator::builder()
        .size_bytes(64 << 20)
        .checks(false)
        .build()
        .expect("arena");
    let touch = |p: iopages::Page| {
        // SAFETY: the page is allocated to this thread and lies in the arena.
        unsafe { std::ptr::write_volatile(alloc.page_address(p), 1) }
    };
    if local {
        let mut h = alloc.local();
        let mut v = Vec::with_capacity(batch.max(1));
        for _ in 0..rounds {
            if batch == 0 {
                let p = h.alloc_pages(Gfp::KERNEL, 0).expect("page");
                touch(p);
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { h.free_pages(p, 0) };
            } else {
                assert_eq!(h.alloc_bulk(Gfp::KERNEL, batch, &mut v), batch);
                for &p in &v {
                    touch(p);
                }
                // SAFETY: the pages came from this allocator and are given up here, once.
                unsafe { h.free_bulk(&mut v) };
            }
        }
    } else if batch == 0 {
        for _ in 0..rounds {
            let p = alloc.alloc_pages(Gfp::KERNEL, 0).expect("page");
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(black_box(p), 0) };
        }
    } else {
        let mut slots = vec![None; batch];
        for _ in 0..rounds {
            assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), batch);
            black_box(&mut slots);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages_bulk_array(&mut slots) };
        }
    }
    assert!(alloc.leak_check().is_ok());
}
