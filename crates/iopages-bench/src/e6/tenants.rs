//! E6 tenants: one `iopages serve` on TCP loopback shared by a polite
//! client (fio's nbd engine from 127.0.0.1) and 8 hostile peers (from
//! 127.0.0.2–9), issue 28's targets side by side in one run.
//!
//! Owns: the image (a LUKS1 volume whose first part the polite client
//! uses and whose last 4 GiB the floods zero), the three scenarios each
//! run visits in turn on a fresh server — alone; beside hostile *holds*
//! (silent sockets and connections with two unread 32 MiB READs each);
//! beside WRITE_ZEROES *floods* of 4 GiB — the polite client's E6 loads and
//! its 4 KiB read latency in each, the per-run ratios and their medians,
//! the verdicts, the table and the `nbd-tenants` report (with the server's
//! own counters of each cell). Must never: assert a timing (the verdicts
//! are reported, never enforced); count a polite load that failed beside
//! hostiles as anything but a throughput of 0 (and a latency ratio of ∞),
//! with its error reported; measure on when the server died or the polite
//! client fails alone (the run ends in an error after the report); leave
//! a child process, hostile thread or temporary file behind.
//!
//! Why a fresh server per cell: what the hostiles leave behind (a budget
//! still held, a flood still being written) must not land on the next
//! cell's figures; the page cache keeps the image warm across servers.
//!
//! The ratios: in each run `r`, hold_r / alone_r and flood_r / (alone_r ÷
//! active peers) per load, and p99_hold_r / p99_alone_r; the figure
//! reported is the median of the runs' ratios.

use super::common::{os, workload, MIB};
use super::files::{fill_file, luks_format, sync_file, work_dirs, Files, LUKS_HEADER_BYTES};
use super::fio::{parse_fio, Plan};
use super::load::Load;
use super::server::{command_line, OUR_EXPORT, START_TIMEOUT};
use super::tools::Tools;
use crate::harness::{Machine, Report, Table};
use crate::measure::median;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages_tools::hostile::{self, Flood, NbdClient, Silent};
use iopages_tools::{find_tool, run_tool, signal, stop, tail_lines};
use serde::Serialize;
use serde_json::{json, Value};
use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The report's stem (`nbd-tenants.json`).
pub const STEM: &str = "nbd-tenants";
/// Hostile peers, one per source address 127.0.0.2 ..= 127.0.0.9.
pub const HOSTILE_PEERS: u8 = 8;
/// Target: beside holds, each load keeps at least this fraction of its
/// throughput alone.
pub const HOLD_TARGET: f64 = 0.8;
/// Target: beside holds, the p99 of 4 KiB reads at most this many times
/// its p99 alone.
pub const P99_TARGET: f64 = 10.0;
/// Target: beside floods, each load gets at least this fraction of its
/// fair share (alone ÷ active peers).
pub const FAIR_TARGET: f64 = 0.8;
/// What the export has beyond the polite client's region: room for a
/// WRITE_ZEROES of 4 GiB less a page (the largest a request can name).
/// The export is the region (1 GiB, 128 MiB with `--quick`) plus this,
/// the region written with data, the rest a hole until a flood writes it
/// (the floods zero from offset 0, over the region too). Not a multiple
/// of 4 GiB on purpose: iopages-tools' `hostile::unread_reads` sizes its READs
/// from the export's size cast to 32 bits, which is 0 for one of 4 GiB.
pub const FLOOD_BYTES: u64 = 4 << 30;

/// The export's size for a polite region of `region` bytes.
pub fn export_bytes(region: u64) -> u64 {
    assert!(region >= 32 * MIB, "room for the unread 32 MiB READs");
    region + FLOOD_BYTES
}
/// How long a server has to stop (SIGTERM) before SIGKILL: a server that
/// finishes 4 GiB floods first would take minutes.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the hostiles settle before the polite loads start (their
/// READs read and encrypted, their sockets accepted).
const SETTLE: Duration = Duration::from_millis(500);

/// What the polite client shares the server with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// No one else.
    Alone,
    /// Silent sockets and unread 32 MiB READs from every hostile peer.
    Hold,
    /// WRITE_ZEROES floods of 4 GiB from every hostile peer.
    Flood,
}

impl Scenario {
    /// Every scenario, in the order one run visits them.
    pub const ALL: [Scenario; 3] = [Scenario::Alone, Scenario::Hold, Scenario::Flood];

    /// The report's key.
    pub fn key(self) -> &'static str {
        match self {
            Scenario::Alone => "alone",
            Scenario::Hold => "hold",
            Scenario::Flood => "flood",
        }
    }

    /// The table's words.
    pub fn label(self) -> &'static str {
        match self {
            Scenario::Alone => "alone",
            Scenario::Hold => "8 peers: silent + unread READs",
            Scenario::Flood => "8 peers: WRITE_ZEROES floods",
        }
    }
}

/// The polite client's measurements: E6's three fio loads and a 4 KiB
/// read latency probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// One of E6's fio loads (a throughput).
    Load(Load),
    /// 4 KiB random reads, one in flight: the p99 completion latency.
    ReadP99,
}

impl Probe {
    /// Every probe, in the order a cell runs them.
    pub const ALL: [Probe; 4] = [
        Probe::Load(Load::SeqWrite),
        Probe::Load(Load::SeqRead),
        Probe::Load(Load::RandRw),
        Probe::ReadP99,
    ];

    /// The report's key.
    pub fn key(self) -> &'static str {
        match self {
            Probe::Load(l) => l.key(),
            Probe::ReadP99 => "read_4k_p99",
        }
    }

    /// The table's words.
    pub fn label(self) -> &'static str {
        match self {
            Probe::Load(l) => l.label(),
            Probe::ReadP99 => "fio randread 4K qd1 p99",
        }
    }

    /// The figure's unit.
    pub fn unit(self) -> &'static str {
        match self {
            Probe::Load(l) => l.unit(),
            Probe::ReadP99 => "us",
        }
    }

    /// Whether the figure is a latency (lower is better).
    pub fn is_latency(self) -> bool {
        self == Probe::ReadP99
    }
}

/// One probe's figure in one cell, or why the polite client got none.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figure {
    /// MiB/s, IOPS or µs (see `Probe::unit`); `None` when it failed.
    pub value: Option<f64>,
    /// fio's error, when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The p99 completion latency of fio's reads, in µs, from its JSON
/// report (`jobs[].read.clat_ns.percentile["99.000000"]`, the largest
/// over jobs).
///
/// **Returns:** `None` without a JSON report or a read p99 in it.
pub fn parse_read_p99_us(stdout: &str) -> Option<f64> {
    let start = stdout
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| stdout.starts_with('{').then_some(0))?;
    let v: Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<Value>()
        .next()?
        .ok()?;
    v["jobs"]
        .as_array()?
        .iter()
        .filter_map(|j| j["read"]["clat_ns"]["percentile"]["99.000000"].as_f64())
        .reduce(f64::max)
        .map(|ns| ns / 1000.0)
}

/// The address `iopages serve` says it serves `export` on: its line
/// `serving nbd://ADDR/EXPORT`.
pub fn parse_serving(stdout: &str, export: &str) -> Option<SocketAddr> {
    let tail = format!("/{export}");
    stdout.lines().find_map(|l| {
        l.trim()
            .strip_prefix("serving nbd://")?
            .strip_suffix(tail.as_str())?
            .parse()
            .ok()
    })
}

/// The ratios of one scenario and probe against alone, run by run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ratio {
    /// Each run's ratio; `None` (JSON null) for ∞ (a latency probe that
    /// failed beside the hostiles).
    pub runs: Vec<Option<f64>>,
    /// The median of the runs' ratios; `None` for ∞.
    pub median: Option<f64>,
    /// The target (at least it for a throughput, at most it for a
    /// latency), where this ratio has one.
    pub target: Option<f64>,
    /// Whether the median meets the target.
    pub met: Option<bool>,
}

/// Per run, `other_r / (alone_r / divisor)` (a throughput's ratio to its
/// share; `divisor` 1 for the ratio to alone) or, for a latency,
/// `other_r / alone_r`; then the median and the verdict against
/// `target` (at least it for a throughput, at most it for a latency).
///
/// A figure missing beside the hostiles (the polite client failed) is a
/// throughput of 0 and a latency of ∞; a run with no figure alone has no
/// ratio (it is left out). **Returns:** `None` if no run has a ratio.
pub fn ratio(
    alone: &[Option<f64>],
    other: &[Option<f64>],
    divisor: f64,
    latency: bool,
    target: Option<f64>,
) -> Option<Ratio> {
    assert!(divisor >= 1.0, "a share divides among at least one peer");
    assert!(!latency || divisor == 1.0, "a latency has no share");
    let per_run: Vec<f64> = alone
        .iter()
        .zip(other)
        .filter_map(|(a, o)| {
            let a = a.filter(|a| *a > 0.0)?;
            Some(match (latency, o) {
                (true, Some(o)) => o / a,
                (true, None) => f64::INFINITY,
                (false, o) => o.unwrap_or(0.0) / (a / divisor),
            })
        })
        .collect();
    if per_run.is_empty() {
        return None;
    }
    let m = median(&per_run);
    let finite = |x: f64| x.is_finite().then(|| round2(x));
    Some(Ratio {
        runs: per_run.iter().map(|&x| finite(x)).collect(),
        median: finite(m),
        target,
        met: target.map(|t| if latency { m <= t } else { m >= t }),
    })
}

/// The busy and total jiffies of all CPUs, from /proc/stat's `cpu` line
/// (busy: everything but idle and iowait).
pub fn parse_proc_stat(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest is in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v[4];
    Some((total - idle, total))
}

/// The 1-minute load average (/proc/loadavg's first field).
pub fn parse_loadavg(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse().ok()
}

/// The machine's load around one cell: the load average as it began and
/// the share of all CPUs busy during it (this bench's own processes
/// included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LoadAround {
    /// 1-minute load average when the cell began.
    pub loadavg_1m: Option<f64>,
    /// Busy share of all CPUs over the cell, percent.
    pub cpu_busy_pct: Option<f64>,
}

/// Measures [`LoadAround`] from now until [`LoadMeter::done`].
struct LoadMeter {
    loadavg_1m: Option<f64>,
    stat: Option<(u64, u64)>,
}

impl LoadMeter {
    /// Begin: read the load average and /proc/stat.
    fn start() -> LoadMeter {
        let read = |p| std::fs::read_to_string(p).unwrap_or_default();
        LoadMeter {
            loadavg_1m: parse_loadavg(&read("/proc/loadavg")),
            stat: parse_proc_stat(&read("/proc/stat")),
        }
    }

    /// End: the busy share since the start.
    fn done(self) -> LoadAround {
        let now = parse_proc_stat(&std::fs::read_to_string("/proc/stat").unwrap_or_default());
        let cpu_busy_pct = match (self.stat, now) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
                Some(round2(100.0 * (b1 - b0) as f64 / (t1 - t0) as f64))
            }
            _ => None,
        };
        LoadAround {
            loadavg_1m: self.loadavg_1m,
            cpu_busy_pct,
        }
    }
}

/// `iopages serve` on 127.0.0.1, an ephemeral port: SIGTERM (then
/// SIGKILL) and reaped when dropped.
struct Served {
    child: Option<Child>,
    addr: SocketAddr,
    out_log: PathBuf,
    err_log: PathBuf,
    stats: PathBuf,
    command: String,
}

impl Served {
    /// Start the server of one cell (`tag` names its logs and statistics
    /// file) and wait for its `serving` line.
    fn start(iopages_bin: &Path, f: &Files, tag: &str) -> Result<Served, String> {
        let (out_log, err_log) = crate::e6::server::logs_in(&f.work, tag);
        let stats = f.work.join(format!("{tag}-stats.json"));
        let mut cmd = Command::new(iopages_bin);
        cmd.arg("serve")
            .arg("--image")
            .arg(&f.image)
            .arg("--passphrase-file")
            .arg(&f.pass)
            .args(["--listen", "127.0.0.1:0", "--name", OUR_EXPORT])
            // The server's default I/O (O_DIRECT where the file system
            // takes it). Through the page cache (--io buffered) a flood's
            // ciphertext drives the kernel into dirty-page throttling,
            // which pauses every writer of the image, the polite client's
            // too, outside the server's shares (docs/experiments.md).
            .args(["--io", io_mode(), "--stats-json"])
            .arg(&stats);
        let command = command_line(&cmd);
        let child = crate::e6::server::spawn_logged(&mut cmd, &f.work, &out_log, &err_log)
            .map_err(|e| format!("cannot start iopages serve ({command}): {e}"))?;
        let mut s = Served {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            out_log,
            err_log,
            stats,
            command,
        };
        s.addr = s.wait_serving()?;
        Ok(s)
    }

    /// Poll the stdout log for the `serving` line.
    fn wait_serving(&mut self) -> Result<SocketAddr, String> {
        let t = Instant::now();
        loop {
            self.alive()?;
            let out = std::fs::read_to_string(&self.out_log).unwrap_or_default();
            if let Some(a) = parse_serving(&out, OUR_EXPORT) {
                return Ok(a);
            }
            if t.elapsed() > START_TIMEOUT {
                let why = format!(
                    "iopages serve did not say where it serves within {} s; stderr: {} (command: {})",
                    START_TIMEOUT.as_secs(),
                    tail_lines(&std::fs::read_to_string(&self.err_log).unwrap_or_default()),
                    self.command
                );
                self.stop();
                return Err(why);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Err (with its stderr's tail) if the server has exited.
    fn alive(&mut self) -> Result<(), String> {
        let child = self.child.as_mut().expect("running until stopped");
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(s)) => Err(format!(
                "iopages serve exited ({s}); stderr: {}",
                tail_lines(&std::fs::read_to_string(&self.err_log).unwrap_or_default())
            )),
            Err(e) => Err(format!("cannot wait for iopages serve: {e}")),
        }
    }

    /// SIGTERM, up to [`STOP_TIMEOUT`], then SIGKILL; how it ended.
    fn stop(&mut self) -> String {
        match self.child.take() {
            Some(mut c) => stop(&mut c, STOP_TIMEOUT),
            None => "not running".into(),
        }
    }

    /// The server's counters now: SIGUSR1 makes it write a fresh
    /// `--stats-json` snapshot, waited for (up to 3 s; its `elapsed_s`
    /// changes), before the hostiles leave and the server stops (a server
    /// killed at the stop writes none).
    ///
    /// **Returns:** [`counters_of`] the snapshot, with `"fresh": false`
    /// when none newer came; null when there is none.
    fn snapshot(&mut self) -> Value {
        let read = |p: &Path| -> Value {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok())
                .unwrap_or(Value::Null)
        };
        let before = read(&self.stats)["elapsed_s"].as_f64();
        if let Some(c) = &self.child {
            signal(c, libc::SIGUSR1);
        }
        let t = Instant::now();
        loop {
            let v = read(&self.stats);
            let fresh = v["elapsed_s"].as_f64().is_some_and(|e| Some(e) != before);
            if fresh || t.elapsed() > Duration::from_secs(3) {
                let mut c = counters_of(&v);
                if let Some(o) = c.as_object_mut() {
                    o.insert("fresh".into(), fresh.into());
                    let pid = self.child.as_ref().map_or(0, |c| c.id());
                    o.insert("process".into(), json!(proc_usage(pid)));
                }
                return c;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The counters of a `--stats-json` snapshot this report keeps: the
/// connections, refusals, timeouts, budget, WRITE_ZEROES and READ totals,
/// and the fair-share counters (`peers`) where the server has them.
pub fn counters_of(v: &Value) -> Value {
    if v.is_null() {
        return Value::Null;
    }
    let mut out = json!({
        "connections": v["connections"],
        "sessions": v["sessions"],
        "refused_connections": v["refused_connections"],
        "timeouts": v["timeouts"],
        "budget": v["budget"],
        "read": v["read"],
        "write": v["write"],
        "write_zeroes": v["write_zeroes"],
    });
    if !v["peers"].is_null() {
        out["peers"] = v["peers"].clone();
    }
    out
}

/// What a process has used so far: CPU time, and the bytes it passed to
/// read and write system calls (/proc/PID/io's rchar and wchar: the
/// floods' encrypted zeros show there as the server's writes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ProcUsage {
    /// User + system CPU seconds.
    pub cpu_s: Option<f64>,
    /// Bytes read through read-like system calls.
    pub rchar: Option<u64>,
    /// Bytes written through write-like system calls.
    pub wchar: Option<u64>,
}

/// /proc/PID/stat's user and system CPU ticks (fields 14 and 15, counted
/// after the command name's closing parenthesis).
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// /proc/PID/stat's CPU ticks of the children the process has waited
/// for (fields 16 and 17, cutime and cstime).
pub fn parse_stat_child_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
}

/// The kernel's clock ticks per second (the unit of /proc's CPU times).
pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant of the system, no memory of ours.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// A `key: value` line of /proc/PID/io.
pub fn parse_io_field(io: &str, key: &str) -> Option<u64> {
    io.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

/// [`ProcUsage`] of `pid` (all `None` when /proc cannot tell).
fn proc_usage(pid: u32) -> ProcUsage {
    let read = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}")).unwrap_or_default();
    let hz = clock_ticks();
    let io = read("io");
    ProcUsage {
        cpu_s: parse_stat_ticks(&read("stat")).map(|t| round2(t as f64 / hz)),
        rchar: parse_io_field(&io, "rchar"),
        wchar: parse_io_field(&io, "wchar"),
    }
}

/// The settings of one run.
struct Setup<'a> {
    iopages_bin: &'a Path,
    fio_bin: PathBuf,
    files: Files,
    /// The polite client's region (the export's first bytes) and each fio
    /// load's time.
    plan: Plan,
    hostile: HostilePlan,
}

/// How hard the hostile peers push, per peer (each from its own address).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct HostilePlan {
    /// Peers, from 127.0.0.2 on.
    pub peers: u8,
    /// Hold: sockets that connect and never send, re-opened when closed.
    pub silent_per_peer: usize,
    /// Hold: connections that each send `unread_reads` READs of 32 MiB and
    /// never read a reply.
    pub greedy_conns_per_peer: usize,
    /// Hold: READs per greedy connection.
    pub unread_reads: usize,
    /// Flood: connections each keeping `flood_depth` WRITE_ZEROES of 4 GiB
    /// (less a page) in flight.
    pub flood_conns_per_peer: usize,
    /// Flood: WRITE_ZEROES in flight per connection.
    pub flood_depth: usize,
}

impl HostilePlan {
    /// The plan of every run: 16 silent sockets a peer (128 in all, twice
    /// the default `--max-connections`), 2 connections with 2 unread
    /// 32 MiB READs a peer (1 GiB in all, four times the default
    /// `--max-inflight`), 1 connection with 4 floods a peer.
    pub const DEFAULT: HostilePlan = HostilePlan {
        peers: HOSTILE_PEERS,
        silent_per_peer: 16,
        greedy_conns_per_peer: 2,
        unread_reads: 2,
        flood_conns_per_peer: 1,
        flood_depth: 4,
    };

    /// Peer `i`'s address: 127.0.0.(2 + i).
    pub fn addr(i: u8) -> Ipv4Addr {
        assert!(i < 250, "peers live in 127.0.0.2..=127.0.0.251");
        Ipv4Addr::new(127, 0, 0, 2 + i)
    }

    /// The peers active beside the polite client in a flood, the polite
    /// client included: its fair share is its throughput alone over this.
    pub fn active_in_flood(&self) -> u32 {
        u32::from(self.peers) + 1
    }
}

/// The hostile peers of one cell, running until dropped (their sockets
/// closed, their threads joined).
#[derive(Default)]
struct Hostiles {
    silent: Vec<Silent>,
    greedy: Vec<NbdClient>,
    floods: Vec<Flood>,
    /// Connections the server did not let the hostiles make, with why
    /// (the first few).
    refused: Vec<String>,
    refused_count: usize,
}

impl Hostiles {
    /// Start `sc`'s hostile peers against `server` (none for alone). In a
    /// hold, every peer's greedy connections first (so the unread READs
    /// are in before the silent sockets take the slots), then its silent
    /// sockets. A connection the server refuses is counted, not an error:
    /// refusing hostiles is the server's right.
    fn start(sc: Scenario, server: SocketAddr, plan: &HostilePlan) -> Hostiles {
        let mut h = Hostiles::default();
        let peers = (0..plan.peers).map(HostilePlan::addr);
        match sc {
            Scenario::Alone => {}
            Scenario::Hold => {
                for ip in peers.clone() {
                    for _ in 0..plan.greedy_conns_per_peer {
                        let r = hostile::unread_reads(1, plan.unread_reads, ip, server, OUR_EXPORT)
                            .map(|v| h.greedy.extend(v));
                        h.note(ip, "unread READs", r);
                    }
                }
                for ip in peers {
                    let r = hostile::silent(plan.silent_per_peer, ip, server, true)
                        .map(|s| h.silent.push(s));
                    h.note(ip, "silent sockets", r);
                }
            }
            Scenario::Flood => {
                for ip in peers {
                    for _ in 0..plan.flood_conns_per_peer {
                        let r = hostile::zero_flood(plan.flood_depth, ip, server, OUR_EXPORT)
                            .map(|f| h.floods.push(f));
                        h.note(ip, "WRITE_ZEROES flood", r);
                    }
                }
            }
        }
        h
    }

    /// Count a hostile connection the server refused.
    fn note(&mut self, ip: Ipv4Addr, what: &str, r: std::io::Result<()>) {
        if let Err(e) = r {
            self.refused_count += 1;
            if self.refused.len() < 4 {
                self.refused.push(format!("{ip} {what}: {e}"));
            }
        }
    }

    /// What the hostiles saw, for the report.
    fn seen(&self) -> Value {
        let sum = |f: &dyn Fn(&Silent) -> u64| self.silent.iter().map(f).sum::<u64>();
        json!({
            "greedy_connections": self.greedy.len(),
            "silent_open": sum(&|s| s.open()),
            "silent_closed_by_server": sum(&|s| s.closed_by_server()),
            "silent_reopened": sum(&|s| s.reopened()),
            "floods": self.floods.len(),
            "floods_running": self.floods.iter().filter(|f| f.running()).count(),
            "flood_replies": self.floods.iter().map(|f| f.replies()).sum::<u64>(),
            "flood_errors": self.floods.iter().map(|f| f.errors()).sum::<u64>(),
            "refused": self.refused_count,
            "refused_first": self.refused,
        })
    }
}

/// fio's arguments for `probe` at `uri`, over the polite region
/// (`plan.dev` bytes from the export's start).
fn probe_args(plan: &Plan, uri: &str, probe: Probe) -> Vec<OsString> {
    match probe {
        Probe::Load(l) => plan.fio_args(uri, l),
        Probe::ReadP99 => [
            "--output-format=json".to_string(),
            "--eta=never".into(),
            "--thread".into(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            "--name=e6-tenants-read-4k-qd1".into(),
            format!("--size={}", plan.dev),
            "--time_based".into(),
            format!("--runtime={}ms", plan.fio_ms),
            "--rw=randread".into(),
            "--bs=4k".into(),
            "--iodepth=1".into(),
            "--numjobs=1".into(),
        ]
        .into_iter()
        .map(OsString::from)
        .collect(),
    }
}

/// The figure of `probe` in fio's JSON output `stdout` (whose jobs had
/// no error: `parse_fio` said so): MiB/s, IOPS for the random load, the
/// read p99 in µs for the latency probe.
///
/// **Returns:** Err when fio moved no data or reported no p99.
fn figure_of(probe: Probe, stdout: &str) -> Result<f64, String> {
    let v = parse_fio(stdout)?;
    let (bytes, x) = match probe {
        Probe::Load(Load::SeqWrite) => (v.write_bytes, v.write_bw / MIB as f64),
        Probe::Load(Load::SeqRead) => (v.read_bytes, v.read_bw / MIB as f64),
        Probe::Load(Load::RandRw) => (v.read_bytes.min(v.write_bytes), v.read_iops + v.write_iops),
        Probe::Load(l) => return Err(format!("{} is not a fio load", l.label())),
        Probe::ReadP99 => (
            v.read_bytes,
            parse_read_p99_us(stdout).ok_or("fio reported no read p99")?,
        ),
    };
    match bytes {
        0 => Err("fio moved no data".into()),
        _ => Ok(x),
    }
}

/// One probe of the polite client (fio from 127.0.0.1) against `addr`.
///
/// **Context:** blocks for the probe's run time (longer when the server
/// makes its requests wait; at most that plus two minutes).
///
/// **Returns:** fio's figure, or its error (exit status, a job's error,
/// no data).
fn probe_once(st: &Setup, addr: SocketAddr, probe: Probe) -> Figure {
    let uri = format!("nbd://{addr}/{OUR_EXPORT}");
    let args = probe_args(&st.plan, &uri, probe);
    let limit = Duration::from_millis(st.plan.fio_ms + 120_000);
    let r = run_tool(&st.fio_bin, &args, &st.files.work, limit, &[]).and_then(|r| {
        let x = figure_of(probe, &r.stdout);
        match (r.status.success(), x) {
            (true, Ok(x)) => Ok(x),
            (_, Err(e)) => Err(format!("{e}; fio {}; {}", r.status, tail_lines(&r.stderr))),
            (false, Ok(_)) => Err(format!("fio {}; {}", r.status, tail_lines(&r.stderr))),
        }
    });
    match r {
        Ok(x) => Figure {
            value: Some(x),
            error: None,
        },
        Err(e) => Figure {
            value: None,
            error: Some(format!("{}: {e}", probe.label())),
        },
    }
}

/// One scenario on one fresh server: its figures, what the hostiles and
/// the server counted, how the server stopped, the machine's load.
#[derive(Clone, Debug, Serialize)]
struct Cell {
    run: usize,
    figures: Vec<Figure>,
    hostiles: Value,
    server: Value,
    stop: String,
    load: LoadAround,
    secs: f64,
}

/// One cell: a fresh server, `sc`'s hostiles started and settled, every
/// probe in turn, the server's counters, then the hostiles stopped before
/// the server (SIGTERM, SIGKILL after [`STOP_TIMEOUT`]) and the image
/// synced (outside the figures).
///
/// **Returns:** the cell; Err when the server would not start or died.
fn cell(st: &Setup, sc: Scenario, run: usize) -> Result<Cell, String> {
    let meter = LoadMeter::start();
    let t = Instant::now();
    // This process's CPU: the hostile threads' (fio runs in children).
    let own_cpu = || proc_usage(std::process::id()).cpu_s.unwrap_or(0.0);
    let own0 = own_cpu();
    let tag = format!("serve-{}-{}", sc.key(), run + 1);
    let mut srv = Served::start(st.iopages_bin, &st.files, &tag)?;
    let hostiles = Hostiles::start(sc, srv.addr, &st.hostile);
    if sc != Scenario::Alone {
        std::thread::sleep(SETTLE);
    }
    let mut figures = Vec::new();
    for p in Probe::ALL {
        figures.push(probe_once(st, srv.addr, p));
        srv.alive()
            .map_err(|e| format!("{}, after {}: {e}", sc.label(), p.label()))?;
    }
    let server = srv.snapshot();
    let mut seen = hostiles.seen();
    seen["bench_process_cpu_s"] = json!(round2(own_cpu() - own0));
    drop(hostiles);
    let stop = srv.stop();
    sync_file(&st.files.image);
    Ok(Cell {
        run: run + 1,
        figures,
        hostiles: seen,
        server,
        stop,
        load: meter.done(),
        secs: round2(t.elapsed().as_secs_f64()),
    })
}

/// A cell's progress line: each probe's figure or FAILED.
fn cell_line(sc: Scenario, c: &Cell) -> String {
    let figs: Vec<String> = Probe::ALL
        .iter()
        .zip(&c.figures)
        .map(|(p, f)| match f.value {
            Some(x) => format!("{} {x:.0} {}", p.key(), p.unit()),
            None => format!("{} FAILED", p.key()),
        })
        .collect();
    format!("  {}: {} ({:.1} s)", sc.label(), figs.join(", "), c.secs)
}

/// Every run: the scenarios in order (alone, hold, flood), each on a
/// fresh server.
///
/// **Returns:** the cells `[scenario][run]`, and why the measuring
/// stopped early (a server that would not start or died), if it did.
fn run_cells(st: &Setup, runs: usize) -> (Vec<Vec<Cell>>, Option<String>) {
    let mut cells: Vec<Vec<Cell>> = Scenario::ALL.iter().map(|_| Vec::new()).collect();
    for run in 0..runs {
        for (i, &sc) in Scenario::ALL.iter().enumerate() {
            progress(STEM, format!("run {}/{runs}: {}", run + 1, sc.label()));
            match cell(st, sc, run) {
                Ok(c) => {
                    progress(STEM, cell_line(sc, &c));
                    cells[i].push(c);
                }
                Err(e) => {
                    progress(STEM, format!("  FAILED: {e}"));
                    return (cells, Some(e));
                }
            }
        }
    }
    (cells, None)
}

/// The figures of probe number `p` in scenario `sc`, run by run.
fn values(cells: &[Vec<Cell>], sc: Scenario, p: usize) -> Vec<Option<f64>> {
    let i = Scenario::ALL.iter().position(|&x| x == sc).expect("listed");
    cells[i].iter().map(|c| c.figures[p].value).collect()
}

/// A scenario's probe set against alone (or against its fair share).
#[derive(Clone, Debug, Serialize)]
struct Compared {
    scenario: &'static str,
    probe: &'static str,
    describe: &'static str,
    /// What the figure is divided by: "alone", or "fair share (alone / N)".
    against: String,
    ratio: Option<Ratio>,
}

/// Every comparison: beside holds, each load against alone (target
/// [`HOLD_TARGET`]) and the p99 against alone (at most [`P99_TARGET`]);
/// beside floods, each load against its fair share (target
/// [`FAIR_TARGET`]) and the p99 against alone (no target).
fn compare(cells: &[Vec<Cell>], plan: &HostilePlan) -> Vec<Compared> {
    let active = plan.active_in_flood();
    let mut out = Vec::new();
    for sc in [Scenario::Hold, Scenario::Flood] {
        for (i, &p) in Probe::ALL.iter().enumerate() {
            let (div, target) = match (sc, p.is_latency()) {
                (Scenario::Flood, false) => (f64::from(active), Some(FAIR_TARGET)),
                (Scenario::Flood, true) => (1.0, None),
                (_, false) => (1.0, Some(HOLD_TARGET)),
                (_, true) => (1.0, Some(P99_TARGET)),
            };
            let alone = values(cells, Scenario::Alone, i);
            let other = values(cells, sc, i);
            out.push(Compared {
                scenario: sc.key(),
                probe: p.key(),
                describe: p.label(),
                against: match div > 1.0 {
                    true => format!("fair share (alone / {active})"),
                    false => "alone".into(),
                },
                ratio: ratio(&alone, &other, div, p.is_latency(), target),
            });
        }
    }
    out
}

/// The targets' verdicts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Verdicts {
    /// Beside holds: the smallest load's ratio to alone.
    pub hold_min_ratio: Option<f64>,
    /// Whether every load keeps [`HOLD_TARGET`] of alone.
    pub hold_met: bool,
    /// Beside holds: p99 over alone's p99 (`None`: ∞ or no figure).
    pub p99_ratio: Option<f64>,
    /// Whether it is at most [`P99_TARGET`].
    pub p99_met: bool,
    /// Beside floods: the smallest load's ratio to its fair share.
    pub flood_min_ratio_to_fair_share: Option<f64>,
    /// Whether every load gets [`FAIR_TARGET`] of its fair share.
    pub flood_met: bool,
    /// All three.
    pub target_met: bool,
}

/// The verdicts of `cmp` (a comparison with no ratio is not met).
fn verdicts(cmp: &[Compared]) -> Verdicts {
    let pick = |sc: Scenario, latency: bool| -> Vec<Option<&Ratio>> {
        cmp.iter()
            .filter(|c| c.scenario == sc.key() && (c.probe == Probe::ReadP99.key()) == latency)
            .map(|c| c.ratio.as_ref())
            .collect()
    };
    let min_met = |v: Vec<Option<&Ratio>>| -> (Option<f64>, bool) {
        let all_met = !v.is_empty() && v.iter().all(|r| r.is_some_and(|r| r.met == Some(true)));
        let min = v
            .iter()
            .map(|r| r.and_then(|r| r.median))
            .collect::<Option<Vec<f64>>>()
            .and_then(|m| m.into_iter().reduce(f64::min));
        (min, all_met)
    };
    let (hold_min_ratio, hold_met) = min_met(pick(Scenario::Hold, false));
    let p99 = pick(Scenario::Hold, true);
    let p99_ratio = p99.first().copied().flatten().and_then(|r| r.median);
    let p99_met = p99
        .first()
        .copied()
        .flatten()
        .is_some_and(|r| r.met == Some(true));
    let (flood_min, flood_met) = min_met(pick(Scenario::Flood, false));
    Verdicts {
        hold_min_ratio,
        hold_met,
        p99_ratio,
        p99_met,
        flood_min_ratio_to_fair_share: flood_min,
        flood_met,
        target_met: hold_met && p99_met && flood_met,
    }
}

/// One scenario's figures for one probe.
#[derive(Clone, Debug, Serialize)]
struct Row {
    scenario: &'static str,
    probe: &'static str,
    describe: &'static str,
    unit: &'static str,
    /// The median of the runs that have a figure.
    median: Option<f64>,
    runs: Vec<Option<f64>>,
    /// Runs where the polite client failed, and the first errors.
    failed_runs: usize,
    errors: Vec<String>,
}

/// Every scenario's rows, in table order.
fn rows(cells: &[Vec<Cell>]) -> Vec<Row> {
    let mut out = Vec::new();
    for (s, &sc) in Scenario::ALL.iter().enumerate() {
        for (i, &p) in Probe::ALL.iter().enumerate() {
            let runs = values(cells, sc, i);
            let ok: Vec<f64> = runs.iter().flatten().copied().collect();
            let errors: Vec<String> = cells[s]
                .iter()
                .filter_map(|c| c.figures[i].error.clone())
                .collect();
            out.push(Row {
                scenario: sc.key(),
                probe: p.key(),
                describe: p.label(),
                unit: p.unit(),
                median: (!ok.is_empty()).then(|| round2(median(&ok))),
                runs: runs.iter().map(|x| x.map(round2)).collect(),
                failed_runs: errors.len(),
                errors: errors.into_iter().take(2).collect(),
            });
        }
    }
    out
}

/// What one report is about.
struct Run<'a> {
    st: &'a Setup<'a>,
    runs: usize,
    cells: &'a [Vec<Cell>],
    cmp: &'a [Compared],
    verdicts: Verdicts,
    machine: &'a Machine,
}

/// `x` with two decimals, or "-".
fn fmt2(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

/// The median of the cells' load averages and busy shares, for the
/// table's machine line.
fn load_line(cells: &[Vec<Cell>]) -> String {
    let all: Vec<LoadAround> = cells.iter().flatten().map(|c| c.load).collect();
    let med = |v: Vec<f64>| (!v.is_empty()).then(|| median(&v));
    let la = med(all.iter().filter_map(|l| l.loadavg_1m).collect());
    let busy = med(all.iter().filter_map(|l| l.cpu_busy_pct).collect());
    format!(
        "load average (1 min) at a cell's start {}, CPUs busy during a cell {} % (medians over cells, this bench included)",
        fmt2(la),
        busy.map_or_else(|| "-".into(), |b| format!("{b:.0}"))
    )
}

/// The table: each scenario's figures, the ratios and the verdicts.
fn table(run: &Run) -> Table {
    let mut t = Table::new(format!(
        "nbd tenants (E6 tenants): iopages serve on TCP 127.0.0.1, LUKS1 (aes-xts-plain64, 512-bit key) export of {} MiB; the polite client (fio from 127.0.0.1) over its first {} MiB; {} hostile peers from 127.0.0.2-{}; median of {} run(s)",
        export_bytes(run.st.plan.dev) / MIB,
        run.st.plan.dev / MIB,
        run.st.hostile.peers,
        1 + run.st.hostile.peers,
        run.runs
    ));
    t.line(format!(
        "CPU: {} ({} CPUs, kernel {}); {}",
        run.machine.cpu,
        run.machine.online_cpus,
        run.machine.kernel,
        load_line(run.cells)
    ));
    t.line(format!(
        "{:<31} | {:<24} | {:>9} {:<5} | {:>15} | {}",
        "scenario", "load", "median", "unit", "min-max", "ratio (median of runs) and target"
    ));
    for r in rows(run.cells) {
        let sc = Scenario::ALL
            .iter()
            .find(|s| s.key() == r.scenario)
            .expect("listed");
        let ok: Vec<f64> = r.runs.iter().flatten().copied().collect();
        let range = match ok.is_empty() {
            true => "-".to_string(),
            false => format!(
                "{:.0}-{:.0}",
                ok.iter().copied().fold(f64::INFINITY, f64::min),
                ok.iter().copied().fold(0.0, f64::max)
            ),
        };
        let failed = match r.failed_runs {
            0 => String::new(),
            n => format!(" FAILED {n}/{}", r.runs.len()),
        };
        let c = run
            .cmp
            .iter()
            .find(|c| c.scenario == r.scenario && c.probe == r.probe);
        t.line(format!(
            "{:<31} | {:<24} | {:>9} {:<5} | {:>15} | {}{failed}",
            sc.label(),
            r.describe,
            r.median.map_or_else(|| "-".into(), |x| format!("{x:.0}")),
            r.unit,
            range,
            c.map_or_else(String::new, ratio_cell)
        ));
    }
    verdict_lines(&mut t, run);
    t
}

/// "0.93 of alone (>= 0.8: met)" or "2.10x alone's (<= 10: met)" for
/// one comparison.
fn ratio_cell(c: &Compared) -> String {
    let Some(r) = &c.ratio else {
        return "- (no figure alone)".into();
    };
    let m = r.median.map_or_else(|| "inf".into(), |x| format!("{x:.2}"));
    let lat = c.probe == Probe::ReadP99.key();
    let what = match lat {
        true => format!("{m}x alone's"),
        false => format!("{m} of {}", c.against),
    };
    match (r.target, r.met) {
        (Some(t), Some(ok)) => {
            format!(
                "{what} ({} {t}: {})",
                if lat { "<=" } else { ">=" },
                met(ok)
            )
        }
        _ => format!("{what} (no target)"),
    }
}

/// What the server and the hostiles counted in one cell (the last run's
/// in the table; every cell's in the JSON).
fn cell_note(sc: Scenario, c: &Cell) -> String {
    let (srv, h) = (&c.server, &c.hostiles);
    let n = |v: &Value| v.as_u64().map_or_else(|| "-".into(), |x| x.to_string());
    let mib = |v: &Value| {
        v.as_u64()
            .map_or_else(|| "-".into(), |x| format!("{}", x / MIB))
    };
    let mut s = format!(
        "{} (run {}): server CPU {} s, write calls {} MiB (wchar: image and sockets), connections {} (refused {}){}",
        sc.key(),
        c.run,
        srv["process"]["cpu_s"]
            .as_f64()
            .map_or_else(|| "-".into(), |x| format!("{x:.1}")),
        mib(&srv["process"]["wchar"]),
        n(&srv["connections"]),
        n(&srv["refused_connections"]),
        match srv.get("peers") {
            Some(p) => format!(", peers {p}"),
            None => String::new(),
        }
    );
    let own = h["bench_process_cpu_s"].as_f64().unwrap_or(0.0);
    match sc {
        Scenario::Alone => {}
        Scenario::Hold => s += &format!(
            "; hostiles (CPU {own:.1} s): {} greedy connections, silent sockets closed by the server {} (re-opened {})",
            n(&h["greedy_connections"]),
            n(&h["silent_closed_by_server"]),
            n(&h["silent_reopened"])
        ),
        Scenario::Flood => s += &format!(
            "; hostiles (CPU {own:.1} s): {} floods ({} still running), {} replies ({} errors)",
            n(&h["floods"]),
            n(&h["floods_running"]),
            n(&h["flood_replies"]),
            n(&h["flood_errors"])
        ),
    }
    s
}

/// The verdict lines and the polite client's first errors.
fn verdict_lines(t: &mut Table, run: &Run) {
    let v = &run.verdicts;
    let active = run.st.hostile.active_in_flood();
    t.line(format!(
        "target beside silent sockets + unread READs: every load >= {HOLD_TARGET} of alone: min {} ({})",
        fmt2(v.hold_min_ratio),
        met(v.hold_met)
    ));
    t.line(format!(
        "target beside silent sockets + unread READs: p99 4 KiB read <= {P99_TARGET}x alone's: {} ({})",
        v.p99_ratio.map_or_else(|| "inf or -".into(), |x| format!("{x:.2}")),
        met(v.p99_met)
    ));
    t.line(format!(
        "target beside WRITE_ZEROES floods: every load >= {FAIR_TARGET} of its fair share (alone / {active} active peers): min {} ({})",
        fmt2(v.flood_min_ratio_to_fair_share),
        met(v.flood_met)
    ));
    for (sc, cells) in Scenario::ALL.iter().zip(run.cells) {
        if let Some(c) = cells.last() {
            t.line(cell_note(*sc, c));
        }
    }
    for r in rows(run.cells).iter().filter(|r| r.failed_runs > 0) {
        t.line(format!(
            "polite client failed ({}, {}): {}",
            r.scenario,
            r.probe,
            r.errors.first().map_or("", String::as_str)
        ));
    }
}

/// How the run was made.
fn settings(run: &Run, opts: &BenchOptions) -> Value {
    let h = &run.st.hostile;
    json!({
        "runs": run.runs,
        "quick": opts.quick,
        "export_bytes": export_bytes(run.st.plan.dev),
        "polite_region_bytes": run.st.plan.dev,
        "image": "LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000 PBKDF2 iterations; the export is the polite region (written with data before the runs) + 4 GiB (a hole until the floods write it; the floods zero from offset 0, over the polite region too)",
        "server": "iopages serve --image IMG --passphrase-file P --listen 127.0.0.1:0 --name iopages --io auto (the default; IOPAGES_TENANTS_IO=buffered for the page cache) --stats-json F: every other setting at its default (--max-connections, --max-inflight, timeouts, and the fair-share flags where the server has them); a fresh server for every cell; SIGTERM after the cell, SIGKILL 5 s later",
        "polite_client": {
            "tool": "fio, nbd engine (libnbd), nbd://127.0.0.1:PORT/iopages (source address 127.0.0.1)",
            "seconds_per_probe": run.st.plan.fio_ms as f64 / 1000.0,
            "loads": "E6's fio loads: seq write and seq read 1 MiB iodepth 16 (1 connection), randrw 4 KiB 50 % reads iodepth 32 x 2 jobs (2 connections), time based over the polite region",
            "latency": "fio randread 4 KiB, iodepth 1, 1 job: the p99 of its completion latency (clat), over the polite region",
            "failure": "a probe whose fio fails (cannot connect, a job error, no data) beside the hostiles is a throughput of 0 and a latency of infinity; its error is reported",
        },
        "hostile_peers": {
            "addresses": format!("127.0.0.2-127.0.0.{}, one peer each, threads of this bench (iopages-tools' hostile module), on the same CPUs", 1 + h.peers),
            "plan": h,
            "hold": "per peer: greedy connections first (NBD_OPT_GO, then READs of 32 MiB never read), then silent sockets (connect, never send; re-opened at once when the server closes them)",
            "flood": "per peer: connections keeping WRITE_ZEROES of 4 GiB less a page at offset 0 in flight, each reply read and the next sent at once",
            "settle_s": SETTLE.as_secs_f64(),
            "cpu": "each cell's hostiles.bench_process_cpu_s: the CPU seconds of this bench's own process during the cell, which are the hostile threads' (fio runs as child processes)",
        },
        "ratios": format!("per run: figure beside holds / alone; figure beside floods / (alone / {} active peers, the polite client included); p99 beside hostiles / p99 alone; the median of the runs' ratios", h.active_in_flood()),
        "order": "each run: alone, then holds, then floods, each on a fresh server; the image synced after each cell (outside the figures)",
        "load": "each cell records the 1-minute load average as it began and the busy share of all CPUs during it (this bench, its server and hostiles included; other users of the machine too)",
    })
}

/// The report's fields beside `settings`.
#[derive(Serialize)]
struct Body<'a> {
    rows: Vec<Row>,
    ratios: &'a [Compared],
    cells: serde_json::Map<String, Value>,
    summary: Value,
}

/// Print the table, write `nbd-tenants.json`.
///
/// **Returns:** the report.
fn report(opts: &BenchOptions, run: &Run, failed: &[String]) -> Result<Value, BenchError> {
    table(run).print();
    let v = run.verdicts;
    let cells = Scenario::ALL
        .iter()
        .zip(run.cells)
        .map(|(s, c)| (s.key().to_string(), json!(c)))
        .collect();
    let summary = json!({
        "hold_min_ratio_vs_alone": v.hold_min_ratio,
        "hold_target_min_ratio": HOLD_TARGET,
        "hold_target_met": v.hold_met,
        "hold_p99_ratio_vs_alone": v.p99_ratio,
        "hold_p99_target_max_ratio": P99_TARGET,
        "hold_p99_target_met": v.p99_met,
        "flood_active_peers": run.st.hostile.active_in_flood(),
        "flood_min_ratio_vs_fair_share": v.flood_min_ratio_to_fair_share,
        "flood_target_min_ratio": FAIR_TARGET,
        "flood_target_met": v.flood_met,
        "target_met": v.target_met,
        "failed": failed,
    });
    let body = Body {
        rows: rows(run.cells),
        ratios: run.cmp,
        cells,
        summary,
    };
    Report::new("E6 nbd tenants", settings(run, opts), body)
        .stem(STEM)
        .emit(opts, &[])
}

/// fio and cryptsetup (the other E6 tools' names stand in: nothing here
/// starts them), with fio's nbd engine checked.
fn tools(dir: &Path) -> Result<Tools, BenchError> {
    let need = |name: &str, pkg: &str, why: &str| {
        find_tool(name).ok_or_else(|| {
            workload(format!(
                "{name} is not installed ({why}); scripts/setup-debian.sh installs it (Debian package {pkg})"
            ))
        })
    };
    let t = Tools {
        cryptsetup: need("cryptsetup", "cryptsetup-bin", "it formats the LUKS1 image")?,
        fio: need("fio", "fio", "its nbd engine is the polite client")?,
        nbdcopy: PathBuf::from("nbdcopy"),
        nbdinfo: PathBuf::from("nbdinfo"),
        nbdkit: PathBuf::from("nbdkit"),
        qemu_nbd: PathBuf::from("qemu-nbd"),
    };
    let ok = run_tool(
        &t.fio,
        &os(&[&"--enghelp=nbd"]),
        dir,
        Duration::from_secs(30),
        &[],
    )
    .is_ok_and(|r| r.status.success());
    if !ok {
        return Err(workload(
            "this fio has no nbd engine (fio built with libnbd is needed); scripts/setup-debian.sh installs it",
        ));
    }
    Ok(t)
}

/// The image: `region` bytes of data after the LUKS header, then a hole
/// up to [`export_bytes`], then `cryptsetup luksFormat`.
///
/// **Returns:** the export's size (checked to be [`export_bytes`]).
fn make_image(tools: &Tools, f: &Files, region: u64) -> Result<u64, BenchError> {
    fill_file(&f.image, region + LUKS_HEADER_BYTES, 0x2545_F491_4F6C_DD1D)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.image)
        .and_then(|x| x.set_len(export_bytes(region) + LUKS_HEADER_BYTES))
        .map_err(|e| BenchError::Write {
            path: f.image.clone(),
            source: e,
        })?;
    let dev = luks_format(tools, f)?;
    if dev != export_bytes(region) {
        return Err(workload(format!(
            "the tenants' export is {dev} bytes, not {}",
            export_bytes(region)
        )));
    }
    Ok(dev)
}

/// The server's `--io` for the tenants row: `auto` (its default), or
/// what `IOPAGES_TENANTS_IO` says (`buffered`, `direct`).
fn io_mode() -> &'static str {
    match std::env::var("IOPAGES_TENANTS_IO").as_deref() {
        Ok("buffered") => "buffered",
        Ok("direct") => "direct",
        _ => "auto",
    }
}

/// E6 tenants. `iopages_bin` is the `iopages` executable whose `serve`
/// is measured. Returns the report (`nbd-tenants.json` unless `--json`
/// names one); the targets' verdicts are reported, never an error. A
/// server that would not start or died, or a polite client that failed
/// alone, is reported and then returned as an error.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (runs, region, fio_ms) = if opts.quick {
        (1usize, 128 * MIB, 1000u64)
    } else {
        (3, 1024 * MIB, 5000)
    };
    let (json_path, _) = opts.paths(STEM);
    // Declared before any server: dropped (removed) after they are stopped.
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, STEM)?;
    let tools = tools(&work)?;
    let files = Files {
        image: work.join("luks1-tenants.img"),
        pass: work.join("passphrase"),
        source: work.join("unused-source"),
        work: work.clone(),
        socks,
        tls: None,
        read_only: false,
    };
    let machine = Machine::this();
    progress(
        STEM,
        format!(
            "E6 tenants: iopages serve on TCP 127.0.0.1, a LUKS1 export of {} MiB under {}; the polite client (fio) over its first {} MiB, {} s per probe; {} hostile peers from 127.0.0.2-{}; {runs} run(s) of alone, holds, floods; CPU {} ({} CPUs)",
            export_bytes(region) / MIB,
            work.display(),
            region / MIB,
            fio_ms as f64 / 1000.0,
            HOSTILE_PEERS,
            1 + HOSTILE_PEERS,
            machine.cpu,
            machine.online_cpus
        ),
    );
    make_image(&tools, &files, region)?;
    let st = Setup {
        iopages_bin,
        fio_bin: tools.fio.clone(),
        files,
        plan: Plan {
            dev: region,
            fio_ms,
        },
        hostile: HostilePlan::DEFAULT,
    };
    let (cells, stopped) = run_cells(&st, runs);
    let failed = failures(&cells, stopped);
    let cmp = compare(&cells, &st.hostile);
    let run = Run {
        st: &st,
        runs,
        cells: &cells,
        cmp: &cmp,
        verdicts: verdicts(&cmp),
        machine: &machine,
    };
    let value = report(opts, &run, &failed)?;
    match failed.is_empty() {
        true => Ok(value),
        false => Err(workload(format!(
            "tenants failed (report written to {}): {}",
            json_path.display(),
            failed.join("; ")
        ))),
    }
}

/// What makes the run an error: the measuring stopped early, or the
/// polite client failed alone (beside hostiles a failure is a figure).
fn failures(cells: &[Vec<Cell>], stopped: Option<String>) -> Vec<String> {
    let mut out: Vec<String> = stopped.into_iter().collect();
    let alone = Scenario::ALL
        .iter()
        .position(|&s| s == Scenario::Alone)
        .expect("listed");
    for c in &cells[alone] {
        for f in c.figures.iter().filter_map(|f| f.error.as_ref()) {
            out.push(format!(
                "the polite client failed alone (run {}): {f}",
                c.run
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fio 3.33's JSON (trimmed to the fields read), after the nbd
    /// engine's line on stdout.
    const FIO_RANDREAD: &str = r#"fio: connected to NBD server
{
  "jobs" : [
    {
      "jobname" : "e6-tenants-read-4k-qd1",
      "error" : 0,
      "read" : {
        "io_bytes" : 40960000, "bw_bytes" : 40960000, "iops" : 10000.0,
        "clat_ns" : { "percentile" : { "50.000000" : 90112, "99.000000" : 250880 } }
      },
      "write" : { "io_bytes" : 0, "bw_bytes" : 0, "iops" : 0.0 }
    }
  ]
}
"#;

    #[test]
    fn the_read_p99_comes_from_fio_clat_percentiles_in_microseconds() {
        assert_eq!(parse_read_p99_us(FIO_RANDREAD), Some(250.88));
        assert_eq!(figure_of(Probe::ReadP99, FIO_RANDREAD), Ok(250.88));
        let none = FIO_RANDREAD.replace("\"99.000000\"", "\"99.500000\"");
        assert_eq!(parse_read_p99_us(&none), None);
        assert!(figure_of(Probe::ReadP99, &none).is_err());
        assert_eq!(parse_read_p99_us("fio: failed to connect\n"), None);
    }

    #[test]
    fn a_probe_that_moved_no_data_or_failed_has_no_figure() {
        let seq_read = FIO_RANDREAD.replace("e6-tenants-read-4k-qd1", "e6-seq_read");
        assert_eq!(
            figure_of(Probe::Load(Load::SeqRead), &seq_read),
            Ok(40960000.0 / MIB as f64)
        );
        let e = figure_of(Probe::Load(Load::SeqWrite), &seq_read).unwrap_err();
        assert!(e.contains("no data"), "{e}");
        let failed = FIO_RANDREAD.replace("\"error\" : 0", "\"error\" : 12");
        let e = figure_of(Probe::Load(Load::SeqRead), &failed).unwrap_err();
        assert!(e.contains("error 12"), "{e}");
    }

    #[test]
    fn the_serving_line_gives_the_tcp_address() {
        let out =
            "volume: LUKS1 ...\nserving nbd://127.0.0.1:40123/iopages\nstatistics: kill -USR1 7\n";
        assert_eq!(
            parse_serving(out, "iopages"),
            Some("127.0.0.1:40123".parse().unwrap())
        );
        assert_eq!(parse_serving(out, "other"), None);
        assert_eq!(
            parse_serving("serving nbd+unix:///iopages?socket=/s\n", "iopages"),
            None
        );
    }

    #[test]
    fn ratios_are_per_run_then_median_with_failures_as_zero_or_infinity() {
        let alone = [Some(100.0), Some(200.0), Some(100.0)];
        // Runs: 0.9, 0.5, 1.0 -> median 0.9.
        let hold = [Some(90.0), Some(100.0), Some(100.0)];
        let r = ratio(&alone, &hold, 1.0, false, Some(HOLD_TARGET)).unwrap();
        assert_eq!(r.runs, vec![Some(0.9), Some(0.5), Some(1.0)]);
        assert_eq!((r.median, r.met), (Some(0.9), Some(true)));
        // A failed run is 0: runs 0.9, 0, 0 -> median 0.
        let r = ratio(&alone, &[Some(90.0), None, None], 1.0, false, Some(0.8)).unwrap();
        assert_eq!((r.median, r.met), (Some(0.0), Some(false)));
        // Fair share over 9 peers: 100 / 9 alone's share; 10 is 0.9 of it.
        let r = ratio(&[Some(90.0)], &[Some(9.0)], 9.0, false, Some(FAIR_TARGET)).unwrap();
        assert_eq!((r.median, r.met), (Some(0.9), Some(true)));
        // Latency: at most the target; a failure is infinite (null).
        let r = ratio(&alone, &[Some(500.0), None, None], 1.0, true, Some(10.0)).unwrap();
        assert_eq!(r.runs, vec![Some(5.0), None, None]);
        assert_eq!((r.median, r.met), (None, Some(false)));
        // Runs 5, 2, inf: the median is 5; no target, no verdict.
        let r = ratio(&alone, &[Some(500.0), Some(400.0), None], 1.0, true, None).unwrap();
        assert_eq!((r.median, r.met), (Some(5.0), None));
        // No figure alone: no ratio for that run, none at all if none.
        let r = ratio(
            &[None, Some(10.0)],
            &[Some(5.0), Some(9.0)],
            1.0,
            false,
            None,
        )
        .unwrap();
        assert_eq!(r.runs, vec![Some(0.9)]);
        assert_eq!(ratio(&[None], &[Some(1.0)], 1.0, false, Some(0.8)), None);
    }

    fn cmp(scenario: Scenario, probe: Probe, median: Option<f64>, met: bool) -> Compared {
        Compared {
            scenario: scenario.key(),
            probe: probe.key(),
            describe: probe.label(),
            against: "alone".into(),
            ratio: Some(Ratio {
                runs: vec![median],
                median,
                target: Some(1.0),
                met: Some(met),
            }),
        }
    }

    #[test]
    fn verdicts_need_every_load_and_the_p99() {
        let (seq, rand) = (Probe::Load(Load::SeqRead), Probe::Load(Load::RandRw));
        let all = vec![
            cmp(Scenario::Hold, seq, Some(0.95), true),
            cmp(Scenario::Hold, rand, Some(0.85), true),
            cmp(Scenario::Hold, Probe::ReadP99, Some(3.0), true),
            cmp(Scenario::Flood, seq, Some(1.2), true),
            cmp(Scenario::Flood, rand, Some(0.7), false),
        ];
        let v = verdicts(&all);
        assert_eq!((v.hold_min_ratio, v.hold_met), (Some(0.85), true));
        assert_eq!((v.p99_ratio, v.p99_met), (Some(3.0), true));
        assert_eq!(
            (v.flood_min_ratio_to_fair_share, v.flood_met),
            (Some(0.7), false)
        );
        assert!(!v.target_met);
        let mut inf = all.clone();
        inf[2] = cmp(Scenario::Hold, Probe::ReadP99, None, false);
        inf[4] = cmp(Scenario::Flood, rand, Some(0.9), true);
        let v = verdicts(&inf);
        assert_eq!((v.p99_ratio, v.p99_met, v.flood_met), (None, false, true));
        assert!(!v.target_met);
        assert!(!verdicts(&[]).target_met);
    }

    #[test]
    fn a_process_cpu_time_and_io_bytes_parse() {
        let stat = "4242 (iopages (x)) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 75 0 0 20 0 9 0";
        assert_eq!(parse_stat_ticks(stat), Some(325));
        assert_eq!(parse_stat_ticks("4242 (x) S 1"), None);
        let io = "rchar: 1000\nwchar: 4294967296\nsyscr: 5\n";
        assert_eq!(parse_io_field(io, "wchar"), Some(4 << 30));
        assert_eq!(parse_io_field(io, "rchar"), Some(1000));
        assert_eq!(parse_io_field(io, "read_bytes"), None);
    }

    #[test]
    fn proc_stat_and_loadavg_parse() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n";
        assert_eq!(parse_proc_stat(stat), Some((170, 990)));
        assert_eq!(parse_proc_stat("intr 5\n"), None);
        assert_eq!(parse_loadavg("1.52 0.98 0.40 2/345 6789\n"), Some(1.52));
        assert_eq!(parse_loadavg(""), None);
    }

    #[test]
    fn counters_keep_the_fair_share_figures_when_the_server_has_them() {
        let old = json!({"connections": 5, "refused_connections": 70, "budget": {"waits": 3}});
        let c = counters_of(&old);
        assert_eq!(c["refused_connections"], 70);
        assert!(c.get("peers").is_none());
        let new = json!({"connections": 5, "peers": {"handshake_evictions": 9}});
        assert_eq!(counters_of(&new)["peers"]["handshake_evictions"], 9);
        assert!(counters_of(&Value::Null).is_null());
    }

    #[test]
    fn hostile_peers_come_from_127_0_0_2_on_and_share_with_the_polite_one() {
        assert_eq!(HostilePlan::addr(0), Ipv4Addr::new(127, 0, 0, 2));
        assert_eq!(HostilePlan::addr(7), Ipv4Addr::new(127, 0, 0, 9));
        assert_eq!(HostilePlan::DEFAULT.active_in_flood(), 9);
        // Room for a 4 GiB flood, and not a multiple of 4 GiB.
        for region in [128 * MIB, 1024 * MIB] {
            let e = export_bytes(region);
            assert!(e > u64::from(hostile::MAX_ZEROES_BYTES));
            assert!(e % (4 << 30) >= u64::from(hostile::GREEDY_READ_BYTES));
        }
    }
}
