//! E1's Rust row alone, for comparing builds side by side (`bench bulk`
//! is the measurement; this is a probe).
//!
//! `cargo run --release -p iopages-bench --example e1_row -- rows BATCHES ARENAS [PAGES]`:
//! E1's loop (`peers::iopages_st_fresh`, batch 0 = single pages) on
//! ARENAS fresh arenas, the median ns per page of each batch.
//!
//! `cargo run --release -p iopages-bench --example e1_row -- io [RUNS]`:
//! E1's I/O-shaped row alone (`iopages_bench::io_shaped::run`, 4 M pages
//! per batch and run) on a fresh 64 MiB arena.
//!
//! `cargo run --release -p iopages-bench --example e1_row -- chain [lag]`:
//! the single-page loop (alloc, first byte written, free) 20 M times, ns
//! per page; with `lag`, each round frees the page of the round before,
//! which breaks the chain from one free's store to the next allocation's
//! load.
use iopages::{Gfp, LocalAllocator, Page, PageAllocator};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("rows") if args.len() >= 3 => rows(&args[1..]),
        Some("chain") => chain(args.get(1).map(String::as_str) == Some("lag")),
        Some("io") => io(args
            .get(1)
            .map_or(3, |s| s.parse().expect("RUNS: a number"))),
        _ => {
            eprintln!(
                "usage: e1_row rows BATCHES ARENAS [PAGES] | e1_row io [RUNS] | e1_row chain [lag]"
            );
            std::process::exit(2);
        }
    }
}

fn rows(args: &[String]) {
    let batches: Vec<usize> = args[0]
        .split(',')
        .map(|s| s.parse().expect("BATCHES: numbers, comma-separated"))
        .collect();
    let arenas: usize = args[1].parse().expect("ARENAS: a number");
    let pages: u64 = args.get(2).map_or(4_000_000, |s| s.parse().expect("PAGES"));
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); batches.len()];
    for _ in 0..arenas {
        let m = iopages_bench::peers::iopages_st_fresh(&batches, pages).expect("E1 loop");
        for (i, b) in batches.iter().enumerate() {
            ns[i].push(m[b]);
        }
    }
    let mut line = String::new();
    for (b, mut v) in batches.iter().zip(ns) {
        v.sort_by(f64::total_cmp);
        line += &format!("{b}:{:.2} ", v[v.len() / 2]);
    }
    println!("{}", line.trim_end());
}

/// A fresh 64 MiB arena, populated, checks off (E1's).
fn arena() -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(64 << 20)
        .populate(true)
        .checks(false)
        .build()
        .expect("arena")
}

fn io(runs: usize) {
    let alloc = arena();
    iopages_bench::io_shaped::run(&alloc, runs, 4_000_000).expect("I/O-shaped row");
    alloc.leak_check().expect("no page leaked");
}

fn chain(lag: bool) {
    const ROUNDS: u64 = 20_000_000;
    let alloc = arena();
    let mut l = alloc.local();
    let touch = |p: Page| {
        // SAFETY: `p` is allocated to this thread and lies in the arena.
        unsafe { std::ptr::write_volatile(alloc.page_address(p), 1) }
    };
    let round = |l: &mut LocalAllocator, prev: Option<Page>| {
        let p = l.alloc_pages(Gfp::KERNEL, 0).expect("page");
        touch(p);
        // SAFETY: allocated here, given up once.
        unsafe { l.free_pages(prev.unwrap_or(p), 0) };
        prev.map(|_| p)
    };
    let mut prev = lag.then(|| l.alloc_pages(Gfp::KERNEL, 0).expect("page"));
    let t = Instant::now();
    for _ in 0..ROUNDS {
        prev = round(&mut l, prev);
    }
    let ns = t.elapsed().as_nanos() as f64 / ROUNDS as f64;
    if let Some(p) = prev {
        // SAFETY: the last page kept back, given up once.
        unsafe { l.free_pages(p, 0) };
    }
    println!("{ns:.2}");
}
