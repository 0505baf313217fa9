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
    /// Serve an encrypted volume over NBD (newstyle fixed handshake).
    ///
    /// With no arguments: an in-memory 256 MiB LUKS2 volume
    /// (aes-xts-plain64, 512-bit key, 4096-byte sectors) under a generated
    /// passphrase printed once, on 127.0.0.1:10809, until stopped (Ctrl-C
    /// or SIGTERM; SIGUSR1 prints statistics). With --image: a LUKS1 or
    /// LUKS2 file or block device. Clients: `nbdcopy`, `qemu-img`,
    /// `qemu-io -f raw nbd://127.0.0.1:10809/iopages`, fio's nbd engine,
    /// `nbd-client`.
    Serve(serve::ServeArgs),
    /// LUKS tools: format a volume, check a passphrase, decrypt offline.
    Luks {
        #[command(subcommand)]
        command: luks_cmd::LuksCommand,
    },
}

mod luks_cmd;
mod passphrase;
mod serve;

/// Largest size the command line accepts (1 PiB).
const MAX_SIZE_BYTES: u64 = 1 << 50;

/// Bytes from a size argument: a number with an optional K, M or G suffix
/// (KiB, MiB, GiB), a non-zero multiple of 4096.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| {
        format!("`{s}` is not a size: give bytes, optionally with K, M or G (for example 256M)")
    })?;
    let bytes = n
        .checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))?;
    if bytes == 0 || bytes % 4096 != 0 {
        return Err(format!(
            "size {bytes} must be a non-zero multiple of 4096 bytes"
        ));
    }
    if bytes > MAX_SIZE_BYTES {
        return Err(format!(
            "size {bytes} is larger than {MAX_SIZE_BYTES} bytes"
        ));
    }
    Ok(bytes)
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
    /// E6: one LUKS1 image served by iopages, nbdkit's luks filter and
    /// qemu-nbd; fio and nbdcopy as the clients.
    Nbd,
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
    let result = match cli.command {
        Command::Serve(args) => serve::serve(args),
        Command::Luks { command } => luks_cmd::run(command),
        command => run(Cli { command }).map_err(|e| e.to_string()),
    };
    match result {
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
            if all || experiment == Experiment::Nbd {
                let me = std::env::current_exe().map_err(|e| {
                    BenchError::Workload(format!(
                        "cannot find the iopages binary to serve with: {e}"
                    ))
                })?;
                iopages_bench::nbd::run(&opts, &me)?;
            }
            Ok(())
        }
        Command::Serve(_) | Command::Luks { .. } => Err(BenchError::Workload(
            "serve and luks are not benchmarks".into(),
        )),
    }
}
