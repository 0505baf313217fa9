//! E1 `bulk`: the cost of alloc+free per page, single-page API and bulk
//! batches, one thread, warm caches — the table of seed 004 (page_bench04).
//!
//! Two iopages configurations run interleaved in the same process: the
//! default (per-thread caches in front of the per-CPU lists) and per-CPU
//! lists only (`thread_cache_pages(0)`), so the thread cache's effect is
//! measured rather than assumed. The kernel's published figures are printed
//! beside them as a reference; they were measured on other machines.
//!
//! Then the peers (see `peers`): the same workloads with each page's first
//! byte written, one thread at every batch, and producer/consumer pairs
//! across threads (2, 4, 8, 16 by default, more threads than cores on
//! purpose) at the single-object API and batch 64. Each multi-thread point
//! has three figures — wall ns per page per pair, aggregate pages/s and CPU
//! ns per page — and a clock check. Must never: hide a failed clock check,
//! or assert a timing; targets are reported as met or not.

use crate::c_abi::CAbi;
use crate::harness::{Plot, PlotFile, Report};
use crate::measure::{median, time_once, tsc_ghz, Sample, Summary};
use crate::peers::{self, batch_key, PeerResult, PeerState, PEERS};
use crate::plot::Series;
use crate::{met, round2};
use crate::{progress, BenchError, BenchOptions};
use iopages::{Arena, Gfp, HugePages, PageAllocator};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Duration;

/// Batch sizes of the table.
pub const BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The seed's prototype bulk allocator (2017): (batch, cycles, ns) per page.
pub const KERNEL_2017: [(usize, f64, f64); 9] = [
    (1, 128.0, 32.134),
    (2, 107.0, 26.783),
    (4, 95.0, 23.988),
    (8, 91.0, 22.823),
    (16, 88.0, 22.093),
    (32, 85.0, 21.338),
    (64, 85.0, 21.315),
    (128, 84.0, 21.214),
    (256, 115.0, 28.979),
];
/// The prototype's single-page cost: cycles, ns.
pub const KERNEL_2017_SINGLE: (f64, f64) = (158.0, 39.593);
/// The allocator as merged (2021, 3.6 GHz part): single cycles, and cycles
/// per page at 64 and 128.
pub const KERNEL_2021_SINGLE_CYCLES: f64 = 194.0;
/// (batch, cycles per page) published for the merged allocator.
pub const KERNEL_2021: [(usize, f64); 2] = [(64, 97.0), (128, 99.0)];

/// Batch sizes of the multi-thread part (0 = the single-object API).
pub const MT_BATCHES: [usize; 2] = [0, 64];
/// Thread counts of the multi-thread part unless `--threads` says: the
/// same on every machine, so more threads than cores where there are fewer
/// than 16 (the oversubscribed case is one the allocator must handle).
pub const DEFAULT_MT_THREADS: [usize; 4] = [2, 4, 8, 16];
/// Most threads one multi-thread point may have.
pub const MAX_MT_THREADS: usize = 1024;
/// Most thread counts in one run (the C harness reads at most 32).
pub const MAX_MT_THREAD_COUNTS: usize = 32;
/// Target: iopages at least this many times faster than the best peer at
/// every batch size.
pub const TARGET_MIN_RATIO: f64 = 1.3;
/// Target: iopages at least as fast as the best page-aligned peer at every
/// batch, one thread; the moonshot is [`MOONSHOT_MIN_RATIO_PAGE_ALIGNED`].
pub const TARGET_MIN_RATIO_PAGE_ALIGNED: f64 = 1.0;
/// Moonshot for the ratio vs the best page-aligned peer.
pub const MOONSHOT_MIN_RATIO_PAGE_ALIGNED: f64 = 1.3;
/// Target: the single-page API this many times faster than the best peer's
/// single-object API, one thread.
pub const TARGET_SINGLE_PAGE_RATIO: f64 = 1.3;
/// Target: one producer/consumer pair at least as fast as DPDK's mempool
/// with page-aligned buffers, single and batch 64.
pub const TARGET_CROSS_THREAD_VS_DPDK_ALIGNED: f64 = 1.0;
/// Target: aggregate pages/s at [`SCALING_TARGET_THREADS`] threads at
/// least this fraction of that at 2 threads, on a machine with fewer CPUs
/// than threads (oversubscribed: the total cannot grow, it must not fall).
pub const TARGET_AGGREGATE_SCALING: f64 = 0.8;
/// The thread count of the scaling target.
pub const SCALING_TARGET_THREADS: usize = 16;
/// The peer of the cross-thread target.
const DPDK_ALIGNED: &str = "dpdk-aligned";

/// Peers whose buffers are not page aligned (DPDK's default layout puts a
/// 64-byte header before each 4 KiB buffer and pads for memory channels).
const UNALIGNED_PEERS: [&str; 1] = ["dpdk"];

/// The runs of one point: ns per page (multi-thread: wall per page per
/// pair) and, multi-thread only, aggregate pages/s, CPU ns per page and how
/// many runs failed the clock check.
#[derive(Default)]
struct Samples {
    ns: Vec<f64>,
    pages_per_s: Vec<f64>,
    cpu_ns_per_page: Vec<f64>,
    clock_failed: usize,
}

/// Samples by allocator, then by (threads, batch): `None` threads is the
/// single-thread part; batch 0 the single-object API.
type Runs = BTreeMap<String, BTreeMap<(Option<usize>, usize), Samples>>;

/// Add one result of `who` to `runs`; a failed clock check is said aloud
/// at once (and kept, for the table and the JSON).
fn record(runs: &mut Runs, who: &str, r: &PeerResult, online: usize) {
    let s = runs
        .entry(who.to_string())
        .or_default()
        .entry((r.threads, r.batch))
        .or_default();
    s.ns.push(r.ns_per_page);
    let Some(mt) = r.mt else {
        return;
    };
    s.pages_per_s.push(mt.pages_per_s);
    s.cpu_ns_per_page.push(mt.cpu_ns_per_page);
    if !mt.clock_ok {
        s.clock_failed += 1;
        let t = r.threads.unwrap_or(0);
        progress(
            "bulk",
            format!(
                "WARNING: CLOCK CHECK FAILED: {who} at {t} threads, batch {}: the workers were busy {:.2} CPUs on average, more than min({t} threads, {online} CPUs online) allows (+10%); this point's interval is wrong",
                batch_key(r.batch),
                mt.busy_cpus()
            ),
        );
    }
}

/// The thread counts of the multi-thread part: `asked` (from `--threads`)
/// or [`DEFAULT_MT_THREADS`], sorted, each even (threads come in
/// producer/consumer pairs).
pub fn mt_threads(asked: Option<&[usize]>) -> Result<Vec<usize>, BenchError> {
    let mut v = asked.map_or_else(|| DEFAULT_MT_THREADS.to_vec(), <[usize]>::to_vec);
    let example = "for example `iopages bench bulk --threads 2,4,8,16`";
    if v.is_empty() {
        return Err(BenchError::Workload(format!(
            "--threads needs at least one thread count ({example})"
        )));
    }
    if let Some(&odd) = v.iter().find(|&&t| t % 2 == 1 || t == 0) {
        return Err(BenchError::Workload(format!(
            "bulk runs producer/consumer pairs, so every --threads count must be even and at least 2, not {odd} ({example})"
        )));
    }
    if let Some(&big) = v.iter().find(|&&t| t > MAX_MT_THREADS) {
        return Err(BenchError::Workload(format!(
            "--threads {big} is more than bulk runs ({MAX_MT_THREADS} at most)"
        )));
    }
    v.sort_unstable();
    v.dedup();
    if v.len() > MAX_MT_THREAD_COUNTS {
        return Err(BenchError::Workload(format!(
            "--threads gives {} thread counts; bulk runs at most {MAX_MT_THREAD_COUNTS}",
            v.len()
        )));
    }
    Ok(v)
}

/// Arena size for the iopages configurations: 64 MiB, or more where the
/// largest multi-thread point would otherwise run the arena dry (every ring
/// full, a batch in each worker's hands, and each thread's cache), with
/// room to spare for the per-CPU lists, the depot and the watermarks.
fn arena_bytes_for(max_threads: usize) -> u64 {
    const STEP: u64 = 64 << 20;
    let in_flight = peers::mt_pages_in_flight(max_threads, *MT_BATCHES.iter().max().unwrap_or(&1))
        + max_threads as u64 * 256;
    (2 * in_flight * 4096).div_ceil(STEP).max(1) * STEP
}

/// Medians of one multi-thread point over its runs.
#[derive(Clone, Copy, Debug)]
struct MtPoint {
    /// Wall ns per page per pair.
    ns: f64,
    /// Aggregate pages/s (all pairs).
    pages_per_s: f64,
    /// The workers' CPU ns per page.
    cpu_ns_per_page: f64,
    /// Runs that failed the clock check.
    clock_failed: usize,
    runs: usize,
}

impl MtPoint {
    fn clock(&self) -> &'static str {
        if self.clock_failed == 0 {
            "ok"
        } else {
            "failed"
        }
    }

    fn json(&self) -> Value {
        let mut m = json!({
            "ns_per_page_per_pair": round2(self.ns),
            "pages_per_s": self.pages_per_s.round(),
            "cpu_ns_per_page": round2(self.cpu_ns_per_page),
            "clock_check": self.clock(),
        });
        if self.clock_failed > 0 {
            m["clock_check_failed_runs"] = json!(format!("{} of {}", self.clock_failed, self.runs));
        }
        m
    }
}

/// Medians of iopages and the peers, and the ratios between them.
struct Comparison<'a> {
    runs: &'a Runs,
    states: &'a [(&'a str, PeerState)],
    st_batches: &'a [usize],
    mt_threads: &'a [usize],
    mt_pages: u64,
    online: usize,
}

/// `f` for each multi-thread batch, as {"single": x, "64": y} (null where
/// there is no figure).
fn per_mt_batch(f: impl Fn(usize) -> Option<f64>) -> Value {
    Value::Object(
        MT_BATCHES
            .iter()
            .map(|&b| (batch_key(b), json!(f(b).map(round2))))
            .collect(),
    )
}

impl<'a> Comparison<'a> {
    fn samples(&self, who: &str, threads: Option<usize>, batch: usize) -> Option<&'a Vec<f64>> {
        self.runs
            .get(who)?
            .get(&(threads, batch))
            .map(|s| &s.ns)
            .filter(|v| !v.is_empty())
    }

    fn get(&self, who: &str, threads: Option<usize>, batch: usize) -> Option<f64> {
        self.samples(who, threads, batch).map(|v| median(v))
    }

    fn range(&self, who: &str, threads: Option<usize>, batch: usize) -> Option<(f64, f64)> {
        let v = self.samples(who, threads, batch)?;
        Some((
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(0.0, f64::max),
        ))
    }

    /// The multi-thread point of `who`, medians of its runs.
    fn mt(&self, who: &str, threads: usize, batch: usize) -> Option<MtPoint> {
        let s = self.runs.get(who)?.get(&(Some(threads), batch))?;
        if s.ns.is_empty() || s.pages_per_s.is_empty() || s.cpu_ns_per_page.is_empty() {
            return None;
        }
        Some(MtPoint {
            ns: median(&s.ns),
            pages_per_s: median(&s.pages_per_s),
            cpu_ns_per_page: median(&s.cpu_ns_per_page),
            clock_failed: s.clock_failed,
            runs: s.ns.len(),
        })
    }

    fn ready_peers(&self) -> Vec<&'a str> {
        self.states
            .iter()
            .filter(|(n, s)| matches!(s, PeerState::Ready(_)) && self.runs.contains_key(*n))
            .map(|(n, _)| *n)
            .collect()
    }

    /// (best peer, its ns) at this point; `aligned_only` leaves out the
    /// peers whose buffers are not page aligned.
    fn best_of(
        &self,
        threads: Option<usize>,
        batch: usize,
        aligned_only: bool,
    ) -> Option<(&'a str, f64)> {
        self.ready_peers()
            .into_iter()
            .filter(|p| !aligned_only || !UNALIGNED_PEERS.contains(p))
            .filter_map(|p| self.get(p, threads, batch).map(|ns| (p, ns)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    fn best(&self, threads: Option<usize>, batch: usize) -> Option<(&'a str, f64)> {
        self.best_of(threads, batch, false)
    }

    /// How many times faster iopages is than the best peer at this point
    /// (chosen by its median): the median of each run's ratio, the two
    /// measured in the same run.
    fn ratio_of(&self, threads: Option<usize>, batch: usize, aligned_only: bool) -> Option<f64> {
        let (p, _) = self.best_of(threads, batch, aligned_only)?;
        self.ratio_vs(p, threads, batch)
    }

    fn ratio(&self, threads: Option<usize>, batch: usize) -> Option<f64> {
        self.ratio_of(threads, batch, false)
    }

    /// How many times faster iopages is than `peer` at this point: the
    /// median over runs of the peer's ns over iopages' in the same run.
    fn ratio_vs(&self, peer: &str, threads: Option<usize>, batch: usize) -> Option<f64> {
        crate::measure::per_run_ratio(
            self.samples(peer, threads, batch)?,
            self.samples("iopages", threads, batch)?,
        )
    }

    /// Cross-thread, one pair (2 threads): dpdk-aligned's wall ns per page
    /// per pair over iopages'.
    fn cross_thread_vs_dpdk_aligned(&self, batch: usize) -> Option<f64> {
        self.ratio_vs(DPDK_ALIGNED, Some(2), batch)
    }

    /// Aggregate pages/s of `who` at `threads` over that at 2 threads.
    fn scaling_at(&self, who: &str, threads: usize, batch: usize) -> Option<f64> {
        Some(self.mt(who, threads, batch)?.pages_per_s / self.mt(who, 2, batch)?.pages_per_s)
    }

    /// The same at the largest thread count of this run.
    fn scaling(&self, who: &str, batch: usize) -> Option<f64> {
        self.scaling_at(who, *self.mt_threads.last()?, batch)
    }

    fn min_ratio_of(&self, aligned_only: bool) -> Option<f64> {
        self.st_batches
            .iter()
            .filter_map(|&b| self.ratio_of(None, b, aligned_only))
            .min_by(f64::total_cmp)
    }

    fn min_ratio(&self) -> Option<f64> {
        self.min_ratio_of(false)
    }

    fn everyone(&self) -> Vec<&'a str> {
        let mut v = vec!["iopages"];
        v.extend(self.ready_peers());
        v
    }

    fn peers_json(&self) -> Value {
        let mut m = Map::new();
        for who in self.everyone() {
            let per: Map<String, Value> = self
                .st_batches
                .iter()
                .filter_map(|&b| {
                    self.get(who, None, b)
                        .map(|ns| (batch_key(b), json!(round2(ns))))
                })
                .collect();
            m.insert(who.to_string(), Value::Object(per));
        }
        for (name, st) in self.states {
            if let PeerState::Unavailable(why) = st {
                m.insert(name.to_string(), json!({ "unavailable": why }));
            }
        }
        Value::Object(m)
    }

    fn ratio_json(&self, aligned_only: bool) -> Value {
        Value::Object(
            self.st_batches
                .iter()
                .filter_map(|&b| {
                    self.ratio_of(None, b, aligned_only)
                        .map(|r| (batch_key(b), json!(round2(r))))
                })
                .collect(),
        )
    }

    /// Every multi-thread point: each allocator's three figures and clock
    /// check, and iopages' ratios.
    fn mt_json(&self) -> Value {
        let mut points = Map::new();
        for &t in self.mt_threads {
            let mut per_t = Map::new();
            for &b in &MT_BATCHES {
                let mut per_b = Map::new();
                for who in self.everyone() {
                    if let Some(p) = self.mt(who, t, b) {
                        per_b.insert(who.to_string(), p.json());
                    }
                }
                per_b.insert(
                    "ratio_vs_dpdk_aligned".into(),
                    json!(self.ratio_vs(DPDK_ALIGNED, Some(t), b).map(round2)),
                );
                per_b.insert(
                    "ratio_vs_best_peer".into(),
                    json!(self.ratio(Some(t), b).map(round2)),
                );
                per_b.insert(
                    "best_peer".into(),
                    json!(self.best(Some(t), b).map(|(p, _)| p)),
                );
                per_t.insert(batch_key(b), Value::Object(per_b));
            }
            points.insert(t.to_string(), Value::Object(per_t));
        }
        let failed: Vec<Value> = self
            .mt_failures()
            .into_iter()
            .map(|(who, t, b)| json!({ "allocator": who, "threads": t, "batch": batch_key(b) }))
            .collect();
        json!({
            "threads": self.mt_threads,
            "batches": MT_BATCHES.map(batch_key),
            "pages_per_pair": self.mt_pages,
            "online_cpus": self.online,
            "clock": "each worker's own CLOCK_MONOTONIC start (after the barrier) and end; interval = latest end - earliest start; CPU = the workers' CLOCK_THREAD_CPUTIME_ID over the same spans",
            "clock_check": format!("the workers' CPU time <= min(threads, online CPUs) x interval x {}", peers::CLOCK_SLACK),
            "clock_check_failed": failed,
            "points": points,
        })
    }

    /// (allocator, threads, batch) of every point whose clock check failed.
    fn mt_failures(&self) -> Vec<(&'a str, usize, usize)> {
        let mut v = Vec::new();
        for &t in self.mt_threads {
            for &b in &MT_BATCHES {
                for who in self.everyone() {
                    if self.mt(who, t, b).is_some_and(|p| p.clock_failed > 0) {
                        v.push((who, t, b));
                    }
                }
            }
        }
        v
    }

    /// `summary.targets` entries of the targets, each with its
    /// figure and whether it is met.
    fn targets_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let page_aligned = self.min_ratio_of(true);
        m.insert(
            "min_ratio_vs_best_page_aligned_peer".into(),
            json!({
                "what": "one thread, every batch: the best page-aligned peer's ns per page over iopages'",
                "min": TARGET_MIN_RATIO_PAGE_ALIGNED,
                "moonshot": MOONSHOT_MIN_RATIO_PAGE_ALIGNED,
                "figure": page_aligned.map(round2),
                "met": page_aligned.is_some_and(|r| r >= TARGET_MIN_RATIO_PAGE_ALIGNED),
                "moonshot_met": page_aligned.is_some_and(|r| r >= MOONSHOT_MIN_RATIO_PAGE_ALIGNED),
            }),
        );
        let single = self.ratio(None, 0);
        m.insert(
            "single_page_ratio_vs_best_peer".into(),
            json!({
                "what": "one thread, single-page API: the best peer's ns per page over iopages'",
                "min": TARGET_SINGLE_PAGE_RATIO,
                "figure": single.map(round2),
                "met": single.is_some_and(|r| r >= TARGET_SINGLE_PAGE_RATIO),
            }),
        );
        let mut cross = json!({
            "what": "one producer/consumer pair (2 threads): dpdk-aligned's wall ns per page per pair over iopages'",
            "min": TARGET_CROSS_THREAD_VS_DPDK_ALIGNED,
        });
        for &b in &MT_BATCHES {
            let r = self.cross_thread_vs_dpdk_aligned(b);
            cross[batch_key(b)] = json!({
                "figure": r.map(round2),
                "met": r.is_some_and(|r| r >= TARGET_CROSS_THREAD_VS_DPDK_ALIGNED),
            });
        }
        m.insert("cross_thread_vs_dpdk_aligned".into(), cross);
        let t = SCALING_TARGET_THREADS;
        let oversubscribed = self.online < t;
        let mut scaling = json!({
            "what": format!("iopages' aggregate pages/s at {t} threads over that at 2 threads, when the machine has fewer than {t} CPUs"),
            "threads": t,
            "min": TARGET_AGGREGATE_SCALING,
            "online_cpus": self.online,
            "oversubscribed": oversubscribed,
        });
        for &b in &MT_BATCHES {
            let r = self.scaling_at("iopages", t, b);
            // With 16 CPUs or more the target does not apply: met is null.
            let met = oversubscribed.then(|| r.is_some_and(|r| r >= TARGET_AGGREGATE_SCALING));
            scaling[batch_key(b)] = json!({ "figure": r.map(round2), "met": met });
        }
        m.insert("aggregate_scaling".into(), scaling);
        m
    }

    fn series(&self) -> Vec<Series> {
        self.everyone()
            .into_iter()
            .map(|who| Series {
                label: who.to_string(),
                points: self
                    .st_batches
                    .iter()
                    .filter(|&&b| b > 0)
                    .filter_map(|&b| self.get(who, None, b).map(|ns| (b as f64, ns)))
                    .collect(),
            })
            .collect()
    }

    fn print(&self, runs: usize) {
        let peers = self.ready_peers();
        println!();
        println!("E1 peers: alloc+free ns per page, first byte of each page written through an array of addresses in every row (median and range of {runs} runs; ratio: the best peer's ns over iopages', median of each run's)");
        let mut head = format!("{:>8} | {:>17}", "batch", "iopages");
        for p in &peers {
            head += &format!(" | {p:>17}");
        }
        head += &format!(" | {:>9} | {:>5}", "best peer", "ratio");
        println!("{head}");
        for &b in self.st_batches {
            let cell = |who: &str| match (self.get(who, None, b), self.range(who, None, b)) {
                (Some(ns), Some((lo, hi))) => {
                    format!(" | {ns:>7.2} {:>9}", format!("{lo:.1}-{hi:.1}"))
                }
                _ => format!(" | {:>17}", "-"),
            };
            let mut row = format!("{:>8}", batch_key(b));
            row += &cell("iopages");
            for p in &peers {
                row += &cell(p);
            }
            match (self.best(None, b), self.ratio(None, b)) {
                (Some((p, _)), Some(r)) => row += &format!(" | {p:>9} | {r:>5.2}"),
                _ => row += &format!(" | {:>9} | {:>5}", "-", "-"),
            }
            println!("{row}");
        }
        for (name, st) in self.states {
            if let PeerState::Unavailable(why) = st {
                println!("{name}: unavailable - {why}");
            }
        }
        if let Some(r) = self.min_ratio_of(true) {
            println!(
                "against page-aligned peers only (all but DPDK's default layout): min ratio {r:.2}"
            );
        }
        match self.min_ratio() {
            Some(r) => println!(
                "target: iopages >= {TARGET_MIN_RATIO}x faster than the best peer at every batch: min ratio {r:.2} ({})",
                met(r >= TARGET_MIN_RATIO)
            ),
            None => println!("target: no peer ran, so there is no ratio (NOT met)"),
        }
        self.print_mt(runs);
        self.print_targets();
    }

    fn print_mt(&self, runs: usize) {
        println!();
        println!(
            "E1 multi-thread: producer/consumer pairs (allocated on one thread, freed on another), {} pages per pair, {} CPUs online (median of {runs} runs)",
            self.mt_pages, self.online
        );
        println!("each worker times itself: wall = latest end - earliest start; CPU = the workers' own CPU time; ratio = that allocator's wall ns over iopages' (median of each run's)");
        println!(
            "{:>7} {:>6}  {:<12} {:>17} {:>9} {:>11} {:>6} {:>9}",
            "threads",
            "batch",
            "allocator",
            "wall ns/page/pair",
            "Mpages/s",
            "CPU ns/page",
            "clock",
            "ratio"
        );
        for &t in self.mt_threads {
            for &b in &MT_BATCHES {
                self.print_mt_point(t, b);
            }
        }
        self.print_mt_checks();
    }

    /// The multi-thread table's rows at `t` threads and batch `b`, and the
    /// ratios where any peer ran there.
    fn print_mt_point(&self, t: usize, b: usize) {
        {
            {
                let mut first = true;
                for who in self.everyone() {
                    let Some(p) = self.mt(who, t, b) else {
                        continue;
                    };
                    let (tc, bc) = if first {
                        (t.to_string(), batch_key(b))
                    } else {
                        (String::new(), String::new())
                    };
                    first = false;
                    let ratio = if who == "iopages" {
                        String::new()
                    } else {
                        self.ratio_vs(who, Some(t), b)
                            .map_or_else(|| "-".into(), |r| format!("{r:.2}"))
                    };
                    let clock = if p.clock_failed > 0 { "FAILED" } else { "ok" };
                    let row = format!(
                        "{tc:>7} {bc:>6}  {who:<12} {:>17.2} {:>9.2} {:>11.2} {clock:>6} {ratio:>9}",
                        p.ns,
                        p.pages_per_s / 1e6,
                        p.cpu_ns_per_page
                    );
                    println!("{}", row.trim_end());
                }
                // The ratios, where any peer ran at this point.
                if self.best(Some(t), b).is_none() {
                    return;
                }
                let vs_dpdk = self
                    .ratio_vs(DPDK_ALIGNED, Some(t), b)
                    .map_or_else(|| "- (did not run)".into(), |r| format!("{r:.2}"));
                let vs_best = match (self.best(Some(t), b), self.ratio(Some(t), b)) {
                    (Some((p, _)), Some(r)) => format!("{r:.2} ({p})"),
                    _ => "- (no peer ran)".into(),
                };
                println!(
                    "{:>16}iopages vs dpdk-aligned {vs_dpdk}, vs best peer {vs_best}",
                    ""
                );
            }
        }
    }

    /// The multi-thread part's clock check and aggregate scaling.
    fn print_mt_checks(&self) {
        let failed = self.mt_failures();
        if failed.is_empty() {
            println!(
                "clock check: every point's CPU time fits min(threads, {} CPUs) x interval (+10%)",
                self.online
            );
        } else {
            println!("!!! CLOCK CHECK FAILED at {} point(s): the workers' CPU time exceeds min(threads, {} CPUs) x interval (+10%), so those intervals are wrong:", failed.len(), self.online);
            for (who, t, b) in failed {
                println!("!!!   {who} at {t} threads, batch {}", batch_key(b));
            }
        }
        let scaling = |who: &str| {
            MT_BATCHES
                .iter()
                .map(|&b| {
                    let r = self
                        .scaling(who, b)
                        .map_or_else(|| "-".into(), |r| format!("{r:.2}"));
                    format!("{} {r}", batch_key(b))
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(&top) = self.mt_threads.last() {
            println!("aggregate scaling, pages/s at {top} threads over 2 threads:");
            for who in self.everyone() {
                println!("  {who:<12} {}", scaling(who));
            }
        }
    }

    fn print_targets(&self) {
        let fig = |r: Option<f64>| r.map_or_else(|| "-".into(), |r| format!("{r:.2}"));
        println!();
        println!("issue targets (timings are reported, never asserted):");
        let pa = self.min_ratio_of(true);
        println!(
            "  min ratio vs best page-aligned peer, one thread, every batch >= {TARGET_MIN_RATIO_PAGE_ALIGNED:.1} (moonshot {MOONSHOT_MIN_RATIO_PAGE_ALIGNED:.1}): {} ({}; moonshot {})",
            fig(pa),
            met(pa.is_some_and(|r| r >= TARGET_MIN_RATIO_PAGE_ALIGNED)),
            met(pa.is_some_and(|r| r >= MOONSHOT_MIN_RATIO_PAGE_ALIGNED))
        );
        let single = self.ratio(None, 0);
        println!(
            "  single-page API vs best peer, one thread >= {TARGET_SINGLE_PAGE_RATIO:.1}: {} ({})",
            fig(single),
            met(single.is_some_and(|r| r >= TARGET_SINGLE_PAGE_RATIO))
        );
        let cross: Vec<String> = MT_BATCHES
            .iter()
            .map(|&b| {
                let r = self.cross_thread_vs_dpdk_aligned(b);
                format!(
                    "{} {} ({})",
                    batch_key(b),
                    fig(r),
                    met(r.is_some_and(|r| r >= TARGET_CROSS_THREAD_VS_DPDK_ALIGNED))
                )
            })
            .collect();
        println!(
            "  cross-thread, one pair, vs dpdk-aligned >= {TARGET_CROSS_THREAD_VS_DPDK_ALIGNED:.1}: {}",
            cross.join(", ")
        );
        let t = SCALING_TARGET_THREADS;
        let scaling: Vec<String> = MT_BATCHES
            .iter()
            .map(|&b| {
                let r = self.scaling_at("iopages", t, b);
                let verdict = if self.online < t {
                    met(r.is_some_and(|r| r >= TARGET_AGGREGATE_SCALING))
                } else {
                    "does not apply"
                };
                format!("{} {} ({verdict})", batch_key(b), fig(r))
            })
            .collect();
        let how = if self.online < t {
            format!("oversubscribed: {} CPUs", self.online)
        } else {
            format!("{} CPUs, not oversubscribed", self.online)
        };
        println!(
            "  aggregate scaling, iopages' pages/s at {t} threads over 2 threads >= {TARGET_AGGREGATE_SCALING:.1} ({how}): {}",
            scaling.join(", ")
        );
    }
}

/// Targets of this experiment, in TSC cycles.
pub const TARGET_SINGLE_CYCLES: f64 = 60.0;
/// Bulk target at batch 64, cycles per page.
pub const TARGET_BULK64_CYCLES: f64 = 6.0;

struct Config {
    name: &'static str,
    key: &'static str,
    alloc: PageAllocator,
}

/// One configuration's results: single-page and per batch.
struct Results {
    single: Vec<Sample>,
    bulk: Vec<Vec<Sample>>,
}

fn single(alloc: &PageAllocator, ops: u64) -> Result<Sample, BenchError> {
    let mut failed = false;
    let s = time_once(ops, || {
        for _ in 0..ops {
            match alloc.alloc_pages(Gfp::KERNEL, 0) {
                // SAFETY: `p` was just allocated here and nothing else holds it.
                Some(p) => unsafe { alloc.free_pages(black_box(p), 0) },
                None => failed = true,
            }
        }
    });
    if failed {
        return Err(BenchError::Workload(
            "single-page allocation failed in a warm arena".into(),
        ));
    }
    Ok(s)
}

fn bulk(alloc: &PageAllocator, batch: usize, pages: u64) -> Result<Sample, BenchError> {
    let rounds = (pages / batch as u64).max(1);
    let mut slots = vec![None; batch];
    let mut short = false;
    let s = time_once(rounds * batch as u64, || {
        for _ in 0..rounds {
            let n = alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots);
            short |= n != batch;
            black_box(&mut slots);
            // SAFETY: the slots hold pages just allocated here, each once.
            unsafe { alloc.free_pages_bulk_array(&mut slots) };
        }
    });
    if short {
        return Err(BenchError::Workload(format!(
            "bulk allocation of {batch} came back short"
        )));
    }
    Ok(s)
}

/// Run E1 with the default thread counts and write its report. Returns the
/// JSON report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    run_with_threads(opts, None)
}

/// The peer comparison's sizes: the same workloads with each page's
/// first byte written, in-process for iopages (one-thread rows on a new
/// arena each run) and one process per peer per run.
struct PeerPlan {
    /// Pages per single-thread workload.
    peer_pages: u64,
    /// Pages per pair: every pair moves the same number, so a point with
    /// more threads does proportionally more work.
    mt_pages: u64,
    /// 0 (the single-object API), then [`BATCHES`].
    st_batches: Vec<usize>,
    mt_threads: Vec<usize>,
    online: usize,
}

impl PeerPlan {
    /// The plan of a run with `opts` and `mt_threads`.
    fn of(opts: &BenchOptions, mt_threads: Vec<usize>) -> PeerPlan {
        PeerPlan {
            peer_pages: if opts.quick { 64 << 10 } else { 512 << 10 },
            mt_pages: if opts.quick { 32 << 10 } else { 1 << 20 },
            st_batches: std::iter::once(0).chain(BATCHES).collect(),
            mt_threads,
            online: peers::online_cpus(),
        }
    }
}

/// The two iopages configurations, each in an arena of `arena_bytes`.
fn build_configs(arena_bytes: u64) -> Result<[Config; 2], BenchError> {
    let build = |tc: usize| {
        PageAllocator::builder()
            .size_bytes(arena_bytes)
            .huge_pages(HugePages::Try)
            .populate(true)
            .checks(false)
            .thread_cache_pages(tc)
            .build()
    };
    Ok([
        Config {
            name: "iopages",
            key: "default",
            alloc: build(iopages::DEFAULT_THREAD_CACHE_PAGES)?,
        },
        Config {
            name: "iopages, no thread cache",
            key: "no_thread_cache",
            alloc: build(0)?,
        },
    ])
}

/// The peers, built (`--peers`) or each marked skipped; says which are
/// unavailable.
fn peer_states(opts: &BenchOptions) -> Vec<(&'static str, PeerState)> {
    let states: Vec<(&'static str, PeerState)> = if opts.peers {
        progress(
            "bulk",
            format!("building peers into {}", opts.peers_dir.display()),
        );
        peers::setup(&opts.peers_dir)
    } else {
        PEERS
            .iter()
            .map(|&n| (n, PeerState::Unavailable("skipped (--no-peers)".into())))
            .collect()
    };
    for (name, st) in &states {
        if let PeerState::Unavailable(why) = st {
            progress("bulk", format!("peer {name} unavailable: {why}"));
        }
    }
    states
}

/// Warm every workload once, then `runs` runs interleaving the
/// configurations and the peers (A B A B …). A peer that fails is marked
/// unavailable and its figures dropped.
fn measure_runs(
    configs: &[Config],
    plan: &PeerPlan,
    peer_states: &mut [(&'static str, PeerState)],
    c_abi: &mut CAbi,
    runs: usize,
    pages_per_run: u64,
) -> Result<(Vec<Results>, Runs), BenchError> {
    let mut results: Vec<Results> = configs
        .iter()
        .map(|_| Results {
            single: Vec::new(),
            bulk: vec![Vec::new(); BATCHES.len()],
        })
        .collect();
    for c in configs {
        single(&c.alloc, pages_per_run / 8)?;
        for &b in &BATCHES {
            bulk(&c.alloc, b, pages_per_run / 8)?;
        }
    }
    let (peer_pages, mt_pages, online) = (plan.peer_pages, plan.mt_pages, plan.online);
    let mut peer_runs: Runs = BTreeMap::new();
    let touched = &configs[0].alloc;
    for run in 0..runs {
        for (c, r) in configs.iter().zip(results.iter_mut()) {
            r.single.push(single(&c.alloc, pages_per_run)?);
            for (i, &b) in BATCHES.iter().enumerate() {
                r.bulk[i].push(bulk(&c.alloc, b, pages_per_run)?);
            }
        }
        // The single-thread peer workloads through a handle (the API a
        // worker loop calls), on an arena of the run's own, as each peer's
        // run has a process of its own.
        for (&b, &ns) in &peers::iopages_st_fresh(&plan.st_batches, peer_pages)? {
            let r = PeerResult {
                threads: None,
                batch: b,
                ns_per_page: ns,
                mt: None,
            };
            record(&mut peer_runs, "iopages", &r, online);
        }
        for &t in &plan.mt_threads {
            for &b in &MT_BATCHES {
                let r = peers::iopages_mt(touched, t, b, mt_pages)?;
                record(&mut peer_runs, "iopages", &r, online);
            }
        }
        run_peers_once(plan, peer_states, &mut peer_runs, run);
        c_abi.run_once(&plan.st_batches, peer_pages, run + 1)?;
        progress("bulk", format!("run {}/{runs} done", run + 1));
    }
    for c in configs {
        if let Err(a) = c.alloc.leak_check() {
            return Err(BenchError::Workload(format!(
                "{}: pages leaked after the benchmark: {a}",
                c.name
            )));
        }
    }
    Ok((results, peer_runs))
}

/// Run `run` (0-based) of every peer still ready, once; a peer that
/// fails is marked unavailable and its figures dropped.
fn run_peers_once(
    plan: &PeerPlan,
    peer_states: &mut [(&'static str, PeerState)],
    peer_runs: &mut Runs,
    run: usize,
) {
    for (name, state) in peer_states.iter_mut() {
        let PeerState::Ready(bin) = state else {
            continue;
        };
        match peers::run_peer(
            bin,
            plan.peer_pages,
            plan.mt_pages,
            &plan.st_batches,
            &plan.mt_threads,
            &MT_BATCHES,
        ) {
            Ok(res) => {
                for r in &res {
                    record(peer_runs, name, r, plan.online);
                }
            }
            Err(why) => {
                progress(
                    "bulk",
                    format!("peer {name} failed in run {}: {why}", run + 1),
                );
                *state = PeerState::Unavailable(format!("failed in run {}: {why}", run + 1));
                peer_runs.remove(*name);
            }
        }
    }
}

/// Run E1 with the multi-thread part at `threads` (see [`mt_threads`];
/// `None`: [`DEFAULT_MT_THREADS`]) and write its report.
pub fn run_with_threads(
    opts: &BenchOptions,
    threads: Option<&[usize]>,
) -> Result<Value, BenchError> {
    let mt_threads = mt_threads(threads)?;
    let (runs, pages_per_run) = if opts.quick {
        (3, 1u64 << 20)
    } else {
        (7, 8u64 << 20)
    };
    let arena_bytes = arena_bytes_for(*mt_threads.last().expect("at least one thread count"));
    progress(
        "bulk",
        format!("{runs} runs of {pages_per_run} pages per workload, two configurations"),
    );
    let ghz = tsc_ghz(Duration::from_millis(200));
    let configs = build_configs(arena_bytes)?;
    let plan = PeerPlan::of(opts, mt_threads);
    let mut peer_states = peer_states(opts);
    let mut c_abi = CAbi::new(
        opts.peers.then_some(opts.peers_dir.as_path()),
        "skipped (--no-peers)",
    );
    let (results, peer_runs) = measure_runs(
        &configs,
        &plan,
        &mut peer_states,
        &mut c_abi,
        runs,
        pages_per_run,
    )?;
    let single_sum: Vec<Summary> = results.iter().map(|r| Summary::of(&r.single)).collect();
    let bulk_sum: Vec<Vec<Summary>> = results
        .iter()
        .map(|r| r.bulk.iter().map(|s| Summary::of(s)).collect())
        .collect();
    print_table(&configs, &single_sum, &bulk_sum, ghz, runs);
    let cmp = Comparison {
        runs: &peer_runs,
        states: &peer_states,
        st_batches: &plan.st_batches,
        mt_threads: &plan.mt_threads,
        mt_pages: plan.mt_pages,
        online: plan.online,
    };
    cmp.print(runs);
    let e1_row = |b| cmp.get("iopages", None, b);
    let best_peer = |b| {
        let (p, _) = cmp.best(None, b)?;
        Some((p.to_string(), cmp.samples(p, None, b)?.clone()))
    };
    c_abi.print(runs, e1_row, best_peer);
    let like = like_for_like(&cmp, &c_abi, &plan.st_batches);
    let like_all = like.len() == plan.st_batches.len();
    let like_min = print_like_for_like(&like, like_all);
    let io_row = crate::io_shaped::run(&configs[0].alloc, runs, plan.peer_pages)?;
    let def = &configs[0].alloc;
    let settings = e1_settings(opts, (runs, pages_per_run, arena_bytes), def, &plan, ghz);
    let mut summary = summary(def, &single_sum[0], &bulk_sum[0], &cmp);
    summary["c_abi"] = c_abi.json(e1_row, best_peer);
    summary["io_shaped"] = io_row;
    like_for_like_json(&mut summary, &like, like_min, like_all);
    let body = Body {
        summary,
        configs: configs_json(&configs, &single_sum, &bulk_sum),
        kernel_reference: kernel_reference(),
    };
    let plots = plots(&configs, &bulk_sum, &cmp);
    Report::new("bulk", settings, body).emit(opts, &plots)
}

/// How E1 ran: `sizes` are the runs, pages per run and arena bytes.
fn e1_settings(
    opts: &BenchOptions,
    sizes: (usize, u64, u64),
    def: &PageAllocator,
    plan: &PeerPlan,
    ghz: f64,
) -> Value {
    let (runs, pages_per_run, arena_bytes) = sizes;
    json!({
        "quick": opts.quick,
        "runs": runs,
        "pages_per_run": pages_per_run,
        "arena_bytes": arena_bytes,
        "backing": format!("{:?}", def.arena().backing()),
        "nr_cpus": def.nr_cpus(),
        "mt_threads": plan.mt_threads,
        "mt_pages_per_pair": plan.mt_pages,
        "pcp_high_batch_order0": [def.pcp_limits().high[0], def.pcp_limits().batch[0]],
        "tsc_ghz": round2(ghz),
        "gfp": "KERNEL",
    })
}

/// The E1 table's two header lines: a column per configuration, then the
/// kernel's.
fn print_table_head(configs: &[Config]) {
    let mut head = format!("{:>8}", "batch");
    for c in configs {
        head += &format!(" | {:>26}", c.name);
    }
    head += &format!(" | {:>14} | {:>12}", "kernel 2017", "kernel 2021");
    println!("{head}");
    let mut sub = format!("{:>8}", "");
    for _ in configs {
        sub += &format!(" | {:>7} {:>6} {:>11}", "cycles", "ns", "ns range");
    }
    sub += &format!(" | {:>6} {:>7} | {:>12}", "cycles", "ns", "cycles");
    println!("{sub}");
}

/// Print the like-for-like line and its target (see [`like_for_like`]);
/// `all`: every batch has a figure (a batch without one cannot count as
/// met).
///
/// **Returns:** the minimum ratio, `None` without figures.
fn print_like_for_like(like: &[(usize, &str, f64)], all: bool) -> Option<f64> {
    let min = (!like.is_empty()).then(|| like.iter().map(|x| x.2).fold(f64::INFINITY, f64::min))?;
    let cells: Vec<String> = like
        .iter()
        .map(|(b, p, r)| format!("{} {r:.2} ({p})", batch_key(*b)))
        .collect();
    println!("from C ({}, the peers' own program), best page-aligned peer's ns over its own: {}; min {min:.2}", crate::c_abi::C_ROW, cells.join(", "));
    println!(
        "  target, from C: min ratio vs best page-aligned peer, every batch >= {TARGET_MIN_RATIO_PAGE_ALIGNED:.1}: {min:.2} ({}{})",
        met(all && min >= TARGET_MIN_RATIO_PAGE_ALIGNED),
        if all { "" } else { "; some batches have no figure" }
    );
    Some(min)
}

/// The like-for-like target (with `min`, see [`print_like_for_like`]) and
/// ratios in `summary`.
fn like_for_like_json(
    summary: &mut Value,
    like: &[(usize, &str, f64)],
    min: Option<f64>,
    all: bool,
) {
    if let Some(min) = min {
        summary["targets"]["min_ratio_vs_best_page_aligned_peer_like_for_like"] = json!({
            "what": "one thread, every batch: the best page-aligned peer's ns per page over iopages-c's (the peers' own C program)",
            "min": TARGET_MIN_RATIO_PAGE_ALIGNED,
            "figure": round2(min),
            "every_batch_measured": all,
            "met": all && min >= TARGET_MIN_RATIO_PAGE_ALIGNED,
        });
    }
    summary["c_abi"]["like_for_like_vs_best_page_aligned_peer"] = Value::Object(
        like.iter()
            .map(|(b, p, r)| (batch_key(*b), json!({ "peer": p, "ratio": round2(*r) })))
            .collect(),
    );
}

/// The report's fields beside `settings`.
#[derive(serde::Serialize)]
struct Body {
    summary: Value,
    configs: Value,
    kernel_reference: Value,
}

/// The `iopages-c` row against the best page-aligned peer at each
/// single-thread batch where both ran in every run: (batch, peer, the
/// median over runs of the peer's ns over the C row's, the two measured in
/// the same run): what a C caller gets, in the peers' own program.
fn like_for_like<'a>(
    cmp: &Comparison<'a>,
    c_abi: &CAbi,
    batches: &[usize],
) -> Vec<(usize, &'a str, f64)> {
    batches
        .iter()
        .filter_map(|&b| {
            let (p, _) = cmp.best_of(None, b, true)?;
            let r = crate::measure::per_run_ratio(cmp.samples(p, None, b)?, c_abi.c_runs(b))?;
            Some((b, p, r))
        })
        .collect()
}

/// The summary: the default configuration's figures, the seed's and the
/// issue's targets, and the peer comparison.
fn summary(def: &PageAllocator, single: &Summary, bulk: &[Summary], cmp: &Comparison) -> Value {
    let per_batch = |f: fn(&Summary) -> f64| -> Map<String, Value> {
        BATCHES
            .iter()
            .zip(bulk)
            .map(|(b, s)| (b.to_string(), json!(round2(f(s)))))
            .collect()
    };
    let mut summary = json!({
        "single_ns": round2(single.ns),
        "single_cycles": round2(single.cycles),
        "bulk_ns_per_page": per_batch(|s| s.ns),
        "bulk_cycles_per_page": per_batch(|s| s.cycles),
        "metadata_bytes_per_frame": Arena::metadata_bytes_per_frame(),
        "pcp_max_pages": def.stats().pcp_max_pages,
        "thread_cache_max_pages": def.thread_cache_max_pages(),
    });
    let bulk64 = bulk[BATCHES
        .iter()
        .position(|&b| b == 64)
        .expect("64 is a batch")]
    .cycles;
    let mut targets = json!({
        "single_cycles_max": TARGET_SINGLE_CYCLES,
        "single_met": single.cycles <= TARGET_SINGLE_CYCLES,
        "bulk64_cycles_per_page_max": TARGET_BULK64_CYCLES,
        "bulk64_met": bulk64 <= TARGET_BULK64_CYCLES,
        "metadata_bytes_per_frame_max": 16,
    });
    // The targets beside the seed's (each: figure, met).
    for (k, v) in cmp.targets_json() {
        targets[k] = v;
    }
    summary["targets"] = targets;
    summary["peers"] = cmp.peers_json();
    summary["ratio_vs_best_peer"] = cmp.ratio_json(false);
    summary["ratio_vs_best_page_aligned_peer"] = cmp.ratio_json(true);
    summary["min_ratio_vs_best_page_aligned_peer"] = json!(cmp.min_ratio_of(true).map(round2));
    summary["min_ratio_vs_best_peer"] = json!(cmp.min_ratio().map(round2));
    summary["peer_target"] = json!({
        "min_ratio_vs_best_peer_min": TARGET_MIN_RATIO,
        "met": cmp.min_ratio().is_some_and(|r| r >= TARGET_MIN_RATIO),
    });
    summary["cross_thread_ratio_vs_dpdk_aligned"] =
        per_mt_batch(|b| cmp.cross_thread_vs_dpdk_aligned(b));
    summary["aggregate_scaling"] = per_mt_batch(|b| cmp.scaling("iopages", b));
    summary["aggregate_scaling_by_peer"] = Value::Object(
        cmp.ready_peers()
            .into_iter()
            .map(|p| (p.to_string(), per_mt_batch(|b| cmp.scaling(p, b))))
            .collect(),
    );
    summary["multi_thread"] = cmp.mt_json();
    summary
}

/// Each configuration's single-page and per-batch summaries.
fn configs_json(configs: &[Config], single: &[Summary], bulk: &[Vec<Summary>]) -> Value {
    let m: Map<String, Value> = configs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            (
                c.key.to_string(),
                json!({
                    "name": c.name,
                    "single": single[i],
                    "bulk": BATCHES.iter().zip(&bulk[i]).map(|(b, s)| (b.to_string(), json!(s))).collect::<Map<_, _>>(),
                }),
            )
        })
        .collect();
    Value::Object(m)
}

/// The kernel's published figures (seed 004 and the merged allocator).
fn kernel_reference() -> Value {
    json!({
        "prototype_2017": {
            "single_cycles": KERNEL_2017_SINGLE.0,
            "single_ns": KERNEL_2017_SINGLE.1,
            "bulk_cycles_per_page": KERNEL_2017.iter().map(|(b, c, _)| (b.to_string(), json!(c))).collect::<Map<_, _>>(),
            "bulk_ns_per_page": KERNEL_2017.iter().map(|(b, _, n)| (b.to_string(), json!(n))).collect::<Map<_, _>>(),
        },
        "merged_2021": {
            "single_cycles": KERNEL_2021_SINGLE_CYCLES,
            "bulk_cycles_per_page": KERNEL_2021.iter().map(|(b, c)| (b.to_string(), json!(c))).collect::<Map<_, _>>(),
        },
    })
}

/// The cycles-per-page plot beside the kernel's, and the peers' plot.
fn plots(configs: &[Config], bulk: &[Vec<Summary>], cmp: &Comparison) -> [Plot; 2] {
    let mut series: Vec<Series> = configs
        .iter()
        .zip(bulk)
        .map(|(c, s)| Series {
            label: format!("{} (this machine)", c.name),
            points: BATCHES
                .iter()
                .zip(s)
                .map(|(&b, s)| (b as f64, s.cycles))
                .collect(),
        })
        .collect();
    series.push(Series {
        label: "kernel bulk prototype, 2017 (seed 004)".into(),
        points: KERNEL_2017.iter().map(|&(b, c, _)| (b as f64, c)).collect(),
    });
    [
        Plot::lines(
            PlotFile::Main,
            "E1: alloc+free cost per page by bulk batch size",
            "batch size (pages)",
            "TSC cycles per page",
            series,
        ),
        Plot::lines(
            PlotFile::Suffix("peers"),
            "E1: alloc+free per page (first byte written), iopages and peers",
            "batch size (pages)",
            "ns per page",
            cmp.series(),
        ),
    ]
}

fn print_table(
    configs: &[Config],
    single: &[Summary],
    bulk: &[Vec<Summary>],
    ghz: f64,
    runs: usize,
) {
    println!("E1 bulk: alloc+free cost per page, one thread, warm caches (median of {runs} runs, TSC {ghz:.2} GHz)");
    print_table_head(configs);
    let cell = |s: &Summary| {
        format!(
            " | {:>7.1} {:>6.2} {:>5.2}-{:<5.2}",
            s.cycles, s.ns, s.ns_min, s.ns_max
        )
    };
    let mut row = format!("{:>8}", "single");
    for s in single {
        row += &cell(s);
    }
    row += &format!(
        " | {:>6.0} {:>7.2} | {:>12.0}",
        KERNEL_2017_SINGLE.0, KERNEL_2017_SINGLE.1, KERNEL_2021_SINGLE_CYCLES
    );
    println!("{row}");
    for (i, &b) in BATCHES.iter().enumerate() {
        let mut row = format!("{b:>8}");
        for s in bulk {
            row += &cell(&s[i]);
        }
        let k17 = KERNEL_2017.iter().find(|k| k.0 == b).map(|k| (k.1, k.2));
        let k21 = KERNEL_2021
            .iter()
            .find(|k| k.0 == b)
            .map(|k| format!("{:.0}", k.1));
        row += &match k17 {
            Some((c, n)) => format!(" | {c:>6.0} {n:>7.2}"),
            None => format!(" | {:>6} {:>7}", "-", "-"),
        };
        row += &format!(" | {:>12}", k21.unwrap_or_else(|| "-".into()));
        println!("{row}");
    }
    let alloc = &configs[0].alloc;
    println!(
        "memory: {} metadata bytes per 4 KiB frame (kernel struct page: 64); per-CPU lists hold at most {} pages ({} CPUs); a thread cache at most {} pages",
        Arena::metadata_bytes_per_frame(),
        alloc.stats().pcp_max_pages,
        alloc.nr_cpus(),
        alloc.thread_cache_max_pages()
    );
    let b64 = &bulk[0][BATCHES
        .iter()
        .position(|&b| b == 64)
        .expect("64 is a batch")];
    println!(
        "targets: single <= {TARGET_SINGLE_CYCLES} cycles: {:.1} ({}); bulk at 64 <= {TARGET_BULK64_CYCLES} cycles/page: {:.1} ({})",
        single[0].cycles,
        met(single[0].cycles <= TARGET_SINGLE_CYCLES),
        b64.cycles,
        met(b64.cycles <= TARGET_BULK64_CYCLES)
    );
    println!("kernel figures are the seed's and upstream's published numbers from other machines, for reference only");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_are_even_sorted_and_default_to_2_to_16() {
        assert_eq!(mt_threads(None).unwrap(), vec![2, 4, 8, 16]);
        assert_eq!(mt_threads(Some(&[8, 2, 8])).unwrap(), vec![2, 8]);
        for bad in [&[2, 3][..], &[0], &[1], &[]] {
            let e = mt_threads(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("--threads"), "{e}");
        }
        assert!(mt_threads(Some(&[3]))
            .unwrap_err()
            .to_string()
            .contains("must be even"));
        assert!(mt_threads(Some(&[2048])).is_err());
        let many: Vec<usize> = (1..=33).map(|i| 2 * i).collect();
        assert!(mt_threads(Some(&many)).is_err());
    }

    #[test]
    fn the_arena_grows_with_the_largest_thread_count() {
        assert_eq!(arena_bytes_for(2), 64 << 20);
        assert!(arena_bytes_for(16) >= 2 * peers::mt_pages_in_flight(16, 64) * 4096);
        assert_eq!(arena_bytes_for(16) % (64 << 20), 0);
    }

    fn point(threads: usize, batch: usize, ns: f64, pages_per_s: f64, ok: bool) -> PeerResult {
        PeerResult {
            threads: Some(threads),
            batch,
            ns_per_page: ns,
            mt: Some(peers::MtFigures {
                pages_per_s,
                cpu_ns_per_page: 10.0,
                clock_ok: ok,
            }),
        }
    }

    #[test]
    fn multi_thread_summary_ratios_scaling_and_a_failed_clock() {
        let mut runs = Runs::new();
        for (t, pps) in [(2, 100e6), (16, 90e6)] {
            for b in MT_BATCHES {
                record(&mut runs, "iopages", &point(t, b, 20.0, pps, true), 2);
                record(&mut runs, DPDK_ALIGNED, &point(t, b, 30.0, 50e6, true), 2);
            }
        }
        // One of three runs of one point fails its clock check.
        for ok in [true, false, true] {
            record(&mut runs, "glibc", &point(16, 64, 900.0, 1e6, ok), 2);
        }
        let states = [
            ("glibc", PeerState::Ready("g".into())),
            (DPDK_ALIGNED, PeerState::Ready("d".into())),
            ("dpdk", PeerState::Unavailable("not built".into())),
        ];
        let cmp = Comparison {
            runs: &runs,
            states: &states,
            st_batches: &[0],
            mt_threads: &[2, 16],
            mt_pages: 1000,
            online: 2,
        };
        assert_eq!(cmp.cross_thread_vs_dpdk_aligned(0), Some(1.5));
        assert_eq!(cmp.scaling("iopages", 64), Some(0.9));
        assert_eq!(cmp.scaling(DPDK_ALIGNED, 0), Some(1.0));
        assert_eq!(
            cmp.scaling("glibc", 64),
            None,
            "glibc never ran at 2 threads"
        );
        let mt = cmp.mt_json();
        let glibc = &mt["points"]["16"]["64"]["glibc"];
        assert_eq!(glibc["clock_check"], "failed");
        assert_eq!(glibc["clock_check_failed_runs"], "1 of 3");
        assert_eq!(mt["points"]["16"]["64"]["iopages"]["clock_check"], "ok");
        assert_eq!(mt["clock_check_failed"][0]["allocator"], "glibc");
        assert_eq!(mt["points"]["2"]["single"]["ratio_vs_dpdk_aligned"], 1.5);
        let targets = cmp.targets_json();
        assert_eq!(targets["cross_thread_vs_dpdk_aligned"]["64"]["met"], true);
        assert_eq!(targets["aggregate_scaling"]["single"]["figure"], 0.9);
        assert_eq!(targets["aggregate_scaling"]["single"]["met"], true);
        assert_eq!(targets["aggregate_scaling"]["oversubscribed"], true);
        // No single-thread figures: those targets have no figure, not met.
        assert_eq!(targets["single_page_ratio_vs_best_peer"]["met"], false);
        assert!(targets["single_page_ratio_vs_best_peer"]["figure"].is_null());
        // A machine with 16 CPUs is not oversubscribed: the target does not apply.
        let big = Comparison { online: 16, ..cmp };
        assert!(big.targets_json()["aggregate_scaling"]["64"]["met"].is_null());
    }
}
