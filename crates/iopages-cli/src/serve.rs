//! `iopages serve`: an encrypted volume over NBD until a signal stops it.
//!
//! Owns: choosing the volume (an in-memory LUKS2 volume, or a LUKS image
//! opened with a passphrase), the listeners, the progress and statistics
//! lines, and signals: SIGUSR1 prints statistics, SIGINT and SIGTERM stop
//! the server cleanly (requests in flight complete, the image is flushed,
//! totals printed). Must never: exit with acknowledged writes unflushed.

use crate::passphrase::read_passphrase;
use crate::served::{self, Served, Volumes};
use iopages_crypt::strategy::Strategy;
use iopages_nbd::volume::{self, VolumeOptions};
use iopages_nbd::{
    Export, ExportConfig, ExportVolume, Listen, Server, ServerOptions, TlsConfig, TlsMode,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests served on the connection's thread by default, for fast
/// backends: the hand-off to a worker costs more than a small request
/// (4 KiB random I/O through the page cache: about 100 000 IOPS inline vs
/// 75 000 through the workers here), while large requests gain from
/// several workers encrypting at once (1 MiB writes: ~750 MiB/s inline vs
/// 1100–1600 MiB/s through the workers).
pub(crate) const DEFAULT_INLINE_MAX_BYTES: u32 = 64 << 10;

fn parse_rule(s: &str) -> Result<iopages_nbd::AllowRule, String> {
    s.parse()
}

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
    /// Serve the exports a TOML file describes (several volumes behind one
    /// port; see contrib/iopages.toml) instead of one volume: each export
    /// names its image, passphrase source and settings there. The
    /// server-wide flags (listening, TLS, limits, statistics) still apply;
    /// the file's listen and unix addresses are used when no --listen or
    /// --unix is given.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "image", "passphrase_file", "size", "name", "read_only", "allow_discards",
        "inline_max", "allow_secondary_header", "max_kdf_memory", "workers", "allow",
        "rate_bytes", "rate_requests"
    ])]
    config: Option<PathBuf>,
    /// With --config: refuse to start when any export cannot be opened
    /// (default: report it, naming it, and serve the others).
    #[arg(long, requires = "config")]
    strict: bool,
    /// TCP address to listen on (default 127.0.0.1:10809 when neither
    /// --unix nor a socket from systemd's socket activation is given —
    /// those are served beside this; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// Unix socket to listen on (must not exist yet).
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Serve this LUKS1 or LUKS2 image (a file or block device) instead of
    /// an in-memory volume. Needs --passphrase-file. An image on a remote
    /// NBD server: nbd://host[:port]/export, nbd+unix:///export?socket=PATH,
    /// or over TLS nbds://… / nbds+unix://… with tls-certificates=DIR
    /// (ca-cert.pem, client-cert.pem, client-key.pem) or tls-psk-file=FILE
    /// and tls-username=NAME; tls-hostname=NAME for a Unix socket.
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
    /// Crypt worker threads (default: one per core; 64 for an nbd:// image,
    /// whose requests each wait on the remote).
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
    /// volume is in memory or served --io buffered, 0 with O_DIRECT or a
    /// remote image.
    #[arg(long, value_name = "BYTES", value_parser = parse_inline)]
    inline_max: Option<u32>,
    /// Print a statistics line every SECS seconds (0: only on SIGUSR1 and
    /// at exit).
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    stats_interval: u64,
    /// Also write every statistics snapshot (each interval, SIGUSR1, the
    /// last at exit) to FILE as JSON, replacing it whole each time: the
    /// counters of the statistics line and the I/O shape histograms
    /// (request sizes and offset alignment per direction, partial-sector
    /// requests and their worst-case write amplification).
    #[arg(long, value_name = "FILE")]
    stats_json: Option<PathBuf>,
    /// Largest Argon2 memory a key slot of the --image may ask for (K, M,
    /// G suffixes; default 1G, at most 4G); a slot over it, or over the
    /// other key-derivation limits, is refused before deriving anything.
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    max_kdf_memory: Option<u64>,
    /// Serve a LUKS2 --image through its secondary header even though the
    /// primary header area now carries another format's signature (the
    /// device was probably reformatted: only to recover the old volume on
    /// purpose; writes would land in the other format's data).
    #[arg(long)]
    allow_secondary_header: bool,
    /// Serve TRIM by punching the whole encryption sectors inside it out
    /// of the image (fallocate; BLKDISCARD on a block device), WRITE_ZEROES
    /// by punching too (and offer fast zeroing), read a sector whose
    /// ciphertext is all zeros as zeros, and report the image's holes in
    /// block status, so copies skip unused space. The same trade-off as
    /// dm-crypt's allow_discards: whoever sees the image learns which
    /// blocks are unused, and whoever can write it can make a sector read
    /// as zeros (rather than as noise) by zeroing its ciphertext.
    #[arg(long)]
    allow_discards: bool,
    /// TLS (NBD's STARTTLS): off; on (offered, plaintext clients still
    /// served); require (nothing but STARTTLS before TLS). Needs
    /// --tls-certificates or --tls-psk.
    #[arg(long, value_enum, default_value_t = TlsArg::Off)]
    tls: TlsArg,
    /// X.509 credentials: DIR/server-cert.pem and DIR/server-key.pem (and
    /// DIR/ca-cert.pem with --tls-verify-peer), as qemu and nbdkit lay
    /// them out.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by DIR/ca-cert.pem.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Pre-shared keys instead of certificates: psktool's format, one
    /// `identity:hexkey` per line.
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Allow serving plaintext on a TCP address that is not loopback
    /// (otherwise refused: the decrypted volume would cross the network in
    /// clear; use --tls require).
    #[arg(long)]
    allow_plaintext: bool,
    /// Connections in transmission at once, shared fairly among peers (a
    /// peer: a TLS identity, else an IP address or IPv6 /64, or a Unix
    /// uid): when all are taken, a peer under its share gets one by
    /// closing the newest idle connection of the peer furthest over its
    /// own; a peer at its share is refused.
    #[arg(long, value_name = "N", default_value_t = iopages_nbd::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Connections still in the handshake (TLS included) at once, in a
    /// pool of their own: when it is full, a new connection closes the
    /// least advanced handshake of the peer holding the most, so silent
    /// sockets cannot keep a client with credentials out. Default 32 (or
    /// the config's max-handshakes).
    #[arg(long, value_name = "N")]
    max_handshakes: Option<usize>,
    /// Each peer's guaranteed share of --max-connections is at least N
    /// (default 2, or the config's peer-min-connections; at most the
    /// limit).
    #[arg(long, value_name = "N")]
    peer_min_connections: Option<usize>,
    /// Payload bytes in flight over all connections (read buffers, write
    /// payloads, and the chunks WRITE_ZEROES and TRIM are being served
    /// in), shared fairly among peers; past its share, a request waits up
    /// to --reply-timeout, then gets ENOMEM. K, M, G suffixes; at least
    /// 32M (the largest request).
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = crate::parse_size)]
    max_inflight: u64,
    /// Each peer's guaranteed share of --max-inflight is at least BYTES,
    /// and as much is kept free for peers holding less (default 16M, or
    /// the config's peer-min-inflight).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    peer_min_inflight: Option<u64>,
    /// Who may use the export (repeatable; default: anyone admitted):
    /// psk:NAME (a TLS PSK identity), dn:SUBJECT (a verified client
    /// certificate's subject, RFC 4514: dn:CN=alice,O=example), uid:N and
    /// gid:N (a Unix socket peer), ip:CIDR. Others are told the export
    /// does not exist and do not see it listed. psk: and dn: need --tls
    /// require (dn: with --tls-verify-peer).
    #[arg(long = "allow", value_name = "RULE", value_parser = parse_rule)]
    allow: Vec<iopages_nbd::AllowRule>,
    /// Limit the export to BYTES per second read, written, zeroed or
    /// discarded, over all its clients (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    rate_bytes: Option<u64>,
    /// Limit the export to N requests per second over all its clients.
    #[arg(long, value_name = "N")]
    rate_requests: Option<u64>,
    /// Close a connection with nothing in flight that sends nothing for
    /// SECS seconds (0: never).
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::DEFAULT_IDLE_TIMEOUT.as_secs())]
    idle_timeout: u64,
    /// A client that has not taken a reply SECS seconds after it was ready
    /// (or not sent a payload SECS seconds after its header) loses its
    /// connection.
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::REPLY_TIMEOUT.as_secs())]
    reply_timeout: u64,
    /// A client that has not finished the handshake SECS seconds after it
    /// connected is disconnected.
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::HANDSHAKE_TIMEOUT.as_secs())]
    handshake_timeout: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (and a health check
    /// at /healthz); port 0 picks a free port. No volume data, but the
    /// export names and their traffic: any address is allowed.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TlsArg {
    /// Plaintext only.
    Off,
    /// TLS offered; plaintext clients still served.
    On,
    /// TLS required before anything else.
    Require,
}

/// The server-wide limits and TLS from the command line (and the
/// config's `[server]`, for what the command line leaves out).
fn server_options(
    a: &ServeArgs,
    listen: &[Listen],
    file: Option<&crate::config::ServerSection>,
) -> Result<ServerOptions, String> {
    let secs = |name: &str, v: u64| {
        if v == 0 {
            Err(format!("--{name} must be at least 1 second"))
        } else {
            Ok(Duration::from_secs(v))
        }
    };
    if a.max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    if a.max_inflight < iopages_nbd::DEFAULT_MAX_BLOCK_BYTES as u64 {
        return Err(format!(
            "--max-inflight {} is below the largest request ({} bytes)",
            a.max_inflight,
            iopages_nbd::DEFAULT_MAX_BLOCK_BYTES
        ));
    }
    let mode = match a.tls {
        TlsArg::Off => None,
        TlsArg::On => Some(TlsMode::On),
        TlsArg::Require => Some(TlsMode::Require),
    };
    let tls = match (mode, &a.tls_certificates, &a.tls_psk) {
        (None, None, None) => None,
        (None, _, _) => {
            return Err("--tls-certificates and --tls-psk need --tls on or --tls require".into())
        }
        (Some(_), Some(_), Some(_)) => {
            return Err("give --tls-certificates or --tls-psk, not both".into())
        }
        (Some(_), None, None) => {
            return Err("--tls on|require needs --tls-certificates DIR or --tls-psk FILE".into())
        }
        (Some(m), Some(dir), None) => {
            Some(TlsConfig::x509(dir, a.tls_verify_peer, m).map_err(|e| e.to_string())?)
        }
        (Some(m), None, Some(f)) => {
            if a.tls_verify_peer {
                return Err("--tls-verify-peer goes with --tls-certificates".into());
            }
            Some(TlsConfig::psk(f, m).map_err(|e| e.to_string())?)
        }
    };
    if a.tls_verify_peer && a.tls_certificates.is_none() {
        return Err("--tls-verify-peer goes with --tls-certificates".into());
    }
    if mode != Some(TlsMode::Require) && !a.allow_plaintext {
        refuse_plaintext_beyond_loopback(listen)?;
    }
    let mut o = ServerOptions {
        max_connections: a.max_connections,
        max_inflight_bytes: a.max_inflight,
        idle_timeout: (a.idle_timeout > 0).then(|| Duration::from_secs(a.idle_timeout)),
        reply_timeout: secs("reply-timeout", a.reply_timeout)?,
        tls,
        ..ServerOptions::default()
    };
    share_options(a, file, &mut o)?;
    Ok(o)
}

/// Plaintext only on loopback: elsewhere the decrypted volume would cross
/// the network in clear, to whoever reaches the port.
fn refuse_plaintext_beyond_loopback(listen: &[Listen]) -> Result<(), String> {
    for l in listen {
        if let Listen::Tcp(addr) = l {
            if !addr.ip().is_loopback() {
                return Err(format!(
                    "{addr} is not a loopback address: clients would read the decrypted volume in clear, and anyone who reaches it could use it. Use --tls require with client authentication (--tls-psk FILE, or --tls-certificates DIR --tls-verify-peer) and --allow rules (psk:NAME, dn:SUBJECT) per export; or pass --allow-plaintext"
                ));
            }
        }
    }
    Ok(())
}

/// The handshake pool and the floors of the peers' shares: the flag, else
/// the config's `[server]` key, else the default.
fn share_options(
    a: &ServeArgs,
    file: Option<&crate::config::ServerSection>,
    o: &mut ServerOptions,
) -> Result<(), String> {
    let pick = |flag: Option<usize>, key: Option<usize>, default, name: &str| match flag
        .or(key)
        .unwrap_or(default)
    {
        0 => Err(format!("--{name} must be at least 1")),
        n => Ok(n),
    };
    o.peer_min_inflight_bytes = a
        .peer_min_inflight
        .or(file.and_then(|f| f.peer_min_inflight))
        .unwrap_or(iopages_nbd::DEFAULT_PEER_MIN_INFLIGHT_BYTES);
    if o.peer_min_inflight_bytes == 0 {
        return Err("--peer-min-inflight must be at least 1 byte".into());
    }
    o.peer_min_connections = pick(
        a.peer_min_connections,
        file.and_then(|f| f.peer_min_connections),
        iopages_nbd::DEFAULT_PEER_MIN_CONNECTIONS,
        "peer-min-connections",
    )?;
    o.max_handshakes = pick(
        a.max_handshakes,
        file.and_then(|f| f.max_handshakes),
        iopages_nbd::DEFAULT_MAX_HANDSHAKES,
        "max-handshakes",
    )?;
    Ok(())
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
pub(crate) fn wait_signal(set: &libc::sigset_t, timeout: Option<Duration>) -> Option<i32> {
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
    max_connections: usize,
    max_inflight: u64,
    start: Instant,
    last: Instant,
    last_read: u64,
    last_write: u64,
}

impl Progress {
    fn line(&mut self, server: &Server, volumes: &[Served]) -> String {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64().max(1e-9);
        let s = server.stats();
        // Out pages and discards summed over the volumes opened so far.
        let mut out = iopages_crypt::strategy::OutStats::default();
        let (mut discard_bytes, mut punch_bytes) = (0, 0);
        for s in volumes {
            let o = s.vol.queue.target().out_pages().stats();
            out.direct_pages += o.direct_pages;
            out.compound_blocks += o.compound_blocks;
            out.pool_pages += o.pool_pages;
            out.reserve_pages += o.reserve_pages;
            out.waits += o.waits;
            let t = s.vol.queue.target().stats();
            discard_bytes += t.discard_bytes;
            punch_bytes += t.zero_punch_bytes;
        }
        let line = format!(
            "[{:>7.1}s] write {:.1} MiB/s ({:.1} MiB, {} req, {} err) | read {:.1} MiB/s ({:.1} MiB, {} req, {} err) | flush {} | out pages: {:.1}% by the strategy ({} compound blocks), {} via mempool ({} from reserve, {} waits) | payload buffers: {} arena blocks, {} vmalloc, {} heap | sessions {} ({} TLS, {} TLS failed) | open {}/{} ({} refused) | timeouts: {} handshake, {} reply, {} payload, {} idle | in flight {:.1}/{:.0} MiB ({} waits, {} ENOMEM)",
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
            s.tls_sessions,
            s.tls_failures,
            s.open_connections,
            self.max_connections,
            s.refused_connections,
            s.handshake_timeouts,
            s.reply_timeouts,
            s.payload_timeouts,
            s.idle_closes,
            mib(s.budget_used_bytes),
            mib(self.max_inflight),
            s.budget_waits,
            s.budget_refusals,
        );
        self.last = now;
        self.last_read = s.read.bytes;
        self.last_write = s.write.bytes;
        format!(
            "{line} | {} | trim {} ({} MiB discarded), write-zeroes {} ({} MiB punched), block status {} | shape: write {}; read {}",
            peers_summary(&s.peers),
            s.trim.requests,
            discard_bytes >> 20,
            s.write_zeroes.requests,
            punch_bytes >> 20,
            s.block_status.requests,
            shape_summary(&s.shape.write, s.shape.sector_bytes),
            shape_summary(&s.shape.read, s.shape.sector_bytes)
        )
    }
}

/// How the limits are shared among the peers, in a few words.
fn peers_summary(p: &iopages_nbd::PeerStats) -> String {
    format!(
        "peers {} ({} at their share; {} handshaking, {} handshakes closed for newcomers, {} connections given back, {} budget waits behind smaller peers, {} refused by allow rules)",
        p.active,
        p.at_share,
        p.handshakes_open,
        p.handshake_evictions,
        p.share_evictions,
        p.budget_share_waits,
        p.authorization_refusals
    )
}

/// "2^k" bytes as "512", "4K", "1M".
fn pow2_name(k: usize) -> String {
    match k {
        0..=9 => format!("{}", 1u64 << k),
        10..=19 => format!("{}K", 1u64 << (k - 10)),
        _ => format!("{}M", 1u64 << (k - 20)),
    }
}

/// One direction of the I/O shape in a few words: the most common request
/// sizes, the share aligned to the volume's sector, partial-sector
/// requests and the amplification serving them would cost.
fn shape_summary(d: &iopages_nbd::DirShape, sector_bytes: u64) -> String {
    let n = d.requests();
    if n == 0 {
        return "none".into();
    }
    let mut by_size: Vec<(usize, u64)> = d
        .sizes
        .iter()
        .copied()
        .enumerate()
        .filter(|&(_, c)| c > 0)
        .collect();
    by_size.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let sizes: Vec<String> = by_size
        .iter()
        .take(3)
        .map(|&(k, c)| format!("{}B {:.0}%", pow2_name(k), c as f64 * 100.0 / n as f64))
        .collect();
    let sector_k = sector_bytes.max(1).trailing_zeros() as usize;
    let aligned: u64 = d.align.iter().skip(sector_k).sum();
    format!(
        "{} ({}), {:.0}% at {}B-aligned offsets, {} partial-sector (x{:.2} if served by read-modify-write)",
        n,
        sizes.join(", "),
        aligned as f64 * 100.0 / n as f64,
        sector_bytes,
        d.partial_sector,
        d.amplification()
    )
}

/// The statistics as JSON (what --stats-json writes).
fn stats_json(s: &iopages_nbd::Stats, elapsed: Duration) -> serde_json::Value {
    use serde_json::json;
    let cmd = |c: &iopages_nbd::CommandStats| json!({"requests": c.requests, "bytes": c.bytes, "errors": c.errors});
    let dir = |d: &iopages_nbd::DirShape| {
        json!({
            "requests": d.requests(),
            "sizes_log2": d.sizes.to_vec(),
            "align_log2": d.align.to_vec(),
            "partial_sector": d.partial_sector,
            "bytes": d.bytes,
            "whole_sector_bytes": d.sector_bytes,
            "amplification": d.amplification(),
        })
    };
    json!({
        "elapsed_s": elapsed.as_secs_f64(),
        "connections": s.connections,
        "sessions": s.sessions,
        "tls_sessions": s.tls_sessions,
        "tls_failures": s.tls_failures,
        "read": cmd(&s.read),
        "write": cmd(&s.write),
        "flush": cmd(&s.flush),
        "trim": cmd(&s.trim),
        "write_zeroes": cmd(&s.write_zeroes),
        "block_status": cmd(&s.block_status),
        "other": cmd(&s.other),
        "open_connections": s.open_connections,
        "refused_connections": s.refused_connections,
        "timeouts": {
            "handshake": s.handshake_timeouts,
            "reply": s.reply_timeouts,
            "payload": s.payload_timeouts,
            "idle": s.idle_closes,
        },
        "budget": {
            "used_bytes": s.budget_used_bytes,
            "waits": s.budget_waits,
            "refusals": s.budget_refusals,
        },
        "peers": {
            "handshakes_open": s.peers.handshakes_open,
            "handshake_evictions": s.peers.handshake_evictions,
            "share_evictions": s.peers.share_evictions,
            "authorization_refusals": s.peers.authorization_refusals,
            "active": s.peers.active,
            "at_share": s.peers.at_share,
            "budget_share_waits": s.peers.budget_share_waits,
        },
        "shape": {
            "sector_bytes": s.shape.sector_bytes,
            "buckets": "index k counts 2^k bytes: sizes in (2^(k-1), 2^k], offsets whose largest power-of-two divisor is 2^k (offset 0 in the last); the last bucket also takes everything larger",
            "read": dir(&s.shape.read),
            "write": dir(&s.shape.write),
        },
    })
}

/// Each export's own figures, by name (what --stats-json adds to the
/// totals).
fn exports_json(server: &Server) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for name in server.export_names() {
        let s = server.export_stats(name).unwrap_or_default();
        let state = match server.export_state(name) {
            Some(iopages_nbd::ExportState::Open) => "open",
            Some(iopages_nbd::ExportState::Failed) => "failed",
            _ => "closed",
        };
        m.insert(
            name.to_string(),
            serde_json::json!({
                "state": state,
                "open_failures": s.export.open_failures,
                "rate_waits": s.export.rate_waits,
                "read": {"requests": s.read.requests, "bytes": s.read.bytes},
                "write": {"requests": s.write.requests, "bytes": s.write.bytes},
            }),
        );
    }
    serde_json::Value::Object(m)
}

/// Replace `path` with `v` whole, so a reader never sees half a file:
/// written to a new file beside it under a random name (created with
/// `O_EXCL | O_NOFOLLOW`, owner-only, so nobody's link or file there is
/// followed or overwritten), then renamed over it.
fn write_stats_json(path: &Path, v: &serde_json::Value) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut nonce = [0u8; 8];
    // SAFETY: getrandom fills the 8 bytes of a live local array.
    let n = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
    if n != nonce.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{:016x}.tmp", u64::from_ne_bytes(nonce)));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    let text = serde_json::to_string_pretty(v).expect("JSON values serialize") + "\n";
    let r = f
        .write_all(text.as_bytes())
        .and_then(|_| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// The one volume of a command line without --config: an --image (a
/// file, block device or NBD URI) or the in-memory volume, opened now.
/// Returns its export and, for the in-memory volume, the generated
/// passphrase (shown once).
fn single_export(
    a: &ServeArgs,
    size: u64,
    opts: VolumeOptions,
    signals: &libc::sigset_t,
    volumes: &Volumes,
) -> Result<(Export, Option<zeroize::Zeroizing<String>>), String> {
    let pass = match (&a.image, &a.passphrase_file) {
        (Some(_), Some(pf)) => Some(read_passphrase(pf)?),
        (Some(path), None) => {
            return Err(format!(
            "--image {} needs --passphrase-file FILE (or - to read one line from standard input)",
            path.display()
        ))
        }
        _ => None,
    };
    let image = a.image.as_deref().map(served::image_spec);
    let read_only = opts.read_only;
    let (vol, generated) =
        served::open_watched(signals, "the volume", move || match (&image, pass) {
            (Some(image), Some(pass)) => {
                served::open_image(image, &pass, &opts, None).map(|v| (v, None))
            }
            _ => volume::in_memory(size, &opts)
                .map(|(v, p)| (v, Some(p)))
                .map_err(|e| format!("cannot make the in-memory LUKS2 volume: {e}")),
        })?;
    let mut export = ExportConfig::new(a.name.clone());
    export.read_only = a.read_only;
    export.handshake_timeout = Duration::from_secs(a.handshake_timeout);
    export.inline_max_bytes = a.inline_max.unwrap_or_else(|| served::default_inline(&vol));
    export.description = served::description(&vol);
    export.allow = a.allow.clone();
    export.rate = iopages_nbd::RateLimit {
        bytes_per_second: a.rate_bytes,
        requests_per_second: a.rate_requests,
    };
    let queue = Arc::clone(&vol.queue);
    volumes.lock().push(Served {
        name: a.name.clone(),
        vol,
        read_only,
    });
    Ok((Export::ready(export, ExportVolume::new(queue)), generated))
}

/// The lines that describe an opened volume (the export's name first
/// when there can be several).
fn print_volume(s: &Served, named: bool) {
    let i = &s.vol.info;
    let who = if named {
        format!("export {}: ", s.name)
    } else {
        String::new()
    };
    println!(
        "{who}volume: {} {}, {}-bit key, {}-byte sectors, payload {} bytes at offset {}, key slot {}, uuid {}",
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
        iopages_crypt::luks::printable(&i.uuid)
    );
    if !i.keys_locked {
        println!("{who}warning: the cipher keys could not be locked in memory (RLIMIT_MEMLOCK): they may be swapped out");
    }
    if s.vol.queue.target().discards_allowed() {
        println!("{who}discards: on (TRIM and WRITE_ZEROES punch holes in the image, holes read as zeros; which blocks are unused is visible to whoever sees the image)");
    }
    match (&i.image, &i.remote) {
        (Some(p), _) => println!("{who}image: {} ({})", p.display(), i.io),
        (None, Some(uri)) => println!("{who}image: {uri} ({})", i.io),
        (None, None) => println!("{who}image: in memory (gone when the server stops)"),
    }
}

pub fn serve(a: ServeArgs) -> Result<(), String> {
    let cfg = match &a.config {
        Some(p) => Some(crate::config::load(p).map_err(|e| e.to_string())?),
        None => None,
    };
    // Sockets passed by systemd (socket activation) replace the default
    // address; --listen and --unix are served beside them. Taken first,
    // before any thread starts (it edits the environment).
    let inherited = crate::activation::inherited_listeners()?.unwrap_or_default();
    let mut listen = Vec::new();
    if let Some(addr) = a.listen {
        listen.push(Listen::Tcp(addr));
    }
    if let Some(p) = &a.unix {
        listen.push(Listen::Unix(p.clone()));
    }
    if let (true, Some(c)) = (listen.is_empty(), &cfg) {
        listen.extend(c.server.listen.iter().map(|&a| Listen::Tcp(a)));
        listen.extend(c.server.unix.iter().map(|p| Listen::Unix(p.clone())));
    }
    if listen.is_empty() && inherited.is_empty() {
        let addr = iopages_nbd::DEFAULT_LISTEN
            .parse()
            .map_err(|e| format!("bad default address: {e}"))?;
        listen.push(Listen::Tcp(addr));
    }
    // Everything served, inherited sockets included (the plaintext check).
    let served = crate::activation::with_addresses(&listen, &inherited)?;
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
    let server_opts = server_options(&a, &served, cfg.as_ref().map(|c| &c.server))?;
    if a.handshake_timeout == 0 {
        return Err("--handshake-timeout must be at least 1 second".into());
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
    opts.workers = a.workers;
    opts.kdf_limits = crate::luks_cmd::kdf_limits(a.max_kdf_memory);
    opts.allow_secondary_header = a.allow_secondary_header;
    opts.allow_discards = a.allow_discards;
    let volumes: Volumes = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let tls = server_opts.tls.as_ref().map(|t| (t.mode(), t.kind()));
    let (exports, generated) = match &cfg {
        Some(cfg) => {
            let common = served::Common {
                base: opts,
                handshake_timeout: Duration::from_secs(a.handshake_timeout),
                strict: a.strict || cfg.server.strict,
            };
            let e = served::from_config(cfg, &common, &signals, &volumes)?;
            (e, None)
        }
        None => {
            let (e, generated) = single_export(&a, size, opts, &signals, &volumes)?;
            (vec![e], generated)
        }
    };
    let names: Vec<String> = exports.iter().map(|e| e.name().to_string()).collect();
    let mut server = Server::start_exports_on(exports, server_opts, &listen, inherited)
        .map_err(|e| e.to_string())?;
    // --metrics, or the file's `metrics`: every export, its volume once
    // open (lazy ones when their first client opens them).
    let metrics_addr = a
        .metrics
        .or_else(|| cfg.as_ref().and_then(|c| c.server.metrics));
    let metrics = match metrics_addr {
        Some(addr) => {
            let source = crate::metrics::MetricsSource::new(server.stats_handle());
            let listed = Arc::clone(&volumes);
            source.list_volumes(Box::new(move || {
                listed
                    .lock()
                    .iter()
                    .map(|s| (s.name.clone(), crate::metrics::volume_probe(&s.vol)))
                    .collect()
            }));
            let m = crate::metrics::MetricsServer::start(addr, source)
                .map_err(|e| format!("cannot serve --metrics on {addr}: {e}"))?;
            println!("metrics: http://{}/metrics", m.local_addr());
            Some(m)
        }
        None => None,
    };
    for s in volumes.lock().iter() {
        print_volume(s, cfg.is_some());
    }
    for n in &names {
        if server.export_is_open(n) == Some(false) {
            println!("export {n}: opened on first use");
        }
    }
    if let Some(p) = &generated {
        println!("passphrase (shown once): {}", p.as_str());
    }
    // nbds:// when TLS is required; with --tls on both schemes work.
    let s = if matches!(tls, Some((TlsMode::Require, _))) {
        "s"
    } else {
        ""
    };
    if let Some((mode, kind)) = tls {
        println!(
            "tls: {} ({kind})",
            if mode == TlsMode::Require {
                "required"
            } else {
                "offered"
            }
        );
    }
    for name in &names {
        for l in server.addresses() {
            match l {
                Listen::Tcp(addr) => println!("serving nbd{s}://{addr}/{name}"),
                Listen::Unix(p) => {
                    println!("serving nbd{s}+unix:///{name}?socket={}", p.display())
                }
            }
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
        max_connections: a.max_connections,
        max_inflight: a.max_inflight,
        start: now,
        last: now,
        last_read: 0,
        last_write: 0,
    };
    let interval = (a.stats_interval > 0).then(|| Duration::from_secs(a.stats_interval));
    // --stats-json: written now (a path that cannot be written is an
    // error before anything is served for long), then with every line.
    let mut json_failed = false;
    let mut emit_json = |server: &Server| {
        let Some(p) = &a.stats_json else {
            return Ok(());
        };
        let mut v = stats_json(&server.stats(), now.elapsed());
        v["exports"] = exports_json(server);
        let r = write_stats_json(p, &v);
        match r {
            Err(e) if !json_failed => {
                json_failed = true;
                Err(format!("cannot write --stats-json {}: {e}", p.display()))
            }
            _ => Ok(()),
        }
    };
    if let Err(e) = emit_json(&server) {
        drop(metrics);
        server.shutdown();
        return Err(e);
    }
    loop {
        match wait_signal(&signals, interval) {
            None | Some(libc::SIGUSR1) => {
                println!("{}", progress.line(&server, &volumes.lock()));
                if let Err(e) = emit_json(&server) {
                    eprintln!("warning: {e} (statistics go on on standard output)");
                }
            }
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
    if let Some(m) = metrics {
        m.stop();
    }
    // Stopping: a remote store that is down is not waited for (requests in
    // flight still end by their own deadlines).
    for s in volumes.lock().iter() {
        if let Some(r) = &s.vol.remote {
            r.stop_waiting();
        }
    }
    // The last line and --stats-json are the figures as stopped: every
    // connection closed and every budget given back (a client that had
    // just hung up is no longer counted as open).
    server.stop_serving();
    let line = progress.line(&server, &volumes.lock());
    if let Err(e) = emit_json(&server) {
        eprintln!("warning: {e}");
    }
    server.shutdown();
    // Every volume opened, lazy ones included, is flushed before exit.
    let mut failed = Vec::new();
    for s in volumes.lock().iter() {
        s.vol.queue.wait_idle();
        if !s.read_only {
            if let Err(e) = s.vol.queue.target().flush() {
                failed.push(format!("export {}: {e}", s.name));
            }
        }
    }
    println!("{line}");
    if !failed.is_empty() {
        return Err(format!(
            "the final flush of the image failed: {}",
            failed.join("; ")
        ));
    }
    println!("stopped");
    Ok(())
}
