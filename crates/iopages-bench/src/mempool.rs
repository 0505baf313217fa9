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

use crate::harness::{run_interleaved, summarise, Experiment, Plot, PlotFile, Report, Table};
use crate::measure::{time_once, tsc_ghz, Sample, Summary};
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages::{Gfp, HugePages, Page, PageAllocator, PagePool};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
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
                            // SAFETY: the page came from this pool this
                            // round and is given up here, once.
                            Some(p) => unsafe { pool.free_raw(p) },
                            None => short = true,
                        }
                    }
                }
                Method::Bulk => {
                    short |= pool.alloc_bulk(gfp, &mut slots) != pages;
                    black_box(&mut slots);
                    // SAFETY: as above, for every page in `slots`.
                    unsafe { pool.free_bulk_slots_raw(&mut slots) };
                }
                Method::Callback => {
                    short |= pool.alloc_bulk_cb(gfp, pages, |p| iov.push(p)) != pages;
                    black_box(&mut iov);
                    // SAFETY: as above, for every page in `iov`.
                    unsafe { pool.free_bulk_raw(&mut iov) };
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

/// One configuration: (request size index, scenario, method index).
type Config = (usize, usize, usize);

/// The mempool measurement: every request size, scenario and method.
struct Mempool {
    scen: Vec<Scenario>,
    configs: Vec<Config>,
    pages_per_run: u64,
}

/// Rounds of `pages`-page requests that make `total` pages (at least one).
fn rounds(pages: usize, total: u64) -> u64 {
    (total / pages as u64).max(1)
}

impl Experiment for Mempool {
    type Config = Config;

    fn name(&self) -> &'static str {
        "mempool"
    }

    fn configs(&self) -> &[Config] {
        &self.configs
    }

    fn warm_up(&mut self, c: usize) -> Result<(), BenchError> {
        let (ni, si, mi) = self.configs[c];
        let n = REQUEST_PAGES[ni];
        workload(
            &self.scen[si].pool,
            METHODS[mi].0,
            n,
            rounds(n, self.pages_per_run / 16),
        )
        .map(|_| ())
    }

    fn measure(&mut self, c: usize) -> Result<Sample, BenchError> {
        let (ni, si, mi) = self.configs[c];
        let n = REQUEST_PAGES[ni];
        workload(
            &self.scen[si].pool,
            METHODS[mi].0,
            n,
            rounds(n, self.pages_per_run),
        )
    }
}

/// Check the reserve is full again, give back the hog's pages and check
/// nothing leaked.
fn tear_down(scen: Vec<Scenario>) -> Result<(), BenchError> {
    for s in scen {
        if s.pool.reserve_len() != MIN_NR {
            return Err(BenchError::Workload(format!(
                "{}: the reserve holds {} pages after the run, not {MIN_NR}",
                s.name,
                s.pool.reserve_len()
            )));
        }
        drop(s.pool);
        // SAFETY: the hog pages were allocated by this run and nothing
        // else holds them.
        unsafe { s.alloc.free_pages_bulk(&s.hog) };
        if let Err(a) = s.alloc.leak_check() {
            return Err(BenchError::Workload(format!(
                "{}: pages leaked after the benchmark: {a}",
                s.name
            )));
        }
    }
    Ok(())
}

/// How the experiment ran.
#[derive(Serialize)]
struct Settings {
    quick: bool,
    runs: usize,
    pages_per_run: u64,
    arena_bytes: u64,
    backing: String,
    min_nr: usize,
    gfp: &'static str,
    tsc_ghz: f64,
    unit: &'static str,
}

/// The headline figures, at [`HEADLINE_PAGES`].
#[derive(Serialize)]
struct Headline {
    request_pages: usize,
    loop_ns_per_page: f64,
    bulk_ns_per_page: f64,
    cb_ns_per_page: f64,
    bulk_speedup: f64,
    cb_speedup: f64,
    reserve_loop_ns_per_page: f64,
    reserve_bulk_ns_per_page: f64,
    reserve_cb_ns_per_page: f64,
    reserve_bulk_speedup: f64,
    targets: Targets,
}

#[derive(Serialize)]
struct Targets {
    bulk_speedup_min: f64,
    bulk_speedup_met: bool,
    reserve_bulk_speedup_met: bool,
}

/// The mempool's counters after the runs.
#[derive(Clone, Copy, Serialize)]
struct PoolStats {
    reserve_allocs: u64,
    reserve_frees: u64,
    waits: u64,
    failures: u64,
}

/// One scenario's figures: method → request size → summary.
#[derive(Serialize)]
struct ScenarioReport {
    name: &'static str,
    ns_per_page: BTreeMap<&'static str, BTreeMap<String, Summary>>,
    pool_stats: PoolStats,
}

#[derive(Serialize)]
struct SeedReference {
    seed: &'static str,
    dm_crypt_1mib_write_mib_per_s_per_page_vs_bulk: [u32; 2],
}

#[derive(Serialize)]
struct Body {
    summary: Headline,
    scenarios: BTreeMap<&'static str, ScenarioReport>,
    seed_reference: SeedReference,
}

/// Each scenario's pool counters, for the report.
fn pool_stats(scen: &[Scenario]) -> Vec<PoolStats> {
    scen.iter()
        .map(|s| {
            let st = s.pool.stats();
            PoolStats {
                reserve_allocs: st.reserve_allocs,
                reserve_frees: st.reserve_frees,
                waits: st.waits,
                failures: st.failures,
            }
        })
        .collect()
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
    let configs = (0..REQUEST_PAGES.len())
        .flat_map(|ni| {
            (0..scen.len()).flat_map(move |si| (0..METHODS.len()).map(move |mi| (ni, si, mi)))
        })
        .collect();
    let mut exp = Mempool {
        scen,
        configs,
        pages_per_run,
    };
    let samples = run_interleaved(&mut exp, runs)?;
    let Mempool { scen, configs, .. } = exp;
    // sum[scenario][method][size]
    let mut sum = vec![vec![Vec::new(); METHODS.len()]; scen.len()];
    for (&(_, si, mi), s) in configs.iter().zip(summarise(&samples)) {
        sum[si][mi].push(s);
    }
    let stats = pool_stats(&scen);
    let backing = format!("{:?}", scen[0].alloc.arena().backing());
    let names: Vec<&'static str> = scen.iter().map(|s| s.name).collect();
    let keys: Vec<&'static str> = scen.iter().map(|s| s.key).collect();
    tear_down(scen)?;
    let f = Figures {
        sum,
        stats,
        names,
        keys,
    };
    print_table(&f, ghz, runs).print();
    let settings = Settings {
        quick: opts.quick,
        runs,
        pages_per_run,
        arena_bytes: 64u64 << 20,
        backing,
        min_nr: MIN_NR,
        gfp: "NOIO",
        tsc_ghz: round2(ghz),
        unit: "ns per page, alloc + free, median of the runs (ns_min/ns_max: range)",
    };
    let plot = Plot::lines(
        PlotFile::Main,
        "mempool: alloc+free cost per page by request size",
        "pages per request",
        "ns per page",
        series(&f),
    );
    Report::new("mempool", settings, body(f)).emit(opts, &[plot])
}

/// The summaries, `sum[scenario][method][size]`, and each scenario's
/// pool counters, name and report key.
struct Figures {
    sum: Vec<Vec<Vec<Summary>>>,
    stats: Vec<PoolStats>,
    names: Vec<&'static str>,
    keys: Vec<&'static str>,
}

impl Figures {
    /// Median ns per page of scenario `si`, method `mi`, at
    /// [`HEADLINE_PAGES`].
    fn at(&self, si: usize, mi: usize) -> f64 {
        let head = REQUEST_PAGES
            .iter()
            .position(|&n| n == HEADLINE_PAGES)
            .expect("256 is a request size");
        self.sum[si][mi][head].ns
    }
    /// Loop over bulk, scenario `si`.
    fn speedup(&self, si: usize) -> f64 {
        self.at(si, 0) / self.at(si, 1)
    }
}

fn body(f: Figures) -> Body {
    let (at, speedup) = (|si, mi| f.at(si, mi), |si| f.speedup(si));
    let summary = Headline {
        request_pages: HEADLINE_PAGES,
        loop_ns_per_page: round2(at(0, 0)),
        bulk_ns_per_page: round2(at(0, 1)),
        cb_ns_per_page: round2(at(0, 2)),
        bulk_speedup: round2(speedup(0)),
        cb_speedup: round2(at(0, 0) / at(0, 2)),
        reserve_loop_ns_per_page: round2(at(1, 0)),
        reserve_bulk_ns_per_page: round2(at(1, 1)),
        reserve_cb_ns_per_page: round2(at(1, 2)),
        reserve_bulk_speedup: round2(speedup(1)),
        targets: Targets {
            bulk_speedup_min: TARGET_BULK_SPEEDUP,
            bulk_speedup_met: speedup(0) >= TARGET_BULK_SPEEDUP,
            reserve_bulk_speedup_met: speedup(1) >= TARGET_BULK_SPEEDUP,
        },
    };
    let ns_per_page = |si: usize| {
        METHODS
            .iter()
            .zip(&f.sum[si])
            .map(|(&(_, mk, _), per_n)| {
                let per_size = REQUEST_PAGES
                    .iter()
                    .map(|n| n.to_string())
                    .zip(per_n.iter().copied());
                (mk, per_size.collect())
            })
            .collect()
    };
    let scenarios = f
        .keys
        .iter()
        .enumerate()
        .map(|(si, &k)| {
            let r = ScenarioReport {
                name: f.names[si],
                ns_per_page: ns_per_page(si),
                pool_stats: f.stats[si],
            };
            (k, r)
        })
        .collect();
    Body {
        summary,
        scenarios,
        seed_reference: SeedReference {
            seed: "000 (Yang Shi, mempool bulk page allocation for dm-crypt)",
            dm_crypt_1mib_write_mib_per_s_per_page_vs_bulk: [1301, 1402],
        },
    }
}

/// ns per page by request size, one line per scenario and method.
fn series(f: &Figures) -> Vec<Series> {
    (0..f.names.len())
        .flat_map(|si| {
            METHODS
                .iter()
                .enumerate()
                .map(move |(mi, &(_, _, mn))| Series {
                    label: format!("{mn}, {}", f.names[si]),
                    points: REQUEST_PAGES
                        .iter()
                        .enumerate()
                        .map(|(ni, &n)| (n as f64, f.sum[si][mi][ni].ns))
                        .collect(),
                })
        })
        .collect()
}

fn print_table(f: &Figures, ghz: f64, runs: usize) -> Table {
    let (sum, names) = (&f.sum, &f.names);
    let mut t = Table::new(format!(
        "mempool: alloc+free per page, one thread, GFP NOIO (median of {runs} runs, ns; TSC {ghz:.2} GHz)"
    ));
    for (si, name) in names.iter().enumerate() {
        t.line(format!("{name}:"));
        let mut head = vec![format!("{:>6}", "pages")];
        head.extend(METHODS.iter().map(|&(_, _, mn)| format!("{mn:>24}")));
        head.push(format!("{:>13}", "loop / bulk"));
        t.row(head);
        for (ni, n) in REQUEST_PAGES.iter().enumerate() {
            let mut row = vec![format!("{n:>6}")];
            row.extend(sum[si].iter().map(|per_method| {
                let s = &per_method[ni];
                format!("{:>7.2} ({:>6.2}-{:<6.2})", s.ns, s.ns_min, s.ns_max)
            }));
            row.push(format!("{:>12.1}x", sum[si][0][ni].ns / sum[si][1][ni].ns));
            t.row(row);
        }
    }
    let stats = &f.stats[1];
    t.line(format!(
        "target: alloc_bulk >= {TARGET_BULK_SPEEDUP}x faster per page than a loop of alloc at {HEADLINE_PAGES} pages, warm lists: {:.1}x ({}); with the reserve serving: {:.1}x",
        f.speedup(0),
        met(f.speedup(0) >= TARGET_BULK_SPEEDUP),
        f.speedup(1),
    ));
    t.line(format!(
        "reserve use in the failing scenario: {} pages from the reserve, {} sleeps, {} failures",
        stats.reserve_allocs, stats.waits, stats.failures
    ));
    t
}
