//! Random operation sequences against a model of what the test holds.
//!
//! Invariants: no frame is handed out twice, every block is aligned to its
//! order, the allocator's in-use count equals what the test holds (the test
//! is single-threaded, so the allocator is quiet between operations), and
//! freeing everything restores the largest blocks.

use iopages::{Gfp, HugePages, Page, PageAllocator, PageAllocatorBuilder, MAX_ORDER};
use proptest::prelude::*;
use proptest::sample::Index;

const ARENA_BYTES: u64 = 8 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        order: u32,
    },
    Free {
        which: Index,
    },
    BulkArray {
        len: usize,
        prefill: usize,
        seed: u64,
    },
    BulkList {
        nr: usize,
    },
    BulkFree {
        nr: usize,
    },
    DrainAll,
    FlushThreadCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..=MAX_ORDER).prop_map(|order| Op::Alloc { order }),
        3 => (0u32..=3).prop_map(|order| Op::Alloc { order }),
        7 => any::<Index>().prop_map(|which| Op::Free { which }),
        3 => (0usize..300, 0usize..20, any::<u64>()).prop_map(|(len, prefill, seed)| Op::BulkArray { len, prefill, seed }),
        2 => (0usize..200).prop_map(|nr| Op::BulkList { nr }),
        3 => (0usize..300).prop_map(|nr| Op::BulkFree { nr }),
        1 => Just(Op::DrainAll),
        1 => Just(Op::FlushThreadCache),
    ]
}

/// What the test holds, frame by frame.
struct Model {
    held: Vec<(Page, u32)>,
    used: Vec<bool>,
    pages: usize,
}

impl Model {
    fn new(total: usize) -> Model {
        Model {
            held: Vec::new(),
            used: vec![false; total],
            pages: 0,
        }
    }

    fn take(&mut self, p: Page, order: u32) -> Result<(), TestCaseError> {
        prop_assert_eq!(
            p.pfn() % (1 << order),
            0,
            "order-{} block at pfn {} is not aligned",
            order,
            p.pfn()
        );
        let end = p.pfn() as usize + (1 << order);
        prop_assert!(
            end <= self.used.len(),
            "block {}/{} ends outside the arena",
            p.pfn(),
            order
        );
        for pfn in p.pfn() as usize..end {
            prop_assert!(!self.used[pfn], "frame {} handed out twice", pfn);
            self.used[pfn] = true;
        }
        self.held.push((p, order));
        self.pages += 1 << order;
        Ok(())
    }

    fn release(&mut self, i: usize) -> (Page, u32) {
        let (p, order) = self.held.swap_remove(i);
        for pfn in p.pfn() as usize..p.pfn() as usize + (1 << order) {
            self.used[pfn] = false;
        }
        self.pages -= 1 << order;
        (p, order)
    }
}

fn run(builder: PageAllocatorBuilder, ops: Vec<Op>) -> Result<(), TestCaseError> {
    // Background reclaim off: its thread drains the per-CPU lists on its
    // own schedule, and the exact accounting checked after every step
    // holds only for a quiet allocator.
    let alloc = builder
        .size_bytes(ARENA_BYTES)
        .huge_pages(HugePages::Never)
        .background_reclaim(false)
        .build()
        .expect("allocator");
    let total = alloc.accounting().total_pages;
    let mut m = Model::new(total);
    for op in ops {
        apply(&alloc, &mut m, op)?;
        check_accounting(&alloc, &m, total)?;
    }
    release_all_and_check(&alloc, &mut m, total)
}

/// Run one operation on the allocator and the model.
fn apply(alloc: &PageAllocator, m: &mut Model, op: Op) -> Result<(), TestCaseError> {
    match op {
        Op::Alloc { order } => {
            if let Some(p) = alloc.alloc_pages(Gfp::NOWAIT, order) {
                m.take(p, order)?;
            }
        }
        Op::Free { which } => {
            if !m.held.is_empty() {
                let (p, order) = m.release(which.index(m.held.len()));
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { alloc.free_pages(p, order) };
            }
        }
        Op::BulkArray { len, prefill, seed } => bulk_array(alloc, m, len, prefill, seed)?,
        Op::BulkList { nr } => {
            let mut list = Vec::new();
            let n = alloc.alloc_pages_bulk_list(Gfp::NOWAIT, nr, &mut list);
            prop_assert_eq!(n, list.len());
            prop_assert!(n <= nr);
            for p in list {
                m.take(p, 0)?;
            }
        }
        Op::BulkFree { nr } => bulk_free(alloc, m, nr),
        Op::DrainAll => alloc.drain_all(),
        Op::FlushThreadCache => alloc.flush_thread_cache(),
    }
    Ok(())
}

/// Fill an array of `len` slots in bulk, some pre-filled with order-0
/// pages the test holds (they stay the test's, the array only keeps
/// them): the count is the filled slots, and pre-filled slots are kept.
fn bulk_array(
    alloc: &PageAllocator,
    m: &mut Model,
    len: usize,
    prefill: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut slots = vec![None; len];
    let mut x = seed | 1;
    let mut pre = Vec::new();
    for &(p, order) in m.held.iter().filter(|h| h.1 == 0).take(prefill.min(len)) {
        debug_assert_eq!(order, 0);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % len as u64) as usize;
        if slots[i].is_none() {
            slots[i] = Some(p);
            pre.push((i, p));
        }
    }
    let n = alloc.alloc_pages_bulk_array(Gfp::NOWAIT, &mut slots);
    let filled = slots.iter().filter(|s| s.is_some()).count();
    prop_assert_eq!(n, filled, "count must equal the filled slots");
    for &(i, p) in &pre {
        prop_assert_eq!(slots[i], Some(p), "pre-filled slot {} changed", i);
    }
    for (i, s) in slots.iter().enumerate() {
        if let Some(p) = *s {
            if !pre.iter().any(|&(j, _)| j == i) {
                m.take(p, 0)?;
            }
        }
    }
    Ok(())
}

/// Free up to `nr` of the order-0 pages the test holds, in one bulk call.
fn bulk_free(alloc: &PageAllocator, m: &mut Model, nr: usize) {
    let mut pages = Vec::new();
    let mut i = 0;
    while i < m.held.len() && pages.len() < nr {
        if m.held[i].1 == 0 {
            pages.push(m.release(i).0);
        } else {
            i += 1;
        }
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.free_pages_bulk(&pages) };
}

/// The allocator's in-use count is what the test holds, and every page is
/// somewhere.
fn check_accounting(alloc: &PageAllocator, m: &Model, total: usize) -> Result<(), TestCaseError> {
    let a = alloc.accounting();
    prop_assert_eq!(
        a.in_use_pages,
        m.pages,
        "allocator and test disagree on pages in use: {}",
        a
    );
    prop_assert_eq!(
        a.buddy_free_pages + a.depot_pages + a.pcp_pages + a.thread_cache_pages + a.in_use_pages,
        total
    );
    Ok(())
}

/// Free everything the test holds: nothing leaked, and the largest blocks
/// are restored.
fn release_all_and_check(
    alloc: &PageAllocator,
    m: &mut Model,
    total: usize,
) -> Result<(), TestCaseError> {
    while let Some(&(p, order)) = m.held.last() {
        m.release(m.held.len() - 1);
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.free_pages(p, order) };
    }
    let a = alloc
        .leak_check()
        .map_err(|a| TestCaseError::fail(format!("leak: {a}")))?;
    prop_assert_eq!(a.buddy_free_pages, total);
    let s = alloc.stats();
    prop_assert_eq!(
        s.free_blocks_by_order[MAX_ORDER as usize],
        total / 1024,
        "largest blocks not restored:\n{}",
        s
    );
    Ok(())
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn invariants_hold_with_thread_caches_and_one_cpu(ops in ops()) {
        run(PageAllocator::builder().nr_cpus(1), ops)?;
    }

    #[test]
    fn invariants_hold_with_thread_caches_and_four_cpus(ops in ops()) {
        run(PageAllocator::builder().nr_cpus(4), ops)?;
    }

    #[test]
    fn invariants_hold_without_thread_caches_and_one_cpu(ops in ops()) {
        run(PageAllocator::builder().thread_cache_pages(0).nr_cpus(1), ops)?;
    }

    #[test]
    fn invariants_hold_without_thread_caches_and_four_cpus(ops in ops()) {
        run(PageAllocator::builder().thread_cache_pages(0).nr_cpus(4), ops)?;
    }

    #[test]
    fn invariants_hold_with_checks_off(ops in ops()) {
        run(PageAllocator::builder().checks(false).nr_cpus(2), ops)?;
    }
}
