//! E2 and E3: the crypt target's write path.
//!
//! Owns: E2 — 1 MiB sequential writes at queue depth 256 through one
//! worker onto the page-store RAM disk, for each out-page strategy, beside
//! two reference rates measured in the same run (the bare AES-XTS rate over
//! the same bytes, and the pipeline writing through a reused out buffer:
//! no allocation at all); E3 — N writer threads with the page limit close
//! to its threshold, the limit checked exactly and approximately. Must
//! never: report a rate whose writes did not all succeed.

use crate::harness::{interleave, Plot, PlotFile, Report, Table};
use crate::measure::median;
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages::{HugePages, PageAllocator};
use iopages_crypt::backend::{Backend, PageStore};
use iopages_crypt::queue::{CryptQueue, QueueConfig};
use iopages_crypt::strategy::{LimitCheck, Strategy};
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig, TargetStats};
use iopages_crypt::XtsCipher;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const SECTOR_BYTES: usize = 4096;
const QUEUE_DEPTH: usize = 256;
/// dm-crypt's page pool keeps BIO_MAX_VECS (256) pages.
const MIN_NR: usize = 256;
/// The seed's figures (000): fio, 1 MiB writes at depth 256 on an
/// encrypted RAM device, before and after bulk mempool allocation.
const SEED_PER_PAGE_MIB_S: f64 = 1301.0;
const SEED_BULK_MIB_S: f64 = 1402.0;

fn key() -> Vec<u8> {
    (0..64u8)
        .map(|i| i.wrapping_mul(29).wrapping_add(7))
        .collect()
}

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(e.to_string())
}

/// The rows of E2, in the order they are measured in each run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Cipher,
    CipherCold,
    NoAlloc,
    Strategy(Strategy),
}

impl Mode {
    const ALL: [Mode; 6] = [
        Mode::Cipher,
        Mode::CipherCold,
        Mode::NoAlloc,
        Mode::Strategy(Strategy::PerPage),
        Mode::Strategy(Strategy::Bulk),
        Mode::Strategy(Strategy::Compound),
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Cipher => "cipher",
            Mode::CipherCold => "cipher_cold",
            Mode::NoAlloc => "noalloc",
            Mode::Strategy(Strategy::PerPage) => "per_page",
            Mode::Strategy(Strategy::Bulk) => "bulk",
            Mode::Strategy(Strategy::Compound) => "compound",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Mode::Cipher => "bare AES-XTS over the same bytes (physical limit)",
            Mode::CipherCold => "bare AES-XTS into a disk-sized buffer, 1 MiB on each time",
            Mode::NoAlloc => "pipeline, reused out buffer (no allocation)",
            Mode::Strategy(Strategy::PerPage) => "per-page: mempool, one page at a time",
            Mode::Strategy(Strategy::Bulk) => "bulk: bulk allocator, then mempool bulk",
            Mode::Strategy(Strategy::Compound) => "compound: high order, NORETRY, stepping down",
        }
    }
}

/// One E2 sample.
#[derive(Clone, Copy, Default)]
struct Sample {
    mib_s: f64,
    iops: f64,
    /// Share of the worker's write time spent allocating and freeing.
    alloc_share: f64,
    /// Share of the wall time the worker spent inside writes.
    busy: f64,
}

fn stats_delta(a: TargetStats, b: TargetStats) -> (u64, Duration, Duration) {
    (
        b.writes - a.writes,
        (b.alloc_time + b.free_time).saturating_sub(a.alloc_time + a.free_time),
        b.write_time.saturating_sub(a.write_time),
    )
}

/// Write `n` MiB through a queue of one worker, sequentially from `*pos`
/// (in MiB, wrapping at the disk's end).
fn pipeline_sample(
    target: &Arc<CryptTarget<CipherPool>>,
    mode: Mode,
    plain: &Arc<[u8]>,
    n: usize,
    pos: &mut usize,
) -> Result<Sample, BenchError> {
    pipeline_sample_workers(target, mode, plain, n, pos, 1)
}

/// [`pipeline_sample`] through a queue of `workers` workers. The clock runs
/// on the submitting thread from before the first submission to after the
/// queue is idle, so it covers every write (it can only under-report).
fn pipeline_sample_workers(
    target: &Arc<CryptTarget<CipherPool>>,
    mode: Mode,
    plain: &Arc<[u8]>,
    n: usize,
    pos: &mut usize,
    workers: usize,
) -> Result<Sample, BenchError> {
    let disk_mib = (target.size_bytes() as usize) / MIB;
    if let Mode::Strategy(s) = mode {
        target.out_pages().set_strategy(s);
    }
    let q = CryptQueue::new(
        Arc::clone(target),
        QueueConfig {
            queue_depth: QUEUE_DEPTH,
            workers,
            preallocated_out: mode == Mode::NoAlloc,
        },
    )
    .map_err(workload)?;
    let failed = Arc::new(AtomicUsize::new(0));
    let before = target.stats();
    let start = Instant::now();
    for _ in 0..n {
        let f = Arc::clone(&failed);
        q.submit_write((*pos * MIB) as u64, Arc::clone(plain), move |r| {
            if r.is_err() {
                f.fetch_add(1, Ordering::Relaxed);
            }
        });
        *pos = (*pos + 1) % disk_mib;
    }
    q.wait_idle();
    let secs = start.elapsed().as_secs_f64();
    drop(q);
    let (writes, alloc, busy) = stats_delta(before, target.stats());
    let failed = failed.load(Ordering::Relaxed);
    if failed > 0 || writes != n as u64 {
        return Err(workload(format!(
            "crypt: {failed} of {n} writes failed ({writes} completed)"
        )));
    }
    Ok(Sample {
        mib_s: n as f64 / secs,
        iops: n as f64 / secs,
        alloc_share: if busy.is_zero() {
            0.0
        } else {
            alloc.as_secs_f64() / busy.as_secs_f64()
        },
        busy: busy.as_secs_f64() / secs,
    })
}

/// The bare cipher over the same bytes: `plain` (1 MiB for E2, E3's write
/// size for E3) encrypted `n` times on this thread, into `dst` one
/// `plain`-sized slot at a time (a slot-sized `dst` is reused and stays in
/// cache; a disk-sized one is written as a RAM disk's memory is).
fn cipher_sample(cipher: &mut XtsCipher, plain: &[u8], dst: &mut [u8], n: usize) -> Sample {
    let len = plain.len();
    let slots = dst.len() / len;
    let start = Instant::now();
    for i in 0..n {
        let out = &mut dst[(i % slots) * len..][..len];
        cipher
            .encrypt_sectors((i * len / SECTOR_BYTES) as u64, plain, out)
            .expect("whole sectors");
        std::hint::black_box(&mut *dst);
    }
    let secs = start.elapsed().as_secs_f64();
    Sample {
        mib_s: (n * len) as f64 / MIB as f64 / secs,
        iops: n as f64 / secs,
        alloc_share: 0.0,
        busy: 1.0,
    }
}

/// 1, 2, 4, … up to `cores`, and `cores` itself.
fn ladder_to(cores: usize) -> Vec<usize> {
    let mut v = vec![1];
    while v.last().unwrap() * 2 <= cores {
        v.push(v.last().unwrap() * 2);
    }
    if *v.last().unwrap() != cores {
        v.push(cores);
    }
    v
}

/// E2 with one worker, then the bulk pipeline at 1, 2, 4, … workers up to
/// the cores. Returns the report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    run_with_workers(opts, None)
}

/// E2's stack: an arena of `arena_mib`, a page-store RAM disk of
/// `disk_mib`, and a bulk-strategy target with `ciphers` cipher instances.
fn e2_target(
    arena_mib: usize,
    disk_mib: usize,
    ciphers: usize,
) -> Result<(PageAllocator, Arc<CryptTarget<CipherPool>>), BenchError> {
    let alloc = PageAllocator::builder()
        .size_bytes((arena_mib as u64) << 20)
        .huge_pages(HugePages::Try)
        .populate(true)
        .build()?;
    let store: Arc<dyn Backend> =
        Arc::new(PageStore::new(&alloc, (disk_mib as u64) << 20).map_err(workload)?);
    let cipher = XtsCipher::new(&key(), SECTOR_BYTES, 0).map_err(workload)?;
    let target = CryptTarget::new(
        &alloc,
        CipherPool::new(cipher, ciphers).map_err(workload)?,
        store,
        TargetConfig {
            strategy: Strategy::Bulk,
            min_nr: MIN_NR,
            ..TargetConfig::default()
        },
    )
    .map_err(workload)?;
    Ok((alloc, Arc::new(target)))
}

/// E2's scaling part: the bulk pipeline with `n` workers (its own target
/// with `n` cipher instances), median of `runs` samples of `sample_mib`.
fn workers_sample(n: usize, runs: usize, sample_mib: usize) -> Result<f64, BenchError> {
    let disk_mib = 256;
    let (alloc, target) = e2_target(1024, disk_mib, n)?;
    let plain: Arc<[u8]> = (0..MIB).map(|i| (i * 131 % 251) as u8).collect();
    let mut pos = 0;
    let bulk = Mode::Strategy(Strategy::Bulk);
    pipeline_sample_workers(&target, bulk, &plain, disk_mib, &mut pos, n)?;
    let mut v = Vec::new();
    for _ in 0..runs {
        v.push(pipeline_sample_workers(&target, bulk, &plain, sample_mib, &mut pos, n)?.mib_s);
    }
    drop(target);
    alloc
        .leak_check()
        .map_err(|a| workload(format!("crypt: pages leaked: {a}")))?;
    Ok(median(&v))
}

/// E2's settings (the report's `settings`).
#[derive(Serialize)]
struct E2Settings {
    runs: usize,
    sample_mib: usize,
    write_bytes: usize,
    queue_depth: usize,
    workers: usize,
    disk_mib: usize,
    arena_mib: usize,
    backend: &'static str,
    cipher: &'static str,
    min_nr: usize,
}

const E2_SETTINGS: E2Settings = E2Settings {
    runs: 7,
    sample_mib: 2048,
    write_bytes: MIB,
    queue_depth: QUEUE_DEPTH,
    workers: 1,
    disk_mib: 256,
    arena_mib: 1024,
    backend: "page-store RAM disk",
    cipher: "aes-xts-plain64, 512-bit key",
    min_nr: MIN_NR,
};

/// One row of E2's report: a mode's samples, run by run.
#[derive(Serialize)]
struct E2Row {
    describe: &'static str,
    mib_s: Vec<f64>,
    iops: Vec<f64>,
    alloc_share: Vec<f64>,
    worker_busy: Vec<f64>,
}

/// The bulk pipeline with `workers` workers against its physical bound.
#[derive(Serialize)]
struct ScalingRow {
    workers: usize,
    bulk_mib_s: f64,
    bound_mib_s: f64,
    vs_bound: f64,
}

/// E2's figures: medians, and the ratios the targets are about, each the
/// median over runs of that run's ratio (samples taken side by side).
#[derive(Serialize)]
struct E2Summary {
    sector_bytes: usize,
    cipher_mib_s: f64,
    noalloc_mib_s: f64,
    per_page_mib_s: f64,
    bulk_mib_s: f64,
    compound_mib_s: f64,
    bulk_vs_noalloc: f64,
    bulk_vs_cipher: f64,
    bulk_vs_cipher_cold: f64,
    ratios: &'static str,
    bulk_vs_noalloc_of_medians: f64,
    bulk_vs_cipher_of_medians: f64,
    bulk_vs_per_page: f64,
    compound_vs_per_page: f64,
    workers_scaling: Vec<ScalingRow>,
    cores: usize,
    workers_eq_cores_vs_bound: Option<f64>,
    target_workers_eq_cores_min: f64,
}

#[derive(Serialize)]
struct SeedFigures {
    per_page_mib_s: f64,
    bulk_mib_s: f64,
}

/// Everything of E2's report after `settings`.
#[derive(Serialize)]
struct E2Body {
    rows: BTreeMap<&'static str, E2Row>,
    seed: SeedFigures,
    summary: E2Summary,
}

/// E2's samples, `[mode][run]`, in `Mode::ALL`'s order.
struct E2Samples(Vec<Vec<Sample>>);

impl E2Samples {
    fn of(&self, m: Mode) -> &[Sample] {
        &self.0[Mode::ALL
            .iter()
            .position(|&x| x == m)
            .expect("a mode of ALL")]
    }

    fn median(&self, m: Mode, f: fn(&Sample) -> f64) -> f64 {
        median(&self.of(m).iter().map(f).collect::<Vec<_>>())
    }

    fn range(&self, m: Mode) -> (f64, f64) {
        let v = self.of(m).iter().map(|s| s.mib_s);
        (
            v.clone().fold(f64::INFINITY, f64::min),
            v.fold(0.0, f64::max),
        )
    }

    /// The median over runs of `a`'s rate over `b`'s in the same run: a
    /// slow second on a shared machine lowers both sides of one ratio
    /// instead of one side of the medians.
    fn paired(&self, a: Mode, b: Mode) -> f64 {
        let r: Vec<f64> = self
            .of(a)
            .iter()
            .zip(self.of(b))
            .map(|(x, y)| x.mib_s / y.mib_s)
            .collect();
        median(&r)
    }
}

/// 1 MiB writes through the target for every mode, interleaved run by
/// run after a format pass.
fn e2_measure(target: &Arc<CryptTarget<CipherPool>>) -> Result<E2Samples, BenchError> {
    let st = &E2_SETTINGS;
    let mut bare = XtsCipher::new(&key(), SECTOR_BYTES, 0).map_err(workload)?;
    let plain: Arc<[u8]> = (0..MIB).map(|i| (i * 131 % 251) as u8).collect();
    let mut dst = vec![0u8; MIB];
    // Touched now, so that no sample pays for faulting it in.
    let mut cold = vec![1u8; st.disk_mib * MIB];
    // Format: every block of the disk holds a page from here on, so each
    // write replaces (and frees) as many pages as it stores. This warms
    // the pipeline and the arena's lists for every mode.
    let mut pos = 0;
    let bulk = Mode::Strategy(Strategy::Bulk);
    pipeline_sample(target, bulk, &plain, st.disk_mib, &mut pos)?;
    cipher_sample(&mut bare, &plain, &mut dst, 64);
    let samples = interleave(
        "crypt",
        Mode::ALL.len(),
        st.runs,
        &mut pos,
        |_, _| Ok(()),
        |pos, i| {
            Ok(match Mode::ALL[i] {
                Mode::Cipher => cipher_sample(&mut bare, &plain, &mut dst, st.sample_mib),
                Mode::CipherCold => cipher_sample(&mut bare, &plain, &mut cold, st.sample_mib),
                mode => pipeline_sample(target, mode, &plain, st.sample_mib, pos)?,
            })
        },
    )?;
    Ok(E2Samples(samples))
}

/// The bulk pipeline at each worker count of `ladder`, against
/// min(workers, cores) × `cipher_mib_s`; a figure over 1.1 × that fails.
fn e2_scaling(ladder: &[usize], cipher_mib_s: f64) -> Result<Vec<ScalingRow>, BenchError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    for &n in ladder {
        let mib_s = workers_sample(n, 3, E2_SETTINGS.sample_mib)?;
        let bound = n.min(cores) as f64 * cipher_mib_s;
        within_bound(&format!("E2 with {n} workers"), mib_s, bound * 1.1)?;
        progress(
            "crypt",
            format!(
                "E2 {n} workers: bulk {mib_s:.0} MiB/s = {:.2} × min(workers, cores) × the one-core cipher",
                mib_s / bound
            ),
        );
        rows.push(ScalingRow {
            workers: n,
            bulk_mib_s: round2(mib_s),
            bound_mib_s: round2(bound),
            vs_bound: mib_s / bound,
        });
    }
    Ok(rows)
}

fn e2_summary(s: &E2Samples, scaling: Vec<ScalingRow>) -> E2Summary {
    let mib = |m: Mode| s.median(m, |x| x.mib_s);
    let bulk = Mode::Strategy(Strategy::Bulk);
    let (cipher, noalloc) = (mib(Mode::Cipher), mib(Mode::NoAlloc));
    let per_page = mib(Mode::Strategy(Strategy::PerPage));
    let compound = mib(Mode::Strategy(Strategy::Compound));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let at_cores = scaling
        .iter()
        .find(|r| r.workers == cores)
        .map(|r| r.vs_bound);
    E2Summary {
        sector_bytes: SECTOR_BYTES,
        cipher_mib_s: round2(cipher),
        noalloc_mib_s: round2(noalloc),
        per_page_mib_s: round2(per_page),
        bulk_mib_s: round2(mib(bulk)),
        compound_mib_s: round2(compound),
        bulk_vs_noalloc: s.paired(bulk, Mode::NoAlloc),
        bulk_vs_cipher: s.paired(bulk, Mode::Cipher),
        bulk_vs_cipher_cold: s.paired(bulk, Mode::CipherCold),
        ratios: "median over runs of each run's ratio",
        bulk_vs_noalloc_of_medians: mib(bulk) / noalloc,
        bulk_vs_cipher_of_medians: mib(bulk) / cipher,
        bulk_vs_per_page: mib(bulk) / per_page,
        compound_vs_per_page: compound / per_page,
        workers_scaling: scaling,
        cores,
        workers_eq_cores_vs_bound: at_cores,
        target_workers_eq_cores_min: 0.8,
    }
}

fn e2_table(s: &E2Samples, sum: &E2Summary) -> Table {
    let mut t = Table::new(format!(
        "\ncrypt (E2): 1 MiB sequential writes, queue depth {QUEUE_DEPTH}, one worker, page-store RAM disk; median of {} runs",
        E2_SETTINGS.runs
    ));
    t.row([
        format!("{:<58}", ""),
        format!("{:>7} {:>11}", "MiB/s", "min-max"),
        format!("{:>6}", "IOPS"),
        format!("{:>12}", "alloc+free %"),
        format!("{:>6}", "busy %"),
    ]);
    for m in Mode::ALL {
        let (lo, hi) = s.range(m);
        let share = if matches!(m, Mode::Cipher | Mode::CipherCold) {
            "-".to_string()
        } else {
            format!("{:.2}", s.median(m, |x| x.alloc_share) * 100.0)
        };
        t.row([
            format!("{:<58}", format!("{} ({})", m.name(), m.describe())),
            format!(
                "{:>7.0} {:>11}",
                s.median(m, |x| x.mib_s),
                format!("{lo:.0}-{hi:.0}")
            ),
            format!("{:>6.0}", s.median(m, |x| x.iops)),
            format!("{share:>12}"),
            format!("{:>6.1}", s.median(m, |x| x.busy) * 100.0),
        ]);
    }
    for (what, v) in [
        (
            "seed 000 (80 CPUs, fio on dm-crypt over a RAM device): before",
            SEED_PER_PAGE_MIB_S,
        ),
        (
            "seed 000: with bulk mempool allocation (the seed says ~6 %)",
            SEED_BULK_MIB_S,
        ),
    ] {
        t.row([
            format!("{what:<58}"),
            format!("{v:>7.0} {:>11}", ""),
            format!("{v:>6.0}"),
            String::new(),
        ]);
    }
    e2_target_lines(&mut t, sum);
    t
}

/// The lines under E2's table: bulk against per-page, and the targets.
fn e2_target_lines(t: &mut Table, sum: &E2Summary) {
    t.line(format!(
        "bulk vs per-page: ours {:+.1} %, seed {:+.1} %",
        (sum.bulk_vs_per_page - 1.0) * 100.0,
        (SEED_BULK_MIB_S / SEED_PER_PAGE_MIB_S - 1.0) * 100.0
    ));
    t.line(format!(
        "target bulk_vs_noalloc >= 0.97: {:.3} ({})",
        sum.bulk_vs_noalloc,
        met(sum.bulk_vs_noalloc >= 0.97)
    ));
    t.line(format!(
        "target bulk_vs_cipher >= 0.9: {:.3} ({}); into cold memory as the pipeline writes: {:.3}",
        sum.bulk_vs_cipher,
        met(sum.bulk_vs_cipher >= 0.9),
        sum.bulk_vs_cipher_cold
    ));
    t.line(format!(
        "(ratios: median over runs of each run's ratio; of the medians: bulk/noalloc {:.3}, bulk/cipher {:.3})",
        sum.bulk_vs_noalloc_of_medians, sum.bulk_vs_cipher_of_medians
    ));
    for r in &sum.workers_scaling {
        t.line(format!(
            "workers {:>2}: bulk {:>7.0} MiB/s, {:.2} × min(workers, cores) × the one-core cipher",
            r.workers, r.bulk_mib_s, r.vs_bound
        ));
    }
    t.line(match sum.workers_eq_cores_vs_bound {
        Some(x) => format!(
            "target with workers = cores ({}) >= 0.8 × cores × the one-core cipher: {x:.3} ({})",
            sum.cores,
            met(x >= 0.8)
        ),
        None => format!(
            "target with workers = cores: not measured (--workers did not include {})",
            sum.cores
        ),
    });
    t.line(format!(
        "target bulk and compound >= per-page: bulk {:.3}, compound {:.3} ({})",
        sum.bulk_vs_per_page,
        sum.compound_vs_per_page,
        met(sum.bulk_vs_per_page >= 1.0 && sum.compound_vs_per_page >= 1.0)
    ));
}

/// E2 with one worker, then the bulk pipeline at each count of `workers`
/// (default 1, 2, 4, … up to the cores).
pub fn run_with_workers(
    opts: &BenchOptions,
    workers: Option<&[usize]>,
) -> Result<Value, BenchError> {
    // `--quick` runs E2 whole: the full run takes under ten seconds, and
    // every shorter version tried reported other ratios than it (64 MiB
    // samples on a 64 MiB disk: bulk_vs_cipher 0.53-0.56 against 0.88;
    // 3 runs of 1 GiB: bulk_vs_noalloc 0.73 against 0.98, the bulk samples
    // falling from 10.1 to 7.3 GB/s between runs where the full run's stay
    // at 10.6-10.9).
    let _ = opts.quick;
    let st = &E2_SETTINGS;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ladder: Vec<usize> = workers.map_or_else(|| ladder_to(cores), <[usize]>::to_vec);
    if ladder.contains(&0) {
        return Err(workload("--workers must be at least 1"));
    }
    progress(
        "crypt",
        format!(
            "E2: {} runs; each sample writes {} MiB as 1 MiB writes at queue depth {QUEUE_DEPTH}, one worker, aes-xts-plain64 (512-bit key, {SECTOR_BYTES}-byte sectors), onto a {} MiB page-store RAM disk in a {} MiB arena (populated up front)",
            st.runs, st.sample_mib, st.disk_mib, st.arena_mib
        ),
    );
    let (alloc, target) = e2_target(st.arena_mib, st.disk_mib, 1)?;
    target.set_timed(true);
    let samples = e2_measure(&target)?;
    drop(target);
    alloc
        .leak_check()
        .map_err(|a| workload(format!("crypt: pages leaked: {a}")))?;
    // One worker encrypts every byte: no pipeline row may pass the bare
    // cipher's one-core rate, its best sample in this run (the one least
    // slowed by the machine), + 10 % as for E3.
    let best_cipher = samples.range(Mode::Cipher).1;
    for m in Mode::ALL {
        if !matches!(m, Mode::Cipher | Mode::CipherCold) {
            let mib_s = samples.median(m, |x| x.mib_s);
            within_bound(&format!("E2 {}", m.name()), mib_s, best_cipher * 1.1)?;
        }
    }
    // The workers ladder is held to, and measured against, the same
    // best sample: a median taken while the machine slowed the cipher
    // samples would make the bound too tight and the ratios too kind.
    let scaling = e2_scaling(&ladder, best_cipher)?;
    let summary = e2_summary(&samples, scaling);
    e2_table(&samples, &summary).print();
    e2_report(opts, &samples, summary)
}

/// E2's JSON report and plot (each run's MiB/s per mode).
fn e2_report(
    opts: &BenchOptions,
    samples: &E2Samples,
    summary: E2Summary,
) -> Result<Value, BenchError> {
    let series: Vec<Series> = Mode::ALL
        .iter()
        .map(|&m| Series {
            label: m.name().to_string(),
            points: samples
                .of(m)
                .iter()
                .enumerate()
                .map(|(r, s)| ((r + 1) as f64, s.mib_s))
                .collect(),
        })
        .collect();
    let rows = Mode::ALL
        .iter()
        .map(|&m| {
            let v = samples.of(m);
            let row = E2Row {
                describe: m.describe(),
                mib_s: v.iter().map(|s| round2(s.mib_s)).collect(),
                iops: v.iter().map(|s| round2(s.iops)).collect(),
                alloc_share: v.iter().map(|s| s.alloc_share).collect(),
                worker_busy: v.iter().map(|s| s.busy).collect(),
            };
            (m.name(), row)
        })
        .collect();
    let body = E2Body {
        rows,
        seed: SeedFigures {
            per_page_mib_s: SEED_PER_PAGE_MIB_S,
            bulk_mib_s: SEED_BULK_MIB_S,
        },
        summary,
    };
    Report::new("E2 crypt", E2_SETTINGS, body)
        .stem("crypt")
        .emit(
            opts,
            &[Plot::lines(
                PlotFile::Main,
                "E2: 1 MiB writes through the crypt target, each run",
                "run",
                "MiB/s",
                series,
            )],
        )
}

/// How E3 sets the page limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSetting {
    /// Just above what the writers hold at once: every check is close.
    Near,
    /// The default, 2 % of the arena: far from the writers' use.
    Default,
}

/// E3's write size: small writes, so the check is a visible share.
const E3_WRITE_BYTES: usize = 16 << 10;
const E3_REGION_BYTES: usize = 4 << 20;

/// One E3 sample: `threads` writers, `writes` writes each. Returns MiB/s
/// and, when `timed`, nanoseconds of limit checking per write.
///
/// The interval comes from the writers themselves: each takes its start
/// after the barrier and its end after its last write, and the sample runs
/// from the first start to the last end. (The main thread's own clock,
/// read after it left the barrier, could start when the writers had
/// nearly finished: with as many writers as cores it may not run until
/// then, which once printed 501 215 MiB/s from 2 cores.)
fn limit_sample(
    target: &Arc<CryptTarget<CipherPool>>,
    threads: usize,
    writes: usize,
    timed: bool,
) -> Result<(f64, f64), BenchError> {
    target.out_pages().set_timed_checks(timed);
    let before = target.out_pages().check_time();
    let plain: Arc<[u8]> = (0..E3_WRITE_BYTES).map(|i| (i * 7) as u8).collect();
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (target, plain, barrier) =
                (Arc::clone(target), Arc::clone(&plain), Arc::clone(&barrier));
            std::thread::spawn(move || -> std::io::Result<(Instant, Instant)> {
                let base = (t * E3_REGION_BYTES) as u64;
                let per = E3_REGION_BYTES / E3_WRITE_BYTES;
                barrier.wait();
                let t0 = Instant::now();
                for i in 0..writes {
                    target.write(base + ((i % per) * E3_WRITE_BYTES) as u64, &plain)?;
                }
                Ok((t0, Instant::now()))
            })
        })
        .collect();
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    for h in handles {
        let (t0, t1) = h
            .join()
            .map_err(|_| workload("crypt: an E3 writer panicked"))?
            .map_err(workload)?;
        first = Some(first.map_or(t0, |f| f.min(t0)));
        last = Some(last.map_or(t1, |l| l.max(t1)));
    }
    let secs = match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => return Err(workload("crypt: an E3 sample had no writers")),
    };
    target.out_pages().set_timed_checks(false);
    let after = target.out_pages().check_time();
    let total = (threads * writes) as f64;
    let check_ns = (after.1 - before.1).as_nanos() as f64 / total;
    Ok((total * E3_WRITE_BYTES as f64 / MIB as f64 / secs, check_ns))
}

/// The bare cipher's rate on one core for E3's writes (MiB/s), best of
/// `samples`: the physical bound of a sample is `min(threads, cores)`
/// times this.
fn e3_cipher_rate(samples: usize) -> Result<f64, BenchError> {
    let mut cipher = XtsCipher::new(&key(), SECTOR_BYTES, 0).map_err(workload)?;
    let plain: Vec<u8> = (0..E3_WRITE_BYTES).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; E3_WRITE_BYTES];
    Ok((0..samples)
        .map(|_| cipher_sample(&mut cipher, &plain, &mut dst, 4096).mib_s)
        .fold(0.0, f64::max))
}

/// Refuse a figure over the physical bound: it would be a broken clock.
fn within_bound(what: &str, mib_s: f64, bound: f64) -> Result<(), BenchError> {
    if mib_s > bound {
        return Err(workload(format!(
            "crypt: {what} measured {mib_s:.0} MiB/s, over the physical bound of {bound:.0} MiB/s (the cores used × the bare cipher's one-core rate measured in this run, + 10 %): the clock is wrong, not the code fast; refusing to report it"
        )));
    }
    Ok(())
}

/// E3's settings (the report's `settings`).
#[derive(Serialize)]
struct E3Settings {
    runs: usize,
    writes_per_thread: usize,
    write_bytes: usize,
    limit: String,
    strategy: &'static str,
    backend: &'static str,
    clock: &'static str,
    cipher_mib_s_one_core: f64,
    bound: &'static str,
}

/// One thread count of E3.
#[derive(Clone, Serialize)]
struct E3Row {
    threads: usize,
    limit_pages: usize,
    exact_mib_s: f64,
    approx_mib_s: f64,
    exact_runs: Vec<f64>,
    approx_runs: Vec<f64>,
    exact_check_ns_per_write: f64,
    approx_check_ns_per_write: f64,
    bound_mib_s: f64,
}

#[derive(Serialize)]
struct E3Summary {
    threads: Option<usize>,
    exact_mib_s: Option<f64>,
    approx_mib_s: Option<f64>,
    exact_check_ns_per_write: Option<f64>,
    approx_check_ns_per_write: Option<f64>,
}

impl E3Summary {
    /// The summary: the figures at the most threads.
    fn of(rows: &[E3Row]) -> E3Summary {
        let last = rows.last();
        E3Summary {
            threads: last.map(|r| r.threads),
            exact_mib_s: last.map(|r| r.exact_mib_s),
            approx_mib_s: last.map(|r| r.approx_mib_s),
            exact_check_ns_per_write: last.map(|r| r.exact_check_ns_per_write),
            approx_check_ns_per_write: last.map(|r| r.approx_check_ns_per_write),
        }
    }
}

/// E3's plot: MiB/s of each check, by writer threads.
fn e3_plot(rows: &[E3Row]) -> Plot {
    let pts = |f: fn(&E3Row) -> f64| -> Vec<(f64, f64)> {
        rows.iter().map(|r| (r.threads as f64, f(r))).collect()
    };
    Plot::lines(
        PlotFile::Main,
        "E3: writes with the page limit near its threshold",
        "writer threads",
        "MiB/s",
        vec![
            Series {
                label: "exact check".into(),
                points: pts(|r| r.exact_mib_s),
            },
            Series {
                label: "approximate check".into(),
                points: pts(|r| r.approx_mib_s),
            },
        ],
    )
}

#[derive(Serialize)]
struct E3Body {
    rows: Vec<E3Row>,
    summary: E3Summary,
}

/// E3 at `n` threads: its own arena and target, exact and approximate
/// checks interleaved run by run, every sample held to `bound`.
fn e3_row(
    n: usize,
    runs: usize,
    writes: usize,
    limit: LimitSetting,
    bound: f64,
) -> Result<E3Row, BenchError> {
    let disk = (n * E3_REGION_BYTES) as u64;
    let alloc = PageAllocator::builder()
        .size_bytes(disk + (256 << 20))
        .huge_pages(HugePages::Try)
        .build()?;
    let target = e3_target(&alloc, disk, n, limit)?;
    const CHECKS: [(LimitCheck, &str); 2] = [
        (LimitCheck::Exact, "exact"),
        (LimitCheck::Approximate, "approximate"),
    ];
    // The format pass warms both modes.
    limit_sample(&target, n, E3_REGION_BYTES / E3_WRITE_BYTES, false)?;
    let rates = interleave(
        "crypt",
        CHECKS.len(),
        runs,
        &mut (),
        |_, _| Ok(()),
        |_, c| {
            let (check, what) = CHECKS[c];
            target.out_pages().set_limit_check(check);
            let mib_s = limit_sample(&target, n, writes, false)?.0;
            within_bound(&format!("E3 {n} threads, {what} check"), mib_s, bound)?;
            Ok(mib_s)
        },
    )?;
    let mut ns = Vec::new();
    for (check, _) in CHECKS {
        target.out_pages().set_limit_check(check);
        ns.push(limit_sample(&target, n, writes / 4, true)?.1);
    }
    let (e, a) = (median(&rates[0]), median(&rates[1]));
    progress(
        "crypt",
        format!(
            "E3 {n} threads: exact {e:.0} MiB/s, approximate {a:.0} MiB/s; check {:.0} / {:.0} ns per write",
            ns[0], ns[1]
        ),
    );
    let row = E3Row {
        threads: n,
        limit_pages: target.out_pages().limit_pages(),
        exact_mib_s: round2(e),
        approx_mib_s: round2(a),
        exact_runs: rates[0].clone(),
        approx_runs: rates[1].clone(),
        exact_check_ns_per_write: round2(ns[0]),
        approx_check_ns_per_write: round2(ns[1]),
        bound_mib_s: round2(bound),
    };
    drop(target);
    alloc
        .leak_check()
        .map_err(|a| workload(format!("crypt: pages leaked: {a}")))?;
    Ok(row)
}

/// E3's target for `n` threads: the bulk strategy over a page-store RAM
/// disk of `disk` bytes in `alloc`, the page limit as `limit` sets it.
fn e3_target(
    alloc: &PageAllocator,
    disk: u64,
    n: usize,
    limit: LimitSetting,
) -> Result<Arc<CryptTarget<CipherPool>>, BenchError> {
    let store: Arc<dyn Backend> = Arc::new(PageStore::new(alloc, disk).map_err(workload)?);
    let limit_pages = match limit {
        LimitSetting::Near => Some(n * (E3_WRITE_BYTES / 4096) * 3 / 2),
        LimitSetting::Default => None,
    };
    let cipher = XtsCipher::new(&key(), SECTOR_BYTES, 0).map_err(workload)?;
    Ok(Arc::new(
        CryptTarget::new(
            alloc,
            CipherPool::new(cipher, n).map_err(workload)?,
            store,
            TargetConfig {
                strategy: Strategy::Bulk,
                limit_check: LimitCheck::Exact,
                min_nr: 64,
                limit_pages,
                ..TargetConfig::default()
            },
        )
        .map_err(workload)?,
    ))
}

fn e3_table(rows: &[E3Row], runs: usize, limit: LimitSetting) -> Table {
    let mut t = Table::new(format!(
        "\ncrypt limit (E3): {} KiB writes by N threads, page limit {}; MiB/s (median of {runs}) and time in the limit check per write (timed runs)",
        E3_WRITE_BYTES >> 10,
        if limit == LimitSetting::Near { "near its threshold" } else { "2 % of the arena" }
    ));
    t.row([
        format!("{:>7}", "threads"),
        format!("{:>8}", "limit"),
        format!("{:>10} {:>10}", "exact", "approx"),
        format!("{:>13} {:>13}", "exact ns/wr", "approx ns/wr"),
        format!("{:>6}", "ratio"),
    ]);
    for r in rows {
        t.row([
            format!("{:>7}", r.threads),
            format!("{:>8}", r.limit_pages),
            format!("{:>10.0} {:>10.0}", r.exact_mib_s, r.approx_mib_s),
            format!(
                "{:>13.1} {:>13.1}",
                r.exact_check_ns_per_write, r.approx_check_ns_per_write
            ),
            format!("{:>6.3}", r.approx_mib_s / r.exact_mib_s),
        ]);
    }
    t
}

/// E3: `threads` (or 1, 2, 4, … up to the cores) writers, limit checked
/// exactly and approximately.
pub fn run_limit(
    opts: &BenchOptions,
    threads: Option<usize>,
    limit: LimitSetting,
) -> Result<Value, BenchError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ladder: Vec<usize> = threads.map_or_else(|| ladder_to(cores), |n| vec![n]);
    if ladder.contains(&0) {
        return Err(workload("--threads must be at least 1"));
    }
    // `--quick` runs E3 whole too: a thread count takes a few seconds, and
    // a shorter run is a different measurement (fewer, shorter samples of
    // a ratio that is near 1 at few threads), not a smaller one.
    let (runs, writes) = (5, 20_000);
    // The physical bound, measured in this run: no sample may pass
    // min(threads, cores) × the bare cipher's one-core rate (+10 % for the
    // noise of a best-of-5 measurement).
    let cipher_mib_s = e3_cipher_rate(5)?;
    progress(
        "crypt",
        format!(
            "E3: bare cipher on one core {cipher_mib_s:.0} MiB/s ({} KiB writes)",
            E3_WRITE_BYTES >> 10
        ),
    );
    progress(
        "crypt",
        format!(
            "E3: threads {ladder:?}, {runs} runs of {writes} writes of {} KiB per thread, bulk strategy, page-store RAM disk, limit {}",
            E3_WRITE_BYTES >> 10,
            match limit {
                LimitSetting::Near => "near: 1.5 × the pages the writers hold at once",
                LimitSetting::Default => "2 % of the arena",
            }
        ),
    );
    let rows = ladder
        .iter()
        .map(|&n| {
            e3_row(
                n,
                runs,
                writes,
                limit,
                n.min(cores) as f64 * cipher_mib_s * 1.1,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    e3_table(&rows, runs, limit).print();
    let plot = e3_plot(&rows);
    let summary = E3Summary::of(&rows);
    let settings = E3Settings {
        runs,
        writes_per_thread: writes,
        write_bytes: E3_WRITE_BYTES,
        limit: format!("{limit:?}"),
        strategy: "bulk",
        backend: "page-store RAM disk",
        clock: "workers' own: first start after the barrier to last end",
        cipher_mib_s_one_core: round2(cipher_mib_s),
        bound: "min(threads, cores) x cipher_mib_s_one_core x 1.1; a sample over it fails the run",
    };
    Report::new("E3 crypt limit", settings, E3Body { rows, summary })
        .stem("crypt-limit")
        .emit(opts, &[plot])
}
