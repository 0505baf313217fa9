//! Per-command request and byte counts of a server, and the shape of the
//! I/O its clients send.
//!
//! Owns: counters bumped as requests complete, histograms of request
//! sizes and offset alignment bumped as requests arrive (the `blkalgn`
//! view of a workload: whether a client's I/O fits the volume's sectors),
//! and their snapshot. Must never: block or take a lock on the I/O path.

use std::sync::atomic::{AtomicU64, Ordering};

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
    pub buffers: crate::BufferStats,
    /// Connections open now (handshake or transmission).
    pub open_connections: u64,
    /// Connections closed at once because `max_connections` were open.
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
    /// Connections closed because a payload did not arrive in time.
    pub payload_timeouts: u64,
    /// Connections closed after the idle timeout.
    pub idle_closes: u64,
    /// Requests that waited for the server's byte budget.
    pub budget_waits: u64,
    /// Requests answered ENOMEM: the budget stayed exhausted.
    pub budget_refusals: u64,
    /// Payload bytes in flight now, over all connections.
    pub budget_used_bytes: u64,
    /// The shape of the reads and writes clients sent.
    pub shape: IoShape,
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
    pub(crate) refused: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) tls_sessions: AtomicU64,
    pub(crate) tls_failures: AtomicU64,
    pub(crate) reply_timeouts: AtomicU64,
    pub(crate) payload_timeouts: AtomicU64,
    pub(crate) idle_closes: AtomicU64,
    pub(crate) budget_waits: AtomicU64,
    pub(crate) budget_refusals: AtomicU64,
    pub(crate) read_shape: ShapeCounter,
    pub(crate) write_shape: ShapeCounter,
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
            buffers: crate::BufferStats::default(),
            open_connections: self.open.load(Ordering::Relaxed),
            refused_connections: self.refused.load(Ordering::Relaxed),
            handshake_timeouts: self.handshake_timeouts.load(Ordering::Relaxed),
            tls_sessions: self.tls_sessions.load(Ordering::Relaxed),
            tls_failures: self.tls_failures.load(Ordering::Relaxed),
            reply_timeouts: self.reply_timeouts.load(Ordering::Relaxed),
            payload_timeouts: self.payload_timeouts.load(Ordering::Relaxed),
            idle_closes: self.idle_closes.load(Ordering::Relaxed),
            budget_waits: self.budget_waits.load(Ordering::Relaxed),
            budget_refusals: self.budget_refusals.load(Ordering::Relaxed),
            budget_used_bytes: 0,
            shape: IoShape {
                sector_bytes: 0,
                read: self.read_shape.get(),
                write: self.write_shape.get(),
            },
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
