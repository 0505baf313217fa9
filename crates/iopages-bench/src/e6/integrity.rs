//! E6 integrity (`iopages bench nbd --integrity`): what authenticating a
//! volume costs. Three LUKS2 images with 4096-byte sectors and the same
//! data size live on one store (an nbdkit `file` export, as the remote
//! row's): plain (no `--integrity`), `--integrity hmac-sha256` and
//! `--integrity aead`. Each is served in turn by `iopages serve --image
//! nbd+unix://…` under E6's loads (fio's nbd engine: 1 MiB sequential
//! write and read, 4 KiB random read/write; nbdcopy of the volume), the
//! three interleaved in every run (plain, hmac, aead), and each
//! authenticated figure is divided by the plain one of the same run.
//!
//! Beside them, in the same run, the bound: the single-core rates of the
//! cipher (`XtsCipher`, 4 KiB sectors, the backend the server picks) and
//! of each MAC (`Keys::seal` over 4 KiB blocks). Per byte an
//! authenticated volume does the cipher's work and the MAC's, a plain one
//! the cipher's alone, so a CPU-bound authenticated volume runs at most
//! `(1/xts) / (1/xts + 1/mac)` of a plain one's rate. And from the
//! server's metrics around the random load: the store I/Os of one 4 KiB
//! write (tag-block and tree-node writes plus the data write) and the
//! node reads per request.
//!
//! Owns: the store process and each volume's server, started and stopped
//! in turn (one server at a time); the images, their freshness state
//! files and the copy's source, under the run's work directory; the
//! bound's measurement; the metrics read over HTTP; the table and
//! `nbd-integrity.json`. Must never: report a figure of a pass whose fio
//! job failed, whose server died or whose read-back (fio verify, also of
//! what the volume's server wrote in the run before, across its restart)
//! did not match — the volume is marked failed and the run ends in an
//! error after the report is written; signal a process it did not start;
//! leave a child process or a temporary file behind.

use super::common::{os, MIB};
use super::files::{fill_file, sync_file, work_dirs};
use super::fio::{fio, verify_region, Plan, RAND_JOBS, VERIFY_BYTES};
use super::load::{Load, Sample};
use super::measure::{load_sample_at, LoadTarget, Results};
use super::report::{figure_lines, figures_head, rows};
use super::server::{command_line, logs_in, spawn_logged, OUR_EXPORT, START_TIMEOUT, STOP_TIMEOUT};
use super::tools::{parse_size, probe, Tools};
use crate::harness::{Report, Table};
use crate::measure::median;
use crate::{met, progress, BenchError, BenchOptions};
use iopages_crypt::integrity::{Keys, Mac};
use iopages_crypt::XtsCipher;
use iopages_tools::{find_tool, run_tool, stop, tail_lines, wait_for_socket};
use serde::Serialize;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The volumes' passphrase (the file holds exactly these bytes).
const PASSPHRASE: &[u8] = b"iopages-e6-integrity-passphrase";
/// The bytes of one sector, one tag's block and one random request.
const BLOCK: usize = 4096;
/// Targets: a sequential ratio at least this fraction of its bound.
const BOUND_TARGET: f64 = 0.8;
/// Targets with aead: sequential and 4 KiB random ratios to plain.
const AEAD_SEQ_TARGET: f64 = 0.7;
const AEAD_RAND_TARGET: f64 = 0.5;
const TAG: &str = "nbd-integrity";

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd --integrity: {e}"))
}

/// The volumes measured, in each run's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Volume {
    Plain,
    Hmac,
    Aead,
}

impl Volume {
    const ALL: [Volume; 3] = [Volume::Plain, Volume::Hmac, Volume::Aead];

    fn key(self) -> &'static str {
        match self {
            Volume::Plain => "plain",
            Volume::Hmac => "hmac_sha256",
            Volume::Aead => "aead",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Volume::Plain => "plain (no --integrity)",
            Volume::Hmac => "--integrity hmac-sha256",
            Volume::Aead => "--integrity aead",
        }
    }

    /// The tags' MAC; `None` for the plain volume.
    fn mac(self) -> Option<Mac> {
        match self {
            Volume::Plain => None,
            Volume::Hmac => Some(Mac::HmacSha256),
            Volume::Aead => Some(Mac::Gmac),
        }
    }

    /// Its image's file name in the store (the store's export name).
    fn image(self) -> String {
        format!("{}.img", self.key())
    }
}

/// A process this run started: SIGTERM (then SIGKILL) and reaped when
/// dropped.
struct Proc {
    name: &'static str,
    child: Option<Child>,
    out_log: PathBuf,
    err_log: PathBuf,
}

impl Proc {
    fn alive(&mut self) -> Result<(), String> {
        let Some(child) = self.child.as_mut() else {
            return Err(format!("{} was stopped", self.name));
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(s)) => Err(format!(
                "{} exited ({s}); stderr: {}",
                self.name,
                tail_lines(&std::fs::read_to_string(&self.err_log).unwrap_or_default())
            )),
            Err(e) => Err(format!("cannot wait for {}: {e}", self.name)),
        }
    }

    fn stop(&mut self) -> String {
        match self.child.take() {
            Some(mut c) => stop(&mut c, STOP_TIMEOUT),
            None => "not running".into(),
        }
    }

    /// The address `iopages serve --metrics 127.0.0.1:0` printed on its
    /// standard output (it prints it before it serves).
    fn metrics_addr(&mut self) -> Result<String, String> {
        let t0 = Instant::now();
        loop {
            let out = std::fs::read_to_string(&self.out_log).unwrap_or_default();
            let found = out.lines().find_map(|l| {
                l.strip_prefix("metrics: http://")
                    .and_then(|a| a.strip_suffix("/metrics"))
                    .map(str::to_string)
            });
            if let Some(a) = found {
                return Ok(a);
            }
            self.alive()?;
            if t0.elapsed() > START_TIMEOUT {
                return Err(format!("{} printed no metrics address", self.name));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start `cmd` (logs `work/<key>.out` and `.err`) and wait for `sock`.
fn start(
    name: &'static str,
    key: &str,
    mut cmd: Command,
    sock: &Path,
    work: &Path,
) -> Result<(Proc, String), String> {
    let _ = std::fs::remove_file(sock);
    let line = command_line(&cmd);
    let (out_log, err_log) = logs_in(work, key);
    let child = spawn_logged(&mut cmd, work, &out_log, &err_log)
        .map_err(|e| format!("cannot start {name} ({line}): {e}"))?;
    let mut p = Proc {
        name,
        child: Some(child),
        out_log,
        err_log,
    };
    if let Err(e) = wait_for_socket(sock, START_TIMEOUT, || p.alive()) {
        p.stop();
        return Err(format!("{name} did not start: {e} (command: {line})"));
    }
    Ok((p, line))
}

/// Paths and sizes of one run.
struct Setup {
    work: PathBuf,
    /// The store's directory: one image per volume.
    store: PathBuf,
    store_sock: PathBuf,
    server_sock: PathBuf,
    pass: PathBuf,
    source: PathBuf,
    /// The volumes' data size (each export's) and each fio load's time.
    plan: Plan,
}

impl Setup {
    /// The store's export of `v`'s image.
    fn image_uri(&self, v: Volume) -> String {
        format!(
            "nbd+unix:///{}?socket={}",
            v.image(),
            self.store_sock.display()
        )
    }

    /// `v`'s freshness state file: in the work directory, off the store.
    fn freshness(&self, v: Volume) -> PathBuf {
        self.work.join(format!("{}.freshness", v.key()))
    }

    /// The served volume's URI.
    fn uri(&self) -> String {
        format!(
            "nbd+unix:///{OUR_EXPORT}?socket={}",
            self.server_sock.display()
        )
    }

    /// E6's loads against the served volume at `uri`.
    fn target<'a>(&'a self, tools: &'a Tools, uri: &'a str) -> LoadTarget<'a> {
        LoadTarget {
            fio: &tools.fio,
            nbdcopy: &tools.nbdcopy,
            work: &self.work,
            home: None,
            fio_uri: uri,
            uri,
            source: &self.source,
        }
    }

    /// `iopages serve` of `v`'s image on the store, metrics on a free
    /// port of 127.0.0.1.
    fn serve_command(&self, v: Volume, ours: &Path) -> Command {
        let mut cmd = Command::new(ours);
        cmd.arg("serve")
            .arg("--image")
            .arg(self.image_uri(v))
            .arg("--passphrase-file")
            .arg(&self.pass)
            .arg("--unix")
            .arg(&self.server_sock)
            .arg("--name")
            .arg(OUR_EXPORT)
            .arg("--metrics")
            .arg("127.0.0.1:0");
        if v.mac().is_some() {
            cmd.arg("--freshness").arg(self.freshness(v));
        }
        cmd
    }

    /// The store's files flushed to disk (outside the timed loads).
    fn sync_store(&self) {
        for v in Volume::ALL {
            sync_file(&self.store.join(v.image()));
        }
    }
}

/// fio, nbdcopy, nbdinfo (and cryptsetup, which `Tools` always finds)
/// with nbdkit and its file plugin for the store.
fn find_tools(dir: &Path) -> Result<Tools, BenchError> {
    let skipped = |e: String| workload(format!("skipped: {e}"));
    let mut t = Tools::find_as(dir, None, false).map_err(skipped)?;
    t.nbdkit = find_tool("nbdkit").ok_or_else(|| {
        skipped("nbdkit is not installed (the store); scripts/setup-debian.sh installs it (Debian package nbdkit)".into())
    })?;
    probe(
        dir,
        &t.nbdkit,
        &[&"file", &"--dump-plugin"],
        "nbdkit's file plugin is missing",
    )
    .map_err(skipped)?;
    Ok(t)
}

/// `iopages luks format` of `v`'s image: LUKS2, 4096-byte sectors, cheap
/// PBKDF2 (1000 iterations), `size` bytes after the header (the data
/// and, authenticated, the integrity area).
///
/// **Returns:** the data size the command printed.
fn format_volume(st: &Setup, ours: &Path, v: Volume, size: u64) -> Result<u64, String> {
    let image = st.store.join(v.image());
    let mut args = os(&[
        &"luks",
        &"format",
        &image,
        &"--passphrase-file",
        &st.pass,
        &"--size",
        &size.to_string(),
        &"--type",
        &"luks2",
        &"--sector-size",
        &"4096",
        &"--pbkdf",
        &"pbkdf2",
        &"--iterations",
        &"1000",
    ]);
    if let Some(mac) = v.mac() {
        args.extend(os(&[
            &"--integrity",
            &mac.name(),
            &"--freshness",
            &st.freshness(v),
        ]));
    }
    let r = run_tool(ours, &args, &st.work, Duration::from_secs(120), &[])?;
    if !r.status.success() {
        return Err(format!(
            "iopages luks format ({}): {}; stderr: {}",
            v.label(),
            r.status,
            tail_lines(&r.stderr)
        ));
    }
    parse_payload(&r.stdout).ok_or_else(|| {
        format!(
            "iopages luks format ({}) printed no payload size: {}",
            v.label(),
            tail_lines(&r.stdout)
        )
    })
}

/// The data size in `luks format`'s last line (`..., payload N bytes at
/// offset M, ...`).
fn parse_payload(stdout: &str) -> Option<u64> {
    let at = stdout.rfind("payload ")? + "payload ".len();
    stdout[at..].split(' ').next()?.parse().ok()
}

/// The authenticated images first (`data` bytes hold data and tags),
/// then the plain one of their data size, then the copy's source.
fn make_images(st: &mut Setup, ours: &Path, data: u64) -> Result<(), BenchError> {
    std::fs::write(&st.pass, PASSPHRASE).map_err(|e| BenchError::Write {
        path: st.pass.clone(),
        source: e,
    })?;
    let hmac = format_volume(st, ours, Volume::Hmac, data).map_err(workload)?;
    let aead = format_volume(st, ours, Volume::Aead, data).map_err(workload)?;
    if hmac != aead {
        return Err(workload(format!(
            "the two authenticated volumes differ in size ({hmac} and {aead} bytes)"
        )));
    }
    let plain = format_volume(st, ours, Volume::Plain, hmac).map_err(workload)?;
    if plain != hmac {
        return Err(workload(format!(
            "the plain volume has {plain} bytes of data, the authenticated ones {hmac}"
        )));
    }
    st.plan.dev = plain;
    st.sync_store();
    fill_file(&st.source, st.plan.dev, 0xD1B5_4A32_D192_ED03)
}

/// The server's counters read from its metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
struct Counters {
    write_requests: f64,
    read_requests: f64,
    node_writes: f64,
    node_reads: f64,
    commits: f64,
}

impl Counters {
    /// `self - before`.
    fn since(&self, before: &Counters) -> Counters {
        Counters {
            write_requests: self.write_requests - before.write_requests,
            read_requests: self.read_requests - before.read_requests,
            node_writes: self.node_writes - before.node_writes,
            node_reads: self.node_reads - before.node_reads,
            commits: self.commits - before.commits,
        }
    }

    /// Store writes per write request: the tag blocks and nodes written,
    /// plus the data itself (a 4 KiB write is one data write on the
    /// store).
    fn store_writes_per_write(&self) -> Option<f64> {
        (self.write_requests > 0.0).then(|| self.node_writes / self.write_requests + 1.0)
    }

    /// Node reads per request (reads and writes).
    fn node_reads_per_request(&self) -> Option<f64> {
        let n = self.write_requests + self.read_requests;
        (n > 0.0).then(|| self.node_reads / n)
    }
}

/// The value of the sample of family `name` whose labels include every
/// `k="v"` of `labels`, in Prometheus' text format.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let rest = series.strip_prefix(name)?;
        let matches = (rest.is_empty() && labels.is_empty())
            || (rest.starts_with('{')
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))));
        matches.then(|| value.parse().ok()).flatten()
    })
}

/// The counters in a metrics text; the integrity families must be there
/// for an authenticated volume (`integrity`), and are 0 otherwise.
fn counters(text: &str, integrity: bool) -> Result<Counters, String> {
    let export = ("export", OUR_EXPORT);
    let need = |name: &str, labels: &[(&str, &str)]| {
        sample(text, name, labels).ok_or_else(|| format!("the metrics have no {name} {labels:?}"))
    };
    let requests = |cmd: &str| need("iopages_requests_total", &[export, ("command", cmd)]);
    let node = |name: &str| match integrity {
        true => need(name, &[export]),
        false => Ok(0.0),
    };
    Ok(Counters {
        write_requests: requests("write")?,
        read_requests: requests("read")?,
        node_writes: node("iopages_integrity_node_writes_total")?,
        node_reads: node("iopages_integrity_node_reads_total")?,
        commits: node("iopages_integrity_commits_total")?,
    })
}

/// GET /metrics from `addr`; the body.
fn scrape(addr: &str) -> Result<String, String> {
    let io = |e: std::io::Error| format!("GET http://{addr}/metrics: {e}");
    let mut s = std::net::TcpStream::connect(addr).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).map_err(io)?;
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET http://{addr}/metrics: no reply head"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "GET http://{addr}/metrics: {}",
            head.lines().next().unwrap_or("")
        ));
    }
    Ok(body.to_string())
}

/// One volume's server while it runs: the process and its metrics.
struct Served {
    proc: Proc,
    metrics: String,
    integrity: bool,
}

impl Served {
    fn start(st: &Setup, v: Volume, ours: &Path) -> Result<(Served, String), String> {
        let (mut proc, line) = start(
            "iopages serve",
            v.key(),
            st.serve_command(v, ours),
            &st.server_sock,
            &st.work,
        )?;
        let metrics = proc.metrics_addr()?;
        let s = Served {
            proc,
            metrics,
            integrity: v.mac().is_some(),
        };
        Ok((s, line))
    }

    fn counters(&mut self) -> Result<Counters, String> {
        let c = scrape(&self.metrics).and_then(|t| counters(&t, self.integrity));
        self.proc.alive()?;
        c
    }
}

/// The size `nbdinfo` sees at `uri`, which must be the volume's.
fn check_size(tools: &Tools, st: &Setup, uri: &str) -> Result<(), String> {
    let info = run_tool(
        &tools.nbdinfo,
        &os(&[&"--size", &uri]),
        &st.work,
        Duration::from_secs(30),
        &[],
    )?;
    match parse_size(&info.stdout) {
        Some(n) if info.status.success() && n == st.plan.dev => Ok(()),
        n => Err(format!(
            "nbdinfo --size {uri}: {n:?} ({}), the volume is {} bytes; stderr: {}",
            info.status,
            st.plan.dev,
            tail_lines(&info.stderr)
        )),
    }
}

/// Every block of `v` written once through its server (nbdcopy of the
/// source), so that no load reads a never-written block (which an
/// authenticated volume answers as zeros without reading the store).
fn prefill(tools: &Tools, st: &Setup, v: Volume, ours: &Path) -> Result<(), String> {
    let (mut s, _) = Served::start(st, v, ours)?;
    let uri = st.uri();
    let at = st.target(tools, &uri);
    let r = check_size(tools, st, &uri)
        .and_then(|_| load_sample_at(&at, &st.plan, Load::CopyWrite))
        .and_then(|_| s.proc.alive());
    let stopped = s.proc.stop();
    r.map_err(|e| format!("writing the volume before the runs: {e} (stop: {stopped})"))
}

/// fio's arguments for the random load: E6's own (two jobs over the whole
/// volume, fio's random map), so writes to one block from both jobs are
/// in flight at once, as E6 has them on every server. An authenticated
/// volume orders such writes (its tag blocks' stripes: docs/
/// architecture.md, "A write"); the fio verify passes check the result.
fn randrw_args(plan: &Plan, uri: &str) -> Vec<std::ffi::OsString> {
    plan.fio_args(uri, Load::RandRw)
}

/// The random load ([`randrw_args`]) at `uri`: its figure, or why fio
/// failed or moved no data.
fn randrw_sample(tools: &Tools, st: &Setup, uri: &str) -> Result<Sample, String> {
    let what = Load::RandRw.label();
    let v = fio(
        &tools.fio,
        &st.work,
        None,
        randrw_args(&st.plan, uri),
        st.plan.fio_ms,
    )
    .map_err(|e| format!("{what}: {e}"))?;
    if v.read_bytes.min(v.write_bytes) == 0 {
        return Err(format!("{what}: fio moved no data"));
    }
    Ok(Sample {
        mib_s: (v.read_bw + v.write_bw) / MIB as f64,
        iops: Some(v.read_iops + v.write_iops),
    })
}

/// One pass of `v`'s server: the size, the read-back of what the run
/// before wrote (`run` > 0), the timed loads (the counters around the
/// random one), then its own read-back.
fn measure_one(
    tools: &Tools,
    st: &Setup,
    v: Volume,
    ours: &Path,
    run: usize,
    res: &mut Results,
) -> Result<(Vec<Sample>, Counters), String> {
    let (mut s, line) = Served::start(st, v, ours)?;
    res.command = line;
    let uri = st.uri();
    let out = (|| {
        check_size(tools, st, &uri)?;
        if run > 0 {
            verify_region(&tools.fio, &st.work, None, &st.plan, &uri, true).map_err(|e| {
                format!("read-back across a restart of what the run before wrote (fio verify_only): {e}")
            })?;
        }
        let at = st.target(tools, &uri);
        let (mut samples, mut io) = (Vec::new(), Counters::default());
        for load in Load::ALL {
            // The load before's writes are on disk: none pays for another's.
            st.sync_store();
            let before = s.counters()?;
            samples.push(match load {
                Load::RandRw => randrw_sample(tools, st, &uri)?,
                _ => load_sample_at(&at, &st.plan, load)?,
            });
            let after = s
                .counters()
                .map_err(|e| format!("after {}: {e}", load.label()))?;
            if load == Load::RandRw {
                io = after.since(&before);
            }
        }
        verify_region(&tools.fio, &st.work, None, &st.plan, &uri, false)
            .map_err(|e| format!("read-back of its own writes (fio verify): {e}"))?;
        s.proc.alive()?;
        Ok((samples, io))
    })();
    res.stops.push(s.proc.stop());
    out
}

/// Per volume: its figures, and the counters of each run's random load.
struct Measured {
    results: Vec<Results>,
    io: Vec<Vec<Counters>>,
}

/// Every run, each the three volumes in order; a failed volume is left
/// out of the runs after.
fn measure_all(
    tools: &Tools,
    st: &Setup,
    ours: &Path,
    runs: usize,
    store: &mut Proc,
) -> Result<Measured, BenchError> {
    let mut m = Measured {
        results: Volume::ALL.iter().map(|_| Results::empty()).collect(),
        io: vec![Vec::new(); Volume::ALL.len()],
    };
    for (i, &v) in Volume::ALL.iter().enumerate() {
        progress(TAG, format!("writing the whole {} volume", v.label()));
        if let Err(e) = prefill(tools, st, v, ours) {
            progress(TAG, format!("  FAILED ({}): {e}", v.label()));
            m.results[i].failed = Some(e);
        }
    }
    for run in 0..runs {
        for (i, &v) in Volume::ALL.iter().enumerate() {
            if m.results[i].failed.is_some() {
                continue;
            }
            progress(TAG, format!("run {}/{runs}: {}", run + 1, v.label()));
            let r = measure_one(tools, st, v, ours, run, &mut m.results[i]);
            store
                .alive()
                .map_err(|e| workload(format!("the store died: {e}")))?;
            record(v, r, &mut m.results[i], &mut m.io[i]);
        }
    }
    Ok(m)
}

/// Keep one pass's samples and counters (or why it failed).
fn record(
    v: Volume,
    r: Result<(Vec<Sample>, Counters), String>,
    res: &mut Results,
    io: &mut Vec<Counters>,
) {
    match r {
        Ok((samples, c)) => {
            let line = Load::ALL
                .iter()
                .zip(&samples)
                .map(|(l, x)| format!("{} {:.0} {}", l.key(), x.figure(*l), l.unit()))
                .collect::<Vec<_>>()
                .join(", ");
            progress(TAG, format!("  {}: {line}", v.label()));
            for (l, x) in samples.into_iter().enumerate() {
                res.samples[l].push(x);
            }
            io.push(c);
        }
        Err(why) => {
            progress(TAG, format!("  FAILED ({}): {why}", v.label()));
            res.failed = Some(why);
        }
    }
}

/// MB/s (10^6 bytes a second) of `op` run over 4 KiB blocks on this
/// thread for about `secs`: the median of three samples.
fn rate(secs: f64, mut op: impl FnMut(u64) -> Result<(), String>) -> Result<f64, String> {
    let mut v = Vec::new();
    let mut block = 0u64;
    for _ in 0..3 {
        let (t0, mut n) = (Instant::now(), 0u64);
        while t0.elapsed().as_secs_f64() < secs {
            for _ in 0..64 {
                op(block)?;
                block += 1;
            }
            n += 64;
        }
        v.push((n * BLOCK as u64) as f64 / 1e6 / t0.elapsed().as_secs_f64());
    }
    Ok(median(&v))
}

/// The single-core rates the bound is made of, measured in this run.
#[derive(Clone, Debug, Serialize)]
struct CpuRates {
    /// The cipher's backend (the one `iopages serve` picks on this CPU).
    xts_backend: String,
    xts_mb_s: f64,
    hmac_sha256_mb_s: f64,
    aead_mb_s: f64,
}

impl CpuRates {
    fn measure(secs: f64) -> Result<CpuRates, String> {
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let plain: Vec<u8> = (0..BLOCK).map(|i| (i * 131 % 251) as u8).collect();
        let mut dst = vec![0u8; BLOCK];
        let mut xts = XtsCipher::builder(&key)
            .sector_size_bytes(BLOCK)
            .iv_large_sectors(false)
            .build()
            .map_err(|e| format!("XtsCipher: {e}"))?;
        let xts_backend = format!("{:?}", xts.backend());
        let xts_mb_s = rate(secs, |s| {
            xts.encrypt_sectors(s, &plain, &mut dst)
                .map_err(|e| e.to_string())?;
            std::hint::black_box(&mut dst);
            Ok(())
        })?;
        let mac_rate = |mac: Mac| -> Result<f64, String> {
            let keys = Keys::derive(mac, &key).map_err(|e| format!("{}: {e}", mac.name()))?;
            rate(secs, |b| {
                let r = keys.seal(b, 1, Some(&plain)).map_err(|e| e.to_string())?;
                std::hint::black_box(r);
                Ok(())
            })
        };
        Ok(CpuRates {
            xts_backend,
            xts_mb_s,
            hmac_sha256_mb_s: mac_rate(Mac::HmacSha256)?,
            aead_mb_s: mac_rate(Mac::Gmac)?,
        })
    }

    fn mac_mb_s(&self, mac: Mac) -> f64 {
        match mac {
            Mac::HmacSha256 => self.hmac_sha256_mb_s,
            Mac::Gmac => self.aead_mb_s,
        }
    }

    /// The CPU-bound ratio of an authenticated volume's throughput to a
    /// plain one's. Per byte a plain volume spends `1/xts` seconds (the
    /// cipher), an authenticated one `1/xts + 1/mac` (the cipher and the
    /// MAC over the same ciphertext, each at its single-core rate), so at
    /// most `(1/xts) / (1/xts + 1/mac)` = `mac / (xts + mac)`. The tag
    /// tree's hashing and the extra store I/O only lower it further.
    fn bound(&self, mac: Mac) -> f64 {
        let (x, m) = (self.xts_mb_s, self.mac_mb_s(mac));
        (1.0 / x) / (1.0 / x + 1.0 / m)
    }
}

/// One authenticated volume's ratio to plain for one load.
#[derive(Clone, Debug, Serialize)]
struct Ratio {
    volume: &'static str,
    load: &'static str,
    unit: &'static str,
    /// authenticated / plain, per run (figures of the same run).
    per_run: Vec<f64>,
    median: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    /// The CPU bound of this MAC ([`CpuRates::bound`]).
    bound: f64,
    /// `median / bound` (a sequential load's target: >= 0.8). Above 1
    /// where plain is not bound by the cipher's single-core rate (its
    /// store, the NBD path or several cores set its pace).
    fraction_of_bound: Option<f64>,
    /// The ratio if the MAC's single-core time per byte were added to
    /// plain's measured time per byte: `(1/plain) / (1/plain + 1/mac)`,
    /// plain's MB/s of each run (median over the runs). Not a target.
    serial_estimate: Option<f64>,
    /// The targets this ratio is held to, and whether all are met (none:
    /// no target for this load).
    targets: Vec<String>,
    target_met: Option<bool>,
}

/// The targets of `v` on `load`: (what, whether `r` and `frac` meet it).
fn targets_of(v: Volume, load: Load, r: Option<f64>, frac: Option<f64>) -> Vec<(String, bool)> {
    let mut t = Vec::new();
    let seq = matches!(load, Load::SeqWrite | Load::SeqRead);
    if seq {
        let ok = frac.is_some_and(|f| f >= BOUND_TARGET);
        t.push((format!("ratio >= {BOUND_TARGET} of the bound"), ok));
    }
    if v == Volume::Aead && seq {
        let ok = r.is_some_and(|x| x >= AEAD_SEQ_TARGET);
        t.push((format!("ratio to plain >= {AEAD_SEQ_TARGET}"), ok));
    }
    if v == Volume::Aead && load == Load::RandRw {
        let ok = r.is_some_and(|x| x >= AEAD_RAND_TARGET);
        t.push((format!("ratio to plain >= {AEAD_RAND_TARGET}"), ok));
    }
    t
}

/// Per authenticated volume and load: its ratios to plain.
fn ratios(results: &[Results], cpu: &CpuRates) -> Vec<Ratio> {
    let figs = |i: usize, l: usize, load: Load| -> Option<Vec<f64>> {
        let r: &Results = &results[i];
        r.failed
            .is_none()
            .then(|| r.samples[l].iter().map(|s| s.figure(load)).collect())
    };
    let mut out = Vec::new();
    for (i, &v) in Volume::ALL.iter().enumerate().skip(1) {
        let mac = v.mac().expect("authenticated");
        for (l, &load) in Load::ALL.iter().enumerate() {
            let per_run: Vec<f64> = match (figs(i, l, load), figs(0, l, load)) {
                (Some(a), Some(p)) if a.len() == p.len() => {
                    a.iter().zip(&p).map(|(a, p)| a / p).collect()
                }
                _ => Vec::new(),
            };
            let some = !per_run.is_empty();
            let med = some.then(|| median(&per_run));
            let bound = cpu.bound(mac);
            let frac = med.map(|m| m / bound);
            let t = targets_of(v, load, med, frac);
            let serial: Vec<f64> = match &results[0].failed {
                Some(_) => Vec::new(),
                None => results[0].samples[l]
                    .iter()
                    .map(|s| serial_estimate(s.mib_s * MIB as f64 / 1e6, cpu.mac_mb_s(mac)))
                    .collect(),
            };
            out.push(Ratio {
                volume: v.key(),
                load: load.key(),
                unit: load.unit(),
                per_run: per_run.iter().map(|&x| round3(x)).collect(),
                median: med.map(round3),
                min: some.then(|| round3(per_run.iter().cloned().fold(f64::INFINITY, f64::min))),
                max: some.then(|| round3(per_run.iter().cloned().fold(0.0, f64::max))),
                bound: round3(bound),
                fraction_of_bound: frac.map(round3),
                serial_estimate: (!serial.is_empty()).then(|| round3(median(&serial))),
                target_met: (!t.is_empty()).then(|| t.iter().all(|x| x.1)),
                targets: t.into_iter().map(|x| x.0).collect(),
            });
        }
    }
    out
}

/// The ratio to plain if, per byte, the MAC's single-core time
/// (`1/mac_mb_s`) were added to plain's measured time (`1/plain_mb_s`).
fn serial_estimate(plain_mb_s: f64, mac_mb_s: f64) -> f64 {
    (1.0 / plain_mb_s) / (1.0 / plain_mb_s + 1.0 / mac_mb_s)
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One volume's store I/O under the 4 KiB random load.
#[derive(Clone, Debug, Serialize)]
struct StoreIo {
    volume: &'static str,
    /// The counters' deltas over each run's random load.
    per_run: Vec<Counters>,
    /// Medians over the runs: store writes (tag blocks and nodes, plus the
    /// data) per 4 KiB write request, their bytes, node reads per request.
    store_writes_per_write: Option<f64>,
    store_bytes_per_write: Option<f64>,
    node_reads_per_request: Option<f64>,
}

fn store_io(io: &[Vec<Counters>]) -> Vec<StoreIo> {
    Volume::ALL
        .iter()
        .zip(io)
        .map(|(v, runs)| {
            // The median over the runs, to `digits` decimals.
            let med = |f: fn(&Counters) -> Option<f64>, digits: i32| {
                let x: Vec<f64> = runs.iter().filter_map(f).collect();
                let scale = 10f64.powi(digits);
                (!x.is_empty()).then(|| (median(&x) * scale).round() / scale)
            };
            let writes = med(Counters::store_writes_per_write, 3);
            StoreIo {
                volume: v.key(),
                per_run: runs.clone(),
                store_writes_per_write: writes,
                store_bytes_per_write: writes.map(|w| (w * BLOCK as f64).round()),
                // Rare where the tags are cached: more decimals.
                node_reads_per_request: med(Counters::node_reads_per_request, 5),
            }
        })
        .collect()
}

/// What the run found, for the table and the report.
struct Found<'a> {
    st: &'a Setup,
    runs: usize,
    store: &'a str,
    cpu: &'a CpuRates,
    m: &'a Measured,
    ratios: Vec<Ratio>,
    io: Vec<StoreIo>,
}

fn fmt(x: Option<f64>, prec: usize) -> String {
    x.map_or_else(|| "-".to_string(), |x| format!("{x:.prec$}"))
}

/// The table: each volume's figures, the bound, the ratios, the store
/// I/O per write.
fn print_table(f: &Found) {
    let mut t = Table::new("");
    t.line(format!(
        "nbd --integrity (E6 integrity): LUKS2 aes-xts-plain64, 4096-byte sectors, {} MiB of data per volume on {}, iopages serve over Unix sockets; median of {} run(s)",
        f.st.plan.dev / MIB,
        f.store,
        f.runs
    ));
    t.line(figures_head(24));
    for (&v, r) in Volume::ALL.iter().zip(&f.m.results) {
        match &r.failed {
            Some(why) => {
                t.line(format!("{:<24} | FAILED: {why}", v.label()));
            }
            None => figure_lines(&mut t, v.label(), 24, r),
        }
    }
    let c = f.cpu;
    t.line(format!(
        "single core, 4 KiB blocks: XTS ({}) {:.0} MB/s, HMAC-SHA256 {:.0} MB/s, GMAC {:.0} MB/s; bound (1/xts)/(1/xts + 1/mac): hmac-sha256 {:.2}, aead {:.2}",
        c.xts_backend,
        c.xts_mb_s,
        c.hmac_sha256_mb_s,
        c.aead_mb_s,
        c.bound(Mac::HmacSha256),
        c.bound(Mac::Gmac)
    ));
    for r in &f.ratios {
        let target = match r.target_met {
            Some(ok) => format!("; target {}: {}", r.targets.join(", "), met(ok)),
            None => String::new(),
        };
        t.line(format!(
            "{:<11} / plain, {:<13}: {} ({}-{}), {} of the bound, serial estimate {}{target}",
            r.volume,
            r.load,
            fmt(r.median, 3),
            fmt(r.min, 3),
            fmt(r.max, 3),
            fmt(r.fraction_of_bound, 2),
            fmt(r.serial_estimate, 2)
        ));
    }
    for s in &f.io {
        t.line(format!(
            "{:<11} randrw 4K: {} store writes ({} bytes) per write request, {} node reads per request",
            s.volume,
            fmt(s.store_writes_per_write, 2),
            fmt(s.store_bytes_per_write, 0),
            fmt(s.node_reads_per_request, 5)
        ));
    }
    t.print();
}

/// How the run was set up (the report's settings).
fn settings_of(opts: &BenchOptions, f: &Found, store_command: &str) -> Value {
    json!({
        "runs": f.runs,
        "quick": opts.quick,
        "volume_data_bytes": f.st.plan.dev,
        "store": f.store,
        "store_command": store_command,
        "images": "iopages luks format IMG --size S --type luks2 --sector-size 4096 --pbkdf pbkdf2 --iterations 1000 [--integrity hmac-sha256|aead --freshness F]: the authenticated ones with S bytes for data and tags, the plain one with their data size; every block written once through its server (nbdcopy) before the runs",
        "server": format!("iopages serve --image nbd+unix:///IMG?socket=STORE --passphrase-file P --unix S --name {OUR_EXPORT} --metrics 127.0.0.1:0 [--freshness F] (the freshness files beside the store, not on it)"),
        "fio": f.st.plan.settings(false, "volume"),
        "randrw_jobs": format!("E6's random load: {RAND_JOBS} jobs over the whole volume with fio's random map, so both jobs' writes to one block are in flight at once"),
        "nbdcopy": "defaults; read: --no-extents export -> null:, write: a data file of the volume's size -> export, no --flush",
        "page_cache": "the store's nbdkit reads and writes its files through the page cache; they are synced to disk before each timed load (outside it)",
        "order": "every run: plain, hmac-sha256, aead, one server at a time; ratios are authenticated / plain of the same run, the median and the range over the runs",
        "bound": "single-core MB/s (10^6 bytes/s) of XtsCipher encrypting 4 KiB sectors (the backend iopages serve picks) and of Keys::seal over 4 KiB blocks, each the median of 3 samples, measured at the start of this run; per byte a plain volume costs 1/xts, an authenticated one 1/xts + 1/mac, so the CPU-bound ratio is at most (1/xts) / (1/xts + 1/mac)",
        "store_io": "from the server's metrics before and after the 4 KiB random load: (iopages_integrity_node_writes_total delta) / (iopages_requests_total{command=\"write\"} delta) + 1 data write per 4 KiB write request; bytes = 4096 x that; node reads per request = iopages_integrity_node_reads_total delta / (read + write requests)",
        "checks": format!("each pass checks nbdinfo --size, then (from the second run) fio verify_only of the last {} MiB its volume's server wrote in the run before, then writes and checks them again (fio verify, crc32c)", VERIFY_BYTES / MIB),
        "targets": format!("sequential (fio seq write and read) ratios >= {BOUND_TARGET} of their bound; with aead, sequential >= {AEAD_SEQ_TARGET} and 4 KiB randrw >= {AEAD_RAND_TARGET} of plain"),
    })
}

#[derive(Serialize)]
struct VolumeInfo {
    label: &'static str,
    image: String,
    command: String,
    failed: Option<String>,
    stops: Vec<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    volumes: serde_json::Map<String, Value>,
    rows: Vec<super::report::Row>,
    cpu: &'a CpuRates,
    bounds: Value,
    ratios: &'a [Ratio],
    store_io: &'a [StoreIo],
    summary: Value,
}

/// Print the table, write `nbd-integrity.json` (unless `--json`).
///
/// **Returns:** the report; Err after writing it when a volume failed.
fn report(opts: &BenchOptions, f: &Found, store_command: &str) -> Result<Value, BenchError> {
    print_table(f);
    let failed: Vec<String> = Volume::ALL
        .iter()
        .zip(&f.m.results)
        .filter_map(|(v, r)| r.failed.as_ref().map(|w| format!("{}: {w}", v.key())))
        .collect();
    let with_target = || f.ratios.iter().filter(|r| r.target_met.is_some());
    let summary = json!({
        "targets_met": with_target().all(|r| r.target_met == Some(true)),
        "targets_not_met": with_target()
            .filter(|r| r.target_met == Some(false))
            .map(|r| format!("{} {}", r.volume, r.load))
            .collect::<Vec<_>>(),
        "failed": failed,
    });
    let bounds = json!({
        "formula": "(1/xts) / (1/xts + 1/mac)",
        "hmac_sha256": round3(f.cpu.bound(Mac::HmacSha256)),
        "aead": round3(f.cpu.bound(Mac::Gmac)),
    });
    let volumes = Volume::ALL
        .iter()
        .zip(&f.m.results)
        .map(|(&v, r)| {
            let info = VolumeInfo {
                label: v.label(),
                image: v.image(),
                command: r.command.clone(),
                failed: r.failed.clone(),
                stops: r.stops.clone(),
            };
            (v.key().to_string(), json!(info))
        })
        .collect();
    let body = Body {
        volumes,
        rows: rows(Volume::ALL.iter().map(|v| v.key()).zip(&f.m.results)),
        cpu: f.cpu,
        bounds,
        ratios: &f.ratios,
        store_io: &f.io,
        summary,
    };
    let value = Report::new(
        "E6 nbd integrity",
        settings_of(opts, f, store_command),
        body,
    )
    .stem(TAG)
    .emit(opts, &[])?;
    if !failed.is_empty() {
        let (json_path, _) = opts.paths(TAG);
        return Err(workload(format!(
            "failed (report written to {}): {}",
            json_path.display(),
            failed.join("; ")
        )));
    }
    Ok(value)
}

/// The store: one `nbdkit file dir=STORE` process on the store socket.
fn start_store(tools: &Tools, st: &Setup) -> Result<(Proc, String), BenchError> {
    let mut cmd = Command::new(&tools.nbdkit);
    cmd.arg("--foreground")
        .arg("--exit-with-parent")
        .arg("--unix")
        .arg(&st.store_sock)
        .arg("file")
        .arg(format!("dir={}", st.store.display()));
    progress(TAG, "starting the store (nbdkit file)");
    start("store nbdkit file", "store", cmd, &st.store_sock, &st.work).map_err(workload)
}

/// `iopages bench nbd --integrity`: `iopages_bin` is the `iopages` whose
/// `luks format` makes the images and whose `serve` is measured.
///
/// **Returns:** the report; a failed volume (a fio job's error, a dead
/// server, a read-back that did not match) is reported and then returned
/// as an error, as is a store that died.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (runs, data, fio_ms, cpu_secs) = if opts.quick {
        (1usize, 64 * MIB, 2000u64, 0.1)
    } else {
        (3, 256 * MIB, 5000, 0.4)
    };
    let (json_path, _) = opts.paths(TAG);
    // Bound before any process: removed after they are stopped.
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, TAG)?;
    let mut st = Setup {
        store: work.join("store"),
        store_sock: socks.join("store.sock"),
        server_sock: socks.join("server.sock"),
        pass: work.join("passphrase"),
        source: work.join("source.bin"),
        work: work.clone(),
        plan: Plan { dev: 0, fio_ms },
    };
    std::fs::create_dir_all(&st.store).map_err(|e| BenchError::Write {
        path: st.store.clone(),
        source: e,
    })?;
    let tools = find_tools(&work)?;
    let store = "a remote nbdkit file export (nbdkit's file plugin over files in the page cache)";
    progress(
        TAG,
        format!(
            "E6 integrity: three LUKS2 volumes (plain, hmac-sha256, aead) of {} MiB data each on {store}, served by iopages serve in turn; {runs} run(s), fio {} s per load",
            data / MIB,
            fio_ms as f64 / 1000.0
        ),
    );
    progress(TAG, "measuring the single-core rates of XTS and the MACs");
    let cpu = CpuRates::measure(cpu_secs).map_err(workload)?;
    progress(TAG, "formatting the three images");
    make_images(&mut st, iopages_bin, data)?;
    let (mut store_proc, store_command) = start_store(&tools, &st)?;
    let m = measure_all(&tools, &st, iopages_bin, runs, &mut store_proc)?;
    store_proc.stop();
    drop(store_proc);
    let found = Found {
        st: &st,
        runs,
        store,
        cpu: &cpu,
        ratios: ratios(&m.results, &cpu),
        io: store_io(&m.io),
        m: &m,
    };
    report(opts, &found, &store_command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_is_read_from_luks_formats_line() {
        let out = "key slot 0: pbkdf2-sha256, 1000 iterations\n/w/hmac_sha256.img: LUKS2 aes-xts-plain64, 512-bit key, 4096-byte sectors, payload 65011712 bytes at offset 16777216, uuid x (0.1 s)\n";
        assert_eq!(parse_payload(out), Some(65_011_712));
        assert_eq!(parse_payload("key slot 0: pbkdf2\n"), None);
        assert_eq!(parse_payload("payload x bytes"), None);
    }

    const METRICS: &str = "# TYPE iopages_requests_total counter\n\
        iopages_requests_total{export=\"iopages\",command=\"read\"} 120\n\
        iopages_requests_total{export=\"iopages\",command=\"write\"} 100\n\
        iopages_requests_total{export=\"other\",command=\"write\"} 7\n\
        iopages_integrity_node_writes_total{export=\"iopages\"} 104\n\
        iopages_integrity_node_writes_totally{export=\"iopages\"} 9\n\
        iopages_integrity_node_reads_total{export=\"iopages\"} 11\n\
        iopages_integrity_commits_total{export=\"iopages\"} 2\n";

    #[test]
    fn counters_are_read_per_export_and_family() {
        let c = counters(METRICS, true).unwrap();
        assert_eq!(
            c,
            Counters {
                write_requests: 100.0,
                read_requests: 120.0,
                node_writes: 104.0,
                node_reads: 11.0,
                commits: 2.0,
            }
        );
        // A plain volume has no integrity families: zeros.
        let plain = counters(METRICS, false).unwrap();
        assert_eq!(plain.node_writes, 0.0);
        assert_eq!(plain.write_requests, 100.0);
        // An authenticated volume without them is an error, not a zero.
        let e = counters("iopages_requests_total{export=\"iopages\",command=\"read\"} 1\niopages_requests_total{export=\"iopages\",command=\"write\"} 1\n", true).unwrap_err();
        assert!(e.contains("iopages_integrity_node_writes_total"), "{e}");
        assert!(counters("", false).is_err());
    }

    #[test]
    fn store_io_counts_the_data_write_beside_the_nodes() {
        let before = counters(METRICS, true).unwrap();
        let after = Counters {
            write_requests: 300.0,
            read_requests: 320.0,
            node_writes: 306.0,
            node_reads: 51.0,
            commits: 2.0,
        };
        let d = after.since(&before);
        assert_eq!(d.store_writes_per_write(), Some(202.0 / 200.0 + 1.0));
        assert_eq!(d.node_reads_per_request(), Some(40.0 / 400.0));
        assert_eq!(Counters::default().store_writes_per_write(), None);
        let io = store_io(&[vec![Counters::default()], vec![d], vec![]]);
        assert_eq!(io[0].store_writes_per_write, None);
        assert_eq!(io[1].store_writes_per_write, Some(2.01));
        assert_eq!(
            io[1].store_bytes_per_write,
            Some((2.01f64 * 4096.0).round())
        );
        assert_eq!(io[2].node_reads_per_request, None);
    }

    fn cpu(xts: f64, hmac: f64, aead: f64) -> CpuRates {
        CpuRates {
            xts_backend: "Vaes".into(),
            xts_mb_s: xts,
            hmac_sha256_mb_s: hmac,
            aead_mb_s: aead,
        }
    }

    #[test]
    fn the_bound_adds_the_macs_time_per_byte_to_the_ciphers() {
        let c = cpu(3000.0, 1000.0, 3000.0);
        // 1/3000 of 1/3000 + 1/1000: a quarter.
        assert!((c.bound(Mac::HmacSha256) - 0.25).abs() < 1e-12);
        // As fast as the cipher: half.
        assert!((c.bound(Mac::Gmac) - 0.5).abs() < 1e-12);
    }

    fn res(figs: [f64; 5]) -> Results {
        Results {
            samples: Load::ALL
                .iter()
                .zip(figs)
                .map(|(&l, x)| {
                    vec![Sample {
                        mib_s: x,
                        iops: (l == Load::RandRw).then_some(x),
                    }]
                })
                .collect(),
            ..Results::empty()
        }
    }

    #[test]
    fn ratios_are_per_run_and_held_to_their_targets() {
        let plain = || res([1000.0, 1000.0, 100.0, 1000.0, 1000.0]);
        let hmac = res([200.0, 240.0, 60.0, 250.0, 250.0]);
        let aead = res([800.0, 600.0, 40.0, 700.0, 700.0]);
        let failed = || Results {
            failed: Some("fio job failed".into()),
            ..res([1.0; 5])
        };
        // hmac's bound 0.25, aead's 0.75.
        let c = cpu(3000.0, 1000.0, 9000.0);
        let r = ratios(&[plain(), hmac, aead], &c);
        assert_eq!(r.len(), 10);
        let hw = &r[0];
        assert_eq!((hw.volume, hw.load), ("hmac_sha256", "seq_write"));
        assert_eq!(hw.median, Some(0.2));
        assert_eq!(hw.fraction_of_bound, Some(0.8));
        assert_eq!(hw.target_met, Some(true));
        assert_eq!(r[1].fraction_of_bound, Some(0.96));
        // hmac's random load has no target.
        assert_eq!(r[2].target_met, None);
        let aw = &r[5];
        assert_eq!(aw.volume, "aead");
        assert_eq!(aw.fraction_of_bound, Some(round3(0.8 / 0.75)));
        assert_eq!(aw.target_met, Some(true));
        // 0.6 of plain: under 0.7, and 0.8 of the bound.
        assert_eq!(r[6].target_met, Some(false));
        // randrw 0.4 < 0.5.
        assert_eq!(r[7].target_met, Some(false));
        assert_eq!(r[8].target_met, None);
        // A failed volume has no ratio, and misses its targets.
        let r = ratios(&[plain(), failed(), failed()], &c);
        assert!(r.iter().all(|x| x.median.is_none() && x.per_run.is_empty()));
        assert_eq!(r[5].target_met, Some(false));
    }

    #[test]
    fn the_random_jobs_each_get_their_own_part() {
        let plan = Plan {
            dev: 65_011_712,
            fio_ms: 1000,
        };
        let a: Vec<String> = randrw_args(&plan, "nbd+unix:///x")
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert!(a.contains(&"--rw=randrw".to_string()));
        // E6's own load: the whole volume, fio's random map.
        assert!(!a.iter().any(|x| x.starts_with("--offset_increment")));
        assert!(!a.iter().any(|x| x.contains("lfsr")));
    }

    #[test]
    fn a_block_rate_is_measured_and_an_error_passes_through() {
        let x = rate(0.01, |_| Ok(())).unwrap();
        assert!(x > 0.0);
        let e = rate(0.01, |b| if b < 10 { Ok(()) } else { Err("no".into()) });
        assert_eq!(e, Err("no".to_string()));
    }
}
