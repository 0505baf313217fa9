//! Rate limits of an export: bytes and requests per second.
//!
//! Owns: one token bucket per limit, shared by every connection to the
//! export, and the count of requests that waited for it. Must never: make
//! a request wait longer than its share of the rate needs, or block on a
//! socket (a connection asks how long to wait, and waits in its own
//! pump, sending replies meanwhile).
//!
//! A bucket holds at most one second of its rate. A request takes what
//! it costs at once, and the bucket may go into debt for it (a 32 MiB
//! write under a 1 MiB/s limit is served, then the export waits 32 s): the
//! next request waits until the debt is paid. So any request size works
//! with any rate, and the long-run rate is the limit.

use parking_lot::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// An export's rate limits (`None`: no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimit {
    /// Bytes per second: payloads of reads and writes, and the bytes
    /// WRITE_ZEROES and TRIM cover.
    pub bytes_per_second: Option<u64>,
    /// Requests per second, of every command.
    pub requests_per_second: Option<u64>,
}

/// One token bucket.
struct Bucket {
    rate: f64,
    /// Tokens now; below zero is debt.
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u64, now: Instant) -> Bucket {
        assert!(rate > 0, "a rate limit of 0 would stop the export");
        Bucket {
            rate: rate as f64,
            tokens: rate as f64,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        self.at = now;
    }

    /// How long until the debt is paid (zero when there is none).
    fn wait(&self) -> Duration {
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// An export's buckets.
pub(crate) struct Rate {
    limit: RateLimit,
    buckets: Mutex<(Option<Bucket>, Option<Bucket>)>,
    /// Requests that had to wait.
    pub(crate) waits: AtomicU64,
}

impl Rate {
    pub(crate) fn new(limit: RateLimit) -> Rate {
        let now = Instant::now();
        Rate {
            limit,
            buckets: Mutex::new((
                limit.bytes_per_second.map(|r| Bucket::new(r, now)),
                limit.requests_per_second.map(|r| Bucket::new(r, now)),
            )),
            waits: AtomicU64::new(0),
        }
    }

    /// The limits.
    pub(crate) fn limit(&self) -> RateLimit {
        self.limit
    }

    /// Take one request of `bytes` if no debt is outstanding; otherwise
    /// how long to wait before asking again.
    ///
    /// **Context:** takes the buckets' lock for a few arithmetic steps.
    pub(crate) fn try_take(&self, bytes: u64) -> Result<(), Duration> {
        if self.limit == RateLimit::default() {
            return Ok(());
        }
        let now = Instant::now();
        let mut g = self.buckets.lock();
        let (b, r) = &mut *g;
        let mut wait = Duration::ZERO;
        for k in [b.as_mut(), r.as_mut()].into_iter().flatten() {
            k.refill(now);
            wait = wait.max(k.wait());
        }
        if !wait.is_zero() {
            return Err(wait);
        }
        if let Some(b) = b {
            b.tokens -= bytes as f64;
        }
        if let Some(r) = r {
            r.tokens -= 1.0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_limit_never_waits() {
        let r = Rate::new(RateLimit::default());
        for _ in 0..1000 {
            assert_eq!(r.try_take(1 << 30), Ok(()));
        }
    }

    #[test]
    fn a_request_may_run_into_debt_and_the_next_waits_it_off() {
        let r = Rate::new(RateLimit {
            bytes_per_second: Some(1000),
            requests_per_second: None,
        });
        // A second's worth in the bucket, then 4 s of debt in one go.
        assert_eq!(r.try_take(5000), Ok(()));
        let w = r.try_take(1).unwrap_err();
        assert!(
            w > Duration::from_millis(3900) && w <= Duration::from_secs(4),
            "{w:?}"
        );
    }

    #[test]
    fn requests_per_second_count_requests_not_bytes() {
        let r = Rate::new(RateLimit {
            bytes_per_second: None,
            requests_per_second: Some(10),
        });
        for _ in 0..10 {
            assert_eq!(r.try_take(1 << 20), Ok(()));
        }
        // The bucket is at 0: the next one is served and puts it in debt.
        assert_eq!(r.try_take(0), Ok(()));
        let w = r.try_take(0).unwrap_err();
        assert!(w <= Duration::from_millis(100), "{w:?}");
    }

    #[test]
    fn the_bucket_refills_at_the_rate_and_holds_one_second() {
        let now = Instant::now();
        let mut b = Bucket::new(100, now);
        b.tokens = -50.0;
        b.refill(now + Duration::from_millis(250));
        assert!((b.tokens - -25.0).abs() < 1e-6);
        b.refill(now + Duration::from_secs(10));
        assert_eq!(b.tokens, 100.0);
    }
}
