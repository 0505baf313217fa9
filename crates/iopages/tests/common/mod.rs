//! Helpers shared by the integration tests.
#![allow(dead_code)]

use iopages::{HugePages, PageAllocator, PageAllocatorBuilder, MAX_ORDER};

/// An allocator builder over a `mib` MiB arena of base pages.
pub fn builder(mib: u64) -> PageAllocatorBuilder {
    PageAllocator::builder()
        .size_bytes(mib << 20)
        .huge_pages(HugePages::Never)
}

/// Nothing is in use, and freeing everything restored the largest blocks.
pub fn assert_no_leaks(alloc: &PageAllocator) {
    let a = alloc
        .leak_check()
        .unwrap_or_else(|a| panic!("pages leaked: {a}"));
    let s = alloc.stats();
    assert_eq!(
        s.free_blocks_by_order[MAX_ORDER as usize],
        a.total_pages >> MAX_ORDER,
        "largest blocks not restored:\n{s}"
    );
}
