//! A tight alloc+free loop for profilers: `bulk_loop <batch> <rounds>`
//! (batch 0 = single-page API).
use iopages::{Gfp, PageAllocator};
use std::hint::black_box;

fn main() {
    let mut args = std::env::args().skip(1);
    let batch: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let rounds: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let alloc = PageAllocator::builder()
        .size_bytes(64 << 20)
        .checks(false)
        .build()
        .expect("arena");
    if batch == 0 {
        for _ in 0..rounds {
            let p = alloc.alloc_pages(Gfp::KERNEL, 0).expect("page");
            alloc.free_pages(black_box(p), 0);
        }
    } else {
        let mut slots = vec![None; batch];
        for _ in 0..rounds {
            assert_eq!(alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots), batch);
            black_box(&mut slots);
            alloc.free_pages_bulk_array(&mut slots);
        }
    }
    assert!(alloc.leak_check().is_ok());
}
