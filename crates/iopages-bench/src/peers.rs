//! E1 peers: the allocators users would pick instead of iopages, run as
//! separate processes, and the same workloads run in-process on iopages.
//!
//! Owns: building the peer harness (`scripts/setup-peers.sh`), running one
//! peer process per run and parsing its results, and the in-process iopages
//! versions of the peer workloads (first byte of each page written, LIFO
//! reuse, one thread on a new arena each run as each peer run is a new
//! process; producer/consumer pairs for the multi-thread part). Must never:
//! drop a peer silently — a peer that cannot be built or started is reported
//! with its reason and the others still run — nor time a multi-thread pass
//! from the main thread.
//!
//! Multi-thread clock (the same in the C harness): each worker reads the
//! monotonic clock and its own thread CPU time right after the start
//! barrier and again when it is done; the interval is the latest end minus
//! the earliest start. A main thread that starts a clock after the barrier
//! and stops it after joining may not run at all, with as many threads as
//! cores, until the workers are nearly done. The workers' CPU time is the
//! check: it cannot exceed min(threads, online CPUs) × the interval.

use crate::measure::{time_once, Sample};
use crate::BenchError;
use iopages::{Gfp, LocalAllocator, Page, PageAllocator};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// A batch's name in tables and reports ("single" for the single-page
/// API, batch 0 as the peer harness numbers it).
pub(crate) fn batch_key(b: usize) -> String {
    if b == 0 {
        "single".into()
    } else {
        b.to_string()
    }
}

/// The peers, in table order.
/// `dpdk` is DPDK's mempool as users create it (cache-line-aligned 4 KiB
/// buffers, padded to spread over memory channels); `dpdk-aligned` is the
/// same mempool laid out with page-aligned buffers, like every other row.
pub const PEERS: [&str; 6] = [
    "glibc",
    "jemalloc",
    "mimalloc",
    "tcmalloc",
    "dpdk",
    "dpdk-aligned",
];
/// Most a peer process may run for one pass before it is counted as failed.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a peer stands.
#[derive(Clone, Debug)]
pub enum PeerState {
    /// Built and usable: the harness binary.
    Ready(PathBuf),
    /// Not usable, and why.
    Unavailable(String),
}

/// One result line of a peer process (or of iopages' own run).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeerResult {
    /// `None`: single-thread; `Some(t)`: multi-thread with `t` threads.
    pub threads: Option<usize>,
    /// Batch size; 0 = the single-object API.
    pub batch: usize,
    /// ns per page (multi-thread: wall time per page and pair).
    pub ns_per_page: f64,
    /// The rest of a multi-thread result (`None` for single-thread).
    pub mt: Option<MtFigures>,
}

/// What a multi-thread pass gives besides wall ns per page per pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MtFigures {
    /// Pages allocated and freed per second by all pairs together.
    pub pages_per_s: f64,
    /// The workers' CPU time (producers and consumers) per page.
    pub cpu_ns_per_page: f64,
    /// Whether the clock passed its check (see [`clock_check`]).
    pub clock_ok: bool,
}

impl MtFigures {
    /// CPUs the workers kept busy on average over the interval.
    pub fn busy_cpus(&self) -> f64 {
        self.cpu_ns_per_page * self.pages_per_s / 1e9
    }
}

/// How far the workers' CPU time may exceed the physical bound before the
/// clock is called wrong (clock granularity, a worker's last slice).
pub const CLOCK_SLACK: f64 = 1.10;

/// CPUs online, as the C harness counts them (`_SC_NPROCESSORS_ONLN`).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
}

/// The physical bound: `threads` workers on `online` CPUs keep at most
/// min(threads, online) CPUs busy, so CPU time over the interval above that
/// (with [`CLOCK_SLACK`]) means the interval is too short.
pub fn clock_check(busy_cpus: f64, threads: usize, online: usize) -> bool {
    busy_cpus <= threads.min(online).max(1) as f64 * CLOCK_SLACK
}

/// One worker's clocks over its timed span: monotonic start and end, and
/// its own CPU time in between.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerClock {
    /// `CLOCK_MONOTONIC` right after the start barrier, ns.
    pub start_ns: u64,
    /// `CLOCK_MONOTONIC` when the worker was done, ns.
    pub end_ns: u64,
    /// `CLOCK_THREAD_CPUTIME_ID` consumed between the two, ns.
    pub cpu_ns: u64,
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime({clock}) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A worker's span being timed: begun right after the barrier.
struct Span {
    start_ns: u64,
    cpu0: u64,
}

impl Span {
    fn begin() -> Span {
        let start_ns = clock_ns(libc::CLOCK_MONOTONIC);
        Span {
            start_ns,
            cpu0: clock_ns(libc::CLOCK_THREAD_CPUTIME_ID),
        }
    }

    /// The CPU clock is read inside the wall span, so it is never longer.
    fn end(self) -> WorkerClock {
        let cpu_ns = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) - self.cpu0;
        WorkerClock {
            start_ns: self.start_ns,
            end_ns: clock_ns(libc::CLOCK_MONOTONIC),
            cpu_ns,
        }
    }
}

/// The result of a multi-thread pass of `threads / 2` pairs that moved
/// `pages_per_pair` pages each, from its workers' clocks: the interval runs
/// from the earliest start to the latest end.
pub fn mt_result(
    threads: usize,
    batch: usize,
    pages_per_pair: u64,
    clocks: &[WorkerClock],
    online: usize,
) -> PeerResult {
    let pairs = (threads / 2).max(1) as f64;
    let first = clocks.iter().map(|c| c.start_ns).min().unwrap_or(0);
    let last = clocks.iter().map(|c| c.end_ns).max().unwrap_or(0);
    let interval = last.saturating_sub(first).max(1) as f64;
    let cpu: f64 = clocks.iter().map(|c| c.cpu_ns as f64).sum();
    let pages = pages_per_pair.max(1) as f64;
    PeerResult {
        threads: Some(threads),
        batch,
        ns_per_page: interval / pages,
        mt: Some(MtFigures {
            pages_per_s: pairs * pages / interval * 1e9,
            cpu_ns_per_page: cpu / (pairs * pages),
            clock_ok: clock_check(cpu / interval, threads, online),
        }),
    }
}

/// The scripts directory of this source tree.
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts")
}

/// Build the peers into `dir` (installing Debian packages where missing and
/// allowed) and say where each stands.
pub fn setup(dir: &Path) -> Vec<(&'static str, PeerState)> {
    setup_with(&scripts_dir().join("setup-peers.sh"), dir)
}

/// [`setup`] with the build script at `script`.
fn setup_with(script: &Path, dir: &Path) -> Vec<(&'static str, PeerState)> {
    if !script.is_file() {
        // An installed binary (the Debian package, cargo install) has no
        // source tree to build the peers' C harness from.
        let why = format!(
            "the peers are built from the iopages source tree ({} is not here): run `iopages bench` in a checkout, or pass --no-peers",
            script.display()
        );
        return PEERS
            .iter()
            .map(|&name| (name, PeerState::Unavailable(why.clone())))
            .collect();
    }
    let ran = Command::new("bash").arg(script).arg(dir).status();
    PEERS
        .iter()
        .map(|&name| {
            let state = match &ran {
                Err(e) => {
                    PeerState::Unavailable(format!("could not run {}: {e}", script.display()))
                }
                Ok(_) => state_of(dir, name),
            };
            (name, state)
        })
        .collect()
}

/// Where the harness of `name` stands in `dir` after `setup`: its binary,
/// or the first line of the reason `setup-peers.sh` wrote.
pub fn state_of(dir: &Path, name: &str) -> PeerState {
    let bin = dir.join(format!("peer-{name}"));
    if bin.is_file() {
        return PeerState::Ready(bin);
    }
    let why = std::fs::read_to_string(dir.join(format!("peer-{name}.err")))
        .ok()
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "not built (see scripts/setup-peers.sh)".into());
    PeerState::Unavailable(why)
}

fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// One line of a peer's output (JSON: batch, ns_per_page, and for the
/// multi-thread part threads, pages_per_s, cpu_ns_per_page, clock_check).
fn parse_peer_line(line: &str) -> Result<PeerResult, String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("bad output line {line:?}: {e}"))?;
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    let (Some(batch), Some(ns)) = (num("batch"), num("ns_per_page")) else {
        return Err(format!("output line without batch or ns_per_page: {line}"));
    };
    let threads = num("threads").map(|t| t as usize);
    let mt = match threads {
        None => None,
        Some(_) => {
            let check = v.get("clock_check").and_then(serde_json::Value::as_str);
            let (Some(pages_per_s), Some(cpu_ns_per_page), Some("ok" | "failed")) =
                (num("pages_per_s"), num("cpu_ns_per_page"), check)
            else {
                return Err(format!(
                    "multi-thread line without pages_per_s, cpu_ns_per_page or clock_check \
                     (an old harness? rebuild it with scripts/setup-peers.sh): {line}"
                ));
            };
            Some(MtFigures {
                pages_per_s,
                cpu_ns_per_page,
                clock_ok: check == Some("ok"),
            })
        }
    };
    Ok(PeerResult {
        threads,
        batch: batch as usize,
        ns_per_page: ns,
        mt,
    })
}

/// One pass of a peer process: every single-thread batch, then every
/// (threads, batch) of the multi-thread part.
pub fn run_peer(
    bin: &Path,
    pages: u64,
    mt_pages: u64,
    batches: &[usize],
    threads: &[usize],
    mt_batches: &[usize],
) -> Result<Vec<PeerResult>, String> {
    // Both pipes are drained while it runs (a chatty peer, such as DPDK's
    // EAL, cannot block on a full pipe), and it is killed at the limit.
    let args: Vec<std::ffi::OsString> = [
        pages.to_string(),
        mt_pages.to_string(),
        join(batches),
        join(threads),
        join(mt_batches),
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    let dir = std::env::current_dir().map_err(|e| format!("no working directory: {e}"))?;
    let out = iopages_tools::run_tool(bin, &args, &dir, PEER_TIMEOUT, &[])?;
    if !out.status.success() {
        let first = out
            .stderr
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(format!("exited with {}: {first}", out.status));
    }
    let text = &out.stdout;
    let mut results = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        results.push(parse_peer_line(line)?);
    }
    let expected = batches.len() + threads.len() * mt_batches.len();
    if results.len() != expected {
        return Err(format!(
            "printed {} results, expected {expected}",
            results.len()
        ));
    }
    Ok(results)
}

#[inline]
fn touch(alloc: &PageAllocator, p: Page) {
    // SAFETY: the page is allocated to the caller and lies in the arena.
    unsafe { std::ptr::write_volatile(alloc.page_address(p), 1) };
}

/// Pages as the C harness holds them: by address. Every E1 row allocates
/// a batch into an array of addresses, writes each first byte through it
/// and frees from addresses, so every row runs the same loop.
#[derive(Clone, Copy)]
struct Addrs {
    base: usize,
}

impl Addrs {
    fn of(alloc: &PageAllocator) -> Addrs {
        Addrs {
            base: alloc.page_address(Page::from_pfn(0)) as usize,
        }
    }

    #[inline(always)]
    fn addr(self, p: Page) -> *mut u8 {
        (self.base + p.pfn() as usize * iopages::PAGE_SIZE) as *mut u8
    }

    /// The page at `a`, converted as the C header's inline free converts
    /// it: the frame number masked to 31 bits, which tells the compiler
    /// it is never `u32::MAX`, so the conversion loop has no panic branch
    /// and vectorises (the arena holds fewer than 2^31 pages).
    #[inline(always)]
    fn page(self, a: *mut u8) -> Page {
        Page::from_pfn(((a as usize - self.base) / iopages::PAGE_SIZE) as u32 & 0x7fff_ffff)
    }

    /// Up to `out.len()` pages into `out` as addresses, converted in the
    /// pass that takes them from the handle's cache, most recently freed
    /// first (as the C ABI's `iopages_local_alloc_bulk_ptrs` hands them
    /// out); how many.
    #[inline(always)]
    fn alloc(
        self,
        local: &mut LocalAllocator,
        spill: &mut Vec<Page>,
        out: &mut [*mut u8],
    ) -> usize {
        local.alloc_bulk_with(Gfp::KERNEL, out.len(), spill, |pages| {
            for (a, &p) in out.iter_mut().zip(pages.iter().rev()) {
                *a = self.addr(p);
            }
            pages.len()
        })
    }

    /// Free the pages at `addrs`, converted in the pass that puts them in
    /// the handle's cache.
    ///
    /// # Safety
    /// Each address is a page of this arena the caller allocated and owns,
    /// given once, not used afterwards.
    #[inline(always)]
    unsafe fn free(self, local: &mut LocalAllocator, spill: &mut Vec<Page>, addrs: &[*mut u8]) {
        // SAFETY: the caller's promise; every slot is written.
        unsafe {
            local.free_bulk_with(addrs.len(), spill, |slots| {
                for (d, &a) in slots.iter_mut().zip(addrs) {
                    d.write(self.page(a));
                }
                true
            })
        };
    }
}

#[inline(always)]
fn touch_addr(a: *mut u8) {
    // SAFETY: the caller passes the address of a page it holds.
    unsafe { std::ptr::write_volatile(a, 1) };
}

/// iopages, single thread, first byte of each page written: batch 0 is the
/// single-page API, others the bulk API.
///
/// The bulk loop is the C harness's (`peers/peer_bench.c`), so that every
/// E1 row runs one loop: the batch's pages as an array of addresses
/// (written in the pass that takes them from the handle's cache, as the C
/// ABI's `iopages_local_alloc_bulk_ptrs` does), each first byte written
/// through that array, the batch freed from the same addresses (turned
/// back into pages in the pass that puts them in the cache). Writing each
/// page through its handle instead costs up to 2× less at batches of 32
/// and more on some CPUs (a cache effect of the page-aligned first bytes
/// that depends on the loop's shape), which is not the allocator's doing.
pub fn iopages_st(
    local: &mut LocalAllocator,
    batch: usize,
    pages: u64,
) -> Result<Sample, BenchError> {
    let alloc = local.allocator().clone();
    let mut short = false;
    let s = if batch == 0 {
        time_once(pages, || short = !st_single(local, &alloc, pages))
    } else {
        let rounds = (pages / batch as u64).max(1);
        let addrs = Addrs::of(&alloc);
        let mut v: Vec<*mut u8> = vec![std::ptr::null_mut(); batch];
        let mut spill = Vec::with_capacity(batch);
        time_once(rounds * batch as u64, || {
            for _ in 0..rounds {
                let got = addrs.alloc(local, &mut spill, &mut v);
                short |= got != batch;
                for &a in &v[..got] {
                    touch_addr(a);
                }
                // SAFETY: pages of this arena allocated here, each once.
                unsafe { addrs.free(local, &mut spill, &v[..got]) };
            }
        })
    };
    if short {
        return Err(BenchError::Workload(format!(
            "iopages ran dry at batch {batch}"
        )));
    }
    Ok(s)
}

/// E1's single-page loop: `pages` rounds of allocate, write the first
/// byte, free; `false` if the cache ran dry. A function of its own that
/// takes the handle by `&mut`, as a user's hot loop would: the compiler
/// may then assume that the store to the page does not write the handle
/// and keeps its fields in registers, where inside a closure that
/// captured it each store made it load them again (with the handle's
/// slow paths kept off its address and the slot left alone on a free,
/// 2.2 -> 1.15 ns per page, Intel Xeon).
#[inline(never)]
fn st_single(local: &mut LocalAllocator, alloc: &PageAllocator, pages: u64) -> bool {
    let mut ok = true;
    for _ in 0..pages {
        match local.alloc_pages(Gfp::KERNEL, 0) {
            Some(p) => {
                touch(alloc, p);
                // SAFETY: `p` was just allocated here and nothing else
                // holds it.
                unsafe { local.free_pages(p, 0) };
            }
            None => ok = false,
        }
    }
    ok
}

/// The arena of [`iopages_st_fresh`]: the C harness's, as big as each
/// peer's pool.
const FRESH_ARENA_BYTES: u64 = 64 << 20;

/// [`iopages_st`] at each of `batches` from a fresh start, as a peer's
/// process starts each run: a new arena of 64 MiB (populated, checks off,
/// huge pages if the system has them), a new handle, each batch warmed
/// once. ns per page by batch.
///
/// A run on its own arena and handle draws its own placement of the
/// handle's record, its cache and its pages, as each peer's run does in
/// its own process. Which placement a run gets moves the small-batch
/// figures by up to 2× on the AMD EPYC VM (see docs/experiments.md), so a
/// row that kept one arena for every run would show one draw seven times
/// where the peers show seven draws.
pub fn iopages_st_fresh(
    batches: &[usize],
    pages: u64,
) -> Result<std::collections::BTreeMap<usize, f64>, BenchError> {
    let alloc = PageAllocator::builder()
        .size_bytes(FRESH_ARENA_BYTES)
        .huge_pages(iopages::HugePages::Try)
        .populate(true)
        .checks(false)
        .build()?;
    let mut out = std::collections::BTreeMap::new();
    {
        let mut local = alloc.local();
        for &b in batches {
            iopages_st(&mut local, b, pages / 8 + 1)?;
        }
        for &b in batches {
            out.insert(b, iopages_st(&mut local, b, pages)?.ns);
        }
    }
    alloc
        .leak_check()
        .map_err(|a| BenchError::Workload(format!("pages leaked: {a}")))?;
    Ok(out)
}

/// A single-producer single-consumer ring of page addresses, the same algorithm as
/// the C harness's: plain slots, published by the release store of `head`
/// and handed back by the release store of `tail`, so the harness costs
/// what the C one costs and the comparison measures the allocators.
struct Ring {
    head: crossbeam_utils::CachePadded<AtomicU64>,
    tail: crossbeam_utils::CachePadded<AtomicU64>,
    slots: Box<[std::cell::UnsafeCell<*mut u8>]>,
}

// SAFETY: slot `i` is written only by the producer while `i - tail <
// RING` and read only by the consumer while `i < head`; `head` and `tail`
// are stored with release and loaded with acquire, so each slot has one
// writer or one reader at a time and the reader sees the write.
unsafe impl Sync for Ring {}
// SAFETY: the slots hold addresses of pages in flight between the pair,
// owned by one side at a time (see `Sync`); nothing ties them to a thread.
unsafe impl Send for Ring {}

impl Ring {
    fn new() -> Ring {
        Ring {
            head: Default::default(),
            tail: Default::default(),
            slots: (0..RING)
                .map(|_| std::cell::UnsafeCell::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// The slots as plain memory (`UnsafeCell<T>` has `T`'s layout).
    fn base(&self) -> *mut *mut u8 {
        self.slots.as_ptr().cast::<*mut u8>().cast_mut()
    }

    /// Producer: write `pages` at `at` (the slots are free).
    #[inline]
    fn write(&self, at: u64, pages: &[*mut u8]) {
        let base = self.base();
        for (i, &p) in pages.iter().enumerate() {
            // SAFETY: see the `Sync` impl; the producer owns these slots, and
            // the index is masked into the ring.
            unsafe { *base.add(((at + i as u64) & (RING - 1)) as usize) = p };
        }
    }

    /// Consumer: the page at `at` (published).
    #[inline]
    fn one(&self, at: u64) -> *mut u8 {
        // SAFETY: see the `Sync` impl; the consumer owns this slot.
        unsafe { *self.base().add((at & (RING - 1)) as usize) }
    }

    /// Consumer: append the `n` pages at `at` to `out` (they are
    /// published).
    #[inline]
    fn read(&self, at: u64, n: u64, out: &mut Vec<*mut u8>) {
        let base = self.base();
        out.extend((at..at + n).map(|i| {
            // SAFETY: see the `Sync` impl; the consumer owns these slots.
            unsafe { *base.add((i & (RING - 1)) as usize) }
        }));
    }
}

/// Slots per ring, a power of two.
const RING: u64 = 1024;
/// Set in `head` by a producer that is done: the consumer drains and stops.
const FINISHED: u64 = 1 << 63;

/// Pages a multi-thread pass of `threads` keeps out of the allocator at
/// most: every ring full and a batch in each worker's hands.
pub fn mt_pages_in_flight(threads: usize, batch: usize) -> u64 {
    (threads / 2).max(1) as u64 * (RING + 2 * batch.max(1) as u64)
}

// The multi-thread workers call the allocator through a `LocalAllocator`
// handle each, the API a worker loop uses. Batches of one page (the
// single-page API, "batch 0") hold the page in a local, as the C harness
// does; larger batches move through an array of addresses.

/// Producer of a pair: allocates `pages` pages (batch 0: one at a time,
/// else in batches), writes each first byte and passes the addresses
/// through `ring`; a short batch is given back whole and marks `failed`.
fn producer(
    alloc: &PageAllocator,
    ring: &Ring,
    start: &Barrier,
    failed: &AtomicBool,
    batch: usize,
    pages: u64,
) -> WorkerClock {
    let b = batch.max(1);
    let addrs = Addrs::of(alloc);
    let mut buf: Vec<*mut u8> = vec![std::ptr::null_mut(); b];
    let mut spill = Vec::with_capacity(b);
    let mut local = alloc.local();
    start.wait();
    let span = Span::begin();
    let mut head = 0u64;
    if batch == 0 {
        // One page at a time, held in a local as the C harness holds it.
        while head < pages {
            let Some(p) = local.alloc_pages(Gfp::KERNEL, 0) else {
                failed.store(true, Ordering::Relaxed);
                break;
            };
            let a = addrs.addr(p);
            touch_addr(a);
            while head + 1 - ring.tail.load(Ordering::Acquire) > RING {
                std::thread::yield_now();
            }
            ring.write(head, &[a]);
            head += 1;
            ring.head.store(head, Ordering::Release);
        }
    }
    while head < pages {
        let got = addrs.alloc(&mut local, &mut spill, &mut buf);
        if got != b {
            // SAFETY: the short batch was just allocated here, each page
            // once.
            unsafe { addrs.free(&mut local, &mut spill, &buf[..got]) };
            failed.store(true, Ordering::Relaxed);
            break;
        }
        for &a in &buf {
            touch_addr(a);
        }
        while head + b as u64 - ring.tail.load(Ordering::Acquire) > RING {
            std::thread::yield_now();
        }
        ring.write(head, &buf);
        head += b as u64;
        ring.head.store(head, Ordering::Release);
    }
    // Tell the consumer how far it will get.
    ring.head.store(head | FINISHED, Ordering::Release);
    span.end()
}

fn consumer(alloc: &PageAllocator, ring: &Ring, start: &Barrier, batch: usize) -> WorkerClock {
    let b = batch.max(1) as u64;
    let addrs = Addrs::of(alloc);
    let mut v: Vec<*mut u8> = Vec::with_capacity(b as usize);
    let mut spill = Vec::with_capacity(b as usize);
    let mut local = alloc.local();
    start.wait();
    let span = Span::begin();
    let mut tail = 0u64;
    loop {
        let h = ring.head.load(Ordering::Acquire);
        let (head, finished) = (h & !FINISHED, h & FINISHED != 0);
        if head - tail < b {
            if finished && head == tail {
                break;
            }
            std::thread::yield_now();
            continue;
        }
        if batch == 0 {
            let a = ring.one(tail);
            tail += 1;
            ring.tail.store(tail, Ordering::Release);
            // SAFETY: the producer handed the page over through the ring
            // and dropped it; the slot is released above, so this consumer
            // owns it alone.
            unsafe { local.free_pages(addrs.page(a), 0) };
            continue;
        }
        ring.read(tail, b, &mut v);
        tail += b;
        ring.tail.store(tail, Ordering::Release);
        // SAFETY: as for a single page: the batch was handed over whole.
        unsafe { addrs.free(&mut local, &mut spill, &v) };
        v.clear();
    }
    span.end()
}

/// iopages, multi-thread: `threads / 2` producer/consumer pairs; each
/// producer allocates (batch 0: single-page API, else bulk) and writes the
/// first byte, each consumer frees what it receives. Each worker times
/// itself (see the module header); the result carries wall ns per page per
/// pair, aggregate pages/s, CPU ns per page and the clock check.
pub fn iopages_mt(
    alloc: &PageAllocator,
    threads: usize,
    batch: usize,
    pages: u64,
) -> Result<PeerResult, BenchError> {
    let pairs = (threads / 2).max(1);
    let b = batch.max(1) as u64;
    let pages = (pages / b).max(1) * b;
    // Only the workers meet here: the main thread takes no time.
    let start = Arc::new(Barrier::new(2 * pairs));
    let failed = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::with_capacity(2 * pairs);
    for _ in 0..pairs {
        let ring = Arc::new(Ring::new());
        let (a, r, s, f) = (alloc.clone(), ring.clone(), start.clone(), failed.clone());
        handles.push(std::thread::spawn(move || {
            producer(&a, &r, &s, &f, batch, pages)
        }));
        let (a, r, s) = (alloc.clone(), ring, start.clone());
        handles.push(std::thread::spawn(move || consumer(&a, &r, &s, batch)));
    }
    let mut clocks = Vec::with_capacity(handles.len());
    for h in handles {
        clocks.push(
            h.join()
                .map_err(|_| BenchError::Workload("a multi-thread worker panicked".into()))?,
        );
    }
    if failed.load(Ordering::Relaxed) {
        return Err(BenchError::Workload(format!(
            "iopages ran dry with {threads} threads at batch {batch}"
        )));
    }
    Ok(mt_result(threads, batch, pages, &clocks, online_cpus()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(body: &str) -> (tempdir::Dir, PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("peer-fake");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        (dir, path)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p = std::env::temp_dir().join(format!(
                    "iopages-peer-test-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn without_the_source_tree_every_peer_is_unavailable_and_says_why() {
        let states = setup_with(
            Path::new("/nonexistent/scripts/setup-peers.sh"),
            Path::new("/nonexistent/peers"),
        );
        assert_eq!(states.len(), PEERS.len());
        for (name, state) in states {
            match state {
                PeerState::Unavailable(why) => assert!(
                    why.contains("source tree") && why.contains("--no-peers"),
                    "{name}: {why}"
                ),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_peer_that_cannot_start_is_reported_with_the_reason() {
        let err = run_peer(Path::new("/nonexistent/peer-x"), 1, 1, &[0], &[], &[]).unwrap_err();
        assert!(err.contains("could not start"), "{err}");
    }

    #[test]
    fn a_peer_that_fails_is_reported_with_its_first_error_line() {
        let (_d, bin) = script("echo 'EAL: cannot init' >&2; exit 3");
        let err = run_peer(&bin, 1, 1, &[0], &[], &[]).unwrap_err();
        assert!(err.contains("EAL: cannot init"), "{err}");
    }

    #[test]
    fn peer_output_is_parsed_and_counted() {
        let (_d, bin) = script(
            r#"echo '{"peer":"x","mode":"st","batch":0,"ns_per_page":5.5}'
echo '{"peer":"x","mode":"mt","threads":2,"batch":64,"ns_per_page":20,"pages_per_s":50000000.0,"cpu_ns_per_page":38.5,"clock_check":"ok"}'
echo '{"peer":"x","mode":"mt","threads":4,"batch":64,"ns_per_page":30,"pages_per_s":66666666.7,"cpu_ns_per_page":60,"clock_check":"failed"}'"#,
        );
        let r = run_peer(&bin, 1, 1, &[0], &[2, 4], &[64]).unwrap();
        assert_eq!(
            r,
            vec![
                PeerResult {
                    threads: None,
                    batch: 0,
                    ns_per_page: 5.5,
                    mt: None,
                },
                PeerResult {
                    threads: Some(2),
                    batch: 64,
                    ns_per_page: 20.0,
                    mt: Some(MtFigures {
                        pages_per_s: 50e6,
                        cpu_ns_per_page: 38.5,
                        clock_ok: true,
                    }),
                },
                PeerResult {
                    threads: Some(4),
                    batch: 64,
                    ns_per_page: 30.0,
                    mt: Some(MtFigures {
                        pages_per_s: 66666666.7,
                        cpu_ns_per_page: 60.0,
                        clock_ok: false,
                    }),
                },
            ]
        );
        let short = run_peer(&bin, 1, 1, &[0, 1], &[2, 4], &[64]).unwrap_err();
        assert!(short.contains("expected 4"), "{short}");
    }

    #[test]
    fn a_multi_thread_line_without_the_new_figures_is_refused() {
        let (_d, bin) =
            script(r#"echo '{"peer":"x","mode":"mt","threads":2,"batch":0,"ns_per_page":20}'"#);
        let err = run_peer(&bin, 1, 1, &[], &[2], &[0]).unwrap_err();
        assert!(err.contains("setup-peers.sh"), "{err}");
        let (_d, bin) = script(
            r#"echo '{"peer":"x","mode":"mt","threads":2,"batch":0,"ns_per_page":20,"pages_per_s":1,"cpu_ns_per_page":1,"clock_check":"maybe"}'"#,
        );
        let err = run_peer(&bin, 1, 1, &[], &[2], &[0]).unwrap_err();
        assert!(err.contains("clock_check"), "{err}");
    }

    fn clock(start_ns: u64, end_ns: u64, cpu_ns: u64) -> WorkerClock {
        WorkerClock {
            start_ns,
            end_ns,
            cpu_ns,
        }
    }

    #[test]
    fn the_interval_runs_from_the_earliest_start_to_the_latest_end() {
        // Two pairs of 1000 pages; workers start and end at different times.
        let clocks = [
            clock(1_000, 41_000, 30_000),
            clock(2_000, 42_000, 30_000),
            clock(11_000, 50_000, 20_000),
            clock(5_000, 21_000, 16_000),
        ];
        let r = mt_result(4, 64, 1000, &clocks, 8);
        let mt = r.mt.unwrap();
        // Interval 49 000 ns: wall per page per pair, pages/s of both pairs.
        assert_eq!(r.ns_per_page, 49.0);
        assert!((mt.pages_per_s - 2000.0 / 49_000.0 * 1e9).abs() < 1e-3);
        // 96 000 ns of CPU over 2000 pages.
        assert_eq!(mt.cpu_ns_per_page, 48.0);
        assert!((mt.busy_cpus() - 96.0 / 49.0).abs() < 1e-9);
        assert!(mt.clock_ok);
        assert_eq!((r.threads, r.batch), (Some(4), 64));
    }

    #[test]
    fn the_clock_check_fails_past_the_physical_bound() {
        // Four workers busy for the whole 1000 ns on 2 CPUs: impossible.
        let clocks = [clock(0, 1000, 1000); 4];
        assert!(!mt_result(4, 0, 10, &clocks, 2).mt.unwrap().clock_ok);
        // The same on 4 CPUs is possible.
        assert!(mt_result(4, 0, 10, &clocks, 4).mt.unwrap().clock_ok);
        // 10 % slack over min(threads, CPUs), and no more.
        assert!(clock_check(2.2, 2, 16));
        assert!(!clock_check(2.21, 2, 16));
        assert!(clock_check(1.1, 16, 1));
        assert!(!clock_check(1.2, 16, 1));
    }

    #[test]
    fn worker_clocks_are_monotonic_and_cpu_fits_the_wall_span() {
        let span = Span::begin();
        let mut x = 0u64;
        for i in 0..100_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        let c = span.end();
        assert!(c.end_ns > c.start_ns, "{c:?}");
        assert!(c.cpu_ns <= c.end_ns - c.start_ns, "{c:?}");
        assert!(online_cpus() >= 1);
    }

    #[test]
    fn iopages_workloads_run_and_leak_nothing() {
        let alloc = PageAllocator::builder()
            .size_bytes(16 << 20)
            .build()
            .unwrap();
        for b in [0, 1, 2, 64, 256] {
            assert!(iopages_st(&mut alloc.local(), b, 4096).unwrap().ns > 0.0);
        }
        for (t, b) in [(2, 0), (2, 64), (4, 0), (4, 64)] {
            let r = iopages_mt(&alloc, t, b, 8192).unwrap();
            let mt = r.mt.unwrap();
            assert!(r.ns_per_page > 0.0 && mt.pages_per_s > 0.0 && mt.cpu_ns_per_page > 0.0);
            assert_eq!((r.threads, r.batch), (Some(t), b));
        }
        alloc
            .leak_check()
            .expect("the workloads must return every page");
    }
}
