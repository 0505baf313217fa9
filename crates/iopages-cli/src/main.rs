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
    /// With no arguments: an in-memory 256 MiB volume (aes-xts-plain64, a
    /// random 512-bit key kept in memory only) on 127.0.0.1:10809, until
    /// the process is stopped (Ctrl-C). Clients: `qemu-io -f raw
    /// nbd://127.0.0.1:10809/iopages`, `qemu-img`, `nbdcopy`, `nbd-client`.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TCP address to listen on (default 127.0.0.1:10809 when --unix is
    /// not given; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// Unix socket to listen on (must not exist yet).
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Volume size in bytes; K, M, G suffixes (KiB, MiB, GiB) allowed.
    /// A multiple of 4096.
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = parse_size)]
    size: u64,
    /// Export read-only (writes get EPERM).
    #[arg(long)]
    read_only: bool,
    /// Export name clients ask for.
    #[arg(long, value_name = "NAME", default_value = "iopages")]
    name: String,
}

/// Largest in-memory volume `serve` accepts (the RAM it takes is real).
const MAX_SERVE_BYTES: u64 = 64 << 30;

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
    if bytes > MAX_SERVE_BYTES {
        return Err(format!(
            "size {bytes} exceeds the in-memory limit of {MAX_SERVE_BYTES} bytes"
        ));
    }
    Ok(bytes)
}

/// Serve an in-memory encrypted volume until the process is stopped.
fn serve(a: ServeArgs) -> Result<(), String> {
    use iopages_crypt::backend::{Backend, RamDisk};
    use iopages_crypt::queue::{CryptQueue, QueueConfig};
    use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
    use iopages_nbd::{ExportConfig, Listen, Server};
    use std::io::Read;
    use std::sync::Arc;

    let mut listen = Vec::new();
    if let Some(addr) = a.listen {
        listen.push(Listen::Tcp(addr));
    }
    if let Some(p) = &a.unix {
        listen.push(Listen::Unix(p.clone()));
    }
    if listen.is_empty() {
        let addr = iopages_nbd::DEFAULT_LISTEN
            .parse()
            .map_err(|e| format!("bad default address: {e}"))?;
        listen.push(Listen::Tcp(addr));
    }
    let mut key = [0u8; 64];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .map_err(|e| format!("cannot read a random key from /dev/urandom: {e}"))?;
    let cipher = iopages_crypt::XtsCipher::new(&key, 512, 0);
    key.fill(0);
    std::hint::black_box(&key);
    let cipher = cipher.map_err(|e| format!("cannot set up aes-xts-plain64: {e}"))?;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cipher = CipherPool::new(cipher, workers)
        .map_err(|e| format!("cannot set up the cipher pool: {e}"))?;
    let alloc = iopages::PageAllocator::builder()
        .size_bytes(128 << 20)
        .build()
        .map_err(|e| format!("cannot create the page arena (128 MiB): {e}"))?;
    let disk: Arc<dyn Backend> =
        Arc::new(RamDisk::new(a.size).map_err(|e| format!("cannot create the RAM disk: {e}"))?);
    let target = CryptTarget::new(&alloc, cipher, disk, TargetConfig::default())
        .map_err(|e| format!("cannot create the crypt target: {e}"))?;
    let queue = CryptQueue::new(
        Arc::new(target),
        QueueConfig {
            workers,
            ..QueueConfig::default()
        },
    )
    .map_err(|e| format!("cannot start the crypt queue: {e}"))?;
    let mut export = ExportConfig::new(a.name.clone());
    export.read_only = a.read_only;
    let server = Server::start(Arc::new(queue), export, &listen).map_err(|e| e.to_string())?;
    for l in server.addresses() {
        match l {
            Listen::Tcp(addr) => println!("serving nbd://{addr}/{}", a.name),
            Listen::Unix(p) => println!("serving nbd+unix:///{}?socket={}", a.name, p.display()),
        }
    }
    println!(
        "export {:?}: {} bytes, aes-xts-plain64, 512-byte sectors{}",
        a.name,
        a.size,
        if a.read_only { ", read-only" } else { "" }
    );
    println!(
        "LUKS is not yet supported: the volume is in memory, under a random key kept in memory only (its data is gone when the server stops)"
    );
    println!("stop with Ctrl-C");
    server.wait();
    Ok(())
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
    let result = match cli.command {
        Command::Serve(args) => serve(args),
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
            Ok(())
        }
        Command::Serve(args) => serve(args).map_err(BenchError::Workload),
    }
}
