//! `iopages`: the command-line front end.
//!
//! Owns: argument parsing and exit codes. Must never: panic on bad input —
//! every error is printed with what to do and exits non-zero.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use iopages_bench::{BenchError, BenchOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "iopages",
    version,
    about = "The kernel's I/O memory machinery in userspace: benchmarks and tools",
    long_about = "The kernel's I/O memory machinery in userspace: benchmarks and tools.\n\n\
        `iopages serve` serves AES-XTS encrypted volumes (LUKS1 or LUKS2 images, \
        block devices, images on a remote NBD store) over NBD, with TLS, \
        per-client limits, several exports, sparse volumes, Prometheus metrics \
        and socket activation. `iopages luks` formats, checks and decrypts \
        volumes and manages their key slots. `iopages bench` runs the \
        experiments that measure the page allocator, the cipher and the server \
        against their peers.\n\n\
        The configuration file of `serve --config` is described in iopages.toml(5); \
        the systemd units iopages@.socket and iopages@.service serve one volume \
        per instance."
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
        /// Only with a single experiment. `crypt` writes two reports: E2
        /// to PATH and E3 beside it as PATH's stem + "-limit.json" (E3
        /// alone, with --threads or --limit, writes PATH).
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
        /// then E3 at 1, 2, 4, … threads up to the cores). bulk: the thread
        /// counts of the multi-thread part, even (producer/consumer pairs)
        /// and comma-separated (default 2,4,8,16 on every machine, more
        /// threads than cores on purpose).
        #[arg(long, value_name = "N[,N...]", value_parser = parse_threads)]
        threads: Option<ThreadCounts>,
        /// crypt: E2's scaling part, the bulk pipeline with these worker
        /// counts (comma-separated; default 1, 2, 4, … up to the cores).
        #[arg(long, value_name = "N[,N...]", value_parser = parse_threads)]
        workers: Option<ThreadCounts>,
        /// crypt: run only E3, with the page limit near its threshold or at
        /// its default (2 % of the arena).
        #[arg(long, value_enum)]
        limit: Option<Limit>,
        /// nbd: TLS (X.509) on every server, and ours also without TLS in
        /// the same runs (report: nbd-tls.json; the sparse copy is not run).
        #[arg(long)]
        tls: bool,
        /// nbd: only the sparse copy — a LUKS1 volume 10 % written (100
        /// regions; 1 GiB, --quick 256 MiB), copied whole by nbdcopy and
        /// qemu-img convert from `iopages serve --allow-discards`, from
        /// `iopages serve` without it, nbdkit and qemu-nbd (ours only with
        /// --no-peers). Report: nbd-sparse.json (`bench nbd` writes it
        /// after nbd.json; with --json PATH, beside PATH as its stem +
        /// "-sparse.json").
        #[arg(long)]
        sparse_only: bool,
        /// nbd: the LUKS1 image on a remote NBD export (nbdkit file),
        /// served by iopages and by nbdkit's luks filter over its nbd
        /// plugin, beside the raw remote (report: nbd-remote.json); then
        /// the outage row: fio verify through iopages while the store is
        /// killed for 2 s and started again (report: nbd-outage.json).
        #[arg(long)]
        remote: bool,
        /// nbd --remote: the store under the remote row: `nbdkit` (its file
        /// plugin; the default) or `ceph` (RBD images of a single-node Ceph
        /// cluster started by scripts/ceph-store.sh, which installs
        /// Debian's Ceph where it is missing; report: nbd-remote-ceph.json;
        /// the outage row, which kills an nbdkit store, is not run).
        #[arg(long, value_enum, value_name = "STORE")]
        store: Option<StoreArg>,
        /// nbd: only the integrity row — three LUKS2 volumes (4096-byte
        /// sectors) of the same data size on one nbdkit file store: plain,
        /// --integrity hmac-sha256 and --integrity aead, each served by
        /// `iopages serve` in turn under E6's loads; their ratios to plain
        /// against the CPU bound of each MAC (XTS and the MAC's
        /// single-core rates, measured in the same run), and the store
        /// I/Os of a 4 KiB write from the server's metrics. Report:
        /// nbd-integrity.json.
        #[arg(long)]
        integrity: bool,
        /// nbd: only the connections row — one `iopages serve` (in-memory
        /// volume, TCP) holding 1000 idle connections from 1000 loopback
        /// addresses beside a polite client's 4 KiB reads, then with 8 of
        /// them reading without pause, against the same reads alone: the
        /// p99 ratios, the server's tasks and its resident memory per idle
        /// connection. Report:
        /// nbd-connections.json (`bench nbd` writes it after
        /// nbd-tenants.json; with --json PATH, beside PATH as its stem +
        /// "-connections.json").
        #[arg(long)]
        connections: bool,
        /// nbd: only the ceiling row — `iopages serve --image --io
        /// buffered` on E6's LUKS1 image against nbdkit's plain file
        /// export of the same bytes (its payload region, no encryption),
        /// both through the page cache, under E6's loads: ours / plain per
        /// load against 1.0, and each side's CPU per GiB or request with the
        /// bound it puts on that ratio. Report: nbd-ceiling.json (`bench nbd` writes
        /// it after nbd-connections.json; with --json PATH, beside PATH as
        /// its stem + "-ceiling.json").
        #[arg(long)]
        ceiling: bool,
        /// nbd: only the outage row — fio 4 KiB random writes with verify
        /// through `iopages serve` on a LUKS2 volume kept by an nbdkit
        /// file store, once steady and once with the store killed for 2 s
        /// (1 s with --quick) and started again: the time lost beyond the
        /// downtime. Report: nbd-outage.json (`bench nbd --remote` runs it
        /// after the remote row).
        #[arg(long)]
        outage: bool,
        /// nbd: only the tenants row — one `iopages serve` on TCP shared by
        /// fio from 127.0.0.1 and 8 hostile peers from 127.0.0.2-9 (silent
        /// sockets and unread READs, then WRITE_ZEROES floods), against fio
        /// alone. Report: nbd-tenants.json (`bench nbd` writes it after
        /// nbd-sparse.json; with --json PATH, beside PATH as its stem +
        /// "-tenants.json").
        #[arg(long)]
        tenants_only: bool,
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
    // Boxed: the serve options outweigh every other command.
    Serve(Box<serve::ServeArgs>),
    /// LUKS tools: format a volume, check a passphrase, decrypt offline.
    Luks {
        #[command(subcommand)]
        command: luks_cmd::LuksCommand,
    },
    /// Write the manual pages: iopages(1), one per subcommand, and
    /// iopages.toml(5).
    ///
    /// Writes DIR/man1/iopages.1, DIR/man1/iopages-serve.1,
    /// DIR/man1/iopages-luks-format.1, ... (a page for every subcommand at
    /// every level) and DIR/man5/iopages.toml.5, the configuration file of
    /// `serve --config`; creates the folders, replaces pages already there
    /// and prints each file it wrote. For example
    /// `iopages man --out /usr/local/share/man`, then `man iopages-serve`.
    Man {
        /// The folder to write man1/ and man5/ under.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Print a shell completion script on standard output.
    ///
    /// Where to put it: bash, in
    /// /usr/share/bash-completion/completions/iopages (for one user:
    /// ~/.local/share/bash-completion/completions/iopages); zsh, as
    /// _iopages in a folder of $fpath (/usr/share/zsh/vendor-completions/
    /// on Debian; for one user, a folder added to $fpath before compinit);
    /// fish, in /usr/share/fish/vendor_completions.d/iopages.fish (for one
    /// user: ~/.config/fish/completions/iopages.fish). A new shell picks it
    /// up.
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

mod activation;
mod config;
mod defaults;
mod luks_cmd;
mod luks_header;
mod luks_integrity;
mod luks_kdf;
mod luks_keys;
mod luks_target;
mod manual;
mod metrics;
mod passphrase;
mod serve;
mod served;
mod signals;
mod sys;

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

/// The thread counts of `--threads`: one number, or a comma list for bulk.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ThreadCounts(Vec<usize>);

/// Thread counts from `--threads`: numbers separated by commas, each at
/// least 1 (whether a list is allowed, and odd counts, is the experiment's
/// to say).
fn parse_threads(s: &str) -> Result<ThreadCounts, String> {
    let v = s
        .split(',')
        .map(|t| {
            let t = t.trim();
            match t.parse::<usize>() {
                Ok(0) => Err("--threads must be at least 1".to_string()),
                Ok(n) => Ok(n),
                Err(_) => Err(format!(
                    "`{t}` is not a thread count: give a number, or for bulk a comma list such as 2,4,8,16"
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ThreadCounts(v))
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Experiment {
    /// Every experiment.
    All,
    /// E1: alloc+free cost per page, single and bulk batches 1..256, beside
    /// the peer allocators; then producer/consumer pairs across threads
    /// (--threads, default 2,4,8,16).
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
    /// qemu-nbd; fio and nbdcopy as the clients; then the sparse copy
    /// (--sparse-only: that alone) and the tenants row (--tenants-only:
    /// that alone); --integrity: the authenticated volumes' row alone.
    Nbd,
    /// Key changes on a served volume: fio's random load alone and during
    /// 20 `luks change-key`s, against the KDF's CPU share; and the unlock
    /// cost of a default `luks add-key` slot against cryptsetup's (not
    /// part of `all`; report keys.json).
    Keys,
}

/// The store of `bench nbd --remote --store`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StoreArg {
    /// nbdkit's file plugin over files in the page cache.
    Nbdkit,
    /// RBD images of a single-node Ceph cluster (scripts/ceph-store.sh).
    Ceph,
}

/// The nbd experiment's flags, checked together.
#[derive(Clone, Copy)]
struct NbdFlags {
    tls: bool,
    sparse_only: bool,
    remote: bool,
    tenants_only: bool,
    store: Option<StoreArg>,
    integrity: bool,
    connections: bool,
    ceiling: bool,
    outage: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Limit {
    /// Just above what the writers hold at once.
    Near,
    /// 2 % of the arena.
    Default,
}

/// The command line, parsed. `--version`'s long text (the build and
/// this machine's code paths, with an io_uring probe) is made only when
/// it is asked for; `-V` prints the version alone.
fn parse_args() -> Cli {
    let mut cmd = Cli::command();
    if std::env::args_os().skip(1).any(|a| a == "--version") {
        cmd = cmd.long_version(manual::version::long_version());
    }
    let matches = cmd.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    let cli = parse_args();
    let result = match cli.command {
        Command::Serve(args) => serve::serve(*args),
        Command::Luks { command } => luks_cmd::run(command),
        Command::Man { out } => manual::write_pages(Cli::command(), &out),
        Command::Completions { shell } => manual::print_completions(Cli::command(), shell),
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
            workers,
            limit,
            tls,
            sparse_only,
            remote,
            store,
            tenants_only,
            integrity,
            connections,
            ceiling,
            outage,
        } => {
            let nbd = NbdFlags {
                tls,
                sparse_only,
                remote,
                tenants_only,
                store,
                integrity,
                connections,
                ceiling,
                outage,
            };
            check_nbd_flags(experiment, nbd)?;
            let crypt_threads = check_thread_flags(
                experiment,
                threads.as_ref(),
                workers.is_some(),
                limit.is_some(),
                json.is_some(),
            )?;
            let bulk_threads = threads.as_ref().map(|t| t.0.as_slice());
            let opts = BenchOptions {
                quick,
                json,
                out_dir,
                peers: !no_peers,
                peers_dir,
            };
            let crypt = (crypt_threads, workers.as_ref(), limit);
            run_experiments(experiment, &opts, bulk_threads, crypt, nbd)?;
            Ok(())
        }
        Command::Serve(_)
        | Command::Luks { .. }
        | Command::Man { .. }
        | Command::Completions { .. } => {
            Err(BenchError::Workload("only bench runs experiments".into()))
        }
    }
}

/// Run `experiment` (every one for `All`) in order, each with its flags:
/// bulk's thread counts, crypt's (E3's thread count, the workers, the
/// limit) and nbd's.
fn run_experiments(
    experiment: Experiment,
    opts: &BenchOptions,
    bulk_threads: Option<&[usize]>,
    crypt: (Option<usize>, Option<&ThreadCounts>, Option<Limit>),
    nbd: NbdFlags,
) -> Result<(), BenchError> {
    let all = experiment == Experiment::All;
    if all || experiment == Experiment::Bulk {
        iopages_bench::bulk::run_with_threads(opts, bulk_threads)?;
    }
    if all || experiment == Experiment::Mempool {
        iopages_bench::mempool::run(opts)?;
    }
    if all || experiment == Experiment::Counter {
        iopages_bench::counter::run(opts)?;
    }
    if all || experiment == Experiment::Xts {
        iopages_bench::xts::run(opts)?;
    }
    if all || experiment == Experiment::Bio {
        iopages_bench::bio::run(opts)?;
    }
    if all || experiment == Experiment::Kvmalloc {
        iopages_bench::kvmalloc::run(opts)?;
    }
    if all || experiment == Experiment::Crypt {
        run_crypt(opts, crypt.0, crypt.1, crypt.2)?;
    }
    if all || experiment == Experiment::Nbd {
        if nbd.integrity || nbd.connections || nbd.ceiling || nbd.outage {
            let me = std::env::current_exe().map_err(|e| {
                BenchError::Workload(format!("cannot find the iopages binary to serve with: {e}"))
            })?;
            if nbd.integrity {
                iopages_bench::nbd_integrity::run(opts, &me)?;
            } else if nbd.connections {
                iopages_bench::nbd_connections::run(opts, &me)?;
            } else if nbd.outage {
                iopages_bench::nbd_outage::run(opts, &me)?;
            } else {
                iopages_bench::nbd_ceiling::run(opts, &me)?;
            }
            return Ok(());
        }
        let NbdFlags {
            tls,
            sparse_only,
            remote,
            tenants_only,
            store,
            ..
        } = nbd;
        run_nbd(opts, tls, sparse_only, remote, tenants_only, store)?;
    }
    if experiment == Experiment::Keys {
        let me = std::env::current_exe()
            .map_err(|e| BenchError::Workload(format!("cannot find the iopages binary: {e}")))?;
        iopages_bench::luks_keys::run(opts, &me)?;
    }
    Ok(())
}

/// Refuse the thread, worker, limit and report flags where they do not
/// belong.
///
/// **Returns:** the thread count of crypt's E3 run alone (`--threads N`).
fn check_thread_flags(
    experiment: Experiment,
    threads: Option<&ThreadCounts>,
    workers: bool,
    limit: bool,
    json: bool,
) -> Result<Option<usize>, BenchError> {
    if workers && experiment != Experiment::Crypt {
        return Err(BenchError::Workload(
            "--workers belongs to the crypt experiment: `iopages bench crypt --workers 1,2,4`"
                .into(),
        ));
    }
    if limit && experiment != Experiment::Crypt {
        return Err(BenchError::Workload(
            "--limit belongs to the crypt experiment: `iopages bench crypt --threads 4 --limit near`".into(),
        ));
    }
    if threads.is_some() && !matches!(experiment, Experiment::Crypt | Experiment::Bulk) {
        return Err(BenchError::Workload(
            "--threads belongs to the crypt and bulk experiments: `iopages bench crypt --threads 4` or `iopages bench bulk --threads 2,4,8,16`".into(),
        ));
    }
    // crypt's E3 runs one thread count; bulk checks its list itself
    // (even counts) before it starts.
    let crypt_threads = match (threads, experiment) {
        (Some(ThreadCounts(v)), Experiment::Crypt) => match v[..] {
            [n] => Some(n),
            _ => {
                return Err(BenchError::Workload(
                    "crypt takes one thread count: `iopages bench crypt --threads 4` (a list such as 2,4,8,16 is for bulk)".into(),
                ))
            }
        },
        _ => None,
    };
    if experiment == Experiment::Bulk {
        iopages_bench::bulk::mt_threads(threads.map(|t| t.0.as_slice()))?;
    }
    if json && experiment == Experiment::All {
        return Err(BenchError::Workload(
            "--json names one report file: give it with a single experiment (for example `iopages bench bulk --json out.json`), or use --out-dir".into(),
        ));
    }
    Ok(crypt_threads)
}

/// crypt: E2 (unless E3 runs alone), then E3.
fn run_crypt(
    opts: &BenchOptions,
    crypt_threads: Option<usize>,
    workers: Option<&ThreadCounts>,
    limit: Option<Limit>,
) -> Result<(), BenchError> {
    let e3_only = crypt_threads.is_some() || limit.is_some();
    if !e3_only {
        iopages_bench::crypt::run_with_workers(opts, workers.map(|w| w.0.as_slice()))?;
    }
    let setting = match limit {
        Some(Limit::Default) => iopages_bench::crypt::LimitSetting::Default,
        _ => iopages_bench::crypt::LimitSetting::Near,
    };
    // E2 and E3 are two reports: with --json PATH, E2 goes to
    // PATH and E3 beside it (PATH's stem + "-limit"), as
    // --out-dir names them crypt.json and crypt-limit.json.
    // Run alone (--threads/--limit), E3 takes PATH itself.
    let mut e3_opts = opts.clone();
    if let (false, Some(p)) = (e3_only, &opts.json) {
        e3_opts.json = Some(e3_beside(p));
    }
    iopages_bench::crypt::run_limit(&e3_opts, crypt_threads, setting)?;
    Ok(())
}

/// Refuse nbd flags given to another experiment or beside a flag they
/// do not go with.
fn check_nbd_flags(experiment: Experiment, f: NbdFlags) -> Result<(), BenchError> {
    if f.tls && experiment != Experiment::Nbd {
        return Err(BenchError::Workload(
            "--tls belongs to the nbd experiment: `iopages bench nbd --tls`".into(),
        ));
    }
    if f.remote && f.sparse_only {
        return Err(BenchError::Workload(
            "--remote and --sparse-only are two different runs of the nbd experiment".into(),
        ));
    }
    if f.remote && (experiment != Experiment::Nbd || f.tls) {
        return Err(BenchError::Workload(
            "--remote belongs to the nbd experiment, without --tls: `iopages bench nbd --remote`"
                .into(),
        ));
    }
    if f.sparse_only && experiment != Experiment::Nbd {
        return Err(BenchError::Workload(
            "--sparse-only belongs to the nbd experiment: `iopages bench nbd --sparse-only`".into(),
        ));
    }
    if f.sparse_only && f.tls {
        return Err(BenchError::Workload(
            "--sparse-only runs no TLS: `iopages bench nbd --sparse-only` or `iopages bench nbd --tls`".into(),
        ));
    }
    if f.tenants_only && (experiment != Experiment::Nbd || f.tls || f.remote || f.sparse_only) {
        return Err(BenchError::Workload(
            "--tenants-only is a run of the nbd experiment on its own: `iopages bench nbd --tenants-only`".into(),
        ));
    }
    if f.integrity
        && (experiment != Experiment::Nbd || f.tls || f.remote || f.sparse_only || f.tenants_only)
    {
        return Err(BenchError::Workload(
            "--integrity is a run of the nbd experiment on its own: `iopages bench nbd --integrity`".into(),
        ));
    }
    // Runs of the nbd experiment on their own: none beside another.
    let own = [
        (f.connections, "--connections"),
        (f.ceiling, "--ceiling"),
        (f.outage, "--outage"),
    ];
    let others = [f.tls, f.remote, f.sparse_only, f.tenants_only, f.integrity];
    for (i, &(on, flag)) in own.iter().enumerate() {
        let beside = others.iter().any(|&x| x) || own[..i].iter().any(|o| o.0);
        if on && (experiment != Experiment::Nbd || beside) {
            return Err(BenchError::Workload(format!(
                "{flag} is a run of the nbd experiment on its own: `iopages bench nbd {flag}`"
            )));
        }
    }
    if f.store.is_some() && !f.remote {
        return Err(BenchError::Workload(
            "--store belongs to the remote row: `iopages bench nbd --remote --store ceph`".into(),
        ));
    }
    Ok(())
}

/// Where E3's report goes when `bench crypt --json PATH` writes E2's to
/// PATH: beside it, PATH's stem + "-limit.json".
fn e3_beside(p: &std::path::Path) -> std::path::PathBuf {
    let stem = p
        .file_stem()
        .map_or_else(|| "crypt".to_string(), |s| s.to_string_lossy().into_owned());
    p.with_file_name(format!("{stem}-limit.json"))
}

/// E6's runs as the flags ask: the remote row alone, or E6 (unless one
/// row runs alone), then the sparse copy and the tenants row (without
/// TLS), each with its own report — beside E6's with `--json PATH`
/// unless it runs alone.
fn run_nbd(
    opts: &iopages_bench::BenchOptions,
    tls: bool,
    sparse_only: bool,
    remote: bool,
    tenants_only: bool,
    store: Option<StoreArg>,
) -> Result<(), BenchError> {
    let me = std::env::current_exe().map_err(|e| {
        BenchError::Workload(format!("cannot find the iopages binary to serve with: {e}"))
    })?;
    if remote && store == Some(StoreArg::Ceph) {
        // The remote row alone: the outage row kills a store of its own.
        let ceph = iopages_bench::nbd_remote::Store::Ceph;
        return iopages_bench::nbd_remote::run_on(opts, &me, ceph).map(|_| ());
    }
    if remote {
        // The remote row, then the outage row (its own report).
        iopages_bench::nbd_remote::run(opts, &me)?;
        let mut o = opts.clone();
        if let Some(p) = &opts.json {
            o.json = Some(beside(p, "outage"));
        }
        return iopages_bench::nbd_outage::run(&o, &me).map(|_| ());
    }
    if !sparse_only && !tenants_only {
        iopages_bench::nbd::run_with(opts, &me, tls)?;
    }
    let alone = sparse_only || tenants_only;
    let beside_e6 = |part: &str| {
        let mut o = opts.clone();
        if let (false, Some(p)) = (alone, &opts.json) {
            o.json = Some(beside(p, part));
        }
        o
    };
    if !tls && !tenants_only {
        iopages_bench::sparse::run(&beside_e6("sparse"), &me)?;
    }
    if !tls && !sparse_only {
        iopages_bench::nbd_tenants::run(&beside_e6("tenants"), &me)?;
    }
    if !tls && !sparse_only && !tenants_only {
        iopages_bench::nbd_connections::run(&beside_e6("connections"), &me)?;
        iopages_bench::nbd_ceiling::run(&beside_e6("ceiling"), &me)?;
    }
    Ok(())
}

/// Where another report of `bench nbd --json PATH` goes: beside PATH,
/// its stem + "-" + `part` + ".json".
fn beside(p: &std::path::Path, part: &str) -> std::path::PathBuf {
    let stem = p
        .file_stem()
        .map_or_else(|| "nbd".to_string(), |s| s.to_string_lossy().into_owned());
    p.with_file_name(format!("{stem}-{part}.json"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn nbd_json_puts_the_sparse_copy_beside_it() {
        use std::path::Path;
        assert_eq!(
            super::beside(Path::new("/r/e6.json"), "sparse"),
            Path::new("/r/e6-sparse.json")
        );
    }

    #[test]
    fn crypt_json_keeps_e2_and_puts_e3_beside_it() {
        use std::path::Path;
        assert_eq!(
            super::e3_beside(Path::new("/r/e2.json")),
            Path::new("/r/e2-limit.json")
        );
        assert_eq!(
            super::e3_beside(Path::new("out")),
            Path::new("out-limit.json")
        );
    }

    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        // clap's own checks: no two arguments share a name or a flag,
        // every default is a possible value, ...
        Cli::command().debug_assert();
    }

    #[test]
    fn threads_take_one_number_or_a_comma_list() {
        assert_eq!(parse_threads("4"), Ok(ThreadCounts(vec![4])));
        assert_eq!(
            parse_threads("2,4, 8,16"),
            Ok(ThreadCounts(vec![2, 4, 8, 16]))
        );
        assert_eq!(
            parse_threads("0").unwrap_err(),
            "--threads must be at least 1"
        );
        assert!(parse_threads("2,x")
            .unwrap_err()
            .contains("`x` is not a thread count"));
        assert!(parse_threads("2,,4").is_err());
    }

    fn bench(args: &[&str]) -> Result<(), String> {
        let cli = Cli::try_parse_from(["iopages", "bench"].iter().chain(args))
            .map_err(|e| e.to_string())?;
        run(cli).map_err(|e| e.to_string())
    }

    #[test]
    fn thread_lists_are_refused_where_they_do_not_belong() {
        let e = bench(&["crypt", "--threads", "2,4"]).unwrap_err();
        assert!(e.contains("crypt takes one thread count"), "{e}");
        let e = bench(&["bulk", "--threads", "2,3"]).unwrap_err();
        assert!(e.contains("must be even"), "{e}");
        let e = bench(&["xts", "--threads", "4"]).unwrap_err();
        assert!(e.contains("crypt and bulk"), "{e}");
        let e = bench(&["bulk", "--limit", "near"]).unwrap_err();
        assert!(e.contains("--limit belongs to the crypt experiment"), "{e}");
        let e = bench(&["crypt", "--threads", "0"]).unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
        let e = bench(&["xts", "--tls"]).unwrap_err();
        assert!(e.contains("--tls belongs to the nbd experiment"), "{e}");
        let e = bench(&["bulk", "--sparse-only"]).unwrap_err();
        assert!(e.contains("--sparse-only belongs to the nbd"), "{e}");
        let e = bench(&["nbd", "--sparse-only", "--tls"]).unwrap_err();
        assert!(e.contains("--sparse-only runs no TLS"), "{e}");
        let e = bench(&["xts", "--remote"]).unwrap_err();
        assert!(e.contains("--remote belongs to the nbd experiment"), "{e}");
        let e = bench(&["nbd", "--tenants-only", "--remote"]).unwrap_err();
        assert!(e.contains("--tenants-only is a run of the nbd"), "{e}");
        assert_eq!(
            super::beside(std::path::Path::new("/r/e6.json"), "tenants"),
            std::path::Path::new("/r/e6-tenants.json")
        );
    }

    /// Each of `cases` is refused with "`flag` is a run of the nbd
    /// experiment on its own", and `flag` beside `--store` as the remote
    /// row's flag.
    fn refused_unless_alone(flag: &str, cases: &[&[&str]]) {
        for args in cases {
            let e = bench(args).unwrap_err();
            assert!(
                e.contains(&format!("{flag} is a run of the nbd experiment on its own")),
                "{args:?}: {e}"
            );
        }
        let e = bench(&["nbd", flag, "--store", "nbdkit"]).unwrap_err();
        assert!(e.contains("--store belongs to the remote row"), "{e}");
    }

    #[test]
    fn the_integrity_row_runs_alone_in_the_nbd_experiment() {
        refused_unless_alone(
            "--integrity",
            &[
                &["xts", "--integrity"],
                &["all", "--integrity"],
                &["nbd", "--integrity", "--tls"],
                &["nbd", "--integrity", "--remote"],
                &["nbd", "--integrity", "--sparse-only"],
                &["nbd", "--integrity", "--tenants-only"],
            ],
        );
        let cli =
            Cli::try_parse_from(["iopages", "bench", "nbd", "--integrity", "--quick"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Bench {
                integrity: true,
                quick: true,
                ..
            }
        ));
    }

    #[test]
    fn the_outage_row_runs_alone_in_the_nbd_experiment() {
        refused_unless_alone(
            "--outage",
            &[
                &["crypt", "--outage"],
                &["all", "--outage"],
                &["nbd", "--outage", "--remote"],
                &["nbd", "--outage", "--ceiling"],
                &["nbd", "--outage", "--connections"],
                &["nbd", "--outage", "--tenants-only"],
            ],
        );
    }

    #[test]
    fn a_store_is_chosen_only_for_the_remote_row() {
        let e = bench(&["nbd", "--store", "ceph"]).unwrap_err();
        assert!(e.contains("--store belongs to the remote row"), "{e}");
        let e = bench(&["xts", "--store", "nbdkit"]).unwrap_err();
        assert!(e.contains("--store belongs to the remote row"), "{e}");
        let e = bench(&["nbd", "--tenants-only", "--store", "ceph"]).unwrap_err();
        assert!(e.contains("--store belongs to the remote row"), "{e}");
        let e = bench(&["nbd", "--remote", "--store", "s3"]).unwrap_err();
        assert!(e.contains("invalid value 's3'"), "{e}");
        let cli = Cli::try_parse_from(["iopages", "bench", "nbd", "--remote", "--store", "ceph"])
            .unwrap();
        assert!(matches!(
            cli.command,
            Command::Bench {
                remote: true,
                store: Some(StoreArg::Ceph),
                ..
            }
        ));
    }
}
