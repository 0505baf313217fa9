//! E1 `bulk`: the cost of alloc+free per page, single-page API and bulk
//! batches, one thread, warm caches — the table of seed 004 (page_bench04).
//!
//! Two iopages configurations run interleaved in the same process: the
//! default (per-thread caches in front of the per-CPU lists) and per-CPU
//! lists only (`thread_cache_pages(0)`), so the thread cache's effect is
//! measured rather than assumed. The kernel's published figures are printed
//! beside them as a reference; they were measured on other machines.

use crate::measure::{median, time_once, tsc_ghz, Sample, Summary};
use crate::peers::{self, PeerState, PEERS};
use crate::plot::{line_plot, Series};
use crate::{met, round2};
use crate::{progress, write_json, BenchError, BenchOptions};
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
/// Target: iopages at least this many times faster than the best peer at
/// every batch size.
pub const TARGET_MIN_RATIO: f64 = 1.3;

/// Peers whose buffers are not page aligned (DPDK's default layout puts a
/// 64-byte header before each 4 KiB buffer and pads for memory channels).
const UNALIGNED_PEERS: [&str; 1] = ["dpdk"];

/// Samples by allocator, then by (threads, batch): `None` threads is the
/// single-thread part; batch 0 the single-object API.
type Runs = BTreeMap<String, BTreeMap<(Option<usize>, usize), Vec<f64>>>;

/// Thread counts of the multi-thread part: 2, 4, 8, … up to the CPUs.
fn mt_thread_counts() -> Vec<usize> {
    let cpus = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .max(2);
    let mut v: Vec<usize> = std::iter::successors(Some(2usize), |t| Some(t * 2))
        .take_while(|&t| t <= cpus)
        .collect();
    if cpus % 2 == 0 && !v.contains(&cpus) {
        v.push(cpus);
    }
    v
}

fn batch_key(b: usize) -> String {
    if b == 0 {
        "single".into()
    } else {
        b.to_string()
    }
}

/// Medians of iopages and the peers, and the ratios between them.
struct Comparison<'a> {
    runs: &'a Runs,
    states: &'a [(&'a str, PeerState)],
    st_batches: &'a [usize],
    mt_threads: &'a [usize],
}

impl<'a> Comparison<'a> {
    fn samples(&self, who: &str, threads: Option<usize>, batch: usize) -> Option<&'a Vec<f64>> {
        self.runs
            .get(who)?
            .get(&(threads, batch))
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

    fn ratio_of(&self, threads: Option<usize>, batch: usize, aligned_only: bool) -> Option<f64> {
        let ours = self.get("iopages", threads, batch)?;
        self.best_of(threads, batch, aligned_only)
            .map(|(_, ns)| ns / ours)
    }

    fn ratio(&self, threads: Option<usize>, batch: usize) -> Option<f64> {
        self.ratio_of(threads, batch, false)
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

    fn mt_json(&self) -> Value {
        let mut out = Map::new();
        for &t in self.mt_threads {
            let mut per_t = Map::new();
            for who in self.everyone() {
                let per: Map<String, Value> = MT_BATCHES
                    .iter()
                    .filter_map(|&b| {
                        self.get(who, Some(t), b)
                            .map(|ns| (batch_key(b), json!(round2(ns))))
                    })
                    .collect();
                per_t.insert(who.to_string(), Value::Object(per));
            }
            let ratios: Map<String, Value> = MT_BATCHES
                .iter()
                .filter_map(|&b| {
                    self.ratio(Some(t), b)
                        .map(|r| (batch_key(b), json!(round2(r))))
                })
                .collect();
            per_t.insert("ratio_vs_best_peer".into(), Value::Object(ratios));
            out.insert(t.to_string(), Value::Object(per_t));
        }
        json!({ "ns_per_page_per_pair": out, "batches": MT_BATCHES.map(batch_key) })
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
        println!("E1 peers: alloc+free ns per page, first byte of each page written (median and range of {runs} runs)");
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
        println!();
        println!("E1 multi-thread: producer/consumer pairs (allocated on one thread, freed on another), wall ns per page per pair");
        for &t in self.mt_threads {
            for &b in &MT_BATCHES {
                let mut row = format!("{t:>3} threads, batch {:>6}:", batch_key(b));
                for who in self.everyone() {
                    if let Some(ns) = self.get(who, Some(t), b) {
                        row += &format!("  {who} {ns:.1}");
                    }
                }
                if let Some(r) = self.ratio(Some(t), b) {
                    row += &format!("  (ratio {r:.2})");
                }
                println!("{row}");
            }
        }
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
                Some(p) => alloc.free_pages(black_box(p), 0),
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
            alloc.free_pages_bulk_array(&mut slots);
        }
    });
    if short {
        return Err(BenchError::Workload(format!(
            "bulk allocation of {batch} came back short"
        )));
    }
    Ok(s)
}

/// Run E1 and write its report. Returns the JSON report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, pages_per_run) = if opts.quick {
        (3, 1u64 << 20)
    } else {
        (7, 8u64 << 20)
    };
    let arena_bytes = 64u64 << 20;
    progress(
        "bulk",
        format!("{runs} runs of {pages_per_run} pages per workload, two configurations"),
    );
    let ghz = tsc_ghz(Duration::from_millis(200));
    let build = |tc: usize| {
        PageAllocator::builder()
            .size_bytes(arena_bytes)
            .huge_pages(HugePages::Try)
            .populate(true)
            .checks(false)
            .thread_cache_pages(tc)
            .build()
    };
    let configs = [
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
    ];
    let mut results: Vec<Results> = configs
        .iter()
        .map(|_| Results {
            single: Vec::new(),
            bulk: vec![Vec::new(); BATCHES.len()],
        })
        .collect();
    // Warm every configuration and workload once, untimed.
    for c in &configs {
        single(&c.alloc, pages_per_run / 8)?;
        for &b in &BATCHES {
            bulk(&c.alloc, b, pages_per_run / 8)?;
        }
    }
    // The peer comparison: the same workloads with each page's first byte
    // written, in-process for iopages and one process per peer per run.
    let peer_pages: u64 = if opts.quick { 64 << 10 } else { 512 << 10 };
    let mt_pages: u64 = if opts.quick { 64 << 10 } else { 1 << 20 };
    let st_batches: Vec<usize> = std::iter::once(0).chain(BATCHES).collect();
    let mt_threads = mt_thread_counts();
    let mut peer_states: Vec<(&str, PeerState)> = if opts.peers {
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
    for (name, st) in &peer_states {
        if let PeerState::Unavailable(why) = st {
            progress("bulk", format!("peer {name} unavailable: {why}"));
        }
    }
    let mut peer_runs: Runs = BTreeMap::new();
    let touched = &configs[0].alloc;
    for &b in &st_batches {
        peers::iopages_st(touched, b, peer_pages / 8 + 1)?;
    }

    // Interleave configurations and peers run by run (A B A B ...).
    for run in 0..runs {
        for (c, r) in configs.iter().zip(results.iter_mut()) {
            r.single.push(single(&c.alloc, pages_per_run)?);
            for (i, &b) in BATCHES.iter().enumerate() {
                r.bulk[i].push(bulk(&c.alloc, b, pages_per_run)?);
            }
        }
        let ours = peer_runs.entry("iopages".into()).or_default();
        for &b in &st_batches {
            ours.entry((None, b))
                .or_default()
                .push(peers::iopages_st(touched, b, peer_pages)?.ns);
        }
        for &t in &mt_threads {
            for &b in &MT_BATCHES {
                ours.entry((Some(t), b))
                    .or_default()
                    .push(peers::iopages_mt(touched, t, b, mt_pages)?);
            }
        }
        for (name, state) in peer_states.iter_mut() {
            let PeerState::Ready(bin) = state else {
                continue;
            };
            match peers::run_peer(
                bin,
                peer_pages,
                mt_pages,
                &st_batches,
                &mt_threads,
                &MT_BATCHES,
            ) {
                Ok(res) => {
                    let m = peer_runs.entry(name.to_string()).or_default();
                    for r in res {
                        m.entry((r.threads, r.batch))
                            .or_default()
                            .push(r.ns_per_page);
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
        progress("bulk", format!("run {}/{runs} done", run + 1));
    }
    for c in &configs {
        if let Err(a) = c.alloc.leak_check() {
            return Err(BenchError::Workload(format!(
                "{}: pages leaked after the benchmark: {a}",
                c.name
            )));
        }
    }

    let single_sum: Vec<Summary> = results.iter().map(|r| Summary::of(&r.single)).collect();
    let bulk_sum: Vec<Vec<Summary>> = results
        .iter()
        .map(|r| r.bulk.iter().map(|s| Summary::of(s)).collect())
        .collect();

    print_table(&configs, &single_sum, &bulk_sum, ghz, runs);
    let cmp = Comparison {
        runs: &peer_runs,
        states: &peer_states,
        st_batches: &st_batches,
        mt_threads: &mt_threads,
    };
    cmp.print(runs);

    let per_batch = |v: &[Summary], f: fn(&Summary) -> f64| -> Map<String, Value> {
        BATCHES
            .iter()
            .zip(v)
            .map(|(b, s)| (b.to_string(), json!(round2(f(s)))))
            .collect()
    };
    let def = &configs[0].alloc;
    let mut summary = json!({
        "single_ns": round2(single_sum[0].ns),
        "single_cycles": round2(single_sum[0].cycles),
        "bulk_ns_per_page": per_batch(&bulk_sum[0], |s| s.ns),
        "bulk_cycles_per_page": per_batch(&bulk_sum[0], |s| s.cycles),
        "metadata_bytes_per_frame": Arena::metadata_bytes_per_frame(),
        "pcp_max_pages": def.stats().pcp_max_pages,
        "thread_cache_max_pages": def.thread_cache_max_pages(),
    });
    let bulk64 = bulk_sum[0][BATCHES
        .iter()
        .position(|&b| b == 64)
        .expect("64 is a batch")]
    .cycles;
    summary["targets"] = json!({
        "single_cycles_max": TARGET_SINGLE_CYCLES,
        "single_met": single_sum[0].cycles <= TARGET_SINGLE_CYCLES,
        "bulk64_cycles_per_page_max": TARGET_BULK64_CYCLES,
        "bulk64_met": bulk64 <= TARGET_BULK64_CYCLES,
        "metadata_bytes_per_frame_max": 16,
    });
    let configs_json: Map<String, Value> = configs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            (
                c.key.to_string(),
                json!({
                    "name": c.name,
                    "single": single_sum[i],
                    "bulk": BATCHES.iter().zip(&bulk_sum[i]).map(|(b, s)| (b.to_string(), json!(s))).collect::<Map<_, _>>(),
                }),
            )
        })
        .collect();
    summary["peers"] = cmp.peers_json();
    summary["ratio_vs_best_peer"] = cmp.ratio_json(false);
    summary["ratio_vs_best_page_aligned_peer"] = cmp.ratio_json(true);
    summary["min_ratio_vs_best_page_aligned_peer"] = json!(cmp.min_ratio_of(true).map(round2));
    summary["min_ratio_vs_best_peer"] = json!(cmp.min_ratio().map(round2));
    summary["peer_target"] = json!({
        "min_ratio_vs_best_peer_min": TARGET_MIN_RATIO,
        "met": cmp.min_ratio().is_some_and(|r| r >= TARGET_MIN_RATIO),
    });
    summary["multi_thread"] = cmp.mt_json();
    let report = json!({
        "experiment": "bulk",
        "machine": crate::machine(),
        "settings": {
            "quick": opts.quick,
            "runs": runs,
            "pages_per_run": pages_per_run,
            "arena_bytes": arena_bytes,
            "backing": format!("{:?}", def.arena().backing()),
            "nr_cpus": def.nr_cpus(),
            "pcp_high_batch_order0": [def.pcp_limits().high[0], def.pcp_limits().batch[0]],
            "tsc_ghz": round2(ghz),
            "gfp": "KERNEL",
        },
        "summary": summary,
        "configs": configs_json,
        "kernel_reference": {
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
        },
    });
    let (json_path, svg_path) = opts.paths("bulk");
    write_json(&json_path, &report)?;
    let mut series: Vec<Series> = configs
        .iter()
        .zip(&bulk_sum)
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
    line_plot(
        &svg_path,
        "E1: alloc+free cost per page by bulk batch size",
        "batch size (pages)",
        "TSC cycles per page",
        &series,
    )?;
    let peers_svg = svg_path.with_file_name(format!(
        "{}-peers.svg",
        svg_path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("bulk")
    ));
    line_plot(
        &peers_svg,
        "E1: alloc+free per page (first byte written), iopages and peers",
        "batch size (pages)",
        "ns per page",
        &cmp.series(),
    )?;
    progress(
        "bulk",
        format!(
            "wrote {}, {} and {}",
            json_path.display(),
            svg_path.display(),
            peers_svg.display()
        ),
    );
    Ok(report)
}

fn print_table(
    configs: &[Config],
    single: &[Summary],
    bulk: &[Vec<Summary>],
    ghz: f64,
    runs: usize,
) {
    println!("E1 bulk: alloc+free cost per page, one thread, warm caches (median of {runs} runs, TSC {ghz:.2} GHz)");
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
