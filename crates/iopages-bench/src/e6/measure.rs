//! One server's measurement: every load timed once, between the check of
//! what the previous server wrote and the write of what the next checks.
//!
//! Owns: [`LoadTarget`] and [`load_sample_at`] (one timed load, shared by
//! E6 remote), [`measure`] (one server's pass, its failures put on the
//! right server) and [`Results`] (each server's samples). Must never:
//! keep a figure of a load whose tool failed or moved no data.

use super::common::{os, MIB};
use super::files::Files;
use super::fio::{fio, verify_region, Plan};
use super::load::{Load, Sample};
use super::server::{Running, Server};
use super::tools::{parse_size, Tools};
use crate::measure::median;
use iopages_tools::{run_tool, tail_lines};
use std::path::Path;
use std::time::Duration;

/// A failure while measuring, and whom it is put on.
pub(super) struct Failure {
    pub(super) server: Server,
    pub(super) why: String,
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

/// Whether the export behind `r` has the LUKS payload's size, as the
/// server advertises it (`nbdinfo --size`).
fn check_size(r: &Running, tools: &Tools, f: &Files, plan: &Plan) -> Result<(), String> {
    let info = run_tool(
        &tools.nbdinfo,
        &os(&[&"--size", &r.uri]),
        &f.work,
        Duration::from_secs(30),
        &[],
    )?;
    let size = parse_size(&info.stdout);
    if !info.status.success() || size != Some(plan.dev) {
        return Err(format!(
            "nbdinfo --size {}: {:?} ({}), the LUKS payload is {} bytes; stderr: {}",
            r.uri,
            size,
            info.status,
            plan.dev,
            tail_lines(&info.stderr)
        ));
    }
    Ok(())
}

/// One server's pass over every load: check the previous server's
/// read-back region, the timed loads, then write the region for the next.
pub(super) fn measure(
    r: &mut Running,
    tools: &Tools,
    f: &Files,
    plan: &Plan,
    previous: Option<Server>,
) -> Result<(Vec<Sample>, Option<Failure>), Failure> {
    let s = r.server;
    let fail = |why: String| Failure { server: s, why };
    check_size(r, tools, f, plan).map_err(fail)?;
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

/// Per server: samples of each load, or why it failed.
pub(super) struct Results {
    pub(super) samples: Vec<Vec<Sample>>,
    pub(super) failed: Option<String>,
    pub(super) command: String,
    pub(super) stops: Vec<String>,
    pub(super) multi_conn: Option<bool>,
}

impl Results {
    /// No samples yet for any load, nothing failed.
    pub(super) fn empty() -> Results {
        Results {
            samples: vec![Vec::new(); Load::ALL.len()],
            failed: None,
            command: String::new(),
            stops: Vec::new(),
            multi_conn: None,
        }
    }

    /// The median of `load`'s figures ([`Sample::figure`]), at `l`.
    pub(super) fn median(&self, l: usize, load: Load) -> Option<f64> {
        let v: Vec<f64> = self.samples[l].iter().map(|s| s.figure(load)).collect();
        (self.failed.is_none() && !v.is_empty()).then(|| median(&v))
    }

    pub(super) fn median_mib(&self, l: usize) -> Option<f64> {
        (self.failed.is_none() && !self.samples[l].is_empty())
            .then(|| median(&self.samples[l].iter().map(|s| s.mib_s).collect::<Vec<_>>()))
    }

    pub(super) fn median_iops(&self, l: usize) -> Option<f64> {
        let v: Vec<f64> = self.samples[l].iter().filter_map(|s| s.iops).collect();
        (self.failed.is_none() && !v.is_empty()).then(|| median(&v))
    }
}
