//! The remote store of E6 remote (`iopages bench nbd --remote --store
//! nbdkit|ceph`): where the LUKS1 image and the plaintext raw export live
//! while the LUKS servers take turns in front of them.
//!
//! Owns: starting the store once per run and stopping it (drop included)
//! — one nbdkit `file` process exporting the two files of the store
//! directory, or a single-node Ceph cluster of scripts/ceph-store.sh with
//! one RBD image per export, each exported over NBD on its own Unix
//! socket (qemu-nbd with qemu's rbd driver, or nbdkit's Python plugin
//! where that cannot be installed); copying the files onto the RBD
//! images; saying whether the store is still alive; the words the report
//! uses for it. Must never: leave the cluster's daemons running
//! (`ceph-store.sh down` on every path, a failed `up` included), or signal
//! a process it did not start.

use super::{start, Proc, Tools};
use crate::e6::common::{os, MIB};
use crate::progress;
use iopages_tools::{find_tool, run_tool, tail_lines};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The file names of the two exports in the store directory.
pub(super) const LUKS_FILE: &str = "luks1.img";
pub(super) const RAW_FILE: &str = "raw.img";
/// The RBD image of the raw export (the LUKS image is the script's `vol`).
const RAW_IMAGE: &str = "raw";
/// `ceph-store.sh up` may install Debian's Ceph and an exporter first.
const CEPH_UP_TIMEOUT: Duration = Duration::from_secs(900);
const CEPH_STEP_TIMEOUT: Duration = Duration::from_secs(300);

/// Which store holds the ciphertext.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// nbdkit's `file` plugin over files in the page cache (the default).
    Nbdkit,
    /// RBD images of a single-node Ceph cluster (scripts/ceph-store.sh).
    Ceph,
}

impl Store {
    /// Its name in the report.
    pub fn key(self) -> &'static str {
        match self {
            Store::Nbdkit => "nbdkit",
            Store::Ceph => "ceph",
        }
    }

    /// The report's file stem (the two stores' reports do not overwrite
    /// each other in one `--out-dir`).
    pub(super) fn stem(self) -> &'static str {
        match self {
            Store::Nbdkit => "nbd-remote",
            Store::Ceph => "nbd-remote-ceph",
        }
    }

    /// What it is, for the table's title and the progress lines.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Store::Nbdkit => "a remote nbdkit file export",
            Store::Ceph => {
                "an RBD image of a single-node Ceph cluster (memstore OSD) exported over NBD"
            }
        }
    }
}

/// One export of the store: its Unix socket and its export name.
#[derive(Clone, Debug)]
pub(super) struct Export {
    pub sock: PathBuf,
    pub name: String,
}

impl Export {
    pub(super) fn uri(&self) -> String {
        format!("nbd+unix:///{}?socket={}", self.name, self.sock.display())
    }

    /// The export at an `nbd+unix:///?socket=PATH` URI (what
    /// ceph-store.sh prints).
    fn from_uri(uri: &str) -> Result<Export, String> {
        let sock = uri
            .strip_prefix("nbd+unix:///?socket=")
            .ok_or_else(|| format!("ceph-store.sh printed {uri:?}, not an nbd+unix URI"))?;
        Ok(Export {
            sock: PathBuf::from(sock),
            name: String::new(),
        })
    }
}

/// The store while it runs: its two exports, how it was started, and its
/// processes.
pub(super) struct Running {
    pub luks: Export,
    pub raw: Export,
    /// How it was started (the raw remote's command in the report).
    pub command: String,
    /// What it is, for the report's settings.
    pub settings: String,
    procs: Procs,
}

enum Procs {
    Nbdkit(Proc),
    Ceph(Cluster),
}

impl Running {
    /// Err naming what died.
    pub(super) fn alive(&mut self) -> Result<(), String> {
        match &mut self.procs {
            Procs::Nbdkit(p) => p.alive(),
            Procs::Ceph(c) => c.alive(),
        }
    }

    /// The store's process, when it is one (nbdkit; not a Ceph cluster).
    pub(super) fn pid(&self) -> Option<u32> {
        match &self.procs {
            Procs::Nbdkit(p) => p.pid(),
            Procs::Ceph(_) => None,
        }
    }

    /// Stop it (once); how that went, in words.
    pub(super) fn stop(&mut self) -> String {
        match &mut self.procs {
            Procs::Nbdkit(p) => p.stop(),
            Procs::Ceph(c) => c.down(),
        }
    }
}

/// The nbdkit store: one `nbdkit file dir=STORE` process on `sock`.
pub(super) fn start_nbdkit(
    tools: &Tools,
    store: &Path,
    sock: &Path,
    work: &Path,
) -> Result<Running, String> {
    let mut cmd = Command::new(&tools.nbdkit);
    cmd.arg("--foreground")
        .arg("--exit-with-parent")
        .arg("--unix")
        .arg(sock)
        .arg("file")
        .arg(format!("dir={}", store.display()));
    progress("nbd-remote", "starting the remote store (nbdkit file)");
    let (p, line) = start("remote nbdkit file", "remote", cmd, sock, work)?;
    let export = |name: &str| Export {
        sock: sock.to_path_buf(),
        name: name.to_string(),
    };
    Ok(Running {
        luks: export(LUKS_FILE),
        raw: export(RAW_FILE),
        command: format!("{line} (export {RAW_FILE})"),
        settings: format!("one nbdkit file plugin process (dir=, exports {LUKS_FILE} and {RAW_FILE}) on a Unix socket for the whole run; files through the page cache"),
        procs: Procs::Nbdkit(p),
    })
}

/// scripts/ceph-store.sh: from the current directory (the repository's
/// root), else from the source tree this was built from.
pub(super) fn ceph_script() -> Option<PathBuf> {
    let here = PathBuf::from("scripts/ceph-store.sh");
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-store.sh");
    // Absolute: the script runs in the work directory.
    [here, built]
        .into_iter()
        .find(|p| p.is_file())
        .and_then(|p| p.canonicalize().ok())
}

/// A cluster of scripts/ceph-store.sh under `dir`: `down` once, on drop
/// at the latest.
struct Cluster {
    bash: PathBuf,
    script: PathBuf,
    dir: PathBuf,
    work: PathBuf,
    stopped: bool,
}

impl Cluster {
    /// `ceph-store.sh ARGS` under `timeout`: the last line it printed
    /// (its URI) and its stderr's notes.
    fn script(
        &self,
        args: &[&dyn AsRef<std::ffi::OsStr>],
        timeout: Duration,
    ) -> Result<(String, String), String> {
        let mut all = os(&[&self.script]);
        all.extend(os(args));
        let r = run_tool(&self.bash, &all, &self.work, timeout, &[])?;
        if !r.status.success() {
            return Err(format!(
                "ceph-store.sh {}: {}; stderr: {}",
                all[1].to_string_lossy(),
                r.status,
                tail_lines(&r.stderr)
            ));
        }
        let last = r.stdout.lines().last().unwrap_or_default().to_string();
        Ok((last, r.stderr))
    }

    /// Err unless every process a pid file under `dir/run` names is alive.
    fn alive(&self) -> Result<(), String> {
        let run = self.dir.join("run");
        let entries = std::fs::read_dir(&run).map_err(|e| format!("{}: {e}", run.display()))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".pid") {
                continue;
            }
            let pid = std::fs::read_to_string(e.path()).unwrap_or_default();
            if !Path::new("/proc").join(pid.trim()).exists() {
                return Err(format!("the Ceph store's {name} names no live process"));
            }
        }
        Ok(())
    }

    fn down(&mut self) -> String {
        if std::mem::replace(&mut self.stopped, true) {
            return "stopped".into();
        }
        match self.script(&[&"down", &self.dir], CEPH_STEP_TIMEOUT) {
            Ok(_) => "ceph-store.sh down: ok".into(),
            Err(e) => e,
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.down();
    }
}

/// The Ceph store: `ceph-store.sh up DIR` with the LUKS image's size,
/// `export DIR raw` with the raw export's, then both files copied onto
/// their images by nbdcopy (and removed here).
pub(super) fn start_ceph(
    tools: &Tools,
    store: &Path,
    dir: &Path,
    work: &Path,
    sizes: (u64, u64),
) -> Result<Running, String> {
    let script = ceph_script().ok_or("scripts/ceph-store.sh not found: run from the repository")?;
    let bash = find_tool("bash").ok_or("bash is not installed")?;
    for b in [sizes.0, sizes.1] {
        if b % MIB != 0 {
            return Err(format!("an RBD image of {b} bytes: whole MiB only here"));
        }
    }
    let mib = |b: u64| format!("{}M", b / MIB);
    let c = Cluster {
        bash,
        script,
        dir: dir.to_path_buf(),
        work: work.to_path_buf(),
        stopped: false,
    };
    progress(
        "nbd-remote",
        "starting the Ceph store (scripts/ceph-store.sh up; it installs what is missing)",
    );
    let t = Instant::now();
    let (luks_uri, notes) = c.script(&[&"up", &dir, &mib(sizes.0)], CEPH_UP_TIMEOUT)?;
    for l in notes.lines().filter(|l| l.starts_with("ceph-store.sh:")) {
        progress("nbd-remote", format!("  {l}"));
    }
    progress(
        "nbd-remote",
        format!(
            "  the Ceph store is up in {:.0} s",
            t.elapsed().as_secs_f64()
        ),
    );
    let (raw_uri, _) = c.script(
        &[&"export", &dir, &RAW_IMAGE, &mib(sizes.1)],
        CEPH_STEP_TIMEOUT,
    )?;
    let exporter = std::fs::read_to_string(dir.join("exporter")).unwrap_or_default();
    let exporter = exporter.trim().to_string();
    let (luks, raw) = (Export::from_uri(&luks_uri)?, Export::from_uri(&raw_uri)?);
    for (file, to) in [(LUKS_FILE, &luks), (RAW_FILE, &raw)] {
        upload(tools, &store.join(file), to, work)?;
    }
    Ok(Running {
        luks,
        raw,
        command: format!(
            "scripts/ceph-store.sh up DIR {}; export DIR {RAW_IMAGE} {} ({exporter} on the RBD image {RAW_IMAGE})",
            mib(sizes.0),
            mib(sizes.1)
        ),
        settings: format!("a single-node Ceph 16 cluster of scripts/ceph-store.sh (one mon, one mgr, one memstore OSD: data in RAM; pool size 1) with two RBD images (layering only), each exported over NBD on a Unix socket by {exporter}{}", if exporter == "qemu-nbd" { " -e 4 --persistent (multi-conn) with qemu's rbd driver, librbd's writeback cache on (qemu-nbd's default cache mode)" } else { "'s Python plugin over Ceph's rbd binding" }),
        procs: Procs::Ceph(c),
    })
}

/// `nbdcopy FILE URI`, then the file is removed (the store holds it).
fn upload(tools: &Tools, file: &Path, to: &Export, work: &Path) -> Result<(), String> {
    let r = run_tool(
        &tools.nbdcopy,
        &os(&[&file, &to.uri()]),
        work,
        Duration::from_secs(600),
        &[],
    )?;
    if !r.status.success() {
        return Err(format!(
            "nbdcopy {} {}: {}; stderr: {}",
            file.display(),
            to.uri(),
            r.status,
            tail_lines(&r.stderr)
        ));
    }
    let _ = std::fs::remove_file(file);
    Ok(())
}
