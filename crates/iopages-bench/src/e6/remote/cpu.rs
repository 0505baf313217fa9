//! Where the CPU of each remote load goes: the client (fio or nbdcopy),
//! the store and the server in front of it, per request and per GiB, and
//! the bound that puts on a server's ratio to the raw store when every
//! process shares the same few cores.
//!
//! Owns: [`Meter`] (the CPU seconds of the three processes across one
//! load: the client's from this process's own children's times in
//! `/proc/self/stat` — it is a child this process waits for — the store's and the server's from
//! `/proc/PID/stat`), [`CpuUse`] and the bound. Must never: count a
//! process it could not read as zero (its figure is `None`).
//!
//! The bound: a load that keeps every core busy moves at most
//! `cores / (CPU seconds per unit)`; raw and a server in front of it then
//! compare at most as `cpu_raw / cpu_ours` per unit (a request for the
//! random load, a GiB otherwise). A measured ratio under it means the
//! server spends more CPU per unit than the raw path does; a ratio at it
//! is as far as that CPU cost allows on this machine.

use super::super::load::{Load, Sample};
use super::super::tenants::{clock_ticks, parse_stat_child_ticks, parse_stat_ticks};
use crate::round2;
use serde::Serialize;
use std::time::Instant;

/// The CPU seconds one load cost, by process, and what it moved.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct CpuUse {
    pub client_s: f64,
    pub store_s: Option<f64>,
    /// The server in front of the store (none for the raw store).
    pub server_s: Option<f64>,
    /// The load's wall time (the bench's clock around the client).
    pub wall_s: f64,
    /// Requests done (fio's loads).
    pub requests: Option<f64>,
    pub gib: f64,
}

impl CpuUse {
    /// All processes' CPU seconds (`None` when one could not be read).
    pub fn total_s(&self, has_server: bool) -> Option<f64> {
        let server = if has_server { self.server_s? } else { 0.0 };
        Some(self.client_s + self.store_s? + server)
    }

    /// The unit the bound is taken per: requests for the random load,
    /// GiB otherwise.
    pub fn units(&self, load: Load) -> Option<f64> {
        match load {
            Load::RandRw => self.requests,
            _ => Some(self.gib),
        }
        .filter(|&u| u > 0.0)
    }
}

/// CPU seconds of this process's children it has waited for.
fn children_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    parse_stat_child_ticks(&stat).map_or(0.0, |t| t as f64 / clock_ticks())
}

/// CPU seconds of the process `pid` so far.
fn pid_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ticks(&stat).map(|t| t as f64 / clock_ticks())
}

/// The CPU counters at a load's start.
pub(crate) struct Meter {
    store: Option<u32>,
    server: Option<u32>,
    at: (f64, Option<f64>, Option<f64>),
    t: Instant,
}

impl Meter {
    /// Start metering the store `store` and the server `server`.
    pub fn start(store: Option<u32>, server: Option<u32>) -> Meter {
        Meter {
            store,
            server,
            at: (children_s(), store.and_then(pid_s), server.and_then(pid_s)),
            t: Instant::now(),
        }
    }

    /// What the load that gave `sample` cost; `fio_s` is a fio load's run
    /// time (its requests are its IOPS over it), `bytes` what an nbdcopy
    /// load moved.
    pub fn finish(self, load: Load, sample: &Sample, fio_s: f64, bytes: u64) -> CpuUse {
        let wall_s = self.t.elapsed().as_secs_f64();
        let delta = |now: Option<f64>, then: Option<f64>| Some(round2(now? - then?));
        let (requests, gib) = match sample.iops {
            Some(iops) if load != Load::CopyRead && load != Load::CopyWrite => {
                (Some(iops * fio_s), sample.mib_s * fio_s / 1024.0)
            }
            _ => (None, bytes as f64 / (1u64 << 30) as f64),
        };
        CpuUse {
            client_s: round2(children_s() - self.at.0),
            store_s: delta(self.store.and_then(pid_s), self.at.1),
            server_s: delta(self.server.and_then(pid_s), self.at.2),
            wall_s: round2(wall_s),
            requests,
            gib,
        }
    }
}

/// The bound on `ours / raw` for `load` from their CPU per unit.
pub fn bound(load: Load, raw: &CpuUse, ours: &CpuUse) -> Option<f64> {
    let per = |c: &CpuUse, server: bool| Some(c.total_s(server)? / c.units(load)?);
    let (r, o) = (per(raw, false)?, per(ours, true)?);
    (o > 0.0).then(|| r / o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_raw_cpu_over_ours_per_unit() {
        let raw = CpuUse {
            client_s: 2.0,
            store_s: Some(2.0),
            server_s: None,
            wall_s: 5.0,
            requests: Some(1000.0),
            gib: 1.0,
        };
        let ours = CpuUse {
            server_s: Some(4.0),
            requests: Some(1000.0),
            ..raw
        };
        assert_eq!(bound(Load::RandRw, &raw, &ours), Some(0.5));
        assert_eq!(bound(Load::SeqRead, &raw, &ours), Some(0.5));
        let unread = CpuUse {
            store_s: None,
            ..ours
        };
        assert_eq!(bound(Load::RandRw, &raw, &unread), None);
    }
}
