//! Helpers shared by the integration tests: an arena builder, the leak
//! check every test ends with, and the test shrinkers.
//!
//! Owns: the one definition of "nothing leaked" and the caches that tests
//! register with an allocator's shrinker list.
//! Must never: weaken a check in place — a weaker check gets its own name
//! that says what it checks.
#![allow(dead_code)]

use iopages::{HugePages, Page, PageAllocator, PageAllocatorBuilder, Shrinker, MAX_ORDER};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};

/// An allocator builder over a `mib` MiB arena of base pages.
pub fn builder(mib: u64) -> PageAllocatorBuilder {
    PageAllocator::builder()
        .size_bytes(mib << 20)
        .huge_pages(HugePages::Never)
}

/// Nothing is in use, every page is back in the zone's free lists, and
/// freeing everything merged them back into the largest blocks.
pub fn assert_no_leaks(alloc: &PageAllocator) {
    let a = alloc
        .leak_check()
        .unwrap_or_else(|a| panic!("pages leaked: {a}"));
    assert_eq!(
        a.buddy_free_pages, a.total_pages,
        "pages held outside the zone's free lists: {a}"
    );
    let s = alloc.stats();
    assert_eq!(
        s.free_blocks_by_order[MAX_ORDER as usize],
        a.total_pages >> MAX_ORDER,
        "largest blocks not restored:\n{s}"
    );
}

/// Free the order-0 pages in `held`, then [`assert_no_leaks`].
pub fn assert_no_leaks_after(alloc: &PageAllocator, held: &[Page]) {
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(held) };
    assert_no_leaks(alloc);
}

/// How a [`HoldingShrinker`] presents itself and gives its pages back.
#[derive(Clone, Copy, Default)]
pub struct Holding {
    /// Reclaim that may not start I/O must skip it.
    pub needs_io: bool,
    /// Reclaim that may not enter the filesystem must skip it.
    pub needs_fs: bool,
    /// Give the pages of one scan back in one bulk free (else one by one).
    pub free_in_bulk: bool,
}

/// A cache that holds order-0 pages of the allocator and gives them back,
/// newest first, when asked; it counts the scans.
pub struct HoldingShrinker {
    alloc: PageAllocator,
    pages: Mutex<Vec<Page>>,
    scans: AtomicUsize,
    how: Holding,
}

impl HoldingShrinker {
    /// A cache of `pages`, which the test allocated from `alloc`.
    pub fn new(alloc: &PageAllocator, pages: Vec<Page>, how: Holding) -> Arc<HoldingShrinker> {
        Arc::new(HoldingShrinker {
            alloc: alloc.clone(),
            pages: Mutex::new(pages),
            scans: AtomicUsize::new(0),
            how,
        })
    }
    /// Add `page` (allocated by the test from the same allocator).
    pub fn hold(&self, page: Page) {
        self.pages.lock().unwrap().push(page);
    }
    /// How many times reclaim scanned it.
    pub fn scans(&self) -> usize {
        self.scans.load(Relaxed)
    }
    /// Take back every page it still holds.
    pub fn take_all(&self) -> Vec<Page> {
        std::mem::take(&mut *self.pages.lock().unwrap())
    }
}

impl Shrinker for HoldingShrinker {
    fn name(&self) -> &str {
        "test-holding"
    }
    fn count_objects(&self) -> usize {
        self.pages.lock().unwrap().len()
    }
    fn scan_objects(&self, nr_to_scan: usize) -> usize {
        self.scans.fetch_add(1, Relaxed);
        let mut pages = self.pages.lock().unwrap();
        let n = nr_to_scan.min(pages.len());
        let at = pages.len() - n;
        let freed: Vec<Page> = pages.drain(at..).collect();
        drop(pages);
        if self.how.free_in_bulk {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { self.alloc.free_pages_bulk(&freed) };
        } else {
            for p in freed.into_iter().rev() {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { self.alloc.free_pages(p, 0) };
            }
        }
        n
    }
    fn needs_io(&self) -> bool {
        self.how.needs_io
    }
    fn needs_fs(&self) -> bool {
        self.how.needs_fs
    }
}

/// A cache that claims `claims` objects and never frees one. It counts its
/// scans, and the times reclaim counted it on the watched thread (every
/// thread when none is watched).
pub struct BarrenShrinker {
    claims: usize,
    watched: Option<ThreadId>,
    counts: AtomicUsize,
    scans: AtomicUsize,
}

impl BarrenShrinker {
    /// Claims one object, so that reclaim scans it and makes no progress.
    pub fn claiming_one() -> Arc<BarrenShrinker> {
        Self::new(1, None)
    }
    /// Holds nothing; records the reclaim runs made on this thread (which
    /// count it before they scan), not background reclaim's.
    pub fn watching_this_thread() -> Arc<BarrenShrinker> {
        Self::new(0, Some(thread::current().id()))
    }
    fn new(claims: usize, watched: Option<ThreadId>) -> Arc<BarrenShrinker> {
        Arc::new(BarrenShrinker {
            claims,
            watched,
            counts: AtomicUsize::new(0),
            scans: AtomicUsize::new(0),
        })
    }
    /// How many times reclaim counted it on the watched thread.
    pub fn counts(&self) -> usize {
        self.counts.load(Relaxed)
    }
    /// How many times reclaim scanned it.
    pub fn scans(&self) -> usize {
        self.scans.load(Relaxed)
    }
}

impl Shrinker for BarrenShrinker {
    fn name(&self) -> &str {
        "test-barren"
    }
    fn count_objects(&self) -> usize {
        let watched = match self.watched {
            Some(t) => t == thread::current().id(),
            None => true,
        };
        if watched {
            self.counts.fetch_add(1, Relaxed);
        }
        self.claims
    }
    fn scan_objects(&self, _nr_to_scan: usize) -> usize {
        self.scans.fetch_add(1, Relaxed);
        0
    }
}
