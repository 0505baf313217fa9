//! `iopages`: the command-line front end.
//!
//! Owns: argument parsing and exit codes. Must never: panic on bad input —
//! every error is printed with what to do and exits non-zero.

use clap::{Parser, Subcommand, ValueEnum};
use iopages_bench::{BenchError, BenchOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "iopages",
    version,
    about = "The kernel's I/O memory machinery in userspace: benchmarks and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run experiments and write their JSON reports and SVG plots.
    Bench {
        /// Which experiment (default: every one that exists).
        #[arg(value_enum, default_value_t = Experiment::All)]
        experiment: Experiment,
        /// A short run (under 30 s) for checks and CI.
        #[arg(long)]
        quick: bool,
        /// Write the JSON report here (the SVG plot goes beside it, .svg).
        /// Only with a single experiment.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Directory for reports when --json is not given.
        #[arg(long, value_name = "DIR", default_value = "bench-out")]
        out_dir: PathBuf,
        /// Skip the peer allocators (glibc, jemalloc, mimalloc, tcmalloc, DPDK).
        #[arg(long)]
        no_peers: bool,
        /// Where the peer harness is built (by scripts/setup-peers.sh).
        #[arg(long, value_name = "DIR", default_value = "target/peers")]
        peers_dir: PathBuf,
        /// crypt: run only E3, with this many writer threads (default: E2,
        /// then E3 at 1, 2, 4, … threads up to the cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// crypt: run only E3, with the page limit near its threshold or at
        /// its default (2 % of the arena).
        #[arg(long, value_enum)]
        limit: Option<Limit>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Experiment {
    /// Every experiment.
    All,
    /// E1: alloc+free cost per page, single and bulk batches 1..256.
    Bulk,
    /// Mempool: cost per page of a request by a loop of alloc, alloc_bulk
    /// and the callback form, warm and with the reserve serving.
    Mempool,
    /// E3 (core): a page limit checked exactly, roughly and with
    /// limited_add, 1..N threads.
    Counter,
    /// E2's cipher: AES-XTS plain64 implementations (512/4096-byte sectors,
    /// both key sizes) beside `openssl speed`, and the one chosen.
    Xts,
    /// E2: 1 MiB writes through the crypt target for each out-page
    /// strategy, beside the bare cipher and a pipeline with no allocation;
    /// then E3: N writers with the page limit near its threshold, checked
    /// exactly and approximately.
    Crypt,
    /// E4: bios from 64 KiB folios and from single pages, built page by
    /// page and folio by folio; direct I/O through io_uring.
    Bio,
    /// E5: kvmalloc of log-commit shadow buffers in a fragmented arena full
    /// of page cache, legacy (reclaim and compaction first) vs fail-fast.
    Kvmalloc,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Limit {
    /// Just above what the writers hold at once.
    Near,
    /// 2 % of the arena.
    Default,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("iopages: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), BenchError> {
    match cli.command {
        Command::Bench {
            experiment,
            quick,
            json,
            out_dir,
            no_peers,
            peers_dir,
            threads,
            limit,
        } => {
            if (threads.is_some() || limit.is_some()) && experiment != Experiment::Crypt {
                return Err(BenchError::Workload(
                    "--threads and --limit belong to the crypt experiment: `iopages bench crypt --threads 4 --limit near`".into(),
                ));
            }
            if threads == Some(0) {
                return Err(BenchError::Workload("--threads must be at least 1".into()));
            }
            if json.is_some() && experiment == Experiment::All {
                return Err(BenchError::Workload(
                    "--json names one report file: give it with a single experiment (for example `iopages bench bulk --json out.json`), or use --out-dir".into(),
                ));
            }
            let opts = BenchOptions {
                quick,
                json,
                out_dir,
                peers: !no_peers,
                peers_dir,
            };
            let all = experiment == Experiment::All;
            if all || experiment == Experiment::Bulk {
                iopages_bench::bulk::run(&opts)?;
            }
            if all || experiment == Experiment::Mempool {
                iopages_bench::mempool::run(&opts)?;
            }
            if all || experiment == Experiment::Counter {
                iopages_bench::counter::run(&opts)?;
            }
            if all || experiment == Experiment::Xts {
                iopages_bench::xts::run(&opts)?;
            }
            if all || experiment == Experiment::Bio {
                iopages_bench::bio::run(&opts)?;
            }
            if all || experiment == Experiment::Kvmalloc {
                iopages_bench::kvmalloc::run(&opts)?;
            }
            if all || experiment == Experiment::Crypt {
                let e3_only = threads.is_some() || limit.is_some();
                if !e3_only {
                    iopages_bench::crypt::run(&opts)?;
                }
                let setting = match limit {
                    Some(Limit::Default) => iopages_bench::crypt::LimitSetting::Default,
                    _ => iopages_bench::crypt::LimitSetting::Near,
                };
                iopages_bench::crypt::run_limit(&opts, threads, setting)?;
            }
            Ok(())
        }
    }
}
