//! E4: building a bio from a page array and releasing its pins, page by
//! page against folio by folio (seed 002), and direct I/O of folio
//! buffers through io_uring end to end.
//!
//! Owns: the workloads, the table, the JSON report and the plot. Must
//! never: report a build whose bio differs between the two builders (each
//! run checks they produce the same segments), or leave pins or pages
//! behind.

use crate::harness::{interleave, Plot, PlotFile, Report, Table};
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages::{Bio, BioLimits, FolioBuffer, Gfp, HugePages, Page, PageAllocator};
use iopages_crypt::dio::DirectFile;
use iopages_crypt::uring::{UringFile, UringOptions};
use serde::Serialize;
use serde_json::Value;
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

/// (segments, pages) per bio of each size, `[buffer][size]`, for each
/// buffer of `bufs`.
fn segments_of(
    alloc: &PageAllocator,
    bufs: &[Vec<Page>],
) -> Result<Vec<Vec<(usize, usize)>>, BenchError> {
    let mut seg = Vec::new();
    for pages in bufs {
        let row: Result<Vec<_>, _> = SIZES
            .iter()
            .map(|&size| segments(alloc, pages, size))
            .collect();
        seg.push(row?);
    }
    Ok(seg)
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
    let bufs = [folio_buf.pages(), page_buf.pages()];

    // Configurations (buffer, size, folio-aware), the builder inner; the
    // samples land in ns[buffer * 2 + folio-aware][size].
    let configs: Vec<(usize, usize, bool)> = (0..bufs.len())
        .flat_map(|b| (0..SIZES.len()).flat_map(move |s| [(b, s, false), (b, s, true)]))
        .collect();
    let samples = interleave(
        "bio",
        configs.len(),
        runs,
        &mut (),
        |_, _| Ok(()),
        |_, c| {
            let (b, s, folio_aware) = configs[c];
            let iters = (budget_pages / (SIZES[s] / 4096)).max(100);
            build_sample(&alloc, &bufs[b], SIZES[s], folio_aware, iters)
        },
    )?;
    let mut ns = vec![Vec::new(); 4];
    for (&(b, _, folio_aware), v) in configs.iter().zip(samples) {
        ns[b * 2 + folio_aware as usize].push(median(v));
    }
    let seg = segments_of(&alloc, &bufs)?;
    let (direct, e2e) = direct_io(opts, &alloc, runs, file_mib)?;
    drop(folio_buf);
    drop(page_buf);
    alloc
        .leak_check()
        .map_err(|a| workload(format!("bio: pages leaked: {a}")))?;

    let f = Figures { ns, seg };
    table(&f, runs, direct, &e2e).print();
    let plot = plot(&f);
    let settings = Settings {
        runs,
        folio_bytes: 4096 << FOLIO_ORDER,
        limits: "256 segments × 64 KiB",
        file_mib,
        o_direct: direct,
    };
    Report::new("E4 bio", settings, body(&f, e2e))
        .stem("bio")
        .emit(opts, &[plot])
}

/// The plot: ns per bio of each buffer and builder, by I/O size.
fn plot(f: &Figures) -> Plot {
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
                .map(|(s, &size)| ((size >> 10) as f64, f.ns[row][s]))
                .collect(),
        })
        .collect();
    Plot::lines(
        PlotFile::Main,
        "E4: build a bio and release its pins",
        "I/O size (KiB)",
        "ns per bio",
        series,
    )
}

/// Medians of the build runs, `ns[buffer * 2 + folio-aware][size]`, and
/// (segments, pages) per bio, `seg[buffer][size]`.
struct Figures {
    ns: Vec<Vec<f64>>,
    seg: Vec<Vec<(usize, usize)>>,
}

impl Figures {
    /// Page by page over folio by folio, 64 KiB folios, at `size`.
    fn speedup(&self, size: usize) -> f64 {
        let s = SIZES.iter().position(|&x| x == size).expect("a size");
        self.ns[0][s] / self.ns[1][s]
    }
}

/// One direct-I/O figure: a buffer layout and builder at one I/O size.
#[derive(Serialize)]
struct DirectIoRow {
    io_bytes: usize,
    buffer: &'static str,
    folio_aware: bool,
    write_mb_s: f64,
    read_mb_s: f64,
}

/// End to end: direct I/O through io_uring on a file of `file_mib` MiB
/// beside the report. Returns whether O_DIRECT was honoured and the rows.
fn direct_io(
    opts: &BenchOptions,
    alloc: &PageAllocator,
    runs: usize,
    file_mib: u64,
) -> Result<(bool, Vec<DirectIoRow>), BenchError> {
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
        for (buffer, order) in [("folio64k", FOLIO_ORDER), ("pages", 0)] {
            for folio_aware in [false, true] {
                let dio = DirectFile::new(Arc::clone(&file), alloc).with_page_by_page(!folio_aware);
                let mut buf = alloc
                    .alloc_buffer(Gfp::KERNEL, io, order)
                    .map_err(workload)?;
                let (mut w, mut r) = (Vec::new(), Vec::new());
                for _ in 0..runs.min(3) {
                    let (a, b) = dio_sample(&dio, &mut buf, io, file_mib << 20)?;
                    w.push(a);
                    r.push(b);
                }
                e2e.push(DirectIoRow {
                    io_bytes: io,
                    buffer,
                    folio_aware,
                    write_mb_s: round2(median(w)),
                    read_mb_s: round2(median(r)),
                });
            }
        }
        progress("bio", format!("direct I/O of {} KiB done", io >> 10));
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    Ok((direct, e2e))
}

fn table(f: &Figures, runs: usize, direct: bool, e2e: &[DirectIoRow]) -> Table {
    let (ns, seg) = (&f.ns, &f.seg);
    let (s128, s1m) = (f.speedup(128 << 10), f.speedup(1 << 20));
    let mut t = Table::new("");
    t.line(format!(
        "bio (E4): ns to build a bio from a page array and release its pins (median of {runs} runs); segments per bio (default limits: 256 × 64 KiB)"
    ));
    t.line(format!(
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
    ));
    for (s, &size) in SIZES.iter().enumerate() {
        t.line(format!(
            "{:>7}K | {:>12} {:>12.0} {:>7.0} {:>5} | {:>12} {:>12.0} {:>7.0} {:>5}",
            size >> 10,
            format!("{:.1}×", ns[0][s] / ns[1][s]),
            ns[0][s],
            ns[1][s],
            seg[0][s].0,
            format!("{:.1}×", ns[2][s] / ns[3][s]),
            ns[2][s],
            ns[3][s],
            seg[1][s].0,
        ));
    }
    t.line(format!(
        "seed 002 (kernel, fio direct I/O on large folios): bio_iov_iter_get_pages {SEED_BEFORE_PCT} % → {SEED_AFTER_PCT} % of cycles ({:.1}× less)",
        SEED_BEFORE_PCT / SEED_AFTER_PCT
    ));
    t.line(format!(
        "target build_speedup_128k >= {TARGET_SPEEDUP_128K}: {s128:.2} ({}); 1 MiB: {s1m:.2}",
        met(s128 >= TARGET_SPEEDUP_128K)
    ));
    t.line(format!(
        "direct I/O through io_uring ({}), MB/s write / read:",
        if direct {
            "O_DIRECT"
        } else {
            "buffered: the file system refused O_DIRECT"
        }
    ));
    for r in e2e {
        t.line(format!(
            "  {:>5} KiB, {:>8}, {:>12}: {:>7.0} / {:>7.0}",
            r.io_bytes >> 10,
            r.buffer,
            if r.folio_aware {
                "folio-aware"
            } else {
                "page-by-page"
            },
            r.write_mb_s,
            r.read_mb_s
        ));
    }
    t
}

#[derive(Serialize)]
struct Settings {
    runs: usize,
    folio_bytes: usize,
    limits: &'static str,
    file_mib: u64,
    o_direct: bool,
}

/// One I/O size's build figures.
#[derive(Serialize)]
struct Row {
    io_bytes: usize,
    folio64k_page_by_page_ns: f64,
    folio64k_folio_aware_ns: f64,
    pages_page_by_page_ns: f64,
    pages_folio_aware_ns: f64,
    segments_folio64k: usize,
    segments_pages: usize,
    pages: usize,
}

#[derive(Serialize)]
struct Seed {
    before_pct: f64,
    after_pct: f64,
}

#[derive(Serialize)]
struct Summary {
    build_speedup_128k: f64,
    build_speedup_1m: f64,
    segments_per_bio_128k_folio: usize,
    target_build_speedup_128k: f64,
    target_met: bool,
}

#[derive(Serialize)]
struct Body {
    rows: Vec<Row>,
    direct_io: Vec<DirectIoRow>,
    seed: Seed,
    summary: Summary,
}

fn body(f: &Figures, direct_io: Vec<DirectIoRow>) -> Body {
    let (ns, seg) = (&f.ns, &f.seg);
    let s128 = f.speedup(128 << 10);
    let i128 = SIZES.iter().position(|&x| x == 128 << 10).expect("a size");
    Body {
        rows: SIZES
            .iter()
            .enumerate()
            .map(|(s, &io_bytes)| Row {
                io_bytes,
                folio64k_page_by_page_ns: round2(ns[0][s]),
                folio64k_folio_aware_ns: round2(ns[1][s]),
                pages_page_by_page_ns: round2(ns[2][s]),
                pages_folio_aware_ns: round2(ns[3][s]),
                segments_folio64k: seg[0][s].0,
                segments_pages: seg[1][s].0,
                pages: seg[0][s].1,
            })
            .collect(),
        direct_io,
        seed: Seed {
            before_pct: SEED_BEFORE_PCT,
            after_pct: SEED_AFTER_PCT,
        },
        summary: Summary {
            build_speedup_128k: s128,
            build_speedup_1m: f.speedup(1 << 20),
            segments_per_bio_128k_folio: seg[0][i128].0,
            target_build_speedup_128k: TARGET_SPEEDUP_128K,
            target_met: s128 >= TARGET_SPEEDUP_128K,
        },
    }
}
