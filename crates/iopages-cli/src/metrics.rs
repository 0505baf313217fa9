//! `iopages serve --metrics ADDR`: the server's counters over HTTP, in the
//! Prometheus text exposition format.
//!
//! Owns: the endpoint's thread (one thread, a `poll` loop over the
//! listener and at most [`MAX_CONNECTIONS`] clients), the HTTP it speaks
//! (`GET /metrics`, `GET /healthz`; 404 and 405 otherwise; one request a
//! connection), the bounds on what a client may make it hold (a request
//! head of at most [`MAX_HEAD_BYTES`], [`CLIENT_TIMEOUT`] to send it and
//! take the reply, the oldest client closed when a new one would pass the
//! connection limit), and turning a snapshot of the NBD server's and the
//! volumes' statistics into metric families — their names, help and
//! labels are this file's; `metrics/exposition.rs` writes them in the
//! text format the scraper asks for (Prometheus 0.0.4 unless its
//! `Accept` header prefers OpenMetrics).
//! Must never: block or slow the NBD server (it reads the server's atomic
//! counters; the volume probe takes only the short locks of a per-CPU
//! counter's sum and the mempool's statistics, as the statistics line
//! does), panic on what a client sends, or hold more than
//! [`MAX_CONNECTIONS`] clients.
//!
//! The metrics carry no volume data, but they name the exports and show
//! their traffic: the endpoint may listen on any address.

use exposition::{Family, Format, Histogram, Kind, Labels, Value};
use iopages_crypt::strategy::OutStats;
use iopages_nbd::remote::RemoteHealth;
use iopages_nbd::volume::Volume;
use iopages_nbd::{Stats, StatsHandle, LATENCY_BUCKETS};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod exposition;

/// Clients connected at once; a new one past it closes the oldest.
pub const MAX_CONNECTIONS: usize = 16;
/// Largest request head (request line and headers) read.
pub const MAX_HEAD_BYTES: usize = 8 << 10;
/// Time a client has to send its request head, and again to take the
/// reply.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes a client may send after its request head (a body, pipelined
/// requests) before it is closed.
const MAX_DROPPED_BYTES: usize = 64 << 10;

/// What a volume reports: its arena, where its out pages came from, and
/// its remote store's state.
#[derive(Clone, Debug, Default)]
pub struct VolumeStats {
    /// Pages in the volume's arena.
    pub arena_pages: u64,
    /// Of those, pages held now.
    pub arena_pages_in_use: u64,
    /// The out-page allocator's counts.
    pub out: OutStats,
    /// The remote store's reachability and counters (a remote image).
    pub remote: Option<RemoteHealth>,
    /// An authenticated volume's tag layer: failures, commits, recovery.
    pub integrity: Option<iopages_crypt::integrity::AuthStats>,
}

/// Reads a volume's statistics at scrape time.
pub type VolumeProbe = Arc<dyn Fn() -> VolumeStats + Send + Sync>;

/// The probe of an opened volume (keeps its allocator and queue alive).
pub fn volume_probe(vol: &Volume) -> VolumeProbe {
    let alloc = vol.alloc.clone();
    let queue = Arc::clone(&vol.queue);
    let remote = vol.remote.clone();
    let auth = vol.auth.clone();
    Arc::new(move || {
        // The accounting, not `stats()`: no zone lock.
        let a = alloc.accounting();
        VolumeStats {
            arena_pages: a.total_pages as u64,
            arena_pages_in_use: a.in_use_pages as u64,
            out: queue.target().out_pages().stats(),
            remote: remote.as_ref().map(|r| r.health()),
            integrity: auth.as_ref().map(|a| a.stats()),
        }
    })
}

/// What the endpoint reports: the server's statistics, and each export's
/// volume once it is open (listed at each scrape by
/// [`MetricsSource::list_volumes`]: a lazy export's as soon as its first
/// client has opened it).
pub struct MetricsSource {
    server: StatsHandle,
    /// Volumes listed at scrape time (exports opened on first use join
    /// the list when they open).
    listed: Mutex<Option<VolumeList>>,
}

/// Lists the volumes open now, by export, at scrape time.
pub type VolumeList = Box<dyn Fn() -> Vec<(String, VolumeProbe)> + Send + Sync>;

impl MetricsSource {
    /// A source reading `server`.
    pub fn new(server: StatsHandle) -> Arc<MetricsSource> {
        Arc::new(MetricsSource {
            server,
            listed: Mutex::new(None),
        })
    }

    /// Report the volumes `list` gives at each scrape.
    pub fn list_volumes(&self, list: VolumeList) {
        *self.listed.lock().unwrap_or_else(|e| e.into_inner()) = Some(list);
    }

    fn snapshot(&self) -> Snapshot {
        let probes: Vec<(String, VolumeProbe)> = self
            .listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|list| list())
            .unwrap_or_default();
        let exports = self
            .server
            .export_names()
            .into_iter()
            .map(|name| ExportSnapshot {
                stats: self.server.export_stats(&name).unwrap_or_default(),
                open: self.server.export_is_open(&name).unwrap_or(false),
                state: self.server.export_state(&name),
                volume: probes.iter().find(|(n, _)| *n == name).map(|(_, p)| p()),
                name,
            })
            .collect();
        Snapshot {
            total: self.server.stats(),
            exports,
        }
    }
}

#[derive(Debug)]
struct ExportSnapshot {
    name: String,
    stats: Stats,
    open: bool,
    state: Option<iopages_nbd::ExportState>,
    volume: Option<VolumeStats>,
}

/// Everything one scrape reports, read at once.
#[derive(Debug)]
struct Snapshot {
    total: Stats,
    exports: Vec<ExportSnapshot>,
}

/// Collects the metric families of a snapshot, in the order served.
struct Families<'a> {
    out: Vec<Family>,
    s: &'a Snapshot,
}

impl Families<'_> {
    /// A family of counters or gauges: one sample per label set.
    fn family(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        samples: Vec<(Labels, u64)>,
    ) {
        debug_assert!(kind != Kind::Histogram, "{name}");
        let samples = samples.into_iter().map(|(l, v)| (l, Value::Int(v)));
        self.push(name, help, kind, samples.collect());
    }

    /// A family as described.
    fn push(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        samples: Vec<(Labels, Value)>,
    ) {
        self.out.push(Family {
            name,
            help,
            kind,
            samples,
        });
    }

    /// One sample per export.
    fn per_export(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        f: impl Fn(&ExportSnapshot) -> Option<u64>,
    ) {
        let samples = self
            .s
            .exports
            .iter()
            .filter_map(|e| f(e).map(|v| (export_label(e), v)))
            .collect();
        self.family(name, help, kind, samples)
    }

    /// One sample per export and value of `label`.
    fn per_export_by(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        label: &'static str,
        f: impl Fn(&ExportSnapshot) -> Vec<(&'static str, u64)>,
    ) {
        let mut samples = Vec::new();
        for e in &self.s.exports {
            for (v, n) in f(e) {
                let mut l = export_label(e);
                l.push((label, v.to_string()));
                samples.push((l, n));
            }
        }
        self.family(name, help, kind, samples)
    }

    /// A server-wide sample.
    fn one(&mut self, name: &'static str, help: &'static str, kind: Kind, v: u64) {
        self.family(name, help, kind, vec![(Vec::new(), v)])
    }

    /// A histogram family: one sample per label set.
    fn histograms(
        &mut self,
        name: &'static str,
        help: &'static str,
        samples: Vec<(Labels, Histogram)>,
    ) {
        let samples = samples.into_iter().map(|(l, h)| (l, Value::Hist(h)));
        self.push(name, help, Kind::Histogram, samples.collect());
    }
}

fn export_label(e: &ExportSnapshot) -> Labels {
    vec![("export", e.name.clone())]
}

const COMMANDS: [&str; 7] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "block_status",
    "other",
];

/// One figure of each command's statistics, labelled by command name.
fn by_command(
    s: &Stats,
    pick: impl Fn(&iopages_nbd::CommandStats) -> u64,
) -> Vec<(&'static str, u64)> {
    COMMANDS
        .iter()
        .zip(commands(s))
        .map(|(n, c)| (*n, pick(c)))
        .collect()
}

fn commands(s: &Stats) -> [&iopages_nbd::CommandStats; 7] {
    [
        &s.read,
        &s.write,
        &s.flush,
        &s.trim,
        &s.write_zeroes,
        &s.block_status,
        &s.other,
    ]
}

impl Snapshot {
    /// Every metric family of this snapshot, in the order served.
    fn families(&self) -> Vec<Family> {
        let t = &self.total;
        let mut f = Families {
            out: Vec::new(),
            s: self,
        };
        requests(&mut f);
        request_durations(&mut f);
        request_resources(&mut f);
        volumes(&mut f);
        server(&mut f, t);
        server_limits(&mut f, t);
        tenants(&mut f, t);
        remotes(&mut f);
        integrity(&mut f);
        f.out
    }
}

/// Requests, per export: bytes read and written, requests and errors by
/// command.
fn requests(f: &mut Families<'_>) {
    use Kind::Counter;
    f.per_export(
        "iopages_read_bytes",
        "Bytes of NBD reads served successfully.",
        Counter,
        |e| Some(e.stats.read.bytes),
    );
    f.per_export(
        "iopages_write_bytes",
        "Bytes of NBD writes served successfully.",
        Counter,
        |e| Some(e.stats.write.bytes),
    );
    f.per_export_by(
        "iopages_requests",
        "NBD requests served successfully, by command.",
        Counter,
        "command",
        |e| by_command(&e.stats, |c| c.requests),
    );
    f.per_export_by(
        "iopages_request_errors",
        "NBD requests answered with an error, by command.",
        Counter,
        "command",
        |e| by_command(&e.stats, |c| c.errors),
    )
}

/// How long requests take, per export and command class.
fn request_durations(f: &mut Families<'_>) {
    let mut samples = Vec::new();
    for e in &f.s.exports {
        let l = &e.stats.latency;
        for (class, h) in [("read", &l.read), ("write", &l.write), ("other", &l.other)] {
            let mut labels = export_label(e);
            labels.push(("command_class", class.to_string()));
            samples.push((labels, histogram(h)));
        }
    }
    f.histograms(
        "iopages_request_duration_seconds",
        "Time from a request's header arriving to its reply being queued, by command class (other: flush, trim, write_zeroes).",
        samples,
    );
}

/// What requests hold now, per export: in flight, payload buffers taken.
fn request_resources(f: &mut Families<'_>) {
    use Kind::{Counter, Gauge};
    f.per_export(
        "iopages_requests_in_flight",
        "Requests submitted to the volume and not answered yet.",
        Gauge,
        |e| Some(e.stats.in_flight),
    );
    f.per_export_by(
        "iopages_payload_buffers",
        "Payload buffers taken, by where they came from.",
        Counter,
        "source",
        |e| {
            let b = &e.stats.buffers;
            vec![
                ("arena_contiguous", b.arena_contiguous),
                ("arena_vmalloc", b.arena_vmalloc),
                ("heap", b.heap),
            ]
        },
    )
}

/// Volumes, per export: open or not, the page arena, out pages.
fn volumes(f: &mut Families<'_>) {
    use Kind::{Counter, Gauge};
    f.per_export(
        "iopages_export_open",
        "1 when the export's volume is open (a lazy export opens on first use).",
        Gauge,
        |e| Some(e.open as u64),
    );
    f.per_export(
        "iopages_arena_pages",
        "Pages in the volume's page arena.",
        Gauge,
        |e| e.volume.as_ref().map(|v| v.arena_pages),
    );
    f.per_export(
        "iopages_arena_pages_in_use",
        "Pages of the volume's arena held now.",
        Gauge,
        |e| e.volume.as_ref().map(|v| v.arena_pages_in_use),
    );
    f.per_export_by(
        "iopages_out_pages",
        "Out pages (ciphertext of writes) by source: the allocation strategy's own attempt, the mempool's free pages, the mempool's reserve.",
        Counter,
        "source",
        |e| match &e.volume {
            Some(v) => vec![
                ("strategy", v.out.direct_pages),
                ("mempool", v.out.pool_pages.saturating_sub(v.out.reserve_pages)),
                ("reserve", v.out.reserve_pages),
            ],
            None => Vec::new(),
        },
    );
    f.per_export(
        "iopages_out_compound_blocks",
        "High-order blocks among the strategy's out pages.",
        Counter,
        |e| e.volume.as_ref().map(|v| v.out.compound_blocks),
    );
    f.per_export(
        "iopages_mempool_reserve_waits",
        "Sleeps of writers that found the out-page mempool's reserve empty.",
        Counter,
        |e| e.volume.as_ref().map(|v| v.out.waits),
    )
}

/// The server's connections: open, accepted, refused, sessions, TLS.
fn server(f: &mut Families<'_>, t: &Stats) {
    use Kind::{Counter, Gauge};
    f.one(
        "iopages_connections_open",
        "Connections open now (handshake or transmission, and those closing).",
        Gauge,
        t.open_connections,
    );
    f.one(
        "iopages_connections_parked",
        "Connections waiting for their client without a thread of their own (in the handshake, or in transmission between requests, partway through one or for room for replies).",
        Gauge,
        t.parked_connections,
    );
    f.one(
        "iopages_connections",
        "Connections accepted.",
        Counter,
        t.connections,
    );
    f.one(
        "iopages_connections_refused",
        "Connections refused because the connection limit was reached and the client's peer held its fair share.",
        Counter,
        t.refused_connections,
    );
    f.one(
        "iopages_sessions",
        "Connections that reached transmission.",
        Counter,
        t.sessions,
    );
    f.one(
        "iopages_tls_sessions",
        "Sessions upgraded to TLS.",
        Counter,
        t.tls_sessions,
    );
    f.one(
        "iopages_tls_failures",
        "TLS handshakes that failed.",
        Counter,
        t.tls_failures,
    );
    f.one(
        "iopages_reply_writes",
        "Socket writes that carried replies to clients (replies per write: requests over this).",
        Counter,
        t.reply_writes,
    )
}

/// The server's limits: connections closed on a deadline, the payload
/// byte budget.
fn server_limits(f: &mut Families<'_>, t: &Stats) {
    use Kind::{Counter, Gauge};
    f.family(
        "iopages_timeouts",
        "Connections closed on a deadline: handshake, reply not taken, payload not sent, idle.",
        Counter,
        [
            ("handshake", t.handshake_timeouts),
            ("reply", t.reply_timeouts),
            ("payload", t.payload_timeouts),
            ("idle", t.idle_closes),
        ]
        .into_iter()
        .map(|(k, v)| (vec![("kind", k.to_string())], v))
        .collect(),
    );
    f.one(
        "iopages_budget_used_bytes",
        "Payload bytes in flight now, over all connections.",
        Gauge,
        t.budget_used_bytes,
    );
    f.one(
        "iopages_budget_waits",
        "Requests that waited for the payload byte budget.",
        Counter,
        t.budget_waits,
    );
    f.one(
        "iopages_budget_refusals",
        "Requests answered ENOMEM because the byte budget stayed exhausted.",
        Counter,
        t.budget_refusals,
    )
}

/// A latency histogram in seconds: each bucket's bound and count, and
/// the sum.
fn histogram(h: &iopages_nbd::LatencyHist) -> Histogram {
    let buckets = (0..LATENCY_BUCKETS)
        .map(|k| {
            let le =
                iopages_nbd::latency_bucket_bound_us(k).map_or(f64::INFINITY, |us| us as f64 / 1e6);
            (le, h.buckets[k])
        })
        .collect();
    Histogram {
        buckets,
        sum: h.sum_seconds(),
    }
}

/// The families of remote stores, per export on one: reachability,
/// reconnects, re-sent requests, failures, round trips.
fn remotes(f: &mut Families<'_>) {
    use Kind::{Counter, Gauge};
    type Get = fn(&RemoteHealth) -> u64;
    let families: [(&'static str, &'static str, Kind, Get); 8] = [
        ("iopages_remote_reachable", "1 while at least one connection to the export's remote store serves; 0 while all of them reconnect.", Gauge, |r| r.reachable as u64),
        ("iopages_remote_connections", "Connections to the remote store serving now.", Gauge, |r| r.connected as u64),
        ("iopages_remote_reconnects", "Connections to the remote store made again after one died.", Counter, |r| r.reconnects),
        ("iopages_remote_resent_requests", "Requests sent again after the connection they went out on died before answering.", Counter, |r| r.resent),
        ("iopages_remote_started_requests", "Requests to the remote store started without a waiting thread (sent by the submitting thread, ended by the connection's reader).", Counter, |r| r.started),
        ("iopages_remote_deadline_failures", "Requests to the remote store failed for their deadline (sending, the reply, or no connection back in time).", Counter, |r| r.deadline_failures),
        ("iopages_remote_unreachable_failures", "Requests failed at once because the remote store stayed unreachable past reconnect-delay.", Counter, |r| r.unreachable_failures),
        ("iopages_remote_lost_flushes", "FLUSHes failed because a connection died holding acknowledged writes no FLUSH had covered.", Counter, |r| r.lost_flushes),
    ];
    for (name, help, ty, get) in families {
        f.per_export(name, help, ty, |e| {
            e.volume.as_ref().and_then(|v| v.remote.as_ref()).map(get)
        });
    }
    let samples =
        f.s.exports
            .iter()
            .filter_map(|e| {
                let r = e.volume.as_ref()?.remote.as_ref()?;
                Some((export_label(e), histogram(&r.round_trips)))
            })
            .collect();
    f.histograms(
        "iopages_remote_round_trip_seconds",
        "Time from sending a request to the remote store to its reply.",
        samples,
    );
}

/// The families of authenticated volumes, per export on one: reads
/// refused for a block that failed verification, those blocks, commits of
/// the tag tree, and blocks kept by a sweep after an unclean stop.
fn integrity(f: &mut Families<'_>) {
    use iopages_crypt::integrity::AuthStats;
    use Kind::Counter;
    type Get = fn(&AuthStats) -> u64;
    let families: [(&'static str, &'static str, Kind, Get); 6] = [
        ("iopages_integrity_failures", "Reads refused (EIO) because a block's tag or the tree above it did not verify: the store altered, moved or rolled back data.", Counter, |a| a.failures),
        ("iopages_integrity_bad_blocks", "4 KiB blocks that failed verification in those reads.", Counter, |a| a.bad_blocks),
        ("iopages_integrity_commits", "Commits of the tag tree (a FLUSH with writes since the last one).", Counter, |a| a.commits),
        ("iopages_integrity_recovered_blocks", "Blocks written after the last flush of an unclean stop whose data proved them, kept by the sweep at open.", Counter, |a| a.recovered),
        ("iopages_integrity_node_reads", "Tag blocks and tree nodes read from the store (cache misses and sweeps).", Counter, |a| a.node_reads),
        ("iopages_integrity_node_writes", "Tag blocks and tree nodes written to the store (one tag block per write through, nodes at commits and evictions).", Counter, |a| a.node_writes),
    ];
    for (name, help, ty, get) in families {
        f.per_export(name, help, ty, |e| {
            e.volume
                .as_ref()
                .and_then(|v| v.integrity.as_ref())
                .map(get)
        });
    }
}

/// The families of many tenants: how the limits are shared among peers
/// (aggregated, never a label per peer), who was refused an export, and
/// each export's state and rate limits.
fn tenants(f: &mut Families<'_>, t: &Stats) {
    use Kind::{Counter, Gauge};
    let p = &t.peers;
    for (name, help, ty, v) in [
        ("iopages_handshakes", "Connections in the handshake now (a pool of their own: --max-handshakes).", Gauge, p.handshakes_open),
        ("iopages_handshake_evictions", "Handshakes closed to admit a new connection to the full handshake pool (the least advanced of the peer holding the most).", Counter, p.handshake_evictions),
        ("iopages_share_evictions", "Connections in transmission closed so a peer under its fair share got its guarantee.", Counter, p.share_evictions),
        ("iopages_authorization_refusals", "Requests for an export refused by its allow rules (answered as an unknown export).", Counter, p.authorization_refusals),
        ("iopages_peers", "Peers (TLS identities, addresses, Unix uids) with a connection now.", Gauge, p.active),
        ("iopages_peers_at_share", "Peers holding at least their guaranteed share of connections or bytes now.", Gauge, p.at_share),
        ("iopages_budget_share_waits", "Requests of peers past their share that waited so a peer under its share went first.", Counter, p.budget_share_waits),
    ] {
        f.one(name, help, ty, v);
    }
    f.per_export(
        "iopages_export_open_failures",
        "Opens of a lazy export that failed (each retried on a request after a backoff of 1 s doubling to 60 s).",
        Counter,
        |e| Some(e.stats.export.open_failures),
    );
    f.per_export(
        "iopages_export_state",
        "0: lazy, not opened yet; 1: open; 2: its last open failed (retried after a backoff).",
        Gauge,
        |e| {
            e.state.map(|s| match s {
                iopages_nbd::ExportState::Closed => 0,
                iopages_nbd::ExportState::Open => 1,
                iopages_nbd::ExportState::Failed => 2,
            })
        },
    );
    f.per_export(
        "iopages_rate_limit_waits",
        "Requests that waited for the export's rate limits.",
        Counter,
        |e| Some(e.stats.export.rate_waits),
    );
    f.per_export(
        "iopages_rate_limit_bytes_per_second",
        "The export's byte rate limit (0: none).",
        Gauge,
        |e| Some(e.stats.export.rate_bytes_per_second),
    );
    f.per_export(
        "iopages_rate_limit_requests_per_second",
        "The export's request rate limit (0: none).",
        Gauge,
        |e| Some(e.stats.export.rate_requests_per_second),
    )
}

/// The snapshot as a body in `format`.
fn exposition(s: &Snapshot, format: Format) -> String {
    exposition::encode(&s.families(), format)
}

/// A response: status line, content type, body.
fn response(status: &str, content_type: &str, body: &[u8], extra: &str) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n{extra}\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn text(status: &str, body: &str) -> Vec<u8> {
    response(status, "text/plain; charset=utf-8", body.as_bytes(), "")
}

/// Where the request head ends (after its blank line), if it has.
fn head_end(b: &[u8]) -> Option<usize> {
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The reply to a whole request head.
fn answer(head: &[u8], source: &MetricsSource) -> Vec<u8> {
    let head = String::from_utf8_lossy(head);
    let mut lines = head.lines();
    let request_line = lines.next().unwrap_or("");
    let mut parts = request_line.split_ascii_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return text("400 Bad Request", "bad request\n");
    };
    if parts.next().is_some() || !version.starts_with("HTTP/1.") {
        return text("400 Bad Request", "bad request\n");
    }
    let path = target.split('?').next().unwrap_or("");
    let export = path.strip_prefix("/healthz/");
    if path != "/metrics" && path != "/healthz" && export.is_none() {
        return text("404 Not Found", "not found\n");
    }
    if method != "GET" {
        return response(
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            b"method not allowed\n",
            "Allow: GET\r\n",
        );
    }
    if path == "/healthz" || export.is_some() {
        return health(source, export);
    }
    let accepts = lines.filter_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("accept").then_some(v)
    });
    let format = Format::negotiate(accepts);
    let body = exposition(&source.snapshot(), format);
    response("200 OK", format.content_type(), body.as_bytes(), "")
}

/// Why an export does not serve now, if it does not: its remote store is
/// unreachable, or its last open failed.
fn unhealthy(e: &ExportSnapshot) -> Option<String> {
    if let Some(r) = e.volume.as_ref().and_then(|v| v.remote.as_ref()) {
        if !r.reachable {
            let why = r.last_error.as_deref().unwrap_or("no connection");
            return Some(format!(
                "its remote store is unreachable (for {:.1} s): {why}",
                r.down_seconds
            ));
        }
    }
    (e.state == Some(iopages_nbd::ExportState::Failed))
        .then(|| "its volume failed to open (retried after a backoff)".to_string())
}

/// `/healthz` (`export` `None`): 200 while every export serves, else 503
/// naming the exports that do not and why; `/healthz/EXPORT` (the name
/// %-escaped): 200 while that export serves, 503 while it does not, 404
/// for no such export. 503 for all while the server stops.
fn health(source: &MetricsSource, export: Option<&str>) -> Vec<u8> {
    if !source.server.is_serving() {
        return text("503 Service Unavailable", "stopping\n");
    }
    let snap = source.snapshot();
    let Some(name) = export else {
        let bad: Vec<String> = snap
            .exports
            .iter()
            .filter_map(|e| unhealthy(e).map(|why| format!("{:?}: {why}", e.name)))
            .collect();
        return match bad.is_empty() {
            true => text("200 OK", "ok\n"),
            false => text(
                "503 Service Unavailable",
                &format!("unhealthy: {}\n", bad.join("; ")),
            ),
        };
    };
    let Ok(name) = iopages_nbd::remote::percent_decode(name) else {
        return text("400 Bad Request", "bad %-escape in the export name\n");
    };
    match snap.exports.iter().find(|e| e.name == name) {
        None => text("404 Not Found", "no such export\n"),
        Some(e) => match unhealthy(e) {
            None => text("200 OK", "ok\n"),
            Some(why) => text("503 Service Unavailable", &format!("{why}\n")),
        },
    }
}

/// One client of the endpoint.
struct Client {
    stream: TcpStream,
    head: Vec<u8>,
    /// The reply, once the head is whole, and how much of it is sent.
    reply: Option<(Vec<u8>, usize)>,
    /// The reply is sent and our side shut: reading what the client still
    /// sends until it closes (so the reply is not lost to a reset).
    draining: bool,
    /// Bytes read after the head and dropped.
    dropped: usize,
    deadline: Instant,
}

enum Step {
    Keep,
    Close,
}

impl Client {
    /// Take what the socket has.
    fn readable(&mut self, source: &MetricsSource) -> Step {
        let mut buf = [0u8; 4096];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return Step::Close,
                Ok(n) => {
                    if self.draining || self.reply.is_some() {
                        // After the head: dropped, up to a bound (a client
                        // that keeps sending is closed).
                        self.dropped += n;
                        if self.dropped > MAX_DROPPED_BYTES {
                            return Step::Close;
                        }
                        continue;
                    }
                    self.head.extend_from_slice(&buf[..n]);
                    if let Some(end) = head_end(&self.head) {
                        let r = answer(&self.head[..end], source);
                        self.head = Vec::new();
                        return self.send(r);
                    }
                    if self.head.len() > MAX_HEAD_BYTES {
                        self.head = Vec::new();
                        return self.send(text(
                            "431 Request Header Fields Too Large",
                            "request head too large\n",
                        ));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Step::Close,
            }
        }
    }

    fn send(&mut self, reply: Vec<u8>) -> Step {
        self.reply = Some((reply, 0));
        self.deadline = Instant::now() + CLIENT_TIMEOUT;
        self.writable()
    }

    /// Send what the socket takes of the reply.
    fn writable(&mut self) -> Step {
        let Some((r, sent)) = &mut self.reply else {
            return Step::Keep;
        };
        while *sent < r.len() {
            match self.stream.write(&r[*sent..]) {
                Ok(0) => return Step::Close,
                Ok(n) => *sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Step::Close,
            }
        }
        if !self.draining {
            self.draining = true;
            let _ = self.stream.shutdown(Shutdown::Write);
            // A second at most for the client to close its side.
            self.deadline = Instant::now() + Duration::from_secs(1);
        }
        Step::Keep
    }

    fn wants_write(&self) -> bool {
        !self.draining && self.reply.as_ref().is_some_and(|(r, s)| *s < r.len())
    }
}

/// The running endpoint; [`MetricsServer::stop`] ends it.
pub struct MetricsServer {
    addr: SocketAddr,
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listen on `addr` and serve `source` from a thread of its own.
    ///
    /// **Returns:** the error of binding `addr`, or of starting the
    /// thread.
    pub fn start(addr: SocketAddr, source: Arc<MetricsSource>) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (wake, woken) = UnixStream::pair()?;
        woken.set_nonblocking(true)?;
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || serve_loop(listener, woken, &source))?;
        Ok(MetricsServer {
            addr,
            wake,
            thread: Some(thread),
        })
    }

    /// The address served (the port resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close every client and join the thread.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.wake.write_all(&[1]);
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The endpoint's thread: wait on the wake-up socket, the listener and
/// every client, serve what is ready, until woken (or `poll` fails).
fn serve_loop(listener: TcpListener, woken: UnixStream, source: &MetricsSource) {
    let mut clients: Vec<Client> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        let now = Instant::now();
        clients.retain(|c| c.deadline > now);
        let timeout_ms = clients
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min()
            .map_or(-1, |d| d.as_millis().clamp(1, 60_000) as i32);
        poll_set(&mut fds, &woken, &listener, &clients);
        if let Err(e) = crate::sys::poll(&mut fds, timeout_ms) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // poll itself failed: nothing sensible to do but stop serving
            // metrics (the NBD server goes on).
            eprintln!("metrics: poll failed: {e}");
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        // The clients first (their indexes match `fds[2..]`), then new
        // ones.
        serve_clients(&mut clients, &fds[2..], source);
        if fds[1].revents != 0 {
            accept_clients(&listener, &mut clients);
        }
    }
}

/// What to wait for: the wake-up socket, the listener, then each client
/// (its reply to send, else its request to read), in that order.
fn poll_set(
    fds: &mut Vec<libc::pollfd>,
    woken: &UnixStream,
    listener: &TcpListener,
    clients: &[Client],
) {
    fds.clear();
    let fd = |fd: i32, events: i16| libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    fds.push(fd(woken.as_raw_fd(), libc::POLLIN));
    fds.push(fd(listener.as_raw_fd(), libc::POLLIN));
    for c in clients {
        let ev = if c.wants_write() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        };
        fds.push(fd(c.stream.as_raw_fd(), ev));
    }
}

/// Serve each client what `poll` found ready (`ready[i]` is
/// `clients[i]`'s entry), closing those that are done or failed.
fn serve_clients(clients: &mut Vec<Client>, ready: &[libc::pollfd], source: &MetricsSource) {
    let mut i = 0;
    for p in ready {
        let rev = p.revents;
        let step = if rev & (libc::POLLERR | libc::POLLNVAL) != 0 {
            Step::Close
        } else if rev & libc::POLLOUT != 0 {
            clients[i].writable()
        } else if rev & (libc::POLLIN | libc::POLLHUP) != 0 {
            clients[i].readable(source)
        } else {
            Step::Keep
        };
        match step {
            Step::Keep => i += 1,
            Step::Close => {
                clients.remove(i);
            }
        }
    }
}

/// Take every connection waiting on the listener, the oldest client
/// closed for each one past [`MAX_CONNECTIONS`].
fn accept_clients(listener: &TcpListener, clients: &mut Vec<Client>) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if clients.len() >= MAX_CONNECTIONS {
                    // The oldest goes: a client that only holds a
                    // connection open cannot keep scrapes out.
                    clients.remove(0);
                }
                clients.push(Client {
                    stream,
                    head: Vec::new(),
                    reply: None,
                    draining: false,
                    dropped: 0,
                    deadline: Instant::now() + CLIENT_TIMEOUT,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // Out of descriptors, a connection reset before it was
            // taken, …: try again on the next wake-up (after a pause, so
            // a persistent error does not spin).
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_end_finds_the_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n"), None);
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nrest"), Some(16));
        assert_eq!(head_end(b""), None);
    }

    /// A snapshot of one export, `a"b`, on a remote store, after three
    /// writes.
    fn one_export() -> Snapshot {
        let mut st = Stats::default();
        st.write.requests = 3;
        st.write.bytes = 3 << 20;
        st.latency.write.buckets[3] = 2;
        st.latency.write.buckets[LATENCY_BUCKETS - 1] = 1;
        st.latency.write.sum_ns = 20_000_000_000;
        Snapshot {
            total: st,
            exports: vec![ExportSnapshot {
                name: "a\"b".into(),
                stats: st,
                open: true,
                state: Some(iopages_nbd::ExportState::Open),
                volume: Some(VolumeStats {
                    arena_pages: 10,
                    arena_pages_in_use: 4,
                    out: OutStats {
                        direct_pages: 5,
                        pool_pages: 3,
                        reserve_pages: 1,
                        ..OutStats::default()
                    },
                    remote: Some(RemoteHealth {
                        connected: 3,
                        connections: 4,
                        reachable: true,
                        reconnects: 2,
                        resent: 5,
                        lost_flushes: 1,
                        round_trips: {
                            let mut h = iopages_nbd::LatencyHist::default();
                            h.buckets[3] = 2;
                            h.sum_ns = 15_000;
                            h
                        },
                        ..RemoteHealth::default()
                    }),
                    integrity: Some(iopages_crypt::integrity::AuthStats {
                        failures: 2,
                        bad_blocks: 3,
                        ..Default::default()
                    }),
                }),
            }],
        }
    }

    #[test]
    fn the_exposition_has_histograms_with_cumulative_buckets() {
        let t = exposition(&one_export(), Format::Text004);
        for want in [
            "iopages_write_bytes_total{export=\"a\\\"b\"} 3145728",
            "iopages_requests_total{export=\"a\\\"b\",command=\"write\"} 3",
            "iopages_request_duration_seconds_bucket{export=\"a\\\"b\",command_class=\"write\",le=\"0.000004\"} 0",
            "iopages_request_duration_seconds_bucket{export=\"a\\\"b\",command_class=\"write\",le=\"0.000008\"} 2",
            "iopages_request_duration_seconds_bucket{export=\"a\\\"b\",command_class=\"write\",le=\"+Inf\"} 3",
            "iopages_request_duration_seconds_count{export=\"a\\\"b\",command_class=\"write\"} 3",
            "iopages_request_duration_seconds_sum{export=\"a\\\"b\",command_class=\"write\"} 20.0",
            "iopages_out_pages_total{export=\"a\\\"b\",source=\"mempool\"} 2",
            "iopages_export_open{export=\"a\\\"b\"} 1",
            "iopages_connections_open 0",
            "iopages_timeouts_total{kind=\"idle\"} 0",
            "iopages_remote_reachable{export=\"a\\\"b\"} 1",
            "iopages_remote_connections{export=\"a\\\"b\"} 3",
            "iopages_remote_reconnects_total{export=\"a\\\"b\"} 2",
            "iopages_remote_resent_requests_total{export=\"a\\\"b\"} 5",
            "iopages_remote_lost_flushes_total{export=\"a\\\"b\"} 1",
            "iopages_integrity_failures_total{export=\"a\\\"b\"} 2",
            "iopages_integrity_bad_blocks_total{export=\"a\\\"b\"} 3",
            "iopages_remote_round_trip_seconds_bucket{export=\"a\\\"b\",le=\"0.000008\"} 2",
            "iopages_remote_round_trip_seconds_count{export=\"a\\\"b\"} 2",
        ] {
            assert!(t.lines().any(|l| l == want), "{want} missing from:\n{t}");
        }
    }

    #[test]
    fn each_format_describes_counters_its_own_way() {
        let s = one_export();
        // 0.0.4: by the samples' name, no # EOF.
        let t = exposition(&s, Format::Text004);
        assert!(t.contains("\n# TYPE iopages_write_bytes_total counter\n"));
        assert!(!t.contains("# TYPE iopages_write_bytes counter"));
        assert!(!t.contains("# EOF"));
        // OpenMetrics: by the family's, # EOF at the end.
        let om = exposition(&s, Format::OpenMetrics);
        assert!(om.contains("\n# TYPE iopages_write_bytes counter\n"));
        assert!(om.ends_with("\n# EOF\n"));
    }
}
