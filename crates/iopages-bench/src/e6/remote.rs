//! E6 remote (`iopages bench nbd --remote`): a LUKS1 image whose
//! ciphertext lives on a remote NBD store, served decrypted by `iopages
//! serve --image nbd+unix://…` and by nbdkit's luks filter over its nbd
//! plugin, in turn, under E6's loads (fio's nbd engine: 1 MiB sequential
//! write and read, 4 KiB random read/write; nbdcopy of the whole volume).
//! The raw remote — a plaintext export of the same size on the same store
//! — runs the same loads: a server that decrypts in front of it cannot beat
//! it, so a figure more than `RAW_BOUND` (10 %) above it is flagged as
//! failed (a wrong clock, not a fast server). The store (`--store`, module
//! `store`) is an nbdkit `file` export by default, or with `--store ceph`
//! RBD images of a single-node Ceph cluster (scripts/ceph-store.sh).
//!
//! Owns: the two LUKS servers started and stopped in turn, the
//! cross-checks (each LUKS server checks with fio `verify_only` what the
//! other wrote last; at the end both read the whole volume and must return
//! the same bytes), the table, `nbd-remote.json` (`nbd-remote-ceph.json`
//! on Ceph). Must never: run both LUKS servers against the remote at once;
//! leave a child process or a temporary file behind.

use super::common::os;
use super::files::{fill_file, format_luks1, work_dirs};
use super::fio::{verify_region, Plan};
use super::load::{Load, Sample};
use super::measure::{load_sample_at, LoadTarget, Results};
use super::server::command_line;
use super::tools::{parse_size, probe, Tools};
use crate::harness::{Report, Table};
use crate::measure::{median, per_run_ratio};
use crate::{met, progress, round2, BenchError, BenchOptions};
use iopages_tools::{die_with_parent, run_tool, stop, tail_lines, wait_for_socket};
use serde::Serialize;
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::common::MIB;
use super::files::LUKS_HEADER_BYTES;
use super::fio::VERIFY_BYTES;
use super::report::{figure_lines, figures_head, rows, Row, TARGET_RATIO};
use super::server::{OUR_EXPORT, START_TIMEOUT, STOP_TIMEOUT};
pub(crate) mod cpu;
mod store;

use cpu::{CpuUse, Meter};
pub use store::Store;
use store::{Export, Running, LUKS_FILE, RAW_FILE};

/// The volume's passphrase (the file holds exactly these bytes).
const PASSPHRASE: &[u8] = b"iopages-e6-remote-passphrase";
/// No figure may exceed the raw remote's by more than this factor.
const RAW_BOUND: f64 = 1.10;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("nbd --remote: {e}"))
}

/// The servers measured, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// The remote's plaintext export, no server in front.
    Raw,
    Ours,
    Nbdkit,
}

impl Server {
    const ALL: [Server; 3] = [Server::Raw, Server::Ours, Server::Nbdkit];

    fn key(self) -> &'static str {
        match self {
            Server::Raw => "raw_remote",
            Server::Ours => "ours",
            Server::Nbdkit => "nbdkit",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Server::Raw => "raw remote (plaintext)",
            Server::Ours => "iopages serve",
            Server::Nbdkit => "nbdkit luks+nbd",
        }
    }
}

/// The outside programs (qemu-nbd's name stands in; nothing starts it),
/// with nbdkit's plugins the run needs probed.
fn find_tools(dir: &Path, store: Store) -> Result<Tools, BenchError> {
    let skipped = |e: String| workload(format!("skipped: {e}"));
    let t = Tools::find_as(
        dir,
        Some("the remote store and the peer (luks filter, nbd plugin)"),
        false,
    )
    .map_err(skipped)?;
    probe(
        dir,
        &t.nbdkit,
        &[&"nbd", &"--dump-plugin"],
        "nbdkit's nbd plugin is missing",
    )
    .map_err(skipped)?;
    if store == Store::Nbdkit {
        probe(
            dir,
            &t.nbdkit,
            &[&"file", &"--dump-plugin"],
            "nbdkit's file plugin is missing",
        )
        .map_err(skipped)?;
    }
    Ok(t)
}

/// A server process: SIGTERM (then SIGKILL) and reaped when dropped.
pub(crate) struct Proc {
    name: &'static str,
    child: Option<Child>,
    err_log: PathBuf,
}

impl Proc {
    /// Its process id while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn alive(&mut self) -> Result<(), String> {
        let child = self.child.as_mut().expect("running");
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

    /// SIGKILL (a crash), reaped.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start `cmd` (logs under `work/<key>.err`) and wait for `sock`.
pub(crate) fn start(
    name: &'static str,
    key: &str,
    mut cmd: Command,
    sock: &Path,
    work: &Path,
) -> Result<(Proc, String), String> {
    let _ = std::fs::remove_file(sock);
    let line = command_line(&cmd);
    let err_log = work.join(format!("{key}.err"));
    let log = std::fs::File::create(&err_log)
        .map_err(|e| format!("cannot create {}: {e}", err_log.display()))?;
    cmd.current_dir(work)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    die_with_parent(&mut cmd, libc::SIGTERM);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {name} ({line}): {e}"))?;
    let mut p = Proc {
        name,
        child: Some(child),
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
    /// The remote's directory: `luks1.img` and `raw.img`.
    store: PathBuf,
    pass: PathBuf,
    source: PathBuf,
    /// The store's exports: the LUKS1 image, the plaintext raw export.
    luks: Export,
    raw: Export,
    server_sock: PathBuf,
    /// The volume's size (the LUKS payload; the raw export's size) and
    /// each fio load's run time.
    plan: Plan,
}

impl Setup {
    /// The URI the loads use for `s`.
    fn uri(&self, s: Server) -> String {
        match s {
            Server::Raw => self.raw.uri(),
            Server::Ours => format!(
                "nbd+unix:///{OUR_EXPORT}?socket={}",
                self.server_sock.display()
            ),
            Server::Nbdkit => format!("nbd+unix:///?socket={}", self.server_sock.display()),
        }
    }

    /// How a LUKS server is started over the remote's `luks1.img`.
    fn server_command(&self, s: Server, tools: &Tools, ours: &Path) -> Command {
        let mut cmd;
        match s {
            Server::Ours => {
                cmd = Command::new(ours);
                cmd.arg("serve")
                    .arg("--image")
                    .arg(self.luks.uri())
                    .arg("--passphrase-file")
                    .arg(&self.pass)
                    .arg("--unix")
                    .arg(&self.server_sock)
                    .arg("--name")
                    .arg(OUR_EXPORT);
            }
            _ => {
                cmd = Command::new(&tools.nbdkit);
                cmd.arg("--foreground")
                    .arg("--exit-with-parent")
                    .arg("--unix")
                    .arg(&self.server_sock)
                    .arg("--filter=luks")
                    .arg("nbd")
                    .arg(format!("socket={}", self.luks.sock.display()))
                    .arg(format!("export={}", self.luks.name))
                    .arg(format!("passphrase=+{}", self.pass.display()));
            }
        }
        cmd
    }

    /// Flush the nbdkit store's files to disk (outside the timed loads;
    /// on Ceph they are on the RBD images, and nothing is here).
    fn sync_store(&self) {
        for f in [LUKS_FILE, RAW_FILE] {
            if let Ok(f) = std::fs::File::open(self.store.join(f)) {
                let _ = f.sync_all();
            }
        }
    }
}

/// One timed load on `uri`, and the CPU it cost the store (`pids.0`), the
/// server in front of it (`pids.1`) and the client.
fn load_sample(
    tools: &Tools,
    st: &Setup,
    uri: &str,
    load: Load,
    pids: (Option<u32>, Option<u32>),
) -> Result<(Sample, CpuUse), String> {
    let meter = Meter::start(pids.0, pids.1);
    let at = LoadTarget {
        fio: &tools.fio,
        nbdcopy: &tools.nbdcopy,
        work: &st.work,
        home: None,
        fio_uri: uri,
        uri,
        source: &st.source,
    };
    let sample = load_sample_at(&at, &st.plan, load)?;
    let fio_s = st.plan.fio_ms as f64 / 1000.0;
    let cpu = meter.finish(load, &sample, fio_s, st.plan.dev);
    Ok((sample, cpu))
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

/// One cross-check between the two LUKS servers.
#[derive(Clone, Debug, Serialize)]
struct Check {
    what: String,
    ok: bool,
    detail: String,
}

/// The LUKS1 image in the store (data everywhere, then the header), the
/// plaintext raw export and nbdcopy's source. Returns the volume's size.
fn make_files(tools: &Tools, st: &mut Setup, payload: u64) -> Result<(), BenchError> {
    std::fs::write(&st.pass, PASSPHRASE).map_err(|e| BenchError::Write {
        path: st.pass.clone(),
        source: e,
    })?;
    let image = st.store.join(LUKS_FILE);
    let len = payload + LUKS_HEADER_BYTES;
    fill_file(&image, len, 0x9E37_79B9_7F4A_7C15)?;
    st.plan.dev =
        format_luks1(&tools.cryptsetup, &st.pass, &image, len, &st.work).map_err(workload)?;
    fill_file(&st.store.join(RAW_FILE), st.plan.dev, 0x2545_F491_4F6C_DD1D)?;
    fill_file(&st.source, st.plan.dev, 0xD1B5_4A32_D192_ED03)
}

/// `iopages bench nbd --remote` on the nbdkit store (see [`run_on`]).
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    run_on(opts, iopages_bin, Store::Nbdkit)
}

/// `iopages bench nbd --remote --store STORE`. `iopages_bin` is the
/// `iopages` whose `serve` is measured.
///
/// **Returns:** the report; a failed server, a failed cross-check or a
/// figure above the raw remote's bound is reported and then returned as
/// an error, as is a store that cannot be started (Ceph: not installable).
pub fn run_on(opts: &BenchOptions, iopages_bin: &Path, store: Store) -> Result<Value, BenchError> {
    let (runs, payload, fio_ms) = if opts.quick {
        (1usize, 64 * MIB, 2000u64)
    } else {
        (3, 256 * MIB, 5000)
    };
    let (json_path, _) = opts.paths(store.stem());
    // Bound before any process: removed after they are stopped.
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, "nbd-remote")?;
    std::fs::create_dir_all(work.join("store")).map_err(|e| BenchError::Write {
        path: work.join("store"),
        source: e,
    })?;
    let tools = find_tools(&work, store)?;
    let remote_sock = socks.join("remote.sock");
    let nbdkit_export = |name: &str| Export {
        sock: remote_sock.clone(),
        name: name.to_string(),
    };
    let mut st = Setup {
        store: work.join("store"),
        pass: work.join("passphrase"),
        source: work.join("source.bin"),
        luks: nbdkit_export(LUKS_FILE),
        raw: nbdkit_export(RAW_FILE),
        server_sock: socks.join("server.sock"),
        work: work.clone(),
        plan: Plan { dev: 0, fio_ms },
    };
    progress(
        "nbd-remote",
        format!(
            "E6 remote: a LUKS1 image (aes-xts-plain64, 512-bit key) of {} MiB payload on {}; iopages serve and nbdkit's luks filter (nbd plugin) in front of it in turn, beside the raw remote; {runs} run(s), fio {} s per load",
            payload / MIB,
            store.describe(),
            fio_ms as f64 / 1000.0
        ),
    );
    progress(
        "nbd-remote",
        "making the LUKS1 image, the raw export and the source file",
    );
    make_files(&tools, &mut st, payload)?;
    let mut remote = match store {
        Store::Nbdkit => store::start_nbdkit(&tools, &st.store, &remote_sock, &work),
        Store::Ceph => store::start_ceph(
            &tools,
            &st.store,
            &socks.join("ceph"),
            &work,
            (payload + LUKS_HEADER_BYTES, st.plan.dev),
        ),
    }
    .map_err(workload)?;
    (st.luks, st.raw) = (remote.luks.clone(), remote.raw.clone());
    let (mut results, checks, cpu) = measure_all(&tools, &st, iopages_bin, runs, &mut remote)?;
    results[0].command = remote.command.clone();
    results[0].stops.push(remote.stop());
    let stored = Stored {
        store,
        settings: remote.settings.clone(),
    };
    drop(remote);
    let found = Found {
        results: &results,
        checks: &checks,
        cpu: &cpu,
    };
    report(opts, &st, &stored, runs, &found, &json_path)
}

/// Every run of every server in turn (each run starts with the next one),
/// then the whole-volume cross-check.
///
/// **Returns:** the results per server and the cross-checks; Err only
/// when the store died.
fn measure_all(
    tools: &Tools,
    st: &Setup,
    iopages_bin: &Path,
    runs: usize,
    remote: &mut Running,
) -> Result<(Vec<Results>, Vec<Check>, Tally), BenchError> {
    let mut results: Vec<Results> = Server::ALL.iter().map(|_| Results::empty()).collect();
    let mut cpu: Tally = Server::ALL
        .iter()
        .map(|_| vec![Vec::new(); Load::ALL.len()])
        .collect();
    let mut checks: Vec<Check> = Vec::new();
    // The LUKS server that last wrote the verify region.
    let mut previous: Option<Server> = None;
    for run in 0..runs {
        for i in 0..Server::ALL.len() {
            let s = Server::ALL[(i + run) % Server::ALL.len()];
            let si = Server::ALL.iter().position(|&x| x == s).expect("listed");
            if results[si].failed.is_some() {
                continue;
            }
            progress(
                "nbd-remote",
                format!("run {}/{runs}: {}", run + 1, s.label()),
            );
            let m = measure_one(
                s,
                Pass {
                    tools,
                    st,
                    ours: iopages_bin,
                    previous,
                    store_pid: remote.pid(),
                },
                &mut results[si],
                &mut checks,
            );
            let m = m.map(|v| {
                let (samples, uses): (Vec<Sample>, Vec<CpuUse>) = v.into_iter().unzip();
                for (l, c) in uses.into_iter().enumerate() {
                    cpu[si][l].push(c);
                }
                samples
            });
            if let Err(e) = remote.alive() {
                return Err(workload(format!("the remote store died: {e}")));
            }
            let wrote = record(s, m, &mut results[si]);
            if s != Server::Raw {
                previous = wrote.then_some(s);
            }
        }
    }
    if results[1].failed.is_none() && results[2].failed.is_none() {
        progress(
            "nbd-remote",
            "cross-check: the whole volume read through each LUKS server",
        );
        checks.push(whole_volume_check(tools, st, iopages_bin));
    }
    Ok((results, checks, cpu))
}

/// The CPU each load cost, `[server][load][run]`.
type Tally = Vec<Vec<Vec<CpuUse>>>;

/// What one server's pass needs besides its results.
struct Pass<'a> {
    tools: &'a Tools,
    st: &'a Setup,
    /// The `iopages` binary whose `serve` is measured.
    ours: &'a Path,
    /// The LUKS server that last wrote the verify region.
    previous: Option<Server>,
    /// The store's process (its CPU), when it is one process.
    store_pid: Option<u32>,
}

/// Keep one pass's samples (or why it failed) in `res`, with a progress
/// line. Returns whether the pass succeeded.
fn record(s: Server, m: Result<Vec<Sample>, String>, res: &mut Results) -> bool {
    match m {
        Ok(v) => {
            let line = Load::ALL
                .iter()
                .zip(&v)
                .map(|(l, x)| format!("{} {:.0} {}", l.key(), x.figure(*l), l.unit()))
                .collect::<Vec<_>>()
                .join(", ");
            progress("nbd-remote", format!("  {}: {line}", s.label()));
            for (l, x) in v.into_iter().enumerate() {
                res.samples[l].push(x);
            }
            true
        }
        Err(why) => {
            progress("nbd-remote", format!("  FAILED ({}): {why}", s.label()));
            res.failed = Some(why);
            false
        }
    }
}

/// One server's pass: the size, the other LUKS server's verify region,
/// the timed loads, then this one's verify region.
fn measure_one(
    s: Server,
    pass: Pass<'_>,
    res: &mut Results,
    checks: &mut Vec<Check>,
) -> Result<Vec<(Sample, CpuUse)>, String> {
    let Pass {
        tools,
        st,
        ours,
        previous,
        store_pid,
    } = pass;
    let uri = st.uri(s);
    let mut server = None;
    if s != Server::Raw {
        let (p, line) = start(
            s.label(),
            s.key(),
            st.server_command(s, tools, ours),
            &st.server_sock,
            &st.work,
        )?;
        res.command = line;
        server = Some(p);
    }
    let out = (|| {
        check_size(tools, st, &uri)?;
        if let (Some(p), true) = (previous, s != Server::Raw) {
            checks.push(cross_check(tools, st, &uri, s, p));
        }
        let mut v = Vec::new();
        for load in Load::ALL {
            // The writes of the load before are on disk: no load pays for
            // another's writeback.
            st.sync_store();
            let server_pid = server.as_ref().and_then(Proc::pid);
            v.push(load_sample(tools, st, &uri, load, (store_pid, server_pid))?);
            if let Some(p) = server.as_mut() {
                p.alive()
                    .map_err(|e| format!("after {}: {e}", load.label()))?;
            }
        }
        if s != Server::Raw {
            verify_region(&tools.fio, &st.work, None, &st.plan, &uri, false)
                .map_err(|e| format!("read-back of its own writes (fio verify): {e}"))?;
        }
        Ok(v)
    })();
    if let Some(mut p) = server {
        res.stops.push(p.stop());
    }
    out
}

/// `s` reads back (fio `verify_only`) what the LUKS server `p` wrote last.
fn cross_check(tools: &Tools, st: &Setup, uri: &str, s: Server, p: Server) -> Check {
    let v = verify_region(&tools.fio, &st.work, None, &st.plan, uri, true);
    let what = format!(
        "{} reads back the {} MiB {} wrote (fio verify_only, crc32c)",
        s.label(),
        VERIFY_BYTES / MIB,
        p.label()
    );
    let ok = if v.is_ok() { "ok" } else { "FAILED" };
    progress("nbd-remote", format!("  cross-check: {what}: {ok}"));
    Check {
        what,
        ok: v.is_ok(),
        detail: v.err().unwrap_or_default(),
    }
}

/// Read the whole volume through ours, then through nbdkit (one at a
/// time), into files; they must be the same bytes.
fn whole_volume_check(tools: &Tools, st: &Setup, ours: &Path) -> Check {
    let what = format!(
        "the whole volume ({} MiB) read through iopages serve and through nbdkit's luks filter is the same bytes",
        st.plan.dev / MIB
    );
    let read = |s: Server| -> Result<PathBuf, String> {
        let (mut p, _) = start(
            s.label(),
            &format!("{}-check", s.key()),
            st.server_command(s, tools, ours),
            &st.server_sock,
            &st.work,
        )?;
        let out = st.work.join(format!("{}-volume.bin", s.key()));
        let c = run_tool(
            &tools.nbdcopy,
            &os(&[&st.uri(s), &out]),
            &st.work,
            Duration::from_secs(60 + st.plan.dev / (2 * MIB)),
            &[],
        );
        p.stop();
        let c = c?;
        if !c.status.success() {
            return Err(format!(
                "nbdcopy from {}: {}; stderr: {}",
                s.label(),
                c.status,
                tail_lines(&c.stderr)
            ));
        }
        Ok(out)
    };
    let r = read(Server::Ours).and_then(|a| {
        let b = read(Server::Nbdkit)?;
        let same = same_bytes(&a, &b);
        let _ = std::fs::remove_file(&a);
        let _ = std::fs::remove_file(&b);
        same
    });
    let ok = r.is_ok();
    progress(
        "nbd-remote",
        format!(
            "  cross-check: whole volume: {}",
            if ok { "ok" } else { "FAILED" }
        ),
    );
    Check {
        what,
        ok,
        detail: r.err().unwrap_or_default(),
    }
}

/// Ok if `a` and `b` hold the same bytes; else where they first differ.
fn same_bytes(a: &Path, b: &Path) -> Result<(), String> {
    let open = |p: &Path| std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()));
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
    let mut at = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(|e| format!("{}: {e}", a.display()))?;
        let nb = read_full(&mut fb, &mut bb).map_err(|e| format!("{}: {e}", b.display()))?;
        if na != nb || ba[..na] != bb[..nb] {
            let i = ba[..na.min(nb)]
                .iter()
                .zip(&bb[..na.min(nb)])
                .position(|(x, y)| x != y)
                .unwrap_or(na.min(nb));
            return Err(format!("the two reads differ at byte {}", at + i as u64));
        }
        if na == 0 {
            return Ok(());
        }
        at += na as u64;
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Per load: ours / nbdkit, and each LUKS server over the raw remote.
#[derive(Clone, Debug, Serialize)]
struct Verdict {
    load: &'static str,
    unit: &'static str,
    raw_remote: Option<f64>,
    ours: Option<f64>,
    nbdkit: Option<f64>,
    ratio_ours_vs_nbdkit: Option<f64>,
    target_met: bool,
    ours_over_raw: Option<f64>,
    nbdkit_over_raw: Option<f64>,
    /// A figure more than `RAW_BOUND` times the raw remote's: failed.
    exceeds_raw_bound: bool,
}

fn verdicts(results: &[Results]) -> Vec<Verdict> {
    Load::ALL
        .iter()
        .enumerate()
        .map(|(l, &load)| {
            let [raw, ours, nbdkit] = [0, 1, 2].map(|i| results[i].median(l, load));
            // Ratios of figures of the same run (every run measures all
            // three), then the median.
            let figs = |i: usize| -> Option<Vec<f64>> {
                let r = &results[i];
                r.failed
                    .is_none()
                    .then(|| r.samples[l].iter().map(|s| s.figure(load)).collect())
            };
            let [raw_f, ours_f, nbdkit_f] = [0, 1, 2].map(figs);
            let ratio_of = |a: &Option<Vec<f64>>, b: &Option<Vec<f64>>| {
                per_run_ratio(a.as_deref()?, b.as_deref()?)
            };
            let ratio = ratio_of(&ours_f, &nbdkit_f);
            let (or, nr) = (ratio_of(&ours_f, &raw_f), ratio_of(&nbdkit_f, &raw_f));
            Verdict {
                load: load.key(),
                unit: load.unit(),
                raw_remote: raw.map(round2),
                ours: ours.map(round2),
                nbdkit: nbdkit.map(round2),
                ratio_ours_vs_nbdkit: ratio.map(round2),
                target_met: ratio.is_some_and(|r| r >= TARGET_RATIO),
                ours_over_raw: or.map(round2),
                nbdkit_over_raw: nr.map(round2),
                exceeds_raw_bound: [or, nr].iter().flatten().any(|&x| x > RAW_BOUND),
            }
        })
        .collect()
}

#[derive(Serialize)]
struct ServerInfo {
    label: &'static str,
    command: String,
    failed: Option<String>,
    stops: Vec<String>,
}

#[derive(Serialize)]
struct Body {
    servers: serde_json::Map<String, Value>,
    rows: Vec<Row>,
    verdicts: Vec<Verdict>,
    checks: Vec<Check>,
    /// Where the CPU went, per load and process (`cpu.rs`).
    cpu: Value,
    summary: Value,
}

/// What the runs found.
struct Found<'a> {
    results: &'a [Results],
    checks: &'a [Check],
    cpu: &'a Tally,
}

/// One load's CPU, as medians over the runs.
#[derive(Clone, Debug, Serialize)]
struct CpuRow {
    load: &'static str,
    /// "request" (the random load) or "GiB".
    unit: &'static str,
    /// Per server (raw, ours, nbdkit): CPU per unit (µs per request, or
    /// seconds per GiB) of the client, the store, the server, and all
    /// together.
    per_unit: Vec<(&'static str, [Option<f64>; 4])>,
    /// All processes' CPU over the wall time and the machine's cores,
    /// ours.
    ours_busy: Option<f64>,
    /// The bound on ours / raw from CPU per unit (`cpu.rs`), median of
    /// the runs' own.
    bound_ours_over_raw: Option<f64>,
}

/// The medians of the tally, per load.
fn cpu_summary(t: &Tally) -> Vec<CpuRow> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let med = |v: Vec<f64>| (!v.is_empty()).then(|| round3(median(&v)));
    Load::ALL
        .iter()
        .enumerate()
        .map(|(l, &load)| {
            // Requests in µs of CPU, GiB in CPU seconds.
            let scale = if load == Load::RandRw { 1e6 } else { 1.0 };
            let per_unit = Server::ALL
                .iter()
                .enumerate()
                .map(|(si, &s)| {
                    let runs = &t[si][l];
                    let f = |g: &dyn Fn(&CpuUse) -> Option<f64>| {
                        med(runs
                            .iter()
                            .filter_map(|c| Some(g(c)? * scale / c.units(load)?))
                            .collect())
                    };
                    let has_server = s != Server::Raw;
                    (
                        s.key(),
                        [
                            f(&|c| Some(c.client_s)),
                            f(&|c| c.store_s),
                            f(&|c| c.server_s),
                            f(&|c| c.total_s(has_server)),
                        ],
                    )
                })
                .collect();
            let (raw, ours) = (&t[0][l], &t[1][l]);
            CpuRow {
                load: load.key(),
                unit: if load == Load::RandRw {
                    "request"
                } else {
                    "GiB"
                },
                per_unit,
                ours_busy: med(ours
                    .iter()
                    .filter_map(|c| Some(c.total_s(true)? / (c.wall_s * cores)))
                    .collect()),
                bound_ours_over_raw: med(raw
                    .iter()
                    .zip(ours)
                    .filter_map(|(r, o)| cpu::bound(load, r, o))
                    .collect()),
            }
        })
        .collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The CPU lines under the table.
fn print_cpu(rows: &[CpuRow]) {
    let mut t = Table::new("");
    let f = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    for r in rows {
        let unit = if r.unit == "request" {
            "CPU-µs/request"
        } else {
            "CPU-s/GiB"
        };
        let parts: Vec<String> = r
            .per_unit
            .iter()
            .map(|(k, [c, st, sv, all])| {
                format!(
                    "{k}: client {} store {} server {} = {}",
                    f(*c),
                    f(*st),
                    f(*sv),
                    f(*all)
                )
            })
            .collect();
        t.line(format!(
            "cpu {:<13} ({unit}) {}; ours busy {}; CPU bound on ours / raw {}",
            r.load,
            parts.join("; "),
            r.ours_busy
                .map_or("-".into(), |b| format!("{:.0} %", b * 100.0)),
            r.bound_ours_over_raw
                .map_or("-".into(), |b| format!("{b:.2}")),
        ));
    }
    t.print();
}

/// The store the run used, for the report.
struct Stored {
    store: Store,
    /// What it was (the report's settings).
    settings: String,
}

/// The table: every server's figures per load, the verdicts, the checks.
fn print_table(
    st: &Setup,
    stored: &Stored,
    runs: usize,
    results: &[Results],
    v: &[Verdict],
    checks: &[Check],
) {
    let mut t = Table::new("");
    t.line(format!(
        "nbd --remote --store {} (E6 remote): LUKS1 (aes-xts-plain64, 512-bit key) ciphertext on {}, {} MiB volume, Unix sockets; median of {runs} run(s)",
        stored.store.key(),
        stored.store.describe(),
        st.plan.dev / MIB
    ));
    t.line(figures_head(24));
    for (&s, r) in Server::ALL.iter().zip(results) {
        if let Some(why) = &r.failed {
            t.line(format!("{:<24} | FAILED: {why}", s.label()));
            continue;
        }
        figure_lines(&mut t, s.label(), 24, r);
    }
    let f = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
    for (load, x) in Load::ALL.iter().zip(v) {
        t.line(format!(
            "{:<13} ({}): ours / nbdkit {} (target >= {TARGET_RATIO}: {}); over raw remote: ours {}, nbdkit {}{}",
            load.key(),
            load.unit(),
            f(x.ratio_ours_vs_nbdkit),
            met(x.target_met),
            f(x.ours_over_raw),
            f(x.nbdkit_over_raw),
            if x.exceeds_raw_bound {
                format!(" — FAILED: above the raw remote by more than {:.0} %", (RAW_BOUND - 1.0) * 100.0)
            } else {
                String::new()
            }
        ));
    }
    for c in checks {
        let how = if c.ok {
            "ok".to_string()
        } else {
            format!("FAILED ({})", c.detail)
        };
        t.line(format!("check: {}: {how}", c.what));
    }
    t.print();
}

/// What failed: servers, figures above the raw remote's bound, checks.
fn failures_of(results: &[Results], v: &[Verdict], checks: &[Check]) -> Vec<String> {
    let mut failed: Vec<String> = Server::ALL
        .iter()
        .zip(results)
        .filter_map(|(s, r)| r.failed.as_ref().map(|w| format!("{}: {w}", s.key())))
        .collect();
    failed.extend(v.iter().filter(|x| x.exceeds_raw_bound).map(|x| {
        format!(
            "{}: a figure exceeds the raw remote's by more than {:.0} %",
            x.load,
            (RAW_BOUND - 1.0) * 100.0
        )
    }));
    failed.extend(
        checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| format!("check failed: {}: {}", c.what, c.detail)),
    );
    failed
}

/// How the run was set up (the report's settings).
fn settings_of(opts: &BenchOptions, st: &Setup, stored: &Stored, runs: usize) -> Value {
    let page_cache = match stored.store {
        Store::Nbdkit => "the remote nbdkit reads and writes its files through the page cache; both files are synced to disk before each timed load (outside it); nothing asks for a flush",
        Store::Ceph => "the RBD images live in the OSD's memory (memstore); the exporter's librbd cache is in front of them; nothing asks for a flush",
    };
    json!({
        "runs": runs,
        "quick": opts.quick,
        "export_bytes": st.plan.dev,
        "image": "LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000 PBKDF2 iterations (cryptsetup); every payload byte written before the runs",
        "store": stored.store.key(),
        "remote": stored.settings,
        "ours": format!("iopages serve --image {} --passphrase-file P --unix S --name {OUR_EXPORT}", st.luks.uri()),
        "nbdkit": format!("nbdkit --unix S --filter=luks nbd socket={} export={} passphrase=+P", st.luks.sock.display(), st.luks.name),
        "raw_remote": format!("the loads straight on the store's plaintext export ({}), of the volume's size", st.raw.uri()),
        "fio": st.plan.settings(false, "volume"),
        "nbdcopy": "defaults; read: --no-extents export -> null:, write: a data file of the volume's size -> export, no --flush",
        "page_cache": page_cache,
        "order": "each run starts with the next server in turn; one LUKS server against the remote at a time",
        "bound": format!("no server may exceed the raw remote for the same load (median of each run's ratio) by more than {:.0} %", (RAW_BOUND - 1.0) * 100.0),
        "checks": format!("each LUKS server checks with fio verify_only the last {} MiB the other wrote with crc32c headers, then writes and checks them itself; at the end the whole volume is read through each and compared", VERIFY_BYTES / MIB),
    })
}

/// Print the table, write the report (`nbd-remote.json`, or
/// `nbd-remote-ceph.json` on Ceph, unless `--json`).
///
/// **Returns:** the report; Err after writing it when anything failed.
fn report(
    opts: &BenchOptions,
    st: &Setup,
    stored: &Stored,
    runs: usize,
    found: &Found,
    json_path: &Path,
) -> Result<Value, BenchError> {
    let (results, checks) = (found.results, found.checks);
    let v = verdicts(results);
    print_table(st, stored, runs, results, &v, checks);
    let cpu = cpu_summary(found.cpu);
    print_cpu(&cpu);
    let failed = failures_of(results, &v, checks);
    let summary = json!({
        "store": stored.store.key(),
        "target_ratio": TARGET_RATIO,
        "raw_bound": RAW_BOUND,
        "loads_met": v.iter().filter(|x| x.target_met).map(|x| x.load).collect::<Vec<_>>(),
        "loads_not_met": v.iter().filter(|x| !x.target_met).map(|x| x.load).collect::<Vec<_>>(),
        "target_met": v.iter().all(|x| x.target_met),
        "checks_ok": checks.iter().all(|c| c.ok) && !checks.is_empty(),
        "failed": failed,
    });
    let servers = Server::ALL
        .iter()
        .zip(results)
        .map(|(&s, r)| {
            let info = ServerInfo {
                label: s.label(),
                command: r.command.clone(),
                failed: r.failed.clone(),
                stops: r.stops.clone(),
            };
            (s.key().to_string(), json!(info))
        })
        .collect();
    let body = Body {
        servers,
        rows: rows(Server::ALL.iter().map(|s| s.key()).zip(results)),
        verdicts: v,
        checks: checks.to_vec(),
        cpu: json!({
            "summary": cpu,
            "runs": Server::ALL.iter().zip(found.cpu).map(|(s, per_load)| {
                let loads: serde_json::Map<String, Value> = Load::ALL
                    .iter()
                    .zip(per_load)
                    .map(|(l, u)| (l.key().to_string(), json!(u)))
                    .collect();
                (s.key().to_string(), Value::Object(loads))
            }).collect::<serde_json::Map<String, Value>>(),
        }),
        summary,
    };
    let value = Report::new("E6 nbd remote", settings_of(opts, st, stored, runs), body)
        .stem(stored.store.stem())
        .emit(opts, &[])?;
    if !failed.is_empty() {
        return Err(workload(format!(
            "failed (report written to {}): {}",
            json_path.display(),
            failed.join("; ")
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e6::tools::parse_payload_offset;

    #[test]
    fn payload_offset_is_read_from_luks_dump() {
        let dump = "LUKS header information for x\n\nVersion:       \t1\nCipher name:   \taes\nPayload offset:\t4096\nMK bits:       \t512\n";
        assert_eq!(parse_payload_offset(dump), Some(4096 * 512));
        assert_eq!(parse_payload_offset("Version: 2\n"), None);
        assert_eq!(parse_payload_offset("Payload offset: x\n"), None);
    }

    #[test]
    fn nbdinfo_size_is_one_number() {
        assert_eq!(parse_size("268435456\n"), Some(268_435_456));
        assert_eq!(parse_size("nbdinfo: error\n"), None);
    }

    fn res(figs: [f64; 5]) -> Results {
        Results {
            samples: Load::ALL
                .iter()
                .zip(figs)
                .map(|(&l, x)| {
                    vec![Sample {
                        mib_s: x,
                        iops: (l != Load::CopyRead && l != Load::CopyWrite).then_some(x * 10.0),
                    }]
                })
                .collect(),
            ..Results::empty()
        }
    }

    #[test]
    fn verdicts_check_target_and_raw_bound() {
        let raw = res([100.0, 100.0, 100.0, 100.0, 100.0]);
        let ours = res([90.0, 111.0, 50.0, 60.0, 60.0]);
        let peer = res([40.0, 40.0, 30.0, 30.0, 31.0]);
        let v = verdicts(&[raw, ours, peer]);
        assert!(v[0].target_met && !v[0].exceeds_raw_bound);
        assert!(v[1].exceeds_raw_bound, "111 > 1.1 x 100");
        assert!(!v[2].target_met, "50 / 30 < 2");
        assert_eq!(v[2].ratio_ours_vs_nbdkit, Some(round2(500.0 / 300.0)));
        assert!(v[3].target_met);
        assert!(!v[4].target_met, "60 / 31 < 2");
    }

    #[test]
    fn same_bytes_finds_the_first_difference() {
        let d = std::env::temp_dir().join(format!("nbdr-same-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (a, b) = (d.join("a"), d.join("b"));
        std::fs::write(&a, vec![7u8; 3000]).unwrap();
        let mut x = vec![7u8; 3000];
        std::fs::write(&b, &x).unwrap();
        assert_eq!(same_bytes(&a, &b), Ok(()));
        x[2100] = 8;
        std::fs::write(&b, &x).unwrap();
        assert_eq!(
            same_bytes(&a, &b),
            Err("the two reads differ at byte 2100".into())
        );
        std::fs::write(&b, &x[..100]).unwrap();
        assert!(same_bytes(&a, &b).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
