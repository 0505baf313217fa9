//! Fault injection for page allocations (the kernel's `fail_page_alloc`).
//!
//! Owns: the decision whether one allocation attempt fails on purpose.
//! Must never: fail a `NOFAIL` allocation, or cost anything when off — the
//! fast paths compare a cache's length with one floor (see
//! [`FaultInjector::alloc_floor`]) that switching injection on raises above
//! every length, so that each allocation leaves the fast path and is
//! considered.

use crate::gfp::Gfp;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Which allocations fail on purpose, and how often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultConfig {
    /// Chance that an eligible attempt fails, in parts per million
    /// (1_000_000 = always).
    pub probability_ppm: u32,
    /// Only every `interval`-th eligible attempt may fail (1 = any).
    pub interval: u64,
    /// Stop after this many injected failures (`None` = no limit).
    pub times: Option<u64>,
    /// Only allocations of at least this order may fail.
    pub min_order: u32,
    /// Whether allocations that cannot block (`NOWAIT`, `ATOMIC`) may fail.
    pub fail_nowait: bool,
    /// Whether allocations that may block (`KERNEL`, `NOIO`, ...) may fail.
    pub fail_blocking: bool,
    /// Seed of the pseudo-random sequence, for reproducible runs.
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            probability_ppm: 1_000_000,
            interval: 1,
            times: None,
            min_order: 0,
            fail_nowait: true,
            fail_blocking: true,
            seed: 0x9e37_79b9_7f4a_7c15,
        }
    }
}

/// The allocator's fault injector. Off until [`FaultInjector::enable`].
pub struct FaultInjector {
    enabled: AtomicBool,
    /// The allocation fast paths' floor: a cache hit is taken only while
    /// the cache holds more than this many blocks. 0, or `usize::MAX`
    /// while injection is on or the allocator is careful for good
    /// (`careful`: allocation checks, or every call counted).
    floor: AtomicUsize,
    careful: AtomicBool,
    state: Mutex<State>,
    injected: AtomicU64,
}

struct State {
    cfg: FaultConfig,
    attempts: u64,
    rng: u64,
}

impl Default for FaultInjector {
    fn default() -> Self {
        FaultInjector {
            enabled: AtomicBool::new(false),
            floor: AtomicUsize::new(0),
            careful: AtomicBool::new(false),
            state: Mutex::new(State {
                cfg: FaultConfig::default(),
                attempts: 0,
                rng: 1,
            }),
            injected: AtomicU64::new(0),
        }
    }
}

impl FaultInjector {
    /// Start failing allocations as `cfg` says.
    pub fn enable(&self, cfg: FaultConfig) {
        let mut s = self.state.lock();
        s.rng = cfg.seed | 1;
        s.attempts = 0;
        s.cfg = cfg;
        self.enabled.store(true, Relaxed);
        self.floor.store(usize::MAX, Relaxed);
    }

    /// Stop failing allocations.
    pub fn disable(&self) {
        let _s = self.state.lock();
        self.enabled.store(false, Relaxed);
        if !self.careful.load(Relaxed) {
            self.floor.store(0, Relaxed);
        }
    }

    /// Keep every allocation off the fast paths for good (set once, when
    /// the allocator is built with checks or with every call counted).
    pub(crate) fn set_careful(&self) {
        self.careful.store(true, Relaxed);
        self.floor.store(usize::MAX, Relaxed);
    }

    /// The fast paths' floor: an order-`o` cache hit is taken only when
    /// the cache holds more blocks than this (`len > floor`, one compare).
    /// 0 normally; `usize::MAX` while injection is on or the allocator is
    /// careful, so that no length passes. Written with relaxed stores:
    /// the thread that switches injection on sees the change at once,
    /// other threads at their next load.
    #[inline(always)]
    pub(crate) fn alloc_floor(&self) -> &AtomicUsize {
        &self.floor
    }

    /// Whether injection is on (one relaxed load).
    #[inline]
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Relaxed)
    }

    /// Failures injected since the allocator was created.
    pub fn injected(&self) -> u64 {
        self.injected.load(Relaxed)
    }

    /// Whether this attempt must fail.
    #[cold]
    pub(crate) fn should_fail(&self, gfp: Gfp, order: u32) -> bool {
        if !self.is_enabled() || gfp.contains(Gfp::NOFAIL) {
            return false;
        }
        let mut s = self.state.lock();
        let cfg = &s.cfg;
        if order < cfg.min_order
            || (gfp.may_block() && !cfg.fail_blocking)
            || (!gfp.may_block() && !cfg.fail_nowait)
            || cfg.times == Some(0)
        {
            return false;
        }
        s.attempts += 1;
        if s.cfg.interval > 1 && s.attempts % s.cfg.interval != 0 {
            return false;
        }
        if s.cfg.probability_ppm < 1_000_000 {
            // xorshift64*: cheap, reproducible from the seed.
            let mut x = s.rng;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            s.rng = x;
            if (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % 1_000_000
                >= s.cfg.probability_ppm as u64
            {
                return false;
            }
        }
        if let Some(t) = s.cfg.times.as_mut() {
            *t -= 1;
        }
        self.injected.fetch_add(1, Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_never_fails_nofail() {
        let f = FaultInjector::default();
        assert!(!f.should_fail(Gfp::KERNEL, 0));
        f.enable(FaultConfig::default());
        assert!(f.should_fail(Gfp::KERNEL, 0));
        assert!(!f.should_fail(Gfp::KERNEL | Gfp::NOFAIL, 0));
        f.disable();
        assert!(!f.should_fail(Gfp::KERNEL, 0));
    }

    #[test]
    fn interval_times_order_and_context_filters() {
        let f = FaultInjector::default();
        f.enable(FaultConfig {
            interval: 3,
            times: Some(2),
            ..FaultConfig::default()
        });
        let fails: Vec<bool> = (0..12).map(|_| f.should_fail(Gfp::KERNEL, 0)).collect();
        assert_eq!(fails.iter().filter(|&&b| b).count(), 2);
        assert!(fails[2] && fails[5] && !fails[8]);

        f.enable(FaultConfig {
            min_order: 2,
            fail_nowait: false,
            ..FaultConfig::default()
        });
        assert!(!f.should_fail(Gfp::KERNEL, 1));
        assert!(f.should_fail(Gfp::KERNEL, 2));
        assert!(!f.should_fail(Gfp::NOWAIT, 3));
        assert_eq!(f.injected(), 3);
    }

    #[test]
    fn probability_is_roughly_honoured_and_reproducible() {
        let run = || {
            let f = FaultInjector::default();
            f.enable(FaultConfig {
                probability_ppm: 250_000,
                ..FaultConfig::default()
            });
            (0..10_000)
                .map(|_| f.should_fail(Gfp::NOWAIT, 0))
                .collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let n = a.iter().filter(|&&b| b).count();
        assert!((2000..3000).contains(&n), "{n} failures of 10000 at 25 %");
    }
}
