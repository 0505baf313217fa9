//! E6 remote outage (`iopages bench nbd --outage`): a LUKS2 volume whose
//! ciphertext is on a remote nbdkit `file` store, served by `iopages serve
//! --image nbd+unix://…`, under fio's 4 KiB random writes with verify
//! (checksums read back while writing, `verify_backlog`) for a fixed time
//! — once with the store up all along, once with the store killed in the
//! middle and started again on the same socket after a set downtime.
//!
//! The cost of the outage is measured two ways, side by side: the time
//! without a single completion (fio's 100 ms IOPS log: the longest run of
//! empty windows) beyond the downtime, and the requests lost against the
//! undisturbed run at its rate. Target: no verify error (fio exits 0) and
//! at most [`TARGET_LOST_S`] seconds lost beyond the downtime.
//!
//! Owns: its work directory, the store and server processes (stopped and
//! reaped on every path), `nbd-outage.json`. Must never: leave a child
//! process or a temporary file behind.

use super::common::os;
use super::files::work_dirs;
use super::remote::{start, Proc};
use super::server::command_line;
use crate::harness::{Report, Table};
use crate::{progress, round2, BenchError, BenchOptions};
use iopages_tools::{find_tool, run_tool, tail_lines};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Seconds lost beyond the downtime the target allows.
pub const TARGET_LOST_S: f64 = 2.0;
/// The volume's payload.
const VOLUME: &str = "256M";
/// fio's IOPS log window.
const LOG_MS: u64 = 100;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd-outage: {e}"))
}

/// One fio run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// fio's exit and its error count: 0 and 0 when every block read back
    /// matched.
    pub fio_ok: bool,
    pub fio_error: String,
    /// Requests completed (writes and verify reads).
    pub ios: u64,
    /// The longest run without a completion, in seconds (IOPS log).
    pub longest_stall_s: f64,
    /// When the store was killed and when it was back (seconds from fio's
    /// start, the bench's clock), for the outage run.
    pub down_at_s: Option<f64>,
    pub up_at_s: Option<f64>,
}

/// The longest run of empty windows in a fio IOPS log (`msec, iops, …`
/// lines), in seconds; the windows before the first completion and after
/// the last do not count.
pub fn longest_stall(log: &str, window_ms: u64) -> f64 {
    let times: Vec<u64> = log
        .lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            let t = f.next()?.parse::<u64>().ok()?;
            let n = f.next()?.parse::<u64>().ok()?;
            (n > 0).then_some(t)
        })
        .collect();
    let gap = times.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    gap.saturating_sub(window_ms) as f64 / 1000.0
}

/// The run's paths and tools.
struct Setup {
    work: PathBuf,
    nbdkit: PathBuf,
    fio: PathBuf,
    iopages: PathBuf,
    image: PathBuf,
    pass: PathBuf,
    store_sock: PathBuf,
    server_sock: PathBuf,
    seconds: u64,
    downtime: Duration,
}

impl Setup {
    fn store(&self) -> Result<Proc, String> {
        let mut cmd = Command::new(&self.nbdkit);
        cmd.args(["--foreground", "--exit-with-parent", "--unix"])
            .arg(&self.store_sock)
            .arg("file")
            .arg(&self.image);
        let name = "nbdkit file (the store)";
        start(name, "store", cmd, &self.store_sock, &self.work).map(|(p, _)| p)
    }

    fn server(&self) -> Result<Proc, String> {
        let mut cmd = Command::new(&self.iopages);
        cmd.args(["serve", "--arena", "256M", "--image"])
            .arg(format!("nbd+unix:///?socket={}", self.store_sock.display()))
            .arg("--passphrase-file")
            .arg(&self.pass)
            .arg("--unix")
            .arg(&self.server_sock);
        start("iopages serve", "serve", cmd, &self.server_sock, &self.work).map(|(p, _)| p)
    }

    /// fio for `seconds`: 4 KiB random writes, each block read back and
    /// checked while writing; its IOPS log goes to `tag`.
    fn fio(&self, tag: &str) -> Command {
        let mut cmd = Command::new(&self.fio);
        cmd.current_dir(&self.work)
            .args([
                "--name=outage",
                "--ioengine=nbd",
                "--rw=randwrite",
                "--bs=4k",
            ])
            .args(["--size=128M", "--iodepth=16", "--time_based"])
            .arg(format!("--runtime={}", self.seconds))
            .args(["--verify=crc32c", "--verify_backlog=64", "--verify_fatal=1"])
            .args([
                "--verify_state_save=0",
                "--do_verify=1",
                "--output-format=json",
            ])
            .arg(format!("--write_iops_log={tag}"))
            .arg(format!("--log_avg_msec={LOG_MS}"))
            .arg(format!(
                "--uri=nbd+unix:///iopages?socket={}",
                self.server_sock.display()
            ));
        cmd
    }
}

/// Requests fio completed, from its JSON report.
fn ios_of(json: &Value) -> u64 {
    let job = &json["jobs"][0];
    ["read", "write"]
        .iter()
        .map(|d| job[d]["total_ios"].as_u64().unwrap_or(0))
        .sum()
}

/// One fio run; with `outage`, the store is killed `seconds / 2 - downtime
/// / 2` in and started again `downtime` later.
fn run_once(st: &Setup, outage: bool, store: &mut Proc) -> Result<Outcome, String> {
    let tag = if outage { "outage" } else { "steady" };
    let mut cmd = st.fio(tag);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let started = Instant::now();
    let child = cmd.spawn().map_err(|e| format!("cannot start fio: {e}"))?;
    let (mut down_at, mut up_at) = (None, None);
    if outage {
        let kill_at = Duration::from_secs(st.seconds) / 2 - st.downtime / 2;
        std::thread::sleep(kill_at.saturating_sub(started.elapsed()));
        store.kill();
        down_at = Some(started.elapsed().as_secs_f64());
        std::thread::sleep(st.downtime);
        *store = st.store()?;
        up_at = Some(started.elapsed().as_secs_f64());
    }
    let out = child.wait_with_output().map_err(|e| format!("fio: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let json: Value = text
        .find('{')
        .and_then(|i| serde_json::from_str(&text[i..]).ok())
        .ok_or_else(|| {
            format!(
                "fio printed no report: {}",
                tail_lines(&String::from_utf8_lossy(&out.stderr))
            )
        })?;
    let err = json["jobs"][0]["error"].as_u64().unwrap_or(u64::MAX);
    let log =
        std::fs::read_to_string(st.work.join(format!("{tag}_iops.1.log"))).unwrap_or_default();
    Ok(Outcome {
        fio_ok: out.status.success() && err == 0,
        fio_error: format!(
            "exit {}, error {err}: {}",
            out.status,
            tail_lines(&String::from_utf8_lossy(&out.stderr))
        ),
        ios: ios_of(&json),
        longest_stall_s: round2(longest_stall(&log, LOG_MS)),
        down_at_s: down_at.map(round2),
        up_at_s: up_at.map(round2),
    })
}

#[derive(Serialize)]
struct Settings {
    seconds: u64,
    downtime_s: f64,
    volume: &'static str,
    fio: String,
    store: &'static str,
    target_lost_s: f64,
}

#[derive(Serialize)]
struct Body {
    steady: Outcome,
    outage: Outcome,
    /// Longest stall beyond the downtime.
    lost_by_stall_s: f64,
    /// Requests lost against the steady run, at its rate, beyond the
    /// downtime.
    lost_by_count_s: f64,
    target_met: bool,
    verdict: String,
}

/// Make the LUKS2 image and its passphrase file.
fn prepare(st: &Setup) -> Result<(), BenchError> {
    std::fs::write(&st.pass, b"iopages-e6-outage").map_err(|e| workload(e.to_string()))?;
    let args = os(&[
        &"luks",
        &"format",
        &"--pbkdf",
        &"pbkdf2",
        &"--iterations",
        &"1000",
        &"--size",
        &VOLUME,
        &"--passphrase-file",
        &st.pass,
        &st.image,
    ]);
    let r =
        run_tool(&st.iopages, &args, &st.work, Duration::from_secs(120), &[]).map_err(workload)?;
    if !r.status.success() {
        return Err(workload(format!(
            "iopages luks format failed: {}",
            r.stderr
        )));
    }
    Ok(())
}

/// Run E6 remote outage.
///
/// **Returns:** the report; a workload error (skipped) without nbdkit or
/// fio's nbd engine.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (seconds, downtime) = if opts.quick { (8, 1.0) } else { (20, 2.0) };
    let (json_path, _) = opts.paths("nbd-outage");
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, "nbd-outage")?;
    let need = |n: &str| {
        find_tool(n).ok_or_else(|| {
            workload(format!(
                "skipped: {n} is not installed (scripts/setup-debian.sh installs it)"
            ))
        })
    };
    let st = Setup {
        nbdkit: need("nbdkit")?,
        fio: need("fio")?,
        iopages: iopages_bin.to_path_buf(),
        image: work.join("luks2.img"),
        pass: work.join("pass"),
        store_sock: socks.join("store.sock"),
        server_sock: socks.join("server.sock"),
        work: work.clone(),
        seconds,
        downtime: Duration::from_secs_f64(downtime),
    };
    progress("nbd-outage", format!("E6 remote outage: a LUKS2 volume ({VOLUME}) on an nbdkit file store behind iopages serve; fio 4 KiB random writes with verify for {seconds} s, once steady, once with the store killed for {downtime} s in the middle"));
    prepare(&st)?;
    let mut store = st.store().map_err(workload)?;
    let server = st.server().map_err(workload)?;
    let steady = run_once(&st, false, &mut store).map_err(workload)?;
    progress(
        "nbd-outage",
        format!(
            "steady: {} requests, longest stall {} s",
            steady.ios, steady.longest_stall_s
        ),
    );
    let outage = run_once(&st, true, &mut store).map_err(workload)?;
    progress(
        "nbd-outage",
        format!(
            "outage: {} requests, longest stall {} s",
            outage.ios, outage.longest_stall_s
        ),
    );
    drop(server);
    drop(store);
    let body = verdict(&st, steady, outage);
    report(opts, &st, body)
}

/// The figures and the verdict.
fn verdict(st: &Setup, steady: Outcome, outage: Outcome) -> Body {
    let down = st.downtime.as_secs_f64();
    let rate = steady.ios as f64 / st.seconds as f64;
    let lost_by_count =
        ((steady.ios.saturating_sub(outage.ios)) as f64 / rate.max(1.0) - down).max(0.0);
    let lost_by_stall = (outage.longest_stall_s - down).max(0.0);
    let ok = steady.fio_ok && outage.fio_ok && lost_by_stall.max(lost_by_count) <= TARGET_LOST_S;
    let verdict = if !steady.fio_ok || !outage.fio_ok {
        format!(
            "FAILED: fio reported an error (steady: {}; outage: {})",
            steady.fio_error, outage.fio_error
        )
    } else {
        format!(
            "{}: {:.2} s lost beyond the {down} s downtime by the longest stall, {:.2} s by the requests lost (target <= {TARGET_LOST_S} s); no verify error",
            if ok { "met" } else { "NOT met" },
            lost_by_stall,
            lost_by_count
        )
    };
    Body {
        steady,
        outage,
        lost_by_stall_s: round2(lost_by_stall),
        lost_by_count_s: round2(lost_by_count),
        target_met: ok,
        verdict,
    }
}

fn report(opts: &BenchOptions, st: &Setup, body: Body) -> Result<Value, BenchError> {
    let mut t = Table::new(format!(
        "nbd --outage (E6 remote outage): {VOLUME} LUKS2 volume on an nbdkit file store, fio 4 KiB randwrite + verify, {} s, store killed for {} s",
        st.seconds,
        st.downtime.as_secs_f64()
    ));
    for (name, o) in [("steady", &body.steady), ("outage", &body.outage)] {
        t.line(format!(
            "{name:<7} | {:>9} requests | longest stall {:>6.2} s | fio {}",
            o.ios,
            o.longest_stall_s,
            if o.fio_ok { "ok" } else { "FAILED" }
        ));
    }
    t.line(body.verdict.clone());
    t.print();
    let settings = Settings {
        seconds: st.seconds,
        downtime_s: st.downtime.as_secs_f64(),
        volume: VOLUME,
        fio: command_line(&st.fio("steady")),
        store: "nbdkit file",
        target_lost_s: TARGET_LOST_S,
    };
    Report::new("nbd-outage", settings, body).emit(opts, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_stall_is_the_widest_gap_between_busy_windows() {
        let log = "100, 50, 0, 4096, 0\n200, 40, 0, 4096, 0\n300, 0, 0, 4096, 0\n\
                   900, 0, 0, 4096, 0\n1000, 30, 0, 4096, 0\n1100, 30, 0, 4096, 0\n";
        assert_eq!(longest_stall(log, 100), 0.7);
        assert_eq!(longest_stall("100, 5, 0, 4096, 0\n", 100), 0.0);
        assert_eq!(longest_stall("", 100), 0.0);
    }
}
