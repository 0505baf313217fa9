//! The volumes `iopages serve` serves: opening them (an image file or
//! block device, a remote NBD export, the in-memory volume), the exports
//! of a `--config` file, and what the statistics and the final flush need
//! of every volume opened so far.
//!
//! Owns: reading each export's passphrase at start (a file, a systemd
//! credential, or a prompt), opening volumes one after another at start
//! (never two key derivations at once) or handing the server an opener
//! for a lazy export, and the list of opened volumes. Must never: serve
//! an export whose volume failed to open, or drop one that opened without
//! it being flushed at stop (it stays in the list).

use crate::config::{self, ExportSpec, ImageSpec, IoMode, PassphraseSource, ServeConfig, Unlock};
use crate::defaults::DEFAULT_INLINE_MAX_BYTES;
use crate::passphrase::read_passphrase;
use crate::signals::{self, SignalSet};
use iopages_crypt::uring::DirectIo;
use iopages_nbd::remote::{NbdRemote, RemoteOptions, RemoteSpec};
use iopages_nbd::volume::{self, Volume, VolumeOptions};
use iopages_nbd::{Export, ExportConfig, ExportVolume};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use zeroize::Zeroizing;

/// An opened volume and the export it serves.
pub struct Served {
    /// The export's name.
    pub name: String,
    /// The volume.
    pub vol: Volume,
    /// Opened read-only (nothing to flush at stop).
    pub read_only: bool,
}

/// The volumes opened so far, in the order they opened (lazy exports join
/// when their first client opens them).
pub type Volumes = Arc<Mutex<Vec<Served>>>;

/// Open the image `image` (a path, or an `nbd://` / `nbd+unix://` URI of
/// a remote export holding it, `nbds://` / `nbds+unix://` over TLS) with
/// `pass`; a remote's requests wait `reconnect` (else the URI's
/// `reconnect-delay=`, else 10 s) for its store to come back.
///
/// **Context:** derives the key (seconds, bounded by the KDF limits).
/// **Returns:** the error, naming the image.
pub fn open_image(
    image: &ImageSpec,
    pass: &[u8],
    opts: &VolumeOptions,
    reconnect: Option<Duration>,
) -> Result<Volume, String> {
    match image {
        ImageSpec::Path(p) => volume::open_image(p, pass, opts).map_err(|e| {
            let m = e.to_string();
            if m.contains("ambiguous signatures") {
                format!("{m} [--allow-secondary-header serves the old volume on purpose]")
            } else {
                m
            }
        }),
        ImageSpec::Nbd(uri) => {
            let mut spec = RemoteSpec::parse(uri).map_err(|e| format!("{uri}: {e}"))?;
            if reconnect.is_some() {
                spec.reconnect_delay = reconnect;
            }
            let remote = NbdRemote::connect(
                &spec,
                &RemoteOptions {
                    read_only: opts.read_only,
                    ..RemoteOptions::default()
                },
            )
            .map_err(|e| format!("cannot reach the remote store {uri}: {e}"))?;
            let remote = Arc::new(remote);
            let mut vol =
                volume::open_remote(uri, remote.clone(), pass, opts).map_err(|e| e.to_string())?;
            vol.remote = Some(remote);
            Ok(vol)
        }
    }
}

/// What an `--image` argument names: an NBD URI (`nbd://`, `nbd+unix://`,
/// or over TLS `nbds://`, `nbds+unix://`), or a path.
pub fn image_spec(arg: &Path) -> ImageSpec {
    let s = arg.to_string_lossy();
    // Any nbd…:// scheme: the URI parser names what is wrong with others.
    let scheme = s.split_once("://").map(|(x, _)| x.to_ascii_lowercase());
    if scheme.is_some_and(|x| x.starts_with("nbd")) {
        ImageSpec::Nbd(s.into_owned())
    } else {
        ImageSpec::Path(arg.to_path_buf())
    }
}

/// Run `f` (a volume's opening) on its own thread while this one watches
/// for SIGINT and SIGTERM, which stop the process at once (nothing has
/// been written yet).
pub fn open_watched<T: Send + 'static>(
    signals: &SignalSet,
    what: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let opening = std::thread::Builder::new()
        .name("open-volume".into())
        .spawn(f)
        .map_err(|e| format!("cannot start the thread that opens {what}: {e}"))?;
    while !opening.is_finished() {
        if let Some(sig) = signals::wait_signal(signals, Some(Duration::from_millis(50))) {
            if signals::stops_opening(sig) {
                eprintln!(
                    "signal {}: stopped while opening {what} (nothing was written)",
                    signals::stop_name(sig)
                );
                std::process::exit(128 + sig);
            }
        }
    }
    opening
        .join()
        .map_err(|_| format!("the thread that opens {what} panicked"))?
}

/// The description clients see for a volume.
pub fn description(vol: &Volume) -> String {
    format!(
        "iopages {} volume ({})",
        match vol.info.version {
            iopages_crypt::luks::LuksVersion::Luks1 => "LUKS1",
            iopages_crypt::luks::LuksVersion::Luks2 => "LUKS2",
        },
        vol.info.cipher
    )
}

/// The inline size a volume is served with when none is given: small
/// requests on the connection's thread for memory and the page cache,
/// never for O_DIRECT or a remote image (whose requests wait on the
/// device or the network, which only the workers overlap).
pub fn default_inline(vol: &Volume) -> u32 {
    if vol.file.as_ref().is_some_and(|f| !f.direct_io()) {
        DEFAULT_INLINE_MAX_BYTES
    } else {
        0
    }
}

/// Settings every export of a `--config` file shares, from the command
/// line.
pub struct Common {
    /// The out-page strategy, handshake timeout and the like.
    pub base: VolumeOptions,
    /// The handshake deadline of every export.
    pub handshake_timeout: Duration,
    /// A bad export stops the start (`--strict` or the file's `strict`).
    pub strict: bool,
}

/// An export of the file, ready to open: its settings and passphrase.
struct Planned {
    spec: ExportSpec,
    opts: VolumeOptions,
    pass: Zeroizing<Vec<u8>>,
    config: ExportConfig,
}

fn passphrase(spec: &ExportSpec) -> Result<Zeroizing<Vec<u8>>, String> {
    match &spec.passphrase {
        PassphraseSource::File(p) => read_passphrase(p),
        PassphraseSource::Credential(name) => read_passphrase(&config::read_credential(name)?),
        PassphraseSource::Prompt => {
            eprintln!("passphrase for export {:?}:", spec.name);
            read_passphrase(Path::new("-"))
        }
    }
}

fn plan(spec: &ExportSpec, c: &Common) -> Result<Planned, String> {
    let mut opts = c.base.clone();
    opts.arena_bytes = spec.arena_bytes;
    opts.read_only = spec.read_only;
    opts.allow_discards = spec.allow_discards;
    opts.freshness.state = spec.freshness.clone();
    opts.direct = match spec.io {
        IoMode::Auto => DirectIo::Auto,
        IoMode::Direct => DirectIo::Require,
        IoMode::Buffered => DirectIo::Off,
    };
    opts.workers = spec.workers;
    opts.kdf_limits = crate::luks_kdf::kdf_limits(spec.max_kdf_memory);
    let mut config = ExportConfig::new(spec.name.clone());
    config.read_only = spec.read_only;
    config.handshake_timeout = c.handshake_timeout;
    config.allow = spec.allow.clone();
    config.rate = spec.rate;
    if let Some(d) = &spec.description {
        config.description = d.clone();
    }
    Ok(Planned {
        pass: passphrase(spec)?,
        spec: spec.clone(),
        opts,
        config,
    })
}

/// The export a planned volume becomes once open (its inline size and,
/// unless the file gives one, its description from the volume).
fn ready(p: &Planned, vol: &Volume) -> (ExportConfig, ExportVolume) {
    let mut config = p.config.clone();
    config.inline_max_bytes = p.spec.inline_max.unwrap_or_else(|| default_inline(vol));
    if p.spec.description.is_none() {
        config.description = description(vol);
    }
    (config, ExportVolume::new(Arc::clone(&vol.queue)))
}

/// The exports of `cfg`: each opened now, one after another (`unlock =
/// "start"`), or handed to the server to open on first use (`"lazy"`).
/// Passphrases are read now in both cases, so a missing file is reported
/// at start.
///
/// **Returns:** the exports to serve; with `strict`, the first bad one's
/// error; without, an error only when no export is left (each bad one is
/// reported on standard error, naming it).
pub fn from_config(
    cfg: &ServeConfig,
    c: &Common,
    signals: &SignalSet,
    volumes: &Volumes,
) -> Result<Vec<Export>, String> {
    let mut exports = Vec::with_capacity(cfg.exports.len());
    for spec in &cfg.exports {
        let planned = match plan(spec, c) {
            Ok(p) => p,
            Err(e) if c.strict => return Err(where_(spec, &e)),
            Err(e) => {
                eprintln!("{}; not served", where_(spec, &e));
                continue;
            }
        };
        match cfg.server.unlock {
            Unlock::Start => match open_now(planned, signals, volumes) {
                Ok(export) => exports.push(export),
                Err(e) if c.strict => return Err(where_(spec, &e)),
                Err(e) => eprintln!("{}; not served", where_(spec, &e)),
            },
            Unlock::Lazy => exports.push(open_lazily(planned, volumes)),
        }
    }
    if exports.is_empty() {
        return Err("no export of the configuration could be served".into());
    }
    Ok(exports)
}

/// An export's error as reported: its name and the line of its
/// `[[export]]`.
fn where_(spec: &ExportSpec, e: &str) -> String {
    format!("export {:?} (line {}): {e}", spec.name, spec.line)
}

/// `unlock = "start"`: open the planned volume now (watching for
/// signals), list it among the opened volumes, and serve it ready.
fn open_now(planned: Planned, signals: &SignalSet, volumes: &Volumes) -> Result<Export, String> {
    let spec = &planned.spec;
    let (image, pass, opts) = (
        spec.image.clone(),
        planned.pass.clone(),
        planned.opts.clone(),
    );
    let what = format!("export {:?}", spec.name);
    let reconnect = spec.reconnect_delay;
    let open = move || open_image(&image, &pass, &opts, reconnect);
    let vol = open_watched(signals, &what, open)?;
    let (config, volume) = ready(&planned, &vol);
    volumes.lock().push(Served {
        name: spec.name.clone(),
        vol,
        read_only: spec.read_only,
    });
    Ok(Export::ready(config, volume))
}

/// `unlock = "lazy"`: an export the server opens on its first client's
/// request, listing the volume among the opened ones then.
fn open_lazily(planned: Planned, volumes: &Volumes) -> Export {
    let volumes = Arc::clone(volumes);
    let spec = &planned.spec;
    // Advertised before the volume is open: the inline size cannot wait
    // to see whether O_DIRECT is taken, so only an explicitly buffered
    // image file is served inline.
    let mut config = planned.config.clone();
    let buffered_file = spec.io == IoMode::Buffered && matches!(spec.image, ImageSpec::Path(_));
    config.inline_max_bytes = spec.inline_max.unwrap_or(if buffered_file {
        DEFAULT_INLINE_MAX_BYTES
    } else {
        0
    });
    Export::lazy(
        config,
        Box::new(move || {
            let p = &planned;
            let vol = open_image(&p.spec.image, &p.pass, &p.opts, p.spec.reconnect_delay)?;
            let (_, volume) = ready(&planned, &vol);
            volumes.lock().push(Served {
                name: planned.spec.name.clone(),
                vol,
                read_only: planned.spec.read_only,
            });
            Ok(volume)
        }),
    )
}
