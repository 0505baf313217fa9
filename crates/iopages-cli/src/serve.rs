//! `iopages serve`: an encrypted volume over NBD until a signal stops it.
//!
//! Owns: choosing the volume (an in-memory LUKS2 volume, or a LUKS image
//! opened with a passphrase), the listeners, the progress and statistics
//! lines, and signals: SIGUSR1 prints statistics, SIGINT and SIGTERM stop
//! the server cleanly (requests in flight complete, the image is flushed,
//! totals printed). Must never: exit with acknowledged writes unflushed.

use crate::passphrase::read_passphrase;
use iopages_crypt::strategy::Strategy;
use iopages_nbd::volume::{self, Volume, VolumeOptions};
use iopages_nbd::{ExportConfig, Listen, Server};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Requests served on the connection's thread by default, for fast
/// backends: the hand-off to a worker costs more than a small request
/// (4 KiB random I/O through the page cache: about 100 000 IOPS inline vs
/// 75 000 through the workers here), while large requests gain from
/// several workers encrypting at once (1 MiB writes: ~750 MiB/s inline vs
/// 1100–1600 MiB/s through the workers).
const DEFAULT_INLINE_MAX_BYTES: u32 = 64 << 10;

fn parse_inline(s: &str) -> Result<u32, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    let b = crate::parse_size(s)?;
    u32::try_from(b).map_err(|_| format!("{s} is larger than a request can be"))
}

/// The in-memory volume's payload when `--size` is not given.
const DEFAULT_MEMORY_BYTES: u64 = 256 << 20;

/// Largest in-memory volume `serve` accepts (the RAM it takes is real).
pub const MAX_MEMORY_BYTES: u64 = 64 << 30;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// TCP address to listen on (default 127.0.0.1:10809 when --unix is
    /// not given; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// Unix socket to listen on (must not exist yet).
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Serve this LUKS1 or LUKS2 image (a file or block device) instead of
    /// an in-memory volume. Needs --passphrase-file.
    #[arg(long, value_name = "PATH")]
    image: Option<PathBuf>,
    /// The image's passphrase: the file's exact bytes (as cryptsetup's
    /// --key-file), or `-` for one line from standard input.
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
    /// Size of the in-memory volume's payload (default 256M); K, M, G
    /// suffixes (KiB, MiB, GiB). A multiple of 4096. Not with --image (an
    /// image's payload is what its header says).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    size: Option<u64>,
    /// Export read-only (writes get EPERM; the image is opened read-only).
    #[arg(long)]
    read_only: bool,
    /// Export name clients ask for.
    #[arg(long, value_name = "NAME", default_value = "iopages")]
    name: String,
    /// Page arena for out pages and payload buffers; K, M, G suffixes.
    #[arg(long, value_name = "BYTES", default_value = "512M", value_parser = crate::parse_size)]
    arena: u64,
    /// Crypt worker threads (default: one per core).
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Out-page allocation strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::Compound)]
    strategy: StrategyArg,
    /// How the image is read and written: O_DIRECT where the file system
    /// takes it (auto), O_DIRECT or fail (direct), or through the page
    /// cache (buffered).
    #[arg(long, value_enum, default_value_t = IoArg::Auto)]
    io: IoArg,
    /// Serve requests up to this size on their connection's thread instead
    /// of the crypt workers (dm-crypt's no_read_workqueue /
    /// no_write_workqueue, by size); 0: never. Default: 64K when the
    /// volume is in memory or served --io buffered, 0 with O_DIRECT.
    #[arg(long, value_name = "BYTES", value_parser = parse_inline)]
    inline_max: Option<u32>,
    /// Print a statistics line every SECS seconds (0: only on SIGUSR1 and
    /// at exit).
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    stats_interval: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IoArg {
    /// O_DIRECT, falling back to buffered I/O where refused.
    Auto,
    /// O_DIRECT or fail.
    Direct,
    /// Buffered, through the page cache.
    Buffered,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StrategyArg {
    /// One mempool allocation per page.
    PerPage,
    /// Bulk page allocation.
    Bulk,
    /// High-order blocks, then single pages.
    Compound,
}

/// Block the signals the server handles, in this thread and every thread
/// started after (the crypt workers, the connections), so that only
/// `sigtimedwait` in the main thread receives them.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc calls on a local, initialised signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Wait up to `timeout` for one of `set`; `None` on timeout.
fn wait_signal(set: &libc::sigset_t, timeout: Option<Duration>) -> Option<i32> {
    loop {
        let r = match timeout {
            Some(t) => {
                let ts = libc::timespec {
                    tv_sec: t.as_secs() as libc::time_t,
                    tv_nsec: t.subsec_nanos() as libc::c_long,
                };
                // SAFETY: `set` and `ts` are valid for the call.
                unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) }
            }
            // SAFETY: as above.
            None => unsafe { libc::sigwaitinfo(set, std::ptr::null_mut()) },
        };
        if r >= 0 {
            return Some(r);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => return None,
            _ => continue, // EINTR
        }
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Statistics since the last line.
struct Progress {
    start: Instant,
    last: Instant,
    last_read: u64,
    last_write: u64,
}

impl Progress {
    fn line(&mut self, server: &Server, vol: &Volume) -> String {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64().max(1e-9);
        let s = server.stats();
        let out = vol.queue.target().out_pages().stats();
        let line = format!(
            "[{:>7.1}s] write {:.1} MiB/s ({:.1} MiB, {} req, {} err) | read {:.1} MiB/s ({:.1} MiB, {} req, {} err) | flush {} | out pages: {:.1}% by the strategy ({} compound blocks), {} via mempool ({} from reserve, {} waits) | payload buffers: {} arena blocks, {} vmalloc, {} heap | connections {}",
            now.duration_since(self.start).as_secs_f64(),
            mib(s.write.bytes - self.last_write) / dt,
            mib(s.write.bytes),
            s.write.requests,
            s.write.errors,
            mib(s.read.bytes - self.last_read) / dt,
            mib(s.read.bytes),
            s.read.requests,
            s.read.errors,
            s.flush.requests,
            out.direct_hit_rate() * 100.0,
            out.compound_blocks,
            out.pool_pages,
            out.reserve_pages,
            out.waits,
            s.buffers.arena_contiguous,
            s.buffers.arena_vmalloc,
            s.buffers.heap,
            s.sessions,
        );
        self.last = now;
        self.last_read = s.read.bytes;
        self.last_write = s.write.bytes;
        line
    }
}

pub fn serve(a: ServeArgs) -> Result<(), String> {
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
    if a.workers == Some(0) {
        return Err("--workers must be at least 1".into());
    }
    if a.image.is_some() && a.size.is_some() {
        return Err(
            "--size is the in-memory volume's; an --image's payload size is what its header says"
                .into(),
        );
    }
    let size = a.size.unwrap_or(DEFAULT_MEMORY_BYTES);
    if size > MAX_MEMORY_BYTES {
        return Err(format!(
            "--size {size} exceeds the in-memory limit of {MAX_MEMORY_BYTES} bytes"
        ));
    }
    if a.image.is_none() && a.passphrase_file.is_some() {
        return Err(
            "--passphrase-file goes with --image (the in-memory volume's passphrase is generated)"
                .into(),
        );
    }
    let signals = block_signals();
    let mut opts = VolumeOptions {
        arena_bytes: a.arena,
        read_only: a.read_only,
        direct: match a.io {
            IoArg::Auto => iopages_crypt::uring::DirectIo::Auto,
            IoArg::Direct => iopages_crypt::uring::DirectIo::Require,
            IoArg::Buffered => iopages_crypt::uring::DirectIo::Off,
        },
        strategy: match a.strategy {
            StrategyArg::PerPage => Strategy::PerPage,
            StrategyArg::Bulk => Strategy::Bulk,
            StrategyArg::Compound => Strategy::Compound,
        },
        ..VolumeOptions::default()
    };
    if let Some(w) = a.workers {
        opts.workers = w;
    }
    let (vol, generated) = match &a.image {
        Some(path) => {
            let Some(pf) = &a.passphrase_file else {
                return Err(format!(
                    "--image {} needs --passphrase-file FILE (or - to read one line from standard input)",
                    path.display()
                ));
            };
            let pass = read_passphrase(pf)?;
            let v = volume::open_image(path, &pass, &opts).map_err(|e| e.to_string())?;
            (v, None)
        }
        None => {
            let (v, p) = volume::in_memory(size, &opts)
                .map_err(|e| format!("cannot make the in-memory LUKS2 volume: {e}"))?;
            (v, Some(p))
        }
    };
    let mut export = ExportConfig::new(a.name.clone());
    export.read_only = a.read_only;
    export.inline_max_bytes =
        a.inline_max
            .unwrap_or(if vol.info.image.is_none() || !vol.file.direct_io() {
                DEFAULT_INLINE_MAX_BYTES
            } else {
                0
            });
    export.description = format!(
        "iopages {} volume ({})",
        match vol.info.version {
            iopages_crypt::luks::LuksVersion::Luks1 => "LUKS1",
            iopages_crypt::luks::LuksVersion::Luks2 => "LUKS2",
        },
        vol.info.cipher
    );
    let server = Server::start(vol.queue.clone(), export, &listen).map_err(|e| e.to_string())?;
    let i = &vol.info;
    println!(
        "volume: {} {}, {}-bit key, {}-byte sectors, payload {} bytes at offset {}, key slot {}, uuid {}",
        match i.version {
            iopages_crypt::luks::LuksVersion::Luks1 => "LUKS1",
            iopages_crypt::luks::LuksVersion::Luks2 => "LUKS2",
        },
        i.cipher,
        i.key_bits,
        i.sector_size,
        i.size_bytes,
        i.data_offset,
        i.keyslot,
        i.uuid
    );
    if !i.keys_locked {
        println!("warning: the cipher keys could not be locked in memory (RLIMIT_MEMLOCK): they may be swapped out");
    }
    match &i.image {
        Some(p) => println!("image: {} ({})", p.display(), i.io),
        None => {
            println!("image: in memory (gone when the server stops)");
            if let Some(p) = &generated {
                println!("passphrase (shown once): {}", p.as_str());
            }
        }
    }
    for l in server.addresses() {
        match l {
            Listen::Tcp(addr) => println!("serving nbd://{addr}/{}", a.name),
            Listen::Unix(p) => println!("serving nbd+unix:///{}?socket={}", a.name, p.display()),
        }
    }
    println!(
        "statistics: kill -USR1 {}{}; stop with Ctrl-C or SIGTERM",
        std::process::id(),
        if a.stats_interval > 0 {
            format!(", and every {} s", a.stats_interval)
        } else {
            String::new()
        }
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    drop(generated);
    let now = Instant::now();
    let mut progress = Progress {
        start: now,
        last: now,
        last_read: 0,
        last_write: 0,
    };
    let interval = (a.stats_interval > 0).then(|| Duration::from_secs(a.stats_interval));
    loop {
        match wait_signal(&signals, interval) {
            None | Some(libc::SIGUSR1) => println!("{}", progress.line(&server, &vol)),
            Some(sig) => {
                println!(
                    "signal {}: stopping (requests in flight complete first)",
                    if sig == libc::SIGINT {
                        "INT"
                    } else if sig == libc::SIGTERM {
                        "TERM"
                    } else {
                        "HUP"
                    }
                );
                break;
            }
        }
        let _ = std::io::stdout().flush();
    }
    let line = progress.line(&server, &vol);
    server.shutdown();
    vol.queue.wait_idle();
    let flushed = if a.read_only {
        Ok(())
    } else {
        vol.queue.target().flush()
    };
    println!("{line}");
    flushed.map_err(|e| format!("the final flush of the image failed: {e}"))?;
    println!("stopped");
    Ok(())
}
