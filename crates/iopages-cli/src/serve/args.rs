//! `iopages serve`'s command line: the flags, their checks, and what
//! they become (the server's options, a volume's options).
//!
//! Owns: [`ServeArgs`] (every flag, its help text and default), the
//! checks between flags that need no file or socket (sizes, timeouts,
//! TLS credentials, plaintext only on loopback), and the merging of the
//! server-wide flags with a `--config` file's `[server]` (the flag wins).
//! Must never: open a volume, a socket or a file other than the TLS
//! credentials, or print: it turns flags into options or a message
//! naming the flag.

use crate::config::ServerSection;
use crate::defaults::{DEFAULT_ARENA_TEXT, DEFAULT_MEMORY_BYTES, MAX_MEMORY_BYTES};
use iopages_crypt::strategy::Strategy;
use iopages_crypt::uring::DirectIo;
use iopages_nbd::volume::VolumeOptions;
use iopages_nbd::{Listen, ServerOptions, TlsConfig, TlsMode};
use std::path::PathBuf;
use std::time::Duration;

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

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Serve the exports a TOML file describes (several volumes behind one
    /// port; its format is iopages.toml(5), an example is
    /// contrib/iopages.toml) instead of one volume: each export
    /// names its image, passphrase source and settings there. The
    /// server-wide flags (listening, TLS, limits, statistics) still apply;
    /// the file's listen and unix addresses are used when no --listen or
    /// --unix is given.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "image", "passphrase_file", "size", "name", "read_only", "allow_discards",
        "inline_max", "allow_secondary_header", "max_kdf_memory", "workers", "allow",
        "rate_bytes", "rate_requests", "freshness"
    ])]
    pub(super) config: Option<PathBuf>,
    /// With --config: refuse to start when any export cannot be opened
    /// (default: report it, naming it, and serve the others).
    #[arg(long, requires = "config")]
    pub(super) strict: bool,
    /// TCP address to listen on (default 127.0.0.1:10809 when neither
    /// --unix nor a socket from systemd's socket activation is given —
    /// those are served beside this; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub(super) listen: Option<std::net::SocketAddr>,
    /// Unix socket to listen on (must not exist yet).
    #[arg(long, value_name = "PATH")]
    pub(super) unix: Option<PathBuf>,
    /// Serve this LUKS1 or LUKS2 image (a file or block device) instead of
    /// an in-memory volume. Needs --passphrase-file. An image on a remote
    /// NBD server: `nbd://host[:port]/export`, nbd+unix:///export?socket=PATH,
    /// or over TLS nbds://… / nbds+unix://… with tls-certificates=DIR
    /// (ca-cert.pem, client-cert.pem, client-key.pem) or tls-psk-file=FILE
    /// and tls-username=NAME; tls-hostname=NAME for a Unix socket.
    #[arg(long, value_name = "PATH")]
    pub(super) image: Option<PathBuf>,
    /// The image's passphrase: the file's exact bytes (as cryptsetup's
    /// --key-file), or `-` for one line from standard input.
    #[arg(long, value_name = "FILE")]
    pub(super) passphrase_file: Option<PathBuf>,
    /// Size of the in-memory volume's payload (default 256M); K, M, G
    /// suffixes (KiB, MiB, GiB). A multiple of 4096. Not with --image (an
    /// image's payload is what its header says).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    pub(super) size: Option<u64>,
    /// Export read-only (writes get EPERM; the image is opened read-only).
    #[arg(long)]
    pub(super) read_only: bool,
    /// Export name clients ask for.
    #[arg(long, value_name = "NAME", default_value = "iopages")]
    pub(super) name: String,
    /// Page arena for out pages and payload buffers; K, M, G suffixes.
    #[arg(long, value_name = "BYTES", default_value = DEFAULT_ARENA_TEXT.as_str(), value_parser = crate::parse_size)]
    pub(super) arena: u64,
    /// Crypt worker threads (default: one per core; 64 for an nbd:// image,
    /// whose requests each wait on the remote).
    #[arg(long, value_name = "N")]
    pub(super) workers: Option<usize>,
    /// Out-page allocation strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::Compound)]
    pub(super) strategy: StrategyArg,
    /// How the image is read and written: O_DIRECT where the file system
    /// takes it (auto), O_DIRECT or fail (direct), or through the page
    /// cache (buffered).
    #[arg(long, value_enum, default_value_t = IoArg::Auto)]
    pub(super) io: IoArg,
    /// Serve requests up to this size on their connection's thread instead
    /// of the crypt workers (dm-crypt's no_read_workqueue /
    /// no_write_workqueue, by size); 0: never. Default: 64K when the
    /// volume is in memory or served --io buffered, 0 with O_DIRECT or a
    /// remote image.
    #[arg(long, value_name = "BYTES", value_parser = parse_inline)]
    pub(super) inline_max: Option<u32>,
    /// Print a statistics line every SECS seconds (0: only on SIGUSR1 and
    /// at exit).
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    pub(super) stats_interval: u64,
    /// Also write every statistics snapshot (each interval, SIGUSR1, the
    /// last at exit) to FILE as JSON, replacing it whole each time: the
    /// counters of the statistics line and the I/O shape histograms
    /// (request sizes and offset alignment per direction, partial-sector
    /// requests and their worst-case write amplification).
    #[arg(long, value_name = "FILE")]
    pub(super) stats_json: Option<PathBuf>,
    /// Largest Argon2 memory a key slot of the --image may ask for (K, M,
    /// G suffixes; default 1G, at most 4G); a slot over it, or over the
    /// other key-derivation limits, is refused before deriving anything.
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    pub(super) max_kdf_memory: Option<u64>,
    /// Serve a LUKS2 --image through its secondary header even though the
    /// primary header area now carries another format's signature (the
    /// device was probably reformatted: only to recover the old volume on
    /// purpose; writes would land in the other format's data).
    #[arg(long)]
    pub(super) allow_secondary_header: bool,
    /// Serve TRIM by punching the whole encryption sectors inside it out
    /// of the image (fallocate; BLKDISCARD on a block device), WRITE_ZEROES
    /// by punching too (and offer fast zeroing), read a sector whose
    /// ciphertext is all zeros as zeros, and report the image's holes in
    /// block status, so copies skip unused space. The same trade-off as
    /// dm-crypt's allow_discards: whoever sees the image learns which
    /// blocks are unused, and whoever can write it can make a sector read
    /// as zeros (rather than as noise) by zeroing its ciphertext.
    #[arg(long)]
    pub(super) allow_discards: bool,
    /// An authenticated --image's freshness state: a small local file
    /// holding the root of the tree over its tags, rewritten atomically at
    /// every flush, so a store that rolls back a block or the whole
    /// volume is caught. Required to serve an authenticated volume
    /// writable; keep it where the store cannot change it.
    #[arg(long, value_name = "FILE")]
    pub(super) freshness: Option<PathBuf>,
    /// Accept the store's current tree as fresh and write a new state file
    /// (a lost state file, or one older than the store). Whatever the
    /// store holds now is believed: use it only when you know why.
    #[arg(long)]
    pub(super) freshness_reset: bool,
    /// Memory for an authenticated volume's tag tree (per volume, whatever
    /// its size; the rest is read from the store and verified).
    #[arg(long, value_name = "BYTES", default_value = "64M", value_parser = parse_cache)]
    pub(super) freshness_cache: u64,
    /// TLS (NBD's STARTTLS): off; on (offered, plaintext clients still
    /// served); require (nothing but STARTTLS before TLS). Needs
    /// --tls-certificates or --tls-psk.
    #[arg(long, value_enum, default_value_t = TlsArg::Off)]
    pub(super) tls: TlsArg,
    /// X.509 credentials: DIR/server-cert.pem and DIR/server-key.pem (and
    /// DIR/ca-cert.pem with --tls-verify-peer), as qemu and nbdkit lay
    /// them out.
    #[arg(long, value_name = "DIR")]
    pub(super) tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by DIR/ca-cert.pem.
    #[arg(long)]
    pub(super) tls_verify_peer: bool,
    /// Pre-shared keys instead of certificates: psktool's format, one
    /// `identity:hexkey` per line.
    #[arg(long, value_name = "FILE")]
    pub(super) tls_psk: Option<PathBuf>,
    /// Allow serving plaintext on a TCP address that is not loopback
    /// (otherwise refused: the decrypted volume would cross the network in
    /// clear; use --tls require).
    #[arg(long)]
    pub(super) allow_plaintext: bool,
    /// Connections in transmission at once, shared fairly among peers (a
    /// peer: a TLS identity, else an IP address or IPv6 /64, or a Unix
    /// uid): when all are taken, a peer under its share gets one by
    /// closing the newest idle connection of the peer furthest over its
    /// own; a peer at its share is refused.
    #[arg(long, value_name = "N", default_value_t = iopages_nbd::DEFAULT_MAX_CONNECTIONS)]
    pub(super) max_connections: usize,
    /// Connections still in the handshake (TLS included) at once, in a
    /// pool of their own: when it is full, a new connection closes the
    /// least advanced handshake of the peer holding the most, so silent
    /// sockets cannot keep a client with credentials out. Default 32 (or
    /// the config's max-handshakes).
    #[arg(long, value_name = "N")]
    pub(super) max_handshakes: Option<usize>,
    /// Each peer's guaranteed share of --max-connections is at least N
    /// (default 2, or the config's peer-min-connections; at most the
    /// limit).
    #[arg(long, value_name = "N")]
    pub(super) peer_min_connections: Option<usize>,
    /// Payload bytes in flight over all connections (read buffers, write
    /// payloads, and the chunks WRITE_ZEROES and TRIM are being served
    /// in), shared fairly among peers; past its share, a request waits up
    /// to --reply-timeout, then gets ENOMEM. K, M, G suffixes; at least
    /// 32M (the largest request).
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = crate::parse_size)]
    pub(super) max_inflight: u64,
    /// Each peer's guaranteed share of --max-inflight is at least BYTES,
    /// and as much is kept free for peers holding less (default 16M, or
    /// the config's peer-min-inflight).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    pub(super) peer_min_inflight: Option<u64>,
    /// Who may use the export (repeatable; default: anyone admitted):
    /// psk:NAME (a TLS PSK identity), dn:SUBJECT (a verified client
    /// certificate's subject, RFC 4514: dn:CN=alice,O=example), uid:N and
    /// gid:N (a Unix socket peer), ip:CIDR. Others are told the export
    /// does not exist and do not see it listed. psk: and dn: need --tls
    /// require (dn: with --tls-verify-peer).
    #[arg(long = "allow", value_name = "RULE", value_parser = parse_rule)]
    pub(super) allow: Vec<iopages_nbd::AllowRule>,
    /// Limit the export to BYTES per second read, written, zeroed or
    /// discarded, over all its clients (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    pub(super) rate_bytes: Option<u64>,
    /// Limit the export to N requests per second over all its clients.
    #[arg(long, value_name = "N")]
    pub(super) rate_requests: Option<u64>,
    /// Close a connection with nothing in flight that sends nothing for
    /// SECS seconds (0: never).
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub(super) idle_timeout: u64,
    /// How long a thread serving a connection with nothing in flight waits
    /// for its client's next request before it parks the connection, in
    /// milliseconds, unless another connection is ready first. Parked
    /// connections wait in one epoll instance, and a few threads (one per
    /// core) serve whichever comes back. 0: park at once.
    #[arg(long, value_name = "MS", default_value_t = iopages_nbd::DEFAULT_PARK_AFTER.as_millis() as u64)]
    pub(super) park_after: u64,
    /// A client that has not taken a reply SECS seconds after it was ready
    /// (or not sent a payload SECS seconds after its header, or the rest
    /// of a header SECS seconds after its first byte) loses its
    /// connection.
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::REPLY_TIMEOUT.as_secs())]
    pub(super) reply_timeout: u64,
    /// A client that has not finished the handshake SECS seconds after it
    /// connected is disconnected.
    #[arg(long, value_name = "SECS", default_value_t = iopages_nbd::HANDSHAKE_TIMEOUT.as_secs())]
    pub(super) handshake_timeout: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (and a health check
    /// at /healthz); port 0 picks a free port. No volume data, but the
    /// export names and their traffic: any address is allowed.
    #[arg(long, value_name = "ADDR")]
    pub(super) metrics: Option<std::net::SocketAddr>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum TlsArg {
    /// Plaintext only.
    Off,
    /// TLS offered; plaintext clients still served.
    On,
    /// TLS required before anything else.
    Require,
}

/// The server-wide limits and TLS from the command line (and the
/// config's `[server]`, for what the command line leaves out).
pub(super) fn server_options(
    a: &ServeArgs,
    listen: &[Listen],
    file: Option<&ServerSection>,
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
        park_after: park_after(a.park_after)?,
        tls,
        ..ServerOptions::default()
    };
    share_options(a, file, &mut o)?;
    Ok(o)
}

/// `--park-after`, at most an hour (the idle timeout's default).
fn park_after(ms: u64) -> Result<Duration, String> {
    if ms > 3_600_000 {
        return Err(format!("--park-after {ms}: at most 3600000 ms (an hour)"));
    }
    Ok(Duration::from_millis(ms))
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
    file: Option<&ServerSection>,
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
pub(super) enum IoArg {
    /// O_DIRECT, falling back to buffered I/O where refused.
    Auto,
    /// O_DIRECT or fail.
    Direct,
    /// Buffered, through the page cache.
    Buffered,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum StrategyArg {
    /// One mempool allocation per page.
    PerPage,
    /// Bulk page allocation.
    Bulk,
    /// High-order blocks, then single pages.
    Compound,
}

/// The checks between the volume's flags (`--workers`, `--size`,
/// `--image`, `--passphrase-file`), before anything is opened.
///
/// **Returns:** the in-memory volume's size (`--size` or the default);
/// the error naming the flag.
pub(super) fn check_volume_flags(a: &ServeArgs) -> Result<u64, String> {
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
    Ok(size)
}

/// The options every volume is opened with, from the command line (a
/// `--config` file's exports override theirs).
pub(super) fn volume_options(a: &ServeArgs) -> VolumeOptions {
    let mut opts = VolumeOptions {
        arena_bytes: a.arena,
        read_only: a.read_only,
        direct: match a.io {
            IoArg::Auto => DirectIo::Auto,
            IoArg::Direct => DirectIo::Require,
            IoArg::Buffered => DirectIo::Off,
        },
        strategy: match a.strategy {
            StrategyArg::PerPage => Strategy::PerPage,
            StrategyArg::Bulk => Strategy::Bulk,
            StrategyArg::Compound => Strategy::Compound,
        },
        ..VolumeOptions::default()
    };
    opts.workers = a.workers;
    opts.kdf_limits = crate::luks_kdf::kdf_limits(a.max_kdf_memory);
    opts.allow_secondary_header = a.allow_secondary_header;
    opts.allow_discards = a.allow_discards;
    opts.freshness = iopages_crypt::integrity::Freshness {
        state: a.freshness.clone(),
        reset: a.freshness_reset,
    };
    opts.freshness_cache = usize::try_from(a.freshness_cache).unwrap_or(usize::MAX);
    opts
}

/// `--freshness-cache`: a size of at least 64 KiB.
fn parse_cache(s: &str) -> Result<u64, String> {
    let b = crate::parse_size(s)?;
    if b < 64 << 10 {
        return Err(format!("{s}: the tag tree cache needs at least 64K"));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn the_arena_defaults_to_the_shared_constant_and_help_shows_it() {
        let cli = Cli::try_parse_from(["serve"]).unwrap();
        assert_eq!(cli.serve.arena, crate::defaults::DEFAULT_ARENA_BYTES);
        let help = <Cli as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        assert!(help.contains("[default: 512M]"), "{help}");
    }
}
