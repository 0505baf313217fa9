//! E6 ceiling (`iopages bench nbd --ceiling`): the encrypting server
//! against the same bytes served with no encryption at all. One LUKS1
//! image (E6's); `iopages serve --image IMG --io buffered` in turn with
//! nbdkit's `file` plugin exporting the same file's payload region as it
//! is (the ciphertext, through the `offset` filter, so the header is out
//! of reach and the export has the volume's size), both through the page
//! cache, under E6's loads. A server that decrypts does more work per
//! byte than one that copies: matching it is the ceiling.
//!
//! Owns: the servers of each run (each run starting with the next), the
//! per-run ratios ours / plain and their medians against the target, the
//! table, where the CPU went (the client's and the server's seconds per
//! request or GiB, `remote/cpu.rs`'s meter) and the bound that puts on
//! each ratio when both share the same cores, and `nbd-ceiling.json`.
//! Must never: compare loads of different
//! I/O modes (both sides go through the page cache), or keep a figure of
//! a load whose tool failed. The plain export's bytes are ciphertext: no
//! read-back is checked across the two (E6's own runs check ours).

use super::common::{workload, MIB};
use super::files::{make_image, sync_file, work_dirs, Files};
use super::fio::Plan;
use super::load::Load;
use super::measure::{load_sample_at, LoadTarget, Results};
use super::remote::cpu::{CpuUse, Meter};
use super::remote::start as start_proc;
use super::report::{figure_lines, figures_head, rows};
use super::server::OUR_EXPORT;
use super::tools::Tools;
use crate::harness::{Report, Table};
use crate::measure::{median, per_run_ratio};
use crate::{met, progress, round2, BenchError, BenchOptions};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

/// The report's stem.
pub const STEM: &str = "nbd-ceiling";
/// Target: ours / plain on every load, at least.
pub const TARGET: f64 = 1.0;

/// The two servers, in table order.
const SERVERS: [(&str, &str); 2] = [
    ("ours", "iopages serve --io buffered"),
    ("plain", "nbdkit file (no encryption)"),
];

/// What the run needs.
struct Setup<'a> {
    tools: Tools,
    f: Files,
    plan: Plan,
    /// The payload's offset in the image (the LUKS header before it).
    offset: u64,
    iopages_bin: &'a Path,
}

impl Setup<'_> {
    /// Server `s`'s command and its URI on `sock`.
    fn server(&self, s: usize, sock: &Path) -> (Command, String) {
        let mut cmd;
        if s == 0 {
            cmd = Command::new(self.iopages_bin);
            cmd.arg("serve")
                .arg("--image")
                .arg(&self.f.image)
                .arg("--passphrase-file")
                .arg(&self.f.pass)
                .arg("--unix")
                .arg(sock)
                .args(["--name", OUR_EXPORT, "--io", "buffered"]);
            let uri = format!("nbd+unix:///{OUR_EXPORT}?socket={}", sock.display());
            (cmd, uri)
        } else {
            cmd = Command::new(&self.tools.nbdkit);
            cmd.args(["--foreground", "--exit-with-parent", "--unix"])
                .arg(sock)
                .args(["--filter=offset", "file"])
                .arg(format!("file={}", self.f.image.display()))
                .arg(format!("offset={}", self.offset))
                .arg(format!("range={}", self.plan.dev));
            (cmd, format!("nbd+unix:///?socket={}", sock.display()))
        }
    }

    /// One pass of server `s`: every load, the image synced before each,
    /// and what each cost the client and the server in CPU (`cpu`, per
    /// load).
    fn pass(&self, s: usize, res: &mut Results, cpu: &mut [Vec<CpuUse>]) -> Result<(), String> {
        let sock = self.f.socks.join("ceiling.sock");
        let (cmd, uri) = self.server(s, &sock);
        let (proc, line) = start_proc(SERVERS[s].1, SERVERS[s].0, cmd, &sock, &self.f.work)?;
        res.command = line;
        let fio_s = self.plan.fio_ms as f64 / 1000.0;
        for (l, &load) in Load::ALL.iter().enumerate() {
            sync_file(&self.f.image);
            let at = LoadTarget {
                fio: &self.tools.fio,
                nbdcopy: &self.tools.nbdcopy,
                work: &self.f.work,
                home: None,
                fio_uri: &uri,
                uri: &uri,
                source: &self.f.source,
            };
            // The server's CPU in the meter's store place: each side is a
            // client and one server.
            let meter = Meter::start(proc.pid(), None);
            let x = load_sample_at(&at, &self.plan, load)?;
            cpu[l].push(meter.finish(load, &x, fio_s, self.plan.dev));
            res.samples[l].push(x);
        }
        drop(proc);
        Ok(())
    }
}

/// Each load's ratio ours / plain: the median of the runs' own.
fn ratios(res: &[Results; 2]) -> Vec<(Load, Option<f64>)> {
    Load::ALL
        .iter()
        .enumerate()
        .map(|(l, &load)| {
            let fig = |r: &Results| {
                r.samples[l]
                    .iter()
                    .map(|x| x.figure(load))
                    .collect::<Vec<_>>()
            };
            (
                load,
                per_run_ratio(&fig(&res[0]), &fig(&res[1])).map(round2),
            )
        })
        .collect()
}

/// `iopages bench nbd --ceiling`: `iopages_bin`'s `serve` measured.
///
/// **Returns:** the report; Err when a server fails (after the report).
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (runs, payload, fio_ms) = if opts.quick {
        (1usize, 128 * MIB, 1500u64)
    } else {
        (3, 1024 * MIB, 5000)
    };
    let (json_path, _) = opts.paths(STEM);
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, STEM)?;
    let tools = Tools::find_as(&work, Some("the plain file export"), false).map_err(workload)?;
    let f = Files::e6(&work, socks, None);
    progress(
        STEM,
        format!("E6 ceiling: ours (--io buffered) and nbdkit's plain file export of the same image, {runs} run(s), {} MiB, fio {} s per load", payload / MIB, fio_ms as f64 / 1000.0),
    );
    let dev = make_image(&tools, &f, payload)?;
    let len = std::fs::metadata(&f.image).map_or(0, |m| m.len());
    let st = Setup {
        tools,
        offset: len - dev,
        f,
        plan: Plan { dev, fio_ms },
        iopages_bin,
    };
    let mut res = [Results::empty(), Results::empty()];
    let mut cpu: [Vec<Vec<CpuUse>>; 2] = std::array::from_fn(|_| vec![Vec::new(); Load::ALL.len()]);
    let mut failed = None;
    'runs: for run in 0..runs {
        for i in 0..2 {
            let s = (i + run) % 2;
            progress(STEM, format!("run {}/{runs}: {}", run + 1, SERVERS[s].1));
            if let Err(e) = st.pass(s, &mut res[s], &mut cpu[s]) {
                failed = Some(format!("{}: {e}", SERVERS[s].1));
                break 'runs;
            }
        }
    }
    report(opts, &st, runs, (&res, &cpu), failed)
}

/// A side's CPU seconds per unit of `load` (a request for the random
/// load, a GiB otherwise): the client's, the server's and both.
fn per_unit(load: Load, c: &CpuUse) -> Option<[f64; 3]> {
    let u = c.units(load)?;
    let server = c.store_s?;
    Some([c.client_s / u, server / u, (c.client_s + server) / u])
}

/// Each load's CPU per unit by side (medians over runs: client, server,
/// both) and the bound on ours / plain when both keep every core busy:
/// the median of the runs' plain CPU per unit over ours.
fn cpu_lines(cpu: &[Vec<Vec<CpuUse>>; 2]) -> Vec<Value> {
    Load::ALL
        .iter()
        .enumerate()
        .map(|(l, &load)| {
            let scale = if load == Load::RandRw { 1e6 } else { 1.0 };
            let side = |runs: &[CpuUse]| -> Option<Vec<f64>> {
                let v: Vec<[f64; 3]> = runs.iter().filter_map(|c| per_unit(load, c)).collect();
                (!v.is_empty()).then(|| {
                    (0..3)
                        .map(|i| {
                            round2(scale * median(&v.iter().map(|x| x[i]).collect::<Vec<_>>()))
                        })
                        .collect()
                })
            };
            let bounds: Vec<f64> = cpu[1][l]
                .iter()
                .zip(&cpu[0][l])
                .filter_map(|(p, o)| Some(per_unit(load, p)?[2] / per_unit(load, o)?[2]))
                .collect();
            json!({
                "load": load.key(),
                "unit": if load == Load::RandRw { "CPU-µs/request" } else { "CPU-s/GiB" },
                "ours_client_server_total": side(&cpu[0][l]),
                "plain_client_server_total": side(&cpu[1][l]),
                "bound_ours_over_plain": (!bounds.is_empty()).then(|| round2(median(&bounds))),
            })
        })
        .collect()
}

/// The CPU lines under the table: each side's CPU per unit, and the bound.
fn cpu_table_lines(t: &mut Table, cpu: &[Value]) {
    let f = |v: &Value| match v.as_array().map(Vec::as_slice) {
        Some([c, s, all]) => format!("client {c} server {s} = {all}"),
        _ => "-".into(),
    };
    for c in cpu {
        t.line(format!(
            "cpu {:<13} ({}) ours: {}; plain: {}; CPU bound on ours / plain {}",
            c["load"].as_str().unwrap_or("-"),
            c["unit"].as_str().unwrap_or("-"),
            f(&c["ours_client_server_total"]),
            f(&c["plain_client_server_total"]),
            c["bound_ours_over_plain"]
        ));
    }
}

fn report(
    opts: &BenchOptions,
    st: &Setup,
    runs: usize,
    (res, cpu): (&[Results; 2], &[Vec<Vec<CpuUse>>; 2]),
    failed: Option<String>,
) -> Result<Value, BenchError> {
    let r = ratios(res);
    let cpu = cpu_lines(cpu);
    let mut t = Table::new(format!(
        "E6 ceiling: {} MiB LUKS1 volume, ours against a plain file export of the same bytes, both through the page cache; median of {runs} run(s)",
        st.plan.dev / MIB
    ));
    t.line(figures_head(30));
    for (s, x) in SERVERS.iter().zip(res) {
        figure_lines(&mut t, s.1, 30, x);
    }
    for (load, x) in &r {
        let ok = x.is_some_and(|x| x >= TARGET);
        let shown = x.map_or("-".into(), |x| format!("{x:.2}"));
        t.line(format!(
            "{:<13}: ours / plain {shown} (target >= {TARGET}: {})",
            load.key(),
            met(ok)
        ));
    }
    cpu_table_lines(&mut t, &cpu);
    if let Some(why) = &failed {
        t.line(format!("FAILED: {why}"));
    }
    t.print();
    let ratios: serde_json::Map<String, Value> = r
        .iter()
        .map(|(l, x)| (l.key().to_string(), json!(x)))
        .collect();
    let body = json!({
        "rows": rows(SERVERS.iter().map(|s| s.0).zip(res.iter())),
        "ratios_ours_over_plain": ratios,
        "commands": { "ours": res[0].command, "plain": res[1].command },
        "cpu": cpu,
        "summary": {
            "target": TARGET,
            "target_met": r.iter().all(|(_, x)| x.is_some_and(|x| x >= TARGET)),
            "failed": failed,
        },
    });
    let settings = json!({
        "runs": runs,
        "volume_bytes": st.plan.dev,
        "fio_ms": st.plan.fio_ms,
        "quick": opts.quick,
        "io": "buffered on both sides (ours --io buffered; nbdkit's file plugin, its default cache)",
    });
    let v = Report::new("E6 nbd ceiling", settings, body)
        .stem(STEM)
        .emit(opts, &[])?;
    match failed {
        Some(why) => Err(workload(format!("failed (report written): {why}"))),
        None => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e6::load::Sample;

    fn res(figs: &[[f64; 5]]) -> Results {
        let mut r = Results::empty();
        for f in figs {
            for (l, &load) in Load::ALL.iter().enumerate() {
                let iops = (load == Load::RandRw).then_some(f[l]);
                r.samples[l].push(Sample { mib_s: f[l], iops });
            }
        }
        r
    }

    fn used(client_s: f64, server_s: f64) -> CpuUse {
        CpuUse {
            client_s,
            store_s: Some(server_s),
            server_s: None,
            wall_s: 5.0,
            requests: Some(1e6),
            gib: 2.0,
        }
    }

    #[test]
    fn the_cpu_bound_is_plain_cpu_over_ours_per_unit() {
        let per_load = |c: CpuUse| vec![vec![c]; Load::ALL.len()];
        // Ours: 1 + 3 CPU-s per load, plain 1 + 1: the bound is 0.5.
        let cpu = [per_load(used(1.0, 3.0)), per_load(used(1.0, 1.0))];
        let lines = cpu_lines(&cpu);
        assert_eq!(lines.len(), Load::ALL.len());
        for (c, load) in lines.iter().zip(Load::ALL) {
            assert_eq!(c["bound_ours_over_plain"], json!(0.5), "{}", load.key());
        }
        // The random load per request, in µs: 4 s over 1e6 requests.
        let rnd = &lines[Load::ALL.iter().position(|&l| l == Load::RandRw).unwrap()];
        assert_eq!(rnd["ours_client_server_total"], json!([1.0, 3.0, 4.0]));
        // Per GiB otherwise: 2 s over 2 GiB.
        assert_eq!(
            lines[0]["plain_client_server_total"],
            json!([0.5, 0.5, 1.0])
        );
        // A server whose CPU could not be read gives no bound.
        let unread = CpuUse {
            store_s: None,
            ..used(1.0, 1.0)
        };
        let lines = cpu_lines(&[per_load(unread), per_load(used(1.0, 1.0))]);
        assert!(lines.iter().all(|c| c["bound_ours_over_plain"].is_null()));
    }

    #[test]
    fn each_ratio_is_the_median_of_the_runs_own() {
        let ours = res(&[
            [1.0, 2.0, 300.0, 4.0, 5.0],
            [2.0, 2.0, 100.0, 4.0, 5.0],
            [9.0, 2.0, 200.0, 4.0, 5.0],
        ]);
        let plain = res(&[
            [2.0, 4.0, 100.0, 4.0, 10.0],
            [2.0, 4.0, 100.0, 4.0, 10.0],
            [3.0, 4.0, 100.0, 4.0, 10.0],
        ]);
        let r = ratios(&[ours, plain]);
        // seq write: runs 0.5, 1.0, 3.0 -> 1.0 (not 12/7, the ratio of sums).
        assert_eq!(r[0], (Load::SeqWrite, Some(1.0)));
        assert_eq!(r[1].1, Some(0.5));
        // The random load compares IOPS: 3, 1, 2 -> 2.
        assert_eq!(r[2], (Load::RandRw, Some(2.0)));
        assert_eq!(r[4].1, Some(0.5));
        let none = ratios(&[Results::empty(), Results::empty()]);
        assert!(none.iter().all(|(_, x)| x.is_none()));
    }
}
