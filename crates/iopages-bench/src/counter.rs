//! E3 `counter` (core): many threads checking a shared page limit near its
//! threshold — the exact `compare` (a locked sum when near), the rough
//! `read_positive` (dm-crypt's fix, seed 001) and `limited_add` — scaling
//! from one thread to every CPU.
//!
//! Owns: this workload, its table, JSON and plot. Must never: assert a
//! timing.
//!
//! One operation is what a page allocation does to dm-crypt's page counter:
//! check the limit, and if there is room add 1 (the page) and subtract 1
//! (its free) — with `limited_add` the check and the add are one call. The
//! counter is set within its error bound of the limit, so `compare` must
//! take the exact path and `limited_add` its locked exact path; a fourth
//! series runs `limited_add` far from the limit (its lock-free path). The
//! cost per operation is CPU time: wall time × busy threads (at most one
//! per CPU) / operations. Thread counts and modes run interleaved.

use crate::harness::{interleave, Plot, PlotFile, Report, Table};
use crate::measure::median;
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages::PercpuCounter;
use serde::Serialize;
use serde_json::{json, Value};
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// The limit being checked (pages).
pub const LIMIT: i64 = 1 << 20;
/// Target: the rough check's cost per operation at the largest thread count
/// within this factor of its cost at one thread.
pub const TARGET_FLAT_FACTOR: f64 = 2.0;

/// How the limit is checked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// `compare(LIMIT) == Less`, then add 1 and subtract 1.
    Exact,
    /// `read_positive() < LIMIT`, then add 1 and subtract 1.
    Approx,
    /// `limited_add(LIMIT, 1)`, then subtract 1, near the limit.
    Limited,
    /// The same, far from the limit.
    LimitedFar,
}

const MODES: [(Mode, &str, &str); 4] = [
    (Mode::Exact, "exact", "compare (exact near the limit)"),
    (Mode::Approx, "approx", "read_positive (rough)"),
    (Mode::Limited, "limited", "limited_add near the limit"),
    (
        Mode::LimitedFar,
        "limited_far",
        "limited_add far from the limit",
    ),
];

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Thread counts: 1, 2, 4, … up to the CPUs, the CPU count itself, and
/// twice the CPUs (oversubscribed: threads preempted while they hold the
/// lock). The targets are judged up to the CPU count.
fn thread_counts() -> Vec<usize> {
    let cpus = cpus();
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n <= cpus)
        .collect();
    if v.last() != Some(&cpus) {
        v.push(cpus);
    }
    v.push(2 * cpus);
    v
}

/// One measurement: `threads` threads doing `ops` operations each.
/// Returns (operations per second, CPU ns per operation).
fn measure(mode: Mode, threads: usize, ops: u64) -> Result<(f64, f64), BenchError> {
    let counter = Arc::new(PercpuCounter::new(0));
    // Within the error bound of the limit (rough checks cannot decide), but
    // below it, so every operation is allowed.
    let near = LIMIT - counter.error_bound() / 2 - 1;
    counter.set(if mode == Mode::LimitedFar { 0 } else { near });
    let start_line = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (c, line) = (counter.clone(), start_line.clone());
            std::thread::spawn(move || {
                line.wait();
                let t0 = Instant::now();
                let mut refused = 0u64;
                for _ in 0..ops {
                    let ok = match mode {
                        Mode::Exact => {
                            let ok = c.compare(LIMIT) == Ordering::Less;
                            if ok {
                                c.add(1);
                                c.add(-1);
                            }
                            ok
                        }
                        Mode::Approx => {
                            let ok = c.read_positive() < LIMIT;
                            if ok {
                                c.add(1);
                                c.add(-1);
                            }
                            ok
                        }
                        Mode::Limited | Mode::LimitedFar => {
                            let ok = c.limited_add(LIMIT, 1);
                            if ok {
                                c.add(-1);
                            }
                            ok
                        }
                    };
                    refused += !ok as u64;
                }
                (refused, t0, Instant::now())
            })
        })
        .collect();
    start_line.wait();
    let (refused, first, last) = join_timed(handles)?;
    let secs = (last - first).as_secs_f64();
    if refused > 0 {
        return Err(BenchError::Workload(format!(
            "{mode:?}: {refused} operations were refused below the limit"
        )));
    }
    let end = counter.sum();
    let expect = if mode == Mode::LimitedFar { 0 } else { near };
    if end != expect {
        return Err(BenchError::Workload(format!(
            "{mode:?}: the counter ended at {end}, not {expect}"
        )));
    }
    let total = (threads as u64 * ops) as f64;
    Ok((
        total / secs,
        secs * 1e9 * threads.min(cpus()) as f64 / total,
    ))
}

/// Join the workers of [`measure`]. Each thread times itself: this thread
/// may not run again until they are done. The span is from the first
/// start to the last finish.
///
/// **Returns:** the refused operations, the first start and the last
/// finish.
fn join_timed(
    handles: Vec<std::thread::JoinHandle<(u64, Instant, Instant)>>,
) -> Result<(u64, Instant, Instant), BenchError> {
    let mut refused = 0;
    let mut span: Option<(Instant, Instant)> = None;
    for h in handles {
        let (r, t0, t1) = h
            .join()
            .map_err(|_| BenchError::Workload("a counter thread panicked".into()))?;
        refused += r;
        span = Some(match span {
            None => (t0, t1),
            Some((a, b)) => (a.min(t0), b.max(t1)),
        });
    }
    let (first, last) = span.expect("at least one thread");
    Ok((refused, first, last))
}

/// The figures of one (mode, thread count): medians over the runs.
#[derive(Clone, Copy)]
struct Point {
    ops_s: f64,
    ns: f64,
    ns_min: f64,
    ns_max: f64,
}

impl Point {
    fn of(v: &[(f64, f64)]) -> Point {
        let ns: Vec<f64> = v.iter().map(|x| x.1).collect();
        Point {
            ops_s: median(&v.iter().map(|x| x.0).collect::<Vec<_>>()),
            ns: median(&ns),
            ns_min: ns.iter().copied().fold(f64::INFINITY, f64::min),
            ns_max: ns.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// `per[mode][thread count]`, and where the counts stop fitting the CPUs.
struct Figures {
    counts: Vec<usize>,
    per: Vec<Vec<Point>>,
    /// The largest count that is not oversubscribed.
    last: usize,
    /// The oversubscribed count.
    over: usize,
}

impl Figures {
    fn ops_s(&self, mi: usize, ci: usize) -> f64 {
        self.per[mi][ci].ops_s
    }
    fn ns(&self, mi: usize, ci: usize) -> f64 {
        self.per[mi][ci].ns
    }
    /// Slowest over fastest cost of mode `mi` from 1 to `last` threads.
    fn spread(&self, mi: usize) -> f64 {
        let v: Vec<f64> = (0..=self.last).map(|ci| self.ns(mi, ci)).collect();
        v.iter().copied().fold(0.0, f64::max) / v.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn exact_growth(&self) -> f64 {
        self.ns(0, self.last) / self.ns(0, 0)
    }
}

pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, ops) = if opts.quick {
        (3, 300_000u64)
    } else {
        (7, 2_000_000u64)
    };
    let counts = thread_counts();
    let probe = PercpuCounter::new(0);
    progress(
        "counter",
        format!(
            "{runs} runs of {ops} operations per thread; threads {counts:?}; {} slots, batch {}, error bound {}",
            probe.nr_slots(),
            probe.batch(),
            probe.error_bound()
        ),
    );
    // Configurations: (thread count, mode), modes inner; the first
    // MODES.len() are one thread, where each mode warms up.
    let configs: Vec<(usize, usize)> = (0..counts.len())
        .flat_map(|ci| (0..MODES.len()).map(move |mi| (ci, mi)))
        .collect();
    let samples = interleave(
        "counter",
        configs.len(),
        runs,
        &mut (),
        |_, c| match MODES.get(c) {
            Some(&(m, _, _)) => measure(m, 1, ops / 10).map(|_| ()),
            None => Ok(()),
        },
        |_, c| measure(MODES[configs[c].1].0, counts[configs[c].0], ops),
    )?;
    let mut per = vec![Vec::new(); MODES.len()];
    for (&(_, mi), v) in configs.iter().zip(&samples) {
        per[mi].push(Point::of(v));
    }
    let f = Figures {
        last: counts.len() - 2,
        over: counts.len() - 1,
        counts,
        per,
    };
    table(&f, &probe, runs).print();
    let settings = Settings {
        quick: opts.quick,
        runs,
        ops_per_thread: ops,
        thread_counts: f.counts.clone(),
        limit: LIMIT,
        nr_slots: probe.nr_slots(),
        batch: probe.batch(),
        error_bound: probe.error_bound(),
        operation: "check the limit; if allowed add 1 and subtract 1 (limited_add: add 1 if within the limit, subtract 1)",
        unit: "ns_per_op is CPU time: wall time x busy threads (at most one per CPU) / operations",
    };
    Report::new("counter", settings, body(&f)).emit(opts, &[plot(&f)])
}

/// The plot: CPU ns per operation of each mode, by threads.
fn plot(f: &Figures) -> Plot {
    let series: Vec<Series> = MODES
        .iter()
        .enumerate()
        .map(|(mi, &(_, _, name))| Series {
            label: name.to_string(),
            points: (0..f.counts.len())
                .map(|ci| (f.counts[ci] as f64, f.ns(mi, ci)))
                .collect(),
        })
        .collect();
    Plot::lines(
        PlotFile::Main,
        "E3: cost of a limit check + add/sub per operation, by threads",
        "threads",
        "CPU ns per operation",
        series,
    )
}

/// The table and the lines under it.
fn table(f: &Figures, probe: &PercpuCounter, runs: usize) -> Table {
    let (last, over) = (f.last, f.over);
    let mut t = Table::new(format!(
        "E3 counter: check a page limit near its threshold, then add 1 and subtract 1 (median of {runs} runs; CPU ns per operation, range; millions of operations per second)"
    ));
    t.line(format!(
        "counter: {} slots, batch {}, error bound {} pages; limit {LIMIT}",
        probe.nr_slots(),
        probe.batch(),
        probe.error_bound()
    ));
    let mut head = vec![format!("{:>7}", "threads")];
    head.extend(MODES.iter().map(|&(_, _, name)| format!("{name:>31}")));
    t.row(head);
    for (ci, &n) in f.counts.iter().enumerate() {
        let mut row = vec![if ci == over {
            format!("{:>7}", format!("{n}*"))
        } else {
            format!("{n:>7}")
        }];
        row.extend(f.per.iter().map(|per| {
            let p = per[ci];
            format!(
                "{:>7.1} ns ({:>6.1}-{:<6.1}) {:>6.1} M/s",
                p.ns,
                p.ns_min,
                p.ns_max,
                p.ops_s / 1e6
            )
        }));
        t.row(row);
    }
    let approx_flat = f.spread(1);
    t.line(format!(
        "at {} threads: read_positive {:.1}x the operations per second of compare",
        f.counts[last],
        f.ops_s(1, last) / f.ops_s(0, last)
    ));
    t.line(format!(
        "target: read_positive cost flat within {TARGET_FLAT_FACTOR}x across thread counts: {:.2}x ({}); compare grows {:.2}x from 1 to {} threads",
        approx_flat,
        met(approx_flat <= TARGET_FLAT_FACTOR),
        f.exact_growth(),
        f.counts[last]
    ));
    t.line(format!(
        "* oversubscribed ({} threads on {} CPUs): read_positive {:.2}x its 1-thread cost, compare {:.2}x",
        f.counts[over],
        cpus(),
        f.ns(1, over) / f.ns(1, 0),
        f.ns(0, over) / f.ns(0, 0)
    ));
    if f.counts.len() < 4 {
        t.line(format!(
            "note: this machine has {} CPUs; contention on the exact path grows with the CPU count (seed 001 measured 96)",
            f.counts[last]
        ));
    }
    t.line("seed 001 (96 CPUs, kernel): %sys 35 -> 7, mempool_alloc 62 % -> 8 % of the profile, 2.0 -> 2.7 GB/s, exact -> rough check");
    t
}

#[derive(Serialize)]
struct Settings {
    quick: bool,
    runs: usize,
    ops_per_thread: u64,
    thread_counts: Vec<usize>,
    limit: i64,
    nr_slots: usize,
    batch: i64,
    error_bound: i64,
    operation: &'static str,
    unit: &'static str,
}

#[derive(Serialize)]
struct Body {
    summary: Value,
    modes: BTreeMap<&'static str, ModeReport>,
    seed_reference: Value,
}

#[derive(Serialize)]
struct ModeReport {
    name: &'static str,
    by_threads: Vec<ThreadsRow>,
}

#[derive(Serialize)]
struct ThreadsRow {
    threads: usize,
    oversubscribed: bool,
    ops_per_s: f64,
    ns_per_op: f64,
    ns_per_op_min: f64,
    ns_per_op_max: f64,
}

/// The report's summary, per-mode rows and the seed's figures.
fn body(f: &Figures) -> Body {
    let (last, over) = (f.last, f.over);
    let (ops_s, ns) = (|mi, ci| f.ops_s(mi, ci), |mi, ci| f.ns(mi, ci));
    let (approx_flat, exact_growth) = (f.spread(1), f.exact_growth());
    let summary = json!({
        "threads": f.counts[last],
        "exact_ops_per_s": ops_s(0, last).round(),
        "approx_ops_per_s": ops_s(1, last).round(),
        "limited_ops_per_s": ops_s(2, last).round(),
        "limited_far_ops_per_s": ops_s(3, last).round(),
        "approx_speedup": round2(ops_s(1, last) / ops_s(0, last)),
        "exact_ns_per_op": round2(ns(0, last)),
        "approx_ns_per_op": round2(ns(1, last)),
        "approx_cost_spread": round2(approx_flat),
        "exact_cost_growth": round2(exact_growth),
        "oversubscribed": {
            "threads": f.counts[over],
            "exact_ops_per_s": ops_s(0, over).round(),
            "approx_ops_per_s": ops_s(1, over).round(),
            "approx_cost_vs_1_thread": round2(ns(1, over) / ns(1, 0)),
            "exact_cost_vs_1_thread": round2(ns(0, over) / ns(0, 0)),
        },
        "targets": {
            "approx_flat_within": TARGET_FLAT_FACTOR,
            "approx_flat_met": approx_flat <= TARGET_FLAT_FACTOR,
            "exact_degrades": exact_growth > approx_flat,
        },
    });
    let modes = MODES
        .iter()
        .zip(&f.per)
        .map(|(&(_, key, name), per)| {
            let by_threads = f
                .counts
                .iter()
                .zip(per)
                .enumerate()
                .map(|(ci, (&threads, p))| ThreadsRow {
                    threads,
                    oversubscribed: ci == over,
                    ops_per_s: p.ops_s.round(),
                    ns_per_op: round2(p.ns),
                    ns_per_op_min: round2(p.ns_min),
                    ns_per_op_max: round2(p.ns_max),
                })
                .collect();
            (key, ModeReport { name, by_threads })
        })
        .collect();
    Body {
        summary,
        modes,
        seed_reference: json!({
            "seed": "001 (Arne Welzel, dm-crypt page limit via percpu_counter_read_positive)",
            "cpus": 96,
            "sys_percent": [35, 7],
            "mempool_alloc_profile_percent": [62, 8],
            "write_gb_per_s": [2.0, 2.7],
        }),
    }
}
