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

use crate::harness::{Chart, Plot, PlotFile, Report, Table};
use crate::measure::median;
use crate::plot::{BarPanel, Bars};
use crate::{met, progress, round2, BenchError, BenchOptions};
/// The test certificates of `bench nbd --tls`, where the tests have always
/// found them (they live in `iopages-tools`).
pub use iopages_tools::pki::{write_pki, write_psk, Pki};
use iopages_tools::{die_with_parent, find_tool, run_tool, stop, tail_lines, wait_for_socket};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub(crate) const MIB: u64 = 1 << 20;
/// The volume's passphrase (the file holds exactly these bytes, no newline:
/// cryptsetup's `--key-file` takes the whole file).
const PASSPHRASE: &[u8] = b"iopages-e6-bench-passphrase";
/// LUKS1 with a 512-bit key puts the payload at sector 4096 (2 MiB).
pub(crate) const LUKS_HEADER_BYTES: u64 = 2 << 20;
/// Export name `iopages serve` is given (nbdkit and qemu-nbd export "").
pub(crate) const OUR_EXPORT: &str = "iopages";
/// Sequential loads: 1 MiB requests, 16 in flight, one connection.
pub(crate) const SEQ_DEPTH: u32 = 16;
/// Random load: 4 KiB, 50 % reads, 32 in flight on each of 2 connections.
pub(crate) const RAND_DEPTH: u32 = 32;
pub(crate) const RAND_JOBS: u32 = 2;
/// The region at the end of the export each server writes with fio's
/// verify headers for the next server to check.
pub(crate) const VERIFY_BYTES: u64 = 16 << 20;
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(30);
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Target: ours at least this many times the best peer, on every load.
pub(crate) const TARGET_RATIO: f64 = 2.0;

pub(crate) fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd: {e}"))
}

/// The servers, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Server {
    Ours,
    /// With `--tls`: ours again without TLS, for TLS's cost side by side.
    OursPlain,
    /// The sparse copy (`sparse.rs`): ours with `--allow-discards` (holes
    /// reported and read as zeros).
    OursDiscards,
    Nbdkit,
    Qemu,
}

impl Server {
    const ALL: [Server; 3] = [Server::Ours, Server::Nbdkit, Server::Qemu];
    /// With `--tls`: every server with TLS, and ours also without.
    const ALL_TLS: [Server; 4] = [
        Server::Ours,
        Server::OursPlain,
        Server::Nbdkit,
        Server::Qemu,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Server::Ours => "ours",
            Server::OursPlain => "ours_plaintext",
            Server::OursDiscards => "ours_discards",
            Server::Nbdkit => "nbdkit",
            Server::Qemu => "qemu",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Server::Ours => "iopages serve",
            Server::OursPlain => "iopages serve, no TLS",
            Server::OursDiscards => "iopages serve --allow-discards",
            Server::Nbdkit => "nbdkit luks filter",
            Server::Qemu => "qemu-nbd luks driver",
        }
    }

    pub(crate) fn is_ours(self) -> bool {
        matches!(
            self,
            Server::Ours | Server::OursPlain | Server::OursDiscards
        )
    }

    /// With TLS in a `--tls` run (all but `OursPlain`).
    fn tls(self, tls: Option<&TlsSetup>) -> Option<&TlsSetup> {
        tls.filter(|_| self != Server::OursPlain)
    }

    /// The URI nbdinfo and nbdcopy connect to: with TLS, `nbds+unix` and
    /// the client's certificate directory.
    fn uri(self, sock: &Path, tls: Option<&TlsSetup>) -> String {
        let name = if self.is_ours() { OUR_EXPORT } else { "" };
        match self.tls(tls) {
            None => format!("nbd+unix:///{name}?socket={}", sock.display()),
            Some(t) => format!(
                "nbds+unix:///{name}?socket={}&tls-certificates={}",
                sock.display(),
                t.pki.client.display()
            ),
        }
    }

    /// The URI fio's nbd engine connects to. fio 3.33 does not let libnbd
    /// read files the URI names (no nbd_set_uri_allow_local_file: "local
    /// file access (tls-certificates) is not allowed"), so with TLS it names
    /// none: libnbd takes its default certificate directory
    /// (`$HOME/.pki/libnbd`, which `TlsSetup::home` provides; root's is
    /// /etc/pki/libnbd, which the bench leaves alone) or the system's CAs.
    /// Over a Unix socket libnbd does not check the server's certificate,
    /// and no server asks for the client's (`TLS_VERIFY_PEER`).
    fn fio_uri(self, sock: &Path, tls: Option<&TlsSetup>) -> String {
        let name = if self.is_ours() { OUR_EXPORT } else { "" };
        let scheme = if self.tls(tls).is_some() {
            "nbds+unix"
        } else {
            "nbd+unix"
        };
        format!("{scheme}:///{name}?socket={}", sock.display())
    }
}

/// The certificates of a `--tls` run.
pub struct TlsSetup {
    /// The servers', the clients' (and unused others).
    pki: Pki,
    /// `HOME` for fio: `.pki/libnbd` holds the client's certificates.
    home: PathBuf,
}

/// Whether the servers ask for the client's certificate: no, as fio (run
/// by root) can present none (see `Server::fio_uri`). The check costs one
/// signature per connection's handshake, nothing per request.
const TLS_VERIFY_PEER: bool = false;
/// TLS target: ours with TLS at least this fraction of ours without.
const TLS_TARGET_FRACTION: f64 = 0.85;

impl TlsSetup {
    /// Certificates under `dir`, and fio's `HOME` with the client's.
    fn make(dir: &Path) -> Result<TlsSetup, String> {
        let pki = write_pki(dir)?;
        let home = dir.join("home");
        let libnbd = home.join(".pki/libnbd");
        std::fs::create_dir_all(&libnbd)
            .map_err(|e| format!("cannot create {}: {e}", libnbd.display()))?;
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            std::fs::copy(pki.client.join(f), libnbd.join(f))
                .map_err(|e| format!("cannot copy {f} into {}: {e}", libnbd.display()))?;
        }
        Ok(TlsSetup { pki, home })
    }
}

/// The loads, in the order each server runs them (E6 and E6 remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Load {
    SeqWrite,
    SeqRead,
    RandRw,
    CopyRead,
    CopyWrite,
}

impl Load {
    pub(crate) const ALL: [Load; 5] = [
        Load::SeqWrite,
        Load::SeqRead,
        Load::RandRw,
        Load::CopyRead,
        Load::CopyWrite,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Load::SeqWrite => "seq_write",
            Load::SeqRead => "seq_read",
            Load::RandRw => "randrw",
            Load::CopyRead => "nbdcopy_read",
            Load::CopyWrite => "nbdcopy_write",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Load::SeqWrite => "fio seq write 1M qd16",
            Load::SeqRead => "fio seq read 1M qd16",
            Load::RandRw => "fio randrw 4K 2x qd32",
            Load::CopyRead => "nbdcopy export -> null",
            Load::CopyWrite => "nbdcopy file -> export",
        }
    }

    /// The figure compared: IOPS for the random load, MiB/s otherwise.
    pub(crate) fn unit(self) -> &'static str {
        if self == Load::RandRw {
            "IOPS"
        } else {
            "MiB/s"
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
pub(crate) struct Sample {
    pub(crate) mib_s: f64,
    /// Requests per second (fio only; nbdcopy sizes its own requests).
    pub(crate) iops: Option<f64>,
}

impl Sample {
    /// The figure compared for `load`: IOPS for the random load, MiB/s
    /// otherwise.
    pub(crate) fn figure(&self, load: Load) -> f64 {
        match (load, self.iops) {
            (Load::RandRw, Some(i)) => i,
            _ => self.mib_s,
        }
    }
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
pub(crate) fn parse_size(stdout: &str) -> Option<u64> {
    stdout.trim().parse().ok()
}

/// `cryptsetup luksDump`'s payload offset, in bytes.
pub(crate) fn parse_payload_offset(dump: &str) -> Option<u64> {
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
    let t = tail_lines(&s);
    if t.is_empty() {
        "(nothing on stderr)".into()
    } else {
        t
    }
}

pub(crate) fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// The outside programs E6 runs (the peers' only when they run).
pub(crate) struct Tools {
    pub(crate) cryptsetup: PathBuf,
    pub(crate) fio: PathBuf,
    pub(crate) nbdcopy: PathBuf,
    pub(crate) nbdinfo: PathBuf,
    pub(crate) nbdkit: PathBuf,
    pub(crate) qemu_nbd: PathBuf,
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
            let ok = run_tool(prog, &args, dir, Duration::from_secs(30), &[])
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
pub(crate) struct Running {
    server: Server,
    child: Option<Child>,
    pub(crate) uri: String,
    /// fio's URI (see `Server::fio_uri`).
    fio_uri: String,
    /// fio's `HOME` with TLS.
    home: Option<PathBuf>,
    err_log: PathBuf,
}

impl Running {
    /// Err if the server has exited.
    pub(crate) fn alive(&mut self) -> Result<(), String> {
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
    pub(crate) fn stop(&mut self) -> String {
        match self.child.take() {
            Some(mut child) => stop(&mut child, STOP_TIMEOUT),
            None => "not running".into(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Paths of one bench run.
pub(crate) struct Files {
    /// Image, source file, logs: under the report's directory.
    pub(crate) work: PathBuf,
    /// Unix sockets: under the temporary directory (socket paths are short).
    pub(crate) socks: PathBuf,
    pub(crate) image: PathBuf,
    pub(crate) pass: PathBuf,
    pub(crate) source: PathBuf,
    /// With `--tls`.
    pub(crate) tls: Option<TlsSetup>,
    /// Every server exports the image read-only (the sparse copy's).
    pub(crate) read_only: bool,
}

/// Checks that `iopages_bin` exists, then makes afresh the work
/// directory `TAG-work-PID` beside the report `json_path` and the
/// sockets' directory `iopages-TAG-PID` under the temporary directory.
/// Returns the work directory (canonical), the sockets' and what removes
/// both when dropped: bind it before starting any server.
pub(crate) fn work_dirs(
    iopages_bin: &Path,
    json_path: &Path,
    tag: &str,
) -> Result<(PathBuf, PathBuf, RemoveDirs), BenchError> {
    if !iopages_bin.is_file() {
        return Err(workload(format!(
            "{} not found: build it (cargo build --release -p iopages-cli)",
            iopages_bin.display()
        )));
    }
    let report_dir = json_path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let pid = std::process::id();
    let work = report_dir.join(format!("{tag}-work-{pid}"));
    let socks = std::env::temp_dir().join(format!("iopages-{tag}-{pid}"));
    let mk = |d: &Path| {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).map_err(|e| BenchError::Write {
            path: d.to_path_buf(),
            source: e,
        })
    };
    let dirs = RemoveDirs(vec![work.clone(), socks.clone()]);
    mk(&work)?;
    mk(&socks)?;
    let work = work.canonicalize().unwrap_or(work);
    Ok((work, socks, dirs))
}

/// Removes the directories it holds when dropped.
pub(crate) struct RemoveDirs(pub(crate) Vec<PathBuf>);

impl Drop for RemoveDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// How a server is started.
pub(crate) fn server_command(
    s: Server,
    tools: &Tools,
    ours: &Path,
    f: &Files,
    sock: &Path,
) -> Command {
    let mut cmd;
    let tls = s.tls(f.tls.as_ref());
    match s {
        Server::Ours | Server::OursPlain | Server::OursDiscards => {
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
            if s == Server::OursDiscards {
                cmd.arg("--allow-discards");
            }
            if f.read_only {
                cmd.arg("--read-only");
            }
            if let Some(t) = tls {
                cmd.args(["--tls", "require", "--tls-certificates"])
                    .arg(&t.pki.server);
                if TLS_VERIFY_PEER {
                    cmd.arg("--tls-verify-peer");
                }
            }
        }
        Server::Nbdkit => {
            cmd = Command::new(&tools.nbdkit);
            cmd.arg("--foreground")
                .arg("--exit-with-parent")
                .arg("--unix")
                .arg(sock);
            if f.read_only {
                cmd.arg("--readonly");
            }
            if let Some(t) = tls {
                cmd.arg("--tls=require")
                    .arg(format!("--tls-certificates={}", t.pki.server.display()));
                if TLS_VERIFY_PEER {
                    cmd.arg("--tls-verify-peer");
                }
            }
            cmd.arg("--filter=luks")
                .arg("file")
                .arg(format!("file={}", f.image.display()))
                .arg(format!("passphrase=+{}", f.pass.display()));
        }
        Server::Qemu => {
            cmd = Command::new(&tools.qemu_nbd);
            if let Some(t) = tls {
                cmd.arg("--object")
                    .arg(format!(
                        "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer={}",
                        qemu_escape(&t.pki.server),
                        if TLS_VERIFY_PEER { "on" } else { "off" }
                    ))
                    .arg("--tls-creds")
                    .arg("tls0");
            }
            cmd.arg("--object")
                .arg(format!("secret,id=sec0,file={}", qemu_escape(&f.pass)))
                .arg("--image-opts")
                .arg(format!(
                    "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
                    qemu_escape(&f.image)
                ))
                .arg("--socket")
                .arg(sock);
            if f.read_only {
                cmd.arg("--read-only");
            }
            cmd.arg("--persistent")
                .arg("--shared=0")
                .arg("--cache=writeback")
                .arg("--aio=io_uring");
        }
    }
    cmd
}

pub(crate) fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A server's standard output and error logs in `work`, named by `tag`.
pub(crate) fn logs_in(work: &Path, tag: &str) -> (PathBuf, PathBuf) {
    (
        work.join(format!("{tag}.out")),
        work.join(format!("{tag}.err")),
    )
}

/// Spawn `cmd` in `work` with no input, its output and errors written to
/// `out` and `err`, killed (SIGTERM) if this process dies first.
pub(crate) fn spawn_logged(
    cmd: &mut Command,
    work: &Path,
    out: &Path,
    err: &Path,
) -> Result<std::process::Child, String> {
    let file = |p: &Path| {
        std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))
    };
    cmd.current_dir(work)
        .stdin(Stdio::null())
        .stdout(file(out)?)
        .stderr(file(err)?);
    die_with_parent(cmd, libc::SIGTERM);
    cmd.spawn().map_err(|e| e.to_string())
}

/// Start `s` and wait until its socket takes connections.
pub(crate) fn start_server(
    s: Server,
    tools: &Tools,
    ours: &Path,
    f: &Files,
) -> Result<(Running, String), BenchError> {
    let sock = f.socks.join(format!("{}.sock", s.key()));
    let _ = std::fs::remove_file(&sock);
    let mut cmd = server_command(s, tools, ours, f, &sock);
    let line = command_line(&cmd);
    let (out_log, err_log) = logs_in(&f.work, s.key());
    let child = spawn_logged(&mut cmd, &f.work, &out_log, &err_log)
        .map_err(|e| workload(format!("cannot start {} ({line}): {e}", s.label())))?;
    let mut r = Running {
        server: s,
        child: Some(child),
        uri: s.uri(&sock, f.tls.as_ref()),
        fio_uri: s.fio_uri(&sock, f.tls.as_ref()),
        home: s.tls(f.tls.as_ref()).map(|t| t.home.clone()),
        err_log,
    };
    let sock_wait = wait_for_socket(&sock, START_TIMEOUT, || r.alive());
    if let Err(e) = sock_wait {
        // An exit's reason carries the stderr already; a silent server's not.
        let stderr = match e.starts_with("did not listen") {
            true => format!("; stderr: {}", tail(&r.err_log)),
            false => String::new(),
        };
        let why = format!("{} did not start: {e}{stderr} (command: {line})", s.label());
        r.stop();
        return Err(workload(why));
    }
    Ok((r, line))
}

/// Settings of the loads.
pub(crate) struct Plan {
    /// Export size, bytes.
    pub(crate) dev: u64,
    /// Each timed fio job's run time, ms.
    pub(crate) fio_ms: u64,
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

    pub(crate) fn fio_args(&self, uri: &str, load: Load) -> Vec<OsString> {
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
    pub(crate) fn verify_args(&self, uri: &str, only: bool) -> Vec<OsString> {
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

/// Run fio (with `HOME` at `home` where given), check its exit status and
/// every job's error field.
/// fio over the verify region at the end of the export at `uri` (see
/// [`Plan::verify_args`]): write it with verify headers, or (`only`) check
/// what another server wrote there. **Returns:** an error unless fio ran
/// and covered the whole region.
pub(crate) fn verify_region(
    fio_bin: &Path,
    dir: &Path,
    home: Option<&Path>,
    plan: &Plan,
    uri: &str,
    only: bool,
) -> Result<(), String> {
    let v = fio(fio_bin, dir, home, plan.verify_args(uri, only), 10_000)?;
    (v.read_bytes == VERIFY_BYTES)
        .then_some(())
        .ok_or(format!("checked {} of {VERIFY_BYTES} bytes", v.read_bytes))
}

pub(crate) fn fio(
    fio: &Path,
    dir: &Path,
    home: Option<&Path>,
    args: Vec<OsString>,
    ms: u64,
) -> Result<FioFigures, String> {
    let env: Vec<(&str, &Path)> = home.map(|h| ("HOME", h)).into_iter().collect();
    let r = run_tool(fio, &args, dir, Duration::from_millis(ms + 120_000), &env)?;
    let parsed = parse_fio(&r.stdout);
    match (r.status.success(), parsed) {
        (true, Ok(f)) => Ok(f),
        (_, Err(e)) => Err(format!(
            "{e}; fio {}; stderr: {}",
            r.status,
            tail_lines(&r.stderr)
        )),
        (false, Ok(_)) => Err(format!(
            "fio {}; stderr: {}",
            r.status,
            tail_lines(&r.stderr)
        )),
    }
}

/// A failure while measuring, and whom it is put on.
struct Failure {
    server: Server,
    why: String,
}

/// One timed load against the server `r`.
///
/// **Returns:** its figure, or why the tool failed or moved no data.
fn load_sample(
    r: &Running,
    tools: &Tools,
    f: &Files,
    plan: &Plan,
    load: Load,
) -> Result<Sample, String> {
    let at = LoadTarget {
        fio: &tools.fio,
        nbdcopy: &tools.nbdcopy,
        work: &f.work,
        home: r.home.as_deref(),
        fio_uri: &r.fio_uri,
        uri: &r.uri,
        source: &f.source,
    };
    load_sample_at(&at, plan, load)
}

/// Where one timed load runs: fio and nbdcopy, the working directory, fio's `HOME` (TLS
/// credentials) where needed, fio's and nbdcopy's URIs of the export, and
/// the file nbdcopy writes into it.
pub(crate) struct LoadTarget<'a> {
    pub(crate) fio: &'a Path,
    pub(crate) nbdcopy: &'a Path,
    pub(crate) work: &'a Path,
    pub(crate) home: Option<&'a Path>,
    pub(crate) fio_uri: &'a str,
    pub(crate) uri: &'a str,
    pub(crate) source: &'a Path,
}

/// One timed load at `at` (E6 and E6 remote).
///
/// **Returns:** its figure, or why the tool failed or moved no data.
pub(crate) fn load_sample_at(at: &LoadTarget, plan: &Plan, load: Load) -> Result<Sample, String> {
    Ok(match load {
        Load::SeqWrite | Load::SeqRead | Load::RandRw => {
            let v = fio(
                at.fio,
                at.work,
                at.home,
                plan.fio_args(at.fio_uri, load),
                plan.fio_ms,
            )
            .map_err(|e| format!("{}: {e}", load.label()))?;
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
                return Err(format!("{}: fio moved no data", load.label()));
            }
            Sample {
                mib_s: bw / MIB as f64,
                iops: Some(iops),
            }
        }
        Load::CopyRead | Load::CopyWrite => {
            let args = if load == Load::CopyRead {
                // Extents off: read every block, holes or not.
                os(&[&"--no-extents", &at.uri, &"null:"])
            } else {
                os(&[&at.source, &at.uri])
            };
            // A generous limit (2 MiB/s): a remote store is slower than a
            // local file.
            let timeout = Duration::from_secs(60 + plan.dev / (2 * MIB));
            let c = run_tool(at.nbdcopy, &args, at.work, timeout, &[])
                .map_err(|e| format!("{}: {e}", load.label()))?;
            if !c.status.success() {
                return Err(format!(
                    "{}: nbdcopy {}; stderr: {}",
                    load.label(),
                    c.status,
                    tail_lines(&c.stderr)
                ));
            }
            Sample {
                mib_s: plan.dev as f64 / MIB as f64 / c.secs,
                iops: None,
            }
        }
    })
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
        &[],
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
            tail_lines(&info.stderr)
        )));
    }
    let mut on_previous = None;
    if let Some(p) = previous {
        let v = verify_region(
            &tools.fio,
            &f.work,
            r.home.as_deref(),
            plan,
            &r.fio_uri,
            true,
        );
        if let Err(e) = v {
            let why = format!(
                "{} did not read back what {} wrote (fio verify_only): {e}",
                s.label(),
                p.label()
            );
            // The peers agree with cryptsetup; a disagreement that involves
            // ours is put on ours. When that is the previous server, this
            // one goes on.
            if p.is_ours() {
                on_previous = Some(Failure { server: p, why });
            } else {
                return Err(fail(why));
            }
        }
    }
    let mut out = Vec::new();
    for load in Load::ALL {
        let sample = load_sample(r, tools, f, plan, load).map_err(fail)?;
        r.alive()
            .map_err(|e| fail(format!("after {}: {e}", load.label())))?;
        out.push(sample);
    }
    verify_region(
        &tools.fio,
        &f.work,
        r.home.as_deref(),
        plan,
        &r.fio_uri,
        false,
    )
    .map_err(|e| fail(format!("read-back of its own writes (fio verify): {e}")))?;
    r.alive().map_err(fail)?;
    Ok((out, on_previous))
}

/// Fill `path` with `bytes` of pseudo-random data and flush it to disk.
pub(crate) fn fill_file(path: &Path, bytes: u64, seed: u64) -> Result<(), BenchError> {
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

pub(crate) fn sync_file(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// The file system `dir` is on, for the report.
pub(crate) fn fs_type(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: `statfs` is plain old data, for which all zeros is valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is NUL-terminated and outlives the call; statfs
    // writes only into `st`.
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
    run_with(opts, iopages_bin, false)
}

/// The servers of a run, in table order.
fn servers_of(peers: bool, tls: bool) -> Vec<Server> {
    match (peers, tls) {
        (true, false) => Server::ALL.to_vec(),
        (false, false) => vec![Server::Ours],
        (true, true) => Server::ALL_TLS.to_vec(),
        (false, true) => vec![Server::Ours, Server::OursPlain],
    }
}

/// E6, with `tls`: TLS (X.509) on every server — `iopages serve --tls require`, nbdkit `--tls=require`,
/// qemu-nbd `--tls-creds` — and ours also without TLS, side by side; the
/// report goes to `nbd-tls.json` unless `--json` names one.
pub fn run_with(opts: &BenchOptions, iopages_bin: &Path, tls: bool) -> Result<Value, BenchError> {
    let (runs, payload, fio_ms) = if opts.quick {
        (1usize, 128 * MIB, 1500u64)
    } else {
        (3, 1024 * MIB, 5000)
    };
    let servers = servers_of(opts.peers, tls);
    let (json_path, _) = opts.paths(if tls { "nbd-tls" } else { "nbd" });
    // Declared before any server: dropped (removed) after they are stopped.
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, "nbd")?;
    let tools = Tools::find(&work, opts.peers)?;
    let tls = if tls {
        Some(TlsSetup::make(&work.join("tls")).map_err(workload)?)
    } else {
        None
    };
    let f = Files {
        image: work.join("luks1.img"),
        pass: work.join("passphrase"),
        source: work.join("source.bin"),
        work: work.clone(),
        socks,
        tls,
        read_only: false,
    };
    let fs = fs_type(&work);
    progress(
        "nbd",
        format!(
            "E6: {} served in turn over Unix sockets{}, {runs} run(s); one LUKS1 image (aes-xts-plain64, 512-bit key, sha256) of {} MiB payload on {fs} under {}; fio {} s per load",
            servers.iter().map(|s| s.label()).collect::<Vec<_>>().join(", "),
            if f.tls.is_some() { " with TLS (X.509)" } else { "" },
            payload / MIB,
            work.display(),
            fio_ms as f64 / 1000.0
        ),
    );

    let dev = make_image(&tools, &f, payload)?;
    let plan = Plan { dev, fio_ms };
    let results = run_servers(&servers, runs, &tools, iopages_bin, &f, &plan)?;
    let run = Run {
        servers: &servers,
        results: &results,
        plan: &plan,
        runs,
        fs: &fs,
        tls: f.tls.is_some(),
    };
    report(opts, &run, &json_path)
}

/// The volume: data everywhere (no holes to read), then the LUKS header,
/// and the source file of nbdcopy's write. Returns the export's size.
fn make_image(tools: &Tools, f: &Files, payload: u64) -> Result<u64, BenchError> {
    fill_file(&f.image, payload + LUKS_HEADER_BYTES, 0x9E37_79B9_7F4A_7C15)?;
    let dev = luks_format(tools, f)?;
    fill_file(&f.source, dev, 0xD1B5_4A32_D192_ED03)?;
    Ok(dev)
}

/// The passphrase file, then `cryptsetup luksFormat` of the file `f.image`
/// as E6 makes it (LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000
/// PBKDF2 iterations): only the header is written, the payload's bytes are
/// left as they are. Returns the export's size (the file's bytes past the
/// payload offset), with the image synced.
pub(crate) fn luks_format(tools: &Tools, f: &Files) -> Result<u64, BenchError> {
    let write_err = |e| BenchError::Write {
        path: f.pass.clone(),
        source: e,
    };
    std::fs::File::create(&f.pass)
        .and_then(|mut p| p.write_all(PASSPHRASE))
        .map_err(write_err)?;
    let len = std::fs::metadata(&f.image)
        .map_err(|e| BenchError::Write {
            path: f.image.clone(),
            source: e,
        })?
        .len();
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
        &f.work,
        Duration::from_secs(120),
        &[],
    )
    .map_err(workload)?;
    if !fmt.status.success() {
        return Err(workload(format!(
            "cryptsetup luksFormat {}: {}",
            fmt.status,
            tail_lines(&fmt.stderr)
        )));
    }
    let dump = run_tool(
        &tools.cryptsetup,
        &os(&[&"luksDump", &f.image]),
        &f.work,
        Duration::from_secs(60),
        &[],
    )
    .map_err(workload)?;
    let offset = parse_payload_offset(&dump.stdout)
        .ok_or_else(|| workload("cryptsetup luksDump shows no payload offset"))?;
    let dev = len.checked_sub(offset).ok_or_else(|| {
        workload(format!(
            "the image ({len} bytes) ends before its payload offset {offset}"
        ))
    })?;
    sync_file(&f.image);
    Ok(dev)
}

/// Whether the server behind `uri` advertises multi-conn (`None`: nbdinfo
/// could not say).
fn multi_conn(tools: &Tools, uri: &str, work: &Path) -> Option<bool> {
    run_tool(
        &tools.nbdinfo,
        &os(&[&"--can", &"multi-conn", &uri]),
        work,
        Duration::from_secs(30),
        &[],
    )
    .ok()
    .and_then(|c| match c.status.code() {
        Some(0) => Some(true),
        Some(2) => Some(false),
        _ => None,
    })
}

/// The progress line of one server's run: each load's last figure.
fn run_line(s: Server, res: &Results) -> String {
    let figures = Load::ALL
        .iter()
        .enumerate()
        .map(|(l, load)| {
            let x = res.samples[l].last().expect("pushed");
            match x.iops {
                Some(i) if *load == Load::RandRw => format!("{} {i:.0} IOPS", load.short()),
                _ => format!("{} {:.0} MiB/s", load.short(), x.mib_s),
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!("  {}: {figures}", s.label())
}

/// Every run: each server in turn (each run starting with the next), its
/// loads measured and checked. A failed server is marked and skipped
/// after; so is the one whose writes the next could not read back.
fn run_servers(
    servers: &[Server],
    runs: usize,
    tools: &Tools,
    iopages_bin: &Path,
    f: &Files,
    plan: &Plan,
) -> Result<Vec<Results>, BenchError> {
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
    let fail = |results: &mut [Results], fl: Failure| {
        progress(
            "nbd",
            format!("  FAILED ({}): {}", fl.server.label(), fl.why),
        );
        results[idx(fl.server)].failed.get_or_insert(fl.why);
    };
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
            let (mut r, line) = start_server(s, tools, iopages_bin, f)?;
            let res = &mut results[idx(s)];
            res.command = line;
            if res.multi_conn.is_none() {
                res.multi_conn = multi_conn(tools, &r.uri, &f.work);
            }
            let m = measure(&mut r, tools, f, plan, previous);
            res.stops.push(r.stop());
            drop(r);
            sync_file(&f.image);
            match m {
                Ok((v, on_previous)) => {
                    for (l, sample) in v.into_iter().enumerate() {
                        res.samples[l].push(sample);
                    }
                    let line = run_line(s, res);
                    if let Some(fl) = on_previous {
                        fail(&mut results, fl);
                    }
                    progress("nbd", line);
                    previous = Some(s);
                }
                Err(fl) => {
                    fail(&mut results, fl);
                    previous = None;
                }
            }
        }
    }
    Ok(results)
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

/// Ours over the best peer, and ours with TLS over ours without, per
/// load, with their minima and targets.
struct Ratios {
    vs_peer: Vec<(Load, Option<(f64, Server)>)>,
    min: Option<f64>,
    target_met: bool,
    tls: Vec<(Load, Option<f64>)>,
    min_tls: Option<f64>,
    tls_target_met: bool,
}

/// The smallest of `v`, `None` if any is missing.
fn min_of(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    v.into_iter()
        .try_fold(f64::INFINITY, |m, r| r.map(|x| m.min(x)))
}

impl Ratios {
    fn of(fig: &dyn Fn(Server, Load) -> Option<f64>) -> Ratios {
        // Ours over the best peer that did not fail, per load.
        let ratio = |load: Load| -> Option<(f64, Server)> {
            let ours = fig(Server::Ours, load)?;
            let (best, who) = [Server::Nbdkit, Server::Qemu]
                .iter()
                .filter_map(|&p| fig(p, load).map(|v| (v, p)))
                .max_by(|a, b| a.0.total_cmp(&b.0))?;
            Some((ours / best, who))
        };
        let vs_peer: Vec<_> = Load::ALL.iter().map(|&l| (l, ratio(l))).collect();
        let min = min_of(vs_peer.iter().map(|(_, r)| r.map(|x| x.0)));
        let tls: Vec<_> = Load::ALL
            .iter()
            .map(
                |&l| match (fig(Server::Ours, l), fig(Server::OursPlain, l)) {
                    (Some(t), Some(p)) if p > 0.0 => (l, Some(t / p)),
                    _ => (l, None),
                },
            )
            .collect();
        let min_tls = min_of(tls.iter().map(|(_, r)| *r));
        Ratios {
            vs_peer,
            target_met: min.is_some_and(|m| m >= TARGET_RATIO),
            min,
            tls,
            tls_target_met: min_tls.is_some_and(|m| m >= TLS_TARGET_FRACTION),
            min_tls,
        }
    }

    fn peer(&self, load: Load) -> Option<f64> {
        self.vs_peer
            .iter()
            .find(|(l, _)| *l == load)
            .and_then(|x| x.1)
            .map(|x| x.0)
    }

    fn tls(&self, load: Load) -> Option<f64> {
        self.tls.iter().find(|(l, _)| *l == load).and_then(|x| x.1)
    }
}

/// What one report is about: the servers, their results and the run.
struct Run<'a> {
    servers: &'a [Server],
    results: &'a [Results],
    plan: &'a Plan,
    runs: usize,
    fs: &'a str,
    tls: bool,
}

impl Run<'_> {
    fn fig(&self, s: Server, load: Load) -> Option<f64> {
        let i = self.servers.iter().position(|&x| x == s)?;
        figure(&self.results[i], load)
    }
}

fn report(opts: &BenchOptions, run: &Run, json_path: &Path) -> Result<Value, BenchError> {
    let (servers, results, tls) = (run.servers, run.results, run.tls);
    let ratios = Ratios::of(&|s, l| run.fig(s, l));
    table(run, &ratios).print();
    let title = if tls {
        "E6: one LUKS1 image served over NBD with TLS (median)"
    } else {
        "E6: one LUKS1 image served over NBD (median)"
    };
    let plot = Plot {
        file: PlotFile::Main,
        title: title.into(),
        chart: Chart::Bars(bars(servers, results)),
    };
    let failed: BTreeMap<&str, String> = servers
        .iter()
        .zip(results)
        .filter_map(|(s, r)| r.failed.clone().map(|w| (s.key(), w)))
        .collect();
    let body = Body {
        servers: servers
            .iter()
            .zip(results)
            .map(|(&s, r)| (s.key(), ServerInfo::of(s, r)))
            .collect(),
        rows: rows(run),
        summary: summary(run, &ratios, &failed),
        tls: tls.then_some(true),
    };
    let stem = if tls { "nbd-tls" } else { "nbd" };
    let report = Report::new("E6 nbd", settings(run, opts), body)
        .stem(stem)
        .emit(opts, &[plot])?;
    failures(&failed, "", json_path)?;
    Ok(report)
}

/// An error naming each server of `failed` and what went wrong, after
/// `what` and where the report was written; `Ok` when none failed.
pub(crate) fn failures(
    failed: &BTreeMap<&str, String>,
    what: &str,
    json_path: &Path,
) -> Result<(), BenchError> {
    if failed.is_empty() {
        return Ok(());
    }
    Err(workload(format!(
        "{what}{} failed (report written to {}): {}",
        failed.keys().copied().collect::<Vec<_>>().join(", "),
        json_path.display(),
        failed
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("; ")
    )))
}

/// The table, the ratios and the targets.
fn table(run: &Run, ratios: &Ratios) -> Table {
    let mut t = Table::new("");
    t.line(format!(
        "nbd (E6): one LUKS1 image (aes-xts-plain64, 512-bit key), {} MiB payload on {}, served over a Unix socket{}; median of {} run(s)",
        run.plan.dev / MIB,
        run.fs,
        if run.tls {
            " with TLS (X.509; ours also without TLS)"
        } else {
            ""
        },
        run.runs
    ));
    t.line(format!(
        "{:<22} | {:<24} | {:>8} {:>13} | {:>8}",
        "server", "load", "MiB/s", "min-max", "IOPS"
    ));
    for (&s, r) in run.servers.iter().zip(run.results) {
        if let Some(why) = &r.failed {
            t.line(format!("{:<22} | FAILED: {why}", s.label()));
            continue;
        }
        if r.samples[0].is_empty() {
            t.line(format!("{:<22} | no figures", s.label()));
            continue;
        }
        for (l, load) in Load::ALL.iter().enumerate() {
            let v: Vec<f64> = r.samples[l].iter().map(|x| x.mib_s).collect();
            let (lo, hi) = (
                v.iter().cloned().fold(f64::INFINITY, f64::min),
                v.iter().cloned().fold(0.0, f64::max),
            );
            t.line(format!(
                "{:<22} | {:<24} | {:>8.0} {:>13} | {:>8}",
                s.label(),
                load.label(),
                r.median_mib(l).unwrap_or(0.0),
                format!("{lo:.0}-{hi:.0}"),
                r.median_iops(l)
                    .map_or_else(|| "-".to_string(), |x| format!("{x:.0}"))
            ));
        }
    }
    for (l, r) in &ratios.vs_peer {
        t.line(match r {
            Some((x, who)) => format!(
                "ratio ours / best peer, {}: {x:.2} (best peer {})",
                l.short(),
                who.label()
            ),
            None => format!("ratio ours / best peer, {}: - (no figure)", l.short()),
        });
    }
    let fmt_min = |m: Option<f64>| m.map_or_else(|| "-".into(), |m| format!("{m:.2}"));
    t.line(format!(
        "target every ratio >= {TARGET_RATIO}: min {} ({})",
        fmt_min(ratios.min),
        met(ratios.target_met)
    ));
    if run.tls {
        for (l, r) in &ratios.tls {
            t.line(match r {
                Some(x) => format!("ratio ours TLS / ours plaintext, {}: {x:.2}", l.short()),
                None => format!(
                    "ratio ours TLS / ours plaintext, {}: - (no figure)",
                    l.short()
                ),
            });
        }
        t.line(format!(
            "target TLS within {:.0} % of plaintext (every ratio >= {TLS_TARGET_FRACTION}): min {} ({})",
            (1.0 - TLS_TARGET_FRACTION) * 100.0,
            fmt_min(ratios.min_tls),
            met(ratios.tls_target_met)
        ));
    }
    t
}

/// The report's fields beside `settings`.
#[derive(Serialize)]
struct Body {
    servers: BTreeMap<&'static str, ServerInfo>,
    rows: Vec<Row>,
    summary: serde_json::Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<bool>,
}

/// How a server ran.
#[derive(Serialize)]
struct ServerInfo {
    label: &'static str,
    command: String,
    advertises_multi_conn: Option<bool>,
    failed: Option<String>,
    stops: Vec<String>,
}

impl ServerInfo {
    fn of(s: Server, r: &Results) -> ServerInfo {
        ServerInfo {
            label: s.label(),
            command: r.command.clone(),
            advertises_multi_conn: r.multi_conn,
            failed: r.failed.clone(),
            stops: r.stops.clone(),
        }
    }
}

/// One server's figures for one load.
#[derive(Serialize)]
struct Row {
    server: &'static str,
    load: &'static str,
    describe: &'static str,
    mib_s: Option<f64>,
    iops: Option<f64>,
    runs_mib_s: Vec<f64>,
    runs_iops: Vec<Option<f64>>,
}

fn rows(run: &Run) -> Vec<Row> {
    run.servers
        .iter()
        .zip(run.results)
        .flat_map(|(&s, r)| {
            Load::ALL.iter().enumerate().map(move |(l, load)| Row {
                server: s.key(),
                load: load.key(),
                describe: load.label(),
                mib_s: r.median_mib(l).map(round2),
                iops: r.median_iops(l).map(round2),
                runs_mib_s: r.samples[l].iter().map(|x| round2(x.mib_s)).collect(),
                runs_iops: r.samples[l].iter().map(|x| x.iops.map(round2)).collect(),
            })
        })
        .collect()
}

/// The summary: each server's median per load, the ratios and targets,
/// and which servers failed.
fn summary(
    run: &Run,
    ratios: &Ratios,
    failed: &BTreeMap<&str, String>,
) -> serde_json::Map<String, Value> {
    let mut summary = serde_json::Map::new();
    for (load, name, unit) in [
        (Load::SeqWrite, "write", "mib_s"),
        (Load::SeqRead, "read", "mib_s"),
        (Load::RandRw, "randrw", "iops"),
        (Load::CopyRead, "nbdcopy_read", "mib_s"),
        (Load::CopyWrite, "nbdcopy_write", "mib_s"),
    ] {
        let keyed: &[Server] = if run.tls {
            &Server::ALL_TLS
        } else {
            &Server::ALL
        };
        for &s in keyed {
            let v = run.fig(s, load).map(round2);
            summary.insert(format!("{}_{name}_{unit}", s.key()), v.into());
        }
        let key = if load == Load::RandRw {
            "randrw_iops_ratio_vs_best_peer".to_string()
        } else {
            format!("{name}_ratio_vs_best_peer")
        };
        summary.insert(key, ratios.peer(load).into());
    }
    summary.insert("min_ratio_vs_best_peer".into(), ratios.min.into());
    summary.insert("target_ratio".into(), TARGET_RATIO.into());
    summary.insert("target_met".into(), ratios.target_met.into());
    if run.tls {
        summary.insert("tls".into(), true.into());
        for (load, name) in [
            (Load::SeqWrite, "write"),
            (Load::SeqRead, "read"),
            (Load::RandRw, "randrw_iops"),
            (Load::CopyRead, "nbdcopy_read"),
            (Load::CopyWrite, "nbdcopy_write"),
        ] {
            let k = format!("{name}_ratio_tls_vs_plaintext");
            summary.insert(k, ratios.tls(load).into());
        }
        summary.insert("min_ratio_tls_vs_plaintext".into(), ratios.min_tls.into());
        summary.insert(
            "tls_target_min_ratio_vs_plaintext".into(),
            TLS_TARGET_FRACTION.into(),
        );
        summary.insert("tls_target_met".into(), ratios.tls_target_met.into());
    }
    summary.insert("failed".into(), json!(failed));
    summary
}

/// How the run was made (with `--tls`, how each server's TLS was set).
fn settings(run: &Run, opts: &BenchOptions) -> Value {
    let mut settings = json!({
        "runs": run.runs,
        "quick": opts.quick,
        "export_bytes": run.plan.dev,
        "image": "LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000 PBKDF2 iterations; every payload byte written before the runs (no holes)",
        "file_system": run.fs,
        "page_cache": "every server reads and writes the image through the page cache (buffered I/O); nothing asks for a flush; the image is synced to disk between servers",
        "transport": "Unix socket, one per server",
        "fio": {
            "engine": "nbd (libnbd)",
            "seconds_per_load": run.plan.fio_ms as f64 / 1000.0,
            "seq": format!("1 MiB, iodepth {SEQ_DEPTH}, 1 job (1 connection), time based over the whole export"),
            "randrw": format!("4 KiB, 50 % reads, iodepth {RAND_DEPTH}, {RAND_JOBS} jobs (connections), time based"),
        },
        "nbdcopy": "defaults (4 connections where the server advertises multi-conn, else 1; threads = CPUs; 256 KiB requests); read: --no-extents export -> null:, write: a data file of the export's size -> export, no --flush",
        "check": format!("each server first checks with fio verify_only the last {} MiB the previous server wrote with crc32c verify headers, then writes and checks them itself after its loads", VERIFY_BYTES / MIB),
        "order": "each run starts with the next server in turn",
    });
    if run.tls {
        settings["tls"] = json!({
            "credentials": "X.509: a CA, a server certificate (RSA 2048, SHA-256, SAN localhost and 127.0.0.1) and a client certificate, made for the run",
            "client_certificate_checked": TLS_VERIFY_PEER,
            "ours": "iopages serve --tls require --tls-certificates DIR",
            "nbdkit": "nbdkit --tls=require --tls-certificates=DIR",
            "qemu": "qemu-nbd --object tls-creds-x509,id=tls0,dir=DIR,endpoint=server,verify-peer=off --tls-creds tls0",
            "ours_plaintext": "iopages serve without TLS, in the same runs, for the TLS cost",
            "clients": "nbdinfo and nbdcopy: nbds+unix:///NAME?socket=S&tls-certificates=DIR; fio's nbd engine: nbds+unix:///NAME?socket=S (fio does not let libnbd read files the URI names; HOME holds .pki/libnbd for a non-root run). Over a Unix socket libnbd does not check the server's certificate",
        });
    }
    settings
}

/// E6's bars: MiB/s of the sequential and copy loads, IOPS of the random
/// one, a bar per server.
fn bars(servers: &[Server], results: &[Results]) -> Bars {
    let panel = |loads: &[Load], y_label: &str, width_px| BarPanel {
        y_label: y_label.into(),
        width_px,
        categories: loads.iter().map(|l| l.short().to_string()).collect(),
        values: (0..servers.len())
            .map(|i| loads.iter().map(|&l| figure(&results[i], l)).collect())
            .collect(),
    };
    Bars {
        series: servers.iter().map(|s| s.label().to_string()).collect(),
        panels: vec![
            panel(
                &[
                    Load::SeqWrite,
                    Load::SeqRead,
                    Load::CopyRead,
                    Load::CopyWrite,
                ],
                "MiB/s",
                760,
            ),
            panel(&[Load::RandRw], "IOPS (4 KiB, 50 % reads)", 240),
        ],
    }
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

    /// A directory under the temporary one, removed when dropped.
    fn scratch(tag: &str) -> RemoveDirs {
        let d = std::env::temp_dir().join(format!("iopages-nbd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        RemoveDirs(vec![d])
    }

    fn fake_tls() -> TlsSetup {
        let d = PathBuf::from("/t");
        TlsSetup {
            pki: Pki {
                server: d.join("server"),
                client: d.join("client"),
                client_no_cert: d.join("client-no-cert"),
                foreign: d.join("foreign"),
            },
            home: d.join("home"),
        }
    }

    #[test]
    fn tls_runs_every_server_with_tls_and_ours_also_without() {
        assert_eq!(servers_of(true, false), Server::ALL.to_vec());
        assert_eq!(servers_of(false, false), vec![Server::Ours]);
        assert_eq!(
            servers_of(true, true),
            vec![
                Server::Ours,
                Server::OursPlain,
                Server::Nbdkit,
                Server::Qemu
            ]
        );
        assert_eq!(
            servers_of(false, true),
            vec![Server::Ours, Server::OursPlain]
        );
        let t = fake_tls();
        let sock = Path::new("/s/x.sock");
        assert_eq!(
            Server::Ours.uri(sock, Some(&t)),
            "nbds+unix:///iopages?socket=/s/x.sock&tls-certificates=/t/client"
        );
        assert_eq!(
            Server::Qemu.uri(sock, Some(&t)),
            "nbds+unix:///?socket=/s/x.sock&tls-certificates=/t/client"
        );
        assert_eq!(
            Server::OursPlain.uri(sock, Some(&t)),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        assert_eq!(
            Server::Ours.uri(sock, None),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        // fio's URI names no file: libnbd finds the certificates in HOME.
        assert_eq!(
            Server::Nbdkit.fio_uri(sock, Some(&t)),
            "nbds+unix:///?socket=/s/x.sock"
        );
        assert_eq!(
            Server::OursPlain.fio_uri(sock, Some(&t)),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        assert_eq!(
            Server::Ours.fio_uri(sock, None),
            Server::Ours.uri(sock, None)
        );
        assert!(Server::OursPlain.is_ours() && !Server::Qemu.is_ours());
    }

    #[test]
    fn tls_server_command_lines() {
        let tools = Tools {
            cryptsetup: "cryptsetup".into(),
            fio: "fio".into(),
            nbdcopy: "nbdcopy".into(),
            nbdinfo: "nbdinfo".into(),
            nbdkit: "nbdkit".into(),
            qemu_nbd: "qemu-nbd".into(),
        };
        let mut f = Files {
            work: "/w".into(),
            socks: "/s".into(),
            image: "/w/luks1.img".into(),
            pass: "/w/passphrase".into(),
            source: "/w/source.bin".into(),
            tls: Some(fake_tls()),
            read_only: false,
        };
        let sock = Path::new("/s/x.sock");
        let line = |s: Server, f: &Files| {
            command_line(&server_command(
                s,
                &tools,
                Path::new("/bin/iopages"),
                f,
                sock,
            ))
        };
        assert_eq!(
            line(Server::Ours, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered --tls require --tls-certificates /t/server"
        );
        assert_eq!(
            line(Server::OursPlain, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered"
        );
        assert_eq!(
            line(Server::Nbdkit, &f),
            "nbdkit --foreground --exit-with-parent --unix /s/x.sock --tls=require --tls-certificates=/t/server --filter=luks file file=/w/luks1.img passphrase=+/w/passphrase"
        );
        let q = line(Server::Qemu, &f);
        assert!(
            q.starts_with("qemu-nbd --object tls-creds-x509,id=tls0,dir=/t/server,endpoint=server,verify-peer=off --tls-creds tls0 --object secret,id=sec0,"),
            "{q}"
        );
        // Without --tls: the command lines of the plaintext E6.
        f.tls = None;
        assert_eq!(
            line(Server::Ours, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered"
        );
        assert!(!line(Server::Nbdkit, &f).contains("tls"));
        assert!(line(Server::Qemu, &f).starts_with("qemu-nbd --object secret,id=sec0,"));
    }

    fn results_of(per_server: &[[f64; 5]]) -> Vec<Results> {
        per_server
            .iter()
            .map(|v| Results {
                samples: v
                    .iter()
                    .enumerate()
                    .map(|(l, &x)| {
                        vec![Sample {
                            mib_s: x,
                            iops: (l <= 2).then_some(x * 10.0),
                        }]
                    })
                    .collect(),
                failed: None,
                command: String::new(),
                stops: Vec::new(),
                multi_conn: Some(true),
            })
            .collect()
    }

    #[test]
    fn tls_report_has_the_marker_and_both_ratios() {
        let dir = scratch("report");
        // The reports go to <out_dir>/nbd-tls.json and nbd.json.
        let opts = BenchOptions {
            quick: true,
            out_dir: dir.0[0].clone(),
            ..BenchOptions::default()
        };
        let plan = Plan {
            dev: 128 * MIB,
            fio_ms: 1500,
        };
        let json = dir.0[0].join("nbd-tls.json");
        let svg = json.with_extension("svg");
        let servers = servers_of(true, true);
        // ours TLS, ours plaintext, nbdkit, qemu.
        let results = results_of(&[
            [900.0, 1000.0, 90.0, 800.0, 700.0],
            [1000.0, 1000.0, 100.0, 1000.0, 700.0],
            [300.0, 400.0, 30.0, 500.0, 200.0],
            [450.0, 200.0, 45.0, 100.0, 350.0],
        ]);
        let run = Run {
            servers: &servers,
            results: &results,
            plan: &plan,
            runs: 1,
            fs: "tmpfs",
            tls: true,
        };
        let r = report(&opts, &run, &json).unwrap();
        assert_eq!(r["tls"], true);
        assert!(r["settings"]["tls"]["qemu"]
            .as_str()
            .unwrap()
            .contains("tls-creds-x509"));
        let s = &r["summary"];
        assert_eq!(s["tls"], true);
        assert_eq!(s["write_ratio_vs_best_peer"], 2.0);
        assert_eq!(s["read_ratio_vs_best_peer"], 2.5);
        assert_eq!(s["randrw_iops_ratio_vs_best_peer"], 2.0);
        assert_eq!(s["nbdcopy_read_ratio_vs_best_peer"], 1.6);
        assert_eq!(s["nbdcopy_write_ratio_vs_best_peer"], 2.0);
        assert_eq!(s["min_ratio_vs_best_peer"], 1.6);
        assert_eq!(s["target_met"], false);
        assert_eq!(s["write_ratio_tls_vs_plaintext"], 0.9);
        assert_eq!(s["read_ratio_tls_vs_plaintext"], 1.0);
        assert_eq!(s["randrw_iops_ratio_tls_vs_plaintext"], 0.9);
        assert_eq!(s["nbdcopy_read_ratio_tls_vs_plaintext"], 0.8);
        assert_eq!(s["min_ratio_tls_vs_plaintext"], 0.8);
        assert_eq!(s["tls_target_min_ratio_vs_plaintext"], 0.85);
        assert_eq!(s["tls_target_met"], false);
        assert_eq!(s["ours_plaintext_write_mib_s"], 1000.0);
        assert_eq!(s["ours_write_mib_s"], 900.0);
        let on_disk: Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(on_disk, r);
        assert!(svg.exists());

        // Without --tls: no marker, no plaintext column, no TLS ratios.
        let plain_servers = servers_of(true, false);
        let plain_results = results_of(&[
            [1000.0, 1000.0, 100.0, 1000.0, 700.0],
            [300.0, 400.0, 30.0, 500.0, 200.0],
            [450.0, 200.0, 45.0, 100.0, 350.0],
        ]);
        let plain_run = Run {
            servers: &plain_servers,
            results: &plain_results,
            tls: false,
            ..run
        };
        let plain = report(&opts, &plain_run, &dir.0[0].join("nbd.json")).unwrap();
        assert!(plain.get("tls").is_none() && plain["settings"].get("tls").is_none());
        let s = plain["summary"].as_object().unwrap();
        assert!(
            !s.keys()
                .any(|k| k.contains("tls") || k.contains("plaintext")),
            "{s:?}"
        );
        let w = s["write_ratio_vs_best_peer"].as_f64().unwrap();
        assert!((w - 1000.0 / 450.0).abs() < 1e-9, "{w}");
    }
}
