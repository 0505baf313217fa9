//! E6's report: the table, the ratios against the targets, the JSON
//! report and the bar chart.
//!
//! Owns: the targets (`TARGET_RATIO`, `TLS_TARGET_FRACTION`), [`Run`] (what
//! a report is about), [`report`] and [`failures`] (the error naming every
//! failed server, after the report is written). Must never: print a
//! figure of a failed server, or a ratio one of whose figures is missing.

use super::common::{workload, MIB};
use super::fio::{Plan, VERIFY_BYTES};
use super::load::Load;
use super::measure::Results;
use super::server::{Server, TLS_VERIFY_PEER};
use crate::harness::{Chart, Plot, PlotFile, Report, Table};
use crate::plot::{BarPanel, Bars};
use crate::{met, round2, BenchError, BenchOptions};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Target: ours at least this many times the best peer, on every load.
pub(crate) const TARGET_RATIO: f64 = 2.0;

/// TLS target: ours with TLS at least this fraction of ours without.
const TLS_TARGET_FRACTION: f64 = 0.85;

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
pub(super) struct Run<'a> {
    pub(super) servers: &'a [Server],
    pub(super) results: &'a [Results],
    pub(super) plan: &'a Plan,
    pub(super) runs: usize,
    pub(super) fs: &'a str,
    pub(super) tls: bool,
}

impl Run<'_> {
    fn fig(&self, s: Server, load: Load) -> Option<f64> {
        let i = self.servers.iter().position(|&x| x == s)?;
        figure(&self.results[i], load)
    }
}

pub(super) fn report(
    opts: &BenchOptions,
    run: &Run,
    json_path: &Path,
) -> Result<Value, BenchError> {
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
        rows: rows(run.servers.iter().map(|s| s.key()).zip(run.results)),
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
    t.line(figures_head(22));
    for (&s, r) in run.servers.iter().zip(run.results) {
        if let Some(why) = &r.failed {
            t.line(format!("{:<22} | FAILED: {why}", s.label()));
            continue;
        }
        if r.samples[0].is_empty() {
            t.line(format!("{:<22} | no figures", s.label()));
            continue;
        }
        figure_lines(&mut t, s.label(), 22, r);
    }
    ratio_lines(&mut t, run.tls, ratios);
    t
}

/// The head of the table's figures, the server's column `w` wide (E6 and
/// E6 remote).
pub(super) fn figures_head(w: usize) -> String {
    format!(
        "{:<w$} | {:<24} | {:>8} {:>13} | {:>8}",
        "server", "load", "MiB/s", "min-max", "IOPS"
    )
}

/// The table's lines of one server's figures, one per load: its `label`
/// (`w` wide), the median MiB/s and the runs' range, the median IOPS (E6
/// and E6 remote).
pub(super) fn figure_lines(t: &mut Table, label: &str, w: usize, r: &Results) {
    for (l, load) in Load::ALL.iter().enumerate() {
        let v: Vec<f64> = r.samples[l].iter().map(|x| x.mib_s).collect();
        let (lo, hi) = (
            v.iter().cloned().fold(f64::INFINITY, f64::min),
            v.iter().cloned().fold(0.0, f64::max),
        );
        t.line(format!(
            "{:<w$} | {:<24} | {:>8.0} {:>13} | {:>8}",
            label,
            load.label(),
            r.median_mib(l).unwrap_or(0.0),
            format!("{lo:.0}-{hi:.0}"),
            r.median_iops(l)
                .map_or_else(|| "-".to_string(), |x| format!("{x:.0}"))
        ));
    }
}

/// The table's ratio lines and targets (with `tls`, TLS's too).
fn ratio_lines(t: &mut Table, tls: bool, ratios: &Ratios) {
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
    t.line(target_line(TARGET_RATIO, ratios.min, ratios.target_met));
    if tls {
        for (l, r) in &ratios.tls {
            let what = format!("ratio ours TLS / ours plaintext, {}", l.short());
            t.line(ratio_line(&what, *r));
        }
        t.line(format!(
            "target TLS within {:.0} % of plaintext (every ratio >= {TLS_TARGET_FRACTION}): min {} ({})",
            (1.0 - TLS_TARGET_FRACTION) * 100.0,
            fmt_min(ratios.min_tls),
            met(ratios.tls_target_met)
        ));
    }
}

/// The smallest ratio for the table: two decimals, `-` when missing.
fn fmt_min(m: Option<f64>) -> String {
    m.map_or_else(|| "-".into(), |m| format!("{m:.2}"))
}

/// A table's line for the ratio `r` (`what: 1.23`, or `what: - (no
/// figure)`) (E6 and the sparse copy).
pub(super) fn ratio_line(what: &str, r: Option<f64>) -> String {
    match r {
        Some(x) => format!("{what}: {x:.2}"),
        None => format!("{what}: - (no figure)"),
    }
}

/// A table's line for the target: every ratio at least `target`, the
/// smallest `min`, whether that is `met` (E6 and the sparse copy).
pub(super) fn target_line(target: f64, min: Option<f64>, met_it: bool) -> String {
    format!(
        "target every ratio >= {target}: min {} ({})",
        fmt_min(min),
        met(met_it)
    )
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

/// One server's figures for one load (E6 and E6 remote).
#[derive(Serialize)]
pub(super) struct Row {
    server: &'static str,
    load: &'static str,
    describe: &'static str,
    mib_s: Option<f64>,
    iops: Option<f64>,
    runs_mib_s: Vec<f64>,
    runs_iops: Vec<Option<f64>>,
}

/// The report's rows: per server (by its key) and load, the medians and
/// every run (E6 and E6 remote).
pub(super) fn rows<'a>(servers: impl IntoIterator<Item = (&'static str, &'a Results)>) -> Vec<Row> {
    servers
        .into_iter()
        .flat_map(|(server, r)| {
            Load::ALL.iter().enumerate().map(move |(l, load)| Row {
                server,
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
        "fio": run.plan.settings(true, "export"),
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
    use crate::e6::files::RemoveDirs;
    use crate::e6::load::Sample;

    #[test]
    fn shared_table_lines() {
        assert_eq!(
            ratio_line("ratio a / b, x", Some(2.345)),
            "ratio a / b, x: 2.35"
        );
        assert_eq!(
            ratio_line("ratio a / b, x", None),
            "ratio a / b, x: - (no figure)"
        );
        assert_eq!(
            target_line(5.0, Some(6.0), true),
            format!("target every ratio >= 5: min 6.00 ({})", met(true))
        );
        assert_eq!(
            target_line(2.0, None, false),
            format!("target every ratio >= 2: min - ({})", met(false))
        );
        assert_eq!(
            figures_head(24),
            format!(
                "{:<24} | {:<24} | {:>8} {:>13} | {:>8}",
                "server", "load", "MiB/s", "min-max", "IOPS"
            )
        );
    }
    use crate::e6::runs::servers_of;

    /// A directory under the temporary one, removed when dropped.
    fn scratch(tag: &str) -> RemoveDirs {
        let d = std::env::temp_dir().join(format!("iopages-nbd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        RemoveDirs(vec![d])
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

    /// Quick options with the reports under `dir` (<dir>/nbd-tls.json and
    /// nbd.json).
    fn quick_opts(dir: &Path) -> BenchOptions {
        BenchOptions {
            quick: true,
            out_dir: dir.to_path_buf(),
            ..BenchOptions::default()
        }
    }

    /// The plan of a quick run.
    fn quick_plan() -> Plan {
        Plan {
            dev: 128 * MIB,
            fio_ms: 1500,
        }
    }

    #[test]
    fn tls_report_has_the_marker_and_both_ratios() {
        let dir = scratch("report");
        let opts = quick_opts(&dir.0[0]);
        let plan = quick_plan();
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
    }

    #[test]
    fn plaintext_report_has_no_tls_marker_or_ratios() {
        let dir = scratch("report-plain");
        let opts = quick_opts(&dir.0[0]);
        let plan = quick_plan();
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
            plan: &plan,
            runs: 1,
            fs: "tmpfs",
            tls: false,
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
