//! What `iopages serve` prints: the lines that describe each volume and
//! where it is served at start, and the statistics line.
//!
//! Owns: the statistics line ([`Progress`]: rates since the last line,
//! totals, out pages, limits, peers, the I/O shape) and the start-up
//! lines (volumes, lazy exports, the generated passphrase, TLS, the URIs
//! served). Must never: change the server or a volume (it reads their
//! statistics), or write anywhere but standard output.

use crate::served::Served;
use iopages_nbd::{Listen, Server, TlsMode};
use std::time::Instant;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Statistics since the last line.
pub(super) struct Progress {
    max_connections: usize,
    max_inflight: u64,
    start: Instant,
    last: Instant,
    last_read: u64,
    last_write: u64,
}

impl Progress {
    /// The first line's rates count from `start`; `max_connections` and
    /// `max_inflight` are the limits the line shows usage against.
    pub(super) fn new(max_connections: usize, max_inflight: u64, start: Instant) -> Progress {
        Progress {
            max_connections,
            max_inflight,
            start,
            last: start,
            last_read: 0,
            last_write: 0,
        }
    }

    /// The statistics line: rates since the last line, totals since
    /// `start`.
    pub(super) fn line(&mut self, server: &Server, volumes: &[Served]) -> String {
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

/// The lines that describe an opened volume (the export's name first
/// when there can be several).
pub(super) fn print_volume(s: &Served, named: bool) {
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
    if let Some(mac) = &i.integrity {
        println!("{who}authenticated: {mac} tags on every 4 KiB block, the tree's root in the freshness state file; blocks that fail verification are refused (EIO)");
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

/// The start-up lines after the volumes: the exports opened on first
/// use, the generated passphrase (shown once), TLS, every URI served and
/// how to get statistics and stop.
pub(super) fn print_serving(
    server: &Server,
    names: &[String],
    generated: Option<&str>,
    tls: Option<(TlsMode, &str)>,
    stats_interval: u64,
) {
    for n in names {
        if server.export_is_open(n) == Some(false) {
            println!("export {n}: opened on first use");
        }
    }
    if let Some(p) = generated {
        println!("passphrase (shown once): {p}");
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
    for name in names {
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
        if stats_interval > 0 {
            format!(", and every {stats_interval} s")
        } else {
            String::new()
        }
    );
}
