//! `mempool`: the cost per page of filling an I/O request from a mempool —
//! a loop of single allocations (dm-crypt before seed 000), one bulk call,
//! and the callback form that fills an I/O vector directly — from warm
//! lists and with the source failing so that the reserve serves.
//!
//! Owns: this workload, its table, JSON and plot. Must never: assert a
//! timing, or report a request that came back short (that is an error).
//!
//! Two page allocators run side by side: one with pages to spare (the pool
//! allocates from its source, the warm per-thread and per-CPU lists), one
//! whose arena a holder has taken completely (every source attempt fails
//! and the reserve serves). Every workload allocates a request of N pages
//! with [`Gfp::NOIO`] (what a block driver passes) and frees it the way it
//! was allocated; the figure is ns per page for the pair. Workloads run
//! interleaved run by run, after one untimed warm-up each.

use crate::measure::{time_once, tsc_ghz, Sample, Summary};
use crate::plot::{line_plot, Series};
use crate::{met, round2};
use crate::{progress, write_json, BenchError, BenchOptions};
use iopages::{Gfp, HugePages, Page, PageAllocator, PagePool};
use serde_json::{json, Map, Value};
use std::hint::black_box;
use std::time::Duration;

/// Pages per request: up to 256 (a 1 MiB I/O, the seed's case).
pub const REQUEST_PAGES: [usize; 5] = [1, 4, 16, 64, 256];
/// The request the summary and the target are about.
pub const HEADLINE_PAGES: usize = 256;
/// Target: the bulk call at least this many times faster per page than
/// the loop of single allocations, at 256 pages from warm lists.
pub const TARGET_BULK_SPEEDUP: f64 = 3.0;
/// The pool's reserve: one full request.
pub const MIN_NR: usize = 256;

/// How the request is filled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    /// `alloc` per page, `free` per page.
    Loop,
    /// `alloc_bulk` into a slot array, `free_bulk_slots`.
    Bulk,
    /// `alloc_bulk_cb` pushing into an I/O vector, `free_bulk`.
    Callback,
}

const METHODS: [(Method, &str, &str); 3] = [
    (Method::Loop, "loop", "loop of alloc"),
    (Method::Bulk, "bulk", "alloc_bulk"),
    (Method::Callback, "cb", "alloc_bulk_cb"),
];

struct Scenario {
    key: &'static str,
    name: &'static str,
    alloc: PageAllocator,
    pool: PagePool,
    /// Pages the holder took so that the source fails (empty when warm).
    hog: Vec<Page>,
}

/// One request of `pages` pages, `rounds` times; ns per page.
fn workload(pool: &PagePool, m: Method, pages: usize, rounds: u64) -> Result<Sample, BenchError> {
    let mut slots: Vec<Option<Page>> = vec![None; pages];
    let mut iov: Vec<Page> = Vec::with_capacity(pages);
    let mut short = false;
    let gfp = Gfp::NOIO;
    let s = time_once(rounds * pages as u64, || {
        for _ in 0..rounds {
            match m {
                Method::Loop => {
                    for slot in slots.iter_mut() {
                        *slot = pool.alloc(gfp);
                    }
                    black_box(&mut slots);
                    for slot in slots.iter_mut() {
                        match slot.take() {
                            Some(p) => pool.free(p),
                            None => short = true,
                        }
                    }
                }
                Method::Bulk => {
                    short |= pool.alloc_bulk(gfp, &mut slots) != pages;
                    black_box(&mut slots);
                    pool.free_bulk_slots(&mut slots);
                }
                Method::Callback => {
                    short |= pool.alloc_bulk_cb(gfp, pages, |p| iov.push(p)) != pages;
                    black_box(&mut iov);
                    pool.free_bulk(&mut iov);
                }
            }
        }
    });
    if short {
        return Err(BenchError::Workload(format!(
            "a blocking mempool request of {pages} pages came back short"
        )));
    }
    Ok(s)
}

fn scenarios() -> Result<Vec<Scenario>, BenchError> {
    let build = || {
        PageAllocator::builder()
            .size_bytes(64 << 20)
            .huge_pages(HugePages::Try)
            .populate(true)
            .checks(false)
            .build()
    };
    let warm = build()?;
    let dry = build()?;
    let warm_pool = PagePool::pages(&warm, 0, MIN_NR)?;
    let dry_pool = PagePool::pages(&dry, 0, MIN_NR)?;
    let gfp = Gfp::KERNEL | Gfp::MEMALLOC | Gfp::NORETRY | Gfp::NOWARN;
    let mut hog = Vec::with_capacity(dry.arena().nr_pages());
    while let Some(p) = dry.alloc_pages(gfp, 0) {
        hog.push(p);
    }
    if dry.stats().free_pages != 0 {
        return Err(BenchError::Workload(
            "could not take every page of the second arena".into(),
        ));
    }
    Ok(vec![
        Scenario {
            key: "warm",
            name: "warm lists",
            alloc: warm,
            pool: warm_pool,
            hog: Vec::new(),
        },
        Scenario {
            key: "reserve",
            name: "source failing, reserve serves",
            alloc: dry,
            pool: dry_pool,
            hog,
        },
    ])
}

/// Run the experiment and write its report. Returns the JSON report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, pages_per_run) = if opts.quick {
        (3, 1u64 << 19)
    } else {
        (7, 1u64 << 22)
    };
    progress(
        "mempool",
        format!(
            "{runs} runs of {pages_per_run} pages per workload; requests of {REQUEST_PAGES:?} pages; two scenarios"
        ),
    );
    let ghz = tsc_ghz(Duration::from_millis(200));
    let scen = scenarios()?;
    // samples[scenario][method][size]
    let mut samples: Vec<Vec<Vec<Vec<Sample>>>> =
        vec![vec![vec![Vec::new(); REQUEST_PAGES.len()]; METHODS.len()]; scen.len()];
    let rounds = |pages: usize, total: u64| (total / pages as u64).max(1);
    for s in &scen {
        for &(m, _, _) in &METHODS {
            for &n in &REQUEST_PAGES {
                workload(&s.pool, m, n, rounds(n, pages_per_run / 16))?;
            }
        }
    }
    for run in 0..runs {
        for &n in &REQUEST_PAGES {
            for (si, s) in scen.iter().enumerate() {
                for (mi, &(m, _, _)) in METHODS.iter().enumerate() {
                    let size_i = REQUEST_PAGES.iter().position(|&x| x == n).expect("a size");
                    samples[si][mi][size_i].push(workload(
                        &s.pool,
                        m,
                        n,
                        rounds(n, pages_per_run),
                    )?);
                }
            }
        }
        progress("mempool", format!("run {}/{runs} done", run + 1));
    }
    let stats: Vec<_> = scen.iter().map(|s| s.pool.stats()).collect();
    let keys: Vec<&str> = scen.iter().map(|s| s.key).collect();
    let backing = format!("{:?}", scen[0].alloc.arena().backing());
    let names: Vec<&str> = scen.iter().map(|s| s.name).collect();
    for s in scen {
        if s.pool.reserve_len() != MIN_NR {
            return Err(BenchError::Workload(format!(
                "{}: the reserve holds {} pages after the run, not {MIN_NR}",
                s.name,
                s.pool.reserve_len()
            )));
        }
        drop(s.pool);
        s.alloc.free_pages_bulk(&s.hog);
        if let Err(a) = s.alloc.leak_check() {
            return Err(BenchError::Workload(format!(
                "{}: pages leaked after the benchmark: {a}",
                s.name
            )));
        }
    }

    let sum: Vec<Vec<Vec<Summary>>> = samples
        .iter()
        .map(|per_m| {
            per_m
                .iter()
                .map(|per_n| per_n.iter().map(|v| Summary::of(v)).collect())
                .collect()
        })
        .collect();
    let head = REQUEST_PAGES
        .iter()
        .position(|&n| n == HEADLINE_PAGES)
        .expect("256 is a request size");
    let at = |si: usize, mi: usize| sum[si][mi][head].ns;
    let speedup = |si: usize| at(si, 0) / at(si, 1);
    print_table(&sum, &names, ghz, runs);
    println!(
        "target: alloc_bulk >= {TARGET_BULK_SPEEDUP}x faster per page than a loop of alloc at {HEADLINE_PAGES} pages, warm lists: {:.1}x ({}); with the reserve serving: {:.1}x",
        speedup(0),
        met(speedup(0) >= TARGET_BULK_SPEEDUP),
        speedup(1),
    );
    println!(
        "reserve use in the failing scenario: {} pages from the reserve, {} sleeps, {} failures",
        stats[1].reserve_allocs, stats[1].waits, stats[1].failures
    );

    let summary = json!({
        "request_pages": HEADLINE_PAGES,
        "loop_ns_per_page": round2(at(0, 0)),
        "bulk_ns_per_page": round2(at(0, 1)),
        "cb_ns_per_page": round2(at(0, 2)),
        "bulk_speedup": round2(speedup(0)),
        "cb_speedup": round2(at(0, 0) / at(0, 2)),
        "reserve_loop_ns_per_page": round2(at(1, 0)),
        "reserve_bulk_ns_per_page": round2(at(1, 1)),
        "reserve_cb_ns_per_page": round2(at(1, 2)),
        "reserve_bulk_speedup": round2(speedup(1)),
        "targets": {
            "bulk_speedup_min": TARGET_BULK_SPEEDUP,
            "bulk_speedup_met": speedup(0) >= TARGET_BULK_SPEEDUP,
            "reserve_bulk_speedup_met": speedup(1) >= TARGET_BULK_SPEEDUP,
        },
    });
    let detail: Map<String, Value> = keys
        .iter()
        .enumerate()
        .map(|(si, k)| {
            let per_method: Map<String, Value> = METHODS
                .iter()
                .enumerate()
                .map(|(mi, &(_, mk, _))| {
                    let per_size: Map<String, Value> = REQUEST_PAGES
                        .iter()
                        .enumerate()
                        .map(|(ni, n)| (n.to_string(), json!(sum[si][mi][ni])))
                        .collect();
                    (mk.to_string(), Value::Object(per_size))
                })
                .collect();
            (
                k.to_string(),
                json!({
                    "name": names[si],
                    "ns_per_page": per_method,
                    "pool_stats": {
                        "reserve_allocs": stats[si].reserve_allocs,
                        "reserve_frees": stats[si].reserve_frees,
                        "waits": stats[si].waits,
                        "failures": stats[si].failures,
                    },
                }),
            )
        })
        .collect();
    let report = json!({
        "experiment": "mempool",
        "machine": crate::machine(),
        "settings": {
            "quick": opts.quick,
            "runs": runs,
            "pages_per_run": pages_per_run,
            "arena_bytes": 64u64 << 20,
            "backing": backing,
            "min_nr": MIN_NR,
            "gfp": "NOIO",
            "tsc_ghz": round2(ghz),
            "unit": "ns per page, alloc + free, median of the runs (ns_min/ns_max: range)",
        },
        "summary": summary,
        "scenarios": detail,
        "seed_reference": {
            "seed": "000 (Yang Shi, mempool bulk page allocation for dm-crypt)",
            "dm_crypt_1mib_write_mib_per_s_per_page_vs_bulk": [1301, 1402],
        },
    });
    let (json_path, svg_path) = opts.paths("mempool");
    write_json(&json_path, &report)?;
    let series: Vec<Series> = (0..names.len())
        .flat_map(|si| {
            let (sum, names) = (&sum, &names);
            METHODS
                .iter()
                .enumerate()
                .map(move |(mi, &(_, _, mn))| Series {
                    label: format!("{mn}, {}", names[si]),
                    points: REQUEST_PAGES
                        .iter()
                        .enumerate()
                        .map(|(ni, &n)| (n as f64, sum[si][mi][ni].ns))
                        .collect(),
                })
        })
        .collect();
    line_plot(
        &svg_path,
        "mempool: alloc+free cost per page by request size",
        "pages per request",
        "ns per page",
        &series,
    )?;
    progress(
        "mempool",
        format!("wrote {} and {}", json_path.display(), svg_path.display()),
    );
    Ok(report)
}

fn print_table(sum: &[Vec<Vec<Summary>>], names: &[&str], ghz: f64, runs: usize) {
    println!(
        "mempool: alloc+free per page, one thread, GFP NOIO (median of {runs} runs, ns; TSC {ghz:.2} GHz)"
    );
    for (si, name) in names.iter().enumerate() {
        println!("{name}:");
        let mut head = format!("{:>6}", "pages");
        for &(_, _, mn) in &METHODS {
            head += &format!(" | {:>24}", mn);
        }
        head += &format!(" | {:>13}", "loop / bulk");
        println!("{head}");
        for (ni, n) in REQUEST_PAGES.iter().enumerate() {
            let mut row = format!("{n:>6}");
            for per_method in &sum[si] {
                let s = &per_method[ni];
                row += &format!(" | {:>7.2} ({:>6.2}-{:<6.2})", s.ns, s.ns_min, s.ns_max);
            }
            row += &format!(" | {:>12.1}x", sum[si][0][ni].ns / sum[si][1][ni].ns);
            println!("{row}");
        }
    }
}
