//! E1 peers: the allocators users would pick instead of iopages, run as
//! separate processes, and the same workloads run in-process on iopages.
//!
//! Owns: building the peer harness (`scripts/setup-peers.sh`), running one
//! peer process per run and parsing its results, and the in-process iopages
//! versions of the peer workloads (first byte of each page written, LIFO
//! reuse; producer/consumer pairs for the multi-thread part). Must never:
//! drop a peer silently — a peer that cannot be built or started is reported
//! with its reason and the others still run.

use crate::measure::{time_once, Sample};
use crate::BenchError;
use iopages::{Gfp, Page, PageAllocator};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

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
}

/// The scripts directory of this source tree.
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts")
}

/// Build the peers into `dir` (installing Debian packages where missing and
/// allowed) and say where each stands.
pub fn setup(dir: &Path) -> Vec<(&'static str, PeerState)> {
    let script = scripts_dir().join("setup-peers.sh");
    let ran = Command::new("bash").arg(&script).arg(dir).status();
    PEERS
        .iter()
        .map(|&name| {
            let bin = dir.join(format!("peer-{name}"));
            let state = if let Err(e) = &ran {
                PeerState::Unavailable(format!("could not run {}: {e}", script.display()))
            } else if bin.is_file() {
                PeerState::Ready(bin)
            } else {
                let why = std::fs::read_to_string(dir.join(format!("peer-{name}.err")))
                    .ok()
                    .and_then(|s| s.lines().next().map(str::to_string))
                    .unwrap_or_else(|| "not built (see scripts/setup-peers.sh)".into());
                PeerState::Unavailable(why)
            };
            (name, state)
        })
        .collect()
}

fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
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
    let mut child = Command::new(bin)
        .args([
            pages.to_string(),
            mt_pages.to_string(),
            join(batches),
            join(threads),
            join(mt_batches),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {}: {e}", bin.display()))?;
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if t0.elapsed() > PEER_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {} s", PEER_TIMEOUT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("wait failed: {e}")),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("could not read its output: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let first = err
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(format!("exited with {}: {first}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut results = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("bad output line {line:?}: {e}"))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        let (Some(batch), Some(ns)) = (num("batch"), num("ns_per_page")) else {
            return Err(format!("output line without batch or ns_per_page: {line}"));
        };
        results.push(PeerResult {
            threads: num("threads").map(|t| t as usize),
            batch: batch as usize,
            ns_per_page: ns,
        });
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

/// iopages, single thread, first byte of each page written: batch 0 is the
/// single-page API, others the bulk array API.
pub fn iopages_st(alloc: &PageAllocator, batch: usize, pages: u64) -> Result<Sample, BenchError> {
    let mut short = false;
    let s = if batch == 0 {
        time_once(pages, || {
            for _ in 0..pages {
                match alloc.alloc_pages(Gfp::KERNEL, 0) {
                    Some(p) => {
                        touch(alloc, p);
                        alloc.free_pages(p, 0);
                    }
                    None => short = true,
                }
            }
        })
    } else {
        let rounds = (pages / batch as u64).max(1);
        let mut slots = vec![None; batch];
        time_once(rounds * batch as u64, || {
            for _ in 0..rounds {
                short |= alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut slots) != batch;
                for p in slots.iter().flatten() {
                    touch(alloc, *p);
                }
                alloc.free_pages_bulk_array(&mut slots);
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

/// A single-producer single-consumer ring of pages, the same algorithm as
/// the C harness's.
struct Ring {
    head: crossbeam_utils::CachePadded<AtomicU64>,
    tail: crossbeam_utils::CachePadded<AtomicU64>,
    slots: Box<[std::sync::atomic::AtomicU32]>,
}

const RING: u64 = 1024;

/// iopages, multi-thread: `threads / 2` producer/consumer pairs; each
/// producer allocates (batch 0: single-page API, else bulk) and writes the
/// first byte, each consumer frees what it receives. Returns wall ns per
/// page per pair.
pub fn iopages_mt(
    alloc: &PageAllocator,
    threads: usize,
    batch: usize,
    pages: u64,
) -> Result<f64, BenchError> {
    let pairs = (threads / 2).max(1);
    let b = batch.max(1);
    let pages = pages / b as u64 * b as u64;
    let start = Arc::new(Barrier::new(2 * pairs + 1));
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut handles = Vec::new();
    for _ in 0..pairs {
        let ring = Arc::new(Ring {
            head: Default::default(),
            tail: Default::default(),
            slots: (0..RING).map(|_| Default::default()).collect(),
        });
        {
            let (alloc, ring, start, failed) =
                (alloc.clone(), ring.clone(), start.clone(), failed.clone());
            handles.push(std::thread::spawn(move || {
                let mut v = vec![None; b];
                start.wait();
                let mut head = 0u64;
                let mut done = 0;
                while done < pages {
                    let got = if batch == 0 {
                        v[0] = alloc.alloc_pages(Gfp::KERNEL, 0);
                        v[0].is_some() as usize
                    } else {
                        alloc.alloc_pages_bulk_array(Gfp::KERNEL, &mut v)
                    };
                    if got != b {
                        failed.store(true, Ordering::Relaxed);
                        alloc.free_pages_bulk_array(&mut v);
                        break;
                    }
                    for p in v.iter().flatten() {
                        touch(&alloc, *p);
                    }
                    while head + b as u64 - ring.tail.load(Ordering::Acquire) > RING {
                        std::thread::yield_now();
                    }
                    for (i, p) in v.iter_mut().enumerate() {
                        let p = p.take().expect("filled above");
                        ring.slots[((head + i as u64) % RING) as usize]
                            .store(p.pfn(), Ordering::Relaxed);
                    }
                    head += b as u64;
                    ring.head.store(head, Ordering::Release);
                    done += b as u64;
                }
                // Tell the consumer how far it will get.
                ring.head.store(head | 1 << 63, Ordering::Release);
            }));
        }
        {
            let (alloc, ring, start) = (alloc.clone(), ring.clone(), start.clone());
            handles.push(std::thread::spawn(move || {
                let mut v: Vec<Page> = Vec::with_capacity(b);
                start.wait();
                let mut tail = 0u64;
                loop {
                    let h = ring.head.load(Ordering::Acquire);
                    let (head, finished) = (h & !(1 << 63), h >> 63 == 1);
                    if head - tail < b as u64 {
                        if finished && head == tail {
                            break;
                        }
                        std::thread::yield_now();
                        continue;
                    }
                    v.clear();
                    for i in 0..b as u64 {
                        v.push(Page::from_pfn(
                            ring.slots[((tail + i) % RING) as usize].load(Ordering::Relaxed),
                        ));
                    }
                    tail += b as u64;
                    ring.tail.store(tail, Ordering::Release);
                    if batch == 0 {
                        alloc.free_pages(v[0], 0);
                    } else {
                        alloc.free_pages_bulk(&v);
                    }
                }
            }));
        }
    }
    start.wait();
    let t0 = Instant::now();
    for h in handles {
        h.join()
            .map_err(|_| BenchError::Workload("a multi-thread worker panicked".into()))?;
    }
    let ns = t0.elapsed().as_nanos() as f64;
    if failed.load(Ordering::Relaxed) {
        return Err(BenchError::Workload(format!(
            "iopages ran dry with {threads} threads at batch {batch}"
        )));
    }
    Ok(ns / pages as f64)
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
echo '{"peer":"x","mode":"mt","threads":2,"batch":64,"ns_per_page":20}'"#,
        );
        let r = run_peer(&bin, 1, 1, &[0], &[2], &[64]).unwrap();
        assert_eq!(
            r,
            vec![
                PeerResult {
                    threads: None,
                    batch: 0,
                    ns_per_page: 5.5
                },
                PeerResult {
                    threads: Some(2),
                    batch: 64,
                    ns_per_page: 20.0
                },
            ]
        );
        let short = run_peer(&bin, 1, 1, &[0, 1], &[2], &[64]).unwrap_err();
        assert!(short.contains("expected 3"), "{short}");
    }

    #[test]
    fn iopages_workloads_run_and_leak_nothing() {
        let alloc = PageAllocator::builder()
            .size_bytes(16 << 20)
            .build()
            .unwrap();
        for b in [0, 1, 2, 64, 256] {
            assert!(iopages_st(&alloc, b, 4096).unwrap().ns > 0.0);
        }
        for b in [0, 64] {
            assert!(iopages_mt(&alloc, 2, b, 8192).unwrap() > 0.0);
        }
        alloc
            .leak_check()
            .expect("the workloads must return every page");
    }
}
