//! Per-command request and byte counts of a server.
//!
//! Owns: counters bumped as requests complete, and their snapshot. Must
//! never: block or take a lock on the I/O path.

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
        }
    }
}
