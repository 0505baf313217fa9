//! E6: the encrypting NBD server (`iopages serve --image`) against the
//! LUKS servers users would run instead — nbdkit with its luks filter and
//! qemu-nbd with qemu's LUKS driver — each serving the same LUKS1 image
//! over a Unix socket, loaded by fio's nbd engine and by nbdcopy.
//!
//! Owns: making the image (cryptsetup), starting, checking and stopping each
//! server, the loads, the cross-check that each server reads back what the
//! one before it wrote, the table, the JSON report and the plot. Must
//! never: measure a server whose I/O failed — a fio job's error, a tool's
//! exit status, a failed read-back or a server that died marks the server
//! as failed, its figures are left out and the run ends in an error after
//! the report is written; nor leave a child process or a temporary file
//! behind, on any path.

use crate::measure::median;
use crate::{met, progress, round2, write_json, BenchError, BenchOptions};
use plotters::prelude::*;
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The volume's passphrase (the file holds exactly these bytes, no newline:
/// cryptsetup's `--key-file` takes the whole file).
const PASSPHRASE: &[u8] = b"iopages-e6-bench-passphrase";
/// LUKS1 with a 512-bit key puts the payload at sector 4096 (2 MiB).
const LUKS_HEADER_BYTES: u64 = 2 << 20;
/// Export name `iopages serve` is given (nbdkit and qemu-nbd export "").
const OUR_EXPORT: &str = "iopages";
/// Sequential loads: 1 MiB requests, 16 in flight, one connection.
const SEQ_DEPTH: u32 = 16;
/// Random load: 4 KiB, 50 % reads, 32 in flight on each of 2 connections.
const RAND_DEPTH: u32 = 32;
const RAND_JOBS: u32 = 2;
/// The region at the end of the export each server writes with fio's
/// verify headers for the next server to check.
const VERIFY_BYTES: u64 = 16 << 20;
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Target: ours at least this many times the best peer, on every load.
const TARGET_RATIO: f64 = 2.0;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd: {e}"))
}

/// The servers, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    Ours,
    Nbdkit,
    Qemu,
}

impl Server {
    const ALL: [Server; 3] = [Server::Ours, Server::Nbdkit, Server::Qemu];

    fn key(self) -> &'static str {
        match self {
            Server::Ours => "ours",
            Server::Nbdkit => "nbdkit",
            Server::Qemu => "qemu",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Server::Ours => "iopages serve",
            Server::Nbdkit => "nbdkit luks filter",
            Server::Qemu => "qemu-nbd luks driver",
        }
    }

    fn uri(self, sock: &Path) -> String {
        let name = if self == Server::Ours { OUR_EXPORT } else { "" };
        format!("nbd+unix:///{name}?socket={}", sock.display())
    }
}

/// The loads, in the order each server runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    SeqWrite,
    SeqRead,
    RandRw,
    CopyRead,
    CopyWrite,
}

impl Load {
    const ALL: [Load; 5] = [
        Load::SeqWrite,
        Load::SeqRead,
        Load::RandRw,
        Load::CopyRead,
        Load::CopyWrite,
    ];

    fn key(self) -> &'static str {
        match self {
            Load::SeqWrite => "seq_write",
            Load::SeqRead => "seq_read",
            Load::RandRw => "randrw",
            Load::CopyRead => "nbdcopy_read",
            Load::CopyWrite => "nbdcopy_write",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Load::SeqWrite => "fio seq write 1M qd16",
            Load::SeqRead => "fio seq read 1M qd16",
            Load::RandRw => "fio randrw 4K 2x qd32",
            Load::CopyRead => "nbdcopy export -> null",
            Load::CopyWrite => "nbdcopy file -> export",
        }
    }

    /// Short name for the plot's axis.
    fn short(self) -> &'static str {
        match self {
            Load::SeqWrite => "seq write",
            Load::SeqRead => "seq read",
            Load::RandRw => "randrw 4K",
            Load::CopyRead => "nbdcopy read",
            Load::CopyWrite => "nbdcopy write",
        }
    }
}

/// One measurement of one load.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Sample {
    mib_s: f64,
    /// Requests per second (fio only; nbdcopy sizes its own requests).
    iops: Option<f64>,
}

/// What fio's JSON report says about one invocation, summed over its jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FioFigures {
    /// Jobs in the report.
    pub jobs: usize,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Read bandwidth, bytes per second.
    pub read_bw: f64,
    /// Write bandwidth, bytes per second.
    pub write_bw: f64,
    /// Read requests per second.
    pub read_iops: f64,
    /// Write requests per second.
    pub write_iops: f64,
}

/// Parse fio's `--output-format=json` output. Lines before the JSON (the nbd
/// engine prints "fio: connected to NBD server" on stdout) and text after it
/// are skipped. A job with a non-zero `error` is an error, never a figure.
pub fn parse_fio(stdout: &str) -> Result<FioFigures, String> {
    let start = stdout
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| stdout.starts_with('{').then_some(0))
        .ok_or_else(|| "no JSON report in fio's output".to_string())?;
    let v: Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<Value>()
        .next()
        .ok_or_else(|| "empty JSON report from fio".to_string())?
        .map_err(|e| format!("fio's JSON report does not parse: {e}"))?;
    let jobs = v["jobs"]
        .as_array()
        .filter(|j| !j.is_empty())
        .ok_or_else(|| "fio's JSON report has no jobs".to_string())?;
    let mut f = FioFigures {
        jobs: jobs.len(),
        ..FioFigures::default()
    };
    for job in jobs {
        let name = job["jobname"].as_str().unwrap_or("?");
        let err = job["error"]
            .as_i64()
            .ok_or_else(|| format!("fio job {name} has no error field"))?;
        if err != 0 {
            // An errno, or -1 (printed as unsigned) for the engine's own.
            let code = err as i32;
            let what = if code > 0 {
                format!(" ({})", std::io::Error::from_raw_os_error(code))
            } else {
                String::new()
            };
            return Err(format!("fio job {name} failed: error {code}{what}"));
        }
        let num = |dir: &str, k: &str| job[dir][k].as_f64().unwrap_or(0.0);
        f.read_bytes += num("read", "io_bytes") as u64;
        f.write_bytes += num("write", "io_bytes") as u64;
        f.read_bw += num("read", "bw_bytes");
        f.write_bw += num("write", "bw_bytes");
        f.read_iops += num("read", "iops");
        f.write_iops += num("write", "iops");
    }
    Ok(f)
}

/// `nbdinfo --size`: one number.
fn parse_size(stdout: &str) -> Option<u64> {
    stdout.trim().parse().ok()
}

/// `cryptsetup luksDump`'s payload offset, in bytes.
fn parse_payload_offset(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| l.trim().strip_prefix("Payload offset:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|sectors| sectors * 512)
}

/// A value inside a qemu option string: commas are doubled.
fn qemu_escape(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// The last lines of a log file, for error messages.
fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let t = text_tail(&s);
    if t.is_empty() {
        "(nothing on stderr)".into()
    } else {
        t
    }
}

/// The last few lines of a tool's output, shortened, for error messages.
fn text_tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..]
        .iter()
        .map(|l| match l.char_indices().nth(200) {
            Some((i, _)) => format!("{}…", &l[..i]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Children get `sig` if this thread goes away without stopping them.
fn die_with_parent(cmd: &mut Command, sig: libc::c_int) {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0);
            Ok(())
        });
    }
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own, not yet reaped, child's id.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// Kills and reaps the child when dropped, unless it was reaped already.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            signal(&self.0, libc::SIGKILL);
            let _ = self.0.wait();
        }
    }
}

/// A tool's run: its status, output and wall time.
struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    secs: f64,
}

/// Run `program args` in `dir` to completion, killing it after `timeout`.
fn run_tool(
    program: &Path,
    args: &[OsString],
    dir: &Path,
    timeout: Duration,
) -> Result<Ran, String> {
    let name = program.display().to_string();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd, libc::SIGKILL);
    let start = Instant::now();
    let mut child = Reaped(
        cmd.spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?,
    );
    let reader = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = reader(child.0.stdout.take().map(|r| Box::new(r) as _));
    let err = reader(child.0.stderr.take().map(|r| Box::new(r) as _));
    let status = loop {
        match child.0.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > timeout => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => return Err(format!("cannot wait for {name}: {e}")),
        }
    };
    let secs = start.elapsed().as_secs_f64();
    if status.is_none() {
        signal(&child.0, libc::SIGKILL);
        let _ = child.0.wait();
    }
    let (stdout, stderr) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    match status {
        Some(status) => Ok(Ran {
            status,
            stdout,
            stderr,
            secs,
        }),
        None => Err(format!(
            "{name} did not finish in {} s (killed); stderr: {}",
            timeout.as_secs(),
            text_tail(&stderr)
        )),
    }
}

fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// The outside programs E6 runs (the peers' only when they run).
struct Tools {
    cryptsetup: PathBuf,
    fio: PathBuf,
    nbdcopy: PathBuf,
    nbdinfo: PathBuf,
    nbdkit: PathBuf,
    qemu_nbd: PathBuf,
}

fn find_tool(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

impl Tools {
    fn find(dir: &Path, peers: bool) -> Result<Tools, BenchError> {
        let need = |name: &str, pkg: &str, why: &str| {
            find_tool(name).ok_or_else(|| {
                workload(format!(
                    "{name} is not installed ({why}); scripts/setup-debian.sh installs it (Debian package {pkg})"
                ))
            })
        };
        // Without peers their names stand in; nothing starts them.
        let peer = |name: &str, pkg: &str, why: &str| {
            if peers {
                need(name, pkg, why)
            } else {
                Ok(PathBuf::from(name))
            }
        };
        let t = Tools {
            cryptsetup: need("cryptsetup", "cryptsetup-bin", "it formats the LUKS1 image")?,
            fio: need("fio", "fio", "its nbd engine is the load")?,
            nbdcopy: need("nbdcopy", "libnbd-bin", "the copy load")?,
            nbdinfo: need("nbdinfo", "libnbd-bin", "it checks each export")?,
            nbdkit: peer("nbdkit", "nbdkit", "a peer server, with its luks filter")?,
            qemu_nbd: peer(
                "qemu-nbd",
                "qemu-utils",
                "a peer server, with qemu's LUKS driver",
            )?,
        };
        let probe = |prog: &Path, args: Vec<OsString>, what: &str| {
            let ok = run_tool(prog, &args, dir, Duration::from_secs(30))
                .map(|r| r.status.success())
                .unwrap_or(false);
            if ok {
                Ok(())
            } else {
                Err(workload(format!(
                    "{what}; scripts/setup-debian.sh installs the Debian packages that have it"
                )))
            }
        };
        probe(
            &t.fio,
            os(&[&"--enghelp=nbd"]),
            "this fio has no nbd engine (fio built with libnbd is needed)",
        )?;
        if peers {
            probe(
                &t.nbdkit,
                os(&[&"--filter=luks", &"null", &"--dump-plugin"]),
                "nbdkit's luks filter is missing",
            )?;
        }
        Ok(t)
    }
}

/// A server process, stopped with SIGTERM (then SIGKILL) and reaped on
/// every path.
struct Running {
    server: Server,
    child: Option<Child>,
    uri: String,
    err_log: PathBuf,
}

impl Running {
    /// Err if the server has exited.
    fn alive(&mut self) -> Result<(), String> {
        let child = self.child.as_mut().expect("running");
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(s)) => Err(format!(
                "{} exited ({s}); stderr: {}",
                self.server.label(),
                tail(&self.err_log)
            )),
            Err(e) => Err(format!("cannot wait for {}: {e}", self.server.label())),
        }
    }

    /// SIGTERM, wait, SIGKILL if it lingers. Says how it ended.
    fn stop(&mut self) -> String {
        let Some(mut child) = self.child.take() else {
            return "not running".into();
        };
        if let Ok(Some(s)) = child.try_wait() {
            return format!("had exited before the stop: {s}");
        }
        signal(&child, libc::SIGTERM);
        let t = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(s)) => return format!("{s} after SIGTERM"),
                Ok(None) if t.elapsed() < STOP_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    signal(&child, libc::SIGKILL);
                    let _ = child.wait();
                    return format!(
                        "killed: still running {} s after SIGTERM",
                        STOP_TIMEOUT.as_secs()
                    );
                }
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Paths of one bench run.
struct Files {
    /// Image, source file, logs: under the report's directory.
    work: PathBuf,
    /// Unix sockets: under the temporary directory (socket paths are short).
    socks: PathBuf,
    image: PathBuf,
    pass: PathBuf,
    source: PathBuf,
}

/// Removes the directories it holds when dropped.
struct RemoveDirs(Vec<PathBuf>);

impl Drop for RemoveDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// How a server is started.
fn server_command(s: Server, tools: &Tools, ours: &Path, f: &Files, sock: &Path) -> Command {
    let mut cmd;
    match s {
        Server::Ours => {
            cmd = Command::new(ours);
            cmd.arg("serve")
                .arg("--image")
                .arg(&f.image)
                .arg("--passphrase-file")
                .arg(&f.pass)
                .arg("--unix")
                .arg(sock)
                .arg("--name")
                .arg(OUR_EXPORT)
                // Through the page cache, as both peers read and write it.
                .arg("--io")
                .arg("buffered");
        }
        Server::Nbdkit => {
            cmd = Command::new(&tools.nbdkit);
            cmd.arg("--foreground")
                .arg("--exit-with-parent")
                .arg("--unix")
                .arg(sock)
                .arg("--filter=luks")
                .arg("file")
                .arg(format!("file={}", f.image.display()))
                .arg(format!("passphrase=+{}", f.pass.display()));
        }
        Server::Qemu => {
            cmd = Command::new(&tools.qemu_nbd);
            cmd.arg("--object")
                .arg(format!("secret,id=sec0,file={}", qemu_escape(&f.pass)))
                .arg("--image-opts")
                .arg(format!(
                    "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
                    qemu_escape(&f.image)
                ))
                .arg("--socket")
                .arg(sock)
                .arg("--persistent")
                .arg("--shared=0")
                .arg("--cache=writeback")
                .arg("--aio=io_uring");
        }
    }
    cmd
}

fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Start `s` and wait until its socket takes connections.
fn start_server(
    s: Server,
    tools: &Tools,
    ours: &Path,
    f: &Files,
) -> Result<(Running, String), BenchError> {
    let sock = f.socks.join(format!("{}.sock", s.key()));
    let _ = std::fs::remove_file(&sock);
    let mut cmd = server_command(s, tools, ours, f, &sock);
    let line = command_line(&cmd);
    let out_log = f.work.join(format!("{}.out", s.key()));
    let err_log = f.work.join(format!("{}.err", s.key()));
    let file = |p: &Path| {
        std::fs::File::create(p).map_err(|e| BenchError::Write {
            path: p.to_path_buf(),
            source: e,
        })
    };
    cmd.current_dir(&f.work)
        .stdin(Stdio::null())
        .stdout(file(&out_log)?)
        .stderr(file(&err_log)?);
    die_with_parent(&mut cmd, libc::SIGTERM);
    let child = cmd
        .spawn()
        .map_err(|e| workload(format!("cannot start {} ({line}): {e}", s.label())))?;
    let mut r = Running {
        server: s,
        child: Some(child),
        uri: s.uri(&sock),
        err_log,
    };
    let t = Instant::now();
    loop {
        if let Err(e) = r.alive() {
            return Err(workload(format!(
                "{} did not start: {e} (command: {line})",
                s.label()
            )));
        }
        if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
            return Ok((r, line));
        }
        if t.elapsed() > START_TIMEOUT {
            let why = format!(
                "{} did not listen on {} within {} s; stderr: {} (command: {line})",
                s.label(),
                sock.display(),
                START_TIMEOUT.as_secs(),
                tail(&r.err_log)
            );
            r.stop();
            return Err(workload(why));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Settings of the loads.
struct Plan {
    /// Export size, bytes.
    dev: u64,
    /// Each timed fio job's run time, ms.
    fio_ms: u64,
}

impl Plan {
    /// What every fio job of E6 starts with: JSON out, threads, the nbd
    /// engine on `uri`, the job's name.
    fn fio_common(uri: &str, name: &str) -> Vec<String> {
        vec![
            "--output-format=json".to_string(),
            "--eta=never".into(),
            "--thread".into(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            format!("--name=e6-{name}"),
        ]
    }

    fn fio_args(&self, uri: &str, load: Load) -> Vec<OsString> {
        let mut a = Self::fio_common(uri, load.key());
        a.extend([
            format!("--size={}", self.dev),
            "--group_reporting".into(),
            "--time_based".into(),
            format!("--runtime={}ms", self.fio_ms),
        ]);
        match load {
            Load::SeqWrite | Load::SeqRead => a.extend([
                format!(
                    "--rw={}",
                    if load == Load::SeqWrite {
                        "write"
                    } else {
                        "read"
                    }
                ),
                "--bs=1M".into(),
                format!("--iodepth={SEQ_DEPTH}"),
                "--numjobs=1".into(),
            ]),
            _ => a.extend([
                "--rw=randrw".into(),
                "--rwmixread=50".into(),
                "--bs=4k".into(),
                format!("--iodepth={RAND_DEPTH}"),
                format!("--numjobs={RAND_JOBS}"),
            ]),
        }
        a.into_iter().map(OsString::from).collect()
    }

    /// The read-back job: 64 KiB writes with crc32c verify headers over the
    /// last `VERIFY_BYTES` of the export, read back and checked; with
    /// `only`, the check alone (of what an earlier run of the job wrote,
    /// through another server).
    fn verify_args(&self, uri: &str, only: bool) -> Vec<OsString> {
        let mut a = Self::fio_common(uri, "verify");
        a.extend([
            "--rw=write".into(),
            "--bs=64k".into(),
            "--iodepth=8".into(),
            format!("--offset={}", self.dev - VERIFY_BYTES),
            format!("--size={VERIFY_BYTES}"),
            "--verify=crc32c".into(),
            "--do_verify=1".into(),
            "--verify_fatal=1".into(),
            "--verify_state_save=0".into(),
            "--randrepeat=1".into(),
        ]);
        if only {
            a.push("--verify_only".into());
        }
        a.into_iter().map(OsString::from).collect()
    }
}

/// Run fio, check its exit status and every job's error field.
fn fio(tools: &Tools, dir: &Path, args: Vec<OsString>, ms: u64) -> Result<FioFigures, String> {
    let r = run_tool(&tools.fio, &args, dir, Duration::from_millis(ms + 120_000))?;
    let parsed = parse_fio(&r.stdout);
    match (r.status.success(), parsed) {
        (true, Ok(f)) => Ok(f),
        (_, Err(e)) => Err(format!(
            "{e}; fio {}; stderr: {}",
            r.status,
            text_tail(&r.stderr)
        )),
        (false, Ok(_)) => Err(format!(
            "fio {}; stderr: {}",
            r.status,
            text_tail(&r.stderr)
        )),
    }
}

/// A failure while measuring, and whom it is put on.
struct Failure {
    server: Server,
    why: String,
}

/// One server's pass over every load: check the previous server's
/// read-back region, the timed loads, then write the region for the next.
fn measure(
    r: &mut Running,
    tools: &Tools,
    f: &Files,
    plan: &Plan,
    previous: Option<Server>,
) -> Result<(Vec<Sample>, Option<Failure>), Failure> {
    let s = r.server;
    let fail = |why: String| Failure { server: s, why };
    // Size and multi-conn, as each server advertises them.
    let info = run_tool(
        &tools.nbdinfo,
        &os(&[&"--size", &r.uri]),
        &f.work,
        Duration::from_secs(30),
    )
    .map_err(fail)?;
    let size = parse_size(&info.stdout);
    if !info.status.success() || size != Some(plan.dev) {
        return Err(fail(format!(
            "nbdinfo --size {}: {:?} ({}), the LUKS payload is {} bytes; stderr: {}",
            r.uri,
            size,
            info.status,
            plan.dev,
            text_tail(&info.stderr)
        )));
    }
    let mut on_previous = None;
    if let Some(p) = previous {
        let v = fio(tools, &f.work, plan.verify_args(&r.uri, true), 10_000);
        let v = v.and_then(|v| {
            (v.read_bytes == VERIFY_BYTES)
                .then_some(())
                .ok_or(format!("checked {} of {VERIFY_BYTES} bytes", v.read_bytes))
        });
        if let Err(e) = v {
            let why = format!(
                "{} did not read back what {} wrote (fio verify_only): {e}",
                s.label(),
                p.label()
            );
            // The peers agree with cryptsetup; a disagreement that involves
            // ours is put on ours. When that is the previous server, this
            // one goes on.
            if p == Server::Ours {
                on_previous = Some(Failure { server: p, why });
            } else {
                return Err(fail(why));
            }
        }
    }
    let mut out = Vec::new();
    for load in Load::ALL {
        let sample = match load {
            Load::SeqWrite | Load::SeqRead | Load::RandRw => {
                let v = fio(tools, &f.work, plan.fio_args(&r.uri, load), plan.fio_ms)
                    .map_err(|e| fail(format!("{}: {e}", load.label())))?;
                let (bytes, bw, iops) = match load {
                    Load::SeqWrite => (v.write_bytes, v.write_bw, v.write_iops),
                    Load::SeqRead => (v.read_bytes, v.read_bw, v.read_iops),
                    _ => (
                        v.read_bytes.min(v.write_bytes),
                        v.read_bw + v.write_bw,
                        v.read_iops + v.write_iops,
                    ),
                };
                if bytes == 0 {
                    return Err(fail(format!("{}: fio moved no data", load.label())));
                }
                Sample {
                    mib_s: bw / MIB as f64,
                    iops: Some(iops),
                }
            }
            Load::CopyRead | Load::CopyWrite => {
                let args = if load == Load::CopyRead {
                    // Extents off: read every block, holes or not.
                    os(&[&"--no-extents", &r.uri, &"null:"])
                } else {
                    os(&[&f.source, &r.uri])
                };
                let timeout = Duration::from_secs(60 + plan.dev / (4 * MIB));
                let c = run_tool(&tools.nbdcopy, &args, &f.work, timeout)
                    .map_err(|e| fail(format!("{}: {e}", load.label())))?;
                if !c.status.success() {
                    return Err(fail(format!(
                        "{}: nbdcopy {}; stderr: {}",
                        load.label(),
                        c.status,
                        text_tail(&c.stderr)
                    )));
                }
                Sample {
                    mib_s: plan.dev as f64 / MIB as f64 / c.secs,
                    iops: None,
                }
            }
        };
        r.alive()
            .map_err(|e| fail(format!("after {}: {e}", load.label())))?;
        out.push(sample);
    }
    let v = fio(tools, &f.work, plan.verify_args(&r.uri, false), 10_000)
        .map_err(|e| fail(format!("read-back of its own writes (fio verify): {e}")))?;
    if v.read_bytes != VERIFY_BYTES {
        return Err(fail(format!(
            "read-back of its own writes checked {} of {VERIFY_BYTES} bytes",
            v.read_bytes
        )));
    }
    r.alive().map_err(fail)?;
    Ok((out, on_previous))
}

/// Fill `path` with `bytes` of pseudo-random data and flush it to disk.
fn fill_file(path: &Path, bytes: u64, seed: u64) -> Result<(), BenchError> {
    let err = |e| BenchError::Write {
        path: path.to_path_buf(),
        source: e,
    };
    let mut file = std::fs::File::create(path).map_err(err)?;
    let mut x = seed | 1;
    let mut buf = vec![0u8; MIB as usize];
    for _ in 0..bytes.div_ceil(MIB) {
        for w in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        file.write_all(&buf).map_err(err)?;
    }
    file.set_len(bytes).map_err(err)?;
    file.sync_all().map_err(err)
}

fn sync_file(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// The file system `dir` is on, for the report.
fn fs_type(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: statfs fills the zeroed struct; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown".into();
    }
    match st.f_type as u64 {
        0xEF53 => "ext2/3/4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794C_7630 => "overlayfs".into(),
        t => format!("f_type {t:#x}"),
    }
}

/// Per server: samples of each load, or why it failed.
struct Results {
    samples: Vec<Vec<Sample>>,
    failed: Option<String>,
    command: String,
    stops: Vec<String>,
    multi_conn: Option<bool>,
}

impl Results {
    fn median_mib(&self, l: usize) -> Option<f64> {
        (self.failed.is_none() && !self.samples[l].is_empty())
            .then(|| median(&self.samples[l].iter().map(|s| s.mib_s).collect::<Vec<_>>()))
    }

    fn median_iops(&self, l: usize) -> Option<f64> {
        let v: Vec<f64> = self.samples[l].iter().filter_map(|s| s.iops).collect();
        (self.failed.is_none() && !v.is_empty()).then(|| median(&v))
    }
}

/// E6. `iopages_bin` is the `iopages` executable whose `serve` is measured.
/// Returns the report; a server that fails is reported (table and JSON)
/// and then returned as an error.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (runs, payload, fio_ms) = if opts.quick {
        (1usize, 128 * MIB, 1500u64)
    } else {
        (3, 1024 * MIB, 5000)
    };
    let servers: Vec<Server> = if opts.peers {
        Server::ALL.to_vec()
    } else {
        vec![Server::Ours]
    };
    if !iopages_bin.is_file() {
        return Err(workload(format!(
            "{} not found: build it (cargo build --release -p iopages-cli)",
            iopages_bin.display()
        )));
    }
    let (json_path, svg_path) = opts.paths("nbd");
    let report_dir = json_path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let pid = std::process::id();
    let work = report_dir.join(format!("nbd-work-{pid}"));
    let socks = std::env::temp_dir().join(format!("iopages-nbd-{pid}"));
    let mk = |d: &Path| {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).map_err(|e| BenchError::Write {
            path: d.to_path_buf(),
            source: e,
        })
    };
    // Declared before any server: dropped (removed) after they are stopped.
    let _dirs = RemoveDirs(vec![work.clone(), socks.clone()]);
    mk(&work)?;
    mk(&socks)?;
    let work = work.canonicalize().unwrap_or(work);
    let tools = Tools::find(&work, opts.peers)?;
    let f = Files {
        image: work.join("luks1.img"),
        pass: work.join("passphrase"),
        source: work.join("source.bin"),
        work: work.clone(),
        socks,
    };
    let fs = fs_type(&work);
    progress(
        "nbd",
        format!(
            "E6: {} served in turn over Unix sockets, {runs} run(s); one LUKS1 image (aes-xts-plain64, 512-bit key, sha256) of {} MiB payload on {fs} under {}; fio {} s per load",
            servers.iter().map(|s| s.label()).collect::<Vec<_>>().join(", "),
            payload / MIB,
            work.display(),
            fio_ms as f64 / 1000.0
        ),
    );

    // The volume: data everywhere (no holes to read), then the LUKS header.
    {
        let mut p = std::fs::File::create(&f.pass).map_err(|e| BenchError::Write {
            path: f.pass.clone(),
            source: e,
        })?;
        p.write_all(PASSPHRASE).map_err(|e| BenchError::Write {
            path: f.pass.clone(),
            source: e,
        })?;
    }
    fill_file(&f.image, payload + LUKS_HEADER_BYTES, 0x9E37_79B9_7F4A_7C15)?;
    let fmt = run_tool(
        &tools.cryptsetup,
        &os(&[
            &"luksFormat",
            &"-q",
            &"--type",
            &"luks1",
            &"--cipher",
            &"aes-xts-plain64",
            &"--key-size",
            &"512",
            &"--hash",
            &"sha256",
            &"--pbkdf-force-iterations",
            &"1000",
            &"--key-file",
            &f.pass,
            &f.image,
        ]),
        &work,
        Duration::from_secs(120),
    )
    .map_err(workload)?;
    if !fmt.status.success() {
        return Err(workload(format!(
            "cryptsetup luksFormat {}: {}",
            fmt.status,
            text_tail(&fmt.stderr)
        )));
    }
    let dump = run_tool(
        &tools.cryptsetup,
        &os(&[&"luksDump", &f.image]),
        &work,
        Duration::from_secs(60),
    )
    .map_err(workload)?;
    let offset = parse_payload_offset(&dump.stdout)
        .ok_or_else(|| workload("cryptsetup luksDump shows no payload offset"))?;
    let dev = payload + LUKS_HEADER_BYTES - offset;
    sync_file(&f.image);
    fill_file(&f.source, dev, 0xD1B5_4A32_D192_ED03)?;
    let plan = Plan { dev, fio_ms };

    let mut results: Vec<Results> = servers
        .iter()
        .map(|_| Results {
            samples: vec![Vec::new(); Load::ALL.len()],
            failed: None,
            command: String::new(),
            stops: Vec::new(),
            multi_conn: None,
        })
        .collect();
    let idx = |s: Server| servers.iter().position(|&x| x == s).expect("listed");
    // The server that last wrote the read-back region, if it passed.
    let mut previous: Option<Server> = None;
    for run in 0..runs {
        // Each run starts with the next server: no server always goes first.
        let order: Vec<Server> = (0..servers.len())
            .map(|i| servers[(i + run) % servers.len()])
            .collect();
        for &s in &order {
            if results[idx(s)].failed.is_some() {
                continue;
            }
            progress("nbd", format!("run {}/{runs}: {}", run + 1, s.label()));
            let (mut r, line) = start_server(s, &tools, iopages_bin, &f)?;
            results[idx(s)].command = line;
            if results[idx(s)].multi_conn.is_none() {
                results[idx(s)].multi_conn = run_tool(
                    &tools.nbdinfo,
                    &os(&[&"--can", &"multi-conn", &r.uri]),
                    &work,
                    Duration::from_secs(30),
                )
                .ok()
                .and_then(|c| match c.status.code() {
                    Some(0) => Some(true),
                    Some(2) => Some(false),
                    _ => None,
                });
            }
            let m = measure(&mut r, &tools, &f, &plan, previous);
            let stopped = r.stop();
            drop(r);
            sync_file(&f.image);
            results[idx(s)].stops.push(stopped);
            match m {
                Ok((v, on_previous)) => {
                    if let Some(fl) = on_previous {
                        progress(
                            "nbd",
                            format!("  FAILED ({}): {}", fl.server.label(), fl.why),
                        );
                        results[idx(fl.server)].failed.get_or_insert(fl.why);
                    }
                    for (l, sample) in v.into_iter().enumerate() {
                        results[idx(s)].samples[l].push(sample);
                    }
                    let res = &results[idx(s)];
                    progress(
                        "nbd",
                        format!(
                            "  {}: {}",
                            s.label(),
                            Load::ALL
                                .iter()
                                .enumerate()
                                .map(|(l, load)| {
                                    let x = res.samples[l].last().expect("pushed");
                                    match x.iops {
                                        Some(i) if *load == Load::RandRw => {
                                            format!("{} {i:.0} IOPS", load.short())
                                        }
                                        _ => format!("{} {:.0} MiB/s", load.short(), x.mib_s),
                                    }
                                })
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                    previous = Some(s);
                }
                Err(fl) => {
                    progress(
                        "nbd",
                        format!("  FAILED ({}): {}", fl.server.label(), fl.why),
                    );
                    results[idx(fl.server)].failed.get_or_insert(fl.why);
                    previous = None;
                }
            }
        }
    }

    report(
        opts, &servers, &results, &plan, runs, &fs, &json_path, &svg_path,
    )
}

/// Median figure of `s` for `load` (IOPS for randrw, MiB/s otherwise).
fn figure(res: &Results, load: Load) -> Option<f64> {
    let l = Load::ALL.iter().position(|&x| x == load).expect("listed");
    if load == Load::RandRw {
        res.median_iops(l)
    } else {
        res.median_mib(l)
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    opts: &BenchOptions,
    servers: &[Server],
    results: &[Results],
    plan: &Plan,
    runs: usize,
    fs: &str,
    json_path: &Path,
    svg_path: &Path,
) -> Result<Value, BenchError> {
    let res = |s: Server| servers.iter().position(|&x| x == s).map(|i| &results[i]);
    let fig = |s: Server, load: Load| res(s).and_then(|r| figure(r, load));
    println!();
    println!(
        "nbd (E6): one LUKS1 image (aes-xts-plain64, 512-bit key), {} MiB payload on {fs}, served over a Unix socket; median of {runs} run(s)",
        plan.dev / MIB
    );
    println!(
        "{:<22} | {:<24} | {:>8} {:>13} | {:>8}",
        "server", "load", "MiB/s", "min-max", "IOPS"
    );
    for (i, &s) in servers.iter().enumerate() {
        let r = &results[i];
        if let Some(why) = &r.failed {
            println!("{:<22} | FAILED: {why}", s.label());
            continue;
        }
        if r.samples[0].is_empty() {
            println!("{:<22} | no figures", s.label());
            continue;
        }
        for (l, load) in Load::ALL.iter().enumerate() {
            let v: Vec<f64> = r.samples[l].iter().map(|x| x.mib_s).collect();
            let (lo, hi) = (
                v.iter().cloned().fold(f64::INFINITY, f64::min),
                v.iter().cloned().fold(0.0, f64::max),
            );
            println!(
                "{:<22} | {:<24} | {:>8.0} {:>13} | {:>8}",
                s.label(),
                load.label(),
                r.median_mib(l).unwrap_or(0.0),
                format!("{lo:.0}-{hi:.0}"),
                r.median_iops(l)
                    .map_or_else(|| "-".to_string(), |x| format!("{x:.0}"))
            );
        }
    }
    // Ours over the best peer that did not fail, per load.
    let ratio = |load: Load| -> Option<(f64, Server)> {
        let ours = fig(Server::Ours, load)?;
        let (best, who) = [Server::Nbdkit, Server::Qemu]
            .iter()
            .filter_map(|&p| fig(p, load).map(|v| (v, p)))
            .max_by(|a, b| a.0.total_cmp(&b.0))?;
        Some((ours / best, who))
    };
    let ratios: Vec<(Load, Option<(f64, Server)>)> =
        Load::ALL.iter().map(|&l| (l, ratio(l))).collect();
    for (l, r) in &ratios {
        match r {
            Some((x, who)) => println!(
                "ratio ours / best peer, {}: {x:.2} (best peer {})",
                l.short(),
                who.label()
            ),
            None => println!("ratio ours / best peer, {}: - (no figure)", l.short()),
        }
    }
    let min_ratio = ratios
        .iter()
        .map(|(_, r)| r.map(|x| x.0))
        .try_fold(f64::INFINITY, |m, r| r.map(|x| m.min(x)));
    let target_met = min_ratio.is_some_and(|m| m >= TARGET_RATIO);
    println!(
        "target every ratio >= {TARGET_RATIO}: min {} ({})",
        min_ratio.map_or_else(|| "-".into(), |m| format!("{m:.2}")),
        met(target_met)
    );

    bar_plot(svg_path, servers, results)?;

    let rows: Vec<Value> = servers
        .iter()
        .enumerate()
        .flat_map(|(i, &s)| {
            let r = &results[i];
            Load::ALL.iter().enumerate().map(move |(l, load)| {
                json!({
                    "server": s.key(),
                    "load": load.key(),
                    "describe": load.label(),
                    "mib_s": r.median_mib(l).map(round2),
                    "iops": r.median_iops(l).map(round2),
                    "runs_mib_s": r.samples[l].iter().map(|x| round2(x.mib_s)).collect::<Vec<_>>(),
                    "runs_iops": r.samples[l].iter().map(|x| x.iops.map(round2)).collect::<Vec<_>>(),
                })
            })
        })
        .collect();
    let server_info: serde_json::Map<String, Value> = servers
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let r = &results[i];
            (
                s.key().to_string(),
                json!({
                    "label": s.label(),
                    "command": r.command,
                    "advertises_multi_conn": r.multi_conn,
                    "failed": r.failed,
                    "stops": r.stops,
                }),
            )
        })
        .collect();
    let mut summary = serde_json::Map::new();
    let put = |m: &mut serde_json::Map<String, Value>, k: String, v: Option<f64>| {
        m.insert(k, v.map(round2).into());
    };
    for (load, name, unit) in [
        (Load::SeqWrite, "write", "mib_s"),
        (Load::SeqRead, "read", "mib_s"),
        (Load::RandRw, "randrw", "iops"),
        (Load::CopyRead, "nbdcopy_read", "mib_s"),
        (Load::CopyWrite, "nbdcopy_write", "mib_s"),
    ] {
        for s in Server::ALL {
            put(
                &mut summary,
                format!("{}_{name}_{unit}", s.key()),
                fig(s, load),
            );
        }
        let r = ratios.iter().find(|(l, _)| *l == load).and_then(|x| x.1);
        let key = if load == Load::RandRw {
            "randrw_iops_ratio_vs_best_peer".to_string()
        } else {
            format!("{name}_ratio_vs_best_peer")
        };
        summary.insert(key, r.map(|x| x.0).into());
    }
    summary.insert("min_ratio_vs_best_peer".into(), min_ratio.into());
    summary.insert("target_ratio".into(), TARGET_RATIO.into());
    summary.insert("target_met".into(), target_met.into());
    let failed: serde_json::Map<String, Value> = servers
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            results[i]
                .failed
                .clone()
                .map(|w| (s.key().to_string(), w.into()))
        })
        .collect();
    summary.insert("failed".into(), failed.clone().into());
    let report = json!({
        "experiment": "E6 nbd",
        "machine": crate::machine(),
        "settings": {
            "runs": runs,
            "quick": opts.quick,
            "export_bytes": plan.dev,
            "image": "LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000 PBKDF2 iterations; every payload byte written before the runs (no holes)",
            "file_system": fs,
            "page_cache": "every server reads and writes the image through the page cache (buffered I/O); nothing asks for a flush; the image is synced to disk between servers",
            "transport": "Unix socket, one per server",
            "fio": {
                "engine": "nbd (libnbd)",
                "seconds_per_load": plan.fio_ms as f64 / 1000.0,
                "seq": format!("1 MiB, iodepth {SEQ_DEPTH}, 1 job (1 connection), time based over the whole export"),
                "randrw": format!("4 KiB, 50 % reads, iodepth {RAND_DEPTH}, {RAND_JOBS} jobs (connections), time based"),
            },
            "nbdcopy": "defaults (4 connections where the server advertises multi-conn, else 1; threads = CPUs; 256 KiB requests); read: --no-extents export -> null:, write: a data file of the export's size -> export, no --flush",
            "check": format!("each server first checks with fio verify_only the last {} MiB the previous server wrote with crc32c verify headers, then writes and checks them itself after its loads", VERIFY_BYTES / MIB),
            "order": "each run starts with the next server in turn",
        },
        "servers": server_info,
        "rows": rows,
        "summary": summary,
    });
    write_json(json_path, &report)?;
    progress(
        "nbd",
        format!("wrote {} and {}", json_path.display(), svg_path.display()),
    );
    if !failed.is_empty() {
        return Err(workload(format!(
            "{} failed (report written to {}): {}",
            failed.keys().cloned().collect::<Vec<_>>().join(", "),
            json_path.display(),
            failed
                .iter()
                .map(|(k, v)| format!("{k}: {}", v.as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join("; ")
        )));
    }
    Ok(report)
}

/// Grouped bars: MiB/s of the four bandwidth loads on the left, randrw
/// IOPS on the right, one bar per server. Failed servers have no bars.
fn bar_plot(path: &Path, servers: &[Server], results: &[Results]) -> Result<(), BenchError> {
    let err = |e: &dyn std::fmt::Display| BenchError::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
    }
    let colors = [BLUE, RED, GREEN];
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(
            "E6: one LUKS1 image served over NBD (median)",
            ("sans-serif", 20),
        )
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(760);
    let panels: [(&[Load], &str, _); 2] = [
        (
            &[
                Load::SeqWrite,
                Load::SeqRead,
                Load::CopyRead,
                Load::CopyWrite,
            ],
            "MiB/s",
            left,
        ),
        (&[Load::RandRw], "IOPS (4 KiB, 50 % reads)", right),
    ];
    for (pi, (loads, y_desc, area)) in panels.iter().enumerate() {
        let value = |i: usize, load: Load| figure(&results[i], load);
        let y_max = loads
            .iter()
            .flat_map(|&l| (0..servers.len()).filter_map(move |i| value(i, l)))
            .fold(1.0f64, f64::max)
            * 1.35;
        let n = loads.len() as f64;
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..y_max)
            .map_err(|e| err(&e))?;
        let names: Vec<&str> = loads.iter().map(|l| l.short()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(loads.len())
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
                    names[i as usize].to_string()
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| format!("{y:.0}"))
            .y_desc(*y_desc)
            .draw()
            .map_err(|e| err(&e))?;
        let width = 0.8 / servers.len() as f64;
        for (si, &s) in servers.iter().enumerate() {
            let color = colors[si % colors.len()];
            let bars: Vec<Rectangle<(f64, f64)>> = loads
                .iter()
                .enumerate()
                .filter_map(|(li, &l)| {
                    let v = value(si, l)?;
                    let x0 = li as f64 - 0.4 + si as f64 * width;
                    Some(Rectangle::new(
                        [(x0, 0.0), (x0 + width * 0.9, v)],
                        color.filled(),
                    ))
                })
                .collect();
            let drawn = chart.draw_series(bars).map_err(|e| err(&e))?;
            if pi == 0 {
                drawn.label(s.label()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
            }
        }
        if pi == 0 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fio 3.33 with the nbd engine against nbdkit's luks filter, randrw
    /// 4 KiB, 2 jobs, group_reporting (trimmed to the fields read; the
    /// engine's line comes first on stdout).
    const RANDRW: &str = r#"fio: connected to NBD server
{
  "fio version" : "fio-3.33",
  "timestamp" : 1795397131,
  "jobs" : [
    {
      "jobname" : "rr",
      "groupid" : 0,
      "error" : 0,
      "job options" : { "name" : "rr", "ioengine" : "nbd", "rw" : "randrw", "bs" : "4k", "iodepth" : "32", "numjobs" : "2" },
      "job_runtime" : 6006,
      "read" : { "io_bytes" : 188854272, "bw_bytes" : 62825772, "bw" : 61353, "iops" : 15338.323353, "runtime" : 3006, "total_ios" : 46107, "short_ios" : 0, "drop_ios" : 0 },
      "write" : { "io_bytes" : 189145088, "bw_bytes" : 62922517, "bw" : 61447, "iops" : 15361.942781, "runtime" : 3006, "total_ios" : 46178, "short_ios" : 0, "drop_ios" : 0 },
      "trim" : { "io_bytes" : 0, "bw_bytes" : 0, "bw" : 0, "iops" : 0.0, "runtime" : 0, "total_ios" : 0, "short_ios" : 0, "drop_ios" : 0 }
    }
  ]
}
"#;

    /// fio verify_only over data another server had overwritten: error 84
    /// (EILSEQ) in the job.
    const VERIFY_FAILED: &str = r#"fio: connected to NBD server
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "verify",
      "groupid" : 0,
      "error" : 84,
      "read" : { "io_bytes" : 524288, "bw_bytes" : 174762666, "iops" : 2666.666667 },
      "write" : { "io_bytes" : 16777216, "bw_bytes" : 0, "iops" : 0.0 }
    }
  ]
}
"#;

    #[test]
    fn parses_fio_randrw() {
        let f = parse_fio(RANDRW).unwrap();
        assert_eq!(f.jobs, 1);
        assert_eq!(f.read_bytes, 188_854_272);
        assert_eq!(f.write_bytes, 189_145_088);
        assert_eq!(f.read_bw, 62_825_772.0);
        assert_eq!(f.write_bw, 62_922_517.0);
        assert!((f.read_iops + f.write_iops - 30_700.266_134).abs() < 1e-3);
    }

    #[test]
    fn sums_jobs_without_group_reporting() {
        let two = r#"{"jobs": [
            {"jobname": "a", "error": 0, "read": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0},
             "write": {"io_bytes": 1048576, "bw_bytes": 1000, "iops": 10.5}},
            {"jobname": "a", "error": 0, "read": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0},
             "write": {"io_bytes": 2097152, "bw_bytes": 3000, "iops": 20.0}}
        ]}"#;
        let f = parse_fio(two).unwrap();
        assert_eq!(f.jobs, 2);
        assert_eq!(f.write_bytes, 3 << 20);
        assert_eq!(f.write_bw, 4000.0);
        assert_eq!(f.write_iops, 30.5);
        assert_eq!(f.read_bytes, 0);
    }

    #[test]
    fn job_error_is_an_error() {
        let e = parse_fio(VERIFY_FAILED).unwrap_err();
        assert!(e.contains("error 84"), "{e}");
        assert!(e.contains("verify"), "{e}");
    }

    #[test]
    fn engine_error_is_an_error() {
        // A server that dropped the connection: libnbd's error comes as -1,
        // printed unsigned.
        let dead = r#"{"jobs": [{"jobname": "e6-seq_read", "error": 4294967295,
            "read": {"io_bytes": 1048576, "bw_bytes": 5, "iops": 1.0}}]}"#;
        let e = parse_fio(dead).unwrap_err();
        assert!(e.contains("e6-seq_read failed: error -1"), "{e}");
    }

    #[test]
    fn missing_or_broken_reports_are_errors() {
        assert!(parse_fio("fio: engine nbd not loadable\n").is_err());
        assert!(parse_fio("{\"jobs\": []}").is_err());
        assert!(parse_fio("{\"jobs\": [{\"jobname\": \"x\"}]}").is_err());
        assert!(parse_fio("fio: connected\n{\"jobs\": [").is_err());
    }

    #[test]
    fn parses_luks_dump_and_nbdinfo() {
        let dump = "LUKS header information for img\n\nVersion:       \t1\nCipher name:   \taes\nCipher mode:   \txts-plain64\nHash spec:     \tsha256\nPayload offset:\t4096\nMK bits:       \t512\n";
        assert_eq!(parse_payload_offset(dump), Some(2 << 20));
        assert_eq!(parse_payload_offset("Version: 2\n"), None);
        assert_eq!(parse_size("134217728\n"), Some(134_217_728));
        assert_eq!(parse_size("nbdinfo: error\n"), None);
        assert_eq!(qemu_escape(Path::new("/a,b/img")), "/a,,b/img");
    }
}
