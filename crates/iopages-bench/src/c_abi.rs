//! E1 through the C ABI: what a C caller of `libiopages` pays over a Rust
//! caller of the same allocator, measured side by side in every E1 run.
//!
//! Owns: the `iopages-c` row (the C harness, `peers/peer_bench.c` built
//! against `libiopages` by `scripts/setup-peers.sh`, one process per run)
//! and its Rust twin — the same single-thread workloads in this process
//! from the same state the C process starts in: a new arena configured as
//! the harness configures it (64 MiB, populated, huge pages if the kernel
//! gives them, checks off, default thread cache), one new per-thread
//! handle, every batch warmed once with an eighth of the pages, then every
//! batch timed in the harness's order, with E1's loop (which is the C
//! harness's: see [`peers::iopages_st`]). The ratio is taken per run (the
//! two samples adjacent in time) and its median reported.
//!
//! The targets: the C row within [`TARGET_C_OVER_RUST`]× of the twin at
//! the single-page API and at every batch of at least
//! [`TARGET_MIN_BATCH`]. Within one run both rows meet the same peer
//! sample, so the C row's ratio against any peer over the Rust row's is
//! exactly the twin's ns over C's: the target bounds the median over runs
//! of that ratio of ratios too (not the ratio of the two rows' separate
//! medians against a peer, which the table also shows).
//!
//! Why a twin rather than E1's `iopages` row, which now runs the same
//! way ([`peers::iopages_st_fresh`]): the twin runs right after the C
//! process, so the pair is adjacent in time, and each arena draws its own
//! placement of record, cache and pages, which moves small batches by more
//! than the C ABI does. The E1 row is shown beside, for the reader to see
//! both.
//!
//! Must never: count `iopages-c` as a peer to beat, or compare figures
//! from different runs.

use crate::measure::{median, per_run_ratio};
use crate::peers::{self, batch_key, PeerState};
use crate::{met, progress, round2, BenchError};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The row's name (and its harness binary, `peer-iopages-c`).
pub const C_ROW: &str = "iopages-c";
/// Target: the C row at most this many times the Rust twin's ns per page
/// at the single-page API and every batch of at least [`TARGET_MIN_BATCH`].
pub const TARGET_C_OVER_RUST: f64 = 1.2;
/// The smallest batch the target covers.
pub const TARGET_MIN_BATCH: usize = 8;
/// Per batch, one figure per run (0: the single-page API).
type PerBatch = BTreeMap<usize, Vec<f64>>;

/// The rows' samples and the per-run ratios.
pub struct CAbi {
    state: PeerState,
    /// The C harness, ns per page.
    c: PerBatch,
    /// The Rust twin (E1's loop, which is the C loop), ns per page.
    rust: PerBatch,
    /// C over `rust`, one per run.
    ratio: PerBatch,
}

fn med(m: &PerBatch, b: usize) -> Option<f64> {
    m.get(&b).filter(|v| !v.is_empty()).map(|v| median(v))
}

impl CAbi {
    /// The row as `setup-peers.sh` left it in `dir` (or skipped, `why`).
    pub fn new(dir: Option<&Path>, why_skipped: &str) -> CAbi {
        let state = match dir {
            Some(d) => peers::state_of(d, C_ROW),
            None => PeerState::Unavailable(why_skipped.into()),
        };
        if let PeerState::Unavailable(why) = &state {
            progress("bulk", format!("{C_ROW} unavailable: {why}"));
        }
        CAbi {
            state,
            c: PerBatch::new(),
            rust: PerBatch::new(),
            ratio: PerBatch::new(),
        }
    }

    /// One run: the C process, then its Rust twin. A failing C process
    /// marks the row unavailable (the rest of E1 goes on); a failing twin
    /// is an error of the benchmark.
    pub fn run_once(
        &mut self,
        batches: &[usize],
        pages: u64,
        run: usize,
    ) -> Result<(), BenchError> {
        let PeerState::Ready(bin) = &self.state else {
            return Ok(());
        };
        let c = match peers::run_peer(bin, pages, 0, batches, &[], &[]) {
            Ok(c) => c,
            Err(why) => {
                progress("bulk", format!("{C_ROW} failed in run {run}: {why}"));
                self.state = PeerState::Unavailable(format!("failed in run {run}: {why}"));
                return Ok(());
            }
        };
        let mut printed: Vec<usize> = c.iter().map(|r| r.batch).collect();
        printed.sort_unstable();
        let mut asked = batches.to_vec();
        asked.sort_unstable();
        if printed != asked {
            return Err(BenchError::Workload(format!(
                "{C_ROW} printed batches {printed:?}, asked {asked:?}"
            )));
        }
        let twin = peers::iopages_st_fresh(batches, pages)
            .map_err(|e| BenchError::Workload(format!("{C_ROW} twin: {e}")))?;
        for r in &c {
            let (b, ns) = (r.batch, r.ns_per_page);
            let t = twin.get(&b).ok_or_else(|| {
                BenchError::Workload(format!("{C_ROW} printed batch {b}, which was not asked"))
            })?;
            self.c.entry(b).or_default().push(ns);
            self.rust.entry(b).or_default().push(*t);
            self.ratio.entry(b).or_default().push(ns / t);
        }
        Ok(())
    }

    /// The C row's samples at `batch`, one per run (empty if the row did
    /// not run or failed).
    pub fn c_runs(&self, batch: usize) -> &[f64] {
        match self.c.get(&batch) {
            Some(v) if self.ready() => v,
            _ => &[],
        }
    }

    /// How many times faster than a peer (its samples `peer`, one per run)
    /// the C row and the twin are at `batch`: each the median of the runs'
    /// ratios.
    fn vs_peer(&self, peer: &[f64], batch: usize) -> (Option<f64>, Option<f64>) {
        let of = |m: &PerBatch| m.get(&batch).and_then(|v| per_run_ratio(peer, v));
        (of(&self.c), of(&self.rust))
    }

    fn ready(&self) -> bool {
        matches!(self.state, PeerState::Ready(_)) && !self.ratio.is_empty()
    }

    /// The worst median ratio in `m` over the batches the target covers
    /// (0, the single-page API, and every batch from [`TARGET_MIN_BATCH`]).
    fn worst(m: &PerBatch) -> Option<(usize, f64)> {
        m.iter()
            .filter(|(&b, v)| (b == 0 || b >= TARGET_MIN_BATCH) && !v.is_empty())
            .map(|(&b, v)| (b, median(v)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// Print the table: C row, the Rust twin, their ratio, E1's `iopages`
    /// row (`e1(batch)`), and how many times faster than the best peer the
    /// C row and the twin are (`best(batch)`: the best peer's name and ns).
    pub fn print(
        &self,
        runs: usize,
        e1: impl Fn(usize) -> Option<f64>,
        best: impl Fn(usize) -> Option<(String, Vec<f64>)>,
    ) {
        println!();
        if !self.ready() {
            if let PeerState::Unavailable(why) = &self.state {
                println!("E1 through the C ABI: {C_ROW} unavailable - {why}");
            }
            return;
        }
        println!("E1 through the C ABI: ns per page, one thread, first byte written through an array of addresses (median of {runs} runs; ratios: median of each run's)");
        println!("  twin: the same workloads and loop in this process (the Rust API), from the C process's starting state");
        println!(
            "{:>8} | {:>8} | {:>8} | {:>8} | {:>8} | {:>24}",
            "batch", "C", "twin", "E1 row", "C/twin", "vs best peer: C, twin"
        );
        let fig = |x: Option<f64>| x.map_or_else(|| "-".into(), |x| format!("{x:.2}"));
        for &b in self.ratio.keys() {
            let vs = match best(b).map(|(p, v)| (p, self.vs_peer(&v, b))) {
                Some((p, (Some(c), Some(rust)))) => format!("{c:.2}, {rust:.2} ({p})"),
                _ => "-".into(),
            };
            println!(
                "{:>8} | {:>8} | {:>8} | {:>8} | {:>8} | {vs:>24}",
                batch_key(b),
                fig(med(&self.c, b)),
                fig(med(&self.rust, b)),
                fig(e1(b)),
                fig(med(&self.ratio, b)),
            );
        }
        if let Some((b, r)) = Self::worst(&self.ratio) {
            println!(
                "target: C row within {TARGET_C_OVER_RUST}x of the Rust row (per run, its ratio vs any peer over the Rust row's is the inverse) at single and every batch >= {TARGET_MIN_BATCH}: worst {r:.2} at {} ({})",
                batch_key(b),
                met(r <= TARGET_C_OVER_RUST)
            );
        }
    }

    /// The report's `c_abi` section.
    pub fn json(
        &self,
        e1: impl Fn(usize) -> Option<f64>,
        best: impl Fn(usize) -> Option<(String, Vec<f64>)>,
    ) -> Value {
        if !self.ready() {
            let why = match &self.state {
                PeerState::Unavailable(why) => why.clone(),
                PeerState::Ready(_) => "no run finished".into(),
            };
            return json!({ "unavailable": why });
        }
        let runs = |m: &PerBatch, b: usize| -> Vec<f64> {
            m.get(&b)
                .map(|v| v.iter().map(|&x| round2(x)).collect())
                .unwrap_or_default()
        };
        let mut per = Map::new();
        for &b in self.ratio.keys() {
            let best = best(b);
            let (c_vs, rust_vs) = best
                .as_ref()
                .map_or((None, None), |(_, v)| self.vs_peer(v, b));
            per.insert(
                batch_key(b),
                json!({
                    "c_ns_per_page": med(&self.c, b).map(round2),
                    "c_ns_per_page_runs": runs(&self.c, b),
                    "twin_ns_per_page": med(&self.rust, b).map(round2),
                    "twin_ns_per_page_runs": runs(&self.rust, b),
                    "c_over_twin": med(&self.ratio, b).map(round2),
                    "c_over_twin_runs": runs(&self.ratio, b),
                    "e1_row_ns_per_page": e1(b).map(round2),
                    "best_peer": best.as_ref().map(|(p, _)| p.clone()),
                    "c_ratio_vs_best_peer": c_vs.map(round2),
                    "twin_ratio_vs_best_peer": rust_vs.map(round2),
                }),
            );
        }
        let worst = Self::worst(&self.ratio);
        json!({
            "what": "the C harness against libiopages (one process per run) beside its Rust twin: the same workloads and loop (first byte written through an array of addresses) in-process from the same state (a new 64 MiB arena, a new handle, each batch warmed once); ratios per run, median",
            "batches": per,
            "target": {
                "what": "C ns over the twin's at the single-page API and every batch >= from_batch, per run then the median (per run, the C row's ratio vs any peer over the twin's is the inverse of this)",
                "max": TARGET_C_OVER_RUST,
                "from_batch": TARGET_MIN_BATCH,
                "worst": worst.map(|(b, r)| json!({ "batch": batch_key(b), "ratio": round2(r) })),
                "met": worst.is_some_and(|(_, r)| r <= TARGET_C_OVER_RUST),
            },
        })
    }
}
