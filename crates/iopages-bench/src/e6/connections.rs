//! E6 connections: one `iopages serve` (its in-memory volume, plain TCP on
//! loopback) holding a thousand idle connections from a thousand
//! addresses, against the same server with none: what they cost it
//! (tasks, resident memory per connection) and what they cost a polite
//! client's 4 KiB reads (p99 latency, one read in flight), and what they
//! cost it when [`BUSY`] of them read without pause; then, on a second
//! server with `--tls require --tls-psk`, what a thousand idle TLS
//! sessions cost it (tasks, resident memory per session).
//!
//! Owns: the server's start and stop, the idle connections (each after
//! its handshake, from 127.0.x.y, so that per-peer shares admit them),
//! the interleaved runs (alone, then beside the thousand, then beside them
//! with some busy, on the same server), the per-run ratios, the verdicts
//! and the `nbd-connections` report. Must never: assert a figure (the verdicts are reported), take
//! a latency from anything but the client's own clock around each read,
//! or leave a child process or socket behind.
//!
//! The figures: tasks are `/proc/PID/task` (every thread of the server,
//! io_uring's io-wq workers included); resident memory is `VmRSS` of
//! `/proc/PID/status`, and the cost per idle connection is the growth
//! from alone to beside them over their count; the p99 ratio is each
//! run's p99 beside them over its p99 alone, and the median is reported.

use super::common::MIB;
use super::files::work_dirs;
use super::server::{command_line, logs_in, spawn_logged, START_TIMEOUT};
use super::tenants::parse_serving;
use crate::harness::{Report, Table};
use crate::measure::median;
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages_tools::hostile::{
    connect_from, open_peers, peer_ip, raise_open_files, read_latencies, NbdClient,
};
use iopages_tools::nbd_client::{self, Client};
use iopages_tools::{stop, tail_lines, write_psk};
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use serde::Serialize;
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The report's stem (`nbd-connections.json`).
pub const STEM: &str = "nbd-connections";
/// Idle connections beside the polite client.
pub const IDLE: usize = 1000;
/// Target: the polite client's p99 beside them at most this many times
/// its p99 alone.
pub const P99_TARGET: f64 = 2.0;
/// Target: resident memory per idle connection, at most.
pub const RSS_TARGET_BYTES: f64 = 64.0 * 1024.0;
/// Target: resident memory per idle TLS connection, at most.
pub const TLS_RSS_TARGET_BYTES: f64 = 128.0 * 1024.0;
/// The PSK identity of the TLS part.
const PSK_IDENTITY: &str = "bench";
/// The export's name (the in-memory volume's).
const EXPORT: &str = "iopages";
/// How long the idle connections settle before the polite reads: well
/// past the 50 ms after which a connection gives its thread up.
const SETTLE: Duration = Duration::from_millis(500);
/// Of the thousand, how many read without pause in a run's busy part
/// (4 KiB at random offsets, one read in flight each, each from its own
/// address: a peer of its own).
pub const BUSY: usize = 8;
/// How long the busy clients read before the polite reads start.
const WARM: Duration = Duration::from_millis(100);
/// How long the polite client pauses before each of its returning reads:
/// past the 50 ms after which its connection gives its thread up, so each
/// read is served by a thread taken again.
const RETURN_GAP: Duration = Duration::from_millis(80);

/// One run: the polite client alone, then beside [`IDLE`] idle
/// connections, on the same server.
#[derive(Clone, Debug, Serialize)]
struct RunFigures {
    p50_alone_us: f64,
    p99_alone_us: f64,
    /// Reads after a pause of [`RETURN_GAP`] each (the connection parked
    /// before each): what taking a thread again costs a read.
    p50_return_us: f64,
    max_return_us: f64,
    p50_idle_us: f64,
    p99_idle_us: f64,
    /// Beside the thousand with [`BUSY`] of them reading.
    p50_busy_us: f64,
    p99_busy_us: f64,
    tasks_alone: usize,
    tasks_idle: usize,
    tasks_busy: usize,
    /// The busy clients' reads per second, all together, while the polite
    /// client read.
    busy_reads_per_s: f64,
    rss_alone_kib: u64,
    rss_idle_kib: u64,
    /// (rss_idle − rss_alone) / IDLE, in bytes.
    rss_per_idle_bytes: f64,
    /// How long opening the idle connections took (handshakes included).
    open_s: f64,
}

impl RunFigures {
    /// The run's progress line.
    fn brief(&self) -> String {
        format!(
            "p99 {:.1} µs alone, {:.1} µs beside, {:.1} µs with {BUSY} busy; p50 {:.1} µs after a pause; tasks {} / {} / {}; {:.0} B per idle connection",
            self.p99_alone_us,
            self.p99_idle_us,
            self.p99_busy_us,
            self.p50_return_us,
            self.tasks_alone,
            self.tasks_idle,
            self.tasks_busy,
            self.rss_per_idle_bytes
        )
    }
}

/// The `p`th percentile (0–100) of `v` in µs (nearest rank).
fn percentile_us(v: &[Duration], p: f64) -> f64 {
    let mut us: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * us.len() as f64).ceil() as usize;
    us[rank.clamp(1, us.len()) - 1]
}

/// The server's tasks and resident KiB now.
fn usage(pid: u32) -> (usize, u64) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (tasks, vm_rss_kib(&status).unwrap_or(0))
}

/// `VmRSS` of a `/proc/PID/status` text, in KiB.
pub fn vm_rss_kib(status: &str) -> Option<u64> {
    let l = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

/// The server: `iopages serve` on its in-memory volume, loopback TCP.
struct Served {
    child: Option<Child>,
    addr: SocketAddr,
    command: String,
}

impl Served {
    /// Start the server (`tag` names its logs), with `extra` arguments.
    fn start(iopages_bin: &Path, work: &Path, tag: &str, extra: &[&str]) -> Result<Served, String> {
        let (out, err) = logs_in(work, tag);
        let mut cmd = Command::new(iopages_bin);
        cmd.args(["serve", "--size", "64M", "--arena", "128M"])
            .args(["--listen", "127.0.0.1:0", "--max-connections"])
            .arg((IDLE + 100).to_string())
            .args(extra);
        let command = command_line(&cmd);
        let child = spawn_logged(&mut cmd, work, &out, &err)
            .map_err(|e| format!("cannot start iopages serve ({command}): {e}"))?;
        let mut s = Served {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            command,
        };
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let tls = text.replace("serving nbds://", "serving nbd://");
            if let Some(a) = parse_serving(&tls, EXPORT) {
                s.addr = a;
                return Ok(s);
            }
            let exited = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || t.elapsed() > START_TIMEOUT {
                let why = std::fs::read_to_string(&err).unwrap_or_default();
                return Err(format!("iopages serve did not start: {}", tail_lines(&why)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop(&mut c, Duration::from_secs(10));
        }
    }
}

/// A PSK client (`key` for [`PSK_IDENTITY`]), TLS 1.2 or 1.3.
fn psk_connector(key: Vec<u8>) -> Result<SslConnector, String> {
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    b.set_verify(SslVerifyMode::NONE);
    b.set_psk_client_callback(move |_, _hint, id, psk| {
        let name = PSK_IDENTITY.as_bytes();
        id[..name.len()].copy_from_slice(name);
        id[name.len()] = 0;
        psk[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    Ok(b.build())
}

/// One idle TLS client from `ip`: the greeting, STARTTLS, the TLS
/// handshake, then NBD_OPT_GO under TLS (a blocking client: the one file
/// that drives TLS sessions without blocking stays the server's).
fn tls_client(
    ip: Ipv4Addr,
    addr: SocketAddr,
    c: &SslConnector,
) -> Result<Client<impl std::io::Read + std::io::Write>, String> {
    let stream = connect_from(ip, addr).map_err(|e| e.to_string())?;
    let mut cl = Client::greet(stream).map_err(|e| e.to_string())?;
    cl.send_client_flags(nbd_client::FLAG_C_FIXED_NEWSTYLE | nbd_client::FLAG_C_NO_ZEROES)
        .map_err(|e| e.to_string())?;
    cl.send_option(nbd_client::OPT_STARTTLS, &[])
        .map_err(|e| e.to_string())?;
    let r = cl.read_option_reply().map_err(|e| e.to_string())?;
    if r.kind != nbd_client::REP_ACK {
        return Err(format!("STARTTLS answered {:#x}", r.kind));
    }
    let ssl = c
        .connect("localhost", cl.into_stream())
        .map_err(|e| format!("TLS: {e}"))?;
    let mut cl = Client::new(ssl);
    cl.go(EXPORT, &[]).map_err(|e| e.to_string())?;
    Ok(cl)
}

/// The TLS part: a server with `--tls require --tls-psk`, [`IDLE`] idle
/// TLS sessions from `peer_ip(0..)`, one at a time; the server's tasks
/// and RSS alone and beside them.
fn tls_idle(iopages_bin: &Path, work: &Path) -> Result<Value, String> {
    let psk = work.join("keys.psk");
    let hex = write_psk(&psk, PSK_IDENTITY)?;
    let key: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let connector = psk_connector(key)?;
    let psk_arg = psk.to_string_lossy().into_owned();
    let extra = ["--tls", "require", "--tls-psk", psk_arg.as_str()];
    let srv = Served::start(iopages_bin, work, "serve-tls", &extra)?;
    let (tasks_alone, rss_alone) = usage(srv.pid());
    let t = Instant::now();
    let clients = (0..IDLE)
        .map(|i| {
            tls_client(peer_ip(i), srv.addr, &connector).map_err(|e| format!("TLS client {i}: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let open_s = t.elapsed().as_secs_f64();
    std::thread::sleep(SETTLE);
    let (tasks_idle, rss_idle) = usage(srv.pid());
    drop(clients);
    let per = (rss_idle as f64 - rss_alone as f64) * 1024.0 / IDLE as f64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(json!({
        "tasks_alone": tasks_alone,
        "tasks_idle": tasks_idle,
        "rss_alone_kib": rss_alone,
        "rss_idle_kib": rss_idle,
        "rss_per_idle_bytes": round2(per),
        "rss_target_bytes": TLS_RSS_TARGET_BYTES,
        "rss_met": per <= TLS_RSS_TARGET_BYTES,
        "tasks_met": tasks_idle <= 2 * cores + 8,
        "open_s": round2(open_s),
    }))
}

/// The polite client's `reads` beside `idle`, [`BUSY`] of which read
/// without pause meanwhile: its latencies, the server's tasks then, and
/// the busy clients' reads per second. The busy ones go back to `idle`.
fn beside_busy(
    pid: u32,
    idle: &mut Vec<NbdClient>,
    polite: &mut NbdClient,
    reads: usize,
) -> Result<(Vec<Duration>, usize, f64), String> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let busy: Vec<_> = idle
        .drain(..BUSY.min(idle.len()))
        .enumerate()
        .map(|(i, mut c)| {
            let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
            std::thread::spawn(move || {
                let pages = (c.size / 4096).max(1);
                let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ (i as u64 + 1);
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    c.read_at(x % pages * 4096, 4096)
                        .map_err(|e| format!("busy client {i}: {e}"))?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<NbdClient, String>(c)
            })
        })
        .collect();
    std::thread::sleep(WARM);
    let (t, before) = (Instant::now(), done.load(Ordering::Relaxed));
    let lat = read_latencies(polite, reads).map_err(|e| format!("polite read: {e}"));
    let tasks = usage(pid).0;
    let rate = (done.load(Ordering::Relaxed) - before) as f64 / t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in busy {
        idle.push(
            h.join()
                .map_err(|_| "a busy client panicked".to_string())??,
        );
    }
    Ok((lat?, tasks, rate))
}

/// One run on `srv`: `reads` polite reads alone, then the idle
/// connections opened and settled, the same reads beside them, then
/// beside them with [`BUSY`] of them reading, and the connections closed.
fn one_run(
    srv: &Served,
    polite: &mut NbdClient,
    reads: usize,
    returns: usize,
) -> Result<RunFigures, String> {
    let pid = srv.pid();
    let lat = |c: &mut NbdClient| read_latencies(c, reads).map_err(|e| format!("polite read: {e}"));
    let alone = lat(polite)?;
    let mut back = Vec::with_capacity(returns);
    for _ in 0..returns {
        std::thread::sleep(RETURN_GAP);
        back.extend(read_latencies(polite, 1).map_err(|e| format!("returning read: {e}"))?);
    }
    let (tasks_alone, rss_alone) = usage(pid);
    let t = Instant::now();
    let idle = open_peers(srv.addr, EXPORT, IDLE)?;
    let open_s = t.elapsed().as_secs_f64();
    std::thread::sleep(SETTLE);
    let beside = lat(polite)?;
    let (tasks_idle, rss_idle) = usage(pid);
    let mut idle = idle;
    let (busy, tasks_busy, busy_reads_per_s) = beside_busy(pid, &mut idle, polite, reads)?;
    drop(idle);
    // The server closes them as their hang-ups arrive.
    std::thread::sleep(SETTLE);
    Ok(RunFigures {
        p50_alone_us: round2(percentile_us(&alone, 50.0)),
        p99_alone_us: round2(percentile_us(&alone, 99.0)),
        p50_return_us: round2(percentile_us(&back, 50.0)),
        max_return_us: round2(percentile_us(&back, 100.0)),
        p50_idle_us: round2(percentile_us(&beside, 50.0)),
        p99_idle_us: round2(percentile_us(&beside, 99.0)),
        p50_busy_us: round2(percentile_us(&busy, 50.0)),
        p99_busy_us: round2(percentile_us(&busy, 99.0)),
        tasks_alone,
        tasks_idle,
        tasks_busy,
        busy_reads_per_s: round2(busy_reads_per_s),
        rss_alone_kib: rss_alone,
        rss_idle_kib: rss_idle,
        rss_per_idle_bytes: round2((rss_idle as f64 - rss_alone as f64) * 1024.0 / IDLE as f64),
        open_s: round2(open_s),
    })
}

/// What the runs give, against the targets.
#[derive(Clone, Debug, Serialize)]
struct Summary {
    p99_ratio_median: f64,
    p99_ratio_runs: Vec<f64>,
    p99_target: f64,
    p99_met: bool,
    /// The same with [`BUSY`] of them reading.
    p99_busy_ratio_median: f64,
    p99_busy_ratio_runs: Vec<f64>,
    p99_busy_met: bool,
    tasks_idle_max: usize,
    /// The most tasks beside them with [`BUSY`] reading (against the same
    /// bound).
    tasks_busy_max: usize,
    tasks_busy_met: bool,
    tasks_bound: usize,
    tasks_met: bool,
    rss_per_idle_bytes_median: f64,
    /// The first run's: the cold cost (later runs reuse memory the
    /// first left behind: freed heap, glibc's cache of thread stacks).
    rss_per_idle_bytes_first: f64,
    rss_target_bytes: f64,
    rss_met: bool,
    /// Each run's p50 of the returning reads over its p50 alone, median
    /// (reported, no target).
    return_p50_ratio_median: f64,
}

fn summarise(runs: &[RunFigures]) -> Summary {
    let ratios: Vec<f64> = runs
        .iter()
        .map(|r| round2(r.p99_idle_us / r.p99_alone_us))
        .collect();
    let busy: Vec<f64> = runs
        .iter()
        .map(|r| round2(r.p99_busy_us / r.p99_alone_us))
        .collect();
    let busy_median = median(&busy);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tasks_idle_max = runs.iter().map(|r| r.tasks_idle).max().unwrap_or(0);
    let tasks_busy_max = runs.iter().map(|r| r.tasks_busy).max().unwrap_or(0);
    let rss: Vec<f64> = runs.iter().map(|r| r.rss_per_idle_bytes).collect();
    let p99 = median(&ratios);
    let rss_median = median(&rss);
    Summary {
        p99_ratio_median: round2(p99),
        p99_ratio_runs: ratios,
        p99_target: P99_TARGET,
        p99_met: p99 <= P99_TARGET,
        p99_busy_ratio_median: round2(busy_median),
        p99_busy_ratio_runs: busy,
        p99_busy_met: busy_median <= P99_TARGET,
        tasks_idle_max,
        tasks_bound: 2 * cores + 8,
        tasks_met: tasks_idle_max <= 2 * cores + 8,
        tasks_busy_max,
        tasks_busy_met: tasks_busy_max <= 2 * cores + 8,
        rss_per_idle_bytes_median: round2(rss_median),
        rss_per_idle_bytes_first: rss.first().copied().unwrap_or(0.0),
        rss_target_bytes: RSS_TARGET_BYTES,
        rss_met: rss_median <= RSS_TARGET_BYTES
            && rss.first().is_none_or(|&f| f <= RSS_TARGET_BYTES),
        return_p50_ratio_median: round2(median(
            &runs
                .iter()
                .map(|r| r.p50_return_us / r.p50_alone_us)
                .collect::<Vec<_>>(),
        )),
    }
}

fn print_table(runs: &[RunFigures], s: &Summary) {
    let mut t = Table::new(format!(
        "E6 connections: a polite client's 4 KiB reads alone, beside {IDLE} idle connections, and beside them with {BUSY} busy"
    ));
    t.row([
        "run",
        "p50 alone µs",
        "p99 alone µs",
        "p50 / max return µs",
        "p50 idle µs",
        "p99 idle µs",
        "p99 busy µs",
        "busy reads/s",
        "tasks",
        "RSS/conn B",
    ]);
    for (i, r) in runs.iter().enumerate() {
        t.row([
            (i + 1).to_string(),
            format!("{:.1}", r.p50_alone_us),
            format!("{:.1}", r.p99_alone_us),
            format!("{:.1} / {:.1}", r.p50_return_us, r.max_return_us),
            format!("{:.1}", r.p50_idle_us),
            format!("{:.1}", r.p99_idle_us),
            format!("{:.1}", r.p99_busy_us),
            format!("{:.0}", r.busy_reads_per_s),
            format!("{} / {} / {}", r.tasks_alone, r.tasks_idle, r.tasks_busy),
            format!("{:.0}", r.rss_per_idle_bytes),
        ]);
    }
    t.line(format!(
        "p99 beside / alone, median {:.2} (target <= {P99_TARGET}: {}); with {BUSY} of them busy {:.2} ({}); tasks beside {} ({}), with {BUSY} busy {} ({}) (bound 2 x cores + 8 = {}); RSS per idle connection {:.0} B, first run {:.0} B (target <= {RSS_TARGET_BYTES} in both: {})",
        s.p99_ratio_median,
        met(s.p99_met),
        s.p99_busy_ratio_median,
        met(s.p99_busy_met),
        s.tasks_idle_max,
        met(s.tasks_met),
        s.tasks_busy_max,
        met(s.tasks_busy_met),
        s.tasks_bound,
        s.rss_per_idle_bytes_median,
        s.rss_per_idle_bytes_first,
        met(s.rss_met)
    ));
    t.line(format!(
        "a read after a pause (the connection parked, served by a thread taken again) / one alone, p50, median {:.2} (reported)",
        s.return_p50_ratio_median
    ));
    t.print();
}

/// `iopages bench nbd --connections`: `iopages_bin`'s `serve` measured.
///
/// **Returns:** the report; Err when the server does not start or dies,
/// or a connection or read fails (nothing is reported then).
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let workload = BenchError::Workload;
    let (runs, reads, returns) = if opts.quick {
        (2, 2000, 10)
    } else {
        (5, 20_000, 40)
    };
    let files = raise_open_files().map_err(|e| workload(format!("open files limit: {e}")))?;
    if files < IDLE as u64 + 100 {
        return Err(workload(format!(
            "{IDLE} connections need more open files than the limit of {files} (ulimit -n)"
        )));
    }
    let (json_path, _) = opts.paths(STEM);
    let (work, _socks, _dirs) = work_dirs(iopages_bin, &json_path, STEM)?;
    progress(
        STEM,
        format!(
            "{runs} run(s): {reads} polite 4 KiB reads alone, then beside {IDLE} idle connections, then with {BUSY} of them busy"
        ),
    );
    let srv = Served::start(iopages_bin, &work, "serve", &[]).map_err(workload)?;
    let mut polite = NbdClient::connect(Ipv4Addr::LOCALHOST, srv.addr, EXPORT)
        .map_err(|e| workload(format!("the polite client: {e}")))?;
    let mut figures = Vec::new();
    for run in 0..runs {
        let r = one_run(&srv, &mut polite, reads, returns).map_err(workload)?;
        progress(STEM, format!("run {}/{runs}: {}", run + 1, r.brief()));
        figures.push(r);
    }
    drop(polite);
    let command = srv.command.clone();
    drop(srv);
    progress(STEM, format!("TLS (PSK): {IDLE} idle TLS sessions"));
    let tls = tls_idle(iopages_bin, &work).map_err(workload)?;
    let s = summarise(&figures);
    print_table(&figures, &s);
    println!(
        "TLS (PSK): tasks {} / {} beside {IDLE} idle TLS sessions; RSS per idle TLS session {} B (target <= {TLS_RSS_TARGET_BYTES}: {})",
        tls["tasks_alone"],
        tls["tasks_idle"],
        tls["rss_per_idle_bytes"],
        met(tls["rss_met"] == json!(true))
    );
    let settings = json!({
        "runs": runs,
        "reads_per_probe": reads,
        "returning_reads": returns,
        "return_gap_ms": RETURN_GAP.as_millis() as u64,
        "idle_connections": IDLE,
        "busy_connections": BUSY,
        "export_bytes": 64 * MIB,
        "server": command,
        "quick": opts.quick,
    });
    Report::new(
        "E6 nbd connections",
        settings,
        json!({ "runs": figures, "summary": s, "tls": tls }),
    )
    .stem(STEM)
    .emit(opts, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_kib() {
        let s = "Name:\tiopages\nVmHWM:\t  9000 kB\nVmRSS:\t   12345 kB\nThreads:\t5\n";
        assert_eq!(vm_rss_kib(s), Some(12345));
        assert_eq!(vm_rss_kib("Name:\tx\n"), None);
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let v: Vec<Duration> = (1..=100u64).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&v, 99.0), 99.0);
        assert_eq!(percentile_us(&v, 50.0), 50.0);
        assert_eq!(percentile_us(&v[..1], 99.0), 1.0);
    }
}
