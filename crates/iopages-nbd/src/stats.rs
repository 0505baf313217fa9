//! Per-command request and byte counts of a server, and the shape of the
//! I/O its clients send.
//!
//! Owns: counters bumped as requests complete, histograms of request
//! sizes and offset alignment bumped as requests arrive (the `blkalgn`
//! view of a workload: whether a client's I/O fits the volume's sectors),
//! latency histograms per command class and the requests in flight, and
//! their snapshot; where payload buffers came from (filled in by the
//! server's `buffers.rs`). Shared by the server and the remote client
//! (its latency histograms). Must never: block or take a lock on the I/O
//! path, or name the server or the client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Where payload buffers came from, so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Buffers that were one contiguous block of the arena.
    pub arena_contiguous: u64,
    /// Buffers that were a vmalloc area over arena pages.
    pub arena_vmalloc: u64,
    /// Buffers from the heap (the arena could give none).
    pub heap: u64,
}

/// Counts of one command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommandStats {
    /// Requests that completed successfully.
    pub requests: u64,
    /// Bytes those requests covered (their lengths).
    pub bytes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

/// A snapshot of a server's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections that reached transmission (NBD_OPT_GO or EXPORT_NAME).
    pub sessions: u64,
    /// NBD_CMD_READ.
    pub read: CommandStats,
    /// NBD_CMD_WRITE.
    pub write: CommandStats,
    /// NBD_CMD_FLUSH.
    pub flush: CommandStats,
    /// NBD_CMD_TRIM.
    pub trim: CommandStats,
    /// NBD_CMD_WRITE_ZEROES.
    pub write_zeroes: CommandStats,
    /// NBD_CMD_BLOCK_STATUS (bytes: the range asked about).
    pub block_status: CommandStats,
    /// Requests with an unknown command.
    pub other: CommandStats,
    /// Where payload buffers came from.
    pub buffers: BufferStats,
    /// Connections open now (handshake or transmission).
    pub open_connections: u64,
    /// Of those, connections waiting without a thread for their client:
    /// in the handshake, or in transmission for the next request or the
    /// rest of one (see `ServerOptions::park_after`; their requests in
    /// flight, if any, complete meanwhile).
    pub parked_connections: u64,
    /// Connections refused because `max_connections` were in
    /// transmission and the client's peer held its share.
    pub refused_connections: u64,
    /// Handshakes that missed the handshake deadline.
    pub handshake_timeouts: u64,
    /// Sessions upgraded to TLS.
    pub tls_sessions: u64,
    /// TLS handshakes that failed (wrong key or certificate, …).
    pub tls_failures: u64,
    /// Connections given up because a reply was not taken within the
    /// reply timeout.
    pub reply_timeouts: u64,
    /// Connections closed because a request begun (its header or its
    /// payload) was not whole in time.
    pub payload_timeouts: u64,
    /// Connections closed after the idle timeout.
    pub idle_closes: u64,
    /// Socket writes that carried replies to clients (a reply bigger
    /// than one write's room counts each): replies over this is how many
    /// replies one write carried.
    pub reply_writes: u64,
    /// Requests that waited for the server's byte budget.
    pub budget_waits: u64,
    /// Requests answered ENOMEM: the budget stayed exhausted.
    pub budget_refusals: u64,
    /// Payload bytes in flight now, over all connections.
    pub budget_used_bytes: u64,
    /// The shape of the reads and writes clients sent.
    pub shape: IoShape,
    /// How long requests took, from their header's arrival to their reply
    /// being queued, per command class.
    pub latency: Latency,
    /// Requests submitted to a volume and not answered yet (a gauge).
    pub in_flight: u64,
    /// How the server's limits are shared among its peers (the server's
    /// figures; zero in one export's).
    pub peers: PeerStats,
    /// An export's own figures (summed over the exports in the server's).
    pub export: ExportFigures,
}

/// How the server's limits are shared among its peers (aggregated: never
/// a figure per peer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Connections in the handshake now.
    pub handshakes_open: u64,
    /// Handshakes closed to admit a new connection (the handshake pool
    /// was full).
    pub handshake_evictions: u64,
    /// Connections in transmission closed so a peer under its share got
    /// its guarantee.
    pub share_evictions: u64,
    /// Requests for an export refused by its `allow` rules.
    pub authorization_refusals: u64,
    /// Peers with a connection now.
    pub active: u64,
    /// Peers holding at least their guarantee of connections or bytes now.
    pub at_share: u64,
    /// Requests of peers past their share that waited so a peer under its
    /// share went first (each request counted once).
    pub budget_share_waits: u64,
}

/// One export's own figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportFigures {
    /// Opens of a lazy export that failed.
    pub open_failures: u64,
    /// Requests that waited for the export's rate limits.
    pub rate_waits: u64,
    /// The export's byte rate limit (0: none; not summed).
    pub rate_bytes_per_second: u64,
    /// The export's request rate limit (0: none; not summed).
    pub rate_requests_per_second: u64,
}

impl CommandStats {
    fn add(&mut self, o: &CommandStats) {
        self.requests += o.requests;
        self.bytes += o.bytes;
        self.errors += o.errors;
    }
}

impl DirShape {
    fn add(&mut self, o: &DirShape) {
        for (a, b) in self.sizes.iter_mut().zip(&o.sizes) {
            *a += b;
        }
        for (a, b) in self.align.iter_mut().zip(&o.align) {
            *a += b;
        }
        self.partial_sector += o.partial_sector;
        self.bytes += o.bytes;
        self.sector_bytes += o.sector_bytes;
    }
}

impl Stats {
    /// Add `o`'s counts to these (the server's totals over its exports;
    /// the shape's sector size stays this one's).
    pub fn add(&mut self, o: &Stats) {
        self.connections += o.connections;
        self.sessions += o.sessions;
        for (a, b) in [
            (&mut self.read, &o.read),
            (&mut self.write, &o.write),
            (&mut self.flush, &o.flush),
            (&mut self.trim, &o.trim),
            (&mut self.write_zeroes, &o.write_zeroes),
            (&mut self.block_status, &o.block_status),
            (&mut self.other, &o.other),
        ] {
            a.add(b);
        }
        self.buffers.arena_contiguous += o.buffers.arena_contiguous;
        self.buffers.arena_vmalloc += o.buffers.arena_vmalloc;
        self.buffers.heap += o.buffers.heap;
        self.open_connections += o.open_connections;
        self.parked_connections += o.parked_connections;
        self.refused_connections += o.refused_connections;
        self.handshake_timeouts += o.handshake_timeouts;
        self.tls_sessions += o.tls_sessions;
        self.tls_failures += o.tls_failures;
        self.reply_timeouts += o.reply_timeouts;
        self.payload_timeouts += o.payload_timeouts;
        self.idle_closes += o.idle_closes;
        self.reply_writes += o.reply_writes;
        self.budget_waits += o.budget_waits;
        self.budget_refusals += o.budget_refusals;
        self.budget_used_bytes += o.budget_used_bytes;
        self.shape.read.add(&o.shape.read);
        self.shape.write.add(&o.shape.write);
        self.latency.read.add(&o.latency.read);
        self.latency.write.add(&o.latency.write);
        self.latency.other.add(&o.latency.other);
        self.in_flight += o.in_flight;
        self.export.open_failures += o.export.open_failures;
        self.export.rate_waits += o.export.rate_waits;
    }
}

/// Buckets of the latency histograms: bucket `k < LATENCY_BUCKETS - 1`
/// counts latencies of at most 2^k µs (and more than 2^(k-1) µs), from
/// 1 µs to 2^24 µs (about 16.8 s); the last counts everything longer.
pub const LATENCY_BUCKETS: usize = 26;

/// The latency bucket of `d`: the smallest `k` with `d <= 2^k` µs, or
/// `LATENCY_BUCKETS - 1` past 2^24 µs.
pub fn latency_bucket(d: Duration) -> usize {
    let us = d.as_nanos().div_ceil(1000);
    let k = if us <= 1 {
        0
    } else {
        128 - (us - 1).leading_zeros() as usize
    };
    k.min(LATENCY_BUCKETS - 1)
}

/// The upper bound of latency bucket `k` in µs (`None` for the last,
/// unbounded one).
pub fn latency_bucket_bound_us(k: usize) -> Option<u64> {
    (k < LATENCY_BUCKETS - 1).then(|| 1u64 << k)
}

/// A latency histogram of one command class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LatencyHist {
    /// Requests by latency: see [`LATENCY_BUCKETS`] (not cumulative).
    pub buckets: [u64; LATENCY_BUCKETS],
    /// The latencies' sum in nanoseconds.
    pub sum_ns: u64,
}

impl LatencyHist {
    /// Requests counted (the buckets' sum).
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The latencies' sum in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 / 1e9
    }

    fn add(&mut self, o: &LatencyHist) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.sum_ns += o.sum_ns;
    }
}

/// Latency histograms per command class. Requests refused before reaching
/// the volume (invalid, or over the byte budget) and BLOCK_STATUS are not
/// counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    /// NBD_CMD_READ.
    pub read: LatencyHist,
    /// NBD_CMD_WRITE.
    pub write: LatencyHist,
    /// The other writes: NBD_CMD_FLUSH, TRIM and WRITE_ZEROES.
    pub other: LatencyHist,
}

/// A latency histogram as atomics.
pub(crate) struct LatencyCounter {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for LatencyCounter {
    fn default() -> Self {
        LatencyCounter {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl LatencyCounter {
    /// Count a request that took `d`.
    pub(crate) fn record(&self, d: Duration) {
        self.buckets[latency_bucket(d)].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> LatencyHist {
        LatencyHist {
            buckets: std::array::from_fn(|k| self.buckets[k].load(Ordering::Relaxed)),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

/// Buckets of the shape histograms: bucket `k` is 2^k bytes.
pub const SHAPE_BUCKETS: usize = 26;

/// The bucket of a request of `len` bytes: the smallest `k` with
/// `len <= 2^k` (lengths past 32 MiB in the last bucket, 0 in the first).
pub fn size_bucket(len: u64) -> usize {
    let k = if len <= 1 {
        0
    } else {
        64 - (len - 1).leading_zeros() as usize
    };
    k.min(SHAPE_BUCKETS - 1)
}

/// The bucket of an offset: the largest `k` with 2^k dividing it (offset
/// 0, and alignments past 32 MiB, in the last bucket).
pub fn align_bucket(offset: u64) -> usize {
    if offset == 0 {
        SHAPE_BUCKETS - 1
    } else {
        (offset.trailing_zeros() as usize).min(SHAPE_BUCKETS - 1)
    }
}

/// The requests of one direction, as they arrived (served or refused).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirShape {
    /// Requests by length: `sizes[k]` counts lengths in (2^(k-1), 2^k].
    pub sizes: [u64; SHAPE_BUCKETS],
    /// Requests by offset alignment: `align[k]` counts offsets whose
    /// largest power-of-two divisor is 2^k.
    pub align: [u64; SHAPE_BUCKETS],
    /// Requests that start or end inside a sector of the volume.
    pub partial_sector: u64,
    /// Bytes asked for.
    pub bytes: u64,
    /// Bytes of the whole sectors those requests touch: what a server that
    /// served partial sectors by read-modify-write would read and write.
    pub sector_bytes: u64,
}

impl DirShape {
    /// Requests counted.
    pub fn requests(&self) -> u64 {
        self.sizes.iter().sum()
    }

    /// Worst-case amplification: whole-sector bytes over bytes asked for
    /// (1.0 when every request is whole sectors, or there were none).
    pub fn amplification(&self) -> f64 {
        if self.bytes == 0 {
            1.0
        } else {
            self.sector_bytes as f64 / self.bytes as f64
        }
    }
}

/// Shape histograms of reads (NBD_CMD_READ) and writes (NBD_CMD_WRITE).
/// Partial-sector requests are refused with EINVAL by this server; the
/// counts show what a client sends, and what serving it by
/// read-modify-write would cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoShape {
    /// The volume's sector size the partial counts are relative to.
    pub sector_bytes: u64,
    /// Reads.
    pub read: DirShape,
    /// Writes.
    pub write: DirShape,
}

/// The shape histograms of one direction, as atomics.
pub(crate) struct ShapeCounter {
    sizes: [AtomicU64; SHAPE_BUCKETS],
    align: [AtomicU64; SHAPE_BUCKETS],
    partial: AtomicU64,
    bytes: AtomicU64,
    sector_bytes: AtomicU64,
}

impl Default for ShapeCounter {
    fn default() -> Self {
        ShapeCounter {
            sizes: std::array::from_fn(|_| AtomicU64::new(0)),
            align: std::array::from_fn(|_| AtomicU64::new(0)),
            partial: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            sector_bytes: AtomicU64::new(0),
        }
    }
}

impl ShapeCounter {
    /// Count a request of `len` bytes at `offset` on a volume of `ss`-byte
    /// sectors (a power of two).
    pub(crate) fn record(&self, offset: u64, len: u64, ss: u64) {
        self.sizes[size_bucket(len)].fetch_add(1, Ordering::Relaxed);
        self.align[align_bucket(offset)].fetch_add(1, Ordering::Relaxed);
        let start = offset & !(ss - 1);
        let end = offset.saturating_add(len).saturating_add(ss - 1) & !(ss - 1);
        let whole = end.saturating_sub(start);
        if whole != len {
            self.partial.fetch_add(1, Ordering::Relaxed);
        }
        self.bytes.fetch_add(len, Ordering::Relaxed);
        self.sector_bytes.fetch_add(whole, Ordering::Relaxed);
    }

    fn get(&self) -> DirShape {
        DirShape {
            sizes: std::array::from_fn(|k| self.sizes[k].load(Ordering::Relaxed)),
            align: std::array::from_fn(|k| self.align[k].load(Ordering::Relaxed)),
            partial_sector: self.partial.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            sector_bytes: self.sector_bytes.load(Ordering::Relaxed),
        }
    }
}

#[derive(Default)]
pub(crate) struct Counter {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

impl Counter {
    pub(crate) fn done(&self, bytes: u64, error: u32) {
        if error == 0 {
            self.requests.fetch_add(1, Ordering::Relaxed);
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn get(&self) -> CommandStats {
        CommandStats {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) connections: AtomicU64,
    pub(crate) sessions: AtomicU64,
    pub(crate) read: Counter,
    pub(crate) write: Counter,
    pub(crate) flush: Counter,
    pub(crate) trim: Counter,
    pub(crate) block_status: Counter,
    pub(crate) write_zeroes: Counter,
    pub(crate) other: Counter,
    pub(crate) open: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) tls_sessions: AtomicU64,
    pub(crate) tls_failures: AtomicU64,
    pub(crate) reply_timeouts: AtomicU64,
    pub(crate) payload_timeouts: AtomicU64,
    pub(crate) idle_closes: AtomicU64,
    pub(crate) reply_writes: AtomicU64,
    pub(crate) budget_waits: AtomicU64,
    pub(crate) budget_refusals: AtomicU64,
    pub(crate) authorization_refusals: AtomicU64,
    pub(crate) read_shape: ShapeCounter,
    pub(crate) write_shape: ShapeCounter,
    pub(crate) read_latency: LatencyCounter,
    pub(crate) write_latency: LatencyCounter,
    pub(crate) other_latency: LatencyCounter,
    /// Requests submitted and not answered yet.
    pub(crate) in_flight: AtomicU64,
}

impl Counters {
    pub(crate) fn command(&self, command: u16) -> &Counter {
        use crate::proto::*;
        match command {
            CMD_READ => &self.read,
            CMD_WRITE => &self.write,
            CMD_FLUSH => &self.flush,
            CMD_TRIM => &self.trim,
            CMD_WRITE_ZEROES => &self.write_zeroes,
            CMD_BLOCK_STATUS => &self.block_status,
            _ => &self.other,
        }
    }
    /// The latency histogram of `command`'s class.
    pub(crate) fn latency(&self, command: u16) -> &LatencyCounter {
        use crate::proto::*;
        match command {
            CMD_READ => &self.read_latency,
            CMD_WRITE => &self.write_latency,
            _ => &self.other_latency,
        }
    }
    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            connections: self.connections.load(Ordering::Relaxed),
            sessions: self.sessions.load(Ordering::Relaxed),
            read: self.read.get(),
            write: self.write.get(),
            flush: self.flush.get(),
            trim: self.trim.get(),
            write_zeroes: self.write_zeroes.get(),
            block_status: self.block_status.get(),
            other: self.other.get(),
            buffers: BufferStats::default(),
            open_connections: self.open.load(Ordering::Relaxed),
            parked_connections: 0,
            // The server's figure comes from its shares.
            refused_connections: 0,
            handshake_timeouts: self.handshake_timeouts.load(Ordering::Relaxed),
            tls_sessions: self.tls_sessions.load(Ordering::Relaxed),
            tls_failures: self.tls_failures.load(Ordering::Relaxed),
            reply_timeouts: self.reply_timeouts.load(Ordering::Relaxed),
            payload_timeouts: self.payload_timeouts.load(Ordering::Relaxed),
            idle_closes: self.idle_closes.load(Ordering::Relaxed),
            reply_writes: self.reply_writes.load(Ordering::Relaxed),
            budget_waits: self.budget_waits.load(Ordering::Relaxed),
            budget_refusals: self.budget_refusals.load(Ordering::Relaxed),
            budget_used_bytes: 0,
            shape: IoShape {
                sector_bytes: 0,
                read: self.read_shape.get(),
                write: self.write_shape.get(),
            },
            latency: Latency {
                read: self.read_latency.get(),
                write: self.write_latency.get(),
                other: self.other_latency.get(),
            },
            in_flight: self.in_flight.load(Ordering::Relaxed),
            peers: PeerStats::default(),
            export: ExportFigures::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_and_saturate() {
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(1), 0);
        assert_eq!(size_bucket(512), 9);
        assert_eq!(size_bucket(513), 10);
        assert_eq!(size_bucket(4096), 12);
        assert_eq!(size_bucket(32 << 20), 25);
        assert_eq!(size_bucket(u64::MAX), SHAPE_BUCKETS - 1);
        assert_eq!(align_bucket(0), SHAPE_BUCKETS - 1);
        assert_eq!(align_bucket(512), 9);
        assert_eq!(align_bucket(4096 + 512), 9);
        assert_eq!(align_bucket(3), 0);
        assert_eq!(align_bucket(1 << 40), SHAPE_BUCKETS - 1);
    }

    #[test]
    fn latency_buckets_are_log2_microseconds_and_saturate() {
        let us = Duration::from_micros;
        assert_eq!(latency_bucket(Duration::ZERO), 0);
        assert_eq!(latency_bucket(Duration::from_nanos(300)), 0);
        assert_eq!(latency_bucket(us(1)), 0);
        // Just past a bound goes to the next bucket.
        assert_eq!(latency_bucket(Duration::from_nanos(1001)), 1);
        assert_eq!(latency_bucket(us(2)), 1);
        assert_eq!(latency_bucket(us(3)), 2);
        assert_eq!(latency_bucket(us(1024)), 10);
        assert_eq!(latency_bucket(us(1025)), 11);
        assert_eq!(latency_bucket(us(1 << 24)), 24);
        assert_eq!(latency_bucket(us((1 << 24) + 1)), LATENCY_BUCKETS - 1);
        assert_eq!(latency_bucket(Duration::MAX), LATENCY_BUCKETS - 1);
        // Every latency lies within its bucket's bound.
        for ns in [
            0u64,
            1,
            999,
            1000,
            1001,
            65_536_000,
            65_536_001,
            16_777_216_000,
        ] {
            let k = latency_bucket(Duration::from_nanos(ns));
            let bound = latency_bucket_bound_us(k).expect("bounded");
            assert!(ns <= bound * 1000, "{ns} ns in bucket {k}");
            if k > 0 {
                assert!(ns > (bound / 2) * 1000, "{ns} ns in bucket {k}");
            }
        }
        assert_eq!(latency_bucket_bound_us(0), Some(1));
        assert_eq!(latency_bucket_bound_us(24), Some(1 << 24));
        assert_eq!(latency_bucket_bound_us(LATENCY_BUCKETS - 1), None);
    }

    #[test]
    fn latency_counter_counts_and_sums() {
        let c = LatencyCounter::default();
        c.record(Duration::from_micros(3));
        c.record(Duration::from_micros(3));
        c.record(Duration::from_secs(60));
        let h = c.get();
        assert_eq!(h.count(), 3);
        assert_eq!(h.buckets[2], 2);
        assert_eq!(h.buckets[LATENCY_BUCKETS - 1], 1);
        assert_eq!(h.sum_ns, 60_000_006_000);
        let mut s = Stats::default();
        let o = Stats {
            latency: Latency {
                write: h,
                ..Latency::default()
            },
            in_flight: 2,
            ..Stats::default()
        };
        s.add(&o);
        s.add(&o);
        assert_eq!(s.latency.write.count(), 6);
        assert_eq!(s.latency.write.sum_ns, 2 * h.sum_ns);
        assert_eq!(s.latency.read.count(), 0);
        assert_eq!(s.in_flight, 4);
    }

    #[test]
    fn partial_sector_requests_count_their_whole_sectors() {
        let c = ShapeCounter::default();
        c.record(0, 8192, 4096); // whole
        c.record(512, 4096, 4096); // straddles two sectors
        c.record(4096 + 100, 10, 4096); // inside one
        c.record(u64::MAX - 10, 20, 4096); // past the end: no overflow
        let d = c.get();
        assert_eq!(d.requests(), 4);
        assert_eq!(d.partial_sector, 3);
        assert_eq!(d.sizes[13] + d.sizes[12] + d.sizes[4] + d.sizes[5], 4);
        assert_eq!(d.bytes, 8192 + 4096 + 10 + 20);
        assert!(d.sector_bytes >= 8192 + 8192 + 4096);
        assert!(d.amplification() > 1.0);
        assert_eq!(DirShape::default().amplification(), 1.0);
    }
}
