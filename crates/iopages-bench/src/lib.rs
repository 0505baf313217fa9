//! iopages experiments: the workloads behind `iopages bench <name>`.
//!
//! Owns: the measurement harness (`measure`: timing with the monotonic
//! clock and the TSC, medians; `harness`: configurations warmed up and run
//! interleaved, the typed report written, printed and plotted once), each
//! experiment's workload, its table, JSON and SVG plot. Must never: assert a timing — benchmarks measure and report;
//! the tests check correctness.
//!
//! Experiments so far:
//! - E1 `bulk`: cost of alloc+free per page, single-page API and bulk
//!   batches 1..256, beside the kernel's figures (seed 004) and the peer
//!   allocators (glibc, jemalloc, mimalloc, tcmalloc, DPDK).
//! - `mempool`: a 1 MiB request from a mempool by a loop, in bulk and by
//!   callback, warm and with the reserve serving.
//! - `counter` (E3's core): a shared page limit checked exactly, roughly and
//!   with `limited_add`, 1..N threads.
//! - `xts` (E2's cipher): AES-XTS plain64 implementations sector by sector,
//!   beside `openssl speed`, to choose the crypt target's cipher.
//! - E2 `crypt`: 1 MiB writes through the crypt target for each out-page
//!   strategy, beside the bare cipher and a pipeline with no allocation;
//!   E3 (`crypt --threads N --limit near`): the page limit checked exactly
//!   and approximately by N writers.
//! - E5 `kvmalloc`: the seed's log-commit workload (shadow buffers of
//!   64 KiB–1 MiB) in a fragmented arena full of page cache, legacy
//!   (reclaim and compaction first) against fail-fast kvmalloc.
//! - E4 `bio`: bios built from page arrays page by page and folio by folio
//!   (build and release of pins), and direct I/O of folio buffers through
//!   io_uring.
//! - E6 `nbd` (the folder `e6/`, whose `mod.rs` maps its files): one LUKS1 image served over NBD by `iopages serve --image`,
//!   nbdkit's luks filter and qemu-nbd's LUKS driver in turn, under fio's
//!   nbd engine (1 MiB sequential, 4 KiB random) and nbdcopy.
//! - E6's sparse copy (`sparse`, part of `nbd`): a LUKS1 volume 10 %
//!   written, copied whole by nbdcopy and qemu-img from `iopages serve
//!   --allow-discards` (holes reported and read as zeros), from `iopages
//!   serve` without it, nbdkit and qemu-nbd.
//! - E6 remote `nbd --remote`: the LUKS1 image's ciphertext on a remote
//!   nbdkit file export, served by `iopages serve` and by nbdkit's luks
//!   filter over its nbd plugin, beside the raw remote.
//! - E6 tenants (`nbd_tenants`, part of `nbd`): one `iopages serve` on TCP
//!   shared by fio from 127.0.0.1 and 8 hostile peers from 127.0.0.2–9
//!   (silent sockets and unread READs, then WRITE_ZEROES floods), against
//!   fio alone: issue 28's fairness targets.
//! - E6 integrity `nbd --integrity`: plain, hmac-sha256 and aead LUKS2
//!   volumes on one nbdkit file store, served by `iopages serve` in turn,
//!   their ratios to plain against the CPU bound of each MAC, and the
//!   store I/Os of a 4 KiB write.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod bio;
pub mod bulk;
pub mod c_abi;
pub mod counter;
pub mod crypt;
pub mod harness;
pub mod io_shaped;
pub mod kvmalloc;
pub mod luks_keys;
pub mod measure;
pub mod mempool;
pub mod peers;
pub mod plot;
pub mod xts;
pub mod xts_pages;

mod e6;
pub use e6::{
    ceiling as nbd_ceiling, connections as nbd_connections, integrity as nbd_integrity,
    outage as nbd_outage, remote as nbd_remote, sparse, tenants as nbd_tenants,
};

/// E6 (`iopages bench nbd`, its code in `e6/`) under the path the command
/// and the tests have always called.
pub mod nbd {
    pub use crate::e6::files::TlsSetup;
    pub use crate::e6::fio::{parse_fio, FioFigures};
    pub use crate::e6::runs::{run, run_with};
    /// The test certificates of `bench nbd --tls` (they live in
    /// `iopages-tools`).
    pub use iopages_tools::pki::{write_pki, write_psk, Pki};
}

use std::path::PathBuf;

/// Settings shared by every experiment.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Short run (under 30 s in all) for CI and checks.
    pub quick: bool,
    /// Where to write the JSON report (the SVG goes beside it). `None`:
    /// `<out_dir>/<experiment>.json`.
    pub json: Option<PathBuf>,
    /// Directory for reports when `json` is not given.
    pub out_dir: PathBuf,
    /// Run the peer allocators beside iopages where an experiment has them.
    pub peers: bool,
    /// Where the peer harness binaries are built.
    pub peers_dir: PathBuf,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            quick: false,
            json: None,
            out_dir: PathBuf::from("bench-out"),
            peers: true,
            peers_dir: PathBuf::from("target/peers"),
        }
    }
}

impl BenchOptions {
    /// The JSON path for `experiment`, and the SVG path beside it.
    pub fn paths(&self, experiment: &str) -> (PathBuf, PathBuf) {
        let json = self
            .json
            .clone()
            .unwrap_or_else(|| self.out_dir.join(format!("{experiment}.json")));
        let svg = json.with_extension("svg");
        (json, svg)
    }
}

/// Errors of the benchmark harness.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The allocator under test could not be built.
    #[error("could not set up the allocator: {0}")]
    Setup(#[from] iopages::Error),
    /// A report could not be written.
    #[error("could not write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The plot could not be drawn.
    #[error("could not draw the plot {path}: {reason}")]
    Plot {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A workload misbehaved (for example the allocator ran dry).
    #[error("{0}")]
    Workload(String),
}

/// Write `value` as pretty JSON to `path`, creating the directory.
pub fn write_json(path: &std::path::Path, value: &serde_json::Value) -> Result<(), BenchError> {
    let err = |source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let text = serde_json::to_string_pretty(value).expect("JSON values always serialize");
    std::fs::write(path, text + "\n").map_err(err)
}

/// A line of progress on stderr (the tables go to stdout).
pub fn progress(experiment: &str, msg: impl std::fmt::Display) {
    eprintln!("[{experiment}] {msg}");
}

/// "met" or "NOT met", for target lines.
pub fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

/// `x` rounded to two decimals, for reports.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
