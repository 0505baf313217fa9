//! E1's I/O-shaped row: the allocator's share of a loop that does what an
//! I/O engine does with a page — fill all 4 KiB of it — rather than write
//! its first byte.
//!
//! Owns: the row's two loops and their report. For each batch, one
//! handle allocates the batch, each page is filled whole (`write_bytes`
//! of 4 KiB, what a read into the page or an encryption costs at least),
//! and the batch is freed; beside it, in the same run, the same fill of
//! the same number of pages held for the whole run, with no allocation,
//! visited in the order the allocator hands them out (each batch from the
//! cache comes most recently freed first, so each round walks the batch
//! in the opposite direction to the round before; a fill in one fixed
//! order would miss the L1 where the allocator's loop hits it, and read
//! slower than the loop it is subtracted from).
//! The allocator's share is the difference over the first. No target:
//! the row shows where the allocator's nanoseconds stand in real work.
//! Must never: report a share from loops measured in different runs.

use crate::measure::{median, time_once};
use crate::BenchError;
use iopages::{Gfp, LocalAllocator, Page, PageAllocator, PAGE_SIZE};
use serde_json::{json, Value};

/// Batches of the row (pages per round trip).
pub const IO_BATCHES: [usize; 4] = [1, 4, 16, 64];

/// One run of one batch: ns per page with and without the allocator.
#[derive(Clone, Copy, Debug)]
pub struct IoSample {
    pub with_alloc_ns: f64,
    pub fill_only_ns: f64,
}

/// Fill every byte of the page at `a`.
#[inline(always)]
fn fill(a: *mut u8, round: u64) {
    // SAFETY: the caller holds the page at `a` (4 KiB of the arena).
    unsafe { std::ptr::write_bytes(a, round as u8, PAGE_SIZE) };
}

/// `pages` pages in batches of `batch` through `local`, each filled whole,
/// then `pages` fills of `batch` pages held throughout.
pub fn measure(
    local: &mut LocalAllocator,
    batch: usize,
    pages: u64,
) -> Result<IoSample, BenchError> {
    let alloc = local.allocator().clone();
    let rounds = (pages / batch as u64).max(1);
    let ops = rounds * batch as u64;
    let mut v: Vec<Page> = Vec::with_capacity(batch);
    let mut short = false;
    let with = time_once(ops, || {
        for r in 0..rounds {
            short |= local.alloc_bulk(Gfp::KERNEL, batch, &mut v) != batch;
            for &p in &v {
                fill(alloc.page_address(p), r);
            }
            // SAFETY: the pages were just allocated here, each once.
            unsafe { local.free_bulk(&mut v) };
        }
    });
    if short {
        return Err(BenchError::Workload(format!(
            "I/O-shaped row: the arena ran dry at batch {batch}"
        )));
    }
    let held = local.alloc_bulk(Gfp::KERNEL, batch, &mut v);
    if held != batch {
        // SAFETY: allocated here, each once.
        unsafe { local.free_bulk(&mut v) };
        return Err(BenchError::Workload(format!(
            "I/O-shaped row: {held} of {batch} pages to hold"
        )));
    }
    let addrs: Vec<*mut u8> = v.iter().map(|&p| alloc.page_address(p)).collect();
    let only = time_once(ops, || {
        for r in 0..rounds {
            if r % 2 == 0 {
                for &a in &addrs {
                    fill(std::hint::black_box(a), r);
                }
            } else {
                for &a in addrs.iter().rev() {
                    fill(std::hint::black_box(a), r);
                }
            }
        }
    });
    // SAFETY: allocated above, each once.
    unsafe { local.free_bulk(&mut v) };
    Ok(IoSample {
        with_alloc_ns: with.ns,
        fill_only_ns: only.ns,
    })
}

/// The allocator's share of one run: (with − fill only) / with.
fn share(s: &IoSample) -> f64 {
    (s.with_alloc_ns - s.fill_only_ns) / s.with_alloc_ns
}

/// Runs `runs` rounds over [`IO_BATCHES`] (batches interleaved within a
/// run), prints the row and returns its JSON.
pub fn run(alloc: &PageAllocator, runs: usize, pages: u64) -> Result<Value, BenchError> {
    let mut local = alloc.local();
    let mut got: Vec<Vec<IoSample>> = vec![Vec::new(); IO_BATCHES.len()];
    for &b in &IO_BATCHES {
        measure(&mut local, b, pages / 8)?;
    }
    for _ in 0..runs {
        for (i, &b) in IO_BATCHES.iter().enumerate() {
            got[i].push(measure(&mut local, b, pages)?);
        }
    }
    drop(local);
    println!(
        "\nE1 I/O-shaped: each page filled whole (4 KiB), alloc+fill+free against the fill alone, one handle (median of {runs} runs)"
    );
    println!("   batch | alloc+fill+free ns | fill only ns | allocator's share");
    let mut rows = serde_json::Map::new();
    for (s, &b) in got.iter().zip(&IO_BATCHES) {
        let with = median(&s.iter().map(|x| x.with_alloc_ns).collect::<Vec<_>>());
        let only = median(&s.iter().map(|x| x.fill_only_ns).collect::<Vec<_>>());
        let sh = median(&s.iter().map(share).collect::<Vec<_>>());
        println!("{b:>8} | {with:>18.2} | {only:>12.2} | {sh:>17.3}");
        rows.insert(
            b.to_string(),
            json!({ "with_alloc_ns": with, "fill_only_ns": only, "allocator_share": sh }),
        );
    }
    Ok(json!({
        "what": "ns per page: alloc_bulk + a 4 KiB fill of each page + free_bulk through one handle, against the same fills of held pages in the allocator's order (the batch walked forwards and backwards in turn); share = (with - fill only) / with, the median of each run's",
        "batches": Value::Object(rows),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_runs_and_leaks_nothing() {
        let alloc = PageAllocator::builder()
            .size_bytes(16 << 20)
            .build()
            .unwrap();
        let mut local = alloc.local();
        for b in IO_BATCHES {
            let s = measure(&mut local, b, 256).unwrap();
            assert!(s.with_alloc_ns > 0.0 && s.fill_only_ns > 0.0, "{s:?}");
        }
        drop(local);
        assert!(alloc.leak_check().is_ok());
    }
}
