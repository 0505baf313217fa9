//! E4: building a bio from a page array and releasing its pins, page by
//! page against folio by folio (seed 002), and direct I/O of folio
//! buffers through io_uring end to end.
//!
//! Owns: the workloads, the table, the JSON report and the plot. Must
//! never: report a build whose bio differs between the two builders (each
//! run checks they produce the same segments), or leave pins or pages
//! behind.

use crate::plot::{line_plot, Series};
use crate::{met, progress, round2, write_json, BenchError, BenchOptions};
use iopages::{Bio, BioLimits, FolioBuffer, Gfp, HugePages, Page, PageAllocator};
use iopages_crypt::dio::DirectFile;
use iopages_crypt::uring::{UringFile, UringOptions};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// I/O sizes of the build part.
const SIZES: [usize; 5] = [16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20];
/// Folio order of the "large folio" buffers: 64 KiB.
const FOLIO_ORDER: u32 = 4;
/// The seed's kernel figure: `bio_iov_iter_get_pages` share of cycles.
const SEED_BEFORE_PCT: f64 = 4.3;
const SEED_AFTER_PCT: f64 = 1.8;
/// Target: folio-aware build+release at least this much faster at 128 KiB.
const TARGET_SPEEDUP_128K: f64 = 4.0;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(e.to_string())
}

/// ns per build+release of a bio over `pages[..size]`, `iters` times.
fn build_sample(
    alloc: &PageAllocator,
    pages: &[Page],
    size: usize,
    folio_aware: bool,
    iters: usize,
) -> Result<f64, BenchError> {
    let limits = BioLimits::default();
    let t = Instant::now();
    for _ in 0..iters {
        let bio = if folio_aware {
            Bio::from_pages(alloc, pages, 0, size, limits)
        } else {
            Bio::from_pages_by_page(alloc, pages, 0, size, limits)
        }
        .map_err(workload)?;
        let bio = std::hint::black_box(bio);
        if folio_aware {
            bio.release(alloc)
        } else {
            bio.release_by_page(alloc)
        }
    }
    Ok(t.elapsed().as_nanos() as f64 / iters as f64)
}

fn segments(
    alloc: &PageAllocator,
    pages: &[Page],
    size: usize,
) -> Result<(usize, usize), BenchError> {
    let l = BioLimits::default();
    let a = Bio::from_pages(alloc, pages, 0, size, l).map_err(workload)?;
    let b = Bio::from_pages_by_page(alloc, pages, 0, size, l).map_err(workload)?;
    if a.segments() != b.segments() {
        return Err(workload("bio: the two builders disagree"));
    }
    let n = a.segments().len();
    a.release(alloc);
    b.release(alloc);
    Ok((n, size / 4096))
}

/// MB/s of sequential direct writes then reads of `io` bytes over a file.
fn dio_sample(
    dio: &DirectFile,
    buf: &mut FolioBuffer,
    io: usize,
    file_bytes: u64,
) -> Result<(f64, f64), BenchError> {
    let n = (file_bytes as usize / io).max(1);
    let t = Instant::now();
    for i in 0..n {
        dio.write((i * io) as u64, buf, 0..io).map_err(workload)?;
    }
    let w = (n * io) as f64 / t.elapsed().as_secs_f64() / 1e6;
    let t = Instant::now();
    for i in 0..n {
        dio.read((i * io) as u64, buf, 0..io).map_err(workload)?;
    }
    let r = (n * io) as f64 / t.elapsed().as_secs_f64() / 1e6;
    Ok((w, r))
}

fn median(mut v: Vec<f64>) -> f64 {
    crate::measure::median(&std::mem::take(&mut v))
}

/// E4. Returns the report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, budget_pages, file_mib) = if opts.quick {
        (3, 2_000_000usize, 16u64)
    } else {
        (7, 20_000_000usize, 256u64)
    };
    progress(
        "bio",
        format!(
            "E4: {runs} runs; bios of {:?} KiB built from buffers of 64 KiB folios and of single pages, page by page and folio by folio (build + release pins); then direct I/O through io_uring on a {file_mib} MiB file",
            SIZES.iter().map(|s| s >> 10).collect::<Vec<_>>()
        ),
    );
    let alloc = PageAllocator::builder()
        .size_bytes(256 << 20)
        .huge_pages(HugePages::Try)
        .build()?;
    let big = 1 << 20;
    let folio_buf = alloc
        .alloc_buffer(Gfp::KERNEL, big, FOLIO_ORDER)
        .map_err(workload)?;
    let page_buf = alloc.alloc_buffer(Gfp::KERNEL, big, 0).map_err(workload)?;
    let bufs = [("folio64k", folio_buf.pages()), ("pages", page_buf.pages())];

    // (buffer, builder, size) → samples of ns.
    let mut ns: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); SIZES.len()]; 4];
    for run in 0..runs {
        for (b, (_, pages)) in bufs.iter().enumerate() {
            for (s, &size) in SIZES.iter().enumerate() {
                let iters = (budget_pages / (size / 4096)).max(100);
                for folio_aware in [false, true] {
                    let v = build_sample(&alloc, pages, size, folio_aware, iters)?;
                    ns[b * 2 + folio_aware as usize][s].push(v);
                }
            }
        }
        progress("bio", format!("build run {}/{runs} done", run + 1));
    }
    let med = |row: usize, s: usize| median(ns[row][s].clone());
    let mut seg = Vec::new();
    for (_, pages) in &bufs {
        let mut row = Vec::new();
        for &size in &SIZES {
            row.push(segments(&alloc, pages, size)?);
        }
        seg.push(row);
    }

    // End to end: direct I/O through io_uring on a file.
    let dir = opts
        .json
        .as_ref()
        .and_then(|p| p.parent().map(|d| d.to_path_buf()))
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| opts.out_dir.clone());
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::Write {
        path: dir.clone(),
        source: e,
    })?;
    let path = dir.join("bio-direct-io.tmp");
    let file = Arc::new(
        UringFile::open(
            &path,
            UringOptions {
                arena: Some(alloc.clone()),
                create_size: Some(file_mib << 20),
                rings: 1,
                ..UringOptions::default()
            },
        )
        .map_err(workload)?,
    );
    let direct = file.direct_io();
    let mut e2e = Vec::new();
    for &io in &[128usize << 10, 1 << 20] {
        for (name, order) in [("folio64k", FOLIO_ORDER), ("pages", 0)] {
            for folio_aware in [false, true] {
                let dio =
                    DirectFile::new(Arc::clone(&file), &alloc).with_page_by_page(!folio_aware);
                let mut buf = alloc
                    .alloc_buffer(Gfp::KERNEL, io, order)
                    .map_err(workload)?;
                let (mut w, mut r) = (Vec::new(), Vec::new());
                for _ in 0..runs.min(3) {
                    let (a, b) = dio_sample(&dio, &mut buf, io, file_mib << 20)?;
                    w.push(a);
                    r.push(b);
                }
                e2e.push(json!({
                    "io_bytes": io, "buffer": name, "folio_aware": folio_aware,
                    "write_mb_s": round2(median(w)), "read_mb_s": round2(median(r)),
                }));
            }
        }
        progress("bio", format!("direct I/O of {} KiB done", io >> 10));
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    drop(bufs);
    drop(folio_buf);
    drop(page_buf);
    alloc
        .leak_check()
        .map_err(|a| workload(format!("bio: pages leaked: {a}")))?;

    let idx = |size: usize| SIZES.iter().position(|&s| s == size).unwrap();
    let speedup = |size: usize| med(0, idx(size)) / med(1, idx(size));
    let (s128, s1m) = (speedup(128 << 10), speedup(1 << 20));
    println!();
    println!(
        "bio (E4): ns to build a bio from a page array and release its pins (median of {runs} runs); segments per bio (default limits: 256 × 64 KiB)"
    );
    println!(
        "{:>8} | {:>12} {:>12} {:>7} {:>5} | {:>12} {:>12} {:>7} {:>5}",
        "I/O",
        "64K folios:",
        "page-by-page",
        "folio",
        "segs",
        "pages:",
        "page-by-page",
        "folio",
        "segs"
    );
    for (s, &size) in SIZES.iter().enumerate() {
        println!(
            "{:>7}K | {:>12} {:>12.0} {:>7.0} {:>5} | {:>12} {:>12.0} {:>7.0} {:>5}",
            size >> 10,
            format!("{:.1}×", med(0, s) / med(1, s)),
            med(0, s),
            med(1, s),
            seg[0][s].0,
            format!("{:.1}×", med(2, s) / med(3, s)),
            med(2, s),
            med(3, s),
            seg[1][s].0,
        );
    }
    println!(
        "seed 002 (kernel, fio direct I/O on large folios): bio_iov_iter_get_pages {SEED_BEFORE_PCT} % → {SEED_AFTER_PCT} % of cycles ({:.1}× less)",
        SEED_BEFORE_PCT / SEED_AFTER_PCT
    );
    println!(
        "target build_speedup_128k >= {TARGET_SPEEDUP_128K}: {s128:.2} ({}); 1 MiB: {s1m:.2}",
        met(s128 >= TARGET_SPEEDUP_128K)
    );
    println!(
        "direct I/O through io_uring ({}), MB/s write / read:",
        if direct {
            "O_DIRECT"
        } else {
            "buffered: the file system refused O_DIRECT"
        }
    );
    for r in &e2e {
        println!(
            "  {:>5} KiB, {:>8}, {:>12}: {:>7.0} / {:>7.0}",
            r["io_bytes"].as_u64().unwrap_or(0) >> 10,
            r["buffer"].as_str().unwrap_or(""),
            if r["folio_aware"].as_bool().unwrap_or(false) {
                "folio-aware"
            } else {
                "page-by-page"
            },
            r["write_mb_s"].as_f64().unwrap_or(0.0),
            r["read_mb_s"].as_f64().unwrap_or(0.0)
        );
    }

    let (json_path, svg_path) = opts.paths("bio");
    let labels = [
        "64K folios, page by page",
        "64K folios, folio-aware",
        "single pages, page by page",
        "single pages, folio-aware",
    ];
    let series: Vec<Series> = (0..4)
        .map(|row| Series {
            label: labels[row].into(),
            points: SIZES
                .iter()
                .enumerate()
                .map(|(s, &size)| ((size >> 10) as f64, med(row, s)))
                .collect(),
        })
        .collect();
    line_plot(
        &svg_path,
        "E4: build a bio and release its pins",
        "I/O size (KiB)",
        "ns per bio",
        &series,
    )?;
    let rows: Vec<Value> = SIZES
        .iter()
        .enumerate()
        .map(|(s, &size)| {
            json!({
                "io_bytes": size,
                "folio64k_page_by_page_ns": round2(med(0, s)),
                "folio64k_folio_aware_ns": round2(med(1, s)),
                "pages_page_by_page_ns": round2(med(2, s)),
                "pages_folio_aware_ns": round2(med(3, s)),
                "segments_folio64k": seg[0][s].0,
                "segments_pages": seg[1][s].0,
                "pages": seg[0][s].1,
            })
        })
        .collect();
    let report = json!({
        "experiment": "E4 bio",
        "machine": crate::machine(),
        "settings": { "runs": runs, "folio_bytes": 4096 << FOLIO_ORDER, "limits": "256 segments × 64 KiB", "file_mib": file_mib, "o_direct": direct },
        "rows": rows,
        "direct_io": e2e,
        "seed": { "before_pct": SEED_BEFORE_PCT, "after_pct": SEED_AFTER_PCT },
        "summary": {
            "build_speedup_128k": s128,
            "build_speedup_1m": s1m,
            "segments_per_bio_128k_folio": seg[0][idx(128 << 10)].0,
            "target_build_speedup_128k": TARGET_SPEEDUP_128K,
            "target_met": s128 >= TARGET_SPEEDUP_128K,
        },
    });
    write_json(&json_path, &report)?;
    progress(
        "bio",
        format!("wrote {} and {}", json_path.display(), svg_path.display()),
    );
    Ok(report)
}
