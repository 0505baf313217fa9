//! Several threads allocating, tagging, passing and freeing blocks.
//!
//! Every block a thread receives gets a tag unique to that thread and that
//! block, written into its first and last 8 bytes. The tag is checked before
//! the block is freed (on the same thread or on the thread it was sent to),
//! so a block handed out to two owners at once is caught even with the
//! allocator's own checks off.

mod common;
use common::{assert_no_leaks, builder};
use iopages::{Gfp, Page, PageAllocator, PAGE_SIZE};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::thread;

const THREADS: usize = 4;
const ROUNDS: usize = 20_000;
const MAX_HELD: usize = 40;

/// A block in flight: where it is, its order and the tag it must carry.
#[derive(Clone, Copy, Debug)]
struct Block {
    page: Page,
    order: u32,
    tag: u64,
}

enum Msg {
    One(Block),
    /// Order-0 pages from a bulk allocation, to be bulk-freed.
    Bulk(Vec<Block>),
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn words(alloc: &PageAllocator, b: &Block) -> (*mut u64, *mut u64) {
    let base = alloc.page_address(b.page);
    let len = PAGE_SIZE << b.order;
    // SAFETY: both words lie inside the block, which lies in the arena.
    unsafe { (base.cast::<u64>(), base.add(len - 8).cast::<u64>()) }
}

fn tag(alloc: &PageAllocator, b: &Block) {
    let (first, last) = words(alloc, b);
    // SAFETY: the block was just handed to this thread.
    unsafe {
        first.write_volatile(b.tag);
        last.write_volatile(!b.tag);
    }
}

fn check(alloc: &PageAllocator, b: &Block) {
    let (first, last) = words(alloc, b);
    // SAFETY: the block is still allocated to the caller.
    let (f, l) = unsafe { (first.read_volatile(), last.read_volatile()) };
    assert_eq!(
        (f, l),
        (b.tag, !b.tag),
        "pfn {} order {}: tag overwritten, the block was handed out twice",
        b.page.pfn(),
        b.order
    );
}

#[derive(Default, Debug)]
struct Tally {
    allocs: u64,
    failures: u64,
    sent: u64,
    received: u64,
}

/// One thread of the ring: the blocks it holds, its random choices and
/// what it counted.
struct Worker {
    alloc: PageAllocator,
    id: usize,
    rng: Rng,
    held: Vec<Block>,
    seq: u64,
    t: Tally,
    tx: mpsc::Sender<Msg>,
}

fn worker(
    alloc: PageAllocator,
    id: usize,
    tx: mpsc::Sender<Msg>,
    rx: mpsc::Receiver<Msg>,
) -> Tally {
    let mut w = Worker {
        alloc,
        id,
        rng: Rng(0x9e37_79b9_7f4a_7c15 ^ ((id as u64 + 1) * 0x1234_5678_9abc_def1)),
        held: Vec::new(),
        seq: 0,
        t: Tally::default(),
        tx,
    };
    for _ in 0..ROUNDS {
        match w.rng.below(10) {
            0..=3 => w.alloc_one(),
            4..=5 => w.free_one(),
            6 => w.bulk_to_next(),
            7 => w.send_one(),
            _ => {
                for msg in rx.try_iter() {
                    w.receive(msg);
                }
            }
        }
        w.bound_and_spot_check();
    }
    w.free_held();
    let Worker {
        alloc, mut t, tx, ..
    } = w;
    drop(tx);
    // The ring ends when the previous thread has dropped its sender.
    for msg in rx.iter() {
        receive(&alloc, msg, &mut t);
    }
    t
}

/// Check and free a message from the previous thread.
fn receive(alloc: &PageAllocator, msg: Msg, t: &mut Tally) {
    match msg {
        Msg::One(b) => {
            check(alloc, &b);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages(b.page, b.order) };
            t.received += 1;
        }
        Msg::Bulk(blocks) => {
            for b in &blocks {
                check(alloc, b);
            }
            let pages: Vec<Page> = blocks.iter().map(|b| b.page).collect();
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.free_pages_bulk(&pages) };
            t.received += 1;
        }
    }
}

impl Worker {
    /// A tag no other block in the test carries.
    fn new_tag(&mut self) -> u64 {
        self.seq += 1;
        (self.id as u64) << 56 | self.seq
    }

    fn random_gfp(&mut self) -> Gfp {
        if self.rng.below(2) == 0 {
            Gfp::KERNEL
        } else {
            Gfp::NOWAIT
        }
    }

    fn receive(&mut self, msg: Msg) {
        receive(&self.alloc, msg, &mut self.t);
    }

    /// Allocate one aligned block of a random order, tag it and hold it.
    fn alloc_one(&mut self) {
        let order = self.rng.below(6) as u32;
        let gfp = self.random_gfp();
        match self.alloc.alloc_pages(gfp, order) {
            Some(page) => {
                assert_eq!(
                    page.pfn() % (1 << order),
                    0,
                    "unaligned order-{order} block"
                );
                let b = Block {
                    page,
                    order,
                    tag: self.new_tag(),
                };
                tag(&self.alloc, &b);
                self.held.push(b);
                self.t.allocs += 1;
            }
            None => self.t.failures += 1,
        }
    }

    /// Check and free a random held block here.
    fn free_one(&mut self) {
        if !self.held.is_empty() {
            let b = self
                .held
                .swap_remove(self.rng.below(self.held.len() as u64) as usize);
            check(&self.alloc, &b);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { self.alloc.free_pages(b.page, b.order) };
        }
    }

    /// Bulk allocation here (in one of the three forms), bulk free on the
    /// next thread.
    fn bulk_to_next(&mut self) {
        let mut pages = Vec::new();
        let nr = 1 + self.rng.below(48) as usize;
        let gfp = self.random_gfp();
        match self.rng.below(3) {
            0 => {
                self.alloc.alloc_pages_bulk_list(gfp, nr, &mut pages);
            }
            1 => {
                let mut slots = vec![None; nr];
                self.alloc.alloc_pages_bulk_array(gfp, &mut slots);
                pages.extend(slots.into_iter().flatten());
            }
            _ => {
                self.alloc.alloc_pages_bulk_cb(gfp, nr, |p| pages.push(p));
            }
        }
        let blocks: Vec<Block> = pages
            .into_iter()
            .map(|page| Block {
                page,
                order: 0,
                tag: self.new_tag(),
            })
            .collect();
        for b in &blocks {
            tag(&self.alloc, b);
        }
        self.t.allocs += blocks.len() as u64;
        if !blocks.is_empty() {
            self.tx.send(Msg::Bulk(blocks)).unwrap();
            self.t.sent += 1;
        }
    }

    /// A single held block freed on the next thread.
    fn send_one(&mut self) {
        if !self.held.is_empty() {
            let b = self
                .held
                .swap_remove(self.rng.below(self.held.len() as u64) as usize);
            self.tx.send(Msg::One(b)).unwrap();
            self.t.sent += 1;
        }
    }

    /// Keep the working set bounded so that the arena does not run dry,
    /// and check that a random held block still carries its tag while
    /// other threads churn.
    fn bound_and_spot_check(&mut self) {
        while self.held.len() > MAX_HELD {
            let b = self.held.swap_remove(0);
            check(&self.alloc, &b);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { self.alloc.free_pages(b.page, b.order) };
        }
        let at = self.rng.below(self.held.len().max(1) as u64) as usize;
        if let Some(b) = self.held.get(at) {
            check(&self.alloc, b);
        }
    }

    /// Check and free every block still held.
    fn free_held(&mut self) {
        for b in self.held.drain(..) {
            check(&self.alloc, &b);
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { self.alloc.free_pages(b.page, b.order) };
        }
    }
}

/// Run the workers on a ring of channels, join them, and check that nothing
/// leaked and every largest block came back.
fn stress(alloc: PageAllocator) {
    // Worker i sends on channel i and receives on channel i - 1: a ring.
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<Msg>()).unzip();
    let mut rxs: Vec<Option<mpsc::Receiver<Msg>>> = rxs.into_iter().map(Some).collect();
    let handles: Vec<_> = txs
        .into_iter()
        .enumerate()
        .map(|(i, tx)| {
            let rx = rxs[(i + THREADS - 1) % THREADS].take().unwrap();
            let a = alloc.clone();
            thread::Builder::new()
                .name(format!("stress-{i}"))
                .spawn(move || worker(a, i, tx, rx))
                .unwrap()
        })
        .collect();
    let tallies: Vec<Tally> = handles
        .into_iter()
        .map(|h| h.join().expect("worker panicked"))
        .collect();
    let sent: u64 = tallies.iter().map(|t| t.sent).sum();
    let received: u64 = tallies.iter().map(|t| t.received).sum();
    assert_eq!(
        sent, received,
        "every message sent must be received and freed"
    );
    assert!(sent > 0, "the test must pass blocks between threads");
    let allocs: u64 = tallies.iter().map(|t| t.allocs).sum();
    assert!(
        allocs > (THREADS * ROUNDS / 4) as u64,
        "too few allocations succeeded: {tallies:?}"
    );
    // The workers' thread caches were flushed when they exited.
    assert_eq!(
        alloc.accounting().thread_cache_pages,
        0,
        "exited threads left cached pages"
    );
    assert_no_leaks(&alloc);
}

#[test]
fn threads_never_share_a_block_with_checks_on() {
    stress(builder(16).checks(true).build().unwrap());
}

#[test]
fn threads_never_share_a_block_with_checks_off() {
    stress(builder(16).checks(false).build().unwrap());
}

#[test]
fn threads_never_share_a_block_without_thread_caches_on_one_cpu_set() {
    // One per-CPU set for all threads: its lock is often busy, so the zone
    // fallback paths run too.
    stress(
        builder(16)
            .thread_cache_pages(0)
            .nr_cpus(1)
            .checks(true)
            .build()
            .unwrap(),
    );
}

#[test]
fn threads_never_share_a_block_in_a_tight_arena() {
    // 4 MiB for four threads: allocations fail and the slow path drains.
    stress(builder(4).nr_cpus(2).build().unwrap());
}

#[test]
fn pages_bulk_allocated_on_one_thread_are_bulk_freed_on_another() {
    let alloc = builder(8).build().unwrap();
    let (tx, rx) = mpsc::channel::<Vec<Page>>();
    let producer = {
        let a = alloc.clone();
        thread::spawn(move || {
            let mut n = 0;
            for i in 0..200 {
                let mut pages = Vec::new();
                a.alloc_pages_bulk_list(Gfp::KERNEL, 1 + i % 64, &mut pages);
                for &p in &pages {
                    // SAFETY: allocated to this thread.
                    unsafe {
                        a.page_address(p)
                            .cast::<u64>()
                            .write(u64::from(p.pfn()) | 1 << 40)
                    };
                }
                n += pages.len();
                tx.send(pages).unwrap();
            }
            n
        })
    };
    let consumer = {
        let a = alloc.clone();
        thread::spawn(move || {
            let mut n = 0;
            for pages in rx {
                for &p in &pages {
                    // SAFETY: the producer gave this page to this thread.
                    let v = unsafe { a.page_address(p).cast::<u64>().read() };
                    assert_eq!(v, u64::from(p.pfn()) | 1 << 40);
                }
                n += pages.len();
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_pages_bulk(&pages) };
            }
            n
        })
    };
    let made = producer.join().unwrap();
    let freed = consumer.join().unwrap();
    assert_eq!(made, freed);
    assert!(made > 1000);
    assert_no_leaks(&alloc);
}

#[test]
fn a_live_threads_cached_pages_are_not_in_use_and_come_back_at_exit() {
    // One per-CPU set: the default limits then give each thread cache 64 pages.
    let alloc = builder(8).nr_cpus(1).build().unwrap();
    let ready = Arc::new(Barrier::new(2));
    let go = Arc::new(Barrier::new(2));
    let h = {
        let (a, ready, go) = (alloc.clone(), ready.clone(), go.clone());
        thread::spawn(move || {
            let pages: Vec<Page> = (0..20)
                .map(|_| a.alloc_pages(Gfp::KERNEL, 0).unwrap())
                .collect();
            for p in pages {
                // SAFETY: the test allocated these pages and gives them up here, once.
                unsafe { a.free_pages(p, 0) };
            }
            ready.wait();
            go.wait();
        })
    };
    ready.wait();
    let a = alloc.accounting();
    assert!(
        a.thread_cache_pages >= 20,
        "the other thread's cache should hold its pages: {a}"
    );
    assert_eq!(a.in_use_pages, 0, "cached pages are free, not in use: {a}");
    // leak_check does not need the other thread's cache flushed.
    assert!(alloc.leak_check().is_ok());
    go.wait();
    h.join().unwrap();
    let a = alloc.accounting();
    assert_eq!(
        a.thread_cache_pages, 0,
        "thread exit must flush its cache: {a}"
    );
    assert_no_leaks(&alloc);
}
