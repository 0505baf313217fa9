//! `xts`'s page part: what encrypting a request into pages that do not
//! follow each other costs, against one contiguous buffer.
//!
//! Owns: three ways of encrypting 1 MiB with the crypt target's cipher
//! (the default backend, 512-bit key, 4096-byte sectors), run by run
//! interleaved — into one buffer (one call), into 256 pages one page
//! apart with a call per page (how the target encrypted a write's out
//! pages when they were not contiguous), and into the same pages with one
//! scattered call (`XtsCipher::encrypt_sectors_scattered`, how it does
//! now). Each run's page rates are divided by that run's one-buffer rate.
//! Must never: assert a timing.
//!
//! The bound: the scattered call does the one-buffer call's work over the
//! same bytes, so its ratio should not pass 1 by more than the noise; the
//! report says whether it stayed under [`BOUND_SLACK`].

use crate::measure::median;
use crate::{progress, round2, BenchError};
use iopages_crypt::XtsCipher;
use serde_json::{json, Value};
use std::hint::black_box;
use std::time::Instant;

const PAGE: usize = 4096;
const BYTES: usize = 1 << 20;
/// A page rate above the one-buffer rate by more than this fraction is
/// reported as past the bound (the same work cannot run faster).
pub const BOUND_SLACK: f64 = 0.10;

/// The three ways, in the order each run measures them.
const WAYS: [&str; 3] = ["one_buffer", "per_page_calls", "scattered_call"];

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("xts pages: {e}"))
}

/// One way, `calls` times over `pages` (256 pages one page apart) or over
/// `one` (1 MiB contiguous): MB/s.
fn sample(
    x: &mut XtsCipher,
    way: usize,
    calls: usize,
    src: &[u8],
    one: &mut [u8],
    pages: &mut [u8],
) -> Result<f64, BenchError> {
    let t0 = Instant::now();
    for i in 0..calls {
        let first = (i * BYTES / PAGE) as u64;
        match way {
            0 => x.encrypt_sectors(first, black_box(src), one).map_err(err)?,
            1 => {
                for (k, page) in pages.chunks_exact_mut(2 * PAGE).enumerate() {
                    let s = &src[k * PAGE..][..PAGE];
                    x.encrypt_sectors(first + k as u64, black_box(s), &mut page[..PAGE])
                        .map_err(err)?;
                }
            }
            _ => {
                let mut segs: Vec<&mut [u8]> = pages
                    .chunks_exact_mut(2 * PAGE)
                    .map(|p| &mut p[..PAGE])
                    .collect();
                x.encrypt_sectors_scattered(first, black_box(src), &mut segs, false)
                    .map_err(err)?;
            }
        }
        black_box(&mut *one);
        black_box(&mut *pages);
    }
    Ok((calls * BYTES) as f64 / t0.elapsed().as_secs_f64() / 1e6)
}

/// Run the page part: `runs` interleaved runs of `calls` MiB per way.
/// Returns the report's `pages` section.
pub fn run(runs: usize, calls: usize) -> Result<Value, BenchError> {
    let key: Vec<u8> = (0..64u8)
        .map(|i| i.wrapping_mul(73).wrapping_add(11))
        .collect();
    let mut x = XtsCipher::new(&key, PAGE, 0).map_err(err)?;
    let src: Vec<u8> = (0..BYTES).map(|i| (i * 131 % 251) as u8).collect();
    let mut one = vec![0u8; BYTES];
    let mut pages = vec![0u8; 2 * BYTES];
    for w in 0..WAYS.len() {
        sample(&mut x, w, 2, &src, &mut one, &mut pages)?;
    }
    let mut mb_s = vec![Vec::new(); WAYS.len()];
    for _ in 0..runs {
        for (w, v) in mb_s.iter_mut().enumerate() {
            v.push(sample(&mut x, w, calls, &src, &mut one, &mut pages)?);
        }
    }
    let ratio = |w: usize| -> Vec<f64> { (0..runs).map(|r| mb_s[w][r] / mb_s[0][r]).collect() };
    let (per_page, scattered) = (ratio(1), ratio(2));
    let (pp, sc) = (median(&per_page), median(&scattered));
    progress(
        "xts",
        format!(
            "1 MiB into 256 pages ({}): one buffer {:.0} MB/s; a call per page {:.2}x that, one scattered call {:.2}x",
            x.backend().name(),
            median(&mb_s[0]),
            pp,
            sc
        ),
    );
    let within = sc <= 1.0 + BOUND_SLACK;
    Ok(json!({
        "what": "1 MiB encrypted (512-bit key, 4096-byte sectors) into one buffer, into 256 pages one page apart with a call per page, and into the same pages with one scattered call; MB/s per run, ratios to the one-buffer rate per run, median",
        "backend": x.backend().name(),
        "mb_s": WAYS.iter().zip(&mb_s).map(|(w, v)| (w.to_string(), json!(v.iter().map(|&m| round2(m)).collect::<Vec<_>>()))).collect::<serde_json::Map<_, _>>(),
        "per_page_calls_vs_one_buffer": round2(pp),
        "scattered_call_vs_one_buffer": round2(sc),
        "per_page_calls_vs_one_buffer_runs": per_page.iter().map(|&r| round2(r)).collect::<Vec<_>>(),
        "scattered_call_vs_one_buffer_runs": scattered.iter().map(|&r| round2(r)).collect::<Vec<_>>(),
        "bound": {"what": "the scattered call does the one-buffer call's work: at most 1 + slack", "slack": BOUND_SLACK, "within": within},
    }))
}
