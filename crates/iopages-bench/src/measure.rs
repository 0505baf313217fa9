//! Timing: the monotonic clock, the TSC, repetitions and their summary.
//!
//! Owns: turning a workload closure into ns and TSC cycles per operation,
//! repeated, with median and range. Must never: report a figure it did not
//! measure in this process.

use std::time::{Duration, Instant};

/// Read the time-stamp counter (0 where the CPU has none we can read).
#[inline]
pub fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC is available on every x86_64 CPU.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// TSC ticks per nanosecond, measured against the monotonic clock over
/// `span` (0.0 where there is no TSC).
pub fn tsc_ghz(span: Duration) -> f64 {
    let (t0, c0) = (Instant::now(), rdtsc());
    while t0.elapsed() < span {
        std::hint::spin_loop();
    }
    let (ns, cycles) = (
        t0.elapsed().as_nanos() as f64,
        rdtsc().wrapping_sub(c0) as f64,
    );
    if cycles == 0.0 {
        0.0
    } else {
        cycles / ns
    }
}

/// One timed run: cost per operation.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Nanoseconds per operation.
    pub ns: f64,
    /// TSC cycles per operation.
    pub cycles: f64,
}

/// Time `f`, which performs `ops` operations per call.
pub fn time_once(ops: u64, mut f: impl FnMut()) -> Sample {
    let (t0, c0) = (Instant::now(), rdtsc());
    f();
    let (ns, cycles) = (
        t0.elapsed().as_nanos() as f64,
        rdtsc().wrapping_sub(c0) as f64,
    );
    Sample {
        ns: ns / ops as f64,
        cycles: cycles / ops as f64,
    }
}

/// The median over runs of `num[i] / den[i]`: `None` unless both have a
/// sample from every run (a peer or row that failed in a run has fewer).
pub fn per_run_ratio(num: &[f64], den: &[f64]) -> Option<f64> {
    if num.len() != den.len() || num.is_empty() {
        return None;
    }
    let r: Vec<f64> = num.iter().zip(den).map(|(n, d)| n / d).collect();
    Some(median(&r))
}

/// The median of `v` (the mean of the middle two for an even count).
///
/// # Panics
/// If `v` is empty.
pub fn median(v: &[f64]) -> f64 {
    assert!(!v.is_empty(), "no values to take the median of");
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median and range of repeated samples.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Summary {
    /// Median ns per operation.
    pub ns: f64,
    /// Fastest run, ns per operation.
    pub ns_min: f64,
    /// Slowest run, ns per operation.
    pub ns_max: f64,
    /// Median TSC cycles per operation.
    pub cycles: f64,
    /// Runs.
    pub runs: usize,
}

impl Summary {
    /// Summarise `samples` (at least one).
    pub fn of(samples: &[Sample]) -> Summary {
        assert!(!samples.is_empty(), "no samples to summarise");
        let ns: Vec<f64> = samples.iter().map(|s| s.ns).collect();
        Summary {
            ns: median(&ns),
            ns_min: ns.iter().copied().fold(f64::INFINITY, f64::min),
            ns_max: ns.iter().copied().fold(0.0, f64::max),
            cycles: median(&samples.iter().map(|s| s.cycles).collect::<Vec<_>>()),
            runs: samples.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_range() {
        let s = |ns| Sample {
            ns,
            cycles: ns * 2.0,
        };
        let m = Summary::of(&[s(3.0), s(1.0), s(2.0)]);
        assert_eq!(
            (m.ns, m.ns_min, m.ns_max, m.cycles, m.runs),
            (2.0, 1.0, 3.0, 4.0, 3)
        );
        let even = Summary::of(&[s(1.0), s(4.0)]);
        assert_eq!(even.ns, 2.5);
    }

    #[test]
    fn time_once_divides_by_ops() {
        let s = time_once(1000, || std::thread::sleep(Duration::from_millis(2)));
        assert!(s.ns >= 2000.0, "{s:?}");
    }
}
