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

use crate::plot::{line_plot, Series};
use crate::{met, progress, round2, write_json, BenchError, BenchOptions};
use iopages::{
    Gfp, HugePages, KvPolicy, Kvmalloc, Page, PageAllocator, PageCache, PageCacheConfig, Vmalloc,
    VmallocConfig, PAGE_SIZE,
};
use serde_json::{json, Value};
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
        if rng % 10 == 0 {
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
        self.alloc.free_pages_bulk(&self.pinned_down);
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

fn run_policy(
    mib: u64,
    policy: KvPolicy,
    area_cache: bool,
    commits: usize,
    sizes: &[usize],
) -> Result<(Sample, (usize, usize)), BenchError> {
    let mut arena = build(mib)?;
    let spread = arena.spread();
    let vm_cfg = if area_cache {
        VmallocConfig::default()
    } else {
        VmallocConfig {
            cache_max_areas: 0,
            ..VmallocConfig::default()
        }
    };
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
    let modes = [
        ("legacy", KvPolicy::Legacy, true),
        ("failfast", KvPolicy::FailFast, true),
        ("failfast, no area cache", KvPolicy::FailFast, false),
    ];
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); modes.len()];
    let mut spread = (0, 1);
    for run in 0..runs {
        for (i, &(_, policy, cache)) in modes.iter().enumerate() {
            let (s, sp) = run_policy(mib, policy, cache, commits, &sizes)?;
            samples[i].push(s);
            spread = sp;
        }
        progress("kvmalloc", format!("run {}/{runs} done", run + 1));
    }
    let med = |i: usize, f: fn(&Sample) -> f64| median(samples[i].iter().map(f).collect());
    let (legacy_cpu, failfast_cpu) = (med(0, |s| s.cpu_us), med(1, |s| s.cpu_us));
    let (legacy_rate, failfast_rate) = (med(0, |s| s.commits_s), med(1, |s| s.commits_s));
    let cpu_ratio = legacy_cpu / failfast_cpu;
    let commit_ratio = failfast_rate / legacy_rate;

    println!();
    println!(
        "kvmalloc (E5): {commits} commits per run, median of {runs} runs; unmovable pages in {} of {} pageblocks",
        spread.0, spread.1
    );
    println!(
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
    );
    for (i, (name, _, _)) in modes.iter().enumerate() {
        println!(
            "{:>23} | {:>18.1} | {:>18.1} | {:>10.0} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.2} | {:>9.2}",
            name,
            med(i, |s| s.cpu_us),
            med(i, |s| s.process_cpu_us),
            med(i, |s| s.commits_s),
            med(i, |s| s.reclaim_share) * 100.0,
            med(i, |s| s.compact_share) * 100.0,
            med(i, |s| s.map_share) * 100.0,
            med(i, |s| s.contiguous_share) * 100.0,
            med(i, |s| s.maps_per_commit),
            med(i, |s| s.cache_hits_per_commit),
        );
    }
    println!(
        "seed 003 (XFS CIL, kernel): ~{SEED_CPU_PER_ALLOC_RATIO}× less CPU per costly kvmalloc, commit rate more than {SEED_COMMIT_RATIO}× (kvmalloc 31.6 % of CPU before)"
    );
    println!(
        "without vmalloc's area cache, fail-fast against legacy: CPU {:.2}×, commits {:.2}×",
        legacy_cpu / med(2, |s| s.cpu_us),
        med(2, |s| s.commits_s) / legacy_rate
    );
    println!(
        "target cpu_ratio >= 5: {cpu_ratio:.2} ({}); target commit_ratio >= 2: {commit_ratio:.2} ({})",
        met(cpu_ratio >= 5.0),
        met(commit_ratio >= 2.0)
    );

    let (json_path, svg_path) = opts.paths("kvmalloc");
    let series: Vec<Series> = modes
        .iter()
        .enumerate()
        .map(|(i, (n, _, _))| Series {
            label: format!("{n}: caller CPU µs per kvmalloc+kvfree"),
            points: samples[i]
                .iter()
                .enumerate()
                .map(|(r, s)| ((r + 1) as f64, s.cpu_us))
                .collect(),
        })
        .collect();
    line_plot(
        &svg_path,
        "E5: kvmalloc in a fragmented arena full of cache, each run",
        "run",
        "µs per kvmalloc+kvfree",
        &series,
    )?;
    let rows = |i: usize| {
        json!({
            "cpu_us_per_alloc": samples[i].iter().map(|s| round2(s.cpu_us)).collect::<Vec<_>>(),
            "process_cpu_us_per_commit": samples[i].iter().map(|s| round2(s.process_cpu_us)).collect::<Vec<_>>(),
            "commits_per_s": samples[i].iter().map(|s| round2(s.commits_s)).collect::<Vec<_>>(),
            "reclaim_share": samples[i].iter().map(|s| s.reclaim_share).collect::<Vec<_>>(),
            "compact_share": samples[i].iter().map(|s| s.compact_share).collect::<Vec<_>>(),
            "contiguous_share": samples[i].iter().map(|s| s.contiguous_share).collect::<Vec<_>>(),
            "maps_per_commit": samples[i].iter().map(|s| s.maps_per_commit).collect::<Vec<_>>(),
            "cache_hits_per_commit": samples[i].iter().map(|s| s.cache_hits_per_commit).collect::<Vec<_>>(),
            "mmap_share": samples[i].iter().map(|s| s.map_share).collect::<Vec<_>>(),
        })
    };
    let report = json!({
        "experiment": "E5 kvmalloc",
        "machine": crate::machine(),
        "settings": {
            "runs": runs, "commits": commits, "arena_mib": mib,
            "sizes_kib": sizes.iter().map(|s| s >> 10).collect::<Vec<_>>(),
            "unmovable_stride": UNMOVABLE_STRIDE,
            "unmovable_pageblocks": spread.0, "pageblocks": spread.1,
        },
        "legacy": rows(0),
        "failfast": rows(1),
        "failfast_no_area_cache": rows(2),
        "seed": { "cpu_per_alloc_ratio": SEED_CPU_PER_ALLOC_RATIO, "commit_ratio": SEED_COMMIT_RATIO },
        "summary": {
            "cpu_ratio": cpu_ratio,
            "commit_ratio": commit_ratio,
            "legacy_cpu_us_per_alloc": round2(legacy_cpu),
            "failfast_cpu_us_per_alloc": round2(failfast_cpu),
            "legacy_commits_per_s": round2(legacy_rate),
            "failfast_commits_per_s": round2(failfast_rate),
            "cpu_ratio_without_area_cache": legacy_cpu / med(2, |s| s.cpu_us),
            "commit_ratio_without_area_cache": med(2, |s| s.commits_s) / legacy_rate,
            "targets_met": cpu_ratio >= 5.0 && commit_ratio >= 2.0,
        },
    });
    write_json(&json_path, &report)?;
    progress(
        "kvmalloc",
        format!("wrote {} and {}", json_path.display(), svg_path.display()),
    );
    Ok(report)
}
