//! E5: kvmalloc in a fragmented arena full of cache, the seed's log-commit
//! workload, with the legacy policy (direct reclaim and compaction before
//! falling back) against fail-fast (fall back to vmalloc at once).
//!
//! Owns: building the arena (movable page-cache pages nearly everywhere,
//! unmovable pages scattered over most pageblocks, a little free memory in
//! single pages), the commit loop (kvmalloc a shadow buffer of 64 KiB–
//! 1 MiB, copy the item into it, kvfree), refilling the cache between
//! commits as the workload's reads would, and the report. Must never:
//! slow either side down on purpose — every cost is the allocator's own
//! work (shrinker scans, compaction scans and copies, mmap calls).

use crate::harness::{interleave, Plot, PlotFile, Report, Table};
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages::{
    Gfp, HugePages, KvPolicy, Kvmalloc, Page, PageAllocator, PageCache, PageCacheConfig, Vmalloc,
    VmallocConfig, PAGE_SIZE,
};
use serde::Serialize;
use serde_json::Value;
use std::time::{Duration, Instant};

/// The seed's figures (003, XFS CIL shadow buffers): kvmalloc's share of
/// CPU 31.6 % → about 18.8 %, ~5× less CPU per costly kvmalloc, commit
/// rate with 64 KiB items more than doubled.
const SEED_CPU_PER_ALLOC_RATIO: f64 = 5.0;
const SEED_COMMIT_RATIO: f64 = 2.0;
/// One unmovable page every this many frames (across every pageblock).
const UNMOVABLE_STRIDE: u32 = 16;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(e.to_string())
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock id is a constant the
    // kernel knows.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of the whole process (the caller and background reclaim).
fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as in `thread_cpu`.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

struct Arena {
    alloc: PageAllocator,
    cache: PageCache,
    pinned_down: Vec<Page>,
    target_cache: usize,
    next_key: u64,
}

/// Build the fragmented arena: fill with cache pages, punch a hole every
/// `UNMOVABLE_STRIDE` frames and fill the holes with unmovable pages, then
/// drop a tenth of the cache at random so the free memory is in single
/// pages scattered everywhere.
fn build(mib: u64) -> Result<Arena, BenchError> {
    let alloc = PageAllocator::builder()
        .size_bytes(mib << 20)
        .huge_pages(HugePages::Never)
        .build()?;
    // No background reclaim while the scene is set (it would shrink the
    // cache being filled); it runs during the commits.
    alloc.stop_kswapd();
    // Fill to the last page (past the watermarks), so that the holes
    // punched below are the only free memory when the unmovable pages are
    // allocated: they land in every pageblock, as after a long uptime.
    let cache = PageCache::with_config(
        &alloc,
        PageCacheConfig {
            gfp: Gfp::NOWAIT | Gfp::MEMALLOC,
            ..PageCacheConfig::default()
        },
    )
    .map_err(workload)?;
    let page = [0x5au8; PAGE_SIZE];
    let mut key = 0u64;
    while cache.insert(key, &page).is_ok() {
        key += 1;
    }
    let holes: Vec<u64> = (0..key)
        .filter(|&k| {
            cache
                .page_of(k)
                .is_some_and(|p| p.pfn() % UNMOVABLE_STRIDE == 0)
        })
        .collect();
    for &k in &holes {
        cache.remove(k);
    }
    // Unmovable pages until nothing is free: every hole gets one.
    let mut pinned_down = Vec::with_capacity(holes.len());
    while let Some(p) = alloc.alloc_pages(Gfp::NOWAIT | Gfp::MEMALLOC, 0) {
        pinned_down.push(p);
    }
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for k in 0..key {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if rng.is_multiple_of(10) {
            cache.remove(k);
        }
    }
    let target_cache = cache.len();
    alloc.start_kswapd();
    Ok(Arena {
        alloc,
        cache,
        pinned_down,
        target_cache,
        next_key: key,
    })
}

impl Arena {
    /// The workload's reads bring the cache back to its size.
    fn refill(&mut self) {
        let page = [0xa5u8; PAGE_SIZE];
        while self.cache.len() < self.target_cache {
            if self.cache.insert(self.next_key, &page).is_err() {
                break;
            }
            self.next_key += 1;
        }
    }

    /// Pageblocks holding at least one unmovable page, of all pageblocks.
    fn spread(&self) -> (usize, usize) {
        let mut blocks: Vec<u32> = self.pinned_down.iter().map(|p| p.pfn() >> 9).collect();
        blocks.sort_unstable();
        blocks.dedup();
        let total = self.alloc.arena().nr_pages() >> 9;
        (blocks.len(), total.max(1))
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.cache.clear();
        // SAFETY: the arena allocated the pinned-down pages itself and
        // hands them to nothing else; dropping it gives them up, once.
        unsafe { self.alloc.free_pages_bulk(&self.pinned_down) };
    }
}

#[derive(Clone, Copy, Default)]
struct Sample {
    /// Caller CPU per kvmalloc+kvfree, µs.
    cpu_us: f64,
    /// Process CPU (caller and background reclaim) per commit, copy
    /// included, µs.
    process_cpu_us: f64,
    /// Commits per second (wall time of the commits alone).
    commits_s: f64,
    /// Share of the caller's kvmalloc+kvfree time in direct reclaim and in
    /// compaction.
    reclaim_share: f64,
    compact_share: f64,
    /// Buffers served contiguously, of all.
    contiguous_share: f64,
    /// vmalloc's mmap calls per commit, and its lazy-cache hits per commit.
    maps_per_commit: f64,
    cache_hits_per_commit: f64,
    /// Share of the caller's time in vmalloc's mmap and munmap calls.
    map_share: f64,
}

/// vmalloc's settings: the default, or without its area cache.
fn vmalloc_config(area_cache: bool) -> VmallocConfig {
    if area_cache {
        VmallocConfig::default()
    } else {
        VmallocConfig {
            cache_max_areas: 0,
            ..VmallocConfig::default()
        }
    }
}

fn run_policy(
    mib: u64,
    policy: KvPolicy,
    area_cache: bool,
    commits: usize,
    sizes: &[usize],
) -> Result<(Sample, (usize, usize)), BenchError> {
    let mut arena = build(mib)?;
    let spread = arena.spread();
    let vm_cfg = vmalloc_config(area_cache);
    let kv = Kvmalloc::with_vmalloc(Vmalloc::with_config(&arena.alloc, vm_cfg).map_err(workload)?);
    let item: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 31) as u8).collect();
    // Warm up: one pass over the sizes, untimed, so that both policies
    // start with vmalloc's area cache as a running system has it.
    for &size in sizes {
        arena.refill();
        let buf = kv.kvmalloc(size, Gfp::KERNEL, policy).map_err(workload)?;
        kv.kvfree(buf);
    }
    let before = arena.alloc.stats();
    let vm_before = kv.vmalloc().stats();
    let kv_before = kv.stats(policy);
    let (mut cpu, mut wall, mut pcpu) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for (i, &size) in sizes.iter().cycle().take(commits).enumerate() {
        arena.refill();
        let (t0, c0, p0) = (Instant::now(), thread_cpu(), process_cpu());
        let mut buf = kv
            .kvmalloc(size, Gfp::KERNEL, policy)
            .map_err(|e| workload(format!("commit {i}: kvmalloc({size}): {e}")))?;
        let c1 = thread_cpu();
        buf.as_mut_slice().copy_from_slice(&item[..size]);
        std::hint::black_box(buf.as_slice()[size - 1]);
        let c2 = thread_cpu();
        kv.kvfree(buf);
        // The caller's CPU in kvmalloc and kvfree, not in the copy.
        cpu += (c1 - c0) + (thread_cpu() - c2);
        pcpu += process_cpu() - p0;
        wall += t0.elapsed();
    }
    let after = arena.alloc.stats();
    let st = kv.stats(policy);
    let contiguous = st.contiguous - kv_before.contiguous;
    let vm = kv.vmalloc().stats();
    let total = commits as u64;
    let reclaim_ns = (after.direct_reclaim_ns - before.direct_reclaim_ns) as f64;
    let compact_ns = (after.compact_ns - before.compact_ns) as f64;
    let wall_ns = wall.as_nanos().max(1) as f64;
    drop(kv);
    drop(arena);
    Ok((
        Sample {
            cpu_us: cpu.as_secs_f64() * 1e6 / commits as f64,
            process_cpu_us: pcpu.as_secs_f64() * 1e6 / commits as f64,
            commits_s: commits as f64 / wall.as_secs_f64(),
            reclaim_share: reclaim_ns / wall_ns,
            compact_share: compact_ns / wall_ns,
            contiguous_share: contiguous as f64 / total as f64,
            maps_per_commit: (vm.map_calls - vm_before.map_calls) as f64 / commits as f64,
            cache_hits_per_commit: (vm.cache_hits - vm_before.cache_hits) as f64 / commits as f64,
            map_share: ((vm.map_ns - vm_before.map_ns) + (vm.unmap_ns - vm_before.unmap_ns)) as f64
                / wall_ns,
        },
        spread,
    ))
}

fn median(v: Vec<f64>) -> f64 {
    crate::measure::median(&v)
}

/// E5. Returns the report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, commits, mib) = if opts.quick {
        (2, 150, 64u64)
    } else {
        (5, 1500, 256u64)
    };
    // The seed's shadow buffers: 64 KiB objects mostly, some up to 1 MiB.
    let sizes: Vec<usize> = [64usize, 64, 64, 128, 64, 256, 64, 1024, 64, 512]
        .iter()
        .map(|k| k << 10)
        .collect();
    progress(
        "kvmalloc",
        format!(
            "E5: {runs} runs × {commits} commits per policy; shadow buffers of {:?} KiB in a {mib} MiB arena: page cache everywhere, an unmovable page every {UNMOVABLE_STRIDE} frames, a tenth free in single pages",
            sizes.iter().map(|s| s >> 10).collect::<Vec<_>>()
        ),
    );
    // Fragmentation (unmovable pageblocks, pageblocks) of the last run.
    let mut spread = (0, 1);
    let samples = interleave(
        "kvmalloc",
        MODES.len(),
        runs,
        &mut spread,
        |_, _| Ok(()),
        |spread, i| {
            let (_, policy, cache) = MODES[i];
            let (s, sp) = run_policy(mib, policy, cache, commits, &sizes)?;
            *spread = sp;
            Ok(s)
        },
    )?;
    let f = Figures { samples };
    table(&f, commits, runs, spread).print();
    let settings = Settings {
        runs,
        commits,
        arena_mib: mib,
        sizes_kib: sizes.iter().map(|s| s >> 10).collect(),
        unmovable_stride: UNMOVABLE_STRIDE,
        unmovable_pageblocks: spread.0,
        pageblocks: spread.1,
    };
    let series: Vec<Series> = MODES
        .iter()
        .zip(&f.samples)
        .map(|((n, _, _), v)| Series {
            label: format!("{n}: caller CPU µs per kvmalloc+kvfree"),
            points: v
                .iter()
                .enumerate()
                .map(|(r, s)| ((r + 1) as f64, s.cpu_us))
                .collect(),
        })
        .collect();
    let plot = Plot::lines(
        PlotFile::Main,
        "E5: kvmalloc in a fragmented arena full of cache, each run",
        "run",
        "µs per kvmalloc+kvfree",
        series,
    );
    Report::new("E5 kvmalloc", settings, body(&f))
        .stem("kvmalloc")
        .emit(opts, &[plot])
}

/// The policies compared: name, policy, vmalloc's area cache on.
const MODES: [(&str, KvPolicy, bool); 3] = [
    ("legacy", KvPolicy::Legacy, true),
    ("failfast", KvPolicy::FailFast, true),
    ("failfast, no area cache", KvPolicy::FailFast, false),
];

/// Every run's sample of each policy, `[policy][run]`.
struct Figures {
    samples: Vec<Vec<Sample>>,
}

impl Figures {
    fn med(&self, i: usize, f: fn(&Sample) -> f64) -> f64 {
        median(self.samples[i].iter().map(f).collect())
    }
    /// Legacy's caller CPU per allocation over policy `i`'s.
    fn cpu_ratio(&self, i: usize) -> f64 {
        self.med(0, |s| s.cpu_us) / self.med(i, |s| s.cpu_us)
    }
    /// Policy `i`'s commit rate over legacy's.
    fn commit_ratio(&self, i: usize) -> f64 {
        self.med(i, |s| s.commits_s) / self.med(0, |s| s.commits_s)
    }
}

fn table(f: &Figures, commits: usize, runs: usize, spread: (usize, usize)) -> Table {
    let (cpu_ratio, commit_ratio) = (f.cpu_ratio(1), f.commit_ratio(1));
    let mut t = Table::new("");
    t.line(format!(
        "kvmalloc (E5): {commits} commits per run, median of {runs} runs; unmovable pages in {} of {} pageblocks",
        spread.0, spread.1
    ));
    t.line(format!(
        "{:>23} | {:>18} | {:>18} | {:>10} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9}",
        "policy",
        "caller CPU µs/alloc",
        "process CPU µs/com",
        "commits/s",
        "reclaim %",
        "compact %",
        "mmap %",
        "contig. %",
        "maps/com",
        "hits/com"
    ));
    for (i, (name, _, _)) in MODES.iter().enumerate() {
        let m = |g: fn(&Sample) -> f64| f.med(i, g);
        t.line(format!(
            "{:>23} | {:>18.1} | {:>18.1} | {:>10.0} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.2} | {:>9.2}",
            name,
            m(|s| s.cpu_us),
            m(|s| s.process_cpu_us),
            m(|s| s.commits_s),
            m(|s| s.reclaim_share) * 100.0,
            m(|s| s.compact_share) * 100.0,
            m(|s| s.map_share) * 100.0,
            m(|s| s.contiguous_share) * 100.0,
            m(|s| s.maps_per_commit),
            m(|s| s.cache_hits_per_commit),
        ));
    }
    t.line(format!(
        "seed 003 (XFS CIL, kernel): ~{SEED_CPU_PER_ALLOC_RATIO}× less CPU per costly kvmalloc, commit rate more than {SEED_COMMIT_RATIO}× (kvmalloc 31.6 % of CPU before)"
    ));
    t.line(format!(
        "without vmalloc's area cache, fail-fast against legacy: CPU {:.2}×, commits {:.2}×",
        f.cpu_ratio(2),
        f.commit_ratio(2)
    ));
    t.line(format!(
        "target cpu_ratio >= 5: {cpu_ratio:.2} ({}); target commit_ratio >= 2: {commit_ratio:.2} ({})",
        met(cpu_ratio >= 5.0),
        met(commit_ratio >= 2.0)
    ));
    t
}

#[derive(Serialize)]
struct Settings {
    runs: usize,
    commits: usize,
    arena_mib: u64,
    sizes_kib: Vec<usize>,
    unmovable_stride: u32,
    unmovable_pageblocks: usize,
    pageblocks: usize,
}

/// One policy's figures, run by run.
#[derive(Serialize)]
struct Rows {
    cpu_us_per_alloc: Vec<f64>,
    process_cpu_us_per_commit: Vec<f64>,
    commits_per_s: Vec<f64>,
    reclaim_share: Vec<f64>,
    compact_share: Vec<f64>,
    contiguous_share: Vec<f64>,
    maps_per_commit: Vec<f64>,
    cache_hits_per_commit: Vec<f64>,
    mmap_share: Vec<f64>,
}

impl Rows {
    fn of(v: &[Sample]) -> Rows {
        let col = |f: fn(&Sample) -> f64| v.iter().map(f).collect::<Vec<_>>();
        Rows {
            cpu_us_per_alloc: col(|s| round2(s.cpu_us)),
            process_cpu_us_per_commit: col(|s| round2(s.process_cpu_us)),
            commits_per_s: col(|s| round2(s.commits_s)),
            reclaim_share: col(|s| s.reclaim_share),
            compact_share: col(|s| s.compact_share),
            contiguous_share: col(|s| s.contiguous_share),
            maps_per_commit: col(|s| s.maps_per_commit),
            cache_hits_per_commit: col(|s| s.cache_hits_per_commit),
            mmap_share: col(|s| s.map_share),
        }
    }
}

#[derive(Serialize)]
struct Seed {
    cpu_per_alloc_ratio: f64,
    commit_ratio: f64,
}

#[derive(Serialize)]
struct Summary {
    cpu_ratio: f64,
    commit_ratio: f64,
    legacy_cpu_us_per_alloc: f64,
    failfast_cpu_us_per_alloc: f64,
    legacy_commits_per_s: f64,
    failfast_commits_per_s: f64,
    cpu_ratio_without_area_cache: f64,
    commit_ratio_without_area_cache: f64,
    targets_met: bool,
}

#[derive(Serialize)]
struct Body {
    legacy: Rows,
    failfast: Rows,
    failfast_no_area_cache: Rows,
    seed: Seed,
    summary: Summary,
}

fn body(f: &Figures) -> Body {
    let (cpu_ratio, commit_ratio) = (f.cpu_ratio(1), f.commit_ratio(1));
    Body {
        legacy: Rows::of(&f.samples[0]),
        failfast: Rows::of(&f.samples[1]),
        failfast_no_area_cache: Rows::of(&f.samples[2]),
        seed: Seed {
            cpu_per_alloc_ratio: SEED_CPU_PER_ALLOC_RATIO,
            commit_ratio: SEED_COMMIT_RATIO,
        },
        summary: Summary {
            cpu_ratio,
            commit_ratio,
            legacy_cpu_us_per_alloc: round2(f.med(0, |s| s.cpu_us)),
            failfast_cpu_us_per_alloc: round2(f.med(1, |s| s.cpu_us)),
            legacy_commits_per_s: round2(f.med(0, |s| s.commits_s)),
            failfast_commits_per_s: round2(f.med(1, |s| s.commits_s)),
            cpu_ratio_without_area_cache: f.cpu_ratio(2),
            commit_ratio_without_area_cache: f.commit_ratio(2),
            targets_met: cpu_ratio >= 5.0 && commit_ratio >= 2.0,
        },
    }
}
