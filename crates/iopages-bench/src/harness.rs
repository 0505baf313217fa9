//! The experiment harness: the shape every `iopages bench` experiment
//! shares, so a bench function holds only its workload and its figures.
//!
//! Owns: running configurations warm-up first and then interleaved run by
//! run (A B C A B C …, so drift hits every configuration alike) with one
//! progress line per run; the typed report envelope (`experiment`,
//! `machine`, `settings`, then the experiment's own fields) written once as
//! JSON; the plots drawn beside it; the one table printer. Must never:
//! change, round or drop a figure it is given (rounding is the
//! experiment's choice, made where the figure is put in its report), or
//! assert a timing.
//!
//! # How an experiment uses it
//! 1. Describe one measurement: implement [`Experiment`] — its
//!    configurations (in the order one run visits them), a warm-up and a
//!    measurement of one configuration — or pass two closures to
//!    [`interleave`].
//! 2. `let samples = run_interleaved(&mut exp, runs)?;` gives, per
//!    configuration, the samples of every run; [`Summary::of`] gives the
//!    median and range.
//! 3. Print with [`Table`] (cells are formatted by the experiment, the
//!    table joins them with ` | `).
//! 4. Build the report: a `#[derive(Serialize)]` struct for the settings
//!    and one for the rest (summary, details), wrapped in [`Report::new`];
//!    [`Report::emit`] writes `<experiment>.json`, draws each [`Plot`]
//!    (the first beside the JSON as `<experiment>.svg`, the others as
//!    `<experiment>-<suffix>.svg`) and says where they went.
//!
//! The JSON goes through `serde_json::Value`, whose maps are sorted, so
//! the files keep the key order they always had.
//!
//! # Porting an experiment (how each of E1–E6 came onto it)
//! - The run loop `for run in 0..runs { for c in configs { … } progress }`
//!   becomes [`interleave`] (or [`run_interleaved`]); a workload that
//!   only some runs do (openssl speed in xts) is one more configuration
//!   that decides inside its closure, as `xts::Ctx::measure` does.
//! - `println!` blocks become a [`Table`] built by a `table()` function
//!   and printed once; keep each cell's format string as it was.
//! - `json!({"experiment": …, "machine": crate::machine(), "settings":
//!   …, …})` + `write_json` + `line_plot` + the "wrote …" progress line
//!   become `Report::new(name, settings, body).emit(opts, &plots)`, with
//!   [`Report::stem`] where the name is not the file's (kvmalloc, bio,
//!   nbd). Settings and body may start as `serde_json::Value` and become
//!   structs field by field; `mempool.rs` and `bio.rs` are fully typed.

use crate::measure::{Sample, Summary};
use crate::plot::{bar_chart, line_plot, Bars, Series};
use crate::{progress, write_json, BenchError, BenchOptions};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One experiment's measurement: configurations, a warm-up and one timed
/// run of one configuration.
pub trait Experiment {
    /// What one configuration is (a scenario, a method, a size, …).
    type Config;

    /// The experiment's name: its progress prefix and report name.
    fn name(&self) -> &'static str;

    /// Every configuration, in the order one run visits them.
    fn configs(&self) -> &[Self::Config];

    /// Run `config` once, untimed, so caches and lists are warm before
    /// the first timed run. The default measures once and discards it.
    fn warm_up(&mut self, config: usize) -> Result<(), BenchError> {
        self.measure(config).map(|_| ())
    }

    /// One timed run of configuration number `config`.
    fn measure(&mut self, config: usize) -> Result<Sample, BenchError>;
}

/// Warm every configuration of `exp` once, then `runs` runs, each visiting
/// every configuration in order; one progress line per run.
///
/// **Returns:** the samples, `[config][run]`; the first workload error.
pub fn run_interleaved<E: Experiment>(
    exp: &mut E,
    runs: usize,
) -> Result<Vec<Vec<Sample>>, BenchError> {
    let n = exp.configs().len();
    let name = exp.name();
    let mut ctx = exp;
    interleave(
        name,
        n,
        runs,
        &mut ctx,
        |e, c| e.warm_up(c),
        |e, c| e.measure(c),
    )
}

/// [`run_interleaved`] with closures: `warm_up(ctx, config)` once per
/// configuration, then `runs` runs of `measure(ctx, config)` over the
/// `configs` configurations in order.
///
/// **Returns:** the samples, `[config][run]`.
pub fn interleave<C: ?Sized, S>(
    name: &str,
    configs: usize,
    runs: usize,
    ctx: &mut C,
    mut warm_up: impl FnMut(&mut C, usize) -> Result<(), BenchError>,
    mut measure: impl FnMut(&mut C, usize) -> Result<S, BenchError>,
) -> Result<Vec<Vec<S>>, BenchError> {
    assert!(runs > 0, "an experiment needs at least one run");
    for c in 0..configs {
        warm_up(ctx, c)?;
    }
    let mut samples: Vec<Vec<S>> = (0..configs).map(|_| Vec::with_capacity(runs)).collect();
    for run in 0..runs {
        for (c, s) in samples.iter_mut().enumerate() {
            s.push(measure(ctx, c)?);
        }
        progress(name, format!("run {}/{runs} done", run + 1));
    }
    Ok(samples)
}

/// The median and range of each configuration's samples.
pub fn summarise(samples: &[Vec<Sample>]) -> Vec<Summary> {
    samples.iter().map(|s| Summary::of(s)).collect()
}

/// What the figures were measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// `model name` of /proc/cpuinfo ("unknown" without one).
    pub cpu: String,
    /// CPUs this process may run on.
    pub online_cpus: usize,
    /// /proc/sys/kernel/osrelease.
    pub kernel: String,
}

impl Machine {
    /// This machine.
    pub fn this() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        Machine {
            cpu,
            online_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        }
    }
}

/// A report: the envelope every experiment shares and its own fields
/// (`body`, flattened beside `settings`).
#[derive(Debug, Serialize)]
pub struct Report<S: Serialize, B: Serialize> {
    /// The experiment's name; also the report file's stem unless
    /// [`Report::stem`] says otherwise.
    pub experiment: &'static str,
    /// The report file's stem and the progress prefix.
    #[serde(skip)]
    pub stem: &'static str,
    /// Where it ran.
    pub machine: Machine,
    /// How it ran (runs, sizes, quick or not, …).
    pub settings: S,
    /// The figures: usually `summary` and per-configuration details.
    #[serde(flatten)]
    pub body: B,
}

/// Where a plot goes, beside the report.
#[derive(Clone, Debug)]
pub enum PlotFile {
    /// `<experiment>.svg`.
    Main,
    /// `<experiment>-<suffix>.svg`.
    Suffix(&'static str),
}

/// What a plot shows.
pub enum Chart {
    /// Lines of (x, y) points on log–log axes.
    Lines {
        /// The x axis' label.
        x_label: String,
        /// The y axis' label.
        y_label: String,
        /// The lines.
        series: Vec<Series>,
    },
    /// Grouped bars in panels side by side.
    Bars(Bars),
}

/// One SVG plot of a report.
pub struct Plot {
    /// Its file.
    pub file: PlotFile,
    /// Its caption.
    pub title: String,
    /// What it draws.
    pub chart: Chart,
}

impl Plot {
    /// A line plot (log–log) drawn to `file`.
    pub fn lines(
        file: PlotFile,
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
        series: Vec<Series>,
    ) -> Plot {
        Plot {
            file,
            title: title.into(),
            chart: Chart::Lines {
                x_label: x_label.into(),
                y_label: y_label.into(),
                series,
            },
        }
    }

    /// Draw it to `path`.
    pub fn draw(&self, path: &Path) -> Result<(), BenchError> {
        match &self.chart {
            Chart::Lines {
                x_label,
                y_label,
                series,
            } => line_plot(path, &self.title, x_label, y_label, series),
            Chart::Bars(b) => bar_chart(path, &self.title, b),
        }
    }
}

/// The path of `file` given the main SVG's path.
fn plot_path(svg: &Path, file: &PlotFile, experiment: &str) -> PathBuf {
    match file {
        PlotFile::Main => svg.to_path_buf(),
        PlotFile::Suffix(suffix) => svg.with_file_name(format!(
            "{}-{suffix}.svg",
            svg.file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or(experiment)
        )),
    }
}

impl<S: Serialize, B: Serialize> Report<S, B> {
    /// A report of `experiment` measured on this machine.
    pub fn new(experiment: &'static str, settings: S, body: B) -> Self {
        Report {
            experiment,
            stem: experiment,
            machine: Machine::this(),
            settings,
            body,
        }
    }

    /// Name the files `<stem>.json` and `<stem>.svg` where the
    /// experiment's name is not a file name (E5's "E5 kvmalloc").
    pub fn stem(mut self, stem: &'static str) -> Self {
        self.stem = stem;
        self
    }

    /// The report as a JSON value (what the bench functions return).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("reports hold no maps with non-string keys")
    }

    /// Write the JSON report where `opts` says, draw `plots` beside it and
    /// say where they went (one progress line).
    ///
    /// **Returns:** the report as JSON; an error if a file could not be
    /// written or a plot drawn (the JSON is written first).
    pub fn emit(&self, opts: &BenchOptions, plots: &[Plot]) -> Result<Value, BenchError> {
        let value = self.to_value();
        let (json_path, svg_path) = opts.paths(self.stem);
        write_json(&json_path, &value)?;
        let mut wrote = vec![json_path.display().to_string()];
        for p in plots {
            let path = plot_path(&svg_path, &p.file, self.stem);
            p.draw(&path)?;
            wrote.push(path.display().to_string());
        }
        progress(self.stem, format!("wrote {}", join_and(&wrote)));
        Ok(value)
    }
}

/// "a", "a and b", "a, b and c".
fn join_and(v: &[String]) -> String {
    match v {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// A table on stdout: a title, then rows of cells joined with ` | `.
/// Cells come formatted (width, precision) by the experiment, so each
/// table keeps its own look; lines that are not rows (notes, targets) go
/// in order with [`Table::line`].
#[derive(Default)]
pub struct Table {
    lines: Vec<String>,
}

impl Table {
    /// A table whose first line is `title`.
    pub fn new(title: impl Into<String>) -> Table {
        Table {
            lines: vec![title.into()],
        }
    }

    /// A row: `cells` joined with ` | `.
    pub fn row<I, T>(&mut self, cells: I) -> &mut Table
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let cells: Vec<String> = cells.into_iter().map(|c| c.as_ref().to_string()).collect();
        self.lines.push(cells.join(" | "));
        self
    }

    /// A line as it is.
    pub fn line(&mut self, text: impl Into<String>) -> &mut Table {
        self.lines.push(text.into());
        self
    }

    /// Print every line to stdout.
    pub fn print(&self) {
        for l in &self.lines {
            println!("{l}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_warms_every_config_then_visits_them_in_order_each_run() {
        let mut log = Vec::new();
        let out = interleave(
            "test",
            2,
            3,
            &mut log,
            |l, c| {
                l.push(format!("w{c}"));
                Ok(())
            },
            |l, c| {
                l.push(format!("m{c}"));
                Ok(c * 10)
            },
        )
        .unwrap();
        assert_eq!(log, ["w0", "w1", "m0", "m1", "m0", "m1", "m0", "m1"]);
        assert_eq!(out, vec![vec![0, 0, 0], vec![10, 10, 10]]);
    }

    #[test]
    fn the_envelope_keeps_the_report_keys() {
        #[derive(Serialize)]
        struct Body {
            summary: u32,
        }
        let v = Report::new("x", serde_json::json!({"runs": 3}), Body { summary: 7 }).to_value();
        assert_eq!(v["experiment"], "x");
        assert_eq!(v["settings"]["runs"], 3);
        assert_eq!(v["summary"], 7);
        assert!(v["machine"]["online_cpus"].as_u64().unwrap() >= 1);
    }

    #[test]
    fn plots_beside_the_report_and_lists_in_words() {
        let svg = Path::new("/o/bulk.svg");
        assert_eq!(plot_path(svg, &PlotFile::Main, "bulk"), svg);
        assert_eq!(
            plot_path(svg, &PlotFile::Suffix("peers"), "bulk"),
            Path::new("/o/bulk-peers.svg")
        );
        let s = |v: &[&str]| join_and(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(s(&["a"]), "a");
        assert_eq!(s(&["a", "b"]), "a and b");
        assert_eq!(s(&["a", "b", "c"]), "a, b and c");
    }
}
