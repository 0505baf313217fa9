//! E6's run: the image made, then each server in turn (each run starting
//! with the next), its loads measured and checked, then the report.
//!
//! Owns: [`run`] and [`run_with`] (the entry points `iopages bench nbd`
//! calls), the servers of a run ([`servers_of`]) and the order they run
//! in. Must never: go on measuring a server that failed, or report before
//! every server is stopped.

use super::common::{workload, MIB};
use super::files::{fs_type, make_image, sync_file, work_dirs, Files, TlsSetup};
use super::fio::Plan;
use super::load::Load;
use super::measure::{measure, Failure, Results};
use super::report::{report, Run};
use super::server::{start_server, Server};
use super::tools::{multi_conn, Tools};
use crate::{progress, BenchError, BenchOptions};
use serde_json::Value;
use std::path::Path;

/// E6. `iopages_bin` is the `iopages` executable whose `serve` is measured.
/// Returns the report; a server that fails is reported (table and JSON)
/// and then returned as an error.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    run_with(opts, iopages_bin, false)
}

/// The servers of a run, in table order.
pub(super) fn servers_of(peers: bool, tls: bool) -> Vec<Server> {
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
    let f = Files::e6(&work, socks, tls);
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
    let mut results: Vec<Results> = servers.iter().map(|_| Results::empty()).collect();
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
