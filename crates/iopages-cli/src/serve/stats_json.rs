//! `iopages serve --stats-json FILE`: the statistics as JSON, written
//! whole each time.
//!
//! Owns: the JSON document (the totals of the statistics line, the I/O
//! shape histograms, each export's own figures) and replacing the file
//! atomically (a new private file beside it, renamed over it).
//! Must never: leave a half-written file where the path points, follow a
//! link or overwrite a file it did not create, or stop the server when
//! the file cannot be written after the first time (a warning instead).

use crate::sys;
use iopages_nbd::Server;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The statistics as JSON (what --stats-json writes).
fn stats_json(s: &iopages_nbd::Stats, elapsed: Duration) -> serde_json::Value {
    use serde_json::json;
    let cmd = |c: &iopages_nbd::CommandStats| json!({"requests": c.requests, "bytes": c.bytes, "errors": c.errors});
    let dir = |d: &iopages_nbd::DirShape| {
        json!({
            "requests": d.requests(),
            "sizes_log2": d.sizes.to_vec(),
            "align_log2": d.align.to_vec(),
            "partial_sector": d.partial_sector,
            "bytes": d.bytes,
            "whole_sector_bytes": d.sector_bytes,
            "amplification": d.amplification(),
        })
    };
    json!({
        "elapsed_s": elapsed.as_secs_f64(),
        "connections": s.connections,
        "sessions": s.sessions,
        "tls_sessions": s.tls_sessions,
        "tls_failures": s.tls_failures,
        "reply_writes": s.reply_writes,
        "read": cmd(&s.read),
        "write": cmd(&s.write),
        "flush": cmd(&s.flush),
        "trim": cmd(&s.trim),
        "write_zeroes": cmd(&s.write_zeroes),
        "block_status": cmd(&s.block_status),
        "other": cmd(&s.other),
        "open_connections": s.open_connections,
        "refused_connections": s.refused_connections,
        "timeouts": {
            "handshake": s.handshake_timeouts,
            "reply": s.reply_timeouts,
            "payload": s.payload_timeouts,
            "idle": s.idle_closes,
        },
        "budget": {
            "used_bytes": s.budget_used_bytes,
            "waits": s.budget_waits,
            "refusals": s.budget_refusals,
        },
        "peers": {
            "handshakes_open": s.peers.handshakes_open,
            "handshake_evictions": s.peers.handshake_evictions,
            "share_evictions": s.peers.share_evictions,
            "authorization_refusals": s.peers.authorization_refusals,
            "active": s.peers.active,
            "at_share": s.peers.at_share,
            "budget_share_waits": s.peers.budget_share_waits,
        },
        "shape": {
            "sector_bytes": s.shape.sector_bytes,
            "buckets": "index k counts 2^k bytes: sizes in (2^(k-1), 2^k], offsets whose largest power-of-two divisor is 2^k (offset 0 in the last); the last bucket also takes everything larger",
            "read": dir(&s.shape.read),
            "write": dir(&s.shape.write),
        },
    })
}

/// Each export's own figures, by name (what --stats-json adds to the
/// totals).
fn exports_json(server: &Server) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for name in server.export_names() {
        let s = server.export_stats(name).unwrap_or_default();
        let state = match server.export_state(name) {
            Some(iopages_nbd::ExportState::Open) => "open",
            Some(iopages_nbd::ExportState::Failed) => "failed",
            _ => "closed",
        };
        m.insert(
            name.to_string(),
            serde_json::json!({
                "state": state,
                "open_failures": s.export.open_failures,
                "rate_waits": s.export.rate_waits,
                "read": {"requests": s.read.requests, "bytes": s.read.bytes},
                "write": {"requests": s.write.requests, "bytes": s.write.bytes},
            }),
        );
    }
    serde_json::Value::Object(m)
}

/// Replace `path` with `v` whole, so a reader never sees half a file:
/// written to a new file beside it under a random name (created with
/// `O_EXCL | O_NOFOLLOW`, owner-only, so nobody's link or file there is
/// followed or overwritten), then renamed over it.
fn write_stats_json(path: &Path, v: &serde_json::Value) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut nonce = [0u8; 8];
    sys::fill_random(&mut nonce)?;
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{:016x}.tmp", u64::from_ne_bytes(nonce)));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    let text = serde_json::to_string_pretty(v).expect("JSON values serialize") + "\n";
    let r = f
        .write_all(text.as_bytes())
        .and_then(|_| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// The `--stats-json` file of a running server: each snapshot written
/// whole; only the first failure to write it is reported.
pub(super) struct StatsJson {
    path: Option<PathBuf>,
    start: Instant,
    failed: bool,
}

impl StatsJson {
    /// Snapshots to `path` (none without `--stats-json`), timed from
    /// `start`.
    pub(super) fn new(path: Option<PathBuf>, start: Instant) -> StatsJson {
        StatsJson {
            path,
            start,
            failed: false,
        }
    }

    /// Write the server's statistics now (the totals and each export's).
    ///
    /// **Returns:** the error naming the file, the first time writing it
    /// fails; later failures are not reported again.
    pub(super) fn emit(&mut self, server: &Server) -> Result<(), String> {
        let Some(p) = &self.path else {
            return Ok(());
        };
        let mut v = stats_json(&server.stats(), self.start.elapsed());
        v["exports"] = exports_json(server);
        let r = write_stats_json(p, &v);
        match r {
            Err(e) if !self.failed => {
                self.failed = true;
                Err(format!("cannot write --stats-json {}: {e}", p.display()))
            }
            _ => Ok(()),
        }
    }
}
