//! `iopages serve`: an encrypted volume over NBD until a signal stops it.
//!
//! Owns: the order of a server's life, one step per function: the
//! command line and the `--config` file are checked (`args.rs`), the
//! listening addresses chosen (socket activation's first), the signals
//! blocked, the volumes opened (an in-memory LUKS2 volume, a LUKS image
//! opened with a passphrase, or a file's exports — `served`), the server
//! and `--metrics` started, then signals served until one stops it:
//! SIGUSR1 prints statistics, SIGINT, SIGTERM and SIGHUP stop the server
//! cleanly (requests in flight complete, every image is flushed, totals
//! printed). What it prints is `report.rs`'s, the `--stats-json` file
//! `stats_json.rs`'s.
//!
//! | file | owns |
//! |---|---|
//! | `args.rs` | [`ServeArgs`], the checks between flags, the options they become |
//! | `report.rs` | the start-up lines and the statistics line |
//! | `stats_json.rs` | the `--stats-json` document and its atomic replacement |
//!
//! Must never: exit with acknowledged writes unflushed.

mod args;
mod report;
mod stats_json;

pub use args::ServeArgs;

use crate::config::ServeConfig;
use crate::passphrase::read_passphrase;
use crate::served::{self, Served, Volumes};
use crate::signals::{self, SignalSet};
use iopages_nbd::volume::{self, VolumeOptions};
use iopages_nbd::{Export, ExportConfig, ExportVolume, Listen, Listener, Server};
use report::Progress;
use stats_json::StatsJson;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `iopages serve`: check the arguments, block the signals, open the
/// volumes and start serving, serve until a stopping signal, then stop.
///
/// **Returns:** the first error of the start (a flag, the file, a volume,
/// a socket), or at stop a failed final flush naming the exports.
pub fn serve(a: ServeArgs) -> Result<(), String> {
    let cfg = match &a.config {
        Some(p) => Some(crate::config::load(p).map_err(|e| e.to_string())?),
        None => None,
    };
    // Sockets passed by systemd (socket activation) replace the default
    // address; --listen and --unix are served beside them. Taken first,
    // before any thread starts (it edits the environment).
    let inherited = crate::activation::inherited_listeners()?.unwrap_or_default();
    let listen = listen_addresses(&a, cfg.as_ref(), &inherited)?;
    // Everything served, inherited sockets included (the plaintext check).
    let served = crate::activation::with_addresses(&listen, &inherited)?;
    let size = args::check_volume_flags(&a)?;
    let server_opts = args::server_options(&a, &served, cfg.as_ref().map(|c| &c.server))?;
    if a.handshake_timeout == 0 {
        return Err("--handshake-timeout must be at least 1 second".into());
    }
    check_open_files(server_opts.max_connections + server_opts.max_handshakes);
    let signals = signals::block_signals();
    let opts = args::volume_options(&a);
    let volumes: Volumes = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let tls = server_opts.tls.as_ref().map(|t| (t.mode(), t.kind()));
    let (exports, generated) = open_exports(&a, cfg.as_ref(), size, opts, &signals, &volumes)?;
    let names: Vec<String> = exports.iter().map(|e| e.name().to_string()).collect();
    let server = Server::start_exports_on(exports, server_opts, &listen, inherited)
        .map_err(|e| e.to_string())?;
    let metrics = start_metrics(&a, cfg.as_ref(), &server, &volumes)?;
    for s in volumes.lock().iter() {
        report::print_volume(s, cfg.is_some());
    }
    let shown = generated.as_ref().map(|p| p.as_str());
    report::print_serving(&server, &names, shown, tls, a.stats_interval);
    flush_stdout();
    drop(generated);
    run(&a, server, metrics, &signals, &volumes)
}

/// Raise the open files limit as far as allowed, and say so when it is
/// still short of what `connections` open at once need (two descriptors
/// each, and some for the volumes and listeners): the server still
/// starts, and a connection over the limit is refused at `accept`.
fn check_open_files(connections: usize) {
    let need = 2 * connections as u64 + 64;
    match crate::sys::raise_open_files() {
        Ok(have) if have < need => eprintln!(
            "iopages: warning: {connections} connections at once need about {need} open files; the limit is {have} (ulimit -n, LimitNOFILE=)"
        ),
        Ok(_) => {}
        Err(e) => eprintln!("iopages: warning: cannot read the open files limit: {e}"),
    }
}

/// Where to listen: `--listen` and `--unix`; else the file's `listen`
/// and `unix`; else, when no socket was inherited either, the default
/// address.
fn listen_addresses(
    a: &ServeArgs,
    cfg: Option<&ServeConfig>,
    inherited: &[Listener],
) -> Result<Vec<Listen>, String> {
    let mut listen = Vec::new();
    if let Some(addr) = a.listen {
        listen.push(Listen::Tcp(addr));
    }
    if let Some(p) = &a.unix {
        listen.push(Listen::Unix(p.clone()));
    }
    if let (true, Some(c)) = (listen.is_empty(), cfg) {
        listen.extend(c.server.listen.iter().map(|&a| Listen::Tcp(a)));
        listen.extend(c.server.unix.iter().map(|p| Listen::Unix(p.clone())));
    }
    if listen.is_empty() && inherited.is_empty() {
        let addr = iopages_nbd::DEFAULT_LISTEN
            .parse()
            .map_err(|e| format!("bad default address: {e}"))?;
        listen.push(Listen::Tcp(addr));
    }
    Ok(listen)
}

/// The exports to serve: the file's (opened now or on first use), or the
/// command line's one volume with, for the in-memory volume, its
/// generated passphrase.
fn open_exports(
    a: &ServeArgs,
    cfg: Option<&ServeConfig>,
    size: u64,
    opts: VolumeOptions,
    signals: &SignalSet,
    volumes: &Volumes,
) -> Result<(Vec<Export>, Option<zeroize::Zeroizing<String>>), String> {
    match cfg {
        Some(cfg) => {
            let common = served::Common {
                base: opts,
                handshake_timeout: Duration::from_secs(a.handshake_timeout),
                strict: a.strict || cfg.server.strict,
            };
            let e = served::from_config(cfg, &common, signals, volumes)?;
            Ok((e, None))
        }
        None => {
            let (e, generated) = single_export(a, size, opts, signals, volumes)?;
            Ok((vec![e], generated))
        }
    }
}

/// The one volume of a command line without --config: an --image (a
/// file, block device or NBD URI) or the in-memory volume, opened now.
/// Returns its export and, for the in-memory volume, the generated
/// passphrase (shown once).
fn single_export(
    a: &ServeArgs,
    size: u64,
    opts: VolumeOptions,
    signals: &SignalSet,
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

/// `--metrics`, or the file's `metrics`: every export, its volume once
/// open (lazy ones when their first client opens them). `None` when
/// neither asks for it.
fn start_metrics(
    a: &ServeArgs,
    cfg: Option<&ServeConfig>,
    server: &Server,
    volumes: &Volumes,
) -> Result<Option<crate::metrics::MetricsServer>, String> {
    let Some(addr) = a.metrics.or_else(|| cfg.and_then(|c| c.server.metrics)) else {
        return Ok(None);
    };
    let source = crate::metrics::MetricsSource::new(server.stats_handle());
    let listed = Arc::clone(volumes);
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
    Ok(Some(m))
}

/// Serve until a stopping signal, printing statistics on SIGUSR1 and
/// every `--stats-interval`, then stop.
///
/// **Returns:** the first `--stats-json` error before serving (the
/// server is shut down), or [`stop`]'s result.
fn run(
    a: &ServeArgs,
    server: Server,
    metrics: Option<crate::metrics::MetricsServer>,
    signals: &SignalSet,
    volumes: &Volumes,
) -> Result<(), String> {
    let now = Instant::now();
    let mut progress = Progress::new(a.max_connections, a.max_inflight, now);
    // --stats-json: written now (a path that cannot be written is an
    // error before anything is served for long), then with every line.
    let mut json = StatsJson::new(a.stats_json.clone(), now);
    if let Err(e) = json.emit(&server) {
        drop(metrics);
        server.shutdown();
        return Err(e);
    }
    let interval = (a.stats_interval > 0).then(|| Duration::from_secs(a.stats_interval));
    loop {
        match signals::wait_signal(signals, interval) {
            None | Some(libc::SIGUSR1) => {
                println!("{}", progress.line(&server, &volumes.lock()));
                if let Err(e) = json.emit(&server) {
                    eprintln!("warning: {e} (statistics go on on standard output)");
                }
            }
            Some(sig) => {
                println!(
                    "signal {}: stopping (requests in flight complete first)",
                    signals::stop_name(sig)
                );
                break;
            }
        }
        flush_stdout();
    }
    if let Some(m) = metrics {
        m.stop();
    }
    stop(server, progress, json, volumes)
}

/// Stop serving, print the last statistics, and flush every volume
/// opened, lazy ones included.
///
/// **Returns:** the error naming every export whose final flush failed.
fn stop(
    mut server: Server,
    mut progress: Progress,
    mut json: StatsJson,
    volumes: &Volumes,
) -> Result<(), String> {
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
    if let Err(e) = json.emit(&server) {
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

/// Standard output now, so the lines reach a pipe as they are printed.
fn flush_stdout() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
}
