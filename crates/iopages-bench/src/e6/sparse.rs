//! E6's sparse copy: a LUKS1 image whose payload is mostly holes (10 %
//! written, in 100 regions spread over the volume), copied out whole by
//! nbdcopy and `qemu-img convert` from `iopages serve --allow-discards`
//! (which reports the image's holes as HOLE|ZERO through `base:allocation`
//! and reads them as zeros), from `iopages serve` without it, from
//! nbdkit's luks filter and from qemu-nbd's LUKS driver.
//!
//! Owns: the sparse image (its payload never written but for the regions,
//! written once through `iopages serve`), the copies, their checks, the
//! table and the `nbd-sparse` report. Must never: report a copy whose tool
//! failed, whose destination is not the export's size or whose written
//! regions differ from what was written — such a server is marked failed,
//! its figures left out, and the run ends in an error after the report is
//! written; nor leave a child process or a temporary file behind.
//!
//! What the copies must agree on: the written regions, byte for byte, on
//! every server. A never-written range is a hole in the image; a server
//! without the zero rule decrypts the hole's zeros into noise (the same
//! noise on each: same key, same sectors), so there the copies from ours
//! without `--allow-discards`, nbdkit and qemu-nbd must agree with each
//! other, and the copy from ours with `--allow-discards` must be zeros.

use super::common::{os, workload, MIB};
use super::files::{fs_type, luks_format, sync_file, work_dirs, Files, LUKS_HEADER_BYTES};
use super::report::{failures, ratio_line, target_line};
use super::server::{start_server, Running, Server};
use super::tools::Tools;
use crate::harness::{Chart, Plot, PlotFile, Report, Table};
use crate::measure::median;
use crate::plot::{BarPanel, Bars};
use crate::{progress, round2, BenchError, BenchOptions};
use iopages_tools::{find_tool, run_tool, tail_lines};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Regions written into the volume.
const REGIONS: u64 = 100;
/// One byte in this many of the volume is written.
const WRITTEN_DIVISOR: u64 = 10;
/// Regions start on this boundary and are a multiple of it long.
const ALIGN: u64 = 4096;
/// Target: each other server's copy takes at least this many times as
/// long as the copy from ours with `--allow-discards`.
const TARGET_RATIO: f64 = 5.0;
/// The report's stem (`nbd-sparse.json`).
pub const STEM: &str = "nbd-sparse";

/// The servers, in table order.
const SERVERS: [Server; 4] = [
    Server::OursDiscards,
    Server::Ours,
    Server::Nbdkit,
    Server::Qemu,
];

/// The label of `s` in this part's table.
fn label(s: Server) -> &'static str {
    match s {
        Server::Ours => "iopages serve, no discards",
        _ => s.label(),
    }
}

/// The copying clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Client {
    Nbdcopy,
    QemuImg,
}

impl Client {
    const ALL: [Client; 2] = [Client::Nbdcopy, Client::QemuImg];

    fn key(self) -> &'static str {
        match self {
            Client::Nbdcopy => "nbdcopy",
            Client::QemuImg => "qemu_img",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Client::Nbdcopy => "nbdcopy export -> file",
            Client::QemuImg => "qemu-img convert -O raw",
        }
    }
}

/// A byte range of the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Extent {
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Where the data goes: `n` regions of `dev / divisor / n` bytes (rounded
/// down to 4 KiB), region `i` somewhere in the `i`-th `n`-th of the volume
/// (at a 4 KiB boundary chosen by a fixed hash of `i`, so the regions are
/// not evenly spaced and not all MiB-aligned). Sorted, disjoint, inside
/// `dev`; empty if `dev` is too small for `n` regions of 4 KiB.
pub fn regions(dev: u64, n: u64, divisor: u64) -> Vec<Extent> {
    let len = dev / divisor.max(1) / n.max(1) / ALIGN * ALIGN;
    let stride = dev / n.max(1) / ALIGN * ALIGN;
    if len == 0 || stride < len {
        return Vec::new();
    }
    let slots = (stride - len) / ALIGN + 1;
    (0..n)
        .map(|i| {
            // splitmix64 of i: a fixed, well-spread choice of slot.
            let mut z = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            Extent {
                offset: i * stride + (z % slots) * ALIGN,
                len,
            }
        })
        .collect()
}

/// The ranges of `[0, dev)` outside the sorted, disjoint `written`.
pub fn gaps(dev: u64, written: &[Extent]) -> Vec<Extent> {
    let mut out = Vec::new();
    let mut at = 0;
    for e in written {
        if e.offset > at {
            out.push(Extent {
                offset: at,
                len: e.offset - at,
            });
        }
        at = at.max(e.offset + e.len);
    }
    if dev > at {
        out.push(Extent {
            offset: at,
            len: dev - at,
        });
    }
    out
}

/// What `nbdinfo --map` says of an export: bytes by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MapTotals {
    /// Extents listed.
    pub extents: usize,
    /// Bytes reported allocated (neither hole nor zero).
    pub data_bytes: u64,
    /// Bytes reported as holes (NBD_STATE_HOLE).
    pub hole_bytes: u64,
    /// Bytes reported to read as zeros (NBD_STATE_ZERO).
    pub zero_bytes: u64,
}

/// Parse `nbdinfo --map`'s lines (`offset length type description`, the
/// type being `base:allocation`'s flags: 1 hole, 2 zero). `None` for no
/// extents or a line that is not one.
pub fn parse_map(stdout: &str) -> Option<MapTotals> {
    let mut t = MapTotals::default();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let mut w = line.split_whitespace();
        let _offset: u64 = w.next()?.parse().ok()?;
        let len: u64 = w.next()?.parse().ok()?;
        let kind: u32 = w.next()?.parse().ok()?;
        t.extents += 1;
        if kind & 1 != 0 {
            t.hole_bytes += len;
        }
        if kind & 2 != 0 {
            t.zero_bytes += len;
        }
        if kind & 3 == 0 {
            t.data_bytes += len;
        }
    }
    (t.extents > 0).then_some(t)
}

/// Bytes a file takes on its file system (`st_blocks` × 512).
fn allocated(path: &Path) -> std::io::Result<u64> {
    Ok(std::fs::metadata(path)?.blocks() * 512)
}

/// Pseudo-random bytes (xorshift64), 8 at a time from `seed`.
fn random_fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for w in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
}

/// The source of the writes: a sparse file of `dev` bytes holding random
/// data in `written` and holes elsewhere (what the volume must read as
/// through a server that reads holes as zeros).
fn write_source(path: &Path, dev: u64, written: &[Extent]) -> Result<(), BenchError> {
    let err = |e| BenchError::Write {
        path: path.to_path_buf(),
        source: e,
    };
    let file = std::fs::File::create(path).map_err(err)?;
    file.set_len(dev).map_err(err)?;
    for (i, e) in written.iter().enumerate() {
        let mut buf = vec![0u8; e.len as usize];
        random_fill(&mut buf, 0xA076_1D64_78BD_642F ^ (i as u64 + 1) << 20);
        file.write_all_at(&buf, e.offset).map_err(err)?;
    }
    file.sync_all().map_err(err)
}

/// What the check of one copy found.
#[derive(Clone, Debug, PartialEq)]
struct Check {
    /// Every never-written byte is zero.
    gaps_zero: bool,
    /// SHA-256 of the never-written ranges, in order.
    gaps_sha256: String,
}

/// Check the copy `dest` of the export: its size, the written regions
/// against `source`, and what the never-written ranges hold.
fn check_copy(dest: &Path, source: &Path, dev: u64, written: &[Extent]) -> Result<Check, String> {
    let open = |p: &Path| std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()));
    let (d, s) = (open(dest)?, open(source)?);
    let len = d.metadata().map_err(|e| e.to_string())?.len();
    if len != dev {
        return Err(format!("the copy is {len} bytes, the export {dev}"));
    }
    let chunk = MIB as usize;
    let (mut a, mut b) = (vec![0u8; chunk], vec![0u8; chunk]);
    for e in written {
        let mut at = e.offset;
        while at < e.offset + e.len {
            let n = chunk.min((e.offset + e.len - at) as usize);
            d.read_exact_at(&mut a[..n], at)
                .and_then(|_| s.read_exact_at(&mut b[..n], at))
                .map_err(|e| format!("cannot read the copy at {at}: {e}"))?;
            if a[..n] != b[..n] {
                let first = a[..n].iter().zip(&b[..n]).position(|(x, y)| x != y);
                return Err(format!(
                    "the written region at byte {} ({} bytes) differs from what was written, first at byte {}",
                    e.offset,
                    e.len,
                    at + first.unwrap_or(0) as u64
                ));
            }
            at += n as u64;
        }
    }
    let mut sha = openssl::sha::Sha256::new();
    let mut zero = true;
    for e in gaps(dev, written) {
        let mut at = e.offset;
        while at < e.offset + e.len {
            let n = chunk.min((e.offset + e.len - at) as usize);
            d.read_exact_at(&mut a[..n], at)
                .map_err(|e| format!("cannot read the copy at {at}: {e}"))?;
            zero = zero && a[..n].iter().all(|&x| x == 0);
            sha.update(&a[..n]);
            at += n as u64;
        }
    }
    Ok(Check {
        gaps_zero: zero,
        gaps_sha256: sha.finish().iter().map(|b| format!("{b:02x}")).collect(),
    })
}

/// The tools of this part: the E6 ones it starts servers with, and the
/// optional clients.
struct SparseTools {
    tools: Tools,
    qemu_img: Option<PathBuf>,
    /// Why a server cannot run here, if it cannot.
    missing: BTreeMap<&'static str, String>,
    /// Why qemu-img's copies are left out, if they are.
    qemu_img_missing: Option<String>,
}

/// Whether `nbdkit` has its luks filter (`--dump-plugin` with it
/// succeeds).
fn luks_filter_works(nbdkit: &Path, dir: &Path) -> bool {
    run_tool(
        nbdkit,
        &os(&[&"--filter=luks", &"null", &"--dump-plugin"]),
        dir,
        Duration::from_secs(30),
        &[],
    )
    .is_ok_and(|r| r.status.success())
}

/// Whether `iopages_bin serve` takes `--allow-discards`: before it
/// existed, `serve --help` did not name it.
fn has_allow_discards(iopages_bin: &Path, dir: &Path) -> bool {
    let help = run_tool(
        iopages_bin,
        &os(&[&"serve", &"--help"]),
        dir,
        Duration::from_secs(30),
        &[],
    )
    .map(|r| r.stdout)
    .unwrap_or_default();
    help.contains("--allow-discards")
}

impl SparseTools {
    fn find(dir: &Path, peers: bool, iopages_bin: &Path) -> Result<SparseTools, BenchError> {
        let need = |name: &str, pkg: &str, why: &str| {
            find_tool(name).ok_or_else(|| {
                workload(format!(
                    "{name} is not installed ({why}); scripts/setup-debian.sh installs it (Debian package {pkg})"
                ))
            })
        };
        let cryptsetup = need("cryptsetup", "cryptsetup-bin", "it formats the LUKS1 image")?;
        let nbdcopy = need(
            "nbdcopy",
            "libnbd-bin",
            "it writes the regions and is a client",
        )?;
        let mut missing = BTreeMap::new();
        let mut peer = |s: Server, name: &str, pkg: &str| match find_tool(name) {
            Some(p) => p,
            None => {
                missing.insert(
                    s.key(),
                    format!(
                        "{name} is not installed (Debian package {pkg}; scripts/setup-debian.sh)"
                    ),
                );
                PathBuf::from(name)
            }
        };
        let nbdkit = peer(Server::Nbdkit, "nbdkit", "nbdkit");
        let qemu_nbd = peer(Server::Qemu, "qemu-nbd", "qemu-utils");
        if !missing.contains_key(Server::Nbdkit.key()) && peers && !luks_filter_works(&nbdkit, dir)
        {
            missing.insert(
                Server::Nbdkit.key(),
                "nbdkit's luks filter is missing".into(),
            );
        }
        if !peers {
            for s in [Server::Nbdkit, Server::Qemu] {
                missing.insert(s.key(), "--no-peers".into());
            }
        }
        if !has_allow_discards(iopages_bin, dir) {
            missing.insert(
                Server::OursDiscards.key(),
                format!("{} serve has no --allow-discards", iopages_bin.display()),
            );
        }
        let qemu_img = find_tool("qemu-img");
        let qemu_img_missing = qemu_img.is_none().then(|| {
            "qemu-img is not installed (Debian package qemu-utils; scripts/setup-debian.sh)"
                .to_string()
        });
        let nbdinfo = find_tool("nbdinfo").unwrap_or_else(|| PathBuf::from("nbdinfo"));
        Ok(SparseTools {
            tools: Tools {
                cryptsetup,
                fio: PathBuf::from("fio"),
                nbdcopy,
                nbdinfo,
                nbdkit,
                qemu_nbd,
            },
            qemu_img,
            missing,
            qemu_img_missing,
        })
    }
}

/// One (server, client) pair's figures.
#[derive(Clone, Debug, Default)]
struct Cell {
    /// Wall seconds of each run's copy.
    secs: Vec<f64>,
    /// The destination's allocated bytes after each run's copy.
    allocated: Vec<u64>,
    /// The first run's content check.
    check: Option<Check>,
}

impl Cell {
    fn best(&self) -> Option<f64> {
        self.secs.iter().copied().reduce(f64::min)
    }
}

/// One server's results.
#[derive(Clone, Debug, Default)]
struct Results {
    cells: Vec<Cell>,
    pub(super) failed: Option<String>,
    skipped: Option<String>,
    pub(super) command: String,
    pub(super) stops: Vec<String>,
    map: Option<MapTotals>,
}

impl Results {
    fn best(&self, c: Client) -> Option<f64> {
        self.secs(c).iter().copied().reduce(f64::min)
    }

    /// Each run's copy time with client `c`, in run order (none for a
    /// server that failed or was skipped).
    fn secs(&self, c: Client) -> &[f64] {
        if self.failed.is_some() || self.skipped.is_some() {
            return &[];
        }
        &self.cells[Client::ALL.iter().position(|&x| x == c).expect("listed")].secs
    }
}

/// The settings of one run.
struct Plan {
    dev: u64,
    written: Vec<Extent>,
    runs: usize,
    image_allocated: u64,
    fs: String,
}

/// The sparse copy. `iopages_bin` is the `iopages` executable whose
/// `serve` is measured. Returns the report (`nbd-sparse.json` unless
/// `--json` names one); a server that fails is reported and then returned
/// as an error.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (runs, payload) = if opts.quick {
        (1usize, 256 * MIB)
    } else {
        (3, 1024 * MIB)
    };
    let (json_path, _) = opts.paths(STEM);
    // Declared before any server: dropped (removed) after they are stopped.
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, "nbd-sparse")?;
    let st = SparseTools::find(&work, opts.peers, iopages_bin)?;
    let mut f = Files {
        image: work.join("luks1-sparse.img"),
        pass: work.join("passphrase"),
        source: work.join("written.bin"),
        work: work.clone(),
        socks,
        tls: None,
        read_only: false,
    };
    let fs = fs_type(&work);
    progress(
        STEM,
        format!(
            "E6 sparse copy: one LUKS1 image of {} MiB payload{} on {fs} under {}, {} written in {REGIONS} regions through iopages serve; copied whole by nbdcopy and qemu-img convert, {runs} run(s), best time kept",
            payload / MIB,
            if opts.quick { " (--quick: 256 MiB)" } else { "" },
            work.display(),
            format_args!("1/{WRITTEN_DIVISOR}"),
        ),
    );

    let (dev, written, image_allocated) = make_image(&st, iopages_bin, &f, payload, &fs)?;
    f.read_only = true;
    let plan = Plan {
        dev,
        written,
        runs,
        image_allocated,
        fs,
    };
    let results = run_servers(&st, iopages_bin, &f, &plan);
    report(opts, &st, &plan, &results, &json_path)
}

/// The image: a hole of the payload's size, then the LUKS1 header, and
/// the written regions through `iopages serve` (on the file system `fs`).
///
/// **Returns:** the export's size, the written regions and the image's
/// allocated bytes.
fn make_image(
    st: &SparseTools,
    iopages_bin: &Path,
    f: &Files,
    payload: u64,
    fs: &str,
) -> Result<(u64, Vec<Extent>, u64), BenchError> {
    let img_err = |e| BenchError::Write {
        path: f.image.clone(),
        source: e,
    };
    std::fs::File::create(&f.image)
        .and_then(|x| x.set_len(payload + LUKS_HEADER_BYTES))
        .map_err(img_err)?;
    let dev = luks_format(&st.tools, f)?;
    let written = regions(dev, REGIONS, WRITTEN_DIVISOR);
    if written.is_empty() {
        return Err(workload(format!("a {dev}-byte export is too small")));
    }
    write_source(&f.source, dev, &written)?;
    let written_bytes: u64 = written.iter().map(|e| e.len).sum();
    progress(
        STEM,
        format!(
            "writing {} MiB in {} regions of {} KiB through iopages serve (nbdcopy --destination-is-zero from a sparse file)",
            written_bytes / MIB,
            written.len(),
            written[0].len / 1024
        ),
    );
    write_regions(st, iopages_bin, f)?;
    sync_file(&f.image);
    let image_allocated = allocated(&f.image).map_err(img_err)?;
    progress(
        STEM,
        format!(
            "image: {:.1} MiB of {:.1} MiB allocated (header {} MiB, written {:.1} MiB)",
            image_allocated as f64 / MIB as f64,
            (dev + LUKS_HEADER_BYTES) as f64 / MIB as f64,
            LUKS_HEADER_BYTES / MIB,
            written_bytes as f64 / MIB as f64
        ),
    );
    if image_allocated > (dev + LUKS_HEADER_BYTES) / 2 {
        progress(
            STEM,
            format!("WARNING: the image is not sparse on {fs}: the copies have no holes to skip"),
        );
    }
    Ok((dev, written, image_allocated))
}

/// Write the regions: `iopages serve` (writable, without
/// `--allow-discards`: writes of data land the same with it) and
/// `nbdcopy --destination-is-zero` from the sparse source, which sends
/// only the source's data.
fn write_regions(st: &SparseTools, iopages_bin: &Path, f: &Files) -> Result<(), BenchError> {
    let (mut r, line) = start_server(Server::Ours, &st.tools, iopages_bin, f)?;
    let c = run_tool(
        &st.tools.nbdcopy,
        &os(&[&"--destination-is-zero", &f.source, &r.uri]),
        &f.work,
        Duration::from_secs(300),
        &[],
    );
    let alive = r.alive();
    let stopped = r.stop();
    let c = c.map_err(|e| workload(format!("writing the regions: {e}")))?;
    if !c.status.success() {
        return Err(workload(format!(
            "writing the regions through {line}: nbdcopy {}; stderr: {}",
            c.status,
            tail_lines(&c.stderr)
        )));
    }
    alive.map_err(|e| workload(format!("writing the regions: {e} ({stopped})")))
}

/// The copy command of `client` from `uri` to `dest`.
fn copy_command(
    st: &SparseTools,
    client: Client,
    uri: &str,
    dest: &Path,
) -> (PathBuf, Vec<OsString>) {
    match client {
        // Defaults: extents on, 4 connections with multi-conn, zero
        // detection; no --flush.
        Client::Nbdcopy => (st.tools.nbdcopy.clone(), os(&[&uri, &dest])),
        // Defaults but for the destination's cache: unsafe (no flush), as
        // nbdcopy's.
        Client::QemuImg => (
            st.qemu_img.clone().unwrap_or_else(|| "qemu-img".into()),
            os(&[
                &"convert", &"-f", &"raw", &"-O", &"raw", &"-t", &"unsafe", &uri, &dest,
            ]),
        ),
    }
}

/// The servers in turn, each run starting with the next; per server each
/// client (each run starting with the next) copies the whole export to a
/// file, which is checked (first run) and removed.
fn run_servers(st: &SparseTools, iopages_bin: &Path, f: &Files, plan: &Plan) -> Vec<Results> {
    let mut results: Vec<Results> = SERVERS
        .iter()
        .map(|s| Results {
            cells: vec![Cell::default(); Client::ALL.len()],
            skipped: st.missing.get(s.key()).cloned(),
            ..Results::default()
        })
        .collect();
    for (s, r) in SERVERS.iter().zip(&results) {
        if let Some(why) = &r.skipped {
            progress(STEM, format!("  skipped ({}): {why}", label(*s)));
        }
    }
    if let Some(why) = &st.qemu_img_missing {
        progress(STEM, format!("  qemu-img copies skipped: {why}"));
    }
    let timeout = Duration::from_secs(120 + plan.dev / (4 * MIB));
    for run in 0..plan.runs {
        let order: Vec<usize> = (0..SERVERS.len())
            .map(|i| (i + run) % SERVERS.len())
            .collect();
        for i in order {
            let s = SERVERS[i];
            if results[i].failed.is_some() || results[i].skipped.is_some() {
                continue;
            }
            progress(STEM, format!("run {}/{}: {}", run + 1, plan.runs, label(s)));
            let outcome = one_server(st, iopages_bin, f, plan, s, run, timeout, &mut results[i]);
            if let Err(why) = outcome {
                progress(STEM, format!("  FAILED ({}): {why}", label(s)));
                results[i].failed = Some(why);
            }
        }
    }
    cross_check(&mut results);
    results
}

/// One server's run: start it, map it (first run), each client's copy.
#[allow(clippy::too_many_arguments)]
fn one_server(
    st: &SparseTools,
    iopages_bin: &Path,
    f: &Files,
    plan: &Plan,
    s: Server,
    run: usize,
    timeout: Duration,
    res: &mut Results,
) -> Result<(), String> {
    let (mut r, line) = start_server(s, &st.tools, iopages_bin, f).map_err(|e| e.to_string())?;
    res.command = line;
    let out = copies(st, f, plan, s, &mut r, run, timeout, res);
    res.stops.push(r.stop());
    out
}

/// `nbdinfo --map` of the export at `uri`, summed (and printed); `None`
/// where nbdinfo failed.
fn map_of(st: &SparseTools, f: &Files, uri: &str) -> Option<MapTotals> {
    let map = run_tool(
        &st.tools.nbdinfo,
        &os(&[&"--map", &uri]),
        &f.work,
        Duration::from_secs(60),
        &[],
    )
    .ok()
    .filter(|c| c.status.success())
    .and_then(|c| parse_map(&c.stdout));
    if let Some(m) = map {
        progress(
            STEM,
            format!(
                "  nbdinfo --map: {} extents, {:.1} MiB data, {:.1} MiB hole, {:.1} MiB zero",
                m.extents,
                m.data_bytes as f64 / MIB as f64,
                m.hole_bytes as f64 / MIB as f64,
                m.zero_bytes as f64 / MIB as f64
            ),
        );
    }
    map
}

/// The copies of one run from the running server `r`.
#[allow(clippy::too_many_arguments)]
fn copies(
    st: &SparseTools,
    f: &Files,
    plan: &Plan,
    s: Server,
    r: &mut Running,
    run: usize,
    timeout: Duration,
    res: &mut Results,
) -> Result<(), String> {
    if res.map.is_none() {
        res.map = map_of(st, f, &r.uri);
    }
    let mut line = Vec::new();
    // Each run starts with the next client: neither always copies first
    // from a freshly started server.
    let n = Client::ALL.len();
    for ci in (0..n).map(|k| (k + run) % n) {
        let client = Client::ALL[ci];
        if client == Client::QemuImg && st.qemu_img.is_none() {
            continue;
        }
        let dest = f
            .work
            .join(format!("copy-{}-{}.raw", s.key(), client.key()));
        let _ = std::fs::remove_file(&dest);
        let (prog, args) = copy_command(st, client, &r.uri, &dest);
        let c = run_tool(&prog, &args, &f.work, timeout, &[]);
        let outcome = (|| {
            let c = c.map_err(|e| format!("{}: {e}", client.label()))?;
            if !c.status.success() {
                return Err(format!(
                    "{}: {} {}; stderr: {}",
                    client.label(),
                    prog.display(),
                    c.status,
                    tail_lines(&c.stderr)
                ));
            }
            r.alive()
                .map_err(|e| format!("after {}: {e}", client.label()))?;
            let bytes =
                allocated(&dest).map_err(|e| format!("{}: the copy: {e}", client.label()))?;
            if run == 0 {
                let chk = check_copy(&dest, &f.source, plan.dev, &plan.written)
                    .map_err(|e| format!("{}: {e}", client.label()))?;
                res.cells[ci].check = Some(chk);
            }
            Ok((c.secs, bytes))
        })();
        let _ = std::fs::remove_file(&dest);
        let (secs, bytes) = outcome?;
        res.cells[ci].secs.push(secs);
        res.cells[ci].allocated.push(bytes);
        line.push(format!(
            "{} {secs:.2} s ({:.0} MiB written)",
            client.key(),
            bytes as f64 / MIB as f64
        ));
    }
    progress(STEM, format!("  {}", line.join(", ")));
    Ok(())
}

/// The never-written ranges: zeros from ours with `--allow-discards`; the
/// same bytes from every other server (and client) as from ours without
/// it. A server that disagrees is marked failed.
fn cross_check(results: &mut [Results]) {
    let reference: Option<String> = SERVERS
        .iter()
        .position(|&s| s == Server::Ours)
        .and_then(|i| results[i].cells.iter().find_map(|c| c.check.clone()))
        .map(|c| c.gaps_sha256);
    for (i, &s) in SERVERS.iter().enumerate() {
        let res = &mut results[i];
        if res.failed.is_some() {
            continue;
        }
        for (ci, cell) in res.cells.iter().enumerate() {
            let Some(chk) = &cell.check else { continue };
            let why = if s == Server::OursDiscards {
                (!chk.gaps_zero).then(|| {
                    "reads non-zero bytes in the never-written ranges (holes of the image)"
                        .to_string()
                })
            } else {
                reference
                    .as_ref()
                    .filter(|r| **r != chk.gaps_sha256)
                    .map(|r| {
                        format!(
                            "its copy's never-written ranges (sha256 {}) differ from iopages serve's without --allow-discards (sha256 {r})",
                            chk.gaps_sha256
                        )
                    })
            };
            if let Some(why) = why {
                let why = format!("{}: {why}", Client::ALL[ci].label());
                progress(STEM, format!("  FAILED ({}): {why}", label(s)));
                res.failed = Some(why);
                break;
            }
        }
    }
}

/// Each other server's copy time over ours with `--allow-discards`, per
/// client — the median over runs of each run's ratio (the two copies of a
/// run are adjacent in time) — and the smallest.
struct Ratios {
    /// `(client, server, ratio)` for the three other servers.
    each: Vec<(Client, Server, Option<f64>)>,
    min: Option<f64>,
    target_met: bool,
}

impl Ratios {
    fn of(results: &[Results], clients: &[Client]) -> Ratios {
        let secs = |s: Server, c: Client| {
            let i = SERVERS.iter().position(|&x| x == s).expect("listed");
            results[i].secs(c)
        };
        let mut each = Vec::new();
        for &c in clients {
            for s in [Server::Ours, Server::Nbdkit, Server::Qemu] {
                let per_run: Vec<f64> = secs(s, c)
                    .iter()
                    .zip(secs(Server::OursDiscards, c))
                    .filter(|&(_, &d)| d > 0.0)
                    .map(|(t, d)| t / d)
                    .collect();
                let r = (!per_run.is_empty()).then(|| median(&per_run));
                each.push((c, s, r));
            }
        }
        // The target needs every ratio of the servers that ran.
        let ran: Vec<Option<f64>> = each
            .iter()
            .filter(|(_, s, _)| {
                let i = SERVERS.iter().position(|x| x == s).expect("listed");
                results[i].skipped.is_none()
            })
            .map(|x| x.2)
            .collect();
        let min = if ran.is_empty() {
            None
        } else {
            ran.iter()
                .try_fold(f64::INFINITY, |m, r| r.map(|x| m.min(x)))
        };
        Ratios {
            each,
            target_met: min.is_some_and(|m| m >= TARGET_RATIO),
            min,
        }
    }
}

/// The clients that ran.
fn clients_of(st: &SparseTools) -> Vec<Client> {
    Client::ALL
        .iter()
        .copied()
        .filter(|&c| c != Client::QemuImg || st.qemu_img.is_some())
        .collect()
}

fn report(
    opts: &BenchOptions,
    st: &SparseTools,
    plan: &Plan,
    results: &[Results],
    json_path: &Path,
) -> Result<Value, BenchError> {
    let clients = clients_of(st);
    let ratios = Ratios::of(results, &clients);
    table(plan, results, &clients, &ratios).print();
    let failed: BTreeMap<&str, String> = SERVERS
        .iter()
        .zip(results)
        .filter_map(|(s, r)| r.failed.clone().map(|w| (s.key(), w)))
        .collect();
    let plot = Plot {
        file: PlotFile::Main,
        title: "E6 sparse copy: a 10 %-written LUKS1 volume copied whole (best time)".into(),
        chart: Chart::Bars(Bars {
            series: SERVERS.iter().map(|&s| label(s).to_string()).collect(),
            panels: vec![BarPanel {
                y_label: "seconds per copy".into(),
                width_px: 1000,
                categories: clients.iter().map(|c| c.label().to_string()).collect(),
                values: results
                    .iter()
                    .map(|r| clients.iter().map(|&c| r.best(c)).collect())
                    .collect(),
            }],
        }),
    };
    let body = Body {
        servers: SERVERS
            .iter()
            .zip(results)
            .map(|(&s, r)| {
                (
                    s.key(),
                    ServerInfo {
                        label: label(s),
                        command: r.command.clone(),
                        failed: r.failed.clone(),
                        skipped: r.skipped.clone(),
                        stops: r.stops.clone(),
                        nbdinfo_map: r.map,
                    },
                )
            })
            .collect(),
        rows: rows(plan, results, &clients),
        summary: summary(plan, st, results, &clients, &ratios, &failed),
    };
    let settings = settings(opts, plan);
    let report = Report::new("E6 nbd sparse copy", settings, body)
        .stem(STEM)
        .emit(opts, &[plot])?;
    failures(&failed, "sparse copy: ", json_path)?;
    Ok(report)
}

/// How the sparse copy was made.
fn settings(opts: &BenchOptions, plan: &Plan) -> Value {
    json!({
        "runs": plan.runs,
        "quick": opts.quick,
        "export_bytes": plan.dev,
        "image": "LUKS1, aes-xts-plain64, 512-bit key, sha256, 1000 PBKDF2 iterations (as E6's); the file made sparse (truncated to size), then luksFormat: the payload is one hole",
        "written": format!("{} regions of {} bytes ({} bytes, 1/{WRITTEN_DIVISOR} of the export), region i at a 4 KiB boundary inside the i-th 1/{REGIONS} of the export, random data; written once through iopages serve (writable, buffered) with nbdcopy --destination-is-zero from a sparse file, which sends only the data", plan.written.len(), plan.written[0].len, plan.written.iter().map(|e| e.len).sum::<u64>()),
        "image_allocated_bytes": plan.image_allocated,
        "file_system": plan.fs,
        "order": "each run starts with the next server, and on each server with the next client",
        "servers": "each serves the image read-only (iopages serve --read-only --io buffered [--allow-discards], nbdkit --readonly with the luks filter, qemu-nbd --read-only with the LUKS driver) over a Unix socket, in turn, each run starting with the next",
        "clients": {
            "nbdcopy": "nbdcopy URI FILE: defaults (extents, zero detection, multi-conn), no --flush",
            "qemu_img": "qemu-img convert -f raw -O raw -t unsafe URI FILE: defaults but the destination's cache (no flush, as nbdcopy)",
        },
        "destination": "a new file in the run's directory (same file system as the image), removed after each copy; its allocated bytes (st_blocks x 512) are what the copy wrote",
        "time": "wall time of the client's process, best of the runs",
        "check": "first run of each server and client: the copy is the export's size; its written regions equal what was written (every server); its never-written ranges are zeros from iopages serve --allow-discards, and from every other server the same bytes (sha256) as from iopages serve without it (a hole decrypts to the same noise)",
        "target": format!("each other server's copy time / ours with --allow-discards >= {TARGET_RATIO}, per client: the median over runs of each run's ratio"),
    })
}

/// What the never-written ranges of a copy held.
fn gaps_word(s: Server, c: &Check) -> &'static str {
    match (c.gaps_zero, s == Server::OursDiscards) {
        (true, _) => "zeros",
        (false, true) => "NOT zeros",
        (false, false) => "noise (as no discards)",
    }
}

fn table(plan: &Plan, results: &[Results], clients: &[Client], ratios: &Ratios) -> Table {
    let mut t = Table::new("");
    let written: u64 = plan.written.iter().map(|e| e.len).sum();
    t.line(format!(
        "nbd sparse copy (E6): one LUKS1 image, {} MiB payload on {}, {:.1} MiB written in {} regions, image {:.1} MiB allocated; whole export copied to a file; best of {} run(s)",
        plan.dev / MIB,
        plan.fs,
        written as f64 / MIB as f64,
        plan.written.len(),
        plan.image_allocated as f64 / MIB as f64,
        plan.runs
    ));
    t.line(format!(
        "{:<30} | {:<24} | {:>8} {:>13} | {:>10} | {}",
        "server", "client", "best s", "min-max", "dest MiB", "never-written ranges"
    ));
    for (&s, r) in SERVERS.iter().zip(results) {
        if let Some(why) = &r.skipped {
            t.line(format!("{:<30} | skipped: {why}", label(s)));
            continue;
        }
        if let Some(why) = &r.failed {
            t.line(format!("{:<30} | FAILED: {why}", label(s)));
            continue;
        }
        for &c in clients {
            let cell = &r.cells[Client::ALL.iter().position(|&x| x == c).expect("listed")];
            let Some(best) = cell.best() else {
                t.line(format!("{:<30} | {:<24} | no figures", label(s), c.label()));
                continue;
            };
            let hi = cell.secs.iter().copied().fold(0.0, f64::max);
            let dest = cell.allocated.iter().copied().max().unwrap_or(0);
            t.line(format!(
                "{:<30} | {:<24} | {:>8.3} {:>13} | {:>10.1} | {}",
                label(s),
                c.label(),
                best,
                format!("{best:.2}-{hi:.2}"),
                dest as f64 / MIB as f64,
                cell.check.as_ref().map_or("-", |k| gaps_word(s, k))
            ));
        }
    }
    for (c, s, r) in &ratios.each {
        let what = format!("ratio {} / ours --allow-discards, {}", label(*s), c.key());
        t.line(ratio_line(&what, *r));
    }
    t.line(target_line(TARGET_RATIO, ratios.min, ratios.target_met));
    t
}

/// The report's fields beside `settings`.
#[derive(Serialize)]
struct Body {
    servers: BTreeMap<&'static str, ServerInfo>,
    rows: Vec<Row>,
    summary: serde_json::Map<String, Value>,
}

/// How a server ran.
#[derive(Serialize)]
struct ServerInfo {
    label: &'static str,
    command: String,
    failed: Option<String>,
    skipped: Option<String>,
    stops: Vec<String>,
    /// What `nbdinfo --map` said (first run), if it could say.
    nbdinfo_map: Option<MapTotals>,
}

/// One server's figures for one client.
#[derive(Serialize)]
struct Row {
    server: &'static str,
    client: &'static str,
    describe: &'static str,
    best_secs: Option<f64>,
    /// The export's bytes over the best time.
    best_mib_s: Option<f64>,
    runs_secs: Vec<f64>,
    dest_allocated_bytes: Vec<u64>,
    /// "zeros" or the never-written ranges' SHA-256.
    never_written: Option<String>,
}

fn rows(plan: &Plan, results: &[Results], clients: &[Client]) -> Vec<Row> {
    let mut out = Vec::new();
    for (&s, r) in SERVERS.iter().zip(results) {
        if r.skipped.is_some() {
            continue;
        }
        for &c in clients {
            let cell = &r.cells[Client::ALL.iter().position(|&x| x == c).expect("listed")];
            let best = r.best(c);
            out.push(Row {
                server: s.key(),
                client: c.key(),
                describe: c.label(),
                best_secs: best.map(|x| (x * 1000.0).round() / 1000.0),
                best_mib_s: best.map(|x| round2(plan.dev as f64 / MIB as f64 / x)),
                runs_secs: cell
                    .secs
                    .iter()
                    .map(|x| (x * 1000.0).round() / 1000.0)
                    .collect(),
                dest_allocated_bytes: cell.allocated.clone(),
                never_written: cell.check.as_ref().map(|k| {
                    if k.gaps_zero {
                        "zeros".to_string()
                    } else {
                        format!("sha256 {}", k.gaps_sha256)
                    }
                }),
            });
        }
    }
    out
}

fn summary(
    plan: &Plan,
    st: &SparseTools,
    results: &[Results],
    clients: &[Client],
    ratios: &Ratios,
    failed: &BTreeMap<&str, String>,
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    for (&s, r) in SERVERS.iter().zip(results) {
        for &c in &Client::ALL {
            let v = r.best(c).map(|x| (x * 1000.0).round() / 1000.0);
            m.insert(format!("{}_{}_best_secs", s.key(), c.key()), v.into());
        }
    }
    for (c, s, r) in &ratios.each {
        m.insert(
            format!("{}_ratio_{}_vs_ours_discards", c.key(), s.key()),
            r.map(round2).into(),
        );
    }
    m.insert(
        "min_ratio_vs_ours_discards".into(),
        ratios.min.map(round2).into(),
    );
    m.insert("target_ratio".into(), TARGET_RATIO.into());
    m.insert("target_met".into(), ratios.target_met.into());
    m.insert("export_bytes".into(), plan.dev.into());
    m.insert(
        "written_bytes".into(),
        plan.written.iter().map(|e| e.len).sum::<u64>().into(),
    );
    m.insert("image_allocated_bytes".into(), plan.image_allocated.into());
    m.insert(
        "clients".into(),
        json!(clients.iter().map(|c| c.key()).collect::<Vec<_>>()),
    );
    let mut skipped: BTreeMap<String, String> = SERVERS
        .iter()
        .zip(results)
        .filter_map(|(s, r)| r.skipped.clone().map(|w| (s.key().to_string(), w)))
        .collect();
    if let Some(w) = &st.qemu_img_missing {
        skipped.insert(Client::QemuImg.key().into(), w.clone());
    }
    m.insert("skipped".into(), json!(skipped));
    m.insert("failed".into(), json!(failed));
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e6::files::RemoveDirs;

    /// The command line `iopages serve` is started with for the sparse copy,
    /// for the tests.
    fn serve_line(s: Server, f: &Files) -> String {
        let tools = Tools::named();
        let cmd = crate::e6::server::server_command(
            s,
            &tools,
            Path::new("/bin/iopages"),
            f,
            Path::new("/s/x.sock"),
        );
        crate::e6::server::command_line(&cmd)
    }

    #[test]
    fn regions_are_spread_disjoint_aligned_and_a_tenth() {
        for dev in [256 * MIB, 1024 * MIB, 1024 * MIB + 12 * 4096] {
            let r = regions(dev, REGIONS, WRITTEN_DIVISOR);
            assert_eq!(r.len(), REGIONS as usize);
            let stride = dev / REGIONS / ALIGN * ALIGN;
            for (i, e) in r.iter().enumerate() {
                assert_eq!(e.offset % ALIGN, 0);
                assert_eq!(e.len % ALIGN, 0);
                assert!(e.offset >= i as u64 * stride);
                assert!(e.offset + e.len <= (i as u64 + 1) * stride, "{e:?}");
            }
            let total: u64 = r.iter().map(|e| e.len).sum();
            assert!(
                total <= dev / 10 && total > dev / 10 - REGIONS * ALIGN,
                "{total}"
            );
            // Not all at the same place in their slot.
            let first = r[0].offset;
            assert!(r
                .iter()
                .enumerate()
                .any(|(i, e)| e.offset - i as u64 * stride != first));
        }
        assert!(regions(64 * 4096, REGIONS, WRITTEN_DIVISOR).is_empty());
    }

    #[test]
    fn gaps_are_the_rest() {
        let w = [
            Extent { offset: 0, len: 10 },
            Extent { offset: 20, len: 5 },
            Extent { offset: 25, len: 5 },
        ];
        assert_eq!(
            gaps(40, &w),
            vec![
                Extent {
                    offset: 10,
                    len: 10
                },
                Extent {
                    offset: 30,
                    len: 10
                }
            ]
        );
        assert_eq!(
            gaps(30, &w),
            vec![Extent {
                offset: 10,
                len: 10
            }]
        );
        assert_eq!(gaps(7, &[]), vec![Extent { offset: 0, len: 7 }]);
        let dev = 256 * MIB;
        let r = regions(dev, REGIONS, WRITTEN_DIVISOR);
        let g = gaps(dev, &r);
        let sum = |v: &[Extent]| v.iter().map(|e| e.len).sum::<u64>();
        assert_eq!(sum(&r) + sum(&g), dev);
    }

    #[test]
    fn parses_nbdinfo_map() {
        // nbdinfo 1.14 --map of a server with base:allocation.
        let out = "         0       32768    0  data\n     32768     1015808    3  hole,zero\n   1048576       32768    0  data\n   1081344     3112960    3  hole,zero\n";
        assert_eq!(
            parse_map(out),
            Some(MapTotals {
                extents: 4,
                data_bytes: 65536,
                hole_bytes: 4_128_768,
                zero_bytes: 4_128_768,
            })
        );
        // A server without it: one allocated extent.
        let all = "         0  1073741824    0  data\n";
        assert_eq!(parse_map(all).unwrap().data_bytes, 1 << 30);
        // Zero but allocated (type 2).
        assert_eq!(parse_map("0 4096 2 zero\n").unwrap().zero_bytes, 4096);
        assert_eq!(parse_map(""), None);
        assert_eq!(parse_map("nbdinfo: error\n"), None);
        assert_eq!(parse_map("0 x 0 data\n"), None);
    }

    #[test]
    fn copy_check_finds_regions_and_zeros() {
        let dir = std::env::temp_dir().join(format!("iopages-sparse-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let _rm = RemoveDirs(vec![dir.clone()]);
        let dev = 8 * MIB;
        let w = regions(dev, 8, 4);
        let src = dir.join("src");
        write_source(&src, dev, &w).unwrap();
        // The source's data is where the regions are, holes elsewhere.
        assert!(allocated(&src).unwrap() < dev);
        let same = check_copy(&src, &src, dev, &w).unwrap();
        assert!(same.gaps_zero);
        // Noise in a gap: regions still match, gaps not zero.
        let noisy = dir.join("noisy");
        std::fs::copy(&src, &noisy).unwrap();
        let g = gaps(dev, &w)[1];
        std::fs::OpenOptions::new()
            .write(true)
            .open(&noisy)
            .unwrap()
            .write_all_at(&[7u8; 512], g.offset)
            .unwrap();
        let n = check_copy(&noisy, &src, dev, &w).unwrap();
        assert!(!n.gaps_zero);
        assert_ne!(n.gaps_sha256, same.gaps_sha256);
        // A changed byte in a region is an error; so is a short copy.
        let mut b = [0u8; 1];
        std::fs::File::open(&src)
            .unwrap()
            .read_exact_at(&mut b, w[3].offset + 100)
            .unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&noisy)
            .unwrap()
            .write_all_at(&[b[0] ^ 1], w[3].offset + 100)
            .unwrap();
        let e = check_copy(&noisy, &src, dev, &w).unwrap_err();
        assert!(
            e.contains(&format!("first at byte {}", w[3].offset + 100)),
            "{e}"
        );
        std::fs::File::options()
            .write(true)
            .open(&noisy)
            .unwrap()
            .set_len(dev - 512)
            .unwrap();
        assert!(check_copy(&noisy, &src, dev, &w)
            .unwrap_err()
            .contains("bytes, the export"));
    }

    fn results_with(secs: [[Option<f64>; 2]; 4]) -> Vec<Results> {
        secs.iter()
            .map(|v| Results {
                cells: v
                    .iter()
                    .map(|x| Cell {
                        secs: x.iter().copied().collect(),
                        allocated: vec![MIB],
                        check: None,
                    })
                    .collect(),
                ..Results::default()
            })
            .collect()
    }

    #[test]
    fn ratios_are_each_server_over_ours_with_discards() {
        let r = results_with([
            [Some(0.1), Some(0.2)],
            [Some(0.6), Some(2.0)],
            [Some(1.0), Some(1.5)],
            [Some(2.0), Some(4.0)],
        ]);
        let x = Ratios::of(&r, &Client::ALL);
        let get = |c: Client, s: Server| {
            x.each
                .iter()
                .find(|e| e.0 == c && e.1 == s)
                .unwrap()
                .2
                .unwrap()
        };
        assert!((get(Client::Nbdcopy, Server::Ours) - 6.0).abs() < 1e-9);
        assert!((get(Client::QemuImg, Server::Qemu) - 20.0).abs() < 1e-9);
        assert!((x.min.unwrap() - 7.5).abs() > 1e-9);
        assert!((x.min.unwrap() - 6.0).abs() < 1e-9);
        assert!(x.target_met);
        // A skipped peer leaves the target to the others; a missing
        // figure of one that ran fails it.
        let mut r2 = r.clone();
        r2[2].skipped = Some("--no-peers".into());
        r2[3].skipped = Some("--no-peers".into());
        assert!(Ratios::of(&r2, &Client::ALL).target_met);
        r2[1].failed = Some("x".into());
        let y = Ratios::of(&r2, &Client::ALL);
        assert!(!y.target_met && y.min.is_none());
        // No --allow-discards: nothing to compare with.
        let mut r3 = r;
        r3[0].skipped = Some("no --allow-discards".into());
        assert!(!Ratios::of(&r3, &Client::ALL).target_met);
    }

    #[test]
    fn cross_check_holds_zeros_and_agreement() {
        let check = |zero: bool, sha: &str| {
            Some(Check {
                gaps_zero: zero,
                gaps_sha256: sha.into(),
            })
        };
        let mut r = results_with([[Some(1.0); 2]; 4]);
        r[0].cells[0].check = check(true, "z");
        r[1].cells[0].check = check(false, "n");
        r[1].cells[1].check = check(false, "n");
        r[2].cells[0].check = check(false, "n");
        r[3].cells[1].check = check(false, "other");
        cross_check(&mut r);
        assert!(r[0].failed.is_none() && r[1].failed.is_none() && r[2].failed.is_none());
        assert!(r[3].failed.as_ref().unwrap().contains("differ"));
        r[0].cells[1].check = check(false, "n");
        cross_check(&mut r);
        assert!(r[0].failed.as_ref().unwrap().contains("non-zero"));
    }

    #[test]
    fn read_only_servers_and_discards() {
        let f = Files {
            work: "/w".into(),
            socks: "/s".into(),
            image: "/w/i.img".into(),
            pass: "/w/p".into(),
            source: "/w/src".into(),
            tls: None,
            read_only: true,
        };
        assert_eq!(
            serve_line(Server::OursDiscards, &f),
            "/bin/iopages serve --image /w/i.img --passphrase-file /w/p --unix /s/x.sock --name iopages --io buffered --allow-discards --read-only"
        );
        assert!(serve_line(Server::Ours, &f).ends_with("--io buffered --read-only"));
        assert!(serve_line(Server::Nbdkit, &f)
            .starts_with("nbdkit --foreground --exit-with-parent --unix /s/x.sock --readonly "));
        assert!(
            serve_line(Server::Qemu, &f).contains("--socket /s/x.sock --read-only --persistent")
        );
    }
}
